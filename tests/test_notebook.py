"""notebooks/plan_inspection.ipynb executes top to bottom without a cell error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "plan_inspection.ipynb")


def _kernel_name() -> str:
    """The venv's python3 kernelspec (ipykernel ships it under sys.prefix/share/jupyter).
    If it is missing, register one for this interpreter under sys.prefix; never --user."""
    from jupyter_client.kernelspec import KernelSpecManager

    ksm = KernelSpecManager()
    if "python3" not in ksm.find_kernel_specs():
        from ipykernel.kernelspec import install

        install(prefix=sys.prefix, kernel_name="python3")
    return "python3"


@pytest.mark.slow
def test_plan_inspection_notebook_runs_without_errors(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    pytest.importorskip("transformers")
    from traitlets.config import Config

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel talks over Unix sockets, not TCP: jupyter_client picks free TCP ports and binds
    # them later, and in a full suite a rank's gloo or rendezvous socket took one in between
    # ("ZMQError: Address already in use", the kernel died before replying). The socket paths
    # are absolute: the kernel runs in the notebook's folder, the client here.
    ipc = Config()
    ipc.KernelManager.transport = "ipc"
    ipc.KernelManager.ip = str(tmp_path / "kernel")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name=_kernel_name(), config=ipc,
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()  # raises CellExecutionError naming the cell on the first error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 5  # breakdown, two module graphs, one layer's nodes, timeline (+ the 70B plots)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "LlamaForCausalLM" in text and "64 × H100-80GB" in text
