"""Rotary position embeddings (RoPE) with the usual scaling options.

``default`` (Su et al.), ``linear`` (position interpolation), ``dynamic`` (NTK-aware, recomputed
from the sequence length once it passes the trained context), ``llama3`` (Llama 3.1's frequency-
band smoothing) and ``yarn`` (Peng et al., with its attention factor applied to cos and sin). The
formulas follow transformers' ``modeling_rope_utils`` so that logits match LlamaForCausalLM.
Rotation is the "rotate half" layout used by Hugging Face Llama checkpoints.
"""

import math
from typing import Optional, Tuple

import torch

from .config import LlamaConfig


def _base_inv_freq(theta: float, dim: int, device: Optional[torch.device]) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (theta**exponents)


def inverse_frequencies(
    config: LlamaConfig, seq_len: Optional[int] = None, device: Optional[torch.device] = None
) -> Tuple[torch.Tensor, float]:
    """The inverse frequencies for ``head_dim`` and the factor cos/sin are multiplied by.

    ``seq_len`` matters only for ``dynamic`` scaling: the sequence length the frequencies serve.
    """
    dim = config.head_dim
    scaling = config.rope_scaling_dict()
    rope_type = config.rope_type
    if rope_type == "default":
        return _base_inv_freq(config.rope_theta, dim, device), 1.0
    if rope_type == "linear":
        return _base_inv_freq(config.rope_theta, dim, device) / float(scaling["factor"]), 1.0
    if rope_type == "dynamic":
        factor = float(scaling["factor"])
        trained = config.max_position_embeddings
        length = max(seq_len or trained, trained)
        theta = config.rope_theta * ((factor * length / trained) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(theta, dim, device), 1.0
    if rope_type == "llama3":
        return _llama3(config, scaling, device), 1.0
    if rope_type == "yarn":
        return _yarn(config, scaling, device)
    raise ValueError("unsupported rope type %r" % rope_type)


def _llama3(config: LlamaConfig, scaling: dict, device: Optional[torch.device]) -> torch.Tensor:
    inv_freq = _base_inv_freq(config.rope_theta, config.head_dim, device)
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(config: LlamaConfig, scaling: dict, device: Optional[torch.device]) -> Tuple[torch.Tensor, float]:
    dim, theta = config.head_dim, config.rope_theta
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    position_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / position_freqs, 1.0 / (factor * position_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables for positions, computed in fp32 and cast to the activations' dtype."""

    def __init__(self, config: LlamaConfig, device: Optional[torch.device] = None) -> None:
        self.config = config
        self.inv_freq, self.attention_factor = inverse_frequencies(config, device=device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [tokens, head_dim] for a 1-D tensor of positions."""
        inv_freq = self.inv_freq
        if self.config.rope_type == "dynamic" and seq_len > self.config.max_position_embeddings:
            inv_freq, _ = inverse_frequencies(self.config, seq_len=seq_len, device=positions.device)
        inv_freq = inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos = emb.cos() * self.attention_factor
        sin = emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [..., tokens, head_dim] by cos/sin of shape [tokens, head_dim]."""
    return x * cos + rotate_half(x) * sin
