"""Loading and saving Hugging Face format checkpoints.

A checkpoint directory holds ``config.json`` and the weights as ``model.safetensors``, or as shards
listed in ``model.safetensors.index.json``; ``pytorch_model*.bin`` is read when no safetensors file
exists (older Vicuna/Llama uploads). Only the tensors a model part needs are read, so a device never
materialises the server's layers.

A safetensors file is memory-mapped, not read: each tensor is a view of the file's pages (copy on
write, which inference never does), so the ranks on one host that load the same layers share one copy
of them in the page cache, and a rank's proportional set size counts its share only.
"""

import glob
import json
import mmap
import os
import struct
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


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own bound on its JSON header


def mapped_tensors(path: str, names: Iterable[str]) -> Dict[str, torch.Tensor]:
    """The named tensors of a safetensors file as views of its pages, mapped copy-on-write (a tensor
    written in place gets private pages; one only read shares the page cache with every process
    that maps the same file). The format: an 8-byte little-endian header length, a JSON header of
    ``{name: {dtype, shape, data_offsets}}``, then the data."""
    with open(path, "rb") as handle:
        (header_bytes,) = struct.unpack("<Q", handle.read(8))
        if header_bytes > MAX_HEADER_BYTES:
            raise ConfigError("%s: a safetensors header of %d bytes" % (path, header_bytes))
        header = json.loads(handle.read(header_bytes))
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + header_bytes
    out: Dict[str, torch.Tensor] = {}
    for name in names:
        entry = header[name]
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            message = "%s: tensor %s has dtype %s, which the engine does not load" % (path, name, entry["dtype"])
            raise ConfigError(message)
        begin, end = entry["data_offsets"]
        shape = [int(d) for d in entry["shape"]]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        out[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + begin).reshape(shape)
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
            out.update(mapped_tensors(path, file_names))
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
