"""The stage DP (Alpa §5.2) against brute force, plus hand cases for memory and stage transfers."""

from __future__ import annotations

import math
import random
from collections import namedtuple

import pytest
from hypothesis import HealthCheck, given, settings
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
    placement_fits,
    stage_dp,
    stage_dp_auto,
    submesh_shapes,
)

Link = namedtuple("Link", "bandwidth latency")  # stand-in for cluster.Link
INTRA = Link(bandwidth=100.0, latency=0.01)
INTER = Link(bandwidth=10.0, latency=0.1)

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_instance(seed: int):
    """A small random problem: candidates with random times and memory, some missing."""
    rng = random.Random(seed)
    L = rng.randint(1, 6)
    hosts, dph = rng.choice([(1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (3, 2), (1, 1)])
    table = {}
    for a in range(L):
        for b in range(a, L):
            for shape in submesh_shapes(hosts, dph):
                opts = []
                for _ in range(rng.choice([0, 1, 1, 2, 3])):
                    # Speedups from none to linear, so that pipelining is often worth it.
                    n = shape[0] * shape[1]
                    speedup = rng.choice([1, n ** 0.5, n ** 0.5, n])
                    f = rng.choice([0.5, 1, 1.5, 2, 3, 4.25]) * (b - a + 1) / speedup
                    opts.append(
                        StageCandidate(
                            (a, b), shape, (1, shape[0] * shape[1]), rng.random() < 0.5,
                            fwd_s=f, bwd_s=f * rng.choice([1, 2, 2.5]),
                            static_bytes=rng.randint(0, 10), act_bytes=rng.randint(0, 5),
                        )
                    )
                table[(a, b, shape)] = opts
    kwargs = dict(
        microbatches=rng.choice([1, 2, 3, 8]),
        mem_limit_bytes=rng.choice([math.inf, math.inf, 12, 20, 30]),
        stage_comm=rng.choice(["model", "ignore"]),
        schedule=rng.choice(["1f1b", "gpipe"]),
        max_stages=rng.choice([None, None, None, 2, 3]),
    )
    if rng.random() < 0.7:
        kwargs.update(
            cut_bytes=[rng.choice([0, 1, 5, 20, 80]) for _ in range(L - 1)], intra_link=INTRA, inter_link=INTER
        )
    return (L, hosts, dph, lambda a, b, s: table[(a, b, s)]), kwargs


def assert_valid_plan(r, L, hosts, dph, kwargs):
    stages = r.stages
    assert stages[0].layers[0] == 0 and stages[-1].layers[1] == L - 1
    for x, y in zip(stages, stages[1:]):
        assert y.layers[0] == x.layers[1] + 1
    assert sum(s.submesh[0] * s.submesh[1] for s in stages) == hosts * dph
    off = 0
    for o, s in zip(r.device_offsets, stages):
        assert o == off and placement_fits(s.submesh, o, hosts, dph)
        off += s.submesh[0] * s.submesh[1]
    S = len(stages)
    if kwargs.get("max_stages"):
        assert S <= kwargs["max_stages"]
    for j, s in enumerate(stages):
        held = held_microbatches(S - j, kwargs["microbatches"], kwargs["schedule"])
        assert s.static_bytes + held * s.act_bytes <= kwargs["mem_limit_bytes"]
        assert r.stage_mem_bytes[j] == s.static_bytes + held * s.act_bytes
    # The reported latency is the formula's value for the reported plan.
    # (A cut's transfers are on the critical path both ways, f + b; in the steady state the slower direction.)
    priced = [f + b for f, b in zip(r.send_fwd_s, r.send_bwd_s)] if r.stage_comm == "model" else [0.0] * (S - 1)
    necks = [max(f, b) for f, b in zip(r.send_fwd_s, r.send_bwd_s)] if r.stage_comm == "model" else [0.0] * (S - 1)
    assert r.latency_s == pytest.approx(pipeline_latency([s.time_s for s in stages], priced, r.microbatches, necks))


@SETTINGS
@given(st.integers(0, 10**9))
def test_dp_matches_brute_force(seed):
    (L, hosts, dph, cands), kwargs = random_instance(seed)
    try:
        bf = brute_force_stages(StageProblem(L, hosts, dph, **kwargs), cands)
    except NoFeasiblePlanError as e:
        with pytest.raises(NoFeasiblePlanError) as got:
            stage_dp(StageProblem(L, hosts, dph, **kwargs), cands)
        assert got.value.min_mem_bytes == e.min_mem_bytes
        return
    dp = stage_dp(StageProblem(L, hosts, dph, **kwargs), cands)
    assert dp.latency_s == pytest.approx(bf.latency_s, rel=1e-9)
    assert_valid_plan(dp, L, hosts, dph, kwargs)
    assert_valid_plan(bf, L, hosts, dph, kwargs)
    # Alpa's early stop and no pruning at all find the same optimum.
    full = stage_dp(StageProblem(L, hosts, dph, **kwargs), cands, DPOptions(t_max_search="all"))
    alpa = stage_dp(StageProblem(L, hosts, dph, **kwargs), cands, DPOptions(t_max_search="alpa"))
    assert full.latency_s == pytest.approx(dp.latency_s, rel=1e-9)
    assert alpa.latency_s == pytest.approx(dp.latency_s, rel=1e-9)
    assert len(full.diagnostics["t_max_tried"]) >= len(alpa.diagnostics["t_max_tried"])


def test_early_stop_prunes_but_keeps_answer():
    # Many distinct stage times; the optimum uses small ones, so the early stop must cut the loop short.
    def cands(a, b, sub):
        n = b - a + 1
        size = sub[0] * sub[1]
        return [StageCandidate((a, b), sub, sub, False, n / size + 0.01 * a, n / size, 0, 0)]

    full = stage_dp(StageProblem(6, 1, 4, microbatches=16), cands, DPOptions(t_max_search="all"))
    alpa = stage_dp(StageProblem(6, 1, 4, microbatches=16), cands, DPOptions(t_max_search="alpa"))
    bisect = stage_dp(StageProblem(6, 1, 4, microbatches=16), cands, DPOptions(t_max_search="bisect"))
    assert alpa.latency_s == full.latency_s == bisect.latency_s
    n_all = len(full.diagnostics["t_max_tried"])
    assert n_all == full.diagnostics["t_max_values"]
    assert len(alpa.diagnostics["t_max_tried"]) < n_all
    assert len(bisect.diagnostics["t_max_tried"]) < n_all


def mem_cands(a, b, sub):
    """Each layer needs 10 bytes of state and 1 byte of activation per microbatch, split over devices;
    remat halves activations at 1.3x the time."""
    n, size = b - a + 1, sub[0] * sub[1]
    return [
        StageCandidate((a, b), sub, sub, False, n / size, 2 * n / size, 10 * n / size, 4 * n / size),
        StageCandidate((a, b), sub, sub, True, 1.3 * n / size, 2.6 * n / size, 10 * n / size, 2 * n / size),
    ]


def test_infeasible_memory_names_smallest_need():
    kw = dict(microbatches=4, schedule="1f1b")
    with pytest.raises(NoFeasiblePlanError) as e:
        stage_dp(StageProblem(4, 1, 2, mem_limit_bytes=5, **kw), mem_cands)
    need = e.value.min_mem_bytes
    assert isinstance(e.value, ValueError)
    assert f"{need:.6g}" in str(e.value)
    assert "more devices" in str(e.value) and "memory limit" in str(e.value)
    # The brute force agrees on the number, and the number is tight: at it a plan exists, below it none does.
    with pytest.raises(NoFeasiblePlanError) as e2:
        brute_force_stages(StageProblem(4, 1, 2, mem_limit_bytes=5, **kw), mem_cands)
    assert e2.value.min_mem_bytes == need
    ok = stage_dp(StageProblem(4, 1, 2, mem_limit_bytes=need, **kw), mem_cands)
    assert max(ok.stage_mem_bytes) <= need
    with pytest.raises(NoFeasiblePlanError):
        stage_dp(StageProblem(4, 1, 2, mem_limit_bytes=need * (1 - 1e-9), **kw), mem_cands)
    # By hand: 2 stages of 2 layers on one device each: 20 static + held * 4 (remat); first stage holds 2.
    # One stage of 4 layers on 2 devices: 20 + 1 * 4 = 24. Four layers on (1,1)+(1,1) split 1/3: 30 + 1*6 = 36.
    assert need == 24


def test_memory_limit_forces_remat():
    free = stage_dp(StageProblem(4, 1, 2, microbatches=4), mem_cands)
    tight = stage_dp(StageProblem(4, 1, 2, microbatches=4, mem_limit_bytes=27), mem_cands)
    assert not any(s.remat for s in free.stages)
    assert any(s.remat for s in tight.stages)
    assert tight.latency_s > free.latency_s


def hand_cands(a, b, sub):
    # Layer times 2, 1, 1 (fwd only); a 2-device stage gets no speedup at all.
    t = sum([2.0, 1.0, 1.0][a : b + 1])
    return [StageCandidate((a, b), sub, sub, False, t, 0.0, 0, 0)]


def test_pricing_stage_comm_changes_the_cut():
    # Two hosts of one device: every cut is inter-host. A huge activation leaves layer 0.
    kw = dict(microbatches=4, cut_bytes=[48.0, 0.0], intra_link=INTRA, inter_link=Link(10.0, 0.05))
    alpa = stage_dp(StageProblem(3, 2, 1, stage_comm="ignore", **kw), hand_cands)
    ours = stage_dp(StageProblem(3, 2, 1, stage_comm="model", **kw), hand_cands)
    # Alpa balances compute: {0} | {1, 2} with T = 4 + 3 * 2 = 10, blind to a 2 * 4.85 s transfer.
    assert alpa.boundaries == (0, 1) and alpa.latency_s == pytest.approx(10.0)
    assert alpa.cut_links == ("inter",)
    assert alpa.stage_comm_s == pytest.approx(2 * (0.05 + 48 / 10))
    # Priced, the transfer crosses once each way on the critical path (2 x 4.85 s); in the steady state the two
    # directions overlap on the full-duplex link, so the slower one (4.85 s) paces the pipeline.
    assert alpa.latency_with_comm_s == pytest.approx(4 + 9.7 + 3 * 4.85)
    # Pricing the transfer moves the cut to the empty edge: {0, 1} | {2}, T = 4 + 0.1 + 3 * 3.
    assert ours.boundaries == (0, 2)
    assert ours.latency_s == pytest.approx(4 + 0.1 + 3 * 3)
    assert ours.latency_with_comm_s == ours.latency_s
    assert ours.latency_s < alpa.latency_with_comm_s


def test_cut_links_follow_in_order_placement():
    # 2 hosts x 2 devices, only single-layer (1,1) stages: four stages at offsets 0, 1, 2, 3.
    def cands(a, b, sub):
        return [StageCandidate((a, b), sub, sub, False, 1.0, 1.0, 0, 0)] if (a == b and sub == (1, 1)) else []

    r = stage_dp(StageProblem(4, 2, 2, microbatches=3, cut_bytes=[10.0, 20.0, 30.0], intra_link=INTRA,
                              inter_link=INTER), cands)
    assert r.device_offsets == (0, 1, 2, 3)
    assert r.cut_links == ("intra", "inter", "intra")
    expect = (0.01 + 10 / 100, 0.1 + 20 / 10, 0.01 + 30 / 100)
    assert r.send_fwd_s == pytest.approx(expect) and r.send_bwd_s == pytest.approx(expect)
    assert r.devices() == ((0,), (1,), (2,), (3,))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_formula_against_simulator(schedule):
    rng = random.Random(7)
    for _ in range(200):
        S, B = rng.randint(1, 5), rng.randint(1, 8)
        ratio = rng.choice([1.0, 2.0, 0.5])
        f = [rng.randint(1, 6) * 0.5 for _ in range(S)]
        sf = [rng.choice([0, 0, 0.5, 1, 4]) for _ in range(S - 1)]
        t = [x * (1 + ratio) for x in f]
        c = [x * (1 + ratio) for x in sf]
        formula = pipeline_latency(t, c, B)
        sim = simulate(f, [x * ratio for x in f], B, schedule, send_fwd_s=[x for x in sf],
                       send_bwd_s=[x * ratio for x in sf]).makespan
        if schedule == "gpipe":
            assert sim == pytest.approx(formula)  # exact when bwd is proportional to fwd everywhere
        elif not any(sf):
            assert sim <= formula + 1e-9  # 1F1B overlaps warm-up with slow stages
        uniform = simulate([f[0]] * S, [f[0] * ratio] * S, B, schedule).makespan
        assert uniform == pytest.approx(pipeline_latency([t[0]] * S, [], B))


def test_result_timeline_matches_latency_for_gpipe():
    r = stage_dp(StageProblem(4, 1, 4, microbatches=6, schedule="gpipe", cut_bytes=[1.0, 2.0, 3.0], intra_link=INTRA,
                              inter_link=INTER), mem_cands)
    tl = r.timeline()
    assert tl.num_stages == len(r.stages)
    # Every stage's bwd is 2x its fwd and every cut's gradient equals its activation in size: not the same
    # ratio, so the formula is only an estimate; it must still bound the pipeline from below here.
    assert tl.makespan >= sum(s.time_s for s in r.stages)
    assert tl.peak_mem_bytes == pytest.approx(r.stage_mem_bytes)


def test_stage_dp_auto_picks_best_microbatches():
    def cands(a, b, sub, B):
        n, size = b - a + 1, sub[0] * sub[1]
        work = n * 16.0 / B / size
        return [StageCandidate((a, b), sub, sub, False, work + 0.2, 2 * work + 0.2, 0, 0)]

    r = stage_dp_auto(StageProblem(4, 1, 4), cands, batch_size=48)
    table = r.diagnostics["by_microbatches"]
    assert sorted(table) == [1, 2, 4, 8, 16]
    for B, lat in table.items():
        one = stage_dp(StageProblem(4, 1, 4, microbatches=B), lambda a, b, s, _B=B: cands(a, b, s, _B))
        assert lat == pytest.approx(one.latency_s)
    assert r.latency_s == min(table.values()) and table[r.microbatches] == r.latency_s
    only = stage_dp_auto(StageProblem(4, 1, 4), cands, batch_size=48, choices=[3, 6])
    assert sorted(only.diagnostics["by_microbatches"]) == [3, 6]


def test_stage_dp_auto_all_infeasible():
    def cands(a, b, sub, B):
        return mem_cands(a, b, sub)

    with pytest.raises(NoFeasiblePlanError, match="every microbatch count"):
        stage_dp_auto(StageProblem(4, 1, 2, mem_limit_bytes=5), cands, batch_size=4)


def test_bad_inputs():
    flat = lambda a, b, s: [StageCandidate((a, b), s, s, False, 1.0, 1.0, 0, 0)]  # noqa: E731
    with pytest.raises(ValueError, match="cut_bytes"):
        stage_dp(StageProblem(3, 1, 2, microbatches=2, cut_bytes=[1.0], intra_link=INTRA, inter_link=INTER), flat)
    with pytest.raises(ValueError, match="intra_link"):
        stage_dp(StageProblem(3, 1, 2, microbatches=2, cut_bytes=[1.0, 2.0]), flat)
    with pytest.raises(ValueError, match="microbatches"):
        stage_dp(StageProblem(3, 1, 2, microbatches=0), flat)
    with pytest.raises(ValueError, match="stage_comm"):
        stage_dp(StageProblem(3, 1, 2, microbatches=2, stage_comm="nope"), flat)
    with pytest.raises(ValueError, match="non-negative"):
        stage_dp(StageProblem(2, 1, 1, microbatches=2),
                 lambda a, b, s: [StageCandidate((a, b), s, s, False, -1.0, 1.0, 0, 0)])
    with pytest.raises(NoFeasiblePlanError, match="candidates"):
        stage_dp(StageProblem(2, 1, 1, microbatches=2), lambda a, b, s: [])
