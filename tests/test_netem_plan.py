"""Link profiles compiled to tc plans: the exact commands, for a table of profiles."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from foundation.errors import InputError, TestbedError
from netem import plan as netem_plan
from netem.plan import queue_limit_packets
from netem.profile import DirectedLink, LinkProfile
from netem.topology import LinkNode, LinkTopology
from testbed.inventory import load_inventory
from testbed.links.plans import compile_plan
from testbed.links.verify import iperf3_goodput

LAB = """
nodes:
  - {name: s, kind: server, model: x, address: 10.9.0.1, data: {interface: eth1, address: 10.250.0.1}}
  - {name: d, kind: jetson, model: agx-orin, address: 10.9.0.2, data: {interface: eth1, address: 10.250.0.2}}
  - {name: p, kind: android, model: pixel, adb: {serial: AB12, usb_host: s}, data: {interface: wlan0, address: 10.250.0.3}}
link_profiles:
  up: {rate: 5MBps}
  down: {rate: 40mbit}
  lossy: {rate: 8mbit, delay: 20ms, jitter: 2ms, distribution: normal, loss: 0.5%, loss_correlation: 25%}
links:
  - {from: d, to: s, profile: up}
  - {from: s, to: d, profile: down}
  - {from: p, to: s, profile: up}
  - {from: s, to: p, profile: lossy}
"""


@pytest.fixture
def plans(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(LAB)
    return {(p.node, p.direction): p for p in compile_plan(load_inventory(path))}


def lines(commands):
    return [" ".join(c) for c in commands]


def test_egress_plan_has_one_htb_class_per_destination_and_netem_only_where_asked(plans):
    server = plans[("s", "egress")]
    assert server.interface == "eth1" and server.uses_netem
    assert lines(server.apply_commands()) == [
        "tc qdisc replace dev eth1 root handle 1f7b: htb",
        "tc class replace dev eth1 parent 1f7b: classid 1f7b:1 htb rate 40000000bit ceil 40000000bit burst 25000b cburst 25000b quantum 50000",
        "tc qdisc replace dev eth1 parent 1f7b:1 handle 1: pfifo limit 100",
        "tc filter replace dev eth1 parent 1f7b: protocol ip prio 1 handle 800::1 u32 match ip dst 10.250.0.2/32 flowid 1f7b:1",
        "tc class replace dev eth1 parent 1f7b: classid 1f7b:2 htb rate 8000000bit ceil 8000000bit burst 5000b cburst 5000b quantum 10000",
        "tc qdisc replace dev eth1 parent 1f7b:2 handle 2: netem delay 20000us 2000us distribution normal loss 0.5% 25% limit 64",
        "tc filter replace dev eth1 parent 1f7b: protocol ip prio 1 handle 800::2 u32 match ip dst 10.250.0.3/32 flowid 1f7b:2",
    ]
    assert lines(server.undo_commands()) == ["tc qdisc del dev eth1 root handle 1f7b: htb"]
    assert lines(server.apply_commands(ours_in_place=True)) == lines(server.apply_commands())[1:]
    device = plans[("d", "egress")]
    assert not device.uses_netem
    assert lines(device.apply_commands())[1] == (
        "tc class replace dev eth1 parent 1f7b: classid 1f7b:1 htb rate 40000000bit ceil 40000000bit burst 25000b cburst 25000b quantum 50000"
    )  # 5MBps is 40 mbit


def test_a_phones_uplink_is_shaped_on_the_receivers_ingress_through_an_ifb(plans):
    ingress = plans[("s", "ingress")]
    assert ingress.ifb == "ifbtb0"
    assert lines(ingress.apply_commands()) == [
        "ip link add ifbtb0 type ifb",
        "ip link set ifbtb0 up",
        "tc qdisc replace dev eth1 handle ffff: ingress",
        "tc qdisc replace dev ifbtb0 root handle 1f7b: htb",
        "tc class replace dev ifbtb0 parent 1f7b: classid 1f7b:1 htb rate 40000000bit ceil 40000000bit burst 25000b cburst 25000b quantum 50000",
        "tc qdisc replace dev ifbtb0 parent 1f7b:1 handle 1: pfifo limit 100",
        "tc filter replace dev ifbtb0 parent 1f7b: protocol ip prio 1 handle 800::1 u32 match ip src 10.250.0.3/32 flowid 1f7b:1",
        "tc filter replace dev eth1 parent ffff: protocol ip prio 1 handle 800::1 u32 match ip src 10.250.0.3/32 action mirred egress redirect dev ifbtb0",
    ]
    assert lines(ingress.undo_commands()) == ["tc qdisc del dev eth1 handle ffff: ingress", "ip link del ifbtb0"]
    assert ("p", "egress") not in plans  # nothing runs on the phone


@pytest.mark.parametrize(
    ("profile", "packets"),
    [
        ("{rate: 8mbit}", 64),  # small BDP: the floor
        ("{rate: 1gbit}", 2500),  # 1.5 x 1 Gbit/s x 20 ms / 1500 B
        ("{rate: 100mbit, delay: 50ms}", 875),  # 1.5 x 100 Mbit/s x 70 ms / 1500 B
        ("{rate: 8mbit, queue_limit_packets: 30}", 30),  # as given
    ],
)
def test_queue_limit_follows_the_bandwidth_delay_product(tmp_path, profile, packets):
    path = tmp_path / "lab.yaml"
    path.write_text(
        f"nodes:\n  - {{name: a, kind: server, model: x, address: 10.9.0.1}}\nlink_profiles:\n  p: {profile}\n"
    )
    assert queue_limit_packets(load_inventory(path).spec.link_profiles["p"]) == packets


def test_a_node_without_a_data_interface_cannot_be_shaped(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(
        "nodes:\n  - {name: a, kind: server, model: x, address: 10.9.0.1}\n"
        "  - {name: b, kind: server, model: x, address: 10.9.0.2}\n"
        "link_profiles:\n  p: {rate: 8mbit}\nlinks:\n  - {from: a, to: b, profile: p}\n"
    )
    with pytest.raises(InputError, match=r"lab.yaml:7: links\[0\]: a -> b: node a has no data: section"):
        load_inventory(path)  # refused where the link is written
    # netem's own check, for a topology built otherwise (an emulated testbed that is not up yet)
    nodes = (LinkNode("a", None, None, runs_tc=True), LinkNode("b", "eth1", "10.9.0.2", runs_tc=True))
    topology = LinkTopology("a lab", nodes, (DirectedLink("a", "b", "p", LinkProfile(rate="8mbit")),))
    with pytest.raises(TestbedError, match="no data interface to shape"):
        netem_plan.compile_plan(topology)


def test_netem_compiles_a_topology_without_an_inventory(plans):
    """netem needs names, data planes, who runs tc and the links: the same plans as the inventory's."""
    up, down = LinkProfile(rate="5MBps"), LinkProfile(rate="40mbit")
    nodes = (
        LinkNode("s", "eth1", "10.250.0.1", runs_tc=True),
        LinkNode("d", "eth1", "10.250.0.2", runs_tc=True),
        LinkNode("p", "wlan0", "10.250.0.3", runs_tc=False),
    )
    links = (DirectedLink("d", "s", "up", up), DirectedLink("s", "d", "down", down), DirectedLink("p", "s", "up", up))
    compiled = {(p.node, p.direction): p for p in netem_plan.compile_plan(LinkTopology("a lab", nodes, links))}
    assert set(compiled) == {("s", "egress"), ("d", "egress"), ("s", "ingress")}
    for key in (("d", "egress"), ("s", "ingress")):
        assert lines(compiled[key].apply_commands()) == lines(plans[key].apply_commands())
    unshaped = LinkTopology("a lab", (nodes[0], LinkNode("d", None, None, runs_tc=True)), links[:1])
    with pytest.raises(Exception, match=r"^a lab: node 'd' has no data interface to shape"):
        netem_plan.compile_plan(unshaped)


REAL_PAIR = """
nodes:
  - {name: a, kind: server, model: x, address: 10.9.0.1, data: {interface: v0, address: 10.250.7.1}}
  - {name: b, kind: server, model: x, address: 10.9.0.2, data: {interface: v1, address: 10.250.7.2}}
link_profiles:
  p: {rate: 8mbit}
links:
  - {from: a, to: b, profile: p}
"""


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")
def test_the_commands_shape_real_qdiscs_and_undo_restores_them(tmp_path):
    """The plan's commands, run as they are on a veth pair between two scratch namespaces: iperf3
    measures the rate within 10%, and undo leaves the qdiscs as they were."""
    path = tmp_path / "lab.yaml"
    path.write_text(REAL_PAIR)
    (plan,) = compile_plan(load_inventory(path))
    ns = f"tq{os.getpid()}"

    def run(*argv, netns="a", check=True):
        return subprocess.run(
            ["ip", "netns", "exec", f"{ns}{netns}", *argv], capture_output=True, text=True, timeout=60, check=check
        )

    subprocess.run(["ip", "netns", "add", f"{ns}a"], check=True)
    subprocess.run(["ip", "netns", "add", f"{ns}b"], check=True)
    try:
        subprocess.run(
            ["ip", "link", "add", "v0", "netns", f"{ns}a", "type", "veth", "peer", "name", "v1", "netns", f"{ns}b"],
            check=True,
        )
        for side, dev, address in (("a", "v0", "10.250.7.1"), ("b", "v1", "10.250.7.2")):
            run("ip", "addr", "add", f"{address}/24", "dev", dev, netns=side)
            run("ip", "link", "set", dev, "up", netns=side)
        before = json.loads(run("tc", "-j", "qdisc", "show", "dev", "v0").stdout)
        for command in plan.apply_commands() + plan.apply_commands(ours_in_place=True):  # re-applying works
            run(*command)
        server = subprocess.Popen(
            ["ip", "netns", "exec", f"{ns}b", "iperf3", "-s", "-B", "10.250.7.2"], stdout=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                client = run("iperf3", "-c", "10.250.7.2", "-t", "3", "-J", check=False)
                try:  # iperf 3.12 exits 0 with an "error" member when the server is not listening yet
                    received_bit_s, _ = iperf3_goodput(json.loads(client.stdout))
                    break
                except ValueError:
                    assert time.monotonic() < deadline, client.stdout + client.stderr
                    time.sleep(0.1)
        finally:
            server.terminate()
            server.wait(timeout=30)
        assert received_bit_s == pytest.approx(8e6, rel=0.10)
        for command in plan.undo_commands():
            run(*command)
        assert json.loads(run("tc", "-j", "qdisc", "show", "dev", "v0").stdout) == before
    finally:
        subprocess.run(["ip", "netns", "del", f"{ns}a"], check=False)
        subprocess.run(["ip", "netns", "del", f"{ns}b"], check=False)
