"""`python -m shardlib grade --class SUBMISSIONS_DIR --release RELEASE_DIR --out RESULTS_DIR [--jobs N]`.

    SUBMISSIONS_DIR/<learner>/.../<lab>.ipynb   one folder per learner (nbgrader's submitted/ layout works
                                                too); a lab is found by its file name, anywhere in the folder
    RELEASE_DIR/<lab>.ipynb                     the labs as released (or RELEASE_DIR/labs/<lab>.ipynb)
    RESULTS_DIR/<learner>.json, <learner>.txt   one report per learner: every lab, every check
    RESULTS_DIR/scores.csv                      learner, lab, score, max_score, outcome, detail, review (how
                                                many lines of the learner's code to look at: review.py)

Every released lab is read once, before any learner's code runs, and handed to each grading on its
standard input, so nothing a notebook does to the files changes the checks another is graded with.
Each notebook is graded by a worker process of its own (`python -m shardlib grade ... --json`), N at
once; results are written when every worker and every process they started has ended. A notebook
whose grading did not run to its end (its kernel died, ran out of memory, hung, or the grading was
stopped) is named in the summary, and the exit code is 1.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from shardlib.course.grading.notebook import GradeInputError, is_check, read_notebook
from shardlib.course.grading.report import Report, cap, format_report
from shardlib.course.grading.sandbox import ProcessTree, become_subreaper
from shardlib.course.grading.stopping import GraderStopped, raise_if_stopped, stop_on_signals

DID_NOT_RUN = ("kernel died", "out of memory", "timed out", "unresponsive", "error", "stopped", "not graded")
WORKER_GRACE_S = 180  # past the notebook's own --timeout, a worker is killed


def released_labs(release_dir: Path) -> dict[str, bytes]:
    folder = release_dir / "labs" if (release_dir / "labs").is_dir() else release_dir
    labs = {}
    for path in sorted(folder.glob("*.ipynb")):
        if any(is_check(cell) for cell in read_notebook(path).cells):
            labs[path.name] = path.read_bytes()
    if not labs:
        raise GradeInputError(f"{release_dir}: no released lab (a notebook with check cells) in it or in its labs/")
    return labs


def check_folders(submissions: Path, release: Path, out: Path) -> None:
    for name, folder in (("--class", submissions), ("--release", release)):
        if not folder.is_dir():
            raise GradeInputError(f"{name} {folder}: no such folder")
    out_resolved = out.resolve()
    for name, folder in (("submissions", submissions), ("release", release)):
        inside = folder.resolve()
        if out_resolved == inside or inside in out_resolved.parents or out_resolved in inside.parents:
            raise GradeInputError(f"--out {out} must be outside the {name} folder {folder}")


def tasks(submissions: Path, labs: dict[str, bytes]) -> list[tuple[str, str, Path | None]]:
    found = []
    for learner in sorted(p for p in submissions.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for lab in labs:
            copies = sorted(learner.rglob(lab), key=lambda p: (len(p.parts), str(p)))
            copies = [p for p in copies if ".ipynb_checkpoints" not in p.parts]
            found.append((learner.name, lab, copies[0] if copies else None))
    if not found:
        raise GradeInputError(f"--class {submissions}: no learner folders in it")
    return found


class Workers:
    """The worker processes running now, so that a signal can reach them all."""

    def __init__(self):
        self.running: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopped = ""

    def grade(self, notebook: Path, release: bytes, options: list[str], timeout: float) -> dict:
        if self.stopped:
            return {"outcome": "not graded", "detail": f"grading stopped by {self.stopped}"}
        command = [sys.executable, "-m", "shardlib", "grade", str(notebook), "--release", "-", "--json", *options]
        worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        with self.lock:
            self.running.add(worker)
        try:
            out, err = worker.communicate(release, timeout=timeout)
        except subprocess.TimeoutExpired:
            worker.kill()
            out, err = worker.communicate()
            return {"outcome": "error", "detail": f"the grader itself ran past {timeout:.0f} s and was killed"}
        finally:
            with self.lock:
                self.running.discard(worker)
        try:
            report = json.loads(out)
            if worker.returncode not in (0, 1, 2):  # killed: what it printed may not be its own
                raise ValueError(f"exit status {worker.returncode}")
        except ValueError:
            return {"outcome": "error", "detail": cap(f"the grader failed (status {worker.returncode}): "
                                                      f"{err.decode(errors='replace')[-400:]}")}
        if "error" in report and "checks" not in report:
            return {"outcome": "error", "detail": cap(report["error"])}
        return report

    def stop(self, why: str) -> None:
        self.stopped = why
        with self.lock:
            for worker in self.running:
                worker.terminate()  # each worker stops its kernel and still prints its report


def grade_class(args) -> int:
    submissions, release_dir, out = Path(args.class_dir), Path(args.release or ""), Path(args.out or "")
    if args.release is None or args.out is None:
        raise GradeInputError("--class needs --release RELEASE_DIR and --out RESULTS_DIR")
    if args.notebook is not None:
        raise GradeInputError("--class grades a folder: give no notebook besides it")
    check_folders(submissions, release_dir, out)
    labs = released_labs(release_dir)
    todo = tasks(submissions, labs)
    options = ["--timeout", repr(args.timeout), "--cell-timeout", repr(args.cell_timeout), "--memory",
               repr(args.memory), "--processes", str(args.processes), "--isolation", args.isolation,
               "--hide", str(submissions.resolve()), "--hide", str(out.resolve()), "--hide", str(release_dir.resolve())]
    workers, results = Workers(), {}
    stop_on_signals()
    become_subreaper()
    before = ProcessTree.children_now()
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(_one, workers, task, labs, options, args.timeout + WORKER_GRACE_S): task
                   for task in todo}
        pending = set(futures)
        while pending:
            try:
                if not workers.stopped:
                    raise_if_stopped()  # a stop whose exception was dropped where the signal landed (stopping.py)
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            except GraderStopped as stopped:
                workers.stop(str(stopped))
                continue
            for future in done:
                results[futures[future][:2]] = future.result()
                if not args.json:
                    learner, lab = futures[future][:2]
                    print(f"graded {learner}/{lab}: {_line(results[(learner, lab)])}", flush=True)
    for pid in ProcessTree.children_now() - before:  # anything a worker left behind
        ProcessTree(pid, before).kill()
    summary = write_results(out, todo, results, time.monotonic() - started)
    print(json.dumps(summary, indent=1) if args.json else _summary_text(summary), flush=True)
    return 1 if summary["did_not_run"] else 0


def _one(workers: Workers, task, labs, options, timeout) -> dict:
    learner, lab, path = task
    if path is None:
        return {"outcome": "not submitted", "detail": f"no {lab} in the learner's folder", "score": 0}
    return workers.grade(path, labs[lab], options, timeout)


def _line(result: dict) -> str:
    score = f"{result.get('score', 0):g} / {result.get('max_score', 0):g}" if "max_score" in result else "-"
    return f"{score} ({result.get('outcome', '?')})"


def write_results(out: Path, todo, results: dict, seconds: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows, per_learner = [], {}
    for learner, lab, _ in todo:
        result = results.get((learner, lab), {"outcome": "not graded", "detail": "grading stopped before it"})
        per_learner.setdefault(learner, []).append(dict(result, lab=lab))
        rows.append({"learner": learner, "lab": lab, "score": result.get("score", 0),
                     "max_score": result.get("max_score", ""), "outcome": result.get("outcome", ""),
                     "detail": cap(result.get("detail", ""), 200), "review": len(result.get("review", []))})
    for learner, reports in per_learner.items():
        total = sum(r.get("score", 0) for r in reports)
        (out / f"{learner}.json").write_text(json.dumps({"learner": learner, "score": total, "labs": reports},
                                                        indent=1), encoding="utf-8")
        (out / f"{learner}.txt").write_text("\n\n".join(_text(r) for r in reports) + "\n", encoding="utf-8")
    with open(out / "scores.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    failed = [f"{r['learner']}/{r['lab']}: {r['outcome']}" + (f" ({r['detail']})" if r["detail"] else "")
              for r in rows if r["outcome"] in DID_NOT_RUN]
    graded = sum("checks" in result for result in results.values())
    return {"learners": len(per_learner), "notebooks": len(rows), "graded": graded, "seconds": round(seconds, 1),
            "did_not_run": failed, "not_submitted": [f"{r['learner']}/{r['lab']}" for r in rows
                                                     if r["outcome"] == "not submitted"],
            "results": str(out), "scores": str(out / "scores.csv")}


def _text(result: dict) -> str:
    if "checks" not in result:
        return f"{result['lab']}: {result.get('outcome')}: {result.get('detail', '')}"
    report = Report(result["notebook"], outcome=result["outcome"], detail=result["detail"],
                    tampering=result.get("tampering", []), review=result.get("review", []),
                    isolation=result.get("isolation", ""),
                    release=result["lab"], seconds=result.get("seconds", 0), errors=result.get("errors", []))
    from shardlib.course.grading.report import CheckResult

    report.checks = [CheckResult(c["grade_id"], c["cell"], c["points"], c["status"], c["message"], c["seconds"])
                     for c in result["checks"]]
    return format_report(report)


def _summary_text(summary: dict) -> str:
    lines = [f"Graded {summary['graded']} of {summary['notebooks']} notebooks ({summary['learners']} learners) in "
             f"{summary['seconds']:.0f} s; reports in {summary['results']}, scores in {summary['scores']}"]
    if summary["not_submitted"]:
        lines.append(f"not submitted ({len(summary['not_submitted'])}): {', '.join(summary['not_submitted'])}")
    for line in summary["did_not_run"]:
        lines.append(f"DID NOT RUN TO ITS END: {line}")
    return "\n".join(lines)
