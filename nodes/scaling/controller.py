"""CoCoServe's auto-scaling controller (Sec. 5): each period it reads the monitor's snapshot and takes
at most one action on the instance it scales.

- SLO violation rate over the window above T_down: the next step of Algorithm 2 (migrate, evict,
  reduce the batch and offload). Phase 3 is re-evaluated over the next window: when the violation
  rate rose after a batch step, that step is undone and phase 3 holds until calm. A smaller batch
  relieves memory, but where violations come from a queue (load beyond the instance's capacity) it
  only serves fewer requests at once, and the paper's "until no violation" would step the batch down
  to 1 while the backlog grows (seen on real ranks: 32 -> 1 in seven ticks under a 24 requests/s step).
- Otherwise, once calm (no violation in the window, and no scale-down for ``calm_s``): first undo
  phase 3 (the batch back up by Δbs and the offloaded parts back, the weights before the KV) when the
  instance's own GPU has vacancy above T_up (a reduced batch that merely holds the SLO under high load
  stays reduced), then the first replica Algorithm 1 would add on the other GPUs whose vacancy exceeds
  T_up.
- After any action, nothing for ``cooldown_s``: the next window measures the change.

The paper gives no values: the defaults are the brief's (T_up 20% vacancy, T_down 5% violations,
a 2 s period) with a 10 s cooldown, and a scale-up waits three cooldowns after a scale-down, so
that load near the knee does not add and remove the same replica in turn.
"""

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

from .placement import GpuMemory, Placement
from .scale_down import OFFLOAD_LEVELS, Action, Instance, apply, next_action
from .scale_up import scale_up


class Thresholds(NamedTuple):
    t_up: float = 0.2  # a GPU's vacancy rate above which it may take replicas
    t_down: float = 0.05  # the SLO violation rate above which the instance scales down
    period_s: float = 2.0
    cooldown_s: float = 10.0
    calm_s: float = 30.0  # no scale-up this long after a scale-down
    max_migrations: int = 4  # Algorithm 2's FilterModules bound per episode
    delta_batch: int = 5


class Snapshot(NamedTuple):
    """What the monitor says at one tick: each GPU's vacancy rate (1 - max(utilisation, memory share))
    and the share of the window's finished requests over the SLO."""

    time_s: float
    vacancy: Dict[str, float]
    violation_rate: float


class ScalingController(object):
    def __init__(self, instance: Instance, source: str, memory: Dict[str, GpuMemory], layer_bytes: int,
                 predict: Callable[[Placement], float], thresholds: Optional[Thresholds] = None) -> None:  # fmt: skip
        self.instance, self.source, self.memory = instance, source, memory
        self.layer_bytes, self.predict, self.thresholds = layer_bytes, predict, thresholds or Thresholds()
        self.full_batch = instance.batch_size
        self.last_action_s: Optional[float] = None
        self.last_down_s: Optional[float] = None
        self.reduced_at: Optional[float] = None  # the violation rate when phase 3 last stepped the batch down
        self.batch_held = False  # a batch step made things worse: phase 3 rests until calm
        self.log: List[Dict[str, object]] = []  # every tick's decision, for the run's records

    def tick(self, snapshot: Snapshot) -> Optional[Action]:
        """The action for this tick (already applied to :attr:`instance`), or None."""
        t = self.thresholds
        action, why = None, "idle"
        if self.last_action_s is not None and snapshot.time_s - self.last_action_s < t.cooldown_s:
            why = "cooldown"
        elif snapshot.violation_rate > t.t_down:
            action = next_action(self.instance, self.source, self.memory, self.layer_bytes, self.predict,
                                 t.max_migrations, t.delta_batch)  # fmt: skip
            why = "scale-down" if action else "scale-down: nothing left"
            if action is not None and action.kind == "reduce":
                action, why = self._batch_step(action, snapshot.violation_rate)
            if action is not None:
                self.last_down_s = snapshot.time_s
        elif snapshot.violation_rate == 0 and self._calm(snapshot.time_s):
            # calm: the next violation starts a new episode (migrations and batch steps anew)
            self.instance = self.instance._replace(migrations=0)
            self.reduced_at, self.batch_held = None, False
            spare = snapshot.vacancy.get(self.source, 0.0) > t.t_up  # phase 3 undone only with room to spare
            action = (self._restore() if spare else None) or self._replicate(snapshot)
            why = "scale-up" if action else "calm"
        if action is not None:
            self.instance = _apply(self.instance, action)
            self.last_action_s = snapshot.time_s
        self.log.append({"time_s": snapshot.time_s, "violation_rate": snapshot.violation_rate, "decision": why,
                         "action": action._asdict() if action else None})  # fmt: skip
        return action

    def _batch_step(self, reduce: Action, violation_rate: float) -> Tuple[Optional[Action], str]:
        """Phase 3's next batch step, unless the last one made violations worse: then that one undone
        (the batch back up by Δbs, one offload level back) and phase 3 held until calm."""
        if self.batch_held:
            return None, "scale-down: batch held"
        if self.reduced_at is not None and violation_rate > self.reduced_at:
            self.batch_held = True
            return self._restore(), "scale-down: the last batch step raised violations, undone"
        self.reduced_at = violation_rate
        return reduce, "scale-down"

    def _calm(self, now_s: float) -> bool:
        return self.last_down_s is None or now_s - self.last_down_s >= self.thresholds.calm_s

    def _restore(self) -> Optional[Action]:
        """Phase 3 undone one step: the batch up by Δbs (to the original), one offload level back."""
        level = OFFLOAD_LEVELS.index(self.instance.offload)
        if self.instance.batch_size >= self.full_batch and level == 0:
            return None
        batch = min(self.full_batch, self.instance.batch_size + self.thresholds.delta_batch)
        return Action(0, "restore", batch_size=batch, offload=OFFLOAD_LEVELS[max(0, level - 1)])

    def _replicate(self, snapshot: Snapshot) -> Optional[Action]:
        """The first replica Algorithm 1 adds now (one action a tick; the next tick re-plans)."""
        others = [g for g in snapshot.vacancy if g != self.source]
        planned = scale_up(self.instance.placement, self.memory, snapshot.vacancy, self.thresholds.t_up,
                           self.layer_bytes, self.predict, others)  # fmt: skip
        if not planned.added:
            return None
        layer, gpu = planned.added[0]
        return Action(0, "replicate", layer, self.source, gpu)


def _apply(instance: Instance, action: Action) -> Instance:
    if action.kind == "replicate":
        return instance._replace(placement=instance.placement.add_replica(action.layer, action.destination))
    if action.kind == "restore":
        return instance._replace(batch_size=action.batch_size, offload=action.offload)
    return apply(instance, action)
