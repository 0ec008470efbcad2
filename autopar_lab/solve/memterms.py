"""The intra-op pass's memory terms: what each operator adds to a stage's memory per device, term by term
(:func:`memory_terms`, the one memory formula), the gathered weight copies a choice holds (:func:`held_copies`), and
the ILP's memory rows (:func:`liveness`, :func:`gathered_param_terms`)."""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

import numpy as np

from ..graph.fusion import kernel_view
from ..graph.opcost import REDUCTIONS
from ..graph.opgraph import (FORWARD, FP8_COPY_BYTES, GRAD_BYTES, INPUT_PRIMITIVE, OPT_STATE, OUTPUT_PRIMITIVE, PARAM,
                             OpGraph, OpNode, dtype_size)
from ..sharding.fsdp import is_param_input
from ..sharding.spec import ShardingSpec
from ..sharding.strategies import Strategy

__all__ = ["STATIC_KINDS", "memory_terms", "kept_outputs", "gathered_bytes", "held_copies", "memory_totals", "liveness",
           "gathered_param_terms", "reshard_buffer_bytes"]


def liveness(graph: OpGraph, ops: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Program points (one per operator, in order) and the operators whose outputs are live there."""
    index = {op: k for k, op in enumerate(ops)}
    last = {op: k for k, op in enumerate(ops)}
    for k, v in enumerate(ops):
        for t in graph.op(v).inputs:
            u = graph.tensor(t).producer
            if u in index:
                last[u] = max(last[u], k)
    # Inputs of the step live all step (they are donated to the outputs only at the end).
    for op in ops:
        if graph.op(op).primitive == INPUT_PRIMITIVE:
            last[op] = len(ops) - 1
    starts: dict[int, list[int]] = defaultdict(list)
    for op in ops:
        starts[index[op]].append(op)
    live: list[tuple[int, ...]] = []
    current: set[int] = set()
    for k in range(len(ops)):
        current.update(starts[k])
        live.append(tuple(sorted(index[o] for o in current)))
        current = {o for o in current if last[o] > k}
    return tuple(live)


def gathered_param_terms(graph: OpGraph, nodes: Sequence[int], strats: Sequence[Sequence[Strategy]],
                         mesh_shape: tuple[int, ...]):
    """The memory constraint's transient terms (``IntraProblem.mem_terms``, one tuple per program point): at the
    point of an operator reading a parameter, the bytes of the parameter in the spec that operator reads it in.

    A parameter stored sharded (ZeRO-3 / FSDP) is gathered for each reader and freed after it: the gathered copy is
    live at the reader's point only, which is what this term adds. It cannot see the stored spec (the memory rows are
    linear in each node's choice), so a reader of a parameter stored as it reads it is charged one copy too many:
    conservative by one parameter at one point, never under."""
    index = {op: k for k, op in enumerate(nodes)}
    out: list[tuple] = [() for _ in nodes]
    for k, v in enumerate(nodes):
        node = graph.op(v)
        if node.primitive == OUTPUT_PRIMITIVE:
            continue
        for j, t in enumerate(node.inputs):
            u = graph.tensor(t).producer
            if u is None or u not in index or not is_param_input(graph, u):
                continue
            info = graph.tensor(t)
            need = np.array([float(s.in_specs[j].bytes_per_device(info.shape, info.dtype, mesh_shape))
                             for s in strats[k]])
            if need.any():
                out[k] += ((k, need),)
    return tuple(out) if any(out) else None



#: The kinds of static memory (held all step) :func:`memory_terms` and :func:`gathered_bytes` name, in stacking
#: order: the parameters as the step computes with them (a mixed-precision step's half-precision copy), their
#: gradients, fp32 master weights, optimizer state, copies of parameters kept all step (gathered from their
#: shards, or cast, sliced or transposed in the forward for the backward), and an FP8 format's FP8 weight copies.
STATIC_KINDS = ("param", "grad", "master", "opt", "copies", "fp8")


def memory_terms(graph: OpGraph, node: OpNode, s: Strategy, mesh_shape: tuple[int, ...],
                 fused_attention: bool = False, *, library_kernels: bool = False):
    """The bytes per device one operator adds to a stage, term by term, as ``(kind, bytes)``.

    A parameter input: ``param`` and ``grad`` (as sharded), or for an fp32 master weight of a lower-precision step
    ``master`` (4 bytes), ``param`` and ``grad`` at the compute precision (the copy the step computes with and its
    gradient: 2 + 2 bytes for fp16/bf16, 16 bytes a parameter with Adam's two fp32 moments, as ZeRO counts); a
    number format that keeps gradients wider (bf16's fp32 gradients, :mod:`autopar_lab.precision`) says so on the
    input operator (``GRAD_BYTES``), and one with FP8 weight copies adds them as ``fp8`` (``FP8_COPY_BYTES``);
    optimizer state: ``opt``; a forward tensor the backward reads, as its kernel wrote it
    (:attr:`~autopar_lab.graph.fusion.KernelView.saved`: broadcasts and cheap elementwise work are recomputed, a
    flash-attention kernel keeps no scores): ``act``, or ``copies`` when computed from parameters alone (it does not
    grow with the microbatch). The one memory formula: the IntraPlan's totals and the per-layer costs of
    :mod:`autopar_lab.pricing` both add these terms, in this order. ``library_kernels``: the forward
    tensors a fused-kernel library keeps instead (:meth:`~autopar_lab.graph.fusion.KernelView.kept`;
    :class:`~autopar_lab.cluster.Efficiency`'s field of that name)."""
    view = kernel_view(graph, fused_attention)
    if node.primitive == INPUT_PRIMITIVE:
        t = node.outputs[0]
        kind = graph.tensor(t).kind
        if kind == PARAM:
            ratio = view.masters.get(t)
            wide = node.params.get(GRAD_BYTES)  # a format's gradient width, bytes per element (else the copy's)
            if ratio is None:
                yield "param", s.mem_bytes
                yield "grad", s.mem_bytes if wide is None else s.mem_bytes * wide / dtype_size(graph.tensor(t).dtype)
            else:
                yield "master", s.mem_bytes
                yield "param", s.mem_bytes * ratio
                yield "grad", s.mem_bytes * (ratio if wide is None else wide / dtype_size(graph.tensor(t).dtype))
            fp8 = node.params.get(FP8_COPY_BYTES)
            if fp8:
                yield "fp8", s.mem_bytes * fp8 / dtype_size(graph.tensor(t).dtype)
        elif kind == OPT_STATE:
            yield "opt", s.mem_bytes
        return
    for _t, kind, nbytes in kept_outputs(graph, node, s, mesh_shape, fused_attention,
                                         library_kernels=library_kernels):
        yield kind, nbytes


def kept_outputs(graph: OpGraph, node: OpNode, s: Strategy, mesh_shape: tuple[int, ...],
                 fused_attention: bool = False, *, library_kernels: bool = False):
    """``(tensor, kind, bytes)`` of each output of a forward operator that the backward keeps, as
    :func:`memory_terms` counts it (``act``, or ``copies`` for one computed from parameters alone): the terms of
    its outputs, tensor by tensor (a stage that sends an output to the next stage prices it there:
    :func:`~autopar_lab.pricing.layers.layer_costs`' ``sent_act_bytes``)."""
    if node.role != FORWARD or node.primitive == INPUT_PRIMITIVE:
        return
    view = kernel_view(graph, fused_attention)
    kept = view.kept(library_kernels)
    for k, t in enumerate(node.outputs):
        if t not in kept:
            continue
        if t in view.weight_derived:
            if node.primitive == "convert_element_type" and graph.tensor(node.inputs[0]).id in view.masters:
                continue  # the compute copy of a master weight: counted with it
            kind = "copies"
        else:
            kind = "act"
        info = graph.tensor(t)
        yield t, kind, s.out_specs[k].bytes_per_device(info.shape, info.dtype, mesh_shape)


def gathered_bytes(graph: OpGraph, t, src: ShardingSpec, dst: ShardingSpec, mesh_shape: tuple[int, ...]) -> float:
    """Bytes per device of a parameter (or a tensor computed from parameters alone) gathered from a sharded ``src``
    into a larger ``dst`` copy that its readers use all step (weight-update sharding: ZeRO-2's gathered weights are
    kept from the forward to the backward, so that copy is live memory as well as the shard); 0 otherwise."""
    p = graph.tensor(t.id).producer
    if p is None:
        return 0.0
    is_weight = (graph.op(p).primitive == INPUT_PRIMITIVE and t.kind == PARAM) or \
        t.id in kernel_view(graph, False).weight_derived
    if not is_weight:
        return 0.0
    full, shard = dst.bytes_per_device(t.shape, t.dtype, mesh_shape), src.bytes_per_device(t.shape, t.dtype, mesh_shape)
    return float(full) if full > shard else 0.0


def held_copies(graph: OpGraph, convs, mesh_shape: tuple[int, ...]) -> dict[int, tuple[int, float]]:
    """tensor id -> (its first reader, bytes per device) of the gathered copies :func:`gathered_bytes` holds all
    step, from :func:`~autopar_lab.solve.intra.conversions`' rows ``convs``: one per tensor, the largest, however
    many readers gather it. A parameter stored sharded is gathered once per reader
    (:func:`~autopar_lab.solve.intra.conversion_key`, ZeRO-3 / FSDP), but the copy held is one: counting it per
    conversion would hold it twice for a weight read in forward and backward."""
    out: dict[int, tuple[int, float]] = {}
    for _u, v, is_alias, t, src, dst, _c in convs:
        b = 0.0 if is_alias else gathered_bytes(graph, t, src, dst, mesh_shape)
        if b and b > out.get(t.id, (v, 0.0))[1]:
            out[t.id] = (out.get(t.id, (v, 0.0))[0], b)
    return out


def reshard_buffer_bytes(graph: OpGraph, reader: int, t, src: ShardingSpec, dst: ShardingSpec,
                         mesh_shape: tuple[int, ...]) -> float:
    """Bytes per device of the destination buffer a resharding of tensor ``t`` from ``src`` to ``dst`` for operator
    ``reader`` writes (the collective's, the all-to-all's or the gather's output): live beside its source while the
    reader runs, where the working set does not count it. 0 where no such buffer is made: a gathered weight held all
    step (:func:`gathered_bytes`: priced as a held copy), and a reduction whose reduced dimensions are the ones the
    resharding would gather (XLA's SPMD partitioner reduces each shard and all-reduces the small result instead of
    gathering the input: measured in the compiled backward programs of gpt-tiny's dp2 x tp2 x pp2 plan on 8 CPU
    devices, whose bias-gradient reductions gather nothing)."""
    if gathered_bytes(graph, t, src, dst, mesh_shape):
        return 0.0
    node = graph.op(reader)
    axes = node.params.get("axes") if node.primitive in REDUCTIONS else None
    if axes is not None:
        gathered = {d for d in range(len(t.shape))
                    if any(mesh_shape[a] > 1 for a in set(src.dims[d]) - set(dst.dims[d]))}
        if gathered <= set(axes):
            return 0.0
    return float(dst.bytes_per_device(t.shape, t.dtype, mesh_shape))


def memory_totals(graph: OpGraph, ops: Sequence[int], chosen: Mapping[int, Strategy], mesh) -> tuple[float, float]:
    """(static, activation) bytes per device: the sum of :func:`memory_terms` over ``ops``."""
    mshape = tuple(mesh.shape)
    eff = mesh.cluster.device.efficiency
    static = act = 0.0
    for op in ops:
        for kind, nbytes in memory_terms(graph, graph.op(op), chosen[op], mshape, eff.flash_attention,
                                         library_kernels=eff.library_kernels):
            if kind == "act":
                act += nbytes
            else:
                static += nbytes
    return static, act
