"""A campaign's expansion: matrix points x repetitions, each run's seed and content-hash id, and the
order (shuffled by the campaign seed unless ``order: listed``, then grouped so that runs of one worker
shape are adjacent and a warm pool serves them in a row). Within one repetition every matrix point
gets the same workload seed: methods are compared on identical requests.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from foundation.errors import InputProblem
from foundation.seeds import derive_seed
from foundation.user_files import FieldPath, YamlSource, field_name
from testbed.campaign.spec import POOL_SHAPE, CampaignSpec, PlannedRun, RunSettings, worker_shape
from testbed.inventory import pydantic_problem

if TYPE_CHECKING:
    from testbed.campaign.validation import SettingsChecker


def run_id_of(settings: RunSettings, repetition: int, seed: int) -> str:
    dumped = settings.model_dump(mode="json")
    if dumped.get("target") is None:  # runs without a target keep the ids they had before it existed
        dumped.pop("target", None)
    if dumped.get("device_slots") == 1:  # and runs with one slot a device, before slots existed
        dumped.pop("device_slots", None)
    for section in ("serving", "dispatch", "scaling"):  # and runs of methods without an engine, dispatch or GPU ranks
        if dumped.get(section) is None:
            dumped.pop(section, None)
    for field in ("qoe_draw", "output_lengths"):  # and workloads with the preset's speed, a fixed output length
        if dumped.get("workload", {}).get(field) is None:
            dumped["workload"].pop(field, None)
    body = json.dumps({"settings": dumped, "repetition": repetition, "seed": seed}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:12]


MatrixPoint = tuple[tuple[tuple[str, Any], ...], RunSettings]  # (matrix key, value) pairs and the settings


def expand(spec: CampaignSpec, points: Sequence[MatrixPoint]) -> tuple[PlannedRun, ...]:
    """Matrix points x repetitions, ids by content; unless ``listed``, shuffled by the campaign seed and
    then grouped by pool shape (server, devices, stages) and within it by the parts the ranks hold, the
    groups in the order their first run drew (a stable sort: within a group the shuffled order stays)."""
    runs = []
    for repetition in range(spec.repetitions):
        seed = derive_seed(spec.seed, "repetition", repetition)
        for overrides, settings in points:
            runs.append((overrides, settings, repetition, seed))
    if spec.order == "random":
        random.Random(derive_seed(spec.seed, "order")).shuffle(runs)
        first: dict[tuple[Any, ...], int] = {}
        for index, (_o, settings, _r, _s) in enumerate(runs):
            first.setdefault(worker_shape(settings)[:POOL_SHAPE], index)  # the pool's shape
            first.setdefault(worker_shape(settings), index)  # within it, the parts its ranks hold
        runs.sort(key=lambda r: (first[worker_shape(r[1])[:POOL_SHAPE]], first[worker_shape(r[1])]))
    planned = []
    seen: set[str] = set()
    for overrides, settings, repetition, seed in runs:
        run_id = run_id_of(settings, repetition, seed)
        if run_id in seen:
            continue  # two matrix points that resolve to the same settings are one run
        seen.add(run_id)
        planned.append(PlannedRun(run_id, len(planned), repetition, seed, overrides, settings))
    return tuple(planned)


def matrix_points(
    spec: CampaignSpec, source: YamlSource, checker: SettingsChecker, problems: list[InputProblem]
) -> Iterable[MatrixPoint]:
    """Every combination of matrix values applied to ``base``; a value that makes invalid settings
    is reported at its own line."""
    keys = list(spec.matrix)
    for key in keys:
        values = spec.matrix[key]
        if not values:
            problems.append(source.problem(("matrix", key), "an empty list of values", "give at least one value"))
        for index, value in enumerate(values):
            settings, errors = apply_overrides(spec.base, [(key, value)], source, ("matrix", key, index))
            problems += errors
            if settings is not None:
                problems += checker.check(settings, ("matrix", key, index), only_under=key)
    if problems:
        return
    for combination in itertools.product(*(spec.matrix[k] for k in keys)):
        overrides = tuple(zip(keys, combination, strict=True))
        settings, errors = apply_overrides(spec.base, list(overrides), source, ("matrix",))
        combo = ", ".join(f"{k}={v}" for k, v in overrides)
        for e in errors:
            problems.append(InputProblem(e.file, e.line, "matrix", f"{combo}: {e.problem}", e.hint))
        if settings is None:
            continue
        for e in checker.check(settings, ("matrix",)):
            problems.append(InputProblem(e.file, e.line, "matrix", f"{combo}: {e.problem}", e.hint))
        yield overrides, settings


def apply_overrides(
    base: RunSettings, overrides: Sequence[tuple[str, Any]], source: YamlSource, at: FieldPath
) -> tuple[RunSettings | None, list[InputProblem]]:
    data = base.model_dump(mode="json")
    for key, value in overrides:
        parts = key.split(".")
        target = data
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):  # a section the base leaves unset (None): the key sets it
                target[part] = {}
            target = target[part]
        target[parts[-1]] = _plain(value)
    try:
        return RunSettings.model_validate(data), []
    except ValidationError as exc:
        out = []
        for err in exc.errors():
            problem = pydantic_problem(source, {**err, "loc": ()}, "examples/campaigns/demo.yaml")
            field = field_name(tuple(p for p in err["loc"] if isinstance(p, (str, int))))
            out.append(InputProblem(str(source.path), source.line_of(at), field_name(at),
                                    f"{field}: {problem.problem}", problem.hint))  # fmt: skip
        return None, out


def _plain(value: Any) -> Any:
    """ruamel's commented containers as plain dicts and lists."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
