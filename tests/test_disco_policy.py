"""DiSCo's dispatch policy (nodes/dispatch/policy.py): Algorithm 1's regime, Algorithm 2's wait map and
Algorithm 3's length threshold on hand-made distributions, and the budget they realise on random ones."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.dispatch.policy import (
    LengthDistribution,
    ServerTtft,
    TokenCosts,
    constrained_endpoint,
    length_threshold,
    wait_map,
)

# four lengths, equally likely: their token shares l p(l) / E[l] are 0.1, 0.2, 0.3, 0.4
FOUR = LengthDistribution.from_samples([10, 20, 30, 40])
UNIFORM = ServerTtft.from_samples(np.arange(1, 1001) / 1000)  # F(w) = w on (0, 1] in steps of 1 ms


def test_the_device_is_constrained_only_when_its_cheapest_token_costs_more_than_the_servers_dearest():
    assert constrained_endpoint(TokenCosts(0.15, 0.60, 0.61, 0.70)) == "device"
    assert constrained_endpoint(TokenCosts(0.15, 0.60, 0.60, 0.70)) == "server"  # a tie is not "more"
    assert constrained_endpoint(TokenCosts(0.15, 0.60, 0.05, 5.0)) == "server"  # one cheap device cost is enough


def test_token_shares_weigh_each_length_by_its_tokens():
    assert FOUR.token_shares() == pytest.approx([0.1, 0.2, 0.3, 0.4])


def test_wait_map_hand_trace():
    # b = 0.4, alpha = 0.1: w_tail = F^-1(0.9) = 0.9 s costs every length 10% of its tokens; the 0.3
    # left starts lengths 10 and 20 at once (0.09 + 0.18) and gives length 30 the wait whose
    # 1 - F(w) = 0.1 + 0.03 / 0.3, w = 0.8 s; length 40 keeps the tail wait
    plan = wait_map(FOUR, UNIFORM, budget=0.4, alpha=0.1)
    assert plan.tail_wait_s == pytest.approx(0.9)
    assert list(plan.waits_s) == pytest.approx([0.0, 0.0, 0.8, 0.9])
    assert plan.device_share(FOUR, UNIFORM) == pytest.approx(0.4)
    assert plan.wait_s(25) == pytest.approx(0.8) and plan.wait_s(41) == pytest.approx(0.9)


def test_a_budget_within_the_tail_ratio_only_protects_the_tail():
    plan = wait_map(FOUR, UNIFORM, budget=0.05, alpha=0.1)
    assert list(plan.waits_s) == pytest.approx([0.95] * 4)  # F^-1(1 - min(alpha, b))
    assert plan.device_share(FOUR, UNIFORM) == pytest.approx(0.05)


def test_a_full_device_budget_starts_every_length_at_once():
    plan = wait_map(FOUR, UNIFORM, budget=1.0, alpha=0.01)
    assert list(plan.waits_s) == [0.0] * 4 and plan.device_share(FOUR, UNIFORM) == pytest.approx(1.0)


def test_length_threshold_hand_trace_splits_the_boundary_length():
    # b = 0.5: lengths 10 and 20 hold 0.3 of the tokens; 2/3 of length 30's requests make up the 0.5
    plan = length_threshold(FOUR, budget=0.5)
    assert plan.length_tokens == 30 and plan.boundary_device_only == pytest.approx(2 / 3)
    assert plan.server_share(FOUR) == pytest.approx(0.5)
    assert plan.device_only(20, 0.99) and not plan.device_only(40, 0.0)
    assert plan.device_only(30, 0.5) and not plan.device_only(30, 0.7)


@pytest.mark.parametrize(("budget", "server_share"), [(0.0, 0.0), (1.0, 1.0), (0.7, 0.7)])
def test_length_threshold_at_the_ends_and_on_a_boundary(budget: float, server_share: float):
    assert length_threshold(FOUR, budget).server_share(FOUR) == pytest.approx(server_share)


@pytest.mark.parametrize("seed", range(5))
def test_both_plans_realise_the_budget_on_random_distributions(seed: int):
    rng = np.random.default_rng(seed)
    lengths = LengthDistribution.from_samples(np.maximum(1, rng.lognormal(3.5, 0.8, 2000).astype(int)))
    ttft = ServerTtft.from_samples(rng.lognormal(-0.9, 0.7, 5000))  # heavy-tailed, median ~0.4 s
    for budget in (0.0, 0.02, 0.1, 0.3, 0.5, 0.8, 1.0):
        assert length_threshold(lengths, budget).server_share(lengths) == pytest.approx(budget, abs=1e-9)
        plan = wait_map(lengths, ttft, budget, alpha=0.05)
        assert plan.device_share(lengths, ttft) == pytest.approx(budget, abs=2e-3)  # F's steps: 1/5000
        assert np.all(np.diff(plan.waits_s) >= 0)  # a longer prompt never waits less
        assert plan.waits_s.max() <= plan.tail_wait_s


def test_bad_budgets_and_tail_ratios_are_refused():
    with pytest.raises(ValueError, match="within \\[0, 1\\]"):
        length_threshold(FOUR, 1.2)
    with pytest.raises(ValueError, match="alpha"):
        wait_map(FOUR, UNIFORM, 0.5, alpha=0.0)
    with pytest.raises(ValueError, match="at least 1 token"):
        LengthDistribution.from_samples([0, 3])
