"""``testbed emulate up``, ``down`` and ``status``.

``up`` journals every change before making it (see :mod:`testbed.emulation.journal`) and writes
the resolved inventory last: its presence means the testbed is up. ``down`` undoes the journal,
which also cleans up after an ``up`` that was killed halfway.
"""

from __future__ import annotations

import fcntl
import importlib.util
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import TestbedError
from nodes.contracts.durable import write_json_atomic
from nodes.contracts.root_paths import ROOT_STATE
from nodes.emulated import phones as phones_catalogue
from nodes.emulated.cgroup import CpuCgroup, cgroup_version
from testbed.emulation import host
from testbed.emulation.journal import Journal
from testbed.emulation.node_files import (
    ADB_DEVICES_FILE,
    REPO,
    SYSTEM_PATH,
    NodeFiles,
    controller_ssh_config,
    nodes_ssh_config,
    write_node_tools,
)
from testbed.emulation.plan import NODE_DATA_INTERFACE, NODE_MGMT_INTERFACE, EmulationPlan, plan_emulation
from testbed.emulation.resolved import RESOLVED_NAME, NodeAccess, source_digest, write_resolved_inventory
from testbed.emulation.sshd_server import (
    SshdServer,
    SshKeys,
    accepts_connections,
    free_port,
    generate_key,
    login_user,
    reach_script,
)
from testbed.inventory import Inventory, load_inventory, node_kind
from testbed.provisioning.delay_handler import HANDLER_SOURCE, install_script
from testbed.provisioning.sudo_rules import sudoers_text

MODES = ("netns", "local")
SSHD_READY_S = 20.0
Say = Callable[[str], None]


@dataclass(frozen=True)
class NodeHealth:
    node: str
    mode: str
    address: str
    data_address: str
    power_mode: str
    cpu_quota: str
    sshd: bool
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class EmulationStatus:
    state_dir: Path
    running: bool
    mode: str | None
    nodes: tuple[NodeHealth, ...]
    leftovers: int  # journal entries of a testbed that is not (fully) up

    @property
    def ok(self) -> bool:
        return self.running and all(n.ok for n in self.nodes)


@contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """One ``up`` or ``down`` at a time per state directory."""
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(state_dir.parent / f".{state_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _journal(plan: EmulationPlan) -> Journal:
    return Journal(plan.state_dir / "journal.jsonl")


def up(inventory: Inventory, *, mode: str = "netns", say: Say = print) -> EmulationStatus:
    plan = plan_emulation(inventory)
    if mode not in MODES:
        raise TestbedError(f"unknown mode {mode!r}; one of {', '.join(MODES)}")
    if mode == "netns":
        _require_netns_host(plan)
    elif plan.bastion is not None:
        raise TestbedError("emulation.bastion needs the netns mode (a management network that only the bastion "
                           "reaches)")  # fmt: skip
    with _locked(plan.state_dir):
        journal = _journal(plan)
        if journal.exists():
            current = status(inventory)
            if current.ok and current.mode == mode and _built_from(plan, inventory):
                say(f"already up ({mode} mode, {len(current.nodes)} nodes); state in {plan.state_dir}")
                return current
            say(f"removing what an earlier `up` left in {plan.state_dir} ({len(journal.entries())} records)")
            if _teardown(plan, journal, say):
                raise TestbedError(f"could not remove the leftovers of an earlier `up`; see {journal.path}")
        if mode == "netns":
            _check_names_free(plan)
        plan.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        started = time.monotonic()
        try:
            keys = SshKeys.create(plan.state_dir / "keys")
            build = _build_netns if mode == "netns" else _build_local
            access = build(plan, journal, keys, say)
            _attach_phones(plan, journal, access)
            bastion = plan.bastion
            jump = None
            if bastion is not None:
                jump = f"{plan.ssh_user or login_user()}@{bastion.address}:22"
            resolved = write_resolved_inventory(
                inventory,
                plan.state_dir,
                mode=mode,
                access=access,
                identity_file=keys.client_key,
                known_hosts=keys.known_hosts,
                node_config=nodes_ssh_config(keys),
                jump=jump,
                ssh_config=controller_ssh_config(keys) if jump else None,
            )
            load_inventory(resolved)  # what every later command will read must load
        except BaseException:
            say("`up` failed: removing what it made")
            _teardown(plan, journal, say)
            raise
        say(f"{len(plan.nodes)} emulated nodes up in {time.monotonic() - started:.1f} s ({mode} mode)")
    return status(inventory)


def _built_from(plan: EmulationPlan, inventory: Inventory) -> bool:
    path = plan.state_dir / RESOLVED_NAME
    if not path.exists():
        return False
    instance = load_inventory(path).spec.emulation.instance
    return instance is not None and instance.source_digest == source_digest(inventory)


def _require_netns_host(plan: EmulationPlan) -> None:
    if os.geteuid() != 0:
        raise TestbedError(
            f"the emulated testbed needs root for network namespaces, veths and CPU cgroups (you are uid "
            f"{os.geteuid()}). Run it as root, or use `testbed emulate up --mode local`: nodes become sshd "
            "processes on 127.0.0.1, with no network isolation, no link shaping and no CPU quotas"
        )
    if cgroup_version() is None:
        raise TestbedError(
            "no cgroup cpu controller on this host (needed for power-mode CPU quotas); see `testbed doctor`, "
            "or use `testbed emulate up --mode local`"
        )


def _check_names_free(plan: EmulationPlan) -> None:
    """Refuse to build over interfaces, namespaces or subnets that are not ours."""
    taken = [b for b in (plan.mgmt_bridge, plan.data_bridge) if host.link_exists(b)]
    if plan.bastion is not None:
        bastion = plan.bastion
        taken += [v for v in (bastion.mgmt_veth, bastion.outside_veth) if host.link_exists(v)]
        taken += [f"namespace {bastion.netns}"] if host.netns_exists(bastion.netns) else []
    for node in plan.nodes:
        taken += [v for v in (node.host_mgmt_veth, node.host_data_veth) if host.link_exists(v)]
        taken += [f"namespace {node.netns}" for _ in [0] if host.netns_exists(node.netns)]
        if CpuCgroup(node.cgroup).exists():
            taken.append(f"cgroup {node.cgroup}")
    if taken:
        raise TestbedError(
            f"{', '.join(taken)} already exist(s) and {plan.state_dir} has no record of making them; "
            "choose another emulation.name_prefix in the inventory (or remove them if they are yours)"
        )
    routes = json.loads(host.ip("-j", "-4", "route", "show", "table", "all").stdout or "[]")
    for route in routes:
        dst = route.get("dst", "")
        if dst in ("", "default") or ("/" not in dst and not dst[0].isdigit()):
            continue
        try:
            net = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        except ValueError:
            continue
        for field, ours in (("management_subnet", plan.mgmt_network), ("data_subnet", plan.data_network)):
            if net.version == 4 and net.overlaps(ours) and net.prefixlen > 0:
                raise TestbedError(
                    f"emulation.{field} {ours} overlaps {dst} (dev {route.get('dev', '?')}) on this host; "
                    "choose a free subnet in the inventory"
                )


def _build_netns(plan: EmulationPlan, journal: Journal, keys: SshKeys, say: Say) -> dict[str, NodeAccess]:
    changes = host.HostChanges(journal, plan.prefix)
    changes.neighbour_table_room(len(plan.nodes))
    _install_delay_handler(say)
    user = _ssh_user(plan, changes, keys) if plan.ssh_user else None
    write_node_tools(plan.state_dir, keys, identity=user.identity if user else None)
    changes.bridge(plan.mgmt_bridge)
    host.ip("addr", "add", f"{plan.host_mgmt_address}/{plan.mgmt_network.prefixlen}", "dev", plan.mgmt_bridge)
    changes.bridge(plan.data_bridge)
    servers = []
    for node in plan.nodes:
        changes.netns(node.netns)
        changes.veth_into(
            node.host_mgmt_veth,
            plan.mgmt_bridge,
            node.netns,
            NODE_MGMT_INTERFACE,
            node.mgmt_address,
            plan.mgmt_network.prefixlen,
        )
        changes.veth_into(
            node.host_data_veth,
            plan.data_bridge,
            node.netns,
            NODE_DATA_INTERFACE,
            node.data_address,
            plan.data_network.prefixlen,
            per_packet=True,
        )
        initial = node.initial_power_mode
        group = changes.cgroup(node.cgroup, initial.cpus if initial else None)
        files = NodeFiles(plan.state_dir, node)
        files.create(mode="netns", cgroup=node.cgroup)
        if user is not None:
            user.give(files, group)
        server = SshdServer(
            keys,
            address=node.mgmt_address,
            port=22,
            name=node.name,
            environment=files.environment("netns"),
            host_key=files.host_key,
            files_dir=files.directory,
            netns=node.netns,
            hostname=node.name,
            cgroup=group,
            detached=True,
            mounts=user.mounts(files) if user is not None else "",
        )
        changes.process(server.launch(), f"sshd {node.name}")
        servers.append(server)
    if user is not None:
        changes.sudoers(user.sudoers_path, sudoers_text(user.name, _standins(plan)))
    _wait_all(servers)
    if plan.bastion is not None:
        _build_bastion(plan, changes, keys, user)
    name = user.name if user is not None else login_user()
    return {n.name: NodeAccess(n.mgmt_address, 22, name, NODE_DATA_INTERFACE, n.data_address) for n in plan.nodes}


def _build_bastion(plan: EmulationPlan, changes: host.HostChanges, keys: SshKeys, user: _SshUser | None) -> None:
    """The lab's only way in: this machine gives up its address on the management bridge (its route to
    the nodes) for a point-to-point link to the bastion, whose sshd forwards to the nodes; the SSH config
    that names the bastion's key is written as a lab's ~/.ssh/config would name it."""
    bastion = plan.bastion
    assert bastion is not None
    changes.netns(bastion.netns)
    prefixlen = plan.mgmt_network.prefixlen
    changes.veth_into(bastion.mgmt_veth, plan.mgmt_bridge, bastion.netns, NODE_MGMT_INTERFACE, bastion.address,
                      prefixlen)  # fmt: skip
    host.ip("addr", "del", f"{plan.host_mgmt_address}/{prefixlen}", "dev", plan.mgmt_bridge)
    changes.unreachable_route(str(plan.mgmt_network))
    changes.point_to_point(bastion.outside_veth, bastion.netns, "outside0", plan.host_mgmt_address, bastion.address)
    directory = plan.state_dir / bastion.name
    home = directory / "home"
    home.mkdir(parents=True, exist_ok=True)
    if user is not None:
        os.chown(home, user.uid, user.gid)
    server = SshdServer(keys, address=bastion.address, port=22, name=bastion.name, files_dir=directory,
                        environment={"HOME": str(home), "PATH": SYSTEM_PATH},
                        host_key=generate_key(directory / "host_ed25519"), netns=bastion.netns,
                        hostname=bastion.name, detached=True)  # fmt: skip
    changes.process(server.launch(), f"sshd {bastion.name}")
    server.wait_ready(SSHD_READY_S)
    controller_ssh_config(keys).write_text(
        f"# The emulated lab's bastion, as a lab's ~/.ssh/config names its jump host (`testbed emulate up`).\n"
        f"Host {bastion.address}\n"
        f"  IdentityFile {keys.client_key}\n"
        f"  UserKnownHostsFile {keys.known_hosts}\n"
    )


def _standins(plan: EmulationPlan) -> dict[str, list[str]]:
    """The emulated Jetsons' stand-in tools, by tool: where the lab's sudo rules allow them."""
    jetsons = [NodeFiles(plan.state_dir, n) for n in plan.nodes if node_kind(n.kind).boards is not None]
    return {tool: [str(f.jetson_bin / tool) for f in jetsons] for tool in ("nvpmodel", "jetson_clocks")}


def _install_delay_handler(say: Say) -> None:
    """The NFQUEUE delay handler, root-owned in its place (testbed.provisioning.delay_handler), to run with this
    Python, where this Python has the binding (else the delay path says what it lacks)."""
    if importlib.util.find_spec("netfilterqueue") is None:
        return
    script = install_script(str(HANDLER_SOURCE), sys.executable)
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        say(f"the NFQUEUE delay handler was not installed: {(done.stderr or done.stdout).strip()[-400:]}")


@dataclass(frozen=True)
class _SshUser:
    """The lab's nodes reached as ``emulation.ssh_user``: a user of the lab's own with a key of its own
    (for ssh between nodes), a home on each node, and sudo limited to the suite's printed rules."""

    name: str
    uid: int
    gid: int
    identity: Path
    sudoers_path: Path
    reach: tuple[Path, ...]  # what the user must reach on every node: this Python and the repository

    def give(self, files: NodeFiles, group: CpuCgroup) -> None:
        """The node's home, and the directory where the stand-in tegrastats (run as the user, as the real
        one is) keeps its instances, to the user; root's own directory of the node (its /var/lib/hil-testbed).
        The CPU pacing of a target emulation (its state and the node cgroup's quota) is the user's too: it is
        the emulation's own machinery, which no real lab runs, so no sudo rule of the printed ones."""
        for directory in (files.home, files.directory / "tegrastats", files.pacing_dir):
            directory.mkdir(exist_ok=True)
            os.chown(directory, self.uid, self.gid)
        for quota in group.quota_files():
            os.chown(quota, self.uid, self.gid)
        files.root_state.mkdir(mode=0o755, exist_ok=True)

    def mounts(self, files: NodeFiles) -> str:
        """The node's mount namespace: its own /var/lib/hil-testbed, an /etc/hosts that names the node
        (sudo looks its host name up), and this Python reachable."""
        hosts = files.directory / "hosts"
        hosts.write_text(Path("/etc/hosts").read_text() + f"\n127.0.1.1\t{files.node.name}\n")
        hosts.chmod(0o644)
        reach = reach_script(list(self.reach), files.directory / ".reach")
        own = [f"mount --bind {shlex.quote(str(files.root_state))} {ROOT_STATE}",
               f"mount --bind {shlex.quote(str(hosts))} /etc/hosts"]  # fmt: skip
        return " && ".join([*own, reach] if reach else own)


def _ssh_user(plan: EmulationPlan, changes: host.HostChanges, keys: SshKeys) -> _SshUser:
    assert plan.ssh_user is not None
    if shutil.which("sudo") is None or shutil.which("visudo") is None:
        raise TestbedError("emulation.ssh_user needs sudo on this machine: make system-packages (apt-get install sudo)")
    for parent in plan.state_dir.parents:
        if not parent.stat().st_mode & 0o001:
            raise TestbedError(f"{parent} is closed to other users (mode {parent.stat().st_mode & 0o777:o}), so "
                               f"{plan.ssh_user} cannot reach the lab's state in {plan.state_dir}; set "
                               "emulation.state_dir to a directory others may pass through")  # fmt: skip
    if not Path(ROOT_STATE).is_dir():
        raise TestbedError(f"{ROOT_STATE} is missing: the NFQUEUE delay handler's install makes it (is the "
                           "netfilterqueue binding installed? make venv)")  # fmt: skip
    plan.state_dir.chmod(0o711)  # passable, not readable: each node's home, the keys the user may read
    home = plan.state_dir / "ssh-user"
    account = changes.user(plan.ssh_user, home)
    identity = generate_key(home / "id_ed25519")
    for path in (identity, identity.with_suffix(".pub")):
        os.chown(path, account.pw_uid, account.pw_gid)
    with keys.authorized_keys.open("a") as f:  # ssh between nodes, as the user, with its own key
        f.write(identity.with_suffix(".pub").read_text())
    reach = (Path(sys.executable), Path(sys.base_prefix), REPO)
    return _SshUser(plan.ssh_user, account.pw_uid, account.pw_gid, identity,
                    Path(f"/etc/sudoers.d/hil-testbed-{plan.prefix}"), reach)  # fmt: skip


def _build_local(plan: EmulationPlan, journal: Journal, keys: SshKeys, say: Say) -> dict[str, NodeAccess]:
    if plan.ssh_user:
        raise TestbedError("emulation.ssh_user needs the netns mode (nodes of their own, reached as that user)")
    say("local mode: nodes are sshd processes on 127.0.0.1 (no isolation, no link shaping, no CPU quotas)")
    changes = host.HostChanges(journal, plan.prefix)
    write_node_tools(plan.state_dir, keys)
    servers, access = [], {}
    for node in plan.nodes:
        files = NodeFiles(plan.state_dir, node)
        files.create(mode="local", cgroup=None)
        port = free_port()
        server = SshdServer(
            keys,
            address="127.0.0.1",
            port=port,
            name=node.name,
            environment=files.environment("local"),
            host_key=files.host_key,
            files_dir=files.directory,
            detached=True,
        )
        pid = server.launch()
        changes.process(pid, f"sshd {node.name}")
        files.write_config(mode="local", cgroup=None, cpu_root_pid=pid)
        servers.append(server)
        # A loopback address of its own on the data plane, so that each node is told apart there.
        access[node.name] = NodeAccess("127.0.0.1", port, login_user(), "lo", f"127.0.2.{node.index + 2}")
    _wait_all(servers)
    return access


def _attach_phones(plan: EmulationPlan, journal: Journal, access: dict[str, NodeAccess]) -> None:
    """Emulated phones: their USB hosts' stand-in adb learns how to reach each (ssh with the testbed's
    keys, so only once every sshd is up), and each phone's battery process starts, journaled."""
    phones = [n for n in plan.nodes if node_kind(n.kind).via_usb_host]
    if not phones:
        return
    ssh = str(plan.state_dir / "bin-node" / "ssh")
    table = {}
    for phone in phones:
        model = phones_catalogue.phone_named(phone.model)
        reach = access[phone.name]
        table[phone.serial] = {"node": phone.name, "usb_host": phone.usb_host, "host": reach.address,
                               "port": reach.port, "user": reach.user, "ssh": ssh,
                               "product_model": model.product_model, "codename": model.codename}  # fmt: skip
    write_json_atomic(plan.state_dir / ADB_DEVICES_FILE, table, mode=0o644)
    changes = host.HostChanges(journal, plan.prefix)
    for phone in phones:
        files = NodeFiles(plan.state_dir, phone)
        log = (files.directory / "battery.log").open("ab")
        process = subprocess.Popen(
            [sys.executable, "-m", "nodes.emulated.battery", str(files.config), str(files.standin_root)],
            env=dict(os.environ, PYTHONPATH=str(REPO)), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        changes.process(process.pid, f"battery {phone.name}")


def _wait_all(servers: list[SshdServer]) -> None:
    for server in servers:
        server.wait_ready(SSHD_READY_S)


def down(inventory: Inventory, *, say: Say = print) -> list[str]:
    """Remove everything ``up`` made (idempotent); return what could not be removed."""
    plan = plan_emulation(inventory)
    with _locked(plan.state_dir):
        journal = _journal(plan)
        if not journal.exists():
            if plan.state_dir.exists():
                shutil.rmtree(plan.state_dir)
            say(f"nothing to remove: no emulated testbed recorded in {plan.state_dir}")
            return []
        return _teardown(plan, journal, say)


def _teardown(plan: EmulationPlan, journal: Journal, say: Say) -> list[str]:
    entries = journal.entries()
    started = time.monotonic()
    problems = host.undo(entries, plan.prefix)
    if problems:
        for p in problems:
            say(f"could not remove {p}")
        say(f"kept {plan.state_dir} (its journal lists what is left); fix the above and run down again")
        return problems
    shutil.rmtree(plan.state_dir, ignore_errors=True)
    say(f"removed {len(entries)} recorded objects in {time.monotonic() - started:.1f} s")
    return []


def status(inventory: Inventory) -> EmulationStatus:
    plan = plan_emulation(inventory)
    journal = _journal(plan)
    resolved = plan.state_dir / RESOLVED_NAME
    if not resolved.exists():
        return EmulationStatus(plan.state_dir, False, None, (), len(journal.entries()))
    running = load_inventory(resolved)
    instance = running.spec.emulation.instance
    mode = instance.mode if instance else None
    sshd_pids = {e.name.split(" ", 1)[1]: e.details for e in journal.entries()
                 if e.kind == "process" and e.name.startswith("sshd ")}  # fmt: skip
    bastion_ok = plan.bastion is not None and accepts_connections(plan.bastion.address, 22)
    nodes = []
    for node_plan in plan.nodes:
        node = running.node(node_plan.name)
        target = running.ssh_target(node)
        problems = []
        details = sshd_pids.get(node.name, {})
        pid = details.get("pid")
        sshd_alive = isinstance(pid, int) and host.process_start_ticks(pid) == details.get("start_ticks")
        if not sshd_alive:
            problems.append("sshd is not running")
        elif plan.bastion is not None:  # this machine has no route to the node: ask from the bastion
            if not host.accepts_connections_in(plan.bastion.netns, target.host, target.port):
                problems.append(f"sshd does not accept connections on {target.host}:{target.port} (from the bastion)")
            if not bastion_ok:
                problems.append(f"the bastion does not accept connections on {plan.bastion.address}:22")
        elif not accepts_connections(target.host, target.port):
            problems.append(f"sshd does not accept connections on {target.host}:{target.port}")
        quota = "not enforced (local mode)"
        if mode == "netns":
            for what, ok in (
                (f"namespace {node_plan.netns}", host.netns_exists(node_plan.netns)),
                (f"veth {node_plan.host_mgmt_veth}", host.link_exists(node_plan.host_mgmt_veth)),
                (f"veth {node_plan.host_data_veth}", host.link_exists(node_plan.host_data_veth)),
            ):
                if not ok:
                    problems.append(f"{what} is missing")
            group = CpuCgroup(node_plan.cgroup)
            if group.exists():
                cpus = group.quota_cpus()
                quota = "unlimited" if cpus is None else f"{cpus:g} CPUs"
            else:
                problems.append(f"cgroup {node_plan.cgroup} is missing")
                quota = "?"
        files = NodeFiles(plan.state_dir, node_plan)
        mode_id = files.power_mode.read_text().strip() if files.power_mode.exists() else ""
        names = {str(m.id): m.name for m in node_plan.power_modes}
        nodes.append(
            NodeHealth(
                node=node.name,
                mode=mode or "?",
                address=f"{target.host}:{target.port}",
                data_address=f"{node.data.interface} {node.data.address}" if node.data else "",
                power_mode=f"{mode_id} {names.get(mode_id, '')}".strip(),
                cpu_quota=quota,
                sshd=sshd_alive,
                problems=tuple(problems),
            )
        )
    return EmulationStatus(plan.state_dir, True, mode, tuple(nodes), 0)

