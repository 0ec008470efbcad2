"""Every operator's layer from the forward operators' layers: the backward pass fitted to them, updates, inputs and
outputs following their neighbours. Shared by :mod:`autopar_lab.graph.relayer` (markers, clustering) and
:mod:`autopar_lab.graph.layerfind` (layers found from scopes and parameter paths).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .opgraph import BACKWARD, FORWARD, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, OpGraph

_PSEUDO = frozenset([INPUT_PRIMITIVE, OUTPUT_PRIMITIVE])


def layers_from_forward(graph: OpGraph, fwd_layer: dict[int, int], names: Sequence[str]) -> list[str]:
    """Per operator, its layer name, given the layer (an index into ``names``) of every forward operator: backward,
    update, input and output operators follow the forward ones by the rules of the module docstring."""
    return complete_layers(graph, fwd_layer, len(names), list(names), None)


def complete_layers(graph: OpGraph, fwd_layer: dict[int, int], L: int, names: Sequence[str],
                    bwd_layer: dict[int, int] | None) -> list[str]:
    """Per operator, its layer name, given the layer (an index into ``names``) of every forward operator and, when
    known, of every backward operator (``bwd_layer``; None: fitted by :func:`fit_backward`): step inputs take their
    first forward reader's layer, updates and outputs the layer of their largest input, the rest their first
    consumer's, else the last layer."""
    n = len(graph)
    layer: list[int | None] = [None] * n
    for i, k in fwd_layer.items():
        layer[i] = k
    producer = {tid: t.producer for tid, t in graph.tensors.items()}
    consumers = graph.consumers
    # Step inputs read by the forward pass: the layer of their first forward reader.
    for node in graph:
        if node.primitive == INPUT_PRIMITIVE:
            readers = [c for c in consumers.get(node.outputs[0], ()) if c in fwd_layer]
            if readers:
                layer[node.id] = fwd_layer[readers[0]]
    bwd = [node.id for node in graph if node.role == BACKWARD and node.primitive not in _PSEUDO]
    if bwd:
        if bwd_layer is None:
            bwd_layer = fit_backward(graph, bwd, layer, producer, L)
        for i, k in bwd_layer.items():
            layer[i] = k
    alias_output = {node.params.get("alias_of"): node.id for node in graph
                    if node.primitive == OUTPUT_PRIMITIVE and node.params.get("alias_of") is not None}
    # Update operators, outputs, optimizer state: the largest input with a layer; repeat until nothing changes.
    for _ in range(n + 1):
        changed = False
        for node in graph:
            i = node.id
            if layer[i] is not None:
                continue
            if node.primitive == INPUT_PRIMITIVE:
                t = node.outputs[0]
                readers = [c for c in consumers.get(t, ()) if layer[c] is not None]
                out = alias_output.get(t)
                found: int | None = layer[readers[0]] if readers else (layer[out] if out is not None else None)
            else:
                best, found = -1, None
                for t in node.inputs:
                    p = producer.get(t)
                    if p is not None and layer[p] is not None and graph.tensor(t).nbytes > best:
                        best, found = graph.tensor(t).nbytes, layer[p]
            if found is not None:
                layer[i] = found
                changed = True
        if not changed:
            break
    # Whatever is left (reads nothing with a layer): its first consumer's layer, else the last layer.
    for node in reversed(list(graph)):
        if layer[node.id] is None:
            ks = [layer[c] for t in node.outputs for c in consumers.get(t, ()) if layer[c] is not None]
            layer[node.id] = ks[0] if ks else L - 1
    return [names[k] for k in layer if k is not None]  # every operator has one by now


def fit_backward(graph: OpGraph, bwd: Sequence[int], layer: list, producer: dict, L: int) -> dict[int, int]:
    """Non-increasing layers along the backward operators (program order), each near the latest forward layer it
    reads directly (isotonic regression, FLOP-weighted, ten times the penalty for sitting before that layer)."""
    m = len(bwd)
    levels = np.arange(L)
    fl = np.array([graph.op(i).flops for i in bwd], dtype=float)
    mean = fl.mean() if m and fl.mean() > 0 else 1.0
    best = np.zeros(L)
    back = np.zeros((m, L), dtype=np.int64)
    for p, i in enumerate(bwd):
        hints = []
        for t in graph.op(i).inputs:
            q = producer.get(t)
            if q is not None and layer[q] is not None and graph.op(q).role == FORWARD:
                hints.append(layer[q])
        if hints:
            h = max(hints)
            w = 1.0 + fl[p] / mean
            cost = np.where(levels >= h, w * (levels - h), 10.0 * w * (h - levels))
        else:
            cost = np.zeros(L)
        # suffix minimum of the previous row (the previous operator's layer must be >= this one's), and where
        suffix = np.minimum.accumulate(best[::-1])[::-1]
        idx_rev = np.minimum.accumulate(np.where(best == suffix, levels, L)[::-1])[::-1]
        back[p] = idx_rev
        best = cost + suffix
    out = {}
    k = int(np.argmin(best))
    for p in range(m - 1, -1, -1):
        out[bwd[p]] = k
        k = int(back[p][k])
    return out
