"""YAML files loaded with their line numbers, so every problem can name ``FILE:LINE: field``.

A user file is bounded before it is parsed (its size, how deep it nests, how long a number is) and after
(how many values its aliases expand to), so that no file can make the parser or a validator run out of
stack, memory or time; :func:`text_problems` finds control and format characters in any key or value.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.constructor import DuplicateKeyError
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from foundation.errors import InputError, InputProblem

FieldPath = Sequence[str | int]

MAX_FILE_BYTES = 16 * 1024 * 1024  # a user file (inventory, campaign, profile, links file, trace)
MAX_NESTING = 64  # levels of flow brackets, or of indentation in steps of two spaces
MAX_NUMBER_DIGITS = 400  # digits in one number (Python refuses to convert 4300)
MAX_VALUES = 1_000_000  # scalars a document expands to, aliases followed

# Characters no key or value may hold: C0/C1 controls (tab and newline allowed in values), format
# characters (bidi overrides, zero widths), line and paragraph separators, surrogates, private use.
_BAD_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
_DIGIT_RUN = re.compile("[0-9]{" + str(MAX_NUMBER_DIGITS + 1) + ",}")


def read_user_text(path: Path, hint: str = "") -> str:
    """The text of a user file, bounded in size and decoded as UTF-8; problems as :class:`InputError`
    (a file that is not UTF-8 is named at the line of its first bad byte)."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise InputError([InputProblem(str(path), 1, "", f"the file is {size / 2**20:.1f} MiB, more than a user "
                                           f"file may be ({MAX_FILE_BYTES // 2**20} MiB)", "is it the right file?")])
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError([InputProblem(str(path), None, "", "file not found", hint)]) from None
    except OSError as exc:
        raise InputError([InputProblem(str(path), None, "", f"cannot read: {exc.strerror or exc}")]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise InputError([InputProblem(str(path), line, "", f"byte {raw[exc.start]:#04x} is not UTF-8 text",
                                       "save the file as UTF-8")]) from None


def bad_character(text: str, *, in_value: bool) -> str | None:
    """The first character of ``text`` no user file may hold (``repr`` of it), or None."""
    for char in text:
        if in_value and char in "\t\n":
            continue
        if unicodedata.category(char) in _BAD_CATEGORIES:
            return f"U+{ord(char):04X}"
    return None


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
        hint = "pass the right file with --inventory/-i (or set TESTBED_INVENTORY)"
        return cls.parse(read_user_text(path, hint), path)

    @classmethod
    def parse(cls, text: str, path: str | Path = "<string>") -> YamlSource:
        path = Path(path)
        problem = _shape_problem(text, path)
        if problem is not None:
            raise InputError([problem])
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
            raise InputError([InputProblem(str(path), line, "", f"YAML syntax error: {what}",
                                           _syntax_hint(text, line))]) from None  # fmt: skip
        except YAMLError as exc:  # e.g. a character YAML does not allow, before any token
            position = getattr(exc, "position", None)
            line = text[:position].count("\n") + 1 if isinstance(position, int) else 1
            raise InputError([InputProblem(str(path), line, "", f"YAML error: {_first_line(exc)}",
                                           "remove control characters; save the file as UTF-8 text")]) from None
        except (ValueError, RecursionError) as exc:  # beyond the bounds _shape_problem checks; never a traceback
            raise InputError([InputProblem(str(path), 1, "", f"cannot read the YAML: {_first_line(exc)}",
                                           "check the file")]) from None
        source = cls(path, data)
        if _count_values(data, MAX_VALUES) > MAX_VALUES:
            raise InputError([InputProblem(str(path), 1, "", f"the document expands to more than {MAX_VALUES} "
                                           "values (aliases of aliases?)", "write each value once")])  # fmt: skip
        return source

    def line_of(self, path: FieldPath) -> int:
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
        return line if line is not None else 1  # the document itself (empty, or one scalar)

    def problem(self, path: FieldPath, problem: str, hint: str = "") -> InputProblem:
        return InputProblem(str(self.path), self.line_of(path), field_name(path), problem, hint)

    def text_problems(self) -> list[InputProblem]:
        """Every key and value (at any depth) that holds a character no user file may: control and format
        characters reach terminals, shells and file names as something else than they look."""
        return [self.problem(path, f"{'the key' if is_key else 'the value'} holds the character {char}, a control "
                             "or format character", "write plain text (letters, digits, punctuation, spaces)")
                for path, char, is_key in _bad_strings(self.data, ())]  # fmt: skip


def beside(first: Sequence[InputProblem], more: Sequence[InputProblem]) -> list[InputProblem]:
    """``first`` and those of ``more`` at fields ``first`` does not name (one problem a field: a value
    with a control character is not also reported as breaking the field's pattern)."""
    named = {(p.file, p.field) for p in first}
    return [*first, *(p for p in more if (p.file, p.field) not in named)]


def _bad_strings(data: Any, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], str, bool]]:
    if isinstance(data, dict):
        for key, value in data.items():
            char = bad_character(key, in_value=False) if isinstance(key, str) else None
            if char is not None:
                yield (*path, key), char, True
            else:
                yield from _bad_strings(value, (*path, key) if isinstance(key, (str, int)) else path)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _bad_strings(value, (*path, i))
    elif isinstance(data, str):
        char = bad_character(data, in_value=True)
        if char is not None:
            yield path, char, False


_UNQUOTED_RANGE = re.compile(r"[A-Za-z0-9_.-]*\[[0-9]+:[0-9]+\][A-Za-z0-9_.-]*")


def _syntax_hint(text: str, line: int | None) -> str:
    """What to check at a syntax error: quoting, where the line holds a host range (``xavier-[01:20]``,
    which a flow list or mapping reads as a nested list)."""
    lines = text.splitlines()
    found = _UNQUOTED_RANGE.search(lines[line - 1]) if line and 0 < line <= len(lines) else None
    if found is not None:
        return f'a host range inside [ ] or {{ }} needs quotes: "{found.group(0)}"'
    return "check indentation, colons and quoting"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _shape_problem(text: str, path: Path) -> InputProblem | None:
    """The first line that nests deeper or writes a longer number than any user file needs (the parser
    would recurse out of its stack, or Python refuse the number): checked before parsing."""
    depth = 0
    for number, line in enumerate(text.splitlines(), start=1):
        if _DIGIT_RUN.search(line):
            return InputProblem(str(path), number, "", f"a number of more than {MAX_NUMBER_DIGITS} digits",
                                "write a number in the range the field takes")  # fmt: skip
        indent = len(line) - len(line.lstrip(" "))
        depth, deepest = _flow_depth(line, depth)
        if indent > 2 * MAX_NESTING or deepest > MAX_NESTING:
            return InputProblem(str(path), number, "", f"nests more than {MAX_NESTING} levels deep",
                                "no user file needs that many levels")  # fmt: skip
    return None


def _flow_depth(line: str, depth: int) -> tuple[int, int]:
    """Flow brackets open after ``line`` and the most open within it, outside quotes and comments (a
    bound, not a parse)."""
    deepest, quote = depth, ""
    for char in line:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#":
            break
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    return depth, deepest


def _count_values(data: Any, limit: int) -> int:
    """Scalars in ``data`` with aliases followed, counting stops past ``limit``."""
    count, stack = 0, [data]
    while stack and count <= limit:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.values())
            count += len(node)
        elif isinstance(node, (list, tuple, set)):
            stack.extend(node)
        else:
            count += 1
    return count

