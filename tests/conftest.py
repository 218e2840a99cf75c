"""Shared test set-up: offline Hugging Face, a headless matplotlib, the repository root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import notebook_kernels

# Set before anything imports transformers or matplotlib; notebook kernels started by nbval
# inherit them too. No test may reach the network: the model ships as a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")

REPO_ROOT = Path(__file__).resolve().parent.parent

# Seconds each long file took (setup, calls and teardown; the whole suite on 2 workers with --junitxml,
# on a quiet 2-core machine): the workers take the files longest first, so that the last ones to start
# are short and the workers finish together. A file not listed counts as NEW_NOTEBOOK_S or NEW_FILE_S.
# The order changes no result; refresh the numbers when a file's time changes a lot.
FILE_SECONDS = {
    "tests/test_labs.py": 645,
    "tests/test_grade_sandbox.py": 420,
    "notebooks/08_finetune_accelerate_fsdp.ipynb": 240,
    "tests/test_slurm.py": 220,
    "tests/test_grade.py": 215,
    "notebooks/10_serving_under_load.ipynb": 115,
    "tests/test_browser.py": 90,
    "notebooks/07_quantization_vs_sharding.ipynb": 85,
    "tests/test_finetune.py": 70,
    "notebooks/13_where_the_time_goes.ipynb": 65,
    "tests/test_packaging.py": 55,
    "notebooks/06_hybrid_and_planning.ipynb": 50,
    "tests/test_frameworks.py": 50,
    "notebooks/05_pipeline_parallel.ipynb": 50,
    "notebooks/14_at_full_scale.ipynb": 40,
    "notebooks/09_frameworks.ipynb": 40,
    "notebooks/01_collectives.ipynb": 25,
    "tests/test_devices.py": 25,
    "tests/test_launch.py": 25,
    "tests/test_multinode.py": 25,
    "tests/test_plan.py": 25,
}
NEW_NOTEBOOK_S, NEW_FILE_S = 60, 10  # a lesson takes about a minute; most test files a few seconds


def pytest_configure(config):
    """nbval's kernels start through tests/notebook_kernels.py: stderr kept, one fresh start if one does not answer."""
    notebook_kernels.install()


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
    """Notebooks (nbval items) belong to the slow tier: `-m "not slow"` runs the library's tests only.
    Under pytest-xdist the files go to the workers longest first (see FILE_SECONDS)."""
    slow = pytest.mark.slow
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = longest_first(items, config.rootpath)


def longest_first(items: list, root: Path) -> list:
    """The items file by file, the longest files first, each file's items in their own order."""
    def seconds(item) -> float:
        path = item.path.relative_to(root).as_posix()
        return FILE_SECONDS.get(path, NEW_NOTEBOOK_S if item.path.suffix == ".ipynb" else NEW_FILE_S)

    return sorted(items, key=seconds, reverse=True)  # stable: a file's items keep their order


def run_folder(tmp_path_factory) -> Path:
    """This run's temporary folder, the same for every pytest-xdist worker (each has its own inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def built_site(tmp_path_factory) -> Path:
    """The course's website built once per session, as `python3 course.py site` builds it, into a
    temporary folder (tests/test_site.py, tests/test_browser.py). Skipped where the `site` extra is missing.
    Under pytest-xdist the workers share one build: the first to need it builds it under a file lock in
    the run's common temporary folder, the other waits for it and reads it."""
    import importlib.util
    import subprocess
    import sys

    from filelock import FileLock

    for module in ("sphinx", "myst_nb", "sphinx_book_theme"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: the website's build tools are pyproject's `site` extra, "
                        "which `python3 course.py test` installs (or pip install -e '.[site]')")
    spec = importlib.util.spec_from_file_location("course", REPO_ROOT / "course.py")
    course = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(course)
    shared = run_folder(tmp_path_factory)
    out = shared / "site" / "html"
    with FileLock(shared / "site.lock", timeout=600):
        if not (shared / "site" / "built").is_file():
            out.parent.mkdir(exist_ok=True)
            command = [str(part) for part in course.site_command(Path(sys.executable), out)]
            built = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
            assert built.returncode == 0, f"the website did not build (every Sphinx warning is an error):\n" \
                                          f"{built.stdout[-4000:]}{built.stderr[-6000:]}"
            (shared / "site" / "built").touch()
    return out
