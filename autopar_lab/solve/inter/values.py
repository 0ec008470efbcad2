"""The stage DP's values: a stage candidate (one at a time, or a submesh's every candidate as arrays), the pins a
solve must keep, the problem both solvers take (:class:`StageProblem`), how the DP searches (:class:`DPOptions`),
and the pipeline it returns."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ...backends import runs_serially

__all__ = ["StageCandidate", "CandidateBlock", "InterResult", "NoFeasiblePlanError", "StageConstraints",
           "StageProblem", "DPOptions", "T_MAX_SEARCH"]

#: How the DP walks the t_max values (:class:`DPOptions`).
T_MAX_SEARCH = ("bisect", "alpa", "all")

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
        from autopar_lab.simulate import SimOptions, simulate

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
        return simulate(fwd, bwd, self.microbatches, self.schedule, send_fwd_s=sf, send_bwd_s=sb, wgrad_s=wgrad,
                        virtual_stages=v if v > 1 else None, options=SimOptions(act_bytes=act, static_bytes=static))


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


@dataclass(frozen=True)
class StageProblem:
    """What the stage DP (:func:`~autopar_lab.solve.inter.stage_dp`) and the brute force
    (:func:`~autopar_lab.solve.inter.brute_force_stages`) solve, besides the candidates: ``num_layers`` layers on
    ``hosts`` hosts of ``devices_per_host`` devices (placed host-major, see the placement rule of
    :mod:`autopar_lab.solve.inter`), ``microbatches`` per step.

    ``mem_limit_bytes``: per device; a candidate is usable only if ``static_bytes + held * act_bytes`` fits, with
    ``held`` from :func:`~autopar_lab.solve.inter.held_microbatches`. ``cut_bytes[k-1]``: activation bytes per
    microbatch crossing the cut in front of layer ``k`` (gradients are the same size); a cut costs ``latency + bytes
    / bandwidth`` per direction over ``intra_link`` or ``inter_link`` (objects with ``.bandwidth`` and ``.latency``).
    ``stage_comm``: ``"model"`` prices the transfers, ``"ignore"`` is Alpa's objective. ``max_stages``: at most that
    many stages. ``schedule``: "1f1b", "gpipe", "interleaved" (``virtual_stages`` chunks per stage, default 2) or
    "zb-h1" (``wgrad_share``: W's share of a stage's time, default
    :data:`~autopar_lab.solve.inter.DEFAULT_WGRAD_SHARE`). ``constraints``: the pins a solve keeps.
    ``serial_stages``: the stages share one compute resource (the CPU's stages of one host:
    :func:`autopar_lab.backends.runs_serially`): they run one task at a time, so every schedule's step is
    :func:`~autopar_lab.solve.inter.serial_latency`. ``microbatch_group`` (interleaved): the microbatches each chunk
    runs in a row (None: the stage count; :func:`~autopar_lab.schedules.check_group`), which sets each stage's
    warm-up and so its memory, and the stage counts the microbatches allow.

    The size comes first, the rest by keyword; the fields are checked when the problem is solved (one ValueError
    naming the field). Immutable: change one with a ``with_*`` method or :func:`dataclasses.replace`.

    >>> p = StageProblem(4, 1, 2, microbatches=8)
    >>> p.with_microbatches(4).microbatches, p.with_schedule("interleaved", virtual_stages=2).virtual_stages
    (4, 2)
    """

    num_layers: int
    hosts: int
    devices_per_host: int
    _: dataclasses.KW_ONLY
    microbatches: int = 1
    mem_limit_bytes: float = math.inf
    cut_bytes: Sequence[float] | None = None
    intra_link: Any = None
    inter_link: Any = None
    stage_comm: str = "model"
    max_stages: int | None = None
    schedule: str = "1f1b"
    constraints: StageConstraints | None = None
    virtual_stages: int | None = None
    wgrad_share: float | None = None
    serial_stages: bool = False
    microbatch_group: int | None = None

    @classmethod
    def on(cls, cluster: Any, *, num_layers: int, microbatches: int = 1) -> StageProblem:
        """The problem on a :class:`~autopar_lab.cluster.Cluster` as the planner poses it: its hosts and devices,
        its scale-up link for cuts inside a host and ``cluster.host_boundary_link`` for cuts between hosts, and
        ``serial_stages`` where its stages share one compute resource (:func:`autopar_lab.backends.runs_serially`)."""
        return cls(num_layers=num_layers, hosts=cluster.hosts, devices_per_host=cluster.devices_per_host,
                   microbatches=microbatches, intra_link=cluster.scale_up_link(2),
                   inter_link=cluster.host_boundary_link,
                   serial_stages=runs_serially(cluster))

    def with_microbatches(self, microbatches: int, cut_bytes: Sequence[float] | None = None) -> StageProblem:
        """This problem with ``microbatches`` per step (and, when given, the cut bytes of one such microbatch)."""
        return dataclasses.replace(self, microbatches=microbatches,
                                   cut_bytes=self.cut_bytes if cut_bytes is None else cut_bytes)

    def with_schedule(self, schedule: str, *, virtual_stages: int | None = None,
                      wgrad_share: float | None = None) -> StageProblem:
        """This problem under another schedule (with its chunk count or weight-gradient share)."""
        return dataclasses.replace(self, schedule=schedule, virtual_stages=virtual_stages, wgrad_share=wgrad_share)

    def with_constraints(self, constraints: StageConstraints | None) -> StageProblem:
        """This problem keeping the pins ``constraints`` (None: none)."""
        return dataclasses.replace(self, constraints=constraints)

    def with_mem_limit(self, mem_limit_bytes: float) -> StageProblem:
        """This problem under another memory limit per device."""
        return dataclasses.replace(self, mem_limit_bytes=mem_limit_bytes)


@dataclass(frozen=True, kw_only=True)
class DPOptions:
    """How the stage DP searches (the answer does not depend on it, only the work done).

    T* = min over t_max of [min_s F(s, 0, N*M; t_max) + (B-1) t_max], with t_max over the distinct stage and (priced)
    cut times. ``t_max_search`` picks which t_max to solve:

    * ``"alpa"``: increasing order, stopping once ``B * t_max`` cannot beat the best T (any plan whose largest term
      is t_max costs at least ``B * t_max``);
    * ``"bisect"`` (default, same answer, far fewer DPs): solve the largest t_max, then bisect the sorted values,
      skipping a range [a, b) when ``max(F(b), a) + (B-1) a`` cannot beat the best T. It is exact because F is
      non-increasing in t_max and a plan whose largest term is in [a, b) costs at least that. Infeasible small
      t_max values (F = inf) are skipped in whole ranges, like a binary search;
    * ``"all"``: every value, no pruning (for tests).

    ``upper_bound`` (a latency some other plan already reaches, e.g. with another microbatch count): the t_max
    search skips what cannot beat it, and the DP's result is None when no plan does. Infeasibility is still raised
    when the largest t_max has no plan (``"bisect"`` and ``"all"`` always solve that one).

    ``prune`` (``"bisect"`` without pins): start the search from the best uniform pipeline's latency (a plan the
    DP could pick itself), skip t_max values below the smallest any plan can have, and stop adding stages to a DP
    once no larger stage count can go below the minimum found (lower bounds of :mod:`autopar_lab.solve.dpbounds`).
    Exact: the same latency and the same plan as ``prune=False`` (kept for tests and measurements).

    ``skip_unbeatable`` (with a finite ``upper_bound``, no pins): when a lower bound on every plan's latency
    (:func:`~autopar_lab.solve.inter.dp.latency_lower_bound`) cannot beat the bound, skip the t_max search: None
    when plans fit, the same error when none does (one memory DP decides; for the schedules whose memory needs the
    stage count, None, as their stage-count bounds answer). The microbatch search uses it.

    ``host_columns``: where every submesh with a candidate is whole hosts (the "scale" planning space), count the
    free devices in hosts (one DP column per host, ``devices_per_host`` times fewer): no stage can start inside a
    host then, so the columns left out are never reached. Exact (same plan; ``False`` keeps one column per device,
    for tests and measurements).

    >>> DPOptions().with_upper_bound(3.0).upper_bound
    3.0
    """

    t_max_search: str = "bisect"
    upper_bound: float = math.inf
    prune: bool = True
    skip_unbeatable: bool = False
    host_columns: bool = True

    def with_upper_bound(self, upper_bound: float) -> DPOptions:
        return dataclasses.replace(self, upper_bound=upper_bound)
