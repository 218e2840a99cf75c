"""What grading found: one CheckResult per check, a Report per notebook, and how both are printed.

Every message that comes from the notebook (an exception's text, a line it printed) is capped at
MESSAGE_LIMIT characters, so a check that prints 50 MB writes a report of a few kilobytes.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

MESSAGE_LIMIT = 500  # characters kept of any message that comes from the notebook
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
TRACEBACK = "Traceback (most recent call last):"
MAX_REVIEW_LINES = 12
# statuses a check can end with; only "passed" scores
STATUSES = ("passed", "failed", "timed out", "out of memory", "kernel died", "not run", "tampered")


def cap(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` on one line, at most `limit` characters, without control characters (a terminal's escape
    sequences could move the cursor and overwrite a FAIL line) or bidirectional overrides."""
    text = " ".join(UNPRINTABLE.sub(" ", str(text)[:limit * 4]).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error_message(ename: str, evalue: str) -> str:
    """'Name: first line'; for an error that carries another process's traceback (a rank's), also that
    traceback's own exception line: the first unindented line after its frames."""
    evalue = str(evalue)[:100_000]
    lines = [line for line in evalue.splitlines() if line.strip()]
    message = f"{ename}: {lines[0].strip()}" if lines else ename
    if TRACEBACK in evalue:
        after = evalue.rsplit(TRACEBACK, 1)[1].splitlines()
        cause = next((line.strip() for line in after if line.strip() and not line[0].isspace()), "")
        if cause and cause not in message:
            message += f" ... {cause}"
    return cap(message)


@dataclass
class CheckResult:
    grade_id: str
    cell: int  # index in the notebook as graded
    points: float
    status: str  # one of STATUSES
    message: str
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class Report:
    notebook: str
    checks: list[CheckResult] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)  # code cells outside the checks that did not end well
    outcome: str = "completed"  # completed | timed out | kernel died | out of memory | unresponsive | tampered | stopped
    detail: str = ""
    tampering: list[str] = field(default_factory=list)  # what the verification found changed, and where
    review: list[str] = field(default_factory=list)  # what a reader should look at in the learner's cells (review.py)
    isolation: str = ""
    release: str = ""
    seconds: float = 0.0

    @property
    def score(self) -> float:
        return sum(check.points for check in self.checks if check.passed)

    @property
    def max_score(self) -> float:
        return sum(check.points for check in self.checks)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    def as_dict(self) -> dict:
        checks = [dict(asdict(check), passed=check.passed, seconds=round(check.seconds, 1)) for check in self.checks]
        return {"notebook": self.notebook, "release": self.release, "score": self.score, "max_score": self.max_score,
                "passed": self.passed, "outcome": self.outcome, "detail": self.detail, "tampering": self.tampering,
                "review": self.review,
                "isolation": self.isolation, "seconds": round(self.seconds, 1), "checks": checks,
                "errors": self.errors}


def _points(value: float) -> str:
    return f"{value:g} point{'' if value == 1 else 's'}"


def format_report(report: Report) -> str:
    lines = [f"Graded {report.notebook}" + (f" against {report.release}" if report.release else "")]
    width = max([len(check.grade_id) for check in report.checks] + [8])
    for check in report.checks:
        status = "" if check.status in ("passed", "failed") else f"[{check.status}] "
        lines.append(f"  {'PASS' if check.passed else 'FAIL'}  {check.grade_id:<{width}}  {_points(check.points):>9}  "
                     f"(cell {check.cell})  {status}{cap(check.message, 220)}")
    if not report.checks:
        lines.append("  (no check cells: nothing to score; checks are code cells tagged `check`)")
    for error in report.errors:
        lines.append(f"  code cell {error['cell']} {error['status']}: {cap(error['message'], 220)}")
    for found in report.tampering:
        lines.append(f"  TAMPERED: {found}")
    for found in report.review[:MAX_REVIEW_LINES]:
        lines.append(f"  REVIEW: {cap(found, 220)}")
    if len(report.review) > MAX_REVIEW_LINES:
        lines.append(f"  REVIEW: ... and {len(report.review) - MAX_REVIEW_LINES} more (--json lists them all)")
    if report.outcome != "completed":
        lines.append(f"  {report.outcome.upper()}: {report.detail}")
    if report.isolation:
        lines.append(f"  isolation: {report.isolation}")
    passed = sum(check.passed for check in report.checks)
    lines.append(f"Score: {report.score:g} / {report.max_score:g} points ({passed} of {len(report.checks)} checks "
                 f"passed) in {report.seconds:.1f} s")
    return "\n".join(lines)
