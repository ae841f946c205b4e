"""The node-side distribution, ``hil-testbed-nodes``: a wheel of ``nodes/`` for Python 3.8+ that
pip installs into each node's virtual environment, with the node's dependencies as requirements.

It is built in-process from this checkout, byte for byte the same for the same sources (fixed zip
times, sorted entries), so its sha256 names a node's software version in records and manifests.
The controller's own dependencies (pydantic, fabric, pandas, ...) are not the nodes' business.
Requirements come from ``pyproject.toml`` (the ``node`` extra, and ``jetson``/``server`` as the
wheel's extras); torch is left out, because Jetsons keep NVIDIA's build and other nodes take the
pin of ``constraints.txt``.
"""

from __future__ import annotations

import base64
import hashlib
import re
import tomllib
from dataclasses import dataclass
from functools import cache

from testbed.provisioning.node_code import NODES_PACKAGE, deterministic_zip, node_code, node_sources

DISTRIBUTION = "hil-testbed-nodes"
REPO = NODES_PACKAGE.parent
WHEEL_FILE = b"Wheel-Version: 1.0\nGenerator: hil-testbed\nRoot-Is-Purelib: true\nTag: py3-none-any\n"


@dataclass(frozen=True)
class NodeWheel:
    data: bytes
    filename: str
    version: str
    sha256: str
    requirements: tuple[str, ...]  # every node's
    extras: dict[str, tuple[str, ...]]  # extra name -> its requirements
    torch_requirement: str  # what non-Jetson nodes install beside it

    def path_on(self, workdir: str) -> str:
        return f"{workdir.rstrip('/')}/wheels/{self.filename}"


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _is_torch(requirement: str) -> bool:
    return re.match(r"torch\b", requirement.strip()) is not None


def torch_pin() -> str:
    """The torch requirement of ``constraints.txt`` (the Makefile's pin), else the project's."""
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if _is_torch(line):
            return line
    return next(r for r in _project()["optional-dependencies"]["node"] if _is_torch(r))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


@cache
def node_wheel() -> NodeWheel:
    project = _project()
    optional = project["optional-dependencies"]
    requirements = tuple(r for r in optional["node"] if not _is_torch(r))
    extras = {name: tuple(optional[name]) for name in ("jetson", "server")}
    version = f"{project['version']}+{node_code().digest}"
    dist_info = f"{DISTRIBUTION.replace('-', '_')}-{version}.dist-info"
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {DISTRIBUTION}",
        f"Version: {version}",
        "Summary: Node-side drivers, samplers and workers of hil-testbed",
        "Requires-Python: >=3.8",
        *(f"Requires-Dist: {r}" for r in requirements),
    ]
    for name, reqs in extras.items():
        metadata.append(f"Provides-Extra: {name}")
        metadata += [f'Requires-Dist: {r}; extra == "{name}"' for r in reqs]
    entries = node_sources() + [
        (f"{dist_info}/METADATA", ("\n".join(metadata) + "\n").encode()),
        (f"{dist_info}/WHEEL", WHEEL_FILE),
    ]
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in entries)
    record += f"{dist_info}/RECORD,,\n"
    entries.append((f"{dist_info}/RECORD", record.encode()))
    data = deterministic_zip(entries)
    filename = f"{DISTRIBUTION.replace('-', '_')}-{version}-py3-none-any.whl"
    return NodeWheel(data, filename, version, hashlib.sha256(data).hexdigest(), requirements, extras, torch_pin())
