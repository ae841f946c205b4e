"""A Monsoon power monitor inline with a node's supply (how labs measure phones: the battery replaced by
the monitor's output), read on the host its USB is plugged into.

The monitor's logger writes its own CSV (:mod:`nodes.contracts.monsoon_csv`) to ``--meter-log``: PyMonsoon's
``SampleEngine`` on a real HVPM (the ``monsoon`` package on the host), or, where the measured node is an
emulated phone (its adb answers as a stand-in), a stand-in that reads the phone's modeled battery over adb
and writes the same lines. This source reads that file as it grows and gives each interval the mean of
its samples: ``board_power_mw`` (a supply meter sees the whole device, so energy is computed from it),
the current and the voltage, labelled ``modeled`` for the stand-in.
"""

import os
import tempfile
import threading
import time
from typing import Callable, Iterator, List, Optional

from nodes.android.adb import adb_shell
from nodes.android.battery import STANDIN_PROPERTY
from nodes.contracts import monsoon_csv
from nodes.contracts.telemetry_rows import MEASURED, MODELED, TelemetryRow
from nodes.telemetry.source import Source, SourceOptions

STAND_IN_INTERVAL_S = 0.02  # the stand-in's samples (the HVPM samples at 5 kHz; a tenth of them kept: 500 Hz)
HARDWARE_GRANULARITY = 10
MAX_READ_BYTES = 1 << 20  # a batch reads at most this much of the log, so a long backlog never stalls a batch


class MonsoonSource(Source):
    name = "monsoon"

    def __init__(self, options: SourceOptions) -> None:
        super(MonsoonSource, self).__init__()
        self.channel, self.vout_v, self.interval_s = options.meter_channel, options.meter_vout_v, options.interval_s
        self.serial, self.adb = options.serial, options.adb
        if options.meter_log:
            self.path = options.meter_log
        else:  # a probe: a scratch log of its own
            handle, self.path = tempfile.mkstemp(suffix=".monsoon.csv")
            os.close(handle)
        answer = adb_shell(self.adb, self.serial, "getprop " + STANDIN_PROPERTY) if self.serial else ""
        self.stand_in = answer.strip() == "1"
        self.kind = MODELED if self.stand_in else MEASURED
        self.header = {"meter": "stand-in: the emulated phone's modeled battery" if self.stand_in
                       else "Monsoon HVPM (PyMonsoon SampleEngine)", "meter_log": self.path,
                       "channel": self.channel, "vout_v": self.vout_v, "power_kind": self.kind}  # fmt: skip
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self.start_unix_s = time.time()
        logger = self._stand_in_log if self.stand_in else self._hardware_log
        self._logger = threading.Thread(target=self._guarded, args=(logger,), name="monsoon-logger")
        self._logger.daemon = True
        self._logger.start()

    def _guarded(self, logger: Callable[[], None]) -> None:
        try:
            logger()
        except Exception as exc:  # reported by batches(), in the sampler's own thread
            self.error = "%s: %s" % (type(exc).__name__, exc)

    def _stand_in_log(self) -> None:
        from nodes.telemetry.battery import BatterySource

        battery = BatterySource(str(self.serial), STAND_IN_INTERVAL_S, adb=self.adb)
        try:
            with open(self.path, "w") as out:
                out.write(monsoon_csv.header(self.channel) + "\n")
                out.flush()
                for batch in battery.batches(STAND_IN_INTERVAL_S, self._stop.is_set):
                    for row in batch:
                        if row.metric == "power_mw":
                            sample = monsoon_csv.MeterSample(time.time() - self.start_unix_s, row.value / self.vout_v,
                                                             self.vout_v)  # fmt: skip
                            out.write(monsoon_csv.line(sample) + "\n")
                    out.flush()
        finally:
            battery.close()

    def _hardware_log(self) -> None:
        try:
            import Monsoon.HVPM as HVPM
            import Monsoon.sampleEngine as sampleEngine
        except ImportError:
            raise RuntimeError("no Monsoon package on this host: pip install monsoon (PyMonsoon), and plug the "
                               "HVPM's USB into it") from None  # fmt: skip
        monitor = HVPM.Monsoon()
        monitor.setup_usb()
        monitor.setVout(self.vout_v)
        engine = sampleEngine.SampleEngine(monitor)
        engine.ConsoleOutput(False)
        main = self.channel == "main"
        for channel, wanted in ((sampleEngine.channels.MainCurrent, main), (sampleEngine.channels.MainVoltage, main),
                                (sampleEngine.channels.USBCurrent, not main),
                                (sampleEngine.channels.USBVoltage, not main)):  # fmt: skip
            (engine.enableChannel if wanted else engine.disableChannel)(channel)
        engine.enableCSVOutput(self.path)
        self.start_unix_s = time.time()
        engine.startSampling(sampleEngine.triggers.SAMPLECOUNT_INFINITE, HARDWARE_GRANULARITY)

    def batches(self, interval_s: float, stopping: Callable[[], bool]) -> Iterator[List[TelemetryRow]]:
        """Each interval, the samples the log gained: their means, stamped at the last one's time."""
        offset, pending, names = 0, "", None
        while not stopping():
            time.sleep(interval_s)
            if self.error is not None:
                raise RuntimeError("the meter's logger ended: " + self.error)
            try:
                with open(self.path) as log:
                    log.seek(offset)
                    text = log.read(MAX_READ_BYTES)
            except IOError:
                continue  # not created yet
            offset += len(text.encode())
            lines = (pending + text).split("\n")
            pending = lines.pop()
            samples = []
            for text_line in lines:
                if names is None:
                    names = monsoon_csv.columns(text_line, self.channel)
                    continue
                sample = monsoon_csv.sample(text_line, names, self.channel)
                if sample is not None:
                    samples.append(sample)
            if samples:
                yield self._rows(samples, interval_s)

    def _rows(self, samples: List[monsoon_csv.MeterSample], interval_s: float) -> List[TelemetryRow]:
        ts_s, n = self.start_unix_s + samples[-1].t_s, float(len(samples))
        sensor = "monsoon:%s" % self.channel
        means = (("board_power_mw", sum(s.power_mw for s in samples) / n, "mW"),
                 ("meter_current_ma", sum(s.current_ma for s in samples) / n, "mA"),
                 ("meter_voltage_v", sum(s.voltage_v for s in samples) / n, "V"))  # fmt: skip
        return [TelemetryRow(ts_s, metric, value, unit, sensor, self.kind, interval_s) for metric, value, unit in means]

    def close(self) -> None:
        self._stop.set()
        self._logger.join(timeout=5)


PACES_ITSELF = True


def source(options: SourceOptions) -> MonsoonSource:
    return MonsoonSource(options)
