"""The emulated lab reached as a real lab is: through a bastion, the only way in (``emulation.bastion``),
as a non-root SSH user (``emulation.ssh_user``) whose sudo allows only the rules the suite prints. A
small demo campaign (delay on its links, so the NFQUEUE delay path runs, and two power modes) finishes
every run there, gives the tokens it gives as root on a lab reached directly, and leaves nothing set; a
privileged command outside the rules is refused by sudo; ``down`` removes the user, its sudoers file,
the bastion and the route that kept this machine out of the lab."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

from bench._common import left_on_nodes
from tests.conftest import REPO, emulated_inventory, emulated_lab, run_cli
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the netns emulated testbed needs root"),
    pytest.mark.skipif(shutil.which("sudo") is None, reason="sudo is not installed (make system-packages)"),
    pytest.mark.slow,
    pytest.mark.root,
]

ROOT_PREFIX, USER_PREFIX = "hesr", "hesu"
USER = f"hesudo{os.getpid() % 100000}"  # a user of its own per test session, removed by `down`
NODES = """nodes:
  - name: server
    kind: server
    model: a6000-server
    roles: [server]
    emulated:
      power_modes:
        - {id: 0, name: default, cpus: 1.0, idle_w: 90, busy_w: 300}
  - name: orin
    kind: jetson
    model: agx-orin
    roles: [device]
    emulated:
      initial_mode: 0
      power_modes:
        - {id: 0, name: MAXN, cpus: 0.5, idle_w: 7.0, busy_w: 40.0}
        - {id: 2, name: MODE_30W, cpus: 0.25, idle_w: 6.0, busy_w: 30.0}
  - name: xavier
    kind: jetson
    model: agx-xavier
    roles: [device]
    emulated:
      initial_mode: 0
      power_modes:
        - {id: 0, name: MAXN, cpus: 0.4, idle_w: 6.0, busy_w: 30.0}
        - {id: 3, name: MODE_30W_ALL, cpus: 0.3, idle_w: 5.0, busy_w: 30.0}
groups:
  devices: [orin, xavier]
link_profiles:
  wifi-up: {rate: 8MBps, delay: 2ms}
  wifi-down: {rate: 12MBps, delay: 2ms}
links:
  - {from: devices, to: server, profile: wifi-up}
  - {from: server, to: devices, profile: wifi-down}
"""

CAMPAIGN = """name: demo-sudo
inventory: {inventory}
base:
  method: ushape
  model: {model}
  partition: {{device_layers: 2, stages: 2}}
  server: server
  devices: [orin, xavier]
  workload: {{arrival: poisson, rate_per_s: 2.0, requests_per_device: 3, prompts: tiny-python, max_new_tokens: 8}}
  link: {{profile: wifi-up}}
  power: {{orin: MAXN, xavier: MAXN}}
  telemetry: {{interval_ms: 200}}
matrix:
  power.orin: [MAXN, MODE_30W]
repetitions: 1
seed: 2026
run_timeout_s: 180
"""


def lab_directory(name: str) -> Path:
    """A directory the SSH user can pass through (pytest's own temporary directories are 0700)."""
    path = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    path.chmod(0o711)
    return path


def lab_inventory(directory: Path, prefix: str, octet: int, ssh_user: str | None, *, bastion: bool = False) -> Path:
    path = emulated_inventory(directory, prefix, octet, NODES)
    if ssh_user is not None:
        text = path.read_text().replace("emulation:\n", f"emulation:\n  ssh_user: {ssh_user}\n  sudo_rules: printed\n"
                                        f"  bastion: {'true' if bastion else 'false'}\n")  # fmt: skip
        path.write_text(text)
    return path


def run_campaign(inventory: Path, directory: Path) -> dict[str, pd.DataFrame]:
    """Run the campaign on ``inventory``'s lab; each run's tokens by run id (every run must be done)."""
    campaign = directory / "campaign.yaml"
    campaign.write_text(CAMPAIGN.format(inventory=inventory, model=REPO / "examples" / "models" / "tiny"))
    out = directory / "out"
    ran = run_cli("run", str(campaign), "--out", str(out), "--json", timeout_s=600)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    runs = json.loads(ran.stdout)["runs"]
    assert [r["state"] for r in runs] == ["done", "done"], runs
    return {r["run_id"]: pd.read_parquet(out / "runs" / r["run_id"] / "tokens.parquet") for r in runs}


def processes() -> Iterator[tuple[int, int, str]]:
    """(pid, uid, command line) of every process."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                yield int(proc.name), proc.stat().st_uid, (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue


def user_processes(user: str) -> list[str]:
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return []
    return [cmdline.replace("\0", " ") for _pid, owner, cmdline in processes() if owner == uid]


@pytest.fixture(scope="module")
def user_lab() -> Iterator[Path]:
    directory = lab_directory("he-sudo-user")
    path = lab_inventory(directory, USER_PREFIX, 192, USER, bastion=True)
    try:
        with emulated_lab(path):
            yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert not Path(f"/etc/sudoers.d/hil-testbed-{USER_PREFIX}").exists()
    routes = subprocess.run(["ip", "route", "show", "10.192.0.0/24"], capture_output=True, text=True, check=True)
    assert routes.stdout.strip() == "" and not Path(f"/run/netns/{USER_PREFIX}-bastion").exists()
    with pytest.raises(KeyError):
        pwd.getpwnam(USER)


def as_user(lab: Path, node: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` on ``node`` through its sshd, as the lab's SSH user (what the controller does)."""
    from testbed.emulation.resolved import load_lab
    from testbed.transport import open_transport
    from testbed.transport.ssh import close_jump_hosts

    inventory = load_lab(lab)
    try:
        with open_transport(inventory, inventory.node(node)) as t:
            result = t.run(list(argv), timeout_s=60)
    finally:
        close_jump_hosts()  # the bastion's session as the user ends with the call
    return subprocess.CompletedProcess(argv, result.exit_code or 0, result.stdout, result.stderr)


def test_the_demo_campaign_through_a_bastion_as_a_user_with_only_the_printed_rules_gives_the_tokens_of_root_directly(
    user_lab,
):
    root_directory = lab_directory("he-sudo-root")
    try:
        root_lab = lab_inventory(root_directory, ROOT_PREFIX, 190, None)
        with emulated_lab(root_lab):
            as_root = run_campaign(root_lab, root_directory)
            assert left_on_nodes(ROOT_PREFIX, root_directory / "state") == []
    finally:
        shutil.rmtree(root_directory, ignore_errors=True)
    whoami = as_user(user_lab, "orin", "id", "-un")
    assert whoami.stdout.strip() == USER and whoami.returncode == 0
    from testbed.emulation.resolved import load_lab

    orin = load_lab(user_lab).node("orin")  # this machine has no route into the lab but to its bastion
    direct = subprocess.run(["ip", "route", "get", str(orin.address)], capture_output=True, text=True, check=False)
    assert direct.returncode != 0 and "No route to host" in direct.stderr, direct.stdout + direct.stderr
    as_user_tokens = run_campaign(user_lab, user_lab.parent)
    manifest = json.loads(next((user_lab.parent / "out" / "runs").glob("*/manifest.json")).read_text())
    reached = manifest["inventory"]["reached"]["orin"]["ssh"]
    assert reached == f"{USER}@{orin.address}:22 via {USER}@10.192.0.254:22", reached
    assert set(as_user_tokens) == set(as_root)
    key = ["node", "request_id", "index"]
    for run_id, tokens in as_root.items():
        merged = tokens.merge(as_user_tokens[run_id], on=key, suffixes=("_root", "_user"))
        assert len(merged) == len(tokens) == len(as_user_tokens[run_id]) > 0, run_id
        assert (merged.token_id_root == merged.token_id_user).all(), run_id
    assert left_on_nodes(USER_PREFIX, user_lab.parent / "state") == []
    wait_until(lambda: not user_processes(USER), lambda: f"the user's closing sessions to end: {user_processes(USER)}",
               30, interval_s=0.5)  # fmt: skip


def test_a_privileged_command_outside_the_rules_is_refused(user_lab):
    allowed = as_user(user_lab, "orin", "sudo", "-n", "-l", "/usr/sbin/tc", "qdisc", "show")
    assert (allowed.returncode, allowed.stderr) == (0, ""), allowed.stdout + allowed.stderr  # its host name resolves
    checked = run_cli("inventory", "check", "-i", str(user_lab))  # the rules it needs are all there
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for argv in (
        ["sh", "-c", "id -u"],
        ["/usr/sbin/iptables", "-w", "-t", "filter", "-S"],
        ["/usr/sbin/tc", "-batch", "/etc/shadow"],
        ["/usr/sbin/ip", "netns", "list"],
    ):
        refused = as_user(user_lab, "orin", "sudo", "-n", "--", *argv)
        assert refused.returncode != 0, argv
        assert "password is required" in refused.stderr or "not allowed" in refused.stderr, refused.stderr
    # the delay handler is allowed, and checks its own arguments as root: only our chains in mangle
    from testbed.provisioning.delay_handler import launcher_path

    handler = as_user(user_lab, "orin", "sudo", "-n", "--", launcher_path(), "iptables", "-w", "-t", "filter", "-S")
    assert handler.returncode == 2, handler.stdout + handler.stderr
    assert "refused" in handler.stderr
    mine = as_user(user_lab, "orin", "touch", "/etc/hil-testbed-sudo-test")
    assert mine.returncode != 0 and not Path("/etc/hil-testbed-sudo-test").exists()


def test_a_privileged_command_that_times_out_is_ended_by_the_user_through_its_sudo(user_lab):
    """A command run with sudo that outlives its timeout is ended without a shell under sudo (which the
    rules refuse): the user signals its own sudo, which relays the TERM to the command it runs as root.
    The rules here allow one more command for the test, ``sleep``, to have a root process that waits."""
    from testbed.emulation.resolved import load_lab
    from testbed.transport import open_transport

    rule = Path(f"/etc/sudoers.d/hil-testbed-test-sleep-{USER}")
    rule.write_text(f"{USER} ALL=(root) NOPASSWD: /usr/bin/sleep\n")
    rule.chmod(0o440)
    marker = f"{4000 + os.getpid() % 1000}"  # a sleep of ours, told apart by its length
    try:
        inventory = load_lab(user_lab)
        with open_transport(inventory, inventory.node("orin")) as t:
            t.run(["true"]).check()  # connected (through the bastion) first: the timeout is the command's own
            result = t.run(["sleep", marker], sudo=True, timeout_s=3)
        assert result.timed_out and t.use_sudo

        def sleeping() -> list[int]:
            return [pid for pid, uid, cmdline in processes() if uid == 0 and cmdline == f"sleep\0{marker}\0"]

        wait_until(lambda: not sleeping(), "the root command to end after its timeout", 30, interval_s=0.2)
    finally:
        rule.unlink()
        for pid, _uid, cmdline in processes():
            if cmdline == f"sleep\0{marker}\0":
                os.kill(pid, 9)


def test_a_second_controller_user_sees_the_first_ones_lease_and_is_refused_naming_it(user_lab):
    """Two people drive one lab from one controller machine, each as a user of their own with a key of
    their own, both logging into the nodes as the lab's account through the bastion: while root's
    controller holds orin, bob's `lab leases` shows root as its holder and his `power set` is refused
    naming root, changing nothing; once root gives it back, bob's command runs."""
    import getpass
    import socket

    from testbed.emulation.resolved import load_lab
    from testbed.emulation.sshd_server import generate_key, reach_script
    from testbed.leases.keeper import LeaseKeeper, holder_for

    bob = f"hebob{os.getpid() % 100000}"
    home = lab_directory("he-bob")
    state = user_lab.parent / "state"
    authorized = state / "keys" / "authorized_keys"
    kept_keys = authorized.read_text()
    subprocess.run(["useradd", "--no-create-home", "--home-dir", str(home), "--shell", "/bin/sh", bob], check=True)
    try:
        key = generate_key(home / "id_ed25519")
        known = home / "known_hosts"
        shutil.copy(state / "keys" / "known_hosts", known)
        config = home / "ssh_config"
        bastion = "10.192.0.254"
        config.write_text(f"Host {bastion}\n  IdentityFile {key}\n  UserKnownHostsFile {known}\n")
        resolved = (state / "inventory.yaml").read_text()  # his own copy, naming his key and files
        mine = resolved.replace(str(state / "keys" / "client_ed25519"), str(key)).replace(
            str(state / "keys" / "known_hosts"), str(known)).replace(
            str(state / "keys" / "controller_ssh_config"), str(config))  # fmt: skip
        (home / "inventory.yaml").write_text(mine)
        subprocess.run(["chown", "-R", f"{bob}:", str(home)], check=True)
        with authorized.open("a") as f:  # the lab's administrator authorizes bob's key
            f.write(key.with_suffix(".pub").read_text())

        # This machine's Python lives under /root (0700): bob's commands run in a mount namespace of their
        # own that lets him reach it, as the emulated nodes' sessions do (a lab's controller would have a
        # Python every user may run)
        reach = reach_script([Path(sys.executable), Path(sys.base_prefix), REPO], home / ".reach")

        def as_bob(*args: str) -> subprocess.CompletedProcess[str]:
            argv = ["runuser", "-u", bob, "--", "env", f"HOME={home}", sys.executable, "-m", "testbed", *args,
                    "-i", str(home / "inventory.yaml")]
            return subprocess.run(["unshare", "--mount", "--propagation", "slave", "sh", "-c",
                                   f'{reach} && exec "$@"' if reach else 'exec "$@"', "bob", *argv], cwd=REPO,
                                  capture_output=True, text=True, timeout=120, check=False)  # fmt: skip

        mode_file = state / "nodes" / "orin" / "power_mode"
        before = mode_file.read_text()
        root = f"{getpass.getuser()}@{socket.gethostname()}"
        with LeaseKeeper(load_lab(user_lab), ["orin"], holder_for("/results/root-campaign")):
            shown = as_bob("lab", "leases", "--json")
            assert shown.returncode == 0, shown.stdout + shown.stderr
            rows = {row["node"]: row for row in json.loads(shown.stdout)}
            assert rows["orin"]["live"] and rows["orin"]["lease"]["holder"] == root, rows
            refused = as_bob("power", "set", "orin", "MODE_30W")
            said = " ".join(refused.stderr.split())
            assert refused.returncode == 1 and f"leased to {root} (campaign /results/root-campaign" in said, said
            assert mode_file.read_text() == before
        done = as_bob("power", "set", "orin", "MODE_30W")
        assert done.returncode == 0 and mode_file.read_text().strip() == "2", done.stdout + done.stderr
        restored = as_bob("power", "restore")
        assert restored.returncode == 0 and mode_file.read_text() == before, restored.stdout + restored.stderr
    finally:
        authorized.write_text(kept_keys)
        subprocess.run(["userdel", bob], check=False)
        shutil.rmtree(home, ignore_errors=True)


def test_a_target_emulations_cpu_pacing_runs_as_the_user_without_a_rule_of_its_own(user_lab):
    """CPU pacing (a campaign with ``target:``) is the emulation's own machinery, no real lab's: the user
    paces and unpaces the node's CPU quota without sudo, and the power mode's quota comes back."""
    from nodes.emulated.cgroup import CpuCgroup
    from testbed.emulation.resolved import load_lab
    from testbed.target.emulation import PACED_PERIOD_MS, pace_nodes, paced_cpus
    from testbed.transport.ssh import close_jump_hosts

    inventory = load_lab(user_lab)
    group = CpuCgroup(f"{USER_PREFIX}-orin")
    before = group.quota_cpus()
    try:
        paced = pace_nodes(inventory, ["orin"], True)
        assert paced.ok, [o.error for o in paced.outcomes]
        assert paced.values()["orin"]["paced"] and group.quota_cpus() == paced_cpus()
        assert group.period_us() == PACED_PERIOD_MS * 1000
        unpaced = pace_nodes(inventory, ["orin"], False)
        assert unpaced.ok and not unpaced.values()["orin"]["paced"], [o.error for o in unpaced.outcomes]
        assert group.quota_cpus() == before
    finally:
        close_jump_hosts()
