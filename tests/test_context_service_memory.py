"""LLMS's context memory on the tiny model: calls of several contexts under a budget that cannot hold
them all, so that every switch reclaims, reads and recomputes chunks; what a switch writes with and
without ahead-of-time swapping; the outputs against the same calls with memory to spare."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nodes.context_service.chunk_store import ChunkStore
from nodes.context_service.context_memory import ContextLimit, ContextMemory, MemorySettings
from nodes.context_service.load_plan import LinearCost
from nodes.inference.checkpoint import load_whole
from nodes.inference.model import Segment

TINY = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny"
# a slow disk next to a fast recompute: the plan recomputes some chunks and reads the rest
RECOMPUTE = LinearCost(2e-3, 1e-3)
READ = LinearCost(1.0 / 20e6, 1e-3)


@pytest.fixture(scope="module")
def model():
    return load_whole(str(TINY), dtype="float32")


def _call(memory: ContextMemory, ident: str, prompt: list[int], new_tokens: int):
    """One callLLM: prepare, prefill the prompt and decode greedily on the working cache, commit."""
    record = memory.prepare(ident)
    cache = memory.working_cache(ident, len(prompt) + new_tokens)
    model = memory.model
    with torch.inference_mode():
        hidden = model.run_layers(model.embed(torch.tensor(prompt)), [Segment(cache, len(prompt))])
        out = [int(torch.argmax(model.logits(hidden[-1])))]
        for _ in range(new_tokens - 1):
            hidden = model.run_layers(model.embed(torch.tensor([out[-1]])), [Segment(cache, 1)])
            out.append(int(torch.argmax(model.logits(hidden[-1]))))
        # the last output token is part of the context too (teacher-forced into the cache)
        model.run_layers(model.embed(torch.tensor([out[-1]])), [Segment(cache, 1)])
    memory.commit(ident, cache, prompt + out)
    return record, out


def _trace(seed: int = 0, contexts: int = 3, calls: int = 9) -> list[tuple[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    order = [f"app{i % contexts}" for i in range(calls)]
    return [(ident, torch.randint(2, 4000, (int(torch.randint(20, 40, (1,), generator=generator)),),
                                  generator=generator).tolist()) for ident in order]  # fmt: skip


def _run(model, tmp_path: Path, name: str, budget: int, **settings):
    memory = ContextMemory(model, ChunkStore(str(tmp_path / name)),
                           MemorySettings(budget, RECOMPUTE, READ, **settings))  # fmt: skip
    for i in range(3):
        memory.new_context(f"app{i}")
    records, outputs = [], []
    for ident, prompt in _trace():
        record, out = _call(memory, ident, prompt, 6)
        records.append(record)
        outputs.append(out)
        assert memory.resident_bytes <= budget
    return memory, records, outputs


def test_switches_under_pressure_write_nothing_with_aot_and_give_the_outputs_of_an_unpressed_run(model, tmp_path):
    _, roomy_records, expected = _run(model, tmp_path, "roomy", 10**9, compression=False)
    assert all(r.missing_chunks == 0 for r in roomy_records)
    # a budget of about one context: every switch brings chunks back
    tight, records, outputs = _run(model, tmp_path, "tight", 300_000, compression=False, pipeline=False)
    later = records[4:]  # from the fifth call on, the three contexts together outgrow the budget
    assert all(r.missing_chunks > 0 for r in later) and all(r.bytes_written == 0 for r in later)  # AoT
    assert all(r.recomputed_chunks == 0 and r.read_chunks == r.missing_chunks for r in later)
    assert tight.faults == 0 and tight.store.stats.bytes_read > 0
    assert outputs == expected  # INT8 chunks read back bit-exact: the same greedy tokens


def test_the_pipeline_recomputes_part_of_the_missing_chunks_and_aot_off_writes_at_switch_time(model, tmp_path):
    _, _, expected = _run(model, tmp_path, "roomy", 10**9, compression=False)
    piped, records, outputs = _run(model, tmp_path, "piped", 300_000, compression=False)
    later = records[4:]
    assert piped.faults == 0 and piped.store.stats.bytes_read > 0
    assert sum(r.recomputed_chunks for r in later) > 0 and sum(r.read_chunks for r in later) > 0
    agree = sum(a == b for out, ref in zip(outputs, expected, strict=True) for a, b in zip(out, ref, strict=True))
    assert agree >= 0.8 * sum(len(o) for o in expected)  # recomputed over INT8 neighbours: nearly the same
    _, lazy_records, _ = _run(model, tmp_path, "lazy", 300_000, compression=False, ahead_of_time=False)
    assert sum(r.bytes_written for r in lazy_records[4:]) > 0  # without AoT the reclaim writes


def test_compression_holds_the_global_ratio_and_a_context_larger_than_the_budget_is_refused(model, tmp_path):
    memory, _, _ = _run(model, tmp_path, "compressed", 10**9)
    for context in memory.contexts.values():
        complete = [c for c in context.chunks if c.tokens == 16]
        assert sum(c.bits for c in complete) / 8 <= 0.5 * len(complete) + 1e-9
        assert context.chunks[-1].bits == 8 or context.chunks[-1].tokens == 16  # the partial chunk stays INT8
    tiny = ContextMemory(model, ChunkStore(str(tmp_path / "tiny")), MemorySettings(10_000, RECOMPUTE, READ))
    tiny.new_context("big")
    _call(tiny, "big", list(range(2, 80)), 4)  # it fits while it is being made, then outgrows the budget
    with pytest.raises(ContextLimit, match="budget"):
        _call(tiny, "big", list(range(2, 80)), 4)
    assert "big" not in tiny.locked  # a refused call leaves no lock behind


def test_the_baselines_are_settings_of_the_same_memory(model, tmp_path) -> None:
    from nodes.context_service.context_memory import BASELINES, baseline_settings

    runs = {}
    for name in ("lmk", "swapping", "vllm-s", "vllm-sq"):
        memory = ContextMemory(model, ChunkStore(str(tmp_path / name)), baseline_settings(name, 600_000, RECOMPUTE, READ))
        for i in range(3):
            memory.new_context(f"app{i}")
        records, held = [], []
        for ident, prompt in _trace():
            held.append(len(memory.contexts[ident].chunks))  # the context's chunks before the call
            records.append(_call(memory, ident, prompt, 6)[0])
        runs[name] = (memory, records, held)
        assert memory.faults == 0 and all(r.bytes_written == 0 or name in ("swapping", "vllm-s", "vllm-sq")
                                          for r in records)  # fmt: skip
    lmk, lmk_records, _ = runs["lmk"]
    assert lmk.store.stats.writes == 0 and lmk.store.stats.reads == 0  # killed contexts are recomputed, not read
    assert any(r.missing_chunks for r in lmk_records)
    assert all(r.recomputed_chunks == r.missing_chunks for r in lmk_records)
    _, swapping_records, held = runs["swapping"]
    for record, chunks in zip(swapping_records, held, strict=True):  # a whole context goes and comes back
        assert record.missing_chunks in (0, chunks) and record.recomputed_chunks == 0
    assert any(record.missing_chunks for record in swapping_records)
    vllm_s, vllm_sq = runs["vllm-s"][0], runs["vllm-sq"][0]
    assert {c.bits for ctx in vllm_s.contexts.values() for c in ctx.chunks} == {16}
    assert {c.bits for ctx in vllm_sq.contexts.values() for c in ctx.chunks} == {8}
    assert vllm_s.store.stats.bytes_read > vllm_sq.store.stats.bytes_read  # float16 moves twice the bytes
    assert len(BASELINES) == 9
    # the ablations change one technique each; llms-lru is half of llms-no-lifecycle
    ablated = {name: baseline_settings(name, 1, RECOMPUTE, READ) for name in BASELINES if name.startswith("llms-")}
    llms = baseline_settings("llms", 1, RECOMPUTE, READ)
    assert (llms.eviction, llms.ahead_of_time) == ("lctru", True)
    assert (ablated["llms-lru"].eviction, ablated["llms-lru"].ahead_of_time) == ("lru", True)
    assert (ablated["llms-no-lifecycle"].eviction, ablated["llms-no-lifecycle"].ahead_of_time) == ("lru", False)
    assert not ablated["llms-no-compression"].compression and not ablated["llms-no-pipeline"].pipeline
    with pytest.raises(ValueError, match="one of llms"):
        baseline_settings("zram", 1, RECOMPUTE, READ)


def test_a_context_begins_with_one_bos_whatever_is_appended_to_it(model, tmp_path) -> None:
    from nodes.context_service.service import LlmService
    from nodes.inference.tokenizer import Tokenizer

    memory = ContextMemory(model, ChunkStore(str(tmp_path / "chunks")), MemorySettings(10**9, RECOMPUTE, READ))
    service = LlmService(memory, Tokenizer(str(TINY)), str(tmp_path / "state"))
    ctx = service.new_context("app", "System: be brief.")
    list(service.call(ctx, "Hello there", 3))
    list(service.call(ctx, "", 0, teacher_forced=" and more"))
    ids, tokenizer = memory.contexts[ctx].token_ids, service.tokenizer
    expected = 1 if tokenizer.add_bos and tokenizer.bos_id is not None else 0
    assert ids.count(tokenizer.bos_id) == expected and (not expected or ids[0] == tokenizer.bos_id)
