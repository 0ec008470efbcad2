"""The stage DP with its device axis counted in hosts (``inter.problem.by_hosts``, issue 36): where every submesh with a
candidate is whole hosts (the "scale" planning space), the DP over hosts must give the very plan of the DP over devices
restricted to the same submeshes, and the brute force's optimum."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from test_dp_pruning import outcome
from test_inter import INTER, INTRA

import autopar_lab as al
from autopar_lab.solve.inter import (DPOptions, NoFeasiblePlanError, StageCandidate, StageConstraints, StageProblem,
                                     brute_force_stages, problem, stage_dp, submesh_shapes)


def whole_host_instance(seed: int):
    """A random problem whose candidates are on whole-host submeshes only ((n, M), n = 1..hosts), the sub-host shapes
    left without any: random times, memory, limits, cut sizes, schedules (the stage-count ones included)."""
    rng = random.Random(seed)
    L = rng.randint(1, 6)
    hosts, dph = rng.choice([(1, 2), (2, 2), (2, 4), (3, 2), (3, 4), (4, 2), (4, 8), (2, 8)])
    table = {}
    for a in range(L):
        for b in range(a, L):
            for shape in submesh_shapes(hosts, dph):
                opts = []
                if shape[1] == dph:
                    for _ in range(rng.choice([0, 1, 1, 2, 3])):
                        n = shape[0] * shape[1]
                        f = rng.choice([0.5, 1, 1.5, 2, 3]) * (b - a + 1) / rng.choice([1, n ** 0.5, n])
                        opts.append(StageCandidate((a, b), shape, (shape[0], shape[1]), rng.random() < 0.5,
                                                   fwd_s=f, bwd_s=f * rng.choice([1, 2, 2.5]),
                                                   static_bytes=rng.randint(0, 10), act_bytes=rng.randint(0, 5)))
                table[(a, b, shape)] = opts
    schedule = rng.choice(["1f1b", "1f1b", "gpipe", "zb-h1", "interleaved"])
    kw = dict(microbatches=rng.choice([1, 2, 4, 8]), mem_limit_bytes=rng.choice([math.inf, 12, 20, 30]),
              stage_comm=rng.choice(["model", "ignore"]), schedule=schedule,
              max_stages=rng.choice([None, None, 2, 3]))
    if schedule == "interleaved":
        kw["virtual_stages"] = 2
    if rng.random() < 0.8:
        kw.update(cut_bytes=[rng.choice([0, 1, 5, 20, 80]) for _ in range(L - 1)], intra_link=INTRA,
                  inter_link=INTER)
    return L, hosts, dph, (lambda a, b, s: table[(a, b, s)]), kw


@pytest.mark.parametrize("seed", range(120))
def test_the_dp_over_hosts_gives_the_dp_over_devices_plan(seed):
    L, hosts, dph, fn, kw = whole_host_instance(seed)
    sp = StageProblem(L, hosts, dph, **kw)
    p = problem.build_problem(sp, fn)
    if p.shapes:  # the instance is one the host count applies to
        assert problem.by_hosts(p).unit == dph and problem.by_hosts(p).columns == hosts
    by_devices = outcome(lambda: stage_dp(sp, fn, DPOptions(host_columns=False)))
    assert outcome(lambda: stage_dp(sp, fn)) == by_devices
    assert outcome(lambda: stage_dp(sp, fn, DPOptions(prune=False))) == by_devices
    if by_devices is not None and by_devices[0] != "infeasible":
        if kw["schedule"] in ("1f1b", "gpipe"):  # the brute force's optimum (its formula for the stage-count ones is
            brute = brute_force_stages(sp, fn)      # the same; kept to the cheap schedules for time)
            assert by_devices[0] == pytest.approx(brute.latency_s, rel=1e-12)
        for bound in (by_devices[0] * 1.5, math.nextafter(by_devices[0], math.inf), by_devices[0]):
            want = outcome(lambda: stage_dp(sp, fn, DPOptions(upper_bound=bound, host_columns=False)))
            assert outcome(lambda: stage_dp(sp, fn, DPOptions(upper_bound=bound))) == want


def test_a_sub_host_candidate_keeps_the_device_columns():
    """One candidate on a (1, 1) submesh and the DP must count devices again (a stage may start inside a host)."""
    fn = lambda a, b, s: [StageCandidate((a, b), s, s, False, 1.0, 1.0, 0, 0)]  # noqa: E731
    p = problem.build_problem(StageProblem(2, 2, 4, microbatches=2), fn)
    assert problem.by_hosts(p) is p and p.columns == 8
    only_hosts = lambda a, b, s: fn(a, b, s) if s[1] == 4 else []  # noqa: E731
    q = problem.build_problem(StageProblem(2, 2, 4, microbatches=2), only_hosts)
    assert problem.by_hosts(q).columns == 2


def test_host_columns_place_stages_at_device_offsets():
    """Two layers on 2 hosts of 4: each on one host, the second at device 4 (not host 1), its cut an inter-host one
    priced as latency + bytes / bandwidth over the inter link: 2 + 2 + 2 (0.1 + 40 / 10) + (2 - 1) * (0.1 + 4)."""
    fn = lambda a, b, s: ([StageCandidate((a, b), s, s, False, 1.0 * (b - a + 1), 1.0 * (b - a + 1), 0, 0)]  # noqa: E731
                          if s == (1, 4) else [])
    r = stage_dp(StageProblem(2, 2, 4, microbatches=2, cut_bytes=[40.0], intra_link=INTRA, inter_link=INTER), fn)
    assert r.device_offsets == (0, 4) and r.cut_links == ("inter",)
    assert r.latency_s == pytest.approx(2 + 2 + 2 * 4.1 + 4.1)


@pytest.mark.parametrize("seed", range(40))
def test_pinned_stages_over_hosts_give_the_device_columns_plan(seed):
    """Pins (the cuts, or each stage's submesh) go through the DP's pinned tables: counted in hosts too."""
    L, hosts, dph, fn, kw = whole_host_instance(seed)
    try:
        free = stage_dp(StageProblem(L, hosts, dph, **kw), fn, DPOptions(host_columns=False))
    except NoFeasiblePlanError:
        return
    pins = (StageConstraints(cuts=free.boundaries[1:]) if seed % 2 else
            StageConstraints(submeshes=tuple(s.submesh for s in free.stages)))
    sp = StageProblem(L, hosts, dph, **{**kw, "constraints": pins})
    assert outcome(lambda: stage_dp(sp, fn)) == outcome(lambda: stage_dp(sp, fn, DPOptions(host_columns=False)))


@pytest.mark.slow
def test_a_deep_model_in_the_scale_space_plans_the_same_over_hosts_and_devices():
    """gpt-tiny with 24 layers (planned on its shallow copy) on 16 DGX A100 hosts in the "scale" space: the cost
    table's stage candidates, one microbatch count, the DP over hosts and over devices give the same plan."""
    c = al.Cluster.parse("dgx-a100:16")
    model = al.models.get("gpt-tiny", num_layers=24, batch_size=256)
    table = al.CostTable.build(model, c, space="scale", workers=1)
    mem = float(c.device.memory_bytes)
    table.solve_planned(mem, 16)
    L = len(table.layer_names)
    assert L >= 24
    sp = dataclasses.replace(StageProblem.on(c, num_layers=L), mem_limit_bytes=mem, microbatches=16,
                             cut_bytes=[x / 16 for x in table.cut_bytes])
    cands = table.candidate_fn(16, mem)
    assert problem.by_hosts(problem.build_problem(sp, cands)).unit == 8
    got = outcome(lambda: stage_dp(sp, cands))
    assert got == outcome(lambda: stage_dp(sp, cands, DPOptions(host_columns=False)))
    assert got is not None and got[0] != "infeasible"
