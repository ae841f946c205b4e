"""Which code a result came from: the checkout's commit, whether it had uncommitted changes, and a hash
of them (campaign manifests and benchmark results record it, so a number can be traced to its code)."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GENERATED = ("bench/results", "docs/reproductions")  # results and the pages made of them: not code changes


def git_provenance(repo: Path = REPO, leave_out: tuple[str, ...] = GENERATED) -> dict[str, Any]:
    """The checkout's commit and a sha256 of its uncommitted changes (diff and untracked names), the paths
    in ``leave_out`` not counted (where results are written: a result is not a change of the code)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "note": f"{repo} is not a git checkout"}
    paths = ["--", ".", *(f":(exclude){path}" for path in leave_out)]
    diff = git("diff", "HEAD", "--binary", *paths) or ""
    untracked = git("ls-files", "--others", "--exclude-standard", *paths) or ""
    dirty = bool(diff or untracked)
    digest = hashlib.sha256((diff + "\0" + untracked).encode()).hexdigest() if dirty else None
    return {"commit": commit.strip(), "dirty": dirty, "uncommitted_sha256": digest}


def code_sha256(paths: list[str] | tuple[str, ...], repo: Path = REPO) -> str:
    """A sha256 of the code a result depends on: every file git tracks under ``paths`` (files, folders or
    globs relative to the checkout), by name and content as they are in the working tree now, so that a
    result records what it ran and a page can say when the code moved on. Untracked files do not count
    (a result file next to the code does not make it stale). A path written ``!PATH`` is left out."""
    specs = [f":(exclude){p[1:]}" if p.startswith("!") else p for p in paths]
    try:
        done = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--", *specs], capture_output=True,
                              timeout=60, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"{repo}: cannot list the tracked files of {', '.join(paths)}: {exc}") from exc
    names = sorted(n for n in done.stdout.decode().split("\0") if n)
    wanted = [p for p in paths if not p.startswith("!") and not any(c in p for c in "*?[")]
    missing = [p for p in wanted if not any(n == p or n.startswith(p.rstrip("/") + "/") for n in names)]
    if missing:
        raise ValueError(f"no tracked file under {', '.join(missing)} in {repo}")
    digest = hashlib.sha256()
    for name in names:
        path = repo / name
        content = path.read_bytes() if path.is_file() else b""  # deleted in the working tree: counts as empty
        digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()
