"""Every example campaign's dry run (``testbed run CAMPAIGN --dry-run --json``) into one directory, a
JSON file per campaign, so that two trees' plans can be compared command for command (``diff -r``).

    .venv/bin/python scripts/dry_run_commands.py /tmp/plans-before
    (change the code)
    .venv/bin/python scripts/dry_run_commands.py /tmp/plans-after && diff -r /tmp/plans-before /tmp/plans-after

Each campaign is planned on the inventory it names (the emulated ones are planned without being up).
The node code's hash (in its archive's name and each context's ``code_version``) is written as ``HASH``,
so that a change of node code alone does not show as a change of every command.
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
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    chosen = {path for pattern in args.only for path in args.campaigns.glob(f"{pattern.removesuffix('.yaml')}.yaml")}
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


if __name__ == "__main__":
    raise SystemExit(main())
