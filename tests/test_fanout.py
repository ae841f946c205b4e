from __future__ import annotations

import threading
import time

import pytest

from foundation.errors import NodeError
from testbed.transport.fanout import fan_out


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
    lock = threading.Lock()
    running = 0
    peak = 0

    def op(name: str) -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.05)
        with lock:
            running -= 1

    fan_out([f"n{i}" for i in range(12)], op, max_parallel=limit)
    assert peak == limit


def test_parallel_is_faster_than_serial():
    result = fan_out([f"n{i}" for i in range(20)], lambda n: time.sleep(0.1), max_parallel=20)
    assert result.ok and result.wall_s < 20 * 0.1 / 4


def test_invalid_limit():
    with pytest.raises(ValueError):
        fan_out(["a"], lambda n: n, max_parallel=0)


def test_progress_is_shown_on_a_terminal_only_for_slow_operations():
    import io

    from rich.console import Console

    def render(duration_s: float) -> str:
        buffer = io.StringIO()
        console = Console(file=buffer, force_terminal=True, width=100)
        fan_out(["a", "b"], lambda n: time.sleep(duration_s), description="probing nodes", console=console)
        return buffer.getvalue()

    assert "probing nodes" in render(1.5)
    assert render(0.05) == ""
    quiet = io.StringIO()
    fan_out(["a"], lambda n: time.sleep(1.3), description="probing", console=Console(file=quiet))
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
