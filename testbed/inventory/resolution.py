"""From a file to an :class:`Inventory`: load, validate (shapes, then what spans fields), expand
groups and links; and a links file resolved against an inventory."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from foundation.errors import InputError
from foundation.user_files import YamlSource, beside
from netem.profile import DirectedLink
from testbed.inventory.expansion import expand_groups, expand_links
from testbed.inventory.host_ranges import expand_ranges
from testbed.inventory.model import Inventory
from testbed.inventory.schema import InventorySpec, LinksFileSpec
from testbed.inventory.validation import (
    cross_check,
    link_problems,
    profile_problems,
    pydantic_problem,
    secret_problems,
    spec_problems,
)

LINKS_EXAMPLE = "examples/links/wifi-delay.yaml"


def load_inventory(path: str | Path) -> Inventory:
    """Load and validate ``path``; raise :class:`InputError` listing every problem found."""
    return inventory_from_source(YamlSource.load(path))


def inventory_from_source(source: YamlSource) -> Inventory:
    """Validate a loaded file: secrets, then host ranges expanded, then shapes, then what spans fields;
    then groups and links expanded."""
    problems = list(secret_problems(source, source.data, ())) + source.text_problems()
    if source.data is None or not isinstance(source.data, dict):
        problems.append(
            source.problem(
                (), "the inventory must be a mapping with a 'nodes' list", "see examples/inventories/lab.yaml"
            )
        )
        raise InputError(problems)
    source, range_problems = expand_ranges(source)
    if range_problems:
        raise InputError(problems + range_problems)
    try:
        spec = InventorySpec.model_validate(source.data)
    except ValidationError as exc:
        raise InputError(beside(problems, spec_problems(source, exc.errors()))) from None
    if problems:
        raise InputError(problems)
    problems = list(cross_check(spec, source))
    if problems:
        raise InputError(problems)
    groups = expand_groups(spec)
    return Inventory(source.path, spec, groups, expand_links(spec, groups))


def links_from_file(inventory: Inventory, path: str | Path) -> tuple[DirectedLink, ...]:
    """The directed links of a links file, checked against the inventory's nodes, groups and
    profiles; problems name the links file's lines."""
    source = YamlSource.load(path)
    if not isinstance(source.data, dict):
        raise InputError([source.problem((), "a links file must be a mapping with a 'links' list",
                                         f"see {LINKS_EXAMPLE}")])  # fmt: skip
    problems = source.text_problems()
    try:
        extra = LinksFileSpec.model_validate(source.data)
    except ValidationError as exc:
        raise InputError(beside(problems, [pydantic_problem(source, err, LINKS_EXAMPLE) for err in exc.errors()])) \
            from None
    for name, profile in extra.link_profiles.items():
        problems += list(profile_problems(name, profile, source))
        if name in inventory.spec.link_profiles:
            problems.append(
                source.problem(("link_profiles", name), f"profile {name!r} is already defined in {inventory.path}",
                               "give it another name")
            )  # fmt: skip
    spec = inventory.spec.model_copy(
        update={"link_profiles": {**inventory.spec.link_profiles, **extra.link_profiles}, "links": extra.links}
    )
    problems += list(link_problems(spec, source, {n.name for n in spec.nodes}, True))
    if problems:
        raise InputError(problems)
    return expand_links(spec, inventory.groups)
