"""An app that replays its calls of a context-switching trace against the LLM service, as its own
process (LLMS Sec. 4: concurrent apps are separate clients of the one service).

    python -m nodes.context_service.trace_app --socket S --calls CALLS.jsonl --out OUT.jsonl \\
        --origin-monotonic-s T

Each call waits for its ``arrival_s`` after the origin (the device rank's start, on the shared
monotonic clock), makes its context where the app has none yet (or begins it again where the trace
restarts it: delete, then new), and sends its prompt with the ground truth teacher-forced, in token
ids. One JSON line per call goes to OUT as the call ends (flushed): its times on the origin's clock,
the service's record of the switch (what was missing, read, recomputed and written, and how long
until the context was resident), and prefill and decode seconds. A refused call is a line with
``completed`` false and the service's reason; the app goes on with its next call.
"""

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

from .client import ContextClient, ServiceRefused


def replay(client: ContextClient, calls: List[Dict[str, Any]], origin_s: float, out: Any, app: str) -> int:
    """Replay ``calls`` (this app's rows, in arrival order); the number that failed."""
    contexts: Dict[str, str] = {}  # the trace's context name -> the service's id
    failed = 0
    for call in calls:
        wait = origin_s + float(call["arrival_s"]) - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        sent = time.monotonic() - origin_s
        name = str(call["context"])
        row: Dict[str, Any] = {"request_id": int(call["request_id"]), "app": app, "context": name,
                               "arrival_s": float(call["arrival_s"]), "sent_s": round(sent, 6),
                               "restart": bool(call.get("restart"))}  # fmt: skip
        try:
            if name in contexts and call.get("restart"):
                client.delete(contexts.pop(name))
            if name not in contexts:
                contexts[name] = client.new_context(app)
            record = client.call_ids(contexts[name], list(call["prompt_ids"]), list(call["ground_truth_ids"]))
            row.update(completed=True, done_s=round(time.monotonic() - origin_s, 6),
                       prompt_tokens=record["prompt_tokens"], output_tokens=len(record["output_ids"]),
                       context_tokens=record["context_tokens"], prefill_s=record["prefill_s"],
                       decode_s=record["decode_s"], switch=record["switch"])  # fmt: skip
        except (ServiceRefused, OSError, ValueError) as exc:
            failed += 1
            row.update(completed=False, done_s=round(time.monotonic() - origin_s, 6), error=str(exc))
        out.write(json.dumps(row, sort_keys=True) + "\n")
        out.flush()
    return failed


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.context_service.trace_app", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--socket", required=True, help="the service's Unix socket")
    parser.add_argument("--calls", required=True, help="this app's calls, JSON lines (schedule rows)")
    parser.add_argument("--out", required=True, help="where each call's record goes, JSON lines")
    parser.add_argument("--origin-monotonic-s", type=float, required=True, help="time.monotonic() of arrival 0")
    parser.add_argument("--app", default="app", help="the app's name (its contexts are its own)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="the longest one call may take")
    args = parser.parse_args(argv)
    with open(args.calls, encoding="utf-8") as handle:
        calls = sorted((json.loads(line) for line in handle if line.strip()), key=lambda c: c["arrival_s"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as out:
        failed = replay(ContextClient(args.socket, args.timeout_s), calls, args.origin_monotonic_s, out, args.app)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
