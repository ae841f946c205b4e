"""A method family is one module on the controller (testbed.campaign.families): a lab adds one, with its
method, in a module of its own named by TESTBED_METHOD_FAMILIES, and the campaign's settings, its checks
at the campaign's line, its unread settings and the devices' schedules all take it, touching nothing else.
The built-in families answer what spec.py, validation.py and run_spec.py used to ask of each by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodes.contracts.methods import method_named
from testbed.campaign.families import families, family_named
from testbed.campaign.spec import RunSettings

REPO = Path(__file__).resolve().parent.parent

LAB_FAMILIES = '''
from pydantic import Field, StrictInt

from nodes.contracts.methods import Method, register as register_method
from testbed.campaign.families import MethodFamily, SectionModel, register

register_method(Method(name="probe-train", summary="fixed-gap probe requests, one model on the server"))


class ProbeTrainSettings(SectionModel):
    requests: StrictInt = Field(2, ge=1, le=50)
    gap_s: float = Field(0.5, gt=0, le=60)
    group: str | None = None  # an inventory group the probes come from


class ProbeTrain(MethodFamily):
    section = "probe_train"
    settings_model = ProbeTrainSettings

    def applies(self, method):
        return method.name == "probe-train"

    def in_run_config(self, settings):
        return False

    def schedules(self, context, settings, devices, seed):
        if not self.applies_to(settings):
            return None
        knobs = self.settings_of(settings)
        return {d: [{"request_id": i, "arrival_s": i * knobs.gap_s, "prompt": "def probe():",
                     "max_new_tokens": settings.workload.max_new_tokens} for i in range(knobs.requests)]
                for d in devices}

    def applies_to(self, settings):
        from nodes.contracts.methods import method_named
        return self.applies(method_named(settings.method))

    def problems(self, context, settings):
        knobs = self.settings_of(settings)
        if self.applies_to(settings) and knobs.group is not None and knobs.group not in context.inventory.groups:
            yield "probe_train.group", f"no group {knobs.group!r} in the inventory", "name one of its groups"

    def ignored(self, settings):
        return {"workload.arrival": "probe-train sends at fixed gaps"} if self.applies_to(settings) else {}


register(ProbeTrain())
'''

PLAN = """
import json, sys
from testbed.campaign.load import load_campaign
from testbed.campaign.run_spec import split_spec
campaign = load_campaign(sys.argv[1])
spec = split_spec(campaign, campaign.runs[0], 1)
print(json.dumps({"schedules": {d: list(rows) for d, rows in spec.schedules},
                  "sections": sorted(k for k, v in vars(spec.sections).items() if v is not None)}))
"""


def campaign(tmp_path: Path, name: str, method: str, section: str, workload: str = "") -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"""name: {name}
inventory: {REPO / 'inventory.yaml'}
base:
  method: {method}
  model: {REPO / 'examples' / 'models' / 'tiny'}
  partition: {{device_layers: 0, stages: 1}}
  devices: [orin]
  workload: {{requests_per_device: 2, max_new_tokens: 4{workload}}}
{section}""")
    return path


def run(args: list[str], tmp_path: Path, script: str | None = None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "lab").mkdir(exist_ok=True)
    (tmp_path / "lab" / "lab_families.py").write_text(LAB_FAMILIES)
    env = dict(os.environ, TESTBED_METHOD_FAMILIES="lab_families",
               PYTHONPATH=os.pathsep.join([str(tmp_path / "lab"), str(REPO)]))  # fmt: skip
    command = [sys.executable, "-c", script, *args] if script else [sys.executable, "-m", "testbed", *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_a_lab_family_needs_only_its_module(tmp_path):
    good = campaign(tmp_path, "probes", "probe-train", "  probe_train: {requests: 3, gap_s: 0.25}\n")
    planned = run([str(good)], tmp_path, PLAN)
    assert planned.returncode == 0, planned.stderr[-2000:]
    out = json.loads(planned.stdout)
    rows = out["schedules"]["orin"]  # the family's schedule, not the workload's two requests
    assert [r["arrival_s"] for r in rows] == [0.0, 0.25, 0.5] and rows[0]["max_new_tokens"] == 4
    assert out["sections"] == ["draft"]  # its section stays on the controller (in_run_config: False)
    dry = run(["run", str(good), "--dry-run"], tmp_path)
    assert dry.returncode == 0, dry.stderr[-2000:]

    # its section written for another method: refused at the campaign's line, exit 2
    elsewhere = campaign(tmp_path, "elsewhere", "ushape", "  probe_train: {requests: 3}\n")
    refused = run(["run", str(elsewhere), "--dry-run"], tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "elsewhere.yaml:" in refused.stderr and "probe_train" in refused.stderr and "ushape" in refused.stderr
    # a value out of its model's bounds, and its own check against the lab, at their lines
    bad = campaign(tmp_path, "bad", "probe-train", "  probe_train: {requests: 99, group: nosuch}\n")
    refused = run(["run", str(bad), "--dry-run"], tmp_path)
    assert refused.returncode == 2 and "probe_train.requests" in refused.stderr, refused.stderr
    unknown_group = campaign(tmp_path, "group", "probe-train", "  probe_train: {group: nosuch}\n")
    refused = run(["run", str(unknown_group), "--dry-run"], tmp_path)
    assert refused.returncode == 2 and "probe_train.group" in refused.stderr and "nosuch" in refused.stderr
    # a setting it leaves unread is named as such
    unread = campaign(tmp_path, "unread", "probe-train", "", workload=", arrival: constant")
    refused = run(["run", str(unread), "--dry-run"], tmp_path)
    assert refused.returncode == 2 and "workload.arrival" in refused.stderr and "fixed gaps" in refused.stderr


def test_a_families_module_that_fails_to_import_is_named(tmp_path):
    done = subprocess.run([sys.executable, "-m", "testbed", "run", str(REPO / "examples/campaigns/demo.yaml"),
                           "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                          env=dict(os.environ, TESTBED_METHOD_FAMILIES="no_such_families"))  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "TESTBED_METHOD_FAMILIES" in done.stderr and "no_such_families" in done.stderr


def test_run_settings_take_one_section_per_family_and_refuse_it_elsewhere():
    sections = [f.section for f in families()]
    assert sections == ["draft", "serving", "dispatch", "context_service", "scaling"]
    assert set(sections) <= set(RunSettings.model_fields)
    for family in families():
        if not family.refuse_elsewhere:
            continue
        reader = next(m for m in ("disco", "llms", "cocoserve") if family.applies(method_named(m)))
        assert getattr(RunSettings(method=reader, **{family.section: {}}), family.section) is not None
        with pytest.raises(ValueError, match=f"{family.section}: ushape does not"):
            RunSettings(method="ushape", **{family.section: {}})
    # a section not written reads as its defaults; the drafting one is always there
    assert RunSettings(method="serving").section("serving").scheduler == "fcfs"
    assert RunSettings().draft.eta == family_named("draft").settings_model().eta


def test_what_a_run_leaves_unread_comes_from_its_families():
    from testbed.campaign.validation import ignored_settings

    assert "serving" in ignored_settings(RunSettings(method="ushape"))
    assert "draft" in ignored_settings(RunSettings(method="ushape"))
    andes = ignored_settings(RunSettings(method="serving", serving={"scheduler": "fcfs"}))
    assert "serving.watermark" in andes and "draft" in andes and "serving" not in andes
    assert "workload" in ignored_settings(RunSettings(method="llms"))
    assert "scaling.t_up" in ignored_settings(RunSettings(method="static-batching"))
