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
