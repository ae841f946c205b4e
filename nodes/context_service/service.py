"""The LLM service's API (LLMS Table 1) over the context memory: ``newLLMCtx``, ``callLLM`` and
``delLLMCtx``, with their limits, and contexts that outlive their apps and the daemon itself.

- ``new_context(app, system_prompt)``: a context id; at most ``contexts_per_app`` live contexts an app.
- ``run_call(ctx, prompt, max_tokens, on_token=...)``: generates the output under the turn lock,
  handing each token to ``on_token`` (the daemon's writer, which sends it to the app off the lock); the
  prompt and the output are appended to the context when the call ends. A call is atomic: if it
  fails, or ``on_token`` says its client went away before the output was made, the context is as
  before. ``teacher_forced`` appends a given output instead of generating one (the traces' ground
  truth, so that latency runs do not depend on what the model says). ``call`` is the same for
  in-process callers, the tokens yielded once the call has committed.
- ``new_context(app, system_prompt)`` is atomic too: a system prompt that fails leaves no context.
- ``delete(ctx)``.

Every context's text, chunk levels and density sums are written to ``state_dir`` (atomically) when a
call commits, and its chunks to the chunk store ahead of time, so a killed daemon restarts with every
context that was written: chunks it finds on disk are loaded, others recomputed from the text.
One call runs at a time (one model); other callers wait their turn.
"""

import contextlib
import json
import os
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

import torch

from nodes.contracts.durable import write_json_atomic
from nodes.inference.model import ModelPart, Segment
from nodes.inference.tokenizer import Tokenizer

from .context_memory import Chunk, Context, ContextMemory, SwitchRecord


class ServiceError(Exception):
    """A request the service refuses; ``code`` names what was wrong, ``field`` where."""

    def __init__(self, code: str, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.code, self.message, self.field = code, message, field


class CallAbandoned(Exception):
    """The call's client went away (or stopped reading) before its output was made: rolled back."""


class Limits(NamedTuple):
    contexts_per_app: int = 4
    context_tokens: int = 2048  # prompt + output of every call of a context, together


class CallResult(NamedTuple):
    switch: SwitchRecord
    prompt_tokens: int
    output_ids: List[int]
    context_tokens: int
    prefill_s: float
    decode_s: float


class LlmService(object):
    def __init__(self, memory: ContextMemory, tokenizer: Tokenizer, state_dir: str,
                 limits: Optional[Limits] = None) -> None:  # fmt: skip
        self.memory, self.tokenizer, self.state_dir = memory, tokenizer, state_dir
        self.limits = limits or Limits()
        self.owners: Dict[str, str] = {}  # context -> app
        self._turn = threading.Lock()  # one call at a time
        os.makedirs(state_dir, exist_ok=True)
        self._restore()

    @property
    def model(self) -> ModelPart:
        return self.memory.model

    # -- persistence --------------------------------------------------------------------------------

    def _state_path(self, ident: str) -> str:
        return os.path.join(self.state_dir, "ctx-%s.json" % ident)

    def _save(self, context: Context) -> None:
        density = context.density
        length = len(context.token_ids)
        write_json_atomic(self._state_path(context.ident), {
            "ctx": context.ident, "app": self.owners[context.ident], "token_ids": context.token_ids,
            "chunks": [{"index": c.index, "tokens": c.tokens, "bits": c.bits, "on_disk": c.on_disk}
                       for c in context.chunks],
            "disk_bytes": {str(k): v for k, v in context.disk_bytes.items()},
            "column_sum": density.column_sum[:length].tolist(), "row_count": density.row_count[:length].tolist(),
        })  # fmt: skip

    def _restore(self) -> None:
        for name in sorted(os.listdir(self.state_dir)):
            if not (name.startswith("ctx-") and name.endswith(".json")):
                continue
            with open(os.path.join(self.state_dir, name)) as handle:
                saved = json.load(handle)
            context = self.memory.new_context(saved["ctx"])
            self.owners[context.ident] = saved["app"]
            context.token_ids = [int(t) for t in saved["token_ids"]]
            on_disk = set(self.memory.store.chunks_of(context.ident))
            for raw in saved["chunks"]:
                chunk = Chunk(int(raw["index"]), int(raw["tokens"]), int(raw["bits"]), None)  # not in memory
                chunk.on_disk = bool(raw["on_disk"]) and chunk.index in on_disk
                context.chunks.append(chunk)
            context.disk_bytes = {int(k): int(v) for k, v in saved["disk_bytes"].items()}
            context.density.restore(saved["column_sum"], saved["row_count"])

    # -- the API ------------------------------------------------------------------------------------

    def new_context(self, app: str, system_prompt: Optional[str] = None) -> str:
        if not app or not isinstance(app, str):
            raise ServiceError("bad_request", "an app name is needed", "app")
        with self._turn:
            owned = sum(1 for owner in self.owners.values() if owner == app)
            if owned >= self.limits.contexts_per_app:
                raise ServiceError("limit", "app %s holds %d contexts, the most an app may (delete one first)"
                                   % (app, owned), "app")  # fmt: skip
            ident = uuid.uuid4().hex[:12]
            context = self.memory.new_context(ident)
            self.owners[ident] = app
            self._save(context)
        if system_prompt:
            try:
                self.run_call(ident, system_prompt, 0)
            except BaseException:  # the context goes with its failed system prompt
                self.delete(ident)
                raise
        return ident

    def _context(self, ident: Any) -> Context:
        context = self.memory.contexts.get(ident) if isinstance(ident, str) else None
        if context is None:
            raise ServiceError("unknown_context", "no context %r (deleted, or never made)" % (ident,), "ctx")
        return context

    def call(self, ident: str, prompt: str, max_tokens: int, teacher_forced: Optional[str] = None,
             results: Optional[List[CallResult]] = None, prompt_ids: Optional[List[int]] = None,
             teacher_forced_ids: Optional[List[int]] = None) -> Iterator[int]:  # fmt: skip
        """The call run whole (``run_call``), then its output's token ids; its record is appended to
        ``results``. An app that holds token ids gives ``prompt_ids`` / ``teacher_forced_ids``."""
        result = self.run_call(ident, prompt, max_tokens, teacher_forced, prompt_ids, teacher_forced_ids)
        if results is not None:
            results.append(result)
        return iter(result.output_ids)

    def run_call(self, ident: str, prompt: str, max_tokens: int, teacher_forced: Optional[str] = None,
                 prompt_ids: Optional[List[int]] = None, teacher_forced_ids: Optional[List[int]] = None,
                 on_token: Optional[Callable[[int], bool]] = None) -> CallResult:  # fmt: skip
        """Run one call under the turn lock and commit it. ``on_token`` hears of each generated token as
        it is made; it must not block (the daemon queues it for the connection's writer) and returns
        False once the client is gone, which ends the call as CallAbandoned, rolled back."""
        context = self._context(ident)
        first = not context.token_ids  # BOS begins a context, not every prompt appended to it
        if prompt_ids is not None:
            prompt_ids = self._checked_ids(prompt_ids, "prompt_ids")
            if first and prompt_ids and self.tokenizer.add_bos:
                prompt_ids = [int(self.tokenizer.bos_id)] + prompt_ids
        else:
            prompt_ids = self.tokenizer.encode(prompt, bos=None if first else False) if prompt else []
        if teacher_forced_ids is not None:
            forced: Optional[List[int]] = self._checked_ids(teacher_forced_ids, "teacher_forced_ids") or None
        else:
            forced = self.tokenizer.encode(teacher_forced, bos=False) if teacher_forced else None
        new = len(forced) if forced is not None else max(0, int(max_tokens))
        if not prompt_ids and not forced:
            raise ServiceError("bad_request", "an empty prompt", "prompt")
        total = len(context.token_ids) + len(prompt_ids) + new
        if total > self.limits.context_tokens:
            raise ServiceError("limit", "the context would hold %d tokens, over the limit of %d"
                               % (total, self.limits.context_tokens), "prompt")  # fmt: skip
        with self._turn, torch.inference_mode():
            if ident not in self.memory.contexts:  # deleted by another app while this call waited its turn
                raise ServiceError("unknown_context", "context %r was deleted" % (ident,), "ctx")
            switch = self.memory.prepare(ident)
            committed = False
            try:
                cache = self.memory.working_cache(ident, len(prompt_ids) + new + 1)
                started = time.monotonic()
                output: List[int] = []
                hidden = self._forward(cache, prompt_ids + (forced or []))
                prefill_s = time.monotonic() - started
                if forced is None and new:
                    eos = self.tokenizer.eos_id
                    token = int(torch.argmax(self.model.logits(hidden[-1])))
                    while True:
                        output.append(token)
                        if on_token is not None and not on_token(token):
                            raise CallAbandoned()
                        hidden = self._forward(cache, [token])  # the output enters the context
                        if token == eos or len(output) == new:
                            break
                        token = int(torch.argmax(self.model.logits(hidden[-1])))
                elif forced is not None:
                    output = list(forced)
                decode_s = time.monotonic() - started - prefill_s
                self.memory.commit(ident, cache, prompt_ids + output)
                committed = True
                self._save(context)
                return CallResult(switch, len(prompt_ids), output, len(context.token_ids), prefill_s, decode_s)
            finally:
                if not committed:  # the context stays as it was, its densities too
                    self.memory.release(ident)
                    context.density.truncate(len(context.token_ids))

    def _checked_ids(self, ids: Any, field: str) -> List[int]:
        vocab = self.model.config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):  # fmt: skip
            raise ServiceError("bad_request", "%s must be a list of token ids from 0 to %d" % (field, vocab - 1), field)
        return list(ids)

    def _forward(self, cache: Any, ids: List[int]) -> torch.Tensor:
        model = self.model
        return model.run_layers(model.embed(torch.tensor(ids, device=model.device)), [Segment(cache, len(ids))])

    def delete(self, ident: str) -> None:
        self._context(ident)
        with self._turn:
            self.memory.delete(ident)
            self.owners.pop(ident, None)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._state_path(ident))

    def contexts(self) -> List[Dict[str, Any]]:
        return [{"ctx": c.ident, "app": self.owners.get(c.ident), "tokens": len(c.token_ids),
                 "chunks": len(c.chunks), "resident_chunks": sum(1 for k in c.chunks if k.resident is not None)}
                for c in self.memory.contexts.values()]  # fmt: skip
