"""Unit tests of provisioning's parts: the node wheel (built, then installed into a real venv), the
checkpoint cut by tensor name against the engine, the weight part files and their verified, resumable
transfer, and the pure planning and judging functions of ``testbed provision``.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shlex
import struct
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from foundation.errors import NodeError, TestbedError
from nodes.inference.checkpoint import load_part, save_checkpoint
from nodes.inference.config import LlamaConfig
from nodes.inference.model import ModelPart
from nodes.inference.partition import UShapePartition, checkpoint_tensor_names
from testbed.inventory import Inventory, load_inventory
from testbed.provisioning import node_code as node_code_module
from testbed.provisioning.node_wheel import node_wheel
from testbed.provisioning.provision import (
    compare_records,
    judge_readiness,
    missing_requirements,
    pip_download_argv,
    pip_install_argv,
    venv_create_command,
)
from testbed.provisioning.weights import (
    ModelSource,
    _progress,
    ensure_file,
    file_sha256,
    parse_partition,
    place_part,
    read_safetensors_header,
    weight_parts,
    write_part,
)
from testbed.transport import LocalTransport
from testbed.transport.facts import NodeFacts

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "examples" / "models" / "tiny"
MIB = 1 << 20

# --------------------------------------------------------------------------------------------
# the node wheel


def fresh_wheel():
    """A wheel built from scratch: neither the wheel's nor the node code's cache is used."""
    node_code_module.node_code.cache_clear()
    return node_wheel.__wrapped__()


def wheel_members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_the_wheel_is_byte_identical_across_builds_and_named_by_its_version():
    first, second = fresh_wheel(), fresh_wheel()
    assert first.data == second.data
    assert first.sha256 == second.sha256 == hashlib.sha256(first.data).hexdigest()
    code = node_code_module.node_code()
    assert code.digest == hashlib.sha256(code.data).hexdigest()[:16]
    assert first.version == f"{pyproject()['version']}+{code.digest}"
    assert first.filename == f"hil_testbed_nodes-{first.version}-py3-none-any.whl"
    assert first.path_on("/w/") == f"/w/wheels/{first.filename}"
    # The cached builder gives the same bytes.
    node_wheel.cache_clear()
    assert node_wheel().data == first.data


def test_the_wheel_holds_every_node_source_file_and_its_metadata():
    wheel = fresh_wheel()
    members = wheel_members(wheel.data)
    dist_info = f"hil_testbed_nodes-{wheel.version}.dist-info"
    sources = {
        str(p.relative_to(REPO)): p.read_bytes() for p in (REPO / "nodes").rglob("*.py") if "__pycache__" not in p.parts
    }
    assert "nodes/__init__.py" in sources and "nodes/installed.py" in sources
    assert {n: d for n, d in members.items() if not n.startswith(dist_info)} == sources
    assert sorted(n for n in members if n.startswith(dist_info)) == [
        f"{dist_info}/{n}" for n in ("METADATA", "RECORD", "WHEEL")
    ]
    wheel_file = members[f"{dist_info}/WHEEL"].decode()
    assert "Root-Is-Purelib: true" in wheel_file.splitlines() and "Tag: py3-none-any" in wheel_file.splitlines()


def test_the_wheel_metadata_requires_the_node_extra_without_torch_and_offers_the_kind_extras():
    wheel = fresh_wheel()
    metadata = wheel_members(wheel.data)[f"hil_testbed_nodes-{wheel.version}.dist-info/METADATA"].decode()
    lines = metadata.splitlines()
    assert "Name: hil-testbed-nodes" in lines and f"Version: {wheel.version}" in lines
    assert "Requires-Python: >=3.8" in lines
    optional = pyproject()["optional-dependencies"]
    node = [r for r in optional["node"] if Requirement(r).name != "torch"]
    assert len(node) == len(optional["node"]) - 1  # torch was there, and only torch left
    plain = [
        line.removeprefix("Requires-Dist: ") for line in lines if line.startswith("Requires-Dist:") and ";" not in line
    ]
    assert plain == node and list(wheel.requirements) == node
    assert not any(Requirement(r).name == "torch" for r in plain)
    for extra in ("jetson", "server"):
        assert f"Provides-Extra: {extra}" in lines
        marked = [r + f'; extra == "{extra}"' for r in optional[extra]]
        assert [
            line.removeprefix("Requires-Dist: ") for line in lines if line.endswith(f'extra == "{extra}"')
        ] == marked
        assert wheel.extras[extra] == tuple(optional[extra])
        for line in marked:  # each one parses, with its marker true only for its extra
            req = Requirement(line)
            assert req.marker is not None and req.marker.evaluate({"extra": extra})
            assert not req.marker.evaluate({"extra": "other"})
    # What non-Jetson nodes install beside it: the Makefile's pin.
    pins = [line.split("#")[0].strip() for line in (REPO / "constraints.txt").read_text().splitlines()]
    assert wheel.torch_requirement in pins and Requirement(wheel.torch_requirement).name == "torch"


def test_the_wheel_record_lists_every_entry_with_its_hash_and_size():
    wheel = fresh_wheel()
    members = wheel_members(wheel.data)
    record_name = f"hil_testbed_nodes-{wheel.version}.dist-info/RECORD"
    rows = list(csv.reader(io.StringIO(members[record_name].decode())))
    assert rows[-1] == [record_name, "", ""]
    assert {row[0] for row in rows} == set(members)
    for name, digest, size in rows[:-1]:
        data = members[name]
        expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={expected}", name
        assert int(size) == len(data), name


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="nodes.venv_overlay needs a venv's Python as its base")
def test_the_wheel_installs_offline_into_an_overlay_venv_and_reports_itself(tmp_path: Path):
    wheel = fresh_wheel()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel_path = wheels / wheel.filename
    wheel_path.write_bytes(wheel.data)
    constraints = wheels / "constraints.txt"
    constraints.write_text(wheel.torch_requirement + "\n")
    venv = tmp_path / "v"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    def run(argv: list[str], cwd: Path) -> str:
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, f"{shlex.join(argv)}:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    # As provisioning makes an emulated node's venv (see_base, the base is a venv with pip).
    command = venv_create_command(sys.executable, str(venv), see_base=True, base_is_venv=True, base_pip=True)
    run(shlex.split(command), tmp_path)
    run([sys.executable, "-m", "nodes.venv_overlay", str(venv)], REPO)

    base_bin = Path(sys.prefix) / "bin"
    assert (venv / "bin" / "mpiexec").is_symlink() and os.access(venv / "bin" / "mpiexec", os.X_OK)
    assert (venv / "bin" / "mpiexec").resolve() == (base_bin / "mpiexec").resolve()
    for script in ("pip", "pytest"):  # console scripts would run the base's Python: never linked
        assert (base_bin / script).read_bytes()[:2] == b"#!"
        assert not os.path.lexists(venv / "bin" / script)

    # The node's install command, offline: the wheel's requirements come from the base through the .pth.
    argv = pip_install_argv(str(venv), str(wheel_path), (), None, str(constraints), str(wheels))
    run(argv, tmp_path)
    site = json.loads(
        run([str(venv / "bin/python"), "-c", "import json, nodes; print(json.dumps(nodes.__file__))"], tmp_path)
    )
    assert Path(site).is_relative_to(venv), "the installed wheel, not the checkout, must be imported"

    report = json.loads(run([str(venv / "bin/python"), "-m", "nodes.installed"], tmp_path))
    assert report["python"]["prefix"] == str(venv)
    assert report["packages"]["hil-testbed-nodes"] == wheel.version
    assert report["mpi"]["abi"] == "mpich/libmpi.so.12"
    library = Path(report["mpi"]["library_file"])
    controller_library = (Path(sys.prefix) / "lib" / library.name).resolve()
    assert library.is_relative_to(venv / "lib") or library.resolve() == controller_library
    assert library.name.startswith("libmpi.so.12")


# --------------------------------------------------------------------------------------------
# the cut by tensor name, against the engine


def untied_model(directory: Path, layers: int = 5) -> Path:
    """A random untied model with attention biases, whose checkpoint also carries the rotary
    ``inv_freq`` buffers of old Llama checkpoints."""
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attention_bias=True,
        tie_word_embeddings=False,
    )
    path = save_checkpoint(ModelPart.whole(config), str(directory))
    tensors = load_file(path)
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(4)
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


def tensor_names(directory: Path) -> list[str]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return untied_model(tmp_path_factory.mktemp("untied"))


@pytest.mark.parametrize("which", ["tiny", "untied"])
def test_the_cut_by_name_is_what_the_engine_loads_for_every_part(which: str, untied: Path):
    directory = TINY if which == "tiny" else untied
    config = json.loads((directory / "config.json").read_text())
    layers, tied = config["num_hidden_layers"], config["tie_word_embeddings"]
    assert tied == (which == "tiny")
    names = tensor_names(directory)
    assert ("lm_head.weight" in names) == (not tied)
    cases = 0
    for m in (0, 1, layers - 2):
        partition = UShapePartition.make(layers, m, 2)
        device = checkpoint_tensor_names(names, partition.device_layer_ids(), True, True, tied)
        part = load_part(str(directory), partition.device_layer_ids(), embedding=True, head=True, dtype="float32")
        assert device == part.expected_tensor_names()
        for stage in partition.stage_layer_ids():
            server = checkpoint_tensor_names(names, stage, False, False, tied)
            assert server == load_part(str(directory), stage, dtype="float32").expected_tensor_names()
            assert server and all(n.startswith("model.layers.") for n in server)
            cases += 1
    assert cases == 6
    # A head without the embedding (and the reverse) reads what the engine reads too.
    for embedding, head in ((False, True), (True, False)):
        chosen = checkpoint_tensor_names(names, [0], embedding, head, tied)
        assert chosen == load_part(str(directory), [0], embedding, head, dtype="float32").expected_tensor_names()


def test_rotary_buffers_are_never_chosen(untied: Path):
    names = tensor_names(untied)
    buffers = [n for n in names if "rotary_emb" in n]
    assert len(buffers) == 5
    chosen = checkpoint_tensor_names(names, range(5), True, True, False)
    assert sorted(chosen) == sorted(set(names) - set(buffers))
    # Also a model-level buffer, as newer transformers versions would name it.
    assert checkpoint_tensor_names(["model.rotary_emb.inv_freq", *names], range(5), True, True, False) == chosen


# --------------------------------------------------------------------------------------------
# the checkpoint as the controller sees it


@pytest.fixture
def tiny_copy(tmp_path: Path) -> Path:
    """The tiny model's files in a directory of the test's own (its mtimes may be changed)."""
    directory = tmp_path / "tiny"
    directory.mkdir()
    for path in TINY.iterdir():
        if path.is_file():
            (directory / path.name).write_bytes(path.read_bytes())
    return directory


def test_a_model_source_reads_the_headers_of_a_checkpoint():
    source = ModelSource.open(TINY)
    assert (source.name, source.num_layers, source.tied) == ("tiny", 8, True)
    assert sorted(source.tensors) == sorted(tensor_names(TINY))
    location = source.tensors["model.norm.weight"]
    with safe_open(str(TINY / "model.safetensors"), framework="pt") as handle:
        tensor = handle.get_tensor("model.norm.weight")
    assert location.shape == tuple(tensor.shape) and location.dtype == "BF16"
    with open(location.file, "rb") as handle:
        handle.seek(location.begin)
        raw = handle.read(location.end - location.begin)
    assert raw == tensor.view(torch.int16).numpy().tobytes()
    assert [p.name for p in source.small_files("device")] == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    assert [p.name for p in source.small_files("server")] == ["config.json"]


def test_a_model_source_refuses_what_it_cannot_distribute(tmp_path: Path):
    with pytest.raises(TestbedError, match=r"no config\.json"):
        ModelSource.open(tmp_path)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    with pytest.raises(TestbedError, match=r"no \*\.safetensors") as plain:
        ModelSource.open(tmp_path)
    assert "convert" not in str(plain.value)
    (tmp_path / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(TestbedError, match=r"convert the \.bin files to safetensors"):
        ModelSource.open(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 2}')
    with pytest.raises(TestbedError, match="num_hidden_layers"):
        ModelSource.open(tmp_path)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 2}')
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(TestbedError, match="not a safetensors file"):
        ModelSource.open(tmp_path)


def test_a_tensor_in_two_weight_files_is_refused(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 1}')
    save_file({"model.norm.weight": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"model.norm.weight": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(TestbedError, match=r"model\.norm\.weight is also in .*a\.safetensors"):
        ModelSource.open(tmp_path)


@pytest.mark.parametrize(("text", "expected"), [("m=2,P=4", (2, 4)), ("P=1, m=0", (0, 1)), ("m=12,P=3", (12, 3))])
def test_parse_partition(text: str, expected: tuple[int, int]):
    assert parse_partition(text) == expected


@pytest.mark.parametrize(
    "text", ["", "m=2", "P=4", "m=2;P=4", "m=-1,P=2", "m=2,P=x", "m=2,P=4,q=1", "M=2,P=4", "m=2,P="]
)
def test_parse_partition_refuses_other_forms(text: str):
    with pytest.raises(TestbedError, match="--partition"):
        parse_partition(text)


def test_parse_partition_refuses_non_ascii_digits_and_repeated_keys_with_a_testbed_error():
    for text in ("m=²,P=4", "m=2,m=3,P=4"):
        with pytest.raises(TestbedError, match="--partition"):
            parse_partition(text)


def test_weight_parts_split_a_checkpoint_between_device_and_server():
    source = ModelSource.open(TINY)
    parts = weight_parts(source, 2, 4)
    device, server = parts["device"], parts["server"]
    assert (device.directory_name, server.directory_name) == ("device-m2", "server-m2")
    layer_of = {n: int(n.split(".")[2]) for n in source.tensors if n.startswith("model.layers.")}
    assert {layer_of[n] for n in device.tensor_names if n in layer_of} == {0, 1}
    assert {layer_of[n] for n in server.tensor_names} == set(range(2, 8))
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(device.tensor_names)
    # Disjoint, and together the whole checkpoint (the tied head reads the embedding).
    assert not set(device.tensor_names) & set(server.tensor_names)
    assert set(device.tensor_names) | set(server.tensor_names) == set(source.tensors)


@pytest.mark.parametrize(("m", "stages"), [(7, 2), (8, 1), (0, 9)])
def test_weight_parts_refuse_a_partition_the_model_cannot_take(m: int, stages: int):
    with pytest.raises(TestbedError, match=r"--partition: .*lower m or P"):
        weight_parts(ModelSource.open(TINY), m, stages)


# --------------------------------------------------------------------------------------------
# part files


def test_a_part_file_holds_exactly_the_parts_tensors_byte_for_byte(tiny_copy: Path, tmp_path: Path):
    source = ModelSource.open(tiny_copy)
    part = weight_parts(source, 2, 4)["device"]
    written = write_part(source, part, tmp_path / "cache")
    assert file_sha256(written.path) == written.sha256 == hashlib.sha256(written.path.read_bytes()).hexdigest()
    assert written.size == written.path.stat().st_size
    assert written.name == f"{written.sha256[:16]}.safetensors"
    with safe_open(str(written.path), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(part.tensor_names)
        assert handle.metadata() == {"format": "pt", "hil_testbed_part": "device-m2"}
        with safe_open(str(tiny_copy / "model.safetensors"), framework="pt") as original:
            for name in part.tensor_names:
                assert torch.equal(handle.get_tensor(name), original.get_tensor(name)), name
    locations = read_safetensors_header(written.path)
    for name in part.tensor_names:
        ours, theirs = locations[name], source.tensors[name]
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape)
        assert read_range(ours.file, ours.begin, ours.end) == read_range(theirs.file, theirs.begin, theirs.end)


def test_part_headers_are_padded_to_eight_bytes(tmp_path: Path):
    source = ModelSource.open(TINY)
    sizes = set()
    for m in (1, 2, 3):
        for part in weight_parts(source, m, 2).values():
            data = write_part(source, part, tmp_path).path.read_bytes()
            (header_size,) = struct.unpack("<Q", data[:8])
            assert header_size % 8 == 0
            header = data[8 : 8 + header_size]
            assert json.loads(header)["__metadata__"]["hil_testbed_part"] == part.directory_name
            sizes.add(len(header.rstrip(b" ")) % 8)
    assert len(sizes) > 1  # padding was needed for some of them


def read_range(path: Path, begin: int, end: int) -> bytes:
    with open(path, "rb") as handle:
        handle.seek(begin)
        return handle.read(end - begin)


def test_a_part_file_is_deterministic_and_cut_once(tiny_copy: Path, tmp_path: Path):
    source = ModelSource.open(tiny_copy)
    part = weight_parts(source, 2, 4)["server"]
    first = write_part(source, part, tmp_path / "cache")
    elsewhere = write_part(source, part, tmp_path / "other-cache")
    assert elsewhere.sha256 == first.sha256 and elsewhere.path.read_bytes() == first.path.read_bytes()
    stamp = first.path.stat().st_mtime_ns
    os.utime(first.path, ns=(stamp - 10**9, stamp - 10**9))  # a rewrite would show as a new mtime
    again = write_part(source, part, tmp_path / "cache")
    assert again == first
    assert first.path.stat().st_mtime_ns == stamp - 10**9
    # A checkpoint file that changed (by its mtime) is cut again, to a new cache entry.
    weights = tiny_copy / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    changed = write_part(ModelSource.open(tiny_copy), part, tmp_path / "cache")
    assert changed.path != first.path and changed.sha256 == first.sha256
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [
        ".safetensors",
        ".safetensors",
        ".sha256",
        ".sha256",
    ]


def test_placed_parts_load_as_checkpoints_and_replace_an_earlier_cut(tiny_copy: Path, tmp_path: Path):
    source = ModelSource.open(tiny_copy)
    parts = weight_parts(source, 2, 3)
    workdir = str(tmp_path / "node" / "work")
    t = LocalTransport("node-a")
    placed = {}
    for role, part in parts.items():
        part_file = write_part(source, part, tmp_path / "cache")
        placed[role] = place_part(t, source, part, part_file, workdir)
        directory = Path(placed[role].directory)
        assert directory == tmp_path / "node" / "work" / "models" / "tiny" / f"{role}-m2"
        assert [Path(f.path).name for f in placed[role].files] == [part_file.name] + [
            p.name for p in source.small_files(role)
        ]
        assert {f.action for f in placed[role].files} == {"sent"}
        assert sorted(p.name for p in directory.iterdir() if p.suffix == ".safetensors") == [part_file.name]
        assert placed[role].removed == ()
    device = load_part(placed["device"].directory, range(2), embedding=True, head=True, dtype="float32")
    whole = load_part(str(tiny_copy), range(2), embedding=True, head=True, dtype="float32")
    for name, tensor in whole.state_dict().items():
        assert torch.equal(device.state_dict()[name], tensor), name
    server = load_part(placed["server"].directory, range(2, 8), dtype="float32")
    assert server.expected_tensor_names() == sorted(parts["server"].tensor_names)

    # Again, with the weight file of an older cut beside it: nothing is sent, the old file goes.
    stale = Path(placed["device"].directory) / "0123456789abcdef.safetensors"
    stale.write_bytes(b"old")
    part_file = write_part(source, parts["device"], tmp_path / "cache")
    again = place_part(t, source, parts["device"], part_file, workdir)
    assert {f.action for f in again.files} == {"present"}
    assert not stale.exists()
    assert again.removed == (str(stale),)
    assert sorted(p.name for p in stale.parent.iterdir() if p.suffix == ".safetensors") == [part_file.name]


# --------------------------------------------------------------------------------------------
# verified, resumable transfers


class Interrupted(Exception):
    pass


class InterruptibleTransport(LocalTransport):
    """The local transport, recording each put's offset; ``interrupt`` makes the next put stop
    after its first chunk, as a dropped connection would."""

    def __init__(self) -> None:
        super().__init__("node-a")
        self.interrupt = False
        self.puts: list[tuple[str, int]] = []

    def put(self, local, remote, *, mode=None, offset=0, progress=None) -> None:
        self.puts.append((remote, offset))
        if self.interrupt:
            self.interrupt = False
            progress = stop_after_first_chunk()
        super().put(local, remote, mode=mode, offset=offset, progress=progress)


def stop_after_first_chunk() -> Callable[[int], None]:
    def progress(written: int) -> None:
        raise Interrupted(written)

    return progress


@pytest.fixture
def payload(tmp_path: Path) -> Path:
    path = tmp_path / "local" / "weights.bin"
    path.parent.mkdir()
    path.write_bytes(os.urandom(2 * MIB + 123_457))  # more than two 1 MiB chunks
    return path


def test_ensure_file_sends_then_finds_then_repairs(payload: Path, tmp_path: Path):
    t = InterruptibleTransport()
    remote = str(tmp_path / "node" / "models" / "x" / "weights.bin")
    digest = file_sha256(payload)
    first = ensure_file(t, payload, remote, digest)
    assert (first.path, first.size, first.action) == (remote, payload.stat().st_size, "sent")
    assert Path(remote).read_bytes() == payload.read_bytes()
    assert not os.path.exists(remote + ".part")
    assert t.puts == [(remote + ".part", 0)]
    assert Path(remote).stat().st_mode & 0o777 == 0o644

    assert ensure_file(t, payload, remote, digest).action == "present"
    assert len(t.puts) == 1  # nothing sent

    data = bytearray(Path(remote).read_bytes())
    data[MIB + 5] ^= 0xFF
    Path(remote).write_bytes(bytes(data))
    assert ensure_file(t, payload, remote, digest).action == "replaced"
    assert Path(remote).read_bytes() == payload.read_bytes()


def test_ensure_file_places_a_path_with_a_backslash_or_space(payload: Path, tmp_path: Path):
    # sha256sum FILE escapes such names in its output (a leading backslash); the hash must still match
    remote = str(tmp_path / "node" / "odd\\dir name" / "weights.bin")
    assert ensure_file(InterruptibleTransport(), payload, remote, file_sha256(payload)).action == "sent"
    assert ensure_file(InterruptibleTransport(), payload, remote, file_sha256(payload)).action == "present"


def test_ensure_file_resumes_a_true_prefix_and_restarts_garbage(payload: Path, tmp_path: Path):
    t = InterruptibleTransport()
    remote = str(tmp_path / "node" / "weights.bin")
    Path(remote).parent.mkdir()
    digest = file_sha256(payload)
    content = payload.read_bytes()

    Path(remote + ".part").write_bytes(content[:1000])
    assert ensure_file(t, payload, remote, digest).action == "resumed"
    assert t.puts[-1] == (remote + ".part", 1000)
    assert Path(remote).read_bytes() == content and not os.path.exists(remote + ".part")

    os.remove(remote)
    Path(remote + ".part").write_bytes(os.urandom(1000))
    assert ensure_file(t, payload, remote, digest).action == "sent"
    assert t.puts[-1] == (remote + ".part", 0)
    assert Path(remote).read_bytes() == content

    os.remove(remote)  # a .part longer than the file: restarted, and cut to the file's length
    Path(remote + ".part").write_bytes(content + b"trailing garbage")
    assert ensure_file(t, payload, remote, digest).action == "sent"
    assert Path(remote).read_bytes() == content


def test_an_interrupted_transfer_never_leaves_a_partial_file_under_the_final_name(payload: Path, tmp_path: Path):
    t = InterruptibleTransport()
    remote = str(tmp_path / "node" / "weights.bin")
    digest = file_sha256(payload)
    content = payload.read_bytes()

    with pytest.raises(Interrupted):
        t.put(payload, remote + ".part", progress=stop_after_first_chunk())
    assert not os.path.exists(remote)
    partial = Path(remote + ".part").read_bytes()
    assert 0 < len(partial) < len(content) and content.startswith(partial)

    # The same through ensure_file: the transfer breaks off, the final name stays absent.
    os.remove(remote + ".part")
    t.interrupt = True
    with pytest.raises(Interrupted):
        ensure_file(t, payload, remote, digest)
    assert not os.path.exists(remote)
    partial = Path(remote + ".part").read_bytes()
    assert 0 < len(partial) < len(content) and content.startswith(partial)

    again = ensure_file(t, payload, remote, digest)
    assert again.action == "resumed"
    assert t.puts[-1] == (remote + ".part", len(partial))
    assert Path(remote).read_bytes() == content and not os.path.exists(remote + ".part")


def test_a_copy_that_does_not_match_its_hash_is_not_kept(payload: Path, tmp_path: Path):
    t = LocalTransport("node-a")
    remote = str(tmp_path / "node" / "weights.bin")
    with pytest.raises(NodeError, match="does not match its sha256"):
        ensure_file(t, payload, remote, "0" * 64)
    assert not os.path.exists(remote) and not os.path.exists(remote + ".part")


def test_progress_is_reported_by_tenths_for_large_files_only():
    assert _progress("n", "/w/x.safetensors", 0, 10 * MIB, print) is None
    said: list[str] = []
    size = 100 * MIB
    report = _progress("n", "/w/x.safetensors", 30 * MIB, size, said.append)
    assert report is not None
    for written in (31 * MIB, 39 * MIB, 40 * MIB, 45 * MIB, 73 * MIB, size):
        report(written)
    assert said == [f"n: x.safetensors {p}% of 100 MiB" for p in (40, 70, 100)]


# --------------------------------------------------------------------------------------------
# provisioning plans


@pytest.mark.parametrize(
    ("see_base", "base_is_venv", "base_pip", "base_ensurepip", "flags"),
    [
        (False, False, False, True, []),
        (False, True, True, True, []),  # a node that does not see its base gets its own pip
        (True, False, False, True, ["--system-site-packages"]),
        (True, False, True, True, ["--system-site-packages"]),  # a Jetson with python3-venv: its own pip
        (True, False, True, False, ["--system-site-packages", "--without-pip"]),  # without: the system's pip
        (True, True, False, True, ["--system-site-packages"]),
        (True, True, True, True, ["--system-site-packages", "--without-pip"]),
    ],
)
def test_venv_create_command(
    see_base: bool, base_is_venv: bool, base_pip: bool, base_ensurepip: bool, flags: list[str]
) -> None:
    command = venv_create_command(
        "/usr/bin/python3", "/home/u/hil testbed/venv", see_base=see_base, base_is_venv=base_is_venv,
        base_pip=base_pip, base_ensurepip=base_ensurepip,
    )  # fmt: skip
    assert shlex.split(command) == ["/usr/bin/python3", "-m", "venv", *flags, "/home/u/hil testbed/venv"]


def test_pip_install_argv_online_and_offline():
    head = ["/v/bin/python", "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    assert pip_install_argv("/v", "/w/wheels/n.whl", ("jetson",), None, "/w/wheels/constraints.txt", "/w/wheels") == [
        *head, "--no-index", "--find-links", "/w/wheels", "-c", "/w/wheels/constraints.txt", "/w/wheels/n.whl[jetson]"
    ]  # fmt: skip
    assert pip_install_argv("/v", "/w/n.whl", (), "torch==2.13.0", "/w/c.txt", None) == [
        *head, "-c", "/w/c.txt", "/w/n.whl", "torch==2.13.0"
    ]  # fmt: skip
    assert pip_install_argv("/v", "/w/n.whl", ("a", "b"), "", "/w/c.txt", None)[-1] == "/w/n.whl[a,b]"


def test_pip_download_argv_targets_the_nodes_platform():
    argv = pip_download_argv(["jetson-stats>=4.2", "numpy>=1.24"], Path("/c/wh"), "3.8", "aarch64", "2.36")
    assert argv[:6] == [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--only-binary=:all:"]
    pairs = list(zip(argv[6:-2:2], argv[7:-2:2], strict=True))
    assert argv[-2:] == ["jetson-stats>=4.2", "numpy>=1.24"]
    options: dict[str, list[str]] = {}
    for option, value in pairs:
        options.setdefault(option, []).append(value)
    assert options["--dest"] == ["/c/wh"]
    assert options["--python-version"] == ["3.8"] and options["--implementation"] == ["cp"]
    assert options["--abi"] == ["cp38", "abi3", "none"]
    glibc_tags = [f"manylinux_2_{g}_aarch64" for g in range(36, 16, -1)]
    assert options["--platform"] == [*glibc_tags, "manylinux2014_aarch64", "any"]
    assert len(glibc_tags) == 20 and glibc_tags[-1] == "manylinux_2_17_aarch64"


@pytest.mark.parametrize(("python", "version", "abi"), [("3.10.12", "3.10", "cp310"), ("3.11", "3.11", "cp311")])
def test_pip_download_argv_abi_and_an_unknown_glibc(python: str, version: str, abi: str):
    argv = pip_download_argv([], Path("/d"), python, "x86_64", "")
    assert argv[argv.index("--python-version") + 1] == version
    assert argv[argv.index("--abi") + 1] == abi
    platforms = [argv[i + 1] for i, word in enumerate(argv) if word == "--platform"]
    assert platforms == ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]


def test_missing_requirements_from_pip_errors():
    output = (
        "Looking in links: /w/wheels\n"
        "Processing /w/wheels/hil_testbed_nodes-0.1.0+abc-py3-none-any.whl\n"
        'ERROR: Could not find a version that satisfies the requirement jetson-stats>=4.2; extra == "jetson" '
        "(from hil-testbed-nodes[jetson]) (from versions: none)\n"
        'ERROR: No matching distribution found for jetson-stats>=4.2; extra == "jetson"\n'
    )
    assert missing_requirements(output) == ["jetson-stats>=4.2"]
    two = (
        "ERROR: No matching distribution found for numpy>=1.24\n"
        "ERROR: No matching distribution found for mpich>=4.1\n"
        "ERROR: No matching distribution found for numpy>=1.24\n"
    )
    assert missing_requirements(two) == ["mpich>=4.1", "numpy>=1.24"]
    assert missing_requirements("ERROR: Could not install packages due to an OSError: [Errno 28] No space left") == []


# --------------------------------------------------------------------------------------------
# readiness

READINESS_INVENTORY = """\
nodes:
  - name: orin
    kind: jetson
    model: agx-orin
    address: 192.168.1.3
  - name: gpu
    kind: server
    model: a6000-server
    address: 192.168.1.2
    gpus: 1
"""

GIB_KB = 1 << 20


@pytest.fixture
def readiness_inventory(tmp_path: Path) -> Inventory:
    path = tmp_path / "inventory.yaml"
    path.write_text(textwrap.dedent(READINESS_INVENTORY))
    return load_inventory(path)


def good_values(**changes: list[str]) -> dict[str, list[str]]:
    values = {
        "tool": ["tc", "ip", "iperf3", "apt-get", "timedatectl", "systemctl", "nvidia-smi"],
        "sudo_needed": ["HIL_TC", "HIL_IP", "HIL_PROBE"],
        "sudo_ok": ["HIL_TC", "HIL_IP", "HIL_PROBE"],
        "workdir_free_kb": [str(20 * GIB_KB)],
        "ntp_synchronized": ["yes"],
        "board_service": ["active"],  # the Jetsons' jtop unit, as the probe names it
    }
    values.update(changes)
    return values


def facts_for(name: str, kind: str, **changes: object) -> NodeFacts:
    return NodeFacts(**{"node": name, "kind": kind, "user": "nvidia", "sudo": "yes", **changes})  # type: ignore[arg-type]


def judge(inventory: Inventory, name: str, values: dict[str, list[str]], need_gib: float = 1.5, **facts: object):
    node = inventory.node(name)
    return judge_readiness(node, facts_for(name, node.kind, **facts), values, need_gib=need_gib, sudo_used=True)


@pytest.mark.parametrize("name", ["orin", "gpu"])
def test_a_ready_node_has_nothing_missing_and_no_warnings(readiness_inventory: Inventory, name: str):
    assert judge(readiness_inventory, name, good_values()) == ([], [])


def test_a_missing_tool_is_fixed_with_apt_where_there_is_apt(readiness_inventory: Inventory):
    tools = ["tc", "ip", "apt-get", "nvidia-smi"]
    missing, _ = judge(readiness_inventory, "gpu", good_values(tool=tools))
    assert missing == [("iperf3", "sudo apt-get install -y iperf3")]
    missing, _ = judge(readiness_inventory, "gpu", good_values(tool=["dnf", "nvidia-smi"], sudo_needed=[], sudo_ok=[]))
    assert missing == [
        ("tc", "install iproute2 with the node's package manager"),
        ("ip", "install iproute2 with the node's package manager"),
        ("iperf3", "install iperf3 with the node's package manager"),
    ]


def test_passwordless_sudo_for_the_suites_rules_is_needed_only_where_sudo_is_used(readiness_inventory: Inventory):
    node = readiness_inventory.node("gpu")
    values = good_values(sudo_ok=["HIL_TC", "HIL_PROBE"])
    missing, _ = judge_readiness(node, facts_for("gpu", "server"), values, need_gib=1.0, sudo_used=True)
    assert [w for w, _ in missing] == ["passwordless sudo for HIL_IP (exactly the suite's commands)"]
    assert "nvidia ALL=(root) NOPASSWD: HIL_TC, HIL_IP" in missing[0][1]
    assert "Cmnd_Alias HIL_IP = /usr/sbin/ip link add * type ifb" in missing[0][1]
    # a Jetson's tools where the node has them (an emulated one's stand-ins)
    values = good_values(sudo_needed=["HIL_JETSON"], sudo_ok=[], tool_path=["nvpmodel:/opt/x/nvpmodel"])
    missing, _ = judge_readiness(node, facts_for("gpu", "server", sudo="no"), values, need_gib=1.0, sudo_used=True)
    assert "/opt/x/nvpmodel -m [0-9]" in missing[0][1] and "/usr/sbin/nvpmodel" not in missing[0][1]
    assert judge_readiness(node, facts_for("gpu", "server"), values, need_gib=1.0, sudo_used=False) == ([], [])
    assert judge_readiness(node, facts_for("gpu", "server", sudo="root"), values, need_gib=1.0, sudo_used=True) == (
        [],
        [],
    )


def test_too_little_disk_names_the_space_free_and_needed(readiness_inventory: Inventory):
    missing, _ = judge(
        readiness_inventory, "gpu", good_values(workdir_free_kb=[str(GIB_KB + GIB_KB // 4)]), need_gib=2.5
    )
    assert len(missing) == 1
    what, fix = missing[0]
    assert "1.2 GiB free" in what and "2.5 GiB needed" in what
    assert "defaults.workdir" in fix
    assert judge(readiness_inventory, "gpu", good_values(workdir_free_kb=[str(3 * GIB_KB)]), need_gib=2.5) == ([], [])


def test_an_unsynchronised_clock_warns_unless_chrony_keeps_it_close(readiness_inventory: Inventory):
    far = "System time     : 0.250000000 seconds fast of NTP time"
    _, warnings = judge(readiness_inventory, "gpu", good_values(ntp_synchronized=["no"], chrony=[far]))
    assert len(warnings) == 1
    assert "clock is not synchronised" in warnings[0] and "0.250000000 seconds fast" in warnings[0]
    assert "timedatectl set-ntp true" in warnings[0]
    close = "System time     : 0.001000000 seconds slow of NTP time"
    assert judge(readiness_inventory, "gpu", good_values(ntp_synchronized=["no"], chrony=[close])) == ([], [])
    _, warnings = judge(readiness_inventory, "gpu", good_values(ntp_synchronized=["no"]))
    assert len(warnings) == 1 and "NTPSynchronized=no" in warnings[0]


def test_jetson_warnings_are_for_real_boards_only(readiness_inventory: Inventory):
    values = good_values(board_service=["inactive"])
    _, warnings = judge(readiness_inventory, "orin", values)
    assert len(warnings) == 1 and "jtop service is not active" in warnings[0]
    assert "systemctl enable --now jtop" in warnings[0]
    unsynced = good_values(
        board_service=["inactive"], ntp_synchronized=["no"], chrony=["System time : 3.0 seconds slow"]
    )
    assert len(judge(readiness_inventory, "orin", unsynced)[1]) == 2
    # an emulated board has no jtop, and its clock is what its stand-in timedatectl says of it
    _, warnings = judge(readiness_inventory, "orin", unsynced, emulated=True)
    assert len(warnings) == 1 and "clock is not synchronised" in warnings[0]
    # The server is no Jetson: jtop is not its business.
    assert judge(readiness_inventory, "gpu", values) == ([], [])


def test_a_gpu_server_needs_nvidia_smi(readiness_inventory: Inventory):
    tools = ["tc", "ip", "iperf3", "apt-get"]
    missing, _ = judge(readiness_inventory, "gpu", good_values(tool=tools))
    assert missing == [("nvidia-smi (NVIDIA driver)", "install the NVIDIA driver for the server's GPUs")]
    assert judge(readiness_inventory, "orin", good_values(tool=tools)) == ([], [])


# --------------------------------------------------------------------------------------------
# records across nodes


def record(abi: str | None, wheel: str | None = "0.1.0+aaaa") -> dict:
    return {"installed": {"mpi": {"abi": abi}} if abi else {}, "installed_wheel": wheel}


def test_an_odd_mpi_abi_is_one_problem_naming_the_node_and_a_fix():
    records = {
        "a": record("mpich/libmpi.so.12"),
        "b": record("mpich/libmpi.so.12"),
        "c": record("openmpi/libmpi.so.40"),
    }
    problems = compare_records(records)
    assert len(problems) == 1
    assert problems[0].startswith("c: MPI ABI openmpi/libmpi.so.40 differs from mpich/libmpi.so.12 on a, b; ")
    assert "same MPI family" in problems[0] and "provision again" in problems[0]


def test_equal_records_and_unknown_values_are_no_problem():
    same = {name: record("mpich/libmpi.so.12") for name in ("a", "b", "c")}
    assert compare_records(same) == []
    # A node whose provisioning failed (no report, no wheel) or whose MPI did not load is not compared.
    same["d"] = record(None, None)
    same["e"] = {"installed": {"mpi": {"error": "ImportError: no libmpi"}}, "installed_wheel": "0.1.0+aaaa"}
    assert compare_records(same) == []
    assert compare_records({}) == []


def test_a_differing_node_code_version_is_a_problem():
    records = {
        "a": record("mpich/libmpi.so.12"),
        "b": record("mpich/libmpi.so.12"),
        "c": record("mpich/libmpi.so.12", "0.1.0+bbbb"),
    }
    problems = compare_records(records)
    assert problems == [
        "c: node code version 0.1.0+bbbb differs from 0.1.0+aaaa on a, b; "
        "provision every node from the same checkout: testbed provision"
    ]


def test_a_nodes_changes_are_summed_up_by_kind_not_by_reading_their_words():
    from testbed.provisioning.provision import NodeProvision

    changes = ("made the venv /v", "installed w.whl[jetson]", "sent a (1.0 MiB)", "resumed b (2.0 MiB)")
    done = NodeProvision("orin", changes, (), (), {}, ("venv", "wheel", "weights", "weights"))
    assert done.summary() == "venv made, wheel installed, 2 weight files sent"
    assert NodeProvision("orin", (), (), ()).summary() == "no changes"
