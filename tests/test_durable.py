"""Durable writes: one helper for both sides (nodes.contracts.durable)."""

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
