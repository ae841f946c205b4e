"""HAT's 30-Jetson lab on this machine: bring-up time, one short run of every rank (HAT, Vicuna-7B
emulated), the ranks' memory and the CPU they leave free, and tear-down time.

    python bench/hat_lab.py                    # 1 request per device, dilation 4
    python bench/hat_lab.py --requests 2 --dilation 6
    python bench/hat_lab.py --inventory examples/inventories/hat-lab-4.yaml \
        --model examples/models/smollm2-135m --draft examples/drafts/smollm2-135m-m2 --dilation 8

``--inventory`` and ``--model`` run another lab and checkpoint (``--draft``: its draft adapter);
the machine's available memory (MemAvailable) is sampled beside the ranks', its lowest reported.

Per rank: its resident memory at the end of serving (the largest sample). CPU headroom: the share of
this machine's CPU time left idle while the ranks served (from /proc/stat, sampled every second).
CPU by kind: the cores busy on average in device ranks, server ranks, other processes of the nodes
(telemetry samplers, shells) and the host's own (controller, sshd, mpirun). Fidelity: each node's
share of paced steps that overran (the run's manifest).

Writes bench/results/hat_lab.json (hat_lab_<inventory>_<model>.json for another lab or model). Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import machine_cpu_s, write
from bench.campaign import REPO, testbed

INVENTORY = REPO / "examples" / "inventories" / "hat-lab.yaml"
TINY = REPO / "examples" / "models" / "tiny"


def memory_available_gb() -> float:
    """The machine's MemAvailable (/proc/meminfo), in GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def process_kind(words: list[bytes], state_dir: str) -> str:
    """What a process is to this lab: a server or device rank, another process of a node (telemetry
    sampler, shell), or the host's (controller, sshd, mpirun, anything else)."""
    nodes = f"{state_dir}/nodes/".encode()
    node = next((w[len(nodes):].split(b"/", 1)[0] for w in words if w.startswith(nodes)), None)
    if node is None:
        return "host"
    if b"nodes.workers" in words:
        return "server ranks" if node == b"server" else "device ranks"
    return "node tools"


def process_cpu_ticks(state_dir: str) -> dict[int, tuple[str, int]]:
    """Every live process's kind and CPU ticks so far (user + system, /proc/PID/stat)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(entry.name)] = (process_kind(words, state_dir), int(fields[11]) + int(fields[12]))
    return out


def worker_memory_mb(state_dir: str) -> dict[int, tuple[float, float]]:
    """Resident and proportional memory (RSS, PSS) of this lab's worker ranks (python -m nodes.workers
    under its state directory). RSS counts every shared page (libtorch's text, the model file) whole in
    each rank; PSS divides a shared page among the ranks that map it, so PSS summed over the ranks is
    what they take from the machine."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
            if b"nodes.workers" not in words or not any(state_dir.encode() in w for w in words):
                continue
            if not os.path.basename(words[0]).startswith(b"python"):
                continue  # mpiexec and its proxy name the worker module too
            rollup = dict(line.split(":", 1) for line in (entry / "smaps_rollup").read_text().splitlines()[1:])
        except (OSError, ValueError):
            continue
        out[int(entry.name)] = (int(rollup["Rss"].split()[0]) / 1024, int(rollup["Pss"].split()[0]) / 1024)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1, help="requests per device")
    parser.add_argument("--dilation", type=float, default=4.0)
    parser.add_argument("--method", default="hat")
    parser.add_argument("--slots", type=int, default=1, help="device ranks per board (device_slots)")
    parser.add_argument("--inventory", default=str(INVENTORY), help="the lab (default: HAT's 30 boards)")
    parser.add_argument("--model", default=str(TINY), help="the checkpoint computing the tokens")
    parser.add_argument("--draft", help="the model's draft adapter (default: MODEL/draft)")
    args = parser.parse_args()
    inventory, model = Path(args.inventory).resolve(), Path(args.model).resolve()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the emulated testbed builds network namespaces")
    from testbed.emulation.lifecycle import down, up
    from testbed.emulation.plan import state_dir_of
    from testbed.inventory import load_inventory

    lab = load_inventory(inventory)
    work = Path(tempfile.mkdtemp(prefix="bench-hat-lab-"))
    started = time.monotonic()
    if not up(lab, say=lambda _: None).ok:
        raise SystemExit("could not bring the HAT lab up")
    up_s = time.monotonic() - started
    state = str(state_dir_of(lab))
    campaign = work / "hat-lab-short.yaml"
    from nodes.contracts.methods import method_named

    # draft settings for a method that drafts (a campaign refuses settings no run uses)
    adapter = f"adapter: {Path(args.draft).resolve()}, " if args.draft else ""
    drafts = method_named(args.method).drafts
    draft = f"  draft: {{{adapter}eta: 0.6, max_draft_tokens: 8, top_k: 3}}\n" if drafts else ""
    campaign.write_text(f"""name: hat-lab-short
inventory: {inventory}
base:
  method: {args.method}
  model: {model}
  partition: {{device_layers: 2, stages: 4}}
  devices: [devices]
  workload: {{arrival: poisson, rate_per_s: 0.1333, requests_per_device: {args.requests}, prompts: specbench,
             max_new_tokens: 32}}
{draft}  target: {{model: vicuna-7b, dilation: {args.dilation}}}
  telemetry: {{interval_ms: 1000}}
  device_slots: {args.slots}
  drain_s: 0.5
run_timeout_s: 1800
""")
    samples: list[dict[str, Any]] = []
    done = threading.Event()
    tick_s = 1 / os.sysconf("SC_CLK_TCK")

    def sample() -> None:
        last = (time.monotonic(), machine_cpu_s(), process_cpu_ticks(state))
        while not done.wait(1.0):
            now, cpu, ticks = time.monotonic(), machine_cpu_s(), process_cpu_ticks(state)
            memory = worker_memory_mb(state)
            available_gb = memory_available_gb()
            busy = (cpu - last[1]) / (now - last[0])
            by_kind: dict[str, float] = {}
            for pid, (kind, used) in ticks.items():  # a process that began since the last sample counts whole
                before = last[2][pid][1] if pid in last[2] else 0
                by_kind[kind] = by_kind.get(kind, 0.0) + (used - before) * tick_s / (now - last[0])
            last = (now, cpu, ticks)
            if memory:
                samples.append({"ranks": len(memory), "rss_mb": sorted(r for r, _ in memory.values()),
                                "pss_mb": sorted(p for _, p in memory.values()), "busy_cpus": busy,
                                "busy_cpus_by_kind": by_kind, "available_gb": available_gb})  # fmt: skip

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        run_started = time.monotonic()
        status = testbed("run", str(campaign), "--out", str(work / "out"), log=work / "run.log").wait()
        run_s = time.monotonic() - run_started
    finally:
        done.set()
        thread.join()
        started = time.monotonic()
        down(load_inventory(inventory), say=lambda _: None)
        down_s = time.monotonic() - started
    manifests = [json.loads(p.read_text()) for p in (work / "out" / "runs").glob("*/manifest.json")]
    most = max((s["ranks"] for s in samples), default=0)
    serving = [s for s in samples if s["ranks"] == most]  # every rank up
    cores = os.cpu_count() or 1
    result = {
        "command": " ".join(["python", "bench/hat_lab.py", *sys.argv[1:]]),
        "inventory": str(inventory), "model": str(model), "draft": args.draft,
        "nodes": len(lab.nodes), "bring_up_s": round(up_s, 2), "tear_down_s": round(down_s, 2),
        "machine_memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "machine_memory_available_min_gb": round(min((s["available_gb"] for s in samples), default=0.0), 2),
        "run_exit_status": status, "run_wall_s": round(run_s, 1),
        "ranks_seen": max((s["ranks"] for s in samples), default=0),
        "rank_rss_mb": {"median": round(sorted(r for s in serving for r in s["rss_mb"])[len(
            [r for s in serving for r in s["rss_mb"]]) // 2], 1) if serving else None,
            "max": round(max((max(s["rss_mb"]) for s in serving), default=0.0), 1),
            "total_max": round(max((sum(s["rss_mb"]) for s in serving), default=0.0), 1)},
        "rank_pss_mb": {"median": statistics.median(p for s in serving for p in s["pss_mb"]) if serving else None,
                        "total_max": round(max((sum(s["pss_mb"]) for s in serving), default=0.0), 1)},
        "cpu_headroom_share": round(1 - sum(s["busy_cpus"] for s in serving) / len(serving) / cores, 3)
        if serving else None,
        "busy_cpus_by_kind": {kind: round(sum(s["busy_cpus_by_kind"].get(kind, 0.0) for s in serving)
                                          / len(serving), 3)
                              for kind in ("device ranks", "server ranks", "node tools", "host")} if serving else None,
        "fidelity": [m.get("fidelity") for m in manifests],
        "runs": [{"status": m["status"], "reason": m["reason"], "requests": m["requests"]} for m in manifests],
    }  # fmt: skip
    default = inventory == INVENTORY.resolve() and model == TINY.resolve()
    path = write("hat_lab" if default else f"hat_lab_{inventory.stem}_{model.name}", result)
    print(json.dumps({k: v for k, v in result.items() if k != "fidelity"}, indent=1))
    print(f"wrote {path}; campaign in {work}")


if __name__ == "__main__":
    main()
