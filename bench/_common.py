"""What every benchmark records next to its numbers: the machine and the versions."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from foundation.provenance import git_provenance

RESULTS = Path(__file__).resolve().parent / "results"


def _version(package: str) -> str | None:
    """An installed package's version; None where it is absent (a lab's GPU server holds the node side only)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The machine, the versions, and the code (commit, uncommitted changes and their hash)."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "paramiko": _version("paramiko"),
        "fabric": _version("fabric"),
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


RESULT_PATH_VARIABLE = "BENCH_RESULT_PATH"  # set by `testbed reproduce`: where an experiment's result goes


def write(name: str, payload: dict[str, Any]) -> Path:
    """``bench/results/NAME.json``, or NAME itself when it is a path ending in .json; when a reproduction
    runs the bench, the path it names in ``$BENCH_RESULT_PATH`` instead."""
    named = os.environ.get(RESULT_PATH_VARIABLE)
    path = Path(named) if named else Path(name) if name.endswith(".json") else RESULTS / f"{name}.json"
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


def left_on_nodes(prefix: str, state: Path) -> list[str]:
    """What a campaign may leave set on an emulated lab's nodes (``prefix``, its ``state`` directory):
    qdiscs on the data interface, our iptables chains, a power mode other than the first, link and power
    journals, delay handlers still running and root's files of them. Empty when nothing is left."""
    from testbed.provisioning.delay_handler import RUN_ROOT

    left = []
    for node in sorted(p.name for p in (state / "nodes").iterdir()):
        ns = ["ip", "netns", "exec", f"{prefix}-{node}"]
        qdiscs = json.loads(subprocess.run([*ns, "tc", "-j", "qdisc", "show", "dev", "data0"], capture_output=True,
                                           text=True, check=True).stdout)  # fmt: skip
        left += [f"{node}: qdisc {q['kind']}" for q in qdiscs if q["kind"] != "noqueue"]
        mangle = subprocess.run([*ns, "iptables", "-w", "-t", "mangle", "-S"], capture_output=True, text=True,
                                check=True).stdout  # fmt: skip
        left += [f"{node}: {line}" for line in mangle.splitlines() if "TB-" in line]
        mode = (state / "nodes" / node / "power_mode").read_text().strip()
        if mode != "0":
            left.append(f"{node}: power mode {mode}")
    left += [str(p) for p in (state / "nodes").glob("*/home/hil-testbed/*/journal.json")]
    for proc in Path("/proc").iterdir():  # the lab's delay handlers (their command lines name its state)
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace") if proc.name.isdigit() else ""
        except OSError:
            continue
        if "link_delay_handler.py" in cmdline and str(state) in cmdline:
            left.append(f"delay handler {proc.name}")
    for rundir in Path(RUN_ROOT).glob("*"):  # root's files of this lab's handlers
        named = rundir / "for"
        if named.is_file() and str(state) in named.read_text(errors="replace"):
            left.append(str(rundir))
    return left
