"""``inventory.yaml``: the lab's nodes, groups, link profiles and links, validated before any node
is touched.

Loading is two passes over a :class:`~foundation.user_files.YamlSource`: pydantic checks shapes,
types and units; :func:`_cross_check` checks what spans fields (names, references, kinds). Every
problem is reported as ``FILE:LINE: field: what is wrong; hint`` and raised as one
:class:`~foundation.errors.InputError`.
"""

from __future__ import annotations

import getpass
import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, ValidationError
from pydantic_core import PydanticCustomError

from foundation import units
from foundation.errors import InputError, InputProblem, TestbedError
from foundation.user_files import YamlSource

# --------------------------------------------------------------------------------------------
# Scalars that end up in commands: a strict character set, so nothing a user writes can reach a
# shell as anything but one word.

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
INTERFACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,14}$"  # Linux IFNAMSIZ: 15 characters
PATH_PATTERN = r"^[A-Za-z0-9_./~+@%:=,-]+$"
SERIAL_PATTERN = r"^[A-Za-z0-9._:-]+$"
ENV_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
HOSTNAME_PATTERN = (
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)

JETSON_MODELS = ("agx-orin", "agx-xavier", "orin-nx", "orin-nano", "xavier-nx")
RESERVED_NAMES = ("all", "controller")
SECRET_KEYS = ("password", "passphrase", "sudo_password", "key_passphrase")
NAMED_BY_USER = (("groups",), ("link_profiles",))  # mappings whose keys are names, not fields


def _invalid(kind: str, problem: str, hint: str) -> PydanticCustomError:
    """A validation error whose message and hint reach the user unchanged."""
    return PydanticCustomError(kind, "{problem}", {"problem": problem, "hint": hint})


def _unit(parser: Any, what: str) -> Any:
    def validate(value: object) -> float:
        try:
            return parser(value)
        except units.UnitError as exc:
            raise _invalid("unit", exc.problem, exc.hint) from None

    validate.__name__ = f"parse_{what}"
    return BeforeValidator(validate)


def _address(value: object) -> str:
    if isinstance(value, str):
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            if re.fullmatch(HOSTNAME_PATTERN, value) and not value.replace(".", "").isdigit():
                return value
    raise _invalid("address", f"{value!r} is not an IP address or host name", "no spaces, ports or shell characters")


def _ip(value: object) -> str:
    try:
        return str(ipaddress.ip_address(str(value)))
    except ValueError:
        raise _invalid(
            "address", f"{value!r} is not an IP address", "the data plane needs a literal IP, e.g. 10.0.0.11"
        ) from None


RateBitS = Annotated[float, _unit(units.parse_rate_bit_s, "rate"), Field(gt=0)]
DurationS = Annotated[float, _unit(units.parse_duration_s, "duration"), Field(ge=0)]
Percent = Annotated[float, _unit(units.parse_percent, "percent"), Field(ge=0, le=100)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
SafePath = Annotated[str, Field(pattern=PATH_PATTERN)]
Address = Annotated[str, BeforeValidator(_address)]
IpAddress = Annotated[str, BeforeValidator(_ip)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


# --------------------------------------------------------------------------------------------
# Schema


class SshSettings(_Strict):
    """SSH settings; in ``defaults.ssh`` every field has a default, on a node each overrides it."""

    user: Name | None = None
    port: StrictInt | None = Field(None, ge=1, le=65535)
    identity_file: SafePath | None = None
    known_hosts: SafePath | None = None
    password_env: Annotated[str, Field(pattern=ENV_PATTERN)] | None = None
    connect_timeout_s: DurationS | None = Field(None, alias="connect_timeout", gt=0, le=600)
    keepalive_s: DurationS | None = Field(None, alias="keepalive", le=3600)


class Defaults(_Strict):
    ssh: SshSettings = SshSettings()
    python: SafePath = "python3"  # the node's Python that runs our code (and that provisioning makes the venv from)
    sudo: StrictBool = True
    workdir: SafePath = "~/hil-testbed"
    venv: SafePath | None = None  # the per-node virtual environment of `testbed provision`; <workdir>/venv
    registry_access: StrictBool = True  # False: nodes get a wheelhouse from the controller instead of PyPI

    @property
    def venv_path(self) -> str:
        return self.venv or f"{self.workdir.rstrip('/')}/venv"


class DataPlane(_Strict):
    """The shaped interface that carries MPI and iperf3 traffic."""

    interface: Annotated[str, Field(pattern=INTERFACE_PATTERN)]
    address: IpAddress


class AdbAttachment(_Strict):
    """A phone reached with adb on a USB host (an inventory node, or ``controller``)."""

    serial: Annotated[str, Field(pattern=SERIAL_PATTERN, max_length=64)]
    usb_host: Name


class EmulatedPowerMode(_Strict):
    """One power mode of an emulated node: its CPU quota and modeled power."""

    id: StrictInt = Field(ge=0, le=255)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")]
    cpus: float = Field(gt=0, le=1024)
    idle_w: float = Field(ge=0, le=10000)
    busy_w: float = Field(ge=0, le=10000)


class EmulatedSpec(_Strict):
    """Makes the node an emulated stand-in (network namespace, sshd, CPU quota) on this machine."""

    power_modes: tuple[EmulatedPowerMode, ...] = ()
    initial_mode: StrictInt | None = Field(None, ge=0, le=255)


class NodeSpec(_Strict):
    name: Name
    kind: Literal["jetson", "android", "server"]
    model: Name
    transport: Literal["ssh", "local"] = "ssh"
    address: Address | None = None
    ssh: SshSettings | None = None
    data: DataPlane | None = None
    roles: tuple[Literal["device", "server"], ...] = ()
    gpus: StrictInt = Field(0, ge=0, le=64)
    gpu_model: Name | None = None
    adb: AdbAttachment | None = None
    tags: tuple[Name, ...] = ()
    registry_access: StrictBool | None = None  # overrides defaults.registry_access for this node
    emulated: EmulatedSpec | None = None


class LinkProfile(_Strict):
    """One direction of a link: rate, delay, jitter and loss, as tc/netem will apply them."""

    rate_bit_s: RateBitS | None = Field(None, alias="rate", ge=1e3, le=1e11)
    delay_s: DurationS | None = Field(None, alias="delay", le=10)
    jitter_s: DurationS | None = Field(None, alias="jitter", le=10)
    distribution: Literal["normal", "pareto", "paretonormal", "uniform"] | None = None
    loss_pct: Percent | None = Field(None, alias="loss")
    loss_correlation_pct: Percent | None = Field(None, alias="loss_correlation")
    queue_limit_packets: StrictInt | None = Field(None, ge=1, le=1_000_000)

    @property
    def needs_netem(self) -> bool:
        return any(v for v in (self.delay_s, self.jitter_s, self.loss_pct))

    def describe(self) -> str:
        parts = []
        if self.rate_bit_s is not None:
            parts.append(units.format_rate(self.rate_bit_s))
        if self.delay_s is not None:
            parts.append("delay " + units.format_duration(self.delay_s))
        if self.jitter_s is not None:
            parts.append("jitter " + units.format_duration(self.jitter_s))
        if self.loss_pct is not None:
            parts.append(f"loss {self.loss_pct:g}%")
        return ", ".join(parts)


class LinkSpec(_Strict):
    source: Name = Field(alias="from")
    destination: Name = Field(alias="to")
    profile: Name
    symmetric: StrictBool = False


class EmulationInstance(_Strict):
    """Written by ``testbed emulate up`` into the inventory it resolves; never written by hand."""

    mode: Literal["netns", "local"]
    source: SafePath  # the inventory it was built from
    source_digest: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class EmulationSettings(_Strict):
    """Where the emulated testbed puts its addresses, its state, and how it names what it creates."""

    management_subnet: ipaddress.IPv4Network = ipaddress.IPv4Network("10.231.0.0/24")
    data_subnet: ipaddress.IPv4Network = ipaddress.IPv4Network("10.232.0.0/24")
    name_prefix: Annotated[str, Field(pattern=r"^[a-z][a-z0-9]{0,5}$")] = "tb"
    state_dir: SafePath | None = None  # default: /run/hil-testbed/<prefix> (root), else per user
    instance: EmulationInstance | None = None


class InventorySpec(_Strict):
    defaults: Defaults = Defaults()
    emulation: EmulationSettings = EmulationSettings()
    nodes: tuple[NodeSpec, ...] = Field(min_length=1)
    groups: dict[Name, tuple[Name, ...]] = {}
    link_profiles: dict[Name, LinkProfile] = {}
    links: tuple[LinkSpec, ...] = ()


# --------------------------------------------------------------------------------------------
# The resolved inventory


@dataclass(frozen=True)
class SshTarget:
    """Everything needed to open one SSH connection, defaults applied."""

    host: str
    port: int
    user: str
    identity_file: str | None
    known_hosts: str
    password_env: str | None
    connect_timeout_s: float
    keepalive_s: float


@dataclass(frozen=True)
class DirectedLink:
    """A shaped direction from one node to another, after groups are expanded."""

    source: str
    destination: str
    profile_name: str
    profile: LinkProfile


@dataclass(frozen=True)
class Inventory:
    path: Path
    spec: InventorySpec
    groups: dict[str, tuple[str, ...]]
    links: tuple[DirectedLink, ...]

    @property
    def nodes(self) -> tuple[NodeSpec, ...]:
        return self.spec.nodes

    def node(self, name: str) -> NodeSpec:
        for node in self.spec.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def select(self, names: Sequence[str] | None) -> tuple[NodeSpec, ...]:
        """Nodes named directly or through groups (``all`` for every node); all when empty."""
        if not names:
            return self.spec.nodes
        wanted: set[str] = set()
        for name in names:
            if name == "all":
                wanted.update(n.name for n in self.spec.nodes)
            elif name in self.groups:
                wanted.update(self.groups[name])
            elif any(n.name == name for n in self.spec.nodes):
                wanted.add(name)
            else:
                known = ", ".join([n.name for n in self.spec.nodes] + list(self.groups))
                raise TestbedError(f"{self.path}: no node or group named {name!r}; known: {known}")
        return tuple(n for n in self.spec.nodes if n.name in wanted)

    @property
    def state_dir(self) -> Path:
        """Where the controller keeps what it learned about this inventory's nodes (provisioning
        records): the emulated testbed's state directory, else ``.testbed/<stem>/`` beside the file."""
        if self.spec.emulation.instance is not None:
            return self.path.parent
        return self.path.parent / ".testbed" / self.path.stem

    def ssh_target(self, node: NodeSpec) -> SshTarget:
        if node.address is None:
            raise TestbedError(f"{self.path}: node {node.name!r} has no address to reach it at")
        d = self.spec.defaults.ssh
        o = node.ssh or SshSettings()

        def pick(field: str, fallback: Any) -> Any:
            for source in (o, d):
                value = getattr(source, field)
                if value is not None:
                    return value
            return fallback

        return SshTarget(
            host=node.address,
            port=pick("port", 22),
            user=pick("user", getpass.getuser()),
            identity_file=pick("identity_file", None),
            known_hosts=pick("known_hosts", "~/.ssh/known_hosts"),
            password_env=pick("password_env", None),
            connect_timeout_s=pick("connect_timeout_s", 10.0),
            keepalive_s=pick("keepalive_s", 15.0),
        )


def load_inventory(path: str | Path) -> Inventory:
    """Load and validate ``path``; raise :class:`InputError` listing every problem found."""
    return inventory_from_source(YamlSource.load(path))


def inventory_from_source(source: YamlSource) -> Inventory:
    problems = list(_secret_problems(source, source.data, ()))
    if source.data is None or not isinstance(source.data, dict):
        problems.append(
            source.problem(
                (), "the inventory must be a mapping with a 'nodes' list", "see examples/inventories/lab.yaml"
            )
        )
        raise InputError(problems)
    try:
        spec = InventorySpec.model_validate(source.data)
    except ValidationError as exc:
        errors = exc.errors()
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
            if not secret and not echo:  # secrets were already reported above, with a better hint
                problems.append(pydantic_problem(source, err))
        raise InputError(problems) from None
    if problems:
        raise InputError(problems)
    problems = list(_cross_check(spec, source))
    if problems:
        raise InputError(problems)
    groups = _expand_groups(spec)
    return Inventory(source.path, spec, groups, _expand_links(spec, groups))



class LinksFileSpec(_Strict):
    """A file given to ``testbed link apply --links``: links (and optionally more profiles) that
    replace the inventory's links for one apply."""

    link_profiles: dict[Name, LinkProfile] = {}
    links: tuple[LinkSpec, ...] = Field(min_length=1)


def links_from_file(inventory: Inventory, path: str | Path) -> tuple[DirectedLink, ...]:
    """The directed links of a links file, checked against the inventory's nodes, groups and
    profiles; problems name the links file's lines."""
    source = YamlSource.load(path)
    if not isinstance(source.data, dict):
        raise InputError([source.problem((), "a links file must be a mapping with a 'links' list", "")])
    try:
        extra = LinksFileSpec.model_validate(source.data)
    except ValidationError as exc:
        raise InputError([pydantic_problem(source, err) for err in exc.errors()]) from None
    problems = []
    for name, profile in extra.link_profiles.items():
        problems += list(_profile_problems(name, profile, source))
        if name in inventory.spec.link_profiles:
            problems.append(
                source.problem(("link_profiles", name), f"profile {name!r} is already defined in {inventory.path}",
                               "give it another name")
            )  # fmt: skip
    spec = inventory.spec.model_copy(
        update={"link_profiles": {**inventory.spec.link_profiles, **extra.link_profiles}, "links": extra.links}
    )
    problems += list(_link_problems(spec, source, {n.name for n in spec.nodes}, True))
    if problems:
        raise InputError(problems)
    return _expand_links(spec, inventory.groups)

# --------------------------------------------------------------------------------------------
# Problem reporting


def _secret_problems(source: YamlSource, data: Any, path: tuple[str | int, ...]) -> Iterable[InputProblem]:
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
                yield from _secret_problems(source, value, path + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _secret_problems(source, value, path + (i,))


def pydantic_problem(source: YamlSource, err: Any) -> InputProblem:
    loc = tuple(part for part in err["loc"] if isinstance(part, (str, int)))
    ctx = err.get("ctx") or {}
    kind = err["type"]
    if kind == "extra_forbidden":
        return source.problem(
            loc, f"unknown key {loc[-1]!r}", "check the spelling; examples/inventories/lab.yaml shows every key"
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
    hint = _HINTS.get(kind, "examples/inventories/lab.yaml shows a valid inventory")
    return source.problem(loc, shown + message, hint)


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


def _cross_check(spec: InventorySpec, src: YamlSource) -> Iterable[InputProblem]:
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
            elif host.kind == "android":
                yield src.problem(
                    ("nodes", i, "adb", "usb_host"),
                    f"{host.name!r} is a phone",
                    "the USB host must be a Linux node or 'controller'",
                )
    yield from _clash_problems(spec, src)

    for group, members in spec.groups.items():
        if group in node_names or group in RESERVED_NAMES:
            yield src.problem(
                ("groups", group),
                f"group name {group!r} is already a node name or reserved",
                "nodes and groups share one namespace",
            )
        for j, member in enumerate(members):
            if member not in node_names and member not in spec.groups:
                yield src.problem(
                    ("groups", group, j), f"unknown node or group {member!r}", "list node names or other group names"
                )
    cycle = _group_cycle(spec.groups)
    if cycle:
        yield src.problem(
            ("groups", cycle[0]), "groups include each other: " + " -> ".join(cycle), "remove one of the references"
        )

    for name, profile in spec.link_profiles.items():
        yield from _profile_problems(name, profile, src)
    yield from _link_problems(spec, src, node_names, cycle is None)

    em = spec.emulation
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


def _link_problems(
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


def _node_kind_problems(
    node: NodeSpec, src: YamlSource, at: tuple[str | int, ...], *, resolved: bool
) -> Iterable[InputProblem]:
    if node.kind == "jetson" and node.model not in JETSON_MODELS:
        yield src.problem(at + ("model",), f"unknown Jetson model {node.model!r}", "one of " + ", ".join(JETSON_MODELS))
    if node.kind == "android":
        if node.adb is None:
            yield src.problem(at, "a phone needs an 'adb:' section", "give its serial and usb_host")
        for field in ("ssh", "address"):
            if getattr(node, field) is not None:
                yield src.problem(
                    at + (field,),
                    f"a phone is reached through adb, not '{field}'",
                    "remove it; put the phone's WLAN address under data.address",
                )
        if node.transport != "ssh":
            yield src.problem(at + ("transport",), "a phone is reached through adb", "remove transport")
        if node.emulated is not None:
            yield src.problem(
                at + ("emulated",), "emulated phones are not supported yet", "emulate a Jetson or server instead"
            )
    elif node.adb is not None:
        yield src.problem(at + ("adb",), "only phones (kind: android) have an adb section", "remove it")
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
    elif node.kind != "android" and node.transport == "ssh" and node.address is None:
        yield src.problem(
            at,
            "required field 'address' is missing",
            "give the management address that SSH reaches, or add 'emulated:'",
        )
    for field in ("roles", "tags"):
        values = getattr(node, field)
        if len(set(values)) != len(values):
            yield src.problem(at + (field,), f"repeated entries in {field}", "list each once")


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


def _profile_problems(name: str, p: LinkProfile, src: YamlSource) -> Iterable[InputProblem]:
    at = ("link_profiles", name)
    if all(v is None for v in (p.rate_bit_s, p.delay_s, p.loss_pct)):
        yield src.problem(at, "the profile shapes nothing", "give at least one of rate, delay, loss")
    if p.jitter_s is not None and not p.delay_s:
        yield src.problem(at + ("jitter",), "jitter needs a delay", "add delay: (jitter varies around it)")
    if p.distribution is not None and not p.jitter_s:
        yield src.problem(at + ("distribution",), "a delay distribution needs jitter", "add jitter:")
    if p.loss_correlation_pct is not None and not p.loss_pct:
        yield src.problem(at + ("loss_correlation",), "loss correlation needs loss", "add loss:")


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


def _expand_groups(spec: InventorySpec) -> dict[str, tuple[str, ...]]:
    order = [n.name for n in spec.nodes]

    def members(name: str) -> set[str]:
        if name not in spec.groups:
            return {name}
        out: set[str] = set()
        for member in spec.groups[name]:
            out |= members(member)
        return out

    expanded = {g: tuple(n for n in order if n in members(g)) for g in spec.groups}
    expanded["all"] = tuple(order)
    return expanded


def _link_pairs(spec: InventorySpec, groups: dict[str, tuple[str, ...]]) -> Iterable[tuple[int, str, str]]:
    for i, link in enumerate(spec.links):
        sources = groups.get(link.source, (link.source,))
        destinations = groups.get(link.destination, (link.destination,))
        for s in sources:
            for d in destinations:
                if s == d:
                    continue
                yield i, s, d
                if link.symmetric:
                    yield i, d, s


def _link_conflicts(spec: InventorySpec, src: YamlSource) -> Iterable[InputProblem]:
    groups = _expand_groups(spec)
    seen: dict[tuple[str, str], int] = {}
    for i, s, d in _link_pairs(spec, groups):
        j = seen.setdefault((s, d), i)
        if j != i and spec.links[j].profile != spec.links[i].profile:
            yield src.problem(
                ("links", i),
                f"{s} -> {d} is also shaped by the link on line {src.line_of(('links', j))} with another profile",
                "each direction between two nodes may have one profile",
            )
            return


def _expand_links(spec: InventorySpec, groups: dict[str, tuple[str, ...]]) -> tuple[DirectedLink, ...]:
    out: dict[tuple[str, str], DirectedLink] = {}
    for i, s, d in _link_pairs(spec, groups):
        name = spec.links[i].profile
        out.setdefault((s, d), DirectedLink(s, d, name, spec.link_profiles[name]))
    return tuple(out.values())
