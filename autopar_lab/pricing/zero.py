"""ZeRO's memory per device (Rajbhandari et al., SC20), from the specs a stage stores its state in.

A parameter's input operator is its fp32 master weight in a mixed-precision step; the cost model counts the master,
the half-precision copy the step computes with and its gradient in that operator's spec
(:func:`~autopar_lab.solve.memterms.memory_terms`), and Adam's moments in their own operators' specs. ZeRO splits them
differently, each stage over the data-parallel group:

* stage 1 (Megatron-LM's distributed optimizer): the optimizer state *and the fp32 master weights* (the "12 bytes a
  parameter" of mixed-precision Adam), the half-precision parameters and gradients whole: ``4 + 12 / d`` bytes a
  parameter in fp16 (``6 + 12 / d`` with bf16's fp32 gradients);
* stage 2: the gradients too (reduce-scattered into the optimizer's shards): ``2 + 14 / d`` (``2 + 16 / d``);
* stage 3: the parameters too, each gathered for its readers and freed after use (FSDP's reshard after forward):
  ``16 / d`` (``18 / d``) at rest, the gathered copies transient.

The layouts store the optimizer state split over the group (stages 1-3) and the parameters too (stage 3)
(:mod:`autopar_lab.layouts.shardpins`); :func:`zero_layer_costs` then moves the master weights (1+) and gradients
(2+) to the optimizer state's split and, for stage 3, drops the gathered parameter copies the cost model otherwise
keeps all step. Nothing changes where the state is stored whole (stage 0), so a plan's time is its strategies' and
its memory is ZeRO's. Not counted: the one layer's gathered weights stage 3 holds at a time (and the next one's,
prefetched), a transient the size of a layer's half-precision weights.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Sequence

from ..graph.opgraph import INPUT_PRIMITIVE, OPT_STATE, PARAM, OpGraph
from ..solve.intra import StrategyCache, conversions
from ..solve.memterms import STATIC_KINDS, held_copies, memory_terms

if TYPE_CHECKING:
    from ..solve.intra import IntraPlan
    from .layers import LayerCost
    from .table import CostTable

__all__ = ["ZERO_STAGES", "opt_states_of", "zero_deltas", "zero_layer_costs"]

#: The stages :func:`zero_layer_costs` prices.
ZERO_STAGES = (0, 1, 2, 3)

# table -> {(id of the IntraPlan, stage): (the IntraPlan, per solve-graph layer {kind: bytes to add})}
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def opt_states_of(graph: OpGraph) -> dict[int, list[int]]:
    """Parameter input operator -> the optimizer-state inputs that belong to it (Adam's moments): those of its shape
    whose pytree path ends with the parameter's path inside its argument (``args[1][0].mu['layers'][0]['qkv']['w']``
    for ``args[0]['layers'][0]['qkv']['w']``). Memoised on the graph."""
    hit = graph.__dict__.get("_zero_opt_states")
    if hit is not None:
        return hit
    params: dict[tuple, list[tuple[str, int]]] = {}
    states = []
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive != INPUT_PRIMITIVE:
            continue
        info = graph.tensor(node.outputs[0])
        if not info.shape:
            continue
        if info.kind == PARAM:
            suffix = info.path[info.path.find("]") + 1:] if info.path.startswith("args[") else info.path
            params.setdefault(tuple(info.shape), []).append((suffix, op))
        elif info.kind == OPT_STATE:
            states.append((info.path, tuple(info.shape), op))
    out: dict[int, list[int]] = {}
    for path, shape, op in states:
        # the longest parameter path the state's path ends with (``['w']`` must not take ``['qkv']['w']``'s state)
        cands = [(len(s), p) for s, p in params.get(shape, ()) if s and path.endswith(s)]
        if cands:
            out.setdefault(max(cands)[1], []).append(op)
    graph.__dict__["_zero_opt_states"] = out
    return out


def zero_deltas(graph: OpGraph, intra: IntraPlan, layer_names: Sequence[str], zero: int,
                cache: StrategyCache | None = None) -> list[dict[str, float]]:
    """Per layer of ``graph`` (in ``layer_names``; an operator without a layer counts in the last), the bytes per
    device ZeRO stage ``zero`` adds to each static part (``master``, ``grad``, ``copies``: negative, it saves them)
    over what ``intra``'s strategies hold (see the module docstring). ``cache``: the mesh's strategy cache."""
    index: dict[str | None, int] = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    out: list[dict[str, float]] = [{k: 0.0 for k in STATIC_KINDS} for _ in layer_names]
    if zero == 0:
        return out
    mshape = tuple(intra.mesh.shape)
    fused = intra.mesh.cluster.device.efficiency.flash_attention
    for p, states in opt_states_of(graph).items():
        if p not in intra.strategies or states[0] not in intra.strategies:
            continue
        info = graph.tensor(graph.op(p).outputs[0])
        own = intra.strategies[p].out_specs[0].bytes_per_device(info.shape, info.dtype, mshape)
        opt = intra.strategies[states[0]].out_specs[0].bytes_per_device(info.shape, info.dtype, mshape)
        if not own or own == opt:
            continue
        ratio = opt / own  # the optimizer state's share of what the parameter's own spec holds
        terms = dict(memory_terms(graph, graph.op(p), intra.strategies[p], mshape, fused))
        slot = out[index.get(graph.op(p).layer, last)]
        if "master" in terms:
            slot["master"] += terms["master"] * (ratio - 1)
        if zero >= 2:
            slot["grad"] += terms["grad"] * (ratio - 1)
    if zero >= 3:
        convs = list(conversions(graph, intra.ops, intra.strategies, cache or StrategyCache(intra.mesh)))
        for v, nbytes in held_copies(graph, convs, mshape).values():
            out[index.get(graph.op(v).layer, last)]["copies"] -= nbytes
    return out


def zero_layer_costs(table: CostTable, intra: IntraPlan, costs: Sequence[LayerCost], zero: int) -> list[LayerCost]:
    """``costs`` (full-graph layer costs of ``intra``, a solution on ``table.solve_graph``) with ZeRO stage ``zero``'s
    memory (see the module docstring); the times are unchanged."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    memo = _MEMO.setdefault(table, {})
    hit = memo.get((id(intra), zero))
    if hit is None or hit[0] is not intra:
        g = table.solve_graph
        hit = memo[(id(intra), zero)] = (intra, zero_deltas(g, intra, list(g.layers) or [""], zero,
                                                              table.strategy_cache(intra.mesh)))
    deltas = hit[1]
    out = []
    for k, c in enumerate(costs):
        d = deltas[table.layer_map[k]]
        if not any(d.values()):
            out.append(c)
            continue
        parts = {f"{kind}_bytes": getattr(c, f"{kind}_bytes") + d[kind] for kind in STATIC_KINDS}
        out.append(dataclasses.replace(c, static_bytes=sum(parts.values()), **parts))
    return out
