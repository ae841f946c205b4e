"""What this host can do for an emulated testbed, checked by trying it.

Kernel features are probed inside a scratch network namespace that is deleted afterwards, so the
check changes nothing on the host's own interfaces.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from testbed.emulation.sshd_server import SSHD_CANDIDATES


@dataclass(frozen=True)
class Capability:
    name: str
    ok: bool
    detail: str
    needed_for: str
    required: bool = True  # False: the testbed works without it, with less fidelity


def _run(argv: list[str], timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
    """Run a probe; a missing program or a hang is a failed probe, not a crash."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: not installed")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]}: no answer in {timeout_s:g} s")


def _tool_version(argv: list[str]) -> tuple[bool, str]:
    if shutil.which(argv[0]) is None and not os.access(argv[0], os.X_OK):
        return False, "not installed"
    proc = _run(argv)
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    versioned = [line for line in lines if "version" in line.lower()]
    return True, " ".join((versioned or lines or ["installed"])[0].split())


def _venv_tool(name: str) -> str:
    """A tool from this Python environment's bin/ (mpiexec from the mpich wheel), else from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else name


def check_host() -> list[Capability]:
    caps: list[Capability] = []
    root = os.geteuid() == 0
    caps.append(
        Capability(
            "root",
            root,
            "running as root" if root else f"uid {os.geteuid()}",
            "namespaces, veths, tc and cgroups of the emulated testbed",
        )
    )
    caps += _kernel_capabilities(root)
    caps.append(_cgroup_cpu(root))
    missing = [tool for tool in ("nsenter", "unshare") if shutil.which(tool) is None]
    caps.append(
        Capability(
            "nsenter/unshare",
            not missing,
            "util-linux: " + ("found" if not missing else f"missing {', '.join(missing)} (apt-get install util-linux)"),
            "starting each node's sshd in its namespaces",
        )
    )
    sshd = next((p for p in SSHD_CANDIDATES if os.access(p, os.X_OK)), None)
    caps.append(
        Capability(
            "sshd",
            sshd is not None,
            sshd or "not installed (apt-get install openssh-server)",
            "an SSH server per emulated node",
        )
    )
    for tool, package, why, required in (
        ("ethtool", "ethtool", "wire-sized packets on emulated data veths (TSO/GSO/GRO off)", True),
        ("ping", "iputils-ping", "link verify's round-trip times (ping -U)", False),
    ):
        found = shutil.which(tool)
        caps.append(Capability(tool, found is not None, found or f"not installed (apt-get install {package})", why,
                               required))  # fmt: skip
    ok, detail = _tool_version(["iperf3", "--version"])
    caps.append(
        Capability("iperf3", ok, detail if ok else "not installed (apt-get install iperf3)", "measuring shaped links")
    )
    ok, detail = _tool_version([_venv_tool("mpiexec"), "--version"])
    caps.append(
        Capability(
            "mpiexec", ok, detail if ok else "not installed (pip install mpich mpi4py)", "split-inference workers"
        )
    )
    has_torch = importlib.util.find_spec("torch") is not None  # found, never imported by the controller
    caps.append(
        Capability(
            "torch",
            has_torch,
            f"torch {importlib.metadata.version('torch')}" if has_torch else "not installed",
            "inference workers",
        )
    )
    return caps


OPTIONAL = ("netem", "nfqueue")  # without both, rate shaping still works


def _kernel_capabilities(root: bool) -> list[Capability]:
    names = [
        ("netns", "network namespaces", "one namespace per emulated node"),
        ("veth", "veth pairs", "management and data links"),
        ("bridge", "Linux bridges", "the management and data networks"),
        ("htb", "tc qdisc htb", "rate shaping per destination"),
        ("tbf", "tc qdisc tbf", "simple rate shaping"),
        ("ingress", "tc qdisc ingress", "shaping traffic into a node"),
        ("ifb", "ifb devices", "ingress shaping through an ifb"),
        ("netem", "tc qdisc netem", "delay, jitter and loss"),
        ("nfqueue", "iptables NFQUEUE and statistic", "delay, jitter and loss without netem (the NFQUEUE path)"),
    ]
    if not root:
        return [Capability(key, False, "not checked: needs root", why, key not in OPTIONAL) for key, _, why in names]
    ns = f"tbdoctor{os.getpid()}"
    results: dict[str, tuple[bool, str]] = {}

    def step(key: str, argv: list[str]) -> bool:
        proc = _run(argv)
        results[key] = (
            proc.returncode == 0,
            "works"
            if proc.returncode == 0
            else (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}"),
        )
        return proc.returncode == 0

    qdiscs = {
        "htb": ["htb", "default", "1"],
        "tbf": ["tbf", "rate", "1mbit", "burst", "32kbit", "latency", "50ms"],
        "netem": ["netem", "delay", "1ms"],
    }
    if step("netns", ["ip", "netns", "add", ns]):
        try:
            veth = step("veth", ["ip", "-n", ns, "link", "add", "tbd0", "type", "veth", "peer", "name", "tbd1"])
            step("bridge", ["ip", "-n", ns, "link", "add", "tbdbr", "type", "bridge"])
            step("ifb", ["ip", "-n", ns, "link", "add", "tbdifb", "type", "ifb"])
            if veth:
                for key, args in qdiscs.items():
                    step(key, ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "tbd0", "root", *args])
                step("ingress", ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "tbd1", "ingress"])
                mangle = ["ip", "netns", "exec", ns, "iptables", "-w", "-t", "mangle", "-A", "PREROUTING", "-i", "tbd1"]
                if step("nfqueue", [*mangle, "-m", "statistic", "--mode", "random", "--probability", "0.5", "-j",
                                    "DROP"]):  # fmt: skip
                    step("nfqueue", [*mangle, "-j", "NFQUEUE", "--queue-num", "8100", "--queue-bypass"])
        finally:
            _run(["ip", "netns", "del", ns])
    caps = []
    for key, label, why in names:
        ok, detail = results.get(key, (False, "not checked (an earlier step failed)"))
        if key == "netem" and not ok:
            detail = (
                "MISSING on this kernel (no sch_netem): delay, jitter and loss take the NFQUEUE path "
                "where it works (below); rate shaping works. " + detail
            )
        if key == "nfqueue" and ok and importlib.util.find_spec("netfilterqueue") is None:
            ok, detail = False, "the rules work, but the NetfilterQueue Python package is missing (make venv)"
        caps.append(Capability(key, ok, f"{label}: {detail}", why, required=key not in OPTIONAL))
    netem, nfqueue = (results.get(k, (False, ""))[0] for k in ("netem", "nfqueue"))
    nfqueue = nfqueue and importlib.util.find_spec("netfilterqueue") is not None
    path = "netem (a tc qdisc)" if netem else "nfqueue (iptables on the receiver + a user-space handler)"
    caps.append(
        Capability(
            "delay-path", netem or nfqueue, ("auto takes " + path) if netem or nfqueue else "none: neither works here",
            "link profiles with delay, jitter or loss", required=False,
        )
    )  # fmt: skip
    return caps


def _cgroup_cpu(root: bool) -> Capability:
    why = "CPU quota per emulated node (its power mode)"
    controllers = Path("/sys/fs/cgroup/cgroup.controllers")
    if controllers.exists():
        has_cpu = "cpu" in controllers.read_text().split()
        if not has_cpu:
            return Capability("cgroup-cpu", False, "cgroup v2 without the cpu controller", why)
        if not root:
            return Capability("cgroup-cpu", False, "cgroup v2 cpu controller present; needs root to use", why)
        probe = Path(f"/sys/fs/cgroup/tbdoctor{os.getpid()}")
        try:
            probe.mkdir()
            (probe / "cpu.max").write_text("50000 100000")
            ok, detail = True, "cgroup v2 cpu.max works"
        except OSError as exc:
            ok, detail = False, f"cgroup v2: {exc}"
        finally:
            if probe.exists():
                probe.rmdir()
        return Capability("cgroup-cpu", ok, detail, why)
    v1 = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    if v1.exists():
        return Capability("cgroup-cpu", root, "cgroup v1 cpu controller" + ("" if root else "; needs root"), why)
    return Capability("cgroup-cpu", False, "no cgroup cpu controller found", why)
