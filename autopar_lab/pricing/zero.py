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
keeps all step. Nothing changes where the state is stored whole (stage 0). Where a parameter's state could not be
split evenly over the group (no dimension divides: 8,192 over 48 replicas), the layout keeps its spec whole, but
ZeRO (Megatron-LM's distributed optimizer, DeepSpeed) splits one flat, padded buffer of all parameters, so each of
the ``d`` replicas (:func:`replicas`) still holds ``1 / d`` of it: its master weights and Adam moments (1+), its
gradients (2+) and its parameters (3) are counted at ``1 / d`` (the padding, under ``d`` elements a buffer, left
out); its gradient reduction stays the strategies' all-reduce. Not counted: the one layer's gathered
weights stage 3 holds at a time (and the next one's, prefetched), a transient the size of a layer's half-precision
weights.

Time: a plan's time is its strategies', but for the gather of the updated weights. With the optimizer state split,
the update runs on each device's shard and its result goes back to the parameter's own spec: the strategies price
that as an all-gather of the float32 master weights (the parameter input is the master). Megatron-LM's distributed
optimizer keeps the master weights only as shards and all-gathers the updated weights in the compute dtype (bf16 or
fp16, 2 bytes a parameter, not 4) into its parameter buffer (Megatron-Core ``DistributedOptimizer``; NVIDIA
Megatron Bridge docs, "Communication Overlap": "reduce-scatter of gradients and all-gather of updated
parameters"). :func:`zero_gather_deltas` re-prices those gathers in the dtype the parameter's readers cast it to.
The gather stays on the critical path after the update: overlapping it with the next step's forward is Megatron's
opt-in ``--overlap-param-gather`` (``DistributedDataParallelConfig.overlap_param_gather``, False by default), which
a plan names in ``stage_pins["overlap"]`` (``megatron_plan(overlap_param_gather=True)``; :mod:`.overlap` prices
it). The gradients' reduce-scatter (or all-reduce) is the weight-gradient operators' own, in the gradient's dtype
(:mod:`autopar_lab.precision`: float32 in the bf16 recipe).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import TYPE_CHECKING, Sequence

from ..graph.opgraph import INPUT_PRIMITIVE, OPT_STATE, OUTPUT_PRIMITIVE, PARAM, OpGraph, dtype_size
from ..solve.intra import StrategyCache, conversions
from ..solve.memterms import STATIC_KINDS, held_copies, memory_terms

if TYPE_CHECKING:
    from ..solve.intra import IntraPlan
    from .layers import LayerCost
    from .table import CostTable

__all__ = ["ZERO_STAGES", "opt_states_of", "compute_dtype", "replicas", "updated_param", "zero_deltas",
           "zero_gather_deltas", "zero_group", "zero_layer_costs"]

#: The stages :func:`zero_layer_costs` prices.
ZERO_STAGES = (0, 1, 2, 3)

# table -> {(id of the IntraPlan, stage): (the IntraPlan, per solve-graph layer {kind: bytes to add})}
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def planned_params(graph: OpGraph, intra: IntraPlan):
    """Each parameter input of ``graph`` that ``intra`` plans, with a shape: (its input operator, its tensor's
    info, its planned spec), in the graph's order. Scalars are left out (nothing to shard or accumulate)."""
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive != INPUT_PRIMITIVE or op not in intra.strategies:
            continue
        info = graph.tensor(node.outputs[0])
        if info.kind == PARAM and info.shape:
            yield op, info, intra.strategies[op].out_specs[0]


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
    group: tuple[int, ...] | None = None
    for p, states in opt_states_of(graph).items():
        if p not in intra.strategies or states[0] not in intra.strategies:
            continue
        info = graph.tensor(graph.op(p).outputs[0])
        spec = intra.strategies[p].out_specs[0]
        own = spec.bytes_per_device(info.shape, info.dtype, mshape)
        opt = intra.strategies[states[0]].out_specs[0].bytes_per_device(info.shape, info.dtype, mshape)
        if not own:
            continue
        slot = out[index.get(graph.op(p).layer, last)]
        terms = dict(memory_terms(graph, graph.op(p), intra.strategies[p], mshape, fused))
        if own == opt:
            # The state could not be split evenly over the group (a dimension of 8,192 over 48 replicas): ZeRO
            # splits one flat buffer, padded to a multiple of the group, so each replica still holds 1 / d of it.
            # A spec already split over the group (stage 3 stores the parameter so) is ZeRO's split itself.
            if group is None:
                group = zero_group(graph, intra)
            if set(spec.axes) & set(group):
                continue
            d = math.prod(int(mshape[a]) for a in group)
            if d <= 1:
                continue
            ratio = 1.0 / d
            for st in states:
                slot["opt"] += sum(b for k, b in memory_terms(graph, graph.op(st), intra.strategies[st], mshape,
                                                                fused) if k == "opt") * (ratio - 1)
            if zero >= 3:
                slot["param"] += terms.get("param", 0.0) * (ratio - 1)
        else:
            ratio = opt / own  # the optimizer state's share of what the parameter's own spec holds
        if "master" in terms:
            slot["master"] += terms["master"] * (ratio - 1)
        if zero >= 2:
            slot["grad"] += terms["grad"] * (ratio - 1)
    if zero >= 3:
        convs = list(conversions(graph, intra.ops, intra.strategies, cache or StrategyCache(intra.mesh)))
        for v, nbytes in held_copies(graph, convs, mshape).values():
            out[index.get(graph.op(v).layer, last)]["copies"] -= nbytes
    return out


def zero_group(graph: OpGraph, intra: IntraPlan) -> tuple[int, ...]:
    """The mesh axes ZeRO splits ``intra``'s optimizer state over: those a parameter's optimizer state is split over
    and the parameter itself is not (axis 0, the layouts' data-parallel axis, when no parameter says: stage 3 stores
    each parameter split as its state is)."""
    axes: set[int] = set()
    for p, states in opt_states_of(graph).items():
        if p in intra.strategies and states[0] in intra.strategies:
            axes |= set(intra.strategies[states[0]].out_specs[0].axes) - set(intra.strategies[p].out_specs[0].axes)
    return tuple(sorted(axes)) or (0,)


def replicas(spec, mesh_shape: Sequence[int]) -> int:
    """The devices of a mesh of ``mesh_shape`` holding the same shard of a tensor stored as ``spec``: the devices
    over the mesh axes ``spec`` does not split (a parameter's data-parallel group, over which ZeRO splits it).

    >>> from autopar_lab.sharding.spec import ShardingSpec
    >>> replicas(ShardingSpec(((), (1,))), (48, 8)), replicas(ShardingSpec(((0,), (1,))), (48, 8))
    (48, 1)
    """
    used = spec.axes
    return math.prod(int(n) for a, n in enumerate(mesh_shape) if a not in used)


def compute_dtype(graph: OpGraph, param: int) -> str:
    """The dtype a parameter input operator's readers compute with: the narrowest dtype a ``convert_element_type``
    reading it casts it to (a mixed-precision step's half-precision copy), else the parameter's own."""
    own = graph.tensor(graph.op(param).outputs[0])
    best = str(own.dtype)
    for c in graph.consumers.get(own.id, ()):
        node = graph.op(c)
        d = str(graph.tensor(node.outputs[0]).dtype)
        if node.primitive == "convert_element_type" and "float" in d and 0 < dtype_size(d) < dtype_size(best):
            best = d
    return best


def updated_param(graph: OpGraph, v: int) -> int | None:
    """The parameter input operator whose updated value the output operator ``v`` returns (its ``alias_of``), or
    None (``v`` is not such an output)."""
    node = graph.op(v)
    alias = node.params.get("alias_of") if node.primitive == OUTPUT_PRIMITIVE else None
    p = graph.tensor(alias).producer if alias is not None else None
    return p if p is not None and graph.tensor(graph.op(p).outputs[0]).kind == PARAM else None


def zero_gather_deltas(graph: OpGraph, intra: IntraPlan, layer_names: Sequence[str], zero: int,
                       cache: StrategyCache | None = None) -> list[float]:
    """Per layer of ``graph`` (as :func:`zero_deltas`), the seconds ZeRO stage ``zero`` adds (negative: saves) to
    the gathers of the updated weights: every resharding on the way from the update to its parameter's spec (into
    the output operator that returns it, or the alias back to the parameter) is priced in the parameter's compute
    dtype (:func:`compute_dtype`) rather than its master's (see the module docstring). 0 everywhere for stage 0."""
    index: dict[str | None, int] = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    out = [0.0] * len(layer_names)
    if zero == 0:
        return out
    cache = cache or StrategyCache(intra.mesh)
    for _u, v, _is_alias, t, src, dst, cost in conversions(graph, intra.ops, intra.strategies, cache):
        param = updated_param(graph, v)
        if param is None:
            continue
        dtype = compute_dtype(graph, param)
        if dtype_size(dtype) < dtype_size(t.dtype):
            out[index.get(graph.op(v).layer, last)] += cache.reshard(src, dst, t.shape, dtype) - cost
    return out


def zero_layer_costs(table: CostTable, intra: IntraPlan, costs: Sequence[LayerCost], zero: int) -> list[LayerCost]:
    """``costs`` (full-graph layer costs of ``intra``, a solution on ``table.solve_graph``) with ZeRO stage ``zero``'s
    memory and its gathers of the updated weights in the compute dtype (see the module docstring); the other times
    are unchanged."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    memo = _MEMO.setdefault(table, {})
    hit = memo.get((id(intra), zero))
    if hit is None or hit[0] is not intra:
        g = table.solve_graph
        names, cache = list(g.layers) or [""], table.strategy_cache(intra.mesh)
        hit = memo[(id(intra), zero)] = (intra, zero_deltas(g, intra, names, zero, cache),
                                         zero_gather_deltas(g, intra, names, zero, cache))
    deltas, gathers = hit[1], hit[2]
    out = []
    for k, c in enumerate(costs):
        d, dt = deltas[table.layer_map[k]], gathers[table.layer_map[k]]
        if not any(d.values()) and not dt:
            out.append(c)
            continue
        parts = {f"{kind}_bytes": getattr(c, f"{kind}_bytes") + d[kind] for kind in STATIC_KINDS}
        # the update's gather runs with the optimizer step, in the backward's time (as layer_costs charges it)
        out.append(dataclasses.replace(c, static_bytes=sum(parts.values()), bwd_s=c.bwd_s + dt,
                                       reshard_s=c.reshard_s + dt, **parts))
    return out
