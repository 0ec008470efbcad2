"""Layer costs: an intra-operator plan's cost split by layer, and the bytes crossing each cut between layers.

These are what the stage-cost formula (:mod:`autopar_lab.pricing.stage`) adds up over a stage's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..graph.opgraph import BATCH, FORWARD, INPUT_PRIMITIVE, OpGraph
from ..solve.intra import StrategyCache, conversions, memory_terms

if TYPE_CHECKING:
    from ..solve.intra import IntraPlan

#: Operators that launch a kernel of their own per microbatch (each costs ``LAUNCH_OVERHEAD_S``, see
#: :func:`autopar_lab.pricing.stage.stage_cost`).
HEAVY_PRIMITIVES = frozenset(["dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "gather",
                              "scatter-add", "scatter_add", "argmax", "cumsum"])


@dataclass(frozen=True)
class LayerCost:
    """One layer on one logical mesh, per training step at the graph's batch (bytes per device)."""

    fwd_s: float
    bwd_s: float  # backward + optimizer update
    compute_s: float
    comm_s: float
    reshard_s: float
    static_bytes: float
    act_bytes: float
    heavy_fwd: int
    heavy_bwd: int


def layer_costs(graph: OpGraph, plan: IntraPlan, layer_names: Sequence[str],
                cache: StrategyCache | None = None) -> list[LayerCost]:
    """Split an intra plan's cost by layer: each operator counts in its layer (operators without one in the last
    layer), each resharding in its consumer's layer."""
    index: dict[str | None, int] = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    acc: list[dict[str, Any]] = [
        dict(fwd=0.0, bwd=0.0, compute=0.0, comm=0.0, reshard=0.0, static=0.0, act=0.0, hf=0, hb=0)
        for _ in layer_names]
    cache = cache or StrategyCache(plan.mesh)
    mshape = tuple(plan.mesh.shape)

    def slot(op):
        return acc[index.get(graph.op(op).layer, last)]

    for op in plan.ops:
        node, s = graph.op(op), plan.strategies[op]
        a = slot(op)
        a["fwd" if node.role == FORWARD else "bwd"] += s.cost
        a["compute"] += s.compute_s
        a["comm"] += s.comm_s
        if node.primitive in HEAVY_PRIMITIVES:
            a["hf" if node.role == FORWARD else "hb"] += 1
        for kind, nbytes in memory_terms(graph, node, s, mshape):
            a[kind] += nbytes
    for _u, v, is_alias, _t, _src, _dst, c in conversions(graph, plan.ops, plan.strategies, cache):
        a = slot(v)
        a["reshard"] += c
        a["fwd" if graph.op(v).role == FORWARD and not is_alias else "bwd"] += c
    return [LayerCost(a["fwd"], a["bwd"], a["compute"], a["comm"], a["reshard"], a["static"], a["act"], a["hf"],
                      a["hb"]) for a in acc]


def cut_bytes(graph: OpGraph, layer_names: Sequence[str]) -> list[float]:
    """Activation bytes (whole batch) crossing the cut in front of each layer 1..L-1 in the forward pass."""
    index: dict[str | None, int] = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    out = [0.0] * max(len(layer_names) - 1, 0)
    for node in graph:
        if node.role != FORWARD or node.primitive == INPUT_PRIMITIVE:
            continue
        src = index.get(node.layer, last)
        for t in node.outputs:
            far = max((index.get(graph.op(c).layer, last) for c in graph.consumers.get(t, ())
                       if graph.op(c).role == FORWARD), default=src)
            for k in range(src + 1, far + 1):
                out[k - 1] += graph.tensor(t).nbytes
    return out


def batch_size(graph: OpGraph) -> int:
    """The step's batch size: the largest leading dimension of its batch inputs (1 without any)."""
    sizes = [graph.tensor(t).shape[0] for t in graph.inputs if graph.tensor(t).kind == BATCH and graph.tensor(t).shape]
    return max(sizes) if sizes else 1


__all__ = ["HEAVY_PRIMITIVES", "LayerCost", "layer_costs", "cut_bytes", "batch_size"]
