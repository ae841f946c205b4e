"""The Monsoon power monitor's CSV as its Python API writes it (nodes.contracts.monsoon_csv): header and
fields each followed by a comma, the enabled channels in the engine's order, the time column in seconds
since sampling began whatever its name says."""

from __future__ import annotations

import pytest

from nodes.contracts import monsoon_csv

# as PyMonsoon's SampleEngine writes with every channel enabled: repr() of each value, a comma after each
ALL_CHANNELS = (
    "Time(ms),Main(mA),USB(mA),Aux(mA),Main Voltage(V),USB Voltage(V),\n"
    "0.0160529613494873,212.5,0.31,0.0,4.19921875,5.0,\n"
    "0.0160529613494873,219.25,0.29,0.0,4.19921875,5.0,\n"
    "0.0321059226989746,1503.0,0.33,0.0,4.1953125,4.99,\n"
    "0.0481"  # still being written
)


def test_each_channel_is_read_by_its_header_names_and_a_line_being_written_waits():
    main = monsoon_csv.parse(ALL_CHANNELS, "main")
    assert [s.current_ma for s in main] == [212.5, 219.25, 1503.0]
    assert main[0].t_s == pytest.approx(0.0160529613) and main[-1].power_mw == pytest.approx(1503.0 * 4.1953125)
    assert [s.voltage_v for s in monsoon_csv.parse(ALL_CHANNELS, "usb")] == [5.0, 5.0, 4.99]


def test_what_the_stand_in_writes_is_what_the_reader_reads():
    samples = [monsoon_csv.MeterSample(0.02 * i, 100.0 + i, 3.9) for i in range(5)]
    text = monsoon_csv.header("main") + "\n" + "".join(monsoon_csv.line(s) + "\n" for s in samples)
    assert text.startswith("Time(ms),Main(mA),Main Voltage(V),\n")
    assert monsoon_csv.parse(text, "main") == samples


def test_a_file_without_the_channel_or_a_header_is_refused():
    with pytest.raises(ValueError, match="lacks USB"):
        monsoon_csv.parse("Time(ms),Main(mA),Main Voltage(V),\n0.1,2,3,\n", "usb")
    with pytest.raises(ValueError, match="no header"):
        monsoon_csv.parse("", "main")
