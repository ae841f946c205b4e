"""Campaign files (expansion, ids, seeds, order, validation), the ledger, run result tables, and the
``testbed run --dry-run`` / ``testbed status`` commands. No testbed, no root, no network."""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from foundation.errors import InputError, TestbedError
from testbed.campaign.ledger import Ledger
from testbed.campaign.load import load_campaign
from testbed.campaign.results import read_tokens, requests_table, write_results
from testbed.campaign.spec import Campaign, device_names, workload_spec
from tests.conftest import REPO, run_cli
from workloads.schedule import build_schedules

INVENTORY = REPO / "inventory.yaml"
TINY = REPO / "examples" / "models" / "tiny"
DEMO = REPO / "examples" / "campaigns" / "demo.yaml"

BASE = f"""\
name: unit
inventory: {INVENTORY}
base:
  method: ushape
  model: {TINY}
  partition:
    device_layers: 2
    stages: 2
  server: server
  devices: [orin, xavier]
  workload: {{arrival: poisson, rate_per_s: 2.0, requests_per_device: 3, max_new_tokens: 4}}
  link: {{profile: wifi-up}}
  power: {{orin: MAXN}}
"""

MATRIX_2X2 = """\
matrix:
  method: [ushape, centralized]
  link.profile: [wifi-up, wifi-far]
"""


def write(tmp_path: Path, text: str, name: str = "campaign.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def line_of(text: str, needle: str) -> int:
    """1-based number of the one line of ``text`` that contains ``needle``."""
    found = [i for i, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(found) == 1, f"{needle!r} is on lines {found}"
    return found[0]


def problems_of(path: Path) -> list[tuple[int | None, str, str]]:
    with pytest.raises(InputError) as caught:
        load_campaign(path)
    return [(p.line, p.field, p.problem) for p in caught.value.problems]


def shape(campaign: Campaign) -> list[tuple[int, tuple]]:
    """What a campaign runs, in order, without ids or seeds."""
    return [(r.repetition, r.overrides) for r in campaign.runs]


# --------------------------------------------------------------------------------------------
# Expansion


def test_matrix_2x2_times_2_repetitions_gives_8_runs_with_unique_hex_ids(tmp_path: Path) -> None:
    campaign = load_campaign(write(tmp_path, BASE + MATRIX_2X2 + "repetitions: 2\nseed: 5\n"))
    ids = [r.run_id for r in campaign.runs]
    assert len(ids) == 8
    assert len(set(ids)) == 8
    for run_id in ids:
        assert len(run_id) == 12
        int(run_id, 16)  # hex
        assert run_id == run_id.lower()
    assert [r.position for r in campaign.runs] == list(range(8))
    combos = {(r.repetition, r.settings.method, r.settings.link.profile) for r in campaign.runs}
    assert len(combos) == 8
    # the overrides are applied on top of base; the rest of base is kept
    for r in campaign.runs:
        assert r.settings.method == dict(r.overrides)["method"]
        assert r.settings.link.profile == dict(r.overrides)["link.profile"]
        assert r.settings.devices == ("orin", "xavier")
        assert r.settings.power == {"orin": "MAXN"}


def test_same_file_loaded_twice_gives_same_ids_order_and_seeds(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + MATRIX_2X2 + "repetitions: 2\nseed: 5\n")
    first, again = load_campaign(path), load_campaign(path)
    assert [(r.run_id, r.seed, r.repetition, r.overrides) for r in first.runs] == [
        (r.run_id, r.seed, r.repetition, r.overrides) for r in again.runs
    ]
    assert first.digest() == again.digest()
    # a copy elsewhere (same content) expands to the same runs: ids hash content, not paths
    copy = load_campaign(write(tmp_path, path.read_text(), "copy.yaml"))
    assert [r.run_id for r in copy.runs] == [r.run_id for r in first.runs]


def test_changing_seed_changes_order_seeds_and_ids(tmp_path: Path) -> None:
    a = load_campaign(write(tmp_path, BASE + MATRIX_2X2 + "repetitions: 2\nseed: 5\n", "a.yaml"))
    b = load_campaign(write(tmp_path, BASE + MATRIX_2X2 + "repetitions: 2\nseed: 6\n", "b.yaml"))
    assert shape(a) != shape(b)
    assert sorted(shape(a)) == sorted(shape(b))  # the same runs, another order
    assert {r.seed for r in a.runs}.isdisjoint({r.seed for r in b.runs})
    assert {r.run_id for r in a.runs}.isdisjoint({r.run_id for r in b.runs})
    assert a.digest() != b.digest()


def test_order_listed_keeps_matrix_order_repetition_major(tmp_path: Path) -> None:
    campaign = load_campaign(write(tmp_path, BASE + MATRIX_2X2 + "repetitions: 2\nseed: 5\norder: listed\n"))
    expected = [
        (rep, (("method", m), ("link.profile", p)))
        for rep in range(2)
        for m in ("ushape", "centralized")
        for p in ("wifi-up", "wifi-far")
    ]
    assert shape(campaign) == expected
    # the keys' order as written decides which one varies fastest
    swapped = "matrix:\n  link.profile: [wifi-up, wifi-far]\n  method: [ushape, centralized]\n"
    other = load_campaign(write(tmp_path, BASE + swapped + "repetitions: 1\norder: listed\n", "swapped.yaml"))
    assert shape(other) == [
        (0, (("link.profile", p), ("method", m))) for p in ("wifi-up", "wifi-far") for m in ("ushape", "centralized")
    ]


def test_random_order_is_a_shuffle_of_the_listed_runs_with_the_same_ids(tmp_path: Path) -> None:
    listed = load_campaign(write(tmp_path, BASE + MATRIX_2X2 + "repetitions: 2\nseed: 5\norder: listed\n", "l.yaml"))
    shuffled = load_campaign(write(tmp_path, BASE + MATRIX_2X2 + "repetitions: 2\nseed: 5\n", "r.yaml"))
    assert shape(shuffled) != shape(listed)
    # a run's id and seed depend on what it is, not on where it lands in the order
    assert sorted((r.run_id, r.seed) for r in shuffled.runs) == sorted((r.run_id, r.seed) for r in listed.runs)
    assert [r.position for r in shuffled.runs] == list(range(8))


def test_random_order_makes_runs_of_one_worker_shape_adjacent(tmp_path: Path) -> None:
    # stages decide the pool (a warm pool serves one server, devices and stages), the method family the
    # parts its ranks hold: four shapes, each a block of consecutive runs, in an order the seed decides
    matrix = (
        "matrix:\n  method: [ushape, centralized]\n  partition.stages: [1, 2]\n  link.profile: [wifi-up, wifi-far]\n"
    )
    campaign = load_campaign(write(tmp_path, BASE + matrix + "repetitions: 2\nseed: 5\n"))
    blocks = [(r.settings.partition.stages, r.settings.method) for r in campaign.runs]
    changes = sum(1 for a, b in itertools.pairwise(blocks) if a != b)
    assert len(blocks) == 16 and len(set(blocks)) == 4 and changes == 3
    # the pool's shape (stages here) changes once: both method families of one pool come together
    pools = [r.settings.partition.stages for r in campaign.runs]
    assert sum(1 for a, b in itertools.pairwise(pools) if a != b) == 1
    # still a seeded shuffle: within a block the order is not the listed one, and the same file gives it again
    listed = load_campaign(write(tmp_path, BASE + matrix + "repetitions: 2\nseed: 5\norder: listed\n", "l.yaml"))
    assert sorted(r.run_id for r in campaign.runs) == sorted(r.run_id for r in listed.runs)
    assert [r.run_id for r in campaign.runs] == [r.run_id for r in load_campaign(tmp_path / "campaign.yaml").runs]
    first = [
        (r.repetition, r.overrides)
        for r in campaign.runs
        if (r.settings.partition.stages, r.settings.method) == blocks[0]
    ]
    in_listed = [
        (r.repetition, r.overrides)
        for r in listed.runs
        if (r.settings.partition.stages, r.settings.method) == blocks[0]
    ]
    assert sorted(first) == sorted(in_listed) and first != in_listed
    # listed keeps the matrix order, shapes interleaved
    listed_blocks = [(r.settings.partition.stages, r.settings.method) for r in listed.runs]
    assert sum(1 for a, b in itertools.pairwise(listed_blocks) if a != b) > 3


def test_device_slots_make_runs_of_their_own_served_by_pools_of_their_own(tmp_path: Path) -> None:
    from testbed.campaign.run_spec import split_spec
    from testbed.workers.pool import pool_name

    text = BASE + "matrix:\n  device_slots: [1, 3]\n  partition.stages: [1, 2]\nrepetitions: 2\nseed: 5\n"
    slotted = load_campaign(write(tmp_path, text, "slots.yaml"))
    assert len({r.run_id for r in slotted.runs}) == 8  # 2 slot counts x 2 stage counts x 2 repetitions
    # random order keeps the runs of one pool (slots, stages) together, and each shape has its own pool
    shapes = [(r.settings.device_slots, r.settings.partition.stages) for r in slotted.runs]
    assert sum(1 for a, b in itertools.pairwise(shapes) if a != b) == 3
    pools = {pool_name(split_spec(slotted, r, 1)) for r in slotted.runs}
    assert len(pools) == 4
    three = next(r for r in slotted.runs if r.settings.device_slots == 3)
    assert split_spec(slotted, three, 1).device_slots == 3


def test_one_seed_per_repetition_shared_by_every_matrix_point(tmp_path: Path) -> None:
    campaign = load_campaign(write(tmp_path, BASE + MATRIX_2X2 + "repetitions: 3\nseed: 5\n"))
    seeds: dict[int, set[int]] = {}
    for r in campaign.runs:
        seeds.setdefault(r.repetition, set()).add(r.seed)
    assert sorted(seeds) == [0, 1, 2]
    assert all(len(s) == 1 for s in seeds.values()), seeds
    per_rep = [next(iter(seeds[rep])) for rep in range(3)]
    assert len(set(per_rep)) == 3
    assert all(0 <= s < 2**63 for s in per_rep)


def test_matrix_values_that_resolve_to_the_same_settings_are_one_run(tmp_path: Path) -> None:
    # wifi-up is base's profile; 0 and 0.0 are the same verify_s
    matrix = "matrix:\n  link.profile: [wifi-up, wifi-far, wifi-up]\n  link.verify_s: [0, 0.0]\n"
    campaign = load_campaign(write(tmp_path, BASE + matrix + "repetitions: 2\nseed: 3\n"))
    ids = [r.run_id for r in campaign.runs]
    assert len(ids) == len(set(ids)) == 4  # 2 distinct profiles x 2 repetitions
    assert {(r.repetition, r.settings.link.profile) for r in campaign.runs} == {
        (rep, p) for rep in range(2) for p in ("wifi-up", "wifi-far")
    }
    assert [r.position for r in campaign.runs] == list(range(4))


def test_campaign_without_matrix_is_base_times_repetitions(tmp_path: Path) -> None:
    campaign = load_campaign(write(tmp_path, BASE + "repetitions: 3\n"))
    assert len(campaign.runs) == 3
    assert sorted(r.repetition for r in campaign.runs) == [0, 1, 2]
    assert all(r.overrides == () for r in campaign.runs)
    assert len({r.run_id for r in campaign.runs}) == 3


# --------------------------------------------------------------------------------------------
# Schedules


def schedules_of(campaign: Campaign) -> dict[str, dict[str, list[dict]]]:
    out = {}
    for run in campaign.runs:
        devices = device_names(campaign.inventory, run.settings)
        out[run.run_id] = build_schedules(
            workload_spec(run.settings), devices, seed=run.seed, model_dir=campaign.resolve(run.settings.model)
        )
    return out


def test_schedules_are_identical_for_two_loads_of_the_same_campaign(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + MATRIX_2X2 + "repetitions: 2\nseed: 11\n")
    first, again = schedules_of(load_campaign(path)), schedules_of(load_campaign(path))
    assert first == again
    assert all(set(s) == {"orin", "xavier"} and all(len(rows) == 3 for rows in s.values()) for s in first.values())
    # common random numbers: every matrix point of a repetition gets the same requests; repetitions differ
    campaign = load_campaign(path)
    by_rep: dict[int, list[dict]] = {}
    for run in campaign.runs:
        by_rep.setdefault(run.repetition, []).append(first[run.run_id])
    assert all(s == group[0] for group in by_rep.values() for s in group)
    assert by_rep[0][0] != by_rep[1][0]


# --------------------------------------------------------------------------------------------
# Bad campaign files: FILE:LINE, all at once, exit status 2


BAD_CASES = {
    # name: (text, the text on the line the problem must name, a word the message must contain)
    "unknown method in base": (BASE.replace("method: ushape", "method: warp"), "method: warp", "warp"),
    "unknown method as a matrix value": (BASE + "matrix:\n  method:\n    - ushape\n    - warp\n", "- warp", "warp"),
    "matrix key that is not a field of link": (BASE + "matrix:\n  link.speed: [1, 2]\n", "link.speed", "speed"),
    "matrix key that is not a field": (BASE + "matrix:\n  methods: [ushape]\n", "methods:", "methods"),
    "power matrix key for an unknown node": (
        BASE + "matrix:\n  power.nosuchnode: [MAXN]\n",
        "power.nosuchnode",
        "nosuchnode",
    ),
    "missing inventory file": (
        BASE.replace(f"inventory: {INVENTORY}", "inventory: no/such/inventory.yaml"),
        "inventory:",
        "inventory",
    ),
    "device the inventory lacks": (BASE.replace("[orin, xavier]", "[orin, ghost]"), "ghost", "ghost"),
    "unknown link profile": (BASE.replace("profile: wifi-up", "profile: moon"), "moon", "moon"),
    "power mode an emulated board lacks": (
        BASE.replace("power: {orin: MAXN}", "power: {orin: MODE_99W}"),
        "MODE_99W",
        "MODE_99W",
    ),
    "more stages than server layers": (BASE.replace("stages: 2", "stages: 7"), "stages: 7", "stages"),
    "no server layers left": (
        BASE.replace("device_layers: 2", "device_layers: 8").replace("stages: 2", "stages: 1"),
        "device_layers: 8",
        "device",
    ),
    "unknown top-level key": (BASE + "repetition: 2\n", "repetition: 2", "repetition"),
    "YAML syntax error": (BASE.replace("server: server", "server: server: oops"), "server: oops", "YAML"),
    "bad matrix value of power": (
        BASE + "matrix:\n  power.orin:\n    - MAXN\n    - MODE_99W\n",
        "- MODE_99W",
        "MODE_99W",
    ),
    "bad matrix value of stages": (BASE + "matrix:\n  partition.stages:\n    - 2\n    - 7\n", "- 7", "stages"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_campaign_is_reported_at_its_line(tmp_path: Path, case: str) -> None:
    text, needle, word = BAD_CASES[case]
    problems = problems_of(write(tmp_path, text))
    assert len(problems) == 1, problems
    assert problems[0][0] == line_of(text, needle), problems
    assert word.lower() in (problems[0][1] + " " + problems[0][2]).lower(), problems


TWO_PROBLEMS = {
    # name: (text, the texts on the lines the problems must name)
    "two inventory problems in base": (
        BASE.replace("[orin, xavier]", "[orin, ghost]").replace("profile: wifi-up", "profile: moon"),
        ("ghost", "moon"),
    ),
    "two bad matrix values": (
        BASE + "matrix:\n  method:\n    - ushape\n    - warp\n  link.profile:\n    - wifi-up\n    - moon\n",
        ("- warp", "- moon"),
    ),
    "two shape problems": (BASE.replace("method: ushape", "method: warp") + "repetition: 2\n", ("warp", "repetition:")),
}


@pytest.mark.parametrize("case", list(TWO_PROBLEMS))
def test_every_problem_of_a_file_is_reported_together(tmp_path: Path, case: str) -> None:
    text, needles = TWO_PROBLEMS[case]
    assert {p[0] for p in problems_of(write(tmp_path, text))} == {line_of(text, n) for n in needles}


def test_cli_rejects_every_bad_campaign_with_its_lines_and_status_2(tmp_path: Path) -> None:
    # a CLI process costs about a second: every case above but the in-process-only variants, and one with two problems
    extra = ("no server layers left", "bad matrix value of power", "bad matrix value of stages")
    cases = {name: (text, (needle,)) for name, (text, needle, _) in BAD_CASES.items() if name not in extra}
    cases["two inventory problems in base"] = TWO_PROBLEMS["two inventory problems in base"]
    paths = {}
    for i, (name, (text, _)) in enumerate(cases.items()):
        (tmp_path / str(i)).mkdir()
        paths[name] = write(tmp_path / str(i), text)
    with ThreadPoolExecutor(max_workers=4) as pool:  # one CLI process per file, a few at a time
        results = dict(zip(cases, pool.map(lambda p: run_cli("run", str(p), "--dry-run"), paths.values()), strict=True))
    wrong = []
    for name, (text, needles) in cases.items():
        result, path = results[name], paths[name]
        missing = [f"{path}:{line_of(text, n)}:" for n in needles if f"{path}:{line_of(text, n)}:" not in result.stderr]
        if result.returncode != 2 or missing or "Traceback" in result.stderr:
            wrong.append(f"{name}: exit {result.returncode}, missing {missing}: {result.stderr[-600:]}")
    assert not wrong, "\n".join(wrong)


def test_the_server_may_take_every_middle_layer_but_no_more(tmp_path: Path) -> None:
    # tiny has 8 layers: the device runs layers 0-1 (HAT's input submodel) and the head, leaving 6 for the server
    ok = load_campaign(write(tmp_path, BASE.replace("stages: 2", "stages: 6"), "six.yaml"))
    assert ok.runs[0].settings.partition.stages == 6
    centralized = BASE.replace("method: ushape", "method: centralized").replace("stages: 2", "stages: 8")
    assert load_campaign(write(tmp_path, centralized, "central.yaml")).runs[0].settings.partition.stages == 8
    with pytest.raises(InputError):
        load_campaign(write(tmp_path, BASE.replace("stages: 2", "stages: 7"), "seven.yaml"))


def test_unknown_device_in_a_block_list_is_reported_at_its_item(tmp_path: Path) -> None:
    text = BASE.replace("devices: [orin, xavier]", "devices:\n    - orin\n    - ghost")
    path = write(tmp_path, text)
    problems = problems_of(path)
    assert [p[0] for p in problems] == [line_of(text, "- ghost")], problems


def test_roles_are_checked_against_the_inventory(tmp_path: Path) -> None:
    # the inventory gives the server the server role and the Jetsons the device role
    as_server = BASE.replace("server: server", "server: orin")
    problems = problems_of(write(tmp_path, as_server, "orin-server.yaml"))
    assert any(f == "base.server" and "orin does not have the server role" in m for _, f, m in problems), problems
    assert any(f == "base.devices" and "orin is the run's server" in m for _, f, m in problems), problems
    text = BASE.replace("devices: [orin, xavier]", "devices: [orin, server]")
    problems = problems_of(write(tmp_path, text, "server-device.yaml"))
    assert [(line, field) for line, field, _ in problems] == [
        (line_of(text, "devices: [orin, server]"), "base.devices")
    ]
    assert "server is the run's server" in problems[0][2]


def test_a_trace_needs_links_between_the_devices_and_a_server(tmp_path: Path) -> None:
    inventory = tmp_path / "no-downlinks.yaml"
    inventory.write_text(INVENTORY.read_text().replace("  - {from: server, to: devices, profile: wifi-down}\n", ""))
    text = BASE.replace(str(INVENTORY), str(inventory)).replace(
        "link: {profile: wifi-up}", f"link: {{trace: {REPO / 'examples' / 'traces' / 'hat-mid.csv'}}}"
    )
    problems = problems_of(write(tmp_path, text))
    assert [(line, field) for line, field, _ in problems] == [(line_of(text, "link: {trace:"), "base.link.trace")]
    assert "has no downlink between 'orin' and a server-role node" in problems[0][2]


# --------------------------------------------------------------------------------------------
# Ledger

RUNS = [("r0", "run zero", ["server", "orin"]), ("r1", "run one", ["server", "xavier"]), ("r2", "run two", ["orin"])]


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    with Ledger.create(tmp_path / "c" / "ledger.sqlite", {"name": "unit", "runs": 3}, RUNS) as made:
        yield made


def test_ledger_starts_every_run_todo_in_campaign_order(ledger: Ledger) -> None:
    rows = ledger.runs()
    assert [(r.run_id, r.position, r.label, r.nodes, r.state, r.attempts) for r in rows] == [
        ("r0", 0, "run zero", ("server", "orin"), "todo", 0),
        ("r1", 1, "run one", ("server", "xavier"), "todo", 0),
        ("r2", 2, "run two", ("orin",), "todo", 0),
    ]
    assert ledger.counts() == {"todo": 3, "running": 0, "done": 0, "failed": 0, "skipped": 0}
    assert ledger.meta() == {"name": "unit", "runs": 3}


def test_ledger_start_and_finish_transitions(ledger: Ledger) -> None:
    assert ledger.start("r0") == 1
    row = ledger.run("r0")
    assert (row.state, row.attempts) == ("running", 1)
    assert row.started_s is not None and row.ended_s is None
    assert ledger.counts()["running"] == 1
    assert ledger.finish("r0", "done", run_nodes=["server", "orin"]) == []
    row = ledger.run("r0")
    assert (row.state, row.attempts) == ("done", 1)
    assert row.ended_s is not None and row.ended_s >= row.started_s
    ledger.start("r1")
    ledger.finish("r1", "failed", reason="worker died", node="xavier", run_nodes=["server", "xavier"])
    row = ledger.run("r1")
    assert (row.state, row.reason, row.failed_node) == ("failed", "worker died", "xavier")
    assert ledger.counts() == {"todo": 1, "running": 0, "done": 1, "failed": 1, "skipped": 0}
    with pytest.raises(ValueError):
        ledger.finish("r2", "skipped")


def test_ledger_refuses_to_start_a_run_that_is_not_todo(ledger: Ledger) -> None:
    ledger.start("r0")
    with pytest.raises(TestbedError):
        ledger.start("r0")  # running
    ledger.finish("r0", "done")
    with pytest.raises(TestbedError):
        ledger.start("r0")  # done
    assert ledger.run("r0").attempts == 1


def test_ledger_requeue_of_an_interrupted_run_and_attempts(ledger: Ledger) -> None:
    ledger.start("r0")
    assert ledger.requeue("r0", ["running"]) is True
    assert ledger.run("r0").state == "todo"
    assert ledger.start("r0") == 2
    ledger.finish("r0", "failed", reason="x")
    assert ledger.requeue("r0", ["running"]) is False  # failed is not asked for
    assert ledger.run("r0").state == "failed"
    assert ledger.requeue("r0", ["failed", "skipped"]) is True
    assert ledger.start("r0") == 3
    assert ledger.requeue("r2", ["running"]) is False
    assert ledger.run("r2").state == "todo"


def test_ledger_skip_only_from_todo(ledger: Ledger) -> None:
    ledger.skip("r2", "orin quarantined")
    row = ledger.run("r2")
    assert (row.state, row.reason) == ("skipped", "orin quarantined")
    ledger.start("r0")
    ledger.skip("r0", "too late")
    assert ledger.run("r0").state == "running"
    assert ledger.counts()["skipped"] == 1


def test_ledger_quarantines_a_node_after_k_failures_in_a_row(tmp_path: Path) -> None:
    runs = [(f"r{i}", f"run {i}", ["server", "orin"]) for i in range(8)]
    with Ledger.create(tmp_path / "ledger.sqlite", {}, runs) as ledger:

        def fail(run_id: str) -> list[str]:
            ledger.start(run_id)
            return ledger.finish(run_id, "failed", reason=f"{run_id} broke", node="orin",
                                 run_nodes=["server", "orin"], quarantine_after=3)  # fmt: skip

        assert fail("r0") == []
        assert fail("r1") == []
        # a run orin takes part in that does not fail because of it ends the streak
        ledger.start("r2")
        assert ledger.finish("r2", "done", run_nodes=["server", "orin"], quarantine_after=3) == []
        assert fail("r3") == []
        assert fail("r4") == []
        assert ledger.quarantined() == {}
        assert fail("r5") == ["orin"]
        assert set(ledger.quarantined()) == {"orin"}
        assert "r5 broke" in ledger.quarantined()["orin"]
        streaks = {n.node: n.failures_in_row for n in ledger.nodes()}
        assert streaks == {"orin": 3, "server": 0}
        assert fail("r6") == []  # newly quarantined only once
        ledger.release("orin")
        assert ledger.quarantined() == {}
        assert {n.node: n.failures_in_row for n in ledger.nodes()}["orin"] == 0


def test_ledger_failure_of_another_node_ends_this_nodes_streak(tmp_path: Path) -> None:
    runs = [(f"r{i}", f"run {i}", ["server", "orin"]) for i in range(3)]
    with Ledger.create(tmp_path / "ledger.sqlite", {}, runs) as ledger:
        for run_id, node in (("r0", "orin"), ("r1", "server"), ("r2", "orin")):
            ledger.start(run_id)
            ledger.finish(run_id, "failed", node=node, run_nodes=["server", "orin"], quarantine_after=2)
        assert ledger.quarantined() == {}
        assert {n.node: n.failures_in_row for n in ledger.nodes()} == {"orin": 1, "server": 0}


def test_ledger_finishing_a_run_twice_counts_its_failure_once(ledger: Ledger) -> None:
    ledger.start("r2")
    assert ledger.finish("r2", "failed", reason="boom", node="orin", run_nodes=["orin"], quarantine_after=2) == []
    try:  # a second finish of a run that is no longer running: refused, or ignored, but never counted
        again = ledger.finish("r2", "failed", reason="boom", node="orin", run_nodes=["orin"], quarantine_after=2)
    except TestbedError:
        again = []
    assert again == []
    assert ledger.quarantined() == {}
    assert {n.node: n.failures_in_row for n in ledger.nodes()} == {"orin": 1}


def test_ledger_create_refuses_an_existing_path_and_open_a_missing_one(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    Ledger.create(path, {}, RUNS).close()
    with pytest.raises(TestbedError):
        Ledger.create(path, {}, RUNS)
    with Ledger.open(path) as reopened:
        assert len(reopened.runs()) == 3  # the refused create changed nothing
    with pytest.raises(TestbedError):
        Ledger.open(tmp_path / "elsewhere" / "ledger.sqlite")


def test_ledger_uses_wal_and_its_state_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    with Ledger.create(path, {"name": "unit"}, RUNS) as ledger:
        ledger.start("r0")
        ledger.finish("r0", "done", run_nodes=["server", "orin"])
        ledger.start("r1")
        ledger.finish("r1", "failed", reason="oops", node="xavier", run_nodes=["server", "xavier"], quarantine_after=1)
        ledger.start("r2")
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with Ledger.open(path) as reopened:
        assert [(r.run_id, r.state, r.attempts) for r in reopened.runs()] == [
            ("r0", "done", 1),
            ("r1", "failed", 1),
            ("r2", "running", 1),
        ]
        assert reopened.run("r1").reason == "oops"
        assert set(reopened.quarantined()) == {"xavier"}
        assert reopened.meta() == {"name": "unit"}


# --------------------------------------------------------------------------------------------
# Run results

HEADER = '# {"clock_origin_monotonic_s": 12.5, "method": "ushape", "node": "%s", "role": "device"}\n'


def record(node: str, request_id: int) -> dict:
    return {
        "request_id": request_id, "node": node, "method": "ushape", "prompt_tokens": 5, "output_tokens": 2,
        "ttft_s": 0.25, "first_token_s": 0.5,
        "prefill": {"network_s": 0.125, "server_compute_s": 0.0625},
        "decode": {"steps": 1, "network_s": 0.03125},
        "token_ids": [7, 1],
    }  # fmt: skip


def schedule_row(request_id: int, arrival_s: float) -> dict:
    return {"request_id": request_id, "arrival_s": arrival_s, "prompt_tokens": 5, "max_new_tokens": 2,
            "expected_ttft_s": 1.0, "expected_tds_tok_s": 4.8, "prompt_source": f"unit:{request_id}"}  # fmt: skip


def write_rank(ranks: Path, index: int, node: str, records: list[dict], tokens: list[str], torn: str = "",
               torn_tokens: str = "") -> None:  # fmt: skip
    directory = ranks / f"device-{index}-{node}"
    directory.mkdir(parents=True)
    body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    (directory / "requests.jsonl").write_text(HEADER % node + body + torn)
    lines = "".join(t + "\n" for t in tokens)
    (directory / "tokens.csv").write_text(HEADER % node + "request_id,index,token_id,ts_s\n" + lines + torn_tokens)


@pytest.fixture
def ranks(tmp_path: Path) -> Path:
    ranks = tmp_path / "ranks"
    # orin finished request 0; request 1 was still running (a torn line that happens to be whole JSON)
    write_rank(ranks, 0, "orin", [record("orin", 0)], ["0,0,7,0.5", "0,1,1,0.75"],
               torn=json.dumps(record("orin", 1)), torn_tokens="1,0,9,1.2")  # fmt: skip
    # orin-nx: a name with '-'; its last lines were cut mid-write
    write_rank(ranks, 1, "orin-nx", [record("orin-nx", 1_000_000)], ["1000000,0,3,0.6"],
               torn='{"request_id": 1000001, "node": "or', torn_tokens="1000001,0,")  # fmt: skip
    return ranks


SCHEDULES = {
    "orin": [schedule_row(0, 0.0), schedule_row(1, 0.5), schedule_row(2, 1.0)],
    "orin-nx": [schedule_row(1_000_000, 0.1), schedule_row(1_000_001, 0.7)],
}


def test_requests_table_has_every_scheduled_request_and_flattened_timings(ranks: Path) -> None:
    table = requests_table(ranks, SCHEDULES)
    assert list(zip(table["node"], table["request_id"], table["completed"], strict=True)) == [
        ("orin", 0, True), ("orin", 1, False), ("orin", 2, False),
        ("orin-nx", 1_000_000, True), ("orin-nx", 1_000_001, False),
    ]  # fmt: skip
    done = table[table["completed"]].set_index("request_id")
    assert done.loc[0, "prefill_network_s"] == 0.125
    assert done.loc[0, "prefill_server_compute_s"] == 0.0625
    assert done.loc[0, "decode_network_s"] == 0.03125
    assert done.loc[1_000_000, "decode_steps"] == 1
    assert "prefill" not in table.columns and "decode" not in table.columns
    assert table.set_index("request_id").loc[1, "scheduled_arrival_s"] == 0.5
    assert table.set_index("request_id").loc[2, "prompt_source"] == "unit:2"
    assert table.set_index("request_id").loc[0, "expected_ttft_s"] == 1.0


def test_requests_table_without_rank_files_marks_every_request_incomplete(tmp_path: Path) -> None:
    table = requests_table(tmp_path / "no-ranks", SCHEDULES)
    assert len(table) == 5
    assert not table["completed"].any()
    assert list(table["request_id"]) == [0, 1, 2, 1_000_000, 1_000_001]


def test_tokens_ignore_torn_lines_and_take_the_node_from_the_directory(ranks: Path) -> None:
    tokens = read_tokens(ranks)
    assert list(tokens.columns) == ["node", "request_id", "index", "token_id", "ts_s"]
    assert [tuple(r) for r in tokens.itertuples(index=False)] == [
        ("orin", 0, 0, 7, 0.5), ("orin", 0, 1, 1, 0.75), ("orin-nx", 1_000_000, 0, 3, 0.6),
    ]  # fmt: skip


def test_tokens_of_a_rank_with_no_tokens_yet(tmp_path: Path) -> None:
    write_rank(tmp_path / "ranks", 0, "orin", [], [], torn_tokens="0,0,4,0.1")
    tokens = read_tokens(tmp_path / "ranks")
    assert len(tokens) == 0
    assert list(tokens.columns) == ["node", "request_id", "index", "token_id", "ts_s"]


def test_write_results_writes_both_tables(ranks: Path, tmp_path: Path) -> None:
    import pandas as pd

    out = tmp_path / "run"
    out.mkdir()
    write_results(ranks, SCHEDULES, out)
    requests = pd.read_parquet(out / "requests.parquet")
    tokens = pd.read_parquet(out / "tokens.parquet")
    assert len(requests) == 5 and int(requests["completed"].sum()) == 2
    assert list(tokens["node"]) == ["orin", "orin", "orin-nx"]


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_dry_run_of_the_demo_campaign_as_json() -> None:
    result = run_cli("run", str(DEMO), "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    runs = data["runs"]
    assert len(runs) == 8
    assert len({r["run_id"] for r in runs}) == 8
    # another process expands to the same ids in the same order (seeds do not depend on hash())
    assert [r["run_id"] for r in runs] == [r.run_id for r in load_campaign(DEMO).runs]
    for run in runs:
        commands = run["commands"]
        lines = [line for node_lines in commands.values() for line in node_lines]
        assert any("nodes.power" in line and run["settings"]["power"]["orin"] in line for line in commands["orin"])
        assert any(line.startswith("mpiexec") for line in commands[run["settings"]["server"]])
        assert sum("mpiexec" in line for line in lines) == 1


def test_cli_dry_run_prints_the_runs() -> None:
    result = run_cli("run", str(DEMO), "--dry-run")
    assert result.returncode == 0, result.stderr
    for run in load_campaign(DEMO).runs:
        assert run.run_id in result.stdout


def make_campaign_dir(directory: Path, states: list[str]) -> list[str]:
    ids = [f"{i:012x}" for i in range(len(states))]
    with Ledger.create(directory / "ledger.sqlite", {"name": "unit"},
                       [(i, f"method=ushape, rep {n}", ["server"]) for n, i in enumerate(ids)]) as ledger:  # fmt: skip
        for run_id, state in zip(ids, states, strict=True):
            if state != "todo":
                ledger.start(run_id)
            if state in ("done", "failed"):
                ledger.finish(run_id, state, reason="broke" if state == "failed" else None)
    return ids


def test_cli_status_lists_runs_and_exits_1_while_runs_are_todo(tmp_path: Path) -> None:
    ids = make_campaign_dir(tmp_path / "c", ["done", "todo", "todo"])
    result = run_cli("status", str(tmp_path / "c"))
    assert result.returncode == 1, result.stdout + result.stderr
    for run_id in ids:
        assert run_id in result.stdout
    assert "todo" in result.stdout and "done" in result.stdout
    words = " ".join(result.stdout.split())  # the title wraps at the terminal's width
    assert "1 done" in words and "2 to do" in words


def test_cli_status_exits_0_when_every_run_is_done(tmp_path: Path) -> None:
    make_campaign_dir(tmp_path / "c", ["done", "done"])
    result = run_cli("status", str(tmp_path / "c"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_cli_status_exits_1_while_a_run_is_still_running(tmp_path: Path) -> None:
    make_campaign_dir(tmp_path / "c", ["done", "running"])
    result = run_cli("status", str(tmp_path / "c"))
    assert result.returncode == 1, result.stdout + result.stderr


def test_cli_status_without_a_ledger_exits_2(tmp_path: Path) -> None:
    result = run_cli("status", str(tmp_path))
    assert result.returncode == 2
    assert "ledger" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_manifest_names_only_modeled_sensors_that_gave_a_reading() -> None:
    """Probes are stored as serialised SensorStatus rows (value and problem, no ``ok``): a modeled sensor
    that gave nothing is not claimed as a modeled reading."""
    from types import SimpleNamespace

    from foundation.jsonable import jsonable
    from nodes.contracts.tool_answers import SensorStatus
    from testbed.campaign.manifest import modeled_statements
    from testbed.inventory import load_inventory

    lab = load_inventory(INVENTORY)
    working = SensorStatus("power_mw", "cgroup-model", "mW", "modeled", 5200.0)
    silent = SensorStatus("energy_j", "cgroup-model", "J", "modeled", None, "no cgroup to read")
    probes = {"server": {"sensors": jsonable([silent])}, "orin": {"sensors": jsonable([working])}}
    statements = modeled_statements(lab, [], SimpleNamespace(telemetry={"probes": probes}))
    assert statements == ["orin: cgroup-model power_mw is modeled"]


@pytest.mark.parametrize("path", sorted((REPO / "examples" / "campaigns").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_campaign_validates_against_its_inventory(path: Path) -> None:
    # what the README tells a newcomer to run must at least load: schema, inventory, method checks
    campaign = load_campaign(path)
    assert campaign.runs and all(run.run_id for run in campaign.runs)
