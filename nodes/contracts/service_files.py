"""Where a run's on-device LLM service (``nodes.context_service``) keeps its files on a node: one
directory beside the run's ``run.json``, known to the controller (which starts and stops the daemon
through the run plan) and to the device rank (whose apps connect to its socket). Built here only.
The directory is its user's alone (0700): the daemon refuses a socket directory others may enter."""

import os
from typing import NamedTuple

SERVICE_DIR = "llm-service"
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


class ServiceFiles(NamedTuple):
    directory: str

    @property
    def socket(self) -> str:
        """In the service's directory, never elsewhere (no shared /tmp name another user could take
        first): a path too long for a Unix socket is refused (``socket_problem``)."""
        return os.path.join(self.directory, "llm.sock")

    @property
    def state_dir(self) -> str:
        """Contexts and chunks: what the service keeps across its own restarts."""
        return os.path.join(self.directory, "state")

    @property
    def pidfile(self) -> str:
        return os.path.join(self.directory, "daemon.pid")

    @property
    def logfile(self) -> str:
        return os.path.join(self.directory, "daemon.log")

    @property
    def install_profile(self) -> str:
        """T_re and T_IO as the daemon fitted them at start (LLMS Sec. 3.2)."""
        return os.path.join(self.state_dir, "install_profile.json")


def service_files(run_dir: str) -> ServiceFiles:
    """The service's files for the run whose directory on the node is ``run_dir``."""
    return ServiceFiles(os.path.join(run_dir, SERVICE_DIR))


def socket_problem(path: str) -> str:
    """Why a Unix socket cannot live at ``path`` (too long for sun_path), or ''."""
    if len(path.encode()) > SOCKET_PATH_MAX:
        return "the socket path %s is %d bytes, over the %d a Unix socket allows: use a shorter defaults.workdir" % (
            path, len(path.encode()), SOCKET_PATH_MAX)
    return ""
