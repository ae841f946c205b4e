"""DiSCo's cost model as data: FLOPs per token (its Eq. 7-9, App. E.1) and API prices (its Table 8).

Device cost is FLOPs times an energy-to-money rate; server cost is tokens times an API's price per
million tokens. Both per-token FLOP formulas follow DiSCo App. E.1:

- Eq. 7: FLOPs_total = attention + FFN + LayerNorm + embedding + output;
- Eq. 8 (prefill, sequence length L): attention = n_layers (3 d^2 + L^2 d / n_heads + L d + d^2);
- Eq. 9 (decode, KV cache): attention = n_layers (3 d^2 + L d / n_heads + L d + d^2).

The paper does not spell out the other four terms; ours reproduce its Table 6 decode column for
BLOOM-1.1B (0.82 G) and Qwen-0.5B (0.37 G) with its stated shapes: FFN = n_layers x (number of
FFN matrices) x d x d_ffn, embedding = output = vocab x d (Table 7 gives them equal shares), and
LayerNorm = (2 n_layers + 1) x 5 d (0.02% in Table 7). Table 6's 0.42 G for BLOOM-560M cannot
come from the shape the paper gives for it (d = 512, FFN 2048: 0.33 G by any reading).
Grouped-query attention replaces the K and V parts of "3 d^2" with 2 d x d_kv, which reduces to
Eq. 8-9 when d_kv = d. Table 6's prefill column
grows faster with L than Eq. 8 does (it matches L^2 d without the 1/n_heads): we implement Eq. 8 as
printed and say so in the report.

Rate units: App. E states the exchange rate as "0.3 $ per million FLOPs" (server-constrained) and
"5 $ per million FLOPs" (device-constrained). Read literally, one 0.8 GFLOP token would cost $240,
more than every Table 8 price by nine orders of magnitude, and no experiment could be
server-constrained. Read as dollars per million *GFLOPs* (10^15 FLOPs, i.e. per PFLOP), a million
BLOOM-1.1B tokens cost $0.25 or $4.1: below and above the Table 8 prices respectively, which is what
the two scenarios need. We use USD per PFLOP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# DiSCo Table 8: USD per million tokens (input, output), public prices on 2024-10-28.
API_PRICES_USD_PER_MTOK: dict[str, tuple[float, float]] = {
    "deepseek-v2.5": (0.14, 0.28),
    "gpt-4o-mini": (0.15, 0.60),
    "llama-3.1-70b-hyperbolic": (0.40, 0.40),
    "llama-3.1-70b-amazon": (0.99, 0.99),
    "command-cohere": (1.25, 2.00),
    "gpt-4o": (2.50, 10.0),
    "claude-3.5-sonnet": (3.00, 15.0),
    "o1-preview": (15.0, 60.0),
}

# DiSCo App. E: device energy-to-money rate, USD per 10^15 FLOPs (see the module docstring).
DEVICE_USD_PER_PFLOP = {"server-constrained": 0.3, "device-constrained": 5.0}


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs from a decoder-only model."""

    n_layers: int
    d_model: int
    n_heads: int
    d_ffn: int
    vocab: int
    n_kv_heads: int | None = None
    ffn_matrices: int = 2  # 2 for GELU MLPs (BLOOM), 3 for SwiGLU (Llama)

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """A Hugging Face ``config.json`` (Llama family: SwiGLU, grouped-query attention)."""
        return cls(
            n_layers=int(config["num_hidden_layers"]),
            d_model=int(config["hidden_size"]),
            n_heads=int(config["num_attention_heads"]),
            d_ffn=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            n_kv_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            ffn_matrices=3 if config.get("hidden_act", "silu") in ("silu", "swiglu") else 2,
        )

    @classmethod
    def from_model_dir(cls, directory: str | Path) -> ModelShape:
        return cls.from_config(json.loads((Path(directory) / "config.json").read_text()))

    @property
    def d_kv(self) -> int:
        return self.d_model * (self.n_kv_heads or self.n_heads) // self.n_heads


# Shapes DiSCo App. E.1 states for its Table 6 (BLOOM's vocabulary 250880, Qwen1.5's 151936).
DISCO_SHAPES = {
    "bloom-1.1b": ModelShape(24, 1024, 16, 4096, 250880),
    "bloom-560m": ModelShape(24, 512, 8, 2048, 250880),
    "qwen-0.5b": ModelShape(24, 768, 12, 2048, 151936),
}


def layer_flops(shape: ModelShape, context_tokens: np.ndarray | float, phase: str) -> np.ndarray:
    """FLOPs of one decoder layer for one token at sequence length L (DiSCo Eq. 8 or 9, plus the
    layer's FFN and its two norms)."""
    d, L = shape.d_model, np.asarray(context_tokens, dtype="float64")
    if phase == "prefill":
        score = L * L * d / shape.n_heads  # Eq. 8
    elif phase == "decode":
        score = L * d / shape.n_heads  # Eq. 9
    else:
        raise ValueError(f"phase must be prefill or decode, not {phase!r}")
    attention = d * d + 2 * d * shape.d_kv + score + L * d + d * d
    ffn = shape.ffn_matrices * d * shape.d_ffn
    norms = 2 * 5 * d
    return attention + ffn + norms


def head_flops(shape: ModelShape) -> float:
    """Embedding + output projection + the final norm (Eq. 7's last terms)."""
    return 2.0 * shape.vocab * shape.d_model + 5 * shape.d_model


def flops_per_token(
    shape: ModelShape, context_tokens: np.ndarray | float, phase: str, *, layers: int | None = None,
    with_head: bool = True,
) -> np.ndarray:
    """DiSCo Eq. 7: one token's FLOPs at sequence length L through the whole model, or through
    ``layers`` decoder layers (with or without embedding and head: one side of a split model)."""
    layers = shape.n_layers if layers is None else layers
    return layers * layer_flops(shape, context_tokens, phase) + (head_flops(shape) if with_head else 0.0)


def request_flops(shape: ModelShape, prompt_tokens: np.ndarray, output_tokens: np.ndarray,
                  layers: int, with_head: bool) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Prefill and decode FLOPs of requests through ``layers`` decoder layers (plus embedding and
    head when ``with_head``). Prefill: L tokens at sequence length L (Eq. 8). Decode: the first
    token comes from prefill; the i-th further token (i = 1 .. n - 1) is computed with L + i
    positions in the sequence (Eq. 9 at L + i)."""
    L = np.asarray(prompt_tokens, dtype="float64")
    n = np.maximum(np.asarray(output_tokens, dtype="float64") - 1, 0)
    head = head_flops(shape) if with_head else 0.0
    prefill = L * flops_per_token(shape, L, "prefill", layers=layers, with_head=with_head)
    # decode layer FLOPs are affine in L: a + b L, so the sum over L + 1 .. L + n is closed-form
    a = layer_flops(shape, 0.0, "decode")
    b = layer_flops(shape, 1.0, "decode") - a
    contexts_sum = n * L + n * (n + 1) / 2
    decode = layers * (a * n + b * contexts_sum) + head * n
    return prefill, decode


def api_price_usd(api: str, input_tokens: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
    """Server cost at an API's Table 8 price."""
    if api not in API_PRICES_USD_PER_MTOK:
        raise ValueError(f"unknown API {api!r}; known: {', '.join(API_PRICES_USD_PER_MTOK)}")
    price_in, price_out = API_PRICES_USD_PER_MTOK[api]
    return (np.asarray(input_tokens) * price_in + np.asarray(output_tokens) * price_out) / 1e6


# The API each of DiSCo's traced services is billed at (Table 8).
SERVICE_APIS = {"gpt": "gpt-4o-mini", "deepseek": "deepseek-v2.5", "command": "command-cohere",
                "llama": "llama-3.1-70b-hyperbolic"}  # fmt: skip
REGIMES = {"server": "server-constrained", "device": "device-constrained"}
# The model each of DiSCo's device speeds (nodes/endpoints/device_speed.py) runs, for its FLOPs.
DEVICE_SPEED_MODELS = {"pixel7pro-bloom-1.1b": "bloom-1.1b", "pixel7pro-bloom-560m": "bloom-560m",
                       "xiaomi14-qwen-0.5b": "qwen-0.5b"}  # fmt: skip
PRICE_CONTEXT_TOKENS = 20.0  # the prompt a device's per-token FLOPs are priced at (Alpaca-like mean)


def dispatch_regime(policy: str, forced: object = None) -> str:
    """The regime a dispatch policy is priced in: the one a campaign forces, else ``-d`` policies
    device-constrained, every other server-constrained."""
    if isinstance(forced, str) and forced:
        return forced
    return "device" if str(policy).endswith("-d") else "server"


@dataclass(frozen=True)
class DispatchPrices:
    """USD per token at each endpoint for one service, device model and regime (Algorithm 1's and
    Eq. 4's c_s^p, c_s^d, c_d^p, c_d^d); device tokens at a typical prompt of ``context_tokens``."""

    server_prefill: float
    server_decode: float
    device_prefill: float
    device_decode: float

    @classmethod
    def for_run(cls, api: str, device_model: str, regime: str, context_tokens: float) -> DispatchPrices:
        price_in, price_out = API_PRICES_USD_PER_MTOK[api]
        shape = DISCO_SHAPES[device_model]
        usd_per_flop = DEVICE_USD_PER_PFLOP[REGIMES.get(regime, regime)] / 1e15
        return cls(price_in / 1e6, price_out / 1e6,
                   float(flops_per_token(shape, context_tokens, "prefill")) * usd_per_flop,
                   float(flops_per_token(shape, context_tokens, "decode")) * usd_per_flop)  # fmt: skip

    @classmethod
    def for_dispatch(cls, service: str, device_speed: str, regime: str) -> DispatchPrices:
        """The prices of a dispatch run: its service's API, its device speed's model, at the Alpaca-like
        prompt."""
        return cls.for_run(SERVICE_APIS[service], DEVICE_SPEED_MODELS[device_speed], regime, PRICE_CONTEXT_TOKENS)

    def as_list(self) -> list[float]:
        """Server input, server output, device prefill, device decode (the run config's order)."""
        return [self.server_prefill, self.server_decode, self.device_prefill, self.device_decode]

    def cost_usd(self, server_input: np.ndarray, server_output: np.ndarray, device_prefill: np.ndarray,
                 device_decode: np.ndarray) -> np.ndarray:  # fmt: skip
        """Per request: the server's bill plus the device's energy in money (App. E)."""
        return (np.asarray(server_input) * self.server_prefill + np.asarray(server_output) * self.server_decode
                + np.asarray(device_prefill) * self.device_prefill + np.asarray(device_decode) * self.device_decode)
