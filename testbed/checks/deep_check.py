"""``testbed inventory check --deep``: whether a lab's nodes can run campaigns, not only be reached.

Beyond the facts (:mod:`testbed.checks.inventory_check`), each Linux node is asked and judged as
provisioning does (:func:`testbed.provisioning.provision.probe_readiness` and ``judge_readiness``: tc,
ip and iperf3, free disk where the workdir is against the weights it will hold), with NTP
synchronisation a problem here, and a node that runs ranks imports the torch its workers will
import (with CUDA where the node has a real GPU: PyPI's aarch64 wheels have none, a Jetson needs
JetPack's). Then across nodes: every
device and its server open TCP connections to each other's data-plane address on a port chosen at
start, as MPI's ranks do, and each device opens the lab's endpoints (``endpoints:``); each power
driver lists the modes it offers. Every problem comes with the command that fixes it.

Nothing is changed on a node: the listeners and probes end with the check (bounded by LISTEN_S).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from foundation.errors import TestbedError
from testbed.checks.launch_reach import rank_nodes
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.provisioning.provision import clock_unsynchronised, judge_readiness, probe_readiness
from testbed.transport import Transport, open_transport
from testbed.transport.facts import NodeFacts
from testbed.transport.fanout import fan_out

FIDELITY_MODEL = Path(__file__).resolve().parents[2] / "examples" / "models" / "smollm2-135m"
MIN_TORCH = (2, 1)  # the node extra's torch>=2.1 (pyproject.toml)
LISTEN_S = 60.0  # a listener ends by itself after this, should the controller vanish
CONNECT_TIMEOUT_S = 3.0
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")

# The torch the workers import: the venv's Python where provisioning made one, else the base Python.
# $1: base Python, $2: venv. One JSON line.
_TORCH_SCRIPT = r"""
p="$2/bin/python"; [ -x "$p" ] || p=$1
"$p" -c '
import json, sys
out = {"python": sys.executable}
try:
    import torch
except Exception as e:
    out["error"] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
else:
    out.update(version=torch.__version__, cuda=torch.version.cuda, available=bool(torch.cuda.is_available()))
print("torch-probe " + json.dumps(out))' 2>&1 || echo "torch-probe {\"error\": \"$p does not run\"}"
"""

# Listens on a free port of every address, prints it, accepts and drops connections until stdin closes
# (the check ends) or LISTEN_S pass. argv: seconds.
_LISTENER = r"""
import select, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.bind(("", 0))
s.listen(128)
print(s.getsockname()[1], flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    ready = select.select([s, sys.stdin], [], [], 0.5)[0]
    if sys.stdin in ready and not sys.stdin.buffer.read1(1):
        break
    if s in ready:
        s.accept()[0].close()
"""

# Opens a TCP connection to each host:port given, all at once; a line per target. argv: timeout, targets.
_CONNECTOR = r"""
import socket, sys, threading
def one(target):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=float(sys.argv[1])).close()
        print("reach %s ok" % target, flush=True)
    except OSError as e:
        print("reach %s %s" % (target, e.strerror or type(e).__name__), flush=True)
threads = [threading.Thread(target=one, args=(t,)) for t in sys.argv[2:]]
[t.start() for t in threads]
[t.join() for t in threads]
"""


def weights_bytes(model_dir: Path | None) -> int:
    """The size of a checkpoint's weight files (a node holds its part of them: this is the bound)."""
    if model_dir is None:
        return 0
    if not model_dir.is_dir():
        raise TestbedError(f"--model {model_dir}: no such checkpoint directory")
    return sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2])


def judge_torch(node: NodeSpec, facts: NodeFacts, probe: Mapping[str, object]) -> list[str]:
    """What is wrong with the torch a rank node's workers import (``probe``: what _TORCH_SCRIPT printed)."""
    kind = kind_of(node)
    python = str(probe.get("python") or "the node's Python")
    jetson = kind.boards is not None
    where = (f"on a Jetson: install NVIDIA's torch wheel for its JetPack (L4T {facts.l4t_release or '?'}) into "
             f"the base Python (docs/real-lab.md), then testbed provision" if jetson
             else "testbed provision installs it into the node's venv")  # fmt: skip
    if probe.get("error"):
        return [f"torch does not import with {python} ({probe['error']}); fix: {where}"]
    version = str(probe.get("version") or "")
    if _version_tuple(version) < MIN_TORCH:
        wanted = ".".join(map(str, MIN_TORCH))
        return [f"torch {version} in {python} is older than the {wanted} the workers need; fix: {where}"]
    has_gpu = not facts.emulated and (jetson or (kind.discrete_gpus and node.gpus > 0))
    if has_gpu and not probe.get("cuda"):
        fix = (where if jetson else "pip install torch from PyTorch's CUDA index for the driver (e.g. --index-url "
               "https://download.pytorch.org/whl/cu121) into the node's venv")  # fmt: skip
        return [f"torch {version} in {python} is a CPU-only build on a node with a GPU (PyPI's aarch64 wheels have "
                f"no CUDA); fix: {fix}"]  # fmt: skip
    if has_gpu and not probe.get("available"):
        return [f"torch {version} (CUDA {probe.get('cuda')}) in {python} sees no GPU; fix: check the driver "
                f"(nvidia-smi, or tegrastats on a Jetson) and that {facts.user or 'the user'} is in the video "
                f"group: sudo usermod -aG video {facts.user or '$USER'}"]  # fmt: skip
    return []


def probe_torch(node: NodeSpec, t: Transport, *, python: str, venv: str) -> dict[str, object]:
    result = t.run(["sh", "-c", _TORCH_SCRIPT, "torch", python, venv], timeout_s=120.0)
    for line in result.stdout.splitlines():
        if line.startswith("torch-probe "):
            return dict(json.loads(line.split(" ", 1)[1]))
    return {"error": (result.stderr.strip() or result.stdout.strip() or "no answer")[-200:]}


def node_problems(inventory: Inventory, node: NodeSpec, t: Transport, facts: NodeFacts, need_gib: float) -> list[str]:
    """The deep problems of one Linux node reached through ``t`` (the cross-node ones: port_problems)."""
    settings = inventory.settings_of(node)
    workdir, venv = t.expand_path(settings.workdir), t.expand_path(settings.venv_path)
    values = probe_readiness(node, t, python=settings.python, venv=venv, workdir=workdir)
    # what provisioning needs (tools, free disk; the sudo rules are inventory_check's own problem), and
    # a clock that NTP does not keep, which provisioning only warns of
    missing, _ = judge_readiness(node, facts, values, need_gib=need_gib, sudo_used=False)
    problems = [f"{what} is missing; fix: {fix}" for what, fix in missing]
    unsynchronised = clock_unsynchronised(values)
    if unsynchronised:
        problems.append(unsynchronised)
    if kind_of(node).runs_ranks:
        problems += judge_torch(node, facts, probe_torch(node, t, python=settings.python, venv=venv))
    return problems


def data_address(node: NodeSpec) -> str:
    """Where ranks reach ``node``: its data-plane address, else the one it is reached at."""
    return node.data.address if node.data is not None else str(node.address)


@contextlib.contextmanager
def _listening(inventory: Inventory, node: NodeSpec):  # type: ignore[no-untyped-def]
    """A port on ``node`` that accepts TCP connections on every address while the block runs."""
    with open_transport(inventory, node) as t, t.open_line_session(
        [inventory.settings_of(node).python, "-c", _LISTENER, str(LISTEN_S)]
    ) as session:
        yield int(session.read_line(30.0))


def reach(inventory: Inventory, node: NodeSpec, targets: Sequence[str]) -> dict[str, str]:
    """``host:port`` -> "ok" or why ``node`` could not open a TCP connection to it."""
    if not targets:
        return {}
    with open_transport(inventory, node) as t:
        argv = [inventory.settings_of(node).python, "-c", _CONNECTOR, str(CONNECT_TIMEOUT_S), *targets]
        result = t.run(argv, timeout_s=CONNECT_TIMEOUT_S + 30.0)
    said = {}
    for line in result.stdout.splitlines():
        words = line.split(" ", 2)
        if len(words) == 3 and words[0] == "reach":
            said[words[1]] = words[2]
    return {target: said.get(target, result.stderr.strip()[-200:] or "no answer") for target in targets}


def server_port_problems(inventory: Inventory, server: NodeSpec, devices: Sequence[NodeSpec]) -> dict[str, list[str]]:
    """Problems by node name where ``server`` and one of its ``devices`` cannot open TCP connections to
    each other's data-plane address (MPI's ranks connect both ways, on ports chosen at start)."""
    problems: dict[str, list[str]] = {}
    if not devices:
        return problems
    with contextlib.ExitStack() as stack:
        server_port = stack.enter_context(_listening(inventory, server))
        ports = {d.name: stack.enter_context(_listening(inventory, d)) for d in devices}
        to_server = f"{data_address(server)}:{server_port}"
        inward = fan_out([d.name for d in devices], lambda name: reach(inventory, inventory.node(name), [to_server]),
                         description="opening ports on the server")  # fmt: skip
        outward = reach(inventory, server, [f"{data_address(d)}:{ports[d.name]}" for d in devices])
    for device, outcome in zip(devices, inward.outcomes, strict=True):
        said = outcome.value[to_server] if outcome.value is not None else outcome.error
        if said != "ok":
            problems.setdefault(server.name, []).append(
                f"{device.name} cannot open TCP to {to_server} on this server's data plane ({said}): MPI's ranks "
                "connect on ports chosen at start; fix: allow TCP from the devices' data addresses, e.g. sudo "
                f"iptables -I INPUT -p tcp -s {data_address(device)} -j ACCEPT (or ufw allow from "
                f"{data_address(device)} proto tcp)")  # fmt: skip
    for device in devices:
        target = f"{data_address(device)}:{ports[device.name]}"
        if outward.get(target) != "ok":
            problems.setdefault(device.name, []).append(
                f"the server {server.name} cannot open TCP to {target} on this device's data plane "
                f"({outward.get(target)}); fix: allow TCP from {data_address(server)}, e.g. sudo iptables -I "
                f"INPUT -p tcp -s {data_address(server)} -j ACCEPT")  # fmt: skip
    return problems


def endpoint_problems(inventory: Inventory, devices: Sequence[NodeSpec]) -> dict[str, list[str]]:
    """Problems by device name where a device cannot open one of the lab's endpoints (``endpoints:``)."""
    endpoints = {name: urlsplit(e.url) for name, e in inventory.spec.endpoints.items()}
    targets = {name: f"{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}" for name, u in endpoints.items()}
    if not targets or not devices:
        return {}
    problems: dict[str, list[str]] = {}
    opened = fan_out([d.name for d in devices],
                     lambda name: reach(inventory, inventory.node(name), sorted(set(targets.values()))),
                     description="opening the endpoints")  # fmt: skip
    for outcome in opened.outcomes:
        for endpoint, target in targets.items():
            said = outcome.value.get(target) if outcome.value is not None else outcome.error
            if said != "ok":
                problems.setdefault(outcome.node, []).append(
                    f"endpoint {endpoint} ({target}) cannot be opened from here ({said}); fix: start it, or "
                    "open its port to the devices on its host's firewall")  # fmt: skip
    return problems


def port_problems(inventory: Inventory, reached: Sequence[NodeSpec]) -> dict[str, list[str]]:
    """Problems by node name, between the nodes that answered: MPI's ports between each server and its
    devices, and the endpoints from the devices."""
    names = {n.name for n in reached}
    found: dict[str, list[str]] = {}
    servers = [n for n in reached if "server" in n.roles and kind_of(n).runs_ranks]
    devices = [n for n in reached if "device" in n.roles and kind_of(n).runs_ranks and n.transport == "ssh"]
    for more in (*(server_port_problems(inventory, s, [d for d in rank_nodes(inventory, s) if d.name in names])
                   for s in servers), endpoint_problems(inventory, devices)):  # fmt: skip
        for name, problems in more.items():
            found.setdefault(name, []).extend(problems)
    return found


def power_problems(inventory: Inventory, reached: Sequence[NodeSpec]) -> dict[str, list[str]]:
    """Problems by node name: a power driver that fails, or a board's or phone's that offers no mode
    (testbed.energy.power_modes)."""
    from testbed.energy.power_modes import show_power

    names = [n.name for n in reached if kind_of(n).power_driver != "none"]
    if not names:
        return {}
    try:
        readings = show_power(inventory, names)
    except TestbedError as exc:
        return {name: [f"the power driver cannot run: {exc}"] for name in names}
    problems: dict[str, list[str]] = {}
    for outcome in readings.outcomes:
        if not outcome.ok or outcome.value is None:
            problems[outcome.node] = [f"the power driver failed: {outcome.error}"]
        elif not outcome.value.modes and not kind_of(inventory.node(outcome.node)).discrete_gpus:  # (a server's
            # driver may list none: its GPUs' power limits are set, not chosen from a list)
            problems[outcome.node] = ["the power driver lists no power mode (nvpmodel's /etc/nvpmodel.conf, or "
                                      "the phone's cpufreq policies)"]  # fmt: skip
    return problems
