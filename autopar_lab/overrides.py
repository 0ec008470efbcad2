"""Overrides of a plan, re-estimated: plans are values, so each override returns a new :class:`~autopar_lab.plan.Plan`.

How an override is re-priced (by :func:`~autopar_lab.pricing.price_plan`, the function the planner's own plans go
through, so an unchanged plan prices to the same bits):

1. The stage running the operator gets a new :class:`~autopar_lab.solve.intra.IntraPlan`: the old choice with one
   strategy replaced (a :class:`~autopar_lab.pricing.LazyIntraPlan`: its totals are evaluate_intra's, computed when
   first read).
2. Its layer costs are split again only for the layers the change can reach
   (:func:`~autopar_lab.pricing.changed_layer_costs` says why that is exact to the bit), and the stage's
   per-microbatch times and memory come from the one stage-cost formula.
3. The pipeline is simulated again and the cost report rebuilt.

A stage override (:func:`with_stages`, :func:`with_remat`, :func:`with_microbatches`, :func:`with_schedule`) reuses
the layer costs of every stage whose layers and mesh are unchanged and takes the cost table's for the rest; only the
stage DP for what the user left free (with the rest pinned) and the simulation run again.

Other stages keep their IntraPlans and layer costs. Overrides record pins: operators' strategies in ``Plan.pins``
(op -> strategy name), stage decisions in ``Plan.stage_pins`` (:func:`with_stages`: boundaries, submeshes, logical
meshes, microbatches; :func:`with_remat`; :func:`with_schedule`; :func:`with_microbatches`).
:func:`~autopar_lab.pins.resolve` re-solves everything else around them.

>>> q = plan.with_stages(boundaries=[12], submeshes=[(1, 4), (1, 4)]).with_remat(0)   # doctest: +SKIP
>>> q.stage_pins                                                                      # doctest: +SKIP
{'boundaries': (12,), 'submeshes': ((1, 4), (1, 4)), 'remat': (True, None)}
>>> al.resolve(q.with_choice(op, "S0R"))        # the DP and the ILP around every pin  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

from . import checks, planner
from .pins import (  # noqa: F401 - stage_ranges, check_submeshes and resolve were first offered here
    PinIndex,
    check_submeshes,
    pair,
    pinned_intra,
    resolve,
    solve_fixed_cuts,
    stage_ranges,
)
from .pricing import LazyIntraPlan, changed_layer_costs, price_plan
from .pricing.price import StageSpec, table_of
from .schedules import check_schedule
from .sharding.strategies import Strategy
from .solve.inter import NoFeasiblePlanError, StageConstraints
from .solve.intra import IntraPlan, strategy_index

if TYPE_CHECKING:
    from .graph.opgraph import OpGraph
    from .plan import Plan
    from .pricing.layers import LayerCost
    from .solve.intra import StrategyCache


class Alternative(NamedTuple):
    """One strategy an operator could have instead: its name, its (first) output spec, and the step-time change."""

    strategy: str
    spec: str
    delta_s: float


def owner_stage(plan: Plan, op: int) -> int:
    """The index of the stage that runs operator ``op`` (see :meth:`Plan.stage_of`)."""
    return plan.stage_of(op)


def reprice(plan: Plan, intras: Sequence[IntraPlan | None], microbatches: int, pins: Mapping[int, str], *,
            specs: Sequence[StageSpec] | None = None, schedule: str | None = None,
            stage_pins: Mapping[str, Any] | None = None,
            layer_costs: Sequence[Sequence[LayerCost] | None] | None = None) -> Plan:
    """``plan`` with some of its decisions replaced (each stage's IntraPlan, the stages themselves, the microbatch
    count, the schedule, the pins), priced again by its table. Stages whose IntraPlan is unchanged reuse their
    layer costs."""
    if specs is None:
        specs = [StageSpec(st.layers, st.submesh, st.logical_mesh, st.remat) for st in plan.stages]
    if layer_costs is None:
        before = {id(st.intra): st.layer_costs for st in plan.stages if st.intra is not None}
        layer_costs = [before.get(id(intra)) for intra in intras]
    return price_plan(table_of(plan), specs, intras=intras, layer_costs=layer_costs, microbatches=microbatches,
                      schedule=schedule or plan.schedule, stage_comm=plan.stage_comm,
                      mem_limit_bytes=plan.cost.mem_limit_bytes, method=plan.method, solve_s=plan.solve_s,
                      notes=plan.notes, pins=pins, stage_pins=plan.stage_pins if stage_pins is None else stage_pins)


# --------------------------------------------------------------------------------------------------------------
# Operator overrides


def resolve_strategy(graph: OpGraph, op: int, strategy, strats: Sequence[Strategy]) -> Strategy:
    """``strategy`` (a Strategy, its name, or an output spec string) among ``strats``; a ValueError naming the
    operator and its valid choices otherwise. An output spec several strategies share picks the cheapest of them."""
    node = graph.op(op)
    if isinstance(strategy, Strategy):
        return strats[strategy_index(strategy, strats, node)]
    text = str(strategy)
    for s in strats:
        if s.name == text:
            return s
    same = [s for s in strats if s.out_specs and str(s.out_specs[0]) == text]
    if same:
        return min(same, key=lambda s: s.cost)
    strategy_index(text, strats, node)  # raises the ValueError with the valid choices
    raise AssertionError("unreachable")


def _stage_choice(plan: Plan, op: int, strategy):
    table_of(plan)
    k = plan.stage_of(op)
    intra = plan.stages[k].intra
    if intra is None or op not in intra.strategies:
        raise ValueError(f"operator {op} has no strategy in stage {k} of this plan")
    g = plan.op_graph
    cache = table_of(plan).strategy_cache(intra.mesh)
    strats = cache.strategies(g.op(op))
    return k, intra, g, cache, resolve_strategy(g, op, strategy, strats)


def _with_strategy(plan: Plan, k: int, intra: IntraPlan, g: OpGraph, cache: StrategyCache, op: int,
                   s: Strategy) -> Plan:
    chosen = dict(intra.strategies)
    chosen[op] = s
    new = LazyIntraPlan(g, intra.mesh, chosen, intra.ops, cache, intra.groups, intra.solve_s)
    st = plan.stages[k]
    table = table_of(plan)
    old_costs = st.layer_costs if st.layer_costs is not None else table.layer_costs_of(intra)
    # Only the layers the change reaches are priced again.
    costs: list[Sequence[LayerCost] | None] = [other.layer_costs for other in plan.stages]
    costs[k] = changed_layer_costs(table, intra, new, op, old_costs, cache)
    intras = [other.intra for other in plan.stages]
    intras[k] = new
    return reprice(plan, intras, plan.microbatches, {**plan.pins, op: s.name}, layer_costs=costs)


def with_choice(plan: Plan, op: int, strategy) -> Plan:
    """A new plan with operator ``op`` run by ``strategy``; the original is left as it was."""
    op = checks.op_id(op)
    k, intra, g, cache, s = _stage_choice(plan, op, strategy)
    return _with_strategy(plan, k, intra, g, cache, op, s)


def with_microbatches(plan: Plan, n: int) -> Plan:
    """A new plan with ``n`` microbatches: same stages and strategies, stages re-priced, pipeline re-simulated."""
    table = table_of(plan)
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"microbatches must be a positive integer dividing the batch size {table.batch_size}, "
                         f"got {n!r}")
    planner.microbatch_choices(table.batch_size, n)
    return reprice(plan, [st.intra for st in plan.stages], n, plan.pins,
                   stage_pins={**plan.stage_pins, "microbatches": n})


def alternatives(plan: Plan, op: int) -> list[Alternative]:
    """Every strategy of ``op`` on its stage's mesh with the step-time change it would bring, best first."""
    k, intra, g, cache, _ = _stage_choice(plan, op, plan.choice(op).name)
    base = plan.cost.step_time_s
    out = []
    for s in cache.strategies(g.op(op)):
        p = _with_strategy(plan, k, intra, g, cache, op, s)
        spec = str(s.out_specs[0]) if s.out_specs else ""
        out.append(Alternative(s.name, spec, p.cost.step_time_s - base))
    out.sort(key=lambda a: (a.delta_s, a.strategy))
    return out


def intra_name(plan: Plan, op: int) -> str:
    return plan.choice(op).name


def diff(plan: Plan, other: Plan) -> dict:
    """What changed from ``plan`` to ``other``.

    ``ops``: [{op, before, after}] operators whose strategy differs (strategy names); ``stages``: [{stage, field,
    before, after}] per-stage differences (layers, submesh, logical_mesh, remat, devices, or the stage itself added or
    removed); ``microbatches``: (before, after) or None; ``step_time_delta_s``: other's step time minus this one's.
    """
    ops = []
    g = plan.op_graph
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
            stages.append({"stage": k, "field": "stage", "before": k < len(plan.stages),
                           "after": k < len(other.stages)})
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
    stage_pins = {k: (plan.stage_pins.get(k), other.stage_pins.get(k))
                  for k in set(plan.stage_pins) | set(other.stage_pins)
                  if plan.stage_pins.get(k) != other.stage_pins.get(k)}
    return {
        "ops": ops,
        "stages": stages,
        "microbatches": None if plan.microbatches == other.microbatches else (plan.microbatches, other.microbatches),
        "schedule": None if plan.schedule == other.schedule else (plan.schedule, other.schedule),
        "pins": pins,
        "stage_pins": stage_pins,
        "step_time_before_s": plan.cost.step_time_s,
        "step_time_after_s": other.cost.step_time_s,
        "step_time_delta_s": other.cost.step_time_s - plan.cost.step_time_s,
    }


# --------------------------------------------------------------------------------------------------------------
# Stage overrides: schedule, remat, stages


def with_schedule(plan: Plan, schedule: str, virtual_stages: int | None = None) -> Plan:
    """A new plan run with pipeline ``schedule``, pinned; stages and strategies kept, re-priced.

    ``schedule``: "gpipe", "1f1b", "interleaved" (``virtual_stages`` model chunks per stage, default 2: each
    stage's layer count is kept and its layers become chunks, see :func:`~autopar_lab.schedules.interleave`) or
    "zb-h1" (each backward split into its input-gradient and weight-gradient tasks). The chunk count is pinned
    with the schedule."""
    schedule, v = check_schedule(schedule, virtual_stages)
    pins = {key: val for key, val in plan.stage_pins.items() if key != "virtual_stages"}
    pins["schedule"] = schedule
    if schedule == "interleaved":
        pins["virtual_stages"] = v
    return reprice(plan, [st.intra for st in plan.stages], plan.microbatches, plan.pins, schedule=schedule,
                   stage_pins=pins)


def _stage_index(plan: Plan, stage) -> int:
    S = len(plan.stages)
    if isinstance(stage, bool) or not isinstance(stage, int) or not -S <= stage < S:
        raise ValueError(f"stage must be a stage index 0..{S - 1} of this {S}-stage plan, got {stage!r}")
    return stage % S


def with_remat(plan: Plan, stage: int, on: bool = True) -> Plan:
    """A new plan with stage ``stage``'s rematerialisation ``on`` (or off), pinned.

    The stage-cost formula prices remat as: only the stage's input activations are held (its entry cut's bytes per
    microbatch, sharded over the stage's devices) and the backward pass runs the forward pass again."""
    k = _stage_index(plan, checks.stage_index(plan, stage))
    if not isinstance(on, bool):
        raise ValueError(f"on must be True or False, got {on!r}")
    specs = [StageSpec(st.layers, st.submesh, st.logical_mesh, st.remat) for st in plan.stages]
    specs[k] = specs[k]._replace(remat=on)
    remat = list(plan.stage_pins.get("remat") or [None] * len(specs))
    remat[k] = on
    return reprice(plan, [st.intra for st in plan.stages], plan.microbatches, plan.pins, specs=specs,
                   stage_pins={**plan.stage_pins, "remat": tuple(remat)})


def _per_stage(values, S: int, what: str) -> list:
    items = list(values)
    if len(items) != S:
        raise ValueError(f"{what} needs one entry per stage ({S}), got {len(items)}")
    return items


def with_stages(plan: Plan, boundaries=None, submeshes=None, logical_meshes=None, microbatches=None) -> Plan:
    """A new plan with the stages changed (see :meth:`autopar_lab.plan.Plan.with_stages`).

    What is given is checked (ranges cover the layers in order, submeshes tile the cluster in order, each logical
    mesh is a view of its submesh) and pinned. What is not: with the same stage count, each stage keeps its
    submesh, its logical mesh (if its submesh is unchanged) and its remat; otherwise the stage DP picks them from
    the plan's cost table with everything given held fixed. A stage whose layers and mesh are unchanged keeps its
    IntraPlan; a changed one takes the table's IntraPlan of its mesh with its operator pins applied.
    """
    table, cluster = table_of(plan), plan.cluster
    L = len(table.layer_names)
    old = plan.stages
    ranges = [st.layers for st in old] if boundaries is None else stage_ranges(boundaries, L)
    S = len(ranges)
    same = S == len(old)
    B = plan.microbatches
    if microbatches is not None:
        if isinstance(microbatches, bool) or not isinstance(microbatches, int):
            raise ValueError(f"microbatches must be a positive integer dividing the batch size {table.batch_size}, "
                             f"got {microbatches!r}")
        planner.microbatch_choices(table.batch_size, microbatches)
        B = microbatches
    if submeshes is not None:
        subs: list[tuple[int, int] | None] = list(check_submeshes(cluster, _per_stage(submeshes, S, "submeshes")))
    else:
        subs = [st.submesh for st in old] if same else [None] * S
    shapes: list[tuple[int, int] | None]
    remat: list[bool | None]
    if logical_meshes is not None:
        shapes = []
        for j, v in enumerate(_per_stage(logical_meshes, S, "logical_meshes")):
            if v is None:
                shapes.append(None)
                continue
            v = pair(v, f"stage {j}'s logical mesh")
            sub = subs[j]
            if sub is not None:
                views = cluster.logical_mesh_shapes(sub)
                if v not in views:
                    raise ValueError(f"stage {j}'s logical mesh {v} is not a view of its {sub} submesh "
                                     f"({sub[0] * sub[1]} devices); use one of {views}.")
            shapes.append(v)
    else:
        shapes = [None] * S
    for j in range(S):
        if shapes[j] is None and same and subs[j] == old[j].submesh:
            shapes[j] = old[j].logical_mesh
    remat = [st.remat for st in old] if same else [None] * S
    # Pins recorded: what this call gave, plus earlier per-stage pins while the stage count stays.
    sp = {k: v for k, v in plan.stage_pins.items()
          if k not in ("submeshes", "logical_meshes", "remat") or same}
    if boundaries is not None:
        sp["boundaries"] = tuple(r[0] for r in ranges[1:])
    if submeshes is not None:
        sp["submeshes"] = tuple(subs)
    if logical_meshes is not None:
        sp["logical_meshes"] = tuple(None if v is None else pair(v, "") for v in logical_meshes)
    elif "logical_meshes" in sp:
        # A logical mesh pinned on a stage whose submesh changes no longer describes it: that pin is dropped.
        sp["logical_meshes"] = tuple(v if subs[j] == old[j].submesh else None
                                     for j, v in enumerate(sp["logical_meshes"]))
        if all(v is None for v in sp["logical_meshes"]):
            del sp["logical_meshes"]
    if microbatches is not None:
        sp["microbatches"] = B
    pins = PinIndex(plan)
    if any(x is None for x in subs + shapes + remat):
        # Let the DP choose what is free, everything else held (the pinned cuts make it a small problem).
        con = StageConstraints(cuts=tuple(r[0] for r in ranges[1:]), submeshes=tuple(subs),
                               logical_meshes=tuple(shapes), remat=tuple(remat))
        try:
            res = solve_fixed_cuts(plan, ranges, con, B, plan.cost.mem_limit_bytes, pins)
        except NoFeasiblePlanError as e:
            if e.min_mem_bytes == float("inf"):
                raise ValueError(f"no stage layout keeps the stages asked for: {e}") from None
            # An override may exceed memory (the plan shows it); pick the fastest layout regardless.
            res = solve_fixed_cuts(plan, ranges, con, B, float("inf"), pins)
        subs = [c.submesh for c in res.stages]
        shapes = [c.logical_mesh for c in res.stages]
        remat = [c.remat for c in res.stages]
    specs, intras = [], []
    for j, (rng, sub, shape, r) in enumerate(zip(ranges, subs, shapes, remat)):
        assert sub is not None and shape is not None  # every stage decided: given, kept or by the DP
        specs.append(StageSpec(tuple(rng), tuple(sub), tuple(shape), bool(r)))
        if same and (old[j].layers, old[j].submesh, old[j].logical_mesh) == (tuple(rng), tuple(sub), tuple(shape)):
            intras.append(old[j].intra)  # unchanged: keep its strategies (and its pins' effects) as they are
        else:
            intras.append(pinned_intra(pins, table, rng, sub, shape, j))
    return reprice(plan, intras, B, plan.pins, specs=specs, stage_pins=sp)
