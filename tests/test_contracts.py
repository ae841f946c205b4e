"""What both sides share (nodes/contracts): durable writes, and how node tools fail."""

from __future__ import annotations


def test_durable_writes_leave_the_old_file_or_the_whole_new_one(tmp_path):
    import json
    import os

    from nodes.contracts.durable import SyncedLines, append_line, write_atomic, write_json_atomic

    path = tmp_path / "deep" / "state.json"
    write_json_atomic(path, {"a": 1}, sort_keys=True)
    assert json.loads(path.read_text()) == {"a": 1} and path.read_text().endswith("\n")
    write_atomic(path, b"replaced", mode=0o644)
    assert path.read_bytes() == b"replaced" and (path.stat().st_mode & 0o777) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]  # no temporary left behind
    log = tmp_path / "journal.jsonl"
    append_line(log, '{"n": 1}')
    with SyncedLines(log) as lines:
        lines.write('{"n": 2}')
    assert [json.loads(line)["n"] for line in log.read_text().splitlines()] == [1, 2]
    assert os.stat(log).st_mode & 0o777 == 0o600


def test_node_tools_answer_failures_as_json_with_one_exit_status_scheme(tmp_path):
    """The power driver and the sampler, run as the controller runs them: a failure is one JSON line
    with "error" and exit status 1 (NODE_FAILED); a bad command line is exit status 2 (BAD_INPUT)."""
    import json
    import subprocess
    import sys

    from nodes.contracts.tool_errors import BAD_INPUT, NODE_FAILED

    def tool(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60, check=False)

    # a phone with no adb to reach it: the driver cannot read its state
    failed = tool("nodes.power", "--kind", "android", "--serial", "nothere", "--adb", str(tmp_path / "no-adb"),
                  "--journal", str(tmp_path / "journal.json"), "show")  # fmt: skip
    assert failed.returncode == NODE_FAILED, failed.stdout + failed.stderr
    assert "error" in json.loads(failed.stdout.strip().splitlines()[-1])
    assert tool("nodes.power", "--kind", "warp", "--journal", "j", "show").returncode == BAD_INPUT
    sampler = tool("nodes.telemetry.sampler", "--source", "android", "--serial", "nothere", "--adb",
                   str(tmp_path / "no-adb"), "--node", "phone", "--probe")  # fmt: skip
    assert sampler.returncode == NODE_FAILED, sampler.stdout + sampler.stderr
    assert "error" in json.loads(sampler.stdout.strip().splitlines()[-1])


def test_the_node_registries_hold_the_names_campaign_files_are_checked_against():
    from nodes.contracts.catalogues import DEVICE_SPEED_NAMES, DISPATCH_POLICIES, SCHEDULER_NAMES, SERVICE_NAMES
    from nodes.dispatch.controller import REGIME_OF
    from nodes.endpoints.device_speed import DEVICE_SPEEDS
    from nodes.endpoints.services import SERVICES
    from nodes.serving.schedulers import SCHEDULERS

    assert set(SCHEDULERS) - set(SCHEDULER_NAMES) == {"static"}  # static batching: a method's, not a choice
    assert set(SCHEDULER_NAMES) <= set(SCHEDULERS)
    assert tuple(SERVICES) == SERVICE_NAMES and tuple(DEVICE_SPEEDS) == DEVICE_SPEED_NAMES
    assert set(REGIME_OF) < set(DISPATCH_POLICIES)
