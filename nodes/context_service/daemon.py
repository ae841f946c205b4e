"""The LLM service daemon: ``python -m nodes.context_service --model DIR --socket PATH --state-dir DIR``.

It owns the model and the context memory and answers apps on a Unix socket (``protocol.py``), one
thread per connection, one call at a time. Its chunks go to ``STATE_DIR/chunks`` (paced to
``--disk`` on an emulated device), its contexts to ``STATE_DIR/contexts``. ``--memory`` picks LLMS or
one of its baselines and ablations (``context_memory.baseline_settings``); the ``--no-*`` flags change
one technique on top. ``--recompute-pace`` makes recompute take a target device's T_re (modeled).
Once it accepts it writes one JSON line on stdout; SIGTERM stops it after the call in flight, and
``--max-seconds`` bounds its life (a daemon whose controller died ends by itself).

The socket lives in a directory of its own that only its user may enter (0700, made so if missing;
the daemon refuses to start when it exists with another owner or mode). Tokens are written to an app
off the turn lock, and a client that sends or reads nothing for ``--client-timeout-s`` is dropped (a
call it was reading is rolled back), so one stalled app holds up neither the others nor shutdown.

    python -m nodes.context_service --model examples/models/tiny --socket ~/llm/llm.sock --state-dir ~/llm/state
"""

import argparse
import contextlib
import json
import os
import queue
import signal
import socketserver
import stat
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

import torch

from nodes.contracts.durable import write_json_atomic
from nodes.contracts.service_files import socket_problem, unix_address
from nodes.inference.checkpoint import load_whole
from nodes.inference.tokenizer import Tokenizer

from .chunk_store import ChunkStore, DiskProfile
from .context_memory import BASELINES, ContextLimit, ContextMemory, baseline_settings
from .install_profile import install_profile
from .load_plan import LinearCost
from .protocol import MAX_REQUEST_BYTES, BadRequest, encode, error, parse_request
from .service import CallAbandoned, Limits, LlmService, ServiceError

CLIENT_TIMEOUT_S = 30.0  # a client that sends nothing, or reads nothing, this long is dropped


class _ClientGone(Exception):
    """The connection failed, or its client sent or read nothing for the timeout: it is dropped."""


class _TokenWriter(object):
    """A call's tokens written to its client from a thread of their own, so that the model, which runs
    under the turn lock, never waits for a client: ``put`` only queues. A write that fails or times out
    (the socket's timeout) marks the client gone; ``put`` then says so and the call is abandoned."""

    def __init__(self, send: Callable[[Dict[str, Any]], None], tokenizer: Tokenizer) -> None:
        self._send, self._tokenizer = send, tokenizer
        self._queue: "queue.Queue[Optional[int]]" = queue.Queue()
        self._sent: List[int] = []
        self.gone = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokens", daemon=True)
        self._thread.start()

    def put(self, token: int) -> bool:
        self._queue.put(token)
        return not self.gone.is_set()

    def finish(self) -> bool:
        """Wait until every queued token is written or the client is gone; whether it is still there."""
        self._queue.put(None)
        self._thread.join()
        return not self.gone.is_set()

    def _run(self) -> None:
        while True:
            token = self._queue.get()
            if token is None:
                return
            if self.gone.is_set():
                continue
            text = self._tokenizer.piece(self._sent, token)
            self._sent.append(token)
            try:
                self._send({"token_id": token, "text": text})
            except _ClientGone:
                self.gone.set()


class _Handler(socketserver.StreamRequestHandler):
    server: "_Server"

    def setup(self) -> None:
        self.timeout = self.server.client_timeout_s  # every read and write of the connection
        super().setup()

    def handle(self) -> None:
        try:
            try:
                line = self.rfile.readline(MAX_REQUEST_BYTES)
            except OSError:  # (socket.timeout: half a request, or none)
                raise _ClientGone() from None
            self._answer(parse_request(line))
        except BadRequest as exc:
            self._refuse(error("bad_request", exc.message, exc.field))
        except ServiceError as exc:
            self._refuse(error(exc.code, exc.message, exc.field))
        except ContextLimit as exc:
            self._refuse(error("memory", str(exc), "ctx"))
        except (_ClientGone, CallAbandoned):
            pass  # the client left or stalled: dropped; a call in flight was rolled back
        except Exception as exc:  # a fault of ours: the app hears of it, the daemon serves on
            self._refuse(error("internal", "%s: %s" % (type(exc).__name__, exc)))
            raise

    def _answer(self, request: Dict[str, Any]) -> None:
        op, service = request["op"], self.server.service
        if op == "new":
            self._send({"ok": True, "ctx": service.new_context(request["app"], request.get("system_prompt"))})
        elif op == "call":
            self._call(service, request)
        elif op == "delete":
            service.delete(request["ctx"])
            self._send({"ok": True})
        elif op == "list":
            self._send({"ok": True, "contexts": service.contexts()})
        else:
            memory = service.memory
            self._send({"ok": True, "memory_method": self.server.memory_method,
                        "settings": memory.settings._asdict(), "resident_bytes": memory.resident_bytes,
                        "budget_bytes": memory.settings.budget_bytes, "faults": memory.faults,
                        "recompute_overruns": memory.recompute_overruns,
                        "aot_bytes_written": memory.aot_bytes_written, "store": memory.store.stats.as_dict(),
                        "store_modeled": memory.store.modeled, "contexts": len(memory.contexts)})  # fmt: skip

    def _call(self, service: LlmService, request: Dict[str, Any]) -> None:
        max_tokens = request.get("max_tokens")
        forced = request.get("teacher_forced") or request.get("teacher_forced_ids")
        writer = None if forced else _TokenWriter(self._send, service.tokenizer)
        try:
            result = service.run_call(request["ctx"], request.get("prompt") or "",
                                      16 if max_tokens is None else max_tokens, request.get("teacher_forced"),
                                      request.get("prompt_ids"), request.get("teacher_forced_ids"),
                                      on_token=writer.put if writer is not None else None)  # fmt: skip
        finally:
            there = writer.finish() if writer is not None else True
        if not there:
            raise _ClientGone()
        self._send({"ok": True, "done": True, "output_ids": result.output_ids, "prompt_tokens": result.prompt_tokens,
                    "context_tokens": result.context_tokens, "prefill_s": result.prefill_s,
                    "decode_s": result.decode_s, "switch": result.switch._asdict()})  # fmt: skip

    def _send(self, message: Dict[str, Any]) -> None:
        try:
            self.wfile.write(encode(message))
            self.wfile.flush()
        except OSError:  # (socket.timeout: a client that reads nothing)
            raise _ClientGone() from None

    def _refuse(self, message: Dict[str, Any]) -> None:
        with contextlib.suppress(_ClientGone):
            self._send(message)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, service: LlmService, memory_method: str = "llms",
                 client_timeout_s: float = CLIENT_TIMEOUT_S) -> None:  # fmt: skip
        self.service, self.memory_method, self.client_timeout_s = service, memory_method, client_timeout_s
        previous = os.umask(0o077)  # the socket itself: its owner's alone (its directory is 0700 too)
        try:
            with unix_address(path) as address:
                super().__init__(address, _Handler)
        finally:
            os.umask(previous)


def socket_directory_problem(socket_path: str) -> str:
    """Make the socket's directory (0700) if it is missing; why it is unsafe if it is there and another
    user owns it, others may enter it, or it is not a plain directory; '' when it is safe."""
    directory = os.path.dirname(os.path.abspath(socket_path))
    try:
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # (whatever the umask)
    except FileExistsError:
        pass
    except OSError as exc:
        return "cannot make the socket's directory %s: %s" % (directory, exc)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        return "the socket's directory %s is not a directory (a link?): it must be a 0700 directory" % directory
    if info.st_uid != os.geteuid():
        return "the socket's directory %s belongs to uid %d, not to this user (uid %d): it must be ours, 0700" % (
            directory, info.st_uid, os.geteuid())
    if stat.S_IMODE(info.st_mode) != 0o700:
        return "the socket's directory %s has mode %04o: it must be 0700 (chmod 700 it, or remove it)" % (
            directory, stat.S_IMODE(info.st_mode))
    return ""


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
    parser.add_argument("--client-timeout-s", type=float, default=CLIENT_TIMEOUT_S,
                        help="drop a client that sends or reads nothing this long (default %(default)s)")
    args = parser.parse_args(argv)
    problem = socket_problem(args.socket) or socket_directory_problem(args.socket)
    if problem:
        parser.error(problem)
    if not args.client_timeout_s > 0:
        parser.error("--client-timeout-s must be > 0")
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
    server = _Server(args.socket, service, args.memory, args.client_timeout_s)
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
    with service._turn:  # the call in flight ends first; calls still waiting for their turn never run
        server.server_close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.socket)
        sys.stdout.flush()
        sys.stderr.flush()
        # Every call is committed or rolled back and saved. Handler threads may still be waiting for
        # the turn or on a stalled client; the interpreter's teardown with them alive can abort inside
        # torch ("terminate called without an active exception", exit -6, seen once under load), so
        # the process ends here, with them.
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
