"""The emulated testbed on this machine's kernel: namespaces, real sshd per node, CPU-quota cgroups,
stand-in Jetson tools, MPI across the data veths, and a clean ``down`` (also after SIGKILL).

Each test builds its testbed under its own name prefix and subnets, so none of this touches a
testbed a user runs with the default inventory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from nodes.emulated.cgroup import CpuCgroup
from testbed.emulation import host
from testbed.emulation.journal import Journal
from testbed.emulation.resolved import load_lab
from testbed.transport import open_transport
from tests.conftest import REPO, emulated_inventory, first_in_line, run_cli, veth_bytes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")

def ours_left(prefix: str) -> list[str]:
    """Every namespace, interface, cgroup or process under ``prefix`` that exists on the host."""
    left = (
        [f"netns {n}" for n in os.listdir("/run/netns") if n.startswith(prefix + "-")]
        if os.path.isdir("/run/netns")
        else []
    )
    left += [f"link {n}" for n in os.listdir("/sys/class/net") if re.fullmatch(rf"{prefix}(-mgmt|-data|\d+[md])", n)]
    for hierarchy in ("cpu", "cpuacct", ""):
        root = Path("/sys/fs/cgroup", hierarchy)
        if root.is_dir():
            left += [f"cgroup {p}" for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix + "-")]
    return left


def processes_under(directory: Path) -> list[int]:
    """Live processes whose command line names a file under ``directory`` (a node's sshd)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(directory) in (entry / "cmdline").read_bytes().decode(errors="replace") and alive(
                    int(entry.name)
                ):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def node_pids(state_dir: Path) -> list[int]:
    return [e.details["pid"] for e in Journal(state_dir / "journal.jsonl").entries() if e.kind == "process"]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


@pytest.fixture(scope="module")
def testbed(tmp_path_factory):
    """The default inventory's four nodes, up for the whole module."""
    directory = tmp_path_factory.mktemp("emulated")
    path = emulated_inventory(directory, "tt", 241)
    up = run_cli("emulate", "up", "-i", str(path))
    assert up.returncode == 0, up.stdout + up.stderr
    yield path
    down = run_cli("emulate", "down", "-i", str(path))
    assert down.returncode == 0, down.stdout + down.stderr
    assert ours_left("tt") == []


def run_on(inventory_path: Path, node: str, script: str, timeout_s: float = 60.0):
    inv = load_lab(inventory_path)
    with open_transport(inv, inv.node(node)) as t:
        return t.run(["sh", "-c", script], timeout_s=timeout_s)


def test_check_over_ssh_is_green_and_reports_the_emulated_boards(testbed):
    result = run_cli("inventory", "check", "-i", str(testbed), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    facts = {row["node"]: row["facts"] for row in json.loads(result.stdout)}
    assert set(facts) == {"server", "orin", "xavier", "orin-nx"}
    assert facts["orin"]["board_model"] == "Jetson AGX Orin" and facts["orin"]["l4t_release"] == "35.4.1"
    assert facts["xavier"]["board_model"] == "Jetson-AGX"
    assert "Orin NX" in facts["orin-nx"]["board_model"]
    assert all(f["emulated"] for f in facts.values())
    assert {n: f["hostname"] for n, f in facts.items()} == {n: n for n in facts}  # a UTS namespace each
    assert facts["server"]["l4t_release"] is None


def test_status_lists_every_node_healthy_with_its_quota(testbed):
    result = run_cli("emulate", "status", "-i", str(testbed), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    nodes = {n["node"]: n for n in json.loads(result.stdout)["nodes"]}
    assert nodes["orin"]["cpu_quota"] == "0.5 CPUs" and nodes["orin"]["power_mode"] == "0 MAXN"
    assert nodes["orin-nx"]["data_address"] == "data0 10.242.0.5"


BUSY_LOOP = (
    "python3 -c 'import time\n"
    "w0, c0 = time.monotonic(), time.process_time()\n"
    "while time.monotonic() - w0 < 2.0: pass\n"
    "print((time.process_time() - c0) / (time.monotonic() - w0))'"
)


def test_a_busy_loop_gets_its_power_modes_cpu_quota_and_nvpmodel_changes_it(testbed):
    with first_in_line("tt-orin"):
        share = float(run_on(testbed, "orin", BUSY_LOOP).check().stdout)
    assert share == pytest.approx(0.5, rel=0.15)  # MAXN: 0.5 CPUs
    switched = run_on(testbed, "orin", "nvpmodel -m 1 && nvpmodel -q").check()
    assert switched.stdout.splitlines() == ["NV Power Mode: MODE_15W", "1"]
    try:
        with first_in_line("tt-orin"):
            share = float(run_on(testbed, "orin", BUSY_LOOP).check().stdout)
        assert share == pytest.approx(0.15, rel=0.15)
    finally:
        run_on(testbed, "orin", "nvpmodel -m 0").check()
    bad = run_on(testbed, "orin", "nvpmodel -m 9")
    assert bad.exit_code != 0 and "NVPM ERROR: request for bad power mode 9" in bad.stdout


RAIL = re.compile(r"(\w+) (\d+)mW/(\d+)mW")


def test_tegrastats_models_rail_power_from_the_nodes_cpu_use(testbed):
    """AGX Orin in MAXN: 7 W idle, 40 W busy; its rails add up to the module's power. The load starts
    once tegrastats has printed its first line (it samples from then on: a loaded machine may take a
    while to start it) and four idle samples later."""
    script = (
        "f=$(mktemp); tegrastats --interval 250 > $f & t=$!; "
        "i=0; while [ ! -s $f ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; sleep 1.1; "
        "timeout 1.6 python3 -c 'while True: pass' & sleep 1.5; kill $t; wait; cat $f; rm -f $f"
    )
    with first_in_line("tt-orin"):
        lines = run_on(testbed, "orin", script).stdout.splitlines()
    assert lines[0].startswith("# hil-testbed stand-in tegrastats")
    samples = [line for line in lines[1:] if line]
    assert re.match(r"\d\d-\d\d-\d{4} \d\d:\d\d:\d\d RAM \d+/62795MB .*CPU \[", samples[0])
    totals = [sum(int(m[1]) for m in RAIL.findall(line)) / 1000 for line in samples]
    assert [m[0] for m in RAIL.findall(samples[0])] == [
        "VDD_GPU_SOC",
        "VDD_CPU_CV",
        "VIN_SYS_5V0",
        "NC",
        "VDDQ_VDD2_1V8AO",
        "NC",
    ]
    assert min(totals[1:4]) == pytest.approx(7.0, abs=1.5)
    assert max(totals) == pytest.approx(40.0, rel=0.15)


def test_jetson_clocks_shows_the_board_and_pins_clocks(testbed):
    show = run_on(testbed, "xavier", "jetson_clocks --show").check().stdout.splitlines()
    assert show[0] == "SOC family:tegra194  Machine:Jetson-AGX"
    assert show[1] == "Online CPUs: 0-7" and show[-1] == "NV Power Mode: MAXN"
    stored = run_on(
        testbed,
        "xavier",
        "jetson_clocks --store && jetson_clocks && jetson_clocks --show | grep EMC; jetson_clocks --restore && jetson_clocks --show | grep EMC",
    ).check()
    assert stored.stdout.split("\n")[:2] == [
        "EMC MinFreq=204000000 MaxFreq=2133000000 CurrentFreq=2133000000 FreqOverride=1",
        "EMC MinFreq=204000000 MaxFreq=2133000000 CurrentFreq=2133000000 FreqOverride=0",
    ]


PING_PONG = """
import sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
buf = bytearray(1 << 20)
for _ in range(8):
    if comm.rank == 0:
        comm.Send([buf, MPI.BYTE], dest=1); comm.Recv([buf, MPI.BYTE], source=1)
    else:
        comm.Recv([buf, MPI.BYTE], source=0); comm.Send([buf, MPI.BYTE], dest=0)
names = comm.gather(MPI.Get_processor_name())
if comm.rank == 0:
    print(" ".join(names))
"""

COUNTERS = "cat /proc/net/dev"


def test_mpi_ping_pong_between_two_nodes_crosses_the_data_veths(testbed, tmp_path):
    script = tmp_path / "ping_pong.py"
    script.write_text(PING_PONG)  # nodes share the controller's file system
    inv = load_lab(testbed)
    orin, xavier = inv.node("orin"), inv.node("xavier")
    before = {n: veth_bytes(run_on(testbed, n, COUNTERS).stdout) for n in ("orin", "xavier")}
    launched = run_on(
        testbed,
        "orin",
        f"mpiexec -hosts {orin.address},{xavier.address} -n 2 -ppn 1 python3 {script}",
        timeout_s=120,
    )
    assert launched.exit_code == 0, launched.stdout + launched.stderr
    assert launched.stdout.split() == ["orin", "xavier"]
    after = {n: veth_bytes(run_on(testbed, n, COUNTERS).stdout) for n in ("orin", "xavier")}
    payload = 2 * 8 * (1 << 20)  # both directions, eight round trips of 1 MiB
    for n in ("orin", "xavier"):
        assert after[n]["data0"] - before[n]["data0"] >= payload
        assert after[n]["mgmt0"] - before[n]["mgmt0"] < payload / 10  # only SSH and the launcher


def test_up_again_on_a_healthy_testbed_changes_nothing(testbed):
    pids = node_pids(testbed.parent / "state")
    again = run_cli("emulate", "up", "-i", str(testbed))
    assert again.returncode == 0 and "already up" in again.stderr
    assert node_pids(testbed.parent / "state") == pids and all(alive(p) for p in pids)


def test_commands_refuse_an_inventory_changed_since_up(testbed, tmp_path):
    changed = tmp_path / "changed.yaml"
    changed.write_text(testbed.read_text().replace("busy_w: 40.0", "busy_w: 41.0"))
    # Same prefix and state directory, other nodes: the running testbed does not belong to it.
    result = run_cli("inventory", "check", "-i", str(changed))
    assert result.returncode == 2 and "belongs to another inventory" in result.stderr


# ---------------------------------------------------------------------------------------------
# Each of these builds (and removes) a testbed of its own.


def test_down_removes_everything_and_is_idempotent(tmp_path):
    path = emulated_inventory(tmp_path, "td", 243)
    assert run_cli("emulate", "up", "-i", str(path)).returncode == 0
    state = tmp_path / "state"
    pids = node_pids(state)
    assert len(pids) == 4 and ours_left("td")
    # A process started over SSH that would otherwise outlive the testbed.
    run_on(path, "server", "nohup sleep 300 >/dev/null 2>&1 &").check()
    group_pids = CpuCgroup("td-server").pids()
    assert group_pids
    down = run_cli("emulate", "down", "-i", str(path))
    assert down.returncode == 0, down.stderr
    assert ours_left("td") == [] and not state.exists()
    assert not any(alive(p) for p in pids + group_pids)
    again = run_cli("emulate", "down", "-i", str(path))
    assert again.returncode == 0 and "nothing to remove" in again.stderr


def test_down_cleans_up_after_up_was_killed_halfway(tmp_path):
    path = emulated_inventory(tmp_path, "tk", 245)
    journal = Journal(tmp_path / "state" / "journal.jsonl")
    up = subprocess.Popen([sys.executable, "-m", "testbed", "emulate", "up", "-i", str(path)], cwd=REPO)
    deadline = time.monotonic() + 30
    while len(journal.entries()) < 9 and time.monotonic() < deadline:  # some nodes made, not all
        time.sleep(0.005)
    os.kill(up.pid, signal.SIGKILL)
    up.wait()
    assert 9 <= len(journal.entries()) < 22, "up finished before it could be killed"
    assert ours_left("tk")
    status = run_cli("emulate", "status", "-i", str(path))
    assert status.returncode == 1 and "not running" in status.stdout
    down = run_cli("emulate", "down", "-i", str(path))
    assert down.returncode == 0, down.stderr
    assert ours_left("tk") == [] and processes_under(tmp_path) == []


def test_up_refuses_names_it_did_not_create_and_leaves_them(tmp_path):
    path = emulated_inventory(tmp_path, "tf", 247)
    subprocess.run(["ip", "link", "add", "tf-mgmt", "type", "bridge"], check=True)
    try:
        result = run_cli("emulate", "up", "-i", str(path))
        assert result.returncode == 2
        assert "tf-mgmt already exist" in result.stderr and "name_prefix" in result.stderr
        assert Path("/sys/class/net/tf-mgmt").exists()
        assert [x for x in ours_left("tf") if x != "link tf-mgmt"] == []
    finally:
        subprocess.run(["ip", "link", "del", "tf-mgmt"], check=False)


def test_bad_inventory_is_refused_before_anything_is_made(tmp_path):
    path = emulated_inventory(tmp_path, "tb9", 249)
    path.write_text(path.read_text().replace("cpus: 0.5", "cpus: -1"))
    result = run_cli("emulate", "up", "-i", str(path))
    assert result.returncode == 2 and re.search(
        r"inventory.yaml:\d+: nodes\[1\]\.emulated\.power_modes\[0\]\.cpus", result.stderr
    )
    assert ours_left("tb9") == [] and not (tmp_path / "state").exists()


def test_local_mode_runs_nodes_as_sshd_on_loopback(tmp_path):
    path = emulated_inventory(tmp_path, "tl", 251)
    up = run_cli("emulate", "up", "-i", str(path), "--mode", "local")
    assert up.returncode == 0, up.stderr
    try:
        assert "no isolation" in up.stderr
        check = run_cli("inventory", "check", "-i", str(path), "--json")
        assert check.returncode == 0, check.stdout + check.stderr
        assert ours_left("tl") == []  # no namespaces, links or cgroups in local mode
        assert run_on(path, "orin-nx", "nvpmodel -m 2 && nvpmodel -q").check().stdout.split() == [
            "NV",
            "Power",
            "Mode:",
            "15W",
            "2",
        ]
        status = json.loads(run_cli("emulate", "status", "-i", str(path), "--json").stdout)
        assert status["mode"] == "local" and {n["cpu_quota"] for n in status["nodes"]} == {"not enforced (local mode)"}
    finally:
        assert run_cli("emulate", "down", "-i", str(path)).returncode == 0
    assert not (tmp_path / "state").exists() and processes_under(tmp_path) == []


def test_without_root_up_explains_and_offers_local_mode():
    directory = Path(tempfile.mkdtemp(prefix="tn-", dir="/tmp"))  # readable by an unprivileged user
    directory.chmod(0o755)
    path = emulated_inventory(directory, "tn", 253)
    path.chmod(0o644)
    result = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m", "testbed", "emulate", "up", "-i", str(path)],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "needs root" in result.stderr and "--mode local" in result.stderr
    assert ours_left("tn") == [] and not (directory / "state").exists()
    shutil.rmtree(directory)


THIRTY_NODES = "nodes:\n" + "".join(
    f"  - {{name: n{i:02d}, kind: jetson, model: {('agx-orin', 'agx-xavier', 'orin-nx')[i % 3]}, emulated: "
    "{power_modes: [{id: 0, name: MAXN, cpus: 0.2, idle_w: 5, busy_w: 20}]}}\n"
    for i in range(30)
)


@pytest.mark.slow
def test_thirty_nodes_come_up_and_check_green(tmp_path):
    """Thirty nodes up and reached over SSH (how long that takes is bench/emulate.py's to say: under a
    minute on 2 cores, bench/results/emulate.json)."""
    path = emulated_inventory(tmp_path, "ts", 238, THIRTY_NODES)
    tables = (host.NEIGHBOUR_TABLE_SOFT, host.NEIGHBOUR_TABLE_HARD)
    before = {key: host.read_sysctl(key) for key in tables}
    up = run_cli("emulate", "up", "-i", str(path))
    try:
        assert up.returncode == 0, up.stderr
        check = run_cli("inventory", "check", "-i", str(path), "--json")
        assert check.returncode == 0, check.stdout[-2000:] + check.stderr
        assert len(json.loads(check.stdout)) == 30
        # One ARP table serves every namespace: a full mesh of 30 nodes on two networks needs room
        # beyond the kernel's default 512/1024 entries, or connects fail with "No route to host".
        assert host.read_sysctl(host.NEIGHBOUR_TABLE_SOFT) >= host.neighbour_entries_needed(30) > 512
        assert host.read_sysctl(host.NEIGHBOUR_TABLE_HARD) >= 2 * host.neighbour_entries_needed(30)
    finally:
        run_cli("emulate", "down", "-i", str(path))
    assert ours_left("ts") == []
    assert {key: host.read_sysctl(key) for key in tables} == before  # put back as it was


def test_a_failing_up_removes_what_it_made(tmp_path, monkeypatch):
    from testbed.emulation import lifecycle
    from testbed.inventory import load_inventory

    path = emulated_inventory(tmp_path, "tx", 236)

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure after every node was started")

    monkeypatch.setattr(lifecycle, "write_resolved_inventory", fail)
    said = []
    with pytest.raises(RuntimeError, match="injected"):
        lifecycle.up(load_inventory(path), say=said.append)
    assert any("removing what it made" in line for line in said)
    assert ours_left("tx") == [] and not (tmp_path / "state").exists()
    assert processes_under(tmp_path) == []


def test_the_server_reaches_every_device_as_mpiexec_will_and_a_device_it_cannot_is_named_with_the_fix(testbed):
    import dataclasses

    from testbed.checks.launch_reach import launch_reach_problems

    lab = load_lab(testbed)
    server = lab.node("server")
    with open_transport(lab, server) as t:
        assert launch_reach_problems(lab, server, t) == []
        # xavier's login as a user whose keys the server's are not: what a board without the server's key is
        stranger = lab.node("xavier").model_copy(update={"ssh": lab.node("xavier").ssh.model_copy(
            update={"user": "nobody"})})  # fmt: skip
        spec = lab.spec.model_copy(update={"nodes": tuple(stranger if n.name == "xavier" else n for n in lab.nodes)})
        problems = launch_reach_problems(dataclasses.replace(lab, spec=spec), server, t)
    assert len(problems) == 1, problems
    assert problems[0].startswith("mpiexec here cannot reach xavier (nobody@")
    assert "Permission denied" in problems[0] and "ssh-copy-id -p 22 nobody@" in problems[0]
