"""The workbench in a real browser: JupyterLab on localhost (with a token), Chromium driven by Playwright.

The test copies the tour notebook into a temporary folder, starts JupyterLab there, opens the notebook and runs every
cell. The tour's workbench is on a plan as deep as GPT-1.3B (24 layers, two pipeline stages on 2 hosts x 4 devices).
The test waits for every view (found by their stable CSS classes), checks that none scrolls sideways and that the
header stays in view, screenshots each one, then clicks every control it owns and checks what each click shows: the
operator graph (open a group of repeated layers, expand a layer of 500 operators, zoom, hover, colour by sharding),
an override on a deep layer in the sharding table (for every layer sharing its solution, then for that layer
alone), a cut moved by layer name, submeshes edited for every stage, undo, a what-if
re-plan, compare and adopt, export, and a local training run. Screenshots are kept under the test's tmp dir; with
``AUTOPAR_SCREENSHOTS=docs`` they are also written to ``docs/`` (the README uses them).

    AUTOPAR_SCREENSHOTS=docs .venv/bin/python -m pytest -q -m slow tests/test_browser.py

It needs Debian's Chromium at /usr/bin/chromium (skipped without it; never ``playwright install``) and, for the local
training run, 8 JAX devices (``JAX_NUM_CPU_DEVICES=8``, as ``make test`` sets).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
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
VIEWS = ("autopar-header", "autopar-controls", "autopar-graph", "autopar-sharding-table", "autopar-cost-panel",
         "autopar-stage-layout", "autopar-timeline", "autopar-training")

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
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           # No language-server search (it starts npm) and no terminals: the tests use neither (0.4 CPU-s a start).
           "--ServerApp.jpserver_extensions=jupyter_lsp=False",
           "--ServerApp.jpserver_extensions=jupyter_server_terminals=False"]
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


# Each plotly figure's drawn size and number of drawn traces, as one string: it stops changing when the figures have
# taken their grid cells' widths and drawn their data.
_PLOT_SIZES = ("(scope) => [...document.querySelectorAll(scope + ' .js-plotly-plot')].map(p => {"
               " const r = p.getBoundingClientRect(); return [r.width, r.height,"
               " p.querySelectorAll('.trace, .hm, .imagelayer image').length].join(','); }).join(';')")


def wait_for_plots(page, scope: str = "body", timeout_s: float = 30) -> None:
    """Give plotly figures under ``scope`` time to (re)draw before a screenshot: a figure widget first shows empty
    axes and draws its data when the front end has it, at its default width, then takes its grid cell's. Waits until
    each figure has data and drawn traces, then until their sizes hold still for half a second (it waited a fixed
    second before: ~15 s of the deep test), at most ``timeout_s``; never fails by itself (a figure may legitimately
    be empty)."""
    deadline = time.monotonic() + timeout_s
    with contextlib.suppress(Exception):
        page.wait_for_function(
            "(scope) => [...document.querySelectorAll(scope + ' .js-plotly-plot')].every(p =>"
            " p._fullData && p._fullData.length > 0 && p.querySelector('.trace, .hm, .imagelayer image'))",
            arg=scope, timeout=int(timeout_s * 1000), polling=250)
    sizes, still = page.evaluate(_PLOT_SIZES, scope), 0
    while still < 2 and time.monotonic() < deadline:
        page.wait_for_timeout(250)
        now = page.evaluate(_PLOT_SIZES, scope)
        still = still + 1 if now == sizes else 0
        sizes = now


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


def sideways_scrolls(page) -> list:
    """Every view (and the workbench, and the notebook) whose content is wider than its box: [(class, content
    width, box width)]."""
    return page.evaluate(
        "(views) => { const out = []; const sel = ['.autopar-workbench', '.jp-WindowedPanel-outer',"
        " ...views.map(v => '.' + v)];"
        " for (const s of sel) for (const e of document.querySelectorAll(s))"
        "   if (e.scrollWidth > e.clientWidth + 1) out.push([s, e.scrollWidth, e.clientWidth]);"
        " return out; }", list(VIEWS))


# Whether the kernel has handled every message the page sent it: none waits to be sent, every request sent (a widget's
# comm message is one) has had its reply and the kernel's idle status for it, and the kernel is idle. A request not
# yet answered is a kernel future without JupyterLab's KernelFutureFlag.IsDone (4); the output areas keep their
# cells' finished execute requests, so the futures are not simply counted.
_KERNEL_DONE = ("() => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
                " const open = [...(k._futures || new Map()).values()].some(f => !(f._status & 4));"
                " return k.status === 'idle' && !open && !(k._pendingMessages || []).length; }")
_KNOWS_FUTURES = ("() => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
                  " return k._futures instanceof Map && Array.isArray(k._pendingMessages); }")
_TWO_FRAMES = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"


def settle(page, timeout_s: float = 600) -> None:
    """Wait until the kernel has handled every message the page sent it (a widget callback may price plans for a
    while; the page shows its result only after), and the page has drawn what it answered. Twice: what the page
    drew may send the kernel a message of its own. (It slept 0.3 s before and after waiting for an idle kernel:
    ~20 s of the deep test's 35 calls.)"""
    knows = page.evaluate(_KNOWS_FUTURES)
    for _ in range(2):
        if not knows:  # a JupyterLab whose kernel connection lacks those fields: give the message time to arrive
            page.wait_for_timeout(300)
        page.wait_for_function(_KERNEL_DONE, timeout=int(timeout_s * 1000), polling=100)
        page.evaluate(_TWO_FRAMES)


def assert_fits(page, timeout_s: float = 90) -> None:
    """No view scrolls sideways, once the figures settled (a plotly figure is first drawn at its default width and
    takes its own a moment later: beside the rest of `make test` on 2 cores, the stage layout's took over 30 s)."""
    deadline = time.monotonic() + timeout_s
    while sideways_scrolls(page) and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    assert not sideways_scrolls(page), (sideways_scrolls(page), widest_children(page))


def widest_children(page) -> list:
    """For each view that scrolls sideways, its descendants wider than it (tag, class, width, start of the text):
    what to fix."""
    return page.evaluate(
        "(views) => { const out = [];"
        " for (const v of views) for (const e of document.querySelectorAll('.' + v)) {"
        "   if (e.scrollWidth <= e.clientWidth + 1) continue;"
        "   for (const c of e.querySelectorAll('*')) { const w = c.getBoundingClientRect().width;"
        "     if (w > e.clientWidth + 1) out.push([v, c.tagName, String(c.className).slice(0, 60), Math.round(w),"
        "                                          (c.innerText || c.textContent || '').slice(0, 80)]); } }"
        " return out.slice(0, 12); }", list(VIEWS))


def text_of(page, selector: str) -> str:
    return page.locator(selector).first.inner_text()


def wait_for_text(page, selector: str, needle: str, timeout_s: float = 60, gone: bool = False) -> str:
    """Wait until the first element matching ``selector`` shows (or, ``gone``, no longer shows) ``needle``; on a
    time-out, fail with what the workbench's header, controls and status said."""
    try:
        page.wait_for_function(
            "([sel, needle, gone]) => { const e = document.querySelector(sel);"
            " return !!e && e.innerText.includes(needle) !== gone; }",
            arg=[selector, needle, gone], timeout=int(timeout_s * 1000), polling=250)
    except Exception as e:  # noqa: BLE001 - re-raised with the page's state
        places = (selector, ".autopar-header", ".autopar-controls", ".autopar-status")
        state = {s: text_of(page, s)[:600] for s in places if page.locator(s).count()}
        raise AssertionError(f"{selector} did not {'lose' if gone else 'show'} {needle!r} in {timeout_s:.0f} s: "
                             f"{state}") from e
    return text_of(page, selector)


def svg_texts(locator) -> list[str]:
    """The text of SVG elements (``inner_text`` is for HTML only)."""
    return locator.evaluate_all("els => els.map(e => e.textContent)")


def button(page, scope: str, name: str):
    return page.locator(scope).first.get_by_role("button", name=name, exact=True).first


def editor_select(page, stage: int, column: int):
    """The stage editor's dropdown of ``stage`` (column 0: first layer, 1: submesh, 2: logical mesh, 3: remat)."""
    return page.locator(".autopar-stage-editor select").nth(4 * stage + column)


@pytest.mark.slow
def test_deep_workbench_in_chromium(tmp_path):
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / "01_tour.ipynb", root)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    dirs = _shots_dirs(tmp_path)
    log = []
    with jupyter_lab(root, scratch) as (url, token), chromium_page((1400, 3400)) as page:
        open_and_run_all(page, url, token, "01_tour.ipynb", timeout_s=90)
        for cls in VIEWS:  # the tour's planning cells run first: allow for a loaded machine
            page.wait_for_selector(f".{cls}", state="visible", timeout=300_000)
        wait_until_idle(page, timeout_s=300)
        assert not cell_errors(page), cell_errors(page)
        wait_for_plots(page, ".autopar-workbench")  # drawn, and fit their grid cells (the first resize)
        header = text_of(page, ".autopar-header")
        assert "2 stages on 8 devices" in header and "peak memory" in header and "operator pins" in header
        assert_fits(page)

        # --- the operator graph: 24 repeated layers as two groups; open one; expand a layer ----------------------
        graph = page.locator(".autopar-graph").first
        labels = svg_texts(graph.locator(".apg-ov-label"))
        assert "layer_0..layer_11" in labels and "layer_12..layer_23" in labels and len(labels) <= 6
        assert svg_texts(graph.locator(".apg-badge")) == ["\u00d712", "\u00d712"]
        legends = graph.locator(".apg-legend-title").all_inner_texts()
        assert "colour: stage" in legends and "edges" in legends
        for cls in VIEWS:
            view = page.locator(f".{cls}").first
            view.scroll_into_view_if_needed()
            wait_for_plots(page, f".{cls}", timeout_s=10)
            if cls != "autopar-graph":
                shot = _save(view, f"workbench-{cls.removeprefix('autopar-')}.png", dirs)
                assert shot.stat().st_size > 2000, f"the {cls} screenshot is empty"
        workbench = page.locator(".autopar-workbench").first
        workbench.scroll_into_view_if_needed()
        _save(workbench, "workbench.png", dirs)

        graph.locator('[data-key="G:layer_0"]').click()
        page.wait_for_function("() => document.querySelectorAll('.autopar-graph .apg-ov').length >= 16",
                               timeout=60_000)
        drawn = svg_texts(graph.locator(".apg-ov-label"))
        assert "embed" in drawn and "outside layers" in drawn and len(drawn) < 16  # 16 nodes, sparse labels
        t0 = time.monotonic()
        graph.locator('[data-key="L:layer_5"]').click()
        page.wait_for_function("() => Number(document.querySelector('.autopar-graph .apg-root').dataset.nodes) > 300",
                               timeout=60_000)
        root_el = graph.locator(".apg-root").first
        layout_ms = root_el.get_attribute("data-layout-ms")
        log.append(f"expand layer_5: {time.monotonic() - t0:.2f} s (layout {layout_ms} ms)")
        assert re.search(r"layer_5: \d{3} operators", text_of(page, ".autopar-graph .apg-detail-title"))
        # Named operators, legible where the view opens (the top of the layer).
        assert "apg-nolabels" not in (root_el.get_attribute("class") or "")
        names = svg_texts(graph.locator(".apg-op-label"))  # matmuls by module, the rest by primitive
        assert len(names) > 300 and {"qkv", "fc1", "fc1 (weight grad)", "add"} <= set(names)
        page.mouse.move(0, 0)  # no tooltip in the screenshot
        page.wait_for_timeout(300)
        _save(graph, "workbench-graph.png", dirs)
        # Zoom and pan stay fast at 500 operators: 20 wheel steps and a drag, then the frame is drawn.
        box = graph.locator(".apg-detail").first.bounding_box()
        cx, cy = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        page.mouse.move(cx, cy)
        scale0 = float(root_el.get_attribute("data-scale"))
        t0 = time.monotonic()
        for _ in range(20):
            page.mouse.wheel(0, 120)
        page.mouse.down()
        page.mouse.move(cx + 150, cy + 60, steps=10)
        page.mouse.up()
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        zoom_s = time.monotonic() - t0
        scale1 = float(root_el.get_attribute("data-scale"))
        log.append(f"20 wheel steps + a 10-step drag, drawn: {zoom_s:.2f} s; scale {scale0:.3f} -> {scale1:.3f}")
        assert scale1 < scale0 and zoom_s < 10
        assert "apg-nolabels" in (root_el.get_attribute("class") or "")  # names hide when too small to read
        button(page, ".autopar-graph", "fit").click()
        # Hover: an operator tells its shapes and sharding; a resharded edge its collective, bytes and time.
        node = graph.locator('.apg-op[data-key^="O:"]').first
        node.dispatch_event("mousemove", {"clientX": int(cx), "clientY": int(cy)})
        tip = graph.locator(".apg-tip").first
        assert tip.is_visible() and "sharding: output" in tip.inner_text() and "read and written" in tip.inner_text()
        graph.get_by_role("button", name="sharding").first.click()
        wait_for_text(page, ".autopar-graph .apg-legends", "operators: output sharding")
        assert_fits(page)

        # --- an override on a deep layer (layer_13, run by stage 1) re-prices the plan ------------------------------
        # Not the planner's copy: the table lists the real layers, and layer_13's row is layer_13's own operator.
        step = page.locator(".autopar-step-time").first
        before = step.inner_text()
        table = page.locator(".autopar-sharding-table").first
        layer_filter = table.locator(".widget-dropdown").filter(has=page.locator("label", has_text="layer")).locator(
            "select").first
        choices = layer_filter.locator("option").evaluate_all("els => els.map(e => e.value)")
        assert "layer_13" in choices and any(c.startswith("layer_0..23 (×24, one solution") for c in choices)
        layer_filter.select_option("layer_13")
        settle(page)
        rows = table.locator(".widget-select select").first
        page.wait_for_function("(el) => el.options.length > 0 && el.options[0].text.includes('layer_13')",
                               arg=rows.element_handle(), timeout=30_000)
        ops = rows.locator("option").evaluate_all("els => els.map(e => e.value)")
        first = rows.locator("option").first.inner_text().replace("\xa0", " ")  # the select pads with nbsp
        assert "layer_13" in first and " S1 " in first, first  # the real layer, on the stage that runs it
        rows.select_option(ops[0])
        settle(page)
        strategy = (table.locator(".widget-dropdown").filter(has=page.locator("label", has_text="strategy"))
                    .locator("select").first)
        page.wait_for_function("(el) => el.options.length > 1", arg=strategy.element_handle(), timeout=60_000)
        wait_for_text(page, ".autopar-op-detail", "stage 1's")
        _save(table, "workbench-sharding-table-alternatives.png", dirs)
        labels = strategy.locator("option").evaluate_all("els => els.map(e => e.textContent)")
        assert sum("no change" not in t for t in labels) >= 2, labels  # real deltas, not "+0 s"
        current = strategy.input_value()
        options = [o for o in strategy.locator("option").evaluate_all("els => els.map(e => e.value)") if o != current]
        strategy.select_option(options[-1])  # the dearest: every layer sharing the solution, on both stages
        settle(page)
        wait_for_text(page, ".autopar-step-time", before, gone=True)
        group_step = step.inner_text()
        assert "was " in group_step and "1 operator pin" in text_of(page, ".autopar-header")
        log.append(f"override of layer_13's group: {before} -> {group_step}")
        # The same operator in layer_13 alone: split from its group, priced on its own.
        table.locator(".autopar-override-scope").get_by_role("button", name="layer_13 alone").click()
        settle(page)
        page.wait_for_function("(el) => el.options.length > 1", arg=strategy.element_handle(), timeout=60_000)
        current = strategy.input_value()
        options = [o for o in strategy.locator("option").evaluate_all("els => els.map(e => e.value)")
                   if o != current and "no change" not in o]
        strategy.select_option(options[0])
        settle(page)
        wait_for_text(page, ".autopar-step-time", group_step, gone=True)
        wait_for_text(page, ".autopar-header", "in split layer")
        assert rows.locator("option").first.inner_text().startswith("*")  # the row refreshed: pinned, new spec
        log.append(f"override of layer_13 alone: {group_step} -> {step.inner_text()}")
        # The graph redrew layer_13 (the selected operator's layer) for the new plan: edges the override made
        # resharded are red, their hover says how.
        settle(page)
        said = int(re.search(r"(\d+) resharded edge", text_of(page, ".autopar-graph")).group(1))
        hot = graph.locator(".apg-resharded")
        assert hot.count() == said
        log.append(f"resharded edges drawn in layer_13 after the override: {said}")
        if said:
            hot.first.dispatch_event("mousemove", {"clientX": int(cx), "clientY": int(cy)})
            text = tip.inner_text()
            assert "→" in text and "costs" in text and ("over mesh axis" in text or "local slicing" in text)
        wait_for_plots(page, ".autopar-cost-panel")
        _save(page.locator(".autopar-cost-panel").first, "workbench-cost-panel-after-override.png", dirs)
        log.append(f"override: {before} -> {step.inner_text()}")

        # --- stages: a cut moved by layer name, then every submesh edited together ------------------------------
        layout = ".autopar-stage-layout"
        editor_select(page, 1, 0).select_option(label="layer_15")
        settle(page)
        wait_for_text(page, ".autopar-stage-preview", "preview: step time")
        assert "S1: layers 16-25 (layer_15..head)" in text_of(page, ".autopar-stage-preview")
        button(page, layout, "apply stages").click()
        settle(page)
        wait_for_text(page, layout, "S1: layers 16-25 (layer_15..head)")
        button(page, layout, "+ stage").click()
        settle(page)
        wait_for_text(page, ".autopar-stage-preview", "S2:")
        editor_select(page, 0, 1).select_option(label="1x4")  # alone it cannot tile the cluster: said so
        settle(page)
        editor_select(page, 1, 1).select_option(label="1x4")
        settle(page)
        wait_for_text(page, ".autopar-stage-preview", "not valid")
        editor_select(page, 0, 1).select_option(label="1x2")
        settle(page)
        editor_select(page, 1, 1).select_option(label="1x2")
        settle(page)
        editor_select(page, 2, 1).select_option(label="1x4")
        settle(page)
        editor_select(page, 2, 2).select_option(label="2x2")  # stage 2's 4 devices as a 2x2 logical mesh
        settle(page)
        wait_for_text(page, ".autopar-stage-preview", "S2: layers 16-25 (layer_15..head) on 1x4 as 2x2")
        page.locator(layout).first.scroll_into_view_if_needed()
        _save(page.locator(layout).first, "workbench-stage-layout.png", dirs)
        button(page, layout, "apply stages").click()
        settle(page)
        wait_for_text(page, ".autopar-header", "3 stages on 8 devices")
        assert "S2: layers 16-25 (layer_15..head) on 1x4 as 2x2" in text_of(page, layout)

        # --- undo (header) ------------------------------------------------------------------------------------------
        button(page, ".autopar-header", "undo").click()
        settle(page)
        wait_for_text(page, ".autopar-header", "2 stages on 8 devices")
        assert "not valid" not in text_of(page, layout)

        # --- what if: 2 devices per host, re-planned; then back -------------------------------------------------
        page.locator(".autopar-toolbar").first.get_by_role("button", name="what if…").click()
        settle(page)
        slider = page.locator(".autopar-controls .widget-slider").filter(
            has=page.locator("label", has_text="devices per host")).first
        slider.locator(".noUi-handle").first.focus()
        page.keyboard.press("ArrowLeft")  # 4 -> 2 devices per host
        settle(page)
        button(page, ".autopar-controls", "re-plan on this cluster").click()
        settle(page)
        wait_for_text(page, ".autopar-header", "on 4 devices", timeout_s=300)
        log.append("what-if: " + text_of(page, ".autopar-header").splitlines()[0])
        button(page, ".autopar-header", "undo").click()
        settle(page)
        wait_for_text(page, ".autopar-header", "on 8 devices")

        # --- compare and adopt; export follows the plan -----------------------------------------------------------
        button(page, ".autopar-toolbar", "export JAX code").click()
        settle(page)
        code = page.locator(".autopar-code textarea").first
        page.wait_for_function("(el) => el.value.includes('PartitionSpec')", arg=code.element_handle(), timeout=60_000)
        old_code = code.input_value()
        button(page, ".autopar-toolbar", "compare baselines").click()
        settle(page)
        wait_for_text(page, ".autopar-controls", "data_parallel", timeout_s=300)
        pick = page.locator(".autopar-controls .widget-dropdown").filter(
            has=page.locator("label", has_text="use plan")).locator("select").first
        assert pick.input_value() == "megatron"  # never blank
        pick.select_option("data_parallel")
        settle(page)
        button(page, ".autopar-controls", "make current").click()
        settle(page)
        wait_for_text(page, ".autopar-header", "adopt_data_parallel")
        wait_for_text(page, ".autopar-controls", "data_parallel (current)")
        page.wait_for_function("([el, old]) => el.value !== old", arg=[code.element_handle(), old_code],
                               timeout=60_000)
        _save(page.locator(".autopar-controls").first, "workbench-controls.png", dirs)
        button(page, ".autopar-header", "undo").click()
        settle(page)
        wait_for_text(page, ".autopar-header", "2 stages on 8 devices")

        # --- a local training run: the loss curve, measured against predicted ------------------------------------
        training = page.locator(".autopar-training").first
        steps = training.locator("input").first
        steps.fill("2")
        steps.press("Tab")
        settle(page)
        t0 = time.monotonic()
        button(page, ".autopar-training", "run locally").click()
        settle(page)
        wait_for_text(page, ".autopar-training", "done", timeout_s=600)
        log.append(f"run locally, 2 steps: {time.monotonic() - t0:.1f} s")
        assert "training failed" not in training.inner_text()
        runs = text_of(page, ".autopar-runs")
        assert "local" in runs and "2/2" in runs and "→" in runs
        # The loss curve's last point is a separate message from the "done" text: wait for it, a while under load.
        # (A figure re-rendered under load shows no trace for a moment: that reads -1, and the wait goes on, where
        # reading the first trace of an empty figure threw and ended the wait at once: a fresh clone, 2026-12-07.)
        count = ("() => { const p = document.querySelector('.autopar-training .js-plotly-plot');"
                 " return p && p._fullData && p._fullData.length && p._fullData[0].y ?"
                 " p._fullData[0].y.length : -1; }")
        with contextlib.suppress(Exception):
            page.wait_for_function(f"() => ({count})() >= 2", timeout=60_000, polling=250)
        assert page.evaluate(count) == 2
        wait_for_plots(page, ".autopar-training")
        _save(training, "workbench-training.png", dirs)

        # --- the header stays in view while the notebook scrolls --------------------------------------------------
        page.set_viewport_size({"width": 1400, "height": 900})
        page.wait_for_timeout(500)
        training.scroll_into_view_if_needed()
        page.wait_for_timeout(300)
        top = page.evaluate("() => document.querySelector('.autopar-header').getBoundingClientRect().top")
        outer = page.evaluate("() => document.querySelector('.jp-WindowedPanel-outer').getBoundingClientRect().top")
        assert abs(top - outer) <= 2, (top, outer)
        assert page.locator(".autopar-header").first.get_by_role("button", name="undo").is_visible()
        assert_fits(page)
        assert not cell_errors(page), cell_errors(page)
        (dirs[0] / "clicks.txt").write_text("\n".join(log) + "\n")


# The workbench the module check opens (issue 30: Llama 3 8B on two DGX H100 hosts), and what it expects layer
# MODULES_LAYER's rows to be named.
MODULES_MODEL, MODULES_CLUSTER, MODULES_LAYER = "llama3-8b", "dgx-h100:2", "layer_20"
MODULES_LABELS = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/scores", "attn/context", "attn/o_proj",
                  "mlp/gate", "mlp/up", "mlp/down")
SHAPES = re.compile(r"\[\d+(,\d+)*\](x\[\d+(,\d+)*\])* -> \[\d+(,\d+)*\]")


@pytest.mark.slow
def test_views_name_modules_in_chromium(tmp_path):
    """Issue 30 item 6 and issue 35 item 8 as a user meets them: the sharding table's rows of a deep layer name their
    module and shapes, the filter by module keeps one module's rows, the graph names the layer's matmuls by module and
    the overview names the layer selected."""
    import nbformat

    root = tmp_path / "notebooks"
    root.mkdir()
    cell = (f"import autopar_lab as al\n"
            f"wb = al.Workbench(al.models.get({MODULES_MODEL!r}), al.Cluster.parse({MODULES_CLUSTER!r}))\nwb")
    kernel = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}}  # as the tour's
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)], metadata=kernel),
                   root / "modules.ipynb")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    dirs = _shots_dirs(tmp_path)[:1]  # kept with the test (the README's table screenshot is the tour's)
    with jupyter_lab(root, scratch) as (url, token), chromium_page((1400, 2400)) as page:
        open_and_run_all(page, url, token, "modules.ipynb", timeout_s=90)
        page.wait_for_selector(".autopar-sharding-table", state="visible", timeout=300_000)
        wait_until_idle(page, timeout_s=300)
        assert not cell_errors(page), cell_errors(page)
        wait_for_plots(page, ".autopar-workbench")  # drawn, and fit their grid cells (the first resize)
        settle(page)

        # --- the table: layer LAYER's rows name their module, with shapes -------------------------------------------
        table = page.locator(".autopar-sharding-table").first
        layer_filter = table.locator(".widget-dropdown").filter(has=page.locator("label", has_text="layer")).locator(
            "select").first
        layer_filter.select_option(MODULES_LAYER)
        settle(page)
        rows = table.locator(".autopar-op-rows select").first
        page.wait_for_function("([el, layer]) => el.options.length > 0 && el.options[0].text.includes(layer)",
                               arg=[rows.element_handle(), MODULES_LAYER], timeout=30_000)

        def texts() -> list[str]:
            return [t.replace("\xa0", " ") for t in rows.locator("option").all_inner_texts()]

        shown = texts()
        assert all(MODULES_LAYER in t and SHAPES.search(t) for t in shown), shown
        for label in MODULES_LABELS:
            assert any(f" {label} " in t for t in shown), (label, shown)
        header = text_of(page, ".autopar-sharding-table .autopar-op-header")
        assert "module" in header and "shapes" in header and "module path" in header
        assert_fits(page)  # the rows are wider than the column: they scroll inside the table, not the page
        table.scroll_into_view_if_needed()
        _save(table, "workbench-sharding-table-modules.png", dirs)

        # --- the filter by module: one module's rows (its forward and its gradients) --------------------------------
        module = MODULES_LABELS[-1]
        box = table.locator(".autopar-module-filter input").first
        box.fill(module)
        box.press("Enter")
        settle(page)
        page.wait_for_function("([el, n]) => el.options.length > 0 && el.options.length < n",
                               arg=[rows.element_handle(), len(shown)], timeout=30_000)
        kept = texts()
        assert all(f" {module}" in t and MODULES_LAYER in t for t in kept), kept
        assert sum(f" {module} " in t for t in shown) == len(kept)

        # --- the graph: the layer opened, its matmuls named by module, its name in the overview --------------------
        graph = page.locator(".autopar-graph").first
        for _ in range(8):  # open the groups of repeated layers until the layer has its own node
            if graph.locator(f'[data-key="L:{MODULES_LAYER}"]').count():
                break
            graph.locator('[data-key^="G:"]').first.click()
            settle(page)
        graph.locator(f'[data-key="L:{MODULES_LAYER}"]').click()
        page.wait_for_function("() => Number(document.querySelector('.autopar-graph .apg-root').dataset.nodes) > 100",
                               timeout=60_000)
        assert MODULES_LAYER in svg_texts(graph.locator(".apg-ov-label"))  # named though its neighbours may not be
        names = set(svg_texts(graph.locator(".apg-op-label")))
        assert set(MODULES_LABELS) <= names, sorted(names)
        node = graph.locator('.apg-op[data-key^="O:"]').filter(has_text=MODULES_LABELS[0]).first
        node.dispatch_event("mousemove", {"clientX": 200, "clientY": 200})
        tip = graph.locator(".apg-tip").first
        assert f"module: {MODULES_LABELS[0]}" in tip.inner_text() and "FLOP" in tip.inner_text()
        page.mouse.move(0, 0)
        _save(graph, "workbench-graph-modules.png", dirs)


# A deep model (24 layers, planned on its shallow copy) small enough to plan in seconds: the graph and charts checks.
CHARTS_CELL = ("import autopar_lab as al\n"
               "m = al.models.get('gpt-tiny', num_layers=24, batch_size=16, hidden_size=64, seq_len=32,\n"
               "                  vocab_size=128)\n"
               "c = al.Cluster.preset('p3.16xlarge', hosts=2).with_(devices_per_host=4)\n"
               "wb = al.Workbench(m, c, plan=al.megatron_plan(m, c, dp=1, tp=4, pp=2, microbatches=4))\nwb")

# Nodes of the detail view whose box starts above the bottom of its caption while lying inside the pane.
_UNDER_CAPTION = """(root) => {
  const cap = root.querySelector('.apg-detail-title').getBoundingClientRect();
  const pane = root.querySelector('.apg-detail').getBoundingClientRect();
  return [...root.querySelectorAll('.apg-op rect')].map(r => r.getBoundingClientRect())
    .filter(b => b.bottom > pane.top && b.top < pane.bottom && b.right > pane.left && b.left < pane.right)
    .filter(b => b.top < cap.bottom - 0.5 && b.right > cap.left && b.left < cap.right).length; }"""

# For the plotly figure under `scope` whose title includes `title`: whether its toolbar's box meets its title's.
_TOOLBAR_ON_TITLE = """([scope, title]) => {
  const plot = [...document.querySelectorAll(scope + ' .js-plotly-plot')]
    .find(p => (p.querySelector('.gtitle') || {}).textContent?.includes(title));
  if (!plot) return 'no figure titled ' + title;
  const t = plot.querySelector('.gtitle').getBoundingClientRect();
  const bar = plot.querySelector('.modebar');
  if (!bar) return 'no toolbar';
  const m = bar.getBoundingClientRect();
  return m.left < t.right && t.left < m.right && m.top < t.bottom && t.top < m.bottom; }"""


@pytest.mark.slow
def test_graph_and_charts_read_clearly_in_chromium(tmp_path):
    """Issue 35 item 8 as a user reads it: the detail view's caption never covers the top row of operators, the
    overview's hover counts the operators the caption counts, the hovers' strategy notation is explained in the
    graph and the table, and plotly's toolbar (shown when the mouse is over a chart) leaves the stage and memory
    charts' titles readable."""
    import nbformat

    root = tmp_path / "notebooks"
    root.mkdir()
    kernel = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}}
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CHARTS_CELL)], metadata=kernel),
                   root / "charts.ipynb")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with jupyter_lab(root, scratch) as (url, token), chromium_page((1600, 2600)) as page:
        open_and_run_all(page, url, token, "charts.ipynb", timeout_s=90)
        for cls in VIEWS:
            page.wait_for_selector(f".{cls}", state="visible", timeout=300_000)
        wait_until_idle(page, timeout_s=300)
        assert not cell_errors(page), cell_errors(page)
        wait_for_plots(page, ".autopar-workbench")  # drawn, and fit their grid cells (the first resize)
        settle(page)
        # Every figure drew with plotly's front end loaded once for the kernel (autopar_lab/widgets/views/_base.py:
        # each figure carried and evaluated its own 5 MB copy before).
        figures = page.locator(".autopar-workbench .js-plotly-plot").count()
        assert figures >= 5 and page.evaluate("() => globalThis.__autoparPlotly?.size") == 1, figures

        # --- the graph: a layer opened; its caption above the drawing, at the opening view and after "fit" --------
        graph = page.locator(".autopar-graph").first
        graph.locator('[data-key="G:layer_0"]').click()
        settle(page)
        graph.locator('[data-key="L:layer_5"]').click()
        page.wait_for_function("() => Number(document.querySelector('.autopar-graph .apg-root').dataset.nodes) > 100",
                               timeout=60_000)
        page.wait_for_timeout(500)
        root_el = graph.locator(".apg-root").first
        assert root_el.evaluate(_UNDER_CAPTION) == 0
        button(page, ".autopar-graph", "fit").click()
        page.wait_for_timeout(500)
        assert root_el.evaluate(_UNDER_CAPTION) == 0
        caption = text_of(page, ".autopar-graph .apg-detail-title")
        drawn = int(re.search(r"layer_5: (\d+) operators", caption).group(1))
        assert drawn == int(root_el.get_attribute("data-nodes"))
        # The overview's hover counts what the caption counts.
        graph.locator('[data-key="L:layer_5"]').dispatch_event("mousemove", {"clientX": 200, "clientY": 120})
        tip = graph.locator(".apg-tip").first.inner_text()
        assert re.findall(r"(\d+) operators", tip) == [str(drawn)] and "inputs and outputs of the step" in tip, tip
        page.mouse.move(0, 0)
        # The strategy notation the operators' hovers use, in words under the graph.
        legends = graph.locator(".apg-legends").first.inner_text()
        assert "strategy (hover)" in legends and "S0 split over mesh axis 0" in legends and "R replicated" in legends

        # --- the sharding table says how to read a strategy and an ILP group -------------------------------------
        table = page.locator(".autopar-sharding-table").first
        table.locator(".autopar-notation summary").click()
        notation = table.locator(".autopar-notation").first.inner_text()
        assert "S0 split over mesh axis 0" in notation and "reused from layer_0" in notation
        assert "the 6-layer copy" in notation

        # --- plotly's toolbar, shown while the mouse is over a chart, leaves its title clear ------------------------
        for scope, title in ((".autopar-stage-layout", "stages on the cluster"),
                             (".autopar-cost-panel", "peak memory per device")):
            plot = page.locator(f"{scope} .js-plotly-plot").filter(
                has=page.locator(".gtitle", has_text=title)).first
            plot.scroll_into_view_if_needed()
            plot.hover()
            page.wait_for_timeout(400)
            assert page.evaluate(_TOOLBAR_ON_TITLE, [scope, title]) is False, (scope, title)


FRAMEWORK_TOML = """[model]
name = "llama3"

[training]
local_batch_size = 4
global_batch_size = 64
mixed_precision_param = "bfloat16"
seq_len = 16

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 2
pipeline_parallel_degree = 1
context_parallel_degree = 1
fsdp_reshard_after_forward = "default"

[activation_checkpoint]
mode = "full"
"""


@pytest.mark.slow
def test_framework_config_in_and_out_in_chromium(tmp_path):
    """Issue 33 as a user meets it: the workbench imports a torchtitan TOML pasted into its configuration box (the
    header then names torchtitan's layout) and exports the plan as MaxText YAML into the same box."""
    import nbformat

    root = tmp_path / "notebooks"
    root.mkdir()
    cell = ("import autopar_lab as al\n"
            "m = al.models.get('llama3-tiny', num_layers=4, batch_size=64, dtype='bfloat16')\n"
            "wb = al.Workbench(m, plan=al.megatron_plan(m, al.Cluster.parse('dgx-h100:2'), dp=16, tp=1, pp=1))\nwb")
    kernel = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}}
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)], metadata=kernel),
                   root / "frameworks.ipynb")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with jupyter_lab(root, scratch) as (url, token), chromium_page((1400, 2400)) as page:
        open_and_run_all(page, url, token, "frameworks.ipynb", timeout_s=90)
        page.wait_for_selector(".autopar-workbench", state="visible", timeout=300_000)
        wait_until_idle(page, timeout_s=300)
        assert not cell_errors(page), cell_errors(page)
        settle(page)
        page.locator(".autopar-workbench").first.get_by_role("button", name="framework config…").first.click()
        box = page.locator(".autopar-config textarea").first
        box.wait_for(state="visible", timeout=30_000)
        box.fill(FRAMEWORK_TOML)
        button(page, ".autopar-workbench", "import configuration").click()
        header = wait_for_text(page, ".autopar-header", "fsdp(dp_shard=8,tp=2", timeout_s=300)
        assert "full" in header
        page.locator(".autopar-config").locator("xpath=..").locator("select").last.select_option(label="MaxText")
        button(page, ".autopar-workbench", "export as").click()
        page.wait_for_function("el => el.value.includes('ici_tensor_parallelism: 2')", arg=box.element_handle(),
                               timeout=120_000)
        assert "remat_policy: 'full'" in box.input_value()  # torchtitan's full checkpointing, as MaxText says it
