"""What is wrong in an inventory, said so the user can fix it: pydantic's errors translated to
``FILE:LINE: field: problem; hint``, secrets refused, and the checks that span fields (unique names,
references, kinds, address clashes, profiles that shape nothing).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from foundation.errors import InputProblem
from foundation.user_files import YamlSource
from netem.profile import LinkProfile
from testbed.inventory.expansion import expand_groups, link_pairs
from testbed.inventory.node_kinds import kind_of, node_kind
from testbed.inventory.schema import NODE_SETTINGS, EmulatedSpec, InventorySpec, NodeSpec

RESERVED_NAMES = ("all", "controller")
SECRET_KEYS = ("password", "passphrase", "sudo_password", "key_passphrase")
NAMED_BY_USER = (("groups",), ("link_profiles",))  # mappings whose keys are names, not fields


def secret_problems(source: YamlSource, data: Any, path: tuple[str | int, ...]) -> Iterable[InputProblem]:
    """Every key, at any depth, that would hold a secret: secrets never go in the inventory."""
    if isinstance(data, dict):
        for key, value in data.items():
            if isinstance(key, str) and key.lower() in SECRET_KEYS and path not in NAMED_BY_USER:
                yield source.problem(
                    path + (key,),
                    "secrets must not be written in the inventory",
                    "use the SSH agent, an identity_file, or password_env naming an "
                    "environment variable that holds the password",
                )
            else:
                yield from secret_problems(source, value, path + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from secret_problems(source, value, path + (i,))


def spec_problems(source: YamlSource, errors: list[Any]) -> list[InputProblem]:
    """pydantic's errors for an inventory as problems, without the secrets :func:`secret_problems`
    reported already (with a better hint)."""
    problems = []
    for err in errors:
        secret = (
            err["type"] == "extra_forbidden"
            and str(err["loc"][-1]).lower() in SECRET_KEYS
            and tuple(err["loc"][:-1]) not in NAMED_BY_USER
        )
        # A list whose items failed is also reported as too short: say only what is wrong inside.
        echo = err["type"] == "too_short" and any(
            len(o["loc"]) > len(err["loc"]) and o["loc"][: len(err["loc"])] == err["loc"] for o in errors
        )
        if not secret and not echo:
            problems.append(pydantic_problem(source, err))
    return problems


INVENTORY_EXAMPLE = "examples/inventories/lab.yaml"


def pydantic_problem(source: YamlSource, err: Any, example: str = INVENTORY_EXAMPLE) -> InputProblem:
    """One pydantic error as ``FILE:LINE: field: problem; hint``; ``example`` is the file the hints
    point at (a campaign's problems point at a campaign example)."""
    loc = tuple(part for part in err["loc"] if isinstance(part, (str, int)) and part != "[key]")
    ctx = err.get("ctx") or {}
    kind = err["type"]
    if "[key]" in err["loc"]:  # a mapping's key (a name) is what is wrong, not its value
        return source.problem(loc, f"the name {loc[-1]!r} " + _key_problem(err), "use letters, digits and . _ - only "
                              "(no spaces or shell characters), at most 63")  # fmt: skip
    if kind == "extra_forbidden":
        return source.problem(
            loc, f"unknown key {loc[-1]!r}", f"check the spelling; {example} shows every key"
        )
    if kind == "missing":
        return source.problem(loc, "required field is missing", f"add '{loc[-1]}:'")
    if kind == "string_pattern_mismatch":
        value = err.get("input")
        return source.problem(
            loc,
            f"{value!r} contains characters that are not allowed",
            "use letters, digits and . _ - only (no spaces or shell characters)",
        )
    if "hint" in ctx:
        return source.problem(loc, str(ctx.get("problem", err["msg"])), str(ctx["hint"]))
    value = err.get("input")
    shown = f"{value!r}: " if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    unit = _UNIT_OF_FIELD.get(str(loc[-1]) if loc else "", "")
    message = err["msg"] + (f" ({unit})" if unit and kind in _RANGE_ERRORS else "")
    hint = _HINTS.get(kind, f"{example} shows a valid {'inventory' if example == INVENTORY_EXAMPLE else 'file'}")
    return source.problem(loc, shown + message, hint)


def _key_problem(err: Any) -> str:
    if err["type"] == "string_pattern_mismatch":
        return "contains characters that are not allowed, or is empty or too long"
    return str(err["msg"]).lower()


_UNIT_OF_FIELD = {
    "rate": "in bit/s",
    "delay": "in seconds",
    "jitter": "in seconds",
    "connect_timeout": "in seconds",
    "keepalive": "in seconds",
}
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
_HINTS = {
    "greater_than": "use a value in the allowed range",
    "greater_than_equal": "use a value in the allowed range",
    "less_than": "use a value in the allowed range",
    "less_than_equal": "use a value in the allowed range",
    "literal_error": "use one of the listed values",
    "int_parsing": "write a whole number",
    "int_type": "write a whole number (no quotes, not true/false)",
    "bool_type": "write true or false",
    "float_type": "write a number",
    "finite_number": "write a finite number",
    "int_from_float": "write a whole number",
    "float_parsing": "write a number",
    "bool_parsing": "write true or false",
    "dict_type": "write a mapping (key: value lines)",
    "list_type": "write a list ([a, b] or '- a' lines)",
    "tuple_type": "write a list ([a, b] or '- a' lines)",
    "string_type": "write text",
}


def cross_check(spec: InventorySpec, src: YamlSource) -> Iterable[InputProblem]:
    """Checks that span fields: unique names, references, kind rules, address clashes."""
    first_line: dict[str, int | None] = {}
    names = set()
    for i, node in enumerate(spec.nodes):
        at = ("nodes", i)
        if node.name in first_line:
            yield src.problem(
                at + ("name",),
                f"duplicate node name {node.name!r}",
                f"first defined on line {first_line[node.name]}; names must be unique",
            )
        else:
            first_line[node.name] = src.line_of(at + ("name",))
        names.add(node.name)
        if node.name in RESERVED_NAMES:
            yield src.problem(at + ("name",), f"{node.name!r} is reserved", "choose another name")
        yield from _node_kind_problems(node, src, at, resolved=spec.emulation.instance is not None)

    node_names = {n.name for n in spec.nodes}
    for i, node in enumerate(spec.nodes):
        if node.adb is not None and node.adb.usb_host != "controller":
            host = next((n for n in spec.nodes if n.name == node.adb.usb_host), None)
            if host is None:
                yield src.problem(
                    ("nodes", i, "adb", "usb_host"),
                    f"unknown node {node.adb.usb_host!r}",
                    "name an inventory node, or 'controller' for this machine",
                )
            elif node_kind(host.kind).via_usb_host:
                yield src.problem(
                    ("nodes", i, "adb", "usb_host"),
                    f"{host.name!r} is a phone",
                    "the USB host must be a Linux node or 'controller'",
                )
            elif node.emulated is not None and host.emulated is None:
                yield src.problem(
                    ("nodes", i, "adb", "usb_host"),
                    f"{host.name!r} is not emulated: an emulated phone's stand-in adb runs on an emulated node",
                    "name an emulated Jetson or server as its usb_host",
                )
        yield from _meter_problems(node, src, ("nodes", i, "meter"))
    yield from _clash_problems(spec, src)

    for group in spec.groups:
        members = spec.members_of(group)
        at = ("groups", group) if isinstance(spec.groups[group], tuple) else ("groups", group, "members")
        if group in node_names or group in RESERVED_NAMES:
            yield src.problem(
                ("groups", group),
                f"group name {group!r} is already a node name or reserved",
                "nodes and groups share one namespace",
            )
        for j, member in enumerate(members):
            if member not in node_names and member not in spec.groups:
                yield src.problem(
                    at + (j,), f"unknown node or group {member!r}", "list node names or other group names"
                )
    cycle = _group_cycle({g: spec.members_of(g) for g in spec.groups})
    if cycle:
        yield src.problem(
            ("groups", cycle[0]), "groups include each other: " + " -> ".join(cycle), "remove one of the references"
        )

    if cycle is None:
        yield from _group_setting_conflicts(spec, src)
    yield from _ssh_config_problems(spec, src)

    for name, profile in spec.link_profiles.items():
        yield from profile_problems(name, profile, src)
    yield from link_problems(spec, src, node_names, cycle is None)

    yield from _endpoint_problems(spec, src)
    em = spec.emulation
    for field, net in (("management_subnet", em.management_subnet), ("data_subnet", em.data_subnet)):
        if net.prefixlen < MIN_EMULATED_PREFIX:
            yield src.problem(("emulation", field), f"{net} has {net.num_addresses} addresses: the emulation plans "
                              f"every one", f"use a /{MIN_EMULATED_PREFIX} or smaller, e.g. a /24")  # fmt: skip
    if em.management_subnet.overlaps(em.data_subnet):
        yield src.problem(
            ("emulation", "data_subnet"), "overlaps the management subnet", "the two planes need separate subnets"
        )
    emulated = sum(1 for n in spec.nodes if n.emulated is not None)
    for field, net in (("management_subnet", em.management_subnet), ("data_subnet", em.data_subnet)):
        if net.num_addresses - 3 < emulated:
            yield src.problem(
                ("emulation", field),
                f"{net} is too small for {emulated} emulated nodes",
                "use a larger subnet, e.g. a /24",
            )


MIN_EMULATED_PREFIX = 16  # an emulated subnet of at most 65536 addresses (a lab of 30 nodes needs a /27)


def _endpoint_problems(spec: InventorySpec, src: YamlSource) -> Iterable[InputProblem]:
    """A key sent over plain http crosses the network in the clear: only to this machine (loopback) or
    to an emulated node (the emulation's subnets, on this machine too)."""
    local = (spec.emulation.management_subnet, spec.emulation.data_subnet)
    for name, endpoint in spec.endpoints.items():
        parts = urlsplit(endpoint.url)
        if endpoint.api_key_env is None or parts.scheme != "http" or _on_this_machine(parts.hostname or "", local):
            continue
        yield src.problem(("endpoints", name, "url"), f"the key in ${endpoint.api_key_env} would be sent over plain "
                          f"http to {parts.hostname}, readable on the network", "use https://, or reach the server "
                          "through a tunnel on localhost")  # fmt: skip


def _on_this_machine(host: str, emulated: Iterable[ipaddress.IPv4Network]) -> bool:
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or any(address in net for net in emulated)


def link_problems(
    spec: InventorySpec, src: YamlSource, node_names: set[str], groups_ok: bool
) -> Iterable[InputProblem]:
    """Links naming unknown nodes, groups or profiles; two profiles for one direction."""
    selectable = node_names | set(spec.groups) | {"all"}
    for i, link in enumerate(spec.links):
        for field, value in (("from", link.source), ("to", link.destination)):
            if value not in selectable:
                yield src.problem(
                    ("links", i, field), f"unknown node or group {value!r}", "name a node, a group, or 'all'"
                )
        if link.profile not in spec.link_profiles:
            yield src.problem(
                ("links", i, "profile"), f"unknown link profile {link.profile!r}", "define it under link_profiles"
            )
    if groups_ok:
        yield from _link_conflicts(spec, src)
        yield from _links_without_data(spec, src)


def _node_kind_problems(
    node: NodeSpec, src: YamlSource, at: tuple[str | int, ...], *, resolved: bool
) -> Iterable[InputProblem]:
    kind = kind_of(node)
    if kind.boards is not None and node.model not in kind.boards.models:
        yield src.problem(at + ("model",), f"unknown {kind.boards.name} model {node.model!r}",
                          "one of " + ", ".join(kind.boards.models))  # fmt: skip
    if kind.via_usb_host:
        if node.adb is None:
            yield src.problem(at, "a phone needs an 'adb:' section", "give its serial and usb_host")
        for field in ("ssh", "address"):
            if getattr(node, field) is not None and not (node.emulated is not None and resolved):
                yield src.problem(
                    at + (field,),
                    f"a phone is reached through adb, not '{field}'",
                    "remove it; put the phone's WLAN address under data.address",
                )
        if node.transport != "ssh":
            yield src.problem(at + ("transport",), "a phone is reached through adb", "remove transport")
        if node.emulated is not None:
            yield from _emulated_phone_problems(node, src, at)
    elif node.adb is not None:
        yield src.problem(at + ("adb",), f"kind {node.kind} is not reached with adb: only phones have an adb section",
                          "remove it")  # fmt: skip
    if node.emulated is not None and not resolved:
        for field in ("address", "data"):
            if getattr(node, field) is not None:
                yield src.problem(
                    at + (field,),
                    "an emulated node gets its addresses from 'emulation'",
                    f"remove {field} (or the emulated section)",
                )
    if node.emulated is not None and resolved and node.address is None:
        yield src.problem(at, "a resolved emulated node needs its address", "run testbed emulate up again")
    if node.emulated is not None:
        if node.transport == "local":
            yield src.problem(at + ("transport",), "an emulated node is reached over SSH", "remove transport")
        yield from _power_mode_problems(node.emulated, src, at + ("emulated",))
        for i, mode in enumerate(node.emulated.power_modes):
            problem = kind.power_modes.problem(node.kind, mode.name)
            if kind.power_modes.ids_are_numbers and problem is None and mode.name.isdigit():
                problem = f"{mode.name!r} reads as a mode id: a name with only digits cannot be told from one"
            if problem is not None and not kind.via_usb_host:  # (a phone's: _emulated_phone_problems)
                yield src.problem(at + ("emulated", "power_modes", i, "name"), problem,
                                  "name the mode as the node's power tool does")  # fmt: skip
    elif kind.reached_by_ssh and node.transport == "ssh" and node.address is None:
        yield src.problem(
            at,
            "required field 'address' is missing",
            "give the management address that SSH reaches, or add 'emulated:'",
        )
    for field in ("roles", "tags"):
        values = getattr(node, field)
        if len(set(values)) != len(values):
            yield src.problem(at + (field,), f"repeated entries in {field}", "list each once")


PHONE_MODE = re.compile(r"^(schedutil|performance|powersave)(@[1-9][0-9]{5,6})?$")


def _emulated_phone_problems(node: NodeSpec, src: YamlSource, at: tuple[str | int, ...]) -> Iterable[InputProblem]:
    """An emulated phone stands for a phone of the catalogue; its power modes are governors (with an
    optional cap in kHz), named as ``testbed power`` reads them back."""
    from nodes.emulated.phones import PHONES

    if node.model not in PHONES:
        yield src.problem(at + ("model",), f"no emulated phone {node.model!r}", "one of " + ", ".join(PHONES))
    if node.adb is not None and node.adb.usb_host == "controller":
        yield src.problem(at + ("adb", "usb_host"), "an emulated phone's stand-in adb runs on an emulated node",
                          "name an emulated Jetson or server as its usb_host")  # fmt: skip
    assert node.emulated is not None
    for i, mode in enumerate(node.emulated.power_modes):
        if not PHONE_MODE.match(mode.name):
            yield src.problem(at + ("emulated", "power_modes", i, "name"),
                              f"{mode.name!r} is not a phone's power mode",
                              "write GOVERNOR or GOVERNOR@KHZ: schedutil, performance or powersave, e.g. "
                              "powersave@1803000")  # fmt: skip
        if mode.idle_w <= 0:
            yield src.problem(at + ("emulated", "power_modes", i, "idle_w"), "a phone never draws 0 W",
                              "give its idle power in watts (the battery current must never read 0)")  # fmt: skip


def _power_mode_problems(spec: EmulatedSpec, src: YamlSource, at: tuple[str | int, ...]) -> Iterable[InputProblem]:
    seen_ids: set[int] = set()
    seen_names: set[str] = set()
    for i, mode in enumerate(spec.power_modes):
        here = at + ("power_modes", i)
        if mode.id in seen_ids:
            yield src.problem(here + ("id",), f"duplicate power mode id {mode.id}", "ids must be unique")
        if mode.name in seen_names:
            yield src.problem(here + ("name",), f"duplicate power mode name {mode.name!r}", "names must be unique")
        if mode.idle_w > mode.busy_w:
            yield src.problem(
                here + ("idle_w",),
                f"idle power {mode.idle_w:g} W exceeds busy power {mode.busy_w:g} W",
                "idle_w must be at most busy_w",
            )
        seen_ids.add(mode.id)
        seen_names.add(mode.name)
    if spec.initial_mode is not None and spec.initial_mode not in seen_ids:
        yield src.problem(
            at + ("initial_mode",),
            f"no power mode with id {spec.initial_mode}",
            "name one of the ids under power_modes",
        )


def _meter_problems(node: NodeSpec, src: YamlSource, at: tuple) -> Iterable[InputProblem]:
    if node.meter is not None and node.emulated is not None and not node_kind(node.kind).via_usb_host:
        yield src.problem(at, f"an emulated {node.kind} has no stand-in meter (the stand-in reads an emulated "
                          "phone's battery)", "put the meter on an emulated phone, or on a real node")  # fmt: skip


def _clash_problems(spec: InventorySpec, src: YamlSource) -> Iterable[InputProblem]:
    seen: dict[tuple[str, int | None], str] = {}
    data_seen: dict[str, str] = {}
    for i, node in enumerate(spec.nodes):
        if node.address is not None and node.transport == "ssh":
            port = (node.ssh.port if node.ssh and node.ssh.port else None) or spec.defaults.ssh.port or 22
            key = (node.address, port)
            if key in seen:
                yield src.problem(
                    ("nodes", i, "address"),
                    f"{node.address}:{port} is also node {seen[key]!r}",
                    "each node needs its own address or SSH port",
                )
            seen.setdefault(key, node.name)
        if node.data is not None:
            if node.data.address in data_seen:
                yield src.problem(
                    ("nodes", i, "data", "address"),
                    f"{node.data.address} is also the data address of {data_seen[node.data.address]!r}",
                    "data addresses must be unique",
                )
            data_seen.setdefault(node.data.address, node.name)


def profile_problems(name: str, p: LinkProfile, src: YamlSource) -> Iterable[InputProblem]:
    """A profile's settings that its other settings make meaningless (:meth:`LinkProfile.problems`)."""
    for field, problem, hint in p.problems():
        yield src.problem(("link_profiles", name, *([field] if field else [])), problem, hint)


def _ssh_config_problems(spec: InventorySpec, src: YamlSource) -> Iterable[InputProblem]:
    """An SSH config the inventory names must be there (the default one may be missing)."""
    places = [(("defaults", "ssh"), spec.defaults.ssh)]
    places += [(("groups", g, "ssh"), e.ssh) for g, e in spec.group_settings().items()]
    places += [(("nodes", i, "ssh"), n.ssh) for i, n in enumerate(spec.nodes)]
    for at, ssh in places:
        if ssh is not None and ssh.config not in (None, "none") and not Path(ssh.config).expanduser().is_file():
            yield src.problem(at + ("config",), f"no SSH config at {ssh.config}",
                              "name an existing file in OpenSSH's format, or 'none'")  # fmt: skip


def _group_setting_conflicts(spec: InventorySpec, src: YamlSource) -> Iterable[InputProblem]:
    """Two groups that set one field differently for a node that does not set it itself: which one
    wins would depend on the order of the file, so neither does."""
    settings = spec.group_settings()
    if len(settings) < 2:
        return
    expanded = expand_groups(spec)
    told: set[tuple[str, str, str]] = set()
    for node in spec.nodes:
        setters: dict[str, tuple[str, object]] = {}
        for group, entry in settings.items():
            if node.name not in expanded[group]:
                continue
            ssh = entry.ssh.model_dump(exclude_none=True) if entry.ssh else {}
            fields = {**{f: getattr(entry, f) for f in NODE_SETTINGS}, **{f"ssh.{k}": v for k, v in ssh.items()}}
            for field, value in fields.items():
                mine = getattr(node.ssh, field[4:], None) if field.startswith("ssh.") else getattr(node, field)
                if value is None or mine is not None:
                    continue
                first = setters.setdefault(field, (group, value))
                if first[1] != value and (first[0], group, field) not in told:
                    told.add((first[0], group, field))
                    at = ("groups", group, *field.split("."))
                    yield src.problem(at, f"{node.name} is also in group {first[0]!r}, which sets {field} to "
                                      f"{first[1]!r}", f"set {field} on {node.name} itself, or in one of the two "
                                      "groups")  # fmt: skip


def _group_cycle(groups: dict[str, tuple[str, ...]]) -> list[str] | None:
    def visit(name: str, trail: list[str]) -> list[str] | None:
        if name in trail:
            return trail[trail.index(name) :] + [name]
        for member in groups.get(name, ()):
            if member in groups:
                found = visit(member, trail + [name])
                if found:
                    return found
        return None

    for group in groups:
        found = visit(group, [])
        if found:
            return found
    return None


def _links_without_data(spec: InventorySpec, src: YamlSource) -> Iterable[InputProblem]:
    """A shaped link needs both ends on the data plane: the shaping node's data interface and the
    other end's data address (the tc filter's match). An emulated node gets both when it comes up."""
    nodes = {n.name: n for n in spec.nodes}
    named: set[str] = set()
    for i, s, d in link_pairs(spec, expand_groups(spec)):
        for end in (s, d):
            node = nodes.get(end)
            if node is None or node.data is not None or node.emulated is not None or end in named:
                continue
            named.add(end)
            yield src.problem(
                ("links", i), f"{s} -> {d}: node {end} has no data: section, so the link has no interface or "
                "address to shape", f"give {end} data: {{interface: ..., address: ...}} (the plane MPI and iperf3 "
                "use, never the SSH one), or leave it out of the links",
            )  # fmt: skip


def _link_conflicts(spec: InventorySpec, src: YamlSource) -> Iterable[InputProblem]:
    groups = expand_groups(spec)
    seen: dict[tuple[str, str], int] = {}
    for i, s, d in link_pairs(spec, groups):
        j = seen.setdefault((s, d), i)
        if j != i and spec.links[j].profile != spec.links[i].profile:
            yield src.problem(
                ("links", i),
                f"{s} -> {d} is also shaped by the link on line {src.line_of(('links', j))} with another profile",
                "each direction between two nodes may have one profile",
            )
            return
