"""Lease trials: on an emulated lab (a server and a Jetson), a controller runs bench/kill_trials.py's small
campaign; while it holds the lab, a second controller's `testbed run` of another campaign is timed until
it is refused (the holder named, nothing written); the first is then killed with SIGKILL, the time until
its leases expire is measured against the ttl, and `--resume` must finish the campaign and give the
leases back.

    python bench/leases.py                 # 3 trials, ttl 8 s
    python bench/leases.py --trials 5 --ttl-s 12

Writes bench/results/leases.json. Needs root; brings its own lab up (prefix lbk, subnets 10.154/155).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emulated_lab, summary, write
from bench.kill_trials import campaign_text, inventory_text, ledger_rows, start_controller

REPO = Path(__file__).resolve().parent.parent


def _cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, check=False)  # fmt: skip


def _leases(inventory: Path) -> list[dict]:
    return json.loads(_cli("lab", "leases", "-i", str(inventory), "--json").stdout)


def _wait(condition, limit_s: float) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > limit_s:
            raise SystemExit(f"not within {limit_s} s")
        time.sleep(0.1)
    return time.monotonic() - started


def trial(inventory: Path, directory: Path, ttl_s: float) -> dict:
    first, second = directory / "first.yaml", directory / "second.yaml"
    first.write_text(campaign_text(inventory, "first"))
    second.write_text(campaign_text(inventory, "second"))
    controller = start_controller(first, directory / "out-first")
    try:
        _wait(lambda: all(row["live"] for row in _leases(inventory)), 120)
        started = time.monotonic()
        refused = _cli("run", str(second), "--out", str(directory / "out-second"))
        refused_s = time.monotonic() - started
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait(timeout=60)
    killed = time.monotonic()
    _wait(lambda: not any(row["live"] for row in _leases(inventory)), 4 * ttl_s)
    expired_after_kill_s = time.monotonic() - killed
    resumed = _cli("run", str(first), "--out", str(directory / "out-first"), "--resume", timeout_s=600)
    states = [state for _id, state, _attempts in ledger_rows(directory / "out-first")]
    return {"refused_s": round(refused_s, 3), "refused_exit": refused.returncode,
            "holder_named": "leased to" in refused.stderr,
            "second_wrote_nothing": not (directory / "out-second" / "ledger.sqlite").exists(),
            "expired_after_kill_s": round(expired_after_kill_s, 2), "resume_exit": resumed.returncode,
            "runs_done": states.count("done"), "runs": len(states),
            "leases_left": sum(1 for row in _leases(inventory) if row["lease"] is not None)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--ttl-s", type=float, default=8.0)
    parser.add_argument("--out", default="leases", help="results name or path (.json)")
    args = parser.parse_args()
    os.environ["TESTBED_LEASE_TTL_S"] = str(args.ttl_s)
    trials = []
    with emulated_lab(lambda state: inventory_text(state, "lbk", 154)) as lab:
        for number in range(args.trials):
            with tempfile.TemporaryDirectory() as tmp:
                trials.append(trial(lab.path, Path(tmp), args.ttl_s))
                print(f"trial {number + 1}: {trials[-1]}", flush=True)
    path = write(args.out, {
        "what": "a second controller refused while a first holds the lab; the first SIGKILLed; expiry; --resume",
        "ttl_s": args.ttl_s,
        "refused_s": summary([t["refused_s"] for t in trials]),
        "expired_after_kill_s": summary([t["expired_after_kill_s"] for t in trials]),
        "all_refused_naming_the_holder": all(t["refused_exit"] == 1 and t["holder_named"] for t in trials),
        "all_resumed_and_released": all(t["resume_exit"] == 0 and t["runs_done"] == t["runs"]
                                        and t["leases_left"] == 0 for t in trials),
        "trials": trials,
    })  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
