"""Durable writes, one way for both sides (standard library, Python 3.8): a file is either the old
one or the whole new one after a crash (``write_atomic``: a temporary beside it, flushed, fsynced,
renamed over it, the directory synced), an appended line is on disk before the caller goes on
(``append_line``, ``SyncedLines``; a file they create is in its directory too), and a file or a whole
directory tree moves to a new name only once everything under it is on disk, the rename itself
synced (``rename_durably``). Journals, records, manifests, run plans, provisioning records and
campaign attempt directories are written and moved with these."""

import json
import os
import threading
from typing import Any, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


def _sync_directory(directory: str) -> None:
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot sync a directory
        pass
    finally:
        os.close(fd)


def _sync_file(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # gone, or a dangling link: nothing of it to keep
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: PathLike) -> None:
    """fsync every file and directory under ``path`` (each directory after what it holds), or ``path``
    itself when it is a file."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        _sync_file(path)
        return
    for directory, _subdirectories, files in os.walk(path, topdown=False):
        for name in files:
            _sync_file(os.path.join(directory, name))
        _sync_directory(directory)


def rename_durably(source: PathLike, target: PathLike) -> None:
    """Rename ``source`` (a file or a directory tree) to ``target`` so that a crash leaves it under one
    name or the other with all it holds: what moves is synced first, the directories of both names after."""
    source, target = os.fspath(source), os.fspath(target)
    sync_tree(source)
    os.rename(source, target)
    _sync_directory(os.path.dirname(target))
    if os.path.dirname(source) != os.path.dirname(target):
        _sync_directory(os.path.dirname(source))


def write_atomic(path: PathLike, data: Union[bytes, str], mode: Optional[int] = None) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8) so that a crash leaves the old file or the new one."""
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    temporary = "%s.tmp%d-%d" % (path, os.getpid(), threading.get_ident())  # threads writing one path
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is None else mode)
    try:
        if mode is not None:
            os.fchmod(fd, mode)  # before the fsync: the mode is on disk with the data
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    _sync_directory(directory)


def write_json_atomic(
    path: PathLike, value: Any, mode: Optional[int] = None, **dump: Any
) -> None:
    """``value`` as JSON (``indent=1`` unless given otherwise) with a final newline, written atomically."""
    dump.setdefault("indent", 1)
    write_atomic(path, json.dumps(value, **dump) + "\n", mode=mode)


def append_line(path: PathLike, line: str) -> None:
    """Append ``line`` (a newline is added) with one write and fsync it: the line is whole on disk or
    absent, also when several threads or processes append to the same file."""
    path = os.fspath(path)
    created = not os.path.exists(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        _sync_directory(os.path.dirname(path))


class SyncedLines(object):
    """A file kept open for appending lines, each flushed and fsynced as it is written."""

    def __init__(self, path: PathLike, truncate: bool = False) -> None:
        path = os.fspath(path)
        created = truncate or not os.path.exists(path)
        self._handle = open(path, "w" if truncate else "a", encoding="utf-8")  # noqa: SIM115
        if created:
            os.fsync(self._handle.fileno())
            _sync_directory(os.path.dirname(path))

    def write(self, line: str) -> None:
        self._handle.write(line + "\n")
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> "SyncedLines":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
