"""A warm worker pool on this host (``python -m nodes.workers --pool``, real MPI ranks started by this
machine's mpiexec): it serves runs one after another with the tokens a single-run launch computes,
reuses the model parts a run shares with the one before and loads the ones it does not, starts every
run afresh (its seed, schedule and clock origin), stops on a stop order or after its idle timeout, and
ends the whole pool (MPI_Abort) on a run whose ranks do not match its shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodes.contracts.run_config import DraftSettings, RankSpec, RunConfig
from nodes.workers.part_cache import PartCache
from testbed.workers.mpi_launch import data_plane_env
from tests.conftest import REPO
from tests.waiting import wait_until

TINY = REPO / "examples" / "models" / "tiny"
PROMPTS = (
    "def read_config(path):\n    with open(path) as handle:\n        return",
    "class Stack:\n    def push(self, x):",
)
LIMIT_S = 120.0


def write_run(
    runs: Path,
    run_id: str,
    method: str,
    *,
    devices: int = 1,
    seed: int = 0,
    gap_s: float = 0.05,
    deadline_s: float | None = None,
) -> Path:
    """A run directory with its config and one schedule per device (two requests each, ``gap_s`` apart)."""
    directory = runs / run_id
    directory.mkdir(parents=True)
    ranks = [RankSpec("stage", "server", 0), RankSpec("stage", "server", 1)]
    for index in range(devices):
        schedule = directory / f"schedule-{index}.jsonl"
        schedule.write_text("".join(json.dumps({"request_id": i, "arrival_s": gap_s * i, "prompt": p,
                                                "max_new_tokens": 6}) + "\n" for i, p in enumerate(PROMPTS)))  # fmt: skip
        ranks.append(RankSpec("device", f"dev{index}", index, schedule=str(schedule)))
    config = RunConfig(run_id, method, str(TINY), "float32", 2, 2, 128, str(directory / "out"), tuple(ranks), seed,
                       DraftSettings(), deadline_s)  # fmt: skip
    (directory / "run.json").write_text(json.dumps(config.to_json()))
    return directory / "run.json"


def mpiexec(ranks: int, *args: str) -> list[str]:
    env = [a for k, v in data_plane_env("lo").items() for a in ("-env", k, v)]
    return [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), *env, sys.executable, "-m", "nodes.workers",
            *args]  # fmt: skip


def start_pool(tmp: Path, ranks: int = 3, idle_timeout_s: float = 60.0) -> subprocess.Popen:
    (tmp / "pool").mkdir(exist_ok=True)
    return subprocess.Popen(
        mpiexec(ranks, "--pool", str(tmp / "pool"), "--runs", str(tmp / "runs"), "--idle-timeout-s", str(idle_timeout_s)),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def order(tmp: Path, number: int, **what: str) -> None:
    path = tmp / "pool" / "order.json"
    path.with_suffix(".tmp").write_text(json.dumps({"number": number, **what}))
    path.with_suffix(".tmp").rename(path)


def served(tmp: Path, run_id: str, pool: subprocess.Popen) -> dict:
    record = tmp / "runs" / run_id / "pool-run.json"
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:
        if record.exists():
            return json.loads(record.read_text())
        assert pool.poll() is None, pool.communicate()[0][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"the pool never finished {run_id}")


def tokens(tmp: Path, run_id: str) -> dict[tuple[str, int], list[int]]:
    out = {}
    for path in (tmp / "runs" / run_id / "out").glob("device-*/requests.jsonl"):
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                out[(row["node"], row["request_id"])] = row["token_ids"]
    return out


def origins(tmp: Path, run_id: str) -> list[float]:
    path = next((tmp / "runs" / run_id / "out").glob("device-*/requests.jsonl"))
    return [json.loads(path.read_text().splitlines()[0][1:])["clock_origin_monotonic_s"]]


def test_a_pool_serves_runs_in_turn_with_the_tokens_of_a_single_run_launch(tmp_path):
    for run_id, method in (("a", "ushape"), ("b", "usarathi"), ("c", "centralized"), ("single", "usarathi")):
        write_run(tmp_path / "runs", run_id, method, seed=ord(run_id[0]))
    single = subprocess.run(mpiexec(3, str(tmp_path / "runs" / "single" / "run.json")), cwd=REPO, capture_output=True,
                            text=True, timeout=LIMIT_S, check=False)  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    pool = start_pool(tmp_path)
    try:
        records = {}
        for number, run_id in enumerate(("a", "b", "c"), 1):
            order(tmp_path, number, run=run_id)
            records[run_id] = served(tmp_path, run_id, pool)
        order(tmp_path, 4, stop="the test is done")
        output, _ = pool.communicate(timeout=LIMIT_S)
    finally:
        if pool.poll() is None:
            pool.kill()
    assert pool.returncode == 0, output[-3000:]
    assert "stops after 3 runs: the test is done" in output
    assert [records[r]["runs_before"] for r in "abc"] == [0, 1, 2]
    # a and b hold the same parts (usarathi differs from ushape only on the server's side): b reuses them
    # all; c (centralized) needs the whole model on the server and nothing on the device
    first, second, third = (records[r]["ranks"] for r in "abc")
    assert all(rank["loaded"] and not rank["reused"] for rank in first)
    assert all(rank["reused"] and not rank["loaded"] for rank in second)
    # each rank set up faster reusing its parts than it did loading them (rank by rank: a loaded machine's
    # stall of some ms in one rank's setup is not compared with the quickest load of another rank's parts)
    assert all(again["setup_s"] < loading["setup_s"] for loading, again in zip(first, second, strict=True))
    assert all(rank["loaded"] for rank in third if rank["role"] == "stage")
    assert not any(rank["loaded"] or rank["reused"] for rank in third if rank["role"] == "device")
    # a warm run computes what a cold launch computes; every run has its own files and clock origin
    assert tokens(tmp_path, "b") == tokens(tmp_path, "single") and len(tokens(tmp_path, "b")) == 2
    assert tokens(tmp_path, "a") == tokens(tmp_path, "b")  # ushape and usarathi: the same greedy tokens
    assert origins(tmp_path, "a") < origins(tmp_path, "b") < origins(tmp_path, "c")
    assert all((tmp_path / "runs" / r / "out" / "stage-0-server" / "iterations.csv").exists() for r in "abc")


def test_an_idle_pool_stops_by_itself(tmp_path):
    pool = start_pool(tmp_path, idle_timeout_s=2.0)
    output, _ = pool.communicate(timeout=LIMIT_S)
    assert pool.returncode == 0 and "stops after 0 runs: no order for 2 s" in output


def test_a_run_of_another_shape_ends_the_pool(tmp_path):
    write_run(tmp_path / "runs", "one-device", "ushape")
    write_run(tmp_path / "runs", "two-devices", "ushape", devices=2)
    pool = start_pool(tmp_path)
    try:
        order(tmp_path, 1, run="one-device")
        served(tmp_path, "one-device", pool)
        order(tmp_path, 2, run="two-devices")
        output, _ = pool.communicate(timeout=LIMIT_S)
    finally:
        if pool.poll() is None:
            pool.kill()
    assert pool.returncode != 0
    # every rank says why in the run's directory before MPI_Abort: mpiexec may end before it forwards
    # their stderr (it did once in CI), the controller reads these files instead
    reasons = [(tmp_path / "runs" / "two-devices" / f"abort-rank-{rank}.txt") for rank in range(3)]
    assert all(path.read_text() == "run two-devices lists 4 ranks, the pool has 3\n" for path in reasons), output
    assert not (tmp_path / "runs" / "two-devices" / "pool-run.json").exists()


def test_a_run_past_its_deadline_ends_the_pool(tmp_path):
    write_run(tmp_path / "runs", "slow", "ushape", gap_s=60.0, deadline_s=2.0)  # its second request comes at 60 s
    pool = start_pool(tmp_path)
    started = time.monotonic()
    try:
        order(tmp_path, 1, run="slow")
        output, _ = pool.communicate(timeout=LIMIT_S)
    finally:
        if pool.poll() is None:
            pool.kill()
    # ended long before its second request (the pool's start, its ranks importing torch, counts too: a loaded
    # machine takes seconds for it)
    assert pool.returncode != 0 and time.monotonic() - started < 45.0
    assert "run slow still going 2 s after its start: ended" in output
    said = [path.read_text() for path in (tmp_path / "runs" / "slow").glob("abort-rank-*.txt")]
    assert said and all("run slow still going 2 s after its start: ended" in text for text in said)
    assert not (tmp_path / "runs" / "slow" / "pool-run.json").exists()


def test_the_part_cache_keeps_only_what_the_last_run_asked_for():
    cache = PartCache()
    loads = []

    def loader(name):
        return lambda: loads.append(name) or name

    assert cache.get("a", loader("a"), "part a") == "a" and cache.get("b", loader("b"), "part b") == "b"
    cache.settle()
    assert cache.take_report() == {"loaded": ["part a", "part b"], "reused": []}
    cache.get("a", loader("a"), "part a")
    cache.settle()  # b was not asked for: dropped
    assert cache.take_report() == {"loaded": [], "reused": ["part a"]}
    cache.get("b", loader("b"), "part b")
    assert loads == ["a", "b", "b"]


def test_the_part_cache_drops_what_the_run_has_not_asked_for_before_it_loads():
    cache = PartCache()
    held_while_loading = []
    cache.get("old", lambda: "old", "old part")
    cache.settle()
    cache.get("new", lambda: held_while_loading.extend(cache._held) or "new", "new part")
    assert held_while_loading == []  # the old part was gone before the new one was loaded
    cache.get("old", lambda: "old", "old part")  # asked for again in the same run: loaded again, kept
    assert sorted(cache._held) == ["new", "old"]


@pytest.fixture(autouse=True)
def _no_leftover_ranks(tmp_path_factory):
    """Every rank a test started is gone within seconds of its mpiexec (an aborted rank takes a moment).
    Only this test session's ranks count (their files are under its base temporary directory): other
    sessions on the machine, or other xdist workers, run pools of their own."""
    ours = str(tmp_path_factory.getbasetemp()).encode()
    yield

    def left() -> list[Path]:
        return [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pool_rank(p, ours)]

    wait_until(lambda: not left(), lambda: f"the pool ranks to end: {left()}", 10.0, interval_s=0.1)


def _pool_rank(proc: Path, base: bytes) -> bool:
    try:
        words = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return (
        b"nodes.workers" in words
        and b"--pool" in words
        and os.getpid() != int(proc.name)
        and any(w.startswith(base) for w in words)
    )


def test_a_pool_counts_as_ended_when_its_status_is_there_or_its_process_is_gone(tmp_path):
    from testbed.workers.pool import PoolFiles, alive_check

    files = PoolFiles(str(tmp_path))

    def ended() -> bool:
        return subprocess.run(["sh", "-c", alive_check(files)], check=False).returncode == 0

    assert ended()  # never started: no pidfile
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        start = Path(f"/proc/{sleeper.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        Path(files.pidfile).write_text(f"{sleeper.pid} {start}\n")
        assert not ended()
        Path(files.pidfile).write_text(f"{sleeper.pid} 1\n")  # the pid now names another process
        assert ended()
        Path(files.pidfile).write_text(f"{sleeper.pid} {start}\n")
        Path(files.status).write_text("0\n")
        assert ended()
        Path(files.status).unlink()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert ended()
