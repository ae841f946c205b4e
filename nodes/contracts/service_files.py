"""Where a run's on-device LLM service (``nodes.context_service``) keeps its files on a node: one
directory beside the run's ``run.json``, known to the controller (which starts and stops the daemon
through the run plan) and to the device rank (whose apps connect to its socket). Built here only.
The directory is its user's alone (0700): the daemon refuses a socket directory others may enter."""

import contextlib
import os
from typing import Iterator, NamedTuple

SERVICE_DIR = "llm-service"
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
PROC_FDS = "/proc/self/fd"  # a longer path is reached through its directory's descriptor here (Linux)


class ServiceFiles(NamedTuple):
    directory: str

    @property
    def socket(self) -> str:
        """In the service's directory, never elsewhere (no shared /tmp name another user could take
        first); a path too long for sun_path is reached through its directory (``unix_address``)."""
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
    """Why a Unix socket cannot live at ``path`` on this host, or '': a path too long for sun_path
    needs ``/proc/self/fd`` (Linux) to be reached through its directory."""
    if len(path.encode()) > SOCKET_PATH_MAX and not os.path.isdir(PROC_FDS):
        return "the socket path %s is %d bytes, over the %d a Unix socket allows: use a shorter defaults.workdir" % (
            path, len(path.encode()), SOCKET_PATH_MAX)
    return ""



@contextlib.contextmanager
def unix_address(path: str) -> Iterator[str]:
    """What to bind or connect to for the socket at ``path``: the path itself when it fits sun_path,
    else the same file reached through an open descriptor of its directory (``/proc/self/fd/N/NAME``),
    so that a run directory deep in a home directory keeps its socket (no name in a shared /tmp)."""
    if len(path.encode()) <= SOCKET_PATH_MAX:
        yield path
        return
    directory = os.open(os.path.dirname(path) or ".", getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY)
    try:
        yield "%s/%d/%s" % (PROC_FDS, directory, os.path.basename(path))
    finally:
        os.close(directory)
