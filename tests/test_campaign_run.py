"""Campaigns on the emulated testbed, through the real ``testbed run`` in a subprocess: runs
complete with their tables, telemetry and manifests; a device worker killed mid-run fails that run
(data kept, shaping and power restored) and the next run goes on; a controller killed with SIGKILL
mid-run is finished by ``--resume`` with every run done exactly once and nothing left behind.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from testbed.emulation.resolved import load_lab
from testbed.transport import open_transport
from tests.conftest import REPO, emulated_inventory, emulated_lab
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root"),
    pytest.mark.slow,
    pytest.mark.root,
]

PREFIX = "tc"
TINY = REPO / "examples" / "models" / "tiny"
WAIT_LIMIT_S = 240.0
POLL_S = 0.01  # how often the tests look for the event they wait on


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("campaign")
    path = emulated_inventory(directory, PREFIX, 214)
    with emulated_lab(path):
        yield path


def campaign_file(
    directory: Path, inventory: Path, *, name: str, methods: list[str], requests: int, warm: bool = True
) -> Path:
    """A campaign on orin + the server: orin at MODE_50W (its initial mode is MAXN), the links
    shaped with wifi-up, ``requests`` per run, in the listed order."""
    path = directory / f"{name}.yaml"
    path.write_text(f"""name: {name}
inventory: {inventory}
base:
  model: {TINY}
  partition: {{device_layers: 2, stages: 1}}
  devices: [orin]
  workload: {{arrival: constant, rate_per_s: 1.0, requests_per_device: {requests}, max_new_tokens: 20}}
  link: {{profile: wifi-up}}
  power: {{orin: MODE_50W}}
  drain_s: 0.2
matrix:
  method: {json.dumps(methods)}
order: listed
seed: 11
run_timeout_s: 120
warm_runs: {"true" if warm else "false"}
""")
    return path


def start_campaign(campaign: Path, out: Path, *extra: str) -> subprocess.Popen:
    log = (out.parent / f"{out.name}-controller.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "testbed", "run", str(campaign), "--out", str(out), *extra],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip


def ledger_rows(out: Path) -> list[tuple]:
    path = out / "ledger.sqlite"
    if not path.exists():
        return []
    with sqlite3.connect(path, timeout=30) as db:
        try:
            return db.execute(
                "SELECT position, run_id, state, attempts, reason, failed_node, started_s FROM runs ORDER BY position"
            ).fetchall()
        except sqlite3.OperationalError:  # the controller has created the file, not yet its tables
            return []


def orin_requests_file(inventory: Path, run_id: str, attempt: int) -> Path:
    home = inventory.parent / "state" / "nodes" / "orin" / "home"
    return home / "hil-testbed" / "runs" / f"{run_id}-a{attempt}" / "out" / "device-0-orin" / "requests.jsonl"


def served(path: Path, since_unix_s: float = 0.0) -> int:
    """Requests finished in a device's requests.jsonl (0 when it was last written before ``since_unix_s``:
    a file an earlier test's run of the same id left, before this attempt's stage removed it)."""
    try:
        if path.stat().st_mtime < since_unix_s:
            return 0
        return sum(1 for line in path.read_text().splitlines() if line.startswith("{"))
    except FileNotFoundError:
        return 0


def wait_until_serving(
    out: Path, inventory: Path, position: int, controller: subprocess.Popen, *, then: Callable[[], None] = lambda: None
) -> str:
    """Wait for the event "the run at ``position`` has finished a request on orin", then call ``then`` at
    once (before the run can go on much further); the run's id. Polled every POLL_S: only a hang meets
    the limit."""
    deadline = time.monotonic() + WAIT_LIMIT_S
    running: tuple | None = None
    while time.monotonic() < deadline:
        assert controller.poll() is None, f"the campaign ended early: {ledger_rows(out)}"
        if running is None:
            rows = ledger_rows(out)
            if len(rows) > position and rows[position][2] == "running":
                running = rows[position]
            elif len(rows) > position and rows[position][2] != "todo":
                raise AssertionError(f"run {position} ended before its first request was seen: {rows}")
        if running is not None and served(orin_requests_file(inventory, running[1], running[3]), running[6]) >= 1:
            then()
            return running[1]
        time.sleep(POLL_S)
    raise AssertionError(f"run {position} never started serving: {ledger_rows(out)}")


def device_worker_pids(inventory: Path) -> list[int]:
    """pids of orin's worker ranks of this lab (a warm pool's: its command line names orin's pool directory)."""
    marker = f"{inventory.parent}/state/nodes/orin/home/hil-testbed/pools/"
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            python = bool(words) and os.path.basename(words[0]).startswith(b"python")
            if python and b"nodes.workers" in words and any(w.startswith(marker.encode()) for w in words):
                pids.append(int(entry.name))  # the rank itself, not the shells and proxies around it
    return pids


def node_state(inventory: Path, node: str = "orin") -> dict[str, str]:
    """What tc has on the node's data veth and its power mode as nvpmodel reads it back."""
    lab = load_lab(inventory)
    with open_transport(lab, lab.node(node)) as t:
        qdiscs = t.run(["tc", "qdisc", "show", "dev", "data0"]).check().stdout
        mode = t.run(["nvpmodel", "-q"]).check().stdout
    return {"qdiscs": qdiscs, "mode": mode}


def test_warm_runs_compute_what_cold_runs_do_and_leave_the_nodes_set_only_between_runs(lab, tmp_path):
    # ushape then usarathi: one shape, the same model parts (they differ on the server's scheduling only)
    results = {}
    for warm in (True, False):
        campaign = campaign_file(tmp_path, lab, name=f"warm-{warm}", methods=["ushape", "usarathi"], requests=3,
                                 warm=warm)  # fmt: skip
        out = tmp_path / f"out-{warm}"
        controller = start_campaign(campaign, out)
        assert controller.wait(timeout=WAIT_LIMIT_S) == 0, (tmp_path / f"out-{warm}-controller.log").read_text()[-3000:]
        rows = ledger_rows(out)
        assert [r[2] for r in rows] == ["done", "done"], rows
        results[warm] = (out, [json.loads((out / "runs" / r[1] / "manifest.json").read_text()) for r in rows])
        state = node_state(lab)
        assert "1f7b:" not in state["qdiscs"] and "MAXN" in state["mode"], state  # the campaign's end restored
        assert not device_worker_pids(lab)
    (warm_out, (first, second)), (cold_out, (cold_first, cold_second)) = results[True], results[False]
    # warm: one pool; the second run reused every part its ranks hold, and found orin's mode and links set
    assert (first["workers"]["start"], second["workers"]["start"]) == ("cold", "warm")
    assert first["workers"]["pool"] == second["workers"]["pool"] and second["workers"]["runs_before"] == 1
    assert all(rank["reused"] and not rank["loaded"] for rank in second["workers"]["ranks"])
    # each rank's memory, measured at its run's end: resident, and its proportional share of what it maps
    assert all(0 < rank["memory"]["pss_kb"] <= rank["memory"]["rss_kb"] for rank in second["workers"]["ranks"])
    # link.profile shapes every link of the inventory, so every node holds shaping for the next run
    # the links between the machines the runs use (orin-nx and xavier, which no run uses, are left alone)
    assert first["restore"]["kept_for_next_run"] == {"power": ["orin"], "links": ["orin", "server"]}
    assert first["power"]["set"] == {"orin": "MODE_50W"} and second["power"]["unchanged"] == {"orin": "MODE_50W"}
    assert not any(link["changed"] for link in second["links"]["applied"])
    # the last run restores what it and the run before it set
    assert "kept_for_next_run" not in second["restore"] and second["restore"]["power"]["orin"]["mode"] == "MAXN"
    assert all(node["ok"] and not node["leftovers"] for node in second["restore"]["links"].values())
    # cold: a pool per run, each run configured and restored on its own
    assert (cold_first["workers"]["start"], cold_second["workers"]["start"]) == ("cold", "cold")
    assert cold_first["workers"]["pool"] != cold_second["workers"]["pool"]
    assert cold_second["power"]["set"] == {"orin": "MODE_50W"} and cold_first["restore"]["power"]["orin"]["ok"]
    # a reproduction's summary of the warm campaign: each method's means with intervals over its 3 requests,
    # usarathi against ushape on the same 3 requests
    from bench.campaign_reproduction import summary

    digest = summary(warm_out, ["method"], {"method": "ushape"})
    assert [g["settings"]["method"] for g in digest["groups"]] == ["usarathi", "ushape"]
    for group in digest["groups"]:
        assert group["requests"] == 3 and group["ttft_ms"]["low"] <= group["ttft_ms"]["estimate"] <= group["ttft_ms"]["high"]
    (change,) = digest["changes"]
    assert change["settings"] == {"method": "usarathi"} and change["pairs"] == 3 and "tbt_change" in change
    # the same requests give the same tokens, warm or cold
    for manifest in (first, second):
        warm_tokens = pd.read_parquet(warm_out / "runs" / manifest["run_id"] / "tokens.parquet")
        cold_tokens = pd.read_parquet(cold_out / "runs" / manifest["run_id"] / "tokens.parquet")
        key = ["node", "request_id", "index"]
        merged = warm_tokens.merge(cold_tokens, on=key, suffixes=("_warm", "_cold"))
        assert len(merged) == len(warm_tokens) == len(cold_tokens) > 0
        assert (merged.token_id_warm == merged.token_id_cold).all()


def test_a_killed_device_worker_fails_its_run_and_the_next_run_proceeds(lab, tmp_path):
    campaign = campaign_file(tmp_path, lab, name="killed-worker", methods=["ushape", "centralized"], requests=5)
    out = tmp_path / "out"
    controller = start_campaign(campaign, out)
    worker: list[int] = []

    def freeze() -> None:  # the moment the first request is seen done: what the worker finished stays as it is
        worker.extend(device_worker_pids(lab))
        assert len(worker) == 1, worker
        os.kill(worker[0], signal.SIGSTOP)

    try:
        killed_run = wait_until_serving(out, lab, 0, controller, then=freeze)
        finished_before_kill = served(orin_requests_file(lab, killed_run, 1))  # the stopped worker writes no more
        os.kill(worker[0], signal.SIGKILL)
        assert controller.wait(timeout=WAIT_LIMIT_S) == 1  # a failed run: exit status 1
    finally:
        if controller.poll() is None:
            controller.kill()
    rows = ledger_rows(out)
    assert [(r[2], r[3]) for r in rows] == [("failed", 1), ("done", 1)], rows
    failed = rows[0]
    assert "worker pool exit" in failed[4] and failed[5] == "orin", failed
    manifest = json.loads((out / "runs" / failed[1] / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["attempt"] == 1
    # the log the reason points at is where the reason says, once the attempt's directory is the run's
    for reason in (failed[4], manifest["reason"]):
        assert "(see " in reason and Path(reason.rsplit("(see ", 1)[1].rstrip(")")).is_file(), reason
    # the failed run's pool was torn down: the next run started a new one, cold
    second = json.loads((out / "runs" / rows[1][1] / "manifest.json").read_text())
    assert manifest["workers"]["start"] == "cold" and second["workers"]["start"] == "cold"
    assert second["workers"]["pool"] != manifest["workers"]["pool"]
    assert manifest["restore"]["links"]["orin"]["ok"] and manifest["restore"]["power"]["orin"]["ok"]
    requests = pd.read_parquet(out / "runs" / failed[1] / "requests.parquet")
    assert len(requests) == 5  # every scheduled request has a row
    assert 1 <= finished_before_kill < 5
    assert requests.completed.sum() == finished_before_kill  # exactly what finished before the kill is kept
    assert (out / "runs" / failed[1] / "telemetry" / "orin.parquet").exists()
    done = pd.read_parquet(out / "runs" / rows[1][1] / "requests.parquet")
    assert done.completed.all() and len(done) == 5
    state = node_state(lab)
    assert "1f7b:" not in state["qdiscs"] and "MAXN" in state["mode"], state
    assert "1f7b:" not in node_state(lab, "orin-nx")["qdiscs"]
    assert not device_worker_pids(lab)  # the campaign's end stopped the second pool


def test_sigkill_of_the_controller_then_resume_does_every_run_exactly_once(lab, tmp_path):
    campaign = campaign_file(tmp_path, lab, name="resumed", methods=["ushape", "centralized", "usarathi"], requests=4)
    out = tmp_path / "out"
    controller = start_campaign(campaign, out)
    try:
        killed_id = wait_until_serving(out, lab, 1, controller, then=lambda: controller.send_signal(signal.SIGKILL))
        controller.wait(timeout=30)
        assert len(device_worker_pids(lab)) == 1  # the pool that served the first run serves the second
    finally:
        if controller.poll() is None:
            controller.kill()
    rows = ledger_rows(out)
    assert [r[2] for r in rows] == ["done", "running", "todo"], rows
    left = node_state(lab)
    assert "1f7b:" in left["qdiscs"] and "MODE_50W" in left["mode"], left  # the crash left orin changed
    # and nothing on orin-nx, which no run uses (its links to the server, in the devices group, are left
    # to whoever uses it: another campaign may)
    assert "1f7b:" not in node_state(lab, "orin-nx")["qdiscs"]
    # what --resume does first (recover) restores both, before any run could fail and leave them
    from testbed.campaign.load import load_campaign
    from testbed.campaign.runner import open_campaign, recover

    loaded = load_campaign(campaign)
    with open_campaign(loaded, out) as ledger:
        assert recover(loaded, out, ledger, say=lambda _: None) == [killed_id]
    assert "1f7b:" not in node_state(lab, "orin-nx")["qdiscs"] and "1f7b:" not in node_state(lab)["qdiscs"]

    resumed = start_campaign(campaign, out, "--resume")
    assert resumed.wait(timeout=WAIT_LIMIT_S * 2) == 0, (out.parent / "out-controller.log").read_text()[-3000:]
    rows = ledger_rows(out)
    assert [(r[2], r[3]) for r in rows] == [("done", 1), ("done", 2), ("done", 1)], rows
    assert (out / "runs" / f"{killed_id}.attempt1.interrupted").is_dir()
    for _, run_id, *_ in rows:
        run_dir = out / "runs" / run_id
        manifest = json.loads((run_dir / "manifest.json").read_text())
        requests = pd.read_parquet(run_dir / "requests.parquet")
        assert manifest["status"] == "done" and manifest["requests"] == {"scheduled": 4, "completed": 4}
        assert len(requests) == 4 and requests.completed.all() and not requests.request_id.duplicated().any()
        # each device's wall clock at its start barrier is recorded, so analysis can place requests
        # on the controller's clock: the run happened between the manifest's start and end
        origins = requests.clock_origin_unix_s
        assert origins.notna().all(), requests
        assert (manifest["started_unix_s"] < origins).all() and (origins < manifest["ended_unix_s"]).all()
    killed = json.loads((out / "runs" / killed_id / "manifest.json").read_text())
    assert killed["attempt"] == 2
    # the resumed invocation started its own pool (the dead controller's was ended) and kept it warm
    starts = [json.loads((out / "runs" / r[1] / "manifest.json").read_text())["workers"]["start"] for r in rows]
    assert starts == ["cold", "cold", "warm"], starts
    state = node_state(lab)
    assert "1f7b:" not in state["qdiscs"] and "MAXN" in state["mode"], state
    assert "1f7b:" not in node_state(lab, "orin-nx")["qdiscs"]
    assert not device_worker_pids(lab)
    pools = list((lab.parent / "state" / "nodes" / "server" / "home" / "hil-testbed" / "pools").glob("*/order.json"))
    pools = [p.parent for p in pools]
    assert pools  # a pool served the runs; its pidfile is gone (stopped) or names a dead process
    assert not any(_alive(d / "mpiexec.pid") for d in pools if (d / "mpiexec.pid").exists()), pools


def _alive(pidfile: Path) -> bool:
    """Whether the process a pidfile names (``pid starttime``) is still running."""
    pid = int(pidfile.read_text().split()[0])
    return Path(f"/proc/{pid}").exists()


def test_sigterm_in_a_warm_run_restores_what_the_runs_had_left_set(lab, tmp_path):
    # SIGTERM (as Ctrl-C) while the second run is served by the warm pool, with orin's mode and every
    # link held from the first run: the interrupted run keeps nothing, the campaign's end stops the pool
    campaign = campaign_file(tmp_path, lab, name="terminated", methods=["ushape", "usarathi", "centralized"],
                             requests=4)  # fmt: skip
    out = tmp_path / "out"
    controller = start_campaign(campaign, out)
    try:
        run_id = wait_until_serving(out, lab, 1, controller, then=lambda: controller.send_signal(signal.SIGTERM))
        assert controller.wait(timeout=WAIT_LIMIT_S) == 130  # interrupted: neither done nor a failed run
    finally:
        if controller.poll() is None:
            controller.kill()
    rows = ledger_rows(out)
    assert [r[2] for r in rows] == ["done", "running", "todo"], rows  # --resume runs it again
    assert "--resume` goes on" in (tmp_path / "out-controller.log").read_text()
    manifest = json.loads((out / "runs" / f"{run_id}.attempt1" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["reason"].startswith("interrupted")
    assert "kept_for_next_run" not in manifest["restore"]
    state = node_state(lab)
    assert "1f7b:" not in state["qdiscs"] and "MAXN" in state["mode"], state
    assert "1f7b:" not in node_state(lab, "orin-nx")["qdiscs"]
    # a pool ended by its pidfile (its stop order not answered in time, mpiexec signalled) may have its ranks
    # on orin end just after the controller
    wait_until(lambda: not device_worker_pids(lab), lambda: f"orin's worker ranks to end: {device_worker_pids(lab)}",
               30, interval_s=0.2)  # fmt: skip
