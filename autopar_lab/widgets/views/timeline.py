"""Pipeline timeline: the simulated schedule (GPipe or 1F1B) of the current plan as a Gantt chart, bubbles in grey.

    >>> rows, makespan = timeline_data(session.plan)      # doctest: +SKIP
"""

from __future__ import annotations

import ipywidgets as w

from . import figures
from ._base import View, fmt_s, sync_figure

MAX_TASKS = 4000  # beyond this many bars the browser slows down; the chart then shows the first microbatches only


def timeline_data(plan, max_tasks: int = MAX_TASKS) -> tuple[list[dict], float, int]:
    """The timeline rows of ``plan.cost.timeline`` (at most ``max_tasks``, earliest first), its makespan, and how
    many rows were left out."""
    tl = plan.cost.timeline
    if tl is None:
        return [], plan.cost.step_time_s, 0
    rows = tl.to_rows()
    cut = max(len(rows) - max_tasks, 0)
    return rows[:max_tasks], tl.makespan, cut


class TimelineView(View):
    """The Gantt chart of the current plan's pipeline."""

    css = "autopar-timeline"

    def __init__(self, session):
        super().__init__(session)
        import plotly.graph_objects as go

        self.figure = go.FigureWidget()
        self.caption = w.HTML("")
        self.refresh()
        self._finish(w.VBox([self.caption, self.figure, self.message]))

    def refresh(self) -> None:
        plan = self.session.plan
        rows, makespan, cut = timeline_data(plan)
        fresh = figures.timeline_figure(rows, makespan,
                                        title=f"{plan.schedule} pipeline, {len(plan.stages)} stage(s), "
                                              f"{plan.microbatches} microbatch(es)")
        if not self.figure.data:
            self.figure.layout = fresh.layout
        sync_figure(self.figure, fresh, {"title.text": fresh.layout.title.text, "xaxis.range": fresh.layout.xaxis.range,
                                         "yaxis.categoryarray": fresh.layout.yaxis.categoryarray})
        tl = plan.cost.timeline
        frac = tl.bubble_fraction if tl is not None else 0.0
        more = f"; {cut} later tasks not drawn" if cut else ""
        self.caption.value = f"makespan {fmt_s(makespan)}, bubble fraction {frac:.1%}{more}"

    def on_plan(self, event) -> None:
        self.refresh()
