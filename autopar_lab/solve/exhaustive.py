"""The global optimum of the whole plan space, for small instances: how far is Alpa's two-level plan from it?

Alpa splits planning in two: the intra-operator ILP prices every (layer, logical mesh) pair once, and the stage DP
(:func:`~autopar_lab.solve.inter.stage_dp`) then picks stages, submeshes, logical meshes and the microbatch count by
minimising a *latency formula*. :func:`global_optimum` instead enumerates every complete plan of the same space

    contiguous layer partition x in-order submesh sequence that tiles the cluster x logical mesh per stage
    x rematerialisation per stage x microbatch count

and prices each one exactly as :func:`autopar_lab.plan.price_plan` prices a plan: the makespan of the event-level
pipeline simulation (:func:`autopar_lab.simulate.simulate`), with the transfers between stages always priced, and a
plan counts only if every stage's simulated peak memory fits the device. Both searches read the SAME
:class:`~autopar_lab.pricing.table.CostTable` (one intra-op ILP per logical mesh), so the gap
``auto / optimum - 1 >= 0`` comes from the inter-operator level only:

* **formula vs simulation.** The DP minimises ``sum t_i + sum c_j + (B - 1) * max(t_i, c_j)``; the simulated 1F1B
  makespan differs from it (a fast stage's warm-up overlaps a slow one, a fixed warm-up depth cannot always hide
  the gradient round trip over a slow cut, uneven fwd/bwd splits shift the critical path), so the formula's
  argmin need not be the simulation's argmin.
* **the t_max decomposition.** For each t_max the DP keeps, per stage, the *fastest* candidate that fits memory
  (``fwd + bwd`` summed), which ignores how that time splits between forward and backward: the simulator cares.
  The microbatch count is chosen by the formula too.
* **stage-comm pricing.** With ``stage_comm="ignore"`` (Alpa) the DP prices cuts at zero while the simulation still
  pays them; with ``"model"`` a cut costs ``c_j`` as an extra pipeline term in the formula, whereas in the
  simulation a transfer overlaps compute and sits on its own link.
* **memory and warm-up.** The DP checks ``static + held * act`` with ``held`` from the schedule; a plan here is
  priced like ``price_plan`` prices it (plain 1F1B, or a deeper warm-up that hides slow transfers when it is faster
  and fits), and counts if the simulated peak fits. (No candidate dominance pruning: with the deeper warm-up,
  whose depth depends on the stage times, makespan and memory are no longer monotone in one candidate's times.)

Schedules: ``schedule="interleaved"`` (``virtual_stages`` chunks per stage) and ``"zb-h1"`` price each plan with
``price_plan`` itself (each chunk, each weight-gradient task priced as a plan is), plans whose layout cannot run
interleaved (a stage count not dividing the microbatches, a stage with fewer layers than chunks) left out; their
lower bound is the busiest stage's ``B * (fwd + bwd)`` alone (the prefix argument below assumes 1F1B's order).

What is *not* covered: the intra-op level is shared (one ILP per mesh, per-layer costs summed), so a gap of zero does
not mean Alpa's plan is globally optimal over operator shardings, only over everything above them.

Search: depth-first over stages, in pipeline order (layer range, then a submesh shape that fits at the current
device offset, then a candidate), with two exact prunings (``prune=True``), checked against the plain enumeration
(``prune=False``) in the tests:

1. *Lower bound.* In the simulator stage ``i`` cannot start before the first microbatch has gone through stages
   ``0..i-1`` and their cuts, it is busy ``B * (fwd_i + bwd_i)``, and its last task (the last microbatch's backward)
   must still travel back through ``i-1..0`` (true for plain 1F1B, GPipe and the deeper 1F1B warm-up
   ``price_plan`` may pick, since every order ends with the last microbatch's backward). So every completion of a
   prefix costs at least
   ``max_i [sum_{k<i} (fwd_k + bwd_k + send_fwd_k + send_bwd_k) + B * (fwd_i + bwd_i)]``; a prefix whose bound
   reaches the incumbent is dropped. The incumbent starts as the auto plan (it lies in the space).
2. *Memory.* A candidate whose ``static + act`` (one microbatch in flight) exceeds the device is dropped early.

The raw size of the space is computed first (a small DP over device offsets); above ``limit`` the call refuses with
a ValueError rather than run for hours. Up to about 8 layers and 8 devices stays within the default limit.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import planner
from ..plan import price_plan
from ..pricing import CostTable, simulate_pipeline
from ..rematmode import REMAT_CHOICES, remat_value
from ..schedules import check_schedule
from ..simulate import SimOptions
from .ilp import DEFAULT_SOLVER
from .inter import NoFeasiblePlanError, StageCandidate, placement_fits, transfer_s

if TYPE_CHECKING:
    from ..cluster import Cluster

__all__ = ["global_optimum", "count_plans", "OptimumSearch", "DEFAULT_LIMIT"]

DEFAULT_LIMIT = 2_000_000


@dataclass(frozen=True, kw_only=True)
class OptimumSearch:
    """How :func:`global_optimum` searches: ``solver``, the intra-op ILP backend of the table it builds (as for
    :func:`autopar_lab.planner.auto_plan`); ``limit``, the most plans it enumerates (more is a ValueError);
    ``prune=False`` prices every plan (for tests); ``seed=False`` starts the pruned search without the auto plan as
    its incumbent (for tests of the bound). Immutable: change one with :func:`dataclasses.replace`."""

    solver: str = DEFAULT_SOLVER
    limit: int = DEFAULT_LIMIT
    prune: bool = True
    seed: bool = True


def count_plans(num_layers: int, cluster: Cluster, microbatch_choices: int,
                remat_choices: int = len(REMAT_CHOICES)) -> int:
    """The size of the plan space: partitions x tilings x logical meshes x remat x microbatch counts.

    >>> import autopar_lab as al
    >>> # 1 stage: 2 meshes x 3 remat (none, full, selective); 2 stages: 3 x 3
    >>> count_plans(2, al.Cluster.preset("p3.16xlarge").with_(devices_per_host=2), 1)
    15
    """
    L, NM = int(num_layers), cluster.num_devices
    shapes = cluster.submesh_shapes()
    weight = {s: len(cluster.logical_mesh_shapes(s)) * remat_choices for s in shapes}

    @functools.lru_cache(maxsize=None)
    def tilings(offset: int, stages: int) -> int:
        if stages == 0:
            return 1 if offset == NM else 0
        return sum(weight[s] * tilings(offset + s[0] * s[1], stages - 1) for s in shapes
                   if placement_fits(s, offset, cluster.hosts, cluster.devices_per_host))

    per_b = sum(math.comb(L - 1, S - 1) * tilings(0, S) for S in range(1, min(L, NM) + 1))
    return microbatch_choices * per_b


def global_optimum(model=None, cluster: Cluster | None = None, *, microbatches="auto", remat=REMAT_CHOICES,
                   schedule: str = "1f1b", stage_comm: str = "model", mem_limit_bytes: float | None = None,
                   table: CostTable | None = None, virtual_stages: int | None = None,
                   search: OptimumSearch = OptimumSearch()) -> dict:
    """Enumerate every plan of a small instance, price each with the pipeline simulator, and compare with Alpa's.

    ``model``/``cluster``/``microbatches``/``stage_comm``/``mem_limit_bytes``/``table``: as for
    :func:`autopar_lab.planner.auto_plan` (``stage_comm`` only changes the auto plan's objective; both plans are
    reported with transfers priced). ``remat``: the rematerialisation choices per stage (default none, full
    and selective, as the auto plan's; :func:`~autopar_lab.rematmode.remat_value` values). ``search``
    (:class:`OptimumSearch`): the ILP solver, the most plans to enumerate, and the pruning switches for tests.
    ``schedule`` (and ``virtual_stages`` for "interleaved"): the schedule both plans run (see the module docstring).

    Returns a dict: ``optimum`` and ``auto`` (Plans priced by ``price_plan``, so priced identically),
    ``optimum_step_s``, ``auto_step_s``, ``gap`` (``auto / optimum - 1``), ``plans_total`` (size of the space),
    ``plans_priced`` (simulations run), ``plans_feasible`` (of those, how many fit memory), ``auto_fits``,
    ``solve_s`` ({"table", "auto", "search", "total"}) and ``table`` (the shared CostTable).
    """
    t_start = time.perf_counter()
    solver, limit, prune, seed = search.solver, search.limit, search.prune, search.seed
    schedule, v = check_schedule(schedule, virtual_stages)
    own = schedule in ("interleaved", "zb-h1")  # priced by price_plan itself, with the busiest-stage bound only
    table, cluster, _ = planner.table_for(model, cluster, table, solver)
    choices = planner.microbatch_choices(table.batch_size, microbatches)
    remat = tuple(dict.fromkeys(remat_value(r) for r in remat))
    if not remat:
        raise ValueError("remat must offer at least one choice, e.g. (False, True, 'selective')")
    L, NM = len(table.layer_names), cluster.num_devices
    M = cluster.devices_per_host
    total = count_plans(L, cluster, len(choices), len(remat))
    if total > limit:
        raise ValueError(f"too many plans to enumerate: {total:,} (limit {limit:,}); use fewer layers or devices")
    mem = float(cluster.device.memory_bytes if mem_limit_bytes is None else mem_limit_bytes)

    # Every logical mesh's layer costs (the ILPs), before any timing of the search itself.
    shapes = cluster.submesh_shapes()
    for sub in shapes:
        for lm in cluster.logical_mesh_shapes(sub):
            table.mesh_costs(sub, lm)
    t_table = time.perf_counter()

    auto = planner.auto_plan(table.graph, cluster, microbatches=microbatches, stage_comm=stage_comm,
                             schedule=schedule, mem_limit_bytes=mem, solver=solver, table=table,
                             virtual_stages=v if schedule == "interleaved" else None)
    auto_fits = all(m <= mem for m in auto.cost.peak_mem_bytes)
    t_auto = time.perf_counter()

    # Per-cut transfer time for a microbatch count B: the cut in front of layer k, into a stage at device offset o,
    # between stages of `sizes` devices (across hosts: over the links of the hosts both span, as the pricing does).
    def send_s(k: int, o: int, B: int, sizes: tuple[int, int]) -> float:
        if o % cluster.devices_per_domain:
            return transfer_s(table.cut_bytes[k - 1] / B, cluster.scale_up_link(2))
        hosts = max(1, min(sizes) // cluster.devices_per_host)
        return transfer_s(table.cut_bytes[k - 1] / B / hosts, cluster.inter_host)

    # Can devices offset..NM be tiled by at most `stages` more stages?
    @functools.lru_cache(maxsize=None)
    def tileable(offset: int, stages: int) -> bool:
        if offset == NM:
            return True
        if stages == 0:
            return False
        return any(tileable(offset + s[0] * s[1], stages - 1) for s in shapes
                   if placement_fits(s, offset, cluster.hosts, M))

    cand_cache: dict = {}

    def cands(k: int, i: int, sub, B: int) -> list[StageCandidate]:
        key = (k, i, sub, B)
        if key not in cand_cache:
            cs = [table.stage(k, i, sub, lm, B, r) for lm in cluster.logical_mesh_shapes(sub) for r in remat]
            if prune:  # fastest first, so the bound can stop at the first candidate that reaches it
                cs = sorted((c for c in cs if c.static_bytes + c.act_bytes <= mem), key=lambda c: c.time_s)
            cand_cache[key] = cs
        return cand_cache[key]

    best: dict[str, Any] = {"T": math.inf, "stages": None, "B": None}
    if prune and seed and auto_fits:
        best.update(T=auto.cost.step_time_s, stages="auto", B=auto.microbatches)
    stats = {"priced": 0, "feasible": 0}

    def leaf(stages: list[StageCandidate], sends: list[float], B: int) -> None:
        # Exactly price_plan's pricing: plain 1F1B, or its deeper warm-up when that is faster and fits.
        stats["priced"] += 1
        if own:
            try:
                cost = price_plan(table, stages, microbatches=B, schedule=schedule, virtual_stages=v,
                                  mem_limit_bytes=mem).cost
            except ValueError:
                return  # a layout the schedule cannot run
            if cost.fits:
                stats["feasible"] += 1
                if cost.step_time_s < best["T"]:
                    best.update(T=cost.step_time_s, stages=list(stages), B=B)
            return
        tl = simulate_pipeline([s.fwd_s for s in stages], [s.bwd_s for s in stages], B, schedule, sends, mem,
                               options=SimOptions().with_memory([s.act_bytes for s in stages],
                                                                [s.static_bytes for s in stages]))
        if any(m > mem for m in tl.peak_mem_bytes):
            return
        stats["feasible"] += 1
        if tl.makespan < best["T"]:
            best.update(T=tl.makespan, stages=list(stages), B=B)

    def descend(k: int, offset: int, stages: list, sends: list, prefix: float, bound: float, B: int,
                prev: int = 0) -> None:
        # prefix: sum over placed stages and the cuts behind them of (fwd + bwd + send_fwd + send_bwd).
        if k == L:
            if offset == NM:
                leaf(stages, sends, B)
            return
        for i in range(k, L):
            left = L - 1 - i  # layers after this stage: at most that many more stages
            for sub in shapes:
                size = sub[0] * sub[1]
                if not placement_fits(sub, offset, cluster.hosts, M):
                    continue
                nxt = offset + size
                if (left == 0) != (nxt == NM) or not tileable(nxt, left):
                    continue
                cut = send_s(k, offset, B, (prev, size)) if k > 0 else 0.0
                into = 0.0 if own else prefix + 2 * cut
                for c in cands(k, i, sub, B):
                    lb = max(bound, into + B * c.time_s)
                    if prune and lb >= best["T"]:
                        break  # candidates are fastest first: the rest are no better
                    stages.append(c)
                    if k > 0:
                        sends.append(cut)
                    descend(i + 1, nxt, stages, sends, into + c.time_s, lb, B, size)
                    stages.pop()
                    if k > 0:
                        sends.pop()

    for B in choices:
        descend(0, 0, [], [], 0.0, 0.0, B)
    t_search = time.perf_counter()

    solve_s = {"table": t_table - t_start, "auto": t_auto - t_table, "search": t_search - t_auto}
    if best["stages"] is None:
        raise NoFeasiblePlanError(
            f"no plan fits in {mem / 2**30:.3g} GiB per device under any of microbatches {choices}; use more "
            "devices, a larger batch split or a smaller model", math.inf)
    if best["stages"] == "auto":
        opt_stages, opt_B = list(auto.stages), auto.microbatches
    else:
        opt_stages, opt_B = best["stages"], best["B"]
    optimum = price_plan(table, opt_stages, microbatches=opt_B, schedule=schedule, stage_comm="model",
                         mem_limit_bytes=mem, method="optimum", virtual_stages=v,
                         solve_s=planner.planning_times(table, {"search": solve_s["search"]}))
    solve_s["total"] = time.perf_counter() - t_start
    a, o = auto.cost.step_time_s, optimum.cost.step_time_s
    return {
        "optimum": optimum,
        "auto": auto,
        "auto_step_s": a,
        "optimum_step_s": o,
        "gap": a / o - 1.0 if o > 0 else 0.0,
        "auto_fits": auto_fits,
        "plans_total": total,
        "plans_priced": stats["priced"],
        "plans_feasible": stats["feasible"],
        "microbatch_choices": choices,
        "solve_s": solve_s,
        "table": table,
    }
