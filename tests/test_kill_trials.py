"""Crash windows of a campaign: the controller killed with SIGKILL right after an iperf3 server of
link verification or a telemetry sampler appears on a node, or between runs, then ``--resume``d: every
run done once and nothing left on the nodes (``bench/kill_trials.py`` runs 20 such trials). A
``processes.json`` entry that names a pidfile outside the testbed's workdir is refused by ``--resume``
before anything is signalled. An attempt directory is renamed only after its files are on disk, and
the rename is synced.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kill_trials import (
    Lab,
    campaign_text,
    inventory_text,
    kill_at,
    node_problems,
    resume_until_complete,
    run_problems,
    run_trial,
    start_controller,
)
from tests.conftest import server_and_jetson_lab

PREFIX = "hd"
OCTET = 150
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    with server_and_jetson_lab(tmp_path_factory.mktemp("kills"), PREFIX, OCTET) as lab:
        yield lab


@pytest.fixture
def campaign(lab: Lab, tmp_path: Path) -> Path:
    path = tmp_path / "campaign.yaml"
    path.write_text(campaign_text(lab.inventory))
    return path


@needs_root
@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", ["verify", "sampler", "run-end:1"])
def test_a_controller_killed_at_a_crash_window_is_finished_by_resume_with_nothing_left(
    lab: Lab, campaign: Path, tmp_path: Path, point: str
) -> None:
    trial = run_trial(point, lab, campaign, tmp_path / "out")
    assert trial.killed, trial.as_json()
    assert trial.exits[0] == -signal.SIGKILL
    assert trial.problems == [], trial.as_json()


def _starttime(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]


@needs_root
@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(600)
def test_resume_refuses_a_noted_process_outside_the_workdir_and_signals_nothing(
    lab: Lab, campaign: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    trial = kill_at("noted-sampler", lab, campaign, out)
    assert trial.killed and trial.ledger_at_kill == ["running", "todo"], trial.as_json()
    (noted,) = list((out / "runs").glob("*.attempt1/processes.json"))
    entries = json.loads(noted.read_text())
    # a process of this host that the journal must not be able to name: its pidfile is outside the workdir
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        pidfile = tmp_path / "victim.pid"
        pidfile.write_text(f"{victim.pid} {_starttime(victim.pid)}\n")
        noted.write_text(json.dumps([*entries, {"node": "orin", "host": "orin", "pidfile": str(pidfile)}]))
        refused = start_controller(campaign, out, "--resume")
        assert refused.wait(timeout=300) == 2
        log = (tmp_path / "out-controller.log").read_text()
        assert str(noted) in log and "pidfile" in log and "Traceback" not in log, log[-2000:]
        assert victim.poll() is None  # nothing was signalled
        noted.write_text(json.dumps(entries))  # the journal as the controller wrote it
        resume_until_complete(trial, campaign, out)
        assert trial.exits[-1] == 0, trial.as_json()
        assert run_problems(out) == [] and node_problems(lab) == []
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_an_attempt_directory_is_renamed_after_its_files_are_synced_and_the_rename_is_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync is observed (the real one still runs): each file and directory of the attempt before the
    rename, the runs directory after it; an earlier attempt moved aside likewise."""
    from testbed.campaign import runner

    runs = tmp_path / "runs"
    earlier = runs / "abc"
    earlier.mkdir(parents=True)
    (earlier / "manifest.json").write_text(json.dumps({"attempt": 1, "status": "failed"}))
    work = runs / "abc.attempt2"
    (work / "telemetry").mkdir(parents=True)
    for name in ("manifest.json", "requests.parquet", "telemetry/orin.parquet"):
        (work / name).write_text("{}")
    log: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str], *a: object, **k: object) -> None:
        log.append(("rename", f"{os.fspath(src)} -> {os.fspath(dst)}"))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    runner._settle_directory(tmp_path, "abc", work, None)
    assert (runs / "abc" / "telemetry" / "orin.parquet").is_file() and (runs / "abc.attempt1").is_dir()
    renames = [i for i, (op, _) in enumerate(log) if op == "rename"]
    assert len(renames) == 2, log
    synced_before = {path for op, path in log[: renames[1]] if op == "fsync"}
    for name in ("manifest.json", "requests.parquet", "telemetry/orin.parquet", "telemetry", ""):
        assert str(work / name).rstrip("/") in synced_before, (name, log)
    assert str(earlier) in {p for op, p in log[: renames[0]] if op == "fsync"}, log  # synced, then moved aside
    for start, end in zip(renames, [*renames[1:], len(log)], strict=True):  # the directory of both names, after each rename
        assert ("fsync", str(runs)) in log[start + 1 : end], log


def test_a_link_journal_value_that_is_not_a_name_or_pidfile_is_refused_before_any_command(tmp_path: Path) -> None:
    from testbed.links.node_journal import LinkJournal

    good = {"format": 1, "devices": {"data0": {"qdiscs": [], "class_text": ""}}, "ingress_on": ["data0"],
            "ifbs": ["ifb-data0"], "chains": [["data0", "ingress"]], "trace_pidfile": None,
            "handler_pidfile": "~/hil-testbed/netem/delay-handler.pid"}  # fmt: skip
    assert LinkJournal.from_json(json.dumps(good)).ifbs == ("ifb-data0",)
    bad = {
        "devices": {"data0; reboot": {"qdiscs": [], "class_text": ""}},
        "ifbs": ["-all"],
        "chains": [["data0", "PREROUTING -j ACCEPT"]],
        "handler_pidfile": "/etc/../run/sshd.pid",
        "trace_pidfile": "~/hil-testbed/netem/trace.pid; rm -rf ~",
    }
    for field, value in bad.items():  # (format 1's chains are read as the NFQUEUE path's held rules)
        named = {"devices": "devices", "chains": r"held\.nfqueue"}.get(field, field.split("_")[0])
        with pytest.raises(ValueError, match=named):
            LinkJournal.from_json(json.dumps({**good, field: value}))
    # format 2 keeps each delay path's keys under held: each path checks its own, an unknown path is refused
    current = {**{k: v for k, v in good.items() if k != "chains"}, "format": 2, "held": {"nfqueue": [["data0", "ingress"]]}}
    assert LinkJournal.from_json(json.dumps(current)).held == {"nfqueue": (("data0", "ingress"),)}
    for held, named in (({"nfqueue": [["data0", "PREROUTING -j ACCEPT"]]}, r"held\.nfqueue"),
                        ({"bogus": [["data0", "ingress"]]}, "'bogus' is not a delay path")):  # fmt: skip
        with pytest.raises(ValueError, match=named):
            LinkJournal.from_json(json.dumps({**current, "held": held}))


def test_a_noted_process_is_checked_against_the_inventory_and_the_workdir(tmp_path: Path) -> None:
    from foundation.errors import TestbedError
    from testbed.campaign.runner import checked_processes
    from testbed.inventory import load_inventory

    path = tmp_path / "inventory.yaml"
    path.write_text(inventory_text(tmp_path / "state", PREFIX, OCTET))
    lab = load_inventory(path)
    noted = tmp_path / "processes.json"
    good = [{"node": "orin", "host": "orin", "pidfile": "/srv/home/hil-testbed/telemetry/r-a1/orin.pid"},
            {"node": "server", "host": "server", "pidfile": "~/hil-testbed/netem/iperf3-5301.pid"}]  # fmt: skip
    noted.write_text(json.dumps(good))
    assert [(p.node.name, p.pidfile) for p in checked_processes(lab, noted)] == [
        ("orin", good[0]["pidfile"]), ("server", good[1]["pidfile"])]  # fmt: skip
    for entry, field in [
        ({"node": "nowhere", "host": "nowhere", "pidfile": "~/hil-testbed/x.pid"}, "node"),
        ({"node": "orin", "host": "server", "pidfile": "~/hil-testbed/x.pid"}, "host"),
        ({"node": "orin", "host": "orin", "pidfile": "/var/run/sshd.pid"}, "pidfile"),
        ({"node": "orin", "host": "orin", "pidfile": "~/hil-testbed/../.ssh/x.pid"}, "pidfile"),
        ({"node": "orin", "host": "orin", "pidfile": "~/hil-testbed/x.pid; reboot"}, "pidfile"),
        ({"node": "orin", "host": "orin", "pidfile": "~/hil-testbed/authorized_keys"}, "pidfile"),
    ]:
        noted.write_text(json.dumps([*good, entry]))
        with pytest.raises(TestbedError, match=rf"{noted}: entry 3: {field}"):
            checked_processes(lab, noted)
    noted.write_text("[{")
    with pytest.raises(TestbedError, match="not a JSON list"):
        checked_processes(lab, noted)
