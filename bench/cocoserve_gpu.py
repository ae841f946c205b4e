"""CoCoServe's premises on one real GPU: what a Llama-2-13B decoder layer costs to run for a share of a
batch, to copy, and to restart, and whether NVML's utilisation says what the monitor's busy share says.

Everything here is measured on this machine's GPU with the engine's own code (no profile, no pacing):

- ``profile``: ``python -m nodes.workers.profile_engine`` on a random checkpoint of Llama-2-13B's shape
  cut to 4 layers (bf16): prompt steps, decode steps at batch 1 to 64, the LM head. The rows are what
  ``testbed profile`` fits a compute profile to; per-layer times by batch are Eq. 3's times by share.
- ``copy``: replicating k decoder layers (k = 1 to 40) into fresh memory, device to device (the floor
  of a peer-to-peer copy between GPUs) and staged through one pinned host buffer of one layer (a
  server whose GPUs cannot reach each other); bytes moved and the median seconds, fitted affine.
- ``restart``: a fresh process that imports torch, starts CUDA, loads k layers of a checkpoint of the
  whole model (all 40 layers, random, written once) with embedding and head onto the GPU and runs one
  step, for k = 1, 10, 40: the 40-layer restart is Sec. 2.3's, measured; the fit in k says what a
  layer adds. ``--quick`` restarts 1, 2 and 4 layers of the small checkpoint.
- ``decode``: one layer's decode step by batch size, the engine's per-sequence attention against the
  same weights batched, and what halving the batch (a replica's share) saves in each.
- ``nvml``: the telemetry sampler's NVML source at 100 ms while a decode layer runs a duty cycle of known
  busy share (0 to 100% of each 200 ms): NVML's ``gpu_util_pct`` and power against the share.

Each measured time is repeated (``--reps``, ``--decode-reps``) and each figure the reproduction reads
has its 95% interval (:mod:`analysis.uncertainty`): a copy's mean seconds, the change of a decode step
when its batch is halved, a restart of the whole model.

    python bench/cocoserve_gpu.py                      # on a GPU: about 4 minutes
    python bench/cocoserve_gpu.py --quick --out /tmp/gpu_quick.json   # on a CPU: small shapes, no NVML

One invocation writes one result, bench/results/cocoserve_gpu.json (or what ``--out`` names; the
profile's rows are in it, and in ``--profile-jsonl`` when given), saved again after each section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analysis.uncertainty import mean_interval, unpaired_change_interval  # noqa: E402
from bench._common import affine_fit, write  # noqa: E402
from bench.random_weights import SHAPES, random_checkpoint  # noqa: E402

RESTART = """
import json, sys, time
started = float(sys.argv[1])
import torch
imported = time.time()
device = sys.argv[3]
torch.zeros(1, device=device)
cuda_ready = time.time()
from nodes.inference.checkpoint import load_part
from nodes.inference.model import Segment
part = load_part(sys.argv[2], range(int(sys.argv[4])), embedding=True, head=True, dtype="bfloat16", device=device)
if device.startswith("cuda"):
    torch.cuda.synchronize()
loaded = time.time()
with torch.inference_mode():
    part.logits(part.run_layers(part.embed(torch.tensor([1, 5, 6])), [Segment(part.new_cache(8), 3)]))
if device.startswith("cuda"):
    torch.cuda.synchronize()
print(json.dumps({"import_s": imported - started, "cuda_init_s": cuda_ready - imported,
                  "load_s": loaded - cuda_ready, "first_step_s": time.time() - loaded}))
"""


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_layer(shape: str, device: str) -> Any:
    """A decoder layer of ``shape`` in bf16 on ``device`` (random weights)."""
    import torch

    from nodes.inference.config import LlamaConfig
    from nodes.inference.model import DecoderLayer

    config = LlamaConfig(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         torch_dtype="bfloat16", **SHAPES[shape])  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return DecoderLayer(config, 0).to(torch.bfloat16).eval(), config


def copy_cost(shape: str, device: str, counts: list[int], staged_max: int, reps: int) -> dict[str, Any]:
    """Replicating k layers: every parameter into a fresh allocation, device to device and staged
    through one pinned host buffer of one layer's bytes."""
    import torch

    layer, _ = one_layer(shape, device)
    tensors = list(layer.state_dict().values())
    layer_bytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = device.startswith("cuda")
    staging = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]
    rows = []
    for k in counts:
        for path in ("device", "staged"):
            if path == "staged" and k > staged_max:
                continue
            times = []
            for _ in range(reps):
                sync(device)
                started = time.perf_counter()
                copies = []
                for _ in range(k):
                    if path == "device":
                        copies.append([t.clone() for t in tensors])
                    else:
                        for buffer, t in zip(staging, tensors, strict=True):
                            buffer.copy_(t, non_blocking=False)
                        copies.append([buffer.to(device, non_blocking=False) for buffer in staging])
                sync(device)
                times.append(time.perf_counter() - started)
                moved = sum(t.numel() * t.element_size() for layer_copy in copies for t in layer_copy)
                del copies
            rows.append({"path": path, "layers": k, "bytes": moved, "seconds": statistics.median(times),
                         "seconds_all": times, "seconds_mean": mean_interval(times).as_dict()})  # fmt: skip
    fits = {}
    for path in ("device", "staged"):
        mine = [r for r in rows if r["path"] == path]
        if len(mine) >= 2:
            fit = affine_fit([r["bytes"] for r in mine], [r["seconds"] for r in mine])
            fits[path] = {"fixed_s": fit["intercept"], "gbps": 1e-9 / fit["slope"] if fit["slope"] > 0 else None,
                          "r2": fit["r2"]}  # fmt: skip
    del layer, tensors, staging
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    exact = all(r["bytes"] == r["layers"] * layer_bytes for r in rows)
    return {"layer_bytes": layer_bytes, "rows": rows, "fits": fits, "memory_is_layers_times_layer_bytes": exact}


def restart_cost(checkpoint: Path, device: str, counts: list[int], reps: int) -> dict[str, Any]:
    """A fresh instance of k layers, from the process's start to its first step's end. One untimed restart
    first (a fresh machine's first process pays for cold disk and driver caches once, which would tilt the
    fit), then the layer counts in turn within each repetition, so that drift spreads over all of them."""

    def restart(k: int) -> dict[str, Any]:
        started = time.time()
        done = subprocess.run([sys.executable, "-c", RESTART, repr(started), str(checkpoint), device, str(k)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        wall = time.time() - started
        if done.returncode != 0:
            raise RuntimeError(f"restart of {k} layers failed: {done.stderr[-1500:]}")
        return {"layers": k, "seconds": wall, **json.loads(done.stdout.strip().splitlines()[-1])}

    warm_up = restart(max(counts))
    rows = [{**restart(k), "rep": rep} for rep in range(reps) for k in counts]
    medians = {k: statistics.median(r["seconds"] for r in rows if r["layers"] == k) for k in counts}
    whole = max(counts)
    return {"warm_up": warm_up, "rows": rows, "median_s": medians,
            "fit": affine_fit(list(medians), list(medians.values())), "whole_layers": whole,
            "whole_mean_s": mean_interval([r["seconds"] for r in rows if r["layers"] == whole]).as_dict()}


class DecodeSteps:
    """One decode step of one layer over ``batch`` sequences after ``context`` positions, two ways: the
    engine's layer (attention one sequence at a time, as :class:`nodes.inference.model.Attention` does)
    and the same weights batched (one scaled-dot-product attention over a [batch, heads, context]
    cache: what a kernel-efficient server runs). Both end synchronised."""

    def __init__(self, layer: Any, config: Any, device: str, batch: int, context: int) -> None:
        import torch

        from nodes.inference.kv_cache import KVCache
        from nodes.inference.rope import RotaryEmbedding

        self.layer, self.device, self.batch, self.context = layer, device, batch, context
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        rotary = RotaryEmbedding(config, torch.device(device))
        self.cos, self.sin = rotary.cos_sin(torch.tensor([context], device=device), torch.bfloat16, context + 1)
        self.hidden = torch.randn(batch, config.hidden_size, device=device, dtype=torch.bfloat16)
        self.caches = [KVCache([0], self.kv_heads, self.head_dim, torch.bfloat16, torch.device(device), context + 8)
                       for _ in range(batch)]  # fmt: skip
        for cache in self.caches:
            cache.fill_random(context)
        self.keys = torch.randn(batch, self.kv_heads, context + 1, self.head_dim, device=device, dtype=torch.bfloat16)
        self.values = torch.randn_like(self.keys)

    def engine(self) -> None:
        import torch

        from nodes.inference.model import Segment

        with torch.inference_mode():
            self.layer(self.hidden, [Segment(c, 1) for c in self.caches], [(self.cos, self.sin)] * self.batch)
        for cache in self.caches:  # the step appended a position: take it back, the next is alike
            cache.length = self.context
        sync(self.device)

    def batched(self) -> None:
        import torch
        import torch.nn.functional as F

        from nodes.inference.rope import apply_rotary

        layer, attention, b, c = self.layer, self.layer.self_attn, self.batch, self.context
        with torch.inference_mode():
            x = layer.input_layernorm(self.hidden)
            q = apply_rotary(attention.q_proj(x).view(b, self.heads, 1, self.head_dim), self.cos, self.sin)
            k = apply_rotary(attention.k_proj(x).view(b, self.kv_heads, 1, self.head_dim), self.cos, self.sin)
            self.keys[:, :, c] = k[:, :, 0]
            self.values[:, :, c] = attention.v_proj(x).view(b, self.kv_heads, self.head_dim)
            out = F.scaled_dot_product_attention(q, self.keys, self.values, enable_gqa=self.kv_heads < self.heads)
            h = self.hidden + attention.o_proj(out.reshape(b, self.heads * self.head_dim))
            h + layer.mlp(layer.post_attention_layernorm(h))
        sync(self.device)


def timed_all(step: Any, reps: int) -> list[float]:
    """Seconds of ``step`` in each of ``reps`` runs after three to warm up."""
    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def timed(step: Any, reps: int) -> float:
    """Median seconds of ``step`` over ``reps`` runs after three to warm up."""
    return statistics.median(timed_all(step, reps))


def decode_by_batch(shape: str, device: str, batches: list[int], context: int, reps: int) -> dict[str, Any]:
    """:class:`DecodeSteps` at each batch size, and what halving the batch (a replica's share: Eq. 3's
    time by share) saves in each: the median's saving, and the change of the mean step with its interval
    (Eq. 1 has a layer's time proportional to its batch share: -50%)."""
    layer, config = one_layer(shape, device)
    rows = []
    for batch in batches:
        steps = DecodeSteps(layer, config, device, batch, context)
        engine, batched = timed_all(steps.engine, reps), timed_all(steps.batched, reps)
        rows.append({"batch": batch, "engine_s": statistics.median(engine), "batched_s": statistics.median(batched),
                     "engine_all_s": engine, "batched_all_s": batched})  # fmt: skip
        del steps
    by_batch = {r["batch"]: r for r in rows}
    for r in rows:
        half = by_batch.get(r["batch"] // 2)
        for path in ("engine", "batched"):
            r[f"{path}_half_saves"] = 1 - half[f"{path}_s"] / r[f"{path}_s"] if half else None
            r[f"{path}_half_change"] = (unpaired_change_interval(half[f"{path}_all_s"], r[f"{path}_all_s"]).as_dict()
                                        if half else None)  # fmt: skip
    return {"context": context, "reps": reps, "rows": rows}


def nvml_duty(shape: str, device: str, shares: list[float], phase_s: float, period_s: float,
              path: str) -> dict[str, Any]:  # fmt: skip
    """NVML utilisation and power while a decode layer (``path``: engine or batched, see
    :class:`DecodeSteps`) is busy ``share`` of every ``period_s``."""
    import torch

    from nodes.telemetry.nvml import NvmlSource

    layer, config = one_layer(shape, device)
    batch, context = 32, 512
    steps = DecodeSteps(layer, config, device, batch, context)
    step = steps.engine if path == "engine" else steps.batched
    step_s = timed(step, 20)
    source = NvmlSource(0.1)
    samples: list[tuple[float, str, float]] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            now = time.monotonic()
            samples.extend((now, r.metric, r.value) for r in source.sample(now))
            stop.wait(0.1)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    phases = []
    try:
        for share in shares:
            began = time.monotonic()
            busy = 0.0
            while time.monotonic() - began < phase_s:
                cycle = time.monotonic()
                while time.monotonic() - cycle < share * period_s:
                    started = time.monotonic()
                    step()
                    busy += time.monotonic() - started
                rest = period_s - (time.monotonic() - cycle)
                if rest > 0:
                    time.sleep(rest)
            ended = time.monotonic()
            phases.append({"share": share, "began": began, "ended": ended, "busy_share": busy / (ended - began)})
    finally:
        stop.set()
        thread.join(timeout=5)
    for phase in phases:  # a phase's first period still averages the one before (NVML's window)
        inside = [(t, m, v) for t, m, v in samples if phase["began"] + max(1.0, period_s) <= t <= phase["ended"]]
        for metric in ("gpu_util_pct", "mem_util_pct", "power_mw", "mem_used_mb", "sm_clock_mhz"):
            values = [v for _, m, v in inside if m == metric]
            phase[metric] = statistics.mean(values) if values else None
        energy = [(t, v) for t, m, v in inside if m == "energy_mj"]
        phase["energy_power_w"] = ((energy[-1][1] - energy[0][1]) / 1e3 / (energy[-1][0] - energy[0][0])
                                   if len(energy) >= 2 and energy[-1][0] > energy[0][0] else None)  # fmt: skip
        phase["samples"] = len(inside)
    util = [(p["busy_share"], p["gpu_util_pct"]) for p in phases if p["gpu_util_pct"] is not None]
    fit = affine_fit([u for u, _ in util], [g / 100 for _, g in util]) if len(util) >= 2 else None
    source.close()
    return {"path": path, "decode_batch": batch, "context": context, "step_s_median": step_s,
            "period_s": period_s, "phase_s": phase_s, "phases": phases, "util_vs_busy_share": fit,
            "problems": [list(p) for p in source.problems],
            "torch_reserved_mb": torch.cuda.memory_reserved() / 2**20 if device.startswith("cuda") else None,
            }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="cocoserve_gpu", help="result name under bench/results, or a .json path")
    parser.add_argument("--profile-jsonl", type=Path, help="also write the profile's rows here")
    parser.add_argument("--quick", action="store_true", help="small shapes on the CPU: checks the script")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each copy and restart")
    parser.add_argument("--decode-reps", type=int, default=10, help="timed decode steps per batch and path")
    parser.add_argument("--nvml-period-s", type=float, default=1.0, help="the duty cycle's period")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out")
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    shape = "1b" if args.quick else "13b"
    skip = set(filter(None, args.skip.split(",")))
    result: dict[str, Any] = {"command": " ".join(["python", "bench/cocoserve_gpu.py", *sys.argv[1:]]),
                              "device": device, "shape": shape, "torch": torch.__version__,
                              "gpu": torch.cuda.get_device_name() if device == "cuda" else None}  # fmt: skip

    def save(section: str, started: float, value: Any) -> None:
        result[section] = value
        result.setdefault("section_s", {})[section] = round(time.monotonic() - started, 2)
        write(args.out, result)  # the same file each time: what is done so far
        print(section, "done in", result["section_s"][section], "s", flush=True)

    with tempfile.TemporaryDirectory() as work:
        checkpoint = random_checkpoint(shape, Path(work) / shape, layers=4, vocab=32000)
        if "profile" not in skip:
            began = time.monotonic()
            grid = (["--layers", "1,2", "--prefill", "1,16,128", "--batch", "1,2,4", "--context", "0,64", "--head", "1"]
                    if args.quick else
                    ["--layers", "1,2,4", "--prefill", "1,16,128,512,2048", "--batch", "1,2,4,8,16,32,64",
                     "--context", "0,512,2048", "--head", "1,8,64"])  # fmt: skip
            argv = [sys.executable, "-m", "nodes.workers.profile_engine", "--model", str(checkpoint), "--device",
                    device, "--dtype", "bfloat16", "--threads", "4", "--reps", "5", *grid]  # fmt: skip
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
            if args.profile_jsonl:
                args.profile_jsonl.write_text(done.stdout)
            rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
            save("profile", began, {"exit": done.returncode, "rows": rows, "stderr": done.stderr[-1500:]})
        if "copy" not in skip:
            began = time.monotonic()
            counts = [1, 2, 4] if args.quick else [1, 2, 5, 10, 20, 30, 40]
            save("copy", began, copy_cost(shape, device, counts, max(counts), args.reps))
        if "restart" not in skip:
            began = time.monotonic()
            if args.quick:
                whole, counts = checkpoint, [1, 2, 4]
            else:  # the whole model, so that its restart is measured, not extrapolated from a few layers
                whole, counts = random_checkpoint(shape, Path(work) / f"{shape}-whole", vocab=32000), [1, 10, 40]
            save("restart", began, restart_cost(whole, device, counts, args.reps))
    if "decode" not in skip:
        began = time.monotonic()
        batches = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
        save("decode", began, decode_by_batch(shape, device, batches, 64 if args.quick else 512, args.decode_reps))
    if "nvml" not in skip and device == "cuda":
        began = time.monotonic()
        for path_kind in ("engine", "batched"):
            save("nvml_" + path_kind, began, nvml_duty(shape, device, [0.0, 0.25, 0.5, 0.75, 1.0], 6.0,
                                                       args.nvml_period_s, path_kind))  # fmt: skip
            began = time.monotonic()
    copy, restart = result.get("copy"), result.get("restart")
    if copy and restart:
        one = next(r["seconds"] for r in copy["rows"] if r["path"] == "device" and r["layers"] == 1)
        result["restart_over_one_layer_op"] = restart["whole_mean_s"]["estimate"] / one
    path = write(args.out, result)
    brief = {k: v for k, v in result.items() if not k.startswith(("copy", "restart", "nvml", "decode", "profile"))}
    print(json.dumps(brief, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
