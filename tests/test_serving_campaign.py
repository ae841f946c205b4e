"""The serving method in campaigns: the engine's KV budget derived from the server's profile and the
target model, campaign checks, and a campaign on the emulated testbed whose two schedulers give the
same tokens request by request while the report's tables carry the engine's counts and the buffer's
display times."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from analysis.report import build_report
from foundation.errors import InputError, TestbedError
from nodes.contracts.target_model import builtin
from testbed.campaign.families.andes import ServingSettings, kv_capacity_tokens, serving_config
from testbed.campaign.load import load_campaign
from testbed.campaign.spec import RunSettings, TargetSettings
from testbed.inventory import load_inventory
from tests.conftest import REPO, assert_sent_as_planned, emulated_inventory, emulated_lab, run_campaign

TINY = REPO / "examples" / "models" / "tiny"


def test_the_kv_capacity_is_the_gpus_memory_left_after_the_weights() -> None:
    opt66 = builtin("opt-66b")
    assert opt66.params * opt66.weight_bytes_per_param == pytest.approx(131.4e9, rel=0.01)  # Andes Table 3: 132 GB
    assert opt66.kv_bytes_per_token == 2 * 64 * 9216 * 2  # keys and values, 64 layers, fp16
    four = kv_capacity_tokens(opt66, 80, 4, 0.9)
    assert four == int((4 * 80e9 * 0.9 - opt66.params * 2) // opt66.kv_bytes_per_token)
    assert 60_000 < four < 70_000
    with pytest.raises(TestbedError, match=r"raise serving\.tensor_parallel"):
        kv_capacity_tokens(opt66, 80, 1, 0.9)  # 132 GB of weights on one 80 GB GPU


def test_a_run_gets_the_servers_budgets_from_its_profile() -> None:
    lab = load_inventory(REPO / "inventory.yaml")  # its server stands for RTX A6000s (48 GB)
    settings = RunSettings(method="serving", model=str(TINY), partition={"device_layers": 0, "stages": 1},
                           target=TargetSettings(model="opt-13b"), serving=ServingSettings(swap_gb=10))  # fmt: skip
    config = serving_config(lab, REPO, settings)
    opt13 = builtin("opt-13b")
    assert config["capacity_tokens"] == kv_capacity_tokens(opt13, 48, 1, 0.9)
    assert config["swap_tokens"] == int(10e9 // opt13.kv_bytes_per_token)
    assert config["host_link_gbps"] > 0 and config["scheduler"] == "fcfs"
    two = serving_config(lab, REPO, settings.model_copy(update={"serving": ServingSettings(tensor_parallel=2)}))
    assert two["capacity_tokens"] > 2 * config["capacity_tokens"]  # the weights are paid for once
    mine = serving_config(lab, REPO, settings.model_copy(update={"serving": ServingSettings(capacity_tokens=500)}))
    assert mine["capacity_tokens"] == 500


def campaign_text(inventory: Path, extra: str = "") -> str:
    return f"""name: serving
inventory: {inventory}
base:
  method: serving
  model: {TINY}
  partition: {{device_layers: 0, stages: 1}}
  devices: [orin, xavier]
  workload: {{arrival: poisson, rate_per_s: 20.0, requests_per_device: 6, max_new_tokens: 24, qoe: reading,
             qoe_draw: true}}
  serving: {{capacity_tokens: 420, swap_gb: 1}}
  telemetry: {{enabled: false}}
  drain_s: 0.1
{extra}matrix:
  serving.scheduler: [fcfs, andes]
order: listed
seed: 3
run_timeout_s: 240
"""


def test_a_streaming_method_refuses_device_slots(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text(campaign_text(REPO / "inventory.yaml").replace("  drain_s: 0.1\n", "  drain_s: 0.1\n  device_slots: 2\n"))
    with pytest.raises(InputError, match="leave device_slots at 1"):
        load_campaign(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.slow
@pytest.mark.root
def test_schedulers_give_the_same_tokens_and_the_tables_carry_the_engine(tmp_path: Path) -> None:
    inventory = emulated_inventory(tmp_path, "sv", 224)
    campaign = tmp_path / "campaign.yaml"
    campaign.write_text(campaign_text(inventory))
    out = tmp_path / "out"
    with emulated_lab(inventory):
        done = run_campaign(campaign, out)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert_sent_as_planned(out)  # the serving engine's runs, delay on their links, sent what they planned
    runs = sorted((out / "runs").iterdir())
    tables = {}
    for run in runs:
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["status"] == "done", manifest.get("reason")
        requests = pd.read_parquet(run / "requests.parquet")
        tokens = pd.read_parquet(run / "tokens.parquet")
        assert requests["completed"].all() and len(requests) == 12
        assert (requests["finished_by"] == "length").all()  # every prompt (64-244 tokens) fits the 420
        assert (tokens["display_s"] >= tokens["ts_s"] - 1e-6).all()
        assert requests["expected_tds_tok_s"].nunique() > 1  # drawn per request from Table 1
        assert requests["serving_preemptions"].notna().all()
        tables[manifest["settings"]["serving"]["scheduler"]] = requests
    assert set(tables) == {"fcfs", "andes"}
    fcfs, andes = (tables[k].set_index(["node", "request_id"])["token_ids"] for k in ("fcfs", "andes"))
    assert all(list(fcfs[key]) == list(andes[key]) for key in fcfs.index)
    assert tables["fcfs"]["serving_preemptions"].sum() + tables["andes"]["serving_preemptions"].sum() > 0
    # the report: Table 4's layout, QoE against length for both schedulers, the buffered timelines
    text = build_report(out).read_text()
    assert "## Serving (Andes Table 4 layout)" in text and "qoe_vs_length.png" in text
    by_length = pd.read_csv(out / "report" / "qoe_by_length.csv")
    assert by_length.groupby("serving.scheduler")["requests"].sum().to_dict() == {"andes": 12, "fcfs": 12}
    assert (by_length["length_from"] <= by_length["length_to"]).all()
    assert all((out / "report" / f"{name}.png").is_file() for name in ("qoe_vs_length", "delivery_curves"))


def test_a_server_too_small_for_the_targets_weights_is_refused_before_anything_runs(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    text = campaign_text(REPO / "inventory.yaml").replace("  serving: {capacity_tokens: 420, swap_gb: 1}",
                                                          "  serving: {swap_gb: 1}\n  target: {model: opt-66b}")
    path.write_text(text)
    with pytest.raises(InputError) as caught:
        load_campaign(path)  # OPT-66B's 131 GB of weights on one 48 GB RTX A6000
    assert "raise serving.tensor_parallel" in str(caught.value) and "serving" in str(caught.value)
