"""The intra-operator ILP built as arrays and handed to HiGHS through highspy, without PuLP.

:func:`autopar_lab.solve.ilp.solve_ilp` with ``solver="highs"`` lands here. The model is the
one :mod:`autopar_lab.solve.ilp` documents (the same reductions, variables, rows and
objective scaling as its PuLP builder, which ``solver="cbc"`` still uses and which the tests
hold as the reference); only the way it reaches the solver differs. PuLP builds one Python
object per variable and per term and CBC reads the model from an MPS file it writes, which
on the planner's problems took longer than solving them. Here the constraint matrix is
assembled row-wise with numpy and passed to HiGHS in one ``passModel`` call, in process.

Example (the two-node problem of :mod:`autopar_lab.solve.ilp`):

>>> import numpy as np
>>> from autopar_lab.solve.ilp import IntraProblem
>>> p = IntraProblem(node_costs=(np.array([4.0, 1.0]), np.array([4.0, 1.0])),
...                  edges=((0, 1),), edge_costs=(np.array([[0.0, 0.0], [5.0, 0.0]]),))
>>> m = build(p, min_memory=False)
>>> m.num_col, m.num_row   # 2 x 2 binaries, 4 pair columns; 2 one-hot rows, 2 + 1 linking rows
(8, 5)
>>> solve(p).choice
(1, 1)
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from .problem import IntraProblem, IntraSolution, check_choice, evaluate, relative_gap
from .reduce import greedy, pair_edges, reductions

__all__ = ["ArrayModel", "build", "solve"]

# An LP solution whose binaries are all this close to 0 or 1 is taken as integral (HiGHS' own MIP feasibility
# tolerance is 1e-6; this is stricter).
_INTEGRAL_TOL = 1e-9


@dataclass
class ArrayModel:
    """A reduced ILP in row-wise sparse form (HiGHS' ``kRowwise`` layout).

    ``x[v]``: the binary columns of node ``v``, aligned with ``dom[v]`` (nodes whose domain has
    one strategy have none); ``e``: ``(u, v, p, q, cols)`` for every edge that kept Alpa's
    pair variables, ``p``/``q`` domain indices of each pair column.
    """

    dom: list
    x: dict
    e: list
    cost: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    start: np.ndarray
    index: np.ndarray
    value: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    scale: float
    build_s: float

    @property
    def num_col(self) -> int:
        return int(self.cost.size)

    @property
    def num_row(self) -> int:
        return int(self.row_lower.size)


class _Rows:
    """Constraint rows, gathered in blocks of (column indices, values, row lengths, lower, upper); CSR at the end."""

    def __init__(self):
        self.idx, self.val, self.len, self.lo, self.hi = [], [], [], [], []

    def add(self, cols, vals, lo, hi):
        cols = np.asarray(cols, dtype=np.int32)
        self.idx.append(cols)
        self.val.append(np.asarray(vals, dtype=float))
        self.len.append(np.array([cols.size], dtype=np.int64))
        self.lo.append(np.array([lo], dtype=float))
        self.hi.append(np.array([hi], dtype=float))

    def add_groups(self, cols, group, own, count):
        """``count`` equality rows: row g is sum(cols where group == g) - own[g] = 0 (``group`` sorted; entries
        with group >= count are left out)."""
        keep = group < count
        cols, group = cols[keep], group[keep]
        sizes = np.bincount(group, minlength=count)
        ends = np.cumsum(sizes)
        self.idx.append(np.insert(cols.astype(np.int32), ends, own[:count].astype(np.int32)))
        self.val.append(np.insert(np.ones(cols.size), ends, -1.0))
        self.len.append(sizes.astype(np.int64) + 1)
        self.lo.append(np.zeros(count))
        self.hi.append(np.zeros(count))

    def add_group_blocks(self, blocks):
        """:meth:`add_groups` for many blocks ``(cols, group, own, count)`` at once, the rows in the same order and
        with the same entries (a sort by row, stable, in place of one ``np.insert`` per block: a reduced model has
        thousands of pair edges)."""
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
        key = 2 * rows + (np.arange(rows.size) >= n_in)  # a row's own column after its pair columns
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


def build(problem: IntraProblem, *, min_memory: bool) -> ArrayModel | None:
    """The reduced model (see :func:`autopar_lab.solve.ilp.pulp_model.build`, which this mirrors term for term);
    None when the reductions already prove that no plan is allowed."""
    t0 = time.perf_counter()
    reduced = reductions(problem, min_memory=min_memory)
    if reduced is None:
        return None
    edges, rows, dom, scale = reduced
    limit = math.inf if min_memory else problem.mem_limit

    ncol = 0
    x: dict[int, np.ndarray] = {}
    lin: dict[int, np.ndarray] = {}
    out = _Rows()
    for v, d in enumerate(dom):
        if d.size > 1:
            x[v] = np.arange(ncol, ncol + d.size, dtype=np.int32)
            ncol += d.size
            lin[v] = np.zeros(d.size) if min_memory else problem.node_costs[v][d].astype(float)
            out.add(x[v], np.ones(d.size), 1.0, 1.0)

    e_cost: list[np.ndarray] = []
    e_list = []
    blocks = []
    for u, v, r in pair_edges(edges, dom, lin, min_memory=min_memory):
        du, dv = dom[u], dom[v]
        P, Q = np.nonzero(np.isfinite(r))  # row-major: the PuLP builder's variable order
        cols = np.arange(ncol, ncol + P.size, dtype=np.int32)
        ncol += P.size
        e_cost.append(r[P, Q] / scale)
        # Rows sum_q e[p, q] - x_u[p] = 0 (P is sorted: np.nonzero walks row-major), then
        # sum_p e[p, q] - x_v[q] = 0 for every q but the last (implied by the rows and the others).
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
                continue  # can never bind
            cols, vals, _ = row_terms(row, mscale)
            out.add(cols, vals, -math.inf, (limit - const) / mscale)
    start, index, value, row_lower, row_upper = out.csr()
    return ArrayModel(dom, x, e_list, cost, lower, upper, integer, start, index, value, row_lower, row_upper,
                      scale, time.perf_counter() - t0)


def _start_vector(model: ArrayModel, start: tuple[int, ...]) -> np.ndarray | None:
    """Column values of a plan; None if the plan lies outside the reduced domains."""
    pos = {}
    for v, d in enumerate(model.dom):
        hit = np.flatnonzero(d == start[v])
        if hit.size == 0:
            return None
        pos[v] = int(hit[0])
    col = np.zeros(model.num_col)
    for v, cols in model.x.items():
        col[cols[pos[v]]] = 1.0
    for u, v, P, Q, cols in model.e:
        col[cols[(P == pos[u]) & (Q == pos[v])]] = 1.0
    return col


_BANNER_DONE = False


def _new_highs():
    """A Highs object. The first one in a process prints HiGHS's banner straight to file descriptor 1, which would
    corrupt `--json` output on stdout, so that one is built with fd 1 pointed at /dev/null."""
    global _BANNER_DONE
    import highspy

    if _BANNER_DONE:
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
    _BANNER_DONE = True
    return h


def _highs(model: ArrayModel, *, msg: bool, time_limit, rel_gap: float, start_col, relax: bool = False):
    import highspy

    h = _new_highs()
    h.setOptionValue("output_flag", bool(msg))
    h.setOptionValue("mip_rel_gap", float(rel_gap))
    h.setOptionValue("mip_abs_gap", 0.0)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    lp = highspy.HighsLp()
    lp.num_col_ = model.num_col
    lp.num_row_ = model.num_row
    lp.col_cost_ = model.cost
    lp.col_lower_ = model.lower
    lp.col_upper_ = model.upper
    lp.row_lower_ = model.row_lower
    lp.row_upper_ = model.row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = model.num_col
    lp.a_matrix_.num_row_ = model.num_row
    lp.a_matrix_.start_ = model.start
    lp.a_matrix_.index_ = model.index
    lp.a_matrix_.value_ = model.value
    if not relax:
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in model.integer]
    h.passModel(lp)
    if start_col is not None:
        idx = np.arange(model.num_col, dtype=np.int32)
        h.setSolution(model.num_col, idx, start_col)
    h.run()
    return h


def _outcome(h, model: ArrayModel):
    """(status, absolute gap in model units or None, column values or None)."""
    import highspy

    ms = h.getModelStatus()
    info = h.getInfo()
    has_sol = int(info.primal_solution_status) == 2  # kSolutionStatusFeasible
    col = np.array(h.getSolution().col_value) if has_sol else None
    if ms == highspy.HighsModelStatus.kOptimal:
        return "optimal", 0.0, col
    if ms in (highspy.HighsModelStatus.kInfeasible,):
        return "infeasible", None, None
    if has_sol:
        bound = float(info.mip_dual_bound)
        if not math.isfinite(bound):
            bound = _trivial_bound(model)  # stopped before the root LP: every node and pair at its cheapest
        gap = float(info.objective_function_value) - bound
        return "time_limit", (gap if math.isfinite(gap) else None), col
    return "no_solution", None, None


def _trivial_bound(model: ArrayModel) -> float:
    """A lower bound on the model's objective without solving anything: exactly one binary per node and one
    pair column per edge are 1, so each contributes at least its cheapest column (valid for the cost objective;
    the memory objective has only the peak column, whose lower bound 0 this gives)."""
    groups = list(model.x.values()) + [cols for *_, cols in model.e]
    return float(sum(model.cost[c].min() for c in groups if c.size))


def _consistent(h, model: ArrayModel, col) -> bool:
    """Do the returned columns score what HiGHS says it found? (HiGHS 1.16 can hand back a MIP start's
    columns while reporting a better incumbent, seen when presolve fixes columns of the start.)"""
    reported = float(h.getInfo().objective_function_value)
    got = float(model.cost @ col)
    return not math.isfinite(reported) or abs(got - reported) <= 1e-7 * max(1.0, abs(reported))


def _choice(model: ArrayModel, col) -> tuple[int, ...]:
    out = []
    for v, d in enumerate(model.dom):
        if v in model.x:
            out.append(int(d[int(np.argmax(col[model.x[v]]))]))  # argmax: lowest index on ties
        else:
            out.append(int(d[0]))
    return tuple(out)


def solve(problem: IntraProblem, *, time_limit=None, warm_start=None, msg: bool = False,
          rel_gap: float = 1e-9, min_memory: bool = False) -> IntraSolution | None:
    """Solve with HiGHS in process; the contract of :func:`autopar_lab.solve.ilp.backends.solve` (None: infeasible)."""
    t0 = time.perf_counter()
    model = build(problem, min_memory=min_memory)
    if model is None:
        return None
    name = "highs"
    status: str | None
    if not model.x:
        status, absgap, name = "optimal", 0.0, "reduction"
        choice = tuple(int(d[0]) for d in model.dom)
    else:
        start = None
        if warm_start is not None:
            start = check_choice(problem, warm_start)
        elif time_limit is not None and not min_memory:
            start = greedy(problem, model.dom)  # an incumbent to return whatever the time limit
        start_col = _start_vector(model, start) if start is not None else None
        status = col = None
        if start_col is None and time_limit is None:
            # The LP relaxation first: on these models it is often integral already (always, on the planner's
            # meshes with one split axis), and then its optimum is the ILP's (a bound the plan reaches), found
            # about 4x faster than by the MIP solver's presolve, root and search. Otherwise the MIP runs as usual.
            h = _highs(model, msg=msg, time_limit=None, rel_gap=rel_gap, start_col=None, relax=True)
            lp_status, _, lp_col = _outcome(h, model)
            if lp_status == "infeasible":
                return None
            if lp_status == "optimal" and lp_col is not None:
                xs = lp_col[model.integer]
                if np.all(np.abs(xs - np.round(xs)) <= _INTEGRAL_TOL):
                    status, absgap, col = "optimal", 0.0, lp_col
        if status is None:
            h = _highs(model, msg=msg, time_limit=time_limit, rel_gap=rel_gap, start_col=start_col)
            status, absgap, col = _outcome(h, model)
        if start_col is not None and col is not None and not _consistent(h, model, col):
            h = _highs(model, msg=msg, time_limit=time_limit, rel_gap=rel_gap, start_col=None)
            status, absgap, col = _outcome(h, model)
        if status == "infeasible":
            return None
        if status == "no_solution":
            if start_col is None:
                raise TimeoutError(f"the highs solver found no plan within its time limit ({time_limit} s); "
                                   "raise time_limit or pass a warm_start")
            assert start is not None  # start_col came from it
            status, absgap, choice = "time_limit", None, start
        else:
            choice = _choice(model, col)
            if start is not None and start_col is not None and status == "time_limit":
                if evaluate(problem, start).objective < evaluate(problem, choice).objective:
                    choice = start
    ev = evaluate(problem, choice)
    gap = relative_gap(ev, status, absgap, model.scale, min_memory)
    return IntraSolution(choice, *ev, status, gap, time.perf_counter() - t0, model.num_col, model.num_row,
                             name, model.build_s)
