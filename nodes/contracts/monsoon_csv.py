"""The CSV a Monsoon power monitor's Python API writes (PyMonsoon's ``sampleEngine.enableCSVOutput``):
a header line naming the enabled channels, then one line per sample, every field followed by a comma::

    Time(ms),Main(mA),Main Voltage(V),
    0.5312199592590332,215.83,4.0000,

The time column is seconds since sampling started, despite its name (the engine stamps each USB packet
with ``time.time() - start``; the samples of one packet share it). Channels, in the engine's order:
``Time(ms)``, ``Main(mA)``, ``USB(mA)``, ``Aux(mA)``, ``Main Voltage(V)``, ``USB Voltage(V)``; only the
enabled ones are written. The controller and the node's meter source both read and write it here, so a
stand-in meter writes exactly what the hardware's logger writes.
"""

from typing import List, NamedTuple, Optional

TIME = "Time(ms)"
CHANNELS = {"main": ("Main(mA)", "Main Voltage(V)"), "usb": ("USB(mA)", "USB Voltage(V)")}
ENGINE_ORDER = (TIME, "Main(mA)", "USB(mA)", "Aux(mA)", "Main Voltage(V)", "USB Voltage(V)")


class MeterSample(NamedTuple):
    t_s: float  # since sampling started
    current_ma: float
    voltage_v: float

    @property
    def power_mw(self) -> float:
        return self.current_ma * self.voltage_v


def header(channel: str) -> str:
    """The header line of a file with ``channel``'s current and voltage enabled (engine order)."""
    wanted = (TIME,) + CHANNELS[channel]
    return "".join(name + "," for name in ENGINE_ORDER if name in wanted)


def line(sample: MeterSample) -> str:
    """One sample's line, as the engine writes it (its values with ``repr``, each followed by a comma)."""
    return "%r,%r,%r," % (float(sample.t_s), float(sample.current_ma), float(sample.voltage_v))


def columns(header_line: str, channel: str) -> List[str]:
    """The column names of a file's header line; ValueError when ``channel``'s are not among them."""
    names = _fields(header_line)
    missing = [n for n in (TIME,) + CHANNELS[channel] if n not in names]
    if missing:
        raise ValueError("not a Monsoon CSV with the %s channel: its header %r lacks %s"
                         % (channel, header_line, ", ".join(missing)))
    return names


def sample(text_line: str, names: List[str], channel: str) -> Optional[MeterSample]:
    """One line's sample of ``channel`` (None: not a complete line of numbers)."""
    fields = _fields(text_line)
    if len(fields) != len(names):
        return None
    current, voltage = CHANNELS[channel]
    try:
        return MeterSample(float(fields[names.index(TIME)]), float(fields[names.index(current)]),
                           float(fields[names.index(voltage)]))
    except ValueError:
        return None


def parse(text: str, channel: str) -> List[MeterSample]:
    """The samples of ``channel`` in a file's ``text`` (header first). A last line without its newline
    (still being written) and lines that are not numbers are skipped. ValueError: no header, or the
    channel is not in it."""
    complete = text.split("\n")[:-1]
    if not complete:
        raise ValueError("not a Monsoon CSV: no header line")
    names = columns(complete[0], channel)
    found = (sample(text_line, names, channel) for text_line in complete[1:])
    return [s for s in found if s is not None]


def _fields(text_line: str) -> List[str]:
    fields = [f.strip() for f in text_line.rstrip("\r").split(",")]
    return fields[:-1] if fields and fields[-1] == "" else fields
