"""Paced steps: a rank computes each step for real, then waits until the target hardware would be done.

With a compute profile in the run config, every step of the model a rank runs (its decoder layers on a
packed batch, the LM head, HAT's draft adapter) takes the time the target hardware takes: the real
computation runs (the tokens stay exact), then the rank sleeps until start + predicted x dilation
(:func:`nodes.contracts.compute_profile.step_seconds` with the target model's shape and this rank's
share of its layers). A step whose real computation took longer than that is a fidelity violation:
the emulation could not keep up, and the step is as slow as this machine made it.

Each step is a row of ``steps.csv`` in the rank's directory (:mod:`nodes.contracts.paced_steps`): its
operation, layers (of the target), tokens, sequences, context, real and target seconds, how late it
ended (``late_s``) and whether it overran: its real computation took longer than its target, or its
sleep returned later than ``late_tolerance_s`` past the due time (the rank was preempted or throttled
while it waited, so the step lasted longer than modeled just the same).

Steps that follow each other directly (the device's shallow layers, then the adapter, then the LM
head) are chained: the next one starts earlier by how late the previous one's sleep returned, so a
sleep's lateness (tens of microseconds) does not add up over a request. Only that lateness is taken
back: the rank's own work between the two steps (encoding and sending a chunk, a scheduler's
bookkeeping) still takes its real time, so no step ever lasts less than its target less one on-time
sleep's lateness, however it is measured; and each
sleep asks to wake that much early (the median of how late the last on-time sleeps returned, at most
:data:`MAX_ADVANCE_S`: sleeps that a CPU quota's throttling or a preemption made late are overruns and
teach nothing, so a rank throttled for a while does not then end its steps early, or skip their
sleeps altogether). The rank's timer slack is set to 1 us on
Linux, so the kernel does not round its wake-ups by its default 50 us, and on Linux 6.12 or later its
scheduler slice to the shortest there is (0.1 ms), so that EEVDF lets a rank whose sleep ends preempt
one that is computing rather than wait for it to use up its slice (a late wake-up overruns the step).
"""

import os
import platform
import struct
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

from nodes.contracts.compute_profile import ModeRates, step_seconds
from nodes.contracts.paced_steps import STEP_COLUMNS, overran, step_row
from nodes.contracts.records import CsvLog
from nodes.contracts.target_model import TargetModel
from nodes.inference.partition import UShapePartition

CHAIN_S = 0.002  # a step that starts this soon after the last one ended takes back that one's lateness
LATENESS_SAMPLES = 32  # sleeps whose lateness the next wake-up's advance is the median of
MAX_ADVANCE_S = 0.00025  # the most a sleep asks to wake before its due time (half of paced_steps.LATE_FLOOR_S)
SCHED_SLICE_NS = 100_000  # the paced thread's scheduler slice: EEVDF's shortest
SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # the syscall's number: x86-64's, and arm64's (the Jetsons')


def _wake_promptly() -> None:
    """Ask Linux to wake this thread's sleeps within 1 us rather than its default 50 us slack
    (``prctl(PR_SET_TIMERSLACK)``), and to give it a 0.1 ms slice (``sched_setattr`` with
    ``sched_runtime``, SCHED_OTHER at the thread's nice value, so nothing needs privileges): under
    EEVDF a waking task with a short slice gets an early deadline and preempts the running one.
    Kernels before 6.12 ignore the slice; elsewhere, or if refused, nothing changes."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
        number = SCHED_SETATTR.get(platform.machine())
        if number is not None:
            # struct sched_attr (56 bytes): size, policy, flags, nice, priority, runtime, deadline, period, util_min/max
            nice = os.getpriority(os.PRIO_PROCESS, 0)
            attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQII", 56, 0, 0, nice, 0, SCHED_SLICE_NS, 0, 0, 0, 0))
            libc.syscall(number, 0, attr, 0)
    except (OSError, AttributeError):
        pass


class Pacer:
    """Waits out each step's predicted time; logs real and target seconds (the fidelity monitor)."""

    def __init__(self, rates: ModeRates, model: TargetModel, dilation: float = 1.0) -> None:
        self.rates, self.model, self.dilation = rates, model, dilation
        self.log: Optional[CsvLog] = None
        self.t0 = 0.0
        self._ended = 0.0  # when the last step's sleep returned
        self._owed_s = 0.0  # how late that on-time sleep returned: the next chained step takes it back
        self._lateness_s = 0.0  # median of how late the last sleeps returned
        self._late_samples: List[float] = []
        self._slack_thread = 0  # the thread whose timer slack was tightened (it is per thread)
        self.steps = 0
        self.overruns = 0

    def start(self, path: str, header: Any, t0: float) -> None:
        self.log = CsvLog(path, STEP_COLUMNS, header)
        self.t0, self._ended, self._owed_s, self.steps, self.overruns = t0, 0.0, 0.0, 0, 0

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def unchain(self) -> None:
        """The next step starts a new chain (untimed work happened in between: a profiler's setup)."""
        self._ended, self._owed_s = 0.0, 0.0

    def target_s(
        self, layers: int, segments: Sequence[Tuple[int, int]], head_tokens: int = 0, attention_layers: int = 0
    ) -> float:
        return step_seconds(self.rates, self.model, layers, segments, head_tokens, attention_layers) * self.dilation

    def pace(self, op: str, started: float, target_s: float, layers: int, segments: Sequence[Tuple[int, int]]) -> None:
        """After a step's real computation (begun at ``started``): sleep until it is due, log it."""
        if self._slack_thread != threading.get_ident():
            _wake_promptly()
            self._slack_thread = threading.get_ident()
        begin = started - self._owed_s if 0.0 <= started - self._ended < CHAIN_S else started
        due = begin + target_s
        now = ended = time.monotonic()
        wake = due - self._lateness_s  # a sleep returns late by about this much: ask for earlier
        if now < wake:
            time.sleep(wake - now)
            ended = time.monotonic()
        late_s = max(0.0, ended - due)
        overrun = overran(now, due, late_s, target_s)
        if now < wake and not overrun:  # an on-time sleep: learn how late sleeps return
            self._late_samples = (self._late_samples + [ended - wake])[-LATENESS_SAMPLES:]
            median = sorted(self._late_samples)[len(self._late_samples) // 2]
            self._lateness_s = min(MAX_ADVANCE_S, max(0.0, median))
        self._ended, self._owed_s = ended, (0.0 if overrun else late_s)
        self.steps += 1
        self.overruns += overrun
        if self.log is not None:
            self.log.write(step_row(begin - self.t0, op, layers, sum(n for n, _ in segments), len(segments),
                                    sum(c for _, c in segments), now - started, target_s, late_s, overrun))


class PacedPart:
    """A model part whose ``run_layers`` and ``logits`` are paced; everything else is the part's.

    ``target_layers``: how many of the target model's layers this part stands for (the target's own
    U-shaped split), whatever the real checkpoint's split is."""

    def __init__(self, part: Any, pacer: Pacer, target_layers: int, role: str) -> None:
        self._part, self._pacer, self._layers, self._role = part, pacer, target_layers, role

    def __getattr__(self, name: str) -> Any:
        return getattr(self._part, name)

    def run_layers(self, hidden: Any, segments: Sequence[Any]) -> Any:
        return _paced(self._pacer, self._role + "_layers", self._layers, lambda: _cache_shape(segments),
                      lambda shape: self._pacer.target_s(self._layers, shape),
                      lambda: self._part.run_layers(hidden, segments))  # fmt: skip

    def logits(self, hidden: Any) -> Any:
        rows = int(hidden.shape[0]) if hidden.dim() > 1 else 1
        return _paced(self._pacer, self._role + "_head", 0, lambda: [(rows, 0)],
                      lambda shape: self._pacer.target_s(0, shape, head_tokens=rows),
                      lambda: self._part.logits(hidden))  # fmt: skip


class PacedAdapter:
    """HAT's draft adapter (one attention module of the target's shape), paced."""

    def __init__(self, adapter: Any, pacer: Pacer) -> None:
        self._adapter, self._pacer = adapter, pacer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)

    def run(self, hidden: Any, segments: Sequence[Any]) -> Any:
        return _paced(self._pacer, "draft_adapter", 0, lambda: _cache_shape(segments),
                      lambda shape: self._pacer.target_s(0, shape, attention_layers=1),
                      lambda: self._adapter.run(hidden, segments))  # fmt: skip


def _cache_shape(segments: Sequence[Any]) -> List[Tuple[int, int]]:
    """(new tokens, context tokens) of each sequence of a step, before the step advances its cache."""
    return [(s.tokens, s.cache.length) for s in segments]


def _paced(pacer: Pacer, op: str, layers: int, shape_of: Callable[[], List[Tuple[int, int]]],
           target_of: Callable[[List[Tuple[int, int]]], float], compute: Callable[[], Any]) -> Any:  # fmt: skip
    """Run ``compute`` for real (a GPU's queue drained), then pace it to its target. The clock starts
    before the pacing's own work (the step's shape and target), which the step's time covers."""
    started = time.monotonic()
    shape = shape_of()
    out = compute()
    _synchronize(out)
    pacer.pace(op, started, target_of(shape), layers, shape)
    return out


def _synchronize(tensor: Any) -> None:
    """Wait for a GPU's queued work, so that the real time is the computation's."""
    if getattr(tensor, "is_cuda", False):
        import torch

        torch.cuda.synchronize(tensor.device)


def pacer_for(config: Any, rank: int) -> Optional[Pacer]:
    """The rank's pacer when the run names a target and the rank's node has a profile, else None
    (the rank runs at this machine's speed)."""
    spec = config.ranks[rank]
    if config.target is None or spec.profile is None:
        return None
    return Pacer(spec.profile, config.target.model, config.target.dilation)


def target_stage_layers(config: Any, stage: int) -> int:
    """How many of the target's layers server stage ``stage`` stands for: the target model split the
    run's way (m layers on the device, the middle over P stages)."""
    split = UShapePartition.make(config.target.model.layers, config.server_device_layers, config.stages)
    return len(split.stage_layer_ids()[stage])

