"""Overrides of a plan, re-estimated: plans are values, so each override returns a new :class:`~autopar_lab.plan.Plan`.

How an override is re-priced (by :func:`~autopar_lab.pricing.price.price_stages`, the function the planner's own plans
go through, so an unchanged plan prices to the same bits):

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
(operator of ``plan.graph`` -> :class:`~autopar_lab.planvalues.Pin`: a name and a scope, see
:mod:`autopar_lab.operators`), stage decisions in ``Plan.stage_pins`` (:func:`with_stages`: boundaries, submeshes,
logical meshes, microbatches; :func:`with_remat`; :func:`with_schedule`; :func:`with_microbatches`).
:func:`~autopar_lab.pins.resolve` re-solves everything else around them.

>>> q = plan.with_stages(boundaries=[12], submeshes=[(1, 4), (1, 4)]).with_remat(0)   # doctest: +SKIP
>>> q.stage_pins                                                                      # doctest: +SKIP
{'boundaries': (12,), 'submeshes': ((1, 4), (1, 4)), 'remat': (True, None)}
>>> al.resolve(q.with_choice(op, "S0R"))        # the DP and the ILP around every pin  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

from . import checks, operators, stagesearch
from .pins import (  # noqa: F401 - stage_ranges, check_submeshes and resolve were first offered here
    PinIndex,
    check_submeshes,
    pair,
    pinned_intra,
    resolve,
    solve_fixed_cuts,
    stage_ranges,
    stage_runs,
)
from .planvalues import LAYER, SHARED, Pin, layer_scoped
from .pricing import LazyIntraPlan, changed_layer_costs, price_stages
from .pricing.price import StageSpec, table_of
from .rematmode import remat_value
from .schedules import check_schedule, schedule_of
from .sharding.experts import expert_matmuls
from .sharding.strategies import Strategy
from .solve.inter import NoFeasiblePlanError, StageConstraints
from .solve.intra import IntraPlan, strategy_index

if TYPE_CHECKING:
    from .graph.opgraph import OpGraph, OpNode
    from .plan import Plan
    from .pricing.layers import LayerCost
    from .solve.intra import StrategyCache


class Alternative(NamedTuple):
    """One strategy an operator could have instead: its name, its (first) output spec, and the step-time change."""

    strategy: str
    spec: str
    delta_s: float


def reprice(plan: Plan, intras: Sequence[IntraPlan | None], microbatches: int, pins: Mapping[int, Pin], *,
            specs: Sequence[StageSpec] | None = None, schedule: str | None = None,
            stage_pins: Mapping[str, Any] | None = None,
            layer_costs: Sequence[Sequence[LayerCost] | None] | None = None,
            solutions: Sequence[str] | None = None) -> Plan:
    """``plan`` with some of its decisions replaced (each stage's IntraPlan, the stages themselves, the microbatch
    count, the schedule, the pins), priced again by its table. Stages whose IntraPlan is unchanged reuse their layer
    costs; a layer with pins of its own is priced on its own. ``solutions``: each stage's mesh solution (default:
    the plan's stages')."""
    if specs is None:
        specs = [StageSpec(st.layers, st.submesh, st.logical_mesh, st.remat) for st in plan.stages]
    if solutions is None:
        solutions = [st.solution for st in plan.stages] if len(specs) == len(plan.stages) else None
    if layer_costs is None:
        before = {id(st.intra): st.layer_costs for st in plan.stages if st.intra is not None}
        layer_costs = [before.get(id(intra)) for intra in intras]
    # The plan's chunk count stays with its schedule, pinned or not (a schedule given takes its pinned or default one).
    keep_v = plan.virtual_stages if schedule is None and plan.virtual_stages > 1 else None
    stage_pins = plan.stage_pins if stage_pins is None else stage_pins
    schedule, v = schedule_of(schedule or plan.schedule, keep_v, stage_pins)  # else a pinned count, else 2
    priced = price_stages(table_of(plan), specs, intras=intras, layer_costs=layer_costs, microbatches=microbatches,
                          schedule=schedule, virtual_stages=v, solutions=solutions,
                          mem_limit_bytes=plan.cost.mem_limit_bytes, layer_pins=layer_scoped(pins),
                          zero=stage_pins.get("zero"), overlap=stage_pins.get("overlap"),
                          host=stage_pins.get("host"), accumulate=stage_pins.get("accumulate"),
                          eager_loss=stage_pins.get("eager_loss"),
                          microbatch_group=stage_pins.get("microbatch_group"))
    return priced.onto(plan, microbatches=microbatches, pins=dict(pins), stage_pins=dict(stage_pins))


# --------------------------------------------------------------------------------------------------------------
# Operator overrides: an operator of plan.graph, in every layer sharing its solution or in its layer alone


def resolve_strategy(node: OpNode, strategy, strats: Sequence[Strategy]) -> Strategy:
    """``strategy`` (a Strategy, its name, or an output spec string) among ``strats``, the strategies of operator
    ``node``; a ValueError naming the operator and its valid choices otherwise. An output spec several strategies
    share picks the cheapest of them."""
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


def _mesh_of(plan: Plan, k: int):
    """Stage ``k``'s logical mesh, as its IntraPlan holds it."""
    intra = plan.stages[k].intra
    if intra is None:
        raise ValueError(f"stage {k} of this plan has no per-operator strategies to change")
    return intra.mesh


def _named(cache: StrategyCache, g: OpGraph, op: int, name: str) -> Strategy | None:
    hit = [s for s in cache.strategies(g.op(op)) if s.name == name]
    return hit[0] if hit else None


class _Group(NamedTuple):
    """Where a change of an operator's shared solution lands: the operator (of plan.graph), its stand-in's
    representative in the graph the plan was solved on (whose strategy lists are asked), the stand-in's siblings
    there (which take the strategy with it) and the stages that run a layer sharing the solution."""

    op: int
    rep: int
    siblings: list[int]
    stages: list[int]


def _group(plan: Plan, op: int) -> _Group:
    m = operators.op_map(plan)
    rep = m.representative(operators.stand_in(plan, op))
    stages = operators.stages_of(plan, op)
    for k in stages:
        intra = plan.stages[k].intra
        if intra is None or rep not in intra.strategies:
            raise ValueError(f"operator {op} has no strategy in stage {k} of this plan")
    return _Group(op, rep, m.siblings(rep), stages)


def _group_strategy(plan: Plan, grp: _Group, strategy) -> Strategy:
    """``strategy`` resolved on the first stage of the group, checked to exist (by name) on every other one."""
    g, table, node = plan.op_graph, table_of(plan), plan.graph.op(grp.op)
    first = _mesh_of(plan, grp.stages[0])
    s = resolve_strategy(node, strategy, table.strategy_cache(first).strategies(g.op(grp.rep)))
    for k in grp.stages[1:]:
        mesh = _mesh_of(plan, k)
        if _named(table.strategy_cache(mesh), g, grp.rep, s.name) is None:
            raise ValueError(f"strategy {s.name!r} of operator {node.describe()} is not one of its strategies on "
                             f"stage {k}'s {mesh.shape[0]}x{mesh.shape[1]} logical mesh, which runs layers that share "
                             "its solution; choose a strategy every such stage has.")
    return s


def _frozen_split_layers(plan: Plan, grp: _Group, name: str) -> dict[int, Pin]:
    """Pins that keep each split layer sharing ``grp``'s solution as it is when the solution's strategy there changes
    to ``name``: a split layer has its own strategies from its split on."""
    split = operators.split_layers(plan)
    if not split:
        return {}
    m = operators.op_map(plan)
    out = {}
    for k in m.full_layers_of(grp.rep):
        full = m.full_op_in(grp.rep, k) if k in split else None
        if full is None or (full in plan.pins and plan.pins[full].scope == LAYER):
            continue
        old = operators.choice(plan, full).name
        if old != name:
            out[full] = Pin(old, LAYER)
    return out


def _with_group_strategy(plan: Plan, grp: _Group, s: Strategy) -> Plan:
    """``plan`` with ``grp``'s solution running ``s`` (by name, on each stage's mesh), each stage re-priced only in
    the layers the change reaches, and the shared pin recorded."""
    g, table = plan.op_graph, table_of(plan)
    intras = [other.intra for other in plan.stages]
    costs: list[Sequence[LayerCost] | None] = [other.layer_costs for other in plan.stages]
    for k in grp.stages:
        intra = plan.stages[k].intra
        assert intra is not None  # checked by _group
        cache = table.strategy_cache(intra.mesh)
        chosen = dict(intra.strategies)
        for op in grp.siblings:
            hit = _named(cache, g, op, s.name) if op in chosen else None
            if hit is None:
                raise ValueError(f"an operator sharing the solution of {plan.graph.op(grp.op).describe()} has no "
                                 f"strategy {s.name!r} on stage {k}'s mesh")
            chosen[op] = hit
        new = LazyIntraPlan.with_strategies(g, intra.mesh, chosen, intra.ops, cache, intra.groups, intra.solve_s)
        st = plan.stages[k]
        old_costs = st.layer_costs if st.layer_costs is not None else table.layer_costs_of(intra)
        # Only the layers the change reaches are priced again.
        costs[k] = changed_layer_costs(table, intra, new, grp.siblings, old_costs, cache)
        intras[k] = new
    pins = operators.pins_with(plan, grp.op, Pin(s.name, SHARED),
                               {**plan.pins, **_frozen_split_layers(plan, grp, s.name)})
    return reprice(plan, intras, plan.microbatches, pins, layer_costs=costs)


def _layer_strategies(plan: Plan, op: int) -> list[Strategy]:
    """The strategies operator ``op`` may run in its layer alone: its stand-in's on the mesh of its layer's stage."""
    k = operators.stage_of(plan, op)
    sop = operators.stand_in(plan, op)
    intra = plan.stages[k].intra
    if intra is None or sop not in intra.strategies:
        raise ValueError(f"operator {op} has no strategy in stage {k} of this plan")
    return table_of(plan).strategy_cache(intra.mesh).strategies(plan.op_graph.op(sop))


def _alone(plan: Plan, op: int, scope: str) -> bool:
    """Whether an override of ``op`` with ``scope`` splits its layer from others (``"layer"`` on a shared layer)."""
    return operators.check_scope(scope) == LAYER and operators.shares_solution(plan, op)


def with_choice(plan: Plan, op: int, strategy, scope: str = SHARED) -> Plan:
    """A new plan with operator ``op`` of ``plan.graph`` run by ``strategy``, pinned; the original is left as it was
    (see :meth:`Plan.with_choice` and :mod:`autopar_lab.operators`).

    ``scope="shared"``: ``op``'s stand-in in the graph the plan was solved on and its siblings there take the
    strategy on every stage that runs a layer sharing the solution (a layer split from them keeps its own strategy:
    pinned in its layer from then on). ``scope="layer"``: ``op``'s layer alone, priced on its own
    (:func:`~autopar_lab.pricing.incremental.split_layer_costs`)."""
    op = operators.check_op(plan, op)
    table_of(plan)
    if _alone(plan, op, scope):
        s = resolve_strategy(plan.graph.op(op), strategy, _layer_strategies(plan, op))
        return reprice(plan, [st.intra for st in plan.stages], plan.microbatches,
                       operators.pins_with(plan, op, Pin(s.name, LAYER)))
    grp = _group(plan, op)
    return _with_group_strategy(plan, grp, _group_strategy(plan, grp, strategy))


def alternatives(plan: Plan, op: int, scope: str = SHARED) -> list[Alternative]:
    """Every strategy of operator ``op`` with the step-time change :func:`with_choice` with that strategy and
    ``scope`` brings (``with_choice(plan, op, s, scope).cost.step_time_s - plan.cost.step_time_s``, exactly), best
    first. A shared change offers only the strategies every stage running a layer sharing the solution has."""
    op = operators.check_op(plan, op)
    table_of(plan)
    base = plan.cost.step_time_s
    out = []
    if _alone(plan, op, scope):
        intras = [st.intra for st in plan.stages]
        for s in _layer_strategies(plan, op):
            p = reprice(plan, intras, plan.microbatches, operators.pins_with(plan, op, Pin(s.name, LAYER)))
            out.append(Alternative(s.name, str(s.out_specs[0]) if s.out_specs else "", p.cost.step_time_s - base))
    else:
        grp = _group(plan, op)
        g, table = plan.op_graph, table_of(plan)
        meshes = [_mesh_of(plan, k) for k in grp.stages]
        for s in table.strategy_cache(meshes[0]).strategies(g.op(grp.rep)):
            if any(_named(table.strategy_cache(mesh), g, grp.rep, s.name) is None for mesh in meshes[1:]):
                continue  # not a strategy of every stage the change would reach
            p = _with_group_strategy(plan, grp, s)
            out.append(Alternative(s.name, str(s.out_specs[0]) if s.out_specs else "", p.cost.step_time_s - base))
    out.sort(key=lambda a: (a.delta_s, a.strategy))
    return out


def without_pin(plan: Plan, op: int, scope: str | None = None) -> Plan:
    """A new plan without the pin that holds operator ``op`` (see :meth:`Plan.without_pin`)."""
    op = operators.check_op(plan, op)
    if scope is not None:
        operators.check_scope(scope)
    own = plan.pins.get(op)
    if scope != SHARED and own is not None and own.scope == LAYER:
        rest = {k: p for k, p in plan.pins.items() if k != op}
        return reprice(plan, [st.intra for st in plan.stages], plan.microbatches,
                       operators.normalised_pins(plan, rest))
    key = operators.shared_pin_key(plan, op, plan.pins) if scope != LAYER else None
    if key is not None:
        return dataclasses.replace(plan, pins={k: p for k, p in plan.pins.items() if k != key})
    kind = {None: "", SHARED: " for the layers sharing its solution", LAYER: " in its layer"}[scope]
    raise ValueError(f"operator {op} is not pinned{kind}; pinned operators: {sorted(plan.pins)}")


def with_microbatches(plan: Plan, n: int) -> Plan:
    """A new plan with ``n`` microbatches: same stages and strategies, stages re-priced, pipeline re-simulated."""
    table = table_of(plan)
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"microbatches must be a positive integer dividing the batch size {table.batch_size}, "
                         f"got {n!r}")
    stagesearch.microbatch_choices(table.batch_size, n)
    return reprice(plan, [st.intra for st in plan.stages], n, plan.pins,
                   stage_pins={**plan.stage_pins, "microbatches": n})


def diff(plan: Plan, other: Plan) -> dict:
    """What changed from ``plan`` to ``other``.

    ``ops``: [{op, before, after}] operators of ``plan.graph`` whose strategy differs (strategy names); ``stages``:
    [{stage, field, before, after}] per-stage differences (layers, submesh, logical_mesh, remat, devices, or the
    stage itself added or removed); ``microbatches``: (before, after) or None; ``pins``, ``stage_pins``: {key:
    (before, after)} of the pins that differ; ``step_time_delta_s``: other's step time minus this one's.
    """
    def strategy(p: Plan, op: int) -> str | None:
        try:
            return operators.choice(p, op).name
        except (KeyError, ValueError):
            return None

    ops = []
    for op in plan.graph.ops:
        a, b = strategy(plan, op), strategy(other, op)
        if a != b:
            ops.append({"op": op, "before": a, "after": b})
    stages = []
    for k in range(max(len(plan.stages), len(other.stages))):
        if k >= len(plan.stages) or k >= len(other.stages):
            stages.append({"stage": k, "field": "stage", "before": k < len(plan.stages),
                           "after": k < len(other.stages)})
            continue
        sa, sb = plan.stages[k], other.stages[k]
        for f in ("layers", "submesh", "logical_mesh", "remat", "devices", "fwd_s", "bwd_s", "peak_mem_bytes"):
            if getattr(sa, f) != getattr(sb, f):
                stages.append({"stage": k, "field": f, "before": getattr(sa, f), "after": getattr(sb, f)})

    def changed(a: Mapping, b: Mapping) -> dict:
        return {key: (a.get(key), b.get(key)) for key in set(a) | set(b) if a.get(key) != b.get(key)}

    return {
        "ops": ops,
        "stages": stages,
        "microbatches": None if plan.microbatches == other.microbatches else (plan.microbatches, other.microbatches),
        "schedule": None if plan.schedule == other.schedule else (plan.schedule, other.schedule),
        "pins": changed(plan.pins, other.pins),
        "stage_pins": changed(plan.stage_pins, other.stage_pins),
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


def with_remat(plan: Plan, stage: int, on: bool | str = True) -> Plan:
    """A new plan with stage ``stage``'s rematerialisation ``on`` (True or "full"), off (False or "none") or
    ``"selective"``, pinned.

    The stage-cost formula prices full remat as: only the stage's layer inputs are held and the backward pass runs
    the forward pass again; selective: every activation but the attention internals is held and the backward runs
    their forward again (:func:`~autopar_lab.pricing.stage.stage_cost`)."""
    k = _stage_index(plan, checks.stage_index(plan, stage))
    on = remat_value(on, "on")
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


def _submesh_shape(cluster, value, j: int) -> tuple[int, int]:
    """Stage ``j``'s submesh ``value`` checked to be a submesh shape of ``cluster`` (where it sits is the DP's)."""
    sh = pair(value, f"stage {j}'s submesh")
    valid = [tuple(s) for s in cluster.submesh_shapes()]
    if sh not in valid:
        raise ValueError(f"stage {j}'s submesh {sh} is not a submesh shape of this cluster ({cluster.hosts} x "
                         f"{cluster.devices_per_host} devices); use one of {valid}.")
    return sh


def with_stages(plan: Plan, boundaries=None, submeshes=None, logical_meshes=None, microbatches=None) -> Plan:
    """A new plan with the stages changed (see :meth:`autopar_lab.plan.Plan.with_stages`).

    What is given is checked (ranges cover the layers in order, submeshes tile the cluster in order, each logical
    mesh is a view of its submesh) and pinned; a ``None`` submesh or logical mesh is left to the DP (submeshes
    given beside one are checked to be submesh shapes, the DP places them). What is not: with the same stage count,
    each stage keeps its submesh, its logical mesh (if its submesh is unchanged) and its remat; otherwise the stage
    DP picks them from the plan's cost table with everything given held fixed. A stage whose layers and mesh are
    unchanged keeps its IntraPlan; a changed one takes the table's IntraPlan of its mesh with its operator pins
    applied.
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
        stagesearch.microbatch_choices(table.batch_size, microbatches)
        B = microbatches
    subs: list[tuple[int, int] | None]
    if submeshes is not None:
        given = _per_stage(submeshes, S, "submeshes")
        if any(x is None for x in given):  # the DP picks these, holding the others (they tile with its choice)
            subs = [None if x is None else _submesh_shape(cluster, x, j) for j, x in enumerate(given)]
        else:
            subs = list(check_submeshes(cluster, given))
    else:
        subs = [st.submesh for st in old] if same else [None] * S
    shapes: list[tuple[int, int] | None]
    remat: list[bool | str | None]
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
    # Each stage's mesh solution: kept with the stage, else the DP's choice, else the fast one.
    sols = [st.solution for st in old] if same else ["fast"] * S
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
        sols = [c.solution for c in res.stages]
    specs, intras = [], []
    # The layers each stage runs (an interleaved stage: its chunks, which move when any stage's count does).
    runs = stage_runs(ranges, plan.virtual_stages if plan.schedule == "interleaved" else 1)
    for j, (rng, sub, shape, r) in enumerate(zip(ranges, subs, shapes, remat)):
        assert sub is not None and shape is not None and r is not None  # every stage decided: given, kept or by the DP
        specs.append(StageSpec(tuple(rng), tuple(sub), tuple(shape), remat_value(r)))
        was = old[j].intra if same else None
        if was is not None and (old[j].layers, old[j].submesh, old[j].logical_mesh) == \
                (tuple(rng), tuple(sub), tuple(shape)) and pins.honoured_by(was, runs[j]):
            intras.append(was)  # unchanged: keep its strategies (and its pins' effects) as they are
        else:
            if sols[j] not in table.solutions(sub, shape):  # a mesh given anew: its lean solution not solved
                sols[j] = "fast"
            intras.append(pinned_intra(pins, table, runs[j], sub, shape, j, sols[j]))
    return reprice(plan, intras, B, plan.pins, specs=specs, stage_pins=sp, solutions=sols)


def with_expert_parallel(plan: Plan, axes: tuple[int, ...] = (), resolve: bool = True) -> Plan:  # noqa: F811
    """``plan`` with the experts of every MoE layer split over mesh ``axes`` (``()``: every expert on every device,
    EP=1; ``(0,)``: over the first mesh axis). Each forward expert matmul is pinned (``plan.with_choice``) to its
    cheapest strategy whose expert dimension is split over exactly those axes (in every layer sharing its solution).
    With ``resolve`` (the default) the stages keep their layers, meshes and microbatch count (pinned) and the
    intra-op ILP re-solves every other operator around the pins (:func:`autopar_lab.resolve`), so the dispatch, the
    combine, the backward and the stored expert weights follow; without, everything else is kept as it was (only the
    reshardings around the pins re-priced: a half-changed layer that moves its tokens back and forth). An axis of one
    device counts as not splitting.

    >>> replicated = with_expert_parallel(plan, ())                          # doctest: +SKIP
    >>> al.parallelism.expert_degree(replicated), replicated.cost.step_time_s > plan.cost.step_time_s   # doctest: +SKIP
    (1, True)
    """
    if not isinstance(axes, (tuple, list)) or not all(a in (0, 1) for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"axes must be a tuple of distinct mesh axes (0 and/or 1; () for replicated experts), got "
                         f"{axes!r}")
    from .pins import resolve as resolve_pins  # the keyword ``resolve`` hides the module-level name here

    g = plan.op_graph
    mats = expert_matmuls(g)
    if not mats:
        raise ValueError("this plan has no MoE layer (no matmul batched over the experts of a weight), so there are "
                         "no experts to split; use a mixture-of-experts model such as 'moe-tiny'.")
    if resolve:  # keep the layout: only the operators' shardings are to be re-solved
        plan = plan.with_stages(boundaries=[st.layers for st in plan.stages],
                                submeshes=[st.submesh for st in plan.stages],
                                logical_meshes=[st.logical_mesh for st in plan.stages], microbatches=plan.microbatches)
    done = set()
    for mat, (j, d, _p) in mats.items():
        op = operators.user_op(plan, mat)  # the operator of plan.graph whose shared solution runs it
        if op is None or op in done:
            continue
        done.add(op)
        k, sop = plan.stage_of(op), operators.stand_in(plan, op)
        intra = plan.stages[k].intra
        if intra is None or sop not in intra.strategies:
            continue
        mshape = tuple(int(x) for x in intra.mesh.shape)
        want = sorted(a for a in axes if mshape[a] > 1)
        cands = [s for s in table_of(plan).strategy_cache(intra.mesh).strategies(g.op(sop))
                 if sorted(a for a in s.in_specs[j].dims[d] if mshape[a] > 1) == want]
        if not cands:
            n = g.op(sop).in_shapes[j][d]
            raise ValueError(f"the {n} experts of {plan.graph.op(op).describe()} cannot be split over mesh axes "
                             f"{tuple(axes)} of the {mshape[0]}x{mshape[1]} mesh of stage {k} (the device count "
                             "must divide the expert count); choose other axes or () for replicated experts.")
        plan = plan.with_choice(op, min(cands, key=lambda s: s.cost).name)
    return resolve_pins(plan) if resolve else plan
