"""ZeRO-3 / FSDP in the intra-operator space: parameters stored sharded, gathered for their readers.

The ILP already holds this choice; nothing new is enumerated. A parameter's input operator may take any valid spec
(:func:`~autopar_lab.sharding.rules.source_rule`), so it can be *stored* split over the axis the batch is split
on, ``S0R`` (``P('x', None)``), while the matmuls that read it ask for it whole along that axis (``RR``): each such
edge is an ``all_gather`` resharding, priced with :meth:`~autopar_lab.cluster.LogicalMesh.all_gather`. Its weight
gradient (a contraction over the batch) takes the ``reduce_scatter`` variant of its strategy, and the optimizer
update runs on the shards, so the alias edge back to the stored parameter costs nothing. What makes the difference
with Alpa's weight-update sharding (ZeRO-2: the parameter stored whole, the updated shards all-gathered once per
step) is priced in :mod:`autopar_lab.solve.intra`:

- the gather is paid once per reader of the parameter (its forward matmul, and again its backward one: FSDP
  frees the gathered copy after use; ``conversion_key`` counts it so, as the ILP's per-reader edges do). XLA left
  alone may instead gather once and keep the copy until the backward (it does so for activations, which are
  priced that way): to get the memory saving at run time the step re-gathers, e.g. under ``jax.checkpoint``;
- under a memory limit the parameter's stored shard is resident all step and the gathered copy only at its
  reader (``gathered_param_terms``), so the memory constraint sees the saving and the transient;
- the sequential two-axis solve leaves parameters free in its second pass under a memory limit.

This module names what a plan chose: :func:`gathered_params` lists the parameters stored sharded over an axis
their readers gather them over, and :func:`fsdp_spec` is the stored spec a ZeRO-3 override gives a parameter.

Example (a weight read whole by its matmul, stored split over the 8 data-parallel devices):
    >>> from autopar_lab.sharding.spec import ShardingSpec as S
    >>> str(fsdp_spec(S.parse("RR"), (1024, 4096), (8, 1), (0,)))
    'S0R'
    >>> str(fsdp_spec(S.parse("RS1"), (1024, 4096), (2, 4), (0,)))   # tensor-parallel over axis 1 as well
    'S0S1'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..graph.opgraph import BACKWARD, FORWARD, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, PARAM, OpGraph
from .reshard import plan_reshard
from .spec import ShardingSpec


def is_param_input(graph: OpGraph, op: int) -> bool:
    """Whether ``op`` is the step input of a parameter (what ZeRO-3 / FSDP stores sharded)."""
    node = graph.op(op)
    return node.primitive == INPUT_PRIMITIVE and graph.tensor(node.outputs[0]).kind == PARAM


@dataclass(frozen=True)
class GatheredParam:
    """A parameter stored sharded and all-gathered for its readers (ZeRO-3 / FSDP).

    ``stored``: its spec at rest (what ``to_jax_code`` exports); ``gathered``: the specs its readers take it in;
    ``axes``: the mesh axes it is gathered over; ``roles``: the passes that gather it (``forward``, ``backward``:
    one all-gather each); ``stored_bytes`` / ``full_bytes``: one device's shard, and the gathered tensor (bytes of
    the widest spec a reader takes).
    """

    op: int
    path: str
    stored: ShardingSpec
    gathered: tuple[ShardingSpec, ...]
    axes: tuple[int, ...]
    roles: tuple[str, ...]
    stored_bytes: int
    full_bytes: int

    def describe(self, axis_names: Sequence[str] = ("x", "y")) -> str:
        """One line for the sharding table, in PartitionSpec terms.

        >>> from autopar_lab.sharding.spec import ShardingSpec as S
        >>> GatheredParam(3, "w", S.parse("S0R"), (S.parse("RR"),), (0,), ("forward", "backward"), 8, 64).describe()
        "ZeRO-3/FSDP: stored P('x', None), all-gathered over x to P(None, None) in forward and backward"
        """
        to = ", ".join(str(s.to_partition_spec(axis_names)) for s in self.gathered)
        over = "+".join(axis_names[a] for a in self.axes)
        return (f"ZeRO-3/FSDP: stored {self.stored.to_partition_spec(axis_names)}, all-gathered over {over} to {to} "
                f"in {' and '.join(self.roles)}")


def gathered_params(graph: OpGraph, strategies: Mapping[int, Any], mesh_shape: Sequence[int],
                    ops: Iterable[int] | None = None) -> list[GatheredParam]:
    """The parameters among ``ops`` (default: every operator with a strategy) that ``strategies`` (op -> Strategy)
    store sharded over a mesh axis some reader of theirs (in ``strategies``) all-gathers them over, in graph order."""
    mshape = tuple(int(x) for x in mesh_shape)
    out = []
    for op in (strategies if ops is None else ops):
        if op not in strategies or not is_param_input(graph, op):
            continue
        node = graph.op(op)
        t = graph.tensor(node.outputs[0])
        stored = strategies[op].out_specs[0]
        if not stored.axes:
            continue
        gathered: dict[ShardingSpec, None] = {}
        axes: set[int] = set()
        roles: set[str] = set()
        for c in graph.consumers.get(node.outputs[0], ()):
            cn = graph.op(c)
            if c not in strategies or cn.primitive == OUTPUT_PRIMITIVE:
                continue
            for j, tin in enumerate(cn.inputs):
                if tin != node.outputs[0]:
                    continue
                need = strategies[c].in_specs[j]
                got = {a for kind, axis, _b in plan_reshard(stored, need, t.shape, t.dtype, mshape)
                       if kind == "all_gather" for a in ((axis,) if isinstance(axis, int) else axis)}
                if got:
                    gathered[need] = None
                    axes |= got
                    roles.add(cn.role)
        if axes:
            full = max(s.bytes_per_device(t.shape, t.dtype, mshape) for s in gathered)
            out.append(GatheredParam(op, t.path, stored, tuple(gathered), tuple(sorted(axes)),
                                     tuple(r for r in (FORWARD, BACKWARD) if r in roles),
                                     stored.bytes_per_device(t.shape, t.dtype, mshape), full))
    return sorted(out, key=lambda p: p.op)


def fsdp_spec(spec: ShardingSpec, shape: Sequence[int], mesh_shape: Sequence[int],
              axes: Sequence[int]) -> ShardingSpec | None:
    """``spec`` with mesh ``axes`` (the data-parallel ones) added on the first dimension they divide that no other
    axis splits: how ZeRO-3 stores a parameter its readers use as ``spec``. ``spec`` itself when it already splits
    over them; None when no dimension can take them evenly (the parameter stays as it is)."""
    useful = tuple(a for a in axes if int(mesh_shape[a]) > 1)
    if not useful or set(useful) <= spec.axes:
        return spec
    if set(useful) & spec.axes:
        return None
    for d, dim in enumerate(spec.dims):
        if dim:
            continue
        cand = ShardingSpec(tuple(tuple(useful) if i == d else x for i, x in enumerate(spec.dims)))
        if cand.is_valid(tuple(shape), tuple(mesh_shape)):
            return cand
    return None


__all__ = ["GatheredParam", "fsdp_spec", "gathered_params", "is_param_input"]
