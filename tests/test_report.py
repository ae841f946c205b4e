"""analysis.load, analysis.metrics' energy, analysis.report and `testbed report` on a real campaign.

``tests/data/sample-campaign`` is 8 runs of the emulated testbed (U-shape and centralized, 0.5 and 4
requests/s per device, orin at MAXN and MODE_30W; modeled Jetson and server power). Every expected
value below is computed here from the campaign's own files (ledger.sqlite, manifest.json, the
parquet tables) with sqlite3, json and plain pandas/numpy, never by calling the code under test.
The sample is always copied first: the report writes into the campaign directory.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox
from ruamel.yaml import YAML

from analysis import load, metrics, plots
from analysis import report as report_module
from analysis.cost_model import API_PRICES_USD_PER_MTOK
from analysis.report import ReportOptions, build_report
from tests.conftest import REPO

SAMPLE = REPO / "tests" / "data" / "sample-campaign"
TESTBED = Path(sys.executable).with_name("testbed")  # the installed entry point, as a user runs it
RUN_IDS = sorted(p.name for p in (SAMPLE / "runs").iterdir())
FIGURES = ("latency_vs_rate", "sla_compliance", "qoe_distribution", "energy_per_token", "delivery_curves",
           "telemetry_timeline")  # fmt: skip
CLOCK = 1e-6  # s: controller-clock instants are ~1.8e9 s, whose float64 spacing is ~2.4e-7 s


def copy_sample(directory: Path) -> Path:
    return Path(shutil.copytree(SAMPLE, directory / "sample-campaign"))


@pytest.fixture
def campaign(tmp_path: Path) -> Path:
    return copy_sample(tmp_path)


# -- the campaign's files, read independently ---------------------------------------------------


def ledger_runs(directory: Path) -> pd.DataFrame:
    with sqlite3.connect(directory / "ledger.sqlite") as db:
        return pd.read_sql_query("SELECT run_id, state, started_s, ended_s, reason FROM runs ORDER BY position", db)


def manifest(directory: Path, run_id: str) -> dict:
    return json.loads((directory / "runs" / run_id / "manifest.json").read_text())


def start_offsets(directory: Path, run_id: str) -> dict[str, float]:
    """Each node's clock offset (node minus controller) measured at the run's start."""
    return {node: entry["start"]["offset_s"] for node, entry in manifest(directory, run_id)["clock_offsets"].items()}


def run_table(directory: Path, run_id: str, name: str) -> pd.DataFrame:
    return pd.read_parquet(directory / "runs" / run_id / f"{name}.parquet")


def barrier_ts_s(directory: Path, run_id: str) -> float:
    """The run's start barrier on the controller's clock: the earliest device wall clock at the barrier,
    minus that device's offset."""
    requests = run_table(directory, run_id, "requests")
    offsets = start_offsets(directory, run_id)
    return min(origin - offsets[node] for node, origin in zip(requests["node"], requests["clock_origin_unix_s"],
                                                                strict=True))  # fmt: skip


def expected_latency_by_method(directory: Path) -> pd.DataFrame:
    """Per method over the ledger's done runs: completed requests, TTFT mean and median (ms) and the
    mean of every gap between consecutive tokens of a request (ms)."""
    ttft, gaps = [], []
    for run_id in ledger_runs(directory).query("state == 'done'")["run_id"]:
        method = manifest(directory, run_id)["settings"]["method"]
        requests = run_table(directory, run_id, "requests")
        requests = requests[requests["completed"]]
        ttft.append(pd.DataFrame({"method": method, "ms": (requests["first_token_s"] - requests["arrival_s"]) * 1e3}))
        tokens = run_table(directory, run_id, "tokens").sort_values(["node", "request_id", "index"])
        gap = tokens.groupby(["node", "request_id"])["ts_s"].diff().dropna() * 1e3
        gaps.append(pd.DataFrame({"method": method, "ms": gap}))
    ttft_ms, gap_ms = pd.concat(ttft).groupby("method")["ms"], pd.concat(gaps).groupby("method")["ms"]
    return pd.DataFrame({"requests": ttft_ms.size(), "ttft_ms_mean": ttft_ms.mean(), "ttft_ms_p50": ttft_ms.median(),
                         "tbt_ms_mean": gap_ms.mean()})  # fmt: skip


def step_energy_j(ts: np.ndarray, power_mw: np.ndarray, start: float, end: float) -> float:
    """Energy over [start, end] of sampled power, each sample's power holding over the interval that
    ends at it (a sensor reports the average over its past period)."""
    overlap = np.clip(np.minimum(ts[1:], end) - np.maximum(ts[:-1], start), 0, None)
    return float(np.sum(power_mw[1:] * overlap) / 1e3)


def merged(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(windows):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def node_power_samples(directory: Path, run_id: str, node: str) -> tuple[np.ndarray, np.ndarray]:
    """A node's total power: a Jetson's board total, the emulated server's modeled ``power_mw``."""
    frame = pd.read_parquet(directory / "runs" / run_id / "telemetry" / f"{node}.parquet")
    metric = "board_power_mw" if (frame["metric"] == "board_power_mw").any() else "power_mw"
    total = frame[frame["metric"] == metric].groupby("ts_s")["value"].sum().sort_index()
    return total.index.to_numpy(dtype="float64"), total.to_numpy(dtype="float64")


# -- load ---------------------------------------------------------------------------------------


def test_load_gives_the_eight_done_runs_with_their_settings_flattened(campaign: Path) -> None:
    data = load(campaign)
    assert list(data.runs["run_id"]) == list(ledger_runs(campaign)["run_id"])
    assert sorted(data.runs["run_id"]) == RUN_IDS
    assert list(data.runs["state"]) == ["done"] * 8
    for row in data.runs.to_dict("records"):
        settings = manifest(campaign, row["run_id"])["settings"]
        assert row["method"] == settings["method"]
        assert row["workload.rate_per_s"] == settings["workload"]["rate_per_s"]
        assert row["power.orin"] == settings["power"]["orin"]
        assert row["link.profile"] == settings["link"]["profile"] == "wifi-up"
    combos = set(zip(data.runs["method"], data.runs["workload.rate_per_s"], data.runs["power.orin"], strict=True))
    assert combos == set(itertools.product(["ushape", "centralized"], [0.5, 4.0], ["MAXN", "MODE_30W"]))
    assert len(data.requests) == sum(len(run_table(campaign, r, "requests")) for r in RUN_IDS) == 80
    assert len(data.tokens) == sum(len(run_table(campaign, r, "tokens")) for r in RUN_IDS)
    assert set(data.events["run_id"]) == set(RUN_IDS)


def test_request_instants_are_the_device_clock_minus_its_offset(campaign: Path) -> None:
    data = load(campaign)
    for run_id in RUN_IDS:
        raw = run_table(campaign, run_id, "requests").sort_values(["node", "request_id"])
        offsets = start_offsets(campaign, run_id)
        assert raw["clock_origin_unix_s"].notna().all()
        assert set(raw["node"]) <= set(offsets)
        got = data.requests[data.requests["run_id"] == run_id].sort_values(["node", "request_id"])
        assert list(got["request_id"]) == list(raw["request_id"])
        for column in ("arrival", "first_token", "last_token"):
            # offsets are ~2e-5 s here: adding one instead of subtracting it misses by 2e-5 >> CLOCK
            expected = raw["clock_origin_unix_s"] + raw[f"{column}_s"] - raw["node"].map(offsets)
            np.testing.assert_allclose(got[f"{column}_ts_s"], expected, rtol=0, atol=CLOCK, err_msg=column)


def test_telemetry_time_is_counted_from_the_runs_start_barrier(campaign: Path) -> None:
    data = load(campaign)
    runs = data.runs.set_index("run_id")
    for run_id in RUN_IDS:
        origin = barrier_ts_s(campaign, run_id)
        assert runs.loc[run_id, "origin_ts_s"] == pytest.approx(origin, rel=0, abs=CLOCK)
        telemetry = data.telemetry[data.telemetry["run_id"] == run_id]
        files = sorted((campaign / "runs" / run_id / "telemetry").glob("*.parquet"))
        assert sorted(telemetry["node"].unique()) == sorted(p.stem for p in files) == ["orin", "server", "xavier"]
        assert len(telemetry) == sum(len(pd.read_parquet(p)) for p in files)
        np.testing.assert_allclose(telemetry["t_s"], telemetry["ts_s"] - origin, rtol=0, atol=CLOCK)


def test_requests_fall_inside_the_telemetry_span_inside_the_ledgers_run_span(campaign: Path) -> None:
    data = load(campaign)
    for run in ledger_runs(campaign).itertuples():
        telemetry = data.telemetry[data.telemetry["run_id"] == run.run_id]["ts_s"]
        requests = data.requests[data.requests["run_id"] == run.run_id]
        assert run.started_s <= telemetry.min() <= requests["arrival_ts_s"].min(), run.run_id
        assert requests["last_token_ts_s"].max() <= telemetry.max() <= run.ended_s, run.run_id
        assert (requests["arrival_ts_s"] <= requests["first_token_ts_s"]).all()
        assert (requests["first_token_ts_s"] <= requests["last_token_ts_s"]).all()


# -- energy on real data ------------------------------------------------------------------------


@dataclass(frozen=True)
class Energy:
    directory: Path
    requests: pd.DataFrame
    energy: pd.DataFrame  # metrics.request_energy
    nodes: pd.DataFrame  # metrics.node_energy


@pytest.fixture(scope="module")
def sample_energy(tmp_path_factory: pytest.TempPathFactory) -> Energy:
    directory = copy_sample(tmp_path_factory.mktemp("energy"))
    data = load(directory)
    power = metrics.node_power(data.telemetry)
    return Energy(directory, data.requests, metrics.request_energy(data.requests, power), metrics.node_energy(power))


def test_request_energy_of_emulated_boards_is_modeled_and_on_the_right_nodes(sample_energy: Energy) -> None:
    requests, energy = sample_energy.requests, sample_energy.energy
    assert not energy.empty
    assert set(energy["kind"]) == {"modeled"}
    device, server = energy[energy["role"] == "device"], energy[energy["role"] == "server"]
    assert set(energy["role"]) == {"device", "server"}
    assert (device["energy_node"] == device["node"]).all()  # a device only pays for its own requests
    assert set(device["energy_node"]) == {"orin", "xavier"}
    assert set(server["energy_node"]) == {"server"}
    key = ["run_id", "node", "request_id"]
    completed = requests.loc[requests["completed"], key].sort_values(key).reset_index(drop=True)
    for part in (device, server):  # one row per completed request on its device and one on the server
        pd.testing.assert_frame_equal(part[key].sort_values(key).reset_index(drop=True), completed)
    assert (energy["energy_j"] > 0).all()
    np.testing.assert_allclose(energy["energy_j"], energy["prefill_energy_j"] + energy["decode_energy_j"])


def test_each_nodes_request_energy_is_positive_and_within_its_energy_over_the_run(sample_energy: Energy) -> None:
    total = sample_energy.nodes.set_index(["run_id", "node"])["energy_j"]
    sums = sample_energy.energy.groupby(["run_id", "energy_node"])["energy_j"].sum()
    assert len(sums) == 8 * 3
    for (run_id, node), joules in sums.items():
        ts, power_mw = node_power_samples(sample_energy.directory, run_id, node)
        assert total[(run_id, node)] == pytest.approx(step_energy_j(ts, power_mw, ts[0], ts[-1]), rel=1e-9)
        assert 0 < joules <= total[(run_id, node)], (run_id, node)


def test_request_energy_integrates_node_power_over_the_requests_windows(sample_energy: Energy) -> None:
    requests = sample_energy.requests
    energy = sample_energy.energy.set_index(["run_id", "energy_node", "node", "request_id"])
    isolated = 0
    for (run_id, node), part in energy.groupby(level=["run_id", "energy_node"]):
        ts, power_mw = node_power_samples(sample_energy.directory, run_id, node)
        served = requests[(requests["run_id"] == run_id) & requests["completed"]]
        if node != "server":
            served = served[served["node"] == node]
        windows = list(zip(served["arrival_ts_s"], served["last_token_ts_s"], strict=True))
        # power is shared among the requests in flight: together they get the power over the union of windows
        union_j = sum(step_energy_j(ts, power_mw, a, b) for a, b in merged(windows))
        assert part["energy_j"].sum() == pytest.approx(union_j, rel=1e-6), (run_id, node)
        for r in served.itertuples():  # a request alone in flight gets all of its node's power
            if sum(a < r.last_token_ts_s and r.arrival_ts_s < b for a, b in windows) > 1:
                continue
            isolated += 1
            row = energy.loc[(run_id, node, r.node, r.request_id)]
            assert row["prefill_energy_j"] == pytest.approx(
                step_energy_j(ts, power_mw, r.arrival_ts_s, r.first_token_ts_s), rel=1e-6)
            assert row["decode_energy_j"] == pytest.approx(
                step_energy_j(ts, power_mw, r.first_token_ts_s, r.last_token_ts_s), rel=1e-6)
    assert isolated >= 20  # the 0.5 requests/s runs have many requests alone on their device


# -- build_report on the sample -----------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    directory: Path
    markdown: Path
    figures: dict[str, Figure]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """One report of a copy of the sample, keeping the Figures it saved."""
    directory = copy_sample(tmp_path_factory.mktemp("report"))
    figures: dict[str, Figure] = {}
    save = report_module.Report.figure

    def keep(self, name: str, fig: Figure, caption: str) -> None:
        figures[name] = fig
        save(self, name, fig, caption)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report_module.Report, "figure", keep)
        markdown = build_report(directory, ReportOptions())
    return Built(directory, markdown, figures)


def image_links(text: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)


def file_links(text: str) -> list[str]:
    return re.findall(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)", text)


def test_report_markdown_links_every_figure_and_table_it_wrote(built: Built) -> None:
    out = built.directory / "report"
    assert built.markdown == out / "report.md" and built.markdown.is_file()
    text = built.markdown.read_text()
    images = image_links(text)
    assert len(images) == len(set(images)) and all(name.endswith(".png") for name in images)
    for name in images:
        assert (out / name).is_file(), name
    assert {p.name for p in out.glob("*.png")} == set(images) == {f"{name}.png" for name in FIGURES}
    tables = [name for name in file_links(text) if name.endswith(".csv")]
    for name in tables:
        assert (out / name).is_file(), name
    assert {"latency_by_method.csv", "latency_by_configuration.csv", "qoe_by_rate.csv", "energy_per_token.csv",
            "energy_by_node.csv", "requests_metrics.csv"} <= set(tables)  # fmt: skip
    # DiSCo cost needs the model's shape: the manifest's model_config, or the config.json of its model_directory
    recorded = manifest(built.directory, RUN_IDS[0])
    assert "cost_by_method.csv" in tables, (f"no cost section; the manifests record model_config: "
                                            f"{'model_config' in recorded}, model_directory: "
                                            f"{recorded.get('model_directory')}")  # fmt: skip


def test_report_latency_by_method_matches_the_parquet_files(built: Built) -> None:
    table = pd.read_csv(built.directory / "report" / "latency_by_method.csv").set_index("method")
    expected = expected_latency_by_method(built.directory)
    assert sorted(table.index) == sorted(expected.index) == ["centralized", "ushape"]
    for method, row in expected.iterrows():
        assert table.loc[method, "requests"] == row["requests"] == 40
        for column in ("ttft_ms_mean", "ttft_ms_p50", "tbt_ms_mean"):
            assert table.loc[method, column] == pytest.approx(row[column], rel=1e-9), (method, column)


def test_report_qoe_by_rate_has_each_method_at_each_rate(built: Built) -> None:
    table = pd.read_csv(built.directory / "report" / "qoe_by_rate.csv")
    combos = set(zip(table["method"], table["workload.rate_per_s"], strict=True))
    assert combos == set(itertools.product(["centralized", "ushape"], [0.5, 4.0]))
    assert list(table["requests"]) == [20] * 4  # 2 runs x 2 devices x 5 requests
    assert table["qoe_mean"].between(0, 1).all()


def test_report_says_the_telemetry_is_modeled(built: Built) -> None:
    text = built.markdown.read_text()
    line = next(line for line in text.splitlines() if line.startswith("Modeled telemetry"))
    for node in ("orin", "xavier", "server"):
        assert node in line
    energy = pd.read_csv(built.directory / "report" / "energy_per_token.csv")
    assert set(energy["kind"]) == {"modeled"}


def fail_runs(directory: Path, run_ids: list[str] | None = None) -> None:
    with sqlite3.connect(directory / "ledger.sqlite") as db:
        if run_ids is None:
            db.execute("UPDATE runs SET state='failed'")
        else:
            db.executemany("UPDATE runs SET state='failed' WHERE run_id = ?", [(r,) for r in run_ids])
    db.close()


def failures_section(text: str) -> str:
    assert "## Failures and quarantined nodes" in text
    return text.split("## Failures and quarantined nodes", 1)[1]


def test_report_of_a_campaign_whose_runs_all_failed(campaign: Path) -> None:
    fail_runs(campaign)
    path = build_report(campaign)
    text = path.read_text()
    assert "0 done, 8 failed" in text
    assert "nothing to report" in text
    failures = failures_section(text)
    for run_id in RUN_IDS:
        assert f"- run {run_id} failed" in failures
    assert image_links(text) == [] and list(path.parent.glob("*.png")) == []


def test_report_leaves_failed_runs_out_of_the_tables(campaign: Path) -> None:
    runs = load(campaign).runs.set_index("run_id")
    failed = [runs.index[runs["method"] == method][0] for method in ("centralized", "ushape")]
    fail_runs(campaign, failed)
    path = build_report(campaign)
    table = pd.read_csv(path.parent / "latency_by_method.csv").set_index("method")
    expected = expected_latency_by_method(campaign)
    assert list(expected["requests"]) == [30, 30]
    for method, row in expected.iterrows():
        assert table.loc[method, "requests"] == row["requests"]
        assert table.loc[method, "ttft_ms_mean"] == pytest.approx(row["ttft_ms_mean"], rel=1e-9)
        assert table.loc[method, "tbt_ms_mean"] == pytest.approx(row["tbt_ms_mean"], rel=1e-9)
    failures = failures_section(path.read_text())
    assert sorted(re.findall(r"- run (\w+) failed", failures)) == sorted(failed)


# -- figure readability -------------------------------------------------------------------------

UNIT = re.compile(r"\((ms|s|%|W|mW|mJ|J|requests/s|tokens/s|MHz|°C)\)")
UNITLESS = ("QoE", "tokens delivered", "node (role), power mode")  # a ratio, a count, the bar categories


def drawn(fig: Figure):
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def xlabel(ax: Axes) -> str:
    """The axes' x label, or that of an axes sharing its x axis (stacked panels label the bottom one)."""
    return next((s.get_xlabel() for s in [ax, *ax.get_shared_x_axes().get_siblings(ax)] if s.get_xlabel()), "")


def texts(fig: Figure, renderer) -> list[tuple[str, Bbox]]:
    """Every title, axis label and legend of the figure with its extent in display units."""
    out = []
    for i, ax in enumerate(fig.axes):
        for text in (ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label):
            if text.get_text():
                out.append((f"axes {i} {text.get_text()!r}", text.get_window_extent(renderer)))
        if ax.get_legend() is not None:
            out.append((f"axes {i} legend", ax.get_legend().get_window_extent(renderer)))
    out += [(f"figure legend {i}", legend.get_window_extent(renderer)) for i, legend in enumerate(fig.legends)]
    return out


def test_report_draws_every_figure(built: Built) -> None:
    assert set(built.figures) == set(FIGURES)


@pytest.mark.parametrize("name", FIGURES)
def test_report_figure_axes_are_labelled_with_units(built: Built, name: str) -> None:
    fig = built.figures[name]
    assert fig.axes
    for i, ax in enumerate(fig.axes):
        for axis, label in (("x", xlabel(ax)), ("y", ax.get_ylabel())):
            assert label.strip(), f"{name}: axes {i} has no {axis} label"
            assert UNIT.search(label) or label.startswith(UNITLESS), f"{name}: {label!r} names no unit"


@pytest.mark.parametrize("name", FIGURES)
def test_report_figure_titles_labels_and_legends_do_not_overlap(built: Built, name: str) -> None:
    fig = built.figures[name]
    items = texts(fig, drawn(fig))
    assert len(items) >= 2 * len(fig.axes)
    for (a, box_a), (b, box_b) in itertools.combinations(items, 2):
        assert not box_a.overlaps(box_b), f"{name}: {a} overlaps {b}"
    for label, box in items:  # nothing is cut off at the figure's edge
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1, (
            f"{name}: {label} leaves the figure")


def overlapping_ticks(fig: Figure) -> list[tuple[str, str]]:
    """Overlapping labels on the energy chart's category axis (its y axis: the bars are horizontal)."""
    renderer = drawn(fig)
    ticks = [(t.get_text(), t.get_window_extent(renderer)) for t in fig.axes[0].get_yticklabels() if t.get_text()]
    return [(a, b) for (a, box_a), (b, box_b) in itertools.combinations(ticks, 2) if box_a.overlaps(box_b)]


def test_report_energy_chart_tick_labels_do_not_overlap(built: Built) -> None:
    fig = built.figures["energy_per_token"]
    names = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    rows = pd.read_csv(built.directory / "report" / "energy_per_token.csv")
    assert len(names) == len(rows) == 4  # orin at 2 modes, xavier, the server
    assert overlapping_ticks(fig) == []


def test_energy_chart_tick_labels_stay_apart_over_every_power_mode_of_the_default_inventory() -> None:
    # A campaign sweeping each emulated device of inventory.yaml over all of its power modes: one bar per
    # (node, mode), as the report's energy_per_token table has them, and one for the server.
    nodes = YAML(typ="safe").load((REPO / "inventory.yaml").read_text())["nodes"]
    rows = [{"energy_node": n["name"], "role": "device", "power_mode": mode["name"], "kind": "modeled",
             "energy_per_token_mj": 400.0} for n in nodes if "device" in n["roles"]
            for mode in n["emulated"]["power_modes"]]  # fmt: skip
    rows.append({"energy_node": "server", "role": "server", "power_mode": "-", "kind": "modeled",
                 "energy_per_token_mj": 3900.0})  # fmt: skip
    assert len(rows) == 13
    assert overlapping_ticks(plots.energy_per_token(pd.DataFrame(rows))) == []


# -- testbed report -----------------------------------------------------------------------------


def run_report(*args: str) -> subprocess.CompletedProcess[str]:
    """``testbed report ARGS`` as a script runs it: output through a pipe, in an 80-column terminal (the
    width rich also assumes for a pipe, pinned so that a wider COLUMNS in CI does not change the output)."""
    return subprocess.run([str(TESTBED), "report", *args], capture_output=True, text=True, cwd=REPO, timeout=120,
                          check=False, env={**os.environ, "COLUMNS": "80"})  # fmt: skip


def test_cli_report_prints_the_report_path_and_exits_0(campaign: Path) -> None:
    result = run_report(str(campaign))
    assert result.returncode == 0, result.stdout + result.stderr
    path = campaign / "report" / "report.md"
    assert path.is_file()
    assert f"report: {path}" in result.stdout.splitlines(), result.stdout  # one line a script can parse
    assert "Traceback" not in result.stderr


def test_cli_report_options_reach_the_report(campaign: Path) -> None:
    run_id = RUN_IDS[0]
    result = run_report(str(campaign), "--api", "gpt-4o", "--run", run_id, "--qoe-alpha", "0.5",
                            "--device-usd-per-pflop", "5")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    text = (campaign / "report" / "report.md").read_text()
    assert f"## One run up close: run {run_id}" in text
    assert "at 5 USD per 10^15 FLOPs" in text and "priced at gpt-4o's Table 8 rate" in text


def test_cli_report_of_a_directory_without_a_ledger_exits_2(tmp_path: Path) -> None:
    directory = tmp_path / "not-a-campaign"
    directory.mkdir()
    result = run_report(str(directory))
    assert result.returncode == 2, result.stdout + result.stderr
    assert str(directory) in result.stderr and "ledger" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (directory / "report").exists()


@pytest.mark.parametrize(("option", "words"), [
    (["--api", "nope"], ["nope", *API_PRICES_USD_PER_MTOK]),
    (["--run", "nosuchrun"], ["--run", "nosuchrun"]),
    (["--qoe-alpha", "2"], ["--qoe-alpha", "[0, 1]"]),
    (["--device-usd-per-pflop", "-1"], ["--device-usd-per-pflop"]),
])  # fmt: skip
def test_cli_report_rejects_bad_options_with_status_2(campaign: Path, option: list[str], words: list[str]) -> None:
    result = run_report(str(campaign), *option)
    assert result.returncode == 2, result.stdout + result.stderr
    for word in words:
        assert word in result.stderr, word
    assert "Traceback" not in result.stderr
    assert not (campaign / "report").exists()  # refused before anything is written


def test_cli_report_help_names_what_the_report_covers() -> None:
    result = run_report("--help")
    assert result.returncode == 0, result.stderr
    words = " ".join(result.stdout.split())
    for word in ("HAT", "QoE", "energy"):
        assert word in words, word


def test_report_on_a_single_configuration_has_no_matrix_sections(tmp_path: Path) -> None:
    # one done run (the others skipped): nothing varies, so no per-configuration table and no rate figure,
    # but the method still labels the per-method table, the SLA and QoE figures
    campaign = Path(shutil.copytree(SAMPLE, tmp_path / "campaign"))
    with sqlite3.connect(campaign / "ledger.sqlite") as db:
        keep = db.execute("SELECT run_id FROM runs ORDER BY position LIMIT 1").fetchone()[0]
        db.execute("UPDATE runs SET state = 'skipped' WHERE run_id != ?", (keep,))
    text = build_report(campaign).read_text()
    assert "## Latency by configuration" not in text and "latency_vs_rate.png" not in text
    assert "sla_compliance.png" in text and "qoe_distribution.png" in text
    table = pd.read_csv(campaign / "report" / "latency_by_method.csv")
    assert len(table) == 1 and table["requests"].iloc[0] == 10


def test_report_of_runs_that_failed_before_any_request_finished(tmp_path: Path) -> None:
    # what a campaign whose workers all die at start-up leaves: every request scheduled, none recorded
    campaign = Path(shutil.copytree(SAMPLE, tmp_path / "campaign"))
    with sqlite3.connect(campaign / "ledger.sqlite") as db:
        db.execute("UPDATE runs SET state = 'failed', reason = 'workers: mpiexec exit status 9'")
    for path in (campaign / "runs").glob("*/requests.parquet"):
        scheduled = pd.read_parquet(path)
        kept = ["node", "request_id", "scheduled_arrival_s", "scheduled_prompt_tokens", "expected_ttft_s",
                "expected_tds_tok_s", "prompt_source", "clock_origin_unix_s"]  # fmt: skip
        scheduled[kept].assign(completed=False).to_parquet(path, index=False)
    for path in (campaign / "runs").glob("*/tokens.parquet"):
        pd.read_parquet(path).iloc[0:0].to_parquet(path, index=False)
    text = build_report(campaign).read_text()
    assert "nothing to report" in text and text.count("failed: workers: mpiexec exit status 9") == 8
    summary = pd.read_csv(campaign / "report" / "summary.csv")
    assert len(summary) == 8 and summary["requests"].isna().all()


def test_report_gives_means_with_intervals_and_changes_against_the_first_method(built: Built) -> None:
    out = built.directory / "report"
    text = built.markdown.read_text()
    assert "## Means and differences with 95% intervals" in text
    means = pd.read_csv(out / "means_with_intervals.csv")
    latency = pd.read_csv(out / "latency_by_configuration.csv")
    for _, row in means.iterrows():  # the interval's estimate is the table's mean, inside its interval
        key = (latency["method"] == row["method"]) & (latency["workload.rate_per_s"] == row["workload.rate_per_s"]) \
            & (latency["power.orin"] == row["power.orin"])  # fmt: skip
        estimate, low, high = (float(v) for v in re.findall(r"-?[\d.]+(?:e-?\d+)?", row["ttft_ms"])[:3])
        assert estimate == pytest.approx(float(latency.loc[key, "ttft_ms_mean"].iloc[0]), rel=1e-3)
        assert low <= estimate <= high
    changes = pd.read_csv(out / "changes_with_intervals.csv")
    # the campaign's matrix lists ushape first: centralized is compared with it, setting by setting
    assert set(changes["method"]) == {"centralized"} and len(changes) == 4
    assert (changes["pairs"] == 10).all()  # 2 devices x 5 requests, the same requests in both runs
    assert "against method=ushape" in text
