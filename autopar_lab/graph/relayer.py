"""Re-assign an OpGraph's layers: at user-marked boundaries, by Alpa's operator clustering, or as the scopes say.

The layers of a captured graph come from name scopes (see :mod:`autopar_lab.graph.capture`). A step without scopes
has a single layer, which leaves the pipeline (inter-operator) pass nothing to cut. :func:`relayer` returns a new
graph, same operators and tensors, whose ``OpNode.layer`` fields say where the pipeline may cut:

``"markers"``
    The user called :func:`autopar_lab.pipeline_boundary` inside the step. Forward operators, in the graph's
    (topological, program) order, are cut at the forward markers: ``stage_0`` holds what runs before the first
    marker, ``stage_k`` marker ``k-1`` (the marker starts the layer its output flows into) and what runs up to
    marker ``k``. Leaves of one pytree marked by one call (same ``index``, adjacent) are one boundary.
``"cluster"``
    Alpa's operator clustering DP (:func:`~autopar_lab.graph.layering.cluster_layers`) over the forward operators
    in topological order: ``num_layers`` contiguous layers ``cluster_0``, ``cluster_1``, ... that minimise the
    largest number of bytes a layer reads from earlier layers, each layer's FLOPs at most ``(1 + delta)`` x the
    average. More than ``MAX_CLUSTER_OPS`` forward operators are first grouped into that many runs of consecutive
    operators (the DP is quadratic in memory).
``"scopes"``
    The layers capture gave (from name scopes), unchanged.
``"auto"``
    ``"markers"`` if the graph has any, else ``"scopes"`` if it has more than one layer, else ``"cluster"`` with
    ``num_layers = min(8, number of forward dot_general/conv operators)`` (at least 1).

``layers="backbone/transformer_layer_*"`` instead names the level of the name-scope tree (or of the parameters'
paths) whose members are the layers (see :mod:`autopar_lab.graph.layerfind`); ``graph.layer_rule`` of the result
says which rule made its layers.

The rest of the step follows the forward layers:

- **Backward operators.** With markers, JAX's transpose puts each marker's twin (same ``index``) into the backward
  pass, and it emits the backward in reverse program order, so the backward markers cut the backward operators
  exactly as the forward ones cut the forward: what runs after backward marker ``k`` (and before the next one) is the
  backward of ``stage_k``; what runs before the first one is the backward of the last layer. Without backward
  markers (clustering, or markers whose twins are missing), each backward operator's layer is fitted: walking the
  backward operators in program order, layers may only go down (the backward visits layers last to first), and an
  operator should sit in (and never before) the latest layer among the forward tensors it reads directly (the
  residuals of the forward operator it differentiates, or its parameter). The fit minimises the FLOP-weighted
  distance to those hints, ten times more for sitting too early (isotonic regression by DP); a weight gradient
  ``x^T g`` whose ``x`` comes from the previous layer is kept in its own layer by its neighbours.
- **Step inputs.** A parameter (or batch) takes the layer of its first forward reader; optimizer state and anything
  read only after the backward takes the layer of its first reader that has one (or of the output that updates it).
- **Update operators and outputs.** Each takes the layer of its largest input that already has a layer (the
  gradient or the parameter it updates, rather than a scalar such as a learning rate or a global norm), repeated
  until nothing changes; operators still without one take their first consumer's layer, and finally the last layer.

So a block's forward matmul, its weight-gradient matmul and the optimizer update of its weight share one layer.

Example:
    >>> import jax, jax.numpy as jnp
    >>> import autopar_lab as al
    >>> def loss(ws, x):
    ...     for i, w in enumerate(ws):
    ...         x = jnp.tanh(x @ w)
    ...         x = al.pipeline_boundary(x) if i < len(ws) - 1 else x
    ...     return x.sum()
    >>> ws, x = [jnp.zeros((4, 4))] * 3, jnp.zeros((2, 4))
    >>> g = relayer(al.trace(lambda ws, x: jax.grad(loss)(ws, x), ws, x, batch_argnums=(1,)), boundaries="markers")
    >>> g.layers
    ['stage_0', 'stage_1', 'stage_2']
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from .complete import complete_layers, layers_from_forward  # noqa: F401 - offered here as before
from .layering import cluster_layers
from .markers import MARKER_PRIMITIVE
from .opgraph import BACKWARD, FORWARD, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, OpGraph

__all__ = ["relayer", "layers_from_forward", "BOUNDARIES", "MAX_CLUSTER_OPS"]

BOUNDARIES = ("auto", "markers", "scopes", "cluster")
MAX_CLUSTER_OPS = 2000
_HEAVY = frozenset(["dot_general", "conv_general_dilated"])
_PSEUDO = frozenset([INPUT_PRIMITIVE, OUTPUT_PRIMITIVE])


def relayer(graph: OpGraph, *, boundaries: str = "auto", num_layers: int | None = None,
            delta: float = 0.5, layers: str | None = None) -> OpGraph:
    """A new OpGraph, same operators, tensors, inputs, outputs, warnings, name and trace time, whose operators'
    ``layer`` fields are re-assigned (see the module docstring for the rules).

    ``boundaries``: ``"auto"``, ``"markers"``, ``"scopes"`` or ``"cluster"``. ``num_layers`` and ``delta`` are for
    the clustering (``num_layers`` defaults to ``min(8, forward matmuls/convolutions)``). ``layers``: a pattern that
    names the layers' level (``"backbone/transformer_layer_*"``), instead of ``boundaries``.
    """
    if not isinstance(graph, OpGraph):
        raise TypeError(f"relayer expects an OpGraph (from autopar_lab.trace), got a {type(graph).__name__}")
    if layers is not None:
        from .layerfind import find_layers

        return find_layers(graph, layers=layers, cluster=lambda g: relayer(g, boundaries="cluster"))
    if boundaries not in BOUNDARIES:
        raise ValueError(f"boundaries={boundaries!r} is not one of {', '.join(map(repr, BOUNDARIES))}")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer))
                                   or num_layers < 1):
        raise ValueError(f"num_layers must be a positive integer or None, got {num_layers!r}")
    nodes = list(graph)
    mode = boundaries
    if mode == "auto":
        if any(n.primitive == MARKER_PRIMITIVE and n.role == FORWARD for n in nodes):
            mode = "markers"
        elif len(graph.layers) > 1:
            mode = "scopes"
        else:
            mode = "cluster"
    new_layers: Sequence[str | None]
    if mode == "scopes":
        new_layers = [n.layer for n in nodes]
    elif mode == "markers":
        new_layers = _marker_layers(graph)
    else:
        new_layers = _cluster_layers(graph, num_layers, delta)
    new_nodes = [n if n.layer == lay else dataclasses.replace(n, layer=lay) for n, lay in zip(nodes, new_layers)]
    rule, note = (graph.layer_rule, graph.layer_note) if mode == "scopes" else (mode, _NOTES[mode])
    return graph.with_nodes(new_nodes, layers=(rule, note))


_NOTES = {"markers": "layers cut at the al.pipeline_boundary markers",
          "cluster": "layers from Alpa's operator clustering (the fewest bytes between layers, balanced FLOPs)"}


# --- forward layers ---------------------------------------------------------------------------------------------
def _forward_ops(graph: OpGraph) -> list[int]:
    return [n.id for n in graph if n.role == FORWARD and n.primitive not in _PSEUDO]


def _marker_groups(graph: OpGraph, ops: Sequence[int]) -> list[tuple[int, list[int]]]:
    """Boundaries among ``ops`` (in order): (index, marker op ids); a marker adjacent to the previous one with the
    same index (the leaves of one pytree) joins its boundary."""
    groups: list[tuple[Any, list[int]]] = []
    prev = None
    for i in ops:
        node = graph.op(i)
        if node.primitive == MARKER_PRIMITIVE:
            idx = node.params.get("index")
            if prev is not None and graph.op(prev).primitive == MARKER_PRIMITIVE and groups and groups[-1][0] == idx:
                groups[-1][1].append(i)
            else:
                groups.append((idx, [i]))
        prev = i
    return groups


def _marker_layers(graph: OpGraph) -> Sequence[str | None]:
    fwd = _forward_ops(graph)
    groups = _marker_groups(graph, fwd)
    if not groups:
        raise ValueError("the graph has no pipeline_boundary markers: call al.pipeline_boundary(x) inside the step "
                         "function where a pipeline stage may end, or use boundaries='cluster' (or 'auto')")
    L = len(groups) + 1
    starts = {ops[0]: t + 1 for t, (_, ops) in enumerate(groups)}
    layer: dict[int, int] = {}
    cur = 0
    for i in fwd:
        cur = starts.get(i, cur)
        layer[i] = cur
    bwd = [n.id for n in graph if n.role == BACKWARD and n.primitive not in _PSEUDO]
    bwd_layer = _backward_by_markers(graph, bwd, groups, L)
    return complete_layers(graph, layer, L, [f"stage_{k}" for k in range(L)], bwd_layer)


def _backward_by_markers(graph: OpGraph, bwd: Sequence[int], fwd_groups, L: int) -> dict[int, int] | None:
    """Backward layers cut at the backward markers, or None when they cannot be matched to the forward ones."""
    groups = _marker_groups(graph, bwd)
    if not groups:
        return None
    fwd_index = [idx for idx, _ in fwd_groups]
    unique = len(set(fwd_index)) == len(fwd_index)
    targets = []
    for j, (idx, _) in enumerate(groups):
        if unique and idx in fwd_index:
            targets.append(fwd_index.index(idx))  # forward boundary t: between stage_t and stage_{t+1}
        elif len(groups) == len(fwd_groups):
            targets.append(len(fwd_groups) - 1 - j)
        else:
            return None
    if any(b >= a for a, b in zip(targets, targets[1:])):
        return None  # not visited last to first: fall back to the fit
    starts = {ops[0]: t for t, (_, ops) in zip(targets, groups)}
    out, cur = {}, L - 1
    for i in bwd:
        cur = starts.get(i, cur)
        out[i] = cur
    return out


def _cluster_layers(graph: OpGraph, num_layers: int | None, delta: float) -> Sequence[str | None]:
    fwd = _forward_ops(graph)
    if not fwd:
        raise ValueError("the graph has no forward operators to cluster into layers")
    if num_layers is None:
        num_layers = max(1, min(8, sum(graph.op(i).primitive in _HEAVY for i in fwd)))
    if num_layers > len(fwd):
        raise ValueError(f"num_layers={num_layers} exceeds the {len(fwd)} forward operators; ask for at most "
                         f"{len(fwd)} layers")
    # Group consecutive operators into at most MAX_CLUSTER_OPS units (the DP's matrices are units x units).
    size = max(1, math.ceil(len(fwd) / MAX_CLUSTER_OPS))
    size = min(size, max(1, len(fwd) // num_layers))
    unit = {op: k // size for k, op in enumerate(fwd)}
    n_units = unit[fwd[-1]] + 1
    flops = [0.0] * n_units
    for op in fwd:
        flops[unit[op]] += graph.op(op).flops
    edges = {}
    for op in fwd:
        v = unit[op]
        for t in dict.fromkeys(graph.op(op).inputs):
            p = graph.tensor(t).producer
            if p is None or p not in unit or unit[p] >= v:
                continue
            key = (unit[p], v, t)
            edges[key] = graph.tensor(t).nbytes
    starts = cluster_layers(flops, [(u, v, b) for (u, v, _), b in edges.items()], num_layers, delta)
    unit_layer = np.searchsorted(np.asarray(starts), np.arange(n_units), side="right") - 1
    layer = {op: int(unit_layer[unit[op]]) for op in fwd}
    return complete_layers(graph, layer, num_layers, [f"cluster_{k}" for k in range(num_layers)], None)


