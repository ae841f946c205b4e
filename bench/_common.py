"""What every benchmark records next to its numbers: the machine and the versions."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any

from foundation.provenance import git_provenance

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """The machine, the versions, and the code (commit, uncommitted changes and their hash)."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "paramiko": version("paramiko"),
        "fabric": version("fabric"),
        "git": git_provenance(),
    }


def machine_cpu_s() -> float:
    """CPU seconds used by the whole machine so far (all processes, all cores), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def summary(samples: list[float]) -> dict[str, float]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def affine_fit(xs: list[float], ys: list[float]) -> dict[str, float]:
    """Least squares y = intercept + slope x, with R^2 (1 when every y is the same)."""
    import numpy as np

    x, y = np.asarray(xs, float), np.asarray(ys, float)
    slope, intercept = np.polyfit(x, y, 1)
    total = float(((y - y.mean()) ** 2).sum())
    residual = float(((y - (intercept + slope * x)) ** 2).sum())
    return {"intercept": float(intercept), "slope": float(slope), "r2": 1.0 - residual / total if total else 1.0}


def write(name: str, payload: dict[str, Any]) -> Path:
    """``bench/results/NAME.json``, or NAME itself when it is a path ending in .json."""
    path = Path(name) if name.endswith(".json") else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2) + "\n")
    return path


def emulated_node(name: str, kind: str, model: str, role: str | None = None,
                  modes: Sequence[tuple[int, str, float, float, float]] = ((0, "MAXN", 1.0, 7.0, 40.0),),
                  initial_mode: int | None = None) -> str:  # fmt: skip
    """One emulated node as an inventory's YAML flow mapping; ``modes``: (id, name, cpus, idle_w, busy_w)."""
    power = ", ".join(f"{{id: {i}, name: {n}, cpus: {c:g}, idle_w: {idle:g}, busy_w: {busy:g}}}"
                      for i, n, c, idle, busy in modes)  # fmt: skip
    emulated = ("" if initial_mode is None else f"initial_mode: {initial_mode}, ") + f"power_modes: [{power}]"
    roles = f", roles: [{role}]" if role else ""
    return f"{{name: {name}, kind: {kind}, model: {model}{roles}, emulated: {{{emulated}}}}}"


def emulated_inventory(state_dir: Path, prefix: str, octet: int, nodes: Sequence[str], rest: str = "") -> str:
    """An inventory of emulated ``nodes`` (:func:`emulated_node`) managed on 10.OCTET.0.0/24 with their
    data plane on 10.OCTET+1.0.0/24, under ``state_dir``; ``rest``: more top-level YAML (groups, links)."""
    return ("defaults: {ssh: {user: root, connect_timeout: 10s}, python: python3, sudo: false}\n"
            f"emulation: {{management_subnet: 10.{octet}.0.0/24, data_subnet: 10.{octet + 1}.0.0/24, "
            f"name_prefix: {prefix}, state_dir: {state_dir}}}\n"
            "nodes:\n" + "".join(f"  - {node}\n" for node in nodes) + rest)  # fmt: skip


@contextmanager
def emulated_lab(inventory_text: Callable[[Path], str]) -> Iterator[Any]:
    """A throwaway emulated testbed: ``inventory_text(state_dir)`` brought up, yielded resolved, taken down."""
    from testbed.emulation.lifecycle import down, up
    from testbed.emulation.resolved import load_lab
    from testbed.inventory import load_inventory

    if os.geteuid() != 0:
        raise SystemExit("needs root: the emulated testbed builds network namespaces")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "inventory.yaml"
        path.write_text(inventory_text(Path(tmp) / "state"))
        up(load_inventory(path), say=lambda _: None)
        try:
            yield load_lab(path)
        finally:
            if down(load_inventory(path), say=lambda _: None):
                print("warning: emulate down left something behind", file=sys.stderr)
