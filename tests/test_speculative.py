"""HAT's speculative decoding and parallel drafting on the device (Sec. 3.4-3.5), its draft adapter,
the branch caches they draft in, the chunk and draft sizing of Eq. 3 and Eq. 6, and the new run
config, state and wire pieces.

The main property: whatever the adapter drafts, ``speculative_generate`` emits exactly the tokens of
greedy generation on the whole model. It is checked on the real tiny checkpoint with an untrained
adapter (any adapter must do), and with the trained one when ``examples/models/tiny/draft`` has it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

from nodes.contracts import run_config
from nodes.contracts.run_config import DraftSettings, RunConfigError
from nodes.inference.checkpoint import load_part, load_whole
from nodes.inference.config import LlamaConfig
from nodes.inference.draft import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    DraftAdapter,
    DraftError,
    adapter_dir,
    distillation_loss,
    load_adapter,
    save_adapter,
    state_loss,
)
from nodes.inference.generate import greedy_generate
from nodes.inference.kv_cache import BranchCache, KVCache
from nodes.inference.model import ModelPart, RMSNorm, Segment
from nodes.inference.rope import apply_rotary
from nodes.inference.speculative import (
    LocalVerifier,
    RoundLog,
    SpeculativeDevice,
    acceptance_length,
    speculative_generate,
    speculative_rounds,
)
from nodes.inference.tokenizer import Tokenizer
from nodes.workers import wire
from nodes.workers.split.hat_sizing import (
    MIN_MEASURED_BYTES,
    LinkEstimator,
    MovingAverage,
    chunk_tokens_eq3,
    parallel_steps_eq6,
)
from nodes.workers.split.state_monitor import ServerState, StateMonitor

REPO = Path(__file__).resolve().parent.parent
TINY = str(REPO / "examples" / "models" / "tiny")
DEVICE_LAYERS = 2  # m: the device runs layers 0..1, the server 2..7
PROMPTS = (
    "def main(argv=None):\n    ",
    "import os\nimport sys\n\n",
    "class Foo(object):\n    def __init__(self",
    "    for i in range(len(items)):\n        if ",
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster than two and keeps timings steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Models(NamedTuple):
    device: ModelPart  # embedding + layers 0..m-1 + final norm and LM head
    middle: ModelPart  # layers m..n-1
    whole: ModelPart
    config: LlamaConfig


@pytest.fixture(scope="module")
def models() -> Models:
    device = load_part(TINY, range(DEVICE_LAYERS), True, True, "float32")
    middle = load_part(TINY, range(DEVICE_LAYERS, 8), False, False, "float32")
    whole = load_whole(TINY, "float32")
    assert whole.config.num_hidden_layers == 8 and middle.layer_ids == tuple(range(2, 8))
    return Models(device, middle, whole, whole.config)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = Tokenizer(TINY)
    return [tokenizer.encode(text) for text in PROMPTS]


def untrained_adapter(config: LlamaConfig, seed: int = 0, std: float | None = 0.02) -> DraftAdapter:
    """An adapter nobody trained: small normal weights (close to the identity, i.e. an early exit after
    layer m), or with ``std=None`` the default initialisation (a large random perturbation)."""
    torch.manual_seed(seed)
    adapter = DraftAdapter(config, DEVICE_LAYERS)
    if std is not None:
        with torch.no_grad():
            for name, parameter in adapter.named_parameters():
                if not name.endswith("layernorm.weight"):
                    parameter.normal_(0.0, std)
    return adapter.eval()


@pytest.fixture(scope="module")
def adapter(models) -> DraftAdapter:
    return untrained_adapter(models.config)


@pytest.fixture(scope="module")
def greedy(models):
    """greedy_generate on the whole model, memoised (the reference every run is compared with)."""
    memo: dict = {}

    def reference(prompt: list[int], max_new_tokens: int, eos_id: int | None = None) -> list[int]:
        key = (tuple(prompt), max_new_tokens, eos_id)
        if key not in memo:
            memo[key] = greedy_generate(models.whole, prompt, max_new_tokens, eos_id)
        return memo[key]

    return reference


def no_steps(drafted: int) -> int:
    return 0


def generate(
    models: Models,
    adapter: DraftAdapter,
    prompt: list[int],
    max_new_tokens: int,
    eta: float = 0.6,
    max_draft: int = 8,
    top_k: int = 0,
    steps: Callable[[int], int] = no_steps,
    eos_id: int | None = None,
) -> tuple[list[int], list[RoundLog]]:
    device = SpeculativeDevice(models.device, adapter, eta)
    verifier = LocalVerifier(models.middle, 8)  # small: it grows while verifying
    return speculative_generate(device, verifier, prompt, max_new_tokens, eos_id, max_draft, top_k, steps)


class Round(NamedTuple):
    draft: object
    verdict: object
    branches: list
    limit: int  # the draft limit speculative_rounds had for this round
    shallow_length: int  # the device's caches right after ``accept``
    adapter_length: int
    unabsorbed: int
    verifier_length: int


def run_rounds(
    models: Models,
    adapter: DraftAdapter,
    prompt: list[int],
    max_new_tokens: int,
    eta: float = 0.6,
    max_draft: int = 8,
    top_k: int = 0,
    steps: Callable[[int], int] = no_steps,
    eos_id: int | None = None,
    check_caches: bool = False,
) -> tuple[list[int], list[Round]]:
    """speculative_generate unrolled: the prefill as it does it, then every round of speculative_rounds
    with the device's cache lengths seen right after ``accept`` (before a parallel draft is adopted).
    With ``check_caches``, every round also compares the device's caches with a fresh prefill."""
    device = SpeculativeDevice(models.device, adapter, eta)
    verifier = LocalVerifier(models.middle, 8)
    state = device.new_state(4)
    with torch.inference_mode():
        verifier.submit(device.shallow(state, prompt), 0)
        device.absorb(state)
        out = [int(device.next_token(verifier.result()[-1:])[0])]
    rounds: list[Round] = []
    for draft, verdict, branches in speculative_rounds(
        device, verifier, state, out[0], max_new_tokens, eos_id, max_draft, top_k, steps
    ):
        limit = min(max_draft, max_new_tokens - len(out) - 1)
        out.extend(verdict.emitted)
        unabsorbed = sum(int(u.shape[0]) for u in state.unabsorbed)
        rounds.append(
            Round(draft, verdict, branches, limit, state.shallow_cache.length, state.adapter_cache.length, unabsorbed,
                  verifier.cache.length)
        )  # fmt: skip
        if check_caches:
            assert_caches_hold(models, adapter, state, prompt + out)
    return out, rounds


def assert_caches_hold(models: Models, adapter: DraftAdapter, state, sequence: list[int]) -> None:
    """The device's layer caches and the adapter's cache hold exactly what a fresh prefill of the
    sequence's first positions computes: rollback left nothing of rejected drafts behind."""
    length = state.shallow_cache.length
    with torch.inference_mode():
        reference = models.device.new_cache(length)
        shallow = models.device.run_layers(
            models.device.embed(torch.tensor(sequence[:length])), [Segment(reference, length)]
        )
        for layer in models.device.layer_ids:
            for got, want in zip(state.shallow_cache.view(layer, length), reference.view(layer, length), strict=True):
                assert torch.allclose(got, want, atol=1e-4), f"layer {layer}'s cache differs from a prefill"
        absorbed = state.adapter_cache.length
        if absorbed:
            adapter_reference = adapter.new_cache(absorbed)
            adapter.run(shallow[:absorbed], [Segment(adapter_reference, absorbed)])
            for got, want in zip(
                state.adapter_cache.view(adapter.layer_id, absorbed),
                adapter_reference.view(adapter.layer_id, absorbed),
                strict=True,
            ):
                assert torch.allclose(got, want, atol=1e-4), "the adapter's cache differs from a prefill"


# --------------------------------------------------------------------------------------------
# the draft adapter (Lambda)


def test_adapter_is_x_plus_attention_of_rmsnorm_x_computed_by_hand(models):
    adapter = untrained_adapter(models.config, seed=3, std=0.05)
    config = models.config
    with torch.no_grad():
        adapter.input_layernorm.weight.uniform_(0.5, 1.5)  # a norm weight that is not all ones
    x = torch.randn(1, 5, config.hidden_size, generator=torch.Generator().manual_seed(4))
    attn = adapter.self_attn
    with torch.no_grad():
        normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * adapter.input_layernorm.weight
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        q = (normed @ attn.q_proj.weight.T).view(5, heads, dim).transpose(0, 1)
        k = (normed @ attn.k_proj.weight.T).view(5, kv_heads, dim).transpose(0, 1)
        v = (normed @ attn.v_proj.weight.T).view(5, kv_heads, dim).transpose(0, 1)
        cos, sin = adapter.rotary.cos_sin(torch.arange(5), torch.float32, 5)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        k = k.repeat_interleave(heads // kv_heads, dim=0)  # query head h reads kv head h // group
        v = v.repeat_interleave(heads // kv_heads, dim=0)
        scores = q @ k.transpose(1, 2) / math.sqrt(dim)
        scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        mixed = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(5, heads * dim)
        expected = x + mixed @ attn.o_proj.weight.T
        full = adapter.forward_full(x)
        cache = adapter.new_cache(2)
        prefill = adapter.run(x[0, :3], [Segment(cache, 3)])
        step_4 = adapter.run(x[0, 3:4], [Segment(cache, 1)])
        step_5 = adapter.run(x[0, 4:5], [Segment(cache, 1)])
    assert torch.allclose(full, expected, atol=1e-5)
    assert torch.allclose(torch.cat([prefill, step_4, step_5]), expected[0], atol=1e-5)
    assert cache.length == 5


def test_adapter_keeps_its_keys_under_a_layer_id_past_the_llm_and_packs_sequences(models, adapter):
    config = models.config
    assert adapter.layer_id == config.num_hidden_layers  # never one of the LLM's layer ids
    cache = adapter.new_cache()
    assert cache.layers == (config.num_hidden_layers,) and not set(cache.layers) & set(models.whole.layer_ids)
    generator = torch.Generator().manual_seed(5)
    first, second = (
        torch.randn(4, config.hidden_size, generator=generator),
        torch.randn(2, config.hidden_size, generator=generator),
    )
    with torch.no_grad():
        alone = [
            adapter.run(first, [Segment(adapter.new_cache(), 4)]),
            adapter.run(second, [Segment(adapter.new_cache(), 2)]),
        ]
        caches = [adapter.new_cache(), adapter.new_cache()]
        packed = adapter.run(torch.cat([first, second]), [Segment(caches[0], 4), Segment(caches[1], 2)])
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)
    assert [c.length for c in caches] == [4, 2]


def test_save_and_load_round_trip(tmp_path, models):
    adapter = untrained_adapter(models.config, seed=7, std=0.1)
    save_adapter(adapter, str(tmp_path), {"eta": 0.6, "steps": 3})
    written = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert written == {"device_layers": DEVICE_LAYERS, "eta": 0.6, "steps": 3}
    loaded = load_adapter(str(tmp_path), models.config, DEVICE_LAYERS, torch.float32)
    assert not loaded.training and loaded.device_layers == DEVICE_LAYERS
    assert loaded.state_dict().keys() == adapter.state_dict().keys()
    for name, tensor in adapter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    x = torch.randn(1, 6, models.config.hidden_size, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert torch.equal(loaded.forward_full(x), adapter.forward_full(x))
    half = load_adapter(str(tmp_path), models.config, DEVICE_LAYERS, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.new_cache().dtype == torch.bfloat16


def test_load_refuses_an_adapter_trained_for_another_device_layers(tmp_path, models):
    save_adapter(untrained_adapter(models.config), str(tmp_path), {})
    with pytest.raises(DraftError, match=r"trained on the output of 2 device layers.*keeps 3.*--device-layers 3"):
        load_adapter(str(tmp_path), models.config, 3, torch.float32)


def test_missing_adapter_files_are_draft_errors(tmp_path, models):
    with pytest.raises(DraftError, match=re.escape(str(tmp_path / "nowhere" / ADAPTER_CONFIG))):
        load_adapter(str(tmp_path / "nowhere"), models.config, DEVICE_LAYERS, torch.float32)
    save_adapter(untrained_adapter(models.config), str(tmp_path), {})
    (tmp_path / ADAPTER_FILE).unlink()
    with pytest.raises(DraftError, match=re.escape(str(tmp_path / ADAPTER_FILE)) + ": cannot read the draft adapter"):
        load_adapter(str(tmp_path), models.config, DEVICE_LAYERS, torch.float32)


def test_an_adapter_file_that_lacks_a_tensor_is_refused(tmp_path, models):
    from safetensors.torch import load_file, save_file

    save_adapter(untrained_adapter(models.config), str(tmp_path), {})
    tensors = load_file(str(tmp_path / ADAPTER_FILE))
    del tensors["self_attn.o_proj.weight"]
    save_file(tensors, str(tmp_path / ADAPTER_FILE))
    with pytest.raises(DraftError, match=r"lacks self_attn\.o_proj\.weight"):
        load_adapter(str(tmp_path), models.config, DEVICE_LAYERS, torch.float32)


def test_a_damaged_adapter_file_is_a_draft_error(tmp_path, models):
    save_adapter(untrained_adapter(models.config), str(tmp_path), {})
    (tmp_path / ADAPTER_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(DraftError, match="cannot read the draft adapter"):
        load_adapter(str(tmp_path), models.config, DEVICE_LAYERS, torch.float32)


def small_head(vocab: int = 11, hidden: int = 8):
    torch.manual_seed(9)
    linear = torch.nn.Linear(hidden, vocab, bias=False)
    return lambda h: linear(h * 2.0), linear


def test_distillation_loss_is_smooth_l1_plus_weighted_soft_cross_entropy():
    head, _ = small_head()
    generator = torch.Generator().manual_seed(10)
    teacher = torch.randn(2, 3, 8, generator=generator) * 2
    student = torch.randn(2, 3, 8, generator=generator) * 2  # differences both below and above 1 (SL1's two arms)
    diff = (student - teacher).abs()
    assert (diff < 1).any() and (diff > 1).any()
    for weight in (0.1, 0.5):
        loss, smooth_l1, cross_entropy = distillation_loss(teacher, student, head, weight)
        with torch.no_grad():
            by_hand_l1 = torch.where(diff < 1, 0.5 * diff**2, diff - 0.5).mean()
            target = torch.softmax(head(teacher), dim=-1).reshape(-1, 11)
            by_hand_ce = F.cross_entropy(head(student).reshape(-1, 11), target)  # soft targets: probabilities
        assert torch.allclose(smooth_l1, by_hand_l1, atol=1e-6)
        assert torch.allclose(smooth_l1, F.smooth_l1_loss(student, teacher), atol=1e-6)
        assert torch.allclose(cross_entropy, by_hand_ce, atol=1e-5)
        assert torch.allclose(loss, by_hand_l1 + weight * by_hand_ce, atol=1e-5)


def test_distillation_loss_of_a_perfect_student_is_the_teachers_entropy():
    head, _ = small_head()
    teacher = torch.randn(4, 8, generator=torch.Generator().manual_seed(11))
    loss, smooth_l1, cross_entropy = distillation_loss(teacher, teacher.clone(), head, 0.1)
    with torch.no_grad():
        p = torch.softmax(head(teacher), dim=-1)
        entropy = -(p * torch.log(p)).sum(-1).mean()
    assert float(smooth_l1) == 0.0
    assert torch.allclose(cross_entropy, entropy, atol=1e-5)
    assert torch.allclose(loss, 0.1 * entropy, atol=1e-6)


def test_state_loss_after_the_final_norm_ignores_a_states_scale():
    """The normed SmoothL1 (a pretrained model's default) compares states as the head reads them: a
    student off by a scale the norm removes costs nothing there, and a lot in the raw term."""
    norm = RMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    teacher = torch.randn(5, 8, generator=torch.Generator().manual_seed(13)) * 50
    other = torch.randn(5, 8, generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        assert float(state_loss(teacher, teacher * 3, norm)) < 1e-6
        assert float(state_loss(teacher, teacher * 3)) > 10
        assert float(state_loss(teacher, other, norm)) > 0.1  # a different direction still costs


def test_distillation_cross_entropy_trains_the_student_not_the_teacher():
    head, _ = small_head()
    generator = torch.Generator().manual_seed(12)
    teacher = torch.randn(3, 8, generator=generator).requires_grad_()
    student = torch.randn(3, 8, generator=generator).requires_grad_()
    _, _, cross_entropy = distillation_loss(teacher, student, head)
    cross_entropy.backward()
    assert teacher.grad is None  # the teacher's softmax is a fixed target
    assert student.grad is not None and student.grad.abs().sum() > 0


# --------------------------------------------------------------------------------------------
# KVCache.view and BranchCache


def chunk(n: int, start: float, heads: int = 2, dim: int = 3) -> torch.Tensor:
    """[heads, n, dim] whose position i holds start + i everywhere (easy to read back)."""
    return (start + torch.arange(n, dtype=torch.float32))[None, :, None].expand(heads, n, dim).clone()


def filled(layers=(0, 1), positions: int = 5, capacity: int = 4) -> KVCache:
    """A cache whose position p holds keys p (layer 0) / 100 + p (layer 1) and values minus that."""
    cache = KVCache(layers, 2, 3, capacity=capacity)
    for layer in layers:
        cache.append(layer, chunk(positions, 100 * layer), -chunk(positions, 100 * layer))
    cache.advance(positions)
    return cache


def positions_of(tensor: torch.Tensor) -> list[float]:
    return tensor[0, :, 0].tolist()


def test_view_is_a_window_on_the_cache_without_a_copy():
    cache = filled(positions=5)
    keys, values = cache.view(1, 3)
    assert positions_of(keys) == [100, 101, 102] and positions_of(values) == [-100, -101, -102]
    cache.truncate(1)
    cache.append(1, chunk(1, 7), chunk(1, 7))
    assert positions_of(keys) == [100, 7, 102]  # the view sees later writes: it shares the storage
    with pytest.raises(ValueError, match="holds 1 positions, not 2"):
        cache.view(1, 2)


def test_a_branch_of_an_empty_cache_reads_nothing_from_it():
    base = KVCache((0,), 2, 3)
    keys, _ = base.view(0, 0)
    assert keys.shape == (2, 0, 3)
    branch = BranchCache(base, 0)
    all_keys, _ = branch.append(0, chunk(2, 5), chunk(2, 5))
    assert positions_of(all_keys) == [5, 6]


def test_a_branch_reads_the_base_prefix_and_keeps_its_own_positions():
    base = filled(positions=5)
    branch = BranchCache(base, 3, capacity=1)
    assert branch.length == 3 and branch.layers == (0, 1)
    for layer in (0, 1):
        keys, values = branch.append(layer, chunk(2, 50 + 100 * layer), -chunk(2, 50 + 100 * layer))
        assert positions_of(keys) == [100 * layer + p for p in (0, 1, 2)] + [100 * layer + 50, 100 * layer + 51]
        assert positions_of(values) == [-v for v in positions_of(keys)]
    branch.advance(2)
    assert branch.length == 5
    keys, _ = branch.append(0, chunk(1, 52), chunk(1, 52))  # grows past its capacity
    assert positions_of(keys) == [0, 1, 2, 50, 51, 52]
    assert base.length == 5 and positions_of(base.view(0, 5)[0]) == [0, 1, 2, 3, 4]  # the base is untouched


def test_two_branches_of_one_base_do_not_see_each_other():
    base = filled(layers=(0,), positions=4)
    left, right = BranchCache(base, 4), BranchCache(base, 4)
    left.append(0, chunk(1, 10), chunk(1, 10))
    left.advance(1)
    keys, _ = right.append(0, chunk(1, 20), chunk(1, 20))
    right.advance(1)
    assert positions_of(keys) == [0, 1, 2, 3, 20]
    keys, _ = left.append(0, chunk(1, 11), chunk(1, 11))
    assert positions_of(keys) == [0, 1, 2, 3, 10, 11]
    assert base.length == 4


def test_commit_makes_the_branch_positions_the_bases_and_drops_what_followed():
    base = filled(positions=6, capacity=6)  # positions 4 and 5 are a rejected continuation
    branch = BranchCache(base, 4)
    for layer in (0, 1):
        branch.append(layer, chunk(4, 40 + 100 * layer), -chunk(4, 40 + 100 * layer))
    branch.advance(4)
    with pytest.raises(ValueError, match="holds 4 positions, not 5"):
        branch.commit(5)
    assert base.length == 6  # a refused commit leaves the base alone
    branch.commit(3)  # 4 + 3 = 7 > the base's capacity: it grows
    assert base.length == 7
    for layer in (0, 1):
        keys, values = base.view(layer, 7)
        expected = [100 * layer + p for p in (0, 1, 2, 3)] + [100 * layer + 40 + i for i in range(3)]
        assert positions_of(keys) == expected and positions_of(values) == [-v for v in expected]


def test_commit_of_nothing_rolls_the_base_back_to_the_branch_point():
    base = filled(positions=6)
    BranchCache(base, 2).commit(0)
    assert base.length == 2 and positions_of(base.view(1, 2)[0]) == [100, 101]


def test_branch_truncate_and_bad_branch_points():
    base = filled(positions=3)
    with pytest.raises(ValueError, match="a branch at 4 of a cache of 3 positions"):
        BranchCache(base, 4)
    branch = BranchCache(base, 3)
    for layer in (0, 1):
        branch.append(layer, chunk(3, 30), chunk(3, 30))
    branch.advance(3)
    branch.truncate(4)  # lengths count from the sequence's start
    assert branch.length == 4 and branch.own.length == 1
    with pytest.raises(ValueError):
        branch.truncate(2)  # cannot cut into the base's share
    keys, _ = branch.append(0, chunk(1, 99), chunk(1, 99))
    assert positions_of(keys) == [0, 1, 2, 30, 99]


def test_attention_through_branches_equals_attention_through_a_copied_cache(models):
    part = models.device
    prefix, rejected = torch.tensor([5, 80, 17, 300, 41, 9]), torch.tensor([1000, 2000])
    continuations = [torch.tensor([11, 12, 13, 14]), torch.tensor([21, 22, 23, 24])]
    with torch.inference_mode():
        base = part.new_cache(4)
        part.run_layers(part.embed(prefix), [Segment(base, 6)])
        part.run_layers(part.embed(rejected), [Segment(base, 2)])  # what the branches must not see
        expected = []
        for tokens in continuations:  # the reference: a full cache of the prefix alone
            full = part.new_cache(4)
            part.run_layers(part.embed(prefix), [Segment(full, 6)])
            first = part.run_layers(part.embed(tokens[:1]), [Segment(full, 1)])
            second = part.run_layers(part.embed(tokens[1:2]), [Segment(full, 1)])
            rest = part.run_layers(part.embed(tokens[2:]), [Segment(full, 2)])  # a chunk: the masked path
            expected.append(torch.cat([first, second, rest]))
        branches = [BranchCache(base, 6, capacity=1), BranchCache(base, 6, capacity=1)]
        steps = []
        for i in range(2):  # both branches packed in one batch, a token each, as parallel drafting runs them
            ids = torch.stack([tokens[i] for tokens in continuations])
            steps.append(part.run_layers(part.embed(ids), [Segment(b, 1) for b in branches]))
        rest = part.run_layers(
            part.embed(torch.cat([tokens[2:] for tokens in continuations])), [Segment(b, 2) for b in branches]
        )
    for j in range(2):
        got = torch.stack([steps[0][j], steps[1][j], rest[2 * j], rest[2 * j + 1]])
        assert torch.allclose(got, expected[j], atol=1e-5)
    assert [b.length for b in branches] == [10, 10] and base.length == 8


# --------------------------------------------------------------------------------------------
# speculative decoding: output equals greedy generation

ETAS = (0.0, 0.6, 1.0)
MAX_DRAFTS = (0, 1, 8)
PARALLEL = {"serial": (0, no_steps), "top3x3": (3, lambda drafted: 3)}


def check_drafts_follow_eq5(rounds: list[Round], eta: float) -> None:
    """Eq. 5 and the limit: a draft stops after its first token below eta, or at the limit."""
    for r in rounds:
        tokens, probs = r.draft.tokens, r.draft.probs
        assert len(tokens) == len(probs) <= r.limit
        assert all(0.0 < p <= 1.0 for p in probs)
        assert all(p >= eta for p in probs[:-1])
        assert len(tokens) == r.limit or (probs and probs[-1] < eta)
        if eta == 0.0:
            assert len(tokens) == r.limit  # no probability is below 0
        if eta == 1.0 and r.limit and probs[0] < 1.0:
            assert len(tokens) == 1


def check_round_accounting(out: list[int], rounds: list[Round], prompt_length: int, eos_id=None) -> None:
    """Each round emits its accepted drafts and one LLM token (the last round may be cut at EOS), and
    leaves the device's caches at x + the accepted drafts, the adapter's never ahead of them."""
    produced = 1
    for i, r in enumerate(rounds):
        draft, verdict = r.draft, r.verdict
        assert draft.start == prompt_length + produced - 1  # x, the last emitted token, sits here
        assert 0 <= verdict.accepted <= len(draft.tokens)
        assert verdict.emitted[: verdict.accepted] == draft.tokens[: verdict.accepted][: len(verdict.emitted)]
        if i < len(rounds) - 1 or eos_id is None or eos_id not in verdict.emitted:
            assert len(verdict.emitted) == verdict.accepted + 1
        else:
            assert len(verdict.emitted) <= verdict.accepted + 1 and verdict.emitted[-1] == eos_id
        assert out[produced : produced + len(verdict.emitted)] == verdict.emitted
        produced += len(verdict.emitted)
        assert r.shallow_length == draft.start + verdict.accepted + 1  # rollback
        assert r.adapter_length <= r.shallow_length
        assert r.adapter_length + r.unabsorbed == r.shallow_length  # nothing lost, nothing twice
        assert r.verifier_length == draft.start + len(draft.tokens) + 1
        assert draft.shallow.shape[0] == len(draft.tokens) + 1
    assert produced == len(out)


def test_tiny_budgets_equal_greedy(models, adapter, prompts, greedy):
    """1 token: the prefill's alone, no round; 2: one round with no room to draft; 4: a short draft."""
    for prompt in prompts:
        for budget in (1, 2, 4):
            for eta, top_k in ((0.6, 0), (0.0, 3)):
                out, rounds = generate(models, adapter, prompt, budget, eta, 8, top_k, lambda drafted: 3)
                assert out == greedy(prompt, budget), (prompt, budget, eta, top_k)
                if budget == 1:
                    assert rounds == []
                assert all(r.drafted <= budget - 2 for r in rounds)
                if eta == 0.0 and budget > 1:
                    assert rounds[0].drafted == budget - 2  # room for the draft and one LLM token


@pytest.mark.parametrize("parallel", sorted(PARALLEL))
@pytest.mark.parametrize("max_draft", MAX_DRAFTS)
@pytest.mark.parametrize("eta", ETAS)
def test_speculative_output_equals_greedy(models, adapter, prompts, greedy, eta, max_draft, parallel):
    top_k, steps = PARALLEL[parallel]
    # a long run, on a prompt that changes with the case, so that every prompt is covered
    case = ETAS.index(eta) * 6 + MAX_DRAFTS.index(max_draft) * 2 + sorted(PARALLEL).index(parallel)
    prompt = prompts[case % len(prompts)]
    out, rounds = generate(models, adapter, prompt, 40, eta, max_draft, top_k, steps)
    assert out == greedy(prompt, 40)
    short = prompts[(case + 1) % len(prompts)]
    assert generate(models, adapter, short, 3, eta, max_draft, top_k, steps)[0] == greedy(short, 3)
    assert len(out) == 1 + sum(r.accepted + 1 for r in rounds)
    assert all(r.accepted <= r.drafted <= max_draft for r in rounds)
    assert acceptance_length(rounds) == pytest.approx(1 + sum(r.accepted for r in rounds) / len(rounds))
    if top_k:
        assert all(r.branch_steps == (3 if r.drafted else 0) for r in rounds)  # no candidates without a draft
    else:
        assert all(r.branch_steps == 0 and not r.reused for r in rounds)
    if max_draft == 0:
        assert len(rounds) == 39 and all(r.drafted == 0 for r in rounds)  # one token a round


@pytest.mark.parametrize(
    "top_k, steps, eta, max_draft",
    [
        (1, lambda drafted: 1, 0.6, 8),
        (8, lambda drafted: drafted + 2, 0.0, 3),
        (3, no_steps, 0.6, 8),
        (2, lambda drafted: 10, 1.0, 8),
    ],
    ids=["top1x1", "top8xk+2", "top3x0", "top2x10"],
)
def test_other_parallel_drafting_settings_keep_the_output(
    models, adapter, prompts, greedy, top_k, steps, eta, max_draft
):
    prompt = prompts[top_k % len(prompts)]
    out, rounds = generate(models, adapter, prompt, 32, eta, max_draft, top_k, steps)
    assert out == greedy(prompt, 32)
    assert all(r.branch_steps == (steps(r.drafted) if r.drafted else 0) for r in rounds)


def test_any_adapter_keeps_the_output(models, prompts, greedy):
    """A default-initialised adapter drafts nonsense; the output must not change."""
    wild = untrained_adapter(models.config, seed=1, std=None)
    for prompt in prompts[2:]:
        out, _ = generate(models, wild, prompt, 30, 0.0, 4, 3, lambda drafted: 2)
        assert out == greedy(prompt, 30)


@pytest.fixture(scope="module")
def trained_adapter(models):
    directory = adapter_dir(TINY)
    if not os.path.exists(os.path.join(directory, ADAPTER_CONFIG)):  # written after the weights
        pytest.skip(f"no trained draft adapter in {directory} (scripts/train_draft.py writes one)")
    return load_adapter(directory, models.config, DEVICE_LAYERS, torch.float32)


def test_the_trained_adapter_keeps_the_output(models, trained_adapter, prompts, greedy):
    for i, prompt in enumerate(prompts):
        top_k = 3 if i % 2 else 0
        out, rounds = generate(models, trained_adapter, prompt, 40, 0.6, 8, top_k, lambda drafted: 3)
        assert out == greedy(prompt, 40)
        assert len(out) == 1 + sum(r.accepted + 1 for r in rounds)


@pytest.mark.parametrize("eta", ETAS)
@pytest.mark.parametrize("parallel", sorted(PARALLEL))
def test_rounds_follow_eq5_and_roll_the_caches_back(models, adapter, prompts, greedy, eta, parallel):
    top_k, steps = PARALLEL[parallel]
    prompt = prompts[(ETAS.index(eta) + 1) % len(prompts)]
    out, rounds = run_rounds(models, adapter, prompt, 24, eta, 6, top_k, steps, check_caches=True)
    assert out == greedy(prompt, 24)
    check_drafts_follow_eq5(rounds, eta)
    check_round_accounting(out, rounds, len(prompt))


def test_a_reused_branch_starts_the_next_draft(models, adapter, prompts, greedy):
    """When exactly d_k is rejected and its correction is a parallel candidate, the next round's draft
    is that branch's (reused), its caches are committed, and the output does not change."""
    reused_rounds = 0
    for prompt in prompts[1:3]:
        out, rounds = run_rounds(models, adapter, prompt, 24, 0.6, 8, 8, lambda drafted: 3, check_caches=True)
        assert out == greedy(prompt, 24)
        check_drafts_follow_eq5(rounds, 0.6)
        check_round_accounting(out, rounds, len(prompt))
        assert not rounds[0].draft.reused
        for this, following in itertools.pairwise(rounds):
            branch, verdict = this.verdict.reused_branch, this.verdict
            if branch is None:
                assert not following.draft.reused
                continue
            reused_rounds += 1
            assert verdict.accepted == len(this.draft.tokens) - 1  # exactly d_k was rejected
            assert branch.token == verdict.emitted[-1] != this.draft.tokens[-1]
            assert any(b is branch for b in this.branches)
            if following.limit < 1:
                assert not following.draft.reused
                continue
            assert following.draft.reused
            assert following.draft.start == this.draft.start + verdict.accepted + 1
            kept = min(
                following.limit, next((i + 1 for i, p in enumerate(branch.probs) if p < 0.6), len(branch.tokens))
            )
            assert following.draft.tokens[:kept] == branch.tokens[:kept]
            assert torch.equal(following.draft.shallow[:kept], torch.cat(branch.shallow[:kept]))
    assert reused_rounds >= 1


def test_rounds_without_a_reused_branch_never_resume(models, adapter, prompts, greedy):
    out, rounds = run_rounds(models, adapter, prompts[0], 30, 0.6, 8, 0)
    assert out == greedy(prompts[0], 30)
    assert all(r.verdict.reused_branch is None and not r.draft.reused and not r.branches for r in rounds)


def test_generation_stops_right_after_eos(models, adapter, prompts, greedy):
    """eos_id is a token the greedy output contains; inside a round's accepted drafts or as its last token."""
    checked_inside_a_round = False
    for prompt in prompts:
        if checked_inside_a_round:
            break
        full, rounds = run_rounds(models, adapter, prompt, 40, 0.0, 8, 0)
        # the first token that an accepted draft brought (not the round's LLM token), new to the output
        produced, eos_id = 1, None
        for r in rounds:
            if r.verdict.accepted and r.verdict.emitted[0] not in full[:produced]:
                eos_id = r.verdict.emitted[0]
                break
            produced += len(r.verdict.emitted)
        if eos_id is None:
            continue
        checked_inside_a_round = True
        expected = greedy(prompt, 40, eos_id)
        assert expected == full[: full.index(eos_id) + 1]
        out, eos_rounds = run_rounds(models, adapter, prompt, 40, 0.0, 8, 0, eos_id=eos_id)
        assert out == expected
        check_round_accounting(out, eos_rounds, len(prompt), eos_id)
        assert len(eos_rounds[-1].verdict.emitted) < eos_rounds[-1].verdict.accepted + 1  # cut inside the round
        out, _ = generate(models, adapter, prompt, 40, 0.6, 8, 3, lambda drafted: 3, eos_id=eos_id)
        assert out == expected
    assert checked_inside_a_round
    # EOS as the first generated token: nothing after it, no round
    prompt = prompts[1]
    first = greedy(prompt, 1)[0]
    out, rounds = generate(models, adapter, prompt, 40, 0.6, 8, 3, lambda drafted: 3, eos_id=first)
    assert out == greedy(prompt, 40, first) == [first] and rounds == []
    # EOS later in the output, with parallel drafting off: the output stops right after it
    full = greedy(prompt, 40)
    index = max(i for i in range(1, 40) if full[i] not in full[:i])  # the last token new to the output
    out, _ = generate(models, adapter, prompt, 40, 0.6, 8, 0, eos_id=full[index])
    assert out == full[: index + 1]


def test_a_budget_of_no_tokens_generates_nothing(models, adapter, prompts, greedy):
    out, _ = generate(models, adapter, prompts[0], 0)
    assert out == greedy(prompts[0], 0) == []


def test_acceptance_length_counts_the_bonus_token():
    rounds = [RoundLog(4, 3, False, 0), RoundLog(4, 0, True, 2), RoundLog(1, 1, False, 0)]
    assert acceptance_length(rounds) == pytest.approx(1 + (3 + 0 + 1) / 3)
    assert acceptance_length([RoundLog(0, 0, False, 0)]) == 1.0
    assert math.isnan(acceptance_length([]))


def test_speculative_device_checks_its_arguments(models, adapter):
    for eta in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"eta must lie in \[0, 1\]"):
            SpeculativeDevice(models.device, adapter, eta)
    with pytest.raises(ValueError, match="needs the embedding and the LM head"):
        SpeculativeDevice(models.middle, adapter)


def test_candidates_are_the_top_k_alternatives_to_the_last_draft_token(models, adapter, prompts):
    device = SpeculativeDevice(models.device, adapter, 0.0)
    state = device.new_state(64)
    with torch.inference_mode():
        device.shallow(state, prompts[0])
        device.absorb(state)
    draft = device.draft(state, prompts[0][-1], 3)
    assert len(draft.tokens) == 3 and draft.start == len(prompts[0])
    ranked = torch.argsort(draft.last_probs, descending=True).tolist()
    assert ranked[0] == draft.tokens[-1]
    assert device.candidates(draft, 4) == ranked[1:5]
    assert device.candidates(draft, 0) == []
    with pytest.raises(ValueError, match="3 deep states for a draft of 3 tokens"):
        device.accept(state, draft, torch.zeros(3, models.config.hidden_size))


class ScriptedDevice(SpeculativeDevice):
    """The LLM's next tokens are given, not read off the deep states: accept's rule in isolation."""

    targets: Sequence[int] = ()

    def next_token(self, deep: torch.Tensor) -> torch.Tensor:
        return torch.tensor(list(self.targets[: deep.shape[0]]))


def drafted_round(models, adapter, prompt, replied_at_once=False):
    """A fresh sequence with a 3-token draft after ``prompt`` and 3 parallel branches of 2 steps (of none
    when the verification is back before the first)."""
    device = ScriptedDevice(models.device, adapter, 0.0)
    state = device.new_state(64)
    with torch.inference_mode():
        device.shallow(state, prompt)
        device.absorb(state)
    draft = device.draft(state, prompt[-1], 3)
    branches = device.draft_branches(state, draft, device.candidates(draft, 3), 2, lambda: replied_at_once)
    return device, state, draft, branches


@pytest.mark.parametrize("case", ["all", "last", "last-not-a-candidate", "first-is-a-candidate", "replied-at-once"])
def test_accept_takes_the_longest_agreeing_prefix_and_reuses_only_when_exactly_d_k_fails(
    models, adapter, prompts, case
):
    prompt = prompts[0]
    device, state, draft, branches = drafted_round(models, adapter, prompt, case == "replied-at-once")
    d1, d2, d3 = draft.tokens
    candidates = [b.token for b in branches]
    assert candidates == device.candidates(draft, 3)
    assert all(len(b.tokens) == (0 if case == "replied-at-once" else 2) for b in branches)
    outsider = next(t for t in range(100) if t not in (*candidates, d1, d2, d3))
    device.targets = {
        "all": [d1, d2, d3, outsider],
        "last": [d1, d2, candidates[1], outsider],
        "last-not-a-candidate": [d1, d2, outsider, d1],
        "first-is-a-candidate": [candidates[0], d2, d3, outsider],
        "replied-at-once": [d1, d2, candidates[0], outsider],  # a branch with no draft is not reused
    }[case]
    accepted = {"all": 3, "last": 2, "last-not-a-candidate": 2, "first-is-a-candidate": 0, "replied-at-once": 2}[case]
    verdict = device.accept(state, draft, torch.zeros(4, models.config.hidden_size), branches)
    assert verdict.accepted == accepted
    assert verdict.emitted == draft.tokens[:accepted] + [device.targets[accepted]]
    assert state.shallow_cache.length == len(prompt) + accepted + 1
    absorbed = state.adapter_cache.length
    assert absorbed + sum(u.shape[0] for u in state.unabsorbed) == state.shallow_cache.length
    assert absorbed == len(prompt) + min(accepted + 1, 3)  # d_3's state never went through the adapter
    if case == "last":
        assert verdict.reused_branch is branches[1] and verdict.reused_branch.tokens
    else:
        assert verdict.reused_branch is None


# --------------------------------------------------------------------------------------------
# HAT's sizing: Eq. 3 (chunks) and Eq. 6 (parallel draft steps)

# One stage's delay table: 10 ms at 1 token, 16 ms at 4, 40 ms at 16. Interpolated, and extrapolated with
# the slope of the two largest, that is g_stage(t) = 8 ms + 2 ms * t for every t >= 1; with P = 2 stages
# the whole middle model's g(t) = 2 * g_stage(t). mu = 3: g(mu) = 28 ms.
STATE_VECTOR = [3.0, 2.0, 1.0, 0.010, 4.0, 0.016, 16.0, 0.040]
TOKEN_BYTES = 512


def per_token(seconds: float) -> float:
    """The seconds per byte at which one token's hidden state takes ``seconds`` to send."""
    return seconds / TOKEN_BYTES


def test_server_state_predicts_the_whole_middle_model():
    server = ServerState(STATE_VECTOR)
    assert server.mu == 3.0 and server.stages == 2
    for tokens, stage_s in [(1, 0.010), (3, 0.014), (4, 0.016), (10, 0.028), (16, 0.040), (21, 0.050)]:
        assert server.g_s(tokens) == pytest.approx(2 * stage_s)
    assert server.g_s(2.2) == pytest.approx(server.g_s(3))  # a fractional size counts as the next whole token
    assert ServerState([3.0, 2.0]).g_s(1) is None


def test_eq3_chunk_is_the_smallest_that_hides_the_next_upload():
    server = ServerState(STATE_VECTOR)
    # X * 3.5 ms >= (g(3) + g(3 + X)) / 2 = 14 ms + (14 ms + 2 ms * X)  <=>  X >= 28 / 1.5 = 18.7  ->  X = 19
    assert chunk_tokens_eq3(100, TOKEN_BYTES, per_token(0.0035), server, 32) == 19
    assert chunk_tokens_eq3(19, TOKEN_BYTES, per_token(0.0035), server, 32) == 19
    assert chunk_tokens_eq3(18, TOKEN_BYTES, per_token(0.0035), server, 32) == 18  # no crossing: the rest
    # a slow link crosses at once: never below 16 tokens, unless fewer remain
    assert chunk_tokens_eq3(100, TOKEN_BYTES, per_token(0.1), server, 32) == 16
    assert chunk_tokens_eq3(10, TOKEN_BYTES, per_token(0.1), server, 32) == 10
    # 1 ms a token against 14 ms + 14 ms + 2 ms * X: the upload never catches up, the whole rest goes at once
    assert chunk_tokens_eq3(500, TOKEN_BYTES, per_token(0.001), server, 32) == 500
    # the heavier the server's load, the bigger the chunk: mu = 9 -> 2 * 26 ms + 2 ms * X <= 3.5 ms * X -> X = 35
    assert chunk_tokens_eq3(100, TOKEN_BYTES, per_token(0.0035), ServerState([9.0, *STATE_VECTOR[1:]]), 32) == 35


def test_eq3_before_measurements_uses_the_fallback():
    server = ServerState(STATE_VECTOR)
    assert chunk_tokens_eq3(100, TOKEN_BYTES, None, server, 32) == 32
    assert chunk_tokens_eq3(100, TOKEN_BYTES, per_token(0.0035), None, 32) == 32
    assert chunk_tokens_eq3(100, TOKEN_BYTES, per_token(0.0035), ServerState([3.0, 2.0]), 32) == 32
    assert chunk_tokens_eq3(20, TOKEN_BYTES, None, None, 32) == 20
    assert chunk_tokens_eq3(20, TOKEN_BYTES, None, None, 0) == 1
    assert chunk_tokens_eq3(0, TOKEN_BYTES, per_token(0.0035), server, 32) == 0
    assert chunk_tokens_eq3(-3, TOKEN_BYTES, None, None, 32) == 0


def test_eq6_parallel_steps_fill_one_verification():
    server = ServerState(STATE_VECTOR)
    # 5 draft tokens at 1 ms each, up and down: 10 ms; g(mu = 3) = 28 ms; 38 ms / 5 ms = 7.6 -> 7 (floor)
    assert parallel_steps_eq6(5, TOKEN_BYTES, per_token(0.001), server, 0.005, 8) == 7
    assert parallel_steps_eq6(5, TOKEN_BYTES, per_token(0.001), server, 0.005, 3) == 3  # the cap
    assert parallel_steps_eq6(5, TOKEN_BYTES, per_token(0.001), server, 0.005, 0) == 0
    assert parallel_steps_eq6(5, TOKEN_BYTES, per_token(0.001), server, 0.05, 8) == 0  # 0.76 of a step
    # mu = 9: g = 2 * 26 ms = 52 ms; (10 + 52) / 5 = 12.4 -> 12
    assert parallel_steps_eq6(5, TOKEN_BYTES, per_token(0.001), ServerState([9.0, *STATE_VECTOR[1:]]), 0.005, 20) == 12
    # 9 draft tokens: 18 ms of transfer; (18 + 28) / 5 = 9.2 -> 9
    assert parallel_steps_eq6(9, TOKEN_BYTES, per_token(0.001), server, 0.005, 20) == 9


def test_eq6_is_zero_before_measurements():
    server = ServerState(STATE_VECTOR)
    assert parallel_steps_eq6(5, TOKEN_BYTES, None, server, 0.005, 8) == 0
    assert parallel_steps_eq6(5, TOKEN_BYTES, per_token(0.001), None, 0.005, 8) == 0
    assert parallel_steps_eq6(5, TOKEN_BYTES, per_token(0.001), server, None, 8) == 0
    assert parallel_steps_eq6(5, TOKEN_BYTES, per_token(0.001), server, 0.0, 8) == 0
    assert parallel_steps_eq6(5, TOKEN_BYTES, per_token(0.001), ServerState([3.0, 2.0]), 0.005, 8) == 0


def test_moving_average():
    average = MovingAverage()
    assert average.value is None
    assert average.update(10.0) == 10.0  # the first sample is the average
    assert average.update(20.0) == pytest.approx(12.0)  # 0.8 * 10 + 0.2 * 20
    assert average.update(20.0) == pytest.approx(13.6)  # 0.8 * 12 + 0.2 * 20
    half = MovingAverage(0.5)
    half.update(4.0)
    assert half.update(8.0) == pytest.approx(6.0)


def test_link_estimator_measures_the_rate_of_messages_of_one_size_by_their_ratio():
    link = LinkEstimator()
    assert link.s_per_byte is None and link.rate_mbit() is None
    link.observe(0, 1.0)  # nothing moved, or no network time: nothing to learn
    link.observe(1_000_000, 0.0)
    assert link.s_per_byte is None
    link.observe(1_000_000, 1.0)  # 1 us a byte = 8 Mbit/s
    assert link.s_per_byte == pytest.approx(1e-6) and link.rate_mbit() == pytest.approx(8.0)
    link.observe(1_000_000, 2.0)  # 2 us a byte: 0.8 * 1 + 0.2 * 2 = 1.2 us (sizes alike: no line to fit)
    assert link.s_per_byte == pytest.approx(1.2e-6) and link.rate_mbit() == pytest.approx(8 / 1.2)
    close = LinkEstimator()
    close.observe(100_000, 1.1)  # 11 us a byte
    close.observe(110_000, 1.11)  # 10.09 us a byte; 100 and 110 kB are too alike to fit a line
    assert close.s_per_byte == pytest.approx(0.8 * 1.1 / 100_000 + 0.2 * 1.11 / 110_000)


def test_link_estimator_ignores_messages_too_small_to_show_the_rate():
    """A link lets a few ms of its rate through at once (a shaper's burst): decode rounds of a few
    kB cross in about no time whatever their size, and a slope through them is no rate at all."""
    link = LinkEstimator()
    for nbytes in (8_000, 16_000, 24_000, 40_000, MIN_MEASURED_BYTES - 1):
        link.observe(nbytes, 0.002)  # within the burst: flat in bytes
    assert link.s_per_byte is None  # nothing learnt: HAT's chunks fall back to their setting
    link.observe(2_000_000, 1.0)  # a prompt's upload: 2 MB in 1 s = 16 Mbit/s
    assert link.rate_mbit() == pytest.approx(16.0)


def test_link_estimator_separates_the_rate_from_the_latency():
    link = LinkEstimator()
    for nbytes in (100_000, 10_000_000, 200_000, 5_000_000, 100_000):  # 1 s of latency + 1 us a byte
        link.observe(nbytes, 1.0 + 1e-6 * nbytes)
    # the ratio alone would be dominated by the latency (11 us a byte for the last, 100 kB message)
    assert link.s_per_byte == pytest.approx(1e-6, rel=1e-6)
    assert link.rate_mbit() == pytest.approx(8.0, rel=1e-6)
    faster_when_bigger = LinkEstimator()  # a negative slope is noise: the ratio stands
    faster_when_bigger.observe(100_000, 2.0)
    faster_when_bigger.observe(10_000_000, 1.0)
    assert faster_when_bigger.s_per_byte == pytest.approx(0.8 * 2.0 / 100_000 + 0.2 * 1.0 / 10_000_000)


# --------------------------------------------------------------------------------------------
# state monitor vector, wire segments, run config


def test_state_vector_round_trip_predicts_p_times_one_stage():
    monitor = StateMonitor()
    for tokens, seconds in [(1, 0.004), (1, 0.006), (8, 0.012), (30, 0.050), (3, 0.007)]:
        monitor.observe(tokens, seconds)
    vector = monitor.to_vector(3)
    assert vector[:2] == [pytest.approx(monitor.mu), 3.0] and len(vector) == 2 + 2 * 4  # buckets 1, 4, 8, 32
    assert vector[2::2] == [1.0, 4.0, 8.0, 32.0]
    server = ServerState(vector)  # what a device builds from a reply's STATE segment
    assert server.mu == pytest.approx(monitor.mu) and server.stages == 3
    for tokens in (1, 2, 5, 8, 20, 32, 100):
        assert server.g_s(tokens) == pytest.approx(3 * monitor.predict_s(tokens))
    empty = StateMonitor().to_vector(2)
    assert empty == [0.0, 2.0] and ServerState(empty).g_s(4) is None


@pytest.mark.parametrize("values", [[], [1.0], [1.0, 2.0, 4.0], [1.0, 2.0, 4.0, 0.1, 8.0]])
def test_bad_state_vectors_are_rejected(values):
    with pytest.raises(ValueError, match="a server state vector has mu, P, then"):
        ServerState(values)


def test_verify_and_state_segments_round_trip_through_the_wire():
    shallow = torch.randn(6, 16, generator=torch.Generator().manual_seed(13))
    monitor = StateMonitor()
    monitor.observe(5, 0.02)
    monitor.observe(40, 0.09)
    state = torch.tensor([monitor.to_vector(2)], dtype=torch.float32)
    segments = [
        wire.Segment(3, 4, wire.VERIFY, 37, 6, shallow),
        wire.Segment(9, 4, wire.DECODE, 12, 1, shallow[:1].to(torch.bfloat16)),
        wire.Segment(0, 0, wire.STATE, 0, 1, state, queue_s=0.25, compute_s=0.5),
    ]
    frame = wire.decode(wire.encode(wire.DATA, 17, segments))
    assert frame.iteration == 17 and [s.phase for s in frame.segments] == [wire.VERIFY, wire.DECODE, wire.STATE]
    assert len({wire.PREFILL, wire.DECODE, wire.RELEASE, wire.VERIFY, wire.STATE}) == 5
    verify = frame.segments[0]
    assert (verify.request_id, verify.device, verify.start, verify.tokens) == (3, 4, 37, 6)
    assert torch.equal(verify.payload, shallow)
    got = frame.segments[2]
    assert got.payload.shape == (1, 6) and torch.equal(got.payload, state)
    assert (got.queue_s, got.compute_s) == (0.25, 0.5)
    server = ServerState(got.payload[0].tolist())  # as the device reads it
    assert server.stages == 2 and server.mu == pytest.approx(monitor.mu)
    assert server.g_s(20) == pytest.approx(2 * monitor.predict_s(20), rel=1e-6)


def config(**changes) -> dict:
    raw = {
        "run_id": "r1",
        "method": "hat",
        "model": "/models/tiny",
        "partition": {"device_layers": 2, "stages": 2},
        "out_dir": "/tmp/out",
        "ranks": [{"role": "stage"}, {"role": "stage"}, {"role": "device", "node": "orin", "schedule": "/s.jsonl"}],
    }
    raw.update(changes)
    return raw


@pytest.mark.parametrize("method", ["sd", "pc", "sd_pc", "sd_pd", "hat"])
def test_hat_methods_parse_with_their_features(method):
    parsed = run_config.parse(config(method=method))
    features = {"sd", "pc", "pd"} if method == "hat" else set(method.split("_"))  # the name lists them
    assert parsed.method == method and parsed.server_state_in_replies
    for feature in ("sd", "pc", "pd"):
        assert parsed.uses(feature) == (feature in features), feature
    assert parsed.draft == DraftSettings()


@pytest.mark.parametrize("method", ["centralized", "ushape", "usarathi"])
def test_methods_outside_hat_use_none_of_its_features(method):
    parsed = run_config.parse(config(method=method))
    assert not any(parsed.uses(f) for f in ("sd", "pc", "pd")) and not parsed.server_state_in_replies


def test_draft_settings_parse():
    parsed = run_config.parse(config(draft={"eta": 0.3, "top_k": 5, "adapter": "/a", "max_draft_tokens": 4}))
    assert parsed.draft == DraftSettings(adapter="/a", eta=0.3, max_draft_tokens=4, top_k=5, max_parallel_steps=8)
    assert run_config.parse(config(draft={"eta": 0.0})).draft.eta == 0.0
    assert run_config.parse(config(draft={"eta": 1.0})).draft.eta == 1.0


@pytest.mark.parametrize(
    "draft, message",
    [
        ({"temperature": 0.7}, r"run\.json: draft\.temperature is not a field; known: adapter, eta"),
        ({"eta": 1.5}, r"run\.json: draft\.eta must lie in \[0, 1\]"),
        ({"eta": -0.1}, r"run\.json: draft\.eta must lie in \[0, 1\]"),
        ({"eta": float("nan")}, r"run\.json: draft\.eta must lie in \[0, 1\]"),
        ({"max_draft_tokens": -1}, r"run\.json: draft\.max_draft_tokens, top_k and max_parallel_steps must be >= 0"),
        ({"top_k": -2}, r"run\.json: draft\.max_draft_tokens"),
        ([0.6], r"run\.json: field 'draft' must be a mapping"),
    ],
)
def test_bad_draft_settings_are_refused(draft, message):
    with pytest.raises(RunConfigError, match=message):
        run_config.parse(config(draft=draft), "run.json")


def test_draft_values_are_numbers_after_parsing():
    try:
        parsed = run_config.parse(config(draft={"eta": "0.5", "max_draft_tokens": "4"}), "run.json")
    except RunConfigError as error:
        assert "draft." in str(error)
        return
    assert isinstance(parsed.draft.eta, float) and isinstance(parsed.draft.max_draft_tokens, int)
