"""Property: every shipped user file, mutated one field at a time, is either refused when it is loaded, with
an :class:`InputError` whose every problem names ``FILE:LINE`` (the command line's exit status 2), or
accepted and planned without error. Any other exception is a traceback a user would have seen.

The files: every example inventory (and ``inventory.yaml``), campaign, compute profile, links file and
trace, and a Mahimahi trace. A mutation takes one field (a value, a list item, a key, a CSV cell or row,
a Mahimahi line) and makes it the wrong type, out of range, not finite, empty, huge, unicode (control,
format, other scripts' digits), renamed or missing. Planning is what the commands do after loading:
campaigns the plan of ``testbed run --dry-run`` (in process, nodes not read); inventories their emulation
plan, SSH targets, Ansible export, tc plans and NFQUEUE chains; links files and traces their tc plans,
chains and trace schedules on the default inventory; profiles every mode's step times.

Hypothesis draws the mutations with a fixed seed (``derandomize``), so a run is reproducible; each test
counts the mutations it ran and says so (``-s`` shows the summary), and together they run more than 2000.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from foundation.errors import InputError
from foundation.user_files import YamlSource
from netem.mahimahi import import_mahimahi
from netem.nfqueue import compile_chains
from netem.trace import BandwidthTrace, delay_timelines, load_trace, schedules, write_trace
from nodes.contracts.compute_profile import step_seconds
from nodes.contracts.target_model import builtin
from testbed.campaign.load import load_campaign
from testbed.campaign.plan import plan_run
from testbed.emulation.plan import plan_emulation
from testbed.inventory import DataPlane, Inventory, links_from_file, load_inventory
from testbed.inventory.ansible_export import ansible_inventory
from testbed.links.plans import compile_plan, link_topology, traced_links
from testbed.target.compute_profiles import load_profile
from tests.conftest import REPO, run_cli

EXAMPLES = REPO / "examples"
INVENTORIES = [REPO / "inventory.yaml", *sorted((EXAMPLES / "inventories").glob("*.yaml"))]
CAMPAIGNS = sorted((EXAMPLES / "campaigns").glob("*.yaml"))
PROFILES = sorted((EXAMPLES / "profiles").glob("*.yaml"))
LINKS_FILES = sorted((EXAMPLES / "links").glob("*.yaml"))
TRACES = sorted((EXAMPLES / "traces").glob("*.csv"))
# Campaigns whose plan builds hundreds of requests' schedules (a second or more each): fewer mutations.
SLOW_CAMPAIGNS = ("andes-", "cocoserve-", "hat-lab-")

RAN: Counter[str] = Counter()  # mutations run, by family
OUTCOMES: Counter[tuple[str, str]] = Counter()  # (family, refused | accepted)
EXAMPLES_PER_FAMILY = {"inventory": 420, "campaign": 230, "campaign-slow": 40, "profile": 560, "links": 200,
                       "trace": 420, "mahimahi": 300}  # fmt: skip
assert sum(EXAMPLES_PER_FAMILY.values()) >= 2000


def mutation_settings(family: str) -> Any:
    return settings(max_examples=EXAMPLES_PER_FAMILY[family], derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Mutations of one field

MISSING = object()  # the field is deleted
KINDS = ("wrong_type", "out_of_range", "non_finite", "empty", "huge", "unicode", "missing", "key")
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)([A-Za-z%]*)$")
_FULLWIDTH = {ord(c): ord(c) + 0xFEE0 for c in "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"}


def candidates(kind: str, value: Any) -> list[Any]:
    """The values a field of ``value`` is mutated to, for one kind of mutation."""
    if kind == "missing":
        return [MISSING]
    if kind == "wrong_type":
        if isinstance(value, bool):
            return ["yes", 1, [value], {"k": value}]
        if isinstance(value, (int, float)):
            return [str(value), True, [value], {"k": value}, "x"]
        if isinstance(value, str):
            return [0, 1.5, True, [value], {"k": value}]
        return ["x", 7, True, [1] if isinstance(value, dict) else {"k": 1}]
    if kind == "out_of_range":
        if isinstance(value, bool):
            return [2, -1]
        if isinstance(value, (int, float)):
            return [-1, 0, -value, value * 1e6 + 1, 10**12, 1e308, 0.5, value + 0.5, 2**63, -(2**63), 1e-300]
        if isinstance(value, str):
            quantity = _QUANTITY.match(value)
            if quantity:
                number, unit = quantity.groups()
                return [f"-{value}", f"0{unit}", f"1e30{unit}", f"{float(number) * 1e9:g}{unit}", f"1e-9{unit}",
                        number, f"{number}xyz", f"{number} {unit}"]  # fmt: skip
            return [value + "-" + "x" * 80, "x", value.upper(), value + "/../..", "/", ".", "~x", "-" + value]
        if isinstance(value, list):
            return [value * 3 if value else [1], value[:1] * 2 if value else [None], list(reversed(value))]
        if isinstance(value, dict):
            return [{**value, "unknown_key": 1}]
        return [1]
    if kind == "non_finite":
        unit = ""
        if isinstance(value, str) and _QUANTITY.match(value):
            unit = _QUANTITY.match(value).group(2)  # type: ignore[union-attr]
        return [math.nan, math.inf, -math.inf, f"nan{unit}", f"inf{unit}", "NaN", ".inf", "-Infinity"]
    if kind == "empty":
        return ["", [], {}, None, 0, " "]
    if kind == "huge":
        out: list[Any] = ["x" * 5000, 2**64, 10**30, 1e300, 10**399, "9" * 401, -(10**50)]
        if isinstance(value, list) and value:
            out.append(value * 200)
        if isinstance(value, dict) and value:
            first = next(iter(value.items()))
            out.append({**value, **{f"{first[0]}-{i}": first[1] for i in range(200)}})
        return out
    if kind == "unicode":
        text = value if isinstance(value, str) else str(value)
        return [text + "\u202e", "\u00fc" + text, "\u540d\u524d", "\x1b[31m" + text, text + "\n", "\U0001f600",
                text.translate(_FULLWIDTH), "\u0663", text + "\u200b", "\ufeff" + text, text + "\x00",
                "\u00b2", text + "\u2028"]  # fmt: skip
    raise AssertionError(kind)


KEY_CANDIDATES = ["", "x y", "\u540d\u524d", "a\x1bb", "k" * 300, "all", "controller", "0", "-x", "a.b", "~"]


def plain(value: Any) -> Any:
    """ruamel's containers and scalars as plain Python (what a file would have held)."""
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def field_paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every value, list item and key of ``data``, by path."""
    out = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out += field_paths(value, (*prefix, key))
    return out


def mutate(data: Any, path: Sequence[Any], kind: str, choice: int) -> tuple[Any, str]:
    """A copy of ``data`` with the field at ``path`` mutated, and what was done (for the report)."""
    data = copy.deepcopy(data)
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    if kind == "key":
        if not isinstance(parent, dict):
            kind = "missing"
        else:
            new = KEY_CANDIDATES[choice % len(KEY_CANDIDATES)]
            if new in parent:
                new += "-renamed"
            parent[new] = parent.pop(key)
            return data, f"{list(path)}: key renamed to {new!r}"
    options = candidates(kind, parent[key])
    value = options[choice % len(options)]
    if value is MISSING:
        del parent[key]
        return data, f"{list(path)}: removed"
    parent[key] = value
    return data, f"{list(path)}: {kind} -> {value!r:.120}"


def dump_yaml(data: Any) -> str:
    """The mutated data as a YAML file (libyaml's emitter where PyYAML has it: ruamel's own is slow)."""
    try:
        import yaml as pyyaml

        return pyyaml.dump(data, Dumper=pyyaml.CSafeDumper, allow_unicode=True, sort_keys=False, width=4096)
    except (ImportError, AttributeError):
        pass
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    yaml.allow_unicode = True
    yaml.width = 4096
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


def yaml_data(path: Path, rewrite: Callable[[str], str] = lambda text: text) -> Any:
    return plain(YamlSource.parse(rewrite(path.read_text(encoding="utf-8")), path).data)


def outcome(family: str, run: Callable[[], None], what: str = "") -> str:
    """Run a load (and its plan): refused with every problem located, or accepted. Anything else is
    raised (the test fails with the traceback a user would have seen). With ``$HIL_MUTATION_LOG`` set,
    each mutation and how it ended is appended to that file."""
    RAN[family] += 1
    ended, first = "accepted", ""
    try:
        run()
    except InputError as exc:
        unplaced = [str(p) for p in exc.problems if p.line is None or not p.file]
        assert not unplaced, f"problems without FILE:LINE: {unplaced}"
        ended, first = "refused", str(exc.problems[0])
    OUTCOMES[(family, ended)] += 1
    if os.environ.get("HIL_MUTATION_LOG"):
        with open(os.environ["HIL_MUTATION_LOG"], "a", encoding="utf-8") as log:
            log.write(json.dumps({"family": family, "mutation": what, "ended": ended, "problem": first}) + "\n")
    return ended


# --------------------------------------------------------------------------------------------
# What each kind of file is planned into once accepted


def with_data_planes(inventory: Inventory) -> Inventory:
    """The inventory as ``testbed emulate up`` resolves it: each emulated node with the addresses and
    data interface its plan gives it (nothing is built)."""
    if not any(n.emulated is not None for n in inventory.nodes):
        return inventory
    planned = {p.name: p for p in plan_emulation(inventory).nodes}
    nodes = tuple(
        n.model_copy(update={"address": planned[n.name].mgmt_address,
                             "data": DataPlane(interface="data0", address=planned[n.name].data_address)})
        if n.name in planned else n
        for n in inventory.nodes
    )  # fmt: skip
    return dataclasses.replace(inventory, spec=inventory.spec.model_copy(update={"nodes": nodes}))


def plan_links(inventory: Inventory, links: Any = None, traces: dict[str, BandwidthTrace] | None = None) -> None:
    """tc plans, NFQUEUE chains and trace schedules, as ``link apply`` computes them before it changes
    anything. Every node a link names has a data plane: one without is refused at load."""
    topology = link_topology(inventory)
    driven: dict = {}
    if traces:
        links, driven = traced_links(inventory, traces)
    links = inventory.links if links is None else links
    ends = {name for link in links for name in (link.source, link.destination)}
    assert all(topology.node(name).data_address is not None for name in ends), "a linked node off the data plane"
    plans = compile_plan(inventory, links)
    for plan in plans:
        assert plan.apply_commands() and plan.undo_commands()
    on_nfqueue = [dataclasses.replace(p, delay_path="nfqueue") for p in plans]
    chains = compile_chains(topology, on_nfqueue, traced=tuple(driven))
    for chain in chains:
        assert chain.apply_commands() and chain.undo_commands()
    schedules(plans, driven, ["sudo", "-n", "--"])
    delay_timelines(chains, driven)


def plan_inventory(inventory: Inventory) -> None:
    if any(n.emulated is not None for n in inventory.nodes):
        plan_emulation(inventory)
    for node in inventory.nodes:
        if node.address is not None and node.transport == "ssh":
            inventory.ssh_target(node)
    ansible_inventory(inventory)
    plan_links(with_data_planes(inventory))


MODELS = [builtin("vicuna-7b"), builtin("llama-2-7b")._replace(dtype="q4f16"), builtin("opt-66b")]


def plan_profile(path: Path) -> None:
    profile = load_profile(path)
    for mode in profile.modes:
        rates = profile.rates(mode)
        for model in MODELS:
            for segments, head in (([(1, 512)], 1), ([(512, 0)], 1), ([(1, 2048)] * 64, 64)):
                seconds = step_seconds(rates, model, model.layers, segments, head_tokens=head)
                assert math.isfinite(seconds) and seconds > 0, (mode, model.name, seconds)


DEFAULT_LAB = with_data_planes(load_inventory(REPO / "inventory.yaml"))
DEVICES = [n.name for n in DEFAULT_LAB.nodes if "device" in n.roles]


def plan_trace(path: Path) -> None:
    trace = load_trace(path)
    plan_links(DEFAULT_LAB, traces={d: trace for d in DEVICES})


# --------------------------------------------------------------------------------------------
# The properties, one family of files each


def campaign_text(text: str) -> str:
    """A campaign's relative paths made absolute, so that it loads from a temporary directory."""
    return text.replace("../../", f"{REPO}/").replace("../", f"{EXAMPLES}/")


def check_yaml_family(family: str, files: Sequence[Path], load_and_plan: Callable[[Path, tuple[Any, ...]], None],
                      tmp: Path, rewrite: Callable[[str], str] = lambda text: text) -> Callable[..., None]:  # fmt: skip
    """The property over mutations of ``files`` (YAML): ``load_and_plan(path, field)`` of the mutated file."""
    sources = [(path, yaml_data(path, rewrite)) for path in files]
    fields = [field_paths(data) for _path, data in sources]

    @mutation_settings(family)
    @given(st.sampled_from(range(len(sources))), st.data(), st.sampled_from(KINDS), st.integers(0, 15))
    def prop(index: int, draw: st.DataObject, kind: str, choice: int) -> None:
        # a file, then one of its fields: each file gets its share, however many fields it has
        original, data = sources[index]
        field = draw.draw(st.sampled_from(fields[index]), label="field")
        mutated, what = mutate(data, field, kind, choice)
        path = tmp / original.name
        path.write_text(dump_yaml(mutated), encoding="utf-8")
        note(f"{original.name}: {what}")
        outcome(family, lambda: load_and_plan(path, field), f"{original.name}: {what}")

    return prop


def test_every_example_inventory_mutated_is_refused_at_a_line_or_planned(tmp_path: Path) -> None:
    check_yaml_family("inventory", INVENTORIES, lambda path, _field: plan_inventory(load_inventory(path)), tmp_path)()
    report("inventory")


def plan_campaign(path: Path, field: tuple[Any, ...]) -> None:
    """The plan of the campaign's first run and, for a mutated matrix value, of the first run with it."""
    campaign = load_campaign(path)
    runs = [campaign.runs[0]]
    if len(field) >= 2 and field[0] == "matrix" and isinstance(field[1], str):
        runs += [r for r in campaign.runs if any(key == field[1] for key, _value in r.overrides)][:1]
        values = campaign.spec.matrix.get(field[1], [])
        if len(field) >= 3 and isinstance(field[2], int) and field[2] < len(values):  # (not a removed one)
            runs += [r for r in campaign.runs if (field[1], values[field[2]]) in r.overrides][:1]
    for run in {run.run_id: run for run in runs}.values():
        plan_run(campaign, run, 1, live=False)


@pytest.mark.parametrize("slow", [False, True], ids=["quick-plans", "slow-plans"])
def test_every_example_campaign_mutated_is_refused_at_a_line_or_planned(tmp_path: Path, slow: bool) -> None:
    files = [p for p in CAMPAIGNS if p.name.startswith(SLOW_CAMPAIGNS) == slow]
    family = "campaign-slow" if slow else "campaign"
    check_yaml_family(family, files, plan_campaign, tmp_path, campaign_text)()
    report(family)


def test_every_example_profile_mutated_is_refused_at_a_line_or_planned(tmp_path: Path) -> None:
    check_yaml_family("profile", PROFILES, lambda path, _field: plan_profile(path), tmp_path)()
    report("profile")


def test_every_example_links_file_mutated_is_refused_at_a_line_or_planned(tmp_path: Path) -> None:
    def load_and_plan(path: Path, _field: tuple[Any, ...]) -> None:
        plan_links(DEFAULT_LAB, links_from_file(DEFAULT_LAB, path))

    check_yaml_family("links", LINKS_FILES, load_and_plan, tmp_path)()
    report("links")


CELL_CANDIDATES = ["", "nan", "inf", "-1", "0", "1e400", "1e300", "0bit", "1bit", "999bit", "1kbit",
                   "99999999999999999999gbit", "8MBps", "8mbps", "8 MBps", "\u0663", "\uff18MBps", "1_000",
                   "+5", "0x10", "1e3", "5.91", "2.386", "100", "101", "10000", "10001", "\x00", "a,b", '"',
                   "8MBps\u202e", "-0", ".5", "5.", "x" * 5000]  # fmt: skip


def mutate_csv(lines: list[str], row: int, column: int, kind: int, choice: int) -> tuple[list[str], str]:
    """A trace's lines with one cell replaced, or one row removed, repeated, moved or split."""
    out = list(lines)
    if kind == 0:
        cells = out[row].split(",")
        column %= len(cells)
        cells[column] = CELL_CANDIDATES[choice % len(CELL_CANDIDATES)]
        out[row] = ",".join(cells)
        return out, f"line {row + 1} column {column}: {cells[column]!r:.60}"
    if kind == 1:
        del out[row]
        return out, f"line {row + 1} removed"
    if kind == 2:
        out[row:row] = [out[row]] * (1 + choice * 40)
        return out, f"line {row + 1} repeated {1 + choice * 40} times"
    if kind == 3:
        moved = out.pop(row)
        out.insert(choice % (len(out) + 1), moved)
        return out, f"line {row + 1} moved"
    if kind == 4:
        out[row] = out[row] + "," + CELL_CANDIDATES[choice % len(CELL_CANDIDATES)]
        return out, f"line {row + 1} has a cell more"
    out[row] = out[row].replace(",", ";")
    return out, f"line {row + 1} with ';' for ','"


def test_every_example_trace_mutated_is_refused_at_a_line_or_planned(tmp_path: Path) -> None:
    traces = [(path, path.read_text(encoding="utf-8").splitlines()) for path in TRACES]

    @mutation_settings("trace")
    @given(st.integers(0, len(traces) - 1), st.integers(0, 10_000), st.integers(0, 4), st.integers(0, 5),
           st.integers(0, 40))  # fmt: skip
    def prop(index: int, row: int, column: int, kind: int, choice: int) -> None:
        original, lines = traces[index]
        mutated, what = mutate_csv(lines, row % len(lines), column, kind, choice)
        path = tmp_path / original.name
        path.write_text("\n".join(mutated) + "\n", encoding="utf-8")
        note(f"{original.name}: {what}")
        outcome("trace", lambda: plan_trace(path), f"{original.name}: {what}")

    prop()
    report("trace")


# A Mahimahi trace in the shape of its cellular traces: bursts of deliveries at a few milliseconds.
MAHIMAHI_LINES = [str(ms) for ms in range(1, 3001, 7) for _ in range(1 + ms % 3)]
MAHIMAHI_WORDS = ["", " ", "-1", "0", "1.5", "1e3", "+7", "0x10", "1_0", "\u0663", "\u00b2", "\uff17", "nan",
                  "99999999999", "86400000", "86400001", "9" * 30, "\x00", "7\u202e", "x" * 200, "3000"]  # fmt: skip


def test_a_mahimahi_trace_mutated_is_refused_at_a_line_or_imported_and_planned(tmp_path: Path) -> None:
    down = tmp_path / "down"
    down.write_text("\n".join(MAHIMAHI_LINES[::2]) + "\n")

    @mutation_settings("mahimahi")
    @given(st.integers(0, len(MAHIMAHI_LINES) - 1), st.integers(0, 4), st.integers(0, 40),
           st.sampled_from([0.01, 0.1, 1.0]))  # fmt: skip
    def prop(line: int, kind: int, choice: int, bin_s: float) -> None:
        lines = list(MAHIMAHI_LINES)
        word = MAHIMAHI_WORDS[choice % len(MAHIMAHI_WORDS)]
        if kind == 0:
            lines[line] = word
        elif kind == 1:
            del lines[line]
        elif kind == 2:
            lines[line:line] = [lines[line]] * (choice * 500)
        elif kind == 3:
            lines.insert(line, word)
        else:
            lines.append(word)
        up = tmp_path / "up"
        up.write_text("\n".join(lines) + "\n", encoding="utf-8")
        note(f"line {line + 1}: kind {kind}, {word!r:.40}, bin {bin_s}")

        def import_and_plan() -> None:
            imported = import_mahimahi(up, down, bin_s=bin_s)
            written = tmp_path / "imported.csv"
            write_trace(imported.trace, written)
            plan_trace(written)

        outcome("mahimahi", import_and_plan, f"line {line + 1}: kind {kind}, {word!r:.40}, bin {bin_s}")

    prop()
    report("mahimahi")


def report(family: str) -> None:
    """Say how many mutations ran and how they ended; a family that ran fewer than planned fails."""
    ran, planned = RAN[family], EXAMPLES_PER_FAMILY[family]
    refused, accepted = OUTCOMES[(family, "refused")], OUTCOMES[(family, "accepted")]
    print(f"\n{family}: {ran} mutations ({refused} refused at FILE:LINE, {accepted} accepted and planned); "
          f"{sum(RAN.values())} so far in this session")  # fmt: skip
    assert ran >= planned * 0.95, f"{family}: only {ran} of {planned} mutations ran"
    assert refused and accepted, f"{family}: every mutation ended the same way ({refused} refused, {accepted} accepted)"


# --------------------------------------------------------------------------------------------
# A few mutations end to end, through the real command line


def first_refused(family: str, files: Sequence[Path], load: Callable[[Path], None], tmp: Path,
                  rewrite: Callable[[str], str] = lambda text: text) -> Path:  # fmt: skip
    """The first mutation (in a fixed order) of ``files`` that ``load`` refuses, written to ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    for original in files:
        data = yaml_data(original, rewrite)
        for field in field_paths(data):
            for kind in ("out_of_range", "unicode", "non_finite"):
                mutated, _what = mutate(data, field, kind, 3)
                path = tmp / original.name
                path.write_text(dump_yaml(mutated), encoding="utf-8")
                try:
                    load(path)
                except InputError:
                    return path
    raise AssertionError(f"no {family} mutation was refused")


def test_refused_mutations_exit_2_from_the_command_line_with_file_and_line(tmp_path: Path) -> None:
    started = time.monotonic()
    commands = []
    inventory = first_refused("inventory", [REPO / "inventory.yaml"], load_inventory, tmp_path / "i")
    commands.append((inventory, ["inventory", "show", "-i", str(inventory)]))
    campaign = first_refused("campaign", [EXAMPLES / "campaigns" / "demo.yaml"], load_campaign, tmp_path / "c",
                             campaign_text)  # fmt: skip
    commands.append((campaign, ["run", str(campaign), "--dry-run"]))
    links = first_refused("links", LINKS_FILES, lambda p: links_from_file(DEFAULT_LAB, p), tmp_path / "l")
    commands.append((links, ["link", "apply", "-i", str(REPO / "inventory.yaml"), "--links", str(links)]))
    # a profile reaches the command line through a campaign with a target, whose inventory names it
    profile = first_refused("profile", [EXAMPLES / "profiles" / "orin-nx.yaml"], load_profile, tmp_path / "p")
    lab = tmp_path / "p" / "inventory.yaml"
    lab.write_text((REPO / "inventory.yaml").read_text().replace("compute_profile: orin-nx", f"compute_profile: {profile}"))
    llms = tmp_path / "p" / "llms.yaml"
    llms.write_text(campaign_text((EXAMPLES / "campaigns" / "llms-ablation.yaml").read_text()).replace(
        f"inventory: {REPO}/inventory.yaml", f"inventory: {lab}"))  # fmt: skip
    commands.append((profile, ["run", str(llms), "--dry-run"]))
    trace = tmp_path / "hat-mid.csv"
    trace.write_text((EXAMPLES / "traces" / "hat-mid.csv").read_text().replace("3.149,7.85MBps", "3.149,nan"))
    hat = tmp_path / "hat-table5.yaml"
    hat.write_text(campaign_text((EXAMPLES / "campaigns" / "hat-table5.yaml").read_text()).replace(
        f"trace: {EXAMPLES}/traces/hat-mid.csv", f"trace: {trace}"))  # fmt: skip
    commands.append((trace, ["run", str(hat), "--dry-run"]))
    up = tmp_path / "up"
    up.write_text("\n".join(MAHIMAHI_LINES[:5] + ["\u00b2"] + MAHIMAHI_LINES[5:]) + "\n", encoding="utf-8")
    commands.append((up, ["link", "import-mahimahi", str(up), str(up), "--out", str(tmp_path / "m.csv")]))
    for path, argv in commands:
        result = run_cli(*argv)
        assert result.returncode == 2, (argv, result.stdout, result.stderr)
        assert "Traceback" not in result.stderr
        assert re.search(re.escape(str(path)) + r":\d+: ", result.stderr), (argv, result.stderr)
    assert not (tmp_path / "m.csv").exists()
    print(f"\n{len(commands)} refused mutations through the command line, exit status 2, in "
          f"{time.monotonic() - started:.1f} s")
