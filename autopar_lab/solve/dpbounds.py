"""Lower bounds the stage DP uses to skip work that cannot produce a better pipeline (exact: nothing they skip can
beat the best latency already known).

All of them come from one quantity, a stage's *device-seconds*: a stage of layers a..b on a submesh of d devices
takes t >= E[a, b] / d per microbatch, where ``E[a, b]`` is the smallest ``d * t`` over every candidate for that
range (every submesh shape, every option). Then, for a pipeline of stages i with times t_i on d_i devices, every
device used exactly once (sum d_i = N):

- the largest stage time is at least the average over devices: ``max t_i >= sum d_i t_i / N >= H / N`` with ``H``
  the smallest sum of E over any partition of the layers into ranges (:func:`partition_bounds`);
- the sum of the stage times is at least ``(sum_i sqrt(E_i))^2 / N`` (Cauchy-Schwarz: ``(sum sqrt(E_i / d_i)
  sqrt(d_i))^2 <= sum E_i / d_i * sum d_i``), so with ``s`` stages it is at least ``G_s^2 / N``, ``G_s`` the smallest
  ``sum sqrt(E_i)`` over partitions into exactly s ranges; each cut between stages adds at least the cheapest cut.

A pipeline's latency ``sum t + sum c + (B - 1) max(t, c)`` is then at least ``G_s^2 / N + (s - 1) c_min + (B - 1)
t_max``, which bounds the stage count worth solving for (:func:`stage_sum_bounds`).

>>> E = np.array([[1.0, 4.0], [np.inf, 1.0]])   # two layers: 1 device-second each, 4 together
>>> H, G = partition_bounds(E, 2)
>>> float(H), [float(g) for g in G]             # best partition: two ranges (1 + 1); sqrt sums: 2 (one), 2 (two)
(2.0, [2.0, 2.0])
"""

from __future__ import annotations

import numpy as np

__all__ = ["device_seconds", "partition_bounds", "stage_sum_bounds"]


def device_seconds(fastest: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``E[a, b]``: the smallest devices x seconds of any candidate for layers a..b. ``fastest[a, b, sh]``: the
    fastest usable candidate's time on shape ``sh`` (inf where none); ``sizes[sh]``: its device count.

    >>> device_seconds(np.array([[[2.0, 0.75]]]), np.array([1, 4]))
    array([[2.]])
    """
    with np.errstate(invalid="ignore"):
        return np.min(fastest * sizes[None, None, :], axis=-1, initial=np.inf)


def partition_bounds(E: np.ndarray, max_parts: int) -> tuple[float, np.ndarray]:
    """(H, G): ``H`` the smallest sum of ``E`` over partitions of the layers into consecutive ranges; ``G[s - 1]``
    the smallest sum of ``sqrt(E)`` over partitions into exactly s ranges (inf where none), s = 1..max_parts."""
    L = E.shape[0]
    root = np.sqrt(E)
    # Over suffixes: best[k] = min over partitions of layers k..L-1.
    h = np.full(L + 1, np.inf)
    h[L] = 0.0
    for k in range(L - 1, -1, -1):
        h[k] = np.min(E[k, k:] + h[k + 1:], initial=np.inf)
    G = np.full(max_parts, np.inf)
    g = np.full(L + 1, np.inf)  # g[k]: min sum of sqrt over partitions of k..L-1 into s ranges (s so far)
    g[L] = 0.0
    # Every k at once: [k, i] is root[k, i] + g[i + 1] for a range k..i (i >= k), inf below (no range), so the row
    # minimum is the same float as the minimum over i >= k alone (a min does not round).
    ranges = np.where(np.triu(np.ones((L, L), dtype=bool)), root, np.inf)
    for s in range(1, max_parts + 1):
        nxt = np.full(L + 1, np.inf)
        nxt[:L] = np.min(ranges + g[None, 1:], axis=1, initial=np.inf)
        g = nxt
        G[s - 1] = g[0]
    return float(h[0]), G


def stage_sum_bounds(G: np.ndarray, devices: int, cut_min: float) -> np.ndarray:
    """``out[s - 1]``: a lower bound on ``sum t + sum c`` of any pipeline with s stages *or more* (a running minimum
    from the top, so the stage counts worth trying are a prefix). ``cut_min``: the cheapest priced cut.

    >>> stage_sum_bounds(np.array([2.0, 3.0, 2.5]), 1, 1.0).tolist()   # 4, 10, 8.25 -> suffix minima
    [4.0, 8.25, 8.25]
    """
    s = np.arange(1, len(G) + 1)
    own = G * G / devices + (s - 1) * cut_min
    return np.minimum.accumulate(own[::-1])[::-1]
