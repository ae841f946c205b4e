"""Model weights for the nodes: each role's share of a checkpoint as one content-hashed safetensors
file, cut on the controller without torch, and sent only where it is missing or damaged.

A device of a U-shaped partition gets the embedding, layers 0..m-1, the final norm and the LM head;
the server gets layers m..L-1 (HAT, Sec. 3.1). On the node a part lives in
``<workdir>/models/<model>/<role>-m<m>/`` beside the checkpoint's config (and, for devices, the
tokenizer), so that the workers load it like any checkpoint directory. Transfers go to a ``.part``
file that is resumed when its bytes match, checked by sha256, and only then renamed: a file under
its final name is always whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import NodeError, TestbedError
from nodes.inference.partition import PartitionError, UShapePartition, checkpoint_tensor_names
from testbed.transport.base import Transport

Say = Callable[[str], None]

# Files of a checkpoint directory besides the weights: every role gets the config, devices also
# the tokenizer (they encode prompts and decode tokens).
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
PROGRESS_FROM_BYTES = 64 << 20  # files from this size report progress every 10%
_HEADER_ALIGN = 8
_COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class TensorLocation:
    file: Path
    begin: int  # absolute byte offsets in the file
    end: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelSource:
    """A Hugging Face checkpoint directory as the controller sees it (headers only)."""

    directory: Path
    name: str
    num_layers: int
    tied: bool
    tensors: dict[str, TensorLocation]

    @classmethod
    def open(cls, directory: str | Path) -> ModelSource:
        root = Path(directory).expanduser().resolve()
        config_path = root / "config.json"
        if not config_path.is_file():
            raise TestbedError(f"{root}: not a checkpoint directory (no config.json)")
        try:
            config = json.loads(config_path.read_text())
            num_layers = int(config["num_hidden_layers"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TestbedError(f"{config_path}: num_hidden_layers: cannot read it ({exc})") from None
        files = sorted(root.glob("*.safetensors"))
        if not files:
            hint = " (convert the .bin files to safetensors first)" if any(root.glob("pytorch_model*.bin")) else ""
            raise TestbedError(f"{root}: no *.safetensors files to distribute{hint}")
        tensors: dict[str, TensorLocation] = {}
        for path in files:
            for name, location in read_safetensors_header(path).items():
                if name in tensors:
                    raise TestbedError(f"{path}: tensor {name} is also in {tensors[name].file}")
                tensors[name] = location
        return cls(root, root.name, num_layers, bool(config.get("tie_word_embeddings", False)), tensors)

    def small_files(self, role: str) -> list[Path]:
        names = CONFIG_FILES + (TOKENIZER_FILES if role == "device" else ())
        return [self.directory / n for n in names if (self.directory / n).is_file()]


def read_safetensors_header(path: Path) -> dict[str, TensorLocation]:
    """Tensor name -> where its bytes are, from a safetensors file's JSON header."""
    try:
        with open(path, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            if size > 100 << 20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(handle.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise TestbedError(f"{path}: not a safetensors file ({exc})") from None
    start = 8 + size
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        out[name] = TensorLocation(path, start + begin, start + end, entry["dtype"], tuple(entry["shape"]))
    return out


@dataclass(frozen=True)
class WeightPart:
    """One role's share of a partitioned checkpoint."""

    role: str  # device or server
    device_layers: int  # m
    tensor_names: tuple[str, ...]

    @property
    def directory_name(self) -> str:
        return f"{self.role}-m{self.device_layers}"


def parse_partition(text: str) -> tuple[int, int]:
    """``m=2,P=4`` -> (2, 4)."""
    values: dict[str, int] = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in ("m", "P") or not re.fullmatch(r"[0-9]+", value.strip()) or key in values:
            raise TestbedError(f"--partition: {text!r} is not of the form m=2,P=4 (m device layers, P server stages)")
        values[key] = int(value)
    if set(values) != {"m", "P"}:
        raise TestbedError(f"--partition: {text!r} needs both m and P, e.g. m=2,P=4")
    return values["m"], values["P"]


def weight_parts(source: ModelSource, device_layers: int, stages: int) -> dict[str, WeightPart]:
    """The device's and the server's parts of a U-shaped partition (HAT, Sec. 3.1)."""
    try:
        partition = UShapePartition.make(source.num_layers, device_layers, stages)
    except PartitionError as exc:
        raise TestbedError(f"--partition: {exc}") from None
    names = list(source.tensors)
    server_layers = [i for stage in partition.stage_layer_ids() for i in stage]
    parts = {
        "device": checkpoint_tensor_names(names, partition.device_layer_ids(), True, True, source.tied),
        "server": checkpoint_tensor_names(names, server_layers, False, False, source.tied),
    }
    for role, chosen in parts.items():
        if not chosen:
            raise TestbedError(f"{source.directory}: the checkpoint has no tensors for the {role}'s part")
    return {role: WeightPart(role, device_layers, tuple(chosen)) for role, chosen in parts.items()}


@dataclass(frozen=True)
class PartFile:
    """A part written as one safetensors file on the controller, named by its content."""

    path: Path
    sha256: str
    size: int

    @property
    def name(self) -> str:
        return f"{self.sha256[:16]}.safetensors"


def write_part(source: ModelSource, part: WeightPart, cache_dir: Path) -> PartFile:
    """The part's safetensors file (tensors in name order, header padded to 8 bytes), cached by the
    source files' identity so that an unchanged checkpoint is cut only once."""
    identity = hashlib.sha256()
    for name in part.tensor_names:
        loc = source.tensors[name]
        stat = loc.file.stat()
        identity.update(f"{name}\0{loc.file}\0{stat.st_size}\0{stat.st_mtime_ns}\0{loc.begin}\n".encode())
    cached = cache_dir / f"{identity.hexdigest()[:24]}.safetensors"
    record = cached.with_suffix(".sha256")
    if cached.is_file() and record.is_file():
        return PartFile(cached, record.read_text().strip(), cached.stat().st_size)

    header: dict[str, object] = {"__metadata__": {"format": "pt", "hil_testbed_part": part.directory_name}}
    offset = 0
    for name in part.tensor_names:
        loc = source.tensors[name]
        size = loc.end - loc.begin
        header[name] = {"dtype": loc.dtype, "shape": list(loc.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % _HEADER_ALIGN)
    cache_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = cached.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as out:
        for chunk in (struct.pack("<Q", len(text)), text):
            out.write(chunk)
            digest.update(chunk)
        for name in part.tensor_names:
            loc = source.tensors[name]
            with open(loc.file, "rb") as handle:
                handle.seek(loc.begin)
                left = loc.end - loc.begin
                while left:
                    chunk = handle.read(min(left, _COPY_CHUNK))
                    if not chunk:
                        raise TestbedError(f"{loc.file}: ends inside tensor {name}")
                    out.write(chunk)
                    digest.update(chunk)
                    left -= len(chunk)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, cached)
    record.write_text(digest.hexdigest() + "\n")
    return PartFile(cached, digest.hexdigest(), cached.stat().st_size)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "hil-testbed" / "parts"


# -- on the node ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileTransfer:
    """What became of one file on one node."""

    path: str  # on the node
    size: int
    action: str  # present, sent, resumed, replaced (the node's copy was damaged)


def file_sha256(path: Path, limit: int | None = None) -> str:
    """sha256 of the file, or of its first ``limit`` bytes."""
    digest = hashlib.sha256()
    left = path.stat().st_size if limit is None else limit
    with open(path, "rb") as handle:
        while left > 0:
            chunk = handle.read(min(left, _COPY_CHUNK))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def ensure_file(t: Transport, local: Path, remote: str, sha256: str, *, say: Say = lambda _: None) -> FileTransfer:
    """Make ``remote`` (absolute) a verified copy of ``local``: nothing is sent when the node's copy
    has the hash; a ``.part`` left by an interrupted transfer is resumed when its bytes are a prefix
    of ``local`` (else restarted); the result is checked before it takes its final name."""
    size = local.stat().st_size
    partial = remote + ".part"
    q, qp = shlex.quote(remote), shlex.quote(partial)
    probe = t.run_script(
        f"if [ -f {q} ]; then sha256sum < {q} | cut -d' ' -f1; else echo none; fi; "
        f"if [ -f {qp} ]; then wc -c < {qp}; else echo 0; fi",
        timeout_s=max(60.0, size / 50e6),
    ).check()
    have, partial_size = (probe.stdout.split() + ["none", "0"])[:2]
    if have == sha256:
        return FileTransfer(remote, size, "present")
    action = "replaced" if have != "none" else "sent"
    offset = int(partial_size) if partial_size.isdigit() else 0
    if 0 < offset < size:
        prefix = t.run_script(f"head -c {offset} {qp} | sha256sum | cut -d' ' -f1", timeout_s=max(60.0, offset / 50e6))
        if prefix.ok and prefix.stdout.strip() == file_sha256(local, offset):
            action = "resumed"
        else:
            offset = 0
    else:
        offset = 0
    t.put(local, partial, mode=0o644, offset=offset, progress=_progress(t.node, remote, offset, size, say))
    settle = t.run_script(  # verify, then rename; a bad copy is not kept
        f"if [ \"$(sha256sum < {qp} | cut -d' ' -f1)\" = {sha256} ]; then mv -f {qp} {q}; "
        f"else rm -f {qp}; echo mismatch; fi",
        timeout_s=max(60.0, size / 50e6),
    ).check()
    if "mismatch" in settle.stdout:
        raise NodeError(t.node, f"{remote}: the copy does not match its sha256 after transfer; run provision again")
    return FileTransfer(remote, size, action)


def _progress(node: str, remote: str, offset: int, size: int, say: Say) -> Callable[[int], None] | None:
    if size < PROGRESS_FROM_BYTES:
        return None
    shown = [offset * 10 // size]

    def report(written: int) -> None:
        tenth = written * 10 // size
        if tenth > shown[0]:
            shown[0] = tenth
            say(f"{node}: {os.path.basename(remote)} {tenth * 10}% of {size / 2**20:.0f} MiB")

    return report


@dataclass(frozen=True)
class PlacedPart:
    """A part on a node: where the workers find it and what each file needed."""

    role: str
    directory: str
    sha256: str
    files: tuple[FileTransfer, ...]
    removed: tuple[str, ...] = ()  # weight files of an earlier cut, taken away


def place_part(
    t: Transport, source: ModelSource, part: WeightPart, part_file: PartFile, workdir: str, *, say: Say = lambda _: None
) -> PlacedPart:
    """Put a part and its small files in ``<workdir>/models/<model>/<role>-m<m>/`` on the node and
    remove weight files there that are not this part's (an older cut would be loaded beside it)."""
    directory = t.expand_path(f"{workdir.rstrip('/')}/models/{source.name}/{part.directory_name}")
    transfers = [ensure_file(t, part_file.path, f"{directory}/{part_file.name}", part_file.sha256, say=say)]
    for path in source.small_files(part.role):
        transfers.append(ensure_file(t, path, f"{directory}/{path.name}", file_sha256(path), say=say))
    stale = t.run_script(
        f"cd {shlex.quote(directory)} && for f in *.safetensors; do "
        f'[ -f "$f" ] && [ "$f" != {shlex.quote(part_file.name)} ] && rm -f "$f" && echo "$f"; done; true',
        timeout_s=30.0,
    ).check()
    removed = tuple(f"{directory}/{name}" for name in stale.stdout.split())
    return PlacedPart(part.role, directory, part_file.sha256, tuple(transfers), removed)


def roles_of(roles: Iterable[str]) -> list[str]:
    """The weight parts a node with these inventory roles needs."""
    return [r for r in ("device", "server") if r in set(roles)]
