"""Training the session's current plan: local runs and Ray launches, what they measured, and the runs so far.

The :class:`~autopar_lab.widgets.session.Session` holds plans and their history; this controller (``session.training``)
trains them. Its events go out through the session (``training``: one
:class:`~autopar_lab.runtime.progress.ProgressEvent` per step, ``measured``: the measured stage times), so every view
subscribes in one place. Every run is kept as a :class:`RunRecord` (losses, step times, the plan it trained, the
predicted step time), so the training panel can overlay past runs and set measured against predicted figures.
No widget library is imported here.

    >>> s = al.Session(plan, model=model)                 # doctest: +SKIP
    >>> s.training.run_local(3)["losses"]                 # doctest: +SKIP
    [4.2..., 3.9..., 3.7...]
    >>> s.training.runs[-1].measured_step_s               # doctest: +SKIP
    0.0123
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["TrainingController", "RunRecord"]

_END = ("done", "cancelled", "error")


@dataclass
class RunRecord:
    """One training run: what was asked (``kind`` "local" or "ray", ``steps``, the ``plan``), what came back (losses
    and step times per step, ``status``), and what the plan predicted."""

    run: int
    kind: str
    plan: Any = field(repr=False)
    steps: int
    batch_size: int | None = None
    losses: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    status: str = "running"
    message: str = ""
    #: This machine's 1-minute load average at each step (what the run shared the cores with; see os.getloadavg).
    loads: list = field(default_factory=list)
    #: A Ray job on a cluster elsewhere (``ray_address`` given): this machine's load and profile say nothing of it.
    remote: bool = False

    @property
    def predicted_step_s(self) -> float:
        return self.plan.cost.step_time_s

    @property
    def predicted_samples_per_s(self) -> float:
        return self.plan.cost.samples_per_s

    @property
    def measured_step_s(self) -> float | None:
        """The median step time, leaving out the first step (it compiles) when there are more."""
        times = [t for t in (self.step_times[1:] if len(self.step_times) > 1 else self.step_times) if t is not None]
        return statistics.median(times) if times else None

    @property
    def measured_samples_per_s(self) -> float | None:
        m = self.measured_step_s
        return self.batch_size / m if m and self.batch_size else None

    @property
    def label(self) -> str:
        """``"run 2 (local, 20 steps)"``: how a legend names the run."""
        return f"run {self.run} ({self.kind}, {len(self.losses)} step{'s' if len(self.losses) != 1 else ''})"


class TrainingController:
    """Runs and launches of ``session``'s current plan (see the module docstring)."""

    def __init__(self, session):
        self.session = session
        self.runs: list[RunRecord] = []
        self.job = None  # the latest Ray job from launch()
        self.runner = None  # the latest local Runner from run_local()
        self._measured: tuple | None = None  # (plan, rows)
        self._lock = threading.Lock()

    # --- measured times ---------------------------------------------------------------------------------------------
    @property
    def measured(self) -> list[dict] | None:
        """The latest measured per-stage times of the current plan: ``[{stage, predicted_fwd_s, predicted_bwd_s,
        measured_fwd_s, measured_bwd_s}]`` (seconds per microbatch), or None. Times measured for another plan are
        stale: any plan change hides them (they come back only if that very plan becomes current again)."""
        m = self._measured
        if m is None or m[0] is not self.session.plan:
            return None
        return [dict(r) for r in m[1]]

    def record_measured(self, plan, rows, action: str = "record_measured") -> None:
        """Keep ``rows`` (stage-time rows as :meth:`Runner.stage_times` gives) as measured for ``plan`` and tell the
        observers with a ``measured`` event. Rows without any measured time are ignored."""
        rows = [dict(r) for r in rows or ()]
        if not any(r.get("measured_fwd_s") is not None or r.get("measured_bwd_s") is not None for r in rows):
            return
        self._measured = (plan, tuple(rows))
        self.session.notify("measured", action, plan, plan, stage_times=[dict(r) for r in rows],
                            current=plan is self.session.plan)

    def runs_of(self, plan) -> list[RunRecord]:
        """The runs that trained ``plan`` (the very plan value), oldest first."""
        return [r for r in self.runs if r.plan is plan]

    # --- runs -------------------------------------------------------------------------------------------------------
    def _model(self, action: str):
        m = self.session.model
        if m is None or not (hasattr(m, "init") and hasattr(m, "step_fn")):
            what = "no model" if m is None else f"a {type(m).__name__}"
            raise ValueError(f"{action} needs the model to train, and this session has {what}: build the session or "
                             "workbench from a zoo ModelSpec (al.models.get(...)) or pass model=... to Session.")
        return m

    def _new_run(self, kind: str, plan, steps: int, batch_size) -> RunRecord:
        with self._lock:
            rec = RunRecord(len(self.runs) + 1, kind, plan, steps, batch_size)
            self.runs.append(rec)
        return rec

    def _on_event(self, action: str, rec: RunRecord) -> Callable:
        """A ProgressEvent callback that updates the run's record, then re-emits the event as a ``training`` event."""
        def on_event(ev) -> None:
            if ev.kind == "step":
                rec.losses.append(None if ev.loss is None else float(ev.loss))
                rec.step_times.append(ev.step_time_s)
                rec.loads.append(os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
            elif ev.kind == "restart":  # back to the checkpoint: later steps are done again
                del rec.losses[ev.step:], rec.step_times[ev.step:]
            elif ev.kind in _END:
                rec.status, rec.message = ev.kind, ev.message
            self.session.notify("training", action, rec.plan, rec.plan, event=ev, run=rec.run)
        return on_event

    def run_local(self, steps: int, *, progress: Callable | None = None, cancel: threading.Event | None = None,
                  seed: int = 0, compiler_options: dict | None = None, devices=None) -> dict:
        """Train the current plan on the local JAX devices (:func:`autopar_lab.execute`) for ``steps`` steps.

        Steps run one at a time on the model's synthetic batches (those of ``Runner.train``, so the losses are the
        same); after each a ``training`` event carries a :class:`~autopar_lab.runtime.progress.ProgressEvent`
        (kind "step"; a last one "done", "cancelled" or "error") and ``progress(event)`` is called with it. ``cancel``
        (a threading.Event) stops the run between steps. From the second step on (the first compiles), the measured
        per-stage times are recorded (:attr:`measured`) and each step event's ``stage_times`` is every stage's median
        forward + backward time per step so far. Returns the runner's report plus ``status`` and ``run``.
        """
        from ..runtime import local
        from ..runtime.progress import ProgressChannel, ProgressEvent

        model = self._model("run_local")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        plan = self.session.plan
        batch_size = plan.table.batch_size if plan.table is not None else getattr(model.config, "batch_size", None)
        rec = self._new_run("local", plan, steps, batch_size)
        channel = ProgressChannel()
        channel.subscribe(self._on_event("run_local", rec))
        if progress is not None:
            channel.subscribe(progress)
        t0 = time.perf_counter()
        status, message = "done", ""
        try:
            runner = local.execute(plan, model, seed=seed, devices=devices, compiler_options=compiler_options)
            self.runner = runner
            for i in range(steps):
                if cancel is not None and cancel.is_set():
                    status = "cancelled"
                    break
                t = time.perf_counter()
                loss = runner.step(local.synthetic_batch(model, seed + i))
                dt = time.perf_counter() - t
                busy: tuple = ()
                if i >= 1:
                    rows = runner.stage_times()
                    self.record_measured(plan, rows, "run_local")
                    # Each stage's compute per step: its median forward + backward per microbatch, times microbatches.
                    if all(r.get("measured_fwd_s") is not None and r.get("measured_bwd_s") is not None for r in rows):
                        busy = tuple((r["measured_fwd_s"] + r["measured_bwd_s"]) * int(plan.microbatches)
                                     for r in rows)
                channel.publish(ProgressEvent(kind="step", step=i + 1, loss=loss, step_time_s=dt,
                                              samples_per_s=batch_size / dt if batch_size and dt > 0 else None,
                                              stage_times=busy, elapsed_s=time.perf_counter() - t0))
        except Exception as e:
            channel.publish(ProgressEvent(kind="error", step=len(channel.losses), elapsed_s=time.perf_counter() - t0,
                                          message=f"{type(e).__name__}: {e}"))
            raise
        if status == "cancelled":
            message = f"cancelled after {len(runner.losses)} of {steps} step(s)"
        channel.publish(ProgressEvent(kind=status, step=len(runner.losses), elapsed_s=time.perf_counter() - t0,
                                      message=message))
        return dict(runner.report(), status=status, run=rec.run)

    def launch(self, steps: int, **launch_kw):
        """Train the current plan on Ray (:func:`autopar_lab.launch`; ``launch_kw`` as it takes: ``ray_address``,
        ``checkpoint_dir``, ``checkpoint_every``, ``on_progress``, ``wait``, ...). Every progress event is re-emitted
        as a session ``training`` event; when the job ends its measured per-stage times are recorded
        (:attr:`measured`). Returns the :class:`~autopar_lab.runtime.launch.Job` (also kept in ``job``)."""
        from ..runtime import launch as launch_mod

        model = self._model("launch")
        plan = self.session.plan
        batch_size = plan.table.batch_size if plan.table is not None else getattr(model.config, "batch_size", None)
        rec = self._new_run("ray", plan, steps, batch_size)
        rec.remote = bool(launch_kw.get("ray_address"))
        user_cb = launch_kw.pop("on_progress", None)
        emit = self._on_event("launch", rec)
        holder: dict = {}

        def on_progress(ev) -> None:
            emit(ev)
            if user_cb is not None:
                user_cb(ev)
            if ev.kind in _END:
                # The job stores its result just after this last event: collect the stage times off this thread.
                threading.Thread(target=self._collect_job_times, args=(holder, plan), daemon=True,
                                 name="autopar-job-times").start()

        try:
            job = launch_mod.launch(plan, model, steps, on_progress=on_progress, **launch_kw)
        except Exception as e:
            rec.status, rec.message = "error", f"{type(e).__name__}: {e}"
            raise
        holder["job"] = job
        self.job = job
        return job

    def _collect_job_times(self, holder: dict, plan, timeout_s: float = 60.0) -> None:
        deadline = time.perf_counter() + timeout_s
        while "job" not in holder and time.perf_counter() < deadline:  # events may end before launch() returns
            time.sleep(0.05)
        job = holder.get("job")
        if job is None:
            return
        wait = getattr(job, "wait", None)
        if wait is not None:
            try:
                wait(timeout_s)
            except Exception:  # noqa: BLE001 - a failed job: its times are whatever it measured
                pass
        try:
            rows = job.stage_times()
        except Exception:  # noqa: BLE001 - no times to show
            return
        self.record_measured(plan, rows, "launch")
