"""``testbed reproduce``: one command per paper that regenerates its results and its page."""

from __future__ import annotations

import importlib
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from foundation.child_process import INTERRUPTED_EXIT_STATUS
from foundation.errors import TestbedError
from testbed.cli.app import app, err, out

CHECKOUT = Path(__file__).resolve().parents[2]


def _reproductions() -> Any:
    """The reproductions (``bench/reproduce``): they live in the repository's checkout, beside the benches
    they run, not in the installed package."""
    if not (CHECKOUT / "bench" / "reproduce" / "__init__.py").is_file():
        raise TestbedError(f"testbed reproduce runs from a checkout of the repository; {CHECKOUT} has no "
                           "bench/reproduce (clone the repository and install it with `make venv`)")  # fmt: skip
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module("bench.reproduce")


@app.command()
def reproduce(
    paper: Annotated[str, typer.Argument(help="hat, andes, disco, llms or cocoserve; 'all' for every paper.")],
    scale: Annotated[
        str,
        typer.Option(
            help="smoke (minutes: the pipeline end to end), reduced (tens of minutes "
            "a paper) or full (the paper's sizes as far as this machine allows; "
            "hours)."
        ),
    ] = "reduced",
    only: Annotated[list[str] | None, typer.Option(help="Run only this experiment (repeatable); see --list.")] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Keep each result that is current at this scale already, and go on with a campaign that was cut short."
        ),
    ] = False,
    pages_only: Annotated[
        bool,
        typer.Option(
            "--pages-only",
            help="Run nothing: regenerate the pages from the results there "
            "are (a result whose code changed is marked stale)."
        ),
    ] = False,
    list_: Annotated[
        bool,
        typer.Option(
            "--list",
            help="List the paper's experiments, their scales and their results' state (current, or stale with "
            "the files changed since); run nothing.",
        ),
    ] = False,
    results: Annotated[Path | None, typer.Option(help="Results folder (default: bench/results/reproductions).")] = None,
    docs: Annotated[Path | None, typer.Option(help="Pages folder (default: docs/reproductions).")] = None,
) -> None:
    """Reproduce a paper's results: run every experiment its page needs (campaigns on the emulated lab,
    benches) at a scale, write each result with its provenance (commit, uncommitted changes, a hash of the
    code it depends on, command, machine, scale, wall time), and regenerate docs/reproductions/PAPER.md:
    each headline of the paper beside ours with its 95% interval, ratio and verdict. Needs root for the
    campaigns. Exit status 1 when an experiment failed, 2 for an unknown paper or scale, 130 when
    interrupted (Ctrl-C, or SIGTERM to a campaign's `testbed run`: --resume goes on)."""
    reproductions = _reproductions()
    from bench.reproduce.pages import DOCS, write_page
    from bench.reproduce.runner import RESULTS, read_result, result_path, state_line
    from bench.reproduce.runner import reproduce as run_paper

    known = reproductions.papers()
    keys = list(known) if paper == "all" else [paper]
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise TestbedError(f"reproduce: no paper {unknown[0]!r}; choose one of {', '.join(known)} or all")
    if scale not in reproductions.SCALES:
        raise TestbedError(f"reproduce --scale: {scale!r}; choose one of {', '.join(reproductions.SCALES)}")
    names = {e.name for key in keys for e in known[key].experiments}
    wrong = [o for o in only or [] if o not in names]
    if wrong:  # with 'all', a name no paper has is as wrong as with one paper
        raise TestbedError(f"reproduce --only: {paper} has no experiment {wrong[0]!r}; see --list")
    failed = False
    for key in keys:
        chosen = known[key]
        if list_:
            for e in chosen.experiments:
                state = state_line(read_result(result_path(results or RESULTS, chosen, e)), e)
                out.print(f"{key}/{e.name}: {e.what} [scales: {', '.join(e.scales)}{'; needs a GPU' if e.gpu else ''}]"
                          f"\n    {state}", markup=False, highlight=False, soft_wrap=True)  # fmt: skip
            continue
        if not pages_only:
            try:
                outcomes = run_paper(chosen, scale, results or RESULTS, only=tuple(only or ()), resume=resume,
                                     log=lambda line: err.print(line, markup=False, highlight=False))  # fmt: skip
            except KeyboardInterrupt:  # Ctrl-C, or a campaign stopped with SIGTERM: its lab is down again
                again = shlex.join(["testbed", "reproduce", paper, "--scale", scale,
                                    *(a for o in only or () for a in ("--only", o)),
                                    *(["--results", str(results)] if results else []),
                                    *(["--docs", str(docs)] if docs else []), "--resume"])  # fmt: skip
                err.print(f"interrupted: `{escape(again)}` goes on (the results written so far are kept)",
                          highlight=False, soft_wrap=True)  # fmt: skip
                raise typer.Exit(INTERRUPTED_EXIT_STATUS) from None
            failed |= any(o.state == "failed" for o in outcomes)
            for o in outcomes:
                out.print(f"{key}/{o.experiment}: {o.state} ({o.wall_s / 60:.1f} min) {o.detail}".rstrip())
        page = write_page(chosen, results or RESULTS, docs or DOCS)
        out.print(f"{key}: wrote {page}")
    if failed:
        raise typer.Exit(1)
