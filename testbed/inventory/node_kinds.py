"""Node kinds: one row per kind, which the controller asks instead of testing a node's ``kind``.

A row says how the kind's nodes are reached (over SSH, or with adb from the Linux node or controller
they are plugged into: a *USB host*), and from that whether they run tc, MPI ranks and Python tools of
their own and are provisioned; which node-side power driver they take (``nodes/power/<driver>.py``) and
how their power modes are written; which telemetry sources sample them; the board family they belong
to, if any (its models, what its device tree says, JetPack's torch, the stand-in tools an emulated one
gets); and what their emulated stand-ins are, for the manifests.

Adding a kind is one :func:`register` call, here or in a lab's own module named by the environment
variable ``TESTBED_NODE_KINDS`` (imported before the first kind or delay path is looked up: such a
module may also register a delay path, :func:`netem.delay_path.register`), and, when it brings its
own power driver or telemetry source, that module on the node side (``nodes/power/<driver>.py``,
``nodes/telemetry/<source>.py``). Nothing else in the controller names a kind.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from foundation.errors import TestbedError
from foundation.lab_modules import import_lab_modules

if TYPE_CHECKING:
    from testbed.inventory.schema import NodeSpec


@dataclass(frozen=True)
class PowerModeSyntax:
    """How a kind's power modes are written in inventories and campaigns (its driver takes nothing else)."""

    pattern: re.Pattern[str]
    example: str
    ids_are_numbers: bool = False  # a mode's id is a number: a name of digits alone cannot be told from one
    listed_by_driver: bool = False  # the driver lists every mode it takes: check a mode against that list first

    def problem(self, kind: str, mode: str) -> str | None:
        """Why ``mode`` cannot be a power mode of a node of ``kind`` (None: it can)."""
        return None if self.pattern.match(mode) else f"{mode!r} is not a power mode of a {kind}: write {self.example}"


@dataclass(frozen=True)
class BoardFamily:
    """Boards whose model the inventory names and the node's device tree confirms (NVIDIA's Jetsons)."""

    name: str  # as a person says it: "Jetson"
    models: tuple[str, ...]  # the inventory's names for them
    device_tree_names: Mapping[str, tuple[str, ...]]  # model -> what /proc/device-tree/model may contain
    release_file: str  # the OS image's release file (L4T's), its absence a problem
    system_torch: bool  # torch comes with the OS image (JetPack's), never from PyPI
    standin_tools: tuple[str, ...]  # the tools an emulated board gets stand-ins of, on its PATH
    service: str = ""  # the systemd unit of the board's optional telemetry service (jtop), read when probing
    service_hint: str = ""  # the warning when that service is not active


@dataclass(frozen=True)
class NodeKind:
    name: str
    summary: str
    power_driver: str  # nodes/power/<driver>.py (``none``: no power modes)
    power_modes: PowerModeSyntax
    telemetry: Callable[[NodeSpec, str], tuple[str, ...]]  # (node, the campaign's Jetson source) -> sampler sources
    stand_ins: str  # what an emulated node of this kind runs instead of the real tools (manifests)
    via_usb_host: bool = False  # reached with adb from its USB host: no SSH, tc, Python, ranks or provisioning
    boards: BoardFamily | None = None
    discrete_gpus: bool = False  # nvidia-smi lists its GPUs: the inventory's ``gpus`` counts them
    wheel_extras: tuple[str, ...] = ()  # the node wheel's extras it installs

    @property
    def system_torch(self) -> bool:
        """Its torch comes with the board's OS image (JetPack's), never from PyPI."""
        return self.boards is not None and self.boards.system_torch

    @property
    def reached_by_ssh(self) -> bool:
        return not self.via_usb_host

    @property
    def shapes_links(self) -> bool:
        """Holds qdiscs and iptables rules (a phone does not: its receivers shape its traffic)."""
        return not self.via_usb_host

    @property
    def runs_ranks(self) -> bool:
        """Runs MPI ranks, the node tools and their Python (provisioned with the node code)."""
        return not self.via_usb_host


_KINDS: dict[str, NodeKind] = {}
LAB_KINDS_VARIABLE = "TESTBED_NODE_KINDS"


def _load_lab_kinds() -> None:
    """Import the modules ``TESTBED_NODE_KINDS`` names (comma-separated), once: they register a lab's kinds."""
    import_lab_modules(LAB_KINDS_VARIABLE, "node kinds")


def register(kind: NodeKind) -> NodeKind:
    """Add ``kind`` (a name already taken is refused: a lab's kind never replaces a built-in one silently)."""
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        raise ValueError(f"node kind {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def delay_path_names() -> tuple[str, ...]:
    """The delay paths an inventory may name (:mod:`netem.delay_path`), a lab's own among them."""
    from netem.delay_path import names

    _load_lab_kinds()
    return names()


def kind_names() -> tuple[str, ...]:
    _load_lab_kinds()
    return tuple(_KINDS)


def node_kind(name: str) -> NodeKind:
    _load_lab_kinds()
    try:
        return _KINDS[name]
    except KeyError:
        raise KeyError(f"unknown node kind {name!r}; known: {', '.join(_KINDS)}") from None


def kind_of(node: NodeSpec) -> NodeKind:
    return node_kind(node.kind)


def host_of(node: NodeSpec) -> str:
    """The node whose transport runs ``node``'s commands: itself, or a phone's USB host (which may be
    ``controller``)."""
    if kind_of(node).via_usb_host:
        assert node.adb is not None
        return node.adb.usb_host
    return node.name


# -- the built-in kinds ------------------------------------------------------------------------------

JETSON_SOURCES = {"tegrastats": "jetson", "jtop": "jtop"}  # the campaign's choice -> the sampler's source


def _jetson_sources(node: NodeSpec, choice: str) -> tuple[str, ...]:
    """tegrastats (the stand-in on emulated boards), or the jtop service where the lab runs it."""
    if choice not in JETSON_SOURCES:
        raise TestbedError(f"unknown Jetson telemetry source {choice!r}; use tegrastats or jtop")
    return (JETSON_SOURCES[choice],)


def _server_sources(node: NodeSpec, choice: str) -> tuple[str, ...]:
    """NVML and the host's CPUs and RAPL; an emulated server: its cgroup and power model."""
    if node.emulated is not None:
        return ("emulated",)
    return ("nvml", "host") if node.gpus else ("host",)


JETSON = register(NodeKind(
    name="jetson",
    summary="an NVIDIA Jetson board over SSH: nvpmodel power modes, tegrastats or jtop telemetry",
    power_driver="jetson",
    power_modes=PowerModeSyntax(
        re.compile(r"^(?:[0-9]{1,3}|[A-Za-z][A-Za-z0-9_.-]{0,31}|[0-9]+[A-Za-z_][A-Za-z0-9_.-]{0,30})$"),
        "an nvpmodel mode's id or name, e.g. 0 or MAXN or MODE_15W", ids_are_numbers=True, listed_by_driver=True),
    telemetry=_jetson_sources,
    stand_ins="stand-in nvpmodel, jetson_clocks and tegrastats; power modes are CPU quotas",
    boards=BoardFamily(
        name="Jetson",
        models=("agx-orin", "agx-xavier", "orin-nx", "orin-nano", "xavier-nx"),
        device_tree_names={"agx-orin": ("AGX Orin",), "agx-xavier": ("AGX Xavier", "Jetson-AGX"),
                           "orin-nx": ("Orin NX",), "orin-nano": ("Orin Nano",), "xavier-nx": ("Xavier NX",)},
        release_file="/etc/nv_tegra_release",
        system_torch=True,
        standin_tools=("nvpmodel", "jetson_clocks", "tegrastats"),
        service="jtop",
        service_hint="the jtop service is not active (needed only for --jetson-source jtop): "
                     "sudo systemctl enable --now jtop",
    ),
    wheel_extras=("jetson",),
))  # fmt: skip

SERVER = register(NodeKind(
    name="server",
    summary="a Linux server over SSH, with NVIDIA GPUs or without: NVML power limits, NVML and host telemetry",
    power_driver="server",
    power_modes=PowerModeSyntax(re.compile(r"^(?:default|[0-9]{1,5}(?:\.[0-9]{1,3})?[Ww])$"),
                                "default, or a GPU power limit in watts such as 250W"),
    telemetry=_server_sources,
    stand_ins="no GPU; its power is modeled from the cgroup's CPU use",
    discrete_gpus=True,
    wheel_extras=("server",),
))  # fmt: skip

ANDROID = register(NodeKind(
    name="android",
    summary="an Android phone, reached with adb from its USB host: CPU frequency policies, battery telemetry",
    power_driver="android",
    power_modes=PowerModeSyntax(re.compile(r"^[a-z][a-z_]{0,31}(?:@[1-9][0-9]{2,7})?$"),
                                "GOVERNOR or GOVERNOR@KHZ, e.g. schedutil or powersave@1803000"),
    telemetry=lambda node, choice: ("android",),
    stand_ins="stand-in adb and battery files",
    via_usb_host=True,
))  # fmt: skip
