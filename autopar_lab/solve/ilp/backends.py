"""Solving: the backends (CBC and HiGHS through PuLP, HiGHS direct), :func:`solve_ilp` and :func:`solve_min_memory`."""

from __future__ import annotations

import math
import time
from typing import Sequence

from . import highs_direct
from .problem import (
    MEM_RTOL,
    SOLVER_NAMES,
    IntraProblem,
    IntraSolution,
    check_choice,
    evaluate,
    memory_error,
    relative_gap,
    structural_error,
)
from .pulp_model import build, read_choice, run, set_start
from .reduce import greedy



def solve(problem, *, solver, time_limit, warm_start, msg, rel_gap, min_memory) -> IntraSolution | None:
    if solver not in SOLVER_NAMES:
        raise ValueError(f"solver must be 'cbc' or 'highs' (or 'highs-pulp'), got {solver!r}")
    if solver == "highs":
        # The model as arrays, straight to highspy (see highs_direct); the PuLP builder below serves CBC.
        return highs_direct.solve(problem, time_limit=time_limit, warm_start=warm_start, msg=msg,
                                  rel_gap=rel_gap, min_memory=min_memory)
    t0 = time.perf_counter()
    model = build(problem, min_memory=min_memory)
    if model is None:
        return None
    nv, nc = model.prob.numVariables(), model.prob.numConstraints()
    name = solver
    if not model.x:
        # Every node is decided by the reductions; the solvers dislike empty models.
        status, absgap = "optimal", 0.0
        choice = tuple(int(d[0]) for d in model.dom)
        name = "reduction"
    else:
        warm, start = False, None
        if warm_start is not None:
            start = check_choice(problem, warm_start)
        elif time_limit is not None and not min_memory:
            # Under a time limit, hand the solver a greedy plan so that it always has an
            # incumbent to return (CBC may otherwise stop with nothing on large models).
            start = greedy(problem, model.dom)
        if start is not None:
            warm = set_start(model, start)
        status, absgap = run(model, solver, time_limit, warm, msg, rel_gap)
        if status == "infeasible" and warm and time_limit is not None:
            # The start is an allowed plan, so the model is feasible: a solver stopped by its time limit before it
            # read the start (CBC on a loaded machine) reports "infeasible". It found nothing: keep the start.
            status = "no_solution"
        if status == "infeasible":
            return None
        if status == "no_solution":
            if not warm:
                raise TimeoutError(
                    f"the {solver} solver found no plan within its time limit ({time_limit} s); "
                    "raise time_limit or pass a warm_start"
                )
            assert start is not None  # warm
            status, absgap, choice = "time_limit", None, start
        else:
            choice = read_choice(model)
            if warm and start is not None and status == "time_limit":
                ev0, ev1 = evaluate(problem, start), evaluate(problem, choice)
                if ev0.objective < ev1.objective:  # the solver lost its start (should not happen)
                    choice = start
    ev = evaluate(problem, choice)
    gap = relative_gap(ev, status, absgap, model.scale, min_memory)
    return IntraSolution(choice, *ev, status, gap, time.perf_counter() - t0, nv, nc, name, model.build_s)


def solve_ilp(problem: IntraProblem, *, solver: str = "cbc", time_limit: float | None = None,
              warm_start: Sequence[int] | None = None, msg: bool = False,
              rel_gap: float = 1e-9) -> IntraSolution:
    """Solve the intra-operator ILP.

    Args:
        solver: ``"cbc"`` (PuLP's bundled CBC, as Alpa), ``"highs"`` (HiGHS through highspy, the
            model built as numpy arrays by :mod:`autopar_lab.solve.ilp.highs_direct`: the fast path) or
            ``"highs-pulp"`` (HiGHS through PuLP's model, a reference for the direct build).
        time_limit: seconds; when hit, the best plan found is returned with status
            ``"time_limit"`` and ``gap`` = (objective - bound) / objective, the bound read
            from CBC's log or from HiGHS' ``mip_dual_bound`` (None if unavailable).
            If no plan at all was found by then, ``TimeoutError``.
        warm_start: a plan to start from (CBC: PuLP's ``warmStart``; HiGHS:
            ``Highs.setSolution``). Ignored when it is not an allowed plan.
        rel_gap: relative gap at which the solver may stop (1e-9: optimal).

    Raises :class:`InfeasibleError` when no plan fits; its message and ``min_peak_mem``
    give the smallest peak memory any plan needs (from :func:`solve_min_memory`).

    The choice is deterministic (same input, same plan); among equally good plans the ILP
    returns the one its solver finds, which need not be the lexicographically smallest
    (:func:`brute_force` returns that one).

    >>> p = IntraProblem(node_costs=([1.0, 2.0], [1.0, 1.0]), edges=((0, 1),),
    ...                  edge_costs=([[5.0, 0.0], [0.0, 5.0]],),
    ...                  node_mem=([4.0, 1.0], [1.0, 1.0]), mem_limit=3.0)
    >>> s = solve_ilp(p, solver="highs")
    >>> s.choice, s.objective, s.peak_mem
    ((1, 0), 3.0, 2.0)
    """
    sol = solve(problem, solver=solver, time_limit=time_limit, warm_start=warm_start, msg=msg,
                 rel_gap=rel_gap, min_memory=False)
    if sol is not None:
        return sol
    if problem.node_mem is None or not math.isfinite(problem.mem_limit):
        raise structural_error(problem)
    best = solve_min_memory(problem, solver=solver, time_limit=time_limit)
    if best.peak_mem <= problem.mem_limit * (1 + MEM_RTOL):  # pragma: no cover - solver noise
        return best
    raise memory_error(problem, best, exact=best.status == "optimal")


def solve_min_memory(problem: IntraProblem, *, solver: str = "cbc", time_limit: float | None = None,
                     msg: bool = False) -> IntraSolution:
    """The plan with the smallest peak memory (``mem_limit`` ignored; pins and inf respected).

    Solved as its own ILP: the same one-hot ``s``, ``e`` only where pairs are forbidden, a
    continuous ``peak`` >= every memory row, minimise ``peak``. ``objective`` in the result
    is the cost of that plan (not minimised). Without memory data it is :func:`solve_ilp`.
    Raises :class:`InfeasibleError` when no plan is allowed at all.

    >>> p = IntraProblem(node_costs=([1.0, 2.0],), node_mem=([8.0, 2.0],))
    >>> solve_min_memory(p).peak_mem
    2.0
    """
    if problem.node_mem is None:
        return solve_ilp(problem, solver=solver, time_limit=time_limit, msg=msg)
    sol = solve(problem, solver=solver, time_limit=time_limit, warm_start=None, msg=msg,
                 rel_gap=1e-9, min_memory=True)
    if sol is None:
        raise structural_error(problem)
    return sol
