"""The transport contract, run against a real sshd on 127.0.0.1 and against the local transport."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import paramiko
import pytest

from foundation.errors import NodeError
from testbed.emulation.sshd_server import SshdServer, SshKeys, login_user
from testbed.inventory import SshTarget
from testbed.transport import CommandFailed, LocalTransport, SshTransport, Transport
from tests.waiting import HANG_S, wait_until

# No bound here depends on this machine's speed: a wait for an event is bounded by HANG_S (it
# fails only on a hang), and "it did not wait for X" is said against X's own length (LONG_S).
LONG_S = 600  # a command or child that would hold a call this long if it were waited for


def ssh_target(keys: SshKeys, port: int, **changes: object) -> SshTarget:
    fields: dict[str, object] = dict(
        host="127.0.0.1",
        port=port,
        user=login_user(),
        identity_file=str(keys.client_key),
        known_hosts=str(keys.known_hosts),
        password_env=None,
        connect_timeout_s=3.0,
        keepalive_s=15.0,
    )
    fields.update(changes)
    return SshTarget(**fields)  # type: ignore[arg-type]


@pytest.fixture(params=["ssh", "local"])
def transport(request, ssh_keys):
    if request.param == "ssh":
        server = SshdServer(ssh_keys).start()
        t: Transport = SshTransport("node-a", ssh_target(ssh_keys, server.port), use_sudo=False)
    else:
        server = None
        t = LocalTransport("node-a")
    yield t
    t.close()
    if server is not None:
        server.stop()


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_command_output_and_exit_codes(transport):
    result = transport.run(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.ok and not result.timed_out and result.duration_s > 0
    with pytest.raises(CommandFailed, match="exited with status 3"):
        result.check()
    assert transport.run(["true"]).check().exit_code == 0


def test_arguments_are_never_interpreted_by_a_shell(transport, tmp_path):
    marker = tmp_path / "pwned"
    tricky = f"$(touch {marker}); `touch {marker}` ; touch {marker} && echo '\"quoted\"' * ~"
    result = transport.run(["printf", "%s", tricky]).check()
    assert result.stdout == tricky
    assert not marker.exists()


def test_env_cwd_and_stdin(transport, tmp_path):
    result = transport.run(
        ["sh", "-c", 'pwd; echo "$GREETING"; cat'],
        env={"GREETING": "hello world; $HOME"},
        cwd=str(tmp_path),
        stdin=b"from stdin\n",
    ).check()
    assert result.stdout.splitlines() == [str(tmp_path), "hello world; $HOME", "from stdin"]
    assert transport.run(["pwd"], cwd=str(tmp_path / "missing")).exit_code == 125


def test_timeout_kills_the_command_and_its_children(transport, tmp_path):
    pids = tmp_path / "pids"
    # connected first (the SSH transport's timeout counts the connecting), and a timeout long enough for a
    # loaded machine's shell to print its pid line and write its pids: a command timed out before then is
    # left running, or has no pids to check
    transport.run(["true"]).check()
    started = time.monotonic()
    command = f"sleep {LONG_S} & echo $! > {pids}; echo $$ >> {pids}; sleep {LONG_S}"
    result = transport.run(["sh", "-c", command], timeout_s=3.0)
    assert result.timed_out and result.exit_code is None and not result.ok
    assert time.monotonic() - started < LONG_S / 10
    with pytest.raises(CommandFailed, match="timed out"):
        result.check()
    recorded = [int(p) for p in pids.read_text().split()]
    wait_until(lambda: not any(pid_alive(p) for p in recorded), "the timed-out command's processes to end")


def test_put_and_get(transport, tmp_path):
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(300_000))
    remote = str(tmp_path / "on-node" / "copy.bin")
    transport.run(["mkdir", "-p", str(tmp_path / "on-node")]).check()
    transport.put(source, remote, mode=0o600)
    assert Path(remote).read_bytes() == source.read_bytes()
    assert Path(remote).stat().st_mode & 0o777 == 0o600
    back = tmp_path / "back" / "copy.bin"
    transport.get(remote, back)
    assert back.read_bytes() == source.read_bytes()


def test_background_start_stop(transport, tmp_path):
    pidfile, logfile = str(tmp_path / "run" / "w.pid"), str(tmp_path / "run" / "w.log")
    proc = transport.start_background(["sh", "-c", "echo started; exec sleep 300"], pidfile=pidfile, logfile=logfile)
    assert pid_alive(proc.pid)
    with pytest.raises(CommandFailed, match="already running"):
        transport.start_background(["sleep", "300"], pidfile=pidfile, logfile=logfile)
    wait_until(lambda: "started" in Path(logfile).read_text(), "its 'started' line")
    assert transport.stop_background(pidfile) == "stopped"
    assert not pid_alive(proc.pid) and not Path(pidfile).exists()
    assert transport.stop_background(pidfile) == "absent"


def test_background_stop_escalates_to_kill(transport, tmp_path):
    pidfile, logfile = str(tmp_path / "t.pid"), str(tmp_path / "t.log")
    proc = transport.start_background(
        ["sh", "-c", "trap '' TERM; echo trapped; while :; do sleep 0.1; done"], pidfile=pidfile, logfile=logfile
    )
    wait_until(lambda: "trapped" in Path(logfile).read_text(), "its trap")  # a TERM before its trap would end it
    assert transport.stop_background(pidfile, grace_s=0.5) == "killed"
    assert not pid_alive(proc.pid)


def test_stale_pidfile_never_signals_a_stranger(transport, tmp_path):
    pidfile = tmp_path / "stale.pid"
    pidfile.write_text(f"{os.getpid()} 1\n")  # our own pid with a start time that is not ours
    assert transport.stop_background(str(pidfile)) == "stale"
    assert pid_alive(os.getpid()) and not pidfile.exists()


def test_the_timeout_kill_leaves_a_process_that_took_the_timed_out_shells_pid_alone(ssh_keys, tmp_path):
    """A timed-out command's group is found from the pid its shell printed; should that shell be gone
    and its pid reused by another session's leader, the kill must not touch that group."""
    server = SshdServer(ssh_keys).start()
    t = SshTransport("node-a", ssh_target(ssh_keys, server.port), use_sudo=False)
    stranger = subprocess.Popen(["sleep", str(LONG_S)], start_new_session=True)
    try:
        started = Path(f"/proc/{stranger.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        t._kill_group(stranger.pid, str(int(started) + 1))  # the pid as another process's
        assert pid_alive(stranger.pid)
        t._kill_group(stranger.pid, started)  # the pid as the shell it is
        wait_until(lambda: not pid_alive(stranger.pid), "the shell's own group to be killed")
    finally:
        stranger.kill()
        stranger.wait()
        t.close()
        server.stop()


def test_line_session_round_trips(transport):
    with transport.open_line_session(["sh", "-c", 'while read -r x; do echo "got $x"; done']) as session:
        for word in ("a", "b c"):
            session.send_line(word)
            assert session.read_line(HANG_S) == f"got {word}"


def test_unknown_host_key_is_refused(ssh_keys, tmp_path):
    server = SshdServer(ssh_keys).start()
    try:
        empty = tmp_path / "empty_known_hosts"
        empty.touch()
        t = SshTransport("n", ssh_target(ssh_keys, server.port, known_hosts=str(empty)), use_sudo=False)
        with pytest.raises(NodeError, match=r"not in .*refusing to connect.*ssh-keyscan"):
            t.run(["true"])
        assert empty.read_text() == "", "the unknown key must not be added"
    finally:
        server.stop()


def test_changed_host_key_is_refused(ssh_keys, tmp_path):
    server = SshdServer(ssh_keys).start()
    try:
        other = paramiko.Ed25519Key.from_private_key_file(str(SshKeys.create(tmp_path / "other").host_key))
        wrong = tmp_path / "wrong_known_hosts"
        wrong.write_text(f"[127.0.0.1]:{server.port} ssh-ed25519 {other.get_base64()}\n")
        t = SshTransport("n", ssh_target(ssh_keys, server.port, known_hosts=str(wrong)), use_sudo=False)
        with pytest.raises(NodeError, match="CHANGED"):
            t.run(["true"])
    finally:
        server.stop()


def test_wrong_client_key_fails_authentication(ssh_keys, tmp_path):
    server = SshdServer(ssh_keys).start()
    try:
        stranger = SshKeys.create(tmp_path / "stranger").client_key
        t = SshTransport("n", ssh_target(ssh_keys, server.port, identity_file=str(stranger)), use_sudo=False)
        with pytest.raises(NodeError, match="authentication failed"):
            t.run(["true"])
    finally:
        server.stop()


def test_unreachable_node_fails_after_retries(ssh_keys):
    from testbed.emulation.sshd_server import free_port

    t = SshTransport("n", ssh_target(ssh_keys, free_port(), connect_timeout_s=1.0), use_sudo=False)
    started = time.monotonic()
    with pytest.raises(NodeError, match=r"cannot connect .* after 3 attempts"):
        t.run(["true"])
    assert time.monotonic() - started >= 1.4  # backed off 0.5 s then 1 s


def test_one_connection_serves_concurrent_commands(ssh_keys):
    from concurrent.futures import ThreadPoolExecutor

    with SshdServer(ssh_keys) as server:
        t = SshTransport("n", ssh_target(ssh_keys, server.port), use_sudo=False)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: t.run(["echo", str(i)]).check().stdout.strip(), range(16)))
        assert results == [str(i) for i in range(16)]
        t.close()


def test_sudo_prefix_only_when_the_node_uses_sudo(ssh_keys):
    plain = LocalTransport("n", use_sudo=False)
    assert plain.run(["id", "-u"], sudo=True).check().stdout.strip() == str(os.getuid())
    target = ssh_target(ssh_keys, 22, user="root")
    assert not SshTransport("n", target, use_sudo=True).use_sudo, "root needs no sudo"


def test_command_line_quotes_every_word():
    from testbed.transport.base import command_line

    line = command_line(
        ["tc", "qdisc", "show", "dev", "eth0; reboot"], sudo=True, env={"LC_ALL": "C x"}, cwd="~/hil testbed"
    )
    assert line == (
        "cd \"$HOME\"/'hil testbed' || exit 125; exec sudo -n -- env 'LC_ALL=C x' tc qdisc show dev 'eth0; reboot'"
    )
    with pytest.raises(ValueError, match="environment variable names"):
        command_line(["true"], env={"A;B": "x"})


def test_line_session_that_ignores_eof_is_ended_on_close(transport, tmp_path):
    pidfile = tmp_path / "pid"
    session = transport.open_line_session(["sh", "-c", f"echo $$ > {pidfile}; trap '' HUP; exec sleep 300"])
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip() != "", "the session's pid file")
    pid = int(pidfile.read_text())
    assert pid_alive(pid)
    session.close()
    wait_until(lambda: not pid_alive(pid), "the line session's command to end on close")


def test_timeout_holds_while_feeding_stdin_to_a_command_that_never_reads_it(transport):
    started = time.monotonic()
    result = transport.run(["sleep", str(LONG_S)], stdin=b"x" * (4 << 20), timeout_s=2.0)
    assert result.timed_out and time.monotonic() - started < LONG_S / 10


def test_large_stdin_reaches_the_command(transport):
    data = os.urandom(3 << 20)
    result = transport.run(["sh", "-c", "wc -c"], stdin=data).check()
    assert int(result.stdout.strip()) == len(data)


def test_a_child_left_holding_stdout_does_not_hang_the_call(transport, tmp_path):
    pidfile = tmp_path / "child"
    started = time.monotonic()
    result = transport.run(["sh", "-c", f"sleep {LONG_S} & echo $! > {pidfile}; echo done"], timeout_s=LONG_S * 2)
    assert result.ok and result.stdout.startswith("done") and time.monotonic() - started < LONG_S / 10
    os.kill(int(pidfile.read_text()), 9)  # the test's own leftover, by its pid


def test_put_creates_directories_and_sets_mode_before_writing(transport, tmp_path):
    source = tmp_path / "secret.key"
    source.write_bytes(b"k" * 1000)
    remote = tmp_path / "deep" / "er" / "secret.key"
    transport.put(source, str(remote), mode=0o600)
    assert remote.read_bytes() == source.read_bytes() and remote.stat().st_mode & 0o777 == 0o600
    with pytest.raises(NodeError, match="cannot copy"):
        transport.get(str(tmp_path / "missing"), tmp_path / "out")


def test_concurrent_starts_on_one_pidfile_start_one_process(transport, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    pidfile, logfile = str(tmp_path / "one.pid"), str(tmp_path / "one.log")

    def start(_: int) -> int | None:
        try:
            return transport.start_background(["sleep", "300"], pidfile=pidfile, logfile=logfile).pid
        except CommandFailed:
            return None

    with ThreadPoolExecutor(4) as pool:
        pids = [p for p in pool.map(start, range(4)) if p is not None]
    assert len(pids) == 1, pids
    assert transport.stop_background(pidfile) == "stopped" and not pid_alive(pids[0])


def test_background_paths_must_be_absolute(transport):
    with pytest.raises(ValueError, match="absolute"):
        transport.start_background(["true"], pidfile="run/x.pid", logfile="/tmp/x.log")


def test_store_keeps_nothing_under_the_name_when_the_bytes_did_not_all_arrive(tmp_path: Path) -> None:
    from testbed.transport.base import store_script

    target = tmp_path / "deep" / "journal.json"
    cut = subprocess.run(["sh", "-c", store_script(str(target), 10)], input=b"12345", capture_output=True, check=False)
    assert cut.returncode == 1 and b"incomplete: 5 of 10 bytes" in cut.stderr
    assert not target.exists() and list(target.parent.iterdir()) == []
    whole = subprocess.run(["sh", "-c", store_script(str(target), 5)], input=b"12345", capture_output=True, check=False)
    assert whole.returncode == 0 and target.read_bytes() == b"12345"
