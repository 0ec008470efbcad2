"""Overrides of a plan, re-estimated: plans are values, so each override returns a new :class:`~autopar_lab.plan.Plan`.

How an override is re-priced (the same code path the planner used, so an unchanged plan prices to the same bits):

1. The stage running the operator gets a new :class:`~autopar_lab.solve.intra.IntraPlan`: the old choice with one
   strategy replaced (a :class:`LazyIntraPlan`: its totals are evaluate_intra's, computed when first read).
2. Its layer costs are split again by :func:`~autopar_lab.planner.layer_costs`, only for the layers the change can
   reach (:func:`_changed_costs` says why that is exact to the bit), and the stage's per-microbatch forward /
   backward times and memory recomputed by :meth:`~autopar_lab.planner.CostTable.stage`.
3. The pipeline is simulated again and the cost report rebuilt (:func:`~autopar_lab.planner._finish`).

A stage override (:func:`with_stages`, :func:`with_remat`, :func:`with_microbatches`, :func:`with_schedule`) reuses
the layer costs of every stage whose layers and mesh are unchanged and takes the cost table's for the rest; only the
stage DP for what the user left free (with the rest pinned) and the simulation run again.

Other stages keep their IntraPlans and layer costs. Overrides record pins: operators' strategies in ``Plan.pins``
(op -> strategy name), stage decisions in ``Plan.stage_pins`` (:func:`with_stages`: boundaries, submeshes, logical
meshes, microbatches; :func:`with_remat`; :func:`with_schedule`; :func:`with_microbatches`). :func:`resolve`
re-solves everything else around them: the stage DP with the stage pins as constraints
(:class:`~autopar_lab.solve.inter.StageConstraints`), then the intra-op ILP of each stage around its operator pins.

>>> q = plan.with_stages(boundaries=[12], submeshes=[(1, 4), (1, 4)]).with_remat(0)   # doctest: +SKIP
>>> q.stage_pins                                                                      # doctest: +SKIP
{'boundaries': (12,), 'submeshes': ((1, 4), (1, 4)), 'remat': (True, None)}
>>> al.resolve(q.with_choice(op, "S0R"))        # the DP and the ILP around every pin  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from typing import Any, Mapping, NamedTuple, Sequence

from . import checks
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
        full = {i for i, m in enumerate(table.layer_map) if m == k}
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


# Per cost table, one _StrategyCache per logical mesh: strategies and resharding costs are looked up, not
# recomputed, by every override of plans priced by that table.
_CACHES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
# Full-graph layer costs of IntraPlans overrides made, by id (weakly: an entry leaves with its IntraPlan), so a
# later override of the same plan does not price them again. Kept outside the IntraPlan so it pickles as before.
_KNOWN_COSTS: dict[int, tuple] = {}


def _remember_costs(intra, table, costs) -> None:
    key = id(intra)
    _KNOWN_COSTS[key] = (weakref.ref(intra, lambda _r, key=key: _KNOWN_COSTS.pop(key, None)), weakref.ref(table),
                         costs)


def _recall_costs(intra, table):
    hit = _KNOWN_COSTS.get(id(intra))
    if hit is not None and hit[0]() is intra and hit[1]() is table:
        return hit[2]
    return None


def strategy_cache(table, mesh) -> _StrategyCache:
    """The shared _StrategyCache of ``mesh`` (a LogicalMesh) for plans priced by ``table``."""
    per = _CACHES.setdefault(table, {})
    key = (tuple(mesh.submesh), tuple(mesh.shape), getattr(mesh, "first_device", 0))
    if key not in per:
        per[key] = _StrategyCache(mesh)
    return per[key]


_TOTALS = ("compute_s", "comm_s", "reshard_s", "role_s", "sync_s", "static_bytes", "act_bytes", "collectives")


class LazyIntraPlan(IntraPlan):
    """An :class:`IntraPlan` whose totals (compute, collectives, resharding, memory) are computed by
    :func:`evaluate_intra` the first time one is read: an override needs only the strategies and its layers' costs
    to re-price a plan, and evaluating every operator and edge again is what would make it slow. Once computed the
    totals are exactly evaluate_intra's."""

    def __init__(self, graph=None, mesh=None, strategies=None, ops=(), cache=None, groups=(), solve_s=0.0,
                 **totals):  # noqa: D107
        for name, value in (("mesh", mesh), ("ops", tuple(ops)), ("strategies", dict(strategies or {})),
                            ("groups", groups), ("solve_s", solve_s)):
            object.__setattr__(self, name, value)
        if totals:  # dataclasses.replace passes every field: nothing left to compute
            for name, value in totals.items():
                object.__setattr__(self, name, value)
        else:
            object.__setattr__(self, "_lazy", (graph, cache))

    def __getattr__(self, name):
        lazy = self.__dict__.get("_lazy")
        if name not in _TOTALS or lazy is None:
            raise AttributeError(name)
        full = evaluate_intra(lazy[0], self.mesh, self.strategies, ops=self.ops, cache=lazy[1], groups=self.groups,
                              solve_s=self.solve_s)
        for f in _TOTALS:
            object.__setattr__(self, f, getattr(full, f))
        self.__dict__.pop("_lazy", None)
        return getattr(self, name)

    def __reduce__(self):
        # Pickled (and deep-copied) as the plain IntraPlan it stands for, totals computed.
        return IntraPlan, tuple(getattr(self, f.name) for f in dataclasses.fields(IntraPlan))

    def __eq__(self, other):
        if not isinstance(other, IntraPlan):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(IntraPlan))

    __hash__ = None


def _costs_of(table, submesh, shape, intra: IntraPlan):
    """Full-graph layer costs of ``intra`` (the table's own entry when it is the table's IntraPlan; remembered on
    an IntraPlan an override made)."""
    from .planner import layer_costs

    hit = table._mesh.get((tuple(submesh), tuple(shape)))
    if hit is not None and hit[1] is intra:
        return hit[0]
    known = _recall_costs(intra, table)
    if known is not None:
        return known
    g = table.solve_graph
    small = layer_costs(g, intra, list(g.layers) or [""], cache=strategy_cache(table, intra.mesh))
    costs = [small[k] for k in table.layer_map]
    _remember_costs(intra, table, costs)
    return costs


def _layer_of(table) -> dict[int, int]:
    """Operator -> index of its layer in the solve graph (no layer: the last), as layer_costs assigns it; per table."""
    per = _CACHES.setdefault(table, {})
    if "layer_of" not in per:
        g = table.solve_graph
        index = {name: k for k, name in enumerate(list(g.layers) or [""])}
        last = len(index) - 1
        per["layer_of"] = {op: index.get(g.op(op).layer, last) for op in g.ops}
    return per["layer_of"]


def _changed_costs(table, old: IntraPlan, new: IntraPlan, op: int, old_costs, cache):
    """The full-graph layer costs of ``new`` (``old`` with operator ``op``'s strategy changed), recomputing only
    the layers the change can reach, bit for bit as :func:`~autopar_lab.planner.layer_costs` on the whole graph.

    Why it is exact: layer_costs adds each operator's cost into its own layer and each resharding into its
    consumer's layer, in graph order, and counts a conversion of one tensor to one spec once (the first consumer
    reading it that way pays). Changing ``op`` changes its own cost and the conversions of its input and output
    tensors, so the layers touched are ``op``'s and those of every consumer of those tensors (and of the output it
    aliases). Those layers are recomputed by layer_costs itself on a sub-plan holding every operator of them, the
    producers they read, and every consumer of the tensors they read (so the "first consumer pays" rule sees the
    same readers in the same order); the other layers keep their costs.
    """
    from .graph.opgraph import INPUT_PRIMITIVE, OUTPUT_PRIMITIVE
    from .planner import layer_costs

    g = table.solve_graph
    names = list(g.layers) or [""]
    layer_of = _layer_of(table)
    node = g.op(op)
    touched = {op}
    for t in (*node.inputs, *node.outputs):
        touched.update(g.consumers.get(t, ()))
    for v in (g.ops if node.primitive == INPUT_PRIMITIVE else ()):
        # An output aliasing the parameter this op produces: the alias edge is priced in the output's layer.
        nv = g.op(v)
        if nv.primitive == OUTPUT_PRIMITIVE and nv.params.get("alias_of") is not None and \
                g.tensor(nv.params["alias_of"]).producer == op:
            touched.add(v)
    layers = {layer_of[v] for v in touched}
    inside = set(old.ops)
    sub = {v for v in old.ops if layer_of[v] in layers}
    extra = set()
    for v in sub:
        nv = g.op(v)
        for t in nv.inputs:
            extra.update(g.consumers.get(t, ()))
            u = g.tensor(t).producer
            if u is not None:
                extra.add(u)
        if nv.primitive == OUTPUT_PRIMITIVE and nv.params.get("alias_of") is not None:
            u = g.tensor(nv.params["alias_of"]).producer
            if u is not None:
                extra.add(u)
    sub |= extra & inside
    ops = tuple(v for v in old.ops if v in sub)
    view = LazyIntraPlan(g, new.mesh, new.strategies, ops, cache)
    small = layer_costs(g, view, names, cache=cache)
    return [small[k] if k in layers else c for k, c in zip(table.layer_map, old_costs)]


def assemble(table, cluster, method: str, stage_specs: Sequence[tuple], intras: Sequence[IntraPlan],
             microbatches: int, schedule: str, stage_comm: str, mem_limit: float, *, solve_s: Mapping | None = None,
             notes=(), pins: Mapping[int, str] | None = None, stage_pins: Mapping[str, Any] | None = None):
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
                               pins=dict(pins or {}), stage_pins=dict(stage_pins or {}), table=table)


def _rebuild(plan, intras: Sequence[IntraPlan], microbatches: int, pins: Mapping[int, str], *, specs=None,
             schedule: str | None = None, stage_pins: Mapping[str, Any] | None = None):
    if specs is None:
        specs = [(st.layers, st.submesh, st.logical_mesh, st.remat) for st in plan.stages]
    return assemble(_table(plan), plan.cluster, plan.method, specs, intras, microbatches, schedule or plan.schedule,
                    plan.stage_comm, plan.cost.mem_limit_bytes, solve_s=plan.solve_s, notes=plan.notes, pins=pins,
                    stage_pins=plan.stage_pins if stage_pins is None else stage_pins)


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
    cache = strategy_cache(plan.table, intra.mesh)
    strats = cache.strategies(g.op(op))
    return k, intra, g, cache, _resolve_strategy(g, op, strategy, strats)


def _with_strategy(plan, k, intra, g, cache, op, s: Strategy):
    chosen = dict(intra.strategies)
    chosen[op] = s
    new = LazyIntraPlan(g, intra.mesh, chosen, intra.ops, cache, intra.groups, intra.solve_s)
    st = plan.stages[k]
    table = plan.table
    if g is table.solve_graph:  # only the layers the change reaches are priced again
        old_costs = _costs_of(table, st.submesh, st.logical_mesh, intra)
        _remember_costs(new, table, _changed_costs(table, intra, new, op, old_costs, cache))
    intras = [st.intra for st in plan.stages]
    intras[k] = new
    return _rebuild(plan, intras, plan.microbatches, {**plan.pins, op: s.name})


def with_choice(plan, op: int, strategy):
    """A new plan with operator ``op`` run by ``strategy``; the original is left as it was."""
    op = checks.op_id(op)
    k, intra, g, cache, s = _stage_choice(plan, op, strategy)
    return _with_strategy(plan, k, intra, g, cache, op, s)


def with_microbatches(plan, n: int):
    """A new plan with ``n`` microbatches: same stages and strategies, stages re-priced, pipeline re-simulated."""
    from .planner import microbatch_choices

    table = _table(plan)
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"microbatches must be a positive integer dividing the batch size {table.batch_size}, "
                         f"got {n!r}")
    microbatch_choices(table.batch_size, n)
    return _rebuild(plan, [st.intra for st in plan.stages], n, plan.pins,
                    stage_pins={**plan.stage_pins, "microbatches": n})


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
    stage_pins = {k: (plan.stage_pins.get(k), other.stage_pins.get(k))
                  for k in set(plan.stage_pins) | set(other.stage_pins) if plan.stage_pins.get(k) != other.stage_pins.get(k)}
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


def with_schedule(plan, schedule: str):
    """A new plan run with pipeline ``schedule`` ("gpipe" or "1f1b"), pinned; stages and strategies kept."""
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule must be '1f1b' or 'gpipe', got {schedule!r}")
    return _rebuild(plan, [st.intra for st in plan.stages], plan.microbatches, plan.pins, schedule=schedule,
                    stage_pins={**plan.stage_pins, "schedule": schedule})


def _stage_index(plan, stage) -> int:
    S = len(plan.stages)
    if isinstance(stage, bool) or not isinstance(stage, int) or not -S <= stage < S:
        raise ValueError(f"stage must be a stage index 0..{S - 1} of this {S}-stage plan, got {stage!r}")
    return stage % S


def with_remat(plan, stage: int, on: bool = True):
    """A new plan with stage ``stage``'s rematerialisation ``on`` (or off), pinned.

    The CostTable prices remat as: only the stage's input activations are held (its entry cut's bytes per
    microbatch, sharded over the stage's devices) and the backward pass runs the forward pass again."""
    k = _stage_index(plan, checks.stage_index(plan, stage))
    if not isinstance(on, bool):
        raise ValueError(f"on must be True or False, got {on!r}")
    specs = [(st.layers, st.submesh, st.logical_mesh, st.remat) for st in plan.stages]
    specs[k] = (*specs[k][:3], on)
    remat = list(plan.stage_pins.get("remat") or [None] * len(specs))
    remat[k] = on
    return _rebuild(plan, [st.intra for st in plan.stages], plan.microbatches, plan.pins, specs=specs,
                    stage_pins={**plan.stage_pins, "remat": tuple(remat)})


def _pair(value, what: str) -> tuple[int, int]:
    try:
        a, b = value
        if isinstance(a, bool) or isinstance(b, bool) or int(a) != a or int(b) != b:
            raise TypeError
        return int(a), int(b)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a pair of integers, got {value!r}") from None


def stage_ranges(boundaries, num_layers: int) -> list[tuple[int, int]]:
    """Stage layer ranges from ``boundaries``: the first layer of each stage after the first, or the ranges
    themselves as (first, last) pairs. ValueError naming the problem when they do not cover every layer in order.

    >>> stage_ranges([2, 3], 5), stage_ranges([(0, 1), (2, 4)], 5)
    ([(0, 1), (2, 2), (3, 4)], [(0, 1), (2, 4)])
    """
    items = list(boundaries)
    L = num_layers
    if items and all(isinstance(x, (tuple, list)) for x in items):
        ranges = [_pair(x, f"stage range {x!r}") for x in items]
        expect = 0
        for j, (a, b) in enumerate(ranges):
            if a != expect or b < a:
                raise ValueError(f"stage {j}'s layers ({a}, {b}) do not continue the stages before it: it must "
                                 f"start at layer {expect} and end at or after its start (layers 0..{L - 1}).")
            expect = b + 1
        if expect != L:
            raise ValueError(f"the stages cover layers 0..{expect - 1}, but the model has layers 0..{L - 1}; "
                             "the last stage must end at the last layer.")
        return ranges
    cuts = []
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"boundaries must be layer indices (the first layer of each stage after the first) or "
                             f"(first, last) ranges, got {x!r}")
        cuts.append(x)
    if any(not 0 < c < L for c in cuts) or cuts != sorted(set(cuts)):
        raise ValueError(f"boundaries {cuts} must be increasing layer indices in 1..{L - 1} (the first layer of "
                         f"each stage after the first; this model has {L} layers).")
    bounds = [0, *cuts, L]
    return [(bounds[j], bounds[j + 1] - 1) for j in range(len(bounds) - 1)]


def check_submeshes(cluster, submeshes) -> list[tuple[int, int]]:
    """The submeshes as pairs, checked to tile ``cluster`` in order (each stage starts where the previous one
    ended, a submesh never straddles a host, every device used once); a ValueError naming the stage otherwise."""
    from .solve.inter import placement_fits

    shapes = [_pair(x, f"submesh {x!r}") for x in submeshes]
    valid = [tuple(s) for s in cluster.submesh_shapes()]
    offset = 0
    for j, sh in enumerate(shapes):
        if sh not in valid:
            raise ValueError(f"stage {j}'s submesh {sh} is not a submesh shape of this cluster "
                             f"({cluster.hosts} x {cluster.devices_per_host} devices); use one of {valid}.")
        if not placement_fits(sh, offset, cluster.hosts, cluster.devices_per_host):
            end = offset + sh[0] * sh[1]
            why = (f"it would run past the cluster's {cluster.num_devices} devices" if end > cluster.num_devices
                   else f"it would straddle hosts of {cluster.devices_per_host} devices")
            raise ValueError(f"stage {j}'s submesh {sh} does not fit at device {offset} (stages are placed in order, "
                             f"each after the previous one): {why}; change the submeshes so they tile the cluster.")
        offset += sh[0] * sh[1]
    if offset != cluster.num_devices:
        raise ValueError(f"the submeshes {shapes} use {offset} devices, but the cluster has {cluster.num_devices}; "
                         "the stages' submeshes must use every device exactly once.")
    return shapes


def _per_stage(values, S: int, what: str) -> list:
    items = list(values)
    if len(items) != S:
        raise ValueError(f"{what} needs one entry per stage ({S}), got {len(items)}")
    return items


def _op_layers(plan, op: int) -> set[int]:
    """Full-graph layer indices operator ``op`` (of the solve graph) stands for."""
    g = _solve_graph(plan)
    node = g.op(op)
    table = plan.table
    if table is None or g is plan.graph:
        names = list(plan.layer_names)
        return {names.index(node.layer) if node.layer in names else len(names) - 1}
    small = list(g.layers) or [""]
    k = small.index(node.layer) if node.layer in small else len(small) - 1
    return {i for i, m in enumerate(table.layer_map) if m == k}


class _PinIndex:
    """Operator pins, looked up by layer and by mesh: which stages they fall in and which meshes can run them."""

    def __init__(self, plan):
        self.plan = plan
        self.g = _solve_graph(plan)
        self.layers = {op: _op_layers(plan, op) for op in plan.pins}
        self._ok: dict[tuple, bool] = {}
        self._caches: dict[tuple, Any] = {}

    def in_range(self, a: int, b: int) -> dict[int, str]:
        return {op: name for op, name in self.plan.pins.items() if any(a <= i <= b for i in self.layers[op])}

    def cache(self, submesh, shape):
        key = (tuple(submesh), tuple(shape))
        if key not in self._caches:
            self._caches[key] = strategy_cache(self.plan.table, self.plan.cluster.logical_mesh(submesh, shape))
        return self._caches[key]

    def strategy(self, op: int, submesh, shape):
        name = self.plan.pins[op]
        hit = [s for s in self.cache(submesh, shape).strategies(self.g.op(op)) if s.name == name]
        return hit[0] if hit else None

    def mesh_ok(self, a: int, b: int, submesh, shape) -> bool:
        """Whether every pinned operator of layers a..b has its strategy on this mesh."""
        for op in self.in_range(a, b):
            key = (op, tuple(submesh), tuple(shape))
            if key not in self._ok:
                self._ok[key] = self.strategy(op, submesh, shape) is not None
            if not self._ok[key]:
                return False
        return True


def _pinned_intra(pins: _PinIndex, table, layers, submesh, shape, stage: int) -> IntraPlan:
    """The table's IntraPlan of a mesh with the stage's operator pins applied (re-priced, not re-solved)."""
    _, base = table.mesh_costs(submesh, shape)
    mine = pins.in_range(*layers)
    if not mine:
        return base
    chosen = dict(base.strategies)
    for op, name in mine.items():
        s = pins.strategy(op, submesh, shape)
        if s is None:
            raise ValueError(f"operator {pins.g.op(op).describe()} is pinned to {name!r}, which is not one of its "
                             f"strategies on stage {stage}'s {shape[0]}x{shape[1]} logical mesh; choose another "
                             "logical mesh for that stage, or pin the operator to a strategy of that mesh.")
        chosen[op] = s
    return LazyIntraPlan(pins.g, base.mesh, chosen, base.ops, pins.cache(submesh, shape), base.groups, base.solve_s)


def _constrained_candidates(table, cluster, constraints, pins: _PinIndex | None, *, prune: bool = True):
    """The DP's candidates(start, end, submesh, B) from ``table``: every logical mesh x remat, less the meshes that
    cannot run a pinned operator, less the ranges the pinned cuts forbid. Pareto-pruned unless a per-stage pin
    (logical mesh, remat) could pick a dominated candidate."""
    from .planner import pareto

    L = len(table.layer_names)
    allowed = None
    if constraints is not None and constraints.cuts is not None:
        allowed = set(zip((0, *constraints.cuts), (*(c - 1 for c in constraints.cuts), L - 1)))
    shapes: dict[tuple, list] = {}
    keep_all = not prune or (constraints is not None and (constraints.logical_meshes is not None
                                                          or constraints.remat is not None))

    def candidates(a, b, sub, B):
        if allowed is not None and (a, b) not in allowed:
            return []
        sub = tuple(sub)
        if sub not in shapes:
            shapes[sub] = cluster.logical_mesh_shapes(sub)
        out = [table.stage(a, b, sub, shape, B, r) for shape in shapes[sub]
               if pins is None or pins.mesh_ok(a, b, sub, shape) for r in (False, True)]
        return out if keep_all else pareto(out)

    return candidates


def _constraints_of(stage_pins: Mapping[str, Any]):
    from .solve.inter import StageConstraints

    c = StageConstraints(cuts=tuple(stage_pins["boundaries"]) if "boundaries" in stage_pins else None,
                         submeshes=stage_pins.get("submeshes"), logical_meshes=stage_pins.get("logical_meshes"),
                         remat=stage_pins.get("remat"))
    return c if c.num_stages is not None else None


def _solve_stages(plan, constraints, microbatch_choices, schedule, mem_limit, pins: _PinIndex | None, *,
                  prune: bool = True):
    from .solve import inter

    table, cluster = _table(plan), plan.cluster
    cands = _constrained_candidates(table, cluster, constraints, pins, prune=prune)
    return inter.stage_dp_auto(
        len(table.layer_names), cluster.hosts, cluster.devices_per_host, cands, table.batch_size,
        choices=microbatch_choices, cut_bytes=lambda B: [c / B for c in table.cut_bytes],
        mem_limit_bytes=mem_limit, intra_link=cluster.intra_host, inter_link=cluster.inter_host,
        stage_comm=plan.stage_comm, schedule=schedule, constraints=constraints)


def _solve_fixed_cuts(plan, ranges, constraints, B: int, mem_limit: float, pins: _PinIndex):
    """The stage DP when the cuts are fixed: each stage's layer range becomes one "layer" of a problem with S
    layers and the same cluster, so the DP only chooses submeshes, logical meshes and remat (exactly the choice
    the full problem has with those cuts pinned, at a fraction of its size)."""
    from .solve import inter

    table, cluster = _table(plan), plan.cluster
    S = len(ranges)
    views: dict[tuple, list] = {}

    def candidates(a, b, sub):
        if a != b:
            return []
        sub = tuple(sub)
        if sub not in views:
            views[sub] = cluster.logical_mesh_shapes(sub)
        first, last = ranges[a]
        return [table.stage(first, last, sub, shape, B, r) for shape in views[sub]
                if pins.mesh_ok(first, last, sub, shape) for r in (False, True)]

    con = inter.StageConstraints(cuts=tuple(range(1, S)), submeshes=constraints.submeshes,
                                 logical_meshes=constraints.logical_meshes, remat=constraints.remat)
    return inter.stage_dp(S, cluster.hosts, cluster.devices_per_host, candidates, B,
                          cut_bytes=[table.cut_bytes[r[0] - 1] / B for r in ranges[1:]], mem_limit_bytes=mem_limit,
                          intra_link=cluster.intra_host, inter_link=cluster.inter_host, stage_comm=plan.stage_comm,
                          schedule=plan.schedule, constraints=con)


def with_stages(plan, boundaries=None, submeshes=None, logical_meshes=None, microbatches=None):
    """A new plan with the stages changed (see :meth:`autopar_lab.plan.Plan.with_stages`).

    What is given is checked (ranges cover the layers in order, submeshes tile the cluster in order, each logical
    mesh is a view of its submesh) and pinned. What is not: with the same stage count, each stage keeps its
    submesh, its logical mesh (if its submesh is unchanged) and its remat; otherwise the stage DP picks them from
    the plan's cost table with everything given held fixed. A stage whose layers and mesh are unchanged keeps its
    IntraPlan; a changed one takes the table's IntraPlan of its mesh with its operator pins applied.
    """
    from .planner import microbatch_choices
    from .solve.inter import NoFeasiblePlanError, StageConstraints

    table, cluster = _table(plan), plan.cluster
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
        microbatch_choices(table.batch_size, microbatches)
        B = microbatches
    if submeshes is not None:
        subs = check_submeshes(cluster, _per_stage(submeshes, S, "submeshes"))
    else:
        subs = [st.submesh for st in old] if same else [None] * S
    if logical_meshes is not None:
        shapes = []
        for j, v in enumerate(_per_stage(logical_meshes, S, "logical_meshes")):
            if v is None:
                shapes.append(None)
                continue
            v = _pair(v, f"stage {j}'s logical mesh")
            if subs[j] is not None:
                views = cluster.logical_mesh_shapes(subs[j])
                if v not in views:
                    raise ValueError(f"stage {j}'s logical mesh {v} is not a view of its {subs[j]} submesh "
                                     f"({subs[j][0] * subs[j][1]} devices); use one of {views}.")
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
        sp["logical_meshes"] = tuple(None if v is None else _pair(v, "") for v in logical_meshes)
    elif "logical_meshes" in sp:
        # A logical mesh pinned on a stage whose submesh changes no longer describes it: that pin is dropped.
        sp["logical_meshes"] = tuple(v if subs[j] == old[j].submesh else None
                                     for j, v in enumerate(sp["logical_meshes"]))
        if all(v is None for v in sp["logical_meshes"]):
            del sp["logical_meshes"]
    if microbatches is not None:
        sp["microbatches"] = B
    pins = _PinIndex(plan)
    if any(x is None for x in subs + shapes + remat):
        # Let the DP choose what is free, everything else held (the pinned cuts make it a small problem).
        con = StageConstraints(cuts=tuple(r[0] for r in ranges[1:]), submeshes=tuple(subs),
                               logical_meshes=tuple(shapes), remat=tuple(remat))
        try:
            res = _solve_fixed_cuts(plan, ranges, con, B, plan.cost.mem_limit_bytes, pins)
        except NoFeasiblePlanError as e:
            if e.min_mem_bytes == float("inf"):
                raise ValueError(f"no stage layout keeps the stages asked for: {e}") from None
            # An override may exceed memory (the plan shows it); pick the fastest layout regardless.
            res = _solve_fixed_cuts(plan, ranges, con, B, float("inf"), pins)
        subs = [c.submesh for c in res.stages]
        shapes = [c.logical_mesh for c in res.stages]
        remat = [c.remat for c in res.stages]
    specs, intras = [], []
    for j, (rng, sub, shape, r) in enumerate(zip(ranges, subs, shapes, remat)):
        specs.append((tuple(rng), tuple(sub), tuple(shape), bool(r)))
        if same and (old[j].layers, old[j].submesh, old[j].logical_mesh) == (tuple(rng), tuple(sub), tuple(shape)):
            intras.append(old[j].intra)  # unchanged: keep its strategies (and its pins' effects) as they are
        else:
            intras.append(_pinned_intra(pins, table, rng, sub, shape, j))
    return _rebuild(plan, intras, B, plan.pins, specs=specs, stage_pins=sp)


# --------------------------------------------------------------------------------------------------------------
# Resolve


def resolve(plan, *, solver: str | None = None):
    """Re-solve every decision that is not pinned, around the pins.

    1. The stage DP runs again over the plan's cost table with the stage pins as constraints (pinned cuts,
       submeshes, logical meshes, remat flags, microbatch count; schedule kept) and only on logical meshes where
       every pinned operator of a stage has its pinned strategy. The DP prices stages with the table's unpinned
       sharding (a pin can only make its stage slower; the final plan is priced exactly).
    2. Each chosen stage that runs pinned operators gets the intra-op ILP again with those pins fixed; the other
       stages take the table's solution for their mesh.

    Raises ValueError naming the operator when a pinned strategy exists on no mesh of the cluster, and
    :class:`~autopar_lab.solve.inter.NoFeasiblePlanError` (with ``min_mem_bytes``, the smallest memory per device
    the pins need) when the pins do not fit in memory.
    """
    import time

    from .planner import microbatch_choices
    from .solve.inter import NoFeasiblePlanError

    t0 = time.perf_counter()
    table, cluster = _table(plan), plan.cluster
    g = _solve_graph(plan)
    pins = _PinIndex(plan)
    meshes = [(sub, shape) for sub in cluster.submesh_shapes() for shape in cluster.logical_mesh_shapes(sub)]
    for op, name in plan.pins.items():
        if not any(pins.strategy(op, sub, shape) is not None for sub, shape in meshes):
            raise ValueError(f"operator {g.op(op).describe()} is pinned to {name!r}, which is a strategy of it on "
                             "no logical mesh of this cluster; pin it to another strategy.")
    sp = dict(plan.stage_pins)
    constraints = _constraints_of(sp)
    schedule = sp.get("schedule", plan.schedule)
    choices = [sp["microbatches"]] if "microbatches" in sp else microbatch_choices(table.batch_size, "auto")
    mem = plan.cost.mem_limit_bytes
    try:
        res = _solve_stages(plan, constraints, choices, schedule, mem, pins if plan.pins else None)
    except NoFeasiblePlanError as e:
        if plan.pins and e.min_mem_bytes == float("inf"):
            raise NoFeasiblePlanError(f"{e} (operator pins limit each stage to the logical meshes that have the "
                                      f"pinned strategies: {dict(plan.pins)})", e.min_mem_bytes) from None
        raise
    specs, intras = [], []
    for j, c in enumerate(res.stages):
        specs.append((c.layers, c.submesh, c.logical_mesh, c.remat))
        _, base = table.mesh_costs(c.submesh, c.logical_mesh)
        mine = pins.in_range(*c.layers)
        if not mine:
            intras.append(base)
            continue
        kw = dict(ops=base.ops, pins=mine, solver=solver or table.solver, rounds=1,
                  cache=pins.cache(c.submesh, c.logical_mesh))
        try:
            intras.append(solve_intra(g, base.mesh, **kw))
        except ValueError:  # a pin outside the axis-0 pass's choices: search both axes at once
            intras.append(solve_intra(g, base.mesh, axes="joint", **kw))
    solve_s = {**dict(plan.solve_s), "resolve": time.perf_counter() - t0}
    out = assemble(table, cluster, plan.method, specs, intras, res.microbatches, schedule, plan.stage_comm, mem,
                   solve_s=solve_s, notes=plan.notes, pins=plan.pins, stage_pins=sp)
    # The ILP minimises its own objective, not the simulated step time, so a re-solved stage can come out a hair
    # slower than the user's overridden one. Where a stage is unchanged in layout, keep its old sharding if that wins.
    old = {(st.layers, st.submesh, st.logical_mesh, st.remat): st.intra for st in plan.stages}
    kept = [(old.get(spec) or intra) if pins.in_range(*spec[0]) else intra for spec, intra in zip(specs, intras)]
    if any(a is not b for a, b in zip(kept, intras)):
        alt = assemble(table, cluster, plan.method, specs, kept, res.microbatches, schedule, plan.stage_comm, mem,
                       solve_s=solve_s, notes=plan.notes, pins=plan.pins, stage_pins=sp)
        if alt.cost.step_time_s < out.cost.step_time_s:
            return alt
    return out
