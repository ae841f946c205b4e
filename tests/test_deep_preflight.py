"""``testbed inventory check --deep`` on an emulated lab reached as a real one (a non-root SSH user whose
sudo allows only the printed rules): clean, it passes; with eight faults planted the way they happen in
a lab, it names each one on its node with the command that fixes it, and exits 1 naming the nodes.

The faults: an unknown host key (the controller's known_hosts lost a node's line), a missing sudo rule
(the sudoers file lost an alias), no clock sync (the node's timedatectl says so), MPI's ports blocked
(a firewall on the server's data plane), the wrong torch (the node's Python has none), iperf3 missing
(hidden in the node's mount namespace), no server-to-device key (the devices no longer authorize the
server's), and a full disk (a 64 KiB file system over the node's home)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import emulated_inventory, emulated_lab, run_cli

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root"),
    pytest.mark.skipif(shutil.which("sudo") is None, reason="sudo is not installed (make system-packages)"),
    pytest.mark.slow,
    pytest.mark.root,
]

PREFIX, OCTET = "hdp", 184
USER = f"hdeep{os.getpid() % 100000}"
NODES = """nodes:
  - name: server
    kind: server
    model: a6000-server
    roles: [server]
    emulated:
      power_modes:
        - {{id: 0, name: default, cpus: 1.0, idle_w: 90, busy_w: 300}}
  - name: orin
    kind: jetson
    model: agx-orin
    roles: [device]
    emulated:
      power_modes:
        - {{id: 0, name: MAXN, cpus: 0.5, idle_w: 7.0, busy_w: 40.0}}
  - name: xavier
    kind: jetson
    model: agx-xavier
    roles: [device]
    python: {python}
    emulated:
      power_modes:
        - {{id: 0, name: MAXN, cpus: 0.4, idle_w: 6.0, busy_w: 30.0}}
  - name: spare
    kind: jetson
    model: agx-xavier
    roles: [device]
    emulated:
      power_modes:
        - {{id: 0, name: MAXN, cpus: 0.4, idle_w: 6.0, busy_w: 30.0}}
groups:
  devices: [orin, xavier, spare]
link_profiles:
  wifi: {{rate: 8MBps}}
links:
  - {{from: devices, to: server, profile: wifi}}
  - {{from: server, to: devices, profile: wifi}}
"""


@pytest.fixture(scope="module")
def lab() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="he-deep-"))
    directory.chmod(0o711)  # the SSH user passes through to the lab's state
    # xavier's Python is a wrapper whose target the test can change: this Python (with torch), later a
    # bare venv's (none)
    python = directory / "xavier-python"
    (directory / "python-target").write_text(sys.executable)
    python.write_text(f'#!/bin/sh\nexec "$(cat {directory / "python-target"})" "$@"\n')
    python.chmod(0o755)
    (directory / "python-target").chmod(0o644)
    path = emulated_inventory(directory, PREFIX, OCTET, NODES.format(python=python))
    path.write_text(path.read_text().replace("emulation:\n", f"emulation:\n  ssh_user: {USER}\n  sudo_rules: printed\n"))
    try:
        with emulated_lab(path):
            yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def deep_check(lab: Path) -> subprocess.CompletedProcess[str]:
    # wide: the problems are read from the text
    return run_cli("inventory", "check", "--deep", "-i", str(lab), "--model", str(lab.parent), timeout_s=300)


def in_mount_namespace(node: str, *argv: str) -> None:
    """``argv`` in the mount namespace of ``node``'s sshd (so in every session it starts), as root."""
    pids = subprocess.run(["ip", "netns", "pids", f"{PREFIX}-{node}"], capture_output=True, text=True,
                          check=True).stdout.split()  # fmt: skip
    sshd = next(p for p in pids if Path(f"/proc/{p}/comm").read_text().strip() == "sshd")
    subprocess.run(["nsenter", "-t", sshd, "-m", "--", *argv], check=True, capture_output=True)


def plant_faults(lab: Path) -> None:
    from testbed.emulation.resolved import load_lab

    inventory = load_lab(lab)
    state = lab.parent / "state"
    known_hosts = next(state.rglob("known_hosts"))
    spare = str(inventory.node("spare").address)
    kept = [line for line in known_hosts.read_text().splitlines() if spare not in line.split(" ", 1)[0]]
    known_hosts.write_text("\n".join(kept) + "\n")  # 1: spare's host key is unknown
    sudoers = Path(f"/etc/sudoers.d/hil-testbed-{PREFIX}")
    lines = sudoers.read_text().splitlines()
    user_line = next(i for i, line in enumerate(lines) if line.startswith(f"{USER} "))
    lines[user_line] = lines[user_line].replace("HIL_TC, ", "")
    assert "HIL_TC" not in lines[user_line]
    sudoers.write_text("\n".join(lines) + "\n")  # 2: the tc rule is missing
    (state / "nodes" / "orin" / "clock_sync").write_text("no\n")  # 3: orin's clock is not synchronised
    subprocess.run(["ip", "netns", "exec", f"{PREFIX}-server", "iptables", "-w", "-I", "INPUT", "-i", "data0",
                    "-p", "tcp", "--syn", "-j", "DROP"], check=True)  # 4: the server's data plane takes no TCP
    bare = lab.parent / "bare-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    (lab.parent / "python-target").write_text(str(bare / "bin" / "python"))  # 5: xavier's Python has no torch
    hidden = lab.parent / "no-iperf3"
    hidden.write_text("")
    in_mount_namespace("orin", "mount", "--bind", str(hidden), shutil.which("iperf3") or "/usr/bin/iperf3")  # 6
    user_key = (state / "ssh-user" / "id_ed25519.pub").read_text().strip()
    authorized = next(state.rglob("authorized_keys"))
    authorized.write_text("".join(f"{k}\n" for k in authorized.read_text().splitlines() if k.strip() != user_key))  # 7
    home = state / "nodes" / "xavier" / "home"
    in_mount_namespace("xavier", "mount", "-t", "tmpfs", "-o", "size=64k,mode=1777", "tmpfs", str(home))  # 8


def problems_of(output: str, node: str) -> str:
    """The problem lines the check printed for ``node`` (and its row's error, where unreachable)."""
    return "\n".join(line for line in output.replace("\n  ", " ").splitlines() if line.startswith(f"{node}:"))


def test_a_clean_lab_passes_and_each_planted_fault_is_named_on_its_node_with_its_fix(lab: Path):
    clean = deep_check(lab)
    assert clean.returncode == 0, clean.stdout[-6000:] + clean.stderr[-3000:]
    assert "4/4 nodes fine" in clean.stdout

    plant_faults(lab)
    found = deep_check(lab)
    text = found.stdout + found.stderr
    assert found.returncode == 1, text[-6000:]
    assert "not fine: server, orin, xavier, spare" in found.stderr
    flat = " ".join(text.split())  # rich wraps long lines
    spare = problems_of(text, "spare")
    assert "ssh-keyscan" in flat and "spare" in spare, text[-6000:]  # 1
    assert "sudo does not allow HIL_TC" in problems_of(text, "orin"), text[-6000:]  # 2
    assert "visudo -cf" in flat
    assert "clock is not synchronised" in problems_of(text, "orin") and "timedatectl set-ntp true" in flat  # 3
    server = problems_of(text, "server")
    assert "cannot open TCP to" in server and "on this server's data plane" in server, text[-6000:]  # 4
    assert "iptables -I INPUT -p tcp -s" in flat
    xavier = problems_of(text, "xavier")
    assert "torch does not import with" in xavier and "ModuleNotFoundError" in xavier, text[-6000:]  # 5
    assert "iperf3 is missing" in problems_of(text, "orin") and "apt-get install -y iperf3" in flat  # 6
    assert "mpiexec here cannot reach orin" in server and "ssh-copy-id" in flat, text[-6000:]  # 7
    assert "needed for the venv and the weights" in xavier and "du -xh" in flat, text[-6000:]  # 8
