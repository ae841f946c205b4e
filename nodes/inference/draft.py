"""HAT's on-device draft model w_S = H_L o Lambda o w_L^m (Sec. 3.4).

The device already holds the LLM's first m layers (w_L^m) and its head H_L (final norm + LM head).
The adapter Lambda has the structure of one decoder layer's self-attention module (pre-norm,
grouped-query attention, residual), and is trained by distillation to stand in for the middle
layers m..n-1 (``scripts/train_draft.py``, Eq. 4). Its keys and values live in a ``KVCache`` of
their own under layer id ``n`` (one past the LLM's last layer), so they never mix with the LLM's.

An adapter is stored beside its checkpoint as ``draft/adapter.safetensors`` with
``draft/adapter_config.json``, which records the m it was trained for.
"""

import json
import os
from typing import Dict, Sequence, Tuple

import torch
from torch import nn

from nodes.contracts.draft import default_adapter_dir

from .config import LlamaConfig
from .kv_cache import KVCache
from .model import Attention, RMSNorm, Segment
from .rope import RotaryEmbedding

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class DraftError(ValueError):
    pass


class DraftAdapter(nn.Module):
    """Lambda: x + Attention(RMSNorm(x)), one self-attention module of the LLM's shape."""

    def __init__(self, config: LlamaConfig, device_layers: int) -> None:
        super().__init__()
        self.config = config
        self.device_layers = device_layers
        self.layer_id = config.num_hidden_layers
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, self.layer_id)
        self.rotary = RotaryEmbedding(config)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def new_cache(self, capacity: int = 256) -> KVCache:
        c = self.config
        return KVCache((self.layer_id,), c.num_key_value_heads, c.head_dim, self.dtype, self.device, capacity)

    def run(self, hidden: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """Packed shallow hidden states [tokens, hidden] -> the draft's deep states; commits each cache."""
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        rotations = []
        for segment in segments:
            start = segment.cache.length
            positions = torch.arange(start, start + segment.tokens, device=self.device)
            rotations.append(self.rotary.cos_sin(positions, self.dtype, start + segment.tokens))
        out = hidden + self.self_attn(self.input_layernorm(hidden), segments, rotations)
        for segment in segments:
            segment.cache.advance(segment.tokens)
        return out

    def forward_full(self, hidden: torch.Tensor) -> torch.Tensor:
        """Training path without a cache: shallow states [batch, seq, hidden] -> [batch, seq, hidden]."""
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype, hidden.shape[1])
        return hidden + self.self_attn.forward_full(self.input_layernorm(hidden), cos, sin)


def adapter_dir(model_dir: str) -> str:
    """Where a checkpoint's draft adapter lives by default (:mod:`nodes.contracts.draft`)."""
    return default_adapter_dir(model_dir)


def save_adapter(adapter: DraftAdapter, directory: str, extra: Dict[str, object]) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in adapter.state_dict().items()}
    save_file(tensors, os.path.join(directory, ADAPTER_FILE), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as handle:
        json.dump({"device_layers": adapter.device_layers, **extra}, handle, indent=2, sort_keys=True)
        handle.write("\n")


def read_adapter_config(directory: str) -> Dict[str, object]:
    path = os.path.join(directory, ADAPTER_CONFIG)
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError) as error:
        raise DraftError("%s: cannot read the draft adapter's config (%s)" % (path, error)) from None


def load_adapter(
    directory: str, config: LlamaConfig, device_layers: int, dtype: torch.dtype, device: str = "cpu"
) -> DraftAdapter:
    """Load the adapter in ``directory``; refuses one trained for another m (its inputs would be wrong)."""
    from safetensors.torch import load_file

    trained_for = int(read_adapter_config(directory).get("device_layers", -1))
    if trained_for != device_layers:
        raise DraftError(
            "%s: the draft adapter was trained on the output of %d device layers, the run keeps %d on the device;"
            " train one with scripts/train_draft.py --device-layers %d"
            % (directory, trained_for, device_layers, device_layers)
        )
    adapter = DraftAdapter(config, device_layers)
    path = os.path.join(directory, ADAPTER_FILE)
    try:
        state = load_file(path)
    except Exception as error:  # missing, or damaged (safetensors raises its own error type)
        raise DraftError("%s: cannot read the draft adapter (%s)" % (path, error)) from None
    missing = sorted(set(adapter.state_dict()) - set(state))
    if missing:
        raise DraftError("%s: the adapter lacks %s" % (path, ", ".join(missing)))
    adapter.load_state_dict({k: v for k, v in state.items() if k in adapter.state_dict()})
    adapter.rotary = RotaryEmbedding(config)
    return adapter.to(device=device, dtype=dtype).eval()


def state_loss(teacher_hidden: torch.Tensor, student_hidden: torch.Tensor, norm=None) -> torch.Tensor:
    """Eq. 4's SmoothL1(f^L, f^S); with ``norm`` (the LLM's final norm) taken on norm(f^L), norm(f^S),
    the states as the head reads them, so that a few large channels do not outweigh the rest."""
    if norm is not None:
        teacher_hidden, student_hidden = norm(teacher_hidden), norm(student_hidden)
    return nn.functional.smooth_l1_loss(student_hidden.float(), teacher_hidden.float())


def distillation_loss(
    teacher_hidden: torch.Tensor, student_hidden: torch.Tensor, head, ce_weight: float = 0.1
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HAT Eq. 4: SmoothL1(f^L, f^S) + w_ce * CE(H_L(f^L), H_L(f^S)).

    ``head`` maps hidden states to logits (the LLM's final norm and LM head). The cross-entropy takes
    the teacher's softmax as the target distribution. Returns (loss, smooth L1 term, CE term).
    """
    smooth_l1 = state_loss(teacher_hidden, student_hidden)
    cross_entropy = soft_cross_entropy(teacher_hidden, student_hidden, head)
    return smooth_l1 + ce_weight * cross_entropy, smooth_l1, cross_entropy


def soft_cross_entropy(teacher_hidden: torch.Tensor, student_hidden: torch.Tensor, head) -> torch.Tensor:
    """Eq. 4's CE(H_L(f^L), H_L(f^S)): the teacher's softmax is the (fixed) target distribution."""
    with torch.no_grad():
        target = torch.softmax(head(teacher_hidden).float(), dim=-1)
    log_student = torch.log_softmax(head(student_hidden).float(), dim=-1)
    return -(target * log_student).sum(-1).mean()
