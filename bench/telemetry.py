"""Sampler overhead: CPU time of the node-side telemetry sampler at 10 Hz, as a share of one core,
for each source this machine can run (the host's /proc/stat, an emulated node's power model, the
tegrastats parser fed by a tool that prints a real JetPack 5 AGX Orin line, NVML through the fake
``pynvml`` of the tests). Only the sampler process itself is counted, not the tool it reads.

Writes bench/results/telemetry.json. Target: under 2% of one core at 10 Hz.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import summary, write

REPO = Path(__file__).resolve().parent.parent
TARGET_PCT = 2.0
ORIN_LINE = (
    "04-24-2023 00:01:24 RAM 1282/62795MB (lfb 15152x4MB) SWAP 0/31398MB (cached 0MB) CPU [0%@729,0%@729,0%@729,"
    "0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729,0%@729] EMC_FREQ 0%@2133 GR3D_FREQ 0%@0 GR3D2_FREQ 0%@0 "
    "VIC_FREQ 729 APE 174 CV0@-256C CPU@42.593C Tboard@32C SOC2@39.343C Tdiode@33.25C SOC0@39.375C CV1@-256C "
    "GPU@-256C tj@42.593C SOC1@40.468C CV2@-256C VDD_GPU_SOC 2399mW/2399mW VDD_CPU_CV 400mW/400mW VIN_SYS_5V0 "
    "4032mW/4032mW NC 0mW/0mW VDDQ_VDD2_1V8AO 301mW/301mW NC 0mW/0mW"
)


def process_cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime of the process


BENCH_CGROUP = "hilbench-telemetry"


def environments(scratch: Path, cgroup: str | None) -> dict[str, dict[str, str]]:
    """Per source: the environment its sampler needs on this machine."""
    tools = scratch / "bin"
    tools.mkdir()
    tegrastats = tools / "tegrastats"  # prints a real line every --interval ms, like the real tool
    tegrastats.write_text(f"#!/bin/sh\nwhile :; do echo '{ORIN_LINE}'; sleep 0.1; done\n")  # --interval 100
    tegrastats.chmod(0o755)
    node = scratch / "node.json"
    node.write_text(json.dumps({
        "node": "bench", "kind": "server", "model": "bench", "mode": "netns" if cgroup else "local",
        "cgroup": cgroup, "cpu_root_pid": None if cgroup else os.getpid(),
        "power_mode_file": str(scratch / "power_mode"),
        "power_modes": [{"id": 0, "name": "default", "cpus": 1.0, "idle_w": 90, "busy_w": 300}],
    }))  # fmt: skip
    path = f"{tools}:{os.environ['PATH']}"
    envs = {
        "host": {"PATH": path},
        "emulated": {"PATH": path, "TESTBED_EMULATED_NODE": str(node)},
        "jetson": {"PATH": path},
    }
    if (REPO / "tests" / "standins" / "pynvml.py").exists():
        envs["nvml"] = {"PATH": path, "PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'standins'}"}
    return envs


def measure(source: str, env: dict[str, str], seconds: float, scratch: Path) -> float:
    """Percent of one core the sampler used over ``seconds`` at 10 Hz (after a 1 s warm-up)."""
    out = scratch / f"{source}-{time.monotonic_ns()}.csv"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nodes.telemetry.sampler", "--source", source, "--interval-ms", "100",
         "--out", str(out), "--max-seconds", str(seconds + 30)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        time.sleep(1.0)
        if proc.poll() is not None:
            raise RuntimeError(f"{source} sampler ended: {proc.stderr.read().decode() if proc.stderr else ''}")
        cpu0, t0 = process_cpu_s(proc.pid), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = process_cpu_s(proc.pid), time.monotonic()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    return 100.0 * (cpu1 - cpu0) / (t1 - t0)


def measure_all(source: str, env: dict[str, str], args: argparse.Namespace, scratch: Path) -> list[float]:
    return [measure(source, env, args.seconds, scratch) for _ in range(args.repeat)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured time per repetition")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results = {}
    from nodes.emulated.cgroup import CpuCgroup, cgroup_version

    # An emulated node reads its CPU time from its cgroup (netns mode); without root, from its
    # process tree (local mode, which scans /proc and costs more). Say which one was measured.
    group = CpuCgroup(BENCH_CGROUP) if os.geteuid() == 0 and cgroup_version() else None
    if group is not None:
        group.create()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        try:
            runs = {
                s: measure_all(s, env, args, scratch)
                for s, env in environments(scratch, group and BENCH_CGROUP).items()
            }
        finally:
            if group is not None:
                group.remove()
    for source, samples in runs.items():
        results[source] = {"cpu_pct_of_one_core": summary(samples),
                           "ratio_to_target": summary(samples)["median"] / TARGET_PCT}  # fmt: skip
        print(f"{source}: median {results[source]['cpu_pct_of_one_core']['median']:.2f}% of one core at 10 Hz")
    emulated_cpu_time = "cgroup" if group is not None else "process tree (no root)"
    path = write("telemetry", {"interval_ms": 100, "seconds": args.seconds, "target_pct": TARGET_PCT,
                               "emulated_cpu_time_from": emulated_cpu_time, "sources": results})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
