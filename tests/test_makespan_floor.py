"""``simulate.makespan_floor``, the bound that lets the planner skip simulating a plan that cannot beat the best
simulated so far (issue 36): below every simulated makespan on random pipelines (every schedule, warm-ups, shared
hosts, memory), and equal to the makespan where the hand formula says so."""

from __future__ import annotations

import random

import pytest

from autopar_lab.simulate import SimOptions, makespan_floor, simulate


def random_pipeline(seed: int):
    rng = random.Random(seed)
    schedule = rng.choice(["1f1b", "1f1b", "gpipe", "zb-h1", "interleaved"])
    v = 2 if schedule == "interleaved" else 1
    S = rng.randint(1, 5) if schedule != "interleaved" else rng.randint(2, 4)
    B = rng.choice([1, 2, 3, 4, 8]) if schedule != "interleaved" else S * rng.choice([1, 2])
    C = S * v
    fwd = [rng.uniform(0.1, 3) for _ in range(C)]
    bwd = [f * rng.uniform(0.5, 3) for f in fwd]
    sends = [rng.choice([0.0, 0.0, rng.uniform(0, 2)]) for _ in range(C - 1)]
    back = [x * rng.uniform(0.5, 1.5) for x in sends]
    wgrad = [rng.uniform(0.1, 1) for _ in range(C)] if schedule == "zb-h1" else None
    opts = SimOptions()
    if schedule == "1f1b" and rng.random() < 0.5:
        extra = [rng.randint(0, 2) for _ in range(S)]  # deeper warm-ups as the planner makes them (pricing.price)
        opts = opts.with_warmup([S - i + sum(extra[i:]) for i in range(S)])
    if rng.random() < 0.3:
        opts = SimOptions(hosts=[rng.randint(0, 1) for _ in range(S)], warmup=opts.warmup)
    kw = dict(send_fwd_s=sends, send_bwd_s=back, wgrad_s=wgrad, virtual_stages=v if v > 1 else None)
    return fwd, bwd, B, schedule, kw, opts


@pytest.mark.parametrize("seed", range(200))
def test_the_floor_is_below_the_simulated_makespan(seed):
    fwd, bwd, B, schedule, kw, opts = random_pipeline(seed)
    makespan = simulate(fwd, bwd, B, schedule, options=opts, **kw).makespan
    assert makespan_floor(fwd, bwd, B, schedule, **kw) <= makespan * (1 + 1e-12)


@pytest.mark.parametrize("S,B", [(1, 1), (3, 4), (4, 16)])
def test_uniform_1f1b_floor_is_the_makespan(S, B):
    """Uniform stages, free transfers: 1F1B's makespan is (B + S - 1)(f + b), and so is the floor (the last stage:
    (S - 1) f in, B (f + b) busy, (S - 1) b back)."""
    f, b = 1.5, 2.5
    assert makespan_floor([f] * S, [b] * S, B) == pytest.approx((B + S - 1) * (f + b))
    assert simulate([f] * S, [b] * S, B).makespan == pytest.approx((B + S - 1) * (f + b))
