"""The checkpoint's tokenizer as the controller uses it: prompts become the token ids that a
schedule carries to the devices.

``tokenizer.json`` through the ``tokenizers`` library; the BOS token comes from
``tokenizer_config.json`` (``bos_token``, a string or an AddedToken dict) or, failing that, from
the model's ``config.json`` (``bos_token_id``), and is added when ``add_bos_token`` (default: when
there is one) says so. The node side reads the same files the same way
(``nodes.inference.tokenizer``); a test holds the two to the same ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from foundation.errors import TestbedError
from nodes.contracts.chat_template import read_chat_template


@dataclass(frozen=True)
class PromptTokenizer:
    """Text to token ids and back, with the checkpoint's BOS."""

    directory: str
    tokenizer: Tokenizer
    bos_id: int | None
    add_bos: bool
    chat_template: str | None = None  # tokenizer_config.json's, for a chat model

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; the BOS id first when the checkpoint asks for one (or ``bos`` says so)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(directory: str | Path) -> PromptTokenizer:
    """The tokenizer of the checkpoint in ``directory``; a :class:`TestbedError` names what is missing."""
    directory = str(directory)
    path = Path(directory) / "tokenizer.json"
    if not path.exists():
        problem = f"{path}: no such file; the tokenizer must be in tokenizer.json format"
        raise TestbedError(f"{directory}: cannot load the tokenizer ({problem})")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except (OSError, ValueError) as error:
        raise TestbedError(f"{directory}: cannot load the tokenizer ({error})") from None
    settings = _read_json(Path(directory) / "tokenizer_config.json")
    bos_id = _bos_id(tokenizer, settings, _read_json(Path(directory) / "config.json"))
    add_bos = bool(settings.get("add_bos_token", bos_id is not None)) and bos_id is not None
    return PromptTokenizer(directory, tokenizer, bos_id, add_bos, read_chat_template(directory))


def _bos_id(tokenizer: Tokenizer, settings: dict, config: dict) -> int | None:
    token = settings.get("bos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    model_id = config.get("bos_token_id")
    if isinstance(model_id, list):
        model_id = model_id[0] if model_id else None
    return model_id


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
