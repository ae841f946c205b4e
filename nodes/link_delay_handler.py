"""Delays packets in user space where the kernel has no sch_netem: the NFQUEUE delay path.

Usage: ``python3 link_delay_handler.py CONFIG.json LOG.jsonl``

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

import heapq
import json
import math
import os
import random
import select
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


def main(argv):
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    from netfilterqueue import COPY_META, NetfilterQueue

    with open(argv[1]) as f:
        config = json.load(f)
    with open(argv[2], "a") as out:
        handler = Handler(config, out)

        def stop(signum, frame):
            handler.stopping = True

        def reload(signum, frame):
            handler.reload_from = argv[1]

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
