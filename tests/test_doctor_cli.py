"""`testbed doctor` probes this host for real and leaves nothing behind; every command documents itself."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli


def host_state() -> tuple[list[str], list[str]]:
    """Doctor's scratch namespaces and cgroups (named tbdoctor<pid>) on this host; other test files' labs
    come and go meanwhile, so only doctor's own names count."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    netns = sorted(line.split()[0] for line in listed.splitlines() if line.startswith("tbdoctor"))
    cgroups = sorted(p.name for p in Path("/sys/fs/cgroup").rglob("tbdoctor*")) if os.geteuid() == 0 else []
    return netns, cgroups


def test_doctor_reports_each_capability_and_leaves_no_trace():
    before = host_state()
    proc = run_cli("doctor", "--json")
    assert host_state() == before, "doctor must delete its scratch namespace and cgroup"
    caps = {c["name"]: c for c in json.loads(proc.stdout)}
    expected = {
        "root",
        "netns",
        "veth",
        "bridge",
        "htb",
        "tbf",
        "ingress",
        "ifb",
        "netem",
        "nfqueue",
        "delay-path",
        "cgroup-cpu",
        "ethtool",
        "ping",
        "nsenter/unshare",
        "sshd",
        "iperf3",
        "mpiexec",
        "torch",
    }
    assert set(caps) == expected
    assert caps["netem"]["required"] is False and caps["nfqueue"]["required"] is False
    # Without netem, delay takes the NFQUEUE path where doctor found it working.
    assert caps["delay-path"]["ok"] == (caps["netem"]["ok"] or caps["nfqueue"]["ok"])
    if caps["nfqueue"]["ok"] and not caps["netem"]["ok"]:
        assert "nfqueue" in caps["delay-path"]["detail"]
    required_missing = [n for n, c in caps.items() if c["required"] and not c["ok"]]
    assert proc.returncode == (1 if required_missing else 0)
    # What doctor says about netem agrees with the kernel, checked independently.
    modules = Path("/proc/modules").read_text() if Path("/proc/modules").exists() else ""
    if caps["netem"]["ok"]:
        assert "sch_netem" in modules or os.path.exists("/sys/module/sch_netem")
    else:
        assert "MISSING" in caps["netem"]["detail"]
    assert caps["sshd"]["ok"] == any(os.access(p, os.X_OK) for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd"))


@pytest.mark.skipif(os.geteuid() != 0, reason="the kernel probes need root")
def test_doctor_as_root_exercises_the_kernel():
    caps = {c["name"]: c for c in json.loads(run_cli("doctor", "--json").stdout)}
    for name in ("netns", "veth", "bridge", "htb", "tbf", "ingress", "ifb"):
        assert caps[name]["detail"].endswith("works") or not caps[name]["ok"]


def test_doctor_table_says_netem_plainly():
    proc = run_cli("doctor")
    assert "netem" in proc.stdout
    assert "What this host can do" in proc.stdout


@pytest.mark.parametrize(
    "command",
    [[], ["doctor"], ["inventory"], ["inventory", "show"], ["inventory", "check"], ["inventory", "export-ansible"]],
)
def test_every_command_has_help(command):
    proc = run_cli(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "Usage:" in text and len(text.split()) > 20
    if command and command != ["inventory"]:
        assert "--inventory" in text and "-i" in text


def test_unknown_option_is_a_usage_error():
    proc = run_cli("inventory", "show", "--bogus")
    assert proc.returncode == 2
    assert "No such option" in proc.stderr or "no such option" in proc.stderr.lower()
