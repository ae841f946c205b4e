"""Clock offset of a node against the controller, NTP-style over the node's transport.

One long-running echo process answers each request line with the node's wall-clock time; for each
exchange the offset is ``t_node - (t_send + t_receive) / 2`` with an error of at most half the round
trip, and the exchange with the shortest round trip wins (as NTP's clock filter does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from testbed.errors import NodeError
from testbed.transport.base import Transport

_PY_ECHO = "import sys,time\nfor _ in sys.stdin:\n sys.stdout.write('%.6f\\n' % time.time()); sys.stdout.flush()"
_SH_ECHO = "while read -r _; do date +%s.%N; done"


@dataclass(frozen=True)
class ClockOffset:
    """Node clock minus controller clock, with the round trip that bounds its error."""

    offset_s: float
    rtt_s: float
    exchanges: int
    method: str

    @property
    def error_bound_s(self) -> float:
        return self.rtt_s / 2


def measure_clock_offset(
    transport: Transport, *, python: str = "python3", exchanges: int = 8, timeout_s: float = 5.0
) -> ClockOffset:
    """Best of ``exchanges`` round trips; Python's clock if the node has it, else ``date +%s.%N``."""
    errors = []
    for method, argv in (("python", [python, "-u", "-c", _PY_ECHO]), ("date", ["sh", "-c", _SH_ECHO])):
        try:
            return _exchange(transport, argv, method, exchanges, timeout_s)
        except (EOFError, TimeoutError, ValueError, OSError) as exc:
            errors.append(f"{method}: {type(exc).__name__}: {exc}")
    raise NodeError(transport.node, "clock offset not measurable (" + "; ".join(errors) + ")")


def _exchange(transport: Transport, argv: list[str], method: str, exchanges: int, timeout_s: float) -> ClockOffset:
    best: tuple[float, float] | None = None
    with transport.open_line_session(argv) as session:
        session.send_line("warm-up")  # the first answer includes the interpreter's start-up
        float(session.read_line(timeout_s))
        for _ in range(exchanges):
            t_send = time.time()
            session.send_line("t")
            t_node = float(session.read_line(timeout_s))
            t_receive = time.time()
            rtt = t_receive - t_send
            if best is None or rtt < best[1]:
                best = (t_node - (t_send + t_receive) / 2, rtt)
    assert best is not None
    return ClockOffset(best[0], best[1], exchanges, method)
