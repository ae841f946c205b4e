"""Waiting for a child process through Ctrl-C, so that it can clean up before anyone goes on.

Ctrl-C at a terminal reaches the whole foreground process group, the child included. ``subprocess.run``
answers it by killing the child 0.25 s later, which would cut a campaign's controller off while it
restores its nodes and takes its lab down; :func:`wait_through_interrupts` waits instead, and
:func:`interrupts_deferred` holds Ctrl-C off while a teardown of one's own runs.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator

# The exit status of a program that stopped because it was interrupted (Ctrl-C or SIGTERM), as shells
# report 128 + SIGINT: `testbed run` and the campaign benches exit with it, and ``--resume`` goes on.
INTERRUPTED_EXIT_STATUS = 130


def wait_through_interrupts(child: subprocess.Popen) -> tuple[int, bool]:
    """The child's exit status and whether Ctrl-C came while waiting. The first Ctrl-C waits for the child
    to finish on its own (it got the signal too); a second one terminates it, a third kills it."""
    interrupts = 0
    while True:
        try:
            return child.wait(), interrupts > 0
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts == 2:
                child.terminate()
            elif interrupts >= 3:
                child.kill()


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Run the block (a lab's teardown, say) to its end whatever Ctrl-C comes meanwhile, then raise
    ``KeyboardInterrupt`` if one came. Main thread only (Python's signal handlers live there)."""
    came: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, _frame: came.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if came:
        raise KeyboardInterrupt
