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
        measure_clock_offset(Broken("odd-node"), timeout_s=60.0)
    assert time.monotonic() - started < 60.0  # it ended at the nonsense, not at the reply timeout


def test_one_alignment_corrects_offset_and_drift_for_samples_and_requests():
    """A node 2 s ahead at t=1000 and 2.010 s ahead at t=1100 (100 ppm of drift): an instant the node
    stamps at 1052 (its clock) is 1052 - (2 + 1e-4 * (1052 - 2 - 1000)) = 1049.995 on the controller's."""
    import pandas as pd

    from analysis.load import _aligned_requests
    from foundation.clock_alignment import ClockAlignment
    from testbed.energy.telemetry import alignment_of
    from testbed.transport.clock import ClockOffset

    alignment = ClockAlignment(1000.0, 2.0, 1100.0, 2.010)
    assert alignment.drift_ppm == pytest.approx(100.0)
    assert alignment.to_controller(1052.0) == pytest.approx(1049.995)
    assert ClockAlignment.constant(2.0).to_controller(1052.0) == pytest.approx(1050.0)
    # telemetry: the sampler's rows
    start, end = (1000.0, ClockOffset(2.0, 0.001, 8, "python")), (1100.0, ClockOffset(2.010, 0.001, 8, "python"))
    assert alignment_of(start, end) == alignment
    # requests: the device's wall clock at the start barrier plus seconds since it, from the manifest's offsets
    manifest = {"clock_offsets": {"orin": {"start": {"offset_s": 2.0}, "end": {"offset_s": 2.010},
                                           "start_unix_s": 1000.0, "end_unix_s": 1100.0}}}  # fmt: skip
    frame = pd.DataFrame({"node": ["orin"], "clock_origin_unix_s": [1050.0], "arrival_s": [0.5],
                          "first_token_s": [2.0], "last_token_s": [4.0]})  # fmt: skip
    aligned = _aligned_requests(frame, manifest)
    assert aligned["first_token_ts_s"].iloc[0] == pytest.approx(1049.995)
    assert aligned["arrival_ts_s"].iloc[0] == pytest.approx(alignment.to_controller(1050.5))
    # an older manifest without the measurement times: the start offset alone
    old = {"clock_offsets": {"orin": {"start": {"offset_s": 2.0}, "end": {"offset_s": 2.010}}}}
    assert _aligned_requests(frame.copy(), old)["first_token_ts_s"].iloc[0] == pytest.approx(1050.0)
