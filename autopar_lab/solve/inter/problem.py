"""The stage DP's problem as both solvers start from it: the inputs checked (:func:`build_problem`), the
candidates as tables the vectorised DP reads (:func:`candidate_tables`, :func:`structure`), the error when nothing
fits, and a chosen plan turned into an :class:`~autopar_lab.solve.inter.InterResult`."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from ...schedules import group_fits
from .formulas import (BY_STAGE_COUNT, DEFAULT_WGRAD_SHARE, SCHEDULES, STAGE_COMM, coefficients, cut_link,
                       held_microbatches, placement_fits, schedule_latency, serial_latency, submesh_shapes,
                       transfer_s)
from .values import CandidateBlock, InterResult, NoFeasiblePlanError, StageCandidate, StageConstraints, StageProblem

__all__ = ["Problem", "BlockCandidates", "positive_int", "build_problem", "by_hosts", "CandidateTables",
           "candidate_tables", "candidate_arrays", "pinned_tables", "structure", "infeasible", "inter_result"]


class BlockCandidates(Mapping):
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
class Problem:
    """A :class:`~autopar_lab.solve.inter.StageProblem` checked and made ready to solve (:func:`build_problem`):
    the submesh shapes that have candidates, the candidates by (start, end, shape), each cut's transfer times."""

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
    serial: bool = False  # the stages share one compute resource (StageProblem.serial_stages): one task at a time
    unit: int = 1  # devices per column of the DP's tables (devices_per_host: counted in hosts, see by_hosts)
    microbatch_group: int | None = None  # the interleaved order's microbatches per chunk in a row (None: the stages)

    @property
    def fixed_stages(self) -> int | None:
        """The stage count the pins or ``total_stages`` impose (then ``max_stages`` equals it), else None."""
        if self.total_stages is not None:
            return self.total_stages
        return None if self.constraints is None else self.constraints.num_stages

    def held(self, s: int) -> float:
        """Microbatches a stage with ``s`` stages from it to the last holds (:func:`held_microbatches`)."""
        return held_microbatches(s, self.microbatches, self.schedule, self.total_stages, self.virtual_stages,
                                 self.microbatch_group)

    def runs_interleaved(self, stages: int) -> bool:
        """Whether the interleaved schedule can run ``stages`` stages with this problem's microbatches (a multiple
        of the stage count, or what its microbatch group accepts: :func:`~autopar_lab.schedules.check_group`)."""
        if self.microbatch_group is None:
            return self.microbatches % stages == 0
        return group_fits(self.microbatch_group, stages, self.microbatches)

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(a, kappa, K)`` of the schedule's formula (:func:`coefficients`); with serial stages every stage's
        microbatches run one after another whatever the schedule: ``B (sum t + sum c)`` (:func:`serial_latency`)."""
        if self.serial:
            return float(self.microbatches), 1.0, 0.0
        return coefficients(self.schedule, self.microbatches, self.virtual_stages, self.wgrad_share)

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

    @property
    def columns(self) -> int:
        """The free-device count's last column in the DP's tables: devices, or hosts when ``unit`` is a host."""
        return self.num_devices // self.unit

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


def positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
    return int(value)


def build_problem(problem: StageProblem, candidates: Any) -> Problem:
    """``problem`` checked (one ValueError naming the field) and its candidates gathered: ``candidates(start, end,
    submesh)`` lists the options for layers ``start..end`` on a submesh, or an object with ``block(submesh) ->
    CandidateBlock | None`` gives them as arrays."""
    if not isinstance(problem, StageProblem):
        raise ValueError(f"the stage problem must be a StageProblem, got {type(problem).__name__}.")
    (num_layers, hosts, devices_per_host, microbatches, mem_limit_bytes, cut_bytes, intra_link, inter_link,
     stage_comm, max_stages, schedule, constraints, virtual_stages, wgrad_share, serial_stages, group) = (
        getattr(problem, f.name) for f in dataclasses.fields(StageProblem))
    L = positive_int(num_layers, "num_layers")
    N = positive_int(hosts, "hosts")
    M = positive_int(devices_per_host, "devices_per_host")
    B = positive_int(microbatches, "microbatches")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
    chunks = 1 if schedule != "interleaved" else 2 if virtual_stages is None else positive_int(
        virtual_stages, "virtual_stages")
    if schedule == "interleaved" and chunks < 2:
        raise ValueError("the interleaved schedule needs virtual_stages of 2 or more.")
    w = DEFAULT_WGRAD_SHARE if wgrad_share is None else float(wgrad_share)
    if group is not None:
        # keeps a FlexibleGroup's kind (Llama 3's schedule): the group's rule goes with its count
        group = (group if positive_int(group, "microbatch_group") == group else None) if schedule == "interleaved" \
            else None
    if not 0.0 <= w < 1.0:
        raise ValueError(f"wgrad_share must be a share of a stage's time in [0, 1), got {wgrad_share!r}.")
    if stage_comm not in STAGE_COMM:
        raise ValueError(f"stage_comm must be one of {STAGE_COMM}, got {stage_comm!r}.")
    mem = float(mem_limit_bytes)
    if not mem > 0:
        raise ValueError(f"mem_limit_bytes must be positive, got {mem_limit_bytes!r}.")
    smax = min(L, N * M) if max_stages is None else min(L, N * M, positive_int(max_stages, "max_stages"))
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
        cands = BlockCandidates(blocks, L)
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
    return Problem(L, N, M, B, schedule, stage_comm, mem, smax, used, cands, cut_cost, constraints, blocks, chunks, w,
                   serial=bool(serial_stages), microbatch_group=group)


def by_hosts(p: Problem) -> Problem:
    """``p`` with the DP's device axis counted in whole hosts (``unit = devices_per_host``) when every shape with a
    candidate is whole hosts (m = devices_per_host, as in the "scale" planning space); else ``p`` itself.

    Exact: in-order placement then starts every stage on a host boundary (a (1, M) stage fills one host, an (n, M)
    one starts on one by :func:`placement_fits`), so the DP over devices reaches only the columns that are multiples
    of M; every cut is then an inter-host one and the recurrence over those columns is the recurrence over hosts,
    term by term (the same sums in the same order, the same tie-breaks), with M times fewer columns."""
    M = p.devices_per_host
    if M == 1 or not p.shapes or any(m != M for _, m in p.shapes):
        return p
    return dataclasses.replace(p, unit=M)


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


class CandidateTables(NamedTuple):
    """What the DP needs of the candidates, per (start layer k, end layer i, shape sh, stages
    remaining s): ``best_time[k, i, sh, s-1]``, the fastest candidate that fits memory while
    holding held(s) microbatches (inf if none); ``index(k, i, sh, s)`` which candidate that is
    (the first of the fastest); ``min_req()`` the smallest memory any candidate there needs
    (for the error message only, so computed only when asked).

    For a fixed t_max the best candidate is simply the fastest one that fits memory (if it
    is within t_max, nothing slower can be better; if not, nothing fits), so the t_max loop
    only has to mask this table. ``best_time`` and ``min_req()`` are laid out ``[s-1, sh, k, i]`` in memory (seen
    through a transposed view): the layered DP reads one (s, shape) block at a time.
    """

    best_time: np.ndarray
    index: Callable[[int, int, int, int], int]  # type: ignore[assignment]  # a field, not tuple.index
    min_req: Callable[[], np.ndarray]


def candidate_tables(p: Problem, arrays=None) -> CandidateTables:
    """See :class:`CandidateTables`. A candidate's memory ``static + held * act`` grows with held, and
    held(s) with s, so each candidate fits exactly while s <= s_max (its largest such s):
    best_time[..., s] is the minimum time over candidates with s_max >= s, a running minimum
    over s from the top. ``arrays``: :func:`candidate_arrays` of p, when already made."""
    if p.constraints is not None:
        return pinned_tables(p)
    L, SH, S = p.num_layers, len(p.shapes), p.max_stages
    held = np.array([p.held(s) for s in range(1, S + 1)], dtype=float)
    whole = bool(np.all(held == np.floor(held)))
    mem = p.mem_limit
    arrays = candidate_arrays(p) if arrays is None else arrays
    # Laid out [s - 1, sh, k, i] and seen as [k, i, sh, s - 1]: the DP reads one (s, shape) block at a time.
    laid = np.full((S, SH, L, L), np.inf)
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
        by_top = np.full((S + 1, L, L), np.inf)  # [t]: fastest candidate whose s_max is t
        cc, kk, ii = np.nonzero(has & (s_max > 0))
        np.minimum.at(by_top, (s_max[cc, kk, ii], kk, ii), time_[cc, kk, ii])
        laid[:, sh] = np.minimum.accumulate(by_top[:0:-1], axis=0)[::-1]  # over s_max >= s
    best_time = laid.transpose(2, 3, 1, 0)

    def index(k, i, sh, s):
        held_s = p.held(s)
        for idx, c in enumerate(p.cands[(k, i, p.shapes[sh])]):
            if c.mem_bytes(held_s) <= mem and c.time_s == best_time[k, i, sh, s - 1]:
                return idx
        return -1

    def min_req():
        out = np.full((S, SH, L, L), np.inf)  # laid out as best_time
        for sh, (_, static, act, has) in enumerate(arrays):
            for s in range(S):
                out[s, sh] = np.where(has, static + held[s] * act, np.inf).min(axis=0, initial=np.inf)
        return out.transpose(2, 3, 1, 0)

    return CandidateTables(best_time, index, min_req)


def candidate_arrays(p: Problem) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per shape of ``p.shapes``: (time, static, act, usable) arrays over (option, start, end), read from the
    candidate blocks, or gathered from the candidate lists (padded; padding is never usable). A layer range too
    short for a stage (:meth:`Problem.short`) is never usable."""
    out = _arrays_of(p)
    if p.virtual_stages > 1:
        idx = np.arange(p.num_layers)
        long_enough = (idx[None, :] - idx[:, None] + 1) >= p.virtual_stages
        out = [(t, st, a, has & long_enough[None]) for t, st, a, has in out]
    return out


def _arrays_of(p: Problem) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
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


def pinned_tables(p: Problem):
    """:func:`candidate_tables` when stage decisions are pinned: whether a candidate is usable depends on which stage it
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
    return CandidateTables(best_time, lambda k, i, sh, s: int(best_idx[k, i, sh, s - 1]), lambda: min_req)


def structure(p: Problem):
    """valid[sh, d]: a stage of shape sh may start with d devices free; size[sh];
    cut[k, d]: priced cut term in front of a stage starting at layer k with d devices free (its sum term);
    neck[k, d]: the same cut's steady-state term (its slower direction), which t_max bounds.
    Devices are counted in ``p.unit`` (d, size: in columns; see :func:`by_hosts`)."""
    L, NM, u = p.num_layers, p.columns, p.unit
    size = np.array([n * m // u for n, m in p.shapes], dtype=np.int64)
    valid = _placements(p.shapes, p.hosts, p.devices_per_host, u)
    cut = np.zeros((L, NM + 1))
    neck = np.zeros((L, NM + 1))
    kappa = p.coefficients[1]  # the schedule's weight of a cut (interleaved: v transfers per microbatch)
    if L > 1 and NM > 1 and p.stage_comm != "ignore":
        # A cut's terms depend on the layer and on the link only (cut_link of the offset): one column per link,
        # spread over the offsets 1..NM-1 that use it (other d never start a stage after layer 0). The same float
        # operations as priced_cut / priced_neck, elementwise.
        d = np.arange(1, NM)
        inter_host = (NM - d) * u % p.devices_per_host == 0
        for where in (inter_host, ~inter_host):
            if not where.any():
                continue
            terms = [p.cut_terms(k, (NM - int(d[where][0])) * u) for k in range(1, L)]
            f = np.array([t[0] for t in terms])
            b = np.array([t[1] for t in terms])
            cols = d[where]
            cut[1:, cols] = (kappa * (f + b))[:, None]
            neck[1:, cols] = (kappa * np.maximum(f, b))[:, None]
    return valid, size, cut, neck


@functools.lru_cache(maxsize=16)
def _placements(shapes: tuple[tuple[int, int], ...], hosts: int, devices_per_host: int, unit: int = 1) -> np.ndarray:
    """valid[sh, d]: a stage of ``shapes[sh]`` may start with d columns of ``unit`` devices free
    (:func:`placement_fits` at offset (C - d) * unit, C columns in all); the same for every microbatch count and
    t_max, so kept (read-only)."""
    C = hosts * devices_per_host // unit
    valid = np.zeros((len(shapes), C + 1), dtype=bool)
    for sh, shape in enumerate(shapes):
        for d in range(C + 1):
            valid[sh, d] = placement_fits(shape, (C - d) * unit, hosts, devices_per_host)
    valid.setflags(write=False)
    return valid



def infeasible(min_mem: float, limit: float, pinned: bool = False) -> NoFeasiblePlanError:
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


def inter_result(p: Problem, plan: list[tuple[int, int, tuple[int, int], int, int]], diagnostics: dict) -> InterResult:
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
