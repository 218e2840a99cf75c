"""Packaging beyond pyproject.toml (which holds everything else): the course's notebooks ship inside the package.

The lessons (notebooks/), labs (labs/) and worked answers (solutions/) live at the top of the
repository; a wheel carries them as shardlib/course/notebooks, .../labs and .../solutions, so that
`python -m shardlib lessons DIR` works wherever shardlib is installed (a wheel, `pip install git+URL`).

A classroom install carries no solutions: build or install with SHARDLIB_WITHOUT_SOLUTIONS=1
(`SHARDLIB_WITHOUT_SOLUTIONS=1 pip install "shardlib @ git+URL"`): the wheel then has no
shardlib/course/solutions, and `python -m shardlib lessons DIR` writes the labs without naming them.
"""

import os

from setuptools import find_packages, setup

SHIPPED = ("notebooks", "labs") if os.environ.get("SHARDLIB_WITHOUT_SOLUTIONS") == "1" else \
    ("notebooks", "labs", "solutions")
COURSE_FOLDERS = {f"shardlib.course.{name}": name for name in SHIPPED}

setup(
    packages=find_packages(include=["shardlib", "shardlib.*"]) + sorted(COURSE_FOLDERS),
    package_dir=COURSE_FOLDERS,
    package_data={name: ["*.ipynb"] for name in COURSE_FOLDERS},
)
