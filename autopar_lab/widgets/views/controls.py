"""Controls: solves (intra-op, inter-op, full) with a progress bar and cancel, resolve around pins, undo/redo,
save/load, export JAX code, what-if cluster sliders that re-plan, and the comparison with the baselines.

Solves run on a worker thread (the notebook stays responsive; cancel sets a threading.Event the session checks at
each progress report). ``start_solve(..., background=False)`` runs on the caller's thread, as tests do.
"""

from __future__ import annotations

import html
import threading
from typing import Any, Callable

import ipywidgets as w

from ._base import USER_ERRORS, View, fmt_s
from ..session import SolveCancelled


def comparison_rows(comparison: dict) -> list[dict]:
    """[{name, step_time_s, ratio (to the current plan), fits, detail}] from :meth:`Session.compare`'s result."""
    cur = comparison["current"].cost.step_time_s
    out = []
    for name in ("current", "megatron", "data_parallel", "optimum"):
        p = comparison.get(name)
        if p is None:
            continue
        detail = p.method
        if name == "megatron" and comparison.get("megatron_config"):
            dp, tp, pp, mb, remat = comparison["megatron_config"]
            detail = f"dp={dp} tp={tp} pp={pp} microbatches={mb}" + (" remat" if remat else "")
        out.append({"name": name, "step_time_s": p.cost.step_time_s, "ratio": p.cost.step_time_s / cur if cur else 0.0,
                    "fits": p.cost.fits, "detail": detail})
    return out


class Controls(View):
    """Buttons, the progress bar, file and code boxes, what-if sliders and the comparison table."""

    css = "autopar-controls"

    def __init__(self, session):
        super().__init__(session)
        c = session.cluster
        B = w.Button
        self.solve_buttons = {k: B(description=f"{k} solve", tooltip=t) for k, t in (
            ("intra", "re-solve each stage's operator shardings (ILP), around the pins"),
            ("inter", "re-run the stage DP over the cached layer costs"),
            ("full", "trace, ILPs and stage DP from scratch"))}
        for k, b in self.solve_buttons.items():
            b.on_click(lambda _, k=k: self.start_solve(k))
        self.cancel_button = B(description="cancel", disabled=True, button_style="warning")
        self.cancel_button.on_click(lambda _: self.cancel())
        self.resolve_button = B(description="resolve around pins")
        self.resolve_button.on_click(lambda _: self.resolve())
        self.undo_button, self.redo_button = B(description="undo"), B(description="redo")
        self.undo_button.on_click(lambda _: self.undo())
        self.redo_button.on_click(lambda _: self.redo())
        self.progress = w.FloatProgress(value=0.0, min=0.0, max=1.0, description="idle")
        self.status = w.HTML("")
        self.path = w.Text(value="plan.json", description="file", layout=w.Layout(width="260px"))
        self.save_button, self.load_button = B(description="save"), B(description="load")
        self.save_button.on_click(lambda _: self.save())
        self.load_button.on_click(lambda _: self.load())
        self.export_button = B(description="export JAX code")
        self.export_button.on_click(lambda _: self.export())
        self.code = w.Textarea(value="", layout=w.Layout(width="100%", height="160px", display="none"))
        # What-if sliders: moving one re-plans with a full solve on the changed cluster (when "re-plan" is ticked).
        self.hosts = w.IntSlider(value=c.hosts, min=1, max=max(8, c.hosts), description="hosts",
                                 continuous_update=False)
        self.devices = w.SelectionSlider(options=[1, 2, 4, 8, 16], value=c.devices_per_host, description="dev/host",
                                         continuous_update=False)
        self.intra_bw = w.FloatLogSlider(value=c.intra_host.bandwidth / 1e9, base=10, min=-1, max=4,
                                         description="intra GB/s", continuous_update=False)
        self.inter_bw = w.FloatLogSlider(value=c.inter_host.bandwidth / 1e9, base=10, min=-2, max=3,
                                         description="inter GB/s", continuous_update=False)
        self.auto_replan = w.Checkbox(value=False, description="re-plan when a slider moves")
        self.whatif_button = B(description="re-plan on this cluster")
        self.whatif_button.on_click(lambda _: self.what_if())
        for s in (self.hosts, self.devices, self.intra_bw, self.inter_bw):
            s.observe(lambda ch: self.what_if() if self.auto_replan.value and not self._quiet else None, names="value")
        self.compare_button = B(description="compare baselines")
        self.compare_button.on_click(lambda _: self.compare())
        self.comparison = w.HTML("")
        self.adopt_pick = w.Dropdown(options=[], description="use plan", layout=w.Layout(width="220px"))
        self.adopt_button = B(description="make current")
        self.adopt_button.on_click(lambda _: self.adopt(self.adopt_pick.value))
        self._quiet = False
        self._thread: threading.Thread | None = None
        self._cancel: threading.Event | None = None
        self._ticks = 0
        self.last_error: str | None = None
        self._sync()
        self._finish(w.VBox([
            w.HBox([*self.solve_buttons.values(), self.cancel_button, self.resolve_button]),
            w.HBox([self.progress, self.status]),
            w.HBox([self.undo_button, self.redo_button, self.path, self.save_button, self.load_button,
                    self.export_button]),
            self.code,
            w.HTML("<b>what if</b> the cluster were different:"),
            w.HBox([self.hosts, self.devices]), w.HBox([self.intra_bw, self.inter_bw]),
            w.HBox([self.auto_replan, self.whatif_button]),
            w.HBox([self.compare_button, self.adopt_pick, self.adopt_button]), self.comparison, self.message]))

    # --- long jobs -----------------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _expected_reports(self, cluster) -> int:
        return 2 + sum(len(cluster.logical_mesh_shapes(s)) for s in cluster.submesh_shapes())

    def _on_progress(self, expected: int) -> Callable[[str, Any], None]:
        def report(message: str, fraction) -> None:
            self._ticks += 1
            self.progress.value = fraction if fraction is not None else min(self._ticks / expected, 0.99)
            self.progress.description = "solving"
            self.status.value = html.escape(message)
        return report

    def _start(self, name: str, job: Callable[[Callable, threading.Event], Any], expected: int,
               background: bool) -> threading.Thread | None:
        if self.busy:
            self.message.value = "a solve is running: cancel it or wait"
            return None
        self._cancel = threading.Event()
        self._ticks = 0
        self.progress.value = 0.0
        cancel, report = self._cancel, self._on_progress(expected)
        self._set_running(True)

        def work():
            try:
                job(report, cancel)
                self.progress.value, self.progress.description = 1.0, "done"
                self.message.value = ""
                self.last_error = None
            except SolveCancelled:
                self.progress.description = "cancelled"
                self.status.value = f"{name} cancelled; the plan is unchanged"
            except USER_ERRORS + (RuntimeError,) as e:  # an infeasible cluster, a solver failure: say so, keep the plan
                self.progress.description = "failed"
                self.last_error = str(e)
                self.message.value = f"<span style='color:#B00020'>{name}: {html.escape(str(e))}</span>"
                self.session.error(name, e)
            finally:
                self._set_running(False)

        if not background:
            work()
            return None
        self._thread = threading.Thread(target=work, name=f"autopar-{name}", daemon=True)
        self._thread.start()
        return self._thread

    def _set_running(self, running: bool) -> None:
        for b in (*self.solve_buttons.values(), self.resolve_button, self.whatif_button, self.compare_button,
                  self.load_button, self.undo_button, self.redo_button):
            b.disabled = running
        self.cancel_button.disabled = not running
        if not running:
            self._sync()

    def start_solve(self, kind: str, background: bool = True) -> threading.Thread | None:
        """Run the ``intra``, ``inter`` or ``full`` solve (on a worker thread unless ``background=False``)."""
        s = self.session
        return self._start(f"{kind} solve", lambda report, cancel: s.solve(kind, progress=report, cancel=cancel),
                           self._expected_reports(s.cluster), background)

    def what_if(self, background: bool = True) -> threading.Thread | None:
        """Re-plan on the cluster the sliders describe."""
        try:
            cluster = self.slider_cluster()
        except USER_ERRORS as e:
            self.run("what_if", lambda: (_ for _ in ()).throw(e))
            return None
        s = self.session
        return self._start("what-if re-plan",
                           lambda report, cancel: s.set_cluster(cluster, progress=report, cancel=cancel),
                           self._expected_reports(cluster), background)

    def slider_cluster(self):
        return self.session.cluster.with_(hosts=int(self.hosts.value), devices_per_host=int(self.devices.value),
                                          intra_host_bandwidth=float(self.intra_bw.value) * 1e9,
                                          inter_host_bandwidth=float(self.inter_bw.value) * 1e9)

    def compare(self, background: bool = True) -> threading.Thread | None:
        """Price the Megatron-style and data-parallel baselines (and the optimum for small instances)."""
        s = self.session
        return self._start("compare", lambda report, cancel: s.compare(progress=report, cancel=cancel),
                           self._expected_reports(s.cluster), background)

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the running job (if any) ends."""
        if self._thread is not None:
            self._thread.join(timeout)

    # --- quick actions -------------------------------------------------------------------------------------------------
    def resolve(self) -> None:
        self.run("resolve", self.session.resolve)

    def undo(self) -> None:
        self.run("undo", self.session.undo)

    def redo(self) -> None:
        self.run("redo", self.session.redo)

    def save(self, path: str | None = None) -> None:
        p = path or self.path.value
        if self.run("save", lambda: self.session.save(p)) is not None:
            self.status.value = f"saved to {html.escape(str(p))}"

    def load(self, path: str | None = None) -> None:
        p = path or self.path.value
        self.run("load", lambda: self.session.load(p))

    def export(self) -> str:
        code = self.run("export", self.session.export_code) or ""
        self.code.value = code
        self.code.layout.display = None if code else "none"
        return code

    def adopt(self, name: str | None) -> None:
        comp = self.session.comparison or {}
        if name not in comp or comp.get(name) is None or name == "current":
            self.message.value = "run compare first, then pick a baseline"
            return
        self.run("adopt", lambda: self.session.adopt(comp[name], action=f"adopt_{name}"))

    # --- drawing -------------------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        s = self.session
        self.undo_button.disabled = not s.can_undo
        self.redo_button.disabled = not s.can_redo
        self.resolve_button.disabled = not (s.plan.pins or s.plan.stage_pins)
        c = s.cluster
        self._quiet = True
        try:
            self.hosts.max = max(self.hosts.max, c.hosts)
            self.hosts.value = c.hosts
            if c.devices_per_host in self.devices.options:
                self.devices.value = c.devices_per_host
            self.intra_bw.value = c.intra_host.bandwidth / 1e9
            self.inter_bw.value = c.inter_host.bandwidth / 1e9
        finally:
            self._quiet = False

    def show_comparison(self, comparison: dict) -> None:
        rows = comparison_rows(comparison)
        body = "".join(f"<tr><td>{r['name']}</td><td>{fmt_s(r['step_time_s'])}</td><td>{r['ratio']:.3f}</td>"
                       f"<td>{'yes' if r['fits'] else 'no'}</td><td>{html.escape(r['detail'])}</td></tr>" for r in rows)
        self.comparison.value = ("<table><tr><th>plan</th><th>step time</th><th>/ current</th><th>fits</th>"
                                 f"<th>what</th></tr>{body}</table>")
        self.adopt_pick.options = [r["name"] for r in rows if r["name"] != "current"]

    def _on_event(self, event) -> None:
        if event.name == "plan":
            self._sync()
        elif event.name == "compare":
            self.show_comparison(event.detail["comparison"])
