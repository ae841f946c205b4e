"""Can the server start ranks on the devices? mpiexec on the server reaches each device over SSH, with
the server's own keys and known_hosts (testbed.workers.mpi_launch), which the controller's reaching
the device proves nothing about. This check runs, on the server, the ssh hydra will run, with the
config hydra will use, against every device at once, and says for each one that fails what to fix.

Nothing is left on the server: the config lives in a temporary file for the check's length.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from testbed.commands.launch_ssh import hydra_ssh
from testbed.inventory import Inventory, NodeSpec, kind_of
from testbed.transport.base import Transport

MARK = "launch-reach"


def rank_nodes(inventory: Inventory, server: NodeSpec) -> list[NodeSpec]:
    """The nodes a launch from ``server`` starts ranks on over SSH: devices with an address."""
    return [n for n in inventory.nodes if n is not server and "device" in n.roles and kind_of(n).runs_ranks
            and n.transport == "ssh" and n.address is not None]  # fmt: skip


def reach_script(config: str, hosts: Sequence[str], timeout_s: float) -> str:
    """sh (the config on stdin) that tries ``ssh HOST true`` to every host at once and prints a line
    per host: the mark, the host, ssh's exit status and its last line of output."""
    tries = "".join(
        f'( o=$(ssh -F "$c" -o ConnectTimeout={max(1, round(timeout_s))} {shlex.quote(h)} true 2>&1 </dev/null); '
        f'r=$?; echo "{MARK} {h} $r $(printf %s "$o" | tail -n 1 | tr -d "\\r")" ) & '
        for h in hosts
    )
    return f'c=$(mktemp) || exit 3; trap \'rm -f "$c"\' EXIT; cat > "$c"; {tries}wait'


def _fix(problem: str, user: str, host: str, port: int) -> str:
    """The command that fixes what ssh said, run on the server as the user mpiexec runs as."""
    said = problem.lower()
    if "host key verification failed" in said or "no matching host key" in said:
        return f"verify the device's key, then on the server: ssh-keyscan -p {port} {host} >> ~/.ssh/known_hosts"
    if "permission denied" in said:
        return (f"authorize the server's key on the device: on the server, ssh-copy-id -p {port} {user}@{host} "
                "(make a key first with ssh-keygen -t ed25519 if it has none)")  # fmt: skip
    if "could not resolve" in said:
        return f"{host} does not resolve on the server: give the device's address, or a Host entry for it"
    return f"the server cannot open {host}:{port}: check the lab network and the device's sshd"


def launch_reach_problems(inventory: Inventory, server: NodeSpec, t: Transport) -> list[str]:
    """What keeps ``server`` (reached through ``t``) from starting ranks on the devices, one line each."""
    nodes = rank_nodes(inventory, server)
    if not nodes:
        return []
    ssh = hydra_ssh(inventory, server, nodes, directory="")  # (the config alone: nothing is stored)
    timeout = max(inventory.ssh_target(n).connect_timeout_s for n in nodes)
    hosts = {n.address: n for n in nodes if n.address}
    script = reach_script(ssh.config, list(hosts), timeout)
    result = t.run(["sh", "-c", script], stdin=ssh.config.encode(), timeout_s=timeout * 2 + 30)
    seen: dict[str, tuple[int, str]] = {}
    for line in result.stdout.splitlines():
        words = line.split(" ", 3)
        if len(words) >= 3 and words[0] == MARK and words[2].lstrip("-").isdigit():
            seen[words[1]] = (int(words[2]), words[3] if len(words) == 4 else "")
    problems = []
    for host, node in hosts.items():
        target = inventory.ssh_target(node)
        code, said = seen.get(host, (None, result.stderr.strip()[-200:] or "no answer"))
        if code != 0:
            problems.append(f"mpiexec here cannot reach {node.name} ({target.user}@{target.host}:{target.port}): "
                            f"{said or f'ssh exit {code}'}; fix: {_fix(said, target.user, target.host, target.port)}")
    return problems
