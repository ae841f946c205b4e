"""Prompt sources: what each request asks, as token ids fixed on the controller.

A prompt set is one of

- ``tiny-python``: real text for the tiny model, snippets of the standard-library files its
  training held out (:mod:`workloads.corpus`), 32 to 256 tokens (uniform);
- ``specbench``, ``cnndm``, ``alpaca``, ``sharegpt``: sets whose prompt *lengths* follow published
  statistics (table below), filled with the same held-out text for a model trained here (its
  ``training.json``), and for a pretrained one (SmolLM2, Vicuna) with tasks over English prose in the
  model's chat template (:mod:`workloads.task_prompts`: SpecBench's six categories, CNN/DM-like
  summaries);
- ``file:<path>``: a user's prompts, JSON lines or CSV (see :func:`load_prompt_file`).

Every prompt is tokenized here with the model's tokenizer (BOS as the tokenizer adds it) and cut to
the model's context: ``prompt_tokens <= max_position_embeddings - max_new_tokens``, where
``prompt_tokens = len(prompt_ids)`` counts the BOS. A snippet starts at a uniformly drawn non-blank
line of the held-out text and runs on (into the next file, in sorted order, where it needs to); a
snippet that occurs verbatim in a training file is drawn again (up to 16 times: a few-token
snippet cannot avoid text the model has seen).

Length models. The prompt length is Gamma-distributed with the published mean and standard
deviation (method of moments: shape k = (mean/std)², scale = std²/mean), rounded to whole tokens
and at least one text token. A lognormal was rejected: no lognormal reaches SpecBench's
P90/mean = 2.54 (its maximum is exp(1.2816²/2) = 2.27), and one fitted to mean and std puts the
P90s at 745 and 1692 (-16 %, -4.5 %). The Gamma leaves the P90s 3.8 % and 2.8 % low; no common
unimodal family matches all three statistics (CNN/DM's P90 lies 1.44 std above its mean, more than
any Gamma's 1.34 or a uniform's 1.39).

| set | mean | std | P90 | Gamma P90 | source |
|---|---|---|---|---|---|
| specbench | 351.2 | 397.3 | 891 | 857 | HAT (Xie et al.), Table 3, Vicuna-7B tokenizer |
| cnndm | 1036.6 | 511.8 | 1772 | 1723 | HAT (Xie et al.), Table 3, Vicuna-13B tokenizer |
| sharegpt | 161.31 | 161.31 (CV 1, assumed) | - | 371 | vLLM (Kwon et al., SOSP 2023) §6.1, Fig. 11a |
| alpaca | 19.31 | 9.66 (CV 0.5, assumed) | - | 32 | vLLM (Kwon et al., SOSP 2023) §6.1, Fig. 11b |
| sharegpt-multiround | 483.93 (3x ShareGPT) | 483.93 (CV 1, assumed), cap 1024 | - | - | Andes (Liu et al.) §6.1 |

Output lengths (``workload.output_lengths``) follow ShareGPT's (mean 337.99, CV 1 assumed) or
Alpaca's (58.45, CV 0.5 assumed) outputs from the same figure, capped by ``max_new_tokens``.

For ShareGPT and Alpaca only the mean input length is published there (ShareGPT's prompts are 8.4x
Alpaca's on average); the spread is an assumption, hence "ShareGPT-like" and "Alpaca-like".
The lengths were measured with other tokenizers than the tiny model's; they are used as token
counts of the model at hand.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from foundation.errors import InputError, InputProblem, TestbedError
from workloads.corpus import Corpus, held_out_corpus, held_out_every
from workloads.task_prompts import ChatRenderer, draw_category, task_prompt
from workloads.tokenizer import PromptTokenizer, load_tokenizer

MAX_PROMPTS = 100_000
TINY_PYTHON_TOKENS = (32, 256)  # inclusive range of the tiny-python snippets' lengths
FILE_PREFIX = "file:"
OUTPUT_FIELDS = ("expected_output_tokens", "max_new_tokens")
UNSEEN_ATTEMPTS = 16


@dataclass(frozen=True)
class LengthModel:
    """A prompt-length distribution: Gamma with the given mean and standard deviation, in tokens."""

    mean_tokens: float
    std_tokens: float
    p90_tokens: float | None  # published, for reference; not fitted
    source: str
    cap_tokens: int | None = None  # no draw is longer (a set built with a cap)

    @property
    def shape(self) -> float:
        return (self.mean_tokens / self.std_tokens) ** 2

    @property
    def scale_tokens(self) -> float:
        return self.std_tokens**2 / self.mean_tokens

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        drawn = rng.gamma(self.shape, self.scale_tokens, size=count)
        return drawn if self.cap_tokens is None else np.minimum(drawn, self.cap_tokens)


LENGTH_MODELS: dict[str, LengthModel] = {
    "specbench": LengthModel(351.2, 397.3, 891.0, "HAT (Xie et al.) Table 3"),
    "cnndm": LengthModel(1036.6, 511.8, 1772.0, "HAT (Xie et al.) Table 3"),
    "sharegpt": LengthModel(161.31, 161.31, None, "vLLM (Kwon et al., SOSP 2023) Fig. 11a; CV 1 assumed"),
    "alpaca": LengthModel(19.31, 0.5 * 19.31, None, "vLLM (Kwon et al., SOSP 2023) Fig. 11b; CV 0.5 assumed"),
    # Andes Sec. 6.1: earlier rounds of a conversation concatenated into the input, capped at 1k
    # tokens; inputs about 3x ShareGPT's (mean 3 x 161.31, CV 1 assumed before the cap)
    "sharegpt-multiround": LengthModel(483.93, 483.93, None, "Andes (Liu et al.) Sec. 6.1; CV 1 assumed",
                                       cap_tokens=1024),
}
PROMPT_SETS = ("tiny-python", *LENGTH_MODELS)
# Output lengths (a request's max_new_tokens), drawn per request where a workload names a set here;
# ShareGPT's outputs are 5.8x Alpaca's (vLLM Fig. 11), Multi-Round ShareGPT's are ShareGPT's (Andes)
OUTPUT_LENGTH_MODELS: dict[str, LengthModel] = {
    "sharegpt": LengthModel(337.99, 337.99, None, "vLLM (Kwon et al., SOSP 2023) Fig. 11a; CV 1 assumed"),
    "alpaca": LengthModel(58.45, 0.5 * 58.45, None, "vLLM (Kwon et al., SOSP 2023) Fig. 11b; CV 0.5 assumed"),
}


def draw_output_lengths(output_set: str, *, count: int, seed: int, max_new_tokens: int) -> list[int]:
    """``count`` output lengths from ``output_set``'s length model, each 1 to ``max_new_tokens``."""
    if output_set not in OUTPUT_LENGTH_MODELS:
        raise TestbedError(f"output_lengths: unknown set {output_set!r}; one of {', '.join(OUTPUT_LENGTH_MODELS)}")
    drawn = OUTPUT_LENGTH_MODELS[output_set].sample(np.random.Generator(np.random.PCG64(seed)), count)
    return [int(min(max(round(x), 1), max_new_tokens)) for x in drawn]


@dataclass(frozen=True)
class Prompt:
    prompt_ids: tuple[int, ...]
    text: str
    prompt_tokens: int  # len(prompt_ids), BOS included
    max_new_tokens: int
    source: str  # "<set>:<held-out file>:<line>" or "file:<path>:<line>"


@dataclass(frozen=True)
class FilePrompt:
    text: str
    max_new_tokens: int | None
    line: int


def prompt_set_problem(prompt_set: str) -> str | None:
    """Why ``prompt_set`` is not a prompt set, or None."""
    if not isinstance(prompt_set, str):
        return f"{prompt_set!r} is not a prompt set name"
    if prompt_set.startswith(FILE_PREFIX):
        return None if prompt_set[len(FILE_PREFIX) :].strip() else "'file:' needs a path after it"
    if prompt_set not in PROMPT_SETS:
        return f"unknown prompt set {prompt_set!r}; choose one of {', '.join(PROMPT_SETS)} or file:<path>"
    return None


def draw_prompt_lengths(
    prompt_set: str, *, count: int, seed: int, max_prompt_tokens: int | None = None, min_prompt_tokens: int = 1
) -> list[int]:
    """The lengths (tokens, BOS included) that :func:`draw_prompts` gives the same set and seed."""
    _check_count(count)
    rng = np.random.Generator(np.random.PCG64(seed))
    return _lengths(prompt_set, rng, count, min_prompt_tokens, max_prompt_tokens or math.inf)


def draw_prompts(
    prompt_set: str,
    *,
    count: int,
    seed: int,
    model_dir: str | Path,
    max_new_tokens: int,
    base_dir: Path | None = None,
    prompt_tokens: Sequence[int | None] | None = None,
    max_new_tokens_per_request: Sequence[int | None] | None = None,
    topics: str = "all",
) -> list[Prompt]:
    """``count`` prompts, the same for the same arguments.

    ``topics`` picks the reference topics a pretrained model's task prompts are made from ("all",
    "training" or "held-out": :func:`workloads.task_prompts.held_out_topic`), so that a draft adapter
    trained on one split is measured on the other.

    ``prompt_tokens`` (e.g. from a trace) sets a request's length (BOS included; for ``file:`` sets
    it caps the length). A request's output length is, first found: ``max_new_tokens_per_request``,
    the prompt file's ``expected_output_tokens``/``max_new_tokens``, ``max_new_tokens``.
    """
    _check_count(count)
    problem = prompt_set_problem(prompt_set)
    if problem:
        raise TestbedError(f"prompts: {problem}")
    for name, values in (("prompt_tokens", prompt_tokens), ("max_new_tokens_per_request", max_new_tokens_per_request)):
        if values is not None and len(values) != count:
            raise TestbedError(f"prompts: {name} has {len(values)} entries for {count} requests")
    model = _model(str(Path(model_dir).resolve()))
    rng = np.random.Generator(np.random.PCG64(seed))
    outputs = [
        _output_tokens(model, (max_new_tokens_per_request or [None] * count)[i], None, max_new_tokens)
        for i in range(count)
    ]
    if prompt_set.startswith(FILE_PREFIX):
        overrides = max_new_tokens_per_request
        return _file_prompts(prompt_set, model, rng, count, outputs, prompt_tokens, overrides, base_dir)
    lengths = _lengths(prompt_set, rng, count, model.min_prompt_tokens, math.inf)
    if prompt_set in LENGTH_MODELS and not model.trained_here:  # a pretrained model reads tasks over prose
        return _task_prompts(prompt_set, model, rng, lengths, prompt_tokens, outputs, topics)
    corpus = held_out_corpus(model.held_out_every)
    out = []
    for i in range(count):
        wanted = lengths[i] if prompt_tokens is None or prompt_tokens[i] is None else prompt_tokens[i]
        length = min(max(int(wanted), model.min_prompt_tokens), model.context_tokens - outputs[i])
        for _ in range(UNSEEN_ATTEMPTS):
            start = corpus.line_starts[corpus.nonblank_lines[int(rng.integers(len(corpus.nonblank_lines)))]]
            prompt = _corpus_prompt(prompt_set, model, corpus, start, length, outputs[i])
            if not corpus.seen_in_training(start, prompt.text):
                break
        out.append(prompt)
    return out


def context_tokens(model_dir: str | Path) -> int:
    """The model's context (``max_position_embeddings`` in its ``config.json``), in tokens."""
    return _model(str(Path(model_dir).resolve())).context_tokens


def load_prompt_file(path: str | Path) -> list[FilePrompt]:
    """A user's prompts: JSON lines (``.jsonl``/``.ndjson``) or CSV with a header (``.csv``).

    Each record has ``prompt`` (non-empty text) and optionally ``expected_output_tokens`` or
    ``max_new_tokens`` (a positive integer; give at most one). Other fields are ignored. Problems
    name the file and line.
    """
    name, suffix = str(path), Path(path).suffix.lower()
    if suffix not in (".jsonl", ".ndjson", ".csv"):
        raise InputError([InputProblem(name, None, "", f"unknown prompt file type {suffix or '(none)'!r}",
                                       "give a .jsonl (one JSON object per line) or a .csv file")])  # fmt: skip
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InputError([InputProblem(name, None, "", f"cannot read the prompts ({error})")]) from None
    problems: list[InputProblem] = []
    read = _csv_records if suffix == ".csv" else _jsonl_records
    records = read(name, text, problems)
    out: list[FilePrompt] = []
    for line, record in records:
        prompt = record.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            problems.append(InputProblem(name, line, "prompt", "missing or empty", "every record needs its text"))
            continue
        given = [f for f in OUTPUT_FIELDS if record.get(f) not in (None, "")]
        if len(given) > 1:
            problems.append(InputProblem(name, line, given[1], f"both {' and '.join(given)} given", "give one"))
            continue
        tokens = _positive_int(record[given[0]]) if given else None
        if given and tokens is None:
            problems.append(InputProblem(name, line, given[0], f"{record[given[0]]!r} is not a positive integer"))
            continue
        out.append(FilePrompt(prompt, tokens, line))
    if problems:
        raise InputError(sorted(problems, key=lambda p: p.line or 0))
    if not out:
        raise InputError([InputProblem(name, None, "", "no prompts in the file")])
    return out


# -- internals ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Model:
    directory: str
    tokenizer: PromptTokenizer
    context_tokens: int
    held_out_every: int
    trained_here: bool  # by scripts/train_tiny.py (its training.json): it reads the held-out code

    @property
    def add_bos(self) -> bool:
        return bool(self.tokenizer.add_bos)

    @property
    def min_prompt_tokens(self) -> int:
        return 2 if self.add_bos else 1  # at least one text token


@lru_cache(maxsize=8)
def _model(directory: str) -> _Model:
    config_path = Path(directory) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        context = int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise TestbedError(f"{config_path}: cannot read max_position_embeddings ({error})") from None
    trained_here = (Path(directory) / "training.json").is_file()
    return _Model(directory, load_tokenizer(directory), context, held_out_every(directory), trained_here)


def _task_prompts(prompt_set: str, model: _Model, rng: np.random.Generator, lengths: list[int],
                  prompt_tokens: Sequence[int | None] | None, outputs: list[int],
                  topics: str) -> list[Prompt]:  # fmt: skip
    """Tasks over prose (:mod:`workloads.task_prompts`) of the drawn lengths, in the model's chat template."""
    renderer = ChatRenderer(model.tokenizer.chat_template)
    bos = [model.tokenizer.bos_id] if model.add_bos and model.tokenizer.bos_id is not None else []
    out = []
    for i, drawn in enumerate(lengths):
        wanted = drawn if prompt_tokens is None or prompt_tokens[i] is None else prompt_tokens[i]
        length = min(max(int(wanted), model.min_prompt_tokens), model.context_tokens - outputs[i])
        made = task_prompt(draw_category(prompt_set, rng), length, rng, lambda t: model.tokenizer.encode(t, bos=False),
                           model.tokenizer.decode, renderer, bos, topics)  # fmt: skip
        if len(made.ids) > model.context_tokens - outputs[i]:
            raise TestbedError(f"prompts: a {len(made.ids)}-token question leaves no room for {outputs[i]} new tokens "
                               f"in the model's context of {model.context_tokens}")  # fmt: skip
        out.append(Prompt(made.ids, made.text, len(made.ids), outputs[i], f"{prompt_set}:{made.source}"))
    return out


def _check_count(count: int) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_PROMPTS:
        raise TestbedError(f"prompts: count must be an integer from 1 to {MAX_PROMPTS}, not {count!r}")


def _lengths(prompt_set: str, rng: np.random.Generator, count: int, low: int, high: float) -> list[int]:
    if prompt_set == "tiny-python":
        raw = rng.integers(TINY_PYTHON_TOKENS[0], TINY_PYTHON_TOKENS[1] + 1, size=count).astype(float)
    elif prompt_set in LENGTH_MODELS:
        raw = LENGTH_MODELS[prompt_set].sample(rng, count)
    else:
        raise TestbedError(f"prompts: {prompt_set!r} has no length model")
    return [int(min(max(round(x), low), high)) for x in raw]


def _output_tokens(model: _Model, override: int | None, from_file: int | None, default: int) -> int:
    tokens = override if override is not None else from_file if from_file is not None else default
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise TestbedError(f"prompts: max_new_tokens must be a positive integer, not {tokens!r}")
    if tokens > model.context_tokens - model.min_prompt_tokens:
        raise TestbedError(
            f"prompts: max_new_tokens {tokens} leaves no room for a prompt in the model's context of "
            f"{model.context_tokens} tokens ({model.directory}/config.json max_position_embeddings)"
        )
    return tokens


def _corpus_prompt(prompt_set: str, model: _Model, corpus: Corpus, start: int, length: int, outputs: int) -> Prompt:
    """``length`` tokens (BOS included) of held-out text from character ``start``."""
    body = length - (1 if model.add_bos else 0)
    chars = 8 * body + 256
    while True:
        ids = model.tokenizer.encode(corpus.window(start, chars), bos=False)
        if len(ids) > body + 8 or chars >= len(corpus.text):  # a margin: the window's cut word is dropped
            break
        chars *= 2
    if len(ids) < body:
        raise TestbedError(f"the held-out corpus has {len(ids)} tokens, fewer than a {length}-token prompt needs")
    ids = ids[:body]
    prompt_ids = ([model.tokenizer.bos_id] if model.add_bos else []) + ids
    path, line = corpus.locate(start)
    text = model.tokenizer.decode(ids)
    return Prompt(tuple(prompt_ids), text, len(prompt_ids), outputs, f"{prompt_set}:{path}:{line}")


def _file_prompts(
    prompt_set: str,
    model: _Model,
    rng: np.random.Generator,
    count: int,
    outputs: list[int],
    prompt_tokens: Sequence[int | None] | None,
    overrides: Sequence[int | None] | None,
    base_dir: Path | None,
) -> list[Prompt]:
    """Prompts from a user's file: a seeded shuffle, repeated when more are asked for than it has.

    A prompt longer than the context allows keeps its BOS and its last tokens (the end of a chat
    prompt holds the question; vLLM's chatbot experiment cuts prompts the same way).
    """
    given = prompt_set[len(FILE_PREFIX) :].strip()
    path = Path(given).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    records = load_prompt_file(path)
    order = np.concatenate([rng.permutation(len(records)) for _ in range(-(-count // len(records)))])[:count]
    out = []
    for i, index in enumerate(order):
        record = records[int(index)]
        override = None if overrides is None else overrides[i]
        try:
            tokens = _output_tokens(model, override, record.max_new_tokens, outputs[i])
        except TestbedError as error:
            raise InputError([InputProblem(str(path), record.line, "max_new_tokens", str(error))]) from None
        ids = model.tokenizer.encode(record.text)
        limit = model.context_tokens - tokens
        if prompt_tokens is not None and prompt_tokens[i] is not None:
            limit = min(limit, max(int(prompt_tokens[i]), model.min_prompt_tokens))
        text = record.text
        if len(ids) > limit:
            head = [model.tokenizer.bos_id] if model.add_bos else []
            ids = head + ids[len(ids) - (limit - len(head)) :]
            text = model.tokenizer.decode(ids)
        out.append(Prompt(tuple(ids), text, len(ids), tokens, f"{FILE_PREFIX}{given}:{record.line}"))
    return out


def _jsonl_records(name: str, text: str, problems: list[InputProblem]) -> list[tuple[int, dict]]:
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            problems.append(InputProblem(name, number, "", f"not JSON ({error})", "one JSON object per line"))
            continue
        if not isinstance(record, dict):
            problems.append(InputProblem(name, number, "", "not a JSON object", 'write {"prompt": "..."}'))
            continue
        records.append((number, record))
    return records


def _csv_records(name: str, text: str, problems: list[InputProblem]) -> list[tuple[int, dict]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = [c.strip() for c in next(reader, [])]
        if "prompt" not in header:
            hint = f"columns: prompt and optionally {' or '.join(OUTPUT_FIELDS)}"
            raise InputError([InputProblem(name, 1, "header", "no 'prompt' column", hint)])
        records = []
        while True:
            line = reader.line_num + 1  # where the next record starts (a quoted cell may span lines)
            cells = next(reader, None)
            if cells is None:
                return records
            if not any(c.strip() for c in cells):
                continue
            if len(cells) > len(header):
                problems.append(InputProblem(name, line, "", f"{len(cells)} cells for {len(header)} columns"))
                continue
            records.append((line, dict(zip(header, cells + [""] * (len(header) - len(cells)), strict=True))))
    except csv.Error as error:
        raise InputError([InputProblem(name, reader.line_num, "", f"not CSV ({error})")]) from None


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 1 else None
    if isinstance(value, float) and value.is_integer():
        return int(value) if value >= 1 else None
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            return None
        return number if number >= 1 else None
    return None
