"""The stage search every plan's layout comes from: the stage DP over a cost table for each microbatch count.

:func:`search_microbatches` runs :func:`~autopar_lab.solve.inter.stage_dp` for each count :func:`microbatch_choices`
offers and keeps the fastest; a deep model's DP cuts only on a coarser :func:`layer_grid`; :func:`wgrad_share` is the
zero-bubble schedule's weight-gradient share the DP's formula takes. It makes no plan: the planner
(:mod:`autopar_lab.planner`) and the re-solves around pins (:mod:`autopar_lab.pins`) price what it finds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from .solve import inter

if TYPE_CHECKING:
    from .pricing import CostTable

__all__ = ["microbatch_choices", "layer_grid", "LAYER_GRID_MAX", "CoarseCandidates", "search_microbatches",
           "wgrad_share", "CandidateFactory"]

#: ``candidates(microbatches, mem_limit_bytes or None)`` -> the DP's ``candidates(start, end, submesh)``.
CandidateFactory = Callable[[int, "float | None"], Callable[[int, int, tuple], Sequence[inter.StageCandidate]]]


def microbatch_choices(batch: int, microbatches) -> list[int]:
    """The microbatch counts to try, for ``"auto"``: every power of two dividing ``batch`` (Alpa's choices); and
    where those reach less than half way to the batch on a log scale (a batch with a large odd factor, like
    Megatron-LM's 2,520), for each power of two that does not divide it, the batch's divisor nearest to it (by
    ratio), so that the search still spans 1 to the batch in steps of about 2. Else ``[microbatches]`` (which must
    divide the batch).

    >>> microbatch_choices(24, "auto"), microbatch_choices(24, 3), microbatch_choices(2520, "auto")[-6:]
    ([1, 2, 4, 8], [3], [63, 126, 252, 504, 840, 2520])
    """
    if microbatches == "auto":
        powers = [1 << e for e in range(batch.bit_length())]
        out = {p for p in powers if batch % p == 0}
        if max(out) ** 2 < batch:  # the powers of two cover under half of [1, batch] in log scale
            divisors = [d for d in range(1, batch + 1) if batch % d == 0]
            out |= {min(divisors, key=lambda d: max(d / p, p / d)) for p in powers}
            out.add(batch)
        return sorted(out)
    b = int(microbatches)
    if b < 1 or batch % b:
        raise ValueError(f"microbatches={microbatches} must be a positive divisor of the batch size {batch}")
    return [b]


#: Above this many layers the stage DP of a deep model cuts only on a coarser grid (see :func:`layer_grid`).
LAYER_GRID_MAX = 66


def layer_grid(num_layers: int, most: int = LAYER_GRID_MAX) -> list[int]:
    """The first layer of each block the stage DP may cut between: every layer up to ``most`` layers; above, the
    first and the last layer alone (a deep zoo model's embedding and head) and the layers between in equal groups,
    so that at most ``most`` blocks remain. An approximation (a stage boundary falls on a group edge), taken for
    the DP's cost, which grows with the cube of the layer count; its gap is measured in ``bench/RESULTS.md``.

    >>> layer_grid(5), layer_grid(10, most=6)
    ([0, 1, 2, 3, 4], [0, 1, 3, 5, 7, 9])
    """
    if num_layers <= most:
        return list(range(num_layers))
    g = math.ceil((num_layers - 2) / (most - 2))
    return [0] + list(range(1, num_layers - 1, g)) + [num_layers - 1]


class CoarseCandidates:
    """A :class:`~autopar_lab.pricing.table.StageCandidates` seen on a layer grid: block b of the grid is layers
    starts[b]..ends[b] (the arrays are sub-arrays, the candidates made are the full-layer ones)."""

    def __init__(self, fine, starts: list[int], ends: list[int]):
        self.fine, self.starts, self.ends = fine, np.array(starts), np.array(ends)

    def block(self, submesh):
        b = self.fine.block(submesh)
        if b is None:
            return None
        if np.array_equal(getattr(b, "starts", None), self.starts) and np.array_equal(getattr(b, "ends", None),
                                                                                      self.ends):
            return b  # priced on the grid already (CostTable.candidate_fn(grid=...)): its make takes positions
        ix = np.ix_(np.arange(b.usable.shape[0]), self.starts, self.ends)
        starts, ends = self.starts, self.ends
        return inter.CandidateBlock(b.fwd_s[ix], b.bwd_s[ix], b.static_bytes[ix], b.act_bytes[ix], b.usable[ix],
                                    lambda k, a, e: b.make(k, int(starts[a]), int(ends[e])))


def search_microbatches(table: CostTable, problem: inter.StageProblem, choices: Sequence[int], *,
                        candidates: CandidateFactory | None = None,
                        grid: Sequence[int] | None = None) -> inter.InterResult:
    """The stage DP for each microbatch count, the fastest plan kept: what ``inter.stage_dp_auto`` (the reference)
    does, with the same answer (ties to the smaller count) and the same ``diagnostics["by_microbatches"]``, in less
    time. The one microbatch search: :func:`~autopar_lab.planner.auto_plan` and
    :func:`~autopar_lab.pins.resolve` both use it.

    Counts are tried from the largest down, and the search stops at the first count where nothing fits: a
    candidate's memory, ``static + min(s, B) * act / B``, never grows with ``B``, so a plan that fits with ``B``
    microbatches fits with any larger count, and a count where nothing fits rules out every smaller one. The
    candidates come from ``candidates(B, mem_limit_bytes)`` (default: :meth:`CostTable.candidate_fn`, vectorised,
    unusable ones dropped; with ``None`` for the limit every candidate; with ``grid`` (first layers of blocks, see
    :func:`layer_grid`) stages start only at those layers). The best latency found so far is handed to
    each DP as an upper bound, so its t_max search skips what cannot beat it, and a count whose latency lower
    bound (:func:`~autopar_lab.solve.inter.dp.latency_lower_bound`) cannot is not searched at all (one memory DP
    says whether it fits); a count that cannot is recorded as ``inf`` in ``by_microbatches`` (stage_dp_auto records
    its exact latency). When nothing fits at all, the largest count is run again with every candidate, for the
    error's smallest memory requirement.
    ``problem``: the stage problem (:class:`~autopar_lab.solve.inter.StageProblem`, e.g.
    ``StageProblem.on(cluster, ...)``: the cluster, memory limit, links, schedule with its ``virtual_stages`` or
    ``wgrad_share``, pins); its layer count, microbatch count and cut bytes are this search's (the table's layers,
    or the grid's blocks; each count of ``choices``; the table's cut bytes over the count).
    """
    make: Callable[[int, float | None], Any] = candidates if candidates is not None else table.candidate_fn
    L = len(table.layer_names)
    cuts = list(table.cut_bytes)
    if grid is not None and list(grid) != list(range(L)):  # cut only at the grid's blocks
        starts = list(grid)
        ends = [b - 1 for b in starts[1:]] + [L - 1]
        fine, L = make, len(starts)
        if candidates is None:  # the table's blocks priced on the grid only (the same numbers there)
            fine = lambda B, m: table.candidate_fn(B, m, grid=(starts, ends))  # noqa: E731
        cuts = [table.cut_bytes[a - 1] for a in starts[1:]]
        make = lambda B, m: CoarseCandidates(fine(B, m), starts, ends)  # noqa: E731
    mem = problem.mem_limit_bytes
    by: dict[int, float | None] = {B: None for B in choices}
    solved: dict[int, inter.InterResult] = {}
    best: inter.InterResult | None = None
    order = sorted(set(choices), reverse=True)
    for n, B in enumerate(order):
        if table.on_progress:  # the stage DP's progress (and a cancel's chance) once per microbatch count
            table.on_progress(f"stage DP, {B} microbatches", n, len(order))
        # The best latency so far bounds the DP's t_max search (nextafter: an equal latency with fewer
        # microbatches still wins, as in stage_dp_auto).
        bound = math.nextafter(best.latency_s, math.inf) if best is not None else math.inf
        try:
            r = inter.stage_dp(dataclasses.replace(problem, num_layers=L, microbatches=B,
                                                   cut_bytes=[c / B for c in cuts]),
                               make(B, mem), inter.DPOptions(upper_bound=bound, skip_unbeatable=True))
        except inter.NoFeasiblePlanError:
            break
        if r is None:
            by[B] = math.inf  # plans fit, but none beats the best: not solved to the end
            continue
        by[B] = r.latency_s
        solved[B] = r
        if best is None or r.latency_s < best.latency_s or (r.latency_s == best.latency_s and B < best.microbatches):
            best = r
    if best is None:
        B = max(choices)
        try:
            best = inter.stage_dp(dataclasses.replace(problem, num_layers=L, microbatches=B,
                                                      cut_bytes=[c / B for c in cuts]), make(B, None))
        except inter.NoFeasiblePlanError as e:
            raise inter.NoFeasiblePlanError(f"for every microbatch count in {list(choices)}: {e}",
                                            e.min_mem_bytes) from e
        if best is None:  # pragma: no cover - stage_dp returns None only under an upper bound
            raise inter.NoFeasiblePlanError(f"for every microbatch count in {list(choices)}: no plan", math.inf)
        by[B] = best.latency_s  # pragma: no cover - the filtered candidates lose no usable one
    best.diagnostics["by_microbatches"] = by
    best.diagnostics["solved"] = solved  # every count's DP plan solved to the end (see auto_plan)
    return best


def wgrad_share(table: CostTable) -> float:
    """ZB-H1's weight-gradient part W as a share of a stage's fwd + bwd, the figure the stage DP's zero-bubble
    formula takes (:func:`~autopar_lab.solve.inter.schedule_latency`): measured on the whole model on one device
    (:func:`~autopar_lab.pricing.wgrad.weight_grad_fraction` of the backward), the DP's default when the table
    has nothing to measure."""
    from .pricing.wgrad import weight_grad_fraction

    costs, intra = table.mesh_costs((1, 1), (1, 1))
    fwd, bwd = sum(c.fwd_s for c in costs), sum(c.bwd_s for c in costs)
    if fwd + bwd <= 0:
        return inter.DEFAULT_WGRAD_SHARE
    share = weight_grad_fraction(table, intra, costs, 0, len(costs) - 1) * bwd / (fwd + bwd)
    return min(max(share, 0.0), 0.9)
