"""Graph capture: FLOPs against hand formulas, inlining, scan/cond/while treatment, roles, kinds, errors."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autopar_lab as al
from autopar_lab.graph.capture import TraceError, UnknownPrimitiveWarning, scope_layer_and_role

f32 = jnp.float32


def sds(*shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


def ops_of(graph, primitive):
    return [graph.op(i) for i in graph.ops if graph.op(i).primitive == primitive]


# --- FLOPs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lhs, rhs, spec, expected",
    [
        ((64, 256), (256, 1024), "ik,kj->ij", 2 * 64 * 256 * 1024),
        ((8, 64, 32), (8, 32, 16), "bik,bkj->bij", 2 * 8 * 64 * 32 * 16),
        ((4, 128, 16, 64), (4, 128, 16, 64), "bqhd,bkhd->bhqk", 2 * 4 * 16 * 128 * 128 * 64),
        ((3, 5, 7), (7, 11), "abk,kc->abc", 2 * 3 * 5 * 7 * 11),
    ],
)
def test_dot_general_flops_are_exact(lhs, rhs, spec, expected):
    g = al.trace(lambda a, b: jnp.einsum(spec, a, b), sds(*lhs), sds(*rhs))
    (dot,) = ops_of(g, "dot_general")
    assert dot.flops == expected
    assert dot.bytes_read == 4 * (np.prod(lhs) + np.prod(rhs))
    assert dot.bytes_written == 4 * np.prod(dot.out_shapes[0])


@pytest.mark.parametrize("groups", [1, 4])
def test_conv_flops_are_exact_for_forward_and_both_gradients(groups):
    n, h, w, cin, cout, k = 2, 16, 16, 8, 16, 3

    def conv(x, kernel):
        return jax.lax.conv_general_dilated(
            x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups
        )

    # Each output element is a dot product of length (cin/groups)*k*k.
    fwd = 2 * n * h * w * cout * (cin // groups) * k * k
    g = al.trace(conv, sds(n, h, w, cin), sds(k, k, cin // groups, cout))
    (c,) = ops_of(g, "conv_general_dilated")
    assert c.flops == fwd

    # Backward: the input gradient and the weight gradient each cost what the forward costs.
    gg = al.trace(jax.grad(lambda x, kern: conv(x, kern).sum(), argnums=(0, 1)), sds(n, h, w, cin),
                  sds(k, k, cin // groups, cout))
    convs = ops_of(gg, "conv_general_dilated")
    assert len(convs) == 3
    assert sorted(c.flops for c in convs) == [fwd, fwd, fwd]


def test_elementwise_and_reduction_flops():
    g = al.trace(lambda x: jnp.sum(jnp.exp(x) * 2.0), sds(32, 64))
    assert ops_of(g, "exp")[0].flops == 32 * 64
    assert ops_of(g, "mul")[0].flops == 32 * 64
    assert ops_of(g, "reduce_sum")[0].flops == 32 * 64
    assert g.total_flops == 3 * 32 * 64


# --- inlining and control flow ------------------------------------------------------------------------------


@jax.custom_vjp
def scaled_tanh(x):
    return jnp.tanh(x) * 2.0


scaled_tanh.defvjp(lambda x: (scaled_tanh(x), x), lambda x, g: (g * 2.0 * (1 - jnp.tanh(x) ** 2),))


def test_nested_calls_are_inlined():
    @jax.jit
    def inner(x, w):
        return jax.nn.relu(x @ w)  # relu is a custom_jvp

    def f(x, w):
        y = jax.checkpoint(lambda x: inner(x, w))(x)
        return jnp.sum(scaled_tanh(y))

    g = al.trace(jax.grad(f, argnums=1), sds(8, 16), sds(16, 32))
    prims = {g.op(i).primitive for i in g.ops}
    for call in ("pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call", "checkpoint", "remat"):
        assert call not in prims
    assert len(ops_of(g, "dot_general")) >= 2  # forward and weight gradient
    assert not any(g.op(i).opaque for i in g.ops)


def _mlp_scan(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w), None

    with jax.named_scope("layers"):
        h, _ = jax.lax.scan(body, x, ws)
    return jnp.sum(h)


def _mlp_loop(ws, x):
    h = x
    for i in range(ws.shape[0]):
        h = jnp.tanh(h @ ws[i])
    return jnp.sum(h)


def test_scan_over_layers_yields_one_layer_per_iteration():
    L = 5
    args = (sds(L, 32, 32), sds(4, 32))
    g = al.trace(jax.grad(_mlp_scan), *args)
    assert [f"layers[{i}]" for i in range(L)] == [x for x in g.layers if x.startswith("layers[")]
    for i in range(L):
        dots = [o for o in ops_of(g, "dot_general") if o.layer == f"layers[{i}]"]
        assert sorted(o.role for o in dots) == ["backward", "backward", "forward"]
    # Unrolling loses nothing: the same FLOPs as the python loop (both differentiated with respect to x too, since a
    # scan computes its carry's gradient in every iteration while the loop skips the first layer's input gradient).
    g = al.trace(jax.grad(_mlp_scan, argnums=(0, 1)), *args)
    g_loop = al.trace(jax.grad(_mlp_loop, argnums=(0, 1)), *args)
    assert g.flops_by("primitive")["dot_general"] == g_loop.flops_by("primitive")["dot_general"]
    assert "scan" not in {g.op(i).primitive for i in g.ops}


def test_long_scan_stays_one_operator_priced_by_length():
    g = al.trace(_mlp_scan, sds(6, 32, 32), sds(4, 32), max_unroll=4)
    (scan,) = ops_of(g, "scan")
    assert scan.flops == 6 * (2 * 4 * 32 * 32 + 4 * 32)
    assert any("scan of 6 iterations" in w for w in g.warnings)


def test_cond_is_one_operator_priced_as_its_costliest_branch():
    def f(p, x, w):
        return jax.lax.cond(p, lambda: x @ w, lambda: x * 2.0 @ jnp.ones((16, 16)))

    g = al.trace(f, sds(dtype=bool), sds(8, 16), sds(16, 16))
    (cond,) = ops_of(g, "cond")
    assert cond.flops == 2 * 8 * 16 * 16 + 8 * 16


def test_while_is_one_operator_with_a_warning():
    def f(x):
        return jax.lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 1, jnp.tanh(c[1])), (0, x))[1]

    g = al.trace(f, sds(8, 8))
    (loop,) = ops_of(g, "while")
    assert loop.flops >= 64  # one iteration of the body
    assert any("while loop" in w and "ONE iteration" in w for w in g.warnings)


def test_unknown_primitive_is_kept_opaque_with_a_warning():
    from jax.extend.core import Primitive

    mystery = Primitive("mystery_op")
    mystery.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))

    with pytest.warns(UnknownPrimitiveWarning, match="mystery_op"):
        g = al.trace(lambda x: jnp.sum(mystery.bind(x) @ x), sds(8, 8))
    (op,) = ops_of(g, "mystery_op")
    assert op.opaque and op.flops == 0 and op.bytes_accessed == 2 * 8 * 8 * 4
    assert any("mystery_op" in w for w in g.warnings)
    assert g.summary()["opaque_ops"] == ["mystery_op"]


# --- roles, layers, kinds -----------------------------------------------------------------------------------


def _train_step():
    opt = optax.adam(1e-3)

    def loss_fn(params, batch):
        x, y = batch
        with jax.named_scope("layer_0"):
            h = jnp.tanh(x @ params["w0"])
        with jax.named_scope("layer_1"):
            out = h @ params["w1"]
        return jnp.mean((out - y) ** 2)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = {"w0": sds(16, 32), "w1": sds(32, 4)}
    opt_state = jax.eval_shape(opt.init, params)
    return step, (params, opt_state, (sds(8, 16), sds(8, 4)))


def test_roles_layers_and_input_kinds_of_a_training_step():
    step, args = _train_step()
    g = al.trace(step, *args, batch_argnums=(2,), opt_state_argnums=(1,))
    dots = ops_of(g, "dot_general")
    assert sorted((d.layer, d.role) for d in dots) == [
        ("layer_0", "backward"),  # weight gradient (the input gradient of layer 0 is not needed)
        ("layer_0", "forward"),
        ("layer_1", "backward"),
        ("layer_1", "backward"),
        ("layer_1", "forward"),
    ]
    first = next(d for d in dots if d.layer == "layer_0" and d.role == "forward")
    assert first.input_kinds == ("batch", "param")
    roles = g.flops_by("role")
    assert set(roles) == {"forward", "backward", "update"}
    # Every optimizer operator on w0's moments joins layer_0.
    updates = [g.op(i) for i in g.ops if g.op(i).role == "update" and g.op(i).out_shapes == ((16, 32),)]
    assert updates and all(u.layer == "layer_0" for u in updates)
    kinds = [g.tensor(t).kind for t in g.inputs]
    assert kinds.count("param") == 2 and kinds.count("batch") == 2 and kinds.count("opt_state") == 5
    assert g.param_count == 16 * 32 + 32 * 4
    # Updated parameters alias their inputs (a plan must keep them in one sharding).
    outs = ops_of(g, "output")
    assert outs[0].params["alias_of"] == g.inputs[0]
    assert outs[-1].params["alias_of"] is None  # the loss


def test_operator_records_agree_with_their_tensors():
    # The capture keeps shapes, dtypes and bytes per tensor id instead of asking TensorInfo each time: every
    # operator's record must still be what its tensors say (mixed dtypes: bf16 compute, fp32 masters, int labels).
    from autopar_lab.graph import opcost

    g = al.models.get("gpt-tiny", num_layers=2, dtype="bfloat16").trace()
    dtypes = {g.tensor(t).dtype for t in g.tensors}
    assert {"bfloat16", "float32", "int32"} <= dtypes
    for node in g:
        ins = [g.tensor(t) for t in node.inputs]
        outs = [g.tensor(t) for t in node.outputs]
        assert node.in_shapes == tuple(t.shape for t in ins) and node.out_shapes == tuple(t.shape for t in outs)
        assert node.in_dtypes == tuple(t.dtype for t in ins) and node.out_dtypes == tuple(t.dtype for t in outs)
        assert node.input_kinds == tuple(t.kind for t in ins)
        assert (node.bytes_read, node.bytes_written) == opcost.op_bytes(
            node.primitive, [t.nbytes for t in ins], [t.nbytes for t in outs])
        assert all(t.producer == node.id for t in outs)
    assert all(g.tensor(t).kind in ("param", "opt_state", "batch") and g.tensor(t).path.startswith("args[")
               for t in g.inputs)


def test_graph_structure_and_summary():
    step, args = _train_step()
    g = al.trace(step, *args, batch_argnums=(2,), opt_state_argnums=(1,), name="toy")
    assert list(g.ops) == list(range(len(g)))
    import networkx as nx

    assert nx.is_directed_acyclic_graph(g.nx)
    assert all(u < v for u, v in g.nx.edges)  # ids are a topological order
    s = g.summary()
    assert s["model"] == "toy" and s["num_ops"] == len(g)
    assert s["param_bytes"] == 4 * g.param_count
    assert abs(sum(s["flops_by_primitive"].values()) - g.total_flops) < 1e-6
    assert len(g.fingerprint) == 16
    g2 = al.trace(step, *args, batch_argnums=(2,), opt_state_argnums=(1,))
    assert g2.fingerprint == g.fingerprint


def test_scope_parsing():
    assert scope_layer_and_role("transpose(jvp(layer_3))/attn") == ("layer_3", "backward")
    assert scope_layer_and_role("jvp()") == (None, "forward")
    assert scope_layer_and_role("outer/jvp(inner)") == ("outer", "forward")


def test_concrete_arrays_are_only_read_for_their_shapes():
    x = jnp.ones((4, 8))
    g = al.trace(lambda a: a.sum(), x)
    assert g.tensor(g.inputs[0]).shape == (4, 8)


# --- bad input ----------------------------------------------------------------------------------------------


def test_not_a_function():
    with pytest.raises(TraceError, match="must be a function"):
        al.trace(42, sds(3))


def test_untraceable_function_names_the_problem():
    def branchy(x):
        if x.sum() > 0:  # Python control flow on a traced value
            return x
        return -x

    with pytest.raises(TraceError, match="could not trace branchy") as e:
        al.trace(branchy, sds(4))
    assert "float32[4]" in str(e.value)


def test_mismatched_arguments_name_the_shapes():
    with pytest.raises(TraceError) as e:
        al.trace(lambda a, b: a @ b, sds(4, 5), sds(6, 7))
    msg = str(e.value)
    assert "float32[4, 5]" in msg and "float32[6, 7]" in msg and "dot_general" in msg


def test_bad_argnums_and_leaves():
    with pytest.raises(TraceError, match="batch_argnums=\\(3,\\) names argument 3"):
        al.trace(lambda a: a, sds(2), batch_argnums=(3,))
    with pytest.raises(TraceError, match=r"argument leaf \['name'\] is a str"):
        al.trace(lambda a: a["x"], {"x": sds(2), "name": "hello"})
