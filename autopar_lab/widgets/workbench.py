"""The notebook workbench: a :class:`~autopar_lab.widgets.session.Session` and its linked views in one ipywidgets box.

    >>> import autopar_lab as al
    >>> wb = al.Workbench(al.models.get("gpt-tiny"), al.Cluster.preset("p3.16xlarge"))   # doctest: +SKIP
    >>> wb                                    # doctest: +SKIP

In a notebook the last line shows the graph, table, layout, cost panel, timeline and controls.

Every view follows one shared selection (an operator, a layer, a stage) and redraws when the plan changes. Each view's
top widget carries a stable CSS class (``autopar-graph``, ``autopar-sharding-table``, ``autopar-stage-layout``,
``autopar-cost-panel``, ``autopar-timeline``, ``autopar-controls``, ``autopar-training``; the step time is
``autopar-step-time``), so a browser test can find it. Below the timeline the training panel runs the plan locally or
launches it on Ray, with a live loss curve and measured against predicted stage times.
"""

from __future__ import annotations

import time

import ipywidgets as w

from .session import Session
from .views.controls import Controls
from .views.cost_panel import CostPanel
from .views.graph import GraphView
from .views.sharding_table import ShardingTable
from .views.stage_layout import StageLayout
from .views.timeline import TimelineView
from .views.training import TrainingPanel

_STYLE = """<style>
.autopar-sharding-table select { font-family: monospace; font-size: 12px; }
.autopar-cost-table td, .autopar-cost-table th { padding: 1px 8px; text-align: right; }
.autopar-cost-table td:first-child { text-align: left; }
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
        # The cost panel subscribes first, so it is up to date before the slower views redraw after a change.
        self.cost = CostPanel(session)
        self.graph = GraphView(session, mode=graph_mode)
        self.table = ShardingTable(session)
        self.layout = StageLayout(session)
        self.timeline = TimelineView(session)
        self.controls = Controls(session)
        self.training = TrainingPanel(session)
        self.status = w.HTML("")
        self.status.add_class("autopar-status")
        session.subscribe(self._on_event)
        # Two columns that wrap under each other when the notebook is narrow, so no view is cut off.
        left = w.VBox([self.graph.widget, self.table.widget], layout=w.Layout(flex="1 1 560px", min_width="0"))
        right = w.VBox([self.cost.widget, self.layout.widget], layout=w.Layout(flex="1 1 420px", min_width="0"))
        columns = w.HBox([left, right], layout=w.Layout(flex_flow="row wrap", width="100%"))
        self.widget = w.VBox([w.HTML(_STYLE), self.controls.widget, self.status, columns,
                              self.timeline.widget, self.training.widget])
        self.widget.add_class("autopar-workbench")
        self.timings = {"plan_s": t1 - t0, "views_s": time.perf_counter() - t1}
        self._update_status()

    @property
    def plan(self):
        """The current plan."""
        return self.session.plan

    @property
    def views(self) -> dict:
        return {"graph": self.graph, "sharding-table": self.table, "stage-layout": self.layout,
                "cost-panel": self.cost, "timeline": self.timeline, "controls": self.controls,
                "training": self.training}

    def _on_event(self, event) -> None:
        if event.name == "error":
            self.status.value = (f"<span style='color:#B00020'>{event.action}: "
                                 f"{event.detail.get('message', '')}</span>")
        elif event.name in ("plan", "selection"):
            self._update_status()

    def _update_status(self) -> None:
        s = self.session
        sel = s.selection
        parts = [repr(s.plan), f"history {len(s.history)} step(s)", f"{len(s.plan.pins)} pin(s)"]
        if sel.op is not None or sel.layer is not None or sel.stage is not None:
            parts.append(f"selected op={sel.op} layer={sel.layer} stage={sel.stage}")
        import html

        self.status.value = html.escape(" · ".join(parts))

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def close(self) -> None:
        for v in self.views.values():
            v.close()
        self.widget.close()

    def __repr__(self) -> str:
        return f"Workbench({self.session!r})"
