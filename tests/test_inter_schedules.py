"""The stage DP with the interleaved and zero-bubble (ZB-H1) schedules: its formulas and memory against the
simulator, its search against brute force."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar_lab.simulate import simulate
from autopar_lab.solve.inter import (
    DPOptions,
    NoFeasiblePlanError,
    StageCandidate,
    StageProblem,
    brute_force_stages,
    held_microbatches,
    pipeline_latency,
    schedule_latency,
    stage_dp,
)
from test_inter import SETTINGS, random_instance

W = 1.0 / 3.0  # F = B = W: the zero-bubble paper's assumption, and the DP's default share


def test_interleaved_formula_is_megatrons_on_uniform_stages_and_bounds_uneven_ones():
    rng = random.Random(3)
    for _ in range(300):
        p, v = rng.randint(2, 4), rng.choice([2, 3, 4])
        B = p * rng.randint(1, 4)
        ratio = rng.choice([1.0, 2.0, 0.5])
        f = [rng.randint(1, 6) * 0.5 for _ in range(p)]
        t = [x * (1 + ratio) for x in f]
        chunk_f = [f[c % p] / v for c in range(p * v)]  # chunk c on stage c % p, a v-th of the stage each
        sim = simulate(chunk_f, [x * ratio for x in chunk_f], B, "interleaved", virtual_stages=v).makespan
        assert sim <= schedule_latency(t, [], B, "interleaved", v) + 1e-9
        uniform = simulate([chunk_f[0]] * (p * v), [chunk_f[0] * ratio] * (p * v), B, "interleaved",
                           virtual_stages=v).makespan
        assert uniform == pytest.approx(B * t[0] + (p - 1) * t[0] / v)  # Megatron's bubble (p - 1) / v
        assert uniform == pytest.approx(schedule_latency([t[0]] * p, [], B, "interleaved", v))


def test_zb_h1_formula_bounds_the_simulator_and_its_gap_on_uniform_stages_is_known():
    rng = random.Random(5)
    for _ in range(500):
        S, B = rng.randint(1, 5), rng.randint(1, 10)
        f = [rng.randint(1, 6) * 0.5 for _ in range(S)]
        t = [3 * x for x in f]
        sim = simulate(f, f, B, "zb-h1", wgrad_s=f).makespan
        formula = schedule_latency(t, [], B, "zb-h1", wgrad_share=W)
        assert sim <= formula + 1e-9
        assert formula <= pipeline_latency(t, [], B) + 1e-9  # never above 1F1B's
        # Uniform stages: the simulator's B t + (p - 1)(1 - w) t - min(B - 1, p - 1) w t; the separable bound
        # leaves out the last term (it needs the smallest stage).
        u = simulate([f[0]] * S, [f[0]] * S, B, "zb-h1", wgrad_s=[f[0]] * S).makespan
        gap = min(B - 1, S - 1) * W * t[0]
        assert u == pytest.approx(schedule_latency([t[0]] * S, [], B, "zb-h1", wgrad_share=W) - gap)


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 2), (4, 3), (3, 4)])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_held_microbatches_is_the_simulated_peak(p, v, groups):
    B = p * groups
    tl = simulate([1.0] * (p * v), [2.0] * (p * v), B, "interleaved", virtual_stages=v)
    assert [k / v for k in tl.peak_inflight] == [held_microbatches(p - i, B, "interleaved", p, v) for i in range(p)]
    zb = simulate([1.0] * p, [1.0] * p, B, "zb-h1", wgrad_s=[1.0] * p)
    assert list(zb.peak_inflight) == [held_microbatches(p - i, B, "zb-h1", p) for i in range(p)]
    with pytest.raises(ValueError, match="num_stages"):
        held_microbatches(1, B, "zb-h1")


def _instance(seed, schedule):
    (L, hosts, dph, cands), kwargs = random_instance(seed)
    kwargs["schedule"] = schedule
    if schedule == "interleaved":
        kwargs["virtual_stages"] = random.Random(seed).choice([2, 2, 3])
        kwargs["microbatches"] = random.Random(seed + 1).choice([2, 4, 6, 8])
    else:
        kwargs["wgrad_share"] = random.Random(seed).choice([0.0, 0.25, W, 0.5])
    return L, hosts, dph, cands, kwargs


@SETTINGS
@given(st.integers(0, 10**9), st.sampled_from(["interleaved", "zb-h1"]))
def test_dp_matches_brute_force(seed, schedule):
    L, hosts, dph, cands, kwargs = _instance(seed, schedule)
    try:
        bf = brute_force_stages(StageProblem(L, hosts, dph, **kwargs), cands)
    except NoFeasiblePlanError as e:
        with pytest.raises(NoFeasiblePlanError) as got:
            stage_dp(StageProblem(L, hosts, dph, **kwargs), cands)
        if math.isfinite(e.min_mem_bytes):
            assert got.value.min_mem_bytes == e.min_mem_bytes
        return
    dp = stage_dp(StageProblem(L, hosts, dph, **kwargs), cands)
    assert dp.latency_s == pytest.approx(bf.latency_s, rel=1e-9)
    full = stage_dp(StageProblem(L, hosts, dph, **kwargs), cands, DPOptions(t_max_search="all"))
    assert full.latency_s == pytest.approx(dp.latency_s, rel=1e-9)
    for r in (dp, bf):
        S = len(r.stages)
        v = kwargs.get("virtual_stages", 1)
        if schedule == "interleaved":
            assert S >= 2 and kwargs["microbatches"] % S == 0
            assert all(s.layers[1] - s.layers[0] + 1 >= v for s in r.stages)
        for j, s in enumerate(r.stages):
            held = held_microbatches(S - j, kwargs["microbatches"], schedule, S, v)
            assert r.stage_mem_bytes[j] == pytest.approx(s.static_bytes + held * s.act_bytes)
            assert r.stage_mem_bytes[j] <= kwargs["mem_limit_bytes"]
        priced = [f + b if r.stage_comm == "model" else 0.0 for f, b in zip(r.send_fwd_s, r.send_bwd_s)]
        necks = [max(f, b) if r.stage_comm == "model" else 0.0 for f, b in zip(r.send_fwd_s, r.send_bwd_s)]
        assert r.latency_s == pytest.approx(schedule_latency([s.time_s for s in r.stages], priced,
                                                             r.microbatches, schedule, v, kwargs.get("wgrad_share", W),
                                                             necks))


def test_interleaving_shrinks_the_bubble_so_the_dp_pipelines_deeper():
    # Four layers of 1 s on four devices, one device per stage at most (a flat speedup of 1): 1F1B and interleaved
    # pick four stages; the interleaved plan's step is Megatron's B t + (p - 1) t / v.
    def cands(a, b, sub):
        n = b - a + 1
        return [StageCandidate((a, b), sub, sub, False, n / 3, 2 * n / 3, 0, 0)] if sub == (1, 1) else []

    one = stage_dp(StageProblem(4, 1, 4, microbatches=4, schedule="1f1b"), cands)
    two = stage_dp(StageProblem(8, 1, 4, microbatches=4, schedule="interleaved", virtual_stages=2), cands)
    assert len(one.stages) == 4 and one.latency_s == pytest.approx(4 * 1 + 3 * 1)
    assert len(two.stages) == 4 and two.latency_s == pytest.approx(4 * 2 + 3 * 2 / 2)
    assert two.timeline().makespan == pytest.approx(two.latency_s)  # what the simulator says of that plan
    zb = stage_dp(StageProblem(4, 1, 4, microbatches=4, schedule="zb-h1", wgrad_share=W), cands)
    assert zb.latency_s < one.latency_s and zb.timeline().makespan <= zb.latency_s + 1e-9


def test_interleaved_without_a_possible_layout_says_why():
    def cands(a, b, sub):
        return [StageCandidate((a, b), sub, sub, False, 1.0, 1.0, 0, 0)]

    with pytest.raises(NoFeasiblePlanError, match="interleaved"):
        stage_dp(StageProblem(3, 1, 2, microbatches=2, schedule="interleaved", virtual_stages=2),
                 cands)  # 2 stages need 4 layers
    with pytest.raises(ValueError, match="wgrad_share"):
        stage_dp(StageProblem(3, 1, 2, microbatches=2, schedule="zb-h1", wgrad_share=1.5), cands)
