"""``testbed provision``: bring each node to a known, recorded software state.

Per node, in parallel and idempotently: gather facts and check what runs need (tc, ip, iperf3,
sudo, time synchronisation, jtop on Jetsons, adb on USB hosts, nvidia-smi on GPU servers, disk),
installing missing tools where the package manager and sudo allow; make the virtual environment
(``defaults.venv``); install the node wheel (:mod:`testbed.provisioning.node_wheel`) with the extras of the
node's kind, torch as pinned (a Jetson keeps NVIDIA's torch from the system and may not have it
replaced); push a wheelhouse to nodes without registry access; place model weights
(:mod:`testbed.provisioning.weights`); and record what is installed in ``<state dir>/provisioned/<node>.json``.

Emulated nodes share the controller's filesystem and have no route to a registry: each has its own
home (so its own venv and weights), its venv sees the controller's packages through a ``.pth`` file,
and whatever that does not cover comes from the wheelhouse.

One concept, provisioning a node, over ~600 lines: its checks, venv, wheel and weights are steps of
one idempotent transaction per node and share its state; the pure parts (commands, readiness) are
at the top and tested by their exact strings.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from foundation.errors import NodeError, TestbedError
from nodes.contracts.durable import write_atomic, write_json_atomic
from testbed.inventory import Inventory, NodeSettings, NodeSpec, kind_of
from testbed.provisioning.delay_handler import HANDLER_SOURCE, handler_digest, install_script, installed_test
from testbed.provisioning.node_code import node_code_path
from testbed.provisioning.node_wheel import NodeWheel, node_wheel
from testbed.provisioning.sudo_rules import install_hint, lacking_rules, sudo_probe_script
from testbed.provisioning.weights import (
    ModelSource,
    PartFile,
    WeightPart,
    default_cache_dir,
    ensure_file,
    file_sha256,
    place_part,
    roles_of,
    weight_parts,
    write_part,
)
from testbed.transport import open_transport
from testbed.transport.base import Transport
from testbed.transport.facts import NodeFacts, first_value, gather_facts, parse_key_values
from testbed.transport.fanout import DEFAULT_PARALLEL, FanOutResult, fan_out

Say = Callable[[str], None]

RECORD_VERSION = 1
BASE_SPACE_GIB = 0.5  # free space a venv and the wheels need beyond the weights
INSTALL_ROUNDS = 3  # wheelhouse rounds: pip names what it lacks, the controller fetches it
PIP_TIMEOUT_S = 1800.0
CLOCK_SYNC_WARN_S = 0.05
# Tools a run uses on every Linux node, and the Debian package that brings each.
_WHEELHOUSE_LOCK = threading.Lock()
TOOL_PACKAGES = {"tc": "iproute2", "ip": "iproute2", "iperf3": "iperf3"}

# key=value lines; what `facts` does not already gather. $1: base Python, $2: venv, $3: workdir, $4: the
# systemd unit of the board family's optional telemetry service (node_kinds.BoardFamily.service), or ''.
_READINESS_SCRIPT = r"""
k() { printf '%s=%s\n' "$1" "$2"; }
PY=$1 V=$2 W=$3 U=$4
S=$PATH:/usr/sbin:/sbin
for t in tc ip iperf3 apt-get dnf timedatectl chronyc systemctl nvidia-smi adb; do
  PATH=$S command -v "$t" >/dev/null 2>&1 && k tool "$t"
done
""" + f"""
{installed_test()} && k delay_handler installed
if [ "$(id -u)" != 0 ]; then
{sudo_probe_script()}
fi
""" + r"""
k glibc "$(getconf GNU_LIBC_VERSION 2>/dev/null | cut -d' ' -f2)"
command -v timedatectl >/dev/null 2>&1 &&
  k ntp_synchronized "$(timedatectl show -p NTPSynchronized --value 2>/dev/null)"
command -v chronyc >/dev/null 2>&1 && k chrony "$(chronyc tracking 2>/dev/null | grep '^System time')"
[ -n "$U" ] && command -v systemctl >/dev/null 2>&1 && k board_service "$(systemctl is-active "$U" 2>/dev/null)"
"$PY" -c '
import sys
from importlib.util import find_spec
print("base_is_venv=%d" % (sys.prefix != getattr(sys, "base_prefix", sys.prefix)))
print("base_version=%d.%d" % sys.version_info[:2])
print("base_pip=%s" % ("yes" if find_spec("pip") else ""))
print("base_venv=%s" % ("yes" if find_spec("venv") and find_spec("ensurepip") else ""))' 2>/dev/null
if [ -x "$V/bin/python" ]; then
  "$V/bin/python" -c '
import sys
print("venv_version=%d.%d" % sys.version_info[:2])
from importlib.metadata import version, PackageNotFoundError
for key, name in (("venv_wheel", "hil-testbed-nodes"), ("venv_torch", "torch")):
    try:
        print("%s=%s" % (key, version(name)))
    except PackageNotFoundError:
        pass' 2>/dev/null
fi
d=$W; while [ ! -d "$d" ]; do d=$(dirname "$d"); done
k workdir_free_kb "$(df -Pk "$d" | { read -r _; read -r _ _ _ free _; echo "$free"; })"
k workdir_existing "$d"
echo readiness-end
"""


@dataclass(frozen=True)
class Readiness:
    """What a node has for runs, what is missing (each with the command that fixes it), and notes."""

    tools: tuple[str, ...]
    missing: tuple[tuple[str, str], ...]  # (what, the command a person should run)
    warnings: tuple[str, ...]
    installed: tuple[str, ...]  # system packages provisioning installed itself
    values: dict[str, list[str]]

    def first(self, key: str) -> str:
        return first_value(self.values, key)


# what a node's change is, said once and many times
CHANGE_KINDS = {
    "system": ("system packages installed", "system packages installed {n} times"),
    "venv": ("venv made", "venv made {n} times"),
    "wheel": ("wheel installed", "wheel installed {n} times"),
    "wheelhouse": ("wheelhouse pushed", "{n} wheelhouses pushed"),
    "weights": ("weight file sent", "{n} weight files sent"),
    "stale": ("stale file removed", "{n} stale files removed"),
    "handler": ("delay handler installed", "delay handler installed {n} times"),
}


@dataclass(frozen=True)
class NodeProvision:
    """What provisioning found and did on one node."""

    node: str
    changes: tuple[str, ...]
    problems: tuple[str, ...]  # each says how to fix it
    warnings: tuple[str, ...]
    record: dict = field(default_factory=dict)
    change_kinds: tuple[str, ...] = ()  # one of CHANGE_KINDS per change, in the same order

    def summary(self) -> str:
        """``venv made, wheel installed, 3 weight files sent`` (the printed lines and the record have
        the details)."""
        if not self.changes:
            return "no changes"
        counts: dict[str, int] = {}
        for kind in self.change_kinds:
            counts[kind] = counts.get(kind, 0) + 1
        return ", ".join(CHANGE_KINDS[kind][0 if n == 1 else 1].format(n=n) for kind, n in counts.items())

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class ProvisionOptions:
    model: Path | None = None
    partition: tuple[int, int] | None = None  # (m, P)
    wheelhouse_cache: Path = field(default_factory=lambda: default_cache_dir().parent / "wheelhouse")
    parts_cache: Path = field(default_factory=default_cache_dir)


# -- plans: the exact commands -----------------------------------------------------------------------


def venv_create_command(
    python: str, venv: str, *, see_base: bool, base_is_venv: bool, base_pip: bool, base_ensurepip: bool = True
) -> str:
    """Make ``venv`` from ``python``. A node that keeps system packages (a Jetson's torch, or an
    emulated node's controller environment) sees its base's packages; where the base Python is
    itself a venv, ``--system-site-packages`` would skip it, and ``nodes.venv_overlay`` follows."""
    flags = ["--system-site-packages"] if see_base else []
    if see_base and base_pip and (base_is_venv or not base_ensurepip):
        # The base's pip is on the path: ensurepip would cost seconds (or is missing, as on Ubuntu
        # without python3-venv, where the system's pip is what a Jetson's venv can use).
        flags.append("--without-pip")
    words = [python, "-m", "venv", *flags, venv]
    return shlex.join(words)


def pip_install_argv(
    venv: str, wheel_path: str, extras: Sequence[str], torch: str | None, constraints: str, find_links: str | None
) -> list[str]:
    """``pip install`` of the node wheel (and torch where it is ours to install)."""
    argv = [f"{venv}/bin/python", "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    if find_links is not None:
        argv += ["--no-index", "--find-links", find_links]
    argv += ["-c", constraints]
    argv.append(wheel_path + (f"[{','.join(extras)}]" if extras else ""))
    if torch:
        argv.append(torch)
    return argv


def pip_download_argv(
    requirements: Sequence[str], dest: Path, python_version: str, machine: str, glibc: str
) -> list[str]:
    """``pip download`` on the controller of wheels for a node's platform (its Python, CPU, glibc)."""
    major, minor = python_version.split(".")[:2]
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:"]
    argv += ["--dest", str(dest), "--python-version", f"{major}.{minor}", "--implementation", "cp"]
    argv += ["--abi", f"cp{major}{minor}", "--abi", "abi3", "--abi", "none"]
    glibc_minor = int(glibc.split(".")[1]) if re.fullmatch(r"2\.\d+", glibc) else 17
    for g in range(glibc_minor, 16, -1):
        argv += ["--platform", f"manylinux_2_{g}_{machine}"]
    argv += ["--platform", f"manylinux2014_{machine}", "--platform", "any"]
    return argv + list(requirements)


def missing_requirements(pip_output: str) -> list[str]:
    """Requirements pip could not find (``No matching distribution found for X``), markers dropped."""
    found = re.findall(r"No matching distribution found for ([^\s;]+)", pip_output)
    return sorted(set(found))


# -- readiness ---------------------------------------------------------------------------------------


def judge_readiness(
    node: NodeSpec, facts: NodeFacts, values: dict[str, list[str]], *, need_gib: float, sudo_used: bool
) -> tuple[list[tuple[str, str]], list[str]]:
    """Missing pieces (with their fix) and warnings, from the readiness probe's values."""
    tools = set(values.get("tool", []))
    missing: list[tuple[str, str]] = []
    warnings: list[str] = []
    apt = "apt-get" in tools
    for tool, package in TOOL_PACKAGES.items():
        if tool not in tools:
            fix = f"sudo apt-get install -y {package}" if apt else f"install {package} with the node's package manager"
            missing.append((tool, fix))
    lacking = lacking_rules(values)
    if sudo_used and facts.sudo != "root" and lacking:
        missing.append((f"passwordless sudo for {', '.join(lacking)} (exactly the suite's commands)",
                        install_hint(facts.user, values)))  # fmt: skip
    free_kb = first_value(values, "workdir_free_kb")
    if free_kb.isdigit() and int(free_kb) / 2**20 < need_gib:
        where = first_value(values, "workdir_existing") or "the workdir"  # the workdir, or where it will be made
        missing.append(
            (f"disk space ({int(free_kb) / 2**20:.1f} GiB free where the workdir is, {need_gib:.1f} GiB needed "
             "for the venv and the weights)",
             f"free space there (du -xh {shlex.quote(where)} | sort -h | tail), or point defaults.workdir (and "
             "venv; or a group's or node's) at a larger disk")
        )  # fmt: skip
    unsynchronised = clock_unsynchronised(values)
    if unsynchronised:
        warnings.append(unsynchronised + " (telemetry is aligned per run, but logs read better on synchronised clocks)")
    kind = kind_of(node)
    hint = kind.boards.service_hint if kind.boards else ""
    if hint and not facts.emulated and first_value(values, "board_service") != "active":
        warnings.append(hint)
    if kind.discrete_gpus and node.gpus and "nvidia-smi" not in tools:
        missing.append(("nvidia-smi (NVIDIA driver)", "install the NVIDIA driver for the server's GPUs"))
    return missing, warnings


def clock_unsynchronised(values: dict[str, list[str]]) -> str | None:
    """What the readiness probe says of the node's clock, where NTP does not keep it synchronised (an
    emulated node's stand-in timedatectl answers for the controller's clock, which it shares)."""
    if first_value(values, "ntp_synchronized") == "yes":
        return None
    chrony = first_value(values, "chrony")
    match = re.search(r"([\d.]+) seconds (fast|slow)", chrony)
    if match is not None and float(match[1]) <= CLOCK_SYNC_WARN_S:
        return None
    state = f"chrony: {chrony.strip()}" if chrony else "timedatectl: NTPSynchronized=" + (
        first_value(values, "ntp_synchronized") or "(no answer)")
    return (f"the clock is not synchronised ({state}); fix: sudo timedatectl set-ntp true (or install chrony "
            "and point it at the lab's time server: sudo apt-get install -y chrony)")


def probe_readiness(node: NodeSpec, t: Transport, *, python: str, venv: str, workdir: str) -> dict[str, list[str]]:
    """What a node has for runs, beyond its facts: tools, sudo rules, clock sync, the base Python and the
    venv, free space where the workdir is (``key=value`` lists, parsed)."""
    boards = kind_of(node).boards
    service = boards.service if boards is not None else ""
    words = ["sh", "-c", _READINESS_SCRIPT, "readiness", python, venv, workdir, service]
    result = t.run(words, timeout_s=60.0)
    if "readiness-end" not in result.stdout:
        raise NodeError(node.name, f"the readiness probe failed: {result.stderr.strip()[-300:]}")
    return parse_key_values(result.stdout)


# -- one node ----------------------------------------------------------------------------------------


class _NodeProvisioner:
    """Provisions one node over one transport; collects changes, problems and the record."""

    def __init__(
        self,
        inventory: Inventory,
        node: NodeSpec,
        t: Transport,
        wheel: NodeWheel,
        parts: dict[str, tuple[WeightPart, PartFile]],
        source: ModelSource | None,
        options: ProvisionOptions,
        say: Say,
    ) -> None:
        self.inventory, self.node, self.t, self.wheel = inventory, node, t, wheel
        self.wheel_file = options.wheelhouse_cache / "ours" / wheel.filename  # written by provision()
        self.parts, self.source, self.options, self.say = parts, source, options, say
        self.settings = inventory.settings_of(node)
        self.python = self.settings.python
        self.workdir = t.expand_path(self.settings.workdir)
        self.venv = t.expand_path(self.settings.venv_path)
        self.changes: list[str] = []
        self.change_kinds: list[str] = []
        self.problems: list[str] = []
        self.warnings: list[str] = []

    def change(self, kind: str, text: str) -> None:
        assert kind in CHANGE_KINDS, kind
        self.changes.append(text)
        self.change_kinds.append(kind)
        self.say(f"{self.node.name}: {text}")

    def run(self) -> NodeProvision:
        facts = gather_facts(self.inventory, self.node, self.t)
        self.problems += facts.problems
        self.warnings += facts.warnings
        readiness = self.readiness(facts)
        if not readiness.first("delay_handler"):
            self.install_delay_handler(facts)
        wheel_version = self.venv_and_wheel(facts, readiness)
        installed = self.installed_report() if wheel_version else {}
        placed = self.place_weights() if self.parts else []
        record = {
            "record_version": RECORD_VERSION,
            "node": self.node.name,
            "kind": self.node.kind,
            "provisioned_at_s": time.time(),
            "wheel": {"filename": self.wheel.filename, "version": self.wheel.version, "sha256": self.wheel.sha256},
            "installed_wheel": wheel_version,
            "venv": self.venv,
            "venv_python": f"{self.venv}/bin/python",
            "installed": installed,
            "facts": {
                "hostname": facts.hostname,
                "arch": facts.arch,
                "kernel": facts.kernel,
                "os": facts.os,
                "l4t_release": facts.l4t_release,
                "board_model": facts.board_model,
                "emulated": facts.emulated,
                "gpus": [asdict(g) for g in facts.gpus],
                "sudo": facts.sudo,
            },
            "tools": list(readiness.tools),
            "missing": [{"what": w, "fix": f} for w, f in readiness.missing],
            "system_packages_installed": list(readiness.installed),
            "weights": placed,
            "changes": self.changes,
            "problems": self.problems,
            "warnings": self.warnings,
        }
        return NodeProvision(self.node.name, tuple(self.changes), tuple(self.problems), tuple(self.warnings), record,
                             tuple(self.change_kinds))  # fmt: skip

    # -- checks ----------------------------------------------------------------------------------

    def readiness(self, facts: NodeFacts) -> Readiness:
        values = self.probe()
        need_gib = BASE_SPACE_GIB + sum(p.size for _, p in self.parts.values()) / 2**30
        sudo_used = self.settings.sudo
        missing, warnings = judge_readiness(self.node, facts, values, need_gib=need_gib, sudo_used=sudo_used)
        installed: list[str] = []
        packages = sorted({TOOL_PACKAGES[w] for w, _ in missing if w in TOOL_PACKAGES})
        can_install = "apt-get" in values.get("tool", []) and facts.sudo in ("root", "yes") and not facts.emulated
        if packages and can_install:
            # an administrator's sudo (not one of the printed rules): one program, no shell under sudo
            argv = ["/usr/bin/env", "DEBIAN_FRONTEND=noninteractive", "/usr/bin/apt-get", "install", "-y",
                    "--no-install-recommends", *packages]  # fmt: skip
            result = self.t.run(argv, timeout_s=600.0, sudo=facts.sudo == "yes")
            if result.ok:
                installed = packages
                self.change("system", "installed " + ", ".join(packages))
                values = self.probe()
                missing, warnings = judge_readiness(self.node, facts, values, need_gib=need_gib, sudo_used=sudo_used)
            else:
                self.warnings.append(f"apt-get install {' '.join(packages)} failed: {result.stderr.strip()[-200:]}")
        for what, fix in missing:
            self.problems.append(f"missing {what}: {fix}")
        self.warnings += warnings
        return Readiness(
            tuple(sorted(set(values.get("tool", [])))), tuple(missing), tuple(warnings), tuple(installed), values
        )

    def install_delay_handler(self, facts: NodeFacts) -> None:
        """Install the NFQUEUE delay handler root-owned (:mod:`testbed.provisioning.delay_handler`) where this
        login may (root, or a sudo that allows it: an administrator's); else say what to run as root."""
        lib = f"{self.workdir}/lib"
        source, script = f"{lib}/link_delay_handler-{handler_digest()}.py", f"{lib}/install-delay-handler.sh"
        self.t.store(source, HANDLER_SOURCE.read_bytes())
        self.t.store(script, install_script(source, self.python).encode())
        if facts.sudo in ("root", "yes"):
            result = self.t.run(["/bin/sh", script], sudo=facts.sudo == "yes", timeout_s=120.0)
            if result.ok:
                self.change("handler", f"installed the NFQUEUE delay handler {handler_digest()} root-owned")
                return
            why = (result.stderr.strip() or result.stdout.strip())[-300:]
        else:
            why = "this login cannot run it as root"
        self.warnings.append(
            f"the NFQUEUE delay handler {handler_digest()} is not installed (delay, jitter and loss need it on a "
            f"kernel without sch_netem); as root, run: sh {script} ({why})"
        )

    def probe(self) -> dict[str, list[str]]:
        return probe_readiness(self.node, self.t, python=self.python, venv=self.venv, workdir=self.workdir)

    # -- venv and wheel --------------------------------------------------------------------------

    def venv_and_wheel(self, facts: NodeFacts, readiness: Readiness) -> str | None:
        """Make the venv and install the wheel where needed; the installed wheel version, or None."""
        system_torch_image = kind_of(self.node).system_torch
        see_base = system_torch_image or facts.emulated
        if not readiness.first("venv_version"):
            if not readiness.first("base_venv") and not (see_base and readiness.first("base_pip")):
                self.problems.append(
                    f"{self.python} cannot make a virtual environment (no venv/ensurepip): "
                    "sudo apt-get install -y python3-venv"
                )
                return None
            base_is_venv = readiness.first("base_is_venv") == "1"
            command = venv_create_command(
                self.python, self.venv, see_base=see_base, base_is_venv=base_is_venv,
                base_pip=bool(readiness.first("base_pip")), base_ensurepip=bool(readiness.first("base_venv")),
            )  # fmt: skip
            env = None
            if see_base and base_is_venv:
                command += f" && {shlex.join([self.python, '-m', 'nodes.venv_overlay', self.venv])}"
                env = {"PYTHONPATH": node_code_path(self.t, self.settings.workdir)}
            script = f"mkdir -p {shlex.quote(self.workdir)} && {command}"
            result = self.t.run(["sh", "-c", script], env=env, timeout_s=600.0)
            if not result.ok:
                self.problems.append(f"making the venv {self.venv} failed: {result.stderr.strip()[-300:]}")
                return None
            self.change("venv", f"made the venv {self.venv}" + (" (sees the system's packages)" if see_base else ""))
            readiness = replace(readiness, values=self.probe())  # what the new venv holds
        system_torch = readiness.first("venv_torch")
        if system_torch_image and not system_torch:
            self.problems.append(
                "no torch in the Jetson's system Python: install NVIDIA's torch wheel for this JetPack "
                "(docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform); provisioning "
                "does not install torch from PyPI on a Jetson"
            )
        if readiness.first("venv_wheel") == self.wheel.version:
            return self.wheel.version
        return self.install_wheel(facts, readiness, system_torch if system_torch_image else None)

    def install_wheel(self, facts: NodeFacts, readiness: Readiness, keep_torch: str | None) -> str | None:
        wheels_dir = f"{self.workdir}/wheels"
        wheel_remote = f"{wheels_dir}/{self.wheel.filename}"
        ensure_file(self.t, self.wheel_file, wheel_remote, self.wheel.sha256, say=self.say)
        torch_pin = None if kind_of(self.node).system_torch else self.wheel.torch_requirement
        pins = [f"torch=={keep_torch}"] if keep_torch else ([torch_pin] if torch_pin else [])
        constraints = f"{wheels_dir}/constraints.txt"
        self.t.store(constraints, "".join(f"{pin}\n" for pin in pins).encode())
        offline = facts.emulated or not self.settings.registry_access
        extras = kind_of(self.node).wheel_extras
        argv = pip_install_argv(
            self.venv, wheel_remote, extras, torch_pin, constraints, wheels_dir if offline else None
        )
        fetched: set[str] = set()
        for _ in range(INSTALL_ROUNDS):
            result = self.t.run(argv, timeout_s=PIP_TIMEOUT_S)
            if result.ok:
                self.change("wheel", f"installed {self.wheel.filename}" + (f"[{','.join(extras)}]" if extras else ""))
                return self.wheel.version
            wanted = [r for r in missing_requirements(result.stdout + result.stderr) if r not in fetched]
            if not offline or not wanted:
                break
            fetched.update(wanted)
            self.push_wheelhouse(wanted, readiness, facts, wheels_dir)
        tail = (result.stderr.strip() or result.stdout.strip())[-400:]
        self.problems.append(f"pip install of {self.wheel.filename} failed: {tail}")
        return None

    def push_wheelhouse(self, requirements: list[str], readiness: Readiness, facts: NodeFacts, wheels_dir: str) -> None:
        """Fetch ``requirements`` (and what they need) for the node's platform on the controller and
        push the wheels the node lacks."""
        version = readiness.first("base_version") or "3.8"
        machine = facts.arch or "x86_64"
        dest = self.options.wheelhouse_cache / f"cp{version.replace('.', '')}-{machine}"
        dest.mkdir(parents=True, exist_ok=True)
        argv = pip_download_argv(requirements, dest, version, machine, readiness.first("glibc"))
        with _WHEELHOUSE_LOCK:  # nodes of one platform share the directory: fetch once, then find it there
            result = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise NodeError(
                self.node.name,
                f"the controller could not fetch {', '.join(requirements)} for the wheelhouse: "
                f"{result.stderr.strip()[-300:]}",
            )
        names = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", result.stdout)
        for path in sorted({Path(n).name for n in names}):
            local = dest / path
            ensure_file(self.t, local, f"{wheels_dir}/{path}", file_sha256(local), say=self.say)
        self.change("wheelhouse", f"pushed a wheelhouse for {', '.join(requirements)} ({len(names)} wheels)")

    def installed_report(self) -> dict:
        # The installed wheel's own code answers: this also proves the installation imports.
        result = self.t.run([f"{self.venv}/bin/python", "-m", "nodes.installed"], timeout_s=120.0)
        try:
            return json.loads(result.check().stdout)
        except ValueError:
            raise NodeError(self.node.name, f"nodes.installed printed no JSON: {result.stdout[-200:]}") from None

    # -- weights ---------------------------------------------------------------------------------

    def place_weights(self) -> list[dict]:
        assert self.source is not None
        out = []
        for role in roles_of(self.node.roles):
            part, part_file = self.parts[role]
            placed = place_part(
                self.t, self.source, part, part_file, self.settings.workdir, say=self.say
            )
            for f in placed.files:
                if f.action != "present":
                    self.change("weights", f"{f.action} {f.path} ({f.size / 2**20:.1f} MiB)")
            for path in placed.removed:
                self.change("stale", f"removed {path}, a weight file of an earlier cut")
            out.append(
                {
                    "model": str(self.source.directory),
                    "role": role,
                    "device_layers": part.device_layers,
                    "partition": list(self.options.partition or ()),
                    "directory": placed.directory,
                    "sha256": placed.sha256,
                    "files": [asdict(f) for f in placed.files],
                }
            )
        return out


# -- all nodes ---------------------------------------------------------------------------------------


def provision(
    inventory: Inventory,
    names: Sequence[str] | None,
    options: ProvisionOptions,
    *,
    max_parallel: int = DEFAULT_PARALLEL,
    say: Say = lambda _: None,
) -> tuple[FanOutResult[NodeProvision], list[str]]:
    """Provision the selected nodes; returns every node's outcome and the problems across nodes
    (MPI ABIs or node versions that differ)."""
    nodes = [n for n in inventory.select(names) if kind_of(n).runs_ranks]
    if not nodes:
        raise TestbedError(f"{inventory.path}: no Linux node selected (phones are reached through their USB host)")
    for node in nodes:
        if node.emulated is not None and node.address is None:
            raise TestbedError(
                f"{inventory.path}: the emulated testbed is not running; start it with `testbed emulate up`"
            )
    wheel = node_wheel()
    wheel_file = options.wheelhouse_cache / "ours" / wheel.filename
    if not wheel_file.is_file():  # once, before the nodes' threads read it
        wheel_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(wheel_file, wheel.data, mode=0o644)
    source, parts = None, {}
    if options.model is not None:
        if options.partition is None:
            raise TestbedError("--model needs --partition, e.g. --partition m=2,P=4")
        source = ModelSource.open(options.model)
        for role, part in weight_parts(source, *options.partition).items():
            if any(role in n.roles for n in nodes):
                parts[role] = (part, write_part(source, part, options.parts_cache))
    by_name = {n.name: n for n in nodes}

    def one(name: str) -> NodeProvision:
        node = by_name[name]
        with open_transport(inventory, node) as t:
            node_parts = {r: parts[r] for r in roles_of(node.roles) if r in parts}
            return _NodeProvisioner(inventory, node, t, wheel, node_parts, source, options, say).run()

    result = fan_out(list(by_name), one, max_parallel=max_parallel, description="provisioning")
    records_dir = inventory.state_dir / "provisioned"
    records_dir.mkdir(parents=True, exist_ok=True)
    for name, outcome in result.values().items():
        # A node keeps the cuts placed by earlier runs (another model, another m) unless replaced.
        placed = {_placement_key(w) for w in outcome.record["weights"]}
        earlier = [w for w in load_record(inventory, name).get("weights", []) if _placement_key(w) not in placed]
        outcome.record["weights"] = earlier + outcome.record["weights"]
        write_json_atomic(records_dir / f"{name}.json", outcome.record, mode=0o644, sort_keys=True)
    return result, compare_records(load_records(inventory))


def _placement_key(placed: dict) -> tuple[str, str, int]:
    return (placed["model"], placed["role"], placed["device_layers"])


def load_record(inventory: Inventory, node: str) -> dict:
    """What the last provisioning recorded for ``node`` (empty when it was never provisioned)."""
    path = inventory.state_dir / "provisioned" / f"{node}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def load_records(inventory: Inventory) -> dict[str, dict]:
    """The provisioning records of the inventory's nodes that have one."""
    return {n.name: record for n in inventory.nodes if (record := load_record(inventory, n.name))}


def compare_records(records: dict[str, dict]) -> list[str]:
    """Differences that forbid running nodes together: MPI ABI, node wheel version."""
    problems = []
    for what, key, fix in (
        ("MPI ABI", lambda r: (r.get("installed") or {}).get("mpi", {}).get("abi"),
         "give every node the same MPI family (the mpich wheel everywhere, or one system MPI) and provision again"),
        ("node code version", lambda r: r.get("installed_wheel"),
         "provision every node from the same checkout: testbed provision"),
    ):  # fmt: skip
        values: dict[str, list[str]] = {}
        for name, record in records.items():
            value = key(record)
            if value:
                values.setdefault(value, []).append(name)
        if len(values) > 1:
            majority = max(values, key=lambda v: len(values[v]))
            for value, nodes in sorted(values.items()):
                if value != majority:
                    problems.append(
                        f"{', '.join(nodes)}: {what} {value} differs from {majority} on "
                        f"{', '.join(values[majority])}; {fix}"
                    )
    return problems


def provisioned_python(settings: NodeSettings, record: dict) -> str:
    """The Python the workers run with on a node: its provisioned venv's (``record`` from
    :func:`load_record`), else the node's ``python``."""
    if record.get("installed_wheel"):
        return str(record["venv_python"])
    return settings.python
