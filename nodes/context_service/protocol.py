"""The LLM service's wire format: one JSON request line on a Unix stream socket, answered by JSON lines.

Requests (``op``; LLMS's names ``newLLMCtx``, ``callLLM``, ``delLLMCtx`` are accepted too):

- ``{"op": "new", "app": "mail", "system_prompt": "..."}`` -> ``{"ok": true, "ctx": "..."}``
- ``{"op": "call", "ctx": "...", "prompt": "...", "max_tokens": 32}`` (or ``"teacher_forced": "..."``;
  an app holding token ids sends ``"prompt_ids"`` and ``"teacher_forced_ids"`` instead of text)
  -> one ``{"token_id": 17, "text": "..."}`` per output token, then ``{"ok": true, "done": true, ...}``
  with the call's record (switching latency and what made it, prefill and decode seconds)
- ``{"op": "delete", "ctx": "..."}`` -> ``{"ok": true}``
- ``{"op": "list"}`` -> ``{"ok": true, "contexts": [...]}``; ``{"op": "stats"}`` -> the memory's counters

A refused request is answered ``{"ok": false, "error": "...", "code": "...", "field": "..."}``.
"""

import json
from typing import Any, Dict

MAX_REQUEST_BYTES = 1 << 20


def encode(message: Dict[str, Any]) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def error(code: str, message: str, field: Any = None) -> Dict[str, Any]:
    return {"ok": False, "code": code, "error": message, "field": field}
