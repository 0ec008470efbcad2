"""What every planner starts from: the cost table of a model on a cluster (:func:`table_for`), the microbatch counts
to try (:func:`~autopar_lab.stagesearch.microbatch_choices`, re-exported here) and the planning times a plan records
(:func:`planning_times`).

:mod:`autopar_lab.planner` (Alpa's plan and the baselines) and :mod:`autopar_lab.layouts` (the frameworks' layouts)
both build on these; ``planner`` re-exports them under their old names.
"""

from __future__ import annotations

from typing import Callable, Mapping

from .cluster import Cluster
from .graph.opgraph import OpGraph
from .precision import Precision, as_precision
from .pricing import CostTable
from .solve.ilp import DEFAULT_SOLVER
from .stagesearch import microbatch_choices


__all__ = ["microbatch_choices", "planning_times", "table_for"]

ProgressFn = Callable[[str, int, int], None]


def planning_times(table: CostTable, solve_s: Mapping[str, float]) -> dict[str, float]:
    """A plan's ``solve_s``: the phases given, plus ``intra`` (the table's ILP seconds so far) and ``total``."""
    out = dict(solve_s)
    out["intra"] = table.solve_s
    out["total"] = sum(v for k, v in out.items() if k != "total")
    return out


def table_for(model, cluster: Cluster | None, table: CostTable | None, solver: str = DEFAULT_SOLVER,
              on_progress: ProgressFn | None = None, space: str = "auto",
              workers: int = 0, precision: str | Precision | None = None) -> tuple[CostTable, Cluster, float | None]:
    """(the cost table to plan with, the cluster, seconds spent tracing or None when a table was given).

    With ``table`` it is checked against ``cluster``, ``model`` (an OpGraph must be the table's graph, or the graph
    it was retyped from) and ``precision`` (the table's number format, when given); without, one is built
    (:meth:`CostTable.build`, with ``space``, ``workers``: processes that start on the ILPs while the full model
    traces, and ``precision``: the number format, None for the model's own)."""
    if cluster is not None and not isinstance(cluster, Cluster):
        cluster = Cluster.parse(cluster)  # 'dgx-h100:8', a preset's name or a cluster file, as the CLI takes it
    if table is None:
        if model is None or cluster is None:
            raise ValueError("give the model and the cluster to plan (or a cost table built for them, table=...)")
        built = CostTable.build(model, cluster, solver=solver, on_progress=on_progress, space=space, workers=workers,
                                precision=precision)
        return built, built.cluster, built.trace_s  # the cluster with the model's routing limit, if it has one
    if not isinstance(table, CostTable):
        raise TypeError(f"table must be a CostTable (from CostTable.build(model, cluster)), got {type(table).__name__}")
    if cluster is None:
        cluster = table.cluster
    elif cluster.with_(moe_routing=table.cluster.moe_routing) != table.cluster:  # the model's routing is the table's
        raise ValueError(f"the cost table was built for another cluster ({table.cluster.name}: {table.cluster.hosts} "
                         f"x {table.cluster.devices_per_host} devices); build one for this cluster with "
                         "CostTable.build(model, cluster), or pass table.cluster.")
    cluster = table.cluster
    if precision is not None and not as_precision(precision).same_format(table.precision):
        want = as_precision(precision).name
        raise ValueError(f"the cost table prices precision {table.precision.name!r}, not {want!r}; build one with "
                         f"CostTable.build(model, cluster, precision={want!r}), or leave precision out.")
    if isinstance(model, OpGraph) and model is not table.graph and model.fingerprint != table.graph.fingerprint \
            and model.fingerprint != table.graph.__dict__.get("source_fingerprint"):
        raise ValueError("the cost table was built for another graph; build one for this model with "
                         "CostTable.build(model, cluster)")
    return table, cluster, None

