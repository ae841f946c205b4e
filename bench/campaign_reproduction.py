"""One example campaign as a reproduction's experiment: run it on its emulated lab (brought up if it is
not, and down again after), then summarise it with intervals: per group of runs (its matrix settings by
default) the mean TTFT, TBT and QoE with their 95% intervals, each group's change against a baseline
group on the same requests (marked when within noise), the paced steps that overran their target, and
the ledger's counts. ``--set`` changes the campaign for a scale (more requests, more repetitions).

    python bench/campaign_reproduction.py examples/campaigns/hat-table5.yaml --baseline method=ushape
    python bench/campaign_reproduction.py examples/campaigns/andes-table4.yaml \\
        --set base.workload.requests_per_device=250 --set repetitions=3 --work /var/tmp/andes --resume

The changed campaign is written beside the original (``<name>.reproduce.yaml``, ignored by git) so its
relative paths hold. Writes bench/results/campaign_reproduction.json unless the reproduction names the
file. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analysis.comparison import settings_of
from bench._common import write
from bench.campaign import ledger_counts
from foundation.child_process import INTERRUPTED_EXIT_STATUS, interrupts_deferred, wait_through_interrupts

REPO = Path(__file__).resolve().parent.parent


def parse_setting(text: str) -> tuple[list[str], Any]:
    """``a.b.c=VALUE`` -> (["a", "b", "c"], VALUE read as YAML); under ``matrix`` the rest of the key is one
    matrix key (``matrix.serving.scheduler=[fcfs, andes]`` -> (["matrix", "serving.scheduler"], [...]))."""
    from ruamel.yaml import YAML

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {text}: write KEY=VALUE (a dotted key of the campaign file, a YAML value)")
    keys = key.split(".")
    if keys[0] == "matrix" and len(keys) > 2:  # a matrix key is itself a dotted setting: matrix.workload.rate_per_s
        keys = ["matrix", ".".join(keys[1:])]
    return keys, YAML(typ="safe").load(value)


def changed_campaign(source: Path, settings: list[tuple[list[str], Any]]) -> Path:
    """The campaign with ``settings`` applied, beside ``source`` (its relative paths stay right)."""
    from ruamel.yaml import YAML

    yaml = YAML()
    data = yaml.load(source.read_text())
    for keys, value in settings:
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    path = source.with_name(f"{source.stem}.reproduce.yaml")
    with path.open("w") as out:
        yaml.dump(data, out)
    return path


def fidelity(out: Path, by: list[str]) -> list[dict[str, Any]]:
    """Per group: the share of all paced steps that overran and the runs with a node above the limit."""
    from analysis.fidelity import violation_shares
    from analysis.load import load

    data = load(out)
    if data.steps.empty:
        return []
    shares = violation_shares(data.steps).merge(data.runs[["run_id", *by]], on="run_id")
    rows = []
    for values, part in shares.groupby(by, sort=True) if by else [((), shares)]:
        rows.append({"settings": settings_of(by, values),
                     "overrun_share": round(float(part["overruns"].sum() / part["steps"].sum()), 4),
                     "worst_node_share": round(float(part["violation_share"].max()), 4),
                     "flagged_runs": int(part.loc[part["flagged"], "run_id"].nunique()),
                     "runs": int(part["run_id"].nunique())})  # fmt: skip
    return rows


def summary(out: Path, by: list[str], baseline: dict[str, Any]) -> dict[str, Any]:
    from analysis.comparison import changes_against, group_means, request_units
    from analysis.load import load

    data = load(out)
    by = [c for c in by if c in data.runs.columns]
    units = request_units(data.requests, data.tokens, data.runs, by)
    return {"by": by, "groups": group_means(units, by),
            "changes": changes_against(units, by, baseline) if baseline else [],
            "fidelity": fidelity(out, by)}  # fmt: skip


def matrix_keys(campaign: Path) -> list[str]:
    from ruamel.yaml import YAML

    return [str(k) for k in (YAML(typ="safe").load(campaign.read_text()).get("matrix") or {})]


def inventory_of(campaign: Path) -> Path:
    from ruamel.yaml import YAML

    written = YAML(typ="safe").load(campaign.read_text())["inventory"]
    return (campaign.parent / written).resolve()


class Refusal(NamedTuple):
    """Why a campaign is no result, and the status this script exits with (130 when it was interrupted,
    so that ``testbed reproduce`` stops and says how to go on)."""

    why: str
    exit_status: int = 1


def unfinished(exit_status: int, interrupted: bool, ledger: dict[str, int], work: Path) -> Refusal | None:
    """Why a campaign whose controller exited with ``exit_status`` is no result (None when it is one): it
    was interrupted (exit status 130, for ``--resume``), its controller failed (an exit status other than 0,
    or 1 for a campaign with failed runs), its ledger still has runs to do or in progress, it skipped runs
    (a quarantined node's), or no run is done. Failed runs are part of a whole result: it counts them."""
    again = f"rerun with --resume --work {work} to go on"
    log = work / "run.log"
    if interrupted or exit_status == INTERRUPTED_EXIT_STATUS:
        return Refusal(f"the campaign was interrupted with runs left ({ledger}); {again}", INTERRUPTED_EXIT_STATUS)
    if exit_status not in (0, 1):
        return Refusal(f"the campaign's controller failed (exit status {exit_status}); see {log}")
    if ledger.get("todo") or ledger.get("running"):  # a whole campaign or none: a result is never a part of one
        return Refusal(f"the campaign stopped with runs left ({ledger}); see {log}, and {again}")
    if ledger.get("skipped"):  # never run (a node quarantined): the groups they stand for would be missing
        return Refusal(f"the campaign skipped runs ({ledger}) after a node failed; see {log}, mend the node, "
                       f"then rerun with --resume --retry-failed --work {work}")  # fmt: skip
    if not ledger.get("done"):
        return Refusal(f"the campaign has no run done ({ledger or 'no ledger'}); see {log}")
    return None


def argument_parser(prog: str = "bench/campaign_reproduction.py",
                    description: str | None = __doc__) -> argparse.ArgumentParser:  # fmt: skip
    """This script's options, for it and for the benches that add measures to its campaign (their ``--help``
    lists the options they pass on)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("campaign", type=Path, help="an example campaign file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change the campaign (dotted key, YAML value); repeatable")  # fmt: skip
    parser.add_argument("--by", help="comma-separated run settings to group by (default: the matrix's keys)")
    parser.add_argument("--baseline", action="append", default=[], metavar="SETTING=VALUE",
                        help="the group the others are compared with, e.g. method=ushape")  # fmt: skip
    parser.add_argument("--work", type=Path, help="campaign directory (default: under /var/tmp, by campaign)")
    parser.add_argument("--resume", action="store_true", help="go on with the campaign already in --work")
    parser.add_argument("--retry-failed", action="store_true",
                        help="with --resume: run the campaign's failed and skipped runs again")  # fmt: skip
    return parser


def run(argv: list[str], parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """The campaign of ``argv`` (this script's arguments, read by ``parser``: :func:`argument_parser`'s by
    default) run on its lab and summarised: the result this script writes. Other benches that add
    measures of their own to a campaign call this. Exits having written nothing when :func:`unfinished`
    says why the campaign is no result (status 130 when it was interrupted): a result is only ever a whole
    campaign, and ``--resume`` goes on with one cut short."""
    parser = parser or argument_parser()
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("needs root: the emulated testbed builds network namespaces")
    source = args.campaign.resolve()
    campaign = changed_campaign(source, [parse_setting(s) for s in args.set])
    baseline = {".".join(keys): value for keys, value in map(parse_setting, args.baseline)}
    by = args.by.split(",") if args.by else matrix_keys(campaign)
    work = args.work or Path("/var/tmp/hil-testbed-reproduce") / source.stem
    # a campaign is resumed only with the same campaign and the same code (a reproduction names its hash)
    identity = {"campaign_sha256": hashlib.sha256(campaign.read_bytes()).hexdigest(),
                "code_sha256": os.environ.get("BENCH_CODE_SHA256")}  # fmt: skip
    recorded = work / "identity.json"
    if work.exists() and args.resume and (not recorded.is_file() or json.loads(recorded.read_text()) != identity):
        print(f"{work}: its campaign or code differs from this one; starting it afresh", file=sys.stderr)
        args.resume = False
    if work.exists() and not args.resume:
        subprocess.run(["rm", "-rf", "--", str(work)], check=True)
    work.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps(identity))

    from testbed.emulation.lifecycle import down, status, up
    from testbed.inventory import load_inventory

    inventory = inventory_of(campaign)
    lab = load_inventory(inventory)
    was_up = status(lab).running
    if not was_up and not up(lab, say=lambda _: None).ok:
        raise SystemExit(f"could not bring the emulated lab {inventory} up")
    started = time.monotonic()
    try:
        command = [sys.executable, "-m", "testbed", "run", str(campaign), "--out", str(work / "out")]
        if args.resume and (work / "out").exists():
            command += ["--resume", *(["--retry-failed"] if args.retry_failed else [])]
        with (work / "run.log").open("ab") as log:
            controller = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            exit_status, interrupted = wait_through_interrupts(controller)
    finally:
        if not was_up:
            with interrupts_deferred():  # a lab half taken down would be worse than a Ctrl-C a moment late
                down(load_inventory(inventory), say=lambda _: None)
    wall_s = time.monotonic() - started
    ledger = ledger_counts(work / "out")
    refusal = unfinished(exit_status, interrupted, ledger, work)
    if refusal is not None:
        print(refusal.why, file=sys.stderr)
        raise SystemExit(refusal.exit_status)
    return {
        "command": " ".join(["python", "bench/campaign_reproduction.py", *argv]),
        "campaign": str(source.relative_to(REPO)), "settings": args.set, "baseline": baseline,
        "exit_status": exit_status, "campaign_wall_s": round(wall_s, 1), "ledger": ledger,
        "work": str(work), **summary(work / "out", by, baseline),
    }  # fmt: skip


def main() -> None:
    print(f"wrote {write('campaign_reproduction', run(sys.argv[1:]))}")


if __name__ == "__main__":
    main()
