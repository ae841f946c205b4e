"""A Llama-family model's hyper-parameters, read from a Hugging Face ``config.json``.

Both spellings of the rotary scaling are accepted: ``rope_scaling`` with ``rope_theta`` beside it
(checkpoints saved by transformers 4.x and the Meta/Vicuna conversions) and ``rope_parameters``
(transformers 5.x).
"""

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ConfigError(ValueError):
    """A config.json this engine cannot run; the message names the file and the field."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[Tuple[Tuple[str, Any], ...]] = None  # sorted (key, value) pairs, hashable
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    torch_dtype: str = "float32"
    extra: Tuple[Tuple[str, Any], ...] = field(default=(), compare=False)

    @property
    def rope_type(self) -> str:
        return str(self.rope_scaling_dict().get("rope_type", "default"))

    def rope_scaling_dict(self) -> Dict[str, Any]:
        return dict(self.rope_scaling or ())

    def to_hf_dict(self) -> Dict[str, Any]:
        """The config.json transformers writes for LlamaForCausalLM (4.x spelling, read by 4.x and 5.x)."""
        out: Dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict() or None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        out.update(dict(self.extra))
        return out

    @classmethod
    def from_hf_dict(cls, raw: Dict[str, Any], source: str = "config.json") -> "LlamaConfig":
        def need(name: str) -> Any:
            if name not in raw or raw[name] is None:
                raise ConfigError("%s: field %r is missing" % (source, name))
            return raw[name]

        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                "%s: field 'model_type' is %r; this engine runs %s"
                % (source, model_type, ", ".join(SUPPORTED_MODEL_TYPES))
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError("%s: field 'hidden_act' is %r; Llama-family SwiGLU needs 'silu'" % (source, act))
        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(
                "%s: field 'num_key_value_heads' (%d) must divide num_attention_heads (%d)" % (source, kv_heads, heads)
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)
        theta, scaling = _rope_fields(raw, source)
        eos = raw.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings") or 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    @classmethod
    def load(cls, directory: str) -> "LlamaConfig":
        path = os.path.join(directory, "config.json")
        try:
            with open(path, encoding="utf-8") as handle:
                raw = json.load(handle)
        except FileNotFoundError:
            raise ConfigError("%s: no such file; a Hugging Face checkpoint directory has one" % path) from None
        except ValueError as error:
            raise ConfigError("%s: not valid JSON (%s)" % (path, error)) from None
        return cls.from_hf_dict(raw, source=path)


def _rope_fields(raw: Dict[str, Any], source: str) -> Tuple[float, Optional[Tuple[Tuple[str, Any], ...]]]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    params.pop("partial_rotary_factor", None)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.pop("type", None)
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            "%s: rope scaling type %r is not supported (supported: %s)" % (source, rope_type, ", ".join(ROPE_TYPES))
        )
    if rope_type == "default":
        return theta, None
    if rope_type in ("linear", "dynamic", "llama3") and "factor" not in params:
        raise ConfigError("%s: rope scaling %r needs field 'factor'" % (source, rope_type))
    if rope_type == "llama3":
        for name in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if name not in params:
                raise ConfigError("%s: rope scaling 'llama3' needs field %r" % (source, name))
    if rope_type == "yarn" and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = int(raw.get("max_position_embeddings") or 2048)
    return theta, tuple(sorted(params.items()))
