"""Facts about a node, gathered in one command, and the problems they reveal against the inventory.

The gathering script is plain POSIX sh so that it runs on a bare node (no testbed code yet):
Jetson boards (L4T release, device-tree model), GPU servers (nvidia-smi), USB hosts (adb), and
any Linux. Phones are asked through adb on their USB host.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace

from foundation.errors import NodeError
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.transport.base import Transport
from testbed.transport.clock import ClockOffset, echo_script, offset_over, read_echo_headers

CLOCK_WARN_S = 0.1
DISK_WARN_GIB = 5.0

# What /proc/device-tree/model contains on each Jetson model of the inventory (any one of them).
# Downstream L4T on AGX Xavier says just "Jetson-AGX".
# One line per fact, ``key=value``; keys may repeat (one ``gpu`` per GPU). Builtins where possible:
# the script runs on every node at every check, and a node's CPU is what it measures.
_FACTS_SCRIPT = r"""
k() { printf '%s=%s\n' "$1" "$2"; }
read -r h < /proc/sys/kernel/hostname; k hostname "$h"
set -- $(uname -m -r); k kernel "$1"; k arch "$2"
[ -r /etc/os-release ] && k os "$(. /etc/os-release; printf '%s' "$PRETTY_NAME")"
k cpus "$(getconf _NPROCESSORS_ONLN 2>/dev/null || nproc)"
while read -r key value _; do [ "$key" = MemTotal: ] && k mem_total_kb "$value" && break; done < /proc/meminfo
k disk_free_kb "$(df -Pk "$HOME" 2>/dev/null | { read -r _; read -r _ _ _ free _; echo "$free"; })"
uid=$(id -u); k user "${USER:-${LOGNAME:-$(id -un)}}"
if [ "$uid" = 0 ]; then k sudo root; elif sudo -n true 2>/dev/null; then k sudo yes; else k sudo no; fi
if command -v nvidia-smi >/dev/null 2>&1; then
  if out=$(nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits 2>&1); then
    printf '%s\n' "$out" | while IFS= read -r l; do k gpu "$l"; done
  else k gpu_error "$(printf '%s' "$out" | head -n 1)"; fi
fi
r=${TESTBED_STANDIN_ROOT:-}
[ -r "$r/etc/nv_tegra_release" ] && { read -r l < "$r/etc/nv_tegra_release"; k nv_tegra_release "$l"; }
[ -r "$r/proc/device-tree/model" ] && k board_model "$(tr -d '\000' < "$r/proc/device-tree/model")"
[ -n "${TESTBED_EMULATED_NODE:-}" ] && k emulated "$TESTBED_EMULATED_NODE"
if command -v adb >/dev/null 2>&1; then
  adb devices -l 2>/dev/null | tail -n +2 | while IFS= read -r l; do [ -n "$l" ] && k adb "$l"; done
fi
echo facts-end
"""

_ANDROID_SCRIPT = (
    "echo model=$(getprop ro.product.model); echo android=$(getprop ro.build.version.release); "
    "echo kernel=$(uname -r); echo arch=$(uname -m); echo abi=$(getprop ro.product.cpu.abi); "
    "echo cpus=$(ls -d /sys/devices/system/cpu/cpu[0-9]* | wc -l); "
    "echo mem_total_kb=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo); "
    "echo disk_free_kb=$(df -k /data | awk 'NR==2 {print $4}')"
)


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_mib: int | None
    driver: str


@dataclass(frozen=True)
class AdbDevice:
    """One line of ``adb devices -l``."""

    serial: str
    state: str  # device, unauthorized, offline, ...
    details: dict[str, str]


@dataclass(frozen=True)
class NodeFacts:
    node: str
    kind: str
    hostname: str = ""
    arch: str = ""
    kernel: str = ""
    os: str = ""
    python: str = ""
    cpus: int | None = None
    mem_total_mib: int | None = None
    disk_free_gib: float | None = None
    user: str = ""
    sudo: str = ""  # root, yes (passwordless), no, or n/a
    gpus: tuple[GpuInfo, ...] = ()
    l4t_release: str | None = None
    board_model: str | None = None
    adb_devices: tuple[AdbDevice, ...] = ()
    emulated: bool = False  # a node of the emulated testbed: board files and Jetson tools are stand-ins
    clock: ClockOffset | None = None
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    raw: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def parse_key_values(text: str) -> dict[str, list[str]]:
    """``key=value`` lines into lists of values per key (keys may repeat, e.g. one per GPU)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and re.fullmatch(r"[a-z_]+", key):
            out.setdefault(key, []).append(value.strip())
    return out


def parse_l4t_release(line: str) -> str | None:
    """``# R35 (release), REVISION: 4.1, ...`` from /etc/nv_tegra_release -> ``35.4.1``."""
    m = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", line)
    return f"{m[1]}.{m[2]}" if m else None


def parse_adb_devices(lines: list[str]) -> tuple[AdbDevice, ...]:
    """Lines of ``adb devices -l`` (after its header) into devices."""
    devices = []
    for line in lines:
        parts = line.split()
        if len(parts) < 2 or parts[0].startswith("*"):
            continue
        details = dict(p.split(":", 1) for p in parts[2:] if ":" in p)
        devices.append(AdbDevice(parts[0], parts[1], details))
    return tuple(devices)


def _parse_gpu(line: str) -> GpuInfo | None:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 4 or not parts[0].isdigit():
        return None
    memory = int(parts[2]) if parts[2].isdigit() else None
    return GpuInfo(int(parts[0]), parts[1], memory, parts[3])


def _int(values: dict[str, list[str]], key: str) -> int | None:
    text = (values.get(key) or [""])[0]
    return int(text) if text.isdigit() else None


def first_value(values: dict[str, list[str]], key: str) -> str:
    """The first value of ``key`` in :func:`parse_key_values` output, or ``""``."""
    return (values.get(key) or [""])[0]


def facts_script(python: str) -> str:
    """sh that prints a node's facts, then answers clock-offset exchanges (one command for both:
    each command a node runs costs a login shell, whose rc files can be slow)."""
    return _FACTS_SCRIPT + echo_script(python)


def gather_facts(inventory: Inventory, node: NodeSpec, transport: Transport, *, timeout_s: float = 30.0) -> NodeFacts:
    """Facts of a Linux node (Jetson, server, USB host) reached through ``transport``."""
    script = facts_script(inventory.settings_of(node).python)
    lines: list[str] = []
    try:
        with transport.open_line_session(["sh", "-c", script]) as session:
            while (line := session.read_line(timeout_s)) != "facts-end":
                lines.append(line)
            headers = read_echo_headers(session, timeout_s)
            clock = offset_over(session, method=headers["clock"], timeout_s=timeout_s)
    except (EOFError, TimeoutError, ValueError, KeyError) as exc:
        got = "; ".join(lines[-3:]) or "no output"
        raise NodeError(node.name, f"gathering facts failed ({type(exc).__name__}: {exc}; got: {got})") from None
    values = parse_key_values("\n".join(lines))
    values["python"] = [headers["python"]]
    mem_kb, disk_kb = _int(values, "mem_total_kb"), _int(values, "disk_free_kb")
    release_line = first_value(values, "nv_tegra_release")
    facts = NodeFacts(
        node=node.name,
        kind=node.kind,
        hostname=first_value(values, "hostname"),
        arch=first_value(values, "arch"),
        kernel=first_value(values, "kernel"),
        os=first_value(values, "os"),
        python=first_value(values, "python"),
        cpus=_int(values, "cpus"),
        mem_total_mib=mem_kb // 1024 if mem_kb is not None else None,
        disk_free_gib=disk_kb / 1024**2 if disk_kb is not None else None,
        user=first_value(values, "user"),
        sudo=first_value(values, "sudo"),
        gpus=tuple(g for g in map(_parse_gpu, values.get("gpu", [])) if g is not None),
        l4t_release=parse_l4t_release(release_line) if release_line else None,
        board_model=first_value(values, "board_model") or None,
        adb_devices=parse_adb_devices(values.get("adb", [])),
        emulated=bool(first_value(values, "emulated")),
        clock=clock,
        raw=values,
    )
    problems, warnings = judge(inventory, node, facts)
    return replace(facts, problems=tuple(problems), warnings=tuple(warnings))


def gather_phone_facts(inventory: Inventory, phone: NodeSpec, host: Transport, *, timeout_s: float = 30.0) -> NodeFacts:
    """Facts of a phone, asked with adb on its USB host."""
    assert phone.adb is not None
    serial = phone.adb.serial
    listing = host.run(["adb", "devices", "-l"], timeout_s=timeout_s)
    if listing.exit_code == 127:
        raise NodeError(phone.name, f"adb is not installed on USB host {phone.adb.usb_host}")
    devices = parse_adb_devices(listing.check().stdout.splitlines()[1:])
    state = next((d.state for d in devices if d.serial == serial), None)
    if state is None:
        raise NodeError(
            phone.name,
            f"serial {serial} is not attached to {phone.adb.usb_host} "
            f"(adb sees: {', '.join(d.serial for d in devices) or 'nothing'})",
        )
    if state != "device":
        hint = "accept the USB debugging prompt on the phone" if state == "unauthorized" else "reconnect it"
        raise NodeError(phone.name, f"adb reports {serial} as {state}; {hint}")
    values = parse_key_values(
        host.run(["adb", "-s", serial, "shell", _ANDROID_SCRIPT], timeout_s=timeout_s).check().stdout
    )
    clock = _phone_clock(host, serial, timeout_s)
    mem_kb, disk_kb = _int(values, "mem_total_kb"), _int(values, "disk_free_kb")
    facts = NodeFacts(
        node=phone.name,
        kind=phone.kind,
        hostname=serial,
        arch=first_value(values, "arch"),
        kernel=first_value(values, "kernel"),
        os=f"Android {first_value(values, 'android')} ({first_value(values, 'model')})",
        cpus=_int(values, "cpus"),
        mem_total_mib=mem_kb // 1024 if mem_kb is not None else None,
        disk_free_gib=disk_kb / 1024**2 if disk_kb is not None else None,
        sudo="n/a",
        board_model=first_value(values, "model") or None,
        clock=clock,
        raw=values,
    )
    problems, warnings = judge(inventory, phone, facts)
    return replace(facts, problems=tuple(problems), warnings=tuple(warnings))


def _phone_clock(host: Transport, serial: str, timeout_s: float, rounds: int = 3) -> ClockOffset | None:
    best: tuple[float, float] | None = None
    for _ in range(rounds):
        t_send = time.time()
        result = host.run(["adb", "-s", serial, "shell", "date +%s.%N"], timeout_s=timeout_s)
        t_receive = time.time()
        try:
            t_node = float(result.stdout.strip())
        except ValueError:
            return None
        rtt = t_receive - t_send
        if best is None or rtt < best[1]:
            best = (t_node - (t_send + t_receive) / 2, rtt)
    assert best is not None
    return ClockOffset(best[0], best[1], rounds, "adb date")


def judge(inventory: Inventory, node: NodeSpec, facts: NodeFacts) -> tuple[list[str], list[str]]:
    """What is wrong (problems) or worth a look (warnings) given what the inventory says."""
    problems: list[str] = []
    warnings: list[str] = []
    kind = kind_of(node)
    if kind.boards is not None:
        wanted = kind.boards.device_tree_names.get(node.model, (node.model,))
        if facts.board_model is None:
            problems.append(f"no /proc/device-tree/model: is this a {kind.boards.name}?")
        elif not any(w.lower() in facts.board_model.lower() for w in wanted):
            problems.append(f"inventory says {node.model} but the board reports {facts.board_model!r}")
        if facts.l4t_release is None:
            problems.append(f"no release in {kind.boards.release_file}")
    if kind.reached_by_ssh and inventory.settings_of(node).sudo and facts.sudo == "no":
        problems.append(
            f"sudo needs a password for {facts.user}; install the sudoers rules that `testbed provision` prints "
            "for this node (only the suite's own commands, docs/real-lab.md), or set "
            "sudo: false (defaults, its group or the node) and log in as root"
        )
    if kind.discrete_gpus and node.gpus and len(facts.gpus) != node.gpus:
        problems.append(f"inventory says {node.gpus} GPUs, nvidia-smi lists {len(facts.gpus)}")
    if facts.raw.get("gpu_error"):
        problems.append("nvidia-smi failed: " + facts.raw["gpu_error"][0][:200])
    if kind.runs_ranks and not facts.python.startswith("Python 3"):
        problems.append(f"{inventory.settings_of(node).python} is not a Python 3 ({facts.python or 'not found'})")
    for phone in inventory.nodes:
        if phone.adb is not None and phone.adb.usb_host == node.name:
            state = next((d.state for d in facts.adb_devices if d.serial == phone.adb.serial), None)
            if state != "device":
                problems.append(f"phone {phone.name} ({phone.adb.serial}) is {state or 'not attached'} on this host")
    # an offset within the round trip's bound may be the exchange's asymmetry (adb through its USB host,
    # a slow ssh start), not the clock: only one beyond it is worth a warning
    if facts.clock is not None and abs(facts.clock.offset_s) - facts.clock.error_bound_s > CLOCK_WARN_S:
        warnings.append(
            f"clock is {facts.clock.offset_s * 1e3:+.0f} ms (+-{facts.clock.error_bound_s * 1e3:.0f} ms) off the "
            "controller; check NTP (telemetry is aligned per run, latency never crosses clocks)"
        )
    if facts.disk_free_gib is not None and facts.disk_free_gib < DISK_WARN_GIB:
        warnings.append(f"only {facts.disk_free_gib:.1f} GiB free in the home directory")
    return problems, warnings
