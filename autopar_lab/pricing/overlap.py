"""Communication a framework overlaps with compute, as a plan names it (``stage_pins["overlap"]``).

Megatron-Core's three switches (``megatron/training/arguments.py``; ``DistributedDataParallelConfig``), each False
by default there, each one name here (:data:`OVERLAPS`):

* ``"grad_reduce"`` (``--overlap-grad-reduce``): the data-parallel gradient reduction (all-reduce, or the
  distributed optimizer's reduce-scatter: the weight-gradient operators' collectives) runs in per-layer buckets
  behind the backward of the step's last microbatch: every bucket but the last hides, up to
  ``bwd_compute / B x (1 - 1/layers)`` of it (:func:`~autopar_lab.pricing.stage.hidden_comm_s`). Without it the
  reduction runs after the backward, all of it on the critical path.
* ``"param_gather"`` (``--overlap-param-gather``, with the distributed optimizer): the all-gather of the updated
  weights (:func:`~autopar_lab.pricing.zero.zero_gather_deltas` prices it in the compute dtype) is dispatched bucket
  by bucket as the next step's forward reaches each layer, so it hides behind the forward of the first microbatch as
  ZeRO-3's parameter gathers do: up to ``fwd_compute / B x (1 - 1/layers)``. Without it the gather follows the
  update on the critical path.
* ``"tp_comm"`` (``--tp-comm-overlap``, with sequence parallelism): Transformer Engine splits each sequence-parallel
  all-gather and reduce-scatter into chunks pipelined with the GEMM that reads or writes them (forward: the column
  GEMMs' all-gather, the row GEMMs' reduce-scatter; backward: the input gradients' collectives and the re-gather of
  the stored sequence shard for the weight gradient, behind the data- and weight-gradient GEMMs). Priced per layer
  and pass: ``hidden = min(T, G)`` where ``T`` is the seconds of the pass's collectives over the tensor axis
  (the logical mesh's axis 1 in the layouts' (data, tensor) meshes; the operators' own collectives and the
  activation resharding, the gradient reduction and the update's gathers aside) and ``G`` the seconds of the pass's
  matmuls (``dot_general``) on that layer; ``fwd_s`` and ``bwd_s`` lose ``hidden`` (collective latency, paid per
  microbatch, is not hidden). Without it these collectives stay on the critical path.

A plan with the key is priced as Megatron-LM runs, each switch on or off. One more difference from the cost model's
own resharding: an activation the forward all-gathers (sequence parallelism's, before a column GEMM) that the
backward reads too (the weight gradient's input) is kept only as its shard, so the backward gathers it again
(Korthikanti et al. 2023, section 4.2.2: the memory already counts the shard alone), where the cost model converts a
tensor once for all its readers; that re-gather is charged to the backward (``regather``), and ``"tp_comm"`` hides it
with the backward's other tensor-parallel collectives.

A plan without the key is priced as before Megatron's switches were modelled (the layer costs as they are): the
weight-gradient collectives hidden as ``"grad_reduce"`` says, ZeRO's reduce-scatter into the optimizer's split, the
updated weights' gather and the tensor-parallel collectives on the critical path.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Iterable, Sequence

from ..graph.fusion import kernel_view
from ..graph.opgraph import FORWARD, PARAM, UPDATE, dtype_size
from ..sharding.reshard import collective_time
from ..solve.intra import StrategyCache, conversions, weight_gradient_ops
from .zero import compute_dtype, updated_param

if TYPE_CHECKING:
    from ..solve.intra import IntraPlan
    from .layers import LayerCost
    from .table import CostTable

__all__ = ["OVERLAPS", "TENSOR_AXIS", "check_overlap", "overlap_layer_costs", "overlap_terms"]

#: The communication a plan may name as overlapped (see the module docstring).
OVERLAPS = ("grad_reduce", "param_gather", "tp_comm")
#: The logical mesh axis ``"tp_comm"`` hides the collectives of (the layouts' tensor-parallel axis).
TENSOR_AXIS = 1

# table -> {(id of the IntraPlan, zero): (the IntraPlan, per solve-graph layer terms)}
_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_overlap(overlap: Iterable[str]) -> tuple[str, ...]:
    """``overlap`` as a sorted tuple of :data:`OVERLAPS` names; a ValueError naming one that is not.

    >>> check_overlap(["tp_comm", "grad_reduce"])
    ('grad_reduce', 'tp_comm')
    """
    if isinstance(overlap, str):
        overlap = (overlap,)
    out = tuple(sorted(set(overlap)))
    bad = [x for x in out if x not in OVERLAPS]
    if bad:
        raise ValueError(f"overlap names {bad[0]!r:.40}; the overlapped communication is any of "
                         f"{', '.join(map(repr, OVERLAPS))}")
    return out


#: The collectives of the tensor-parallel matmuls that ``--tp-comm-overlap`` hides (a ring attention's key/value
#: passes, ``collective_permute``, are context parallelism's and already overlapped in their strategies).
TP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _on_tensor_axis(axis, kind: str = "all_gather") -> bool:
    return kind in TP_KINDS and (axis == TENSOR_AXIS or (isinstance(axis, tuple) and TENSOR_AXIS in axis))


def overlap_terms(graph, intra: IntraPlan, layer_names: Sequence[str], zero: int | None,
                  cache: StrategyCache | None = None) -> list[dict[str, float]]:
    """Per layer of ``graph`` (in ``layer_names``; an operator without a layer counts in the last), the seconds a
    step of ``intra`` spends on: ``tp_fwd``/``tp_bwd``, collectives over the tensor axis in each pass (see the module
    docstring); ``mm_fwd``/``mm_bwd``, matmul compute in each pass; ``update_gather``, the gathers of the updated
    weights (in the compute dtype under a ZeRO stage, as :func:`~autopar_lab.pricing.zero.zero_gather_deltas`);
    ``regather``, the backward's gathers again of activations the forward gathered (see the module docstring),
    counted in ``tp_bwd`` too where they cross the tensor axis."""
    index = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    out = [dict(tp_fwd=0.0, tp_bwd=0.0, mm_fwd=0.0, mm_bwd=0.0, update_gather=0.0, regather=0.0)
           for _ in layer_names]
    cache = cache or StrategyCache(intra.mesh)
    mesh = intra.mesh
    tensor = len(mesh.shape) > TENSOR_AXIS and mesh.shape[TENSOR_AXIS] > 1
    grads = weight_gradient_ops(graph, intra.ops)
    for op in intra.ops:
        node, s = graph.op(op), intra.strategies[op]
        if node.role == UPDATE:
            continue
        slot = out[index.get(node.layer, last)]
        fwd = node.role == FORWARD
        if node.primitive == "dot_general":
            slot["mm_fwd" if fwd else "mm_bwd"] += s.compute_s
        if tensor and op not in grads:
            slot["tp_fwd" if fwd else "tp_bwd"] += sum(collective_time(mesh, kind, n, axis) for kind, axis, n
                                                       in s.collectives if _on_tensor_axis(axis, kind))
    weights = kernel_view(graph, mesh.cluster.device.efficiency.flash_attention).weight_derived
    for _u, v, _is_alias, t, src, dst, cost in conversions(graph, intra.ops, intra.strategies, cache):
        vn = graph.op(v)
        slot = out[index.get(vn.layer, last)]
        param = updated_param(graph, v)
        if param is not None:  # the update's way back to its parameter's spec (pricing.zero)
            dtype = compute_dtype(graph, param) if zero else str(t.dtype)
            narrower = dtype_size(dtype) < dtype_size(t.dtype)
            slot["update_gather"] += cache.reshard(src, dst, t.shape, dtype) if narrower else cost
            continue
        if vn.role == UPDATE or t.kind == PARAM or t.id in weights:
            continue
        cols = cache.reshard_collectives(src, dst, t.shape, t.dtype)
        on_axis = min(cost, sum(collective_time(mesh, kind, n, axis) for kind, axis, n in cols
                                if _on_tensor_axis(axis, kind))) if tensor else 0.0
        slot["tp_fwd" if vn.role == FORWARD else "tp_bwd"] += on_axis
        if vn.role == FORWARD and cols and all(k == "all_gather" for k, _a, _n in cols) and \
                _read_again(graph, intra, t.id, dst):
            # the backward reads the gathered copy too: Megatron-LM keeps the shard and gathers it again (an
            # all-to-all's output, the experts' dispatched tokens, is kept as it is)
            slot["regather"] += cost
            slot["tp_bwd"] += on_axis
    return out


def _read_again(graph, intra: IntraPlan, tensor: int, spec) -> bool:
    """Whether a backward operator of ``intra`` reads ``tensor`` in ``spec`` (the copy a forward conversion made)."""
    for c in graph.consumers.get(tensor, ()):
        node = graph.op(c)
        if node.role in (FORWARD, UPDATE) or c not in intra.strategies:
            continue
        if any(x == tensor and intra.strategies[c].in_specs[j] == spec for j, x in enumerate(node.inputs)):
            return True
    return False


def overlap_layer_costs(table: CostTable, intra: IntraPlan, costs: Sequence[LayerCost], overlap: Iterable[str],
                        zero: int | None = None) -> list[LayerCost]:
    """``costs`` (full-graph layer costs of ``intra``, after :func:`~autopar_lab.pricing.zero.zero_layer_costs`
    where the plan names a ZeRO stage ``zero``) priced with the communication ``overlap`` names hidden as the module
    docstring says, the rest on the critical path."""
    overlap = check_overlap(overlap)
    memo = _MEMO.setdefault(table, {})
    key = (id(intra), zero)
    hit = memo.get(key)
    if hit is None or hit[0] is not intra:
        g = table.solve_graph
        hit = memo[key] = (intra, overlap_terms(g, intra, list(g.layers) or [""], zero,
                                                table.strategy_cache(intra.mesh)))
    terms = hit[1]
    out = []
    for k, c in enumerate(costs):
        t = terms[table.layer_map[k]]
        fwd, bwd, gather, comm, reshard = c.fwd_s, c.bwd_s, c.gather_s, c.comm_s, c.reshard_s
        bwd, reshard = bwd + t["regather"], reshard + t["regather"]  # Megatron-LM gathers the shard again
        # not overlapped, none of the reduction (the weight-gradient collectives: all-reduce, or ZeRO's
        # reduce-scatter) hides; overlapped, stage_cost hides it behind the last backward
        sync = c.sync_s if "grad_reduce" in overlap else 0.0
        if "param_gather" in overlap and t["update_gather"] > 0:
            # the update's gather moves to the next step's forward, prefetched there as parameter gathers are
            g = min(t["update_gather"], bwd)
            bwd, fwd, gather = bwd - g, fwd + g, gather + g
        if "tp_comm" in overlap:
            hf, hb = min(t["tp_fwd"], t["mm_fwd"]), min(t["tp_bwd"], t["mm_bwd"])
            fwd, bwd = fwd - hf, bwd - hb
            # the hidden seconds leave the communication they were charged as (operators' or resharding's)
            cut = min(hf + hb, comm + reshard)
            from_comm = min(cut, max(comm - sync, 0.0))
            comm, reshard = comm - from_comm, max(reshard - (cut - from_comm), 0.0)
        if (fwd, bwd, gather, comm, reshard, sync) == (c.fwd_s, c.bwd_s, c.gather_s, c.comm_s, c.reshard_s,
                                                         c.sync_s):
            out.append(c)
        else:
            out.append(dataclasses.replace(c, fwd_s=fwd, bwd_s=bwd, gather_s=gather, comm_s=comm, reshard_s=reshard,
                                           sync_s=sync))
    return out
