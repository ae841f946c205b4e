"""``testbed run``, ``status``, ``report`` and ``demo``: campaigns."""

from __future__ import annotations

import shlex
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from foundation.child_process import INTERRUPTED_EXIT_STATUS
from foundation.errors import TestbedError
from foundation.jsonable import jsonable
from testbed.cli.app import (
    InventoryOption,
    JsonOption,
    app,
    err,
    out,
)
from testbed.cli.emulate import print_emulation
from testbed.inventory import load_inventory

CampaignOutOption = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Campaign directory (ledger, runs, report). Default: results/<campaign name>."),
]


@app.command("run")
def run_command(
    campaign_file: Annotated[Path, typer.Argument(help="Campaign YAML: inventory, base settings, matrix, "
                                                  "repetitions, seed, order, timeout, failure policy.")],
    inventory: Annotated[Path | None, typer.Option("--inventory", "-i", help="Use this inventory instead of "
                                                   "the one the campaign names.")] = None,
    out_dir: CampaignOutOption = None,
    resume: Annotated[bool, typer.Option("--resume", help="Go on with a campaign started before (also after "
                                         "the controller was killed): done runs are kept, interrupted ones "
                                         "rerun.")] = False,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="With --resume: run failed and skipped runs "
                                               "again and lift quarantines.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the expanded runs and each node's commands; "
                                          "touch nothing.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Run an experiment campaign: every run of the matrix x repetitions, in the campaign's order,
    each as preflight, configure (power modes, links, read back), telemetry, MPI workers driving the
    workload, drain, collect, restore and a manifest. The ledger (OUT/ledger.sqlite) records each
    run's state, so --resume finishes a campaign whose controller died, doing no run twice. Exit
    status 0 when every run is done, 1 when a run failed or was skipped, 2 for a bad campaign file
    (nothing is touched then), 130 when interrupted (Ctrl-C, SIGTERM: --resume goes on)."""
    from testbed.campaign.load import load_campaign

    if retry_failed and not resume:
        raise TestbedError("--retry-failed goes with --resume")
    campaign = load_campaign(campaign_file, inventory=inventory)
    if dry_run:
        _print_dry_run(campaign, as_json)
        return
    from testbed.campaign.display import CampaignDisplay
    from testbed.campaign.runner import run_campaign
    directory = out_dir or Path("results") / campaign.spec.name
    _interrupt_on_sigterm()
    display = CampaignDisplay(err, len(campaign.runs))
    try:
        with display:
            summary = run_campaign(campaign, directory, resume=resume, retry_failed=retry_failed, say=display.say,
                                   report=display.report)  # fmt: skip
    except KeyboardInterrupt:  # the run in progress was restored and stays 'running' in the ledger
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one does not cut this message short
        again = shlex.join(["testbed", "run", str(campaign_file), *(["-i", str(inventory)] if inventory else []),
                            "--out", str(directory), "--resume"])  # fmt: skip
        err.print(f"interrupted: the run in progress was restored; `{escape(again)}` goes on with the campaign",
                  highlight=False, soft_wrap=True)  # fmt: skip
        raise typer.Exit(INTERRUPTED_EXIT_STATUS) from None
    _print_campaign_summary(summary, as_json)
    if not summary.ok:
        raise typer.Exit(1)


def _interrupt_on_sigterm() -> None:
    """SIGTERM ends a campaign like Ctrl-C: the current run is restored and recorded before exiting
    (its ledger row stays 'running', so --resume runs it again)."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _print_dry_run(campaign: Any, as_json: bool) -> None:
    from testbed.campaign.plan import NodeReads, plan_run
    from testbed.campaign.runner import describe_run

    reads = NodeReads()  # every node read once for all the runs
    plans = [plan_run(campaign, r, 1, live=True, reads=reads) for r in campaign.runs]
    runs = [{**describe_run(r), "commands": plan.actions(), "plan": plan.to_json()}
            for r, plan in zip(campaign.runs, plans, strict=True)]  # fmt: skip
    if as_json:
        out.print_json(data={"campaign": campaign.spec.name, "inventory": str(campaign.inventory.path), "runs": runs})
        return
    table = Table(title=f"{campaign.spec.name}: {len(runs)} runs (dry run: nodes were only read, nothing changed)")
    for column in ("#", "run id", "rep", "seed", "settings"):
        table.add_column(column, overflow="fold")
    for r in campaign.runs:
        table.add_row(str(r.position + 1), r.run_id, str(r.repetition), str(r.seed), escape(r.label()))
    out.print(table)
    for r, plan in zip(campaign.runs, plans, strict=True):
        out.print(f"[bold]run {r.position + 1} {r.run_id}[/] ({escape(r.label())})")
        out.print(escape(plan.render()), highlight=False, soft_wrap=True)


def _print_campaign_summary(summary: Any, as_json: bool) -> None:
    from testbed.campaign.display import eta_s, eta_text
    from testbed.campaign.ledger import Ledger, finished_seconds

    with Ledger.open(summary.directory / "ledger.sqlite") as ledger:
        rows, nodes = ledger.runs(), ledger.nodes()
    left = summary.counts.get("todo", 0) + summary.counts.get("running", 0)
    seconds = finished_seconds(rows)
    if as_json:
        out.print_json(data={"directory": str(summary.directory), "counts": summary.counts,
                             "quarantined": summary.quarantined, "eta_s": eta_s(seconds, left),
                             "runs": jsonable(rows), "nodes": jsonable(nodes)})  # fmt: skip
        return
    c = summary.counts
    table = Table(title=f"campaign in {summary.directory}: {c['done']} done, {c['failed']} failed, "
                  f"{c['skipped']} skipped, {c['todo'] + c['running']} to do")  # fmt: skip
    for column in ("#", "run id", "state", "attempts", "seconds", "settings", "reason"):
        table.add_column(column, overflow="fold")
    for r in rows:
        seconds = f"{r.ended_s - r.started_s:.1f}" if r.ended_s and r.started_s else ""
        color = {"done": "green", "failed": "red", "skipped": "yellow"}.get(r.state, "white")
        table.add_row(str(r.position + 1), r.run_id, f"[{color}]{r.state}[/]", str(r.attempts), seconds,
                      escape(r.label), escape(r.reason or ""))  # fmt: skip
    out.print(table)
    for n in nodes:
        if n.quarantined_s is not None:
            out.print(f"[red]{escape(n.node)} quarantined[/]: {escape(n.reason or '')}", soft_wrap=True)
    if eta := eta_text(seconds, left):
        out.print(escape(eta), soft_wrap=True)


@app.command("status")
def status_command(
    campaign_dir: Annotated[Path, typer.Argument(help="The campaign's directory (testbed run --out).")],
    as_json: JsonOption = False,
) -> None:
    """Show a campaign's progress from its ledger: each run's state, attempts, time and failure
    reason, quarantined nodes, and the time the runs left should take (at the median run time so far).
    Reads only files; exits 1 while runs failed or remain."""
    from testbed.campaign.ledger import Ledger
    from testbed.campaign.runner import LEDGER, CampaignSummary

    with Ledger.open(campaign_dir / LEDGER) as ledger:
        summary = CampaignSummary(campaign_dir, ledger.counts(), ledger.quarantined(), False)
    _print_campaign_summary(summary, as_json)
    if not summary.ok:
        raise typer.Exit(1)


@app.command("report")
def report_command(
    campaign_dir: Annotated[Path, typer.Argument(help="The campaign's directory (testbed run --out).")],
    api: Annotated[str, typer.Option(help="API whose price (DiSCo Table 8, USD per million tokens) bills the "
                                     "server's share of each request.")] = "gpt-4o-mini",
    device_usd_per_pflop: Annotated[float, typer.Option(help="Device cost per 10^15 FLOPs (DiSCo App. E: 0.3 "
                                                        "server-constrained, 5 device-constrained).")] = 0.3,
    qoe_alpha: Annotated[float | None, typer.Option(help="Andes' TTFT penalty alpha in [0, 1] (default: none, "
                                                    "Eq. 1 as is).")] = None,
    run_id: Annotated[str | None, typer.Option("--run", help="The run whose token timelines and telemetry are "
                                               "drawn (default: the done run with the lowest mean QoE).")] = None,
) -> None:
    """Analyse a finished (or partly finished) campaign: write report/report.md with PNG figures and
    CSV tables beside it. It covers TTFT/TBT per method in the layout of HAT's Table 5 and per
    configuration, latency against request rate, HAT's SLA compliance CDFs, Andes QoE and capacity,
    energy per token by node and power mode (measured and modeled kept apart), DiSCo's cost per
    request, and one run's token timelines and telemetry. Reads only files."""
    from analysis.cost_model import API_PRICES_USD_PER_MTOK
    from analysis.report import ReportOptions, build_report

    if not (campaign_dir / "ledger.sqlite").is_file():
        raise TestbedError(f"{campaign_dir}: not a campaign directory (no ledger.sqlite); give testbed run's --out")
    if api not in API_PRICES_USD_PER_MTOK:
        raise TestbedError(f"--api: unknown API {api!r}; one of {', '.join(API_PRICES_USD_PER_MTOK)}")
    if run_id is not None and not (campaign_dir / "runs" / run_id / "manifest.json").is_file():
        raise TestbedError(f"--run: {campaign_dir}/runs/{run_id} is not a finished run of this campaign")
    if qoe_alpha is not None and not 0 <= qoe_alpha <= 1:
        raise TestbedError(f"--qoe-alpha: {qoe_alpha} is outside [0, 1]")
    if not device_usd_per_pflop >= 0:
        raise TestbedError(f"--device-usd-per-pflop: {device_usd_per_pflop} must not be negative")
    path = build_report(campaign_dir, ReportOptions(api=api, device_usd_per_pflop=device_usd_per_pflop,
                                                    qoe_alpha=qoe_alpha, delivery_run=run_id))
    out.print(f"report: {path}", soft_wrap=True)


EXAMPLE_CAMPAIGNS = Path(__file__).resolve().parents[2] / "examples" / "campaigns"


@app.command("demo")
def demo_command(
    inventory: InventoryOption = Path("inventory.yaml"),
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="Campaign directory; a previous demo there is "
                                          "replaced.")] = Path("demo-output/campaign"),
    campaign_file: Annotated[Path | None, typer.Option("--campaign", help="Campaign to run (default: "
                                                       "examples/campaigns/demo.yaml, or demo-local.yaml without "
                                                       "root).")] = None,
) -> None:
    """The whole suite in one command: bring up the emulated testbed (network namespaces as root,
    local processes otherwise), run the demo campaign (methods x link profiles x power modes on the
    tiny model), write its report (testbed report), print where it is, and take the testbed down again
    (unless it was already up)."""
    import os
    import shutil

    from testbed.campaign.display import CampaignDisplay
    from testbed.campaign.load import load_campaign
    from testbed.campaign.runner import LEDGER, run_campaign
    from testbed.emulation.lifecycle import down, status, up

    root = os.geteuid() == 0
    chosen = campaign_file or EXAMPLE_CAMPAIGNS / ("demo.yaml" if root else "demo-local.yaml")
    load_campaign(chosen, inventory=inventory)  # a bad file stops here, before anything is built
    if out_dir.exists():
        if not (out_dir / LEDGER).exists():
            raise TestbedError(f"{out_dir} exists and is not a campaign directory; choose another --out")
        shutil.rmtree(out_dir)
    lab = load_inventory(inventory)
    was_up = status(lab).running
    say = lambda line: err.print(escape(line), highlight=False)  # noqa: E731
    if not was_up:
        result = up(lab, mode="netns" if root else "local", say=say)
        if not result.ok:
            print_emulation(result)
            down(lab, say=say)
            raise typer.Exit(1)
    _interrupt_on_sigterm()
    try:
        campaign = load_campaign(chosen, inventory=inventory)
        display = CampaignDisplay(err, len(campaign.runs))
        with display:
            summary = run_campaign(campaign, out_dir, say=display.say, report=display.report)
        from analysis.report import build_report

        report = build_report(out_dir)
    finally:
        if not was_up:
            down(lab, say=say)
    _print_campaign_summary(summary, False)
    out.print(f"report: {report}", soft_wrap=True)
    if not summary.ok:
        raise typer.Exit(1)
