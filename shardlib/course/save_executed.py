"""Run a notebook as `jupyter nbconvert --execute --inplace` does, and save it: how lessons are saved.

    failed, outcome = run_keeping_outputs(notebook, folder, deadline)   # outputs go into the cells
    save_in_place(path, notebook, metadata)

The kernel is one of this very Python (whatever kernels are installed), started in the notebook's folder,
with figures inline (MPLBACKEND=INLINE_FIGURES: what a notebook saved by Jupyter shows, whatever the caller
has set). `python -m shardlib.course.measure_course --save` uses it, so that one quiet run gives both the
saved outputs and the guide's table of run times.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import nbformat

INLINE_FIGURES = "module://matplotlib_inline.backend_inline"

__all__ = ["INLINE_FIGURES", "run_keeping_outputs", "save_in_place"]


def this_python_kernel():
    """A kernel manager for a kernel of this very Python, whatever kernels are installed."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    class ThisPython(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    return KernelManager(kernel_name="this-python", kernel_spec_manager=ThisPython())


def run_keeping_outputs(notebook, folder: Path, deadline: float, *, env: dict | None = None,
                        on_kernel=None) -> tuple[list, str]:
    """Run every code cell of `notebook` (a NotebookNode, changed in place) in a fresh kernel started in
    `folder`, going on past errors, until `deadline` (time.monotonic()). Returns (indices of the cells that
    raised, "completed" | "timed out" | "kernel died"). env: more environment variables; on_kernel(pid):
    called once the kernel runs. The kernel's process group, ranks included, is killed at the end."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    env = {**os.environ, "MPLBACKEND": INLINE_FIGURES, **(env or {})}
    client = NotebookClient(notebook, km=this_python_kernel(), timeout=600, startup_timeout=120, allow_errors=True,
                            resources={"metadata": {"path": str(folder)}})
    failed, pgid = [], None
    try:
        with client.setup_kernel(cwd=str(folder), env=env):
            if on_kernel is not None:
                on_kernel(client.km.provisioner.process.pid)
            pgid = getattr(client.km.provisioner, "pgid", None)  # the kernel leads its own process group
            for index, cell in enumerate(notebook.cells):
                if cell.cell_type != "code" or not cell.source.strip():
                    continue
                client.timeout = max(1, int(deadline - time.monotonic()))
                try:
                    client.execute_cell(cell, index)
                except CellTimeoutError:
                    return failed, "timed out"
                except DeadKernelError:
                    return failed, "kernel died"
                if any(output.get("output_type") == "error" for output in cell.outputs):
                    failed.append(index)
    finally:
        if pgid is not None and pgid != os.getpgid(0):  # ranks a cell left behind go with the kernel
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return failed, "completed"


def save_in_place(path: Path, executed, metadata) -> None:
    """Write the executed notebook over `path`: the run's outputs, the notebook's own metadata; each
    cell's consecutive stream outputs merged and a progress bar's frames reduced to the last, as Jupyter
    shows them (nbconvert's CoalesceStreamsPreprocessor), so no blank output or stale frame is saved."""
    from nbconvert.preprocessors import CoalesceStreamsPreprocessor  # comes with JupyterLab

    CoalesceStreamsPreprocessor().preprocess(executed, {})
    executed.metadata = metadata
    nbformat.write(executed, path)
