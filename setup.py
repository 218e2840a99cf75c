"""Packaging beyond pyproject.toml (which holds everything else): the course's notebooks ship inside the package.

The lessons (notebooks/), labs (labs/) and worked answers (solutions/) live at the top of the
repository; a wheel carries them as shardlib/course/notebooks, .../labs and .../solutions, so that
`python -m shardlib lessons DIR` works wherever shardlib is installed (a wheel, `pip install git+URL`).
"""

from setuptools import find_packages, setup

COURSE_FOLDERS = {f"shardlib.course.{name}": name for name in ("notebooks", "labs", "solutions")}

setup(
    packages=find_packages(include=["shardlib", "shardlib.*"]) + sorted(COURSE_FOLDERS),
    package_dir=COURSE_FOLDERS,
    package_data={name: ["*.ipynb"] for name in COURSE_FOLDERS},
)
