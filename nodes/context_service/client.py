"""Apps' side of the LLM service: ``ContextClient`` (newLLMCtx / callLLM / delLLMCtx over the daemon's
Unix socket) and a small CLI for scripts and shells.

    python -m nodes.context_service.client --socket S new --app mail [--system-prompt TEXT]
    python -m nodes.context_service.client --socket S call CTX "prompt" [--max-tokens 32]
    python -m nodes.context_service.client --socket S delete CTX
    python -m nodes.context_service.client --socket S list
    python -m nodes.context_service.client --socket S stats
"""

import argparse
import json
import socket
import sys
from typing import Any, Dict, Iterator, List, Optional

from nodes.contracts.service_files import unix_address

from .protocol import encode


class ServiceRefused(Exception):
    def __init__(self, answer: Dict[str, Any]) -> None:
        super().__init__("%s: %s" % (answer.get("code"), answer.get("error")))
        self.code, self.field = answer.get("code"), answer.get("field")


class ContextClient(object):
    def __init__(self, socket_path: str, timeout_s: float = 120.0) -> None:
        self.socket_path, self.timeout_s = socket_path, timeout_s

    def _lines(self, request: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            with unix_address(self.socket_path) as address:
                sock.connect(address)
            sock.sendall(encode(request))
            with sock.makefile("rb") as reader:
                for line in reader:
                    answer = json.loads(line)
                    if answer.get("ok") is False:
                        raise ServiceRefused(answer)
                    yield answer
        finally:
            sock.close()

    def _one(self, request: Dict[str, Any]) -> Dict[str, Any]:
        for answer in self._lines(request):
            return answer
        raise ConnectionError("the service closed the connection without an answer")

    def new_context(self, app: str, system_prompt: Optional[str] = None) -> str:
        return str(self._one({"op": "new", "app": app, "system_prompt": system_prompt})["ctx"])

    def call_stream(self, ctx: str, prompt: str, max_tokens: int = 16,
                    teacher_forced: Optional[str] = None) -> Iterator[Dict[str, Any]]:  # fmt: skip
        """Every answer line: ``{"token_id", "text"}`` per token, then the ``done`` record."""
        return self._lines({"op": "call", "ctx": ctx, "prompt": prompt, "max_tokens": max_tokens,
                            "teacher_forced": teacher_forced})  # fmt: skip

    def call_ids(self, ctx: str, prompt_ids: List[int], teacher_forced_ids: List[int]) -> Dict[str, Any]:
        """A teacher-forced call in token ids (a replayed trace): the service's record of it."""
        answer = self._one({"op": "call", "ctx": ctx, "prompt_ids": prompt_ids, "max_tokens": 0,
                            "teacher_forced_ids": teacher_forced_ids})  # fmt: skip
        if not answer.get("done"):
            raise ConnectionError("the service ended the call without its record")
        return answer

    def call(self, ctx: str, prompt: str, max_tokens: int = 16, teacher_forced: Optional[str] = None) -> Dict[str, Any]:
        """The whole call: the output text and the service's record of it."""
        text: List[str] = []
        for answer in self.call_stream(ctx, prompt, max_tokens, teacher_forced):
            if answer.get("done"):
                return dict(answer, text="".join(text))
            text.append(answer["text"])
        raise ConnectionError("the service ended the call without its record")

    def delete(self, ctx: str) -> None:
        self._one({"op": "delete", "ctx": ctx})

    def contexts(self) -> List[Dict[str, Any]]:
        return list(self._one({"op": "list"})["contexts"])

    def stats(self) -> Dict[str, Any]:
        return self._one({"op": "stats"})


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.context_service.client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--socket", required=True, help="the daemon's Unix socket")
    sub = parser.add_subparsers(dest="op", required=True)
    new = sub.add_parser("new", help="make a context (newLLMCtx); prints its id")
    new.add_argument("--app", required=True)
    new.add_argument("--system-prompt")
    call = sub.add_parser("call", help="call the LLM in a context (callLLM); streams the output")
    call.add_argument("ctx")
    call.add_argument("prompt")
    call.add_argument("--max-tokens", type=int, default=16)
    delete = sub.add_parser("delete", help="delete a context (delLLMCtx)")
    delete.add_argument("ctx")
    sub.add_parser("list", help="the contexts the service holds")
    sub.add_parser("stats", help="the memory's counters, settings and the store's bytes (a health check)")
    args = parser.parse_args(argv)
    client = ContextClient(args.socket)
    try:
        if args.op == "new":
            print(client.new_context(args.app, args.system_prompt))
        elif args.op == "call":
            for answer in client.call_stream(args.ctx, args.prompt, args.max_tokens):
                if answer.get("done"):
                    sys.stdout.write("\n")
                    sys.stderr.write(json.dumps(answer["switch"]) + "\n")
                else:
                    sys.stdout.write(answer["text"])
                    sys.stdout.flush()
        elif args.op == "delete":
            client.delete(args.ctx)
        elif args.op == "stats":
            print(json.dumps(client.stats(), indent=1))
        else:
            print(json.dumps(client.contexts(), indent=1))
    except ServiceRefused as refused:
        print("error: %s" % refused, file=sys.stderr)
        return 2
    except (ConnectionError, FileNotFoundError) as exc:
        print("error: cannot reach the service at %s: %s" % (args.socket, exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
