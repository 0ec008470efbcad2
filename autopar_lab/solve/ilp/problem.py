"""The intra-operator ILP as values: the problem, a solution, its evaluation, and the errors when nothing fits.

See :mod:`autopar_lab.solve.ilp` for the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

import numpy as np

SOLVER_NAMES = ("cbc", "highs", "highs-pulp")
#: The solver the planner, resolve and the workbench use unless told otherwise (HiGHS in process: the fast path).
DEFAULT_SOLVER = "highs"

# Relative slack used when a memory sum is compared with the limit, so that a plan whose
# peak equals the limit up to float rounding counts as fitting.
MEM_RTOL = 1e-9


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


def _kept_vec(x, what: str, seen: dict[int, np.ndarray]) -> np.ndarray:
    """``_frozen_vec(x)``, but a 1-D read-only float64 array (and every array it views) is itself the result, remembered
    in ``seen`` once checked."""
    if not (_frozen_float(x) and x.ndim == 1):
        return _frozen_vec(x, what)
    if x.size == 0 or np.isnan(x).any() or np.isneginf(x).any():
        return _frozen_vec(x, what)  # its error
    seen[id(x)] = x
    return x


def _frozen_float(m) -> bool:
    """Is ``m`` a float64 array that nobody can write, through itself or the arrays it views?"""
    if not isinstance(m, np.ndarray) or m.dtype != np.float64:
        return False
    while isinstance(m, np.ndarray):
        if m.flags.writeable:
            return False
        m = m.base
    return True


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

    Arrays are copied and made read-only (an edge matrix already read-only, with every array it views, is kept
    as it is); ``pins`` becomes a read-only mapping.

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
        # A read-only float vector (the intra-op pass hands one per strategy list, shared by every operator of that
        # signature) is kept as it is and checked once, as the edge matrices below.
        seen: dict[int, np.ndarray] = {}
        costs = tuple(c if seen.get(id(c)) is c else _kept_vec(c, f"node_costs[{i}]", seen)
                      for i, c in enumerate(self.node_costs))
        n = len(costs)
        set_("node_costs", costs)
        sizes = [c.size for c in costs]

        edges = tuple((int(u), int(v)) for u, v in self.edges)
        if len(self.edge_costs) != len(edges):
            raise ValueError(f"{len(edges)} edges but {len(self.edge_costs)} edge cost matrices")
        ecosts = []
        # The intra-op pass hands the same read-only matrix to many edges (identical layers, chains of one shape):
        # such a matrix is kept as it is (no copy: nobody can write it through this problem) and checked once.
        checked: dict[int, np.ndarray] = {}
        for k, ((u, v), m) in enumerate(zip(edges, self.edge_costs)):
            if not (0 <= u < n and 0 <= v < n):
                raise ValueError(f"edge {k} = ({u}, {v}) names a node outside 0..{n - 1}")
            if u == v:
                raise ValueError(f"edge {k} = ({u}, {v}) is a self loop")
            kept = _frozen_float(m)
            a = m if kept else np.array(m, dtype=float)
            if a.shape != (sizes[u], sizes[v]):
                raise ValueError(
                    f"edge {k} = ({u}, {v}): cost matrix has shape {a.shape}, "
                    f"expected {(sizes[u], sizes[v])} (strategies of u x strategies of v)"
                )
            if checked.get(id(a)) is not a:
                if np.isnan(a).any() or np.isneginf(a).any():
                    raise ValueError(f"edge {k} = ({u}, {v}): cost matrix contains NaN or -inf")
                if kept:
                    checked[id(a)] = a
                else:
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
        rows = [[(v, self.node_mem[v]) for v in pt] for pt in self.live or ()]
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


def fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit} ({b:.6g} bytes)"
    return f"{b:.6g} bytes"


def memory_error(problem: IntraProblem, best: IntraSolution, exact: bool) -> InfeasibleError:
    need, limit = best.peak_mem, problem.mem_limit
    at_least = "" if exact else "at most "
    msg = (
        f"No sharding plan fits in {fmt_bytes(limit)} per device: the smallest peak memory any "
        f"allowed plan needs is {at_least}{fmt_bytes(need)}"
        f"{f', {need / limit:.2f}x the limit' if limit > 0 else ''}. "
        "Use devices with more memory, more devices (a larger mesh), rematerialisation, "
        "or more pipeline stages, or drop pins that force large shardings."
    )
    return InfeasibleError(msg, min_peak_mem=need, mem_limit=limit, choice=best.choice, exact=exact)


def structural_error(problem: IntraProblem) -> InfeasibleError:
    return InfeasibleError(
        "No sharding plan is allowed at all, whatever the memory: the pins, the forbidden "
        "(inf) strategies and the forbidden (inf) resharding pairs exclude every combination. "
        "Drop or change a pin, or allow more resharding pairs.",
        mem_limit=problem.mem_limit,
    )


# --------------------------------------------------------------------------------------
# Evaluation and brute force (the references the ILP is tested against)
# --------------------------------------------------------------------------------------


def check_choice(problem: IntraProblem, choice: Sequence[int]) -> tuple[int, ...]:
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
    choice = check_choice(problem, choice)
    node = math.fsum(float(c[q]) for c, q in zip(problem.node_costs, choice))
    edge = math.fsum(float(m[choice[u], choice[v]]) for (u, v), m in zip(problem.edges, problem.edge_costs))
    if math.isinf(node) or math.isinf(edge):
        node, edge = (math.inf if math.isinf(node) else node), (math.inf if math.isinf(edge) else edge)
    peak = max((math.fsum(float(vec[choice[v]]) for v, vec in row) for row in problem.mem_rows()), default=0.0)
    return Evaluation(node + edge, node, edge, peak)


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
