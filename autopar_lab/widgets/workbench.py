"""The notebook workbench: a :class:`~autopar_lab.widgets.session.Session` and its linked views in one ipywidgets box.

    >>> import autopar_lab as al
    >>> wb = al.Workbench(al.models.get("gpt-tiny"), al.Cluster.preset("p3.16xlarge"))   # doctest: +SKIP
    >>> wb                                    # doctest: +SKIP

In a notebook the last line shows a dashboard: a header that stays in view (the plan, its step time, its memory, the
pins, undo / redo), a compact toolbar (solves, save / load, export, compare, what if), and the views in a grid that
fits the notebook's width: the operator graph across the top, then the sharding table over the stage layout beside
the cost panel (one under the other when the notebook is narrow), the pipeline timeline and the training panel.

Every view follows one shared selection (an operator, a layer, a stage) and redraws when the plan changes. Each view's
top widget carries a stable CSS class (``autopar-header``, ``autopar-controls``, ``autopar-graph``,
``autopar-sharding-table``, ``autopar-stage-layout``, ``autopar-cost-panel``, ``autopar-timeline``,
``autopar-training``; the step time is ``autopar-step-time``), so a browser test can find it.
"""

from __future__ import annotations

import html
import time

import ipywidgets as w

from .session import Session
from .views.controls import Controls
from .views.cost_panel import CostPanel
from .views.graph import GraphView
from .views.header import Header
from .views.sharding_table import ShardingTable
from .views.stage_layout import StageLayout
from .views.timeline import TimelineView
from .views.training import TrainingPanel

# Column width of the grid: the narrowest a side view (table, cost panel, stage layout) reads well at; its figures
# are a little narrower (figures.SIDE_WIDTH), so nothing in a column scrolls sideways.
COLUMN_PX = 470

STYLE = """<style>
.autopar-workbench { max-width: 100%; box-sizing: border-box; }
/* The header sticks to the top of the notebook's scroll area: no box between it and that area may clip. */
.jp-OutputArea:has(.autopar-workbench), .jp-OutputArea-output:has(.autopar-workbench),
.jp-OutputArea-child:has(.autopar-workbench), .output_area:has(.autopar-workbench),
.output_subarea:has(.autopar-workbench), .autopar-workbench { overflow: visible !important; }
.autopar-header { position: sticky; top: 0; z-index: 30; background: var(--jp-layout-color0, #fff);
  border-bottom: 1px solid #ccc; padding: 4px 6px; box-shadow: 0 2px 4px rgba(0,0,0,0.06); }
.autopar-header .widget-html-content { white-space: normal; line-height: 1.35; }
.autopar-toolbar { gap: 2px 4px; padding: 2px 0; }
.autopar-toolbar .widget-button, .autopar-toolbar .widget-toggle-button { margin: 1px; }
.autopar-grid > * { min-width: 0; }
.autopar-grid > .autopar-wide { grid-column: 1 / -1; }
.autopar-grid .widget-html-content { white-space: normal; line-height: 1.4; }
.autopar-sharding-table select { font-family: monospace; font-size: 12px; }
.autopar-op-listing select { width: max-content; min-width: 100%; }
.autopar-op-listing .widget-select, .autopar-op-listing .widget-html { width: max-content; min-width: 100%; }
.autopar-op-listing .widget-html-content pre { margin: 0 0 0 4px; font-family: monospace; font-size: 12px; }
.autopar-cost-table td, .autopar-cost-table th { padding: 1px 8px; text-align: right; white-space: nowrap; }
.autopar-cost-table td:first-child, .autopar-cost-table th:first-child { text-align: left; white-space: normal; }
.autopar-workbench .jupyter-button:disabled { opacity: 0.45; }
</style>"""


class Workbench:
    """The workbench for ``model_or_graph`` (a zoo ModelSpec or an OpGraph) on ``cluster``.

    ``plan``: the plan to start from; by default :func:`~autopar_lab.auto_plan` solves one (``solve_kw`` are passed
    to it, e.g. ``microbatches=8``). ``session``: an existing Session to attach the views to instead.
    The views are attributes (``graph``, ``table``, ``layout``, ``cost``, ``timeline``, ``controls``, ``training``);
    ``widget`` is the ipywidgets box a notebook displays (the Workbench itself displays as that box).
    """

    def __init__(self, model_or_graph=None, cluster=None, plan=None, *, session: Session | None = None,
                 graph_mode: str = "stage", **solve_kw):
        t0 = time.perf_counter()
        if session is None:
            if plan is None:
                if model_or_graph is None or cluster is None:
                    raise ValueError("Workbench needs a model (or graph) and a cluster, or a plan, or a session")
                from ..planner import auto_plan

                plan = auto_plan(model_or_graph, cluster, **solve_kw)
            elif cluster is not None and plan.cluster != cluster:
                raise ValueError("the plan was made for another cluster than the one given; pass the plan's cluster "
                                 "or leave cluster out")
            session = Session(plan, model=model_or_graph)
        self.session = session
        t1 = time.perf_counter()
        # Observers hear of a change in the order they subscribed, each redrawing before the next hears of it: the
        # header first (the plan, its step time: what a user reads first), then the cost panel, then the slower views
        # (on a deep model the graph and table take seconds; the header used to wait for them all).
        self.header = Header(session)
        self.cost = CostPanel(session)
        self.graph = GraphView(session, mode=graph_mode)
        self.table = ShardingTable(session)
        self.layout = StageLayout(session)
        self.timeline = TimelineView(session)
        self.controls = Controls(session)
        self.training = TrainingPanel(session)
        self.header.set_buttons([self.controls.undo_button, self.controls.redo_button])
        self.status = w.HTML("")
        self.status.add_class("autopar-status")
        session.subscribe(self._on_event)
        for v in (self.graph, self.timeline, self.training):
            v.widget.add_class("autopar-wide")  # across every column (CSS below)
        # The table and the stage layout share a column beside the (taller) cost panel: no empty space under either.
        self.column = w.VBox([self.table.widget, self.layout.widget], layout=w.Layout(min_width="0"))
        self.column.add_class("autopar-column")
        self.grid = w.GridBox(
            [self.graph.widget, self.column, self.cost.widget, self.timeline.widget, self.training.widget],
            layout=w.Layout(grid_template_columns=f"repeat(auto-fill, minmax(min(100%, {COLUMN_PX}px), 1fr))",
                            grid_gap="10px 14px", width="100%", align_items="flex-start"))
        self.grid.add_class("autopar-grid")
        self.widget = w.VBox([w.HTML(STYLE), self.header.widget, self.controls.widget, self.status, self.grid],
                             layout=w.Layout(width="100%"))
        self.widget.add_class("autopar-workbench")
        # The graph spans the notebook's width and says how wide it is: the full-width figures take that width (a
        # plotly figure without one keeps the 700 px it was first drawn at).
        self.graph.width_listeners.append(self.fit_width)
        self.timings = {"plan_s": t1 - t0, "views_s": time.perf_counter() - t1}
        self._update_status()

    def fit_width(self, px: int) -> None:
        """Size the full-width figures (timeline, loss curve) to ``px`` pixels, the width of the notebook's grid."""
        width = max(int(px) - 8, 320)
        for fig in (self.timeline.figure, self.training.loss_fig):
            if fig.layout.width != width:
                fig.layout.width = width

    @property
    def plan(self):
        """The current plan."""
        return self.session.plan

    @property
    def views(self) -> dict:
        return {"header": self.header, "graph": self.graph, "sharding-table": self.table, "stage-layout": self.layout,
                "cost-panel": self.cost, "timeline": self.timeline, "controls": self.controls,
                "training": self.training}

    def _on_event(self, event) -> None:
        if event.name == "error" and event.detail.get("source") == self.controls.css:
            pass  # the controls show it right above this line: once is enough
        elif event.name == "error":
            self.status.value = (f"<span style='color:#B00020'>{html.escape(event.action)}: "
                                 f"{html.escape(str(event.detail.get('message', '')))}</span>")
        elif event.name in ("plan", "selection"):
            self._update_status()  # (a plan change also clears an error about the plan before)

    def _update_status(self) -> None:
        """The selection, when there is one (the plan itself is in the header)."""
        sel = self.session.selection
        parts = []
        if sel.op is not None:
            node = self.session.op_graph.op(sel.op)
            parts.append(f"operator #{sel.op} ({node.primitive})")
        if sel.layer is not None:
            parts.append(f"layer {sel.layer}")
        if sel.stage is not None:
            parts.append(f"stage {sel.stage}")
        self.status.value = ("<small>selected: " + html.escape(", ".join(parts)) + "</small>") if parts else ""

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def close(self) -> None:
        for v in self.views.values():
            v.close()
        self.widget.close()

    def __repr__(self) -> str:
        return f"Workbench({self.session!r})"
