"""Each GPU's memory budget (weights + KV) as the worker enforces it (CoCoServe Sec. 6: an
out-of-memory is a failed request, counted in the OOM rate, never a crash of the worker).

A GPU holds its layer copies' weights, a fixed share (embedding and LM head on the instance's GPU,
activations), and for each sequence the keys and values of the layers it is served on there. Before a
step, :func:`out_of_memory` says which sequences cannot grow by their new tokens: the newest first,
until every GPU fits (the oldest requests, furthest along, are kept). Bytes may be the target's (a
Llama-2-13B layer is 605 MB, 800 KB of KV a token over its 40 layers): the accounting is logical,
as the brief asks, not the process's memory.
"""

from typing import Dict, List, Mapping, NamedTuple, Sequence, Tuple


class MemoryCosts(NamedTuple):
    layer_bytes: int  # one decoder layer's weights
    kv_bytes_per_token_layer: int  # one token's keys and values in one layer
    fixed_bytes: Mapping[str, int] = {}  # per GPU, what it holds besides layers and KV


class SequenceUse(NamedTuple):
    ident: int
    serving: Mapping[int, str]  # layer -> the GPU that serves this sequence (and holds its KV)
    tokens: int  # the tokens its KV holds now
    new_tokens: int = 0  # what this step adds


def used_bytes(hosts: Mapping[int, Sequence[str]], sequences: Sequence[SequenceUse], costs: MemoryCosts,
               with_new_tokens: bool = False) -> Dict[str, int]:  # fmt: skip
    """Per GPU: fixed bytes, weights of the copies it holds, the KV of the sequences it serves (after
    this step's tokens with ``with_new_tokens``)."""
    used: Dict[str, int] = dict(costs.fixed_bytes)
    for gpus in hosts.values():
        for gpu in gpus:
            used[gpu] = used.get(gpu, 0) + costs.layer_bytes
    for sequence in sequences:
        tokens = sequence.tokens + (sequence.new_tokens if with_new_tokens else 0)
        for gpu in sequence.serving.values():
            used[gpu] = used.get(gpu, 0) + tokens * costs.kv_bytes_per_token_layer
    return used


def out_of_memory(hosts: Mapping[int, Sequence[str]], sequences: Sequence[SequenceUse], costs: MemoryCosts,
                  budgets: Mapping[str, int]) -> Tuple[List[int], Dict[str, int]]:  # fmt: skip
    """The sequences that fail this step for lack of memory (newest first, the highest ident, until
    every GPU with a budget fits with the others' new tokens), and the bytes each GPU then uses."""
    alive = sorted(sequences, key=lambda s: s.ident)
    failed: List[int] = []
    while True:
        used = used_bytes(hosts, alive, costs, with_new_tokens=True)
        over = [g for g, limit in budgets.items() if used.get(g, 0) > limit]
        if not over or not alive:
            return failed, used
        # the newest sequence holding KV on an overfull GPU goes
        victim = next((s for s in reversed(alive) if any(g in over for g in s.serving.values())), None)
        if victim is None:  # weights alone overfill it: no sequence can help
            return failed, used
        alive.remove(victim)
        failed.append(victim.ident)

