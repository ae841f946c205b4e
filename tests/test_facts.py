"""Facts gathered from real nodes (sshd on 127.0.0.1), phones through a stand-in adb, and parsers fed
the real tools' output formats."""

from __future__ import annotations

import json
import os
import sys

import pytest

from testbed.inventory import load_inventory
from testbed.transport.facts import NodeFacts, judge, parse_adb_devices, parse_l4t_release
from tests.conftest import REPO, inventory_text, run_cli

STANDINS = REPO / "tests" / "standins"


@pytest.mark.parametrize(
    ("line", "release"),
    [
        (
            "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug  1 19:57:35 UTC 2023",
            "35.4.1",
        ),
        (
            "# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic, EABI: aarch64, DATE: Fri Jul 19 23:24:25 UTC 2024",
            "36.3.0",
        ),
        (
            "# R32 (release), REVISION: 7.1, GCID: 29818004, BOARD: t186ref, EABI: aarch64, DATE: Sat Feb 19 17:07:00 UTC 2022",
            "32.7.1",
        ),
        ("garbage", None),
    ],
)
def test_l4t_release(line, release):
    assert parse_l4t_release(line) == release


def test_adb_devices_lines():
    devices = parse_adb_devices(
        [
            "28011FDH2000AB         device usb:1-1.2 product:cheetah model:Pixel_7_Pro device:cheetah transport_id:3",
            "2A131FDH300CDE         unauthorized usb:1-1.3 transport_id:4",
            "* daemon started successfully",
        ]
    )
    assert [(d.serial, d.state) for d in devices] == [("28011FDH2000AB", "device"), ("2A131FDH300CDE", "unauthorized")]
    assert devices[0].details["model"] == "Pixel_7_Pro"


def test_judging_a_jetson_that_is_not_what_the_inventory_says(tmp_path):
    path = tmp_path / "inv.yaml"
    path.write_text("nodes:\n  - {name: j, kind: jetson, model: agx-xavier, address: 10.0.0.1}\n")
    inv = load_inventory(path)
    facts = NodeFacts(
        node="j",
        kind="jetson",
        python="Python 3.8.10",
        sudo="no",
        user="nvidia",
        board_model="NVIDIA Jetson AGX Orin Developer Kit",
        l4t_release="35.4.1",
    )
    problems, _ = judge(inv, inv.node("j"), facts)
    assert any("agx-xavier" in p and "AGX Orin" in p for p in problems)
    assert any("sudo needs a password" in p for p in problems)
    right = NodeFacts(
        node="j",
        kind="jetson",
        python="Python 3.8.10",
        sudo="yes",
        board_model="NVIDIA Jetson AGX Xavier Developer Kit",
        l4t_release="35.4.1",
    )
    assert judge(inv, inv.node("j"), right) == ([], [])
    # a clock offset within its exchange's bound (half the round trip) may be the exchange's asymmetry
    from dataclasses import replace

    from testbed.transport.clock import ClockOffset

    slow_exchange = replace(right, clock=ClockOffset(0.15, 0.4, 3, "adb date"))
    assert judge(inv, inv.node("j"), slow_exchange) == ([], [])
    off = replace(right, clock=ClockOffset(0.5, 0.02, 3, "echo"))
    assert any("clock is +500 ms" in w for w in judge(inv, inv.node("j"), off)[1])


def test_check_over_real_ssh_reports_facts_and_clock(tmp_path, ssh_keys, sshd_factory):
    servers = [sshd_factory() for _ in range(3)]
    path = tmp_path / "inv.yaml"
    path.write_text(inventory_text(ssh_keys, [(f"n{i}", s.port) for i, s in enumerate(servers)]))
    proc = run_cli("inventory", "check", "-i", str(path), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["node"] for r in rows] == ["n0", "n1", "n2"] and all(r["ok"] for r in rows)
    facts = rows[0]["facts"]
    assert facts["hostname"] == os.uname().nodename and facts["arch"] == os.uname().machine
    assert facts["kernel"] == os.uname().release and facts["cpus"] == os.cpu_count()
    assert facts["python"] == f"Python {sys.version.split()[0]}"
    assert facts["mem_total_mib"] > 0 and facts["disk_free_gib"] > 0
    assert facts["sudo"] in ("root", "yes", "no")
    clock = facts["clock"]
    assert clock["method"] == "python" and clock["exchanges"] == 8
    assert abs(clock["offset_s"]) <= clock["rtt_s"] / 2 + 0.005, "same clock: offset within the error bound"


def test_check_with_one_unreachable_node(tmp_path, ssh_keys, sshd_factory):
    from testbed.emulation.sshd_server import free_port

    servers = [sshd_factory() for _ in range(2)]
    path = tmp_path / "inv.yaml"
    nodes = [("up0", servers[0].port), ("down", free_port()), ("up1", servers[1].port)]
    path.write_text(inventory_text(ssh_keys, nodes))
    proc = run_cli("inventory", "check", "-i", str(path), "--json")
    assert proc.returncode == 1
    rows = {r["node"]: r for r in json.loads(proc.stdout)}
    assert rows["up0"]["ok"] and rows["up1"]["ok"]
    assert not rows["down"]["ok"] and "cannot connect" in rows["down"]["error"]
    table = run_cli("inventory", "check", "-i", str(path), "--nodes", "up0", "--nodes", "down")
    assert table.returncode == 1
    assert "1/2 nodes fine" in table.stdout and "down: cannot connect" in table.stdout


def test_phones_are_checked_through_adb_on_their_usb_host(tmp_path, ssh_keys, sshd_factory, monkeypatch):
    environment = {
        "PATH": f"{STANDINS}:{os.environ['PATH']}",
        "ADB_STANDIN_DEVICES": "28011FDH2000AB:device 2A131FDH300CDE:unauthorized",
    }
    for key, value in environment.items():
        monkeypatch.setenv(key, value)  # for the phone on the controller
    sshd = sshd_factory(environment)  # for the phones on the USB host reached over SSH
    phones = (
        "  - {name: p1, kind: android, model: pixel-7-pro, adb: {serial: 28011FDH2000AB, usb_host: host}}\n"
        "  - {name: p2, kind: android, model: pixel-7-pro, adb: {serial: 2A131FDH300CDE, usb_host: host}}\n"
        "  - {name: p3, kind: android, model: pixel-7-pro, adb: {serial: MISSING0001, usb_host: controller}}\n"
    )
    path = tmp_path / "inv.yaml"
    path.write_text(inventory_text(ssh_keys, [("host", sshd.port)], phones))
    proc = run_cli("inventory", "check", "-i", str(path), "--json")
    rows = {r["node"]: r for r in json.loads(proc.stdout)}
    assert proc.returncode == 1
    assert rows["p1"]["ok"], rows["p1"]
    assert (
        rows["p1"]["facts"]["os"] == "Android 14 (Pixel 7 Pro)" and rows["p1"]["facts"]["clock"]["method"] == "adb date"
    )
    assert "unauthorized" in rows["p2"]["error"] and "USB debugging" in rows["p2"]["error"]
    assert "not attached" in rows["p3"]["error"]
    host = rows["host"]
    assert not host["ok"] and host["facts"], host
    assert [d["serial"] for d in host["facts"]["adb_devices"]] == ["28011FDH2000AB", "2A131FDH300CDE"]
    assert any("p2" in p and "unauthorized" in p for p in host["facts"]["problems"])
