"""Training panel: run the current plan on the local devices or launch it on Ray, with live progress.

A steps box, "run locally" / "launch on Ray" buttons (a Ray address box: empty means an embedded local Ray; "stages
on": what Ray's stage actors run on, the plan's devices or this machine's CPU devices), a
progress bar, a live loss curve with the earlier runs' curves beside it, throughput text, a cancel button, a table of
every run with its measured step time and throughput against the plan's predicted ones, and a table of each stage's
predicted and measured forward / backward time per microbatch with their ratio. The runs themselves live in the
session's :class:`~autopar_lab.widgets.training.TrainingController` (``session.training``).

Everything arrives as session ``training`` events (one :class:`~autopar_lab.runtime.progress.ProgressEvent` per
step), called from the job's thread; the panel only sets widget values there. A ``restart`` event (a stage actor
died, the job went back to its last checkpoint) cuts the loss curve back to that step. Local runs run on a worker
thread (as the controls' solves do), so the notebook stays responsive; ``background=False`` runs on the caller's
thread, as tests do.

    >>> rows = stage_rows(session.plan, session.measured)       # doctest: +SKIP
    >>> rows[0]["fwd_ratio"]                                      # measured / predicted  # doctest: +SKIP
    4.9
"""

from __future__ import annotations

import dataclasses

import html
import threading
import time

import ipywidgets as w

from ._base import USER_ERRORS, SharedFigure, View
from .fmt import fmt_rate, fmt_ratio, fmt_s
from .mismatch import mismatch_note
from ...runtime.train_entry import RunOptions

_END = ("done", "cancelled", "error")
#: Steps are drawn at most this often; the latest one always shows within this time. Why: a run of fast steps sent
#: the browser a whole loss curve, the runs table and the bar at every step (20 a second for gpt-tiny on Ray), and the
#: page stopped answering clicks; the cancel button could not be pressed (a browser test's CI failure, 2026-12-07).
DRAW_EVERY_S = 0.25
AS_PLANNED = "plan"  # "stages on": the devices the plan's cluster has (launch's default device_kind)


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    return measured / predicted if measured is not None and predicted else None


def stage_rows(plan, measured: list[dict] | None) -> list[dict]:
    """Per stage of ``plan``: predicted and measured forward / backward seconds per microbatch, and measured over
    predicted (``fwd_ratio``, ``bwd_ratio``; None where nothing was measured). ``measured``: rows as
    :meth:`Runner.stage_times` or :meth:`Job.stage_times` give them (matched by ``stage``), or None."""
    by_stage = {int(r["stage"]): r for r in measured or ()}
    out = []
    for k, st in enumerate(plan.stages):
        m = by_stage.get(k, {})
        mf, mb = m.get("measured_fwd_s"), m.get("measured_bwd_s")
        out.append({"stage": k, "predicted_fwd_s": st.fwd_s, "predicted_bwd_s": st.bwd_s,
                    "measured_fwd_s": mf, "measured_bwd_s": mb,
                    "fwd_ratio": _ratio(mf, st.fwd_s), "bwd_ratio": _ratio(mb, st.bwd_s)})
    return out


def _t(x):
    return "—" if x is None else fmt_s(x)


def hardware_note(runs, platform: str) -> str:
    """A line saying which local runs measured other hardware than their plan was priced for: a plan for V100s run
    on this machine's CPU devices is 50-100x "slower than predicted" for that reason alone. ``platform``: the JAX
    platform the runs used ("cpu", "gpu", ...); "" when every run's plan was priced for it.

    >>> class P: cluster = type("C", (), {"device": type("D", (), {"name": "V100-SXM2-16GB"})()})()
    >>> class R: plan, run, kind = P(), 1, "local"
    >>> hardware_note([R()], "cpu")[:60]
    'run 1: its plan is priced for V100-SXM2-16GB devices and it '
    """
    other = [r for r in runs if _other_hardware(r, platform)]
    if not other:
        return ""
    names = sorted({str(r.plan.cluster.device.name) for r in other})
    which = ", ".join(str(r.run) for r in other)
    return (f"run{'s' if len(other) > 1 else ''} {which}: {'their plans are' if len(other) > 1 else 'its plan is'} "
            f"priced for {' / '.join(names)} devices and it ran on this machine's {platform} devices, so measured ÷ "
            f"predicted compares different hardware; plan on the cluster the run uses (the 'cpu' preset here) to "
            f"compare like with like")


def _other_hardware(run, platform: str) -> bool:
    # Local runs only: a Ray job may run on a cluster of the plan's own devices.
    return run.kind == "local" and not str(run.plan.cluster.device.name).lower().startswith(platform.lower())


def runs_table_html(runs, platform: str | None = None) -> str:
    """Every run (:class:`~autopar_lab.widgets.training.RunRecord`), newest first: where it ran, its losses, and its
    measured step time and throughput beside the plan's predicted ones (class ``autopar-runs``); with ``platform``
    (the JAX platform the runs used), a note under it when a plan was priced for other hardware; and for the newest
    runs measured far from their prediction on the hardware priced, what differed (:func:`.mismatch.mismatch_note`).
    """
    if not runs:
        return ""
    head = ("<tr><th>run</th><th>where</th><th>steps</th><th>loss first → last</th><th>step time measured</th>"
            "<th>predicted</th><th>measured ÷ predicted</th><th>samples/s measured</th><th>predicted</th>"
            "<th>status</th></tr>")
    body = []
    for r in reversed(runs):
        losses = [x for x in r.losses if x is not None]
        loss = f"{losses[0]:.4g} → {losses[-1]:.4g}" if losses else "—"
        m = r.measured_step_s
        body.append(f"<tr><td>{r.run}</td><td>{r.kind}</td><td>{len(r.losses)}/{r.steps}</td><td>{loss}</td>"
                    f"<td>{_t(m)}</td><td>{fmt_s(r.predicted_step_s)}</td>"
                    f"<td>{fmt_ratio(m / r.predicted_step_s if m and r.predicted_step_s else None)}</td>"
                    f"<td>{fmt_rate(r.measured_samples_per_s, 'samples').removesuffix(' samples/s')}</td>"
                    f"<td>{fmt_rate(r.predicted_samples_per_s, 'samples').removesuffix(' samples/s')}</td>"
                    f"<td>{html.escape(r.status)}</td></tr>")
    note = hardware_note(runs, platform) if platform else ""
    far = [t for t in (mismatch_note(r) for r in reversed(runs) if not (platform and _other_hardware(r, platform)))
           if t][:3]
    return (f"<table class='autopar-cost-table autopar-runs'>{head}{''.join(body)}</table>"
            "<small>measured: the median step after the first (which compiles)"
            + (f"<br>{html.escape(note)}" if note else "")
            + "".join(f"<br><span class='autopar-mismatch'>{html.escape(t)}</span>" for t in far) + "</small>")


def local_platform() -> str:
    """The JAX platform runs from this kernel use ("cpu", "gpu", "tpu"): local runs and the embedded Ray's workers
    both run on this machine."""
    import jax

    return jax.default_backend()


def stage_table_html(rows: list[dict]) -> str:
    """The rows of :func:`stage_rows` as an HTML table (class ``autopar-stage-times``)."""
    t, r = _t, fmt_ratio

    head = ("<tr><th>stage</th><th>forward predicted</th><th>measured</th><th>ratio</th>"
            "<th>backward predicted</th><th>measured</th><th>ratio</th></tr>")
    body = "".join(
        f"<tr><td>{x['stage']}</td><td>{t(x['predicted_fwd_s'])}</td><td>{t(x['measured_fwd_s'])}</td>"
        f"<td>{r(x['fwd_ratio'])}</td><td>{t(x['predicted_bwd_s'])}</td><td>{t(x['measured_bwd_s'])}</td>"
        f"<td>{r(x['bwd_ratio'])}</td></tr>" for x in rows)
    return f"<table class='autopar-cost-table autopar-stage-times'>{head}{body}</table>"


def progress_text(ev, total: int | None) -> str:
    """One line for a step event: step, loss, throughput, step time, each stage's busy time, elapsed time."""
    parts = [f"step {ev.step}" + (f"/{total}" if total else "")]
    if ev.loss is not None:
        parts.append(f"loss {ev.loss:.4f}")
    if ev.samples_per_s is not None:
        parts.append(fmt_rate(ev.samples_per_s))
    if ev.step_time_s is not None:
        parts.append(f"{fmt_s(ev.step_time_s)}/step")
    if ev.stage_times:
        parts.append("stage busy " + ", ".join(f"{k}: {fmt_s(t)}" for k, t in enumerate(ev.stage_times)))
    parts.append(f"elapsed {fmt_s(ev.elapsed_s)}")
    return " · ".join(parts)


def loss_figure():
    """An empty loss-against-step figure with one line trace named ``loss`` (the current run; the panel appends to
    it, and adds one fainter trace per earlier run after it).

        >>> loss_figure().data[0].name
        'loss'
    """
    import plotly.graph_objects as go

    # One null point, drawn as nothing: a trace with no points at all gets no trace element in the browser, and
    # tests (and screenshots) wait for every figure to have one.
    fig = go.Figure(go.Scatter(x=[None], y=[None], mode="lines+markers", name="loss", line=dict(width=2.5)))
    fig.update_layout(height=280, margin=dict(l=50, r=20, t=30, b=40), title="training loss",
                      xaxis_title="step", yaxis_title="loss", showlegend=True,
                      legend=dict(orientation="h", y=-0.3, font=dict(size=10)))
    return fig


def _past_traces(runs, current: int | None) -> list:
    """One faint line per earlier run with losses (the overlay), oldest first."""
    import plotly.graph_objects as go

    out = []
    for r in runs:
        if r.run == current:
            continue
        pts = [(i + 1, x) for i, x in enumerate(r.losses) if x is not None]
        if not pts:
            continue
        out.append(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines", name=r.label,
                              opacity=0.45, line=dict(width=1.5, dash="dot")))
    return out


class TrainingPanel(View):
    """Run or launch training of the session's current plan and watch it (see the module docstring).

    ``compiler_options``: XLA options for local runs and for Ray runs whose ``options`` name none
    (``{"xla_backend_optimization_level": 0}`` compiles faster on CPU). ``launch_kw``: extra arguments for
    :func:`autopar_lab.launch` (``options``: a RunOptions, ``num_cpus``, ...).
    """

    css = "autopar-training"

    def __init__(self, session, *, compiler_options: dict | None = None, **launch_kw):
        super().__init__(session)
        self.compiler_options = compiler_options
        self.launch_kw = dict(launch_kw)
        def B(**kw):  # sized to its label
            return w.Button(layout=w.Layout(width="auto"), **kw)

        self.steps = w.BoundedIntText(value=20, min=1, max=1_000_000, description="steps",
                                      layout=w.Layout(width="160px"))
        self.run_button = B(description="run locally", tooltip="train on this machine's JAX devices")
        self.run_button.on_click(lambda _: self.run_local())
        self.address = w.Text(value="", placeholder="empty: embedded local Ray", description="Ray address",
                              layout=w.Layout(width="320px"))
        self.launch_button = B(description="launch on Ray", tooltip="train on a Ray cluster (stage actors)")
        self.launch_button.on_click(lambda _: self.launch())
        # What Ray's stage actors run on (launch's device_kind): a plan for GPUs can be trained on CPU devices.
        # ("as planned" is not None: a Dropdown shows a None value as no choice at all)
        self.stages_on = w.Dropdown(options=[("as planned", AS_PLANNED), ("CPU devices", "cpu"), ("GPUs", "gpu")],
                                    value=AS_PLANNED, description="stages on", layout=w.Layout(width="190px"),
                                    style={"description_width": "initial"},
                                    tooltip="what each stage's Ray actor runs on: the plan's devices, this "
                                            "machine's CPU devices, or GPUs")
        self.cancel_button = B(description="cancel", disabled=True)
        self.cancel_button.add_class("autopar-cancel")
        self.cancel_button.on_click(lambda _: self.cancel())
        self.progress = w.IntProgress(value=0, min=0, max=1, description="idle")
        self.throughput = w.HTML("")
        self.loss_fig = SharedFigure(loss_figure())
        self.runs_table = w.HTML("")
        self.stage_table = w.HTML("")
        self.job = None  # the Ray job this panel launched last
        self.last_result: dict | None = None
        self.last_error: str | None = None
        self._thread: threading.Thread | None = None
        self._cancel: threading.Event | None = None
        self._running = False
        self._run: int | None = None  # the session run number the curve shows
        self._xs: list[int] = []
        self._ys: list[float] = []
        self._total: int | None = None
        self._draw_lock = threading.Lock()  # the job's thread and the trailing-draw timer both draw
        self._shown_at = 0.0  # time.monotonic() of the last step drawn
        self._pending = None  # the latest step event not drawn yet
        self._timer: threading.Timer | None = None
        self.can_train = hasattr(session.model, "init") and hasattr(session.model, "step_fn")
        self.note = w.HTML("" if self.can_train else
                           "<small>training needs the model: open the workbench on a zoo ModelSpec "
                           "(al.models.get(...)), not an operator graph</small>")
        self._set_running(False)
        self.refresh_table()
        self._finish(w.VBox([
            w.HBox([self.steps, self.run_button, self.address, self.stages_on, self.launch_button,
                    self.cancel_button], layout=w.Layout(flex_flow="row wrap")),
            self.note, w.HBox([self.progress, self.throughput], layout=w.Layout(flex_flow="row wrap")),
            self.loss_fig, self.runs_table, self.stage_table, self.message], layout=w.Layout(min_width="0")))

    # --- state --------------------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._running

    @property
    def losses(self) -> list[float]:
        """The loss curve's values as drawn (after any restart cut)."""
        return list(self._ys)

    def _set_running(self, running: bool) -> None:
        self._running = running
        self.run_button.disabled = running or not self.can_train
        self.launch_button.disabled = running or not self.can_train
        self.steps.disabled = running
        self.cancel_button.disabled = not running
        self.cancel_button.button_style = "warning" if running else ""  # coloured only while it can act

    def reset(self, total: int | None = None) -> None:
        """Clear the curve and the bar for a new run of ``total`` steps (unknown: the bar grows with the steps)."""
        with self._draw_lock:
            self._drop_pending()
            self._shown_at = 0.0  # a new run's first step shows at once
        self._xs, self._ys = [], []
        self._total = total
        self.progress.max = max(int(total or 1), 1)
        self.progress.value = 0
        self.throughput.value = ""
        self._draw_curve()

    def _draw_curve(self) -> None:
        xs, ys = (tuple(self._xs), tuple(self._ys)) if self._xs else ((None,), (None,))  # see loss_figure
        with self.loss_fig.batch_update():
            self.loss_fig.data[0].x = xs
            self.loss_fig.data[0].y = ys
            self.loss_fig.data[0].name = f"run {self._run}" if self._run is not None else "loss"

    def draw_runs(self) -> None:
        """The earlier runs' curves beside the current one, and the runs table."""
        runs = list(self.session.training.runs)
        past = _past_traces(runs, self._run)
        names = [t.name for t in past]
        if [t.name for t in self.loss_fig.data[1:]] != names or any(
                len(a.y or ()) != len(b.y or ()) for a, b in zip(self.loss_fig.data[1:], past)):
            with self.loss_fig.batch_update():
                self.loss_fig.data = self.loss_fig.data[:1]
                self.loss_fig.add_traces(past)
        self.runs_table.value = runs_table_html(runs, local_platform())

    # --- starting and stopping ----------------------------------------------------------------------------------------
    def _steps(self, steps) -> int:
        return int(self.steps.value if steps is None else steps)

    def run_local(self, steps: int | None = None, background: bool = True) -> threading.Thread | None:
        """Train the current plan locally for ``steps`` (default: the steps box) on a worker thread."""
        if self._running:
            self.message.value = "a run is in progress: cancel it or wait"
            return None
        n = self._steps(steps)
        self._cancel = threading.Event()
        cancel = self._cancel
        self.job = None
        self.reset(n)
        self.progress.description = "compiling"
        self._set_running(True)

        def work():
            try:
                self.last_result = self.session.run_local(n, cancel=cancel, compiler_options=self.compiler_options)
                self.last_error = None
                self.message.value = ""
            except Exception as e:  # noqa: BLE001 - shown in the panel; a training failure must not kill the kernel
                self._fail("run locally", e)
            finally:
                self._set_running(False)

        if not background:
            work()
            return None
        self._thread = threading.Thread(target=work, name="autopar-train-local", daemon=True)
        self._thread.start()
        return self._thread

    def launch(self, steps: int | None = None, address: str | None = None, background: bool = True, **launch_kw):
        """Launch training of the current plan on Ray (``address``: default the address box; empty = embedded local
        Ray). Starting Ray can take a while, so the call runs on a worker thread unless ``background=False``; the
        job is then in ``job``. Returns the thread (background) or the job."""
        if self._running:
            self.message.value = "a run is in progress: cancel it or wait"
            return None
        n = self._steps(steps)
        addr = (self.address.value if address is None else address).strip() or None
        kw = {**self.launch_kw, **launch_kw, "ray_address": addr}
        base = kw.get("options") or RunOptions()
        if self.stages_on.value != AS_PLANNED:  # the run's options (launch's RunOptions) say where stages run
            base = dataclasses.replace(base, device_kind=base.device_kind or self.stages_on.value)
        if self.compiler_options and base.compiler_options is None:  # the panel's XLA options hold for Ray runs too
            base = dataclasses.replace(base, compiler_options=dict(self.compiler_options))
        kw["options"] = base
        self._cancel = threading.Event()
        cancel = self._cancel
        self.job = None
        self.reset(n)
        self.progress.description = "starting"
        self._set_running(True)

        def work():
            try:
                job = self.session.launch(n, **kw)
            except Exception as e:  # noqa: BLE001 - bad address, too few devices, Ray failing to start: say so
                self._fail("launch on Ray", e)
                self._set_running(False)
                return None
            self.job = job
            self.last_error = None
            if cancel.is_set():  # cancelled while Ray was starting
                job.cancel()
            if job.status() != "running" and self._running:  # it ended before we saw its last event
                self._set_running(False)
            return job

        if not background:
            return work()
        self._thread = threading.Thread(target=work, name="autopar-train-launch", daemon=True)
        self._thread.start()
        return self._thread

    def cancel(self) -> None:
        """Stop the run at the end of the current step (a Ray job: ``job.cancel()``)."""
        if self._cancel is not None:
            self._cancel.set()
        if self.job is not None:
            self.job.cancel()
        if self._running:
            self.progress.description = "cancelling"

    def wait(self, timeout: float | None = None) -> None:
        """Block until the worker thread (a local run, or a launch call) ends."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _fail(self, action: str, e: BaseException) -> None:
        self.last_error = f"{type(e).__name__}: {e}"
        self.progress.description = "failed"
        # The API's advice in the panel's terms: the control that sets it.
        text = str(e).replace("(device_kind='cpu')", "(stages on: CPU devices, beside 'launch on Ray')")
        self.message.value = f"<span style='color:#B00020'>{action}: {html.escape(text)}</span>"
        if isinstance(e, USER_ERRORS + (RuntimeError,)):
            self.session.error(action, e)

    # --- drawing ------------------------------------------------------------------------------------------------------
    def show_event(self, ev, run: int | None = None) -> None:
        """Draw one ProgressEvent (called in the job's thread: only widget values are set)."""
        if run is not None and self._run is not None and run < self._run:
            return  # the last words of an older run (a cancelled job finishing its step)
        if run is not None and run != self._run:
            self._run = run
            if self._xs:  # a run started elsewhere (code in the notebook): a fresh curve, length unknown
                self.reset(None)
            self.draw_runs()  # the run before this one joins the overlay
        if ev.kind == "step":
            if ev.loss is not None:
                self._xs.append(ev.step)
                self._ys.append(float(ev.loss))
            self._draw_step(ev)
        elif ev.kind == "restart":
            self.flush()
            keep = sum(1 for x in self._xs if x <= ev.step)
            del self._xs[keep:], self._ys[keep:]
            self._draw_curve()
            self.progress.value = min(ev.step, self.progress.max)
            self.progress.description = "restarted"
            self.throughput.value = html.escape(f"restarted from step {ev.step}" +
                                                (f": {ev.message}" if ev.message else ""))
        elif ev.kind in _END:
            self.flush()
            self.progress.description = ev.kind
            if ev.kind == "error":
                self.last_error = ev.message
                self.message.value = f"<span style='color:#B00020'>training failed: {html.escape(ev.message)}</span>"
            elif ev.message:
                self.throughput.value = html.escape(ev.message)
            if self._thread is None or not self._thread.is_alive() or self.job is not None:
                self._set_running(False)
            self.draw_runs()

    def _draw_step(self, ev) -> None:
        """Draw step ``ev`` now if the last draw is :data:`DRAW_EVERY_S` old, else within that time (the latest
        step wins; the curve keeps every step's loss)."""
        with self._draw_lock:
            self._pending = ev
            wait = self._shown_at + DRAW_EVERY_S - time.monotonic()
            if wait <= 0 or (self._total is not None and ev.step >= self._total):
                self._show_pending()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Draw the latest step now if one is waiting (the end of a run, a restart, the trailing timer)."""
        with self._draw_lock:
            self._show_pending()

    def _drop_pending(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._pending = None

    def _show_pending(self) -> None:
        ev = self._pending
        self._drop_pending()
        if ev is None:
            return
        self._shown_at = time.monotonic()
        if ev.step > self.progress.max:
            self.progress.max = ev.step
        self.progress.value = ev.step
        self.progress.description = "training"
        self._draw_curve()
        self.throughput.value = html.escape(progress_text(ev, self._total))
        self.runs_table.value = runs_table_html(self.session.training.runs, local_platform())

    def refresh_table(self) -> None:
        rows = stage_rows(self.session.plan, self.session.measured)
        self.rows = rows
        self.stage_table.value = stage_table_html(rows)

    def _on_event(self, event) -> None:
        if event.name == "training":
            self.show_event(event.detail["event"], event.detail.get("run"))
        elif event.name in ("plan", "measured"):
            if event.name == "plan" and not self._running:
                self.message.value = ""  # an error about the plan before no longer applies to this one
            self.refresh_table()

    def close(self) -> None:
        with self._draw_lock:
            self._drop_pending()
        self.cancel()
        super().close()
