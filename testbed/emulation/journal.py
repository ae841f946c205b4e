"""What the emulated testbed made on this host, recorded before it is made.

One JSON object per line, appended and fsynced before the change it describes, so that a controller
killed at any point (SIGKILL included) leaves a record from which ``down`` removes everything, and
nothing else: ``down`` only removes what is recorded here and carries the testbed's name prefix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodes.contracts.durable import append_line


@dataclass(frozen=True)
class JournalEntry:
    kind: str  # bridge, netns, veth, cgroup, process, sysctl, sudoers, user
    name: str
    details: dict[str, Any]


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, kind: str, name: str, **details: Any) -> None:
        """Append one entry and make it durable before the caller changes anything."""
        append_line(self.path, json.dumps({"kind": kind, "name": name, **details}, sort_keys=True))

    def entries(self) -> list[JournalEntry]:
        """Every entry in the order made; a line cut short by a crash is skipped."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.append(JournalEntry(str(data.pop("kind")), str(data.pop("name")), data))
        return out

    def exists(self) -> bool:
        return self.path.exists()
