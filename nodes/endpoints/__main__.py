"""Serve an endpoint: ``python -m nodes.endpoints --model DIR --pace device --device-speed NAME``.

Paces: ``device`` (a phone's measured rates: ``--device-speed``), ``trace`` (a service's TTFT and
inter-token distributions: ``--service``) or ``compute`` (as fast as this host computes). The bound
address is printed as one JSON line on stdout (and written to ``--port-file``) once it accepts.
SIGTERM or SIGINT stops it after the requests in flight.
"""

import argparse
import json
import signal
import sys
import threading

import torch

from .generator import PacedGenerator
from .openai_api import Endpoint, api_key_from_env, make_server
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
    parser.add_argument("--device", default="cpu", help="where the model computes: cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", help="float32, float16, bfloat16 or auto (the checkpoint's)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    try:
        pace = pace_named(args.pace, args.device_speed if args.pace == "device" else args.service, args.seed)
        key = api_key_from_env(args.api_key_env)
    except ValueError as error:
        print("error: %s" % error, file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = PacedGenerator(args.model, args.dtype, args.device)
    name = args.model_name or args.model.rstrip("/").split("/")[-1]
    endpoint = Endpoint(generator, pace, name, args.log, key)
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
