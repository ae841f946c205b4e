"""The model a campaign emulates (its shape), as opposed to the checkpoint that computes the tokens.

On the emulated testbed the tokens come from the real (tiny) checkpoint, so outputs stay exact; the
target's shape decides how long a step takes (with a compute profile, :mod:`compute_profile`) and how
many bytes cross the data plane (hidden states at the target's width and dtype).

A shape comes from a Hugging Face ``config.json`` (:func:`from_hf_config`) or from the built-in table
of the seed papers' models (:data:`BUILTIN`, from each model's published ``config.json``).
"""

from typing import Any, Dict, NamedTuple

DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "int8": 1.0, "q4f16": 0.5}


class TargetModelError(ValueError):
    pass


class TargetModel(NamedTuple):
    name: str
    family: str  # llama | opt | bloom | qwen2
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int  # intermediate size
    vocab: int
    dtype: str = "float16"  # of the weights and of what crosses the wire
    mlp_matrices: int = 3  # SwiGLU (gate, up, down) = 3; OPT's and BLOOM's fc1/fc2 = 2
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def weight_bytes_per_param(self) -> float:
        return DTYPE_BYTES[self.dtype]

    @property
    def activation_bytes(self) -> float:
        """Bytes of one hidden value on the wire and in the KV cache (fp16 also for 4-bit weights)."""
        return 2.0 if self.dtype in ("q4f16", "int8") else DTYPE_BYTES[self.dtype]

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention: q and o at full width, k and v at the KV heads'
        width; the MLP's matrices; norms and biases left out, under 0.1%)."""
        kv_width = self.kv_heads * self.head_dim
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv_width + self.mlp_matrices * self.hidden * self.ffn

    @property
    def head_params(self) -> int:
        """The LM head (vocab x hidden); read in full for every step that produces logits."""
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        embedding = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.layers * self.layer_params + self.head_params + embedding

    @property
    def hidden_bytes_per_token(self) -> int:
        """One token's hidden state on the wire (8 KiB for Vicuna-7B in fp16)."""
        return int(self.hidden * self.activation_bytes)

    @property
    def kv_bytes_per_token_per_layer(self) -> float:
        """Keys and values of one token in one layer."""
        return 2.0 * self.kv_heads * self.head_dim * self.activation_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """Keys and values of one token over every layer (what a serving engine's KV budget counts)."""
        return self.kv_bytes_per_token_per_layer * self.layers

    def to_json(self) -> Dict[str, Any]:
        return self._asdict()


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int = 32000,
           tied: bool = False) -> TargetModel:  # fmt: skip
    return TargetModel(name, "llama", layers, hidden, heads, kv_heads, ffn, vocab, "float16", 3, tied)


# Shapes from each model's config.json on the Hugging Face hub (num_hidden_layers, hidden_size,
# num_attention_heads, num_key_value_heads, intermediate_size / ffn_dim, vocab_size, tie_word_embeddings).
BUILTIN = {
    m.name: m
    for m in (
        _llama("vicuna-7b", 32, 4096, 32, 32, 11008),  # lmsys/vicuna-7b-v1.3 (LLaMA-7B shape)
        _llama("vicuna-13b", 40, 5120, 40, 40, 13824),  # lmsys/vicuna-13b-v1.3
        _llama("llama-2-7b", 32, 4096, 32, 32, 11008),  # meta-llama/Llama-2-7b-hf
        _llama("llama-2-13b", 40, 5120, 40, 40, 13824),  # meta-llama/Llama-2-13b-hf
        _llama("llama-2-70b", 80, 8192, 64, 8, 28672),  # meta-llama/Llama-2-70b-hf (grouped-query attention)
        TargetModel("opt-6.7b", "opt", 32, 4096, 32, 32, 16384, 50272, "float16", 2, True),  # facebook/opt-6.7b
        TargetModel("opt-13b", "opt", 40, 5120, 40, 40, 20480, 50272, "float16", 2, True),  # facebook/opt-13b
        TargetModel("opt-30b", "opt", 48, 7168, 56, 56, 28672, 50272, "float16", 2, True),  # facebook/opt-30b
        TargetModel("opt-66b", "opt", 64, 9216, 72, 72, 36864, 50272, "float16", 2, True),  # facebook/opt-66b
        TargetModel("bloom-1b1", "bloom", 24, 1536, 16, 16, 6144, 250880, "float16", 2, True),  # bigscience/bloom-1b1
        TargetModel("bloom-560m", "bloom", 24, 1024, 16, 16, 4096, 250880, "float16", 2, True),  # bigscience/bloom-560m
        TargetModel("qwen1.5-0.5b", "qwen2", 24, 1024, 16, 16, 2816, 151936, "float16", 3, True),  # Qwen/Qwen1.5-0.5B
    )
}
ALIASES = {"vicuna-7b-v1.3": "vicuna-7b", "vicuna-7b-v1.5": "vicuna-7b", "vicuna-13b-v1.3": "vicuna-13b",
           "llama2-7b": "llama-2-7b", "llama2-13b": "llama-2-13b", "llama2-70b": "llama-2-70b",
           "bloom-1.1b": "bloom-1b1", "opt-7b": "opt-6.7b"}  # fmt: skip


def builtin(name: str) -> TargetModel:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in BUILTIN:
        raise TargetModelError("no built-in model %r; known: %s" % (name, ", ".join(sorted(BUILTIN))))
    return BUILTIN[key]


# What a config.json's sizes may be: beyond any published model (Llama-3.1-405B: 126 layers, hidden
# 16384, vocab 128256), so that a typo cannot make every byte count and step time absurd.
SIZE_LIMITS = {"layers": 1024, "hidden": 1 << 17, "heads": 4096, "ffn": 1 << 20, "vocab": 1 << 22}


def _size(raw: Dict[str, Any], name: str, key: str, limit: int) -> int:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise TargetModelError("%s: config.json's %s is %r, not a whole number from 1 to %d"
                               % (name, key, value, limit))
    return value


def from_hf_config(raw: Dict[str, Any], name: str, dtype: str = "") -> TargetModel:
    """A shape from a Hugging Face config.json (llama, mistral, qwen2, opt, bloom)."""
    if not isinstance(raw, dict):
        raise TargetModelError("%s: config.json is not a JSON object" % name)
    kind = str(raw.get("model_type", "llama"))
    limits = {"hidden_size": "hidden", "n_embed": "hidden", "d_model": "hidden", "num_attention_heads": "heads",
              "n_head": "heads", "ffn_dim": "ffn", "intermediate_size": "ffn", "num_hidden_layers": "layers",
              "n_layer": "layers", "vocab_size": "vocab", "num_key_value_heads": "heads"}

    def need(*keys: str) -> int:
        for key in keys:
            if raw.get(key) is not None:
                return _size(raw, name, key, SIZE_LIMITS[limits[key]])
        raise TargetModelError("%s: config.json has none of %s" % (name, ", ".join(keys)))

    hidden = need("hidden_size", "n_embed", "d_model")
    heads = need("num_attention_heads", "n_head")
    if kind == "opt":
        ffn, matrices, family = need("ffn_dim"), 2, "opt"
    elif kind == "bloom":
        ffn, matrices, family = 4 * hidden, 2, "bloom"
    elif kind in ("llama", "mistral", "qwen2"):
        ffn, matrices, family = need("intermediate_size"), 3, "qwen2" if kind == "qwen2" else "llama"
    else:
        raise TargetModelError("%s: model_type %r is not one of llama, mistral, qwen2, opt, bloom" % (name, kind))
    chosen = dtype or str(raw.get("torch_dtype") or "float16")
    if chosen not in DTYPE_BYTES:
        raise TargetModelError("%s: dtype %r is not one of %s" % (name, chosen, ", ".join(DTYPE_BYTES)))
    return TargetModel(
        name=name, family=family, layers=need("num_hidden_layers", "n_layer"), hidden=hidden, heads=heads,
        kv_heads=need("num_key_value_heads") if raw.get("num_key_value_heads") else heads, ffn=ffn,
        vocab=need("vocab_size"), dtype=chosen,
        mlp_matrices=matrices, tied_embeddings=bool(raw.get("tie_word_embeddings", family in ("opt", "bloom"))),
    )  # fmt: skip


def from_json(raw: Dict[str, Any]) -> TargetModel:
    """The inverse of :meth:`TargetModel.to_json` (as a run config carries it)."""
    try:
        model = TargetModel(**raw)
    except TypeError as error:
        raise TargetModelError("target model: %s" % error) from None
    if model.dtype not in DTYPE_BYTES:
        raise TargetModelError("target model %s: dtype %r is not one of %s" % (model.name, model.dtype,
                                                                                ", ".join(DTYPE_BYTES)))
    return model
