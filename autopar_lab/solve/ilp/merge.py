"""Alpa's follower merging: a heuristic that makes the ILP smaller, recorded so that it can be shown and undone."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np

from .problem import IntraProblem

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
    succ: list[list[int]] = [[] for _ in range(n)]
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
    >>> from autopar_lab.solve.ilp import solve_ilp
    >>> expand(rec, solve_ilp(r).choice)
    (0, 0)
    """
    n = problem.num_nodes
    if len(mergeable) != n:
        raise ValueError(f"mergeable has {len(mergeable)} entries for {n} nodes")
    edges: dict[tuple[int, int], np.ndarray] = {}
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
        live = problem.live or ()
        extra_terms = problem.mem_terms or tuple(() for _ in live)
        for pt, more in zip(live, extra_terms):
            live_l.append(tuple(index[v] for v in pt if leader[v] == v))
            t = [(index[leader[v]], lift(v, problem.node_mem[v], 0.0)) for v in pt if leader[v] != v]
            t += [(index[leader[v]], lift(v, vec, 0.0)) for v, vec in more]
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
