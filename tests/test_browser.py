"""The workbench in a real browser: JupyterLab on localhost (with a token), Chromium driven by Playwright.

The test copies the tour notebook into a temporary folder, starts JupyterLab there, opens the notebook, runs every
cell, waits for each of the workbench's views (found by their stable CSS classes), screenshots each one, then changes
one operator's sharding in the table's dropdown and checks that the step time shown changes. Screenshots are kept
under the test's tmp dir; with ``AUTOPAR_SCREENSHOTS=docs`` they are also written to ``docs/`` (the README uses them).

    AUTOPAR_SCREENSHOTS=docs .venv/bin/python -m pytest -q -m slow tests/test_browser.py

It needs Debian's Chromium at /usr/bin/chromium (skipped without it; never ``playwright install``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = pathlib.Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# The workbench's views, by the CSS class each one's top widget carries (autopar_lab/widgets/workbench.py).
VIEWS = ("autopar-controls", "autopar-graph", "autopar-sharding-table", "autopar-cost-panel", "autopar-stage-layout",
         "autopar-timeline", "autopar-training")

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed at /usr/bin/chromium")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(root_dir: pathlib.Path, scratch: pathlib.Path, timeout: float = 90.0):
    """JupyterLab serving ``root_dir`` on 127.0.0.1 with a random token; yields its base URL and the token.

    Its runtime, settings and workspace folders live under ``scratch`` (nothing of the user's is read or written),
    and the server (with its kernels) is stopped on exit, whatever happened."""
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JUPYTER_RUNTIME_DIR=str(scratch / "runtime"), JUPYTER_CONFIG_DIR=str(scratch / "config"),
               JUPYTERLAB_SETTINGS_DIR=str(scratch / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(scratch / "workspaces"),
               IPYTHONDIR=str(scratch / "ipython"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={root_dir}", "--ServerApp.port_retries=0",
           "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "getuid") and os.getuid() == 0:
        cmd.append("--allow-root")
    # No news or update prompts: a toast over a view would end up in its screenshot.
    notes = scratch / "settings" / "@jupyterlab" / "apputils-extension"
    notes.mkdir(parents=True, exist_ok=True)
    (notes / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    # Render every cell (no virtual scrolling), so a view is drawn wherever it sits on the page.
    tracker = scratch / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True, exist_ok=True)
    (tracker / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    log = open(scratch / "jupyter.log", "w")
    proc = subprocess.Popen(cmd, cwd=root_dir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {proc.returncode}: {(scratch / 'jupyter.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s")
            time.sleep(0.5)
        yield url, token
    finally:
        # SIGTERM lets the server shut its kernels down; the process group catches anything left behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # kernels started in the server's group
        log.close()


@contextlib.contextmanager
def chromium_page(viewport=(1500, 3000)):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
            yield page
        finally:
            browser.close()


def open_and_run_all(page, url: str, token: str, notebook: str, timeout_s: float) -> None:
    """Open ``notebook`` in JupyterLab, wait for its kernel, and run every cell (the "Run All Cells" command)."""
    page.goto(f"{url}/lab/tree/{notebook}?token={token}", timeout=int(timeout_s * 1000))
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=int(timeout_s * 1000))
    page.wait_for_function(
        "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " return !!(w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
        " && w.sessionContext.session.kernel.status === 'idle'); }",
        timeout=int(timeout_s * 1000))
    page.evaluate("() => { window.jupyterapp.shell.collapseLeft(); window.jupyterapp.shell.collapseRight();"
                  " return window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def wait_until_idle(page, timeout_s: float) -> None:
    """Wait until no cell is queued or running (JupyterLab marks those with an ``[*]`` prompt)."""
    page.wait_for_function(
        "() => { const p = [...document.querySelectorAll('.jp-InputArea-prompt')].map(e => e.textContent);"
        " return p.length > 0 && !p.some(t => t.includes('*')); }",
        timeout=int(timeout_s * 1000), polling=500)


def cell_errors(page) -> list[str]:
    """The error outputs of the open notebook's cells, read from its model ("ename: evalue" each)."""
    return page.evaluate(
        "() => { const m = window.jupyterapp.shell.currentWidget.content.model; const out = [];"
        " for (let i = 0; i < m.cells.length; i++) { const c = m.cells.get(i); if (c.type !== 'code') continue;"
        " for (const o of c.outputs.toJSON()) if (o.output_type === 'error') out.push(o.ename + ': ' + o.evalue); }"
        " return out; }")


def wait_for_plots(page, scope: str = "body", timeout_s: float = 30) -> None:
    """Give plotly figures under ``scope`` time to (re)draw before a screenshot: a figure widget first shows empty
    axes and draws its data when the front end has it. Waits until each figure has data and drawn traces, at most
    ``timeout_s``; never fails by itself (a figure may legitimately be empty)."""
    with contextlib.suppress(Exception):
        page.wait_for_function(
            "(scope) => [...document.querySelectorAll(scope + ' .js-plotly-plot')].every(p =>"
            " p._fullData && p._fullData.length > 0 && p.querySelector('.trace, .hm, .imagelayer image'))",
            arg=scope, timeout=int(timeout_s * 1000), polling=250)
    page.wait_for_timeout(1000)  # plotly's transitions


def _shots_dirs(tmp_path: pathlib.Path) -> list[pathlib.Path]:
    dirs = [tmp_path / "screenshots"]
    if os.environ.get("AUTOPAR_SCREENSHOTS") == "docs":
        dirs.append(ROOT / "docs")
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    return dirs


def _save(locator, name: str, dirs) -> pathlib.Path:
    first = dirs[0] / name
    locator.screenshot(path=str(first))
    for d in dirs[1:]:
        shutil.copyfile(first, d / name)
    return first


@pytest.mark.slow
def test_tour_workbench_in_chromium(tmp_path):
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / "01_tour.ipynb", root)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    dirs = _shots_dirs(tmp_path)
    with jupyter_lab(root, scratch) as (url, token), chromium_page() as page:
        open_and_run_all(page, url, token, "01_tour.ipynb", timeout_s=90)
        # Every view renders (the tour's planning cells run first: allow for a loaded machine).
        for cls in VIEWS:
            page.wait_for_selector(f".{cls}", state="visible", timeout=240_000)
        wait_until_idle(page, timeout_s=240)
        assert not cell_errors(page), cell_errors(page)
        wait_for_plots(page, ".autopar-workbench")
        for cls in VIEWS:
            view = page.locator(f".{cls}").first
            view.scroll_into_view_if_needed()
            wait_for_plots(page, f".{cls}", timeout_s=10)
            shot = _save(view, f"workbench-{cls.removeprefix('autopar-')}.png", dirs)
            assert shot.stat().st_size > 2000, f"the {cls} screenshot is empty"
        workbench = page.locator(".autopar-workbench").first
        workbench.scroll_into_view_if_needed()
        _save(workbench, "workbench.png", dirs)

        # Override one operator's sharding in the table, and see the cost panel re-price the plan: pick an operator
        # in the table's rows, then another strategy in its "strategy" dropdown (ipywidgets Select / Dropdown).
        step = page.locator(".autopar-step-time").first
        before = step.inner_text()
        table = page.locator(".autopar-sharding-table").first
        rows = table.locator(".widget-select select").first
        ops = rows.locator("option").evaluate_all("els => els.map(e => e.value)")
        assert ops, "the sharding table lists no operator"
        rows.select_option(ops[0])
        strategy = (table.locator(".widget-dropdown").filter(has=page.locator("label", has_text="strategy"))
                    .locator("select").first)
        page.wait_for_function("(el) => el.options.length > 1", arg=strategy.element_handle(), timeout=60_000)
        _save(table, "workbench-sharding-table-alternatives.png", dirs)
        current = strategy.input_value()
        options = [o for o in strategy.locator("option").evaluate_all("els => els.map(e => e.value)") if o != current]
        changed = None
        for value in options[-3:]:  # the dearest alternatives come last: their step time differs for sure
            strategy.select_option(value)
            with contextlib.suppress(Exception):
                page.wait_for_function("([el, old]) => el.innerText !== old", arg=[step.element_handle(), before],
                                       timeout=60_000)
            if step.inner_text() != before:
                changed = value
                break
        after = step.inner_text()
        assert changed is not None, f"the step time stayed {before!r} after overriding a sharding"
        assert not cell_errors(page), cell_errors(page)
        wait_for_plots(page, ".autopar-cost-panel")
        _save(page.locator(".autopar-cost-panel").first, "workbench-cost-panel-after-override.png", dirs)
        (dirs[0] / "override.txt").write_text(f"{before}\n-> {changed}\n{after}\n")
