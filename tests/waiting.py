"""Waiting for an event in a test: poll its condition until it holds, failing only past a bound.

A test waits for what it needs (a log line, a pid file, a lease) rather than sleeping for a time that a
loaded machine may overrun; the bound is there so that a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import time
from collections.abc import Callable

HANG_S = 60.0  # the default bound: reached only when the awaited event never comes


def wait_until(condition: Callable[[], object], what: str | Callable[[], str], limit_s: float = HANG_S,
               interval_s: float = 0.05) -> float:  # fmt: skip
    """Poll ``condition`` every ``interval_s`` until it is true and return the seconds that took; fail
    naming ``what`` (a text, or a function giving one then, e.g. what is still left) after ``limit_s``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > limit_s:
            said = what() if callable(what) else what
            raise AssertionError(f"still waiting after {limit_s:g} s for {said}")
        time.sleep(interval_s)
    return time.monotonic() - started
