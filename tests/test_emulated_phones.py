"""Emulated phones: a phone of the catalogue as its own namespace, reached as a real phone is, through
adb on its USB host (a stand-in adb that carries each shell command into the phone), with its cpufreq,
battery and thermal files where the phone's kernel has them. Governors are its power modes (they move
its CPU quota) and its battery reports the modeled power of its CPU use. The real drivers and readers
(``nodes/android``) run unchanged against it."""

from __future__ import annotations

import json
import os
import shlex
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from ruamel.yaml import YAML

from foundation.errors import InputError
from nodes.emulated.cgroup import CpuCgroup
from nodes.emulated.phones import PHONES, mode_of_policies, write_phone_files
from testbed.emulation.resolved import load_lab
from testbed.inventory import load_inventory
from testbed.transport import open_transport
from tests.conftest import REPO, emulated_inventory, emulated_lab, json_log_rows, run_cli
from tests.waiting import wait_until

TINY = REPO / "examples" / "models" / "tiny"

PHONE_NODES = """nodes:
  - name: server
    kind: server
    model: generic
    roles: [server]
    emulated:
      power_modes:
        - {id: 0, name: default, cpus: 1.0, idle_w: 90, busy_w: 300}
  - name: hub
    kind: jetson
    model: agx-orin
    roles: [device]
    emulated:
      power_modes:
        - {id: 0, name: MAXN, cpus: 0.5, idle_w: 7.0, busy_w: 40.0}
  - name: pixel
    kind: android
    model: pixel-7-pro
    adb: {serial: EMU7PRO0001, usb_host: hub}
    roles: [device]
    emulated:
      power_modes:
        - {id: 0, name: schedutil, cpus: 1.0, idle_w: 0.6, busy_w: 6.0}
        - {id: 1, name: powersave@1803000, cpus: 0.3, idle_w: 0.5, busy_w: 2.5}
"""


def test_the_catalogue_lays_out_a_phones_sysfs_and_reads_its_mode_back(tmp_path: Path) -> None:
    phone = PHONES["xiaomi-14"]
    write_phone_files(str(tmp_path), phone, "powersave@1803000")
    policies = sorted((tmp_path / "sys/devices/system/cpu/cpufreq").iterdir())
    assert [p.name for p in policies] == [f"policy{c.cpus[0]}" for c in phone.clusters]
    caps = [int((p / "scaling_max_freq").read_text()) for p in policies]
    assert caps == [min(c.max_khz, 1803000) for c in phone.clusters]
    assert mode_of_policies(str(tmp_path), phone) == "powersave@1803000"
    battery = tmp_path / "sys/class/power_supply/battery"
    assert int((battery / "current_now").read_text()) < 0 and (battery / "status").read_text().strip() == "Discharging"


def test_an_emulated_phones_inventory_is_checked(tmp_path: Path) -> None:
    bad_mode = PHONE_NODES.replace("name: powersave@1803000", "name: turbo")
    with pytest.raises(InputError, match="not a phone's power mode"):
        load_inventory(emulated_inventory(tmp_path, "pq", 212, bad_mode))
    with pytest.raises(InputError, match="no emulated phone 'galaxy-s24'"):
        load_inventory(emulated_inventory(tmp_path, "pq", 212, PHONE_NODES.replace("pixel-7-pro", "galaxy-s24")))
    assert load_inventory(emulated_inventory(tmp_path, "pq", 212, PHONE_NODES)).node("pixel").emulated is not None
    # a supply meter: a kind the suite reads, on a node that has one (an emulated board has no stand-in)
    metered = PHONE_NODES.replace("    adb: {serial: EMU7PRO0001, usb_host: hub}\n",
                                  "    adb: {serial: EMU7PRO0001, usb_host: hub}\n    meter: {kind: monsoon}\n")
    assert load_inventory(emulated_inventory(tmp_path, "pq", 212, metered)).node("pixel").meter is not None
    with pytest.raises(InputError, match=r"inventory.yaml:\d+: nodes\[2\]\.meter\.kind"):
        load_inventory(emulated_inventory(tmp_path, "pq", 212, metered.replace("kind: monsoon", "kind: otii")))
    board = PHONE_NODES.replace("    roles: [device]\n    emulated:\n      power_modes:\n        - {id: 0, name: MAXN",
                                "    roles: [device]\n    meter: {kind: monsoon}\n    emulated:\n      power_modes:\n"
                                "        - {id: 0, name: MAXN", 1)  # fmt: skip
    with pytest.raises(InputError, match="an emulated jetson has no stand-in meter"):
        load_inventory(emulated_inventory(tmp_path, "pq", 212, board))


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.slow
@pytest.mark.root
def test_a_phone_is_reached_through_adb_its_governor_moves_its_quota_and_its_battery_follows_the_load(
    tmp_path: Path,
) -> None:
    inventory = emulated_inventory(tmp_path, "ph", 212, PHONE_NODES)
    with emulated_lab(inventory) as path:
        resolved = str(tmp_path / "state" / "inventory.yaml")
        lab = load_lab(path)
        check = run_cli("inventory", "check", "-i", resolved, "--nodes", "pixel", "--json")
        assert check.returncode == 0, check.stdout + check.stderr
        assert "Pixel 7 Pro" in check.stdout
        group = CpuCgroup("ph-pixel")
        assert group.quota_cpus() == pytest.approx(1.0)
        changed = run_cli("power", "set", "-i", resolved, "pixel", "powersave@1803000")
        assert changed.returncode == 0, changed.stdout + changed.stderr
        assert group.quota_cpus() == pytest.approx(0.3)  # the governor is the power mode: its CPU quota
        shown = run_cli("power", "show", "-i", resolved, "--nodes", "pixel", "--json")
        assert "powersave@1803000" in shown.stdout  # read back from the phone's cpufreq files
        restored = run_cli("power", "restore", "-i", resolved)
        assert restored.returncode == 0 and group.quota_cpus() == pytest.approx(1.0)

        probe = run_cli("telemetry", "probe", "-i", resolved, "--nodes", "pixel", "--require-energy", "--json")
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert "modeled" in probe.stdout and "power_mw" in probe.stdout

        current = tmp_path / "state" / "nodes" / "pixel" / "root" / "sys/class/power_supply/battery/current_now"
        idle_bound_ua = 0.6 / 3.89 * 1e6 * 1.5  # about the idle 0.6 W at 3.89 V
        idle_ua, deadline = -int(current.read_text()), time.monotonic() + 20
        while idle_ua >= idle_bound_ua and time.monotonic() < deadline:  # the probe's own CPU time, read back
            time.sleep(0.2)  # in the battery's last sample on a loaded machine, passes with the next one
            idle_ua = min(idle_ua, -int(current.read_text() or 0))
        peak, busy_done = [0], threading.Event()

        def watch() -> None:  # until the busy loop is over, however long reaching the phone took
            while not busy_done.is_set():
                peak[0] = max(peak[0], -int(current.read_text() or 0))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with open_transport(lab, lab.node("hub")) as hub:  # a busy loop on the phone, through adb
                busy = 'end=$(($(date +%s)+3)); while [ "$(date +%s)" -lt "$end" ]; do :; done; echo done'
                out = hub.run(["adb", "-s", "EMU7PRO0001", "shell", busy], timeout_s=30.0)
        finally:
            busy_done.set()
            watcher.join()
        assert out.exit_code == 0 and "done" in out.stdout
        assert idle_ua < idle_bound_ua
        assert peak[0] > 3 * idle_ua  # the phone's load shows in its battery current
        devices = json.loads((tmp_path / "state" / "adb-devices.json").read_text())
        assert devices["EMU7PRO0001"]["usb_host"] == "hub"
        _an_app_on_the_phone_streams_from_the_server_across_the_data_plane(lab, tmp_path)
        _a_supply_meter_on_the_phone_is_what_measures_it(Path(resolved), tmp_path)


def _an_app_on_the_phone_streams_from_the_server_across_the_data_plane(lab, tmp_path: Path) -> None:
    """What bench/disco_phones.py does at scale: a process the phone's adb shell starts (so in the
    phone's namespace) streams a completion from the server's trace endpoint at its data address."""
    server, pixel = lab.node("server"), lab.node("pixel")
    assert server.data is not None and pixel.data is not None
    log, served = tmp_path / "endpoint.log", tmp_path / "served.jsonl"
    start = (f"cd {REPO} && PYTHONPATH={REPO} nohup python -m nodes.endpoints --model {TINY} --pace trace "
             f"--service gpt --host {server.data.address} --port 18401 --log {served} > {log} 2>&1 < /dev/null "
             "& echo $!")  # fmt: skip
    with open_transport(lab, server) as t:
        pid = int(t.run_script(start, timeout_s=60.0).check().stdout.strip())
    try:
        wait_until(lambda: "serving" in (log.read_text() if log.exists() else ""), "the server's 'serving' line",
                   interval_s=0.2)  # fmt: skip
        app = ("import json, queue; from nodes.endpoints.client import CompletionStream; q = queue.Queue(); "
               f"s = CompletionStream('app', 'http://{server.data.address}:18401/v1', [5, 6, 7], 3, q, seed=11); "
               "s.start().join(60); print(json.dumps([e[1] for e in list(q.queue)]))")  # fmt: skip
        with open_transport(lab, lab.node("hub")) as hub:
            out = hub.run(["adb", "-s", "EMU7PRO0001", "shell", f"cd {REPO} && PYTHONPATH={REPO} python -c "
                           + shlex.quote(app)], timeout_s=90.0)  # fmt: skip
        assert out.exit_code == 0, out.stdout + out.stderr
        kinds = json.loads(out.stdout.strip().splitlines()[-1])
        assert kinds[-1] == "done" and "tokens" in kinds
        # the endpoint logs a request after its stream's end, which the app saw
        wait_until(lambda: json_log_rows(served), "the endpoint to log the request", 30, interval_s=0.1)
        row = json_log_rows(served)[-1]
        assert row["client"] == pixel.data.address  # it came from the phone, over the data plane
        assert row["seed"] == 11 and row["completion_tokens"] == 3
    finally:
        with open_transport(lab, server) as t:
            t.run(["kill", str(pid)], timeout_s=30.0)


def _a_supply_meter_on_the_phone_is_what_measures_it(resolved: Path, tmp_path: Path) -> None:
    """A Monsoon inline with the phone's supply (``meter:`` on the node): its logger runs on the phone's
    USB host and writes the meter's own CSV (here the stand-in's, from the phone's modeled battery), and
    the node's telemetry is the meter's: whole-device power, labelled modeled, the raw file beside it."""
    from analysis.metrics import node_power
    from nodes.contracts import monsoon_csv

    yaml = YAML(typ="rt")
    data = yaml.load(resolved.read_text())
    next(n for n in data["nodes"] if n["name"] == "pixel")["meter"] = {"kind": "monsoon", "vout_v": 3.9}
    metered = tmp_path / "metered.yaml"
    with metered.open("w") as handle:
        yaml.dump(data, handle)
    out = tmp_path / "metered"
    # 5 s: the meter's logger starts by asking the phone twice through adb, which a loaded machine makes slow
    done = run_cli("telemetry", "record", "-i", str(metered), "--nodes", "pixel", "--seconds", "5",
                   "--interval-ms", "250", "--out", str(out), timeout_s=180)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    frame = pd.read_parquet(out / "pixel.parquet")
    power = frame[frame["metric"] == "board_power_mw"]
    assert len(power) >= 6 and set(power["sensor"]) == {"monsoon:main"} and set(power["kind"]) == {"modeled"}
    raw = (out / "raw" / "pixel.monsoon.csv").read_text()
    assert raw.startswith("Time(ms),Main(mA),Main Voltage(V),\n")  # the meter's own format, as PyMonsoon writes
    samples = monsoon_csv.parse(raw, "main")
    assert len(samples) >= 50 and {s.voltage_v for s in samples} == {3.9}
    mean_raw = sum(s.power_mw for s in samples) / len(samples)
    assert power["value"].mean() == pytest.approx(mean_raw, rel=0.25)  # interval means of the same samples
    recording = json.loads((out / "recording.json").read_text())["nodes"]["pixel"]
    assert recording["source"] == "monsoon" and "stand-in" in recording["source_header"]["meter"]
    chosen = node_power(frame.assign(run_id="r"))
    assert len(chosen) == len(power)  # the run's energy comes from the meter
