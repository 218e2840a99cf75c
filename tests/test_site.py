"""The course's website (`python3 course.py site`, configured in docs/): built from the committed,
executed notebooks into a temporary folder with every Sphinx warning an error, then held to what a
reader needs: every lesson and lab has its page, every internal link and image resolves, each lesson
shows the figures it saved (the same bytes), its answers folded, each lab its instructions and a
download of the lab itself and never the solution's answer, and each page's Colab and Kaggle buttons
name that notebook at the repository pyproject.toml names (the one URL the set-up cells install from).

What a browser shows (figures decoded, math typeset, search, no console errors) is tests/test_browser.py.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # one Sphinx build of the whole course (about 15 s on 2 cores)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

URLS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]
REPOSITORY = URLS["Repository"]
IMAGE_TYPES = ("image/png", "image/jpeg")
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def notebook(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def source(cell: dict) -> str:
    return "".join(cell.get("source", ""))


def shown_notebooks() -> list[Path]:
    return [path for folder in ("notebooks", "labs") for path in sorted((REPO_ROOT / folder).glob("*.ipynb"))]


def page_of(site: Path, path: Path) -> Path:
    return site / path.parent.name / f"{path.stem}.html"


def page_text(page: Path) -> str:
    """What the page says, tags removed (syntax highlighting splits code into spans, nothing more)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


class Links(HTMLParser):
    """The href and src of a page, and its element ids."""

    def __init__(self):
        super().__init__()
        self.targets, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for name in ("href", "src"):
            if attrs.get(name):
                self.targets.append((tag, attrs[name]))


def parsed(page: Path) -> Links:
    links = Links()
    links.feed(page.read_text(encoding="utf-8"))
    return links


def site_pages(site: Path) -> list[Path]:
    """The website's pages (the theme's template fragments under _static/ are none)."""
    return sorted(page for page in site.rglob("*.html") if "_static" not in page.relative_to(site).parts)


def broken_links(site: Path) -> list[str]:
    """Every relative href/src of every page whose file is missing, or whose #anchor is not in it."""
    pages = {page: parsed(page) for page in site_pages(site)}
    broken = []
    for page, links in pages.items():
        for tag, target in links.targets:
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or target.startswith(("mailto:", "javascript:")):
                continue
            file = (page.parent / parts.path).resolve() if parts.path else page
            if parts.path.endswith("/"):
                file = file / "index.html"
            where = f"{page.relative_to(site)}: <{tag}> {target}"
            if not file.is_file():
                broken.append(f"{where} (no such file)")
            elif parts.fragment and file in pages and parts.fragment not in pages[file].ids:
                broken.append(f"{where} (no #{parts.fragment} there)")
    return broken


def test_every_lesson_and_lab_has_its_page_and_no_solution_is_published(built_site):
    missing = [str(path.relative_to(REPO_ROOT)) for path in shown_notebooks() if not page_of(built_site, path).is_file()]
    assert not missing, f"notebooks the website leaves out: {missing}"
    assert (built_site / "index.html").is_file() and (built_site / "search.html").is_file()
    shown = {hashlib.sha256(path.read_bytes()).hexdigest() for path in shown_notebooks()}
    published = [str(path.relative_to(built_site)) for path in built_site.rglob("*")
                 if "solutions" in path.relative_to(built_site).parts
                 or (path.suffix == ".ipynb" and hashlib.sha256(path.read_bytes()).hexdigest() not in shown)]
    assert not published, f"the website publishes notebooks that are neither lessons nor labs: {published[:5]}"
    pages = len(site_pages(built_site))
    print(f"website: {pages} pages ({len(shown_notebooks())} notebooks)")


def test_the_toc_follows_the_curriculum_order(built_site):
    home = (built_site / "index.html").read_text(encoding="utf-8")
    linked = re.findall(r'href="((?:notebooks|labs)/[^"#]+)\.html"', home)
    expected = [f"{path.parent.name}/{path.stem}" for path in shown_notebooks()]
    assert list(dict.fromkeys(linked)) == expected, "the home page does not list the notebooks in curriculum order"


def test_every_internal_link_and_image_resolves(built_site):
    broken = broken_links(built_site)
    assert not broken, f"{len(broken)} broken internal links on the website:\n  " + "\n  ".join(broken[:20])


def test_the_link_check_finds_a_missing_page_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.html").write_text('<p id="here"><a href="b.html#gone">b</a> <img src="x.png"> '
                                     '<a href="#here">ok</a> <a href="https://example.org/">out</a></p>')
    (tmp_path / "b.html").write_text('<p id="there">b</p>')
    assert broken_links(tmp_path) == ["a.html: <a> b.html#gone (no #gone there)", "a.html: <img> x.png (no such file)"]


def saved_figures(path: Path) -> list[str]:
    """sha256 of every figure a notebook saved in its outputs."""
    digests = []
    for cell in notebook(path)["cells"]:
        for output in cell.get("outputs", []):
            for kind in IMAGE_TYPES:
                if kind in output.get("data", {}):
                    data = output["data"][kind]
                    digests.append(hashlib.sha256(base64.b64decode("".join(data))).hexdigest())
    return digests


def shown_figures(page: Path) -> list[str]:
    """sha256 of every figure of a page's content (the theme's logos left aside)."""
    sources = [src for tag, src in parsed(page).targets if tag == "img" and "_images/" in src]
    return [hashlib.sha256((page.parent / src).read_bytes()).hexdigest() for src in sources]


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_each_lesson_shows_its_saved_figures_and_folds_its_answers(built_site, path):
    page = page_of(built_site, path)
    assert sorted(shown_figures(page)) == sorted(saved_figures(path)), \
        f"{page.name} does not show the figures {path.name} saved"
    markdown = "\n".join(source(cell) for cell in notebook(path)["cells"] if cell["cell_type"] == "markdown")
    folded = page.read_text(encoding="utf-8").count("<details")
    assert folded == markdown.count("<details") > 0, f"{page.name}: {folded} folded blocks, the lesson has " \
                                                     f"{markdown.count('<details')}"
    assert "<details open" not in page.read_text(encoding="utf-8"), f"{page.name} shows an answer unfolded"
    assert "$$" not in page_text(page), f"{page.name} holds math MyST did not parse"


def test_the_figure_check_sees_a_figure_that_is_not_the_saved_one(built_site):
    lesson = REPO_ROOT / "notebooks" / "00_memory_wall.ipynb"
    shown = shown_figures(page_of(built_site, lesson))
    assert shown and sorted(shown) != sorted(saved_figures(lesson)[:-1] + [hashlib.sha256(b"other").hexdigest()])


def answer_lines(solution: Path) -> list[str]:
    """The solution's lines a learner must write (inside its BEGIN/END regions), long enough to be
    telling and absent from the lab notebook itself."""
    lab = (REPO_ROOT / "labs" / solution.name).read_text(encoding="utf-8")
    lines = []
    for cell in notebook(solution)["cells"]:
        inside = False
        for line in source(cell).splitlines():
            if line.strip().startswith((BEGIN, END)):
                inside = line.strip().startswith(BEGIN)
            elif inside and len(line.strip()) >= 25 and json.dumps(line.strip())[1:-1] not in lab:
                lines.append(line.strip())
    return lines


@pytest.mark.parametrize("solution", sorted((REPO_ROOT / "solutions").glob("*.ipynb")), ids=lambda p: p.stem)
def test_each_lab_page_gives_instructions_and_a_download_never_the_answer(built_site, solution):
    page = built_site / "labs" / f"{solution.stem}.html"
    text = page_text(page)
    answers = answer_lines(solution)
    assert answers and all(line in "\n".join(source(c) for c in notebook(solution)["cells"]) for line in answers)
    shown = [line for line in answers if line in text]
    assert not shown, f"{page.name} shows the solution's answer: {shown[:3]}"
    assert "NotImplementedError" in text, f"{page.name} lost the lab's stubs"
    downloads = [href for tag, href in parsed(page).targets if tag == "a" and "_downloads/" in href]
    assert len(downloads) == 1, f"{page.name}: expected one download link to the lab, found {downloads}"
    assert (page.parent / downloads[0]).read_bytes() == (REPO_ROOT / "labs" / solution.name).read_bytes(), \
        f"{page.name}'s download is not labs/{solution.name}"


def test_launch_buttons_open_each_notebook_at_the_repository_pyproject_names(built_site):
    owner_name = urlsplit(REPOSITORY).path.strip("/")
    wrong = []
    for path in shown_notebooks():
        where = f"{path.parent.name}/{path.name}"
        hrefs = {href for tag, href in parsed(page_of(built_site, path)).targets if tag == "a"}
        expected = {f"https://colab.research.google.com/github/{owner_name}/blob/main/{where}",
                    f"https://www.kaggle.com/kernels/welcome?src={REPOSITORY}/blob/main/{where}"}
        if not expected <= hrefs:
            wrong.append(f"{where}: missing {sorted(expected - hrefs)}")
    assert not wrong, "launch buttons that do not open their notebook:\n  " + "\n  ".join(wrong)


def test_one_repository_url_feeds_the_set_up_cells_the_readme_and_the_site():
    """pyproject's Repository is the address every install line, clone line and badge uses."""
    found = []
    for folder in ("notebooks", "labs", "solutions"):
        for path in sorted((REPO_ROOT / folder).glob("*.ipynb")):
            for cell in notebook(path)["cells"]:
                found += [(f"{folder}/{path.name}", url) for url in re.findall(r"git\+(https://[^\s\"']+)", source(cell))]
    patterns = [r"git\+(https://[^\s\"'`]+)", r"git clone (https://\S+)",
                r"kernels/welcome\?src=(https://\S+?)/blob/"]
    for name in ("README.md", "INSTRUCTORS.md"):
        text = (REPO_ROOT / name).read_text(encoding="utf-8")
        found += [(name, url) for pattern in patterns for url in re.findall(pattern, text)]
        found += [(name, f"https://github.com/{path}")
                  for path in re.findall(r"colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/", text)]
    assert found, "no install line found: the check looks at nothing"
    wrong = sorted({f"{where}: {url}" for where, url in found if url.rstrip("/").removesuffix(".git") != REPOSITORY})
    assert not wrong, f"addresses that are not pyproject's Repository ({REPOSITORY}):\n  " + "\n  ".join(wrong)


def test_the_readme_links_the_website_where_the_workflow_publishes_it():
    owner, name = urlsplit(REPOSITORY).path.strip("/").split("/")
    assert URLS["Documentation"] == f"https://{owner}.github.io/{name}/", "GitHub Pages serves OWNER.github.io/NAME/"
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert f"]({URLS['Documentation']})" in readme.split("## ")[0], "the README's top links the website"
    workflow = (REPO_ROOT / ".github" / "workflows" / "site.yml").read_text(encoding="utf-8")
    assert "course.site_command(" in workflow and "actions/deploy-pages" in workflow
    for lesson in ("00_memory_wall", "08_finetune_accelerate_fsdp"):
        for badge in (f"https://colab.research.google.com/github/{owner}/{name}/blob/main/notebooks/{lesson}.ipynb",
                      f"https://www.kaggle.com/kernels/welcome?src={REPOSITORY}/blob/main/notebooks/{lesson}.ipynb"):
            assert f"]({badge})" in readme, f"the README lacks the badge {badge}"


def tiny_notebook(title: str, markdown: str = "") -> str:
    cells = [{"cell_type": "markdown", "id": "title", "metadata": {}, "source": f"# {title}\n\n{markdown}"}]
    return json.dumps({"cells": cells, "nbformat": 4, "nbformat_minor": 5,
                       "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                                   "language": "python"}}})


def test_a_new_lesson_joins_the_site_and_a_broken_link_or_missing_figure_fails_the_build(tmp_path):
    """The site lists whatever notebooks/ holds, in order (a lesson 14 needs no edit), and a link to a
    page that does not exist or a figure that is not there stops the build, naming them."""
    pytest.importorskip("myst_nb", reason="the website's build tools (pyproject's `site` extra) are not installed")
    course = load_course()
    root = tmp_path / "course"
    shutil.copytree(REPO_ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO_ROOT / "pyproject.toml", root)
    (root / "notebooks").mkdir()
    (root / "labs").mkdir()
    (root / "notebooks" / "00_first.ipynb").write_text(tiny_notebook("00 · First", "[next](missing_page.ipynb)"))
    (root / "notebooks" / "14_new.ipynb").write_text(tiny_notebook("14 · New", "![a plot](missing_figure.png)"))
    (root / "labs" / "01_lab.ipynb").write_text(tiny_notebook("Lab 01"))
    out = tmp_path / "html"
    built = subprocess.run([str(p) for p in course.site_command(Path(sys.executable), out, root)],
                           capture_output=True, text=True, timeout=300)
    log = built.stdout + built.stderr
    assert built.returncode != 0, f"the build passed with a broken link and a missing figure:\n{log[-3000:]}"
    assert "missing_page" in log and "missing_figure.png" in log, log[-3000:]
    home = (out / "index.html").read_text(encoding="utf-8")
    assert home.index("notebooks/00_first.html") < home.index("notebooks/14_new.html") < home.index("labs/01_lab.html")


def load_course():
    import importlib.util

    spec = importlib.util.spec_from_file_location("course", REPO_ROOT / "course.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
