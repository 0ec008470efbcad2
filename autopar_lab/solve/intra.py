"""Alpa's intra-operator pass on an operator graph: per-operator strategies, resharding edges, the ILP.

:func:`build_problem` turns the operators of an :class:`~autopar_lab.graph.opgraph.OpGraph` and a logical mesh into
an :class:`~autopar_lab.solve.ilp.IntraProblem`: one node per operator with its strategies
(:func:`~autopar_lab.sharding.strategies.strategies_for`), one edge per producer -> consumer pair with the resharding
cost of every (producer strategy, consumer strategy) pair, and an extra edge from every updated parameter back to the
parameter it replaces (the step's outputs alias its inputs, so a parameter kept sharded differently from its update
pays the conversion once per step: this is how weight-update sharding, ZeRO-2 style, is a choice the ILP makes).

:func:`solve_intra` solves it. Transformer layers repeat, so by default (``IntraOptions.reuse_layers``) it solves each
structurally distinct layer once and gives every identical layer the same strategies; layers are solved in forward
order and each sees the strategies already chosen for its neighbours, so a layer agrees with the one before it.
``IntraOptions(reuse_layers=False)`` solves the whole graph as one ILP (the reference the reuse is measured against).

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

import dataclasses
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

from ..backends import read_again_s
from ..graph.opgraph import (
    BACKWARD,
    FORWARD,
    INPUT_PRIMITIVE,
    OPT_STATE,
    OUTPUT_PRIMITIVE,
    PARAM,
    UPDATE,
    OpGraph,
    OpNode,
)
from ..graph.fusion import attach_kernel_roles
from ..graph.opcost import CONTRACTIONS, REDUCTIONS, SCATTERS, WINDOWED
from ..sharding.fsdp import is_param_input
from ..sharding.spec import ShardingSpec
from ..sharding.strategies import Strategy
from . import ilp
from .intracache import StrategyCache, graph_memo, layer_signature, shared_lists
from .memterms import gathered_param_terms, held_copies, liveness, memory_totals

if TYPE_CHECKING:
    from ..cluster import LogicalMesh

MEMORY_TIE_BREAK_S_PER_BYTE = 1e-15

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


@dataclass(frozen=True, kw_only=True)
class IntraOptions:
    """How :func:`solve_intra` solves (the problem itself is the graph, the mesh, the pins and the memory limit).

    ``solver``: the ILP backend (:func:`~autopar_lab.solve.ilp.solve_ilp`), ``time_limit`` its seconds per ILP.
    ``merge``: Alpa's follower merging (smaller ILPs, possibly worse plans: see
    :func:`autopar_lab.solve.ilp.merge_followers`). ``reuse_layers``: solve each structurally distinct layer once
    (default) or the whole graph as one ILP. ``axes``: on a mesh with two axes of more than one device,
    ``"joint"`` searches both axes' splits in one ILP (every strategy of every operator: exact, but the ILP grows
    with the square of the strategy counts), while ``"sequential"`` first solves with axis 0 alone, then lets the
    ILP choose axis 1's splits among the strategies that keep axis 0's (two small ILPs; the plan data x tensor
    parallelism naturally has). ``"auto"`` is sequential when both axes are split, joint otherwise.
    ``bench/bench_intra.py`` measures what it costs. ``rounds``: with layer reuse, how many times each group is
    solved in turn, each time seeing its neighbours' latest strategies (coordinate descent; the second round
    repairs boundaries the first could not see).

    >>> IntraOptions().with_solver("highs", rounds=1)
    IntraOptions(solver='highs', time_limit=None, merge=False, reuse_layers=True, axes='auto', rounds=1)
    """

    solver: str = "cbc"
    time_limit: float | None = None
    merge: bool = False
    reuse_layers: bool = True
    axes: str = "auto"
    rounds: int = 2

    def with_solver(self, solver: str, *, rounds: int | None = None) -> IntraOptions:
        """These options with another ILP backend (and, when given, another number of rounds)."""
        return dataclasses.replace(self, solver=solver, rounds=self.rounds if rounds is None else rounds)

    def with_axes(self, axes: str) -> IntraOptions:
        return dataclasses.replace(self, axes=axes)


@dataclass(frozen=True)
class _Group:
    """One group of operators to solve (a layer, the layers that do not repeat, or the whole graph): its name, its
    operators, the strategies already decided around it, its pins, and the operators of its identical copies
    mapped onto its own (``mirror``, see :func:`build_problem`)."""

    name: str
    ops: Sequence[int]
    context: Mapping[int, Strategy]
    pins: Mapping[int, Any]
    mirror: Mapping[int, int] = field(default_factory=dict)


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


def _names(graph: OpGraph, nodes: Sequence[int]) -> tuple[str, ...]:
    """The ILP's node names (for its messages), each operator's described once per graph: the planner builds a
    problem over the same operators on every mesh."""
    memo = graph_memo(graph, "describe")
    out = []
    for op in nodes:
        name = memo.get(op)
        if name is None:
            name = memo[op] = graph.op(op).describe()
        out.append(name)
    return tuple(out)



# --------------------------------------------------------------------------------------------------------------
# The problem


def _edges_of(graph: OpGraph, ops: Iterable[int]) -> list[tuple[int, int, int, int]]:
    """(producer, consumer, producer output index, consumer input index) for every tensor read, plus alias edges
    (updated parameter -> parameter: producer is the parameter op, consumer the output op, indices -1)."""
    memo = graph_memo(graph, "in_edges")
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
    :class:`IntraOptions`).

    Each edge is priced on its own (Alpa's pairwise formulation): a value that several readers read in one other
    layout is charged its conversion once per reader, where the plan's price (:func:`evaluate_intra`, through
    :func:`conversions`) and XLA convert it once. The objective is so an upper bound on the price of the plan it
    chooses, above it by the conversions those readers share; the ILP decides on the bound (a formulation that
    prices a shared conversion once, a node per value and layout, weakened the LP relaxation and doubled planning
    time).
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
            k = index[op]
            q = strategy_index(pin, strats[k], graph.op(op))
            if op in inside:
                # A pinned operator's other strategies can never be chosen: its node carries the pinned one alone,
                # so its edges are priced for that strategy only (the reductions would drop the rest anyway).
                strats[k], q = cache.single(strats[k][q]), 0
            pin_idx[k] = q
    node_costs = [cache.costs(ss) for ss in strats]
    # Keeping a parameter or optimizer state whole costs no time when its readers slice it locally, but it costs
    # memory: among plans equally fast, prefer the one that stores step inputs sharded (a tie-break, 1e-15 s per byte).
    for k, op in enumerate(nodes):
        if op in inside and graph.op(op).primitive == INPUT_PRIMITIVE and \
                graph.tensor(graph.op(op).outputs[0]).kind in (PARAM, OPT_STATE):
            node_costs[k] = node_costs[k] + MEMORY_TIE_BREAK_S_PER_BYTE * np.array([s.mem_bytes for s in strats[k]])
    # An output a later layer of the same program reads again (backends: 0 but on the CPU) costs one reading here:
    # the stage DP decides afterwards how many layers share a program and charges the rest.
    for k, op in enumerate(nodes):
        again = read_again_s(mesh, graph, graph.op(op), strats[k]) if op in inside else None
        if again is not None:
            node_costs[k] = node_costs[k] + np.array(again)
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
        live = liveness(graph, nodes)
        terms = gathered_param_terms(graph, nodes, strats, tuple(mesh.shape))
    problem = ilp.IntraProblem(
        node_costs=tuple(node_costs),
        edges=tuple(edges), edge_costs=tuple(mats), node_mem=node_mem, live=live, mem_limit=mem_limit_bytes,
        pins=pin_idx, names=_names(graph, nodes), mem_terms=terms,
    )
    return _Built(problem, nodes, strats)


# --------------------------------------------------------------------------------------------------------------
# Solving


def _solve_group(graph, mesh, group: _Group, *, mem_limit, cache, options: IntraOptions, restrict):
    ops, name = group.ops, group.name
    built = build_problem(graph, mesh, ops, context=group.context, pins=group.pins, mem_limit_bytes=mem_limit,
                          cache=cache, mirror=group.mirror, restrict=restrict)
    problem, merges = built.problem, 0
    record = None
    inside = set(ops)
    if options.merge:
        mergeable = [graph.op(op).primitive in _MERGEABLE and op in inside for op in built.nodes]
        problem, record = ilp.merge_followers(problem, mergeable)
        merges = len(built.nodes) - problem.num_nodes
    sol = ilp.solve_ilp(problem, solver=options.solver, time_limit=options.time_limit)
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
        self.num_devices = mesh.num_devices  # the program still runs on all of them (backends.kernel_share)

    def axis_size(self, axis) -> int:
        return self.shape[0] if axis in (0, (0, 1)) else 1

    def __getattr__(self, kind):  # all_gather, reduce_scatter, all_reduce, all_to_all: axis 0's links
        fn = getattr(self._mesh, kind)
        return lambda nbytes, axis: fn(nbytes, 0) if axis in (0, (0, 1)) else 0.0


def solve_intra(graph: OpGraph, mesh: LogicalMesh, ops: Sequence[int] | None = None, *, pins: Mapping[int, Any] = {},
                mem_limit_bytes: float | None = None, options: IntraOptions = IntraOptions(),
                cache: StrategyCache | None = None, memo: dict | None = None) -> IntraPlan:
    """Choose a strategy for every operator in ``ops`` (default: the whole graph) on ``mesh``.

    ``pins`` fix operators' strategies; the ILP solves the rest around them. ``mem_limit_bytes`` (per device) adds
    Alpa's memory constraint over program points; it is applied to the whole graph as one ILP, since the layers'
    memory adds up. ``options`` (:class:`IntraOptions`): the backend, follower merging, layer reuse, how a
    two-axis mesh is searched, the rounds of coordinate descent.

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
    if options.axes not in ("auto", "joint", "sequential"):
        raise ValueError(f"axes must be 'auto', 'joint' or 'sequential', got {options.axes!r}")
    chosen, infos = _choose(graph, mesh, ops, pins=pins, mem_limit=mem_limit, options=options, cache=cache, memo=memo)
    return evaluate_intra(graph, mesh, chosen, ops=ops, cache=cache, groups=tuple(infos),
                          solve_s=time.perf_counter() - t0)


def _choose(graph: OpGraph, mesh, ops: list[int], *, pins: Mapping[int, Any], mem_limit: float, options: IntraOptions,
            cache: StrategyCache, memo: dict | None) -> tuple[dict[int, Strategy], list[GroupSolve]]:
    """:func:`solve_intra`'s choice of strategies and its groups' solves, without the plan's evaluation (which the
    sequential solve's first pass does not need: it keeps only the strategies)."""
    restrict: dict[int, tuple] = {}
    two_axes = mesh.shape[0] > 1 and mesh.shape[1] > 1
    if two_axes and options.axes in ("auto", "sequential"):
        key = ("first pass", tuple(ops), mesh.axis_profile(0), options.reuse_layers, options.merge, options.solver,
               options.time_limit, options.rounds)
        if memo is None or key not in memo:
            view: Any = _OneAxisView(mesh)  # axis 0 alone, standing in for a LogicalMesh
            vcache = StrategyCache(view)
            first, _ = _choose(graph, view, ops, pins={}, mem_limit=math.inf, options=options.with_axes("joint"),
                               cache=vcache, memo=None)
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
    kw: dict[str, Any] = dict(cache=cache, options=options, restrict=restrict)
    chosen: dict[int, Strategy] = {}
    infos: list[GroupSolve] = []
    if not options.reuse_layers or math.isfinite(mem_limit):
        chosen, info = _solve_group(graph, mesh, _Group("(whole graph)", ops, {}, pins), mem_limit=mem_limit, **kw)
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
        if options.rounds > 1 and any(len(c) > 1 for c in copies.values()) and len(copies) > 1:
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
            part, info = _solve_group(graph, mesh, _Group(name, group, chosen, group_pins, mirror), mem_limit=math.inf,
                                      **kw)
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
    memo = graph_memo(graph, "weight_gradient_ops")  # a function of the graph alone, asked on every mesh
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
    static, act = memory_totals(graph, ops, chosen, mesh)
    static += sum(b for _v, b in held_copies(graph, convs, tuple(mesh.shape)).values())
    return IntraPlan(mesh, tuple(ops), dict(chosen), compute, comm, reshard, role_s, sync, static, act,
                     {k: dict(v) for k, v in colls.items()}, groups, solve_s)


def conversions(graph: OpGraph, ops: Sequence[int], chosen: Mapping[int, Strategy], cache: StrategyCache):
    """The resharding a choice costs: (producer, consumer, is_alias, tensor, src spec, dst spec, seconds) for every
    conversion with a cost, between operators both in ``ops``.

    A tensor converted to one spec is converted once, whatever the number of consumers that read the copy (the ILP's
    pairwise edges count it per consumer: an upper bound this recomputation corrects, as XLA does; see
    :func:`conversion_key` for the one exception). This is the one place a plan's conversions are listed: the
    plan's ``reshard_s`` and ``collectives``, the layer costs, the cost panel and explain() read them from here, and
    ``validate.predicted_collectives`` dedupes by the same :func:`conversion_key`.
    """
    seen: set[tuple] = set()
    for u, v, i, j, t, param in _internal_edges(graph, ops):
        if i == -1:  # alias: the update goes back to the parameter's spec
            src, dst = chosen[v].in_specs[0], chosen[u].out_specs[0]
        else:
            src, dst = chosen[u].out_specs[i], chosen[v].in_specs[j]
        if src is dst:  # no conversion (specs are interned: most unconverted edges end here, before any hashing)
            continue
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
    memo = graph_memo(graph, "internal_edges")
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
