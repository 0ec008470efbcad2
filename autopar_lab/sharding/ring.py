"""Context parallelism with ring attention: an attention matmul run on a sequence block per device, the other
operand's blocks passed around a ring of send/recv steps that overlap the block's compute.

Attention's matmuls (``Q K^T``, ``P V`` and their gradients) have batch dimensions and two sequence dimensions of the
same length, one per operand. Splitting the first operand's sequence over a mesh axis and keeping the second whole
is already a strategy (the second operand is all-gathered by a resharding edge before the matmul: context
parallelism by all-gather). A ring strategy keeps *both* split along their sequence over the same axis: the device
computes its block against the other operand's block it holds, sends that block to its ring neighbour and receives
the next, ``n - 1`` times (what JAX writes with ``shard_map`` and ``lax.ppermute``; XLA's ``collective-permute``).
Each step's transfer overlaps the step's compute, so only what is longer than the compute is exposed:

    exposed = (n - 1) * max(0, step - compute / n),   step = the time of sending one block (B / n bytes) to a
                                                      neighbour over the axis' link: a + (B / n) / b

priced with :meth:`~autopar_lab.cluster.LogicalMesh.ring_step` (one hop's latency, not the n - 1 of a whole
all-gather). ``B`` is the rotated operand's bytes per device without the ring axis.

Ring strategies are offered only for sequences of at least :data:`RING_MIN_SEQ` tokens: shorter attention gains
nothing the all-gather form does not have, and today's plans (sequence 1,024 and below) keep their space unchanged.
"""

from __future__ import annotations

from typing import Any, Sequence

from .spec import ShardingSpec, useful_axes

#: The collective kind of a ring step (XLA's name for a send/recv between neighbours).
RING_KIND = "collective_permute"
#: Sequences shorter than this get no ring strategies.
RING_MIN_SEQ = 4096

__all__ = ["RING_KIND", "RING_MIN_SEQ", "is_ring", "ring_axes_used", "ring_exposed_s", "ring_variants"]


def ring_exposed_s(mesh, nbytes: float, axis, compute_s: float) -> float:
    """Seconds of a ring of ``n - 1`` send/recv steps of ``nbytes / n`` each over mesh ``axis`` not hidden by the
    ``compute_s`` it overlaps (see the module docstring). 0 on an axis of one device.

    >>> from autopar_lab.cluster import Cluster
    >>> mesh = Cluster.preset("p3.16xlarge").logical_mesh((1, 8), (1, 8))
    >>> ring_exposed_s(mesh, 8e6, 1, 1.0)       # a second of compute hides 7 steps of 1 MB
    0.0
    >>> round(ring_exposed_s(mesh, 8e6, 1, 0.0) / mesh.ring_step(8e6 / 8, 1), 6)    # nothing to hide behind
    7.0
    """
    n = int(mesh.axis_size(axis))
    if n <= 1:
        return 0.0
    step = float(mesh.ring_step(nbytes / n, axis))
    return (n - 1) * max(0.0, step - compute_s / n)


def _spec(rank: int, splits: dict[int, tuple[int, ...]]) -> ShardingSpec:
    return ShardingSpec(tuple(splits.get(d, ()) for d in range(rank)))


def ring_variants(op, mesh_shape: Sequence[int]) -> list[tuple[tuple[ShardingSpec, ...], tuple[ShardingSpec, ...],
                                                               tuple[tuple[str, Any, int], ...], str]]:
    """``(out_specs, in_specs, collectives, name suffix)`` of the ring strategies of a ``dot_general`` ``op`` with
    batch dimensions: for each operand kept (X) and the other rotated (Y), X's free sequence dimension and Y's
    sequence dimension (free or contracted) of the same length >= :data:`RING_MIN_SEQ`, split over one mesh axis;
    with the first batch dimension split over the other axis as well where it divides. Empty for other matmuls."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    if not lb:
        return []
    shapes = [tuple(op.in_shapes[0]), tuple(op.in_shapes[1])]
    cont, batch = [tuple(lc), tuple(rc)], [tuple(lb), tuple(rb)]
    free = [[d for d in range(len(s)) if d not in cont[i] and d not in batch[i]] for i, s in enumerate(shapes)]
    nb, nl = len(lb), len(free[0])
    out_rank = len(op.out_shapes[0])
    mshape = tuple(int(x) for x in mesh_shape)
    out = []
    for x in (0, 1):
        y = 1 - x
        for dx in free[x]:
            seq = shapes[x][dx]
            if seq < RING_MIN_SEQ:
                continue
            pos = nb + (free[0].index(dx) if x == 0 else nl + free[1].index(dx))
            for dy in (d for d in range(len(shapes[y])) if d not in batch[y] and shapes[y][d] == seq):
                for a in useful_axes(mshape):
                    n = mshape[a]
                    if seq % n:
                        continue
                    others = [b for b in useful_axes(mshape) if b != a]
                    for extra in [None] + [b for b in others if shapes[x][batch[x][0]] % mshape[b] == 0]:
                        sx, sy, so = {dx: (a,)}, {dy: (a,)}, {pos: (a,)}
                        if extra is not None:
                            sx[batch[x][0]], sy[batch[y][0]], so[0] = (extra,), (extra,), (extra,)
                        ins = [None, None]
                        ins[x], ins[y] = _spec(len(shapes[x]), sx), _spec(len(shapes[y]), sy)
                        spec_y = ins[y]
                        assert spec_y is not None
                        rotated = spec_y.without_axes((a,)).bytes_per_device(shapes[y], op.in_dtypes[y], mshape)
                        cols = ((RING_KIND, a, int(rotated)),)
                        out.append(((_spec(out_rank, so),), (ins[0], ins[1]), cols, f" [ring@{a}]"))
    return out


def ring_axes_used(strategy) -> tuple[int, ...]:
    """The mesh axes ``strategy`` runs a ring over (none for a strategy without one)."""
    return tuple(sorted({a for k, a, _b in strategy.collectives if k == RING_KIND}))


def is_ring(strategy) -> bool:
    return any(k == RING_KIND for k, _a, _b in strategy.collectives)

