"""The microbatch search's skip (issue 36): a microbatch count whose latency lower bound
(``inter.dp.latency_lower_bound``) cannot beat the best plan so far is not solved. The bound must be below every plan's
latency (checked against the brute force on random small instances), and the search with it must keep the reference
search's plan (``stage_dp_auto``, every count solved to the end)."""

from __future__ import annotations

import math
import random
import types

import pytest
from test_dp_pruning import outcome
from test_inter import INTER, INTRA
from test_inter import random_instance as inter_instance
from test_stage_dp_hosts import whole_host_instance

from autopar_lab.stagesearch import search_microbatches
from autopar_lab.solve.inter import (DPOptions, NoFeasiblePlanError, StageCandidate, StageProblem, brute_force_stages,
                                     problem, stage_dp, stage_dp_auto, submesh_shapes)
from autopar_lab.solve.inter.dp import latency_lower_bound


def instance(seed: int):
    """test_inter's instances (1F1B, GPipe, sub-host shapes) for even seeds, whole-host ones with every schedule for
    odd seeds."""
    if seed % 2 == 0:
        (L, hosts, dph, fn), kw = inter_instance(seed)
        return L, hosts, dph, fn, kw
    return whole_host_instance(seed)


@pytest.mark.parametrize("seed", range(100))
def test_the_bound_is_below_every_plan_s_latency(seed):
    L, hosts, dph, fn, kw = instance(seed)
    sp = StageProblem(L, hosts, dph, **kw)
    p = problem.build_problem(sp, fn)
    if not p.shapes:
        return
    try:
        best = brute_force_stages(sp, fn).latency_s
    except NoFeasiblePlanError:
        return
    assert latency_lower_bound(p) <= best


@pytest.mark.parametrize("seed", range(100))
def test_skipping_unbeatable_keeps_every_plan_that_beats_the_bound(seed):
    L, hosts, dph, fn, kw = instance(seed)
    sp = StageProblem(L, hosts, dph, **kw)
    exact = outcome(lambda: stage_dp(sp, fn))
    if exact is None or exact[0] == "infeasible":
        return
    for bound in (exact[0] * 2, exact[0] * 1.01, math.nextafter(exact[0], math.inf), exact[0], exact[0] * 0.99):
        want = outcome(lambda: stage_dp(sp, fn, DPOptions(upper_bound=bound)))
        got = outcome(lambda: stage_dp(sp, fn, DPOptions(upper_bound=bound, skip_unbeatable=True)))
        if bound > exact[0] * (1 + 1e-6):
            assert got == want == exact  # a plan beats the bound: never skipped
        else:  # none does, to rounding: skipped, or solved as without the skip
            assert got is None or got == want


def per_count_instance(seed: int):
    """Candidates whose time and memory depend on the microbatch count B (a microbatch of batch / B samples): work that
    shrinks with B plus a fixed overhead per microbatch, activations that shrink with B; random weights and limits."""
    rng = random.Random(seed)
    L = rng.randint(2, 6)
    hosts, dph = rng.choice([(1, 4), (2, 2), (2, 4), (4, 2)])
    batch = 16
    base = {}
    for a in range(L):
        for b in range(a, L):
            for shape in submesh_shapes(hosts, dph):
                n = shape[0] * shape[1]
                base[(a, b, shape)] = [(rng.uniform(0.5, 3) * (b - a + 1) / rng.choice([1, n ** 0.5, n]),
                                        rng.uniform(0, 0.3), rng.randint(0, 10) / n, rng.uniform(1, 16) * (b - a + 1))
                                       for _ in range(rng.choice([1, 1, 2]))]

    def candidates(a, b, shape, B):
        return [StageCandidate((a, b), shape, shape, False, w * batch / B / 3 + o, 2 * (w * batch / B / 3 + o),
                               static, act / B) for w, o, static, act in base[(a, b, shape)]]

    kw = dict(mem_limit_bytes=rng.choice([math.inf, 30, 60]), schedule=rng.choice(["1f1b", "gpipe"]),
              cut_bytes=[rng.choice([0, 5, 40]) for _ in range(L - 1)], intra_link=INTRA, inter_link=INTER)
    return L, hosts, dph, batch, candidates, kw


@pytest.mark.parametrize("seed", range(40))
def test_the_search_with_the_skip_keeps_the_reference_plan(seed):
    """search_microbatches (skips, bounds, stops at the first count where nothing fits) against stage_dp_auto (every
    count solved): the same latency and microbatch count; every count it skipped has an exact latency no better."""
    L, hosts, dph, batch, candidates, kw = per_count_instance(seed)
    sp = StageProblem(L, hosts, dph, **kw)
    choices = [1, 2, 4, 8, 16]
    per_b = lambda B: [c / B for c in kw["cut_bytes"]]  # noqa: E731  # a microbatch's activations: batch / B samples
    try:
        ref = stage_dp_auto(sp, candidates, batch, choices=choices, cut_bytes=per_b)
    except NoFeasiblePlanError:
        return
    # What search_microbatches reads of a cost table: the layers, the cut bytes (divided by the count), progress.
    table = types.SimpleNamespace(layer_names=[f"l{i}" for i in range(L)], cut_bytes=kw["cut_bytes"], on_progress=None)
    got = search_microbatches(table, sp, choices, candidates=lambda B, mem: lambda a, b, s: candidates(a, b, s, B))
    assert (got.latency_s, got.microbatches) == (ref.latency_s, ref.microbatches)
    for B, lat in got.diagnostics["by_microbatches"].items():
        exact = ref.diagnostics["by_microbatches"][B]
        if lat == math.inf:  # skipped or bounded away: plans fit there, none beats the plan found
            assert exact is not None and exact >= got.latency_s
        else:
            assert lat == exact
