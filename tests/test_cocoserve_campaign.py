"""The GPU-rank methods in campaigns: the scaling section's bytes from the target and the server's
profile, its checks, and a campaign on the emulated testbed where static batching fails requests out
of memory, CoCoServe replicates layers onto the idle GPU ranks and fails none, both give the same tokens
for the requests both finished, and the report's GPU serving section carries throughput, SLO
attainment, OOM rate, memory and the controller's actions."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest

from analysis.report import build_report
from foundation.errors import InputError
from nodes.contracts.target_model import builtin
from testbed.campaign.families.cocoserve import scaling_config
from testbed.campaign.load import load_campaign
from testbed.campaign.spec import RunSettings
from testbed.inventory import load_inventory
from tests.conftest import REPO, assert_sent_as_planned, emulated_inventory, emulated_lab, run_campaign

TINY = REPO / "examples" / "models" / "tiny"
LLAMA_13B = builtin("llama-2-13b")
WEIGHTS_GB = LLAMA_13B.params * 2 / 1e9  # bf16


def campaign_text(inventory: Path, budget_gb: float, extra: str = "", link: str = "{shaped: false}") -> str:
    return f"""name: cocoserve
inventory: {inventory}
base:
  method: cocoserve
  model: {TINY}
  partition: {{device_layers: 0, stages: 3}}
  devices: [orin, xavier]
  workload: {{arrival: poisson, rate_per_s: 20.0, requests_per_device: 5, prompts: alpaca, max_new_tokens: 12}}
  serving: {{max_batch: 10, ignore_eos: true}}
  scaling: {{gpu_memory_gb: {budget_gb}, period_s: 0.2, cooldown_s: 0.2, window_s: 2}}
  target: {{model: llama-2-13b, dtype: bfloat16, dilation: 2, pad_payloads: false}}
  link: {link}
  telemetry: {{enabled: false}}
  drain_s: 0.1
{extra}matrix:
  method: [static-batching, cocoserve]
order: listed
seed: 5
run_timeout_s: 300
"""


def test_the_scaling_section_counts_the_targets_bytes_per_real_layer() -> None:
    lab = load_inventory(REPO / "inventory.yaml")
    settings = RunSettings(method="cocoserve", model=str(TINY), devices=["orin"],
                           target={"model": "llama-2-13b", "dtype": "bfloat16"})  # fmt: skip
    out = scaling_config(lab, REPO, settings)
    per_copy = LLAMA_13B.layers / 8  # the tiny model's 8 layers stand for Llama-2-13B's 40
    assert out["layer_bytes"] == int(LLAMA_13B.layer_params * 2 * per_copy)
    assert out["kv_bytes_per_token_layer"] == int(2 * 40 * 128 * 2 * per_copy)  # keys and values, 40 heads of 128
    assert out["fixed_bytes"] + 8 * out["layer_bytes"] == pytest.approx(LLAMA_13B.params * 2, rel=1e-6)
    assert out["gpu_memory_bytes"] == 48e9 and out["gpu_link_gbps"] > 0  # the server's rtx-a6000 profile
    assert out["t_up"] == 0.2 and out["slo_factor"] == 5.0


def test_a_scaling_section_needs_a_gpu_rank_method_and_the_weights_must_fit_one_gpu(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text(campaign_text(REPO / "inventory.yaml", 40).replace("[static-batching, cocoserve]", "[serving]"))
    with pytest.raises(InputError, match="remove the scaling section"):
        load_campaign(path)
    lab = load_inventory(REPO / "inventory.yaml")
    settings = RunSettings(method="cocoserve", model=str(TINY), devices=["orin"], scaling={"gpu_memory_gb": 20},
                           target={"model": "llama-2-13b", "dtype": "bfloat16"})  # fmt: skip
    from foundation.errors import TestbedError

    with pytest.raises(TestbedError, match=r"do not fit one GPU of 20 GB"):
        scaling_config(lab, REPO, settings)


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.slow
@pytest.mark.root
def test_static_batching_runs_out_of_memory_where_cocoserve_scales_and_the_report_shows_both(tmp_path: Path) -> None:
    inventory = emulated_inventory(tmp_path, "cc", 216)
    campaign = tmp_path / "campaign.yaml"
    # the weights and KV for about 150 tokens: ten Alpaca prompts (about 19 tokens each) overfill it at once
    budget_gb = round(WEIGHTS_GB + 150 * LLAMA_13B.kv_bytes_per_token / 1e9, 4)
    campaign.write_text(campaign_text(inventory, budget_gb, link="{profile: wifi-down}"))  # 2 ms each way
    out = tmp_path / "out"
    with emulated_lab(inventory):
        done = run_campaign(campaign, out, timeout_s=900)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert_sent_as_planned(out)  # the scaling engine's runs sent what they planned
    tables, ops = {}, {}
    for run in sorted((out / "runs").iterdir()):
        import json

        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["status"] == "done", manifest.get("reason")
        method = manifest["settings"]["method"]
        tables[method] = pd.read_parquet(run / "requests.parquet")
        ops[method] = pd.read_parquet(run / "scaling_ops.parquet") if (run / "scaling_ops.parquet").is_file() else None
    static, coco = tables["static-batching"], tables["cocoserve"]
    assert (static["finished_by"] == "oom").any() and not (coco["finished_by"] == "oom").any()
    assert coco["completed"].all() and (coco["serving_slo_s"] > 0).all()
    assert ops["static-batching"] is None and (ops["cocoserve"]["kind"] == "replicate").any()
    both = static[static["finished_by"] == "length"].merge(coco, on=["node", "request_id"], suffixes=("_s", "_c"))
    assert len(both) > 0 and all(list(a) == list(b) for a, b in zip(both["token_ids_s"], both["token_ids_c"],
                                                                      strict=True))  # fmt: skip
    text = build_report(out).read_text()
    assert "## GPU serving (CoCoServe Fig. 8, 10 and 11)" in text and "## Serving (Andes" not in text
    table = pd.read_csv(out / "report" / "gpu_serving.csv").set_index("method")
    assert table.loc["static-batching", "oom_rate"] > 0 and table.loc["cocoserve", "oom_rate"] == 0
    assert table.loc["cocoserve", "gpus_used"] > 1  # the replicas' GPUs held memory too
    actions = pd.read_csv(out / "report" / "scaling_actions.csv")
    assert (actions["kind"] == "replicate").any() and actions["time_s"].is_monotonic_increasing
