"""Pipeline timeline: the simulated schedule (GPipe or 1F1B) of the current plan as a Gantt chart, bubbles in grey.

With many microbatches the whole step is a barcode; the chart then opens on the first microbatches (the pipeline
filling up and its first steady steps, every bar labelled), and a dropdown widens the window up to the whole step.

    >>> rows, makespan = timeline_data(session.plan)[:2]      # doctest: +SKIP
    >>> window_end(rows, 4)                                    # doctest: +SKIP
    0.0123
"""

from __future__ import annotations

import ipywidgets as w

from . import figures
from ._base import View, sync_figure
from .fmt import fmt_pct, fmt_s

MAX_TASKS = 4000  # beyond this many bars the browser slows down; the chart then shows the first microbatches only
ZOOM_ABOVE = 16  # more microbatches than this: open on the first ZOOM_TO of them
ZOOM_TO = 4


def timeline_data(plan, max_tasks: int = MAX_TASKS) -> tuple[list[dict], float, int]:
    """The timeline rows of ``plan.cost.timeline`` (at most ``max_tasks``, earliest first), its makespan, and how
    many rows were left out."""
    tl = plan.cost.timeline
    if tl is None:
        return [], plan.cost.step_time_s, 0
    rows = tl.to_rows()
    cut = max(len(rows) - max_tasks, 0)
    return rows[:max_tasks], tl.makespan, cut


def window_end(rows, microbatches: int) -> float:
    """When every stage has worked on microbatch ``microbatches - 1``: the end of the window that shows the
    pipeline filling up and its first ``microbatches`` microbatches (each stage's first task of that microbatch,
    the latest of them)."""
    last = microbatches - 1
    firsts: dict = {}
    for r in rows:
        if r["kind"] in ("fwd", "bwd") and r["microbatch"] == last:
            s = r["stage"]
            if s not in firsts or r["start"] < firsts[s][0]:
                firsts[s] = (r["start"], r["end"])
    return max((e for _, e in firsts.values()), default=0.0)


class TimelineView(View):
    """The Gantt chart of the current plan's pipeline, with a window on its first microbatches."""

    css = "autopar-timeline"

    def __init__(self, session):
        super().__init__(session)
        import plotly.graph_objects as go

        self.figure = go.FigureWidget()
        self.caption = w.HTML("")
        self.window = w.Dropdown(description="show", layout=w.Layout(width="260px"))
        self.window.observe(lambda ch: None if self._quiet else self.zoom(ch["new"] or None), names="value")
        self._quiet = False
        self.first: int | None = None  # the microbatches the window shows (None: the whole step)
        self.refresh()
        self._finish(w.VBox([w.HBox([self.caption, self.window], layout=w.Layout(flex_flow="row wrap",
                                                                                 align_items="center")),
                             self.figure, self.message], layout=w.Layout(min_width="0")))

    def zoom(self, first: int | None) -> None:
        """Show the first ``first`` microbatches (None: the whole step)."""
        plan = self.session.plan
        self.first = None if first is None or first >= plan.microbatches else int(first)
        self.refresh(keep_window=True)

    def refresh(self, keep_window: bool = False) -> None:
        plan = self.session.plan
        B = plan.microbatches
        if not keep_window:
            self.first = ZOOM_TO if B > ZOOM_ABOVE else None
        choices = [k for k in (2, 4, 8, 16, 32) if k < B]
        self._quiet = True
        try:
            # 0 stands for the whole step: a Dropdown shows a value of None as blank.
            self.window.options = [(f"first {k} microbatches", k) for k in choices] + [(f"whole step ({B})", 0)]
            self.window.value = self.first or 0
        finally:
            self._quiet = False
        rows, makespan, cut = timeline_data(plan)
        end = window_end(rows, self.first) * 1.04 if self.first else makespan * 1.01
        label = self.first * 2 if self.first else None
        fresh = figures.timeline_figure(rows, makespan, label_upto=label,
                                        title=f"{plan.schedule} pipeline, {len(plan.stages)} stage(s), "
                                              f"{B} microbatch(es)")
        if not self.figure.data:
            self.figure.layout = fresh.layout
        sync_figure(self.figure, fresh, {"title.text": fresh.layout.title.text,
                                         "xaxis.range": [0, end if end > 0 else 1],
                                         "yaxis.categoryarray": fresh.layout.yaxis.categoryarray})
        tl = plan.cost.timeline
        frac = tl.bubble_fraction if tl is not None else 0.0
        more = f"; {cut} later tasks not drawn" if cut else ""
        shown = f"; showing the first {self.first} microbatches (drag or zoom to see more)" if self.first else ""
        self.caption.value = f"makespan {fmt_s(makespan)}, bubble {fmt_pct(frac)} of it{more}{shown}"

    def on_plan(self, event) -> None:
        self.refresh()
