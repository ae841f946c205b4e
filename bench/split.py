"""Where a split-inference prefill spends its time: device compute, upload, server queue, server
compute, download, for 128-, 512- and 2048-token prompts over a 5 MB/s data link (HAT's WiFi uplink
is 5-10 MB/s), on a two-node emulated testbed (one device at the orin's MAXN quota, a server with
P=2 stages, the tiny model with m=2, ushape).

Upload and download come from one clock: the emulated nodes share the host kernel's
CLOCK_MONOTONIC, so the server's arrival/departure stamps and the device's send/receive stamps are
comparable here (on separate machines only their sum, network = round trip - server residence, is).
Writes bench/results/split.json with the median of each phase over the repeats. Needs root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import emulated_inventory, emulated_lab, emulated_node, write
from netem.profile import DirectedLink, LinkProfile
from testbed.links.apply import apply_plans, clear_nodes
from testbed.links.plans import compile_plan
from testbed.workers.split_run import run_split
from testbed.workers.split_spec import SplitRunSpec

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
PROMPT_TOKENS = (128, 512, 2048)
PHASES = (
    "device_queue_s",
    "device_compute_s",
    "upload_s",
    "server_queue_s",
    "server_compute_s",
    "server_pipeline_s",
    "download_s",
)


def inventory_text(state_dir: Path) -> str:
    return emulated_inventory(state_dir, "tbm", 216, [
        emulated_node("server", "server", "s", "server", ((0, "default", 1.0, 90, 300),)),
        emulated_node("device", "jetson", "agx-orin", "device", ((0, "MAXN", 0.5, 7, 40),))])


def prompt_ids(count: int) -> list[int]:
    """``count`` tokens of real text (this repository's engine source) in the tiny model's vocabulary."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    text = "".join(p.read_text() for p in sorted((REPO / "nodes").rglob("*.py")))
    ids = tokenizer.encode(text).ids
    return ids[:count]


def phases(request: dict, origin_s: float) -> dict[str, float]:
    p = request["prefill"]
    sent_abs = origin_s + request["upload_start_s"]
    received_abs = sent_abs + p["round_trip_s"]
    pipeline = p["server_residence_s"] - p["server_queue_s"] - p["server_compute_s"]
    return {
        "device_queue_s": request["start_s"] - request["arrival_s"],  # behind this device's earlier requests
        "device_compute_s": p["device_head_s"] + p["device_tail_s"],
        "upload_s": p["server_arrival_monotonic_s"] - sent_abs,
        "server_queue_s": p["server_queue_s"],
        "server_compute_s": p["server_compute_s"],
        "server_pipeline_s": pipeline,  # hand-over between stages beyond their compute
        "download_s": received_abs - p["server_depart_monotonic_s"],
        "ttft_s": request["ttft_s"],
        "ttft_from_start_s": request["first_token_s"] - request["start_s"],
        "upload_bytes": p["upload_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate", default="5MBps", help="data link rate, both directions")
    parser.add_argument("--output", default="split", help="name of the JSON file in bench/results")
    args = parser.parse_args()
    rows = []
    with emulated_lab(inventory_text) as lab, tempfile.TemporaryDirectory() as tmp:
        profile = LinkProfile.model_validate({"rate": args.rate})
        links = (
            DirectedLink("device", "server", "bench", profile),
            DirectedLink("server", "device", "bench", profile),
        )
        if not apply_plans(lab, compile_plan(lab, links)).ok:
            raise SystemExit(f"shaping the link at {args.rate} failed")
        schedule = []
        for size in PROMPT_TOKENS:
            ids = prompt_ids(size)
            for _ in range(args.repeats):
                schedule.append({"request_id": len(schedule), "arrival_s": 0.0, "prompt_ids": ids, "max_new_tokens": 1})
        spec = SplitRunSpec(
            method="ushape", model=str(TINY), server="server", devices=("device",), stages=2, device_layers=2,
            schedule=tuple(schedule), run_id="bench-split", timeout_s=600,
        )  # fmt: skip
        result = run_split(lab, spec, Path(tmp) / "out")
        device_dir = next(d for d in result.rank_dirs if d.name.startswith("device-"))
        header = json.loads((device_dir / "requests.jsonl").read_text().splitlines()[0][2:])
        for request in result.requests():
            rows.append(
                {"prompt_tokens": request["prompt_tokens"], **phases(request, header["clock_origin_monotonic_s"])}
            )
        clear_nodes(lab)
    table = []
    for size in PROMPT_TOKENS:
        mine = [r for r in rows if r["prompt_tokens"] == size]
        entry = {"prompt_tokens": size, "requests": len(mine)}
        for key in (*PHASES, "ttft_s", "ttft_from_start_s"):
            entry[key + "_median"] = round(statistics.median(r[key] for r in mine), 4)
        entry["upload_bytes"] = mine[0]["upload_bytes"]
        entry["upload_at_link_rate_s"] = round(
            mine[0]["upload_bytes"] / LinkProfile.model_validate({"rate": args.rate}).rate_bit_s * 8, 4
        )
        table.append(entry)
        print(
            f"{size:>5} tokens: "
            + "  ".join(f"{k[:-2]} {entry[k + '_median'] * 1e3:7.1f} ms" for k in (*PHASES, "ttft_s"))
        )
    payload = {
        "method": f"ushape, tiny model (m=2, P=2, fp32), one device at 0.5 CPU, server at 1 CPU, link {args.rate} "
        f"both ways, {args.repeats} requests per size, all arriving at 0 and served one after another by the device "
        "(device_queue_s is the wait behind earlier ones; ttft_from_start_s excludes it), medians",
        "results": table,
    }
    print(write(args.output, payload))


if __name__ == "__main__":
    main()
