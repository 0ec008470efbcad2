"""Resharding cost: what converting a tensor from one sharding spec to another costs on a logical mesh.

The price is that of the collectives XLA would insert, decided axis by axis (an axis of size 1 is free):

- the axis splits the same dimension in both specs            -> nothing;
- the source is replicated along it, the destination splits   -> local slicing, free (0 s);
- the source splits a dimension, the destination replicates   -> ``all_gather`` over that axis (over both axes
  at once when a dimension loses both);
- the axis moves from one dimension to another                 -> ``all_to_all`` over that axis (one
  ``all_to_all`` over both axes when a dimension split over both moves whole, ``S01R`` -> ``RS01``).

Each collective's B is the bytes of the buffer it works on: the tensor as sharded by the *other* axes at that moment
(the full extent along the axis itself), the convention of :class:`~autopar_lab.cluster.LogicalMesh`. Steps run in
the cheapest order: free slices first (they shrink the buffers), then all-to-alls, then all-gathers.

A dimension split over both axes whose order changes (``S01`` -> ``S1`` gathers the *outer* axis; ``S1`` -> ``S01``
puts a new axis outside) is not a plain gather or slice: the data a device keeps moves. It is priced as an extra
``all_to_all`` over the axis that stayed (an approximation; the strategies never produce ``S10``).

Example (a 2 x 4 mesh, a 1 MB float32 tensor):
    >>> from autopar_lab.sharding.spec import ShardingSpec as S
    >>> plan_reshard(S.parse("S0R"), S.parse("RS0"), (512, 512), "float32", (2, 4))
    (('all_to_all', 0, 1048576),)
    >>> plan_reshard(S.parse("S0S1"), S.parse("RS1"), (512, 512), "float32", (2, 4))
    (('all_gather', 0, 262144),)
"""

from __future__ import annotations

from typing import Any, Sequence

from .spec import ShardingSpec, useful_axes

Collective = tuple[str, Any, int]  # (kind, mesh axis, bytes of the full buffer along that axis)


def _with_axis(spec: ShardingSpec, axis: int, dim: int | None) -> ShardingSpec:
    """``spec`` with ``axis`` removed from wherever it is, then (if ``dim`` is not None) added to ``dim``."""
    dims = [tuple(a for a in d if a != axis) for d in spec.dims]
    if dim is not None:
        dims[dim] = tuple(sorted(dims[dim] + (axis,)))
    return ShardingSpec(tuple(dims))


def plan_reshard(
    src: ShardingSpec, dst: ShardingSpec, shape: Sequence[int], dtype: str, mesh_shape: Sequence[int]
) -> tuple[Collective, ...]:
    """The collectives that turn ``src`` into ``dst`` (see the module docstring for the rule)."""
    if src.rank != dst.rank or src.rank != len(shape):
        raise ValueError(f"cannot reshard {src} -> {dst}: ranks differ (tensor shape {tuple(shape)})")
    if src == dst:
        return ()
    for spec in (src, dst):
        if not spec.is_valid(shape, mesh_shape):
            raise ValueError(f"spec {spec} does not evenly shard shape {tuple(shape)} on a {tuple(mesh_shape)} mesh")
    axes = useful_axes(mesh_shape)
    moves = {a: (src.dim_of(a), dst.dim_of(a)) for a in axes}
    cur = src
    out: list[Collective] = []

    def buffer(spec: ShardingSpec, axis) -> int:
        ax = (axis,) if isinstance(axis, int) else tuple(axis)
        return spec.without_axes(ax).bytes_per_device(shape, dtype, mesh_shape)

    # 1. free slices: the buffers the collectives below move get smaller.
    for a, (s, d) in moves.items():
        if s is None and d is not None:
            cur = _with_axis(cur, a, d)
    # 2. an axis changing dimension: all-to-all. Both axes moving together from one dimension to another, in the
    #    same order (S01 on dim i -> S01 on dim j), is ONE all-to-all over the flattened axes (what XLA emits):
    #    B is the whole buffer, each device exchanges its 1/n of it once (not two rounds, one per axis).
    together = [a for a, (s, d) in moves.items() if s is not None and d is not None and s != d]
    if (len(together) == 2 and len({moves[a] for a in together}) == 1
            and [a for a in src.dims[moves[together[0]][0]] if a in axes] == together
            and [a for a in dst.dims[moves[together[0]][1]] if a in axes] == together):
        axis = tuple(together)
        out.append(("all_to_all", axis, buffer(cur, axis)))
        for a in together:
            cur = _with_axis(cur, a, moves[a][1])
    else:
        for a, (s, d) in moves.items():
            if s is not None and d is not None and s != d:
                out.append(("all_to_all", a, buffer(cur, a)))
                cur = _with_axis(cur, a, d)
    # 3. order of two axes on one dimension changed (see module docstring): the axis that stayed moves data.
    for i, (sd, dd) in enumerate(zip(src.dims, dst.dims)):
        kept = [a for a in sd if a in dd and int(mesh_shape[a]) > 1]
        sd_u = [a for a in sd if int(mesh_shape[a]) > 1]
        dd_u = [a for a in dd if int(mesh_shape[a]) > 1]
        if kept and (dd_u[: len(kept)] != kept or sd_u[: len(kept)] != kept):
            for a in kept:
                out.append(("all_to_all", a, buffer(cur, a)))
    # 4. an axis no longer splitting anything: all-gather over it (one gather over both axes when a dimension
    #    loses both: same bytes, one latency).
    gone: dict[int, list[int]] = {}
    for a, (s, d) in moves.items():
        if s is not None and d is None:
            gone.setdefault(s, []).append(a)
    for _dim, ax in sorted(gone.items()):
        axis = ax[0] if len(ax) == 1 else tuple(sorted(ax))
        out.append(("all_gather", axis, buffer(cur, axis)))
        cur = cur.without_axes(ax)
    return tuple(out)


def collective_time(mesh, kind: str, nbytes: float, axis) -> float:
    """Seconds of one collective on ``mesh`` (``kind`` is a LogicalMesh method name)."""
    # Remembered per mesh (a mesh's links do not change): the same buffers recur across an operator's strategies and
    # across operators, and each call walks the mesh's groups again for the hosts they span.
    memo = getattr(mesh, "__dict__", None)
    key = (kind, nbytes, axis)
    if memo is not None:
        memo = memo.setdefault("_collective_s", {})
        try:
            return memo[key]
        except (KeyError, TypeError):  # new, or an unhashable axis (a list)
            pass
    fn = getattr(mesh, kind, None)
    if fn is None:
        raise ValueError(f"unknown collective {kind!r}; use all_reduce, all_gather, reduce_scatter or all_to_all")
    out = float(fn(nbytes, axis))
    if memo is not None and not isinstance(axis, list):
        memo[key] = out
    return out


def reshard_cost(
    src: ShardingSpec, dst: ShardingSpec, shape: Sequence[int], dtype: str, mesh
) -> tuple[float, tuple[Collective, ...]]:
    """(seconds, collectives) to convert a tensor of ``shape``/``dtype`` from ``src`` to ``dst`` on ``mesh``.

    >>> from autopar_lab.cluster import Cluster
    >>> from autopar_lab.sharding.spec import ShardingSpec as S
    >>> mesh = Cluster.preset("p3.16xlarge").logical_mesh((1, 8), (1, 8))
    >>> reshard_cost(S.parse("RR"), S.parse("RS1"), (64, 64), "float32", mesh)
    (0.0, ())
    """
    cols = plan_reshard(src, dst, shape, dtype, tuple(mesh.shape))
    limit = getattr(getattr(mesh, "cluster", None), "moe_routing", None)
    return float(sum(collective_time(mesh, _priced_as(k, a, src, dst, shape, limit), b, a) for k, a, b in cols)), cols


def _priced_as(kind: str, axis, src: ShardingSpec, dst: ShardingSpec, shape: Sequence[int], limit) -> str:
    """The mesh method that prices one collective of a resharding: ``routed_all_to_all`` for an MoE token exchange
    under node-limited routing (``limit``, the cluster's :class:`~autopar_lab.cluster.values.NodeLimit`): an
    all-to-all that moves a mesh axis onto or off a dimension of ``num_experts`` (the expert dimension of the
    dispatched tokens, as :func:`~autopar_lab.sharding.experts.layer_all_to_alls` recognises them); ``kind``
    otherwise."""
    if limit is None or kind != "all_to_all":
        return kind
    moved = (axis,) if isinstance(axis, int) else tuple(axis)
    dims = {spec.dim_of(a) for spec in (src, dst) for a in moved} - {None}
    return "routed_all_to_all" if any(int(shape[d]) == limit.num_experts for d in dims) else kind


__all__ = ["Collective", "collective_time", "plan_reshard", "reshard_cost"]
