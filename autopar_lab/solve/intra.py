"""Alpa's intra-operator pass on an operator graph: per-operator strategies, resharding edges, the ILP.

:func:`build_problem` turns the operators of an :class:`~autopar_lab.graph.opgraph.OpGraph` and a logical mesh into
an :class:`~autopar_lab.solve.ilp.IntraProblem`: one node per operator with its strategies
(:func:`~autopar_lab.sharding.strategies.strategies_for`), one edge per producer -> consumer pair with the resharding
cost of every (producer strategy, consumer strategy) pair, and an extra edge from every updated parameter back to the
parameter it replaces (the step's outputs alias its inputs, so a parameter kept sharded differently from its update
pays the conversion once per step: this is how weight-update sharding, ZeRO-2 style, is a choice the ILP makes).

:func:`solve_intra` solves it. Transformer layers repeat, so by default (``reuse_layers=True``) it solves each
structurally distinct layer once and gives every identical layer the same strategies; layers are solved in forward
order and each sees the strategies already chosen for its neighbours, so a layer agrees with the one before it.
``reuse_layers=False`` solves the whole graph as one ILP (the reference the reuse is measured against).

Example:
    >>> import jax, jax.numpy as jnp
    >>> from autopar_lab.graph import trace
    >>> from autopar_lab.cluster import Cluster
    >>> mesh = Cluster.preset("p3.16xlarge").logical_mesh((1, 8), (8, 1))
    >>> g = trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jax.ShapeDtypeStruct((64, 64), jnp.float32),
    ...           jax.ShapeDtypeStruct((1 << 18, 64), jnp.float32), batch_argnums=(1,))
    >>> plan = solve_intra(g, mesh)
    >>> str(plan.strategies[2].in_specs[0])   # the batch is split over the 8 devices: data parallelism
    'S0R'
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from ..graph.opgraph import (
    BACKWARD,
    FORWARD,
    FP8_COPY_BYTES,
    GRAD_BYTES,
    INPUT_PRIMITIVE,
    OPT_STATE,
    OUTPUT_PRIMITIVE,
    PARAM,
    UPDATE,
    OpGraph,
    OpNode,
    dtype_size,
    op_signature,
)
from ..graph.fusion import attach_kernel_roles, is_chain_link, kernel_role, kernel_view
from ..graph.opcost import CONTRACTIONS, REDUCTIONS, SCATTERS, WINDOWED
from ..sharding.fsdp import is_param_input
from ..sharding.reshard import reshard_cost
from ..sharding.spec import ShardingSpec
from ..sharding.strategies import Strategy, chain_read_s_per_byte, strategies_for
from . import ilp

if TYPE_CHECKING:
    from ..cluster import LogicalMesh

MEMORY_TIE_BREAK_S_PER_BYTE = 1e-15

#: Later layers the ILP assumes re-read each gradient-chain link (where the device's compiler re-reads the chain,
#: ``Efficiency.chain_reads``): the stage DP decides afterwards how many layers share a program, so the ILP prices the
#: least a link is re-read when it is read at all (by the next layer), enough that it does not replicate the chain to
#: save a resharding elsewhere (pricing.stage.chain_pairs charges the stage's real count).
CHAIN_READERS_IN_ILP = 1

# Elementwise-like operators that Alpa merges into the operator they follow (see ilp.merge_followers).
_MERGEABLE = frozenset(
    """add sub mul div neg exp log tanh logistic sqrt rsqrt integer_pow max min select_n convert_element_type
    add_any abs sign square erf pow reshape broadcast_in_dim transpose squeeze expand_dims""".split()
)


@dataclass(frozen=True)
class GroupSolve:
    """How one group of operators (a layer, or the whole graph) got its strategies."""

    name: str
    ops: int
    reused_from: str | None
    status: str
    gap: float | None
    solve_s: float
    num_vars: int
    num_constraints: int
    merges: int = 0


@dataclass(frozen=True)
class IntraPlan:
    """The strategy of every operator of a graph (or of a part of it) on one logical mesh, and what it costs.

    Times are seconds per training step on the graph's batch: ``compute_s`` (roofline of each operator's shard),
    ``comm_s`` (the collectives the operators run themselves), ``reshard_s`` (the collectives between operators whose
    specs disagree). ``role_s`` splits their sum by forward / backward / update (a resharding counts for the
    consumer's role); ``sync_s`` is the part of ``comm_s`` spent on weight gradients (which a pipeline pays once per
    step, not once per microbatch). Memory per device: ``static_bytes`` (parameters, their gradients, optimizer state)
    and ``act_bytes`` (forward outputs the backward pass reads).
    """

    mesh: Any
    ops: tuple[int, ...]
    strategies: Mapping[int, Strategy]
    compute_s: float
    comm_s: float
    reshard_s: float
    role_s: Mapping[str, float]
    sync_s: float
    static_bytes: float
    act_bytes: float
    collectives: Mapping[str, Mapping[str, float]]
    groups: tuple[GroupSolve, ...] = ()
    solve_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.reshard_s

    @property
    def logical_mesh(self) -> tuple[int, int]:
        return tuple(self.mesh.shape)

    def spec_of(self, op: int) -> tuple[ShardingSpec, ...]:
        return self.strategies[op].out_specs


# --------------------------------------------------------------------------------------------------------------
# Signatures: which operators (and layers) are the same problem


def layer_signature(graph: OpGraph, ops: Sequence[int]) -> tuple:
    """A hashable description of a group of operators: their signatures and how they connect.

    Two layers with equal signatures pose the same ILP, so one's solution serves the other.
    """
    memo = _graph_memo(graph, "layer_signature")
    key = tuple(ops)
    if key not in memo:
        memo[key] = _layer_signature(graph, ops)
    return memo[key]


def _names(graph: OpGraph, nodes: Sequence[int]) -> tuple[str, ...]:
    """The ILP's node names (for its messages), each operator's described once per graph: the planner builds a
    problem over the same operators on every mesh."""
    memo = _graph_memo(graph, "describe")
    out = []
    for op in nodes:
        name = memo.get(op)
        if name is None:
            name = memo[op] = graph.op(op).describe()
        out.append(name)
    return tuple(out)


def shared_lists(graph: OpGraph, ref_ops: Sequence[int], ops: Sequence[int], cache: StrategyCache) -> tuple[bool, ...]:
    """Per position, whether operator ``ops[k]`` gets the very strategy list of ``ref_ops[k]`` from ``cache`` (equal
    signature and kernel role), on any mesh: a reused layer then takes the reference's strategy as it is, with no
    look-up (:meth:`StrategyCache.same_strategy` per operator and mesh was a twentieth of the intra-op pass)."""
    memo = _graph_memo(graph, "shared_lists")
    key = (tuple(ref_ops), tuple(ops), cache.mesh.cluster.device.efficiency.flash_attention)
    hit = memo.get(key)
    if hit is None:
        keys = cache.list_key
        hit = memo[key] = tuple(keys(graph.op(a)) == keys(graph.op(b)) for a, b in zip(ref_ops, ops))
    return hit


def _graph_memo(graph: OpGraph, name: str) -> dict:
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


#: ``_project(s, 1)`` per (output specs, input specs): a projection reads only the specs, and the planner's meshes
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
        return (op_signature(node), kernel_role(node, self.mesh.cluster.device.efficiency.flash_attention))

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
        """``_project(s, 1)``, memoised per strategy object (the cache hands out the same objects for every
        operator of one signature, and the sequential solve asks once per operator and strategy)."""
        hit = self._proj.get(id(s))
        if hit is None or hit[0] is not s:
            key = (s.out_specs, s.in_specs)  # specs, not strategies: the same on every mesh
            proj = _PROJECTED.get(key)
            if proj is None:
                if len(_PROJECTED) > 1 << 17:
                    _PROJECTED.clear()
                proj = _PROJECTED[key] = _project(s, 1)
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


# --------------------------------------------------------------------------------------------------------------
# The problem


def _edges_of(graph: OpGraph, ops: Iterable[int]) -> list[tuple[int, int, int, int]]:
    """(producer, consumer, producer output index, consumer input index) for every tensor read, plus alias edges
    (updated parameter -> parameter: producer is the parameter op, consumer the output op, indices -1)."""
    memo = _graph_memo(graph, "in_edges")
    out: list[tuple[int, int, int, int]] = []
    for v in ops:
        edges = memo.get(v)
        if edges is None:
            edges = memo[v] = _in_edges(graph, v)
        out.extend(edges)
    return out


def _in_edges(graph: OpGraph, v: int) -> tuple[tuple[int, int, int, int], ...]:
    node = graph.op(v)
    out: list[tuple[int, int, int, int]] = []
    for j, t in enumerate(node.inputs):
        u = graph.tensor(t).producer
        if u is None:
            continue
        out.append((u, v, graph.op(u).outputs.index(t), j))
    if node.primitive == OUTPUT_PRIMITIVE and node.params.get("alias_of") is not None:
        p = graph.tensor(node.params["alias_of"]).producer
        if p is not None:
            out.append((p, v, -1, -1))
    return tuple(out)


def _edge_matrix(graph, cache, u, v, i, j, su, sv) -> np.ndarray:
    """Resharding seconds from each strategy of u (rows) to each of v (columns). Strategies share specs (a matmul's
    dozens of strategies have a handful of output specs), so each distinct (source, destination) pair is priced
    once and the matrix gathered from those. The matrix depends only on the two strategy lists, the positions read
    and the tensor's shape and dtype: operators that repeat (each layer's copies, a chain of elementwise operators
    of one shape) share it (read-only)."""
    t = graph.tensor(graph.op(v).inputs[0] if i == -1 else graph.op(u).outputs[i])
    key = (id(su), id(sv), i, j, t.shape, t.dtype)
    hit = cache.edge_mats.get(key)
    if hit is not None and hit[0] is su and hit[1] is sv:  # the memo holds both lists: their ids stay theirs
        return hit[2]
    mat = _gathered_edge_matrix(graph, cache, u, v, i, j, su, sv)
    mat.setflags(write=False)
    cache.edge_mats[key] = (su, sv, mat)
    return mat


def _gathered_edge_matrix(graph, cache, u, v, i, j, su, sv) -> np.ndarray:
    if i == -1:  # alias: the update (consumer v's input spec) must become the parameter's spec (u's output spec)
        t = graph.tensor(graph.op(v).inputs[0])
        dst, drow = cache.spec_index(su, "out", 0)
        src, scol = cache.spec_index(sv, "in", 0)
        return cache.reshard_matrix(src, dst, t.shape, t.dtype).T[drow[:, None], scol[None, :]]
    t = graph.tensor(graph.op(u).outputs[i])
    src, srow = cache.spec_index(su, "out", i)
    dst, dcol = cache.spec_index(sv, "in", j)
    return cache.reshard_matrix(src, dst, t.shape, t.dtype)[srow[:, None], dcol[None, :]]


def _liveness(graph: OpGraph, ops: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Program points (one per operator, in order) and the operators whose outputs are live there."""
    index = {op: k for k, op in enumerate(ops)}
    last = {op: k for k, op in enumerate(ops)}
    for k, v in enumerate(ops):
        for t in graph.op(v).inputs:
            u = graph.tensor(t).producer
            if u in index:
                last[u] = max(last[u], k)
    # Inputs of the step live all step (they are donated to the outputs only at the end).
    for op in ops:
        if graph.op(op).primitive == INPUT_PRIMITIVE:
            last[op] = len(ops) - 1
    starts: dict[int, list[int]] = defaultdict(list)
    for op in ops:
        starts[index[op]].append(op)
    live: list[tuple[int, ...]] = []
    current: set[int] = set()
    for k in range(len(ops)):
        current.update(starts[k])
        live.append(tuple(sorted(index[o] for o in current)))
        current = {o for o in current if last[o] > k}
    return tuple(live)


def gathered_param_terms(graph: OpGraph, nodes: Sequence[int], strats: Sequence[Sequence[Strategy]],
                         mesh_shape: tuple[int, ...]):
    """The memory constraint's transient terms (``IntraProblem.mem_terms``, one tuple per program point): at the
    point of an operator reading a parameter, the bytes of the parameter in the spec that operator reads it in.

    A parameter stored sharded (ZeRO-3 / FSDP) is gathered for each reader and freed after it: the gathered copy is
    live at the reader's point only, which is what this term adds. It cannot see the stored spec (the memory rows are
    linear in each node's choice), so a reader of a parameter stored as it reads it is charged one copy too many:
    conservative by one parameter at one point, never under."""
    index = {op: k for k, op in enumerate(nodes)}
    out: list[tuple] = [() for _ in nodes]
    for k, v in enumerate(nodes):
        node = graph.op(v)
        if node.primitive == OUTPUT_PRIMITIVE:
            continue
        for j, t in enumerate(node.inputs):
            u = graph.tensor(t).producer
            if u is None or u not in index or not is_param_input(graph, u):
                continue
            info = graph.tensor(t)
            need = np.array([float(s.in_specs[j].bytes_per_device(info.shape, info.dtype, mesh_shape))
                             for s in strats[k]])
            if need.any():
                out[k] += ((k, need),)
    return tuple(out) if any(out) else None


def strategy_index(pin, strats: Sequence[Strategy], node: OpNode) -> int:
    if isinstance(pin, (int, np.integer)):
        if not 0 <= pin < len(strats):
            raise ValueError(f"operator {node.describe()} has {len(strats)} strategies; pin index {pin} is out of "
                             "range")
        return int(pin)
    if isinstance(pin, Strategy):
        for k, s in enumerate(strats):
            if s.key == pin.key:
                return k
        pin = pin.name
    text = str(pin)
    for k, s in enumerate(strats):
        if s.name == text or (s.out_specs and str(s.out_specs[0]) == text):
            return k
    names = ", ".join(sorted({str(s.out_specs[0]) if s.out_specs else s.name for s in strats}))
    raise ValueError(
        f"strategy {text!r} is not available for operator {node.describe()} on this mesh (it does not divide the "
        f"operator's shapes, or is not one of its patterns); choose one of: {names}"
    )


@dataclass
class _Built:
    problem: ilp.IntraProblem
    nodes: list[int]  # problem node -> op id
    strats: list[list[Strategy]]


def _project(s: Strategy, drop_axis: int) -> tuple:
    return (tuple(x.without_axes((drop_axis,)) for x in s.out_specs),
            tuple(x.without_axes((drop_axis,)) for x in s.in_specs))


def build_problem(graph: OpGraph, mesh: LogicalMesh, ops: Sequence[int] | None = None, *,
                  context: Mapping[int, Strategy] = {}, pins: Mapping[int, Any] = {},
                  mem_limit_bytes: float = math.inf, cache: StrategyCache | None = None,
                  mirror: Mapping[int, int] = {}, restrict: Mapping[int, tuple] = {}) -> _Built:
    """The ILP for ``ops`` (default: all) on ``mesh``.

    Operators in ``context`` (already decided, outside ``ops``) join as single-strategy nodes, so the edges to them
    are priced; ``pins`` fix an operator's strategy (a Strategy, its name, its output spec string, or an index).
    ``mirror`` maps an operator outside ``ops`` to the operator inside that will get the same strategy (the same
    position in an identical layer): edges from it are priced as edges from its mirror. ``restrict`` keeps, per
    operator, only the strategies whose specs without mesh axis 1 equal the given projection (see ``axes`` in
    :func:`solve_intra`).
    """
    attach_kernel_roles(graph)
    cache = cache or StrategyCache(mesh)
    ops = list(graph.ops if ops is None else ops)
    inside = set(ops)
    near = inside | set(mirror)  # an identical layer's operators stand for this layer's
    ctx = sorted(({u for (u, v, _, _) in _edges_of(graph, near) if u not in inside and u in context}
                  | {v for v in context if v not in inside and any(
                      graph.tensor(t).producer in near for t in graph.op(v).inputs)}) - set(mirror))
    nodes = ops + ctx
    index = {op: k for k, op in enumerate(nodes)}
    strats = []
    for op in nodes:
        if op not in inside:
            strats.append(cache.single(context[op]))
            continue
        full = cache.strategies(graph.op(op))
        if op in restrict:
            full = cache.restricted(full, restrict[op])
        strats.append(full)
    pin_idx = {}
    for op, pin in pins.items():
        if op in index:
            pin_idx[index[op]] = strategy_index(pin, strats[index[op]], graph.op(op))
    node_costs = [cache.costs(ss) for ss in strats]
    # Keeping a parameter or optimizer state whole costs no time when its readers slice it locally, but it costs
    # memory: among plans equally fast, prefer the one that stores step inputs sharded (a tie-break, 1e-15 s per byte).
    for k, op in enumerate(nodes):
        if op in inside and graph.op(op).primitive == INPUT_PRIMITIVE and \
                graph.tensor(graph.op(op).outputs[0]).kind in (PARAM, OPT_STATE):
            node_costs[k] = node_costs[k] + MEMORY_TIE_BREAK_S_PER_BYTE * np.array([s.mem_bytes for s in strats[k]])
    chain_unit = CHAIN_READERS_IN_ILP * chain_read_s_per_byte(mesh)
    if chain_unit:
        mshape = tuple(mesh.shape)
        for k, op in enumerate(nodes):
            node = graph.op(op)
            if op in inside and is_chain_link(graph, node):
                link = graph.tensor(node.outputs[0])
                node_costs[k] = node_costs[k] + chain_unit * np.array(
                    [s.out_specs[0].bytes_per_device(link.shape, link.dtype, mshape) for s in strats[k]])
    edges, mats = [], []
    # Edges to and from identical layers, folded onto this layer's own operators (each pattern once: a middle layer
    # both receives and sends the same boundary).
    folded: dict[tuple, tuple] = {}
    fold = {**{op: op for op in inside}, **{op: m for op, m in mirror.items() if op not in inside},
            **{op: op for op in ctx}}
    for (u, v, i, j) in _edges_of(graph, list(fold)):
        if u not in fold or (u not in mirror and v not in mirror) or (u in inside and v in inside):
            continue
        if (u in ctx and v in ctx) or (fold[u] not in inside and fold[v] not in inside):
            continue
        folded.setdefault((fold[u], i, fold[v], j), (u, v, i, j))
    for (mu, i, mv, j), (u, v, _, _) in folded.items():
        mat = _edge_matrix(graph, cache, u, v, i, j, strats[index[mu]], strats[index[mv]])
        if mu == mv:  # the same position feeds itself across layers (a residual stream)
            node_costs[index[mu]] = node_costs[index[mu]] + np.diag(mat)
        else:
            edges.append((index[mu], index[mv]))
            mats.append(mat)
    for (u, v, i, j) in _edges_of(graph, nodes):
        if u not in index or v not in index or (u not in inside and v not in inside):
            continue
        edges.append((index[u], index[v]))
        mats.append(_edge_matrix(graph, cache, u, v, i, j, strats[index[u]], strats[index[v]]))
    # Edges point forward in node order (the ILP does not care; follower merging needs an acyclic graph, and edges
    # folded from identical layers can point backward).
    for k, ((a, b), mat) in enumerate(zip(edges, mats)):
        if a > b:
            edges[k], mats[k] = (b, a), mat.T
    node_mem = live = terms = None
    if math.isfinite(mem_limit_bytes):
        node_mem = tuple(np.array([s.mem_bytes for s in ss]) for ss in strats)
        live = _liveness(graph, nodes)
        terms = gathered_param_terms(graph, nodes, strats, tuple(mesh.shape))
    problem = ilp.IntraProblem(
        node_costs=tuple(node_costs),
        edges=tuple(edges), edge_costs=tuple(mats), node_mem=node_mem, live=live, mem_limit=mem_limit_bytes,
        pins=pin_idx, names=_names(graph, nodes), mem_terms=terms,
    )
    return _Built(problem, nodes, strats)


# --------------------------------------------------------------------------------------------------------------
# Solving


def _solve_group(graph, mesh, ops, *, context, pins, mem_limit, cache, solver, time_limit, merge, name,
                 mirror={}, restrict={}):
    built = build_problem(graph, mesh, ops, context=context, pins=pins, mem_limit_bytes=mem_limit, cache=cache,
                          mirror=mirror, restrict=restrict)
    problem, merges = built.problem, 0
    record = None
    inside = set(ops)
    if merge:
        mergeable = [graph.op(op).primitive in _MERGEABLE and op in inside for op in built.nodes]
        problem, record = ilp.merge_followers(problem, mergeable)
        merges = len(built.nodes) - problem.num_nodes
    sol = ilp.solve_ilp(problem, solver=solver, time_limit=time_limit)
    choice = ilp.expand(record, sol.choice) if record is not None else sol.choice
    chosen = {op: built.strats[k][choice[k]] for k, op in enumerate(built.nodes) if op in inside}
    info = GroupSolve(name, len(ops), None, sol.status, sol.gap, sol.solve_s, sol.num_vars, sol.num_constraints, merges)
    return chosen, info


def layer_groups(graph: OpGraph, ops: Sequence[int] | None = None) -> list[tuple[str, list[int]]]:
    """Operators grouped by layer, in order of first appearance; operators without a layer form the group ''."""
    groups: dict[str, list[int]] = {}
    for op in (graph.ops if ops is None else ops):
        groups.setdefault(graph.op(op).layer or "", []).append(op)
    return list(groups.items())


class _OneAxisView:
    """Axis 0 of a logical mesh as a mesh of its own, (n0, 1): the first pass of the ``axes="sequential"`` solve."""

    def __init__(self, mesh):
        self._mesh = mesh
        self.cluster = mesh.cluster
        self.shape = (mesh.shape[0], 1)
        self.num_devices = mesh.num_devices  # the program still runs on all of them (Cluster.virtual_share)

    def axis_size(self, axis) -> int:
        return self.shape[0] if axis in (0, (0, 1)) else 1

    def __getattr__(self, kind):  # all_gather, reduce_scatter, all_reduce, all_to_all: axis 0's links
        fn = getattr(self._mesh, kind)
        return lambda nbytes, axis: fn(nbytes, 0) if axis in (0, (0, 1)) else 0.0


def solve_intra(graph: OpGraph, mesh: LogicalMesh, ops: Sequence[int] | None = None, *, pins: Mapping[int, Any] = {},
                mem_limit_bytes: float | None = None, reuse_layers: bool = True, merge: bool = False,
                solver: str = "cbc",
                time_limit: float | None = None, axes: str = "auto", cache: StrategyCache | None = None,
                rounds: int = 2, memo: dict | None = None) -> IntraPlan:
    """Choose a strategy for every operator in ``ops`` (default: the whole graph) on ``mesh``.

    ``pins`` fix operators' strategies; the ILP solves the rest around them. ``mem_limit_bytes`` (per device) adds
    Alpa's memory constraint over program points; it is applied to the whole graph as one ILP, since the layers'
    memory adds up. ``merge`` applies Alpa's follower merging (smaller ILPs, possibly worse plans: see
    :func:`autopar_lab.solve.ilp.merge_followers`).

    ``axes``: on a mesh with two axes of more than one device, ``"joint"`` searches both axes' splits in one ILP
    (every strategy of every operator: exact, but the ILP grows with the square of the strategy counts), while
    ``"sequential"`` first solves with axis 0 alone, then lets the ILP choose axis 1's splits among the strategies
    that keep axis 0's (two small ILPs; the plan data x tensor parallelism naturally has). ``"auto"`` is
    sequential when both axes are split, joint otherwise. ``bench/bench_intra.py`` measures what it costs.

    ``rounds``: with layer reuse, how many times each group is solved in turn, each time seeing its neighbours'
    latest strategies (coordinate descent; the second round repairs boundaries the first could not see).

    ``memo``: a dict the caller keeps across calls on the same graph and cluster (the planner solves ~50 meshes).
    The sequential solve's first pass sees only axis 0, so it is the same problem on every mesh whose axis 0 has
    the same size and link (a (2, 8) view of 2 hosts and a (2, 16) view of 4 hosts both pair devices 8 apart
    with 8 pairs sharing a host's NICs); it is solved once per such axis.
    """
    t0 = time.perf_counter()
    attach_kernel_roles(graph)
    cache = cache or StrategyCache(mesh)
    ops = list(graph.ops if ops is None else ops)
    mem_limit = math.inf if mem_limit_bytes is None else float(mem_limit_bytes)
    if axes not in ("auto", "joint", "sequential"):
        raise ValueError(f"axes must be 'auto', 'joint' or 'sequential', got {axes!r}")
    chosen, infos = _choose(graph, mesh, ops, pins=pins, mem_limit=mem_limit, reuse_layers=reuse_layers, merge=merge,
                            solver=solver, time_limit=time_limit, axes=axes, cache=cache, rounds=rounds, memo=memo)
    return evaluate_intra(graph, mesh, chosen, ops=ops, cache=cache, groups=tuple(infos),
                          solve_s=time.perf_counter() - t0)


def _choose(graph: OpGraph, mesh, ops: list[int], *, pins: Mapping[int, Any], mem_limit: float, reuse_layers: bool,
            merge: bool, solver: str, time_limit: float | None, axes: str, cache: StrategyCache, rounds: int,
            memo: dict | None) -> tuple[dict[int, Strategy], list[GroupSolve]]:
    """:func:`solve_intra`'s choice of strategies and its groups' solves, without the plan's evaluation (which the
    sequential solve's first pass does not need: it keeps only the strategies)."""
    restrict: dict[int, tuple] = {}
    two_axes = mesh.shape[0] > 1 and mesh.shape[1] > 1
    if two_axes and axes in ("auto", "sequential"):
        key = ("first pass", tuple(ops), mesh.axis_profile(0), reuse_layers, merge, solver, time_limit, rounds)
        if memo is None or key not in memo:
            view: Any = _OneAxisView(mesh)  # axis 0 alone, standing in for a LogicalMesh
            vcache = StrategyCache(view)
            first, _ = _choose(graph, view, ops, pins={}, mem_limit=math.inf, reuse_layers=reuse_layers, merge=merge,
                               solver=solver, time_limit=time_limit, axes="joint", cache=vcache, rounds=rounds,
                               memo=None)
            restrict = {op: vcache.project(s) for op, s in first.items()}
            if memo is not None:
                memo[key] = restrict
        else:
            restrict = memo[key]
        if math.isfinite(mem_limit):
            # The second pass may store parameters sharded over axis 0 although the first (which sees no limit)
            # kept them whole: ZeRO-3 / FSDP, the memory-lean choice, stays open under a memory limit.
            restrict = {op: r for op, r in restrict.items() if not is_param_input(graph, op)}
    if pins and restrict:  # a pinned operator keeps every strategy: its pin need not agree with axis 0's pass
        restrict = {op: r for op, r in restrict.items() if op not in pins}
    kw = dict(cache=cache, solver=solver, time_limit=time_limit, merge=merge, restrict=restrict)
    chosen: dict[int, Strategy] = {}
    infos: list[GroupSolve] = []
    if not reuse_layers or math.isfinite(mem_limit):
        chosen, info = _solve_group(graph, mesh, ops, context={}, pins=pins, mem_limit=mem_limit,
                                    name="(whole graph)", **kw)
        infos.append(info)
    else:
        groups = layer_groups(graph, ops)
        sigs = [layer_signature(graph, g) for _, g in groups]
        copies: dict[tuple, list[int]] = defaultdict(list)
        for k, sig in enumerate(sigs):
            copies[sig].append(k)
        # Layers that do not repeat (embedding, head, ...) are solved together: they often share parameters (a tied
        # embedding) that one ILP should decide.
        single = [k for k in range(len(groups)) if len(copies[sigs[k]]) == 1]
        if len(single) > 1:
            merged = ("+".join(groups[k][0] or "(no layer)" for k in single),
                      sorted(op for k in single for op in groups[k][1]))
            keep = [k for k in range(len(groups)) if k not in single]
            groups = [groups[k] for k in keep] + [merged]
            sigs = [sigs[k] for k in keep] + [("merged",)]
            copies = defaultdict(list)
            for k, sig in enumerate(sigs):
                copies[sig].append(k)
        # Repeated layers first (they are most of the model), each solved once with its copies' operators mirrored
        # onto its own, so the boundary between two identical layers is priced; then the rest around them.
        order = sorted(range(len(groups)), key=lambda k: (len(copies[sigs[k]]) == 1, k))
        if rounds > 1 and any(len(c) > 1 for c in copies.values()) and len(copies) > 1:
            order = order + order  # a second round: each group again, now seeing every neighbour's choice
        done: dict[tuple, int] = {}
        for step, k in enumerate(order):
            if step == len(order) // 2 and len(order) > len(groups):
                done.clear()
                infos.clear()
            name, group = groups[k]
            group_pins = {op: p for op, p in pins.items() if op in set(group)}
            # Identical layers pinned alike (the same pins at the same positions: e.g. the cost table's lean solution
            # pins every layer's weights to their least storage) are one problem too, solved once.
            reuse_key = (sigs[k], tuple((i, getattr(group_pins[op], "name", group_pins[op]))
                                        for i, op in enumerate(group) if op in group_pins))
            if reuse_key in done:
                ref_name, ref_ops = groups[done[reuse_key]]
                for a, b, same in zip(ref_ops, group, shared_lists(graph, ref_ops, group, cache)):
                    chosen[b] = chosen[a] if same else cache.same_strategy(chosen[a], graph.op(b))
                infos.append(GroupSolve(name, len(group), ref_name, "reused", 0.0, 0.0, 0, 0))
                continue
            mirror: dict[int, int] = {}
            for other in copies[sigs[k]]:
                if other != k:
                    mirror.update(zip(groups[other][1], group))
            part, info = _solve_group(graph, mesh, group, context=chosen, pins=group_pins, mem_limit=math.inf,
                                      name=name, mirror=mirror, **kw)
            chosen.update(part)
            infos.append(info)
            done[reuse_key] = k
    return chosen, infos


# --------------------------------------------------------------------------------------------------------------
# Evaluation: the cost of a choice, recomputed operator by operator and edge by edge


#: Backward operators that end a weight-gradient chain (as do reductions that reduce elements): they combine their
#: input into a new value (an activation gradient reduced into a norm's scale gradient is not a weight gradient).
_CHAIN_ENDS = CONTRACTIONS | SCATTERS | WINDOWED


def weight_gradient_ops(graph: OpGraph, ops: Iterable[int]) -> set[int]:
    """Backward operators whose output reaches the optimizer (or leaves the step as a gradient) through layout and
    elementwise operators only: their collectives synchronise weight gradients.

    The chain stops at contractions and reductions: an activation gradient (say the tensor-parallel all-reduce of
    ``dX = dY @ W.T``) that a layer norm's scale gradient reduces (``sum(dX * x_hat)``) is on the critical path of
    the backward, not a data-parallel gradient reduction that may be deferred and overlapped; the reduction that
    follows it is the weight-gradient operator."""
    ends: dict[int, bool] = {}

    def ends_chain(node: OpNode) -> bool:
        if node.primitive in REDUCTIONS:  # a reduction over size-1 axes only is a reshape
            size = math.prod(graph.tensor(node.inputs[0]).shape) if node.inputs else 0
            return size > math.prod(graph.tensor(node.outputs[0]).shape)
        return node.primitive in _CHAIN_ENDS

    def reaches_update(op: int, depth: int) -> bool:
        if op in ends:
            return ends[op]
        node = graph.op(op)
        hit = False
        for t in node.outputs:
            for c in graph.consumers.get(t, ()):
                cn = graph.op(c)
                if cn.role == UPDATE or cn.primitive == OUTPUT_PRIMITIVE:
                    hit = True
                elif depth > 0 and cn.role == BACKWARD and not ends_chain(cn):
                    hit = reaches_update(c, depth - 1)
                if hit:
                    break
            if hit:
                break
        ends[op] = hit
        return hit

    ops = tuple(ops)
    memo = _graph_memo(graph, "weight_gradient_ops")  # a function of the graph alone, asked on every mesh
    hit = memo.get(ops)
    if hit is None:
        if len(memo) > 256:
            memo.clear()
        hit = memo[ops] = frozenset(op for op in ops if graph.op(op).role == BACKWARD and reaches_update(op, 4))
    return set(hit)


def evaluate_intra(graph: OpGraph, mesh: LogicalMesh, chosen: Mapping[int, Strategy], *,
                   ops: Sequence[int] | None = None, cache: StrategyCache | None = None, groups: tuple = (),
                   solve_s: float = 0.0) -> IntraPlan:
    """The :class:`IntraPlan` of a given choice: every term recomputed from the strategies and the edges."""
    attach_kernel_roles(graph)
    cache = cache or StrategyCache(mesh)
    ops = list(graph.ops if ops is None else ops)
    missing = [op for op in ops if op not in chosen]
    if missing:
        raise ValueError(f"no strategy chosen for operator {graph.op(missing[0]).describe()}")
    role_s = {FORWARD: 0.0, BACKWARD: 0.0, UPDATE: 0.0}
    compute = comm = reshard = sync = 0.0
    colls: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0.0})
    grads = weight_gradient_ops(graph, ops)
    for op in ops:
        s, node = chosen[op], graph.op(op)
        compute += s.compute_s
        comm += s.comm_s
        role_s[node.role] += s.cost
        if op in grads:
            sync += s.comm_s
        for kind, _axis, nbytes in s.collectives:
            if mesh_axis_size(mesh, _axis) > 1:
                colls[kind]["count"] += 1
                colls[kind]["bytes"] += nbytes
    convs = list(conversions(graph, ops, chosen, cache))
    for u, v, is_alias, t, src, dst, cost in convs:
        reshard += cost
        role_s[UPDATE if is_alias else graph.op(v).role] += cost
        for kind, _axis, nbytes in cache.reshard_collectives(src, dst, t.shape, t.dtype):
            colls[kind]["count"] += 1
            colls[kind]["bytes"] += nbytes
    static, act = _memory(graph, ops, chosen, mesh)
    static += sum(b for _v, b in held_copies(graph, convs, tuple(mesh.shape)).values())
    return IntraPlan(mesh, tuple(ops), dict(chosen), compute, comm, reshard, role_s, sync, static, act,
                     {k: dict(v) for k, v in colls.items()}, groups, solve_s)


def conversions(graph: OpGraph, ops: Sequence[int], chosen: Mapping[int, Strategy], cache: StrategyCache):
    """The resharding a choice costs: (producer, consumer, is_alias, tensor, src spec, dst spec, seconds) for every
    conversion with a cost, between operators both in ``ops``.

    A tensor converted to one spec is converted once, whatever the number of consumers that read the copy (the ILP's
    pairwise edges count it per consumer: an over-estimate this recomputation corrects, as XLA does).
    """
    seen: set[tuple] = set()
    for u, v, i, j, t, param in _internal_edges(graph, ops):
        if i == -1:  # alias: the update goes back to the parameter's spec
            src, dst = chosen[v].in_specs[0], chosen[u].out_specs[0]
        else:
            src, dst = chosen[u].out_specs[i], chosen[v].in_specs[j]
        # conversion_key(graph, u, v, t.id, src, dst, i == -1), with the parameter test read from the memo
        gathers = param and i != -1 and bool(src.axes - dst.axes)
        key = (t.id, src, dst, i == -1, v if gathers else None)
        if key in seen:
            continue
        seen.add(key)
        cost = cache.reshard(src, dst, t.shape, t.dtype)
        if cost:
            yield u, v, i == -1, t, src, dst, cost


def _internal_edges(graph: OpGraph, ops: Sequence[int]) -> tuple[tuple, ...]:
    """(u, v, i, j, tensor, whether u is a parameter input) for the edges of :func:`_edges_of` between operators both
    in ``ops``; remembered per graph and operator list (the planner evaluates the same plan's operators on every
    mesh, and per layer)."""
    memo = _graph_memo(graph, "internal_edges")
    key = tuple(ops)
    hit = memo.get(key)
    if hit is None:
        inside = set(key)
        rows = []
        for (u, v, i, j) in _edges_of(graph, key):
            if u not in inside or v not in inside:
                continue
            t = graph.tensor(graph.op(v).inputs[0] if i == -1 else graph.op(u).outputs[i])
            rows.append((u, v, i, j, t, is_param_input(graph, u)))
        if len(memo) > 256:
            memo.clear()
        hit = memo[key] = tuple(rows)
    return hit


def conversion_key(graph: OpGraph, u: int, v: int, tensor: int, src: ShardingSpec, dst: ShardingSpec,
                   is_alias: bool = False) -> tuple:
    """Which conversions of a tensor are one: readers of ``tensor`` (produced by ``u``) in the same spec share a
    conversion (XLA converts once and keeps the copy, measured by ``validate_plan``), except that a parameter stored
    sharded (ZeRO-3 / FSDP) is gathered for each reader ``v`` and freed after it: in forward, again in backward (a
    tied embedding: once for the lookup, once for the logits), as the ILP's per-reader edges count."""
    gathers = not is_alias and bool(src.axes - dst.axes) and is_param_input(graph, u)
    return (tensor, src, dst, is_alias, v if gathers else None)


def mesh_axis_size(mesh, axis) -> int:
    return mesh.axis_size(axis)


#: The kinds of static memory (held all step) :func:`memory_terms` and :func:`gathered_bytes` name, in stacking
#: order: the parameters as the step computes with them (a mixed-precision step's half-precision copy), their
#: gradients, fp32 master weights, optimizer state, copies of parameters kept all step (gathered from their
#: shards, or cast, sliced or transposed in the forward for the backward), and an FP8 format's FP8 weight copies.
STATIC_KINDS = ("param", "grad", "master", "opt", "copies", "fp8")


def memory_terms(graph: OpGraph, node: OpNode, s: Strategy, mesh_shape: tuple[int, ...],
                 fused_attention: bool = False):
    """The bytes per device one operator adds to a stage, term by term, as ``(kind, bytes)``.

    A parameter input: ``param`` and ``grad`` (as sharded), or for an fp32 master weight of a lower-precision step
    ``master`` (4 bytes), ``param`` and ``grad`` at the compute precision (the copy the step computes with and its
    gradient: 2 + 2 bytes for fp16/bf16, 16 bytes a parameter with Adam's two fp32 moments, as ZeRO counts); a
    number format that keeps gradients wider (bf16's fp32 gradients, :mod:`autopar_lab.precision`) says so on the
    input operator (``GRAD_BYTES``), and one with FP8 weight copies adds them as ``fp8`` (``FP8_COPY_BYTES``);
    optimizer state: ``opt``; a forward tensor the backward reads, as its kernel wrote it
    (:attr:`~autopar_lab.graph.fusion.KernelView.saved`: broadcasts and cheap elementwise work are recomputed, a
    flash-attention kernel keeps no scores): ``act``, or ``copies`` when computed from parameters alone (it does not
    grow with the microbatch). The one memory formula: the IntraPlan's totals and the per-layer costs of
    :mod:`autopar_lab.pricing` both add these terms, in this order."""
    view = kernel_view(graph, fused_attention)
    if node.primitive == INPUT_PRIMITIVE:
        t = node.outputs[0]
        kind = graph.tensor(t).kind
        if kind == PARAM:
            ratio = view.masters.get(t)
            wide = node.params.get(GRAD_BYTES)  # a format's gradient width, bytes per element (else the copy's)
            if ratio is None:
                yield "param", s.mem_bytes
                yield "grad", s.mem_bytes if wide is None else s.mem_bytes * wide / dtype_size(graph.tensor(t).dtype)
            else:
                yield "master", s.mem_bytes
                yield "param", s.mem_bytes * ratio
                yield "grad", s.mem_bytes * (ratio if wide is None else wide / dtype_size(graph.tensor(t).dtype))
            fp8 = node.params.get(FP8_COPY_BYTES)
            if fp8:
                yield "fp8", s.mem_bytes * fp8 / dtype_size(graph.tensor(t).dtype)
        elif kind == OPT_STATE:
            yield "opt", s.mem_bytes
        return
    if node.role != FORWARD:
        return
    for k, t in enumerate(node.outputs):
        if t not in view.saved:
            continue
        if t in view.weight_derived:
            if node.primitive == "convert_element_type" and graph.tensor(node.inputs[0]).id in view.masters:
                continue  # the compute copy of a master weight: counted with it
            kind = "copies"
        else:
            kind = "act"
        info = graph.tensor(t)
        yield kind, s.out_specs[k].bytes_per_device(info.shape, info.dtype, mesh_shape)


def gathered_bytes(graph: OpGraph, t, src: ShardingSpec, dst: ShardingSpec, mesh_shape: tuple[int, ...]) -> float:
    """Bytes per device of a parameter (or a tensor computed from parameters alone) gathered from a sharded ``src``
    into a larger ``dst`` copy that its readers use all step (weight-update sharding: ZeRO-2's gathered weights are
    kept from the forward to the backward, so that copy is live memory as well as the shard); 0 otherwise."""
    p = graph.tensor(t.id).producer
    if p is None:
        return 0.0
    is_weight = (graph.op(p).primitive == INPUT_PRIMITIVE and t.kind == PARAM) or \
        t.id in kernel_view(graph, False).weight_derived
    if not is_weight:
        return 0.0
    full, shard = dst.bytes_per_device(t.shape, t.dtype, mesh_shape), src.bytes_per_device(t.shape, t.dtype, mesh_shape)
    return float(full) if full > shard else 0.0


def held_copies(graph: OpGraph, convs, mesh_shape: tuple[int, ...]) -> dict[int, tuple[int, float]]:
    """tensor id -> (its first reader, bytes per device) of the gathered copies :func:`gathered_bytes` holds all
    step, from :func:`conversions`' rows ``convs``: one per tensor, the largest, however many readers gather it. A
    parameter stored sharded is gathered once per reader (:func:`conversion_key`, ZeRO-3 / FSDP), but the copy held
    is one: counting it per conversion would hold it twice for a weight read in forward and backward."""
    out: dict[int, tuple[int, float]] = {}
    for _u, v, is_alias, t, src, dst, _c in convs:
        b = 0.0 if is_alias else gathered_bytes(graph, t, src, dst, mesh_shape)
        if b and b > out.get(t.id, (v, 0.0))[1]:
            out[t.id] = (out.get(t.id, (v, 0.0))[0], b)
    return out


def _memory(graph: OpGraph, ops: Sequence[int], chosen: Mapping[int, Strategy], mesh) -> tuple[float, float]:
    """(static, activation) bytes per device: the sum of :func:`memory_terms` over ``ops``."""
    mshape = tuple(mesh.shape)
    fused = mesh.cluster.device.efficiency.flash_attention
    static = act = 0.0
    for op in ops:
        for kind, nbytes in memory_terms(graph, graph.op(op), chosen[op], mshape, fused):
            if kind == "act":
                act += nbytes
            else:
                static += nbytes
    return static, act
