"""What reproducing a paper means here: its experiments (a bench script and its arguments per scale, and
the code its result depends on) and its headlines (the paper's number, and where ours is in a result).

Scales: ``smoke`` (a few minutes: the pipeline end to end, what the tests run), ``reduced`` (tens of
minutes a paper on this 2-core machine) and ``full`` (the paper's sizes as far as this machine allows;
hours, resumable). A page shows each experiment's scale.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from analysis.uncertainty import Interval

SCALES = ("smoke", "reduced", "full")
# What every experiment's result depends on besides its own script and what it names.
COMMON_CODE = ("bench/_common.py", "foundation")
# A campaign experiment (bench/campaign_reproduction.py): the controller but its command line, and the
# node code it deploys, workloads and links, which run in other processes than the script's; the analysis
# its summary computes is in the script's import closure. The paper adds its campaign files, inventories
# and models.
CAMPAIGN_CODE = ("testbed", "!testbed/cli", "nodes", "workloads", "netem")

Result = Mapping[str, Any]
REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("analysis", "bench", "foundation", "netem", "nodes", "testbed", "workloads")


@cache
def import_closure(script: str) -> tuple[str, ...]:
    """The project's modules ``script`` imports, directly or through another (every package's
    ``__init__`` on the way included), as paths from the checkout: what its result can depend on even
    when its experiment does not name it."""

    def module_path(name: str) -> Path | None:
        base = REPO.joinpath(*name.split("."))
        return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)

    def imported(path: Path) -> list[str]:
        package = path.relative_to(REPO).parts[:-1]  # a module's package; an __init__.py's own
        try:
            tree = ast.parse(path.read_text())
        except (OSError, SyntaxError, ValueError):  # a leaf: the code hash names what is wrong with it
            return []
        names = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                names += [module, *(f"{module}.{a.name}" for a in node.names)]
        return names

    seen: set[Path] = set()
    todo = [REPO / script]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in imported(path):
            parts = name.split(".")
            if parts[0] not in PACKAGES:
                continue
            found = (module_path(".".join(parts[:i])) for i in range(1, len(parts) + 1))
            todo += [p for p in found if p is not None and p not in seen]
    return tuple(sorted(str(p.relative_to(REPO)) for p in seen))


@dataclass(frozen=True)
class Experiment:
    """One result file: ``python SCRIPT ARGS...`` with the arguments of a scale (a scale it lacks is not
    run at that scale). ``code``: the files and folders the result depends on (with its script and
    :data:`COMMON_CODE`); their hash, recorded with the result, says when it is stale."""

    name: str
    what: str
    script: str
    scales: Mapping[str, tuple[str, ...]]
    code: tuple[str, ...] = ()
    gpu: bool = False  # needs a GPU: skipped, and said so, where there is none
    # runs a campaign through bench/campaign_reproduction.py (its script takes --work and --resume): a
    # campaign cut short goes on with ``testbed reproduce --resume``
    resumable: bool = False

    def depends_on(self) -> tuple[str, ...]:
        """Its script, what the script imports, :data:`COMMON_CODE` and ``code`` (whose ``!`` paths leave
        a folder's files out, imported or not)."""
        return tuple(dict.fromkeys((self.script, *import_closure(self.script), *COMMON_CODE, *self.code)))


def interval_text(data: Mapping[str, float], form: str) -> str:
    """A result's interval (``as_dict``'s keys) as findings quote it: ``estimate [low, high]`` in ``form``."""
    interval = Interval.from_dict(dict(data))
    return f"{interval.estimate:{form}} [{interval.low:{form}}, {interval.high:{form}}]"


@dataclass(frozen=True)
class Headline:
    """One number of the paper (``figure``, ``quantity``, ``paper`` in ``unit``) and how to read ours from
    ``experiment``'s result (None when the result lacks it). See :mod:`analysis.reproduction` for
    ``no_effect`` and the verdicts."""

    figure: str
    quantity: str
    unit: str
    paper: float
    experiment: str
    ours: Callable[[Result], Interval | None]
    no_effect: float | None = 0.0
    note: str = ""
    x: float | None = None
    series: str = ""
    at_most: bool = False  # ``paper`` is a bound ours should stay under (a premise), not a value to match


@dataclass(frozen=True)
class Paper:
    key: str  # the command's argument and the page's name: hat, andes, disco, llms, cocoserve
    title: str
    citation: str
    experiments: tuple[Experiment, ...]
    headlines: tuple[Headline, ...]
    modeled: tuple[str, ...] = field(default=())  # inputs that are modeled and what they decide
    # measured findings that say why a headline lands where it does: each reads the experiments' results
    # (name -> result, None where none) and gives its lines, each with the experiment it rests on (none
    # when a result it needs is missing)
    findings: tuple[Callable[[Mapping[str, Result | None]], list[tuple[str, str]]], ...] = field(default=())

    def experiment(self, name: str) -> Experiment:
        for experiment in self.experiments:
            if experiment.name == name:
                return experiment
        raise KeyError(f"{self.key} has no experiment {name}")


# -- reading ours from a campaign_reproduction result -------------------------------------------------


def _matches(row: Mapping[str, Any], settings: Mapping[str, Any]) -> bool:
    return all(row.get(k) == v for k, v in settings.items())


def campaign_change(metric: str, settings: Mapping[str, Any]) -> Callable[[Result], Interval | None]:
    """The change of ``metric`` ("ttft", "tbt", "qoe") of the group with ``settings`` against its baseline
    in a bench/campaign_reproduction.py result, in percent."""

    def read(result: Result) -> Interval | None:
        for row in result.get("changes", []):
            if _matches(row["settings"], settings) and f"{metric}_change" in row:
                return Interval.from_dict(row[f"{metric}_change"]).scaled(100.0)
        return None

    return read


def campaign_mean(metric: str, settings: Mapping[str, Any]) -> Callable[[Result], Interval | None]:
    """The mean ``metric`` ("ttft_ms", "tbt_ms", "qoe") of the group with ``settings``."""

    def read(result: Result) -> Interval | None:
        for row in result.get("groups", []):
            if _matches(row["settings"], settings) and metric in row:
                return Interval.from_dict(row[metric])
        return None

    return read
