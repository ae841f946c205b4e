"""The shape of ``inventory.yaml`` (and of a links file) as pydantic models: fields, types, units
and the character sets of everything that ends up in a command.

What spans fields (names, references, kinds) is checked in :mod:`testbed.inventory.validation`.
Link profiles are netem's (:class:`netem.profile.LinkProfile`).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from foundation.user_fields import STRICT_MODEL_CONFIG, DurationS, Number, invalid_value
from netem.profile import LinkProfile
from testbed.inventory.node_kinds import delay_path_names, kind_names

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

def _address(value: object) -> str:
    if isinstance(value, str):
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            if re.fullmatch(HOSTNAME_PATTERN, value) and not value.replace(".", "").isdigit():
                return value
    raise invalid_value(
        "address", f"{value!r} is not an IP address or host name", "no spaces, ports or shell characters"
    )


def _ip(value: object) -> str:
    try:
        address = ipaddress.ip_address(str(value)) if isinstance(value, str) else None
    except ValueError:
        address = None
    if address is None:
        raise invalid_value("address", f"{value!r} is not an IP address",
                            "the data plane needs a literal IP, e.g. 10.0.0.11")  # fmt: skip
    # the tc filters (u32 'match ip dst A/32') and the iptables rules match one IPv4 unicast host
    if address.version != 4:
        raise invalid_value("address", f"{value} is an IPv6 address: the data plane's tc filters and iptables "
                            "rules match IPv4 only", "give the node's IPv4 address on the data network")  # fmt: skip
    # (loopback stays: the emulated testbed's local mode puts its nodes' data planes there, unshaped)
    broadcast = address == ipaddress.IPv4Address("255.255.255.255")
    for what, test in (("unspecified", address.is_unspecified), ("multicast", address.is_multicast),
                       ("broadcast", broadcast), ("reserved", address.is_reserved and not broadcast)):
        if test:
            raise invalid_value("address", f"{value} is a {what} address: no shaped link reaches one node there",
                                "give the node's own IPv4 address on the data network")  # fmt: skip
    return str(address)


def _node_path(value: object) -> object:
    """A path on a node (or the controller) must not depend on the directory a command happens to run
    in: absolute, or under the home directory (``~`` or ``~/...``)."""
    if isinstance(value, str) and not (value.startswith("/") or value == "~" or value.startswith("~/")):
        where = "another user's home (~user) is not supported" if value.startswith("~") else "it is relative"
        raise invalid_value("path", f"{value!r}: {where}; it would resolve against whatever directory a command "
                            "runs in", "write an absolute path or one under the home directory, e.g. ~/hil-testbed")
    return value


def _python(value: object) -> object:
    """The node's Python: a command found on PATH (``python3``) or a path as :func:`_node_path` takes."""
    return value if isinstance(value, str) and "/" not in value and not value.startswith("~") else _node_path(value)


def _delay_path(value: object) -> str:
    known = ("auto", *delay_path_names())
    if isinstance(value, str) and value in known:
        return value
    raise invalid_value("delay_path", f"{value!r} is not a delay path", "one of " + ", ".join(map(repr, known)))


def _workdir(value: object) -> object:
    if isinstance(value, str) and value.rstrip("/") == "":
        raise invalid_value("path", f"{value!r} is the root directory", "give an absolute directory of its own, "
                            "or one under the home directory, e.g. ~/hil-testbed")  # fmt: skip
    return _node_path(value)


Name = Annotated[str, Field(pattern=NAME_PATTERN)]
SafePath = Annotated[str, Field(pattern=PATH_PATTERN, max_length=4096)]
NodePath = Annotated[SafePath, AfterValidator(_node_path)]
Address = Annotated[str, BeforeValidator(_address)]
IpAddress = Annotated[str, BeforeValidator(_ip)]


MAX_NODES = 4096  # a lab of 30+ boards; a bound so that no file makes the checks quadratic in millions


class _Strict(BaseModel):
    model_config = STRICT_MODEL_CONFIG


def _ssh_config(value: object) -> object:
    return value if value == "none" else _node_path(value)


class SshSettings(_Strict):
    """SSH settings; in ``defaults.ssh`` every field has a default, on a group or a node each overrides
    it. What none of them sets comes from the SSH config (testbed.inventory.ssh_config)."""

    user: Name | None = None
    port: StrictInt | None = Field(None, ge=1, le=65535)
    identity_file: NodePath | None = None  # on the controller
    known_hosts: NodePath | None = None
    password_env: Annotated[str, Field(pattern=ENV_PATTERN)] | None = None
    connect_timeout_s: DurationS | None = Field(None, alias="connect_timeout", gt=0, le=600)
    keepalive_s: DurationS | None = Field(None, alias="keepalive", le=3600)
    # ProxyJump's syntax: [user@]host[:port], hops joined by commas, the first hop first; none: no jump
    jump: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.@:,\[\]-]+$", max_length=1024)] | None = None
    # the SSH config to read on the controller (OpenSSH's format); default ~/.ssh/config (emulated nodes:
    # none unless named); none: read none
    config: Annotated[SafePath, AfterValidator(_ssh_config)] | None = None
    # the SSH config the node's own ssh reads when it reaches the others (mpiexec's launch from the
    # server, after the inventory's users and ports); default ~/.ssh/config on that node
    node_config: NodePath | None = None


NodePython = Annotated[SafePath, AfterValidator(_python)]
Workdir = Annotated[SafePath, AfterValidator(_workdir)]


class Defaults(_Strict):
    ssh: SshSettings = SshSettings()
    # the node's Python that runs our code (and that provisioning makes the venv from): a command or a path
    python: NodePython = "python3"
    sudo: StrictBool = True
    workdir: Workdir = "~/hil-testbed"  # absolute, or under ~
    venv: NodePath | None = None  # the per-node virtual environment of `testbed provision`; <workdir>/venv
    registry_access: StrictBool = True  # False: nodes get a wheelhouse from the controller instead of PyPI
    # How delay, jitter and loss are applied: netem (a tc qdisc), nfqueue (iptables and a user-space
    # handler, for kernels without sch_netem), auto (netem where the node's kernel has it), or a delay
    # path a lab's module registers (netem.delay_path)
    delay_path: Annotated[str, BeforeValidator(_delay_path)] = "auto"

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


class MeterSpec(_Strict):
    """An external power meter inline with the node's supply (a Monsoon on a phone whose battery it
    replaces, or on a board's input): the node's telemetry then comes from the meter, read where the
    node's commands run (a phone's USB host, which its USB is plugged into too; else the node). On an
    emulated phone a stand-in meter reads the phone's modeled battery and writes the meter's format."""

    kind: Literal["monsoon"]  # the meter's logger and file format (nodes/telemetry/monsoon.py)
    channel: Literal["main", "usb"] = "main"  # the Monsoon output the node hangs on
    vout_v: Number = Field(4.0, ge=0.8, le=13.5)  # the voltage it supplies (HVPM: 0.8-13.5 V)


class EmulatedPowerMode(_Strict):
    """One power mode of an emulated node: its CPU quota and modeled power."""

    id: StrictInt = Field(ge=0, le=255)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}(@[0-9]{1,9})?$")]  # phones: GOVERNOR@KHZ
    cpus: Number = Field(ge=0.001, le=1024)  # a CPU quota below a thousandth of a CPU never gets to run
    idle_w: Number = Field(ge=0, le=10000)
    busy_w: Number = Field(ge=0, le=10000)


class EmulatedSpec(_Strict):
    """Makes the node an emulated stand-in (network namespace, sshd, CPU quota) on this machine."""

    power_modes: tuple[EmulatedPowerMode, ...] = Field((), max_length=256)
    initial_mode: StrictInt | None = Field(None, ge=0, le=255)


def _node_kind(value: object) -> str:
    if isinstance(value, str) and value in kind_names():
        return value
    raise invalid_value("node_kind", f"{value!r} is not a node kind", "one of " + ", ".join(map(repr, kind_names())))


NODE_SETTINGS = ("python", "sudo", "workdir", "venv", "registry_access")  # of defaults, set again per group/node


class NodeOverrides(_Strict):
    """What a group or a node sets again over ``defaults`` (unset: None)."""

    ssh: SshSettings | None = None
    python: NodePython | None = None
    sudo: StrictBool | None = None
    workdir: Workdir | None = None
    venv: NodePath | None = None
    registry_access: StrictBool | None = None


class GroupSpec(NodeOverrides):
    """A group that also sets what its nodes share (a bare list of members sets nothing): its settings
    override ``defaults`` for its members, and a node's own override the group's."""

    members: tuple[Name, ...] = Field(min_length=1, max_length=MAX_NODES)


class NodeSpec(NodeOverrides):
    name: Name
    kind: Annotated[str, BeforeValidator(_node_kind)]  # a row of testbed.inventory.node_kinds
    model: Name
    transport: Literal["ssh", "local"] = "ssh"
    address: Address | None = None
    data: DataPlane | None = None
    roles: tuple[Literal["device", "server"], ...] = Field((), max_length=2)
    gpus: StrictInt = Field(0, ge=0, le=64)
    gpu_model: Name | None = None
    adb: AdbAttachment | None = None
    meter: MeterSpec | None = None
    tags: tuple[Name, ...] = Field((), max_length=64)
    # the hardware the node is (or stands for, emulated): a profile in examples/profiles or a file
    compute_profile: SafePath | None = None
    emulated: EmulatedSpec | None = None


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
    # Reach the nodes as a real lab is reached: as this non-root user (made by `up`, removed by `down`),
    # whose sudo allows only the rules the suite prints (testbed.provisioning.sudo_rules); netns mode only.
    ssh_user: Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_-]{0,30}$")] | None = None
    sudo_rules: Literal["printed"] = "printed"
    # Reach the nodes only through a bastion, as most labs are: `up` makes a namespace with an sshd on the
    # management network, the one address of the lab this machine can reach; every node is reached with
    # ssh.jump through it, its key named in an SSH config (netns mode only).
    bastion: StrictBool = False
    instance: EmulationInstance | None = None


class EndpointSpec(_Strict):
    """An OpenAI-compatible server the lab runs (vLLM, llama.cpp's server, ...), that DiSCo's devices
    can race against (a campaign's ``dispatch.external``). Its key, if it needs one, is read from the
    environment variable ``api_key_env`` on the controller when a run starts: never written here."""

    url: Annotated[str, Field(max_length=2048)]
    model: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/@+-]+$")] = "default"
    api_key_env: Annotated[str, Field(pattern=ENV_PATTERN)] | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        # The URL reaches every manifest and run config: it must carry no secret, and it must be one any
        # client opens the same way (ASCII host, a port that exists).
        example = "write e.g. http://10.50.0.2:8000/v1"
        if not url.isascii() or re.search(r"[\x00-\x20\x7f'\"`$;\\]", url):
            raise invalid_value("url", "the URL holds spaces, quotes, control or non-ASCII characters",
                                f"{example} (a host name in punycode)")  # fmt: skip
        parts = urlsplit(url)
        if "@" in parts.netloc:
            raise invalid_value("url", "the URL carries credentials (user:password@): they would be written into "
                                "every manifest and run config", "remove them; put the key in an environment "
                                "variable on the controller and name it in api_key_env")  # fmt: skip
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise invalid_value("url", f"{url!r} is not an http:// or https:// URL", example)
        if parts.query or parts.fragment:
            raise invalid_value("url", "the URL has a query or fragment (a key in '?api_key=' would be written into "
                                "every manifest)", "give the server's base URL; put a key in an environment variable "
                                "named in api_key_env")  # fmt: skip
        try:
            port = parts.port
        except ValueError:
            port = 0
        if port == 0 or (port is None and re.search(r":[^/\]]*$", parts.netloc)):
            raise invalid_value("url", f"{url!r} has no valid port (1-65535)", example)
        return url.rstrip("/")

    @model_validator(mode="before")
    @classmethod
    def _no_inline_key(cls, data: object) -> object:
        if isinstance(data, dict) and ({"api_key", "key", "token"} & set(data)):
            raise ValueError("never write a key in the inventory: export it in an environment variable on the "
                             "controller and name the variable in api_key_env")  # fmt: skip
        return data


class InventorySpec(_Strict):
    defaults: Defaults = Defaults()
    emulation: EmulationSettings = EmulationSettings()
    nodes: tuple[NodeSpec, ...] = Field(min_length=1, max_length=MAX_NODES)
    groups: dict[Name, Annotated[tuple[Name, ...], Field(max_length=MAX_NODES)] | GroupSpec] = Field(
        {}, max_length=MAX_NODES
    )
    link_profiles: dict[Name, LinkProfile] = Field({}, max_length=MAX_NODES)
    links: tuple[LinkSpec, ...] = Field((), max_length=MAX_NODES)
    endpoints: dict[Name, EndpointSpec] = Field({}, max_length=256)  # OpenAI-compatible servers of the lab

    def members_of(self, group: str) -> tuple[str, ...]:
        """A group's members as written (nodes and groups), whether it is a list or a mapping."""
        entry = self.groups[group]
        return entry.members if isinstance(entry, GroupSpec) else entry

    def group_settings(self) -> dict[str, GroupSpec]:
        """The groups that set something for their nodes, in the file's order."""
        return {name: entry for name, entry in self.groups.items() if isinstance(entry, GroupSpec)}


class LinksFileSpec(_Strict):
    """A file given to ``testbed link apply --links``: links (and optionally more profiles) that
    replace the inventory's links for one apply."""

    link_profiles: dict[Name, LinkProfile] = Field({}, max_length=MAX_NODES)
    links: tuple[LinkSpec, ...] = Field(min_length=1, max_length=MAX_NODES)
