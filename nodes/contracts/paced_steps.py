"""A paced step's record, ``steps.csv`` in a rank's directory: the fidelity monitor's one format.

A rank that paces its work to the target hardware (a worker's model steps, an endpoint's tokens) writes
one row per step: when it began (``ts_s``, from the rank's start), its operation, the target's layers,
tokens, sequences and context it stood for, its real and target seconds, how late it ended past its
due time (``late_s``) and whether it ``overran``: its real computation took longer than its target, or
it ended later than :func:`late_tolerance_s` past its due time. The controller reads every rank's rows
(testbed/campaign/results.py) and analysis/fidelity.py counts the overruns.

A DiSCo endpoint's tokens are steps too (ops :data:`ENDPOINT_OPS`): the prompt's prefill against the
first token's time, then each token against its gap, with no layer count (a token stands for the whole
model) and no dilation (its pace is a trace's or a phone's, in real time).
"""

from typing import Any, Dict

STEP_COLUMNS = ("ts_s", "op", "layers", "tokens", "sequences", "context_tokens", "real_s", "target_s", "late_s",
                "overrun")
LATE_FLOOR_S = 0.0005  # a step may always end this late (a wake-up's scheduling noise)
LATE_SHARE = 0.05  # a step that ends later than this share of its target past its due time overran


ENDPOINT_OPS = ("endpoint_prefill", "endpoint_token")


def late_tolerance_s(target_s: float) -> float:
    """How late past its due time a step may end and still count as on time: 5% of the step, and at
    least :data:`LATE_FLOOR_S`."""
    return max(LATE_FLOOR_S, LATE_SHARE * target_s)


def overran(computed_s: float, due_s: float, late_s: float, target_s: float) -> bool:
    """Whether a step overran: its real work ended (at ``computed_s``) after its due time, or the step
    ended (``late_s`` past it) later than :func:`late_tolerance_s` allows."""
    return computed_s > due_s or late_s > late_tolerance_s(target_s)


def step_row(ts_s: float, op: str, layers: int, tokens: int, sequences: int, context_tokens: int, real_s: float,
             target_s: float, late_s: float, overrun: bool) -> Dict[str, Any]:
    """One row of ``steps.csv``, times rounded to the microsecond."""
    return {"ts_s": round(ts_s, 6), "op": op, "layers": layers, "tokens": tokens, "sequences": sequences,
            "context_tokens": context_tokens, "real_s": round(real_s, 6), "target_s": round(target_s, 6),
            "late_s": round(late_s, 6), "overrun": int(overrun)}  # fmt: skip
