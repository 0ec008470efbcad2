"""The HiGHS array model (``highs_direct.build``) against the per-edge builder it replaced, array for array.

``reference_build`` below is that builder as it was (2026-12-07, before the edges' rows were assembled per pattern
of finite entries and the edges' additivity and scale tested per shape, stacked): the rows, columns, coefficients,
bounds and costs HiGHS reads must stay the same, entry for entry and in order, so that it solves the same LP (its
answer on ties may depend on the order).
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ilp import problems

from autopar_lab.solve.ilp import IntraProblem, highs_direct
from autopar_lab.solve.ilp.reduce import is_additive, reductions, restrict

INF = math.inf
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- the reference: the per-edge builder


def reference_pair_edges(edges, dom, lin, *, min_memory):
    """``reduce.pair_edges`` as it was: additivity tested edge by edge (``is_additive``), cached per matrix object."""
    additive: dict[int, tuple] = {}
    for (u, v), m in edges.items():
        du, dv = dom[u], dom[v]
        if du.size == 1 and dv.size == 1:
            continue
        r = restrict(m, du, dv)
        if min_memory:
            if np.isfinite(r).all():
                continue
            r = np.where(np.isfinite(r), 0.0, np.inf)
        if du.size == 1:
            lin[v] += r[0]
            continue
        if dv.size == 1:
            lin[u] += r[:, 0]
            continue
        hit = additive.get(id(r))
        if hit is None or hit[0] is not r:
            hit = additive[id(r)] = (r, is_additive(r))
        ab = hit[1]
        if ab is not None:
            lin[u] += ab[0]
            lin[v] += ab[1]
            continue
        yield u, v, r



class _RefRows:
    def __init__(self):
        self.idx, self.val, self.len, self.lo, self.hi = [], [], [], [], []

    def add(self, cols, vals, lo, hi):
        cols = np.asarray(cols, dtype=np.int32)
        self.idx.append(cols)
        self.val.append(np.asarray(vals, dtype=float))
        self.len.append(np.array([cols.size], dtype=np.int64))
        self.lo.append(np.array([lo], dtype=float))
        self.hi.append(np.array([hi], dtype=float))

    def add_group_blocks(self, blocks):
        rid, col, own_rid, own_col, off = [], [], [], [], 0
        for cols, group, own, count in blocks:
            keep = group < count
            rid.append(group[keep].astype(np.int64) + off)
            col.append(cols[keep].astype(np.int32))
            own_rid.append(np.arange(off, off + count, dtype=np.int64))
            own_col.append(own[:count].astype(np.int32))
            off += count
        if not off:
            return
        rows = np.concatenate(rid + own_rid)
        n_in = sum(r.size for r in rid)
        key = 2 * rows + (np.arange(rows.size) >= n_in)
        order = np.argsort(key, kind="stable")
        self.idx.append(np.concatenate(col + own_col)[order])
        self.val.append(np.where(order < n_in, 1.0, -1.0))
        self.len.append(np.bincount(rows, minlength=off).astype(np.int64))
        self.lo.append(np.zeros(off))
        self.hi.append(np.zeros(off))

    def csr(self):
        lengths = np.concatenate(self.len) if self.len else np.zeros(0, dtype=np.int64)
        start = np.zeros(lengths.size + 1, dtype=np.int32)
        np.cumsum(lengths, out=start[1:])
        index = np.concatenate(self.idx) if self.idx else np.zeros(0, dtype=np.int32)
        value = np.concatenate(self.val) if self.val else np.zeros(0)
        lo = np.concatenate(self.lo) if self.lo else np.zeros(0)
        hi = np.concatenate(self.hi) if self.hi else np.zeros(0)
        return start, index, value, lo, hi


def reference_build(problem: IntraProblem, *, min_memory: bool):
    reduced = reductions(problem, min_memory=min_memory)
    if reduced is None:
        return None
    edges, rows, dom, scale = reduced
    limit = math.inf if min_memory else problem.mem_limit

    ncol = 0
    x: dict[int, np.ndarray] = {}
    lin: dict[int, np.ndarray] = {}
    out = _RefRows()
    for v, d in enumerate(dom):
        if d.size > 1:
            x[v] = np.arange(ncol, ncol + d.size, dtype=np.int32)
            ncol += d.size
            lin[v] = np.zeros(d.size) if min_memory else problem.node_costs[v][d].astype(float)
            out.add(x[v], np.ones(d.size), 1.0, 1.0)

    e_cost: list[np.ndarray] = []
    e_list = []
    blocks = []
    for u, v, r in reference_pair_edges(edges, dom, lin, min_memory=min_memory):
        du, dv = dom[u], dom[v]
        P, Q = np.nonzero(np.isfinite(r))
        cols = np.arange(ncol, ncol + P.size, dtype=np.int32)
        ncol += P.size
        e_cost.append(r[P, Q] / scale)
        blocks.append((cols, P, x[u], du.size))
        order = np.argsort(Q, kind="stable")
        blocks.append((cols[order], Q[order], x[v][:-1], dv.size - 1))
        e_list.append((u, v, P, Q, cols))
    out.add_group_blocks(blocks)

    nx = sum(c.size for c in x.values())
    cost = np.zeros(ncol + (1 if min_memory else 0))
    for v, c in lin.items():
        cost[x[v]] = c / scale
    off = nx
    for c in e_cost:
        cost[off:off + c.size] = c
        off += c.size
    lower = np.zeros(cost.size)
    upper = np.ones(cost.size)
    integer = np.zeros(cost.size, dtype=bool)
    integer[:nx] = True

    def row_terms(row, mscale):
        cols, vals = [], []
        for v, vec in row.items():
            if v in x:
                b = vec[dom[v]] / mscale
                nz = b != 0.0
                cols.append(x[v][nz])
                vals.append(b[nz])
        const = sum(float(vec[dom[v][0]]) for v, vec in row.items() if dom[v].size == 1)
        return (np.concatenate(cols) if cols else np.zeros(0, dtype=np.int32),
                np.concatenate(vals) if vals else np.zeros(0), const)

    if min_memory:
        peak = ncol
        upper[peak] = math.inf
        cost[:] = 0.0
        cost[peak] = 1.0
        mscale = max((float(vec.max()) for row in rows for vec in row.values()), default=1.0) or 1.0
        for row in rows:
            cols, vals, const = row_terms(row, mscale)
            if cols.size:
                out.add(np.append(cols, peak), np.append(vals, -1.0), -math.inf, -const / mscale)
    elif math.isfinite(limit):
        mscale = max(limit, 1.0)
        for row in rows:
            const = sum(float(vec[dom[v][0]]) for v, vec in row.items() if dom[v].size == 1)
            worst = const + sum(float(vec[dom[v]].max()) for v, vec in row.items() if v in x)
            if worst <= limit:
                continue
            cols, vals, _ = row_terms(row, mscale)
            out.add(cols, vals, -math.inf, (limit - const) / mscale)
    start, index, value, row_lower, row_upper = out.csr()
    return dict(dom=dom, x=x, e=e_list, cost=cost, lower=lower, upper=upper, integer=integer, start=start,
                index=index, value=value, row_lower=row_lower, row_upper=row_upper, scale=scale)


def reference_scale(problem: IntraProblem, edges, dom) -> float:
    """``reductions``' objective scale as it was: each edge matrix's largest finite |entry|, edge by edge."""
    finite_costs = [float(np.abs(c[d]).max()) for c, d in zip(problem.node_costs, dom)]
    for (u, v), m in edges.items():
        r = restrict(m, dom[u], dom[v])
        fin = np.isfinite(r)
        if fin.any():
            finite_costs.append(float(np.abs(r[fin]).max()))
    return max(max(finite_costs, default=1.0), 1e-300)


# ---------------------------------------------------------------- comparison


ARRAYS = ("cost", "lower", "upper", "integer", "start", "index", "value", "row_lower", "row_upper")


def assert_same_model(p: IntraProblem, min_memory: bool) -> None:
    got = highs_direct.build(p, min_memory=min_memory)
    want = reference_build(p, min_memory=min_memory)
    assert (got is None) == (want is None)
    if got is None:
        return
    for f in ARRAYS:
        a, b = getattr(got, f), want[f]
        assert a.dtype == b.dtype and a.shape == b.shape, f
        assert np.array_equal(a, b), f  # exact: the same floats, not close ones
    assert got.scale == want["scale"]
    if not min_memory:
        assert got.scale == reference_scale(p, reductions(p, min_memory=False)[0], got.dom)
    assert [d.tolist() for d in got.dom] == [d.tolist() for d in want["dom"]]
    assert list(got.x) == list(want["x"])
    for v, cols in want["x"].items():
        assert got.x[v].dtype == cols.dtype and got.x[v].tolist() == cols.tolist()
    assert len(got.e) == len(want["e"])
    for (u, v, P, Q, cols), (u2, v2, P2, Q2, cols2) in zip(got.e, want["e"]):
        assert (u, v) == (u2, v2)
        assert P.tolist() == P2.tolist() and Q.tolist() == Q2.tolist()
        assert cols.dtype == cols2.dtype and cols.tolist() == cols2.tolist()


@st.composite
def shared_problems(draw):
    """Problems shaped like the planner's: many edges between few strategy counts, matrices shared among edges (one
    read-only object per shape, as the intra-op pass hands them) or fresh, some additive (folded into the nodes),
    some with forbidden pairs (patterns of finite entries), pins (nodes decided: their edges become linear terms),
    and memory rows under a limit or none."""
    n = draw(st.integers(2, 14))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    node_costs = tuple(np.array(draw(st.lists(st.integers(0, 20), min_size=k, max_size=k)), float) for k in sizes)
    pairs = [(u, v) for u in range(n) for v in range(n) if u != v]
    edges = tuple(draw(st.lists(st.sampled_from(pairs), max_size=min(30, len(pairs)))))
    cell = st.integers(0, 27).map(lambda c: INF if c > 23 else float(c))
    pool: dict[tuple, np.ndarray] = {}
    mats = []
    for u, v in edges:
        shape = (sizes[u], sizes[v])
        if shape not in pool or draw(st.integers(0, 3)) == 0:
            kind = draw(st.integers(0, 2))
            if kind == 0:  # additive: a[p] + b[q]
                a = np.array(draw(st.lists(st.integers(0, 9), min_size=shape[0], max_size=shape[0])), float)
                b = np.array(draw(st.lists(st.integers(0, 9), min_size=shape[1], max_size=shape[1])), float)
                m = a[:, None] + b[None, :]
            else:
                m = np.array(draw(st.lists(cell if kind == 1 else st.integers(0, 27).map(float),
                                           min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]))
                             ).reshape(shape)
            m.setflags(write=False)
            pool[shape] = m
        mats.append(pool[shape])
    kw = {}
    if draw(st.booleans()):
        kw["node_mem"] = tuple(np.array(draw(st.lists(st.integers(0, 10), min_size=k, max_size=k)), float)
                               for k in sizes)
        kw["live"] = tuple(tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)))
                           for _ in range(draw(st.integers(1, 5))))
        kw["mem_limit"] = float(draw(st.integers(0, 60))) if draw(st.integers(0, 4)) else INF
    nodes = draw(st.lists(st.integers(0, n - 1), max_size=3, unique=True))
    kw["pins"] = {v: draw(st.integers(0, sizes[v] - 1)) for v in nodes}
    return IntraProblem(node_costs, edges, tuple(mats), **kw)


@FAST
@given(p=problems())
def test_model_is_the_per_edge_builders(p):
    """Random small problems (memory rows under a limit, pins, forbidden pairs): the same model as the reference,
    minimising cost and (with memory) minimising the peak."""
    for min_memory in ((False, True) if p.node_mem is not None else (False,)):
        assert_same_model(p, min_memory)


@FAST
@given(p=shared_problems())
def test_model_with_shared_matrices_is_the_per_edge_builders(p):
    """Many edges per shape and per pattern of finite entries, sharing matrix objects: the same model, the pair
    edges' rows interleaved in edge order whatever their pattern."""
    for min_memory in ((False, True) if p.node_mem is not None else (False,)):
        assert_same_model(p, min_memory)


def test_model_examples_cover_the_cases():
    """A fixed problem with every kind of edge at once: pair edges of two patterns (one with a forbidden pair), an
    edge to a pinned (single-strategy) node, an additive edge, and memory rows that bind; then with no pair edge."""
    fin = np.array([[1.0, 2.0, 0.0], [3.0, INF, 1.0]])
    full = np.array([[0.0, 5.0], [2.0, 0.0], [1.0, 7.0]])
    additive = np.add.outer([0.0, 1.0, 2.0], [0.0, 3.0])
    p = IntraProblem(node_costs=(np.array([1.0, 2.0]), np.array([3.0, 1.0, 2.0]), np.array([1.0, 1.0]),
                                 np.array([0.0, 4.0]), np.array([2.0, 2.0, 1.0])),
                     edges=((0, 1), (1, 2), (1, 3), (0, 2), (4, 2), (0, 1)),
                     edge_costs=(fin, full, additive, np.ones((2, 2)), full, fin),
                     node_mem=(np.array([1.0, 2.0]), np.array([3.0, 1.0, 2.0]), np.array([1.0, 5.0]),
                               np.array([2.0, 2.0]), np.array([1.0, 1.0, 4.0])),
                     live=((0, 1, 2), (2, 3, 4), (1, 4)), mem_limit=9.0, pins={3: 1})
    m = highs_direct.build(p, min_memory=False)
    assert m is not None and len(m.e) >= 2 and m.row_lower.size > len(m.x) + 2 * len(m.e)
    assert np.isinf(m.row_lower).any()  # a memory row is there
    for min_memory in (False, True):
        assert_same_model(p, min_memory)
    lone = IntraProblem(node_costs=(np.array([1.0, 2.0]), np.array([3.0])), edges=((0, 1),),
                        edge_costs=(np.array([[1.0], [0.0]]),))
    assert highs_direct.build(lone, min_memory=False).e == []
    assert_same_model(lone, False)
