"""Which code a result came from: the checkout's commit, whether it had uncommitted changes, and a hash
of them (campaign manifests and benchmark results record it, so a number can be traced to its code)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def git_provenance(repo: Path = REPO) -> dict[str, Any]:
    """The checkout's commit and a sha256 of its uncommitted changes (diff and untracked names)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "note": f"{repo} is not a git checkout"}
    diff = git("diff", "HEAD", "--binary") or ""
    untracked = git("ls-files", "--others", "--exclude-standard") or ""
    dirty = bool(diff or untracked)
    digest = hashlib.sha256((diff + "\0" + untracked).encode()).hexdigest() if dirty else None
    return {"commit": commit.strip(), "dirty": dirty, "uncommitted_sha256": digest}
