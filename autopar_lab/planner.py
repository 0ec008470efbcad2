"""Whole plans: Alpa's two levels together (:func:`auto_plan`), and the hand-made baselines they are measured against.

Planning makes decisions; :mod:`autopar_lab.pricing` prices them:

1. A :class:`~autopar_lab.pricing.table.CostTable` holds each logical mesh's layer costs (one intra-operator ILP per
   mesh, :func:`~autopar_lab.solve.intra.solve_intra`); a zoo model is solved on a copy with fewer layers (its
   repeated layers are identical), so planning GPT-39B needs a 4-layer trace per mesh, not a 48-layer one. A table
   is a value: build it once (``CostTable.build(model, cluster)``) and pass it as ``table=`` to every function here.
2. A stage's per-microbatch times and memory come from the one stage-cost formula
   (:func:`~autopar_lab.pricing.stage.stage_cost`: layer costs over the microbatch count, a launch overhead per
   heavy operator, the device's per-task overhead, rematerialisation).
3. The stage DP (:func:`~autopar_lab.solve.inter.stage_dp`) picks stages, submeshes and logical meshes for each
   microbatch count (:func:`search_microbatches`); the plan's step time is the makespan of the event-level
   simulation of that pipeline (:func:`~autopar_lab.plan.price_plan`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, Callable, Sequence


from . import checks, layouts
from .plan import Plan, price_plan
from .planning import planning_times, table_for  # noqa: F401 - their old home (re-exported)
from .precision import Precision
from .pricing import (  # noqa: F401 - names this module has always offered (notebooks and user code import them)
    LAUNCH_OVERHEAD_S,
    CostTable,
    LayerCost,
    cut_bytes,
    distinct_mesh_shapes,
    layer_costs,
    mesh_signature,
    pareto,
)
from .pricing.price import StepAbove
from .pricing.table_pool import default_workers
from .rematmode import REMAT_CHOICES, is_full, is_selective, remat_value
from .solve import inter
from .schedules import check_schedule
from .solve.ilp import DEFAULT_SOLVER
from .stagesearch import (  # noqa: F401 - names this module has always offered
    LAYER_GRID_MAX,
    CandidateFactory,
    layer_grid,
    microbatch_choices,
    search_microbatches,
    wgrad_share,
)

if TYPE_CHECKING:
    from .cluster import Cluster

ProgressFn = Callable[[str, int, int], None]




#: What ``schedule="auto"`` tries: (schedule, virtual stages), each planned by the stage DP with its own formula.
AUTO_SCHEDULES = (("1f1b", None), ("interleaved", 2), ("interleaved", 4), ("zb-h1", None))


def auto_plan(model=None, cluster: Cluster | None = None, *, microbatches="auto", stage_comm: str = "model",
              schedule: str = "1f1b", mem_limit_bytes: float | None = None, solver: str = DEFAULT_SOLVER,
              max_stages: int | None = None, on_progress: ProgressFn | None = None,
              table: CostTable | None = None, space: str = "auto", workers: int | None = None,
              virtual_stages: int | None = None, precision: str | Precision | None = None,
              zero: int | None = None, expressible_in: str | None = None) -> Plan:
    """Alpa's plan: the stage DP over every layer range x submesh x logical mesh, each priced by the intra-op ILP.

    ``model``: a zoo ``ModelSpec`` (planned on a shallower copy, see the module docstring) or an ``OpGraph``.
    ``microbatches``: a count or ``"auto"`` (:func:`microbatch_choices`: the powers of two dividing the batch,
    filled in for a batch with a large odd factor). ``stage_comm``: ``"model"``
    prices transfers between stages, ``"ignore"`` reproduces Alpa (the plan's reported step time still includes
    them). ``mem_limit_bytes``: bytes per device (default: the device's memory). ``on_progress(message, done,
    total)``: called as each mesh's ILP finishes. ``table``: a :class:`CostTable` built for this model and cluster
    (its ILPs are reused; ``model`` and ``cluster`` may then be left out). ``space``: the submesh shapes searched
    when the table is built here (:func:`~autopar_lab.pricing.space.planning_submeshes`: ``"full"``, Alpa's every
    shape; ``"divisors"``; ``"scale"``; ``"auto"``, full up to 4 hosts, scale on a power-of-two cluster of 256 hosts
    or more); a given table keeps its own. ``workers``: processes
    for the intra-op ILPs (:meth:`CostTable.solve_meshes`; default: the cores available, at most 4). A model of
    more than ``LAYER_GRID_MAX`` layers is cut on a grid of blocks (:func:`layer_grid`).

    ``schedule``: "1f1b" (default), "gpipe", "interleaved" (``virtual_stages`` model chunks per stage, default 2),
    "zb-h1", each searched with its own step-time formula and memory by the stage DP; or ``"auto"``: each of
    :data:`AUTO_SCHEDULES` (interleaving only where a layout allows it) is planned and the fastest plan that fits
    is kept, its notes (``plan.notes``, shown by ``explain``) saying which schedules were tried and their steps.

    ``precision``: the number format to plan in (``"fp32"``, ``"fp16"``, ``"bf16"``, ``"fp8"``, ``"fp8-block"`` or a
    :class:`~autopar_lab.precision.Precision`; see :mod:`autopar_lab.precision`); None (default): the model's own,
    as traced. The plan records it (``plan.precision``).

    ``zero``: the ZeRO stage of the optimizer (0-3): each stage's weights and optimizer state are stored as it says
    over the mesh axes the stage splits the batch on, the sharding re-solved around that storage and the memory
    priced as ZeRO's (:func:`autopar_lab.layouts.storage.with_zero`; the stage DP chooses the stages first, without
    ZeRO's savings). None (default): the storage is the ILP's, and each stage's memory-lean solution where its
    state overflows (the stage DP chooses per stage; explain() says which stages and what it saved).

    ``expressible_in``: "megatron", "torchtitan" or "maxtext": the best plan that framework can run instead (the
    fastest that fits of its grid of layouts, :mod:`autopar_lab.frameworks.grid`, each priced by its layout
    function), its notes stating the unconstrained auto plan's step (planned here too, with the other keywords) and
    the gap: what the framework's limits cost. ``al.export_config(plan, expressible_in)`` writes it.
    """
    zero = layouts.check_zero(zero)
    table, cluster, trace_s = table_for(model, cluster, table, solver, on_progress, space,
                                        workers=default_workers() if workers is None else workers,
                                        precision=precision)
    if expressible_in is not None:
        return _expressible(table, expressible_in, mem_limit_bytes=mem_limit_bytes, solver=solver,
                            free=dict(microbatches=microbatches, stage_comm=stage_comm, schedule=schedule,
                                      max_stages=max_stages, workers=workers, virtual_stages=virtual_stages,
                                      zero=zero))
    if schedule == "auto":
        if virtual_stages is not None:
            raise ValueError("virtual_stages goes with schedule='interleaved'; schedule='auto' tries 2 and 4.")
        return _auto_schedule(table, cluster, trace_s or 0.0, microbatches=microbatches, stage_comm=stage_comm,
                              mem_limit_bytes=mem_limit_bytes, max_stages=max_stages, workers=workers, zero=zero)
    schedule, v = check_schedule(schedule, virtual_stages)
    solve_s = {"trace": trace_s or 0.0}
    mem = float(cluster.device.memory_bytes if mem_limit_bytes is None else mem_limit_bytes)
    t0 = time.perf_counter()
    intra_before = table.solve_s
    choices = microbatch_choices(table.batch_size, microbatches)
    # Every mesh the DP prices, side by side where cores allow, and memory-lean solutions (ZeRO-3 / FSDP storage)
    # beside the fast ones where the fast one cannot hold a layer (CostTable.lean_meshes), in one pool of workers.
    table.solve_planned(mem, max(choices), workers=workers)
    # (a one-host cluster of CPU devices runs the stages one task at a time: StageProblem.on prices that, as
    # price_plan does)
    problem = dataclasses.replace(
        inter.StageProblem.on(cluster, num_layers=len(table.layer_names)), mem_limit_bytes=mem,
        stage_comm=stage_comm, max_stages=max_stages).with_schedule(
        schedule, virtual_stages=v if schedule == "interleaved" else None,
        wgrad_share=wgrad_share(table) if schedule == "zb-h1" else None)
    grid = layer_grid(len(table.layer_names))
    try:
        result = search_microbatches(table, problem, choices, grid=grid)
    except inter.NoFeasiblePlanError:  # lean solutions on every mesh when nothing fits without them
        if table.lean != "auto" or not table.solve_lean(workers=workers):
            raise
        result = search_microbatches(table, problem, choices, grid=grid)
    result = simulated_best(table, result, schedule=schedule, stage_comm=stage_comm, mem_limit_bytes=mem,
                            virtual_stages=v)
    stages = [(st.layers, st.submesh, st.logical_mesh, st.remat) for st in result.stages]
    # Each stage's sharding as the DP chose it (a memory-lean solution included): a mesh's solution covers every
    # layer, so it stays right when a cut moves.
    intras = [st.payload for st in result.stages]
    if schedule in inter.BY_STAGE_COUNT:
        stages = nudged_cuts(table, stages, microbatches=result.microbatches, schedule=schedule, virtual_stages=v,
                             stage_comm=stage_comm, mem_limit_bytes=mem, intras=intras)
    solve_s["inter"] = time.perf_counter() - t0 - (table.solve_s - intra_before)
    priced = result.diagnostics.get("priced")  # simulated_best's pricing of these very stages, when it made one
    if priced is not None and [tuple(x) for x in stages] == [(st.layers, st.submesh, st.logical_mesh, st.remat)
                                                             for st in result.stages]:
        plan = dataclasses.replace(priced, solve_s=planning_times(table, solve_s))
    else:
        plan = price_plan(table, stages, microbatches=result.microbatches, schedule=schedule,
                          stage_comm=stage_comm, mem_limit_bytes=mem, method="auto",
                          solve_s=planning_times(table, solve_s), virtual_stages=v, intras=intras,
                          solutions=[st.solution for st in result.stages])
    if zero is not None:
        plan = layouts.with_zero(plan, zero, solver=solver)
    return layouts.explain_fit(plan)


def _expressible(table: CostTable, framework: str, *, mem_limit_bytes, solver: str, free: dict) -> Plan:
    """``auto_plan(expressible_in=framework)``: the framework grid's best plan, with the unconstrained plan's step and
    the gap in its notes."""
    from .frameworks import FRAMEWORK_NAMES, best_in_grid

    key = str(framework).strip().lower()
    if key not in FRAMEWORK_NAMES:
        raise ValueError(f"expressible_in must be one of {', '.join(FRAMEWORK_NAMES)}, got {framework!r:.40}")
    name = FRAMEWORK_NAMES[key]
    best, priced, fitting, skipped = best_in_grid(key, table, mem_limit_bytes=mem_limit_bytes, solver=solver)
    if best is None:
        raise ValueError(f"none of the {priced} layouts of {name}'s grid fits in memory on this cluster; add devices "
                         "or plan it without expressible_in")
    free_plan = auto_plan(table.graph, table.cluster, table=table, mem_limit_bytes=mem_limit_bytes, solver=solver,
                          **free)
    ours, theirs = best.cost.step_time_s, free_plan.cost.step_time_s
    gap = (f"{ours / theirs - 1:+.1%} ({ours:.4g} s against {theirs:.4g} s)" if theirs > 0 else "n/a")
    note = (f"the best plan {name} can run: the fastest layout of its grid that fits ({priced} priced, "
            f"autopar_lab.frameworks.grid: {fitting} fit, {skipped} stopped by a lower bound above the best); the "
            f"unconstrained auto plan ({free_plan.method}, {len(free_plan.stages)} stage(s)"
            f"{'' if free_plan.cost.fits else ', does not fit'}): what {name}'s "
            f"limits cost: {gap}")
    return dataclasses.replace(best, notes=(*best.notes, note))


#: Rounds of :func:`nudged_cuts` at most (each moves one cut by one layer).
NUDGE_ROUNDS = 4


def nudged_cuts(table: CostTable, stages: list, *, microbatches: int, schedule: str, virtual_stages: int,
                stage_comm: str, mem_limit_bytes: float, intras: Sequence | None = None) -> list:
    """``stages`` ((layers, submesh, logical mesh, remat) each) with the cuts between them moved one layer at a
    time while the simulated step gets faster and the plan fits (at most :data:`NUDGE_ROUNDS` moves). ``intras``:
    each stage's IntraPlan, kept as the cuts move (default: the table's fast solution of its mesh).

    For the interleaved and ZB-H1 schedules the stage DP minimises a formula that is not the simulated step (ZB-H1's
    is an upper bound, see :func:`~autopar_lab.solve.inter.schedule_latency`), so its split can be a layer off the
    simulation's best (MoE-10B on 16 V100s: 10 + 8 layers where 9 + 9 is 0.9% faster)."""
    def step(sts) -> float:
        try:
            cost = price_plan(table, sts, microbatches=microbatches, schedule=schedule, stage_comm=stage_comm,
                              mem_limit_bytes=mem_limit_bytes, virtual_stages=virtual_stages, intras=intras).cost
        except ValueError:
            return math.inf  # a layout the schedule cannot run
        return cost.step_time_s if cost.fits else math.inf

    best, best_s = list(stages), step(stages)
    for _ in range(NUDGE_ROUNDS):
        moves = []
        for j in range(1, len(best)):
            for d in (-1, 1):
                (a, b), (c, e) = best[j - 1][0], best[j][0]
                if a <= b + d and c + d <= e:
                    moves.append([*best[:j - 1], ((a, b + d), *best[j - 1][1:]), ((c + d, e), *best[j][1:]),
                                  *best[j + 1:]])
        scored = [(step(m), m) for m in moves]
        if not scored or min(s for s, _ in scored) >= best_s * (1 - 1e-9):
            break
        best_s, best = min(scored, key=lambda x: x[0])
    return best


def _auto_schedule(table: CostTable, cluster: Cluster, trace_s: float, **kw) -> Plan:
    """:func:`auto_plan` with ``schedule="auto"``: every schedule of :data:`AUTO_SCHEDULES` planned on one table,
    the fastest plan that fits kept (ties: the earlier, simpler schedule), with a note of what was tried."""
    plans, tried = [], []
    for schedule, v in AUTO_SCHEDULES:
        name = schedule if v is None else f"{schedule} v={v}"
        try:
            plan = auto_plan(table.graph, cluster, schedule=schedule, virtual_stages=v, table=table, **kw)
        except inter.NoFeasiblePlanError as e:
            tried.append(f"{name}: no plan ({str(e).split(';')[0]})")
            continue
        plans.append((name, plan))
        tried.append(f"{name}: {plan.cost.step_time_s:.4g} s{'' if plan.cost.fits else ' (does not fit)'}")
    if not plans:
        raise inter.NoFeasiblePlanError("no schedule has a plan: " + "; ".join(tried), math.inf)
    fitting = [x for x in plans if x[1].cost.fits] or plans
    name, best = fitting[0]
    for other in fitting[1:]:  # a later schedule only when faster beyond rounding (one stage: all the same)
        if other[1].cost.step_time_s < best.cost.step_time_s * (1 - 1e-9):
            name, best = other
    note = f"schedule auto: {name} is the fastest that fits of {'; '.join(tried)}"
    solve_s = dict(best.solve_s)
    solve_s["trace"] = trace_s
    return dataclasses.replace(best, notes=(*best.notes, note), solve_s=solve_s,
                               cost=dataclasses.replace(best.cost, schedule_choice=note))


#: How many of the DP's best microbatch counts :func:`simulated_best` prices by simulation.
SIMULATED_COUNTS = 3


def simulated_best(table: CostTable, result: inter.InterResult, *, schedule: str, stage_comm: str,
                   mem_limit_bytes: float, virtual_stages: int | None = None) -> inter.InterResult:
    """Of the stage DP's plans for the microbatch counts it solved to the end, the one whose simulated step is
    fastest (among the :data:`SIMULATED_COUNTS` best by the DP's latency; ties: the DP's choice).

    The DP ranks counts by Alpa's latency formula (the sum of the stages' times plus ``B - 1`` times the slowest);
    a plan is priced by simulating its schedule, where a transfer between stages is hidden only by a warm-up deep
    enough to cover it, and memory can forbid that depth. The two can rank two counts differently (MoE-10B on
    16 V100s: the DP's 128 microbatches simulate to 8.02 s, its 256 to 7.46 s). Counts the DP left unsolved because
    their latency could not beat the best are not priced, so this can only improve on the DP's pick. For ZB-H1
    the DP's formula is an upper bound (see :func:`~autopar_lab.solve.inter.schedule_latency`), and for
    interleaving each chunk pays its own overheads: the simulation decides there too.

    They are simulated in the DP's order, and one whose step's lower bound (:func:`~autopar_lab.simulate.
    makespan_floor`) is above the fastest simulated plan that fits is not (it cannot be picked): the same pick. The
    pick's priced plan is left in its ``diagnostics["priced"]`` (None when it was not simulated).
    """
    solved = result.diagnostics.get("solved") or {}
    ranked = sorted(solved.values(), key=lambda r: (r.latency_s, r.microbatches))[:SIMULATED_COUNTS]
    if len(ranked) < 2:
        return result
    scores: dict[int, tuple[bool, float]] = {}
    plans: dict[int, Plan] = {}
    beat = math.inf  # the fastest simulated step of a plan that fits so far
    for r in ranked:
        # A plan whose step's lower bound is above one that fits cannot be picked (its score is worse): it is not
        # simulated (at 16,384 GPUs a simulation of 32 stages x 512 microbatches is seconds). The margin keeps a
        # bound summed in another order than the simulation's on the safe side.
        try:
            plan = price_plan(table, r.stages, microbatches=r.microbatches, schedule=schedule, stage_comm=stage_comm,
                              mem_limit_bytes=mem_limit_bytes, method="auto", virtual_stages=virtual_stages,
                              skip_above=beat * (1 + 1e-9))
        except StepAbove:
            continue
        plans[r.microbatches] = plan
        scores[r.microbatches] = (not plan.cost.fits, plan.cost.step_time_s)
        if plan.cost.fits:
            beat = min(beat, plan.cost.step_time_s)
    pick = min((r for r in ranked if r.microbatches in scores), key=lambda r: scores[r.microbatches])
    if scores[pick.microbatches] < scores.get(result.microbatches, (True, math.inf)):
        pick.diagnostics["by_microbatches"] = result.diagnostics["by_microbatches"]
        pick.diagnostics["solved"] = solved
        result = pick
    # The chosen plan priced as auto_plan prices it (the same stages, solutions and keywords): kept, not priced again.
    result.diagnostics["priced"] = plans.get(result.microbatches)
    return result


#: Megatron-LM's layout, Megatron-LM's sharding pinned (:func:`autopar_lab.layouts.megatron.megatron_plan`, which
#: documents its keywords).
megatron_plan = layouts.megatron_plan


def data_parallel_plan(model=None, cluster: Cluster | None = None, *, microbatches: int = 1, remat: bool | str = False,
                       mem_limit_bytes: float | None = None, solver: str = DEFAULT_SOLVER,
                       table: CostTable | None = None, precision: str | Precision | None = None,
                       zero: int | None = None, lean: bool = True) -> Plan:
    """One stage on the whole cluster viewed as a (N*M, 1) mesh, microbatches as gradient accumulation.

    The operators' shardings on that 1D mesh come from the intra-op ILP: for dense models that is data parallelism
    (the batch split over every device); for MoE the ILP also splits the experts (data + expert parallelism).
    ``remat``: the forward is recomputed in the backward (gradient checkpointing; ``"selective"``: the attention
    internals only). ``zero``: the ZeRO stage of the optimizer (0-3, over the data-parallel devices); None: the
    storage left to the ILP, and stored at its least when the step does not fit otherwise (explain() says so;
    ``lean=False`` keeps the ILP's storage, to see what replicated state would need).
    ``table``, ``precision``: as for :func:`auto_plan`."""
    microbatches, remat = checks.whole(microbatches, "microbatches"), remat_value(remat)
    zero = layouts.check_zero(zero)
    table, cluster, trace_s = table_for(model, cluster, table, solver, precision=precision)
    n = cluster.num_devices
    submesh = (cluster.hosts, cluster.devices_per_host) if cluster.hosts > 1 else (1, cluster.devices_per_host)
    name = "data_parallel(remat)" if is_full(remat) else "data_parallel(selective)" if is_selective(remat) \
        else "data_parallel"
    if zero is not None:
        name = f"{name[:-1]},zero={zero})" if name.endswith(")") else f"{name}(zero={zero})"
    layout = layouts.Layout(name, 1, submesh, layouts.MeshRoles((n, 1), batch=(0,), zero=(0,)), microbatches, remat,
                            zero=zero, lean=checks.flag(lean, "lean"))
    return layouts.price_layout(table, layout, mem_limit_bytes=mem_limit_bytes, solver=solver,
                                solve_s={} if trace_s is None else {"trace": trace_s})


def megatron_grid(cluster: Cluster, num_layers: int) -> list[tuple[int, int, int]]:
    """Every valid (dp, tp, pp): tp a power of two inside a scale-up domain, pp dividing into submesh-shaped
    stages."""
    n, M = cluster.num_devices, cluster.devices_per_host
    out = []
    tp = 1
    while tp <= min(cluster.devices_per_domain, n):
        pp = 1
        while pp <= min(n // tp, num_layers):
            if n % (tp * pp) == 0:
                dp = n // (tp * pp)
                per = dp * tp
                if per <= M or per % M == 0:
                    out.append((dp, tp, pp))
            pp *= 2
        tp *= 2
    return out


def compare(model=None, cluster: Cluster | None = None, *, microbatches="auto", solver: str = DEFAULT_SOLVER,
            stage_comm: str = "model", table: CostTable | None = None, schedule: str = "1f1b",
            grid_schedules: Sequence[str] = ("1f1b",), precision: str | Precision | None = None) -> dict:
    """Auto vs the best Megatron-style configuration vs data parallelism, all priced by one cost table.

    Both baselines are tried with every rematerialisation auto chooses from (none, full: Megatron-LM's activation
    checkpointing, selective: its attention-only recomputation) at every microbatch count; ``megatron_tried``
    lists every Megatron configuration with its step time and peak memory. ``table``: as for :func:`auto_plan`.
    ``schedule``: the auto plan's (``"auto"``: it chooses);
    ``grid_schedules``: the schedules every Megatron configuration is tried with (see :func:`baselines`), so that a
    comparison with ``schedule="auto"`` stays fair. ``precision``: the number format all three are planned in (see
    :func:`auto_plan`)."""
    table, cluster, trace_s = table_for(model, cluster, table, solver, precision=precision)
    auto = auto_plan(table.graph, cluster, microbatches=microbatches, solver=solver, stage_comm=stage_comm,
                     table=table, schedule=schedule)
    return {"auto": auto, **baselines(table, cluster, microbatches, schedules=grid_schedules),
            "trace_s": trace_s or 0.0}


def baselines(table: CostTable, cluster: Cluster | None = None, microbatches="auto",
              schedules: Sequence[str] = ("1f1b",)) -> dict:
    """The best Megatron-style plan and the best data-parallel plan, priced by ``table``.

    Every (dp, tp, pp) of :func:`megatron_grid` x microbatch count x rematerialisation (each of
    :data:`~autopar_lab.rematmode.REMAT_CHOICES`: none, full as Megatron-LM's ``--checkpoint-activations``, selective
    as its ``--recompute-activations``, the choices the auto plan has per stage, so the comparison stays fair) is
    tried; data parallelism gets the same microbatch counts (gradient accumulation) and remat choices.
    Returns ``megatron_best`` (None when no configuration fits memory), ``megatron_config`` ((dp, tp, pp,
    microbatches, remat) or None), ``megatron_tried`` (one row per configuration: step time, peak memory, fits) and
    ``data_parallel`` (the fastest that fits, else the one with the smallest peak memory).

    ``schedules``: each configuration with more than one stage is also tried with these ("interleaved": 2 chunks
    per stage, where the layout allows; "zb-h1"); ``megatron_schedule`` names the best one's.
    """
    cluster = cluster if cluster is not None else table.cluster
    best, config, tried, best_schedule = None, None, [], "1f1b"
    mbs = microbatch_choices(table.batch_size, microbatches)
    extra = [check_schedule(s) for s in dict.fromkeys(schedules) if s != "1f1b"]
    for dp, tp, pp in megatron_grid(cluster, len(table.layer_names)):
        for mb in mbs:
            for remat in REMAT_CHOICES:
                for schedule, v in [("1f1b", 1), *(extra if pp > 1 else [])]:
                    try:
                        p = megatron_plan(table.graph, cluster, dp=dp, tp=tp, pp=pp, microbatches=mb, remat=remat,
                                          table=table, schedule=schedule,
                                          virtual_stages=v if schedule == "interleaved" else None)
                    except ValueError:
                        continue
                    fits = p.cost.fits
                    tried.append({"dp": dp, "tp": tp, "pp": pp, "microbatches": mb, "remat": remat,
                                  "step_time_s": p.cost.step_time_s, "peak_mem_bytes": max(p.cost.peak_mem_bytes),
                                  "fits": fits, **({"schedule": schedule} if extra else {})})
                    if fits and (best is None or p.cost.step_time_s < best.cost.step_time_s):
                        best, config, best_schedule = p, (dp, tp, pp, mb, remat), schedule
    datas = [data_parallel_plan(table.graph, cluster, microbatches=mb, remat=remat, table=table)
             for mb in mbs for remat in REMAT_CHOICES]
    fitting = [p for p in datas if p.cost.fits]
    data = (min(fitting, key=lambda p: p.cost.step_time_s) if fitting
            else min(datas, key=lambda p: max(p.cost.peak_mem_bytes)))
    return {"megatron_best": best, "megatron_config": config, "megatron_tried": tried, "data_parallel": data,
            "megatron_schedule": best_schedule + (f" v={best.virtual_stages}" if best is not None and
                                                  best.virtual_stages > 1 else "")}
