"""Loading and saving Hugging Face format checkpoints.

A checkpoint directory holds ``config.json`` and the weights as ``model.safetensors``, or as shards
listed in ``model.safetensors.index.json``; ``pytorch_model*.bin`` is read when no safetensors file
exists (older Vicuna/Llama uploads). Only the tensors a model part needs are read, so a device never
materialises the server's layers.
"""

import glob
import json
import os
from typing import Dict, Iterable, List, Optional

import torch

from .config import ConfigError, LlamaConfig
from .model import ModelPart

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(name: str, config: Optional[LlamaConfig] = None) -> torch.dtype:
    """``float32``/``fp32``, ``float16``/``fp16``, ``bfloat16``/``bf16``, or ``auto`` (the checkpoint's own)."""
    if name == "auto":
        name = config.torch_dtype if config is not None else "float32"
    if name not in DTYPES:
        raise ConfigError("dtype %r is not one of %s or auto" % (name, ", ".join(sorted(DTYPES))))
    return DTYPES[name]


def weight_files(directory: str) -> Dict[str, str]:
    """Tensor name -> file that holds it."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as handle:
            mapping = json.load(handle)["weight_map"]
        return {name: os.path.join(directory, file) for name, file in mapping.items()}
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    out: Dict[str, str] = {}
    if files:
        from safetensors import safe_open

        for path in files:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    out[name] = path
        return out
    for path in sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin"))):
        for name in torch.load(path, map_location="meta", weights_only=True):
            out[name] = path
    if not out:
        raise ConfigError("%s: no model.safetensors, *.safetensors or pytorch_model*.bin" % directory)
    return out


def read_tensors(directory: str, names: Iterable[str]) -> Dict[str, torch.Tensor]:
    """Read the named tensors (and only those) from a checkpoint directory, on the CPU."""
    located = weight_files(directory)
    wanted = sorted(set(names))
    missing = [name for name in wanted if name not in located]
    if missing:
        raise ConfigError("%s: the checkpoint lacks %s" % (directory, ", ".join(missing[:5])))
    by_file: Dict[str, List[str]] = {}
    for name in wanted:
        by_file.setdefault(located[name], []).append(name)
    out: Dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                for name in file_names:
                    out[name] = handle.get_tensor(name)
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            for name in file_names:
                out[name] = loaded[name]
    return out


def load_part(
    directory: str,
    layers: Iterable[int],
    embedding: bool = False,
    head: bool = False,
    dtype: str = "auto",
    device: str = "cpu",
) -> ModelPart:
    """Build a model part from a checkpoint directory, reading only its own tensors."""
    config = LlamaConfig.load(directory)
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        part = ModelPart(config, layers, embedding=embedding, head=head)
    tensors = read_tensors(directory, part.expected_tensor_names())
    state = {name: tensors[part.checkpoint_name(name)].to(dtype=torch_dtype) for name in part.state_dict()}
    part.load_state_dict(state, assign=True)
    if head and embedding and config.tie_word_embeddings:
        part.lm_head.weight = part.embed_tokens.weight
    part.rotary = type(part.rotary)(config)
    return part.to(device).eval()


def load_whole(directory: str, dtype: str = "auto", device: str = "cpu") -> ModelPart:
    config = LlamaConfig.load(directory)
    return load_part(directory, range(config.num_hidden_layers), True, True, dtype, device)


def save_checkpoint(
    part: ModelPart, directory: str, dtype: str = "float32", extra_config: Optional[dict] = None
) -> str:
    """Write ``config.json`` and ``model.safetensors`` the way transformers does; returns the weights path."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    torch_dtype = resolve_dtype(dtype)
    config = part.config.to_hf_dict()
    config["torch_dtype"] = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[
        torch_dtype
    ]
    config.update(extra_config or {})
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)
        handle.write("\n")
    tensors = {name: t.detach().to("cpu", torch_dtype).contiguous() for name, t in part.state_dict_hf().items()}
    path = os.path.join(directory, "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    return path
