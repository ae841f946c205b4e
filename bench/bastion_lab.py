"""The demo campaign on the emulated lab reached as a real lab is, against the same lab reached directly.

Two labs of the default inventory's nodes: one reached directly as root (as `make demo` does), one
behind a bastion (``emulation.bastion``: this machine has no route into it but to the bastion) as a
non-root SSH user whose sudo allows only the printed rules (``emulation.ssh_user``). The demo campaign
(examples/campaigns/demo.yaml, 8 runs) runs on each; every run must be done, each run's tokens must be
the same on both, and nothing may be left set on the nodes (qdiscs, iptables chains, power modes,
journals, delay handlers).

    python bench/bastion_lab.py            # as root; about 6 minutes on 2 cores
    python bench/bastion_lab.py --lab hat  # HAT's 31-node lab, one HAT run (1 request a board), ~10 minutes

Writes bench/results/bastion_lab.json (``--lab hat``: bastion_lab_hat.json). Brings its labs up and down
(prefixes bld/blb, subnets 10.164-167).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd

from bench._common import left_on_nodes, write

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "examples" / "campaigns" / "demo.yaml"
USER = f"blbuser{os.getpid() % 10000}"


def _cli(*args: str, timeout_s: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, check=False)  # fmt: skip


HAT_LAB = REPO / "examples" / "inventories" / "hat-lab.yaml"
HAT_EMULATION = "emulation: {management_subnet: 10.241.0.0/24, data_subnet: 10.242.0.0/24, name_prefix: hat}"


def lab_inventory(directory: Path, prefix: str, octet: int, user: str | None, lab: str = "demo") -> Path:
    """The default inventory (``lab`` hat: HAT's lab) under its own prefix, subnets and state; with
    ``user``: behind a bastion, as it."""
    if lab == "hat":
        extra = f", ssh_user: {user}, sudo_rules: printed, bastion: true" if user else ""
        text = HAT_LAB.read_text().replace(HAT_EMULATION, (
            f"emulation: {{management_subnet: 10.{octet}.0.0/24, data_subnet: 10.{octet + 1}.0.0/24, "
            f"name_prefix: {prefix}, state_dir: {directory / 'state'}{extra}}}"))  # fmt: skip
        assert text != HAT_LAB.read_text(), "hat-lab.yaml's emulation line changed"
    else:
        text = (REPO / "inventory.yaml").read_text()
        text = text.replace("10.231.0.0/24", f"10.{octet}.0.0/24").replace("10.232.0.0/24", f"10.{octet + 1}.0.0/24")
        extra = f"\n  ssh_user: {user}\n  sudo_rules: printed\n  bastion: true" if user else ""
        text = text.replace("name_prefix: tb", f"name_prefix: {prefix}\n  state_dir: {directory / 'state'}{extra}")
    path = directory / "inventory.yaml"
    path.write_text(text)
    return path


def hat_campaign(directory: Path) -> Path:
    """One HAT run on HAT's lab (examples/campaigns/hat-lab-rates.yaml's base at 4 requests/s), each board
    sending one request of 16 tokens."""
    text = (REPO / "examples" / "campaigns" / "hat-lab-rates.yaml").read_text()
    text = text.replace("../models/tiny", str(REPO / "examples" / "models" / "tiny"))
    text = text.replace("    requests_per_device: 4\n", "    requests_per_device: 1\n")
    text = text.replace("    max_new_tokens: 48\n", "    max_new_tokens: 16\n")
    matrix = "  method: [ushape, usarathi, hat]\n  workload.rate_per_s: [0.1333, 0.2, 0.3]"
    text = text.replace(matrix, "  method: [hat]")
    assert "method: [hat]" in text and "requests_per_device: 1" in text, "hat-lab-rates.yaml changed"
    path = directory / "hat-campaign.yaml"
    path.write_text(text)
    return path


def run_demo(inventory: Path, out: Path, campaign: Path = DEMO) -> dict:
    started = time.monotonic()
    ran = _cli("run", str(campaign), "-i", str(inventory), "--out", str(out), "--json", timeout_s=2400)
    wall_s = time.monotonic() - started
    if ran.returncode != 0:
        raise SystemExit(f"the demo failed on {inventory}: {ran.stdout[-3000:]}{ran.stderr[-3000:]}")
    runs = json.loads(ran.stdout)["runs"]
    tokens = {r["run_id"]: pd.read_parquet(out / "runs" / r["run_id"] / "tokens.parquet") for r in runs}
    return {"runs": runs, "tokens": tokens, "wall_s": round(wall_s, 1)}


def on_lab(prefix: str, octet: int, user: str | None, lab: str) -> dict:
    directory = Path(tempfile.mkdtemp(prefix=f"bench-{prefix}-"))
    directory.chmod(0o711)  # the SSH user passes through to the lab's state
    inventory = lab_inventory(directory, prefix, octet, user, lab)
    campaign = hat_campaign(directory) if lab == "hat" else DEMO
    up = _cli("emulate", "up", "-i", str(inventory), timeout_s=300)
    if up.returncode != 0:
        raise SystemExit(up.stdout + up.stderr)
    try:
        lab = json.loads(_cli("inventory", "show", "-i", str(inventory), "--json").stdout)
        orin = next(n for n in lab["spec"]["nodes"] if n["name"].startswith("orin"))
        route = subprocess.run(["ip", "route", "get", orin["address"]], capture_output=True, text=True, check=False)
        result = run_demo(inventory, directory / "out", campaign)
        manifest = json.loads(next((directory / "out" / "runs").glob("*/manifest.json")).read_text())
        result.update(reached_orin=manifest["inventory"]["reached"][orin["name"]]["ssh"],
                      direct_route_to_orin=route.stdout.strip() or route.stderr.strip(),
                      left_set=left_on_nodes(prefix, directory / "state"))  # fmt: skip
    finally:
        down = _cli("emulate", "down", "-i", str(inventory), timeout_s=300)
        if down.returncode != 0:
            print(down.stdout + down.stderr, file=sys.stderr)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lab", choices=("demo", "hat"), default="demo",
                        help="demo: the default inventory and the demo campaign; hat: HAT's lab, one HAT run")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the emulated testbed builds network namespaces")
    direct = on_lab("bld", 164, None, args.lab)
    bastion = on_lab("blb", 166, USER, args.lab)
    key = ["node", "request_id", "index"]
    compared = []
    for run_id, tokens in direct["tokens"].items():
        other = bastion["tokens"].get(run_id)
        merged = tokens.merge(other, on=key, suffixes=("_direct", "_bastion")) if other is not None else tokens[:0]
        compared.append({"run_id": run_id, "tokens_direct": len(tokens),
                         "tokens_bastion": 0 if other is None else len(other),
                         "identical": other is not None and len(merged) == len(tokens) == len(other)
                         and bool((merged.token_id_direct == merged.token_id_bastion).all())})  # fmt: skip
    payload = {
        "campaign": str(DEMO.relative_to(REPO)) if args.lab == "demo" else
        "examples/campaigns/hat-lab-rates.yaml, method hat at 4 requests/s, 1 request of 16 tokens a board",
        "command": "python bench/bastion_lab.py" + (" --lab hat" if args.lab == "hat" else ""),
        "direct": {"runs_done": sum(r["state"] == "done" for r in direct["runs"]), "runs": len(direct["runs"]),
                   "wall_s": direct["wall_s"], "reached_orin": direct["reached_orin"],
                   "left_set": direct["left_set"]},
        "bastion": {"runs_done": sum(r["state"] == "done" for r in bastion["runs"]), "runs": len(bastion["runs"]),
                    "wall_s": bastion["wall_s"], "ssh_user": USER, "reached_orin": bastion["reached_orin"],
                    "direct_route_to_orin": bastion["direct_route_to_orin"], "left_set": bastion["left_set"]},
        "runs_with_identical_tokens": sum(c["identical"] for c in compared),
        "runs_compared": compared,
    }  # fmt: skip
    path = write("bastion_lab" if args.lab == "demo" else "bastion_lab_hat", payload)
    print(json.dumps({k: v for k, v in payload.items() if k != "runs_compared"}, indent=2))
    print(f"wrote {path}")
    return 0 if payload["runs_with_identical_tokens"] == len(compared) == payload["bastion"]["runs_done"] else 1


if __name__ == "__main__":
    sys.exit(main())
