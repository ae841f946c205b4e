"""``testbed workers``: run split-inference workers over MPI outside a campaign."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from foundation.errors import NodeError, TestbedError
from nodes.contracts.methods import method_named
from nodes.contracts.methods import names as method_names
from testbed.cli.app import (
    InventoryOption,
    JsonOption,
    _say,
    err,
    out,
    workers_app,
)
from testbed.emulation.resolved import load_lab

TINY_MODEL = Path(__file__).resolve().parents[2] / "examples" / "models" / "tiny"


METHODS_HELP = "One of the registered methods (nodes/contracts/methods): " + "; ".join(
    f"{m.name} ({m.summary})" for m in map(method_named, method_names())
) + ". Drafting methods use the adapter in MODEL/draft."


@workers_app.command("run")
def workers_run(
    schedule: Annotated[Path, typer.Argument(help="JSON lines of requests: request_id, arrival_s (from the "
                                             "start), prompt or prompt_ids, max_new_tokens. Every device "
                                             "replays it.")],
    inventory: InventoryOption = Path("inventory.yaml"),
    method: Annotated[str, typer.Option(help=METHODS_HELP)] = "ushape",
    model: Annotated[Path, typer.Option(help="Hugging Face checkpoint directory, as seen on the nodes.")] = TINY_MODEL,
    server: Annotated[str, typer.Option(help="Node that runs the pipeline stages and mpiexec.")] = "server",
    devices: Annotated[str, typer.Option(help="Comma-separated device nodes or groups.")] = "devices",
    stages: Annotated[int, typer.Option("--stages", "-P", help="Server pipeline stages (MPI ranks).")] = 1,
    device_layers: Annotated[int, typer.Option("--device-layers", "-m", help="Layers the device runs after "
                                               "the embedding (U-shape's m).")] = 1,
    chunk_tokens: Annotated[int, typer.Option(help="usarathi's prompt chunk (token budget per iteration); the "
                                              "first chunk of pc methods, before the link is measured.")] = 128,
    dtype: Annotated[str, typer.Option(help="float32, float16, bfloat16 or auto (the checkpoint's).")] = "float32",
    out_dir: Annotated[Path, typer.Option("--out", help="Where rank files and mpiexec.log are collected.")] = Path(
        "split-run"
    ),
    run_id: Annotated[str, typer.Option(help="Name of the run's directory on the nodes.")] = "split",
    timeout: Annotated[float, typer.Option(help="Seconds before mpiexec and every rank are ended.")] = 600.0,
    as_json: JsonOption = False,
) -> None:
    """Run one split-inference run and print each request's TTFT and TBT. Files per rank land in
    OUT/ranks/: requests.jsonl and tokens.csv from devices, iterations.csv from server stages."""
    from nodes.contracts.run_config import RunConfigError, load_schedule
    from testbed.workers.split_run import run_split
    from testbed.workers.split_spec import SplitRunSpec

    inv = load_lab(inventory)
    try:
        rows = [r._asdict() for r in load_schedule(str(schedule))]
    except (OSError, RunConfigError) as exc:
        raise TestbedError(str(exc)) from None
    schedule_rows = tuple({k: v for k, v in r.items() if v is not None} for r in rows)
    device_names = tuple(n.name for n in inv.select([d.strip() for d in devices.split(",") if d.strip()]))
    spec = SplitRunSpec(
        method=method, model=str(model.resolve()) if model.exists() else str(model), server=server,
        devices=device_names, stages=stages, device_layers=device_layers, chunk_tokens=chunk_tokens, dtype=dtype,
        schedule=schedule_rows, run_id=run_id, timeout_s=timeout,
    )  # fmt: skip
    try:
        result = run_split(inv, spec, out_dir, say=_say)
    except NodeError as exc:
        err.print("[red]error:[/] " + escape(str(exc)), highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    requests = sorted(result.requests(), key=lambda r: (r["node"], r["request_id"]))
    if as_json:
        out.print_json(data={"out": str(out_dir), "seconds": result.seconds, "requests": requests})
        return
    speculative = any("speculative" in r for r in requests)
    caption = ("accept len: vLLM's mean acceptance length, 1 + accepted draft tokens / verification rounds "
               "(the bonus token counted)") if speculative else None  # fmt: skip
    table = Table(title=f"{method}: {len(requests)} requests in {result.seconds:.1f} s (files in {out_dir})",
                  caption=caption)  # fmt: skip
    columns = ["node", "request", "prompt tok", "chunks", "out tok", "TTFT ms", "mean TBT ms", "network ms"]
    for column in [*columns, *(["accept len"] if speculative else []), "text"]:
        table.add_column(column, overflow="fold")
    import pandas as pd

    from analysis.metrics import request_latencies

    latencies = request_latencies(pd.DataFrame(requests)) if requests else None
    for index, r in enumerate(requests):
        tbt = latencies["tpot_s"].iloc[index] * 1e3  # the mean gap between tokens: vLLM's TPOT
        length = (r.get("speculative") or {}).get("acceptance_length")
        table.add_row(
            r["node"], str(r["request_id"]), str(r["prompt_tokens"]), str(len(r["prefill"]["chunks_tokens"])),
            str(r["output_tokens"]), f"{r['ttft_s'] * 1e3:.0f}", f"{tbt:.1f}", f"{r['prefill']['network_s'] * 1e3:.0f}",
            *([f"{length:.2f}" if length is not None else "-"] if speculative else []),
            r["text"][:40].replace("\n", "\\n"),
        )  # fmt: skip
    out.print(table)
