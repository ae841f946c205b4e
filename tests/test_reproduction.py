"""``testbed reproduce``: an experiment run with its provenance, its page generated from the result, a
result marked stale when its code moves on, and every committed page regenerated identically from the
committed results (so no number on a page can drift from its data)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from analysis.uncertainty import Interval
from bench.reproduce import papers
from bench.reproduce.pages import DOCS, render, write_page
from bench.reproduce.registry import Experiment, Headline, Paper
from bench.reproduce.runner import RESULTS, is_current, read_result, reproduce
from foundation.provenance import GENERATED, code_sha256, git_provenance

REPO = Path(__file__).resolve().parents[1]
# the benches that run a campaign through bench/campaign_reproduction.py and add measures of their own
CAMPAIGN_BENCHES = ("bench/andes_campaign.py", "bench/disco_campaign.py", "bench/hat_campaign.py")


def _table2_device(result: dict) -> Interval | None:
    for row in result.get("table2_reduction_pct", []):
        if row["regime"] == "device":
            value = row["pixel7pro-bloom-1.1b"]
            return Interval(value, float("nan"), float("nan"), result["requests"])
    return None


SWEEP = Experiment(
    "sweep", "DiSCo's budget sweep, one trace and one device", "bench/disco_sweep.py",
    {"smoke": ("--traces", "gpt", "--devices", "pixel7pro-bloom-1.1b", "--seeds", "2", "--requests", "100",
               "--budgets", "3")},
    ("nodes/dispatch", "nodes/endpoints", "analysis/dispatch.py"),
)  # fmt: skip
BROKEN = Experiment("broken", "a bench that fails", "bench/disco_sweep.py", {"smoke": ("--traces", "no-such")})
PAPER = Paper(
    "example", "An example paper", "a paper of the tests", (SWEEP, BROKEN),
    (Headline("Table 2", "tail TTFT cut, device-constrained", "%", 26.39, "sweep", _table2_device),
     Headline("Table 2", "a headline of the broken one", "%", 10.0, "broken", _table2_device)),
)  # fmt: skip


def test_an_experiment_is_run_with_its_provenance_and_its_page_generated(tmp_path):
    results = tmp_path / "results"
    outcomes = reproduce(PAPER, "smoke", results, log=lambda _: None)
    assert [(o.experiment, o.state) for o in outcomes] == [("sweep", "done"), ("broken", "failed")]
    assert "exit status 2" in outcomes[1].detail
    result = read_result(results / "example" / "sweep.json")
    record = result["reproduction"]
    assert record["scale"] == "smoke" and record["experiment"] == "sweep"
    assert record["command"].startswith("python bench/disco_sweep.py --traces gpt")
    assert record["code_sha256"] == code_sha256(SWEEP.depends_on())
    assert {"commit", "dirty"} <= set(record["git"]) and record["wall_s"] >= 0
    assert result["machine"]["cpus"] >= 1 and is_current(result, SWEEP, "smoke")
    assert not list((results / "example").glob(".*partial"))  # no half-written file is left
    # with --resume a current result is kept, not run again
    kept = reproduce(PAPER, "smoke", results, only=("sweep",), resume=True, log=lambda _: None)
    assert [(o.state, o.detail) for o in kept] == [("kept", "current at this scale")]

    page = write_page(PAPER, results, tmp_path / "docs")
    text = page.read_text()
    assert text.startswith("# An example paper: our reproduction")
    assert "**2 headlines: 1 within ±25% of the paper's, 0 in the right direction, 0 missed (1 not run yet, " \
           "1 without an interval).**" in text  # fmt: skip
    assert "| tail TTFT cut, device-constrained | 26.39% |" in text
    assert "(no interval)" in text and "| `broken` | a bench that fails | – | – | – | – | not run |" in text
    assert (tmp_path / "docs" / "example" / "table-2.png").stat().st_size > 1000

    # a result whose code hash is not today's is stale, on the page and in its count
    result["reproduction"]["code_sha256"] = "0" * 64
    (results / "example" / "sweep.json").write_text(json.dumps(result))
    stale, _ = render(PAPER, results)
    plt.close("all")
    assert "1 stale" in stale and "within ±25% · **stale**" in stale and "**stale** (its code changed since)" in stale
    # and so is one made with other arguments than its scale has now, on today's code
    result["reproduction"]["code_sha256"] = code_sha256(SWEEP.depends_on())
    assert is_current(result, SWEEP)
    fewer = Experiment(SWEEP.name, SWEEP.what, SWEEP.script, {"smoke": (*SWEEP.scales["smoke"][:-1], "2")}, SWEEP.code)
    assert not is_current(result, fewer) and not is_current(result, Experiment(
        SWEEP.name, SWEEP.what, SWEEP.script, {"reduced": SWEEP.scales["smoke"]}, SWEEP.code))  # fmt: skip
    (results / "example" / "sweep.json").write_text(json.dumps(result))
    other = Paper(PAPER.key, PAPER.title, PAPER.citation, (fewer, BROKEN), PAPER.headlines)
    assert "**stale** (its command changed since)" in render(other, results)[0]
    plt.close("all")


def test_the_code_hash_follows_tracked_files_only(tmp_path):
    repo = tmp_path / "repo"
    (repo / "code").mkdir(parents=True)
    (repo / "code" / "a.py").write_text("A = 1\n")
    (repo / "code" / "skip.py").write_text("B = 1\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    before = code_sha256(["code"], repo)
    (repo / "code" / "untracked.py").write_text("C = 1\n")  # a new file nobody added does not count
    assert code_sha256(["code"], repo) == before
    (repo / "code" / "a.py").write_text("A = 2\n")  # an edit does, committed or not
    assert code_sha256(["code"], repo) != before
    edited = code_sha256(["code", "!code/skip.py"], repo)
    (repo / "code" / "skip.py").write_text("B = 2\n")  # a path left out with ! does not
    assert code_sha256(["code", "!code/skip.py"], repo) == edited
    with pytest.raises(ValueError, match="no tracked file under nothing"):
        code_sha256(["nothing"], repo)


def test_a_stale_result_names_the_files_changed_since_its_commit(tmp_path):
    from bench.reproduce.runner import changed_since, state_line

    repo = tmp_path / "repo"
    (repo / "code").mkdir(parents=True)
    for name in ("code/a.py", "code/b.py", "elsewhere.py"):
        (repo / name).write_text("X = 1\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    experiment = Experiment("x", "an experiment", "code/a.py", {"smoke": ()}, ("code",))
    result = {"reproduction": {"scale": "smoke", "wall_s": 60.0, "git": {"commit": commit}, "code_sha256": "0",
                               "command": "python code/a.py"}}
    assert changed_since(result, experiment, repo) == []
    (repo / "code" / "b.py").write_text("X = 2\n")  # what it depends on, not committed
    (repo / "elsewhere.py").write_text("X = 2\n")  # what it does not
    assert changed_since(result, experiment, repo) == ["code/b.py"]
    assert state_line(result, experiment, repo) == f"stale (smoke, 1.0 min, on {commit[:10]}): code/b.py changed since"
    assert changed_since({"reproduction": {"git": {"commit": "f" * 40}}}, experiment, repo) is None  # not here
    assert changed_since(None, experiment, repo) is None and state_line(None, experiment, repo) == "no result"
    other = {"reproduction": {**result["reproduction"], "command": "python code/a.py --more"}}
    assert state_line(other, experiment, repo).endswith("): its command changed since")


def test_a_result_written_into_the_checkout_is_not_an_uncommitted_change_of_its_code(tmp_path):
    repo = tmp_path / "repo"
    (repo / "code").mkdir(parents=True)
    (repo / "code" / "a.py").write_text("A = 1\n")
    for args in (["init", "-q"], ["add", "."], ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    (repo / "bench" / "results" / "reproductions").mkdir(parents=True)
    (repo / "bench" / "results" / "reproductions" / "one.json").write_text("{}")
    assert git_provenance(repo, leave_out=GENERATED)["dirty"] is False
    assert git_provenance(repo, leave_out=())["dirty"] is True  # counted, had they not been left out
    assert git_provenance(repo)["dirty"] is False  # what a campaign manifest records: left out by default
    (repo / "code" / "a.py").write_text("A = 2\n")
    changed = git_provenance(repo, leave_out=GENERATED)
    assert changed["dirty"] is True and len(changed["uncommitted_sha256"]) == 64


def test_every_paper_s_code_paths_exist_and_its_headlines_name_its_experiments():
    for paper in papers().values():
        names = {e.name for e in paper.experiments}
        assert all(h.experiment in names for h in paper.headlines), paper.key
        for experiment in paper.experiments:
            code_sha256(experiment.depends_on())  # raises on a path with no tracked file
            assert (REPO / experiment.script).is_file() and experiment.scales


def test_the_committed_pages_are_what_the_committed_results_give():
    for paper in papers().values():
        text, figures = render(paper, RESULTS)
        page = DOCS / f"{paper.key}.md"
        assert page.is_file(), f"{page} is missing: run `testbed reproduce {paper.key} --pages-only`"
        assert page.read_text() == text, f"{page} differs from its results: run `testbed reproduce {paper.key} " \
                                         "--pages-only` (and rerun what it marks stale)"  # fmt: skip
        assert all((DOCS / name).is_file() for name in figures)
        plt.close("all")


def test_the_command_refuses_an_unknown_paper_or_scale_with_status_2():
    for args in (["nope"], ["hat", "--scale", "huge"], ["hat", "--only", "nothing"]):
        done = subprocess.run([sys.executable, "-m", "testbed", "reproduce", *args], capture_output=True, text=True,
                              cwd=REPO)  # fmt: skip
        assert done.returncode == 2, done
        assert "reproduce" in done.stderr


def test_a_scale_changes_a_campaign_by_dotted_keys_and_a_matrix_key_keeps_its_dots(tmp_path):
    from ruamel.yaml import YAML

    from bench.campaign_reproduction import changed_campaign, parse_setting

    source = tmp_path / "c.yaml"
    source.write_text("name: c\nbase:\n  workload: {requests_per_device: 8}\n"
                      "matrix:\n  method: [a, b]\n  workload.rate_per_s: [1, 2]\n")  # fmt: skip
    settings = ["base.workload.requests_per_device=2", "matrix.workload.rate_per_s=[0.5]", "repetitions=3"]
    changed = YAML(typ="safe").load(changed_campaign(source, [parse_setting(s) for s in settings]).read_text())
    assert changed["base"]["workload"]["requests_per_device"] == 2 and changed["repetitions"] == 3
    assert changed["matrix"] == {"method": ["a", "b"], "workload.rate_per_s": [0.5]}  # one key replaced, order kept
    with pytest.raises(SystemExit, match="write KEY=VALUE"):
        parse_setting("repetitions")


def test_resume_goes_on_with_a_campaign_cut_short_and_its_wall_time_sums_the_parts(tmp_path):
    from bench.campaign_reproduction import unfinished
    from bench.reproduce.runner import _earlier_parts, experiment_argv

    campaign = Experiment("camp", "a campaign", "bench/campaign_reproduction.py",
                          {"reduced": ("c.yaml",), "full": ("c.yaml", "--resume")}, resumable=True)  # fmt: skip
    assert experiment_argv(campaign, "reduced")[1:] == ["bench/campaign_reproduction.py", "c.yaml"]
    assert experiment_argv(campaign, "reduced", resume=True)[-1] == "--resume"
    assert experiment_argv(campaign, "full", resume=True).count("--resume") == 1  # not given twice
    assert "--resume" not in experiment_argv(SWEEP, "smoke", resume=True)  # a bench that is no campaign
    parts = tmp_path / ".camp.json.parts"
    parts.write_text(json.dumps({"code_sha256": "a" * 64, "command": "c", "parts": [{"started_utc": "t0",
                                                                                   "wall_s": 60.0}]}))  # fmt: skip
    assert _earlier_parts(parts, "a" * 64, "c") == [{"started_utc": "t0", "wall_s": 60.0}]
    assert _earlier_parts(parts, "b" * 64, "c") == []  # parts on other code: that campaign starts afresh
    assert _earlier_parts(parts, "a" * 64, "other scale's") == []
    assert _earlier_parts(tmp_path / "none", "a" * 64, "c") == []
    # a campaign is a result only when it is whole: not interrupted, its controller fine, no run left
    assert unfinished(0, False, {"done": 6}, tmp_path) is None
    assert unfinished(1, False, {"done": 5, "failed": 1}, tmp_path) is None  # a failed run is part of the result
    stopped = unfinished(130, False, {"done": 5, "running": 1}, tmp_path)  # SIGTERM to `testbed run`
    assert stopped.exit_status == 130 and f"--resume --work {tmp_path}" in stopped.why
    assert unfinished(0, True, {"done": 6}, tmp_path).exit_status == 130  # Ctrl-C reached this script
    left = unfinished(0, False, {"done": 2, "todo": 3}, tmp_path)
    assert "runs left" in left.why and left.exit_status == 1
    assert "controller failed (exit status 2)" in unfinished(2, False, {}, tmp_path).why
    assert "--retry-failed" in unfinished(1, False, {"done": 4, "skipped": 2}, tmp_path).why
    assert "no run done" in unfinished(1, False, {"failed": 6}, tmp_path).why
    assert "no run done" in unfinished(1, False, {}, tmp_path).why  # no ledger: the controller never began


def test_a_campaign_stopped_on_purpose_stops_the_reproduction_and_keeps_its_part(tmp_path):
    stopped = Experiment("camp", "a campaign stopped with SIGTERM", "tests/data/interrupted_campaign.py",
                         {"smoke": ()}, resumable=True)  # fmt: skip
    after = Experiment("next", "the experiment after it", "tests/data/interrupted_campaign.py", {"smoke": ("x",)})
    paper = Paper("example", "An example paper", "a paper of the tests", (stopped, after), ())
    logged = []
    with pytest.raises(KeyboardInterrupt):
        reproduce(paper, "smoke", tmp_path / "results", log=logged.append)
    assert not any("next" in line for line in logged)  # the reproduction stopped at the campaign
    assert len(json.loads((tmp_path / "results" / "example" / ".camp.json.parts").read_text())["parts"]) == 1
    # a bench that is no campaign exiting 130 is a failure like any other: the reproduction goes on
    (outcome,) = reproduce(Paper("example", "An example paper", "tests", (after,), ()), "smoke", tmp_path / "r",
                           log=lambda _: None)  # fmt: skip
    assert outcome.state == "failed" and outcome.detail == "exit status 130"


def test_ctrl_c_during_a_teardown_waits_for_its_end():
    from foundation.child_process import interrupts_deferred

    finished, before = [], signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), interrupts_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the signal arrives between bytecodes: the block goes on regardless
            sum(range(100))
        finished.append(True)
    assert finished
    assert signal.getsignal(signal.SIGINT) is before  # the handler is restored


def test_every_campaign_experiment_resumes_and_no_other_does():
    # the runner's --resume reaches exactly the experiments whose script takes --work and --resume
    takes_resume = {"bench/campaign_reproduction.py", *CAMPAIGN_BENCHES}
    for paper in papers().values():
        for experiment in paper.experiments:
            campaign = experiment.script in takes_resume or any("--campaign" in a for a in experiment.scales.values())
            assert experiment.resumable == campaign, (paper.key, experiment.name)


def test_each_part_of_a_campaign_that_did_not_finish_is_kept_for_its_resumed_total(tmp_path):
    # a campaign script that stops at once (its campaign file is missing): each --resume adds a part on the
    # same command and code; run without --resume, the campaign starts afresh and so do its parts
    missing = Experiment("camp", "a campaign cut short", "bench/campaign_reproduction.py",
                         {"smoke": (str(tmp_path / "missing.yaml"), "--work", str(tmp_path / "work"))},
                         ("examples/campaigns",), resumable=True)  # fmt: skip
    paper = Paper("example", "An example paper", "a paper of the tests", (missing,), ())
    parts = tmp_path / "results" / "example" / ".camp.json.parts"
    for expected in (1, 2):
        (outcome,) = reproduce(paper, "smoke", tmp_path / "results", resume=True, log=lambda _: None)
        assert outcome.state == "failed"
        recorded = json.loads(parts.read_text())
        assert len(recorded["parts"]) == expected and recorded["command"].endswith("--resume")
        assert recorded["code_sha256"] == code_sha256(missing.depends_on())
    reproduce(paper, "smoke", tmp_path / "results", log=lambda _: None)
    assert len(json.loads(parts.read_text())["parts"]) == 1


def test_a_result_depends_on_every_project_module_its_script_imports_even_unnamed():
    from bench.reproduce.registry import import_closure

    closure = import_closure("bench/campaign_reproduction.py")
    # bench/campaign.py (ledger_counts) and the analysis it imports inside functions, which no experiment named
    assert {"bench/campaign_reproduction.py", "bench/campaign.py", "analysis/fidelity.py"} <= set(closure)
    assert "bench/__init__.py" in closure and not any(p.startswith(("numpy", "torch")) for p in closure)
    # a package's __init__ that imports its own modules relatively (from . import centralized, ...)
    methods = import_closure("nodes/contracts/methods/__init__.py")
    assert {"nodes/contracts/methods/base.py", "nodes/contracts/methods/hat.py"} <= set(methods)
    # a campaign's hash changes with a module only its script's imports reach (bench/campaign.py)
    hat = papers()["hat"].experiment("table5_specbench")
    assert "bench/campaign.py" in hat.depends_on() and "bench/campaign.py" not in (hat.script, *hat.code)


def test_an_experiment_names_only_code_its_script_s_imports_do_not_reach():
    # the import closure is derived; a named path its files already cover would be a second list to keep
    from bench.reproduce.registry import CAMPAIGN_CODE, import_closure

    def tracked(paths):
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--", *paths], capture_output=True, text=True)
        return set(listed.stdout.split())

    for paper in papers().values():
        for experiment in paper.experiments:
            reached = tracked([experiment.script, *import_closure(experiment.script)])
            for path in experiment.code:
                if path not in CAMPAIGN_CODE and not path.startswith("!"):
                    assert not tracked([path]) <= reached, (paper.key, experiment.name, path)


def test_the_campaign_benches_list_the_options_they_pass_on():
    for script in CAMPAIGN_BENCHES:
        shown = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True,
                               timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"usage: {script}")
        assert all(option in shown.stdout for option in ("--set", "--work", "--resume", "--retry-failed"))


def test_hat_s_page_says_how_much_of_u_shape_s_ttft_chunking_could_hide(tmp_path):
    """HAT's findings read a Table 5 campaign's prefill composition: U-shape's upload, compute and waiting
    shares, PC's change against the floor of all compute hidden, and the paper's own bound; a finding of
    a stale result says so, and one whose result is missing is left out."""
    import pandas as pd

    from analysis import prefill_composition
    from bench.reproduce.hat import PAPER as HAT

    # four U-shape requests, each 0.1 s device, 0.6 s upload and 0.2 s server; two also waited 0.4 s for a slot
    whole = pd.DataFrame({"node": ["a", "a", "b", "b"], "request_id": [0, 1, 2, 3], "prompt_tokens": [300] * 4,
                          "ttft_s": [0.9, 1.3, 0.9, 1.3], "prefill_device_head_s": [0.08] * 4,
                          "prefill_device_tail_s": [0.02] * 4, "prefill_network_s": [0.6] * 4,
                          "prefill_server_residence_s": [0.2] * 4})  # fmt: skip
    chunked = whole.assign(ttft_s=whole["ttft_s"] - 0.15)  # half the compute hidden behind the upload
    row = prefill_composition.summary(prefill_composition.chunked_against_whole(chunked, whole))
    results = tmp_path / "results"
    (results / "hat").mkdir(parents=True)
    (results / "hat" / "table5_specbench.json").write_text(json.dumps({
        "prefill_composition": [{"settings": {"method": "pc"}, "against": {"method": "ushape"}, **row}],
        "reproduction": {"code_sha256": "0" * 64}}))  # fmt: skip
    text, _ = render(HAT, results)
    plt.close("all")
    finding = next(line for line in text.splitlines() if line.startswith("- Table 5, SpecBench"))
    assert "U-shape's TTFT is 54.5% [" in finding  # 2.4 s of upload in 4.4 s
    assert "18.2% [" in finding  # waiting, 0.8 of 4.4 s
    assert "gains at most the compute, -27.3% [" in finding  # 1.2 of 4.4 s
    assert "PC changed TTFT by -13.6%, 0.50 of that floor" in finding
    assert "against its Table 5 PC gain of -41.4%" in finding and finding.endswith("(**stale**: its result "
                                                                                  "predates its code)")  # fmt: skip
    assert "CNN/DM (Vicuna-13B): U-shape's TTFT" not in text and "- Fig. 6:" not in text


def test_andes_s_page_reads_the_cap_campaign_s_conclusion_from_its_intervals(tmp_path):
    """Andes' cap finding quotes both caps' preemptions, mean QoE and TDS with their intervals, and says
    whether P = 1's further preemptions lower, raise or leave the QoE by the paired change's interval, and
    whether P = 0.4 comes near the paper's bound by its estimate; a missing result gives no finding."""
    from bench.reproduce.andes import PAPER as ANDES

    def interval(estimate: float, spread: float) -> dict[str, float]:
        return {"estimate": estimate, "low": estimate - spread, "high": estimate + spread, "units": 2000}

    def group(cap: float, preemptions: float, qoe: float) -> dict:
        return {"settings": {"serving.preemption_cap": cap}, "requests": 2000, "output_tokens_per_s": 800.0 + cap,
                "preemptions_per_request": interval(preemptions, 0.05), "qoe_mean": interval(qoe, 0.01),
                "percentiles": {"tds_tok_s": {"p50": interval(5.0, 0.1)}}}  # fmt: skip

    def finding(preemptions_at_low_cap: float, qoe_change: float) -> str:
        results = tmp_path / f"results-{preemptions_at_low_cap}-{qoe_change}"
        (results / "andes").mkdir(parents=True)
        (results / "andes" / "cap_campaign.json").write_text(json.dumps({
            "table4": {"groups": [group(0.4, preemptions_at_low_cap, 0.95), group(1.0, 1.1, 0.9)]},
            "changes": [{"qoe_change": {**interval(qoe_change, 0.01), "within_noise": abs(qoe_change) < 0.01}}],
            "reproduction": {"code_sha256": "0" * 64}}))  # fmt: skip
        text, _ = render(ANDES, results)
        plt.close("all")
        return next((line for line in text.splitlines() if line.startswith("- Sec. 6.5")), "")

    lowered = finding(0.45, 0.05)
    assert "0.45 [0.40, 0.50] at P = 0.4 against 1.10 [1.05, 1.15] at P = 1" in lowered
    assert "0.950 [0.940, 0.960] at P = 0.4" in lowered and "(paired change +5.0% [+4.0%, +6.0%])" in lowered
    assert "they come near the paper's 0.5" in lowered and "allows lower it." in lowered
    assert "generates 800 against 801 tokens/s" in lowered
    raised = finding(0.7, -0.05)
    assert "they stay above the paper's 0.5" in raised and "allows raise it." in raised
    assert "are within noise of each other" in finding(0.45, 0.005)
    empty = tmp_path / "empty"
    (empty / "andes").mkdir(parents=True)
    text, _ = render(ANDES, empty)
    plt.close("all")
    assert "- Sec. 6.5" not in text
