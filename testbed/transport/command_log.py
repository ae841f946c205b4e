"""An audit trail of every command the controller sends to a node.

With ``TESTBED_COMMAND_LOG=<file>`` in the controller's environment, each shell line a transport
runs is appended to ``<file>`` as one JSON object ``{"ts_s", "node", "line"}``, written with one
``write`` on a file opened for appending, so threads of a fan-out never interleave their lines.
This is how a run is checked against its printed plan, and how a user sees what touched a node.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV_VARIABLE = "TESTBED_COMMAND_LOG"
_lock = threading.Lock()


def record(node: str, line: str) -> None:
    """Append ``line`` (as run on ``node``) to the command log, when one is configured."""
    path = os.environ.get(ENV_VARIABLE)
    if not path:
        return
    entry = json.dumps({"ts_s": round(time.time(), 6), "node": node, "line": line}) + "\n"
    with _lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, entry.encode())
        finally:
            os.close(fd)


def read(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """The entries of a command log, in the order they were sent."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
