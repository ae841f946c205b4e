"""Greedy generation with the real checkpoint, each token released at its paced time.

``stream`` yields one ``Emitted`` per token: its id, its index in the output and the monotonic time it
was released. The first token is due ``pace.first_token_s(l)`` after the request was taken, each next
one ``pace.gap_s()`` after the previous was due. A token computed later than its due time is released
at once and counted as an overrun (the host could not keep the target's pace: a fidelity violation),
and the next one is due a gap after that release. Each token carries its paced step's record
(:mod:`nodes.contracts.paced_steps`): its slot's start (the request taken, or the previous token's due
time), the real time to its computation from there (sending the previous token included), its target
and how late it was released.
Closing the generator (the client went away) stops the computation at the next token.
"""

import threading
import time
from typing import Iterator, List, NamedTuple, Optional, Sequence

import torch

from nodes.contracts.chat_template import ChatTemplate, ChatTemplateError
from nodes.contracts.paced_steps import late_tolerance_s, overran
from nodes.inference.checkpoint import load_whole
from nodes.inference.model import Segment
from nodes.inference.tokenizer import Tokenizer

from .pace import Pace
from .request_checks import ApiError


class Emitted(NamedTuple):
    token_id: int
    index: int
    released_s: float  # time.monotonic()
    overrun_s: float  # how late the computation made it (0 when on time)
    # the token as a paced step (nodes.contracts.paced_steps): when its slot began, the real time from
    # there to its computation (waiting for the model included), its target (the first token's time or
    # one gap) and how late it was released past its due time; 0 where a source paces its steps itself
    began_s: float = 0.0
    real_s: float = 0.0
    target_s: float = 0.0
    late_s: float = 0.0

    @property
    def overran(self) -> bool:
        """Whether the host missed this token's pace (computed after its due time, or released late)."""
        return self.overrun_s > 0 or self.late_s > late_tolerance_s(self.target_s)


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


class PacedGenerator(TokenText):
    """The whole model of ``model_dir`` on ``device`` (``cpu`` or ``cuda[:N]``) behind a lock (one
    forward pass at a time)."""

    def __init__(self, model_dir: str, dtype: str = "float32", device: str = "cpu") -> None:
        self.model_dir = model_dir
        self.device = device
        self.model = load_whole(model_dir, dtype=dtype, device=device)
        self.tokenizer = Tokenizer(model_dir)
        self.context_tokens = int(self.model.config.max_position_embeddings)
        self._lock = threading.Lock()

    def stream(self, prompt_ids: Sequence[int], max_tokens: int, pace: Pace,
               stop_at_eos: bool = True, sleep=time.sleep) -> Iterator[Emitted]:  # fmt: skip
        if not prompt_ids:
            raise ValueError("a prompt needs at least one token")
        began = time.monotonic()
        target_s = pace.first_token_s(len(prompt_ids))
        due = began + target_s
        cache = self.model.new_cache(len(prompt_ids) + max_tokens + 1)
        eos = self.tokenizer.eos_id if stop_at_eos else None
        with self._lock, torch.inference_mode():
            ids = torch.tensor(list(prompt_ids), device=self.device)
            hidden = self.model.run_layers(self.model.embed(ids), [Segment(cache, len(prompt_ids))])
            token = int(torch.argmax(self.model.logits(hidden[-1])).item())
        for index in range(max_tokens):
            now = time.monotonic()
            if now < due:
                sleep(due - now)
            released = time.monotonic()
            late_s = max(0.0, released - due)
            yield Emitted(token, index, released, max(0.0, now - due), began, now - began, target_s, late_s)
            if token == eos or index + 1 == max_tokens:
                return
            # the next token's slot starts at this one's due time, or at its release if it overran: a
            # late token delays the rest, as on the target, instead of a burst that catches up
            began = due if not overran(now, due, late_s, target_s) else released
            target_s = pace.gap_s()
            due = began + target_s
            with self._lock, torch.inference_mode():
                step = self.model.embed(torch.tensor([token], device=self.device))
                hidden = self.model.run_layers(step, [Segment(cache, 1)])
                token = int(torch.argmax(self.model.logits(hidden[-1])).item())



def max_tokens_for(generator: PacedGenerator, prompt_tokens: int, asked: Optional[int]) -> int:
    """What a request may generate: what it asked (16 by default, as OpenAI's completions) within the
    model's context."""
    room = generator.context_tokens - prompt_tokens
    return max(0, min(room, asked if asked is not None else 16))
