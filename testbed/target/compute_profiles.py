"""Compute profile files (``examples/profiles/<hardware>.yaml``): one per hardware, with a source for
every number, validated with ``FILE:LINE: field`` errors, resolved per power mode into the
:class:`~nodes.contracts.compute_profile.ModeRates` that the workers pace with.

A file gives the hardware's peak (memory bandwidth and dense FP16 tensor throughput at its top
clocks), the efficiencies and fixed costs calibrated against published measurements, and its power
modes by their clocks: a mode's bandwidth scales with its memory (EMC) clock, its throughput with its
GPU clock and the share of GPU TPCs it keeps online. It also carries memory capacity (KV budgets),
host-link bandwidth (swap) and disk bandwidth and per-I/O latency (LLMS's chunk store)::

    hardware: agx-orin
    description: NVIDIA Jetson AGX Orin 64GB
    memory_gb: 64
    host_link_gbps: 204.8          # unified memory: "swap to host" is a copy within DRAM
    disk: {read_mbps: 2000, write_mbps: 1500, io_latency_ms: 0.1}
    peak: {mem_bw_gbps: 204.8, tflops: 42.5, gpu_mhz: 1300.5, emc_mhz: 3199, tpcs: 8}
    efficiency: {bw: 0.77, flops: 0.45, quantized_flops: 0.2, sharpness: 2,
                 step_overhead_ms: 0.5, layer_overhead_ms: 0.1}
    modes:
      MAXN: {}
      MODE_15W: {gpu_mhz: 420.8, emc_mhz: 2133, tpcs: 4}
    sources:
      memory_gb: NVIDIA Jetson AGX Orin data sheet
      peak: ...
      modes.MODE_15W: /etc/nvpmodel.conf of L4T 35 (nvpmodel_p3701_0000.conf)
      efficiency: calibrated to MLC's Llama-2-7B decode and prefill on AGX Orin (jetson-containers)

``sources`` keys are dotted field paths; a key covers every number under it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, Field, StrictInt, ValidationError

from foundation.errors import InputError, InputProblem
from foundation.user_fields import STRICT_MODEL_CONFIG, Number
from foundation.user_files import YamlSource, beside, field_name, read_user_text
from nodes.contracts.compute_profile import ModeRates
from testbed.inventory.validation import pydantic_problem

PROFILES_DIR = Path(__file__).resolve().parents[2] / "examples" / "profiles"
PROFILE_EXAMPLE = "examples/profiles/agx-orin.yaml"

# Bounds no real hardware reaches (an H100 has 3.35 TB/s and 990 dense FP16 TFLOP/s): a number beyond
# one is a typo or a unit mistake, and would pace every step at nothing or forever.
MAX_RATE = 100_000.0  # GB/s, TFLOP/s, MHz
# An engine's share of a peak can be tiny and real: this CPU's tiny model against an AGX Orin's GPU
# peak fits at 0.0003 of its FLOP/s (testbed profile without --target).
MIN_EFFICIENCY = 1e-6
Rate = Annotated[Number, Field(ge=0.001, le=MAX_RATE)]
Share = Annotated[Number, Field(ge=MIN_EFFICIENCY, le=1)]
OverheadMs = Annotated[Number, Field(default=0.0, ge=0, le=60_000)]
Count = Annotated[StrictInt, Field(gt=0, le=100_000)]
HARDWARE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
MODE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$"  # nvpmodel names, default, GOVERNOR@KHZ


class _Strict(BaseModel):
    model_config = STRICT_MODEL_CONFIG


class DiskSpec(_Strict):
    read_mbps: Annotated[Number, Field(ge=0.001, le=1_000_000)]
    write_mbps: Annotated[Number, Field(ge=0.001, le=1_000_000)]
    io_latency_ms: Annotated[Number, Field(ge=0, le=60_000)]


class PeakSpec(_Strict):
    mem_bw_gbps: Rate
    tflops: Rate
    gpu_mhz: Rate | None = None
    emc_mhz: Rate | None = None
    tpcs: Count | None = None


class EfficiencySpec(_Strict):
    bw: Share
    flops: Share
    quantized_flops: Share | None = None
    # p of the knee: t = (t_mem^p + t_flop^p)^(1/p) overflows a float for p in the hundreds
    sharpness: Annotated[Number, Field(default=2.0, ge=1, le=16)]
    step_overhead_ms: OverheadMs
    layer_overhead_ms: OverheadMs
    prefill_overhead_ms: OverheadMs
    sequence_overhead_ms: OverheadMs  # per sequence of a step (a serving framework's)


class ModeSpec(_Strict):
    gpu_mhz: Rate | None = None
    emc_mhz: Rate | None = None
    tpcs: Count | None = None
    efficiency: EfficiencySpec | None = None  # replaces the file's for this mode


class ProfileSpec(_Strict):
    hardware: Annotated[str, Field(pattern=HARDWARE_PATTERN)]
    description: Annotated[str, Field(max_length=1000)] = ""
    memory_gb: Annotated[Number, Field(ge=0.001, le=100_000)]
    host_link_gbps: Rate
    disk: DiskSpec
    peak: PeakSpec
    efficiency: EfficiencySpec
    modes: dict[Annotated[str, Field(pattern=MODE_PATTERN)], ModeSpec] = Field(min_length=1, max_length=256)
    sources: dict[Annotated[str, Field(min_length=1, max_length=200)], Annotated[str, Field(max_length=10_000)]]


@dataclass(frozen=True)
class ComputeProfile:
    """A validated profile file."""

    path: Path
    spec: ProfileSpec

    @property
    def hardware(self) -> str:
        return self.spec.hardware

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.spec.modes)

    def rates(self, mode: str | None = None) -> ModeRates:
        """The numbers of ``mode`` (the file's first mode when None)."""
        name = mode if mode is not None else self.modes[0]
        if name not in self.spec.modes:
            raise KeyError(f"{self.path}: no mode {name!r}; it has {', '.join(self.modes)}")
        m, peak = self.spec.modes[name], self.spec.peak
        eff = m.efficiency or self.spec.efficiency
        bw_scale = m.emc_mhz / peak.emc_mhz if m.emc_mhz and peak.emc_mhz else 1.0
        flops_scale = m.gpu_mhz / peak.gpu_mhz if m.gpu_mhz and peak.gpu_mhz else 1.0
        if m.tpcs and peak.tpcs:
            flops_scale *= m.tpcs / peak.tpcs
        return ModeRates(
            mem_bw_gbps=peak.mem_bw_gbps * bw_scale, peak_tflops=peak.tflops * flops_scale,
            bw_efficiency=eff.bw, flops_efficiency=eff.flops, step_overhead_s=eff.step_overhead_ms / 1e3,
            layer_overhead_s=eff.layer_overhead_ms / 1e3, sharpness=eff.sharpness,
            quantized_flops_efficiency=eff.quantized_flops or 0.0, prefill_overhead_s=eff.prefill_overhead_ms / 1e3,
            sequence_overhead_s=eff.sequence_overhead_ms / 1e3,
        )  # fmt: skip


def load_profile(path: str | Path) -> ComputeProfile:
    """Read and validate a profile file; every problem at once as :class:`InputError`. A file read
    before with the same text is not parsed again (a campaign resolves one profile for many nodes)."""
    path = Path(path)
    return _profile_from_text(str(path), read_user_text(path))


@functools.lru_cache(maxsize=64)
def _profile_from_text(path: str, text: str) -> ComputeProfile:
    source = YamlSource.parse(text, path)
    if not isinstance(source.data, dict):
        raise InputError([source.problem((), "a compute profile must be a mapping", f"see {PROFILE_EXAMPLE}")])
    problems = source.text_problems()
    try:
        spec = ProfileSpec.model_validate(source.data)
    except ValidationError as exc:
        raise InputError(beside(problems, [pydantic_problem(source, err, PROFILE_EXAMPLE) for err in exc.errors()])) \
            from None
    problems += list(_unsourced(source, spec))
    for name, mode in spec.modes.items():
        for clock, base in (("gpu_mhz", spec.peak.gpu_mhz), ("emc_mhz", spec.peak.emc_mhz), ("tpcs", spec.peak.tpcs)):
            value = getattr(mode, clock)
            if value is not None and base is None:
                problems.append(source.problem(("modes", name, clock), f"peak.{clock} is not given",
                                               f"give peak.{clock}, the clock the peak numbers are at"))  # fmt: skip
            elif value is not None and base is not None and value > base:
                problems.append(source.problem(("modes", name, clock), f"{value:g} is above peak.{clock} "
                                               f"({base:g})", "the peak numbers are at the top clocks: no mode runs "
                                               "faster"))  # fmt: skip
    if problems:
        raise InputError(problems)
    return ComputeProfile(source.path, spec)


def _numbers(data: Any, path: tuple[str | int, ...]) -> Iterable[tuple[str | int, ...]]:
    if isinstance(data, dict):
        for key, value in data.items():
            if path == () and key == "sources":
                continue
            yield from _numbers(value, (*path, key))
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield path


def _unsourced(source: YamlSource, spec: ProfileSpec) -> Iterable[InputProblem]:
    """Every number whose path (or a parent's) has no entry under ``sources``."""
    cited = {key for key, text in spec.sources.items() if text.strip()}
    for path in _numbers(source.data, ()):
        dotted = [field_name(path[:i]) for i in range(1, len(path) + 1)]
        if not cited.intersection(dotted):
            yield source.problem(path, "this number has no source",
                                 f"add 'sources: {{{field_name(path)}: <where it comes from>}}'")  # fmt: skip


def profile_path(name_or_path: str, base_dir: Path) -> Path:
    """A profile named by hardware (``agx-orin``: ``examples/profiles/agx-orin.yaml``) or by a path
    relative to ``base_dir`` (the inventory's directory)."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return (base_dir / name_or_path).resolve()
    return PROFILES_DIR / f"{name_or_path}.yaml"


def known_profiles() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))

