"""Bad user files refused when they are loaded, one test per kind of input the review found let
through: each problem is ``FILE:LINE: field: what is wrong; hint`` (an :class:`InputError`, exit status
2 from the command line), never an acceptance that fails later and never a traceback.

Files are the shipped examples with one edit, so each test shows the one thing that is wrong.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from foundation.errors import InputError, InputProblem
from netem.mahimahi import import_mahimahi, load_opportunities
from netem.trace import load_trace
from testbed.campaign.load import load_campaign
from testbed.inventory import links_from_file, load_inventory
from testbed.target.compute_profiles import load_profile
from tests.conftest import REPO, run_cli

EXAMPLES = REPO / "examples"


def example(tmp_path: Path, relative: str, old: str, new: str, *, name: str | None = None) -> Path:
    """The shipped file ``relative`` with ``old`` replaced by ``new`` (once), written to ``tmp_path``;
    a campaign's relative paths are made absolute so that it loads from there."""
    text = (REPO / relative).read_text(encoding="utf-8")
    assert old in text, f"{old!r} is not in {relative}"
    text = text.replace(old, new, 1)
    if relative.startswith("examples/campaigns/"):
        text = text.replace("../../", f"{REPO}/").replace("../", f"{EXAMPLES}/")
    path = tmp_path / (name or Path(relative).name)
    path.write_text(text, encoding="utf-8")
    return path


def line_of(path: Path, needle: str) -> int:
    found = [i for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if needle in line]
    assert len(found) == 1, f"{needle!r} is on lines {found} of {path}"
    return found[0]


def refused(load: Callable[[], Any]) -> list[InputProblem]:
    """The problems ``load`` raised, each checked to carry its file's line."""
    with pytest.raises(InputError) as caught:
        load()
    problems = list(caught.value.problems)
    assert all(p.line is not None for p in problems), [str(p) for p in problems]
    return problems


def one(problems: list[InputProblem], field: str) -> InputProblem:
    matching = [p for p in problems if p.field == field]
    assert len(matching) == 1, f"no single problem at {field}: {[str(p) for p in problems]}"
    return matching[0]


# --------------------------------------------------------------------------------------------
# Compute profiles (examples/profiles/*.yaml)

PROFILE = "examples/profiles/agx-orin.yaml"


@pytest.mark.parametrize("written", [".inf", "-.inf", ".nan"])
def test_a_profile_number_that_is_not_finite_is_refused_at_its_line(tmp_path: Path, written: str) -> None:
    path = example(tmp_path, PROFILE, "memory_gb: 64", f"memory_gb: {written}")
    problem = one(refused(lambda: load_profile(path)), "memory_gb")
    assert problem.line == line_of(path, f"memory_gb: {written}") and "finite" in problem.problem


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("tflops: 42.6,", "tflops: 1e300,", "peak.tflops"),
        ("mem_bw_gbps: 204.8,", "mem_bw_gbps: 1e12,", "peak.mem_bw_gbps"),
        ("sharpness: 1.5", "sharpness: 1e9", "efficiency.sharpness"),  # (t^p + ...)^(1/p) overflows on the nodes
        ("layer_overhead_ms: 0.05", "layer_overhead_ms: 1e15", "efficiency.layer_overhead_ms"),
        ("tpcs: 8}", "tpcs: 100000000000000000000}", "peak.tpcs"),
    ],
)
def test_a_profile_number_beyond_any_hardware_is_refused(tmp_path: Path, old: str, new: str, field: str) -> None:
    path = example(tmp_path, PROFILE, old, new)
    problem = one(refused(lambda: load_profile(path)), field)
    assert "less than or equal" in problem.problem


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [("memory_gb: 64", "memory_gb: '64'", "memory_gb"), ("tpcs: 8}", "tpcs: true}", "peak.tpcs"),
     ("bw: 0.85", "bw: yes", "efficiency.bw")],
)  # fmt: skip
def test_a_profile_number_written_as_text_or_a_boolean_is_refused(tmp_path: Path, old: str, new: str,
                                                                   field: str) -> None:  # fmt: skip
    path = example(tmp_path, PROFILE, old, new)
    one(refused(lambda: load_profile(path)), field)


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [("hardware: agx-orin", "hardware: ''", "hardware"),
     ("  MODE_15W: {", '  "MODE\\e[31m15W": {', "modes.MODE\x1b[31m15W"),
     ("  MODE_15W: {", "  '': {", "modes."),
     ("description: NVIDIA Jetson", 'description: "NVIDIA\\u202e"  # NVIDIA Jetson', "description")],
)  # fmt: skip
def test_a_profile_name_that_is_empty_or_carries_control_characters_is_refused(tmp_path: Path, old: str, new: str,
                                                                                field: str) -> None:  # fmt: skip
    path = example(tmp_path, PROFILE, old, new)
    one(refused(lambda: load_profile(path)), field)


# --------------------------------------------------------------------------------------------
# Inventories: endpoints, link profiles, data addresses, power modes, paths

INVENTORY = "inventory.yaml"
LAB = "examples/inventories/lab.yaml"


def with_endpoint(tmp_path: Path, endpoint: str, relative: str = INVENTORY) -> Path:
    return example(tmp_path, relative, "\ngroups:\n", f"\nendpoints:\n  vllm: {endpoint}\ngroups:\n")


@pytest.mark.parametrize("url", ["http://lab:hunter2@10.50.0.2:8000/v1", "https://token@api.example.com/v1",
                                 "http://10.50.0.2:8000/v1?api_key=hunter2"])  # fmt: skip
def test_an_endpoint_url_that_carries_credentials_is_refused(tmp_path: Path, url: str) -> None:
    path = with_endpoint(tmp_path, f"{{url: '{url}'}}")
    problem = one(refused(lambda: load_inventory(path)), "endpoints.vllm.url")
    assert "hunter2" not in str(problem) and "token@" not in str(problem)  # the secret is not echoed
    assert "api_key_env" in problem.hint


def test_an_endpoint_key_over_plain_http_to_a_remote_host_is_refused(tmp_path: Path) -> None:
    path = with_endpoint(tmp_path, "{url: 'http://vllm.lab.example:8000/v1', api_key_env: VLLM_KEY}")
    problem = one(refused(lambda: load_inventory(path)), "endpoints.vllm.url")
    assert "https" in problem.hint
    # the same key over https, or over http to this machine or an emulated node, is fine
    for url in ("https://vllm.lab.example/v1", "http://127.0.0.1:8000/v1", "http://localhost:8000/v1",
                "http://10.232.0.2:8000/v1", "http://[::1]:8000/v1"):  # fmt: skip
        load_inventory(with_endpoint(tmp_path, f"{{url: '{url}', api_key_env: VLLM_KEY}}"))


@pytest.mark.parametrize("url", ["http://10.50.0.2:99999/v1", "http://10.50.0.2:0/v1", "http://10.50.0.2:x/v1",
                                 "http://vllm.lab.exämple/v1", "http://10.50.0.2/v1\x1b"])  # fmt: skip
def test_an_endpoint_url_that_no_client_can_open_is_refused(tmp_path: Path, url: str) -> None:
    path = with_endpoint(tmp_path, f"{{url: {json.dumps(url)}}}")
    one(refused(lambda: load_inventory(path)), "endpoints.vllm.url")


def test_a_loss_correlation_of_100_percent_is_refused(tmp_path: Path) -> None:
    # netem repeats its first draw for ever (loss off); the Gilbert chain never leaves its bad state
    path = example(tmp_path, LAB, "loss: 0.1%}", "loss: 0.1%, loss_correlation: 100%}")
    problem = one(refused(lambda: load_inventory(path)), "link_profiles.up-8m.loss_correlation")
    assert "100%" in problem.problem


def test_jitter_larger_than_the_delay_is_refused(tmp_path: Path) -> None:
    # delays below 0 are cut to 0: neither the mean delay nor the jitter would be what is written
    path = example(tmp_path, LAB, "up-2m: {rate: 10MBps, delay: 2ms, jitter: 1ms",
                   "up-2m: {rate: 10MBps, delay: 2ms, jitter: 5ms")  # fmt: skip
    one(refused(lambda: load_inventory(path)), "link_profiles.up-2m.jitter")


def test_reorder_without_jitter_is_refused(tmp_path: Path) -> None:
    path = example(tmp_path, INVENTORY, "wifi-up: {rate: 8MBps, delay: 2ms}", "wifi-up: {rate: 8MBps, delay: 2ms, reorder: true}")
    one(refused(lambda: load_inventory(path)), "link_profiles.wifi-up.reorder")


def test_a_links_file_is_held_to_the_same_profile_rules(tmp_path: Path) -> None:
    path = example(tmp_path, "examples/links/wifi-delay.yaml", "loss: 0.1%}", "loss: 0.1%, loss_correlation: 100%}")
    lab = load_inventory(REPO / INVENTORY)
    one(refused(lambda: links_from_file(lab, path)), "link_profiles.wifi-up-lossy.loss_correlation")


@pytest.mark.parametrize("address", ["fd00::2", "0.0.0.0", "224.0.0.5", "255.255.255.255", "240.0.0.1"])
def test_a_data_address_the_tc_filters_and_iptables_rules_cannot_match_is_refused(tmp_path: Path,
                                                                                   address: str) -> None:  # fmt: skip
    path = example(tmp_path, LAB, "address: 10.50.0.2}", f"address: '{address}'}}")
    problem = one(refused(lambda: load_inventory(path)), "nodes[0].data.address")
    assert problem.line == line_of(path, f"'{address}'")


@pytest.mark.parametrize(
    ("relative", "old", "new", "field"),
    [(INVENTORY, "{id: 1, name: MODE_15W,", "{id: 1, name: MODE_15W@5,", "nodes[1].emulated.power_modes[1].name"),
     (INVENTORY, "{id: 1, name: MODE_15W,", "{id: 1, name: '2',", "nodes[1].emulated.power_modes[1].name"),
     (INVENTORY, "{id: 0, name: default,", "{id: 0, name: turbo,", "nodes[0].emulated.power_modes[0].name")],
)  # fmt: skip
def test_an_emulated_power_mode_name_that_its_kind_cannot_set_is_refused(tmp_path: Path, relative: str, old: str,
                                                                          new: str, field: str) -> None:  # fmt: skip
    path = example(tmp_path, relative, old, new)
    one(refused(lambda: load_inventory(path)), field)


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [("workdir: ~/hil-testbed", "workdir: hil-testbed", "defaults.workdir"),
     ("workdir: ~/hil-testbed", "workdir: ~lab/hil-testbed", "defaults.workdir"),
     ("workdir: ~/hil-testbed", "workdir: /", "defaults.workdir"),
     ("# venv: ~/hil-testbed/venv", "venv: venvs/testbed", "defaults.venv"),
     ("python: /usr/bin/python3", "python: bin/python3", "defaults.python"),
     ("identity_file: ~/.ssh/testbed_ed25519", "identity_file: keys/testbed_ed25519", "defaults.ssh.identity_file")],
)  # fmt: skip
def test_a_relative_path_that_would_resolve_against_whatever_directory_is_current_is_refused(
    tmp_path: Path, old: str, new: str, field: str
) -> None:
    path = example(tmp_path, LAB, old, new)
    problem = one(refused(lambda: load_inventory(path)), field)
    assert "absolute" in problem.problem or "absolute" in problem.hint


def test_a_bare_python_command_and_home_relative_paths_stay_accepted(tmp_path: Path) -> None:
    path = example(tmp_path, LAB, "python: /usr/bin/python3", "python: python3.8")
    assert load_inventory(path).spec.defaults.python == "python3.8"


def test_an_emulated_subnet_too_large_to_plan_is_refused(tmp_path: Path) -> None:
    # the emulation's plan lists the subnet's hosts: a /12 is a million addresses
    path = example(tmp_path, INVENTORY, "data_subnet: 10.232.0.0/24", "data_subnet: 172.16.0.0/12")
    one(refused(lambda: load_inventory(path)), "emulation.data_subnet")


# --------------------------------------------------------------------------------------------
# Trace CSVs (examples/traces/*.csv)

TRACE = "examples/traces/hat-mid.csv"


@pytest.mark.parametrize(("rate", "why"), [("1bit", "at least"), ("999bit", "at least"), ("1e15gbit", "at most")])
def test_a_trace_rate_outside_what_a_link_profile_allows_is_refused(tmp_path: Path, rate: str, why: str) -> None:
    path = example(tmp_path, TRACE, "3.149,7.85MBps", f"3.149,{rate}")
    problem = one(refused(lambda: load_trace(path)), "up_rate")
    assert problem.line == line_of(path, f"3.149,{rate}") and why in problem.problem


def test_a_trace_scaled_below_the_link_floor_is_refused_when_the_campaign_loads(tmp_path: Path) -> None:
    path = example(tmp_path, "examples/campaigns/hat-table5.yaml", "rate_scale: 0.125", "rate_scale: 0.00001")
    problem = one(refused(lambda: load_campaign(path)), "base.link.rate_scale")
    assert problem.line == line_of(path, "rate_scale:") and "hat-mid.csv" in problem.problem
    result = run_cli("run", str(path), "--dry-run")
    assert result.returncode == 2 and f"{path}:{problem.line}: base.link.rate_scale" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_profile_scaled_below_the_link_floor_is_refused_when_the_campaign_loads(tmp_path: Path) -> None:
    path = example(tmp_path, "examples/campaigns/demo.yaml", "link: {profile: wifi-up}",
                   "link: {profile: wifi-up, rate_scale: 0.00001}")  # fmt: skip
    one(refused(lambda: load_campaign(path)), "base.link.rate_scale")


def test_a_trace_that_is_not_utf8_is_refused_at_its_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_bytes((REPO / TRACE).read_bytes().replace(b"3.149,7.85MBps", b"3.149,7.85\xffMBps"))
    problem = refused(lambda: load_trace(path))[0]
    assert problem.line == 4 and "UTF-8" in problem.problem


@pytest.mark.parametrize("t_s", ["3_149", "\u0663.149", "+3.149", "0x10"])
def test_a_trace_time_that_is_not_a_plain_decimal_number_is_refused(tmp_path: Path, t_s: str) -> None:
    path = example(tmp_path, TRACE, "3.149,7.85MBps", f"{t_s},7.85MBps")
    assert one(refused(lambda: load_trace(path)), "t_s").line == 4


def test_a_trace_with_a_column_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("t_s,up_rate,down_rate,up_rate\n0,8mbit,8mbit,1mbit\n")
    assert one(refused(lambda: load_trace(path)), "header").line == 1


def test_a_trace_with_a_header_only_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("# nothing yet\nt_s,up_rate,down_rate\n")
    assert refused(lambda: load_trace(path))[0].line == 2


def test_a_trace_row_beyond_what_a_trace_can_hold_is_refused(tmp_path: Path) -> None:
    path = example(tmp_path, TRACE, "3.149,7.85MBps", "1e300,7.85MBps")
    assert next(p.line for p in refused(lambda: load_trace(path)) if p.field == "t_s") == 4


# --------------------------------------------------------------------------------------------
# Mahimahi traces


def write_mahimahi(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


@pytest.mark.parametrize("word", ["\u00b2", "\u0663", "\uff13", "1_0", "+5", "5.0", "0x10"])
def test_a_mahimahi_line_that_is_not_a_plain_decimal_number_is_refused_at_its_line(tmp_path: Path,
                                                                                    word: str) -> None:  # fmt: skip
    path = write_mahimahi(tmp_path, "up", f"1\n2\n{word}\n9\n")
    problem = refused(lambda: load_opportunities(path))[0]
    assert problem.line == 3


def test_a_mahimahi_file_that_is_not_utf8_is_refused_at_its_line(tmp_path: Path) -> None:
    path = write_mahimahi(tmp_path, "up", b"1\n2\n\xff\n9\n")
    assert refused(lambda: load_opportunities(path))[0].line == 3


@pytest.mark.parametrize("last", ["100000000000", "99999999999999999999999999"])
def test_an_absurd_mahimahi_length_is_refused_before_anything_is_allocated(tmp_path: Path, last: str) -> None:
    up = write_mahimahi(tmp_path, "up", f"1\n2\n{last}\n")
    down = write_mahimahi(tmp_path, "down", "5\n10\n")
    problem = refused(lambda: import_mahimahi(up, down, bin_s=0.01))[0]
    assert (problem.file, problem.line) == (str(up), 3)


def test_a_mahimahi_trace_too_long_for_its_bins_is_refused(tmp_path: Path) -> None:
    # a day at 10 ms bins would be 8.6 million rows
    up = write_mahimahi(tmp_path, "up", "1\n86400000\n")
    down = write_mahimahi(tmp_path, "down", "5\n10\n")
    problem = refused(lambda: import_mahimahi(up, down, bin_s=0.01))[0]
    assert (problem.file, problem.line) == (str(up), 2) and "--bin" in problem.hint


def test_a_mahimahi_line_that_never_ends_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    path = write_mahimahi(tmp_path, "up", "1\n" + "7" * 5_000_000)
    assert refused(lambda: load_opportunities(path))[0].line == 2


@pytest.mark.parametrize(("option", "value"), [("--bin", "nan"), ("--bin", "inf"), ("--delay-ms", "inf"),
                                               ("--delay-ms", "nan"), ("--loss-pct", "nan"),
                                               ("--delay-ms", "100000")])  # fmt: skip
def test_import_mahimahi_refuses_options_that_are_not_finite_or_in_range(tmp_path: Path, option: str,
                                                                          value: str) -> None:  # fmt: skip
    up = write_mahimahi(tmp_path, "up", "1\n2\n3\n")
    down = write_mahimahi(tmp_path, "down", "1\n2\n3\n")
    result = run_cli("link", "import-mahimahi", str(up), str(down), "--out", str(tmp_path / "t.csv"), option, value)
    assert result.returncode == 2, result.stdout + result.stderr
    assert option in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "t.csv").exists()


# --------------------------------------------------------------------------------------------
# Campaigns: sections a method ignores, contradictions, capacity, paths, power modes


@pytest.mark.parametrize(
    ("relative", "old", "new", "field"),
    [("examples/campaigns/demo.yaml", "  telemetry: {interval_ms: 100}",
      "  telemetry: {interval_ms: 100}\n  serving: {scheduler: rr}", "base.serving"),
     ("examples/campaigns/demo.yaml", "  telemetry: {interval_ms: 100}",
      "  telemetry: {interval_ms: 100}\n  draft: {eta: 0.5}", "base.draft"),
     ("examples/campaigns/demo.yaml", "  telemetry: {interval_ms: 100}",
      "  telemetry: {interval_ms: 100}\n  chunk_tokens: 64", "base.chunk_tokens"),
     ("examples/campaigns/llms-ablation.yaml", "  link: {shaped: false}", "  link: {shaped: false}\n  workload: "
      "{prompts: alpaca}", "base.workload"),
     ("examples/campaigns/andes-dp.yaml", "serving: {scheduler: andes,", "serving: {rr_interval: 5, scheduler: andes,",
      "base.serving.rr_interval"),
     ("examples/campaigns/andes-table4.yaml", "serving: {scheduler: fcfs,", "serving: {dp_block_tokens: 32, "
      "scheduler: fcfs,", "base.serving.dp_block_tokens"),
     ("examples/campaigns/disco-budget.yaml", "dispatch: {service: gpt,", "dispatch: {source_keeps_streaming: false, "
      "service: gpt,", "base.dispatch.source_keeps_streaming")],
)  # fmt: skip
def test_a_setting_that_no_run_of_the_campaign_uses_is_refused(tmp_path: Path, relative: str, old: str, new: str,
                                                                field: str) -> None:  # fmt: skip
    path = example(tmp_path, relative, old, new)
    problem = one(refused(lambda: load_campaign(path)), field)
    assert "no run" in problem.problem


def test_a_setting_some_runs_use_stays_accepted(tmp_path: Path) -> None:
    # hat-table5 draws only in its drafting runs, and its base method does not draft
    path = example(tmp_path, "examples/campaigns/hat-table5.yaml", "repetitions: 2", "repetitions: 1")
    assert len(load_campaign(path).runs) == 14


@pytest.mark.parametrize(
    ("relative", "old", "new", "field"),
    [("examples/campaigns/andes-table4.yaml", "link: {shaped: false}", "link: {shaped: false, profile: wifi-up}",
      "base.link.profile"),
     ("examples/campaigns/andes-table4.yaml", "link: {shaped: false}", "link: {shaped: false, verify_s: 5}",
      "base.link.verify_s"),
     ("examples/campaigns/demo.yaml", "telemetry: {interval_ms: 100}", "telemetry: {interval_ms: 100, enabled: false}",
      "base.telemetry.interval_ms"),
     ("examples/campaigns/cocoserve-steps.yaml", "    arrival: steps", "    arrival: steps\n    rate_per_s: 5",
      "base.workload.rate_per_s"),
     ("examples/campaigns/disco-budget.yaml", "dispatch: {service: gpt,", "dispatch: {policy: server-only, "
      "service: gpt,", "matrix.dispatch.budget")],
)  # fmt: skip
def test_a_setting_that_its_own_section_makes_meaningless_is_refused(tmp_path: Path, relative: str, old: str,
                                                                     new: str, field: str) -> None:  # fmt: skip
    if field == "matrix.dispatch.budget":  # the matrix gives every run a policy: take it out
        path = example(tmp_path, relative, old, new)
        text = path.read_text().replace("  dispatch.policy: [stoch-s, disco-s, stoch-d, disco-d]\n", "")
        path.write_text(text.replace("  dispatch.service: [gpt, command]\n", ""))
    else:
        path = example(tmp_path, relative, old, new)
    one(refused(lambda: load_campaign(path)), field)


def test_weights_that_cannot_fit_a_gpu_are_refused_when_the_campaign_loads(tmp_path: Path) -> None:
    path = example(tmp_path, "examples/campaigns/cocoserve-steps.yaml", "gpu_memory_gb: 26.8", "gpu_memory_gb: 2")
    problem = one(refused(lambda: load_campaign(path)), "base.scaling.gpu_memory_gb")
    assert problem.line == line_of(path, "gpu_memory_gb:") and "do not fit" in problem.problem
    result = run_cli("run", str(path), "--dry-run")
    assert result.returncode == 2 and f"{path}:{problem.line}: base.scaling.gpu_memory_gb" in result.stderr


def test_an_empty_list_of_context_tasks_is_refused(tmp_path: Path) -> None:
    path = example(tmp_path, "examples/campaigns/llms-ablation.yaml", "    budget_gb: 0.5",
                   "    budget_gb: 0.5\n    tasks: []")  # fmt: skip
    one(refused(lambda: load_campaign(path)), "base.context_service.tasks")


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [("link: {trace: ../traces/hat-mid.csv,", "link: {trace: '',", "base.link.trace"),
     ("model: ../models/tiny", "model: ''", "base.model"),
     ("draft: {eta: 0.6,", "draft: {adapter: '', eta: 0.6,", "base.draft.adapter")],
)  # fmt: skip
def test_an_empty_path_is_refused_not_taken_as_unset(tmp_path: Path, old: str, new: str, field: str) -> None:
    path = example(tmp_path, "examples/campaigns/hat-table5.yaml", old, new)
    one(refused(lambda: load_campaign(path)), field)


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [("power: {orin: MAXN, xavier: MAXN}", "power: {orin: MAXN, xavier: MAXN, server: 'x; reboot'}", "base.power.server"),
     ("power: {orin: MAXN, xavier: MAXN}", "power: {orin: MAXN, xavier: MAXN, server: 300W}", "base.power.server"),
     ("power.orin: [MAXN, MODE_30W]", "power.orin: [MAXN, 'MODE_30W\\n']", "matrix.power.orin[1]")],
)  # fmt: skip
def test_a_power_mode_that_is_not_a_mode_of_the_node_is_refused(tmp_path: Path, old: str, new: str,
                                                                 field: str) -> None:  # fmt: skip
    path = example(tmp_path, "examples/campaigns/demo.yaml", old, new)
    one(refused(lambda: load_campaign(path)), field)


@pytest.mark.parametrize(("mode", "ok"), [("default", True), ("250W", True), ("250.5w", True), ("turbo", False),
                                          ("250 W; reboot", False)])  # fmt: skip
def test_a_real_server_takes_default_or_a_limit_in_watts(tmp_path: Path, mode: str, ok: bool) -> None:
    campaign = tmp_path / "campaign.yaml"
    campaign.write_text(f"name: watts\ninventory: {EXAMPLES}/inventories/lab.yaml\nbase:\n  model: {EXAMPLES}/models/tiny\n"
                        f"  partition: {{device_layers: 2, stages: 2}}\n  server: gpu-server\n  devices: [xavier-01]\n"
                        f"  link: {{profile: up-2m}}\n  power: {{gpu-server: {json.dumps(mode)}}}\n")  # fmt: skip
    if ok:
        assert load_campaign(campaign).runs[0].settings.power == {"gpu-server": mode}
    else:
        one(refused(lambda: load_campaign(campaign)), "base.power.gpu-server")


@pytest.mark.parametrize("seed", ["-1", "18446744073709551616", "1e3", "true"])
def test_a_seed_that_is_not_a_64_bit_count_is_refused(tmp_path: Path, seed: str) -> None:
    path = example(tmp_path, "examples/campaigns/demo.yaml", "seed: 2026", f"seed: {seed}")
    one(refused(lambda: load_campaign(path)), "seed")


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [("description: U-shape", 'description: "U-shape\\e]0;owned\\a"  # U-shape', "description"),
     ("prompts: tiny-python", 'prompts: "tiny-python\\u202e"', "base.workload.prompts"),
     ("model: ../models/tiny", 'model: "../models/tiny\\n"', "base.model")],
)  # fmt: skip
def test_control_characters_in_a_campaign_string_are_refused(tmp_path: Path, old: str, new: str, field: str) -> None:
    path = example(tmp_path, "examples/campaigns/demo.yaml", old, new)
    one(refused(lambda: load_campaign(path)), field)


def test_a_target_config_json_with_absurd_sizes_is_refused(tmp_path: Path) -> None:
    config = json.loads((EXAMPLES / "models" / "tiny" / "config.json").read_text())
    config["num_hidden_layers"] = 10**12
    (tmp_path / "huge").mkdir()
    (tmp_path / "huge" / "config.json").write_text(json.dumps(config))
    path = example(tmp_path, "examples/campaigns/llms-ablation.yaml", "target: {model: llama-2-7b,",
                   f"target: {{model: {tmp_path / 'huge'},")  # fmt: skip
    problem = one(refused(lambda: load_campaign(path)), "base.target.model")
    assert "num_hidden_layers" in problem.problem


def test_every_number_of_every_shipped_profile_is_finite_and_in_range() -> None:
    for path in sorted((EXAMPLES / "profiles").glob("*.yaml")):
        profile = load_profile(path)
        for mode in profile.modes:
            assert all(math.isfinite(v) for v in profile.rates(mode)), (path, mode)


def test_problem_lines_never_fall_back_to_none_for_a_whole_file_problem(tmp_path: Path) -> None:
    for name, load in (("inventory.yaml", load_inventory), ("profile.yaml", load_profile),
                       ("campaign.yaml", load_campaign)):  # fmt: skip
        path = tmp_path / name
        path.write_text("# nothing but a comment\n")
        assert re.match(rf"{re.escape(str(path))}:1: ", str(refused(lambda: load(path))[0]))  # noqa: B023


def test_a_matrix_key_into_a_section_the_base_leaves_unset_is_checked_not_a_traceback(tmp_path: Path) -> None:
    # the base writes 'dispatch:' empty (null): the matrix's dispatch.policy sets it, it does not crash
    path = example(tmp_path, "examples/campaigns/disco-budget.yaml", "  dispatch: {service: gpt, device_speed: "
                   "pixel7pro-bloom-1.1b, calibration_requests: 40}", "  dispatch:")  # fmt: skip
    campaign = load_campaign(path)
    assert {run.settings.dispatch.policy for run in campaign.runs} == {"stoch-s", "disco-s", "stoch-d", "disco-d"}
    path.write_text(path.read_text().replace("  dispatch.budget: [0.2, 0.5, 0.8]", "  dispatch.budget: [0.2, 2]"))
    assert one(refused(lambda: load_campaign(path)), "matrix.dispatch.budget[1]").line == line_of(path, "[0.2, 2]")


def test_a_delay_stretched_past_a_links_maximum_by_the_dilation_is_refused(tmp_path: Path) -> None:
    lab = example(tmp_path, INVENTORY, "wifi-up: {rate: 8MBps, delay: 2ms}", "wifi-up: {rate: 8MBps, delay: 50ms}")
    path = example(tmp_path, "examples/campaigns/demo.yaml", "  telemetry: {interval_ms: 100}",
                   "  telemetry: {interval_ms: 100}\n  target: {model: vicuna-7b, dilation: 1000}")  # fmt: skip
    path.write_text(path.read_text().replace(f"inventory: {REPO}/inventory.yaml", f"inventory: {lab}"))
    problem = one(refused(lambda: load_campaign(path)), "base.target.dilation")
    assert "50ms" in problem.problem and problem.line == line_of(path, "dilation: 1000")


def test_a_prompt_file_and_an_arrival_trace_are_read_when_the_campaign_loads(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": \n')
    path = example(tmp_path, "examples/campaigns/demo.yaml", "prompts: tiny-python", f"prompts: 'file:{prompts}'")
    problem = one(refused(lambda: load_campaign(path)), "base.workload.prompts")
    assert f"{prompts}:2" in problem.problem
    arrivals = tmp_path / "arrivals.csv"
    arrivals.write_text("arrival_s\n0.5\n1.0\n")  # two rows, and the demo asks for ten requests a device
    path = example(tmp_path, "examples/campaigns/demo.yaml", "    arrival: poisson\n    rate_per_s: 1.0",
                   f"    arrival: trace\n    trace: {arrivals}")  # fmt: skip
    assert "10 requests" in one(refused(lambda: load_campaign(path)), "base.workload.trace").problem


@pytest.mark.parametrize(("old", "new"), [("cpus: 1.0", "cpus: '1.0'"), ("cpus: 1.0", "cpus: true"),
                                          ("cpus: 1.0", "cpus: 1e-9")])  # fmt: skip
def test_an_emulated_power_mode_number_written_as_text_or_too_small_to_run_is_refused(tmp_path: Path, old: str,
                                                                                       new: str) -> None:  # fmt: skip
    path = example(tmp_path, INVENTORY, old, new)
    one(refused(lambda: load_inventory(path)), "nodes[0].emulated.power_modes[0].cpus")


def test_a_matrix_that_expands_beyond_any_campaign_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    values = ", ".join(f"{0.01 * (i + 1):.2f}" for i in range(999))
    path = example(tmp_path, "examples/campaigns/demo.yaml", "  power.orin: [MAXN, MODE_30W]",
                   f"  power.orin: [MAXN, MODE_30W]\n  workload.rate_per_s: [{values}]")  # fmt: skip
    path.write_text(path.read_text().replace("repetitions: 1", "repetitions: 2"))
    problem = one(refused(lambda: load_campaign(path)), "matrix")
    assert "15984 runs" in problem.problem  # 2 x 2 x 2 x 999 values x 2 repetitions
