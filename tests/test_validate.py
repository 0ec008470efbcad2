"""Applying sharding specs to the real step (replay) and reading collectives back from compiled HLO.

Run with JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu (the tests that need 8 devices skip otherwise).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import autopar_lab.models as zoo
from autopar_lab.graph.capture import trace
from autopar_lab.sharding.spec import ShardingSpec
from autopar_lab.validate import (
    COLLECTIVE_KINDS,
    ReplayError,
    collective_instructions,
    collectives_in_hlo,
    replay_with_shardings,
    total_bytes,
    validate_model,
)

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs JAX_NUM_CPU_DEVICES=8")

MLP_KW = dict(batch_size=16, input_dim=24, hidden_size=32, num_layers=2, num_classes=10)


def _max_err(a, b) -> float:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(la, lb))


def _close(a, b, rtol=1e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol)


@pytest.fixture(scope="module")
def mesh24():
    if len(jax.devices()) < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8")
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"))


@pytest.fixture(scope="module")
def mesh1d():
    if len(jax.devices()) < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8")
    return Mesh(np.array(jax.devices()[:8]), ("x",))


@pytest.fixture(scope="module")
def mlp():
    spec = zoo.get("mlp", **MLP_KW)
    return spec, spec.trace(), spec.init(0)


# ------------------------------------------------------------------------------------------------ the HLO parser

HLO_SNIPPET = """
HloModule jit_f, entry_computation_layout={(f32[8,256]{1,0})->f32[256]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add = f32[] add(%a, %b)
}

%fused_computation (param_0: f32[8,32]) -> f32[8,32] {
  %param_0 = f32[8,32]{1,0} parameter(0)
  ROOT %all-reduce.7 = f32[8,32]{1,0} all-reduce(%param_0), replica_groups={{0,1},{2,3}}, to_apply=%add
}

ENTRY %main (p: f32[8,256], q: f32[64,32]) -> f32[256] {
  %p = f32[8,256]{1,0} parameter(0)
  %q = f32[64,32]{1,0} parameter(1)
  %all-gather-start = (f32[8,256]{1,0}, f32[64,256]{1,0}) all-gather-start(%p), replica_groups=[1,8]<=[8], dimensions={0}
  %all-gather-done = f32[64,256]{1,0} all-gather-done(%all-gather-start)
  %ars = (f32[256]{0}, bf16[10,10]{1,0}) all-reduce-start(%x, %y), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %ard = (f32[256]{0}, bf16[10,10]{1,0}) all-reduce-done(%ars)
  %reduce-scatter = f32[8,32]{1,0} reduce-scatter(%q), replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}, to_apply=%add
  %rs2 = f32[4]{0} reduce-scatter(f32[16]{0} %z), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %rs3 = f32[4]{0} reduce-scatter(%unknown), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}, to_apply=%add
  %a2a = (f32[8,1,32]{2,1,0}, f32[8,1,32]{2,1,0}, /*index=2*/f32[8,1,32]{2,1,0}) all-to-all(%a, %b, %c), replica_groups={{0,1,2}}
  %cps = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%w), source_target_pairs={{0,1},{1,0}}
  %cpd = f32[16]{0} collective-permute-done(%cps)
  %cp = s32[4]{0} collective-permute(%v), source_target_pairs={{0,1}}
  %fusion = f32[8,32]{1,0} fusion(%q), kind=kLoop, calls=%fused_computation, metadata={op_name="all-reduce(x)"}
  ROOT %r = f32[256]{0} reduce(%all-gather-done, %c0), dimensions={0}, to_apply=%add, metadata={op_name="jit(f)/all-gather"}
}
"""


def test_parser_on_hand_written_hlo():
    got = collectives_in_hlo(HLO_SNIPPET)
    assert set(got) == set(COLLECTIVE_KINDS)
    # all-gather-start: its result (the second tuple element), not the operand
    assert got["all_gather"] == {"count": 1, "bytes": 64 * 256 * 4}
    # a variadic all-reduce-start sums its parts; the all-reduce inside the fusion computation counts too
    assert got["all_reduce"] == {"count": 2, "bytes": 256 * 4 + 100 * 2 + 8 * 32 * 4}
    # reduce-scatter: its operand, looked up by name (64x32), printed inline (16), or result x group size (4x4)
    assert got["reduce_scatter"] == {"count": 3, "bytes": 64 * 32 * 4 + 16 * 4 + 4 * 4 * 4}
    assert got["all_to_all"] == {"count": 1, "bytes": 3 * 8 * 32 * 4}
    # collective-permute-start: its result (second element), not the u32 context; -done not counted
    assert got["collective_permute"] == {"count": 2, "bytes": 16 * 4 + 4 * 4}
    inst = collective_instructions(HLO_SNIPPET)
    assert [c["opcode"] for c in inst].count("all-reduce") == 1
    assert {c["computation"] for c in inst if c["opcode"] == "all-reduce"} == {"fused_computation"}
    by_name = {c["name"]: c for c in inst}
    assert by_name["reduce-scatter"]["group_size"] == 8 and by_name["rs3"]["group_size"] == 4
    assert by_name["all-gather-start"]["group_size"] == 8 and by_name["rs2"]["group_size"] == 4


def test_parser_empty_and_no_collectives():
    assert total_bytes(collectives_in_hlo("")) == 0
    text = "ENTRY %m (p: f32[4]) -> f32[4] {\n  ROOT %p = f32[4]{0} parameter(0)\n}\n"
    assert all(v == {"count": 0, "bytes": 0.0} for v in collectives_in_hlo(text).values())


def _compiled(fn, in_shardings, *args, out_shardings=None):
    return collectives_in_hlo(jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
                              .lower(*args).compile().as_text())


def test_real_compile_sum_is_one_all_reduce(mesh1d):
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    got = _compiled(lambda a: jnp.sum(a, axis=0), NamedSharding(mesh1d, P("x", None)), x)
    assert got["all_reduce"] == {"count": 1, "bytes": 256 * 4}
    assert total_bytes(got) == 256 * 4


def test_real_compile_contracting_matmul_all_reduces_output(mesh1d):
    a = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    b = jax.ShapeDtypeStruct((256, 32), jnp.float32)
    got = _compiled(jnp.matmul, (NamedSharding(mesh1d, P(None, "x")), NamedSharding(mesh1d, P("x", None))), a, b,
                    out_shardings=NamedSharding(mesh1d, P()))
    assert got["all_reduce"] == {"count": 1, "bytes": 64 * 32 * 4}
    assert total_bytes(got) == 64 * 32 * 4


def test_real_compile_all_gather_from_constraint(mesh1d):
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    fn = lambda a: jax.lax.with_sharding_constraint(a * 2.0, NamedSharding(mesh1d, P())) + 1.0
    got = _compiled(fn, NamedSharding(mesh1d, P("x", None)), x)
    assert got["all_gather"] == {"count": 1, "bytes": 64 * 256 * 4}
    assert total_bytes(got) == 64 * 256 * 4


# ------------------------------------------------------------------------------------------------ the replay


def test_replay_walk_covers_calls_scans_cond_while():
    """Inlined jit / checkpoint / custom_jvp bodies, forward and reverse scans, cond and while, with grad."""

    @jax.jit
    def inner(w, x):
        return jax.nn.relu(x @ w)  # relu is a custom_jvp

    def loss(w, xs):
        def body(c, x):
            h = jax.checkpoint(inner)(w, x + c)
            return c + h.sum(), h.mean(0)
        c, ys = jax.lax.scan(body, 0.0, xs)
        _, zs = jax.lax.scan(lambda c, y: (c, y * c), 2.0, ys, reverse=True)
        c = jax.lax.cond(c > 0, lambda v: v * 2.0, lambda v: v - 1.0, c)
        n = jax.lax.while_loop(lambda v: v < 3, lambda v: v + 1, 0)
        return c + zs.sum() + n

    def step(w, xs):
        return jax.value_and_grad(loss)(w, xs)

    w = jnp.linspace(-1, 1, 12).reshape(4, 3)
    xs = jnp.linspace(-2, 2, 40).reshape(5, 2, 4)
    g = trace(step, w, xs, batch_argnums=(1,))
    prims = {n.primitive for n in g}
    assert {"scan_slice", "scan_stack", "cond", "while"} <= prims
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    r = replay_with_shardings(g, step, (w, xs), {}, mesh)
    out = r(w, xs)  # eager: op by op
    assert r.ops_walked == len(g)
    _close(out, step(w, xs))
    # a scan kept whole (max_unroll) is one `scan` operator, and the replay infers it
    g2 = trace(step, w, xs, batch_argnums=(1,), max_unroll=2)
    assert "scan" in {n.primitive for n in g2}
    r2 = replay_with_shardings(g2, step, (w, xs), {}, mesh)
    _close(jax.jit(r2)(w, xs), step(w, xs))
    assert r2.ops_walked == len(g2)


def test_replay_diverging_graph_raises():
    f1 = lambda x: jnp.tanh(x) * 2.0
    f2 = lambda x: jnp.sin(x) * 2.0
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    r = replay_with_shardings(trace(f1, x), f2, (x,), {}, mesh)
    with pytest.raises(ReplayError, match="operator 1: the graph has #1 tanh"):
        jax.eval_shape(r, x)
    with pytest.raises(ValueError, match="spec 'S0R' has 2 dimensions"):
        replay_with_shardings(trace(f1, x), f1, (x,), {0: ["S0R"]}, mesh)


@needs8
def test_replay_without_constraints_equals_step_mlp(mlp, mesh24):
    spec, graph, args = mlp
    r = replay_with_shardings(graph, spec.step_fn, spec.abstract_args, {}, mesh24)
    out = jax.jit(r)(*args)
    assert r.ops_walked == len(graph)
    assert _max_err(out, jax.jit(spec.step_fn)(*args)) < 1e-6


@needs8
def test_replay_without_constraints_equals_step_gpt_tiny(mesh24):
    spec = zoo.get("gpt-tiny")
    graph = spec.trace()
    args = spec.init(0)
    r = replay_with_shardings(graph, spec.step_fn, spec.abstract_args, {}, mesh24)
    out = jax.jit(r)(*args)
    assert r.ops_walked == len(graph)
    assert _max_err(out, jax.jit(spec.step_fn)(*args)) < 1e-5
    # the scanned variant: the walk unrolls the layer scan exactly like the capture (checked abstractly)
    scanned = zoo.get("gpt-tiny", scan_layers=True)
    g2 = scanned.trace()
    r2 = replay_with_shardings(g2, scanned.step_fn, scanned.abstract_args, {}, mesh24)
    shapes = jax.eval_shape(r2, *scanned.abstract_args)
    assert r2.ops_walked == len(g2)
    assert jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(
        jax.eval_shape(scanned.step_fn, *scanned.abstract_args))


def data_parallel_specs(graph, batch: int) -> dict:
    """Every output with the batch dim first: that dim over both mesh axes (S01...); values holding the batch
    dim elsewhere: left to XLA; everything else (parameters, gradients, optimizer state) replicated."""
    out = {}
    for node in graph:
        if node.primitive == "output":
            continue
        specs = []
        for shape in node.out_shapes:
            if len(shape) >= 1 and shape[0] == batch:
                specs.append(ShardingSpec(((0, 1),) + ((),) * (len(shape) - 1)))
            elif batch in shape:
                specs.append(None)
            else:
                specs.append(ShardingSpec.replicated(len(shape)))
        out[node.id] = specs
    return out


@needs8
def test_data_parallel_plan_all_reduces_the_gradients(mlp, mesh24):
    spec, graph, _ = mlp
    B = MLP_KW["batch_size"]
    specs = data_parallel_specs(graph, B)
    n_in = len(graph.inputs)  # the batch dict's leaves (labels, x) are the last parameter ops
    assert [str(specs[i][0]) for i in (n_in - 2, n_in - 1)] == ["S01", "S01R"]
    assert str(specs[0][0]) == "R"  # a parameter: replicated
    param_bytes = graph.param_bytes
    predicted = {"all_reduce": {"count": 2 * MLP_KW["num_layers"] + 2, "bytes": float(param_bytes)}}
    rep = validate_model(spec, specs, mesh24, predicted, graph=graph)
    ar = rep["compiled"]["all_reduce"]
    assert ar["count"] >= 1
    assert abs(ar["bytes"] - param_bytes) <= 0.03 * param_bytes, (ar, param_bytes)
    assert rep["compiled"]["all_gather"]["count"] == 0
    assert rep["numerics_max_abs_err"] < 1e-5
    assert rep["num_devices"] == 8 and rep["num_ops"] == len(graph)
    assert rep["bytes_ratio"] == pytest.approx(param_bytes / total_bytes(rep["compiled"]))


@needs8
def test_megatron_mlp_forward_all_reduces_the_activation(mlp, mesh24):
    spec, _, (p_concrete, _, b_concrete) = mlp
    params, _, batch = spec.abstract_args
    B, H = MLP_KW["batch_size"], MLP_KW["hidden_size"]
    g = trace(spec.loss_fn, params, batch, batch_argnums=(1,))
    # parameter leaves in pytree order: head.b, head.w, layers[0].b, layers[0].w, layers[1].b, layers[1].w, ...
    leaves = jax.tree_util.tree_flatten_with_path((params, batch))[0]
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    col, row = ShardingSpec.parse("RS1"), ShardingSpec.parse("S1R")
    out_specs = {names.index("[0]['layers'][0]['w']"): [col], names.index("[0]['layers'][0]['b']"): ["S1"],
                 names.index("[0]['layers'][1]['w']"): [row]}
    dots = [n.id for n in g if n.primitive == "dot_general"]
    out_specs[dots[0]] = [col]  # h1 = x @ w0: columns split over mesh axis 1
    out_specs[dots[1]] = [ShardingSpec.replicated(2)]  # h2 = gelu(h1) @ w1: partial sums -> all-reduce
    r = replay_with_shardings(g, spec.loss_fn, (params, batch), out_specs, mesh24)
    text = r.jit().lower(params, batch).compile().as_text()
    assert r.ops_walked == len(g) and r.constrained == 2 + 3
    inst = collective_instructions(text)
    ar = [c for c in inst if c["kind"] == "all_reduce"]
    assert any(c["bytes"] == B * H * 4 for c in ar), inst
    assert total_bytes(collectives_in_hlo(text)) == B * H * 4
    # numerics of the sharded forward against the plain one
    sharded = r.jit()(*jax.device_put((p_concrete, b_concrete), r.in_shardings))
    assert abs(float(sharded) - float(jax.jit(spec.loss_fn)(p_concrete, b_concrete))) < 1e-5


def test_parser_async_wrapped_collective_counts_once():
    text = """
%wrapped_reduce_scatter (p0: f32[64]) -> f32[8] {
  %p0 = f32[64]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[8]{0} reduce-scatter(%p0), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[64]) -> f32[8] {
  %x = f32[64]{0} parameter(0)
  %rs-start = ((f32[64]{0}), f32[8]{0}) async-start(%x), calls=%wrapped_reduce_scatter
  ROOT %rs-done = f32[8]{0} async-done(%rs-start)
}
"""
    got = collectives_in_hlo(text)
    assert got["reduce_scatter"] == {"count": 1, "bytes": 64 * 4}
    assert total_bytes(got) == 64 * 4


def test_specs_from_strategies_feeds_the_replay():
    from autopar_lab.sharding.strategies import Strategy
    from autopar_lab.validate import specs_from_strategies

    fn = lambda w, x: jnp.tanh(x @ w)
    w, x = jax.ShapeDtypeStruct((4, 8), jnp.float32), jax.ShapeDtypeStruct((2, 4), jnp.float32)
    g = trace(fn, w, x, batch_argnums=(1,))  # parameter, parameter, dot_general, tanh, output
    S = ShardingSpec.parse
    chosen = {0: Strategy("w", (S("RS1"),), ()), 1: Strategy("x", (S("RR"),), ()),
              2: Strategy("dot", (S("RS1"),), (S("RR"), S("RS1"))), 3: Strategy("tanh", (S("RS1"),), (S("RS1"),)),
              4: Strategy("out", (), (S("RS0"),))}
    out_specs, output_specs = specs_from_strategies(g, chosen)
    assert 4 not in out_specs and output_specs == {4: S("RS0")}
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    r = replay_with_shardings(g, fn, (w, x), out_specs, mesh, output_specs=output_specs)
    assert r.in_shardings[0].spec == P(None, "y") and r.out_shardings.spec == P(None, "x")
    # without output_specs the output takes its producer's spec
    r2 = replay_with_shardings(g, fn, (w, x), out_specs, mesh)
    assert r2.out_shardings.spec == P(None, "y")
    jax.eval_shape(r, w, x)
    assert r.ops_walked == len(g) and r.constrained == 4
