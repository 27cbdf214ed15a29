"""examples/quickstart.ipynb runs top to bottom offline."""

import pathlib

import nbclient  # test dependencies (pyproject.toml's [test] extra)
import nbformat
import pytest

NOTEBOOK = pathlib.Path(__file__).parent.parent / "examples" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "accuracy after compression" in outputs
    assert (tmp_path / "quickstart_report.png").stat().st_size > 10_000
    assert (tmp_path / "quickstart_slim.keras").exists()
