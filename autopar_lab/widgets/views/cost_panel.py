"""Cost panel: the step time split into its terms, before -> after the last change; memory per stage split into
parameters, gradients, optimizer state and activations (:mod:`autopar_lab.memory`), before -> after; utilisation
against the roofline bound.

The stacked bar sums exactly to the step time: compute + collectives + resharding (the busiest stage's work) + bubble
(its idle time). Stage transfers overlap compute and are part of that idle time where they are exposed, so the table
lists their total separately rather than adding it twice.

Utilisation (:mod:`.utilisation`): MFU, the step's model FLOPs over (step time x devices x peak FLOP/s); HFU, the
same counting what recomputation runs again; and the roofline bound, the MFU of an ideal step (every kernel split
evenly over all devices at peak FLOP/s or bandwidth, no communication or bubble), never above the plan's step.

    >>> cost_terms(plan.cost)                       # doctest: +SKIP
    {'compute': 0.5, 'collectives': 0.1, 'resharding': 0.0, 'bubble': 0.05}
"""

from __future__ import annotations

import html
import time

import ipywidgets as w

from ...memory import memory_breakdown
from . import figures
from ._base import LiveFigure, View, sync_figure
from .fmt import fmt_bytes, fmt_delta_bytes, fmt_delta_s, fmt_pct, fmt_rate, fmt_ratio, fmt_s
from .utilisation import utilisation, utilisation_html

def cost_terms(cost) -> dict[str, float]:
    """The terms that add up to the step time (the host's wait only for a plan run by an eager host)."""
    host = {"host": cost.host_s} if getattr(cost, "host_launch_s", 0.0) else {}
    return {"compute": cost.compute_s, "collectives": cost.comm_s, "resharding": cost.reshard_s, **host,
            "bubble": cost.bubble_s}


def roofline(plan) -> dict:
    """:func:`~.utilisation.utilisation` of ``plan`` (MFU, HFU, the roofline bound and its ideal step), with
    ``utilisation`` (its MFU) as earlier callers read it."""
    u = utilisation(plan)
    return {**u, "utilisation": u["mfu"]}


def step_time_text(before, after) -> str:
    """``"step time 1.23 s · 4.56k samples/s"`` and, after a change, what it was and the change."""
    text = f"step time {fmt_s(after.step_time_s)}"
    if before is not None and before.step_time_s != after.step_time_s:
        text += f" (was {fmt_s(before.step_time_s)}: {fmt_delta_s(before.step_time_s, after.step_time_s)})"
    return text + f" · {fmt_rate(after.samples_per_s)}"


def cpu_terms(cost) -> list[tuple[str, str, float]]:
    """The CPU's parts of ``cost``'s compute term (``CostReport.cpu``: a row label, a clause, seconds); none on a GPU
    or TPU."""
    cpu = getattr(cost, "cpu", None)
    return cpu.terms() if cpu is not None else []


def explain_text(cost) -> str:
    """:meth:`CostReport.explain` in the views' number format: the step time as the sum of its terms."""
    attention = "flash attention" if getattr(cost, "flash_attention", False) else "attention through memory"
    return (f"step time {fmt_s(cost.step_time_s)} = compute {fmt_s(cost.compute_s)} (the busiest stage, "
            f"S{cost.busiest_stage}, runs {getattr(cost, 'kernels', 0):,} fused kernels a step, {attention}"
            + "".join(f"; {fmt_s(v)} of it {clause}" for _label, clause, v in cpu_terms(cost) if v)
            + ") + "
            f"collectives {fmt_s(cost.comm_s)} (including the latency of {getattr(cost, 'collectives', 0):,} "
            f"collectives a step, {fmt_s(getattr(cost, 'collective_latency_s', 0.0))}: each microbatch pays its "
            f"own) + resharding {fmt_s(cost.reshard_s)} (over all microbatches, what is "
            f"not hidden) "
            + (f"+ host {fmt_s(cost.host_s)} (the GPU waiting on an eager host: {getattr(cost, 'kernels', 0):,} "
               f"kernels a step x {cost.host_launch_s * 1e6:.3g} us launched from Python) "
               if getattr(cost, "host_launch_s", 0.0) else "")
            + f"+ bubble {fmt_s(cost.bubble_s)} (that stage idle: pipeline fill and drain, waiting for "
            f"transfers); stage transfers cost {fmt_s(cost.stage_comm_s)} per microbatch round trip in all; "
            f"{fmt_s(getattr(cost, 'hidden_comm_s', 0.0))} of communication runs hidden behind compute (gradient "
            "reduction behind the last backward, parameter gathers behind the forward)")


def breakdown_html(before, after) -> str:
    """The terms before -> after as an HTML table; a term's relative change is given only when the term is at least
    1% of the step time (see :mod:`.fmt`)."""
    terms = [("compute", "compute_s"), ("collectives", "comm_s"),
             ("of which collective latency (every microbatch)", "collective_latency_s"), ("resharding", "reshard_s"),
             ("bubble", "bubble_s"),
             *([("waiting on the eager host (kernels x host time a kernel)", "host_s")]
               if getattr(after, "host_launch_s", 0.0) else []),
             ("stage transfers (overlapped, inside the bubble)", "stage_comm_s"),
             ("communication hidden behind compute (not in the step)", "hidden_comm_s"), ("step time", "step_time_s")]
    rows = [(label, f, getattr(after, f), getattr(before, f) if before is not None else None) for label, f in terms]
    # The CPU's parts of the compute term, under it, where the plan is priced on the CPU (backends.cpu).
    was = {label: v for label, _clause, v in cpu_terms(before)} if before is not None else {}
    rows[1:1] = [(label, "", v, was.get(label, 0.0) if before is not None else None)
                 for label, _clause, v in cpu_terms(after)]
    ref = before.step_time_s if before is not None else None
    head = "<tr><th style='text-align:left'>term</th>" + ("<th>before</th>" if before is not None else "") + \
           "<th>now</th>" + ("<th>change</th>" if before is not None else "") + "</tr>"
    body = []
    for label, f, a, b in rows:
        cells = (f"<td>{fmt_s(b)}</td>" if before is not None else "") + f"<td>{fmt_s(a)}</td>" + \
                (f"<td>{fmt_delta_s(b, a, ref)}</td>" if before is not None else "")
        style = " style='font-weight:bold'" if f == "step_time_s" else ""
        body.append(f"<tr{style}><td>{label}</td>{cells}</tr>")
    mem_b = max(before.peak_mem_bytes) if before is not None else None
    mem_a = max(after.peak_mem_bytes)
    over = " <span style='color:#B00020'>over the limit</span>" if mem_a > after.mem_limit_bytes else ""
    mem = ("<tr><td>peak memory (largest stage)</td>" + (f"<td>{fmt_bytes(mem_b)}</td>" if before is not None else "")
           + f"<td>{fmt_bytes(mem_a)}{over}</td>"
           + (f"<td>{fmt_delta_bytes(mem_b, mem_a)}</td>" if before is not None else "") + "</tr>")
    return f"<table class='autopar-cost-table'>{head}{''.join(body)}{mem}</table>"


class CostPanel(View):
    """The step time's terms before -> after the last change, memory per stage by part, utilisation, and measured
    against predicted times once a run measured them. "Before" is the plan shown before the last change, whatever
    it was (an undo's before is the plan undone)."""

    css = "autopar-cost-panel"

    def __init__(self, session):
        super().__init__(session)

        plan = session.plan
        self.before = session.previous  # the plan before the last change (None at the start)
        self.breakdown = w.HTML("")
        self.explain = w.HTML("")
        self.utilisation = w.HTML("")
        self.memory = w.HTML("")
        self.measured = w.HTML("")  # measured / predicted stage times, once a training run measured them
        self.cost_fig = LiveFigure(figures.cost_figure(None, cost_terms(plan.cost)))
        self.mem_fig = LiveFigure(figures.memory_figure(memory_breakdown(plan), None,
                                                             plan.cost.mem_limit_bytes))
        self.last_refresh: float | None = None
        self.refresh()
        self._finish(w.VBox([self.breakdown, self.cost_fig, self.memory, self.mem_fig, self.utilisation,
                             self.measured, self.explain, self.message], layout=w.Layout(min_width="0")))

    def refresh(self) -> None:
        plan, prev = self.session.plan, self.before
        before = prev.cost if prev is not None else None
        after = plan.cost
        self.breakdown.value = breakdown_html(before, after)
        self.explain.value = f"<small>{html.escape(explain_text(after))}</small>"
        self.utilisation.value = utilisation_html(plan)
        sync_figure(self.cost_fig, figures.cost_figure(cost_terms(before) if before is not None else None,
                                                       cost_terms(after)))
        now = memory_breakdown(plan)
        was = memory_breakdown(prev) if prev is not None and prev.cost.peak_mem_bytes != after.peak_mem_bytes \
            else None
        self.mem_rows = now
        mem = figures.memory_figure(now, was, after.mem_limit_bytes)
        sync_figure(self.mem_fig, mem, {"shapes": mem.layout.shapes, "annotations": mem.layout.annotations,
                                        "title.text": mem.layout.title.text,
                                        "yaxis.title.text": mem.layout.yaxis.title.text,
                                        "height": mem.layout.height, "margin": mem.layout.margin})
        self.memory.value = memory_text(now, after.mem_limit_bytes)
        self.show_measured()
        self.last_refresh = time.perf_counter()

    def show_measured(self) -> None:
        """One line of measured over predicted stage times (from ``session.measured``; empty when there are none)."""
        from .training import stage_rows

        measured = self.session.measured
        if not measured:
            self.measured.value = ""
            return
        parts = [f"stage {r['stage']}: forward {fmt_ratio(r['fwd_ratio'])}, backward {fmt_ratio(r['bwd_ratio'])}"
                 for r in stage_rows(self.session.plan, measured)
                 if r["fwd_ratio"] is not None and r["bwd_ratio"] is not None]
        self.measured.value = ("<small>measured / predicted time per microbatch: " + "; ".join(parts) + "</small>"
                               if parts else "")

    def on_plan(self, event) -> None:
        self.before = event.before if event.before is not event.after else self.before
        self.refresh()

    def _on_event(self, event) -> None:
        super()._on_event(event)
        if event.name == "measured":
            self.show_measured()


def memory_text(rows, limit_bytes: float) -> str:
    """One line per stage: its peak and what holds it (the figure's numbers, as text)."""
    lines = []
    for r in rows:
        extra = "".join(f", {label} {fmt_bytes(r[key])}" for key, label in (
            ("master_bytes", "fp32 master weights"), ("copies_bytes", "parameter copies"),
            ("fp8_copies_bytes", "FP8 weight copies"), ("buffers_bytes", "buffers"),
            ("recompute_bytes", "recompute working set")) if r.get(key))
        parts = (f"parameters {fmt_bytes(r['params_bytes'])}, gradients {fmt_bytes(r['grads_bytes'])}, optimizer "
                 f"{fmt_bytes(r['optimizer_bytes'])}{extra}, activations {fmt_bytes(r['activations_bytes'])} "
                 f"({r['microbatches_in_flight']} microbatch(es) in flight)")
        if r["remat"]:
            parts += f"; remat saves {fmt_bytes(r['remat_saved_bytes'])}"
        lines.append(f"S{r['stage']}: <b>{fmt_bytes(r['total_bytes'])}</b> of {fmt_bytes(limit_bytes)} "
                     f"({fmt_pct(r['total_bytes'] / limit_bytes)}) = {parts}")
    return "<div class='autopar-memory-text'><small>" + "<br>".join(lines) + "</small></div>"
