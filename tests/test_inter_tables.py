"""The stage DP's vectorised inner parts against plain reference loops, on random memory-limited instances: the
candidate tables (a running minimum over each candidate's largest stage count) against a scan of every candidate at
every stage count, and the layered recurrence (evaluated only where a submesh can be placed, in a band of layer
ranges) against the full min over every end layer and shape."""

from __future__ import annotations

import dataclasses
import math
import random
from types import SimpleNamespace as NS

import numpy as np
import pytest

from autopar_lab.solve import inter
from autopar_lab.solve.inter import dp, problem

LINKS = dict(intra_link=NS(bandwidth=1e9, latency=1e-5), inter_link=NS(bandwidth=1e8, latency=1e-4))


def random_problem(rng: random.Random):
    L, N, M = rng.randint(1, 9), rng.choice([1, 2, 3]), rng.choice([1, 2, 4])
    longest = rng.choice([1, 2, 3, 100])  # ranges longer than this have no candidate (a band)

    def cands(a, b, sub):
        n = rng.randint(0, 4) if b - a < longest else 0
        return [inter.StageCandidate((a, b), sub, sub, bool(r % 2), rng.choice([1.0, 2.0, 0.5 * (b - a + 1)]),
                                     rng.choice([0.0, 1.0]), rng.choice([0, 1e9, 3e9]),
                                     rng.choice([0, 3e8, 5e8, 7.7e8, 1e9])) for r in range(n)]

    B, mem = rng.choice([1, 2, 3, 4, 8, 16]), rng.choice([math.inf, 3.5e9, 4e9, 5.25e9, 6e9])
    cut_bytes = [rng.choice([0, 1e8]) for _ in range(L - 1)]
    return problem.build_problem(inter.StageProblem(L, N, M, microbatches=B, mem_limit_bytes=mem, cut_bytes=cut_bytes,
                                                    stage_comm="model", max_stages=None,
                                                    schedule=rng.choice(["1f1b", "gpipe"]), **LINKS), cands)


def reference_layered_dp(p, stage_cost, cut, valid, size, combine):
    L, NM, SH = p.num_layers, p.num_devices, len(p.shapes)
    F_prev = np.full((L + 1, NM + 1), np.inf)
    F_prev[L, 0] = 0.0
    Fs, args = [F_prev], [None]
    for s in range(1, p.max_stages + 1):
        F, arg = np.full((L + 1, NM + 1), np.inf), np.zeros((L, NM + 1), dtype=np.int64)
        for k in range(L):
            for d in range(NM + 1):
                best, best_flat = math.inf, 0
                for i in range(L):
                    for sh in range(SH):
                        if not (valid[sh, d] and d >= size[sh]):
                            continue
                        v = combine(stage_cost[k, i, sh, s - 1] + cut[k, d], F_prev[i + 1, d - size[sh]])
                        if v < best:
                            best, best_flat = v, i * SH + sh
                F[k, d], arg[k, d] = best, best_flat
        Fs.append(F)
        args.append(arg)
        F_prev = F
    return Fs, args


@pytest.mark.parametrize("seed", range(60))
def test_tables_equal_a_scan_of_every_candidate(seed):
    p = random_problem(random.Random(seed))
    got = problem.candidate_tables(p)
    want = problem.pinned_tables(p)  # without pins: the plain loop over every candidate and stage count
    np.testing.assert_array_equal(got.best_time, want.best_time)
    np.testing.assert_array_equal(got.min_req(), want.min_req())
    for k, i, sh, s in zip(*np.nonzero(np.isfinite(want.best_time))):
        assert got.index(k, i, sh, s + 1) == want.index(k, i, sh, s + 1)


@pytest.mark.parametrize("seed", range(40))
def test_layered_dp_equals_the_full_minimum(seed):
    rng = random.Random(1000 + seed)
    p = random_problem(rng)
    tables = problem.candidate_tables(p)
    valid, size, cut, _neck = problem.structure(p)
    t_max = rng.choice([math.inf, 1.0, 2.0])
    masked = np.where(tables.best_time <= t_max, tables.best_time, np.inf)
    for combine, cost in ((np.add, masked), (np.maximum, tables.min_req())):
        got_F, got_arg = dp.layered_dp(p, cost, cut, valid, size, combine)
        want_F, want_arg = reference_layered_dp(p, cost, cut, valid, size, combine)
        for s in range(1, p.max_stages + 1):  # the DP keeps each F table's first row (what a plan reads)
            np.testing.assert_array_equal(got_F[s], want_F[s][0])
            np.testing.assert_array_equal(got_arg[s], want_arg[s])
    # t_max given to the DP is the same as masking the table first, and a table laid out [k, i, sh, s] in memory
    # (pins build one so) gives what candidate_tables' [s, sh, k, i] layout gives
    got_F, got_arg = dp.layered_dp(p, tables.best_time, cut, valid, size, np.add, t_max=t_max)
    want_F, _ = dp.layered_dp(p, masked, cut, valid, size, np.add)
    other_F, other_arg = dp.layered_dp(p, np.ascontiguousarray(tables.best_time), cut, valid, size, np.add, t_max=t_max)
    for s in range(1, p.max_stages + 1):
        np.testing.assert_array_equal(got_F[s], want_F[s])
        np.testing.assert_array_equal(got_F[s], other_F[s])
        np.testing.assert_array_equal(got_arg[s], other_arg[s])


@pytest.mark.parametrize("seed", range(40))
def test_the_dp_structure_equals_its_definition_offset_by_offset(seed):
    """The placement table and the cut terms built per link (columns) equal placement_fits, priced_cut and
    priced_neck evaluated at every (layer, free devices) as defined, to the bit, for every schedule's weight."""
    rng = random.Random(seed)
    p = random_problem(rng)
    if rng.random() < 0.5:
        p = dataclasses.replace(p, schedule="interleaved", virtual_stages=2)
    if rng.random() < 0.2:
        p = dataclasses.replace(p, stage_comm="ignore")
    valid, size, cut, neck = problem.structure(p)
    L, NM = p.num_layers, p.num_devices
    assert list(size) == [n * m for n, m in p.shapes]
    for sh, shape in enumerate(p.shapes):
        assert [bool(v) for v in valid[sh]] == [inter.placement_fits(shape, NM - d, p.hosts, p.devices_per_host)
                                                for d in range(NM + 1)]
    kappa = p.coefficients[1]
    want_cut, want_neck = np.zeros((L, NM + 1)), np.zeros((L, NM + 1))
    for k in range(1, L):
        for d in range(1, NM):
            want_cut[k, d] = kappa * p.priced_cut(k, NM - d)
            want_neck[k, d] = kappa * p.priced_neck(k, NM - d)
    assert np.array_equal(cut, want_cut) and np.array_equal(neck, want_neck)
