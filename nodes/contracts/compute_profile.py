"""A compute profile: how long one step of a model part takes on one piece of hardware in one power mode.

The form is a roofline (as in GenZ and LLMCompass) with a smooth knee and fixed costs:

    t_mem  = (weight bytes + KV bytes read and written) / (bandwidth x bw_efficiency)
    t_flop = FLOPs / (peak x flops_efficiency)
    t      = (t_mem^p + t_flop^p)^(1/p) + step_overhead + layers x layer_overhead
             + sequences x sequence_overhead (+ prefill_overhead)

p (``sharpness``) -> infinity is the plain roofline max(); p = 2 bends the knee as measured decode steps
do (Vidur's A40/A100 linear-op profiles: flat to batch 64, then rising). Weight bytes are read once per
step whatever the batch; FLOPs are 2 per parameter per token plus attention (4 x hidden per token and
context position, QK^T and AV); the LM head counts only for the tokens whose logits are taken.

The controller loads profile files (``testbed/target/compute_profiles.py``, YAML with a source for every
number) and hands each rank its mode's :class:`ModeRates` in the run config; this module, standard
library only, is what both sides compute with.
"""

from typing import Any, Dict, Iterable, NamedTuple, Sequence, Tuple

from .target_model import TargetModel

Segment = Tuple[int, int]  # (new tokens, context tokens already in the cache) of one sequence


class ModeRates(NamedTuple):
    """One power mode's numbers (per GPU on a multi-GPU server)."""

    mem_bw_gbps: float  # peak memory bandwidth, GB/s
    peak_tflops: float  # peak dense FP16 tensor throughput, TFLOP/s
    bw_efficiency: float  # share of peak bandwidth a decode step reaches
    flops_efficiency: float  # share of peak FLOP/s a large prefill reaches
    step_overhead_s: float = 0.0  # per step: launches, synchronisation, the framework
    layer_overhead_s: float = 0.0  # per layer of a step: kernel launches of one decoder layer
    sharpness: float = 2.0  # p of the roofline's knee
    quantized_flops_efficiency: float = 0.0  # for 4-bit weights (dequantisation costs); 0: as fp16
    prefill_overhead_s: float = 0.0  # per step with several new tokens of one sequence (a prompt's graph)
    sequence_overhead_s: float = 0.0  # per sequence of a step: a serving framework's per-request work

    def to_json(self) -> Dict[str, Any]:
        return self._asdict()


def rates_from_json(raw: Dict[str, Any]) -> ModeRates:
    return ModeRates(**{k: float(v) for k, v in raw.items()})


class StepCost(NamedTuple):
    """What a step moves and computes (for the report and for fitting)."""

    weight_bytes: float
    kv_bytes: float
    flops: float


def step_cost(
    model: TargetModel, layers: int, segments: Sequence[Segment], head_tokens: int = 0, attention_layers: int = 0
) -> StepCost:
    """Bytes and FLOPs of one step: ``layers`` decoder layers (and ``attention_layers`` attention-only
    modules, HAT's draft adapter) over ``segments``, and the LM head for ``head_tokens`` tokens."""
    kv_width = model.kv_heads * model.head_dim
    attention_params = 2 * model.hidden * model.hidden + 2 * model.hidden * kv_width
    weight_params = layers * model.layer_params + attention_layers * attention_params
    weight_bytes = weight_params * model.weight_bytes_per_param
    if head_tokens:
        weight_bytes += model.head_params * model.weight_bytes_per_param
    tokens = sum(new for new, _ in segments)
    stacks = layers + attention_layers
    kv_bytes = sum((context + new) * model.kv_bytes_per_token_per_layer * stacks for new, context in segments)
    attention_flops = sum(4.0 * model.hidden * new * (context + (new + 1) / 2.0) for new, context in segments)
    flops = 2.0 * tokens * weight_params + stacks * attention_flops + 2.0 * head_tokens * model.head_params
    return StepCost(weight_bytes, kv_bytes, flops)


def step_seconds(
    rates: ModeRates,
    model: TargetModel,
    layers: int,
    segments: Sequence[Segment],
    head_tokens: int = 0,
    attention_layers: int = 0,
) -> float:
    """Predicted seconds of one step (the module docstring's formula)."""
    cost = step_cost(model, layers, segments, head_tokens, attention_layers)
    memory_s = (cost.weight_bytes + cost.kv_bytes) / (rates.mem_bw_gbps * 1e9 * rates.bw_efficiency)
    efficiency = rates.flops_efficiency
    if model.dtype == "q4f16" and rates.quantized_flops_efficiency:
        efficiency = rates.quantized_flops_efficiency
    compute_s = cost.flops / (rates.peak_tflops * 1e12 * efficiency)
    p = rates.sharpness
    big, small = max(memory_s, compute_s), min(memory_s, compute_s)
    knee = big * (1.0 + (small / big) ** p) ** (1.0 / p) if big > 0 else 0.0  # (m^p + c^p)^(1/p), no overflow
    fixed = rates.step_overhead_s + (layers + attention_layers) * rates.layer_overhead_s
    fixed += len(segments) * rates.sequence_overhead_s
    if any(new > 1 for new, _ in segments):
        fixed += rates.prefill_overhead_s
    return knee + fixed


def batch(new_tokens: int, sequences: int, context_tokens: int) -> Iterable[Segment]:
    """``sequences`` alike segments: the (new tokens, batch, context) grid of a profile."""
    return [(new_tokens, context_tokens)] * sequences
