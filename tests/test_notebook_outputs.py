"""Saved outputs a learner reads first must be clean: no absolute paths of the machine that ran them,
no tracebacks or error outputs, no warning or error log lines, no pile of progress-bar frames.

One test per committed notebook (notebooks/, labs/, solutions/), each failure listing every offending
cell. A cell may show a few progress bars (each bar's first and final frame); more than MAX_FRAMES
frames in one cell are the intermediate frames of a bar that redrew itself into the saved output:
finalize the bar, raise tqdm's `mininterval`, or show one bar per cell. Re-execute the notebook after
fixing the code that printed the debris; never edit saved outputs by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("notebooks", "labs", "solutions")

# a path of the machine that ran the notebook (Linux, macOS, Windows, Colab, Kaggle)
ABSOLUTE_PATH = re.compile(r"(?<![\w.])(/home/|/work/|/tmp/|/root/|/Users/|/opt/|/usr/|/var/|/mnt/|/srv/"
                           r"|/private/|/content/|/kaggle/|[A-Z]:\\{1,2}Users)")
# glog-style lines of PyTorch's C++ side (W1130 00:33:17...) and Python warnings (UserWarning: ...)
LOG_LINE = re.compile(r"^(?:[EWF]\d{4} \d\d:\d\d|.*\b\w*Warning: )", re.MULTILINE)
PROGRESS_FRAME = re.compile(r"\|\s*\d+/\d+ \[")
MAX_FRAMES = 6


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def output_text(output: dict) -> str:
    """What a reader sees of one output: stream text, plain-text and HTML data, an error's traceback."""
    data = output.get("data", {})
    return _text(output.get("text")) + _text(data.get("text/plain")) + _text(data.get("text/html")) \
        + "\n".join(output.get("traceback", []))


def cell_findings(cell: dict) -> list[str]:
    findings, frames = [], 0
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            findings.append(f"error output ({output.get('ename')}: {output.get('evalue', '')[:60]})")
            continue
        text = output_text(output)
        if match := ABSOLUTE_PATH.search(text):
            line = next(ln for ln in text.splitlines() if match.group(0) in ln)
            findings.append(f"absolute path {match.group(0)!r} in {line.strip()[:80]!r}")
        if "Traceback (most recent call last)" in text:
            findings.append("traceback")
        if match := LOG_LINE.search(text):
            findings.append(f"log line {match.group(0).strip()[:60]!r}")
        frames += len(PROGRESS_FRAME.findall(text))
    if frames > MAX_FRAMES:
        findings.append(f"{frames} progress-bar frames (at most {MAX_FRAMES})")
    return findings


def notebook_findings(path: Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    return [f"cell {i}: {finding}" for i, cell in enumerate(cells) for finding in cell_findings(cell)]


def committed_notebooks() -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((REPO_ROOT / folder).glob("*.ipynb"))]


@pytest.mark.parametrize("path", committed_notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_saved_outputs_are_clean(path):
    findings = notebook_findings(path)
    assert not findings, (f"{path.parent.name}/{path.name} holds outputs a learner should not read "
                          "(fix the code that printed them, then re-execute the notebook):\n  " + "\n  ".join(findings))


# ---------------------------------------------------------------------------------
# the rules themselves catch what they are for


def stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": text}


@pytest.mark.parametrize("outputs, words", [
    ([stream("exported the model to /work/main/runs/model\n")], "absolute path '/work/'"),
    ([stream("saved to /content/drive/run\n")], "absolute path '/content/'"),
    ([stream("wrote C:\\Users\\ada\\run\n")], "absolute path"),
    ([{"output_type": "execute_result", "data": {"text/plain": "PosixPath('/home/ada/x')"}}], "absolute path"),
    ([stream("Traceback (most recent call last):\n  File \"x\", line 1\nValueError: no\n", "stderr")], "traceback"),
    ([{"output_type": "error", "ename": "ValueError", "evalue": "no", "traceback": []}], "error output (ValueError"),
    ([stream("W1130 00:33:17.701000 18130 spawn.py:165] Terminating process\n", "stderr")], "log line 'W1130 00:33"),
    ([stream("x.py:21: UserWarning: something\n", "stderr")], "log line"),
    ([stream(f"\rrun: {10 * i}%|#  | {i}/10 [00:0{i}<00:01]", "stderr") for i in range(8)], "8 progress-bar frames"),
])
def test_each_rule_catches_its_debris(outputs, words):
    findings = cell_findings({"cell_type": "code", "outputs": outputs})
    assert any(words in f for f in findings), f"{words!r} not among {findings}"


def test_clean_outputs_pass():
    clean = [stream("rank 0 holds 11,357,763 of 22,715,141 parameters; see runs/08_finetune/model\n"),
             stream("\rtrain:   0%|   | 0/31 [00:00<?, ?it/s]\rtrain: 100%|###| 31/31 [00:10<00:00]\n", "stderr"),
             {"output_type": "display_data", "data": {"text/plain": "<Figure size 640x480 with 1 Axes>"}},
             stream("a ratio of 1/2 [exact] and a URL https://arxiv.org/abs/1910.02054\n")]
    assert cell_findings({"cell_type": "code", "outputs": clean}) == []


# ---------------------------------------------------------------------------------
# saved timings come from a quiet machine

LOAD_LINE = re.compile(r"load average (\d+(?:\.\d+)?) on (\d+) cores")


def saved_loads(path: Path) -> list[tuple[int, float, int]]:
    """(cell, load average, cores) for every `shardlib.timing.machine_load()` line in a notebook's outputs."""
    cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
    return [(i, float(load), int(cores)) for i, cell in enumerate(cells) for output in cell.get("outputs", [])
            for load, cores in LOAD_LINE.findall(output_text(output))]


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_saved_timings_were_taken_on_a_quiet_machine(path):
    from shardlib.timing import QUIET_LOAD_PER_CORE

    busy = [f"cell {i}: load average {load} on {cores} cores (limit {QUIET_LOAD_PER_CORE * cores:.2f})"
            for i, load, cores in saved_loads(path) if load > QUIET_LOAD_PER_CORE * cores]
    assert not busy, (f"{path.name} saved timings taken on a busy machine: re-execute it with nothing else "
                      "running (python -m shardlib.course.measure_course):\n  " + "\n  ".join(busy))


def test_the_load_line_is_read_as_lessons_print_it():
    from shardlib.timing import machine_load

    assert LOAD_LINE.fullmatch(machine_load()), machine_load()
