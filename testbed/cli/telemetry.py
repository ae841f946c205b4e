"""``testbed telemetry``: probe sensors, record telemetry, import tegrastats logs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from foundation.errors import TestbedError
from foundation.jsonable import jsonable
from testbed.cli.app import (
    InventoryOption,
    JetsonSourceOption,
    JsonOption,
    NodesOption,
    _print_outcome_errors,
    _say,
    err,
    out,
    telemetry_app,
)
from testbed.emulation.resolved import load_lab


@telemetry_app.command("probe")
def telemetry_probe(
    inventory: InventoryOption = Path("inventory.yaml"),
    nodes: NodesOption = None,
    require_energy: Annotated[bool, typer.Option("--require-energy", help="Fail (exit 1) for every node "
                                                 "without a working power or energy sensor.")] = False,
    jetson_source: JetsonSourceOption = "tegrastats",
    as_json: JsonOption = False,
) -> None:
    """Take two samples from every node's telemetry source and list each sensor with its reading,
    or why it gave none (NVML NotSupported, RAPL root-only, a charging phone...)."""
    from testbed.energy.telemetry import probe_telemetry

    inv = load_lab(inventory)
    result = probe_telemetry(inv, nodes, require_energy=require_energy, jetson_source=jetson_source)
    probes = list(result.values().values())
    if as_json:
        out.print_json(data=jsonable(probes))
    else:
        table = Table(title="telemetry sensors")
        for column in ("node", "source", "metric", "sensor", "value", "unit", "kind", "problem"):
            table.add_column(column, overflow="fold")
        for p in probes:
            by_metric: dict[str, list[Any]] = {}
            for s in p.sensors:
                by_metric.setdefault(s.metric + ("!" if s.problem else ""), []).append(s)
            for group in by_metric.values():
                s = group[0]  # one row per metric: its first sensor's reading, the others named
                more = f" (+{len(group) - 1} more)" if len(group) > 1 else ""
                value = f"{s.value:.6g}" if s.value is not None else ""
                table.add_row(p.node, p.source, s.metric, escape(s.sensor) + more, value, s.unit, s.kind,
                              f"[yellow]{escape(s.problem)}[/]" if s.problem else "")
        out.print(table)
    if not result.ok:
        _print_outcome_errors(result)
        raise typer.Exit(1)


@telemetry_app.command("record")
def telemetry_record(
    out_dir: Annotated[Path, typer.Option("--out", help="Directory for <node>.parquet, raw/ and recording.json.")],
    seconds: Annotated[float, typer.Option("--seconds", help="How long to record.", min=0.5, max=86400)] = 10.0,
    interval_ms: Annotated[int, typer.Option("--interval-ms", help="Sampling interval.", min=10, max=60000)] = 100,
    inventory: InventoryOption = Path("inventory.yaml"),
    nodes: NodesOption = None,
    require_energy: Annotated[bool, typer.Option("--require-energy", help="Refuse to start unless every "
                                                 "node has a working energy sensor.")] = False,
    jetson_source: JetsonSourceOption = "tegrastats",
) -> None:
    """Record telemetry outside a campaign: start a detached sampler on every node, wait, measure
    clock offsets at both ends, then collect telemetry/<node>.parquet in long format (ts_s on the
    controller's clock, node_ts_s, metric, value, unit, sensor, kind, period_s)."""
    from testbed.energy.telemetry import record_telemetry

    inv = load_lab(inventory)
    result = record_telemetry(inv, nodes, seconds, out_dir, interval_s=interval_ms / 1000.0,
                              require_energy=require_energy, jetson_source=jetson_source, say=_say)
    table = Table(title=f"telemetry recorded in {out_dir}")
    for column in ("node", "rows", "longest gap", "clock offset", "drift", "sampler"):
        table.add_column(column)
    for n in result.nodes:
        gap = f"{n.max_gap_s * 1000:.0f} ms" if n.max_gap_s is not None else ""
        table.add_row(n.node, str(n.rows), gap, f"{n.clock_start.offset_s * 1000:+.2f} ms",
                      f"{n.drift_ppm:+.1f} ppm", n.stopped)
    out.print(table)
    for node, error in result.errors.items():
        err.print(f"[red]{escape(node)}:[/] {escape(error)}", highlight=False, soft_wrap=True)
    if not result.ok:
        raise typer.Exit(1)


@telemetry_app.command("import-tegrastats")
def telemetry_import_tegrastats(
    log: Annotated[Path, typer.Argument(help="A tegrastats log (tegrastats --logfile, or its stdout).")],
    node: Annotated[str, typer.Option("--node", help="The node name the rows are for.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Directory to write <node>.parquet to.")] = Path("."),
    interval_ms: Annotated[int, typer.Option("--interval-ms", help="The log's interval (for JetPack 4 lines, "
                                             "which carry no timestamp).", min=1)] = 1000,
    utc_offset_h: Annotated[float, typer.Option("--utc-offset", help="Hours between the board's local time "
                                                "(its timestamps) and UTC.")] = 0.0,
) -> None:
    """Convert an existing tegrastats log (JetPack 4 to 7) into our telemetry format."""
    from testbed.energy.board_logs import import_tegrastats

    if not log.is_file():
        raise TestbedError(f"{log}: no such file")
    path = import_tegrastats(log, node, out_dir, interval_s=interval_ms / 1000.0, utc_offset_h=utc_offset_h)
    out.print(f"wrote {path}")
