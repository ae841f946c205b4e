"""Every example campaign's dry run (``testbed run CAMPAIGN --dry-run --json``) into one directory, a
JSON file per campaign, so that two trees' plans can be compared command for command (``diff -r``).

    .venv/bin/python scripts/dry_run_commands.py /tmp/plans-before
    (change the code)
    .venv/bin/python scripts/dry_run_commands.py /tmp/plans-after && diff -r /tmp/plans-before /tmp/plans-after

Each campaign is planned on the inventory it names (the emulated ones are planned without being up).
The node code's hash (in its archive's name and each context's ``code_version``) is written as ``HASH``,
so that a change of node code alone does not show as a change of every command.

``--as-real-lab auto|netem|nfqueue`` plans instead, in this process and without reaching a node, each
campaign on its inventory made a real lab (emulated nodes get documentation addresses, 192.0.2.0/24,
and data interfaces; sudo on; ``defaults.delay_path`` as given): so that the link lines (tc, the
NFQUEUE rules, the delay handler, trace players, restore) are planned and compared too.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NODE_CODE_HASH = re.compile(r'(hil-nodes-|"code_version": ")[0-9a-f]{16}')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory for one <campaign>.json each")
    parser.add_argument("--campaigns", type=Path, default=REPO / "examples" / "campaigns")
    parser.add_argument("--only", nargs="+", default=["*"], help="campaign file name patterns (default: all)")
    parser.add_argument("--as-real-lab", choices=("auto", "netem", "nfqueue"),
                        help="plan offline on each inventory made a real lab, with this delay path")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    chosen = {path for pattern in args.only for path in args.campaigns.glob(f"{pattern.removesuffix('.yaml')}.yaml")}
    if args.as_real_lab:
        return plan_as_real_labs(sorted(chosen), args.out, args.as_real_lab)
    for campaign in sorted(chosen):
        done = subprocess.run([sys.executable, "-m", "testbed", "run", str(campaign), "--dry-run", "--json"],
                              cwd=REPO, capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        if done.returncode != 0:
            failed += 1
            print(f"{campaign.name}: exit {done.returncode}: {done.stderr.strip()[-400:]}", file=sys.stderr)
            continue
        plan = json.loads(done.stdout)
        text = NODE_CODE_HASH.sub(r"\1HASH", json.dumps(plan, indent=1, sort_keys=True))
        (args.out / f"{campaign.stem}.json").write_text(text + "\n")
        commands = sum(len(v) for run in plan.get("runs", []) for v in (run.get("commands") or {}).values())
        print(f"{campaign.name}: {len(plan.get('runs', []))} runs, {commands} commands")
    return 1 if failed else 0


def plan_as_real_labs(campaigns: list[Path], out: Path, delay_path: str) -> int:
    import tempfile

    from testbed.campaign.load import load_campaign
    from testbed.campaign.plan import plan_run
    from testbed.emulation.resolved import as_real_lab

    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        for campaign_path in campaigns:
            named = re.search(r"^inventory: (\S+)", campaign_path.read_text(), re.M)
            try:
                inventory = (campaign_path.parent / named[1]).resolve() if named else REPO / "inventory.yaml"
                real = as_real_lab(inventory, Path(scratch) / f"{inventory.stem}-real.yaml", delay_path=delay_path)
                campaign = load_campaign(campaign_path, inventory=real)
                plans = [plan_run(campaign, run, 1, live=False).to_json() for run in campaign.runs]
            except Exception as exc:  # a campaign that cannot be planned this way is named, the rest go on
                failed += 1
                print(f"{campaign_path.name}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            text = NODE_CODE_HASH.sub(r"\1HASH", json.dumps({"runs": plans}, indent=1, sort_keys=True))
            (out / f"{campaign_path.stem}.json").write_text(text.replace(scratch, "SCRATCH") + "\n")
            print(f"{campaign_path.name}: {len(plans)} runs, {sum(len(p['commands']) for p in plans)} lines")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
