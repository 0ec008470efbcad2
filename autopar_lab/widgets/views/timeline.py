"""Pipeline timeline: the simulated schedule of the current plan as a Gantt chart, bubbles in grey.

With many microbatches the whole step is a barcode; the chart then opens on the first microbatches (the pipeline
filling up and its first steady steps, every bar labelled), and a dropdown widens the window up to the whole step.
An interleaved plan's chunks are told apart by shade (the legend names each chunk's forward and backward); a
zero-bubble plan's backward shows as its input-gradient part B and its weight-gradient part W, in a colour of its
own (:func:`timeline_series`).

    >>> rows, makespan = timeline_data(session.plan)[:2]      # doctest: +SKIP
    >>> window_end(rows, 4)                                    # doctest: +SKIP
    0.0123
"""

from __future__ import annotations

import ipywidgets as w

from . import figures
from ._base import LiveFigure, View, sync_figure
from .fmt import fmt_pct, fmt_s

# Each of an interleaved stage's chunks is drawn in its kind's colour, a shade further from it per chunk.
_SHADES = (0.0, 0.45, -0.35, 0.7, -0.55)

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


def _shade(hex_colour: str, t: float) -> str:
    """``hex_colour`` moved ``t`` of the way to white (``t < 0``: to black)."""
    rgb = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    goal = 255 if t >= 0 else 0
    return "#" + "".join(f"{round(c + (goal - c) * abs(t)):02X}" for c in rgb)


def timeline_series(rows: list[dict], schedule: str, virtual_stages: int = 1) -> list[tuple[str, str]]:
    """The legend of a timeline as (name, colour) pairs, and each row's ``"series"`` (set in place): per kind, or
    for an interleaved plan per kind and chunk ("fwd chunk 2/2": a stage's second chunk), and for ZB-H1 the
    backward as "B (input grad)" and the weight-gradient task as "W (weight grad)".

    >>> rows = [{"kind": "fwd", "round": 1}, {"kind": "wgrad", "round": 0}]
    >>> timeline_series(rows, "interleaved", 2)[:2], rows[0]["series"]
    ([('fwd chunk 1/2', '#636EFA'), ('fwd chunk 2/2', '#A9AFFC')], 'fwd chunk 2/2')
    """
    names = {"bwd": "B (input grad)", "wgrad": "W (weight grad)"} if schedule == "zb-h1" else {}
    out = []
    for kind in ("fwd", "bwd", "wgrad", "send_fwd", "send_bwd"):
        rounds = range(virtual_stages) if schedule == "interleaved" and kind in ("fwd", "bwd") else [None]
        for r in rounds:
            name = names.get(kind, kind) if r is None else f"{kind} chunk {r + 1}/{virtual_stages}"
            out.append((name, _shade(figures.KIND_COLOURS[kind], _SHADES[r % len(_SHADES)] if r else 0.0)))
    for row in rows:
        kind = row["kind"]
        if schedule == "interleaved" and kind in ("fwd", "bwd"):
            row["series"] = f"{kind} chunk {row.get('round', 0) + 1}/{virtual_stages}"
        else:
            row["series"] = names.get(kind, kind)
    return out


def window_end(rows, microbatches: int) -> float:
    """When every stage has worked on microbatch ``microbatches - 1``: the end of the window that shows the
    pipeline filling up and its first ``microbatches`` microbatches (each stage's first task of that microbatch,
    the latest of them)."""
    last = microbatches - 1
    firsts: dict = {}
    for r in rows:
        if r["kind"] in figures.COMPUTE_KINDS and r["microbatch"] == last:
            s = r["stage"]
            if s not in firsts or r["start"] < firsts[s][0]:
                firsts[s] = (r["start"], r["end"])
    return max((e for _, e in firsts.values()), default=0.0)


class TimelineView(View):
    """The Gantt chart of the current plan's pipeline, with a window on its first microbatches."""

    css = "autopar-timeline"

    def __init__(self, session):
        super().__init__(session)
        self.caption = w.HTML("")
        self.window = w.Dropdown(description="show", layout=w.Layout(width="260px"))
        self.window.observe(lambda ch: None if self._quiet else self.zoom(ch["new"] or None), names="value")
        self._quiet = False
        self.first: int | None = None  # the microbatches the window shows (None: the whole step)
        fresh, view = self._draw(keep_window=False)
        fresh.update_layout({k.replace(".", "_"): v for k, v in view.items()})
        self.figure = LiveFigure(fresh)  # built whole, its comm opened with its traces (LiveFigure says why)
        self._finish(w.VBox([w.HBox([self.caption, self.window], layout=w.Layout(flex_flow="row wrap",
                                                                                 align_items="center")),
                             self.figure, self.message], layout=w.Layout(min_width="0")))

    def zoom(self, first: int | None) -> None:
        """Show the first ``first`` microbatches (None: the whole step)."""
        plan = self.session.plan
        self.first = None if first is None or first >= plan.microbatches else int(first)
        self.refresh(keep_window=True)

    def refresh(self, keep_window: bool = False) -> None:
        fresh, view = self._draw(keep_window)
        sync_figure(self.figure, fresh, view)

    def _draw(self, keep_window: bool):
        """Set the window's choices and the caption for the current plan; return its figure and the layout
        properties a redraw sets."""
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
        v = getattr(plan, "virtual_stages", 1)
        series = timeline_series(rows, plan.schedule, v)
        end = window_end(rows, self.first) * 1.04 if self.first else makespan * 1.01
        label = self.first * 2 if self.first else None
        sched = f"interleaved ({v} chunks per stage)" if plan.schedule == "interleaved" else plan.schedule
        fresh = figures.timeline_figure(rows, makespan, label_upto=label, series=series,
                                        title=f"{sched} pipeline, {len(plan.stages)} stage(s), "
                                              f"{B} microbatch(es)")
        view = {"title.text": fresh.layout.title.text, "xaxis.range": [0, end if end > 0 else 1],
                "yaxis.categoryarray": fresh.layout.yaxis.categoryarray}
        tl = plan.cost.timeline
        frac = tl.bubble_fraction if tl is not None else 0.0
        more = f"; {cut} later tasks not drawn" if cut else ""
        shown = f"; showing the first {self.first} microbatches (drag or zoom to see more)" if self.first else ""
        how = {"interleaved": f"; each stage runs {v} chunks of the model, told apart by shade",
               "zb-h1": "; each backward split into B (input gradients, passed on at once) and W (weight gradients, "
                        "deferred into the bubbles)"}.get(plan.schedule, "")
        self.caption.value = f"makespan {fmt_s(makespan)}, bubble {fmt_pct(frac)} of it{more}{shown}{how}"
        return fresh, view

    def on_plan(self, event) -> None:
        self.refresh()
