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

from pydantic import BaseModel, BeforeValidator, Field, StrictBool, StrictInt, field_validator, model_validator

from foundation.user_fields import STRICT_MODEL_CONFIG, DurationS, invalid_value
from netem.profile import LinkProfile

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
        return str(ipaddress.ip_address(str(value)))
    except ValueError:
        raise invalid_value(
            "address", f"{value!r} is not an IP address", "the data plane needs a literal IP, e.g. 10.0.0.11"
        ) from None


Name = Annotated[str, Field(pattern=NAME_PATTERN)]
SafePath = Annotated[str, Field(pattern=PATH_PATTERN)]
Address = Annotated[str, BeforeValidator(_address)]
IpAddress = Annotated[str, BeforeValidator(_ip)]


class _Strict(BaseModel):
    model_config = STRICT_MODEL_CONFIG


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
    # How delay, jitter and loss are applied: netem (a tc qdisc), nfqueue (iptables and a user-space
    # handler, for kernels without sch_netem), or auto (netem where the node's kernel has it).
    delay_path: Literal["auto", "netem", "nfqueue"] = "auto"

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
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}(@[0-9]{1,9})?$")]  # phones: GOVERNOR@KHZ
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
    instance: EmulationInstance | None = None


class EndpointSpec(_Strict):
    """An OpenAI-compatible server the lab runs (vLLM, llama.cpp's server, ...), that DiSCo's devices
    can race against (a campaign's ``dispatch.external``). Its key, if it needs one, is read from the
    environment variable ``api_key_env`` on the controller when a run starts: never written here."""

    url: str
    model: Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/@+-]+$")] = "default"
    api_key_env: Annotated[str, Field(pattern=ENV_PATTERN)] | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or re.search(r"[\s'\"`$;]", url):
            raise ValueError(f"{url!r} is not an http:// or https:// URL; write e.g. http://10.50.0.2:8000/v1")
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
    nodes: tuple[NodeSpec, ...] = Field(min_length=1)
    groups: dict[Name, tuple[Name, ...]] = {}
    link_profiles: dict[Name, LinkProfile] = {}
    links: tuple[LinkSpec, ...] = ()
    endpoints: dict[Name, EndpointSpec] = {}  # OpenAI-compatible servers of the lab, by name


class LinksFileSpec(_Strict):
    """A file given to ``testbed link apply --links``: links (and optionally more profiles) that
    replace the inventory's links for one apply."""

    link_profiles: dict[Name, LinkProfile] = {}
    links: tuple[LinkSpec, ...] = Field(min_length=1)
