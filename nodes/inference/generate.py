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
