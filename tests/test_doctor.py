"""`python -m shardlib doctor`: a report an instructor can paste, exit code 0, the device each lesson
will use read from its parameters cell, and no spoiled forks afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch

from shardlib import devices
from shardlib.course import doctor

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_doctor(*arguments: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "shardlib", "doctor", *arguments], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


@pytest.mark.slow
def test_the_report_names_versions_gpus_forking_and_lessons():
    done = run_doctor()
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    for words in (f"torch         {torch.__version__}", "NCCL", "accelerate", "transformers",
                  "GPUs (read through NVML; CUDA not started)", "launch(fn, N) here", "forking: safe",
                  "lessons (notebooks)", "01_collectives.ipynb"):
        assert words in text, f"{words!r} missing from the report:\n{text}"
    assert str(REPO_ROOT) not in text, "the report shows the lessons' folder relative to where it runs"
    assert done.stderr == "", done.stderr


@pytest.mark.slow
def test_json_holds_the_same_facts():
    done = run_doctor("--json")
    assert done.returncode == 0, done.stdout + done.stderr
    facts = json.loads(done.stdout)
    assert facts["versions"]["torch"] == torch.__version__
    assert facts["fork_safe"] is True
    assert len(facts["gpus"]) == len(devices.visible_gpus())
    lessons = {entry["notebook"] for entry in facts["lessons"]}
    assert {p.name for p in (REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")} == lessons


# ---------------------------------------------------------------------------------
# lessons: their parameters cell


def write_lesson(folder: Path, name: str, parameters: str | None) -> Path:
    notebook = nbformat.v4.new_notebook()
    notebook.cells.append(nbformat.v4.new_code_cell("import shardlib"))
    if parameters is not None:
        notebook.cells.append(nbformat.v4.new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    notebook.cells.append(nbformat.v4.new_code_cell("print(1)"))
    path = folder / name
    nbformat.write(notebook, path)
    return path


@pytest.fixture
def two_gpus(monkeypatch):
    physical = tuple({"name": "Fake GPU", "uuid": f"GPU-{i}", "total_memory": 24 << 30, "capability": (8, 6)}
                     for i in range(2))
    monkeypatch.setattr(devices, "_nvml_inventory", lambda: (physical, {"driver": "999.1", "cuda": (99, 0)}, ""))
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_each_lesson_gets_the_device_its_parameters_ask_for_here(tmp_path, two_gpus):
    write_lesson(tmp_path, "01_a.ipynb", 'DEVICE = "auto"  # or "cpu", "cuda"\nWORLD_SIZES = (1, 2, 4)\n')
    write_lesson(tmp_path, "02_b.ipynb", 'DEVICE = "cuda"\nWORLD_SIZES = [2, 3]\nMODEL_ID = "x"\n')
    write_lesson(tmp_path, "03_c.ipynb", None)
    write_lesson(tmp_path, "04_d.ipynb", 'MODEL_ID = str(get_model_path())\n')
    write_lesson(tmp_path, "05_e.ipynb", 'DEVICE = "cpu"\nWORLD_SIZE = 2\n')
    facts = doctor.collect(str(tmp_path))
    lessons = {entry["notebook"]: entry for entry in facts["lessons"]}
    assert lessons["01_a.ipynb"]["plan"] == {"1": "cuda (NCCL)", "2": "cuda (NCCL)", "4": "cpu (gloo)"}
    plan = lessons["02_b.ipynb"]["plan"]
    assert plan["2"] == "cuda (NCCL)" and plan["3"].startswith("fails: device='cuda' needs one GPU per rank"), plan
    assert lessons["03_c.ipynb"]["note"] == "not parameterised"
    assert "MODEL_ID=str(get_model_path())" in lessons["04_d.ipynb"]["note"], lessons["04_d.ipynb"]
    assert lessons["05_e.ipynb"]["plan"] == {"2": "cpu (gloo)"}
    report = doctor.format_report(facts)
    assert "cuda:1  Fake GPU" in report and "bf16 native" in report, report
    assert "01_a.ipynb" in report and "N=4: cpu (gloo)" in report and "not parameterised" in report, report


def test_a_gpu_without_native_bf16_is_reported_with_fp16(monkeypatch, two_gpus):
    t4 = ({"name": "Tesla T4", "uuid": "GPU-9", "total_memory": 15 << 30, "capability": (7, 5)},)
    monkeypatch.setattr(devices, "_nvml_inventory", lambda: (t4, {"driver": "999.1", "cuda": (99, 0)}, ""))
    (gpu,) = doctor.gpus()
    assert gpu["sm"] == "sm_75" and not gpu["native_bf16"] and gpu["mixed_precision"] == "fp16 (loss scaling)", gpu


# ---------------------------------------------------------------------------------
# the doctor spoils no fork, in a notebook's process either

AFTER_DOCTOR = """
    import contextlib, io, json, os
    import torch
    import shardlib
    from shardlib.course import doctor

    def forked_child_is_in_bad_fork():
        pid = os.fork()
        if pid == 0:
            os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3

    with contextlib.redirect_stdout(io.StringIO()):
        codes = [doctor.main([]), doctor.main(["--json"])]
    after = forked_child_is_in_bad_fork()
    ranks = shardlib.launch(lambda: torch.cuda._is_in_bad_fork(), 2, device="cpu")
    torch.cuda.is_available()  # the control: this does spoil forks on a CUDA build
    print(json.dumps({"codes": codes, "after": after, "ranks": ranks, "control": forked_child_is_in_bad_fork()}))
"""


@pytest.mark.slow
def test_running_the_doctor_leaves_forks_usable():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(AFTER_DOCTOR)], capture_output=True, text=True,
                          timeout=180, env=env, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["codes"] == [0, 0], seen
    assert seen["after"] is False and seen["ranks"] == [False, False], f"the doctor spoiled later forks: {seen}"
    if torch.backends.cuda.is_built():
        assert seen["control"] is True, "the probe cannot see a bad fork at all"
