"""Running a paper's experiments at a scale, each result written with its provenance.

Each experiment runs as ``python SCRIPT ARGS`` from the checkout with ``$BENCH_RESULT_PATH`` naming a
file of the run's own (bench/_common.write honours it); the runner then adds a ``reproduction`` record
(paper, experiment, scale, the command, the commit with its dirty flag and diff hash, the hash of the
code the result depends on, start time and wall time) and moves the file into place atomically, so a
result on disk is always whole and always says what made it. A campaign cut short goes on with
``--resume``; the parts it took on the same code are kept beside the result (``.NAME.json.parts``) until
it is whole, and its wall time is their sum.
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
from foundation.child_process import INTERRUPTED_EXIT_STATUS, wait_through_interrupts
from foundation.provenance import code_sha256
from nodes.contracts.durable import write_json_atomic

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
    """Whether ``result`` was computed by the code there is now with the arguments its scale has now (and
    at ``scale`` when given)."""
    record = (result or {}).get("reproduction") or {}
    if scale is not None and record.get("scale") != scale:
        return False
    if not same_arguments(record, experiment):
        return False
    try:
        return record.get("code_sha256") == code_sha256(experiment.depends_on(), REPO)
    except (ValueError, RuntimeError):  # a path it depends on is not tracked (yet): nothing to compare with
        return False


def same_arguments(record: dict[str, Any], experiment: Experiment) -> bool:
    """Whether a result's ``reproduction`` record ran ``experiment`` with the arguments its scale has now
    (resumed or not): the same script and arguments."""
    scale = record.get("scale")
    return scale in experiment.scales and record.get("command") in {
        command_line(experiment_argv(experiment, scale, resume=resume)) for resume in (False, True)}  # fmt: skip


def changed_since(result: dict[str, Any] | None, experiment: Experiment, repo: Path | None = None) -> list[str] | None:
    """The files ``experiment`` depends on that differ now from the commit ``result`` was made on (tracked
    files, as its code hash counts them): why a stale result is stale. None where git cannot say (no
    commit recorded, or that commit is not in this clone); a result made with uncommitted changes may
    list files that it ran as they are now."""
    commit = (((result or {}).get("reproduction") or {}).get("git") or {}).get("commit")
    if not commit:
        return None
    specs = [f":(exclude){p[1:]}" if p.startswith("!") else p for p in experiment.depends_on()]
    try:
        done = subprocess.run(["git", "-C", str(repo or REPO), "diff", "--name-only", commit, "--", *specs],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted(done.stdout.split()) if done.returncode == 0 else None


def state_line(result: dict[str, Any] | None, experiment: Experiment, repo: Path | None = None) -> str:
    """An experiment's result in a few words: none, or its scale, wall time and commit, and whether it is
    current; a stale one names the files that changed since (the first three)."""
    record = (result or {}).get("reproduction") or {}
    if not record:
        return "no result"
    commit = ((record.get("git") or {}).get("commit") or "?")[:10]
    made = f"{record.get('scale')}, {record.get('wall_s', 0) / 60:.1f} min, on {commit}"
    if is_current(result, experiment):
        return f"current ({made})"
    if not same_arguments(record, experiment):
        return f"stale ({made}): its command changed since"
    changed = changed_since(result, experiment, repo)
    if not changed:
        return f"stale ({made}): its code changed since"
    more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
    return f"stale ({made}): {', '.join(changed[:3])}{more} changed since"


@dataclass(frozen=True)
class Outcome:
    experiment: str
    state: str  # "done", "failed", "kept" (current already, with --resume), "skipped" (needs a GPU)
    wall_s: float
    path: Path | None
    detail: str = ""


def has_gpu() -> bool:
    return Path("/dev/nvidia0").exists()


def _earlier_parts(parts: Path, code: str, command: str) -> list[dict[str, Any]]:
    """The parts recorded in ``parts`` before, if they ran this command on this code (a campaign of other
    code, or another scale's, starts afresh, so its parts do not count). A part whose runner was killed
    before it could record its time is missing: the sum is then a lower bound."""
    try:
        recorded = json.loads(parts.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(recorded, dict) or (recorded.get("code_sha256"), recorded.get("command")) != (code, command):
        return []
    return [p for p in recorded.get("parts") or [] if isinstance(p, dict) and "wall_s" in p]


def command_line(argv: list[str]) -> str:
    """How a result records the command that made it: ``python`` and the script's arguments, quoted."""
    return " ".join(shlex.quote(a) for a in ["python", *argv[1:]])


def experiment_argv(experiment: Experiment, scale: str, *, resume: bool = False) -> list[str]:
    """The command that runs ``experiment`` at ``scale``; with ``resume``, a campaign cut short (a killed
    run, a session that ended) goes on where it stopped instead of starting again."""
    args = list(experiment.scales[scale])
    if resume and experiment.resumable and "--resume" not in args:
        args.append("--resume")
    return [sys.executable, experiment.script, *args]


def run_experiment(paper: Paper, experiment: Experiment, scale: str, results: Path, *, resume: bool = False,
                   log: Callable[[str], None] = print) -> Outcome:  # fmt: skip
    """Run one experiment at ``scale`` and write its result with provenance (or say why not)."""
    argv = experiment_argv(experiment, scale, resume=resume)
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
    command = command_line(argv)
    # the parts of a campaign cut short and resumed, with the same code: its wall time is their sum
    campaign = experiment.resumable
    parts = target.with_name(f".{target.name}.parts")
    earlier = _earlier_parts(parts, code, command) if campaign and "--resume" in argv else []
    if not earlier:
        parts.unlink(missing_ok=True)  # a campaign not resumed starts afresh
    log(f"{paper.key}/{experiment.name} ({scale}): {command}")
    started = time.monotonic()
    env = dict(os.environ, **{RESULT_PATH_VARIABLE: str(partial)}, BENCH_CODE_SHA256=code, PYTHONPATH=str(REPO))
    exit_status, interrupted = wait_through_interrupts(subprocess.Popen(argv, cwd=REPO, env=env))
    wall_s = time.monotonic() - started
    payload = read_result(partial)  # none when a campaign stopped with runs left (it writes whole ones only)
    if exit_status != 0 or payload is None:
        partial.unlink(missing_ok=True)
        if campaign:  # the campaign's next --resume goes on from here: keep this part's time for its total
            done = [*earlier, {"started_utc": started_utc, "wall_s": round(wall_s, 1)}]
            write_json_atomic(parts, {"code_sha256": code, "command": command, "parts": done})
        # Ctrl-C, or a campaign stopped on purpose (SIGTERM to `testbed run`), stops the whole reproduction
        if interrupted or (campaign and exit_status == INTERRUPTED_EXIT_STATUS):
            raise KeyboardInterrupt
        why = f"exit status {exit_status}" if exit_status else "no result"
        return Outcome(experiment.name, "failed", wall_s, None, why)
    if code_sha256(experiment.depends_on(), REPO) != code:
        partial.unlink(missing_ok=True)
        return Outcome(experiment.name, "failed", wall_s, None, "the code changed while it ran; run it again")
    payload["reproduction"] = {
        "paper": paper.key, "experiment": experiment.name, "scale": scale, "command": command,
        "code": list(experiment.depends_on()), "code_sha256": code, "git": provenance,
        "started_utc": (earlier[0] if earlier else {}).get("started_utc", started_utc),
        "wall_s": round(wall_s + sum(p["wall_s"] for p in earlier), 1), "parts": len(earlier) + 1,
    }  # fmt: skip
    write_json_atomic(target, payload, mode=0o644)
    partial.unlink()
    parts.unlink(missing_ok=True)
    return Outcome(experiment.name, "done", payload["reproduction"]["wall_s"], target)


def reproduce(paper: Paper, scale: str, results: Path = RESULTS, *, only: tuple[str, ...] = (),
              resume: bool = False, log: Callable[[str], None] = print) -> list[Outcome]:  # fmt: skip
    """Run ``paper``'s experiments at ``scale`` (those named in ``only``, or all that have that scale);
    with ``resume``, keep each result that is current at this scale already and go on with a campaign that
    was cut short (its wall time is then the sum of its parts)."""
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
        outcome = run_experiment(paper, experiment, scale, results, resume=resume, log=log)
        log(f"{paper.key}/{experiment.name}: {outcome.state} in {outcome.wall_s:.0f} s {outcome.detail}".rstrip())
        outcomes.append(outcome)
    return outcomes
