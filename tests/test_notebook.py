"""analysis/notebooks/walkthrough.ipynb: it runs top to bottom on the sample campaign, and the checked-in
file is exactly what scripts/make_walkthrough.py generates (clean, no outputs)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO

NOTEBOOK = REPO / "analysis" / "notebooks" / "walkthrough.ipynb"
GENERATOR = REPO / "scripts" / "make_walkthrough.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_walkthrough", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def output_text(output: nbformat.NotebookNode) -> str:
    if output.output_type == "stream":
        return output.text
    return output.get("data", {}).get("text/plain", "")


def test_walkthrough_runs_top_to_bottom(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count is not None for cell in code)
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert errors == [], [f"{o.ename}: {o.evalue}" for o in errors]
    assert any("one request:" in output_text(o) for cell in code for o in cell.outputs)
    figure_cells = [cell for cell in code if "plots." in cell.source]
    assert figure_cells, "no cell draws a figure"
    for cell in figure_cells:
        assert any("image/png" in o.get("data", {}) for o in cell.outputs), cell.source
    assert list(tmp_path.iterdir()) == []  # the report cell writes into a temporary copy, not the cwd


def test_checked_in_walkthrough_has_no_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source


def test_walkthrough_is_exactly_what_its_generator_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = generator()
    target = tmp_path / "walkthrough.ipynb"
    monkeypatch.setattr(module, "TARGET", target)
    module.main()
    assert json.loads(target.read_text()) == json.loads(NOTEBOOK.read_text())
    assert target.read_bytes() == NOTEBOOK.read_bytes(), "regenerate: .venv/bin/python scripts/make_walkthrough.py"
    sources = [cell.source for cell in nbformat.read(target, as_version=4).cells]
    assert sources == [source for _, source in module.CELLS]
