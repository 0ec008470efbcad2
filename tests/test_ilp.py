"""The intra-operator ILP (autopar_lab.solve.ilp) against exhaustive search.

Every solver answer is checked against two references: the module's vectorised
``brute_force`` and a plain itertools enumeration written here, independent of the module.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar_lab.solve.ilp import (
    BRUTE_FORCE_LIMIT,
    InfeasibleError,
    IntraProblem,
    brute_force,
    evaluate,
    expand,
    merge_followers,
    solve_ilp,
    solve_min_memory,
)

INF = math.inf
SOLVERS = ["cbc", "highs", "highs-pulp"]
FAST = settings(max_examples=45, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def close(a: float, b: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


# ---------------------------------------------------------------- random problems


@st.composite
def problems(draw, dag: bool = False, memory: bool | None = None, pins: bool | None = None):
    """2-7 nodes, 1-4 strategies, small integer costs (ties happen), some inf pairs."""
    n = draw(st.integers(2, 7))
    sizes = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    node_costs = tuple(
        np.array(draw(st.lists(st.integers(0, 20), min_size=k, max_size=k)), float) for k in sizes
    )
    pairs = [(u, v) for u in range(n) for v in range(n) if (u < v if dag else u != v)]
    edges = tuple(draw(st.lists(st.sampled_from(pairs), max_size=min(9, len(pairs)))))
    # ~1 in 7 entries forbidden
    cell = st.integers(0, 27).map(lambda x: INF if x > 23 else float(x))
    edge_costs = tuple(
        np.array(draw(st.lists(cell, min_size=sizes[u] * sizes[v], max_size=sizes[u] * sizes[v]))).reshape(
            sizes[u], sizes[v])
        for u, v in edges
    )
    kw = {}
    use_mem = draw(st.booleans()) if memory is None else memory
    if use_mem:
        kw["node_mem"] = tuple(
            np.array(draw(st.lists(st.integers(0, 10), min_size=k, max_size=k)), float) for k in sizes
        )
        kw["live"] = tuple(
            tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)))
            for _ in range(draw(st.integers(1, 4)))
        )
        kw["mem_limit"] = float(draw(st.integers(0, 40))) if draw(st.integers(0, 4)) else INF
    use_pins = draw(st.booleans()) if pins is None else pins
    if use_pins:
        nodes = draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True))
        kw["pins"] = {v: draw(st.integers(0, sizes[v] - 1)) for v in nodes}
    return IntraProblem(node_costs, edges, edge_costs, **kw)


def reference(p: IntraProblem):
    """Plain enumeration: (best objective, min peak over allowed plans); inf when none."""
    doms = [[p.pins[v]] if v in p.pins else range(k) for v, k in enumerate(p.num_strategies)]
    best, minpeak = INF, INF
    for c in itertools.product(*doms):
        obj = sum(p.node_costs[v][c[v]] for v in range(p.num_nodes))
        obj += sum(m[c[u], c[v]] for (u, v), m in zip(p.edges, p.edge_costs))
        if math.isinf(obj):
            continue
        peak = 0.0
        if p.node_mem is not None:
            extra = p.mem_terms or [()] * len(p.live)
            peak = max((sum(p.node_mem[v][c[v]] for v in pt) + sum(vec[c[v]] for v, vec in ex)
                        for pt, ex in zip(p.live, extra)), default=0.0)
        minpeak = min(minpeak, peak)
        if peak <= p.mem_limit:
            best = min(best, obj)
    return best, minpeak


def check_solution(p: IntraProblem, s) -> None:
    ev = evaluate(p, s.choice)
    assert (s.objective, s.node_cost, s.edge_cost, s.peak_mem) == tuple(ev)
    assert close(s.objective, s.node_cost + s.edge_cost)
    assert s.peak_mem <= p.mem_limit
    for v, q in p.pins.items():
        assert s.choice[v] == q


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("solver", SOLVERS)
@FAST
@given(p=problems())
def test_ilp_matches_brute_force(solver, p):
    best, minpeak = reference(p)
    if math.isinf(best):
        with pytest.raises(InfeasibleError) as ilp_err:
            solve_ilp(p, solver=solver)
        with pytest.raises(InfeasibleError) as bf_err:
            brute_force(p)
        if math.isinf(minpeak):  # nothing allowed at all, memory aside
            assert ilp_err.value.min_peak_mem is None and bf_err.value.min_peak_mem is None
        else:
            assert close(ilp_err.value.min_peak_mem, minpeak)
            assert close(bf_err.value.min_peak_mem, minpeak)
            assert close(evaluate(p, ilp_err.value.choice).peak_mem, minpeak)
            assert "smallest peak memory" in str(ilp_err.value)
        return
    s = solve_ilp(p, solver=solver)
    b = brute_force(p)
    assert s.status == "optimal" and s.gap == 0.0 and s.solver in (solver, "reduction")
    assert close(s.objective, best) and close(b.objective, best)
    check_solution(p, s)
    check_solution(p, b)
    assert s.num_vars >= 0 and s.num_constraints >= 0


@pytest.mark.parametrize("solver", SOLVERS)
@settings(max_examples=30, deadline=None)
@given(p=problems(memory=True), data=st.data())
def test_memory_infeasible_reports_min_peak(solver, p, data):
    _, minpeak = reference(p)
    if math.isinf(minpeak):
        return
    m = solve_min_memory(p, solver=solver)
    assert close(m.peak_mem, minpeak) and m.status == "optimal"
    if minpeak == 0:
        return
    tight = IntraProblem(p.node_costs, p.edges, p.edge_costs, p.node_mem, p.live,
                         mem_limit=minpeak - data.draw(st.sampled_from([1e-3, 0.5, 1.0])), pins=p.pins)
    with pytest.raises(InfeasibleError) as err:
        solve_ilp(tight, solver=solver)
    assert close(err.value.min_peak_mem, minpeak) and err.value.exact
    msg = str(err.value)
    assert "more devices" in msg and "rematerialisation" in msg and "pipeline stages" in msg
    # ... and the limit it names is enough:
    fits = IntraProblem(p.node_costs, p.edges, p.edge_costs, p.node_mem, p.live,
                        mem_limit=err.value.min_peak_mem, pins=p.pins)
    assert solve_ilp(fits, solver=solver).peak_mem <= err.value.min_peak_mem


def test_memory_error_message_example():
    p = IntraProblem(node_costs=([1.0, 2.0], [1.0, 1.0]), edges=((0, 1),),
                     edge_costs=([[0.0, 1.0], [1.0, 0.0]],),
                     node_mem=([4.0 * 2**30, 2.0 * 2**30], [3.0 * 2**30, 1.0 * 2**30]),
                     live=((0, 1),), mem_limit=2.0 * 2**30)
    with pytest.raises(InfeasibleError, match=r"needs is 3 GiB") as err:
        solve_ilp(p)
    assert err.value.min_peak_mem == 3.0 * 2**30 and err.value.choice == (1, 1)


def test_structural_infeasibility():
    # both nodes pinned to strategies whose pair is forbidden
    p = IntraProblem(node_costs=([0.0, 0.0], [0.0, 0.0]), edges=((0, 1),),
                     edge_costs=([[INF, 0.0], [0.0, INF]],), pins={0: 0, 1: 0})
    for solver in SOLVERS:
        with pytest.raises(InfeasibleError, match="No sharding plan is allowed") as err:
            solve_ilp(p, solver=solver)
        assert err.value.min_peak_mem is None
    with pytest.raises(InfeasibleError):
        brute_force(p)


@pytest.mark.parametrize("solver", SOLVERS)
@settings(max_examples=20, deadline=None)
@given(p=problems(memory=False), data=st.data())
def test_pins_respected_and_warm_start(solver, p, data):
    if math.isinf(reference(p)[0]):
        return
    s = solve_ilp(p, solver=solver)
    # warm start from the optimum, and from some other plan, gives the same optimum
    w = solve_ilp(p, solver=solver, warm_start=s.choice)
    assert close(w.objective, s.objective)
    other = tuple(data.draw(st.integers(0, k - 1)) for k in p.num_strategies)
    w2 = solve_ilp(p, solver=solver, warm_start=other)
    assert close(w2.objective, s.objective)
    # pin every node to the optimum: the same plan comes back, without a solver
    pinned = IntraProblem(p.node_costs, p.edges, p.edge_costs, pins=dict(enumerate(s.choice)))
    ps = solve_ilp(pinned, solver=solver)
    assert ps.choice == s.choice and ps.num_vars == 0 and ps.solver == "reduction"


def test_deterministic():
    rng = np.random.default_rng(3)
    n = 25
    p = IntraProblem(
        node_costs=tuple(rng.integers(0, 3, 4).astype(float) for _ in range(n)),
        edges=tuple((v - 1, v) for v in range(1, n)) + ((0, n - 1),),
        edge_costs=tuple(rng.integers(0, 3, (4, 4)).astype(float) for _ in range(n)),
    )
    for solver in SOLVERS:
        runs = {solve_ilp(p, solver=solver).choice for _ in range(3)}
        assert len(runs) == 1
    assert brute_force(IntraProblem(node_costs=([1.0, 1.0], [2.0, 2.0]))).choice == (0, 0)


# ---------------------------------------------------------------- model reductions


def test_reductions_shrink_the_model():
    M = np.array([[0.0, 3.0, 1.0], [2.0, 0.0, 4.0], [1.0, 1.0, 0.0]])
    # chain 0 -> 1 -> 2; node 1 has one strategy: both edges become linear terms
    p = IntraProblem(node_costs=(np.zeros(3), np.zeros(1), np.zeros(3)), edges=((0, 1), (1, 2)),
                     edge_costs=(M[:, :1], M[:1, :]))
    s = solve_ilp(p)
    assert s.num_vars == 6 and s.num_constraints == 2  # 3 + 3 binaries, two one-hot rows
    # an all-zero and an additive edge: no e variables either
    add = np.add.outer([1.0, 2.0, 0.0], [0.0, 5.0, 1.0])
    p2 = IntraProblem(node_costs=(np.zeros(3),) * 3, edges=((0, 1), (1, 2)), edge_costs=(np.zeros((3, 3)), add))
    s2 = solve_ilp(p2)
    assert s2.num_vars == 9 and close(s2.objective, brute_force(p2).objective)
    # a general edge: 9 e variables, 3 row + 2 column links
    p3 = IntraProblem(node_costs=(np.zeros(3),) * 2, edges=((0, 1),), edge_costs=(M,))
    s3 = solve_ilp(p3)
    assert s3.num_vars == 6 + 9 and s3.num_constraints == 2 + 5
    # an inf pair gets no variable
    M4 = M.copy()
    M4[0, 1] = INF
    assert solve_ilp(IntraProblem(node_costs=(np.zeros(3),) * 2, edges=((0, 1),), edge_costs=(M4,))).num_vars == 14
    # pins and a forbidden strategy: nothing left to decide
    p5 = IntraProblem(node_costs=(np.array([0.0, INF]), np.zeros(3)), edges=((0, 1),), edge_costs=(M[:2],),
                      pins={1: 2})
    s5 = solve_ilp(p5)
    assert s5.choice == (0, 2) and s5.num_vars == 0 and s5.objective == 1.0


@pytest.mark.parametrize("solver", ["cbc", "highs"])  # PuLP's HiGHS reports no bound if stopped before the root LP
def test_time_limit_reports_gap(solver):
    # A frustrated random instance that is not proven optimal in a fraction of a second.
    rng = np.random.default_rng(0)
    n, k = 120, 8
    edges = sorted({(int(u), int(v)) for v in range(1, n) for u in rng.choice(v, size=min(v, 3), replace=False)})
    p = IntraProblem(node_costs=tuple(rng.uniform(0, 1, k) for _ in range(n)), edges=tuple(edges),
                     edge_costs=tuple(rng.uniform(0, 2, (k, k)) for _ in edges))
    s = solve_ilp(p, solver=solver, time_limit=1)
    check_solution(p, s)
    assert s.status in ("optimal", "time_limit")
    if s.status == "time_limit" and s.gap is not None:  # no bound when stopped before the root LP (a loaded machine)
        assert 0 <= s.gap < 1
    assert s.num_vars > n * k


# ---------------------------------------------------------------- follower merging


@settings(max_examples=40, deadline=None)
@given(p=problems(dag=True), data=st.data())
def test_merge_is_exact_on_the_reduced_space(p, data):
    mergeable = data.draw(st.lists(st.booleans(), min_size=p.num_nodes, max_size=p.num_nodes))
    r, rec = merge_followers(p, mergeable)
    assert len(rec.kept) == r.num_nodes and len(rec.group) == p.num_nodes
    for v, u in rec.parent.items():
        assert mergeable[v] and {a for a, b in p.edges if b == v} == {u}
    # every reduced plan maps to a full plan with the same cost and peak memory
    for c in itertools.islice(itertools.product(*(range(k) for k in r.num_strategies)), 200):
        er = evaluate(r, c)
        try:
            full = expand(rec, c)
        except ValueError:  # a leader strategy its follower forbids
            assert math.isinf(er.objective)
            continue
        ef = evaluate(p, full)
        assert close(er.objective, ef.objective)
        if math.isfinite(ef.objective):
            assert close(er.peak_mem, ef.peak_mem)
    # the merged optimum is exact on the reduced space and never beats the full one
    best_full, _ = reference(p)
    best_red, _ = reference(r)
    assert best_red >= best_full - 1e-9
    if math.isfinite(best_red):
        s = solve_ilp(r, solver="highs")
        assert close(s.objective, best_red)
        full = expand(rec, s.choice)
        assert close(evaluate(p, full).objective, s.objective)
        for v, q in p.pins.items():
            assert full[v] == q
    else:
        with pytest.raises(InfeasibleError):
            solve_ilp(r)


def test_merge_loses_optimality_example():
    # x -> relu -> y. relu is cheapest in strategy 0 whatever x does, but y can only
    # read strategy 1 cheaply: merging relu into x fixes relu by its local optimum.
    big = 10.0
    p = IntraProblem(
        node_costs=(np.array([0.0, 0.0]), np.array([0.0, 1.0]), np.array([0.0, 0.0])),
        edges=((0, 1), (1, 2)),
        edge_costs=(np.array([[0.0, 0.0], [0.0, 0.0]]), np.array([[big, big], [0.0, 0.0]])),
        names=("x", "relu", "y"),
    )
    r, rec = merge_followers(p, [False, True, False])
    assert r.num_nodes == 2 and r.names == ("x (+1)", "y")
    assert rec.followers(0) == (1,) and rec.parent == {1: 0}
    assert list(rec.mapping[1]) == [0, 0]
    assert rec.describe(p.names) == ["relu follows x (leader x): 0->0 1->0"]
    merged = solve_ilp(r)
    assert merged.objective == big and solve_ilp(p).objective == 1.0
    # undo: relu not mergeable any more
    r2, rec2 = merge_followers(p, [False, False, False])
    assert r2.num_nodes == 3 and solve_ilp(r2).objective == 1.0 and not rec2.parent


def test_merge_chain_pins_and_memory():
    # 0 -> 1 -> 2 (1, 2 trivial) and 2 -> 3; node 2 pinned; memory of followers still counts
    e = np.array([[0.0, 2.0], [2.0, 0.0]])
    p = IntraProblem(
        node_costs=(np.array([0.0, 0.5]), np.zeros(2), np.zeros(2), np.zeros(2)),
        edges=((0, 1), (1, 2), (2, 3)), edge_costs=(e, e, e),
        node_mem=(np.array([1.0, 1.0]), np.array([5.0, 1.0]), np.array([1.0, 7.0]), np.array([1.0, 1.0])),
        live=((0, 1), (1, 2), (2, 3)), mem_limit=20.0, pins={2: 1},
    )
    r, rec = merge_followers(p, [False, True, True, False])
    assert rec.kept == (0, 3) and rec.group == (0, 0, 0, 1) and dict(rec.parent) == {1: 0, 2: 1}
    assert [list(rec.mapping[1]), list(rec.mapping[2])] == [[0, 1], [1, 1]]
    for c in itertools.product(range(2), range(2)):
        er, ef = evaluate(r, c), evaluate(p, expand(rec, c))
        # folded edge costs move into node costs; the totals and the peak stay the same
        assert (er.objective, er.peak_mem) == (ef.objective, ef.peak_mem)
    s = solve_ilp(r)
    assert expand(rec, s.choice)[2] == 1 and close(s.objective, brute_force(r).objective)


def test_merge_rejects_cycles_and_bad_input():
    p = IntraProblem(node_costs=(np.zeros(1), np.zeros(1)), edges=((0, 1), (1, 0)),
                     edge_costs=(np.zeros((1, 1)), np.zeros((1, 1))))
    with pytest.raises(ValueError, match="acyclic"):
        merge_followers(p, [True, True])
    with pytest.raises(ValueError):
        merge_followers(p, [True])


# ---------------------------------------------------------------- validation


def test_problem_validation():
    with pytest.raises(ValueError, match="shape"):
        IntraProblem(node_costs=(np.zeros(2), np.zeros(3)), edges=((0, 1),), edge_costs=(np.zeros((3, 2)),))
    with pytest.raises(ValueError, match="outside"):
        IntraProblem(node_costs=(np.zeros(2),), edges=((0, 1),), edge_costs=(np.zeros((2, 2)),))
    with pytest.raises(ValueError, match="pin"):
        IntraProblem(node_costs=(np.zeros(2),), pins={0: 2})
    with pytest.raises(ValueError, match="node_mem"):
        IntraProblem(node_costs=(np.zeros(2),), mem_limit=1.0)
    with pytest.raises(ValueError, match="NaN"):
        IntraProblem(node_costs=(np.array([np.nan, 1.0]),))
    p = IntraProblem(node_costs=(np.zeros(2),), node_mem=(np.array([1.0, 2.0]),))
    assert p.live == ((0,),)  # no live sets: everything is live at one point
    with pytest.raises(ValueError):
        evaluate(p, (2,))
    with pytest.raises(ValueError, match="solver"):
        solve_ilp(IntraProblem(node_costs=(np.zeros(2), np.zeros(2)), edges=((0, 1),),
                               edge_costs=(np.eye(2),)), solver="gurobi")
    big = IntraProblem(node_costs=tuple(np.zeros(4) for _ in range(11)))
    assert 4**11 > BRUTE_FORCE_LIMIT
    with pytest.raises(ValueError, match="brute_force"):
        brute_force(big)


@FAST
@given(p=problems())
def test_direct_highs_model_is_the_pulp_model(p):
    """The array builder (solver="highs") makes the PuLP builder's reduced model: same domains, scale, columns and
    rows; and its LP-first shortcut finds the optimum the MIP finds."""
    from autopar_lab.solve.ilp import highs_direct, pulp_model

    for min_memory in ((False, True) if p.node_mem is not None else (False,)):
        a = highs_direct.build(p, min_memory=min_memory)
        b = pulp_model.build(p, min_memory=min_memory)
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert [d.tolist() for d in a.dom] == [d.tolist() for d in b.dom] and a.scale == b.scale
        assert a.integer.sum() == sum(len(xs) for xs in b.x.values())
        pairs = sum(len(cells) for *_, cells in b.e)
        assert a.num_col == a.integer.sum() + pairs + (1 if min_memory else 0)  # + the peak column
        assert a.num_row == b.prob.numConstraints()
    try:
        lp_first = solve_ilp(p, solver="highs")
    except InfeasibleError:
        return
    mip = solve_ilp(p, solver="highs", time_limit=600.0)  # a time limit sends it straight to the MIP
    assert close(lp_first.objective, mip.objective) and mip.status == "optimal"


@FAST
@given(p=problems(memory=False))
def test_direct_highs_rows_are_one_hot_then_each_edges_linking_rows(p):
    """The array model's rows, entry by entry and in order (HiGHS's answer may depend on it): each node's one-hot
    row, then per pair edge the rows sum_q e[p, q] - x_u[p] = 0 for every p and sum_p e[p, q] - x_v[q] = 0 for every
    q but the last (pair columns in column order, the node's column last)."""
    from autopar_lab.solve.ilp import highs_direct

    m = highs_direct.build(p, min_memory=False)
    if m is None:
        return
    want = [(list(cols), [1.0] * len(cols), 1.0) for cols in m.x.values()]
    for u, v, P, Q, cols in m.e:
        for k in range(len(m.x[u])):
            want.append((list(cols[P == k]) + [m.x[u][k]], [1.0] * int((P == k).sum()) + [-1.0], 0.0))
        for k in range(len(m.x[v]) - 1):
            want.append((list(cols[Q == k]) + [m.x[v][k]], [1.0] * int((Q == k).sum()) + [-1.0], 0.0))
    assert len(want) == m.num_row
    for r, (cols, vals, rhs) in enumerate(want):
        a, b = m.start[r], m.start[r + 1]
        assert m.index[a:b].tolist() == [int(c) for c in cols] and m.value[a:b].tolist() == vals
        assert m.row_lower[r] == m.row_upper[r] == rhs


def test_read_only_edge_matrices_are_kept_checked_and_others_copied():
    """A problem keeps an edge matrix nobody can write (the intra-op pass shares one among many edges) and copies
    any other; either way a NaN or a wrong shape is still refused, on every edge that carries the matrix."""
    costs = (np.zeros(2), np.zeros(2), np.zeros(3))
    shared = np.array([[0.0, 1.0], [2.0, 3.0]])
    shared.setflags(write=False)
    mine = np.ones((2, 2))
    p = IntraProblem(costs, edges=((0, 1), (1, 0), (0, 1)), edge_costs=(shared, shared.T, mine))
    assert p.edge_costs[0] is shared and p.edge_costs[1].base is shared
    assert p.edge_costs[2] is not mine and not p.edge_costs[2].flags.writeable
    mine[0, 0] = 5.0  # the caller's array is not the problem's
    assert p.edge_costs[2][0, 0] == 1.0
    base = np.zeros((2, 2))
    view = base[:, :]
    view.setflags(write=False)  # read-only, but its base can still be written: copied
    q = IntraProblem(costs[:2], edges=((0, 1),), edge_costs=(view,))
    base[0, 0] = 7.0
    assert q.edge_costs[0][0, 0] == 0.0
    bad = np.array([[0.0, np.nan], [1.0, 2.0]])
    bad.setflags(write=False)
    with pytest.raises(ValueError, match="edge 0 .*NaN"):
        IntraProblem(costs[:2], edges=((0, 1), (0, 1)), edge_costs=(bad, bad))
    with pytest.raises(ValueError, match="edge 1 .*shape"):  # the same matrix, checked once, on a 2 x 3 edge
        IntraProblem(costs, edges=((0, 1), (0, 2)), edge_costs=(shared, shared))


@FAST
@given(data=st.data())
def test_restrict_is_the_submatrix_of_the_domains(data):
    from autopar_lab.solve.ilp.reduce import restrict

    rows, cols = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 5))
    m = np.arange(rows * cols, dtype=float).reshape(rows, cols)
    du = np.array(sorted(data.draw(st.sets(st.integers(0, rows - 1), min_size=1))), dtype=np.intp)
    dv = np.array(sorted(data.draw(st.sets(st.integers(0, cols - 1), min_size=1))), dtype=np.intp)
    r = restrict(m, du, dv)
    assert np.array_equal(r, m[np.ix_(du, dv)])
    assert (r is m) == (du.size == rows and dv.size == cols)


def _old_domains(p: IntraProblem, edges) -> list[list[int]] | None:
    """Arc consistency as it was before the solver skipped edges with every pair allowed: every edge walked on every
    pass (memory rows left out: the problems below have none)."""
    mask = [np.isfinite(c) for c in p.node_costs]
    for v, q in p.pins.items():
        m = np.zeros_like(mask[v])
        m[q] = mask[v][q]
        mask[v] = m
    changed = True
    while changed:
        changed = False
        if any(not m.any() for m in mask):
            return None
        for (u, v), r in edges.items():
            f = np.isfinite(r)
            mu, mv = mask[u] & f[:, mask[v]].any(axis=1), mask[v] & f[mask[u], :].any(axis=0)
            if (mu != mask[u]).any() or (mv != mask[v]).any():
                mask[u], mask[v], changed = mu, mv, True
                if not mu.any() or not mv.any():
                    return None
    return [np.flatnonzero(m).tolist() for m in mask]


@FAST
@given(p=problems(memory=False), data=st.data())
def test_shared_read_only_arrays_build_the_model_of_copies(p, data):
    """The intra-op pass hands one read-only array to many nodes and edges (one per strategy list, per pair of
    lists), and the model builder remembers per array what it found (its maximum, whether it is additive), as the
    problem keeps it unchecked after the first time. The same problem with every array a fresh copy builds the
    same model, array for array, and the same plan; and the domains are those of arc consistency walking every
    edge (the builder skips edges with every pair allowed)."""
    from autopar_lab.solve.ilp import highs_direct
    from autopar_lab.solve.ilp.reduce import combined_edges, reductions

    pool: dict[tuple, np.ndarray] = {}  # one read-only matrix per shape, drawn once: edges of a shape share it
    mats = []
    for (u, v), m in zip(p.edges, p.edge_costs):
        if m.shape not in pool or data.draw(st.booleans()):
            pool[m.shape] = np.array(m)
            pool[m.shape].setflags(write=False)
        mats.append(pool[m.shape])
    vecs: dict[int, np.ndarray] = {}
    costs = []
    for c in p.node_costs:
        if c.size not in vecs or data.draw(st.booleans()):
            vecs[c.size] = np.array(c)
            vecs[c.size].setflags(write=False)
        costs.append(vecs[c.size])
    shared = IntraProblem(tuple(costs), p.edges, tuple(mats), pins=p.pins)
    copies = IntraProblem(tuple(np.array(c) for c in costs), p.edges, tuple(np.array(m) for m in mats), pins=p.pins)
    assert all(a is b for a, b in zip(shared.node_costs, costs))  # kept, not copied
    a, b = highs_direct.build(shared, min_memory=False), highs_direct.build(copies, min_memory=False)
    assert (a is None) == (b is None)
    want = _old_domains(copies, combined_edges(copies))
    got = reductions(shared, min_memory=False)
    assert (got is None) == (want is None)
    if a is None:
        return
    assert [d.tolist() for d in got[2]] == want
    for f in ("cost", "lower", "upper", "integer", "start", "index", "value", "row_lower", "row_upper"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.scale == b.scale
    assert solve_ilp(shared, solver="highs").choice == solve_ilp(copies, solver="highs").choice


def test_read_only_node_costs_are_kept_checked_and_others_copied():
    shared = np.array([1.0, 2.0])
    shared.setflags(write=False)
    mine = np.array([3.0, 4.0])
    p = IntraProblem((shared, mine, shared))
    assert p.node_costs[0] is shared and p.node_costs[2] is shared
    assert p.node_costs[1] is not mine and not p.node_costs[1].flags.writeable
    bad = np.array([0.0, np.nan])
    bad.setflags(write=False)
    with pytest.raises(ValueError, match=r"node_costs\[1\] contains NaN"):
        IntraProblem((shared, bad))
    empty = np.zeros(0)
    empty.setflags(write=False)
    with pytest.raises(ValueError, match=r"node_costs\[0\] is empty"):
        IntraProblem((empty,))
