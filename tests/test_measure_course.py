"""The quiet re-execution: `python -m shardlib.course.measure_course --save` waits for a quiet machine,
runs each notebook once, writes that run's outputs back in place (its metadata kept, figures inline) and
records the load, so that one run gives both the saved timings and INSTRUCTORS.md's table.

Tested on a tiny notebook, not on the course: waiting with a faked load and clock; saving with one kernel
per case.
"""

from __future__ import annotations

import json

import nbformat
import pytest

from shardlib.course import measure_course


class FakeMachine:
    """A load average that follows `loads`, one value per look, and a clock that moves only when slept."""

    def __init__(self, loads):
        self.loads, self.now, self.slept, self.said = list(loads), 0.0, [], []

    def load(self):
        return self.loads.pop(0) if len(self.loads) > 1 else self.loads[0]

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds

    def clock(self):
        return self.now

    def say(self, text, **_):
        self.said.append(text)


def test_it_waits_until_the_load_is_below_the_limit():
    machine = FakeMachine([3.1, 2.4, 1.2, 0.7])
    load = measure_course.wait_until_quiet(1.0, 600, "notebooks/01_x.ipynb", load=machine.load, sleep=machine.sleep,
                                           clock=machine.clock, say=machine.say)
    assert load == 0.7 and machine.slept == [measure_course.POLL_S] * 3, (load, machine.slept)
    assert len(machine.said) == 1 and "load average 3.10" in machine.said[0] and "01_x" in machine.said[0], machine.said


def test_a_quiet_machine_is_not_waited_for():
    machine = FakeMachine([0.2])
    assert measure_course.wait_until_quiet(1.0, 600, "x", load=machine.load, sleep=machine.sleep,
                                           clock=machine.clock, say=machine.say) == 0.2
    assert machine.slept == [] and machine.said == []


def test_a_machine_that_stays_busy_stops_the_run_with_what_it_saw():
    machine = FakeMachine([2.5])
    with pytest.raises(SystemExit, match=r"did not get quiet for x: load average 2\.50 .* after 60 s, limit 1\.00"):
        measure_course.wait_until_quiet(1.0, 60, "x", load=machine.load, sleep=machine.sleep, clock=machine.clock,
                                        say=machine.say)
    assert sum(machine.slept) == 60, machine.slept  # bounded: never past --max-wait


def test_the_table_records_the_load(monkeypatch):
    monkeypatch.setattr(measure_course, "tree_bytes", lambda *args, **kwargs: 0)  # not the whole environment
    row = {"notebook": "notebooks/01_x.ipynb", "seconds": 42.0, "peak_memory_bytes": 2 ** 30, "disk_bytes": 0,
           "load_start": 0.31, "load_peak": 1.8, "outcome": "completed"}
    text = measure_course.table([row])
    assert "| load (start, peak) |" in text and "| 0.31, 1.80 | completed |" in text, text


def test_a_partial_run_replaces_its_rows_and_keeps_the_others(monkeypatch, tmp_path):
    monkeypatch.setattr(measure_course, "tree_bytes", lambda *args, **kwargs: 0)
    row = lambda name, seconds, mib: {"notebook": name, "seconds": seconds, "peak_memory_bytes": mib * 2 ** 20,  # noqa
                                      "disk_bytes": 3 * 2 ** 10, "load_start": 0.5, "load_peak": 1.25,
                                      "outcome": "completed"}
    first = [row("notebooks/00_memory_wall.ipynb", 15, 100), row("notebooks/06_hybrid_and_planning.ipynb", 57, 200),
             row("solutions/06_plan_a_job.ipynb", 10, 300)]
    guide = tmp_path / "GUIDE.md"
    begin, end = measure_course.MARKERS
    guide.write_text(f"intro\n{begin}\n{measure_course.table(first)}\n{end}\nafter\n", encoding="utf-8")
    assert measure_course.rows_in(guide) == first, "the table reads back as it was written"
    again = [row("notebooks/06_hybrid_and_planning.ipynb", 60, 400)]
    measure_course.write_into(guide, measure_course.table(measure_course.merged(measure_course.rows_in(guide), again)))
    assert [r["notebook"] for r in measure_course.rows_in(guide)] == [r["notebook"] for r in first]
    assert measure_course.rows_in(guide)[1] == again[0] and measure_course.rows_in(guide)[2] == first[2]
    text = guide.read_text(encoding="utf-8")
    assert text.startswith("intro\n") and text.endswith("after\n") and "| 1 min | 400 MiB (largest) | 9 KiB |" in text


def tiny_notebook(path, cells):
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    notebook.metadata = {"kernelspec": {"name": "python3", "display_name": "Course", "language": "python"},
                         "course": {"kept": True}}
    nbformat.write(notebook, path)
    return notebook


@pytest.mark.slow  # two kernels
def test_save_writes_the_outputs_of_that_run_in_place_and_keeps_the_metadata(tmp_path):
    path = tmp_path / "01_tiny.ipynb"
    tiny_notebook(path, [
        "import secrets, pathlib\ntoken = secrets.token_hex(8)\npathlib.Path('token.txt').write_text(token)\nprint(token)",
        "import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 0])\nplt.show()",
        "import os, sys, time\nfor i in range(3):\n    sys.stdout.write(f'\\rframe {i}/3'); sys.stdout.flush(); time.sleep(0.3)\n"
        "print(flush=True)\ntime.sleep(0.5)\nif os.fork() == 0:\n    print('from a forked process', flush=True)\n    os._exit(0)\nos.wait(); time.sleep(0.5)",
    ])
    row = measure_course.measure(path, 300, save=True, course=tmp_path)
    assert row["outcome"] == "completed" and row["saved"], row
    assert row["load_peak"] >= row["load_start"] >= 0, row
    saved = json.loads(path.read_text(encoding="utf-8"))
    assert saved["metadata"] == {"kernelspec": {"name": "python3", "display_name": "Course", "language": "python"},
                                 "course": {"kept": True}}, saved["metadata"]
    printed = "".join(saved["cells"][0]["outputs"][0]["text"]).strip()
    assert printed == (tmp_path / "token.txt").read_text(), "the saved output is not the run's own (cwd: its folder)"
    assert saved["cells"][0]["execution_count"] == 1
    assert any("image/png" in output.get("data", {}) for output in saved["cells"][1]["outputs"]), \
        "the figure was not saved inline"
    streams = [(o["name"], "".join(o["text"])) for o in saved["cells"][2]["outputs"]]
    assert streams == [("stdout", "frame 2/3\nfrom a forked process\n")], \
        f"stream outputs not merged as Jupyter shows them (one output, the bar's last frame): {streams}"

    broken = tmp_path / "02_broken.ipynb"
    tiny_notebook(broken, ["print('first')", "raise ValueError('no')"])
    before = broken.read_bytes()
    row = measure_course.measure(broken, 300, save=True, course=tmp_path)
    assert not row["saved"] and "cells [1] raised" in row["outcome"], row
    assert broken.read_bytes() == before, "a run with an error must leave the saved notebook as it was"
