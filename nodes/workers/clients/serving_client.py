"""A device as a client of the serving engine (streaming methods, ``methods/serving.py``): one rank
per device node that keeps every one of its requests in flight at once.

At each request's arrival it sends the prompt's token ids with the request's QoE expectation
(TTFT_exp, TDS_exp from the schedule) and its token budget, then takes tokens as the engine streams
them. Every token is stamped twice on this rank's clock: ``ts_s`` when it arrived, and ``display_s``
when the client's token buffer shows it (Andes Sec. 5): the first at once, each next one no sooner
than 1 / TDS_exp after the one before (target seconds; times the run's dilation on this clock), so
a burst of tokens is shown at the user's pace and a stall drains what the buffer held.

A request the engine refuses (its prompt alone exceeds the KV capacity) ends with no tokens and
``finished_by: refused``; one that filled the whole capacity alone ends with ``capacity``; one that
failed because its GPU ran out of memory (static batching) ends with ``oom`` and the tokens it had.

Logs, like a device rank's: ``requests.jsonl`` (per request: arrival, first and last token,
the engine's preemptions, swaps and recomputes, the last display time, the tokens and text) and
``tokens.csv`` (``request_id, index, token_id, ts_s, display_s``).
"""

import time
from typing import Any, Dict, List, Optional

import torch
from mpi4py import MPI

from nodes.contracts.records import CsvLog, JsonLinesLog
from nodes.contracts.run_config import RunConfig, ScheduledRequest, load_schedule
from nodes.inference.tokenizer import Tokenizer

from .. import mpi_link, wire
from ..part_cache import PartCache

TOKEN_COLUMNS = ("request_id", "index", "token_id", "ts_s", "display_s")


class _InFlight(object):
    def __init__(self, request: ScheduledRequest, sent_s: float, prompt_tokens: int, upload_bytes: int) -> None:
        self.request, self.sent_s, self.prompt_tokens, self.upload_bytes = request, sent_s, prompt_tokens, upload_bytes
        self.tokens: List[int] = []
        self.stamps: List[float] = []
        self.shown: List[float] = []
        self.download_bytes = 0.0
        self.stats: Optional[List[float]] = None


class ServingClient:
    def __init__(self, config: RunConfig, comm: "MPI.Comm", rank: int, parts: Optional[PartCache] = None) -> None:
        self.config, self.comm, self.rank, self.t0 = config, comm, rank, 0.0
        self.spec = config.ranks[rank]
        self.schedule = load_schedule(self.spec.schedule)
        self.tokenizer = Tokenizer(config.model)
        self.dilation = config.target.dilation if config.target is not None else 1.0

    def start(self, t0: float) -> None:
        self.t0 = t0
        header = {"role": "device", "node": self.spec.node, "method": self.config.method,
                  "scheduler": self.config.serving.scheduler, "clock_origin_monotonic_s": t0,
                  "clock_origin_unix_s": time.time() - (time.monotonic() - t0)}  # fmt: skip
        directory = self.config.rank_dir(self.rank)
        self.requests = JsonLinesLog(directory + "/requests.jsonl", header)
        self.tokens = CsvLog(directory + "/tokens.csv", TOKEN_COLUMNS, header)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        waiting = list(self.schedule)
        open_requests: Dict[int, _InFlight] = {}
        inbox = mpi_link.Inbox(self.comm, mpi_link.TAG_DOWN)
        outbox = mpi_link.Outbox()
        while waiting or open_requests:
            while waiting and waiting[0].arrival_s <= self.now():
                request = waiting.pop(0)
                open_requests[request.request_id] = self._send(request, outbox)
            deadline = self.t0 + waiting[0].arrival_s if waiting else None
            for frame, _, size in inbox.wait(deadline):
                self._take(frame, size, open_requests)
        outbox.wait_all()
        mpi_link.send(self.comm, wire.encode(wire.STOP, 0, []), 0, mpi_link.TAG_UP)
        self.requests.close()
        self.tokens.close()

    def _send(self, request: ScheduledRequest, outbox: "mpi_link.Outbox") -> _InFlight:
        given = request.prompt_ids
        ids = [int(i) for i in given] if given else self.tokenizer.encode(request.prompt or "")
        asked = torch.tensor([[request.max_new_tokens, request.expected_ttft_s or 0.0,
                               request.expected_tds_tok_s or 0.0]], dtype=torch.float32)  # fmt: skip
        frame = wire.encode(wire.DATA, 0, [
            wire.Segment(request.request_id, self.rank, wire.REQUEST, 0, 1, asked),
            wire.Segment(request.request_id, self.rank, wire.PREFILL, 0, len(ids),
                         torch.tensor(ids, dtype=torch.int32).view(-1, 1), wire.LAST_CHUNK),
        ])  # fmt: skip
        sent = self.now()
        outbox.send(self.comm, frame, 0, mpi_link.TAG_UP)
        return _InFlight(request, sent, len(ids), len(frame))

    def _take(self, frame: wire.Frame, size: int, open_requests: Dict[int, _InFlight]) -> None:
        arrived = self.now()
        share = size / max(1, len(frame.segments))  # a frame carries tokens of several requests
        for segment in frame.segments:
            flight = open_requests.get(segment.request_id)
            if flight is None:
                continue
            if segment.phase == wire.STATS:
                flight.stats = segment.payload[0].tolist()
                continue
            if segment.phase != wire.TOKENS:
                continue
            flight.download_bytes += share
            tds = flight.request.expected_tds_tok_s
            for token in segment.payload.view(-1).tolist() if segment.payload is not None else []:
                flight.tokens.append(int(token))
                flight.stamps.append(arrived)
                gap = self.dilation / tds if tds else 0.0  # the buffer's pace, on this clock
                flight.shown.append(arrived if not flight.shown else max(arrived, flight.shown[-1] + gap))
            if segment.flags & wire.DONE:
                self._finish(open_requests.pop(segment.request_id))

    def _finish(self, flight: _InFlight) -> None:
        request, tokens = flight.request, flight.tokens
        self.tokens.write_many([
            {"request_id": request.request_id, "index": i, "token_id": token, "ts_s": round(ts, 6),
             "display_s": round(shown, 6)}
            for i, (token, ts, shown) in enumerate(zip(tokens, flight.stamps, flight.shown))
        ])  # fmt: skip
        preemptions, swaps, recomputes = flight.stats[:3] if flight.stats is not None else (None, None, None)
        if flight.stats is not None and len(flight.stats) > 3 and flight.stats[3]:
            finished_by = "oom"  # its GPU ran out of memory (static batching: nodes.workers.engines.scaling_engine)
        elif not tokens:
            finished_by = "refused"  # its prompt alone does not fit in the engine's KV capacity
        elif tokens[-1] == self.tokenizer.eos_id and not self.config.serving.ignore_eos:
            finished_by = "eos"
        else:
            finished_by = "length" if len(tokens) >= request.max_new_tokens else "capacity"
        record: Dict[str, Any] = {
            "request_id": request.request_id, "node": self.spec.node, "method": self.config.method,
            "prompt_tokens": flight.prompt_tokens, "output_tokens": len(tokens),
            "max_new_tokens": request.max_new_tokens, "finished_by": finished_by,
            "arrival_s": round(request.arrival_s, 6), "start_s": round(flight.sent_s, 6),
            "upload_start_s": round(flight.sent_s, 6), "upload_end_s": round(flight.sent_s, 6),
            "first_token_s": _stamp(flight.stamps, 0), "last_token_s": _stamp(flight.stamps, -1),
            "done_s": round(self.now(), 6),
            "ttft_s": round(flight.stamps[0] - request.arrival_s, 6) if tokens else None,
            "decode": {"steps": max(0, len(tokens) - 1)},  # one token an engine iteration
            "serving": {"scheduler": self.config.serving.scheduler, "preemptions": _whole(preemptions),
                        "swaps": _whole(swaps), "recomputes": _whole(recomputes),
                        "last_display_s": _stamp(flight.shown, -1),
                        # the engine's SLO for it (GPU-rank methods), on this clock like the times above
                        "slo_s": round(flight.stats[4] * self.dilation, 6) if flight.stats is not None
                        and len(flight.stats) > 4 and flight.stats[4] > 0 else None},
            "upload_bytes": flight.upload_bytes, "download_bytes": round(flight.download_bytes),
            "token_ids": tokens, "text": self.tokenizer.decode(tokens),
        }  # fmt: skip
        self.requests.write(record)


def _stamp(stamps: List[float], index: int) -> Optional[float]:
    return round(stamps[index], 6) if stamps else None


def _whole(value: Optional[float]) -> Optional[int]:
    return None if value is None else int(value)
