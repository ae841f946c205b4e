"""Shared fixtures: real sshd servers on 127.0.0.1 with generated keys, and inventories for them."""

from __future__ import annotations

import fcntl
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from nodes.emulated.cgroup import CpuCgroup
from testbed.emulation.host import process_start_ticks
from testbed.emulation.sshd_server import SshdServer, SshKeys, loopback_inventory_yaml

REPO = Path(__file__).resolve().parent.parent
# Every emulated lab a test brings up is listed here until it is taken down: a file naming its inventory,
# held under an exclusive flock by the process that brought the lab up. A process that dies without its
# teardown (SIGKILL, a crashed test worker) loses its lock with it, so a later session can tell a lab
# left behind from one in use by a session beside it (another test worker) without trusting pids, and
# takes the left one down from its own journals.
LAB_REGISTRY = Path(tempfile.gettempdir()) / "hil-testbed-test-labs"


@pytest.fixture
def ssh_keys(tmp_path: Path) -> SshKeys:
    return SshKeys.create(tmp_path / "keys")


@pytest.fixture
def sshd_factory(ssh_keys: SshKeys) -> Iterator[Callable[..., SshdServer]]:
    """Start as many real sshd processes as a test needs; all are stopped at the end."""
    servers: list[SshdServer] = []

    def start(environment: dict[str, str] | None = None) -> SshdServer:
        name = f"sshd{len(servers)}"
        home = {"HOME": str(ssh_keys.directory / f"home-{name}")}  # a node's own home, as on a real node
        server = SshdServer(ssh_keys, name=name, environment={**home, **(environment or {})}).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def sshd(sshd_factory: Callable[..., SshdServer]) -> SshdServer:
    return sshd_factory()


def inventory_text(keys: SshKeys, nodes: list[tuple[str, int]], extra_nodes: str = "") -> str:
    """An inventory of server nodes reached on 127.0.0.1 at the given ports."""
    return loopback_inventory_yaml(keys, nodes, python=sys.executable, extra_nodes=extra_nodes)


def run_cli(*args: str, cwd: Path | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real ``testbed`` command line in a subprocess."""
    return subprocess.run(
        [sys.executable, "-m", "testbed", *args],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        timeout=timeout_s,
        check=False,
    )


DEFAULT_INVENTORY = (REPO / "inventory.yaml").read_text()


def json_log_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines log (a request log, the engine's) as its writer has finished them: its "# "
    header left out, and a last line still being written (no newline yet), so a test polling it never
    reads half a row."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1] if line and not line.startswith("#")]


def command_log_of(out: Path) -> Path:
    """Where :func:`run_campaign` keeps the command log of a campaign run into ``out``."""
    return out.with_name(out.name + ".commands.jsonl")


def run_campaign(
    campaign: Path, out: Path, *, timeout_s: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``testbed run CAMPAIGN --out OUT`` in a subprocess, every command it sends to a node recorded
    in ``OUT.commands.jsonl`` (the transports' command log): :func:`assert_sent_as_planned` reads it."""
    from testbed.transport.command_log import ENV_VARIABLE

    log = command_log_of(out)
    return subprocess.run([sys.executable, "-m", "testbed", "run", str(campaign), "--out", str(out)], cwd=REPO,
                          env={**os.environ, **(env or {}), ENV_VARIABLE: str(log)}, capture_output=True, text=True,
                          timeout=timeout_s, check=False)  # fmt: skip


def assert_sent_as_planned(out: Path) -> int:
    """The plans are what ran: every shell line the campaign of :func:`run_campaign` sent to a node is
    a line of one of its runs' ``plan.json`` (made when the run started, from the nodes as they were),
    and every line a plan sends unconditionally (``once``, ``per-campaign``) was sent. The lines sent."""
    from testbed.commands.planned import normalised_line
    from testbed.transport.command_log import read

    planned: dict[tuple[str, str], list[dict]] = {}
    plans = sorted(out.glob("runs/*/plan.json"))
    assert plans, f"no run of {out} wrote its plan"
    for path in plans:
        for c in json.loads(path.read_text())["commands"]:
            planned.setdefault((c["host"], normalised_line(c["line"])), []).append(c)
    sent = [(e["node"], normalised_line(e["line"])) for e in read(command_log_of(out))]
    unplanned = list(dict.fromkeys(s for s in sent if s not in planned))
    assert not unplanned, "sent but in no run's plan:\n" + "\n".join(f"{n}: {line[:300]}" for n, line in unplanned)
    once = {k for k, cs in planned.items() if any(c["when"] in ("once", "per-campaign") for c in cs)}
    missing = once - set(sent)
    assert not missing, "planned but never sent:\n" + "\n".join(f"{n}: {line[:300]}" for n, line in missing)
    return len(sent)


# Test files run side by side (pytest-xdist, `make test`): a lab's name prefix and its two subnets
# (10.<octet>.0.0/24 and 10.<octet + 1>.0.0/24) must be one test file's own, or two workers would build
# the same bridges and namespaces at once. Each use is claimed here for the whole test run (all its
# workers), so a clash fails at once, naming both files, instead of as a flaky network.
CLAIMS = Path(tempfile.gettempdir()) / "hil-testbed-test-claims"


def claim_lab_names(prefix: str, subnet_octet: int) -> None:
    """Claim ``prefix`` and the two subnets for the calling test file, for this test run."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"{os.getpid()}-{process_start_ticks(os.getpid())}"
    caller = next((Path(f.filename).name for f in inspect.stack()[1:] if Path(f.filename).name.startswith("test_")),
                  None)  # fmt: skip
    if caller is None:
        return  # a bench or a script: not run beside the tests
    directory = CLAIMS / run
    directory.mkdir(parents=True, exist_ok=True)
    for name in (f"prefix-{prefix}", f"subnet-{subnet_octet}", f"subnet-{subnet_octet + 1}"):
        path = directory / name
        try:
            with open(path, "x") as f:
                f.write(caller)
        except FileExistsError:
            owner = path.read_text()
            assert owner in ("", caller), (f"{caller} uses the lab {name} that {owner} uses: give the labs of each "
                                           "test file a name prefix and subnets of their own (tests/conftest.py)")  # fmt: skip


def emulated_inventory(directory: Path, prefix: str, subnet_octet: int, nodes_yaml: str | None = None) -> Path:
    """The default inventory (or ``nodes_yaml``) under its own prefix, subnets and state directory."""
    claim_lab_names(prefix, subnet_octet)
    text = DEFAULT_INVENTORY
    text = text.replace("10.231.0.0/24", f"10.{subnet_octet}.0.0/24").replace(
        "10.232.0.0/24", f"10.{subnet_octet + 1}.0.0/24"
    )
    text = text.replace("name_prefix: tb", f"name_prefix: {prefix}\n  state_dir: {directory / 'state'}")
    if nodes_yaml is not None:
        text = text[: text.index("nodes:")] + nodes_yaml
    path = directory / "inventory.yaml"
    path.write_text(text)
    return path


def _take_down(path: Path) -> subprocess.CompletedProcess[str]:
    """Undo ``path``'s links and power modes from the nodes' journals, then take its testbed down
    (each step is a no-op when nothing changed)."""
    run_cli("link", "clear", "-i", str(path))
    run_cli("power", "restore", "-i", str(path))
    return run_cli("emulate", "down", "-i", str(path))


def _take_down_left_labs() -> None:
    """Take down every lab in LAB_REGISTRY whose holder is gone (its flock free); labs in use are left."""
    for entry in sorted(LAB_REGISTRY.iterdir()):
        try:
            fd = os.open(entry, os.O_RDONLY)
        except FileNotFoundError:
            continue  # taken down by another session just now
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its session is alive, or another session is taking it down
            try:
                if os.fstat(fd).st_ino != entry.stat().st_ino:
                    continue
            except FileNotFoundError:
                continue  # taken down (and unlinked) by another session before the lock was ours
            if entry.name.startswith("."):  # being named, or its holder died before bringing its lab up
                if time.time() - os.fstat(fd).st_mtime > 60:
                    entry.unlink(missing_ok=True)
                continue
            path = Path(os.read(fd, 65536).decode())
            if path.exists():
                down = _take_down(path)
                assert down.returncode == 0, f"a lab left by a killed test session: {down.stdout}{down.stderr}"
            entry.unlink(missing_ok=True)
        finally:
            os.close(fd)


@pytest.fixture(scope="session", autouse=True)
def labs_of_killed_sessions_taken_down() -> None:
    """Labs that a killed earlier test session left up, taken down before this session's tests."""
    for old in CLAIMS.glob("*") if CLAIMS.is_dir() else ():
        if time.time() - old.stat().st_mtime > 86400:  # claims of test runs long over
            shutil.rmtree(old, ignore_errors=True)
    if os.geteuid() == 0 and LAB_REGISTRY.is_dir():
        _take_down_left_labs()


@contextmanager
def emulated_lab(path: Path) -> Iterator[Path]:
    """``path``'s emulated testbed, up for the block, then taken down (links and power undone first).
    Listed in LAB_REGISTRY, under this process's lock, while it may exist, so that a later session can
    take it down if this one dies."""
    LAB_REGISTRY.mkdir(parents=True, exist_ok=True)
    name = uuid.uuid4().hex
    writing = LAB_REGISTRY / f".{name}"
    fd = os.open(writing, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # not inherited by run_cli's children
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # before the entry has its name: no one sees it unlocked
        os.write(fd, str(path).encode())
        entry = LAB_REGISTRY / name
        os.rename(writing, entry)
        up = run_cli("emulate", "up", "-i", str(path))
        try:
            assert up.returncode == 0, up.stdout + up.stderr
            yield path
        finally:
            down = _take_down(path)
            assert down.returncode == 0, down.stdout + down.stderr
            entry.unlink()
    finally:
        os.close(fd)


@contextmanager
def server_and_jetson_lab(directory: Path, prefix: str, octet: int) -> Iterator[Any]:
    """bench/kill_trials.py's lab (a server and a Jetson, rate-shaped both ways) up in ``directory`` for
    the block, as a ``Lab``."""
    from bench.kill_trials import Lab, inventory_text

    path = directory / "inventory.yaml"
    path.write_text(inventory_text(directory / "state", prefix, octet))
    with emulated_lab(path):
        yield Lab(path, prefix)


def veth_bytes(proc_net_dev: str) -> dict[str, int]:
    """rx+tx bytes of an emulated node's data0 and mgmt0, from its /proc/net/dev."""
    out = {}
    for line in proc_net_dev.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if name.strip() in ("data0", "mgmt0"):
            out[name.strip()] = int(fields[0]) + int(fields[8])
    return out


@contextmanager
def first_in_line(group_name: str) -> Iterator[None]:
    """The node's cgroup weighted far above everything else on this machine for the block, so that a
    busy loop in it gets what its quota allows whatever else runs (other test workers, a spin loop):
    what the block measures is the quota, not the machine's load. The weight is put back after."""
    group = CpuCgroup(group_name)
    path = Path(group.quota_directory) / ("cpu.weight" if group.version == 2 else "cpu.shares")
    before = path.read_text().strip()
    path.write_text("10000" if group.version == 2 else "262144")  # the largest either version takes
    try:
        yield
    finally:
        path.write_text(before)


# The test files that take longest (minutes each: campaigns on emulated labs), heaviest first. `make test`
# hands whole files to its workers in collection order, so these go first and the run does not end
# with one worker alone on a long file while the others idle. Only the order depends on this list.
LONGEST_FILES = (
    "test_campaign_run.py", "test_split_workers.py", "test_provision.py", "test_kill_trials.py",
    "test_disco_campaign.py", "test_target_emulation.py", "test_restricted_sudo.py", "test_input_mutations.py",
    "test_llms_campaign.py", "test_bounded_waits.py", "test_sudo_rules.py", "test_cocoserve_campaign.py",
    "test_emulated_phones.py", "test_links.py", "test_context_service_daemon.py", "test_serving_campaign.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (LONGEST_FILES), the rest in their usual order; a file's tests stay together."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept
