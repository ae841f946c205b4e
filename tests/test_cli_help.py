"""How the command line reads: a long campaign says how long the runs left should take (the median
run so far); each group's listing gives every command one short line (its help's first sentence), a
command's own --help its whole text, and on/off options read as flags, not as options that take a
``<bool>``. Through typer's runner on the real application."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from testbed.cli import app
from testbed.cli.app import short_help

RUNNER = CliRunner()


def _help(*words: str) -> str:
    result = RUNNER.invoke(app, [*words, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0, result.output
    return result.output


def _groups() -> list[str]:
    return [g.name for g in app.registered_groups if g.name]


def _listed(output: str) -> dict[str, str]:
    """Command -> its line in a listing's Commands panel (wrapped lines joined)."""
    panel = output.split("Commands", 1)[1]
    rows: dict[str, str] = {}
    last = None
    for line in panel.splitlines():
        cells = line.strip("│ ").split(None, 1)
        if match := re.match(r"│ (\S+)\s{2,}(.*?)\s*│$", line):
            last = match[1]
            rows[last] = match[2]
        elif last and cells and line.startswith("│   "):
            rows[last] += " " + line.strip("│ ").strip()
    return rows


def test_every_listing_gives_each_command_one_short_sentence():
    for words in ([], *([g] for g in _groups())):
        listed = _listed(_help(*words))
        assert listed, words
        for command, line in listed.items():
            assert line.endswith(".") and line.count(". ") == 0, (words, command, line)
            assert len(line) <= 140, (words, command, line)


def test_a_commands_own_help_is_its_whole_text_and_flags_take_no_value():
    check = _help("inventory", "check")
    assert "With --deep, the preflight before a campaign on a real lab" in " ".join(check.split())
    assert "<bool>" not in check and "--deep" in check
    for words in (["run"], ["link", "apply"], ["emulate", "up"], ["lab", "release"]):
        assert "<bool>" not in _help(*words), words
    assert "<path>" in _help("run")  # options that take a value still say what


def test_the_short_line_is_the_first_sentence_cut_at_a_colon_only_when_long():
    assert short_help("Shape links. Then more.") == "Shape links."
    assert short_help("Turn traces (e.g. cellular ones) into CSV. More.") == "Turn traces (e.g. cellular ones) into CSV."
    long = "Reach every node in parallel and print its facts: " + "a, " * 40 + "b. More."
    assert short_help(long) == "Reach every node in parallel and print its facts."
    kept = "Write the hosts as Ansible YAML (phones are left out: Ansible reaches them through hosts " + "x " * 20
    assert short_help(kept).startswith("Write the hosts as Ansible YAML (phones are left out: Ansible")


def test_a_campaigns_eta_is_the_runs_left_at_the_median_run_time_so_far():
    from testbed.campaign.display import eta_s, eta_text

    assert eta_s([], 5) is None and eta_text([], 5) == ""  # before a run has finished: none
    assert eta_s([10.0, 30.0, 20.0], 4) == 80.0
    assert eta_text([10.0, 30.0, 20.0], 4) == "about 80 s left (4 runs at the median 20 s of 3)"
    assert eta_text([600.0], 9) == "about 1.5 h left (9 runs at the median 600 s of 1)"
    assert eta_text([600.0], 2) == "about 20 min left (2 runs at the median 600 s of 1)"
    assert eta_text([3600.0, 3600.0], 3) == "about 3.0 h left (3 runs at the median 3600 s of 2)"
    assert eta_s([5.0], 0) is None
