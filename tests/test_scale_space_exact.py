"""The "scale" planning space against the full space on random small instances (issue 36 item 2): the space keeps
whole-host submeshes of a power-of-two host count (``pricing.space.planning_submeshes``), and the stage DP over it
(counted in hosts, ``inter.problem.by_hosts``) against the brute force over every Alpa submesh.

The space is an approximation, not exact in general: what holds is that its optimum is never below the full space's
(it is a restriction), and equal to it whenever the full space's optimum uses only submeshes the space keeps (the
condition under which the cut loses nothing). Both are checked here, plan by plan."""

from __future__ import annotations

import math
import random

import pytest
from test_inter import INTER, INTRA

import autopar_lab as al
from autopar_lab.pricing import planning_submeshes
from autopar_lab.solve.inter import (NoFeasiblePlanError, StageCandidate, StageProblem, brute_force_stages, problem,
                                     stage_dp, submesh_shapes)


def full_instance(seed: int):
    """Candidates on every Alpa submesh of 4 hosts x 2 devices (the scale space keeps (1, 2), (2, 2), (4, 2) of
    (1, 1), (1, 2), (2, 2), (3, 2), (4, 2)); times scale from none to linearly with the devices."""
    rng = random.Random(seed)
    L, hosts, dph = rng.randint(1, 5), 4, 2
    table = {}
    for a in range(L):
        for b in range(a, L):
            for shape in submesh_shapes(hosts, dph):
                n = shape[0] * shape[1]
                opts = []
                for _ in range(rng.choice([1, 1, 2])):
                    f = rng.uniform(0.5, 3) * (b - a + 1) / rng.choice([1, n ** 0.5, n ** 0.8, n])
                    opts.append(StageCandidate((a, b), shape, shape, False, f, 2 * f, rng.randint(0, 10) / n,
                                               rng.randint(0, 4)))
                table[(a, b, shape)] = opts
    kw = dict(microbatches=rng.choice([1, 2, 4, 8]), mem_limit_bytes=rng.choice([math.inf, 12, 20]),
              schedule=rng.choice(["1f1b", "gpipe"]), cut_bytes=[rng.choice([0, 5, 40]) for _ in range(L - 1)],
              intra_link=INTRA, inter_link=INTER)
    return L, hosts, dph, table, kw


def test_the_space_s_submeshes_on_the_instances_cluster():
    """What the scale space keeps of a 4-host cluster of 2 devices: whole hosts, 1, 2 and 4 of them."""
    c = al.Cluster.preset("p3.16xlarge", hosts=4).with_(devices_per_host=2)
    assert planning_submeshes(c, 64, "scale") == [(1, 2), (2, 2), (4, 2)]


@pytest.mark.parametrize("seed", range(60))
def test_the_scale_space_optimum_against_the_full_space(seed):
    L, hosts, dph, table, kw = full_instance(seed)
    kept = {(1, 2), (2, 2), (4, 2)}
    sp = StageProblem(L, hosts, dph, **kw)
    full_fn = lambda a, b, s: table[(a, b, s)]  # noqa: E731
    scale_fn = lambda a, b, s: table[(a, b, s)] if s in kept else []  # noqa: E731
    try:
        full = brute_force_stages(sp, full_fn)
    except NoFeasiblePlanError:
        with pytest.raises(NoFeasiblePlanError):
            stage_dp(sp, scale_fn)
        return
    assert problem.by_hosts(problem.build_problem(sp, scale_fn)).unit == dph  # counted in hosts
    try:
        scale = stage_dp(sp, scale_fn)
    except NoFeasiblePlanError:
        assert any(st.submesh not in kept for st in full.stages)  # only the dropped submeshes fit
        return
    assert scale.latency_s >= full.latency_s * (1 - 1e-12)
    assert all(st.submesh in kept for st in scale.stages)
    if all(st.submesh in kept for st in full.stages):
        assert scale.latency_s == pytest.approx(full.latency_s, rel=1e-12)
