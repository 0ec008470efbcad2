"""One device's view of a step: each operator's seconds, the kernels they run in, each layer's cost.

What a roofline lesson reads (``notebooks/07_rooflines_mfu``), priced by the formulas every plan is priced with:

- :func:`op_seconds`: the seconds one device spends on each operator, either as its share of the kernel the
  compiler fuses it into (:mod:`autopar_lab.graph.fusion`; flash attention where the device's preset runs it) or as a
  kernel of its own (reading every input from memory and writing every output back), at the roofline
  ``max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth)``
  (:func:`~autopar_lab.sharding.strategies.kernel_time`);
- :func:`kernel_costs`: the kernels of the step, each with its kind, the FLOPs it runs, the bytes it moves and its
  seconds (without its launch, ``device.efficiency.kernel_launch_s`` each);
- :func:`costs_by_layer`: an intra-operator plan's cost split by layer (:class:`~autopar_lab.pricing.layers.LayerCost`).

>>> import jax, jax.numpy as jnp
>>> import autopar_lab as al
>>> g = al.trace(lambda x: jnp.sum(jnp.exp(jnp.tanh(x))), jax.ShapeDtypeStruct((1 << 20,), jnp.float32))
>>> h100 = al.Cluster.preset("dgx-h100")
>>> [(k.kind, k.bytes) for k in kernel_costs(g, h100) if k.flops]   # reads x once, writes the sum
[('reduce', 4194308.0)]
>>> sum(op_seconds(g, h100, fused=False).values()) > 4 * sum(op_seconds(g, h100).values())
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..graph.fusion import attach_kernel_roles, kernel_view
from ..graph.opgraph import OpGraph
from ..sharding.strategies import price, strategies_for
from .layers import LayerCost, layer_costs

if TYPE_CHECKING:
    from ..solve.intra import IntraPlan

__all__ = ["KernelCost", "costs_by_layer", "kernel_costs", "op_seconds"]


@dataclass(frozen=True)
class KernelCost:
    """One kernel of a step on one device: its kind (``"gemm"``, ``"attention"``, ``"loop"``, ``"reduce"``,
    ``"library"``), layer, role (forward, backward, update) and operators (graph order); ``flops``: the FLOPs it
    runs (its operators', half of them in a causal flash-attention kernel, which skips the masked half); ``bytes``:
    what it reads from and writes to memory (a tensor that stays inside the kernel moves none); ``seconds``: its
    operators' priced seconds (:func:`op_seconds`), without the kernel's launch."""

    kind: str
    layer: str | None
    role: str
    ops: tuple[int, ...]
    flops: float
    bytes: float
    seconds: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved (infinite for a kernel that moves none)."""
        return self.flops / self.bytes if self.bytes else math.inf


def _one_device(cluster: Any) -> Any:
    return cluster.logical_mesh((1, 1), (1, 1))


def op_seconds(graph: OpGraph, cluster: Any, *, fused: bool = True) -> dict[int, float]:
    """Seconds one device of ``cluster`` spends on each operator of ``graph`` (all of it, on one device): with
    ``fused`` (the default, how every plan is priced) its share of the kernel it runs in, so that the sum over a
    kernel's operators is the kernel's time (an operator folded into its readers costs 0); else as a kernel of its
    own. Launches are not included (one per kernel, ``cluster.device.efficiency.kernel_launch_s``)."""
    if fused:
        attach_kernel_roles(graph, eager=not cluster.device.efficiency.kernel_fusion)
    one = _one_device(cluster)
    return {op: price(graph.op(op), strategies_for(graph.op(op), one)[0], one, alone=not fused).compute_s
            for op in graph.ops}


def kernel_costs(graph: OpGraph, cluster: Any) -> list[KernelCost]:
    """The kernels of ``graph`` on one device of ``cluster``, as the compiler fuses its operators (flash attention
    where ``cluster.device.efficiency.flash_attention`` says so; one operator a kernel where ``kernel_fusion`` is
    off: eager execution), in graph order. The operators recomputed inside
    the kernels that read them (a cheap elementwise producer) are in none; their seconds are in :func:`op_seconds`."""
    eff = cluster.device.efficiency
    view = kernel_view(graph, eff.flash_attention, eager=not eff.kernel_fusion)
    seconds = op_seconds(graph, cluster)
    out = []
    for k in view.kernels:
        moved = 0.0
        for op in k.ops:
            role, node = view.roles[op], graph.op(op)
            ins = [graph.tensor(t).nbytes for t in node.inputs]
            outs = [graph.tensor(t).nbytes for t in node.outputs]
            moved += (sum(f * x for f, x in zip(role.reads, ins)) + sum(f * x for f, x in zip(role.writes, outs))
                      + role.extra_bytes * sum(outs))
        flops = sum(graph.op(op).flops for op in k.ops) * view.roles[k.root].work
        out.append(KernelCost(k.kind, k.layer, k.role, tuple(k.ops), flops, moved, sum(seconds[op] for op in k.ops)))
    return out


def costs_by_layer(graph: OpGraph, plan: IntraPlan) -> dict[str, LayerCost]:
    """``plan``'s cost (an intra-operator plan of ``graph``: :func:`autopar_lab.solve_intra`) split by layer, in the
    graph's layer order: each operator in its layer, each resharding in its consumer's, each kernel's launch in its
    root's (see :class:`~autopar_lab.pricing.layers.LayerCost` for the fields)."""
    names = list(graph.layers)
    return dict(zip(names, layer_costs(graph, plan, names)))
