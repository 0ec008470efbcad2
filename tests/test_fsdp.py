"""ZeRO-3 / FSDP in the intra-op ILP: parameters stored sharded over the data axis, gathered in forward and again in
backward, gradients reduce-scattered; the memory constraint sees the saving and the gathered copy; plans say it
in PartitionSpec terms, override to it, export it and run it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.cluster import Cluster
from autopar_lab.graph import trace
from autopar_lab.memory import memory_breakdown
from autopar_lab.parallelism import fsdp_params, with_fsdp
from autopar_lab.sharding.fsdp import fsdp_spec, gathered_params, is_param_input
from autopar_lab.sharding.spec import ShardingSpec as S
from autopar_lab.solve import ilp
from autopar_lab.solve.intra import (MEMORY_TIE_BREAK_S_PER_BYTE, StrategyCache, build_problem, evaluate_intra,
                                     solve_intra)

P3 = Cluster.preset("p3.16xlarge")
f32 = jnp.float32


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, f32)


def _mlp_step(H=64, B=64):
    """A two-matmul MLP trained with SGD: the smallest graph with forward, backward and update readers."""
    def step(params, x):
        def loss(p):
            return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])
        grads = jax.grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    return trace(step, {"w1": sds(H, H), "w2": sds(H, H)}, sds(B, H), batch_argnums=(1,))


def _choice(built, strategies):
    return [next(k for k, s in enumerate(built.strats[i]) if s.key == strategies[op].key)
            for i, op in enumerate(built.nodes)]


def _tie(g, chosen):
    return sum(MEMORY_TIE_BREAK_S_PER_BYTE * s.mem_bytes for op, s in chosen.items()
               if g.op(op).primitive == "parameter" and g.tensor(g.op(op).outputs[0]).kind in ("param", "opt_state"))


@pytest.fixture(scope="module")
def small_gpt():
    spec = al.models.get("gpt-tiny", num_layers=1, hidden_size=256, seq_len=32, batch_size=64, num_heads=4,
                         vocab_size=256)
    return spec.trace()


def test_fsdp_spec_adds_the_data_axes_where_they_divide():
    assert str(fsdp_spec(S.parse("RR"), (64, 32), (8, 1), (0,))) == "S0R"
    assert str(fsdp_spec(S.parse("RS1"), (64, 32), (2, 4), (0,))) == "S0S1"
    assert str(fsdp_spec(S.parse("RR"), (6, 32), (8, 1), (0,))) == "RS0"  # 6 rows do not split 8 ways
    assert fsdp_spec(S.parse("R"), (6,), (8, 1), (0,)) is None
    assert fsdp_spec(S.parse("S0R"), (64, 32), (8, 1), (0,)) == S.parse("S0R")  # already stored sharded
    assert fsdp_spec(S.parse("RR"), (64, 32), (1, 8), (0,)) == S.parse("RR")  # a size-1 axis splits nothing


def test_a_gathered_parameter_is_gathered_again_in_backward_and_the_ilp_agrees_with_the_plan(small_gpt):
    g = small_gpt
    m = P3.logical_mesh((1, 8), (8, 1))
    cache = StrategyCache(m)
    free = solve_intra(g, m, cache=cache)  # data parallel, weights whole (ZeRO-2: the update sharded)
    assert gathered_params(g, free.strategies, (8, 1)) == []
    # The same plan with every weight stored sharded over the data axis, readers unchanged: FSDP.
    chosen = dict(free.strategies)
    for op in g.ops:
        if is_param_input(g, op):
            t = g.tensor(g.op(op).outputs[0])
            spec = fsdp_spec(chosen[op].out_specs[0], t.shape, (8, 1), (0,))
            if spec is not None:
                chosen[op] = next(s for s in cache.strategies(g.op(op)) if s.out_specs[0] == spec)
    fsdp = evaluate_intra(g, m, chosen, cache=cache)
    gp = {p.path: p for p in gathered_params(g, fsdp.strategies, (8, 1))}
    w = gp["args[0]['layers'][0]['fc1']['w']"]
    assert w.stored == S.parse("S0R") and w.axes == (0,) and w.roles == ("forward", "backward")
    assert w.describe() == ("ZeRO-3/FSDP: stored P('x', None), all-gathered over x to P(None, None) in forward "
                            "and backward")
    assert w.stored_bytes * 8 == w.full_bytes == 256 * 1024 * 4
    # Each weight read by a forward and a backward matmul is gathered twice (the forward's copy was freed).
    twice = [p for p in gp.values() if p.roles == ("forward", "backward")]
    assert len(twice) >= 4
    extra = fsdp.collectives["all_gather"]["count"] - free.collectives.get("all_gather", {"count": 0})["count"]
    assert extra >= 2 * len(twice)
    assert fsdp.reshard_s > free.reshard_s and fsdp.static_bytes < free.static_bytes
    # The ILP (one edge per reader) and the plan's recomputation (one conversion per tensor, spec and pass) count
    # the weights' gathers alike: storing them sharded moves both by the same seconds. (They differ elsewhere by
    # the readers of one activation sharing a conversion, the same in both plans.)
    built = build_problem(g, m, cache=cache)
    gap = [ilp.evaluate(built.problem, _choice(built, p.strategies)).objective - p.total_s - _tie(g, p.strategies)
           for p in (free, fsdp)]
    assert gap[1] == pytest.approx(gap[0], rel=1e-9, abs=1e-15)


def test_the_memory_rows_count_the_gathered_copy_at_its_reader():
    g = _mlp_step()
    m = P3.logical_mesh((1, 8), (8, 1))
    built = build_problem(g, m, mem_limit_bytes=1e30)
    terms = built.problem.mem_terms
    readers = {built.nodes[k] for k, pt in enumerate(terms) if pt}
    w = {op for op in g.ops if is_param_input(g, op)}
    assert readers and all(any(g.tensor(t).producer in w for t in g.op(v).inputs) for v in readers)
    # a forward matmul reading w1 whole: its point carries 64 x 64 x 4 bytes for its RR strategies
    k = next(k for k, pt in enumerate(terms) if pt and g.op(built.nodes[k]).role == "forward")
    (node, need), = [t for t in terms[k] if True][:1]
    assert node == k and need.max() == 64 * 64 * 4 and need.min() == 64 * 64 * 4 / 8


@pytest.mark.parametrize("shape", [(4, 1), (2, 2)])
def test_ilp_with_the_memory_terms_equals_brute_force(shape):
    g = trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)), sds(16, 16), sds(16, 16), batch_argnums=(1,))
    m = P3.logical_mesh((1, 4), shape)
    free = build_problem(g, m, mem_limit_bytes=1e30)
    smallest = ilp.solve_min_memory(free.problem).peak_mem
    for limit in (1e30, smallest * 1.2, smallest):
        built = build_problem(g, m, mem_limit_bytes=limit)
        assert built.problem.mem_terms is not None
        sol = ilp.solve_ilp(built.problem)
        brute = ilp.brute_force(built.problem)
        assert math.isclose(sol.objective, brute.objective, rel_tol=1e-9, abs_tol=1e-15)


@pytest.mark.slow
def test_a_gpt_that_does_not_fit_with_zero2_fits_with_fsdp():
    # Weights large enough that ZeRO-2 pays under the latency terms (a reduce-scatter and an all-gather, 14 ring
    # latencies, against an all-reduce's tree 6: the sharded update must save more), a batch large enough that data
    # parallelism beats tensor parallelism.
    g = al.models.get("gpt-tiny", num_layers=1, hidden_size=512, seq_len=64, batch_size=64, num_heads=4,
                      vocab_size=512).trace()
    m = P3.logical_mesh((1, 8), (8, 1))
    cache = StrategyCache(m)
    free = solve_intra(g, m, cache=cache)  # the time-optimal plan: ZeRO-2 (weights whole, update sharded)
    assert gathered_params(g, free.strategies, (8, 1)) == []
    assert any(k == "reduce_scatter" for s in free.strategies.values() for k, _a, _b in s.collectives)
    params = [op for op in g.ops if is_param_input(g, op)]
    zero2 = build_problem(g, m, mem_limit_bytes=1e30, cache=cache, pins={op: free.strategies[op] for op in params})
    need_zero2 = ilp.solve_min_memory(zero2.problem).peak_mem  # the least any plan storing weights so needs
    limit = 0.97 * need_zero2
    with pytest.raises(ilp.InfeasibleError):
        solve_intra(g, m, cache=cache, mem_limit_bytes=limit, pins={op: free.strategies[op] for op in params})
    tight = solve_intra(g, m, cache=cache, mem_limit_bytes=limit)
    gp = gathered_params(g, tight.strategies, (8, 1))  # weights stored split over the data axis, gathered to read
    assert gp and all(p.axes == (0,) and p.stored.axes == {0} and "forward" in p.roles for p in gp)
    assert tight.total_s > free.total_s  # the gathers cost time: chosen because memory is tight, not because it pays
    built = build_problem(g, m, mem_limit_bytes=limit, cache=cache)
    ev = ilp.evaluate(built.problem, _choice(built, tight.strategies))
    assert ev.peak_mem <= limit * (1 + 1e-9)
    assert tight.static_bytes < free.static_bytes


@pytest.fixture(scope="module")
def cpu():
    return al.Cluster.preset("cpu", hosts=1)


def _data_parallel(plan):
    """``plan`` with the batch split over mesh axis 0 (the CPU preset's latencies keep a tiny model replicated)."""
    g = plan.graph
    for op in g.ops:
        if g.op(op).primitive == "parameter" and g.tensor(g.op(op).outputs[0]).kind == "batch":
            plan = plan.with_choice(op, "S0R")
    return plan


def test_with_fsdp_on_a_24_layer_gpt_shards_every_layer(cpu):
    model = al.models.get("gpt-tiny", num_layers=24, batch_size=8)
    base = _data_parallel(al.data_parallel_plan(model, cpu))
    plan = with_fsdp(base)
    before, after = memory_breakdown(base)[0], memory_breakdown(plan)[0]
    assert after["params_bytes"] < before["params_bytes"]
    assert after["params_bytes"] == pytest.approx(model.param_bytes / 8)  # every weight of 24 layers, 1/8 each
    assert plan.cost.step_time_s > base.cost.step_time_s  # the gathers
    gp = fsdp_params(plan)[0]
    layers = {plan.op_graph.op(p.op).layer for p in gp}
    assert {f"layer_{i}" for i in range(len(plan.op_graph.layers) - 2)} <= layers | {None}
    assert all(p.stored.axes == {0} for p in gp)
    # the 24 layers of the full graph share the copy's solution: the export shows every one sharded
    code = plan.to_jax_code()
    assert "\"args[0]['layers'][23]['qkv']['w']\": P('x', None)," in code
    assert "ZeRO-3/FSDP" in code
    with pytest.raises(ValueError, match="axes must be"):
        with_fsdp(base, axes=(2,))


@pytest.fixture(scope="module")
def model():
    """What ``reference`` (conftest) trains on one device: gpt-tiny, batch 8, two layers."""
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
def test_an_fsdp_plan_trains_like_one_device(cpu, model, reference):
    plan = with_fsdp(_data_parallel(al.data_parallel_plan(model, cpu)))
    assert fsdp_params(plan)[0]
    runner = al.execute(plan, model, compiler_options={"xla_backend_optimization_level": 0})
    np.testing.assert_allclose(runner.train(3), reference[0], rtol=1e-5, atol=1e-7)
    assert runner.mode == "spmd"
    w = runner.params["layers"][0]["qkv"]["w"]  # after 3 steps: still stored sharded over the data axis
    assert w.sharding.spec == jax.sharding.PartitionSpec("x", None)
    assert w.addressable_shards[0].data.shape == (32 // 8, 96)
    # a 2-stage pipeline (dp 2 x tp 2 per stage) with every stage's weights stored sharded over its data axes
    piped = al.megatron_plan(model, cpu, dp=2, tp=2, pp=2, microbatches=2).with_fsdp()
    assert all(fsdp_params(piped)[k] for k in (0, 1))
    runner = al.execute(piped, model, compiler_options={"xla_backend_optimization_level": 0})
    assert runner.mode == "pipeline"
    np.testing.assert_allclose(runner.train(3), reference[0], rtol=1e-5, atol=1e-7)


def test_the_sharding_table_names_fsdp_parameters(cpu):
    from autopar_lab.widgets.session import Session
    from autopar_lab.widgets.views.sharding_table import op_rows, row_label

    model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)
    plan = with_fsdp(_data_parallel(al.data_parallel_plan(model, cpu)))
    session = Session(plan, model=model)
    rows = {r["op"]: r for r in op_rows(session, primitive="parameter")}
    g = plan.op_graph
    w = next(op for op in g.ops if g.tensor(g.op(op).outputs[0]).path == "args[0]['layers'][0]['qkv']['w']")
    assert rows[w]["partition_spec"] == "P('x', None)"
    assert rows[w]["note"].startswith("ZeRO-3/FSDP: stored P('x', None), all-gathered over x to P(None, None)")
    assert "ZeRO-3/FSDP" in row_label(rows[w])


@pytest.mark.slow
def test_a_user_script_exports_an_fsdp_plan(tmp_path):
    """As a user runs it: a script in another directory plans, overrides to FSDP and writes the JAX code."""
    import os
    import subprocess
    import sys

    script = tmp_path / "fsdp_export.py"
    script.write_text(
        "import autopar_lab as al\n"
        "model = al.models.get('gpt-tiny', batch_size=8, num_layers=2)\n"
        "plan = al.data_parallel_plan(model, al.Cluster.preset('cpu', hosts=1))\n"
        "g = plan.op_graph\n"
        "for op in g.ops:\n"
        "    if g.op(op).primitive == 'parameter' and g.tensor(g.op(op).outputs[0]).kind == 'batch':\n"
        "        plan = plan.with_choice(op, 'S0R')\n"
        "print(plan.with_fsdp().to_jax_code())\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "# ZeRO-3/FSDP:" in out.stdout
    assert "\"args[0]['layers'][1]['qkv']['w']\": P('x', None)," in out.stdout
    compile(out.stdout, "exported.py", "exec")  # the export is Python


@pytest.mark.slow
def test_on_a_two_axis_mesh_tight_memory_stores_weights_over_the_first_axis_too():
    """The sequential solve's first pass (axis 0 alone, no limit) keeps weights whole; under a memory limit the
    second pass may still store them split over axis 0 (it leaves parameters free there)."""
    g = al.models.get("gpt-tiny", num_layers=1, hidden_size=512, seq_len=64, batch_size=64, num_heads=4,
                      vocab_size=512).trace()  # as in test_a_gpt_that_does_not_fit_with_zero2_fits_with_fsdp
    m = P3.logical_mesh((1, 8), (2, 4))
    cache = StrategyCache(m)
    free = solve_intra(g, m, cache=cache)
    assert gathered_params(g, free.strategies, (2, 4)) == []
    built = build_problem(g, m, mem_limit_bytes=1e30, cache=cache)
    peak = ilp.evaluate(built.problem, _choice(built, free.strategies)).peak_mem
    tight = solve_intra(g, m, cache=cache, mem_limit_bytes=0.9 * peak)
    gp = gathered_params(g, tight.strategies, (2, 4))
    assert any(0 in p.stored.axes and 0 in p.axes for p in gp)
