"""A node kind is one row of the registry (testbed.inventory.node_kinds) plus, when it has one, its power
driver module on the node side: a lab adds an FPGA board kind here with a module of its own named by
TESTBED_NODE_KINDS and a driver nodes/power/fpga.py, and the inventory, the campaign's validation, its
plan (power, telemetry, links, the MPI launch) and the node's power tool all take it, touching nothing
else."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from testbed.inventory import kind_of, node_kind
from testbed.inventory.node_kinds import kind_names

REPO = Path(__file__).resolve().parent.parent

LAB_KINDS = '''
import re
from testbed.inventory.node_kinds import NodeKind, PowerModeSyntax, register

register(NodeKind(
    name="fpga",
    summary="an FPGA board over SSH whose power mode is a clock profile",
    power_driver="fpga",
    power_modes=PowerModeSyntax(re.compile(r"^(?:low|high)$"), "low or high", listed_by_driver=True),
    telemetry=lambda node, choice: ("host",),
    stand_ins="none",
))
'''

FPGA_DRIVER = '''"""A lab's FPGA board: its clock profile (low or high) is one file beside the journal."""
import os
from nodes.power.common import DriverOptions, PowerDriver, PowerModeInfo, PowerState


class FpgaPower(PowerDriver):
    kind = "fpga"

    def __init__(self, path):
        self.path = path

    def modes(self):
        return [PowerModeInfo("0", "low"), PowerModeInfo("1", "high")]

    def state(self):
        mode = open(self.path).read().strip() if os.path.exists(self.path) else "0"
        info = [m for m in self.modes() if m.id == mode][0]
        return PowerState(info.id, info.name, None, [], {})

    def set_mode(self, mode):
        with open(self.path, "w") as f:
            f.write(self.resolve(mode).id)
        return self.state()

    def snapshot(self):
        return {"mode": self.state().mode_id}

    def restore(self, snapshot):
        with open(self.path, "w") as f:
            f.write(snapshot["mode"])
        return self.state()


def driver(options: DriverOptions) -> FpgaPower:
    return FpgaPower(os.path.join(os.path.dirname(options.journal.path), "fpga-mode"))
'''

INVENTORY = """defaults: {ssh: {user: lab}, python: python3, sudo: false}
nodes:
  - {name: gpu, kind: server, model: a6000-server, roles: [server], address: 192.0.2.10,
     data: {interface: eth1, address: 10.9.0.10}}
  - {name: fpga1, kind: fpga, model: zcu104, roles: [device], address: 192.0.2.11,
     data: {interface: eth1, address: 10.9.0.11}}
link_profiles:
  wifi: {rate: 40mbit}
links:
  - {from: fpga1, to: gpu, profile: wifi, symmetric: true}
"""


def campaign(tmp_path: Path, mode: str) -> Path:
    path = tmp_path / f"fpga-{mode}.yaml"
    path.write_text(f"""name: fpga-{mode}
inventory: {tmp_path / 'inventory.yaml'}
base:
  method: ushape
  model: {REPO / 'examples' / 'models' / 'tiny'}
  partition: {{device_layers: 2, stages: 1}}
  server: gpu
  devices: [fpga1]
  workload: {{arrival: poisson, rate_per_s: 1.0, requests_per_device: 2, prompts: tiny-python, max_new_tokens: 4}}
  power: {{fpga1: {mode}}}
  telemetry: {{interval_ms: 200}}
""")
    return path


def test_a_lab_kind_needs_only_its_registry_row_and_its_power_driver(tmp_path):
    (tmp_path / "labkinds").mkdir()
    (tmp_path / "labkinds" / "lab_kinds.py").write_text(LAB_KINDS)
    (tmp_path / "inventory.yaml").write_text(INVENTORY)
    env = dict(os.environ, TESTBED_NODE_KINDS="lab_kinds",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "labkinds"), str(REPO)]))  # fmt: skip

    def testbed(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300, check=False)  # fmt: skip

    # the controller: the inventory takes the kind, the plan drives it as the row says
    done = testbed("run", str(campaign(tmp_path, "high")), "--dry-run", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(done.stdout)["runs"][0]
    lines = run["commands"]["fpga1"]
    assert any("nodes.power --kind fpga" in line and "set high --if-differs" in line for line in lines)
    assert any("nodes.power --kind fpga" in line and line.endswith("restore") for line in lines)
    planned = [c for c in run["plan"]["commands"] if c["node"] == "fpga1"]
    assert any("nodes.telemetry.sampler" in c["short"] and "--source host" in c["short"] for c in planned)
    assert any(c["what"] == "shape the links" for c in planned)  # it holds qdiscs: reached over SSH
    assert any(c["host"] == "fpga1" for c in planned) and all(c["host"] == "fpga1" for c in planned)
    assert "192.0.2.11:1" in run["plan"]["launch"]  # it runs an MPI rank (mpiexec reaches it at its address)
    # a mode its syntax refuses: exit 2, the campaign's line, the kind's own words; nothing touched
    refused = testbed("run", str(campaign(tmp_path, "turbo")), "--dry-run")
    assert refused.returncode == 2 and "power.fpga1" in refused.stderr and "write low or high" in refused.stderr
    # without the lab's module the kind is unknown, at the inventory's line
    unknown = subprocess.run([sys.executable, "-m", "testbed", "inventory", "check", "-i",
                              str(tmp_path / "inventory.yaml")], cwd=REPO, capture_output=True, text=True,
                             timeout=120, check=False, env=dict(os.environ, TESTBED_NODE_KINDS=""))  # fmt: skip
    assert unknown.returncode == 2 and "inventory.yaml:5" in unknown.stderr and "not a node kind" in unknown.stderr

    # the node: its copy of the node code with nodes/power/fpga.py added, and nothing else changed
    node_code = tmp_path / "node"
    shutil.copytree(REPO / "nodes", node_code / "nodes", ignore=shutil.ignore_patterns("__pycache__"))
    (node_code / "nodes" / "power" / "fpga.py").write_text(FPGA_DRIVER)
    journal = tmp_path / "power" / "journal.json"
    journal.parent.mkdir()

    def power(*action: str) -> dict:
        answer = subprocess.run([sys.executable, "-m", "nodes.power", "--kind", "fpga", "--journal", str(journal),
                                 *action], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(node_code)),
                                capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert answer.returncode == 0, answer.stdout + answer.stderr
        return json.loads(answer.stdout)

    assert power("set", "high")["state"]["mode_name"] == "high" and journal.is_file()
    assert power("show")["state"]["mode_name"] == "high"
    assert power("restore")["restored"]["mode_name"] == "low" and not journal.exists()


def test_the_built_in_rows_answer_what_the_controller_used_to_ask_of_kind():
    assert set(kind_names()) >= {"jetson", "server", "android"}
    phone = node_kind("android")
    assert phone.via_usb_host and not phone.shapes_links and not phone.runs_ranks
    jetson = node_kind("jetson")
    assert jetson.boards is not None and "agx-orin" in jetson.boards.models and jetson.boards.system_torch
    assert jetson.power_modes.problem("jetson", "MAXN") is None
    assert "nvpmodel" in (jetson.power_modes.problem("jetson", "MAXN; rm -rf /") or "")
    assert node_kind("server").power_modes.problem("server", "250W") is None
    assert node_kind("server").power_modes.problem("server", "fast") is not None
    try:
        node_kind("toaster")
    except KeyError as exc:
        assert "jetson" in str(exc)
    else:
        raise AssertionError("an unknown kind was answered")


def test_a_kinds_module_that_fails_to_import_is_named(tmp_path):
    done = subprocess.run([sys.executable, "-m", "testbed", "inventory", "check", "-i", str(REPO / "inventory.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ, TESTBED_NODE_KINDS="no_such_lab_kinds"))  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "TESTBED_NODE_KINDS" in done.stderr and "no_such_lab_kinds" in done.stderr


def test_kind_of_reads_the_row_of_an_inventory_node():
    from testbed.inventory import load_inventory

    lab = load_inventory(REPO / "inventory.yaml")
    assert kind_of(lab.node("orin")).name == "jetson" and kind_of(lab.node("server")).discrete_gpus
