"""DiSCo's trace-driven runs: the race, the billing, the client buffer and migration (Eq. 4-5), on
hand-made requests whose times can be worked out by hand, and the report tables on a small sweep."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from analysis.cost_model import SERVICE_APIS, DispatchPrices
from analysis.dispatch import cost_curves, migration_table, tail_reduction_table
from nodes.dispatch.controller import GENERATION_CAP_TOKENS, NEVER, DispatchPlan, MigrationRule, plan_dispatch
from nodes.dispatch.policy import (
    LengthDistribution,
    LengthThreshold,
    ServerTtft,
    TokenCosts,
    WaitMap,
    constrained_endpoint,
)
from nodes.dispatch.replay import ReplayInput, display_times, replay
from nodes.endpoints.device_speed import DEVICE_SPEEDS, DeviceSpeed, LinearTtft
from nodes.endpoints.services import SERVICES, Lognormal, ServiceModel

R_C = 4.8
DEVICE = DeviceSpeed("hand", prefill_tok_s=10.0, decode_tok_s=20.0, model="bloom-1.1b")
GAPS = GENERATION_CAP_TOKENS - 1


def hand_run(prompts, outputs, server_ttft, gap_s=0.01, migration_ttft=None, draws=None) -> ReplayInput:
    n = len(prompts)
    return ReplayInput(np.array(prompts), np.array(outputs), np.array(server_ttft, dtype=float),
                       np.full((n, GAPS), gap_s), np.array(migration_ttft if migration_ttft else server_ttft, dtype=float),
                       np.array(draws if draws else [0.5] * n), np.ones(n))  # fmt: skip


def test_the_client_buffer_shows_tokens_no_faster_than_reading_speed():
    shown = display_times(np.array([0.0, 0.01, 0.02, 1.0, 1.01]), R_C)
    step = 1 / R_C
    assert shown == pytest.approx([0.0, step, 2 * step, 1.0, 1.0 + step])


def test_the_race_goes_to_the_first_token_and_bills_the_cancelled_server_in_full():
    race = DispatchPlan("disco-s", 1.0, threshold=LengthThreshold(1, 0.0))  # every prompt races
    # device: 5 tokens at 10 tok/s = 0.5 s; server 2.0 s (request 0) and 0.3 s (request 1)
    result = replay(race, hand_run([5, 5], [3, 3], [2.0, 0.3]), DEVICE, R_C)
    assert result.ttft_s == pytest.approx([0.5, 0.3])
    assert list(result.winner_device) == [True, False]
    assert list(result.server_input_tokens) == [5, 5]  # cancelled or not, the server bills the prompt
    assert list(result.server_output_tokens) == [0, 3]
    # the device finished request 0's prefill and was cancelled 0.3 s into request 1's (60% of it)
    assert result.device_prefill_tokens == pytest.approx([5.0, 3.0])
    assert list(result.device_decode_tokens) == [3, 0]


def test_disco_d_starts_the_device_only_when_the_server_has_not_answered_by_the_wait():
    waits = WaitMap(np.array([5]), np.array([0.5]), 0.5)
    plan = DispatchPlan("disco-d", 0.3, waits=waits)
    # server answers at 0.3 (before the wait), 1.2 (device started at 0.5, done at 1.0) and 0.7
    result = replay(plan, hand_run([5, 5, 5], [2, 2, 2], [0.3, 1.2, 0.7]), DEVICE, R_C)
    assert result.ttft_s == pytest.approx([0.3, 1.0, 0.7])
    assert result.race_device_prefill_tokens == pytest.approx([0.0, 5.0, 2.0])  # 0.2 s of a 0.5 s prefill
    assert result.realised_budget("device") == pytest.approx(7.0 / 15.0)


def test_stoch_routes_each_request_to_one_endpoint_and_realises_its_budget():
    rng = np.random.default_rng(3)
    prompts = rng.integers(5, 40, 4000)
    run = ReplayInput.draw(SERVICES["gpt"], prompts, np.full(4000, 10), rng)
    for policy, regime in (("stoch-s", "server"), ("stoch-d", "device")):
        plan = plan_dispatch(policy, 0.3, LengthDistribution.from_samples(prompts), ServerTtft.from_samples([0.4]))
        result = replay(plan, run, DEVICE_SPEEDS["pixel7pro-bloom-1.1b"], R_C)
        assert not np.any((result.server_input_tokens > 0) & (result.device_prefill_tokens > 0))
        assert result.realised_budget(regime) == pytest.approx(0.3, abs=0.03)


def test_disco_cuts_the_tail_against_stoch_at_the_same_budget():
    rng = np.random.default_rng(11)
    service, device = SERVICES["gpt"], DEVICE_SPEEDS["pixel7pro-bloom-1.1b"]
    calibration = rng.integers(5, 60, 1000)
    lengths = LengthDistribution.from_samples(calibration)
    ttft = ServerTtft.from_samples(service.ttft_s(rng, 1000))
    run = ReplayInput.draw(service, rng.integers(5, 60, 1000), np.full(1000, 20), rng)
    for stoch, disco, regime in (("stoch-s", "disco-s", "server"), ("stoch-d", "disco-d", "device")):
        base = replay(plan_dispatch(stoch, 0.5, lengths, ttft), run, device, R_C)
        ours = replay(plan_dispatch(disco, 0.5, lengths, ttft), run, device, R_C)
        assert np.percentile(ours.ttft_s, 99) < np.percentile(base.ttft_s, 99)
        assert ours.realised_budget(regime) <= 0.5 + 0.05


def rule_for(costs: TokenCosts, server_median_s: float = 0.4, keeps_streaming: bool = True) -> MigrationRule:
    return MigrationRule.from_calibration(costs, R_C, LinearTtft(0.1, 0.0, 1.0, 10),
                                          ServerTtft.from_samples([server_median_s]), [40] * 10,
                                          keeps_streaming)  # fmt: skip


SERVER_DEAR = TokenCosts(server_prefill=1.0, server_decode=4.0, device_prefill=1.0, device_decode=1.0)


def test_eq4_migrates_when_the_saved_decode_exceeds_the_target_prefill():
    rule = rule_for(SERVER_DEAR)
    assert rule.remaining_after[1] == 39  # every calibration output is 40 tokens
    assert rule.worth_it("server", prompt_tokens=10, generated=1)  # 3 x 39 > 1 x 11
    assert not rule.worth_it("server", prompt_tokens=200, generated=1)  # 117 < 201
    assert not rule.worth_it("device", prompt_tokens=10, generated=1)  # the device decodes cheaper
    assert rule.buffer_tokens("server", np.array([10]))[0] == np.ceil(R_C * 1.0)  # Eq. 5 with t_m = T_d(10)
    assert rule.buffer_tokens("device", np.array([10]))[0] == np.ceil(R_C * 0.4)


def test_a_migrated_stream_is_whole_billed_once_and_shown_at_reading_speed():
    race = DispatchPlan("disco-s", 1.0, threshold=LengthThreshold(1, 0.0))
    # the server wins (device prefill 1.0 s) and streams 100 tokens at 20 tok/s, until 5.15 s: the device
    # is ready (prompt + about 9 tokens at 10 tok/s) long before
    run = hand_run([10], [100], [0.2], gap_s=0.05)
    plain = replay(race, run, DEVICE, R_C)
    moved = replay(race, run, DEVICE, R_C, rule_for(SERVER_DEAR))
    assert moved.migrated[0] and not plain.migrated[0]
    assert moved.held_tokens[0] >= 5  # B = ceil(4.8 x T_d(10 + g)) = 5 or more
    handoff = moved.server_output_tokens[0]
    assert 0 < handoff < 100 and handoff + moved.device_decode_tokens[0] == 100
    assert moved.device_prefill_tokens[0] == pytest.approx(plain.device_prefill_tokens[0] + 10 + handoff)
    # the source streamed on until the device was ready: nobody sees a token later
    assert moved.delayed_tokens[0] == 0
    assert moved.last_display_s[0] == pytest.approx(plain.last_display_s[0])
    assert np.max(moved.migrated_display_gaps_s) == pytest.approx(1 / R_C)
    costs = DispatchPrices(1.0, 4.0, 1.0, 1.0)
    before = costs.cost_usd(plain.server_input_tokens, plain.server_output_tokens, plain.device_prefill_tokens,
                            plain.device_decode_tokens)[0]  # fmt: skip
    after = costs.cost_usd(moved.server_input_tokens, moved.server_output_tokens, moved.device_prefill_tokens,
                           moved.device_decode_tokens)[0]  # fmt: skip
    assert after < before


def test_a_source_that_stops_at_the_start_lets_a_slow_target_delay_tokens():
    device_dear = TokenCosts(server_prefill=1.0, server_decode=1.0, device_prefill=4.0, device_decode=4.0)
    solo = DispatchPlan("device-only", 0.0)
    # the device streams at 20 tok/s; the server's fresh TTFT (2.0 s) is far above its median (0.4 s)
    run = hand_run([4], [60], [9.9], migration_ttft=[2.0])
    streaming = replay(solo, run, DEVICE, R_C, rule_for(device_dear, keeps_streaming=True))
    stopping = replay(solo, run, DEVICE, R_C, rule_for(device_dear, keeps_streaming=False))
    assert streaming.migrated[0] and stopping.migrated[0]
    assert streaming.delayed_tokens[0] == 0
    assert stopping.delayed_tokens[0] > 0 and stopping.server_output_tokens[0] > streaming.server_output_tokens[0]
    assert np.max(stopping.migrated_display_gaps_s) > 1 / R_C + 1.0  # the display stalled


def test_device_ttft_fit_recovers_k_and_c():
    lengths = np.arange(5, 100, 5)
    fit = LinearTtft.fit(lengths, 0.2 + lengths / 31.32)
    assert fit.seconds_per_token == pytest.approx(1 / 31.32)
    assert fit.intercept_s == pytest.approx(0.2)
    assert fit.pearson == pytest.approx(1.0)
    with pytest.raises(ValueError):
        LinearTtft.fit([10, 10], [0.3, 0.4])


def test_service_traces_have_their_median_and_a_heavy_tail():
    rng = np.random.default_rng(5)
    for service in SERVICES.values():
        ttft = service.ttft_s(rng, 20000)
        assert np.median(ttft) == pytest.approx(service.ttft_body.median_s, rel=0.05)
        assert np.percentile(ttft, 99) > 2.0 * np.median(ttft)
    recorded = ServiceModel.from_samples("lab", [0.3, 0.5, 2.0], Lognormal(0.02, 0.0))
    assert set(recorded.ttft_s(rng, 100)) <= {0.3, 0.5, 2.0}


def test_algorithm_1_follows_the_exchange_rate_of_each_regime():
    for regime, expected in (("server", "server"), ("device", "device")):
        prices = DispatchPrices.for_run(SERVICE_APIS["gpt"], "bloom-1.1b", regime, 20.0)
        costs = TokenCosts(prices.server_prefill, prices.server_decode, prices.device_prefill, prices.device_decode)
        assert constrained_endpoint(costs) == expected


def test_never_starting_either_endpoint_is_an_error():
    plan = DispatchPlan("disco-d", 0.0, waits=WaitMap(np.array([5]), np.array([NEVER]), NEVER))
    run = hand_run([5], [2], [NEVER])
    with pytest.raises(ValueError):
        replay(plan, run, DEVICE, R_C)


def test_the_report_tables_read_a_sweep():
    rows = []
    for budget in (0.0, 0.5, 1.0):
        for policy, p99 in (("stoch-s", 2.0), ("disco-s", 1.0 if budget else 2.0)):
            for migration in (False, True) if policy == "disco-s" else (False,):
                rows.append({"trace": "gpt", "regime": "server", "device": "d1", "budget": budget, "policy": policy,
                             "migration": migration, "p99_ttft_s": p99, "mean_ttft_s": p99 / 2,
                             "realised_budget": budget, "cost_usd_per_request": 1.0 if not migration else 0.25,
                             "migrated_share": 0.5 if migration else 0.0, "held_tokens_mean": 4.0,
                             "held_tokens_p99": 6.0, "slipped_tokens_mean": 0.0, "migrated_tbt_p99_s": 0.21})  # fmt: skip
    frame = pd.DataFrame(rows)
    assert tail_reduction_table(frame).loc[("gpt", "server"), "d1"] == pytest.approx(100 * (0 + 0.5 + 0.5) / 3)
    assert set(cost_curves(frame)["cut_pct"]) == {75.0}
    table3 = migration_table(frame)
    assert table3.loc[0, "held_tokens_mean"] == 4.0 and table3.loc[0, "tbt_p99_s"] == 0.21


def test_a_seeded_trace_endpoint_draws_what_the_replay_draws():
    from nodes.dispatch.replay import draw_seeded
    from nodes.endpoints.pace import TracePace

    service = SERVICES["command"]
    pace = TracePace(service, seed=0).seeded(42)  # what the endpoint draws for a request with seed 42
    live = [pace.first_token_s(10)] + [pace.gap_s() for _ in range(5)]
    run = draw_seeded(service, np.array([10, 12]), np.array([6, 6]), [42, 43], np.zeros(2))
    assert live == pytest.approx([run.server_ttft_s[0], *run.server_gaps_s[0, :5]])
    assert run.server_ttft_s[1] != run.server_ttft_s[0]  # another seed, another draw
