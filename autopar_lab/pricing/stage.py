"""The stage-cost formula: what a pipeline stage costs per microbatch, from its layers' costs.

A stage running layers ``a..b`` on a microbatch of ``batch / B`` samples costs ``sum(layer costs) / B`` plus a fixed
launch overhead per heavy operator (``LAUNCH_OVERHEAD_S``: the term that stops more microbatches from being free);
each forward and each backward task also costs the device's ``task_overhead_s`` (:func:`task_overhead_s`). With
rematerialisation it holds only its input activations and runs its forward pass twice.

:func:`stage_cost` is the one place this is written: the cost table calls it with floats for one stage
(:meth:`~autopar_lab.pricing.table.CostTable.stage`) and with numpy arrays for every layer range of a submesh at
once (:class:`~autopar_lab.pricing.table.StageBlock`), so both give the same numbers to the bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..solve.inter import StageCandidate

if TYPE_CHECKING:
    from ..cluster import Cluster

#: Seconds per heavy operator (matmul, convolution, reduction, gather) per microbatch.
LAUNCH_OVERHEAD_S = 5e-6

#: The layer-cost fields a stage adds up over its layers (running sums of them make any range O(1)).
SUM_FIELDS = ("fwd_s", "bwd_s", "static_bytes", "act_bytes", "heavy_fwd", "heavy_bwd")


def prefix_sums(costs: Sequence[Any]) -> dict[str, list[float]]:
    """Running sums of each :data:`SUM_FIELDS` field over a list of LayerCosts: ``sums[f][b + 1] - sums[f][a]`` is
    the total over layers ``a..b``."""
    sums: dict[str, list[float]] = {f: [0.0] for f in SUM_FIELDS}
    for c in costs:
        for f in SUM_FIELDS:
            sums[f].append(sums[f][-1] + getattr(c, f))
    return sums


def stage_cost(totals: Mapping[str, Any], entry_bytes: Any, microbatches: int, devices: int, remat: bool,
               task_s: float) -> tuple[Any, Any, Any, Any]:
    """(forward s, backward s, static bytes, activation bytes) of one stage per microbatch.

    ``totals``: each of :data:`SUM_FIELDS` summed over the stage's layers (per training step at the full batch);
    ``entry_bytes``: the activation bytes (full batch) entering the stage's first layer; ``devices``: the stage's
    device count; ``task_s``: the per-task overhead (:func:`task_overhead_s`). Floats give one stage; numpy arrays
    (broadcastable) give many at once, with the same float operations.

    >>> t = dict(fwd_s=4.0, bwd_s=8.0, static_bytes=10.0, act_bytes=6.0, heavy_fwd=2, heavy_bwd=4)
    >>> stage_cost(t, 0.0, 2, 1, False, 0.0)
    (2.00001, 4.00002, 10.0, 3.0)
    >>> stage_cost(t, 4.0, 2, 2, True, 0.0)   # remat: holds its (sharded) input, runs the forward twice
    (2.00001, 6.000030000000001, 10.0, 1.0)
    """
    B = microbatches
    fwd = totals["fwd_s"] / B + LAUNCH_OVERHEAD_S * totals["heavy_fwd"]
    bwd = totals["bwd_s"] / B + LAUNCH_OVERHEAD_S * totals["heavy_bwd"]
    static = totals["static_bytes"]
    act = totals["act_bytes"] / B
    if remat:
        # Only the stage's input is kept (sharded over the mesh); the forward pass runs again in the backward.
        act = entry_bytes / B / devices
        bwd = bwd + fwd
    # Once per task: a rematerialised backward is still one task.
    return fwd + task_s, bwd + task_s, static, act


def task_overhead_s(cluster: Cluster, submesh: Sequence[int]) -> float:
    """Seconds charged per stage task (the forward, or the backward, of one microbatch): the device's
    ``task_overhead_s`` times the host's devices over the stage's devices on that host. A host runs every
    stage's tasks from one driver, so a stage on d of its D devices gets d/D of it, as it gets d/D of the
    host's cores (measured on the cpu preset: tasks of different stages do not overlap). 0 on the GPU presets."""
    per_host = cluster.devices_per_host
    return cluster.device.task_overhead_s * per_host / min(int(submesh[1]), per_host)


def pareto(cands: Sequence[StageCandidate]) -> list[StageCandidate]:
    """The candidates no other candidate beats on every count (forward time, backward time, static and activation
    memory): the stage DP and the simulation can never prefer a dominated one, so dropping them changes no plan.

    >>> a = StageCandidate((0, 0), (1, 2), (1, 2), False, 1.0, 2.0, 10.0, 5.0)
    >>> b = StageCandidate((0, 0), (1, 2), (2, 1), False, 1.5, 2.0, 10.0, 5.0)
    >>> [c.logical_mesh for c in pareto([a, b])]
    [(1, 2)]
    """
    keys = [(c.fwd_s, c.bwd_s, c.static_bytes, c.act_bytes) for c in cands]
    out = []
    for i, ki in enumerate(keys):
        dominated = any(all(x <= y for x, y in zip(kj, ki)) and (kj != ki or j < i)
                        for j, kj in enumerate(keys) if j != i)
        if not dominated:
            out.append(cands[i])
    return out
