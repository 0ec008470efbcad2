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
from .layergroups import stage_of_layer
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
from .pricing import LazyIntraPlan, changed_layer_costs, price_plan
from .pricing.price import StageSpec, table_of
from .rematmode import remat_value
from .schedules import check_schedule
from .sharding.experts import expert_matmuls
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
            layer_costs: Sequence[Sequence[LayerCost] | None] | None = None,
            layer_pins: Mapping[int, str] | None = None, solutions: Sequence[str] | None = None) -> Plan:
    """``plan`` with some of its decisions replaced (each stage's IntraPlan, the stages themselves, the microbatch
    count, the schedule, the pins, the split layers' pins), priced again by its table. Stages whose IntraPlan is
    unchanged reuse their layer costs. ``solutions``: each stage's mesh solution (default: the plan's stages')."""
    if specs is None:
        specs = [StageSpec(st.layers, st.submesh, st.logical_mesh, st.remat) for st in plan.stages]
    if solutions is None:
        solutions = [st.solution for st in plan.stages] if len(specs) == len(plan.stages) else None
    if layer_costs is None:
        before = {id(st.intra): st.layer_costs for st in plan.stages if st.intra is not None}
        layer_costs = [before.get(id(intra)) for intra in intras]
    # The plan's chunk count stays with its schedule, pinned or not (a schedule given takes its pinned or default one).
    keep_v = plan.virtual_stages if schedule is None and plan.virtual_stages > 1 else None
    return price_plan(table_of(plan), specs, intras=intras, layer_costs=layer_costs, microbatches=microbatches,
                      schedule=schedule or plan.schedule, virtual_stages=keep_v, solutions=solutions,
                      stage_comm=plan.stage_comm,
                      mem_limit_bytes=plan.cost.mem_limit_bytes, method=plan.method, solve_s=plan.solve_s,
                      notes=plan.notes, pins=pins, stage_pins=plan.stage_pins if stage_pins is None else stage_pins,
                      layer_pins=plan.layer_pins if layer_pins is None else layer_pins)


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
    """Where a change of one operator's strategy lands: its representative (the id its pin is kept under), its
    siblings (the copy's operators that take the strategy with it), and the stages that run them."""

    rep: int
    siblings: list[int]
    stages: list[int]


def _group(plan: Plan, op: int) -> _Group:
    m = table_of(plan).op_map
    rep = m.representative(op)
    stages = plan.stages_of(rep)
    for k in stages:
        intra = plan.stages[k].intra
        if intra is None or rep not in intra.strategies:
            raise ValueError(f"operator {op} has no strategy in stage {k} of this plan")
    return _Group(rep, m.siblings(rep), stages)


def _group_strategy(plan: Plan, grp: _Group, strategy) -> Strategy:
    """``strategy`` resolved on the first stage of the group, checked to exist (by name) on every other one."""
    g, table = plan.op_graph, table_of(plan)
    first = _mesh_of(plan, grp.stages[0])
    s = resolve_strategy(g, grp.rep, strategy, table.strategy_cache(first).strategies(g.op(grp.rep)))
    for k in grp.stages[1:]:
        mesh = _mesh_of(plan, k)
        if _named(table.strategy_cache(mesh), g, grp.rep, s.name) is None:
            raise ValueError(f"strategy {s.name!r} of operator {g.op(grp.rep).describe()} is not one of its strategies "
                             f"on stage {k}'s {mesh.shape[0]}x{mesh.shape[1]} logical mesh, which runs layers that "
                             "share its solution; choose a strategy every such stage has.")
    return s


def _frozen_split_layers(plan: Plan, grp: _Group, name: str) -> dict[int, str]:
    """Layer pins that keep each split layer of the group as it is when the group's strategy of ``grp.rep``
    changes to ``name``: a split layer has its own strategies from its split on."""
    if not plan.layer_pins:
        return {}
    m = table_of(plan).op_map
    split = {m.full_layer_of(o) for o in plan.layer_pins}
    out = {}
    for k in m.full_layers_of(grp.rep):
        if k not in split:
            continue
        full = m.full_op_in(grp.rep, k)
        if full is None or full in plan.layer_pins:
            continue
        old = plan.full_choice(full).name
        if old != name:
            out[full] = old
    return out


def _with_group_strategy(plan: Plan, grp: _Group, s: Strategy) -> Plan:
    """``plan`` with ``grp``'s operators run by ``s`` (by name, on each stage's mesh), each stage re-priced only in
    the layers the change reaches; the pin is recorded under the representative (replacing pins on its siblings)."""
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
                raise ValueError(f"operator {g.op(op).describe()} (which shares {g.op(grp.rep).describe()}'s "
                                 f"solution) has no strategy {s.name!r} on stage {k}'s mesh")
            chosen[op] = hit
        new = LazyIntraPlan(g, intra.mesh, chosen, intra.ops, cache, intra.groups, intra.solve_s)
        st = plan.stages[k]
        old_costs = st.layer_costs if st.layer_costs is not None else table.layer_costs_of(intra)
        # Only the layers the change reaches are priced again.
        costs[k] = changed_layer_costs(table, intra, new, grp.siblings, old_costs, cache)
        intras[k] = new
    sibs = set(grp.siblings)
    pins = {op: name for op, name in plan.pins.items() if op not in sibs}
    pins[grp.rep] = s.name
    layer_pins = {**_frozen_split_layers(plan, grp, s.name), **plan.layer_pins}
    return reprice(plan, intras, plan.microbatches, pins, layer_costs=costs, layer_pins=layer_pins)


def with_choice(plan: Plan, op: int, strategy) -> Plan:
    """A new plan with operator ``op`` run by ``strategy``; the original is left as it was.

    On a deep model solved on a shallower copy, ``op`` stands for an operator of every layer that shares its
    solution (:meth:`~autopar_lab.pricing.OpMap.full_layers_of`): the strategy is given to ``op`` and its siblings
    in the copy (:meth:`~autopar_lab.pricing.OpMap.siblings`) on every stage that runs one of those layers, and the
    pin is recorded under the representative (:meth:`~autopar_lab.pricing.OpMap.representative`). A layer split from
    the group (:func:`with_layer_choice`) keeps its own strategy. To change one layer alone, use
    :func:`with_layer_choice`."""
    op = checks.op_id(op)
    table_of(plan)
    plan.stage_of(op)  # a ValueError naming the range when op is not in the graph
    grp = _group(plan, op)
    return _with_group_strategy(plan, grp, _group_strategy(plan, grp, strategy))


def alternatives(plan: Plan, op: int) -> list[Alternative]:
    """Every strategy of ``op`` (on the meshes of every stage that runs a layer sharing its solution) with the
    step-time change it would bring (``with_choice(plan, op, s).cost.step_time_s - plan.cost.step_time_s``), best
    first."""
    op = checks.op_id(op)
    table_of(plan)
    plan.stage_of(op)
    grp = _group(plan, op)
    g, table = plan.op_graph, table_of(plan)
    meshes = [_mesh_of(plan, k) for k in grp.stages]
    base = plan.cost.step_time_s
    out = []
    for s in table.strategy_cache(meshes[0]).strategies(g.op(grp.rep)):
        if any(_named(table.strategy_cache(mesh), g, grp.rep, s.name) is None for mesh in meshes[1:]):
            continue  # not a strategy of every stage the change would reach
        p = _with_group_strategy(plan, grp, s)
        spec = str(s.out_specs[0]) if s.out_specs else ""
        out.append(Alternative(s.name, spec, p.cost.step_time_s - base))
    out.sort(key=lambda a: (a.delta_s, a.strategy))
    return out


# --------------------------------------------------------------------------------------------------------------
# One layer alone: split from the layers that share its solution


def full_stage_of(plan: Plan, full_op: int) -> int:
    """The stage that runs operator ``full_op`` of the full graph (the stage of its layer; no layer: the last)."""
    full_op = checks.op_id(full_op)
    g = plan.graph
    try:
        layer = g.op(full_op).layer
    except (KeyError, IndexError):
        raise ValueError(f"operator {full_op} is not in this model's graph (ids run 0..{len(g.ops) - 1})") from None
    names = list(plan.layer_names)
    k = names.index(layer) if layer in names else len(names) - 1
    return stage_of_layer(plan, k)


def _stand_in(plan: Plan, full_op: int) -> int:
    full_op = checks.op_id(full_op)
    if plan.table is None:
        return full_op
    sop = plan.table.op_map.solve_op(full_op)
    if sop is None:
        raise ValueError(f"operator {plan.graph.op(full_op).describe()} has no counterpart in the graph this plan was "
                         "solved on, so it has no strategy of its own")
    return sop


def full_choice(plan: Plan, full_op: int) -> Strategy:
    """The strategy operator ``full_op`` of the full graph runs with (see :meth:`Plan.full_choice`)."""
    k = full_stage_of(plan, full_op)
    sop = _stand_in(plan, full_op)
    intra = plan.stages[k].intra
    if intra is None or sop not in intra.strategies:
        return plan.choice(sop)
    name = plan.layer_pins.get(int(full_op))
    if name is not None:
        hit = _named(table_of(plan).strategy_cache(intra.mesh), plan.op_graph, sop, name)
        if hit is not None:
            return hit
    return intra.strategies[sop]


def _is_shared(plan: Plan, full_op: int) -> bool:
    """Whether operator ``full_op``'s layer shares its solution with other layers (a deep model's block)."""
    if plan.table is None or plan.table.op_map.is_identity:
        return False
    m = plan.table.op_map
    return len(m.sharing(m.full_layer_of(full_op))) > 1 and plan.graph.op(int(full_op)).layer is not None


def _layer_target(plan: Plan, full_op: int, strategy) -> tuple[int, Strategy]:
    k = full_stage_of(plan, full_op)
    sop = _stand_in(plan, full_op)
    intra = plan.stages[k].intra
    if intra is None or sop not in intra.strategies:
        raise ValueError(f"operator {full_op} has no strategy in stage {k} of this plan")
    g = plan.op_graph
    strats = table_of(plan).strategy_cache(intra.mesh).strategies(g.op(sop))
    return sop, resolve_strategy(g, sop, strategy, strats)


def with_layer_choice(plan: Plan, full_op: int, strategy) -> Plan:
    """A new plan with operator ``full_op`` of the full graph run by ``strategy`` in its layer alone (see
    :meth:`Plan.with_layer_choice`): recorded in ``layer_pins`` and priced by
    :func:`~autopar_lab.pricing.incremental.split_layer_costs`."""
    full_op = checks.op_id(full_op)
    table_of(plan)
    if not _is_shared(plan, full_op):
        return with_choice(plan, _stand_in(plan, full_op), strategy)
    _, s = _layer_target(plan, full_op, strategy)
    return reprice(plan, [st.intra for st in plan.stages], plan.microbatches, plan.pins,
                   layer_pins={**plan.layer_pins, full_op: s.name})


def layer_alternatives(plan: Plan, full_op: int) -> list[Alternative]:
    """Every strategy of operator ``full_op`` of the full graph on its stage's mesh with the step-time change of
    running it in that layer alone (:func:`with_layer_choice`), best first."""
    full_op = checks.op_id(full_op)
    table_of(plan)
    if not _is_shared(plan, full_op):
        return alternatives(plan, _stand_in(plan, full_op))
    sop, _ = _layer_target(plan, full_op, full_choice(plan, full_op).name)
    mesh = _mesh_of(plan, full_stage_of(plan, full_op))
    base = plan.cost.step_time_s
    intras = [st.intra for st in plan.stages]
    out = []
    for s in table_of(plan).strategy_cache(mesh).strategies(plan.op_graph.op(sop)):
        p = reprice(plan, intras, plan.microbatches, plan.pins, layer_pins={**plan.layer_pins, full_op: s.name})
        out.append(Alternative(s.name, str(s.out_specs[0]) if s.out_specs else "", p.cost.step_time_s - base))
    out.sort(key=lambda a: (a.delta_s, a.strategy))
    return out


def without_layer_pin(plan: Plan, full_op: int) -> Plan:
    """A new plan where operator ``full_op`` of the full graph no longer has a strategy of its own: it runs its
    group's strategy again (re-priced); a layer left with no pin of its own shares its group's solution again."""
    full_op = checks.op_id(full_op)
    if full_op not in plan.layer_pins:
        raise ValueError(f"operator {full_op} has no strategy of its own in its layer; operators with one: "
                         f"{sorted(plan.layer_pins)}")
    rest = {op: name for op, name in plan.layer_pins.items() if op != full_op}
    return reprice(plan, [st.intra for st in plan.stages], plan.microbatches, plan.pins, layer_pins=rest)


def with_microbatches(plan: Plan, n: int) -> Plan:
    """A new plan with ``n`` microbatches: same stages and strategies, stages re-priced, pipeline re-simulated."""
    table = table_of(plan)
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"microbatches must be a positive integer dividing the batch size {table.batch_size}, "
                         f"got {n!r}")
    planner.microbatch_choices(table.batch_size, n)
    return reprice(plan, [st.intra for st in plan.stages], n, plan.pins,
                   stage_pins={**plan.stage_pins, "microbatches": n})


def intra_name(plan: Plan, op: int) -> str:
    return plan.choice(op).name


def diff(plan: Plan, other: Plan) -> dict:
    """What changed from ``plan`` to ``other``.

    ``ops``: [{op, before, after}] operators whose strategy differs (strategy names); ``stages``: [{stage, field,
    before, after}] per-stage differences (layers, submesh, logical_mesh, remat, devices, or the stage itself added or
    removed); ``microbatches``: (before, after) or None; ``pins``, ``stage_pins``, ``layer_pins``: {key: (before,
    after)} of the pins that differ; ``step_time_delta_s``: other's step time minus this one's.
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
    layer_pins = {op: (plan.layer_pins.get(op), other.layer_pins.get(op))
                  for op in set(plan.layer_pins) | set(other.layer_pins)
                  if plan.layer_pins.get(op) != other.layer_pins.get(op)}
    return {
        "ops": ops,
        "stages": stages,
        "microbatches": None if plan.microbatches == other.microbatches else (plan.microbatches, other.microbatches),
        "schedule": None if plan.schedule == other.schedule else (plan.schedule, other.schedule),
        "pins": pins,
        "stage_pins": stage_pins,
        "layer_pins": layer_pins,
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
        planner.microbatch_choices(table.batch_size, microbatches)
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
    cheapest strategy whose expert dimension is split over exactly those axes. With ``resolve`` (the default) the
    stages keep their layers, meshes and microbatch count (pinned) and the intra-op ILP re-solves every other operator
    around the pins (:func:`autopar_lab.resolve`), so the dispatch, the combine, the backward and the stored expert
    weights follow; without, everything else is kept as it was (only the reshardings around the pins re-priced: a
    half-changed layer that moves its tokens back and forth). An axis of one device counts as not splitting.

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
    for op, (j, d, _p) in mats.items():
        intra = plan.stages[plan.stage_of(op)].intra
        if intra is None or op not in intra.strategies:
            continue
        mshape = tuple(int(x) for x in intra.mesh.shape)
        want = sorted(a for a in axes if mshape[a] > 1)
        cands = [s for s in table_of(plan).strategy_cache(intra.mesh).strategies(g.op(op))
                 if sorted(a for a in s.in_specs[j].dims[d] if mshape[a] > 1) == want]
        if not cands:
            n = g.op(op).in_shapes[j][d]
            raise ValueError(f"the {n} experts of {g.op(op).describe()} cannot be split over mesh axes "
                             f"{tuple(axes)} of the {mshape[0]}x{mshape[1]} mesh of stage {plan.stage_of(op)} (the "
                             "device count must divide the expert count); choose other axes or () for replicated "
                             "experts.")
        plan = plan.with_choice(op, min(cands, key=lambda s: s.cost).name)
    return resolve_pins(plan) if resolve else plan
