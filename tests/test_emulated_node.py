"""The node side of the emulated testbed without a testbed: cgroup v1/v2 file formats, the power
model, the board tables, and the stand-in tools' behaviour outside an emulated node."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from nodes.emulated import boards
from nodes.emulated.cgroup import CpuCgroup, ProcessTreeCpu, cgroup_version
from nodes.emulated.node import EmulatedNode, PowerMode, UtilisationMeter, modeled_power_w, online_cores
from testbed.inventory.node_kinds import JETSON
from tests.conftest import REPO


def fake_v2_root(tmp_path):
    """A cgroup v2 tree as the kernel lays it out (this host has v1; the files are what differs)."""
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    return tmp_path


def test_cgroup_v2_quota_and_usage_files(tmp_path):
    root = fake_v2_root(tmp_path)
    assert cgroup_version(str(root)) == 2
    group = CpuCgroup("tb-orin", str(root))
    group.create()
    assert (root / "cgroup.subtree_control").read_text() == "+cpu"
    group.set_quota_cpus(0.25)
    assert (root / "tb-orin" / "cpu.max").read_text() == "25000 100000"
    assert group.quota_cpus() == 0.25
    (root / "tb-orin" / "cpu.max").write_text("max 100000\n")
    assert group.quota_cpus() is None
    (root / "tb-orin" / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    assert group.usage_s() == 2.5


def test_cgroup_v1_with_cpu_and_cpuacct_mounted_apart(tmp_path):
    for hierarchy in ("cpu", "cpuacct"):
        (tmp_path / hierarchy).mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_version(str(tmp_path)) == 1
    group = CpuCgroup("tb-x", str(tmp_path))
    group.create()
    assert [d.rsplit("/", 2)[-2] for d in group.directories] == ["cpu", "cpuacct"]
    group.set_quota_cpus(0.5)
    assert (tmp_path / "cpu" / "tb-x" / "cpu.cfs_quota_us").read_text() == "50000"
    (tmp_path / "cpuacct" / "tb-x" / "cpuacct.usage").write_text("1500000000\n")
    assert group.usage_s() == 1.5


def test_no_cpu_controller_is_an_error_not_a_guess(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    assert cgroup_version(str(tmp_path)) is None
    with pytest.raises(OSError, match="no cgroup cpu controller"):
        CpuCgroup("x", str(tmp_path))


def test_process_tree_cpu_counts_descendants():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\ntime.sleep(5)",
        ]
    )
    try:
        meter = ProcessTreeCpu(child.pid)
        deadline = 300  # looks 0.1 s apart: 30 s for the child's 0.3 s of CPU on a loaded machine
        while meter.usage_s() < 0.25 and deadline:
            subprocess.run(["sleep", "0.1"], check=True)
            deadline -= 1
        assert 0.25 <= meter.usage_s() < 1.0
    finally:
        child.kill()
        child.wait()


def test_modeled_power_is_linear_in_utilisation_and_clipped():
    mode = PowerMode(0, "MAXN", 0.5, 7.0, 40.0)
    assert modeled_power_w(mode, 0.0) == 7.0
    assert modeled_power_w(mode, 0.5) == 23.5
    assert modeled_power_w(mode, 1.7) == 40.0
    assert modeled_power_w(mode, -0.1) == 7.0


def node_config(tmp_path, **extra):
    config = {
        "node": "orin",
        "kind": "jetson",
        "model": "agx-orin",
        "mode": "local",
        "cgroup": None,
        "cpu_root_pid": None,
        "power_mode_file": str(tmp_path / "power_mode"),
        "power_modes": [
            {"id": 0, "name": "MAXN", "cpus": 0.5, "idle_w": 7, "busy_w": 40},
            {"id": 1, "name": "MODE_15W", "cpus": 0.15, "idle_w": 5, "busy_w": 15},
        ],
        **extra,
    }
    return EmulatedNode(config)


def test_power_mode_switch_is_recorded_and_cores_follow_the_quota(tmp_path):
    node = node_config(tmp_path)
    assert node.power_mode().name == "MAXN"  # no state yet: the first mode
    node.set_power_mode(node.mode_by_id(1))
    assert node.power_mode().name == "MODE_15W"
    assert online_cores(12, node, node.power_mode()) == 4  # 12 x 0.15/0.5, rounded
    assert online_cores(12, node, node.mode_by_id(0)) == 12


def test_utilisation_is_against_the_current_modes_quota(tmp_path):
    """CPUs busy are the node's CPU time over the wall time between samples (however much of a CPU
    this machine's load left the busy loop); utilisation is that against the mode's quota, clipped."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.monotonic()\nwhile time.monotonic()-t<5: pass"]
    )
    try:
        modes = [{"id": 0, "name": "MAXN", "cpus": 0.5, "idle_w": 7, "busy_w": 40},
                 {"id": 1, "name": "MODE_3W", "cpus": 0.02, "idle_w": 2, "busy_w": 3}]  # fmt: skip
        node = node_config(tmp_path, cpu_root_pid=child.pid, power_modes=modes)
        node.set_power_mode(node.mode_by_id(1))
        meter = UtilisationMeter(node)
        before, started = ProcessTreeCpu(child.pid).usage_s(), time.monotonic()
        subprocess.run(["sleep", "1.5"], check=True)  # CPU time is counted in 10 ms ticks: a long window
        busy_cpus, utilisation = meter.sample()
        used = (ProcessTreeCpu(child.pid).usage_s() - before) / (time.monotonic() - started)
        assert busy_cpus == pytest.approx(used, rel=0.15, abs=0.02)
        assert busy_cpus > 0.02 and utilisation == 1.0  # a busy loop beyond a 0.02 CPU quota: clipped
        node.set_power_mode(node.mode_by_id(0))  # the next sample is against MAXN's 0.5 CPUs
        subprocess.run(["sleep", "1.0"], check=True)
        busy_cpus, utilisation = meter.sample()
        assert utilisation == pytest.approx(min(1.0, busy_cpus / 0.5))
    finally:
        child.kill()
        child.wait()


def test_every_jetson_model_of_the_inventory_has_a_board():
    for model in JETSON.boards.models:
        board = boards.board_for(model)
        shares = sum(r.share for r in board.rails if not r.total)
        assert shares == pytest.approx(1.0) or any(r.total for r in board.rails)
        assert board.nv_tegra_release.startswith("# R35 (release), REVISION: ")


@pytest.mark.parametrize(
    ("tool", "argument"), [("nvpmodel", "-q"), ("jetson_clocks", "--show"), ("tegrastats", "--interval=100")]
)
def test_stand_ins_refuse_to_run_outside_an_emulated_node(tool, argument, monkeypatch):
    monkeypatch.delenv("TESTBED_EMULATED_NODE", raising=False)
    result = subprocess.run(
        [sys.executable, "-m", f"nodes.emulated.{tool}", argument],
        capture_output=True, text=True, cwd=REPO, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 1 and "emulated testbed" in result.stderr


def test_jetson_clocks_lists_cores_in_the_real_scripts_glob_order(tmp_path, monkeypatch):
    node = node_config(tmp_path)
    (tmp_path / "node.json").write_text(json.dumps(node.config))
    monkeypatch.setenv("TESTBED_EMULATED_NODE", str(tmp_path / "node.json"))
    result = subprocess.run(
        [sys.executable, "-m", "nodes.emulated.jetson_clocks", "--show"],
        capture_output=True, text=True, cwd=REPO, timeout=30, check=True,
    )  # fmt: skip
    cores = [line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("cpu")]
    assert cores[:4] == ["cpu0", "cpu1", "cpu10", "cpu11"] and len(cores) == 12


def test_cpu_pacing_gives_a_short_period_and_off_puts_the_modes_quota_back(tmp_path):
    (tmp_path / "cg").mkdir()
    root = fake_v2_root(tmp_path / "cg")
    group = CpuCgroup("tb-orin", str(root))
    group.create()
    node = node_config(tmp_path)
    node.cgroup = lambda: group  # the node's group, under the fake cgroup root
    node.set_power_mode(node.mode_by_id(1))
    assert (root / "tb-orin" / "cpu.max").read_text() == "15000 100000"  # MODE_15W: 0.15 CPU per 100 ms
    node.set_cpu_pacing(2.0, 10000)
    assert (root / "tb-orin" / "cpu.max").read_text() == "20000 10000" and node.cpu_pacing() == (2.0, 10000)
    node.set_power_mode(node.mode_by_id(0))  # a mode change while paced keeps the pacing quota
    assert (root / "tb-orin" / "cpu.max").read_text() == "20000 10000" and node.power_mode().name == "MAXN"
    node.set_cpu_pacing(None)
    assert (root / "tb-orin" / "cpu.max").read_text() == "50000 100000" and node.cpu_pacing() is None
    node.set_cpu_pacing(None)  # off twice (a restore after a crash) is fine
