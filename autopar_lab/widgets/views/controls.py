"""Controls: a compact toolbar of solves (intra-op, inter-op, full) with a progress bar and cancel, resolve around pins,
save/load, export JAX code, what-if cluster sliders that re-plan, and the comparison with the baselines; undo / redo
buttons the workbench puts in its header.

Solves run on a worker thread (the notebook stays responsive; cancel sets a threading.Event the session checks at
each progress report). ``start_solve(..., background=False)`` runs on the caller's thread, as tests do. What the
panels below the toolbar show always describes the current plan: the exported code is made again when the plan
changes, and the comparison's "current" row is the current plan (baselines priced for another cluster are dropped).
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any, Callable

import ipywidgets as w

from ._base import USER_ERRORS, View
from .fmt import fmt_ratio, fmt_s
from ..session import SolveCancelled


def hosts_max(hosts: int) -> int:
    """The hosts slider's upper end for a cluster of ``hosts`` hosts: twice as many (at least 8)."""
    return max(8, 2 * int(hosts))


#: The share of the progress bar the ILPs of a solve take when the stage DP follows them (it reports apart).
ILP_SHARE = 0.7


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


def device_counts(per_host: int) -> list[int]:
    """The devices-per-host choices of the what-if slider: powers of two up to the larger of 16 and ``per_host``."""
    top = max(16, int(per_host))
    return [1 << k for k in range(top.bit_length()) if 1 << k <= top]


class Controls(View):
    """Buttons, the progress bar, file and code boxes, what-if sliders and the comparison table."""

    css = "autopar-controls"

    def __init__(self, session):
        super().__init__(session)
        c = session.cluster

        def B(description, tooltip="", **kw):  # sized to its label: no truncated "re-plan on this cl..."
            return w.Button(description=description, tooltip=tooltip, layout=w.Layout(width="auto"), **kw)

        self.solve_buttons = {k: B(f"{k} solve", t) for k, t in (
            ("intra", "re-solve each stage's operator shardings (ILP), around the pins"),
            ("inter", "re-run the stage DP over the cached layer costs"),
            ("full", "trace, ILPs and stage DP from scratch"))}
        for k, b in self.solve_buttons.items():
            b.on_click(lambda _, k=k: self.start_solve(k))
        self.cancel_button = B("cancel", "stop the running solve at its next progress report", disabled=True)
        self.cancel_button.add_class("autopar-cancel")
        self.cancel_button.on_click(lambda _: self.cancel())
        self.resolve_button = B("resolve around pins", "re-solve every decision that is not pinned")
        self.resolve_button.on_click(lambda _: self.resolve())
        self.undo_button, self.redo_button = B("undo", "back to the plan before the last change"), B("redo")
        self.undo_button.on_click(lambda _: self.undo())
        self.redo_button.on_click(lambda _: self.redo())
        self.progress = w.FloatProgress(value=0.0, min=0.0, max=1.0, description="idle",
                                        layout=w.Layout(width="220px"))
        self.status = w.HTML("", layout=w.Layout(min_width="0"))
        self.path = w.Text(value="plan.json", placeholder="plan file", layout=w.Layout(width="140px"))
        self.save_button, self.load_button = B("save", "save the plan to the file"), B("load", "load a plan file")
        self.save_button.on_click(lambda _: self.save())
        self.load_button.on_click(lambda _: self.load())
        self.export_button = B("export JAX code", "the current plan as JAX sharding code")
        self.export_button.on_click(lambda _: self.export())
        self.code = w.Textarea(value="", layout=w.Layout(width="auto", height="160px", display="none"))  # stretches
        self.code.add_class("autopar-code")
        # Frameworks in and out: a configuration pasted (or the file in the path box) imported; the plan exported.
        self.config_toggle = w.ToggleButton(value=False, description="framework config…",
                                            tooltip="import a Megatron-LM, torchtitan or MaxText configuration, or "
                                                    "export the plan as one", layout=w.Layout(width="auto"))
        self.config_box = w.Textarea(value="", placeholder="paste a Megatron-LM argument list, a torchtitan TOML or a "
                                     "MaxText YAML (or leave this empty and give its path in the file box)",
                                     layout=w.Layout(width="auto", height="160px"))
        self.config_box.add_class("autopar-config")
        self.import_button = B("import configuration", "price the configuration in the box (or the file in the path "
                                                       "box) on this model and cluster")
        self.import_button.on_click(lambda _: self.import_config())
        self.framework = w.Dropdown(options=[("Megatron-LM", "megatron"), ("torchtitan", "torchtitan"),
                                             ("MaxText", "maxtext")], value="megatron", layout=w.Layout(width="130px"))
        self.export_as_button = B("export as", "write the current plan as the picked framework's configuration")
        self.export_as_button.on_click(lambda _: self.export_config())
        self.config_panel = w.VBox([
            w.HTML("<b>framework configuration</b>: what it costs, and the plan in terms your framework runs"),
            self.config_box, w.HBox([self.import_button, self.export_as_button, self.framework])],
            layout=w.Layout(display="none"))
        self.config_toggle.observe(lambda ch: self.show_config(ch["new"]), names="value")
        # What-if sliders: moving one re-plans with a full solve on the changed cluster (when "re-plan" is ticked).
        S = dict(continuous_update=False, style={"description_width": "initial"}, layout=w.Layout(width="300px"))
        # Up to twice the hosts: a user planning 512 GPUs tries 1,024 (the max grows as the cluster does).
        self.hosts = w.IntSlider(value=c.hosts, min=1, max=hosts_max(c.hosts), description="hosts", **S)
        # Powers of two up to the cluster's own (a TPU slice is one host of 64 ... 4,096 chips) and at least 16.
        self.devices = w.SelectionSlider(options=device_counts(c.devices_per_host), value=c.devices_per_host,
                                         description="devices per host", **S)
        self.intra_bw = w.FloatLogSlider(value=c.intra_host.bandwidth / 1e9, base=10, min=-1, max=4,
                                         description="within a host (GB/s)", **S)
        self.inter_bw = w.FloatLogSlider(value=c.inter_host.bandwidth / 1e9, base=10, min=-2, max=3,
                                         description="between hosts (GB/s)", **S)
        self.auto_replan = w.Checkbox(value=False, description="re-plan when a slider moves", indent=False,
                                      layout=w.Layout(width="auto"))
        self.whatif_button = B("re-plan on this cluster", "a full solve on the cluster the sliders describe")
        self.whatif_button.on_click(lambda _: self.what_if())
        for s in (self.hosts, self.devices, self.intra_bw, self.inter_bw):
            s.observe(lambda ch: self.what_if() if self.auto_replan.value and not self._quiet else None, names="value")
        self.whatif_toggle = w.ToggleButton(value=False, description="what if…", tooltip="show the cluster sliders",
                                            layout=w.Layout(width="auto"))
        self.whatif_panel = w.VBox([
            w.HTML("<b>what if</b> the cluster were different:"),
            w.HBox([self.hosts, self.devices, self.intra_bw, self.inter_bw], layout=w.Layout(flex_flow="row wrap")),
            w.HBox([self.auto_replan, self.whatif_button])], layout=w.Layout(display="none"))
        self.whatif_toggle.observe(lambda ch: self.show_what_if(ch["new"]), names="value")
        self.compare_button = B("compare baselines", "price Megatron-style and data-parallel plans beside this one")
        self.compare_button.on_click(lambda _: self.compare())
        self.comparison = w.HTML("")
        self.adopt_pick = w.Dropdown(options=[], description="use plan", layout=w.Layout(width="200px"))
        self.adopt_button = B("make current", "make the picked plan the current one (undoable)")
        self.adopt_button.on_click(lambda _: self.adopt(self.adopt_pick.value))
        self.compare_panel = w.VBox([self.comparison, w.HBox([self.adopt_pick, self.adopt_button])],
                                    layout=w.Layout(display="none"))
        self._quiet = False
        self._thread: threading.Thread | None = None
        self._cancel: threading.Event | None = None
        self._ticks = 0
        self.last_error: str | None = None
        self._exported = None  # the plan whose code the code box shows
        self._said_for = None  # the plan the status line speaks of ("saved to ...", "... done in ..."), or None
        self._set_running(False)
        sep = lambda: w.HTML("<span style='color:#bbb'>|</span>")  # noqa: E731
        self.toolbar = w.HBox([*self.solve_buttons.values(), self.cancel_button, self.resolve_button, sep(),
                               self.path, self.save_button, self.load_button, self.export_button, sep(),
                               self.compare_button, self.whatif_toggle, self.config_toggle, self.progress,
                               self.status],
                              layout=w.Layout(flex_flow="row wrap", align_items="center", width="100%"))
        self.toolbar.add_class("autopar-toolbar")
        self._finish(w.VBox([self.toolbar, self.whatif_panel, self.config_panel, self.compare_panel, self.code,
                             self.message],
                            layout=w.Layout(width="100%", min_width="0")))

    def show_what_if(self, on: bool = True) -> None:
        """Show (or hide) the what-if sliders below the toolbar."""
        self.whatif_panel.layout.display = None if on else "none"
        if self.whatif_toggle.value != on:
            self.whatif_toggle.value = on

    # --- long jobs ----------------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _expected_reports(self, cluster) -> int:
        return 2 + sum(len(cluster.logical_mesh_shapes(s)) for s in cluster.submesh_shapes())

    def _on_progress(self, expected: int) -> Callable[[str, Any], None]:
        seen_ilp = [False]

        def report(message: str, fraction) -> None:
            # One bar for the two phases that report a fraction each: the ILPs (when any run), then the stage DP.
            self._ticks += 1
            if fraction is None:
                value = min(self._ticks / expected, 0.99)
            elif message.startswith("intra-op"):
                seen_ilp[0] = True
                value = ILP_SHARE * fraction
            elif message.startswith("stage DP"):
                value = ILP_SHARE + (1 - ILP_SHARE) * fraction if seen_ilp[0] else fraction
            else:
                value = fraction
            self.progress.value = max(self.progress.value, value) if value < 1 else value
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
            t0 = time.perf_counter()
            try:
                job(report, cancel)
                self.progress.value, self.progress.description = 1.0, "done"
                # Not the last progress report ("intra-op 1x1 as 1x1"): what finished, and how long it took.
                # a comparison is kept (its table) when the plan changes; a solve's line is about the plan it made
                self._say(f"{name} done in {fmt_s(time.perf_counter() - t0)}", of_plan=name != "compare")
                self.message.value = ""
                self.last_error = None
            except SolveCancelled:
                self.progress.description = "cancelled"
                self._say(f"{name} cancelled; the plan is unchanged")
            except USER_ERRORS + (RuntimeError,) as e:  # an infeasible cluster, a solver failure: say so, keep the plan
                self.progress.description = "failed"
                self.last_error = str(e)
                self.status.value = ""  # the message below says what failed
                self.message.value = f"<span style='color:#B00020'>{name}: {html.escape(str(e))}</span>"
                self.session.error(name, e, source=self.css)
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
        # Coloured only while it can act: a greyed-out orange button still reads as "press me".
        self.cancel_button.button_style = "warning" if running else ""
        if not running:
            self._sync()

    def start_solve(self, kind: str, background: bool = True) -> threading.Thread | None:
        """Run the ``intra``, ``inter`` or ``full`` solve (on a worker thread unless ``background=False``)."""
        s = self.session
        return self._start(f"{kind} solve", lambda report, cancel: s.solve(kind, on_progress=report, cancel=cancel),
                           self._expected_reports(s.cluster), background)

    def what_if(self, background: bool = True) -> threading.Thread | None:
        """Re-plan on the cluster the sliders describe."""
        try:
            cluster = self.slider_cluster()
        except USER_ERRORS as e:
            self.run("what_if", lambda err=e: (_ for _ in ()).throw(err))
            return None
        s = self.session
        return self._start("what-if re-plan",
                           lambda report, cancel: s.set_cluster(cluster, on_progress=report, cancel=cancel),
                           self._expected_reports(cluster), background)

    def slider_cluster(self):
        return self.session.cluster.with_(hosts=int(self.hosts.value), devices_per_host=int(self.devices.value),
                                          intra_host_bandwidth=float(self.intra_bw.value) * 1e9,
                                          inter_host_bandwidth=float(self.inter_bw.value) * 1e9)

    def compare(self, background: bool = True) -> threading.Thread | None:
        """Price the Megatron-style and data-parallel baselines (and the optimum for small instances)."""
        s = self.session
        return self._start("compare", lambda report, cancel: s.compare(on_progress=report, cancel=cancel),
                           self._expected_reports(s.cluster), background)

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the running job (if any) ends."""
        if self._thread is not None:
            self._thread.join(timeout)

    def resolve(self, background: bool = True) -> threading.Thread | None:
        """Re-solve around the pins (:meth:`Session.resolve`) as a job: progress, cancel, a done line."""
        from ...planner import microbatch_choices

        s = self.session
        batch = s.plan.table.batch_size if s.plan.table is not None else 1
        expected = 2 + len(microbatch_choices(batch, "auto")) + len(s.plan.stages)
        return self._start("resolve around pins",
                           lambda report, cancel: s.resolve(on_progress=report, cancel=cancel), expected, background)

    def _say(self, text: str, of_plan: bool = True) -> None:
        """Set the status line; ``of_plan``: it speaks of the current plan and goes when another becomes current."""
        self.status.value = html.escape(text)
        self._said_for = self.session.plan if of_plan else None

    # --- quick actions ------------------------------------------------------------------------------------------------

    def undo(self) -> None:
        self.run("undo", self.session.undo)

    def redo(self) -> None:
        self.run("redo", self.session.redo)

    def save(self, path: str | None = None) -> None:
        p = path or self.path.value
        if self.run("save", lambda: self.session.save(p)) is not None:
            self._say(f"saved to {p}")
        else:
            self.status.value = ""  # the message below says why it was not saved

    def load(self, path: str | None = None) -> None:
        p = path or self.path.value
        if self.run("load", lambda: self.session.load(p)) is not None:
            self._say(f"loaded {p}")
        else:
            self.status.value = ""  # the message below says why it was not loaded

    def export(self) -> str:
        """The current plan as JAX code, shown below the toolbar (and made again whenever the plan changes)."""
        code = self.run("export", self.session.export_code) or ""
        self.code.value = code
        self.code.layout.display = None if code else "none"
        self._exported = self.session.plan if code else None
        return code

    def show_config(self, on: bool = True) -> None:
        """Show (or hide) the framework-configuration box below the toolbar."""
        self.config_panel.layout.display = None if on else "none"

    def import_config(self, text: str | None = None) -> None:
        """Price the configuration ``text`` (default: the box's, or the file in the path box when the box is empty)
        and make it the current plan."""
        source = text if text is not None else (self.config_box.value.strip() or self.path.value)
        if self.run("import configuration", lambda: self.session.import_config(source)) is not None:
            self._say(f"imported: {self.session.plan.method}")

    def export_config(self, framework: str | None = None) -> str:
        """The current plan as ``framework``'s configuration (default: the dropdown's), shown in the box."""
        fw = framework or self.framework.value
        text = self.run(f"export as {fw}", lambda: self.session.export_config(fw)) or ""
        if text:
            self.config_box.value = text
            self.show_config(True)
            self.config_toggle.value = True
            self._say(f"exported as {fw}")
        return text

    def adopt(self, name: str | None) -> None:
        comp = self.session.comparison or {}
        if not comp:
            self.message.value = "press compare baselines first, then pick a plan to use"
            return
        if name is None or comp.get(name) is None or name == "current":
            self.message.value = f"pick a plan to use ({', '.join(self.adopt_pick.options)}) in the dropdown"
            return
        self.run("adopt", lambda: self.session.adopt(comp[name], action=f"adopt_{name}"))

    # --- drawing ------------------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        s = self.session
        self.undo_button.disabled = not s.can_undo
        self.redo_button.disabled = not s.can_redo
        self.resolve_button.disabled = not (s.plan.pins or s.plan.stage_pins)
        c = s.cluster
        self._quiet = True
        try:
            self.hosts.max = max(self.hosts.max, hosts_max(c.hosts))
            self.hosts.value = c.hosts
            if c.devices_per_host not in self.devices.options:
                self.devices.options = device_counts(c.devices_per_host)
            self.devices.value = c.devices_per_host
            self.intra_bw.value = c.intra_host.bandwidth / 1e9
            self.inter_bw.value = c.inter_host.bandwidth / 1e9
        finally:
            self._quiet = False

    def show_comparison(self, comparison: dict | None) -> None:
        """The comparison table against the *current* plan (a baseline adopted since is the current row now; one
        priced on another cluster than the current plan's is left out); nothing when there is none."""
        plan = self.session.plan
        if comparison:
            comparison = {**comparison, "current": plan}
            for name in ("megatron", "data_parallel", "optimum"):
                p = comparison.get(name)
                if p is not None and p.cluster != plan.cluster:
                    comparison[name] = None
        rows = comparison_rows(comparison) if comparison else []
        others = [r for r in rows if r["name"] != "current"]
        if not others:
            self.comparison.value = ""
            self.adopt_pick.options = []
            self.compare_panel.layout.display = "none"
            return
        adopted = {n for n in ("megatron", "data_parallel", "optimum") if comparison.get(n) is plan}
        body = "".join(
            f"<tr><td>{r['name']}{' (current)' if r['name'] in adopted else ''}</td><td>{fmt_s(r['step_time_s'])}</td>"
            f"<td>{fmt_ratio(r['ratio'])}</td><td>{'yes' if r['fits'] else 'no'}</td>"
            f"<td>{html.escape(r['detail'])}</td></tr>" for r in rows)
        self.comparison.value = ("<table class='autopar-cost-table autopar-comparison'><tr><th>plan</th>"
                                 "<th>step time</th><th>÷ current</th><th>fits</th><th>what</th></tr>"
                                 f"{body}</table>")
        names = [r["name"] for r in others]
        keep = self.adopt_pick.value if self.adopt_pick.value in names else names[0]
        self.adopt_pick.options = names
        self.adopt_pick.value = keep  # never blank: "make current" acts on what the dropdown shows
        self.compare_panel.layout.display = None

    def _on_event(self, event) -> None:
        if event.name == "plan":
            self.message.value = ""  # an error about the plan before no longer applies to this one
            if not self.busy and self._said_for is not None and self._said_for is not self.session.plan:
                self.status.value = ""  # "saved to ..." spoke of the plan before
                self._said_for = None
            self._sync()
            if self.session.comparison:
                self.show_comparison(self.session.comparison)
            if self._exported is not None and self._exported is not self.session.plan:
                self.export()  # the code box shows the current plan's code, never an older one's
        elif event.name == "compare":
            self.show_comparison(event.detail["comparison"])
