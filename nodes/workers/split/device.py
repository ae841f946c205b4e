"""A device rank: replays its request schedule and stamps every token on its own clock.

For each request in arrival order (one at a time, as one user's device): wait for its arrival
time, run the device's share of the model, send hidden states (or token ids for ``centralized``)
to server stage 0, receive the deep hidden state (or the next token id) from the last stage, run
the LM head, and repeat for every generated token. ``ushape`` and ``usarathi`` send the prompt
whole; ``usarathi`` differs on the server, which chunks it.

A run with ``device_slots`` > 1 gives a device node that many device ranks (slots), each reading
the device's whole schedule: a slot that is free when a request arrives claims it (an exclusive
create of ``claims-<node>/<request id>`` beside the run's ``out/``; the first of several free slots
wins), and a slot that frees up takes the oldest request no slot has claimed. A request waits only
when every slot is busy, as at a server with that many workers.

HAT's methods (``methods/hat.py``) change the device's side:

- ``pc`` (prompt chunking, Sec. 3.3): the prompt goes up in chunks sized by Eq. 3
  (``hat_sizing``), each sent as soon as its shallow states are computed, so the next chunk's
  upload overlaps the server's compute of the previous one. Chunk sizes are logged per request.
- ``sd`` (speculative decoding, Sec. 3.4): rounds of draft, verify, accept and roll back
  (``nodes.inference.speculative``) replace single-token decode steps; tokens of a round are
  delivered together. Drafted and accepted tokens are logged per round.
- ``pd`` (parallel drafting, Sec. 3.5): while the server verifies, lambda_i steps (Eq. 6) of drafts
  from the top-k alternatives to the last draft token; reuse is logged.

Stamps (seconds from the start barrier, this rank's monotonic clock): ``arrival_s`` (scheduled),
``start_s``, ``upload_start_s``/``upload_end_s`` of the prompt, ``first_token_s``, every token's
``ts_s``, ``done_s``. The server's durations (queue, compute, residence) come back in the frame
headers, so ``network_s`` = round trip - server residence is measured without shared clocks.

One concept, a device rank, over ~410 lines.
"""

import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from mpi4py import MPI

from nodes.contracts.records import CsvLog, JsonLinesLog
from nodes.contracts.run_config import RunConfig, ScheduledRequest, load_schedule
from nodes.contracts.speculative_metrics import acceptance_length
from nodes.inference.checkpoint import load_part
from nodes.inference.config import LlamaConfig
from nodes.inference.draft import adapter_dir, load_adapter
from nodes.inference.model import Segment as CacheSegment
from nodes.inference.partition import UShapePartition
from nodes.inference.speculative import SequenceState, SpeculativeDevice, Verifier, speculative_rounds
from nodes.inference.tokenizer import Tokenizer

from .. import mpi_link, wire
from ..pacing import PacedAdapter, PacedPart, pacer_for
from ..part_cache import PartCache
from .hat_sizing import LinkEstimator, MovingAverage, chunk_tokens_eq3, parallel_steps_eq6
from .state_monitor import ServerState

TOKEN_COLUMNS = ("request_id", "index", "token_id", "ts_s")


class DeviceWorker:
    def __init__(self, config: RunConfig, comm: "MPI.Comm", rank: int, parts: Optional[PartCache] = None) -> None:
        self.config, self.comm, self.rank, self.t0 = config, comm, rank, 0.0
        parts = parts if parts is not None else PartCache()
        spec = config.ranks[rank]
        self.spec = spec
        self.schedule = load_schedule(spec.schedule)
        self.tokenizer = Tokenizer(config.model)
        model_config = LlamaConfig.load(config.model)
        self.centralized = config.method_spec.token_ids_only
        self.part = None
        self.speculative: Optional[SpeculativeDevice] = None
        self.pacer = pacer_for(config, rank)
        if not self.centralized:
            partition = UShapePartition.make(model_config.num_hidden_layers, config.device_layers, config.stages)
            layers = tuple(partition.device_layer_ids())
            self.part = parts.get(
                ("part", config.model, layers, True, True, config.dtype, spec.torch_device),
                lambda: load_part(config.model, layers, embedding=True, head=True, dtype=config.dtype,
                                  device=spec.torch_device),
                "device part: embedding, layers %s, head" % (list(layers),),
            )  # fmt: skip
            loaded = self.part
            if self.pacer is not None:  # the target's m layers and head, at the target's speed
                self.part = PacedPart(loaded, self.pacer, config.device_layers, "device")
            if config.uses("sd"):
                where = config.draft.adapter or adapter_dir(config.model)
                adapter = parts.get(
                    ("adapter", where, config.device_layers, str(loaded.dtype), spec.torch_device),
                    lambda: load_adapter(where, model_config, config.device_layers, loaded.dtype, spec.torch_device),
                    "draft adapter %s" % where,
                )
                if self.pacer is not None:
                    adapter = PacedAdapter(adapter, self.pacer)
                self.speculative = SpeculativeDevice(self.part, adapter, config.draft.eta)
            # A of Eq. 3 and Eq. 6: the bytes of one token's hidden state on the wire (the target's)
            real = model_config.hidden_size * torch.empty((), dtype=loaded.dtype).element_size()
            self.bytes_per_token = config.wire_bytes_per_token or real
        self.last_stage = config.stages - 1
        self.link = LinkEstimator()
        self.draft_step_s = MovingAverage()  # one draft step's delay
        # one parallel drafting step (all top-k candidates at once): gamma_i of Eq. 6 once measured, since
        # lambda_i counts those steps, and k candidates in one step cost more than one draft token
        self.parallel_step_s = MovingAverage()
        self.server: Optional[ServerState] = None

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
        if self.pacer is not None:
            self.pacer.start(directory + "/steps.csv", header, t0)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def run(self) -> None:
        claims = self._claims_dir()
        for request in self.schedule:
            claim = None if claims is None else os.path.join(claims, str(request.request_id))
            if claim is not None and os.path.exists(claim):
                continue  # another slot serves it
            wait = request.arrival_s - self.now()
            if wait > 0:
                time.sleep(wait)
            if claim is not None and not _claimed(claim):
                continue
            self._serve(request)
        mpi_link.send(self.comm, wire.encode(wire.STOP, 0, []), 0, mpi_link.TAG_UP)
        self.requests.close()
        self.tokens.close()
        if self.pacer is not None:
            self.pacer.close()

    def _claims_dir(self) -> Optional[str]:
        """Where this device's slots claim requests; None when the device has one slot."""
        node = self.spec.node
        if sum(1 for s in self.config.ranks if s.role == "device" and s.node == node) < 2:
            return None
        directory = os.path.join(os.path.dirname(self.config.out_dir), "claims-" + node)
        os.makedirs(directory, exist_ok=True)
        return directory

    # -- the device's share of the model -----------------------------------------------------------
    def _prompt_ids(self, request: ScheduledRequest) -> List[int]:
        if request.prompt_ids:
            return [int(i) for i in request.prompt_ids]
        return self.tokenizer.encode(request.prompt or "")

    def _head(self, ids: List[int], cache) -> torch.Tensor:
        """Device share before the server: token ids for ``centralized``, else embedding + first m layers
        (through the speculative device when there is one, so that the adapter sees them too)."""
        if self.centralized:
            return torch.tensor(ids, dtype=torch.int32).view(-1, 1)
        with torch.inference_mode():
            if isinstance(cache, SequenceState):
                return self.speculative.shallow(cache, ids)
            hidden = self.part.embed(torch.tensor(ids, dtype=torch.long))
            return self.part.run_layers(hidden, [CacheSegment(cache, len(ids))])

    def _tail(self, reply: wire.Segment) -> int:
        """Next token from the server's reply: the id itself, or LM head on the deep hidden state."""
        if self.centralized:
            return int(reply.payload[-1, 0])
        with torch.inference_mode():
            logits = self.part.logits(reply.payload[-1:].to(self.part.device))
            return int(torch.argmax(logits[-1]).item())

    # -- the link ----------------------------------------------------------------------------------
    def _frame(self, segment: wire.Segment) -> bytearray:
        """The segment as a frame, padded to the target model's bytes when the run emulates one."""
        return wire.encode(wire.DATA, 0, [segment], wire.padding_for([segment], self.config.wire_bytes_per_token))

    def _send(self, segment: wire.Segment) -> Dict[str, Any]:
        frame = self._frame(segment)
        sent_at = self.now()
        mpi_link.send(self.comm, frame, 0, mpi_link.TAG_UP)
        return {"send_start_s": sent_at, "send_end_s": self.now(), "up_bytes": len(frame)}

    def _receive(
        self, request_id: int, trip: Dict[str, Any], measure: bool = True, arrived_s: Optional[float] = None
    ) -> Dict[str, Any]:
        """Wait for the reply to ``trip``; keeps the server's state and measures the link with it
        (``arrived_s``: when the reply was seen waiting, if the device was busy then)."""
        reply_frame, _, size = mpi_link.recv(self.comm, source=self.last_stage, tag=mpi_link.TAG_DOWN)
        received = self.now() if arrived_s is None else arrived_s
        replies = [s for s in reply_frame.segments if s.phase != wire.STATE]
        for s in reply_frame.segments:
            if s.phase == wire.STATE:
                self.server = ServerState(s.payload[0].tolist())
        reply = replies[0]
        if reply.request_id != request_id:
            raise RuntimeError("reply for request %d while waiting for %d" % (reply.request_id, request_id))
        residence = reply.server_depart_s - reply.server_arrival_s
        network_s = (received - trip["send_start_s"]) - residence
        if measure:
            self.link.observe(trip["up_bytes"] + size, network_s)
        return dict(trip, reply=reply, received_s=received, down_bytes=size, residence_s=residence,
                    network_s=network_s)  # fmt: skip

    def _round_trip(self, segment: wire.Segment) -> Dict[str, Any]:
        return self._receive(segment.request_id, self._send(segment))

    def _upload_prompt(self, request: ScheduledRequest, ids: List[int], cache) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Send the prompt (in Eq. 3's chunks for ``pc``) and wait for the first token's reply.

        Returns (the last chunk's round trip, the prefill's device-side record)."""
        chunks: List[int] = []
        head_s = 0.0
        first_send: Optional[float] = None
        prompt_bytes = 0
        outbox = mpi_link.Outbox()
        done = 0
        while done < len(ids):
            if self.config.uses("pc"):
                size = chunk_tokens_eq3(
                    len(ids) - done, self.bytes_per_token, self.link.s_per_byte, self.server, self.config.chunk_tokens
                )
            else:
                size = len(ids)
            t = self.now()
            payload = self._head(ids[done : done + size], cache)
            head_s += self.now() - t
            last = done + size == len(ids)
            segment = wire.Segment(request.request_id, self.rank, wire.PREFILL, done, size, payload,
                                   wire.LAST_CHUNK if last else 0)  # fmt: skip
            frame = self._frame(segment)
            prompt_bytes += len(frame)
            sent_at = self.now()
            first_send = sent_at if first_send is None else first_send
            if last:
                outbox.wait_all()
                mpi_link.send(self.comm, frame, 0, mpi_link.TAG_UP)
                trip = {"send_start_s": sent_at, "send_end_s": self.now(), "up_bytes": len(frame)}
            else:
                outbox.send(self.comm, frame, 0, mpi_link.TAG_UP)  # the next chunk's compute overlaps this upload
            chunks.append(size)
            done += size
        if isinstance(cache, SequenceState):  # the adapter takes in the prompt while the server works
            with torch.inference_mode():
                self.speculative.absorb(cache)
        trip = self._receive(request.request_id, trip, measure=False)
        trip["first_send_s"] = first_send
        # the link, from the whole prompt: every chunk's bytes and the reply's, over the time from the
        # first send to the reply less the server's work on the last chunk (chunks upload back to back)
        assert first_send is not None
        self.link.observe(prompt_bytes + trip["down_bytes"], trip["received_s"] - first_send - trip["residence_s"])
        return trip, {"chunks_tokens": chunks, "device_head_s": head_s}

    # -- one request -------------------------------------------------------------------------------
    def _serve(self, request: ScheduledRequest) -> None:
        ids = self._prompt_ids(request)
        start = self.now()
        capacity = len(ids) + request.max_new_tokens + self.config.draft.max_draft_tokens + 2
        if self.speculative is not None:
            cache = self.speculative.new_state(capacity)
        else:
            cache = self.part.new_cache(capacity) if self.part is not None else None
        trip, prefill = self._upload_prompt(request, ids, cache)
        reply = trip["reply"]
        t = self.now()
        token = self._tail(reply)
        first_token_s = self.now()
        tail_s = first_token_s - t
        generated = [token]
        stamps = [first_token_s]
        totals = {"up_bytes": trip["up_bytes"], "down_bytes": trip["down_bytes"], "server_s": 0.0, "network_s": 0.0,
                  "device_s": 0.0, "steps": 0}  # fmt: skip
        speculative = None
        if self.speculative is not None:
            speculative = self._decode_speculative(request, cache, token, generated, stamps, totals)
        else:
            self._decode(request, cache, len(ids), generated, stamps, totals)
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
        residence = trip["residence_s"]
        round_trip = trip["received_s"] - trip["send_start_s"]
        record = {
            "request_id": request.request_id,
            "node": self.spec.node,
            "method": self.config.method,
            "prompt_tokens": len(ids),
            "output_tokens": len(generated),
            "max_new_tokens": request.max_new_tokens,
            "finished_by": "eos" if generated[-1] == self.tokenizer.eos_id else "length",
            "arrival_s": round(request.arrival_s, 6),
            "start_s": round(start, 6),
            "upload_start_s": round(trip["first_send_s"], 6),
            "upload_end_s": round(trip["send_end_s"], 6),
            "first_token_s": round(first_token_s, 6),
            "last_token_s": round(stamps[-1], 6),
            "done_s": round(done, 6),
            "ttft_s": round(first_token_s - request.arrival_s, 6),
            "prefill": {
                "device_head_s": round(prefill["device_head_s"], 6),
                "device_tail_s": round(tail_s, 6),
                "round_trip_s": round(round_trip, 6),
                "server_queue_s": round(reply.queue_s, 6),
                "server_compute_s": round(reply.compute_s, 6),
                "server_residence_s": round(residence, 6),
                "network_s": round(round_trip - residence, 6),
                "server_arrival_monotonic_s": reply.server_arrival_s,
                "server_depart_monotonic_s": reply.server_depart_s,
                "upload_bytes": trip["up_bytes"],
                "chunks_tokens": prefill["chunks_tokens"],
            },
            "decode": {
                "steps": totals["steps"],
                "device_s": round(totals["device_s"], 6),
                "server_residence_s": round(totals["server_s"], 6),
                "network_s": round(totals["network_s"], 6),
            },
            "upload_bytes": totals["up_bytes"],
            "download_bytes": totals["down_bytes"],
            "token_ids": generated,
            "text": self.tokenizer.decode(generated),
        }
        if speculative is not None:
            record["speculative"] = speculative
        if self.link.s_per_byte is not None:
            record["link_estimate_mbit"] = round(self.link.rate_mbit(), 3)
        self.requests.write(record)

    def _account(self, totals: Dict[str, Any], trip: Dict[str, Any], device_s: float) -> None:
        totals["steps"] += 1
        totals["server_s"] += trip["residence_s"]
        totals["network_s"] += trip["network_s"]
        totals["device_s"] += device_s
        totals["up_bytes"] += trip["up_bytes"]
        totals["down_bytes"] += trip["down_bytes"]

    def _decode(self, request, cache, prompt_tokens, generated, stamps, totals) -> None:
        """One token per round trip (every method without ``sd``)."""
        token = generated[-1]
        while len(generated) < request.max_new_tokens and token != self.tokenizer.eos_id:
            t = self.now()
            step = self._head([token], cache)
            segment = wire.Segment(request.request_id, self.rank, wire.DECODE, prompt_tokens + len(generated) - 1, 1,
                                   step)  # fmt: skip
            trip = self._round_trip(segment)
            t2 = self.now()
            token = self._tail(trip["reply"])
            stamps.append(self.now())
            generated.append(token)
            self._account(totals, trip, (trip["send_start_s"] - t) + (self.now() - t2))

    def _decode_speculative(self, request, state, first, generated, stamps, totals) -> Dict[str, Any]:
        """HAT's rounds (Sec. 3.4, with parallel drafting of Sec. 3.5 for ``pd``); returns their log."""
        verifier = _MpiVerifier(self, request.request_id)
        parallel = self.config.uses("pd")

        def branch_steps(drafted: int) -> int:
            step_s = self.parallel_step_s.value or self.draft_step_s.value
            steps = parallel_steps_eq6(drafted + 1, self.bytes_per_token, self.link.s_per_byte, self.server,
                                       step_s, self.config.draft.max_parallel_steps)  # fmt: skip
            verifier.planned_steps = steps
            return steps

        rounds = []
        round_start = self.now()
        for draft, verdict, branches in speculative_rounds(
            self.speculative, verifier, state, first, request.max_new_tokens, self.tokenizer.eos_id,
            self.config.draft.max_draft_tokens, self.config.draft.top_k if parallel else 0, branch_steps,
        ):  # fmt: skip
            now = self.now()
            generated.extend(verdict.emitted)
            stamps.extend([now] * len(verdict.emitted))
            trip = verifier.trip
            drafting_s = trip["send_start_s"] - round_start
            if draft.tokens and not draft.reused:
                self.draft_step_s.update(drafting_s / len(draft.tokens))
            polls = verifier.polls  # one before each parallel step: the gaps are the steps' delays
            if branches and len(polls) >= 2:
                self.parallel_step_s.update((polls[-1] - polls[0]) / (len(polls) - 1))
            self._account(totals, trip, drafting_s + (now - trip["received_s"]))
            rounds.append({
                "drafted": len(draft.tokens), "accepted": verdict.accepted, "reused": draft.reused,
                "lambda": verifier.planned_steps if branches else 0,
                "branch_steps": len(branches[0].tokens) if branches else 0,
                "adopted": verdict.reused_branch is not None,
            })  # fmt: skip
            verifier.planned_steps = 0
            round_start = now
        accepted = sum(r["accepted"] for r in rounds)
        with_branches = [r for r in rounds if r["branch_steps"]]
        return {
            "rounds": len(rounds),
            "drafted": sum(r["drafted"] for r in rounds),
            "accepted": accepted,
            "acceptance_length": _rounded(acceptance_length(accepted, len(rounds))),
            "parallel_rounds": len(with_branches),
            "reused": sum(1 for r in rounds if r["reused"]),
            "reuse_rate": round(sum(1 for r in rounds if r["adopted"]) / len(with_branches), 4) if with_branches
            else None,
            "per_round": [[r["drafted"], r["accepted"], int(r["reused"]), r["lambda"], r["branch_steps"]]
                          for r in rounds],
        }  # fmt: skip


class _MpiVerifier(Verifier):
    """Verification by the server: a VERIFY segment up, every position's deep state down."""

    def __init__(self, worker: DeviceWorker, request_id: int) -> None:
        self.worker, self.request_id = worker, request_id
        self.trip: Dict[str, Any] = {}
        self.planned_steps = 0
        self.arrived_s: Optional[float] = None
        self.polls: List[float] = []

    def submit(self, shallow: torch.Tensor, start: int) -> None:
        segment = wire.Segment(self.request_id, self.worker.rank, wire.VERIFY, start, shallow.shape[0], shallow)
        self.trip = self.worker._send(segment)
        self.arrived_s: Optional[float] = None
        self.polls: List[float] = []

    def replied(self) -> bool:
        self.polls.append(self.worker.now())
        if self.arrived_s is None and self.worker.comm.Iprobe(source=self.worker.last_stage, tag=mpi_link.TAG_DOWN):
            self.arrived_s = self.worker.now()
        return self.arrived_s is not None

    def result(self) -> torch.Tensor:
        # a reply that came while the device drafted in parallel, unseen, has no arrival time to measure with
        waited_unseen = (
            self.planned_steps > 0
            and self.arrived_s is None
            and self.worker.comm.Iprobe(source=self.worker.last_stage, tag=mpi_link.TAG_DOWN)
        )
        self.trip = self.worker._receive(self.request_id, self.trip, not waited_unseen, self.arrived_s)
        return self.trip["reply"].payload


def _claimed(path: str) -> bool:
    """Claim a request for this slot (an exclusive create): False when another slot has it."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def _rounded(value: Optional[float], digits: int = 4) -> Optional[float]:
    return None if value is None else round(value, digits)
