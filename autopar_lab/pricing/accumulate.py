"""Gradients accumulated unsharded between microbatches (FSDP2 without a gradient sync), their memory priced.

FSDP2 (PyTorch's ``fully_shard``) reduce-scatters each layer's gradient as soon as its backward ends, so a device
holds its shard of the gradients only. A framework that accumulates gradients over several microbatches may skip that
reduction on every microbatch but the last (``module.set_requires_gradient_sync(False)``: KempnerForge's
``maybe_no_sync``, ``kempnerforge/training/grad.py``; torchtitan reduce-scatters every microbatch). FSDP2 then keeps
each parameter's gradient *unsharded* from one microbatch to the next, and where its mixed-precision policy reduces
in another dtype than the parameters' (``MixedPrecisionPolicy(reduce_dtype=torch.float32)``, KempnerForge's
``default_mp_policy`` and torchtitan's default), it upcasts the gradient to that dtype to accumulate it
(``FSDPParam.to_accumulated_grad_if_needed``: ``unsharded_accumulated_grad = grad.to(reduce_dtype)``). The sharded
gradient appears only at the last microbatch's reduce-scatter (the optimizer's ``zero_grad`` set it to None), so
through the last microbatch's forward and the start of its backward, where the step's peak is, each device holds

    unsharded bytes = sum over the stage's parameters of (elements / tensor split) x 4  (float32)

the parameters gathered over the FSDP group but still split by the other axes (tensor parallelism), in place of its
shard of the gradients. :func:`accumulated_layer_costs` prices each layer's ``grad_bytes`` so (a plan's
``stage_pins["accumulate"] = "unsharded"``, ``fsdp_plan(accumulate_unsharded=True)``). With one microbatch nothing is
accumulated and nothing changes. Time is unchanged: the cost model already reduces the gradients once a step, behind
the last microbatch's backward, which is what skipping the sync does.

An FSDP2 group of one device (KempnerForge wraps a tensor-parallel model so, ``dp_shard=1``, for its fused
optimizer's DTensors) does the same: its gradient is then the tensor-parallel shard, upcast to float32.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import TYPE_CHECKING, Sequence

from ..graph.opgraph import OpGraph
from .zero import planned_params, zero_group

if TYPE_CHECKING:
    from ..solve.intra import IntraPlan
    from .layers import LayerCost
    from .table import CostTable

__all__ = ["ACCUMULATIONS", "REDUCE_BYTES", "accumulated_layer_costs", "check_accumulate", "unsharded_grad_bytes"]

#: What a plan may name in ``stage_pins["accumulate"]``: "unsharded", the gradients of every microbatch but the last
#: kept unsharded in the reduce dtype (FSDP2 without a gradient sync between microbatches).
ACCUMULATIONS = ("unsharded",)

#: Bytes an element of FSDP2's reduce dtype takes: float32, KempnerForge's ``default_mp_policy`` and torchtitan's
#: ``mixed_precision_reduce`` default.
REDUCE_BYTES = 4

# table -> {id of the IntraPlan: (the IntraPlan, per solve-graph layer: unsharded gradient bytes)}
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_accumulate(value: str | None) -> str | None:
    """``value`` if it is None or one of :data:`ACCUMULATIONS`, else one clear error."""
    if value is not None and value not in ACCUMULATIONS:
        raise ValueError(f"accumulate must be None or one of {', '.join(map(repr, ACCUMULATIONS))}, got {value!r}")
    return value


def unsharded_grad_bytes(graph: OpGraph, intra: IntraPlan, layer_names: Sequence[str],
                         reduce_bytes: int = REDUCE_BYTES) -> list[float]:
    """Per layer of ``graph`` (in ``layer_names``; a parameter without a layer counts in the last), the bytes per
    device of its parameters' gradients held unsharded over the FSDP group (the axes ZeRO splits the optimizer state
    over, :func:`~autopar_lab.pricing.zero.zero_group`) and split over every other axis the parameter's spec splits,
    ``reduce_bytes`` an element (see the module docstring)."""
    index: dict[str | None, int] = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    out = [0.0] * len(layer_names)
    mshape = tuple(intra.mesh.shape)
    group = set(zero_group(graph, intra))
    for op, info, spec in planned_params(graph, intra):
        split = math.prod(int(mshape[a]) for a in spec.axes if a not in group)
        out[index.get(graph.op(op).layer, last)] += math.prod(info.shape) * reduce_bytes / split
    return out


def accumulated_layer_costs(table: CostTable, intra: IntraPlan, costs: Sequence[LayerCost], accumulate: str | None,
                            microbatches: int) -> list[LayerCost]:
    """``costs`` (full-graph layer costs of ``intra``, a solution on ``table.solve_graph``) with each layer's gradient
    held as ``accumulate`` says (see the module docstring): "unsharded", its parameters' float32 gradients gathered
    over the FSDP group in place of ``grad_bytes``, where ``microbatches`` > 1; None, or one microbatch: ``costs``."""
    check_accumulate(accumulate)
    if accumulate is None or microbatches <= 1:
        return list(costs)
    memo = _MEMO.setdefault(table, {})
    hit = memo.get(id(intra))
    if hit is None or hit[0] is not intra:
        g = table.solve_graph
        hit = memo[id(intra)] = (intra, unsharded_grad_bytes(g, intra, list(g.layers) or [""]))
    held = hit[1]
    out = []
    for k, c in enumerate(costs):
        grad = held[table.layer_map[k]]
        out.append(dataclasses.replace(c, grad_bytes=grad, static_bytes=c.static_bytes - c.grad_bytes + grad))
    return out
