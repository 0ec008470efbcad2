"""The reference solver the ILP is tested against: exhaustive enumeration, for tiny problems."""

from __future__ import annotations

import math
import time

import numpy as np

from .problem import MEM_RTOL, IntraProblem, IntraSolution, evaluate, memory_error, structural_error

#: brute_force refuses problems whose strategy-count product exceeds this.
BRUTE_FORCE_LIMIT = 2_000_000


def brute_force(problem: IntraProblem) -> IntraSolution:
    """Exhaustive optimum, for tiny problems; ties go to the lexicographically smallest plan.

    Raises ValueError when the product of strategy counts (pinned nodes count 1) exceeds
    ``BRUTE_FORCE_LIMIT``, and :class:`InfeasibleError` (with the brute-force minimum peak
    memory) when no plan fits.

    >>> brute_force(IntraProblem(node_costs=([2.0, 1.0, 1.0],))).choice
    (1,)
    """
    t0 = time.perf_counter()
    n = problem.num_nodes
    domains = [np.array([problem.pins[v]]) if v in problem.pins else np.arange(k)
               for v, k in enumerate(problem.num_strategies)]
    sizes = [d.size for d in domains]
    total = math.prod(sizes)
    if total > BRUTE_FORCE_LIMIT:
        raise ValueError(f"brute_force: {total} plans to enumerate, more than {BRUTE_FORCE_LIMIT}")
    rows = problem.mem_rows()
    best_obj, best_idx = math.inf, None
    minpeak, minpeak_idx = math.inf, None
    chunk = 1 << 16
    for start in range(0, total, chunk):
        idx = np.arange(start, min(total, start + chunk))
        # unravel_index in C order walks plans lexicographically, so argmin's first hit is
        # the lexicographically smallest optimum.
        cols = np.unravel_index(idx, sizes) if n else ()
        ch = [domains[v][cols[v]] for v in range(n)]
        obj = np.zeros(idx.size)
        for v in range(n):
            obj += problem.node_costs[v][ch[v]]
        for (u, v), m in zip(problem.edges, problem.edge_costs):
            obj += m[ch[u], ch[v]]
        peak = np.zeros(idx.size)
        for row in rows:
            s = np.zeros(idx.size)
            for v, vec in row:
                s += vec[ch[v]]
            peak = np.maximum(peak, s)
        allowed = np.isfinite(obj)
        if allowed.any():
            i = int(np.argmin(np.where(allowed, peak, np.inf)))
            if peak[i] < minpeak:
                minpeak, minpeak_idx = float(peak[i]), int(idx[i])
        ok = allowed & (peak <= problem.mem_limit * (1 + MEM_RTOL))
        if ok.any():
            i = int(np.argmin(np.where(ok, obj, np.inf)))
            if obj[i] < best_obj:
                best_obj, best_idx = float(obj[i]), int(idx[i])

    def plan(i):
        cols = np.unravel_index(i, sizes) if n else ()
        return tuple(int(domains[v][cols[v]]) for v in range(n))

    if best_idx is None:
        if minpeak_idx is None:
            raise structural_error(problem)
        choice = plan(minpeak_idx)
        ev = evaluate(problem, choice)
        sol = IntraSolution(choice, *ev, "optimal", 0.0, time.perf_counter() - t0, 0, 0, "brute_force")
        raise memory_error(problem, sol, exact=True)
    choice = plan(best_idx)
    return IntraSolution(choice, *evaluate(problem, choice), "optimal", 0.0,
                         time.perf_counter() - t0, 0, 0, "brute_force")
