"""Groups and links expanded: each group to its nodes (in the inventory's order), each link to the
directions it shapes, one profile per direction."""

from __future__ import annotations

from collections.abc import Iterable

from netem.profile import DirectedLink
from testbed.inventory.schema import InventorySpec


def expand_groups(spec: InventorySpec) -> dict[str, tuple[str, ...]]:
    order = [n.name for n in spec.nodes]

    def members(name: str) -> set[str]:
        if name not in spec.groups:
            return {name}
        out: set[str] = set()
        for member in spec.members_of(name):
            out |= members(member)
        return out

    expanded = {g: tuple(n for n in order if n in members(g)) for g in spec.groups}
    expanded["all"] = tuple(order)
    return expanded


def link_pairs(spec: InventorySpec, groups: dict[str, tuple[str, ...]]) -> Iterable[tuple[int, str, str]]:
    for i, link in enumerate(spec.links):
        sources = groups.get(link.source, (link.source,))
        destinations = groups.get(link.destination, (link.destination,))
        for s in sources:
            for d in destinations:
                if s == d:
                    continue
                yield i, s, d
                if link.symmetric:
                    yield i, d, s


def expand_links(spec: InventorySpec, groups: dict[str, tuple[str, ...]]) -> tuple[DirectedLink, ...]:
    out: dict[tuple[str, str], DirectedLink] = {}
    for i, s, d in link_pairs(spec, groups):
        name = spec.links[i].profile
        out.setdefault((s, d), DirectedLink(s, d, name, spec.link_profiles[name]))
    return tuple(out.values())
