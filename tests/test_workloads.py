"""Workloads: arrival processes, prompt sources, QoE expectations and per-device request schedules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from foundation.errors import InputError, TestbedError
from nodes.contracts.run_config import load_schedule
from nodes.inference.tokenizer import Tokenizer
from workloads.arrivals import (
    ConstantRate,
    GammaArrivals,
    Poisson,
    StepRates,
    TraceArrivals,
    arrival_times_s,
    load_arrival_trace,
)
from workloads.corpus import corpus_sha256, is_held_out, stdlib_root, training_texts
from workloads.prompts import LENGTH_MODELS, context_tokens, draw_prompt_lengths, draw_prompts
from workloads.qoe import READING, SPEAKING, QoeExpectation, qoe_expectation
from workloads.schedule import WorkloadSpec, build_schedules, schedule_digest, write_schedule
from workloads.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
CONTEXT = 4096  # examples/models/tiny/config.json max_position_embeddings


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(TINY))


def gaps_of(times: list[float]) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))


# -- arrivals ------------------------------------------------------------------------------------


def test_poisson_arrivals_have_the_rate_and_unit_cv():
    # 100k gaps: the mean's relative standard error is 0.3 %, the CV's 0.45 %; tolerance 2 %.
    times = arrival_times_s(Poisson(2.0), count=100_000, seed=11)
    gaps = gaps_of(times)
    assert times[0] > 0 and np.all(gaps > 0)
    assert len(times) / times[-1] == pytest.approx(2.0, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.02)


def test_gamma_arrivals_are_bursty_with_the_given_cv():
    # Andes' bursty process, CV 3 (shape 1/9): the CV's relative standard error at 100k gaps is ~1.2 %,
    # the mean's 0.95 %; tolerance 5 %.
    times = arrival_times_s(GammaArrivals(2.0, 3.0), count=100_000, seed=12)
    gaps = gaps_of(times)
    assert len(times) / times[-1] == pytest.approx(2.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.05)
    poisson_gaps = gaps_of(arrival_times_s(Poisson(2.0), count=100_000, seed=12))
    # bursts: far more very short gaps than a Poisson process of the same rate has
    assert np.mean(gaps < 0.01) > 3 * np.mean(poisson_gaps < 0.01)


def test_constant_rate_has_exact_gaps_and_a_seeded_phase():
    times = arrival_times_s(ConstantRate(4.0), count=50, seed=1)
    assert np.allclose(np.diff(times), 0.25, rtol=0, atol=1e-12)
    assert 0 < times[0] <= 0.25
    assert arrival_times_s(ConstantRate(4.0), count=50, seed=2)[0] != times[0]


def test_step_arrivals_follow_each_steps_rate_and_the_last_step_runs_on():
    steps = StepRates(((4.0, 50.0), (24.0, 50.0), (4.0, 100.0)))
    times = np.array(arrival_times_s(steps, count=2200, seed=7))
    assert len(times) == 2200 and np.all(np.diff(times) >= 0)
    for low, high, rate in ((0, 50, 4.0), (50, 100, 24.0), (100, 200, 4.0)):
        inside = ((times >= low) & (times < high)).sum()
        expected = rate * (high - low)
        assert abs(inside - expected) < 4 * np.sqrt(expected), (low, inside, expected)  # Poisson: 4 sigma
        gaps = np.diff(times[(times >= low) & (times < high)])
        assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.2)  # exponential within a step
    assert times[-1] > 200  # the 2,200th request comes after the steps' 2,000 expected: the last step ran on
    short = arrival_times_s(StepRates(((4.0, 50.0), (24.0, 50.0))), count=100, seed=7)
    assert max(short) < 50  # fewer requests than the first step holds: they all come in it
    with pytest.raises(TestbedError, match="positive rate and duration"):
        arrival_times_s(StepRates(((4.0, 0.0),)), count=3, seed=0)


def test_arrivals_are_deterministic_per_seed():
    for process in (Poisson(1.0), GammaArrivals(1.0, 3.0), ConstantRate(1.0), StepRates(((1.0, 5.0), (3.0, 5.0)))):
        assert arrival_times_s(process, count=20, seed=5) == arrival_times_s(process, count=20, seed=5)
        assert arrival_times_s(process, count=20, seed=5) != arrival_times_s(process, count=20, seed=6)


@pytest.mark.parametrize("count", [0, -1, 100_001, 2.5, True])
def test_arrival_count_is_bounded(count):
    with pytest.raises(TestbedError, match="count"):
        arrival_times_s(Poisson(1.0), count=count, seed=0)


def test_bad_rates_are_refused():
    with pytest.raises(TestbedError, match="rate_per_s"):
        arrival_times_s(Poisson(0.0), count=3, seed=0)
    with pytest.raises(TestbedError, match="cv"):
        arrival_times_s(GammaArrivals(1.0, -1.0), count=3, seed=0)


# -- traces --------------------------------------------------------------------------------------


def test_trace_replays_times_prompt_lengths_and_output_lengths(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "# recorded on the lab's phone\narrival_s,prompt_tokens,max_new_tokens\n0.5,40,8\n1.25,,\n3.0,100,16\n"
    )
    rows = load_arrival_trace(trace)
    assert [(r.arrival_s, r.prompt_tokens, r.max_new_tokens) for r in rows] == [
        (0.5, 40, 8),
        (1.25, None, None),
        (3.0, 100, 16),
    ]
    assert arrival_times_s(TraceArrivals(trace), count=2, seed=0) == [0.5, 1.25]

    spec = WorkloadSpec(arrival="trace", trace="trace.csv", requests_per_device=3, max_new_tokens=24)
    schedule = build_schedules(spec, ["orin"], seed=1, model_dir=TINY, base_dir=tmp_path)["orin"]
    assert [r["arrival_s"] for r in schedule] == [0.5, 1.25, 3.0]
    assert [r["prompt_tokens"] for r in schedule][::2] == [40, 100]
    assert [len(r["prompt_ids"]) for r in schedule] == [r["prompt_tokens"] for r in schedule]
    assert [r["max_new_tokens"] for r in schedule] == [8, 24, 16]  # an empty cell takes the workload's


def test_trace_with_absolute_timestamps_starts_at_zero(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp_s\n1700000000.5\n1700000001.0\n1700000004.25\n")
    assert [r.arrival_s for r in load_arrival_trace(trace)] == [0.0, 0.5, 3.75]


def test_trace_with_a_device_column_gives_each_device_its_rows(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("ts_s,device\n10,phone\n11,orin\n12,phone\n14,orin\n")
    spec = WorkloadSpec(arrival="trace", trace=str(trace), requests_per_device=2)
    schedules = build_schedules(spec, ["orin", "phone"], seed=1, model_dir=TINY)
    assert [r["arrival_s"] for r in schedules["orin"]] == [1.0, 4.0]
    assert [r["arrival_s"] for r in schedules["phone"]] == [0.0, 2.0]


@pytest.mark.parametrize(
    ("text", "line", "field"),
    [
        ("arrival_s,prompt_tokens\n0.1,5\nsoon,6\n", 3, "arrival_s"),
        ("arrival_s,prompt_tokens\n0.1,5\n0.2,-3\n", 3, "prompt_tokens"),
        ("arrival_s\n0.1\n0.5\n0.3\n", 4, "arrival_s"),  # out of time order
        ("arrival_s\n-1\n", 2, "arrival_s"),
        ("arrival_s,prompt_token\n0.1,5\n", 1, "header"),  # misspelt column
        ("arrival_s,ts_s\n0.1,5\n", 1, "header"),
        ("arrival_s,max_new_tokens\n0.1,5,7\n", 2, ""),
    ],
)
def test_bad_trace_rows_name_file_and_line(tmp_path, text, line, field):
    trace = tmp_path / "trace.csv"
    trace.write_text(text)
    with pytest.raises(InputError) as caught:
        load_arrival_trace(trace)
    problem = caught.value.problems[0]
    assert (problem.file, problem.line, problem.field) == (str(trace), line, field)
    assert f"{trace}:{line}" in str(caught.value)


def test_a_trace_shorter_than_the_workload_is_refused(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s\n0.1\n0.2\n")
    spec = WorkloadSpec(arrival="trace", trace=str(trace), requests_per_device=3)
    with pytest.raises(InputError, match="3 requests asked for, but the trace has 2 rows"):
        build_schedules(spec, ["orin"], seed=1, model_dir=TINY)


# -- prompt lengths ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["specbench", "cnndm"])
def test_synthetic_lengths_match_the_published_statistics(name):
    # 20k draws of Gamma(mean, std): standard errors ~1 % (mean) and ~1-2 % (std). The Gamma's own P90
    # is 3.8 % (SpecBench) / 2.8 % (CNN/DM) below the published one, so P90 gets 7 %.
    model = LENGTH_MODELS[name]
    lengths = np.array(draw_prompt_lengths(name, count=20_000, seed=3, max_prompt_tokens=CONTEXT - 32))
    assert lengths.mean() == pytest.approx(model.mean_tokens, rel=0.03)
    assert lengths.std() == pytest.approx(model.std_tokens, rel=0.05)
    assert np.percentile(lengths, 90) == pytest.approx(model.p90_tokens, rel=0.07)


@pytest.mark.parametrize("name", ["alpaca", "sharegpt"])
def test_short_chat_lengths_match_the_published_means(name):
    lengths = np.array(draw_prompt_lengths(name, count=20_000, seed=4, min_prompt_tokens=2))
    assert lengths.mean() == pytest.approx(LENGTH_MODELS[name].mean_tokens, rel=0.03)
    assert lengths.min() >= 2


def test_prompts_follow_their_length_model_and_carry_tokenizer_ids(tokenizer):
    prompts = draw_prompts("sharegpt", count=40, seed=9, model_dir=TINY, max_new_tokens=32)
    assert [p.prompt_tokens for p in prompts] == draw_prompt_lengths(
        "sharegpt", count=40, seed=9, max_prompt_tokens=CONTEXT - 32, min_prompt_tokens=2
    )
    for p in prompts:
        assert p.prompt_ids[0] == tokenizer.bos_id and len(p.prompt_ids) == p.prompt_tokens
        assert tokenizer.decode(list(p.prompt_ids)) == p.text
        assert p.max_new_tokens == 32 and p.source.startswith("sharegpt:")


def test_the_controllers_tokenizer_gives_the_nodes_ids(tokenizer, tmp_path):
    """Schedules are tokenized on the controller (workloads) and decoded on the nodes (nodes.inference)."""
    ours = load_tokenizer(TINY)
    assert (ours.bos_id, ours.add_bos) == (tokenizer.bos_id, tokenizer.add_bos)
    for text in ("import os\n", "def f(x):\n    return x ** 2  # é ü", ""):
        assert ours.encode(text) == tokenizer.encode(text)
        assert ours.encode(text, bos=False) == tokenizer.encode(text, bos=False)
        assert ours.decode(ours.encode(text)) == tokenizer.decode(tokenizer.encode(text))
    with pytest.raises(TestbedError, match=r"cannot load the tokenizer .*tokenizer\.json: no such file"):
        load_tokenizer(tmp_path)


def test_prompts_are_cut_to_the_context(tmp_path):
    assert context_tokens(TINY) == CONTEXT
    prompts = draw_prompts("cnndm", count=60, seed=2, model_dir=TINY, max_new_tokens=3500)
    lengths = [p.prompt_tokens for p in prompts]
    assert max(lengths) == CONTEXT - 3500  # CNN/DM's mean 1037 is far above the 596 tokens left
    assert all(len(p.prompt_ids) == p.prompt_tokens for p in prompts)
    long = draw_prompts("tiny-python", count=2, seed=2, model_dir=TINY, max_new_tokens=32, prompt_tokens=[9000, None])
    assert long[0].prompt_tokens == CONTEXT - 32 and 32 <= long[1].prompt_tokens <= 256
    with pytest.raises(TestbedError, match="no room for a prompt"):
        draw_prompts("cnndm", count=1, seed=2, model_dir=TINY, max_new_tokens=CONTEXT)


def test_tiny_python_prompts_are_held_out_text_the_model_never_saw():
    training = json.loads((TINY / "training.json").read_text())
    assert corpus_sha256() == training["corpus"]["sha256"]  # this interpreter's stdlib is the one trained on
    every = training["hyperparameters"]["held_out_every"]
    seen = "\0".join(training_texts(every))
    prompts = draw_prompts("tiny-python", count=60, seed=5, model_dir=TINY, max_new_tokens=32)
    assert len({p.text for p in prompts}) == 60
    for p in prompts:
        _, path, line = p.source.split(":")
        assert is_held_out(path, every)
        lines = Path(stdlib_root(), path).read_text(encoding="utf-8").split("\n")
        rest = "\n".join(lines[int(line) - 1 :])  # the file from the snippet's first line on
        assert p.text.startswith(rest) if len(p.text) > len(rest) else rest.startswith(p.text)
        assert p.text not in seen


def test_synthetic_prompts_draw_again_when_the_text_was_in_training():
    # the held-out codec tables (encodings/cp857.py, ...) repeat runs of training codecs' lines
    every = json.loads((TINY / "training.json").read_text())["hyperparameters"]["held_out_every"]
    seen = "\0".join(training_texts(every))
    prompts = draw_prompts("specbench", count=150, seed=3, model_dir=TINY, max_new_tokens=32)
    assert all(p.text not in seen for p in prompts if p.prompt_tokens >= 16)


# -- prompt files --------------------------------------------------------------------------------


def test_jsonl_prompts_carry_their_expected_output_length(tmp_path, tokenizer):
    (tmp_path / "p.jsonl").write_text(
        '{"prompt": "def add(a, b):", "expected_output_tokens": 12}\n'
        "\n"
        '{"prompt": "class Stack:", "max_new_tokens": 5, "category": "code"}\n'
        '{"prompt": "import os"}\n'
    )
    prompts = draw_prompts("file:p.jsonl", count=6, seed=1, model_dir=TINY, max_new_tokens=20, base_dir=tmp_path)
    by_text = {p.text: p for p in prompts}
    assert {t: p.max_new_tokens for t, p in by_text.items()} == {
        "def add(a, b):": 12,
        "class Stack:": 5,
        "import os": 20,
    }
    assert by_text["class Stack:"].source == "file:p.jsonl:3"
    assert list(by_text["import os"].prompt_ids) == tokenizer.encode("import os")
    assert sorted(p.text for p in prompts) == sorted(2 * list(by_text))  # each once before any repeats


def test_csv_prompts_and_a_bad_line(tmp_path):
    good = tmp_path / "p.csv"
    good.write_text('prompt,expected_output_tokens\n"def f():\n    return 1",7\nwhile True:,\n')
    prompts = draw_prompts(f"file:{good}", count=2, seed=0, model_dir=TINY, max_new_tokens=9)
    assert sorted((p.text, p.max_new_tokens, p.source.rsplit(":", 1)[1]) for p in prompts) == [
        ("def f():\n    return 1", 7, "2"),
        ("while True:", 9, "4"),
    ]
    bad = tmp_path / "bad.csv"
    bad.write_text('prompt,expected_output_tokens\n"a\nb",3\n\nc,many\n')  # a multi-line cell, a blank line
    with pytest.raises(InputError) as caught:
        draw_prompts(f"file:{bad}", count=1, seed=0, model_dir=TINY, max_new_tokens=9)
    assert (caught.value.problems[0].line, caught.value.problems[0].field) == (5, "expected_output_tokens")
    assert f"{bad}:5" in str(caught.value)


def test_jsonl_bad_lines_name_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "x", "max_new_tokens": 3, "expected_output_tokens": 4}\n{oops\n')
    with pytest.raises(InputError) as caught:
        draw_prompts(f"file:{path}", count=1, seed=0, model_dir=TINY, max_new_tokens=9)
    assert [(p.line, p.field) for p in caught.value.problems] == [(2, "max_new_tokens"), (3, "")]
    path.write_text('{"prompt": "ok"}\n{"prompt": "x", "max_new_tokens": 3, "expected_output_tokens": 4}\n')
    with pytest.raises(
        InputError, match=r"p\.jsonl:2: max_new_tokens: both expected_output_tokens and max_new_tokens given"
    ):
        draw_prompts(f"file:{path}", count=1, seed=0, model_dir=TINY, max_new_tokens=9)
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(InputError, match=r"p\.jsonl:1: prompt"):
        draw_prompts(f"file:{path}", count=1, seed=0, model_dir=TINY, max_new_tokens=9)


def test_a_long_file_prompt_keeps_its_bos_and_its_end(tmp_path, tokenizer):
    text = " ".join(f"word{i}" for i in range(3000)) + " QUESTION"
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": text}) + "\n")
    (p,) = draw_prompts("file:p.jsonl", count=1, seed=0, model_dir=TINY, max_new_tokens=96, base_dir=tmp_path)
    assert p.prompt_tokens == CONTEXT - 96 < len(tokenizer.encode(text))
    assert p.prompt_ids[0] == tokenizer.bos_id and p.text.endswith("word2999 QUESTION")


# -- QoE -----------------------------------------------------------------------------------------


def test_qoe_presets_and_overrides():
    assert qoe_expectation("reading") == READING == QoeExpectation(1.0, 4.8)
    assert qoe_expectation("speaking") == SPEAKING == QoeExpectation(1.0, 3.3)
    assert qoe_expectation("speaking", expected_ttft_s=0.5) == QoeExpectation(0.5, 3.3)
    assert qoe_expectation("custom", 2.0, 10.0) == QoeExpectation(2.0, 10.0)
    assert qoe_expectation(None, 2.0, 10.0) == QoeExpectation(2.0, 10.0)
    with pytest.raises(TestbedError, match="expected_tds_tok_s"):
        qoe_expectation("custom", 2.0)
    with pytest.raises(TestbedError, match="unknown QoE preset"):
        qoe_expectation("listening")


def test_schedule_rows_carry_the_qoe_expectation():
    spec = WorkloadSpec(requests_per_device=3, qoe="speaking", expected_ttft_s=2.5)
    rows = build_schedules(spec, ["orin"], seed=0, model_dir=TINY)["orin"]
    assert {(r["expected_ttft_s"], r["expected_tds_tok_s"]) for r in rows} == {(2.5, 3.3)}


# -- workload spec and schedules -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"arrival": "gamma"}, "cv"),
        ({"arrival": "gamma", "cv": 0.0}, "cv"),
        ({"cv": 3.0}, "cv"),
        ({"rate_per_s": 0.0}, "rate_per_s"),
        ({"rate_per_s": None}, "rate_per_s"),
        ({"arrival": "bursty"}, "arrival"),
        ({"arrival": "trace"}, "trace"),
        ({"trace": "t.csv"}, "trace"),
        ({"arrival": "steps"}, "rate_steps"),
        ({"arrival": "steps", "rate_steps": [[1.0, 0.0]]}, "rate_steps"),
        ({"arrival": "steps", "rate_steps": [[1.0]]}, "rate_steps"),
        ({"rate_steps": [[1.0, 5.0]]}, "rate_steps"),
        ({"prompts": "wikipedia"}, "prompts"),
        ({"prompts": "file:"}, "prompts"),
        ({"requests_per_device": 0}, "requests_per_device"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"qoe": "custom", "expected_ttft_s": 1.0}, "expected_tds_tok_s"),
        ({"qoe": "listening"}, "qoe"),
        ({"expected_ttft_s": -1.0}, "expected_ttft_s"),
    ],
)
def test_workload_spec_problems(changes, field):
    assert [f for f, _ in WorkloadSpec(**changes).problems()] == [field]
    with pytest.raises(TestbedError, match=field):
        build_schedules(WorkloadSpec(**changes), ["orin"], seed=0, model_dir=TINY)


def test_valid_specs_have_no_problems():
    for spec in (
        WorkloadSpec(),
        WorkloadSpec(arrival="gamma", cv=3.0, prompts="specbench", qoe="speaking"),
        WorkloadSpec(arrival="trace", trace="t.csv", rate_per_s=None, prompts="file:p.jsonl"),
        WorkloadSpec(qoe="custom", expected_ttft_s=0.5, expected_tds_tok_s=8.0),
        WorkloadSpec(arrival="steps", rate_steps=[[1.0, 20.0], [6.0, 20.0]], rate_per_s=None),
    ):
        assert spec.problems() == []


def test_schedules_are_byte_identical_for_a_seed_and_differ_for_another(tmp_path):
    spec = WorkloadSpec(arrival="gamma", cv=3.0, rate_per_s=2.0, requests_per_device=6, prompts="specbench")
    first = build_schedules(spec, ["orin", "phone"], seed=7, model_dir=TINY)
    again = build_schedules(spec, ["orin", "phone"], seed=7, model_dir=TINY)
    other = build_schedules(spec, ["orin", "phone"], seed=8, model_dir=TINY)
    for device in ("orin", "phone"):
        a, b = tmp_path / f"a-{device}.jsonl", tmp_path / f"b-{device}.jsonl"
        assert write_schedule(first[device], a) == schedule_digest(first[device])
        write_schedule(again[device], b)
        assert a.read_bytes() == b.read_bytes()
        assert schedule_digest(other[device]) != schedule_digest(first[device])
    assert schedule_digest(first["orin"]) != schedule_digest(first["phone"])  # independent streams
    ids = [r["request_id"] for rows in first.values() for r in rows]
    assert len(set(ids)) == len(ids)
    # a device's schedule does not depend on which other devices there are
    alone = build_schedules(spec, ["phone"], seed=7, model_dir=TINY)["phone"]
    assert [r["arrival_s"] for r in alone] == [r["arrival_s"] for r in first["phone"]]
    assert [r["prompt_ids"] for r in alone] == [r["prompt_ids"] for r in first["phone"]]


def test_schedules_do_not_depend_on_the_python_hash_seed(tmp_path):
    code = (
        "from workloads.schedule import WorkloadSpec, build_schedules, schedule_digest;"
        f"s = build_schedules(WorkloadSpec(requests_per_device=4), ['orin'], seed=3, model_dir={str(TINY)!r});"
        "print(schedule_digest(s['orin']))"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for hash_seed in ("1", "2")
    }
    here = schedule_digest(
        build_schedules(WorkloadSpec(requests_per_device=4), ["orin"], seed=3, model_dir=TINY)["orin"]
    )
    assert digests == {here}


def test_device_workers_read_the_schedule_file(tmp_path):
    spec = WorkloadSpec(rate_per_s=5.0, requests_per_device=5, max_new_tokens=7)
    rows = build_schedules(spec, ["orin", "phone"], seed=1, model_dir=TINY)["phone"]
    write_schedule(rows, tmp_path / "phone.jsonl")
    requests = load_schedule(str(tmp_path / "phone.jsonl"))
    assert [(r.request_id, r.arrival_s, r.prompt_ids, r.max_new_tokens) for r in requests] == [
        (r["request_id"], r["arrival_s"], r["prompt_ids"], 7) for r in rows
    ]
    assert [r.request_id for r in requests] == list(range(1_000_000, 1_000_005))
    assert all(r["arrival_s"] == round(r["arrival_s"], 6) for r in rows)


@pytest.mark.parametrize(("name", "mean", "groups"), [("reading", 4.8, 5), ("speaking", 3.3, 4)])
def test_expected_speeds_are_drawn_from_the_andes_tables_at_the_presets_mean(name: str, mean: float, groups: int) -> None:
    from workloads.qoe import draw_expected_tds

    drawn = draw_expected_tds(name, np.random.default_rng(3), 40_000)
    assert drawn.mean() == pytest.approx(mean, rel=0.01)
    assert len(np.unique(drawn)) == groups  # speaking: English and Korean share 150 words/min
    # the commonest group is the most drawn: 25-44 year olds (51.9%) read at 200 words/min; English 79.3%
    _, counts = np.unique(drawn, return_counts=True)
    assert counts.max() / len(drawn) == pytest.approx(0.519 if name == "reading" else 0.793 + 0.069, abs=0.01)


def test_output_lengths_follow_sharegpt_and_multiround_inputs_are_capped_at_1k() -> None:
    from workloads.prompts import draw_output_lengths, draw_prompt_lengths

    outputs = np.array(draw_output_lengths("sharegpt", count=20_000, seed=1, max_new_tokens=100_000))
    assert outputs.mean() == pytest.approx(337.99, rel=0.03) and outputs.min() >= 1
    capped = np.array(draw_output_lengths("sharegpt", count=2000, seed=1, max_new_tokens=256))
    assert capped.max() == 256 and (capped <= 256).all()
    multi = np.array(draw_prompt_lengths("sharegpt-multiround", count=20_000, seed=2))
    single = np.array(draw_prompt_lengths("sharegpt", count=20_000, seed=2))
    assert multi.max() == 1024 and 2.4 < multi.mean() / single.mean() < 3.0  # 3x before the 1k cap
    with pytest.raises(TestbedError, match="unknown set 'vicuna'"):
        draw_output_lengths("vicuna", count=1, seed=1, max_new_tokens=8)


def test_a_schedule_draws_each_requests_output_length_and_speed() -> None:
    spec = WorkloadSpec(prompts="sharegpt", output_lengths="sharegpt", max_new_tokens=300, requests_per_device=40,
                        qoe="speaking", qoe_draw=True)  # fmt: skip
    rows = build_schedules(spec, ["orin", "xavier"], seed=4, model_dir=TINY)
    lengths = [r["max_new_tokens"] for r in rows["orin"]]
    assert len(set(lengths)) > 10 and max(lengths) <= 300 and min(lengths) >= 1
    mean_wpm = 0.793 * 150 + 0.070 * 158 + 0.069 * 150 + 0.036 * 195 + 0.032 * 218  # Andes Table 2
    speeds = {r["expected_tds_tok_s"] for r in rows["orin"]}
    assert len(speeds) > 1 and speeds <= {round(3.3 * w / mean_wpm, 6) for w in (150, 158, 195, 218)}
    assert [r["max_new_tokens"] for r in rows["xavier"]] != lengths  # each device its own draws
    assert ("output_lengths", "unknown output length set 'none'; choose one of sharegpt, alpaca") in \
        WorkloadSpec(output_lengths="none").problems()
    assert any(field == "qoe_draw" for field, _ in WorkloadSpec(qoe="custom", expected_ttft_s=1.0,
                                                                 expected_tds_tok_s=4.0, qoe_draw=True).problems())


# -- task prompts for a pretrained model ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from testbed.models.packaged import PACKAGED, up_to_date

    model = PACKAGED["smollm2-135m"]
    if not up_to_date(model):
        pytest.fail(f"SmolLM2-135M is not imported; fetch it: {model.fetch_command}")
    return model.directory


def test_a_pretrained_model_gets_tasks_over_prose_of_exactly_the_drawn_lengths_in_its_chat_template(smollm2):
    from workloads.task_prompts import CATEGORIES, prose_corpus

    prompts = draw_prompts("specbench", count=240, seed=5, model_dir=smollm2, max_new_tokens=64)
    drawn = draw_prompt_lengths("specbench", count=240, seed=5, max_prompt_tokens=8192 - 64)
    tokenizer = load_tokenizer(smollm2)
    start, assistant = tokenizer.encode("<|im_start|>system\n"), tokenizer.encode("<|im_start|>assistant\n")
    categories = [p.source.split(":")[1] for p in prompts]
    for p, length in zip(prompts, drawn, strict=True):
        assert len(p.prompt_ids) == p.prompt_tokens
        assert list(p.prompt_ids[: len(start)]) == start and list(p.prompt_ids[-len(assistant) :]) == assistant
        if p.source.endswith(":short-question"):  # a draw shorter than the task's fixed part
            assert length <= p.prompt_tokens <= 64
        else:
            assert p.prompt_tokens == length
    # SpecBench's Gamma puts a sixth of its draws below SmolLM2's chat template with its system prompt
    assert sum(s.endswith(":short-question") for s in (p.source for p in prompts)) < 0.25 * len(prompts)
    # the six categories in about equal shares; short draws take the shortest instruction ("explain")
    drawn_categories = [c for c in categories if c in CATEGORIES]
    assert all(drawn_categories.count(c) >= 0.6 * len(drawn_categories) / 6 for c in CATEGORIES), categories
    # the text is the reference's prose, named by its digest; the same seed gives the same prompts
    assert all(p.source.split(":")[3] == f"prose-{prose_corpus().sha256[:12]}" for p in prompts)
    assert "statement" in " ".join(p.text for p in prompts) and "def " not in prompts[0].text[:20]
    again = draw_prompts("specbench", count=240, seed=5, model_dir=smollm2, max_new_tokens=64)
    assert [p.prompt_ids for p in again] == [p.prompt_ids for p in prompts]
    articles = draw_prompts("cnndm", count=30, seed=5, model_dir=smollm2, max_new_tokens=64)
    assert all(p.source.startswith("cnndm:article:") and "Summarize the following article." in p.text
               for p in articles)  # fmt: skip
    # the tiny model, trained here on code, still reads held-out code
    assert ".py:" in draw_prompts("specbench", count=1, seed=5, model_dir=TINY, max_new_tokens=8)[0].source


def test_task_prompts_of_one_topic_split_never_read_the_other_splits_topics(smollm2):
    """A draft adapter trains on the "training" topics and is measured on the "held-out" ones."""
    from workloads.task_prompts import held_out_topic, prose_corpus

    splits = {name: {topic for topic, _ in prose_corpus(name).topics} for name in ("training", "held-out")}
    everything = {topic for topic, _ in prose_corpus().topics}
    assert splits["training"] | splits["held-out"] == everything and not splits["training"] & splits["held-out"]
    assert 0.15 < len(splits["held-out"]) / len(everything) < 0.35
    for name in ("training", "held-out"):
        mine = {topic for topic, _ in prose_corpus(name).topics}
        other = [para for topic, text in prose_corpus().topics if topic not in mine for para in text.split("\n\n")
                 if len(para) > 120 and para not in "\n\n".join(t for _, t in prose_corpus(name).topics)]  # fmt: skip
        for p in draw_prompts("specbench", count=40, seed=3, model_dir=smollm2, max_new_tokens=32, topics=name):
            topic = p.source.split(":")[2]
            assert topic == "gsm8k-like" or held_out_topic(topic) == (name == "held-out"), p.source
            assert p.source.split(":")[3] == f"prose-{prose_corpus(name).sha256[:12]}"
            assert not any(para in p.text for para in other), p.source
    with pytest.raises(TestbedError, match="no topic split"):
        draw_prompts("specbench", count=2, seed=3, model_dir=smollm2, max_new_tokens=32, topics="test")
