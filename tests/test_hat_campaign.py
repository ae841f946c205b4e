"""HAT on the controller's side: campaign validation of the speculative methods, ``link.rate_scale``
on profiles and traces, the draft settings a run config gets, the Table 5 campaign file, and the
report's acceptance length and scaled-links note. No testbed, no root."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from analysis.report import ReportOptions, build_report
from foundation.errors import InputError
from netem.trace import load_trace, scale_trace
from testbed.campaign.families import FamilyContext, family_named
from testbed.campaign.load import load_campaign
from testbed.campaign.plan import run_links
from tests.conftest import REPO, run_cli

INVENTORY = REPO / "inventory.yaml"
TINY = REPO / "examples" / "models" / "tiny"
SAMPLE = REPO / "tests" / "data" / "sample-campaign"


def campaign_text(method: str = "hat", model: Path = TINY, m: int = 2, extra: str = "") -> str:
    return f"""\
name: hat-unit
inventory: {INVENTORY}
base:
  method: {method}
  model: {model}
  partition: {{device_layers: {m}, stages: 2}}
  server: server
  devices: [orin, xavier]
  workload: {{arrival: poisson, rate_per_s: 1.0, requests_per_device: 2, max_new_tokens: 4}}
{extra}"""


def problems(path: Path) -> list[tuple[int | None, str, str, str]]:
    with pytest.raises(InputError) as caught:
        load_campaign(path)
    return [(p.line, p.field, p.problem, p.hint) for p in caught.value.problems]


def copy_model_without_adapter(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(TINY / "config.json", model / "config.json")
    return model


@pytest.mark.parametrize("method", ["sd", "sd_pc", "sd_pd", "hat"])
def test_a_speculative_method_without_an_adapter_is_refused_with_the_command_that_trains_one(tmp_path, method):
    model = copy_model_without_adapter(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(campaign_text(method, model))
    [(line, field, problem, hint)] = problems(path)
    assert line == 4 and field == "base.method"  # the method's line: that is what needs the adapter
    assert "adapter_config.json" in problem and str(model / "draft") in problem
    assert "scripts/train_draft.py" in hint and "--device-layers 2" in hint


@pytest.mark.parametrize("method", ["ushape", "usarathi", "pc", "centralized"])
def test_methods_that_do_not_draft_need_no_adapter(tmp_path, method):
    path = tmp_path / "c.yaml"
    path.write_text(campaign_text(method, copy_model_without_adapter(tmp_path)))
    assert load_campaign(path).runs


def test_an_adapter_trained_for_another_m_is_refused_at_the_partition(tmp_path):
    path = tmp_path / "c.yaml"
    text = campaign_text("sd", TINY, m=1)
    path.write_text(text)
    [(line, field, problem, hint)] = problems(path)
    assert field == "base.partition.device_layers" and "trained on 2 device layers, not 1" in problem
    assert line == 6 and "--device-layers 1" in hint


def test_an_adapter_named_in_the_campaign_is_found_relative_to_it_and_reaches_the_run_config(tmp_path):
    shutil.copytree(TINY / "draft", tmp_path / "adapters" / "mine")
    path = tmp_path / "c.yaml"
    path.write_text(campaign_text("hat", copy_model_without_adapter(tmp_path),
                                  extra="  draft: {adapter: adapters/mine, eta: 0.4, top_k: 2}\n"))  # fmt: skip
    campaign = load_campaign(path)
    draft = draft_section(campaign)
    assert draft == {"adapter": str(tmp_path / "adapters" / "mine"), "eta": 0.4, "max_draft_tokens": 8, "top_k": 2,
                     "max_parallel_steps": 8}  # fmt: skip
    # without one, the run config points at the checkpoint's own draft/ (also when devices load a placed part)
    default = load_campaign(write_default(tmp_path))
    assert draft_section(default)["adapter"] == str(TINY / "draft")


def draft_section(campaign):
    """The run config's draft section of the campaign's first run, as the drafting family makes it."""
    family = family_named("draft")
    assert family.in_run_config(campaign.runs[0].settings)
    return family.run_section(FamilyContext(campaign.inventory, campaign.base_dir), campaign.runs[0].settings)


def write_default(tmp_path: Path) -> Path:
    path = tmp_path / "default.yaml"
    path.write_text(campaign_text("sd"))
    return path


@pytest.mark.parametrize(("field", "value"), [("eta", 1.5), ("eta", -0.1), ("top_k", -1), ("bogus", 1)])
def test_bad_draft_settings_are_reported_at_their_line(tmp_path, field, value):
    path = tmp_path / "c.yaml"
    path.write_text(campaign_text("hat", extra=f"  draft:\n    {field}: {value}\n"))
    found = problems(path)
    assert [line for line, *_ in found] == [11]  # the field's own line, under draft:
    assert all(f"base.draft.{field}" == f for _, f, *_ in found)


def test_rate_scale_multiplies_every_profile_rate(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(campaign_text("ushape", extra="  link: {rate_scale: 0.125}\n") +
                    "matrix:\n  link.rate_scale: [1.0, 0.125]\n")  # fmt: skip
    campaign = load_campaign(path)
    by_scale = {r.settings.link.rate_scale: run_links(campaign, r.settings) for r in campaign.runs}
    assert set(by_scale) == {1.0, 0.125}
    full, scaled = by_scale[1.0], by_scale[0.125]
    assert [(lk.source, lk.destination) for lk in full] == [(lk.source, lk.destination) for lk in scaled]
    for a, b in zip(full, scaled, strict=True):
        assert b.profile.rate_bit_s == pytest.approx(a.profile.rate_bit_s * 0.125)
    assert len({r.run_id for r in campaign.runs}) == 2  # the scale is part of what identifies a run


def test_rate_scale_scales_a_trace_once(tmp_path):
    trace = REPO / "examples" / "traces" / "hat-mid.csv"
    path = tmp_path / "c.yaml"
    path.write_text(campaign_text("ushape", extra=f"  link: {{trace: {trace}, rate_scale: 0.5}}\n"))
    campaign = load_campaign(path)
    original = load_trace(trace)
    links = {(lk.source, lk.destination): lk for lk in run_links(campaign, campaign.runs[0].settings)}
    assert links[("orin", "server")].profile.rate_bit_s == pytest.approx(original.steps[0].up_bit_s * 0.5)
    assert links[("server", "orin")].profile.rate_bit_s == pytest.approx(original.steps[0].down_bit_s * 0.5)
    # orin-nx is no device of this run: its links are not the run's to shape
    assert ("orin-nx", "server") not in links and ("server", "orin-nx") not in links


def test_scale_trace_keeps_the_times_and_names_the_scale():
    trace = load_trace(REPO / "examples" / "traces" / "hat-near.csv")
    half = scale_trace(trace, 0.25)
    assert [s.t_s for s in half.steps] == [s.t_s for s in trace.steps]
    assert [s.up_bit_s for s in half.steps] == pytest.approx([s.up_bit_s / 4 for s in trace.steps])
    assert [s.down_bit_s for s in half.steps] == pytest.approx([s.down_bit_s / 4 for s in trace.steps])
    assert "x 0.25" in half.source and scale_trace(trace, 1.0) is trace


def test_the_table5_campaign_expands_every_method_on_identical_requests():
    result = run_cli("run", str(REPO / "examples" / "campaigns" / "hat-table5.yaml"), "--out", "/nonexistent/x",
                     "--dry-run", "--json")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads(result.stdout)["runs"]
    methods = {r["settings"]["method"] for r in runs}
    assert methods == {"ushape", "usarathi", "pc", "sd", "sd_pd", "sd_pc", "hat"}
    assert all(r["settings"]["link"]["rate_scale"] == 0.125 for r in runs)
    seeds = {(r["repetition"], r["seed"]) for r in runs}
    assert len(seeds) == len({r["repetition"] for r in runs})  # one workload seed per repetition


def test_report_gives_acceptance_length_and_names_scaled_runs(tmp_path):
    directory = tmp_path / "campaign"
    shutil.copytree(SAMPLE, directory)
    run_dirs = sorted((directory / "runs").iterdir())
    scaled = run_dirs[0]
    for run_dir in run_dirs:  # as if link.rate_scale had been a matrix axis: one run scaled
        manifest = json.loads((run_dir / "manifest.json").read_text())
        manifest["settings"]["link"]["rate_scale"] = 0.125 if run_dir == scaled else 1.0
        (run_dir / "manifest.json").write_text(json.dumps(manifest))
    manifest = json.loads((scaled / "manifest.json").read_text())
    # one run's requests become speculative ones: 3 rounds, 4 accepted drafts each request
    requests = pd.read_parquet(scaled / "requests.parquet")
    requests["speculative_rounds"] = 3
    requests["speculative_accepted"] = 4
    requests.to_parquet(scaled / "requests.parquet", index=False)
    build_report(directory, ReportOptions())
    text = (directory / "report" / "report.md").read_text()
    assert "**Scaled links:** 1 of 8 runs" in text and "0.125" in text
    table = pd.read_csv(directory / "report" / "latency_by_method.csv")
    method = manifest["settings"]["method"]
    row = table[table["method"] == method].iloc[0]
    # pooled over the method's runs: only the altered run's requests have rounds
    assert row["acceptance_length"] == pytest.approx(1 + 4 / 3)
    other = table[table["method"] != method]
    assert other["acceptance_length"].isna().all()
