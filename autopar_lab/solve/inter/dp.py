"""The stage DP: Alpa's recurrence vectorised over layers and free devices, the t_max search, the stage counts
of the schedules whose formula depends on them, the bounds that prune the search, and the microbatch search of
:func:`stage_dp_auto` (see :mod:`autopar_lab.solve.inter` for the problem and the placement rule)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .. import dpbounds
from .formulas import BY_STAGE_COUNT, placement_fits
from .problem import (Problem, build_problem, by_hosts, candidate_arrays, infeasible, inter_result, positive_int,
                      structure, candidate_tables)
from .values import DPOptions, InterResult, NoFeasiblePlanError, StageCandidate, StageProblem, T_MAX_SEARCH

__all__ = ["stage_dp", "stage_dp_auto", "latency_lower_bound", "layered_dp", "sweep_dp", "min_memory", "solve_one",
           "stage_counts", "stage_count_bounds", "fastest_at", "seed_latency", "walk"]


def layered_dp(p, stage_cost, cut, valid, size, combine, t_max: float = math.inf, stop_at=None):
    """Alpa's recurrence, vectorised over (start layer k, end layer i, free devices d) for each s.

    F[s][k, d] = min over end layer i >= k and shape sh (fits at offset N*M - d) of
                 combine(stage_cost[k, i, sh, s-1] + cut[k, d], F[s-1][i+1, d - size[sh]])
    with F[0][L, 0] = 0 (all layers placed, every device used exactly).
    ``combine`` is np.add (latency) or np.maximum (bottleneck memory); stage costs above
    ``t_max`` count as inf.
    Returns the list of F tables' first rows, ``F[s][0, :]`` (every layer placed, what a plan reads), and of
    argmin tables (flat index i * SH + sh, the first of equal minima). Each shape is evaluated only at the d where
    it can be placed (a host-sized submesh only on host boundaries), which is most of the saving on large clusters.
    ``stop_at[s - 1]`` (with np.add): a lower bound on F[s'][0, N*M] for every s' > s; the tables stop growing at
    the first s where the smallest F[.][0, N*M] so far is at most it (no more stages can give a smaller one).
    """
    L, NM, SH = p.num_layers, p.columns, len(p.shapes)
    S = p.max_stages
    lowest = math.inf
    # At thousands of devices each (s, shape) step is small (tens of start layers and columns): the time goes to
    # numpy's per-call overhead and to strided reads, so each s reads its costs as one block, [sh, k, i].
    costs = stage_cost.transpose(3, 2, 0, 1)  # [s - 1, sh, k, i]: candidate_tables lays best_time out so
    if not costs.flags.c_contiguous:  # (a table laid out otherwise: copied once)
        costs = np.ascontiguousarray(costs)
    # Two F tables, the previous stage count's and this one's, reused: only the argmin tables and each F's first row
    # are kept. (A fresh (L + 1) x (N*M + 1) table per s was a quarter of the DP at 4,096 hosts, most of it the
    # kernel mapping the new pages.)
    F_prev, F_next = np.full((L + 1, NM + 1), np.inf), np.empty((L + 1, NM + 1))
    F_prev[L, 0] = 0.0
    Fs, args = [F_prev[0].copy()], [None]  # type: list[Any], list[Any]
    d_idx = np.arange(NM + 1)
    places = [np.flatnonzero(valid[sh] & (d_idx >= size[sh])) for sh in range(SH)]
    for s in range(1, S + 1):
        # s stages need s layers: only start layers k <= L - s can have a plan, and a stage ending at i leaves
        # i + 1 <= L - s + 1 for the s - 1 after it, so k and i both range over 0..L-s; the rows from L - s + 1
        # on are inf and never read (the next s reads rows 1..L - s).
        n = L - s + 1
        F = F_next
        best = F[:n]
        best.fill(np.inf)
        arg = np.zeros((L, NM + 1), dtype=np.int32)  # flat indices i * SH + sh: far below 2**31
        # Device counts the s - 1 stages after this one can fill at all: a stage is placed only where it leaves one.
        reachable = np.asarray(np.isfinite(F_prev[1:n + 1]).any(axis=0))
        cost_s = costs[s - 1, :, :n, :n]  # [sh, k, i]
        if t_max < math.inf:
            cost_s = np.where(cost_s <= t_max, cost_s, np.inf)
        fin_all = np.isfinite(cost_s)
        any_row = fin_all.any(axis=2)  # [sh, k]: some stage of shape sh starts at layer k
        for sh, all_ds in enumerate(places):
            rows = any_row[sh]
            if not rows.any():
                continue  # no stage of this shape here (memory, t_max): nothing to take
            ds = all_ds[reachable[all_ds - size[sh]]] if all_ds.size else all_ds
            if ds.size == 0:
                continue
            # A run of consecutive columns (most stage counts at thousands of hosts: every count of free hosts is
            # reachable) is read and written as a slice, a view, not gathered and scattered: the same values.
            cols: Any = ds
            src: Any = ds - size[sh]
            if int(ds[-1]) - int(ds[0]) + 1 == ds.size:
                cols = slice(int(ds[0]), int(ds[-1]) + 1)
                src = slice(int(ds[0]) - int(size[sh]), int(ds[-1]) + 1 - int(size[sh]))
            # Start layers k0..k1-1 (a row between without a stage is all inf: it never takes, as in the min).
            k0, k1 = int(rows.argmax()), n - int(rows[::-1].argmax())
            k_fin, i_fin = np.nonzero(fin_all[sh, k0:k1])
            # Stages longer than the longest finite one cost inf: look only at end layers i = k .. k + w - 1.
            w = int((i_fin - k_fin).max()) + 1 - k0
            i_of = np.arange(k0, k1)[:, None] + np.arange(w)  # (row, r) -> end layer k + r
            ends = np.minimum(i_of, n - 1)
            band = np.where(i_of < n, cost_s[sh][np.arange(k0, k1)[:, None], ends], np.inf)
            total = band[:, :, None] + cut[k0:k1, cols][:, None, :]  # (row, r, d)
            combine(total, F_prev[1:n + 1, src][ends], out=total)  # next stage starts at layer i + 1
            r_best = np.argmin(total, axis=1)
            v = total.min(axis=1)
            flat = (r_best + np.arange(k0, k1)[:, None]) * SH + sh
            cur_v, cur_f = best[k0:k1, cols], arg[k0:k1, cols]
            take = (v < cur_v) | ((v == cur_v) & (flat < cur_f))
            best[k0:k1, cols] = np.where(take, v, cur_v)
            arg[k0:k1, cols] = np.where(take, flat, cur_f)
        Fs.append(F[0].copy())
        args.append(arg)
        F_prev, F_next = F, F_prev
        lowest = min(lowest, F[0, NM])
        if stop_at is not None and lowest <= stop_at[s - 1]:
            break
        if not np.isfinite(best).any():  # no s-stage suffix fits anywhere: none with more stages can either
            for _ in range(s + 1, S + 1):
                Fs.append(Fs[-1])
                args.append(arg)
            break
    return Fs, args


def min_memory(p: Problem, min_req, valid, size) -> float:
    """Smallest over full assignments of the largest per-stage memory requirement."""
    zero_cut = np.zeros((p.num_layers, p.columns + 1))
    Fs, _ = layered_dp(p, min_req, zero_cut, valid, size, np.maximum)
    if p.fixed_stages is not None:
        return float(Fs[p.fixed_stages][p.columns])
    return float(min(F[p.columns] for F in Fs[1:]))

def sweep_dp(p, stage_cost, cut, valid, size):
    """The same recurrence without the stage count, for when it does not matter (memory
    does not depend on it and max_stages does not bind): F[k, d] over k descending,
    vectorised over (end layer i, shape, d). About max_stages times cheaper."""
    L, NM, SH = p.num_layers, p.columns, len(p.shapes)
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


_MARGIN = 1e-9  # relative slack on the bounds, far above float rounding, far below any real difference


def stage_dp(problem: StageProblem, candidates: Any, options: DPOptions = DPOptions()) -> InterResult | None:
    """Alpa's stage DP: the latency-optimal pipeline of ``problem`` (:class:`StageProblem`) over the candidates given.

    ``candidates(start, end, submesh)`` lists the options for layers ``start..end`` (inclusive) on an ``(n, m)``
    submesh (an empty list means "cannot run there"); or an object with ``block(submesh) -> CandidateBlock | None``
    gives each submesh's candidates as arrays. ``options`` (:class:`DPOptions`): how the t_max values are
    searched, a latency bound to beat, the pruning bounds; the answer is the same whatever they are.

    Each schedule is priced with its own formula (:func:`schedule_latency`) and memory (:func:`held_microbatches`).
    Interleaved and zb-h1 depend on the total stage count p, so the DP is solved for each p on its own
    (interleaved: p >= 2 dividing the microbatch count, stages of at least ``virtual_stages`` layers), each bounded
    by the best so far. With serial stages (``problem.serial_stages``) the step is :func:`serial_latency` (no max term:
    one DP, no t_max search).

    Pins (``problem.constraints``, :class:`StageConstraints`: cuts, submeshes, logical meshes or remat flags) fix
    the stage count S, so the DP keeps the stage count in its state and stage ``j`` is the one with ``S - j`` stages
    remaining; a candidate is usable for stage ``j`` only if the pins allow it. Infeasible pins raise
    :class:`NoFeasiblePlanError` with the smallest memory any assignment keeping them needs.

    Returns None only under ``options.upper_bound`` when no plan beats it.

    >>> flat = lambda a, b, sub: [StageCandidate((a, b), sub, sub, False, 1.0 * (b - a + 1), 0.0, 0, 0)]
    >>> stage_dp(StageProblem(num_layers=4, hosts=1, devices_per_host=2, microbatches=8), flat).latency_s
    18.0
    """
    t_max_search, upper_bound, prune = options.t_max_search, options.upper_bound, options.prune
    t0 = time.perf_counter()
    if t_max_search not in T_MAX_SEARCH:
        raise ValueError(f"t_max_search must be one of {T_MAX_SEARCH}, got {t_max_search!r}.")
    if math.isfinite(upper_bound) and t_max_search == "alpa":
        raise ValueError('upper_bound needs t_max_search="bisect" or "all" (they solve the largest t_max first).')
    p = build_problem(problem, candidates)
    if options.host_columns:
        p = by_hosts(p)
    if (options.skip_unbeatable and math.isfinite(upper_bound) and p.constraints is None and p.shapes
            and latency_lower_bound(p) >= upper_bound):
        # No plan of this problem can beat the bound. Whether any fits, as the full search would say it (None:
        # some does; else the same error): a uniform pipeline that fits says so at once, else one memory DP
        # instead of the t_max search; the schedules of BY_STAGE_COUNT answer None, as their stage-count bounds do.
        if p.schedule not in BY_STAGE_COUNT and not math.isfinite(seed_latency(p, candidate_arrays(p))):
            valid, size, _, _ = structure(p)
            need = min_memory(p, candidate_tables(p).min_req(), valid, size)
            if not need <= p.mem_limit:
                raise infeasible(need, p.mem_limit, False)
        return None
    if p.schedule not in BY_STAGE_COUNT:
        return solve_one(p, t_max_search, upper_bound, prune, t0)
    best: InterResult | None = None
    least_mem, some_fit = math.inf, False  # some_fit: some stage count has plans (found, or bounded away)
    counts, lower = stage_count_bounds(p)
    for S in sorted(counts, key=lambda S: lower[S]):  # the most promising first, so the bound prunes the others
        q = dataclasses.replace(p, total_stages=S, max_stages=S)
        bound = min(upper_bound, best.latency_s) if best is not None else upper_bound
        if lower[S] >= bound:
            some_fit = some_fit or math.isfinite(lower[S])
            continue  # no plan with S stages can beat the bound
        try:
            r = solve_one(q, t_max_search, bound, prune, t0)
        except NoFeasiblePlanError as e:
            least_mem = min(least_mem, e.min_mem_bytes)
            continue
        some_fit = True
        if r is not None and (best is None or r.latency_s < best.latency_s):
            best = r
    if best is None:
        if some_fit:
            return None  # plans fit, none beats upper_bound
        if p.schedule == "interleaved" and not stage_counts(p):
            raise NoFeasiblePlanError(
                f"the interleaved schedule needs 2 or more stages of {p.virtual_stages} layers or more each, their "
                f"count dividing the {p.microbatches} microbatch(es)"
                + ("" if p.microbatch_group is None else f" (with microbatch groups of {p.microbatch_group}: at "
                   "most that many stages, and a last group of 0 or at least the stage count)")
                + "; none is possible here.", math.inf)
        raise infeasible(least_mem, p.mem_limit, p.constraints is not None)
    best.diagnostics["stage_counts_tried"] = stage_counts(p)
    best.diagnostics["solve_s"] = time.perf_counter() - t0
    return best


def stage_count_bounds(p: Problem) -> tuple[list[int], dict[int, float]]:
    """The stage counts to solve (:func:`stage_counts`) and a lower bound on the latency of any plan with each:
    ``a (G_S^2 / N + K H / N)`` with the device-second bounds of :mod:`dpbounds` (``G_S``: S ranges, ``H``: any), from
    the fastest candidates whatever their memory, so it holds for every plan. Without candidate arrays (pins): 0."""
    counts = stage_counts(p)
    lower = {S: 0.0 for S in counts}
    if p.constraints is not None or not p.shapes or not counts:
        return counts, lower
    arrays = candidate_arrays(p)
    fastest = np.stack([np.where(has, t, np.inf).min(axis=0, initial=np.inf) for t, _, _, has in arrays], axis=-1)
    size = np.array([n * m for n, m in p.shapes], dtype=float)
    NM = p.num_devices
    H, G = dpbounds.partition_bounds(dpbounds.device_seconds(fastest, size), max(counts))
    a, _, K = p.coefficients
    for S in counts:
        lower[S] = a * (G[S - 1] ** 2 / NM + K * H / NM) * (1 - _MARGIN) if math.isfinite(G[S - 1]) else math.inf
    return counts, lower


def latency_lower_bound(p: Problem) -> float:
    """A lower bound on the latency (seconds) of every plan of ``p`` (no pins), whatever its stage count:
    ``a (min_S G_S^2 / N + K H / N)`` with the device-second bounds of :mod:`dpbounds`. It holds because a plan's
    latency is ``a (sum t + sum kappa c + K max(t, kappa c))`` with c >= 0, its stage times sum to at least
    ``G_S^2 / N`` for its S stages and the largest is at least ``H / N`` (see :mod:`dpbounds`; every device used
    once), where E is each range's fewest device-seconds over the candidates any plan can use: for 1F1B and GPipe
    those that fit memory holding ``held(1)`` microbatches (a stage holds at least that many: held grows with the
    stages after it), for the schedules whose memory needs the stage count every candidate. Cheap (no DP): the
    microbatch search skips a count with it (:class:`DPOptions` ``skip_unbeatable``)."""
    arrays = candidate_arrays(p)
    if p.schedule in BY_STAGE_COUNT:
        fastest = np.stack([np.where(has, t, np.inf).min(axis=0, initial=np.inf) for t, _, _, has in arrays], axis=-1)
    else:
        fastest = fastest_at(p, arrays, 1)
    size = np.array([n * m for n, m in p.shapes], dtype=float)
    H, G = dpbounds.partition_bounds(dpbounds.device_seconds(fastest, size), p.max_stages)
    if not math.isfinite(H):
        return math.inf  # some layer has no candidate that fits: no plan
    a, _, K = p.coefficients
    NM = p.num_devices
    return a * (float(np.min(G)) ** 2 / NM + K * H / NM) * (1 - _MARGIN)


def stage_counts(p: Problem) -> list[int]:
    """The total stage counts a problem of a :data:`BY_STAGE_COUNT` schedule is solved for."""
    if p.fixed_stages is not None:
        counts = [p.fixed_stages]
    else:
        counts = list(range(1, p.max_stages + 1))
    if p.schedule == "interleaved":
        counts = [S for S in counts if S >= 2 and p.runs_interleaved(S) and S * p.virtual_stages <= p.num_layers]
    return counts


def solve_one(p: Problem, t_max_search: str, upper_bound: float, prune: bool, t0: float) -> InterResult | None:
    """:func:`stage_dp` on a built problem (for a schedule of :data:`BY_STAGE_COUNT`, one stage count)."""
    valid, size, cut_full, neck_full = structure(p)
    L, NM = p.num_layers, p.columns  # devices counted in columns of p.unit devices (size too)
    # Bounds (the "bisect" search only; "all" and "alpa" stay the plain references): a seed plan's latency, a
    # lower bound on t_max and on sum t + sum c by stage count (see dpbounds). They only skip what cannot beat the
    # best latency known, or what cannot change a DP's minimum.
    # (Not when the stage count is fixed by the schedule: the seed and the stage-count bounds assume a free one.)
    bounded = prune and t_max_search == "bisect" and p.fixed_stages is None and bool(p.shapes)
    a_coef, kappa, K = p.coefficients  # the schedule's formula: a * (sum t + sum kappa c + K max(t, kappa c))
    arrays = candidate_arrays(p) if p.constraints is None else None
    t_lb, sum_lb, seed = -math.inf, None, math.inf
    if bounded:
        E = dpbounds.device_seconds(fastest_at(p, arrays, 1), size.astype(float))
        H, G = dpbounds.partition_bounds(E, p.max_stages)
        # The bounds hold in exact arithmetic; a relative margin keeps a plan the DP sums in another order inside.
        t_lb = H / NM * (1 - _MARGIN)
        cut_min = float(cut_full[1:, 1:NM].min()) if L > 1 and NM > 1 else 0.0
        sum_lb = dpbounds.stage_sum_bounds(G, NM, cut_min) * (1 - _MARGIN)
        seed = seed_latency(p, arrays) * (1 + _MARGIN) / a_coef  # seconds -> the DP's units
    tables = candidate_tables(p, arrays)
    best_time = tables.best_time

    values = set(np.unique(best_time[np.isfinite(best_time)]).tolist())
    if p.stage_comm == "model":
        values |= {kappa * max(f, b) for f, b in p.cut_cost.values()}
    V = sorted(values) if p.shapes else []  # no shape has a candidate: nothing to solve

    # Without a memory effect of the stage count and without a binding max_stages, the
    # stage count can be dropped from the state.
    collapsed = p.fixed_stages is None and p.max_stages == min(L, p.num_devices) and all(
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
            F, arg = sweep_dp(p, np.where(best_time[..., 0] <= t_max, best_time[..., 0], np.inf), cut, valid, size)
            f = F[0, NM]
            chooser = None if not math.isfinite(f) else (lambda s, k, d: int(arg[k, d]))
            s_best = None
        else:
            Fs, args = layered_dp(p, best_time, cut, valid, size, np.add, t_max=t_max, stop_at=stop)
            stage_counts.append(len(Fs) - 1)
            totals = [Fs[s][NM] for s in range(1, len(Fs))]
            s_best = int(np.argmin(totals)) + 1 if p.fixed_stages is None else p.fixed_stages
            f = totals[s_best - 1]
            chooser = lambda s, k, d: int(args[s][k, d])  # noqa: E731
        finite.append(math.isfinite(f))
        if f + K * t_max < best["T"]:
            best.update(T=f + K * t_max, t_max=t_max, pieces=walk(p, chooser, s_best, size))
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
        # A plan whose largest term is V[j] costs at least (K + 1) V[j]: above the last j where that is below the
        # best known (an upper bound, the seed), no t_max can win, and the search starts there instead of at the
        # top (the search's own pruning, taken at once: at 16,384 GPUs with a microbatch count's upper bound most
        # of the DPs solved were above it). The top is still solved when nothing else says whether any plan fits.
        Va = np.asarray(V)
        cap = int(np.count_nonzero(Va + K * Va < best["T"])) - 1 if math.isfinite(best["T"]) else top
        if cap >= top:
            search(0, top, solve(top))
        else:
            if cap >= 0:
                search(0, cap, solve(cap))
            if best["t_max"] is None and not any(finite) and not math.isfinite(seed):
                solve(top)  # whether any plan fits (it cannot win: the same None or error as the full search)

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
        raise infeasible(min_memory(p, tables.min_req(), valid, size), p.mem_limit, p.fixed_stages is not None)

    pieces = best["pieces"]
    S = len(pieces)
    plan = []
    for j, (k, i, sh, offset) in enumerate(pieces):
        # The candidate index for the stage count the plan really has (memory depends on it).
        plan.append((k, i, p.shapes[sh], tables.index(k, i, sh, S - j), offset))
    diagnostics["solve_s"] = time.perf_counter() - t0
    return inter_result(p, plan, diagnostics)


def fastest_at(p: Problem, arrays, s: int) -> np.ndarray:
    """``[a, b, sh]``: the fastest candidate's time for layers a..b on shape sh that fits memory with s stages
    remaining (inf where none): one column of :func:`~.problem.candidate_tables`, computed directly."""
    held = p.held(s)
    out = np.full((p.num_layers, p.num_layers, len(p.shapes)), np.inf)
    for sh, (time_, static, act, has) in enumerate(arrays):
        ok = has & (static + held * act <= p.mem_limit)
        out[:, :, sh] = np.where(ok, time_, np.inf).min(axis=0, initial=np.inf)
    return out


def seed_latency(p: Problem, arrays) -> float:
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


def walk(p: Problem, chooser, s, size) -> list[tuple[int, int, int, int]] | None:
    """Follow the argmin tables from (s, 0, N*M) to the end: [(start, end, shape index, offset)] (the offset in
    devices; the tables' columns and ``size`` count ``p.unit`` devices each)."""
    if chooser is None:
        return None
    NM, SH = p.columns, len(p.shapes)
    pieces, k, d = [], 0, NM
    while k < p.num_layers:
        i, sh = divmod(chooser(s, k, d), SH)
        pieces.append((k, i, sh, (NM - d) * p.unit))
        k, d = i + 1, d - int(size[sh])
        s = None if s is None else s - 1
    assert d == 0 and (s is None or s == 0), "DP reconstruction must use every device and stage"
    return pieces


def stage_dp_auto(problem: StageProblem,
                  candidates: Callable[[int, int, tuple[int, int], int], Sequence[StageCandidate]],
                  batch_size: int, *, choices: Iterable[int] | None = None,
                  cut_bytes: Sequence[float] | Callable[[int], Sequence[float]] | None = None,
                  options: DPOptions = DPOptions()) -> InterResult:
    """Try several microbatch counts and keep the fastest plan: :func:`stage_dp` on ``problem`` with each count
    ``B`` of ``choices`` (``problem.microbatches`` is not read).

    Here ``candidates(start, end, submesh, microbatches)`` takes the microbatch count too
    (a microbatch of ``batch_size / B`` samples runs faster and holds less), and
    ``cut_bytes`` may be a function of ``B`` for the same reason (default: ``problem.cut_bytes`` for every count).
    ``choices`` defaults to the powers of two that divide ``batch_size``. ``options`` go to :func:`stage_dp` (a
    finite ``upper_bound`` is refused: every count is solved to the end).
    The result's ``diagnostics["by_microbatches"]`` maps each B tried to its latency
    (``None`` when nothing fitted).

    >>> def c(a, b, sub, B):   # a fixed 0.5 s per microbatch on top of the work
    ...     return [StageCandidate((a, b), sub, sub, False, (b - a + 1) * 8.0 / B + 0.5, 0.0, 0, 0)]
    >>> r = stage_dp_auto(StageProblem(num_layers=2, hosts=1, devices_per_host=2), c, batch_size=8)
    >>> r.microbatches, r.diagnostics["by_microbatches"]
    (4, {1: 16.5, 2: 13.5, 4: 12.5, 8: 13.5})
    """
    if math.isfinite(options.upper_bound):
        raise ValueError("stage_dp_auto solves every microbatch count to the end; leave DPOptions.upper_bound out.")
    bs = positive_int(batch_size, "batch_size")
    if choices is None:
        choices = [b for b in (1 << e for e in range(bs.bit_length())) if bs % b == 0]
    choices = [positive_int(b, "each microbatch choice") for b in choices]
    if not choices:
        raise ValueError("choices is empty; give at least one microbatch count.")
    table: dict[int, float | None] = {}
    best: InterResult | None = None
    least_mem = math.inf
    last_error: NoFeasiblePlanError | None = None
    for B in choices:
        cb = cut_bytes(B) if callable(cut_bytes) else problem.cut_bytes if cut_bytes is None else cut_bytes
        try:
            def at_b(a: int, b: int, sub: tuple[int, int], _B: int = B) -> Sequence[StageCandidate]:
                return candidates(a, b, sub, _B)

            r = stage_dp(dataclasses.replace(problem, microbatches=B, cut_bytes=cb), at_b, options)
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
        limit = float(problem.mem_limit_bytes)
        c = problem.constraints
        err = infeasible(least_mem, limit, c is not None and c.num_stages is not None)
        raise NoFeasiblePlanError(f"for every microbatch count in {choices}: {err}", least_mem) from last_error
    best.diagnostics["by_microbatches"] = table
    return best
