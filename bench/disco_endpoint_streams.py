"""Can DiSCo's trace endpoint keep a trace's token gaps with several streams at once on this host?

Serves ``--streams`` concurrent streams (each ``--requests`` requests in turn, threads as the HTTP server
runs them) on the endpoint's model, paced by a service trace (GPT's by default: 0.40 s median TTFT,
12.5 ms median gaps), twice in one run: one forward pass per stream at a time (``max_streams=1``, the
endpoint before batching) and one pass for every stream waiting (:class:`StepBatcher`). Per mode and
stream count: the share of tokens that overran their pace (computed after their due time or released
late; :mod:`nodes.contracts.paced_steps`) with a 95% interval (bootstrap over requests), the first
token's and the gaps' apart; the share computed after its due time (the host's compute fell behind,
as opposed to a wake-up released late); the median and p99 of how late tokens were released; and the
streams a pass computed on average.

    .venv/bin/python bench/disco_endpoint_streams.py --streams 1,2,4,8     # bench/results/disco_endpoint_streams.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd
import torch

from analysis.uncertainty import mean_interval
from bench._common import write
from nodes.endpoints.generator import PacedGenerator
from nodes.endpoints.pace import pace_named

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ("def add(a, b):", "import os\n", "class Point:", "# sum a list", "for i in range(10):",
           "while True:", "x = [1, 2, 3]", "def main():")  # fmt: skip
HANG_S = 600.0  # a mode's streams that take longer than this are a hang: the bench fails


def serve(model: str, max_streams: int | None, streams: int, requests: int, tokens: int, service: str,
          seed: int) -> tuple[pd.DataFrame, dict[str, int]]:  # fmt: skip
    """Every token of ``streams`` threads x ``requests`` (stream, request, index, overran) and the
    batcher's counts."""
    generator = PacedGenerator(model, max_streams=max_streams)
    rows: list[tuple[int, int, int, bool, bool, float]] = []
    lock = threading.Lock()
    start = threading.Barrier(streams)

    def stream(i: int) -> None:
        pace = pace_named("trace", service, seed=seed + i)
        start.wait(timeout=HANG_S)
        for r in range(requests):
            prompt = generator.encode(PROMPTS[(i + r) % len(PROMPTS)])
            out = [(i, r, e.index, e.overran, e.real_s > e.target_s, e.late_s)
                   for e in generator.stream(prompt, tokens, pace, stop_at_eos=False)]  # fmt: skip
            with lock:
                rows.extend(out)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + HANG_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if any(thread.is_alive() for thread in threads):
        raise SystemExit(f"{streams} streams did not finish within {HANG_S:.0f} s")
    counts = {"passes": generator.batcher.passes, "steps": generator.batcher.steps}
    return pd.DataFrame(rows, columns=["stream", "request", "index", "overran", "computed_over", "late_s"]), counts


def shares(tokens: pd.DataFrame) -> dict[str, Any]:
    """Overran shares, each a ratio of sums over requests with its interval: all tokens, first, gaps."""
    out: dict[str, Any] = {"tokens": len(tokens)}
    for name, part in (("all", tokens), ("first_token", tokens[tokens["index"] == 0]),
                       ("gaps", tokens[tokens["index"] > 0])):  # fmt: skip
        per_request = part.groupby(["stream", "request"])["overran"].agg(["sum", "count"])
        out[f"overran_share_{name}"] = mean_interval(per_request["sum"], per_request["count"]).as_dict()
    over = tokens.groupby(["stream", "request"])["computed_over"].agg(["sum", "count"])
    out["computed_over_share"] = mean_interval(over["sum"], over["count"]).as_dict()
    out["late_ms_p50"] = round(float(tokens["late_s"].quantile(0.5)) * 1e3, 3)
    out["late_ms_p99"] = round(float(tokens["late_s"].quantile(0.99)) * 1e3, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "models" / "tiny"), help="the endpoint's model")
    parser.add_argument("--streams", default="1,2,4,8", help="comma-separated stream counts")
    parser.add_argument("--requests", type=int, default=4, help="requests each stream makes in turn")
    parser.add_argument("--tokens", type=int, default=48, help="tokens a request generates")
    parser.add_argument("--service", default="gpt", help="the service trace that paces the tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a campaign's ranks use 1)")
    parser.add_argument("--out", default="disco_endpoint_streams", help="result name or .json path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    rows = []
    for streams in (int(s) for s in args.streams.split(",")):
        for mode, max_streams in (("one_stream_a_pass", 1), ("batched", None)):
            tokens, counts = serve(args.model, max_streams, streams, args.requests, args.tokens, args.service,
                                   args.seed)  # fmt: skip
            row = {"streams": streams, "mode": mode, **shares(tokens), **counts,
                   "streams_per_pass": round(counts["steps"] / max(1, counts["passes"]), 3)}  # fmt: skip
            rows.append(row)
            share = row["overran_share_all"]
            print(f"{streams} streams, {mode}: {share['estimate']:.1%} [{share['low']:.1%}, {share['high']:.1%}] "
                  f"of {row['tokens']} tokens overran, {row['computed_over_share']['estimate']:.1%} computed late; "
                  f"release late by {row['late_ms_p50']:.2f} ms (p50), {row['late_ms_p99']:.2f} ms (p99); "
                  f"{row['streams_per_pass']:.2f} streams a pass")  # fmt: skip
    print(write(args.out, {"model": args.model, "service": args.service, "threads": args.threads,
                           "requests_per_stream": args.requests,
                           "tokens_per_request": args.tokens, "seed": args.seed, "results": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
