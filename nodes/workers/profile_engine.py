"""``python -m nodes.workers.profile_engine``: time the engine's steps on this node over a grid, for
``testbed profile`` to fit a compute profile to.

For each count of decoder layers, a model part of the checkpoint's first layers (with its embedding
and LM head) runs:

- prompt steps: one sequence of n new tokens on an empty cache, for each n of ``--prefill``;
- decode steps: B sequences of one new token, each after a context of c tokens (random keys and
  values, not computed), for each B of ``--batch`` and c of ``--context``;
- LM head steps on ``--head`` rows.

Each point is run once to warm up, then ``--reps`` times; the median is reported. With ``--target``
and ``--rates`` (a target model's shape and a compute profile's mode, as a run config carries them)
every step is paced as a run paces it, so what is measured is the emulation (``testbed profile``'s
self-check); repetitions that overran (the real computation took longer than its target, or the
rank woke late from its wait) measure this machine, so they are run again (a bounded number of
times), and the point says how many overran (``overruns``) and how many were clean (``clean_reps``).
A paced point gives the fastest of its clean repetitions, not their median: a paced step never ends
before its due time (less one sleep's advance, at most 0.25 ms), and a clean one may still end up to
``late_tolerance_s`` after it (0.5 ms: a fifth of a 2.5 ms step), so the machine's load can only
lengthen a repetition, and the fastest one measures the pacing.

Prints one JSON object per line, then ``{"done": true, ...}``.
"""

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from nodes.contracts.compute_profile import rates_from_json
from nodes.contracts.target_model import from_json as target_from_json
from nodes.inference.checkpoint import load_part
from nodes.inference.config import LlamaConfig
from nodes.inference.model import Segment

from .pacing import PacedPart, Pacer


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.split(",") if v.strip()]


RETRIES_PER_REP = 3  # a paced point runs again this many times per repetition that overran, at most


def _measure(prepare: Callable[[], Any], step: Callable[[Any], Any], reps: int, sync: Callable[[], None],
             violated: Callable[[], int], paced: bool) -> Tuple[float, int, int]:  # fmt: skip
    """Seconds of ``step(prepare())`` over ``reps`` clean runs after one to warm up (``prepare``
    untimed: fresh caches every run), and how many runs ``violated`` (a paced step that overran: it
    measured a hiccup of this machine, not the profile). A run that overran is run again, at most
    :data:`RETRIES_PER_REP` times for each repetition, so that a moment of load on the machine does not
    take a point out of the fit. The median of the clean runs, or their minimum when ``paced`` (load
    only lengthens a paced step); of the late ones only if none was clean.
    Returns (seconds, clean runs, runs that overran)."""
    clean, late = [], []  # type: List[float], List[float]
    runs = 0
    while len(clean) < reps and runs <= reps * (1 + RETRIES_PER_REP):
        inputs = prepare()
        sync()
        before = violated()
        started = time.monotonic()
        step(inputs)
        sync()
        if runs:  # the first run warms up
            (late if violated() > before else clean).append(time.monotonic() - started)
        runs += 1
    kept = clean or late
    return (min(kept) if paced else statistics.median(kept)), len(clean), len(late)


class _Profiler:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.config = LlamaConfig.load(args.model)
        self.pacer: Optional[Pacer] = None
        if args.target:
            rates = rates_from_json(json.loads(args.rates))
            self.pacer = Pacer(rates, target_from_json(json.loads(args.target)), args.dilation)
        # on a GPU, random contexts are drawn there: a CPU draw of 64 sequences' keys and values for
        # every layer would take longer than the whole grid's steps
        self.generator = torch.Generator(device=args.device if args.device.startswith("cuda") else "cpu")
        self.generator.manual_seed(1)
        self.points = 0

    def sync(self) -> None:
        if self.args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def emit(self, row: Dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()

    def point(self, op: str, layers: int, tokens: int, sequences: int, context: int, prepare: Callable[[], Any],
              step: Callable[[Any], Any]) -> None:  # fmt: skip
        pacer = self.pacer
        if pacer is not None:  # each timed step on its own, not chained to the one before its setup
            prepared = prepare

            def prepare() -> Any:
                inputs = prepared()
                pacer.unchain()
                return inputs

        violated = (lambda: pacer.overruns) if pacer is not None else (lambda: 0)
        seconds, clean, overruns = _measure(prepare, step, self.args.reps, self.sync, violated, pacer is not None)
        self.emit({"op": op, "layers": layers, "tokens": tokens, "sequences": sequences, "context_tokens": context,
                   "seconds": seconds, "overruns": overruns if pacer is not None else None,
                   "clean_reps": clean if pacer is not None else None})  # fmt: skip
        self.points += 1

    def part(self, layers: int, with_head: bool) -> None:
        """Every point of the grid on a part of the checkpoint's first ``layers`` layers."""
        args = self.args
        loaded = load_part(args.model, range(layers), embedding=True, head=True, dtype=args.dtype, device=args.device)
        part: Any = loaded if self.pacer is None else PacedPart(loaded, self.pacer, layers, "profile")
        width, dtype = self.config.hidden_size, loaded.dtype

        def states(rows: int) -> Any:
            drawn = torch.randn(rows, width, generator=self.generator, device=self.generator.device)
            return drawn.to(device=args.device, dtype=dtype)

        for new, sequences, context in [(n, 1, 0) for n in _ints(args.prefill)] + [
                (1, b, c) for b in _ints(args.batch) for c in _ints(args.context)]:  # fmt: skip

            def prepare(new: int = new, sequences: int = sequences, context: int = context) -> Any:
                caches = [loaded.new_cache(context + new + 1) for _ in range(sequences)]
                for cache in caches:
                    if context:
                        cache.fill_random(context, self.generator)
                return states(new * sequences), [Segment(c, new) for c in caches]

            def step(inputs: Any) -> None:
                with torch.inference_mode():
                    part.run_layers(*inputs)

            self.point("layers", layers, new, sequences, context, prepare, step)
        if with_head:
            for rows in _ints(args.head):

                def head(hidden: Any) -> None:
                    with torch.inference_mode():
                        part.logits(hidden)

                self.point("head", 0, rows, 1, 0, lambda rows=rows: states(rows), head)


def profile(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    profiler = _Profiler(args)
    counts = [n for n in _ints(args.layers) if n <= profiler.config.num_hidden_layers]
    for layers in counts:
        profiler.part(layers, with_head=layers == max(counts))
    config = profiler.config
    profiler.emit({
        "done": True, "points": profiler.points, "paced": profiler.pacer is not None, "device": args.device,
        "torch": torch.__version__, "dtype": args.dtype, "model_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size, "config": config.to_hf_dict(),
        "cuda_device": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
    })  # fmt: skip
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.workers.profile_engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", required=True, help="checkpoint directory (Hugging Face format)")
    parser.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto (the checkpoint's)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--layers", default="1,2,4", help="decoder layer counts")
    parser.add_argument("--prefill", default="1,16,128,512", help="new tokens of the prompt steps")
    parser.add_argument("--batch", default="1,8,32", help="sequences of the decode steps")
    parser.add_argument("--context", default="0,512,2048", help="context tokens of the decode steps")
    parser.add_argument("--head", default="1,8,64", help="rows of the LM head steps")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per point (median; paced: fastest)")
    parser.add_argument("--target", help="target model shape (JSON): pace every step")
    parser.add_argument("--rates", help="with --target: the compute profile mode (JSON) to pace with")
    parser.add_argument("--dilation", type=float, default=1.0, help="with --target: the dilation")
    args = parser.parse_args(argv)
    if bool(args.target) != bool(args.rates):
        parser.error("--target and --rates go together")
    return profile(args)


if __name__ == "__main__":
    sys.exit(main())
