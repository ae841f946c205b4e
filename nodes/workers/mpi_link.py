"""Frames over MPI: raw bytes (``MPI.BYTE``) with the uppercase, buffer-based calls.

Sizes vary per message, so a receiver probes first, then receives into a buffer of the probed
size. Tags separate the three directions so that a rank can wait on the one it needs.

No call here blocks inside MPI. MPICH's blocking calls (Probe, Recv, Send, Wait, Barrier) spin on a
core until they complete, and a rank waits a lot: a device for the server's reply, for its upload to
cross a shaped link, or at the end barrier for the last device of the run; a stage for the previous
one. Spinning ranks would take the CPU from the ranks doing the work (on the emulated 30-board lab,
devices done with their requests spun at the end barrier and took most of the 2 cores) and inflate
the energy measured on a board that should be idle. So every wait polls a non-blocking call and
sleeps in between (:func:`_poll_until`).
"""

import os
import sys
import time
from typing import Any, Callable, List, Optional, Tuple

from mpi4py import MPI

from nodes.contracts.durable import write_atomic
from nodes.contracts.rank_dirs import abort_reason_file

from . import wire

TAG_UP = 11  # device -> stage 0
TAG_PIPE = 12  # stage k -> stage k + 1
TAG_DOWN = 13  # last stage -> device
POLL_INTERVAL_S = 0.0005  # the most a wait adds to what it waits for, in the target's time
POLL_BACKOFF_SHARE = 1 / 16  # a wait that has lasted t polls at most t x this apart...
_max_poll_interval_s = POLL_INTERVAL_S  # ...and at most this apart (POLL_INTERVAL_S x dilation)
ABORT_GRACE_S = 0.5  # how long a rank lets mpiexec forward its last words before MPI_Abort


def set_time_dilation(dilation: float) -> None:
    """Let a wait poll up to ``POLL_INTERVAL_S`` x ``dilation`` apart. A dilated run stretches
    everything modeled by ``dilation``, so the latency a wait adds stays within ``POLL_INTERVAL_S`` of
    the target's time while the polls (tens of microseconds of CPU each) become ``dilation`` times
    rarer: on a lab of tens of ranks sharing a few cores that CPU is what the paced steps need."""
    global _max_poll_interval_s
    _max_poll_interval_s = POLL_INTERVAL_S * max(1.0, float(dilation))


def _poll_until(done: Callable[[], bool], deadline: Optional[float] = None) -> None:
    """Call ``done`` until it returns True (or the monotonic clock reaches ``deadline``), sleeping in
    between: ``POLL_INTERVAL_S`` at first, then up to ``POLL_BACKOFF_SHARE`` of the time waited so far,
    capped by :func:`set_time_dilation`; a sleep never passes the deadline."""
    if done():
        return
    started = time.monotonic()
    while True:
        now = time.monotonic()
        nap = min(_max_poll_interval_s, max(POLL_INTERVAL_S, (now - started) * POLL_BACKOFF_SHARE))
        if deadline is not None:
            if now >= deadline:
                return
            nap = min(nap, deadline - now)
        time.sleep(nap)
        if done():
            return


def wait(request: "MPI.Request") -> None:
    """Wait for a non-blocking operation without spinning."""
    _poll_until(request.Test)


def barrier(comm: "MPI.Comm") -> None:
    """Meet every rank of ``comm`` without spinning (``Ibarrier``, polled)."""
    wait(comm.Ibarrier())


def say_why(rank: int, message: str, run_dir: str) -> None:
    """Say why ``rank`` is ending the launch: in ``run_dir``, where the controller reads it
    (:func:`nodes.contracts.rank_dirs.abort_reason_file`), and on stderr."""
    text = message if message.endswith("\n") else message + "\n"
    try:
        write_atomic(os.path.join(run_dir, abort_reason_file(rank)), text)
    except (OSError, ValueError) as exc:  # the reason still goes to stderr
        text += "rank %d: could not store this in %s: %s\n" % (rank, run_dir, exc)
    sys.stderr.write(text)
    sys.stderr.flush()


def abort(comm: "MPI.Comm", code: int, message: str, run_dir: str) -> None:
    """End every rank of ``comm`` with exit status ``code``, saying why first (:func:`say_why`).
    Hydra's mpiexec can end on the abort before it has forwarded what the rank wrote just before, so
    the file is what counts, and the rank waits ``ABORT_GRACE_S`` to give stderr its chance too."""
    try:
        say_why(comm.Get_rank(), message, run_dir)
        time.sleep(ABORT_GRACE_S)
    finally:  # whatever saying why did, the launch ends
        comm.Abort(code)


def send(comm: "MPI.Comm", frame: bytearray, dest: int, tag: int) -> None:
    """Send and wait until ``frame`` may be reused (over a shaped link: until most of it has crossed)."""
    wait(isend(comm, frame, dest, tag))


def isend(comm: "MPI.Comm", frame: bytearray, dest: int, tag: int) -> "MPI.Request":
    """Non-blocking send; the caller keeps ``frame`` alive until the request completes."""
    return comm.Isend([frame, MPI.BYTE], dest=dest, tag=tag)


def recv(comm: "MPI.Comm", source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> Tuple[wire.Frame, int, int]:
    """Wait for a frame; returns (frame, source rank, bytes)."""
    buffer, source, size = recv_bytes(comm, source, tag)
    return wire.decode(buffer), source, size


def recv_bytes(comm: "MPI.Comm", source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> Tuple[bytearray, int, int]:
    """Wait for a message of any format; returns (its bytes, source rank, size)."""
    status = MPI.Status()
    return _receive(_matched(comm, source, tag, status), status)


def recv_object(comm: "MPI.Comm", source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> Tuple[Any, int]:
    """Wait for a Python object sent with ``comm.send`` (a URL, a rank's "done"): its pickle received as
    bytes, unpickled as mpi4py does; returns (object, source rank). A rank that waits for its peers this
    way all through a run leaves its node's CPU quota to the threads doing the run's work."""
    buffer, source, _ = recv_bytes(comm, source, tag)
    return MPI.pickle.loads(buffer), source


def _matched(comm: "MPI.Comm", source: int, tag: int, status: "MPI.Status") -> "MPI.Message":
    """Poll until a message from ``source`` with ``tag`` is there, and match it (no other receive can take
    it then); ``status`` tells its source and size."""
    matched: List["MPI.Message"] = []

    def probed() -> bool:
        message = comm.Improbe(source=source, tag=tag, status=status)
        if message is not None:
            matched.append(message)
        return message is not None

    _poll_until(probed)
    return matched[0]


def _receive(message: "MPI.Message", status: "MPI.Status") -> Tuple[bytearray, int, int]:
    """Receive a matched message into a buffer of its size (a large one streams in while we sleep)."""
    size = status.Get_count(MPI.BYTE)
    buffer = bytearray(size)
    wait(message.Irecv([buffer, MPI.BYTE]))
    return buffer, status.Get_source(), size


class Outbox:
    """Non-blocking sends whose buffers stay referenced until they complete."""

    def __init__(self) -> None:
        self._pending: List[Tuple["MPI.Request", bytearray]] = []

    def send(self, comm: "MPI.Comm", frame: bytearray, dest: int, tag: int) -> None:
        self._pending.append((isend(comm, frame, dest, tag), frame))
        self._pending = [(r, f) for r, f in self._pending if not r.Test()]

    def wait_all(self) -> None:
        for request, _ in self._pending:
            wait(request)
        self._pending = []


class Inbox:
    """Frames with one tag from any sender, received side by side: a large frame streaming in over
    one sender's link does not hold back the frames of the others (stage 0 receives every device's
    upload at once, as a server with a connection per device would)."""

    def __init__(self, comm: "MPI.Comm", tag: int) -> None:
        self._comm = comm
        self._tag = tag
        self._incoming: List[Tuple["MPI.Request", bytearray, int]] = []  # in the order they were matched

    def _match_new(self) -> None:
        status = MPI.Status()
        while True:
            message = self._comm.Improbe(source=MPI.ANY_SOURCE, tag=self._tag, status=status)
            if message is None:
                return
            buffer = bytearray(status.Get_count(MPI.BYTE))
            self._incoming.append((message.Irecv([buffer, MPI.BYTE]), buffer, status.Get_source()))

    def take(self) -> List[Tuple[wire.Frame, int, int]]:
        """The frames that have arrived whole, as (frame, source rank, bytes); never waits. A sender's
        frames come out in the order it sent them."""
        self._match_new()
        done: List[Tuple[wire.Frame, int, int]] = []
        left: List[Tuple["MPI.Request", bytearray, int]] = []
        held_back = set()  # senders with an earlier frame still arriving
        for request, buffer, source in self._incoming:
            if source not in held_back and request.Test():
                done.append((wire.decode(buffer), source, len(buffer)))
            else:
                held_back.add(source)
                left.append((request, buffer, source))
        self._incoming = left
        return done

    def wait(self, deadline: Optional[float] = None) -> List[Tuple[wire.Frame, int, int]]:
        """At least one whole frame (sleeping between polls), and any others that have arrived; or
        nothing, once the monotonic clock reaches ``deadline``."""
        got: List[Tuple[wire.Frame, int, int]] = []
        _poll_until(lambda: bool(got.extend(self.take()) or got), deadline)
        return got
