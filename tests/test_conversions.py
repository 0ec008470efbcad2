"""What a plan's conversions cost: a value several readers read in one layout is converted once (the price, the
validate records and XLA agree; the ILP's pairwise objective charges it per reader, an upper bound), a value read in
two layouts pays both, and the two conversions XLA moves across their reader (validate/xlamoves) are what XLA does.

Hand-built graphs on one axis of 8 devices; x is float32[4096, 64], B = 4096 * 64 * 4 bytes, the cost model's
buffer of each collective below (an all-to-all's HLO buffer is B / 8, one device's share).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from autopar_lab.cluster import Cluster
from autopar_lab.graph import trace
from autopar_lab.solve import ilp
from autopar_lab.solve.intra import build_problem, evaluate_intra
from autopar_lab.solve.intracache import StrategyCache
from autopar_lab.validate import (
    collectives_in_hlo,
    moves_seconds,
    predicted_collectives,
    replay_with_shardings,
    specs_from_strategies,
    summarize_collectives,
    total_bytes,
    without_moves,
    xla_moves,
)

N, D = 4096, 64
B = N * D * 4
MESH = Cluster.preset("p3.16xlarge").logical_mesh((1, 8), (8, 1))
needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs JAX_NUM_CPU_DEVICES=8")


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def two_readers(x):
    return jnp.tanh(x), jnp.exp(x)


def summed(a, b):
    return a + b


def column_sums(x):
    return jnp.sum(x, axis=0)


def _choose(graph, want):
    """Each operator's strategy by (input specs, output specs), looked up by operator id or primitive."""
    cache = StrategyCache(MESH)
    chosen = {}
    for op in graph.ops:
        node = graph.op(op)
        ins, outs = want[op] if op in want else want[node.primitive]
        chosen[op] = next(s for s in cache.strategies(node)
                          if [str(x) for x in s.in_specs] == ins and [str(x) for x in s.out_specs] == outs)
    return chosen


def _reader_layouts(tanh_in, exp_in):
    g = trace(two_readers, sds(N, D), batch_argnums=(0,))
    chosen = _choose(g, {0: ([], ["S0R"]), 1: ([tanh_in], [tanh_in]), 2: ([exp_in], [exp_in]),
                         3: ([tanh_in], []), 4: ([exp_in], [])})
    return g, chosen


def _ilp_objective(graph, chosen) -> float:
    built = build_problem(graph, MESH)
    choice = [next(k for k, s in enumerate(built.strats[i]) if s.key == chosen[op].key)
              for i, op in enumerate(built.nodes)]
    return ilp.evaluate(built.problem, choice).objective


def _compiled(graph, fn, args, chosen) -> dict:
    out_specs, output_specs = specs_from_strategies(graph, chosen)
    replay = replay_with_shardings(graph, fn, args, out_specs, MESH.to_jax_mesh(jax.devices()[:8]),
                                   output_specs=output_specs)
    return collectives_in_hlo(replay.jit().lower(*args).compile().as_text())


def test_one_value_two_readers_gather_alike_is_priced_as_one_gather():
    g, chosen = _reader_layouts("RR", "RR")
    plan = evaluate_intra(g, MESH, chosen)
    gather = MESH.all_gather(B, 0)
    assert plan.collectives == {"all_gather": {"count": 1, "bytes": B}}
    assert plan.reshard_s == pytest.approx(gather, rel=1e-12)
    records = predicted_collectives(g, chosen, MESH)
    assert [(r["kind"], r["hlo_bytes"], r["source"]) for r in records] == [("all_gather", B, "reshard")]
    # The ILP's pairwise edges charge the gather to each reader: its objective is the price plus the gather it
    # counted twice (no parameter here, so no memory tie-break in the objective).
    assert _ilp_objective(g, chosen) - plan.total_s == pytest.approx(gather, rel=1e-9)


def test_one_value_read_in_two_layouts_pays_both_conversions():
    g, chosen = _reader_layouts("RR", "RS0")
    plan = evaluate_intra(g, MESH, chosen)
    assert plan.collectives == {"all_gather": {"count": 1, "bytes": B}, "all_to_all": {"count": 1, "bytes": B}}
    assert plan.reshard_s == pytest.approx(MESH.all_gather(B, 0) + MESH.all_to_all(B, 0), rel=1e-12)
    assert _ilp_objective(g, chosen) == pytest.approx(plan.total_s, rel=1e-12)  # nothing shared, nothing over


@needs8
@pytest.mark.parametrize("exp_in", ["RR", "RS0"])
def test_xla_compiles_the_conversions_the_price_counts(exp_in):
    g, chosen = _reader_layouts("RR", exp_in)
    records = predicted_collectives(g, chosen, MESH)
    compiled = _compiled(g, two_readers, (sds(N, D),), chosen)
    assert summarize_collectives(records) == compiled
    assert xla_moves(g, chosen, records, MESH.shape) == []


@needs8
def test_an_elementwise_sum_of_two_gathered_values_is_gathered_once_by_xla():
    g = trace(summed, sds(N, D), sds(N, D), batch_argnums=(0, 1))
    chosen = _choose(g, {"parameter": ([], ["S0R"]), "add": (["RR", "RR"], ["RR"]), "output": (["RR"], [])})
    records = predicted_collectives(g, chosen, MESH)
    assert total_bytes(summarize_collectives(records)) == 2 * B  # the plan gathers both inputs
    moves = xla_moves(g, chosen, records, MESH.shape)
    assert [(m["rule"], m["kind"], m["kept"]) for m in moves] == [("commuted", "all_gather", 0.0)]
    compiled = _compiled(g, summed, (sds(N, D), sds(N, D)), chosen)
    assert compiled["all_gather"] == {"count": 1, "bytes": B}  # XLA adds, then gathers the sum
    assert summarize_collectives(without_moves(records, moves)) == compiled
    assert moves_seconds(moves, MESH) == pytest.approx(MESH.all_gather(B, 0), rel=1e-12)


@needs8
def test_a_reduction_of_a_gathered_value_is_reduced_first_by_xla():
    g = trace(column_sums, sds(N, D), batch_argnums=(0,))
    chosen = _choose(g, {"parameter": ([], ["RS0"]), "reduce_sum": (["RR"], ["R"]), "output": (["R"], [])})
    records = predicted_collectives(g, chosen, MESH)
    moves = xla_moves(g, chosen, records, MESH.shape)
    assert [(m["rule"], m["kind"], m["kept"]) for m in moves] == [("reduced first", "all_gather", 1 / N)]
    compiled = _compiled(g, column_sums, (sds(N, D),), chosen)
    assert compiled["all_gather"] == {"count": 1, "bytes": D * 4}  # the [64] sums gathered, not x
    assert summarize_collectives(without_moves(records, moves)) == compiled
    assert moves_seconds(moves, MESH) == pytest.approx(MESH.all_gather(B, 0) - MESH.all_gather(D * 4, 0))


def test_a_conversion_another_reader_needs_is_not_moved():
    """x + y, x gathered for the add and for exp too: the gathered copy of x is made anyway, nothing moves."""
    def fn(x, y):
        return x + y, jnp.exp(x)

    g = trace(fn, sds(N, D), sds(N, D), batch_argnums=(0, 1))
    chosen = _choose(g, {"parameter": ([], ["S0R"]), "add": (["RR", "RR"], ["RR"]), "exp": (["RR"], ["RR"]),
                         "output": (["RR"], [])})
    records = predicted_collectives(g, chosen, MESH)
    assert total_bytes(summarize_collectives(records)) == 2 * B
    assert xla_moves(g, chosen, records, MESH.shape) == []
