"""Executes examples/quickstart.ipynb end to end so it cannot rot (about a minute on CPU)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"


@pytest.mark.timeout(300)
def test_quickstart_notebook_runs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "Paris" in text  # greedy SmolLM2 answer to "The capital of France is"
    assert "TTFT" in text and "goodput" in text
    images = [o for c in nb.cells for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "the sweep plot was not rendered"
