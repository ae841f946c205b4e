"""Prompts of real tasks over real text, for pretrained models (SmolLM2, Vicuna): what the
SpecBench-like and CNN/DM-like sets hold when the model reads English, not the tiny model's code.

No dataset can be downloaded at run time, so the text is one that every CPython carries: the Python
Language Reference's topics (``pydoc_data.topics``, the pages ``help()`` shows: 79 topics, about 465,000
characters of English prose with code examples). Its digest goes with every prompt's source, so a
schedule says which text it was built from (it changes only with the Python version).

- **SpecBench-like** (Xia et al., 2024: six categories, 80 prompts each): a request draws its category
  with equal odds: multi-turn conversation, translation, summarization, question answering,
  mathematical reasoning (GSM8K-like word problems generated from the seed, with worked examples before
  the question), retrieval-augmented generation (several passages, then a question).
- **CNN/DM-like**: summarization of one long passage ("Summarize the following article").
- ShareGPT-, Alpaca- and multi-round-ShareGPT-like lengths take the SpecBench-like mix.

Each prompt has exactly the drawn length: the task's instruction and the chat template around it
(the model's own, from ``tokenizer_config.json``, rendered with a sandboxed Jinja) are kept whole and
the passages are cut to fill the rest, token by token. A draw shorter than its category's fixed part
(the chat template and instruction, 40-70 tokens with SmolLM2's default system prompt) takes the
shortest instruction instead ("Explain this:", category ``explain``); one shorter still becomes a
bare question, longer than drawn, and its source says so (``short-question``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from foundation.errors import TestbedError
from nodes.contracts.chat_template import ChatTemplate, ChatTemplateError, plain_chat

CATEGORIES = ("multi-turn", "translation", "summarization", "question-answering", "math", "rag")
PASSAGE_MARK = "\x00passage\x00"  # where a task's passage goes, in the rendered text
MIN_PASSAGE_TOKENS = 8
PASSAGE_CHARS = 20_000  # a passage's text before it is cut to the prompt's length (about 4,500 tokens)
LANGUAGES = ("French", "German", "Spanish", "Italian")
TOPIC_SPLITS = ("all", "training", "held-out")  # which reference topics prompts are made from
HELD_OUT_EVERY = 4


@dataclass(frozen=True)
class ProseCorpus:
    """The reference topics, in sorted order: (topic, text) and their joined text's digest."""

    topics: tuple[tuple[str, str], ...]
    sha256: str


def held_out_topic(name: str) -> bool:
    """Whether a topic is in the held-out split (one in :data:`HELD_OUT_EVERY`, by its name's hash): a
    draft adapter trains on the other topics and its acceptance is measured on these."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


@lru_cache(maxsize=len(TOPIC_SPLITS))
def prose_corpus(split: str = "all") -> ProseCorpus:
    """The topics of ``split`` (:data:`TOPIC_SPLITS`); passages run on only within them."""
    if split not in TOPIC_SPLITS:
        raise TestbedError(f"no topic split {split!r} (one of {', '.join(TOPIC_SPLITS)})")
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # pragma: no cover - part of every CPython
        raise TestbedError(f"this Python has no pydoc_data.topics ({error}): no prose for task prompts") from None
    wanted = {name for name in topics if split == "all" or held_out_topic(name) == (split == "held-out")}
    pairs = tuple(
        sorted((name, text.strip() + "\n") for name, text in topics.items() if text.strip() and name in wanted)
    )
    digest = hashlib.sha256("\0".join(f"{n}\0{t}" for n, t in pairs).encode()).hexdigest()
    return ProseCorpus(pairs, digest)


@dataclass(frozen=True)
class TaskPrompt:
    ids: tuple[int, ...]
    text: str
    source: str  # "<category>:<topic>" (+ ":short-question" when longer than drawn)


@dataclass(frozen=True)
class _Task:
    category: str
    messages: list[dict[str, str]]  # the chat, one of them holding PASSAGE_MARK
    passages: list[str]  # what PASSAGE_MARK is filled from, joined in order
    topic: str


class ChatRenderer:
    """The model's chat template (:mod:`nodes.contracts.chat_template`), or plain ``User:``/``Assistant:``
    paragraphs for a model without one (``plain_chat``, as the chat route renders them)."""

    def __init__(self, template: str | None) -> None:
        try:
            self._template = ChatTemplate(template) if template else None
        except ChatTemplateError as error:
            raise TestbedError(str(error)) from None

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._template is None:
            return plain_chat(messages)
        try:
            return self._template.render(messages)
        except ChatTemplateError as error:
            raise TestbedError(str(error)) from None


def _passage(rng: np.random.Generator, corpus: ProseCorpus) -> tuple[str, str]:
    """A topic and :data:`PASSAGE_CHARS` of text from one of its paragraph boundaries on (running into
    the next topics)."""
    index = int(rng.integers(len(corpus.topics)))
    name, text = corpus.topics[index]
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    start = int(rng.integers(max(1, len(paragraphs) // 2)))
    parts, chars, following = ["\n\n".join(paragraphs[start:])], 0, index
    while (chars := chars + len(parts[-1])) < PASSAGE_CHARS:
        following = (following + 1) % len(corpus.topics)
        parts.append(corpus.topics[following][1])
    return name, "\n\n".join(parts)[:PASSAGE_CHARS]


def _math_problem(rng: np.random.Generator) -> tuple[str, str]:
    """A GSM8K-like word problem and its worked answer."""
    a, b, c = (int(v) for v in rng.integers(2, 60, size=3))
    kind = int(rng.integers(4))
    if kind == 0:
        return (f"A baker makes {a} loaves in the morning and {b} more in the afternoon than in the morning. How many "
                f"loaves does the baker make in total?",
                f"The afternoon has {a} + {b} = {a + b} loaves. In total {a} + {a + b} = {2 * a + b}. "
                f"The answer is {2 * a + b}.")  # fmt: skip
    if kind == 1:
        return (f"Sara reads {a} pages a day for {c} days, then {b} pages on the last day. How many pages does she "
                "read?",
                f"{a} x {c} = {a * c} pages, plus {b} is {a * c + b}. The answer is {a * c + b}.")  # fmt: skip
    if kind == 2:
        total = a * c
        return (f"A class of {c} students shares {total} pencils equally. How many pencils does each student get?",
                f"{total} / {c} = {a}. The answer is {a}.")  # fmt: skip
    return (f"A tank holds {a + b + c} litres. {a} litres leak out and {b} are used. How many litres are left?",
            f"{a + b + c} - {a} - {b} = {c}. The answer is {c}.")  # fmt: skip


def _user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _task(category: str, rng: np.random.Generator, corpus: ProseCorpus) -> _Task:
    topic, text = _passage(rng, corpus)
    mark = PASSAGE_MARK
    if category == "summarization":
        return _Task(category, _user(f"Summarize the following text in a few sentences.\n\n{mark}"), [text], topic)
    if category == "article":
        return _Task(category, _user(f"Summarize the following article.\n\nArticle: {mark}\n\nSummary:"), [text], topic)
    if category == "translation":
        language = LANGUAGES[int(rng.integers(len(LANGUAGES)))]
        return _Task(category, _user(f"Translate the following text into {language}.\n\n{mark}"), [text], topic)
    if category == "question-answering":
        question = f'According to the passage, what does the "{topic}" topic describe, and how is it used?'
        content = f"Read the passage and answer the question.\n\nPassage: {mark}\n\nQuestion: {question}"
        return _Task(category, _user(content), [text], topic)
    if category == "rag":
        documents = [text] + [_passage(rng, corpus)[1][:3000] for _ in range(2)]
        question = f'Using the documents, explain "{topic}" in your own words.'
        content = f"Answer the question using the documents below.\n\n{mark}\n\nQuestion: {question}"
        return _Task(category, _user(content), [f"Document [{i + 1}]: {d}" for i, d in enumerate(reversed(documents))],
                     topic)  # fmt: skip
    if category == "math":
        question, _ = _math_problem(rng)
        # worked examples first (cut to the length), as few-shot GSM8K prompts are
        examples = "\n\n".join("Question: {}\nAnswer: {}".format(*_math_problem(rng)) for _ in range(64))
        content = f"Solve the last problem step by step, as in the examples.\n\n{mark}\n\nQuestion: {question}\nAnswer:"
        return _Task(category, _user(content), [examples], "gsm8k-like")
    if category == "multi-turn":
        follow_up = "Thanks. Can you give a short example and say when not to use it?"
        messages = [*_user(f'Can you explain "{topic}" in Python?'), {"role": "assistant", "content": mark},
                    *_user(follow_up)]  # fmt: skip
        return _Task(category, messages, [text], topic)
    raise TestbedError(f"no task category {category!r}")


def task_prompt(category: str, length: int, rng: np.random.Generator, encode: Callable[[str], list[int]],
                decode: Callable[[list[int]], str], renderer: ChatRenderer, bos: list[int],
                split: str = "all") -> TaskPrompt:  # fmt: skip
    """A prompt of ``category`` with exactly ``length`` tokens (``bos`` included), or a bare question
    when even the shortest instruction's fixed part is longer; its text from the topics of ``split``."""
    corpus = prose_corpus(split)
    task = _task(category, rng, corpus)
    head, tail, room = _fixed_parts(task, length, encode, renderer, bos)
    if room < MIN_PASSAGE_TOKENS:  # the category's instruction does not fit: the shortest one does
        task = _Task("explain", _user(f"Explain this:\n\n{PASSAGE_MARK}"), task.passages, task.topic)
        head, tail, room = _fixed_parts(task, length, encode, renderer, bos)
    source = f"{task.category}:{task.topic}:prose-{corpus.sha256[:12]}"
    if room < MIN_PASSAGE_TOKENS:
        question = renderer.render(_user(f'What is "{task.topic}" in Python?'))
        ids = bos + encode(question)
        return TaskPrompt(tuple(ids), question, source + ":short-question")
    body = encode("\n\n".join(task.passages))
    while len(body) < room:  # a long draw: the passages run on through the corpus
        body += encode("\n\n" + _passage(rng, corpus)[1])
    ids = head + body[:room] + tail
    return TaskPrompt(tuple(ids), decode(ids), source)


def _fixed_parts(task: _Task, length: int, encode: Callable[[str], list[int]], renderer: ChatRenderer,
                 bos: list[int]) -> tuple[list[int], list[int], int]:  # fmt: skip
    """The ids before and after the passage, and how many passage tokens make ``length``."""
    before, _, after = renderer.render(task.messages).partition(PASSAGE_MARK)
    head, tail = bos + encode(before), encode(after)
    return head, tail, length - len(head) - len(tail)


def draw_category(prompt_set: str, rng: np.random.Generator) -> str:
    return "article" if prompt_set == "cnndm" else CATEGORIES[int(rng.integers(len(CATEGORIES)))]
