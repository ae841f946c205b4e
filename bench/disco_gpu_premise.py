"""DiSCo's premises measured on real compute: the server endpoint on a GPU (TTFT hardly grows with the
prompt) against the device endpoint on a CPU (TTFT linear in the prompt), with NVML energy.

Each configuration starts ``python -m nodes.endpoints --pace compute`` (no pacing: every time is this
machine's) on a model and a torch device, then sends completions through the API's client:

- ``idle``: one request at a time, prompt lengths drawn uniformly (seeded) up to ``--max-prompt``;
- ``loaded``: the same lengths arriving as a Poisson stream at ``--load`` times the idle service rate,
  so a request waits for those before it (the endpoint computes one forward pass at a time).

For each phase: Pearson(prompt tokens, TTFT) with its 95% interval over the requests (DiSCo's Table 1),
the fit TTFT = k l + c, TTFT and TBT medians. On a GPU the NVML sampler (``python -m
nodes.telemetry.sampler --source nvml``) runs beside it, and the energy counter gives joules per request.
A model named by a shape (1b, 7b, 13b) is a checkpoint of random weights of that shape with the tiny
model's tokenizer (its tokens are really computed, meaningless as text): only its size matters.

    python bench/disco_gpu_premise.py --config server:cuda:1b --config device:cpu:tiny

Writes bench/results/disco_gpu_premise.json (``--result`` names another), the NVML samples and engine
profile under ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analysis.uncertainty import statistic_interval  # noqa: E402
from bench._common import write  # noqa: E402
from bench.random_weights import SHAPES, TINY, random_checkpoint  # noqa: E402
from nodes.endpoints.client import CompletionStream  # noqa: E402


def start_endpoint(model: Path, device: str, threads: int, workdir: Path) -> tuple[subprocess.Popen, str]:
    port_file = workdir / f"port-{model.name}-{device}"
    port_file.unlink(missing_ok=True)  # never a port of an endpoint before this one
    argv = [sys.executable, "-m", "nodes.endpoints", "--model", str(model), "--pace", "compute", "--device", device,
            "--dtype", "bfloat16" if device.startswith("cuda") else "float32", "--threads", str(threads),
            "--port-file", str(port_file), "--log", str(workdir / "endpoint_requests.jsonl")]  # fmt: skip
    log = workdir / f"endpoint-{model.name}-{device}.log"  # a file, not a pipe nobody reads: a full pipe stalls it
    with log.open("w") as output:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not port_file.exists() or not port_file.read_text().strip():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the endpoint did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    return process, f"http://127.0.0.1:{port_file.read_text().strip()}/v1"


def prompt_ids(rng: np.random.Generator, tokens: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(2, vocab, size=tokens)]


def one_request(url: str, ids: list[int], max_tokens: int, arrival_s: float | None = None) -> dict:
    """One streamed completion: TTFT (from ``arrival_s`` if given: queueing counted) and the token gaps."""
    events: queue.Queue = queue.Queue()
    stream = CompletionStream("r", url, ids, max_tokens, events, timeout_s=600.0)
    stream.start()
    started = arrival_s if arrival_s is not None else stream.started_s
    times: list[float] = []
    while True:
        _, kind, payload, at = events.get(timeout=600)
        if kind == "tokens":
            times.extend([at] * len(payload))
        elif kind == "failed":
            raise RuntimeError(payload)
        else:
            break
    stream.join(5)
    gaps = np.diff(times).tolist() if len(times) > 1 else []
    return {"prompt_tokens": len(ids), "ttft_s": times[0] - started, "gaps_s": gaps, "tokens": len(times),
            "started_s": started, "ended_s": times[-1]}  # fmt: skip


def pearson(pairs: np.ndarray) -> float:
    """Pearson's r of a [units, 2] array's two columns (NaN where one is constant)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1])


def phase_summary(rows: list[dict]) -> dict:
    lengths = np.array([r["prompt_tokens"] for r in rows], float)
    ttft = np.array([r["ttft_s"] for r in rows], float)
    gaps = np.concatenate([r["gaps_s"] for r in rows if r["gaps_s"]] or [np.zeros(0)])
    slope, intercept = np.polyfit(lengths, ttft, 1)
    return {"requests": len(rows), "pearson_length_ttft": pearson(np.column_stack([lengths, ttft])),
            "pearson_length_ttft_interval": statistic_interval(np.column_stack([lengths, ttft]), pearson).as_dict(),
            "ttft_fit_s_per_token": float(slope), "ttft_fit_intercept_s": float(intercept),
            "ttft_p50_s": float(np.median(ttft)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tbt_p50_s": float(np.median(gaps)) if gaps.size else None,
            "tbt_p99_s": float(np.percentile(gaps, 99)) if gaps.size else None}  # fmt: skip


def nvml_energy(csv_path: Path, windows: dict[str, tuple[float, float]]) -> dict:
    """Per window (wall-clock seconds, as the rows' ``ts_s``): joules from the energy counter, mean
    power, peak utilisation."""
    rows = []
    with open(csv_path) as handle:
        for row in csv.DictReader(line for line in handle if not line.startswith("#")):
            rows.append(row)
    out = {}
    for name, (start, end) in windows.items():

        def series(metric: str, start: float = start, end: float = end) -> list[tuple[float, float]]:
            return [(float(r["ts_s"]), float(r["value"])) for r in rows
                    if r["metric"] == metric and start <= float(r["ts_s"]) <= end]  # fmt: skip

        energy = series("energy_mj")
        power = [v for _, v in series("power_mw")]
        util = [v for _, v in series("gpu_util_pct")]
        out[name] = {"energy_j": (energy[-1][1] - energy[0][1]) / 1e3 if len(energy) > 1 else None,
                     "power_w_mean": float(np.mean(power)) / 1e3 if power else None,
                     "gpu_util_pct_max": max(util) if util else None, "samples": len(power)}  # fmt: skip
    return out


def run_config(label: str, device: str, model: Path, args: argparse.Namespace, workdir: Path) -> dict:
    import torch

    from nodes.inference.config import LlamaConfig

    vocab = LlamaConfig.load(str(model)).vocab_size
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(16, args.max_prompt + 1, size=args.requests).tolist()
    sampler = None
    telemetry = workdir / f"{label}_nvml.csv"
    if device.startswith("cuda"):
        sampler = subprocess.Popen([sys.executable, "-m", "nodes.telemetry.sampler", "--source", "nvml",
                                    "--interval-ms", "50", "--out", str(telemetry), "--max-seconds", "900"],
                                   cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip
    process, url = start_endpoint(model, device, args.threads, workdir)
    windows: dict[str, tuple[float, float]] = {}
    try:
        for n in (64, 512, args.max_prompt):  # warm-up (allocator, kernels) at a few lengths
            one_request(url, prompt_ids(rng, n, vocab), 4)
        time.sleep(1.0)
        idle_start = time.time()
        idle = [one_request(url, prompt_ids(rng, n, vocab), args.max_tokens) for n in lengths]
        windows["idle"] = (idle_start, time.time())
        service_s = float(np.mean([r["ended_s"] - r["started_s"] for r in idle]))
        rate = args.load / service_s
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(lengths)))
        pending: list = []
        results: list[dict] = []
        from concurrent.futures import ThreadPoolExecutor

        loaded_start, loaded_wall = time.monotonic(), time.time()
        with ThreadPoolExecutor(max_workers=64) as pool:
            for n, at in zip(lengths, arrivals, strict=True):
                due = loaded_start + at
                time.sleep(max(0.0, due - time.monotonic()))
                pending.append(pool.submit(one_request, url, prompt_ids(rng, n, vocab), args.max_tokens, due))
            results = [f.result(timeout=900) for f in pending]
        windows["loaded"] = (loaded_wall, time.time())
    finally:
        process.terminate()
        process.wait(30)
        if sampler is not None:
            time.sleep(0.3)
            sampler.terminate()
            sampler.wait(30)
    out = {"label": label, "device": device, "model": model.name, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
           "threads": args.threads, "max_prompt_tokens": args.max_prompt, "max_tokens": args.max_tokens,
           "idle": phase_summary(idle), "loaded": dict(phase_summary(results), load=args.load, rate_per_s=rate),
           "idle_service_s_mean": service_s, "requests": {"idle": idle, "loaded": results}}  # fmt: skip
    if sampler is not None and telemetry.exists():
        energy = nvml_energy(telemetry, windows)
        for name in ("idle", "loaded"):
            if energy[name]["energy_j"] is not None:
                energy[name]["j_per_request"] = energy[name]["energy_j"] / len(lengths)
        out["nvml"] = energy
    return out


def profile_engine(shape: str, layers: int, device: str, out: Path, workdir: Path) -> None:
    """``python -m nodes.workers.profile_engine`` on a random checkpoint of ``shape`` cut to ``layers``
    layers (32,000-token vocabulary): the rows ``testbed profile`` fits a compute profile to."""
    model = random_checkpoint(shape, workdir / ("profile-" + shape), layers=layers, vocab=32000)
    argv = [sys.executable, "-m", "nodes.workers.profile_engine", "--model", str(model), "--device", device,
            "--dtype", "bfloat16", "--layers", "1,2,4", "--prefill", "1,16,128,512,2048", "--batch", "1,8,32",
            "--context", "0,512,2048", "--head", "1,8,64", "--reps", "5"]  # fmt: skip
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    out.write_text(result.stdout)
    print("profile:", result.returncode, result.stdout.strip().splitlines()[-1:] or result.stderr[-2000:], flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", metavar="SHAPE:LAYERS:DEVICE",
                        help="also time the engine's steps on a random checkpoint (e.g. 7b:4:cuda)")
    parser.add_argument("--config", action="append", default=[],
                        help="label:device:model (model: tiny, a shape of random weights (1b, 7b, 13b) or a directory)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-prompt", type=int, default=2048, help="largest prompt length (tokens)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--load", type=float, default=0.8, help="loaded phase: arrival rate over the idle service rate")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of the endpoint")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of the NVML samples and profile")
    parser.add_argument("--result", default="disco_gpu_premise",
                        help="result name under bench/results, or a .json path")  # fmt: skip
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="disco-gpu-"))
    os.makedirs(args.out, exist_ok=True)
    if args.profile:
        shape, layers, device = args.profile.split(":")
        profile_engine(shape, int(layers), device, Path(args.out) / "gpu_engine_profile.jsonl", workdir)
    results = []
    for spec in args.config:
        label, device, model_name = spec.split(":", 2)
        if model_name == "tiny":
            model = TINY
        elif model_name in SHAPES:
            model = random_checkpoint(model_name, workdir / ("random-" + model_name))
        else:
            model = Path(model_name)
        result = run_config(label, device, model, args, workdir)
        print(json.dumps({k: result[k] for k in ("label", "device", "model", "gpu", "idle", "loaded")}), flush=True)
        if "nvml" in result:
            print(json.dumps({"nvml": result["nvml"]}), flush=True)
            shutil.copy(workdir / f"{label}_nvml.csv", Path(args.out) / f"disco_gpu_{label}_nvml.csv")
        results.append(result)
        path = write(args.result, {"bench": "disco_gpu_premise",  # after each configuration: a cut run keeps the rest
                                   "command": " ".join(["python", "bench/disco_gpu_premise.py", *sys.argv[1:]]),
                                   "configs": results})  # fmt: skip
        print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
