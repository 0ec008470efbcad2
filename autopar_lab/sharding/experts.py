"""Expert parallelism (MoE) in the intra-operator space: the expert axis of the expert einsums split over the mesh.

The ILP already holds this choice; nothing new is enumerated. An expert matmul of a GShard layer
(``"egcm,emf->egcf"``) is a ``dot_general`` batched over the expert dimension ``e`` of a *parameter* (the stacked
expert weights ``[E, H, F]``): :func:`~autopar_lab.sharding.rules.dot_general_rule` may split that batch
dimension like any other, which stores each device's experts only (``E / n`` of them) and runs them on the tokens
routed to it. The tokens arrive split over the batch (the group dimension ``g``), so the edge from the dispatch einsum
(``"gsec,gsm->egcm"``) to the expert matmul moves the mesh axis from ``g`` to ``e``: an ``all_to_all``
(:mod:`~autopar_lab.sharding.reshard`), and the combine back from ``e`` to ``g`` another, in the forward and again
in the backward. Its buffer B is the dispatched tensor ``[E, G, C, M]``: E x C = capacity_factor x group_size slots
per group, so B = capacity_factor x tokens x hidden x bytes, and one device sends ``(n - 1) / n^2`` of it
(:meth:`~autopar_lab.cluster.LogicalMesh.all_to_all`).

This module names what a plan chose: :func:`expert_matmuls` finds the expert einsums of a graph (forward matmuls
batched over a parameter's leading dimension), :func:`expert_layers` groups them per layer with the mesh axes the
experts are split over and the all-to-alls the layer's tokens take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..graph.opgraph import FORWARD, OpGraph
from .fsdp import is_param_input
from .reshard import Collective, collective_time, plan_reshard

#: Operators a parameter passes through unchanged in shape on its way to a matmul (a mixed-precision cast).
_PASS_THROUGH = frozenset(["convert_element_type", "copy", "copy_p"])


def _param_source(graph: OpGraph, tensor: int) -> int | None:
    """The parameter input operator ``tensor`` is (possibly cast), else None."""
    for _ in range(4):
        u = graph.tensor(tensor).producer
        if u is None:
            return None
        if is_param_input(graph, u):
            return u
        node = graph.op(u)
        if node.primitive not in _PASS_THROUGH or len(node.inputs) != 1:
            return None
        tensor = node.inputs[0]
    return None


def expert_matmuls(graph: OpGraph) -> dict[int, tuple[int, int, int]]:
    """Forward matmul -> ``(operand index, expert dimension of that operand, parameter operator)`` for every
    ``dot_general`` whose operand of a batch dimension is a parameter: the weights of experts batched over ``e``.
    (Dense layers' weights are never batch dimensions; attention's batch dimensions are activations.)"""
    out = {}
    for node in graph:
        if node.primitive != "dot_general" or node.role != FORWARD:
            continue
        (_lc, _rc), (lb, rb) = node.params["dimension_numbers"]
        for j, bdims in ((0, lb), (1, rb)):
            if bdims:
                p = _param_source(graph, node.inputs[j])
                if p is not None:
                    out[node.id] = (j, int(bdims[0]), p)
                    break
    return out


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer of a plan: its expert matmuls, the mesh axes its experts are split over (``()``: replicated
    experts, every device runs all of them) and the all-to-alls its tokens take (``(kind, axis, bytes of B)``, forward
    and backward, on the graph's whole batch) with their seconds on the mesh."""

    layer: str
    ops: tuple[int, ...]
    num_experts: int
    axes: tuple[int, ...]
    degree: int
    all_to_alls: tuple[Collective, ...]
    all_to_all_s: float

    @property
    def all_to_all_bytes(self) -> float:
        return float(sum(b for _k, _a, b in self.all_to_alls))

    def describe(self, axis_names: Sequence[str] = ("x", "y")) -> str:
        """One line for the sharding table and the plan's summary.

        >>> ExpertLayer("layer_1", (5,), 8, (0,), 8, (("all_to_all", 0, 2**20),) * 4, 1e-3).describe()
        'expert parallel EP=8: 8 experts split over x (1 per device); 4 all-to-alls of 1 MiB (1 ms a step)'
        """
        if not self.axes:
            return f"experts replicated: all {self.num_experts} experts on every device (EP=1)"
        over = "+".join(axis_names[a] for a in self.axes)
        mib = self.all_to_all_bytes / len(self.all_to_alls) / 2**20 if self.all_to_alls else 0.0
        cols = (f"{len(self.all_to_alls)} all-to-alls of {mib:.3g} MiB ({self.all_to_all_s * 1e3:.3g} ms a step)"
                if self.all_to_alls else "no all-to-all (tokens already split like the experts)")
        return (f"expert parallel EP={self.degree}: {self.num_experts} experts split over {over} "
                f"({self.num_experts // self.degree} per device); {cols}")


def expert_layers(graph: OpGraph, strategies: Mapping[int, Any], mesh, ops=None) -> list[ExpertLayer]:
    """The MoE layers among ``ops`` (default: every operator with a strategy), in graph order: per layer the expert
    matmuls, the mesh axes their expert dimension is split over (the widest of them) and the ``all_to_all``
    reshardings into the layer's operators (forward and backward), priced on ``mesh`` (a
    :class:`~autopar_lab.cluster.LogicalMesh`)."""
    mshape = tuple(int(x) for x in mesh.shape)
    keep = set(strategies if ops is None else ops) & set(strategies)
    mats = expert_matmuls(graph)
    by_layer: dict[str, list[int]] = {}
    for op in mats:
        if op in keep:
            by_layer.setdefault(graph.op(op).layer or "", []).append(op)
    out = []
    for layer, mm in by_layer.items():
        best: tuple[int, ...] = ()
        num_experts = 0
        for op in mm:
            j, d, _p = mats[op]
            num_experts = max(num_experts, int(graph.op(op).in_shapes[j][d]))
            axes = tuple(a for a in strategies[op].in_specs[j].dims[d] if mshape[a] > 1)
            if math.prod(mshape[a] for a in axes) > math.prod(mshape[a] for a in best):
                best = axes
        cols = layer_all_to_alls(graph, strategies, mshape, layer, keep, num_experts)
        # the layer's token exchanges, under the cluster's node-limited routing where the model declares one
        secs = sum(collective_time(mesh, "routed_all_to_all", b, a) for _k, a, b in cols)
        out.append(ExpertLayer(layer, tuple(sorted(mm)), num_experts, best,
                               math.prod(mshape[a] for a in best), cols, float(secs)))
    return sorted(out, key=lambda e: e.ops[0])


def layer_all_to_alls(graph: OpGraph, strategies: Mapping[int, Any], mesh_shape: Sequence[int], layer: str,
                      ops, num_experts: int) -> tuple[Collective, ...]:
    """The token exchanges of an MoE layer: the ``all_to_all`` reshardings on edges into operators of ``layer``
    (forward and backward: a backward operator's ``layer`` is its forward's) that move a mesh axis onto or off a
    dimension of ``num_experts`` (the expert dimension), one per tensor and spec pair (XLA converts once for every
    reader). Other all-to-alls of the layer (attention's, say) are not the experts'."""
    out: list[Collective] = []
    seen = set()
    for v in sorted(ops):
        node = graph.op(v)
        if node.layer != layer:
            continue
        for j, t in enumerate(node.inputs):
            u = graph.tensor(t).producer
            if u is None or u not in strategies:
                continue
            src, dst = strategies[u].out_specs[graph.op(u).outputs.index(t)], strategies[v].in_specs[j]
            info = graph.tensor(t)
            if src == dst or not info.shape or (t, src, dst) in seen:
                continue
            seen.add((t, src, dst))
            for c in plan_reshard(src, dst, info.shape, info.dtype, mesh_shape):
                moved = (c[1],) if isinstance(c[1], int) else tuple(c[1])
                dims = {spec.dim_of(a) for spec in (src, dst) for a in moved} - {None}
                if c[0] == "all_to_all" and any(int(info.shape[d]) == num_experts for d in dims):
                    out.append(c)
    return tuple(out)


__all__ = ["ExpertLayer", "expert_layers", "expert_matmuls", "layer_all_to_alls"]
