"""The LLM service daemon: ``python -m nodes.context_service --model DIR --socket PATH --state-dir DIR``.

It owns the model and the context memory and answers apps on a Unix socket (``protocol.py``), one
thread per connection, one call at a time. Its chunks go to ``STATE_DIR/chunks`` (paced to
``--disk`` on an emulated device), its contexts to ``STATE_DIR/contexts``. ``--memory`` picks LLMS or
one of its baselines and ablations (``context_memory.baseline_settings``); the ``--no-*`` flags change
one technique on top. ``--recompute-pace`` makes recompute take a target device's T_re (modeled).
Once it accepts it writes one JSON line on stdout; SIGTERM stops it after the call in flight, and
``--max-seconds`` bounds its life (a daemon whose controller died ends by itself).

    python -m nodes.context_service --model examples/models/tiny --socket /tmp/llm.sock --state-dir /tmp/llm
"""

import argparse
import contextlib
import json
import os
import signal
import socketserver
import sys
import threading
from typing import Any, Dict, List, Optional

import torch

from nodes.contracts.durable import write_json_atomic
from nodes.contracts.service_files import socket_problem
from nodes.inference.checkpoint import load_whole
from nodes.inference.tokenizer import Tokenizer

from .chunk_store import ChunkStore, DiskProfile
from .context_memory import BASELINES, ContextLimit, ContextMemory, baseline_settings
from .install_profile import install_profile
from .load_plan import LinearCost
from .protocol import MAX_REQUEST_BYTES, encode, error
from .service import ALIASES, CallResult, Limits, LlmService, ServiceError


class _Handler(socketserver.StreamRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        line = self.rfile.readline(MAX_REQUEST_BYTES)
        try:
            request = json.loads(line.decode() or "null")
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
        except ValueError as exc:
            self._send(error("bad_request", "not a JSON request line: %s" % exc))
            return
        op = ALIASES.get(request.get("op"), request.get("op"))
        service = self.server.service
        try:
            if op == "new":
                self._send({"ok": True, "ctx": service.new_context(request.get("app"), request.get("system_prompt"))})
            elif op == "call":
                self._call(service, request)
            elif op == "delete":
                service.delete(request.get("ctx"))
                self._send({"ok": True})
            elif op == "list":
                self._send({"ok": True, "contexts": service.contexts()})
            elif op == "stats":
                memory = service.memory
                self._send({"ok": True, "memory_method": self.server.memory_method,
                            "settings": memory.settings._asdict(), "resident_bytes": memory.resident_bytes,
                            "budget_bytes": memory.settings.budget_bytes, "faults": memory.faults,
                            "recompute_overruns": memory.recompute_overruns,
                            "aot_bytes_written": memory.aot_bytes_written, "store": memory.store.stats.as_dict(),
                            "store_modeled": memory.store.modeled, "contexts": len(memory.contexts)})  # fmt: skip
            else:
                self._send(error("bad_request", "unknown op %r: new, call, delete, list or stats" % (op,), "op"))
        except ServiceError as exc:
            self._send(error(exc.code, exc.message, exc.field))
        except ContextLimit as exc:
            self._send(error("memory", str(exc), "ctx"))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left; a call in flight was rolled back
        except Exception as exc:  # a fault of ours: the app hears of it, the daemon serves on
            with contextlib.suppress(OSError):
                self._send(error("internal", "%s: %s" % (type(exc).__name__, exc)))
            raise

    def _call(self, service: LlmService, request: Dict[str, Any]) -> None:
        max_tokens = request.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ServiceError("bad_request", "max_tokens must be a non-negative integer", "max_tokens")
        results: List[CallResult] = []
        stream = service.call(request.get("ctx"), request.get("prompt") or "", max_tokens,
                              request.get("teacher_forced"), results, request.get("prompt_ids"),
                              request.get("teacher_forced_ids"))  # fmt: skip
        out: List[int] = []
        try:
            for token in stream:
                text = service.tokenizer.piece(out, token)
                out.append(token)
                if not (request.get("teacher_forced") or request.get("teacher_forced_ids")):
                    self._send({"token_id": token, "text": text})
        finally:
            stream.close()  # a client gone mid-stream: the call rolls back
        result = results[0]
        self._send({"ok": True, "done": True, "output_ids": result.output_ids, "prompt_tokens": result.prompt_tokens,
                    "context_tokens": result.context_tokens, "prefill_s": result.prefill_s,
                    "decode_s": result.decode_s, "switch": result.switch._asdict()})  # fmt: skip

    def _send(self, message: Dict[str, Any]) -> None:
        self.wfile.write(encode(message))
        self.wfile.flush()


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, service: LlmService, memory_method: str = "llms") -> None:
        self.service, self.memory_method = service, memory_method
        super().__init__(path, _Handler)


def profile_json(profile: Dict[str, Any]) -> Dict[str, Any]:
    """The install profile as its file holds it, with the read:recompute ratio of one INT8 chunk."""
    read, recompute = profile["read"], profile["recompute"]
    one_chunk_bytes = profile["read_points"][0][0]
    return {"t_re_s_per_chunk": recompute.per_unit_s, "t_re_fixed_s": recompute.fixed_s,
            "t_io_s_per_byte": read.per_unit_s, "t_io_fixed_s": read.fixed_s,
            "read_to_recompute_ratio": read.seconds(one_chunk_bytes) / max(1e-12, recompute.seconds(1)),
            "recompute_points": profile["recompute_points"], "read_points": profile["read_points"],
            "read_modeled": profile["read_modeled"]}  # fmt: skip


def _costs(text: Optional[str], default: LinearCost) -> LinearCost:
    if not text:
        return default
    per_unit, fixed = (float(v) for v in text.split(","))
    return LinearCost(per_unit, fixed)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.context_service", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", required=True, help="checkpoint directory (config.json, weights, tokenizer.json)")
    parser.add_argument("--socket", required=True, help="the Unix socket apps connect to")
    parser.add_argument("--state-dir", required=True, help="where contexts and chunks persist")
    parser.add_argument("--memory", choices=BASELINES, default="llms",
                        help="LLMS, a baseline (lmk, swapping, vllm-s, vllm-sq) or an ablation (default %(default)s)")
    parser.add_argument("--budget-mib", type=float, default=16.0, help="memory for contexts' chunks (MiB)")
    parser.add_argument("--chunk-tokens", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=0.5, help="global compression ratio over INT8 (1: none)")
    parser.add_argument("--disk", help="read_mbps,write_mbps,io_latency_ms: pace the chunk store (emulated)")
    parser.add_argument("--recompute-cost", help="seconds a chunk,fixed seconds (T_re; default: fitted at start)")
    parser.add_argument("--read-cost", help="seconds a byte,fixed seconds (T_IO; default: fitted at start)")
    parser.add_argument("--recompute-pace", help="seconds a chunk,fixed seconds: recompute takes a target's T_re")
    parser.add_argument("--no-compression", action="store_true", help="every chunk INT8")
    parser.add_argument("--no-pipeline", action="store_true", help="read every missing chunk, recompute none")
    parser.add_argument("--no-aot", action="store_true", help="write chunks at reclaim, not when a call returns")
    parser.add_argument("--eviction", choices=("lctru", "lru"), help="override the memory method's eviction")
    parser.add_argument("--max-seconds", type=float, help="end after this long, whatever happens (a bound)")
    parser.add_argument("--contexts-per-app", type=int, default=4, help="K: contexts one app may hold")
    parser.add_argument("--context-tokens", type=int, default=2048, help="the longest a context may grow")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    if socket_problem(args.socket):
        parser.error(socket_problem(args.socket))
    torch.set_num_threads(args.threads)
    disk = DiskProfile(*(float(v) for v in args.disk.split(","))) if args.disk else None
    model = load_whole(args.model, dtype="float32")
    store = ChunkStore(os.path.join(args.state_dir, "chunks"), disk)
    profile = install_profile(model, store, args.chunk_tokens)  # T_re and T_IO of this device, fitted now
    budget = int(args.budget_mib * (1 << 20))
    recompute, read = _costs(args.recompute_cost, profile["recompute"]), _costs(args.read_cost, profile["read"])
    settings = baseline_settings(args.memory, budget, recompute, read, args.chunk_tokens)
    settings = settings._replace(ratio_global=args.ratio)
    off = {"compression": args.no_compression, "pipeline": args.no_pipeline, "ahead_of_time": args.no_aot}
    settings = settings._replace(**{name: False for name, flag in off.items() if flag})
    if args.eviction:
        settings = settings._replace(eviction=args.eviction)
    if args.recompute_pace:
        settings = settings._replace(recompute_pace=_costs(args.recompute_pace, settings.recompute_cost))
    recorded = profile_json(profile)
    if settings.recompute_pace is not None:  # the target's T_re decides the plan, and how long recompute takes
        pace = settings.recompute_pace
        settings = settings._replace(recompute_cost=pace)
        recorded.update(t_re_s_per_chunk=pace.per_unit_s, t_re_fixed_s=pace.fixed_s, t_re_modeled=True,
                        read_to_recompute_ratio=settings.read_cost.seconds(profile["read_points"][0][0])
                        / max(1e-12, pace.seconds(1)))  # fmt: skip
    write_json_atomic(os.path.join(args.state_dir, "install_profile.json"), recorded)
    service = LlmService(ContextMemory(model, store, settings), Tokenizer(args.model),
                         os.path.join(args.state_dir, "contexts"),
                         Limits(args.contexts_per_app, args.context_tokens))  # fmt: skip
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)  # a socket left by a killed daemon
    server = _Server(args.socket, service, args.memory)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(json.dumps({"serving": args.socket, "pid": os.getpid(), "memory": args.memory,
                      "contexts": len(service.memory.contexts), "store_modeled": store.modeled,
                      "t_re": list(settings.recompute_cost), "t_io": list(settings.read_cost),
                      "recompute_paced": settings.recompute_pace is not None}), flush=True)  # fmt: skip
    stop.wait(args.max_seconds)
    server.shutdown()
    with service._turn:  # the call in flight ends first
        server.server_close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
