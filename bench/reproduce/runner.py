"""Running a paper's experiments at a scale, each result written with its provenance.

Each experiment runs as ``python SCRIPT ARGS`` from the checkout with ``$BENCH_RESULT_PATH`` naming a
file of the run's own (bench/_common.write honours it); the runner then adds a ``reproduction`` record
(paper, experiment, scale, the command, the commit with its dirty flag and diff hash, the hash of the
code the result depends on, start time and wall time) and moves the file into place atomically, so a
result on disk is always whole and always says what made it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench._common import RESULT_PATH_VARIABLE, machine
from bench.reproduce.registry import Experiment, Paper
from foundation.provenance import code_sha256

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results" / "reproductions"


def result_path(results: Path, paper: Paper, experiment: Experiment) -> Path:
    return results / paper.key / f"{experiment.name}.json"


def read_result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_current(result: dict[str, Any] | None, experiment: Experiment, scale: str | None = None) -> bool:
    """Whether ``result`` was computed by the code there is now (and at ``scale`` when given)."""
    record = (result or {}).get("reproduction") or {}
    if scale is not None and record.get("scale") != scale:
        return False
    try:
        return record.get("code_sha256") == code_sha256(experiment.depends_on(), REPO)
    except (ValueError, RuntimeError):  # a path it depends on is not tracked (yet): nothing to compare with
        return False


@dataclass(frozen=True)
class Outcome:
    experiment: str
    state: str  # "done", "failed", "kept" (current already, with --resume), "skipped" (needs a GPU)
    wall_s: float
    path: Path | None
    detail: str = ""


def has_gpu() -> bool:
    return Path("/dev/nvidia0").exists()


def run_experiment(paper: Paper, experiment: Experiment, scale: str, results: Path, *,
                   timeout_s: float | None = None, log: Callable[[str], None] = print) -> Outcome:  # fmt: skip
    """Run one experiment at ``scale`` and write its result with provenance (or say why not)."""
    argv = [sys.executable, experiment.script, *experiment.scales[scale]]
    target = result_path(results, paper, experiment)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    try:
        code = code_sha256(experiment.depends_on(), REPO)
    except (ValueError, RuntimeError) as exc:  # e.g. a new script not committed yet: no hash, no result
        return Outcome(experiment.name, "failed", 0.0, None, f"{exc}; commit it first")
    provenance = machine()["git"]
    started_utc = datetime.now(UTC).isoformat(timespec="seconds")
    command = " ".join(shlex.quote(a) for a in ["python", *argv[1:]])
    log(f"{paper.key}/{experiment.name} ({scale}): {command}")
    started = time.monotonic()
    env = dict(os.environ, **{RESULT_PATH_VARIABLE: str(partial)}, BENCH_CODE_SHA256=code, PYTHONPATH=str(REPO))
    try:
        exit_status = subprocess.run(argv, cwd=REPO, env=env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        exit_status = None
    wall_s = time.monotonic() - started
    payload = read_result(partial)
    if exit_status != 0 or payload is None:
        partial.unlink(missing_ok=True)
        why = "timed out" if exit_status is None else f"exit status {exit_status}" if exit_status else "no result"
        return Outcome(experiment.name, "failed", wall_s, None, why)
    if code_sha256(experiment.depends_on(), REPO) != code:
        partial.unlink(missing_ok=True)
        return Outcome(experiment.name, "failed", wall_s, None, "the code changed while it ran; run it again")
    payload["reproduction"] = {
        "paper": paper.key, "experiment": experiment.name, "scale": scale, "command": command,
        "code": list(experiment.depends_on()), "code_sha256": code, "git": provenance,
        "started_utc": started_utc, "wall_s": round(wall_s, 1),
    }  # fmt: skip
    partial.write_text(json.dumps(payload, indent=1) + "\n")
    with partial.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(partial, target)
    return Outcome(experiment.name, "done", wall_s, target)


def reproduce(paper: Paper, scale: str, results: Path = RESULTS, *, only: tuple[str, ...] = (),
              resume: bool = False, log: Callable[[str], None] = print) -> list[Outcome]:  # fmt: skip
    """Run ``paper``'s experiments at ``scale`` (those named in ``only``, or all that have that scale);
    with ``resume``, keep each result that is current at this scale already."""
    outcomes = []
    for experiment in paper.experiments:
        if (only and experiment.name not in only) or scale not in experiment.scales:
            continue
        path = result_path(results, paper, experiment)
        if resume and is_current(read_result(path), experiment, scale):
            outcomes.append(Outcome(experiment.name, "kept", 0.0, path, "current at this scale"))
            continue
        if experiment.gpu and not has_gpu():
            outcomes.append(Outcome(experiment.name, "skipped", 0.0, None, "needs a GPU; this machine has none"))
            continue
        outcome = run_experiment(paper, experiment, scale, results, log=log)
        log(f"{paper.key}/{experiment.name}: {outcome.state} in {outcome.wall_s:.0f} s {outcome.detail}".rstrip())
        outcomes.append(outcome)
    return outcomes
