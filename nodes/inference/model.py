"""The Llama-family layers and a model part that holds any subset of them.

A ``ModelPart`` is what one process runs: the whole model in single-process generation, or a
partition's share (the device's embedding + first m layers + final norm + LM head; a server stage's
middle layers). Parameter names are those of Hugging Face checkpoints without the ``model.``
prefix, so a part loads exactly the tensors it needs.

Inference batches are packed: the hidden states of all sequences' chunks are concatenated along
the token axis ([tokens, hidden]), every projection runs once on the whole pack, and attention runs
per sequence against that sequence's own ``KVCache`` (sequences of different lengths, prefill
chunks and decode steps mixed in one batch).
"""

from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig
from .kv_cache import KVCache
from .rope import RotaryEmbedding, apply_rotary


def _sdpa_takes_gqa() -> bool:
    """Whether this torch's scaled_dot_product_attention takes ``enable_gqa`` (2.5 and later; a
    Jetson's JetPack torch may be older)."""
    try:
        q, kv = torch.zeros(2, 1, 4), torch.zeros(1, 1, 4)
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


SDPA_GQA = _sdpa_takes_gqa()


class Segment(NamedTuple):
    """One sequence's share of a packed batch: ``tokens`` new positions after ``cache.length``."""

    cache: KVCache
    tokens: int


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back (as transformers does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    """Grouped-query attention: ``num_key_value_heads`` key/value heads shared by query-head groups."""

    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)

    def _shared_kv(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each key/value head repeated for the query heads that share it (grouped-query attention)."""
        groups = self.heads // self.kv_heads
        if groups > 1:
            return k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
        return k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                query_positions: Optional[torch.Tensor] = None) -> torch.Tensor:  # fmt: skip
        """q [..., heads, n, d] against k/v [..., kv_heads, total, d]; query i sits at start + i, or at
        ``query_positions[i]`` (queries scattered among the keys: LLMS's interleaved recompute)."""
        if q.dim() == 3:  # one sequence: as a batch of one, since PyTorch's fused CPU kernel takes only
            # 4-D inputs (3-D ones fell back to the unfused math path, which also copies each
            # key/value head for its query group: 63% of a batch-8 SmolLM2 decode step at 512 tokens)
            return self.attend(q[None], k[None], v[None], start, query_positions)[0]
        extra = {}
        if self.heads != self.kv_heads:
            if SDPA_GQA:  # the kernel reads each key/value head for its group: no repeated copy
                extra["enable_gqa"] = True
            else:
                k, v = self._shared_kv(k, v)
        n, total = q.shape[-2], k.shape[-2]
        if query_positions is None:
            if n == 1:
                return F.scaled_dot_product_attention(q, k, v, **extra)
            if start == 0 and total == n:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, **extra)
            query_positions = torch.arange(start, start + n, device=q.device)
        key_pos = torch.arange(total, device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_pos <= query_positions[:, None], **extra)

    def attend_with_weights(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            start: int) -> Tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``attend`` written out, for a cache that wants the attention weights [heads, n, total] (float32)
        as well: computed once and used for the output too, instead of a second pass beside SDPA."""
        k, v = self._shared_kv(k, v)
        n, total = q.shape[-2], k.shape[-2]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (self.head_dim**-0.5)
        if n > 1 or total != start + 1:
            query_pos = torch.arange(start, start + n, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(total, device=q.device)[None, :] > query_pos, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        return torch.matmul(weights.to(v.dtype), v), weights

    def forward(
        self, x: torch.Tensor, segments: Sequence[Segment], rotations: Sequence[Tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Packed x [tokens, hidden] -> [tokens, hidden]."""
        q = self.q_proj(x).view(-1, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(-1, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        # every segment's positions rotated at once ([heads, tokens, head_dim]): one pass, not one per
        # sequence (at batch 8 the per-sequence rotations were most of a decode step's small operations)
        cos = torch.cat([c for c, _ in rotations]) if len(rotations) > 1 else rotations[0][0]
        sin = torch.cat([s for _, s in rotations]) if len(rotations) > 1 else rotations[0][1]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        outputs: List[torch.Tensor] = []
        offset = 0
        for segment in segments:
            n = segment.tokens
            seg_q = q[:, offset : offset + n]
            seg_k = k[:, offset : offset + n]
            seg_v = v[offset : offset + n].transpose(0, 1)
            all_k, all_v = segment.cache.append(self.layer, seg_k, seg_v)
            observe = getattr(segment.cache, "observe_attention", None)  # LLMS's density (Eq. 1), when asked
            if observe is None:
                out = self.attend(seg_q, all_k, all_v, segment.cache.length)
            else:
                out, weights = self.attend_with_weights(seg_q, all_k, all_v, segment.cache.length)
                observe(self.layer, weights, segment.cache.length)
            outputs.append(out.transpose(0, 1).reshape(n, self.heads * self.head_dim))
            offset += n
        return self.o_proj(torch.cat(outputs) if len(outputs) > 1 else outputs[0])

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training/scoring path without a cache: x [batch, seq, hidden], causal."""
        b, s, _ = x.shape
        q = apply_rotary(self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = apply_rotary(self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        out = self.attend(q, k, v, 0)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, segments: Sequence[Segment], rotations: Sequence) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), segments, rotations)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.forward_full(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class ModelPart(nn.Module):
    """Any subset of a Llama model: optional embedding, a set of layers, optional final norm + LM head."""

    def __init__(
        self,
        config: LlamaConfig,
        layers: Iterable[int],
        embedding: bool = False,
        head: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_ids = tuple(sorted(layers))
        for index in self.layer_ids:
            if not 0 <= index < config.num_hidden_layers:
                raise ValueError("layer %d is outside 0..%d" % (index, config.num_hidden_layers - 1))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if embedding else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in self.layer_ids})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if head else None
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False) if head else None
        if head and embedding and config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)

    @classmethod
    def whole(cls, config: LlamaConfig) -> "ModelPart":
        return cls(config, range(config.num_hidden_layers), embedding=True, head=True)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def new_cache(self, capacity: int = 256) -> KVCache:
        """A cache for one sequence, covering this part's layers."""
        return KVCache(
            self.layer_ids, self.config.num_key_value_heads, self.config.head_dim, self.dtype, self.device, capacity
        )

    def checkpoint_name(self, name: str) -> str:
        """The Hugging Face tensor that holds this part's parameter ``name`` (a tied head reads the embedding)."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return name if name.startswith("lm_head") else "model." + name

    def expected_tensor_names(self) -> List[str]:
        """The checkpoint tensors (Hugging Face names) this part loads."""
        return sorted({self.checkpoint_name(name) for name in self.state_dict()})

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [tokens] -> hidden states [tokens, hidden]."""
        if self.embed_tokens is None:
            raise RuntimeError("this model part holds no embedding")
        return self.embed_tokens(token_ids.to(self.device))

    def run_layers(self, hidden: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """Run this part's layers on a packed batch and commit every segment to its cache.

        ``hidden`` is [sum of segment tokens, hidden]; segment i's positions start at its cache's length.
        """
        if sum(s.tokens for s in segments) != hidden.shape[0]:
            raise ValueError(
                "segments cover %d tokens, hidden has %d" % (sum(s.tokens for s in segments), hidden.shape[0])
            )
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        if not self.layer_ids:
            return hidden
        rotations = []
        for segment in segments:
            start = segment.cache.length
            positions = torch.arange(start, start + segment.tokens, device=self.device)
            rotations.append(self.rotary.cos_sin(positions, self.dtype, start + segment.tokens))
        for index in self.layer_ids:
            hidden = self.layers[str(index)](hidden, segments, rotations)
        for segment in segments:
            segment.cache.advance(segment.tokens)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [..., hidden] -> logits [..., vocab]."""
        if self.lm_head is None or self.norm is None:
            raise RuntimeError("this model part holds no LM head")
        return self.lm_head(self.norm(hidden.to(device=self.device, dtype=self.dtype)))

    def forward_full(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Training/scoring: token ids [batch, seq] -> logits [batch, seq, vocab], no cache."""
        x = self.embed(token_ids)
        positions = torch.arange(token_ids.shape[1], device=self.device)
        cos, sin = self.rotary.cos_sin(positions, self.dtype, token_ids.shape[1])
        for index in self.layer_ids:
            x = self.layers[str(index)].forward_full(x, cos, sin)
        return self.logits(x)

    def state_dict_hf(self) -> Dict[str, torch.Tensor]:
        """This part's tensors under their Hugging Face names (a tied LM head written once)."""
        return {self.checkpoint_name(name): tensor for name, tensor in self.state_dict().items()}


def count_parameters(part: ModelPart) -> int:
    return sum(p.numel() for p in {id(p): p for p in part.parameters()}.values())


__all__ = ["Attention", "DecoderLayer", "ModelPart", "RMSNorm", "Segment", "count_parameters"]
