"""LLMS's context-switching traces (LLMS Sec. 4, Eq. 5): {(time, context id, prompt, ground truth)}.

- Calls arrive as a Poisson process (one every ``mean_gap_s``, 5 minutes in the paper, over 72 hours);
  the clock may be compressed, since switching latency depends on the memory's state, not on idle time.
- Each context belongs to one of Table 3's tasks; each call grows its context by a delta length drawn
  uniformly from the task's range (prompt plus ground-truth output; the output share is
  ``output_share`` of it, teacher-forced in latency runs).
- Which context a call goes to follows a switching pattern over N active contexts:
  ``random`` (uniform), ``markov`` (favours recent ones: P ∝ 0.5^k for the context used k distinct
  switches ago, our reading of the paper's "favours recent contexts"), ``gaussian`` (favours moderate
  delta lengths: the k-th most recent context drawn with k ~ N((N-1)/2, N/4), our reading).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from foundation.errors import TestbedError
from nodes.contracts.schedules import request_id

# Table 3: context growth per call (tokens), by task and dataset
TASK_DELTAS: dict[str, tuple[int, int]] = {
    "agnews": (200, 500),  # news classification
    "xsum": (1000, 2000),  # document summary
    "samsum": (100, 300),  # chat history summary
    "cnndm": (500, 1000),  # text comprehension
    "wmt17": (100, 500),  # translation de-en
    "sst2": (10, 100),  # sentiment
}
PATTERNS = ("random", "markov", "gaussian")


@dataclass(frozen=True)
class TraceCall:
    time_s: float
    context: int
    task: str
    prompt_tokens: int
    output_tokens: int  # the ground truth's length (teacher-forced)
    restart: bool = False  # the context was full: the app deletes it and begins a new one with this call


def _pick(pattern: str, recency: list[int], contexts: int, rng: np.random.Generator) -> int:
    if pattern == "random" or len(recency) < contexts:
        return int(rng.integers(contexts))
    if pattern == "markov":
        weights = 0.5 ** np.arange(contexts)
        k = int(rng.choice(contexts, p=weights / weights.sum()))
    else:  # gaussian over how recent
        k = int(np.clip(np.rint(rng.normal((contexts - 1) / 2.0, contexts / 4.0)), 0, contexts - 1))
    return recency[k]


def context_trace(contexts: int, calls: int, pattern: str = "random", *, tasks: tuple[str, ...] = tuple(TASK_DELTAS),
                  mean_gap_s: float = 300.0, output_share: float = 0.2, max_context_tokens: int | None = None,
                  seed: int = 0) -> list[TraceCall]:  # fmt: skip
    """``calls`` calls over ``contexts`` contexts (context i of task ``tasks[i % len(tasks)]``). With
    ``max_context_tokens``, a call that would overflow its context is shrunk to the room left; a
    context with no room left (under a tenth of its task's smallest delta) begins again (``restart``)."""
    if pattern not in PATTERNS:
        raise TestbedError(f"switching pattern {pattern!r}: one of {', '.join(PATTERNS)}")
    unknown = [t for t in tasks if t not in TASK_DELTAS]
    if unknown:
        raise TestbedError(f"task {unknown[0]!r}: one of {', '.join(TASK_DELTAS)}")
    if contexts < 1 or calls < 0:
        raise TestbedError("a trace needs at least one context and no negative count of calls")
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(mean_gap_s, size=calls))
    recency: list[int] = []  # most recent first, each context once
    sizes = [0] * contexts
    out = []
    for time_s in times:
        context = _pick(pattern, recency, contexts, rng)
        task = tasks[context % len(tasks)]
        low, high = TASK_DELTAS[task]
        delta = int(rng.integers(low, high + 1))
        restart = False
        if max_context_tokens is not None:
            if max_context_tokens - sizes[context] < max(2, low // 10):
                restart, sizes[context] = True, 0
            delta = min(delta, max_context_tokens - sizes[context])
        output = round(delta * output_share)
        out.append(TraceCall(float(time_s), context, task, max(1, delta - output), output, restart))
        sizes[context] += max(1, delta - output) + output
        if context in recency:
            recency.remove(context)
        recency.insert(0, context)
    return out


def context_schedule(
    trace: list[TraceCall], *, device_index: int, apps: int, model_dir: str | Path, seed: int
) -> list[dict[str, Any]]:
    """A device's schedule for the LLM service: one row per call of ``trace`` (keys sorted by the writer),
    with the call's token ids cut from the model's held-out text (consecutive slices from a drawn start):

        {"request_id": 1000003, "arrival_s": 1.52, "context": "c2", "app": "app-0", "task": "samsum",
         "restart": false, "prompt_ids": [...], "ground_truth_ids": [...], "prompt_tokens": 160,
         "output_tokens": 40, "max_new_tokens": 40, "prompt_source": "context-trace:samsum:<file>:<line>"}

    Context ``c<i>`` belongs to app ``app-<i mod apps>``. The ids carry no BOS: the service adds it
    where a context begins."""
    from workloads.corpus import held_out_corpus, held_out_every
    from workloads.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    corpus = held_out_corpus(held_out_every(model_dir))
    needed = sum(c.prompt_tokens + c.output_tokens for c in trace)
    rng = np.random.default_rng(seed)
    start = int(corpus.line_starts[corpus.nonblank_lines[int(rng.integers(len(corpus.nonblank_lines)))]])
    chars = 6 * needed + 4096
    ids = tokenizer.encode(corpus.window(start, chars), bos=False)
    while len(ids) < needed + 8 and chars < 64 * len(corpus.text):
        chars *= 2
        ids = tokenizer.encode(corpus.window(start, chars), bos=False)
    if len(ids) < needed:
        raise TestbedError(f"the held-out text has {len(ids)} tokens, fewer than the trace's {needed}")
    path, line = corpus.locate(start)
    rows, offset = [], 0
    for i, call in enumerate(trace):
        prompt = ids[offset: offset + call.prompt_tokens]
        truth = ids[offset + call.prompt_tokens: offset + call.prompt_tokens + call.output_tokens]
        offset += call.prompt_tokens + call.output_tokens
        rows.append({
            "request_id": request_id(device_index, i), "arrival_s": round(call.time_s, 6),
            "context": f"c{call.context}", "app": f"app-{call.context % apps}", "task": call.task,
            "restart": call.restart, "prompt_ids": [int(t) for t in prompt],
            "ground_truth_ids": [int(t) for t in truth], "prompt_tokens": len(prompt), "output_tokens": len(truth),
            "max_new_tokens": max(1, len(truth)), "prompt_source": f"context-trace:{call.task}:{path}:{line}",
        })  # fmt: skip
    return rows
