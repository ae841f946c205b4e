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

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from foundation.errors import InputError, InputProblem
from foundation.user_files import YamlSource, field_name
from nodes.contracts.compute_profile import ModeRates
from testbed.inventory.validation import pydantic_problem

PROFILES_DIR = Path(__file__).resolve().parent.parent / "examples" / "profiles"
PROFILE_EXAMPLE = "examples/profiles/agx-orin.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DiskSpec(_Strict):
    read_mbps: float = Field(gt=0)
    write_mbps: float = Field(gt=0)
    io_latency_ms: float = Field(ge=0)


class PeakSpec(_Strict):
    mem_bw_gbps: float = Field(gt=0)
    tflops: float = Field(gt=0)
    gpu_mhz: float | None = Field(default=None, gt=0)
    emc_mhz: float | None = Field(default=None, gt=0)
    tpcs: int | None = Field(default=None, gt=0)


class EfficiencySpec(_Strict):
    bw: float = Field(gt=0, le=1)
    flops: float = Field(gt=0, le=1)
    quantized_flops: float | None = Field(default=None, gt=0, le=1)
    sharpness: float = Field(default=2.0, ge=1)
    step_overhead_ms: float = Field(default=0.0, ge=0)
    layer_overhead_ms: float = Field(default=0.0, ge=0)
    prefill_overhead_ms: float = Field(default=0.0, ge=0)
    sequence_overhead_ms: float = Field(default=0.0, ge=0)  # per sequence of a step (a serving framework's)


class ModeSpec(_Strict):
    gpu_mhz: float | None = Field(default=None, gt=0)
    emc_mhz: float | None = Field(default=None, gt=0)
    tpcs: int | None = Field(default=None, gt=0)
    efficiency: EfficiencySpec | None = None  # replaces the file's for this mode


class ProfileSpec(_Strict):
    hardware: str
    description: str = ""
    memory_gb: float = Field(gt=0)
    host_link_gbps: float = Field(gt=0)
    disk: DiskSpec
    peak: PeakSpec
    efficiency: EfficiencySpec
    modes: dict[str, ModeSpec] = Field(min_length=1)
    sources: dict[str, str]


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
    """Read and validate a profile file; every problem at once as :class:`InputError`."""
    source = YamlSource.load(path)
    if not isinstance(source.data, dict):
        raise InputError([source.problem((), "a compute profile must be a mapping", f"see {PROFILE_EXAMPLE}")])
    try:
        spec = ProfileSpec.model_validate(source.data)
    except ValidationError as exc:
        raise InputError([pydantic_problem(source, err, PROFILE_EXAMPLE) for err in exc.errors()]) from None
    problems = list(_unsourced(source, spec))
    for name, mode in spec.modes.items():
        for clock, base in (("gpu_mhz", spec.peak.gpu_mhz), ("emc_mhz", spec.peak.emc_mhz), ("tpcs", spec.peak.tpcs)):
            if getattr(mode, clock) is not None and base is None:
                problems.append(source.problem(("modes", name, clock), f"peak.{clock} is not given",
                                               f"give peak.{clock}, the clock the peak numbers are at"))  # fmt: skip
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

