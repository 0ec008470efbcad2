"""Ring attention, executed: the matmuls a plan marks ``[ring@a]`` (context parallelism, priced by
:mod:`autopar_lab.sharding.ring`) run as a ring of ``shard_map`` steps instead of XLA's own algorithm.

A ring strategy keeps both operands of a batched ``dot_general`` split along their sequence over mesh axis ``a``:
the *kept* operand along a free sequence dimension (its block of rows stays put), the *rotated* one along a
sequence dimension of the same length. :func:`ring_dot_general` runs it in ``n`` steps on each device: multiply the
kept block by the rotated block held now, then pass that block to the next device on the ring
(``jax.lax.ppermute``; XLA's ``collective-permute``) and receive the previous device's. After ``t`` steps device
``i`` holds block ``(i - t) mod n``, so it knows which slice of the result (or of the kept block) the product
belongs to:

- the rotated operand's sequence is *contracted* (``P V``, and the gradients that sum over the sequence): each
  step multiplies the block by the kept operand's matching slice of the contracted dimension, and the partial
  products are summed;
- it is *free* (``Q K^T``): each step fills its block of columns of the result.

Every device ends with its block of the result, split as the strategy's output spec says, having never held the
whole rotated operand (what context parallelism saves over the all-gather form).

- :func:`usable_layout`: whether a ring-marked strategy can run on a mesh for given operand shapes (a microbatch's
  shapes may not divide like the batch the plan was priced on; such an operator falls back to XLA's algorithm);
- :func:`ring_binds`: operator id -> the function that runs it, for every ring-marked operator of a graph, what the
  replay (:func:`autopar_lab.validate.replay_with_shardings`, ``binds=``) and the pipeline stages
  (:meth:`autopar_lab.runtime.partition.StagedModel.ring_ops`) call in place of ``dot_general``.

:func:`ring_dot_general` reads nothing but ``jax``:
:func:`autopar_lab.export.to_jax_code` writes its source into the exported script as it is.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax

from ..sharding.ring import is_ring, ring_axes_used
from ..sharding.spec import DEFAULT_AXIS_NAMES

__all__ = ["ring_binds", "ring_dot_general", "rotated_operand", "usable_layout"]


def ring_dot_general(lhs, rhs, *, dimension_numbers, mesh, in_specs, out_spec, axis, rotate, precision=None,
                     preferred_element_type=None):
    """``jax.lax.dot_general(lhs, rhs, dimension_numbers)`` with operand ``rotate`` (0: lhs, 1: rhs) passed around
    a ring over mesh axis ``axis`` (a name), each device multiplying its block of the other operand by the block
    it holds; ``in_specs`` (two PartitionSpecs) and ``out_spec`` lay the operands and the result out on ``mesh``,
    both operands split along a sequence dimension over ``axis``."""
    (lc, rc), (lb, rb) = dimension_numbers
    cont, batch = (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))
    n = int(mesh.shape[axis])
    y, x = int(rotate), 1 - int(rotate)

    def split_dim(spec):  # the dimension a PartitionSpec splits over `axis`
        for d, e in enumerate(spec):
            if e == axis or (isinstance(e, tuple) and axis in e):
                return d
        raise ValueError(f"{spec} does not split any dimension over {axis!r}")

    dy = split_dim(in_specs[y])
    shapes = (lhs.shape, rhs.shape)
    free = [[d for d in range(len(s)) if d not in cont[i] and d not in batch[i]] for i, s in enumerate(shapes)]
    contracted = dy in cont[y]
    # where the rotated block's products go: a slice of the kept operand's contracted dimension, or of the result
    cx = cont[x][cont[y].index(dy)] if contracted else None
    pos = None if contracted else len(lb) + (free[0].index(dy) if y == 0 else len(free[0]) + free[1].index(dy))
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(a, b):
        blocks = [a, b]
        held = blocks[y]
        blk = held.shape[dy]
        me = jax.lax.axis_index(axis)
        acc = None
        for t in range(n):
            j = (me - t) % n  # the block this device holds after t steps
            pair = list(blocks)
            pair[y] = held
            if contracted:
                pair[x] = jax.lax.dynamic_slice_in_dim(blocks[x], j * blk, blk, axis=cx)
            part = jax.lax.dot_general(pair[0], pair[1], dimension_numbers, precision=precision,
                                       preferred_element_type=preferred_element_type)
            if contracted:
                acc = part if acc is None else acc + part
            else:
                if acc is None:
                    shape = list(part.shape)
                    shape[pos] = blk * n
                    acc = jax.numpy.zeros(shape, part.dtype)
                acc = jax.lax.dynamic_update_slice_in_dim(acc, part, j * blk, axis=pos)
            if t < n - 1:  # the last block needs no passing on
                held = jax.lax.ppermute(held, axis, ring)
        return acc

    # the operands laid out as the ring reads them (the plan's reshards, if they are not already)
    lhs, rhs = (jax.lax.with_sharding_constraint(v, jax.sharding.NamedSharding(mesh, sp))
                for v, sp in zip((lhs, rhs), in_specs))
    # check_vma off: the result starts as zeros that every step's block (device-varying) is written into, which the
    # varying-axes check cannot type; the ring's collectives are the explicit ppermutes, nothing is left to insert
    fn = jax.shard_map(body, mesh=mesh, in_specs=(in_specs[0], in_specs[1]), out_specs=out_spec, check_vma=False)
    return fn(lhs, rhs)


def rotated_operand(strategy, dimension_numbers, in_shapes) -> int:
    """Which operand (0: lhs, 1: rhs) a ring strategy passes around the ring: the other one's free dimension split
    over the ring axis is the output's split dimension."""
    (axis,) = ring_axes_used(strategy)
    (lc, rc), (lb, rb) = dimension_numbers
    cont, batch = (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))
    free = [[d for d in range(len(s)) if d not in cont[i] and d not in batch[i]] for i, s in enumerate(in_shapes)]
    pos = next(i for i, d in enumerate(strategy.out_specs[0].dims) if axis in d)
    return 1 if pos < len(lb) + len(free[0]) else 0


def usable_layout(strategy, in_shapes: Sequence[Sequence[int]], out_shape: Sequence[int],
                  mesh_shape: Sequence[int]) -> bool:
    """Whether ring strategy ``strategy`` can run on a mesh of ``mesh_shape`` for operands of ``in_shapes``: one
    ring axis of more than one device, every spec dividing its shape (a microbatch may not split like the batch the
    plan was priced on)."""
    if not is_ring(strategy) or len(ring_axes_used(strategy)) != 1 or len(strategy.in_specs) != 2:
        return False
    mshape = tuple(int(s) for s in mesh_shape)
    (axis,) = ring_axes_used(strategy)
    if mshape[axis] <= 1 or any(sum(axis in d for d in s.dims) != 1 for s in strategy.in_specs):
        return False  # the ring needs each operand split along exactly one (sequence) dimension over its axis
    return (all(s.is_valid(tuple(sh), mshape) for s, sh in zip(strategy.in_specs, in_shapes))
            and strategy.out_specs[0].is_valid(tuple(out_shape), mshape))


def ring_binds(graph, strategy_of: Callable[[int], Any] | Mapping[int, Any], mesh: jax.sharding.Mesh,
               axis_names: Sequence[str] = DEFAULT_AXIS_NAMES, ops=None) -> dict[int, Callable]:
    """Operator id -> ``fn(lhs, rhs, **dot_general params)`` running it as a ring, for every ``dot_general`` of
    ``graph`` (among ``ops``, default all) whose strategy (``strategy_of(op)`` or ``strategy_of[op]``) is a ring
    usable on ``mesh`` at the graph's shapes. Operators left out run as they are."""
    lookup = strategy_of.get if isinstance(strategy_of, Mapping) else strategy_of
    mshape = tuple(int(s) for s in mesh.devices.shape)
    out: dict[int, Callable] = {}
    for op in (graph.ops if ops is None else ops):
        node = graph.op(op)
        if node.primitive != "dot_general":
            continue
        s = lookup(op)
        if s is None or not usable_layout(s, node.in_shapes, node.out_shapes[0], mshape):
            continue
        dn = node.params["dimension_numbers"]
        out[int(op)] = _bound(s, rotated_operand(s, dn, node.in_shapes), mesh, tuple(axis_names))
    return out


def _bound(strategy, rotate: int, mesh, axis_names: tuple[str, ...]) -> Callable:
    axis = axis_names[ring_axes_used(strategy)[0]]
    in_specs = tuple(sp.to_partition_spec(axis_names) for sp in strategy.in_specs)
    out_spec = strategy.out_specs[0].to_partition_spec(axis_names)

    def run(lhs, rhs, *, dimension_numbers, precision=None, preferred_element_type=None, **_other):
        # other bind parameters (an out_sharding) are the layout the ring's out_spec already fixes
        return ring_dot_general(lhs, rhs, dimension_numbers=dimension_numbers, mesh=mesh, in_specs=in_specs,
                                out_spec=out_spec, axis=axis, rotate=rotate, precision=precision,
                                preferred_element_type=preferred_element_type)

    return run

