"""A delay path is one class given to netem.delay_path.register: here a lab's inline hardware link
emulator, driven by a command-line tool on the node that receives (a stand-in script that keeps the
emulator's settings in a file and lists them back: this machine has no such hardware). The
inventory names it, the run plan shapes and restores with it, the link transaction journals,
applies, reads back and undoes it on real nodes, and nothing else in the suite names it."""

from __future__ import annotations

import os
import shlex
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from netem import delay_path as delay_paths
from netem.plan import TcPlan
from netem.topology import LinkTopology
from tests.conftest import REPO, emulated_inventory, emulated_lab

TOOL = r"""#!/bin/sh
# linkemu PORT... : a stand-in for an inline link emulator's CLI (settings kept in $HOME/linkemu.state)
state="$HOME/linkemu.state"; touch "$state"
case "$1" in
  set) grep -v "^$2 $3 " "$state" > "$state.new"; echo "$2 $3 delay_ms $4 loss_pct $5" >> "$state.new";
       mv "$state.new" "$state" ;;
  clear) grep -v "^$2 $3 " "$state" > "$state.new"; mv "$state.new" "$state" ;;
  show) cat "$state" ;;
  *) echo "usage: linkemu set|clear|show" >&2; exit 2 ;;
esac
"""


@dataclass(frozen=True)
class EmulatedPort:
    """The emulator's setting for one direction into its receiver: the receiver's port and the sender."""

    node: str
    interface: str
    sender_address: str
    delay_ms: float
    loss_pct: float
    tool: str
    delay_path = "linkemu"
    queues: tuple[dict, ...] = ()

    @property
    def key(self) -> tuple[str, ...]:
        return (self.interface, self.sender_address)

    @property
    def description(self) -> str:
        return f"{self.sender_address} -> {self.node}"

    def rule_lines(self) -> list[str]:
        return [f"{self.interface} {self.sender_address} delay_ms {self.delay_ms:g} loss_pct {self.loss_pct:g}"]

    def apply_commands(self) -> list[list[str]]:
        return [[self.tool, "set", self.interface, self.sender_address, f"{self.delay_ms:g}", f"{self.loss_pct:g}"]]

    def undo_commands(self) -> list[list[str]]:
        return [[self.tool, "clear", *self.key]]


class LinkEmulatorPath:
    """The hardware emulator on the receiver's port: tc keeps the rate, the emulator the delay and loss."""

    name = "linkemu"
    auto = False
    listing_name = "linkemu settings"

    def __init__(self, tool: str) -> None:
        self.tool = tool
        self.listing_argv = (tool, "show")

    def readiness_probe(self, installed) -> str:
        return f"if [ -x {shlex.quote(self.tool)} ]; then echo ready; else echo 'missing: the linkemu tool'; fi"

    def ready(self, answer: str) -> bool:
        return answer == "ready"

    def not_ready(self, node: str, answer: str, what: str) -> str:
        return f"{node}: the link emulator is not reachable ({answer}) for {what}; install its tool"

    def compile(self, topology: LinkTopology, plans: Sequence[TcPlan], traced: Collection[tuple[str, str]]):
        ports = []
        for plan in plans:
            for peer in plan.peers:
                if peer.profile.has_delay_or_loss:
                    sender, receiver = (plan.node, peer.peer) if plan.direction == "egress" else (peer.peer, plan.node)
                    holder, other = topology.node(receiver), topology.node(sender)
                    ports.append(EmulatedPort(receiver, holder.data_interface, other.data_address,
                                              1000 * (peer.profile.delay_s or 0.0), peer.profile.loss_pct or 0.0,
                                              self.tool))  # fmt: skip
        return tuple(ports)

    def commands(self, held, listing: str, journaled) -> list[list[str]]:
        wanted = {r.key for r in held}
        return self.undo([k for k in journaled if k not in wanted], listing) + [
            c for r in held for c in r.apply_commands()
        ]

    def differences(self, held, listing: str) -> list[str]:
        return [] if held.rule_lines()[0] in listing.splitlines() else [f"linkemu: {held.rule_lines()[0]} not set"]

    def undo(self, journaled, listing: str) -> list[list[str]]:
        set_now = {tuple(line.split()[:2]) for line in listing.splitlines() if line.strip()}
        return [[self.tool, "clear", *k] for k in journaled if tuple(k) in set_now]

    def key_problem(self, key) -> str | None:
        return None if len(key) == 2 and all(isinstance(k, str) and k.strip() for k in key) else "not (port, sender)"

    def listed(self, key, listing: str) -> list[str]:
        return [line for line in listing.splitlines() if tuple(line.split()[:2]) == tuple(key)]


@pytest.fixture(scope="module")
def linkemu(tmp_path_factory) -> Path:
    tool = tmp_path_factory.mktemp("linkemu") / "linkemu"
    tool.write_text(TOOL)
    tool.chmod(0o755)
    if "linkemu" not in delay_paths.names():
        delay_paths.register(LinkEmulatorPath(str(tool)))
    return tool


def test_a_third_delay_path_is_a_registered_class_the_plan_uses_for_shaping_and_restore(linkemu, tmp_path):
    from testbed.campaign.load import load_campaign
    from testbed.campaign.plan import plan_run
    from testbed.links.node_journal import LinkJournal

    assert delay_paths.names()[:2] == ("netem", "nfqueue") and "linkemu" in delay_paths.names()
    assert delay_paths.choose("auto", {"netem": "missing", "nfqueue": "ready", "linkemu": "ready"}) == "nfqueue"
    inventory = tmp_path / "lab.yaml"
    inventory.write_text("""defaults: {ssh: {user: lab}, sudo: false, delay_path: linkemu}
nodes:
  - {name: gpu, kind: server, model: a6000-server, roles: [server], address: 192.0.2.10,
     data: {interface: eth1, address: 10.9.0.10}}
  - {name: orin, kind: jetson, model: agx-orin, roles: [device], address: 192.0.2.11,
     data: {interface: eth1, address: 10.9.0.11}}
link_profiles:
  wifi: {rate: 40mbit, delay: 5ms, loss: 1%}
links:
  - {from: orin, to: gpu, profile: wifi, symmetric: true}
""")
    campaign = tmp_path / "c.yaml"
    campaign.write_text(f"""name: emu
inventory: {inventory}
base:
  method: ushape
  model: {REPO / 'examples' / 'models' / 'tiny'}
  partition: {{device_layers: 2, stages: 1}}
  server: gpu
  devices: [orin]
  workload: {{requests_per_device: 1, max_new_tokens: 2}}
  telemetry: {{enabled: false}}
""")
    loaded = load_campaign(campaign)
    plan = plan_run(loaded, loaded.runs[0], 1, live=False)  # planned, no node reached
    assert {p.delay_path for p in plan.tc_plans} == {"linkemu"}
    assert all(p.leaf_kind(peer) == "pfifo" for p in plan.tc_plans for peer in p.peers)  # tc keeps the rate
    held = {n: [r.key for r in rules] for n, rules in plan.shaping.held.items()}
    assert held == {"gpu": [("eth1", "10.9.0.11")], "orin": [("eth1", "10.9.0.10")]}
    lines = {(c.node, c.what): c.line for c in plan.commands}
    assert f"{linkemu} set eth1 10.9.0.11 5 1" in lines[("gpu", "shape the links")]
    assert f"{linkemu} clear eth1 10.9.0.11" in lines[("gpu", "undo the shaping (only what the journal says is ours)")]
    assert ("orin", "read linkemu settings back") in lines and ("orin", "read linkemu settings after undoing") in lines
    changes = [line for (_node, what), line in lines.items() if what.startswith(("shape the links", "undo the"))]
    assert changes and not any("iptables" in line or " netem " in line for line in changes)  # neither other path
    # the journal keeps its keys by path, checked by the path before they reach a command
    journal = LinkJournal(devices={}, held={"linkemu": (("eth1", "10.9.0.11"),)})
    assert LinkJournal.from_json(journal.to_json()).held == journal.held
    with pytest.raises(ValueError, match=r"held\.linkemu: not"):
        LinkJournal.from_json(journal.to_json().replace('"10.9.0.11"', '""'))
    # an inventory naming a path nobody registered is refused at its line
    from foundation.errors import InputError
    from testbed.inventory import load_inventory

    (tmp_path / "other.yaml").write_text(inventory.read_text().replace("delay_path: linkemu", "delay_path: fpga"))
    with pytest.raises(InputError, match=r"other.yaml:1.*delay_path.*'fpga' is not a delay path"):
        load_inventory(tmp_path / "other.yaml")


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.root
def test_the_link_transaction_journals_applies_reads_back_and_undoes_a_third_path(linkemu, tmp_path, monkeypatch):
    from testbed.emulation.resolved import load_lab
    from testbed.links.apply import apply_plans, clear_nodes, show_nodes
    from testbed.links.plans import compile_plan

    path = emulated_inventory(tmp_path, "dp", 196)
    text = path.read_text().replace("defaults:\n", "defaults:\n  delay_path: linkemu\n", 1)  # sudo: false there
    path.write_text(text)
    # the lab's module, named as a lab names its own: the CLI (emulate up, link clear) registers the path too
    (tmp_path / "lab_linkemu.py").write_text(
        "from netem.delay_path import names, register\nfrom tests.test_delay_paths import LinkEmulatorPath\n"
        f"if 'linkemu' not in names():\n    register(LinkEmulatorPath({str(linkemu)!r}))\n")  # fmt: skip
    monkeypatch.setenv("TESTBED_NODE_KINDS", "lab_linkemu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    with emulated_lab(path):
        lab = load_lab(path)
        result = apply_plans(lab, compile_plan(lab))
        assert result.ok, [o.error for o in result.applied.failed]
        state = {n: (tmp_path / "state" / "nodes" / n / "home" / "linkemu.state") for n in ("server", "orin")}
        server_ports = state["server"].read_text().splitlines()
        # the three devices' uplinks (wifi-up: 2 ms) on the server's port, each downlink on its device's
        assert len(server_ports) == 3 and all("delay_ms 2 " in line for line in server_ports), server_ports
        shown = {o.node: o.value for o in show_nodes(lab).outcomes}
        assert len(shown["server"].held) == 3 and all(key.startswith("linkemu ") for key in shown["server"].held)
        again = apply_plans(lab, compile_plan(lab))  # held already, read back: nothing sent
        assert again.ok and not any(o.value.changed for o in again.applied.outcomes)
        cleared = clear_nodes(lab)
        assert cleared.ok and all(o.value is None or not o.value.leftovers for o in cleared.outcomes)
        assert state["server"].read_text() == "" and state["orin"].read_text() == ""
