"""The checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library.

Special tokens come from ``tokenizer_config.json`` (``bos_token``/``eos_token``, strings or
AddedToken dicts) or, failing that, from the model's ``config.json`` ids.
"""

import json
import os
from typing import List, Optional

from nodes.contracts.chat_template import read_chat_template

from .config import ConfigError


class Tokenizer:
    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.exists(path):
            raise ConfigError("%s: no such file; the tokenizer must be in tokenizer.json format" % path)
        from tokenizers import Tokenizer as _Tokenizer

        self._tokenizer = _Tokenizer.from_file(path)
        self.bos_id = self._special(directory, "bos")
        self.eos_id = self._special(directory, "eos")
        self.add_bos = self._add_bos(directory)
        self.directory = directory
        self.chat_template = read_chat_template(directory)  # None: the model has none (the tiny one)

    def _special(self, directory: str, kind: str) -> Optional[int]:
        settings = _read_json(os.path.join(directory, "tokenizer_config.json"))
        token = settings.get(kind + "_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            found = self._tokenizer.token_to_id(token)
            if found is not None:
                return found
        model_id = _read_json(os.path.join(directory, "config.json")).get(kind + "_token_id")
        if isinstance(model_id, list):
            model_id = model_id[0] if model_id else None
        return model_id

    def _add_bos(self, directory: str) -> bool:
        settings = _read_json(os.path.join(directory, "tokenizer_config.json"))
        return bool(settings.get("add_bos_token", self.bos_id is not None)) and self.bos_id is not None

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    def encode(self, text: str, bos: Optional[bool] = None) -> List[int]:
        """Token ids of ``text``; a BOS id first when the checkpoint asks for one."""
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: List[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def piece(self, before: List[int], token_id: int) -> str:
        """The text ``token_id`` adds after ``before`` (decoding the whole tail keeps merged bytes right)."""
        tail = before[-4:]
        return self.decode(tail + [token_id])[len(self.decode(tail)) :]


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}
