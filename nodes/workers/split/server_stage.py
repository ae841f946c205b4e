"""A server pipeline stage: continuous batching across devices over the stage's layers.

Stage 0 gathers what devices have sent (prefill hidden states or token ids, decode steps, cache
releases), forms one iteration from all of it, runs its layers on the packed batch and passes the
result on; later stages run theirs on what they receive; the last stage returns deep hidden states
(or, for a method whose device sends token ids, the next token id) to each device. Methods
(``nodes/contracts/methods``) differ only in how stage 0 forms an iteration, by their ``prefill``:

- ``whole`` and ``device_chunks`` (``centralized``, ``ushape``, HAT's): every pending prompt (or
  chunk) is taken whole, beside all decode steps.
- ``server_chunks`` (``usarathi``): decode steps first, then prompt chunks filling a token budget of
  ``chunk_tokens`` (128 by default), so that a long prompt is spread over iterations mixed with decodes.

Every iteration is logged with its batched tokens, compute time and queue wait, and feeds HAT's
state monitor (Eq. 1-2).
"""

import time
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from mpi4py import MPI

from nodes.contracts.records import CsvLog
from nodes.contracts.run_config import RunConfig
from nodes.inference.checkpoint import load_part
from nodes.inference.config import LlamaConfig
from nodes.inference.model import ModelPart
from nodes.inference.model import Segment as CacheSegment
from nodes.inference.partition import UShapePartition

from .. import mpi_link, wire
from ..pacing import PacedPart, pacer_for, target_stage_layers
from ..part_cache import PartCache
from .state_monitor import StateMonitor

ITERATION_COLUMNS = (
    "stage",
    "iteration",
    "start_s",
    "batched_tokens",
    "prefill_tokens",
    "decode_tokens",
    "segments",
    "releases",
    "compute_s",
    "queue_wait_mean_s",
    "queue_wait_max_s",
    "idle_s",
    "mu_tokens",
    "g_predicted_s",
)


def stage_device(requested: str, stage: int) -> str:
    """``cuda`` means one GPU per stage: stage i takes GPU i modulo the GPUs the server has."""
    if requested == "cuda" and torch.cuda.is_available():
        return "cuda:%d" % (stage % torch.cuda.device_count())
    return requested


class _Progress:
    """Stage 0's bookkeeping for one device segment that may be split over iterations."""

    def __init__(self, arrival_s: float) -> None:
        self.arrival_s = arrival_s
        self.first_start_s: Optional[float] = None
        self.compute_s = 0.0


class _Pending(NamedTuple):
    segment: wire.Segment
    info: _Progress  # shared by the pieces of one device segment


def _join_chunk(pending: List[_Pending], segment: wire.Segment) -> bool:
    """Append a prompt chunk to the waiting chunk it continues (one cache takes one segment per
    iteration), keeping the first chunk's arrival; False when no waiting chunk precedes it."""
    if segment.phase != wire.PREFILL:
        return False
    for index, item in enumerate(pending):
        s = item.segment
        if (s.device, s.request_id, s.phase) == (segment.device, segment.request_id, wire.PREFILL) and (
            s.start + s.tokens == segment.start
        ):
            joined = s._replace(
                tokens=s.tokens + segment.tokens, payload=torch.cat([s.payload, segment.payload]), flags=segment.flags
            )
            pending[index] = _Pending(joined, item.info)
            return True
    return False


class ServerStage:
    def __init__(self, config: RunConfig, comm: "MPI.Comm", rank: int, parts: Optional[PartCache] = None) -> None:
        self.config, self.comm, self.rank, self.t0 = config, comm, rank, 0.0
        self.stage = config.ranks[rank].index
        self.last = self.stage == config.stages - 1
        model_config = LlamaConfig.load(config.model)
        partition = UShapePartition.make(model_config.num_hidden_layers, config.server_device_layers, config.stages)
        centralized = config.method_spec.token_ids_only
        parts = parts if parts is not None else PartCache()
        layers = tuple(partition.stage_layer_ids()[self.stage])
        embedding, head = centralized and self.stage == 0, centralized and self.last
        device = stage_device(config.ranks[rank].torch_device, self.stage)
        self.part: ModelPart = parts.get(
            ("part", config.model, layers, embedding, head, config.dtype, device),
            lambda: load_part(config.model, layers, embedding=embedding, head=head, dtype=config.dtype, device=device),
            "stage %d part: layers %s%s%s" % (self.stage, list(layers), ", embedding" if embedding else "",
                                               ", head" if head else ""),
        )  # fmt: skip
        self.pacer = pacer_for(config, rank)
        if self.pacer is not None:  # the target's layers of this stage, at the target GPU's speed
            self.part = PacedPart(self.part, self.pacer, target_stage_layers(config, self.stage), "stage")
        self.caches: Dict[Tuple[int, int], object] = {}
        self.monitor = StateMonitor()
        self.outbox = mpi_link.Outbox()
        self.iteration = 0
        self.log: Optional[CsvLog] = None

    def start(self, t0: float) -> None:
        """Take the clock origin (at the start barrier) and open the iteration log."""
        self.t0 = t0
        self.log = CsvLog(
            "%s/iterations.csv" % self.config.rank_dir(self.rank),
            ITERATION_COLUMNS,
            {
                "role": "stage",
                "stage": self.stage,
                "node": self.config.ranks[self.rank].node,
                "clock_origin_monotonic_s": t0,
                "clock_origin_unix_s": time.time() - (time.monotonic() - t0),
            },
        )
        if self.pacer is not None:
            header = {"role": "stage", "stage": self.stage, "node": self.config.ranks[self.rank].node,
                      "clock_origin_monotonic_s": t0}  # fmt: skip
            self.pacer.start("%s/steps.csv" % self.config.rank_dir(self.rank), header, t0)

    # -- stage 0: forming iterations ---------------------------------------------------------------
    def serve(self) -> None:
        if self.stage == 0:
            self._serve_first()
        else:
            self._serve_later()
        self.outbox.wait_all()
        self.log.close()
        if self.pacer is not None:
            self.pacer.close()

    def _serve_first(self) -> None:
        devices = set(self.config.device_ranks)
        stopped = set()
        pending: List[_Pending] = []
        releases: List[wire.Segment] = []
        inbox = mpi_link.Inbox(self.comm, mpi_link.TAG_UP)
        idle_since = time.monotonic()
        while True:
            block = not pending and not releases
            if block and stopped == devices:
                break
            frames = inbox.wait() if block else inbox.take()
            now = time.monotonic()
            for frame, source, _ in frames:
                if frame.kind == wire.STOP:
                    stopped.add(source)
                for segment in frame.segments:
                    if segment.phase == wire.RELEASE:
                        releases.append(segment)
                    elif not _join_chunk(pending, segment):
                        pending.append(_Pending(segment, _Progress(now)))
            if not pending and not releases:
                continue
            start = time.monotonic()
            batch, pending = self._form_batch(pending)
            out_segments = []
            waits = []
            for item, piece in batch:
                info = item.info
                if info.first_start_s is None:
                    info.first_start_s = start
                    waits.append(start - info.arrival_s)
                out_segments.append((piece, info))
            self._run_and_forward(out_segments, releases, start, start - idle_since, waits)
            releases = []
            idle_since = time.monotonic()
        self._stop_downstream()

    def _form_batch(self, pending: List[_Pending]) -> Tuple[List[Tuple[_Pending, wire.Segment]], List[_Pending]]:
        """(items taken this iteration with the piece of each, items left for later)."""
        if self.config.method_spec.prefill != "server_chunks":
            return [(item, item.segment) for item in pending], []
        budget = self.config.chunk_tokens
        taken: List[Tuple[_Pending, wire.Segment]] = []
        left: List[_Pending] = []
        for item in pending:
            if item.segment.phase == wire.DECODE:
                taken.append((item, item.segment))
                budget -= item.segment.tokens
        for item in pending:
            s = item.segment
            if s.phase == wire.DECODE:
                continue
            if budget <= 0:
                left.append(item)
                continue
            n = min(budget, s.tokens)
            budget -= n
            if n == s.tokens:
                taken.append((item, s))
                continue
            head = s._replace(tokens=n, payload=s.payload[:n], flags=s.flags & ~wire.LAST_CHUNK)
            rest = s._replace(start=s.start + n, tokens=s.tokens - n, payload=s.payload[n:])
            taken.append((item, head))
            left.append(_Pending(rest, item.info))
        return taken, left

    # -- running the layers ------------------------------------------------------------------------
    def _cache(self, segment: wire.Segment):
        key = (segment.device, segment.request_id)
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = self.part.new_cache(max(256, segment.start + segment.tokens))
        if segment.phase == wire.VERIFY and segment.start < cache.length:
            cache.truncate(segment.start)  # speculative decoding: forget the rejected draft positions
        if cache.length != segment.start:
            raise RuntimeError(
                "request %d of rank %d: segment starts at %d, the stage's cache holds %d"
                % (segment.request_id, segment.device, segment.start, cache.length)
            )
        return cache

    def _compute(self, segments: List[wire.Segment]) -> Tuple[Optional[torch.Tensor], float]:
        if not segments:
            return None, 0.0
        started = time.monotonic()
        with torch.inference_mode():
            payload = torch.cat([s.payload for s in segments])
            centralized_first = self.part.embed_tokens is not None
            hidden = self.part.embed(payload.view(-1).to(torch.long)) if centralized_first else payload
            out = self.part.run_layers(hidden, [CacheSegment(self._cache(s), s.tokens) for s in segments])
            if self.part.lm_head is not None:
                rows, offset = [], 0
                for s in segments:
                    offset += s.tokens
                    rows.append(offset - 1)
                last = out[torch.tensor(rows, device=out.device)]
                out_ids = torch.argmax(self.part.logits(last), dim=-1).to(torch.int32).view(-1, 1)
                out = self._spread_ids(out_ids, segments)
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
        return out, time.monotonic() - started

    @staticmethod
    def _spread_ids(ids: torch.Tensor, segments: List[wire.Segment]) -> torch.Tensor:
        """Place each segment's next-token id at its last position, so slicing works like hidden states."""
        total = sum(s.tokens for s in segments)
        out = torch.zeros(total, 1, dtype=torch.int32, device=ids.device)
        offset = 0
        for i, s in enumerate(segments):
            offset += s.tokens
            out[offset - 1] = ids[i]
        return out

    def _release(self, releases: List[wire.Segment]) -> None:
        for r in releases:
            self.caches.pop((r.device, r.request_id), None)

    def _run_and_forward(self, pieces, releases, start, idle_s, waits) -> None:
        segments = [piece for piece, _ in pieces]
        out, compute_s = self._compute(segments)
        for _, info in pieces:
            info.compute_s += compute_s
        carried = []
        for piece, info in pieces:
            queue_s = (info.first_start_s or start) - info.arrival_s
            carried.append(piece._replace(queue_s=queue_s, compute_s=info.compute_s, server_arrival_s=info.arrival_s))
        self._log(start, segments, releases, compute_s, waits, idle_s)
        self._release(releases)
        self._pass_on(carried, out, releases)

    def _serve_later(self) -> None:
        idle_since = time.monotonic()
        while True:
            frame, _, _ = mpi_link.recv(self.comm, source=self.rank - 1, tag=mpi_link.TAG_PIPE)
            if frame.kind == wire.STOP:
                break
            start = time.monotonic()
            work = [s for s in frame.segments if s.phase != wire.RELEASE]
            releases = [s for s in frame.segments if s.phase == wire.RELEASE]
            out, compute_s = self._compute(work)
            carried = [s._replace(compute_s=s.compute_s + compute_s) for s in work]
            self._log(start, work, releases, compute_s, [], start - idle_since)
            self._release(releases)
            self._pass_on(carried, out, releases)
            idle_since = time.monotonic()
        self._stop_downstream()

    def _pass_on(self, segments: List[wire.Segment], out: Optional[torch.Tensor], releases: List[wire.Segment]) -> None:
        self.iteration += 1
        if not self.last:
            with_payload = []
            offset = 0
            for s in segments:
                with_payload.append(s._replace(payload=out[offset : offset + s.tokens]))
                offset += s.tokens
            frame = wire.encode(wire.DATA, self.iteration, with_payload + releases)
            self.outbox.send(self.comm, frame, self.rank + 1, mpi_link.TAG_PIPE)
            return
        by_device: Dict[int, List[wire.Segment]] = {}
        offset = 0
        depart = time.monotonic()
        for s in segments:
            offset += s.tokens
            if s.phase == wire.VERIFY:  # every position's deep state goes back
                by_device.setdefault(s.device, []).append(
                    s._replace(payload=out[offset - s.tokens : offset], server_depart_s=depart)
                )
            elif s.phase == wire.DECODE or s.last_chunk:
                last = out[offset - 1 : offset]
                by_device.setdefault(s.device, []).append(
                    s._replace(start=s.start + s.tokens - 1, tokens=1, payload=last, server_depart_s=depart)
                )
        if self.config.server_state_in_replies:
            state = torch.tensor([self.monitor.to_vector(self.config.stages)], dtype=torch.float32)
            for replies in by_device.values():
                replies.append(wire.Segment(0, 0, wire.STATE, 0, 1, state))
        for device, replies in by_device.items():
            pad = wire.padding_for(replies, self.config.wire_bytes_per_token)  # the target's bytes on the link
            self.outbox.send(self.comm, wire.encode(wire.DATA, self.iteration, replies, pad), device, mpi_link.TAG_DOWN)

    def _stop_downstream(self) -> None:
        if not self.last:
            mpi_link.send(self.comm, wire.encode(wire.STOP, self.iteration, []), self.rank + 1, mpi_link.TAG_PIPE)

    def _log(self, start, segments, releases, compute_s, waits, idle_s) -> None:
        tokens = sum(s.tokens for s in segments)
        if segments:
            self.monitor.observe(tokens, compute_s)
        predicted = self.monitor.predict_s(tokens)
        self.log.write(
            {
                "stage": self.stage,
                "iteration": self.iteration,
                "start_s": round(start - self.t0, 6),
                "batched_tokens": tokens,
                "prefill_tokens": sum(s.tokens for s in segments if s.phase == wire.PREFILL),
                "decode_tokens": sum(s.tokens for s in segments if s.phase in (wire.DECODE, wire.VERIFY)),
                "segments": len(segments),
                "releases": len(releases),
                "compute_s": round(compute_s, 6),
                "queue_wait_mean_s": round(sum(waits) / len(waits), 6) if waits else "",
                "queue_wait_max_s": round(max(waits), 6) if waits else "",
                "idle_s": round(idle_s, 6),
                "mu_tokens": round(self.monitor.mu or 0.0, 3),
                "g_predicted_s": round(predicted, 6) if predicted is not None else "",
            }
        )
        self.log.flush()
