"""DiSCo live on emulated phones: each phone's dispatcher and on-device endpoint run on the phone, and
race the server's trace endpoint across the shaped data plane; the trace-driven replay of the same
requests is the reference (target: mean TTFT and realised budget within 15%, b = 0.2 / 0.5 / 0.8).

The lab is ``examples/inventories/phones-lab.yaml``: a Pixel 7 Pro and a Xiaomi 14 (stand-in adb on
their USB host, governors as power modes with their CPU quotas, batteries fed by the power model)
beside a server. This script

1. brings the lab up (unless it runs) and shapes its links (WiFi-like rates, as the inventory says);
2. starts the trace endpoint (``python -m nodes.endpoints --pace trace``) on the server, listening on
   its data-plane address, through the testbed's SSH transport;
3. on each phone, through ``adb -s SERIAL shell`` on the USB host (so in the phone's namespace and CPU
   quota, as an app's process would be), runs ``bench/disco_live.py --server-url`` against it: its own
   device endpoint paced to that phone's measured rates (Pixel 7 Pro + BLOOM-1.1B, Xiaomi 14 +
   Qwen-0.5B), calibration, then DiSCo-S and DiSCo-D at three budgets;
4. records the phones' telemetry (battery power through adb) during the runs;
5. stops the endpoint by its pid, clears the links and takes down what it brought up.

Emulated phones only: a real phone has no Python for our dispatcher (its app would do this part).

    python bench/disco_phones.py                 # 100 requests per budget and regime on each phone (2 min)
    python bench/disco_phones.py --requests 20   # quicker

Writes bench/results/disco_phones.json (each phone's points and the 15% verdict).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import write

REPO = Path(__file__).resolve().parent.parent
LAB = REPO / "examples" / "inventories" / "phones-lab.yaml"
TINY = REPO / "examples" / "models" / "tiny"
PHONE_SPEEDS = {"pixel": "pixel7pro-bloom-1.1b", "xiaomi": "xiaomi14-qwen-0.5b"}  # DiSCo Sec. 5.1's pairs
SERVER_PORT = 18400


def testbed(*args: str, timeout_s: float = 900) -> str:
    result = subprocess.run([str(Path(sys.executable).parent / "testbed"), *args], cwd=REPO, capture_output=True,
                            text=True, timeout=timeout_s, check=False)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"testbed {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--service", default="gpt", help="the server's trace: gpt, deepseek, command or llama")
    parser.add_argument("--requests", type=int, default=100, help="requests per budget and regime on each phone")
    parser.add_argument("--calibration", type=int, default=100, help="calibration requests per endpoint")
    parser.add_argument("--keep-up", action="store_true", help="leave the lab up afterwards")
    args = parser.parse_args()

    from testbed.emulation.resolved import load_lab, resolved_path
    from testbed.energy.telemetry import finish_recording, start_recording
    from testbed.inventory import load_inventory
    from testbed.transport import open_transport

    began = time.perf_counter()
    brought_up = not resolved_path(load_inventory(LAB)).exists()
    if brought_up:
        print(testbed("emulate", "up", "-i", str(LAB)), flush=True)
    lab = load_lab(LAB)
    server = lab.node("server")
    assert server.data is not None
    server_url = f"http://{server.data.address}:{SERVER_PORT}/v1"
    pid = None
    telemetry_dir = Path(tempfile.mkdtemp(prefix="disco-phones-"))
    try:
        print(testbed("link", "apply", "-i", str(LAB)), flush=True)
        with open_transport(lab, server) as t:
            log = "/tmp/disco-phones-server-endpoint.log"
            repo = shlex.quote(str(REPO))
            start = (f"cd {repo} && PYTHONPATH={repo} nohup python -m nodes.endpoints --model {shlex.quote(str(TINY))} "
                     f"--pace trace --service {args.service} --seed 0 --host {server.data.address} "
                     f"--port {SERVER_PORT} > {log} 2>&1 < /dev/null & echo $!")  # fmt: skip
            pid = int(t.run_script(start, timeout_s=60).check().stdout.strip())
            deadline = time.monotonic() + 120
            while "serving" not in t.run(["cat", log], timeout_s=30).stdout:
                if time.monotonic() > deadline:
                    raise SystemExit("the server's trace endpoint did not start: " + t.run(["cat", log]).stdout)
                time.sleep(0.5)
        print(f"trace endpoint ({args.service}) on the server at {server_url} (pid {pid})", flush=True)
        recording = start_recording(lab, list(PHONE_SPEEDS), interval_s=1.0, max_seconds=3600)

        def on_phone(phone: str) -> dict:
            node = lab.node(phone)
            assert node.adb is not None
            out = f"{telemetry_dir}/live-{phone}.json"
            command = (f"cd {shlex.quote(str(REPO))} && PYTHONPATH={shlex.quote(str(REPO))} python bench/disco_live.py "
                       f"--server-url {server_url} --service {args.service} --device {PHONE_SPEEDS[phone]} "
                       f"--requests {args.requests} --calibration {args.calibration} --out {out}")  # fmt: skip
            with open_transport(lab, lab.node(node.adb.usb_host)) as hub:
                result = hub.run(["adb", "-s", node.adb.serial, "shell", command], timeout_s=3600)
            print(f"== {phone}\n{result.stdout[-3000:]}{result.stderr[-2000:]}", flush=True)
            result.check()
            return json.loads(Path(out).read_text())

        with ThreadPoolExecutor(len(PHONE_SPEEDS)) as pool:
            runs = dict(zip(PHONE_SPEEDS, pool.map(on_phone, PHONE_SPEEDS), strict=True))
        power = phone_power(finish_recording(lab, recording, telemetry_dir / "telemetry").directory)
    finally:
        if pid is not None:
            with open_transport(lab, server) as t:
                t.run(["kill", str(pid)], timeout_s=30)
        testbed("link", "clear", "-i", str(LAB))
        if brought_up and not args.keep_up:
            print(testbed("emulate", "down", "-i", str(LAB)), flush=True)
    within = all(abs(p["mean_ttft_gap_pct"]) <= 15 and abs(p["budget_gap_pct"]) <= 15
                 for run in runs.values() for p in run["points"])  # fmt: skip
    path = write("disco_phones", {
        "command": " ".join(["python", "bench/disco_phones.py", *sys.argv[1:]]),
        "seconds": round(time.perf_counter() - began, 1), "inventory": str(LAB.relative_to(REPO)),
        "service": args.service, "server_url": server_url, "modeled_times": True,
        "phones": {phone: {"device_speed": PHONE_SPEEDS[phone], "calibration": run["calibration"],
                           "points": run["points"], "telemetry": power.get(phone)}
                   for phone, run in runs.items()},
        "all_within_15_pct": within,
    })  # fmt: skip
    print(f"all points within 15%: {within}; wrote {path}")
    return 0 if within else 1


def phone_power(directory: Path) -> dict:
    """Per phone: mean battery power over the runs (``<node>.parquet`` of ``finish_recording``)."""
    import pandas as pd

    out: dict = {}
    for path in sorted(directory.glob("*.parquet")):
        frame = pd.read_parquet(path)
        rows = frame[frame["metric"] == "power_mw"]
        if not rows.empty:
            out[path.stem] = {"power_w_mean": float(rows["value"].mean()) / 1e3, "samples": len(rows),
                              "kind": sorted(set(rows["kind"]))}  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
