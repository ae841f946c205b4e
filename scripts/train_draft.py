#!/usr/bin/env python3
"""Train HAT's draft adapter Lambda for a checkpoint by distillation (HAT Sec. 3.4, Eq. 4).

The LLM stays frozen. For random windows of the corpus, the teacher's features f^L are the last
decoder layer's outputs (what the head reads); the student's are Lambda applied to the outputs of
the first m layers, f^S = Lambda(w_L^m(x)). The loss is SmoothL1(f^L, f^S) + w_ce x CE(H_L(f^L),
H_L(f^S)), the teacher's softmax being the CE's target; w_ce = 0.1 as in the paper for a model trained
here. For a pretrained model the defaults are w_ce = 1.0 and the SmoothL1 term taken after the LLM's
final norm (``--state-space normed``): SmolLM2's last-layer states have a few channels hundreds of
times larger than the rest, which dominate a raw SmoothL1 (at 120 steps, held-out agreement 0.09 raw
with w_ce 0.1, 0.19 raw with 1.0, 0.21 normed with 1.0; bench/results/draft_smollm2-135m_loss.json).

Two kinds of training text, both on every machine:
- ``--data corpus`` (the default for a model trained here, such as the tiny one): random windows of the
  corpus it was trained on (this interpreter's standard library, same held-out files).
- ``--data task-generations`` (the default for a pretrained model, such as SmolLM2): the model's own
  greedy answers to SpecBench-like and CNN/DM-like task prompts (:mod:`workloads.task_prompts`) made
  from the reference topics of the ``training`` split, prompt and answer together, as the draft meets
  them when it drafts an answer (self-distillation). A 30-layer teacher forward per step would not fit
  a bounded CPU run, so the teacher's features (the states after layer m-1 and after the last layer)
  are computed once and kept in ``--features`` (reused while its recipe matches); the CE term is taken
  on ``--ce-positions`` sampled positions a step (a 49,152-token head on every position would be most
  of the step). Held out: the answers to prompts of the ``held-out`` topics.

Writes ``<model>/draft/adapter.safetensors`` (or ``--out``), ``adapter_config.json`` (m, eta and the
training's summary), ``training_log.jsonl`` (one line per logged step) and reports held-out top-1
agreement between draft and LLM (the share of positions where speculative decoding would accept the
draft).

    python scripts/train_draft.py --model examples/models/tiny --device-layers 2
    python scripts/train_draft.py --model examples/models/smollm2-135m --out examples/drafts/smollm2-135m-m2
"""

import argparse
import json
import os
import platform
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nodes.inference.checkpoint import load_whole
from nodes.inference.draft import (
    DraftAdapter,
    adapter_dir,
    distillation_loss,
    save_adapter,
    soft_cross_entropy,
    state_loss,
)
from nodes.inference.generate import greedy_generate_batch
from nodes.inference.tokenizer import Tokenizer
from scripts.train_tiny import learning_rate, read_corpus, windows
from testbed.provisioning.weights import file_sha256
from workloads.prompts import draw_prompts
from workloads.task_prompts import prose_corpus


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


def task_sequences(model, model_dir, topics, count, seed, answer_tokens, eos_id, log):
    """Prompt + greedy answer ids (and the prompt's length) for ``count`` task prompts of ``topics``:
    three in four SpecBench-like, one in four CNN/DM-like; answers generated 8 at a time."""
    articles = count // 4
    prompts = [p.prompt_ids for p in draw_prompts("specbench", count=count - articles, seed=seed, model_dir=model_dir,
                                                  max_new_tokens=answer_tokens, topics=topics)]  # fmt: skip
    if articles:
        prompts += [p.prompt_ids for p in draw_prompts("cnndm", count=articles, seed=seed, model_dir=model_dir,
                                                       max_new_tokens=answer_tokens, topics=topics)]  # fmt: skip
    out = []
    for start in range(0, len(prompts), 8):
        group = prompts[start : start + 8]
        for ids, answer in zip(group, greedy_generate_batch(model, group, answer_tokens, eos_id), strict=True):
            out.append((list(ids) + answer, len(ids)))
        log(f"{topics}: answered {len(out)}/{len(prompts)} prompts")
    return out


def sequence_features(model, sequences, device_layers):
    """Per sequence: (shallow states, last layer's states) as float16 [tokens, hidden], and its prompt length."""
    out = []
    for ids, prompt_tokens in sequences:
        shallow, deep = features(model, torch.tensor([ids]), device_layers)
        out.append((shallow[0].half(), deep[0].half(), prompt_tokens))
    return out


def load_or_make_features(path, recipe, make):
    """The features kept at ``path`` if it holds ``recipe``'s, else ``make()``'s (then kept there)."""
    if path and os.path.exists(path):
        kept = torch.load(path, weights_only=True)
        if kept.get("recipe") == json.dumps(recipe, sort_keys=True):
            print(f"features: reusing {path}", flush=True)
            return kept["train"], kept["held_out"]
    train, held_out = make()
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save({"recipe": json.dumps(recipe, sort_keys=True), "train": train, "held_out": held_out}, path + ".tmp")
        os.replace(path + ".tmp", path)
    return train, held_out


def feature_batch(items, token_budget, rng):
    """Whole sequences drawn at random until ``token_budget`` tokens, padded at the end (causal
    attention keeps padding out of the real positions): shallow, deep [batch, longest, hidden] float32
    and the mask of real positions."""
    chosen, tokens = [], 0
    while True:
        item = items[rng.randrange(len(items))]
        if chosen and tokens + len(item[0]) > token_budget:
            break
        chosen.append(item)
        tokens += len(item[0])
    longest = max(len(c[0]) for c in chosen)
    hidden = chosen[0][0].shape[1]
    shallow = torch.zeros(len(chosen), longest, hidden)
    deep = torch.zeros(len(chosen), longest, hidden)
    mask = torch.zeros(len(chosen), longest, dtype=torch.bool)
    for row, (s, d, _) in enumerate(chosen):
        shallow[row, : len(s)] = s.float()
        deep[row, : len(d)] = d.float()
        mask[row, : len(s)] = True
    return shallow, deep, mask


def masked_loss(model, adapter, batch, ce_weight, ce_positions, generator, state_space="raw"):
    """Eq. 4 over the real positions, the CE term on ``ce_positions`` of them drawn at random (0: all).

    ``state_space`` is where the SmoothL1 term compares the states: ``raw`` (the last layer's outputs,
    as Eq. 4 writes it) or ``normed`` (after the LLM's final norm, what the head reads)."""
    shallow, deep, mask = batch
    student = adapter.forward_full(shallow)[mask]
    teacher = deep[mask]
    rows = torch.arange(len(teacher))
    if 0 < ce_positions < len(rows):
        rows = torch.randperm(len(rows), generator=generator)[:ce_positions]
    smooth_l1 = state_loss(teacher, student, model.norm if state_space == "normed" else None)
    cross_entropy = soft_cross_entropy(teacher[rows], student[rows], head(model))
    return smooth_l1 + ce_weight * cross_entropy, smooth_l1, cross_entropy


def top1_same(model, student, teacher):
    """Per position, whether the draft's hidden state and the LLM's give the same argmax token."""
    return head(model)(student).argmax(-1) == head(model)(teacher).argmax(-1)


@torch.no_grad()
def answer_agreement(model, adapter, items):
    """Top-1 agreement of draft and LLM on the answers' positions (where drafting happens), and on all."""
    agree = total = agree_all = total_all = 0
    for shallow, deep, prompt_tokens in items:
        same = top1_same(model, adapter.forward_full(shallow.float()[None])[0], deep.float())
        agree += int(same[prompt_tokens:].sum())
        total += len(same) - prompt_tokens
        agree_all += int(same.sum())
        total_all += len(same)
    return agree / max(1, total), agree_all / max(1, total_all)


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
        agree += int(top1_same(model, student, deep).sum())
        total += batch.numel()
    return agree / total, sum(losses) / len(losses)


class CorpusData:
    """Random windows of the corpus a model trained here was trained on; the teacher runs each step."""

    def __init__(self, model, args, rng):
        self.model, self.args, self.rng = model, args, rng
        tokenizer = Tokenizer(args.model)
        files, train_texts, held_texts, self.digest = read_corpus(args.corpus, args.held_out_every)

        def stream(texts):
            return torch.tensor([i for text in texts for i in tokenizer.encode(text, bos=False) + [tokenizer.eos_id]])

        self.train_stream, held_stream = stream(train_texts), stream(held_texts)
        print(f"corpus: {len(files)} files, {len(self.train_stream)} train / {len(held_stream)} held-out tokens",
              flush=True)  # fmt: skip
        eval_rng = random.Random(args.seed + 1)
        self.held_batches = [windows(held_stream, 8, args.seq_len, eval_rng)[:, :-1] for _ in range(4)]
        self.description = {"corpus_sha256": self.digest.hexdigest(), "train_tokens": len(self.train_stream),
                            "held_out_tokens": len(held_stream)}  # fmt: skip

    def loss(self, adapter):
        batch = windows(self.train_stream, self.args.batch, self.args.seq_len, self.rng)[:, :-1]
        shallow, deep = features(self.model, batch, self.args.device_layers)
        return distillation_loss(deep, adapter.forward_full(shallow), head(self.model), self.args.ce_weight)

    def evaluate(self, adapter, quick=False):
        """{"top1_agreement": ..., "loss": ...} on held-out windows."""
        agree, loss = agreement(self.model, adapter, self.held_batches[:1] if quick else self.held_batches,
                                self.args.device_layers)  # fmt: skip
        return {"top1_agreement": round(agree, 4), "loss": round(loss, 4)}


class TaskGenerationData:
    """The model's answers to task prompts, with the teacher's features computed once."""

    def __init__(self, model, args, rng):
        self.model, self.args, self.rng = model, args, rng
        self.generator = torch.Generator().manual_seed(args.seed)
        tokenizer = Tokenizer(args.model)
        recipe = {"model_sha256": weights_digest(args.model), "device_layers": args.device_layers,
                  "prompts": args.prompts, "held_out_prompts": args.held_out_prompts,
                  "answer_tokens": args.answer_tokens, "seed": args.seed,
                  "prose_sha256": {name: prose_corpus(name).sha256 for name in ("training", "held-out")}}  # fmt: skip

        def make():
            started = time.time()

            def log(line):
                print(f"[{time.time() - started:.0f} s] {line}", flush=True)

            train = task_sequences(model, args.model, "training", args.prompts, args.seed, args.answer_tokens,
                                   tokenizer.eos_id, log)  # fmt: skip
            held = task_sequences(model, args.model, "held-out", args.held_out_prompts, args.seed + 1,
                                  args.answer_tokens, tokenizer.eos_id, log)  # fmt: skip
            log("teacher features")
            m = args.device_layers
            return sequence_features(model, train, m), sequence_features(model, held, m)

        self.train, self.held_out = load_or_make_features(args.features, recipe, make)
        tokens = sum(len(item[0]) for item in self.train)
        answers = sum(len(item[0]) - item[2] for item in self.train)
        print(f"task generations: {len(self.train)} sequences, {tokens} tokens ({answers} answer tokens); "
              f"{len(self.held_out)} held out", flush=True)  # fmt: skip
        held_tokens = sum(len(item[0]) for item in self.held_out)
        held_answers = sum(len(item[0]) - item[2] for item in self.held_out)
        self.description = {"recipe": recipe, "train_tokens": tokens, "train_answer_tokens": answers,
                            "held_out_tokens": held_tokens, "held_out_answer_tokens": held_answers}  # fmt: skip

    def loss(self, adapter):
        batch = feature_batch(self.train, self.args.batch * self.args.seq_len, self.rng)
        return masked_loss(self.model, adapter, batch, self.args.ce_weight, self.args.ce_positions, self.generator,
                           self.args.state_space)  # fmt: skip

    def evaluate(self, adapter, quick=False):
        """Top-1 agreement on the held-out answers' positions (and on all their positions)."""
        items = self.held_out[:4] if quick else self.held_out
        answers, every = answer_agreement(self.model, adapter, items)
        return {"top1_agreement": round(answers, 4), "top1_agreement_all_positions": round(every, 4)}


def weights_digest(model_dir):
    """The checkpoint's identity: the digest of the GGUF it was imported from, else of its weights file."""
    source = os.path.join(model_dir, "source.json")
    if os.path.exists(source):
        with open(source, encoding="utf-8") as handle:
            return json.load(handle)["gguf_sha256"]
    return file_sha256(Path(model_dir) / "model.safetensors")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="examples/models/tiny", help="checkpoint directory (the LLM)")
    parser.add_argument("--out", help="adapter directory to write (default: MODEL/draft)")
    parser.add_argument("--device-layers", type=int, default=2, help="m: the LLM layers the device runs")
    parser.add_argument(
        "--data",
        choices=("corpus", "task-generations"),
        help="training text (default: corpus for a model trained here, else task-generations)",
    )
    parser.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"], help="corpus: directory of .py files")
    parser.add_argument("--held-out-every", type=int, default=20, help="corpus: one file in N is held out")
    parser.add_argument("--prompts", type=int, default=192, help="task-generations: training prompts")
    parser.add_argument("--held-out-prompts", type=int, default=16, help="task-generations: held-out prompts")
    parser.add_argument("--answer-tokens", type=int, default=128, help="task-generations: greedy answer length")
    parser.add_argument("--features", help="task-generations: file keeping the teacher's features between runs")
    parser.add_argument(
        "--ce-positions",
        type=int,
        default=0,
        help="positions a step the CE term is taken on (0: all; task-generations default 256)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=256,
        help="tokens a sequence (task-generations: batch x seq-len is a step's token budget)",
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--ce-weight", type=float, help="w_ce of Eq. 4 (default: 0.1 for corpus, 1.0 for task-generations)"
    )
    parser.add_argument(
        "--state-space",
        choices=("raw", "normed"),
        help="task-generations: compare states in the SmoothL1 term raw (Eq. 4) or after the LLM's final norm"
        " (default: normed)",
    )
    parser.add_argument("--eta", type=float, default=0.6, help="the drafting threshold recorded with the adapter")
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
    data_kind = args.data or ("corpus" if os.path.exists(os.path.join(args.model, "training.json")) else
                              "task-generations")  # fmt: skip
    pretrained = data_kind == "task-generations"
    if pretrained and not args.ce_positions:
        args.ce_positions = 256
    if args.ce_weight is None:
        args.ce_weight = 1.0 if pretrained else 0.1
    if args.state_space is None:
        args.state_space = "normed" if pretrained else "raw"
    if args.state_space == "normed" and not pretrained:
        parser.error("--state-space normed is for --data task-generations")
    data = (CorpusData if data_kind == "corpus" else TaskGenerationData)(model, args, rng)
    prepared_s = time.time() - started

    adapter = DraftAdapter(model.config, args.device_layers)
    with torch.no_grad():  # start near the identity: a small output projection
        for name, param in adapter.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02 / (4 if name.endswith("o_proj.weight") else 1))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    initial = data.evaluate(adapter)
    print(f"held-out before training: {initial}", flush=True)
    os.makedirs(out, exist_ok=True)
    stopped_early, step, smoothed = False, 0, None
    with open(os.path.join(out, "training_log.jsonl"), "w", encoding="utf-8") as log:
        for step in range(args.steps):
            if time.time() - started > args.max_minutes * 60:
                stopped_early = True
                break
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
            loss, smooth_l1, cross_entropy = data.loss(adapter)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
            optimizer.step()
            value = float(loss.detach())
            smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
            if step % args.log_every == 0 or step == args.steps - 1:
                record = {
                    "step": step,
                    "loss": round(value, 4),
                    "smooth_l1": round(float(smooth_l1.detach()), 4),
                    "cross_entropy": round(float(cross_entropy.detach()), 4),
                    "loss_smoothed": round(smoothed, 4),
                    "lr": round(optimizer.param_groups[0]["lr"], 6),
                    "elapsed_s": round(time.time() - started, 1),
                }
                if step % (args.log_every * 10) == 0 or step == args.steps - 1:
                    record["held_out"] = data.evaluate(adapter, quick=True)
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(json.dumps(record), flush=True)
    final = data.evaluate(adapter)
    summary = {
        "trained_for": os.path.basename(os.path.abspath(args.model)),
        "eta": args.eta,
        "training": {
            "loss": ("SmoothL1(norm(f_L), norm(f_S))" if args.state_space == "normed" else "SmoothL1(f_L, f_S)")
            + f" + {args.ce_weight:g} * CE(H(f_L), H(f_S)) (HAT Eq. 4)",
            "data": data_kind,
            **data.description,
            "hyperparameters": {k: v for k, v in vars(args).items() if k not in ("model", "out", "corpus", "features")},
            "steps_run": step if stopped_early else step + 1,
            "stopped_early_by_time_guard": stopped_early,
            "held_out": {"before": initial, "after": final},
            "seconds": round(time.time() - started, 1),
            "seconds_preparing_data": round(prepared_s, 1),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "torch": torch.__version__,
            "parameters": sum(p.numel() for p in adapter.parameters()),
        },
    }
    save_adapter(adapter, out, summary)
    print(json.dumps({"held_out": summary["training"]["held_out"], "out": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
