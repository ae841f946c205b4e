"""Power modes of a Jetson: ``nvpmodel`` for the mode, ``jetson_clocks`` for locked clocks.

Setting a mode runs ``nvpmodel -m ID`` and reads it back with ``nvpmodel -q``; a mode that needs
a reboot is refused (the tool asks on stdin; we answer no). Locking clocks first stores the current
clock settings with ``jetson_clocks --store FILE`` next to the journal, so that ``restore`` can
``jetson_clocks --restore FILE`` after switching back to the original mode (a mode switch resets
the clocks, so the order matters). ``restore`` takes from the journal only a numeric mode id and the
clock file beside the journal.
"""

import os
import re
from typing import Any, Dict, List, Optional

from nodes.contracts.journal_values import JournalValueError, checked
from nodes.contracts.root_paths import JETSON_CLOCKS_FILE
from nodes.jetson.nvpmodel import parse_clocks_show, parse_modes, parse_query
from nodes.power.common import DriverOptions, PowerDriver, PowerError, PowerModeInfo, PowerState, Runner

CONF = "/etc/nvpmodel.conf"
MODE_ID = re.compile(r"\d{1,4}")


class JetsonPower(PowerDriver):
    kind = "jetson"

    def __init__(self, run: Runner, clocks_file: Optional[str] = None) -> None:
        self.run = run
        self.clocks_file = clocks_file
        self._modes: Optional[List[PowerModeInfo]] = None

    def modes(self) -> List[PowerModeInfo]:
        if self._modes is None:
            done = self.run(["nvpmodel", "-p", "--verbose"], privileged=True)
            found, default = parse_modes(done.stdout + "\n" + done.stderr) if done.returncode == 0 else ([], None)
            if not found and os.path.exists(CONF):
                with open(CONF) as f:
                    found, default = parse_modes(f.read())
            if not found:
                raise PowerError("no power modes: `nvpmodel -p --verbose` listed none and %s has none" % CONF)
            self._modes = [PowerModeInfo(str(i), name, "default" if i == default else "") for i, name in found]
        return self._modes

    def _query(self) -> Any:
        try:
            return parse_query(self.run.checked(["nvpmodel", "-q"], privileged=True))
        except ValueError as exc:
            raise PowerError(str(exc)) from None

    def state(self) -> PowerState:
        query = self._query()
        done = self.run(["jetson_clocks", "--show"], privileged=True)
        clocks = None
        warnings = list(query.warnings)
        if done.returncode == 0:
            try:
                clocks = parse_clocks_show(done.stdout)
            except ValueError as exc:
                warnings.append(str(exc))
        else:
            warnings.append("jetson_clocks --show failed: " + (done.stderr.strip() or done.stdout.strip())[-200:])
        details: Dict[str, Any] = {}
        if clocks is not None:
            details = {"cpu_online": sorted(clocks.cpu), "gpu": clocks.gpu, "emc": clocks.emc}
        return PowerState(str(query.mode_id), query.mode_name, clocks.locked if clocks else None, warnings, details)

    def set_mode(self, mode: str) -> PowerState:
        wanted = self.resolve(mode)
        done = self.run(["nvpmodel", "-m", wanted.id], privileged=True, stdin="NO\n")
        text = done.stdout + done.stderr
        if "reboot" in text.lower() and "required" in text.lower():
            raise PowerError(
                "power mode %s (%s) needs a reboot; the testbed does not reboot nodes: set it once "
                "with `sudo nvpmodel -m %s` and reboot" % (wanted.id, wanted.name, wanted.id)
            )
        if done.returncode != 0:
            raise PowerError(
                "`nvpmodel -m %s` exited with status %d: %s" % (wanted.id, done.returncode, text.strip()[-300:])
            )
        state = self.state()
        if state.mode_id != wanted.id:
            raise PowerError(
                "asked for power mode %s (%s) but nvpmodel -q reads back %s (%s)"
                % (wanted.id, wanted.name, state.mode_id, state.mode_name)
            )
        return state

    def _store_clocks(self) -> str:
        if not self.clocks_file:
            raise PowerError("no file to store the clock settings in")
        if os.path.exists(self.clocks_file) and os.access(os.path.dirname(self.clocks_file), os.W_OK):
            os.unlink(self.clocks_file)
        # jetson_clocks --store asks before overwriting a file (root's own, with sudo): yes
        self.run.checked(["jetson_clocks", "--store", self.clocks_file], privileged=True, stdin="y\n")
        return self.clocks_file

    def lock_clocks(self) -> PowerState:
        self.run.checked(["jetson_clocks"], privileged=True)
        state = self.state()
        if state.clocks_locked is not True:
            raise PowerError("jetson_clocks ran but --show does not read back locked clocks")
        return state

    def snapshot(self) -> Dict[str, Any]:
        state = self.state()
        return {
            "mode_id": state.mode_id,
            "mode_name": state.mode_name,
            "clocks_file": self._store_clocks(),
            "clocks_locked": state.clocks_locked,
        }

    def _checked_snapshot(self, snapshot: Dict[str, Any]) -> Dict[str, Any]:
        """The journal's snapshot as this driver wrote it, or JournalValueError naming the field."""
        mode_id = snapshot.get("mode_id")
        if mode_id is not None:
            checked(str(mode_id) if isinstance(mode_id, int) else mode_id, MODE_ID, "mode_id", "an nvpmodel mode id")
        clocks_file = snapshot.get("clocks_file")
        if clocks_file and clocks_file != self.clocks_file:
            raise JournalValueError("clocks_file: %r is not the clock file beside the journal (%s)"
                                    % (clocks_file, self.clocks_file))  # fmt: skip
        if snapshot.get("clocks_locked") not in (None, True, False):
            raise JournalValueError("clocks_locked: %r is not true, false or null" % (snapshot["clocks_locked"],))
        return snapshot

    def restore(self, snapshot: Dict[str, Any]) -> PowerState:
        snapshot = self._checked_snapshot(snapshot)
        mode_id = snapshot.get("mode_id")
        if mode_id is not None and self._query().mode_id != int(mode_id):
            self.set_mode(str(mode_id))
        clocks_file = snapshot.get("clocks_file")
        if clocks_file and os.path.exists(clocks_file):
            self.run.checked(["jetson_clocks", "--restore", clocks_file], privileged=True)
        state = self.state()
        if mode_id is not None and state.mode_id != str(mode_id):
            raise PowerError("restored power mode %s but nvpmodel -q reads back %s" % (mode_id, state.mode_id))
        if snapshot.get("clocks_locked") is not None and state.clocks_locked != snapshot["clocks_locked"]:
            raise PowerError(
                "restored clocks but jetson_clocks --show reads back locked=%s, before it was %s"
                % (state.clocks_locked, snapshot["clocks_locked"])
            )
        return state


def driver(options: DriverOptions) -> JetsonPower:
    """With sudo the clocks go to root's own file (jetson_clocks would write and restore a user's as
    root); without, beside the journal."""
    clocks = JETSON_CLOCKS_FILE if options.sudo else os.path.join(os.path.dirname(options.journal.path), "l4t_dfs.conf")
    return JetsonPower(options.runner, clocks_file=clocks)
