import pytest
from hypothesis import given
from hypothesis import strategies as st

from foundation import units
from foundation.units import UnitError

RATE_FACTORS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "KBps": 8e3,
    "MBps": 8e6,
    "GBps": 8e9,
    "kibit": 1024,
    "MiBps": 8 * 1024**2,
}
DURATION_FACTORS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
numbers = st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False, allow_infinity=False)


@given(numbers, st.sampled_from(sorted(RATE_FACTORS)))
def test_rate_is_value_times_unit(number, unit):
    text = f"{number}{unit}"
    assert units.parse_rate_bit_s(text) == pytest.approx(float(number) * RATE_FACTORS[unit])


@given(numbers, st.sampled_from(sorted(DURATION_FACTORS)))
def test_duration_is_value_times_unit(number, unit):
    assert units.parse_duration_s(f"{number}{unit}") == pytest.approx(float(number) * DURATION_FACTORS[unit])


@given(st.decimals(min_value=0, max_value=100, places=3))
def test_percent_up_to_100(number):
    assert units.parse_percent(f"{number}%") == pytest.approx(float(number))


@given(st.decimals(min_value="100.001", max_value=10**6, places=3))
def test_percent_over_100_refused(number):
    with pytest.raises(UnitError, match="more than 100%"):
        units.parse_percent(f"{number}%")


@given(numbers, st.sampled_from(["bps", "kbps", "mbps", "Mbps", "gbps", "Gbps"]))
def test_ambiguous_rate_units_refused_with_both_spellings_offered(number, unit):
    with pytest.raises(UnitError) as info:
        units.parse_rate_bit_s(f"{number}{unit}")
    assert "ambiguous" in info.value.problem
    assert "mbit" in info.value.hint and "MBps" in info.value.hint


@given(numbers, st.sampled_from(sorted(RATE_FACTORS)), st.sampled_from([" ", "\t", "  "]))
def test_whitespace_between_number_and_unit_refused(number, unit, space):
    with pytest.raises(UnitError, match="whitespace"):
        units.parse_rate_bit_s(f"{number}{space}{unit}")


@given(st.one_of(st.integers(min_value=0, max_value=10**9), st.floats(min_value=0, max_value=1e9)))
def test_bare_numbers_have_no_unit(value):
    for parse in (units.parse_rate_bit_s, units.parse_duration_s, units.parse_percent):
        with pytest.raises(UnitError, match="no unit"):
            parse(value)
        with pytest.raises(UnitError, match="no unit"):
            parse(str(int(value)))


@pytest.mark.parametrize("text", ["10 mbps", "fast", "-5ms", "5 ms", "1e400mbit", "10mbit/s", "", "5sec"])
def test_malformed_quantities_refused(text):
    with pytest.raises(UnitError):
        units.parse_rate_bit_s(text) if "bit" in text or "bps" in text else units.parse_duration_s(text)


@pytest.mark.parametrize(("bit_s", "text"), [(40e6, "40mbit"), (1.5e9, "1.5gbit"), (64e3, "64kbit"), (800, "800bit")])
def test_format_rate_round_trips(bit_s, text):
    assert units.format_rate(bit_s) == text
    assert units.parse_rate_bit_s(text) == pytest.approx(bit_s)

