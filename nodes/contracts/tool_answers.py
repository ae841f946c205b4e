"""What node tools answer the controller, as JSON (standard library, Python 3.8): the sampler's probe
reports one :class:`SensorStatus` per (metric, sensor); the controller reads them back into the same
type. (The power driver answers with ``nodes.power.PowerState`` as JSON; failures follow
:mod:`nodes.contracts.tool_errors`.)"""

from typing import NamedTuple, Optional

ENERGY_METRICS = ("power_mw", "board_power_mw", "energy_mj", "energy_uj")


class SensorStatus(NamedTuple):
    """What the probe found for one (metric, sensor): a number, or why there is none."""

    metric: str
    sensor: str
    unit: str
    kind: str
    value: Optional[float]
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None and not self.problem

    @property
    def energy(self) -> bool:
        return self.metric in ENERGY_METRICS
