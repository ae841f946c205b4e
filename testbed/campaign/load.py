"""Loading a campaign file: read it with its line numbers, validate it (shape, matrix keys, every
run's settings against the inventory), expand it; every problem at once as :class:`InputError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from foundation.errors import InputError, InputProblem
from foundation.user_files import YamlSource, beside
from testbed.campaign.expansion import expand, matrix_points
from testbed.campaign.spec import MAX_RUNS, Campaign, CampaignSpec
from testbed.campaign.validation import SettingsChecker, matrix_key_problems, relative_path, unused_setting_problems
from testbed.emulation.resolved import load_lab
from testbed.inventory import pydantic_problem

CAMPAIGN_EXAMPLE = "examples/campaigns/demo.yaml"


def load_campaign(path: str | Path, *, inventory: str | Path | None = None) -> Campaign:
    """Read, validate and expand a campaign file; every problem at once as :class:`InputError`."""
    source = YamlSource.load(path)
    if not isinstance(source.data, dict):
        raise InputError([source.problem((), "a campaign must be a mapping with 'name' and 'base'",
                                         f"see {CAMPAIGN_EXAMPLE}")])  # fmt: skip
    problems = source.text_problems()
    try:
        spec = CampaignSpec.model_validate(source.data)
    except ValidationError as exc:
        raise InputError(beside(problems, [pydantic_problem(source, err, CAMPAIGN_EXAMPLE) for err in exc.errors()])) \
            from None
    count = spec.repetitions * math.prod(len(values) for values in spec.matrix.values())
    if count > MAX_RUNS:
        problems.append(source.problem(("matrix",), f"the matrix x {spec.repetitions} repetitions is {count} runs, "
                                       f"more than a campaign may have ({MAX_RUNS})", "split it into campaigns"))
    if problems:
        raise InputError(problems)
    inventory_path = Path(inventory) if inventory is not None else relative_path(source.path, spec.inventory)
    if not inventory_path.is_file():
        where = () if inventory is not None else ("inventory",)
        raise InputError([source.problem(where, f"inventory {inventory_path} does not exist",
                                         "give the inventory's path relative to the campaign file")])  # fmt: skip
    lab = load_lab(inventory_path)
    problems = list(matrix_key_problems(spec, source, lab))
    if problems:
        raise InputError(problems)
    checker = SettingsChecker(source, lab)
    problems += checker.check(spec.base, ("base",))
    points = list(matrix_points(spec, source, checker, problems))
    if not problems:
        problems += unused_setting_problems(spec, source, [settings for _overrides, settings in points])
    if problems:
        raise InputError(_unique(problems))
    runs = expand(spec, points)
    return Campaign(source.path, spec, lab, runs)


def _unique(problems: Iterable[InputProblem]) -> list[InputProblem]:
    return list(dict.fromkeys(problems))


