"""The inventory schema: what it accepts, and every rejection with its FILE:LINE: field message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from foundation.errors import InputError
from testbed.inventory import load_inventory
from tests.conftest import REPO, run_cli

GOOD = """\
defaults:
  ssh: {user: nvidia, identity_file: ~/.ssh/id_ed25519}
nodes:
  - name: orin-1
    kind: jetson
    model: agx-orin
    address: 192.168.1.11
    data: {interface: wlan0, address: 10.0.0.11}
    roles: [device]
  - name: gpu
    kind: server
    model: a6000-server
    address: gpu.lab.example
    ssh: {user: lab, port: 2222}
    gpus: 8
    roles: [server]
    data: {interface: eth1, address: 10.0.0.2}
  - name: phone
    kind: android
    model: pixel-7-pro
    adb: {serial: 28011FDH2000AB, usb_host: gpu}
    data: {interface: wlan0, address: 10.0.0.21}
groups:
  devices: [orin-1, phone]
link_profiles:
  up: {rate: 5MBps, delay: 5ms, jitter: 1ms, loss: 0.1%}
  down: {rate: 80mbit}
links:
  - {from: devices, to: gpu, profile: up}
  - {from: gpu, to: devices, profile: down}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(tmp_path: Path, text: str) -> list[str]:
    with pytest.raises(InputError) as info:
        load_inventory(write(tmp_path, text))
    return [str(p) for p in info.value.problems]


@pytest.mark.parametrize("path", ["inventory.yaml", "examples/inventories/lab.yaml", "examples/inventories/phones-lab.yaml"])
def test_shipped_inventories_are_valid(path):
    inv = load_inventory(REPO / path)
    assert inv.nodes
    assert all(lk.source != lk.destination for lk in inv.links)


def test_default_inventory_is_an_emulated_server_and_three_device_models():
    inv = load_inventory(REPO / "inventory.yaml")
    assert all(n.emulated is not None for n in inv.nodes)
    assert [n.kind for n in inv.nodes].count("server") == 1
    devices = [n for n in inv.nodes if "device" in n.roles]
    assert len(devices) == 3 and len({n.model for n in devices}) == 3
    # WiFi's few ms of round trip on every link, one way each (the NFQUEUE path gives it without netem)
    assert all(0.001 <= lk.profile.delay_s <= 0.005 and not lk.profile.loss_pct for lk in inv.links)


def test_lab_inventory_matches_hat_testbed():
    inv = load_inventory(REPO / "examples/inventories/lab.yaml")
    models = [n.model for n in inv.nodes]
    assert models.count("agx-xavier") == 20 and models.count("agx-orin") == 10
    server = next(n for n in inv.nodes if "server" in n.roles)
    assert server.gpus == 8
    phones = [n for n in inv.nodes if n.kind == "android"]
    assert len(phones) == 2 and all(p.adb and p.adb.usb_host for p in phones)
    distance_groups = [g for g in inv.groups if g.endswith("m") and g[0].isalpha() and "-" in g]
    assert len(distance_groups) == 3 and sum(len(inv.groups[g]) for g in distance_groups) == 30


def test_resolution_of_groups_links_and_ssh_defaults(tmp_path):
    inv = load_inventory(write(tmp_path, GOOD))
    assert inv.groups["devices"] == ("orin-1", "phone")
    pairs = {(lk.source, lk.destination): lk for lk in inv.links}
    assert set(pairs) == {("orin-1", "gpu"), ("phone", "gpu"), ("gpu", "orin-1"), ("gpu", "phone")}
    up = pairs[("orin-1", "gpu")].profile
    assert up.rate_bit_s == 40e6 and up.delay_s == pytest.approx(0.005) and up.loss_pct == pytest.approx(0.1)
    assert up.has_delay_or_loss and not pairs[("gpu", "orin-1")].profile.has_delay_or_loss
    gpu = inv.ssh_target(inv.node("gpu"))
    assert (gpu.user, gpu.port, gpu.identity_file) == ("lab", 2222, "~/.ssh/id_ed25519")
    orin = inv.ssh_target(inv.node("orin-1"))
    assert (orin.user, orin.port) == ("nvidia", 22)
    assert [n.name for n in inv.select(["devices"])] == ["orin-1", "phone"]


def test_symmetric_link_shapes_both_directions(tmp_path):
    text = GOOD.replace("  - {from: gpu, to: devices, profile: down}\n", "").replace(
        "profile: up}", "profile: up, symmetric: true}"
    )
    inv = load_inventory(write(tmp_path, text))
    assert {(lk.source, lk.destination) for lk in inv.links} == {
        ("orin-1", "gpu"),
        ("gpu", "orin-1"),
        ("phone", "gpu"),
        ("gpu", "phone"),
    }


def edit(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


REJECTIONS = [
    # (change to GOOD, line, field, words in the problem)
    (edit("    model: agx-orin\n", "    model: agx-orin\n    colour: red\n"), 7, "nodes[0].colour", "unknown key"),
    (edit("  - name: gpu\n", "  - name: orin-1\n"), 10, "nodes[1].name", "duplicate node name"),
    (edit("  devices: [orin-1, phone]", "  devices: [orin-1, phnoe]"), 24, "groups.devices[1]", "unknown node"),
    (edit("{from: devices, to: gpu", "{from: devices, to: gpus"), 29, "links[0].to", "unknown node or group"),
    (edit("profile: down}", "profile: dwn}"), 30, "links[1].profile", "unknown link profile"),
    (edit("rate: 80mbit", "rate: 10 mbps"), 27, "link_profiles.down.rate", "whitespace"),
    (edit("rate: 80mbit", "rate: 10mbps"), 27, "link_profiles.down.rate", "ambiguous"),
    (edit("delay: 5ms", "delay: 5"), 26, "link_profiles.up.delay", "no unit"),
    (edit("loss: 0.1%", "loss: 120%"), 26, "link_profiles.up.loss", "more than 100%"),
    (edit("rate: 80mbit", "rate: 0mbit"), 27, "link_profiles.down.rate", "greater than 0"),
    (edit("rate: 80mbit", "rate: 900gbit"), 27, "link_profiles.down.rate", "less than or equal"),
    (edit("delay: 5ms", "delay: 5min"), 26, "link_profiles.up.delay", "less than or equal"),
    (edit("port: 2222", "port: 70000"), 14, "nodes[1].ssh.port", "less than or equal"),
    (edit("gpus: 8", "gpus: -1"), 15, "nodes[1].gpus", "greater than or equal"),
    (edit("gpus: 8", "gpus: true"), 15, "nodes[1].gpus", "valid integer"),
    (edit("port: 2222", "port: '2222'"), 14, "nodes[1].ssh.port", "valid integer"),
    (edit("ssh: {user: nvidia,", "sudo: 'off'\n  ssh: {user: nvidia,"), 2, "defaults.sudo", "valid boolean"),
    (
        edit("ssh: {user: nvidia,", "ssh: {connect_timeout: 0s, user: nvidia,"),
        2,
        "defaults.ssh.connect_timeout",
        "greater than 0",
    ),
    (edit("interface: wlan0", "interface: 'wlan0; reboot'"), 8, "nodes[0].data.interface", "not allowed"),
    (edit("interface: wlan0", "interface: wlan0-is-far-too-long"), 8, "nodes[0].data.interface", "not allowed"),
    (
        edit("identity_file: ~/.ssh/id_ed25519", "identity_file: ~/my keys/id"),
        2,
        "defaults.ssh.identity_file",
        "not allowed",
    ),
    (edit("serial: 28011FDH2000AB", "serial: '28011$(reboot)'"), 21, "nodes[2].adb.serial", "not allowed"),
    (edit("address: 192.168.1.11", "address: '192.168.1.11 && reboot'"), 7, "nodes[0].address", "not an IP"),
    (edit("address: 10.0.0.11", "address: wlan.example"), 8, "nodes[0].data.address", "not an IP address"),
    (
        edit("ssh: {user: nvidia,", "ssh: {user: nvidia, password: hunter2,"),
        2,
        "defaults.ssh.password",
        "secrets must not be written",
    ),
    (
        edit("    ssh: {user: lab, port: 2222}\n", "    ssh: {user: lab, port: 2222}\n    sudo_password: x\n"),
        15,
        "nodes[1].sudo_password",
        "secrets must not be written",
    ),
    (edit("    kind: jetson\n", "    kind: jetsn\n"), 5, "nodes[0].kind", "is not a node kind"),
    (edit("    model: agx-orin\n", "    model: agx-orn\n"), 6, "nodes[0].model", "unknown Jetson model"),
    (edit("    address: 192.168.1.11\n", ""), 4, "nodes[0]", "'address' is missing"),
    (edit("    adb: {serial: 28011FDH2000AB, usb_host: gpu}\n", ""), 18, "nodes[2]", "needs an 'adb:' section"),
    (edit("usb_host: gpu}", "usb_host: nowhere}"), 21, "nodes[2].adb.usb_host", "unknown node"),
    (edit("usb_host: gpu}", "usb_host: phone}"), 21, "nodes[2].adb.usb_host", "is a phone"),
    (
        edit("address: gpu.lab.example", "address: 192.168.1.11\n    ssh: {port: 22}").replace(
            "    ssh: {user: lab, port: 2222}\n", ""
        ),
        13,
        "nodes[1].address",
        "is also node 'orin-1'",
    ),
    (
        edit("  up: {rate: 5MBps, delay: 5ms, jitter: 1ms, loss: 0.1%}", "  up: {rate: 5MBps, jitter: 1ms}"),
        26,
        "link_profiles.up.jitter",
        "jitter needs a delay",
    ),
    (
        edit("  up: {rate: 5MBps, delay: 5ms, jitter: 1ms, loss: 0.1%}", "  up: {queue_limit_packets: 10}"),
        26,
        "link_profiles.up",
        "shapes nothing",
    ),
    (
        edit("  devices: [orin-1, phone]", "  devices: [orin-1, more]\n  more: [devices]"),
        24,
        "groups.devices",
        "include each other",
    ),
    (edit("  devices: [orin-1, phone]", "  gpu: [orin-1]"), 24, "groups.gpu", "already a node name"),
    (GOOD + "  - {from: orin-1, to: gpu, profile: down}\n", 31, "links[2]", "also shaped by the link on line 29"),
    (
        edit(
            "nodes:\n",
            "nodes:\n  - name: x\n    kind: server\n    model: m\n    address: 10.9.9.9\n  - name: x\n"
            "    kind: server\n    model: m\n    address: 10.9.9.8\n",
        ),
        8,
        "nodes[1].name",
        "duplicate node name",
    ),
    (edit("  devices: [orin-1, phone]", "  devices: [orin-1, phone\n"), 26, "", "YAML syntax error"),
    (edit("  down: {rate: 80mbit}", "  down: {rate: 80mbit}\n  down: {rate: 10mbit}"), 28, "", "duplicate key"),
]


@pytest.mark.parametrize(("text", "line", "field", "words"), REJECTIONS)
def test_rejection_names_file_line_and_field(tmp_path, text, line, field, words):
    problems = problems_of(tmp_path, text)
    prefix = f"{tmp_path / 'inventory.yaml'}:{line}: {field}" if field else f"{tmp_path / 'inventory.yaml'}:{line}:"
    matching = [p for p in problems if p.startswith(prefix) and words in p]
    assert matching, f"expected '{prefix} ... {words}' in {problems}"
    assert all(";" in p for p in matching), "every problem carries a hint"


def test_all_problems_are_reported_at_once(tmp_path):
    text = edit("kind: jetson", "kind: phone").replace("rate: 80mbit", "rate: 80").replace("gpus: 8", "gpus: x")
    problems = problems_of(tmp_path, text)
    assert len(problems) == 3, problems


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(InputError, match="file not found"):
        load_inventory(tmp_path / "nope.yaml")
    assert "must be a mapping" in problems_of(tmp_path, "- just\n- a list\n")[0]


def test_cli_rejects_bad_inventory_with_status_2_and_the_message(tmp_path):
    path = write(tmp_path, edit("rate: 80mbit", "rate: 10 mbps"))
    for args in (["inventory", "show"], ["inventory", "check"], ["inventory", "export-ansible"]):
        proc = run_cli(*args, "-i", str(path))
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert f"{path}:27: link_profiles.down.rate" in proc.stderr
        assert "Traceback" not in proc.stderr


def test_cli_show_and_export_ansible(tmp_path):
    path = write(tmp_path, GOOD)
    shown = run_cli("inventory", "show", "-i", str(path), "--json")
    assert shown.returncode == 0, shown.stderr
    exported = run_cli("inventory", "export-ansible", "-i", str(path))
    assert exported.returncode == 0, exported.stderr
    data = YAML(typ="safe").load(exported.stdout)
    hosts = data["all"]["hosts"]
    assert set(hosts) == {"orin-1", "gpu"}  # the phone is reached through its USB host
    assert hosts["gpu"]["ansible_port"] == 2222 and hosts["gpu"]["ansible_user"] == "lab"
    assert set(data["all"]["children"]["devices"]["hosts"]) == {"orin-1"}
    assert "phone" in exported.stderr



def test_the_inventory_comes_from_testbed_inventory_unless_i_is_given(tmp_path):
    path = write(tmp_path, GOOD)

    def show(*args: str, variable: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "testbed", "inventory", "show", "--json", *args], cwd=REPO,
                              env=dict(os.environ, TESTBED_INVENTORY=variable), capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip

    def names(proc: subprocess.CompletedProcess[str]) -> set[str]:
        assert proc.returncode == 0, proc.stderr
        return {node["name"] for node in json.loads(proc.stdout)["spec"]["nodes"]}

    assert names(show(variable=str(path))) == {"orin-1", "gpu", "phone"}  # not the repository's inventory.yaml
    assert "server" in names(show("-i", str(REPO / "inventory.yaml"), variable=str(path)))  # -i wins
    missing = show(variable=str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr and "TESTBED_INVENTORY" in missing.stderr

def test_names_that_look_like_secret_keys_are_fine_as_names(tmp_path):
    text = edit("  devices: [orin-1, phone]", "  devices: [orin-1, phone]\n  token: [gpu]").replace(
        "  down: {rate: 80mbit}", "  down: {rate: 80mbit}\n  password: {rate: 1mbit}"
    )
    inv = load_inventory(write(tmp_path, text))
    assert inv.groups["token"] == ("gpu",) and "password" in inv.spec.link_profiles


def test_problem_in_a_merged_mapping_still_gets_a_line(tmp_path):
    text = GOOD.replace(
        "link_profiles:\n", "link_profiles:\n  base: &base {rate: 10mbit}\n  merged: {<<: *base, loss: 200%}\n"
    )
    problems = problems_of(tmp_path, text)
    assert any(p.startswith(f"{tmp_path / 'inventory.yaml'}:27: link_profiles.merged.loss") for p in problems), problems


def test_nan_power_is_refused(tmp_path):
    text = (
        edit(
            "    roles: [device]\n  - name: gpu",
            "    roles: [device]\n    emulated: {power_modes: [{id: 0, name: M, cpus: 1, idle_w: .nan, busy_w: 5}]}\n  - name: gpu",
        )
        .replace("    address: 192.168.1.11\n", "")
        .replace("    data: {interface: wlan0, address: 10.0.0.11}\n", "")
    )
    problems = problems_of(tmp_path, text)
    assert any("idle_w" in p and "finite" in p for p in problems), problems


def test_a_link_to_a_node_off_the_data_plane_is_refused_at_its_line(tmp_path):
    """A shaped link is shaped on the data plane: a real node a link names needs its data: section
    (interface and address). Refused at load, not when `link apply` first compiles a plan."""
    text = edit("    data: {interface: eth1, address: 10.0.0.2}\n", "")
    (problem,) = problems_of(tmp_path, text)
    assert problem.startswith(f"{tmp_path / 'inventory.yaml'}:28: links[0]: orin-1 -> gpu: node gpu has no data:")
    assert "give gpu data: {interface: ..., address: ...}" in problem
    # a node no link names needs none
    assert load_inventory(write(tmp_path, text[: text.index("links:\n")] + "links: []\n"))


def test_groups_and_nodes_override_python_sudo_workdir_venv_and_ssh(tmp_path):
    text = GOOD.replace("groups:\n  devices: [orin-1, phone]\n", textwrap.dedent("""\
        groups:
          devices: [orin-1, phone]
          jetsons:
            members: [orin-1]
            python: /usr/bin/python3.8
            workdir: /data/hil
            ssh: {user: ubuntu, jump: bastion.lab}
          servers: {members: [gpu], sudo: false, venv: /opt/venvs/hil}
        """)).replace("    ssh: {user: lab, port: 2222}\n", "    ssh: {user: lab, port: 2222}\n    python: /opt/py/bin/python3\n")
    inv = load_inventory(write(tmp_path, text))
    orin, gpu, phone = (inv.settings_of(n) for n in ("orin-1", "gpu", "phone"))
    assert (orin.python, orin.workdir, orin.venv_path, orin.sudo) == ("/usr/bin/python3.8", "/data/hil",
                                                                      "/data/hil/venv", True)  # fmt: skip
    assert (gpu.python, gpu.workdir, gpu.venv_path, gpu.sudo) == ("/opt/py/bin/python3", "~/hil-testbed",
                                                                  "/opt/venvs/hil", False)  # fmt: skip
    assert phone == gpu, "a phone's commands run on its USB host, with the host's settings"
    target = inv.ssh_target(inv.node("orin-1"))
    assert (target.user, [hop.host for hop in target.jumps]) == ("ubuntu", ["bastion.lab"])
    assert inv.groups["jetsons"] == ("orin-1",) and inv.groups["servers"] == ("gpu",)


def test_two_groups_setting_one_field_differently_for_a_node_are_refused(tmp_path):
    text = GOOD.replace("groups:\n  devices: [orin-1, phone]\n", textwrap.dedent("""\
        groups:
          devices: [orin-1, phone]
          a: {members: [orin-1], workdir: /data/a}
          b: {members: [devices], workdir: /data/b}
          c: {members: [gpu], workdir: /data/c}
        """))
    problems = problems_of(tmp_path, text)
    assert len(problems) == 1 and "inventory.yaml:26: groups.b.workdir: orin-1 is also in group 'a', which sets " \
        "workdir to '/data/a'; set workdir on orin-1 itself, or in one of the two groups" in problems[0], problems
    inv = load_inventory(write(tmp_path, text.replace("    roles: [device]\n  - name: gpu",
                                                       "    roles: [device]\n    workdir: /mine\n  - name: gpu")))
    assert inv.settings_of("orin-1").workdir == "/mine"


RANGES = """\
defaults: {ssh: {user: nvidia}}
nodes:
  - {name: gpu, kind: server, model: a6000-server, address: 10.50.0.2, roles: [server],
     data: {interface: eth1, address: 10.60.0.2}}
  - name: xavier-[08:12]
    kind: jetson
    model: agx-xavier
    address: 192.168.50.[18:22]
    data: {interface: wlan0, address: "10.60.1.[8:12]"}
    roles: [device]
groups:
  near: ["xavier-[08:09]"]
  far: {members: ["xavier-[10:12]"], workdir: /data/hil}
link_profiles:
  up: {rate: 5MBps}
links:
  - {from: near, to: gpu, profile: up}
"""


def test_a_host_range_makes_one_node_per_name_with_addresses_paired_in_order(tmp_path):
    inv = load_inventory(write(tmp_path, RANGES))
    xaviers = [n for n in inv.nodes if n.kind == "jetson"]
    assert [n.name for n in xaviers] == ["xavier-08", "xavier-09", "xavier-10", "xavier-11", "xavier-12"]
    assert [n.address for n in xaviers] == [f"192.168.50.{i}" for i in range(18, 23)]
    assert [n.data.address for n in xaviers] == [f"10.60.1.{i}" for i in range(8, 13)]
    assert inv.groups["near"] == ("xavier-08", "xavier-09") and len(inv.groups["far"]) == 3
    assert inv.settings_of("xavier-11").workdir == "/data/hil" and inv.settings_of("xavier-09").workdir != "/data/hil"
    assert {(lk.source, lk.destination) for lk in inv.links} == {("xavier-08", "gpu"), ("xavier-09", "gpu")}


@pytest.mark.parametrize(
    "old,new,line,field,words",
    [
        ("address: 192.168.50.[18:22]", "address: 192.168.50.[18:21]", 8, "nodes[1].address",
         "the range gives 4 values for 5 nodes (xavier-08 to xavier-12)"),
        ("name: xavier-[08:12]", "name: xavier-[12:08]", 5, "nodes[1].name", "counts down (12 to 08)"),
        ("name: xavier-[08:12]", "name: xavier-[08:12]-[1:2]", 5, "nodes[1].name", "more than one [first:last] range"),
        ("name: xavier-[08:12]", "name: xavier-08", 8, "nodes[1].address",
         "a range here needs a range in the node's name"),
        ("address: 192.168.50.[18:22]", "address: 192.168.50.[254:258]", 8, "nodes[1] (xavier-10).address",
         "'192.168.50.256' is not an IP address"),
        ('  near: ["xavier-[08:09]"]', '  near: ["xavier-[08:09]", "orin-[1:2]"]', 12, "groups.near[1]",
         "unknown node or group 'orin-1'"),
    ],
)  # fmt: skip
def test_a_bad_host_range_is_named_at_its_entry(tmp_path, old, new, line, field, words):
    problems = problems_of(tmp_path, RANGES.replace(old, new))
    assert any(p.startswith(f"{tmp_path / 'inventory.yaml'}:{line}: {field}") and words in p for p in problems), \
        problems  # fmt: skip


def test_a_range_in_a_flow_list_without_quotes_is_a_syntax_error_that_says_to_quote_it(tmp_path):
    problems = problems_of(tmp_path, RANGES.replace('["xavier-[08:09]"]', "[xavier-[08:09]]"))
    assert problems == [f"{tmp_path / 'inventory.yaml'}:12: YAML syntax error: expected ',' or ']', but got '['; "
                        "a host range inside [ ] or { } needs quotes: \"xavier-[08:09]\""], problems


def test_hat_lab_inventory_is_written_with_ranges_in_at_most_60_lines():
    path = REPO / "examples" / "inventories" / "hat-lab.yaml"
    assert len(path.read_text().splitlines()) <= 60
    inv = load_inventory(path)
    models = [n.model for n in inv.nodes]
    assert models.count("agx-xavier") == 20 and models.count("agx-orin") == 10
    assert [len(inv.groups[g]) for g in ("near", "mid", "far")] == [11, 10, 9]
