"""The notebooks: each .ipynb matches its jupytext .py twin, and both run top to bottom at
smoke size (MNJAX_NOTEBOOK_SMOKE=1), writing PNG plots a reader can open."""

import os
from pathlib import Path

# Before jupyter_core is imported: its platformdirs migration warning would be an error here.
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")

import jupytext
import matplotlib.image
import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
FIGURES = {
    "quickstart": ["quickstart_loss"],
    "scaling": ["allreduce_bandwidth", "measured_efficiency", "validation_sensitivity",
                "predicted_efficiency", "predicted_overlap", "predicted_compiled",
                "cluster_link", "predicted_slow_link"],
}


def _cells(notebook):
  return [(c.cell_type, c.source.strip()) for c in notebook.cells]


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_ipynb_and_py_are_the_same_notebook(name):
  py = jupytext.read(NOTEBOOKS / f"{name}.py")
  ipynb = jupytext.read(NOTEBOOKS / f"{name}.ipynb")
  assert _cells(py) == _cells(ipynb), (
      f"notebooks/{name}.ipynb and .py differ: run `jupytext --sync notebooks/{name}.py`")
  assert ipynb.metadata["jupytext"]["formats"] == "ipynb,py:percent"


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_notebook_runs_and_writes_its_plots(name, tmp_path, monkeypatch):
  monkeypatch.setenv("MNJAX_NOTEBOOK_SMOKE", "1")
  monkeypatch.setenv("MNJAX_FIGURES", str(tmp_path))
  notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  NotebookClient(notebook, timeout=900, kernel_name="python3",
                 resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
  errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.output_type == "error"]
  assert not errors
  for figure in FIGURES[name]:
    path = tmp_path / f"{figure}.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 200 and width > 300, (path, height, width)
