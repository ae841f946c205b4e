"""Kill trials: the controller (``testbed run`` in a subprocess) killed with SIGKILL at chosen and at
random points of a small campaign on an emulated lab, each kill followed by ``testbed run --resume``
until the campaign completes. Then every run must be in the ledger once, as done, with its attempts
recorded and its requests once each; and nothing the testbed sets may be left on any node: our
qdiscs, ifb devices and iptables chains, the link and power journals, a power mode other than the
initial one, and any process of ours (sampler, iperf3, delay handler, worker, pool) in the nodes'
network namespaces.

Kill points (the kill lands right after the event is seen; files are polled every few milliseconds):

    verify          an iperf3 server of link verification has its pidfile on a node
    sampler         a telemetry sampler has its pidfile on a node (started; maybe not yet noted)
    noted-sampler   an attempt's processes.json names a sampler (noted; maybe not yet started)
    phase:NAME      a run's events.jsonl says that phase NAME started (e.g. phase:restore)
    run-end:N       the N-th run_end event (between runs, with the nodes set for the next run)
    uniform         a uniformly drawn moment of an uninterrupted campaign's duration

    python bench/kill_trials.py                   # 20 trials
    python bench/kill_trials.py --trials 6 --seed 2

Writes bench/results/kill_trials.json (machine, commit, each trial's point, moment, resumes and
problems). Needs root (network namespaces); brings its own lab up (prefix hdk, subnets 10.152/153)
and takes it down after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emulated_inventory, emulated_node

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
POLL_S = 0.005
CAMPAIGN_LIMIT_S = 600.0  # one invocation of the small campaign; only a hang comes near it
MAX_RESUMES = 4
OUR_QDISC = "1f7b:"  # netem.plan.HTB_HANDLE
OUR_CHAIN = "-N TB-"  # netem.nfqueue.chain_name
INITIAL_MODE = "MAXN"
TWENTY = (["verify"] * 4 + ["sampler"] * 3 + ["noted-sampler"] * 2 + ["phase:restore", "phase:collect"]
          + ["run-end:1"] * 2 + ["uniform"] * 7)  # fmt: skip


def inventory_text(state_dir: Path, prefix: str, octet: int) -> str:
    """A server and one Jetson, rate-shaped both ways (HTB only: verify compares goodput with the rate)."""
    nodes = [emulated_node("server", "server", "a6000-server", "server", ((0, "default", 1.0, 90, 300),)),
             emulated_node("orin", "jetson", "agx-orin", "device", ((0, INITIAL_MODE, 0.5, 7, 40),
                                                                    (3, "MODE_50W", 0.4, 6.5, 50)), initial_mode=0)]
    links = ("groups: {devices: [orin]}\nlink_profiles: {up: {rate: 2MBps}, down: {rate: 3MBps}}\n"
             "links:\n  - {from: devices, to: server, profile: up}\n  - {from: server, to: devices, profile: down}\n")
    return emulated_inventory(state_dir, prefix, octet, nodes, links)  # fmt: skip


def campaign_text(inventory: Path, name: str = "kills") -> str:
    """Two warm runs: orin's power mode set, both links shaped and verified with iperf3, telemetry."""
    return f"""name: {name}
inventory: {inventory}
base:
  model: {TINY}
  partition: {{device_layers: 2, stages: 1}}
  devices: [orin]
  workload: {{arrival: constant, rate_per_s: 2.0, requests_per_device: 2, max_new_tokens: 8}}
  link: {{verify_s: 2}}
  power: {{orin: MODE_50W}}
  drain_s: 0.2
matrix:
  method: [ushape, centralized]
order: listed
seed: 11
run_timeout_s: 120
"""


@dataclass(frozen=True)
class Lab:
    inventory: Path
    prefix: str
    nodes: tuple[str, ...] = ("server", "orin")

    @property
    def state(self) -> Path:
        return self.inventory.parent / "state"

    def home(self, node: str) -> Path:
        """The node's workdir as seen from this host (emulated nodes' homes live in the state directory)."""
        return self.state / "nodes" / node / "home" / "hil-testbed"

    def namespace(self, node: str) -> str:
        return f"{self.prefix}-{node}"


def start_controller(campaign: Path, out: Path, *extra: str) -> subprocess.Popen:
    log = (out.parent / f"{out.name}-controller.log").open("ab")
    return subprocess.Popen([sys.executable, "-m", "testbed", "run", str(campaign), "--out", str(out), *extra],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip


# -- kill points --------------------------------------------------------------------------------


def _fresh(paths: list[Path], since: float) -> bool:
    for path in paths:
        try:
            if path.stat().st_mtime >= since and path.stat().st_size > 0:
                return True
        except OSError:
            continue
    return False


def _events(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in (out / "runs").glob("*/events.jsonl"):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # being written
    return rows


def trigger(point: str, lab: Lab, out: Path, started: float, at_s: float | None) -> Callable[[], bool]:
    """A test that turns true when the controller reached ``point`` (``started``: its wall-clock start)."""
    if point == "verify":
        return lambda: _fresh([p for n in lab.nodes for p in (lab.home(n) / "netem").glob("iperf3-*.pid")], started)
    if point == "sampler":
        return lambda: _fresh([p for n in lab.nodes for p in (lab.home(n) / "telemetry").glob("*/*.pid")], started)
    if point == "noted-sampler":
        def noted() -> bool:
            for path in (out / "runs").glob("*/processes.json"):
                try:
                    if "/telemetry/" in path.read_text():
                        return True
                except OSError:
                    continue
            return False

        return noted
    if point.startswith("phase:"):
        phase = point.split(":", 1)[1]
        return lambda: any(e.get("event") == "phase_start" and e.get("phase") == phase for e in _events(out))
    if point.startswith("run-end:"):
        count = int(point.split(":", 1)[1])
        return lambda: sum(e.get("event") == "run_end" for e in _events(out)) >= count
    if point == "uniform":
        assert at_s is not None
        return lambda: time.time() - started >= at_s
    raise ValueError(f"unknown kill point {point!r}")


# -- what a trial leaves ------------------------------------------------------------------------


def ledger_rows(out: Path) -> list[tuple[str, str, int]]:
    path = out / "ledger.sqlite"
    if not path.is_file():
        return []
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30) as db:
        try:
            return db.execute("SELECT run_id, state, attempts FROM runs ORDER BY position").fetchall()
        except sqlite3.OperationalError:
            return []


def run_problems(out: Path) -> list[str]:
    """Every run done once: its directory with this attempt's manifest, each scheduled request once and
    completed, and the earlier attempts set aside under their own numbers."""
    import pandas as pd

    problems = []
    rows = ledger_rows(out)
    if not rows:
        return ["no ledger"]
    for run_id, state, attempts in rows:
        if state != "done":
            problems.append(f"{run_id}: {state} after {attempts} attempts")
            continue
        manifest_path = out / "runs" / run_id / "manifest.json"
        if not manifest_path.is_file():
            problems.append(f"{run_id}: done without runs/{run_id}/manifest.json")
            continue
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("status") != "done" or manifest.get("attempt") != attempts:
            problems.append(f"{run_id}: manifest {manifest.get('status')} attempt {manifest.get('attempt')}, "
                            f"ledger done attempt {attempts}")  # fmt: skip
        requests = pd.read_parquet(out / "runs" / run_id / "requests.parquet")
        scheduled = (manifest.get("requests") or {}).get("scheduled")
        if len(requests) != scheduled or requests.duplicated(["node", "request_id"]).any():
            problems.append(f"{run_id}: {len(requests)} request rows for {scheduled} scheduled (or duplicates)")
        if not requests.completed.all():
            problems.append(f"{run_id}: {int((~requests.completed).sum())} requests not completed")
        numbers = [attempts]
        for aside in (out / "runs").glob(f"{run_id}.attempt*"):
            numbers.append(int(aside.name.split(".attempt", 1)[1].split(".", 1)[0]))
        if sorted(numbers) != sorted(set(numbers)) or max(numbers) != attempts:
            problems.append(f"{run_id}: attempts on disk {sorted(numbers)}, ledger {attempts}")
    return problems


def _netns(lab: Lab, node: str, *argv: str) -> str:
    done = subprocess.run(["ip", "netns", "exec", lab.namespace(node), *argv], capture_output=True, text=True,
                          timeout=30, check=False)  # fmt: skip
    return done.stdout


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def processes_left(lab: Lab, node: str) -> list[str]:
    """Processes in the node's namespace other than its sshd (listener, or a session closing)."""
    pids = subprocess.run(["ip", "netns", "pids", lab.namespace(node)], capture_output=True, text=True, timeout=30,
                          check=False).stdout.split()  # fmt: skip
    lines = [(pid, _cmdline(pid)) for pid in pids]
    return [f"{pid} {line[:160]}" for pid, line in lines if line and not line.startswith("sshd")]


def node_problems(lab: Lab, settle_s: float = 15.0) -> list[str]:
    """What is left set on the lab's nodes (processes get ``settle_s`` to go: sessions close)."""
    problems = []
    for node in lab.nodes:
        qdiscs = _netns(lab, node, "tc", "qdisc", "show")
        if OUR_QDISC in qdiscs or "ingress ffff:" in qdiscs:
            problems.append(f"{node}: qdiscs of ours left: {qdiscs.strip()}")
        if "ifb" in _netns(lab, node, "ip", "-o", "link", "show", "type", "ifb"):
            problems.append(f"{node}: an ifb device left")
        chains = [line for line in _netns(lab, node, "iptables", "-w", "-t", "mangle", "-S").splitlines()
                  if line.startswith(OUR_CHAIN)]  # fmt: skip
        if chains:
            problems.append(f"{node}: iptables chains left: {chains}")
        for journal in ("netem/journal.json", "power/journal.json"):
            if (lab.home(node) / journal).exists():
                problems.append(f"{node}: {journal} left")
        deadline = time.monotonic() + settle_s
        left = processes_left(lab, node)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = processes_left(lab, node)
        problems += [f"{node}: process left: {p}" for p in left]
    problems += power_problems(lab)
    return problems


def power_problems(lab: Lab) -> list[str]:
    """Nodes whose power mode, read back through the testbed, is not the initial one (or has a journal)."""
    from testbed.emulation.resolved import load_lab
    from testbed.energy.power_modes import show_power

    shown = show_power(load_lab(lab.inventory), ["orin"])
    problems = [f"{o.node}: power mode unreadable: {o.error}" for o in shown.failed]
    for node, reading in shown.values().items():
        if reading.mode_name != INITIAL_MODE or reading.journal:
            problems.append(f"{node}: power mode {reading.mode_name} (journal: {reading.journal}), not {INITIAL_MODE}")
    return problems


# -- a trial ------------------------------------------------------------------------------------


@dataclass
class Trial:
    point: str
    killed: bool = False
    kill_after_s: float | None = None
    at_s: float | None = None  # a uniform point's drawn moment
    ledger_at_kill: list[str] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)  # the killed invocation's (-9), then each resume's
    retried_failed: bool = False
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.killed and not self.problems

    def as_json(self) -> dict[str, Any]:
        return {"point": self.point, "killed": self.killed, "kill_after_s": self.kill_after_s, "at_s": self.at_s,
                "ledger_at_kill": self.ledger_at_kill, "exits": self.exits, "retried_failed": self.retried_failed,
                "wall_s": round(self.wall_s, 1), "problems": self.problems, "clean": self.clean}  # fmt: skip


def kill_at(point: str, lab: Lab, campaign: Path, out: Path, at_s: float | None = None) -> Trial:
    """Start the campaign into ``out``, SIGKILL its controller at ``point``; the trial so far."""
    trial = Trial(point, at_s=at_s)
    started = time.time()
    controller = start_controller(campaign, out)
    reached = trigger(point, lab, out, started, at_s)
    try:
        deadline = time.monotonic() + CAMPAIGN_LIMIT_S
        while controller.poll() is None and time.monotonic() < deadline:
            if reached():
                controller.send_signal(signal.SIGKILL)
                trial.killed = True
                trial.kill_after_s = round(time.time() - started, 3)
                break
            time.sleep(POLL_S)
        trial.exits.append(controller.wait(timeout=60))
    finally:
        if controller.poll() is None:
            controller.kill()
    trial.ledger_at_kill = [state for _id, state, _attempts in ledger_rows(out)]
    return trial


def resume_until_complete(trial: Trial, campaign: Path, out: Path) -> None:
    """``--resume`` until the campaign completes; a run that failed by itself (not by the kill) is
    retried once with ``--retry-failed``, and the trial says so."""
    for _ in range(MAX_RESUMES):
        extra = ["--resume"]
        if any(state == "failed" for _id, state, _a in ledger_rows(out)) and not trial.retried_failed:
            extra.append("--retry-failed")
            trial.retried_failed = True
        resumed = start_controller(campaign, out, *extra)
        try:
            trial.exits.append(resumed.wait(timeout=CAMPAIGN_LIMIT_S))
        finally:
            if resumed.poll() is None:
                resumed.kill()
        if trial.exits[-1] in (0, 2):  # complete, or refused (a problem the trial reports)
            return


def run_trial(point: str, lab: Lab, campaign: Path, out: Path, at_s: float | None = None) -> Trial:
    started = time.monotonic()
    trial = kill_at(point, lab, campaign, out, at_s)
    resume_until_complete(trial, campaign, out)
    trial.wall_s = time.monotonic() - started
    if not trial.killed:
        trial.problems.append(f"the campaign ended before {point} was reached")
    if trial.exits[-1] != 0:
        log = out.parent / f"{out.name}-controller.log"
        trial.problems.append(f"the last resume exited {trial.exits[-1]}: {log.read_text()[-800:]}")
    trial.problems += run_problems(out) + node_problems(lab)
    return trial


# -- the bench ----------------------------------------------------------------------------------


def commit() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False).stdout.strip()

    return {"sha": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def main() -> None:
    from bench._common import emulated_lab, write

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=len(TWENTY), help="how many (the 20 points cycle)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="kill_trials", help="results name or path (.json)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    points = [TWENTY[i % len(TWENTY)] for i in range(args.trials)]
    rng.shuffle(points)
    with tempfile.TemporaryDirectory(prefix="kill-trials-") as tmp:
        directory = Path(tmp)
        prefix, states = "hdk", []

        def text(state: Path) -> str:
            states.append(state)
            return inventory_text(state, prefix, 152)

        with emulated_lab(text):
            lab = Lab(states[0].parent / "inventory.yaml", prefix)  # where _common.emulated_lab wrote it
            campaign = directory / "campaign.yaml"
            campaign.write_text(campaign_text(lab.inventory))
            started = time.monotonic()
            reference = start_controller(campaign, directory / "reference")
            reference_exit = reference.wait(timeout=CAMPAIGN_LIMIT_S)
            reference_s = time.monotonic() - started
            reference_problems = run_problems(directory / "reference") + node_problems(lab)
            print(f"reference campaign: exit {reference_exit}, {reference_s:.1f} s, problems {reference_problems}")
            trials = []
            for i, point in enumerate(points):
                at_s = round(rng.uniform(0.0, reference_s), 2) if point == "uniform" else None
                trial = run_trial(point, lab, campaign, directory / f"trial-{i + 1:02d}", at_s)
                trials.append(trial)
                print(f"trial {i + 1:2d} {point:14s} killed after {trial.kill_after_s} s, exits {trial.exits}: "
                      f"{'clean' if trial.clean else trial.problems}", flush=True)  # fmt: skip
    clean = sum(t.clean for t in trials)
    path = write(args.out, {
        "bench": "kill_trials", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "commit": commit(),
        "seed": args.seed, "campaign": {"runs": 2, "requests_per_run": 2, "verify_s": 2},
        "reference": {"exit": reference_exit, "wall_s": round(reference_s, 1), "problems": reference_problems},
        "trials": [t.as_json() for t in trials], "clean": clean, "of": len(trials),
        "retried_failed": sum(t.retried_failed for t in trials),
    })  # fmt: skip
    print(f"{clean}/{len(trials)} clean -> {path}")


if __name__ == "__main__":
    if os.geteuid() != 0:
        raise SystemExit("needs root: the emulated testbed builds network namespaces")
    main()
