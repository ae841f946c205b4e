"""LLMS's context-switching views (analysis.context_switching) and the report's Context service section,
on calls written by hand: which calls are switches, Fig. 9's means and slowdowns, Fig. 10's counts."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import context_switching
from analysis.report import build_report
from testbed.campaign.ledger import Ledger
from tests.conftest import REPO

MIB = 1 << 20

# (context, prompt tokens, output tokens, switching ms, missing chunks, restart, completed); a context's
# first call (and a restart) start it afresh, every other call finds its past
Call = tuple[str, int, int, float, int, bool, bool]


def calls(rows: list[Call], node: str = "orin-nx") -> pd.DataFrame:
    """A run's requests.parquet rows as the llms method writes them: context_tokens counts the context's
    tokens after the call; a missing chunk is read (1 MiB) or, every other one, recomputed."""
    held: dict[str, int] = {}
    out = []
    for i, (context, prompt, output, switch_ms, missing, restart, completed) in enumerate(rows):
        held[context] = (0 if restart else held.get(context, 0)) + prompt + output
        read = missing - missing // 2
        out.append({
            "node": node, "request_id": i, "app": f"app-{i % 2}", "context": context, "arrival_s": float(i),
            "sent_s": i + 1e-4, "done_s": i + 0.5, "prompt_tokens": prompt, "output_tokens": output,
            "context_tokens": held[context], "prefill_s": 0.01, "decode_s": 0.01, "restart": restart,
            "switch_switch_s": switch_ms / 1e3, "switch_missing_chunks": missing, "switch_read_chunks": read,
            "switch_recomputed_chunks": missing // 2, "switch_bytes_read": read * MIB,
            "switch_reclaimed_chunks": missing, "switch_bytes_written": missing * MIB // 2,
            "switch_planned_s": switch_ms / 2e3, "switch_faults": 0, "completed": completed,
        })  # fmt: skip
    return pd.DataFrame(out)


def first(context: str, ms: float = 50.0) -> Call:
    return (context, 20, 5, ms, 0, False, True)


def again(context: str, ms: float, missing: int = 0) -> Call:
    return (context, 10, 5, ms, missing, False, True)


# Per (memory, contexts): the calls of one run. Only the `again` calls are switches: their means are
# llms 3 and 8 ms, swapping 9 and 40 ms (3x and 5x LLMS's).
RUNS: dict[tuple[str, int], list[Call]] = {
    ("llms", 2): [first("c0"), first("c1"), again("c0", 2.0), again("c1", 4.0),
                  ("c0", 30, 5, 90.0, 0, True, True)],  # a restarted context: no past, not a switch
    ("llms", 4): [first("c0"), first("c1"), first("c2"), first("c3"), again("c0", 6.0, missing=2),
                  again("c2", 10.0, missing=4), ("c3", 10, 5, 70.0, 3, False, False)],  # never completed
    ("swapping", 2): [first("c0"), first("c1"), again("c1", 6.0, missing=1), again("c0", 12.0, missing=2)],
    ("swapping", 4): [first("c0"), first("c1"), first("c2"), first("c3"), again("c3", 30.0, missing=4),
                      again("c1", 50.0, missing=6)],
}  # fmt: skip
SWITCH_MS = {key: [c[3] for c in rows if c[1] == 10 and c[6]] for key, rows in RUNS.items()}


def requests_with_settings() -> pd.DataFrame:
    frames = [calls(rows).assign(run_id=f"{memory}-{n}", pattern="random", contexts=n, memory=memory)
              for (memory, n), rows in RUNS.items()]  # fmt: skip
    return pd.concat(frames, ignore_index=True)


def test_switches_are_the_completed_calls_to_a_context_with_a_past() -> None:
    requests = requests_with_settings()
    switches = context_switching.switch_rows(requests)
    every = sorted(ms for run in SWITCH_MS.values() for ms in run)
    assert sorted(switches["switch_switch_s"] * 1e3) == pytest.approx(every)
    assert not switches["restart"].any() and switches["completed"].all()
    # a call that found chunks missing is a switch even where its context's tokens say nothing of a past
    odd = requests.iloc[[0]].assign(switch_missing_chunks=3)
    assert len(context_switching.switch_rows(odd)) == 1
    assert context_switching.switch_rows(requests.iloc[[0]]).empty


def test_switching_table_means_and_the_slowdown_against_llms() -> None:
    table = context_switching.switching_table(requests_with_settings())
    assert list(zip(table["contexts"], table["memory"], strict=True)) == [
        (2, "llms"), (2, "swapping"), (4, "llms"), (4, "swapping")]  # fmt: skip
    row = table.set_index(["memory", "contexts"])
    for key, ms in SWITCH_MS.items():
        assert row.loc[key, "switches"] == len(ms)
        assert row.loc[key, "mean_switch_ms"] == pytest.approx(np.mean(ms))
        assert row.loc[key, "p50_switch_ms"] == pytest.approx(np.median(ms))
        assert np.mean(ms) <= row.loc[key, "p99_switch_ms"] <= max(ms)
    assert row.loc[("swapping", 2), "slower_than_llms"] == pytest.approx(9.0 / 3.0)
    assert row.loc[("swapping", 4), "slower_than_llms"] == pytest.approx(40.0 / 8.0)
    assert row.loc[("llms", 4), "slower_than_llms"] == pytest.approx(1.0)
    # what the switches missed, recomputed and read: swapping at 4 contexts missed 4 and 6 chunks
    assert row.loc[("swapping", 4), "mean_missing_chunks"] == pytest.approx(5.0)
    assert row.loc[("swapping", 4), "mean_recomputed_chunks"] == pytest.approx((2 + 3) / 2)
    assert row.loc[("swapping", 4), "mean_read_chunks"] == pytest.approx((2 + 3) / 2)
    assert row.loc[("swapping", 4), "read_mib"] == pytest.approx(2 + 3)
    assert row.loc[("swapping", 4), "written_at_switch_mib"] == pytest.approx((4 + 6) / 2)


def test_slowdown_is_nan_where_llms_did_not_run() -> None:
    lmk = calls([first("c0"), again("c0", 20.0)]).assign(run_id="lmk-8", pattern="random", contexts=8,
                                                             memory="lmk")  # fmt: skip
    table = context_switching.switching_table(pd.concat([requests_with_settings(), lmk], ignore_index=True))
    assert np.isnan(table.loc[table["memory"] == "lmk", "slower_than_llms"]).all()
    assert table["slower_than_llms"].notna().sum() == len(RUNS)


def test_max_contexts_under_a_constraint() -> None:
    table = context_switching.switching_table(requests_with_settings())

    def held(limit_ms: float) -> dict[str, int]:
        out = context_switching.max_contexts_under(table, limit_ms)
        assert set(out["pattern"]) == {"random"}
        return dict(zip(out["memory"], out["max_contexts"], strict=True))

    assert held(10.0) == {"llms": 4, "swapping": 2}  # means 3, 8 | 9, 40 ms
    assert held(25.0) == {"llms": 4, "swapping": 2}
    assert held(5.0) == {"llms": 2, "swapping": 0}
    assert held(40.0) == {"llms": 4, "swapping": 4}
    assert held(1.0) == {"llms": 0, "swapping": 0}
    # where the latency reaches the constraint, linear in contexts from one context at 0 ms
    out = context_switching.max_contexts_under(table, 25.0).set_index("memory")
    assert out.loc["swapping", "interpolated_contexts"] == pytest.approx(2 + (25 - 9) / (40 - 9) * 2)
    assert out.loc["llms", "interpolated_contexts"] == 4 and out.loc["llms", "every_tested_within"]
    assert not out.loc["swapping", "every_tested_within"]
    assert context_switching.max_contexts_under(table, 1.0).set_index("memory").loc[
        "swapping", "interpolated_contexts"] == pytest.approx(1 + 1 / 9)  # fmt: skip


def test_contexts_under_a_constraint_between_the_tested_counts() -> None:
    assert context_switching.contexts_under([2, 4, 8], [4.0, 8.0, 16.0], 10.0) == (pytest.approx(5.0), False)
    assert context_switching.contexts_under([8, 2, 4], [16.0, 4.0, 8.0], 10.0) == (pytest.approx(5.0), False)
    assert context_switching.contexts_under([2, 4], [1.0, 2.0], 10.0) == (4.0, True)
    assert context_switching.contexts_under([2, 4], [20.0, 30.0], 10.0) == (pytest.approx(1.5), False)


def test_chunk_sizes_and_budgets_are_rows_of_their_own() -> None:
    """Fig. 14 (chunk size) and Fig. 10 (budget): the same pattern, contexts and method at another chunk
    size or budget is another row, its slowdown against LLMS at that chunk size and budget."""
    base = requests_with_settings().assign(chunk_tokens=16, budget_gb=1.0)
    big = base.assign(chunk_tokens=256, switch_switch_s=base["switch_switch_s"] * 2)
    table = context_switching.switching_table(pd.concat([base, big], ignore_index=True))
    assert len(table) == 2 * len(RUNS)
    row = table.set_index(["memory", "contexts", "chunk_tokens"])
    assert row.loc[("llms", 2, 256), "mean_switch_ms"] == pytest.approx(2 * row.loc[("llms", 2, 16), "mean_switch_ms"])
    assert row.loc[("swapping", 4, 256), "slower_than_llms"] == pytest.approx(5.0)
    held = context_switching.max_contexts_under(table, 10.0).set_index(["memory", "chunk_tokens"])
    assert held.loc[("llms", 16), "max_contexts"] == 4 and held.loc[("llms", 256), "max_contexts"] == 2


def test_settings_come_from_the_runs_and_default_to_the_spec() -> None:
    requests = calls([first("c0")]).assign(run_id="a")
    runs = pd.DataFrame({"run_id": ["a"], "context_service.memory": ["vllm-s"], "context_service.contexts": [8]})
    row = context_switching.with_settings(requests, runs).iloc[0]
    assert (row["memory"], row["contexts"], row["pattern"]) == ("vllm-s", 8, "random")


# -- the report's section on a campaign written by hand ----------------------------------------------


DILATION = 2.0  # the runs ran twice as slow; the report gives the target's times


def write_campaign(directory: Path) -> Path:
    ids = {key: f"run-{key[0]}-{key[1]}" for key in RUNS}
    with Ledger.create(directory / "ledger.sqlite", {"name": "llms-unit"},
                       [(run_id, f"{m} x{n}", ["orin-nx"]) for (m, n), run_id in ids.items()]) as ledger:  # fmt: skip
        for key, run_id in ids.items():
            memory, contexts = key
            ledger.start(run_id)
            run_dir = directory / "runs" / run_id
            run_dir.mkdir(parents=True)
            settings = {"method": "llms", "devices": ["orin-nx"],
                        "target": {"model": "llama-2-7b", "dtype": "q4f16", "dilation": DILATION},
                        "context_service": {"memory": memory, "contexts": contexts, "pattern": "random",
                                            "budget_gb": 1.0, "chunk_tokens": 16}}  # fmt: skip
            (run_dir / "manifest.json").write_text(json.dumps({"settings": settings, "repetition": 0, "seed": 0}))
            frame = calls(RUNS[key])
            dilated = [c for c in frame.columns if c.endswith("_s")]
            frame[dilated] *= DILATION
            frame.to_parquet(run_dir / "requests.parquet")
            ledger.finish(run_id, "done", run_nodes=["orin-nx"])
    return directory


def section(text: str) -> str:
    return text.split("## Context service")[1].split("\n## ")[0]


def test_report_of_a_context_switching_campaign(tmp_path: Path) -> None:
    campaign = write_campaign(tmp_path / "llms")
    text = build_report(campaign).read_text()
    assert "## Context service" in text and "modeled" in section(text)
    table = pd.read_csv(campaign / "report" / "context_switching.csv").set_index(["memory", "contexts"])
    for key, ms in SWITCH_MS.items():
        assert table.loc[key, "switches"] == len(ms)
        assert table.loc[key, "mean_switch_ms"] == pytest.approx(np.mean(ms))
    assert table.loc[("swapping", 4), "slower_than_llms"] == pytest.approx(5.0)
    held = pd.read_csv(campaign / "report" / "context_max_contexts.csv").set_index("memory")
    assert held.loc["llms", ["max_contexts_10ms", "max_contexts_25ms"]].tolist() == [4, 4]
    assert held.loc["swapping", ["max_contexts_10ms", "max_contexts_25ms"]].tolist() == [2, 2]
    assert held.loc["swapping", "contexts_at_25ms"] == pytest.approx(2 + (25 - 9) / (40 - 9) * 2)
    assert held.loc["llms", "beyond_sweep_25ms"] and not held.loc["swapping", "beyond_sweep_25ms"]
    assert "context_switching.csv" in text and "context_max_contexts.csv" in text


def test_report_of_a_campaign_with_context_switching_and_serving_runs(tmp_path: Path) -> None:
    """The sample campaign's runs keep their sections; an llms run beside them gets its own."""
    campaign = Path(shutil.copytree(REPO / "tests" / "data" / "sample-campaign", tmp_path / "mixed"))
    write_campaign(tmp_path / "llms")
    with sqlite3.connect(tmp_path / "llms" / "ledger.sqlite") as source, \
            sqlite3.connect(campaign / "ledger.sqlite") as db:  # fmt: skip
        last = db.execute("SELECT max(position) FROM runs").fetchone()[0]
        for i, row in enumerate(source.execute("SELECT run_id, label, nodes, state, attempts, started_s, ended_s "
                                               "FROM runs ORDER BY position")):  # fmt: skip
            db.execute("INSERT INTO runs (run_id, position, label, nodes, state, attempts, started_s, ended_s) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (row[0], last + 1 + i, *row[1:]))  # fmt: skip
            shutil.copytree(tmp_path / "llms" / "runs" / row[0], campaign / "runs" / row[0])
    text = build_report(campaign).read_text()
    for heading in ("## Latency by method", "## SLA compliance", "## Context service"):
        assert heading in text
    latency = pd.read_csv(campaign / "report" / "latency_by_method.csv")
    assert "llms" not in set(latency["method"])
    table = pd.read_csv(campaign / "report" / "context_switching.csv")
    assert table["switches"].sum() == sum(len(ms) for ms in SWITCH_MS.values())
