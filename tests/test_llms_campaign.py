"""LLMS in campaigns: the ``context_service`` section is checked with the method; the target's bytes and
times scale the daemon (budget and disk by the chunk ratio, recompute at the target's T_re); the run
plan starts, checks and stops the daemon; and a campaign on the emulated testbed replays a context
trace through app processes against each device's real daemon, which is gone when the run ends, also
after a killed controller."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from foundation.errors import InputError
from nodes.contracts.kv_chunk_bytes import chunk_bytes_all_layers
from nodes.contracts.service_files import service_files
from nodes.contracts.target_model import builtin
from testbed.campaign.load import load_campaign
from testbed.campaign.plan import plan_run
from testbed.target.compute_profiles import load_profile
from testbed.workers.context_service import context_scale
from tests.conftest import REPO, assert_sent_as_planned, emulated_inventory, emulated_lab, run_campaign
from workloads.context_traces import context_schedule, context_trace

TINY = REPO / "examples" / "models" / "tiny"


SMALL = ("{contexts: 2, calls_per_context: 8, apps: 2, mean_gap_s: 0.4, budget_gb: 0.75, tasks: [samsum, samsum]}")
# 6 MiB of the tiny model's chunks hold 1,228 tokens at float16 (LMK's cache): less than the two contexts that
# grow by 100-300 tokens a call to 1,024 each, so switching between them kills and recomputes contexts. Each
# context is its own app's process: the calls are spread over about 6 s so that the two apps' calls still
# interleave when one process starts late on a loaded machine (at 0.1 s apart, one run of the whole suite
# found no switch to a killed context under LMK: likely one app's calls all came before the other's)


def campaign_text(inventory: Path, service: str = SMALL, memories: str = "[llms, lmk]", timeout_s: int = 300,
                  link: str = "{shaped: false}") -> str:  # fmt: skip
    return f"""name: llms
inventory: {inventory}
base:
  method: llms
  model: {TINY}
  partition: {{device_layers: 0, stages: 1}}
  devices: [orin]
  target: {{model: llama-2-7b, dtype: q4f16}}
  context_service: {service}
  link: {link}
  telemetry: {{enabled: false}}
  drain_s: 0.1
matrix:
  context_service.memory: {memories}
order: listed
seed: 5
run_timeout_s: {timeout_s}
"""


def test_a_context_service_section_needs_the_llms_method(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text(campaign_text(REPO / "inventory.yaml").replace("method: llms", "method: ushape"))
    with pytest.raises(InputError, match="use method: llms"):
        load_campaign(path)
    path.write_text(campaign_text(REPO / "inventory.yaml", memories="[llms, zram]"))
    with pytest.raises(InputError, match=r"context_service\.memory"):
        load_campaign(path)
    path.write_text(campaign_text(REPO / "inventory.yaml", service="{max_context_tokens: 5000}"))
    with pytest.raises(InputError, match=r"context_service\.max_context_tokens"):
        load_campaign(path)
    path.write_text(campaign_text(REPO / "inventory.yaml", service="{budget_gb: 0.25}"))
    with pytest.raises(InputError, match=r"budget_gb: one context of 1024 tokens needs 0.317 GB with llms"):
        load_campaign(path)
    path.write_text(campaign_text(REPO / "inventory.yaml", service="{budget_gb: 0.5}", memories="[swapping]")
                    .replace("  context_service: {budget_gb: 0.5}", "  context_service: {budget_gb: 0.5, memory: swapping}"))
    with pytest.raises(InputError, match=r"needs 0.508 GB with swapping"):
        load_campaign(path)


def test_the_target_scales_the_budget_and_disk_by_its_chunk_and_paces_recompute() -> None:
    config = json.loads((TINY / "config.json").read_text())
    target = builtin("llama-2-7b")
    profile = load_profile(REPO / "examples" / "profiles" / "orin-nx.yaml")
    disk = profile.spec.disk
    scale = context_scale(config, 16, 1.0, target=target, rates=profile.rates(), disk=disk)
    tiny_chunk = chunk_bytes_all_layers(config["num_hidden_layers"], config["num_key_value_heads"], 32, 16)
    ratio = chunk_bytes_all_layers(32, 32, 128, 16) / tiny_chunk
    assert scale.target_over_model == pytest.approx(ratio) and ratio == pytest.approx(128.0)  # the brief's 128x
    assert scale.budget_bytes == int((1 << 30) / ratio)  # 1 GB of the target's chunks: 8 MiB of the tiny model's
    assert scale.disk == pytest.approx((disk.read_mbps / ratio, disk.write_mbps / ratio, disk.io_latency_ms * 4))
    per_chunk_s, fixed_s = scale.recompute
    assert per_chunk_s > 0 and fixed_s >= 0 and scale.modeled
    bigger = context_scale(config, 32, 1.0, target=target, rates=profile.rates(), disk=disk)
    assert bigger.recompute[0] > per_chunk_s  # a chunk of 32 tokens takes longer to recompute than one of 16
    own = context_scale(config, 16, 0.5)
    assert own.budget_bytes == 1 << 29 and own.disk is None and own.recompute is None and not own.modeled


def test_a_context_trace_becomes_a_schedule_of_token_ids_owned_by_apps() -> None:
    trace = context_trace(5, 20, "markov", max_context_tokens=400, seed=3)
    rows = context_schedule(trace, device_index=2, apps=2, model_dir=TINY, seed=9)
    again = context_schedule(trace, device_index=2, apps=2, model_dir=TINY, seed=9)
    assert rows == again and len(rows) == 20
    for call, row in zip(trace, rows, strict=True):
        assert row["request_id"] == 2_000_000 + rows.index(row)
        assert len(row["prompt_ids"]) == call.prompt_tokens and len(row["ground_truth_ids"]) == call.output_tokens
        assert row["app"] == f"app-{call.context % 2}" and row["context"] == f"c{call.context}"
    sizes: dict[str, int] = {}
    for row in rows:  # contexts grow within the limit, and begin again where the trace restarts them
        sizes[row["context"]] = (0 if row["restart"] else sizes.get(row["context"], 0)) + row["prompt_tokens"] + \
            row["output_tokens"]
        assert sizes[row["context"]] <= 400


def test_the_run_plan_starts_checks_and_stops_each_devices_daemon(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text(campaign_text(REPO / "inventory.yaml"))
    campaign = load_campaign(path)
    plan = plan_run(campaign, campaign.runs[1], 1, live=False)
    (service,) = plan.services
    argv = " ".join(service.argv)
    assert service.node == "orin" and service.memory == "lmk" and "--memory lmk" in argv
    assert "--recompute-pace" in argv and "--disk" in argv and "--max-seconds" in argv
    assert service.files == service_files(f"~/hil-testbed/runs/{plan.node_run_id}")
    whats = [(c.phase, c.what) for c in plan.commands if c.node == "orin"]
    assert ("services", "start the LLM service (detached)") in whats
    assert ("services", "wait until the LLM service answers") in whats
    assert ("restore", "stop the LLM service") in whats
    order = [phase for phase, _ in whats]
    assert order.index("services") > max(i for i, p in enumerate(order) if p == "stage")
    assert "services" in plan.render()


def _alive(pidfile: Path) -> bool:
    if not pidfile.exists():
        return False
    pid = int(pidfile.read_text().split()[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.slow
@pytest.mark.root
def test_apps_switch_contexts_on_each_devices_daemon_which_ends_with_the_run(tmp_path: Path) -> None:
    inventory = emulated_inventory(tmp_path, "lm", 200)
    campaign = tmp_path / "campaign.yaml"
    campaign.write_text(campaign_text(inventory, link="{profile: wifi-down}"))  # 2 ms each way
    out = tmp_path / "out"
    with emulated_lab(inventory):
        done = run_campaign(campaign, out)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert_sent_as_planned(out)  # the LLM services' runs sent what they planned
        by_memory = {}
        for run in sorted((out / "runs").iterdir()):
            manifest = json.loads((run / "manifest.json").read_text())
            assert manifest["status"] == "done", manifest.get("reason")
            service = manifest["context_service"]["orin"]
            assert service["install_profile"]["t_re_modeled"] and service["scale"]["modeled"]
            assert service["context_service_stats"]["faults"] == 0  # a fault is a bug, never expected
            assert manifest["restore"]["llm_services"] == {"orin": "stopped"}
            pidfiles = [Path(p["pidfile"]) for p in json.loads((run / "processes.json").read_text())
                        if p["pidfile"].endswith("daemon.pid")]  # fmt: skip
            assert pidfiles and not any(_alive(p) for p in pidfiles)
            requests = pd.read_parquet(run / "requests.parquet")
            assert len(requests) == 16 and requests.completed.all()
            assert set(requests["app"]) == {"app-0", "app-1"}
            by_memory[service["memory"]] = (requests, service["context_service_stats"])
    (llms, llms_stats), (lmk, lmk_stats) = by_memory["llms"], by_memory["lmk"]
    assert llms_stats["store"]["bytes_written"] > 0 and lmk_stats["store"]["bytes_written"] == 0  # LMK only kills
    assert (lmk["switch_recomputed_chunks"] > 0).any() and (lmk["switch_read_chunks"] == 0).all()
    # compressed to half of INT8, LLMS keeps what LMK had to kill and recompute: fewer misses, faster switches
    assert llms["switch_missing_chunks"].sum() < lmk["switch_missing_chunks"].sum()
    assert llms["switch_switch_s"].mean() < lmk["switch_switch_s"].mean()
    assert (llms["switch_bytes_written"] == 0).all()  # ahead-of-time swap-out: nothing written at switch time
    assert (llms["switch_switch_s"] >= 0).all() and llms["switch_context"].nunique() >= 2


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.slow
@pytest.mark.root
def test_a_killed_controller_leaves_no_daemon_once_resumed(tmp_path: Path) -> None:
    from testbed.campaign.runner import open_campaign, recover

    inventory = emulated_inventory(tmp_path, "lk", 202)
    campaign = tmp_path / "campaign.yaml"
    campaign.write_text(campaign_text(inventory, "{contexts: 2, calls_per_context: 40, apps: 1, mean_gap_s: 2.0}",
                                      "[llms]"))  # fmt: skip
    out = tmp_path / "out"
    with emulated_lab(inventory):
        log = (tmp_path / "controller.log").open("w")
        controller = subprocess.Popen([sys.executable, "-m", "testbed", "run", str(campaign), "--out", str(out)],
                                      cwd=REPO, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            pidfile = None
            while time.monotonic() < deadline and pidfile is None:
                for listing in out.glob("runs/*/processes.json"):
                    named = [Path(p["pidfile"]) for p in json.loads(listing.read_text())
                             if p["pidfile"].endswith("daemon.pid")]  # fmt: skip
                    pidfile = next((p for p in named if _alive(p)), None)
                time.sleep(0.5)
            assert pidfile is not None, (tmp_path / "controller.log").read_text()[-3000:]
            controller.send_signal(signal.SIGKILL)
            controller.wait(timeout=30)
        finally:
            if controller.poll() is None:
                controller.kill()
            log.close()
        assert _alive(pidfile)  # the crash left the daemon serving
        loaded = load_campaign(campaign)
        with open_campaign(loaded, out) as ledger:
            assert len(recover(loaded, out, ledger, say=lambda _: None)) == 1
        assert not _alive(pidfile)  # what --resume does first ended it
