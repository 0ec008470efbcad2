"""Overrides of a plan, re-estimated: plans are values, so each override returns a new :class:`~autopar_lab.plan.Plan`.

How an override is re-priced (the same code path the planner used, so an unchanged plan prices to the same bits):

1. The stage running the operator gets a new :class:`~autopar_lab.solve.intra.IntraPlan`: the old choice with one
   strategy replaced, recomputed by :func:`~autopar_lab.solve.intra.evaluate_intra` (every operator and every
   resharding edge priced again).
2. Its layer costs are split again by :func:`~autopar_lab.planner.layer_costs`, and the stage's per-microbatch
   forward / backward times and memory recomputed by :meth:`~autopar_lab.planner.CostTable.stage`.
3. The pipeline is simulated again and the cost report rebuilt (:func:`~autopar_lab.planner._finish`).

Other stages keep their IntraPlans and layer costs. Overrides record pins (op -> strategy name) in ``Plan.pins``;
:func:`resolve` re-solves each stage's operators around them.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping, NamedTuple, Sequence

from .sharding.strategies import Strategy
from .solve.intra import IntraPlan, _StrategyCache, _to_index, evaluate_intra, solve_intra


class Alternative(NamedTuple):
    """One strategy an operator could have instead: its name, its (first) output spec, and the step-time change."""

    strategy: str
    spec: str
    delta_s: float


# --------------------------------------------------------------------------------------------------------------
# Where an operator lives


def _table(plan):
    if plan.table is None:
        raise ValueError("this plan has no cost table to re-price it with; build it with autopar_lab.planner "
                         "(auto_plan, megatron_plan, data_parallel_plan) or load it with load_plan")
    return plan.table


def _solve_graph(plan):
    return plan.table.solve_graph if plan.table is not None else plan.graph


def owner_stage(plan, op: int) -> int:
    """The index of the stage that runs operator ``op``: its layer's stage (no layer: the last layer's).

    Operator ids are those of the graph the stages' IntraPlans were solved on (``plan.table.solve_graph``: the
    plan's own graph, or for a deep zoo model its shallower copy whose layer ``k`` stands for every identical one).
    """
    g = _solve_graph(plan)
    try:
        node = g.op(op)
    except (KeyError, IndexError):
        raise ValueError(f"operator {op} is not in this plan's graph (ids run 0..{len(g.ops) - 1})") from None
    table = plan.table
    if table is None or g is plan.graph:
        names = list(plan.layer_names)
        k = names.index(node.layer) if node.layer in names else len(names) - 1
        full = {k}
    else:
        small = list(g.layers) or [""]
        k = small.index(node.layer) if node.layer in small else len(small) - 1
        full = {i for i, m in enumerate(table._map) if m == k}
    for s, st in enumerate(plan.stages):
        if any(st.layers[0] <= i <= st.layers[1] for i in full):
            return s
    return len(plan.stages) - 1


# --------------------------------------------------------------------------------------------------------------
# Re-pricing


class _FinishView:
    """The CostTable as planner._finish reads it, except that each stage's (layer costs, IntraPlan) come from the
    plan being re-priced (stages sharing a mesh may have different choices after an override)."""

    def __init__(self, table, per_stage):
        self._table = table
        self._it = iter(per_stage)

    def __getattr__(self, name):
        return getattr(self._table, name)

    def mesh_costs(self, submesh, shape):
        costs, intra = next(self._it)
        return costs, intra


def _costs_of(table, submesh, shape, intra: IntraPlan):
    """Full-graph layer costs of ``intra`` (the table's own entry when it is the table's IntraPlan)."""
    from .planner import layer_costs

    hit = table._mesh.get((tuple(submesh), tuple(shape)))
    if hit is not None and hit[1] is intra:
        return hit[0]
    g = table.solve_graph
    small = layer_costs(g, intra, list(g.layers) or [""])
    return [small[k] for k in table._map]


def assemble(table, cluster, method: str, stage_specs: Sequence[tuple], intras: Sequence[IntraPlan],
             microbatches: int, schedule: str, stage_comm: str, mem_limit: float, *, solve_s: Mapping | None = None,
             notes=(), pins: Mapping[int, str] | None = None):
    """A Plan from its decisions: ``stage_specs`` [(layers, submesh, logical_mesh, remat)] with one IntraPlan each,
    priced by ``table`` exactly as the planner prices its own plans."""
    from .planner import _finish

    cands, per_stage = [], []
    for (layers, submesh, shape, remat), intra in zip(stage_specs, intras):
        key = (tuple(submesh), tuple(shape))
        costs = _costs_of(table, submesh, shape, intra)
        view = copy.copy(table)  # CostTable.stage over this stage's costs only (prefix sums as the planner does)
        view._mesh = {key: (costs, intra)}
        view._sums = {}
        cands.append(view.stage(layers[0], layers[1], tuple(submesh), tuple(shape), microbatches, bool(remat)))
        per_stage.append((costs, intra))
    plan = _finish(_FinishView(table, per_stage), cluster, method, cands, microbatches, schedule, stage_comm,
                   mem_limit, dict(solve_s or {}), notes)
    return dataclasses.replace(plan, solve_s=dict(solve_s) if solve_s is not None else plan.solve_s,
                               pins=dict(pins or {}), table=table)


def _rebuild(plan, intras: Sequence[IntraPlan], microbatches: int, pins: Mapping[int, str]):
    specs = [(st.layers, st.submesh, st.logical_mesh, st.remat) for st in plan.stages]
    return assemble(_table(plan), plan.cluster, plan.method, specs, intras, microbatches, plan.schedule,
                    plan.stage_comm, plan.cost.mem_limit_bytes, solve_s=plan.solve_s, notes=plan.notes, pins=pins)


# --------------------------------------------------------------------------------------------------------------
# Overrides


def _resolve_strategy(graph, op: int, strategy, strats: Sequence[Strategy]) -> Strategy:
    """``strategy`` (a Strategy, its name, or an output spec string) among ``strats``; a ValueError naming the
    operator and its valid choices otherwise. An output spec several strategies share picks the cheapest of them."""
    node = graph.op(op)
    if isinstance(strategy, Strategy):
        return strats[_to_index(strategy, strats, node)]
    text = str(strategy)
    for s in strats:
        if s.name == text:
            return s
    same = [s for s in strats if s.out_specs and str(s.out_specs[0]) == text]
    if same:
        return min(same, key=lambda s: s.cost)
    _to_index(text, strats, node)  # raises the ValueError with the valid choices
    raise AssertionError("unreachable")


def _stage_choice(plan, op: int, strategy):
    _table(plan)
    k = owner_stage(plan, op)
    intra = plan.stages[k].intra
    if intra is None or op not in intra.strategies:
        raise ValueError(f"operator {op} has no strategy in stage {k} of this plan")
    g = _solve_graph(plan)
    cache = _StrategyCache(intra.mesh)
    strats = cache.strategies(g.op(op))
    return k, intra, g, cache, _resolve_strategy(g, op, strategy, strats)


def _with_strategy(plan, k, intra, g, cache, op, s: Strategy):
    chosen = dict(intra.strategies)
    chosen[op] = s
    new = evaluate_intra(g, intra.mesh, chosen, ops=intra.ops, cache=cache, groups=intra.groups,
                         solve_s=intra.solve_s)
    intras = [st.intra for st in plan.stages]
    intras[k] = new
    return _rebuild(plan, intras, plan.microbatches, {**plan.pins, op: s.name})


def with_choice(plan, op: int, strategy):
    """A new plan with operator ``op`` run by ``strategy``; the original is left as it was."""
    k, intra, g, cache, s = _stage_choice(plan, op, strategy)
    return _with_strategy(plan, k, intra, g, cache, op, s)


def with_microbatches(plan, n: int):
    """A new plan with ``n`` microbatches: same stages and strategies, stages re-priced, pipeline re-simulated."""
    from .planner import _microbatch_choices

    table = _table(plan)
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"microbatches must be a positive integer dividing the batch size {table.batch_size}, "
                         f"got {n!r}")
    _microbatch_choices(table.batch_size, n)
    return _rebuild(plan, [st.intra for st in plan.stages], n, plan.pins)


def alternatives(plan, op: int) -> list[Alternative]:
    """Every strategy of ``op`` on its stage's mesh with the step-time change it would bring, best first."""
    k, intra, g, cache, _ = _stage_choice(plan, op, intra_name(plan, op))
    base = plan.cost.step_time_s
    out = []
    for s in cache.strategies(g.op(op)):
        p = _with_strategy(plan, k, intra, g, cache, op, s)
        spec = str(s.out_specs[0]) if s.out_specs else ""
        out.append(Alternative(s.name, spec, p.cost.step_time_s - base))
    out.sort(key=lambda a: (a.delta_s, a.strategy))
    return out


def intra_name(plan, op: int) -> str:
    return plan.choice(op).name


def diff(plan, other) -> dict:
    """What changed from ``plan`` to ``other``.

    ``ops``: [{op, before, after}] operators whose strategy differs (strategy names); ``stages``: [{stage, field,
    before, after}] per-stage differences (layers, submesh, logical_mesh, remat, devices, or the stage itself added or
    removed); ``microbatches``: (before, after) or None; ``step_time_delta_s``: other's step time minus this one's.
    """
    ops = []
    g = _solve_graph(plan)
    for op in g.ops:
        try:
            a = plan.choice(op).name
        except KeyError:
            a = None
        try:
            b = other.choice(op).name
        except KeyError:
            b = None
        if a != b:
            ops.append({"op": op, "before": a, "after": b})
    stages = []
    for k in range(max(len(plan.stages), len(other.stages))):
        if k >= len(plan.stages) or k >= len(other.stages):
            stages.append({"stage": k, "field": "stage", "before": k < len(plan.stages), "after": k < len(other.stages)})
            continue
        sa, sb = plan.stages[k], other.stages[k]
        for f in ("layers", "submesh", "logical_mesh", "remat", "devices"):
            if getattr(sa, f) != getattr(sb, f):
                stages.append({"stage": k, "field": f, "before": getattr(sa, f), "after": getattr(sb, f)})
        for f in ("fwd_s", "bwd_s", "peak_mem_bytes"):
            if getattr(sa, f) != getattr(sb, f):
                stages.append({"stage": k, "field": f, "before": getattr(sa, f), "after": getattr(sb, f)})
    pins = {op: (plan.pins.get(op), other.pins.get(op)) for op in set(plan.pins) | set(other.pins)
            if plan.pins.get(op) != other.pins.get(op)}
    return {
        "ops": ops,
        "stages": stages,
        "microbatches": None if plan.microbatches == other.microbatches else (plan.microbatches, other.microbatches),
        "pins": pins,
        "step_time_before_s": plan.cost.step_time_s,
        "step_time_after_s": other.cost.step_time_s,
        "step_time_delta_s": other.cost.step_time_s - plan.cost.step_time_s,
    }


def resolve(plan, *, solver: str | None = None):
    """Re-solve every stage's operators around the plan's pins (stages without pins keep their strategies)."""
    table = _table(plan)
    g = _solve_graph(plan)
    intras: list[Any] = []
    for k, st in enumerate(plan.stages):
        pins = {op: name for op, name in plan.pins.items() if owner_stage(plan, op) == k}
        if not pins:
            intras.append(st.intra)
            continue
        kw = dict(ops=st.intra.ops, pins=pins, solver=solver or table.solver, rounds=1)
        try:
            intras.append(solve_intra(g, st.intra.mesh, **kw))
        except ValueError:  # a pin outside the axis-0 pass's choices: search both axes at once
            intras.append(solve_intra(g, st.intra.mesh, axes="joint", **kw))
    return _rebuild(plan, intras, plan.microbatches, plan.pins)
