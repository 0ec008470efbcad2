"""Today's simulate (each stage placing its tasks in a tight loop, tasks built on first read, peaks by sorted starts
and ends) against the simulator as it was (tests/sim_reference.py) on random pipelines: the same floats, figure
for figure and task for task, ties included."""

from __future__ import annotations

import random

import pytest

from autopar_lab.simulate import SimOptions, simulate
from sim_reference import old_simulate


def times(rng, n, ties):
    # Small multiples of 0.5 (zeros included) make equal starts and ends, and so ties in every ordering, common.
    return [rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]) if ties else rng.uniform(0.0, 2.0) for _ in range(n)]


def instance(rng, schedule, ties):
    v = rng.choice([2, 3]) if schedule == "interleaved" else 1
    S = rng.randint(2 if v > 1 else 1, 5)
    B = S * rng.randint(1, 3) if v > 1 else rng.randint(1, 12)
    C = S * v
    kw = dict(fwd=times(rng, C, ties), bwd=times(rng, C, ties), B=B, schedule=schedule, v=v,
              sf=times(rng, C - 1, ties), sb=times(rng, C - 1, ties), act=times(rng, C, ties),
              static=times(rng, C, ties))
    if schedule == "zb-h1":
        kw["wgt"] = times(rng, C, ties)
    if schedule == "1f1b" and rng.random() < 0.5:
        # Deeper warm-ups as simulate_pipeline makes them (a stage warms up at least one more than the next).
        extra = [rng.randint(0, 2) for _ in range(S)]
        kw["warmup"] = [S - i + sum(extra[i:]) for i in range(S)]
    if rng.random() < 0.3:
        kw["hosts"] = [rng.randint(0, max(S - 2, 0)) for _ in range(S)]
    return kw


def run_new(kw):
    opts = SimOptions(act_bytes=kw["act"], static_bytes=kw["static"], warmup=kw.get("warmup"), hosts=kw.get("hosts"))
    return simulate(kw["fwd"], kw["bwd"], kw["B"], kw["schedule"], send_fwd_s=kw["sf"], send_bwd_s=kw["sb"],
                    wgrad_s=kw.get("wgt"), virtual_stages=kw["v"] if kw["v"] > 1 else None, options=opts)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "interleaved"])
@pytest.mark.parametrize("ties", [True, False])
def test_simulate_equals_the_old_simulator_to_the_bit_on_random_pipelines(schedule, ties):
    rng = random.Random(hash((schedule, ties)) % 1000)
    for _ in range(60):
        kw = instance(rng, schedule, ties)
        tasks, makespan, busy, peak, mem = old_simulate(**kw)
        tl = run_new(kw)
        assert tl.tasks == tasks, kw
        assert (tl.makespan, tl.busy_s, tl.peak_inflight, tl.peak_mem_bytes) == (makespan, busy, peak, mem), kw


def test_a_timeline_builds_its_tasks_once_and_compares_by_them():
    a = simulate([1, 2], [2, 1], 3, send_fwd_s=[0.5], send_bwd_s=[0.5])
    b = simulate([1, 2], [2, 1], 3, send_fwd_s=[0.5], send_bwd_s=[0.5])
    assert a.tasks is a.tasks and a == b and hash(a) == hash(b)
    assert a != simulate([1, 2], [2, 1], 3, send_fwd_s=[0.5], send_bwd_s=[0.25])
    assert len(a.tasks) == 2 * 2 * 3 + 2 * 3  # fwd and bwd on both stages, a send each way per microbatch
