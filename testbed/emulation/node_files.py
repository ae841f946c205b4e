"""Files an emulated node lives on: its home, host key, stand-in configuration, power-mode state,
the stand-in Jetson tools on its PATH, and the board files (``/etc/nv_tegra_release``,
``/proc/device-tree/model``) under a stand-in root that node-side readers honour.

Nodes share the controller's file system and Python environment.
"""

from __future__ import annotations

import shutil
import stat
import sys
from pathlib import Path

from nodes.contracts.durable import write_json_atomic
from nodes.emulated import boards, phones
from nodes.emulated.adb import DEVICES_VARIABLE
from nodes.emulated.node import CONFIG_VARIABLE, PACING_DIRECTORY, STANDIN_ROOT_VARIABLE
from testbed.emulation.plan import NODE_DATA_INTERFACE as DATA_INTERFACE
from testbed.emulation.plan import EmulatedNodePlan
from testbed.emulation.sshd_server import SshKeys, generate_key
from testbed.inventory.node_kinds import node_kind
from testbed.leases.lease_file import LEASE_DIR_ENV

REPO = Path(__file__).resolve().parents[2]
ADB_DEVICES_FILE = "adb-devices.json"  # the stand-in adb's table of attached phones, in the state directory
PHONE_SHELL = REPO / "nodes" / "emulated" / "phone_shell.sh"
STANDIN_PACKAGE = "nodes.emulated"  # a board's stand-in for TOOL is the module nodes.emulated.TOOL
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _write_executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def nodes_ssh_config(keys: SshKeys) -> Path:
    """The SSH config the nodes' own ssh reads (their keys and known_hosts): what a real node's
    ~/.ssh/config is (``ssh.node_config`` in the resolved inventory)."""
    return keys.directory / "ssh_config"


def controller_ssh_config(keys: SshKeys) -> Path:
    """The SSH config this machine reads for a lab behind a bastion: what a lab member's ~/.ssh/config
    is (``ssh.config`` in the resolved inventory)."""
    return keys.directory / "controller_ssh_config"


def write_node_tools(state_dir: Path, keys: SshKeys, identity: Path | None = None) -> None:
    """Tools on the nodes' PATH: the stand-in adb, phone tools and timedatectl (run with this Python), and an ``ssh``
    that trusts the other nodes, as in a lab whose nodes share keys (mpiexec launches ranks with it;
    ``identity``: the key it uses, where the nodes' user cannot read the controller's)."""
    _write_executable(
        state_dir / "bin-adb" / "adb",
        "#!/bin/sh\n# Stand-in for Android's adb on the USB host of emulated phones (hil-testbed).\n"
        f"PYTHONPATH='{REPO}' exec '{sys.executable}' -m nodes.emulated.adb \"$@\"\n",
    )
    _write_executable(
        state_dir / "bin-android" / "phone-shell",
        f"#!/bin/sh\n# An emulated phone's shell (hil-testbed).\nexec sh '{PHONE_SHELL}' \"$@\"\n",
    )
    _write_executable(
        state_dir / "bin-android" / "phone-governor-sync",
        "#!/bin/sh\n# An emulated phone's power mode follows its cpufreq files (hil-testbed).\n"
        f"PYTHONPATH='{REPO}' exec '{sys.executable}' -m nodes.emulated.phone_governor \"$@\"\n",
    )
    config = nodes_ssh_config(keys)
    config.write_text(
        "Host *\n"
        f"  IdentityFile {identity or keys.client_key}\n"
        f"  UserKnownHostsFile {keys.known_hosts}\n"
        "  StrictHostKeyChecking yes\n"
        "  BatchMode yes\n"
    )
    ssh = shutil.which("ssh") or "/usr/bin/ssh"
    _write_executable(
        state_dir / "bin-node" / "timedatectl",
        "#!/bin/sh\n# Stand-in for systemd's timedatectl on emulated nodes (hil-testbed).\n"
        f"PYTHONPATH='{REPO}' exec '{sys.executable}' -m nodes.emulated.timedatectl \"$@\"\n",
    )
    _write_executable(
        state_dir / "bin-node" / "ssh",
        "#!/bin/sh\n# ssh between emulated nodes, with the testbed's keys (hil-testbed).\n"
        f'exec {ssh} -F {config} "$@"\n',
    )


class NodeFiles:
    def __init__(self, state_dir: Path, node: EmulatedNodePlan) -> None:
        self.node = node
        self.directory = state_dir / "nodes" / node.name
        self.home = self.directory / "home"
        self.host_key = self.directory / "host_ed25519"
        self.config = self.directory / "node.json"
        self.power_mode = self.directory / "power_mode"
        self.standin_root = self.directory / "root"
        self.jetson_bin = self.directory / "bin-jetson"  # its own: sudo drops the environment that names the node
        self.root_state = self.directory / "root-state"  # the node's /var/lib/hil-testbed (nodes.contracts.root_paths)
        self.lease_dir = self.directory / "lease"  # the node's /run/lock for its lease (testbed.leases), every user's
        self.pacing_dir = self.directory / PACING_DIRECTORY  # its CPU pacing state (nodes.emulated.node)
        self.node_bin = state_dir / "bin-node"
        self.android_bin = state_dir / "bin-android"
        self.adb_bin = state_dir / "bin-adb"
        self.adb_devices = state_dir / ADB_DEVICES_FILE

    def create(self, *, mode: str, cgroup: str | None) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.lease_dir.mkdir(exist_ok=True)
        self.lease_dir.chmod(0o1777)  # as /run/lock: every user may add a file, none remove another's
        self.pacing_dir.mkdir(exist_ok=True)
        generate_key(self.host_key)
        initial = self.node.initial_power_mode
        self.power_mode.write_text(f"{initial.id}\n" if initial else "")
        kind = node_kind(self.node.kind)
        if kind.boards is not None:
            self.write_board_tools(kind.boards.standin_tools)
            board = boards.board_for(self.node.model)
            release = self.standin_root / "etc" / "nv_tegra_release"
            model = self.standin_root / "proc" / "device-tree" / "model"
            release.parent.mkdir(parents=True, exist_ok=True)
            model.parent.mkdir(parents=True, exist_ok=True)
            release.write_text(board.nv_tegra_release + "\n")
            model.write_bytes(board.device_tree_model.encode() + b"\0")  # NUL-terminated, as in the device tree
        if kind.via_usb_host:  # a phone's sysfs: cpufreq in the initial mode, battery, thermal zones
            phones.write_phone_files(str(self.standin_root), phones.phone_named(self.node.model),
                                     initial.name if initial else "schedutil")  # fmt: skip
        self.write_config(mode=mode, cgroup=cgroup, cpu_root_pid=None)

    def write_board_tools(self, tools: tuple[str, ...]) -> None:
        """The board's stand-in tools on the node's PATH (run with this Python), each naming its node and
        board files itself: run with sudo, a tool keeps none of the session's environment."""
        for tool in tools:
            module = f"{STANDIN_PACKAGE}.{tool}"
            _write_executable(
                self.jetson_bin / tool,
                "#!/bin/sh\n"
                f"# Stand-in for NVIDIA's {tool} on {self.node.name}, written by `testbed emulate up` (hil-testbed).\n"
                f"{CONFIG_VARIABLE}='{self.config}' {STANDIN_ROOT_VARIABLE}='{self.standin_root}' PYTHONPATH='{REPO}' "
                f"exec '{sys.executable}' -m {module} \"$@\"\n",
            )

    def write_config(self, *, mode: str, cgroup: str | None, cpu_root_pid: int | None) -> None:
        """What the stand-in tools read: the board, power modes, and where the node's CPU time is."""
        config = {
            "node": self.node.name,
            "kind": self.node.kind,
            "model": self.node.model,
            "mode": mode,
            "cgroup": cgroup,
            "cpu_root_pid": cpu_root_pid,
            "power_mode_file": str(self.power_mode),
            "power_modes": [m.model_dump() for m in self.node.power_modes],
        }
        write_json_atomic(self.config, config, mode=0o644)

    def environment(self, mode: str) -> dict[str, str]:
        """What every SSH session on the node starts with."""
        python_bin = str(Path(sys.executable).parent)
        path = [str(self.node_bin), python_bin, SYSTEM_PATH]
        env = {"HOME": str(self.home), CONFIG_VARIABLE: str(self.config), LEASE_DIR_ENV: str(self.lease_dir)}
        if mode == "netns":
            # Nodes share one kernel, so MPI would pass messages between them through shared memory;
            # on separate boards they cross the network. Keep MPI (UCX or libfabric) on the data plane.
            env.update(
                UCX_TLS="tcp,self", UCX_NET_DEVICES=DATA_INTERFACE, FI_PROVIDER="tcp", FI_TCP_IFACE=DATA_INTERFACE
            )
        kind = node_kind(self.node.kind)
        if kind.boards is not None:
            path.insert(0, str(self.jetson_bin))
            env[STANDIN_ROOT_VARIABLE] = str(self.standin_root)
        if kind.via_usb_host:
            phone = phones.phone_named(self.node.model)
            path.insert(0, str(self.android_bin))
            env[STANDIN_ROOT_VARIABLE] = str(self.standin_root)
            env.update(TESTBED_PHONE_MODEL=phone.product_model, TESTBED_PHONE_DEVICE=phone.codename,
                       TESTBED_PHONE_ANDROID=phone.android)  # fmt: skip
        if self.node.hosts_phones:
            path.insert(0, str(self.adb_bin))
            env[DEVICES_VARIABLE] = str(self.adb_devices)
        env["PATH"] = ":".join(path)
        return env
