"""The ranks of a context-serving method (``methods/llms.py``).

``ContextApps`` (a device rank) finds the LLM service that the run plan started on its node (its
socket in the run's ``llm-service/`` directory), splits its schedule by app, and starts one app
process per app (``nodes.context_service.trace_app``) that replays its calls against the service at
their arrival times. As each call ends, its record goes to ``requests.jsonl`` (a call served: on the
rank's clock from the start barrier, with the service's record of the switch) or to
``refused_calls.jsonl`` (a call the service refused, with its reason: not completed). When every app
has ended, the rank writes the service's counters (``context_service_stats.json``) and the T_re /
T_IO it fitted at start (``install_profile.json``).

``IdleServer`` (the server's stage rank) takes no part: LLMS runs on the device alone.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List

from nodes.contracts.durable import write_json_atomic
from nodes.contracts.records import JsonLinesLog
from nodes.contracts.run_config import RunConfig
from nodes.contracts.service_files import service_files

APP_STOP_GRACE_S = 10.0
FOLLOW_POLL_S = 0.2


class _Follower(object):
    """The complete lines an app has appended to its output since the last look."""

    def __init__(self, path: str) -> None:
        self.path, self.offset = path, 0

    def new_rows(self) -> List[Dict[str, Any]]:
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next look
        self.offset += len(complete)
        return [json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip()]


class IdleServer(object):
    def __init__(self, config: RunConfig, comm: Any, rank: int, parts: Any = None) -> None:
        self.config = config

    def start(self, t0: float) -> None:
        self.t0 = t0

    def serve(self) -> None:
        return None


class ContextApps(object):
    def __init__(self, config: RunConfig, comm: Any, rank: int, parts: Any = None) -> None:
        self.config, self.rank = config, rank
        self.spec = config.ranks[rank]
        self.files = service_files(os.path.dirname(config.out_dir))
        with open(os.path.expanduser(self.spec.schedule), encoding="utf-8") as handle:
            self.calls = [json.loads(line) for line in handle if line.strip()]
        from nodes.context_service.client import ContextClient

        self.client = ContextClient(self.files.socket, timeout_s=60.0)
        try:
            self.client.stats()
        except OSError as exc:
            raise RuntimeError("no LLM service answers on %s (the run plan starts it before the workers): %s"
                               % (self.files.socket, exc)) from None  # fmt: skip

    def start(self, t0: float) -> None:
        self.t0 = t0
        self.directory = self.config.rank_dir(self.rank)
        os.makedirs(self.directory, exist_ok=True)

    def run(self) -> None:
        by_app: Dict[str, List[Dict[str, Any]]] = {}
        for call in self.calls:
            by_app.setdefault(str(call["app"]), []).append(call)
        apps_dir = os.path.join(self.directory, "apps")
        os.makedirs(apps_dir, exist_ok=True)
        origin = time.monotonic()
        header = {"role": "device", "node": self.spec.node, "method": self.config.method,
                  "clock_origin_monotonic_s": origin, "clock_origin_unix_s": time.time() - (time.monotonic() - origin),
                  "modeled_times": self.config.target is not None}  # fmt: skip
        served = JsonLinesLog(os.path.join(self.directory, "requests.jsonl"), header)
        refused = JsonLinesLog(os.path.join(self.directory, "refused_calls.jsonl"), header)
        processes = []
        for app, calls in sorted(by_app.items()):
            calls_path = os.path.join(apps_dir, "%s-calls.jsonl" % app)
            with open(calls_path, "w", encoding="utf-8") as handle:
                handle.writelines(json.dumps(c, sort_keys=True) + "\n" for c in calls)
            out = os.path.join(apps_dir, "%s.jsonl" % app)
            open(out, "w").close()  # the app appends; the rank follows it from the start
            argv = [sys.executable, "-m", "nodes.context_service.trace_app", "--socket", self.files.socket,
                    "--calls", calls_path, "--out", out, "--origin-monotonic-s", repr(origin),
                    "--app", app]  # fmt: skip
            log = open(os.path.join(apps_dir, "%s.log" % app), "w", encoding="utf-8")  # noqa: SIM115 (the app's)
            processes.append((_Follower(out), subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log))
        try:
            while True:  # each call's record goes to requests.jsonl as its app writes it (progress, crash-safe)
                running = any(process.poll() is None for _f, process, _l in processes)
                for follower, _process, _log in processes:
                    for row in follower.new_rows():
                        completed = row.pop("completed", False)
                        (served if completed else refused).write(dict(row, node=self.spec.node))
                if not running:
                    break
                time.sleep(FOLLOW_POLL_S)
        finally:
            for _follower, process, log in processes:  # the rank was ended: its apps end with it
                if process.poll() is None:
                    process.terminate()
                    try:
                        process.wait(APP_STOP_GRACE_S)
                    except subprocess.TimeoutExpired:
                        process.kill()
                log.close()
            served.close()
            refused.close()
        self._write_service_files()

    def _write_service_files(self) -> None:
        try:
            stats = self.client.stats()
        except OSError as exc:
            stats = {"ok": False, "error": "the service did not answer at the end: %s" % exc}
        write_json_atomic(os.path.join(self.directory, "context_service_stats.json"), stats)
        if os.path.exists(self.files.install_profile):
            shutil.copyfile(self.files.install_profile, os.path.join(self.directory, "install_profile.json"))
