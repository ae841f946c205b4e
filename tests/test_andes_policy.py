"""Andes' policy, checked exactly: the server's shadow of Eq. 1 and its lookahead (Eq. 2), Algorithm 1
against hand traces (its ``break`` included), Algorithm 2 against brute force, B_min/B_max from a
latency table, the trigger, the preemption cap P, and the fcfs and round-robin baselines."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from analysis.metrics import qoe
from nodes.serving.knapsack import exact_pack, greedy_pack, largest_batch
from nodes.serving.qoe_shadow import BufferShadow, future_digested_area, predicted_qoe
from nodes.serving.schedulers import SCHEDULERS, SchedulerSettings, Snapshot, batch_bounds, triggered


def digested_by_definition(token_times: np.ndarray, tds: float, t: np.ndarray) -> np.ndarray:
    """Brief, pitfall 1: A(t) = min(delivered(t), min_j (j + s (t - t_j))) over tokens j delivered by t."""
    delivered = np.searchsorted(token_times, t, side="right")
    out = np.zeros_like(t)
    for k, when in enumerate(t):
        got = token_times[: delivered[k]]
        out[k] = 0.0 if not len(got) else min(float(delivered[k]), float(np.min(np.arange(len(got)) + tds * (when - got))))
    return out


def numeric_qoe(token_times: np.ndarray, ttft: float, tds: float, horizon: float) -> float:
    grid = np.linspace(0.0, horizon, 40001)
    actual = np.trapezoid(digested_by_definition(token_times, tds, grid), grid)
    expected = np.trapezoid(np.maximum(0.0, tds * (grid - ttft)), grid)
    return min(1.0, actual / expected)


@pytest.mark.parametrize("seed", range(6))
def test_the_shadow_buffer_gives_eq1_of_its_delivered_tokens(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tds, ttft = float(rng.uniform(2, 8)), 1.0
    gaps = rng.exponential(1.0 / rng.uniform(1, 12), size=int(rng.integers(5, 40)))
    times = np.cumsum(gaps) + rng.uniform(0.2, 3.0)
    shadow = BufferShadow(ttft, tds)
    for t in times:
        shadow.deliver(float(t))
    horizon = float(times[-1] + rng.uniform(0, 2))
    assert shadow.qoe(horizon) == pytest.approx(numeric_qoe(times, ttft, tds, horizon), abs=2e-3)


def test_the_shadow_agrees_with_the_analysis_metric_when_the_response_outpaces_the_expected_curve() -> None:
    # analysis.metrics.qoe caps the expected curve at the response length l; the server does not know
    # l and leaves it unbounded. The two are the same while s (TTLT - TTFT_exp) <= l.
    times = np.array([0.4, 0.5, 0.55, 0.7, 0.9, 1.0, 1.2, 1.25, 1.5, 1.6])
    shadow = BufferShadow(1.0, 4.0)
    for t in times:
        shadow.deliver(float(t))
    assert 4.0 * (times[-1] - 1.0) <= len(times)
    assert shadow.qoe(float(times[-1])) == pytest.approx(qoe(times, 1.0, 4.0), rel=1e-9)


def test_a_late_first_token_at_the_expected_speed_gives_the_closed_form() -> None:
    # nothing delivered d after TTFT_exp; from then tokens at s: A(t) = s (t - TTFT - d), so
    # QoE(h) = (h - TTFT - d)^2 / (h - TTFT)^2
    ttft, late, tds, lookahead = 1.0, 0.5, 5.0, 4.0
    now = ttft + late
    got = predicted_qoe(0.0, 0.0, 0.0, ttft, tds, now, lookahead, tds, 0.0)
    h = now + lookahead
    assert float(got) == pytest.approx((h - ttft - late) ** 2 / (h - ttft) ** 2, rel=1e-12)
    # left waiting, it stays at 0; served slower (s / 2), in between
    assert float(predicted_qoe(0.0, 0.0, 0.0, ttft, tds, now, lookahead, 0.0, 0.0)) == 0.0
    slower = float(predicted_qoe(0.0, 0.0, 0.0, ttft, tds, now, lookahead, tds / 2, 0.0))
    assert 0.0 < slower < float(got)


@pytest.mark.parametrize("seed", range(8))
def test_the_lookahead_area_is_the_integral_of_the_digested_curve(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    for _ in range(50):
        n = float(rng.integers(0, 30))
        a = float(rng.uniform(0, n)) if rng.random() < 0.8 else n
        s, r = float(rng.uniform(1, 10)), float(rng.choice([0.0, rng.uniform(0.5, 15)]))
        d, h = float(rng.choice([0.0, rng.uniform(0, 3)])), float(rng.uniform(0.1, 8))
        tau = np.linspace(0, h, 20001)
        curve = np.minimum(a + s * tau, n + min(r, s) * np.maximum(0, tau - d))
        assert float(future_digested_area(a, n, s, r, d, h)) == pytest.approx(np.trapezoid(curve, tau), rel=1e-5, abs=1e-6)


def test_greedy_packing_takes_by_gain_per_token_and_stops_at_the_first_misfit() -> None:
    # priorities 0.01, 0.0015, 0.0001: the second (400 tokens) does not fit in 300, and the paper's
    # `break` ends the packing there, although the third (10 tokens) would fit
    chosen = greedy_pack(np.array([1.0, 0.6, 0.001]), np.array([100, 400, 10]), batch=3, capacity_tokens=300)
    assert chosen.tolist() == [True, False, False]
    # by priority, not by gain: 0.4 over 50 tokens (0.008) goes before 0.5 over 300 (0.0017)
    chosen = greedy_pack(np.array([0.9, 0.5, 0.4]), np.array([100, 300, 50]), batch=3, capacity_tokens=350)
    assert chosen.tolist() == [True, False, True]
    # the batch size binds before the memory does
    chosen = greedy_pack(np.array([0.9, 0.5, 0.4]), np.array([10, 10, 10]), batch=2, capacity_tokens=1000)
    assert chosen.tolist() == [True, True, False]


@pytest.mark.parametrize("seed", range(10))
def test_the_dp_equals_brute_force_on_small_instances(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 11))
    gains, lengths = rng.uniform(0, 1, n), rng.integers(1, 40, n)
    capacity = int(rng.integers(20, 200))
    for batch in range(0, n + 1):
        feasible = [c for c in itertools.combinations(range(n), batch) if lengths[list(c)].sum() <= capacity]
        chosen = exact_pack(gains, lengths, batch, capacity)
        if not feasible:
            assert chosen is None
            continue
        assert chosen is not None and int(chosen.sum()) == batch and lengths[chosen].sum() <= capacity
        assert gains[chosen].sum() == pytest.approx(max(gains[list(c)].sum() for c in feasible), rel=1e-12)


def test_the_dp_counts_memory_in_whole_blocks() -> None:
    # 17 tokens take two 16-token blocks: two such requests need 4 blocks, and 3 blocks (48 tokens) hold one
    assert exact_pack(np.array([1.0, 1.0]), np.array([17, 17]), 2, 48, block_tokens=16) is None
    assert exact_pack(np.array([1.0, 1.0]), np.array([17, 17]), 2, 64, block_tokens=16) is not None
    assert exact_pack(np.array([1.0, 1.0]), np.array([17, 17]), 2, 48, block_tokens=1) is not None


def snapshot(**given: object) -> Snapshot:
    """A few requests of 100 tokens each, M = 1000, nothing running, latency(B) = 0.05 + 0.002 B."""
    count = len(given.get("need_tokens", [100, 100, 100]))  # type: ignore[arg-type]
    base = {
        "now_s": 10.0, "capacity_tokens": 1000, "max_batch": 64,
        "latency_s": np.concatenate([[np.nan], 0.05 + 0.002 * np.arange(1, 65)]), "lookahead_s": 5.0,
        "running": np.zeros(count, dtype=bool), "need_tokens": np.full(count, 100),
        "arrival_s": np.arange(count, dtype="float64"), "queued_s": np.arange(count, dtype="float64"),
        "served_iterations": np.zeros(count, dtype="int64"), "delay_if_served_s": np.full(count, 0.1),
        "expected_ttft_s": np.full(count, 1.0), "expected_tds": np.full(count, 4.8),
        "delivered": np.zeros(count), "digested": np.zeros(count), "digested_area": np.zeros(count),
        "ever_run": np.zeros(count, dtype=bool),
    }  # fmt: skip
    for key, value in given.items():
        base[key] = np.asarray(value) if isinstance(value, list) else value
    return Snapshot(**base)  # type: ignore[arg-type]


def test_batch_bounds_come_from_the_latency_table_and_the_memory() -> None:
    latency = np.array([np.nan, 0.10, 0.10, 0.12, 0.15, 0.20, 0.30])
    shot = snapshot(need_tokens=[100, 50, 200, 10, 500, 500], capacity_tokens=170, max_batch=6, latency_s=latency,
                    expected_tds=[8.0, 4.0, 4.0, 4.0, 4.0, 4.0])  # fmt: skip
    # the most demanding TDS is 8 tok/s: latency(B) <= 0.125 s up to B = 3; 10 + 50 + 100 <= 170 < + 200
    assert batch_bounds(shot) == (3, 3)
    assert batch_bounds(replace(shot, capacity_tokens=10_000)) == (3, 6)
    assert batch_bounds(replace(shot, expected_tds=np.full(6, 20.0))) == (1, 3)  # none fast enough: 1


def test_andes_solves_only_above_the_watermark_or_when_the_batch_is_too_slow() -> None:
    settings = SchedulerSettings()
    calm = snapshot(running=[True, True, False], need_tokens=[300, 300, 100])
    assert not triggered(calm, settings)
    assert triggered(replace(calm, need_tokens=np.array([460, 460, 100])), settings)  # 920 > 900
    slow = replace(calm, latency_s=np.full(65, 0.25))  # 4 tok/s a request < 4.8 expected
    assert triggered(slow, settings)
    untriggered = SCHEDULERS["andes"](calm, settings)
    assert not untriggered.solved and untriggered.run.tolist() == SCHEDULERS["fcfs"](calm, settings).run.tolist()


def test_andes_serves_the_starving_request_where_fcfs_serves_the_first_arrived() -> None:
    # room for two of three; request 0 arrived first and has 40 tokens buffered, 1 and 2 have none
    shot = snapshot(running=[True, True, False], need_tokens=[460, 460, 460], arrival_s=[0.0, 1.0, 2.0],
                    delivered=[60, 10, 0], digested=[20, 10, 0], digested_area=[100, 30, 0], ever_run=[True, True, False],
                    now_s=6.0)  # fmt: skip
    fcfs = SCHEDULERS["fcfs"](shot, SchedulerSettings())
    assert fcfs.run.tolist() == [True, True, False]
    decision = SCHEDULERS["andes"](shot, SchedulerSettings())
    assert decision.solved
    assert decision.run.tolist() == [False, True, True]  # 0 reads from its buffer while 2 gets its first token
    assert decision.preempted == 1


def test_the_preemption_cap_keeps_running_what_it_cannot_preempt() -> None:
    # Andes would swap both running requests (buffers full) for the two starving ones; with P = 1,
    # 3 preemptions over 4 admitted so far allow one more
    shot = snapshot(running=[True, True, False, False], need_tokens=[460, 460, 460, 460], arrival_s=[0.0, 1.0, 2.0, 3.0],
                    delivered=[80, 70, 0, 0], digested=[20, 20, 0, 0], digested_area=[100, 100, 0, 0],
                    ever_run=[True, True, True, True], now_s=8.0, preemptions_total=3, admitted_total=4)  # fmt: skip
    free = SCHEDULERS["andes"](replace(shot, preemptions_total=0), SchedulerSettings())
    assert free.preempted == 2 and free.run.tolist() == [False, False, True, True]
    capped = SCHEDULERS["andes"](shot, SchedulerSettings())
    assert capped.preempted == 1 and int(capped.run.sum()) == 2
    assert int(shot.need_tokens[capped.run].sum()) <= shot.capacity_tokens
    none_left = SCHEDULERS["andes"](replace(shot, preemptions_total=4), SchedulerSettings())
    assert none_left.preempted == 0 and none_left.run.tolist() == [True, True, False, False]


def test_fcfs_preempts_the_latest_arrival_and_admits_nothing_in_that_iteration() -> None:
    shot = snapshot(running=[True, True, True, False], need_tokens=[400, 400, 300, 10], arrival_s=[0.0, 2.0, 1.0, 3.0])
    decision = SCHEDULERS["fcfs"](shot, SchedulerSettings())
    assert decision.run.tolist() == [True, False, True, False] and decision.preempted == 1


def test_fcfs_admits_in_arrival_order_and_the_head_of_the_queue_blocks_the_rest() -> None:
    shot = snapshot(running=[True, False, False, False], need_tokens=[300, 200, 600, 10], arrival_s=[0.0, 1.0, 2.0, 3.0])
    assert SCHEDULERS["fcfs"](shot, SchedulerSettings()).run.tolist() == [True, True, False, False]


def test_round_robin_sends_a_request_whose_turn_is_over_to_the_back_when_others_wait() -> None:
    shot = snapshot(running=[True, True, False], need_tokens=[450, 450, 450], served_iterations=[50, 10, 0],
                    queued_s=[0.0, 1.0, 2.0])  # fmt: skip
    decision = SCHEDULERS["rr"](shot, SchedulerSettings(rr_interval=50))
    assert decision.run.tolist() == [False, True, True] and decision.preempted == 1
    alone = replace(shot, running=np.array([True, True, True]), need_tokens=np.array([300, 300, 300]))
    assert SCHEDULERS["rr"](alone, SchedulerSettings(rr_interval=50)).run.all()


def test_the_dp_never_packs_less_gain_than_the_greedy_for_the_same_batch() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        n = int(rng.integers(2, 12))
        gains, lengths, capacity = rng.uniform(0, 1, n), rng.integers(1, 100, n), int(rng.integers(50, 400))
        batch = int(rng.integers(1, n + 1))
        greedy = greedy_pack(gains, lengths, batch, capacity)
        exact = exact_pack(gains, lengths, int(greedy.sum()), capacity)
        assert exact is not None and gains[exact].sum() >= gains[greedy].sum() - 1e-12


@pytest.mark.parametrize("name", ["fcfs", "rr", "andes", "andes-dp"])
def test_every_scheduler_keeps_the_batch_within_the_memory_and_the_batch_limit(name: str) -> None:
    rng = np.random.default_rng(11)
    for _ in range(30):
        count = 10
        delivered = rng.integers(0, 40, count).astype("float64")
        running = rng.random(count) < 0.5
        need = rng.integers(50, 400, count)
        while need[running].sum() > 1200 or running.sum() > 4:  # it fit when admitted; it may have outgrown M
            running[np.flatnonzero(running)[-1]] = False
        shot = snapshot(need_tokens=need, running=running, arrival_s=np.sort(rng.uniform(0, 5, count)),
                        delivered=delivered, digested=delivered * rng.uniform(0, 1, count),
                        digested_area=rng.uniform(0, 50, count), expected_tds=rng.uniform(3, 6, count),
                        ever_run=running | (delivered > 0), served_iterations=rng.integers(0, 80, count),
                        capacity_tokens=1000, max_batch=4, now_s=8.0)  # fmt: skip
        decision = SCHEDULERS[name](shot, SchedulerSettings(dp_block_tokens=1))
        assert int(shot.need_tokens[decision.run].sum()) <= shot.capacity_tokens
        assert int(decision.run.sum()) <= shot.max_batch
        assert decision.preempted == int(np.sum(shot.running & ~decision.run))


def test_b_max_adds_the_shortest_first() -> None:
    assert largest_batch(np.array([5, 1, 3]), 4) == 2
    assert largest_batch(np.array([5, 1, 3]), 9) == 3
