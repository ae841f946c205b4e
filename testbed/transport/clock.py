"""Clock offset of a node against the controller, NTP-style over the node's transport.

A long-running echo process on the node answers each request line with its wall-clock time. For
each exchange the offset is ``t_node - (t_send + t_receive) / 2``, wrong by at most half the round
trip; the exchange with the shortest round trip wins (as NTP's clock filter does).
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass

from foundation.errors import NodeError
from testbed.transport.base import LineSession, Transport

# The node's Python if it has one (-S -E: no site packages, fast start), else a date loop. Either
# first prints two header lines: the Python version (empty without Python) and the method.
_PY_ECHO = (
    "import sys,time\n"
    "sys.stdout.write('python=Python %d.%d.%d\\nclock=python\\n' % sys.version_info[:3]); sys.stdout.flush()\n"
    "for _ in sys.stdin:\n"
    " sys.stdout.write('%.6f\\n' % time.time()); sys.stdout.flush()\n"
)
# busybox's date has no %N and prints it literally: such replies count in whole seconds.
_SH_ECHO = "echo python=; echo clock=date; while read -r _; do date +%s.%N; done"


def echo_script(python: str) -> str:
    """sh that serves clock exchanges on stdin/stdout after its two header lines."""
    return f"{shlex.quote(python)} -S -E -u -c {shlex.quote(_PY_ECHO)} 2>/dev/null || {{ {_SH_ECHO}; }}"


@dataclass(frozen=True)
class ClockOffset:
    """Node clock minus controller clock, with the round trip that bounds its error."""

    offset_s: float
    rtt_s: float
    exchanges: int
    method: str
    resolution_s: float = 1e-6  # of the node's clock readings

    @property
    def error_bound_s(self) -> float:
        return self.rtt_s / 2 + self.resolution_s / 2


def read_echo_headers(session: LineSession, timeout_s: float) -> dict[str, str]:
    """The echo program's header lines: ``python`` (version or empty) and ``clock`` (method)."""
    headers = {}
    for _ in range(2):
        key, _, value = session.read_line(timeout_s).partition("=")
        headers[key] = value
    return headers


def offset_over(session: LineSession, *, method: str, exchanges: int = 8, timeout_s: float = 5.0) -> ClockOffset:
    """Run ``exchanges`` round trips on an echo session and keep the one with the shortest trip."""
    best: tuple[float, float] | None = None
    resolution_s = 1e-6
    for _ in range(exchanges):
        t_send = time.time()
        session.send_line("t")
        reply = session.read_line(timeout_s)
        t_receive = time.time()
        if reply.endswith(".%N"):  # whole seconds: the true time lies in [t, t + 1)
            t_node, resolution_s = float(reply[:-3]) + 0.5, 1.0
        else:
            t_node = float(reply)
        rtt = t_receive - t_send
        if best is None or rtt < best[1]:
            best = (t_node - (t_send + t_receive) / 2, rtt)
    if best is None:
        raise ValueError("no exchanges")
    return ClockOffset(best[0], best[1], exchanges, method, resolution_s)


def measure_clock_offset(
    transport: Transport, *, python: str = "python3", exchanges: int = 8, timeout_s: float = 5.0
) -> ClockOffset:
    """Best of ``exchanges`` round trips, on the node's Python clock or ``date +%s.%N``."""
    try:
        with transport.open_line_session(["sh", "-c", echo_script(python)]) as session:
            method = read_echo_headers(session, timeout_s)["clock"]
            return offset_over(session, method=method, exchanges=exchanges, timeout_s=timeout_s)
    except (EOFError, TimeoutError, ValueError, KeyError, OSError) as exc:
        raise NodeError(transport.node, f"clock offset not measurable: {type(exc).__name__}: {exc}") from None
