"""Measure what each lesson and lab costs a machine: run time, peak memory, disk written.

    python -m shardlib.course.measure_course                       # every lesson and lab: print the table
    python -m shardlib.course.measure_course --write INSTRUCTORS.md # ... and put it in the guide
    python -m shardlib.course.measure_course 03 p1                  # only notebooks whose names start so
    python -m shardlib.course.measure_course --save --write INSTRUCTORS.md   # the quiet run: both at once

Each lesson (notebooks/NN_*.ipynb) and each lab, run solved (solutions/*.ipynb: what a learner who
finished runs), executes top to bottom in a fresh kernel of this Python, in its own folder, the way
`python -m shardlib grade` runs it (shardlib/course/grading/kernel.py), without its sandbox and limits;
the notebook file is not changed. With --save it runs instead as `jupyter nbconvert --execute` does
(nbclient, every output kept), and a notebook whose every cell ran without error is written back in place
with the outputs of that same run (figures inline, stream outputs merged as Jupyter shows them) and its
own metadata: one run gives both the saved timings of the lessons and the guide's table.

Before each notebook the run waits until the machine is quiet: the 1-minute load average below
--quiet-load per core (default WAIT_LOAD_PER_CORE), checked every POLL_S seconds for at most --max-wait
seconds, after which it stops and says what it saw. Saved lessons are held to
shardlib.timing.QUIET_LOAD_PER_CORE (tests/test_notebook_outputs.py); starting lower leaves room for the
load the lesson's own ranks add. The load at each notebook's start and its peak during the run are
recorded (in the table and the JSON).

    run time      wall-clock seconds from the kernel's start to the last cell's end
    peak memory   the largest sum, over the kernel and every process it started (the ranks), of each
                  process's proportional set size (PSS: shared pages split among the processes that
                  share them, so forked ranks are not counted twice); sampled every SAMPLE_S seconds,
                  so a spike shorter than that can be missed
    disk          bytes the run leaves in the course folder (files created or changed under it), plus
                  the most its temporary folder (TMPDIR, a fresh one per notebook) held at any sample

The table goes between the two MARKERS lines of the guide; the rest of the guide is left alone. A run of
some notebooks only (names given) replaces their rows and keeps the guide's other rows, as measured before.
"""

from __future__ import annotations

import argparse
import copy
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
from shardlib.course.save_executed import run_keeping_outputs, save_in_place

ROOT = Path(__file__).resolve().parents[2]  # the checkout
SAMPLE_S = 0.5
MARKERS = ("<!-- measured by shardlib/course/measure_course.py: begin -->",
           "<!-- measured by shardlib/course/measure_course.py: end -->")
SKIP_DIRS = {".git", ".venv", "__pycache__", ".ipynb_checkpoints", ".pytest_cache"}
WAIT_LOAD_PER_CORE = 0.5  # start a notebook only below this 1-minute load average per core
MAX_WAIT_S = 1200
POLL_S = 15


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
        self.peak_load = os.getloadavg()[0]
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(SAMPLE_S):
            if self.pid is not None:
                self.peak_memory = max(self.peak_memory, process_tree_pss(self.pid))
            self.peak_tmp = max(self.peak_tmp, tree_bytes(self.tmpdir))
            self.peak_load = max(self.peak_load, os.getloadavg()[0])


def wait_until_quiet(limit: float, max_wait: float, what: str, *, load=lambda: os.getloadavg()[0],
                     sleep=time.sleep, clock=time.monotonic, say=print) -> float:
    """Wait until the 1-minute load average is below `limit`; return it. Says what it waits for, every
    minute or so; past `max_wait` seconds, stops (SystemExit) with the load it saw."""
    started, said = clock(), None
    while (now := load()) >= limit:
        waited = clock() - started
        if waited >= max_wait:
            raise SystemExit(f"the machine did not get quiet for {what}: load average {now:.2f} on {os.cpu_count()} "
                             f"cores after {waited:.0f} s, limit {limit:.2f}. Stop what else runs (or wait), then "
                             "run again; --quiet-load and --max-wait set the limit and the wait")
        if said is None or waited - said >= 60:
            say(f"  waiting for a quiet machine before {what}: load average {now:.2f} on {os.cpu_count()} cores, "
                f"limit {limit:.2f} (waited {waited:.0f} of at most {max_wait:.0f} s)", file=sys.stderr, flush=True)
            said = waited
        sleep(min(POLL_S, max_wait - waited))
    return now


def _run_measuring(notebook, path: Path, tmpdir: Path, sampler: Sampler, deadline: float) -> tuple[list, str]:
    """The grader's kernel, without its sandbox and limits: (cells that raised, outcome)."""
    failed, outcome = [], "completed"
    with Kernel(Sandbox(tmpdir, memory_bytes=psutil.virtual_memory().total, processes=1 << 20,
                        workdir=path.parent)) as kernel:
        sampler.pid = kernel.tree.root_pid
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            run = kernel.run(cell.source, max(1.0, deadline - time.monotonic()))
            if run.status in ("died", "unresponsive", "timed out"):
                return failed, {"died": "kernel died"}.get(run.status, "timed out")
            if run.status == "error":
                failed.append(index)
    return failed, outcome


def _run_saving(notebook, path: Path, tmpdir: Path, sampler: Sampler, deadline: float) -> tuple[list, str]:
    (tmpdir / "tmp").mkdir(parents=True, exist_ok=True)
    env = {"TMPDIR": str(tmpdir / "tmp"), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    return run_keeping_outputs(notebook, path.parent, deadline, env=env,
                               on_kernel=lambda pid: setattr(sampler, "pid", pid))


def _name(path: Path, course: Path) -> str:
    return path.relative_to(course).as_posix() if path.is_relative_to(course) else path.name


def measure(path: Path, timeout: float = DEFAULT_TIMEOUT_S, *, save: bool = False, course: Path = ROOT) -> dict:
    """Run one notebook in a fresh kernel and measure it; with `save`, write it back with this run's
    outputs when every cell ran without error (a failed run leaves the file as it was)."""
    notebook = nbformat.read(path, as_version=4)
    metadata = copy.deepcopy(notebook.metadata)
    tmpdir = Path(tempfile.mkdtemp(prefix="measure-"))
    sampler = Sampler(tmpdir / "tmp")
    started_wall = time.time()
    started = time.monotonic()
    load_start = sampler.peak_load
    sampler.start()
    try:
        failed, outcome = (_run_saving if save else _run_measuring)(notebook, path, tmpdir, sampler, started + timeout)
    finally:
        seconds = time.monotonic() - started
        sampler.stopped.set()
        sampler.join()
        shutil.rmtree(tmpdir, ignore_errors=True)
    written = tree_bytes(course, since=started_wall)
    saved = save and outcome == "completed" and not failed
    if saved:
        save_in_place(path, notebook, metadata)
    return {"notebook": _name(path, course), "seconds": round(seconds, 1),
            "peak_memory_bytes": sampler.peak_memory, "disk_bytes": written + sampler.peak_tmp,
            "load_start": round(load_start, 2), "load_peak": round(sampler.peak_load, 2), "saved": saved,
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
             f"{tree_bytes(environment) / 2 ** 30:.1f} GiB on disk. Labs are run solved (their solutions). "
             "Load: the 1-minute load average as the notebook started, and its peak during the run (the "
             "notebook's own ranks included).",
             "",
             "| notebook | run time | peak memory | disk written | load (start, peak) | result |",
             "|---|---:|---:|---:|---:|---|"]
    for row in rows:
        lines.append(f"| `{row['notebook']}` | {row['seconds']:.0f} s | {_mib(row['peak_memory_bytes'])} | "
                     f"{_mib(row['disk_bytes'])} | {row['load_start']:.2f}, {row['load_peak']:.2f} | {row['outcome']} |")
    total = sum(row["seconds"] for row in rows)
    lines.append(f"| all of the above | {total / 60:.0f} min | {_mib(max(r['peak_memory_bytes'] for r in rows))} (largest) | "
                 f"{_mib(sum(r['disk_bytes'] for r in rows))} | {max(r['load_start'] for r in rows):.2f} (highest start) | |")
    return "\n".join(lines)


def _bytes(text: str) -> int:
    number, unit = text.split()
    return int(float(number.replace(",", "")) * {"MiB": 2 ** 20, "KiB": 2 ** 10}[unit])


def rows_in(guide: Path) -> list[dict]:
    """The rows of the table already between the guide's markers (none when it has no table)."""
    content = guide.read_text(encoding="utf-8")
    begin, end = MARKERS
    if begin not in content:
        return []
    rows = []
    for line in content.split(begin, 1)[1].split(end, 1)[0].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].startswith("`"):
            continue  # the header, its rule, the total
        start, peak = (float(x) for x in cells[4].split(","))
        rows.append({"notebook": cells[0].strip("`"), "seconds": float(cells[1].split()[0]),
                     "peak_memory_bytes": _bytes(cells[2]), "disk_bytes": _bytes(cells[3]), "load_start": start,
                     "load_peak": peak, "outcome": cells[5]})
    return rows


def merged(before: list[dict], measured: list[dict]) -> list[dict]:
    """The guide's rows with those measured now in their place, in the course's order (lessons, then labs)."""
    by_name = {row["notebook"]: row for row in before} | {row["notebook"]: row for row in measured}
    order = [str(path.relative_to(ROOT)) for path in notebooks([])]
    return sorted(by_name.values(), key=lambda r: order.index(r["notebook"]) if r["notebook"] in order else len(order))


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
    parser.add_argument("--save", action="store_true",
                        help="write each notebook that ran without error back in place, with this run's outputs")
    parser.add_argument("--quiet-load", type=float, default=WAIT_LOAD_PER_CORE, metavar="PER_CORE",
                        help="start each notebook only below this 1-minute load average per core (0: do not wait)")
    parser.add_argument("--max-wait", type=float, default=MAX_WAIT_S, metavar="S",
                        help="seconds to wait for a quiet machine before each notebook, then stop")
    args = parser.parse_args(argv)
    rows = []
    for path in notebooks(args.names):
        name = path.relative_to(ROOT)
        if args.quiet_load > 0:
            wait_until_quiet(args.quiet_load * os.cpu_count(), args.max_wait, str(name))
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows.append(measure(path, args.timeout, save=args.save))
        row = rows[-1]
        print(f"  {row['seconds']:.0f} s, {_mib(row['peak_memory_bytes'])}, {_mib(row['disk_bytes'])}, load "
              f"{row['load_start']:.2f} -> peak {row['load_peak']:.2f}: {row['outcome']}"
              + ("; saved" if row["saved"] else ""), file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    if args.write:
        keep = rows_in(Path(args.write)) if args.names else []
        write_into(Path(args.write), table(merged(keep, rows)) if keep else text)
    return 0 if all(row["outcome"] == "completed" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
