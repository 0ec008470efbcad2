"""Alpa's operator clustering (OSDI'22 §5.3): cut a topologically ordered op list into layers.

Objective: minimise the largest number of bytes any layer receives from earlier ops,

    G(k, r) = min_i max{ G(i-1, r-1), C(i, k) }

where ``C(i, k)`` sums the bytes of edges ``(u, v)`` with ``u < i <= v <= k`` (what layer
``[i..k]`` reads from before it), subject to every layer's FLOPs being at most
``(1 + delta) * total / num_layers``. Among the partitions that reach the smallest such
maximum, the one whose heaviest layer is lightest is returned (the most balanced).

Works on plain data: FLOPs per op and ``(u, v, bytes)`` edges, ops in topological order.

>>> # two heavy blocks of 3 ops joined by one tiny edge (2 -> 3): the cut falls there
>>> flops = [1, 1, 1, 1, 1, 1]
>>> edges = [(0, 1, 100), (1, 2, 100), (2, 3, 1), (3, 4, 100), (4, 5, 100), (0, 5, 1)]
>>> cluster_layers(flops, edges, 2)
[0, 3]
>>> layers_from_scopes(["embed", "embed", None, "block0", "block0", "head"])
[0, 3, 5]
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

__all__ = ["cluster_layers", "layers_from_scopes", "cut_bytes_matrix", "layer_flops_bound"]


def cut_bytes_matrix(num_ops: int, edges: Iterable[tuple[int, int, float]]) -> np.ndarray:
    """``C[i, k]``: bytes flowing into ops ``[i..k]`` from ops ``< i`` (0 below the diagonal).

    O(n^2) memory: fine for merged graphs of a few thousand ops.

    >>> cut_bytes_matrix(3, [(0, 1, 5.0), (0, 2, 7.0), (1, 2, 1.0)])[1].tolist()
    [0.0, 5.0, 12.0]
    """
    W = np.zeros((num_ops, num_ops))
    for u, v, b in edges:
        u, v, b = int(u), int(v), float(b)
        if not (0 <= u < v < num_ops):
            raise ValueError(
                f"edge ({u}, {v}) must go forward between ops 0..{num_ops - 1}; list ops in topological order."
            )
        if not (math.isfinite(b) and b >= 0):
            raise ValueError(f"edge ({u}, {v}) has bytes={b!r}; use a finite non-negative number.")
        W[u, v] += b
    # P[i, v] = bytes into op v from ops < i; C[i, k] = sum over v in [i, k] of P[i, v].
    P = np.vstack([np.zeros((1, num_ops)), np.cumsum(W, axis=0)[:-1]])
    C = np.cumsum(np.triu(P), axis=1)
    return np.triu(C)


def layer_flops_bound(op_flops: "Sequence[float] | np.ndarray", num_layers: int, delta: float) -> float:
    """``(1 + delta) * sum(op_flops) / num_layers``."""
    return (1.0 + delta) * float(sum(op_flops)) / num_layers


def _bottleneck(cost: np.ndarray, allowed: np.ndarray, r: int):
    """min over partitions of ops 0..n-1 into ``r`` contiguous layers [i..k] with allowed[i, k]
    of the max of cost[i, k]. Returns (value, starts), or (inf, None).

    G[q][k]: best for ops 0..k in q layers. G[q][k] = min_i max(G[q-1][i-1], cost[i, k]).
    """
    n = cost.shape[0]
    masked = np.where(allowed, cost, np.inf)
    G = masked[0].copy()  # one layer: ops 0..k
    choice: list[np.ndarray | None] = [None]
    for q in range(2, r + 1):
        newG = np.full(n, np.inf)
        arg = np.zeros(n, dtype=np.int64)
        for k in range(q - 1, n):
            # Last layer starts at i in q-1..k; the previous q-1 layers cover 0..i-1.
            i = np.arange(q - 1, k + 1)
            vals = np.maximum(G[i - 1], masked[i, k])
            j = int(np.argmin(vals))
            newG[k], arg[k] = vals[j], i[j]
        G = newG
        choice.append(arg)
    value = float(G[n - 1])
    if not math.isfinite(value):
        return math.inf, None
    starts: list[int] = []
    k = n - 1
    for q in range(r, 1, -1):
        arg_q = choice[q - 1]
        assert arg_q is not None  # filled for every q >= 2
        start = int(arg_q[k])
        starts.append(start)
        k = start - 1
    return value, [0, *reversed(starts)]


def cluster_layers(
    op_flops: Sequence[float],
    edges: Iterable[tuple[int, int, float]],
    num_layers: int,
    delta: float = 0.5,
) -> list[int]:
    """Cut ops ``0..n-1`` into ``num_layers`` contiguous layers; return each layer's first op.

    1. Minimise the largest ``C(i, k)`` (bytes a layer reads from earlier ops) over the
       partitions whose layers all have at most ``(1 + delta) * average`` FLOPs.
    2. Among those optimal partitions, minimise the heaviest layer's FLOPs.

    If no partition meets the FLOP bound (one op heavier than the bound, say), the bound is
    raised to the smallest heaviest-layer FLOPs any partition can reach, i.e. delta is
    relaxed exactly as much as needed and no more.

    >>> cluster_layers([4, 1, 1, 1, 1], [(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 4, 1)], 2, delta=0.0)
    [0, 1]
    """
    flops = np.asarray([float(f) for f in op_flops])
    n = len(flops)
    if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}.")
    if n == 0:
        raise ValueError("op_flops is empty; give at least one op.")
    if num_layers > n:
        raise ValueError(f"num_layers={num_layers} exceeds the {n} ops; ask for at most {n} layers.")
    if not (np.all(np.isfinite(flops)) and np.all(flops >= 0)):
        raise ValueError("op_flops must hold finite non-negative numbers.")
    if not (math.isfinite(delta) and delta >= 0):
        raise ValueError(f"delta must be a finite non-negative number, got {delta!r}.")

    C = cut_bytes_matrix(n, edges)
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    F = prefix[None, 1:] - prefix[:-1, None]  # F[i, k] = FLOPs of ops i..k
    upper = np.triu(np.ones((n, n), dtype=bool))

    cap = layer_flops_bound(flops, num_layers, delta)
    fits = upper & (F <= cap * (1 + 1e-12))  # relative slack: sums of floats, not exact
    best_cut, _ = _bottleneck(C, fits, num_layers)
    if not math.isfinite(best_cut):
        least_cap, _ = _bottleneck(F, upper, num_layers)
        fits = upper & (F <= least_cap)
        best_cut, _ = _bottleneck(C, fits, num_layers)
    # Tie-break: among partitions reaching best_cut, the lightest heaviest layer.
    _, starts = _bottleneck(F, fits & (C <= best_cut), num_layers)
    return starts


def layers_from_scopes(scopes: Sequence[str | None]) -> list[int]:
    """Layer boundaries where the name scope changes, for ops in topological order.

    An op with scope ``None`` joins the previous op's layer (leading ``None`` ops join the
    first layer). A scope that comes back later starts a new layer: layers are contiguous.

    >>> layers_from_scopes([None, "a", "a", "b", None, "a"])
    [0, 3, 5]
    """
    if len(scopes) == 0:
        raise ValueError("scopes is empty; give one entry per op.")
    starts = [0]
    current = None
    for idx, scope in enumerate(scopes):
        if scope is None:
            continue
        if current is not None and scope != current:
            starts.append(idx)
        current = scope
    return starts
