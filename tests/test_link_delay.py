"""The NFQUEUE delay path without a kernel: where its rules go (exact iptables commands), how they
are read back and undone, and the delay handler's timing and loss models (nodes/link_delay_handler).
The path on real namespaces, rules and handlers is in test_links.py."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from netem import nfqueue
from netem import plan as netem_plan
from netem.plan import compile_plan
from netem.profile import DirectedLink, LinkProfile
from netem.topology import LinkNode, LinkTopology
from nodes import link_delay_handler as handler
from testbed.links.handler_lifecycle import parse_handler_report
from testbed.links.node_journal import LinkJournal


def topology(links: list[tuple[str, str, dict]]) -> LinkTopology:
    nodes = (
        LinkNode("s", "eth1", "10.250.0.1", True, ("server",)),
        LinkNode("d", "eth1", "10.250.0.2", True, ("device",)),
        LinkNode("p", "wlan0", "10.250.0.3", False, ("device",)),  # a phone: runs no tc or iptables
    )
    directed = tuple(DirectedLink(a, b, "x", LinkProfile.model_validate(profile)) for a, b, profile in links)
    return LinkTopology("lab.yaml", nodes, directed)


def chains_of(topo: LinkTopology, traced=()) -> dict[tuple[str, str], nfqueue.NfqueueRules]:
    plans = tuple(p.__class__(**{**p.__dict__, "delay_path": "nfqueue"}) for p in compile_plan(topo))
    return {(c.node, c.hook_side): c for c in nfqueue.compile_chains(topo, plans, traced)}


def lines(commands):
    return [" ".join(c) for c in commands]


def test_rules_sit_on_the_receiver_except_for_a_phone_and_their_commands_are_exact():
    topo = topology([
        ("d", "s", {"rate": "40mbit", "delay": "10ms"}),
        ("s", "d", {"rate": "40mbit", "delay": "10ms", "loss": "1%"}),
        ("s", "p", {"rate": "8mbit", "delay": "30ms", "jitter": "5ms", "distribution": "normal"}),
        ("p", "s", {"rate": "8mbit", "loss": "2%"}),  # shaped on s's ifb; the loss is s's too
    ])  # fmt: skip
    chains = chains_of(topo)
    assert set(chains) == {("s", "ingress"), ("d", "ingress"), ("s", "egress")}
    assert lines(chains[("d", "ingress")].apply_commands()) == [
        "iptables -w -t mangle -N TB-IN-eth1",
        "iptables -w -t mangle -A TB-IN-eth1 -s 10.250.0.1/32 -m statistic --mode random --probability 0.01000000000 -j DROP",
        "iptables -w -t mangle -A TB-IN-eth1 -s 10.250.0.1/32 -j NFQUEUE --queue-num 8100 --queue-bypass",
        "iptables -w -t mangle -I PREROUTING 1 -i eth1 -j TB-IN-eth1",
    ]  # fmt: skip
    on_server = chains[("s", "ingress")]
    assert lines(on_server.apply_commands(chain_exists=True, jump_exists=True)) == [
        "iptables -w -t mangle -F TB-IN-eth1",
        "iptables -w -t mangle -A TB-IN-eth1 -s 10.250.0.2/32 -j NFQUEUE --queue-num 8101 --queue-bypass",
        "iptables -w -t mangle -A TB-IN-eth1 -s 10.250.0.3/32 -m statistic --mode random --probability 0.02000000000 -j DROP",
    ]  # fmt: skip
    # The phone cannot hold rules: what it receives is delayed on the sender, before its HTB class.
    to_phone = chains[("s", "egress")]
    assert lines(to_phone.apply_commands())[-2:] == [
        "iptables -w -t mangle -A TB-EG-eth1 -d 10.250.0.3/32 -j NFQUEUE --queue-num 8100 --queue-bypass",
        "iptables -w -t mangle -I POSTROUTING 1 -o eth1 -j TB-EG-eth1",
    ]
    assert lines(to_phone.undo_commands()) == [
        "iptables -w -t mangle -D POSTROUTING -o eth1 -j TB-EG-eth1",
        "iptables -w -t mangle -F TB-EG-eth1",
        "iptables -w -t mangle -X TB-EG-eth1",
    ]
    (queue,) = to_phone.queues
    assert queue == {
        "queue_num": 8100, "from": "s", "to": "p", "delay_s": 0.03, "jitter_s": 0.005, "distribution": "normal",
        "reorder": False, "queue_length": nfqueue.queue_length_packets(to_phone.directions[0].profile),
    }  # fmt: skip
    assert on_server.queues[0]["queue_num"] == 8101  # numbers are per node, over both of s's chains
    assert chains[("d", "ingress")].queues[0]["queue_num"] == 8100


def test_correlated_loss_is_a_gilbert_chain_in_the_kernel_and_a_traces_loss_goes_to_the_handler():
    topo = topology([
        ("d", "s", {"rate": "8mbit", "loss": "5%", "loss_correlation": "50%"}),
        ("s", "d", {"rate": "8mbit", "delay": "1us", "loss": "3%"}),
    ])  # fmt: skip
    correlated = chains_of(topo)[("s", "ingress")]
    assert correlated.queues == ()  # no delay: no packet of this direction goes through user space
    listed = "--name tbge_10_250_0_2 --mask 255.255.255.255 --rsource"
    # good -> bad with p (1 - rho) = 0.025 (and drop), bad -> good with (1 - p)(1 - rho) = 0.475, bad: drop
    assert lines(correlated.apply_commands())[1:4] == [
        f"iptables -w -t mangle -A TB-IN-eth1 -s 10.250.0.2/32 -m recent ! --rcheck {listed} -m statistic --mode "
        f"random --probability 0.02500000000 -m recent --set {listed} -j DROP",
        f"iptables -w -t mangle -A TB-IN-eth1 -s 10.250.0.2/32 -m recent --rcheck {listed} -m statistic --mode "
        f"random --probability 0.47500000000 -m recent --remove {listed}",
        f"iptables -w -t mangle -A TB-IN-eth1 -s 10.250.0.2/32 -m recent --rcheck {listed} -j DROP",
    ]  # fmt: skip
    p, rho = 0.05, 0.5  # the chain's P(lost | lost) is the handler model's
    to_bad, to_good = correlated.directions[0].gilbert
    assert (to_bad, 1 - to_good) == pytest.approx((p * (1 - rho), p + rho * (1 - p)))
    traced = chains_of(topo, traced={("s", "d")})[("d", "ingress")]
    (rule,) = traced.directions[0].rule_words()  # a trace's rows change the loss: the handler's
    assert "statistic" not in rule and traced.queues[0]["loss_pct"] == 3
    # 1.5 x (40 mbit / 1500 B) x (50 ms + 4 x 10 ms + 20 ms) = 550 packets: below the kernel's 1024
    assert nfqueue.queue_length_packets(LinkProfile.model_validate({"rate": "40mbit", "delay": "50ms",
                                                                    "jitter": "10ms"})) == 1024  # fmt: skip
    # 1 gbit and 50 ms: 1.5 x 83333 x 0.07 = 8750 packets; a delay-only link is sized as 1 gbit
    assert nfqueue.queue_length_packets(LinkProfile.model_validate({"rate": "1gbit", "delay": "50ms"})) == 8750
    assert nfqueue.queue_length_packets(LinkProfile.model_validate({"delay": "50ms"})) == 8750


LISTING = """-P PREROUTING ACCEPT
-P POSTROUTING ACCEPT
-N TB-IN-eth1
-N THEIRS
-A PREROUTING -i eth1 -j TB-IN-eth1
-A PREROUTING -i eth1 -j THEIRS
-A TB-IN-eth1 -s 10.250.0.1/32 -m statistic --mode random --probability 0.00999999978 -j DROP
-A TB-IN-eth1 -s 10.250.0.1/32 -j NFQUEUE --queue-num 8100 --queue-bypass
-A THEIRS -j ACCEPT
"""


def test_read_back_compares_rules_with_iptables_precision_and_undo_touches_only_ours():
    chain = chains_of(topology([("s", "d", {"delay": "10ms", "loss": "1%"})]))[("d", "ingress")]
    assert nfqueue.rule_differences(chain, LISTING) == []
    wrong = LISTING.replace("0.00999999978", "0.02000000019")
    assert "chain TB-IN-eth1" in nfqueue.rule_differences(chain, wrong)[0]
    unjumped = LISTING.replace("-A PREROUTING -i eth1 -j TB-IN-eth1\n", "")
    assert "no jump" in nfqueue.rule_differences(chain, unjumped)[0]
    journal = LinkJournal(devices={}, held={"nfqueue": (("eth1", "ingress"), ("eth1", "egress"))})
    assert lines(journal.held_undo_commands({"nfqueue": LISTING})) == [
        "iptables -w -t mangle -D PREROUTING -i eth1 -j TB-IN-eth1",
        "iptables -w -t mangle -F TB-IN-eth1",
        "iptables -w -t mangle -X TB-IN-eth1",
    ]  # the egress chain is not there, and THEIRS is not ours
    assert lines(journal.held_undo_commands({"nfqueue": unjumped}))[0] == "iptables -w -t mangle -F TB-IN-eth1"
    assert journal.held_undo_commands({"nfqueue": "-P PREROUTING ACCEPT\n"}) == []
    again = LinkJournal.from_json(journal.to_json())
    assert again.held == journal.held and again.handler_pidfile is None
    # a journal an earlier version wrote (format 1: the chains by name) is read, and its chains undone
    earlier = json.loads(journal.to_json())
    earlier.update(format=1, chains=earlier.pop("held")["nfqueue"])
    assert LinkJournal.from_json(json.dumps(earlier)).held == journal.held


def queue(**spec) -> handler.DelayQueue:
    return handler.DelayQueue({"queue_num": 8100, "queue_length": 1024, **spec}, random.Random(7))


def test_release_times_keep_order_unless_reordering_is_allowed_and_jitter_has_the_configured_spread():
    in_order = queue(delay_s=0.02, jitter_s=0.005, distribution="normal")
    dues = [in_order.due(t * 1e-4) for t in range(20000)]  # a packet every 0.1 ms: jitter would reorder
    assert all(b >= a for a, b in itertools.pairwise(dues))
    free = queue(delay_s=0.02, jitter_s=0.005, distribution="normal", reorder=True)
    dues = [free.due(t * 1e-4) for t in range(20000)]
    assert any(b < a for a, b in itertools.pairwise(dues))
    offsets = [d - t * 1e-4 - 0.02 for t, d in enumerate(dues)]
    assert statistics.mean(offsets) == pytest.approx(0, abs=1e-4)
    assert statistics.pstdev(offsets) == pytest.approx(0.005, rel=0.03)
    rng = random.Random(3)
    uniform = [handler.jitter_draw(rng, 0.006, None) for _ in range(20000)]  # netem's default
    assert max(uniform) <= 0.006 and min(uniform) >= -0.006
    assert statistics.pstdev(uniform) == pytest.approx(0.006 / 3**0.5, rel=0.03)
    for shape in ("pareto", "paretonormal"):
        draws = [handler.jitter_draw(rng, 0.004, shape) for _ in range(50000)]
        assert statistics.mean(draws) == pytest.approx(0, abs=2e-4), shape
        assert statistics.pstdev(draws) == pytest.approx(0.004, rel=0.15), shape
        assert statistics.mean(d > 0.008 for d in draws) > statistics.mean(d < -0.008 for d in draws)  # a long tail
    never_early = queue(delay_s=0.001, jitter_s=0.01)
    assert min(never_early.due(0.0) for _ in range(1000)) >= 0.0  # no packet leaves before it came


def test_gilbert_loss_keeps_the_mean_and_makes_bursts_as_correlated():
    for p_pct, rho_pct in ((5, 0), (5, 50), (20, 25)):
        model = handler.GilbertLoss(p_pct, rho_pct, random.Random(11))
        drops = [model.drop() for _ in range(200_000)]
        assert statistics.mean(drops) == pytest.approx(p_pct / 100, rel=0.05), (p_pct, rho_pct)
        bursts, run = [], 0
        for lost in drops:
            if lost:
                run += 1
            elif run:
                bursts.append(run)
                run = 0
        p, rho = p_pct / 100, rho_pct / 100
        assert statistics.mean(bursts) == pytest.approx(1 / (1 - (p + rho * (1 - p))), rel=0.05), (p_pct, rho_pct)


def test_trace_rows_change_delay_and_loss_on_time_and_a_reload_takes_up_a_new_start(tmp_path):
    config = {"seed": 1, "start_unix_s": None, "queues": [
        {"queue_num": 8100, "queue_length": 1024, "delay_s": 0.005, "loss_pct": 0.0, "loss_correlation_pct": 0.0},
    ]}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with open(tmp_path / "log.jsonl", "a") as log:
        h = handler.Handler(config, log)
        (q,) = h.queues
        q.advance(100.0)
        assert q.delay_s == 0.005 and q.loss.p == 0
        config["start_unix_s"] = 1_000_000_000.0  # long ago: every row is due
        config["queues"][0]["timeline"] = [[2, 0.02, 10], [4, 0.05, None]]
        path.write_text(json.dumps(config))
        h.reload(str(path))
        q.advance(3.0)
        assert (q.delay_s, q.loss.p) == (0.02, 0.1)
        q.advance(4.0)
        assert (q.delay_s, q.loss.p) == (0.05, 0.1)  # a row without loss keeps the last
    assert '"event": "reloaded"' in (tmp_path / "log.jsonl").read_text()


def test_on_the_nfqueue_path_the_class_leaf_is_a_pfifo_and_the_netem_path_keeps_netem():
    topo = topology([("s", "d", {"rate": "40mbit", "delay": "10ms", "loss": "1%"})])
    (plan,) = compile_plan(topo)
    assert plan.uses_netem and plan.leaf_kind(plan.peers[0]) == "netem"
    assert "netem delay 10000us loss 1%" in " ".join(plan.apply_commands()[2])
    on_nfqueue = plan.__class__(**{**plan.__dict__, "delay_path": "nfqueue"})
    assert not on_nfqueue.uses_netem and on_nfqueue.has_delay_or_loss
    assert on_nfqueue.apply_commands()[2][-3:] == ["pfifo", "limit", str(netem_plan.queue_limit_packets(
        plan.peers[0].profile))]  # fmt: skip


def test_a_handler_report_sums_its_seconds_since_the_run_began_and_says_whether_it_still_runs():
    lines = [
        {"event": "ready", "unix_s": 90.0},
        {"event": "stats", "unix_s": 99.0, "queue_num": 8100, "packets": 50, "late_mean_ms": 9.0, "late_max_ms": 9.0,
         "dropped": 0},
        {"event": "stats", "unix_s": 101.0, "queue_num": 8100, "packets": 200, "late_mean_ms": 0.05,
         "late_max_ms": 0.4, "dropped": 3},
        {"event": "stats", "unix_s": 102.0, "queue_num": 8100, "packets": 100, "late_mean_ms": None,
         "late_max_ms": 0.0, "dropped": 0},
    ]  # fmt: skip
    text = "\n".join(json.dumps(line) for line in lines)
    report = parse_handler_report("b", "alive\n" + text + "\n{half a line", since_unix_s=100.0)
    assert (report.alive, report.seconds, report.packets, report.dropped) == (True, 2, 300, 3)
    assert (report.late_mean_ms_worst_second, report.late_max_ms) == (0.05, 0.4)
    assert not parse_handler_report("b", text, since_unix_s=100.0).alive


def test_a_traced_link_keeps_its_profiles_loss_correlation_for_the_handlers_chain(tmp_path):
    from netem.trace import load_trace, traced_links

    trace = tmp_path / "t.csv"
    trace.write_text("t_s,up_rate,down_rate,delay_ms,loss_pct\n0,8mbit,8mbit,5,2\n3,8mbit,8mbit,5,10\n")
    topo = topology([("d", "s", {"rate": "8mbit", "loss": "1%", "loss_correlation": "30%"}), ("s", "d", {})])
    links, driven = traced_links(topo, {"d": load_trace(trace)})
    up = links[0]
    assert (up.profile.loss_pct, up.profile.loss_correlation_pct) == (2, 30)  # the row's loss, the link's burstiness
    plans = tuple(p.__class__(**{**p.__dict__, "delay_path": "nfqueue"})
                  for p in compile_plan(LinkTopology(topo.source, topo.nodes, links)))  # fmt: skip
    chain = {c.node: c for c in nfqueue.compile_chains(topo, plans, tuple(driven))}["s"]
    assert chain.queues[0]["loss_pct"] == 2 and chain.queues[0]["loss_correlation_pct"] == 30


def test_the_handler_runs_only_our_chains_iptables_commands_as_root():
    """iptables runs through the installed handler, which checks every word as root: a sudoers pattern
    cannot keep out ``--modprobe`` (which runs a program), another table, or chains not ours."""
    topo = topology([
        ("d", "s", {"rate": "40mbit", "delay": "10ms", "loss": "5%", "loss_correlation": "25%"}),
        ("s", "d", {"rate": "40mbit", "delay": "10ms", "loss": "1%"}),
        ("s", "p", {"rate": "8mbit", "delay": "30ms"}),
    ])  # fmt: skip
    ours = [c for chain in chains_of(topo).values()
            for c in (chain.apply_commands(), chain.apply_commands(chain_exists=True, jump_exists=True),
                      chain.undo_commands())]  # fmt: skip
    ours += [["iptables", "-w", "-t", "mangle", "-S"]]
    for command in (c for group in ours for c in (group if isinstance(group[0], list) else [group])):
        assert command[0] == "iptables"
        handler.check_iptables(command[1:])  # none refused
    mangle = ["-w", "-t", "mangle"]
    for words in (
        ["-w", "-t", "filter", "-S"],
        [*mangle, "--modprobe=/tmp/x", "-S"],
        [*mangle, "-S", "-M", "/tmp/x"],
        [*mangle, "-A", "TB-IN-eth1", "-s", "10.0.0.1/32", "--modp", "/tmp/x", "-j", "DROP"],
        [*mangle, "-A", "TB-IN-eth1", "-j", "LOG"],
        [*mangle, "-A", "INPUT", "-j", "DROP"],
        [*mangle, "-F", "PREROUTING"],
        [*mangle, "-X"],
        [*mangle, "-I", "PREROUTING", "2", "-i", "eth1", "-j", "TB-IN-eth1"],
        [*mangle, "-A", "TB-IN-eth1", "-s", "10.0.0.1/32; id", "-j", "DROP"],
    ):
        with pytest.raises(handler.Refused):
            handler.check_iptables(words)


def test_the_handlers_files_are_roots_and_named_alike_by_the_controller_the_node_shell_and_the_handler():
    from testbed.links.handler_lifecycle import handler_files
    from testbed.provisioning.delay_handler import RUN_ROOT, run_dir, run_dir_script

    directory = "/home/lab/hil-testbed/netem"
    assert handler.RUN_ROOT == RUN_ROOT and handler.run_dir(directory) == run_dir(directory)
    assert handler_files(directory)["pidfile"].startswith(run_dir(directory) + "/")
    printed = subprocess.run(["sh", "-c", run_dir_script("'/home/lab/hil-testbed/netem'")], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    assert printed == run_dir(directory)
    assert handler.main(["h", "stop", "relative/dir"]) == handler.BAD_INPUT


@pytest.mark.skipif(os.geteuid() != 0, reason="the handler's files are root's")
def test_a_user_may_stop_only_a_handler_it_started(tmp_path):
    """``SUDO_UID`` says who sudo runs the handler for: another user's stop is refused, root's is not."""
    directory = str(tmp_path / "netem")
    rundir = Path(handler.run_dir(directory))
    rundir.mkdir(parents=True)
    try:
        (rundir / "for").write_text(f"{directory}\n4321\n")
        command = [sys.executable, str(Path(handler.__file__)), "stop", directory]
        other = subprocess.run(command, env={**os.environ, "SUDO_UID": "1234"}, capture_output=True, text=True)
        assert other.returncode == handler.BAD_INPUT and "started by uid 4321" in other.stderr and rundir.is_dir()
        owner = subprocess.run(command, env={**os.environ, "SUDO_UID": "4321"}, capture_output=True, text=True)
        assert (owner.returncode, owner.stdout.strip()) == (0, "stale") and not rundir.exists()
    finally:
        shutil.rmtree(rundir, ignore_errors=True)


@pytest.mark.root
def test_a_handler_that_ends_before_it_is_ready_is_started_once_more_and_its_log_is_kept(tmp_path):
    """The first handler holds queue 8990; a second one for another directory cannot bind it and
    ends: its start tries once more, says so, fails naming the handler's own log, and keeps what
    each attempt left in RUN_ROOT/<hash>.failed-starts."""
    if os.geteuid() != 0:
        pytest.fail("binding an NFQUEUE needs root (CI runs the suite as root)")
    config = json.dumps({"queues": [{"queue_num": 8990, "queue_length": 100, "delay_s": 0.01}]})
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    command = [sys.executable, str(Path(handler.__file__))]
    evidence = Path(handler.run_dir(second) + ".failed-starts")
    try:
        started = subprocess.run([*command, "start", first], input=config, capture_output=True, text=True, timeout=60)
        assert started.returncode == 0 and started.stdout.startswith("ready "), started.stderr
        clash = subprocess.run([*command, "start", second], input=config, capture_output=True, text=True, timeout=60)
        assert clash.returncode == handler.FAILED
        assert "ended before it was ready" in clash.stderr and "starting it again" in clash.stderr
        assert "did not bind its queues" in clash.stderr and "handler ended" in clash.stderr, clash.stderr
        assert len(evidence.read_text().splitlines()) == 2  # both attempts' logs
        assert not Path(handler.run_dir(second)).exists()  # nothing else left of the failed one
    finally:
        for directory in (first, second):
            subprocess.run([*command, "stop", directory], capture_output=True, timeout=60)
        evidence.unlink(missing_ok=True)
