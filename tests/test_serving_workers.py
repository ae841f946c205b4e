"""The serving engine and its clients as real MPI ranks (mpiexec on this host): many requests in
flight per client, a KV budget small enough that the scheduler preempts, and every request's tokens
equal to single-process greedy generation whether its KV was swapped out and back or dropped and
recomputed. The clients' token buffers show tokens no faster than each request's TDS_exp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "models" / "tiny"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
MAX_NEW_TOKENS = 20
PROMPTS = [
    "def read_config(path):\n    with open(path) as handle:\n        return",
    "import os\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.",
    "for i in range(10):\n    print(",
    "def add(a, b):\n    return",
    "x = [1, 2, 3]\ny =",
]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    from nodes.inference.checkpoint import load_whole
    from nodes.inference.generate import greedy_generate
    from nodes.inference.tokenizer import Tokenizer

    model, tokenizer = load_whole(str(TINY), dtype="float32"), Tokenizer(str(TINY))
    return {p: greedy_generate(model, tokenizer.encode(p), MAX_NEW_TOKENS, tokenizer.eos_id) for p in PROMPTS}


def serve(tmp_path: Path, serving: dict, devices: int = 2, tds: float = 30.0, target: dict | None = None,
          profile: dict | None = None, model: Path = TINY, prompts: list[str] = PROMPTS,
          spacing_s: float = 0.02) -> dict:  # fmt: skip
    """Run the engine and ``devices`` clients over the prompts (spread round robin, arriving
    ``spacing_s`` apart: by default all within 0.1 s); the clients' and the engine's records."""
    schedules = []
    for d in range(devices):
        path = tmp_path / f"device{d}.jsonl"
        rows = [{"request_id": i, "arrival_s": spacing_s * i, "prompt": p, "max_new_tokens": MAX_NEW_TOKENS,
                 "expected_ttft_s": 1.0, "expected_tds_tok_s": tds}
                for i, p in enumerate(prompts) if i % devices == d]  # fmt: skip
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        schedules.append(path)
    out = tmp_path / "out"
    config = {
        "run_id": "serving", "method": "serving", "model": str(model), "partition": {"device_layers": 0, "stages": 1},
        "out_dir": str(out), "serving": serving, "target": target,
        "ranks": [{"role": "stage", "node": "server", **({"profile": profile} if profile else {})}]
        + [{"role": "device", "node": f"dev{d}", "schedule": str(s)} for d, s in enumerate(schedules)],
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([str(MPIEXEC), "-n", str(1 + devices), sys.executable, "-m", "nodes.workers",
                           str(tmp_path / "config.json")], env=env, capture_output=True, text=True, timeout=240,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def lines(path: Path) -> list[str]:
        return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]

    clients = [json.loads(line) for d in range(devices) for line in lines(out / f"device-{d}-dev{d}" / "requests.jsonl")]
    tokens = {}
    for d in range(devices):
        rows = lines(out / f"device-{d}-dev{d}" / "tokens.csv")
        header = rows[0].split(",")
        for row in rows[1:]:
            entry = dict(zip(header, row.split(","), strict=True))
            tokens.setdefault((d, int(entry["request_id"])), []).append(
                (int(entry["index"]), float(entry["ts_s"]), float(entry["display_s"])))
    engine = [json.loads(line) for line in lines(out / "stage-0-server" / "engine_requests.jsonl")]
    iterations = lines(out / "stage-0-server" / "engine_iterations.csv")
    steps = out / "stage-0-server" / "steps.csv"
    return {"clients": clients, "tokens": tokens, "engine": engine, "iterations": iterations,
            "steps": lines(steps) if steps.exists() else []}


def check_tokens(result: dict, reference: dict[str, list[int]]) -> None:
    assert len(result["clients"]) == len(PROMPTS)
    for record in result["clients"]:
        assert record["token_ids"] == reference[PROMPTS[record["request_id"]]], record["request_id"]


@pytest.mark.parametrize(("swap_tokens", "kind"), [(None, "swaps"), (0, "recomputes")])
def test_preempted_requests_resume_token_for_token_after_a_swap_or_a_recompute(tmp_path, reference, swap_tokens, kind):
    # round robin every 3 iterations with room for about two requests: requests leave and come back. All
    # arrive at once: a client's three requests then overlap however fast this machine serves them
    result = serve(tmp_path, {"scheduler": "rr", "rr_interval": 3, "capacity_tokens": 140, "swap_tokens": swap_tokens},
                   spacing_s=0.0)  # fmt: skip
    check_tokens(result, reference)
    moved = sum(r["serving"][kind] for r in result["clients"])
    other = "recomputes" if kind == "swaps" else "swaps"
    assert moved > 0 and sum(r["serving"][other] for r in result["clients"]) == 0
    assert sum(r["serving"]["preemptions"] for r in result["clients"]) == moved
    assert {(r["device_rank"], r["request_id"]) for r in result["engine"]} == {
        (1 + i % 2, i) for i in range(len(PROMPTS))}


def test_the_engine_serves_smollm2_token_for_token_through_preemption(tmp_path):
    """The serving engine (Andes' scheduler, a KV budget that forces preemption) on the pretrained
    model: every request's tokens equal greedy generation of SmolLM2 alone."""
    from nodes.inference.checkpoint import load_whole
    from nodes.inference.generate import greedy_generate
    from nodes.inference.tokenizer import Tokenizer
    from testbed.models.packaged import PACKAGED, up_to_date

    packaged = PACKAGED["smollm2-135m"]
    assert up_to_date(packaged), f"SmolLM2-135M is not imported; fetch it: {packaged.fetch_command}"
    prompts = ["The capital of France is", "Water boils at a temperature of", "A haiku about autumn:\n",
               "def fibonacci(n):\n", "Three primary colours are", "The opposite of cold is"]  # fmt: skip
    model, tokenizer = load_whole(str(packaged.directory), dtype="float32"), Tokenizer(str(packaged.directory))
    reference = {p: greedy_generate(model, tokenizer.encode(p), MAX_NEW_TOKENS, tokenizer.eos_id) for p in prompts}
    del model
    result = serve(tmp_path, {"scheduler": "andes", "capacity_tokens": 60}, model=packaged.directory, prompts=prompts)
    assert len(result["clients"]) == len(prompts)
    for record in result["clients"]:
        assert record["token_ids"] == reference[prompts[record["request_id"]]], record["request_id"]
    assert sum(r["serving"]["preemptions"] for r in result["clients"]) > 0  # the budget made it preempt
    assert "Paris" in tokenizer.decode(reference[prompts[0]])


@pytest.mark.parametrize("scheduler", ["fcfs", "andes", "andes-dp"])
def test_every_scheduler_serves_every_request_exactly(tmp_path, reference, scheduler):
    result = serve(tmp_path, {"scheduler": scheduler, "capacity_tokens": 140})
    check_tokens(result, reference)
    assert len(result["iterations"]) > 1 + MAX_NEW_TOKENS  # several requests at once, more than one batch


def test_the_token_buffer_shows_tokens_at_the_expected_speed(tmp_path, reference):
    tds = 10.0  # tokens/s: a gap of 100 ms, slower than the engine makes them here even on a loaded machine
    result = serve(tmp_path, {"scheduler": "fcfs"}, devices=1, tds=tds)
    check_tokens(result, reference)
    for stamps in result["tokens"].values():
        stamps.sort()
        assert stamps[0][2] == stamps[0][1]  # the first token is shown as it arrives
        for (_, ts, shown), (_, _, before) in zip(stamps[1:], stamps[:-1], strict=True):
            assert shown >= ts - 1e-6 and shown >= before + 1 / tds - 1e-5
        # the buffer holds the tokens back: the last is shown later than it arrived (as long as the engine's
        # iterations take under 90 ms; the display times are computed, so a slower pace costs no time)
        assert stamps[-1][2] - stamps[-1][1] > 0.2


def test_a_request_that_cannot_fit_is_refused_and_one_that_fills_the_memory_ends_there(tmp_path, reference):
    from nodes.inference.tokenizer import Tokenizer

    capacity = 25  # KV tokens: the 31-token prompt never fits; the others stop once context + 1 would pass 25
    result = serve(tmp_path, {"scheduler": "fcfs", "capacity_tokens": capacity})
    lengths = [len(Tokenizer(str(TINY)).encode(p)) for p in PROMPTS]
    assert sorted(lengths)[-1] + 1 > capacity >= sorted(lengths)[-2] + 1 + 1
    for record in result["clients"]:
        prompt, want = lengths[record["request_id"]], reference[PROMPTS[record["request_id"]]]
        if prompt + 1 > capacity:
            assert record["finished_by"] == "refused" and record["token_ids"] == [] and record["ttft_s"] is None
        elif prompt + MAX_NEW_TOKENS <= capacity:
            assert record["finished_by"] == "length" and record["token_ids"] == want
        else:
            assert record["finished_by"] == "capacity"
            assert record["token_ids"] == want[: capacity - prompt]
    by_engine = {r["request_id"]: r["finished_by"] for r in result["engine"]}
    assert by_engine == {r["request_id"]: r["finished_by"] for r in result["clients"]}


def test_a_paced_engine_takes_one_target_step_an_iteration(tmp_path, reference):
    from nodes.contracts.compute_profile import step_seconds
    from nodes.contracts.target_model import builtin
    from testbed.target.compute_profiles import load_profile

    rates = load_profile(REPO / "examples" / "profiles" / "a100-80gb-vllm.yaml").rates()
    opt13 = builtin("opt-13b")
    result = serve(tmp_path, {"scheduler": "andes"}, target={"model": opt13.to_json(), "dilation": 1.0},
                   profile=rates.to_json())  # fmt: skip
    check_tokens(result, reference)
    header = result["steps"][0].split(",")
    steps = [dict(zip(header, row.split(","), strict=True)) for row in result["steps"][1:]]
    kinds = {row["op"] for row in steps}
    assert kinds == {"engine_prefill", "engine_decode"}
    assert len(steps) == len(result["iterations"]) - 1  # one paced step an iteration (the csv header aside)
    for row in steps:
        batch, context = int(row["sequences"]), int(row["context_tokens"])
        if row["op"] == "engine_decode":  # every sequence one new token: the step depends on the sum of contexts
            want = step_seconds(rates, opt13, opt13.layers, [(1, context / batch)] * batch, head_tokens=batch)
            assert float(row["target_s"]) == pytest.approx(want, rel=1e-4)
    # paced: the iterations took at least their steps' target time
    head = result["iterations"][0].split(",")
    starts = [float(dict(zip(head, row.split(","), strict=True))["start_s"]) for row in result["iterations"][1:]]
    assert starts[-1] - starts[0] >= 0.98 * sum(float(row["target_s"]) for row in steps[:-1])
