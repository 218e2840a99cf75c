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


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The course's website built once per session, as `python3 course.py site` builds it, into a
    temporary folder (tests/test_site.py, tests/test_browser.py). Skipped where the `site` extra is missing."""
    import importlib.util
    import subprocess
    import sys

    for module in ("sphinx", "myst_nb", "sphinx_book_theme"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: the website's build tools are pyproject's `site` extra, "
                        "which `python3 course.py test` installs (or pip install -e '.[site]')")
    spec = importlib.util.spec_from_file_location("course", REPO_ROOT / "course.py")
    course = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(course)
    out = tmp_path_factory.mktemp("site") / "html"
    command = [str(part) for part in course.site_command(Path(sys.executable), out)]
    built = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert built.returncode == 0, f"the website did not build (every Sphinx warning is an error):\n" \
                                  f"{built.stdout[-4000:]}{built.stderr[-6000:]}"
    return out
