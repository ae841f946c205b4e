"""CoCoServe's scaling decisions (nodes/scaling) against hand-computed fixtures: the speedup model
(Eq. 1-4 and gamma), Algorithm 1 (scale-up) and Algorithm 2 (scale-down)."""

from __future__ import annotations

import itertools
import random

import pytest

from nodes.scaling import scale_down as down
from nodes.scaling.placement import GpuMemory, Placement, available_bytes
from nodes.scaling.scale_up import by_continuity, eligible, scale_up
from nodes.scaling.speedup_model import (
    communication_s,
    computation_s,
    fit_gamma,
    gamma_from_times,
    homogeneous_speedup,
    identical,
    shares,
    speedup,
    transitions,
)

GB = 1 << 30
GPUS = ("g0", "g1", "g2", "g3")


def room(**free_layers: int) -> dict[str, GpuMemory]:
    """GPU memories with room for this many more 1 GB layers than they hold (g0 holds the model)."""
    return {g: GpuMemory(capacity_bytes=(n + (8 if g == "g0" else 0)) * GB) for g, n in free_layers.items()}


def eq4(gamma: float):
    return lambda placement: homogeneous_speedup(placement.degrees(), gamma)


def eq3(compute: dict[str, float], transfer: dict[str, float]):
    return lambda placement: speedup(placement, compute, transfer)


# -- the speedup model --------------------------------------------------------------------------------


def test_eq3_on_identical_gpus_is_eq4_with_gamma_from_the_times() -> None:
    compute, transfer = identical(GPUS, 2.0), identical(GPUS, 0.5)
    base = Placement.single(8, "g0")
    for layers, replicas in [(range(0, 8), ("g1",)), (range(2, 6), ("g1", "g2")), (range(0, 3), ("g1", "g2", "g3"))]:
        placement = base
        for layer, gpu in itertools.product(layers, replicas):
            placement = placement.add_replica(layer, gpu)
        gamma = gamma_from_times(2.0, 0.5, len(layers))
        assert speedup(placement, compute, transfer) == pytest.approx(homogeneous_speedup(placement.degrees(), gamma))
    # every layer on two GPUs, no transfer: Amdahl's perfect 2x; a run of 8 pays one scatter and gather
    everything = Placement(tuple(("g0", "g1") for _ in range(8)))
    assert speedup(everything, compute, identical(GPUS, 0.0)) == pytest.approx(2.0)
    assert communication_s(everything, compute, transfer) == pytest.approx(0.5 * (0.5 + 0.5))
    assert transitions(everything) == 1


def test_eq1_splits_a_layer_by_speed_and_eq2_counts_runs_not_layers() -> None:
    compute = {"g0": 1.0, "g1": 0.5}  # g1 twice as fast
    placement = Placement.single(4, "g0").add_replica(1, "g1")
    assert shares(placement, 1, compute) == pytest.approx({"g0": 1 / 3, "g1": 2 / 3})
    assert computation_s(placement, compute) == pytest.approx(3 * 1.0 + 1 / 3)
    # layers 0-1 and 3 on g1: two runs, so two scatters and two gathers of g1's share (2/3)
    split = placement.add_replica(0, "g1").add_replica(3, "g1")
    assert transitions(split) == 2
    assert communication_s(split, compute, {"g0": 0.0, "g1": 0.3}) == pytest.approx(2 * 0.3 * (2 / 3 + 2 / 3))


def test_eq4_and_the_gamma_fit() -> None:
    assert homogeneous_speedup([1, 1, 1, 1], 0.3) == pytest.approx(1.0)
    assert homogeneous_speedup([2, 2, 2, 2], 0.0) == pytest.approx(2.0)
    assert homogeneous_speedup([2, 2, 1, 1], 0.2) == pytest.approx(1 / (0.2 + 0.8 / 4 * 3))
    with pytest.raises(ValueError):
        homogeneous_speedup([], 0.1)
    truth = 0.27
    measured = [(p, homogeneous_speedup(p, truth)) for p in ([2, 2, 1, 1], [2, 2, 2, 2], [4, 4, 4, 1], [1, 1, 1, 1])]
    assert fit_gamma(measured) == pytest.approx(truth)
    with pytest.raises(ValueError, match="with a replica"):
        fit_gamma([([1, 1], 1.0)])


# -- Algorithm 1 --------------------------------------------------------------------------------------


def test_scale_up_replicates_every_layer_when_it_pays_and_none_once_gamma_reaches_one() -> None:
    start = Placement.single(4, "g0")
    full = scale_up(start, room(g0=0, g1=4), {"g1": 0.9}, 0.2, GB, eq4(0.0))
    assert full.placement.degrees() == [2, 2, 2, 2] and full.speedup == pytest.approx(2.0)
    assert full.added == tuple((i, "g1") for i in range(4))
    for gamma in (1.0, 1.5):  # Eq. 4: S never rises above 1 (1.0) or falls (1.5): no replica
        none = scale_up(start, room(g0=0, g1=4), {"g1": 0.9}, 0.2, GB, eq4(gamma))
        assert none.placement == start and none.added == ()


def test_scale_up_takes_as_many_replicas_as_the_memory_holds() -> None:
    result = scale_up(Placement.single(4, "g0"), room(g0=0, g1=2), {"g1": 0.9}, 0.2, GB, eq4(0.1))
    assert result.placement.degrees() == [2, 2, 1, 1]  # floor(2.0 GB / 1 GB) = 2, the run from layer 0
    half = {"g0": GpuMemory(8 * GB), "g1": GpuMemory(int(2.5 * GB))}
    assert scale_up(Placement.single(4, "g0"), half, {"g1": 0.9}, 0.2, GB, eq4(0.1)).placement.degrees() == [2, 2, 1, 1]


def test_scale_up_prefers_the_longest_run_of_free_layers() -> None:
    start = Placement.single(8, "g0").add_replica(2, "g1")  # g1 already holds layer 2
    assert by_continuity(start, "g1", 10) == [3, 4, 5, 6, 7, 0, 1]
    result = scale_up(start, room(g0=0, g1=4), {"g1": 0.9}, 0.2, GB, eq4(0.1))
    assert result.placement.degrees() == [1, 1, 2, 2, 2, 2, 1, 1]  # 1 GB of the 4 held layer 2 already
    assert [layer for layer, _ in result.added] == [3, 4, 5]


def test_scale_up_goes_to_the_emptiest_eligible_gpu_first_and_a_second_covers_what_the_first_did_not() -> None:
    vacancy = {"g1": 0.5, "g2": 0.9, "g3": 0.2}  # g3 at the threshold: not eligible (strictly above)
    result = scale_up(Placement.single(4, "g0"), room(g0=0, g1=2, g2=2, g3=4), vacancy, 0.2, GB, eq4(0.0))
    assert eligible(vacancy, 0.2) == ["g2", "g1"]
    assert result.added == ((0, "g2"), (1, "g2"), (2, "g1"), (3, "g1"))
    assert result.placement.degrees() == [2, 2, 2, 2] and "g3" not in result.placement.replica_gpus()


def test_scale_up_judges_a_run_whole_when_its_ends_pay_the_transfer() -> None:
    """Eq. 3 with w = 1 s and t = 0.6 s: one replica alone gives 4 / 4.1 < 1, two give 4 / 3.6 > 1, the
    whole run 4 / 2.6. The paper's one-at-a-time test would add none."""
    compute, transfer = identical(GPUS, 1.0), identical(GPUS, 0.6)
    result = scale_up(Placement.single(4, "g0"), room(g0=0, g1=4), {"g1": 0.9}, 0.2, GB, eq3(compute, transfer))
    assert result.added == tuple((i, "g1") for i in range(4))
    assert result.speedup == pytest.approx(4 / 2.6)
    # a transfer dearer than anything replication saves: nothing
    dear = scale_up(Placement.single(4, "g0"), room(g0=0, g1=4), {"g1": 0.9}, 0.2, GB, eq3(compute, identical(GPUS, 5)))
    assert dear.added == ()


def test_scale_up_on_a_faster_gpu_splits_by_speed() -> None:
    compute, transfer = {"g0": 1.0, "g1": 0.5}, {"g0": 0.0, "g1": 0.0}
    result = scale_up(Placement.single(2, "g0"), room(g0=0, g1=2), {"g1": 0.9}, 0.2, GB, eq3(compute, transfer))
    assert result.speedup == pytest.approx(2 / (2 / 3))  # each layer 1/3 s: g0 a third of the batch, g1 two


def test_scale_up_adds_nothing_when_no_gpu_is_vacant_enough() -> None:
    start = Placement.single(4, "g0")
    result = scale_up(start, room(g0=0, g1=4, g2=4), {"g1": 0.2, "g2": 0.05}, 0.2, GB, eq4(0.0))
    assert result.placement == start and result.added == () and result.speedup == pytest.approx(1.0)


def test_scale_up_skips_a_vacant_gpu_without_room_for_a_layer() -> None:
    # g2 is the emptiest but holds 0.9 GB free: floor(0.9) = 0 replicas; g1 takes them all
    memory = {"g0": GpuMemory(8 * GB), "g1": GpuMemory(4 * GB), "g2": GpuMemory(int(0.9 * GB))}
    result = scale_up(Placement.single(4, "g0"), memory, {"g1": 0.5, "g2": 0.95}, 0.2, GB, eq4(0.0))
    assert result.added == tuple((i, "g1") for i in range(4)) and result.speedup == pytest.approx(2.0)


def test_scale_up_takes_the_layers_with_fewest_copies_first() -> None:
    # layers 0-1 already have a replica on g2: g1's two replicas go to 2-3, which lifts Eq. 4 (gamma 0)
    # from 1 / (1/4 x (1/2 + 1/2 + 1 + 1)) = 4/3 to 2
    start = Placement.single(4, "g0").add_replica(0, "g2").add_replica(1, "g2")
    assert by_continuity(start, "g1", 2) == [2, 3]
    result = scale_up(start, room(g0=0, g1=2, g2=0), {"g1": 0.9}, 0.2, GB, eq4(0.0))
    assert result.added == ((2, "g1"), (3, "g1")) and result.speedup == pytest.approx(2.0)


def test_scale_up_with_gamma_one_half_adds_every_layer_to_eq4s_four_thirds() -> None:
    # Eq. 4, gamma 0.5: one replica gives 1 / (0.5 + 0.5 x 3.5 / 4) = 16/15, all four 1 / (0.5 + 0.25) = 4/3
    start = Placement.single(4, "g0")
    assert eq4(0.5)(start.add_replica(0, "g1")) == pytest.approx(16 / 15)
    result = scale_up(start, room(g0=0, g1=4), {"g1": 0.9}, 0.2, GB, eq4(0.5))
    assert result.added == tuple((i, "g1") for i in range(4)) and result.speedup == pytest.approx(4 / 3)


def test_scale_up_never_lowers_the_speedup_nor_overfills_a_gpu() -> None:
    rng = random.Random(7)
    for _ in range(40):
        layers = rng.randint(2, 10)
        start = Placement.single(layers, "g0")
        for layer in rng.sample(range(layers), rng.randint(0, layers // 2)):
            start = start.add_replica(layer, rng.choice(("g1", "g2")))
        memory = {"g0": GpuMemory(64 * GB), **{g: GpuMemory(rng.randint(0, 6) * GB + rng.randint(0, GB))
                                                 for g in ("g1", "g2", "g3")}}  # fmt: skip
        memory = {g: m if available_bytes(start, memory, GB, g) >= 0 else GpuMemory(
            len(start.layers_on(g)) * GB) for g, m in memory.items()}  # fmt: skip
        compute = {g: rng.uniform(0.5, 2.0) for g in GPUS}
        transfer = {g: rng.uniform(0.0, 1.0) for g in GPUS}
        predict = eq3(compute, transfer)
        result = scale_up(start, memory, {g: rng.random() for g in ("g1", "g2", "g3")}, 0.3, GB, predict)
        assert result.speedup >= predict(start) and result.speedup == pytest.approx(predict(result.placement))
        assert all(available_bytes(result.placement, memory, GB, g) >= 0 for g in memory)
        assert all(len(set(hosts)) == len(hosts) for hosts in result.placement.hosts)  # one copy per GPU


def test_scale_up_is_within_ten_percent_of_the_best_enumerated_placement() -> None:
    """Every way to replicate layers of a 6-layer model on g1 (room for 3) and g2 (room for 2): the
    algorithm's pick is within 10% of the best, under Eq. 3 with a transfer of 0.3 s per 1 s layer."""
    compute, transfer = identical(GPUS, 1.0), identical(GPUS, 0.3)
    predict = eq3(compute, transfer)
    start = Placement.single(6, "g0")
    best = 0.0
    for on_g1 in itertools.chain.from_iterable(itertools.combinations(range(6), k) for k in range(4)):
        for on_g2 in itertools.chain.from_iterable(itertools.combinations(range(6), k) for k in range(3)):
            placement = start
            for layer in on_g1:
                placement = placement.add_replica(layer, "g1")
            for layer in on_g2:
                placement = placement.add_replica(layer, "g2")
            best = max(best, predict(placement))
    result = scale_up(start, room(g0=0, g1=3, g2=2), {"g1": 0.9, "g2": 0.8}, 0.2, GB, predict)
    assert result.speedup >= 0.9 * best


# -- Algorithm 2 --------------------------------------------------------------------------------------


def scaled_instance() -> down.Instance:
    """Layers 0-3 on g0 with replicas of 2-3 on g1; g0 also holds a replica of g2's layer 4."""
    placement = Placement.split(["g0", "g0", "g0", "g0", "g2"]).add_replica(2, "g1").add_replica(3, "g1")
    return down.Instance(placement.add_replica(4, "g0"), batch_size=32)


MEMORY = {"g0": GpuMemory(8 * GB), "g1": GpuMemory(3 * GB), "g2": GpuMemory(6 * GB)}


def test_scale_down_runs_its_phases_in_order_until_nothing_is_left() -> None:
    instance, actions = down.scale_down(scaled_instance(), "g0", MEMORY, GB, eq4(0.1), lambda _: True,
                                        max_migrations=2, delta_batch=5)  # fmt: skip
    assert [a.phase for a in actions] == [1, 1, 2] + [3] * 7
    # phase 1: the last layers g0 is primary for go to the GPU with the most room (g2: 5 GB free, then 4)
    assert [(a.layer, a.destination) for a in actions[:2]] == [(3, "g2"), (2, "g2")]
    # phase 2: g0's own replica (of layer 4); phase 3: batch 32 down by 5 to 1, offloading KV first
    assert (actions[2].kind, actions[2].layer) == ("evict", 4)
    assert [a.batch_size for a in actions[3:]] == [27, 22, 17, 12, 7, 2, 1]
    assert [a.offload for a in actions[3:]] == ["kv"] + ["kv+weights"] * 6
    assert instance.batch_size == 1 and instance.offload == "kv+weights" and instance.migrations == 2
    assert down.next_action(instance, "g0", MEMORY, GB, eq4(0.1), 2, 5) is None


def test_scale_down_stops_as_soon_as_the_slo_holds() -> None:
    after_one, actions = down.scale_down(scaled_instance(), "g0", MEMORY, GB, eq4(0.1),
                                         lambda i: i.migrations < 1, max_migrations=2)  # fmt: skip
    assert [a.kind for a in actions] == ["migrate"] and after_one.placement.primary(3) == "g2"
    _, actions = down.scale_down(scaled_instance(), "g0", MEMORY, GB, eq4(0.1),
                                 lambda i: 4 in i.placement.replicas_on("g0"), max_migrations=0)  # fmt: skip
    assert [a.kind for a in actions] == ["evict"]  # no migration allowed: phase 2 at once, then it holds
    _, actions = down.scale_down(scaled_instance(), "g0", MEMORY, GB, eq4(0.1), lambda i: i.batch_size > 20,
                                 max_migrations=0)  # fmt: skip
    assert [a.batch_size for a in actions if a.phase == 3] == [27, 22, 17]


def test_scale_down_skips_migration_without_a_destination_and_evicts_the_cheapest_replica_first() -> None:
    # every other GPU full: nothing can migrate; g0 holds replicas of layer 1 (on 3 GPUs) and 3 (on 2)
    placement = Placement.split(["g1", "g2", "g0", "g2"]).add_replica(1, "g0").add_replica(1, "g3")
    placement = placement.add_replica(3, "g0")
    full = {"g0": GpuMemory(8 * GB), "g1": GpuMemory(1 * GB), "g2": GpuMemory(2 * GB), "g3": GpuMemory(1 * GB)}
    action = down.next_action(down.Instance(placement, 8), "g0", full, GB, eq4(0.1), 2, 5)
    assert action is not None and (action.phase, action.layer) == (2, 1)  # 1/3 -> 1/2 costs less than 1/2 -> 1
    assert down.evictees(placement, "g0", eq4(0.1)) == [1, 3]
    assert down.destination_for(placement, full, GB, 2, "g0") is None


def test_scale_down_never_takes_the_batch_below_one() -> None:
    instance = down.Instance(Placement.single(2, "g0"), batch_size=3)
    _, actions = down.scale_down(instance, "g0", {"g0": GpuMemory(4 * GB)}, GB, eq4(0.1), lambda _: True,
                                 max_migrations=2, delta_batch=5)  # fmt: skip
    assert [(a.batch_size, a.offload) for a in actions] == [(1, "kv"), (1, "kv+weights")]


# -- the controller on a step trace ------------------------------------------------------------------


def test_the_controller_on_a_step_trace_low_high_low() -> None:
    """Low load (0-60 s): replicas added one a tick, a cooldown apart. High load (60-160 s): the SLO is
    violated until the batch is down to 22: migrations, then batch steps, in Algorithm 2's order, and
    no replica added. Low again: once calm, phase 3 undone, then replicas again; no scale-down."""
    from nodes.scaling.controller import ScalingController, Snapshot, Thresholds

    memory = {"g0": GpuMemory(12 * GB), **{g: GpuMemory(8 * GB) for g in ("g1", "g2", "g3")}}
    thresholds = Thresholds(max_migrations=2)
    controller = ScalingController(down.Instance(Placement.single(8, "g0"), 32), "g0", memory, GB, eq4(0.1),
                                   thresholds)  # fmt: skip
    actions = []
    for tick in range(0, 300, 2):
        high = 60 <= tick < 160
        violation = 0.2 if high and controller.instance.batch_size > 22 else 0.0
        vacancy = {"g0": 0.05 if high else 0.4, **{g: (0.1 if high else 0.8) for g in ("g1", "g2", "g3")}}
        action = controller.tick(Snapshot(float(tick), vacancy, violation))
        if action is not None:
            actions.append((tick, action))
    low, high, after = ([a for t, a in actions if lo <= t < hi] for lo, hi in ((0, 60), (60, 160), (160, 300)))
    assert [a.kind for a in low] == ["replicate"] * 6
    assert [t for t, _ in actions[:6]] == [0, 10, 20, 30, 40, 50]  # one a cooldown
    assert [(a.kind, a.phase) for a in high] == [("migrate", 1), ("migrate", 1), ("reduce", 3), ("reduce", 3)]
    assert [a.batch_size for a in high if a.kind == "reduce"] == [27, 22]
    assert [a.kind for a in after[:2]] == ["restore", "restore"] and [a.batch_size for a in after[:2]] == [27, 32]
    assert after[1].offload == "none" and after[2:] and {a.kind for a in after[2:]} == {"replicate"}
    last_down = max(t for t, a in actions if a.phase in (1, 2, 3))
    assert min(t for t, a in actions if t > last_down) - last_down >= thresholds.calm_s  # calm before scale-up
    assert controller.instance.batch_size == 32 and controller.instance.offload == "none"
    assert controller.instance.migrations == 0  # calm again: a new high load may migrate anew
    assert all(row["decision"] != "scale-down" for row in controller.log if row["time_s"] >= 160)


def test_a_batch_step_that_raises_violations_is_undone_and_phase_3_holds_until_calm() -> None:
    """A queue beyond capacity: violations keep rising whatever the batch. Phase 1 migrates once (its
    bound), phase 2 has no replica on the source, phase 3 steps the batch down once; the next window is
    worse, so that step is undone and the batch stays at 32, not walked down to 1. Calm again, a new
    episode may step the batch down anew."""
    from nodes.scaling.controller import ScalingController, Snapshot, Thresholds

    memory = {"g0": GpuMemory(12 * GB), "g1": GpuMemory(8 * GB)}
    controller = ScalingController(down.Instance(Placement.single(8, "g0"), 32), "g0", memory, GB, eq4(0.1),
                                   Thresholds(max_migrations=1, calm_s=20.0))  # fmt: skip
    busy = {"g0": 0.0, "g1": 0.1}  # no vacancy anywhere: no replica in between
    rates = [0.2, 0.4, 0.6, 0.8, 0.9, 1.0, 1.0, 1.0]  # one per 10 s tick: the backlog grows
    actions = [controller.tick(Snapshot(10.0 * i, busy, rate)) for i, rate in enumerate(rates)]
    taken = [(a.kind, a.batch_size) for a in actions if a is not None]
    assert taken == [("migrate", 0), ("reduce", 27), ("restore", 32)]
    assert controller.instance.batch_size == 32 and controller.instance.offload == "none"
    assert [row["decision"] for row in controller.log][2:] == [
        "scale-down: the last batch step raised violations, undone"] + ["scale-down: batch held"] * 5
    # the same steps with violations that fall after each batch step: the batch keeps going down
    falling = ScalingController(down.Instance(Placement.single(8, "g0"), 32), "g0", memory, GB, eq4(0.1),
                                Thresholds(max_migrations=1))  # fmt: skip
    for i, rate in enumerate([0.5, 0.5, 0.4, 0.3, 0.2]):
        falling.tick(Snapshot(10.0 * i, busy, rate))
    assert falling.instance.batch_size == 12  # four steps after the migration
    # calm (no violation for calm_s), then a new high load: phase 3 may step again
    for t in (80.0, 90.0, 100.0):
        controller.tick(Snapshot(t, {"g0": 0.0, "g1": 0.0}, 0.0))
    assert not controller.batch_held
    controller.tick(Snapshot(110.0, busy, 0.5))  # migrations reset by calm: phase 1 first
    controller.tick(Snapshot(120.0, busy, 0.5))
    assert controller.instance.batch_size == 27


# -- memory budgets and out-of-memory ----------------------------------------------------------------


def test_out_of_memory_fails_the_newest_requests_until_every_gpu_fits() -> None:
    from nodes.scaling.memory_budget import MemoryCosts, SequenceUse, out_of_memory, used_bytes

    hosts = {0: ["g0"], 1: ["g0", "g1"]}
    costs = MemoryCosts(layer_bytes=100, kv_bytes_per_token_layer=1, fixed_bytes={"g0": 50})
    old = SequenceUse(0, {0: "g0", 1: "g0"}, tokens=10, new_tokens=1)
    new = SequenceUse(1, {0: "g0", 1: "g1"}, tokens=20, new_tokens=1)
    # g0: 50 fixed + 2 layers + old's 2 x 11 + new's 1 x 21; g1: 1 layer + new's 21
    assert used_bytes(hosts, [old, new], costs, with_new_tokens=True) == {"g0": 293, "g1": 121}
    assert out_of_memory(hosts, [old, new], costs, {"g0": 300}) == ([], {"g0": 293, "g1": 121})
    assert out_of_memory(hosts, [old, new], costs, {"g0": 280})[0] == [1]  # the newest goes: 272 fits
    assert out_of_memory(hosts, [new, old], costs, {"g0": 260})[0] == [1, 0]  # then the next: 250
    assert out_of_memory(hosts, [old, new], costs, {"g0": 240})[0] == [1, 0]  # weights alone overfill it
    assert out_of_memory(hosts, [old, new], costs, {"g1": 110})[0] == [1]  # only the one with KV on g1


def test_eq3_by_share_is_eq3_when_time_is_proportional_and_saves_nothing_when_it_is_not():
    from nodes.scaling.placement import Placement
    from nodes.scaling.speedup_model import speedup, speedup_by_share

    placement = Placement.single(4, "g0").add_replica(1, "g1").add_replica(2, "g1")
    compute, transfer = {"g0": 2.0, "g1": 2.0}, {"g0": 0.5, "g1": 0.5}
    proportional = speedup_by_share(placement, lambda g, share: share * compute[g], transfer)
    assert proportional == pytest.approx(speedup(placement, compute, transfer))
    # a memory-bound step: every copy reads the layer's weights whatever its share, so only transfers change
    flat = speedup_by_share(placement, lambda g, share: 2.0, transfer)
    assert flat == pytest.approx(8.0 / (8.0 + 0.5 * (0.5 + 0.5))) and flat < 1
