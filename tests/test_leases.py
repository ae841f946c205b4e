"""Lab leases: the lease file's protocol run by its real script (flock, the node's clock), the keeper
that takes all or none and renews, and two controllers on one emulated lab."""

from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from testbed.leases.lease_file import LEASE_DIR_ENV, lease_request, lease_script, parse_answer
from tests.waiting import wait_until


def _answer(directory: Path, action: str, key: str = "", holder: str = "", ttl_s: float = 60.0):
    fields = {"holder": holder, "campaign": f"/campaigns/{holder or 'x'}", "pid": "42"}
    done = subprocess.run(["sh", "-c", lease_script(action)], input=lease_request(key, fields, ttl_s).decode(),
                          env={"PATH": "/usr/bin:/bin", LEASE_DIR_ENV: str(directory)}, capture_output=True,
                          text=True, timeout=30, check=True)  # fmt: skip
    return parse_answer(done.stdout)


def test_a_lease_is_taken_once_renewed_by_its_holder_and_refused_to_another_naming_it(tmp_path):
    first = _answer(tmp_path, "take", "key-a", "alice@ctl-1")
    assert first.state == "taken" and first.live and first.lease.holder == "alice@ctl-1"
    other = _answer(tmp_path, "take", "key-b", "bob@ctl-2")
    assert other.state == "held" and other.lease.holder == "alice@ctl-1" and other.lease.campaign == "/campaigns/alice@ctl-1"
    assert "alice@ctl-1 (campaign /campaigns/alice@ctl-1, pid 42)" in other.lease.describe(other.node_now_s)
    again = _answer(tmp_path, "take", "key-a", "alice@ctl-1")  # --resume of the same campaign: its own back
    assert again.state == "renewed" and again.lease.taken_unix_s == first.lease.taken_unix_s
    assert _answer(tmp_path, "renew", "key-a", "alice@ctl-1").state == "renewed"
    assert _answer(tmp_path, "release", "key-b").state == "held", "bob cannot release alice's lease"
    assert _answer(tmp_path, "release", "key-a").state == "released"
    assert _answer(tmp_path, "show").state == "free"
    assert _answer(tmp_path, "take", "key-b", "bob@ctl-2").state == "taken"
    assert _answer(tmp_path, "force").state == "released"


@pytest.mark.skipif(os.geteuid() != 0, reason="runs the lease script as a second user")
def test_a_lease_another_user_made_is_taken_over_without_an_o_creat_open_that_protected_regular_refuses():
    """Controllers that log in as different users share one lease file in a sticky, world-writable
    directory (/run/lock). fs.protected_regular (on in most distributions, off on this machine) refuses an
    open with O_CREAT of another user's file there, so the script must open an existing lease file without
    it: root's expired lease is taken by 'nobody', and strace shows no O_CREAT open of the existing file."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="lease-users-"))
    try:
        top.chmod(0o755)
        lock = top / "lock"
        lock.mkdir()
        lock.chmod(0o1777)  # as /run/lock
        assert _answer(lock, "take", "key-root", "root@ctl-1", ttl_s=1).state == "taken"
        time.sleep(2.1)  # (the node's clock counts whole seconds)
        trace = top / "strace.log"
        request = lease_request("key-nobody", {"holder": "nobody@ctl-2", "campaign": "/c", "pid": "7"}, 60)
        done = subprocess.run(["strace", "-f", "-u", "nobody", "-e", "trace=open,openat,creat", "-o", str(trace),
                               "sh", "-c", lease_script("take")], input=request.decode(),
                              env={"PATH": "/usr/bin:/bin", LEASE_DIR_ENV: str(lock)}, capture_output=True,
                              text=True, timeout=30, check=True)  # fmt: skip
        taken = parse_answer(done.stdout)
        assert (taken.state, taken.lease.holder) == ("taken", "nobody@ctl-2"), done.stdout + done.stderr
        opens = [line for line in trace.read_text().splitlines() if "hil-testbed.lease" in line]
        assert opens and not [line for line in opens if "O_CREAT" in line], opens
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_lease_not_renewed_expires_and_its_old_holder_learns_it_was_lost(tmp_path):
    # the node's clock counts whole seconds, so a lease of 3 s is live for at least 2 s after it is taken
    assert _answer(tmp_path, "take", "key-a", "alice@ctl-1", ttl_s=3).state == "taken"
    assert _answer(tmp_path, "take", "key-b", "bob@ctl-2").state == "held"
    deadline = time.monotonic() + 30
    while (answer := _answer(tmp_path, "take", "key-b", "bob@ctl-2")).state == "held":
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.2)
    assert answer.state == "taken" and answer.lease.holder == "bob@ctl-2"
    lost = _answer(tmp_path, "renew", "key-a", "alice@ctl-1")
    assert lost.state == "lost" and lost.lease.holder == "bob@ctl-2"


def test_a_lease_file_locked_by_a_stuck_controller_answers_busy_not_a_hang(tmp_path):
    _answer(tmp_path, "show")
    lease = str(tmp_path / "hil-testbed.lease")
    holder = subprocess.Popen(["flock", lease, "sleep", "30"])
    try:
        wait_until(lambda: subprocess.run(["flock", "-n", lease, "true"], check=False).returncode != 0,
                   "the stuck controller's lock", 30, interval_s=0.2)  # fmt: skip
        started = time.monotonic()
        answer = _answer(tmp_path, "take", "key-a", "alice@ctl-1")
        assert answer.state == "busy"
        assert time.monotonic() - started < 25, "the script waits for the lock a bounded time"
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("value", ["a b", "x;rm -rf /", "$(id)", "a'b"])
def test_a_field_that_is_not_one_plain_word_never_reaches_the_script(value):
    with pytest.raises(ValueError, match="plain"):
        lease_request("key", {"holder": value}, 60)


# --------------------------------------------------------------------------------------------
# Two controllers on one emulated lab (a server and a Jetson; bench/kill_trials.py's campaign)

PREFIX, OCTET = "le", 234
TTL_S = 15.0  # after a kill the lease lives on >= 2/3 of it; a CLI call (seconds under load) must see it live


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import claim_lab_names, server_and_jetson_lab

    claim_lab_names(PREFIX, OCTET)
    with server_and_jetson_lab(tmp_path_factory.mktemp("leases"), PREFIX, OCTET) as lab:
        yield lab


def _leases(lab) -> dict[str, dict]:
    from tests.conftest import run_cli

    shown = run_cli("lab", "leases", "-i", str(lab.inventory), "--json")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    return {row["node"]: row for row in json.loads(shown.stdout)}


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.timeout(600)
def test_a_second_controller_is_refused_naming_the_holder_and_a_killed_ones_lease_expires_then_resume_takes_it(
    lab, tmp_path, monkeypatch
):
    from bench.kill_trials import campaign_text, ledger_rows, start_controller
    from tests.conftest import run_cli

    monkeypatch.setenv("TESTBED_LEASE_TTL_S", str(TTL_S))
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text(campaign_text(lab.inventory, "first"))
    second.write_text(campaign_text(lab.inventory, "second"))
    controller = start_controller(first, tmp_path / "out-first")
    try:
        wait_until(lambda: _leases(lab)["server"]["live"] and _leases(lab)["orin"]["live"], "the first controller's leases",
                   120, interval_s=0.2)
        started = time.monotonic()
        refused = run_cli("run", str(second), "--out", str(tmp_path / "out-second"))
        refused_after_s = time.monotonic() - started
        assert refused.returncode == 1, refused.stdout + refused.stderr
        holder = f"{getpass.getuser()}@{socket.gethostname()}"
        assert f"leased to {holder} (campaign {tmp_path / 'out-first'}, pid {controller.pid})" in refused.stderr
        assert "Nothing was changed" in refused.stderr
        assert not (tmp_path / "out-second" / "ledger.sqlite").exists(), "a refused campaign starts nothing"
        assert refused_after_s < TTL_S, "refused at once, not after waiting the holder's lease out"
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait(timeout=60)
    assert all(row["live"] for row in _leases(lab).values()), "a killed controller's leases outlive it for a while"
    expired_after_s = wait_until(lambda: not any(row["live"] for row in _leases(lab).values()), "expiry", 4 * TTL_S,
                                 interval_s=0.2)
    assert expired_after_s <= TTL_S + 10  # (each look is a CLI call: seconds on a loaded machine)
    resumed = run_cli("run", str(first), "--out", str(tmp_path / "out-first"), "--resume", timeout_s=400)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert [state for _id, state, _attempts in ledger_rows(tmp_path / "out-first")] == ["done", "done"]
    assert all(row["lease"] is None for row in _leases(lab).values()), "given back at the end"
    manifest = json.loads(next((tmp_path / "out-first" / "runs").glob("*/manifest.json")).read_text())
    reached = manifest["inventory"]["reached"]["orin"]  # how the run reached the node, as resolved
    assert reached["ssh"].startswith("root@10.234.0.") and reached["ssh"].endswith(":22")
    assert reached["workdir"] == "~/hil-testbed" and reached["sudo"] is False


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
def test_single_commands_that_change_nodes_are_refused_on_a_machine_another_holds_and_lease_it_themselves(lab):
    """link apply/clear, power set/restore and provision take a lease for their own length: while another
    controller (alice's campaign, elsewhere) holds orin, each is refused naming her and changes nothing;
    once she gives it back, power set runs and gives its own lease back."""
    from testbed.emulation.resolved import load_lab
    from testbed.leases.keeper import Holder, LeaseKeeper
    from tests.conftest import run_cli

    inventory = load_lab(lab.inventory)
    mode_file = lab.state / "nodes" / "orin" / "power_mode"
    before = mode_file.read_text()
    alice = Holder("alice", "other-controller", "/home/alice/results/sweep", 4242)
    with LeaseKeeper(inventory, ["orin"], alice):
        for argv in (("link", "apply"), ("link", "clear"), ("power", "set", "orin", "MODE_50W"),
                     ("power", "restore"), ("provision", "--nodes", "orin")):  # fmt: skip
            refused = run_cli(*argv, "-i", str(lab.inventory))
            assert refused.returncode == 1, (argv, refused.stdout + refused.stderr)
            said = " ".join(refused.stderr.split())
            assert "leased to alice@other-controller (campaign /home/alice/results/sweep, pid 4242" in said, argv
            assert "Nothing was changed" in said, argv
        assert mode_file.read_text() == before
        assert not [n for n in lab.nodes if (lab.home(n) / "netem" / "journal.json").exists()], "nothing shaped"
        assert _leases(lab)["server"]["lease"] is None, "what a refused command took it gave back"
    done = run_cli("power", "set", "orin", "MODE_50W", "-i", str(lab.inventory))
    assert done.returncode == 0, done.stdout + done.stderr
    assert mode_file.read_text().strip() == "3"
    assert all(row["lease"] is None for row in _leases(lab).values()), "a command gives its lease back"
    restored = run_cli("power", "restore", "-i", str(lab.inventory))
    assert restored.returncode == 0 and mode_file.read_text() == before, restored.stdout + restored.stderr


# --------------------------------------------------------------------------------------------
# Two campaigns at once on disjoint machines of one lab

DISJOINT_PREFIX, DISJOINT_OCTET = "lj", 176


def _disjoint_inventory(directory: Path) -> Path:
    from bench._common import emulated_inventory, emulated_node

    nodes = [emulated_node("server-a", "server", "a6000-server", "server", ((0, "default", 0.5, 90, 300),)),
             emulated_node("server-b", "server", "a6000-server", "server", ((0, "default", 0.5, 90, 300),)),
             emulated_node("orin", "jetson", "agx-orin", "device", ((0, "MAXN", 0.4, 7, 40),)),
             emulated_node("xavier", "jetson", "agx-xavier", "device", ((0, "MAXN", 0.4, 6, 30),))]
    links = ("link_profiles: {up: {rate: 2MBps}, down: {rate: 3MBps}}\nlinks:\n"
             "  - {from: orin, to: server-a, profile: up}\n  - {from: server-a, to: orin, profile: down}\n"
             "  - {from: xavier, to: server-b, profile: up}\n  - {from: server-b, to: xavier, profile: down}\n")
    path = directory / "inventory.yaml"
    path.write_text(emulated_inventory(directory / "state", DISJOINT_PREFIX, DISJOINT_OCTET, nodes, links))
    return path


def _campaign(inventory: Path, name: str, server: str, device: str) -> str:
    from bench.kill_trials import TINY

    return (f"name: {name}\ninventory: {inventory}\nbase:\n  model: {TINY}\n  server: {server}\n"
            f"  partition: {{device_layers: 2, stages: 1}}\n  devices: [{device}]\n"
            "  workload: {arrival: constant, rate_per_s: 2.0, requests_per_device: 2, max_new_tokens: 8}\n"
            "  telemetry: {enabled: false}\n  drain_s: 0.2\n"
            + ("  link: {verify_s: 1}\n" if name == "a" else "")  # (its iperf3 lines are planned too)
            + "matrix:\n  method: [ushape, centralized]\norder: listed\nseed: 3\nrun_timeout_s: 120\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.timeout(900)
def test_two_campaigns_on_disjoint_machines_of_one_lab_run_at_once_and_never_touch_each_others(tmp_path):
    import sys

    from testbed.transport.command_log import ENV_VARIABLE, read
    from tests.conftest import REPO, assert_sent_as_planned, claim_lab_names, command_log_of, emulated_lab

    claim_lab_names(DISJOINT_PREFIX, DISJOINT_OCTET)
    inventory = _disjoint_inventory(tmp_path)
    with emulated_lab(inventory):
        started = {}
        for name, server, device in (("a", "server-a", "orin"), ("b", "server-b", "xavier")):
            campaign = tmp_path / f"{name}.yaml"
            campaign.write_text(_campaign(inventory, name, server, device))
            out = tmp_path / f"out-{name}"
            started[name] = (out, (server, device), subprocess.Popen(
                [sys.executable, "-m", "testbed", "run", str(campaign), "--out", str(out)], cwd=REPO,
                env={**os.environ, ENV_VARIABLE: str(command_log_of(out))}, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True))  # fmt: skip
        for name, (out, mine, process) in started.items():
            output, _ = process.communicate(timeout=800)
            assert process.returncode == 0, f"campaign {name}:\n{output[-3000:]}"
            assert_sent_as_planned(out)
            touched = {entry["node"] for entry in read(command_log_of(out))}
            assert touched == set(mine), f"campaign {name} reached {touched}, its machines are {mine}"
