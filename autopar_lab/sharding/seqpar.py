"""Megatron sequence parallelism in the intra-operator space (Korthikanti et al., MLSys 2023).

Tensor parallelism leaves the layer norms, dropouts and residual adds between a row-parallel matmul and the next
column-parallel one replicated over the tensor axis: the row-parallel matmul all-reduces its partial sums. Sequence
parallelism splits that region along the sequence instead: the matmul *reduce-scatters* its partial sums onto the
sequence dimension, the region runs on ``1/t`` of the tokens, and the next column-parallel matmul *all-gathers* its
input. The collectives move the same bytes (an all-reduce is a reduce-scatter then an all-gather); the region's
compute and its activations are divided by ``t``.

The ILP already holds every piece, nothing new is enumerated: a contraction split on its reduced dimension has a
``reduce_scatter`` variant onto the first free output dimension that divides (:func:`contraction_strategies`; for
``(batch, seq, hidden)`` with the batch split over the data axis that is the sequence), elementwise, reduction and
layout operators follow any split of their dimensions (the sequence included), and converting ``S1`` on the sequence
back to ``R`` is an ``all_gather`` resharding edge (:mod:`autopar_lab.sharding.reshard`), all priced with the
collective functions of :mod:`autopar_lab.cluster`. The ILP picks it where it pays: the layer norm on ``1/t`` of the
tokens costs less, for one more collective latency per region. Where activation memory is tight (a memory limit),
it also keeps the layer norm's output split and gathers it for the matmul, Korthikanti et al.'s layout; the
activation is then counted split, and its gather once (as XLA compiles it; Megatron gathers it again in the
backward, one more all-gather per region the cost model does not charge).

This module names it in a plan: :func:`sequence_regions` finds the operators split along the sequence and the
collectives that open and close each region, and :func:`without_sequence_parallel` turns a plan's regions back into
tensor parallelism with the regions replicated (the all-reduce variant of the opening matmul), the layout
Korthikanti et al. compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..graph.opgraph import BATCH, FORWARD, INPUT_PRIMITIVE, OpGraph
from .spec import ShardingSpec

__all__ = ["SeqRegion", "sequence_length", "sequence_regions", "without_sequence_parallel"]


@dataclass(frozen=True)
class SeqRegion:
    """Forward operators run split along the sequence over mesh ``axes``, connected producer to consumer.

    ``opened_by``: the operators of the region whose own collective is a ``reduce_scatter`` (the row-parallel
    matmuls that start it); ``ops``: every operator of the region, in graph order.
    """

    axes: tuple[int, ...]
    ops: tuple[int, ...]
    opened_by: tuple[int, ...]

    def describe(self, axis_names: Sequence[str] = ("x", "y")) -> str:
        over = "+".join(axis_names[a] for a in self.axes)
        return (f"sequence parallel over {over}: {len(self.ops)} operators on 1/n of the tokens, opened by "
                f"{len(self.opened_by)} reduce-scatter(s)")


def sequence_length(graph: OpGraph) -> int | None:
    """The step's sequence length: the second dimension of its first batch input of rank 2 or more (tokens are
    ``(batch, seq)``), or None."""
    for t in graph.inputs:
        info = graph.tensor(t)
        if info.kind == BATCH and len(info.shape) >= 2:
            return int(info.shape[1])
    return None


def _seq_axes(spec: ShardingSpec, shape: Sequence[int], seq: int) -> tuple[int, ...]:
    """The mesh axes splitting the sequence dimension (dim 1 of a ``(batch, seq, ...)`` tensor) of ``spec``: a
    layer norm's statistics are ``(batch, seq)``."""
    if len(shape) < 2 or int(shape[1]) != seq or spec.rank != len(shape):
        return ()
    return tuple(spec.dims[1])


def _split_axes(graph: OpGraph, op: int, s: Any, seq: int) -> tuple[int, ...]:
    node = graph.op(op)
    axes: set[int] = set()
    for spec, shape in zip(s.out_specs, node.out_shapes):
        axes |= set(_seq_axes(spec, shape, seq))
    return tuple(sorted(axes))


def sequence_regions(graph: OpGraph, strategies: Mapping[int, Any], mesh_shape: Sequence[int]) -> list[SeqRegion]:
    """The sequence-parallel regions of ``strategies`` (op -> Strategy): forward operators (outside attention's
    head-split internals) whose output is split along the sequence over a mesh axis of more than one device,
    grouped by the tensors they pass each other. Empty for a graph without a ``(batch, seq)`` input."""
    seq = sequence_length(graph)
    if seq is None:
        return []
    split = {}
    for op, s in strategies.items():
        node = graph.op(op)
        if node.role != FORWARD or node.primitive == INPUT_PRIMITIVE:
            continue
        axes = tuple(a for a in _split_axes(graph, op, s, seq) if int(mesh_shape[a]) > 1)
        if axes:
            split[op] = axes
    parent = {op: op for op in split}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for op in split:
        for t in graph.op(op).inputs:
            u = graph.tensor(t).producer
            if u in split:
                parent[find(u)] = find(op)
    groups: dict[int, list[int]] = {}
    for op in sorted(split):
        groups.setdefault(find(op), []).append(op)
    out = []
    for ops in groups.values():
        axes = tuple(sorted({a for op in ops for a in split[op]}))
        opened = tuple(op for op in ops if any(k == "reduce_scatter" for k, _a, _b in strategies[op].collectives))
        out.append(SeqRegion(axes, tuple(ops), opened))
    return sorted(out, key=lambda r: r.ops[0])


def without_sequence_parallel(graph: OpGraph, strategies: Mapping[int, Any], mesh_shape: Sequence[int],
                              strategies_of: Callable[[Any], Sequence[Any]]) -> dict[int, Any]:
    """``strategies`` with every sequence-parallel region replicated along the sequence again: each operator of a
    region takes its strategy with the sequence's axes removed from every ``(batch, seq, ...)`` spec (the opening
    matmul thereby its ``all_reduce`` variant). ``strategies_of(node)`` lists an operator's strategies (e.g.
    ``StrategyCache.strategies``). An operator without such a strategy keeps its own."""
    seq = sequence_length(graph)
    out = dict(strategies)
    for region in sequence_regions(graph, strategies, mesh_shape):
        drop = set(region.axes)
        for op in region.ops:
            node, s = graph.op(op), strategies[op]

            def strip(specs, shapes):
                return tuple(sp.without_axes(drop) if seq is not None and _seq_axes(sp, sh, seq) else sp
                             for sp, sh in zip(specs, shapes))

            key = (strip(s.out_specs, node.out_shapes), strip(s.in_specs, node.in_shapes))
            hit = [x for x in strategies_of(node) if x.key == key]
            if hit:
                out[op] = min(hit, key=lambda x: x.cost)
    return out
