"""Per-operator sharding strategies: Alpa's intra-operator search space.

A :class:`Strategy` of an operator fixes the spec of each output, the spec it needs each input in, and the
collectives it runs itself (a contraction over a split dimension leaves partial sums: an all-reduce, or a
reduce-scatter). :func:`strategies_for` lists the strategies of one :class:`~autopar_lab.graph.opgraph.OpNode` on a
logical mesh, priced:

- ``compute_s``: one device's share of the kernel the operator runs in (:func:`kernel_time`): the roofline
  ``max(flops / n_work / achievable FLOP/s, bytes / achievable bandwidth)``, where ``n_work`` is the number of devices
  the work is divided over (the product of the sizes of every mesh axis any of its specs splits) and ``bytes`` the
  bytes its kernel moves for it (:mod:`autopar_lab.graph.fusion`: fused neighbours' tensors move none), plus the
  FP8 cast kernels a number format gives it (:func:`cast_time`);
- ``comm_s``: the sum of its collectives on the mesh (alpha-beta, see :mod:`autopar_lab.cluster`);
- ``mem_bytes``: bytes of its output shards on one device.

Most rules are one of two shapes, both public so a custom rule can use them:

- :func:`contraction_strategies`: an "iteration space" of named dimensions (for a matmul: batch, i, j, k), each
  tensor maps its dimensions onto it, splitting a reduced dimension leaves partial outputs;
- :func:`follow_strategies`: outputs and inputs share a spec on the dimensions they have in common (elementwise,
  slicing, sorting ...), the other dimensions stay replicated.

Both enumerate splits of at most two dimensions, each useful mesh axis (size > 1) used at most once:
``1 + 3r + r(r-1)`` candidates for ``r`` splittable dimensions on a 2D mesh, ``r + 1`` on a mesh with one useful
axis. Counts therefore stay small on 1D meshes (a matmul has 5: RR, i, j, k with all-reduce, k with reduce-scatter)
and grow on 2D ones (on 2 x 4: a plain matmul 23, a batched attention matmul up to 45, an elementwise op on a
rank-2 tensor 9, rank 3: 16, rank 4: 25). Contractions split only one representative of each kind of dimension
(the first lhs-free, rhs-free and contracting dimension that divides the mesh; at most two batch dimensions).
Strategies that would need padding are dropped; duplicates (same specs) keep the cheapest.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from autopar_lab.graph.capture import trace
    >>> from autopar_lab.cluster import Cluster
    >>> mesh = Cluster.preset("p3.16xlarge").logical_mesh((1, 8), (1, 8))
    >>> g = trace(lambda x, w: x @ w, jax.ShapeDtypeStruct((64, 256), jnp.float32),
    ...           jax.ShapeDtypeStruct((256, 1024), jnp.float32))
    >>> sorted(s.name for s in strategies_for(g.op(2), mesh))  # doctest: +NORMALIZE_WHITESPACE
    ['RR = RR x RR', 'RR = RS1 x S1R [all_reduce@1]', 'RS1 = RR x RS1', 'S1R = RS1 x S1R [reduce_scatter@1]',
     'S1R = S1R x RR']
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..graph import opcost
from ..graph.fusion import kernel_role
from ..graph.opgraph import FP8_CASTS, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, OpGraph, OpNode, op_signature
from .reshard import Collective, collective_time
from .ring import RING_KIND, ring_exposed_s, ring_variants
from .spec import ShardingSpec, assignments, useful_axes

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Strategy:
    """One way to run an operator on a logical mesh.

    ``collectives`` are ``(kind, mesh axis, bytes of the full buffer)`` with kind one of ``COLLECTIVE_KINDS`` and
    axis 0, 1 or (0, 1). Rules may leave ``compute_s``, ``comm_s`` and ``mem_bytes`` at 0: :func:`strategies_for`
    prices every strategy.

    >>> s = Strategy("S0R = S0R x RR", (ShardingSpec.parse("S0R"),), (ShardingSpec.parse("S0R"), ShardingSpec.parse("RR")),
    ...              compute_s=2.0, comm_s=0.5)
    >>> s.cost
    2.5
    """

    name: str
    out_specs: tuple[ShardingSpec, ...]
    in_specs: tuple[ShardingSpec, ...]
    collectives: tuple[Collective, ...] = ()
    compute_s: float = 0.0
    comm_s: float = 0.0
    mem_bytes: float = 0.0

    @property
    def cost(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def key(self) -> tuple:
        """What makes two strategies the same choice for the ILP: their specs."""
        return (self.out_specs, self.in_specs)

    def __str__(self) -> str:
        return self.name


Rule = Callable[[OpNode, Any], Iterable[Strategy]]
_RULES: dict[str, Rule] = {}


def register_rule(primitive: str, fn: Rule | None = None):
    """Register ``fn(op, mesh) -> iterable of Strategy`` as the rule of ``primitive`` (replacing any earlier one).

    Works as a decorator too. The rule returns unpriced strategies; invalid ones (a spec that does not divide its
    tensor, the wrong number of specs) are dropped and the rest priced by :func:`strategies_for`. A rule should read
    only the mesh's shape (links are the pricing's business): its strategies are remembered per operator signature
    and mesh shape.

    >>> @register_rule("my_identity")
    ... def _identity(op, mesh):
    ...     return follow_strategies(op, mesh)
    >>> "my_identity" in registered_primitives()
    True
    """
    if fn is None:
        return lambda f: register_rule(primitive, f)
    if not callable(fn):
        raise TypeError(f"the rule for {primitive!r} must be a function (op, mesh) -> strategies, got {type(fn).__name__}")
    _RULES[str(primitive)] = fn
    return fn


def unregister_rule(primitive: str) -> None:
    """Remove the rule of ``primitive`` (its operators become replicated-only)."""
    _RULES.pop(str(primitive), None)


def registered_primitives() -> frozenset[str]:
    return frozenset(_RULES)


def has_rule(primitive: str) -> bool:
    return primitive in _RULES


# --------------------------------------------------------------------------------------------------------------
# Building blocks


def _mesh_shape(mesh) -> tuple[int, int]:
    shape = mesh.shape
    try:  # asked for every strategy priced: the few shapes of a run remembered
        return _MESH_SHAPES[shape]
    except (KeyError, TypeError):  # new, or not hashable (a list)
        out = tuple(int(s) for s in shape)
        if type(shape) is tuple and len(_MESH_SHAPES) < 1 << 12:
            _MESH_SHAPES[shape] = out
        return out  # type: ignore[return-value]


_MESH_SHAPES: dict[tuple, tuple[int, ...]] = {}


def _axis_key(axes: Sequence[int]):
    """A collective's axis argument: 0, 1 or (0, 1)."""
    axes = tuple(sorted(axes))
    return axes[0] if len(axes) == 1 else axes


def _spec(rank_map: Sequence[int | None], assign: Mapping[int, tuple[int, ...]]) -> ShardingSpec:
    return ShardingSpec(tuple(assign.get(r, ()) if r is not None else () for r in rank_map))


def _name(out_specs: Sequence[ShardingSpec], in_specs: Sequence[ShardingSpec], suffix: str = "") -> str:
    outs = ", ".join(map(str, out_specs)) or "()"
    ins = " x ".join(str(s) or "''" for s in in_specs) or "()"
    return f"{outs} = {ins}{suffix}"


def contraction_strategies(
    op: OpNode,
    mesh,
    space: Sequence[int],
    in_maps: Sequence[Sequence[int | None]],
    out_maps: Sequence[Sequence[int | None]],
    reduce: Iterable[int] = (),
    splittable: Iterable[int] | None = None,
    reduce_scatter: bool = True,
) -> list[Strategy]:
    """Strategies of an einsum-like operator.

    ``space`` are the sizes of the iteration dimensions; ``in_maps[i][d]`` (``out_maps``) is the iteration dimension
    that dimension ``d`` of input ``i`` (output) runs along, or None if that dimension stays replicated. Splitting a
    dimension in ``reduce`` (contracted away) leaves each output partial over those axes: an ``all_reduce`` of it,
    or, when ``reduce_scatter`` and there is one output, a variant that ``reduce_scatter``s it onto its first free
    dimension that divides (how gradients get sharded for a sharded optimizer update). ``splittable`` limits which
    iteration dimensions may be split (all by default).

    >>> # C[i,j] = sum_k A[i,k] B[k,j]: space (i, j, k)
    >>> # contraction_strategies(op, mesh, (M, N, K), [(0, 2), (2, 1)], [(0, 1)], reduce=[2])
    """
    mshape = _mesh_shape(mesh)
    out: list[Strategy] = []
    for checks, ins, outs, red_axes, axis, name, scatters in _contraction_template(
            len(space), in_maps, out_maps, reduce, splittable, reduce_scatter, useful_axes(mshape)):
        if any(int(space[r]) % math.prod(mshape[a] for a in ax) for r, ax in checks):
            continue
        if not red_axes:
            out.append(Strategy(name, outs, ins))
            continue
        cols = tuple(
            ("all_reduce", axis, s.bytes_per_device(shape, dtype, mshape))
            for s, shape, dtype in zip(outs, op.out_shapes, op.out_dtypes)
            if s.is_valid(shape, mshape)
        )
        out.append(Strategy(name, outs, ins, cols))
        if scatters:
            o, shape, dtype = outs[0], op.out_shapes[0], op.out_dtypes[0]
            n = math.prod(mshape[a] for a in red_axes)
            for d, scattered, rs_name in scatters:
                if shape[d] % n == 0 and shape[d] >= n:
                    if not o.is_valid(shape, mshape):
                        break
                    col = ("reduce_scatter", axis, o.bytes_per_device(shape, dtype, mshape))
                    out.append(Strategy(rs_name, (scattered,), ins, (col,)))
                    break
    return out


#: :func:`contraction_strategies`' candidates per (iteration rank, maps, reduce, splittable, reduce_scatter, useful
#: mesh axes): their specs and names do not depend on the sizes, only which of them divide does. The planner asks
#: again on every logical mesh shape, so the specs are built once per pattern of useful axes.
_TEMPLATES: dict[tuple, tuple] = {}


def _contraction_template(rank, in_maps, out_maps, reduce, splittable, reduce_scatter, useful) -> tuple:
    in_maps = tuple(tuple(m) for m in in_maps)
    out_maps = tuple(tuple(m) for m in out_maps)
    reduce = frozenset(reduce)
    splittable = None if splittable is None else tuple(sorted(set(splittable)))
    key = (rank, in_maps, out_maps, reduce, splittable, reduce_scatter, useful)
    hit = _TEMPLATES.get(key)
    if hit is not None:
        return hit
    pattern = tuple(2 if a in useful else 1 for a in (0, 1))  # a mesh shape with the same useful axes
    rows = []
    for assign in assignments(rank, pattern, splittable):
        checks = tuple(assign.items())
        ins = tuple(_spec(m, assign) for m in in_maps)
        outs = tuple(_spec(m, assign) for m in out_maps)
        red_axes = tuple(sorted(a for r, ax in assign.items() if r in reduce for a in ax))
        if not red_axes:
            rows.append((checks, ins, outs, red_axes, None, _name(outs, ins), ()))
            continue
        axis = _axis_key(red_axes)
        scatters: tuple = ()
        if reduce_scatter and len(outs) == 1:
            o = outs[0]
            scatters = tuple(
                (d, sc, _name((sc,), ins, f" [reduce_scatter@{_fmt_axis(axis)}]"))
                for d in range(o.rank) if not o.dims[d]
                for sc in (ShardingSpec(tuple(red_axes if i == d else ax for i, ax in enumerate(o.dims))),)
            )
        rows.append((checks, ins, outs, red_axes, axis, _name(outs, ins, f" [all_reduce@{_fmt_axis(axis)}]"),
                     scatters))
    if len(_TEMPLATES) > 1 << 14:
        _TEMPLATES.clear()
    hit = _TEMPLATES[key] = tuple(rows)
    return hit


def _fmt_axis(axis) -> str:
    return str(axis) if isinstance(axis, int) else "".join(map(str, axis))


def _same_dims_map(shape: Sequence[int], ref: Sequence[int]) -> tuple[int | None, ...]:
    """Map a tensor's dims onto ``ref``'s: identity where the ranks match and the sizes agree, else replicated."""
    if len(shape) != len(ref):
        return (None,) * len(shape)
    return tuple(d if int(shape[d]) == int(ref[d]) else None for d in range(len(shape)))


def follow_strategies(
    op: OpNode,
    mesh,
    allowed: Iterable[int] | None = None,
    space: Sequence[int] | None = None,
    in_maps: Sequence[Sequence[int | None]] | None = None,
    out_maps: Sequence[Sequence[int | None]] | None = None,
) -> list[Strategy]:
    """Strategies where inputs and outputs share one spec over ``space`` (the first output's shape by default).

    By default a tensor of the same rank follows ``space`` on the dimensions whose size agrees and is replicated on
    the others; scalars and other ranks are replicated. ``allowed`` limits the dimensions of ``space`` that may be
    split (e.g. not the sorted or the concatenated one). No collectives.
    """
    if space is None:
        space = op.out_shapes[0] if op.out_shapes else op.in_shapes[0]
    if in_maps is None:
        in_maps = [_same_dims_map(s, space) for s in op.in_shapes]
    if out_maps is None:
        out_maps = [_same_dims_map(s, space) for s in op.out_shapes]
    return contraction_strategies(op, mesh, space, in_maps, out_maps, splittable=allowed)


def _pick(candidates: Sequence[int], sizes: Sequence[int], mesh_shape: Sequence[int]) -> list[int]:
    """One representative dimension to split among ``candidates``: the first that divides the whole (useful) mesh,
    else the first that divides the largest axis, else the first."""
    if not candidates:
        return []
    ax = useful_axes(mesh_shape)
    total = math.prod(mesh_shape[a] for a in ax) if ax else 1
    biggest = max((mesh_shape[a] for a in ax), default=1)
    for need in (total, biggest):
        for c in candidates:
            if sizes[c] % need == 0 and sizes[c] >= need:
                return [c]
    return [candidates[0]]


# --------------------------------------------------------------------------------------------------------------
# Rules


def dot_general_rule(op: OpNode, mesh) -> list[Strategy]:
    """Batch dims (the first two) split like i; i (an lhs free dim), j (an rhs free dim), k (contracting).

    Every split of at most two of them over the mesh axes: i/j no communication; k leaves partial sums
    (``all_reduce``, or ``reduce_scatter`` onto a free output dim: a weight gradient contracting over the batch
    becomes a sharded gradient, Alpa's weight-update sharding).
    """
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs, rhs = op.in_shapes[0], op.in_shapes[1]
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    # The iteration space: batch dims, lhs free dims, rhs free dims (the output's order), then contracting dims.
    space = [lhs[d] for d in lb] + [lhs[d] for d in lfree] + [rhs[d] for d in rfree] + [lhs[d] for d in lc]
    nb, nl, nr = len(lb), len(lfree), len(rfree)
    lmap: list[int | None] = [None] * len(lhs)
    rmap: list[int | None] = [None] * len(rhs)
    for k, (a, b) in enumerate(zip(lb, rb)):
        lmap[a], rmap[b] = k, k
    for k, d in enumerate(lfree):
        lmap[d] = nb + k
    for k, d in enumerate(rfree):
        rmap[d] = nb + nl + k
    for k, (a, b) in enumerate(zip(lc, rc)):
        lmap[a], rmap[b] = nb + nl + nr + k, nb + nl + nr + k
    out_map = list(range(nb + nl + nr))
    mshape = _mesh_shape(mesh)
    split = list(range(min(nb, 2)))
    split += _pick(list(range(nb, nb + nl)), space, mshape)
    split += _pick(list(range(nb + nl, nb + nl + nr)), space, mshape)
    contracting = list(range(nb + nl + nr, len(space)))
    split += _pick(contracting, space, mshape)
    out = contraction_strategies(op, mesh, space, [lmap, rmap], [out_map], reduce=contracting, splittable=split)
    # Attention on long sequences: ring strategies (context parallelism, see sharding/ring.py).
    return out + [Strategy(_name(o, i, sfx), o, i, c) for o, i, c, sfx in ring_variants(op, mshape)]


def conv_rule(op: OpNode, mesh) -> list[Strategy]:
    """Batch (N), output feature (O), input feature (C: contracted, all-reduce); spatial dims replicated.

    Grouped convolutions (``feature_group_count`` or ``batch_group_count`` > 1) only split the batch.
    """
    dn = op.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs, rhs, outs = op.in_shapes[0], op.in_shapes[1], op.out_shapes[0]
    # space: 0 = N, 1 = O, 2 = C
    space = [lhs[lhs_spec[0]], rhs[rhs_spec[0]], lhs[lhs_spec[1]]]
    lmap: list[int | None] = [None] * len(lhs)
    rmap: list[int | None] = [None] * len(rhs)
    omap: list[int | None] = [None] * len(outs)
    lmap[lhs_spec[0]], omap[out_spec[0]] = 0, 0
    rmap[rhs_spec[0]], omap[out_spec[1]] = 1, 1
    lmap[lhs_spec[1]], rmap[rhs_spec[1]] = 2, 2
    grouped = op.params.get("feature_group_count", 1) != 1 or op.params.get("batch_group_count", 1) != 1
    split = [0] if op.params.get("batch_group_count", 1) == 1 else []
    if not grouped:
        split = [0, 1, 2]
    return contraction_strategies(op, mesh, space, [lmap, rmap], [omap], reduce=[2], splittable=split)


def elementwise_rule(op: OpNode, mesh) -> list[Strategy]:
    """Output any spec; inputs of the output's shape in the same spec, scalars and broadcast dims replicated."""
    return follow_strategies(op, mesh)


def reduction_rule(op: OpNode, mesh) -> list[Strategy]:
    """Input any spec; a reduced dim that is split leaves a partial result: all-reduce over its axes."""
    shape = op.in_shapes[0]
    axes = tuple(int(a) for a in op.params.get("axes", ()))
    kept = [d for d in range(len(shape)) if d not in axes]
    out_maps = [tuple(kept) if len(s) == len(kept) else (None,) * len(s) for s in op.out_shapes]
    in_maps = [tuple(range(len(shape)))] + [_same_dims_map(s, shape) for s in op.in_shapes[1:]]
    # argmax's partial (value, index) pairs need a custom reduction; it is priced as an all-reduce of the output.
    return contraction_strategies(op, mesh, shape, in_maps, out_maps, reduce=axes, reduce_scatter=False)


def _except(op: OpNode, *excluded: int) -> list[int]:
    space = op.out_shapes[0] if op.out_shapes else op.in_shapes[0]
    return [d for d in range(len(space)) if d not in excluded]


def broadcast_rule(op: OpNode, mesh) -> list[Strategy]:
    """Output any spec; the input follows on the dims it maps to (a size-1 broadcast dim stays replicated)."""
    out = op.out_shapes[0]
    bd = tuple(op.params.get("broadcast_dimensions", ()))
    ins = op.in_shapes[0]
    imap = tuple(bd[i] if ins[i] == out[bd[i]] else None for i in range(len(ins)))
    in_maps = [imap] + [(None,) * len(s) for s in op.in_shapes[1:]]
    return follow_strategies(op, mesh, space=out, in_maps=in_maps, out_maps=[tuple(range(len(out)))])


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Groups of input dims and output dims with equal products (size-1 dims left out).

    >>> reshape_groups((4, 6, 8), (24, 2, 4))
    [([0, 1], [0]), ([2], [1, 2])]
    """
    ia = [i for i, s in enumerate(in_shape) if s != 1]
    ib = [j for j, s in enumerate(out_shape) if s != 1]
    groups, i, j = [], 0, 0
    try:
        while i < len(ia) and j < len(ib):
            gi, gj = [ia[i]], [ib[j]]
            pa, pb = in_shape[ia[i]], out_shape[ib[j]]
            i, j = i + 1, j + 1
            while pa != pb:
                if pa < pb:
                    gi.append(ia[i])
                    pa *= in_shape[ia[i]]
                    i += 1
                else:
                    gj.append(ib[j])
                    pb *= out_shape[ib[j]]
                    j += 1
            groups.append((gi, gj))
    except IndexError:
        return []
    return groups


def reshape_rule(op: OpNode, mesh) -> list[Strategy]:
    """A split dim maps to the first of the dims it becomes (when that divides); merged dims keep the split on the
    outermost one. Each group of dims can carry one split, on its first (outermost) dim on both sides."""
    ins, out = op.in_shapes[0], op.out_shapes[0]
    if op.params.get("dimensions") is not None:
        return follow_strategies(op, mesh, allowed=[])
    imap: list[int | None] = [None] * len(ins)
    allowed = []
    for gi, gj in reshape_groups(ins, out):
        imap[gi[0]] = gj[0]
        allowed.append(gj[0])
    in_maps = [tuple(imap)] + [(None,) * len(s) for s in op.in_shapes[1:]]
    return follow_strategies(op, mesh, allowed=allowed, space=out, in_maps=in_maps, out_maps=[tuple(range(len(out)))])


def transpose_rule(op: OpNode, mesh) -> list[Strategy]:
    """Output any spec; the input carries it permuted back."""
    perm = tuple(op.params["permutation"])
    imap: list[int | None] = [None] * len(perm)
    for k, p in enumerate(perm):
        imap[p] = k
    return follow_strategies(op, mesh, in_maps=[tuple(imap)])


def squeeze_rule(op: OpNode, mesh) -> list[Strategy]:
    """Removed (size-1) dims are replicated; the others follow."""
    ins = op.in_shapes[0]
    gone = {d % len(ins) for d in op.params.get("dimensions", ())} if ins else set()
    kept = [d for d in range(len(ins)) if d not in gone]
    return follow_strategies(op, mesh, space=ins, in_maps=[tuple(range(len(ins)))], out_maps=[tuple(kept)])


def expand_dims_rule(op: OpNode, mesh) -> list[Strategy]:
    """New (size-1) dims are replicated; the others follow."""
    out = op.out_shapes[0]
    new = {d % len(out) for d in op.params.get("dimensions", ())}
    kept = [d for d in range(len(out)) if d not in new]
    return follow_strategies(op, mesh, in_maps=[tuple(kept)])


def _unchanged_dims_rule(excluded_param: str | None = None, last_dim: bool = False):
    """Follow rule over dims whose size is unchanged, minus the dims a parameter names (rev, sort, cumsum ...)."""

    def rule(op: OpNode, mesh) -> list[Strategy]:
        space = op.out_shapes[0] if op.out_shapes else op.in_shapes[0]
        ref = op.in_shapes[0] if op.in_shapes else space
        excluded: set[int] = set()
        if excluded_param is not None and excluded_param in op.params:
            v = op.params[excluded_param]
            excluded |= {int(x) % max(len(space), 1) for x in (v if isinstance(v, (tuple, list)) else (v,))}
        if last_dim and space:
            excluded.add(len(space) - 1)
        # Split only dims every non-scalar tensor has at the same size: sliced/padded/concatenated dims change size.
        allowed = [
            d for d in range(len(space)) if d not in excluded and len(ref) == len(space) and ref[d] == space[d]
        ]
        return follow_strategies(op, mesh, allowed=allowed, space=space)

    return rule


def pad_rule(op: OpNode, mesh) -> list[Strategy]:
    """Padded dims replicated (padding shifts data between shards), the others follow; the pad value is a scalar."""
    cfg = op.params.get("padding_config", ())
    padded = [d for d, c in enumerate(cfg) if tuple(c) != (0, 0, 0)]
    return follow_strategies(op, mesh, allowed=_except(op, *padded))


def window_rule(op: OpNode, mesh) -> list[Strategy]:
    """reduce_window / select_and_scatter_add: only dims with a window of 1, stride 1 and no padding follow."""
    win = op.params.get("window_dimensions", ())
    strides = op.params.get("window_strides", (1,) * len(win))
    pads = op.params.get("padding", ((0, 0),) * len(win))
    dil = op.params.get("base_dilation", (1,) * len(win))
    wdil = op.params.get("window_dilation", (1,) * len(win))
    allowed = [
        d for d in range(len(win))
        if win[d] == 1 and strides[d] == 1 and tuple(pads[d]) == (0, 0) and dil[d] == 1 and wdil[d] == 1
    ]
    return follow_strategies(op, mesh, allowed=allowed)


def gather_rule(op: OpNode, mesh) -> list[Strategy]:
    """Gathers as embeddings use them (``jnp.take(table, ids, axis=0)``).

    Output dims are index-batch dims (from the indices) and offset dims (from the operand's full-size slices). Split
    index-batch dims (the first two) like a batch, a full-size operand dim (the embedding dim), or the vocabulary
    dim: each device looks up the rows it holds and zeros the rest, so the output needs an ``all_reduce``.
    """
    dn = op.params["dimension_numbers"]
    operand, indices, out = op.in_shapes[0], op.in_shapes[1], op.out_shapes[0]
    sizes = op.params.get("slice_sizes", operand)
    offset_dims = tuple(dn.offset_dims)
    collapsed = tuple(dn.collapsed_slice_dims)
    start_map = tuple(dn.start_index_map)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    space = list(out)
    bdims = [d for d in range(len(out)) if d not in offset_dims]
    imap: list[int | None] = [None] * len(indices)
    for k in range(len(indices) - 1):  # the last indices dim is the index vector
        if k < len(bdims):
            imap[k] = bdims[k]
    omap: list[int | None] = [None] * len(operand)
    odims = [d for d in range(len(operand)) if d not in collapsed and d not in op_batch]
    offset_roles = []
    for d, o in zip(odims, offset_dims):
        if sizes[d] == operand[d] and d not in start_map:
            omap[d] = o
            offset_roles.append(o)
    for p, d in enumerate(op_batch):
        if idx_batch[p] < len(bdims):
            omap[d] = bdims[idx_batch[p]]
    reduce = []
    vocab = [d for d in collapsed if d in start_map and sizes[d] == 1 and operand[d] > 1]
    if len(vocab) == 1:
        omap[vocab[0]] = len(space)
        reduce = [len(space)]
        space.append(operand[vocab[0]])
    mshape = _mesh_shape(mesh)
    split = bdims[:2] + _pick(offset_roles, space, mshape) + reduce
    in_maps = [tuple(omap), tuple(imap)] + [(None,) * len(s) for s in op.in_shapes[2:]]
    return contraction_strategies(op, mesh, space, in_maps, [tuple(range(len(out)))], reduce=reduce,
                                  splittable=split, reduce_scatter=False)


def scatter_rule(op: OpNode, mesh) -> list[Strategy]:
    """Scatters as embedding gradients use them (``scatter-add`` of row updates into a table).

    The operand and output share a spec; the updates' window dims follow the operand's full-size dims. Splitting the
    vocabulary (scattered-into) dim needs no communication: each device keeps the updates that land in its rows.
    For a scatter-add, splitting the updates' scatter dims (the batch) leaves partial sums: ``all_reduce`` or
    ``reduce_scatter`` of the output, exactly as for a weight gradient. (The operand is then counted once per
    shard; it is the zeros of a gradient in practice.)
    """
    dn = op.params["dimension_numbers"]
    operand, indices, updates = op.in_shapes[0], op.in_shapes[1], op.in_shapes[2]
    window = tuple(dn.update_window_dims)
    inserted = tuple(dn.inserted_window_dims)
    to_operand = tuple(dn.scatter_dims_to_operand_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    space = list(operand)
    umap: list[int | None] = [None] * len(updates)
    imap: list[int | None] = [None] * len(indices)
    odims = [d for d in range(len(operand)) if d not in inserted and d not in op_batch]
    window_roles = []
    for d, u in zip(odims, window):
        if updates[u] == operand[d] and d not in to_operand:
            umap[u] = d
            window_roles.append(d)
    scatter_dims = [d for d in range(len(updates)) if d not in window]
    reduce = []
    for k, u in enumerate(scatter_dims):
        if k >= len(indices) - 1:
            break
        if k in idx_batch:
            role = op_batch[idx_batch.index(k)]
        else:
            role = len(space)
            space.append(updates[u])
            reduce.append(role)
        umap[u], imap[k] = role, role
    vocab = [d for d in inserted if d in to_operand and operand[d] > 1]
    additive = op.primitive in ("scatter-add", "scatter_add")
    mshape = _mesh_shape(mesh)
    split = _pick(window_roles, space, mshape) + vocab[:1] + (reduce[:2] if additive else [])
    split += [d for d in op_batch if d not in split]
    ident = tuple(range(len(operand)))
    in_maps = [ident, tuple(imap), tuple(umap)] + [(None,) * len(s) for s in op.in_shapes[3:]]
    return contraction_strategies(op, mesh, space, in_maps, [ident], reduce=reduce, splittable=split)


def scan_slice_rule(op: OpNode, mesh) -> list[Strategy]:
    """Index ``axis`` of a stacked tensor: that axis replicated, the others follow."""
    axis = int(op.params.get("axis", 0))
    out = op.out_shapes[0]
    imap = [d if d < axis else d - 1 for d in range(len(op.in_shapes[0]))]
    imap[axis] = None  # type: ignore[call-overload]
    return follow_strategies(op, mesh, space=out, in_maps=[tuple(imap)])


def scan_stack_rule(op: OpNode, mesh) -> list[Strategy]:
    """Stack per-iteration tensors along ``axis``: that axis replicated, the others follow."""
    axis = int(op.params.get("axis", 0))
    out = op.out_shapes[0]
    imap = tuple(d if d < axis else d + 1 for d in range(len(out) - 1))
    return follow_strategies(op, mesh, allowed=_except(op, axis), in_maps=[imap] * len(op.in_shapes))


def source_rule(op: OpNode, mesh) -> list[Strategy]:
    """Operators without tensor inputs (``parameter``, ``iota``): any valid spec of the output."""
    return follow_strategies(op, mesh)


def output_rule(op: OpNode, mesh) -> list[Strategy]:
    """The step's output: any valid spec; its input must be in it."""
    shape = op.in_shapes[0]
    strategies = follow_strategies(op, mesh, space=shape, in_maps=[tuple(range(len(shape)))], out_maps=[])
    return [Strategy(str(s.in_specs[0]) or "''", (), s.in_specs) for s in strategies]


def replicated_strategy(op: OpNode, why: str = "") -> Strategy:
    """Everything replicated (the fallback for operators without a rule)."""
    outs = tuple(ShardingSpec.replicated(len(s)) for s in op.out_shapes)
    ins = tuple(ShardingSpec.replicated(len(s)) for s in op.in_shapes)
    return Strategy(_name(outs, ins, f" [{why}]" if why else ""), outs, ins)


for _p in opcost.ELEMENTWISE | {
    "convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision", "optimization_barrier",
    "sharding_constraint", "integer_pow", "select_n", "clamp", "logistic", "erf_inv", "square",
}:
    register_rule(_p, elementwise_rule)
for _p in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
           "argmax", "argmin"):
    register_rule(_p, reduction_rule)
for _p in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
    register_rule(_p, _unchanged_dims_rule("axis"))
register_rule("dot_general", dot_general_rule)
register_rule("conv_general_dilated", conv_rule)
register_rule("broadcast_in_dim", broadcast_rule)
register_rule("reshape", reshape_rule)
register_rule("transpose", transpose_rule)
register_rule("squeeze", squeeze_rule)
register_rule("expand_dims", expand_dims_rule)
register_rule("slice", _unchanged_dims_rule())
register_rule("dynamic_slice", _unchanged_dims_rule())
register_rule("dynamic_update_slice", _unchanged_dims_rule())
register_rule("concatenate", _unchanged_dims_rule("dimension"))
register_rule("split", _unchanged_dims_rule("axis"))
register_rule("rev", _unchanged_dims_rule("dimensions"))
register_rule("pad", pad_rule)
register_rule("sort", _unchanged_dims_rule("dimension"))
register_rule("top_k", _unchanged_dims_rule(last_dim=True))
for _p in sorted(opcost.WINDOWED):
    register_rule(_p, window_rule)
register_rule("gather", gather_rule)
for _p in ("scatter", "scatter-add", "scatter_add"):
    register_rule(_p, scatter_rule)
register_rule("scan_slice", scan_slice_rule)
register_rule("scan_stack", scan_stack_rule)
register_rule("pipeline_boundary", elementwise_rule)  # al.pipeline_boundary: the identity, output spec = input spec
register_rule("iota", source_rule)
register_rule(INPUT_PRIMITIVE, source_rule)
register_rule(OUTPUT_PRIMITIVE, output_rule)

#: The rules defined here (see :func:`_valid_strategies`).
_BUILTIN_RULES = frozenset(_RULES.values())

# Operators that cost nothing whatever their spec: inputs and outputs of the step, and constants made on the spot.
ZERO_COST = frozenset([INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, "iota"])


# --------------------------------------------------------------------------------------------------------------
# Pricing and the entry points


def _fits(s: Strategy, op: OpNode, mshape: Sequence[int]) -> bool:
    if len(s.out_specs) != len(op.out_shapes) or len(s.in_specs) != len(op.in_shapes):
        return False
    return all(spec.is_valid(shape, mshape) for spec, shape in zip(s.out_specs, op.out_shapes)) and all(
        spec.is_valid(shape, mshape) for spec, shape in zip(s.in_specs, op.in_shapes)
    )


def price(op: OpNode, s: Strategy, mesh) -> Strategy:
    """``s`` with compute_s, comm_s and mem_bytes filled in (see the module docstring for the formulas)."""
    mshape = _mesh_shape(mesh)
    outs = [spec.bytes_per_device(sh, dt, mshape) for spec, sh, dt in zip(s.out_specs, op.out_shapes, op.out_dtypes)]
    ins = [spec.bytes_per_device(sh, dt, mshape) for spec, sh, dt in zip(s.in_specs, op.in_shapes, op.in_dtypes)]
    if op.primitive in ("gather", "dynamic_slice", "scan_slice") and ins:
        ins[0] = sum(outs)  # they read only the slice they return, not the whole operand
    compute = 0.0
    if op.primitive not in ZERO_COST:
        used = set().union(*(spec.axes for spec in s.out_specs + s.in_specs)) if (s.out_specs or s.in_specs) else set()
        n_work = math.prod(mshape[a] for a in used)
        compute = kernel_time(op, s, mesh, ins, outs, n_work)
        if FP8_CASTS in op.params:
            compute += cast_time(op, mesh, ins)
    comm = sum(collective_time(mesh, kind, nbytes, axis) if kind != RING_KIND else
               ring_exposed_s(mesh, nbytes, axis, compute) for kind, axis, nbytes in s.collectives)
    return Strategy(s.name, s.out_specs, s.in_specs, s.collectives, compute, comm, float(sum(outs)))


def kernel_time(op: OpNode, s: Strategy, mesh, ins: Sequence[float], outs: Sequence[float], n_work: int) -> float:
    """Seconds one device spends on ``op``'s shard under strategy ``s``, as part of the kernel it runs in.

    The roofline of the kernel, ``max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth)``, split over its
    operators (:mod:`autopar_lab.graph.fusion`): an operator charges the bytes its kernel reads and writes for it
    (a tensor inside the kernel costs none); a matmul (or flash-attention kernel) charges its absorbed operators'
    FLOPs and traffic with its own, at the GEMM's achievable rate for the shard's shape (wave quantisation, inner
    dimension: :meth:`~autopar_lab.cluster.Device.matmul_rate`); the rest run at the elementwise rate. An operator
    whose graph has no kernel roles attached is priced as a kernel of its own. Launch overheads are counted per
    kernel elsewhere (:mod:`autopar_lab.pricing.layers`).
    """
    device = mesh.cluster.device
    role = kernel_role(op, device.efficiency.flash_attention)
    dtype = op.in_dtypes[0] if op.in_dtypes else (op.out_dtypes[0] if op.out_dtypes else "float32")
    flops = op.flops / n_work
    bw = device.achievable_bandwidth
    # virtual devices (the cpu preset) were calibrated with all of a host's devices busy; fewer share the cores less
    share = mesh.cluster.virtual_share(mesh.num_devices) if getattr(device, "virtual", False) else 1.0
    if role is not None and role.kind in ("free", "dead"):
        return 0.0  # folded into the kernels that read it (a layout change, a scalar), or removed
    if role is None:
        traffic = float(sum(ins) + sum(outs))
        extra_mm = extra_vec = 0.0
        work = 1.0
    elif role.absorbed:
        # Its traffic is its kernel root's; its own elementwise work it does where its spec puts it (so an epilogue
        # computed on a shard costs less than one replicated). A flash-attention step's work is the root's.
        return 0.0 if role.kind in ("attention", "dead") else flops / device.vector_rate(dtype) * share
    else:
        traffic = float(sum(f * b for f, b in zip(role.reads, ins)) + sum(f * b for f, b in zip(role.writes, outs)))
        traffic += role.extra_bytes * float(sum(outs))
        extra_mm, extra_vec, work = role.extra_mm, role.extra_vec, role.work
    if op.primitive in opcost.CONTRACTIONS:
        if role is not None and role.kind == "attention":
            rate = device.attention_rate(dtype)
        else:
            local_in = [spec.shard_shape(sh, _mesh_shape(mesh)) for spec, sh in zip(s.in_specs, op.in_shapes)]
            local_out = [spec.shard_shape(sh, _mesh_shape(mesh)) for spec, sh in zip(s.out_specs, op.out_shapes)]
            batch, m, n, k = opcost.gemm_dims(op.primitive, local_in, local_out, op.params)
            rate = device.matmul_rate(dtype, m, n, k, batch)
        t = flops * (1.0 + extra_mm) * work / rate + flops * extra_vec / device.vector_rate(dtype)
    else:
        t = flops * (1.0 + extra_vec) / device.vector_rate(dtype)
    return max(t, traffic / bw) * share


def cast_time(op: OpNode, mesh, ins: Sequence[float]) -> float:
    """Seconds one device spends on the FP8 cast kernels ``op`` pays for (``op.params[FP8_CASTS]``, written by
    :func:`autopar_lab.precision.retype`): each a memory-bound kernel of its own, moving ``FP8_CASTS[i]`` times the
    bytes ``ins[i]`` the operator reads of input ``i`` (as its strategy shards it) at the achievable bandwidth. Their
    launches are counted with the other kernels' (:mod:`autopar_lab.pricing.layers`)."""
    device = mesh.cluster.device
    share = mesh.cluster.virtual_share(mesh.num_devices) if getattr(device, "virtual", False) else 1.0
    moved = sum(f * b for f, b in zip(op.params[FP8_CASTS], ins))
    return moved / device.achievable_bandwidth * share


def strategies_for(op: OpNode, mesh) -> list[Strategy]:
    """The priced, valid, deduplicated strategies of ``op`` on ``mesh`` (never empty).

    An operator without a rule (see :func:`register_rule`) gets the all-replicated strategy only; its graph's
    :func:`unsupported_ops` says so.
    """
    mshape = _mesh_shape(mesh)
    rule = _RULES.get(op.primitive)
    best: dict[tuple, Strategy] = {}
    for s in _valid_strategies(op, rule, mesh, mshape):
        p = price(op, s, mesh)
        if p.key not in best or p.cost < best[p.key].cost:
            best[p.key] = p
    if not best:
        why = f"no rule for '{op.primitive}'" if rule is None else "no valid split"
        p = price(op, replicated_strategy(op, why), mesh)
        best[p.key] = p
    return list(best.values())


_VALID: dict[tuple, tuple[Strategy, ...]] = {}


def _valid_strategies(op: OpNode, rule, mesh, mshape) -> tuple[Strategy, ...]:
    """The rule's strategies that fit ``op`` on a mesh of shape ``mshape``, unpriced. Remembered per (rule, operator
    signature, mesh shape): a rule sees the mesh only through its shape (pricing, which reads links, comes after),
    and the planner asks again on every logical mesh of every submesh."""
    if rule is None:
        return ()
    sig = op_signature(op)
    # The built-in rules read an operator's primitive, shapes, dtypes and parameters only, not its role or its
    # inputs' kinds: a forward and a backward operator of one shape share the enumeration. A rule registered later
    # may read anything: it keeps the whole signature.
    key = (rule, sig[:6] if rule in _BUILTIN_RULES else sig, mshape)
    hit = _VALID.get(key)
    if hit is None:
        hit = tuple(s for s in rule(op, mesh) if _fits(s, op, mshape))
        if len(_VALID) > 1 << 16:
            _VALID.clear()
        _VALID[key] = hit
    return hit


def unsupported_ops(graph: OpGraph) -> list[str]:
    """One warning per primitive of ``graph`` that has no sharding rule (its operators are planned replicated)."""
    missing: dict[str, list[int]] = defaultdict(list)
    for node in graph:
        if node.primitive not in _RULES:
            missing[node.primitive].append(node.id)
    out = []
    for prim, ids in sorted(missing.items()):
        shown = ", ".join(f"#{i}" for i in ids[:5]) + (", ..." if len(ids) > 5 else "")
        out.append(
            f"no sharding rule for '{prim}' ({len(ids)} operator{'s' if len(ids) > 1 else ''}: {shown}): planned "
            f"replicated; register one with autopar_lab.sharding.register_rule('{prim}', fn) to shard it"
        )
    return out


def chain_read_s_per_byte(mesh) -> float:
    """Seconds one device of ``mesh`` spends per byte of its shard of a gradient-chain link
    (:func:`~autopar_lab.graph.fusion.is_chain_link`) each time one later layer's backward reads it again: the
    device's ``Efficiency.chain_reads`` reads at its achievable bandwidth, at the mesh's share of a virtual host's
    cores. 0 where the compiler writes the chain once (the GPU presets).

    >>> from autopar_lab.cluster import Cluster
    >>> chain_read_s_per_byte(Cluster.preset("dgx-a100").logical_mesh((1, 8)))
    0.0
    """
    device = mesh.cluster.device
    unit = device.efficiency.chain_reads / device.achievable_bandwidth
    if unit and device.virtual:
        unit *= mesh.cluster.virtual_share(mesh.num_devices)
    return unit


__all__ = [
    "COLLECTIVE_KINDS",
    "chain_read_s_per_byte",
    "Rule",
    "Strategy",
    "ZERO_COST",
    "contraction_strategies",
    "follow_strategies",
    "has_rule",
    "kernel_time",
    "price",
    "register_rule",
    "registered_primitives",
    "replicated_strategy",
    "reshape_groups",
    "strategies_for",
    "unregister_rule",
    "unsupported_ops",
]
