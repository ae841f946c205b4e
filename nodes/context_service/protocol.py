"""The LLM service's wire format: one JSON request line on a Unix stream socket, answered by JSON lines.

Requests (``op``; LLMS's names ``newLLMCtx``, ``callLLM``, ``delLLMCtx`` are accepted too):

- ``{"op": "new", "app": "mail", "system_prompt": "..."}`` -> ``{"ok": true, "ctx": "..."}``
- ``{"op": "call", "ctx": "...", "prompt": "...", "max_tokens": 32}`` (or ``"teacher_forced": "..."``;
  an app holding token ids sends ``"prompt_ids"`` and ``"teacher_forced_ids"`` instead of text)
  -> one ``{"token_id": 17, "text": "..."}`` per output token, then ``{"ok": true, "done": true, ...}``
  with the call's record (switching latency and what made it, prefill and decode seconds)
- ``{"op": "delete", "ctx": "..."}`` -> ``{"ok": true}``
- ``{"op": "list"}`` -> ``{"ok": true, "contexts": [...]}``; ``{"op": "stats"}`` -> the memory's counters

A refused request is answered ``{"ok": false, "error": "...", "code": "...", "field": "..."}``; a field
of the wrong type is ``bad_request`` naming it (``parse_request``).
"""

import json
from typing import Any, Dict, Optional

MAX_REQUEST_BYTES = 1 << 20
ALIASES = {"newLLMCtx": "new", "callLLM": "call", "delLLMCtx": "delete", "deLLMCtx": "delete", "delLLMctx": "delete"}
OPS = ("new", "call", "delete", "list", "stats")
TEXT_FIELDS = ("app", "system_prompt", "ctx", "prompt", "teacher_forced")
ID_FIELDS = ("prompt_ids", "teacher_forced_ids")
REQUIRED = {"new": ("app",), "call": ("ctx",), "delete": ("ctx",)}


class BadRequest(Exception):
    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.message, self.field = message, field


def encode(message: Dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def error(code: str, message: str, field: Any = None) -> Dict[str, Any]:
    return {"ok": False, "code": code, "error": message, "field": field}


def _not_json(name: str) -> Any:
    raise ValueError("%s is not JSON" % name)


def parse_request(line: bytes) -> Dict[str, Any]:
    """A request line as a dict whose ``op`` is one of ``OPS`` and whose fields have their types
    (text: a string, ids: a list of integers, ``max_tokens``: an integer >= 0); else BadRequest."""
    try:
        request = json.loads(line.decode("utf-8") or "null", parse_constant=_not_json)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise BadRequest("not a JSON request line: %s" % (str(exc)[:200] or type(exc).__name__)) from None
    if not isinstance(request, dict):
        raise BadRequest("a request is a JSON object")
    op = request.get("op")
    op = ALIASES.get(op, op) if isinstance(op, str) else op
    if op not in OPS:
        raise BadRequest("op must be one of %s, not %s" % (", ".join(OPS), json.dumps(op)[:60]), "op")
    for field in TEXT_FIELDS:
        value = request.get(field)
        if value is None:
            if field in REQUIRED.get(op, ()):
                raise BadRequest("%s needs %s" % (op, field), field)
            continue
        if not isinstance(value, str):
            raise BadRequest("%s must be a string, not %s" % (field, type(value).__name__), field)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("%s is not valid Unicode text" % field, field) from None
    for field in ID_FIELDS:
        value = request.get(field)
        if value is not None and not (isinstance(value, list) and all(_is_int(t) for t in value)):
            raise BadRequest("%s must be a list of token ids (integers)" % field, field)
    tokens = request.get("max_tokens")
    if tokens is not None and (not _is_int(tokens) or tokens < 0):
        raise BadRequest("max_tokens must be an integer >= 0, not %s" % json.dumps(tokens)[:40], "max_tokens")
    return dict(request, op=op)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
