"""The node-side code (``nodes/``) as one zip that runs on any node's Python (3.8+) with
``PYTHONPATH=<zip>``: built from this checkout, named by its content hash, and pushed only when the
node does not have that exact version yet. So the samplers and drivers on a node are always the
controller's version, and the hash can go into run manifests.

Provisioning (a per-node virtual environment with the node's dependencies) is a separate step;
this bundle needs only the standard library (and nvidia-ml-py for NVML, where installed).
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from testbed.transport.base import Transport

NODES_PACKAGE = Path(__file__).resolve().parents[2] / "nodes"
_FIXED_TIME = (2020, 1, 1, 0, 0, 0)  # zip entries carry no build time, so the hash is the content's


@dataclass(frozen=True)
class NodeCode:
    data: bytes
    digest: str  # sha256 of the zip, first 16 hex digits

    def path_on(self, workdir: str) -> str:
        return f"{workdir.rstrip('/')}/lib/hil-nodes-{self.digest}.zip"


def node_sources() -> list[tuple[str, bytes]]:
    """Every ``nodes/**/*.py`` as (path inside an archive, content), in a fixed order."""
    return [
        (str(path.relative_to(NODES_PACKAGE.parent)), path.read_bytes())
        for path in sorted(NODES_PACKAGE.rglob("*.py"))
        if "__pycache__" not in path.parts
    ]


def deterministic_zip(entries: list[tuple[str, bytes]]) -> bytes:
    """A zip of ``entries`` whose bytes depend on their names and contents only."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries:
            info = zipfile.ZipInfo(name, _FIXED_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, data)
    return buffer.getvalue()


@cache
def node_code() -> NodeCode:
    """The zip of every ``nodes/**/*.py``, deterministic for a given content."""
    data = deterministic_zip(node_sources())
    return NodeCode(data, hashlib.sha256(data).hexdigest()[:16])


def store_if_missing(transport: Transport, path: str) -> None:
    """Store the bundle at ``path`` on the node unless it is there (its name carries its content's hash)."""
    if not transport.run(["test", "-s", path], timeout_s=30.0).ok:
        transport.store(path, node_code().data)


def node_code_path(transport: Transport, workdir: str) -> str:
    """The node's absolute path of the current bundle under ``workdir``, stored first if the node lacks it."""
    path = transport.expand_path(node_code().path_on(workdir))
    store_if_missing(transport, path)
    return path
