"""Durable writes, one way for both sides (standard library, Python 3.8): a file is either the old
one or the whole new one after a crash (``write_atomic``: a temporary beside it, flushed, fsynced,
renamed over it, the directory synced), and an appended line is on disk before the caller goes on
(``append_line``, ``SyncedLines``). Journals, records, manifests, run plans and provisioning records
are written with these."""

import json
import os
from typing import Any, Optional, Union


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


def write_atomic(path: Union[str, "os.PathLike[str]"], data: Union[bytes, str], mode: Optional[int] = None) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8) so that a crash leaves the old file or the new one."""
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    temporary = "%s.tmp%d" % (path, os.getpid())
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is None else mode)
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if mode is not None:
        os.chmod(temporary, mode)
    os.replace(temporary, path)
    _sync_directory(directory)


def write_json_atomic(
    path: Union[str, "os.PathLike[str]"], value: Any, mode: Optional[int] = None, **dump: Any
) -> None:
    """``value`` as JSON (``indent=1`` unless given otherwise) with a final newline, written atomically."""
    dump.setdefault("indent", 1)
    write_atomic(path, json.dumps(value, **dump) + "\n", mode=mode)


def append_line(path: Union[str, "os.PathLike[str]"], line: str) -> None:
    """Append ``line`` (a newline is added) with one write and fsync it: the line is whole on disk or
    absent, also when several threads or processes append to the same file."""
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)


class SyncedLines(object):
    """A file kept open for appending lines, each flushed and fsynced as it is written."""

    def __init__(self, path: Union[str, "os.PathLike[str]"], truncate: bool = False) -> None:
        self._handle = open(os.fspath(path), "w" if truncate else "a", encoding="utf-8")  # noqa: SIM115

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
