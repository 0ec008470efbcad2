"""Alpa's inter-operator pass (OSDI'22 §5.2): cut layers into pipeline stages and give each a submesh.

Everything here works on plain data. The caller supplies a function
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

Pinned decisions. ``constraints=StageConstraints(cuts=..., submeshes=..., logical_meshes=...,
remat=...)`` makes both solvers keep what a user fixed (an override re-solved around): the
cut positions exactly, and per stage a submesh, a logical mesh or a remat flag (``None``
entries are free). Any of them fixes the stage count S, so the DP keeps the stage count in its
state and stage ``j`` is the one with ``S - j`` stages still to place; a candidate is usable
for stage ``j`` only if the pins allow it. Pins that no assignment can keep, or that do not fit
in memory, raise :class:`NoFeasiblePlanError` with the smallest memory the pins need.

Example (two layers, one host of two devices, one candidate per stage):

>>> def cands(start, end, submesh):
...     n = end - start + 1
...     size = submesh[0] * submesh[1]
...     slowdown = 1.5 if size > 1 else 1.0   # splitting a layer across devices costs communication
...     t = slowdown * n / size
...     return [StageCandidate((start, end), submesh, submesh, False, t, 2 * t, 0, 0)]
>>> r = stage_dp(2, 1, 2, cands, microbatches=4)
>>> [(s.layers, s.submesh) for s in r.stages], r.latency_s
([((0, 0), (1, 1)), ((1, 1), (1, 1))], 15.0)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from . import dpbounds

__all__ = [
    "StageCandidate",
    "CandidateBlock",
    "StageConstraints",
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
    "cluster_kwargs",
    "DEFAULT_WGRAD_SHARE",
]

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
#: The schedules whose formula and memory depend on the total stage count (the DP solves each count on its own).
BY_STAGE_COUNT = ("interleaved", "zb-h1")
#: ZB-H1's weight-gradient part W as a share of a stage's fwd + bwd when none is given: a transformer layer's
#: backward is about twice its forward and W about half of it, so F = B = W.
DEFAULT_WGRAD_SHARE = 1.0 / 3.0
STAGE_COMM = ("model", "ignore")


@dataclass(frozen=True)
class StageCandidate:
    """One way to run ``layers = (start, end)`` (inclusive) on a ``submesh``.

    Times are per microbatch; bytes are per device.

    >>> StageCandidate((0, 3), (1, 2), (2, 1), False, 1.0, 2.0, 5e9, 1e8).time_s
    3.0
    """

    layers: tuple[int, int]
    submesh: tuple[int, int]
    logical_mesh: tuple[int, int]
    remat: bool | str  # False (none), True (full) or "selective"
    fwd_s: float
    bwd_s: float
    static_bytes: float  # params + grads + optimizer state per device
    act_bytes: float  # activations held per in-flight microbatch per device
    payload: Any = field(default=None, compare=False, repr=False)  # e.g. the intra-op solution
    # Which of its mesh's intra-op solutions ``payload`` is: "fast" (the time-only ILP) or "lean" (weights stored
    # at their least, :meth:`~autopar_lab.pricing.table.CostTable.solutions`); recorded, never guessed afterwards.
    solution: str = "fast"

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s

    def mem_bytes(self, held: int) -> float:
        """Per-device memory when the stage holds ``held`` microbatches at once."""
        return self.static_bytes + held * self.act_bytes


@dataclass(frozen=True)
class CandidateBlock:
    """Every candidate of one submesh shape at once, as arrays over (option k, start layer a, end layer b).

    ``fwd_s``, ``bwd_s``, ``static_bytes``, ``act_bytes``: float arrays of shape (K, L, L) with the fields of
    :class:`StageCandidate`; ``usable[k, a, b]``: option k is a candidate for layers a..b (values elsewhere are never
    read); ``make(k, a, b)``: that candidate as a StageCandidate, called only for the stages of the plan chosen (and by
    the slow paths: pins, the brute force). The candidates for layers a..b are the usable options in the order of k.

    The stage DP takes, instead of a function, any object with ``block(submesh) -> CandidateBlock | None`` (None: no
    candidate on that submesh): it then reads these arrays directly and builds no StageCandidate per layer range.
    """

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    static_bytes: np.ndarray
    act_bytes: np.ndarray
    usable: np.ndarray
    make: Callable[[int, int, int], StageCandidate]


class _BlockCandidates(Mapping):
    """``(start, end, shape) -> candidates`` of a set of :class:`CandidateBlock`, built on first access (the DP's
    vectorised path reads the blocks; the pinned path, the brute force and the chosen plan read this)."""

    def __init__(self, blocks: Mapping[tuple[int, int], CandidateBlock], num_layers: int):
        self.blocks = blocks
        self.num_layers = num_layers
        self._memo: dict = {}

    def __getitem__(self, key) -> tuple[StageCandidate, ...]:
        if key not in self._memo:
            start, end, shape = key
            b = self.blocks.get(tuple(shape))
            self._memo[key] = () if b is None else tuple(
                b.make(int(k), start, end) for k in np.flatnonzero(b.usable[:, start, end]))
        return self._memo[key]

    def __iter__(self) -> Iterator:
        L = self.num_layers
        return ((a, b, shape) for a in range(L) for b in range(a, L) for shape in self.blocks)

    def __len__(self) -> int:
        return self.num_layers * (self.num_layers + 1) // 2 * len(self.blocks)


@dataclass(frozen=True)
class InterResult:
    """A chosen pipeline. Per-cut tuples are indexed by cut ``j`` (between stage j and j+1).

    ``latency_s`` is the objective the solver minimised (transfers priced 0 when
    ``stage_comm == "ignore"``); ``latency_with_comm_s`` always prices them;
    ``stage_comm_s`` is ``sum_j (send_fwd_s[j] + send_bwd_s[j])``, what they cost either way.
    """

    stages: tuple[StageCandidate, ...]
    microbatches: int
    latency_s: float
    t_max: float
    stage_comm_s: float
    latency_with_comm_s: float
    send_fwd_s: tuple[float, ...]
    send_bwd_s: tuple[float, ...]
    cut_links: tuple[str, ...]  # "intra" | "inter" per cut
    device_offsets: tuple[int, ...]  # first device (host-major) of each stage
    stage_mem_bytes: tuple[float, ...]  # static + held * act per stage under the schedule
    schedule: str = "1f1b"
    stage_comm: str = "model"
    diagnostics: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    virtual_stages: int = 1  # chunks per stage (interleaved)
    wgrad_share: float = 0.0  # W's share of each stage's time the zb-h1 formula assumed

    @property
    def boundaries(self) -> tuple[int, ...]:
        """First layer of each stage."""
        return tuple(s.layers[0] for s in self.stages)

    def devices(self) -> tuple[tuple[int, ...], ...]:
        """Host-major device indices of each stage under the in-order placement rule."""
        return tuple(
            tuple(range(o, o + s.submesh[0] * s.submesh[1])) for o, s in zip(self.device_offsets, self.stages)
        )

    def timeline(self):
        """Simulate this plan event by event (see :mod:`autopar_lab.simulate`)."""
        from autopar_lab.simulate import simulate

        # The timeline shows what would happen, so transfers are always priced here. As the DP's formula sees it:
        # interleaved stages as v equal chunks (each cut's transfer between consecutive chunks of the same round,
        # the wrap-around free), ZB-H1's W as wgrad_share of each stage's time.
        fwd, bwd = [s.fwd_s for s in self.stages], [s.bwd_s for s in self.stages]
        act, static = [s.act_bytes for s in self.stages], [s.static_bytes for s in self.stages]
        sf, sb, wgrad, v = list(self.send_fwd_s), list(self.send_bwd_s), None, self.virtual_stages
        if self.schedule == "zb-h1":
            wgrad = [self.wgrad_share * (f + b) for f, b in zip(fwd, bwd)]
            bwd = [max(b - w, 0.0) for b, w in zip(bwd, wgrad)]
        elif v > 1:
            p = len(fwd)
            fwd, bwd, act, static = ([x[c % p] / v for c in range(p * v)] for x in (fwd, bwd, act, static))
            sf, sb = ([x[c % p] if c % p < p - 1 else 0.0 for c in range(p * v - 1)] for x in (sf, sb))
        return simulate(fwd, bwd, self.microbatches, self.schedule, send_fwd_s=sf, send_bwd_s=sb, act_bytes=act,
                        static_bytes=static, wgrad_s=wgrad, virtual_stages=v if v > 1 else None)


class NoFeasiblePlanError(ValueError):
    """No stage assignment fits in memory. ``min_mem_bytes`` is the smallest per-device
    memory limit under which some assignment would fit (inf if none exists at all)."""

    def __init__(self, message: str, min_mem_bytes: float):
        super().__init__(message)
        self.min_mem_bytes = min_mem_bytes


@dataclass(frozen=True)
class StageConstraints:
    """Stage decisions the DP must keep (a user's pins); everything left ``None`` is free.

    ``cuts``: the first layer of every stage after the first, exactly (so the stage count is
    ``len(cuts) + 1``). ``submeshes`` / ``logical_meshes`` / ``remat``: one entry per stage, in
    pipeline order, each a value the stage must have or ``None`` (free). Any of them fixes the
    stage count; they must agree on it.

    >>> c = StageConstraints(cuts=(2,), submeshes=((1, 2), None))
    >>> c.num_stages, c.allows_range(0, 0, 1, 4), c.allows_range(1, 1, 3, 4), c.allows_range(1, 2, 3, 4)
    (2, True, False, True)
    """

    cuts: tuple[int, ...] | None = None
    submeshes: tuple[tuple[int, int] | None, ...] | None = None
    logical_meshes: tuple[tuple[int, int] | None, ...] | None = None
    remat: tuple[bool | str | None, ...] | None = None

    @property
    def num_stages(self) -> int | None:
        counts = self._counts()
        return counts[0][1] if counts else None

    def _counts(self) -> list[tuple[str, int]]:
        out = []
        if self.cuts is not None:
            out.append(("cuts", len(self.cuts) + 1))
        for name in ("submeshes", "logical_meshes", "remat"):
            v = getattr(self, name)
            if v is not None:
                out.append((name, len(v)))
        return out

    def check(self, num_layers: int) -> None:
        """ValueError naming the conflict when the pins contradict each other or the layer count."""
        counts = self._counts()
        if len({n for _, n in counts}) > 1:
            said = ", ".join(f"{name} say {n}" for name, n in counts)
            raise ValueError(f"the pinned stage decisions disagree on the number of stages ({said}); "
                             "give one entry per stage.")
        if self.cuts is not None:
            cuts = list(self.cuts)
            if any(not 0 < c < num_layers for c in cuts) or cuts != sorted(set(cuts)):
                raise ValueError(f"pinned cuts {cuts} must be increasing layer indices in 1..{num_layers - 1} "
                                 f"(the first layer of each stage after the first, {num_layers} layers).")

    def stage_range(self, j: int, num_layers: int) -> tuple[int, int] | None:
        if self.cuts is None:
            return None
        bounds = (0, *self.cuts, num_layers)
        return bounds[j], bounds[j + 1] - 1

    def allows_range(self, j: int, start: int, end: int, num_layers: int) -> bool:
        """Whether stage ``j`` may cover layers ``start..end`` (of ``num_layers``)."""
        return self.cuts is None or self.stage_range(j, num_layers) == (start, end)

    def allows(self, j: int, cand: "StageCandidate") -> bool:
        """Whether candidate ``cand`` may be stage ``j`` (its submesh, logical mesh and remat)."""
        if self.submeshes is not None and self.submeshes[j] is not None \
                and tuple(self.submeshes[j] or ()) != tuple(cand.submesh):
            return False
        if self.logical_meshes is not None and self.logical_meshes[j] is not None \
                and tuple(self.logical_meshes[j] or ()) != tuple(cand.logical_mesh):
            return False
        # compared, not tested for truth: remat is False, True or "selective"
        if self.remat is not None and self.remat[j] is not None and self.remat[j] != cand.remat:
            return False
        return True


# ---------------------------------------------------------------------------------------------
# Shared definitions (the DP and the brute force both use these, so the brute force checks the
# search, not the definitions).


def submesh_shapes(hosts: int, devices_per_host: int) -> list[tuple[int, int]]:
    """Alpa's submesh shapes: (1,1), (1,2), (1,4) ... (1,M), then (2,M) ... (N,M).

    >>> submesh_shapes(2, 4)
    [(1, 1), (1, 2), (1, 4), (2, 4)]
    """
    m = devices_per_host
    shapes = []
    w = 1
    while w < m:
        shapes.append((1, w))
        w *= 2
    shapes.append((1, m))
    shapes += [(n, m) for n in range(2, hosts + 1)]
    return shapes


def placement_fits(submesh: tuple[int, int], offset: int, hosts: int, devices_per_host: int) -> bool:
    """Whether a stage of shape ``submesh`` may start at host-major device ``offset``.

    >>> placement_fits((1, 2), 2, 2, 4), placement_fits((1, 4), 2, 2, 4), placement_fits((2, 4), 4, 3, 4)
    (True, False, True)
    """
    n, m = submesh
    size = n * m
    if offset < 0 or offset + size > hosts * devices_per_host:
        return False
    if n == 1:  # inside one host
        return offset // devices_per_host == (offset + m - 1) // devices_per_host
    return offset % devices_per_host == 0  # whole hosts, starting on a host boundary


def cut_link(offset: int, devices_per_host: int) -> str:
    """Link used by the cut in front of a stage starting at device ``offset`` (> 0).

    >>> cut_link(2, 4), cut_link(4, 4)
    ('intra', 'inter')
    """
    return "intra" if offset % devices_per_host else "inter"


def held_microbatches(stages_from_here: int, microbatches: int, schedule: str, num_stages: int | None = None,
                      virtual_stages: int = 1) -> float:
    """Microbatches a stage keeps alive at once, in units of a whole stage's activations per microbatch: 1F1B
    ``min(s, B)`` where ``s`` counts the stages from this one to the last (inclusive); GPipe ``B``. These two need
    only ``s``; the others need the total stage count ``num_stages = p`` too (as the simulator shows them):

    - ZB-H1: ``min(p, B)`` on every stage (a microbatch lives from its F to its W, which waits ``p - 1`` steps);
    - interleaved with ``v`` chunks: ``n / v`` where ``n`` counts chunk-microbatches (each holds a chunk's share,
      ``1 / v``, of the stage's activations): Megatron's warm-up ``2(s - 1) + (v - 1)p + 1`` of them, or all
      ``B v`` when ``B == p`` or fewer are left.

    >>> held_microbatches(3, 8, "1f1b"), held_microbatches(3, 8, "gpipe"), held_microbatches(1, 8, "zb-h1", 3)
    (3, 8, 3)
    >>> held_microbatches(2, 8, "interleaved", 4, 2)    # (2 + 4 + 1) chunk-microbatches of half a stage each
    3.5
    """
    if schedule == "1f1b":
        return min(stages_from_here, microbatches)
    if schedule == "gpipe":
        return microbatches
    if num_stages is None:
        raise ValueError(f"the {schedule} schedule's memory depends on the total stage count; give num_stages.")
    if schedule == "zb-h1":
        return min(num_stages, microbatches)
    v = int(virtual_stages)
    chunks = microbatches * v if microbatches == num_stages else min(
        2 * (stages_from_here - 1) + (v - 1) * num_stages + 1, microbatches * v)
    return chunks / v


def _coefficients(schedule: str, microbatches: int, virtual_stages: int,
                  wgrad_share: float) -> tuple[float, float, float]:
    """``(a, kappa, K)``: the schedule's step time is ``a * (sum t + sum kappa c + K * max(t, kappa c))`` (see
    :func:`schedule_latency`), the form the DP minimises (``a`` scales every plan alike)."""
    B = microbatches
    if schedule == "interleaved":
        v = int(virtual_stages)
        return 1.0 / v, float(v), float(v * B - 1)
    if schedule == "zb-h1":
        a = 1.0 - wgrad_share
        return a, 1.0 / a, (B - 1 + wgrad_share) / a
    return 1.0, 1.0, float(B - 1)


def schedule_latency(stage_s: Sequence[float], cut_s: Sequence[float], microbatches: int, schedule: str = "1f1b",
                     virtual_stages: int = 1, wgrad_share: float = DEFAULT_WGRAD_SHARE,
                     cut_neck_s: Sequence[float] | None = None) -> float:
    """The step time the stage DP minimises for ``schedule``: :func:`pipeline_latency` for 1F1B and GPipe, and

    - interleaved (``v`` chunks): each stage runs ``vB`` chunk-microbatches of ``t / v`` and each cut carries ``v``
      transfers per microbatch (the wrap-around from the last stage to the first, ``v - 1`` more, is left out),
      so ``(sum t + v sum c + (vB - 1) max(t, v c)) / v`` -- with uniform stages and
      free transfers exactly the simulator's ``B t + (p - 1) t / v`` (Megatron's bubble), and above it for uneven
      stages (both checked in the tests);
    - ZB-H1 (``w = wgrad_share``: W's share of each stage's t): the simulator's makespan with uniform stages and
      F = B is ``B t + (p - 1)(t - w t) - min(B - 1, p - 1) w t``; for uneven stages it stays below
      ``sum (1 - w) t + (B - 1) max t + w max t - min(B - 1, p - 1) w min t`` (tests), whose last term needs the
      smallest stage and so does not split over stages. The DP drops it: ``(1 - w) sum t + sum c + (B - 1 + w)
      max(t, c / (1 - w))``, an upper bound the planner then re-ranks by simulation.

    >>> schedule_latency([3, 3], [], 4, "interleaved", 2)    # 4 * 3 + (2 - 1) * 3 / 2
    13.5
    >>> round(schedule_latency([3, 3], [], 4, "zb-h1", wgrad_share=1 / 3), 9)
    14.0
    """
    if schedule not in ("interleaved", "zb-h1"):
        return pipeline_latency(stage_s, cut_s, microbatches, cut_neck_s)
    a, kappa, K = _coefficients(schedule, microbatches, virtual_stages, wgrad_share)
    necks = cut_s if cut_neck_s is None else cut_neck_s
    return a * (sum(stage_s) + kappa * sum(cut_s) + K * max(list(stage_s) + [kappa * c for c in necks]))


def serial_latency(stage_s: Sequence[float], cut_s: Sequence[float], microbatches: int) -> float:
    """The step time when every stage runs on one host's shared cores (virtual devices, one driver): each stage's
    forward and backward of every microbatch, and each transfer, one after another, ``B (sum t + sum c)``; the
    simulator's makespan on one host (checked in the tests), whatever the schedule.

    >>> serial_latency([3, 1], [0.5], 4)
    18.0
    """
    return microbatches * (sum(stage_s) + sum(cut_s))


def pipeline_latency(stage_s: Sequence[float], cut_s: Sequence[float], microbatches: int,
                     cut_neck_s: Sequence[float] | None = None) -> float:
    """``sum t + sum c + (B-1) * max(t, n)``: transfers act as extra pipeline stages. ``c`` is a cut's
    ``send_fwd + send_bwd`` (one microbatch's activation goes forward and its gradient back: both on its critical
    path); ``n`` (``cut_neck_s``, default ``c``) is what the cut takes per microbatch in the steady state: a link is
    full duplex (activations and gradients travel in opposite directions at once, one link each in the simulator),
    so the DP and its results pass ``max(send_fwd, send_bwd)``.

    How it compares with :func:`autopar_lab.simulate.simulate` (checked in the tests):
    GPipe equals it exactly when each stage's and each cut's backward time is the same
    multiple of its forward time (uniform stages and free transfers included); 1F1B equals
    it for uniform stages and free transfers, and is at most it when transfers are free and
    bwd is proportional to fwd (a fast stage's warm-up overlaps a slow one); with transfers,
    1F1B's fixed warm-up depth cannot always hide the gradient round trip, so it can exceed
    the formula. With arbitrary fwd/bwd splits either schedule can land on either side.

    >>> pipeline_latency([3, 3], [], 2)
    9
    >>> pipeline_latency([3, 3], [5], 2, cut_neck_s=[4])   # 3 + 3 + 5 + (2 - 1) * 4
    15
    """
    necks = cut_s if cut_neck_s is None else cut_neck_s
    return sum(stage_s) + sum(cut_s) + (microbatches - 1) * max(list(stage_s) + list(necks))


def cluster_kwargs(cluster: Any) -> dict:
    """Plain keyword arguments for :func:`stage_dp` from a cluster-like object with
    ``hosts``, ``devices_per_host``, ``intra_host`` and ``inter_host``.

    >>> from types import SimpleNamespace as NS
    >>> sorted(cluster_kwargs(NS(hosts=1, devices_per_host=2, intra_host=None, inter_host=None)))
    ['devices_per_host', 'hosts', 'inter_link', 'intra_link']
    """
    return {
        "hosts": cluster.hosts,
        "devices_per_host": cluster.devices_per_host,
        "intra_link": cluster.intra_host,
        "inter_link": cluster.inter_host,
    }


# ---------------------------------------------------------------------------------------------
# Input checking and the tables both solvers start from.


@dataclass(frozen=True)
class _Problem:
    num_layers: int
    hosts: int
    devices_per_host: int
    microbatches: int
    schedule: str
    stage_comm: str
    mem_limit: float
    max_stages: int
    shapes: tuple[tuple[int, int], ...]  # the submesh shapes with at least one candidate, in Alpa's order
    cands: Mapping  # (start, end, shape) -> tuple[StageCandidate, ...]
    cut_cost: dict  # (layer k >= 1, "intra"|"inter") -> (send_fwd_s, send_bwd_s)
    constraints: StageConstraints | None = None  # pinned decisions; they fix the stage count to max_stages
    blocks: Mapping | None = None  # shape -> CandidateBlock when the candidates came as arrays
    virtual_stages: int = 1  # chunks per stage (interleaved)
    wgrad_share: float = DEFAULT_WGRAD_SHARE  # W's share of a stage's time (zb-h1)
    total_stages: int | None = None  # the stage count this problem is solved for (the schedules of BY_STAGE_COUNT)
    serial: bool = False  # the stages share one host's cores (virtual devices): they run one task at a time

    @property
    def fixed_stages(self) -> int | None:
        """The stage count the pins or ``total_stages`` impose (then ``max_stages`` equals it), else None."""
        if self.total_stages is not None:
            return self.total_stages
        return None if self.constraints is None else self.constraints.num_stages

    def held(self, s: int) -> float:
        """Microbatches a stage with ``s`` stages from it to the last holds (:func:`held_microbatches`)."""
        return held_microbatches(s, self.microbatches, self.schedule, self.total_stages, self.virtual_stages)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(a, kappa, K)`` of the schedule's formula (:func:`_coefficients`); on a serial host every stage's
        microbatches run one after another whatever the schedule: ``B (sum t + sum c)`` (:func:`serial_latency`)."""
        if self.serial:
            return float(self.microbatches), 1.0, 0.0
        return _coefficients(self.schedule, self.microbatches, self.virtual_stages, self.wgrad_share)

    def latency(self, stage_s: Sequence[float], cut_s: Sequence[float],
                cut_neck_s: Sequence[float] | None = None) -> float:
        if self.serial:
            return serial_latency(stage_s, cut_s, self.microbatches)
        return schedule_latency(stage_s, cut_s, self.microbatches, self.schedule, self.virtual_stages,
                                self.wgrad_share, cut_neck_s)

    def short(self, start: int, end: int) -> bool:
        """Whether layers start..end are too few for a stage (interleaved: one layer per chunk at least)."""
        return end - start + 1 < self.virtual_stages

    def usable(self, j: int, start: int, end: int, cand: "StageCandidate") -> bool:
        """Whether ``cand`` may be stage ``j`` (counted from the first) under the pins."""
        c = self.constraints
        return c is None or (c.allows_range(j, start, end, self.num_layers) and c.allows(j, cand))

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def cut_terms(self, k: int, offset: int) -> tuple[float, float]:
        return self.cut_cost[(k, cut_link(offset, self.devices_per_host))]

    def priced_cut(self, k: int, offset: int) -> float:
        """The cut term c_j the objective uses."""
        if self.stage_comm == "ignore":
            return 0.0
        f, b = self.cut_terms(k, offset)
        return f + b

    def priced_neck(self, k: int, offset: int) -> float:
        """What the cut takes per microbatch in the steady state: the slower direction (links are full duplex)."""
        if self.stage_comm == "ignore":
            return 0.0
        return max(self.cut_terms(k, offset))


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
    return int(value)


def transfer_s(nbytes: float, link: Any) -> float:
    """Seconds to send ``nbytes`` over ``link`` (one direction): its latency plus bytes over bandwidth. The one
    stage-transfer formula: the DP, the pricing of a plan and the global-optimum search all use it."""
    return float(link.latency) + float(nbytes) / float(link.bandwidth)


def _build_problem(
    num_layers, hosts, devices_per_host, candidates, microbatches, mem_limit_bytes, cut_bytes,
    intra_link, inter_link, stage_comm, max_stages, schedule, constraints=None, virtual_stages=None,
    wgrad_share=None, serial_host=False,
) -> _Problem:
    L = _positive_int(num_layers, "num_layers")
    N = _positive_int(hosts, "hosts")
    M = _positive_int(devices_per_host, "devices_per_host")
    B = _positive_int(microbatches, "microbatches")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
    chunks = 1 if schedule != "interleaved" else 2 if virtual_stages is None else _positive_int(
        virtual_stages, "virtual_stages")
    if schedule == "interleaved" and chunks < 2:
        raise ValueError("the interleaved schedule needs virtual_stages of 2 or more.")
    w = DEFAULT_WGRAD_SHARE if wgrad_share is None else float(wgrad_share)
    if not 0.0 <= w < 1.0:
        raise ValueError(f"wgrad_share must be a share of a stage's time in [0, 1), got {wgrad_share!r}.")
    if stage_comm not in STAGE_COMM:
        raise ValueError(f"stage_comm must be one of {STAGE_COMM}, got {stage_comm!r}.")
    mem = float(mem_limit_bytes)
    if not mem > 0:
        raise ValueError(f"mem_limit_bytes must be positive, got {mem_limit_bytes!r}.")
    smax = min(L, N * M) if max_stages is None else min(L, N * M, _positive_int(max_stages, "max_stages"))
    if constraints is not None:
        if not isinstance(constraints, StageConstraints):
            raise ValueError(f"constraints must be a StageConstraints, got {type(constraints).__name__}.")
        constraints.check(L)
        S = constraints.num_stages
        if S is not None:
            if S > smax:
                raise ValueError(f"the pinned stage decisions ask for {S} stages, but at most {smax} are possible "
                                 f"({L} layers, {N * M} devices, max_stages={max_stages}).")
            smax = S
        if S is None:
            constraints = None  # nothing pinned

    # Cut k (1..L-1) sits in front of layer k. Without cut_bytes nothing is known: transfers are free.
    cut_cost = {}
    if cut_bytes is not None:
        cb = [float(x) for x in cut_bytes]
        if len(cb) != L - 1:
            raise ValueError(f"cut_bytes needs one entry per cut ({L - 1} for {L} layers), got {len(cb)}.")
        if any(not (math.isfinite(x) and x >= 0) for x in cb):
            raise ValueError("cut_bytes must hold finite non-negative byte counts.")
        if intra_link is None or inter_link is None:
            raise ValueError("cut_bytes needs intra_link and inter_link (objects with .bandwidth and .latency).")
    for k in range(1, L):
        for kind, link in (("intra", intra_link), ("inter", inter_link)):
            t = 0.0 if cut_bytes is None else transfer_s(cb[k - 1], link)
            cut_cost[(k, kind)] = (t, t)  # gradients are the same size as activations

    shapes = tuple(submesh_shapes(N, M))
    blocks = None
    cands: Mapping
    if hasattr(candidates, "block"):
        blocks = {}
        for shape in shapes:
            b = candidates.block(shape)
            if b is not None and b.usable.any():
                _check_block(b, shape, L)
                blocks[shape] = b
        cands = _BlockCandidates(blocks, L)
        used = tuple(blocks)
    else:
        cands = {}
        for start in range(L):
            for end in range(start, L):
                for shape in shapes:
                    opts = tuple(candidates(start, end, shape))
                    for c in opts:
                        for name in ("fwd_s", "bwd_s", "static_bytes", "act_bytes"):
                            v = getattr(c, name)
                            if not (math.isfinite(v) and v >= 0):
                                raise ValueError(
                                    f"candidate for layers {start}..{end} on {shape} has {name}={v!r}; "
                                    "it must be finite and non-negative."
                                )
                    cands[(start, end, shape)] = opts
        have = {shape for (_, _, shape), opts in cands.items() if opts}
        used = tuple(shape for shape in shapes if shape in have)
    # Shapes without any candidate can never be placed: the DP's tables leave them out (at thousands of devices most
    # submesh shapes have none), which keeps the order of the others and so every tie-break.
    return _Problem(L, N, M, B, schedule, stage_comm, mem, smax, used, cands, cut_cost, constraints, blocks, chunks, w,
                    serial=bool(serial_host))


def _check_block(b: CandidateBlock, shape: tuple[int, int], L: int) -> None:
    for name in ("fwd_s", "bwd_s", "static_bytes", "act_bytes", "usable"):
        if getattr(b, name).shape[1:] != (L, L) or getattr(b, name).shape[0] != b.usable.shape[0]:
            raise ValueError(f"candidate block for {shape}: {name} has shape {getattr(b, name).shape}, expected "
                             f"(options, {L}, {L}) like usable {b.usable.shape}.")
    for name in ("fwd_s", "bwd_s", "static_bytes", "act_bytes"):
        v = getattr(b, name)[b.usable]
        bad = ~(np.isfinite(v) & (v >= 0))
        if bad.any():
            k, start, end = (int(x[bad.argmax()]) for x in np.nonzero(b.usable))
            raise ValueError(f"candidate for layers {start}..{end} on {shape} has {name}={float(v[bad][0])!r}; it "
                             "must be finite and non-negative.")


# ---------------------------------------------------------------------------------------------
# The DP.


class _Tables(NamedTuple):
    """What the DP needs of the candidates, per (start layer k, end layer i, shape sh, stages
    remaining s): ``best_time[k, i, sh, s-1]``, the fastest candidate that fits memory while
    holding held(s) microbatches (inf if none); ``index(k, i, sh, s)`` which candidate that is
    (the first of the fastest); ``min_req()`` the smallest memory any candidate there needs
    (for the error message only, so computed only when asked).

    For a fixed t_max the best candidate is simply the fastest one that fits memory (if it
    is within t_max, nothing slower can be better; if not, nothing fits), so the t_max loop
    only has to mask this table.
    """

    best_time: np.ndarray
    index: Callable[[int, int, int, int], int]  # type: ignore[assignment]  # a field, not tuple.index
    min_req: Callable[[], np.ndarray]


def _tables(p: _Problem, arrays=None) -> _Tables:
    """See :class:`_Tables`. A candidate's memory ``static + held * act`` grows with held, and
    held(s) with s, so each candidate fits exactly while s <= s_max (its largest such s):
    best_time[..., s] is the minimum time over candidates with s_max >= s, a running minimum
    over s from the top. ``arrays``: :func:`_candidate_arrays` of p, when already made."""
    if p.constraints is not None:
        return _tables_pinned(p)
    L, SH, S = p.num_layers, len(p.shapes), p.max_stages
    held = np.array([p.held(s) for s in range(1, S + 1)], dtype=float)
    whole = bool(np.all(held == np.floor(held)))
    mem = p.mem_limit
    arrays = _candidate_arrays(p) if arrays is None else arrays
    best_time = np.full((L, L, SH, S), np.inf)
    for sh, (time_, static, act, has) in enumerate(arrays):
        # hmax: the most microbatches a candidate can hold, checked with the same float operations as
        # StageCandidate.mem_bytes (the estimate from a division is corrected by one either way).
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            est = np.floor(np.where(act > 0, (mem - static) / act, np.where(static <= mem, np.inf, -1.0)))
        est = np.minimum(est, 2.0 ** 52)
        fits = lambda h: static + h * act <= mem  # noqa: E731
        finite = np.isfinite(est) & (est >= 0)
        est = np.where(finite & ~fits(np.where(finite, est, 0.0)), est - 1, est)
        est = np.where(finite & fits(np.where(finite, est + 1, 0.0)), est + 1, est)
        s_max = np.searchsorted(held, np.where(has, est, -1.0), side="right")  # candidates fit for s = 1..s_max
        if not whole:  # a fractional held (interleaved): count the s that fit directly (held grows with s)
            s_max = sum((static + h * act <= mem).astype(np.int64) for h in held)
        by_top = np.full((L, L, S + 1), np.inf)  # [..., t]: fastest candidate whose s_max is t
        cc, kk, ii = np.nonzero(has & (s_max > 0))
        np.minimum.at(by_top, (kk, ii, s_max[cc, kk, ii]), time_[cc, kk, ii])
        best_time[:, :, sh, :] = np.minimum.accumulate(by_top[..., :0:-1], axis=-1)[..., ::-1]  # over s_max >= s

    def index(k, i, sh, s):
        held_s = p.held(s)
        for idx, c in enumerate(p.cands[(k, i, p.shapes[sh])]):
            if c.mem_bytes(held_s) <= mem and c.time_s == best_time[k, i, sh, s - 1]:
                return idx
        return -1

    def min_req():
        out = np.full((L, L, SH, S), np.inf)
        for sh, (_, static, act, has) in enumerate(arrays):
            for s in range(S):
                out[:, :, sh, s] = np.where(has, static + held[s] * act, np.inf).min(axis=0, initial=np.inf)
        return out

    return _Tables(best_time, index, min_req)


def _candidate_arrays(p: _Problem) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per shape of ``p.shapes``: (time, static, act, usable) arrays over (option, start, end), read from the
    candidate blocks, or gathered from the candidate lists (padded; padding is never usable). A layer range too
    short for a stage (:meth:`_Problem.short`) is never usable."""
    out = _candidate_arrays_all(p)
    if p.virtual_stages > 1:
        idx = np.arange(p.num_layers)
        long_enough = (idx[None, :] - idx[:, None] + 1) >= p.virtual_stages
        out = [(t, st, a, has & long_enough[None]) for t, st, a, has in out]
    return out


def _candidate_arrays_all(p: _Problem) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    L = p.num_layers
    if p.blocks is not None:
        out = []
        for shape in p.shapes:
            b = p.blocks[shape]
            has = np.asarray(b.usable, dtype=bool)
            # Values where a block has no candidate are never read; zeros keep the memory arithmetic quiet.
            out.append((np.where(has, b.fwd_s + b.bwd_s, np.inf), np.where(has, b.static_bytes, 0.0),
                        np.where(has, b.act_bytes, 0.0), has))
        return out
    by_shape: dict[tuple, list] = {shape: [] for shape in p.shapes}
    for (k, i, shape), opts in p.cands.items():
        if opts:
            by_shape[shape].append((k, i, opts))
    out = []
    for shape in p.shapes:
        K = max(len(opts) for _, _, opts in by_shape[shape])
        time_, static, act = np.full((K, L, L), np.inf), np.zeros((K, L, L)), np.zeros((K, L, L))
        has = np.zeros((K, L, L), dtype=bool)
        for k, i, opts in by_shape[shape]:
            n = len(opts)
            time_[:n, k, i] = [c.time_s for c in opts]
            static[:n, k, i] = [c.static_bytes for c in opts]
            act[:n, k, i] = [c.act_bytes for c in opts]
            has[:n, k, i] = True
        out.append((time_, static, act, has))
    return out


def _tables_pinned(p: _Problem):
    """:func:`_tables` when stage decisions are pinned: whether a candidate is usable depends on which stage it
    would be, so each is checked on its own."""
    L, SH, S = p.num_layers, len(p.shapes), p.max_stages
    best_time = np.full((L, L, SH, S), np.inf)
    best_idx = np.full((L, L, SH, S), -1, dtype=np.int64)
    min_req = np.full((L, L, SH, S), np.inf)
    for (k, i, shape), opts in p.cands.items():
        if not opts:
            continue  # a shape without candidates is not among p.shapes
        sh = p.shapes.index(shape)
        if p.short(k, i):
            continue
        for s in range(1, S + 1):
            held = p.held(s)
            for idx, c in enumerate(opts):
                if not p.usable(S - s, k, i, c):
                    continue  # with pins the stage count is S, so s stages remaining means stage S - s
                need = c.mem_bytes(held)
                min_req[k, i, sh, s - 1] = min(min_req[k, i, sh, s - 1], need)
                if need <= p.mem_limit and c.time_s < best_time[k, i, sh, s - 1]:
                    best_time[k, i, sh, s - 1] = c.time_s
                    best_idx[k, i, sh, s - 1] = idx
    return _Tables(best_time, lambda k, i, sh, s: int(best_idx[k, i, sh, s - 1]), lambda: min_req)


def _structure(p: _Problem):
    """valid[sh, d]: a stage of shape sh may start with d devices free; size[sh];
    cut[k, d]: priced cut term in front of a stage starting at layer k with d devices free (its sum term);
    neck[k, d]: the same cut's steady-state term (its slower direction), which t_max bounds."""
    L, NM = p.num_layers, p.num_devices
    size = np.array([n * m for n, m in p.shapes], dtype=np.int64)
    valid = _placements(p.shapes, p.hosts, p.devices_per_host)
    cut = np.zeros((L, NM + 1))
    neck = np.zeros((L, NM + 1))
    kappa = p.coefficients[1]  # the schedule's weight of a cut (interleaved: v transfers per microbatch)
    if L > 1 and NM > 1 and p.stage_comm != "ignore":
        # A cut's terms depend on the layer and on the link only (cut_link of the offset): one column per link,
        # spread over the offsets 1..NM-1 that use it (other d never start a stage after layer 0). The same float
        # operations as priced_cut / priced_neck, elementwise.
        d = np.arange(1, NM)
        inter_host = (NM - d) % p.devices_per_host == 0
        for where in (inter_host, ~inter_host):
            if not where.any():
                continue
            terms = [p.cut_terms(k, NM - int(d[where][0])) for k in range(1, L)]
            f = np.array([t[0] for t in terms])
            b = np.array([t[1] for t in terms])
            cols = d[where]
            cut[1:, cols] = (kappa * (f + b))[:, None]
            neck[1:, cols] = (kappa * np.maximum(f, b))[:, None]
    return valid, size, cut, neck


@functools.lru_cache(maxsize=16)
def _placements(shapes: tuple[tuple[int, int], ...], hosts: int, devices_per_host: int) -> np.ndarray:
    """valid[sh, d]: a stage of ``shapes[sh]`` may start with d devices free (:func:`placement_fits` at offset
    N*M - d); the same for every microbatch count and t_max, so kept (read-only)."""
    NM = hosts * devices_per_host
    valid = np.zeros((len(shapes), NM + 1), dtype=bool)
    for sh, shape in enumerate(shapes):
        for d in range(NM + 1):
            valid[sh, d] = placement_fits(shape, NM - d, hosts, devices_per_host)
    valid.setflags(write=False)
    return valid


def _layered_dp(p, stage_cost, cut, valid, size, combine, t_max: float = math.inf, stop_at=None):
    """Alpa's recurrence, vectorised over (start layer k, end layer i, free devices d) for each s.

    F[s][k, d] = min over end layer i >= k and shape sh (fits at offset N*M - d) of
                 combine(stage_cost[k, i, sh, s-1] + cut[k, d], F[s-1][i+1, d - size[sh]])
    with F[0][L, 0] = 0 (all layers placed, every device used exactly).
    ``combine`` is np.add (latency) or np.maximum (bottleneck memory); stage costs above
    ``t_max`` count as inf.
    Returns the list of F tables and of argmin tables (flat index i * SH + sh, the first of
    equal minima). Each shape is evaluated only at the d where it can be placed (a host-sized
    submesh only on host boundaries), which is most of the saving on large clusters. ``stop_at[s - 1]``
    (with np.add): a lower bound on F[s'][0, N*M] for every s' > s; the tables stop growing at the first s
    where the smallest F[.][0, N*M] so far is at most it (no more stages can give a smaller one).
    """
    L, NM, SH = p.num_layers, p.num_devices, len(p.shapes)
    S = p.max_stages
    lowest = math.inf
    F_prev = np.full((L + 1, NM + 1), np.inf)
    F_prev[L, 0] = 0.0
    Fs, args = [F_prev], [None]  # type: list[Any], list[Any]
    d_idx = np.arange(NM + 1)
    places = [np.flatnonzero(valid[sh] & (d_idx >= size[sh])) for sh in range(SH)]
    for s in range(1, S + 1):
        F = np.full((L + 1, NM + 1), np.inf)
        arg = np.zeros((L, NM + 1), dtype=np.int64)
        # s stages need s layers: only start layers k <= L - s can have a plan, and a stage ending at i leaves
        # i + 1 <= L - s + 1 for the s - 1 after it, so k and i both range over 0..L-s.
        n = L - s + 1
        best = F[:n]
        # Device counts the s - 1 stages after this one can fill at all: a stage is placed only where it leaves one.
        reachable = np.asarray(np.isfinite(F_prev[1:n + 1]).any(axis=0))
        for sh, all_ds in enumerate(places):
            ds = all_ds[reachable[all_ds - size[sh]]] if all_ds.size else all_ds
            if ds.size == 0:
                continue
            cost = stage_cost[:n, :n, sh, s - 1]
            if t_max < math.inf:
                cost = np.where(cost <= t_max, cost, np.inf)
            fin = np.isfinite(cost)
            rows = np.flatnonzero(fin.any(axis=1))  # start layers with any stage of this shape
            if rows.size == 0:
                continue  # no stage of this shape here (memory, t_max): nothing to take
            k_fin, i_fin = np.nonzero(fin[rows])
            # Stages longer than the longest finite one cost inf: look only at end layers i = k .. k + w - 1.
            w = int((i_fin - rows[k_fin]).max()) + 1
            i_of = rows[:, None] + np.arange(w)[None, :]  # (row, r) -> end layer k + r
            ends = np.minimum(i_of, n - 1)
            band = np.where(i_of < n, cost[rows[:, None], ends], np.inf)
            here = band[:, :, None] + cut[rows][:, None, ds]  # (row, r, d)
            total = combine(here, F_prev[1:n + 1, ds - size[sh]][ends])  # next stage starts at layer i + 1
            r_best = np.argmin(total, axis=1)
            v = np.take_along_axis(total, r_best[:, None, :], axis=1)[:, 0, :]
            flat = (r_best + rows[:, None]) * SH + sh
            at = np.ix_(rows, ds)
            cur_v, cur_f = best[at], arg[at]
            take = (v < cur_v) | ((v == cur_v) & (flat < cur_f))
            best[at] = np.where(take, v, cur_v)
            arg[at] = np.where(take, flat, cur_f)
        Fs.append(F)
        args.append(arg)
        F_prev = F
        lowest = min(lowest, F[0, NM])
        if stop_at is not None and lowest <= stop_at[s - 1]:
            break
        if not np.isfinite(F).any():  # no s-stage suffix fits anywhere: none with more stages can either
            for _ in range(s + 1, S + 1):
                Fs.append(F)
                args.append(arg)
            break
    return Fs, args


def _min_memory(p: _Problem, min_req, valid, size) -> float:
    """Smallest over full assignments of the largest per-stage memory requirement."""
    zero_cut = np.zeros((p.num_layers, p.num_devices + 1))
    Fs, _ = _layered_dp(p, min_req, zero_cut, valid, size, np.maximum)
    if p.fixed_stages is not None:
        return float(Fs[p.fixed_stages][0, p.num_devices])
    return float(min(F[0, p.num_devices] for F in Fs[1:]))


def _infeasible(min_mem: float, limit: float, pinned: bool = False) -> NoFeasiblePlanError:
    if math.isinf(min_mem) and pinned:
        return NoFeasiblePlanError(
            "no stage assignment keeps the pinned stage decisions (cuts, submeshes, logical meshes, remat) and "
            "covers every layer and every device in order; unpin or change one of them.",
            min_mem,
        )
    if pinned:
        return NoFeasiblePlanError(
            f"the pinned stage decisions do not fit in {limit:.4g} bytes per device; with them the smallest any "
            f"assignment needs is {min_mem:.6g} bytes per device. Unpin them, or use a bigger memory limit, more "
            "microbatches or rematerialisation.",
            min_mem,
        )
    if math.isinf(min_mem):
        return NoFeasiblePlanError(
            "no stage assignment covers every layer and every device with the candidates given; "
            "make the candidates function return options for more (layer range, submesh) pairs.",
            min_mem,
        )
    return NoFeasiblePlanError(
        f"no stage assignment fits in {limit:.4g} bytes per device; the smallest any assignment needs is "
        f"{min_mem:.6g} bytes per device. Use more devices, more microbatches or rematerialisation, "
        "or a bigger memory limit.",
        min_mem,
    )


def _result(p: _Problem, plan: list[tuple[int, int, tuple[int, int], int, int]], diagnostics: dict) -> InterResult:
    """plan: [(start, end, shape, candidate index, offset)] in order."""
    S = len(plan)
    stages = tuple(p.cands[(k, i, shape)][idx] for k, i, shape, idx, _ in plan)
    offsets = tuple(o for *_, o in plan)
    sf, sb, links = [], [], []
    for k, _, _, _, o in plan[1:]:
        f, b = p.cut_terms(k, o)
        sf.append(f)
        sb.append(b)
        links.append(cut_link(o, p.devices_per_host))
    times = [c.time_s for c in stages]
    with_comm = [f + b for f, b in zip(sf, sb)]
    necks = [max(f, b) for f, b in zip(sf, sb)]  # full-duplex links: the slower direction paces the steady state
    priced = with_comm if p.stage_comm == "model" else [0.0] * len(with_comm)
    priced_necks = necks if p.stage_comm == "model" else [0.0] * len(necks)
    if p.schedule in BY_STAGE_COUNT:
        p = dataclasses.replace(p, total_stages=S)
    mems = tuple(c.mem_bytes(p.held(S - j)) for j, c in enumerate(stages))
    kappa = p.coefficients[1]
    return InterResult(
        stages=stages,
        microbatches=p.microbatches,
        latency_s=p.latency(times, priced, priced_necks),
        t_max=max(times + [kappa * c for c in priced_necks]),
        stage_comm_s=sum(with_comm),
        latency_with_comm_s=p.latency(times, with_comm, necks),
        send_fwd_s=tuple(sf),
        send_bwd_s=tuple(sb),
        cut_links=tuple(links),
        device_offsets=offsets,
        stage_mem_bytes=mems,
        schedule=p.schedule,
        stage_comm=p.stage_comm,
        diagnostics=diagnostics,
        virtual_stages=p.virtual_stages,
        wgrad_share=p.wgrad_share if p.schedule == "zb-h1" else 0.0,
    )


def _sweep_dp(p, stage_cost, cut, valid, size):
    """The same recurrence without the stage count, for when it does not matter (memory
    does not depend on it and max_stages does not bind): F[k, d] over k descending,
    vectorised over (end layer i, shape, d). About max_stages times cheaper."""
    L, NM, SH = p.num_layers, p.num_devices, len(p.shapes)
    d_idx = np.arange(NM + 1)
    F = np.full((L + 1, NM + 1), np.inf)
    F[L, 0] = 0.0
    G = np.full((L, SH, NM + 1), np.inf)  # G[i, sh, d] = F[i+1, d - size[sh]] where placeable
    arg = np.zeros((L, NM + 1), dtype=np.int64)
    for k in range(L - 1, -1, -1):
        row = F[k + 1]
        for sh in range(SH):
            ok = valid[sh] & (d_idx >= size[sh])
            G[k, sh, ok] = row[d_idx[ok] - size[sh]]
        total = stage_cost[k][:, :, None] + G + cut[k][None, None, :]  # (i, sh, d)
        flat = total.reshape(L * SH, NM + 1)
        arg[k] = np.argmin(flat, axis=0)
        F[k] = flat[arg[k], d_idx]
    return F, arg


T_MAX_SEARCH = ("bisect", "alpa", "all")
_MARGIN = 1e-9  # relative slack on the bounds, far above float rounding, far below any real difference


def stage_dp(
    num_layers: int,
    hosts: int,
    devices_per_host: int,
    candidates: Callable[[int, int, tuple[int, int]], Sequence[StageCandidate]],
    microbatches: int,
    *,
    mem_limit_bytes: float = math.inf,
    cut_bytes: Sequence[float] | None = None,
    intra_link: Any = None,
    inter_link: Any = None,
    stage_comm: str = "model",
    max_stages: int | None = None,
    schedule: str = "1f1b",
    t_max_search: str = "bisect",
    constraints: StageConstraints | None = None,
    upper_bound: float = math.inf,
    prune: bool = True,
    virtual_stages: int | None = None,
    wgrad_share: float | None = None,
    serial_host: bool = False,
) -> InterResult | None:
    """Alpa's stage DP: the latency-optimal pipeline over the candidates given.

    ``schedule``: "1f1b" (default), "gpipe", "interleaved" (``virtual_stages`` chunks per stage, default 2) or
    "zb-h1" (``wgrad_share``: W's share of a stage's time, default :data:`DEFAULT_WGRAD_SHARE`); each priced with
    its own formula (:func:`schedule_latency`) and memory (:func:`held_microbatches`). The last two depend on the
    total stage count p, so the DP is solved for each p on its own (interleaved: p >= 2 dividing the microbatch
    count, stages of at least ``virtual_stages`` layers), each bounded by the best so far.

    ``upper_bound`` (a latency some other plan already reaches, e.g. with another microbatch count): the t_max
    search skips what cannot beat it, and the result is None when no plan here does. Infeasibility is still
    raised when the largest t_max has no plan (``"bisect"`` and ``"all"`` always solve that one).

    ``candidates(start, end, submesh)`` lists the options for layers ``start..end``
    (inclusive) on an ``(n, m)`` submesh (an empty list means "cannot run there").
    ``cut_bytes[k-1]``: activation bytes per microbatch crossing the cut in front of layer
    ``k`` (gradients are the same size); a cut costs ``latency + bytes / bandwidth`` per
    direction over ``intra_link`` or ``inter_link`` (see the placement rule in the module
    docstring). A candidate is usable only if ``static_bytes + held * act_bytes <=
    mem_limit_bytes`` with ``held`` from :func:`held_microbatches`.

    ``serial_host``: the stages share one host's cores (virtual devices, JAX's CPU devices): they run one task at a
    time, so every schedule's step is :func:`serial_latency` (no max term: one DP, no t_max search).

    T* = min over t_max of [min_s F(s, 0, N*M; t_max) + (B-1) t_max], with t_max over the
    distinct stage and (priced) cut times. ``t_max_search`` picks which t_max to solve:

    * ``"alpa"``: increasing order, stopping once ``B * t_max`` cannot beat the best T
      (any plan whose largest term is t_max costs at least ``B * t_max``);
    * ``"bisect"`` (default, same answer, far fewer DPs): solve the largest t_max, then
      bisect the sorted values, skipping a range [a, b) when ``max(F(b), a) + (B-1) a``
      cannot beat the best T. It is exact because F is non-increasing in t_max and a plan
      whose largest term is in [a, b) costs at least that. Infeasible small t_max values
      (F = inf) are skipped in whole ranges, like a binary search;
    * ``"all"``: every value, no pruning (for tests).

    ``prune`` (``"bisect"`` without pins): start the search from the best uniform pipeline's latency (a plan the
    DP could pick itself), skip t_max values below the smallest any plan can have, and stop adding stages to a DP
    once no larger stage count can go below the minimum found (lower bounds of :mod:`autopar_lab.solve.dpbounds`).
    Exact: the same latency and the same plan as ``prune=False`` (kept for tests and measurements).

    ``constraints`` (:class:`StageConstraints`): pinned cuts, submeshes, logical meshes or remat
    flags. They fix the stage count S, so the DP keeps the stage count in its state and stage
    ``j`` is the one with ``S - j`` stages remaining; a candidate is usable for stage ``j`` only
    if the pins allow it. Infeasible pins raise :class:`NoFeasiblePlanError` with the smallest
    memory any assignment keeping them needs.

    >>> flat = lambda a, b, sub: [StageCandidate((a, b), sub, sub, False, 1.0 * (b - a + 1), 0.0, 0, 0)]
    >>> stage_dp(4, 1, 2, flat, microbatches=8).latency_s   # two stages of 2 layers: 4 + 7 * 2
    18.0
    """
    t0 = time.perf_counter()
    if t_max_search not in T_MAX_SEARCH:
        raise ValueError(f"t_max_search must be one of {T_MAX_SEARCH}, got {t_max_search!r}.")
    if math.isfinite(upper_bound) and t_max_search == "alpa":
        raise ValueError('upper_bound needs t_max_search="bisect" or "all" (they solve the largest t_max first).')
    p = _build_problem(
        num_layers, hosts, devices_per_host, candidates, microbatches, mem_limit_bytes, cut_bytes,
        intra_link, inter_link, stage_comm, max_stages, schedule, constraints, virtual_stages, wgrad_share,
        serial_host,
    )
    if p.schedule not in BY_STAGE_COUNT:
        return _solve(p, t_max_search, upper_bound, prune, t0)
    best: InterResult | None = None
    least_mem, some_fit = math.inf, False  # some_fit: some stage count has plans (found, or bounded away)
    counts, lower = _stage_count_bounds(p)
    for S in sorted(counts, key=lambda S: lower[S]):  # the most promising first, so the bound prunes the others
        q = dataclasses.replace(p, total_stages=S, max_stages=S)
        bound = min(upper_bound, best.latency_s) if best is not None else upper_bound
        if lower[S] >= bound:
            some_fit = some_fit or math.isfinite(lower[S])
            continue  # no plan with S stages can beat the bound
        try:
            r = _solve(q, t_max_search, bound, prune, t0)
        except NoFeasiblePlanError as e:
            least_mem = min(least_mem, e.min_mem_bytes)
            continue
        some_fit = True
        if r is not None and (best is None or r.latency_s < best.latency_s):
            best = r
    if best is None:
        if some_fit:
            return None  # plans fit, none beats upper_bound
        if p.schedule == "interleaved" and not _stage_counts(p):
            raise NoFeasiblePlanError(
                f"the interleaved schedule needs 2 or more stages of {p.virtual_stages} layers or more each, their "
                f"count dividing the {p.microbatches} microbatch(es); none is possible here.", math.inf)
        raise _infeasible(least_mem, p.mem_limit, p.constraints is not None)
    best.diagnostics["stage_counts_tried"] = _stage_counts(p)
    best.diagnostics["solve_s"] = time.perf_counter() - t0
    return best


def _stage_count_bounds(p: _Problem) -> tuple[list[int], dict[int, float]]:
    """The stage counts to solve (:func:`_stage_counts`) and a lower bound on the latency of any plan with each:
    ``a (G_S^2 / N + K H / N)`` with the device-second bounds of :mod:`dpbounds` (``G_S``: S ranges, ``H``: any), from
    the fastest candidates whatever their memory, so it holds for every plan. Without candidate arrays (pins): 0."""
    counts = _stage_counts(p)
    lower = {S: 0.0 for S in counts}
    if p.constraints is not None or not p.shapes or not counts:
        return counts, lower
    arrays = _candidate_arrays(p)
    fastest = np.stack([np.where(has, t, np.inf).min(axis=0, initial=np.inf) for t, _, _, has in arrays], axis=-1)
    size = np.array([n * m for n, m in p.shapes], dtype=float)
    NM = p.num_devices
    H, G = dpbounds.partition_bounds(dpbounds.device_seconds(fastest, size), max(counts))
    a, _, K = p.coefficients
    for S in counts:
        lower[S] = a * (G[S - 1] ** 2 / NM + K * H / NM) * (1 - _MARGIN) if math.isfinite(G[S - 1]) else math.inf
    return counts, lower


def _stage_counts(p: _Problem) -> list[int]:
    """The total stage counts a problem of a :data:`BY_STAGE_COUNT` schedule is solved for."""
    if p.fixed_stages is not None:
        counts = [p.fixed_stages]
    else:
        counts = list(range(1, p.max_stages + 1))
    if p.schedule == "interleaved":
        counts = [S for S in counts if S >= 2 and p.microbatches % S == 0 and S * p.virtual_stages <= p.num_layers]
    return counts


def _solve(p: _Problem, t_max_search: str, upper_bound: float, prune: bool, t0: float) -> InterResult | None:
    """:func:`stage_dp` on a built problem (for a schedule of :data:`BY_STAGE_COUNT`, one stage count)."""
    valid, size, cut_full, neck_full = _structure(p)
    L, NM = p.num_layers, p.num_devices
    # Bounds (the "bisect" search only; "all" and "alpa" stay the plain references): a seed plan's latency, a
    # lower bound on t_max and on sum t + sum c by stage count (see dpbounds). They only skip what cannot beat the
    # best latency known, or what cannot change a DP's minimum.
    # (Not when the stage count is fixed by the schedule: the seed and the stage-count bounds assume a free one.)
    bounded = prune and t_max_search == "bisect" and p.fixed_stages is None and bool(p.shapes)
    a_coef, kappa, K = p.coefficients  # the schedule's formula: a * (sum t + sum kappa c + K max(t, kappa c))
    arrays = _candidate_arrays(p) if p.constraints is None else None
    t_lb, sum_lb, seed = -math.inf, None, math.inf
    if bounded:
        E = dpbounds.device_seconds(_fastest_at(p, arrays, 1), size.astype(float))
        H, G = dpbounds.partition_bounds(E, p.max_stages)
        # The bounds hold in exact arithmetic; a relative margin keeps a plan the DP sums in another order inside.
        t_lb = H / NM * (1 - _MARGIN)
        cut_min = float(cut_full[1:, 1:NM].min()) if L > 1 and NM > 1 else 0.0
        sum_lb = dpbounds.stage_sum_bounds(G, NM, cut_min) * (1 - _MARGIN)
        seed = _seed_latency(p, arrays) * (1 + _MARGIN) / a_coef  # seconds -> the DP's units
    tables = _tables(p, arrays)
    best_time = tables.best_time

    values = set(np.unique(best_time[np.isfinite(best_time)]).tolist())
    if p.stage_comm == "model":
        values |= {kappa * max(f, b) for f, b in p.cut_cost.values()}
    V = sorted(values) if p.shapes else []  # no shape has a candidate: nothing to solve

    # Without a memory effect of the stage count and without a binding max_stages, the
    # stage count can be dropped from the state.
    collapsed = p.fixed_stages is None and p.max_stages == min(L, NM) and all(
        np.array_equal(best_time[..., 0], best_time[..., s]) for s in range(1, p.max_stages)
    )
    # The layered DP may stop adding stages once none with more can go below the minimum found: exact.
    stop = None if sum_lb is None else np.append(sum_lb[1:], np.inf)  # [s - 1]: bound for s + 1 stages or more

    # best["T"] is in the DP's units (the formula over a; the seed, 1F1B and GPipe only, has a = 1).
    best: dict[str, Any] = {"T": min(float(upper_bound) / a_coef, seed), "t_max": None, "shapes": None}
    tried: list[float] = []
    finite: list[bool] = []  # whether each DP solved found any plan
    stage_counts: list[int] = []

    def solve(j: int) -> float:
        """Solve the DP at t_max = V[j]; record the plan if it beats the best; return min_s F."""
        t_max = V[j]
        tried.append(t_max)
        cut = np.where(neck_full <= t_max, cut_full, np.inf)
        if collapsed:
            F, arg = _sweep_dp(p, np.where(best_time[..., 0] <= t_max, best_time[..., 0], np.inf), cut, valid, size)
            f = F[0, NM]
            chooser = None if not math.isfinite(f) else (lambda s, k, d: int(arg[k, d]))
            s_best = None
        else:
            Fs, args = _layered_dp(p, best_time, cut, valid, size, np.add, t_max=t_max, stop_at=stop)
            stage_counts.append(len(Fs) - 1)
            totals = [Fs[s][0, NM] for s in range(1, len(Fs))]
            s_best = int(np.argmin(totals)) + 1 if p.fixed_stages is None else p.fixed_stages
            f = totals[s_best - 1]
            chooser = lambda s, k, d: int(args[s][k, d])  # noqa: E731
        finite.append(math.isfinite(f))
        if f + K * t_max < best["T"]:
            best.update(T=f + K * t_max, t_max=t_max, pieces=_walk(p, chooser, s_best, size))
        return f

    if V and t_max_search == "all":
        for j in range(len(V)):
            solve(j)
    elif V and t_max_search == "alpa":
        for j in range(len(V)):
            if (K + 1) * V[j] >= best["T"]:
                break
            solve(j)
    elif V:
        def search(a: int, b: int, f_b: float) -> None:
            # Indices a..b-1 are unsolved; F(V[b]) = f_b bounds F from below on them. Below t_lb nothing fits.
            if a >= b or max(f_b, V[a]) + K * V[a] >= best["T"] or V[b - 1] < t_lb:
                return
            mid = (a + b) // 2
            f_mid = solve(mid)
            search(a, mid, f_mid)
            search(mid + 1, b, f_b)

        top = len(V) - 1
        search(0, top, solve(top))

    diagnostics = {
        "t_max_tried": tried,
        "t_max_values": len(V),
        "t_max_search": t_max_search,
        "stage_count_dropped": collapsed,
        "stage_counts_solved": stage_counts,
        "t_max_lower_bound": t_lb,
        "seed_latency": seed,
        "dp_table_size": int((1 if collapsed else p.max_stages + 1) * (L + 1) * (NM + 1)),
        "num_candidates": (sum(int(b.usable.sum()) for b in p.blocks.values()) if p.blocks is not None
                           else sum(len(v) for v in p.cands.values())),
        "solve_s": None,
    }
    if best["t_max"] is None:
        if math.isfinite(upper_bound) and (any(finite) or math.isfinite(seed)):
            return None  # plans exist (one was found, or the seed is one), none beats upper_bound
        raise _infeasible(_min_memory(p, tables.min_req(), valid, size), p.mem_limit, p.fixed_stages is not None)

    pieces = best["pieces"]
    S = len(pieces)
    plan = []
    for j, (k, i, sh, offset) in enumerate(pieces):
        # The candidate index for the stage count the plan really has (memory depends on it).
        plan.append((k, i, p.shapes[sh], tables.index(k, i, sh, S - j), offset))
    diagnostics["solve_s"] = time.perf_counter() - t0
    return _result(p, plan, diagnostics)


def _fastest_at(p: _Problem, arrays, s: int) -> np.ndarray:
    """``[a, b, sh]``: the fastest candidate's time for layers a..b on shape sh that fits memory with s stages
    remaining (inf where none): one column of :func:`_tables`, computed directly."""
    held = p.held(s)
    out = np.full((p.num_layers, p.num_layers, len(p.shapes)), np.inf)
    for sh, (time_, static, act, has) in enumerate(arrays):
        ok = has & (static + held * act <= p.mem_limit)
        out[:, :, sh] = np.where(ok, time_, np.inf).min(axis=0, initial=np.inf)
    return out


def _seed_latency(p: _Problem, arrays) -> float:
    """The latency of the best uniform pipeline (Megatron's layout: S stages of one shape, layers split evenly, for
    each shape whose size divides the cluster), or inf when none fits: a plan the DP can find, so a bound to start
    from."""
    L, NM = p.num_layers, p.num_devices
    best = math.inf
    for sh, shape in enumerate(p.shapes):
        size = shape[0] * shape[1]
        S = NM // size
        if NM % size or S > p.max_stages:
            continue
        bounds = [round(j * L / S) for j in range(S + 1)]
        times, cuts, necks = [], [], []
        time_, static, act, has = arrays[sh]
        for j in range(S):
            a, b, offset = bounds[j], bounds[j + 1] - 1, j * size
            if not placement_fits(shape, offset, p.hosts, p.devices_per_host):
                break
            held = p.held(S - j)
            ok = has[:, a, b] & (static[:, a, b] + held * act[:, a, b] <= p.mem_limit)
            if not ok.any():
                break
            times.append(float(time_[ok, a, b].min()))
            if j:
                cuts.append(p.priced_cut(a, offset))
                necks.append(p.priced_neck(a, offset))
        else:
            best = min(best, p.latency(times, cuts, necks))
    return best


def _walk(p: _Problem, chooser, s, size) -> list[tuple[int, int, int, int]] | None:
    """Follow the argmin tables from (s, 0, N*M) to the end: [(start, end, shape index, offset)]."""
    if chooser is None:
        return None
    NM, SH = p.num_devices, len(p.shapes)
    pieces, k, d = [], 0, NM
    while k < p.num_layers:
        i, sh = divmod(chooser(s, k, d), SH)
        pieces.append((k, i, sh, NM - d))
        k, d = i + 1, d - int(size[sh])
        s = None if s is None else s - 1
    assert d == 0 and (s is None or s == 0), "DP reconstruction must use every device and stage"
    return pieces


def stage_dp_auto(
    num_layers: int,
    hosts: int,
    devices_per_host: int,
    candidates: Callable[[int, int, tuple[int, int], int], Sequence[StageCandidate]],
    batch_size: int,
    *,
    choices: Iterable[int] | None = None,
    cut_bytes: Sequence[float] | Callable[[int], Sequence[float]] | None = None,
    **kwargs: Any,
) -> InterResult:
    """Try several microbatch counts and keep the fastest plan.

    Here ``candidates(start, end, submesh, microbatches)`` takes the microbatch count too
    (a microbatch of ``batch_size / B`` samples runs faster and holds less), and
    ``cut_bytes`` may be a function of ``B`` for the same reason. ``choices`` defaults to
    the powers of two that divide ``batch_size``. Other keywords go to :func:`stage_dp`.
    The result's ``diagnostics["by_microbatches"]`` maps each B tried to its latency
    (``None`` when nothing fitted).

    >>> def c(a, b, sub, B):   # a fixed 0.5 s per microbatch on top of the work
    ...     return [StageCandidate((a, b), sub, sub, False, (b - a + 1) * 8.0 / B + 0.5, 0.0, 0, 0)]
    >>> r = stage_dp_auto(2, 1, 2, c, batch_size=8)
    >>> r.microbatches, r.diagnostics["by_microbatches"]
    (4, {1: 16.5, 2: 13.5, 4: 12.5, 8: 13.5})
    """
    bs = _positive_int(batch_size, "batch_size")
    if choices is None:
        choices = [b for b in (1 << e for e in range(bs.bit_length())) if bs % b == 0]
    choices = [_positive_int(b, "each microbatch choice") for b in choices]
    if not choices:
        raise ValueError("choices is empty; give at least one microbatch count.")
    table: dict[int, float | None] = {}
    best: InterResult | None = None
    least_mem = math.inf
    last_error: NoFeasiblePlanError | None = None
    for B in choices:
        cb = cut_bytes(B) if callable(cut_bytes) else cut_bytes
        try:
            def at_b(a: int, b: int, sub: tuple[int, int], _B: int = B) -> Sequence[StageCandidate]:
                return candidates(a, b, sub, _B)

            r = stage_dp(num_layers, hosts, devices_per_host, at_b, B, cut_bytes=cb, **kwargs)
        except NoFeasiblePlanError as e:
            table[B] = None
            least_mem = min(least_mem, e.min_mem_bytes)
            last_error = e
            continue
        assert r is not None  # None only under an upper_bound, which this search does not give
        table[B] = r.latency_s
        if best is None or r.latency_s < best.latency_s:
            best = r
    if best is None:
        limit = float(kwargs.get("mem_limit_bytes", math.inf))
        c = kwargs.get("constraints")
        err = _infeasible(least_mem, limit, c is not None and c.num_stages is not None)
        raise NoFeasiblePlanError(f"for every microbatch count in {choices}: {err}", least_mem) from last_error
    best.diagnostics["by_microbatches"] = table
    return best


# ---------------------------------------------------------------------------------------------
# Brute force reference.


def _compositions(n: int, parts_max: int):
    """All ways to cut range(n) into contiguous (start, end) pieces, at most parts_max of them."""
    for parts in range(1, min(n, parts_max) + 1):
        for cuts in itertools.combinations(range(1, n), parts - 1):
            bounds = (0, *cuts, n)
            yield [(bounds[j], bounds[j + 1] - 1) for j in range(parts)]


def _shape_sequences(p: _Problem, count: int, offset: int = 0):
    """Sequences of ``count`` shapes placed in order from ``offset`` using every device exactly."""
    if count == 0:
        if offset == p.num_devices:
            yield (), ()
        return
    for shape in p.shapes:
        if placement_fits(shape, offset, p.hosts, p.devices_per_host):
            for rest, offs in _shape_sequences(p, count - 1, offset + shape[0] * shape[1]):
                yield (shape, *rest), (offset, *offs)


def brute_force_stages(
    num_layers: int,
    hosts: int,
    devices_per_host: int,
    candidates: Callable[[int, int, tuple[int, int]], Sequence[StageCandidate]],
    microbatches: int,
    *,
    mem_limit_bytes: float = math.inf,
    cut_bytes: Sequence[float] | None = None,
    intra_link: Any = None,
    inter_link: Any = None,
    stage_comm: str = "model",
    max_stages: int | None = None,
    schedule: str = "1f1b",
    constraints: StageConstraints | None = None,
    virtual_stages: int | None = None,
    wgrad_share: float | None = None,
    serial_host: bool = False,
) -> InterResult:
    """Every layer partition x every in-order submesh assignment x every candidate choice,
    priced with :func:`schedule_latency`. Same inputs and result as :func:`stage_dp`;
    exponential, for small instances only (about 6 layers and 8 devices). ``constraints``
    are checked plan by plan (only partitions with the pinned stage count, each stage's
    candidates filtered by the pins), independently of how the DP applies them.

    >>> flat = lambda a, b, sub: [StageCandidate((a, b), sub, sub, False, 1.0 * (b - a + 1), 0.0, 0, 0)]
    >>> brute_force_stages(4, 1, 2, flat, microbatches=8).latency_s
    18.0
    """
    t0 = time.perf_counter()
    p = _build_problem(
        num_layers, hosts, devices_per_host, candidates, microbatches, mem_limit_bytes, cut_bytes,
        intra_link, inter_link, stage_comm, max_stages, schedule, constraints, virtual_stages, wgrad_share,
        serial_host,
    )
    if p.num_layers > 10 or p.num_devices > 32:
        raise ValueError("brute_force_stages is exponential; use at most 10 layers and 32 devices.")
    best_T, best_plan = math.inf, None
    least_mem = math.inf
    visited = 0
    for parts in _compositions(p.num_layers, p.max_stages):
        S = len(parts)
        if p.fixed_stages is not None and S != p.fixed_stages:
            continue
        if p.schedule == "interleaved" and (S < 2 or p.microbatches % S or any(p.short(k, i) for k, i in parts)):
            continue  # the layouts interleaving cannot run (schedules.check_layout)
        q = dataclasses.replace(p, total_stages=S) if p.schedule in BY_STAGE_COUNT else p
        for shapes, offsets in _shape_sequences(p, S):
            per_stage = []
            for j, ((k, i), shape) in enumerate(zip(parts, shapes)):
                held = q.held(S - j)
                opts = [(idx, c) for idx, c in enumerate(p.cands[(k, i, shape)]) if p.usable(j, k, i, c)]
                per_stage.append([(idx, c, c.mem_bytes(held)) for idx, c in opts])
            cuts = [p.priced_cut(parts[j][0], offsets[j]) for j in range(1, S)]
            necks = [p.priced_neck(parts[j][0], offsets[j]) for j in range(1, S)]
            for choice in itertools.product(*per_stage):
                visited += 1
                need = max(m for _, _, m in choice)
                least_mem = min(least_mem, need)
                if need > p.mem_limit:
                    continue
                T = q.latency([c.time_s for _, c, _ in choice], cuts, necks)
                if T < best_T:
                    best_T = T
                    best_plan = [
                        (k, i, shape, idx, o)
                        for (k, i), shape, (idx, _, _), o in zip(parts, shapes, choice, offsets)
                    ]
    if best_plan is None:
        raise _infeasible(least_mem, p.mem_limit, p.fixed_stages is not None)
    return _result(p, best_plan, {"plans_visited": visited, "solve_s": time.perf_counter() - t0})
