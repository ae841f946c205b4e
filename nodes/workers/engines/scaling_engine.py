"""The engine of the GPU-rank methods (``methods/cocoserve.py``): a streaming serving engine whose
decoder layers are module copies on the server's GPUs (CoCoServe Sec. 3-5).

The first stage rank is the instance: it holds the whole model (embedding, every layer, the head) on
its GPU, admits and schedules requests like ``serving_engine``, and runs each iteration's layers
through :class:`~nodes.inference.layer_copies.LayerCopies`: a layer's rows go to the copies that serve
their sequences, on this rank or on another GPU rank (:class:`GpuRank`, a copy server), and come back.
Every layer copy's step is paced at its GPU's profile for the target layers it stands for, and hidden
states between GPU ranks take ``scaling.gpu_link_gbps`` at the ends of each replicated run (modeled).

Memory, as the worker enforces it (``nodes.scaling.memory_budget``): each GPU rank has a budget
(``scaling.gpu_memory_bytes``) for the layer copies it holds, the KV of the sequences they serve, and on
the instance's GPU a fixed share. Continuous batching admits only what the budgets hold (its KV
capacity follows the placement); static batching checks nothing, so before each step the sequences
that no longer fit fail, newest first, with ``finished_by: oom`` (the paper's OOM rate), and the
worker goes on.

Every ``scaling.period_s`` of the engine's clock the monitor takes a snapshot, and with
``autoscales`` the controller (``nodes.scaling.controller``) acts on it. The snapshot: each GPU's
vacancy (1 - the larger of its busy share of the window and its memory share; busy from the engine's
own step times, and on real GPUs the node's NVML telemetry records the same) and the share of the
window's finished requests over their SLO (``slo_factor`` times the request's unloaded time on the
profile, or out of memory). The action is carried out at once: a replica installed (Algorithm 1), a
layer migrated with its KV or a replica evicted (Algorithm 2 phases 1-2), or the batch cap lowered or
raised by delta_bs. Phase 3's offload level is recorded but changes nothing here: the memory-aware
scheduler already keeps the KV within the budgets (preempting, by swap or recompute, what does not
fit). A module operation moves the real layer (and, with ``target.pad_payloads``, padding up to the
target's layer bytes) between the ranks, and lasts at least the time its counted bytes take over
``gpu_link_gbps`` (modeled). Records in the rank directory, besides the serving engine's:
``scaling_ops.csv`` (each module operation: time, kind, layer, GPUs, seconds as it lasted, real and
modeled, bytes moved as counted) and ``scaling_ticks.jsonl`` (each tick: the
snapshot, the decision, each GPU's memory).
"""

import time
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from nodes.contracts.records import CsvLog, JsonLinesLog
from nodes.contracts.run_config import RunConfig
from nodes.inference.layer_copies import LayerCopies, SequenceKV
from nodes.scaling.controller import ScalingController, Snapshot, Thresholds
from nodes.scaling.memory_budget import MemoryCosts, SequenceUse, out_of_memory, used_bytes
from nodes.scaling.placement import GpuMemory, Placement
from nodes.scaling.scale_down import Action, Instance
from nodes.scaling.speedup_model import speedup, times_by_share
from nodes.serving.engine_state import DONE, RUNNING, SWAPPED, EngineState, IterationPlan, ServedRequest
from nodes.serving.schedulers import Decision

from .. import mpi_link, wire
from ..pacing import Pacer
from ..split.server_stage import stage_device
from .layer_ranks import CopyServer, RemoteGpu
from .serving_engine import UNBOUNDED_TOKENS, ServingEngine

OP_COLUMNS = ("time_s", "kind", "layer", "source", "destination", "seconds", "real_s", "modeled_s", "bytes",
              "batch_size", "offload")  # fmt: skip
UNBOUNDED_BYTES = 1 << 62
RECENT_ITERATIONS = 8  # the controller predicts speedups over the engine's last iterations


def gpu_name(rank: int) -> str:
    """The GPU a stage rank stands for."""
    return "gpu%d" % rank


def target_layers_per_copy(config: RunConfig, real_layers: int) -> float:
    """How many of the target's decoder layers one real layer stands for (1 without a target)."""
    return config.target.model.layers / float(real_layers) if config.target is not None else 1.0


class GpuRank(object):
    """A stage rank after the first: one GPU's layer copies, paced at its profile."""

    def __init__(self, config: RunConfig, comm: Any, rank: int, parts: Any = None) -> None:
        from nodes.inference.config import LlamaConfig

        spec = config.ranks[rank]
        self.config, self.rank = config, rank
        self.pacer: Optional[Pacer] = None
        pace = None
        if config.target is not None and spec.profile is not None:
            self.pacer = Pacer(spec.profile, config.target.model, config.target.dilation)
            per_copy = target_layers_per_copy(config, LlamaConfig.load(config.model).num_hidden_layers)
            pacer = self.pacer

            def pace(layer: int, shape: List[Tuple[int, int]], started: float) -> None:
                pacer.pace("copy_layer", started, pacer.target_s(per_copy, shape), per_copy, shape)  # type: ignore[arg-type]

        self.server = CopyServer(comm, config.model, str(stage_device(spec.torch_device, spec.index)), 0, pace)

    def start(self, t0: float) -> None:
        if self.pacer is not None:
            header = {"role": "gpu", "node": self.config.ranks[self.rank].node, "gpu": gpu_name(self.rank)}
            self.pacer.start(self.config.rank_dir(self.rank) + "/steps.csv", header, t0)

    def serve(self) -> None:
        self.server.serve()
        if self.pacer is not None:
            self.pacer.close()


class ScalingEngine(ServingEngine):
    """The instance's rank (see the module docstring)."""

    def __init__(self, config: RunConfig, comm: Any, rank: int, parts: Any = None) -> None:
        super().__init__(config, comm, rank, parts)
        settings, method = config.scaling, config.method_spec
        model = self.part.config
        stages = [r for r, spec in enumerate(config.ranks) if spec.role == "stage"]
        self.gpus = [gpu_name(r) for r in stages]
        self.copies = LayerCopies(self.part, self.gpus[0])
        for r in stages[1:]:
            self.copies.add_remote(gpu_name(r), RemoteGpu(comm, r, model))
        self.layers = model.num_hidden_layers
        self.per_copy = target_layers_per_copy(config, self.layers)
        element = torch.empty((), dtype=self.part.dtype).element_size()  # (torch.dtype.itemsize: torch >= 2.1)
        if config.target is not None:
            self.hidden_bytes_per_token = config.target.model.hidden_bytes_per_token
            if config.target.pad_payloads and settings.layer_bytes:  # the target's layer on the wire
                self.copies.wire_pad_bytes = max(0, int(settings.layer_bytes) - self.copies.layer_bytes(0))
        else:
            self.hidden_bytes_per_token = model.hidden_size * element
        if self.pacer is not None:
            pacer = self.pacer
            self.copies.pace = lambda gpu, layer, shape, started: pacer.pace(
                "layer", started, pacer.target_s(self.per_copy, shape), self.per_copy, shape)  # type: ignore[arg-type]
        if settings.gpu_link_gbps:
            self.copies.transfer_s = lambda gpu, tokens: self._transfer_s(tokens) * self.dilation
        self.costs = MemoryCosts(
            layer_bytes=int(settings.layer_bytes or self.copies.layer_bytes(0)),
            kv_bytes_per_token_layer=int(settings.kv_bytes_per_token_layer
                                         or 2 * model.num_key_value_heads * model.head_dim * element),
            fixed_bytes={self.gpus[0]: int(settings.fixed_bytes)},
        )  # fmt: skip
        self.budgets = {g: int(settings.gpu_memory_bytes) for g in self.gpus} if settings.gpu_memory_bytes else {}
        self.static = method.batching == "static"
        self.recent_shapes: Deque[List[Tuple[int, int]]] = deque(maxlen=RECENT_ITERATIONS)  # what _predict weighs
        self._computed: List[ServedRequest] = []  # the plan's requests that did not fail this iteration
        self.kv_of: Dict[Any, SequenceKV] = {}  # request key -> its sequence's KV on the GPUs
        self.busy_s: List[Tuple[float, float, Dict[str, float]]] = []  # (end, seconds, each GPU's share)
        self.controller: Optional[ScalingController] = None
        if method.autoscales:
            thresholds = Thresholds(settings.t_up, settings.t_down, settings.period_s, settings.cooldown_s,
                                    settings.calm_s, settings.max_migrations, settings.delta_batch)  # fmt: skip
            instance = Instance(Placement.single(self.layers, self.gpus[0]), config.serving.max_batch)
            self.controller = ScalingController(instance, self.gpus[0], self._memory(self._used_bytes()),
                                                self.costs.layer_bytes,
                                                self._predict, thresholds)  # fmt: skip
        self.next_tick_s = settings.period_s
        self.given_capacity_tokens = self.state.capacity_tokens
        self._place_capacity()

    def _new_state(self, scheduler: str) -> EngineState:
        """Static batching checks no memory (an out-of-memory fails requests instead); continuous
        batching's KV capacity follows the GPUs' budgets (:meth:`_capacity_tokens`), each iteration."""
        static = self.config.method_spec.batching == "static"
        state = super()._new_state("static" if static else scheduler)
        if static:
            state.capacity_tokens = UNBOUNDED_TOKENS
        return state

    # -- the run -------------------------------------------------------------------------------
    def start(self, t0: float) -> None:
        super().start(t0)
        directory = self.config.rank_dir(self.rank)
        header = {"role": "engine", "gpus": self.gpus, "clock_origin_monotonic_s": t0,
                  "time_dilation": self.dilation, "layer_bytes": self.costs.layer_bytes,
                  "gpu_memory_bytes": self.config.scaling.gpu_memory_bytes}  # fmt: skip
        self.op_log = CsvLog(directory + "/scaling_ops.csv", OP_COLUMNS, header)
        self.tick_log = JsonLinesLog(directory + "/scaling_ticks.jsonl", header)

    def serve(self) -> None:
        try:
            super().serve()
        finally:
            for remote in self.copies.remote.values():
                remote.stop()
            self.op_log.close()
            self.tick_log.close()

    def _iterate(self) -> None:
        if self.clock() >= self.next_tick_s:
            self._tick()
        super()._iterate()

    def _place_capacity(self) -> None:
        """Continuous batching's empty-server KV capacity for the placement now (it changes only when
        a module operation does)."""
        if not self.static:
            self.state.capacity_tokens = self._capacity_tokens()

    # -- memory ----------------------------------------------------------------------------------
    def _uses(self, new_tokens: Optional[Dict[Any, int]] = None) -> List[SequenceUse]:
        """What each running request's KV holds (and adds this step), by the GPUs that serve it."""
        running = [r for r in self.state.live if r.state == RUNNING and r.key in self.kv_of]
        return [SequenceUse(self.kv_of[r.key].ident, self.kv_of[r.key].serving, self.kv_of[r.key].length,
                            (new_tokens or {}).get(r.key, 0)) for r in running]  # fmt: skip

    def _used_bytes(self) -> Dict[str, int]:
        return used_bytes(self.copies.hosts, self._uses(), self.costs)

    def _capacity_tokens(self) -> int:
        """The KV tokens the budgets hold with nothing running (what a request's prompt is refused
        against, and where one that fills it alone ends): per GPU, what is left after its weights and
        fixed share over one token's KV in every layer it holds a copy of; the tightest GPU's."""
        weights = used_bytes(self.copies.hosts, [], self.costs)
        return self._tokens_within(weights, self.given_capacity_tokens)

    def _tokens_within(self, used: Dict[str, int], capacity: int) -> int:
        """Tokens of KV that fit in what the budgets have left beyond ``used``, counting a token in
        every layer a GPU holds a copy of (a sequence may be served there by all of them), at most
        ``capacity``."""
        for gpu, budget in self.budgets.items():
            layers = sum(1 for hosts in self.copies.hosts.values() if gpu in hosts)
            if layers:
                per_token = layers * self.costs.kv_bytes_per_token_layer
                capacity = min(capacity, int(max(0, budget - used.get(gpu, 0)) // per_token))
        return capacity

    def _decide(self, now_s: float) -> Decision:
        """The scheduler decides against the memory the GPUs really have left: the running requests'
        tokens plus the headroom of the tightest GPU (a conservative count: a token of a replicated
        layer is charged on every copy's GPU), so that what it admits never overflows a GPU."""
        if self.static or not self.budgets:
            return super()._decide(now_s)
        running = sum(r.context_tokens for r in self.state.live if r.state == RUNNING)
        room = running + self._tokens_within(self._used_bytes(), UNBOUNDED_TOKENS)
        return self.state.decide(now_s, min(self.state.capacity_tokens, room))

    def _memory(self, used: Dict[str, int]) -> Dict[str, GpuMemory]:
        """Each GPU as the scaling algorithms see it: its budget, and what it holds besides layers
        (``used``: what it holds in all)."""
        layers = used_bytes(self.copies.hosts, [], MemoryCosts(self.costs.layer_bytes, 0))
        return {g: GpuMemory(self.budgets.get(g, UNBOUNDED_BYTES), used.get(g, 0) - layers.get(g, 0))
                for g in self.gpus}  # fmt: skip

    # -- one iteration -----------------------------------------------------------------------------
    def _compute(self, plan: IterationPlan) -> List[int]:
        """The plan's next tokens through the layer copies; first, the sequences that would outgrow a
        GPU's budget this step fail (out of memory), newest first."""
        compute = list(plan.compute)
        for request in compute:
            if plan.kind == "prefill":  # a new request, or one whose KV was dropped: served afresh
                old = self.kv_of.pop(request.key, None)
                if old is not None:
                    self.copies.release(old)
                self.kv_of[request.key] = self.copies.admit()
        adds = {r.key: (r.context_tokens if plan.kind == "prefill" else 1) for r in compute}
        if self.budgets:
            over, _ = out_of_memory(self.copies.hosts, self._uses(adds), self.costs, self.budgets)
            if over and self.static:  # Transformers has no way out: the requests fail
                compute = self._fail_out_of_memory(compute, set(over))
            elif over:  # a scheduler that counts memory preempts them, as vLLM does when its blocks run out
                compute = self._preempt(compute, set(over), swap=plan.kind == "decode")
        self._computed = compute
        if not compute:
            return []
        began = time.monotonic()
        ids: List[int] = []
        steps: List[Tuple[SequenceKV, int]] = []
        for request in compute:
            context = request.prompt_ids + request.generated if plan.kind == "prefill" else [request.generated[-1]]
            ids.extend(context)
            steps.append((self.kv_of[request.key], len(context)))
        self.recent_shapes.append([(tokens, sequence.length) for sequence, tokens in steps])
        with torch.inference_mode():
            hidden = self.part.embed(torch.tensor(ids, dtype=torch.long, device=self.part.device))
            out = self.copies.run_layers(hidden, steps)
            rows, offset = [], 0
            for _, tokens in steps:
                offset += tokens
                rows.append(offset - 1)
            head_began = time.monotonic()
            logits = self.part.logits(out[torch.tensor(rows, device=out.device)])
            tokens = [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
        if self.pacer is not None:
            shape = [(len(rows), 0)]
            self.pacer.pace("head", head_began, self.pacer.target_s(0, shape, head_tokens=len(rows)), 0, shape)
        self._busy(time.monotonic() - began, steps)
        return tokens

    def _stream(self, plan: IterationPlan, tokens: List[int]) -> None:
        computed = self._computed
        super()._stream(plan._replace(compute=tuple(computed)), tokens)
        for request in computed:
            if request.state == DONE and request.key in self.kv_of:
                self.copies.release(self.kv_of.pop(request.key))

    def _preempt(self, compute: List[ServedRequest], over: set, swap: bool) -> List[ServedRequest]:
        """Preempt the requests whose sequences are in ``over`` (a safety net: :meth:`_decide` admits
        only what fits, so the copies that serve these would overflow only if that count fell short),
        swapping their KV out if ``swap`` (a prefill's have none yet); the ones left."""
        now = self.clock()
        kept = []
        for request in compute:
            if self.kv_of[request.key].ident not in over:
                kept.append(request)
            elif self.state.preempt(request, now, swap) != SWAPPED:  # dropped: its KV goes, recomputed later
                self.copies.release(self.kv_of.pop(request.key))
        return kept

    def _fail_out_of_memory(self, compute: List[ServedRequest], failed: set) -> List[ServedRequest]:
        """Fail the requests whose sequences are in ``failed``; the ones left to compute."""
        now = self.clock()
        by_device: Dict[int, List[wire.Segment]] = {}
        kept = []
        for request in compute:
            if self.kv_of[request.key].ident not in failed:
                kept.append(request)
                continue
            self.state.cancel(request, now, "oom")
            self.copies.release(self.kv_of.pop(request.key))
            by_device.setdefault(request.key[0], []).extend(self._closing(request, []))
            self._log_request(request)
        for device, segments in by_device.items():
            self.outbox.send(self.comm, wire.encode(wire.DATA, self.iteration, segments), device, mpi_link.TAG_DOWN)
        return kept

    def _busy(self, seconds: float, steps: Sequence[Tuple[SequenceKV, int]]) -> None:
        """The monitor's utilisation: this iteration's time, shared among the GPUs by the rows they ran."""
        work: Dict[str, float] = {}
        for layer in range(self.layers):
            for sequence, tokens in steps:
                gpu = sequence.serving[layer]
                work[gpu] = work.get(gpu, 0.0) + tokens
        most = max(work.values()) if work else 1.0  # GPU ranks run their rows side by side
        self.busy_s.append((self.clock(), seconds / self.dilation, {g: w / most for g, w in work.items()}))

    # -- the controller ------------------------------------------------------------------------------
    def _tick(self) -> None:
        settings = self.config.scaling
        now = self.clock()
        self.next_tick_s = now + settings.period_s
        since = now - settings.window_s
        self.busy_s = [b for b in self.busy_s if b[0] >= since]
        busy = {g: 0.0 for g in self.gpus}
        for _, seconds, shares in self.busy_s:
            for gpu, share in shares.items():
                busy[gpu] += seconds * min(1.0, share)
        window = min(settings.window_s, max(now, 1e-9))
        used = self._used_bytes()
        vacancy = {}
        for gpu in self.gpus:
            memory_share = used.get(gpu, 0) / float(self.budgets[gpu]) if gpu in self.budgets else 0.0
            vacancy[gpu] = max(0.0, 1.0 - max(min(1.0, busy[gpu] / window), memory_share))
        ended = [r for r in self.state.finished if r.done_s is not None and r.done_s >= since
                 and r.finished_by not in ("refused", "cancelled")]  # fmt: skip
        missed = sum(1 for r in ended if r.finished_by == "oom" or r.done_s - r.arrival_s > self._slo_s(r))
        rate = missed / float(len(ended)) if ended else 0.0
        action, decision, predicted = None, "monitor", None  # without autoscaling the monitor still records
        if self.controller is not None:
            self.controller.memory = self._memory(used)
            action = self.controller.tick(Snapshot(now, vacancy, rate))
            decision = str(self.controller.log[-1]["decision"])
            predicted = round(self._predict(self.controller.instance.placement), 4)  # Eq. 3, the placement now
        self.tick_log.write({"time_s": round(now, 6), "vacancy": vacancy, "violation_rate": rate,
                             "finished": len(ended), "decision": decision, "predicted_speedup": predicted,
                             "action": action._asdict() if action else None, "used_bytes": used,
                             "batch_size": self.state.max_batch,
                             "kv_capacity_tokens": self.state.capacity_tokens})  # fmt: skip (flushed as written)
        if action is not None:
            self._carry_out(action)

    def _slo_s(self, request: ServedRequest) -> float:
        """The request's SLO: ``slo_factor`` times its time alone on an idle server (its prefill, then
        each further token at batch 1)."""
        alone = self.prefill_s(len(request.prompt_ids)) + max(0, len(request.generated) - 1) * self.latency_s(1)
        return self.config.scaling.slo_factor * max(alone, self.latency_s(1))

    def _predict(self, placement: Placement) -> float:
        """Eq. 3 over the engine's last iterations (their batches, prefill and decode as they came):
        with a profile, each copy's time for its share of an iteration's sequences is the profile's
        (:func:`times_by_share`: a memory-bound decode step reads every weight whatever its share),
        else proportional to the share of the last timed decode step; the hidden states of each
        iteration's tokens cross the link between GPU ranks at the ends of each replicated run."""
        shapes = list(self.recent_shapes) or [[(1, self.config.serving.latency_context_tokens)]]
        pacer = self.pacer
        if pacer is None:
            transfer = {g: self._transfer_s(sum(n for n, _ in shapes[-1])) for g in self.gpus}
            return speedup(placement, {g: self.observed_step_s / self.layers for g in self.gpus}, transfer)
        alone = placed = 0.0
        for shape in shapes:
            by_degree = {p: pacer.target_s(self.per_copy, shape[::p]) / self.dilation  # type: ignore[arg-type]
                         for p in range(1, len(self.gpus) + 1)}  # fmt: skip
            tokens = sum(n for n, _ in shape)
            one, many = times_by_share(placement, lambda g, share, t=by_degree: t[max(1, round(1.0 / share))],
                                       {g: self._transfer_s(tokens) for g in self.gpus})  # fmt: skip
            alone, placed = alone + one, placed + many
        return alone / placed

    def _transfer_s(self, tokens: int) -> float:
        gbps = self.config.scaling.gpu_link_gbps
        return tokens * self.hidden_bytes_per_token / (gbps * 1e9) if gbps else 0.0

    def _carry_out(self, action: Action) -> None:
        """Do what the controller decided, on the layer copies or the engine's batch, and log it."""
        began = time.monotonic()
        sequences = list(self.kv_of.values())
        kv_tokens = sum(q.length for q in sequences if q.serving.get(action.layer) == action.source)
        moved = 0  # as the budgets count them: a layer's weights, and the KV that goes with it
        if action.kind == "replicate":
            self.copies.replicate(action.layer, action.destination)
            moved = self.costs.layer_bytes
        elif action.kind == "migrate":
            self.copies.migrate(action.layer, action.source, action.destination, sequences)
            moved = self.costs.layer_bytes + kv_tokens * self.costs.kv_bytes_per_token_layer
        elif action.kind == "evict":
            self.copies.evict(action.layer, action.source, sequences)
            moved = kv_tokens * self.costs.kv_bytes_per_token_layer
        else:  # reduce or restore: the batch cap (the offload level is recorded only)
            self.state.max_batch = max(1, action.batch_size)
        self._place_capacity()
        for remote in self.copies.remote.values():  # the operation is done when every rank has it
            remote.sync()
        real_s = (time.monotonic() - began) / self.dilation
        modeled_s = moved / (self.config.scaling.gpu_link_gbps * 1e9) \
            if self.config.scaling.gpu_link_gbps else 0.0  # fmt: skip
        if modeled_s > real_s:  # the bytes over the target's link between GPUs (modeled): wait it out
            time.sleep((modeled_s - real_s) * self.dilation)
        self.op_log.write({
            "time_s": round(self.clock(), 6), "kind": action.kind, "layer": action.layer, "source": action.source,
            "destination": action.destination, "seconds": round(max(real_s, modeled_s), 6),
            "real_s": round(real_s, 6), "modeled_s": round(modeled_s, 6),
            "bytes": moved,
            "batch_size": self.state.max_batch, "offload": action.offload,
        })  # fmt: skip
        self.op_log.flush()
