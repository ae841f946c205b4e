"""The phones the emulated testbed can stand in for: what their shell reports (``getprop``), their
CPU clusters as cpufreq policies, their governors, and their battery.

An emulated phone's files live under its stand-in root as the kernel lays them out on the phone:
``sys/devices/system/cpu/cpufreq/policyN/*`` (one policy per cluster), ``sys/class/power_supply/
battery/*`` (the battery driver's units: microamperes, microvolts, percent, tenths of a degree) and
``sys/class/thermal/thermal_zoneN/*``. The stand-in adb rewrites the phone's ``/sys/`` paths there,
so that the real readers (``nodes/android``) run unchanged.
"""

import os
from typing import Dict, NamedTuple, Optional, Tuple

from nodes.contracts.durable import write_atomic

GOVERNORS = ("schedutil", "performance", "powersave")
BATTERY = ("sys", "class", "power_supply", "battery")


class Cluster(NamedTuple):
    cpus: Tuple[int, ...]
    max_khz: int
    min_khz: int


class PhoneModel(NamedTuple):
    name: str  # the inventory's model
    product_model: str  # getprop ro.product.model
    codename: str  # getprop ro.product.device
    android: str  # getprop ro.build.version.release
    clusters: Tuple[Cluster, ...]
    battery_mah: float
    nominal_v: float
    source: str


PHONES: Dict[str, PhoneModel] = {
    "pixel-7-pro": PhoneModel(
        "pixel-7-pro", "Pixel 7 Pro", "cheetah", "14",
        (Cluster((0, 1, 2, 3), 1803000, 300000), Cluster((4, 5), 2348000, 400000), Cluster((6, 7), 2850000, 500000)),
        5000.0, 3.89, "Tensor G2 cluster maxima (cpufreq policies 0/4/6) and the 5,000 mAh battery: Google's "
        "specifications",
    ),
    "xiaomi-14": PhoneModel(
        "xiaomi-14", "23127PN0CG", "houji", "14",
        (Cluster((0, 1), 2265600, 364800), Cluster((2, 3, 4), 3148800, 499200), Cluster((5, 6), 2956800, 499200),
         Cluster((7,), 3302400, 480000)),
        4610.0, 3.87, "Snapdragon 8 Gen 3 clusters (2x A520, 3+2x A720, 1x X4) and the 4,610 mAh battery: "
        "estimates from public specifications, not read from a phone",
    ),
}  # fmt: skip


def phone_named(name: str) -> PhoneModel:
    try:
        return PHONES[name]
    except KeyError:
        raise ValueError("unknown phone model %r; known: %s" % (name, ", ".join(PHONES))) from None


def parse_mode(name: str) -> Tuple[str, Optional[int]]:
    """A phone's power mode as ``testbed power`` writes it: ``GOVERNOR`` or ``GOVERNOR@KHZ`` (a cap on
    every cluster)."""
    governor, _, cap = name.partition("@")
    return governor, (int(cap) if cap else None)


def policy_dir(root: str, index: int) -> str:
    return os.path.join(root, "sys", "devices", "system", "cpu", "cpufreq", "policy%d" % index)


def write_phone_files(root: str, phone: PhoneModel, mode_name: str, capacity_pct: float = 80.0) -> None:
    """The phone's sysfs under ``root``: cpufreq policies in ``mode_name``, CPUs, a discharging
    battery, two thermal zones."""
    governor, cap = parse_mode(mode_name)
    cpu_root = os.path.join(root, "sys", "devices", "system", "cpu")
    for cluster in phone.clusters:
        policy = policy_dir(root, cluster.cpus[0])
        os.makedirs(policy, exist_ok=True)
        files = {
            "scaling_governor": governor,
            "scaling_available_governors": " ".join(GOVERNORS),
            "cpuinfo_max_freq": str(cluster.max_khz),
            "cpuinfo_min_freq": str(cluster.min_khz),
            "scaling_max_freq": str(min(cluster.max_khz, cap) if cap else cluster.max_khz),
            "scaling_min_freq": str(cluster.min_khz),
            "related_cpus": " ".join(str(c) for c in cluster.cpus),
        }
        for name, text in files.items():
            write_atomic(os.path.join(policy, name), text + "\n", mode=0o644)
        for cpu in cluster.cpus:
            os.makedirs(os.path.join(cpu_root, "cpu%d" % cpu), exist_ok=True)
    battery = os.path.join(root, *BATTERY)
    os.makedirs(battery, exist_ok=True)
    write_battery(root, phone, current_ua=-200000, capacity_pct=capacity_pct, temp_dc=300)
    for index, kind in enumerate(("cpu-big", "battery")):
        zone = os.path.join(root, "sys", "class", "thermal", "thermal_zone%d" % index)
        os.makedirs(zone, exist_ok=True)
        write_atomic(os.path.join(zone, "type"), kind + "\n", mode=0o644)
        write_atomic(os.path.join(zone, "temp"), "30000\n", mode=0o644)


def write_battery(root: str, phone: PhoneModel, current_ua: int, capacity_pct: float, temp_dc: int,
                  voltage_uv: Optional[int] = None) -> None:  # fmt: skip
    """The battery driver's files: current (negative: discharging), voltage, capacity, charge, temp."""
    battery = os.path.join(root, *BATTERY)
    volts = voltage_uv if voltage_uv is not None else int(phone.nominal_v * 1e6)
    files = {
        "current_now": str(int(current_ua)), "voltage_now": str(int(volts)),
        "capacity": str(round(capacity_pct)), "temp": str(int(temp_dc)), "status": "Discharging",
        "charge_counter": str(int(phone.battery_mah * 1000 * capacity_pct / 100.0)),
    }  # fmt: skip
    for name, text in files.items():
        write_atomic(os.path.join(battery, name), text + "\n", mode=0o644)


def mode_of_policies(root: str, phone: PhoneModel) -> str:
    """The mode the policies are in, named as ``testbed power`` reads it back: the first cluster's
    governor, with ``@KHZ`` when some cluster runs capped below its maximum."""
    first = policy_dir(root, phone.clusters[0].cpus[0])
    with open(os.path.join(first, "scaling_governor")) as handle:
        governor = handle.read().strip()
    caps = []
    for cluster in phone.clusters:
        with open(os.path.join(policy_dir(root, cluster.cpus[0]), "scaling_max_freq")) as handle:
            value = int(handle.read().strip() or cluster.max_khz)
        if value < cluster.max_khz:
            caps.append(value)
    return "%s@%d" % (governor, max(caps)) if caps else governor
