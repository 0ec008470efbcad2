"""Operator pins that make a mesh's intra-op plan a framework's layout; the ILP decides everything else around them.

From the roles of :mod:`~autopar_lab.layouts.roles` and the axes of :class:`~autopar_lab.layouts.config.MeshRoles`:

* a ``column`` matmul (and the ``head``) reads its weight split by output features over the tensor axis and its
  input whole over it, communicating nothing; a ``row`` matmul reads its weight split by input features and its input
  split alike, and all-reduces its partial sums over the tensor axis (with sequence parallelism, Korthikanti et al.
  2023, it reduce-scatters them onto the sequence instead, :mod:`autopar_lab.sharding.seqpar`); a ``duplicated`` one
  reads its weight whole (Megatron-LM keeps MLA's down-projections and routers whole on every rank); every such matmul
  splits its input's batch over the batch axes;
* the backward matmuls that read a weight (its data gradient, a recomputed forward) read the same shard;
* attention's scores and context split the batch over the batch axes and the heads (their second batch dimension)
  over the tensor axis, or with a context axis run as a ring over it (:mod:`autopar_lab.sharding.ring`);
* the embedding's lookup reads its table split by vocabulary over the tensor axis (an all-reduce of the rows found);
* an expert matmul reads its experts split over the expert axes (whole without expert parallelism), and a token
  dispatch or combine written as a matmul keeps the tokens' batch split, so that the tokens reach the experts by an
  all-to-all (GShard's, Lepikhin et al. 2021);
* with a ``storage`` (a ZeRO stage, or :data:`LEAN`), every parameter and optimizer state is stored as the layout
  says: split like its readers over the tensor axis (a column matmul's bias by its output) and, by the ZeRO stage,
  over the data-parallel group too (:func:`~autopar_lab.sharding.fsdp.fsdp_spec`): 1 and 2 the optimizer state,
  3 and :data:`LEAN` (the least the layout allows) the parameters as well. Without one the storage stays the ILP's.

A role whose wanted strategy does not exist on the mesh (a dimension the axis does not divide: GQA with more
tensor-parallel ranks than KV heads splits no KV head, so K and V stay whole there, as Megatron-LM keeps them) is left
to the ILP and named in :attr:`Pinned.free`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Collection, Sequence

from ..graph.opgraph import BACKWARD, INPUT_PRIMITIVE, PARAM, OpGraph
from ..sharding.fsdp import fsdp_spec
from ..sharding.ring import is_ring, ring_axes_used
from ..sharding.spec import ShardingSpec
from .config import MeshRoles
from .roles import MatmulRole, Roles, opt_states_of, weight_source

__all__ = ["LEAN", "Pinned", "layout_pins", "stored_specs", "zero_spec_on_split_dim"]

#: The storage of a stage that overflows with its state as the ILP keeps it: every parameter and optimizer state
#: split over the tensor axis as its readers want and over the data-parallel group (ZeRO-3 storage, the least).
LEAN = "lean"


@dataclass(frozen=True)
class Pinned:
    """``pins`` (operator -> Strategy, for :func:`~autopar_lab.solve.intra.solve_intra`) and ``free``: the labels of
    the roles no strategy on the mesh could pin (left to the ILP)."""

    pins: dict[int, Any]
    free: tuple[str, ...]


def _spec(rank: int, splits: dict[int, tuple[int, ...]]) -> ShardingSpec:
    return ShardingSpec(tuple(tuple(splits.get(d, ())) for d in range(rank)))


def _pick(strats: Sequence[Any], *tests: Callable[[Any], bool]) -> Any:
    """The cheapest strategy passing the first test any strategy passes (None if none does)."""
    for ok in tests:
        fits = [s for s in strats if ok(s)]
        if fits:
            return min(fits, key=lambda s: s.cost)
    return None


class _Pinner:
    def __init__(self, graph: OpGraph, roles: Roles, axes: MeshRoles, cache, sequence_parallel: bool):
        self.g, self.roles, self.axes, self.cache = graph, roles, axes, cache
        self.ta = axes.tensor if axes.tensor_size > 1 else None
        self.batch = axes.useful(axes.batch)
        self.ca = axes.context if axes.context is not None and axes.shape[axes.context] > 1 else None
        self.experts = None if axes.experts is None else axes.useful(axes.experts)
        self.sp = sequence_parallel and self.ta is not None
        self.pins: dict[int, Any] = {}
        self.free: list[str] = []
        self.whole: set[int | None] = set()  # Q, K, V weights kept whole (more tensor-parallel ranks than KV heads)

    def batch_ok(self, spec: ShardingSpec, dim: int = 0) -> bool:
        """The batch (dimension ``dim``) split over the batch axes exactly (whole without any)."""
        return spec.dims[dim] == self.batch if self.batch else self.ta not in spec.dims[dim]

    def no_tensor(self, spec: ShardingSpec) -> bool:
        return self.ta is None or self.ta not in spec.axes

    def only(self, spec: ShardingSpec, dim: int | None, axes: tuple[int | None, ...]) -> bool:
        """``spec`` splits ``dim`` over exactly ``axes`` and uses none of them elsewhere."""
        if dim is None:
            return False
        return spec.dims[dim] == axes and all(a not in d for k, d in enumerate(spec.dims) if k != dim for a in axes)

    def reduced(self, s, kind: str) -> bool:
        """``s`` runs one collective, a ``kind`` over the tensor axis."""
        return len(s.collectives) == 1 and s.collectives[0][0] == kind and s.collectives[0][1] == self.ta

    def onto_sequence(self, s) -> bool:
        """``s``'s output is split along the sequence (its second dimension) over the tensor axis."""
        out = s.out_specs[0]
        return len(out.dims) > 1 and out.dims[1] == (self.ta,)

    def pin(self, op: int, label: str, *tests: Callable[[Any], bool]) -> None:
        s = _pick(self.cache.strategies(self.g.op(op)), *tests)
        if s is None:
            self.free.append(label)
        else:
            self.pins[op] = s

    # -- the roles ---------------------------------------------------------------------------------------------
    def weight_matmul(self, r: MatmulRole) -> None:
        ta, w = self.ta, r.weight
        assert w is not None
        x = 1 - w
        if r.kind == "duplicated":
            self.pin(r.op, r.label, lambda s: self.no_tensor(s.in_specs[w]) and self.batch_ok(s.in_specs[x])
                     and not s.collectives)
            return
        if r.split is None:
            self.free.append(r.label)
            return
        want = (ta,)
        tests: list[Callable[[Any], bool]]
        if r.kind == "row":
            tests = [lambda s: self.only(s.in_specs[w], r.split, want) and self.batch_ok(s.in_specs[x])
                     and self.reduced(s, "all_reduce")]
            if self.sp:  # the sum reduce-scattered onto the sequence
                tests.insert(0, lambda s: self.only(s.in_specs[w], r.split, want) and self.batch_ok(s.in_specs[x])
                             and self.reduced(s, "reduce_scatter") and self.onto_sequence(s))
            self.pin(r.op, r.label, *tests)
        else:  # column, head
            self.pin(r.op, r.label, lambda s: self.only(s.in_specs[w], r.split, want) and
                     self.batch_ok(s.in_specs[x]) and not s.collectives)
            if self.sp:
                self.sequence_input(r)

    def sequence_input(self, r: MatmulRole) -> None:
        """With sequence parallelism, the operator making a column matmul's input (a layer norm's output) keeps it
        split along the sequence; the matmul gathers it (Korthikanti et al. 2022, section 4.2.2: the gathered input
        is not kept, the backward gathers it again). Left to the ILP, the time-optimal plan may gather earlier (before
        the layer norm, one collective either way) and keep the norm's activations whole on every rank: t times the
        bytes Megatron-LM keeps. Nothing is pinned where the producer has no such strategy (a 2D input)."""
        assert r.weight is not None
        u = self.g.tensor(self.g.op(r.op).inputs[1 - r.weight]).producer
        if u is None or u in self.pins or self.g.op(u).primitive == INPUT_PRIMITIVE:
            return
        s = _pick(self.cache.strategies(self.g.op(u)),
                  lambda s: len(s.out_specs[0].dims) > 2 and self.only(s.out_specs[0], 1, (self.ta,))
                  and self.batch_ok(s.out_specs[0]))
        if s is not None:
            self.pins[u] = s

    def whole_heads(self, r: MatmulRole) -> str:
        """For a projection into attention whose heads the tensor axis cannot split (GQA with more tensor-parallel
        ranks than KV heads): "kv" when it makes K or V (the attention operand without the query's group
        dimension: Megatron-LM replicates those heads), "q" when it makes Q (its heads sit under the KV heads'
        dimension here, which the axis cannot split either: left to the ILP); "" when the heads split."""
        g, n = self.g, self.axes.tensor_size
        short = []
        for a, j in r.feeds:
            node = g.op(a)
            _, bdims = node.params["dimension_numbers"]
            if len(bdims[j]) > 1 and int(node.in_shapes[j][bdims[j][1]]) % n:
                short.append(len(node.in_shapes[j]) < len(node.in_shapes[1 - j]))
        if not short:
            return ""
        return "kv" if all(short) else "q"

    def whole_operand(self, s, j: int) -> bool:
        return self.no_tensor(s.in_specs[j])

    def same_shard(self, s, j: int, d: int) -> bool:
        """Operand ``j`` split along its dimension ``d`` over the tensor axis, and nowhere else over it."""
        return self.only(s.in_specs[j], d, (self.ta,))

    def data_grad(self, s, j: int, d: int) -> bool:
        """:meth:`same_shard`, its partial sums all-reduced (reduce-scattered onto the sequence with sequence
        parallelism)."""
        if not self.same_shard(s, j, d):
            return False
        return self.reduced(s, "reduce_scatter") and self.onto_sequence(s) if self.sp else self.reduced(s, "all_reduce")

    def backward_readers(self, r: MatmulRole) -> None:
        """The backward matmuls reading ``r``'s weight read the same shard."""
        pd = r.param_dim
        for op in self.readers.get(r.param, ()) if r.param is not None else ():
            node = self.g.op(op)
            for j, t in enumerate(node.inputs):
                p, dims = weight_source(self.g, t)
                if p != r.param:
                    continue
                if r.kind == "duplicated":
                    self.pin(op, f"{r.label} (backward)", partial(self.whole_operand, j=j))
                elif pd is not None and pd in dims:
                    d = dims.index(pd)
                    tests: list[Callable[[Any], bool]] = [partial(self.same_shard, j=j, d=d)]
                    (lc, rc), _ = node.params["dimension_numbers"]
                    if d in (lc, rc)[j]:
                        # a column matmul's data gradient: partial sums over the tensor axis, all-reduced (Megatron-LM's
                        # f operator), or reduce-scattered onto the sequence with sequence parallelism
                        tests.insert(0, partial(self.data_grad, j=j, d=d))
                    self.pin(op, f"{r.label} (backward)", *tests)
                break

    def attention(self, r: MatmulRole) -> None:
        node = self.g.op(r.op)
        _, (lb, rb) = node.params["dimension_numbers"]
        bdims = (lb, rb)
        if self.ca is not None:
            self.pin(r.op, r.label, lambda s: is_ring(s) and ring_axes_used(s) == (self.ca,) and
                     all(self.batch_ok(s.in_specs[i], bdims[i][0]) for i in (0, 1)))
        elif self.ta is not None and r.split is not None:
            self.pin(r.op, r.label, lambda s: not s.collectives and all(
                self.batch_ok(s.in_specs[i], bdims[i][0]) and s.in_specs[i].dims[bdims[i][1]] == (self.ta,)
                for i in (0, 1)))

    def embedding(self, r: MatmulRole) -> None:
        self.pin(r.op, r.label, lambda s: self.only(s.in_specs[0], 0, (self.ta,)) and self.batch_ok(s.in_specs[1]))

    def expert(self, r: MatmulRole) -> None:
        """The experts split over the expert axes (whole without), and over none of the other data axes."""
        w, d = r.weight, r.split
        assert w is not None and d is not None and self.experts is not None
        others = [a for a in self.batch if a not in self.experts]
        self.pin(r.op, r.label, lambda s: s.in_specs[w].dims[d] == self.experts and
                 not any(a in s.in_specs[w].axes for a in others))

    def dispatch(self, r: MatmulRole) -> None:
        """A token dispatch or combine keeps the tokens' batch split (its first batch dimension)."""
        _, bdims = self.g.op(r.op).params["dimension_numbers"]
        if bdims[0]:
            self.pin(r.op, r.label, lambda s: not s.collectives and all(
                self.batch_ok(s.in_specs[i], bdims[i][0]) for i in (0, 1)))

    def run(self) -> None:
        g, blocks = self.g, set(self.roles.blocks)
        self.readers: dict[int, list[int]] = {}
        if self.ta is not None:
            for node in g:
                if node.role == BACKWARD and node.primitive == "dot_general":
                    for t in node.inputs:
                        p, _ = weight_source(g, t)
                        if p is not None:
                            self.readers.setdefault(p, []).append(node.id)
        for r in self.roles.matmuls.values():
            in_block = g.op(r.op).layer in blocks
            if r.kind in ("expert", "dispatch"):
                if self.experts:  # (None: the ILP's choice; whole experts: the tokens' exchange is the ILP's too)
                    self.dispatch(r) if r.kind == "dispatch" else self.expert(r)
                elif self.experts is not None and r.kind == "expert":
                    self.expert(r)
            elif r.kind == "attention" and in_block:
                self.attention(r)
            elif self.ta is None:
                continue
            elif r.kind == "embedding":
                self.embedding(r)
            elif r.kind == "head" or (in_block and r.kind in ("column", "row", "duplicated")):
                heads = self.whole_heads(r) if r.kind == "column" else ""
                if heads:  # stored whole over the tensor axis (the readers may still slice it)
                    self.whole.add(r.param)
                if heads == "q":
                    self.free.append(r.label)
                    continue
                if heads == "kv":  # K and V whole on every tensor-parallel rank
                    r = dataclasses.replace(r, kind="duplicated", split=None)
                self.weight_matmul(r)
                self.backward_readers(r)


def stored_specs(graph: OpGraph, roles: Roles, axes: MeshRoles, storage,
                 whole: Collection[int | None] = ()) -> dict[int, ShardingSpec]:
    """Parameter and optimizer-state input operator -> its stored spec under ``storage`` (a ZeRO stage 0-3 or
    :data:`LEAN`; see the module docstring); the parameters in ``whole`` are not split over the tensor axis."""
    mshape = tuple(axes.shape)
    ta = axes.tensor if axes.tensor_size > 1 else None
    experts = axes.useful(axes.experts or ())
    blocks = set(roles.blocks)
    states = opt_states_of(graph)
    out: dict[int, ShardingSpec] = {}
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive != INPUT_PRIMITIVE:
            continue
        info = graph.tensor(node.outputs[0])
        if info.kind != PARAM or not info.shape:
            continue
        shape, rank = tuple(info.shape), len(info.shape)
        pr = roles.params.get(op)
        splits: dict[int, tuple[int, ...]] = {}
        if pr is not None and pr.dim is not None and op not in whole:
            reader = roles.matmuls.get(next((r.op for r in roles.matmuls.values() if r.param == op), -1))
            in_block = reader is None or graph.op(reader.op).layer in blocks or pr.kind in ("head", "embedding")
            if pr.kind == "expert" and experts:
                splits[pr.dim] = experts
            elif ta is not None and pr.kind in ("column", "row", "head", "embedding") and in_block:
                splits[pr.dim] = (ta,)
        tp_spec = _spec(rank, splits)
        if not tp_spec.is_valid(shape, mshape):
            tp_spec = _spec(rank, {})
        zero_axes = tuple(a for a in axes.useful(axes.zero) if a not in tp_spec.axes)
        sharded = fsdp_spec(tp_spec, shape, mshape, zero_axes) or \
            zero_spec_on_split_dim(tp_spec, shape, mshape, zero_axes)
        out[op] = sharded if storage in (3, LEAN) else tp_spec
        for st in states.get(op, ()):
            out[st] = sharded if storage in (1, 2, 3, LEAN) else tp_spec
    return out


def zero_spec_on_split_dim(spec: ShardingSpec, shape, mesh_shape, axes: tuple[int, ...]) -> ShardingSpec:
    """``spec`` with ``axes`` added to a dimension it already splits, where that divides (a column matmul's bias:
    ZeRO shards a flat buffer, so every parameter is divided); ``spec`` itself when none does."""
    for d, dim in enumerate(spec.dims):
        if dim and axes:
            cand = ShardingSpec(tuple(tuple(sorted(set(x) | set(axes))) if i == d else x
                                      for i, x in enumerate(spec.dims)))
            if cand.is_valid(tuple(shape), tuple(mesh_shape)):
                return cand
    return spec


def layout_pins(graph: OpGraph, roles: Roles, axes: MeshRoles, cache, *, storage=None,
                sequence_parallel: bool = False, roles_pinned: bool = True) -> Pinned:
    """The pins of a layout on a mesh (``cache``: the mesh's :class:`~autopar_lab.solve.intra.StrategyCache`); see
    the module docstring. ``storage``: None (left to the ILP), a ZeRO stage 0-3 or :data:`LEAN`;
    ``roles_pinned``: False pins the storage only (the operators' sharding is the ILP's)."""
    p = _Pinner(graph, roles, axes, cache, sequence_parallel)
    if roles_pinned:
        p.run()
    if storage is not None:
        for op, spec in stored_specs(graph, roles, axes, storage, p.whole).items():
            strats = cache.strategies(graph.op(op))
            s = next((s for s in strats if s.out_specs and s.out_specs[0] == spec), None)
            if s is not None:
                p.pins[op] = s
            else:
                p.free.append(f"{graph.tensor(graph.op(op).outputs[0]).path} (storage)")
    return Pinned(p.pins, tuple(dict.fromkeys(p.free)))

