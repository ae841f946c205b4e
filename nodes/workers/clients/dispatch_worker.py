"""The ranks of a dispatching method (``methods/disco.py``).

``DispatchServer`` (the server's stage rank) serves the trace endpoint: an OpenAI-compatible API on
the server's data-plane address whose tokens the checkpoint computes and whose times replay the run's
service (``dispatch.service``); it tells every device rank its URL over MPI and serves until each has
said it is done. Its log, ``endpoint_requests.jsonl``, counts what it produced for every request,
also the cancelled ones (what the server bills). Every endpoint of the run asks for the run's own key
(``dispatch.endpoint_key_file``, fresh for each run: nobody else on the data plane or the node can use
them), which the dispatchers send.

``DispatchClient`` (a device rank) serves its own device endpoint on loopback, paced to the phone's
measured rates (``endpoints.device_speed``), then profiles both endpoints with calibration requests of
its own (F from server-only requests, T_d = k l + c from device-only ones, p(l) from their lengths:
never from the requests it evaluates), makes the policy's plan for the run's budget, and dispatches
each scheduled request at its arrival time (``nodes.dispatch.live``). It writes ``requests.jsonl``
and ``tokens.csv`` as every device does (TTFT on its own clock; each token's ``display_s`` paced at
r_c by the client buffer) and ``dispatch_calibration.json`` with the profiles, the premises' Pearson
coefficients and Algorithm 1's verdict.
"""

import contextlib
import fcntl
import json
import os
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import numpy as np
from mpi4py import MPI

from nodes.contracts.durable import write_json_atomic
from nodes.contracts.records import CsvLog, JsonLinesLog
from nodes.contracts.run_config import RunConfig, load_schedule
from nodes.dispatch.controller import REGIME_OF, MigrationRule, plan_dispatch
from nodes.dispatch.live import EndpointAddress, dispatch_request
from nodes.dispatch.policy import SERVER, LengthDistribution, ServerTtft, TokenCosts, constrained_endpoint
from nodes.dispatch.replay import display_times
from nodes.endpoints.device_speed import LinearTtft, device_speed_named
from nodes.endpoints.generator import PacedGenerator
from nodes.endpoints.openai_api import Endpoint, EndpointLimits, api_key_from_file, make_server
from nodes.endpoints.pace import DevicePace, EnginePace, TracePace
from nodes.endpoints.services import service_named

from .. import mpi_link

TAG_DISPATCH = 21  # the server's URL down, each device's "done" up
TOKEN_COLUMNS = ("request_id", "index", "token_id", "ts_s", "display_s")
CALIBRATION_WORKERS = 4
SCHEDULE_WORKERS = 64  # a device's requests in flight at once
STREAMS_PER_REQUEST = 2  # a race's two streams, or a migration's source and target
SIOCGIFADDR = 0x8915


def interface_address(interface: str) -> str:
    """The IPv4 address of ``interface`` (the data plane the MPI launch names); loopback for ``lo``."""
    if not interface or interface == "lo":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def run_key(config: RunConfig) -> Optional[str]:
    """The key the run's endpoints ask for (from its 0600 file), or None for a run without one."""
    path = config.dispatch.endpoint_key_file
    return api_key_from_file(os.path.expanduser(path)) if path else None


def endpoint_limits(devices: int) -> EndpointLimits:
    """Room for every stream the run's ``devices`` dispatchers may open at once (calibration included)."""
    streams = max(1, devices) * max(SCHEDULE_WORKERS, CALIBRATION_WORKERS) * STREAMS_PER_REQUEST
    default = EndpointLimits()
    in_flight = max(default.max_in_flight, streams)
    return default._replace(max_in_flight=in_flight, max_connections=max(default.max_connections, 2 * in_flight))


class DispatchServer(object):
    """The server's endpoint: the trace endpoint, or (``dispatch.server_endpoint: engine``) the serving
    engine with the run's scheduler and KV budget behind the same API."""

    def __init__(self, config: RunConfig, comm: "MPI.Comm", rank: int, parts: Any = None) -> None:
        self.config, self.comm, self.rank = config, comm, rank
        self.key = run_key(config)
        self.engine = None
        self.external = config.dispatch.external_url is not None  # a lab's server: nothing to serve here
        if self.external:
            return
        if config.dispatch.server_endpoint == "engine":
            from ..engines.engine_endpoint import EngineEndpoint

            self.engine = EngineEndpoint(config, comm, rank, parts)
            self.generator: Any = self.engine.streams
            self.pace: Any = EnginePace(config.serving.scheduler, config.target is not None)
        else:
            self.generator = PacedGenerator(config.model, dtype=config.dtype)
            self.pace = TracePace(service_named(config.dispatch.service), seed=config.seed)

    def start(self, t0: float) -> None:
        if self.external:
            for device in self.config.device_ranks:
                self.comm.send(self.config.dispatch.external_url, dest=device, tag=TAG_DISPATCH)
            return
        directory = self.config.rank_dir(self.rank)
        if self.engine is not None:
            self.engine.start(t0)
        name = os.path.basename(self.config.model.rstrip("/"))
        self.endpoint = Endpoint(self.generator, self.pace, name, directory + "/endpoint_requests.jsonl", self.key,
                                 role="server endpoint", limits=endpoint_limits(len(self.config.device_ranks)),
                                 # the trace endpoint's tokens are its paced steps; the engine logs its own
                                 steps_path=None if self.engine is not None else directory + "/steps.csv",
                                 t0=t0)  # fmt: skip
        host = interface_address(os.environ.get("FI_TCP_IFACE", "lo"))
        self.http, port = make_server(self.endpoint, host, 0)
        self.thread = threading.Thread(target=self.http.serve_forever, name="endpoint", daemon=True)
        self.thread.start()
        url = "http://%s:%d/v1" % (host, port)
        for device in self.config.device_ranks:
            self.comm.send(url, dest=device, tag=TAG_DISPATCH)

    def serve(self) -> None:
        if self.external:
            self._await_devices()
            return
        if self.engine is not None:  # the engine loop here, the devices' "done" on a thread of its own
            waiter = threading.Thread(target=self._await_devices, name="devices", daemon=True)
            waiter.start()
            self.engine.serve()
            waiter.join()
        else:
            self._await_devices()
        self.http.shutdown()
        self.http.server_close()
        self.endpoint.close()

    def _await_devices(self) -> None:
        for _ in self.config.device_ranks:  # each device says when it has dispatched its schedule
            mpi_link.recv_object(self.comm, MPI.ANY_SOURCE, TAG_DISPATCH)  # polled: a blocking recv spins
        if self.engine is not None:
            self.engine.stop()


class DispatchClient(object):
    def __init__(self, config: RunConfig, comm: "MPI.Comm", rank: int, parts: Any = None) -> None:
        self.config, self.comm, self.rank = config, comm, rank
        self.spec = config.ranks[rank]
        self.settings = config.dispatch
        self.schedule = load_schedule(self.spec.schedule)
        self.generator = PacedGenerator(config.model, dtype=config.dtype)
        self.speed = device_speed_named(self.settings.device_speed)
        self.rng = np.random.default_rng([config.seed, self.spec.index])
        self.key = run_key(config)

    def start(self, t0: float) -> None:
        self.t0 = t0
        directory = self.config.rank_dir(self.rank)
        self.directory = directory
        name = os.path.basename(self.config.model.rstrip("/"))
        self.endpoint = Endpoint(self.generator, DevicePace(self.speed, seed=self.config.seed), name,
                                 directory + "/endpoint_requests.jsonl", self.key, role="device endpoint",
                                 limits=endpoint_limits(1), steps_path=directory + "/steps.csv", t0=t0)  # fmt: skip
        self.http, port = make_server(self.endpoint, "127.0.0.1", 0)
        threading.Thread(target=self.http.serve_forever, name="endpoint", daemon=True).start()
        self.device_url = "http://127.0.0.1:%d/v1" % port

    def run(self) -> None:
        server_url, _ = mpi_link.recv_object(self.comm, 0, TAG_DISPATCH)
        model = os.path.basename(self.config.model.rstrip("/"))
        server = EndpointAddress(server_url, model, self.key)
        if self.settings.external_url is not None:  # a lab's server, its key from the file staging wrote
            server = EndpointAddress(self.settings.external_url, self.settings.external_model, self._key())
        endpoints = {"server": server, "device": EndpointAddress(self.device_url, model, self.key)}
        prompts = [self._prompt_ids(r) for r in self.schedule]
        began = time.monotonic()
        plan, fit, rule, calibration = self._calibrate(endpoints, prompts)
        calibration["calibration_s"] = round(time.monotonic() - began, 3)
        write_json_atomic(os.path.join(self.directory, "dispatch_calibration.json"), calibration)
        origin = self.origin = time.monotonic()  # the schedule's clock starts after the calibration
        header = {"role": "device", "node": self.spec.node, "method": self.config.method,
                  "policy": self.settings.policy, "clock_origin_monotonic_s": origin,
                  "clock_origin_unix_s": time.time() - (time.monotonic() - origin), "modeled_times": True}  # fmt: skip
        requests = JsonLinesLog(self.directory + "/requests.jsonl", header)
        tokens = CsvLog(self.directory + "/tokens.csv", TOKEN_COLUMNS, header)
        lock = threading.Lock()
        starts = plan.starts(np.array([len(p) for p in prompts]), self.rng.random(len(prompts)))

        def serve(index: int) -> None:
            request = self.schedule[index]
            wait = origin + request.arrival_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            sent = time.monotonic() - origin
            route = (float(starts[0][index]), float(starts[1][index]))
            record = dispatch_request(request.request_id, prompts[index], request.max_new_tokens, route[0], route[1],
                                      endpoints, self.settings.consumption_tok_s, fit, rule,
                                      seed=self.config.seed * 1_000_003 + request.request_id)  # fmt: skip
            # the route the plan gave (None: never), so that a replay can serve the same request the same way
            record["route_server_s"], record["route_device_s"] = (t if np.isfinite(t) else None for t in route)
            with lock:
                self._write(request, sent, record, requests, tokens)

        with ThreadPoolExecutor(max(1, min(SCHEDULE_WORKERS, len(self.schedule)))) as pool:
            list(pool.map(serve, range(len(self.schedule))))
        requests.close()
        tokens.close()
        self.comm.send("done", dest=0, tag=TAG_DISPATCH)
        self.http.shutdown()
        self.http.server_close()
        self.endpoint.close()

    def _key(self) -> Optional[str]:
        """The external endpoint's key, read once from its 0600 file, which is then removed."""
        path = self.settings.external_key_file
        if not path:
            return None
        with open(path, encoding="utf-8") as handle:
            key = handle.read().strip()
        with contextlib.suppress(OSError):
            os.remove(path)
        return key

    def _prompt_ids(self, request) -> List[int]:
        if request.prompt_ids:
            return [int(i) for i in request.prompt_ids]
        return self.generator.encode(request.prompt or "")

    def _calibrate(self, endpoints: Dict[str, EndpointAddress], prompts: List[List[int]]):
        """Profiles from requests of their own: lengths resampled from the schedule's, content cut from
        its prompts at random places; server-only for F, device-only for T_d (one token each)."""
        count = self.settings.calibration_requests
        pool = [t for p in prompts for t in p] or [1]
        lengths = self.rng.choice([len(p) for p in prompts], size=count)
        starts = self.rng.integers(0, max(1, len(pool) - int(lengths.max())), size=count)
        calibration_prompts = [(pool * (1 + int(n) // len(pool) + 1))[s : s + int(n)] for s, n in zip(starts, lengths)]
        rough = LinearTtft(1.0 / self.speed.prefill_tok_s, 0.0, 1.0, 0)
        never = float("inf")

        def measure(server_start: float, device_start: float) -> List[float]:
            def one(i: int) -> float:
                record = dispatch_request(-1 - i, calibration_prompts[i], 1, server_start, device_start, endpoints,
                                          self.settings.consumption_tok_s, rough)  # fmt: skip
                if record["ttft_s"] is None:
                    raise RuntimeError("calibration request failed: %s" % record["failure"])
                return float(record["ttft_s"])

            with ThreadPoolExecutor(CALIBRATION_WORKERS) as workers:
                return list(workers.map(one, range(count)))

        server_ttft = measure(0.0, never)
        device_ttft = measure(never, 0.0)
        ttft = ServerTtft.from_samples(server_ttft)
        fit = LinearTtft.fit(lengths, device_ttft)
        p_l = LengthDistribution.from_samples(lengths)
        plan = plan_dispatch(self.settings.policy, self.settings.budget, p_l, ttft, self.settings.alpha)
        costs = TokenCosts(*self.settings.prices)
        rule = None
        if self.settings.migration:
            rule = MigrationRule.from_calibration(costs, self.settings.consumption_tok_s, fit, ttft,
                                                  [r.max_new_tokens for r in self.schedule],
                                                  self.settings.source_keeps_streaming)  # fmt: skip
        calibration = {
            "requests_per_endpoint": count, "server_ttft_s": server_ttft, "device_ttft_s": device_ttft,
            "prompt_tokens": [int(n) for n in lengths],
            "device_fit": {"seconds_per_token": fit.seconds_per_token, "intercept_s": fit.intercept_s},
            "device_pearson": fit.pearson,
            "server_pearson": float(np.corrcoef(lengths, server_ttft)[0, 1]) if np.ptp(lengths) else None,
            "algorithm1": constrained_endpoint(costs) if any(self.settings.prices) else None,
            "regime": REGIME_OF.get(self.settings.policy, SERVER), "policy": self.settings.policy,
            "budget": self.settings.budget, "plan": _describe(plan), "modeled_times": True,
            "server_url": endpoints["server"].base_url, "external": self.settings.external_url is not None,
            "device_url": endpoints["device"].base_url, "endpoints_keyed": self.key is not None,
        }  # fmt: skip
        return plan, fit, rule, calibration

    def _write(self, request, sent_s: float, record: Dict[str, Any], requests: JsonLinesLog, tokens: CsvLog) -> None:
        ids, arrivals = record["token_ids"], record["arrivals_s"]
        stamps = [sent_s + a for a in arrivals]
        shown = display_times(np.array(stamps), self.settings.consumption_tok_s).tolist() if stamps else []
        rows = enumerate(zip(ids, stamps, shown))
        tokens.write_many([{"request_id": request.request_id, "index": i, "token_id": t, "ts_s": round(ts, 6),
                            "display_s": round(d, 6)} for i, (t, ts, d) in rows])  # fmt: skip
        ttft = record["ttft_s"]
        requests.write({
            "request_id": request.request_id, "node": self.spec.node, "method": self.config.method,
            "prompt_tokens": record["prompt_tokens"], "output_tokens": len(ids),
            "max_new_tokens": request.max_new_tokens, "finished_by": "failed" if record["failure"] else "length",
            "arrival_s": round(request.arrival_s, 6), "start_s": round(sent_s, 6),
            "upload_start_s": round(sent_s, 6), "upload_end_s": round(sent_s, 6),
            "first_token_s": round(stamps[0], 6) if stamps else None,
            "last_token_s": round(stamps[-1], 6) if stamps else None,
            "done_s": round(time.monotonic() - self.origin, 6),
            "ttft_s": round(sent_s + ttft - request.arrival_s, 6) if ttft is not None else None,
            "decode": {"steps": max(0, len(ids) - 1)},
            "dispatch": {k: v for k, v in record.items() if k not in ("token_ids", "arrivals_s")},
            "token_ids": ids, "text": self.generator.decode(ids),
        })  # fmt: skip


def _describe(plan) -> Dict[str, Any]:
    out: Dict[str, Any] = {"policy": plan.policy, "budget": plan.budget}
    if plan.threshold is not None:
        out["length_threshold_tokens"] = plan.threshold.length_tokens
        out["boundary_device_only"] = plan.threshold.boundary_device_only
    if plan.waits is not None:
        out["tail_wait_s"] = plan.waits.tail_wait_s
        out["waits_s"] = {int(n): float(w) for n, w in zip(plan.waits.lengths, plan.waits.waits_s)}
    return json.loads(json.dumps(out))
