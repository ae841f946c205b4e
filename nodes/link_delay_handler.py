"""Delays packets in user space where the kernel has no sch_netem: the NFQUEUE delay path; and the one
program the suite runs as root for that path. One file on purpose (over 500 lines): it is installed
root-owned as a single, self-contained program that imports nothing of the suite, so that root never
runs code a user can change.

Usage (as root, through sudo; installed root-owned, see testbed/provisioning/delay_handler.py)::

    link_delay_handler.py start DIR      # the config (JSON) on stdin; returns once every queue is bound
    link_delay_handler.py retime DIR     # {"start_unix_s": ..., "timelines": {queue: rows}} on stdin; SIGHUP
    link_delay_handler.py stop DIR       # TERM, then KILL; prints stopped, killed, stale or absent
    link_delay_handler.py iptables -w -t mangle ARGS...   # only our chains' commands, checked, then run

``DIR`` names the handler (the node's link journal directory, whose user it belongs to); nothing is read
from or written to it. The handler's files (config.json, handler.pid, stats.jsonl, log) live in a
directory of root's, ``/run/hil-testbed-delay/<first 16 hex digits of sha256(DIR)>`` (0755, files
0644: the user reads them), so a root process never follows a path the user can change. A user
(``SUDO_UID``) may stop or retime only a handler it started.

iptables hands each delayed direction's packets to its own NFQUEUE (``--queue-bypass``: with no
handler bound they pass undelayed, never dropped). This handler binds every queue of the node's
config, stamps each packet on arrival, and gives it its verdict (accept) at its due time: arrival +
delay + a jitter draw, held in one heap ordered by due time. Per queue, due times never go
backwards unless the queue's ``reorder`` is set, so jitter does not reorder a flow (netem's tfifo
would). A trace's loss, whose rows change it, is drawn here (a two-state Gilbert chain); other loss,
correlated loss included, is dropped in the kernel before the queue (netem/nfqueue.py).

The config gives ``start_unix_s`` (t = 0 of a trace, on the controller's clock), ``seed`` and
``queues``: each with ``queue_num``, ``from``/``to`` (the direction), ``delay_s``, ``jitter_s``,
``distribution`` (None is netem's default, uniform in delay +- jitter; ``normal``, ``pareto``,
``paretonormal``: jitter is the standard deviation), ``reorder``, ``queue_length``,
``loss_pct``/``loss_correlation_pct`` (when the handler draws the loss) and ``timeline``
(``[t_s, delay_s, loss_pct]`` rows of a trace, after its first).

SIGHUP makes it read the config again and take up its ``start_unix_s`` and each queue's
``timeline`` (a trace started after the handler). The log gets a ``ready`` line once every queue is
bound, then one ``stats`` line a second per queue (packets, drops, how late verdicts were against
their due times, held packets), each flushed and synced. SIGTERM releases every held packet at once
and exits. Standard library and the ``netfilterqueue`` binding only; runs on Python 3.8.
"""

import contextlib
import faulthandler
import hashlib
import heapq
import json
import math
import os
import random
import re
import select
import shutil
import signal
import sys
import time

STATS_PERIOD_S = 1.0
IDLE_WAIT_S = 0.25
SPIN_S = 0.0003  # the last stretch before a due time is waited out busy: select wakes ~0.1 ms late
PARETO_ALPHA = 3.0  # netem's pareto table shape; mean and spread normalised below
_PARETO_MEAN = PARETO_ALPHA / (PARETO_ALPHA - 1.0)
_PARETO_STD = math.sqrt(PARETO_ALPHA / ((PARETO_ALPHA - 1.0) ** 2 * (PARETO_ALPHA - 2.0)))


def jitter_draw(rng, jitter_s, distribution):
    """One jitter offset in seconds: uniform in [-j, j] (netem's default) or, for the named
    distributions, zero-mean with standard deviation ``jitter_s``."""
    if not jitter_s:
        return 0.0
    if distribution is None or distribution == "uniform":
        return rng.uniform(-jitter_s, jitter_s)
    if distribution == "normal":
        return rng.gauss(0.0, jitter_s)
    pareto = (rng.paretovariate(PARETO_ALPHA) - _PARETO_MEAN) / _PARETO_STD
    if distribution == "pareto":
        return jitter_s * pareto
    if distribution == "paretonormal":  # netem's mix: a quarter normal, three quarters pareto
        mixed = 0.25 * rng.gauss(0.0, 1.0) + 0.75 * pareto
        return jitter_s * mixed / math.sqrt(0.25**2 + 0.75**2)
    raise ValueError("unknown distribution %r" % (distribution,))


class GilbertLoss(object):
    """Correlated loss as a two-state Markov chain with stationary loss ``p`` and lag-1 correlation
    ``rho``: P(loss | loss) = p + rho (1 - p), P(loss | kept) = p (1 - rho). Mean burst length is
    1 / (1 - P(loss | loss)); rho = 0 is independent loss."""

    def __init__(self, loss_pct, correlation_pct, rng):
        self.p = loss_pct / 100.0
        self.rho = correlation_pct / 100.0
        self.rng = rng
        self.lost = False

    def drop(self):
        chance = self.p + self.rho * (1.0 - self.p) if self.lost else self.p * (1.0 - self.rho)
        self.lost = self.rng.random() < chance
        return self.lost


class DelayQueue(object):
    """One destination class: when each of its packets is due."""

    def __init__(self, spec, rng):
        self.spec = spec
        self.queue_num = int(spec["queue_num"])
        self.delay_s = float(spec.get("delay_s") or 0.0)
        self.jitter_s = float(spec.get("jitter_s") or 0.0)
        self.distribution = spec.get("distribution")
        self.reorder = bool(spec.get("reorder"))
        self.timeline = _rows(spec)
        self.rng = rng
        self.last_due = 0.0
        self.loss = None
        if "loss_pct" in spec:
            self.loss = GilbertLoss(float(spec["loss_pct"]), float(spec.get("loss_correlation_pct") or 0.0), rng)
        self.reset_stats()

    def reset_stats(self):
        self.packets = 0
        self.dropped = 0
        self.late_sum_s = 0.0
        self.late_max_s = 0.0
        self.released = 0

    def advance(self, t_s):
        """Take up the trace's rows whose time has come (``t_s`` since the trace's start)."""
        while self.timeline and self.timeline[0][0] <= t_s:
            _t, self.delay_s, loss_pct = self.timeline.pop(0)
            if self.loss is not None and loss_pct is not None:
                self.loss.p = loss_pct / 100.0

    def due(self, now):
        """The due time of a packet that arrived at ``now`` (monotonic seconds)."""
        due = now + max(0.0, self.delay_s + jitter_draw(self.rng, self.jitter_s, self.distribution))
        if not self.reorder:
            due = max(due, self.last_due)
        self.last_due = due
        return due


class Handler(object):
    """Every queue of one node, and the heap of held packets across them."""

    def __init__(self, config, log):
        self.config = config
        self.log = log
        seed = config.get("seed", 0)
        self.queues = [DelayQueue(q, random.Random("%s-%s" % (seed, q["queue_num"]))) for q in config["queues"]]
        self.held = []  # (due, seq, queue index, packet)
        self.seq = 0
        self.stopping = False
        self.reload_from = None  # the config's path, when SIGHUP asked for it to be read again
        self.start_mono = _start_mono(config)

    def reload(self, path):
        """Take up a rewritten config's start and timelines (same queues)."""
        with open(path) as f:
            config = json.load(f)
        by_number = dict((int(q["queue_num"]), q) for q in config["queues"])
        for q in self.queues:
            spec = by_number.get(q.queue_num)
            if spec is not None:
                q.timeline = _rows(spec)
        self.start_mono = _start_mono(config)
        _log(self.log, {"event": "reloaded", "unix_s": round(time.time(), 4),
                        "timeline_rows": sum(len(q.timeline) for q in self.queues)})  # fmt: skip

    def callback_for(self, index):
        queue = self.queues[index]

        def on_packet(packet):
            now = time.monotonic()
            queue.packets += 1
            if queue.loss is not None and queue.loss.drop():
                queue.dropped += 1
                packet.drop()
                return
            if self.stopping:
                packet.accept()
                return
            self.seq += 1
            heapq.heappush(self.held, (queue.due(now), self.seq, index, packet))

        return on_packet

    def release_due(self):
        now = time.monotonic()
        while self.held and self.held[0][0] <= now:
            due, _seq, index, packet = heapq.heappop(self.held)
            packet.accept()
            queue = self.queues[index]
            late = now - due
            queue.released += 1
            queue.late_sum_s += late
            if late > queue.late_max_s:
                queue.late_max_s = late
            now = time.monotonic()

    def release_all(self):
        while self.held:
            heapq.heappop(self.held)[3].accept()

    def write_stats(self):
        held = {}
        for entry in self.held:
            held[entry[2]] = held.get(entry[2], 0) + 1
        for index, q in enumerate(self.queues):
            _log(self.log, {
                "event": "stats", "unix_s": round(time.time(), 4), "queue_num": q.queue_num,
                "from": q.spec.get("from"), "to": q.spec.get("to"), "packets": q.packets,
                "released": q.released, "dropped": q.dropped, "held": held.get(index, 0),
                "delay_s": q.delay_s,
                "late_mean_ms": round(1000 * q.late_sum_s / q.released, 4) if q.released else None,
                "late_max_ms": round(1000 * q.late_max_s, 4),
            })  # fmt: skip
            q.reset_stats()

    def serve(self, bound):
        """Run until SIGTERM: read packets from every bound queue, release them when due."""
        fds = {nfq.get_fd(): nfq for nfq in bound}
        next_stats = time.monotonic() + STATS_PERIOD_S
        while not self.stopping:
            if self.reload_from is not None:
                path, self.reload_from = self.reload_from, None
                self.reload(path)
            now = time.monotonic()
            for q in self.queues:
                q.advance(now - self.start_mono)
            wait = IDLE_WAIT_S if not self.held else max(0.0, self.held[0][0] - now - SPIN_S)
            wait = min(wait, max(0.0, next_stats - now))
            for q in self.queues:  # a trace's next row is taken up on time, also on an idle link
                if q.timeline:
                    wait = min(wait, max(0.0, self.start_mono + q.timeline[0][0] - now))
            try:
                readable, _w, _x = select.select(list(fds), [], [], wait)
            except InterruptedError:
                readable = []
            for fd in readable:
                fds[fd].run(block=False)
            if not readable and self.held and self.held[0][0] - time.monotonic() <= SPIN_S:
                while self.held[0][0] > time.monotonic():  # at most SPIN_S
                    pass
            self.release_due()
            if time.monotonic() >= next_stats:
                self.write_stats()
                next_stats += STATS_PERIOD_S
        self.release_all()


def _rows(spec):
    """A queue's trace rows as (t_s, delay_s, loss_pct or None)."""
    rows = []
    for row in spec.get("timeline") or ():
        loss = float(row[2]) if len(row) > 2 and row[2] is not None else None
        rows.append((float(row[0]), float(row[1]), loss))
    return rows


def _start_mono(config):
    """t = 0 of the config's trace on this process's monotonic clock (now when it has none)."""
    start_unix_s = config.get("start_unix_s")
    return time.monotonic() + ((float(start_unix_s) - time.time()) if start_unix_s else 0.0)


def _log(out, record):
    out.write(json.dumps(record) + "\n")
    out.flush()
    os.fsync(out.fileno())


RUN_ROOT = "/run/hil-testbed-delay"  # testbed/provisioning/delay_handler.py RUN_ROOT
READY_S = 10.0
STOP_GRACE_S = 5.0
MAX_INPUT_BYTES = 64 << 20
IPTABLES = ("/usr/sbin/iptables", "/sbin/iptables")
BAD_INPUT, FAILED = 2, 1


class Refused(Exception):
    """A request this program does not carry out (exit status 2)."""


def run_dir(directory):
    """Where the handler named by ``directory`` keeps its files (testbed/provisioning/delay_handler.run_dir)."""
    return "%s/%s" % (RUN_ROOT, hashlib.sha256(directory.encode()).hexdigest()[:16])


def _files(rundir):
    names = {"config": "config.json", "pid": "handler.pid", "stats": "stats.jsonl", "log": "log", "for": "for"}
    return dict((key, os.path.join(rundir, name)) for key, name in names.items())


def _invoker():
    """The user sudo ran us for (root when run by root without sudo)."""
    value = os.environ.get("SUDO_UID", "")
    return int(value) if value.isdigit() else os.getuid()


def _start_ticks(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def _running(files):
    """The handler's pid while it runs (the pid and start time its pidfile names), else None."""
    try:
        with open(files["pid"]) as f:
            pid, start = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(pid) if _start_ticks(int(pid)) == start else None


def _write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.rename(tmp, path)


def _read_input():
    data = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise Refused("more than %d bytes on stdin" % MAX_INPUT_BYTES)
    try:
        value = json.loads(data.decode())
    except ValueError as exc:
        raise Refused("stdin is not JSON: %s" % exc) from None
    if not isinstance(value, dict):
        raise Refused("stdin is not a JSON object")
    return value


def check_config(config):
    """Refuse a config whose queues the handler could not bind as given."""
    queues = config.get("queues")
    if not isinstance(queues, list) or not queues:
        raise Refused("the config has no queues")
    for q in queues:
        if not isinstance(q, dict):
            raise Refused("a queue is not an object")
        for key, low, high in (("queue_num", 0, 65535), ("queue_length", 1, 1 << 20)):
            value = q.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise Refused("queue %s: %s must be an integer in [%d, %d]" % (q.get("queue_num"), key, low, high))
    return config


def _owned(files):
    """Refuse a user other than the one that started the handler (root may always)."""
    try:
        with open(files["for"]) as f:
            owner = int(f.read().split("\n")[1])
    except (OSError, ValueError, IndexError):
        owner = 0
    if _invoker() not in (0, owner):
        raise Refused("this handler was started by uid %d" % owner)


def start(directory):
    """Start the handler for ``directory`` detached, with the config on stdin; wait until it is bound.
    A handler that ends before it is ready is started once more (in two of three loaded runs of the
    test suite one ended so, its log empty; the cause is not known yet): what the first one left is
    appended to ``RUN_ROOT/<dir hash>.failed-starts`` (kept for whoever looks into it) and said on
    stderr."""
    config = check_config(_read_input())
    outcome, why = _start_once(directory, config)
    if outcome == "ended":
        _keep_evidence(directory, why)
        sys.stderr.write("the delay handler ended before it was ready (%s); starting it again\n" % why)
        outcome, why = _start_once(directory, config)
    if outcome == "ready":
        print(why)
        return 0
    if outcome == "ended":
        _keep_evidence(directory, why)
    sys.stderr.write("the delay handler did not bind its queues: %s\n" % why)
    return FAILED


def _keep_evidence(directory, why):
    with contextlib.suppress(OSError):
        path = run_dir(directory) + ".failed-starts"
        if not os.path.exists(path) or os.path.getsize(path) < 1 << 20:
            with open(path, "a") as f:
                f.write("%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), json.dumps(why)))


def _start_once(directory, config):
    """("ready", "ready PID"), ("ended", what it left) or ("timeout", what it left)."""
    rundir = run_dir(directory)
    files = _files(rundir)
    if not os.path.isdir(RUN_ROOT):
        os.makedirs(RUN_ROOT, 0o755)
    if _running(files) is not None:
        raise Refused("a handler for %s is running already (pid in %s); stop it first" % (directory, files["pid"]))
    shutil.rmtree(rundir, ignore_errors=True)
    os.mkdir(rundir, 0o755)
    os.chmod(rundir, 0o755)
    _write(files["for"], "%s\n%d\n" % (directory, _invoker()))
    _write(files["config"], json.dumps(config))
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            if os.fork() == 0:
                _daemon(files)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    deadline = time.monotonic() + READY_S
    while True:
        try:
            with open(files["stats"]) as f:
                ready = '"event": "ready"' in f.read()
        except OSError:
            ready = False
        pid = _running(files)
        if ready and pid is not None:
            return "ready", "ready %d" % pid
        if (pid is None and os.path.exists(files["pid"])) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    try:
        with open(files["log"]) as f:
            tail = f.read()[-1500:].strip() or "no output"
    except OSError:
        tail = "no log"
    outcome = "ended" if time.monotonic() <= deadline else "timeout"
    if outcome == "ended":  # it ended (or was ended) before binding: what its pidfile said
        try:
            with open(files["pid"]) as f:
                tail += " (ended before it was ready; its pidfile: %s)" % f.read().strip()
        except OSError:
            pass
    else:
        tail += " (not ready after %.0f s)" % READY_S
    stop(directory, quiet=True)
    return outcome, tail


def _ended_before_serving(signum, frame):
    sys.stderr.write("handler %d: signal %d before its queues were served: ending\n" % (os.getpid(), signum))
    sys.stderr.flush()
    os._exit(128 + signum)


def _daemon(files):
    """The detached handler: its output to the log, its pid (and start time) in the pidfile."""
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(files["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, 1024)
    os.chdir("/")
    os.umask(0o022)
    # Until serve() installs its own handlers, a reload order (SIGHUP) must not end the handler silently
    # (SIGHUP's default action) and a stop (SIGTERM) says so in the log; a crash in C code (the
    # NetfilterQueue binding) writes its Python stack there too. The log's first line says it began.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _ended_before_serving)
    faulthandler.enable(file=sys.stderr)
    sys.stderr.write("handler %d starting\n" % os.getpid())
    sys.stderr.flush()
    _write(files["pid"], "%d %s\n" % (os.getpid(), _start_ticks(os.getpid())))
    try:
        serve(files["config"], files["stats"])
    except BaseException as exc:  # whatever ended it goes to the log
        sys.stderr.write("handler ended: %r\n" % (exc,))
    finally:
        sys.stderr.flush()
        os._exit(0)


def stop(directory, quiet=False):
    """Stop the handler for ``directory`` and remove its files; prints what happened."""
    rundir = run_dir(directory)
    files = _files(rundir)
    if not os.path.isdir(rundir):
        state = "absent"
    else:
        _owned(files)
        pid = _running(files)
        state = "stale"
        if pid is not None:
            state = "stopped"
            for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 2.0)):
                try:
                    os.kill(pid, sig)
                except OSError:
                    break
                deadline = time.monotonic() + wait_s
                while _start_ticks(pid) is not None and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _start_ticks(pid) is None:
                    break
                state = "killed"
            if _start_ticks(pid) is not None:
                raise Refused("pid %d survived SIGKILL" % pid)
        shutil.rmtree(rundir, ignore_errors=True)
    if not quiet:
        print(state)
    return 0


def retime(directory):
    """Give the running handler a trace's start and delay rows (stdin), then SIGHUP it."""
    update = _read_input()
    files = _files(run_dir(directory))
    pid = _running(files)
    if pid is None:
        print("absent")
        return FAILED
    _owned(files)
    with open(files["config"]) as f:
        config = json.load(f)
    start_unix_s = update.get("start_unix_s")
    if start_unix_s is not None and not isinstance(start_unix_s, (int, float)):
        raise Refused("start_unix_s must be a number")
    config["start_unix_s"] = start_unix_s
    timelines = update.get("timelines") or {}
    for queue in config["queues"]:
        rows = timelines.get(str(queue["queue_num"]), [])
        if not isinstance(rows, list) or not all(isinstance(r, list) and 2 <= len(r) <= 3 for r in rows):
            raise Refused("queue %s: a timeline is a list of [t_s, delay_s, loss_pct] rows" % queue["queue_num"])
        queue["timeline"] = rows
    _write(files["config"], json.dumps(config))
    os.kill(pid, signal.SIGHUP)
    print("signalled")
    return 0


_IFACE = r"[A-Za-z0-9][A-Za-z0-9_.@:-]{0,14}"
_CHAIN = re.compile(r"TB-(IN|EG)-" + _IFACE)
_RULE_VALUES = {
    "-s": r"(\d{1,3}\.){3}\d{1,3}/32", "-d": r"(\d{1,3}\.){3}\d{1,3}/32", "-m": r"statistic|recent",
    "--mode": r"random", "--probability": r"0(\.\d{1,12})?|1(\.0{1,12})?", "--name": r"tbge_[0-9_]{7,15}",
    "--mask": r"255\.255\.255\.255", "-j": r"DROP|NFQUEUE", "--queue-num": r"\d{1,5}",
}  # fmt: skip
_RULE_FLAGS = ("!", "--rcheck", "--set", "--remove", "--rsource", "--rdest", "--queue-bypass")


def check_iptables(args):
    """Refuse anything but the commands of our chains (netem/nfqueue.py): the mangle table, chains named
    ``TB-IN-<if>``/``TB-EG-<if>``, the jump into one, and rules of a fixed set of matches and targets."""
    if list(args[:3]) != ["-w", "-t", "mangle"]:
        raise Refused("iptables: only -w -t mangle")
    rest = list(args[3:])
    hooks = {"PREROUTING": "-i", "POSTROUTING": "-o"}

    def chain(name):
        if not _CHAIN.fullmatch(name):
            raise Refused("iptables: %r is not one of our chains" % name)

    if rest == ["-S"]:
        return
    if len(rest) == 2 and rest[0] in ("-N", "-F", "-X"):
        return chain(rest[1])
    if len(rest) in (7, 6) and rest[0] in ("-I", "-D") and rest[1] in hooks:
        words = rest[2:] if rest[0] == "-D" else rest[3:]
        if rest[0] == "-I" and rest[2] != "1":
            raise Refused("iptables: a jump goes first in its hook")
        if len(words) == 4 and words[0] == hooks[rest[1]] and re.fullmatch(_IFACE, words[1]) and words[2] == "-j":
            return chain(words[3])
    if len(rest) >= 2 and rest[0] == "-A":
        chain(rest[1])
        i = 2
        while i < len(rest):
            word = rest[i]
            if word in _RULE_FLAGS:
                i += 1
            elif word in _RULE_VALUES and i + 1 < len(rest) and re.fullmatch(_RULE_VALUES[word], rest[i + 1]):
                i += 2
            else:
                raise Refused("iptables: %r is not a word of our rules" % word)
        return
    raise Refused("iptables: %s is not a command of our chains" % " ".join(rest))


def iptables(args):
    check_iptables(args)
    for path in IPTABLES:
        if os.access(path, os.X_OK):
            os.execv(path, [path] + list(args))
    raise Refused("iptables is not installed (%s)" % " or ".join(IPTABLES))


def _release_promptly():
    """Ask Linux to run this process as soon as a release is due, whatever else the node runs: it stands
    for a link, not for the node's software. The highest CFS weight (nice -20; the handler runs as
    root), a timer slack of 1 us instead of 50 us (select's wake-ups), and on Linux 6.12 or later the
    shortest scheduler slice (EEVDF then lets a waking handler preempt a task that is computing).
    Not a real-time policy: a handler that spins cannot starve the node. (nodes/workers/pacing.py asks
    the same for paced ranks; the handler is one root-owned file, so it asks on its own.) Anything
    refused leaves the default."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, -20)
    try:
        import ctypes
        import platform
        import struct

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
        number = {"x86_64": 314, "aarch64": 274}.get(platform.machine())  # sched_setattr
        if number is not None:  # struct sched_attr: SCHED_OTHER at nice -20 with a 0.1 ms slice
            attr = ctypes.create_string_buffer(struct.pack("IIQiIQQQII", 56, 0, 0, -20, 0, 100000, 0, 0, 0, 0))
            libc.syscall(number, 0, attr, 0)
    except (OSError, AttributeError):
        pass


def serve(config_path, stats_path):
    """Bind every queue of the config and delay their packets until SIGTERM."""
    from netfilterqueue import COPY_META, NetfilterQueue

    _release_promptly()

    with open(config_path) as f:
        config = json.load(f)
    with open(stats_path, "a") as out:
        handler = Handler(config, out)

        def stop_serving(signum, frame):
            handler.stopping = True

        def reload(signum, frame):
            handler.reload_from = config_path

        signal.signal(signal.SIGTERM, stop_serving)
        signal.signal(signal.SIGINT, stop_serving)
        signal.signal(signal.SIGHUP, reload)
        bound = []
        try:
            for index, spec in enumerate(config["queues"]):
                nfq = NetfilterQueue()
                nfq.bind(int(spec["queue_num"]), handler.callback_for(index), max_len=int(spec["queue_length"]),
                         mode=COPY_META)  # fmt: skip
                bound.append(nfq)
            _log(out, {"event": "ready", "unix_s": round(time.time(), 4), "pid": os.getpid(),
                       "queues": [q["queue_num"] for q in config["queues"]]})  # fmt: skip
            handler.serve(bound)
        finally:
            handler.release_all()
            for nfq in bound:
                nfq.unbind()
            _log(out, {"event": "stopped", "unix_s": round(time.time(), 4)})


def main(argv):
    actions = {"start": start, "stop": stop, "retime": retime}
    try:
        if len(argv) >= 2 and argv[1] == "iptables":
            iptables(argv[2:])
        if len(argv) != 3 or argv[1] not in actions:
            raise Refused("usage: %s start|stop|retime DIR, or iptables -w -t mangle ARGS" % argv[0])
        directory = argv[2]
        if not directory.startswith("/") or "\n" in directory or len(directory) > 4096:
            raise Refused("DIR must be an absolute path")
        return actions[argv[1]](directory)
    except Refused as exc:
        sys.stderr.write("refused: %s\n" % exc)
        return BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv))
