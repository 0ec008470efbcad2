"""Context parallelism with ring attention: a priced strategy of attention's matmuls on long sequences (both
operands split along the sequence, the second passed around a ring overlapping compute), chosen where it pays."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

import autopar_lab as al
from autopar_lab.cluster import Cluster
from autopar_lab.graph import trace
from autopar_lab.sharding.ring import RING_KIND, RING_MIN_SEQ, is_ring, ring_exposed_s
from autopar_lab.sharding.strategies import strategies_for
from autopar_lab.solve import ilp
from autopar_lab.solve.intra import StrategyCache, build_problem, evaluate_intra, solve_intra

P3 = Cluster.preset("p3.16xlarge")


def test_ring_time_is_the_steps_not_hidden_by_compute():
    m = P3.logical_mesh((1, 8), (1, 8))
    step = m.ring_step(8e6, 1)  # one block of 8 MB to the neighbour: one hop's latency, not a whole all-gather's
    assert step == pytest.approx(m.axis_link(1).latency + 8e6 / m.axis_link(1).bandwidth)
    assert m.all_gather(64e6, 1) == pytest.approx(7 * step)  # a ring all-gather is n - 1 such steps
    assert ring_exposed_s(m, 64e6, 1, 0.0) == pytest.approx(7 * step)
    assert ring_exposed_s(m, 64e6, 1, 8 * step) == 0.0  # each step's compute covers its transfer
    assert ring_exposed_s(m, 64e6, 1, 4 * step) == pytest.approx(7 * step / 2)
    assert ring_exposed_s(P3.logical_mesh((1, 8), (8, 1)), 64e6, 1, 0.0) == 0.0  # one device along the axis


def _scores(seq):
    q = jax.ShapeDtypeStruct((1, seq, 4, 16), jnp.float16)
    return trace(lambda q, k: jnp.sum(jnp.einsum("bqhd,bkhd->bhqk", q, k)), q, q, batch_argnums=(0, 1))


def test_ring_strategies_exist_only_for_long_sequences():
    m = P3.logical_mesh((1, 8), (1, 8))
    dot = lambda g: next(g.op(o) for o in g.ops if g.op(o).primitive == "dot_general")  # noqa: E731
    assert not any(is_ring(s) for s in strategies_for(dot(_scores(1024)), m))
    rings = [s for s in strategies_for(dot(_scores(RING_MIN_SEQ)), m) if is_ring(s)]
    assert rings and all(s.collectives[0][0] == RING_KIND and s.collectives[0][1] == 1 for s in rings)
    # Q split on q, K split on k, the scores split on q: each device a row block against every K block in turn
    assert "RRS1R = RS1RR x RS1RR [ring@1]" in {s.name for s in rings}


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)])
def test_ilp_with_ring_strategies_equals_brute_force(shape):
    g = _scores(RING_MIN_SEQ)
    built = build_problem(g, P3.logical_mesh((1, 4), shape))
    assert any(is_ring(s) for ss in built.strats for s in ss)
    sol = ilp.solve_ilp(built.problem)
    brute = ilp.brute_force(built.problem)
    assert math.isclose(sol.objective, brute.objective, rel_tol=1e-9, abs_tol=1e-15)


def _allgather_instead(g, cache, strategies):
    """Each ring strategy replaced by the same split with the rotated operand gathered whole beforehand."""
    out = dict(strategies)
    for op, s in strategies.items():
        if is_ring(s):
            axis = s.collectives[0][1]
            keys = [(s.out_specs, tuple(x.without_axes((axis,)) if k == i else x for k, x in enumerate(s.in_specs)))
                    for i in range(2)]
            hit = [x for x in cache.strategies(g.op(op)) if x.key in keys and not is_ring(x)]
            assert hit, s.name
            out[op] = min(hit, key=lambda x: x.cost)
    return out


@pytest.mark.slow
def test_a_gpt_with_32k_tokens_plans_ring_attention_where_it_pays():
    g = al.models.get("gpt-tiny", num_layers=1, hidden_size=1024, seq_len=32768, batch_size=1, num_heads=8,
                      vocab_size=1024, dtype="float16").trace()
    m = P3.logical_mesh((1, 8), (1, 8))
    cache = StrategyCache(m)
    plan = solve_intra(g, m, cache=cache)
    ring = {op: s for op, s in plan.strategies.items() if is_ring(s)}
    assert {g.op(op).role for op in ring} == {"forward", "backward"}
    assert all(g.op(op).primitive == "dot_general" and g.op(op).layer == "layer_0" for op in ring)
    assert plan.collectives[RING_KIND]["count"] == len(ring)
    # the same plan with each ring replaced by gathering the other operand first (context parallelism by
    # all-gather, what the space held before): slower by the gathers the ring hides behind the block's compute
    gathered = evaluate_intra(g, m, _allgather_instead(g, cache, plan.strategies), cache=cache)
    assert plan.total_s < gathered.total_s
    assert plan.reshard_s < gathered.reshard_s
    # the plan splits the sequence everywhere, the batch of one cannot be split
    assert sum(s.comm_s for s in ring.values()) == 0.0  # 7 steps of 8 MiB hide behind 2.4 ms of compute each
