"""The course's grader, `python -m shardlib grade`: one notebook, or a whole class.

    notebook.py    reading a notebook, each cell's role, the notebook as graded against its release
    sandbox.py     where the learner's code runs (bubblewrap, else this user), limits, killing it all
    kernel.py      one kernel: run code, read the kernel's reply, interrupt, notice death
    tamper.py      what the checks rely on, verified after every cell from outside the learner's cells
    grade.py       one notebook, cell by cell: the Report
    report.py      the Report and how it prints
    classroom.py   --class: every learner's copy of every lab, reports and scores.csv
    cli.py         the command line
"""

import sys

# nbformat validates with jsonschema, which imports rfc3987_syntax where it is installed (Jupyter's event
# schemas want it) for its IRI format checks; notebooks' schema has none, and that module builds its grammar
# when imported: 1.5 to 4.5 s of every grading's start, measured. A grader that imported it already keeps it.
sys.modules.setdefault("rfc3987_syntax", None)  # before nbformat is imported below

from shardlib.course.grading.grade import DEFAULT_CELL_TIMEOUT_S, DEFAULT_TIMEOUT_S, grade  # noqa: E402
from shardlib.course.grading.notebook import GradeInputError, read_notebook  # noqa: E402
from shardlib.course.grading.report import CheckResult, Report, format_report  # noqa: E402

__all__ = ["grade", "Report", "CheckResult", "format_report", "GradeInputError", "read_notebook",
           "DEFAULT_TIMEOUT_S", "DEFAULT_CELL_TIMEOUT_S"]
