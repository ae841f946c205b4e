"""Delay, jitter and loss on the delay path this kernel takes (NFQUEUE without sch_netem, netem with it):
the targets of issue 26, on a three-node emulated testbed (a and c send to b).

- RTT at 1, 5, 20 and 50 ms, idle (ping -U, user to user), against the configured round trip.
- RTT under 40 mbit of TCP: the load c -> b goes through b's delay handler beside a's pings (the
  handler's own error), and the load a -> b in the pings' own class (which adds HTB's queue, a real
  link's queueing, reported apart).
- Jitter: a -> b 20 ms with 5 ms normal jitter, the way back without: the RTT's standard deviation.
- Goodput: iperf3 TCP over 40 mbit + 20 ms each way, against 40 mbit without delay.
- Loss 1, 5 and 20 %: one-way, over 100k UDP datagrams each.
- The handler's CPU per 10k packets/s and its delay error as the packet rate grows (UDP a -> b with
  5 ms), and the rate where the RTT error passes 1 ms.
- SIGKILL of `testbed link apply` at random moments, then `link clear`: no rule, no handler, and the
  interfaces and mangle tables as before.

Writes bench/results/link_delay.json. Needs root (network namespaces). About 4 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emulated_inventory, emulated_lab, emulated_node, summary, write
from netem.profile import DirectedLink, LinkProfile
from testbed.links.apply import apply_plans, clear_nodes
from testbed.links.handler_lifecycle import handler_files
from testbed.links.plans import compile_plan

PREFIX = "tbd"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_TIME = re.compile(r"time=([\d.]+) ms")


def inventory_text(state_dir: Path) -> str:
    return emulated_inventory(state_dir, PREFIX, 219, [
        emulated_node("a", "jetson", "agx-orin", "device", ((0, "MAXN", 1.0, 5, 20),)),
        emulated_node("b", "server", "s", "server", ((0, "default", 1.0, 5, 20),)),
        emulated_node("c", "jetson", "agx-orin", "device", ((0, "MAXN", 1.0, 5, 20),))])


def netns(node: str, *argv: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", f"{PREFIX}-{node}", *argv], capture_output=True, text=True,
                          timeout=timeout_s, check=check)  # fmt: skip


def shape(lab, links: list[tuple[str, str, dict]]) -> None:
    directed = tuple(DirectedLink(a, b, "bench", LinkProfile.model_validate(p)) for a, b, p in links)
    result = apply_plans(lab, compile_plan(lab, directed))
    if not result.ok:
        raise SystemExit(f"applying {links} failed: {[o.error for o in result.applied.failed]}")


def address(lab, node: str) -> str:
    return lab.node(node).data.address


def ping_rtts_ms(lab, src: str, dst: str, count: int, interval_s: float) -> list[float]:
    out = netns(src, "ping", "-U", "-c", str(count), "-i", f"{interval_s:g}", "-I", address(lab, src),
                address(lab, dst), timeout_s=count * interval_s + 30, check=False)  # fmt: skip
    return [float(x) for x in _TIME.findall(out.stdout)]


def rtt_row(rtts: list[float], target_ms: float) -> dict:
    return {"target_ms": target_ms, "n": len(rtts), "mean_ms": round(statistics.mean(rtts), 4),
            "median_ms": round(statistics.median(rtts), 4), "std_ms": round(statistics.pstdev(rtts), 4),
            "p99_ms": round(sorted(rtts)[int(0.99 * (len(rtts) - 1))], 4),
            "error_mean_ms": round(statistics.mean(rtts) - target_ms, 4)}  # fmt: skip


class Iperf3Server:
    def __init__(self, lab, node: str, port: int) -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", f"{PREFIX}-{node}", "iperf3", "-s", "-1", "-J", "-B", address(lab, node),
             "-p", str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        time.sleep(0.3)

    def result(self) -> dict:
        out, _ = self.proc.communicate(timeout=60)
        return json.loads(out or "{}")


def iperf3(lab, src: str, dst: str, port: int, *extra: str, seconds: float) -> dict:
    server = Iperf3Server(lab, dst, port)
    client = netns(src, "iperf3", "-c", address(lab, dst), "-B", address(lab, src), "-p", str(port), "-t",
                   f"{seconds:g}", "-J", *extra, timeout_s=seconds + 60, check=False)  # fmt: skip
    received = server.result()
    report = json.loads(client.stdout or "{}")
    return {"client": report, "server": received}


def tcp_goodput_bit_s(report: dict) -> float:
    return report["client"]["end"]["sum_received"]["bits_per_second"]


def handler_pid(lab_dir: Path, node: str) -> int | None:
    needle = f"{lab_dir}/nodes/{node}/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "link_delay_handler.py" in cmd and needle in cmd:
            return int(proc.name)
    return None


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def handler_stats(lab_dir: Path, node: str, since_unix_s: float) -> list[dict]:
    path = Path(handler_files(str(lab_dir / "nodes" / node / "home" / "hil-testbed" / "netem"))["stats"])
    rows = [json.loads(line) for line in path.read_text().splitlines() if '"stats"' in line]
    return [r for r in rows if r["unix_s"] >= since_unix_s and r["packets"]]


def idle_rtt(lab, rtts_ms: list[float]) -> list[dict]:
    rows = []
    shape(lab, [])  # nothing shaped: the veth's own round trip
    base = rtt_row(ping_rtts_ms(lab, "a", "b", 100, 0.01), 0.0)
    rows.append({"configured_rtt_ms": 0, **base})
    for rtt in rtts_ms:
        one_way = {"delay": f"{rtt / 2:g}ms"}
        shape(lab, [("a", "b", one_way), ("b", "a", one_way)])
        row = rtt_row(ping_rtts_ms(lab, "a", "b", 200, 0.01), rtt)
        rows.append({"configured_rtt_ms": rtt, **row, "within_0_5_ms": abs(row["error_mean_ms"]) <= 0.5})
        print(f"idle RTT {rtt:>4g} ms: mean {row['mean_ms']:.3f} median {row['median_ms']:.3f} "
              f"(error {row['error_mean_ms']:+.3f} ms)")  # fmt: skip
    return rows


def loaded_rtt(lab, lab_dir: Path) -> dict:
    link = {"rate": "40mbit", "delay": "10ms"}
    shape(lab, [(x, y, link) for x, y in (("a", "b"), ("b", "a"), ("c", "b"), ("b", "c"))])
    out = {}
    for name, sender in (("load_beside_the_pings_c_to_b", "c"), ("load_in_the_pings_class_a_to_b", "a")):
        server = Iperf3Server(lab, "b", 5411)
        load = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}-{sender}", "iperf3", "-c", address(lab, "b"),
                                 "-p", "5411", "-t", "14", "-J"], stdout=subprocess.PIPE, text=True)  # fmt: skip
        time.sleep(2.0)  # past slow start
        since = time.time()
        rtts = ping_rtts_ms(lab, "a", "b", 300, 0.03)
        late = [r["late_max_ms"] for r in handler_stats(lab_dir, "b", since)]
        load_report = json.loads(load.communicate(timeout=60)[0] or "{}")
        server.result()
        row = rtt_row(rtts, 20.0)
        row["load_goodput_mbit"] = round(load_report["end"]["sum_received"]["bits_per_second"] / 1e6, 3)
        row["handler_late_max_ms"] = round(max(late), 4) if late else None
        row["within_2_ms"] = abs(row["error_mean_ms"]) <= 2.0
        out[name] = row
        print(f"RTT 20 ms with 40 mbit TCP {sender}->b: mean {row['mean_ms']:.3f} ms, p99 {row['p99_ms']:.3f}, "
              f"load {row['load_goodput_mbit']} mbit")  # fmt: skip
    return out


def jitter(lab) -> dict:
    shape(lab, [("a", "b", {"delay": "20ms", "jitter": "5ms", "distribution": "normal"})])
    rtts = ping_rtts_ms(lab, "a", "b", 300, 0.05)
    row = rtt_row(rtts, 20.0)
    row.update(configured_jitter_std_ms=5.0, std_ratio=round(row["std_ms"] / 5.0, 4),
               within_15_pct=abs(row["std_ms"] / 5.0 - 1) <= 0.15)
    print(f"jitter 5 ms normal: RTT std {row['std_ms']:.3f} ms (ratio {row['std_ratio']:.3f})")
    return row


def goodput(lab, seconds: float) -> dict:
    out = {}
    for name, profile in (("htb_only", {"rate": "40mbit"}), ("htb_and_20ms_each_way", {"rate": "40mbit",
                                                                                        "delay": "20ms"})):
        shape(lab, [("a", "b", profile), ("b", "a", profile)])
        out[name + "_mbit"] = round(tcp_goodput_bit_s(iperf3(lab, "a", "b", 5412, "-O", "2", seconds=seconds)) / 1e6,
                                    3)  # fmt: skip
    out["ratio"] = round(out["htb_and_20ms_each_way_mbit"] / out["htb_only_mbit"], 4)
    out["within_15_pct"] = abs(out["ratio"] - 1) <= 0.15
    print(f"goodput 40 mbit: {out['htb_only_mbit']} without delay, {out['htb_and_20ms_each_way_mbit']} with "
          f"20 ms each way (ratio {out['ratio']})")  # fmt: skip
    return out


def loss(lab, packets: int) -> list[dict]:
    rows = []
    for pct in (0, 1, 5, 20):
        shape(lab, [("a", "b", {"rate": "100mbit", **({"loss": f"{pct}%"} if pct else {})})])
        seconds = packets / 10_000  # 500-byte datagrams at 40 mbit: 10k a second
        report = iperf3(lab, "a", "b", 5413, "-u", "-b", "40M", "-l", "500", seconds=seconds)
        got = report["client"]["end"]["sum_received"]
        measured = 100 * got["lost_packets"] / got["packets"]
        row = {"configured_pct": pct, "packets": got["packets"], "lost": got["lost_packets"],
               "measured_pct": round(measured, 4)}  # fmt: skip
        if pct:
            row["relative_error"] = round(measured / pct - 1, 4)
            row["within_10_pct_relative"] = abs(measured / pct - 1) <= 0.10
        rows.append(row)
        print(f"loss {pct:>2}%: measured {measured:.3f}% over {got['packets']} datagrams")
    return rows


def handler_load(lab, lab_dir: Path, rates_pps: list[int], seconds: float) -> list[dict]:
    shape(lab, [("a", "b", {"delay": "5ms"})])
    pid = handler_pid(lab_dir, "b")
    rows = []
    for pps in rates_pps:
        server = Iperf3Server(lab, "b", 5414)
        sender = subprocess.Popen(
            ["ip", "netns", "exec", f"{PREFIX}-a", "iperf3", "-c", address(lab, "b"), "-p", "5414", "-u", "-l", "100",
             "-b", str(pps * 100 * 8), "-t", f"{seconds:g}", "-J"], stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(1.0)
        since, cpu0, t0 = time.time(), cpu_s(pid), time.monotonic()
        rtts = ping_rtts_ms(lab, "a", "b", int((seconds - 2) / 0.05), 0.05)
        cpu = (cpu_s(pid) - cpu0) / (time.monotonic() - t0)
        report = json.loads(sender.communicate(timeout=60)[0] or "{}")
        server.result()
        got = report["end"]["sum_received"]
        stats = handler_stats(lab_dir, "b", since)
        handled = sum(r["packets"] for r in stats) / max(1, len(stats))
        row = rtt_row(rtts, 5.0) if rtts else {"n": 0}
        row.update(
            offered_pps=pps, received_pps=round(got["packets"] / got["seconds"] - got["lost_packets"] / got["seconds"]),
            lost_pct=round(got["lost_percent"], 3), handler_pps=round(handled), handler_cpu_share=round(cpu, 4),
            handler_cpu_per_10k_pps=round(cpu / max(handled, 1) * 1e4, 4),
            handler_late_max_ms=round(max(r["late_max_ms"] for r in stats), 3) if stats else None,
            handler_late_mean_ms=round(statistics.mean(r["late_mean_ms"] for r in stats if r["late_mean_ms"]), 4)
            if stats else None,
        )  # fmt: skip
        rows.append(row)
        print(f"{pps:>6} pps offered: handler {row['handler_pps']} pps at {cpu:.2f} CPU, RTT error "
              f"{row.get('error_mean_ms')} ms, lost {row['lost_pct']}%")  # fmt: skip
    return rows


def killed_applies(lab, lab_dir: Path, inventory: Path, trials: int, seed: int) -> list[dict]:
    links = lab_dir.parent / "kill-links.yaml"
    links.write_text(
        "link_profiles:\n  lan: {rate: 40mbit, delay: 10ms, jitter: 1ms}\n"
        "  lossy: {rate: 8mbit, delay: 5ms, loss: 2%}\n"
        "links:\n  - {from: a, to: b, profile: lan, symmetric: true}\n"
        "  - {from: c, to: b, profile: lossy, symmetric: true}\n"
    )  # fmt: skip
    assert clear_nodes(lab).ok

    def state() -> dict:
        return {n: (netns(n, "tc", "-j", "qdisc", "show", "dev", "data0").stdout,
                    netns(n, "iptables", "-w", "-t", "mangle", "-S").stdout) for n in ("a", "b", "c")}  # fmt: skip

    before = state()
    rng = random.Random(seed)
    rows = []
    for trial in range(trials):
        wait_s = rng.uniform(0.05, 0.75)  # an apply of these links takes about 0.8 s
        proc = subprocess.Popen([sys.executable, "-m", "testbed", "link", "apply", "-i", str(inventory), "--links",
                                 str(links)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
        time.sleep(wait_s)
        finished = proc.poll() is not None
        if not finished:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(1.0)  # what the killed controller had sent lands
        handlers_before_clear = sum(handler_pid(lab_dir, n) is not None for n in ("a", "b", "c"))
        cleared = subprocess.run([sys.executable, "-m", "testbed", "link", "clear", "-i", str(inventory)],
                                 capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        after = state()
        row = {"trial": trial, "killed_after_s": round(wait_s, 3), "apply_had_finished": finished,
               "handlers_running_at_kill": handlers_before_clear, "clear_exit": cleared.returncode,
               "handlers_left": sum(handler_pid(lab_dir, n) is not None for n in ("a", "b", "c")),
               "interfaces_and_rules_as_before": after == before}  # fmt: skip
        rows.append(row)
        print(f"kill after {wait_s:.2f} s: {handlers_before_clear} handlers up, clear exit {cleared.returncode}, "
              f"as before: {row['interfaces_and_rules_as_before']}")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtts", type=float, nargs="+", default=[1, 5, 20, 50], help="round trips to check, ms")
    parser.add_argument("--loss-packets", type=int, default=100_000)
    parser.add_argument("--rates-pps", type=int, nargs="+",
                        default=[5000, 10000, 20000, 40000, 60000, 80000, 100000, 130000])
    parser.add_argument("--load-seconds", type=float, default=7.0)
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--output", default="link_delay")
    args = parser.parse_args()
    with emulated_lab(inventory_text) as lab:
        lab_dir = Path(lab.spec.emulation.state_dir)
        probe_path = "nfqueue" if not Path("/sys/module/sch_netem").exists() else "netem"
        payload = {
            "delay_path": probe_path,
            "idle_rtt": idle_rtt(lab, args.rtts),
            "rtt_under_40mbit_tcp": loaded_rtt(lab, lab_dir),
            "jitter": jitter(lab),
            "goodput_40mbit": goodput(lab, 10.0),
            "loss": loss(lab, args.loss_packets),
            "handler_load": handler_load(lab, lab_dir, args.rates_pps, args.load_seconds),
            "killed_applies": killed_applies(lab, lab_dir, lab.path, args.kills, 26),
        }
        assert clear_nodes(lab).ok
    over = [r["offered_pps"] for r in payload["handler_load"] if abs(r.get("error_mean_ms", 99)) > 1.0]
    payload["delay_error_exceeds_1ms_from_pps"] = min(over) if over else None
    cpu = [r["handler_cpu_per_10k_pps"] for r in payload["handler_load"] if r["received_pps"] >= 0.9 * r["offered_pps"]]
    payload["handler_cpu_per_10k_pps_median"] = statistics.median(cpu) if cpu else None
    payload["summary_rtt_error_ms"] = summary([abs(r["error_mean_ms"]) for r in payload["idle_rtt"][1:]])
    print(write(args.output, payload))


if __name__ == "__main__":
    main()
