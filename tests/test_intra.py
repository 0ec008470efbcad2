"""The intra-operator pass on real graphs: known answers, brute force, pins, memory, layer reuse."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar_lab as al
from autopar_lab.cluster import Cluster
from autopar_lab.graph import trace
from autopar_lab.solve import ilp
from autopar_lab.solve.intra import (
    MEMORY_TIE_BREAK_S_PER_BYTE,
    IntraOptions,
    build_problem,
    evaluate_intra,
    solve_intra,
    weight_gradient_ops,
)

f32 = jnp.float32
P3 = Cluster.preset("p3.16xlarge")


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, f32)


def mesh(shape, submesh=(1, 8)):
    return P3.logical_mesh(submesh, shape)


def mlp_block(w1, w2, x):
    return jnp.sum(jax.nn.gelu(x @ w1) @ w2)


def dots(graph, plan, role=None):
    return [(graph.op(o), plan.strategies[o]) for o in graph.ops
            if graph.op(o).primitive == "dot_general" and (role is None or graph.op(o).role == role)]


def test_large_hidden_mlp_picks_megatron_pattern():
    B, H = 8, 8192
    g = trace(mlp_block, sds(H, 4 * H), sds(4 * H, H), sds(B, H), param_argnums=(0, 1), batch_argnums=(2,))
    plan = solve_intra(g, mesh((1, 8)))
    (first, s1), (second, s2) = dots(g, plan)
    assert str(s1.in_specs[1]) == "RS1"  # w1 split by columns
    assert str(s2.in_specs[1]) == "S1R"  # w2 split by rows
    assert [c[0] for c in s1.collectives] == []
    assert [c[0] for c in s2.collectives] == ["all_reduce"]  # one all-reduce, of the output
    assert plan.collectives == {"all_reduce": {"count": 1, "bytes": B * H * 4}}


def test_large_hidden_mlp_training_step_keeps_megatron_in_forward():
    B, H = 8, 4096
    # value and gradient: the loss is an output, so the forward's last matmul is live (a compiler removes what no
    # output needs, and so does the cost model: a dead operator costs nothing whatever its strategy)
    step = jax.value_and_grad(mlp_block, argnums=(0, 1))
    g = trace(step, sds(H, 4 * H), sds(4 * H, H), sds(B, H), param_argnums=(0, 1), batch_argnums=(2,))
    plan = solve_intra(g, mesh((1, 8)))
    fwd = dots(g, plan, "forward")
    assert [str(s.in_specs[1]) for _, s in fwd] == ["RS1", "S1R"]
    fwd_colls = [c[0] for _, s in fwd for c in s.collectives]
    assert fwd_colls == ["all_reduce"]


def test_large_batch_small_weights_picks_data_parallelism():
    # Big enough that splitting the batch saves more than a gradient all-reduce's latency costs (tiny steps are
    # cheaper replicated: a collective of a few bytes still takes ~20 us over NVLink), and a live forward.
    B, H = 1 << 17, 64
    step = jax.value_and_grad(mlp_block, argnums=(0, 1))
    g = trace(step, sds(H, H), sds(H, H), sds(B, H), param_argnums=(0, 1), batch_argnums=(2,))
    plan = solve_intra(g, mesh((8, 1)))
    for node, s in dots(g, plan, "forward"):
        assert str(s.out_specs[0]) == "S0R"  # batch split over the 8 devices
        assert str(s.in_specs[1]) == "RR"  # weights replicated
    # The weight gradients are synchronised: all-reduce (or reduce-scatter + all-gather, ZeRO style).
    assert set(plan.collectives) <= {"all_reduce", "reduce_scatter", "all_gather"}
    assert plan.sync_s > 0


def _adam_step(H=1024, B=64):
    opt = optax.adam(1e-3)

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

    def step(p, s, x):
        grads = jax.grad(loss)(p, x)
        upd, s = opt.update(grads, s, p)
        return optax.apply_updates(p, upd), s

    params = {"w1": sds(H, H), "w2": sds(H, H)}
    return trace(step, params, jax.eval_shape(opt.init, params), sds(B, H), batch_argnums=(2,))


def test_tight_memory_changes_the_choice_and_impossible_memory_says_what_it_needs():
    g = _adam_step()
    m = mesh((8, 1))
    free = solve_intra(g, m, options=IntraOptions(reuse_layers=False))
    built = build_problem(g, m, mem_limit_bytes=1e30)  # the memory rows, to read the unconstrained plan's peak
    choice = [next(k for k, s in enumerate(built.strats[i]) if s.key == free.strategies[op].key)
              for i, op in enumerate(built.nodes)]
    peak = ilp.evaluate(built.problem, choice).peak_mem
    smallest = ilp.solve_min_memory(built.problem).peak_mem
    assert smallest < peak  # sharding the optimizer state and weights saves memory, at a price
    tight = solve_intra(g, m, mem_limit_bytes=(smallest + peak) / 2)
    assert tight.total_s >= free.total_s
    assert any(tight.strategies[o].key != free.strategies[o].key for o in g.ops)
    with pytest.raises(ilp.InfeasibleError) as e:
        solve_intra(g, m, mem_limit_bytes=smallest * 0.9)
    assert e.value.min_peak_mem == pytest.approx(smallest)
    assert "smallest peak memory" in str(e.value)


def test_pins_hold_and_the_rest_is_resolved_around_them():
    B, H = 8, 8192
    g = trace(mlp_block, sds(H, 4 * H), sds(4 * H, H), sds(B, H), param_argnums=(0, 1), batch_argnums=(2,))
    m = mesh((1, 8))
    free = solve_intra(g, m)
    first_dot = next(o for o in g.ops if g.op(o).primitive == "dot_general")
    pinned = solve_intra(g, m, pins={first_dot: "RR"})
    assert str(pinned.strategies[first_dot].out_specs[0]) == "RR"
    assert pinned.total_s >= free.total_s
    with pytest.raises(ValueError, match="not available"):
        solve_intra(g, m, pins={first_dot: "S0S1"})


def test_a_pinned_operator_carries_its_pinned_strategy_alone_and_the_optimum_is_unchanged():
    # build_problem gives a pinned operator's node the pinned strategy only; the optimum is the one of the problem
    # with every strategy kept and the pin as a constraint (brute force over both).
    g = trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)), sds(16, 16), sds(8, 16), batch_argnums=(1,))
    m = P3.logical_mesh((1, 4), (2, 2))
    dot = next(o for o in g.ops if g.op(o).primitive == "dot_general")
    whole = build_problem(g, m)
    k = whole.nodes.index(dot)
    for q, s in enumerate(whole.strats[k]):
        pinned = build_problem(g, m, pins={dot: s.name})
        assert [t.name for t in pinned.strats[k]] == [s.name] and dict(pinned.problem.pins) == {k: 0}
        constrained = ilp.IntraProblem(node_costs=whole.problem.node_costs, edges=whole.problem.edges,
                                       edge_costs=whole.problem.edge_costs, pins={k: q})
        assert math.isclose(ilp.brute_force(pinned.problem).objective, ilp.brute_force(constrained).objective,
                            rel_tol=1e-12, abs_tol=1e-15)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.sampled_from([4, 8, 64]),
    h=st.sampled_from([8, 16, 256]),
    shape=st.sampled_from([(1, 4), (4, 1), (2, 2)]),
    act=st.sampled_from([jnp.tanh, jax.nn.relu]),
)
def test_ilp_on_small_real_graphs_equals_brute_force(b, h, shape, act):
    g = trace(lambda w, x: jnp.sum(act(x @ w)), sds(h, h), sds(b, h), batch_argnums=(1,))
    built = build_problem(g, P3.logical_mesh((1, 4), shape))
    sol = ilp.solve_ilp(built.problem)
    brute = ilp.brute_force(built.problem)
    assert math.isclose(sol.objective, brute.objective, rel_tol=1e-9, abs_tol=1e-15)
    # The cost the plan reports is an independent recomputation of the chosen strategies.
    chosen = {op: built.strats[k][sol.choice[k]] for k, op in enumerate(built.nodes)}
    plan = evaluate_intra(g, P3.logical_mesh((1, 4), shape), chosen)
    # (the ILP's objective also holds the memory tie-break on stored parameters, which is not a cost of the plan)
    tie = sum(MEMORY_TIE_BREAK_S_PER_BYTE * s.mem_bytes for op, s in chosen.items()
              if g.op(op).primitive == "parameter" and g.tensor(g.op(op).outputs[0]).kind in ("param", "opt_state"))
    assert math.isclose(plan.total_s + tie, sol.objective, rel_tol=1e-9, abs_tol=1e-15)


@pytest.mark.parametrize("name", ["gpt-tiny", "moe-tiny"])
def test_layer_reuse_costs_nothing_on_the_zoo_transformers(name):
    model = al.models.get(name, dtype="float32", num_layers=4)  # MoE alternates dense and MoE layers: 2 of each
    g = model.trace()
    m = P3.logical_mesh((1, 4), (2, 2))
    reused = solve_intra(g, m)
    whole = solve_intra(g, m, options=IntraOptions(reuse_layers=False))
    assert any(gs.reused_from for gs in reused.groups)
    gap = reused.total_s / whole.total_s - 1
    assert gap <= 1e-6, f"layer reuse costs {gap:.2%} on {name}"


def test_merging_and_time_limits_work_with_layer_reuse():
    g = al.models.get("gpt-tiny", dtype="float32", num_layers=3).trace()
    m = P3.logical_mesh((1, 4), (1, 4))
    free = solve_intra(g, m)
    # folded edges between identical layers must not break merging
    merged = solve_intra(g, m, options=IntraOptions(merge=True))
    assert merged.total_s >= free.total_s * (1 - 1e-9)
    assert sum(gs.merges for gs in merged.groups) > 0
    limited = solve_intra(g, m, options=IntraOptions(time_limit=30))  # the greedy start of a time-limited solve
    assert limited.total_s == pytest.approx(free.total_s, rel=1e-6) or all(
        gs.status in ("optimal", "time_limit", "reused") for gs in limited.groups)


def test_first_pass_memo_is_shared_by_meshes_with_the_same_axis_0():
    """The sequential solve's first pass depends only on axis 0's size and link: (2, 2) on 4 devices and (2, 4) on 8
    of one host share it through ``memo``, and the plans equal those solved without it."""
    g = al.models.get("gpt-tiny", dtype="float32", num_layers=2).trace()
    memo = {}
    for sub, shape in [((1, 4), (2, 2)), ((1, 8), (2, 4))]:
        m = P3.logical_mesh(sub, shape)
        with_memo = solve_intra(g, m, memo=memo, options=IntraOptions(rounds=1, solver="highs"))
        plain = solve_intra(g, m, options=IntraOptions(rounds=1, solver="highs"))
        assert with_memo.total_s == pytest.approx(plain.total_s, rel=1e-12)
        assert {o: s.key for o, s in with_memo.strategies.items()} == {o: s.key for o, s in plain.strategies.items()}
    assert len(memo) == 1  # one first pass served both meshes
    # A different axis-0 link (across hosts) is a different first pass.
    solve_intra(g, Cluster.preset("p3.16xlarge", hosts=2).logical_mesh((2, 8), (2, 8)), memo=memo,
                options=IntraOptions(rounds=1, solver="highs"))
    assert len(memo) == 2


def test_tensor_parallel_activation_gradient_is_not_a_weight_gradient_reduction():
    # x * g feeds a Megatron MLP: the backward's dX = dZ @ W1.T is all-reduced over the tensor-parallel axis, then a
    # reduction turns it into g's gradient. That all-reduce is on the backward's critical path; only the reduction
    # (and the weight matmuls) make weight gradients, whose collectives a data-parallel step may defer and overlap.
    B, H = 8, 4096

    def loss(p, x):
        return jnp.sum(jax.nn.gelu((x * p["g"]) @ p["w1"]) @ p["w2"])

    g = trace(jax.value_and_grad(loss), {"g": sds(H), "w1": sds(H, 4 * H), "w2": sds(4 * H, H)}, sds(B, H),
              batch_argnums=(1,))
    plan = solve_intra(g, mesh((1, 8)))
    grads = weight_gradient_ops(g, plan.ops)
    act_grads = [o for o in plan.ops if g.op(o).role == "backward" and g.op(o).primitive == "dot_general"
                 and g.tensor(g.op(o).outputs[0]).shape == (B, H)]
    assert len(act_grads) == 1
    (dx,) = act_grads
    assert [c[0] for c in plan.strategies[dx].collectives] == ["all_reduce"]  # the tensor-parallel backward all-reduce
    assert dx not in grads
    # The weight gradients: the two weight matmuls and the reduction into g's shape.
    weight_shapes = {(H, 4 * H), (4 * H, H), (H,)}
    made = {o for o in plan.ops if g.op(o).role == "backward" and g.op(o).primitive in ("dot_general", "reduce_sum")
            and g.tensor(g.op(o).outputs[0]).shape in weight_shapes}
    assert {o for o in grads if g.op(o).primitive in ("dot_general", "reduce_sum")} == made
    # Nothing is data parallel here, so there is no gradient to synchronise.
    assert plan.sync_s == sum(plan.strategies[o].comm_s for o in grads) == 0.0
    assert plan.comm_s > 0
