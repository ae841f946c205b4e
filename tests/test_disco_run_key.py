"""A DiSCo run's own key: every endpoint the run starts (the server's on the data plane, each device's)
asks for a key made fresh for the run, handed to the ranks as a 0600 file the run config names, and
sent by the dispatchers; the plan, the dry run and the run's files show ``<per-run key>`` in its place.
Real MPI ranks (mpiexec on this host), real endpoints, raw HTTP and the official ``openai`` client."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from testbed.campaign.families.disco import dispatch_config
from testbed.campaign.load import load_campaign
from testbed.campaign.plan import plan_run
from testbed.workers.split_spec import PER_RUN_KEY, RUN_KEY_FILE, MethodSections, SplitRunSpec, run_config_for
from tests.test_disco_campaign import campaign_text

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "examples" / "models" / "tiny"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
HANG_S = 240.0
PROMPTS = ["def add(a, b):\n    return", "import os\n", "for i in range(10):\n    print("]


def status_of(url: str, key: str | None, method: str = "GET", body: bytes | None = None) -> int:
    request = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    if key is not None:
        request.add_header("Authorization", "Bearer " + key)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_disco_runs_endpoints_take_its_key_alone_and_its_dispatchers_send_it(tmp_path: Path) -> None:
    key = secrets.token_urlsafe(32)
    key_file = tmp_path / "run" / RUN_KEY_FILE
    key_file.parent.mkdir()
    key_file.write_text(key)
    key_file.chmod(0o600)
    schedule = tmp_path / "device0.jsonl"
    rows = [{"request_id": i, "arrival_s": 0.0 if i < 2 else 12.0, "prompt": p, "max_new_tokens": 6}
            for i, p in enumerate(PROMPTS)]  # the last one late: the run is alive while the test knocks
    schedule.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    config = {
        "run_id": "keyed", "method": "disco", "model": str(TINY), "partition": {"device_layers": 0, "stages": 1},
        "out_dir": str(out), "seed": 3,
        "ranks": [{"role": "stage", "node": "server"}, {"role": "device", "node": "dev0", "schedule": str(schedule)}],
        "dispatch": {"policy": "stoch-s", "budget": 0.5, "service": "command", "calibration_requests": 2,
                     "endpoint_key_file": str(key_file)},
    }  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(config))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    seen_ps: list[str] = []
    with subprocess.Popen([str(MPIEXEC), "-n", "2", sys.executable, "-m", "nodes.workers", str(tmp_path / "run.json")],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as run:  # fmt: skip
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(run.stdout or []), daemon=True)
        reader.start()
        calibration_path = out / "device-0-dev0" / "dispatch_calibration.json"
        deadline = time.monotonic() + HANG_S
        while not calibration_path.exists():
            assert run.poll() is None, "".join(output)[-3000:]
            assert time.monotonic() < deadline, f"no calibration within {HANG_S:.0f} s"
            seen_ps.append(subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout)
            time.sleep(0.2)
        calibration = json.loads(calibration_path.read_text())
        assert calibration["endpoints_keyed"]
        server, device = calibration["server_url"], calibration["device_url"]
        completion = json.dumps({"prompt": "def f(x):", "max_tokens": 2}).encode()
        for url in (server, device):  # while the run serves its late request
            for wrong in (None, "wrong", key[:-1]):
                assert status_of(url + "/models", wrong) == 401
                assert status_of(url + "/completions", wrong, "POST", completion) == 401
            assert status_of(url + "/models", key) == 200
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
            reply = openai.OpenAI(base_url=url, api_key=key, max_retries=0).completions.create(
                model="tiny", prompt="def f(x):", max_tokens=2)  # fmt: skip
            assert reply.usage.completion_tokens == 2
        seen_ps.append(subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout)
        assert run.wait(timeout=HANG_S) == 0, "".join(output)[-3000:]
        reader.join(timeout=30)
    records = [json.loads(line) for line in (out / "device-0-dev0" / "requests.jsonl").read_text().splitlines()
               if not line.startswith("#")]  # fmt: skip
    assert len(records) == len(PROMPTS) and all(r["finished_by"] == "length" for r in records), records
    assert all(r["dispatch"]["failure"] is None for r in records)  # the dispatchers sent the key
    assert not any(key in snapshot for snapshot in seen_ps)  # never on a command line
    assert key not in "".join(output)
    for path in out.rglob("*"):
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path


def test_staging_hands_each_node_the_path_of_its_run_key_and_plans_show_a_placeholder() -> None:
    from dataclasses import replace

    from nodes.contracts.run_config import RankSpec, parse
    from testbed.campaign.spec import RunSettings

    section = dispatch_config(RunSettings(method="disco", dispatch={"policy": "disco-s"}))
    assert section["endpoint_key"] == PER_RUN_KEY  # what the plan holds: no key yet
    spec = SplitRunSpec(method="disco", model=str(TINY), server="server", devices=("orin",), device_layers=0,
                        schedule=({"prompt": "x", "max_new_tokens": 2},), run_id="r1-a1",
                        sections=MethodSections(dispatch=section))  # fmt: skip
    ranks = (RankSpec("stage", "server", 0), RankSpec("device", "orin", 0, schedule="/s"))
    config = run_config_for(spec, str(TINY), "/home/lab/hil-testbed/runs/r1-a1", ranks)
    assert config.dispatch.endpoint_key_file == f"/home/lab/hil-testbed/runs/r1-a1/{RUN_KEY_FILE}"
    assert parse(config.to_json()) == config and PER_RUN_KEY not in json.dumps(config.to_json())
    assert run_config_for(replace(spec, sections=MethodSections()), str(TINY), "/w", ranks).dispatch.endpoint_key_file is None


def test_the_dry_run_of_a_disco_campaign_shows_the_key_as_a_placeholder(tmp_path: Path) -> None:
    path = tmp_path / "campaign.yaml"
    path.write_text(campaign_text(REPO / "inventory.yaml"))
    campaign = load_campaign(path)
    plan = plan_run(campaign, campaign.runs[0], 1, live=False)
    stores = [c for c in plan.commands if c.phase == "stage" and "endpoint key" in c.what]
    assert {c.node for c in stores} == {"server", "orin", "xavier"}  # every node of the run
    assert all(PER_RUN_KEY in c.what and "umask 077" in c.line and RUN_KEY_FILE in c.line for c in stores)
    text = json.dumps(plan.to_json()) + plan.render()
    assert PER_RUN_KEY in text
    dry = subprocess.run([sys.executable, "-m", "testbed", "run", str(path), "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "endpoint key" in dry.stdout and PER_RUN_KEY in dry.stdout
