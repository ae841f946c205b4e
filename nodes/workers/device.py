"""A device rank: replays its request schedule and stamps every token on its own clock.

For each request in arrival order (one at a time, as one user's device): wait for its arrival
time, run the device's share of the model, send hidden states (or token ids for ``centralized``)
to server stage 0, receive the deep hidden state (or the next token id) from the last stage, run
the LM head, and repeat for every generated token. ``ushape`` and ``usarathi`` send the prompt
whole; ``usarathi`` differs on the server, which chunks it.

Stamps (seconds from the start barrier, this rank's monotonic clock): ``arrival_s`` (scheduled),
``start_s``, ``upload_start_s``/``upload_end_s`` of the prompt, ``first_token_s``, every token's
``ts_s``, ``done_s``. The server's durations (queue, compute, residence) come back in the frame
headers, so ``network_s`` = round trip - server residence is measured without shared clocks.
"""

import time
from typing import Any, Dict, List

import torch
from mpi4py import MPI

from nodes.inference.checkpoint import load_part
from nodes.inference.config import LlamaConfig
from nodes.inference.model import Segment as CacheSegment
from nodes.inference.partition import UShapePartition
from nodes.inference.tokenizer import Tokenizer

from . import mpi_link, wire
from .records import CsvLog, JsonLinesLog
from .run_config import RunConfig, ScheduledRequest, load_schedule

TOKEN_COLUMNS = ("request_id", "index", "token_id", "ts_s")


class DeviceWorker:
    def __init__(self, config: RunConfig, comm: "MPI.Comm", rank: int) -> None:
        self.config, self.comm, self.rank, self.t0 = config, comm, rank, 0.0
        spec = config.ranks[rank]
        self.spec = spec
        self.schedule = load_schedule(spec.schedule)
        self.tokenizer = Tokenizer(config.model)
        model_config = LlamaConfig.load(config.model)
        self.centralized = config.method == "centralized"
        self.part = None
        if not self.centralized:
            partition = UShapePartition.make(model_config.num_hidden_layers, config.device_layers, config.stages)
            self.part = load_part(
                config.model,
                partition.device_layer_ids(),
                embedding=True,
                head=True,
                dtype=config.dtype,
                device=spec.torch_device,
            )
        self.last_stage = config.stages - 1

    def start(self, t0: float) -> None:
        """Take the clock origin (at the start barrier) and open the result files."""
        self.t0 = t0
        header = {
            "role": "device",
            "node": self.spec.node,
            "method": self.config.method,
            "clock_origin_monotonic_s": t0,
            # the node's wall clock at the same instant: analysis maps request times onto the
            # controller's clock (with the measured offset) to integrate power over them
            "clock_origin_unix_s": time.time() - (time.monotonic() - t0),
        }
        directory = self.config.rank_dir(self.rank)
        self.requests = JsonLinesLog(directory + "/requests.jsonl", header)
        self.tokens = CsvLog(directory + "/tokens.csv", TOKEN_COLUMNS, header)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        for request in self.schedule:
            wait = request.arrival_s - self.now()
            if wait > 0:
                time.sleep(wait)
            self._serve(request)
        mpi_link.send(self.comm, wire.encode(wire.STOP, 0, []), 0, mpi_link.TAG_UP)
        self.requests.close()
        self.tokens.close()

    # -- one request -------------------------------------------------------------------------------
    def _prompt_ids(self, request: ScheduledRequest) -> List[int]:
        if request.prompt_ids:
            return [int(i) for i in request.prompt_ids]
        return self.tokenizer.encode(request.prompt or "")

    def _head(self, ids: List[int], cache) -> torch.Tensor:
        """Device share before the server: token ids for ``centralized``, else embedding + first m layers."""
        if self.centralized:
            return torch.tensor(ids, dtype=torch.int32).view(-1, 1)
        with torch.inference_mode():
            hidden = self.part.embed(torch.tensor(ids, dtype=torch.long))
            return self.part.run_layers(hidden, [CacheSegment(cache, len(ids))])

    def _tail(self, reply: wire.Segment) -> int:
        """Next token from the server's reply: the id itself, or LM head on the deep hidden state."""
        if self.centralized:
            return int(reply.payload[-1, 0])
        with torch.inference_mode():
            logits = self.part.logits(reply.payload[-1:].to(self.part.device))
            return int(torch.argmax(logits[-1]).item())

    def _round_trip(self, segment: wire.Segment) -> Dict[str, Any]:
        frame = wire.encode(wire.DATA, 0, [segment])
        sent_at = self.now()
        mpi_link.send(self.comm, frame, 0, mpi_link.TAG_UP)
        sent_done = self.now()
        reply_frame, _, size = mpi_link.recv(self.comm, source=self.last_stage, tag=mpi_link.TAG_DOWN)
        received = self.now()
        reply = reply_frame.segments[0]
        if reply.request_id != segment.request_id:
            raise RuntimeError("reply for request %d while waiting for %d" % (reply.request_id, segment.request_id))
        return {
            "reply": reply,
            "send_start_s": sent_at,
            "send_end_s": sent_done,
            "received_s": received,
            "up_bytes": len(frame),
            "down_bytes": size,
        }

    def _serve(self, request: ScheduledRequest) -> None:
        ids = self._prompt_ids(request)
        start = self.now()
        cache = self.part.new_cache(len(ids) + request.max_new_tokens) if self.part is not None else None
        t = self.now()
        payload = self._head(ids, cache)
        head_s = self.now() - t
        prompt = wire.Segment(request.request_id, self.rank, wire.PREFILL, 0, len(ids), payload, wire.LAST_CHUNK)
        trip = self._round_trip(prompt)
        reply = trip["reply"]
        t = self.now()
        token = self._tail(reply)
        first_token_s = self.now()
        tail_s = first_token_s - t
        generated = [token]
        stamps = [first_token_s]
        up_bytes, down_bytes = trip["up_bytes"], trip["down_bytes"]
        decode_server_s = decode_network_s = decode_device_s = 0.0
        while len(generated) < request.max_new_tokens and token != self.tokenizer.eos_id:
            t = self.now()
            step = self._head([token], cache)
            segment = wire.Segment(request.request_id, self.rank, wire.DECODE, len(ids) + len(generated) - 1, 1, step)
            step_trip = self._round_trip(segment)
            t2 = self.now()
            token = self._tail(step_trip["reply"])
            stamps.append(self.now())
            generated.append(token)
            residence = step_trip["reply"].server_depart_s - step_trip["reply"].server_arrival_s
            decode_server_s += residence
            decode_network_s += (step_trip["received_s"] - step_trip["send_start_s"]) - residence
            decode_device_s += (step_trip["send_start_s"] - t) + (self.now() - t2)
            up_bytes += step_trip["up_bytes"]
            down_bytes += step_trip["down_bytes"]
        mpi_link.send(
            self.comm,
            wire.encode(wire.DATA, 0, [wire.Segment(request.request_id, self.rank, wire.RELEASE, 0, 0)]),
            0,
            mpi_link.TAG_UP,
        )
        done = self.now()
        self.tokens.write_many(
            [
                {"request_id": request.request_id, "index": i, "token_id": tok, "ts_s": round(ts, 6)}
                for i, (tok, ts) in enumerate(zip(generated, stamps))
            ]
        )
        residence = reply.server_depart_s - reply.server_arrival_s
        round_trip = trip["received_s"] - trip["send_start_s"]
        self.requests.write(
            {
                "request_id": request.request_id,
                "node": self.spec.node,
                "method": self.config.method,
                "prompt_tokens": len(ids),
                "output_tokens": len(generated),
                "max_new_tokens": request.max_new_tokens,
                "finished_by": "eos" if generated[-1] == self.tokenizer.eos_id else "length",
                "arrival_s": round(request.arrival_s, 6),
                "start_s": round(start, 6),
                "upload_start_s": round(trip["send_start_s"], 6),
                "upload_end_s": round(trip["send_end_s"], 6),
                "first_token_s": round(first_token_s, 6),
                "last_token_s": round(stamps[-1], 6),
                "done_s": round(done, 6),
                "ttft_s": round(first_token_s - request.arrival_s, 6),
                "prefill": {
                    "device_head_s": round(head_s, 6),
                    "device_tail_s": round(tail_s, 6),
                    "round_trip_s": round(round_trip, 6),
                    "server_queue_s": round(reply.queue_s, 6),
                    "server_compute_s": round(reply.compute_s, 6),
                    "server_residence_s": round(residence, 6),
                    "network_s": round(round_trip - residence, 6),
                    "server_arrival_monotonic_s": reply.server_arrival_s,
                    "server_depart_monotonic_s": reply.server_depart_s,
                    "upload_bytes": trip["up_bytes"],
                },
                "decode": {
                    "steps": len(generated) - 1,
                    "device_s": round(decode_device_s, 6),
                    "server_residence_s": round(decode_server_s, 6),
                    "network_s": round(decode_network_s, 6),
                },
                "upload_bytes": up_bytes,
                "download_bytes": down_bytes,
                "token_ids": generated,
                "text": self.tokenizer.decode(generated),
            }
        )
