"""The compact Llama engine against transformers' LlamaForCausalLM, and its cache and partition logic."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from nodes.inference.checkpoint import load_part, load_whole, save_checkpoint, weight_files  # noqa: E402
from nodes.inference.config import ConfigError, LlamaConfig  # noqa: E402
from nodes.inference.generate import greedy_generate, greedy_generate_batch  # noqa: E402
from nodes.inference.model import ModelPart, Segment  # noqa: E402
from nodes.inference.partition import PartitionError, UShapePartition  # noqa: E402

VOCAB = 300
TOLERANCE = 1e-4

ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
}


def hf_model(tmp_path, rope=None, tied=False, kv_heads=2, bias=False, layers=4, seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        max_position_embeddings=16,
        rope_scaling=rope,
        rope_theta=500.0,
        tie_word_embeddings=tied,
        attention_bias=bias,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    if bias:  # transformers initialises biases to zero; make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("rope", sorted(ROPE_VARIANTS))
@pytest.mark.parametrize(("tied", "kv_heads", "bias"), [(False, 2, False), (True, 8, True)])
def test_prefill_and_incremental_decoding_match_transformers(tmp_path, rope, tied, kv_heads, bias):
    reference = hf_model(tmp_path, ROPE_VARIANTS[rope], tied, kv_heads, bias)
    ours = load_whole(str(tmp_path), dtype="float32")
    prompt = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))  # past 16: scaling matters
    with torch.no_grad():
        out = reference(prompt, use_cache=True)
        cache = ours.new_cache(4)  # small, so that it grows while decoding
        hidden = ours.run_layers(ours.embed(prompt[0]), [Segment(cache, prompt.shape[1])])
        assert torch.max(torch.abs(ours.logits(hidden) - out.logits[0])) < TOLERANCE
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        for _ in range(6):
            out = reference(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            hidden = ours.run_layers(ours.embed(torch.tensor([token])), [Segment(cache, 1)])
            assert torch.max(torch.abs(ours.logits(hidden)[0] - out.logits[0, -1])) < TOLERANCE
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    assert cache.length == 26


def test_greedy_generation_matches_transformers_generate(tmp_path):
    reference = hf_model(tmp_path)
    ours = load_whole(str(tmp_path))
    prompt = [5, 17, 42, 99, 3]
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    assert greedy_generate(ours, prompt, 12) == expected


def test_batched_greedy_generation_gives_each_prompt_its_own_tokens_and_stops_each_at_eos(tmp_path):
    hf_model(tmp_path)
    model = load_whole(str(tmp_path))
    prompts = [[5, 17, 42, 99, 3], [8], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    alone = [greedy_generate(model, p, 12) for p in prompts]
    assert greedy_generate_batch(model, prompts, 12) == alone and len({tuple(a) for a in alone}) == 3
    eos = alone[1][3]  # a token of the second prompt's ends it early (and any other that reaches it)
    stopped = greedy_generate_batch(model, prompts, 12, eos)
    assert stopped == [greedy_generate(model, p, 12, eos) for p in prompts]
    assert stopped[1] == alone[1][: alone[1].index(eos) + 1] and len(stopped[1]) < 12


def test_packed_batch_of_different_lengths_equals_each_sequence_alone(tmp_path):
    hf_model(tmp_path)
    model = load_whole(str(tmp_path))
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator) for n in (3, 11, 6)]
    with torch.no_grad():
        alone = []
        for prompt in prompts:
            cache = model.new_cache()
            first = model.logits(model.run_layers(model.embed(prompt), [Segment(cache, len(prompt))]))
            step = model.logits(model.run_layers(model.embed(torch.tensor([7])), [Segment(cache, 1)]))
            alone.append((first, step))
        caches = [model.new_cache() for _ in prompts]
        packed = model.logits(
            model.run_layers(model.embed(torch.cat(prompts)), [Segment(c, len(p)) for c, p in zip(caches, prompts, strict=True)])
        )
        steps = model.logits(model.run_layers(model.embed(torch.tensor([7, 7, 7])), [Segment(c, 1) for c in caches]))
    offset = 0
    for i, prompt in enumerate(prompts):
        assert torch.allclose(packed[offset : offset + len(prompt)], alone[i][0], atol=1e-5)
        assert torch.allclose(steps[i], alone[i][1][0], atol=1e-5)
        offset += len(prompt)


def test_mixed_batch_of_a_prefill_chunk_and_decode_steps(tmp_path):
    """One iteration of continuous batching: a later prefill chunk of one sequence beside a decode step."""
    hf_model(tmp_path)
    model = load_whole(str(tmp_path))
    prompt = torch.arange(10, 22)
    with torch.no_grad():
        whole_cache = model.new_cache()
        whole = model.logits(model.run_layers(model.embed(prompt), [Segment(whole_cache, 12)]))
        chunked, other = model.new_cache(), model.new_cache()
        model.run_layers(
            model.embed(torch.cat([prompt[:5], torch.tensor([1, 2])])), [Segment(chunked, 5), Segment(other, 2)]
        )
        mixed = model.logits(
            model.run_layers(
                model.embed(torch.cat([prompt[5:], torch.tensor([3])])), [Segment(chunked, 7), Segment(other, 1)]
            )
        )
    assert torch.allclose(mixed[:7], whole[5:], atol=1e-5)
    assert chunked.length == 12 and other.length == 3


def test_truncate_rolls_back_rejected_tokens(tmp_path):
    hf_model(tmp_path)
    model = load_whole(str(tmp_path))
    with torch.no_grad():
        cache = model.new_cache()
        model.run_layers(model.embed(torch.arange(1, 9)), [Segment(cache, 8)])
        clean = model.logits(model.run_layers(model.embed(torch.tensor([50])), [Segment(cache, 1)]))
        cache.truncate(8)
        model.run_layers(model.embed(torch.tensor([60, 61, 62])), [Segment(cache, 3)])  # a rejected draft
        cache.truncate(8)
        again = model.logits(model.run_layers(model.embed(torch.tensor([50])), [Segment(cache, 1)]))
    assert torch.equal(clean, again)
    with pytest.raises(ValueError):
        cache.truncate(20)


def test_u_shape_parts_chained_equal_the_whole_model(tmp_path):
    hf_model(tmp_path, layers=5, tied=True)
    partition = UShapePartition.make(5, device_layers=1, stages=2)
    assert partition.stage_layer_ids() == [(1, 2), (3, 4)]
    whole = load_whole(str(tmp_path))
    device = load_part(str(tmp_path), partition.device_layer_ids(), embedding=True, head=True)
    stages = [load_part(str(tmp_path), ids) for ids in partition.stage_layer_ids()]
    assert {n for n, _ in device.named_parameters() if n.startswith("layers.")} == {
        n for n, _ in device.named_parameters() if n.startswith("layers.0.")
    }
    prompt = torch.arange(3, 15)
    with torch.no_grad():
        expected = whole.logits(whole.run_layers(whole.embed(prompt), [Segment(whole.new_cache(), 12)]))
        hidden = device.run_layers(device.embed(prompt), [Segment(device.new_cache(), 12)])
        for stage in stages:
            hidden = stage.run_layers(hidden, [Segment(stage.new_cache(), 12)])
        got = device.logits(hidden)
    assert torch.allclose(got, expected, atol=1e-5)


def test_partition_rejects_too_few_middle_layers():
    with pytest.raises(PartitionError, match="lower m or P"):
        UShapePartition.make(4, device_layers=2, stages=3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loading_keeps_the_model(tmp_path, dtype):
    hf_model(tmp_path)
    full = load_whole(str(tmp_path), dtype="float32")
    half = load_whole(str(tmp_path), dtype=dtype)
    assert half.dtype == getattr(torch, dtype)
    prompt = torch.arange(2, 12)
    with torch.no_grad():
        a = full.logits(full.run_layers(full.embed(prompt), [Segment(full.new_cache(), 10)]))
        b = half.logits(half.run_layers(half.embed(prompt), [Segment(half.new_cache(), 10)])).float()
    assert torch.max(torch.abs(a - b)) < 0.05
    assert half.new_cache().dtype == getattr(torch, dtype)


def test_saved_checkpoint_loads_in_transformers(tmp_path):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    ours = ModelPart.whole(config)
    save_checkpoint(ours, str(tmp_path))
    reference = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    prompt = torch.arange(1, 9)
    with torch.no_grad():
        got = ours.logits(ours.run_layers(ours.embed(prompt), [Segment(ours.new_cache(), 8)]))
        assert torch.max(torch.abs(reference(prompt[None]).logits[0] - got)) < TOLERANCE
    assert "lm_head.weight" not in weight_files(str(tmp_path))


def test_config_errors_name_the_file_and_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match=r"config.json: field 'num_attention_heads' is missing"):
        LlamaConfig.load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type"):
        LlamaConfig.load(str(tmp_path))
    with pytest.raises(ConfigError, match="no such file"):
        LlamaConfig.load(str(tmp_path / "missing"))


MAPPED_LOADER = """
import sys
from nodes.inference.checkpoint import load_whole
from nodes.workers.run_one import memory_kb
model = load_whole(sys.argv[1])
touched = sum(float(p.float().sum()) for p in model.parameters())  # as inference reads them: every page
print("loaded", flush=True)
sys.stdin.readline()  # measured once every process has loaded (and touched) the weights
with open("/proc/self/smaps") as handle:
    lines = handle.read().splitlines()
rss = pss = 0
inside = False
for line in lines:
    head = line.split()
    if "-" in head[0] and len(head) >= 5:  # a mapping's first line: inside when it maps the weights file
        inside = line.endswith("model.safetensors")
    elif inside and head[0] in ("Rss:", "Pss:"):
        rss, pss = (rss + int(head[1]), pss) if head[0] == "Rss:" else (rss, pss + int(head[1]))
print(rss, pss, memory_kb()["pss_kb"], flush=True)
sys.stdin.readline()
"""


def test_ranks_on_one_host_share_the_weights_pages_of_a_checkpoint(tmp_path):
    """The weights are mapped from model.safetensors, not copied: two processes loading the same
    checkpoint each count half of its resident pages in their proportional set size."""
    import subprocess
    import sys

    from tests.conftest import REPO

    checkpoint = str(REPO / "examples" / "models" / "tiny")
    processes = [subprocess.Popen([sys.executable, "-c", MAPPED_LOADER, checkpoint], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=REPO) for _ in range(2)]  # fmt: skip
    try:
        assert [p.stdout.readline().strip() for p in processes] == ["loaded", "loaded"]
        measured = []
        for process in processes:  # both hold every page of the weights now
            process.stdin.write("\n")
            process.stdin.flush()
            measured.append([int(v) for v in process.stdout.readline().split()])
        weights_kb = sum(p.stat().st_size for p in (REPO / "examples/models/tiny").glob("*.safetensors")) / 1024
        for rss, pss, total_pss in measured:
            assert rss >= 0.9 * weights_kb  # every weight is read, through the mapping
            assert pss <= 0.6 * rss and total_pss > pss  # half of the pages counted to each process
    finally:
        for process in processes:
            process.communicate("\n", timeout=30)
