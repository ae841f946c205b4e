"""Replays a bandwidth trace on this node: runs each step's tc commands at its time.

Usage: ``python3 link_trace_player.py SCHEDULE.json LOG.jsonl``

The schedule gives ``start_unix_s`` (when t = 0 was, on the controller's clock) and ``steps``
(``t_s``, ``commands``: argv lists, ``rates``: what the step sets, for the log). Step times are
reckoned from one start instant on the monotonic clock, so late steps never push later ones back
(no drift). Each step is logged as one JSON line, flushed and synced, with its actual time.
Standard library only; runs on Python 3.8.
"""

import json
import os
import signal
import subprocess
import sys
import time

COMMAND_TIMEOUT_S = 10.0
MAX_SLEEP_S = 0.5


class Stopped(Exception):
    pass


def _stop(signum, frame):
    raise Stopped()


def _log(out, record):
    out.write(json.dumps(record) + "\n")
    out.flush()
    os.fsync(out.fileno())


def replay(schedule, out):
    """Run the schedule's steps on time; return the number of steps that failed."""
    start_mono = time.monotonic() + (float(schedule["start_unix_s"]) - time.time())
    failed = 0
    for step in schedule["steps"]:
        due = start_mono + float(step["t_s"])
        while True:
            wait = due - time.monotonic()
            if wait <= 0:
                break
            time.sleep(min(wait, MAX_SLEEP_S))
        actual = time.monotonic() - start_mono
        errors = []
        for argv in step["commands"]:
            try:
                proc = subprocess.run(
                    argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=COMMAND_TIMEOUT_S
                )
                if proc.returncode != 0:
                    errors.append("%s: exit %d: %s" % (" ".join(argv), proc.returncode, proc.stderr.decode().strip()))
            except (OSError, subprocess.TimeoutExpired) as exc:
                errors.append("%s: %s" % (" ".join(argv), exc))
        failed += bool(errors)
        _log(
            out,
            {
                "event": "step",
                "t_s": step["t_s"],
                "actual_t_s": round(actual, 4),
                "late_ms": round(1000 * (actual - float(step["t_s"])), 2),
                "unix_s": round(time.time(), 4),
                "rates": step.get("rates", {}),
                "ok": not errors,
                "errors": errors,
            },
        )
    return failed


def main(argv):
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    with open(argv[1]) as f:
        schedule = json.load(f)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    with open(argv[2], "a") as out:
        _log(out, {"event": "start", "unix_s": round(time.time(), 4), "steps": len(schedule["steps"])})
        try:
            failed = replay(schedule, out)
        except Stopped:
            _log(out, {"event": "stopped", "unix_s": round(time.time(), 4)})
            return 0
        _log(out, {"event": "end", "unix_s": round(time.time(), 4), "failed_steps": failed})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
