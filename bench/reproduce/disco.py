"""DiSCo (device-server cooperative text streaming): Table 2 (P99 TTFT against stochastic dispatching),
Fig. 6 (mean and P99 TTFT against the budget), Fig. 7 (migration's cost cut), Table 3 (migrated
requests: delayed tokens and TBT P99) and Fig. 9 (the policy's computation time).

Trace-driven, as the paper's Sec. 5.1: bench/disco_sweep.py replays 1,000 Alpaca-like requests a seed
against each service's TTFT distribution and each phone's measured rates in virtual time (four traces,
three devices, both regimes, b = 0, 0.1, ..., 1, with and without migration). Its server TTFTs are our
lognormal reading of Sec. 3 (no trace is published); bench/disco_engine.py measures them instead on our
own serving engine under load (Llama-2-70B's step times on 4 x A100, fcfs, one replica at a busy rate),
scaled to each trace's typical TTFT, and runs the same sweep on them. Live on the emulated testbed
(bench/disco_campaign.py: examples/campaigns/disco-budget.yaml and disco-migration.yaml): each device
races its own endpoint (paced to the phone) against the server's trace endpoint over the data plane.
"""

from __future__ import annotations

from collections.abc import Callable

from analysis.uncertainty import Interval
from bench.disco_sweep import PAPER_TABLE2
from bench.reproduce.registry import CAMPAIGN_CODE, Experiment, Headline, Paper, Result

WORK = "/var/tmp/hil-testbed-reproduce"
DEVICES = ("pixel7pro-bloom-1.1b", "pixel7pro-bloom-560m", "xiaomi14-qwen-0.5b")
DEVICE_NAMES = {"pixel7pro-bloom-1.1b": "Pixel 7 Pro B-1.1B", "pixel7pro-bloom-560m": "Pixel 7 Pro B-560M",
                "xiaomi14-qwen-0.5b": "Xiaomi 14 Q-0.5B"}  # fmt: skip
TRACES = {"gpt": "GPT", "llama": "LLaMA", "deepseek": "DeepSeek", "command": "Command"}
REGIMES = {"server": "server-constrained", "device": "device-constrained"}

# DiSCo Table 2 (average P99 TTFT reduction against Stoch over the budget range, %, devices as DEVICES):
# the sweep's own copy, which it also prints beside its cells
TABLE2 = PAPER_TABLE2
# DiSCo Table 3: mean delay_num of migrated requests (tokens) per trace and regime; TBT P99 (s) per regime
TABLE3_DELAY = {
    ("gpt", "server"): 4.21, ("gpt", "device"): 6.59, ("llama", "server"): 5.53, ("llama", "device"): 10.01,
    ("deepseek", "server"): 8.13, ("deepseek", "device"): 17.17, ("command", "server"): 3.25,
    ("command", "device"): 8.54,
}  # fmt: skip
TABLE3_TBT_P99_S = {"server": 0.209, "device": 0.217}
# DiSCo Fig. 9 (Sec. 5.3, on an M1): the policy's computation time, ms, at 1K / 10K / 100K samples
FIG9_MS = {"disco-s": (0.128, 0.969, 9.082), "disco-d": (0.486, 1.741, 14.856)}
FIG9_SAMPLES = (1_000, 10_000, 100_000)

SWEEP_CODE = ("nodes/dispatch", "nodes/endpoints")
ENGINE_CODE = (*SWEEP_CODE, "nodes/workers", "nodes/serving", "nodes/inference", "nodes/contracts", "testbed/target",
               "examples/profiles/a100-80gb.yaml", "examples/models/tiny")  # fmt: skip
BUDGET_CAMPAIGN, MIGRATION_CAMPAIGN = "examples/campaigns/disco-budget.yaml", "examples/campaigns/disco-migration.yaml"
PREMISE = "bench/disco_gpu_premise.py"
PREMISE_CODE = ("nodes/contracts", "nodes/endpoints", "nodes/inference", "nodes/server", "nodes/telemetry",
                "examples/models/tiny")  # fmt: skip
SERVER, DEVICE = ("--config", "server:cuda:1b"), ("--config", "device:cpu:tiny")
CAMPAIGN_RUN = (*CAMPAIGN_CODE, "inventory.yaml", "examples/models/tiny")


def _budget_matrix(services: str, budgets: str) -> tuple[str, ...]:
    """disco-budget.yaml's matrix with these services and budgets (its four policies kept)."""
    return "--set", f"matrix.dispatch.service=[{services}]", "--set", f"matrix.dispatch.budget=[{budgets}]"


def _migration_matrix(budgets: str) -> tuple[str, ...]:
    """disco-migration.yaml's matrix with these budgets (both policies, with and without migration)."""
    return "--set", f"matrix.dispatch.budget=[{budgets}]"


def _requests(per_device: int, rate_per_s: float) -> tuple[str, ...]:
    return ("--set", f"base.workload.requests_per_device={per_device}", "--set",
            f"base.workload.rate_per_s={rate_per_s:g}")  # fmt: skip


SMOKE_CALIBRATION = ("--set", "base.dispatch.calibration_requests=8")
MIGRATION_BASELINE = ("--baseline", "dispatch.migration=false")


# -- reading ours ------------------------------------------------------------------------------------


def _find(key: str, match: dict, field: str) -> Callable[[Result], Interval | None]:
    """The interval ``field`` of the row of ``result[key]`` whose fields equal ``match``."""

    def read(result: Result) -> Interval | None:
        for row in result.get(key) or []:
            if all(row.get(k) == v for k, v in match.items()) and row.get(field):
                return Interval.from_dict(row[field])
        return None

    return read


def _pearson(label: str, phase: str) -> Callable[[Result], Interval | None]:
    """Pearson(prompt length, TTFT) of configuration ``label``'s ``phase`` (idle or loaded), with its interval."""

    def read(result: Result) -> Interval | None:
        for config in result.get("configs") or []:
            found = config["label"] == label and (config.get(phase) or {}).get("pearson_length_ttft_interval")
            if found:
                return Interval.from_dict(found)
        return None

    return read


def _tbt(regime: str) -> Callable[[Result], Interval | None]:
    def read(result: Result) -> Interval | None:
        found = (result.get("table3_tbt_p99_s") or {}).get(regime)
        return Interval.from_dict(found) if found else None

    return read


def _live_budget(service: str, regime: str, budget: float) -> Callable[[Result], Interval | None]:
    """The realised budget of DiSCo (live) at ``budget``."""

    def read(result: Result) -> Interval | None:
        for row in result.get("table2_live") or []:
            if row["service"] == service and row["regime"] == regime:
                for point in row["per_budget"]:
                    if point["budget"] == budget:
                        return Interval.from_dict(point["realised_budget"][f"disco-{regime[0]}"])
        return None

    return read


def _fig9(policy: str, samples: int) -> Callable[[Result], Interval | None]:
    def read(result: Result) -> Interval | None:
        for row in result.get("results") or []:
            if row["policy"] == policy and row["samples"] == samples and "mean_ms" in row:
                return Interval.from_dict(row["mean_ms"])
        return None

    return read


# -- the headlines -----------------------------------------------------------------------------------

DEVICE_AXIS = "device: 1 B-1.1B, 2 B-560M, 3 Q-0.5B"


def _table2(experiment: str, title: str, note: str) -> list[Headline]:
    out = []
    for regime in REGIMES:
        for trace, name in TRACES.items():
            for index, device in enumerate(DEVICES):
                out.append(Headline(
                    f"Table 2, {REGIMES[regime]}, {title} | {DEVICE_AXIS}",
                    f"{name}, {DEVICE_NAMES[device]}: P99 TTFT reduction against Stoch", "%",
                    TABLE2[trace, regime][index], experiment,
                    _find("table2", {"trace": trace, "regime": regime, "device": device}, "reduction_pct"),
                    note=note, x=float(index + 1), series=name,
                ))  # fmt: skip
    return out


SWEEP_NOTE = "server TTFT modeled: our lognormal reading"
ENGINE_NOTE = "server TTFT measured on our loaded engine, scaled to the trace's typical TTFT"
TABLE1 = "Table 1 (Sec. 3): does TTFT follow the prompt's length?"
FIG6 = "Fig. 6, trace-driven"
LIVE2 = "Table 2 live: emulated testbed, Pixel 7 Pro + BLOOM-1.1B"
BUDGET = "Sec. 5.1: the realised budget at b = 0.5"
FIG7, DELAY, TBT = "Fig. 7: migration's cost cut", "Table 3: delay_num of migrated requests", \
    "Table 3: TBT P99 of migrated requests"  # fmt: skip
LIVE = "live, GPT-like trace, Pixel 7 Pro + BLOOM-560M"
POLICY_NAMES = {"disco-s": "DiSCo-S", "disco-d": "DiSCo-D"}

HEADLINES = (
    # Table 1 (Sec. 3): Pearson(prompt length, TTFT) is 0.014 to 0.040 on the four servers and 0.8424 for
    # LLaMA-3.1-8B on a device; the brief's check: server < 0.1, device >= 0.8
    Headline(TABLE1, "server on a GPU under load: Pearson(prompt length, TTFT)", "", 0.1, "table1_server",
             _pearson("server", "loaded"), no_effect=None, at_most=True,
             note="the paper's servers: 0.014 to 0.040; ours: random weights of a 1B Llama on the lent GPU, "
             "Poisson arrivals at 0.8 of its one-at-a-time rate"),
    Headline(TABLE1, "device, one request at a time: Pearson(prompt length, TTFT)", "", 0.8424, "table1_device",
             _pearson("device", "idle"), no_effect=None,
             note="the paper's LLaMA-3.1-8B on a device; ours: the tiny model on this machine's CPU"),
    *_table2("sweep", "trace-driven", SWEEP_NOTE),
    *_table2("engine_sweep", "server TTFT of our loaded engine", ENGINE_NOTE),
    # Sec. 5.2: GPT "decreasing P99 TTFT by up to 40% relative to Stochastic dispatching across all device
    # configurations, while mean TTFT is also reduced ... between 20-30% across diverse budget ratios";
    # LLaMA device-constrained: "reducing tail latency by up to 50%"
    *(Headline(FIG6, f"GPT, {REGIMES[regime]}: best P99 TTFT change against Stoch over b", "%", -40.0, "sweep",
               _find("fig6", {"trace": "gpt", "regime": regime, "metric": "p99_ttft"}, "best_change_pct"),
               note="paper: up to -40%; ours: the best budget, mean over the three devices")
      for regime in REGIMES),
    *(Headline(FIG6, f"GPT, {REGIMES[regime]}: mean TTFT change against Stoch, average over b", "%", -25.0,
               "sweep", _find("fig6", {"trace": "gpt", "regime": regime, "metric": "mean_ttft"},
                              "average_change_pct"),
               note="paper: -20 to -30% across budgets (the middle); ours: b = 0, 0.1, ..., 1 and the devices")
      for regime in REGIMES),
    Headline(FIG6, "LLaMA, device-constrained: best P99 TTFT change against Stoch over b", "%", -50.0, "sweep",
             _find("fig6", {"trace": "llama", "regime": "device", "metric": "p99_ttft"}, "best_change_pct"),
             note="paper: up to -50%"),
    # Table 2's Pixel 7 Pro + BLOOM-1.1B cells live, and the budget DiSCo is given
    *(Headline(LIVE2, f"{TRACES[service]}, {REGIMES[regime]}: P99 TTFT reduction against Stoch", "%",
               TABLE2[service, regime][0], "budget_campaign",
               _find("table2_live", {"service": service, "regime": regime}, "reduction_pct"),
               note="averaged over b = 0.2, 0.5, 0.8 (the paper: over the whole range)")
      for service in ("gpt", "command") for regime in REGIMES),
    *(Headline(BUDGET, f"GPT, DiSCo-{regime[0].upper()} (trace-driven)", "", 0.5, "sweep",
               _find("realised_budget", {"trace": "gpt", "regime": regime, "policy": f"disco-{regime[0]}",
                                         "budget": 0.5}, "realised_budget"),
               no_effect=None, note="the constrained endpoint's share of input tokens in the races, mean over devices")
      for regime in REGIMES),
    *(Headline(BUDGET, f"GPT, DiSCo-{regime[0].upper()} (live, Pixel 7 Pro + BLOOM-1.1B)", "", 0.5,
               "budget_campaign", _live_budget("gpt", regime, 0.5), no_effect=None,
               note="the constrained endpoint's share of input tokens in the races")
      for regime in REGIMES),
    # Sec. 5.2, Fig. 7: migration cuts cost "up to 72.7%" (DiSCo-D) and "83.6%" (DiSCo-S), "most significant
    # at higher budget ratios"
    *(Headline(FIG7, f"{POLICY_NAMES[policy]}: largest cost cut (trace-driven)", "%", value, "sweep",
               _find("fig7", {"regime": regime}, "max_cut_pct"), note="over traces, devices and budgets")
      for policy, regime, value in (("disco-d", "device", 72.7), ("disco-s", "server", 83.6))),
    *(Headline(FIG7, f"{POLICY_NAMES[policy]}: cost cut at b = 0.8 ({LIVE})", "%", value, "migration_campaign",
               _find("migration_live", {"policy": policy, "budget": 0.8}, "cost_cut_pct"),
               note="paper: its largest; ours on the same requests with and without migration")
      for policy, value in (("disco-d", 72.7), ("disco-s", 83.6))),
    # Table 3: mean delay_num read as the tokens the client held when the migration began (Eq. 5's B: the
    # paper's device rows have mean = P99, a constant per trace); TBT P99 after the client's buffer
    *(Headline(DELAY, f"{name}, {REGIMES[regime]}: mean (trace-driven)", "tokens", TABLE3_DELAY[trace, regime],
               "sweep", _find("table3", {"trace": trace, "regime": regime}, "held_tokens_mean"), no_effect=None,
               note="read as the tokens held for the migration (Eq. 5's B)")
      for regime in REGIMES for trace, name in TRACES.items()),
    *(Headline(DELAY, f"GPT, {REGIMES[regime]}: mean ({LIVE})", "tokens", TABLE3_DELAY["gpt", regime],
               "migration_campaign",
               _find("migration_live", {"policy": f"disco-{regime[0]}", "budget": "all"}, "held_tokens_mean"),
               no_effect=None, note="tokens held for the migration, all budgets")
      for regime in REGIMES),
    *(Headline(TBT, f"{REGIMES[regime]} (trace-driven)", "s", TABLE3_TBT_P99_S[regime], "sweep", _tbt(regime),
               no_effect=None, note="shown tokens, after the client's buffer (r_c = 4.8 tokens/s)")
      for regime in REGIMES),
    *(Headline(TBT, f"{REGIMES[regime]} ({LIVE})", "s", TABLE3_TBT_P99_S[regime], "migration_campaign",
               _find("migration_live", {"policy": f"disco-{regime[0]}", "budget": "all"}, "migrated_tbt_p99_s"),
               no_effect=None, note="shown tokens, all budgets")
      for regime in REGIMES),
    # Fig. 9: the paper's on an M1, ours on this machine's CPU
    *(Headline("Fig. 9: the policy's computation time | samples", f"{POLICY_NAMES[policy]}: {samples:,} samples",
               "ms", FIG9_MS[policy][i], "policy", _fig9(policy, samples), no_effect=None, x=float(samples),
               series=POLICY_NAMES[policy], note="ours on this machine's CPU, the paper's on an M1")
      for policy in FIG9_MS for i, samples in enumerate(FIG9_SAMPLES)),
)  # fmt: skip

PAPER = Paper(
    key="disco",
    title="DiSCo: device-server cooperative LLM text streaming",
    citation="DiSCo, dispatching between a device's and a server's LLM under a cost budget, with token-level "
    "migration (seed 000): Table 2, Fig. 6, Fig. 7 and Table 3 (Sec. 5.2), Fig. 9 (Sec. 5.3).",
    experiments=(
        Experiment(
            "table1_server",
            "Table 1's premise on a real GPU: our endpoint serving random weights of a 1B Llama, one request at a "
            "time and then under Poisson load",
            PREMISE,
            {"smoke": (*SERVER, "--requests", "10"), "reduced": (*SERVER, "--requests", "60"),
             "full": (*SERVER, "--requests", "200")},
            PREMISE_CODE,
            gpu=True,
        ),
        Experiment(
            "table1_device",
            "Table 1's premise on a device: our endpoint serving the tiny model on this machine's CPU",
            PREMISE,
            {"smoke": (*DEVICE, "--requests", "10"), "reduced": (*DEVICE, "--requests", "60"),
             "full": (*DEVICE, "--requests", "200")},
            PREMISE_CODE,
        ),
        Experiment(
            "sweep",
            "Table 2, Fig. 6, Fig. 7, Table 3 trace-driven: 4 traces x 3 devices x 2 regimes x b in {0, 0.1, ..., 1} "
            "x migration, 1,000 Alpaca-like requests a seed",
            "bench/disco_sweep.py",
            {"smoke": ("--seeds", "2"), "reduced": ("--seeds", "10"), "full": ("--seeds", "10")},
            SWEEP_CODE,
        ),
        Experiment(
            "engine_sweep",
            "the same sweep on server TTFTs measured on our serving engine under load (Llama-2-70B's steps on "
            "4 x A100-80GB, fcfs, 8 requests a batch, 3 arrivals/s)",
            "bench/disco_engine.py",
            {
                "smoke": ("--engine-requests", "120", "--seeds", "2"),
                "reduced": ("--engine-requests", "600", "--seeds", "10"),
                "full": ("--engine-requests", "2000", "--seeds", "10"),
            },
            ENGINE_CODE,
        ),
        Experiment(
            "budget_campaign",
            "live on the emulated testbed: Stoch and DiSCo in both regimes at b = 0.2, 0.5, 0.8, GPT- and "
            "Command-like traces, 2 devices",
            "bench/disco_campaign.py",
            {
                "smoke": (
                    BUDGET_CAMPAIGN,
                    *_budget_matrix("gpt", "0.5"),
                    *_requests(4, 1.0),
                    *SMOKE_CALIBRATION,
                    "--work",
                    f"{WORK}/disco-budget-smoke",
                ),
                "reduced": (
                    BUDGET_CAMPAIGN,
                    *_budget_matrix("gpt, command", "0.2, 0.5, 0.8"),
                    *_requests(15, 0.5),
                    "--work",
                    f"{WORK}/disco-budget-reduced",
                ),
                "full": (BUDGET_CAMPAIGN, "--work", f"{WORK}/disco-budget", "--resume"),
            },
            (*CAMPAIGN_RUN, BUDGET_CAMPAIGN),
            resumable=True,
        ),
        Experiment(
            "migration_campaign",
            "live on the emulated testbed: DiSCo-S and -D with and without migration at b = 0.2, 0.5, 0.8, "
            "GPT-like trace, 2 devices",
            "bench/disco_campaign.py",
            {
                "smoke": (
                    MIGRATION_CAMPAIGN,
                    *_migration_matrix("0.8"),
                    *_requests(3, 1.0),
                    *SMOKE_CALIBRATION,
                    *MIGRATION_BASELINE,
                    "--work",
                    f"{WORK}/disco-migration-smoke",
                ),
                "reduced": (
                    MIGRATION_CAMPAIGN,
                    *_requests(12, 0.5),
                    *MIGRATION_BASELINE,
                    "--work",
                    f"{WORK}/disco-migration-reduced",
                ),
                "full": (MIGRATION_CAMPAIGN, *MIGRATION_BASELINE, "--work", f"{WORK}/disco-migration", "--resume"),
            },
            (*CAMPAIGN_RUN, MIGRATION_CAMPAIGN),
            resumable=True,
        ),
        Experiment(
            "policy",
            "Fig. 9: the policy computed from 1K, 10K and 100K profile samples",
            "bench/disco_policy.py",
            {"smoke": ("--repeats", "5"), "reduced": ("--repeats", "20"), "full": ("--repeats", "50")},
        ),
    ),
    headlines=HEADLINES,
    modeled=(
        "Server TTFT (trace-driven rows): DiSCo publishes no trace, only its shape (Sec. 3, Table 1) and typical "
        "values (Table 5); nodes/endpoints/services.py reads each service as a lognormal body around its typical "
        "TTFT mixed with a lognormal tail. Table 2's cells rest on that tail (DiSCo-D's wait is F's 99th "
        "percentile at alpha = 0.01), so the rows 'server TTFT of our loaded engine' replace it with TTFTs "
        "measured on our serving engine under load.",
        "Server TTFT (engine rows): the tail's shape is measured (queueing for a place in an 8-request batch and "
        "the prefill iteration, at 3 arrivals/s), but the load, the batch limit and the step times (Llama-2-70B "
        "on 4 x A100-80GB, paced) are chosen, and the TTFTs are scaled to each trace's typical TTFT; inter-token "
        "times stay the trace's. Their intervals resample the sweep's seeds over one measured engine run.",
        "Devices: the phones' TTFT is T_d = c + l / prefill rate and their decode rate DiSCo's measured ones "
        "(Sec. 5.1), with 3% run-to-run jitter in the trace-driven runs; live, each device endpoint paces the tiny "
        "model's tokens to them. Cost: Table 8's API prices and Eq. 7-9's FLOPs at App. E's energy-to-money "
        "rates (analysis/cost_model.py).",
        "Live runs: times on the trace endpoint and the device endpoints are modeled (the tiny model computes the "
        "tokens); what is live is the dispatcher, HTTP, the data plane's links and the client's buffer. Table 2's "
        "live cells average three budgets, the paper's the whole range; Stoch and DiSCo meet the same requests "
        "and the same server draws.",
        "Table 3's delay_num is read as the tokens the client held when a migration began (Eq. 5's B); the source "
        "keeps streaming until the target is ready (Sec. 4.3), so no shown token is late.",
    ),
)
