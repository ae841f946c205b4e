"""YAML files loaded with their line numbers, so every problem can name ``FILE:LINE: field``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.constructor import DuplicateKeyError
from ruamel.yaml.error import MarkedYAMLError

from foundation.errors import InputError, InputProblem

FieldPath = Sequence[str | int]


def field_name(path: FieldPath) -> str:
    """``('nodes', 2, 'data', 'interface')`` -> ``nodes[2].data.interface``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


@dataclass(frozen=True)
class YamlSource:
    """A parsed YAML document and the file it came from, able to locate any field by path."""

    path: Path
    data: Any

    @classmethod
    def load(cls, path: str | Path) -> YamlSource:
        """Read and parse ``path``; syntax errors and duplicate keys become :class:`InputError`."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InputError(
                [InputProblem(str(path), None, "", "file not found", "pass the right file with --inventory/-i")]
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError([InputProblem(str(path), None, "", f"cannot read: {exc}")]) from None
        return cls.parse(text, path)

    @classmethod
    def parse(cls, text: str, path: str | Path = "<string>") -> YamlSource:
        path = Path(path)
        yaml = YAML(typ="rt")
        yaml.allow_duplicate_keys = False
        try:
            data = yaml.load(text)
        except DuplicateKeyError as exc:
            mark = exc.problem_mark
            line = mark.line + 1 if mark is not None else None
            raise InputError(
                [
                    InputProblem(
                        str(path), line, "", f"duplicate key: {exc.problem}", "each key may appear once in a mapping"
                    )
                ]
            ) from None
        except MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else None
            what = exc.problem or exc.context or "invalid YAML"
            raise InputError(
                [
                    InputProblem(
                        str(path), line, "", f"YAML syntax error: {what}", "check indentation, colons and quoting"
                    )
                ]
            ) from None
        return cls(path, data)

    def line_of(self, path: FieldPath) -> int | None:
        """1-based line of the deepest part of ``path`` that exists in the document."""
        node = self.data
        line: int | None = None
        for part in path:
            try:
                if isinstance(node, CommentedMap) and part in node:
                    pos = node.lc.key(part)
                elif isinstance(node, CommentedSeq) and isinstance(part, int) and 0 <= part < len(node):
                    pos = node.lc.item(part)
                else:
                    break
            except (KeyError, IndexError):  # a key merged in with <<: *anchor has no position here
                pos = None
            line = pos[0] + 1 if pos else line
            node = node[part]
        if line is None and isinstance(self.data, (CommentedMap, CommentedSeq)):
            line = self.data.lc.line + 1
        return line

    def problem(self, path: FieldPath, problem: str, hint: str = "") -> InputProblem:
        return InputProblem(str(self.path), self.line_of(path), field_name(path), problem, hint)
