"""notebooks/: committed without outputs, with a parameters cell (each run top to bottom:
test_e2e_explore_notebook.py, test_e2e_finetune_notebook.py)."""
import nbformat
import pytest

from helpers import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
NOTEBOOK = REPO / "notebooks" / "finetune_fewshot.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_have_no_outputs_and_a_parameters_cell(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.outputs == [] and c.execution_count is None for c in code)
  assert "parameters" in code[1].metadata.get("tags", [])


def test_committed_notebook_has_no_outputs_and_a_parameters_cell():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.outputs == [] and c.execution_count is None for c in code)
  assert "parameters" in code[1].metadata.get("tags", [])
  assert all(f"VIT_{name}" in code[1].source for name in ("PRETRAINED", "STEPS", "OUT_DIR"))
