"""Mahimahi link traces imported as our bandwidth traces (``testbed link import-mahimahi``)."""

from __future__ import annotations

import pytest

from foundation.errors import InputError
from netem.mahimahi import MIN_RATE_BIT_S, import_mahimahi
from netem.trace import load_trace
from tests.conftest import run_cli


def write_lines(path, ms_values) -> str:
    path.write_text("".join(f"{ms}\n" for ms in ms_values))
    return str(path)


def test_opportunities_become_rates_per_bin_and_the_shorter_trace_repeats(tmp_path):
    # uplink: 4 packets a millisecond for 1 s (48 mbit), then none until 2 s (the last line, its period)
    up = write_lines(tmp_path / "up", [ms for ms in range(1, 1001) for _ in range(4)] + [2000])
    # downlink: one packet a millisecond, a 500 ms period, repeated four times over the uplink's 2 s
    down = write_lines(tmp_path / "down", range(1, 501))
    imported = import_mahimahi(up, down, bin_s=0.5, delay_ms=15, loss_pct=1)
    steps = imported.trace.steps
    assert [s.t_s for s in steps] == [0, 0.5, 1.0, 1.5]
    # ms 1..499 fall in the first bin, 500..999 in the second, 1000 in the third
    assert [s.up_bit_s for s in steps] == [4 * 499 * 12000 / 0.5, 4 * 500 * 12000 / 0.5, 4 * 12000 / 0.5,
                                           MIN_RATE_BIT_S]  # fmt: skip
    assert imported.empty_bins == 1
    assert all(s.down_bit_s == pytest.approx(12e6, rel=0.01) for s in steps)  # 1 packet/ms = 12 mbit
    assert all(s.delay_s == 0.015 and s.loss_pct == 1 for s in steps)

    out = tmp_path / "trace.csv"
    proc = run_cli("link", "import-mahimahi", up, down, "--out", str(out), "--bin", "0.5", "--delay-ms", "15")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 bins had no delivery opportunity" in proc.stderr
    again = load_trace(out)  # our own loader reads what the import wrote, delay column included
    assert [(s.t_s, round(s.up_bit_s), s.delay_s) for s in again.steps] == [
        (s.t_s, round(s.up_bit_s), 0.015) for s in steps
    ]


def test_bad_mahimahi_lines_are_named_by_file_and_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.trace"
    bad.write_text("1\n2\n1.5\n3\n2\n")
    with pytest.raises(InputError) as caught:
        import_mahimahi(bad, bad)
    text = str(caught.value)
    assert f"{bad}:3" in text and "not a whole number" in text and f"{bad}:5" in text and "comes before" in text
    proc = run_cli("link", "import-mahimahi", str(bad), str(bad), "--out", str(tmp_path / "x.csv"))
    assert proc.returncode == 2 and f"{bad}:3" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.csv").exists()


def test_a_trace_row_with_rate_zero_is_refused_not_dropped(tmp_path):
    trace = tmp_path / "stall.csv"
    trace.write_text("t_s,up_rate,down_rate\n0,1MBps,1MBps\n2,0bit,1MBps\n")
    with pytest.raises(InputError) as caught:
        load_trace(trace)
    assert f"{trace}:3: up_rate" in str(caught.value) and "8kbit" in str(caught.value)
