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
        self.add_block(cols, np.asarray(vals, dtype=float), np.array([cols.size], dtype=np.int64),
                       np.array([lo], dtype=float), np.array([hi], dtype=float))

    def add_block(self, idx, val, lengths, lo, hi):
        self.idx.append(idx)
        self.val.append(val)
        self.len.append(lengths)
        self.lo.append(lo)
        self.hi.append(hi)

    def csr(self):
        lengths = np.concatenate(self.len) if self.len else np.zeros(0, dtype=np.int64)
        start = np.zeros(lengths.size + 1, dtype=np.int32)
        np.cumsum(lengths, out=start[1:])
        index = np.concatenate(self.idx) if self.idx else np.zeros(0, dtype=np.int32)
        value = np.concatenate(self.val) if self.val else np.zeros(0)
        lo = np.concatenate(self.lo) if self.lo else np.zeros(0)
        hi = np.concatenate(self.hi) if self.hi else np.zeros(0)
        return start, index, value, lo, hi


class _Pattern:
    """The pair columns and linking rows of every pair edge whose matrix has one shape and one set of finite
    entries: ``P``/``Q`` the pair columns' domain indices (row-major, as ``np.nonzero``), and the edge's rows as a
    template: entry ``k`` is column ``at[k]`` past the edge's first pair column (``side`` 0), past ``x_u[0]`` (1) or
    past ``x_v[0]`` (2). An edge's rows are then a few array operations shared by all the edges of its pattern,
    in place of a dozen numpy calls per edge (a DeepSeek-V3 mesh's model has ~700-1,300 pair edges in ~20
    patterns)."""

    __slots__ = ("P", "Q", "at", "side", "value", "lengths")

    def __init__(self, finite: np.ndarray):
        du, dv = finite.shape
        P, Q = np.nonzero(finite)
        P.setflags(write=False)  # shared by the edges of the pattern in ArrayModel.e
        Q.setflags(write=False)
        # Rows sum_q e[p, q] - x_u[p] = 0 for every p (P is sorted), then sum_p e[p, q] - x_v[q] = 0 for every q
        # but the last (implied by the rows and the others); pair columns in column order, the node's column last.
        size_u = np.bincount(P, minlength=du)
        at_u = np.insert(np.arange(P.size), np.cumsum(size_u), np.arange(du))
        side_u = np.insert(np.zeros(P.size, dtype=np.int64), np.cumsum(size_u), 1)
        by_q = np.argsort(Q, kind="stable")
        by_q = by_q[Q[by_q] < dv - 1]
        size_v = np.bincount(Q[by_q], minlength=dv - 1)
        at_v = np.insert(by_q, np.cumsum(size_v), np.arange(dv - 1))
        side_v = np.insert(np.zeros(by_q.size, dtype=np.int64), np.cumsum(size_v), 2)
        self.P, self.Q = P, Q
        self.at = np.concatenate([at_u, at_v])
        self.side = np.concatenate([side_u, side_v])
        self.value = np.where(self.side == 0, 1.0, -1.0)
        self.lengths = np.concatenate([size_u, size_v]).astype(np.int64) + 1


def _pair_rows(pats: list[_Pattern], pid: np.ndarray, first: np.ndarray):
    """The linking rows of the pair edges in order, edge ``i`` of pattern ``pats[pid[i]]`` with its first pair
    column, ``x_u[0]`` and ``x_v[0]`` in ``first[i]``: (column indices, values, row lengths)."""
    n_ent = np.array([p.at.size for p in pats], dtype=np.int64)[pid]
    n_row = np.array([p.lengths.size for p in pats], dtype=np.int64)[pid]
    ent_off = np.cumsum(n_ent) - n_ent
    row_off = np.cumsum(n_row) - n_row
    index = np.empty(int(n_ent.sum()), dtype=np.int32)
    value = np.empty(index.size)
    lengths = np.empty(int(n_row.sum()), dtype=np.int64)
    for k, pat in enumerate(pats):
        es = np.flatnonzero(pid == k)
        pos = ent_off[es, None] + np.arange(pat.at.size)
        index[pos] = first[es][:, pat.side] + pat.at
        value[pos] = pat.value
        lengths[row_off[es, None] + np.arange(pat.lengths.size)] = pat.lengths
    return index, value, lengths


def build(problem: IntraProblem, *, min_memory: bool) -> ArrayModel | None:
    """The reduced model (see :func:`autopar_lab.solve.ilp.pulp_model.build`, which this mirrors term for term);
    None when the reductions already prove that no plan is allowed."""
    t0 = time.perf_counter()
    reduced = reductions(problem, min_memory=min_memory)
    if reduced is None:
        return None
    edges, rows, dom, scale = reduced
    limit = math.inf if min_memory else problem.mem_limit

    # Columns: each undecided node's binaries (node order), then each pair edge's pair columns (edge order).
    multi = [v for v, d in enumerate(dom) if d.size > 1]
    size = np.array([dom[v].size for v in multi], dtype=np.int64)
    nx = int(size.sum())
    x0 = np.full(len(dom), -1, dtype=np.int64)  # each node's first column
    x0[multi] = np.cumsum(size) - size
    lin: dict[int, np.ndarray] = {
        v: np.zeros(dom[v].size) if min_memory else problem.node_costs[v][dom[v]].astype(float) for v in multi}

    pats: list[_Pattern] = []
    pat_of: dict[tuple, int] = {}
    seen: dict[int, tuple] = {}  # per matrix object (identical layers' edges share theirs): its pattern, its costs
    us, vs, pids, e_cost = [], [], [], []
    for u, v, r in pair_edges(edges, dom, lin, min_memory=min_memory):
        hit = seen.get(id(r))
        if hit is None or hit[0] is not r:
            finite = np.isfinite(r)
            key = (r.shape, finite.tobytes())
            k = pat_of.get(key)
            if k is None:
                k = pat_of[key] = len(pats)
                pats.append(_Pattern(finite))
            hit = seen[id(r)] = (r, k, r[pats[k].P, pats[k].Q])
        us.append(u)
        vs.append(v)
        pids.append(hit[1])
        e_cost.append(hit[2])
    pid = np.array(pids, dtype=np.int64)
    n_pair = np.array([p.P.size for p in pats], dtype=np.int64)[pid]
    ncol = nx + int(n_pair.sum())
    first = np.stack([nx + np.cumsum(n_pair) - n_pair, x0[us], x0[vs]], axis=1) if pids else np.zeros((0, 3), int)
    allcol = np.arange(ncol, dtype=np.int32)
    x = {v: allcol[s:s + n] for v, s, n in zip(multi, x0[multi].tolist(), size.tolist())}
    e_list = [(u, v, pats[k].P, pats[k].Q, allcol[s:s + n])
              for u, v, k, s, n in zip(us, vs, pids, first[:, 0].tolist(), n_pair.tolist())]

    out = _Rows()
    out.add_block(allcol[:nx], np.ones(nx), size, np.ones(size.size), np.ones(size.size))  # one-hot rows
    index, value, lengths = _pair_rows(pats, pid, first)
    out.add_block(index, value, lengths, np.zeros(lengths.size), np.zeros(lengths.size))

    cost = np.zeros(ncol + (1 if min_memory else 0))
    if lin:
        cost[:nx] = np.concatenate(list(lin.values())) / scale
    if e_cost:
        cost[nx:ncol] = np.concatenate(e_cost) / scale
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
