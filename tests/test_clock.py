"""Clock offsets measured over real line sessions."""

from __future__ import annotations

import sys
import time

import pytest

from foundation.errors import NodeError
from testbed.transport import LocalTransport
from testbed.transport.clock import measure_clock_offset, offset_over


def test_same_clock_has_offset_within_its_error_bound():
    for python, method in ((sys.executable, "python"), ("/nonexistent/python", "date")):
        clock = measure_clock_offset(LocalTransport(), python=python)
        assert clock.method == method and clock.exchanges == 8
        assert abs(clock.offset_s) <= clock.error_bound_s + 0.002


def test_a_node_clock_ahead_by_two_seconds_is_measured():
    transport = LocalTransport()
    script = "while read -r _; do python3 -c 'import time; print(time.time() + 2.0)'; done"
    with transport.open_line_session(["sh", "-c", script]) as session:
        clock = offset_over(session, method="skewed", exchanges=4)
    assert clock.offset_s == pytest.approx(2.0, abs=clock.error_bound_s + 0.005)


def test_busybox_date_without_nanoseconds_counts_whole_seconds():
    # busybox's `date +%s.%N` prints the %N literally; such a node is read to the second.
    with LocalTransport().open_line_session(["sh", "-c", 'while read -r _; do echo "$(date +%s).%N"; done']) as s:
        clock = offset_over(s, method="date", exchanges=3)
    assert clock.resolution_s == 1.0 and clock.error_bound_s >= 0.5
    assert abs(clock.offset_s) <= clock.error_bound_s


def test_a_node_that_answers_nonsense_is_an_error_naming_the_node():
    class Broken(LocalTransport):
        def open_line_session(self, argv):
            return super().open_line_session(["sh", "-c", "echo python=; echo clock=date; read -r _; echo soon"])

    started = time.monotonic()
    with pytest.raises(NodeError, match="clock offset not measurable"):
        measure_clock_offset(Broken("odd-node"))
    assert time.monotonic() - started < 5
