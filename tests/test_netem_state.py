"""Reading tc back, the node journal, bandwidth traces and the trace player, without root: parsers
fed the real output formats of tc, iperf3 and ping, and the player run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundation.errors import InputError, TestbedError
from netem.tc_state import differences, parse_htb_classes, parse_read, parse_tc_rate_bit_s, read_script
from netem.trace import HAT_DISTANCE_GROUPS, hat_trace, load_trace, schedules, write_trace
from testbed.inventory import links_from_file, load_inventory
from testbed.links.node_journal import DeviceSnapshot, LinkJournal
from testbed.links.plans import compile_plan, traced_links
from testbed.links.verify import iperf3_goodput, parse_ping

REPO = Path(__file__).resolve().parent.parent

# iproute2 6.1, `tc -s class show dev data0` after an 8 mbit class carried traffic
CLASS_TEXT = """class htb 1f7b:1 root leaf 1: prio 0 rate 8Mbit ceil 8Mbit burst 5000b cburst 5000b 
 Sent 3094456 bytes 2067 pkt (dropped 12, overlimits 1893 requeues 0) 
 backlog 0b 0p requeues 0
 lended: 2055 borrowed: 0 giants: 0
 tokens: -5875 ctokens: -5875

class htb 1f7b:2 root leaf 2: prio 0 rate 96Mbit ceil 96Mbit burst 60000b cburst 60000b 
 Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0) 
 backlog 0b 0p requeues 0
"""  # noqa: W291 - tc prints the trailing spaces

LAB = """
nodes:
  - {name: srv, kind: server, model: x, address: 10.9.0.1, roles: [server], data: {interface: eth1, address: 10.250.0.1}}
  - {name: dev, kind: jetson, model: agx-orin, address: 10.9.0.2, roles: [device],
     data: {interface: eth1, address: 10.250.0.2}}
link_profiles:
  up: {rate: 8mbit}
  down: {rate: 96mbit}
links:
  - {from: dev, to: srv, profile: up}
  - {from: srv, to: dev, profile: down}
"""


@pytest.fixture
def inventory(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(LAB)
    return load_inventory(path)


def test_htb_classes_and_counters_are_parsed_from_tc_text():
    first, second = parse_htb_classes(CLASS_TEXT)
    assert (first.classid, first.leaf, first.rate_bit_s, first.ceil_bit_s) == ("1f7b:1", "1:", 8e6, 8e6)
    assert (first.sent_bytes, first.sent_packets, first.dropped_packets, first.overlimits) == (3094456, 2067, 12, 1893)
    assert second.rate_bit_s == 96e6 and second.sent_bytes == 0
    assert parse_tc_rate_bit_s("1234Kbit") == 1.234e6 and parse_tc_rate_bit_s("100bit") == 100
    with pytest.raises(ValueError):
        parse_tc_rate_bit_s("8mbps")


def _state_output(rate: str, limit: int, match_value: str) -> str:
    qdiscs = [
        {"kind": "htb", "handle": "1f7b:", "root": True, "options": {}},
        {"kind": "pfifo", "handle": "1:", "parent": "1f7b:1", "options": {"limit": limit}},
    ]
    filters = [{"protocol": "ip", "pref": 1, "kind": "u32", "options": {"fh": "800::1", "flowid": "1f7b:1",
                "match": {"value": match_value, "mask": "ffffffff", "offmask": "", "off": 16}}}]  # fmt: skip
    return (
        "#### tc-state link eth1\n" + json.dumps([{"ifname": "eth1"}]) + "\n"
        "#### tc-state qdisc eth1\n" + json.dumps(qdiscs) + "\n"
        f"#### tc-state class eth1\nclass htb 1f7b:1 root leaf 1: prio 0 rate {rate} ceil {rate} burst 5000b\n"
        " Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0)\n"
        "#### tc-state filter eth1\n" + json.dumps(filters) + "\n#### tc-state ingress eth1\n[]\n"
    )


def test_read_back_matches_the_plan_or_names_each_difference(inventory):
    plan = next(p for p in compile_plan(inventory) if p.node == "dev")
    good = parse_read(_state_output("8Mbit", 64, "afa0001"))  # 10.250.0.1
    assert differences(plan, good) == []
    bad = parse_read(_state_output("7Mbit", 1000, "afa0009"))
    problems = differences(plan, bad)
    assert any("rate is 7000000 bit/s, expected 8000000" in p for p in problems)
    assert any("limit is 1000, expected 64" in p for p in problems)
    assert any("no u32 filter sends 10.250.0.1 to 1f7b:1" in p for p in problems)
    assert differences(plan, parse_read("#### tc-state link eth1\n[]\n")) == ["device eth1 does not exist"]
    assert "tc -s class show dev eth1" in read_script(["eth1"])


def test_the_journal_keeps_the_first_snapshot_and_undoes_only_what_is_ours_and_still_there():
    noqueue = ({"kind": "noqueue", "handle": "0:", "root": True, "refcnt": 2, "options": {}},)
    first = LinkJournal({"eth1": DeviceSnapshot(noqueue, "")})
    ours_now = ({"kind": "htb", "handle": "1f7b:", "root": True, "options": {}},)
    second = LinkJournal({"eth1": DeviceSnapshot(ours_now, "x"), "ifbtb1": DeviceSnapshot((), "")},
                         ingress_on=("eth1",), ifbs=("ifbtb1",))  # fmt: skip
    merged = first.merged_with(second)
    assert merged.devices["eth1"].qdiscs == noqueue and set(merged.devices) == {"eth1", "ifbtb1"}
    again = LinkJournal.from_json(merged.to_json())
    assert again == merged

    state = parse_read(
        "#### tc-state link eth1\n[{}]\n#### tc-state qdisc eth1\n"
        + json.dumps([*ours_now, {"kind": "ingress", "handle": "ffff:", "parent": "ffff:fff1"}])
        + "\n#### tc-state link ifbtb1\n[{}]\n#### tc-state qdisc ifbtb1\n[]\n"
    )
    assert again.undo_commands(state) == [
        ["tc", "qdisc", "del", "dev", "eth1", "handle", "ffff:", "ingress"],
        ["ip", "link", "del", "ifbtb1"],
        ["tc", "qdisc", "del", "dev", "eth1", "root", "handle", "1f7b:", "htb"],
    ]
    gone = parse_read("#### tc-state link eth1\n[{}]\n#### tc-state qdisc eth1\n" + json.dumps(list(noqueue)))
    assert again.undo_commands(gone) == [] and again.snapshot_differences(gone) == []
    with pytest.raises(ValueError, match="format"):
        LinkJournal.from_json('{"format": 99}')



def test_the_journal_names_what_it_applied_and_gives_the_links_back(inventory, tmp_path):
    """What ``link verify`` and ``link show`` take as applied: each node's plans, egress and ingress
    (ifb) classes alike, written as their directions with the profile as a file writes it (units), read
    back equal; applying again replaces them; a journal of the previous format has none."""
    from netem.profile import LinkProfile
    from testbed.links.node_journal import applied_entries

    plans = compile_plan(inventory)
    journal = LinkJournal({}, applied=applied_entries([p for p in plans if p.node == "dev"]))
    back = LinkJournal.from_json(journal.to_json())
    assert back == journal and back.applied_links()
    shaped = {(lk.source, lk.destination): lk for lk in inventory.links}
    for link in back.applied_links():
        assert shaped[(link.source, link.destination)].profile == link.profile
    assert journal.merged_with(LinkJournal({})).applied == ()  # applied again with nothing for this node
    old = json.loads(journal.to_json())
    del old["applied"]
    assert LinkJournal.from_json(json.dumps(old)).applied_links() == ()
    tampered = dict(json.loads(journal.to_json()), applied=[{"source": "dev", "destination": "srv",
                                                             "profile_name": "x", "profile": {"rate": 5}}])
    with pytest.raises(ValueError, match="applied entry"):
        LinkJournal.from_json(json.dumps(tampered)).applied_links()
    for written in ({"rate": "8mbit", "delay": "10ms"}, {"rate": "5MBps"}, {"loss": "0.1%"},
                    {"delay": "10ms", "jitter": "2ms", "distribution": "pareto", "loss": "1.5%",
                     "loss_correlation": "25%", "queue_limit_packets": 50, "reorder": True}):
        profile = LinkProfile.model_validate(written)
        assert LinkProfile.model_validate(profile.as_written()) == profile

def test_trace_csv_errors_name_file_line_and_column(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("# a comment\nt_s,up_rate,down_rate\n0,5MBps,10MBps\n2,7mbps,10MBps\n1,5MBps,x\n")
    with pytest.raises(InputError) as err:
        load_trace(path)
    text = str(err.value)
    assert f"{path}:4: up_rate" in text and "ambiguous" in text
    assert f"{path}:5: t_s: 1 does not come after 2" in text and f"{path}:5: down_rate" in text
    path.write_text("t_s,up_rate\n0,5MBps\n")
    with pytest.raises(InputError, match="missing \\['down_rate'\\]"):
        load_trace(path)
    path.write_text("t_s,up_rate,down_rate\n1,5MBps,10MBps\n")
    with pytest.raises(InputError, match="t_s = 0"):
        load_trace(path)


def test_hat_traces_are_seeded_and_stay_in_each_groups_range(tmp_path):
    a, b = hat_trace("far", seed=3, duration_s=120), hat_trace("far", seed=3, duration_s=120)
    assert a == b and a != hat_trace("far", seed=4, duration_s=120)
    for group, limits in HAT_DISTANCE_GROUPS.items():
        trace = hat_trace(group, seed=1, duration_s=300)
        ups = [s.up_bit_s / 8e6 for s in trace.steps]
        downs = [s.down_bit_s / 8e6 for s in trace.steps]
        assert limits["up_MBps"][0] - 0.01 <= min(ups) and max(ups) <= limits["up_MBps"][1] + 0.01
        assert limits["down_MBps"][0] - 0.01 <= min(downs) and max(downs) <= limits["down_MBps"][1] + 0.01
        gaps = [y.t_s - x.t_s for x, y in zip(trace.steps, trace.steps[1:], strict=False)]
        assert min(gaps) >= 2.0 and max(gaps) <= 5.0
    assert min(s.up_bit_s / 8e6 for s in hat_trace("far", seed=1).steps) >= 5.0
    write_trace(a, tmp_path / "a.csv")
    again = load_trace(tmp_path / "a.csv")
    assert [s.t_s for s in again.steps] == [s.t_s for s in a.steps]
    assert [s.up_bit_s for s in again.steps] == [s.up_bit_s for s in a.steps]


def test_a_trace_becomes_a_first_plan_and_timed_class_changes(inventory, tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("t_s,up_rate,down_rate\n0,1MBps,2MBps\n2.5,4MBps,2MBps\n")
    trace = load_trace(path)
    links, driven = traced_links(inventory, {"dev": trace})
    by_pair = {(lk.source, lk.destination): lk for lk in links}
    assert by_pair[("dev", "srv")].profile.rate_bit_s == 8e6 and by_pair[("srv", "dev")].profile.rate_bit_s == 16e6
    assert driven[("dev", "srv")][1] == "up" and driven[("srv", "dev")][1] == "down"
    plans = compile_plan(inventory, links)
    dev_schedule = next(s for s in schedules(plans, driven, ["sudo", "-n", "--"]) if s.node == "dev")
    ((step),) = dev_schedule.steps
    assert step["t_s"] == 2.5 and step["rates"] == {"dev->srv": 32e6}
    assert step["commands"] == [
        ["sudo", "-n", "--", "tc", "class", "change", "dev", "eth1", "parent", "1f7b:", "classid", "1f7b:1", "htb",
         "rate", "32000000bit", "ceil", "32000000bit", "burst", "20000b", "cburst", "20000b", "quantum", "40000"]
    ]  # fmt: skip
    with pytest.raises(TestbedError, match="no uplink between 'srv'"):
        traced_links(inventory, {"srv": trace})


def test_the_trace_player_keeps_to_its_schedule_without_drift(tmp_path):
    """A step whose command takes 0.4 s does not push the next step back: a player that waited out each
    gap after the step before would run them at 1.4 s and 1.9 s. Its start leaves a loaded machine 1 s
    to start Python, and each step's slack (0.2 s) is for a late wake-up or a slow spawn of `true`."""
    start = time.time() + 1.0
    schedule = {
        "start_unix_s": start,
        "steps": [
            {"t_s": 0.0, "commands": [["sleep", "0.4"]], "rates": {}},
            {"t_s": 1.0, "commands": [["true"]], "rates": {}},
            {"t_s": 1.5, "commands": [["false"]], "rates": {}},
        ],
    }
    (tmp_path / "s.json").write_text(json.dumps(schedule))
    log = tmp_path / "log.jsonl"
    player = REPO / "nodes" / "link_trace_player.py"
    proc = subprocess.run([sys.executable, str(player), str(tmp_path / "s.json"), str(log)], timeout=30, check=False)
    assert proc.returncode == 1  # one step failed
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert [s["t_s"] for s in steps] == [0.0, 1.0, 1.5]
    assert abs(steps[1]["actual_t_s"] - 1.0) < 0.2 and abs(steps[2]["actual_t_s"] - 1.5) < 0.2
    assert [s["ok"] for s in steps] == [True, True, False] and "false" in steps[2]["errors"][0]
    assert records[-1] == {**records[-1], "event": "end", "failed_steps": 1}


def test_iperf3_and_ping_reports_are_read_and_errors_are_not_results():
    ok = {"end": {"sum_sent": {"bits_per_second": 8.2e6, "retransmits": 3}, "sum_received": {"bits_per_second": 7.9e6}}}
    assert iperf3_goodput(ok) == (7.9e6, 3)
    refused = {
        "start": {"connected": []},
        "intervals": [],
        "end": {},
        "error": "unable to connect to server: Connection refused",
    }
    with pytest.raises(ValueError, match="Connection refused"):
        iperf3_goodput(refused)
    with pytest.raises(ValueError, match="sum_received"):
        iperf3_goodput({"end": {}})
    ping = (
        "PING 10.232.0.2 (10.232.0.2) from 10.232.0.3 : 56(84) bytes of data.\n"
        "64 bytes from 10.232.0.2: icmp_seq=1 ttl=64 time=20.4 ms\n\n"
        "--- 10.232.0.2 ping statistics ---\n"
        "20 packets transmitted, 19 received, 5% packet loss, time 3805ms\n"
        "rtt min/avg/max/mdev = 20.112/20.453/21.002/0.231 ms\n"
    )
    assert parse_ping(ping) == (20.453, 0.231, 5.0)


def test_a_links_file_is_checked_against_the_inventory_with_its_own_lines(inventory, tmp_path):
    f = tmp_path / "links.yaml"
    f.write_text(
        "link_profiles:\n  up: {rate: 1mbit}\n  slow: {rate: 2mbit}\nlinks:\n  - {from: dev, to: nowhere, profile: slow}\n"
    )
    with pytest.raises(InputError) as err:
        links_from_file(inventory, f)
    text = str(err.value)
    assert f"{f}:2: link_profiles.up: profile 'up' is already defined" in text
    assert f"{f}:5: links[0].to: unknown node or group 'nowhere'" in text
    f.write_text("links:\n  - {from: dev, to: srv, profile: down, symmetric: true}\n")
    links = links_from_file(inventory, f)
    assert {(lk.source, lk.destination, lk.profile.rate_bit_s) for lk in links} == {
        ("dev", "srv", 96e6), ("srv", "dev", 96e6)
    }  # fmt: skip


def test_the_shipped_examples_load():
    inventory = load_inventory(REPO / "inventory.yaml")
    links = links_from_file(inventory, REPO / "examples" / "links" / "wifi-delay.yaml")
    assert len(links) == 6 and all(lk.profile.has_delay_or_loss for lk in links)
    for group in HAT_DISTANCE_GROUPS:
        trace = load_trace(REPO / "examples" / "traces" / f"hat-{group}.csv")
        assert trace.duration_s > 100 and not trace.has_delay_or_loss


def test_a_u32_filters_match_value_is_its_destination_address():
    from netem.tc_state import u32_destination

    assert u32_destination({"options": {"match": {"value": "0a0e0003", "mask": "ffffffff", "offmask": "", "off": 16}}}) == "10.14.0.3"
    assert u32_destination({"options": {"flowid": "1f7b:1"}}) is None and u32_destination({}) is None
