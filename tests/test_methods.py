"""Methods are plugins: the registry holds the eight built-in methods with the behaviours the workers
compose, and a method registered at run time is accepted by campaign validation, checked with its own
rules, and read back from a run config with its behaviours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foundation.errors import InputError
from nodes.contracts.methods import Method, MethodCheck, method_named, names, register, unregister
from nodes.contracts.run_config import RunConfigError, parse
from testbed.campaign.load import load_campaign

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
CAMPAIGN = f"""\
name: plugin
inventory: {REPO / "inventory.yaml"}
base:
  method: METHOD
  model: {TINY}
  partition: {{device_layers: DEVICE_LAYERS, stages: 1}}
  devices: [orin]
  workload: {{arrival: constant, rate_per_s: 1.0, requests_per_device: 2, max_new_tokens: 4}}
  link: {{profile: wifi-up}}
"""


def campaign(tmp_path: Path, method: str, device_layers: int = 2) -> Path:
    path = tmp_path / f"{method}-{device_layers}.yaml"
    path.write_text(CAMPAIGN.replace("METHOD", method).replace("DEVICE_LAYERS", str(device_layers)))
    return path


def run_config(method: str) -> dict:
    return {"method": method, "model": str(TINY), "out_dir": "/tmp/out", "partition": {"device_layers": 2, "stages": 1},
            "ranks": [{"role": "stage", "node": "server"}, {"role": "device", "node": "orin", "schedule": "s.jsonl"}]}


def test_the_built_in_methods_compose_hats_strategies():
    gpu_methods = ["cocoserve", "continuous-batching", "static-batching"]
    assert names() == ("centralized", "ushape", "usarathi", "sd", "pc", "sd_pc", "sd_pd", "hat", "serving", "disco",
                       "llms", *gpu_methods)  # fmt: skip
    features = {name: {f for f in ("sd", "pc", "pd") if method_named(name).uses(f)} for name in names()}
    assert features == {"centralized": set(), "ushape": set(), "usarathi": set(), "sd": {"sd"}, "pc": {"pc"},
                        "sd_pc": {"sd", "pc"}, "sd_pd": {"sd", "pd"}, "hat": {"sd", "pc", "pd"},
                        "serving": set(), "disco": set(), "llms": set(), **{n: set() for n in gpu_methods}}  # fmt: skip
    assert [n for n in names() if method_named(n).token_ids_only] == ["centralized", "serving", "disco", "llms",
                                                                       *gpu_methods]  # fmt: skip
    assert [n for n in names() if method_named(n).serves_contexts] == ["llms"]
    assert [n for n in names() if method_named(n).streams] == ["serving", *gpu_methods]
    assert [n for n in names() if method_named(n).gpu_ranks] == gpu_methods
    assert [n for n in names() if method_named(n).autoscales] == ["cocoserve"]
    assert [n for n in names() if method_named(n).batching == "static"] == ["static-batching"]
    assert [n for n in names() if method_named(n).dispatches] == ["disco"]
    assert [n for n in names() if method_named(n).prefill == "server_chunks"] == ["usarathi"]
    assert {n for n in names() if method_named(n).server_state_in_replies} == {"sd", "pc", "sd_pc", "sd_pd", "hat"}
    assert method_named("centralized").server_layers(8, 2) == 8 and method_named("ushape").server_layers(8, 2) == 6


def test_a_streaming_method_runs_one_engine_rank_and_its_settings_are_checked():
    check = MethodCheck("tiny", str(TINY), 8, 0, 2)
    assert [p[0] for p in method_named("serving").problems(check)] == ["partition.stages"]
    assert not list(method_named("serving").problems(check._replace(stages=1)))
    parsed = parse(dict(run_config("serving"), serving={"scheduler": "andes", "capacity_tokens": 4096}))
    assert (parsed.serving.scheduler, parsed.serving.capacity_tokens, parsed.serving.rr_interval) == ("andes", 4096, 50)
    assert parse(parsed.to_json()) == parsed
    with pytest.raises(RunConfigError, match=r"serving\.scheduler is 'lifo'; choose one of fcfs, rr, andes, andes-dp"):
        parse(dict(run_config("serving"), serving={"scheduler": "lifo"}))
    with pytest.raises(RunConfigError, match=r"serving\.capacity_tokens must be a whole number"):
        parse(dict(run_config("serving"), serving={"capacity_tokens": -5}))
    with pytest.raises(RunConfigError, match=r"serving\.watermak is not a field"):
        parse(dict(run_config("serving"), serving={"watermak": 0.9}))


def test_an_unknown_method_names_the_registered_ones(tmp_path):
    with pytest.raises(InputError) as caught:
        load_campaign(campaign(tmp_path, "warp"))
    assert "unknown method 'warp'" in str(caught.value) and "usarathi" in str(caught.value)
    with pytest.raises(RunConfigError, match="choose one of centralized, ushape"):
        parse(run_config("warp"))
    with pytest.raises(ValueError, match="unknown method 'warp'"):
        method_named("warp")


@pytest.fixture
def sarathi_sd():
    """A method made of existing behaviours: the server chunks prompts, the device drafts."""
    method = register(Method(name="sarathi_sd", summary="server-chunked prefill with speculative decoding",
                             prefill="server_chunks", decode="speculative"))  # fmt: skip
    yield method
    unregister("sarathi_sd")


def test_a_registered_method_is_validated_by_its_own_rules_and_read_back_with_its_behaviours(tmp_path, sarathi_sd):
    loaded = load_campaign(campaign(tmp_path, "sarathi_sd"))
    assert loaded.runs[0].settings.method == "sarathi_sd"
    # it drafts, so it needs an adapter trained for the run's m: the tiny model's is for m = 2
    with pytest.raises(InputError) as caught:
        load_campaign(campaign(tmp_path, "sarathi_sd", device_layers=3))
    assert "trained on 2 device layers, not 3" in str(caught.value)
    config = parse(run_config("sarathi_sd"))
    assert config.method_spec is sarathi_sd
    assert config.uses("sd") and not config.uses("pc") and not config.server_state_in_replies
    assert config.server_device_layers == 2


def test_a_method_with_an_unknown_behaviour_is_refused():
    with pytest.raises(ValueError, match="prefill must be one of"):
        Method(name="odd", prefill="sideways")
    with pytest.raises(TypeError, match="no trait"):
        Method(name="odd", colour="blue")
    with pytest.raises(ValueError, match="not registered yet"):
        register(Method(name="ushape"))


def test_the_registry_imports_no_torch():
    import subprocess
    import sys

    probe = "import sys, nodes.contracts.methods; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mpi4py', 'numpy'))))"
    out = subprocess.run([sys.executable, "-c", "import json; " + probe], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout  # fmt: skip
    assert json.loads(out) == []


def test_the_report_says_what_each_method_is_from_its_plugin(tmp_path):
    """A run's manifest records its method as the plugin describes it; the report lists each method of
    the campaign with its behaviours and what to read for it."""
    import shutil

    from analysis.report import ReportOptions, build_report

    directory = tmp_path / "campaign"
    shutil.copytree(REPO / "tests" / "data" / "sample-campaign", directory)
    for path in sorted((directory / "runs").glob("*/manifest.json")):
        manifest = json.loads(path.read_text())
        manifest["method"] = method_named(manifest["settings"]["method"]).describe()
        path.write_text(json.dumps(manifest))
    text = build_report(directory, ReportOptions()).read_text()
    section = text.split("## Methods", 1)[1].split("##", 1)[0]
    methods = {json.loads(p.read_text())["settings"]["method"] for p in (directory / "runs").glob("*/manifest.json")}
    for name in methods:
        assert f"**{name}**: {method_named(name).summary}" in section
    assert "prefill: whole, decode: token" in section


def test_the_run_config_the_controller_builds_is_what_the_ranks_read():
    """The controller builds a RunConfig and writes its JSON; the ranks parse exactly it back."""
    from nodes.contracts.run_config import RankSpec
    from testbed.workers.split_spec import MethodSections, SplitRunSpec, run_config_for

    spec = SplitRunSpec(method="hat", model=str(TINY), server="server", devices=("orin",), stages=2, device_layers=2,
                        chunk_tokens=64, run_id="r1-a1", sections=MethodSections(draft={"eta": 0.5, "top_k": 2}))  # fmt: skip
    ranks = (RankSpec("stage", "server", 0, "cpu", 1), RankSpec("stage", "server", 1, "cpu", 1),
             RankSpec("device", "orin", 0, "cpu", 1, "/w/runs/r1-a1/schedule-orin.jsonl"))  # fmt: skip
    config = run_config_for(spec, "/w/models/tiny/server-m2", "/w/runs/r1-a1", ranks)
    back = parse(json.loads(json.dumps(config.to_json())))
    assert back == config
    assert back.draft.adapter == str(TINY / "draft") and back.draft.eta == 0.5 and back.draft.top_k == 2
    assert back.rank_dir(2) == "/w/runs/r1-a1/out/device-0-orin" and back.uses("pd")
