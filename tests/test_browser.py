"""What a person sees in a browser: the course's website and JupyterLab as `python3 course.py` opens it,
in a real headless Chromium (Debian's, driven by Playwright; nothing is downloaded at run time).

- The website (built by the `built_site` fixture, served on 127.0.0.1): every page loads with no
  console error and no failed request; lesson 00 shows its figures decoded and its math typeset by
  MathJax; the search box finds "ZeRO"; the Colab and Kaggle entries of the launch menu open the
  lesson's notebook; screenshots of the home page and lesson 00 go to the test's temporary folder.
- The main command, in a copy of the course: `course.py --no-browser --port P` prints a URL with its
  token that opens lesson 00, unmodified (a copy saved with another kernelspec opens modified); Run All from the Run menu ends with the kernel idle, every
  figure drawn and no error output; a lab and its solution open from the file browser; a request
  without the token is refused; Ctrl-C (SIGINT to the command's process group, as a terminal sends it)
  stops the server, its kernel and every child, leaving no runtime file.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.browser, pytest.mark.slow]
CHROMIUM_ARGS = [  # as root Chromium needs --no-sandbox; the rest keep it off the (closed) network
    "--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
    "--disable-background-networking", "--disable-component-update", "--disable-dev-shm-usage",
]
FIRST_LESSON = "notebooks/00_memory_wall.ipynb"
LAB = "01_ring_allreduce.ipynb"
OLD_KERNELSPEC = "zz_old_kernelspec.ipynb"  # lesson 00's title saved with another display name: opens modified


def chromium_path() -> str | None:
    return os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through Playwright; skipped, saying why, where either is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed: pyproject's `browser` extra, which `python3 course.py test` installs")
    executable = chromium_path()
    if not executable:
        pytest.skip("no Chromium on this machine: on Debian/Ubuntu `apt-get install chromium` (.ci/run does so)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Watched:
    """A page whose console errors, uncaught exceptions and failed requests are kept."""

    def __init__(self, browser):
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.problems = []
        self.page.on("console", lambda message: message.type == "error" and self.problems.append(message.text))
        self.page.on("pageerror", lambda error: self.problems.append(f"uncaught: {error}"))
        self.page.on("requestfailed", lambda request: self.problems.append(f"failed: {request.url}"))
        self.page.on("response", lambda response: response.status >= 400
                     and self.problems.append(f"{response.status}: {response.url}"))


# ---------------------------------------------------------------------------------
# the website


@pytest.fixture(scope="module")
def site_url(built_site):
    """The built website served by Python's http.server on a free loopback port."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(built_site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


def typeset(page) -> None:
    """Wait for MathJax (on pages that load it) to finish typesetting."""
    page.wait_for_function("!window.MathJax || (window.MathJax.startup && window.MathJax.startup.promise)",
                           timeout=30_000)
    page.evaluate("window.MathJax ? window.MathJax.startup.promise : null")


def test_every_page_of_the_site_loads_without_a_console_error(browser, built_site, site_url):
    pages = sorted(str(p.relative_to(built_site)) for p in built_site.rglob("*.html")
                   if "_static" not in p.relative_to(built_site).parts)
    watched = Watched(browser)
    failing = {}
    for name in pages:
        watched.problems.clear()
        watched.page.goto(site_url + name, wait_until="load")
        typeset(watched.page)
        # every request of this page answered (the favicon comes after "load"): a request left pending is
        # aborted by the next page's navigation and would be counted against that page
        watched.page.wait_for_load_state("networkidle", timeout=30_000)
        if watched.problems:
            failing[name] = list(watched.problems)
    watched.page.close()
    assert len(pages) > 25
    assert not failing, f"pages with console errors or failed requests: {json.dumps(failing, indent=1)[:3000]}"


def test_lesson_00_shows_its_figures_and_typeset_math(browser, site_url, tmp_path):
    watched = Watched(browser)
    page = watched.page
    page.goto(site_url + "index.html", wait_until="load")
    page.screenshot(path=tmp_path / "home.png")
    page.goto(site_url + "notebooks/00_memory_wall.html", wait_until="load")
    typeset(page)
    figures = page.evaluate("""[...document.querySelectorAll('article img')].filter(i => i.src.includes('/_images/'))
        .map(i => ({complete: i.complete, width: i.naturalWidth, height: i.naturalHeight}))""")
    saved = json.loads((REPO_ROOT / FIRST_LESSON).read_text(encoding="utf-8"))
    count = sum("image/png" in output.get("data", {}) for cell in saved["cells"] for output in cell.get("outputs", []))
    assert len(figures) == count > 0, f"lesson 00 shows {len(figures)} figures, it saved {count}"
    assert all(f["complete"] and f["width"] > 0 and f["height"] > 0 for f in figures), f"figures not decoded: {figures}"
    math = page.evaluate("""({spans: document.querySelectorAll('article .math').length,
        typeset: document.querySelectorAll('article .math mjx-container').length,
        text: document.querySelector('article').textContent})""")
    assert math["spans"] > 20 and math["typeset"] == math["spans"], \
        f"MathJax typeset {math['typeset']} of {math['spans']} formulas"
    raw = [mark for mark in ("$$", "\\(", "\\[", "\\frac") if mark in math["text"]]
    assert not raw, f"lesson 00 shows raw TeX: {raw}"
    first = page.locator("article details").first
    assert first.evaluate("d => !d.open"), "the answers must be folded"
    first.locator("summary").click()
    assert first.evaluate("d => d.open") and first.locator("mjx-container").count() > 0, \
        "an opened answer shows its typeset math"
    page.locator("article details").first.locator("summary").click()
    page.locator("article img[src*='_images/']").first.scroll_into_view_if_needed()
    page.screenshot(path=tmp_path / "lesson_00.png")
    assert (tmp_path / "home.png").stat().st_size > 10_000 and (tmp_path / "lesson_00.png").stat().st_size > 10_000
    assert not watched.problems, watched.problems
    print(f"screenshots: {tmp_path / 'home.png'} {tmp_path / 'lesson_00.png'}")
    page.close()


def test_the_search_box_finds_zero(browser, site_url):
    watched = Watched(browser)
    page = watched.page
    page.goto(site_url + "index.html", wait_until="load")
    page.locator("button[aria-label=Search]:visible").first.click()  # opens the theme's search dialog
    field = page.locator("#pst-search-dialog input[name=q]")
    field.fill("ZeRO")
    field.press("Enter")
    page.wait_for_url(re.compile(r"search\.html\?q=ZeRO"))
    page.wait_for_selector("#search-results li a", timeout=30_000)
    found = page.eval_on_selector_all("#search-results li a", "links => links.map(a => a.getAttribute('href'))")
    assert any("notebooks/03_zero_fsdp.html" in href for href in found), f"search for ZeRO found {found[:10]}"
    assert not watched.problems, watched.problems
    page.close()


def test_the_launch_menu_opens_the_lesson_in_colab_and_kaggle(browser, site_url):
    import tomllib

    repository = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]["Repository"]
    page = Watched(browser).page
    page.goto(site_url + "notebooks/00_memory_wall.html", wait_until="load")
    page.locator("button[aria-label='Launch interactive content']").click()
    colab = page.get_by_role("link", name=re.compile("Colab"))
    kaggle = page.get_by_role("link", name=re.compile("Kaggle"))
    assert colab.is_visible() and kaggle.is_visible()
    owner_name = repository.removeprefix("https://github.com/")
    assert colab.get_attribute("href") == f"https://colab.research.google.com/github/{owner_name}/blob/main/{FIRST_LESSON}"
    assert kaggle.get_attribute("href") == f"https://www.kaggle.com/kernels/welcome?src={repository}/blob/main/{FIRST_LESSON}"
    page.close()


# ---------------------------------------------------------------------------------
# JupyterLab through the main command


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def course_copy(tmp_path: Path) -> Path:
    """The course in a temporary folder (JupyterLab's autosave writes there), with a .venv that is this
    test's environment, stamped up to date so that course.py installs nothing."""
    import importlib.util

    root = tmp_path / "course"
    root.mkdir()
    for name in ("course.py", "pyproject.toml", "course-lock.txt"):
        shutil.copy2(REPO_ROOT / name, root)
    for folder in ("notebooks", "labs", "solutions"):
        shutil.copytree(REPO_ROOT / folder, root / folder)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    spec = importlib.util.spec_from_file_location("course_copy", root / "course.py")
    course = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(course)
    (root / ".venv" / "course-stamp.txt").write_text(course.pyproject_hash() + "\n")
    lesson = json.loads((root / FIRST_LESSON).read_text(encoding="utf-8"))
    lesson["cells"] = lesson["cells"][:1]
    lesson["metadata"]["kernelspec"]["display_name"] = "Python 3"
    (root / "notebooks" / OLD_KERNELSPEC).write_text(json.dumps(lesson, indent=1), encoding="utf-8")
    return root


class Command:
    """`python3 course.py --no-browser --port P` in its own session (as a terminal's foreground job)."""

    def __init__(self, root: Path, jupyter: Path, port: int):
        env = {key: value for key, value in os.environ.items() if key != "MPLBACKEND"}  # figures drawn inline
        env.update({name: str(jupyter / folder) for name, folder in [
            ("JUPYTER_RUNTIME_DIR", "runtime"), ("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
            ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
            ("IPYTHONDIR", "ipython")]})
        self.runtime = jupyter / "runtime"
        self.lines = []
        self.process = subprocess.Popen([sys.executable, root / "course.py", "--no-browser", "--port", str(port)],
                                        cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True).start()

    def url(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            for line in list(self.lines):
                if found := re.search(r"(http://127\.0\.0\.1:\d+/\S*\?token=\w+)", line):
                    return found[1]
            time.sleep(0.2)
        raise AssertionError(f"course.py printed no URL with a token:\n{self.log()}")

    def log(self) -> str:
        return "".join(self.lines)[-6000:]

    def interrupt(self, timeout: float = 90) -> int:
        """Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group."""
        os.killpg(self.process.pid, signal.SIGINT)
        return self.process.wait(timeout=timeout)

    def stop(self):
        """After a failure: kill course.py and everything under it (JupyterLab has its own session)."""
        import psutil

        if self.process.poll() is None:
            family = psutil.Process(self.process.pid).children(recursive=True)
            os.killpg(self.process.pid, signal.SIGKILL)
            for process in family:
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            self.process.wait(timeout=30)


def current_tab(page):
    return page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")


def wait_for_notebook(page, path: str, timeout: float = 120_000) -> None:
    """The current tab shows the notebook at `path`, its cells drawn, its kernel idle."""
    page.wait_for_function(f"""() => {{
        const tab = document.querySelector('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current');
        return tab && tab.title.includes('Path: {path}');
    }}""", timeout=timeout)
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell", timeout=timeout)
    page.wait_for_selector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator[data-status="idle"]',
                           timeout=timeout)


def click_until(click, wait, undo=lambda: None, attempts: int = 3) -> None:
    """`click()`, then `wait()` (a Playwright wait) for what it should bring about. A click that lands while the
    page is being redrawn is lost on a loaded 2-core machine (seen in the full suite, on the file browser's Home
    and on Run All): `undo()`, and click again, `attempts` times at most."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for attempt in range(attempts):
        click()
        try:
            wait()
            return
        except PlaywrightTimeout:
            if attempt == attempts - 1:
                raise
            undo()


def open_from_file_browser(page, folder: str, name: str) -> None:
    """Home in the file browser's breadcrumbs, then a double click on the folder and on the notebook."""
    listing = page.locator(".jp-FileBrowser .jp-DirListing-content")
    entry = listing.get_by_text(folder, exact=True)
    click_until(lambda: page.locator(".jp-FileBrowser .jp-BreadCrumbs-home").click(),
                lambda: entry.wait_for(timeout=15_000))
    entry.dblclick()
    page.wait_for_selector(f".jp-FileBrowser .jp-BreadCrumbs >> text={folder}")
    listing.get_by_text(name, exact=True).dblclick()
    wait_for_notebook(page, f"{folder}/{name}")


def run_all_cells(page, cells: str) -> None:
    """Run > Run All Cells, until a cell shows it is running (`[*]`); a menu left open is closed before a retry."""
    def click():
        page.locator(".lm-MenuBar-item", has_text="Run").click()
        page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()

    click_until(click, lambda: page.wait_for_function(f"[...document.querySelectorAll('{cells} .jp-InputPrompt')]"
                                                      ".some(p => p.textContent.includes('*'))", timeout=20_000),
                undo=lambda: page.keyboard.press("Escape"))


def wait_for_connections(port: int, timeout: float = 60) -> None:
    """Until the server accepts connections on `port`: its URL can be printed a moment before (a loaded machine)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def idle_kernels(port: int, token: str, timeout: float = 120) -> list:
    """The server's kernels once every one of them is idle (started and connected)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/kernels?token={token}", timeout=30) as answer:
            kernels = json.load(answer)
        if all(k["execution_state"] == "idle" and k["connections"] for k in kernels) or time.monotonic() > deadline:
            return kernels
        time.sleep(0.5)


@pytest.mark.skipif(os.name == "nt", reason="POSIX process groups and signals")
def test_the_main_command_in_a_browser(browser, tmp_path):
    import psutil

    root = course_copy(tmp_path)
    port = free_port()
    command = Command(root, tmp_path / "jupyter", port)
    try:
        url = command.url()
        assert f"/lab/tree/{FIRST_LESSON}?token=" in url, f"the printed URL does not open lesson 00: {url}"
        wait_for_connections(port)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents", timeout=30)
        assert refused.value.code == 403, f"a request without the token got {refused.value.code}"
        token = url.split("token=")[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}", timeout=30) as answer:
            listed = {item["name"] for item in json.load(answer)["content"]}
        assert {"notebooks", "labs", "solutions"} <= listed, f"JupyterLab serves {listed}, not the course folder"

        page = browser.new_page(viewport={"width": 1400, "height": 900})
        started = time.monotonic()
        page.goto(url)
        wait_for_notebook(page, FIRST_LESSON)
        page.wait_for_timeout(1000)  # the kernel's info has come back: metadata updated if it differs
        assert "jp-mod-dirty" not in current_tab(page).get_attribute("class"), \
            "lesson 00 opens marked modified (its saved kernelspec differs from the environment's?)"

        cells = ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell"
        run_all_cells(page, cells)  # Run > Run All Cells
        ran = time.monotonic()
        page.wait_for_function(f"""() => {{
            const prompts = [...document.querySelectorAll('{cells} .jp-InputPrompt')];
            const idle = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) '
                                                + '.jp-Notebook-ExecutionIndicator[data-status="idle"]');
            return idle && prompts.length && prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
        }}""", timeout=600_000)
        run_all = time.monotonic() - ran
        errors = page.locator(f'{cells} .jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
        assert errors.count() == 0, f"Run All left error output: {errors.all_inner_texts()[:3]}"
        saved = json.loads((REPO_ROOT / FIRST_LESSON).read_text(encoding="utf-8"))
        figures = sum("image/png" in o.get("data", {}) for c in saved["cells"] for o in c.get("outputs", []))
        drawn = page.locator(f"{cells} .jp-RenderedImage img").count()
        assert drawn == figures, f"Run All drew {drawn} figures, the saved lesson has {figures}"
        page.screenshot(path=tmp_path / "jupyterlab_lesson_00.png")

        for folder in ("labs", "solutions"):
            open_from_file_browser(page, folder, LAB)
            page.wait_for_timeout(1000)
            assert "jp-mod-dirty" not in current_tab(page).get_attribute("class"), f"{folder}/{LAB} opens modified"
        assert page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=LAB).count() == 2
        open_from_file_browser(page, "notebooks", OLD_KERNELSPEC)  # the modified mark the check looks for
        page.wait_for_function("document.querySelector('.lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current')"
                               ".classList.contains('jp-mod-dirty')", timeout=60_000)
        kernels = idle_kernels(port, token)
        assert len(kernels) == 4, f"expected a kernel for each of the 4 notebooks opened: {kernels}"
        print(f"JupyterLab: lesson 00 open {ran - started:.0f} s after the URL, Run All {run_all:.0f} s")

        server = psutil.Process(command.process.pid)
        family = [server, *server.children(recursive=True)]  # course.py, JupyterLab, its 4 kernels
        assert len(family) >= 6, f"expected course.py, JupyterLab and 4 kernels, found {[p.name() for p in family]}"
        code = command.interrupt()  # with the page still open, as a learner would
        page.close()
    finally:
        command.stop()
    log = command.log()
    assert code == 0, f"course.py exited {code} on Ctrl-C:\n{log}"
    assert "received signal 15, stopping" in log and "Shutting down 4 kernels" in log, log
    assert "Traceback" not in log, f"the stop was not clean:\n{log}"
    alive = [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left running after Ctrl-C: {alive}"
    left = sorted(p.name for p in command.runtime.iterdir() if p.name.startswith(("jpserver-", "kernel-")))
    assert not left, f"runtime files left after Ctrl-C: {left}"
