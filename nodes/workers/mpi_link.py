"""Frames over MPI: raw bytes (``MPI.BYTE``) with the uppercase, buffer-based calls.

Sizes vary per message, so a receiver probes first, then receives into a buffer of the probed
size. Tags separate the three directions so that a rank can wait on the one it needs.
"""

import time
from typing import List, Optional, Tuple

from mpi4py import MPI

from . import wire

TAG_UP = 11  # device -> stage 0
TAG_PIPE = 12  # stage k -> stage k + 1
TAG_DOWN = 13  # last stage -> device
POLL_INTERVAL_S = 0.0005  # added latency per wait: at most this


def send(comm: "MPI.Comm", frame: bytearray, dest: int, tag: int) -> None:
    comm.Send([frame, MPI.BYTE], dest=dest, tag=tag)


def isend(comm: "MPI.Comm", frame: bytearray, dest: int, tag: int) -> "MPI.Request":
    """Non-blocking send; the caller keeps ``frame`` alive until the request completes."""
    return comm.Isend([frame, MPI.BYTE], dest=dest, tag=tag)


def recv(
    comm: "MPI.Comm", source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG, poll_interval_s: float = POLL_INTERVAL_S
) -> Tuple[wire.Frame, int, int]:
    """Wait for a frame; returns (frame, source rank, bytes).

    MPICH's blocking Probe spins on a core. A rank waiting for its peer (a device waiting for the
    server, a stage waiting for the previous one) would then burn the CPU quota it shares with the
    rank doing the work, and inflate the energy measured on a board that should be idle. So waiting
    polls with Iprobe and sleeps ``poll_interval_s`` in between (0 spins as MPI would).
    """
    status = MPI.Status()
    if poll_interval_s > 0:
        while not comm.Iprobe(source=source, tag=tag, status=status):
            time.sleep(poll_interval_s)
    else:
        comm.Probe(source=source, tag=tag, status=status)
    size = status.Get_count(MPI.BYTE)
    buffer = bytearray(size)
    comm.Recv([buffer, MPI.BYTE], source=status.Get_source(), tag=status.Get_tag())
    return wire.decode(buffer), status.Get_source(), size


def poll(
    comm: "MPI.Comm", source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG
) -> Optional[Tuple[wire.Frame, int, int]]:
    """A frame if one is waiting, else None (never blocks)."""
    status = MPI.Status()
    if not comm.Iprobe(source=source, tag=tag, status=status):
        return None
    return recv(comm, status.Get_source(), status.Get_tag())


class Outbox:
    """Non-blocking sends whose buffers stay referenced until they complete."""

    def __init__(self) -> None:
        self._pending: List[Tuple["MPI.Request", bytearray]] = []

    def send(self, comm: "MPI.Comm", frame: bytearray, dest: int, tag: int) -> None:
        self._pending.append((isend(comm, frame, dest, tag), frame))
        self._pending = [(r, f) for r, f in self._pending if not r.Test()]

    def wait_all(self) -> None:
        for request, _ in self._pending:
            request.Wait()
        self._pending = []
