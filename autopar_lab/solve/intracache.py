"""What the intra-op pass remembers: per mesh, each operator signature's priced strategies and the resharding costs
between specs (:class:`StrategyCache`); per graph, which layers pose the same problem (:func:`layer_signature`,
:func:`shared_lists`) and the results the planner would otherwise recompute on every mesh (:func:`graph_memo`)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..graph.fusion import kernel_role
from ..graph.opgraph import OUTPUT_PRIMITIVE, OpGraph, OpNode, op_signature
from ..sharding.reshard import reshard_cost
from ..sharding.spec import ShardingSpec
from ..sharding.strategies import Strategy, strategies_for

__all__ = ["StrategyCache", "graph_memo", "layer_signature", "shared_lists", "project_specs"]


def layer_signature(graph: OpGraph, ops: Sequence[int]) -> tuple:
    """A hashable description of a group of operators: their signatures and how they connect.

    Two layers with equal signatures pose the same ILP, so one's solution serves the other.
    """
    memo = graph_memo(graph, "layer_signature")
    key = tuple(ops)
    if key not in memo:
        memo[key] = _layer_signature(graph, ops)
    return memo[key]




def shared_lists(graph: OpGraph, ref_ops: Sequence[int], ops: Sequence[int], cache: StrategyCache) -> tuple[bool, ...]:
    """Per position, whether operator ``ops[k]`` gets the very strategy list of ``ref_ops[k]`` from ``cache`` (equal
    signature and kernel role), on any mesh: a reused layer then takes the reference's strategy as it is, with no
    look-up (:meth:`StrategyCache.same_strategy` per operator and mesh was a twentieth of the intra-op pass)."""
    memo = graph_memo(graph, "shared_lists")
    key = (tuple(ref_ops), tuple(ops), cache.mesh.cluster.device.efficiency.flash_attention)
    hit = memo.get(key)
    if hit is None:
        keys = cache.list_key
        hit = memo[key] = tuple(keys(graph.op(a)) == keys(graph.op(b)) for a, b in zip(ref_ops, ops))
    return hit


def graph_memo(graph: OpGraph, name: str) -> dict:
    """A dict kept on ``graph`` (graphs do not change once captured) for results the planner recomputes per mesh."""
    memos = graph.__dict__.setdefault("_intra_memos", {})
    return memos.setdefault(name, {})


def _layer_signature(graph: OpGraph, ops: Sequence[int]) -> tuple:
    pos = {op: i for i, op in enumerate(ops)}
    parts = []
    for op in ops:
        node = graph.op(op)
        refs: list[tuple] = []
        for t in node.inputs:
            p = graph.tensor(t).producer
            refs.append(("in", pos[p], graph.op(p).outputs.index(t)) if p in pos else ("ext",))
        alias = node.params.get("alias_of") if node.primitive == OUTPUT_PRIMITIVE else None
        if alias is not None:
            p = graph.tensor(alias).producer
            refs.append(("alias", pos[p]) if p in pos else ("alias-ext",))
        parts.append((op_signature(node), tuple(refs)))
    return tuple(parts)


#: ``project_specs(s, 1)`` per (output specs, input specs): a projection reads only the specs, and the planner's meshes
#: share most of them (each mesh builds its own Strategy objects).
_PROJECTED: dict[tuple, tuple] = {}


class StrategyCache:
    """Strategies per operator signature, and resharding costs per (specs, shape), on one mesh."""

    def __init__(self, mesh):
        self.mesh = mesh
        self._strats: dict[tuple, list[Strategy]] = {}
        self._by_node: dict[int, tuple[OpNode, Any, list[Strategy]]] = {}
        self._reshard: dict[tuple, float] = {}
        self._reshard_cols: dict[tuple, tuple] = {}
        self._proj: dict[int, tuple] = {}
        self._spec_idx: dict[tuple, tuple] = {}
        self._reshard_mats: dict[tuple, np.ndarray] = {}
        self.edge_mats: dict[tuple, tuple] = {}  # see _edge_matrix
        self._kept: dict[tuple, tuple] = {}
        self._projs: dict[int, tuple] = {}
        self._single: dict[int, tuple] = {}
        self._members: dict[int, tuple] = {}
        self._costs: dict[int, tuple] = {}

    def strategies(self, node: OpNode) -> list[Strategy]:
        # Asked ~10^5 times per mesh: remembered per node object first (hashing a signature and a kernel role each
        # time cost a tenth of the build), then per (signature, kernel role) so identical operators share the list.
        hit = self._by_node.get(id(node))
        if hit is not None and hit[0] is node and hit[1] is node.__dict__.get("_kernel"):  # roles attached since?
            return hit[2]
        # The same operator prices differently in different kernels (what it reads and writes): its kernel role
        # is part of the key.
        key = self.list_key(node)
        if key not in self._strats:
            self._strats[key] = strategies_for(node, self.mesh)
        self._by_node[id(node)] = (node, node.__dict__.get("_kernel"), self._strats[key])
        return self._strats[key]

    def restricted(self, strats: list[Strategy], proj: tuple) -> list[Strategy]:
        """The strategies of ``strats`` whose axis-1 projection is ``proj`` (all of them when none is), one list per
        (list, projection): operators of one signature restricted alike share it, and so their edge matrices."""
        key = (id(strats), proj)
        hit = self._kept.get(key)
        if hit is None or hit[0] is not strats:
            projs = self._projs.get(id(strats))  # each strategy's projection, once per list
            if projs is None or projs[0] is not strats:
                projs = self._projs[id(strats)] = (strats, [self.project(s) for s in strats])
            kept = [s for s, p in zip(strats, projs[1]) if p == proj]
            hit = self._kept[key] = (strats, kept or strats)
        return hit[1]

    def costs(self, strats: list[Strategy]) -> np.ndarray:
        """Each strategy's seconds, one read-only array per list (operators of one signature share their list)."""
        hit = self._costs.get(id(strats))
        if hit is None or hit[0] is not strats:
            arr = np.array([s.cost for s in strats])
            arr.setflags(write=False)
            hit = self._costs[id(strats)] = (strats, arr)
        return hit[1]

    def list_key(self, node: OpNode) -> tuple:
        """What :meth:`strategies` keys a node's list by: nodes with equal keys get the same list object."""
        eff = self.mesh.cluster.device.efficiency
        return (op_signature(node), kernel_role(node, eff.flash_attention, not eff.kernel_fusion))

    def single(self, s: Strategy) -> list[Strategy]:
        """``[s]``, one list per strategy (an operator decided outside the ILP joins it with this one choice)."""
        hit = self._single.get(id(s))
        if hit is None or hit[0] is not s:
            hit = self._single[id(s)] = (s, [s])
        return hit[1]

    def same_strategy(self, s: Strategy, node: OpNode) -> Strategy:
        """Strategy ``s`` (chosen for an identical operator of another layer) as priced for ``node``: the same specs,
        priced in ``node``'s own kernel (a layer at the model's edge may fuse differently)."""
        strats = self.strategies(node)
        hit = self._members.get(id(strats))
        if hit is None or hit[0] is not strats:  # per list: its members, and each by its key (keys are distinct)
            hit = self._members[id(strats)] = (strats, {id(t) for t in strats}, {t.key: t for t in reversed(strats)})
        if id(s) in hit[1]:
            return s
        return hit[2].get(s.key, s)

    def reshard(self, src: ShardingSpec, dst: ShardingSpec, shape, dtype) -> float:
        key = (src, dst, shape, dtype)
        if key not in self._reshard:
            if src == dst or not shape:
                self._reshard[key], self._reshard_cols[key] = 0.0, ()
            else:
                self._reshard[key], self._reshard_cols[key] = reshard_cost(src, dst, shape, dtype, self.mesh)
        return self._reshard[key]

    def project(self, s: Strategy) -> tuple:
        """``project_specs(s, 1)``, memoised per strategy object (the cache hands out the same objects for every
        operator of one signature, and the sequential solve asks once per operator and strategy)."""
        hit = self._proj.get(id(s))
        if hit is None or hit[0] is not s:
            key = (s.out_specs, s.in_specs)  # specs, not strategies: the same on every mesh
            proj = _PROJECTED.get(key)
            if proj is None:
                if len(_PROJECTED) > 1 << 17:
                    _PROJECTED.clear()
                proj = _PROJECTED[key] = project_specs(s, 1)
            hit = self._proj[id(s)] = (s, proj)
        return hit[1]

    def spec_index(self, strats: Sequence[Strategy], side: str, pos: int) -> tuple[list[ShardingSpec], np.ndarray]:
        """The distinct specs of output (``side="out"``) or input ``pos`` over ``strats``, and each strategy's
        index among them; memoised per list (the cache hands out the same list for every operator of a signature)."""
        key = (id(strats), side, pos)
        hit = self._spec_idx.get(key)
        if hit is None or hit[0] is not strats:
            uniq: dict[ShardingSpec, int] = {}
            inv = np.array([uniq.setdefault((s.out_specs if side == "out" else s.in_specs)[pos], len(uniq))
                            for s in strats], dtype=np.intp)
            hit = self._spec_idx[key] = (strats, list(uniq), inv)
        return hit[1], hit[2]

    def reshard_matrix(self, src: list[ShardingSpec], dst: list[ShardingSpec], shape, dtype) -> np.ndarray:
        """Resharding seconds from each of ``src`` to each of ``dst`` (lists from :meth:`spec_index`, which keeps
        them alive, so their ids name them)."""
        key = (id(src), id(dst), shape, dtype)
        hit = self._reshard_mats.get(key)
        if hit is None:
            known, reshard = self._reshard.get, self.reshard  # a pair seen before: one dict lookup, no call
            rows = []
            for a in src:
                row = []
                for b in dst:
                    c = known((a, b, shape, dtype))
                    row.append(reshard(a, b, shape, dtype) if c is None else c)
                rows.append(row)
            hit = self._reshard_mats[key] = np.array(rows)
        return hit

    def reshard_collectives(self, src, dst, shape, dtype) -> tuple:
        self.reshard(src, dst, shape, dtype)
        return self._reshard_cols[(src, dst, shape, dtype)]



def project_specs(s: Strategy, drop_axis: int) -> tuple:
    return (tuple(x.without_axes((drop_axis,)) for x in s.out_specs),
            tuple(x.without_axes((drop_axis,)) for x in s.in_specs))
