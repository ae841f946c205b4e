"""A GGUF file (llama.cpp's format) turned into the checkpoint format the engine loads: ``config.json``,
``model.safetensors``, ``tokenizer.json`` and ``tokenizer_config.json`` (Hugging Face's layout).

- Weights are dequantized to float32 (``gguf.quants``: Q8_0, Q4_1, ... as llama.cpp stores them).
- llama.cpp's converter permutes the rows of every layer's query and key projections (its RoPE pairs
  neighbouring dimensions, Hugging Face's pairs the two halves of a head); the permutation is undone,
  with the key/value head count for the keys.
- A file without ``output.weight`` ties the LM head to the token embedding.
- The tokenizer's vocabulary, merges and token types become a byte-level BPE ``tokenizer.json``, split
  before BPE as llama.cpp splits for the file's ``tokenizer.ggml.pre`` (see :data:`PRE_TOKENIZERS`);
  the chat template, BOS/EOS and ``add_bos_token`` go to ``tokenizer_config.json``.

Only the llama architecture with a byte-level BPE vocabulary (``tokenizer.ggml.model: gpt2``) is
taken; anything else is refused with the key that says why. The controller runs this (numpy and the
``gguf`` reader, no torch).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import TestbedError
from testbed.provisioning.weights import file_sha256

CONVERTER_VERSION = 1  # bump when the files written for the same GGUF change

# llama.cpp's name of a tensor -> Hugging Face's; {n} is the layer
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{n}.attn_norm.weight": "model.layers.{n}.input_layernorm.weight",
    "blk.{n}.ffn_norm.weight": "model.layers.{n}.post_attention_layernorm.weight",
    "blk.{n}.attn_q.weight": "model.layers.{n}.self_attn.q_proj.weight",
    "blk.{n}.attn_k.weight": "model.layers.{n}.self_attn.k_proj.weight",
    "blk.{n}.attn_v.weight": "model.layers.{n}.self_attn.v_proj.weight",
    "blk.{n}.attn_output.weight": "model.layers.{n}.self_attn.o_proj.weight",
    "blk.{n}.ffn_gate.weight": "model.layers.{n}.mlp.gate_proj.weight",
    "blk.{n}.ffn_up.weight": "model.layers.{n}.mlp.up_proj.weight",
    "blk.{n}.ffn_down.weight": "model.layers.{n}.mlp.down_proj.weight",
}

# the GPT-2 split, and llama 3's (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
# tokenizer.ggml.pre -> how llama.cpp splits text before BPE: (digits one by one first, the split regex)
PRE_TOKENIZERS = {
    "default": (False, GPT2_SPLIT),
    "gpt-2": (False, GPT2_SPLIT),
    "smollm": (True, GPT2_SPLIT),  # SmolLM's tokenizer.json: Digits(individual) then ByteLevel
    "llama-bpe": (False, LLAMA3_SPLIT),
    "llama3": (False, LLAMA3_SPLIT),
}
CONTROL_TOKEN = 3  # llama.cpp's token type of a special token (<|im_start|>, ...)
USER_DEFINED_TOKEN = 4  # an added token matched whole in text, not special


@dataclass(frozen=True)
class Imported:
    directory: Path
    config: dict[str, Any]
    tensors: int
    parameters: int
    gguf_sha256: str


def _reader(path: Path) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise TestbedError("reading GGUF files needs the gguf package: pip install gguf") from exc
    if not path.is_file():
        raise TestbedError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise TestbedError(f"{path}: not a readable GGUF file ({exc})") from exc


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _required(reader: Any, path: Path, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise TestbedError(f"{path}: GGUF key {key} is missing")
    return value


def _float32(value: Any) -> float:
    """A float the file stores as float32, written as its shortest decimal (1e-05, not 9.99999974e-06)."""
    import numpy as np

    return float(str(np.float32(value)))


def hf_config(reader: Any, path: Path) -> dict[str, Any]:
    """``config.json`` (LlamaForCausalLM) from the file's ``llama.*`` metadata."""
    arch = _required(reader, path, "general.architecture")
    if arch != "llama":
        raise TestbedError(f"{path}: general.architecture is {arch!r}; only llama files are imported")
    for key in ("llama.rope.scaling.type", "llama.expert_count"):
        if _field(reader, key) not in (None, "none", 0):
            raise TestbedError(f"{path}: {key} = {_field(reader, key)!r} is not supported by the importer")
    heads = int(_required(reader, path, "llama.attention.head_count"))
    hidden = int(_required(reader, path, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_required(reader, path, "llama.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, path, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 2048)),
        "rms_norm_eps": _float32(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float32(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def unpermute_rows(weight: Any, heads: int) -> Any:
    """Undo llama.cpp's permutation of a query or key projection's rows (``heads``: the key/value head
    count for keys): within each head it interleaved the two halves, Hugging Face keeps them apart."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(name: str) -> str | None:
    if name.startswith("blk."):
        layer, _, rest = name[4:].partition(".")
        template = TENSOR_NAMES.get("blk.{n}." + rest)
        return template.format(n=int(layer)) if template is not None and layer.isdigit() else None
    return TENSOR_NAMES.get(name)


def hf_tensors(reader: Any, path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """Every tensor, dequantized to float32, under its Hugging Face name, Q/K rows un-permuted."""
    import numpy as np
    from gguf import quants

    expected = {"token_embd.weight", "output_norm.weight"}
    for n in range(config["num_hidden_layers"]):
        expected |= {k.format(n=n) for k in TENSOR_NAMES if k.startswith("blk.")}
    missing = sorted(expected - {t.name for t in reader.tensors})
    if missing:
        raise TestbedError(f"{path}: the file lacks tensor {', '.join(missing[:4])}")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            if tensor.name.startswith("rope_freqs"):
                raise TestbedError(f"{path}: tensor {tensor.name} (rope frequency factors) is not supported")
            raise TestbedError(f"{path}: tensor {tensor.name} has no Hugging Face name the importer knows")
        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise TestbedError(f"{path}: tensor {tensor.name} is {tensor.tensor_type.name}, which the gguf "
                               f"package cannot dequantize") from exc  # fmt: skip
        values = np.ascontiguousarray(values, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        if name.endswith("q_proj.weight"):
            values = unpermute_rows(values, heads)
        elif name.endswith("k_proj.weight"):
            values = unpermute_rows(values, kv_heads)
        out[name] = np.ascontiguousarray(values)
    return out


def tokenizer_files(reader: Any, path: Path) -> tuple[str, dict[str, Any]]:
    """``tokenizer.json`` text and ``tokenizer_config.json`` for the file's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _required(reader, path, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise TestbedError(f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE (gpt2) is imported")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise TestbedError(f"{path}: tokenizer.ggml.pre {pre!r} is not one the importer knows "
                           f"({', '.join(sorted(PRE_TOKENIZERS))})")  # fmt: skip
    tokens: list[str] = list(_required(reader, path, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _required(reader, path, "tokenizer.ggml.merges")]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    digits, split = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]  # fmt: skip
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    typed = list(zip(tokens, types, strict=True))
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in typed if k == CONTROL_TOKEN]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == USER_DEFINED_TOKEN])

    def token(key: str) -> str | None:
        index = _field(reader, key)
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
        "pre_tokenizer_of_gguf": pre,
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        settings["chat_template"] = template
    return tokenizer.to_str(), settings


def import_gguf(path: Path, out: Path, source: dict[str, Any] | None = None,
                progress: Callable[[str], None] | None = None) -> Imported:  # fmt: skip
    """Write ``out`` (replaced whole, atomically: a crash leaves the old directory or none) from the
    GGUF at ``path``; ``source`` (where the file came from) is recorded in ``out/source.json``."""
    from safetensors.numpy import save_file

    say = progress or (lambda _: None)
    path, out = Path(path), Path(out)
    reader = _reader(path)
    config = hf_config(reader, path)
    say("tokenizer")
    tokenizer_json, tokenizer_config = tokenizer_files(reader, path)
    say("dequantizing tensors")
    tensors = hf_tensors(reader, path, config)
    vocab_rows = tensors["model.embed_tokens.weight"].shape[0]
    if vocab_rows != config["vocab_size"]:
        raise TestbedError(f"{path}: llama.vocab_size {config['vocab_size']} but token_embd has {vocab_rows} rows")
    digest = file_sha256(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        say("writing model.safetensors")
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (staging / "tokenizer.json").write_text(tokenizer_json)
        (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        provenance = {"gguf": path.name, "gguf_sha256": digest, "converter_version": CONVERTER_VERSION,
                      "name": _field(reader, "general.name"), "license": _field(reader, "general.license"),
                      "dequantized_from": sorted({t.tensor_type.name for t in reader.tensors}),
                      **(source or {})}  # fmt: skip
        (staging / "source.json").write_text(json.dumps(provenance, indent=2) + "\n")
        for file in staging.iterdir():
            file.chmod(0o644)  # read by the nodes' users, whatever this process's umask
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
        staging.chmod(0o755)
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    parameters = sum(int(t.size) for t in tensors.values())
    return Imported(out, config, len(tensors), parameters, digest)
