"""CoCoServe (module-level scaling of LLM serving): Fig. 8 (one Llama-2-13B instance at low load against
HF Transformers and vLLM), Fig. 10 (two scaled instances against two and four static ones: latency,
throughput, memory), Fig. 11 (OOM rate and SLO attainment at high load), and on a GPU Table 2's
replication costs, Sec. 2.3's instance restart and Eq. 1's premise that a replica's share of the batch
costs its share of the time.

Our lab: one server of four emulated A100-40GB GPU ranks (examples/inventories/cocoserve-lab.yaml), the
tiny model computing every token (8 layers standing for Llama-2-13B's 40), each copy's step paced to the
A100 profile at dilation 8; static batching stands for HF Transformers and our continuous batching
without the controller for vLLM. Fig. 8 and 11 are examples/campaigns/cocoserve-load.yaml on the lab
(bench/cocoserve_load.py --campaign adds throughput, E2E, OOM and SLO with intervals to
bench/campaign_reproduction.py's summary); Fig. 10's fleets are bench/cocoserve_load.py --fleets.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from analysis.uncertainty import Interval
from bench.reproduce.registry import CAMPAIGN_CODE, Experiment, Headline, Paper, Result

CAMPAIGN = "examples/campaigns/cocoserve-load.yaml"
LOAD = "bench/cocoserve_load.py"
WORK = "/var/tmp/hil-testbed-reproduce"
CAMPAIGN_RUN = (
    *CAMPAIGN_CODE,
    CAMPAIGN,
    "examples/inventories/cocoserve-lab.yaml",
    "examples/profiles/a100-40gb.yaml",
    "examples/models/tiny",
)
RANKS_RUN = (  # bench/cocoserve_load.py's own runs: the workers under mpiexec, no lab
    "nodes/workers",
    "nodes/scaling",
    "nodes/serving",
    "nodes/inference",
    "nodes/contracts",
    "testbed/target",
    "examples/profiles/a100-40gb.yaml",
    "examples/models/tiny",
)
GPU_RUN = (
    "examples/models/tiny",
    "nodes/contracts",
    "nodes/inference",
    "nodes/workers/profile_engine.py",
    "nodes/workers/pacing.py",
    "nodes/telemetry",
)
STATIC, CONTINUOUS, COCO = "static-batching", "continuous-batching", "cocoserve"
HFT2, HFT4, COCO2 = "static-batching:2x1", "static-batching:4x1", "cocoserve:2x2"


def _matrix(methods: tuple[str, ...], client_rates: tuple[float, ...]) -> tuple[str, ...]:
    rates = ", ".join(f"{r:g}" for r in client_rates)
    return "--set", f"matrix.method=[{', '.join(methods)}]", "--set", f"matrix.workload.rate_per_s=[{rates}]"


def _campaign(name: str, methods: tuple[str, ...], client_rates: tuple[float, ...], requests_per_client: int,
              repetitions: int, *extra: str) -> tuple[str, ...]:  # fmt: skip
    """bench/cocoserve_load.py's arguments for cocoserve-load.yaml with this matrix: 4 clients, so a
    client's rate is a quarter of the server's."""
    return ("--campaign", CAMPAIGN, *_matrix(methods, client_rates),
            "--set", f"base.workload.requests_per_device={requests_per_client}",
            "--set", f"repetitions={repetitions}", *extra, "--work", f"{WORK}/cocoserve-{name}")  # fmt: skip


THREE = (STATIC, CONTINUOUS, COCO)
TIGHT = ("--set", "base.scaling.gpu_memory_gb=26.8")  # a static batch of 32 outgrows it; cocoserve-steps.yaml's
FLEETS = ("--fleets", f"{HFT2},{HFT4},{COCO2}")


# -- reading ours from a bench/cocoserve_load.py result ------------------------------------------------


def _row(result: Result, table: str, **wanted: str) -> dict | None:
    return next((r for r in result.get(table, []) if all(r.get(k) == v for k, v in wanted.items())), None)


def _defined(interval: Interval) -> Interval | None:
    """None for an estimate that is not defined (a change against a baseline of none, e.g. no OOM at all)."""
    return None if math.isnan(interval.estimate) else interval


def change(config: str, against: str, load: str, measure: str) -> Callable[[Result], Interval | None]:
    """``config``'s change of ``measure`` (e2e_change, throughput_change, oom_change, slo_violation_change,
    memory_change) against ``against`` at ``load`` ("low", "high", "all" or "16/s"), in percent."""

    def read(result: Result) -> Interval | None:
        row = _row(result, "changes", config=config, against=against, load=load)
        found = _defined(Interval.from_dict(row[measure])) if row and measure in row else None
        return found.scaled(100.0) if found else None

    return read


def mean(config: str, load: str, measure: str, factor: float = 1.0) -> Callable[[Result], Interval | None]:
    """``config``'s mean ``measure`` (oom_rate, slo_attainment, e2e_mean_s, ...) at ``load``, times ``factor``."""

    def read(result: Result) -> Interval | None:
        row = _row(result, "groups", config=config, load=load)
        return _defined(Interval.from_dict(row[measure]).scaled(factor)) if row and measure in row else None

    return read


# -- reading ours from a bench/cocoserve_gpu.py result -------------------------------------------------


def copy_seconds(layers: int, path: str = "staged") -> Callable[[Result], Interval | None]:
    """The mean seconds of replicating ``layers`` layers (``staged`` through one pinned host buffer, as
    between GPUs that cannot reach each other)."""

    def read(result: Result) -> Interval | None:
        rows = (result.get("copy") or {}).get("rows", [])
        row = next((r for r in rows if r["path"] == path and r["layers"] == layers and "seconds_mean" in r), None)
        return Interval.from_dict(row["seconds_mean"]) if row else None

    return read


def copy_mib(layers: int) -> Callable[[Result], Interval | None]:
    """The bytes a replication of ``layers`` layers moved, in MiB (exact: no interval to speak of)."""

    def read(result: Result) -> Interval | None:
        rows = (result.get("copy") or {}).get("rows", [])
        row = next((r for r in rows if r["layers"] == layers), None)
        if row is None:
            return None
        mib = row["bytes"] / 2**20
        return Interval(mib, mib, mib, 1)

    return read


def restart_seconds(result: Result) -> Interval | None:
    found = (result.get("restart") or {}).get("whole_mean_s")
    return Interval.from_dict(found) if found else None


def half_batch_change(batch: int, path: str = "batched") -> Callable[[Result], Interval | None]:
    """The change of a decode step's mean time when its batch of ``batch`` is halved, in percent."""

    def read(result: Result) -> Interval | None:
        rows = (result.get("decode") or {}).get("rows", [])
        row = next((r for r in rows if r["batch"] == batch and r.get(f"{path}_half_change")), None)
        return Interval.from_dict(row[f"{path}_half_change"]).scaled(100.0) if row else None

    return read


# -- the paper's numbers -------------------------------------------------------------------------------

FIG8 = "Fig. 8, Llama-2-13B, one instance on 4 GPUs, low load (3-30 requests/s)"
VLLM = "vLLM: our continuous batching without the controller"
TOKENS = "throughput: output tokens/s"
# Sec. 6.2's text: CoCoServe against HFT -56.89% latency and 2.13x throughput; against vLLM -26.87% and +36.89%
# (throughput factors written as changes: 2.13x is +113%)
FIG8_HEADLINES = (
    Headline(FIG8, "CoCoServe E2E vs HFT", "%", -56.89, "fig8_low_load", change(COCO, STATIC, "low", "e2e_change"),
             note="HFT: static batching"),
    Headline(FIG8, "CoCoServe throughput vs HFT", "%", 113.0, "fig8_low_load",
             change(COCO, STATIC, "low", "throughput_change"), note="2.13x; " + TOKENS),
    Headline(FIG8, "CoCoServe E2E vs vLLM", "%", -26.87, "fig8_low_load",
             change(COCO, CONTINUOUS, "low", "e2e_change"), note=VLLM),
    Headline(FIG8, "CoCoServe throughput vs vLLM", "%", 36.89, "fig8_low_load",
             change(COCO, CONTINUOUS, "low", "throughput_change"), note=VLLM),
    Headline(FIG8, "vLLM E2E vs HFT", "%", round(100 * ((1 - 0.5689) / (1 - 0.2687) - 1), 1), "fig8_low_load",
             change(CONTINUOUS, STATIC, "low", "e2e_change"), note="derived from CoCoServe's against each"),
    Headline(FIG8, "vLLM throughput vs HFT", "%", round(100 * (2.13 / 1.3689 - 1), 1), "fig8_low_load",
             change(CONTINUOUS, STATIC, "low", "throughput_change"), note="derived from CoCoServe's against each"),
)  # fmt: skip

FIG10 = "Fig. 10, Llama-2-13B: CoCoServe-2 (2 instances of 2 GPUs) against HFT-2 and HFT-4"
# Sec. 6.3: against HFT-2 at low load -14.23% latency, +16.92% throughput; at high load -27.48%, +38.78%;
# HFT-4 is "approximately 11.28% better latency and 9.59% better throughput" at low load; memory HFT-2
# 58,786.68 MiB, HFT-4 119,573.34 MiB, CoCoServe-2 64,015.44 MiB
HFT_N = "HFT-n: n static instances of 1 GPU"
FIG10_HEADLINES = (
    Headline(FIG10, "E2E vs HFT-2, low load", "%", -14.23, "fig10_fleets", change(COCO2, HFT2, "low", "e2e_change"),
             note=HFT_N),
    Headline(FIG10, "throughput vs HFT-2, low load", "%", 16.92, "fig10_fleets",
             change(COCO2, HFT2, "low", "throughput_change"), note=TOKENS),
    Headline(FIG10, "E2E vs HFT-2, high load", "%", -27.48, "fig10_fleets", change(COCO2, HFT2, "high", "e2e_change")),
    Headline(FIG10, "throughput vs HFT-2, high load", "%", 38.78, "fig10_fleets",
             change(COCO2, HFT2, "high", "throughput_change"), note=TOKENS),
    Headline(FIG10, "E2E vs HFT-4, low load", "%", round(100 * (1 / (1 - 0.1128) - 1), 1), "fig10_fleets",
             change(COCO2, HFT4, "low", "e2e_change"),
             note="from HFT-4's latency 11.28% below CoCoServe-2's; unpaired (other clients)"),
    Headline(FIG10, "throughput vs HFT-4, low load", "%", round(100 * (1 / 1.0959 - 1), 1), "fig10_fleets",
             change(COCO2, HFT4, "low", "throughput_change"), note="from HFT-4's throughput 9.59% above CoCoServe-2's"),
    Headline(FIG10, "GPU memory vs HFT-2", "%", round(100 * (64015.44 / 58786.68 - 1), 1), "fig10_fleets",
             change(COCO2, HFT2, "all", "memory_change"), note="peak, the target's bytes"),
    Headline(FIG10, "GPU memory vs HFT-4", "%", round(100 * (64015.44 / 119573.34 - 1), 1), "fig10_fleets",
             change(COCO2, HFT4, "all", "memory_change"), note="peak, the target's bytes; the paper's 53.54%"),
)  # fmt: skip

FIG11 = "Fig. 11, Llama-2-13B, high load (31-50 requests/s), GPUs of 26.8 GB"
# Sec. 6.4: HFT's OOM rate 34% at high load against CoCoServe's 2% (17x fewer); CoCoServe's SLO attainment
# perfect to about 50 requests/s while HFT's "completely fails beyond 30"
FIG11_HEADLINES = (
    Headline(FIG11, "HFT: OOM rate", "%", 34.0, "fig11_high_load", mean(STATIC, "high", "oom_rate", 100.0),
             no_effect=None, note="the share of requests failed out of memory; HFT: static batching"),
    Headline(FIG11, "CoCoServe OOM rate vs HFT", "%", round(100 * (2 / 34 - 1), 1), "fig11_high_load",
             change(COCO, STATIC, "high", "oom_change"), note="2% against 34%"),
    Headline(FIG11, "CoCoServe: SLO attainment", "%", 100.0, "fig11_high_load",
             mean(COCO, "high", "slo_attainment", 100.0), no_effect=None, note="SLO: 5x the request's time alone"),
    Headline(FIG11, "CoCoServe SLO violations vs HFT", "%", -100.0, "fig11_high_load",
             change(COCO, STATIC, "high", "slo_violation_change"),
             note="none against HFT failing every request beyond 30 requests/s"),
)  # fmt: skip

TABLE2_TIME = "Table 2, replicating Llama-2-13B layers on a real GPU: time | layers replicated"
TABLE2_MEMORY = "Table 2, replicating Llama-2-13B layers: memory | layers replicated"
# Table 2: replication seconds and memory (MB) for 1, 10, 20, 30 and 40 layers
TABLE2_S = {1: 0.2987, 10: 0.3581, 20: 0.3826, 30: 0.4947, 40: 0.8938}
TABLE2_MB = {1: 1107, 10: 6579, 20: 12659, 30: 18739, 40: 24819}
TABLE2_HEADLINES = tuple(
    Headline(TABLE2_TIME, f"replication time, {k} layer{'s' * (k > 1)}", "s", v, "gpu_premises", copy_seconds(k),
             no_effect=None, note="ours: the copy through pinned host memory alone", x=float(k), series="time (s)")
    for k, v in TABLE2_S.items()
) + tuple(
    Headline(TABLE2_MEMORY, f"memory, {k} layer{'s' * (k > 1)}", "MiB", v, "gpu_premises",
             copy_mib(k), no_effect=None, note="ours: the layers' bytes alone (the paper's about 499 MB more)",
             x=float(k), series="memory (MiB)")
    for k, v in TABLE2_MB.items()
)  # fmt: skip

RESTART = "Sec. 2.3, an instance-level adjustment (real GPU)"
EQ1 = "Eq. 1, a replica's half of the batch: one layer's decode step (real GPU)"
GPU_HEADLINES = (
    Headline(RESTART, "restarting a Llama-2-13B instance", "s", 16.5, "gpu_premises", restart_seconds,
             no_effect=None, note="the middle of Sec. 2.3's 8-25 s; ours: a fresh process loads all 40 layers (random "
             "weights of its shape, from the page cache) and runs one step"),
    Headline(EQ1, "batch of 32 halved: step time", "%", -50.0, "gpu_premises",
             half_batch_change(32), note="Eq. 1: time in proportion to the batch share; batched attention"),
    Headline(EQ1, "batch of 256 halved: step time", "%", -50.0, "gpu_premises",
             half_batch_change(256), note="Eq. 1: time in proportion to the batch share; batched attention"),
)  # fmt: skip

PAPER = Paper(
    key="cocoserve",
    title="CoCoServe: module-level scaling of LLM serving",
    citation="CoCoServe, fine-grained scaling of LLM serving by replicating and migrating decoder layers across "
    "GPUs (seed 003): Fig. 8 (Sec. 6.2), Fig. 10 (Sec. 6.3), Fig. 11 (Sec. 6.4), Table 2 (Sec. 6.5), Sec. 2.3, Eq. 1.",
    experiments=(
        Experiment(
            "fig8_low_load",
            "Fig. 8: static batching, continuous batching and CoCoServe, one instance on 4 GPUs of 40 GB, "
            "low load (the campaign on the emulated lab)",
            LOAD,
            {
                "smoke": _campaign("fig8-smoke", THREE, (4,), 2, 1),
                "reduced": _campaign("fig8", THREE, (4,), 8, 3),
                "full": _campaign("fig8", THREE, (1, 3, 5, 7), 40, 5, "--resume"),
            },
            CAMPAIGN_RUN,
            resumable=True,
        ),
        Experiment(
            "fig10_fleets",
            "Fig. 10: 2 and 4 static instances of 1 GPU against 2 CoCoServe instances of 2 GPUs (real ranks, "
            "instances in turn on one clock)",
            LOAD,
            {
                "smoke": (*FLEETS, "--rates", "16", "--requests", "8", "--repetitions", "1"),
                "reduced": (*FLEETS, "--rates", "16,40", "--requests", "24", "--repetitions", "3"),
                "full": (*FLEETS, "--rates", "8,24,40,48", "--requests", "120", "--repetitions", "3"),
            },
            RANKS_RUN,
        ),
        Experiment(
            "fig11_high_load",
            "Fig. 11: OOM rate and SLO attainment at high load, each GPU 26.8 GB (the campaign on the emulated lab)",
            LOAD,
            {
                "smoke": _campaign("fig11-smoke", (STATIC, COCO), (12,), 2, 1, *TIGHT),
                "reduced": _campaign("fig11", (STATIC, COCO), (12,), 8, 3, *TIGHT),
                "full": _campaign("fig11", THREE, (2, 6, 10, 12), 40, 5, *TIGHT, "--resume"),
            },
            CAMPAIGN_RUN,
            resumable=True,
        ),
        Experiment(
            "gpu_premises",
            "Table 2, Sec. 2.3 and Eq. 1 on a real GPU: layer copies, an instance restart, a decode step by batch",
            "bench/cocoserve_gpu.py",
            {
                "smoke": ("--skip", "profile,restart,nvml", "--reps", "2", "--decode-reps", "5"),
                "reduced": ("--reps", "3", "--decode-reps", "10"),
                "full": ("--reps", "5", "--decode-reps", "30"),
            },
            GPU_RUN,
            gpu=True,
        ),
    ),
    headlines=(*FIG8_HEADLINES, *FIG10_HEADLINES, *FIG11_HEADLINES, *TABLE2_HEADLINES, *GPU_HEADLINES),
    modeled=(
        "Time: every GPU's step is the target's (Llama-2-13B on an A100-40GB, examples/profiles/a100-40gb.yaml, "
        "for the 5 layers a tiny-model layer stands for), paced at dilation 8; tokens are the tiny model's. A "
        "replica's share of a batch costs what the profile says, not Eq. 1's proportional share.",
        "Memory: each GPU's budget is counted in the target's bytes (weights, KV cache, embedding and head): 40 GB "
        "in Fig. 8 and 10, 26.8 GB in Fig. 11 so that a static batch of 32 outgrows it. An OOM is that "
        "accounting, not an allocator's failure.",
        "Baselines: static batching (a batch of 32 run to its end) stands for HF Transformers, our continuous "
        "batching without the controller for vLLM 0.8.5 (no paged attention's own gains).",
        "Load: the paper's rates in the target's time (low up to 30 requests/s, high above), Poisson arrivals, "
        "Alpaca-like prompts and lengths; Fig. 10's instances run one after another on one clock (two cores "
        "cannot pace several), each with its share of the clients.",
        "Table 2 and Sec. 2.3 run on the GPU the session is lent (an H100 or H200, not an A100), with random "
        "weights of Llama-2-13B's shape; without one they are not run.",
    ),
)
