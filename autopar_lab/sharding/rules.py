"""The built-in sharding rules, one per primitive family: matmuls and convolutions, elementwise operators,
reductions, broadcasts, reshapes, transposes, slices, pads, windows, gathers and scatters (embeddings), the scan's
slices and stacks, the step's inputs and outputs. Each lists an operator's unpriced strategies on a mesh, built
with :func:`~autopar_lab.sharding.strategies.contraction_strategies` or
:func:`~autopar_lab.sharding.strategies.follow_strategies`; importing this module registers them
(:func:`~autopar_lab.sharding.strategies.register_rule`, shape-only), as the package does on import."""

from __future__ import annotations

import math
from typing import Sequence

from ..graph import opcost
from ..graph.opgraph import INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, OpNode
from .ring import ring_variants
from .spec import useful_axes
from .strategies import (Strategy, contraction_strategies, follow_strategies, mesh_shape, register_rule,
                         same_dims_map, strategy_name)

__all__ = ["pick_dim", "dot_general_rule", "conv_rule", "elementwise_rule", "reduction_rule", "broadcast_rule",
           "reshape_groups", "reshape_rule", "transpose_rule", "squeeze_rule", "expand_dims_rule", "pad_rule",
           "window_rule", "gather_rule", "scatter_rule", "scan_slice_rule", "scan_stack_rule", "source_rule",
           "output_rule"]


def pick_dim(candidates: Sequence[int], sizes: Sequence[int], mesh_shape: Sequence[int]) -> list[int]:
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
    mshape = mesh_shape(mesh)
    split = list(range(min(nb, 2)))
    split += pick_dim(list(range(nb, nb + nl)), space, mshape)
    split += pick_dim(list(range(nb + nl, nb + nl + nr)), space, mshape)
    contracting = list(range(nb + nl + nr, len(space)))
    split += pick_dim(contracting, space, mshape)
    out = contraction_strategies(op, mesh, space, [lmap, rmap], [out_map], reduce=contracting, splittable=split)
    # Attention on long sequences: ring strategies (context parallelism, see sharding/ring.py).
    return out + [Strategy(strategy_name(o, i, sfx), o, i, c) for o, i, c, sfx in ring_variants(op, mshape)]


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
    in_maps = [tuple(range(len(shape)))] + [same_dims_map(s, shape) for s in op.in_shapes[1:]]
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
    mshape = mesh_shape(mesh)
    split = bdims[:2] + pick_dim(offset_roles, space, mshape) + reduce
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
    mshape = mesh_shape(mesh)
    split = pick_dim(window_roles, space, mshape) + vocab[:1] + (reduce[:2] if additive else [])
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




for _p in opcost.ELEMENTWISE | {
    "convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision", "optimization_barrier",
    "sharding_constraint", "integer_pow", "select_n", "clamp", "logistic", "erf_inv", "square",
}:
    register_rule(_p, elementwise_rule, shape_only=True)
for _p in ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor",
           "argmax", "argmin"):
    register_rule(_p, reduction_rule, shape_only=True)
for _p in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
    register_rule(_p, _unchanged_dims_rule("axis"), shape_only=True)
register_rule("dot_general", dot_general_rule, shape_only=True)
register_rule("conv_general_dilated", conv_rule, shape_only=True)
register_rule("broadcast_in_dim", broadcast_rule, shape_only=True)
register_rule("reshape", reshape_rule, shape_only=True)
register_rule("transpose", transpose_rule, shape_only=True)
register_rule("squeeze", squeeze_rule, shape_only=True)
register_rule("expand_dims", expand_dims_rule, shape_only=True)
register_rule("slice", _unchanged_dims_rule(), shape_only=True)
register_rule("dynamic_slice", _unchanged_dims_rule(), shape_only=True)
register_rule("dynamic_update_slice", _unchanged_dims_rule(), shape_only=True)
register_rule("concatenate", _unchanged_dims_rule("dimension"), shape_only=True)
register_rule("split", _unchanged_dims_rule("axis"), shape_only=True)
register_rule("rev", _unchanged_dims_rule("dimensions"), shape_only=True)
register_rule("pad", pad_rule, shape_only=True)
register_rule("sort", _unchanged_dims_rule("dimension"), shape_only=True)
register_rule("top_k", _unchanged_dims_rule(last_dim=True), shape_only=True)
for _p in sorted(opcost.WINDOWED):
    register_rule(_p, window_rule, shape_only=True)
register_rule("gather", gather_rule, shape_only=True)
for _p in ("scatter", "scatter-add", "scatter_add"):
    register_rule(_p, scatter_rule, shape_only=True)
register_rule("scan_slice", scan_slice_rule, shape_only=True)
register_rule("scan_stack", scan_stack_rule, shape_only=True)
register_rule("pipeline_boundary", elementwise_rule)  # al.pipeline_boundary: the identity, output spec = input spec
register_rule("iota", source_rule, shape_only=True)
register_rule(INPUT_PRIMITIVE, source_rule, shape_only=True)
register_rule(OUTPUT_PRIMITIVE, output_rule, shape_only=True)
