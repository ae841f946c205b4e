"""Host ranges: one inventory entry for many alike nodes, as Ansible and Slurm write them.

``name: xavier-[01:20]`` makes twenty nodes, xavier-01 to xavier-20 (a leading zero pads every number to
the width of the first). ``address`` and ``data.address`` may carry a range of the same length
(``192.168.50.[11:30]``), paired in order; every other field is the same on each node. A group's members
may name a range too (``near: [orin-[01:04], xavier-[01:07]]``).

Ranges are expanded in the file's data before it is validated, so every later check sees plain nodes; a
problem on an expanded node is reported at its entry's line, naming the node.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from foundation.errors import InputProblem
from foundation.user_files import FieldPath, YamlSource, field_name

RANGE = re.compile(r"\[([0-9]{1,6}):([0-9]{1,6})\]")
RANGED_FIELDS = (("name",), ("address",), ("data", "address"))  # where a node entry may write a range
MAX_EXPANDED = 4096  # as many nodes as an inventory may hold (schema.MAX_NODES)


def expand(text: str) -> list[str] | None:
    """The strings ``text``'s one range stands for (None: it has none). Raises ValueError for a range
    that counts down or a second range."""
    found = list(RANGE.finditer(text))
    if not found:
        return None
    if len(found) > 1:
        raise ValueError("has more than one [first:last] range")
    first, last = found[0].group(1), found[0].group(2)
    if int(last) < int(first):
        raise ValueError(f"counts down ({first} to {last})")
    if int(last) - int(first) >= MAX_EXPANDED:
        raise ValueError(f"stands for {int(last) - int(first) + 1} values; at most {MAX_EXPANDED}")
    width = len(first) if first.startswith("0") and len(first) > 1 else 0
    start, end = found[0].span()
    return [f"{text[:start]}{n:0{width}d}{text[end:]}" for n in range(int(first), int(last) + 1)]


def _get(entry: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(entry, dict) or part not in entry:
            return None
        entry = entry[part]
    return entry


def _set(entry: Any, path: tuple[str, ...], value: str) -> None:
    for part in path[:-1]:
        entry = entry[part]
    entry[path[-1]] = value


@dataclass(frozen=True)
class RangedSource(YamlSource):
    """A file whose ranges were expanded: ``data`` is the expanded document, ``original`` the file's,
    and ``origin[i]`` the file's entry of expanded node ``i`` (its lines are where problems point)."""

    original: Any = None
    origin: tuple[int, ...] = ()
    names: tuple[str, ...] = field(default=())
    member_origin: dict[tuple, tuple[int, ...]] = field(default_factory=dict)  # a group's members alike

    def _in_file(self, path: FieldPath) -> tuple[FieldPath, str]:
        if len(path) >= 2 and path[0] == "nodes" and isinstance(path[1], int) and path[1] < len(self.origin):
            i = path[1]
            if self.origin.count(self.origin[i]) > 1:
                return ("nodes", self.origin[i], *path[2:]), self.names[i]
            return ("nodes", self.origin[i], *path[2:]), ""
        for at, origin in self.member_origin.items():
            k = len(at)
            if tuple(path[:k]) == at and len(path) > k and isinstance(path[k], int) and path[k] < len(origin):
                return (*at, origin[path[k]], *path[k + 1 :]), ""
        return path, ""

    def line_of(self, path: FieldPath) -> int:
        return YamlSource(self.path, self.original).line_of(self._in_file(path)[0])

    def problem(self, path: FieldPath, problem: str, hint: str = "") -> InputProblem:
        located, name = self._in_file(path)
        where = field_name(located)
        if name:  # "nodes[2] (xavier-05).address"
            head, dot, rest = where.partition(".")
            where = f"{head} ({name}){dot}{rest}"
        return InputProblem(str(self.path), self.line_of(path), where, problem, hint)


def expand_ranges(source: YamlSource) -> tuple[YamlSource, list[InputProblem]]:
    """``source`` with its node and group-member ranges expanded, and the problems of its ranges (the
    source unchanged where a range cannot be expanded, or where it has none)."""
    data = source.data
    nodes = data.get("nodes") if isinstance(data, dict) else None
    groups = data.get("groups") if isinstance(data, dict) else None
    if not isinstance(nodes, list) or not (_has_range_nodes(nodes) or _has_range_members(groups)):
        return source, []
    problems: list[InputProblem] = []
    expanded_nodes, origin = [], []
    for j, entry in enumerate(nodes):
        copies = _node_copies(source, j, entry, problems)
        expanded_nodes += copies
        origin += [j] * len(copies)
    if len(expanded_nodes) > MAX_EXPANDED:
        problems.append(source.problem(("nodes",), f"the ranges make {len(expanded_nodes)} nodes; at most "
                                       f"{MAX_EXPANDED}", "split the lab into inventories"))  # fmt: skip
    expanded = copy.deepcopy(data)
    expanded["nodes"] = type(nodes)(expanded_nodes)
    member_origin: dict[tuple, tuple[int, ...]] = {}
    if isinstance(groups, dict):
        for name, entry in groups.items():
            members = entry.get("members") if isinstance(entry, dict) else entry
            at = ("groups", name, "members") if isinstance(entry, dict) else ("groups", name)
            if isinstance(members, list):
                plain, member_origin[at] = _members(source, at, members, problems)
                if isinstance(entry, dict):
                    expanded["groups"][name]["members"] = type(members)(plain)
                else:
                    expanded["groups"][name] = type(members)(plain)
    names = tuple(str(n.get("name")) if isinstance(n, dict) else "" for n in expanded_nodes)
    return RangedSource(source.path, expanded, source.data, tuple(origin), names, member_origin), problems


def _has_range_nodes(nodes: list) -> bool:
    return any(isinstance(_get(n, f), str) and RANGE.search(_get(n, f)) for n in nodes for f in RANGED_FIELDS)


def _has_range_members(groups: Any) -> bool:
    if not isinstance(groups, dict):
        return False
    for entry in groups.values():
        members = entry.get("members") if isinstance(entry, dict) else entry
        if isinstance(members, list) and any(isinstance(m, str) and RANGE.search(m) for m in members):
            return True
    return False


def _flat(entry: Any) -> Any:
    """A copy of ``entry`` with the keys a merge (``<<: *anchor``) brought in written out: a copy that
    is changed, and written again, must not take them back from the anchor."""
    if not isinstance(entry, dict):
        return copy.deepcopy(entry)
    flat = type(entry)()
    flat.update((key, copy.deepcopy(value)) for key, value in entry.items())
    return flat


def _node_copies(source: YamlSource, j: int, entry: Any, problems: list[InputProblem]) -> list[Any]:
    """The nodes entry ``j`` stands for: a copy of it, or one per name of its range."""
    entry = _flat(entry)
    values: dict[tuple[str, ...], list[str]] = {}
    for path in RANGED_FIELDS:
        value = _get(entry, path)
        if not isinstance(value, str):
            continue
        try:
            found = expand(value)
        except ValueError as exc:
            problems.append(source.problem(("nodes", j, *path), f"the range in {value!r} {exc}",
                                           "write one range [first:last], e.g. xavier-[01:20]"))  # fmt: skip
            return [entry]
        if found is not None:
            values[path] = found
    if not values:
        return [entry]
    names = values.get(("name",))
    if names is None:
        first = next(iter(values))
        problems.append(source.problem(("nodes", j, *first), "a range here needs a range in the node's name",
                                       "name the nodes with a range as long, e.g. xavier-[01:20]"))  # fmt: skip
        return [entry]
    for path, found in values.items():
        if len(found) != len(names):
            problems.append(source.problem(("nodes", j, *path), f"the range gives {len(found)} values for "
                                           f"{len(names)} nodes ({names[0]} to {names[-1]})",
                                           "give a range of the same length as the name's"))  # fmt: skip
            return [entry]
    copies = []
    for i in range(len(names)):
        node = _flat(entry)
        for path, found in values.items():
            _set(node, path, found[i])
        copies.append(node)
    return copies


def _members(
    source: YamlSource, at: FieldPath, members: Iterable[Any], problems: list[InputProblem]
) -> tuple[list[Any], tuple[int, ...]]:
    """A group's members with their ranges written out, and each one's place in the file's list."""
    out: list[Any] = []
    origin: list[int] = []
    for k, member in enumerate(members):
        try:
            found = expand(member) if isinstance(member, str) else None
        except ValueError as exc:
            problems.append(source.problem((*at, k), f"the range in {member!r} {exc}",
                                           "write one range [first:last], e.g. xavier-[01:07]"))  # fmt: skip
            found = None
        out += found if found is not None else [member]
        origin += [k] * (len(found) if found is not None else 1)
    return out, tuple(origin)
