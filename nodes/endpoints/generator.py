"""Greedy generation with the real checkpoint, each token released at its paced time.

``stream`` yields one ``Emitted`` per token: its id, its index in the output and the monotonic time it
was released. The first token is due ``pace.first_token_s(l)`` after the request was taken, each next
one ``pace.gap_s()`` after the previous was due. A token computed later than its due time is released
at once and counted as an overrun (the host could not keep the target's pace: a fidelity violation),
and the next one is due a gap after that release. Each token carries its paced step's record
(:mod:`nodes.contracts.paced_steps`): its slot's start (the request taken, or the previous token's due
time), the real time to its computation from there (0 when it was ready before its slot began), its
target and how late it was released.
Closing the generator (the client went away) stops the computation after the token computing ahead.

The streams share the model through :class:`StepBatcher`: every stream that needs a forward pass while
one runs waits for the next, which computes all of them in one packed batch, as a serving engine's
continuous batching does; and a stream hands in its next token's pass as soon as it has the token
before, so that the host computes while the pace holds the token (a token is late only when the host
fell behind by a whole gap). One pass at a time for each stream in turn, each started at its slot,
fell behind a trace's token gaps as soon as a few streams ran at once on a small host.
"""

import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch

from nodes.contracts.chat_template import ChatTemplate, ChatTemplateError
from nodes.contracts.paced_steps import overran
from nodes.inference.checkpoint import load_whole
from nodes.inference.kv_cache import KVCache
from nodes.inference.model import Segment
from nodes.inference.tokenizer import Tokenizer

from .pace import Pace
from .request_checks import ApiError


class Emitted(NamedTuple):
    token_id: int
    index: int
    released_s: float  # time.monotonic()
    # the token as a paced step (nodes.contracts.paced_steps): when its slot began, the real time from
    # there to its computation (waiting for the model's pass included; 0 when it was computed before its
    # slot began), its target (the first token's time or one gap) and how late it was released past its
    # due time; 0 where a source paces its steps itself
    began_s: float = 0.0
    real_s: float = 0.0
    target_s: float = 0.0
    late_s: float = 0.0

    @property
    def overran(self) -> bool:
        """Whether the host missed this token's pace (computed after its due time, or released late)."""
        return overran(self.began_s + self.real_s, self.began_s + self.target_s, self.late_s, self.target_s)


class TokenText(object):
    """Text in and out of an endpoint's tokenizer (``self.tokenizer``): what the HTTP API needs of any
    token source beside its ``stream``."""

    tokenizer: Tokenizer
    _chat_template: Optional[ChatTemplate] = None

    @property
    def chat_template(self) -> Optional[ChatTemplate]:
        """The model's chat template, parsed once; None for a model without one (the tiny model)."""
        if self._chat_template is None and self.tokenizer.chat_template:
            try:
                self._chat_template = ChatTemplate(self.tokenizer.chat_template)
            except ChatTemplateError as error:
                raise ApiError(500, "%s: %s" % (self.tokenizer.directory, error)) from None
        return self._chat_template

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids)

    def piece(self, before: List[int], token_id: int) -> str:
        return self.tokenizer.piece(before, token_id)


class _Step(object):
    """One stream's share of a batch: new token ids after its cache, and the greedy next token to come."""

    __slots__ = ("cache", "future", "token_ids")

    def __init__(self, cache: KVCache, token_ids: Sequence[int]) -> None:
        self.cache, self.token_ids = cache, list(token_ids)
        self.future = Future()  # type: Future


class StepBatcher(object):
    """One forward pass at a time over ``model``, each for every stream waiting: a stream hands in its
    new token ids (a prompt, or its last token) with its cache and gets the argmax of its last position.

    Its own thread runs the passes (started with the first step), so a stream can hand in its next step
    and go on releasing the token before. ``max_streams`` caps a pass (1: one stream at a time, as
    before batching). ``passes`` and ``steps`` count the passes run and the streams' steps they computed."""

    def __init__(self, model: Any, device: str, max_streams: Optional[int] = None) -> None:
        self.model, self.device, self.max_streams = model, device, max_streams
        self.passes = 0
        self.steps = 0
        self._state = threading.Condition()
        self._waiting = []  # type: List[_Step]
        self._thread = None  # type: Optional[threading.Thread]

    def submit(self, cache: KVCache, token_ids: Sequence[int]) -> "Future[Tuple[int, float]]":
        """The next token after ``token_ids`` and the monotonic time its pass ended, from the next pass (the
        future raises what the pass raised)."""
        step = _Step(cache, token_ids)
        with self._state:
            self._waiting.append(step)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="endpoint-passes", daemon=True)
                self._thread.start()
            self._state.notify()
        return step.future

    def _serve(self) -> None:
        while True:
            with self._state:
                while not self._waiting:
                    self._state.wait()
                cut = len(self._waiting) if self.max_streams is None else self.max_streams
                batch, self._waiting = self._waiting[:cut], self._waiting[cut:]
            self._run(batch)

    def _run(self, batch: List[_Step]) -> None:
        """Compute every step of ``batch`` in one packed pass (an error is every step's)."""
        try:
            with torch.inference_mode():
                ids = torch.tensor([t for step in batch for t in step.token_ids], device=self.device)
                segments = [Segment(step.cache, len(step.token_ids)) for step in batch]
                hidden = self.model.run_layers(self.model.embed(ids), segments)
                last = torch.tensor(list(itertools.accumulate(len(step.token_ids) for step in batch)),
                                    device=hidden.device) - 1  # fmt: skip
                tokens = torch.argmax(self.model.logits(hidden[last]), dim=-1).tolist()
        except Exception as error:  # each stream waiting raises it
            for step in batch:
                step.future.set_exception(error)
            return
        computed = time.monotonic()
        self.passes += 1
        self.steps += len(batch)
        for step, token in zip(batch, tokens):
            step.future.set_result((int(token), computed))


class PacedGenerator(TokenText):
    """The whole model of ``model_dir`` on ``device`` (``cpu`` or ``cuda[:N]``), its streams' forward
    passes batched by a :class:`StepBatcher` (at most ``max_streams`` a pass; None: every one waiting)."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu",
                 max_streams: Optional[int] = None) -> None:  # fmt: skip
        self.model_dir = model_dir
        self.device = device
        self.model = load_whole(model_dir, dtype=dtype, device=device)
        self.tokenizer = Tokenizer(model_dir)
        self.context_tokens = int(self.model.config.max_position_embeddings)
        self.batcher = StepBatcher(self.model, device, max_streams)

    def stream(self, prompt_ids: Sequence[int], max_tokens: int, pace: Pace,
               stop_at_eos: bool = True, sleep=time.sleep) -> Iterator[Emitted]:  # fmt: skip
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        began = time.monotonic()
        target_s = pace.first_token_s(len(prompt_ids))
        due = began + target_s
        cache = self.model.new_cache(len(prompt_ids) + max_tokens + 1)
        eos = self.tokenizer.eos_id if stop_at_eos else None
        pending = self.batcher.submit(cache, prompt_ids)
        for index in range(max_tokens):
            token, computed = pending.result()
            last = token == eos or index + 1 == max_tokens
            if not last:  # the next token computes while this one waits for its due time
                pending = self.batcher.submit(cache, [token])
            now = time.monotonic()
            if now < due:
                sleep(due - now)
            released = time.monotonic()
            # ready before its slot began (computed ahead): no real time in its slot
            emitted = Emitted(token, index, released, began, max(0.0, computed - began), target_s,
                              max(0.0, released - due))  # fmt: skip
            yield emitted
            if last:
                return
            # the next token's slot starts at this one's due time, or at its release if it overran: a
            # late token delays the rest, as on the target, instead of a burst that catches up
            began = released if emitted.overran else due
            target_s = pace.gap_s()
            due = began + target_s


def max_tokens_for(generator: PacedGenerator, prompt_tokens: int, asked: Optional[int]) -> int:
    """What a request may generate: what it asked (16 by default, as OpenAI's completions) within the
    model's context."""
    room = generator.context_tokens - prompt_tokens
    return max(0, min(room, asked if asked is not None else 16))
