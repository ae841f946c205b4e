"""The serving engine's scheduler knobs, as the run config carries them and the schedulers
(:mod:`nodes.serving.schedulers`) read them."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerSettings:
    rr_interval: int = 50  # iterations a request runs before round robin moves it to the back
    watermark: float = 0.9  # Andes' trigger: KV cache use above this share of M (Optimisation 1)
    preemption_cap: float = 1.0  # P: preemptions over admitted requests, at most (Optimisation 4)
    batch_grid: int = 16  # batch sizes Andes tries, geometrically from B_min to B_max (all when fewer)
    dp_block_tokens: int = 16  # andes-dp counts memory in blocks of this many tokens
