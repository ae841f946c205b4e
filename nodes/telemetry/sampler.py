"""The telemetry sampler: runs on the node, detached from the SSH session that started it, and
appends rows to a file until it is stopped (SIGTERM) or its time limit passes.

Usage::

    python3 -m nodes.telemetry.sampler --source jetson --interval-ms 100 --out FILE --max-seconds 600
    python3 -m nodes.telemetry.sampler --probe --source nvml --source host

``--probe`` takes two samples and prints, as JSON, every sensor with its value or the reason it
has none. Standard library only (plus nvidia-ml-py for ``nvml``); runs on Python 3.8.
"""

import argparse
import json
import os
import platform
import resource
import signal
import sys
import time
from typing import List, Optional

from nodes.contracts.telemetry_rows import RowWriter
from nodes.contracts.tool_errors import NODE_FAILED, error_answer
from nodes.telemetry.source import Source
from nodes.telemetry.sources import NAMES, UnknownSource, build_source


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def record(source: Source, out: str, interval_s: float, max_seconds: float, header: dict) -> int:
    """Write batches until SIGTERM or ``max_seconds``; returns the number of rows written."""
    stop = [False]

    def on_term(signum, frame):  # type: ignore[no-untyped-def]
        stop[0] = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # survive the SSH session that started us
    deadline = time.monotonic() + max_seconds
    started = time.monotonic()

    def stopping() -> bool:
        return stop[0] or time.monotonic() >= deadline

    writer = RowWriter(out, header)
    batches = 0
    try:
        for batch in source.batches(interval_s, stopping):
            writer.write(batch)
            batches += 1
            if batches == 1:  # what the source learnt from its first reading (stand-in mark, current sign)
                writer.comment("source " + json.dumps(source.header, sort_keys=True))
            if stopping():
                break
        reason = "stopped" if stop[0] else "time limit of %g s reached" % max_seconds
        wall = time.monotonic() - started
        writer.comment(
            "end "
            + json.dumps(
                {
                    "reason": reason,
                    "batches": batches,
                    "rows": writer.rows_written,
                    "wall_s": round(wall, 3),
                    "sampler_cpu_s": round(_cpu_s(), 3),
                }
            )
        )
    finally:
        source.close()
        writer.close()
    return writer.rows_written


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="nodes.telemetry.sampler", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", choices=NAMES, required=True, help="telemetry source")
    parser.add_argument("--interval-ms", type=int, default=100, help="sampling interval (default 100 ms)")
    parser.add_argument("--out", help="file to append rows to (CSV)")
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="stop by itself after this long")
    parser.add_argument("--node", default=platform.node(), help="node name for the file header")
    parser.add_argument("--serial", help="phone serial (android source)")
    parser.add_argument("--adb", default="adb", help="adb executable (android source)")
    parser.add_argument("--meter-channel", choices=("main", "usb"), default="main", help="monsoon: the output channel")
    parser.add_argument("--meter-vout-v", type=float, default=4.0, help="monsoon: the voltage it supplies")
    parser.add_argument("--meter-log", help="monsoon: where its logger writes its own CSV")
    parser.add_argument("--probe", action="store_true", help="print every sensor's reading as JSON and exit")
    args = parser.parse_args(argv)
    interval_s = args.interval_ms / 1000.0
    if interval_s <= 0 or args.max_seconds <= 0:
        parser.error("--interval-ms and --max-seconds must be positive")
    try:
        source = build_source(args.source, interval_s, serial=args.serial, adb=args.adb,
                              meter_channel=args.meter_channel, meter_vout_v=args.meter_vout_v,
                              meter_log=args.meter_log)  # fmt: skip
    except UnknownSource as exc:
        parser.error(str(exc))
    except Exception as exc:  # a source that cannot start says why, as JSON
        print(error_answer(exc))
        return NODE_FAILED
    if args.probe:
        try:
            sensors = source.probe(interval_s=min(interval_s, 0.5))
        except Exception as exc:
            print(error_answer(exc))
            return NODE_FAILED
        finally:
            source.close()
        print(
            json.dumps(
                {"source": source.name, "header": source.header, "sensors": [s._asdict() for s in sensors]},
                sort_keys=True,
            )
        )
        return 0
    if not args.out:
        parser.error("--out is required unless --probe is given")
    header = {
        "source": source.name,
        "node": args.node,
        "interval_s": interval_s,
        "pid": os.getpid(),
        "start_unix_s": time.time(),
        "python": platform.python_version(),
    }
    header.update(source.header)
    record(source, args.out, interval_s, args.max_seconds, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
