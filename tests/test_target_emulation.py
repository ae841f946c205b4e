"""A campaign that emulates a target (Vicuna-7B on an AGX Orin and RTX A6000 stages) on the emulated
testbed, through the real ``testbed run``: every step is paced to its compute profile's prediction and
logged, hidden states cross the shaped link at the target's 8 KiB a token, the manifest says what was
emulated and how faithfully, dilation stretches the schedule and analysis divides it back; campaigns
that name an unknown target or a node without a profile are refused at their line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.load import load
from analysis.report import build_report
from nodes.contracts.compute_profile import step_seconds
from nodes.contracts.target_model import builtin
from testbed.target.compute_profiles import PROFILES_DIR, load_profile
from tests.conftest import REPO, emulated_inventory, emulated_lab

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root"),
    pytest.mark.slow,
    pytest.mark.root,
]

TINY = REPO / "examples" / "models" / "tiny"
VICUNA_7B = builtin("vicuna-7b")
FRAME_AND_SEGMENT_HEADERS = 20 + 64


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("target")
    path = emulated_inventory(directory, "tg", 222)
    with emulated_lab(path):
        yield path


def campaign(directory: Path, inventory: Path, target: str, name: str = "target", *, stages: int = 2,
             rate_per_s: float = 1.0, tokens: int = 12, matrix: str = "target.dilation: [1, 2]") -> Path:  # fmt: skip
    """orin and the server, ``wifi-up`` links, orin at MODE_50W, 3 SpecBench requests, run in the
    listed order over ``matrix`` (one line), ``tokens`` new tokens each."""
    path = directory / f"{name}.yaml"
    path.write_text(f"""name: {name}
inventory: {inventory}
base:
  method: ushape
  model: {TINY}
  partition: {{device_layers: 2, stages: {stages}}}
  devices: [orin]
  workload: {{arrival: constant, rate_per_s: {rate_per_s}, requests_per_device: 3, max_new_tokens: {tokens}, prompts: specbench}}
  link: {{profile: wifi-up}}
  power: {{orin: MODE_50W}}
  target: {target}
  drain_s: 0.2
matrix:
  {matrix}
order: listed
seed: 3
run_timeout_s: 120
""")
    return path


def _pacing(inventory: Path, node: str) -> dict:
    """What the node's CPU pacing tool says of it (over the node's real SSH)."""
    from testbed.commands.node_context import resolve_context
    from testbed.emulation.resolved import load_lab
    from testbed.transport import open_transport

    lab = load_lab(inventory)
    with open_transport(lab, lab.node(node)) as t:
        context = resolve_context(lab, lab.node(node), t)
        answer = t.run(context.command([context.base_python, "-m", "nodes.emulated.cpu_pacing", "show"])).check()
    return json.loads(answer.stdout.strip().splitlines()[-1])


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip


def test_a_target_campaign_paces_every_step_pads_the_wire_and_dilation_divides_back(lab, tmp_path):
    out = tmp_path / "out"
    done = run("run", str(campaign(tmp_path, lab, "{model: vicuna-7b}")), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = load(out)
    first, second = (data.runs.loc[data.runs["target.dilation"] == k, "run_id"].item() for k in (1.0, 2.0))
    manifest = json.loads((out / "runs" / first / "manifest.json").read_text())
    # what was emulated: the target's shape, each node's profile in the mode the run set
    nodes = manifest["target"]["nodes"]
    assert manifest["target"]["model"]["name"] == "vicuna-7b" and manifest["target"]["dilation"] == 1.0
    assert (nodes["orin"]["profile"], nodes["orin"]["mode"]) == ("agx-orin", "MODE_50W")
    assert (nodes["server"]["profile"], nodes["server"]["mode"]) == ("rtx-a6000", "default")
    assert any("step times are modeled" in line for line in manifest["modeled"])
    assert set(manifest["fidelity"]) == {"orin", "server"}
    # the run paced its emulated nodes' CPUs (10 ms periods) and ended it: the power mode's quota is back
    events = [json.loads(line) for line in (out / "runs" / first / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "cpu_paced" and sorted(e["nodes"]) == ["orin", "server"] for e in events)
    assert manifest["restore"]["cpu_pacing_ended"] == ["orin", "server"]
    assert _pacing(lab, "orin") == {"paced": False, "cpus": None, "period_ms": None}
    assert all(f["steps"] > 0 and 0 <= f["violation_share"] <= 1 for f in manifest["fidelity"].values())
    assert all(f["computed_over"] + f["woke_late"] == f["overruns"] for f in manifest["fidelity"].values())

    # every step's target is the profile's prediction for the target model's share of layers
    steps = pd.read_parquet(out / "runs" / first / "steps.parquet")
    orin = load_profile(PROFILES_DIR / "agx-orin.yaml").rates("MODE_50W")
    a6000 = load_profile(PROFILES_DIR / "rtx-a6000.yaml").rates()
    assert {"device_layers", "device_head", "stage_layers"} <= set(steps["op"])
    for row in steps[steps["op"] == "device_layers"].itertuples():
        assert row.layers == 2 and row.target_s == pytest.approx(
            step_seconds(orin, VICUNA_7B, 2, [(row.tokens, row.context_tokens)]), abs=2e-6)
    for row in steps[steps["op"] == "device_head"].itertuples():
        assert row.target_s == pytest.approx(step_seconds(orin, VICUNA_7B, 0, [(row.tokens, 0)], row.tokens), abs=2e-6)
    stage = steps[(steps["op"] == "stage_layers") & (steps["sequences"] == 1)]
    assert set(stage["layers"]) == {15}  # Vicuna-7B's 30 middle layers over 2 stages, whatever the tiny split
    for row in stage.itertuples():
        assert row.target_s == pytest.approx(
            step_seconds(a6000, VICUNA_7B, 15, [(row.tokens, row.context_tokens)]), abs=2e-6)
    # a step lasts at least its target: the device's prefill layers before the first token
    requests = pd.read_parquet(out / "runs" / first / "requests.parquet")
    assert (requests["prefill_device_head_s"] >= 0.95 * requests["prompt_tokens"].map(
        lambda n: step_seconds(orin, VICUNA_7B, 2, [(n, 0)]))).all()  # fmt: skip

    # the prompt crossed the link at Vicuna-7B's 4096 x fp16 = 8 KiB a token
    assert (requests["prefill_upload_bytes"] == FRAME_AND_SEGMENT_HEADERS + 8192 * requests["prompt_tokens"]).all()

    # dilation 2: the schedule ran twice as slow, and analysis divides it back to the same arrivals
    raw = pd.read_parquet(out / "runs" / second / "requests.parquet")
    plain = pd.read_parquet(out / "runs" / first / "requests.parquet")
    assert list(raw["arrival_s"]) == pytest.approx([2 * a for a in plain["arrival_s"]])
    loaded = data.requests
    assert list(loaded.loc[loaded["run_id"] == second, "arrival_s"]) == pytest.approx(list(plain["arrival_s"]))
    assert set(loaded.loc[loaded["run_id"] == second, "time_dilation"]) == {2.0}
    # the report shows each node's overrun share, from the same steps
    report = build_report(out).read_text()
    fidelity = pd.read_csv(out / "report" / "fidelity.csv")
    assert "## Fidelity of the target emulation" in report and len(fidelity) == 4  # 2 runs x (orin, server)
    row = fidelity[(fidelity["run_id"] == first) & (fidelity["node"] == "orin")].iloc[0]
    assert row["violation_share"] == pytest.approx(manifest["fidelity"]["orin"]["violation_share"], abs=1e-4)
    second_steps = pd.read_parquet(out / "runs" / second / "steps.parquet")
    head = second_steps[second_steps["op"] == "device_head"].iloc[0]
    assert head.target_s == pytest.approx(2 * step_seconds(orin, VICUNA_7B, 0, [(head.tokens, 0)], head.tokens),
                                          abs=4e-6)  # fmt: skip


def test_an_unknown_target_or_a_node_without_a_profile_is_refused_at_its_line(lab, tmp_path):
    bad = run("run", str(campaign(tmp_path, lab, "{model: vicuna-700b}", "unknown")), "--out", str(tmp_path / "o1"))
    assert bad.returncode == 2
    assert "unknown.yaml:11: base.target.model: no built-in model 'vicuna-700b'" in bad.stderr + bad.stdout
    # the same lab as another inventory (its own prefix and state, not up: nothing is reached) with a
    # profile that does not exist
    text = lab.read_text().replace("compute_profile: agx-orin", "compute_profile: no-such-board")
    text = text.replace("name_prefix: tg", "name_prefix: tz").replace(str(lab.parent / "state"), str(tmp_path / "s"))
    other = tmp_path / "inventory.yaml"
    other.write_text(text)
    path = campaign(tmp_path, other, "{model: vicuna-7b}", "profileless")
    refused = run("run", str(path), "--out", str(tmp_path / "o2"))
    assert refused.returncode == 2
    said = refused.stderr + refused.stdout
    assert "profileless.yaml:11: base.target: " in said and "node orin: compute_profile 'no-such-board'" in said


def test_profile_gives_back_the_profile_a_node_is_paced_with_and_fits_the_real_engine(lab, tmp_path):
    from testbed.target.compute_profiles import load_profile as load

    paced = run("profile", "orin", "-i", str(lab), "--target", "vicuna-7b", "--mode", "MAXN", "--dilation", "4",
                "--reps", "2", "--out", str(tmp_path / "paced.yaml"), "--json")  # fmt: skip
    assert paced.returncode == 0, paced.stdout[-2000:] + paced.stderr[-2000:]
    result = json.loads(paced.stdout)
    assert result["paced"] and result["points"] >= 10 and result["agreement_with_paced_profile"] <= 0.05
    fitted = load(tmp_path / "paced.yaml")  # a valid profile file, every number with its source
    assert fitted.hardware == "agx-orin"
    measured = json.loads((tmp_path / "paced.measurements.json").read_text())
    assert len(measured["measurements"]) == result["points"] + result["excluded_points"]
    # a repetition that overran (computation, or a late wake under load) is not in its point's time
    # and is run again, a bounded number of times; a point is left out only when no repetition was clean
    from nodes.workers.profile_engine import RETRIES_PER_REP

    for m in measured["measurements"]:
        assert m["clean_reps"] == 2 or m["overruns"] >= 2 * RETRIES_PER_REP, m
        assert m["clean_reps"] + m["overruns"] <= 2 * (1 + RETRIES_PER_REP)
    assert result["overrun_repetitions"] == sum(m["overruns"] for m in measured["measurements"])
    # without --target: the real (tiny) engine on orin's CPU slice, fitted with orin's peak numbers
    real = run("profile", "orin", "-i", str(lab), "--reps", "1", "--out", str(tmp_path / "real.yaml"), "--json")
    assert real.returncode == 0, real.stdout[-2000:] + real.stderr[-2000:]
    assert not json.loads(real.stdout)["paced"] and load(tmp_path / "real.yaml").rates().mem_bw_gbps > 0


def test_device_slots_serve_a_devices_requests_at_once_with_the_same_tokens(lab, tmp_path):
    """HAT's lab serves every arrival at once: with ``device_slots: 3`` a device's three requests, one
    every 0.25 s, each start when they arrive (a free slot claims each), while with one slot they
    queue behind the request before; the tokens are the same request by request."""
    path = campaign(tmp_path, lab, "{model: vicuna-7b}", "slots", stages=1, rate_per_s=4.0, tokens=16,
                    matrix="device_slots: [1, 3]")  # fmt: skip
    out = tmp_path / "out"
    done = run("run", str(path), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = load(out)
    serial, slotted = (data.runs.loc[data.runs["device_slots"] == n, "run_id"].item() for n in (1, 3))
    requests = data.requests.assign(wait_s=lambda r: r["start_s"] - r["arrival_s"])
    one = requests[requests["run_id"] == serial].set_index("request_id")
    three = requests[requests["run_id"] == slotted].set_index("request_id")
    assert one["completed"].all() and three["completed"].all() and len(one) == len(three) == 3
    assert (three["wait_s"] < 0.1).all()  # every request started when it arrived
    assert one["wait_s"].max() > 0.2  # a request 0.25 s behind one that takes longer waited for it
    assert [list(t) for t in one["token_ids"]] == [list(t) for t in three["token_ids"]]
    ranks = sorted(p.name for p in (out / "runs" / slotted / "workers" / "ranks").iterdir() if p.name.startswith("dev"))
    assert ranks == ["device-0-orin", "device-1-orin", "device-2-orin"]
    assert json.loads((out / "runs" / slotted / "manifest.json").read_text())["settings"]["device_slots"] == 3
