"""SmolLM2-135M as we import it against transformers loading the same GGUF (issue 40's parity target):
greedy tokens identical for 20 prompts x 64 tokens (EOS not honoured, so every prompt runs 64 steps),
float32 logits within 1e-3 over every position of prompt + generation, and our tokenizer's ids equal
transformers' on the prompts and a text set (numbers, code, whitespace, non-Latin scripts, emoji,
special tokens).

Needs the packaged model (make models). Writes bench/results/smollm2_parity.json.

    .venv/bin/python bench/smollm2_parity.py [--tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write
from nodes.inference.checkpoint import load_whole
from nodes.inference.generate import greedy_generate
from nodes.inference.model import Segment
from nodes.inference.tokenizer import Tokenizer
from testbed.models.packaged import PACKAGED, cache_dir

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "import numpy as np\n\ndef softmax(x):",
    "Photosynthesis is the process by which",
    "Q: What is 17 times 23?\nA:",
    "The French Revolution began in",
    "SELECT name, COUNT(*) FROM orders",
    "A haiku about autumn:\n",
    "To make a cup of tea, first",
    "The main difference between TCP and UDP is",
    "<|im_start|>user\nWrite a short poem about the moon.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain recursion to a child.<|im_end|>\n<|im_start|>assistant\n",
    "In machine learning, overfitting means",
    "The Great Wall of China",
    "#include <stdio.h>\n\nint main(void) {",
    "Water boils at 100 degrees Celsius because",
    "Dear hiring manager,\n\nI am writing to apply for",
    "The mitochondria is",
]
TEXTS = [
    "In 2024, 1,234,567 people paid $3.50 each (a 12.5% rise).",
    "naïve café — 東京タワー, Москва, القاهرة 🙂👍🏽",
    "    indented\n\n\ttabs  and   runs   of spaces\r\nwindows line",
    "x = {'a': [1, 2, 3]}; print(f\"{x['a'][0]:>08.3f}\")",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|endoftext|>",
    "I'm sure they'll say it's theirs, won't they? We'd've known.",
]


def greedy_reference(model, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy decoding, one token at a time through its cache, EOS not honoured."""
    from transformers import DynamicCache

    cache, out = DynamicCache(), []
    logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
    for _ in range(steps):
        token = int(torch.argmax(logits[0, -1]))
        out.append(token)
        logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="smollm2_parity")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renaming past_key_values
    model = PACKAGED["smollm2-135m"]
    gguf = cache_dir() / Path(model.member).name
    started = time.monotonic()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    their_tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    load_reference_s = time.monotonic() - started
    started = time.monotonic()
    ours = load_whole(str(model.directory), dtype="float32")
    tokenizer = Tokenizer(str(model.directory))
    load_ours_s = time.monotonic() - started
    ids_equal = {text: tokenizer.encode(text, bos=False) == their_tokenizer(text, add_special_tokens=False)["input_ids"]
                 for text in PROMPTS + TEXTS}  # fmt: skip
    rows = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt, bos=False)
            mine = greedy_generate(ours, ids, args.tokens)
            theirs = greedy_reference(reference, ids, args.tokens)
            sequence = ids + mine
            their_logits = reference(torch.tensor([sequence])).logits[0]
            hidden = ours.run_layers(ours.embed(torch.tensor(sequence)), [Segment(ours.new_cache(len(sequence)),
                                                                                   len(sequence))])  # fmt: skip
            difference = float((ours.logits(hidden) - their_logits).abs().max())
            first_differing = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), None)
            rows.append({"prompt": prompt, "prompt_tokens": len(ids), "tokens": len(mine), "identical": mine == theirs,
                         "first_differing_token": first_differing, "max_abs_logit_difference": difference,
                         "text": tokenizer.decode(mine)})  # fmt: skip
            print(f"{'same' if mine == theirs else 'DIFFERENT':9} {difference:.2e}  {prompt[:40]!r}", flush=True)
    worst = max(r["max_abs_logit_difference"] for r in rows)
    result = {
        "model": model.name, "wheel_sha256": model.sha256, "threads": args.threads, "dtype": "float32",
        "prompts": len(rows), "tokens_per_prompt": args.tokens,
        "greedy_identical": sum(r["identical"] for r in rows), "max_abs_logit_difference": worst,
        "targets": {"greedy_identical": f"{len(rows)} of {len(rows)}", "max_abs_logit_difference": 1e-3},
        "met": all(r["identical"] for r in rows) and worst < 1e-3 and all(ids_equal.values()),
        "tokenizer_ids_equal": sum(ids_equal.values()), "tokenizer_texts": len(ids_equal),
        "tokenizer_differing": [t for t, same in ids_equal.items() if not same],
        "load_s": {"transformers_from_gguf": round(load_reference_s, 2), "ours_from_import": round(load_ours_s, 2)},
        "rows": rows,
    }  # fmt: skip
    print(f"greedy identical {result['greedy_identical']}/{len(rows)}, worst logit difference {worst:.2e}, "
          f"tokenizer ids equal {result['tokenizer_ids_equal']}/{len(ids_equal)}")  # fmt: skip
    print(write(args.out, result))


if __name__ == "__main__":
    main()
