"""Serve an endpoint: ``python -m nodes.endpoints --model DIR --pace device --device-speed NAME``.

Paces: ``device`` (a phone's measured rates: ``--device-speed``), ``trace`` (a service's TTFT and
inter-token distributions: ``--service``) or ``compute`` (as fast as this host computes). The bound
address is printed as one JSON line on stdout (and written to ``--port-file``) once it accepts.
SIGTERM or SIGINT stops it after the requests in flight.

With ``--api-key-env VAR`` or ``--api-key-file FILE`` (0600) every route asks for that key; a key is
never given on the command line (``ps`` shows it to every user). ``--max-in-flight``,
``--max-connections``, ``--max-body-bytes`` and ``--timeout-s`` bound what it takes (429, 413, and
connections dropped).
"""

import argparse
import json
import signal
import sys
import threading

import torch

from .generator import PacedGenerator
from .openai_api import Endpoint, EndpointLimits, api_key_from_env, api_key_from_file, make_server
from .pace import pace_named


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nodes.endpoints", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", required=True, help="checkpoint directory (config.json, weights, tokenizer.json)")
    parser.add_argument("--model-name", help="the name /v1/models reports (default: the directory's name)")
    parser.add_argument("--pace", choices=("device", "trace", "compute"), default="compute")
    parser.add_argument("--device-speed", help="with --pace device: e.g. pixel7pro-bloom-1.1b")
    parser.add_argument("--service", help="with --pace trace: gpt, deepseek, command or llama")
    parser.add_argument("--seed", type=int, default=0, help="the pace's random stream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--log", help="endpoint_requests.jsonl to append each finished request to")
    parser.add_argument("--port-file", help="write the bound port here once serving")
    parser.add_argument("--api-key-env", help="require the key held by this environment variable")
    parser.add_argument("--api-key-file", help="require the key held by this file (readable by its owner alone)")
    defaults = EndpointLimits()
    parser.add_argument("--max-in-flight", type=int, default=defaults.max_in_flight,
                        help="completions at once; more are refused with 429 (default %(default)s)")
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections,
                        help="open connections; more are refused with 429 (default %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help="a request body's size; more is refused with 413 (default %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s,
                        help="a connection that sends or reads nothing this long is dropped (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="where the model computes: cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", help="float32, float16, bfloat16 or auto (the checkpoint's)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    try:
        pace = pace_named(args.pace, args.device_speed if args.pace == "device" else args.service, args.seed)
        if args.api_key_env and args.api_key_file:
            raise ValueError("give --api-key-env or --api-key-file, not both")
        key = api_key_from_file(args.api_key_file) if args.api_key_file else api_key_from_env(args.api_key_env)
        limits = EndpointLimits(args.max_body_bytes, args.timeout_s, args.max_in_flight, args.max_connections)
        if min(limits.max_body_bytes, limits.max_in_flight, limits.max_connections) < 1 or not limits.timeout_s > 0:
            raise ValueError("--max-in-flight, --max-connections, --max-body-bytes and --timeout-s must be > 0")
    except (OSError, ValueError) as error:
        print("error: %s" % error, file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = PacedGenerator(args.model, args.dtype, args.device)
    name = args.model_name or args.model.rstrip("/").split("/")[-1]
    endpoint = Endpoint(generator, pace, name, args.log, key, limits=limits)
    server, port = make_server(endpoint, args.host, args.port)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    if args.port_file:
        with open(args.port_file, "w") as handle:
            handle.write("%d\n" % port)
    print(json.dumps({"serving": "http://%s:%d/v1" % (args.host, port), "pace": pace.label}), flush=True)
    stop.wait()
    server.shutdown()
    server.server_close()
    endpoint.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
