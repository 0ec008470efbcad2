"""From a framework's layout to a priced plan: the one path Megatron-LM's, torchtitan's and MaxText's layouts take.

A :class:`Layout` holds everything a framework decides: the pipeline's stages (equal runs of transformer blocks, the
embedding with the first and the head with the last, :func:`stage_bounds`), each stage's submesh and logical mesh with
the roles of its axes (:class:`~autopar_lab.layouts.config.MeshRoles`), the microbatches, schedule, recomputation,
ZeRO stage and sequence parallelism. :func:`price_layout` solves each stage mesh's intra-op ILP around the layout's
pins (:func:`~autopar_lab.layouts.shardpins.layout_pins`; a layout with nothing to pin takes the cost table's own
solution) and hands the decisions to :func:`~autopar_lab.pricing.price.price_plan`.

Memory (issue 31): a layout that names its ZeRO stage is priced with it (``stage_pins["zero"]``,
:mod:`autopar_lab.pricing.zero`). One that leaves the storage open (``zero=None``) gets the ILP's fastest storage;
every stage that then overflows is priced with its state stored at its least instead (the memory-lean solution: every
parameter and optimizer state split over the data-parallel group on top of its tensor split, decided per stage), and
the plan's explain() says what was sharded and what it saved. A plan that still does not fit says which part of which
stage overflows by how much (:func:`~autopar_lab.layouts.fit.overflow_note`).

Pinned solutions are kept per cost table, mesh and pins (a grid of Megatron configurations solves each once).
"""

from __future__ import annotations

import dataclasses
import math
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from .. import checks
from ..backends import on_cpu
from ..backends import kernel_share
from ..graph.fusion import attach_kernel_roles, kernel_view
from ..graph.opgraph import FORWARD, UPDATE, cast_kernels
from ..plan import Plan
from ..planning import planning_times
from ..plan import price_plan
from ..pricing.price import StepAbove
from ..pricing.table_pool import LEAN as TABLE_LEAN
from ..schedules import interleave
from ..simulate import makespan_floor
from ..solve.ilp import DEFAULT_SOLVER
from ..solve.intra import IntraOptions, solve_intra
from .config import MeshRoles
from .fit import lean_note, overflow_note
from .roles import find_roles
from .shardpins import LEAN, layout_pins

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..pricing import CostTable, LayerCost
    from ..solve.intra import IntraPlan

__all__ = ["MICRO_BATCH_SIZES", "Layout", "Solution", "check_experts", "compute_floor", "eager_host",
           "layout_solution", "least_compute", "micro_batch_sizes",
           "microbatch_counts", "microbatches_for", "price_fastest", "price_layout",
           "stage_bounds", "stage_submesh"]


@dataclass(frozen=True)
class Layout:
    """Everything a framework's layout decides about one training step (see the module docstring). ``method``: the
    plan's name; ``stages``: the pipeline's stage count; ``submesh``: each stage's devices; ``mesh``: each stage's
    logical mesh and its axes' roles; ``notes``: what the plan should say about the layout (approximations);
    ``pin_roles``: False leaves every operator's sharding to the ILP (only the storage a ZeRO stage names is
    pinned); ``lean``: False keeps the storage as the ILP chose it where it overflows (what the layout would need)
    instead of the memory-lean solution; ``overlap``: the communication the framework hides behind compute
    (:mod:`~autopar_lab.pricing.overlap`; None: the pricing's default); ``host``: "eager" where the framework
    launches each kernel from Python (:mod:`autopar_lab.backends.eager`), None for compiled programs;
    ``accumulate``: "unsharded" where the framework holds the gradients unsharded between microbatches
    (:mod:`~autopar_lab.pricing.accumulate`), None where it reduces them as the strategies store them;
    ``eager_loss``: the bytes a device holds a step of the loss an eager framework computes after the model
    (:mod:`~autopar_lab.pricing.eagerloss`), None for the traced step's own; ``microbatch_group``: the interleaved
    schedule's microbatches per chunk in a row (:func:`~autopar_lab.schedules.check_group`), None for the stage
    count."""

    method: str
    stages: int
    submesh: tuple[int, int]
    mesh: MeshRoles
    microbatches: int
    remat: bool | str = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int | None = None
    sequence_parallel: bool = False
    notes: tuple[str, ...] = ()
    pin_roles: bool = True
    lean: bool = True
    overlap: tuple[str, ...] | None = None
    host: str | None = None
    accumulate: str | None = None
    eager_loss: float | None = None
    microbatch_group: int | None = None

    def with_(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Solution:
    """A stage mesh's sharding under a layout: its IntraPlan on the table's solve graph, the full graph's layer costs,
    the roles left to the ILP (``free``), the seconds its ILP took, and ``table_solution`` (``"fast"`` or ``"lean"``)
    when it is the cost table's own (nothing pinned), else None."""

    intra: IntraPlan
    costs: tuple[LayerCost, ...]
    free: tuple[str, ...] = ()
    solve_s: float = 0.0
    table_solution: str | None = None


# table -> {(submesh, mesh key, storage, sequence parallel, solver): Solution}
_SOLVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# table -> {(submesh, mesh shape): (forward, backward) least compute seconds of each full-graph layer}
_LEAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# table -> the sequential solve's first passes (shared by the meshes whose axis 0 is the same)
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layout_solution(table: CostTable, submesh: tuple[int, int], mesh: MeshRoles, *, storage=None,
                    sequence_parallel: bool = False, solver: str = DEFAULT_SOLVER, pin_roles: bool = True) -> Solution:
    """The sharding of ``submesh`` viewed as ``mesh`` under the layout's pins (``storage``: None, a ZeRO stage or
    :data:`~autopar_lab.layouts.shardpins.LEAN`): the pinned ILP's, or with nothing to pin the table's own (its
    fast solution, or for ``LEAN`` its memory-lean one)."""
    key = (tuple(submesh), mesh.key(), storage, bool(sequence_parallel), solver, pin_roles)
    memo = _SOLVED.setdefault(table, {})
    if key in memo:
        return memo[key]
    lmesh = table.cluster.logical_mesh(submesh, mesh.shape)
    cache = table.strategy_cache(lmesh)
    pinned = layout_pins(table.solve_graph, find_roles(table.solve_graph), mesh, cache, storage=storage,
                         sequence_parallel=sequence_parallel, roles_pinned=pin_roles)
    if not pinned.pins:
        which = TABLE_LEAN if storage == LEAN else "fast"
        if which == TABLE_LEAN:
            table.solve_lean([(tuple(submesh), tuple(mesh.shape))], workers=1)
            if TABLE_LEAN not in table.solutions(submesh, mesh.shape):  # the fast solution is already the least
                which = "fast"
        costs, intra = table.mesh_costs(submesh, mesh.shape, which)
        out = Solution(intra, tuple(costs), pinned.free, 0.0, which)
    else:
        t0 = time.perf_counter()
        # State sharded over the data-parallel axis is updated where it lies only if the ILP sees both axes at once:
        # the sequential solve's first pass (axis 0 alone, without pins) runs the optimizer's update whole over the
        # data-parallel axis, which would gather the sharded state back every step.
        axes = "joint" if storage in (1, 2, 3, LEAN) else "auto"
        intra = solve_intra(table.solve_graph, lmesh, pins=pinned.pins, cache=cache, memo=_MEMO.setdefault(table, {}),
                            options=IntraOptions(solver=solver, rounds=1, axes=axes))
        costs = table.layer_costs_of(intra)
        out = Solution(intra, tuple(costs), pinned.free, time.perf_counter() - t0)
    memo[key] = out
    return out


def least_compute(table: CostTable, submesh: tuple[int, int], shape) -> tuple[list[float], ...]:
    """Each full-graph layer's least (forward, backward) seconds a step over every sharding of ``submesh`` viewed as
    ``shape``, and its kernel launches' seconds a microbatch (forward, backward), counted in its layer as
    :func:`~autopar_lab.pricing.layers.layer_costs` counts them: every operator at its cheapest strategy's
    ``compute_s`` (an operator's compute depends on its own strategy alone; the update with the backward, its
    kernels launched once a step), and each kernel's launch, which no strategy changes. No ILP: it reads the mesh's
    strategy lists, which the ILP reads too."""
    key = (tuple(submesh), tuple(shape))
    memo = _LEAST.setdefault(table, {})
    if key not in memo:
        g = table.solve_graph
        lmesh = table.cluster.logical_mesh(submesh, shape)
        device = lmesh.cluster.device
        eager = not device.efficiency.kernel_fusion
        attach_kernel_roles(g, eager=eager)
        view = kernel_view(g, device.efficiency.flash_attention, eager=eager)
        launch = device.efficiency.kernel_launch_s * kernel_share(lmesh)
        cache = table.strategy_cache(lmesh)
        names = list(g.layers) or [""]
        index: dict[str | None, int] = {name: k for k, name in enumerate(names)}
        fwd, bwd, lf, lb = ([0.0] * len(names) for _ in range(4))
        for node in g:
            k = index.get(node.layer, len(names) - 1)
            least = min((s.compute_s for s in cache.strategies(node)), default=0.0)
            role = view.roles.get(node.id)
            kernels = (1 if role is not None and role.root else 0) + cast_kernels(node)
            if node.role == FORWARD:
                fwd[k] += least
                lf[k] += kernels * launch
            elif node.role == UPDATE:
                bwd[k] += least + kernels * launch
            else:
                bwd[k] += least
                lb[k] += kernels * launch
        memo[key] = tuple([x[k] for k in table.layer_map] for x in (fwd, bwd, lf, lb))
    return memo[key]


def compute_floor(table: CostTable, layout: Layout) -> float:
    """A lower bound on ``layout``'s priced step (:func:`price_layout`), from :func:`least_compute` alone, before its
    ILP: each stage's (each chunk's) forward and backward a microbatch at least its layers' least compute over the
    microbatches, their launches and its tasks' overhead (the priced times add communication, recomputation and the
    host to those, and hide only communication), through :func:`~autopar_lab.simulate.makespan_floor` with free
    transfers (the floor only grows with every time it reads). The frameworks' grids skip a layout whose floor cannot
    beat the best so far without solving its ILP."""
    fwd, bwd, lf, lb = least_compute(table, layout.submesh, layout.mesh.shape)
    bounds = stage_bounds(table, layout.stages)
    ranges = [(bounds[k], bounds[k + 1] - 1) for k in range(layout.stages)]
    v = layout.virtual_stages if layout.schedule == "interleaved" else 1
    chunks = interleave(ranges, v) if v > 1 else [(r,) for r in ranges]
    order = [chunks[c % layout.stages][c // layout.stages] for c in range(layout.stages * v)]
    B = layout.microbatches
    f, w = [], []
    for a, b in order:
        task, _arrays = table.task_charge(a, b, layout.submesh, B)
        f.append(sum(fwd[a:b + 1]) / B + sum(lf[a:b + 1]) + task)
        w.append(sum(bwd[a:b + 1]) / B + sum(lb[a:b + 1]) + task + task / B)
    return makespan_floor(f, w, B, layout.schedule, virtual_stages=v if v > 1 else None)


def cluster_running(cluster, table, field: str, value: bool | None, what: str):
    """The cluster to build a layout's cost table on when the framework decides how the device runs a kernel (a
    field of :class:`~autopar_lab.cluster.Efficiency`: ``flash_attention``, ``kernel_fusion``,
    ``library_kernels``): ``cluster`` (a Cluster or its name) with ``field`` set to ``value``; ``value`` None keeps
    it. With a ``table`` instead, the
    table's cluster is used as built, and a ``value`` that disagrees with it raises one ValueError naming ``what``
    (the framework's argument) and how to build a table that agrees.

    >>> cluster_running("dgx-h100:1", None, "kernel_fusion", False, "compile").device.efficiency.kernel_fusion
    False
    """
    from ..cluster import Cluster

    if table is not None:
        if value is not None and getattr(table.cluster.device.efficiency, field) != value:
            raise ValueError(f"the cost table was built with {field}={not value}, but {what} asks for "
                             f"{field}={value}; build it on cluster.with_({field}={value}), or leave {what} out to "
                             "keep the table's")
        return cluster
    if cluster is None or value is None:
        return cluster
    if not isinstance(cluster, Cluster):
        cluster = Cluster.parse(cluster)
    return cluster.with_(**{field: bool(value)})


def eager_host(cluster: Cluster, host: str, eager: bool) -> str | None:
    """A layout's ``host`` (:class:`Layout`): ``host`` ("eager" or "eager-te", :mod:`autopar_lab.backends.eager`)
    where the framework runs ``eager`` on a GPU, None where it runs compiled programs or the plan runs on the CPU's
    devices (this library's JAX runtime, whose dispatch the CPU's calibration prices).

    >>> from autopar_lab.cluster import Cluster
    >>> eager_host(Cluster.preset("dgx-h100"), "eager", True), eager_host(Cluster.preset("cpu"), "eager", True)
    ('eager', None)
    """
    return host if eager and not on_cpu(cluster) else None


def stage_submesh(cluster: Cluster, devices: int) -> tuple[int, int]:
    """The submesh of a stage of ``devices`` devices: part of a host, or whole hosts (a ValueError otherwise)."""
    M = cluster.devices_per_host
    sub = (1, devices) if devices <= M else (devices // M, M)
    if sub not in [tuple(s) for s in cluster.submesh_shapes()] or sub[0] * sub[1] != devices:
        raise ValueError(f"a stage of {devices} devices is not a submesh shape of this cluster (part of a host of "
                         f"{M} in powers of two, or whole hosts); change the degrees")
    return sub


def microbatches_for(batch: int, dp: int, microbatches: int | None, micro_batch_size: int | None) -> int:
    """The microbatch count: ``microbatches`` (default 1), or the global ``batch`` over ``dp x micro_batch_size``
    (Megatron-LM's ``--micro-batch-size``); both given, they must agree.

    >>> microbatches_for(512, 32, None, 1), microbatches_for(512, 32, 8, None)
    (16, 8)
    """
    if micro_batch_size is None:
        return 1 if microbatches is None else checks.whole(microbatches, "microbatches")
    mbs = checks.whole(micro_batch_size, "micro_batch_size")
    if batch % (dp * mbs):
        raise ValueError(f"the global batch of {batch} does not split into dp={dp} replicas of microbatches of "
                         f"{mbs}; pick a micro_batch_size dividing {batch // dp if batch % dp == 0 else batch}")
    n = batch // (dp * mbs)
    if microbatches is not None and checks.whole(microbatches, "microbatches") != n:
        raise ValueError(f"microbatches={microbatches} disagrees with micro_batch_size={mbs} (the global batch "
                         f"{batch} / (dp {dp} x {mbs}) = {n} microbatches); pass one of the two")
    return n


#: The micro-batch sizes (sequences a data-parallel rank takes a microbatch) that ``microbatches="auto"`` and the
#: frameworks' grids try: Megatron-LM's and torchtitan's usual ``--micro-batch-size`` / ``local_batch_size``.
MICRO_BATCH_SIZES = (1, 2, 4, 8)


def micro_batch_sizes(batch: int, dp: int) -> list[int]:
    """Those of :data:`MICRO_BATCH_SIZES` that split each of ``dp`` replicas' share of the global ``batch``.

    >>> micro_batch_sizes(512, 4), micro_batch_sizes(12, 4), micro_batch_sizes(10, 4)
    ([1, 2, 4, 8], [1], [])
    """
    return [m for m in MICRO_BATCH_SIZES if batch % dp == 0 and (batch // dp) % m == 0]


def microbatch_counts(batch: int, dp: int, microbatches: int | str | None,
                      micro_batch_size: int | None) -> list[int]:
    """The microbatch counts a layout is priced at: the one :func:`microbatches_for` gives, or with
    ``microbatches="auto"`` one for each of :func:`micro_batch_sizes` (the global batch over ``dp`` x that size),
    fewest first (one microbatch where no size splits the replicas' share).

    >>> microbatch_counts(512, 4, "auto", None), microbatch_counts(512, 4, 16, None)
    ([16, 32, 64, 128], [16])
    >>> microbatch_counts(4, 8, "auto", None)
    [1]
    """
    if microbatches != "auto":
        return [microbatches_for(batch, dp, microbatches, micro_batch_size)]  # type: ignore[arg-type]
    if micro_batch_size is not None:
        raise ValueError("microbatches='auto' searches the micro-batch size: pass micro_batch_size or "
                         "microbatches='auto', not both")
    sizes = micro_batch_sizes(batch, dp)
    if not sizes:  # the batch does not split evenly over the replicas: one microbatch, as without "auto"
        return [1]
    return [batch // (dp * m) for m in reversed(sizes)]


def price_fastest(table: CostTable, layouts: list[Layout], dp: int, **kw) -> Plan:
    """:func:`price_layout` of the one layout, or of several (one layout at several microbatch counts:
    ``microbatches="auto"``) the fastest plan that fits, else the one that needs least memory; its notes say which
    count was kept of which (and its micro-batch size: the global batch over ``dp`` x the count). ``kw``:
    :func:`price_layout`'s keywords (a layout whose step cannot beat ``skip_above`` is left out; all of them:
    :class:`~autopar_lab.pricing.price.StepAbove`)."""
    if len(layouts) == 1:
        return price_layout(table, layouts[0], **kw)
    plans: list[Plan] = []
    above: StepAbove | None = None
    for layout in layouts:
        try:
            plans.append(price_layout(table, layout, **kw))
        except StepAbove as e:
            above = e
    if not plans:
        assert above is not None
        raise above
    fitting = [p for p in plans if p.cost.fits]
    best = min(fitting, key=lambda p: p.cost.step_time_s) if fitting else \
        min(plans, key=lambda p: max(p.cost.peak_mem_bytes))
    why = "the fastest that fits" if fitting else "none fits: the one needing least memory"
    mbs = table.batch_size // (dp * best.microbatches)
    count = f"{best.microbatches} microbatch{'' if best.microbatches == 1 else 'es'}"
    note = (f"microbatches auto: {count} (micro-batch size {mbs}) of "
            f"{', '.join(str(p.microbatches) for p in plans)} priced, {why}")
    return dataclasses.replace(best, notes=(*best.notes, note))


def check_experts(table: CostTable, ep: int) -> None:
    """A ValueError unless ``ep`` (the expert-parallel degree) divides every MoE layer's expert count."""
    if ep == 1:
        return
    g = table.solve_graph
    counts = sorted({int(g.op(r.op).in_shapes[r.weight][r.split]) for r in find_roles(g).of_kind("expert")
                     if r.weight is not None and r.split is not None})
    if not counts:
        raise ValueError(f"ep={ep} splits experts, but this model has no MoE layer; pass ep=1")
    bad = [n for n in counts if n % ep]
    if bad:
        raise ValueError(f"ep={ep} does not divide the model's {bad[0]} experts; pass a divisor of {bad[0]}")


def stage_bounds(table: CostTable, stages: int) -> list[int]:
    """The first layer of each of ``stages`` stages and the layer count: Megatron-LM's split, ``l / p`` transformer
    blocks a stage, the layers before the first block (the embedding) with the first stage and those after the last
    (the head) with the last; where the blocks are not found or do not divide, equal runs of all the layers."""
    L = len(table.layer_names)
    names = list(table.solve_graph.layers)
    blocks = set(find_roles(table.solve_graph).blocks)
    inside = [k for k in range(L) if names and names[table.layer_map[k]] in blocks]
    if inside and inside == list(range(inside[0], inside[-1] + 1)) and len(inside) % stages == 0 \
            and len(inside) >= stages:
        per = len(inside) // stages
        return [0] + [inside[0] + per * j for j in range(1, stages)] + [L]
    return [round(k * L / stages) for k in range(stages + 1)]


def price_layout(table: CostTable, layout: Layout, *, mem_limit_bytes: float | None = None,
                 solver: str = DEFAULT_SOLVER, solve_s: Mapping[str, float] | None = None,
                 skip_above: float = math.inf) -> Plan:
    """``layout`` priced by ``table`` (see the module docstring); ``solve_s``: the phases so far (tracing);
    ``skip_above``: a step time to beat (:func:`~autopar_lab.plan.price_plan`'s: a layout whose step cannot beat it
    raises :class:`~autopar_lab.pricing.price.StepAbove` unsimulated; so does its memory-lean retry, whose gathers
    only add to the step)."""
    t0 = time.perf_counter()
    if skip_above < math.inf:  # before the ILP: a layout whose compute alone cannot beat the step is not solved
        floor = compute_floor(table, layout)
        if floor > skip_above:
            raise StepAbove(floor)
    p = layout.stages
    bounds = stage_bounds(table, p)
    stages = [((bounds[k], bounds[k + 1] - 1), layout.submesh, layout.mesh.shape, layout.remat) for k in range(p)]
    sols = [layout_solution(table, layout.submesh, layout.mesh, storage=layout.zero,
                            sequence_parallel=layout.sequence_parallel, solver=solver,
                            pin_roles=layout.pin_roles)] * p
    spent = sols[0].solve_s
    notes = list(layout.notes)
    if sols[0].free:
        notes.append("left to the ILP (no strategy on this mesh is the layout's): " + ", ".join(sols[0].free[:8])
                     + (", ..." if len(sols[0].free) > 8 else ""))
    stage_pins: dict = {"zero": layout.zero} if layout.zero is not None else {}
    if layout.overlap is not None:
        stage_pins["overlap"] = layout.overlap
    if layout.host is not None:
        stage_pins["host"] = layout.host
    if layout.accumulate is not None:
        stage_pins["accumulate"] = layout.accumulate
    if layout.eager_loss is not None:
        stage_pins["eager_loss"] = layout.eager_loss
    if layout.microbatch_group is not None and layout.schedule == "interleaved":
        stage_pins["microbatch_group"] = layout.microbatch_group

    def priced(sol_list) -> Plan:
        times = dict(solve_s or {})
        times["layout"] = spent + time.perf_counter() - t0
        return price_plan(table, stages, microbatches=layout.microbatches, schedule=layout.schedule,
                          virtual_stages=layout.virtual_stages if layout.schedule == "interleaved" else None,
                          stage_comm="model", mem_limit_bytes=mem_limit_bytes, method=layout.method,
                          intras=[s.intra for s in sol_list], layer_costs=[list(s.costs) for s in sol_list],
                          solutions=[s.table_solution or ("lean" if s is not sols[0] else "fast") for s in sol_list],
                          stage_pins=stage_pins, notes=tuple(notes), solve_s=planning_times(table, times),
                          skip_above=skip_above)

    plan = priced(sols)
    fit = ""
    if not plan.cost.fits and layout.zero is None and layout.lean:
        limit = plan.cost.mem_limit_bytes
        over = [k for k, m in enumerate(plan.cost.peak_mem_bytes) if m > limit]
        lean = layout_solution(table, layout.submesh, layout.mesh, storage=LEAN,
                               sequence_parallel=layout.sequence_parallel, solver=solver,
                               pin_roles=layout.pin_roles)
        spent += lean.solve_s
        if lean.intra is not sols[0].intra:
            mixed = [lean if k in over else s for k, s in enumerate(sols)]
            leaner = priced(mixed)
            axes = layout.mesh.useful(layout.mesh.zero)
            group = " x ".join(str(layout.mesh.shape[a]) for a in axes) or "1"
            fit = lean_note(over, [plan.cost.peak_mem_bytes[k] for k in over],
                            [leaner.cost.peak_mem_bytes[k] for k in over],
                            f"the parameters and optimizer state of {len(over)} of {p} stage(s) are stored at their "
                            f"least, split over the {group} data-parallel devices as well as the tensor split "
                            "(ZeRO-3 storage, the memory-lean solution)")
            plan = leaner
    if not plan.cost.fits:
        fit = "; ".join(x for x in (fit, overflow_note(plan)) if x)
    if fit:
        plan = dataclasses.replace(plan, notes=(*plan.notes, fit), cost=dataclasses.replace(plan.cost, fit_note=fit))
    return plan
