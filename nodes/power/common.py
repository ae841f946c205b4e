"""What every power driver shares: the interface (:class:`PowerDriver`, also the null driver of a node
without power modes), its errors, the runner of the node's tools (``sudo -n`` with absolute paths), and
the journal that records the state before the first change so that ``restore`` puts it back."""

import json
import os
import shutil
import subprocess
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from nodes.contracts.durable import write_json_atomic
from nodes.contracts.journal_values import JournalValueError
from nodes.contracts.tool_errors import NodeToolError


class PowerError(NodeToolError):
    """A power operation failed or its read-back differs from what was asked."""


class PowerUsageError(PowerError):
    """The command line cannot work (a missing argument): bad input, not a failing node."""


class PowerModeInfo(NamedTuple):
    id: str
    name: str
    detail: str = ""


class PowerState(NamedTuple):
    mode_id: Optional[str]
    mode_name: Optional[str]
    clocks_locked: Optional[bool]  # None: the node has no such notion
    warnings: List[str]
    details: Dict[str, Any]


class Runner(object):
    """Runs the node's tools, adding ``sudo -n`` to privileged ones when asked to (with the tool's
    absolute path: sudo's rules name programs by path, testbed/provisioning/sudo_rules.py)."""

    def __init__(self, sudo: bool = False, timeout_s: float = 60.0) -> None:
        self.sudo = sudo
        self.timeout_s = timeout_s

    def __call__(
        self, argv: Sequence[str], privileged: bool = False, stdin: str = ""
    ) -> "subprocess.CompletedProcess[str]":
        words = list(argv)
        if privileged and self.sudo:
            found = shutil.which(argv[0], path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
            words = ["sudo", "-n", "--", found or argv[0]] + words[1:]
        try:
            return subprocess.run(
                words,
                input=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                universal_newlines=True,
                timeout=self.timeout_s,
                check=False,
            )
        except FileNotFoundError:
            raise PowerError("%s is not installed (not on PATH)" % argv[0]) from None
        except subprocess.TimeoutExpired:
            raise PowerError("`%s` did not finish within %g s" % (" ".join(argv), self.timeout_s)) from None

    def checked(self, argv: Sequence[str], privileged: bool = False, stdin: str = "") -> str:
        done = self(argv, privileged, stdin)
        if done.returncode != 0:
            detail = (done.stderr.strip() or done.stdout.strip())[-400:]
            raise PowerError(
                "`%s` exited with status %d%s" % (" ".join(argv), done.returncode, ": " + detail if detail else "")
            )
        return done.stdout


class PowerDriver(object):
    """The common interface. ``mode`` arguments are a mode's id or its name."""

    kind = "none"

    def modes(self) -> List[PowerModeInfo]:
        return []

    def state(self) -> PowerState:
        return PowerState(None, None, None, [], {})

    def set_mode(self, mode: str) -> PowerState:
        raise PowerError("this node has no power modes to set")

    def check_mode(self, mode: str) -> None:
        """Raise :class:`PowerError` if ``mode`` cannot be set here (before anything is journaled)."""
        self.resolve(mode)

    def lock_clocks(self) -> PowerState:
        raise PowerError("this node has no clocks to lock")

    def snapshot(self) -> Dict[str, Any]:
        """What :meth:`restore` needs to put the node back as it is now."""
        return {}

    def restore(self, snapshot: Dict[str, Any]) -> PowerState:
        return self.state()

    def resolve(self, mode: str) -> PowerModeInfo:
        """The mode named by ``mode`` (its id, or its name in any case)."""
        modes = self.modes()
        for m in modes:
            if m.id == mode:
                return m
        for m in modes:
            if m.name.lower() == mode.lower():
                return m
        known = ", ".join("%s (%s)" % (m.id, m.name) for m in modes) or "none"
        raise PowerError("no power mode %r on this node; its modes: %s" % (mode, known))


class PowerJournal(object):
    """``journal.json`` on the node: the driver's snapshot from before the first change."""

    def __init__(self, path: str) -> None:
        self.path = os.path.expanduser(path)

    def read(self) -> Optional[Dict[str, Any]]:
        try:
            with open(self.path) as f:
                document = json.load(f)
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise PowerError("the power journal %s is not JSON (%s); mend it or restore by hand and remove it"
                             % (self.path, exc)) from None  # fmt: skip
        if not isinstance(document, dict) or not isinstance(document.get("snapshot", {}), dict):
            raise PowerError("the power journal %s is not {kind, snapshot}; mend it or restore by hand and remove it"
                             % self.path)  # fmt: skip
        return document

    def record_before_change(self, driver: PowerDriver) -> None:
        """Write the snapshot unless one is there already (the first one is the original state)."""
        if self.read() is not None:
            return
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)  # the snapshot may keep files there (jetson_clocks --store)
        write_json_atomic(self.path, {"kind": driver.kind, "snapshot": driver.snapshot()}, sort_keys=True)

    def restore(self, driver: PowerDriver) -> Optional[PowerState]:
        """Put the node back as the journal recorded it and drop the journal; None without one."""
        document = self.read()
        if document is None:
            return None
        if document.get("kind") != driver.kind:
            raise PowerError(
                "the journal %s was written by the %s driver, not %s" % (self.path, document.get("kind"), driver.kind)
            )
        try:
            state = driver.restore(dict(document.get("snapshot") or {}))
        except JournalValueError as exc:
            raise PowerError(
                "the power journal %s: snapshot.%s; the testbed never writes that there: mend the "
                "journal (or restore the node by hand and remove it)" % (self.path, exc)
            ) from None
        os.unlink(self.path)
        return state


class DriverOptions(NamedTuple):
    """What the command line gives a driver module's ``driver(options)``."""

    runner: Runner
    sudo: bool
    journal: PowerJournal
    serial: Optional[str] = None  # a phone's adb serial
    adb: str = "adb"
