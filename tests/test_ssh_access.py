"""SSH as labs use it, against real sshd processes on 127.0.0.1: the lab's SSH config (Host aliases,
User, Port, IdentityFile, UserKnownHostsFile, ProxyJump), jump hosts (one bastion's connection shared
by the nodes behind it, chains of hops), and host certificates trusted through ``@cert-authority``."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from foundation.errors import InputError, NodeError, TestbedError
from testbed.emulation.sshd_server import SshdServer, SshKeys, login_user
from testbed.inventory import load_inventory
from testbed.transport import SshTransport, open_transport
from testbed.transport.host_keys import KnownHosts, certificate_problem


def _inventory(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(body)
    return path


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ssh_config"
    path.write_text(text)
    return path


@pytest.fixture
def servers(ssh_keys: SshKeys):
    started: list[SshdServer] = []

    def start(name: str, *extra: str, host_key: Path | None = None) -> SshdServer:
        server = SshdServer(ssh_keys, name=name, host_key=host_key, extra_config=extra).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _peer_process(port: int) -> str:
    """The name of the process holding the client end of the TCP connection to 127.0.0.1:``port``."""
    out = subprocess.run(["ss", "-Htnp", "state", "established", "dst", f"127.0.0.1:{port}"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return out


def test_an_ssh_config_alias_gives_host_port_user_key_and_known_hosts(tmp_path, ssh_keys, servers):
    node = servers("node")
    config = _config(tmp_path, f"Host board-7\n  HostName 127.0.0.1\n  Port {node.port}\n  User {login_user()}\n"
                     f"  IdentityFile {ssh_keys.client_key}\n  UserKnownHostsFile {ssh_keys.known_hosts}\n"
                     "  ConnectTimeout 4\n")  # fmt: skip
    path = _inventory(tmp_path, f"defaults: {{ssh: {{config: {config}}}, sudo: false}}\n"
                      "nodes:\n  - {name: b7, kind: server, model: loopback, address: board-7}\n")  # fmt: skip
    inventory = load_inventory(path)
    target = inventory.ssh_target(inventory.node("b7"))
    assert (target.host, target.port, target.user, target.alias) == ("127.0.0.1", node.port, login_user(), "board-7")
    assert (target.identity_files, target.known_hosts, target.connect_timeout_s) == (
        (str(ssh_keys.client_key),), str(ssh_keys.known_hosts), 4.0)  # fmt: skip
    with open_transport(inventory, inventory.node("b7")) as t:
        assert t.run(["echo", "reached"]).stdout == "reached\n"


def test_the_inventory_wins_over_the_ssh_config(tmp_path, ssh_keys):
    config = _config(tmp_path, "Host board-*\n  User nvidia\n  Port 2200\n  ProxyJump gate\n")
    path = _inventory(tmp_path, f"defaults: {{ssh: {{config: {config}, user: lab}}}}\ngroups:\n"
                      "  far: {members: [board-2], ssh: {port: 2222, jump: none}}\nnodes:\n"
                      "  - {name: board-1, kind: server, model: x, address: board-1}\n"
                      "  - {name: board-2, kind: server, model: x, address: board-2, ssh: {user: root}}\n")  # fmt: skip
    inventory = load_inventory(path)
    one, two = (inventory.ssh_target(inventory.node(n)) for n in ("board-1", "board-2"))
    assert (one.user, one.port, [h.host for h in one.jumps]) == ("lab", 2200, ["gate"])
    assert (two.user, two.port, two.jumps) == ("root", 2222, ())  # the node's, the group's, none


def test_emulated_nodes_read_no_ssh_config_unless_one_is_named(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host *\n  ProxyJump somewhere\n  User stranger\n")
    monkeypatch.setenv("HOME", str(home))
    body = ("nodes:\n  - {name: real, kind: server, model: x, address: 10.9.0.1}\n"
            "  - {name: emu, kind: server, model: x, emulated: {}}\n")  # fmt: skip
    inventory = load_inventory(_inventory(tmp_path, body))
    real = inventory.ssh_target(inventory.node("real"))
    assert (real.user, [h.host for h in real.jumps]) == ("stranger", ["somewhere"])
    emu = inventory.node("emu").model_copy(update={"address": "10.9.0.2"})
    assert inventory.ssh_target(emu).jumps == ()


def test_proxycommand_is_refused_and_a_missing_named_config_is_an_input_error(tmp_path):
    config = _config(tmp_path, "Host b\n  ProxyCommand nc %h %p\n")
    inventory = load_inventory(_inventory(tmp_path, f"defaults: {{ssh: {{config: {config}}}}}\n"
                                          "nodes:\n  - {name: b, kind: server, model: x, address: b}\n"))  # fmt: skip
    with pytest.raises(TestbedError, match=r"ProxyCommand.*ProxyJump"):
        inventory.ssh_target(inventory.node("b"))
    with pytest.raises(InputError, match=r"inventory.yaml:1: defaults.ssh.config: no SSH config at /nowhere/config"):
        load_inventory(_inventory(tmp_path, "defaults: {ssh: {config: /nowhere/config}}\n"
                                  "nodes:\n  - {name: b, kind: server, model: x, address: b}\n"))  # fmt: skip


def _jump_inventory(tmp_path: Path, ssh_keys: SshKeys, bastion: SshdServer, nodes: dict[str, SshdServer]) -> Path:
    lines = [f"Host bastion\n  HostName 127.0.0.1\n  Port {bastion.port}\n  IdentityFile {ssh_keys.client_key}\n"]
    for name, server in nodes.items():
        lines.append(f"Host {name}\n  HostName 127.0.0.1\n  Port {server.port}\n  ProxyJump bastion\n")
    config = _config(tmp_path, "".join(lines))
    body = (f"defaults:\n  sudo: false\n  ssh: {{config: {config}, user: {login_user()}, identity_file: "
            f"{ssh_keys.client_key}, known_hosts: {ssh_keys.known_hosts}, connect_timeout: 4s}}\nnodes:\n")
    body += "".join(f"  - {{name: {n}, kind: server, model: x, address: {n}}}\n" for n in nodes)
    return _inventory(tmp_path, body)


def test_nodes_behind_a_jump_host_are_reached_through_it_on_one_shared_connection(tmp_path, ssh_keys, servers):
    bastion = servers("bastion", "AllowTcpForwarding yes")
    nodes = {"n1": servers("n1"), "n2": servers("n2")}
    inventory = load_inventory(_jump_inventory(tmp_path, ssh_keys, bastion, nodes))
    transports = [open_transport(inventory, inventory.node(n)) for n in nodes]
    try:
        for t in transports:
            assert t.run(["echo", t.node]).stdout == f"{t.node}\n"
        for server in nodes.values():  # the node's sshd was connected to by the bastion's sshd, not by us
            assert "sshd" in _peer_process(server.port) and "python" not in _peer_process(server.port)
        ours = [line for line in _peer_process(bastion.port).splitlines() if line.strip()]
        assert len(ours) == 1, f"one connection to the bastion serves both nodes: {ours}"
        assert isinstance(transports[0], SshTransport) and transports[0].target.describe().endswith(
            f"via {login_user()}@127.0.0.1:{bastion.port}")  # fmt: skip
    finally:
        for t in transports:
            t.close()


def test_nodes_connecting_and_closing_at_once_keep_the_one_connection_to_the_bastion(tmp_path, ssh_keys, servers):
    from testbed.transport.fanout import fan_out
    from testbed.transport.ssh import close_jump_hosts

    bastion = servers("bastion", "AllowTcpForwarding yes")
    nodes = {f"n{i}": servers(f"n{i}") for i in range(4)}
    inventory = load_inventory(_jump_inventory(tmp_path, ssh_keys, bastion, nodes))

    def session(name: str) -> str:
        with open_transport(inventory, inventory.node(name)) as t:
            return "".join(t.run(["echo", str(i)], timeout_s=30).check().stdout for i in range(3))

    try:
        assert session("n0") == "0\n1\n2\n"
        first = _peer_process(bastion.port).split()[3]  # our end of the one connection to the bastion
        failed = []
        for _ in range(8):
            failed += [(o.node, o.error) for o in fan_out(list(nodes), session, description="sessions").failed]
        assert failed == []
        assert _peer_process(bastion.port).split()[3] == first, "the connection to the bastion was opened again"
    finally:
        close_jump_hosts()


def test_a_node_stream_through_a_bastion_closes_only_after_a_write_in_progress():
    """paramiko's channel sends a write's packet after releasing its lock, so a close from another thread
    could go out first; OpenSSH then drops the bastion's whole connection ("data packet referred to
    nonexistent channel"): on the emulated bastion lab about one round of four nodes in twenty failed.
    The stream a node's connection runs in orders them. (A recording channel makes the interleaving
    certain; the bastion lab's demo, tests/test_restricted_sudo.py, is the same path end to end.)"""
    import threading

    from testbed.transport.jump_hosts import JumpStream

    events: list[str] = []
    sending = threading.Event()

    class Channel:
        def send(self, data: bytes) -> int:
            sending.set()
            time.sleep(0.2)  # between paramiko building the DATA packet and sending it
            events.append("data")
            return len(data)

        def close(self) -> None:
            events.append("close")

        def recv(self, n: int) -> bytes:
            return b"x" * n

    stream = JumpStream(Channel())  # type: ignore[arg-type]
    writer = threading.Thread(target=stream.send, args=(b"packet",))
    writer.start()
    assert sending.wait(5)
    stream.close()
    writer.join()
    assert events == ["data", "close"]
    assert stream.recv(2) == b"xx"  # everything else is the channel's


def test_a_chain_of_jump_hosts(tmp_path, ssh_keys, servers):
    outer, inner, node = servers("outer", "AllowTcpForwarding yes"), servers("inner", "AllowTcpForwarding yes"), \
        servers("deep")  # fmt: skip
    config = _config(tmp_path, f"Host outer\n  HostName 127.0.0.1\n  Port {outer.port}\n"
                     f"Host inner\n  HostName 127.0.0.1\n  Port {inner.port}\n"
                     f"Host deep\n  HostName 127.0.0.1\n  Port {node.port}\n  ProxyJump outer,inner\n"
                     f"Host *\n  IdentityFile {ssh_keys.client_key}\n")  # fmt: skip
    path = _inventory(tmp_path, f"defaults: {{sudo: false, ssh: {{config: {config}, known_hosts: "
                      f"{ssh_keys.known_hosts}, user: {login_user()}}}}}\n"
                      "nodes:\n  - {name: deep, kind: server, model: x, address: deep}\n")  # fmt: skip
    inventory = load_inventory(path)
    target = inventory.ssh_target(inventory.node("deep"))
    assert [h.port for h in target.jumps] == [outer.port, inner.port]
    assert [h.port for h in target.jumps[1].jumps] == [outer.port]
    with open_transport(inventory, inventory.node("deep")) as t:
        assert t.run(["echo", "deep"]).stdout == "deep\n"
        assert "sshd" in _peer_process(node.port) and "sshd" in _peer_process(inner.port)


def test_a_jump_host_that_forwards_nothing_is_named_with_the_fix(tmp_path, ssh_keys, servers):
    bastion = servers("closed", "AllowTcpForwarding no")
    inventory = load_inventory(_jump_inventory(tmp_path, ssh_keys, bastion, {"n1": servers("n1")}))
    started = time.monotonic()
    with pytest.raises(NodeError, match=r"jump host .*127.0.0.1:\d+ cannot open a channel.*AllowTcpForwarding"), \
            open_transport(inventory, inventory.node("n1")) as t:  # fmt: skip
        t.run(["true"])
    assert time.monotonic() - started < 60, "a refused channel is said at once, not retried into a hang"


def _certify(tmp_path: Path, ca: Path, host_key: Path, *, principals: str, validity: str = "+1d",
             kind: str = "-h") -> Path:  # fmt: skip
    args = ["ssh-keygen", "-q", "-s", str(ca), "-I", "node-cert", "-n", principals, "-V", validity]
    subprocess.run(args + ([kind] if kind else []) + [str(host_key.with_suffix(".pub"))], check=True,
                   capture_output=True)  # fmt: skip
    return host_key.parent / (host_key.name + "-cert.pub")


def _ca(tmp_path: Path, name: str = "ca") -> Path:
    ca = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ca)], check=True)
    return ca


def _host_key(tmp_path: Path, name: str) -> Path:
    key = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key


def test_a_host_certificate_from_a_listed_ca_is_trusted_without_the_nodes_own_key(tmp_path, ssh_keys, servers):
    ca, key = _ca(tmp_path), _host_key(tmp_path, "board_host_key")
    cert = _certify(tmp_path, ca, key, principals="127.0.0.1,board-7")
    server = servers("certified", f"HostCertificate {cert}", host_key=key)
    known = tmp_path / "known_hosts_ca"
    known.write_text("@cert-authority [127.0.0.1]:*,board-* " + " ".join(ca.with_suffix(".pub").read_text().split()[:2])
                     + "\n")  # fmt: skip
    body = (f"defaults: {{sudo: false, ssh: {{user: {login_user()}, identity_file: {ssh_keys.client_key}, "
            f"known_hosts: {known}, port: {server.port}}}}}\n"
            "nodes:\n  - {name: b, kind: server, model: x, address: 127.0.0.1}\n")
    inventory = load_inventory(_inventory(tmp_path, body))
    with open_transport(inventory, inventory.node("b")) as t:
        assert t.run(["echo", "certified"]).stdout == "certified\n"
    assert known.read_text().count("\n") == 1, "nothing is added to known_hosts"

    other_ca = _ca(tmp_path, "other_ca")  # the same node, its CA no longer listed: refused, with the fix
    known.write_text("@cert-authority * " + " ".join(other_ca.with_suffix(".pub").read_text().split()[:2]) + "\n")
    with pytest.raises(NodeError, match=r"refusing to connect .*signed by a CA that .* does not list"), \
            open_transport(inventory, inventory.node("b")) as t:  # fmt: skip
        t.run(["true"])
    known.write_text("")  # nothing listed: the plain refusal, which names ssh-keyscan and @cert-authority
    with pytest.raises(NodeError, match=r"not in .*ssh-keyscan.*@cert-authority"), \
            open_transport(inventory, inventory.node("b")) as t:  # fmt: skip
        t.run(["true"])


def test_certificates_that_do_not_hold_are_refused(tmp_path):
    ca, key = _ca(tmp_path), _host_key(tmp_path, "k")
    line = "@cert-authority * " + " ".join(ca.with_suffix(".pub").read_text().split()[:2]) + "\n"
    known_path = tmp_path / "kh"
    known_path.write_text(line)

    def blob(cert: Path) -> bytes:
        import base64

        return base64.b64decode(cert.read_text().split()[1])

    good = blob(_certify(tmp_path, ca, key, principals="10.0.0.5"))
    known = KnownHosts(known_path)
    assert certificate_problem(known, "10.0.0.5", good) is None
    assert "is for 10.0.0.5, not 10.0.0.6" in certificate_problem(known, "10.0.0.6", good)
    assert "not valid now" in certificate_problem(known, "10.0.0.5", good, now_s=time.time() + 3 * 86400)
    user = blob(_certify(tmp_path, ca, key, principals="10.0.0.5", kind=""))
    assert "user certificate" in certificate_problem(known, "10.0.0.5", user)
    tampered = bytearray(good)
    tampered[-5] ^= 0xFF
    assert "signature" in certificate_problem(known, "10.0.0.5", bytes(tampered))
    known_path.write_text(line + "@revoked * " + " ".join(ca.with_suffix(".pub").read_text().split()[:2]) + "\n")
    assert "@revoked" in certificate_problem(KnownHosts(known_path), "10.0.0.5", good)
    known_path.write_text("@cert-authority !10.0.0.5,10.0.0.* " + line.split(" ", 2)[2])
    assert "does not list" in certificate_problem(KnownHosts(known_path), "10.0.0.5", good)


def test_hydra_reaches_the_nodes_with_the_inventorys_users_and_ports_then_the_servers_own_config(tmp_path):
    from testbed.commands.launch_ssh import hydra_ssh

    config = _config(tmp_path, "Host board-*\n  HostName 10.50.1.7\n  Port 2201\n")
    path = _inventory(tmp_path, f"defaults: {{ssh: {{config: {config}, user: nvidia}}}}\ngroups:\n"
                      "  gpus: {members: [gpu], ssh: {user: lab, node_config: /etc/hil/ssh_config}}\nnodes:\n"
                      "  - {name: gpu, kind: server, model: x, address: 10.50.0.2}\n"
                      "  - {name: b1, kind: jetson, model: agx-orin, address: board-1}\n")  # fmt: skip
    inventory = load_inventory(path)
    ssh = hydra_ssh(inventory, inventory.node("gpu"), inventory.nodes, "/home/lab/hil-testbed/mpi")
    assert ssh.config.splitlines()[1:] == [
        "Host 10.50.0.2", "  User lab", "  Port 22",
        "Host board-1", "  HostName 10.50.1.7", "  User nvidia", "  Port 2201",
        "Host *", "  BatchMode yes", "  StrictHostKeyChecking yes", "  ConnectTimeout 10",
        "Include /etc/hil/ssh_config",
    ]  # fmt: skip
    assert ssh.launcher_path.startswith("/home/lab/hil-testbed/mpi/ssh-") and ssh.config_path in ssh.launcher()
