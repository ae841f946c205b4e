"""Exact recompute of interleaved missing chunks (LLMS Sec. 3.3, Fig. 7).

Some positions of a context's keys and values are missing (their chunks were reclaimed); the others
are resident. The missing tokens are embedded and run through every layer at their global positions
(RoPE at those positions); in each layer their keys and values are written among the resident ones,
and their queries attend over all keys at or before their own position (a causal mask over scattered
queries), which gives the next layer's input. The result equals computing the whole sequence.
"""

from typing import Callable, Dict, Optional, Sequence

import torch

from nodes.inference.model import ModelPart
from nodes.inference.rope import apply_rotary

LayerHook = Callable[[int], None]


def recompute_positions(model: ModelPart, token_ids: Sequence[int], keys: Dict[int, torch.Tensor],
                        values: Dict[int, torch.Tensor], positions: Sequence[int],
                        after_layer: Optional[LayerHook] = None,
                        before_layer: Optional[LayerHook] = None) -> None:  # fmt: skip
    """Fill ``keys[l][:, p]`` and ``values[l][:, p]`` ([kv_heads, length, head_dim] per layer) for every
    p in ``positions`` from ``token_ids`` (the context's text as ids). ``before_layer(l)`` is called
    before layer l reads the other positions' keys and values (the pipeline waits there for that
    layer's chunks from disk); ``after_layer(l)`` when layer l is done."""
    if not positions:
        return
    device, dtype = model.device, model.dtype
    where = torch.tensor(sorted(positions), device=device)
    length = int(where[-1]) + 1  # no key after the last missing query matters to it
    hidden = model.embed(torch.tensor([token_ids[int(p)] for p in where], device=device)).to(dtype)
    cos, sin = model.rotary.cos_sin(where, dtype, length)
    with torch.inference_mode():
        for index in model.layer_ids:
            if before_layer is not None:
                before_layer(index)
            layer = model.layers[str(index)]
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            n = x.shape[0]
            q = apply_rotary(attn.q_proj(x).view(n, attn.heads, attn.head_dim).transpose(0, 1), cos, sin)
            k = apply_rotary(attn.k_proj(x).view(n, attn.kv_heads, attn.head_dim).transpose(0, 1), cos, sin)
            v = attn.v_proj(x).view(n, attn.kv_heads, attn.head_dim).transpose(0, 1)
            keys[index][:, where] = k.to(keys[index].dtype)
            values[index][:, where] = v.to(values[index].dtype)
            all_k = keys[index][:, :length].to(dtype)
            all_v = values[index][:, :length].to(dtype)
            out = attn.attend(q, all_k, all_v, 0, query_positions=where)
            hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(n, attn.heads * attn.head_dim))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if after_layer is not None:
                after_layer(index)
