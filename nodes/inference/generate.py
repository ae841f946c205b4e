"""Greedy generation in one process: the reference every split method must reproduce token for token."""

from typing import List, Optional, Sequence

import torch

from .model import ModelPart, Segment


@torch.inference_mode()
def greedy_generate(
    model: ModelPart, prompt_ids: Sequence[int], max_new_tokens: int, eos_id: Optional[int] = None
) -> List[int]:
    """The ids generated after ``prompt_ids`` (prompt excluded), stopping at ``eos_id`` (included)."""
    cache = model.new_cache(len(prompt_ids) + max_new_tokens)
    ids = torch.tensor(list(prompt_ids), dtype=torch.long)
    hidden = model.run_layers(model.embed(ids), [Segment(cache, len(prompt_ids))])
    out: List[int] = []
    while len(out) < max_new_tokens:
        token = int(torch.argmax(model.logits(hidden[-1])).item())
        out.append(token)
        if token == eos_id or len(out) == max_new_tokens:
            break
        hidden = model.run_layers(model.embed(torch.tensor([token])), [Segment(cache, 1)])
    return out


@torch.inference_mode()
def greedy_generate_batch(
    model: ModelPart, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_id: Optional[int] = None
) -> List[List[int]]:
    """:func:`greedy_generate` for several prompts at once, packed into one batch per step (prefill one
    prompt at a time, decode the unfinished ones together): the same tokens as one by one, but where a
    step's two best logits are closer than float rounding across batch shapes."""
    caches = [model.new_cache(len(ids) + max_new_tokens) for ids in prompts]
    last = []
    for ids, cache in zip(prompts, caches):
        hidden = model.run_layers(model.embed(torch.tensor(list(ids), dtype=torch.long)), [Segment(cache, len(ids))])
        last.append(hidden[-1])
    outs: List[List[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    hidden = torch.stack(last)
    while live:
        tokens = torch.argmax(model.logits(hidden), dim=-1).tolist()
        going = []
        for row, token in zip(live, tokens):
            outs[row].append(int(token))
            if token != eos_id and len(outs[row]) < max_new_tokens:
                going.append(row)
        if not going:
            break
        live = going
        step = torch.tensor([outs[row][-1] for row in live], dtype=torch.long)
        hidden = model.run_layers(model.embed(step), [Segment(caches[row], 1) for row in live])
    return outs
