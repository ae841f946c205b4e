"""How mpiexec on the launch node reaches the nodes it starts ranks on: an SSH config written from the
inventory (each node's address, user and port; batch mode and strict host keys), then the launch node's
own SSH config (``ssh.node_config``, default ``~/.ssh/config``) for its keys and whatever else the lab
sets there; and a launcher that runs the node's ``ssh`` with it, for hydra's ``-launcher-exec``. Used
by the launch (testbed.workers.mpi_launch) and by the check that the server reaches every device
(testbed.checks.launch_reach), so that both run the same ssh with the same config.
"""

from __future__ import annotations

import hashlib
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from testbed.commands.planned import PlanLines
from testbed.inventory import Inventory, NodeSpec
from testbed.transport.base import Transport, command_line


@dataclass(frozen=True)
class HydraSsh:
    """How hydra's ssh launcher on the launch node reaches the nodes: a config and the launcher that runs
    ``ssh`` with it, both named by the config's hash (written once, shared by every run that needs it)."""

    directory: str  # on the launch node, home expanded
    config: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.config.encode()).hexdigest()[:16]

    @property
    def config_path(self) -> str:
        return f"{self.directory}/ssh_config-{self.digest}"

    @property
    def launcher_path(self) -> str:
        return f"{self.directory}/ssh-{self.digest}"

    def launcher(self) -> str:
        return (f"#!/bin/sh\n# hydra's ssh launcher (hil-testbed): the nodes as the inventory reaches them\n"
                f'exec ssh -F {shlex.quote(self.config_path)} "$@"\n')  # fmt: skip

    def ready_check(self) -> list[str]:
        return ["test", "-x", self.launcher_path]

    def write(self, t: Transport) -> None:
        """Store the config and the launcher on the launch node (where they are not there yet)."""
        if t.run(self.ready_check(), timeout_s=30.0).ok:
            return
        t.store(self.config_path, self.config.encode())
        t.store(self.launcher_path, self.launcher().encode())
        t.run(["chmod", "0755", self.launcher_path], timeout_s=30.0).check()

    def plan(self, lines: PlanLines, node: str, phase: str) -> None:
        lines.add(node, phase, "is hydra's ssh launcher there?", command_line(self.ready_check()), "if-cold")
        lines.store(node, phase, "store hydra's ssh config (the nodes' users and ports)", self.config_path,
                    "if-missing")  # fmt: skip
        lines.store(node, phase, "store hydra's ssh launcher", self.launcher_path, "if-missing")
        lines.add(node, phase, "make it executable", command_line(["chmod", "0755", self.launcher_path]),
                  "if-missing")  # fmt: skip


def hydra_ssh(inventory: Inventory, launch_node: NodeSpec, nodes: Sequence[NodeSpec], directory: str) -> HydraSsh:
    """The SSH config hydra's launcher uses on ``launch_node`` to reach ``nodes``."""
    lines = [f"# hil-testbed: how mpiexec on {launch_node.name} reaches the nodes of a run ({inventory.path.name})"]
    timeout = 10.0
    for node in nodes:
        if node.address is None or node.transport != "ssh":
            continue
        target = inventory.ssh_target(node)
        timeout = max(timeout, target.connect_timeout_s)
        lines.append(f"Host {node.address}")
        if target.host != node.address:
            lines.append(f"  HostName {target.host}")
        lines += [f"  User {target.user}", f"  Port {target.port}"]
    own = inventory.ssh_target(launch_node).node_config if launch_node.address else "~/.ssh/config"
    lines += ["Host *", "  BatchMode yes", "  StrictHostKeyChecking yes", f"  ConnectTimeout {math.ceil(timeout)}",
              f"Include {own}", ""]  # fmt: skip
    return HydraSsh(directory, "\n".join(lines))
