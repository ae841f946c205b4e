"""Telemetry of an emulated node that has no stand-in sensor tool (an emulated server): the
node's CPU utilisation, measured on its cgroup, and its power from the node's power model,
labelled ``modeled`` (see :func:`nodes.emulated.node.modeled_power_w`)."""

from typing import List, Optional

from nodes.contracts.telemetry_rows import MEASURED, MODELED, TelemetryRow
from nodes.emulated.node import EmulatedNode, UtilisationMeter, modeled_power_w
from nodes.telemetry.source import PolledSource, SourceOptions


class ModeledPowerSource(PolledSource):
    name = "emulated"

    def __init__(self, interval_s: float, node: "Optional[EmulatedNode]" = None) -> None:
        super(ModeledPowerSource, self).__init__()
        self.node = node or EmulatedNode.from_environment()
        self.meter = UtilisationMeter(self.node)
        self.interval_s = interval_s
        self.header = {"emulated_node": self.node.name, "power_model": "idle + (busy - idle) x cgroup utilisation"}

    def sample(self, now_s: float) -> List[TelemetryRow]:
        busy_cpus, utilisation = self.meter.sample()
        mode = self.node.power_mode()
        period = self.interval_s
        rows = [
            TelemetryRow(now_s, "cpu_util_pct", 100.0 * utilisation, "%", "cgroup", MEASURED, period),
            TelemetryRow(now_s, "cpu_busy_cpus", busy_cpus, "CPUs", "cgroup", MEASURED, period),
        ]
        if mode is not None:
            rows.append(
                TelemetryRow(
                    now_s, "power_mw", 1000.0 * modeled_power_w(mode, utilisation), "mW", "model", MODELED, period
                )
            )
            rows.append(TelemetryRow(now_s, "power_mode_id", float(mode.id), "", "power_mode", MEASURED, period))
        return rows


PACES_ITSELF = False


def source(options: SourceOptions) -> ModeledPowerSource:
    return ModeledPowerSource(options.interval_s)
