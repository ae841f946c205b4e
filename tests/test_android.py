"""Phones end to end through the stand-in ``adb`` (tests/standins/adb): the battery source and its
unit/sign detection, the sampler recording a phone from its USB host (here the controller), the
cpufreq power driver with its journal, and ``testbed telemetry probe --require-energy``.

Each phone's filesystem lives under ``$ADB_STANDIN_ROOT/<serial>/`` (``make_phone`` writes it);
the stand-in maps the phone's ``/sys/`` there, so the real driver scripts read and write it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from nodes.contracts.telemetry_rows import TelemetryRow, read_rows
from nodes.contracts.tool_answers import SensorStatus
from nodes.power.android import AndroidPower
from nodes.telemetry.battery import BatterySource
from testbed.energy.power_modes import restore_power, set_power, show_power
from testbed.energy.telemetry import record_telemetry
from testbed.inventory import Inventory, load_inventory
from tests.conftest import REPO, run_cli
from tests.waiting import wait_until

STANDINS = REPO / "tests" / "standins"
ADB = str(STANDINS / "adb")
PIXEL = "28011FDH2000AB"
SAMSUNG = "R5CT20ABCDE"
INTERVAL_S = 0.05
# policyN: (related cpus, cpuinfo_max_freq kHz), as on a Tensor G2 phone
POLICIES = {"policy0": ("0 1 2 3", 1803000), "policy4": ("4 5", 2348000), "policy7": ("6 7", 2850000)}
GOVERNORS = "schedutil performance powersave"
THERMAL_ZONES = {"thermal_zone0": ("BIG", 41500), "thermal_zone1": ("battery", 28100)}


@dataclass(frozen=True)
class Phone:
    """A phone's files under the stand-in's root: what its kernel and the stand-in's dumpsys read."""

    serial: str
    root: Path

    @property
    def battery_dir(self) -> Path:
        return self.root / "sys" / "class" / "power_supply" / "battery"

    def policy_dir(self, policy: str) -> Path:
        return self.root / "sys" / "devices" / "system" / "cpu" / "cpufreq" / policy

    def battery(self, **values: int | str) -> None:
        """Write battery files (current_now, voltage_now, capacity, temp, status)."""
        for name, value in values.items():
            (self.battery_dir / name).write_text(f"{value}\n")

    def plug(self, source: str = "usb", powered: bool = True) -> None:
        (self.root / "standin" / f"{source}_powered").write_text("true\n" if powered else "false\n")

    def cpufreq(self, policy: str) -> tuple[str, int]:
        """(scaling_governor, scaling_max_freq) as the phone has them now."""
        d = self.policy_dir(policy)
        return (d / "scaling_governor").read_text().strip(), int((d / "scaling_max_freq").read_text())

    def cap(self, policy: str, khz: int) -> None:
        (self.policy_dir(policy) / "scaling_max_freq").write_text(f"{khz}\n")


def make_phone(
    base: Path,
    serial: str,
    *,
    current_now: int,
    voltage_uv: int = 3850000,
    capacity: int = 80,
    temp_tenths_c: int = 281,
    status: str = "Discharging",
    usb_powered: bool = False,
) -> Phone:
    """A phone root: battery files (current_now in the vendor's unit and sign, voltage_now in µV,
    capacity in %, temp in tenths of °C, the status word), three cpufreq policies with the
    schedutil governor uncapped, and two thermal zones in millidegrees."""
    phone = Phone(serial, base / serial)
    phone.battery_dir.mkdir(parents=True)
    (phone.root / "standin").mkdir()
    phone.battery(current_now=current_now, voltage_now=voltage_uv, capacity=capacity, temp=temp_tenths_c,
                  status=status)  # fmt: skip
    phone.plug("usb", usb_powered)
    cpu = phone.root / "sys" / "devices" / "system" / "cpu"
    for n in range(8):
        (cpu / f"cpu{n}").mkdir(parents=True)
    for policy, (cpus, hw_max) in POLICIES.items():
        d = phone.policy_dir(policy)
        d.mkdir(parents=True)
        files = {
            "scaling_governor": "schedutil",
            "scaling_max_freq": hw_max,
            "cpuinfo_max_freq": hw_max,
            "scaling_available_governors": GOVERNORS,
            "related_cpus": cpus,
        }
        for name, value in files.items():
            (d / name).write_text(f"{value}\n")
    for zone, (kind, millideg) in THERMAL_ZONES.items():
        d = phone.root / "sys" / "class" / "thermal" / zone
        d.mkdir(parents=True)
        (d / "type").write_text(kind + "\n")
        (d / "temp").write_text(f"{millideg}\n")
    return phone


@pytest.fixture
def phones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in adb on PATH (for this process and the controller's local children), with a
    Pixel-like and a Samsung-like phone attached; returns the stand-in's root for make_phone."""
    root = tmp_path / "phones"
    root.mkdir()
    monkeypatch.setenv("PATH", f"{STANDINS}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ADB_STANDIN_DEVICES", f"{PIXEL}:device {SAMSUNG}:device")
    monkeypatch.setenv("ADB_STANDIN_ROOT", str(root))
    return root


def by_metric(sensors: list[SensorStatus]) -> dict[str, SensorStatus]:
    return {s.metric: s for s in sensors}


def values(batch: list[TelemetryRow]) -> dict[str, float]:
    return {r.metric: r.value for r in batch}


# -- the battery source ---------------------------------------------------------------------------


def test_a_pixel_reports_microamps_negative_while_discharging(phones: Path) -> None:
    make_phone(phones, PIXEL, current_now=-412000, voltage_uv=3850000, capacity=80, temp_tenths_c=281)
    source = BatterySource(PIXEL, INTERVAL_S, adb=ADB)
    try:
        assert source.dumpsys["voltage"] == 3850 and source.dumpsys["level"] == 80
        assert source.dumpsys["USB powered"] is False and source.dumpsys["status"] == 3
        sensors = by_metric(source.probe(interval_s=INTERVAL_S))
    finally:
        source.close()
    assert sensors["battery_current_ma"].value == pytest.approx(412.0)
    assert sensors["power_mw"].value == pytest.approx(412 * 3.85)  # 1586.2 mW
    assert sensors["power_mw"].unit == "mW" and sensors["power_mw"].ok
    assert sensors["battery_voltage_mv"].value == pytest.approx(3850.0)
    assert sensors["battery_capacity_pct"].value == 80 and sensors["battery_temp_c"].value == pytest.approx(28.1)
    assert sensors["charging"].value == 0
    convention = source.header["current_convention"]
    assert isinstance(convention, dict)
    assert (convention["unit"], convention["discharge_sign"]) == ("uA", -1)
    assert not source.problems


def test_a_samsung_reports_milliamps_positive_while_discharging(phones: Path) -> None:
    make_phone(phones, SAMSUNG, current_now=380, voltage_uv=4012000)
    source = BatterySource(SAMSUNG, INTERVAL_S, adb=ADB)
    try:
        sensors = by_metric(source.probe(interval_s=INTERVAL_S))
    finally:
        source.close()
    assert sensors["battery_current_ma"].value == pytest.approx(380.0)
    assert sensors["power_mw"].value == pytest.approx(380 * 4.012)  # 1524.56 mW
    convention = source.header["current_convention"]
    assert isinstance(convention, dict)
    assert (convention["unit"], convention["discharge_sign"]) == ("mA", 1)


def test_a_charging_phone_gives_no_power_until_it_discharges(phones: Path) -> None:
    phone = make_phone(phones, PIXEL, current_now=1200000, status="Charging", usb_powered=True)
    source = BatterySource(PIXEL, INTERVAL_S, adb=ADB)
    batches: list[dict[str, float]] = []
    try:
        power = by_metric(source.probe(interval_s=INTERVAL_S))["power_mw"]
        assert power.value is None and "charging" in power.problem and "USB powered" in power.problem
        assert "current_convention" not in source.header

        def stopping() -> bool:  # nine lines, and one after the unplugging has reached the phone's loop: a
            # loaded machine may read lines the loop printed before the last change (bounded: 400 lines, 20 s)
            return (len(batches) >= 9 and "power_mw" in batches[-1]) or len(batches) >= 400

        # Unplugged after the third line, one file change per line read (the loop cats the files
        # one by one, so no line can pair the charging current with the discharging status):
        # current 0, then the status, then the discharge current.
        unplugging = {3: {"current_now": 0}, 4: {"status": "Discharging"}, 5: {"current_now": -412000}}
        for batch in source.batches(INTERVAL_S, stopping):
            batches.append(values(batch))
            if len(batches) == 3:
                phone.plug("usb", False)
            phone.battery(**unplugging.get(len(batches), {}))
    finally:
        source.close()
    assert len(batches) >= 9
    assert all("power_mw" not in b and b["charging"] == 1 for b in batches[:3])
    for b in batches:
        if b["charging"] == 1:
            assert "power_mw" not in b and "battery_current_ma" not in b
        elif "power_mw" in b:
            assert b["battery_current_ma"] == pytest.approx(412.0) and b["power_mw"] == pytest.approx(1586.2)
    assert batches[-1]["charging"] == 0 and batches[-1]["power_mw"] == pytest.approx(412 * 3.85)
    convention = source.header["current_convention"]
    assert isinstance(convention, dict) and (convention["unit"], convention["discharge_sign"]) == ("uA", -1)


@pytest.mark.parametrize(("charger", "named"), [(None, "(status charging)"), ("dock", "(Dock powered)")])
def test_the_charging_problem_names_what_charges_it(phones: Path, charger: str | None, named: str) -> None:
    """A dock charging it, or dumpsys's status 2 (charging) with no charger online."""
    phone = make_phone(phones, PIXEL, current_now=900000, status="Charging", usb_powered=False)
    if charger:
        phone.plug(charger)
    source = BatterySource(PIXEL, INTERVAL_S, adb=ADB)
    source.close()
    (problem,) = [p for metric, sensor, p in source.problems if "is charging" in p]
    assert named in problem, problem


def test_a_phone_that_is_not_attached_fails_with_adbs_words(phones: Path) -> None:
    with pytest.raises(RuntimeError, match="not found"):
        BatterySource("NOSUCHPHONE", INTERVAL_S, adb=ADB)


# -- the controller: sampler, power, CLI ----------------------------------------------------------


def phone_inventory(tmp_path: Path, serial: str = PIXEL) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(
        f"defaults:\n  sudo: false\n  python: {sys.executable}\n  workdir: {tmp_path / 'node'}\n"
        "nodes:\n"
        f"  - {{name: p1, kind: android, model: pixel-7-pro, adb: {{serial: {serial}, usb_host: controller}}}}\n"
    )
    return path


def test_record_a_phone_from_its_usb_host(phones: Path, tmp_path: Path) -> None:
    phone = make_phone(phones, PIXEL, current_now=-412000, voltage_uv=3850000)
    inv = load_inventory(phone_inventory(tmp_path))
    out = tmp_path / "telemetry"

    def sampled(milliamps: float) -> int:
        """Samples of ``milliamps`` the sampler has written so far."""
        files = list((tmp_path / "node").glob("telemetry/*/p1.csv"))
        rows = read_rows(str(files[0])) if files else []
        return sum(r.metric == "battery_current_ma" and round(r.value, 3) == milliamps for r in rows)

    def wait_for_samples(milliamps: float) -> None:  # the sampler's start is slow on a loaded machine
        wait_until(lambda: sampled(milliamps) >= 3, f"3 samples of {milliamps} mA")

    def during() -> None:  # the workload starts once the phone was sampled idle: it draws 600 mA from then on
        wait_for_samples(412.0)
        phone.battery(current_now=-600000)
        wait_for_samples(600.0)

    result = record_telemetry(inv, None, 1.4, out, interval_s=INTERVAL_S, during=during)
    assert result.ok, result.errors
    (node,) = result.nodes
    frame = pd.read_parquet(node.path)
    assert set(frame["node"]) == {"p1"}
    current = frame[frame["metric"] == "battery_current_ma"].sort_values("node_ts_s")
    assert set(current["value"].round(3)) == {412.0, 600.0}
    # one switch, from 412 mA to 600 mA, with several samples on each side
    switched = current["value"].diff().fillna(0).ne(0).sum()
    assert switched == 1 and current["value"].iloc[0] == 412.0 and current["value"].iloc[-1] == 600.0
    assert min((current["value"] == 412.0).sum(), (current["value"] == 600.0).sum()) >= 3
    power = frame[frame["metric"] == "power_mw"]
    assert set(power["value"].round(3)) == {round(412 * 3.85, 3), round(600 * 3.85, 3)}
    assert set(power["unit"]) == {"mW"} and set(power["sensor"]) == {"battery"}
    assert set(frame["kind"]) == {"modeled"}  # the stand-in phone says it is one
    assert node.stopped == "stopped"
    document = json.loads((out / "recording.json").read_text())
    assert document["nodes"]["p1"]["source"] == "android"
    assert document["nodes"]["p1"]["source_header"]["current_convention"]["unit"] == "uA"


def cpufreq_of(phone: Phone) -> dict[str, tuple[str, int]]:
    return {policy: phone.cpufreq(policy) for policy in POLICIES}


def test_set_read_back_and_restore_a_phones_power_mode(phones: Path, tmp_path: Path) -> None:
    phone = make_phone(phones, PIXEL, current_now=-412000)
    inv = load_inventory(phone_inventory(tmp_path))
    original = cpufreq_of(phone)
    assert original == {p: ("schedutil", hw) for p, (_, hw) in POLICIES.items()}

    before = show_power(inv).values()["p1"]
    assert before.kind == "android" and before.mode_id == "schedutil" and not before.journal
    assert before.details["thermal_c"] == {"BIG": pytest.approx(41.5), "battery": pytest.approx(28.1)}
    assert [m[0] for m in before.modes] == GOVERNORS.split()

    # 2000000 kHz caps the two big clusters; the little one's maximum (1803000) is lower already
    result = set_power(inv, ["p1"], "powersave@2000000")
    assert result.ok, [o.error for o in result.failed]
    expected = {p: ("powersave", min(2000000, hw)) for p, (_, hw) in POLICIES.items()}
    assert cpufreq_of(phone) == expected
    assert expected["policy0"] == ("powersave", 1803000)
    set_reading = result.values()["p1"]
    assert set_reading.mode_id == "powersave@2000000" and set_reading.journal

    shown = show_power(inv).values()["p1"]
    assert shown.mode_id == "powersave@2000000" and shown.journal
    policies = shown.details["policies"]
    assert {p: (v["governor"], int(v["max_khz"])) for p, v in policies.items()} == expected

    journal = tmp_path / "node" / "power" / f"journal-{PIXEL}.json"
    document = json.loads(journal.read_text())
    assert document["kind"] == "android"
    saved = document["snapshot"]["policies"]
    assert {p: (v["governor"], int(v["max_khz"])) for p, v in saved.items()} == original

    # a second change keeps the journal of the original state
    assert set_power(inv, ["p1"], "performance").ok
    assert cpufreq_of(phone) == {p: ("performance", hw) for p, (_, hw) in POLICIES.items()}

    restored = restore_power(inv)
    assert restored.ok, [o.error for o in restored.failed]
    reading = restored.values()["p1"]
    assert reading.mode_id == "schedutil" and not reading.journal
    assert cpufreq_of(phone) == original
    assert not journal.exists()
    assert show_power(inv).values()["p1"].journal is False
    assert restore_power(inv).values() == {}  # nothing left to restore


def test_an_unknown_governor_is_the_nodes_error_and_changes_nothing(phones: Path, tmp_path: Path) -> None:
    phone = make_phone(phones, PIXEL, current_now=-412000)
    inv: Inventory = load_inventory(phone_inventory(tmp_path))
    original = cpufreq_of(phone)
    for mode in ("ondemand", "ondemand@1200000"):
        result = set_power(inv, ["p1"], mode)
        assert not result.ok
        (outcome,) = result.failed
        assert outcome.node == "p1" and "ondemand" in (outcome.error or "")
        assert "schedutil performance powersave" in (outcome.error or "")
        assert cpufreq_of(phone) == original
    malformed = set_power(inv, ["p1"], "Power Save")
    assert not malformed.ok and "GOVERNOR@KHZ" in (malformed.failed[0].error or "")
    assert cpufreq_of(phone) == original
    assert not (tmp_path / "node" / "power" / f"journal-{PIXEL}.json").exists()  # refused before journaling
    assert show_power(inv).values()["p1"].journal is False


@pytest.mark.parametrize(
    ("field", "value"),
    [("governor", "schedutil; touch {marker}"), ("max_khz", "1803000 > /dev/null; touch {marker}"),
     ("policy", "policy0/../../../../../../..{marker}")],
)  # fmt: skip
def test_restore_refuses_a_journal_value_that_is_not_a_governor_policy_or_frequency(
    phones: Path, tmp_path: Path, field: str, value: str
) -> None:
    """What the journal says is checked again before it reaches the phone's root shell: a value that is
    not what the driver writes there is the node's error, naming the journal and the field, and the
    phone is left as it is (the journal too, to be mended by hand)."""
    phone = make_phone(phones, PIXEL, current_now=-412000)
    inv = load_inventory(phone_inventory(tmp_path))
    assert set_power(inv, ["p1"], "performance").ok
    journal = tmp_path / "node" / "power" / f"journal-{PIXEL}.json"
    document = json.loads(journal.read_text())
    marker = tmp_path / "injected"
    policies = document["snapshot"]["policies"]
    if field == "policy":
        policies[value.format(marker=marker)] = policies.pop("policy0")
    else:
        policies["policy4"][field] = value.format(marker=marker)
    journal.write_text(json.dumps(document))
    restored = restore_power(inv)
    assert not restored.ok
    error = restored.failed[0].error or ""
    assert str(journal) in error and ("governor" if field == "governor" else field if field != "policy" else
                                      "policy") in error, error  # fmt: skip
    assert "Traceback" not in error
    assert not marker.exists()
    assert cpufreq_of(phone) == {p: ("performance", hw) for p, (_, hw) in POLICIES.items()}
    assert json.loads(journal.read_text()) == document


def test_a_phone_with_clusters_capped_apart_reports_the_highest_cap(phones: Path) -> None:
    """A thermal engine capped the little cluster at 950400 kHz and the big one at 2400000 kHz:
    the mode names the highest cap, compared as numbers (950400 < 2400000)."""
    phone = make_phone(phones, PIXEL, current_now=-412000)
    phone.cap("policy0", 950400)
    phone.cap("policy7", 2400000)
    state = AndroidPower(PIXEL, adb=ADB).state()
    assert state.mode_id == "schedutil@2400000"


def test_the_node_power_command_needs_a_serial_for_a_phone(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nodes.power", "--kind", "android", "--journal", str(tmp_path / "j.json"), "show"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=False,
    )  # fmt: skip
    # bad input (nodes.contracts.tool_errors): exit status 2, the reason as the tool's JSON answer
    assert done.returncode == 2 and "--serial" in json.loads(done.stdout)["error"]


def test_require_energy_refuses_a_charging_phone(phones: Path, tmp_path: Path) -> None:
    phone = make_phone(phones, PIXEL, current_now=1200000, status="Charging", usb_powered=True)
    inventory = str(phone_inventory(tmp_path))
    refused = run_cli("telemetry", "probe", "-i", inventory, "--require-energy")
    assert refused.returncode == 1, refused.stderr
    assert "p1" in refused.stderr and "charging" in refused.stderr
    phone.plug("usb", False)
    phone.battery(current_now=-412000, status="Discharging")
    accepted = run_cli("telemetry", "probe", "-i", inventory, "--require-energy")
    assert accepted.returncode == 0, accepted.stderr
    assert "p1" in accepted.stdout


def test_power_show_warns_when_the_phone_charges(phones: Path, tmp_path: Path) -> None:
    phone = make_phone(phones, PIXEL, current_now=1200000, status="Charging", usb_powered=True)
    inv = load_inventory(phone_inventory(tmp_path))
    reading = show_power(inv).values()["p1"]
    assert any("charging (USB powered)" in w for w in reading.warnings)
    phone.plug("usb", powered=False)
    phone.battery(status="Discharging", current_now=-412000)
    assert show_power(inv).values()["p1"].warnings == ()
