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

* ``"moe_comm"`` (``--overlap-moe-expert-parallel-comm``, with expert parallelism; DeepSeek-V3's DualPipe does the
  same): Megatron-Core's combined 1F1B step (``pipeline_parallel/combined_1f1b.py``) runs the forward of one
  microbatch and the backward of another together, layer by layer on two streams, so the expert-parallel
  all-to-alls (dispatch and combine) of each pass run behind the *other* microbatch's compute: the forward's behind
  the backward's, the backward's behind the forward's. Priced per MoE layer (a layer holding expert matmuls,
  :func:`~autopar_lab.sharding.experts.expert_matmuls`): ``hidden_f = min(A_f, C_b)`` and ``hidden_b = min(A_b,
  C_f)``, where ``A_f``/``A_b`` are the seconds of the layer's all-to-all resharding in each pass (the token
  exchanges, wherever in dispatch and combine the plan placed them) and ``C_f``/``C_b`` the layer's compute in each
  pass. Only the steady state pairs a forward with another microbatch's backward: the warm-up forwards and the
  cool-down backwards run alone and hide nothing, so a stage hides ``paired x (hidden_f + hidden_b)`` a layer, with
  ``paired`` its share of forwards run in the steady state (:func:`paired_share`, from the schedule's warm-up count
  as Megatron-Core computes it); ``fwd_s`` and ``bwd_s`` lose their part of it, spread over every microbatch (the
  stage's mean, as the simulator takes one time a pass). DualPipe also pairs much of the fill (not priced). Without
  the switch the all-to-alls stay on the critical path.

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
from ..sharding.experts import expert_matmuls
from ..sharding.reshard import collective_time
from ..solve.intra import StrategyCache, conversions, weight_gradient_ops
from .zero import compute_dtype, updated_param

if TYPE_CHECKING:
    from ..solve.intra import IntraPlan
    from .layers import LayerCost
    from .table import CostTable

__all__ = ["OVERLAPS", "TENSOR_AXIS", "check_overlap", "overlap_layer_costs", "overlap_terms", "paired_share"]

#: The communication a plan may name as overlapped (see the module docstring).
OVERLAPS = ("grad_reduce", "moe_comm", "param_gather", "tp_comm")
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
    counted in ``tp_bwd`` too where they cross the tensor axis; ``a2a_fwd``/``a2a_bwd``, the all-to-all resharding
    into the operators of an MoE layer (one holding expert matmuls) in each pass."""
    index = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    out = [dict(tp_fwd=0.0, tp_bwd=0.0, mm_fwd=0.0, mm_bwd=0.0, update_gather=0.0, regather=0.0, a2a_fwd=0.0,
                a2a_bwd=0.0) for _ in layer_names]
    cache = cache or StrategyCache(intra.mesh)
    mesh = intra.mesh
    tensor = len(mesh.shape) > TENSOR_AXIS and mesh.shape[TENSOR_AXIS] > 1
    grads = weight_gradient_ops(graph, intra.ops)
    moe = {graph.op(op).layer for op in expert_matmuls(graph) if op in intra.strategies}
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
        if vn.layer in moe and any(k == "all_to_all" for k, _a, _n in cols):
            # an MoE layer's token exchange: the whole conversion where it is all-to-alls alone, else their share
            a2a = cost if all(k == "all_to_all" for k, _a, _n in cols) else min(cost, sum(
                collective_time(mesh, k, n, a) for k, a, n in cols if k == "all_to_all"))
            slot["a2a_fwd" if vn.role == FORWARD else "a2a_bwd"] += a2a
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


def paired_share(schedule: str, stages: int, stage: int, microbatches: int, virtual_stages: int = 1,
                 group: int | None = None) -> float:
    """The share of stage ``stage``'s forward passes (of ``stages``) that Megatron-Core's combined 1F1B runs beside
    another microbatch's backward (``"moe_comm"``): the rest are its warm-up. Megatron-Core's warm-up
    (``pipeline_parallel/schedules.py``): ``stages - stage - 1`` forwards in 1F1B (ZB-H1 alike), ``(stages - stage
    - 1) x 2 + (v - 1) x N`` of the ``microbatches x v`` chunk forwards interleaved (a microbatch group of ``N``,
    ``group``, default ``stages``), and one more with the combined schedule, whose forward pairs with an *earlier*
    microbatch's backward (the last stage's 1F1B would pair a microbatch's forward with its own backward); without
    pipelining, the first forward alone. GPipe runs every forward before any backward: nothing pairs.

    >>> paired_share("interleaved", 4, 1, 8, 2)   # 16 chunk forwards, 2 x 2 + 4 + 1 = 9 of them warm-up
    0.4375
    >>> paired_share("1f1b", 1, 0, 8), paired_share("gpipe", 4, 3, 8)
    (0.875, 0.0)
    """
    if schedule == "gpipe" or microbatches < 1:
        return 0.0
    v = virtual_stages if schedule == "interleaved" else 1
    n = microbatches * v
    size = stages if group is None or v == 1 else group
    warm = (stages - stage - 1) * (2 if v > 1 else 1) + (v - 1) * size + 1
    return max(n - warm, 0) / n


def overlap_layer_costs(table: CostTable, intra: IntraPlan, costs: Sequence[LayerCost], overlap: Iterable[str],
                        zero: int | None = None, paired: float = 1.0) -> list[LayerCost]:
    """``costs`` (full-graph layer costs of ``intra``, after :func:`~autopar_lab.pricing.zero.zero_layer_costs`
    where the plan names a ZeRO stage ``zero``) priced with the communication ``overlap`` names hidden as the module
    docstring says, the rest on the critical path; ``paired``: the stage's share of forwards run beside another
    microbatch's backward (:func:`paired_share`), the share of the MoE all-to-alls ``"moe_comm"`` may hide."""
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
        if "moe_comm" in overlap and t["a2a_fwd"] + t["a2a_bwd"] > 0:
            # each pass's token exchanges behind the other microbatch's compute of the other pass (combined 1F1B)
            hf, hb = paired * min(t["a2a_fwd"], c.bwd_compute_s), paired * min(t["a2a_bwd"], c.fwd_compute_s)
            hf, hb = min(hf, fwd), min(hb, bwd)
            fwd, bwd, reshard = fwd - hf, bwd - hb, max(reshard - hf - hb, 0.0)
        if (fwd, bwd, gather, comm, reshard, sync) == (c.fwd_s, c.bwd_s, c.gather_s, c.comm_s, c.reshard_s,
                                                         c.sync_s):
            out.append(c)
        else:
            out.append(dataclasses.replace(c, fwd_s=fwd, bwd_s=bwd, gather_s=gather, comm_s=comm, reshard_s=reshard,
                                           sync_s=sync))
    return out
