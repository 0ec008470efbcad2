"""Model reduction (done before any solver sees the model; each step keeps the optimum exact), shared by both
model builders, and a greedy plan to start a time-limited solve from.
"""

from __future__ import annotations

import math

import numpy as np

from .problem import MEM_RTOL, IntraProblem, evaluate

def combined_edges(problem: IntraProblem) -> dict[tuple[int, int], np.ndarray]:
    """Sum parallel edges (either direction) into one matrix per node pair (u < v)."""
    out: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), m in zip(problem.edges, problem.edge_costs):
        if u > v:
            u, v, m = v, u, m.T
        if (u, v) in out:
            out[(u, v)] = out[(u, v)] + m  # inf + x stays inf: a forbidden pair stays forbidden
        else:
            out[(u, v)] = m  # a problem's matrices are read-only, and a sum makes a new one: no copy needed
    return out


def restrict(m: np.ndarray, du: np.ndarray, dv: np.ndarray) -> np.ndarray:
    """``m[np.ix_(du, dv)]``; ``m`` itself when both domains keep every strategy (the common case: a copy per
    edge and call was a tenth of building a model)."""
    if du.size == m.shape[0] and dv.size == m.shape[1]:  # domains are sorted and distinct: all of them
        return m
    return m[np.ix_(du, dv)]


def _aggregate_rows(problem: IntraProblem) -> list[dict[int, np.ndarray]]:
    """Memory rows as node -> summed bytes vector; repeated and dominated rows removed.

    All terms are >= 0, so a row whose terms are a subset of another row's can never bind
    first and is dropped (this also drops exact repeats).
    """
    keyed = []
    ids: dict[bytes, int] = {}
    for row in problem.mem_rows():
        key = frozenset((v, ids.setdefault(vec.tobytes(), len(ids))) for v, vec in row)
        keyed.append((key, row))
    # Largest first, and in original order among equals, so the result is deterministic.
    order = sorted(range(len(keyed)), key=lambda i: -len(keyed[i][0]))
    kept: list[int] = []
    for i in order:
        key = keyed[i][0]
        if any(key <= keyed[j][0] for j in kept):
            continue
        kept.append(i)
    rows = []
    for i in sorted(kept):
        agg: dict[int, np.ndarray] = {}
        for v, vec in keyed[i][1]:
            agg[v] = agg[v] + vec if v in agg else np.array(vec)
        if agg:
            rows.append(agg)
    return rows


def _domains(problem: IntraProblem, edges, rows, limit: float) -> list[np.ndarray] | None:
    """Strategies of each node that can be part of an allowed plan; None if some node has none.

    Arc consistency: drop forbidden strategies (inf cost, pins), strategies with no finite
    partner across some edge, and strategies that cannot meet some memory row even if every
    other node takes its smallest option; repeat until stable.
    """
    mask = [np.isfinite(c) for c in problem.node_costs]
    for v, q in problem.pins.items():
        m = np.zeros_like(mask[v])
        m[q] = mask[v][q]
        mask[v] = m
    # An edge whose every pair is allowed never removes a strategy: while both sides keep one (checked on every
    # change below), each strategy of one side has a partner on the other. Only the others are walked.
    finite = {k: f for k, f in ((k, np.isfinite(m)) for k, m in edges.items()) if not f.all()}
    tol_limit = limit * (1 + MEM_RTOL)
    changed = True
    while changed:
        changed = False
        if any(not m.any() for m in mask):
            return None
        for (u, v), f in finite.items():
            mu = mask[u] & f[:, mask[v]].any(axis=1)
            mv = mask[v] & f[mask[u], :].any(axis=0)
            if (mu != mask[u]).any() or (mv != mask[v]).any():
                mask[u], mask[v], changed = mu, mv, True
                if not mu.any() or not mv.any():
                    return None
        if math.isfinite(limit):
            for row in rows:
                mins = {v: vec[mask[v]].min() for v, vec in row.items()}
                base = sum(mins.values())
                for v, vec in row.items():
                    mv = mask[v] & (base - mins[v] + vec <= tol_limit)
                    if (mv != mask[v]).any():
                        mask[v], changed = mv, True
                        if not mv.any():
                            return None
                        base = base - mins[v] + vec[mv].min()
                        mins[v] = vec[mv].min()
    return [np.flatnonzero(m) for m in mask]


def is_additive(r: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """If every entry is finite and r[p, q] = a[p] + b[q], return (a, b)."""
    if not np.isfinite(r).all():
        return None
    a = r[:, 0] - r[0, 0]
    b = r[0, :]
    scale = max(float(np.abs(r).max()), 1e-300)
    if np.all(np.abs(r - (a[:, None] + b[None, :])) <= 1e-12 * scale):
        return a, b
    return None


def reductions(problem: IntraProblem, *, min_memory: bool):
    """What both model builders start from: (combined edges, aggregated memory rows, each node's allowed
    strategies, objective scale), or None when the reductions already prove infeasibility."""
    edges = combined_edges(problem)
    rows = _aggregate_rows(problem)
    limit = math.inf if min_memory else problem.mem_limit
    dom = _domains(problem, edges, rows, limit)
    if dom is None:
        return None
    if min_memory:
        return edges, rows, dom, 1.0
    # Objective scale: costs are seconds (1e-6 .. 1e2); solvers' absolute tolerances are
    # ~1e-7, so bring the largest coefficient to ~1.
    finite_costs = [float(np.abs(c[d]).max()) for c, d in zip(problem.node_costs, dom)]
    # The largest finite |entry| of every edge matrix on the domains: each matrix object once (one shared by many
    # edges), those of one shape stacked (only the maximum over all of them counts: no per-edge numpy calls).
    by_shape: dict[tuple, dict[int, np.ndarray]] = {}
    for (u, v), m in edges.items():
        r = restrict(m, dom[u], dom[v])
        by_shape.setdefault(r.shape, {}).setdefault(id(r), r)  # held here: ids stay unique
    for shape, same in by_shape.items():
        for part in _batches(list(same.values()), shape):
            a = np.abs(np.stack(part))
            a[a == np.inf] = -np.inf  # forbidden pairs do not count
            top = float(a.max())
            if top != -np.inf:
                finite_costs.append(top)
    return edges, rows, dom, max(max(finite_costs, default=1.0), 1e-300)


def greedy(problem: IntraProblem, dom) -> tuple[int, ...] | None:
    """A quick allowed plan: nodes in index order, each taking its cheapest strategy given
    the neighbours already placed. None if it dead-ends or breaks the memory limit."""
    n = problem.num_nodes
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (u, v), m in combined_edges(problem).items():
        nbrs[v].append((u, m.T))  # indexed [v strategy, u strategy]
        nbrs[u].append((v, m))
    choice: list[int | None] = [None] * n
    for v in range(n):
        d = dom[v]
        cost = problem.node_costs[v][d].astype(float)
        for w, m in nbrs[v]:
            if choice[w] is not None:
                cost = cost + m[d, choice[w]]
        i = int(np.argmin(cost))
        if not np.isfinite(cost[i]):
            return None
        choice[v] = int(d[i])
    plan = tuple(int(q) for q in choice if q is not None)
    ev = evaluate(problem, plan)
    if not np.isfinite(ev.objective) or ev.peak_mem > problem.mem_limit * (1 + MEM_RTOL):
        return None
    return plan


#: Entries per stack of same-shape matrices (32 MB of float64): what stacking them costs in memory stays bounded
#: whatever the model (a batch of this size is already thousands of small matrices).
_BATCH_ENTRIES = 1 << 22


def _batches(items: list, shape: tuple) -> list[list]:
    """``items`` (matrices of ``shape``) in runs of at most :data:`_BATCH_ENTRIES` entries (one at least)."""
    per = max(1, _BATCH_ENTRIES // max(1, math.prod(shape)))
    return [items[i:i + per] for i in range(0, len(items), per)]


def _additive_all(mats: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """:func:`is_additive` of each matrix, the same answers and the same (a, b) (the same operations on each entry):
    matrices of one shape are checked together, stacked, in place of a dozen numpy calls each (a DeepSeek-V3 mesh
    has ~1,000 undecided edges, few of which share a matrix)."""
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(mats)
    by_shape: dict[tuple, list[int]] = {}
    for i, r in enumerate(mats):
        by_shape.setdefault(r.shape, []).append(i)
    for shape, all_ids in by_shape.items():
        for ids in _batches(all_ids, shape):
            _additive_batch(mats, ids, out)
    return out


def _additive_batch(mats: list[np.ndarray], ids: list[int], out: list) -> None:
    """:func:`_additive_all` for ``mats[i]``, ``i`` in ``ids`` (one shape), into ``out[i]``."""
    R = np.stack([mats[i] for i in ids])
    fin = np.isfinite(R).all(axis=(1, 2))
    ids = [i for i, f in zip(ids, fin.tolist()) if f]
    if not ids:
        return
    R = R[fin]
    a = R[:, :, 0] - R[:, :1, 0]
    b = R[:, 0, :].copy()  # not a view: the stack goes when this returns
    scale = np.maximum(np.abs(R).max(axis=(1, 2)), 1e-300)
    ok = np.all(np.abs(R - (a[:, :, None] + b[:, None, :])) <= 1e-12 * scale[:, None, None], axis=(1, 2))
    for k, i in enumerate(ids):
        if ok[k]:
            out[i] = (a[k], b[k])


def pair_edges(edges, dom, lin: dict[int, np.ndarray], *, min_memory: bool):
    """The edges that need Alpa's pair variables, as (u, v, r) with ``r`` the edge's matrix on the nodes' allowed
    strategies; every other edge is folded into ``lin`` (each node's linear cost over its allowed strategies), in
    place, in edge order. Both model builders (PuLP and HiGHS direct) take the edges from here, so they build the
    same model.

    An edge between two decided nodes is a constant (evaluate() adds it back); with one side decided it is a linear
    term on the other; an additive matrix is two linear terms. When minimising memory only the forbidden pairs
    matter (their costs are dropped)."""
    todo = []  # (u, v, r, is r a matrix to test for additivity)
    for (u, v), m in edges.items():
        du, dv = dom[u], dom[v]
        if du.size == 1 and dv.size == 1:
            continue
        r = restrict(m, du, dv)
        if min_memory:
            if np.isfinite(r).all():
                continue
            r = np.where(np.isfinite(r), 0.0, np.inf)
        todo.append((u, v, r, du.size > 1 and dv.size > 1))
    # Additivity once per matrix object (identical layers' edges may share theirs), all of them at once.
    index: dict[int, int] = {}
    mats: list[np.ndarray] = []
    for *_, r, both in todo:
        if both and id(r) not in index:
            index[id(r)] = len(mats)
            mats.append(r)  # kept alive here: ids stay unique
    additive = _additive_all(mats)
    for u, v, r, both in todo:
        if dom[u].size == 1:
            lin[v] += r[0]  # finite: arc consistency removed partners of inf pairs
        elif dom[v].size == 1:
            lin[u] += r[:, 0]
        elif (ab := additive[index[id(r)]]) is not None:
            lin[u] += ab[0]
            lin[v] += ab[1]
        else:
            yield u, v, r
