"""User-marked pipeline boundaries (al.pipeline_boundary) and re-layering (al.relayer): markers, clustering, scopes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab import planner
from autopar_lab.cluster import Cluster
from autopar_lab.graph.markers import MARKER_PRIMITIVE
from autopar_lab.graph.opgraph import BACKWARD, FORWARD, INPUT_PRIMITIVE, UPDATE
from autopar_lab.sharding.strategies import has_rule

D, BATCH, BLOCKS = 16, 8, 4


def _loss(ws, x, y, mark=True):
    for i, w in enumerate(ws):
        x = jnp.tanh(x @ w)
        if mark and i < len(ws) - 1:
            x = al.pipeline_boundary(x)
    return jnp.mean((x - y) ** 2)


def _step(mark=True):
    def step(params, momentum, x, y):
        g = jax.grad(_loss)(params, x, y, mark)
        m = [0.9 * mi + gi for mi, gi in zip(momentum, g)]
        return [w - 0.1 * mi for w, mi in zip(params, m)], m
    return step


def _abstract():
    w = jax.ShapeDtypeStruct((D, D), jnp.float32)
    x = jax.ShapeDtypeStruct((BATCH, D), jnp.float32)
    return [w] * BLOCKS, [w] * BLOCKS, x, x


@pytest.fixture(scope="module")
def marked():
    return al.trace(_step(True), *_abstract(), batch_argnums=(2, 3), opt_state_argnums=(1,), name="marked-mlp")


def _param_op(graph, argnum, k):
    return next(n for n in graph if n.primitive == INPUT_PRIMITIVE and n.params["argnum"] == argnum
                and n.params["path"] == f"[{k}]")


# --- the marker --------------------------------------------------------------------------------------------------
def test_marker_is_identity_under_jit_and_grad():
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=(D, D)) / 4, jnp.float32) for _ in range(BLOCKS)]
    x = jnp.asarray(rng.normal(size=(BATCH, D)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(BATCH, D)), jnp.float32)
    plain = jax.value_and_grad(_loss)(ws, x, y, False)
    for fn in (jax.value_and_grad(_loss), jax.jit(jax.value_and_grad(_loss), static_argnums=3)):
        val, grads = fn(ws, x, y, True)
        np.testing.assert_allclose(val, plain[0], rtol=1e-6)
        for a, b in zip(grads, plain[1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # A pytree comes back unchanged, leaf by leaf; vmap and jit of the marker itself too.
    tree = {"a": x, "b": (y, jnp.arange(3))}
    out = jax.jit(al.pipeline_boundary)(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(tree)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.vmap(lambda r: al.pipeline_boundary(r) * 2)(x), x * 2)
    # The backward pass carries the boundary too: grad of a marked function has a marker in its jaxpr.
    jaxpr = jax.make_jaxpr(jax.grad(lambda v: jnp.sum(jnp.sin(al.pipeline_boundary(v)))))(x)
    assert [e.params["index"] for e in jaxpr.jaxpr.eqns if e.primitive.name == MARKER_PRIMITIVE] == [0, 0]


def test_markers_are_operators_numbered_in_call_order(marked):
    markers = [n for n in marked if n.primitive == MARKER_PRIMITIVE]
    fwd = [n.params["index"] for n in markers if n.role == FORWARD]
    bwd = [n.params["index"] for n in markers if n.role == BACKWARD]
    assert fwd == [0, 1, 2]  # forward markers in call order
    assert bwd == [2, 1, 0]  # their twins in the backward pass, visited last to first, same index
    assert all(not n.opaque and n.flops == 0 for n in markers)
    assert has_rule(MARKER_PRIMITIVE)
    # Tracing again numbers the markers the same way (the counter is per trace, not per process).
    again = al.trace(_step(True), *_abstract(), batch_argnums=(2, 3), opt_state_argnums=(1,))
    assert [n.params["index"] for n in again if n.primitive == MARKER_PRIMITIVE] == fwd + bwd
    # A pytree marked by one call: one operator per leaf, sharing the call's index.
    g = al.trace(lambda w, x: jnp.sum(al.pipeline_boundary((x @ w, x))[0]), jnp.zeros((4, 4)), jnp.zeros((2, 4)),
                 batch_argnums=(1,))
    assert [n.params for n in g if n.primitive == MARKER_PRIMITIVE] == [{"index": 0}, {"index": 0}]


# --- relayer: markers --------------------------------------------------------------------------------------------
def test_markers_give_one_layer_per_block_with_its_backward_and_update(marked):
    before = [n.layer for n in marked]
    g = al.relayer(marked, boundaries="markers")
    assert g.layers == [f"stage_{k}" for k in range(BLOCKS)]
    # Same operators and tensors; only the layers changed; the input graph is untouched.
    assert len(g) == len(marked) and g.fingerprint == marked.fingerprint
    assert g.inputs == marked.inputs and g.outputs == marked.outputs and g.name == marked.name
    assert [n.layer for n in marked] == before
    assert all(n.layer is not None for n in g)
    fwd_mm = [n for n in g if n.primitive == "dot_general" and n.role == FORWARD]
    bwd_mm = [n for n in g if n.primitive == "dot_general" and n.role == BACKWARD]
    assert len(fwd_mm) == BLOCKS and len(bwd_mm) == 2 * BLOCKS - 1  # block 0 has no input gradient
    for k in range(BLOCKS):
        w = _param_op(g, 0, k).outputs[0]
        mom = _param_op(g, 1, k).outputs[0]
        layer = f"stage_{k}"
        assert _param_op(g, 0, k).layer == layer and _param_op(g, 1, k).layer == layer
        # The forward matmul of block k reads w_k ...
        (f,) = [n for n in fwd_mm if w in n.inputs]
        assert f.layer == layer
        # ... its weight-gradient matmul has w's shape (transposed or not) and reads the block's input,
        x_in = f.inputs[0]
        (wg,) = [n for n in bwd_mm if x_in in n.inputs]
        assert wg.layer == layer
        # and every update operator that reads w_k or its momentum sits with them.
        upd = [n for n in g if n.role == UPDATE and (w in n.inputs or mom in n.inputs)]
        assert upd and all(n.layer == layer for n in upd)
    # Marker k starts the layer its output flows into: forward marker k in stage_{k+1}, its twin in stage_k.
    for n in g:
        if n.primitive == MARKER_PRIMITIVE:
            k = n.params["index"]
            assert n.layer == (f"stage_{k + 1}" if n.role == FORWARD else f"stage_{k}")


def test_markers_cut_exactly_the_marked_activation(marked):
    g = al.relayer(marked, boundaries="markers")
    # The only forward activation crossing each boundary is the marked one (BATCH x D float32).
    assert planner.cut_bytes(g, g.layers) == [BATCH * D * 4] * (BLOCKS - 1)


def test_markers_mode_needs_markers_and_auto_picks_them(marked):
    plain = al.trace(_step(False), *_abstract(), batch_argnums=(2, 3), opt_state_argnums=(1,))
    with pytest.raises(ValueError, match="pipeline_boundary"):
        al.relayer(plain, boundaries="markers")
    assert al.relayer(marked).layers == al.relayer(marked, boundaries="markers").layers
    with pytest.raises(ValueError, match="boundaries"):
        al.relayer(marked, boundaries="layers")


# --- relayer: clustering -----------------------------------------------------------------------------------------
def test_clustering_splits_a_scopeless_chain_evenly():
    n_mm = 6
    w = jax.ShapeDtypeStruct((32, 32), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 32), jnp.float32)

    def step(ws, x):
        def loss(ws):
            h = x
            for wi in ws:
                h = jnp.tanh(h @ wi)
            return jnp.sum(h)
        return [wi - 0.1 * gi for wi, gi in zip(ws, jax.grad(loss)(ws))]

    graph = al.trace(step, [w] * n_mm, x, batch_argnums=(1,))
    # no scopes: capture finds the layers from the parameters' list indices
    assert graph.layer_rule == "indexed-params" and graph.layers == [f"[{i}]" for i in range(n_mm)]
    g = al.relayer(graph, boundaries="cluster", num_layers=3)
    assert g.layers == ["cluster_0", "cluster_1", "cluster_2"]
    fwd_mm = [n for n in g if n.primitive == "dot_general" and n.role == FORWARD]
    assert [n.layer for n in fwd_mm] == ["cluster_0"] * 2 + ["cluster_1"] * 2 + ["cluster_2"] * 2
    # Backward and update follow the forward: each layer holds 2 forward, 2 weight-gradient matmuls (+ input grads).
    for k, layer in enumerate(g.layers):
        ws = [_param_op(g, 0, j).outputs[0] for j in (2 * k, 2 * k + 1)]
        assert all(_param_op(g, 0, j).layer == layer for j in (2 * k, 2 * k + 1))
        upd = [n for n in g if n.role == UPDATE and any(t in n.inputs for t in ws)]
        assert len(upd) == 2 and all(n.layer == layer for n in upd)
        bwd_flops = sum(n.flops for n in g if n.layer == layer and n.role == BACKWARD and n.primitive == "dot_general")
        assert bwd_flops == pytest.approx(sum(n.flops for n in fwd_mm[2 * k: 2 * k + 2]) * (2 if k else 1.5))
    # auto on a scope-less, marker-less graph: cluster into min(8, #matmuls) layers.
    assert len(al.relayer(graph).layers) == n_mm


def test_scopes_mode_keeps_a_zoo_models_layers():
    graph = al.models.get("gpt-tiny", dtype="float32", batch_size=4, num_layers=2).trace()
    assert len(graph.layers) > 1
    for mode in ("scopes", "auto"):
        g = al.relayer(graph, boundaries=mode)
        assert g is not graph and g.layers == graph.layers
        assert [n.layer for n in g] == [n.layer for n in graph]
    # Clustering the same graph ignores the scopes and yields the asked-for number of layers.
    assert al.relayer(graph, boundaries="cluster", num_layers=2).layers == ["cluster_0", "cluster_1"]


# --- the planner on a marker-layered graph -----------------------------------------------------------------------
def test_planner_stages_fall_on_marker_layers(marked):
    g = al.relayer(marked, boundaries="markers")
    cluster = Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=2)
    plan = planner.auto_plan(g, cluster, microbatches=1)
    assert list(plan.layer_names) == g.layers
    covered = [k for st in plan.stages for k in range(st.layers[0], st.layers[1] + 1)]
    assert covered == list(range(BLOCKS))
    # A two-stage pipeline over the same layers: its one cut is a marker, and it carries the marked activation.
    pp = planner.megatron_plan(g, cluster, dp=1, tp=1, pp=2, microbatches=1)
    assert [st.layers for st in pp.stages] == [(0, 1), (2, 3)]
    assert pp.cost.stage_comm_s > 0
    table = planner.CostTable(g, cluster)
    assert table.cut_bytes[pp.stages[1].layers[0] - 1] == BATCH * D * 4
