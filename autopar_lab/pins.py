"""Pins: the decisions a user fixed, checked, and everything else re-solved around them.

Overrides record pins (:mod:`autopar_lab.overrides`): operators' strategies in ``Plan.pins`` (operator ->
:class:`~autopar_lab.planvalues.Pin`), stage decisions in ``Plan.stage_pins`` ("boundaries", "submeshes",
"logical_meshes", "remat", "microbatches", "schedule"). This module re-solves around them:

- :func:`resolve`: the stage DP with the stage pins as constraints (:class:`~autopar_lab.solve.inter.StageConstraints`,
  the one microbatch search :func:`~autopar_lab.stagesearch.search_microbatches`) and the plan's own schedule
  (:func:`schedule_keywords`), then the intra-op ILP of each stage around the operator pins of the layers it runs
  (:func:`stage_runs`: an interleaved stage's chunks);
- :func:`solve_intra_around_pins`: the same stages, each stage's ILP again around its pins (the workbench's "intra"
  solve);
- :func:`keep_pins`: a fresh plan (another cluster: a what-if question) re-solved around every pin of the old one
  that still holds there, with one message per pin it had to drop.

Pins name operators of ``plan.graph`` (:mod:`autopar_lab.operators`); a shared pin holds for every layer that shares
its operator's solution, a layer's own pin for that layer alone.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from . import operators, stagesearch
from .planvalues import LAYER, SHARED, Pin, layer_scoped
from .pricing import LazyIntraPlan, pareto, price_stages
from .pricing.price import StageSpec, table_of
from .pricing.table_pool import LEAN, lean_pins
from .rematmode import REMAT_CHOICES
from .schedules import interleave, schedule_of
from .solve.ilp import DEFAULT_SOLVER
from .solve.inter import NoFeasiblePlanError, StageConstraints, StageProblem, placement_fits, stage_dp
from .solve.intra import IntraOptions, IntraPlan, solve_intra

if TYPE_CHECKING:
    from .cluster import Cluster
    from .plan import Plan
    from .pricing import CostTable
    from .sharding.strategies import Strategy
    from .solve.intra import StrategyCache

Hook = Callable[..., None]


# --------------------------------------------------------------------------------------------------------------
# Checking stage decisions


def pair(value, what: str) -> tuple[int, int]:
    """``value`` as a pair of integers; a ValueError naming ``what`` otherwise."""
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
        ranges = [pair(x, f"stage range {x!r}") for x in items]
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


def check_submeshes(cluster: Cluster, submeshes) -> list[tuple[int, int]]:
    """The submeshes as pairs, checked to tile ``cluster`` in order (each stage starts where the previous one
    ended, a submesh never straddles a host, every device used once); a ValueError naming the stage otherwise."""
    shapes = [pair(x, f"submesh {x!r}") for x in submeshes]
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


def constraints_of(stage_pins: Mapping[str, Any]) -> StageConstraints | None:
    """The stage DP's constraints for these stage pins (None when they fix nothing the DP decides)."""
    c = StageConstraints(cuts=tuple(stage_pins["boundaries"]) if "boundaries" in stage_pins else None,
                         submeshes=stage_pins.get("submeshes"), logical_meshes=stage_pins.get("logical_meshes"),
                         remat=stage_pins.get("remat"))
    return c if c.num_stages is not None else None


# --------------------------------------------------------------------------------------------------------------
# Operator pins


class PinIndex:
    """Operator pins (``Plan.pins``, operators of ``plan.graph``), looked up by layer and by mesh: which stages they
    fall in and which meshes can run them, in the ids of the graph the plan was solved on (``plan.op_graph``).

    A shared pin is held by its operator's stand-in in that graph, recorded under the stand-in's representative
    (:attr:`pins`), and by its siblings too (:meth:`OpMap.siblings`: the same place in every copy layer of that
    structure), so the layer that prices the blocks reads its input as the pin says. The pins of single layers split
    from their group (:attr:`layer_pins`, operators of ``plan.graph``) are checked against the mesh of the stage that
    runs their layer."""

    def __init__(self, plan: Plan, pins: Mapping[int, Pin] | None = None):
        self.plan = plan
        given = plan.pins if pins is None else pins
        self.table = table_of(plan)
        self.g = plan.op_graph
        m = self.table.op_map
        #: Shared pins: representative in the solve graph -> strategy name; and the user's operator of each.
        self.pins: dict[int, str] = {}
        self.user: dict[int, int] = {}
        for op, p in given.items():
            if p.scope == SHARED:
                rep = m.representative(operators.stand_in(plan, op))
                self.pins[rep], self.user[rep] = p.strategy, op
        #: Pins of single layers: operator of plan.graph -> strategy name.
        self.layer_pins = layer_scoped(given)
        self.layers = {op: m.full_layers_of(op) for op in self.pins}
        # A layer pin: (its full layer, its stand-in in the solve graph).
        self.split = {op: (m.full_layer_of(op), m.solve_op(op)) for op in self.layer_pins}
        self._ok: dict[tuple, bool] = {}

    def in_range(self, a: int, b: int) -> dict[int, str]:
        """The pins on operators of layers a..b (for a shallower copy's operator: any layer it stands for)."""
        return self.in_ranges(((a, b),))

    def in_ranges(self, ranges: Sequence[Sequence[int]]) -> dict[int, str]:
        """The pins on operators of any of the layer ranges ``((first, last), ...)``: what a stage that runs those
        layers must hold (an interleaved stage runs several ranges, its chunks: :func:`stage_runs`)."""
        return {op: name for op, name in self.pins.items()
                if any(a <= i <= b for a, b in ranges for i in self.layers[op])}

    def with_siblings(self, pins: Mapping[int, str]) -> dict[int, str]:
        """``pins`` given to every sibling of each pinned operator (what the ILP and the IntraPlan must hold)."""
        m = self.table.op_map
        out: dict[int, str] = {}
        for op, name in pins.items():
            for sib in m.siblings(op):
                out.setdefault(sib, name)
        out.update(pins)  # an operator pinned itself keeps its own pin
        return out

    def cache(self, submesh, shape) -> StrategyCache:
        return self.table.strategy_cache(self.plan.cluster.logical_mesh(submesh, shape))

    def strategy(self, op: int, submesh, shape, name: str | None = None) -> Strategy | None:
        """The pinned strategy of ``op`` (or the one named ``name``) on that logical mesh, or None when that mesh
        has no strategy so named."""
        name = self.pins[op] if name is None else name
        hit = [s for s in self.cache(submesh, shape).strategies(self.g.op(op)) if s.name == name]
        return hit[0] if hit else None

    def _held(self, op: int, submesh, shape, layer_pin: bool = False) -> bool:
        key = (op, layer_pin, tuple(submesh), tuple(shape))
        if key not in self._ok:
            if layer_pin:
                sop = self.split[op][1]
                self._ok[key] = sop is not None and \
                    self.strategy(sop, submesh, shape, self.layer_pins[op]) is not None
            else:
                self._ok[key] = self.strategy(op, submesh, shape) is not None
        return self._ok[key]

    def anywhere(self, op: int) -> bool:
        """Whether some logical mesh of the cluster has the strategy pinned on operator ``op`` of ``plan.graph``
        (a key of the pins given)."""
        layer_pin = op in self.layer_pins
        key = op if layer_pin else next(rep for rep, user in self.user.items() if user == op)
        cluster = self.plan.cluster
        return any(self._held(key, sub, shape, layer_pin)
                   for sub in cluster.submesh_shapes() for shape in cluster.logical_mesh_shapes(sub))

    def mesh_ok(self, a: int, b: int, submesh, shape) -> bool:
        """Whether every pinned operator of layers a..b (and every pin of a split layer among them) has its
        strategy on this mesh."""
        return self.runs_ok(((a, b),), submesh, shape)

    def runs_ok(self, ranges: Sequence[Sequence[int]], submesh, shape) -> bool:
        """:meth:`mesh_ok` for a stage that runs every layer range of ``ranges``."""
        if not all(self._held(op, submesh, shape) for op in self.in_ranges(ranges)):
            return False
        return all(self._held(op, submesh, shape, True) for op, (k, _) in self.split.items()
                   if any(a <= k <= b for a, b in ranges))

    def honoured_by(self, intra: IntraPlan, ranges: Sequence[Sequence[int]]) -> bool:
        """Whether ``intra`` runs every pinned operator of the layer ranges (and its siblings) by its pinned
        strategy."""
        return all(op in intra.strategies and intra.strategies[op].name == name
                   for op, name in self.with_siblings(self.in_ranges(ranges)).items())


# --------------------------------------------------------------------------------------------------------------
# The schedule a re-solve keeps


def schedule_keywords(plan: Plan, schedule: str | None = None) -> dict[str, Any]:
    """The stage DP's schedule keywords (``schedule``, and ``virtual_stages`` or ``wgrad_share`` where it takes
    them) for re-solving ``plan`` with ``schedule`` (default: the pinned one, else the plan's): a re-solve searches
    with the formula and memory of the schedule the plan runs, as :func:`~autopar_lab.planner.auto_plan` does, so
    the stages it picks are the best for that schedule (an interleaved plan keeps its chunk count, pinned or not)."""
    sp = plan.stage_pins
    name = sp.get("schedule", plan.schedule) if schedule is None else schedule
    v = plan.virtual_stages if name == plan.schedule else schedule_of(name, None, sp)[1]
    kw: dict[str, Any] = {"schedule": name}
    if name == "interleaved":
        kw["virtual_stages"] = v
        if sp.get("microbatch_group") is not None:  # the DP holds the grouped warm-up and runs the counts it allows
            kw["microbatch_group"] = sp["microbatch_group"]
    elif name == "zb-h1":
        kw["wgrad_share"] = stagesearch.wgrad_share(table_of(plan))
    return kw


def stage_runs(layers: Sequence[Sequence[int]], virtual_stages: int = 1) -> list[tuple[tuple[int, int], ...]]:
    """The layer ranges each stage runs when the stages hold ``layers`` ((first, last) each, the 1F1B layout):
    its own range, or with ``virtual_stages`` > 1 its chunks (:func:`~autopar_lab.schedules.interleave`), which
    lie in other stages' ranges: the pins a stage must hold are those of these ranges.

    >>> stage_runs([(0, 1), (2, 3)]), stage_runs([(0, 1), (2, 3)], 2)
    ([((0, 1),), ((2, 3),)], [((0, 0), (2, 2)), ((1, 1), (3, 3))])
    """
    if virtual_stages > 1:
        return interleave(layers, virtual_stages)
    return [((int(a), int(b)),) for a, b in layers]


def pinned_intra(pins: PinIndex, table: CostTable, runs, submesh, shape, stage: int,
                 solution: str = "fast") -> IntraPlan:
    """The table's IntraPlan of a mesh (its ``solution``) with the operator pins of the layers the stage runs
    (``runs``, see :func:`stage_runs`) applied (re-priced, not re-solved)."""
    _, base = table.mesh_costs(submesh, shape, solution)
    mine = pins.in_ranges(runs)
    if not mine:
        return base
    chosen = dict(base.strategies)
    for op, name in pins.with_siblings(mine).items():
        s = pins.strategy(op, submesh, shape, name)
        if s is None:
            raise ValueError(f"operator {pins.g.op(op).describe()} is pinned to {name!r}, which is not one of its "
                             f"strategies on stage {stage}'s {shape[0]}x{shape[1]} logical mesh; choose another "
                             "logical mesh for that stage, or pin the operator to a strategy of that mesh.")
        chosen[op] = s
    return LazyIntraPlan.with_strategies(pins.g, base.mesh, chosen, base.ops, pins.cache(submesh, shape), base.groups,
                                         base.solve_s)


def intras_around_pins(pins: PinIndex, table: CostTable, specs: Sequence[StageSpec], solver: str,
                       hook: Hook | None = None, solutions: Sequence[str] | None = None,
                       runs: Sequence[Sequence[Sequence[int]]] | None = None) -> list[IntraPlan]:
    """Each stage's IntraPlan: the table's solution of its mesh (``solutions[k]``: "fast", the default, or "lean",
    see :meth:`~autopar_lab.pricing.table.CostTable.solutions`), or, for a stage that runs pinned operators, the
    intra-op ILP of that mesh solved again with those pins fixed (a lean stage keeps its weights stored at their
    least around the user's pins, so it still fits where only the lean solution did). ``runs[k]``: the layer ranges
    stage k runs (:func:`stage_runs`; default: its own layers), whose pins it must hold."""
    runs = [(tuple(spec.layers),) for spec in specs] if runs is None else runs
    out = []
    for k, spec in enumerate(specs):
        if hook is not None:
            hook(f"intra-op ILP of stage {k} on {spec.logical_mesh[0]}x{spec.logical_mesh[1]}", k, len(specs))
        solution = "fast" if solutions is None else solutions[k]
        _, base = table.mesh_costs(spec.submesh, spec.logical_mesh, solution)
        mine = pins.in_ranges(runs[k])
        if not mine:
            out.append(base)
            continue
        cache = pins.cache(spec.submesh, spec.logical_mesh)
        fixed: dict[int, Any] = dict(lean_pins(pins.g, cache)) if solution == LEAN else {}
        fixed.update(pins.with_siblings(mine))  # the user's pins win over the lean storage
        options = IntraOptions(solver=solver, rounds=1)
        try:
            out.append(solve_intra(pins.g, base.mesh, base.ops, pins=fixed, options=options, cache=cache))
        except ValueError:  # a pin outside the axis-0 pass's choices: search both axes at once
            out.append(solve_intra(pins.g, base.mesh, base.ops, pins=fixed, options=options.with_axes("joint"),
                                   cache=cache))
    return out


# --------------------------------------------------------------------------------------------------------------
# The stage DP around pins


def constrained_candidates(table: CostTable, cluster: Cluster, constraints: StageConstraints | None,
                           pins: PinIndex | None, *, prune: bool = True, virtual_stages: int = 1):
    """The DP's candidates(start, end, submesh, B) from ``table``: every logical mesh x remat, less the meshes that
    cannot run a pinned operator, less the ranges the pinned cuts forbid. Pareto-pruned unless a per-stage pin
    (logical mesh, remat) could pick a dominated candidate.

    With ``virtual_stages`` > 1 (interleaved) the layers a stage runs are its chunks, which depend on every
    stage's layer count (:func:`stage_runs`), not on the range the DP prices; the DP cannot see them, so a mesh
    is offered only where it holds every operator pin of the model (never a stage that cannot run what it is
    given; a re-solve may then miss a layout that puts an unpinnable mesh where no pinned operator runs)."""
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
        span = (a, b) if virtual_stages == 1 else (0, L - 1)
        out = [table.stage(a, b, sub, shape, B, r, sol) for shape in shapes[sub]
               if pins is None or pins.mesh_ok(*span, sub, shape)
               for sol in table.solutions(sub, shape) for r in REMAT_CHOICES]
        return out if keep_all else pareto(out)

    return candidates


def solve_stages(plan: Plan, constraints: StageConstraints | None, microbatch_choices: Sequence[int],
                 schedule: Mapping[str, Any], mem_limit_bytes: float, pins: PinIndex | None, *, prune: bool = True):
    """The stage DP over the plan's table, around the stage pins (``constraints``) and on meshes that can run the
    operator pins, for each microbatch count (:func:`~autopar_lab.stagesearch.search_microbatches`), with the
    schedule keywords ``schedule`` (:func:`schedule_keywords`)."""
    table, cluster = table_of(plan), plan.cluster
    cands = constrained_candidates(table, cluster, constraints, pins, prune=prune,
                                   virtual_stages=int(schedule.get("virtual_stages", 1)))
    problem = dataclasses.replace(StageProblem.on(cluster, num_layers=len(table.layer_names)),
                                  mem_limit_bytes=mem_limit_bytes, stage_comm=plan.stage_comm, constraints=constraints,
                                  **schedule)
    return stagesearch.search_microbatches(
        table, problem, list(microbatch_choices), candidates=lambda B, _mem: (lambda a, b, sub: cands(a, b, sub, B)))


def solve_fixed_cuts(plan: Plan, ranges, constraints: StageConstraints, B: int, mem_limit_bytes: float,
                     pins: PinIndex):
    """The stage DP when the cuts are fixed, with the plan's schedule (:func:`schedule_keywords`): each stage's
    layer range becomes one "layer" of a problem with S layers and the same cluster, so the DP only chooses
    submeshes, logical meshes and remat (exactly the choice the full problem has with those cuts pinned, at a
    fraction of its size). An interleaved plan is solved on its full layers, the cuts pinned: its chunk transfers
    and its one-layer-per-chunk rule need them."""
    table, cluster = table_of(plan), plan.cluster
    sched = schedule_keywords(plan)
    S = len(ranges)
    if sched["schedule"] == "interleaved":
        full = StageConstraints(cuts=tuple(r[0] for r in ranges[1:]), submeshes=constraints.submeshes,
                                logical_meshes=constraints.logical_meshes, remat=constraints.remat)
        return solve_stages(plan, full, [B], sched, mem_limit_bytes, pins, prune=False)
    views: dict[tuple, list] = {}
    runs = stage_runs(ranges)

    def candidates(a, b, sub):
        if a != b:
            return []
        sub = tuple(sub)
        if sub not in views:
            views[sub] = cluster.logical_mesh_shapes(sub)
        first, last = ranges[a]
        return [table.stage(first, last, sub, shape, B, r, sol) for shape in views[sub]
                if pins.runs_ok(runs[a], sub, shape)
                for sol in table.solutions(sub, shape) for r in REMAT_CHOICES]

    con = StageConstraints(cuts=tuple(range(1, S)), submeshes=constraints.submeshes,
                           logical_meshes=constraints.logical_meshes, remat=constraints.remat)
    problem = dataclasses.replace(StageProblem.on(cluster, num_layers=S, microbatches=B),
                                  cut_bytes=[table.cut_bytes[r[0] - 1] / B for r in ranges[1:]],
                                  mem_limit_bytes=mem_limit_bytes, stage_comm=plan.stage_comm, constraints=con, **sched)
    return stage_dp(problem, candidates)


# --------------------------------------------------------------------------------------------------------------
# Resolve


def resolve(plan: Plan, *, solver: str | None = None, on_progress: Hook | None = None) -> Plan:
    """Re-solve every decision that is not pinned, around the pins.

    1. The stage DP runs again over the plan's cost table with the stage pins as constraints (pinned cuts,
       submeshes, logical meshes, remat flags, microbatch count), with the formula and memory of the plan's
       schedule (:func:`schedule_keywords`: pinned or not, an interleaved plan keeps its chunk count) and only on
       logical meshes where every pinned operator a stage runs (its chunks when interleaved, see
       :func:`constrained_candidates`) has its pinned strategy. The DP prices stages with the table's unpinned
       sharding (a pin can only make its stage slower; the final plan is priced exactly).
    2. Each chosen stage that runs pinned operators (:func:`stage_runs`) gets the intra-op ILP again with those pins
       fixed; the other stages take the table's solution for their mesh (the one the DP chose, recorded as
       ``Stage.solution``).

    ``on_progress(message, done, total)`` hears of each stage's ILP (the stage DP reports through the table's
    ``on_progress``, as every DP over it does). Raises ValueError naming the operator when a pinned strategy exists
    on no mesh of the cluster, and
    :class:`~autopar_lab.solve.inter.NoFeasiblePlanError` (with ``min_mem_bytes``, the smallest memory per device
    the pins need) when the pins do not fit in memory.
    """
    t0 = time.perf_counter()
    table = table_of(plan)
    pins = PinIndex(plan)
    for op, p in plan.pins.items():
        if not pins.anywhere(op):
            where = " in its layer" if p.scope == LAYER else ""
            raise ValueError(f"operator {plan.graph.op(op).describe()} is pinned{where} to {p.strategy!r}, which is a "
                             "strategy of it on no logical mesh of this cluster; pin it to another strategy.")
    sp = dict(plan.stage_pins)
    constraints = constraints_of(sp)
    sched = schedule_keywords(plan)
    v = int(sched.get("virtual_stages", 1))
    choices = [sp["microbatches"]] if "microbatches" in sp else stagesearch.microbatch_choices(table.batch_size, "auto")
    mem = plan.cost.mem_limit_bytes
    try:
        res = solve_stages(plan, constraints, choices, sched, mem, pins if plan.pins else None)
    except NoFeasiblePlanError as e:
        if plan.pins and e.min_mem_bytes == float("inf"):
            raise NoFeasiblePlanError(f"{e} (operator pins limit each stage to the logical meshes that have the "
                                      f"pinned strategies: {_pins_text(plan.pins)})", e.min_mem_bytes) from None
        raise
    specs = [StageSpec(c.layers, c.submesh, c.logical_mesh, c.remat) for c in res.stages]
    solutions = [c.solution for c in res.stages]
    runs = stage_runs([s.layers for s in specs], v)
    intras = intras_around_pins(pins, table, specs, solver or table.solver, on_progress, solutions=solutions,
                                runs=runs)
    solve_s = {**dict(plan.solve_s), "resolve": time.perf_counter() - t0}
    kw = dict(microbatches=res.microbatches, schedule=sched["schedule"], mem_limit_bytes=mem,
              layer_pins=pins.layer_pins, virtual_stages=v if v > 1 else None, zero=sp.get("zero"),
              overlap=sp.get("overlap"), host=sp.get("host"), accumulate=sp.get("accumulate"),
              eager_loss=sp.get("eager_loss"), microbatch_group=sp.get("microbatch_group"))
    # the pins as given, recorded where the rules say (a plan made by hand may hold a shared pin on any block)
    fields = dict(microbatches=res.microbatches, solve_s=solve_s, stage_pins=sp,
                  pins=operators.normalised_pins(plan, plan.pins))
    out = price_stages(table, specs, intras=intras, solutions=solutions, **kw).onto(plan, **fields)
    # The ILP minimises its own objective, not the simulated step time, so a re-solved stage can come out a hair
    # slower than the user's overridden one. Where a stage is unchanged in layout and its old sharding honours
    # every pin of the layers it runs, keep that sharding if it wins.
    old = {StageSpec(st.layers, st.submesh, st.logical_mesh, st.remat): st for st in plan.stages}
    kept, costs, kept_solutions = [], [], []
    for spec, intra, run, solution in zip(specs, intras, runs, solutions):
        st = old.get(spec)
        if pins.in_ranges(run) and st is not None and st.intra is not None and pins.honoured_by(st.intra, run):
            kept.append(st.intra)
            costs.append(st.layer_costs)
            kept_solutions.append(st.solution)
        else:
            kept.append(intra)
            costs.append(None)
            kept_solutions.append(solution)
    if any(a is not b for a, b in zip(kept, intras)):
        alt = price_stages(table, specs, intras=kept, layer_costs=costs, solutions=kept_solutions, **kw).onto(
            plan, **fields)
        if alt.cost.step_time_s < out.cost.step_time_s:
            return alt
    return out


def solve_intra_around_pins(plan: Plan, *, solver: str | None = None, on_progress: Hook | None = None) -> Plan:
    """The same stages, each stage's operators from the intra-op ILP of its mesh, re-solved around its pins
    (an operator that is no longer pinned goes back to the ILP's choice)."""
    table = table_of(plan)
    specs = [StageSpec(st.layers, st.submesh, st.logical_mesh, st.remat) for st in plan.stages]
    runs = stage_runs([s.layers for s in specs], plan.virtual_stages)
    solutions = [st.solution for st in plan.stages]
    intras = intras_around_pins(PinIndex(plan), table, specs, solver or table.solver, on_progress,
                                solutions=solutions, runs=runs)
    return price_stages(table, specs, intras=intras, solutions=solutions, microbatches=plan.microbatches,
                        schedule=plan.schedule, mem_limit_bytes=plan.cost.mem_limit_bytes,
                        layer_pins=layer_scoped(plan.pins), zero=plan.stage_pins.get("zero"),
                        overlap=plan.stage_pins.get("overlap"), host=plan.stage_pins.get("host"),
                        accumulate=plan.stage_pins.get("accumulate"),
                        eager_loss=plan.stage_pins.get("eager_loss"),
                        microbatch_group=plan.stage_pins.get("microbatch_group"),
                        virtual_stages=plan.virtual_stages if plan.virtual_stages > 1 else None).onto(plan)


# --------------------------------------------------------------------------------------------------------------
# What-if re-plans


def _stage_pins_that_hold(stage_pins: Mapping[str, Any], plan: Plan) -> tuple[dict, list[str]]:
    """The stage pins that still describe a valid choice on ``plan``'s model and cluster, and why the others
    do not."""
    cluster, L = plan.cluster, len(plan.layer_names)
    batch = table_of(plan).batch_size
    kept, dropped = {}, []
    for key, value in stage_pins.items():
        try:
            if key == "boundaries":
                stage_ranges(value, L)
            elif key == "submeshes" and any(v is None for v in value):  # some left to the DP: each a shape
                valid = {tuple(sh) for sh in cluster.submesh_shapes()}
                bad = [v for v in value if v is not None and tuple(v) not in valid]
                if bad:
                    raise ValueError(f"{tuple(bad[0])} is not a submesh shape of this cluster")
            elif key == "submeshes":
                check_submeshes(cluster, value)
            elif key == "logical_meshes":
                views = {tuple(v) for sub in cluster.submesh_shapes() for v in cluster.logical_mesh_shapes(sub)}
                bad = [v for v in value if v is not None and tuple(v) not in views]
                if bad:
                    raise ValueError(f"{tuple(bad[0])} is a logical mesh of no submesh of this cluster")
            elif key == "microbatches":
                stagesearch.microbatch_choices(batch, value)
        except ValueError as e:
            dropped.append(f"stage pin {key}={value!r} dropped: {str(e).rstrip('.')}.")
            continue
        kept[key] = value
    return kept, dropped


def keep_pins(plan: Plan, old: Plan, *, solver: str = DEFAULT_SOLVER,
              on_progress: Hook | None = None) -> tuple[Plan, list[str]]:
    """``plan`` (a fresh solve, e.g. on another cluster) re-solved around every pin of ``old`` that still holds, and
    one message per pin dropped, saying which and why.

    An operator pin holds when the model's graph is the same and some logical mesh of the new cluster has the
    pinned strategy; a stage pin when it still describes a valid choice (boundaries inside the model, submeshes that
    tile the new cluster, logical meshes it has, a microbatch count dividing the batch). When the pins that hold
    cannot all be kept together (no layout keeping them fits in memory), the stage pins are dropped first, then the
    operator pins, each with the reason.
    """
    if not old.pins and not old.stage_pins:
        return plan, []
    messages: list[str] = []
    if not same_graph(old, plan):
        n = len(old.pins) + len(old.stage_pins)
        return plan, [f"{n} pin(s) dropped: the new plan is of another graph, whose operators they do not name."]
    pins = PinIndex(plan, old.pins)
    op_pins = {}
    for op, p in old.pins.items():
        if pins.anywhere(op):
            op_pins[op] = p
        else:
            where = " in its layer" if p.scope == LAYER else ""
            messages.append(f"pin of operator {plan.graph.op(op).describe()}{where} to {p.strategy!r} dropped: no "
                            "logical mesh of the new cluster has that strategy.")
    stage_pins, dropped = _stage_pins_that_hold(old.stage_pins, plan)
    messages += dropped
    if not op_pins and not stage_pins:
        return plan, messages
    if on_progress is not None:
        on_progress("re-solving around the pins")
    # Operator pins (shared and of split layers) go together: a split layer's pins assume its solution's.
    attempts = [(op_pins, stage_pins)]
    if stage_pins:
        attempts.append((op_pins, {}))
    if op_pins:
        attempts.append(({}, {}))
    last: Exception | None = None
    for ops, stages in attempts:
        if not ops and not stages:
            break
        try:
            out = resolve(dataclasses.replace(plan, pins=dict(ops), stage_pins=dict(stages)), solver=solver)
        except (ValueError, NoFeasiblePlanError) as e:
            last = e
            continue
        if last is not None:
            what = []
            if stage_pins and not stages:
                what.append(f"stage pins {sorted(stage_pins)}")
            if op_pins and not ops:
                what.append(f"operator pins {sorted(op_pins)}")
            messages.append(f"{' and '.join(what)} dropped: the new cluster cannot keep them all "
                            f"({str(last).rstrip('.')}).")
        return out, messages
    messages.append(f"every pin dropped: the new cluster cannot keep them ({str(last).rstrip('.')}).")
    return plan, messages


def same_graph(old: Plan, new: Plan) -> bool:
    """Whether ``new``'s operators are ``old``'s (pins name them): the same graph, or for a model planned on a
    shallower copy the same copy and the same layers (the full graph is then the same model's, not traced again to
    be compared)."""
    if old.graph is new.graph:
        return True
    copied = old.op_graph is not old.graph
    if copied != (new.op_graph is not new.graph) or list(old.layer_names) != list(new.layer_names):
        return False
    return old.op_graph.fingerprint == new.op_graph.fingerprint


def _pins_text(pins: Mapping[int, Pin]) -> str:
    return "{" + ", ".join(f"{op}: {p.strategy!r}" + (" (its layer)" if p.scope == LAYER else "")
                           for op, p in sorted(pins.items())) + "}"
