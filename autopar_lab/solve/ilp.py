"""Alpa's intra-operator pass as a generic ILP over "nodes with strategies" (OSDI'22 §4).

The problem is graph-agnostic: a node is anything with a finite list of strategies, each
with a cost (compute plus the collectives the node runs itself) and, optionally, the bytes
per device its output takes. An edge ``(u, v)`` says that ``v`` reads ``u``'s output and
carries a ``|S_u| x |S_v|`` matrix of resharding costs; ``np.inf`` marks a pair that is not
allowed (likewise an ``inf`` node cost forbids that strategy). The ILP picks one strategy per
node (one-hot ``s_v``) and one pair per edge (one-hot ``e_uv``, linked to ``s_u`` and
``s_v`` by Alpa's row/column constraints) to minimise

    sum_v s_v . c_v  +  sum_(u,v) e_uv . R_uv

subject to, for every program point ``t``, ``sum_(v live at t) s_v . mem_v <= mem_limit``.

Nothing here knows about operators, meshes or JAX; the sharding code turns an operator
graph into an :class:`IntraProblem` and reads :attr:`IntraSolution.choice` back.

Reductions done before the solver sees the model (each keeps the optimum exact):

* pinned nodes, nodes with a single strategy, and strategies that cannot be part of any
  plan (``inf`` costs, ``inf`` edge pairs with no partner left, memory rows that cannot be
  met) are removed, repeatedly, until nothing changes (arc consistency);
* an edge whose one side has a single strategy left becomes a linear term on the other
  side's ``s``; an edge whose finite matrix is additive (``R[p,q] = a[p] + b[q]``; all-zero
  matrices included) becomes two linear terms; only the remaining edges get ``e``
  variables;
* ``e`` variables are continuous in ``[0, 1]``: with ``s_u`` and ``s_v`` binary the linking
  constraints leave exactly one ``e`` at 1, so the branch-and-bound only branches on
  ``s``; one column constraint per edge is implied by the others and dropped;
* memory rows that can never bind, repeat, or are dominated by another row are dropped.

Alpa's follower merging (:func:`merge_followers`) is exposed separately, because it is a
heuristic: a merged follower takes, for each strategy of the node it follows, its locally
best strategy, which ignores what the follower's own consumers want. Measured with this
module on 400 random problems (3-7 nodes, 1-4 strategies, random DAGs with 1-2 inputs
per node, half of the nodes marked mergeable, integer costs 0-19; resharding matrices
either unstructured or "zero when the specs match, positive otherwise"; optimum by brute
force on both sides): of the 295 instances where something merged, merging lost
optimality on 61 (21%), by 10% of the optimum on average when it lost (median 7%, worst
62%); unstructured 21% / mean 8%, spec-like 21% / mean 12%. This is the "merging over-constrains the ILP" issue
Alpa's users reported, hence merges are recorded (:class:`MergeRecord`) and can be undone
by marking a node not mergeable.

Example: two nodes, each either replicated (strategy 0, costly) or split (strategy 1, cheap
but it must be resharded when the consumer is replicated):

>>> p = IntraProblem(node_costs=(np.array([4.0, 1.0]), np.array([4.0, 1.0])),
...                  edges=((0, 1),), edge_costs=(np.array([[0.0, 0.0], [5.0, 0.0]]),))
>>> s = solve_ilp(p)
>>> s.choice, s.objective, s.status
((1, 1), 2.0, 'optimal')
>>> brute_force(p).objective
2.0
"""

from __future__ import annotations

import heapq
import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import pulp

__all__ = [
    "IntraProblem",
    "IntraSolution",
    "Evaluation",
    "InfeasibleError",
    "MergeRecord",
    "solve_ilp",
    "solve_min_memory",
    "evaluate",
    "brute_force",
    "merge_followers",
    "expand",
    "BRUTE_FORCE_LIMIT",
]

#: brute_force refuses problems whose strategy-count product exceeds this.
BRUTE_FORCE_LIMIT = 2_000_000

# Relative slack used when a memory sum is compared with the limit, so that a plan whose
# peak equals the limit up to float rounding counts as fitting.
_MEM_RTOL = 1e-9


# --------------------------------------------------------------------------------------
# Problem and solution values
# --------------------------------------------------------------------------------------


def _frozen_vec(x, what: str) -> np.ndarray:
    a = np.array(x, dtype=float).reshape(-1)
    if a.size == 0:
        raise ValueError(f"{what} is empty: every node needs at least one strategy")
    if np.isnan(a).any() or np.isneginf(a).any():
        raise ValueError(f"{what} contains NaN or -inf")
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class IntraProblem:
    """One intra-operator ILP instance.

    Attributes:
        node_costs: per node, the cost (seconds) of each strategy; ``inf`` forbids it.
        edges: ``(u, v)`` pairs, ``v`` reads ``u``'s output.
        edge_costs: per edge, a ``|S_u| x |S_v|`` matrix of resharding seconds; ``inf``
            forbids that pair.
        node_mem: per node, bytes per device its output(s) take under each strategy.
        live: per program point, the nodes whose outputs are live there. When
            ``node_mem`` is given and ``live`` is None, all nodes are live at one point.
        mem_limit: bytes per device; a plan fits when its peak over the points is <= it.
        pins: node -> the only strategy allowed.
        names: node names, for messages.
        mem_terms: per program point, extra ``(node, bytes per strategy of node)`` terms.
            :func:`merge_followers` uses them so that a merged follower's memory still
            counts exactly at the points where the follower (not its leader) is live.

    Arrays are copied and made read-only; ``pins`` becomes a read-only mapping.

    >>> p = IntraProblem(node_costs=([1.0, 2.0],), pins={0: 1})
    >>> p.num_nodes, p.num_strategies, dict(p.pins)
    (1, (2,), {0: 1})
    """

    node_costs: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int], ...] = ()
    edge_costs: tuple[np.ndarray, ...] = ()
    node_mem: tuple[np.ndarray, ...] | None = None
    live: tuple[tuple[int, ...], ...] | None = None
    mem_limit: float = math.inf
    pins: Mapping[int, int] = field(default_factory=dict)
    names: tuple[str, ...] | None = None
    mem_terms: tuple[tuple[tuple[int, np.ndarray], ...], ...] | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        costs = tuple(_frozen_vec(c, f"node_costs[{i}]") for i, c in enumerate(self.node_costs))
        n = len(costs)
        set_("node_costs", costs)
        sizes = [c.size for c in costs]

        edges = tuple((int(u), int(v)) for u, v in self.edges)
        if len(self.edge_costs) != len(edges):
            raise ValueError(f"{len(edges)} edges but {len(self.edge_costs)} edge cost matrices")
        ecosts = []
        for k, ((u, v), m) in enumerate(zip(edges, self.edge_costs)):
            if not (0 <= u < n and 0 <= v < n):
                raise ValueError(f"edge {k} = ({u}, {v}) names a node outside 0..{n - 1}")
            if u == v:
                raise ValueError(f"edge {k} = ({u}, {v}) is a self loop")
            a = np.array(m, dtype=float)
            if a.shape != (sizes[u], sizes[v]):
                raise ValueError(
                    f"edge {k} = ({u}, {v}): cost matrix has shape {a.shape}, "
                    f"expected {(sizes[u], sizes[v])} (strategies of u x strategies of v)"
                )
            if np.isnan(a).any() or np.isneginf(a).any():
                raise ValueError(f"edge {k} = ({u}, {v}): cost matrix contains NaN or -inf")
            a.setflags(write=False)
            ecosts.append(a)
        set_("edges", edges)
        set_("edge_costs", tuple(ecosts))

        if self.node_mem is not None:
            if len(self.node_mem) != n:
                raise ValueError(f"node_mem has {len(self.node_mem)} entries for {n} nodes")
            mem = []
            for i, m in enumerate(self.node_mem):
                a = _frozen_vec(m, f"node_mem[{i}]")
                if a.size != sizes[i] or not np.isfinite(a).all() or (a < 0).any():
                    raise ValueError(
                        f"node_mem[{i}] must hold {sizes[i]} finite, non-negative byte counts"
                    )
                mem.append(a)
            set_("node_mem", tuple(mem))
            live = self.live if self.live is not None else (tuple(range(n)),)
            lv = []
            for t, pt in enumerate(live):
                pt = tuple(dict.fromkeys(int(v) for v in pt))  # a set, in first-seen order
                if any(not 0 <= v < n for v in pt):
                    raise ValueError(f"live[{t}] names a node outside 0..{n - 1}")
                lv.append(pt)
            set_("live", tuple(lv))
        elif self.live is not None or self.mem_terms is not None:
            raise ValueError("live / mem_terms need node_mem (bytes per strategy of each node)")

        if self.mem_terms is not None:
            if len(self.mem_terms) != len(self.live):
                raise ValueError(f"mem_terms has {len(self.mem_terms)} points, live has {len(self.live)}")
            terms = []
            for t, pt in enumerate(self.mem_terms):
                row = []
                for v, vec in pt:
                    v = int(v)
                    if not 0 <= v < n:
                        raise ValueError(f"mem_terms[{t}] names a node outside 0..{n - 1}")
                    a = _frozen_vec(vec, f"mem_terms[{t}]")
                    if a.size != sizes[v] or not np.isfinite(a).all() or (a < 0).any():
                        raise ValueError(f"mem_terms[{t}]: node {v} needs {sizes[v]} finite bytes >= 0")
                    row.append((v, a))
                terms.append(tuple(row))
            set_("mem_terms", tuple(terms))

        limit = float(self.mem_limit)
        if math.isnan(limit) or limit < 0:
            raise ValueError(f"mem_limit must be >= 0, got {self.mem_limit}")
        if math.isfinite(limit) and self.node_mem is None:
            raise ValueError("a finite mem_limit needs node_mem")
        set_("mem_limit", limit)

        pins = {}
        for v, q in dict(self.pins).items():
            v, q = int(v), int(q)
            if not 0 <= v < n:
                raise ValueError(f"pin on node {v}, which is outside 0..{n - 1}")
            if not 0 <= q < sizes[v]:
                raise ValueError(f"pin {self._name_of(v)} -> {q}: it has {sizes[v]} strategies")
            pins[v] = q
        set_("pins", MappingProxyType(dict(sorted(pins.items()))))

        if self.names is not None:
            names = tuple(str(s) for s in self.names)
            if len(names) != n:
                raise ValueError(f"{len(names)} names for {n} nodes")
            set_("names", names)

    def _name_of(self, v: int) -> str:
        return self.names[v] if self.names is not None and len(self.names) > v else f"node {v}"

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @property
    def num_strategies(self) -> tuple[int, ...]:
        return tuple(c.size for c in self.node_costs)

    def mem_rows(self) -> list[list[tuple[int, np.ndarray]]]:
        """Per program point, the ``(node, bytes per strategy)`` terms summed there."""
        if self.node_mem is None:
            return []
        rows = [[(v, self.node_mem[v]) for v in pt] for pt in self.live]
        if self.mem_terms is not None:
            for row, extra in zip(rows, self.mem_terms):
                row.extend(extra)
        return rows


@dataclass(frozen=True)
class IntraSolution:
    """The result of :func:`solve_ilp` (or :func:`brute_force`, :func:`solve_min_memory`).

    ``objective = node_cost + edge_cost`` is recomputed by :func:`evaluate` from ``choice``,
    not read back from the solver. ``gap`` is the relative optimality gap (0 when optimal,
    None when the solver did not report a bound). ``solve_s`` is the wall time of the whole
    call (model build included; ``build_s`` is the build part).
    """

    choice: tuple[int, ...]
    objective: float
    node_cost: float
    edge_cost: float
    peak_mem: float
    status: str
    gap: float | None
    solve_s: float
    num_vars: int
    num_constraints: int
    solver: str
    build_s: float = 0.0


class Evaluation(NamedTuple):
    objective: float
    node_cost: float
    edge_cost: float
    peak_mem: float


class InfeasibleError(ValueError):
    """No plan satisfies the constraints.

    Attributes: ``min_peak_mem`` (the smallest peak memory any allowed plan needs, or None
    when no plan is allowed at all, whatever the memory), ``exact`` (False when that figure
    is only an upper bound because its own solve hit the time limit), ``mem_limit``, and
    ``choice`` (a plan reaching ``min_peak_mem``).
    """

    def __init__(self, message: str, *, min_peak_mem: float | None = None, mem_limit: float = math.inf,
                 choice: tuple[int, ...] | None = None, exact: bool = True):
        super().__init__(message)
        self.min_peak_mem = min_peak_mem
        self.mem_limit = mem_limit
        self.choice = choice
        self.exact = exact


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit} ({b:.6g} bytes)"
    return f"{b:.6g} bytes"


def _memory_error(problem: IntraProblem, best: IntraSolution, exact: bool) -> InfeasibleError:
    need, limit = best.peak_mem, problem.mem_limit
    at_least = "" if exact else "at most "
    msg = (
        f"No sharding plan fits in {_fmt_bytes(limit)} per device: the smallest peak memory any "
        f"allowed plan needs is {at_least}{_fmt_bytes(need)}"
        f"{f', {need / limit:.2f}x the limit' if limit > 0 else ''}. "
        "Use devices with more memory, more devices (a larger mesh), rematerialisation, "
        "or more pipeline stages, or drop pins that force large shardings."
    )
    return InfeasibleError(msg, min_peak_mem=need, mem_limit=limit, choice=best.choice, exact=exact)


def _structural_error(problem: IntraProblem) -> InfeasibleError:
    return InfeasibleError(
        "No sharding plan is allowed at all, whatever the memory: the pins, the forbidden "
        "(inf) strategies and the forbidden (inf) resharding pairs exclude every combination. "
        "Drop or change a pin, or allow more resharding pairs.",
        mem_limit=problem.mem_limit,
    )


# --------------------------------------------------------------------------------------
# Evaluation and brute force (the references the ILP is tested against)
# --------------------------------------------------------------------------------------


def _check_choice(problem: IntraProblem, choice: Sequence[int]) -> tuple[int, ...]:
    choice = tuple(int(q) for q in choice)
    if len(choice) != problem.num_nodes:
        raise ValueError(f"choice has {len(choice)} entries for {problem.num_nodes} nodes")
    for v, (q, k) in enumerate(zip(choice, problem.num_strategies)):
        if not 0 <= q < k:
            raise ValueError(f"choice for {problem._name_of(v)} is {q}; it has {k} strategies")
    return choice


def evaluate(problem: IntraProblem, choice: Sequence[int]) -> Evaluation:
    """Cost and peak memory of one plan, computed directly (no ILP).

    Pins and the memory limit are not checked: a forbidden pair or strategy makes the
    objective ``inf``; ``peak_mem`` is reported whether or not it fits.

    >>> p = IntraProblem(node_costs=([1.0, 2.0], [3.0]), edges=((0, 1),),
    ...                  edge_costs=([[0.5], [0.0]],), node_mem=([8.0, 4.0], [2.0]))
    >>> evaluate(p, (0, 0))
    Evaluation(objective=4.5, node_cost=4.0, edge_cost=0.5, peak_mem=10.0)
    """
    choice = _check_choice(problem, choice)
    node = math.fsum(float(c[q]) for c, q in zip(problem.node_costs, choice))
    edge = math.fsum(float(m[choice[u], choice[v]]) for (u, v), m in zip(problem.edges, problem.edge_costs))
    if math.isinf(node) or math.isinf(edge):
        node, edge = (math.inf if math.isinf(node) else node), (math.inf if math.isinf(edge) else edge)
    peak = max((math.fsum(float(vec[choice[v]]) for v, vec in row) for row in problem.mem_rows()), default=0.0)
    return Evaluation(node + edge, node, edge, peak)


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
        ok = allowed & (peak <= problem.mem_limit * (1 + _MEM_RTOL))
        if ok.any():
            i = int(np.argmin(np.where(ok, obj, np.inf)))
            if obj[i] < best_obj:
                best_obj, best_idx = float(obj[i]), int(idx[i])

    def plan(i):
        cols = np.unravel_index(i, sizes) if n else ()
        return tuple(int(domains[v][cols[v]]) for v in range(n))

    if best_idx is None:
        if minpeak_idx is None:
            raise _structural_error(problem)
        choice = plan(minpeak_idx)
        ev = evaluate(problem, choice)
        sol = IntraSolution(choice, *ev, "optimal", 0.0, time.perf_counter() - t0, 0, 0, "brute_force")
        raise _memory_error(problem, sol, exact=True)
    choice = plan(best_idx)
    return IntraSolution(choice, *evaluate(problem, choice), "optimal", 0.0,
                         time.perf_counter() - t0, 0, 0, "brute_force")


# --------------------------------------------------------------------------------------
# Model reduction
# --------------------------------------------------------------------------------------


def _combined_edges(problem: IntraProblem) -> dict[tuple[int, int], np.ndarray]:
    """Sum parallel edges (either direction) into one matrix per node pair (u < v)."""
    out: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), m in zip(problem.edges, problem.edge_costs):
        if u > v:
            u, v, m = v, u, m.T
        if (u, v) in out:
            out[(u, v)] = out[(u, v)] + m  # inf + x stays inf: a forbidden pair stays forbidden
        else:
            out[(u, v)] = np.array(m)
    return out


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
    finite = {k: np.isfinite(m) for k, m in edges.items()}
    tol_limit = limit * (1 + _MEM_RTOL)
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


def _is_additive(r: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """If every entry is finite and r[p, q] = a[p] + b[q], return (a, b)."""
    if not np.isfinite(r).all():
        return None
    a = r[:, 0] - r[0, 0]
    b = r[0, :]
    scale = max(float(np.abs(r).max()), 1e-300)
    if np.all(np.abs(r - (a[:, None] + b[None, :])) <= 1e-12 * scale):
        return a, b
    return None


def _new_var(prob: pulp.LpProblem, name: str, lb, ub, cat) -> pulp.LpVariable:
    # PuLP >= 3.3 wants variables made through the problem (LpVariable() warns there).
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lb, ub, cat=cat)
    return pulp.LpVariable(name, lb, ub, cat)  # pragma: no cover - PuLP < 3.3


@dataclass
class _Model:
    prob: pulp.LpProblem
    dom: list[np.ndarray]
    x: dict[int, list]                  # node -> binary vars aligned with dom[node]
    e: list[tuple[int, int, list]]      # (u, v, [(p_idx, q_idx, var)]) in domain indices
    scale: float                        # objective divided by this before solving
    build_s: float


def _reductions(problem: IntraProblem, *, min_memory: bool):
    """What both model builders start from: (combined edges, aggregated memory rows, each node's allowed
    strategies, objective scale), or None when the reductions already prove infeasibility."""
    edges = _combined_edges(problem)
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
    for (u, v), m in edges.items():
        r = m[np.ix_(dom[u], dom[v])]
        if np.isfinite(r).any():
            finite_costs.append(float(np.abs(r[np.isfinite(r)]).max()))
    return edges, rows, dom, max(max(finite_costs, default=1.0), 1e-300)


def _build(problem: IntraProblem, *, min_memory: bool) -> _Model | None:
    """Build the reduced PuLP model; None when the reductions already prove infeasibility."""
    t0 = time.perf_counter()
    reduced = _reductions(problem, min_memory=min_memory)
    if reduced is None:
        return None
    edges, rows, dom, scale = reduced
    limit = math.inf if min_memory else problem.mem_limit

    prob = pulp.LpProblem("intra_min_memory" if min_memory else "intra", pulp.LpMinimize)
    x: dict[int, list] = {}
    lin: dict[int, np.ndarray] = {}
    for v, d in enumerate(dom):
        if d.size > 1:
            x[v] = [_new_var(prob, f"s{v}_{q}", 0, 1, pulp.LpBinary) for q in d]
            lin[v] = np.zeros(d.size) if min_memory else problem.node_costs[v][d].astype(float)
            prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression((xv, 1.0) for xv in x[v]),
                                                 pulp.LpConstraintEQ, rhs=1.0))

    obj_terms: list[tuple] = []
    e_list = []
    for (u, v), m in edges.items():
        du, dv = dom[u], dom[v]
        if du.size == 1 and dv.size == 1:
            continue  # a constant: evaluate() adds it back
        r = m[np.ix_(du, dv)]
        if min_memory:
            if np.isfinite(r).all():
                continue  # only the forbidden pairs matter when minimising memory
            r = np.where(np.isfinite(r), 0.0, np.inf)
        if du.size == 1:
            lin[v] += r[0]  # finite: arc consistency removed partners of inf pairs
            continue
        if dv.size == 1:
            lin[u] += r[:, 0]
            continue
        ab = _is_additive(r)
        if ab is not None:
            lin[u] += ab[0]
            lin[v] += ab[1]
            continue
        # Alpa's e_uv, continuous (see module docstring), only on allowed pairs.
        cells = []
        rowsum: list[list] = [[] for _ in range(du.size)]
        colsum: list[list] = [[] for _ in range(dv.size)]
        for p, q in zip(*np.nonzero(np.isfinite(r))):
            var = _new_var(prob, f"e{u}_{v}_{du[p]}_{dv[q]}", 0.0, 1.0, pulp.LpContinuous)
            cells.append((int(p), int(q), var))
            rowsum[p].append((var, 1.0))
            colsum[q].append((var, 1.0))
            if r[p, q] != 0.0:
                obj_terms.append((var, float(r[p, q]) / scale))
        for p in range(du.size):
            prob.addConstraint(pulp.LpConstraint(
                pulp.LpAffineExpression(rowsum[p] + [(x[u][p], -1.0)]), pulp.LpConstraintEQ, rhs=0.0))
        for q in range(dv.size - 1):  # the last column is implied by the rows and the others
            prob.addConstraint(pulp.LpConstraint(
                pulp.LpAffineExpression(colsum[q] + [(x[v][q], -1.0)]), pulp.LpConstraintEQ, rhs=0.0))
        e_list.append((u, v, cells))

    for v, c in lin.items():
        for xv, coef in zip(x[v], c):
            if coef != 0.0:
                obj_terms.append((xv, float(coef) / scale))

    if min_memory:
        mscale = max((float(vec.max()) for row in rows for vec in row.values()), default=1.0) or 1.0
        peak = _new_var(prob, "peak", 0.0, None, pulp.LpContinuous)
        for row in rows:
            const = sum(float(vec[dom[v][0]]) for v, vec in row.items() if dom[v].size == 1)
            terms = [(xv, float(b) / mscale) for v, vec in row.items() if v in x
                     for xv, b in zip(x[v], vec[dom[v]]) if b != 0.0]
            if terms:
                prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms + [(peak, -1.0)]),
                                                     pulp.LpConstraintLE, rhs=-const / mscale))
        prob.setObjective(pulp.LpAffineExpression([(peak, 1.0)]))
    else:
        if math.isfinite(limit):
            for row in rows:
                const = sum(float(vec[dom[v][0]]) for v, vec in row.items() if dom[v].size == 1)
                worst = const + sum(float(vec[dom[v]].max()) for v, vec in row.items() if v in x)
                if worst <= limit:
                    continue  # can never bind
                mscale = max(limit, 1.0)
                terms = [(xv, float(b) / mscale) for v, vec in row.items() if v in x
                         for xv, b in zip(x[v], vec[dom[v]]) if b != 0.0]
                prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE,
                                                     rhs=(limit - const) / mscale))
        prob.setObjective(pulp.LpAffineExpression(obj_terms))
    return _Model(prob, dom, x, e_list, scale, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------
# Solving
# --------------------------------------------------------------------------------------


class _HiGHSWarm(pulp.HiGHS):
    """PuLP's highspy-API HiGHS with a MIP start.

    PuLP (3.3) offers ``warmStart`` only for its command-line solvers; the API solver
    ignores initial values. This hands the variables' initial values to
    ``Highs.setSolution`` just before the run, which HiGHS uses as its first incumbent.
    HiGHS 1.16 sometimes returns the start's columns although it found (and reports) a
    better plan; ``_run`` checks for that and re-solves without the start.
    """

    def __init__(self, *args, start: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._start = start

    def callSolver(self, lp):
        if self._start:
            vs = lp.variables()
            idx = np.array([v.index for v in vs], dtype=np.int32)
            val = np.array([0.0 if v.varValue is None else float(v.varValue) for v in vs])
            lp.solverModel.setSolution(len(idx), idx, val)
        super().callSolver(lp)


def _highs_consistent(prob: pulp.LpProblem) -> bool:
    """Does the objective of the returned columns match what HiGHS says it found?"""
    try:
        reported = float(prob.solverModel.getInfo().objective_function_value)
    except Exception:  # pragma: no cover
        return True
    got = sum(c * (v.varValue or 0.0) for v, c in prob.objective.items())
    return not math.isfinite(reported) or abs(got - reported) <= 1e-7 * max(1.0, abs(reported))


_CBC_OBJ = re.compile(r"^Objective value:\s*(\S+)", re.M)
_CBC_BOUND = re.compile(r"^Lower bound:\s*(\S+)", re.M)


def _run(model: _Model, solver: str, time_limit, warm: bool, msg: bool, rel_gap: float):
    """Solve; return (status, absolute gap in model units or None)."""
    prob = model.prob
    if solver == "cbc":
        with tempfile.TemporaryDirectory(prefix="autopar_ilp_") as d:
            log = os.path.join(d, "cbc.log")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # PULP_CBC_CMD's deprecation notice
                cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, warmStart=warm, gapRel=rel_gap,
                                        logPath=log)
            prob.solve(cmd)
            text = open(log).read() if os.path.exists(log) else ""
        if msg:
            print(text)
        # PuLP reads CBC's solution file but not its bound; the log has both figures.
        mo, mb = _CBC_OBJ.search(text), _CBC_BOUND.search(text)
        absgap = float(mo.group(1)) - float(mb.group(1)) if mo and mb else None
    elif solver == "highs-pulp":
        cmd = _HiGHSWarm(msg=msg, timeLimit=time_limit, gapRel=rel_gap, gapAbs=0.0, start=warm)
        prob.solve(cmd)
        if warm and not _highs_consistent(prob):
            # HiGHS 1.16 can hand back the MIP start's columns while reporting a better
            # incumbent (seen when presolve fixes columns of the start). Solve again, cold.
            cmd = _HiGHSWarm(msg=msg, timeLimit=time_limit, gapRel=rel_gap, gapAbs=0.0, start=False)
            prob.solve(cmd)
        try:
            info = prob.solverModel.getInfo()
            absgap = float(info.objective_function_value) - float(info.mip_dual_bound)
            if not math.isfinite(absgap):
                absgap = None
        except Exception:  # pragma: no cover - older highspy
            absgap = None
    else:
        raise ValueError(f"solver must be one of {SOLVER_NAMES}, got {solver!r}")
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal", 0.0
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "time_limit", absgap
    if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible", None
    return "no_solution", None


def _read_choice(model: _Model) -> tuple[int, ...]:
    choice = []
    for v, d in enumerate(model.dom):
        if v in model.x:
            vals = [xv.varValue or 0.0 for xv in model.x[v]]
            choice.append(int(d[int(np.argmax(vals))]))  # argmax: lowest index on ties
        else:
            choice.append(int(d[0]))
    return tuple(choice)


def _set_start(model: _Model, start: tuple[int, ...]) -> bool:
    """Give every variable its value under ``start``; False if start is outside the model."""
    pos = {}
    for v, d in enumerate(model.dom):
        hit = np.flatnonzero(d == start[v])
        if hit.size == 0:
            return False
        pos[v] = int(hit[0])
    for v, xs in model.x.items():
        for i, xv in enumerate(xs):
            xv.setInitialValue(1.0 if i == pos[v] else 0.0)
    for u, v, cells in model.e:
        for p, q, var in cells:
            var.setInitialValue(1.0 if (p, q) == (pos[u], pos[v]) else 0.0)
    return True


def _greedy(problem: IntraProblem, model: _Model) -> tuple[int, ...] | None:
    """A quick allowed plan: nodes in index order, each taking its cheapest strategy given
    the neighbours already placed. None if it dead-ends or breaks the memory limit."""
    n = problem.num_nodes
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (u, v), m in _combined_edges(problem).items():
        nbrs[v].append((u, m.T))  # indexed [v strategy, u strategy]
        nbrs[u].append((v, m))
    choice: list[int | None] = [None] * n
    for v in range(n):
        d = model.dom[v]
        cost = problem.node_costs[v][d].astype(float)
        for w, m in nbrs[v]:
            if choice[w] is not None:
                cost = cost + m[d, choice[w]]
        i = int(np.argmin(cost))
        if not np.isfinite(cost[i]):
            return None
        choice[v] = int(d[i])
    plan = tuple(choice)
    ev = evaluate(problem, plan)
    if not np.isfinite(ev.objective) or ev.peak_mem > problem.mem_limit * (1 + _MEM_RTOL):
        return None
    return plan


SOLVER_NAMES = ("cbc", "highs", "highs-pulp")
#: The solver the planner, resolve and the workbench use unless told otherwise (HiGHS in process: the fast path).
DEFAULT_SOLVER = "highs"


def _solve(problem, *, solver, time_limit, warm_start, msg, rel_gap, min_memory) -> IntraSolution | None:
    if solver not in SOLVER_NAMES:
        raise ValueError(f"solver must be 'cbc' or 'highs' (or 'highs-pulp'), got {solver!r}")
    if solver == "highs":
        # The model as arrays, straight to highspy (see highs_direct); the PuLP builder below serves CBC.
        from . import highs_direct

        return highs_direct.solve(problem, time_limit=time_limit, warm_start=warm_start, msg=msg,
                                  rel_gap=rel_gap, min_memory=min_memory)
    t0 = time.perf_counter()
    model = _build(problem, min_memory=min_memory)
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
            start = _check_choice(problem, warm_start)
        elif time_limit is not None and not min_memory:
            # Under a time limit, hand the solver a greedy plan so that it always has an
            # incumbent to return (CBC may otherwise stop with nothing on large models).
            start = _greedy(problem, model)
        if start is not None:
            warm = _set_start(model, start)
        status, absgap = _run(model, solver, time_limit, warm, msg, rel_gap)
        if status == "infeasible":
            return None
        if status == "no_solution":
            if not warm:
                raise TimeoutError(
                    f"the {solver} solver found no plan within its time limit ({time_limit} s); "
                    "raise time_limit or pass a warm_start"
                )
            status, absgap, choice = "time_limit", None, start
        else:
            choice = _read_choice(model)
            if warm and status == "time_limit":
                ev0, ev1 = evaluate(problem, start), evaluate(problem, choice)
                if ev0.objective < ev1.objective:  # the solver lost its start (should not happen)
                    choice = start
    ev = evaluate(problem, choice)
    gap = relative_gap(ev, status, absgap, model.scale, min_memory)
    return IntraSolution(choice, *ev, status, gap, time.perf_counter() - t0, nv, nc, name, model.build_s)


def relative_gap(ev, status: str, absgap, scale: float, min_memory: bool):
    """The proven relative optimality gap of a solution evaluated as ``ev``: 0 when optimal, None when the solver
    proved no bound; ``absgap`` is the solver's absolute gap in its (scaled) objective units."""
    if status == "optimal":
        return 0.0
    if absgap is None:
        return None
    if min_memory:
        base = ev.peak_mem
        gap = absgap / base if base else math.inf
    else:
        base = abs(ev.objective)
        gap = absgap * scale / base if base else (0.0 if absgap <= 0 else math.inf)
    return max(gap, 0.0)


def solve_ilp(problem: IntraProblem, *, solver: str = "cbc", time_limit: float | None = None,
              warm_start: Sequence[int] | None = None, msg: bool = False,
              rel_gap: float = 1e-9) -> IntraSolution:
    """Solve the intra-operator ILP.

    Args:
        solver: ``"cbc"`` (PuLP's bundled CBC, as Alpa), ``"highs"`` (HiGHS through highspy, the
            model built as numpy arrays by :mod:`autopar_lab.solve.highs_direct`: the fast path) or
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
    sol = _solve(problem, solver=solver, time_limit=time_limit, warm_start=warm_start, msg=msg,
                 rel_gap=rel_gap, min_memory=False)
    if sol is not None:
        return sol
    if problem.node_mem is None or not math.isfinite(problem.mem_limit):
        raise _structural_error(problem)
    best = solve_min_memory(problem, solver=solver, time_limit=time_limit)
    if best.peak_mem <= problem.mem_limit * (1 + _MEM_RTOL):  # pragma: no cover - solver noise
        return best
    raise _memory_error(problem, best, exact=best.status == "optimal")


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
    sol = _solve(problem, solver=solver, time_limit=time_limit, warm_start=None, msg=msg,
                 rel_gap=1e-9, min_memory=True)
    if sol is None:
        raise _structural_error(problem)
    return sol


# --------------------------------------------------------------------------------------
# Alpa's follower merging
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MergeRecord:
    """What :func:`merge_followers` did, to show it and to map plans back.

    Attributes:
        num_nodes: nodes of the original problem.
        kept: reduced node ``i`` is original node ``kept[i]`` (the group's leader).
        group: original node -> the reduced node it was merged into (or kept as).
        parent: follower -> the original node it follows (its only producer).
        mapping: follower -> array over the leader's strategies giving the follower's
            strategy (-1 where the leader's strategy is forbidden by the follower's pin or
            inf costs).
    """

    num_nodes: int
    kept: tuple[int, ...]
    group: tuple[int, ...]
    parent: Mapping[int, int]
    mapping: Mapping[int, np.ndarray]

    def followers(self, leader: int) -> tuple[int, ...]:
        """Original nodes merged into ``leader`` (an original node id), in merge order."""
        g = self.group[leader]
        return tuple(v for v in self.parent if self.group[v] == g)

    def describe(self, names: Sequence[str] | None = None) -> list[str]:
        """One line per merge, e.g. ``"relu follows matmul (leader matmul): 0->1 1->0"``."""
        nm = (lambda v: names[v]) if names is not None else (lambda v: f"node {v}")
        out = []
        for v, u in self.parent.items():
            leader = self.kept[self.group[v]]
            pairs = " ".join(f"{p}->{q}" for p, q in enumerate(self.mapping[v]))
            out.append(f"{nm(v)} follows {nm(u)} (leader {nm(leader)}): {pairs}")
        return out


def _topo_order(n: int, edges) -> list[int]:
    succ = [[] for _ in range(n)]
    indeg = [0] * n
    for u, v in edges:
        succ[u].append(v)
        indeg[v] += 1
    heap = [v for v in range(n) if indeg[v] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        u = heapq.heappop(heap)
        order.append(u)
        for v in succ[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, v)
    if len(order) != n:
        raise ValueError("merge_followers needs an acyclic graph (edges form a cycle)")
    return order


def merge_followers(problem: IntraProblem, mergeable: Sequence[bool]) -> tuple[IntraProblem, MergeRecord]:
    """Alpa's node merging: fold each trivial node into the node it follows.

    A node ``v`` with ``mergeable[v]`` whose inputs all come from one node ``u`` follows
    ``u``: for each strategy ``p`` of ``u`` it takes ``argmin_q R_uv[p, q] + c_v[q]``
    (lowest ``q`` on ties; only its pinned ``q`` if pinned), and that cost is added to
    ``u``'s node cost at ``p`` (``inf`` if no ``q`` is allowed). Chains fold into the first
    non-follower (the leader). ``v``'s other edges move to the leader, its memory stays
    counted at the points where ``v`` is live (via ``mem_terms``). Every plan of the
    reduced problem maps back (:func:`expand`) to a full plan with the same cost and peak
    memory, but the reduced problem has fewer plans, so its optimum can be worse (see the
    module docstring for how often). To undo a merge, set ``mergeable[v] = False``.

    >>> p = IntraProblem(node_costs=([1.0, 1.0], [0.0, 3.0]), edges=((0, 1),),
    ...                  edge_costs=([[0.0, 2.0], [2.0, 0.0]],))
    >>> r, rec = merge_followers(p, [False, True])
    >>> r.node_costs[0].tolist(), rec.describe()
    ([1.0, 3.0], ['node 1 follows node 0 (leader node 0): 0->0 1->0'])
    >>> expand(rec, solve_ilp(r).choice)
    (0, 0)
    """
    n = problem.num_nodes
    if len(mergeable) != n:
        raise ValueError(f"mergeable has {len(mergeable)} entries for {n} nodes")
    edges = {}
    for (u, v), m in zip(problem.edges, problem.edge_costs):
        edges[(u, v)] = edges[(u, v)] + m if (u, v) in edges else np.array(m)
    sources: list[set[int]] = [set() for _ in range(n)]
    for u, v in edges:
        sources[v].add(u)
    order = _topo_order(n, edges)

    leader = list(range(n))
    parent: dict[int, int] = {}
    mapping: dict[int, np.ndarray] = {}      # follower -> leader strategy -> its strategy
    added = {v: np.zeros(c.size) for v, c in enumerate(problem.node_costs)}  # leader extra cost
    for v in order:
        if not mergeable[v] or len(sources[v]) != 1:
            continue
        (u,) = sources[v]
        r = leader[u]
        nr = problem.node_costs[r].size
        su = np.arange(nr) if u == r else mapping[u]
        cv = np.array(problem.node_costs[v])
        if v in problem.pins:
            keep = np.full(cv.size, np.inf)
            keep[problem.pins[v]] = cv[problem.pins[v]]
            cv = keep
        m = edges[(u, v)]
        f = np.full(nr, -1)
        extra = np.full(nr, np.inf)
        for p in range(nr):
            if su[p] < 0:
                continue
            total = m[su[p]] + cv
            q = int(np.argmin(total))  # first minimum: lowest index on ties
            if np.isfinite(total[q]):
                f[p], extra[p] = q, total[q]
        leader[v], parent[v], mapping[v] = r, u, f
        added[r] = added[r] + extra
        f.setflags(write=False)

    kept = tuple(v for v in range(n) if leader[v] == v)
    index = {v: i for i, v in enumerate(kept)}
    group = tuple(index[leader[v]] for v in range(n))

    def strat(v: int) -> np.ndarray:
        """Original node v's strategy as a function of its leader's (-1: forbidden)."""
        return np.arange(problem.node_costs[v].size) if leader[v] == v else mapping[v]

    def lift(v: int, vec: np.ndarray, fill: float) -> np.ndarray:
        s = strat(v)
        return np.where(s >= 0, vec[np.maximum(s, 0)], fill)

    node_costs = tuple(problem.node_costs[r] + added[r] for r in kept)
    red_edges: dict[tuple[int, int], np.ndarray] = {}
    for (a, b), m in edges.items():
        if b in parent and parent[b] == a:
            continue  # folded into the leader's node cost
        ra, rb = index[leader[a]], index[leader[b]]
        if ra == rb:  # pragma: no cover - impossible in a DAG (b would have a second source)
            raise ValueError("merge_followers: an edge inside a merged group")
        # Rows follow a's strategy under ra's; b is a leader (followers have one source).
        sa = strat(a)
        mm = np.where((sa >= 0)[:, None], m[np.maximum(sa, 0)], np.inf)
        sb = strat(b)
        mm = np.where((sb >= 0)[None, :], mm[:, np.maximum(sb, 0)], np.inf)
        key = (ra, rb)
        red_edges[key] = red_edges[key] + mm if key in red_edges else mm

    node_mem = live = mem_terms = None
    if problem.node_mem is not None:
        node_mem = tuple(problem.node_mem[r] for r in kept)
        live_l, terms_l = [], []
        extra_terms = problem.mem_terms or tuple(() for _ in problem.live)
        for pt, extra in zip(problem.live, extra_terms):
            live_l.append(tuple(index[v] for v in pt if leader[v] == v))
            t = [(index[leader[v]], lift(v, problem.node_mem[v], 0.0)) for v in pt if leader[v] != v]
            t += [(index[leader[v]], lift(v, vec, 0.0)) for v, vec in extra]
            terms_l.append(tuple(t))
        live = tuple(live_l)
        mem_terms = tuple(terms_l) if any(terms_l) else None

    pins = {index[v]: q for v, q in problem.pins.items() if leader[v] == v}
    names = None
    if problem.names is not None:
        cnt = {r: sum(1 for v in parent if leader[v] == r) for r in kept}
        names = tuple(problem.names[r] + (f" (+{cnt[r]})" if cnt[r] else "") for r in kept)
    reduced = IntraProblem(
        node_costs=node_costs,
        edges=tuple(red_edges),
        edge_costs=tuple(red_edges.values()),
        node_mem=node_mem,
        live=live,
        mem_limit=problem.mem_limit,
        pins=pins,
        names=names,
        mem_terms=mem_terms,
    )
    record = MergeRecord(n, kept, group, MappingProxyType(parent), MappingProxyType(mapping))
    return reduced, record


def expand(record: MergeRecord, reduced_choice: Sequence[int]) -> tuple[int, ...]:
    """Map a plan of the merged problem back to every original node.

    >>> p = IntraProblem(node_costs=([0.0, 0.0], [0.0, 0.0]), edges=((0, 1),),
    ...                  edge_costs=([[1.0, 0.0], [0.0, 1.0]],))
    >>> r, rec = merge_followers(p, [False, True])
    >>> expand(rec, (0,)), expand(rec, (1,))
    ((0, 1), (1, 0))
    """
    reduced_choice = tuple(int(q) for q in reduced_choice)
    if len(reduced_choice) != len(record.kept):
        raise ValueError(f"reduced choice has {len(reduced_choice)} entries for {len(record.kept)} nodes")
    out = []
    for v in range(record.num_nodes):
        p = reduced_choice[record.group[v]]
        if v in record.mapping:
            q = int(record.mapping[v][p])
            if q < 0:
                raise ValueError(f"strategy {p} of leader {record.kept[record.group[v]]} is forbidden "
                                 f"for its follower {v}")
            out.append(q)
        else:
            out.append(p)
    return tuple(out)
