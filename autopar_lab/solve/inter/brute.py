"""The brute-force reference of the stage DP: every plan of a small instance, priced with the same formulas
(:mod:`.formulas`) and the same checked problem (:func:`.problem.build_problem`), so it checks the DP's search."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Callable, Sequence

from .formulas import BY_STAGE_COUNT, placement_fits
from .problem import Problem, build_problem, infeasible, inter_result
from .values import InterResult, StageCandidate, StageProblem

__all__ = ["brute_force_stages", "compositions", "shape_sequences"]


def compositions(n: int, parts_max: int):
    """All ways to cut range(n) into contiguous (start, end) pieces, at most parts_max of them."""
    for parts in range(1, min(n, parts_max) + 1):
        for cuts in itertools.combinations(range(1, n), parts - 1):
            bounds = (0, *cuts, n)
            yield [(bounds[j], bounds[j + 1] - 1) for j in range(parts)]


def shape_sequences(p: Problem, count: int, offset: int = 0):
    """Sequences of ``count`` shapes placed in order from ``offset`` using every device exactly."""
    if count == 0:
        if offset == p.num_devices:
            yield (), ()
        return
    for shape in p.shapes:
        if placement_fits(shape, offset, p.hosts, p.devices_per_host):
            for rest, offs in shape_sequences(p, count - 1, offset + shape[0] * shape[1]):
                yield (shape, *rest), (offset, *offs)


def brute_force_stages(problem: StageProblem,
                       candidates: Callable[[int, int, tuple[int, int]], Sequence[StageCandidate]]) -> InterResult:
    """Every layer partition x every in-order submesh assignment x every candidate choice,
    priced with :func:`~autopar_lab.solve.inter.schedule_latency`. Same inputs and result as
    :func:`~autopar_lab.solve.inter.stage_dp`; exponential, for small instances only (about 6 layers and 8
    devices). ``problem.constraints`` are checked plan by plan (only partitions with the pinned stage count, each
    stage's candidates filtered by the pins), independently of how the DP applies them.

    >>> flat = lambda a, b, sub: [StageCandidate((a, b), sub, sub, False, 1.0 * (b - a + 1), 0.0, 0, 0)]
    >>> brute_force_stages(StageProblem(num_layers=4, hosts=1, devices_per_host=2, microbatches=8), flat).latency_s
    18.0
    """
    t0 = time.perf_counter()
    p = build_problem(problem, candidates)
    if p.num_layers > 10 or p.num_devices > 32:
        raise ValueError("brute_force_stages is exponential; use at most 10 layers and 32 devices.")
    best_T, best_plan = math.inf, None
    least_mem = math.inf
    visited = 0
    for parts in compositions(p.num_layers, p.max_stages):
        S = len(parts)
        if p.fixed_stages is not None and S != p.fixed_stages:
            continue
        if p.schedule == "interleaved" and (S < 2 or not p.runs_interleaved(S) or any(p.short(k, i) for k, i in parts)):
            continue  # the layouts interleaving cannot run (schedules.check_layout)
        q = dataclasses.replace(p, total_stages=S) if p.schedule in BY_STAGE_COUNT else p
        for shapes, offsets in shape_sequences(p, S):
            per_stage = []
            for j, ((k, i), shape) in enumerate(zip(parts, shapes)):
                held = q.held(S - j)
                opts = [(idx, c) for idx, c in enumerate(p.cands[(k, i, shape)]) if p.usable(j, k, i, c)]
                per_stage.append([(idx, c, c.mem_bytes(held)) for idx, c in opts])
            cuts = [p.priced_cut(parts[j][0], offsets[j]) for j in range(1, S)]
            necks = [p.priced_neck(parts[j][0], offsets[j]) for j in range(1, S)]
            for choice in itertools.product(*per_stage):
                visited += 1
                need = max(m for _, _, m in choice)
                least_mem = min(least_mem, need)
                if need > p.mem_limit:
                    continue
                T = q.latency([c.time_s for _, c, _ in choice], cuts, necks)
                if T < best_T:
                    best_T = T
                    best_plan = [
                        (k, i, shape, idx, o)
                        for (k, i), shape, (idx, _, _), o in zip(parts, shapes, choice, offsets)
                    ]
    if best_plan is None:
        raise infeasible(least_mem, p.mem_limit, p.fixed_stages is not None)
    return inter_result(p, best_plan, {"plans_visited": visited, "solve_s": time.perf_counter() - t0})
