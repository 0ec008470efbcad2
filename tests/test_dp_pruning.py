"""The stage DP's speed-ups against the plain search, on random small instances: candidates handed over as arrays
(``CandidateBlock``) against the same candidates as a function, the pruned bisection (``prune=True``: a seed plan,
a t_max floor, stage counts cut by a lower bound) against the unpruned one, and the lower bounds themselves against
every plan of the instance."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from test_inter import random_instance as inter_instance

from autopar_lab.solve import dpbounds, inter
from autopar_lab.solve.inter import brute, dp, problem
from autopar_lab.solve.inter import (CandidateBlock, DPOptions, NoFeasiblePlanError, StageProblem, stage_dp,
                                     submesh_shapes)


def random_instance(seed: int):
    """test_inter's random instances (random times and memory, some candidates missing, random limits, schedules
    and stage caps), unpacked."""
    (L, hosts, dph, fn), kw = inter_instance(seed)
    return L, hosts, dph, fn, kw


class Blocks:
    """The same candidates as arrays: what CostTable.candidate_fn hands the DP."""

    def __init__(self, L, hosts, dph, fn):
        self.L, self.fn, self.shapes = L, fn, submesh_shapes(hosts, dph)

    def block(self, shape):
        L = self.L
        lists = {(a, b): list(self.fn(a, b, shape)) for a in range(L) for b in range(a, L)}
        K = max(len(v) for v in lists.values())
        if K == 0:
            return None
        arrs = {f: np.full((K, L, L), np.nan) for f in ("fwd_s", "bwd_s", "static_bytes", "act_bytes")}
        usable = np.zeros((K, L, L), dtype=bool)
        for (a, b), opts in lists.items():
            for k, c in enumerate(opts):
                for f, arr in arrs.items():
                    arr[k, a, b] = getattr(c, f)
                usable[k, a, b] = True
        return CandidateBlock(**arrs, usable=usable, make=lambda k, a, b: lists[(a, b)][k])


def outcome(fn):
    try:
        r = fn()
    except NoFeasiblePlanError as e:
        return ("infeasible", e.min_mem_bytes, str(e))
    if r is None:
        return None
    return (r.latency_s, r.microbatches, r.device_offsets,
            [(s.layers, s.submesh, s.logical_mesh, s.remat, s.fwd_s, s.bwd_s) for s in r.stages])


@pytest.mark.parametrize("seed", range(150))
def test_array_candidates_and_pruning_give_the_plain_search_s_plan(seed):
    L, hosts, dph, fn, kw = random_instance(seed)
    plain = outcome(lambda: stage_dp(StageProblem(L, hosts, dph, **kw), fn, DPOptions(prune=False)))
    assert outcome(lambda: stage_dp(StageProblem(L, hosts, dph, **kw), fn)) == plain
    assert outcome(lambda: stage_dp(StageProblem(L, hosts, dph, **kw), Blocks(L, hosts, dph, fn))) == plain
    if plain is not None and plain[0] != "infeasible":
        for bound in (plain[0] * 1.5, math.nextafter(plain[0], math.inf), plain[0]):
            want = outcome(lambda: stage_dp(StageProblem(L, hosts, dph, **kw), fn,
                                            DPOptions(prune=False, upper_bound=bound)))
            assert outcome(lambda: stage_dp(StageProblem(L, hosts, dph, **kw), fn,
                                            DPOptions(upper_bound=bound))) == want


def all_plans(p):
    """Every plan of a problem: (stage times, priced cuts, their steady-state terms) of the assignments that fit."""
    for parts in brute.compositions(p.num_layers, p.max_stages):
        S = len(parts)
        for shapes, offsets in brute.shape_sequences(p, S):
            per = []
            for j, ((k, i), shape) in enumerate(zip(parts, shapes)):
                held = inter.held_microbatches(S - j, p.microbatches, p.schedule)
                per.append([c for c in p.cands[(k, i, shape)] if c.mem_bytes(held) <= p.mem_limit])
            cuts = [p.priced_cut(parts[j][0], offsets[j]) for j in range(1, S)]
            necks = [p.priced_neck(parts[j][0], offsets[j]) for j in range(1, S)]
            for choice in itertools.product(*per):
                yield [c.time_s for c in choice], cuts, necks


@pytest.mark.parametrize("seed", range(80))
def test_the_bounds_hold_for_every_plan(seed):
    """t_max >= H / N and sum t + sum c >= the stage-count bound, for every plan that fits; the seed is a plan."""
    L, hosts, dph, fn, kw = random_instance(seed)
    p = problem.build_problem(StageProblem(L, hosts, dph, **kw), fn)
    if not p.shapes:
        return
    arrays = problem.candidate_arrays(p)
    valid, size, cut, _neck = problem.structure(p)
    NM = p.num_devices
    E = dpbounds.device_seconds(dp.fastest_at(p, arrays, 1), size.astype(float))
    H, G = dpbounds.partition_bounds(E, p.max_stages)
    cut_min = float(cut[1:, 1:NM].min()) if L > 1 and NM > 1 else 0.0
    lb = dpbounds.stage_sum_bounds(G, NM, cut_min)
    latencies = []
    for times, cuts, necks in all_plans(p):
        assert max(times) >= H / NM * (1 - 1e-12)
        assert sum(times) + sum(cuts) >= lb[len(times) - 1] * (1 - 1e-12)
        latencies.append(inter.pipeline_latency(times, cuts, p.microbatches, necks))
    seed_T = dp.seed_latency(p, arrays)
    if math.isfinite(seed_T):
        assert any(math.isclose(seed_T, T, rel_tol=1e-12) for T in latencies)


def test_partition_bounds_against_enumeration():
    rng = np.random.default_rng(0)
    for L in range(1, 7):
        E = np.triu(rng.uniform(0.5, 4.0, size=(L, L)) * (1 + np.arange(L))[None, :])
        E = E + np.tril(np.full((L, L), np.inf), -1)  # no range ends before it starts
        H, G = dpbounds.partition_bounds(E, L)
        sums, roots = [], {}
        for parts in brute.compositions(L, L):
            sums.append(sum(E[a, b] for a, b in parts))
            r = sum(math.sqrt(E[a, b]) for a, b in parts)
            roots[len(parts)] = min(roots.get(len(parts), math.inf), r)
        assert H == pytest.approx(min(sums))
        assert [G[s - 1] for s in range(1, L + 1)] == pytest.approx([roots[s] for s in range(1, L + 1)])


@pytest.mark.parametrize("seed", range(60))
def test_under_an_upper_bound_no_t_max_that_cannot_win_is_solved(seed):
    """A plan whose largest term is t costs at least (K + 1) t (in the formula's units), so under an upper bound the
    t_max search solves no value above the last one that could beat it (the largest is solved only when nothing
    else says whether a plan fits), and finds the plain search's plan."""
    L, hosts, dph, fn, kw = random_instance(seed)
    sp = StageProblem(L, hosts, dph, **kw)
    plain = outcome(lambda: stage_dp(sp, fn, DPOptions(prune=False)))
    if plain is None or plain[0] == "infeasible":
        return
    a, _, K = dp.build_problem(sp, fn).coefficients
    bound = plain[0] * 1.25
    r = stage_dp(sp, fn, DPOptions(upper_bound=bound))
    assert outcome(lambda: r) == outcome(lambda: stage_dp(sp, fn, DPOptions(prune=False, upper_bound=bound)))
    tried = r.diagnostics["t_max_tried"]
    assert tried and all(t * (K + 1) < bound / a for t in tried)
