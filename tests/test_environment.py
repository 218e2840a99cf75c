"""environment.yml (conda users) and pyproject.toml (everyone) describe the same install."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT_INSTALLS = {"-e .", "-e ./", ".", "./"}
CONDA_TOOLS = {"python", "pip"}  # provided by conda itself, not dependencies of the package
CONDA_TO_PYPI = {"pytorch": "torch"}  # conda names that differ from PyPI's
CONDA_SPEC = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)\s*(?:(?P<op>==|=|>=)\s*(?P<version>[0-9][0-9A-Za-z.]*))?$")


def pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def environment() -> dict:
    return yaml.safe_load((REPO_ROOT / "environment.yml").read_text(encoding="utf-8"))


def conda_packages(env: dict) -> list[str]:
    return [entry for entry in env["dependencies"] if isinstance(entry, str)]


def pip_section(env: dict) -> list[str]:
    sections = [entry["pip"] for entry in env["dependencies"] if isinstance(entry, dict) and "pip" in entry]
    assert len(sections) == 1, "environment.yml needs exactly one `- pip:` section"
    return sections[0]


def parse_conda_spec(spec: str) -> tuple[str, str | None, str | None]:
    match = CONDA_SPEC.match(spec.strip())
    assert match, f"environment.yml: cannot read {spec!r}; use `name`, `name=1.2` or `name>=1.2`"
    return match["name"].lower(), match["op"], match["version"]


def agrees(op: str | None, version: str | None, specifier: SpecifierSet) -> bool:
    """Whether the versions conda may pick (from `op version`) are allowed by pyproject's specifier.

    `=1.2` (conda's 1.2.*), `==1.2` and `>=1.2` are all held by their lowest version, 1.2;
    pyproject's specifiers are lower bounds, so the lowest version decides. An unpinned conda
    package is fine: pip raises it to pyproject's bound when it installs the project.
    """
    return op is None or specifier.contains(Version(version))


def test_pip_section_installs_the_project_and_nothing_else():
    entries = [str(entry).strip() for entry in pip_section(environment())]
    assert any(entry in PROJECT_INSTALLS for entry in entries), \
        f"environment.yml's pip section must install the course package (`-e .`), has {entries}"
    others = [entry for entry in entries if entry not in PROJECT_INSTALLS]
    assert not others, f"list dependencies in pyproject.toml, not in environment.yml's pip section: {others}"


def test_conda_python_satisfies_requires_python():
    pythons = [parse_conda_spec(spec) for spec in conda_packages(environment())
               if parse_conda_spec(spec)[0] == "python"]
    assert len(pythons) == 1 and pythons[0][2], "environment.yml must pin one Python version (python=3.x)"
    _, op, version = pythons[0]
    requires = SpecifierSet(pyproject()["requires-python"])
    assert agrees(op, version, requires), f"python {op}{version} in environment.yml; pyproject needs {requires}"


def test_conda_packages_are_pyproject_dependencies_with_compatible_versions():
    dependencies = {Requirement(text).name.lower(): Requirement(text).specifier for text in pyproject()["dependencies"]}
    for spec in conda_packages(environment()):
        name, op, version = parse_conda_spec(spec)
        if name in CONDA_TOOLS:
            continue
        pypi_name = CONDA_TO_PYPI.get(name, name)
        assert pypi_name in dependencies, f"environment.yml lists {name}, which pyproject.toml does not depend on"
        if op is not None:
            assert agrees(op, version, dependencies[pypi_name]), \
                f"environment.yml wants {spec}; pyproject.toml wants {pypi_name}{dependencies[pypi_name]}"


def test_agreement_rules_can_fail():
    """The rules above, on specs that must be refused (not only on the files as they are)."""
    assert not agrees("=", "3.9", SpecifierSet(">=3.10"))
    assert agrees("=", "3.11", SpecifierSet(">=3.10"))
    assert not agrees(">=", "2.0", SpecifierSet(">=2.6"))
    assert parse_conda_spec("pytorch>=2.6") == ("pytorch", ">=", "2.6")


def test_package_data_covers_every_shipped_data_and_config_file():
    """What the wheel carries besides code (pyproject's package-data): every file of shardlib/data and
    shardlib/configs, so that shardlib.resources finds them in any install (test_packaging builds one)."""
    from fnmatch import fnmatch

    package_data = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "package-data"]
    for package in ("shardlib.data", "shardlib.configs"):
        folder = REPO_ROOT.joinpath(*package.split("."))
        files = [p.relative_to(folder).as_posix() for p in folder.rglob("*")
                 if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
        assert files, f"{folder} holds no data"
        missing = [f for f in files if not any(fnmatch(f, pattern) for pattern in package_data.get(package, []))]
        assert not missing, f"{package}: {missing} would be left out of the wheel; add a pattern to package-data"
