"""examples/quickstart.ipynb runs top to bottom against the test cluster (nbclient, a real kernel)."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_executes(ray_cluster, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster["address"])  # the kernel inherits it
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "final loss:" in outputs and "alice has 3 red apples. bob has" in outputs
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))  # the plot
