"""Measure what each lesson and lab costs a machine: run time, peak memory, disk written.

    python -m shardlib.course.measure_course                       # every lesson and lab: print the table
    python -m shardlib.course.measure_course --write INSTRUCTORS.md # ... and put it in the guide
    python -m shardlib.course.measure_course 03 p1                  # only notebooks whose names start so

Each lesson (notebooks/NN_*.ipynb) and each lab, run solved (solutions/*.ipynb: what a learner who
finished runs), executes top to bottom in a fresh kernel of this Python, in its own folder, the way
`python -m shardlib grade` runs it (shardlib/course/grading/kernel.py), without its sandbox and limits;
the notebook file is not changed.

    run time      wall-clock seconds from the kernel's start to the last cell's end
    peak memory   the largest sum, over the kernel and every process it started (the ranks), of each
                  process's proportional set size (PSS: shared pages split among the processes that
                  share them, so forked ranks are not counted twice); sampled every SAMPLE_S seconds,
                  so a spike shorter than that can be missed
    disk          bytes the run leaves in the course folder (files created or changed under it), plus
                  the most its temporary folder (TMPDIR, a fresh one per notebook) held at any sample

The table goes between the two MARKERS lines of the guide; the rest of the guide is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import psutil

from shardlib.course.grading import DEFAULT_TIMEOUT_S
from shardlib.course.grading.kernel import Kernel
from shardlib.course.grading.sandbox import Sandbox

ROOT = Path(__file__).resolve().parents[2]  # the checkout
SAMPLE_S = 0.5
MARKERS = ("<!-- measured by shardlib/course/measure_course.py: begin -->",
           "<!-- measured by shardlib/course/measure_course.py: end -->")
SKIP_DIRS = {".git", ".venv", "__pycache__", ".ipynb_checkpoints", ".pytest_cache"}


def tree_bytes(folder: Path, since: float | None = None) -> int:
    """Bytes of the files under `folder` (those modified at or after `since`, if given)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            try:
                info = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
            except OSError:
                continue  # deleted while we walked
            if since is None or info.st_mtime >= since:
                total += info.st_size
    return total


def process_tree_pss(pid: int) -> int:
    """PSS (RSS where PSS is unknown) of a process and all its descendants, in bytes."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            info = process.memory_full_info()
            total += getattr(info, "pss", info.rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return total


class Sampler(threading.Thread):
    """Every SAMPLE_S seconds: the memory of the kernel's process tree and the size of its TMPDIR."""

    def __init__(self, tmpdir: Path):
        super().__init__(daemon=True)
        self.tmpdir, self.pid = tmpdir, None
        self.peak_memory = self.peak_tmp = 0
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(SAMPLE_S):
            if self.pid is not None:
                self.peak_memory = max(self.peak_memory, process_tree_pss(self.pid))
            self.peak_tmp = max(self.peak_tmp, tree_bytes(self.tmpdir))


def measure(path: Path, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Run one notebook in a fresh kernel and measure it."""
    notebook = nbformat.read(path, as_version=4)
    tmpdir = Path(tempfile.mkdtemp(prefix="measure-"))
    sampler = Sampler(tmpdir / "tmp")
    started_wall = time.time()
    started = time.monotonic()
    sampler.start()
    failed, outcome = [], "completed"
    try:
        with Kernel(Sandbox(tmpdir, memory_bytes=psutil.virtual_memory().total, processes=1 << 20,
                            workdir=path.parent)) as kernel:
            sampler.pid = kernel.tree.root_pid
            for index, cell in enumerate(notebook.cells):
                if cell.cell_type != "code" or not cell.source.strip():
                    continue
                run = kernel.run(cell.source, max(1.0, started + timeout - time.monotonic()))
                if run.status in ("died", "unresponsive", "timed out"):
                    outcome = {"died": "kernel died"}.get(run.status, "timed out")
                    break
                if run.status == "error":
                    failed.append(index)
    finally:
        seconds = time.monotonic() - started
        sampler.stopped.set()
        sampler.join()
        shutil.rmtree(tmpdir, ignore_errors=True)
    written = tree_bytes(ROOT, since=started_wall)
    return {"notebook": path.relative_to(ROOT).as_posix(), "seconds": round(seconds, 1),
            "peak_memory_bytes": sampler.peak_memory, "disk_bytes": written + sampler.peak_tmp,
            "outcome": outcome if not failed else f"{outcome}, cells {failed} raised", "detail": ""}


def notebooks(prefixes: list[str]) -> list[Path]:
    lessons = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    labs = [path for path in sorted((ROOT / "solutions").glob("*.ipynb"))]
    chosen = [path for path in lessons + labs if not prefixes or path.name.startswith(tuple(prefixes))]
    if not chosen:
        raise SystemExit(f"no lesson or lab starts with {prefixes}: names look like 03_zero_fsdp or p1_zero3")
    return chosen


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:,.0f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:,.0f} KiB"


def table(rows: list[dict]) -> str:
    environment = Path(sys.prefix)
    lines = [f"Measured on {os.cpu_count()} CPU cores, {psutil.virtual_memory().total / 2 ** 30:.0f} GiB of memory, "
             f"Python {platform.python_version()}, no GPU; the course environment ({environment.name}/) takes "
             f"{tree_bytes(environment) / 2 ** 30:.1f} GiB on disk. Labs are run solved (their solutions).",
             "",
             "| notebook | run time | peak memory | disk written | result |",
             "|---|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| `{row['notebook']}` | {row['seconds']:.0f} s | {_mib(row['peak_memory_bytes'])} | "
                     f"{_mib(row['disk_bytes'])} | {row['outcome']} |")
    total = sum(row["seconds"] for row in rows)
    lines.append(f"| all of the above | {total / 60:.0f} min | {_mib(max(r['peak_memory_bytes'] for r in rows))} (largest) | "
                 f"{_mib(sum(r['disk_bytes'] for r in rows))} | |")
    return "\n".join(lines)


def write_into(guide: Path, text: str) -> None:
    content = guide.read_text(encoding="utf-8")
    begin, end = MARKERS
    if begin not in content or end not in content:
        raise SystemExit(f"{guide} has no {begin!r} ... {end!r} lines to put the table between")
    head, rest = content.split(begin, 1)
    guide.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardlib.course.measure_course", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="only notebooks whose names start with these (default: all)")
    parser.add_argument("--write", metavar="GUIDE", help="put the table into this markdown file, between its markers")
    parser.add_argument("--json", metavar="PATH", help="also save the measurements as JSON")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per notebook")
    args = parser.parse_args(argv)
    rows = []
    for path in notebooks(args.names):
        print(f"running {path.relative_to(ROOT)} ...", file=sys.stderr, flush=True)
        rows.append(measure(path, args.timeout))
        print(f"  {rows[-1]['seconds']:.0f} s, {_mib(rows[-1]['peak_memory_bytes'])}, {_mib(rows[-1]['disk_bytes'])}: "
              f"{rows[-1]['outcome']}", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if args.write:
        write_into(Path(args.write), text)
    return 0 if all(row["outcome"] == "completed" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
