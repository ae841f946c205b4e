"""Checkpoints of random weights in the shapes of real models (TinyLlama-1.1B, Llama-2-7B, Llama-2-13B)
with the tiny model's tokenizer: what a GPU bench needs where only a model's size matters (its tokens are
really computed and meaningless as text). Used by bench/disco_gpu_premise.py and bench/cocoserve_gpu.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "models" / "tiny"
# Llama shapes with the tiny model's vocabulary (its tokenizer decodes the output).
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, head_dim=64),  # TinyLlama-1.1B's layers
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, head_dim=128),  # Llama-2-7B's layers
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=40, head_dim=128),  # Llama-2-13B's layers (CoCoServe's model)
}  # fmt: skip


def random_checkpoint(shape: str, directory: Path, layers: int | None = None, vocab: int | None = None) -> Path:
    """Random weights of ``shape`` (bf16; ``layers`` and ``vocab`` override its own) beside a copy of
    the tiny model's tokenizer."""
    import torch

    from nodes.inference.checkpoint import save_checkpoint
    from nodes.inference.config import LlamaConfig
    from nodes.inference.model import ModelPart

    tiny = LlamaConfig.load(str(TINY))
    fields = dict(SHAPES[shape], num_hidden_layers=layers or SHAPES[shape]["num_hidden_layers"])
    config = LlamaConfig(vocab_size=vocab or tiny.vocab_size, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=tiny.bos_token_id, eos_token_id=tiny.eos_token_id,
                         torch_dtype="bfloat16", **fields)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = ModelPart.whole(config).to(torch.bfloat16)
    save_checkpoint(model, str(directory), dtype="bfloat16", extra_config={"random_weights": True})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, directory / name)
    del model
    return directory
