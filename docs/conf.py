"""The course's website: Sphinx with MyST-NB renders the committed, executed notebooks as they are
saved (never re-executed), in the look of Jupyter Book (sphinx-book-theme).

`python3 course.py site` builds it: it stages this folder's pages, notebooks/ and labs/ into one
source folder, so that every page sits at its path in the repository (the Colab and Kaggle
buttons name that path), and runs sphinx-build with warnings as errors. solutions/ is never staged.

The repository's address comes from one place, pyproject.toml's [project.urls] Repository, which
the notebooks' set-up cells install from too (tests/test_site.py holds them to it).
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: pyproject's tomli
    import tomli as tomllib

COURSE = Path(__file__).resolve().parent.parent  # the course folder: pyproject.toml, notebooks/, labs/
PROJECT = tomllib.loads((COURSE / "pyproject.toml").read_text(encoding="utf-8"))["project"]
REPOSITORY = PROJECT["urls"]["Repository"]  # https://github.com/OWNER/NAME
WEBSITE = PROJECT["urls"]["Documentation"]  # where .github/workflows/site.yml publishes this site
BRANCH = "main"
COLAB = "https://colab.research.google.com"
KAGGLE = "https://www.kaggle.com/kernels/welcome"  # ?src=<a notebook's GitHub URL> opens it in Kaggle

project = "Sharding models, from scratch and for real"
author = "the sharding course"
copyright = "the sharding course, Apache-2.0"
root_doc = "index"
language = "en"

extensions = ["myst_nb", "sphinx-mathjax-offline"]  # MathJax served with the site: no CDN needed
nb_execution_mode = "off"  # the notebooks are committed executed: show what they saved
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
suppress_warnings: list[str] = []

html_theme = "sphinx_book_theme"
html_title = "Sharding models"
html_baseurl = WEBSITE
html_copy_source = True
html_static_path = ["_static"]
html_favicon = "_static/favicon.svg"
html_context = {"default_mode": "auto"}  # light or dark as the reader's system says
html_last_updated_fmt = None
html_theme_options = {
    "repository_url": REPOSITORY,
    "repository_branch": BRANCH,
    "path_to_docs": "",  # staged pages sit at their repository paths
    "use_repository_button": True,
    "use_download_button": True,  # the .ipynb of each page (a lab's download never holds answers)
    "use_fullscreen_button": False,
    "launch_buttons": {"colab_url": COLAB, "notebook_interface": "jupyterlab"},
    "home_page_in_toc": True,
    "show_toc_level": 2,
}


def notebook_url(pagename: str) -> str:
    """The GitHub address of a staged notebook page (`notebooks/00_memory_wall`)."""
    return f"{REPOSITORY}/blob/{BRANCH}/{pagename}.ipynb"


def add_kaggle_button(app, pagename, templatename, context, doctree):
    """Kaggle beside the theme's Colab entry in each notebook page's launch menu."""
    for group in context.get("header_buttons", []):
        if group.get("label") == "launch-buttons":
            group["buttons"].append({"type": "link", "text": "Kaggle", "tooltip": "Launch on Kaggle",
                                     "icon": "fab fa-kaggle", "url": f"{KAGGLE}?src={notebook_url(pagename)}"})


def link_solutions_to_the_repository(app, doctree):
    """A lab's links to its worked answer (../solutions/NAME.ipynb) point at the repository: the site
    never renders the solutions, nor offers them for download."""
    from docutils import nodes
    from sphinx import addnodes

    for node in list(doctree.findall(addnodes.pending_xref)):
        target = node.get("reftarget", "")
        if node.get("reftype") == "myst" and target.startswith("../solutions/") and "/" not in target[13:]:
            reference = nodes.reference("", "", internal=False, refuri=f"{REPOSITORY}/blob/{BRANCH}/{target[3:]}")
            reference += node.children
            node.replace_self(reference)


def add_lab_download_link(app, doctree):
    """Under a lab's title, a link that downloads the lab notebook itself (stubs, no answers)."""
    from docutils import nodes
    from sphinx import addnodes

    docname = app.env.docname
    sections = list(doctree.findall(nodes.section))
    if not docname.startswith("labs/") or not sections:
        return
    name = Path(docname).name + ".ipynb"
    link = addnodes.download_reference("", "", nodes.literal(text=name), refdoc=docname, reftarget=name,
                                       refexplicit=True, reftype="download", refdomain="")
    paragraph = nodes.paragraph("", "", nodes.strong(text="Download this lab: "), link,
                                nodes.Text(", then open it in JupyterLab (or open it in Colab or Kaggle from the "
                                           "rocket button above) and run it from the top."))
    sections[0].insert(1, paragraph)


def setup(app):
    app.connect("html-page-context", add_kaggle_button, priority=502)  # after the theme's launch buttons (501)
    # before Sphinx's own collectors (priority 500), which gather the download links
    app.connect("doctree-read", link_solutions_to_the_repository, priority=400)
    app.connect("doctree-read", add_lab_download_link, priority=400)
