"""Metrics and cost model (analysis.metrics, analysis.cost_model) against hand-computed values.

Every expected number below is derived in a comment from the definitions (Andes Eq. 1, HAT Sec. 5.1-5.2,
DiSCo App. E), never by calling the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import metrics
from analysis.cost_model import (
    DISCO_SHAPES,
    ModelShape,
    api_price_usd,
    flops_per_token,
    head_flops,
    layer_flops,
    request_flops,
)

EXACT = {"rel": 1e-9, "abs": 1e-12}


def approx(value):
    return pytest.approx(value, **EXACT)


def request_row(run_id="r1", node="d1", request_id=0, *, arrival=0.0, first=None, last=None, prompt=128,
                output=1, completed=True, **extra) -> dict:  # fmt: skip
    return {"run_id": run_id, "node": node, "request_id": request_id, "arrival_s": arrival,
            "first_token_s": first, "last_token_s": last, "prompt_tokens": prompt, "output_tokens": output,
            "completed": completed, **extra}  # fmt: skip


def token_rows(run_id: str, node: str, request_id: int, times: list[float]) -> list[dict]:
    return [{"run_id": run_id, "node": node, "request_id": request_id, "index": i, "ts_s": t}
            for i, t in enumerate(times)]  # fmt: skip


def shuffled(frame: pd.DataFrame, seed: int = 3) -> pd.DataFrame:
    return frame.sample(frac=1.0, random_state=seed).reset_index(drop=True)


# -- Andes QoE (Eq. 1) ------------------------------------------------------------------------------
# Notation: T(t) = tds (t - ttft) capped at l; A(t) the digested curve; areas over [0, TTLT].


def test_qoe_is_one_for_delivery_exactly_on_the_expected_curve():
    # ttft 1, tds 1, tokens at 1, 2, 3 (l = 3, TTLT = 3).
    # S_expected = ramp from 1 to 3 under t - 1 = 2^2 / 2 = 2.
    # A: [1,2) min(1, t-1) -> 1/2; [2,3) min(2, t-1) -> (1+2)/2 = 3/2; S_actual = 2. QoE = 1.
    assert metrics.qoe([1.0, 2.0, 3.0], 1.0, 1.0) == approx(1.0)
    # same at tds 2: tokens at 0.5, 1.0, 1.5, 2.0 with ttft 0.5 -> S_e = 2 * 1.5^2 / 2 = 2.25 = S_a
    assert metrics.qoe([0.5, 1.0, 1.5, 2.0], 0.5, 2.0) == approx(1.0)


def test_qoe_of_a_late_start_at_the_expected_speed():
    # ttft 1, tds 1, tokens 1 s late at 2, 3, 4 (l = 3, TTLT = 4).
    # S_e: ramp from 1 to min(4, 1 + 3/1) = 4 -> 3^2 / 2 = 9/2.
    # A(t) = t - 2 on [2, 4] (always below the delivered count) -> 2^2 / 2 = 2. QoE = 2 / 4.5 = 4/9.
    assert metrics.qoe([2.0, 3.0, 4.0], 1.0, 1.0) == approx(4 / 9)


def test_qoe_of_delivery_at_half_the_expected_speed():
    # ttft 1, tds 2, tokens at 1, 2, 3 (1 tok/s, l = 3, TTLT = 3).
    # S_e: ramp ends at 1 + 3/2 = 2.5: 2 * 1.5^2 / 2 = 2.25, then flat 3 * 0.5 = 1.5 -> 3.75.
    # A on [1,2): min(1, 2(t-1)): triangle to t = 1.5 (0.25) + 1 * 0.5 -> 0.75.
    # A on [2,3): min(2, 1 + 2(t-2)) (token 2's line): from 1 to 2 by t = 2.5 (0.75) + 2 * 0.5 -> 1.75.
    # S_a = 2.5; QoE = 2.5 / 3.75 = 2/3.
    assert metrics.qoe([1.0, 2.0, 3.0], 1.0, 2.0) == approx(2 / 3)


def test_qoe_of_a_stall_followed_by_a_burst():
    # ttft 1, tds 1, tokens at 1, 2, (stall) 5, 5, (stall) 8: l = 5, TTLT = 8.
    # S_e: ramp 1..6 -> 5^2/2 = 12.5, flat 6..8 -> 5 * 2 = 10; total 22.5.
    # A: [1,2) t-1 -> 0.5; [2,5) min(2, t-1): 1.5 on [2,3] + 2 * 2 on [3,5] -> 5.5;
    # at 5 two tokens arrive (4 delivered) but A(5) = 2, so A = min(4, 2 + (t-5)) = min(4, t-3):
    # [5,7] (2+4)/2 * 2 = 6, [7,8) 4 -> 10. S_a = 0.5 + 5.5 + 10 = 16. QoE = 16 / 22.5 = 32/45.
    assert metrics.qoe([1.0, 2.0, 5.0, 5.0, 8.0], 1.0, 1.0) == approx(32 / 45)


def test_qoe_ignores_the_order_the_token_times_come_in():
    assert metrics.qoe([8.0, 5.0, 1.0, 5.0, 2.0], 1.0, 1.0) == approx(32 / 45)


def test_qoe_buffered_tokens_cover_a_later_delay():
    # ttft 1, tds 1, tokens at 1, 1, 3: l = 3, TTLT = 3. S_e = 2^2/2 = 2 (ramp 1..3).
    # A on [1,3): min(2, t-1) reaches 2 only at 3 -> 2. QoE = 1: the second token was buffered.
    assert metrics.qoe([1.0, 1.0, 3.0], 1.0, 1.0) == approx(1.0)


def test_qoe_is_capped_at_one_when_faster_than_expected():
    # ttft 1, tds 1, tokens at 0.5, 1, 1.5: S_e = 0.5^2/2 = 0.125; S_a = 0.125 + 0.375 = 0.5 -> ratio 4 -> 1.
    assert metrics.qoe([0.5, 1.0, 1.5], 1.0, 1.0) == 1.0


def test_qoe_is_one_when_everything_arrives_before_the_expected_first_token():
    # S_e = 0 over [0, TTLT] when TTLT <= ttft
    assert metrics.qoe([0.5, 1.0], 2.0, 1.0) == 1.0
    assert metrics.qoe([2.0], 2.0, 1.0) == 1.0  # a single token exactly on time: S_e = 0


def test_qoe_of_a_single_late_token_is_zero():
    # ttft 1, tds 1, one token at 3: S_a = 0 (TTLT = t_0); S_e = 0.5 (ramp 1..2) + 1 * 1 (flat 2..3) > 0.
    assert metrics.qoe([3.0], 1.0, 1.0) == 0.0


def test_qoe_alpha_penalises_late_first_tokens_only():
    # late start case (4/9), first token 1 s late: x 0.5^1
    assert metrics.qoe([2.0, 3.0, 4.0], 1.0, 1.0, alpha=0.5) == approx(4 / 9 * 0.5)
    # tokens 0.5 s late at 1.5, 2.5, 3.5 (ttft 1, tds 1, l = 3, TTLT 3.5): S_e = 2.5^2/2 = 3.125,
    # S_a = 2^2/2 = 2 -> 0.64; alpha 0.25 ** 0.5 = 0.5 -> 0.32
    assert metrics.qoe([1.5, 2.5, 3.5], 1.0, 1.0) == approx(0.64)
    assert metrics.qoe([1.5, 2.5, 3.5], 1.0, 1.0, alpha=0.25) == approx(0.32)
    # first token 1 s early, then a stall: tokens 0, 4 (ttft 1, tds 1, l = 2, TTLT 4).
    # S_e: ramp 1..3 = 2, flat 3..4 = 2 -> 4. S_a: min(1, t) on [0,4) = 0.5 + 3 = 3.5 -> 7/8.
    # The early first token is not rewarded: alpha changes nothing.
    assert metrics.qoe([0.0, 4.0], 1.0, 1.0) == approx(7 / 8)
    assert metrics.qoe([0.0, 4.0], 1.0, 1.0, alpha=0.5) == approx(7 / 8)
    # alpha 1 is no penalty; alpha 0 zeroes any late request but leaves an on-time one alone (0 ** 0 = 1)
    assert metrics.qoe([2.0, 3.0, 4.0], 1.0, 1.0, alpha=1.0) == approx(4 / 9)
    assert metrics.qoe([2.0, 3.0, 4.0], 1.0, 1.0, alpha=0.0) == 0.0
    assert metrics.qoe([1.0, 2.0, 3.0], 1.0, 1.0, alpha=0.0) == approx(1.0)


@pytest.mark.parametrize(
    ("times", "tds", "alpha"),
    [([], 1.0, None), ([1.0], 0.0, None), ([1.0], -1.0, None), ([1.0], math.nan, None), ([1.0], math.inf, None),
     ([1.0], 1.0, -0.1), ([1.0], 1.0, 1.5), ([1.0], 1.0, math.nan)],
)  # fmt: skip
def test_qoe_refuses_bad_inputs(times, tds, alpha):
    with pytest.raises(ValueError):
        metrics.qoe(times, 1.0, tds, alpha=alpha)


def qoe_fixture() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Requests in two runs and two nodes (request ids repeat across them) with absolute token times."""
    tds = "expected_tds_tok_s"
    requests = pd.DataFrame([
        # late start: arrival 10, tokens at 12, 13, 14 = 2, 3, 4 from arrival -> 4/9 (1 s late)
        request_row("r1", "d1", 0, arrival=10.0, output=3, expected_ttft_s=1.0, **{tds: 1.0}),
        # half speed: arrival 100, tokens at 101, 102, 103 = 1, 2, 3, tds 2 -> 2/3 (on time)
        request_row("r1", "d2", 0, arrival=100.0, output=3, expected_ttft_s=1.0, **{tds: 2.0}),
        # stall: arrival 0, tokens at 1, 2, 5, 5, 8 -> 32/45 (on time)
        request_row("r2", "d1", 0, arrival=0.0, output=5, expected_ttft_s=1.0, **{tds: 1.0}),
        # incomplete, and without expectations: both left out
        request_row("r2", "d1", 1, arrival=0.0, output=2, completed=False, expected_ttft_s=1.0, **{tds: 1.0}),
        request_row("r2", "d1", 2, arrival=0.0, output=2, expected_ttft_s=np.nan, **{tds: np.nan}),
    ])  # fmt: skip
    tokens = pd.DataFrame(
        token_rows("r1", "d1", 0, [12.0, 13.0, 14.0]) + token_rows("r1", "d2", 0, [101.0, 102.0, 103.0])
        + token_rows("r2", "d1", 0, [1.0, 2.0, 5.0, 5.0, 8.0]) + token_rows("r2", "d1", 1, [50.0, 60.0])
        + token_rows("r2", "d1", 2, [50.0, 60.0])
    )  # fmt: skip
    return requests, shuffled(tokens)


def test_qoe_table_matches_single_request_values():
    requests, tokens = qoe_fixture()
    table = metrics.qoe_table(requests, tokens).set_index(["run_id", "node", "request_id"])["qoe"]
    assert sorted(table.index) == [("r1", "d1", 0), ("r1", "d2", 0), ("r2", "d1", 0)]
    assert table[("r1", "d1", 0)] == approx(4 / 9)
    assert table[("r1", "d2", 0)] == approx(2 / 3)
    assert table[("r2", "d1", 0)] == approx(32 / 45)


def test_qoe_table_applies_alpha_per_request():
    requests, tokens = qoe_fixture()
    table = metrics.qoe_table(requests, tokens, alpha=0.5).set_index(["run_id", "node", "request_id"])["qoe"]
    assert table[("r1", "d1", 0)] == approx(4 / 9 * 0.5)  # 1 s late
    assert table[("r1", "d2", 0)] == approx(2 / 3)  # on time: no penalty
    assert table[("r2", "d1", 0)] == approx(32 / 45)


def test_qoe_table_without_usable_requests_is_empty():
    requests, tokens = qoe_fixture()
    table = metrics.qoe_table(requests[~requests["completed"]], tokens)
    assert table.empty and list(table.columns) == ["run_id", "node", "request_id", "qoe"]


def test_capacity_is_the_highest_rate_before_the_first_failure():
    # rates 1..4 with mean QoE 0.95, 0.90 (passes: >= 0.9), 0.85, 0.95: 3 fails, so 4 does not count -> 2
    assert metrics.capacity_per_s([1, 2, 3, 4], [0.95, 0.90, 0.85, 0.95]) == 2.0
    # unsorted input gives the same answer
    assert metrics.capacity_per_s([3, 1, 4, 2], [0.85, 0.95, 0.95, 0.90]) == 2.0
    assert metrics.capacity_per_s([0.5, 1.5, 1.0], [0.99, 0.91, 0.97]) == 1.5  # all pass: the highest
    assert math.isnan(metrics.capacity_per_s([2, 1, 3], [0.95, 0.89, 0.99]))  # the lowest fails
    assert metrics.capacity_per_s([1, 2, 3], [0.8, 0.75, 0.5], threshold=0.75) == 2.0


# -- latency ----------------------------------------------------------------------------------------


def test_request_latencies_from_hand_made_rows():
    requests = pd.DataFrame([
        request_row("r1", "d1", 0, arrival=1.0, first=1.5, last=3.5, prompt=64, output=5),
        request_row("r1", "d1", 1, arrival=2.0, first=2.25, last=2.25, prompt=256, output=1),
        request_row("r1", "d2", 0, arrival=0.0, first=9.0, last=9.5, prompt=64, output=3, completed=False),
    ])  # fmt: skip
    out = metrics.request_latencies(requests).set_index(["node", "request_id"])
    assert list(out.index) == [("d1", 0), ("d1", 1)]  # the incomplete request is dropped
    a = out.loc[("d1", 0)]
    assert a["ttft_s"] == approx(0.5)  # 1.5 - 1.0
    assert a["e2e_s"] == approx(2.5)  # 3.5 - 1.0
    assert a["tpot_s"] == approx(0.5)  # (3.5 - 1.5) / (5 - 1)
    assert a["prefill_delay_per_128_s"] == approx(1.0)  # 0.5 x 128 / 64
    assert a["decode_delay_per_10_s"] == approx(5.0)  # 10 x 2 / 4
    b = out.loc[("d1", 1)]
    assert b["ttft_s"] == approx(0.25) and b["e2e_s"] == approx(0.25)
    assert b["prefill_delay_per_128_s"] == approx(0.125)  # 0.25 x 128 / 256
    assert math.isnan(b["tpot_s"]) and math.isnan(b["decode_delay_per_10_s"])  # one token: no decode gaps


def test_token_gaps_stay_within_a_request():
    tokens = pd.DataFrame(
        token_rows("r1", "d1", 0, [1.0, 1.25, 1.75]) + token_rows("r1", "d2", 0, [1.1, 1.6])
        + token_rows("r2", "d1", 0, [5.0, 5.5, 5.75]) + token_rows("r2", "d1", 1, [1.3])
    )  # fmt: skip
    gaps = metrics.token_gaps_s(shuffled(tokens))
    got = sorted((r.run_id, r.node, r.request_id, round(r.gap_s, 9)) for r in gaps.itertuples())
    # r1/d1: 0.25, 0.5; r1/d2: 0.5; r2/d1/0: 0.5, 0.25; r2/d1/1: one token, no gap; nothing across requests
    assert got == [("r1", "d1", 0, 0.25), ("r1", "d1", 0, 0.5), ("r1", "d2", 0, 0.5),
                   ("r2", "d1", 0, 0.25), ("r2", "d1", 0, 0.5)]  # fmt: skip
    assert gaps["gap_s"].sum() == approx(2.0)


def test_token_gaps_of_no_tokens_is_an_empty_table():
    empty = pd.DataFrame(columns=["run_id", "node", "request_id", "index", "ts_s"])
    gaps = metrics.token_gaps_s(empty)
    assert gaps.empty and list(gaps.columns) == ["run_id", "node", "request_id", "gap_s"]


def test_sla_compliance_counts_delays_within_the_sla():
    delays = pd.Series([0.4, 0.2, np.nan, 0.1, 0.2])  # NaN left out: 4 delays
    assert metrics.sla_compliance(delays, 0.2) == 0.75  # 0.1, 0.2, 0.2 of 4: equal to the SLA complies
    assert isinstance(metrics.sla_compliance(delays, 0.2), float)
    shares = metrics.sla_compliance(delays, np.array([0.05, 0.1, 0.3, 0.4, 1.0]))
    assert shares.tolist() == [0.0, 0.25, 0.75, 1.0, 1.0]
    assert math.isnan(metrics.sla_compliance([np.nan], 1.0))
    assert np.isnan(metrics.sla_compliance([], np.array([1.0, 2.0]))).all()


def test_compliance_cdf_steps_through_sorted_delays():
    cdf = metrics.compliance_cdf(np.array([0.4, np.nan, 0.1, 0.3]))
    assert cdf["sla_s"].tolist() == [0.1, 0.3, 0.4]
    assert cdf["compliance"].tolist() == pytest.approx([1 / 3, 2 / 3, 1.0], **EXACT)
    assert metrics.compliance_cdf([]).empty


# -- speculative decoding ---------------------------------------------------------------------------


def test_acceptance_length_counts_the_bonus_token():
    assert metrics.acceptance_length([3, 1, 0, 1]) == approx(2.25)  # 1 + (3+1+0+1)/4
    assert metrics.acceptance_length([0, 0]) == 1.0
    assert math.isnan(metrics.acceptance_length([]))


def test_tokens_per_decode_step():
    requests = pd.DataFrame({"output_tokens": [9, 5, 1, 3], "decode_steps": [4, 4, 0, 0]})
    out = metrics.tokens_per_decode_step(requests)
    # (9-1)/4 = 2, (5-1)/4 = 1, no decode steps: NaN
    assert out.iloc[0] == 2.0 and out.iloc[1] == 1.0
    assert out.iloc[2:].isna().all()
    # pooled per group: (8 + 4) / (4 + 4) for "a"; "b" decoded nothing
    pooled = metrics.tokens_per_decode_step(requests.assign(method=["a", "a", "b", "b"]), by=["method"])
    assert pooled["a"] == 1.5 and np.isnan(pooled["b"])


# -- tables -----------------------------------------------------------------------------------------


def test_latency_table_groups_runs_by_method():
    runs = pd.DataFrame({"run_id": ["r1", "r2", "r3"], "method": ["ushape", "centralized", "ushape"]})
    requests = pd.DataFrame([
        request_row("r1", "d1", 0, arrival=0.0, first=0.1, last=0.5, output=5),
        request_row("r3", "d1", 0, arrival=0.0, first=0.3, last=0.9, output=4),
        request_row("r2", "d1", 0, arrival=1.0, first=1.2, last=1.2, output=1),
        request_row("r2", "d1", 1, arrival=1.0, first=9.0, last=9.0, output=1, completed=False),
    ])  # fmt: skip
    tokens = pd.DataFrame(
        token_rows("r1", "d1", 0, [0.1, 0.2, 0.3, 0.4, 0.5]) + token_rows("r3", "d1", 0, [0.3, 0.5, 0.7, 0.9])
        + token_rows("r2", "d1", 0, [1.2])
    )  # fmt: skip
    table = metrics.latency_table(requests, tokens, runs).set_index("method")
    assert sorted(table.index) == ["centralized", "ushape"]
    u = table.loc["ushape"]
    # TTFT 100 and 300 ms: mean 200, p50 200, p90 100 + 0.9 x 200 = 280
    assert u["requests"] == 2
    assert u["ttft_ms_mean"] == approx(200.0) and u["ttft_ms_p50"] == approx(200.0)
    assert u["ttft_ms_p90"] == approx(280.0)
    # TBT: four 100 ms gaps (r1) and three 200 ms gaps (r3): mean 1000/7, median (4th of 7) 100
    assert u["tbt_ms_mean"] == approx(1000 / 7) and u["tbt_ms_p50"] == approx(100.0)
    # TPOT 400/4 = 100 and 600/3 = 200 ms -> 150; e2e 500 and 900 -> 700
    assert u["tpot_ms_mean"] == approx(150.0) and u["e2e_ms_mean"] == approx(700.0)
    c = table.loc["centralized"]
    assert c["requests"] == 1 and c["ttft_ms_mean"] == approx(200.0) and c["e2e_ms_mean"] == approx(200.0)
    assert math.isnan(c["tbt_ms_mean"]) and math.isnan(c["tpot_ms_mean"])  # one token: no gaps


def test_throughput_over_the_active_span():
    requests = pd.DataFrame([
        request_row("r1", "d1", 0, arrival=0.0, first=1.0, last=4.0, output=10),
        request_row("r1", "d2", 0, arrival=1.0, first=2.0, last=5.0, output=20),
        request_row("r1", "d2", 1, arrival=2.0, first=3.0, last=100.0, output=50, completed=False),
        request_row("r2", "d1", 0, arrival=3.0, first=3.5, last=5.0, output=4),
    ])  # fmt: skip
    out = metrics.throughput(requests).set_index("run_id")
    # r1: span 5 - 0 = 5 s (the incomplete request does not stretch it), 2 requests, 30 tokens
    assert out.loc["r1", "requests"] == 2 and out.loc["r1", "output_tokens"] == 30
    assert out.loc["r1", "span_s"] == approx(5.0)
    assert out.loc["r1", "requests_per_s"] == approx(0.4) and out.loc["r1", "output_tokens_per_s"] == approx(6.0)
    # r2: 4 tokens over 5 - 3 = 2 s
    assert out.loc["r2", "output_tokens_per_s"] == approx(2.0) and out.loc["r2", "requests_per_s"] == approx(0.5)


# -- energy -----------------------------------------------------------------------------------------


def telemetry_row(node, ts, metric, value, kind="measured", sensor="s", run_id="r1") -> dict:
    return {"run_id": run_id, "node": node, "ts_s": ts, "metric": metric, "value": value, "unit": "mW",
            "sensor": sensor, "kind": kind}  # fmt: skip


def test_node_power_prefers_the_board_total_and_sums_other_sensors():
    telemetry = pd.DataFrame([
        # a Jetson: board total 5000 and rails 2000 + 3000 -> 5000, not 10000
        telemetry_row("orin", 0.0, "board_power_mw", 5000.0, sensor="VDD_IN"),
        telemetry_row("orin", 0.0, "power_mw", 2000.0, sensor="VDD_CPU"),
        telemetry_row("orin", 0.0, "power_mw", 3000.0, sensor="VDD_GPU"),
        telemetry_row("orin", 0.0, "cpu_util_pct", 50.0),
        # a server with two GPUs: summed per timestamp
        telemetry_row("server", 0.0, "power_mw", 100000.0, sensor="gpu0"),
        telemetry_row("server", 0.0, "power_mw", 150000.0, sensor="gpu1"),
        telemetry_row("server", 1.0, "power_mw", 110000.0, sensor="gpu0"),
        telemetry_row("server", 1.0, "power_mw", 160000.0, sensor="gpu1"),
        # the server's modeled power stays a row of its own
        telemetry_row("server", 1.0, "power_mw", 7000.0, kind="modeled", sensor="model"),
    ])  # fmt: skip
    power = metrics.node_power(shuffled(telemetry))
    got = sorted((r.node, r.kind, r.ts_s, r.power_mw) for r in power.itertuples())
    assert got == [("orin", "measured", 0.0, 5000.0),
                   ("server", "measured", 0.0, 250000.0), ("server", "measured", 1.0, 270000.0),
                   ("server", "modeled", 1.0, 7000.0)]  # fmt: skip


def test_node_power_without_power_rows_is_empty():
    assert metrics.node_power(pd.DataFrame([telemetry_row("orin", 0.0, "cpu_util_pct", 5.0)])).empty


def power_frame(node, ts, mw, kind="measured", run_id="r1") -> pd.DataFrame:
    return pd.DataFrame({"run_id": run_id, "node": node, "kind": kind, "ts_s": ts, "power_mw": mw})


def test_node_energy_holds_each_sample_over_the_interval_before_it():
    power = pd.concat([
        # (2000 + 2000 + 4000) mW x 1 s = 8 J over 3 s; the first sample only opens the span
        power_frame("orin", [0.0, 1.0, 2.0, 3.0], [1000.0, 2000.0, 2000.0, 4000.0]),
        power_frame("orin", [0.0, 2.0], [500.0, 3000.0], kind="modeled"),  # 3 W x 2 s = 6 J
        power_frame("phone", [4.0], [900.0]),  # one sample: no energy, no mean power
    ])  # fmt: skip
    out = metrics.node_energy(power).set_index(["node", "kind"])
    assert out.loc[("orin", "measured"), "energy_j"] == approx(8.0)
    assert out.loc[("orin", "measured"), "span_s"] == approx(3.0)
    assert out.loc[("orin", "measured"), "mean_power_w"] == approx(8 / 3)
    assert out.loc[("orin", "modeled"), "energy_j"] == approx(6.0)
    assert out.loc[("phone", "measured"), "energy_j"] == 0.0
    assert math.isnan(out.loc[("phone", "measured"), "mean_power_w"])


def energy_request(node, request_id, arrival, first, last, output, completed=True, run_id="r1") -> dict:
    return {"run_id": run_id, "node": node, "request_id": request_id, "arrival_ts_s": arrival,
            "first_token_ts_s": first, "last_token_ts_s": last, "output_tokens": output, "completed": completed}  # fmt: skip


def test_request_energy_on_a_device_with_sequential_requests():
    # constant 2 W sampled every second over [0, 10]
    power = power_frame("d1", np.arange(11.0), np.full(11, 2000.0))
    requests = pd.DataFrame([energy_request("d1", 0, 1.0, 2.0, 4.0, 3), energy_request("d1", 1, 5.0, 5.5, 8.0, 5)])
    out = metrics.request_energy(requests, power).set_index("request_id")
    assert set(out["role"]) == {"device"} and set(out["energy_node"]) == {"d1"}
    # request 0: prefill 2 W x 1 s = 2 J, decode 2 W x 2 s = 4 J, 6 J over 3 tokens = 2 J/token
    assert out.loc[0, "prefill_energy_j"] == approx(2.0) and out.loc[0, "decode_energy_j"] == approx(4.0)
    assert out.loc[0, "energy_j"] == approx(6.0) and out.loc[0, "energy_per_token_j"] == approx(2.0)
    # request 1: prefill 2 W x 0.5 s = 1 J, decode 2 W x 2.5 s = 5 J, 6 J over 5 tokens
    assert out.loc[1, "prefill_energy_j"] == approx(1.0) and out.loc[1, "decode_energy_j"] == approx(5.0)
    assert out.loc[1, "energy_per_token_j"] == approx(1.2)


def test_request_energy_follows_varying_power_samples():
    # samples at 0, 1, 2, 3 s: 1000, 2000, 2000, 4000 mW, each holding over the second before it.
    # request [0.5, 1.5, 3]: prefill 0.5 s x 2 W (sample 1) + 0.5 s x 2 W (sample 2) = 2 J;
    # decode 0.5 s x 2 W (sample 2) + 1 s x 4 W (sample 3) = 5 J.
    power = power_frame("d1", [0.0, 1.0, 2.0, 3.0], [1000.0, 2000.0, 2000.0, 4000.0])
    out = metrics.request_energy(pd.DataFrame([energy_request("d1", 0, 0.5, 1.5, 3.0, 4)]), power)
    assert out.loc[0, "prefill_energy_j"] == approx(2.0) and out.loc[0, "decode_energy_j"] == approx(5.0)
    assert out.loc[0, "energy_per_token_j"] == approx(7 / 4)


def test_request_energy_counts_nothing_outside_the_sampled_span():
    # 1 W sampled over [0, 4]; request [3, 3.5, 6]: prefill 0.5 J, decode only [3.5, 4] -> 0.5 J
    power = power_frame("d1", np.arange(5.0), np.full(5, 1000.0))
    out = metrics.request_energy(pd.DataFrame([energy_request("d1", 0, 3.0, 3.5, 6.0, 2)]), power)
    assert out.loc[0, "prefill_energy_j"] == approx(0.5) and out.loc[0, "decode_energy_j"] == approx(0.5)


def test_a_server_shares_its_power_among_overlapping_requests():
    # server: 6 W over [0, 10]. R1 (d1): [0, 2, 6]; R2 (d2): [4, 5, 8]. Both active on [4, 6]: 3 W each.
    # R1 prefill [0,2]: 6 x 2 = 12 J; decode [2,4] 6 x 2 = 12 J + [4,6] 3 x 2 = 6 J -> 18 J; total 30 J
    # R2 prefill [4,5]: 3 x 1 = 3 J; decode [5,6] 3 J + [6,8] 6 x 2 = 12 J -> 15 J; total 18 J
    # (30 + 18 = 48 J = 6 W x 8 s of activity; the idle [8, 10] is nobody's)
    power = pd.concat([power_frame("server", np.arange(11.0), np.full(11, 6000.0)),
                       power_frame("d1", np.arange(11.0), np.full(11, 1000.0))])  # fmt: skip
    requests = pd.DataFrame([energy_request("d1", 0, 0.0, 2.0, 6.0, 6), energy_request("d2", 0, 4.0, 5.0, 8.0, 3),
                             energy_request("d2", 1, 1.0, 9.0, 9.5, 3, completed=False)])  # fmt: skip
    out = metrics.request_energy(requests, power)
    server = out[out["energy_node"] == "server"].set_index("node")
    assert set(server["role"]) == {"server"} and len(server) == 2  # the incomplete request gets nothing
    assert server.loc["d1", "prefill_energy_j"] == approx(12.0) and server.loc["d1", "decode_energy_j"] == approx(18.0)
    assert server.loc["d2", "prefill_energy_j"] == approx(3.0) and server.loc["d2", "decode_energy_j"] == approx(15.0)
    assert server.loc["d1", "energy_per_token_j"] == approx(5.0)  # 30 J / 6 tokens
    assert server.loc["d2", "energy_per_token_j"] == approx(6.0)  # 18 J / 3 tokens
    # the device d1 serves only its own request: 1 W x 6 s
    device = out[out["energy_node"] == "d1"]
    assert device["role"].tolist() == ["device"] and device["node"].tolist() == ["d1"]
    assert device["energy_j"].iloc[0] == approx(6.0)


def test_a_device_whose_requests_all_failed_is_not_taken_for_the_server():
    # d2 issued a request in the run (it did not complete), so d2 is a device, not a node "without requests
    # in the run": it served none of d1's requests and should get no rows at all.
    power = pd.concat([power_frame("server", np.arange(5.0), np.full(5, 6000.0)),
                       power_frame("d2", np.arange(5.0), np.full(5, 1000.0))])  # fmt: skip
    requests = pd.DataFrame([energy_request("d1", 0, 0.0, 1.0, 2.0, 2),
                             energy_request("d2", 0, 0.0, np.nan, np.nan, 0, completed=False)])  # fmt: skip
    out = metrics.request_energy(requests, power)
    assert out[out["energy_node"] == "server"]["energy_j"].tolist() == [approx(12.0)]  # 6 W x 2 s
    assert out[out["energy_node"] == "d2"].empty


def test_request_energy_needs_controller_clock_windows():
    power = power_frame("d1", [0.0, 1.0], [1000.0, 1000.0])
    requests = pd.DataFrame([request_row("r1", "d1", 0, arrival=0.0, first=0.5, last=1.0, output=2)])
    out = metrics.request_energy(requests, power)  # only device-clock columns
    assert out.empty and "energy_per_token_j" in out.columns


# -- cost model (DiSCo App. E) ----------------------------------------------------------------------
# TINY: one layer, d = 2, one head (d_kv = 2), FFN 4 (2 matrices), vocab 3.
#   decode layer at L:  d^2 + 2 d d_kv + L d / h + L d + d^2 = 4 + 8 + 2L + 2L + 4 = 16 + 4L;
#                       FFN 2 x 2 x 4 = 16; norms 2 x 5 x 2 = 20  -> 52 + 4L
#   prefill layer at L: 16 + 2 L^2 + 2L + 16 + 20 = 52 + 2 L^2 + 2L
#   head: 2 x 3 x 2 + 5 x 2 = 22
TINY = ModelShape(n_layers=1, d_model=2, n_heads=1, d_ffn=4, vocab=3)


def test_tiny_shape_flops_by_hand():
    assert layer_flops(TINY, 3, "decode") == 64.0  # 52 + 12
    assert layer_flops(TINY, 3, "prefill") == 76.0  # 52 + 18 + 6
    assert head_flops(TINY) == 22.0
    assert flops_per_token(TINY, 5, "decode") == 94.0  # 52 + 20 + 22
    with pytest.raises(ValueError):
        layer_flops(TINY, 3, "verify")


def test_tiny_request_flops_by_hand():
    # L = 3, 4 output tokens: prefill = 3 tokens x (76 + 22) = 294;
    # decode: 3 further tokens, the i-th computed with 3 + i positions (contexts 4, 5, 6):
    # (68 + 22) + (72 + 22) + (76 + 22) = 282
    prefill, decode = request_flops(TINY, 3, 4, 1, True)
    assert (float(prefill), float(decode)) == (294.0, 282.0)
    prefill, decode = request_flops(TINY, 3, 4, 1, False)  # layers only: 3 x 76 = 228; 68 + 72 + 76 = 216
    assert (float(prefill), float(decode)) == (228.0, 216.0)
    # one output token (or none) has no decode step
    assert request_flops(TINY, np.array([3.0, 3.0]), np.array([1, 0]), 1, True)[1].tolist() == [0.0, 0.0]


def test_grouped_query_attention_shrinks_the_kv_projections():
    # d = 4, 2 heads, 1 KV head -> d_kv = 2. Decode layer at L = 0: 16 + 2 x 4 x 2 + 16 = 48 (MHA: 64);
    # FFN 2 x 4 x 8 = 64; norms 40 -> 152; head 2 x 5 x 4 + 20 = 60 -> 212 (MHA 228)
    gqa = ModelShape(1, 4, 2, 8, 5, n_kv_heads=1)
    assert gqa.d_kv == 2
    assert float(flops_per_token(gqa, 0, "decode")) == 212.0
    assert float(flops_per_token(ModelShape(1, 4, 2, 8, 5), 0, "decode")) == 228.0


def test_shape_from_a_hugging_face_config():
    config = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 4, "intermediate_size": 16,
              "vocab_size": 10, "num_key_value_heads": 2, "hidden_act": "silu"}  # fmt: skip
    shape = ModelShape.from_config(config)
    assert (shape.n_layers, shape.d_model, shape.n_heads, shape.d_ffn, shape.vocab) == (2, 8, 4, 16, 10)
    assert shape.d_kv == 4 and shape.ffn_matrices == 3
    assert ModelShape.from_config({**config, "hidden_act": "gelu"}).ffn_matrices == 2


@pytest.mark.parametrize(("name", "table6"), [("bloom-1.1b", 0.82e9), ("qwen-0.5b", 0.37e9)])
@pytest.mark.parametrize("context", [32, 64, 128])
def test_decode_flops_reproduce_disco_table_6(name, table6, context):
    assert float(flops_per_token(DISCO_SHAPES[name], context, "decode")) == pytest.approx(table6, rel=0.02)


def test_bloom_and_qwen_decode_flops_by_hand():
    # BLOOM-1.1B: per layer 4 d^2 = 4,194,304 + FFN 2 x 1024 x 4096 = 8,388,608 + norms 10,240 = 12,593,152,
    # x 24 = 302,235,648; linear term 24 x (1024/16 + 1024) L = 26,112 L; head 2 x 250,880 x 1024 + 5 x 1024
    # = 513,807,360 -> 816,043,008 + 26,112 L
    bloom = DISCO_SHAPES["bloom-1.1b"]
    assert float(flops_per_token(bloom, 0, "decode")) == 816_043_008.0
    assert float(flops_per_token(bloom, 128, "decode")) == 816_043_008.0 + 26_112 * 128
    # Qwen-0.5B: 4 x 768^2 = 2,359,296 + 2 x 768 x 2048 = 3,145,728 + 7,680 = 5,512,704, x 24 = 132,304,896;
    # linear 24 x (64 + 768) = 19,968 L; head 2 x 151,936 x 768 + 3,840 = 233,377,536 -> 365,682,432
    qwen = DISCO_SHAPES["qwen-0.5b"]
    assert float(flops_per_token(qwen, 0, "decode")) == 365_682_432.0
    # decode FLOPs depend on L only through the linear term: 32 -> 128 adds 96 x 26,112 = 2,506,752 (0.3 %)
    assert float(flops_per_token(bloom, 128, "decode") - flops_per_token(bloom, 32, "decode")) == 2_506_752.0


def test_request_decode_flops_equal_the_sum_over_contexts():
    # Definition: the i-th further token (i = 1 .. n-1) is computed with L + i positions: L + 1 .. L + n - 1.
    shape = DISCO_SHAPES["bloom-1.1b"]
    L, n = 100, 50
    per_token = [shape.n_layers * float(layer_flops(shape, c, "decode")) + head_flops(shape)
                 for c in range(L + 1, L + n)]  # fmt: skip
    assert len(per_token) == 49
    _, decode = request_flops(shape, L, n, shape.n_layers, True)
    assert float(decode) == pytest.approx(sum(per_token), rel=1e-12)
    # 5 layers, no head
    partial = sum(5 * float(layer_flops(shape, c, "decode")) for c in range(L + 1, L + n))
    assert float(request_flops(shape, L, n, 5, False)[1]) == pytest.approx(partial, rel=1e-12)


def test_api_prices_follow_disco_table_8():
    assert float(api_price_usd("gpt-4o-mini", 1e6, 1e6)) == approx(0.75)  # 0.15 + 0.60
    assert float(api_price_usd("claude-3.5-sonnet", 2e6, 0)) == approx(6.0)  # 2 x 3.00
    with pytest.raises(ValueError, match="unknown API"):
        api_price_usd("gpt-5", 1, 1)


def test_request_cost_splits_flops_between_device_and_server():
    # TWO: the tiny shape with 2 layers. Request L = 3, n = 4: per layer prefill 3 x 76 = 228, decode
    # 68 + 72 + 76 = 216 -> 444; head 3 x 22 (prefill) + 3 x 22 (decode) = 132; whole 2 x 444 + 132 = 1020.
    # ushape, m = 1: device = head + one layer = 576, server = 444. centralized: device 0, server 1020.
    # gpt-4o-mini price: (3 x 0.15 + 4 x 0.60) / 1e6 = 2.85e-6 USD.
    two = ModelShape(n_layers=2, d_model=2, n_heads=1, d_ffn=4, vocab=3)
    runs = pd.DataFrame({"run_id": ["u", "c"], "method": ["ushape", "centralized"], "partition.device_layers": [1, 1]})
    requests = pd.DataFrame([request_row("u", "d1", 0, prompt=3, output=4), request_row("c", "d1", 0, prompt=3, output=4),
                             request_row("u", "d1", 1, prompt=3, output=4, completed=False)])  # fmt: skip
    out = metrics.request_cost(requests, runs, two, api="gpt-4o-mini", device_usd_per_pflop=5.0).set_index("run_id")
    assert len(out) == 2
    u, c = out.loc["u"], out.loc["c"]
    assert (u["device_flops"], u["server_flops"]) == (576.0, 444.0)
    assert u["device_flops"] + u["server_flops"] == 1020.0
    assert u["device_usd"] == approx(576 / 1e15 * 5.0)
    assert u["server_usd"] == approx(2.85e-6 * 444 / 1020)
    assert u["total_usd"] == approx(576 / 1e15 * 5.0 + 2.85e-6 * 444 / 1020)
    assert (c["device_flops"], c["server_flops"], c["device_usd"]) == (0.0, 1020.0, 0.0)
    assert c["server_usd"] == approx(2.85e-6) and c["total_usd"] == approx(2.85e-6)


def test_request_cost_refuses_an_unknown_api():
    runs = pd.DataFrame({"run_id": ["u"], "method": ["ushape"], "partition.device_layers": [1]})
    with pytest.raises(ValueError, match="unknown API"):
        metrics.request_cost(pd.DataFrame([request_row("u", prompt=3, output=4)]), runs, TINY, api="nope",
                             device_usd_per_pflop=1.0)  # fmt: skip


def test_qoe_refuses_a_negative_expected_ttft():
    # Eq. 1 integrates from the request's arrival (t = 0); an expectation before it has no meaning
    with pytest.raises(ValueError, match="expected TTFT"):
        metrics.qoe([0.0, 1.0, 2.0], -1.0, 1.0)


def test_node_power_decides_board_or_sensors_per_kind():
    # a measured board total and a modeled extra sensor on one node: both kept, each in its own row,
    # the board's rails (measured power_mw) not added to the board total
    telemetry = pd.DataFrame([
        telemetry_row("orin", 0.0, "board_power_mw", 5000.0, sensor="VDD_IN"),
        telemetry_row("orin", 0.0, "power_mw", 5000.0, sensor="VDD_GPU"),
        telemetry_row("orin", 0.0, "power_mw", 700.0, kind="modeled", sensor="model"),
    ])  # fmt: skip
    power = metrics.node_power(telemetry).set_index("kind")["power_mw"]
    assert power.to_dict() == {"measured": 5000.0, "modeled": 700.0}


def test_andes_table4_tds_is_the_pre_buffer_speed_and_unserved_requests_count_zero_qoe():
    # request 1: 5 tokens 0.1 s apart from 1.0 s (TDS 10/s); request 2: refused, no tokens;
    # request 3: one token (no speed)
    tokens = pd.DataFrame({"run_id": "r", "node": "d", "request_id": [1] * 5 + [3],
                           "index": [0, 1, 2, 3, 4, 0], "ts_s": [1.0, 1.1, 1.2, 1.3, 1.4, 2.0]})  # fmt: skip
    speeds = metrics.token_delivery_speed(tokens).set_index("request_id")["tds_tok_s"]
    assert speeds[1] == pytest.approx(10.0) and math.isnan(speeds[3])
    requests = pd.DataFrame({
        "run_id": "r", "node": "d", "request_id": [1, 2, 3], "arrival_s": [0.5, 0.6, 1.5],
        "first_token_s": [1.0, np.nan, 2.0], "last_token_s": [1.4, np.nan, 2.0], "ttft_s": [0.5, np.nan, 0.5],
        "output_tokens": [5, 0, 1], "completed": True, "expected_ttft_s": 1.0, "expected_tds_tok_s": 4.8,
        "serving_preemptions": [2, 0, 1], "finished_by": ["length", "refused", "length"],
    })  # fmt: skip
    qoe = metrics.qoe_table(requests, tokens)
    runs = pd.DataFrame({"run_id": ["r"], "serving.scheduler": ["andes"]})
    table = metrics.serving_table(requests, tokens, qoe, runs, ["serving.scheduler"]).iloc[0]
    assert table["requests"] == 3 and table["refused"] == 1
    assert table["qoe_mean"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)  # both served ones were early: QoE 1
    assert table["preemptions_per_request"] == pytest.approx(1.0)
    assert table["tds_tok_s_p50"] == pytest.approx(10.0)
    assert table["output_tokens_per_s"] == pytest.approx(6 / (2.0 - 0.5))


def test_qoe_by_length_cuts_every_scheduler_at_the_same_length_quantiles():
    # 8 requests a scheduler, total lengths (prompt 4 + response) 10..80; fcfs starves the short half,
    # andes the longest one
    lengths = [6, 16, 26, 36, 46, 56, 66, 76]
    served = pd.DataFrame({
        "serving.scheduler": ["fcfs"] * 8 + ["andes"] * 8, "prompt_tokens": 4, "max_new_tokens": lengths * 2,
        "qoe": [0.0, 0.2, 0.4, 0.6, 1.0, 1.0, 1.0, 1.0] + [1.0] * 7 + [0.5],
    })  # fmt: skip
    table = metrics.qoe_by_length(served, ["serving.scheduler"], bins=2)
    assert list(table["serving.scheduler"]) == ["andes", "andes", "fcfs", "fcfs"]
    assert list(table["length_from"]) == [10, 45, 10, 45] and list(table["length_to"]) == [44, 80, 44, 80]
    assert list(table["requests"]) == [4, 4, 4, 4]
    assert list(table["qoe_mean"]) == pytest.approx([1.0, 0.875, 0.3, 1.0])
    assert table["qoe_p10"].iloc[2] == pytest.approx(0.06)  # np.percentile of 0, 0.2, 0.4, 0.6
