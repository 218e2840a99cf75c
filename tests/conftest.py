"""Shared test set-up: offline Hugging Face, a headless matplotlib, the repository root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Set before anything imports transformers or matplotlib; notebook kernels started by nbval
# inherit them too. No test may reach the network: the model ships as a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository's top folder (where pyproject.toml is)."""
    return REPO_ROOT


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """The course's models are tiny: one thread runs them fastest, and on a 2-core machine whose cores
    the launched ranks share, several threads in the test process thrash (measured: 80 small
    generations took 144 s on 2 threads under load, 1.4 s on 1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Notebooks (nbval items) belong to the slow tier: `-m "not slow"` runs the library's tests only."""
    slow = pytest.mark.slow
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(slow)
