"""DiSCo in campaigns: the dispatch section is checked with the method, the prices come from the cost
model per regime, and a campaign on the emulated testbed races the server's trace endpoint (over the
data plane) against each device's own endpoint, with the profiles fitted from calibration requests."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from analysis.cost_model import SERVICE_APIS, DispatchPrices
from analysis.report import build_report
from foundation.errors import InputError
from nodes.contracts.run_config import DISPATCH_POLICIES, DispatchSettings, parse
from nodes.dispatch.controller import POLICIES
from nodes.dispatch.policy import TokenCosts, constrained_endpoint
from testbed.campaign.families.disco import dispatch_config
from testbed.campaign.load import load_campaign
from testbed.campaign.spec import RunSettings
from testbed.transport.command_log import ENV_VARIABLE
from testbed.workers.split_spec import PER_RUN_KEY, RUN_KEY_FILE
from tests.conftest import (
    REPO,
    assert_sent_as_planned,
    command_log_of,
    emulated_inventory,
    emulated_lab,
    json_log_rows,
    run_campaign,
)

TINY = REPO / "examples" / "models" / "tiny"


def campaign_text(inventory: Path, dispatch: str = "{policy: disco-s, budget: 0.5, calibration_requests: 8}") -> str:
    return f"""name: disco
inventory: {inventory}
base:
  method: disco
  model: {TINY}
  partition: {{device_layers: 0, stages: 1}}
  devices: [orin, xavier]
  workload: {{arrival: poisson, rate_per_s: 2.0, requests_per_device: 5, max_new_tokens: 6, prompts: alpaca}}
  dispatch: {dispatch}
  telemetry: {{enabled: false}}
  drain_s: 0.1
matrix:
  dispatch.policy: [stoch-s, disco-s]
  dispatch.server_endpoint: [trace, engine]
order: listed
seed: 4
run_timeout_s: 300
"""


def test_the_run_config_knows_every_policy_the_controller_plans() -> None:
    assert DISPATCH_POLICIES == POLICIES


def test_prices_follow_the_regime_and_algorithm_1_agrees() -> None:
    for policy, regime in (("disco-s", "server"), ("disco-d", "device")):
        settings = RunSettings(method="disco", dispatch={"policy": policy, "service": "gpt"})
        prices = dispatch_config(settings)["prices"]
        expected = DispatchPrices.for_run(SERVICE_APIS["gpt"], "bloom-1.1b", regime, 20.0)
        assert prices == pytest.approx([expected.server_prefill, expected.server_decode, expected.device_prefill,
                                        expected.device_decode])  # fmt: skip
        assert constrained_endpoint(TokenCosts(*prices)) == regime
    forced = dispatch_config(RunSettings(method="disco", dispatch={"policy": "stoch-d", "regime": "server"}))
    assert constrained_endpoint(TokenCosts(*forced["prices"])) == "server"


def test_a_run_config_carries_the_dispatch_and_refuses_a_bad_one() -> None:
    raw = {"method": "disco", "model": "/m", "out_dir": "/o", "partition": {"stages": 1},
           "ranks": [{"role": "stage", "node": "server"}, {"role": "device", "node": "d", "schedule": "/s"}],
           "dispatch": {"policy": "disco-d", "budget": 0.3, "prices": [1e-7, 2e-7, 3e-7, 4e-7]}}  # fmt: skip
    config = parse(raw)
    assert config.dispatch == DispatchSettings(policy="disco-d", budget=0.3, prices=(1e-7, 2e-7, 3e-7, 4e-7))
    assert parse(config.to_json()) == config
    with pytest.raises(ValueError, match=r"dispatch\.policy"):
        parse(dict(raw, dispatch={"policy": "random"}))
    with pytest.raises(ValueError, match=r"dispatch\.budget"):
        parse(dict(raw, dispatch={"budget": 1.5}))


def test_a_dispatch_section_needs_a_dispatching_method(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text(campaign_text(REPO / "inventory.yaml").replace("method: disco", "method: serving"))
    with pytest.raises(InputError, match="use method: disco"):
        load_campaign(path)
    path.write_text(campaign_text(REPO / "inventory.yaml", "{policy: disco-x}"))
    with pytest.raises(InputError, match=r"dispatch\.policy"):
        load_campaign(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.slow
@pytest.mark.root
def test_devices_race_the_servers_endpoint_over_the_data_plane(tmp_path: Path) -> None:
    inventory = emulated_inventory(tmp_path, "dc", 204)
    campaign = tmp_path / "campaign.yaml"
    campaign.write_text(campaign_text(inventory))
    out = tmp_path / "out"
    with emulated_lab(inventory):
        log = {ENV_VARIABLE: str(command_log_of(out))}
        done, command_lines = run_watching_ps([sys.executable, "-m", "testbed", "run", str(campaign), "--out", str(out)],
                                              log)  # fmt: skip
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert_sent_as_planned(out)  # the dispatch runs, delay on their links, sent what they planned
        keys = {}  # each run's own endpoint key, as staging left it on the nodes
        for path in (tmp_path / "state" / "nodes").rglob(RUN_KEY_FILE):
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
            keys[path] = path.read_text().strip()
    assert len(set(keys.values())) == 4 and len(keys) == 4 * 3  # a fresh key a run, on its three nodes
    for key in set(keys.values()):  # never on a command line, in the controller's output or the run's records
        assert not any(key in snapshot for snapshot in command_lines) and key not in done.stdout + done.stderr
        for path in out.rglob("*"):
            if path.is_file() and path.suffix in (".json", ".jsonl", ".txt", ".log", ".csv", ".md"):
                assert key not in path.read_text(errors="replace"), path
    tables = {}
    for run in sorted((out / "runs").iterdir()):
        assert PER_RUN_KEY in (run / "plan.json").read_text()  # the key's place, shown as such
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["status"] == "done", manifest.get("reason")
        requests = pd.read_parquet(run / "requests.parquet")
        assert len(requests) == 10 and requests["ttft_s"].notna().all()
        assert (requests["dispatch_failure"].isna()).all()
        policy, server = (manifest["settings"]["dispatch"][k] for k in ("policy", "server_endpoint"))
        tables[policy, server] = requests
        calibrations = list(run.rglob("dispatch_calibration.json"))
        assert len(calibrations) == 2  # one per device
        for path in calibrations:
            calibration = json.loads(path.read_text())
            # the device premise on its own endpoint (T_d grows with the prompt): 8 calibration requests,
            # four at a time beside other test workers, gave 0.78 once on a loaded 2-core machine
            assert calibration["device_pearson"] >= 0.6 and calibration["device_fit"]["seconds_per_token"] > 0
            assert calibration["server_url"].startswith("http://10.205.")  # the data plane (10.204: management)
            assert calibration["endpoints_keyed"]  # the server's and the device's endpoints asked for the run's key
        served = [json.loads(line) for path in run.rglob("endpoint_requests.jsonl")
                  for line in path.read_text().splitlines() if not line.startswith("#")]  # fmt: skip
        assert any(row["pace"] == ("trace:gpt" if server == "trace" else "engine:fcfs") for row in served)
        assert any(row["pace"].startswith("device:") for row in served)
        if server == "engine":  # the serving engine logged what it served, cancelled races included
            assert list(run.rglob("engine_requests.jsonl"))
        if policy == "stoch-s":  # one endpoint a request: nobody was cancelled in a race
            assert set(requests["dispatch_winner"]) <= {"server", "device"}
    assert len(tables) == 4
    reference = tables["stoch-s", "trace"].set_index(["node", "request_id"])["token_ids"]
    for table in tables.values():  # the same tokens whoever served them, trace endpoint or engine
        ids = table.set_index(["node", "request_id"])["token_ids"]
        assert all(list(ids[key]) == list(reference[key]) for key in reference.index)
    text = build_report(out).read_text()
    assert "## Dispatch (DiSCo Sec. 5)" in text
    runs = pd.read_csv(out / "report" / "dispatch_runs.csv")
    assert set(runs["policy"]) == {"stoch-s", "disco-s"} and len(runs) == 4 and (runs["requests"] == 10).all()
    assert runs["realised_budget"].between(0, 1).all() and (runs["cost_micro_usd_per_request"] > 0).all()
    assert (out / "report" / "dispatch_tail_reduction.csv").is_file()


def run_watching_ps(argv: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run ``argv`` (the controller) to its end, reading every process's command line as it runs."""
    snapshots: list[str] = []
    with subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **env}) as process:  # fmt: skip
        outputs: dict[str, str] = {}
        readers = [threading.Thread(target=lambda n=n, f=f: outputs.update({n: f.read()}), daemon=True)
                   for n, f in (("out", process.stdout), ("err", process.stderr))]  # fmt: skip
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 900
        while process.poll() is None and time.monotonic() < deadline:
            snapshots.append(subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout)
            time.sleep(0.5)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
        for reader in readers:
            reader.join(timeout=60)
    done = subprocess.CompletedProcess(argv, process.returncode, outputs.get("out", ""), outputs.get("err", ""))
    return done, snapshots


def inventory_with_endpoint(directory: Path, endpoint_yaml: str, prefix: str = "dx", octet: int = 206) -> Path:
    path = emulated_inventory(directory, prefix, octet)
    path.write_text(path.read_text() + f"endpoints:\n  lab:\n{endpoint_yaml}")
    return path


def test_an_inventory_names_a_labs_endpoint_and_never_its_key(tmp_path: Path) -> None:
    from testbed.inventory import load_inventory

    good = inventory_with_endpoint(tmp_path, "    url: http://10.207.0.2:18080/v1/\n    model: tiny\n"
                                             "    api_key_env: LAB_KEY\n")  # fmt: skip
    lab = load_inventory(good).spec.endpoints["lab"]
    assert (lab.url, lab.model, lab.api_key_env) == ("http://10.207.0.2:18080/v1", "tiny", "LAB_KEY")
    inline = inventory_with_endpoint(tmp_path, "    url: http://10.207.0.2:18080/v1\n    api_key: sk-123\n")
    with pytest.raises(InputError) as caught:
        load_inventory(inline)
    text = str(caught.value)
    assert "inventory.yaml:" in text and "never write a key in the inventory" in text and "sk-123" not in text
    with pytest.raises(InputError, match="is not an http:// or https:// URL"):
        load_inventory(inventory_with_endpoint(tmp_path, "    url: ftp://10.207.0.2/v1\n"))


def test_an_external_endpoint_must_exist_and_its_key_be_set(tmp_path: Path, monkeypatch) -> None:
    inventory = inventory_with_endpoint(tmp_path, "    url: http://10.207.0.2:18080/v1\n    api_key_env: TB_TEST_KEY\n")
    path = tmp_path / "campaign.yaml"
    monkeypatch.delenv("TB_TEST_KEY", raising=False)
    external = campaign_text(inventory, "{policy: disco-s, external: lab}")  # (no server endpoint: the lab's)
    path.write_text(external.replace("  dispatch.server_endpoint: [trace, engine]\n", ""))
    with pytest.raises(InputError, match=r"takes its key from \$TB_TEST_KEY, which is not set"):
        load_campaign(path)
    path.write_text(campaign_text(inventory, "{policy: disco-s, external: elsewhere}"))
    with pytest.raises(InputError, match="no endpoint 'elsewhere' in the inventory"):
        load_campaign(path)
    monkeypatch.setenv("TB_TEST_KEY", "s3cret")
    path.write_text(external.replace("  dispatch.server_endpoint: [trace, engine]\n", ""))
    campaign = load_campaign(path)
    config = dispatch_config(campaign.runs[0].settings, campaign.inventory)
    assert config["external_url"] == "http://10.207.0.2:18080/v1" and config["external_key_env"] == "TB_TEST_KEY"
    assert "s3cret" not in json.dumps(config)


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root")
@pytest.mark.slow
@pytest.mark.root
def test_devices_race_a_labs_own_endpoint_with_its_key_from_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TB_LAB_KEY", "k3y-" + os.urandom(4).hex())
    inventory = inventory_with_endpoint(tmp_path, "    url: http://10.209.0.2:18080/v1\n    model: tiny\n"
                                                  "    api_key_env: TB_LAB_KEY\n", "dy", 208)  # fmt: skip
    campaign = tmp_path / "campaign.yaml"
    text = campaign_text(inventory, "{policy: disco-s, budget: 0.8, calibration_requests: 6, external: lab}")
    campaign.write_text(text.replace("  dispatch.server_endpoint: [trace, engine]\n", ""))
    out = tmp_path / "out"
    log = tmp_path / "lab-endpoint.jsonl"
    with emulated_lab(inventory):  # the lab's server: our trace endpoint in the server's namespace, keyed
        lab = subprocess.Popen(["ip", "netns", "exec", "dy-server", sys.executable, "-m", "nodes.endpoints",
                                "--model", str(TINY), "--pace", "trace", "--service", "command", "--host",
                                "10.209.0.2", "--port", "18080", "--log", str(log), "--api-key-env", "TB_LAB_KEY"],
                               cwd=REPO, stdout=subprocess.PIPE)  # fmt: skip
        try:
            assert lab.stdout is not None and b"serving" in lab.stdout.readline()
            done = run_campaign(campaign, out, timeout_s=900)
        finally:
            lab.terminate()
            lab.wait(timeout=30)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert_sent_as_planned(out)  # the external key's store included, its value never on a line
        homes = tmp_path / "state" / "nodes"  # the nodes' run directories, while the lab is up
        assert list(homes.rglob("run.json")) and not list(homes.rglob("endpoint.key"))  # removed once read
    served = json_log_rows(log)
    assert len(served) >= 2 * 6  # every device's calibration at least, over the data plane, with the key
    for run in (out / "runs").iterdir():
        manifest = (run / "manifest.json").read_text()
        assert os.environ["TB_LAB_KEY"] not in manifest and os.environ["TB_LAB_KEY"] not in (run / "plan.json").read_text()
        for path in run.rglob("dispatch_calibration.json"):
            assert json.loads(path.read_text())["server_url"] == "http://10.209.0.2:18080/v1"
        requests = pd.read_parquet(run / "requests.parquet")
        assert len(requests) == 10 and requests["ttft_s"].notna().all()


def test_the_controllers_lists_match_the_node_sides_catalogues() -> None:
    """The controller cannot import nodes.dispatch: its copies of the catalogues' names must agree."""
    import typing

    from analysis.cost_model import DEVICE_SPEED_MODELS
    from nodes.endpoints.device_speed import DEVICE_SPEEDS
    from nodes.endpoints.services import SERVICES
    from testbed.campaign.families.disco import DispatchSettings as CampaignDispatch

    fields = CampaignDispatch.model_fields
    assert set(typing.get_args(fields["service"].annotation)) == set(SERVICES)
    assert set(typing.get_args(fields["device_speed"].annotation)) == set(DEVICE_SPEEDS)
    assert {name: speed.model for name, speed in DEVICE_SPEEDS.items()} == DEVICE_SPEED_MODELS
