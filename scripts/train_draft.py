#!/usr/bin/env python3
"""Train HAT's draft adapter Lambda for a checkpoint by distillation (HAT Sec. 3.4, Eq. 4).

The LLM stays frozen. For random windows of the corpus, the teacher's features f^L are the last
decoder layer's outputs (what the head reads); the student's are Lambda applied to the outputs of
the first m layers, f^S = Lambda(w_L^m(x)). The loss is SmoothL1(f^L, f^S) + 0.1 x CE(H_L(f^L),
H_L(f^S)), the teacher's softmax being the CE's target. The corpus is the one the tiny model was
trained on (this interpreter's standard library, same held-out files), so every machine has it.

Writes ``<model>/draft/adapter.safetensors``, ``adapter_config.json`` (m, eta and the training's
summary), ``training_log.jsonl`` (one line per logged step) and reports held-out top-1 agreement
between draft and LLM (the share of positions where speculative decoding would accept the draft).

    python scripts/train_draft.py --model examples/models/tiny --device-layers 2
"""

import argparse
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nodes.inference.checkpoint import load_whole
from nodes.inference.draft import DraftAdapter, adapter_dir, distillation_loss, save_adapter
from nodes.inference.tokenizer import Tokenizer
from scripts.train_tiny import learning_rate, read_corpus, windows


def features(model, token_ids, device_layers):
    """(shallow states after layer m-1, last layer's states) for token ids [batch, seq]; no grad."""
    with torch.no_grad():
        x = model.embed(token_ids)
        positions = torch.arange(token_ids.shape[1])
        cos, sin = model.rotary.cos_sin(positions, model.dtype, token_ids.shape[1])
        shallow = x if device_layers == 0 else None
        for index in model.layer_ids:
            x = model.layers[str(index)].forward_full(x, cos, sin)
            if index == device_layers - 1:
                shallow = x
        return shallow, x


def head(model):
    return lambda hidden: model.lm_head(model.norm(hidden))


@torch.no_grad()
def agreement(model, adapter, batches, device_layers):
    """Held-out share of positions where the draft's argmax equals the LLM's, and the mean loss."""
    agree = total = 0
    losses = []
    for batch in batches:
        shallow, deep = features(model, batch, device_layers)
        student = adapter.forward_full(shallow)
        loss, _, _ = distillation_loss(deep, student, head(model))
        losses.append(float(loss))
        agree += int((head(model)(student).argmax(-1) == head(model)(deep).argmax(-1)).sum())
        total += batch.numel()
    return agree / total, sum(losses) / len(losses)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="examples/models/tiny", help="checkpoint directory (the LLM)")
    parser.add_argument("--out", help="adapter directory to write (default: MODEL/draft)")
    parser.add_argument("--device-layers", type=int, default=2, help="m: the LLM layers the device runs")
    parser.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="directory of .py files")
    parser.add_argument("--held-out-every", type=int, default=20, help="one file in N is held out (as train_tiny)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--ce-weight", type=float, default=0.1, help="w_ce of Eq. 4")
    parser.add_argument("--max-minutes", type=float, default=15.0, help="stop early (and say so) after this long")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)

    started = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    out = args.out or adapter_dir(args.model)
    model = load_whole(args.model, dtype="float32")
    for p in model.parameters():
        p.requires_grad_(False)
    tokenizer = Tokenizer(args.model)
    files, train_texts, held_texts, digest = read_corpus(args.corpus, args.held_out_every)

    def stream(texts):
        return torch.tensor([i for text in texts for i in tokenizer.encode(text, bos=False) + [tokenizer.eos_id]])

    train_stream, held_stream = stream(train_texts), stream(held_texts)
    print(f"corpus: {len(files)} files, {len(train_stream)} train / {len(held_stream)} held-out tokens", flush=True)

    adapter = DraftAdapter(model.config, args.device_layers)
    with torch.no_grad():  # start near the identity: a small output projection
        for name, param in adapter.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02 / (4 if name.endswith("o_proj.weight") else 1))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    eval_rng = random.Random(args.seed + 1)
    held_batches = [windows(held_stream, 8, args.seq_len, eval_rng)[:, :-1] for _ in range(4)]
    initial_agreement, initial_loss = agreement(model, adapter, held_batches, args.device_layers)
    print(f"held-out agreement before training: {initial_agreement:.3f}", flush=True)
    os.makedirs(out, exist_ok=True)
    stopped_early, step, smoothed = False, 0, None
    with open(os.path.join(out, "training_log.jsonl"), "w", encoding="utf-8") as log:
        for step in range(args.steps):
            if time.time() - started > args.max_minutes * 60:
                stopped_early = True
                break
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
            batch = windows(train_stream, args.batch, args.seq_len, rng)[:, :-1]
            shallow, deep = features(model, batch, args.device_layers)
            loss, smooth_l1, cross_entropy = distillation_loss(
                deep, adapter.forward_full(shallow), head(model), args.ce_weight
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
            optimizer.step()
            value = float(loss.detach())
            smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
            if step % args.log_every == 0 or step == args.steps - 1:
                record = {
                    "step": step,
                    "loss": round(float(loss), 4),
                    "smooth_l1": round(float(smooth_l1), 4),
                    "cross_entropy": round(float(cross_entropy), 4),
                    "loss_smoothed": round(smoothed, 4),
                    "lr": round(optimizer.param_groups[0]["lr"], 6),
                    "elapsed_s": round(time.time() - started, 1),
                }
                if step % (args.log_every * 10) == 0 or step == args.steps - 1:
                    record["held_out_agreement"] = round(
                        agreement(model, adapter, held_batches[:1], args.device_layers)[0], 4
                    )
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(json.dumps(record), flush=True)
    final_agreement, final_loss = agreement(model, adapter, held_batches, args.device_layers)
    summary = {
        "trained_for": os.path.basename(os.path.abspath(args.model)),
        "eta": 0.6,
        "training": {
            "loss": f"SmoothL1(f_L, f_S) + {args.ce_weight:g} * CE(H(f_L), H(f_S)) (HAT Eq. 4)",
            "corpus_sha256": digest.hexdigest(),
            "train_tokens": len(train_stream),
            "held_out_tokens": len(held_stream),
            "hyperparameters": {k: v for k, v in vars(args).items() if k not in ("model", "out", "corpus")},
            "steps_run": step if stopped_early else step + 1,
            "stopped_early_by_time_guard": stopped_early,
            "held_out_loss": {"before": round(initial_loss, 4), "after": round(final_loss, 4)},
            "held_out_top1_agreement": {"before": round(initial_agreement, 4), "after": round(final_agreement, 4)},
            "seconds": round(time.time() - started, 1),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "torch": torch.__version__,
            "parameters": sum(p.numel() for p in adapter.parameters()),
        },
    }
    save_adapter(adapter, out, summary)
    print(
        json.dumps(
            {
                "held_out_top1_agreement": summary["training"]["held_out_top1_agreement"],
                "perplexity_equivalent": round(math.exp(final_loss), 3),
                "out": out,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
