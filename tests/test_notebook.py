"""analysis/notebooks/walkthrough.ipynb: committed with its outputs (executed on the sample campaign,
tests/data/sample-campaign/), its cells exactly those scripts/make_walkthrough.py writes, and executed
again here top to bottom: no errors, and the same outputs in kind (streams, tables, figures) as the
committed ones; the numbers themselves are not compared.

Regenerate the committed notebook (the generator's cells, executed):
``.venv/bin/python -m tests.test_notebook``.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "analysis" / "notebooks" / "walkthrough.ipynb"
GENERATOR = REPO / "scripts" / "make_walkthrough.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_walkthrough", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generated(tmp: Path) -> nbformat.NotebookNode:
    """The notebook as the generator writes it (no outputs)."""
    module = generator()
    module.TARGET = tmp / "walkthrough.ipynb"
    module.main()
    return nbformat.read(module.TARGET, as_version=4)


def execute(nb: nbformat.NotebookNode, cwd: Path) -> nbformat.NotebookNode:
    """``nb`` executed from scratch in ``cwd`` (outputs cleared first; no timings, so the file stays stable)."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # iopub_timeout: how long a cell's outputs may trail its reply (nbclient's 4 s drops them silently)
    client = NotebookClient(
        nb, timeout=180, kernel_name="python3", record_timing=False, resources={"metadata": {"path": str(cwd)}},
        iopub_timeout=60,
    )
    client.execute()
    return nb


def output_text(output: nbformat.NotebookNode) -> str:
    if output.output_type == "stream":
        return output.text
    return output.get("data", {}).get("text/plain", "")


def shape(nb: nbformat.NotebookNode) -> list[tuple[str, str, int | None, list[tuple[str, str, tuple[str, ...]]]]]:
    """What a notebook holds without its numbers: each cell's kind, source, execution count and outputs
    (their type, stream name and mime types)."""
    return [
        (
            cell.cell_type,
            cell.source,
            cell.get("execution_count"),
            [(o.output_type, o.get("name", ""), tuple(sorted(o.get("data", {})))) for o in cell.get("outputs", [])],
        )
        for cell in nb.cells
    ]


def check_executed(nb: nbformat.NotebookNode) -> None:
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "not run top to bottom"
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert errors == [], [f"{o.ename}: {o.evalue}" for o in errors]
    assert all(cell.outputs for cell in code), [cell.source for cell in code if not cell.outputs]
    assert any("one request:" in output_text(o) for cell in code for o in cell.outputs)
    figure_cells = [cell for cell in code if "plots." in cell.source]
    assert figure_cells, "no cell draws a figure"
    for cell in figure_cells:
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.source
    report_cells = [cell for cell in code if "build_report" in cell.source]
    assert report_cells and any("report.md" in output_text(o) for o in report_cells[0].outputs)


def test_committed_walkthrough_is_executed_with_its_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    check_executed(nb)
    text = NOTEBOOK.read_text()
    assert str(REPO) not in text and "/tmp/" not in text, "outputs name this machine's paths"
    assert all("execution" not in cell.metadata for cell in nb.cells), "timings make every run a diff"


def test_committed_cells_are_the_generators(tmp_path: Path) -> None:
    fresh, committed = generated(tmp_path), nbformat.read(NOTEBOOK, as_version=4)
    assert [(c.get("id"), c.cell_type, c.source) for c in committed.cells] == [
        (c.get("id"), c.cell_type, c.source) for c in fresh.cells
    ], "regenerate: .venv/bin/python -m tests.test_notebook"
    assert committed.metadata["kernelspec"] == fresh.metadata["kernelspec"]


def test_walkthrough_runs_again_to_the_committed_outputs(tmp_path: Path) -> None:
    committed = nbformat.read(NOTEBOOK, as_version=4)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    again = execute(committed, cwd)
    check_executed(again)
    assert shape(again) == shape(committed), (
        "the notebook's outputs changed kind: .venv/bin/python -m tests.test_notebook"
    )
    assert list(cwd.iterdir()) == []  # the report cell writes into a temporary copy, not the working directory


def main() -> int:
    """Write the committed notebook: the generator's cells, executed in a scratch directory."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        nb = execute(generated(Path(tmp)), Path(tmp))
    check_executed(nb)
    nbformat.write(nb, NOTEBOOK)
    print(NOTEBOOK.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
