"""HAT's draft model on the tiny checkpoint, in one process: acceptance and drafting cost against eta.

For SpecBench-length prompts drawn as the Table 5 campaign draws them (``specbench``, seed 5), every
prompt is generated with speculative decoding (``nodes.inference.speculative``, the LLM's middle
layers verifying in-process) at several drafting thresholds eta (Eq. 5), and checked to equal
greedy generation. Reported per eta: acceptance length (vLLM's: 1 + accepted / rounds), draft
tokens per round, accepted share of drafted tokens, and rounds per output token. Timed on
``--threads`` threads (one by default): one draft step (m layers + adapter + head + softmax) and
one plain decode step of the device's share (m layers + head), whose ratio is what speculative
decoding has to earn back.

``--adapter DIR`` measures another adapter (one trained longer, say) on the same prompts, beside the
checkpoint's own: ``by_eta`` is the checkpoint's, ``other_adapter`` the other's with its held-out
top-1 agreement.

``--model`` measures another checkpoint with ``--draft`` (its adapter, default MODEL/draft); for a
pretrained model the prompts are tasks over the reference topics its adapter was not trained on
(``topics="held-out"``, :func:`workloads.task_prompts.held_out_topic`).

    python bench/draft.py
    python bench/draft.py --adapter /tmp/draft-long --prompts 16
    python bench/draft.py --model examples/models/smollm2-135m --draft examples/drafts/smollm2-135m-m2

Writes bench/results/draft.json (the tiny model) or bench/results/draft_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.metrics import acceptance_length
from bench._common import summary, write
from nodes.inference.checkpoint import load_part, load_whole
from nodes.inference.config import LlamaConfig
from nodes.inference.draft import DraftAdapter, adapter_dir, load_adapter
from nodes.inference.generate import greedy_generate
from nodes.inference.model import ModelPart, Segment
from nodes.inference.speculative import LocalVerifier, SpeculativeDevice, speculative_generate
from workloads.prompts import draw_prompts

MODEL = Path(__file__).resolve().parent.parent / "examples" / "models" / "tiny"
M, PROMPTS, MAX_NEW_TOKENS, ETAS = 2, 8, 48, (0.2, 0.4, 0.6, 0.8)


def step_times_s(device: ModelPart, adapter: DraftAdapter, repeats: int = 200) -> dict[str, list[float]]:
    """One draft step and one plain device step after a 300-token context, each timed ``repeats`` times."""
    speculative = SpeculativeDevice(device, adapter, 0.0)
    state = speculative.new_state(400 + repeats)
    cache = device.new_cache(400 + repeats)
    out: dict[str, list[float]] = {"draft_step_s": [], "plain_step_s": []}
    with torch.inference_mode():
        speculative.shallow(state, list(range(5, 305)))
        speculative.absorb(state)
        device.run_layers(device.embed(torch.arange(5, 305)), [Segment(cache, 300)])
        for _ in range(repeats):
            t = time.perf_counter()
            speculative.shallow(state, [7])
            deep = speculative.absorb(state)
            torch.max(torch.softmax(device.logits(deep).float(), dim=-1), dim=-1)
            out["draft_step_s"].append(time.perf_counter() - t)
            t = time.perf_counter()
            hidden = device.run_layers(device.embed(torch.tensor([7])), [Segment(cache, 1)])
            torch.argmax(device.logits(hidden[-1]))
            out["plain_step_s"].append(time.perf_counter() - t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter", help="another adapter directory to measure beside the checkpoint's own")
    parser.add_argument("--prompts", type=int, default=PROMPTS, help="SpecBench-length prompts (seed 5)")
    parser.add_argument("--model", default=str(MODEL), help="checkpoint directory (default: the tiny model)")
    parser.add_argument("--draft", help="the checkpoint's draft adapter (default: MODEL/draft)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for generation and the step times")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = str(Path(args.model))
    config = LlamaConfig.load(model)
    whole = load_whole(model, dtype="float32")
    device = load_part(model, range(M), embedding=True, head=True, dtype="float32")
    middle = load_part(model, range(M, config.num_hidden_layers), dtype="float32")
    adapter = load_adapter(args.draft or adapter_dir(model), config, M, torch.float32)
    prompts = [p.prompt_ids for p in draw_prompts("specbench", count=args.prompts, seed=5, model_dir=model,
                                                  max_new_tokens=MAX_NEW_TOKENS, topics="held-out")]  # fmt: skip
    references = [greedy_generate(whole, ids, MAX_NEW_TOKENS, config.eos_token_id) for ids in prompts]
    by_eta = against_eta(device, middle, adapter, prompts, references, config.eos_token_id)
    other = None
    if args.adapter:
        trained = json.loads((Path(args.adapter) / "adapter_config.json").read_text()).get("training", {})
        print(f"other adapter {args.adapter}:", flush=True)
        other = {"directory": args.adapter, "steps_run": trained.get("steps_run"),
                 "held_out": trained.get("held_out") or trained.get("held_out_top1_agreement"),
                 "by_eta": against_eta(device, middle, load_adapter(args.adapter, config, M, torch.float32), prompts,
                                       references, config.eos_token_id)}  # fmt: skip
    times = step_times_s(device, adapter)
    steps = {name: summary(values) for name, values in times.items()}
    ratio = steps["draft_step_s"]["median"] / steps["plain_step_s"]["median"]
    print(f"{args.threads} thread(s): draft step {steps['draft_step_s']['median'] * 1e3:.2f} ms, plain device step "
          f"{steps['plain_step_s']['median'] * 1e3:.2f} ms (ratio {ratio:.2f})")  # fmt: skip
    results = "draft" if Path(model).resolve() == MODEL else f"draft_{Path(model).resolve().name}"
    trained = json.loads((Path(args.draft or adapter_dir(model)) / "adapter_config.json").read_text())["training"]
    path = write(results, {"command": " ".join(["python", "bench/draft.py", *sys.argv[1:]]), "model": model,
                        "adapter": args.draft or adapter_dir(model), "adapter_held_out": trained.get("held_out"),
                        "device_layers": M, "prompts": args.prompts, "prompt_set": "specbench",
                        "topics": "held-out", "threads": args.threads,
                        "max_new_tokens": MAX_NEW_TOKENS, "by_eta": by_eta, "other_adapter": other,
                        "steps": steps, "draft_over_plain_step": round(ratio, 3)})  # fmt: skip
    print(f"wrote {path}")


def against_eta(device: ModelPart, middle: ModelPart, adapter: DraftAdapter, prompts: list, references: list,
                eos_id: int) -> dict[str, dict]:  # fmt: skip
    """Per eta: acceptance length, draft tokens per round, accepted share, rounds per token (outputs
    checked equal to greedy generation)."""
    by_eta = {}
    for eta in ETAS:
        speculative = SpeculativeDevice(device, adapter, eta)
        rounds, tokens = [], 0
        for ids, reference in zip(prompts, references, strict=True):
            verifier = LocalVerifier(middle, len(ids) + MAX_NEW_TOKENS + 16)
            out, logs = speculative_generate(speculative, verifier, ids, MAX_NEW_TOKENS, eos_id)
            if out != reference:
                raise SystemExit(f"eta {eta}: speculative output differs from greedy generation")
            rounds += logs
            tokens += len(out) - 1
        drafted = sum(r.drafted for r in rounds)
        by_eta[str(eta)] = {
            "acceptance_length": round(acceptance_length([r.accepted for r in rounds]), 3),
            "draft_tokens_per_round": round(drafted / len(rounds), 3),
            "accepted_share_of_drafted": round(sum(r.accepted for r in rounds) / drafted, 3) if drafted else None,
            "rounds_per_decode_token": round(len(rounds) / tokens, 3),
        }
        print(f"eta {eta}: {by_eta[str(eta)]}", flush=True)
    return by_eta


if __name__ == "__main__":
    main()
