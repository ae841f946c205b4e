"""What the suite runs with sudo on a node, and the sudoers rules that allow exactly that.

Every privileged command is one fixed program named by its absolute path, never a shell under sudo:
``tc`` and ``ip`` for shaping (their object words fixed: no batch files, no namespaces), the installed
NFQUEUE delay handler (:mod:`testbed.provisioning.delay_handler`; it also runs our iptables commands, after
checking them as root, since iptables' own arguments cannot be limited soundly by a pattern:
``--modprobe`` runs a program), ``nvpmodel`` and ``jetson_clocks`` for a Jetson's power (modes by
number; clocks stored in and restored from root's own file only: both tools write root's files and
sysfs from what they are given), and ``true``, the probe ``inventory check`` uses for passwordless
sudo. :func:`sudoers_text` writes them as Cmnd_Alias lines; provisioning and ``inventory check``
print it, an emulated lab with ``emulation.ssh_user`` installs it.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodes.contracts.root_paths import JETSON_CLOCKS_FILE
from testbed.provisioning.delay_handler import launcher_glob, launcher_path

# Where the suite expects each tool on a node (a Jetson's tools may be elsewhere: provisioning reads them).
TOOL_PATHS = {
    "tc": "/usr/sbin/tc",
    "ip": "/usr/sbin/ip",
    "nvpmodel": "/usr/sbin/nvpmodel",
    "jetson_clocks": "/usr/bin/jetson_clocks",
    "true": "/usr/bin/true",
}
SUDO = ("sudo", "-n", "--")
SUDOERS_FILE = "/etc/sudoers.d/hil-testbed"


@dataclass(frozen=True)
class SudoRule:
    """One command a user may run as root: a program and its arguments (None: any; "": none; else a
    sudoers pattern, ``*`` matching any text)."""

    alias: str
    tool: str  # a key of TOOL_PATHS, or "delay" for the installed handler
    args: str | None

    def line(self, path: str) -> str:
        if self.args is None:
            return path
        return f'{path} ""' if self.args == "" else f"{path} {self.args}"


RULES = (
    SudoRule("HIL_TC", "tc", "qdisc *"),
    SudoRule("HIL_TC", "tc", "class *"),
    SudoRule("HIL_TC", "tc", "filter * u32 *"),
    SudoRule("HIL_TC", "tc", "filter * u32"),
    SudoRule("HIL_IP", "ip", "link add * type ifb"),
    SudoRule("HIL_IP", "ip", "link set * up"),
    SudoRule("HIL_IP", "ip", "link del *"),
    SudoRule("HIL_DELAY", "delay", None),  # it checks its arguments itself, as root
    SudoRule("HIL_JETSON", "nvpmodel", "-q"),
    SudoRule("HIL_JETSON", "nvpmodel", "-p --verbose"),
    SudoRule("HIL_JETSON", "nvpmodel", "-m [0-9]"),
    SudoRule("HIL_JETSON", "nvpmodel", "-m [0-9][0-9]"),
    SudoRule("HIL_JETSON", "nvpmodel", "-m [0-9][0-9][0-9]"),
    SudoRule("HIL_JETSON", "jetson_clocks", ""),
    SudoRule("HIL_JETSON", "jetson_clocks", "--show"),
    SudoRule("HIL_JETSON", "jetson_clocks", f"--store {JETSON_CLOCKS_FILE}"),
    SudoRule("HIL_JETSON", "jetson_clocks", f"--restore {JETSON_CLOCKS_FILE}"),
    SudoRule("HIL_PROBE", "true", ""),
)

# One command per alias that provisioning and ``inventory check`` ask ``sudo -n -l`` about.
PROBES = {
    "HIL_TC": ("tc", ["qdisc", "replace", "dev", "lo", "root", "handle", "1f7b:", "htb"]),
    "HIL_IP": ("ip", ["link", "del", "ifb-probe"]),
    "HIL_DELAY": ("delay", ["stop", "/probe"]),
    "HIL_JETSON": ("nvpmodel", ["-q"]),
    "HIL_PROBE": ("true", []),
}
FOUND_ON_NODE = ("nvpmodel", "jetson_clocks")  # where a node has them (an emulated Jetson: stand-ins)


def tool_path(tool: str, paths: Mapping[str, str] | None = None) -> str:
    if tool == "delay":
        return launcher_path()
    return (paths or {}).get(tool, TOOL_PATHS[tool])


def privileged(argv: Sequence[str], *, sudo: bool) -> list[str]:
    """``argv`` as the suite sends it: with sudo, ``sudo -n --`` and the tool's absolute path; iptables
    always through the installed delay handler, which checks it (it is only used on that path)."""
    if argv[0] == "iptables":
        argv = [launcher_path(), *argv]
    if not sudo:
        return list(argv)
    program = TOOL_PATHS.get(argv[0], argv[0])
    if not program.startswith("/"):
        raise ValueError(f"{argv[0]} is not run with sudo by the suite")
    return [*SUDO, program, *argv[1:]]


def sudoers_text(user: str, paths: Mapping[str, Sequence[str]] | None = None) -> str:
    """The sudoers file that lets ``user`` run exactly the suite's privileged commands without a password
    (``paths``: where a node has a tool elsewhere than :data:`TOOL_PATHS`, e.g. an emulated Jetson's
    stand-ins; one path per node of a lab that shares the file)."""
    aliases: dict[str, list[str]] = {}
    for rule in RULES:
        where = [launcher_glob()] if rule.tool == "delay" else (paths or {}).get(rule.tool) or [TOOL_PATHS[rule.tool]]
        aliases.setdefault(rule.alias, []).extend(rule.line(p) for p in where)
    lines = [
        "# hil-testbed: exactly the commands `testbed` runs with sudo (testbed/provisioning/sudo_rules.py). "
        "Install as root:",
        f"#   visudo -cf FILE && install -o root -g root -m 0440 FILE {SUDOERS_FILE}",
        *(f"Cmnd_Alias {name} = {', '.join(commands)}" for name, commands in aliases.items()),
        f"{user} ALL=(root) NOPASSWD: {', '.join(aliases)}",
    ]
    return "\n".join(lines) + "\n"


def sudo_probe_script() -> str:
    """sh that prints ``tool_path=TOOL:PATH`` where the node has a Jetson tool, ``sudo_needed=ALIAS``
    for each alias whose program the node has (a server has no nvpmodel, a node without the delay
    handler installed needs no rule for it yet), and ``sudo_ok=ALIAS`` where ``sudo -n -l`` allows
    the alias's probe command (so the rules are installed)."""
    lines = [f'p=$(PATH="$PATH:/usr/sbin:/sbin" command -v {t}) && echo "tool_path={t}:$p"' for t in FOUND_ON_NODE]
    for alias, (tool, args) in PROBES.items():
        if tool in FOUND_ON_NODE:
            path = f'"$(PATH="$PATH:/usr/sbin:/sbin" command -v {tool} || echo {shlex.quote(TOOL_PATHS[tool])})"'
        else:
            path = shlex.quote(tool_path(tool))
        words = " ".join([path, *map(shlex.quote, args)])
        lines.append(f"if [ -x {path} ]; then echo sudo_needed={alias}; "
                     f"sudo -n -l {words} >/dev/null 2>&1 && echo sudo_ok={alias}; fi")  # fmt: skip
    return "\n".join(lines)


def lacking_rules(values: Mapping[str, Sequence[str]]) -> list[str]:
    """The aliases a node needs (``sudo_needed``) that its sudo does not allow (``sudo_ok``)."""
    return sorted(set(values.get("sudo_needed", ())) - set(values.get("sudo_ok", ())))


def node_paths(values: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The Jetson tools' paths a node reported (``tool_path=TOOL:PATH``)."""
    paths: dict[str, list[str]] = {}
    for item in values.get("tool_path", ()):
        tool, _, path = item.partition(":")
        if tool in FOUND_ON_NODE and path.startswith("/"):
            paths.setdefault(tool, []).append(path)
    return paths


def install_hint(user: str, values: Mapping[str, Sequence[str]]) -> str:
    """What to install, and how, for a node whose sudo lacks the suite's rules."""
    return (f"as root, put these lines in {SUDOERS_FILE} (check them with visudo -cf FILE first):\n"
            + sudoers_text(user, node_paths(values)))  # fmt: skip
