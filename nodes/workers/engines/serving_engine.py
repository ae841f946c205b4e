"""The serving engine rank of a streaming method (``methods/serving.py``): the whole model on one
rank, continuous batching under a KV budget, preemption by swap or recompute, and the scheduler the
run names (``nodes.serving``), streaming every token to its client as soon as it exists.

Each iteration: take the requests that have arrived, let the scheduler decide (``EngineState``),
move the KV of swapped requests (paced at the profile's host-link rate: the target's KV bytes), run
one prefill iteration of the admitted requests (their prompt, and their output so far when their KV
was dropped) or one decode iteration of the running ones, and send each new token down. Tokens are
computed by the real checkpoint; a swapped request keeps its real KV, a dropped one recomputes it, so
its output is the same token for token.

The engine keeps the target's time: with a dilation k its scheduler, the clients' expectations and
its logs count seconds of the emulated server (the monotonic clock over k). Logs, in its rank
directory: ``engine_iterations.csv`` (one row per iteration: kind, batch, KV use, queue, preemptions, the
scheduler's decision time) and ``engine_requests.jsonl`` (one row per request as the engine saw it).
"""

import time
from dataclasses import fields
from typing import Dict, List, Optional

import torch
from mpi4py import MPI

from nodes.contracts.records import CsvLog, JsonLinesLog
from nodes.contracts.run_config import RunConfig
from nodes.inference.checkpoint import load_part
from nodes.inference.config import LlamaConfig
from nodes.inference.model import Segment as CacheSegment
from nodes.inference.tokenizer import Tokenizer
from nodes.serving.engine_state import EngineState, IterationPlan, ServedRequest
from nodes.serving.schedulers import Decision, SchedulerSettings

from .. import mpi_link, wire
from ..pacing import Pacer
from ..part_cache import PartCache
from ..split.server_stage import stage_device

ITERATION_COLUMNS = (
    "iteration", "start_s", "kind", "batch", "new_tokens", "running", "waiting", "swapped", "dropped",
    "kv_used_tokens", "swap_used_tokens", "preempted", "forced", "swapped_out", "swapped_in", "recomputed",
    "solved", "batch_target", "decide_s", "swap_s", "compute_s",
)  # fmt: skip
UNBOUNDED_TOKENS = 10**12
UNPROFILED_STEP_S = 0.02  # latency(B) before an unprofiled engine has timed a decode iteration


class ServingEngine:
    def __init__(self, config: RunConfig, comm: "MPI.Comm", rank: int, parts: Optional[PartCache] = None) -> None:
        self.config, self.comm, self.rank, self.t0 = config, comm, rank, 0.0
        spec = config.ranks[rank]
        parts = parts if parts is not None else PartCache()
        model_config = LlamaConfig.load(config.model)
        layers = tuple(range(model_config.num_hidden_layers))
        device = stage_device(spec.torch_device, 0)
        self.part = parts.get(
            ("part", config.model, layers, True, True, config.dtype, device),
            lambda: load_part(config.model, layers, embedding=True, head=True, dtype=config.dtype, device=device),
            "engine: the whole model",
        )
        self.tokenizer = Tokenizer(config.model)
        settings = config.serving
        self.eos_id = None if settings.ignore_eos else self.tokenizer.eos_id
        self.dilation = config.target.dilation if config.target is not None else 1.0
        self.pacer: Optional[Pacer] = None
        if config.target is not None and spec.profile is not None:  # tensor parallel: tp GPUs' rates
            tp = settings.tensor_parallel
            rates = spec.profile._replace(mem_bw_gbps=spec.profile.mem_bw_gbps * tp,
                                          peak_tflops=spec.profile.peak_tflops * tp)  # fmt: skip
            self.pacer = Pacer(rates, config.target.model, self.dilation)
            self.target_layers = config.target.model.layers
            self.kv_bytes_per_token = config.target.model.kv_bytes_per_token
        else:
            element = torch.empty((), dtype=self.part.dtype).element_size()
            kv_width = model_config.num_key_value_heads * (model_config.hidden_size // model_config.num_attention_heads)
            self.kv_bytes_per_token = 2.0 * kv_width * element * len(layers)
        self.observed_step_s = UNPROFILED_STEP_S  # an unprofiled engine's latency(B): its last timed decode
        self.state = self._new_state(settings.scheduler)
        self.outbox = mpi_link.Outbox()
        self.iteration = 0

    def _new_state(self, scheduler: str) -> EngineState:
        """The requests and KV budget the scheduler ``scheduler`` works on (the run's serving settings)."""
        settings = self.config.serving
        return EngineState(
            scheduler,
            SchedulerSettings(**{f.name: getattr(settings, f.name) for f in fields(SchedulerSettings)}),
            settings.capacity_tokens if settings.capacity_tokens is not None else UNBOUNDED_TOKENS,
            settings.swap_tokens if settings.swap_tokens is not None else UNBOUNDED_TOKENS,
            settings.max_batch, self.latency_s, self.prefill_s, self.swap_s, settings.lookahead_s,
        )  # fmt: skip

    # -- the engine's model of its own time (the target's seconds) ---------------------------------
    def latency_s(self, batch: int) -> float:
        """One decode iteration of ``batch`` requests at the tabulated context (Andes App. B)."""
        if self.pacer is None:
            return self.observed_step_s
        context = self.config.serving.latency_context_tokens
        return self.pacer.target_s(self.target_layers, [(1, context)] * batch, head_tokens=batch) / self.dilation

    def prefill_s(self, tokens: int) -> float:
        if self.pacer is None:
            return 0.0
        return self.pacer.target_s(self.target_layers, [(tokens, 0)], head_tokens=1) / self.dilation

    def swap_s(self, tokens: int) -> float:
        """Moving ``tokens`` of the target's KV across the host link (one way)."""
        gbps = self.config.serving.host_link_gbps
        return 0.0 if not gbps else tokens * self.kv_bytes_per_token / (gbps * 1e9)

    def clock(self) -> float:
        """Seconds of the emulated server since the start barrier."""
        return (time.monotonic() - self.t0) / self.dilation

    # -- the run -----------------------------------------------------------------------------------
    def start(self, t0: float) -> None:
        self.t0 = t0
        directory = self.config.rank_dir(self.rank)
        header = {"role": "engine", "node": self.config.ranks[self.rank].node,
                  "scheduler": self.config.serving.scheduler, "clock_origin_monotonic_s": t0,
                  "time_dilation": self.dilation,
                  "clock_origin_unix_s": time.time() - (time.monotonic() - t0)}  # fmt: skip
        self.log = CsvLog(directory + "/engine_iterations.csv", ITERATION_COLUMNS, header)
        self.request_log = JsonLinesLog(directory + "/engine_requests.jsonl", header)
        if self.pacer is not None:
            self.pacer.start(directory + "/steps.csv", header, t0)

    def serve(self) -> None:
        devices = set(self.config.device_ranks)
        stopped = set()
        inbox = mpi_link.Inbox(self.comm, mpi_link.TAG_UP)
        while True:
            idle = not self.state.live
            if idle and stopped == devices:
                break
            for frame, source, _ in inbox.wait() if idle else inbox.take():
                if frame.kind == wire.STOP:
                    stopped.add(source)
                self._admit_arrivals(frame.segments, source)
            if self.state.live:
                self._iterate()
        self.outbox.wait_all()
        self.log.close()
        self.request_log.close()
        if self.pacer is not None:
            self.pacer.close()

    def _admit_arrivals(self, segments, source: int) -> None:
        asked: Dict[int, wire.Segment] = {s.request_id: s for s in segments if s.phase == wire.REQUEST}
        refused: List[wire.Segment] = []
        for s in segments:
            if s.phase != wire.PREFILL:
                continue
            max_new, ttft, tds = asked[s.request_id].payload[0].tolist()
            ids = [int(i) for i in s.payload.view(-1).tolist()]
            request = ServedRequest((source, s.request_id), self.clock(), ids, int(max_new), ttft if ttft > 0 else 1.0,
                                    tds if tds > 0 else 1e6)  # fmt: skip
            if not self.state.add(request, self.clock()):  # it could never fit: refused, no tokens
                refused += self._closing(request, [])
                self._log_request(request)
        if refused:
            self.outbox.send(self.comm, wire.encode(wire.DATA, self.iteration, refused), source, mpi_link.TAG_DOWN)

    def _slo_s(self, request: ServedRequest) -> float:
        """The request's latency SLO in the target's seconds; 0: this engine sets none."""
        return 0.0

    def _closing(self, request: ServedRequest, token_ids: List[int]) -> List[wire.Segment]:
        """A finished request's last segments: its counts (whether it failed out of memory, its SLO),
        then its last tokens (none if refused) flagged DONE."""
        device, request_id = request.key
        stats = request.stats()
        out_of_memory = 1.0 if request.finished_by == "oom" else 0.0  # the GPU ran out (scaling_engine)
        counts = torch.tensor([[stats["preemptions"], stats["swaps"], stats["recomputes"], out_of_memory,
                                self._slo_s(request)]], dtype=torch.float32)  # fmt: skip
        ids = torch.tensor(token_ids, dtype=torch.int32).view(-1, 1)
        return [wire.Segment(request_id, device, wire.STATS, 0, 1, counts),
                wire.Segment(request_id, device, wire.TOKENS, len(request.generated) - len(token_ids), len(token_ids),
                             ids if token_ids else None, wire.DONE)]  # fmt: skip

    def _iterate(self) -> None:
        start = self.clock()
        begun = time.monotonic()
        decision = self._decide(start)
        plan = self.state.apply(decision, start)
        decide_s = time.monotonic() - begun
        moved = sum(r.context_tokens for r in plan.swapped_out + plan.swapped_in)
        swap_s = self.swap_s(moved)
        if swap_s > 0:  # the KV crossing the host link: modeled, paced like a step
            began = time.monotonic()
            if self.pacer is not None:
                self.pacer.pace("swap", began, swap_s * self.dilation, 0, [(moved, 0)])
            else:
                time.sleep(swap_s)
        new_tokens = sum(r.context_tokens if plan.kind == "prefill" else 1 for r in plan.compute)
        recomputed = sum(1 for r in plan.compute if plan.kind == "prefill" and r.generated)
        compute_s = 0.0
        if plan.compute:  # (an iteration may only preempt: the next one decides again)
            began = time.monotonic()
            tokens = self._compute(plan)
            compute_s = time.monotonic() - began
            if plan.kind == "decode" and self.pacer is None and self.iteration % 50 == 0:
                self.observed_step_s = compute_s
                self.state.refresh_latency()
            self._stream(plan, tokens)
        self.iteration += 1
        counts = {state: len(self.state.in_state(state)) for state in ("running", "waiting", "swapped", "dropped")}
        self.log.write({
            "iteration": self.iteration, "start_s": round(start, 6), "kind": plan.kind, "batch": len(plan.compute),
            "new_tokens": new_tokens, **counts,
            "kv_used_tokens": self.state.kv_used_tokens(), "swap_used_tokens": self.state.swap_used_tokens(),
            "preempted": decision.preempted, "forced": decision.forced, "swapped_out": len(plan.swapped_out),
            "swapped_in": len(plan.swapped_in), "recomputed": recomputed,
            "solved": int(decision.solved), "batch_target": decision.batch, "decide_s": round(decide_s, 6),
            "swap_s": round(swap_s, 6), "compute_s": round(compute_s / self.dilation, 6),
        })  # fmt: skip
        self.log.flush()

    def _decide(self, now_s: float) -> Decision:
        """The scheduler's decision for this iteration."""
        return self.state.decide(now_s)

    def _compute(self, plan: IterationPlan) -> List[int]:
        """The next token of every request in the plan, computed by the real model; with a profile the
        iteration is paced as one step of the target (every layer and the head for each request), the
        step latency(B) and prefill_s model."""
        began = time.monotonic()
        ids: List[int] = []
        segments = []
        for request in plan.compute:
            if plan.kind == "prefill":  # a new request, or one whose KV was dropped: its whole context
                context = request.prompt_ids + request.generated
                request.cache = self.part.new_cache(max(256, len(context) + request.max_new_tokens + 1))
            else:
                context = [request.generated[-1]]
            ids.extend(context)
            segments.append(CacheSegment(request.cache, len(context)))
        shape = [(s.tokens, s.cache.length) for s in segments]  # (new, context) before the step
        with torch.inference_mode():
            hidden = self.part.embed(torch.tensor(ids, dtype=torch.long, device=self.part.device))
            out = self.part.run_layers(hidden, segments)
            rows, offset = [], 0
            for segment in segments:
                offset += segment.tokens
                rows.append(offset - 1)
            logits = self.part.logits(out[torch.tensor(rows, device=out.device)])
            tokens = [int(t) for t in torch.argmax(logits, dim=-1).tolist()]  # (a GPU's queue drained here)
        if self.pacer is not None:
            target_s = self.pacer.target_s(self.target_layers, shape, head_tokens=len(shape))
            self.pacer.pace("engine_" + plan.kind, began, target_s, self.target_layers, shape)
        return tokens

    def _stream(self, plan: IterationPlan, tokens: List[int]) -> None:
        """Each new token down to its client at once, one frame per client per iteration."""
        by_device: Dict[int, List[wire.Segment]] = {}
        now = self.clock()
        for request, token in zip(plan.compute, tokens):
            ended = self.state.delivered(request, token, now, self.eos_id)
            device, request_id = request.key
            replies = by_device.setdefault(device, [])
            if ended:  # the request's counts go before its last token, which closes it at the client
                replies += self._closing(request, [token])
                self._log_request(request)
            else:
                token_ids = torch.tensor([[token]], dtype=torch.int32)
                replies.append(wire.Segment(request_id, device, wire.TOKENS, len(request.generated) - 1, 1, token_ids))
        for device, replies in by_device.items():
            self.outbox.send(self.comm, wire.encode(wire.DATA, self.iteration, replies), device, mpi_link.TAG_DOWN)

    def _log_request(self, request: ServedRequest) -> None:
        device, request_id = request.key
        self.request_log.write(dict({
            "request_id": request_id, "device_rank": device, "node": self.config.ranks[device].node,
            "arrival_s": round(request.arrival_s, 6), "first_token_s": round(request.first_token_s or 0.0, 6),
            "done_s": round(request.done_s or 0.0, 6), "prompt_tokens": len(request.prompt_ids),
            "output_tokens": len(request.generated), "finished_by": request.finished_by,
            "expected_ttft_s": request.shadow.expected_ttft_s,
            "expected_tds_tok_s": request.shadow.expected_tds,
        }, **request.stats()))  # fmt: skip
