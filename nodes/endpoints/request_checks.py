"""A completion request's fields checked strictly, as OpenAI's API types them: a boolean is not an
integer, ``stream_options`` is an object, counts are integers within bounds, ``messages`` a list of
objects with string roles and contents, ``prompt`` a string or token ids of the vocabulary. Each
refusal is an ``ApiError`` (400) naming its field as ``param``. Fields we do not serve are ignored,
as other OpenAI-compatible servers do; those that would change the answer (``n``, ``logprobs``) are
refused."""

import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from nodes.contracts.chat_template import ChatTemplate, ChatTemplateError, plain_chat

CHAT_ROLES = ("system", "developer", "user", "assistant")
MAX_SEED = (1 << 63) - 1


class ApiError(Exception):
    """A refused request: its HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def payload(self) -> Dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


class CompletionRequest(NamedTuple):
    prompt_ids: List[int]
    max_tokens: Optional[int]  # as asked (None: the default); the endpoint fits it to the context
    stream: bool
    include_usage: bool
    seed: Optional[int]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(body: Dict[str, Any], name: str, low: int, high: int) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise ApiError(400, "%s must be an integer from %d to %d, not %s" % (name, low, high, _shown(value)), name)
    return value


def _number(body: Dict[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is not None and (not _is_number(value) or not low <= value <= high):
        raise ApiError(400, "%s must be a number from %g to %g, not %s" % (name, low, high, _shown(value)), name)


def _flag(body: Dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, "%s must be true or false, not %s" % (name, _shown(value)), name)
    return bool(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def completion_request(body: Dict[str, Any], chat: bool, vocab_size: int, context_tokens: int,
                       encode: Callable[[str], List[int]],
                       template: Optional[ChatTemplate] = None) -> CompletionRequest:  # fmt: skip
    """The request's fields checked; its prompt as token ids (``encode``: the endpoint's tokenizer;
    ``template``: the model's chat template, if it has one)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", "model")
    if chat:
        prompt_ids = _encoded(encode, chat_prompt(body.get("messages"), template), "messages")
    else:
        prompt_ids = _prompt_ids(body.get("prompt"), vocab_size, encode)
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise ApiError(400, "only n = 1 is served", "n")
    if body.get("logprobs") is not None and body["logprobs"] is not False:  # completions: a count, chat: a flag
        raise ApiError(400, "logprobs are not served", "logprobs")
    asked = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = _integer(body, name, 1, context_tokens)
        asked = value if asked is None else asked
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    _flag(body, "return_token_ids")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object, not %s" % _shown(options), "stream_options")
    usage = (options or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ApiError(400, "stream_options.include_usage must be true or false", "stream_options")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= MAX_SEED):
        raise ApiError(400, "seed must be an integer from 0 to 2^63 - 1, not %s" % _shown(seed), "seed")
    return CompletionRequest(prompt_ids, asked, stream, bool(usage), seed)


def _prompt_ids(prompt: Any, vocab_size: int, encode: Callable[[str], List[int]]) -> List[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return _encoded(encode, prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(t) and 0 <= t < vocab_size for t in prompt):
        return list(prompt)
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids from 0 to %d" % (vocab_size - 1),
                   "prompt")  # fmt: skip


def _encoded(encode: Callable[[str], List[int]], text: str, param: str) -> List[int]:
    try:
        return encode(text)
    except (ValueError, TypeError):  # a lone surrogate ("\\ud800" is JSON), which the tokenizer refuses
        raise ApiError(400, "%s is not valid Unicode text" % param, param) from None


def chat_prompt(messages: Any, template: Optional[ChatTemplate] = None) -> str:
    """The chat messages as one prompt: in the model's chat template, or as plain paragraphs for a model
    without one (the tiny model: :func:`nodes.contracts.chat_template.plain_chat`)."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of objects", "messages")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(400, "messages[%d] must be an object with a role and a content" % i, "messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ApiError(400, "messages[%d].role must be one of %s" % (i, ", ".join(CHAT_ROLES)), "messages")
        checked.append({"role": role, "content": _content(message.get("content"), i)})
    if template is not None:
        try:
            return template.render(checked)
        except ChatTemplateError as error:
            raise ApiError(400, str(error), "messages") from None
    return plain_chat(checked)


def _content(content: Any, index: int) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) and content else [None]
    if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return "".join(p["text"] for p in parts)
    raise ApiError(400, "messages[%d].content must be a string or a list of text parts" % index, "messages")
