""""launch on Ray" from the workbench in a real browser (issue 12): the click starts the embedded Ray from the
panel's worker thread, steps arrive in the panel, cancel stops the job, and the kernel is still alive afterwards (a
new cell runs). Before the fix, Ray's head died with the short-lived thread that started it and took the kernel down.

Same harness as tests/test_browser.py: JupyterLab on 127.0.0.1 with a token, Debian's Chromium through Playwright.
RAY_AUTH_MODE is set explicitly (token auth with a throwaway token); the Ray folders the kernel made are gone after.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from test_browser import CHROMIUM, chromium_page, cell_errors, jupyter_lab, open_and_run_all, wait_until_idle

pytestmark = [pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian chromium is not installed at /usr/bin/chromium"),
              pytest.mark.slow]

CELLS = [
    "import autopar_lab as al\n"
    "model = al.models.get('gpt-tiny', batch_size=8, num_layers=2)\n"
    "plan = al.megatron_plan(model, al.Cluster.preset('cpu'), dp=2, tp=2, pp=2, microbatches=2)\n"
    "wb = al.Workbench(model, plan.cluster, plan=plan)\n"
    "wb.training.launch_kw.update(options=al.RunOptions(compiler_options={'xla_backend_optimization_level': 0}))\n"
    "wb.training.steps.value = 500\n"
    "wb.training.widget",
]


def _notebook(path: Path) -> None:
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}
             for src in CELLS]
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.write_text(json.dumps({"cells": cells, "metadata": {"kernelspec": kernelspec},
                                "nbformat": 4, "nbformat_minor": 5}))


def test_launch_on_ray_from_the_workbench_keeps_the_kernel_alive(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "8")
    root = tmp_path / "nb"
    root.mkdir()
    _notebook(root / "ray.ipynb")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with jupyter_lab(root, scratch) as (url, token), chromium_page(viewport=(1400, 1400)) as page:
        open_and_run_all(page, url, token, "ray.ipynb", timeout_s=90)
        panel = page.locator(".autopar-training").first
        panel.wait_for(state="visible", timeout=300_000)
        wait_until_idle(page, timeout_s=300)
        assert not cell_errors(page), cell_errors(page)

        panel.get_by_role("button", name="launch on Ray").click()
        # Steps arrive: the panel's progress line reads "step N/500 · loss ..." (Ray's start and the stage actors'
        # compiles take minutes on a loaded machine).
        # A failed launch (bad arguments, Ray not starting) says so at once: stop waiting then.
        page.wait_for_function(
            "(el) => /step [1-9][0-9]*\\/500|failed/.test(el.innerText)", arg=panel.element_handle(), timeout=600_000,
            polling=500)
        assert "failed" not in panel.inner_text()
        # The panel draws steps at most 4 times a second, so the page takes the click (before that change it drew
        # every step and could stay too busy for 30 s on a loaded machine); a loaded machine still gets 2 minutes.
        panel.get_by_role("button", name="cancel").click(timeout=120_000)
        page.wait_for_function("(el) => el.innerText.includes('cancelled')", arg=panel.element_handle(),
                               timeout=300_000, polling=500)
        text = panel.inner_text()
        steps = int(text.split("step ")[1].split("/")[0])
        assert 1 <= steps < 500

        # The kernel survived the launching thread's end: a new cell runs in it, with the job's result at hand.
        page.evaluate(
            "async () => { const nb = window.jupyterapp.shell.currentWidget; const app = window.jupyterapp;"
            " nb.content.activeCellIndex = nb.content.widgets.length - 1;"
            " await app.commands.execute('notebook:insert-cell-below');"
            " nb.content.activeCell.model.sharedModel.setSource("
            "   \"import os; from autopar_lab.runtime.launch import local_ray_head\\n\""
            " + \"print('ray folder', os.path.dirname(local_ray_head().head_dir))\\n\""
            " + \"print('kernel alive', wb.training.job.status(), len(wb.training.job.losses))\");"
            " await app.commands.execute('notebook:run-cell'); }")
        page.wait_for_function("() => document.body.innerText.includes('kernel alive cancelled')", timeout=120_000,
                               polling=500)
        assert not cell_errors(page), cell_errors(page)
        folder = Path(page.evaluate("() => document.body.innerText.split('ray folder ')[1].split('\\n')[0].trim()"))
        assert folder.name.startswith("autopar-ray-") and (folder / "auth_token").exists()
    # JupyterLab stopped its kernel: its Ray went with it, folder and token included.
    deadline = time.monotonic() + 120
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert not folder.exists()
