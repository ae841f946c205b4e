"""Every metric of the seed papers, defined once, on the tables of :func:`analysis.load`.

Inputs are ``requests`` (one row per request: ``arrival_s``, ``first_token_s``, ``last_token_s``,
``prompt_tokens``, ``output_tokens``, ``decode_steps``, ... in seconds on the device's clock),
``tokens`` (one row per delivered token: ``run_id``, ``node``, ``request_id``, ``index``, ``ts_s``
on the device's clock) and node ``telemetry`` on the controller's clock. Latency is always taken
on the device that issued the request (DESIGN principle 4); energy needs request windows on the
controller's clock (``*_ts_s`` columns, added by :func:`analysis.load`).

Sources: TTFT, TBT, TPOT and end-to-end latency as in vLLM's benchmark and HAT Sec. 5.1
("Metrics"); SLA compliance as in HAT Sec. 5.2 (prefill delay per 128 prompt tokens, decode delay
per 10 generated tokens); QoE as Andes Eq. 1 and its capacity as Andes Sec. 6.1; acceptance length
as vLLM reports it for speculative decoding; energy by integrating sampled power; cost as DiSCo
App. E (:mod:`analysis.cost_model`).

One concept, the metric definitions, over ~420 lines: each metric is written once here.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pandas as pd

from analysis.cost_model import ModelShape, api_price_usd, request_flops
from nodes.contracts.speculative_metrics import acceptance_length as contract_acceptance_length

REQUEST_KEY = ["run_id", "node", "request_id"]
PERCENTILES = (50, 90, 99)
PREFILL_SLA_PER_TOKENS = 128  # HAT Sec. 5.2
DECODE_SLA_PER_TOKENS = 10  # HAT Sec. 5.2
QOE_THRESHOLD = 0.9  # Andes Sec. 6.1: the minimum acceptable average QoE


def _key(frame: pd.DataFrame) -> list[str]:
    return [c for c in REQUEST_KEY if c in frame.columns]


# -- latency ----------------------------------------------------------------------------------------


def request_latencies(requests: pd.DataFrame) -> pd.DataFrame:
    """Per completed request: ``ttft_s`` (first token minus arrival, HAT Sec. 5.1), ``e2e_s`` (last
    token minus arrival), ``tpot_s`` (vLLM: (e2e - TTFT) / (output tokens - 1), NaN for one token),
    and HAT's SLA delays ``prefill_delay_per_128_s`` = TTFT x 128 / prompt tokens and
    ``decode_delay_per_10_s`` = 10 x (last - first token) / (output tokens - 1)."""
    done = requests[requests["completed"]] if "completed" in requests else requests
    if "first_token_s" not in done:  # no request recorded anything (a run that failed at once)
        columns = [*_key(done), "prompt_tokens", "output_tokens", "ttft_s", "e2e_s", "tpot_s",
                   "prefill_delay_per_128_s", "decode_delay_per_10_s"]  # fmt: skip
        return pd.DataFrame({c: pd.Series(dtype=done[c].dtype if c in done else "float64") for c in columns})
    out = done[[*_key(done), "prompt_tokens", "output_tokens"]].copy()
    out["ttft_s"] = done["first_token_s"] - done["arrival_s"]
    out["e2e_s"] = done["last_token_s"] - done["arrival_s"]
    decode_s = done["last_token_s"] - done["first_token_s"]
    gaps = (done["output_tokens"] - 1).where(done["output_tokens"] > 1)
    out["tpot_s"] = decode_s / gaps
    out["prefill_delay_per_128_s"] = out["ttft_s"] * PREFILL_SLA_PER_TOKENS / done["prompt_tokens"]
    out["decode_delay_per_10_s"] = decode_s * DECODE_SLA_PER_TOKENS / gaps
    if "preemptions" in done:
        out["preemptions"] = done["preemptions"]
    return out.reset_index(drop=True)


def token_gaps_s(tokens: pd.DataFrame) -> pd.DataFrame:
    """TBT: every gap between consecutive tokens of a request (vLLM's inter-token latency; HAT
    Sec. 5.1), as ``run_id, node, request_id, gap_s``."""
    key = _key(tokens)
    if tokens.empty:
        return pd.DataFrame({c: pd.Series(dtype="object") for c in key} | {"gap_s": pd.Series(dtype="float64")})
    ordered = tokens.sort_values([*key, "index"], kind="stable")
    ts = ordered["ts_s"].to_numpy()
    same = np.ones(len(ordered), dtype=bool)
    for column in key:
        values = ordered[column].to_numpy()
        same[1:] &= values[1:] == values[:-1]
    same[0] = False
    gaps = ordered.loc[same, key].copy()
    gaps["gap_s"] = ts[same] - ts[np.flatnonzero(same) - 1]
    return gaps.reset_index(drop=True)


def describe(values: pd.Series | np.ndarray, unit_scale: float = 1.0, prefix: str = "") -> dict[str, float]:
    """Mean, p50, p90, p99 and count of ``values`` (NaN dropped), each times ``unit_scale``."""
    v = np.asarray(values, dtype="float64")
    v = v[~np.isnan(v)]
    out = {f"{prefix}count": float(len(v)), f"{prefix}mean": float(v.mean()) * unit_scale if len(v) else np.nan}
    for p in PERCENTILES:
        out[f"{prefix}p{p}"] = float(np.percentile(v, p)) * unit_scale if len(v) else np.nan
    return out


def latency_table(requests: pd.DataFrame, tokens: pd.DataFrame, runs: pd.DataFrame,
                  by: Sequence[str] = ("method",), gaps: pd.DataFrame | None = None) -> pd.DataFrame:  # fmt: skip
    """HAT Table 5's layout: per group of runs (``by`` are columns of ``runs``), TTFT and TBT in ms
    (mean, p50, p90, p99), TPOT and end-to-end latency means, requests counted. ``gaps`` may pass
    :func:`token_gaps_s` of ``tokens`` when it is already computed."""
    by = [c for c in by if c in runs.columns]
    settings = runs[["run_id", *by]].drop_duplicates("run_id")
    combos = settings[by].astype(str).agg("\x1f".join, axis=1) if by else pd.Series("", index=settings.index)
    codes, _ = pd.factorize(combos)
    groups = settings.iloc[np.unique(codes, return_index=True)[1]].reset_index(drop=True)
    group_of_run = dict(zip(settings["run_id"], codes, strict=True))
    lat = request_latencies(requests)
    lat["_group"] = lat["run_id"].map(group_of_run)
    gaps = token_gaps_s(tokens) if gaps is None else gaps
    gap_group = gaps["run_id"].map(group_of_run).to_numpy()
    rows = []
    for index, part in lat.groupby("_group", sort=True):
        row = groups.loc[index, by].to_dict()
        row["requests"] = len(part)
        row.update(describe(part["ttft_s"], 1e3, "ttft_ms_"))
        row.update(describe(gaps["gap_s"].to_numpy()[gap_group == index], 1e3, "tbt_ms_"))
        row["tpot_ms_mean"] = part["tpot_s"].mean() * 1e3
        row["e2e_ms_mean"] = part["e2e_s"].mean() * 1e3
        if "preemptions" in part:
            row["preemptions_per_request"] = part["preemptions"].mean()
        rows.append(row)
    table = pd.DataFrame(rows).drop(columns=["ttft_ms_count", "tbt_ms_count"], errors="ignore")
    return table.sort_values(by, kind="stable").reset_index(drop=True) if by and len(table) else table


def throughput(requests: pd.DataFrame) -> pd.DataFrame:
    """Per run: completed requests, output tokens, and both per second over the run's active span
    (first arrival to last delivered token, across devices on their own clocks)."""
    done = requests[requests["completed"]] if "completed" in requests else requests
    per = done.groupby("run_id").agg(requests=("request_id", "count"), output_tokens=("output_tokens", "sum"),
                                     first_arrival_s=("arrival_s", "min"), last_token_s=("last_token_s", "max"))
    span = per.pop("last_token_s") - per.pop("first_arrival_s")
    per["span_s"] = span
    per["requests_per_s"] = per["requests"] / span
    per["output_tokens_per_s"] = per["output_tokens"] / span
    return per.reset_index()


# -- SLA compliance (HAT Sec. 5.2) ------------------------------------------------------------------


def sla_compliance(delays_s: pd.Series | np.ndarray, sla_s: float | np.ndarray) -> np.ndarray | float:
    """The fraction of requests whose delay is within each SLA (HAT's compliance rate). Requests
    without a delay (NaN: one output token for the decode SLA) are left out."""
    v = np.sort(np.asarray(delays_s, dtype="float64"))
    v = v[~np.isnan(v)]
    if not len(v):
        return np.full(np.shape(sla_s), np.nan) if np.ndim(sla_s) else np.nan
    share = np.searchsorted(v, np.asarray(sla_s, dtype="float64"), side="right") / len(v)
    return share if np.ndim(sla_s) else float(share)


def compliance_cdf(delays_s: pd.Series | np.ndarray) -> pd.DataFrame:
    """The empirical CDF of SLA delays: ``sla_s`` and the ``compliance`` it would have."""
    v = np.sort(np.asarray(delays_s, dtype="float64"))
    v = v[~np.isnan(v)]
    return pd.DataFrame({"sla_s": v, "compliance": np.arange(1, len(v) + 1) / max(len(v), 1)})


# -- QoE (Andes Eq. 1) ------------------------------------------------------------------------------


def _expected_area(ttlt: np.ndarray, ttft_e: np.ndarray, tds: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Integral over [0, TTLT] of min(T(t), l) with T(t) = tds (t - TTFT_expected), 0 before."""
    ramp_end = ttft_e + length / tds
    ramp = np.clip(np.minimum(ttlt, ramp_end) - ttft_e, 0, None)
    flat = np.clip(ttlt - ramp_end, 0, None)
    return tds * ramp * ramp / 2 + length * flat


def _qoe_arrays(t: np.ndarray, start: np.ndarray, tds_tok: np.ndarray, ttft_e: np.ndarray,
                tds: np.ndarray, alpha: float | None) -> np.ndarray:  # fmt: skip
    """QoE of many requests at once. ``t``: token times from arrival, grouped by request and sorted
    within it; ``start``: each request's first row in ``t``; ``tds_tok``: the request's expected
    speed repeated per token. See :func:`qoe` for the definition."""
    n_tokens = np.diff(np.append(start, len(t)))
    position = np.arange(len(t)) - np.repeat(start, n_tokens)
    # A(t) = min(D(t), min over delivered tokens j of (j + tds (t - t_j))): keep the running minimum of
    # c_j = j - tds t_j within each request (a cumulative minimum that restarts at each request).
    owner_all = np.repeat(np.arange(len(start)), n_tokens)
    running = pd.Series(position - tds_tok * t).groupby(owner_all).cummin().to_numpy()
    # on [t_k, t_k+1): A(t) = min(k + 1, tds t + M_k); the line meets the cap at t* = (k + 1 - M_k) / tds
    last = np.zeros(len(t), dtype=bool)
    last[np.append(start[1:], len(t)) - 1] = True
    a, b = t[~last], t[np.flatnonzero(~last) + 1]
    m, cap, s = running[~last], position[~last] + 1.0, tds_tok[~last]
    meet = np.clip((cap - m) / s, a, b)
    pieces = s * (meet - a) * (meet + a) / 2 + m * (meet - a) + cap * (b - meet)
    actual = np.bincount(owner_all[~last], weights=pieces, minlength=len(start))
    ttlt, first = t[np.append(start[1:], len(t)) - 1], t[start]
    expected = _expected_area(ttlt, ttft_e, tds, n_tokens.astype("float64"))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(expected > 0, actual / expected, 1.0)
    if alpha is not None:
        ratio = ratio * np.power(alpha, np.clip(first - ttft_e, 0, None))
    return np.minimum(ratio, 1.0)


def qoe(token_times_s: Sequence[float], expected_ttft_s: float, expected_tds: float,
        alpha: float | None = None) -> float:  # fmt: skip
    """Andes Eq. 1: QoE = S_actual / S_expected of one request.

    ``token_times_s`` are the delivery times of its tokens, in seconds from the request's arrival.
    The expected curve is T(t) = tds (t - TTFT_expected) (0 before), capped at the response length l
    (the number of tokens). The actual curve A(t) is what the user has digested by t: never more
    than the tokens delivered by t, rising at most at the expected speed tds (a token delivered at
    t_i is digestible from t_i). Both areas are integrated exactly on these piecewise-linear curves
    over [0, TTLT], TTLT being the last token's delivery. QoE is capped at 1, and is 1 when the
    expected area is 0 (everything arrived before the expected first token). With ``alpha`` in
    [0, 1], Andes' TTFT penalty alpha ** (TTFT - TTFT_expected) multiplies it, for late first
    tokens only (an early first token is not rewarded beyond 1)."""
    t = np.sort(np.asarray(token_times_s, dtype="float64"))
    if not len(t):
        raise ValueError("QoE needs at least one delivered token")
    if not expected_tds > 0 or not np.isfinite(expected_tds):
        raise ValueError(f"the expected token delivery speed must be a positive number, not {expected_tds}")
    if alpha is not None and not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be within [0, 1], not {alpha}")
    if not expected_ttft_s >= 0:
        raise ValueError(f"the expected TTFT must be at least 0 s, not {expected_ttft_s}")
    one = np.array([0])
    return float(_qoe_arrays(t, one, np.full(len(t), float(expected_tds)), np.array([float(expected_ttft_s)]),
                             np.array([float(expected_tds)]), alpha)[0])  # fmt: skip


def qoe_table(requests: pd.DataFrame, tokens: pd.DataFrame, alpha: float | None = None) -> pd.DataFrame:
    """Andes QoE of every completed request with expectations, from its token timeline:
    ``run_id, node, request_id, qoe``. Token times are taken from the request's arrival, on the
    device's clock."""
    key = _key(requests)
    want = requests.dropna(subset=["expected_ttft_s", "expected_tds_tok_s"])
    if "completed" in want:
        want = want[want["completed"]]
    want = want[key + ["arrival_s", "expected_ttft_s", "expected_tds_tok_s"]]
    merged = tokens[[*key, "index", "ts_s"]].merge(want, on=key, how="inner")
    if merged.empty:
        return pd.DataFrame({c: pd.Series(dtype=requests[c].dtype) for c in key} | {"qoe": pd.Series(dtype="float64")})
    merged = merged.sort_values([*key, "ts_s"], kind="stable")
    group = merged.groupby(key, sort=False, observed=True)
    starts = np.flatnonzero(group.cumcount().to_numpy() == 0)
    heads = merged.iloc[starts]
    t = (merged["ts_s"] - merged["arrival_s"]).to_numpy(dtype="float64")
    values = _qoe_arrays(t, starts, merged["expected_tds_tok_s"].to_numpy(dtype="float64"),
                         heads["expected_ttft_s"].to_numpy(dtype="float64"),
                         heads["expected_tds_tok_s"].to_numpy(dtype="float64"), alpha)  # fmt: skip
    out = heads[key].reset_index(drop=True)
    out["qoe"] = values
    return out


def capacity_per_s(rates_per_s: Sequence[float], mean_qoe: Sequence[float] | np.ndarray,
                   threshold: float = QOE_THRESHOLD) -> float | np.ndarray:  # fmt: skip
    """Andes' system capacity: the highest tested request rate whose average QoE is at least
    ``threshold``, with every lower tested rate passing too (no interpolation between rates; NaN
    when even the lowest rate fails). ``mean_qoe`` may hold several curves, one a row over the rates
    on its last axis (a bootstrap's resamples): then one capacity a row."""
    order = np.argsort(np.asarray(rates_per_s, dtype="float64"), kind="stable")
    rates = np.asarray(rates_per_s, dtype="float64")[order]
    qoe = np.asarray(mean_qoe, dtype="float64")
    passing = qoe[..., order] >= threshold
    upto = np.where(passing.all(axis=-1), len(rates), np.argmin(passing, axis=-1))
    capacity = np.where(upto > 0, rates[np.maximum(upto - 1, 0)], np.nan)
    return float(capacity) if qoe.ndim == 1 else capacity


def token_delivery_speed(tokens: pd.DataFrame) -> pd.DataFrame:
    """Per request, Andes Table 4's TDS: tokens delivered after the first over the time they took,
    (n - 1) / (t_last - t_first), on arrival at the client, before its buffer (brief, pitfall 9);
    NaN for fewer than two tokens."""
    key = _key(tokens)
    per = tokens.groupby(key, observed=True)["ts_s"].agg(["count", "min", "max"]).reset_index()
    span = (per["max"] - per["min"]).where(per["count"] > 1)
    per["tds_tok_s"] = (per["count"] - 1) / span.where(span > 0)
    return per[[*key, "tds_tok_s"]]


def served_requests(requests: pd.DataFrame, tokens: pd.DataFrame, qoe: pd.DataFrame, runs: pd.DataFrame,
                    by: Sequence[str]) -> pd.DataFrame:  # fmt: skip
    """Every request with a QoE expectation, with its ``qoe`` (0 when it has none: refused or cut
    short, brief pitfall 8), its ``tds_tok_s`` and the runs' ``by`` columns."""
    key = _key(requests)
    want = requests.dropna(subset=["expected_ttft_s", "expected_tds_tok_s"])
    frame = want.merge(qoe[[*key, "qoe"]], on=key, how="left").merge(token_delivery_speed(tokens), on=key, how="left")
    frame["qoe"] = frame["qoe"].fillna(0.0)
    return frame.merge(runs[["run_id", *by]], on="run_id")


def qoe_by_length(served: pd.DataFrame, by: Sequence[str], bins: int = 6) -> pd.DataFrame:
    """Andes Fig. 14's view: mean and p10 QoE per group of ``by`` and per bin of the request's total
    length (its prompt plus the response length it asked for, ``prompt_tokens + max_new_tokens``), the
    bins' edges the length quantiles over all ``served`` requests so that every group is cut alike.
    Columns: ``by``, ``length_from``, ``length_to`` (tokens, inclusive), ``requests``, ``qoe_mean``,
    ``qoe_p10``."""
    total = served["prompt_tokens"] + served["max_new_tokens"]
    lengths = total.to_numpy(dtype="float64")
    edges = np.unique(np.floor(np.quantile(lengths, np.linspace(0, 1, bins + 1))))
    edges[-1] = lengths.max() + 1  # the longest in the last bin
    frame = served.assign(length_bin=pd.cut(total, edges, right=False, labels=False))
    rows = []
    for values, part in frame.groupby([*by, "length_bin"], sort=True, dropna=False):
        row = dict(zip([*by, "length_bin"], values, strict=True))
        at = int(row.pop("length_bin"))
        row.update(length_from=int(edges[at]), length_to=int(edges[at + 1]) - 1, requests=len(part),
                   qoe_mean=part["qoe"].mean(), qoe_p10=float(np.percentile(part["qoe"], 10)))  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


def serving_table(requests: pd.DataFrame, tokens: pd.DataFrame, qoe: pd.DataFrame, runs: pd.DataFrame,
                  by: Sequence[str]) -> pd.DataFrame:  # fmt: skip
    """Andes' Table 4 layout per group of ``by``: QoE, TTFT (s) and TDS (tokens/s) at p10/p50/p90,
    mean QoE, preemptions per request, refused requests, and generated tokens per second (the mean
    over the group's runs of :func:`throughput`). Every scheduled request with an expectation counts
    (brief, pitfall 8): one without a QoE (refused, or cut short) counts 0."""
    frame = served_requests(requests, tokens, qoe, runs, by)
    rates = throughput(requests).merge(runs[["run_id", *by]], on="run_id")
    rows = []
    for values, part in frame.groupby(list(by), sort=True, dropna=False):
        row = dict(zip(by, values if isinstance(values, tuple) else (values,), strict=True))
        row.update(requests=len(part), qoe_mean=part["qoe"].mean())
        for name, column in (("qoe", "qoe"), ("ttft_s", "ttft_s"), ("tds_tok_s", "tds_tok_s")):
            for pct in (10, 50, 90):
                row[f"{name}_p{pct}"] = float(np.nanpercentile(part[column], pct)) if part[column].notna().any() \
                    else float("nan")  # fmt: skip
        if "serving_preemptions" in part:
            row["preemptions_per_request"] = part["serving_preemptions"].fillna(0).mean()
        if "finished_by" in part:
            row["refused"] = int((part["finished_by"] == "refused").sum())
        mine = rates
        for column, value in zip(by, values if isinstance(values, tuple) else (values,), strict=True):
            mine = mine[mine[column] == value]
        row["output_tokens_per_s"] = mine["output_tokens_per_s"].mean()
        rows.append(row)
    return pd.DataFrame(rows)


# -- speculative decoding ---------------------------------------------------------------------------


def acceptance_length(accepted_per_step: Sequence[int]) -> float:
    """Mean tokens emitted per verification step, the bonus (corrected) token counted:
    1 + accepted / steps, as vLLM reports "mean acceptance length" (the formula is the contract's,
    :mod:`nodes.contracts.speculative_metrics`, which the device workers use too)."""
    length = pooled_acceptance_length(float(np.sum(accepted_per_step)), len(accepted_per_step))
    return float("nan") if length is None else length


def pooled_acceptance_length(accepted_tokens: float, rounds: float) -> float | None:
    """The acceptance length of many requests together: their accepted draft tokens over their rounds."""
    return contract_acceptance_length(accepted_tokens, rounds)


def acceptance_length_by(frame: pd.DataFrame, by: Sequence[str]) -> pd.Series:
    """Per group of ``by``, the pooled acceptance length of the requests' ``speculative_accepted`` and
    ``speculative_rounds`` (NaN where no request of the group drafted)."""
    sums = frame.groupby(list(by))[["speculative_accepted", "speculative_rounds"]].sum(min_count=1)
    lengths = [pooled_acceptance_length(a, r) if pd.notna(r) else None
               for a, r in zip(sums["speculative_accepted"], sums["speculative_rounds"], strict=True)]  # fmt: skip
    return pd.Series(lengths, index=sums.index, dtype="float64", name="acceptance_length")


def tokens_per_decode_step(requests: pd.DataFrame, by: Sequence[str] | None = None) -> pd.Series:
    """Decode tokens per decode step, (output tokens - 1) / decode steps: per request, or with ``by``
    pooled over each group's requests (their decode tokens over their steps). For a method whose decode
    steps are verification steps this is its acceptance length; plain decoding gives 1."""
    frame = requests.assign(decode_tokens=requests["output_tokens"] - 1)
    if by:
        frame = frame.groupby(list(by))[["decode_tokens", "decode_steps"]].sum()
    steps = frame["decode_steps"].where(frame["decode_steps"] > 0)
    return (frame["decode_tokens"] / steps).rename("tokens_per_decode_step")


# -- energy -----------------------------------------------------------------------------------------


def node_power(telemetry: pd.DataFrame) -> pd.DataFrame:
    """Each node's total power per sample, ``run_id, node, kind, ts_s, power_mw``: a board's
    ``board_power_mw`` where it reports one (Jetsons: the sum of its rails, so the rails are not
    added again), otherwise the sum of its ``power_mw`` sensors at each sample (GPUs, RAPL
    packages, a phone's battery, the emulated model), decided per kind. Measured and modeled stay
    separate rows."""
    power = telemetry[telemetry["metric"].isin(["board_power_mw", "power_mw"])]
    if power.empty:
        return pd.DataFrame(columns=["run_id", "node", "kind", "ts_s", "power_mw"])
    has_board = power[power["metric"] == "board_power_mw"].groupby(["run_id", "node", "kind"]).size().index
    keyed = power.set_index(["run_id", "node", "kind"])
    board = keyed.index.isin(has_board)
    chosen = keyed[(board & (keyed["metric"] == "board_power_mw").to_numpy())
                   | (~board & (keyed["metric"] == "power_mw").to_numpy())].reset_index()  # fmt: skip
    return (chosen.groupby(["run_id", "node", "kind", "ts_s"], sort=True)["value"].sum()
            .rename("power_mw").reset_index())  # fmt: skip


def _cumulative_energy_j(ts: np.ndarray, power_mw: np.ndarray) -> np.ndarray:
    """Energy since the first sample at each sample time: a sample's power holds over the interval
    that ends at it (power sensors report averages over the past period)."""
    return np.concatenate([[0.0], np.cumsum(power_mw[1:] * np.diff(ts) / 1e3)])


def node_energy(power: pd.DataFrame) -> pd.DataFrame:
    """Per run, node and kind: ``energy_j`` over the sampled span, ``span_s`` and ``mean_power_w``."""
    rows = []
    for (run_id, node, kind), part in power.groupby(["run_id", "node", "kind"], sort=True):
        part = part.sort_values("ts_s", kind="stable")
        ts, p = part["ts_s"].to_numpy(), part["power_mw"].to_numpy()
        energy = _cumulative_energy_j(ts, p)[-1] if len(ts) > 1 else 0.0
        span = ts[-1] - ts[0] if len(ts) > 1 else 0.0
        rows.append({"run_id": run_id, "node": node, "kind": kind, "energy_j": energy, "span_s": span,
                     "mean_power_w": energy / span if span > 0 else np.nan})  # fmt: skip
    return pd.DataFrame(rows, columns=["run_id", "node", "kind", "energy_j", "span_s", "mean_power_w"])


def _shared_energy_j(ts: np.ndarray, power_mw: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                     marks: Sequence[np.ndarray]) -> list[np.ndarray]:  # fmt: skip
    """Energy between consecutive ``marks`` (arrays of times, one per boundary), each instant's
    power shared equally among the windows [start, end] active then; time outside the sampled
    span counts nothing."""
    cuts = np.unique(np.concatenate([ts, starts, ends]))
    cuts = cuts[(cuts >= ts[0]) & (cuts <= ts[-1])]
    left, right = cuts[:-1], cuts[1:]
    p = power_mw[np.clip(np.searchsorted(ts, right, side="left"), 0, len(ts) - 1)]
    s, e = np.sort(starts), np.sort(ends)
    active = np.searchsorted(s, left, side="right") - np.searchsorted(e, left, side="right")
    share = np.where(active > 0, p * (right - left) / 1e3 / np.maximum(active, 1), 0.0)
    cumulative = np.concatenate([[0.0], np.cumsum(share)])
    at = [np.interp(np.clip(m, cuts[0], cuts[-1]), cuts, cumulative) for m in marks]
    return [b - a for a, b in itertools.pairwise(at)]


def request_energy(requests: pd.DataFrame, power: pd.DataFrame) -> pd.DataFrame:
    """Energy of each completed request on each node that served it, by integrating the node's power
    over the request's prefill window [arrival, first token] and decode window [first token, last
    token] on the controller's clock. A device serves its own requests; a node without requests in
    the run (the server) serves all of them, its power shared equally among the requests active at
    each instant. Rows: ``run_id, node, request_id, energy_node, role, kind, prefill_energy_j,
    decode_energy_j, energy_j, output_tokens, energy_per_token_j``. Measured and modeled stay
    separate rows: add them up only within one ``kind``."""
    columns = ["run_id", "node", "request_id", "energy_node", "role", "kind", "prefill_energy_j",
               "decode_energy_j", "energy_j", "output_tokens", "energy_per_token_j"]  # fmt: skip
    need = ["arrival_ts_s", "first_token_ts_s", "last_token_ts_s"]
    if power.empty or not set(need) <= set(requests.columns):
        return pd.DataFrame(columns=columns)
    done = requests[requests["completed"]].dropna(subset=need) if "completed" in requests else requests.dropna(
        subset=need)
    devices = requests.groupby("run_id")["node"].agg(set).to_dict()  # every node that issued a request
    parts = []
    for (run_id, node, kind), samples in power.groupby(["run_id", "node", "kind"], sort=True):
        run_requests = done[done["run_id"] == run_id]
        is_device = node in devices.get(run_id, set())
        served = run_requests[run_requests["node"] == node] if is_device else run_requests
        role = "device" if is_device else "server"
        if served.empty or len(samples) < 2:
            continue
        samples = samples.sort_values("ts_s", kind="stable")
        ts, p = samples["ts_s"].to_numpy(), samples["power_mw"].to_numpy()
        a, f, z = (served[c].to_numpy(dtype="float64") for c in need)
        prefill, decode = _shared_energy_j(ts, p, a, z, [a, f, z])
        part = served[["run_id", "node", "request_id", "output_tokens"]].copy()
        part["energy_node"], part["role"], part["kind"] = node, role, kind
        part["prefill_energy_j"], part["decode_energy_j"] = prefill, decode
        parts.append(part)
    if not parts:
        return pd.DataFrame(columns=columns)
    out = pd.concat(parts, ignore_index=True)
    out["energy_j"] = out["prefill_energy_j"] + out["decode_energy_j"]
    out["energy_per_token_j"] = out["energy_j"] / out["output_tokens"].where(out["output_tokens"] > 0)
    return out[columns]


# -- cost (DiSCo App. E) ----------------------------------------------------------------------------


def request_cost(requests: pd.DataFrame, runs: pd.DataFrame, shape: ModelShape, *, api: str,
                 device_usd_per_pflop: float) -> pd.DataFrame:  # fmt: skip
    """DiSCo's unified cost of each completed request, split by endpoint: the device's share is the
    FLOPs it ran (DiSCo Eq. 7-9: embedding, its ``partition.device_layers`` layers and the head
    under U-shaped methods; nothing under ``centralized``) at ``device_usd_per_pflop``; the server's
    share is the API price of the request's tokens (DiSCo Table 8) scaled by the server's share of
    the request's FLOPs (all of it under ``centralized``). Columns: ``run_id, node, request_id,
    device_flops, server_flops, device_usd, server_usd, total_usd``."""
    settings = runs[["run_id", "method", "partition.device_layers"]].copy()
    done = requests[requests["completed"]] if "completed" in requests else requests
    frame = done[["run_id", "node", "request_id", "prompt_tokens", "output_tokens"]].merge(settings, on="run_id")
    centralized = (frame["method"] == "centralized").to_numpy()
    m = np.where(centralized, 0, frame["partition.device_layers"].fillna(0).to_numpy()).astype("float64")
    L, n = frame["prompt_tokens"].to_numpy(dtype="float64"), frame["output_tokens"].to_numpy(dtype="float64")
    whole = sum(request_flops(shape, L, n, shape.n_layers, True))
    per_layer = sum(request_flops(shape, L, n, 1, False))
    head = whole - shape.n_layers * per_layer
    device = np.where(centralized, 0.0, head + m * per_layer)
    server = whole - device
    out = frame[["run_id", "node", "request_id"]].copy()
    out["device_flops"], out["server_flops"] = device, server
    out["device_usd"] = device / 1e15 * device_usd_per_pflop
    out["server_usd"] = api_price_usd(api, L, n) * server / whole
    out["total_usd"] = out["device_usd"] + out["server_usd"]
    return out
