#!/usr/bin/env python3
"""Train the embedded default's tiny Llama and its BPE tokenizer on the Python standard library.

Every machine with Python has the corpus: the ``.py`` files of this interpreter's standard library
(tests excluded). Files are split into training and held-out sets by a hash of their path; the
tokenizer (byte-level BPE) is trained on the training files only. The model is the engine's own
``ModelPart`` (the same code the workers run), trained with AdamW on random windows under bf16
autocast on the CPU, for a fixed number of steps (a wall-clock guard stops it early and says so).

Writes a Hugging Face format checkpoint (config.json, model.safetensors in bf16, tokenizer.json,
tokenizer_config.json), ``training_log.jsonl`` (one line per logged step) and ``training.json``
(corpus, hyper-parameters, final and held-out loss, perplexity against a unigram baseline, greedy
samples, machine and versions).

    python scripts/train_tiny.py --out examples/models/tiny
"""

import argparse
import hashlib
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

from nodes.inference.checkpoint import save_checkpoint
from nodes.inference.config import LlamaConfig
from nodes.inference.generate import greedy_generate
from nodes.inference.model import ModelPart, count_parameters
from workloads.corpus import corpus_files, is_held_out

BOS, EOS = "<s>", "</s>"
SAMPLE_PROMPTS = ["def __init__(self", "import os\nimport sys\n\n", "    for i in range(", "class Error(Exception):"]


def read_text(path):
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def read_corpus(root, held_out_every):
    """(files, training texts, held-out texts, sha256 of every file's path and text) of a corpus."""
    files = corpus_files(root)
    train_texts, held_texts, digest = [], [], hashlib.sha256()
    for path in files:
        relative = os.path.relpath(path, root)
        text = read_text(path)
        digest.update(relative.encode() + b"\0" + text.encode("utf-8", "replace"))
        (held_texts if is_held_out(relative, held_out_every) else train_texts).append(text)
    return files, train_texts, held_texts, digest


def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_stream(tokenizer, texts):
    eos = tokenizer.token_to_id(EOS)
    ids = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream, count, length, rng):
    starts = [rng.randrange(0, len(stream) - length - 1) for _ in range(count)]
    return torch.stack([stream[s : s + length + 1] for s in starts])


def learning_rate(step, steps, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, batches):
    losses = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model.forward_full(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        losses.append(float(loss))
    return sum(losses) / len(losses)


def unigram_cross_entropy(train_stream, held_out_stream, vocab_size):
    counts = torch.bincount(train_stream, minlength=vocab_size).double() + 1.0
    log_p = torch.log(counts / counts.sum())
    return float(-log_p[held_out_stream].mean())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="examples/models/tiny", help="checkpoint directory to write")
    parser.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="directory of .py files")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=704)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--max-minutes", type=float, default=18.0, help="stop early (and say so) after this long")
    parser.add_argument("--held-out-every", type=int, default=20, help="one file in N is held out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)

    started = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    os.makedirs(args.out, exist_ok=True)

    files, train_texts, held_texts, digest = read_corpus(args.corpus, args.held_out_every)
    print(f"corpus: {len(files)} files ({len(held_texts)} held out) from {args.corpus}", flush=True)

    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    tokenizer.save(os.path.join(args.out, "tokenizer.json"))
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump(
            {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "model_max_length": 4096}, handle, indent=2
        )
        handle.write("\n")
    train_stream, held_stream = token_stream(tokenizer, train_texts), token_stream(tokenizer, held_texts)
    tokenizer_s = time.time() - started
    print(
        f"tokens: {len(train_stream)} train, {len(held_stream)} held out (tokenizer {tokenizer_s:.0f} s)",
        flush=True,
    )

    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
    )
    model = ModelPart.whole(config)
    with torch.no_grad():  # GPT-2 style init: small normal weights, residual projections scaled by depth
        for name, param in model.named_parameters():
            if param.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * args.layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                )
                param.normal_(0.0, std)
    params = count_parameters(model)
    print(f"model: {params} parameters", flush=True)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    eval_rng = random.Random(args.seed + 1)
    held_batches = [windows(held_stream, 8, args.seq_len, eval_rng) for _ in range(8)]
    log_path = os.path.join(args.out, "training_log.jsonl")
    train_started, stopped_early, step, smoothed = time.time(), False, 0, None
    with open(log_path, "w", encoding="utf-8") as log:
        for step in range(args.steps):
            if time.time() - started > args.max_minutes * 60:
                stopped_early = True
                break
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
            batch = windows(train_stream, args.batch, args.seq_len, rng)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model.forward_full(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            loss_value = loss.item()
            smoothed = loss_value if smoothed is None else 0.95 * smoothed + 0.05 * loss_value
            if step % args.log_every == 0 or step == args.steps - 1:
                record = {
                    "step": step,
                    "loss": round(loss_value, 4),
                    "loss_smoothed": round(smoothed, 4),
                    "lr": round(optimizer.param_groups[0]["lr"], 6),
                    "elapsed_s": round(time.time() - started, 1),
                }
                if step % (args.log_every * 10) == 0 or step == args.steps - 1:
                    record["held_out_loss"] = round(evaluate(model, held_batches[:2]), 4)
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(json.dumps(record), flush=True)
    train_s = time.time() - train_started

    held_out_loss = evaluate(model, held_batches)
    unigram = unigram_cross_entropy(train_stream, held_stream, config.vocab_size)
    save_checkpoint(model, args.out, dtype="bfloat16")
    from nodes.inference.checkpoint import load_whole
    from nodes.inference.tokenizer import Tokenizer

    saved = load_whole(args.out, dtype="float32")  # what users get: the bf16 checkpoint, run in fp32
    saved_loss = evaluate(saved, held_batches)
    tok = Tokenizer(args.out)
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        samples[prompt] = tok.decode(greedy_generate(saved, tok.encode(prompt), 40, eos_id=tok.eos_id))
    summary = {
        "corpus": {
            "root": args.corpus,
            "python": platform.python_version(),
            "files": len(files),
            "held_out_files": len(held_texts),
            "sha256": digest.hexdigest(),
            "train_tokens": len(train_stream),
            "held_out_tokens": len(held_stream),
        },
        "model": config.to_hf_dict(),
        "parameters": params,
        "hyperparameters": {k: v for k, v in vars(args).items() if k not in ("out", "corpus")},
        "steps_run": step + 1 if not stopped_early else step,
        "stopped_early_by_time_guard": stopped_early,
        "tokens_seen": (step + (0 if stopped_early else 1)) * args.batch * args.seq_len,
        "final_train_loss_smoothed": round(smoothed, 4),
        "held_out_loss": round(held_out_loss, 4),
        "held_out_perplexity": round(math.exp(held_out_loss), 2),
        "held_out_loss_bf16_checkpoint_fp32": round(saved_loss, 4),
        "unigram_held_out_perplexity": round(math.exp(unigram), 2),
        "greedy_samples": samples,
        "seconds": {
            "tokenizer_and_data": round(tokenizer_s, 1),
            "training": round(train_s, 1),
            "total": round(time.time() - started, 1),
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        "torch": torch.__version__,
    }
    with open(os.path.join(args.out, "training.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
        handle.write("\n")
    print(json.dumps({k: summary[k] for k in ("held_out_perplexity", "unigram_held_out_perplexity", "seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
