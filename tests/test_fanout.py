from __future__ import annotations

import threading
import time

import pytest

from foundation.errors import NodeError
from testbed.transport.fanout import fan_out
from tests.waiting import HANG_S


def test_every_node_gets_an_outcome_in_order_and_failures_do_not_abort_others():
    def op(name: str) -> str:
        if name == "bad":
            raise NodeError(name, "unreachable")
        if name == "buggy":
            raise KeyError("oops")
        time.sleep(0.05)
        return name.upper()

    names = ["a", "bad", "b", "buggy", "c"]
    result = fan_out(names, op, max_parallel=2)
    assert [o.node for o in result.outcomes] == names
    assert result.values() == {"a": "A", "b": "B", "c": "C"}
    assert [o.node for o in result.failed] == ["bad", "buggy"]
    assert result.failed[0].error == "unreachable"
    assert "KeyError" in (result.failed[1].error or "")
    assert not result.ok


@pytest.mark.parametrize("limit", [1, 3, 8])
def test_concurrency_is_bounded_and_used(limit):
    # each operation holds its place until `limit` of them run at once (or a hang limit passes): the
    # peak is reached however slowly threads start, and an operation more would show above it
    lock = threading.Lock()
    full = threading.Event()
    running = 0
    peak = 0

    def op(name: str) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            if running == limit:
                full.set()
        full.wait(HANG_S)
        with lock:
            running -= 1

    fan_out([f"n{i}" for i in range(12)], op, max_parallel=limit)
    assert full.is_set() and peak == limit


def test_every_node_runs_at_once_when_the_limit_allows():
    # 20 operations that can only pass together: serial or partly serial would break the barrier
    barrier = threading.Barrier(20, timeout=HANG_S)
    result = fan_out([f"n{i}" for i in range(20)], lambda n: barrier.wait(), max_parallel=20)
    assert result.ok, result.failed


def test_invalid_limit():
    with pytest.raises(ValueError):
        fan_out(["a"], lambda n: n, max_parallel=0)


def test_progress_is_shown_on_a_terminal_only_for_slow_operations():
    import io

    from rich.console import Console

    from testbed.transport.fanout import PROGRESS_AFTER_S

    def render(slow: bool) -> str:
        buffer = io.StringIO()
        console = Console(file=buffer, force_terminal=True, width=100)

        def op(_: str) -> None:  # a slow one lasts until its progress display has been drawn
            deadline = time.monotonic() + HANG_S
            while slow and "probing nodes" not in buffer.getvalue() and time.monotonic() < deadline:
                time.sleep(0.05)

        fan_out(["a", "b"], op, description="probing nodes", console=console)
        return buffer.getvalue()

    assert "probing nodes" in render(slow=True)
    assert render(slow=False) == ""
    quiet = io.StringIO()
    fan_out(["a"], lambda n: time.sleep(PROGRESS_AFTER_S + 0.3), description="probing", console=Console(file=quiet))
    assert quiet.getvalue() == "", "no progress display when output is not a terminal"


def test_require_returns_every_value_or_names_every_failure():
    assert fan_out(["a", "b"], lambda n: n.upper()).require("greeting") == {"a": "A", "b": "B"}

    def flaky(name: str) -> str:
        if name != "a":
            raise NodeError(name, f"{name} is down")
        return name

    with pytest.raises(NodeError) as raised:
        fan_out(["a", "b", "c"], flaky).require("staging")
    assert raised.value.node == "b"
    assert "staging failed" in str(raised.value) and "b is down" in str(raised.value) and "c is down" in str(raised.value)
