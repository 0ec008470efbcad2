"""Alpa's inter-operator pass (OSDI'22 §5.2): cut layers into pipeline stages and give each a submesh.

Everything here works on plain data. The caller poses a :class:`StageProblem` (layers,
cluster, microbatches, memory, transfers, schedule, pins) and supplies a function
``candidates(start, end, submesh)`` that lists the ways to run layers ``start..end``
(inclusive) on a submesh of shape ``(n, m)``; each way is a :class:`StageCandidate`
with its per-microbatch times and per-device memory. The DP picks stages, submeshes and
candidates to minimise the pipeline latency

    T = sum_i t_i + sum_j c_j + (B - 1) * max(max_i t_i, max_j n_j)

where ``t_i = fwd + bwd`` of stage ``i``, ``c_j = send_fwd + send_bwd`` of cut ``j`` (one microbatch's activation
and gradient both cross it on the critical path) and ``n_j = max(send_fwd, send_bwd)`` (links are full duplex:
in the steady state the two directions overlap, and the slower one paces the cut).
With ``stage_comm="ignore"`` every ``c_j`` is priced 0 and this is exactly Alpa's
``sum t_i + (B - 1) max t_i``. The interleaved and zero-bubble schedules have formulas of their own, of the same
shape (:func:`schedule_latency`), and hold other numbers of microbatches (:func:`held_microbatches`); both depend
on the total stage count, so for them the DP is solved once per stage count.

Placement rule (needed to know which link a cut uses). The cluster has N hosts of M
devices, numbered host-major (device ``h * M + r`` is slot ``r`` of host ``h``). Stages
take consecutive device ranges in pipeline order: stage 0 starts at device 0 and each
stage starts where the previous one ended. A submesh never straddles a host: a
``(1, m)`` stage must lie inside one host and an ``(n, M)`` stage must start on a host
boundary. The cut in front of a stage that starts at device offset ``o`` then uses the
intra-host link iff ``o % M != 0`` (both neighbours sit inside the same host), else the
inter-host link. Since ``o = N*M - d`` with ``d`` the devices still free, the DP state
``(s, k, d)`` of Alpa's recurrence already carries everything needed.

This differs from Alpa in one way: Alpa only counts devices (a multiset of submesh
shapes always tiles the cluster once sorted by size), so it may pick an order of stages
such as sizes 2, 4, 2 on hosts of 4, which the in-order rule above cannot place. The
workbench needs the in-order rule to price stage transfers and to place stages
without surprises; the brute-force reference uses the same rule.

Pinned decisions. ``StageProblem(constraints=StageConstraints(cuts=..., submeshes=..., logical_meshes=...,
remat=...))`` makes both solvers keep what a user fixed (an override re-solved around): the
cut positions exactly, and per stage a submesh, a logical mesh or a remat flag (``None``
entries are free). Any of them fixes the stage count S, so the DP keeps the stage count in its
state and stage ``j`` is the one with ``S - j`` stages still to place; a candidate is usable
for stage ``j`` only if the pins allow it. Pins that no assignment can keep, or that do not fit
in memory, raise :class:`NoFeasiblePlanError` with the smallest memory the pins need.

The package's modules, one job each: :mod:`.values` (candidates, the problem, the options, the result),
:mod:`.formulas` (placement, held microbatches, each schedule's formula, the transfer time), :mod:`.problem` (the
inputs checked, the candidate tables), :mod:`.dp` (the DP and its search), :mod:`.brute` (the brute force).

Example (two layers, one host of two devices, one candidate per stage):

>>> def cands(start, end, submesh):
...     n = end - start + 1
...     size = submesh[0] * submesh[1]
...     slowdown = 1.5 if size > 1 else 1.0   # splitting a layer across devices costs communication
...     t = slowdown * n / size
...     return [StageCandidate((start, end), submesh, submesh, False, t, 2 * t, 0, 0)]
>>> r = stage_dp(StageProblem(num_layers=2, hosts=1, devices_per_host=2, microbatches=4), cands)
>>> [(s.layers, s.submesh) for s in r.stages], r.latency_s
([((0, 0), (1, 1)), ((1, 1), (1, 1))], 15.0)
"""

from .brute import brute_force_stages
from .dp import stage_dp, stage_dp_auto
from .formulas import (BY_STAGE_COUNT, DEFAULT_WGRAD_SHARE, SCHEDULES, STAGE_COMM, cut_link, held_microbatches,
                       pipeline_latency, placement_fits, schedule_latency, serial_latency, submesh_shapes, transfer_s)
from .values import (T_MAX_SEARCH, CandidateBlock, DPOptions, InterResult, NoFeasiblePlanError, StageCandidate,
                     StageConstraints, StageProblem)

__all__ = [
    "StageCandidate",
    "CandidateBlock",
    "StageConstraints",
    "StageProblem",
    "DPOptions",
    "InterResult",
    "NoFeasiblePlanError",
    "stage_dp",
    "stage_dp_auto",
    "transfer_s",
    "brute_force_stages",
    "serial_latency",
    "pipeline_latency",
    "submesh_shapes",
    "placement_fits",
    "cut_link",
    "held_microbatches",
    "schedule_latency",
    "DEFAULT_WGRAD_SHARE",
    "SCHEDULES",
    "BY_STAGE_COUNT",
    "STAGE_COMM",
    "T_MAX_SEARCH",
]
