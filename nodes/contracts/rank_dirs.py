"""The layout of a run's output on a node: one directory per MPI rank under the run's ``out/``, named
``<role>-<index>-<node>`` (``stage-0-server``, ``device-1-orin``), holding the rank's records
(``requests.jsonl``, ``tokens.csv``, ``iterations.csv``). Built and read here only.

A rank that ends the launch with MPI_Abort first writes why to ``abort-rank-<rank>.txt`` in the run's
directory on its node (beside ``run.json``): mpiexec may end before it forwards the rank's last output.
"""

from typing import NamedTuple, Optional

ROLES = ("stage", "device")
ABORT_REASON_GLOB = "abort-rank-*.txt"


def abort_reason_file(rank: int) -> str:
    """The name, in the run's directory, of the file where ``rank`` says why it ended the launch."""
    return "abort-rank-%d.txt" % rank


class RankDir(NamedTuple):
    role: str  # stage | device
    index: int  # stage index or device index
    node: str

    @property
    def name(self) -> str:
        return "%s-%d-%s" % (self.role, self.index, self.node)


def parse_rank_dir(name: str) -> Optional[RankDir]:
    """The rank a directory name stands for; None for a name that is not a rank directory."""
    parts = name.split("-", 2)
    if len(parts) != 3 or parts[0] not in ROLES or not parts[1].isdigit() or not parts[2]:
        return None
    return RankDir(parts[0], int(parts[1]), parts[2])


def device_glob(node: str = "*") -> str:
    """A shell/pathlib glob for the device rank directories (of ``node``, or of every node)."""
    return "device-*-%s" % node
