"""The tiny model's held-out text: standard-library ``.py`` files that its training left out.

``scripts/train_tiny.py`` trains on this interpreter's standard library (test directories and
site-packages skipped, files sorted) and holds a file out when ``sha1(relative path) % every == 0``
(``every`` = ``held_out_every`` in the checkpoint's ``training.json``, 20 by default), with this
module's :func:`corpus_files` and :func:`is_held_out`: the rule has this one home. The text is read from
``sysconfig.get_paths()["stdlib"]`` when a schedule is built and never copied into the repository;
:func:`corpus_sha256` is the script's corpus digest, to compare with ``training.json``.

Held-out is not the same as unseen: generated files (the ``encodings`` codec tables) repeat long
runs of lines of training files. :meth:`Corpus.seen_in_training` tells whether a snippet occurs
verbatim in a training file, so that prompt sources can draw again.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

from foundation.errors import TestbedError

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
DEFAULT_HELD_OUT_EVERY = 20


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def corpus_files(root: str) -> list[str]:
    """The training script's corpus: every ``.py`` under ``root`` outside the skipped directories, sorted."""
    files: list[str] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS)
        files.extend(os.path.join(directory, n) for n in sorted(names) if n.endswith(".py"))
    return sorted(files)


def is_held_out(relative_path: str, every: int) -> bool:
    return int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % every == 0


def held_out_every(model_dir: str | Path) -> int:
    """``held_out_every`` from the checkpoint's ``training.json``; 20 (the script's default) without one."""
    try:
        settings = json.loads((Path(model_dir) / "training.json").read_text(encoding="utf-8"))
        every = int(settings["hyperparameters"]["held_out_every"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_HELD_OUT_EVERY
    return every if every >= 1 else DEFAULT_HELD_OUT_EVERY


def corpus_sha256(root: str | None = None) -> str:
    """The training script's digest of the whole corpus (``training.json`` corpus.sha256)."""
    root = root or stdlib_root()
    digest = hashlib.sha256()
    for path in corpus_files(root):
        digest.update(os.path.relpath(path, root).encode() + b"\0" + _read(path).encode("utf-8", "replace"))
    return digest.hexdigest()


@dataclass(frozen=True)
class Corpus:
    """Held-out files joined in sorted order (each ending in a newline)."""

    root: str
    every: int
    relative_paths: tuple[str, ...]
    text: str = field(repr=False)
    file_starts: tuple[int, ...] = field(repr=False)  # character offset of each file in ``text``
    line_starts: tuple[int, ...] = field(repr=False)  # character offset of every line
    nonblank_lines: tuple[int, ...] = field(repr=False)  # indices into line_starts: where snippets may start

    def window(self, start: int, chars: int) -> str:
        """``chars`` characters from ``start``, wrapping from the last file to the first."""
        chars = min(chars, len(self.text))
        end = start + chars
        return self.text[start:end] if end <= len(self.text) else self.text[start:] + self.text[: end - len(self.text)]

    def locate(self, offset: int) -> tuple[str, int]:
        """(relative path, 1-based line) of a character offset."""
        index = bisect.bisect_right(self.file_starts, offset) - 1
        line = self.text.count("\n", self.file_starts[index], offset) + 1
        return self.relative_paths[index], line

    def seen_in_training(self, start: int, text: str) -> bool:
        """Whether ``text`` (which begins at ``start``) occurs verbatim in a training file.

        Fast path: a whole line inside the snippet (after its first) that no training file has
        proves it unseen; otherwise search the training text."""
        end = start + len(text) - 4  # margin: the last character may be a cut multi-byte one
        j = bisect.bisect_right(self.line_starts, start)
        while j + 1 < len(self.line_starts) and self.line_starts[j + 1] <= end:
            line = self.text[self.line_starts[j] : self.line_starts[j + 1] - 1]
            if line not in self._training.lines:
                return False
            j += 1
        return text in self._training.text

    @cached_property
    def _training(self) -> _TrainingText:
        return _training_text(self.every, self.root)


def held_out_corpus(every: int = DEFAULT_HELD_OUT_EVERY, root: str | None = None) -> Corpus:
    return _held_out_corpus(every, root or stdlib_root())


def training_texts(every: int = DEFAULT_HELD_OUT_EVERY, root: str | None = None) -> list[str]:
    """The texts of the files the tiny model was trained on."""
    root = root or stdlib_root()
    return [_read(p) for p in corpus_files(root) if not is_held_out(os.path.relpath(p, root), every)]


@dataclass(frozen=True)
class _TrainingText:
    text: str  # every training file, joined by NUL (which no file contains)
    lines: frozenset[str]


@lru_cache(maxsize=2)
def _training_text(every: int, root: str) -> _TrainingText:
    texts = training_texts(every, root)
    return _TrainingText("\0".join(texts), frozenset(line for t in texts for line in t.split("\n")))


@lru_cache(maxsize=4)
def _held_out_corpus(every: int, root: str) -> Corpus:
    paths, texts = [], []
    for path in corpus_files(root):
        relative = os.path.relpath(path, root)
        if is_held_out(relative, every):
            text = _read(path)
            if text.strip():
                paths.append(relative)
                texts.append(text if text.endswith("\n") else text + "\n")
    if not paths:
        raise TestbedError(f"{root}: no held-out .py files (every={every}); the tiny model's corpus is missing")
    file_starts, offset = [], 0
    for text in texts:
        file_starts.append(offset)
        offset += len(text)
    joined = "".join(texts)
    line_starts, nonblank, position = [], [], 0
    for line in joined[:-1].split("\n"):  # the text ends with a newline: no line after it
        if line.strip():
            nonblank.append(len(line_starts))
        line_starts.append(position)
        position += len(line) + 1
    return Corpus(root, every, tuple(paths), joined, tuple(file_starts), tuple(line_starts), tuple(nonblank))


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()
