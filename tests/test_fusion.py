"""Kernels, not operators (autopar_lab.graph.fusion): how a compiler groups a step's operators into kernels, and
the per-operator prices that add up to each kernel's roofline."""

import math

import jax
import jax.numpy as jnp
import pytest

import autopar_lab as al
from autopar_lab.cluster import Cluster
from autopar_lab.graph.capture import trace
from autopar_lab.graph.fusion import attach_kernel_roles, kernel_role, kernel_view
from autopar_lab.sharding import strategies_for

F32 = jnp.float32


def sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(scope="module")
def gpt():
    return al.models.get("gpt-tiny", num_layers=2, seq_len=64, hidden_size=64, num_heads=4, batch_size=4,
                         dtype="float16").trace()


def _kinds(graph, view, layer, role):
    return sorted(k.kind for k in view.kernels if k.layer == layer and k.role == role)


def test_a_matmul_takes_its_elementwise_consumers_as_its_epilogue():
    g = trace(lambda w, b, x: jax.nn.relu(x @ w + b), sds(64, 64), sds(64), sds(32, 64))
    v = kernel_view(g)
    (k,) = v.kernels
    assert k.kind == "gemm" and g.op(k.root).primitive == "dot_general"
    root = v.roles[k.root]
    # The matmul's own output never reaches memory; the epilogue's does (and it reads the bias), and the root
    # prices that traffic: the output's bytes plus the bias's (64 of 32 x 64 elements).
    assert root.writes == (0.0,) and root.extra_bytes == pytest.approx(1.0 + 64 / (32 * 64))
    assert all(v.roles[o].absorbed for o in k.ops if o != k.root)


def test_elementwise_chains_fuse_and_a_reduction_ends_a_kernel():
    g = trace(lambda x: jnp.sum(jnp.exp(jnp.tanh(x) * 2.0 + 1.0), axis=-1) * 3.0, sds(128, 256))
    v = kernel_view(g)
    kinds = [(k.kind, [g.op(o).primitive for o in k.ops]) for k in v.kernels]
    # tanh and exp are a reduction's input fusion; the multiply after the sum is a kernel of its own
    assert kinds[0][0] == "reduce" and {"tanh", "exp", "reduce_sum"} <= set(kinds[0][1])
    assert len(v.kernels) == 2 and v.kernels[1].kind == "loop"
    # Inside the first kernel, nothing is read or written but x and the row sums.
    read = sum(f * g.tensor(t).nbytes for o in v.kernels[0].ops for f, t in zip(v.roles[o].reads, g.op(o).inputs))
    written = sum(f * g.tensor(t).nbytes for o in v.kernels[0].ops
                  for f, t in zip(v.roles[o].writes, g.op(o).outputs))
    assert read == 128 * 256 * 4 and written == 128 * 4


def test_dead_operators_cost_nothing_and_launch_no_kernel():
    # jax.grad of a function whose value is not returned: the forward's last matmul is dead.
    step = jax.grad(lambda w1, w2, x: jnp.sum(jnp.tanh(x @ w1) @ w2), argnums=(0, 1))
    g = trace(step, sds(32, 32), sds(32, 32), sds(64, 32), param_argnums=(0, 1), batch_argnums=(2,))
    v = kernel_view(g)
    dead = [o for o, r in v.roles.items() if r.kind == "dead"]
    assert dead and all(o not in k.ops for k in v.kernels for o in dead)
    attach_kernel_roles(g)
    mesh = Cluster.preset("p3.16xlarge").logical_mesh((1, 1), (1, 1))
    assert all(s.compute_s == 0.0 for o in dead for s in strategies_for(g.op(o), mesh))


def test_kernels_of_a_gpt_layer_and_flash_attention(gpt):
    plain, flash = kernel_view(gpt, False), kernel_view(gpt, True)
    assert "attention" not in _kinds(gpt, plain, "layer_0", "forward")
    assert _kinds(gpt, flash, "layer_0", "forward").count("attention") == 1
    assert _kinds(gpt, flash, "layer_0", "backward").count("attention") == 1
    (fwd,) = [k for k in flash.kernels if k.kind == "attention" and k.layer == "layer_0" and k.role == "forward"]
    (bwd,) = [k for k in flash.kernels if k.kind == "attention" and k.layer == "layer_0" and k.role == "backward"]
    # The forward kernel runs both attention matmuls (and the mask and softmax between them), causal: half the work.
    assert [gpt.op(o).primitive for o in fwd.ops].count("dot_general") == 2 and flash.roles[fwd.root].work == 0.5
    # The backward kernel recomputes the scores: its four matmuls plus the forward's first.
    assert flash.roles[bwd.root].extra_mm == pytest.approx(4.0)
    # No s x s tensor is kept for the backward under flash attention; without it, the softmax's output is.
    score = (4, 4, 64, 64)
    assert any(tuple(sorted(gpt.tensor(t).shape)) == tuple(sorted(score)) for t in plain.saved)
    assert not any(tuple(sorted(gpt.tensor(t).shape)) == tuple(sorted(score)) for t in flash.saved)
    assert len(flash.saved) < len(plain.saved)


def test_mixed_precision_master_weights_are_found(gpt):
    v = kernel_view(gpt)
    params = [t for t in gpt.inputs if gpt.tensor(t).kind == "param"]
    assert params and set(v.masters) == set(params) and set(v.masters.values()) == {0.5}
    pure = al.models.get("gpt-tiny", num_layers=2, dtype="float16", mixed_precision=False).trace()
    assert kernel_view(pure).masters == {}


def test_operator_prices_add_up_to_their_kernels_rooflines():
    """A fused elementwise kernel costs its external bytes at the achievable bandwidth, once: the sum of its
    operators' prices; a matmul kernel costs max(its FLOPs at the GEMM rate, its traffic with the epilogue's)."""
    g = trace(lambda w, x: jax.nn.gelu(x @ w) * 2.0, sds(1024, 4096), sds(2048, 1024))
    attach_kernel_roles(g)
    c = Cluster.preset("dgx-a100")
    mesh, d = c.logical_mesh((1, 1), (1, 1)), c.device
    v = kernel_view(g)
    (k,) = v.kernels
    total = sum(strategies_for(g.op(o), mesh)[0].compute_s for o in g.ops)
    flops = 2 * 2048 * 1024 * 4096
    rate = d.matmul_rate("float32", 2048, 4096, 1024)
    traffic = (2048 * 1024 + 1024 * 4096 + 2048 * 4096) * 4  # x and w read, the epilogue's output written
    # every other operator prices its own elementwise work: the epilogue's members and the cheap ones inlined into
    # them alike
    vec = sum(g.op(o).flops for o in g.ops if o != k.root) / d.vector_rate("float32")
    assert total == pytest.approx(max(flops / rate, traffic / d.achievable_bandwidth) + vec, rel=1e-9)
    assert kernel_role(g.op(k.root)).root


def test_a_deep_model_has_the_same_kernels_in_every_layer():
    g = al.models.get("gpt-tiny", num_layers=24, dtype="float16").trace()
    v = kernel_view(g)
    per_layer = [tuple(sorted((k.kind, k.role) for k in v.kernels if k.layer == f"layer_{i}")) for i in range(24)]
    assert len(set(per_layer[1:-1])) == 1 and len(per_layer[0]) > 10
    # every live operator belongs to exactly one kernel or is folded into one
    assert all((r.kernel >= 0) == (r.kind not in ("dead", "inline", "free")) for r in v.roles.values())
    assert math.isclose(sum(1 for r in v.roles.values() if r.root), len(v.kernels))


def _traffic(g, view):
    """Bytes the view's kernels read and write over the whole graph."""
    total = 0.0
    for o in g.ops:
        r, n = view.roles.get(o), g.op(o)
        if r is None:
            continue
        ins, outs = [g.tensor(t).nbytes for t in n.inputs], [g.tensor(t).nbytes for t in n.outputs]
        total += sum(f * b for f, b in zip(r.reads, ins)) + sum(w * b for w, b in zip(r.writes, outs)) + \
            r.extra_bytes * sum(outs)
    return total


def test_eager_execution_runs_every_elementwise_operator_through_memory():
    """PyTorch without torch.compile: tanh(x @ w + b) is three kernels, the bias add reading the matmul's output and
    the bias and writing its sum, tanh reading that and writing its own: (MK + KN + N + 5 MN) floats of traffic
    where the fused matmul with its epilogue moves (MK + KN + N + MN)."""
    M, K, N = 64, 32, 16
    g = trace(lambda w, b, x: jnp.tanh(x @ w + b), jnp.zeros((K, N)), jnp.zeros(N), jnp.zeros((M, K)))
    fused, eager = kernel_view(g), kernel_view(g, eager=True)
    assert [k.kind for k in eager.kernels] == ["gemm", "loop", "loop"] and len(fused.kernels) == 1
    assert _traffic(g, fused) == 4 * (M * K + K * N + N + M * N)
    assert _traffic(g, eager) == 4 * (M * K + K * N + N + 5 * M * N)
    assert eager.saved == fused.saved  # what the backward keeps is autodiff's, however the kernels run
    # priced so on a device without a fusing compiler: the add and tanh each pay the roofline of their traffic
    attach_kernel_roles(g, eager=True)
    tanh = next(n for n in g if n.primitive == "tanh")
    assert kernel_role(tanh, eager=True).root and not kernel_role(tanh).root


@pytest.mark.slow
def test_fsdp_plan_prices_torchtitan_without_torch_compile_as_eager():
    model = al.models.get("gpt-tiny", batch_size=8, dtype="bfloat16")
    cluster = Cluster.preset("dgx-h100")
    compiled = al.fsdp_plan(model, cluster, precision="bf16")
    eager = al.fsdp_plan(model, cluster, precision="bf16", compile=False)
    assert compiled.cluster.device.efficiency.kernel_fusion and not eager.cluster.device.efficiency.kernel_fusion
    assert eager.cost.kernels > compiled.cost.kernels and eager.cost.step_time_s > compiled.cost.step_time_s
    assert al.fsdp_plan(model, cluster, precision="bf16", compile=True).cost.step_time_s == \
        compiled.cost.step_time_s  # the presets' default is a fusing compiler
    with pytest.raises(ValueError, match="built with kernel_fusion=True, but compile=False"):
        al.fsdp_plan(table=compiled.table, precision="bf16", compile=False)
    # torchtitan's own switch, read from its job configuration
    toml = '[training]\nlocal_batch_size = 1\nmixed_precision_param = "bfloat16"\ncompile = false\n'
    imported = al.import_config(toml, model, cluster=cluster, framework="torchtitan")
    assert not imported.cluster.device.efficiency.kernel_fusion
