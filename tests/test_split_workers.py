"""Split-inference workers on the emulated testbed: real MPI ranks launched with mpiexec over SSH,
hidden states on the shaped data veths, and every method emitting exactly the tokens of
single-process greedy generation with the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

import pytest

from foundation.errors import NodeError
from testbed.commands.node_context import ensure_node_code, resolve_context
from testbed.emulation.resolved import load_lab
from testbed.transport import open_transport
from testbed.workers.split_run import run_split
from testbed.workers.split_spec import SplitRunSpec
from tests.conftest import emulated_inventory, emulated_lab, run_cli, veth_bytes

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root"),
    pytest.mark.slow,
    pytest.mark.root,
]

PREFIX = "tm"
TINY = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny"
DEVICES = ("orin", "xavier", "orin-nx")
MAX_NEW_TOKENS = 12  # enough for several speculative rounds
PROMPTS = [
    "def read_config(path):\n    with open(path) as handle:\n        return",
    "import os\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.",
]


RATE_B_S = {"narrow": 1e6, "mid": 4e6}  # the link profiles the lab adds, in bytes per second


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("split")
    path = emulated_inventory(directory, PREFIX, 218)
    profiles = "".join(f"  {name}: {{rate: {rate / 1e6:g}MBps}}\n" for name, rate in RATE_B_S.items())
    path.write_text(path.read_text().replace("link_profiles:\n", "link_profiles:\n" + profiles))
    with emulated_lab(path):
        yield path


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of single-process generation with the whole model, per prompt."""
    from nodes.inference.checkpoint import load_whole
    from nodes.inference.generate import greedy_generate
    from nodes.inference.tokenizer import Tokenizer

    model, tokenizer = load_whole(str(TINY), dtype="float32"), Tokenizer(str(TINY))
    return {p: greedy_generate(model, tokenizer.encode(p), MAX_NEW_TOKENS, tokenizer.eos_id) for p in PROMPTS}


def schedule(prompts, max_new_tokens, spacing_s=0.0):
    return tuple(
        {"request_id": i, "arrival_s": i * spacing_s, "prompt": p, "max_new_tokens": max_new_tokens}
        for i, p in enumerate(prompts)
    )


def stage_iterations(result, stage: int) -> list[dict[str, str]]:
    path = next(d for d in result.rank_dirs if d.name.startswith(f"stage-{stage}-")) / "iterations.csv"
    lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
    header = lines[0].split(",")
    return [dict(zip(header, line.split(","), strict=True)) for line in lines[1:]]


@pytest.mark.parametrize("method", ["centralized", "ushape", "usarathi", "pc", "sd", "sd_pc", "sd_pd", "hat"])
def test_every_method_emits_the_tokens_of_single_process_generation(lab, reference, tmp_path, method):
    inv = load_lab(lab)
    spec = SplitRunSpec(
        method=method, model=str(TINY), server="server", devices=DEVICES, stages=2, device_layers=2,
        chunk_tokens=16, schedule=schedule(PROMPTS, MAX_NEW_TOKENS), run_id=f"same-{method}", timeout_s=240,
    )  # fmt: skip
    result = run_split(inv, spec, tmp_path / method)
    requests = result.requests()
    assert len(requests) == len(DEVICES) * len(PROMPTS)
    for r in requests:
        prompt = PROMPTS[r["request_id"] % 1_000_000]
        assert r["token_ids"] == reference[prompt], (r["node"], prompt)
        assert r["method"] == method
        assert sum(r["prefill"]["chunks_tokens"]) == r["prompt_tokens"]
    first = stage_iterations(result, 0)
    prefill = [int(row["prefill_tokens"]) for row in first]
    longest = max(r["prompt_tokens"] for r in requests)
    if method == "usarathi":
        assert max(prefill) <= 16 < longest  # long prompts were spread over iterations
    elif method in ("pc", "sd_pc", "hat"):
        # the device sends chunks (the first request's of chunk_tokens, before anything is measured)
        assert any(len(r["prefill"]["chunks_tokens"]) > 1 for r in requests)
    else:
        assert max(prefill) >= longest  # prompts taken whole
        assert all(len(r["prefill"]["chunks_tokens"]) == 1 for r in requests)
    if method in ("sd", "sd_pc", "sd_pd", "hat"):
        rounds = [r["speculative"] for r in requests]
        assert all(s["rounds"] == r["decode"]["steps"] >= 1 for s, r in zip(rounds, requests, strict=True))
        for s, r in zip(rounds, requests, strict=True):  # every round emits its accepted drafts and one token
            assert sum(a + 1 for _, a, *_ in s["per_round"]) >= r["output_tokens"] - 1
            assert s["acceptance_length"] == pytest.approx(1 + s["accepted"] / s["rounds"], abs=1e-4)
        # verifications carry several positions: some decode-only iteration has more positions than segments
        assert any(int(row["decode_tokens"]) > int(row["segments"]) for row in first if row["prefill_tokens"] == "0")
        for s in rounds:  # parallel drafting runs at most Eq. 6's lambda steps, and only in pd methods
            assert all(steps <= lam <= 8 for *_, lam, steps in s["per_round"])
            assert method in ("sd_pd", "hat") or not s["parallel_rounds"]
    else:
        assert all("speculative" not in r for r in requests)
    assert sum(int(row["segments"]) for row in stage_iterations(result, 1)) > 0  # stage 1 ran too
    assert any(int(row["segments"]) > 1 for row in first)  # devices batched together at least once


def data_and_mgmt_bytes(inv, node: str) -> dict[str, int]:
    with open_transport(inv, inv.node(node)) as t:
        return veth_bytes(t.run(["cat", "/proc/net/dev"]).check().stdout)


def test_ttft_grows_with_the_upload_time_as_the_link_narrows(lab, tmp_path):
    """Three devices, P=2, prompts of a few hundred tokens: TTFT follows the hidden-state upload."""
    inv = load_lab(lab)
    text = (TINY.parent.parent.parent / "nodes" / "inference" / "model.py").read_text()
    prompts = [text[i * 900 : i * 900 + 1200] for i in range(2)]
    table = {}
    counters = {}
    for n in DEVICES:  # the node code is on each device before any bytes are counted (a lab's first run ships it)
        with open_transport(inv, inv.node(n)) as t:
            ensure_node_code(t, resolve_context(inv, inv.node(n)))
    for profile in (None, "mid", "narrow"):
        if profile:
            applied = run_cli("link", "apply", "-i", str(lab), "--profile", profile)
            assert applied.returncode == 0, applied.stdout + applied.stderr
        before = {n: data_and_mgmt_bytes(inv, n) for n in DEVICES}
        spec = SplitRunSpec(
            method="ushape", model=str(TINY), server="server", devices=DEVICES, stages=2, device_layers=2,
            schedule=schedule(prompts, 2, spacing_s=0.5), run_id=f"rate-{profile}", timeout_s=240,
        )  # fmt: skip
        requests = run_split(inv, spec, tmp_path / str(profile)).requests()
        after = {n: data_and_mgmt_bytes(inv, n) for n in DEVICES}
        counters[profile] = {
            n: {k: after[n][k] - before[n][k] for k in ("data0", "mgmt0")} for n in DEVICES
        }
        uploads = {n: sum(r["upload_bytes"] for r in requests if r["node"] == n) for n in DEVICES}
        for n in DEVICES:  # every byte of hidden state crossed the data veth, not the management one
            assert counters[profile][n]["data0"] >= uploads[n]
            assert counters[profile][n]["mgmt0"] < uploads[n] / 4
        table[profile] = {
            "ttft_median_s": statistics.median(r["ttft_s"] for r in requests),
            "network_median_s": statistics.median(r["prefill"]["network_s"] for r in requests),
            "upload_bytes_median": statistics.median(r["prefill"]["upload_bytes"] for r in requests),
            "prompt_tokens": sorted({r["prompt_tokens"] for r in requests}),
            # each upload's network share against the time its bytes take at the link's rate
            "network_over_upload_time_min": min(
                r["prefill"]["network_s"] * RATE_B_S[profile] / r["prefill"]["upload_bytes"] for r in requests
            ) if profile else None,
            "ttft_over_upload_time_min": min(
                r["ttft_s"] * RATE_B_S[profile] / r["prefill"]["upload_bytes"] for r in requests
            ) if profile else None,
        }
    (tmp_path / "ttft_by_rate.json").write_text(json.dumps(table, indent=1))
    print(json.dumps(table, indent=1))
    # The network share (round trip minus server residence, one clock) is never shorter than the
    # upload at the link's rate (less a burst's worth), however loaded the machine: load only adds. It
    # is not compared between 'mid' and no shaping, nor TTFT at 'mid': mid's ~0.1 s upload is within
    # what a loaded machine adds to a round trip (0.21 s measured once with no shaping).
    for profile in ("mid", "narrow"):
        assert table[profile]["network_over_upload_time_min"] >= 0.6, profile
    assert table[None]["network_median_s"] < table["narrow"]["network_median_s"]
    # TTFT holds the upload: never shorter than its bytes at the narrow link's rate. (TTFTs of separate
    # runs are not subtracted: load beside the test adds ~0.1-0.3 s to one run and not to another.)
    assert table["narrow"]["ttft_over_upload_time_min"] >= 0.6


def test_a_rank_that_fails_ends_the_run_with_its_node_and_reason(lab, tmp_path):
    broken = tmp_path / "broken-model"  # loads on no rank: every rank aborts, each saying why
    shutil.copytree(TINY, broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    inv = load_lab(lab)
    spec = SplitRunSpec(
        method="ushape", model=str(broken), server="server", devices=("orin",), stages=1, device_layers=2,
        chunk_tokens=16, schedule=schedule(PROMPTS[:1], 4), run_id="broken", timeout_s=120,
    )  # fmt: skip
    with pytest.raises(NodeError) as raised:
        run_split(inv, spec, tmp_path / "out")
    # the rank's own words, read from the abort file it left on its node, not hydra's generic summary
    assert raised.value.node in ("server", "orin")
    assert "failed:" in raised.value.message and "safetensors" in raised.value.message.lower(), raised.value
    log = (tmp_path / "out" / "mpiexec.log").read_text()  # the first abort may end the other rank first
    assert f"# {raised.value.node} aborted the launch:\nrank " in log


def test_reason_files_are_read_one_by_one_with_their_rank_oldest_first(tmp_path):
    """Each rank's reason stays whole (a traceback is not joined to another rank's last line), and
    the rank that aborted first comes first, whatever the names sort as."""
    import subprocess
    import time

    from nodes.contracts.rank_dirs import abort_reason_file
    from testbed.workers.mpi_launch import reason_files_script, split_reason_files

    (tmp_path / abort_reason_file(10)).write_text("rank 10 saw the abort\n")
    (tmp_path / abort_reason_file(2)).write_text("Traceback (most recent call last):\n  ...\nValueError: bad part\n")
    past = time.time() - 5
    os.utime(tmp_path / abort_reason_file(2), (past, past))  # rank 2 wrote first
    printed = subprocess.run(["sh", "-c", reason_files_script(str(tmp_path))], capture_output=True, text=True).stdout
    found = sorted(split_reason_files(printed))
    assert [(rank, text.splitlines()[-1]) for _, rank, text in found] == [
        (2, "ValueError: bad part"),
        (10, "rank 10 saw the abort"),
    ]
    assert found[0][0] < found[1][0] - 4
    assert split_reason_files(subprocess.run(["sh", "-c", reason_files_script(str(tmp_path / "gone"))],
                                             capture_output=True, text=True).stdout) == []  # fmt: skip
