"""Trace-driven runs of the dispatch controller (DiSCo Sec. 5.1): requests replayed in virtual time
against a server whose first-token and inter-token times are drawn from a service trace and a device
paced at its measured rates. Every request is independent (30 s mean arrival interval in the paper:
the device serves one at a time), so the run is vectorised over requests.

For each request: the route (``DispatchPlan.starts``) gives the race, TTFT = min(server first token,
device start + T_d(l)) where the device starts only if the server has not answered by its start;
the winner streams; with a ``MigrationRule`` the stream may move to the other endpoint (Eq. 4-5):
the source keeps streaming until the target has re-prefilled prompt + generated tokens (token ids
only), then the source is cancelled. A device target that finds the source ahead prefills the extra
tokens (catch-up) before it decodes on. The client shows tokens no faster than r_c (its buffer).

Billing (the brief's pitfall 2): a server that was sent a request bills its input tokens in full,
also when cancelled, and the tokens it produced; the device is charged the share of a prefill it did
before it was cancelled. Everything here is modeled time: no token is computed.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np

from nodes.endpoints.device_speed import DeviceSpeed
from nodes.endpoints.services import ServiceModel

from .controller import GENERATION_CAP_TOKENS, NEVER, DispatchPlan, MigrationRule
from .policy import DEVICE, SERVER

EPSILON_S = 1e-9
# A phone's TTFT for one prompt varies by a few percent run to run (DiSCo Fig. 2: "stable"); our
# reading, so that T_d is fitted from noisy calibration runs as on a real phone
DEVICE_JITTER_SIGMA = 0.03


@dataclass(frozen=True)
class ReplayInput:
    """One run's requests and the server's behaviour for them (drawn once per seed, so that every
    policy of a seed meets the same server)."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    server_ttft_s: np.ndarray
    server_gaps_s: np.ndarray  # (requests, cap - 1): the server's inter-token times
    migration_ttft_s: np.ndarray  # the server's TTFT for a request migrated to it (a new request)
    draws: np.ndarray  # uniform, one per request: the Stoch coin and the boundary split
    device_jitter: np.ndarray  # the device's prefill time over its nominal one, per request

    @classmethod
    def draw(cls, service: ServiceModel, prompt_tokens: np.ndarray, output_tokens: np.ndarray,
             rng: np.random.Generator, device_jitter_sigma: float = DEVICE_JITTER_SIGMA) -> "ReplayInput":  # fmt: skip
        n = len(prompt_tokens)
        outputs = np.clip(np.asarray(output_tokens, dtype="int64"), 1, GENERATION_CAP_TOKENS)
        return cls(np.asarray(prompt_tokens, dtype="int64"), outputs, service.ttft_s(rng, n),
                   service.inter_token_s(rng, (n, GENERATION_CAP_TOKENS - 1)), service.ttft_s(rng, n),
                   rng.random(n), np.exp(device_jitter_sigma * rng.standard_normal(n)))  # fmt: skip


def draw_seeded(service: ServiceModel, prompt_tokens: np.ndarray, output_tokens: np.ndarray,
                seeds: Sequence[int], draws: np.ndarray) -> ReplayInput:  # fmt: skip
    """The requests a trace endpoint serves when each names its ``seed``: per request, its TTFT and
    then its gaps from ``default_rng(seed)`` (``TracePace.seeded``), a fresh draw for a migration's
    TTFT, and no device jitter (the device endpoint paces exactly)."""
    n = len(prompt_tokens)
    ttft, gaps = np.zeros(n), np.zeros((n, GENERATION_CAP_TOKENS - 1))
    for i, seed in enumerate(seeds):
        rng = np.random.default_rng(int(seed))
        ttft[i] = service.ttft_s(rng, 1)[0]
        gaps[i] = service.inter_token_s(rng, GENERATION_CAP_TOKENS - 1)
    outputs = np.clip(np.asarray(output_tokens, dtype="int64"), 1, GENERATION_CAP_TOKENS)
    migration = service.ttft_s(np.random.default_rng([int(s) for s in seeds]), n)
    return ReplayInput(np.asarray(prompt_tokens, dtype="int64"), outputs, ttft, gaps, migration,
                       np.asarray(draws, dtype="float64"), np.ones(n))  # fmt: skip


@dataclass(frozen=True)
class ReplayResult:
    """Per request (arrays of the run's length) and the display gaps of the whole run."""

    ttft_s: np.ndarray
    winner_device: np.ndarray  # bool: the device produced the first token
    server_input_tokens: np.ndarray  # billed at the server (race and migration)
    server_output_tokens: np.ndarray
    device_prefill_tokens: np.ndarray  # done on the device (partial prefills included)
    device_decode_tokens: np.ndarray
    race_server_input_tokens: np.ndarray  # the race alone: what the server budget counts
    race_device_prefill_tokens: np.ndarray  # the race alone: what the device budget counts
    migrated: np.ndarray  # bool
    delayed_tokens: np.ndarray  # tokens shown later than without the migration
    held_tokens: np.ndarray  # tokens in the client's buffer when the migration began (>= B)
    last_display_s: np.ndarray
    display_gaps_s: np.ndarray  # TBT after the buffer, all requests
    migrated_display_gaps_s: np.ndarray  # the same, migrated requests only
    arrival_gaps_s: np.ndarray  # TBT before the buffer, all requests
    prompt_tokens_total: float

    def summary(self) -> Dict[str, float]:
        """The run's numbers (seconds, tokens, shares) as the report tables read them."""
        moved = self.migrated

        def pct(values: np.ndarray, q: float) -> float:
            return float(np.percentile(values, q)) if len(values) else float("nan")

        return {
            "mean_ttft_s": float(self.ttft_s.mean()), "p99_ttft_s": pct(self.ttft_s, 99),
            "p50_ttft_s": pct(self.ttft_s, 50), "device_first_share": float(self.winner_device.mean()),
            "migrated_share": float(moved.mean()),
            "held_tokens_mean": float(self.held_tokens[moved].mean()) if moved.any() else float("nan"),
            "held_tokens_p99": pct(self.held_tokens[moved], 99),
            "slipped_tokens_mean": float(self.delayed_tokens[moved].mean()) if moved.any() else float("nan"),
            "slipped_tokens_p99": pct(self.delayed_tokens[moved], 99),
            "tbt_p99_s": pct(self.display_gaps_s, 99), "migrated_tbt_p99_s": pct(self.migrated_display_gaps_s, 99),
            "arrival_tbt_p99_s": pct(self.arrival_gaps_s, 99), "tbt_mean_s": float(self.display_gaps_s.mean()),
            "server_input_tokens": float(self.server_input_tokens.sum()),
            "device_prefill_tokens": float(self.device_prefill_tokens.sum()),
        }  # fmt: skip

    def realised_budget(self, regime: str) -> float:
        """The constrained endpoint's share of all input tokens (the race's, not the migrations')."""
        spent = self.race_server_input_tokens if regime == SERVER else self.race_device_prefill_tokens
        return float(spent.sum() / self.prompt_tokens_total) if self.prompt_tokens_total else 0.0


def display_times(arrivals_s: np.ndarray, consumption_tok_s: float) -> np.ndarray:
    """The client buffer: token i is shown at max(arrival_i, shown_{i-1} + 1/r_c), along the last
    axis; closed form max_{j <= i}(a_j + (i - j)/r_c)."""
    step = 1.0 / consumption_tok_s
    index = np.arange(arrivals_s.shape[-1]) * step
    return index + np.maximum.accumulate(arrivals_s - index, axis=-1)


def replay(plan: DispatchPlan, run: ReplayInput, device: DeviceSpeed, consumption_tok_s: float,
           migration: Optional[MigrationRule] = None) -> ReplayResult:  # fmt: skip
    """Replay ``run``'s requests under ``plan`` (see the module docstring)."""
    lengths, outputs = run.prompt_tokens, run.output_tokens
    n, cap = len(lengths), GENERATION_CAP_TOKENS
    server_start, device_start = plan.starts(lengths, run.draws)
    server_first = server_start + run.server_ttft_s  # inf where the server was not asked
    device_runs = device_start < server_first  # it starts only if the server has not answered
    device_prefill_s = device.ttft_s(lengths) * run.device_jitter
    device_first = np.where(device_runs, device_start + device_prefill_s, NEVER)
    winner_device = device_first < server_first
    ttft = np.minimum(server_first, device_first)
    if not np.all(np.isfinite(ttft)):
        raise ValueError("a route started neither endpoint")
    asked_server = np.isfinite(server_start)
    # the race's bill: the server's input in full; the device's prefill up to its cancellation
    race_server_in = np.where(asked_server, lengths, 0).astype("float64")
    device_done = np.where(winner_device, 1.0,
                           np.clip((server_first - device_start) / device_prefill_s, 0.0, 1.0))  # fmt: skip
    race_device_prefill = np.where(device_runs, lengths * device_done, 0.0)

    # each winner's own stream: arrival of token k (k = 0 .. cap - 1)
    steps = np.arange(cap)
    server_stream = server_first[:, None] + np.concatenate([np.zeros((n, 1)), np.cumsum(run.server_gaps_s, axis=1)], 1)
    device_stream = device_first[:, None] + steps[None, :] * device.decode_s()
    arrivals = np.where(winner_device[:, None], device_stream, server_stream)
    produced = steps[None, :] < outputs[:, None]
    shown = display_times(arrivals, consumption_tok_s)

    server_out = np.where(winner_device, 0, outputs).astype("float64")
    device_decode = np.where(winner_device, outputs, 0).astype("float64")
    server_in = race_server_in.copy()
    device_prefill = race_device_prefill.copy()
    migrated = np.zeros(n, dtype=bool)
    delayed = np.zeros(n)
    held = np.zeros(n)
    if migration is not None:
        for r in range(n):
            moved = _migrate(r, migration, run, device, lengths[r], int(outputs[r]), bool(winner_device[r]),
                             arrivals[r], shown[r], consumption_tok_s)  # fmt: skip
            if moved is None:
                continue
            new_arrivals, handoff, ready_context, held[r] = moved
            new_shown = display_times(new_arrivals, consumption_tok_s)
            k = int(outputs[r])
            delayed[r] = int(np.sum(new_shown[:k] > shown[r, :k] + EPSILON_S))
            arrivals[r], shown[r] = new_arrivals, new_shown
            migrated[r] = True
            if winner_device[r]:  # device -> server: a new server request on prompt + handoff tokens
                device_decode[r] = handoff
                server_in[r] += ready_context
                server_out[r] = k - handoff
            else:  # server -> device: the device prefills prompt + handoff tokens (catch-up included)
                server_out[r] = handoff
                device_prefill[r] += ready_context
                device_decode[r] = k - handoff
    gaps = np.diff(shown, axis=1)
    raw_gaps = np.diff(arrivals, axis=1)
    inside = produced[:, 1:]
    result = ReplayResult(
        ttft_s=ttft, winner_device=winner_device, server_input_tokens=server_in, server_output_tokens=server_out,
        device_prefill_tokens=device_prefill, device_decode_tokens=device_decode,
        race_server_input_tokens=race_server_in, race_device_prefill_tokens=race_device_prefill,
        migrated=migrated, delayed_tokens=delayed, held_tokens=held,
        last_display_s=shown[np.arange(n), outputs - 1], display_gaps_s=gaps[inside],
        migrated_display_gaps_s=gaps[inside & migrated[:, None]], arrival_gaps_s=raw_gaps[inside],
        prompt_tokens_total=float(lengths.sum()),
    )  # fmt: skip
    return result


def _migrate(r: int, rule: MigrationRule, run: ReplayInput, device: DeviceSpeed, prompt: int, outputs: int,
             from_device: bool, arrivals: np.ndarray, shown: np.ndarray, consumption_tok_s: float):  # fmt: skip
    """The request's arrivals with its stream migrated, the tokens the source produced (handoff), the
    context the target prefilled and the tokens the client held when the migration began; None when
    it does not migrate."""
    source = DEVICE if from_device else SERVER
    if outputs < 2 or not rule.worth_it(source, prompt, 1):
        return None
    # after token i arrives the buffer holds i + 1 minus the tokens shown by then; start at the first
    # i (before the last token) where that reaches B for prompt + i + 1 tokens of context
    index = np.arange(outputs - 1)
    buffered = index + 1 - np.searchsorted(shown[:outputs], arrivals[: outputs - 1], side="right")
    ready_enough = np.flatnonzero(buffered >= rule.buffer_tokens(source, prompt + index + 1))
    if not len(ready_enough):
        return None
    start = int(ready_enough[0])
    begun, generated, held = arrivals[start], start + 1, int(buffered[start])
    if from_device:  # the server answers the new request after a fresh TTFT
        ready = begun + run.migration_ttft_s[r]
    else:
        ready = begun + float(device.ttft_s(prompt + generated)) * run.device_jitter[r]
    if rule.source_keeps_streaming:  # the source's tokens by the time the target is ready
        handoff = int(np.searchsorted(arrivals[:outputs], ready, side="right"))
    else:  # the other reading of Sec. 4.3: the source stops when the migration begins
        handoff = generated
    if handoff >= outputs:  # the source finished first: the target is cancelled, its prefill spent
        return None
    new = arrivals.copy()
    if from_device:  # the server generated from token `generated`; the client keeps the source's up to handoff
        server_tokens = ready + np.concatenate([[0.0], np.cumsum(run.server_gaps_s[r])])
        new[handoff:] = server_tokens[handoff - generated : len(arrivals) - generated]
        return new, handoff, prompt + generated, held
    # the device's prefill yields token `generated`; the source's tokens past it are prefilled too
    # (catch-up), and that prefill yields token `handoff`
    catch_up_s = (handoff - generated) / device.prefill_tok_s
    new[handoff:] = ready + catch_up_s + np.arange(len(arrivals) - handoff) * device.decode_s()
    return new, handoff, prompt + handoff, held
