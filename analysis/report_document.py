"""A report as a document: its lines, the tables it writes beside itself (CSV and Markdown) and its
figures (PNG), and the campaign's axes (the settings that differ between runs)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

IGNORED_SETTINGS = ("seed", "repetition", "origin_ts_s")




@dataclass
class Report:
    directory: Path
    lines: list[str] = field(default_factory=list)

    def table(self, name: str, frame: pd.DataFrame, caption: str, digits: int = 1) -> None:
        path = self.directory / f"{name}.csv"
        frame.to_csv(path, index=False)
        self.lines += [caption, "", markdown_table(frame, digits), "", f"[{path.name}]({path.name})", ""]

    def figure(self, name: str, fig: Figure, caption: str) -> None:
        path = self.directory / f"{name}.png"
        fig.savefig(path, dpi=110)
        self.lines += [f"![{caption}]({path.name})", "", f"*{caption}*", ""]


def markdown_table(frame: pd.DataFrame, digits: int = 1) -> str:
    if frame.empty:
        return "(no rows)"
    shown = frame.copy()
    for column in shown.columns:
        if pd.api.types.is_float_dtype(shown[column]):
            shown[column] = shown[column].map(lambda v: "" if pd.isna(v) else f"{v:.{digits}f}")
    shown = shown.astype(object).where(shown.notna(), "")
    lines = ["| " + " | ".join(str(c) for c in shown.columns) + " |", "|" + "---|" * len(shown.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in shown.itertuples(index=False)]
    return "\n".join(lines)


def varying_settings(runs: pd.DataFrame) -> list[str]:
    """The settings columns that differ between the campaign's runs (the matrix's axes)."""
    skip = {"run_id", "position", "label", "state", "attempts", "started_s", "ended_s", "reason", "failed_node",
            *IGNORED_SETTINGS}  # fmt: skip
    out = []
    for column in runs.columns:
        if column in skip:
            continue
        values = runs[column].map(lambda v: json.dumps(v, sort_keys=True, default=str) if isinstance(v, list | dict)
                                  else v)  # fmt: skip
        if values.nunique(dropna=False) > 1:
            out.append(column)
    return out
