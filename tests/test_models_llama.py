"""The Llama 3 family (and the Mixtral / Qwen3-MoE shapes): parameters and matmul FLOPs against hand counts,
grouped-query attention sharded by whole KV heads, routed experts dispatched by index and split over a mesh axis,
and the tiny copies training as pipelines exactly like one device."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.graph.fusion import kernel_view
from autopar_lab.graph.opgraph import FORWARD
from autopar_lab.models import llama
from autopar_lab.models.routing import assign_slots, capacity
from autopar_lab.sharding.experts import expert_matmuls
from autopar_lab.sharding.strategies import strategies_for, unsupported_ops

FAST = {"xla_backend_optimization_level": 0}


def forward_matmul_flops(graph) -> float:
    return sum(op.flops for op in graph if op.primitive == "dot_general" and op.role == FORWARD)


# ------------------------------------------------------------------ parameters

def llama_params(c) -> int:
    """Hand count: embedding + lm_head, final norm, per layer attention (q, k, v, o), two norms, FFN."""
    H, V, L, nh, kv = c.hidden_size, c.vocab_size, c.num_layers, c.num_heads, c.num_kv_heads
    hd = c.head_dim or H // nh
    attn = H * nh * hd + 2 * H * kv * hd + nh * hd * H + (2 * hd if c.qk_norm else 0)
    if c.num_experts:
        F = c.moe_ffn_hidden or c.ffn_hidden
        ffn = H * c.num_experts + 3 * c.num_experts * H * F + 3 * H * c.num_shared_experts * F
    else:
        ffn = 3 * H * c.ffn_hidden
    return 2 * V * H + H + L * (attn + 2 * H + ffn)


def test_published_parameter_counts():
    # Llama 3 8B: 32 layers of (4096x4096 q, o; 4096x1024 k, v; 3 x 4096x14336 SwiGLU; two norms) + 2 x 128256x4096
    assert llama_params(al.models.config_of("llama3-8b")) == 8_030_261_248
    for name, published in [("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9), ("llama3-405b", 405.85e9),
                            ("mixtral-8x7b", 46.70e9), ("qwen3-30b-a3b", 30.53e9)]:
        spec = al.models.get(name)
        assert spec.param_count == llama_params(spec.config)
        assert abs(spec.param_count / published - 1) < 1e-3, (name, spec.param_count)
        assert spec.family == "llama" and spec.config.dtype == "bfloat16"
        assert all(x.dtype == np.float32 for x in jax.tree_util.tree_leaves(spec.abstract_args[0]))  # fp32 masters
    c = al.models.config_of("llama3-70b")
    assert (c.num_layers, c.hidden_size, c.ffn_hidden, c.num_heads, c.num_kv_heads, c.vocab_size, c.seq_len,
            c.batch_size, c.rope_theta) == (80, 8192, 28672, 64, 8, 128256, 8192, 512, 500000.0)


def test_parameter_paths_name_the_modules():
    p = al.models.get("qwen3-moe-tiny", num_shared_experts=1).abstract_args[0]
    c = al.models.config_of("qwen3-moe-tiny")
    layer = p["layers"][1]
    assert set(layer) == {"attn_norm", "attn", "mlp_norm", "moe"}
    assert set(layer["attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
    assert layer["attn"]["q_proj"].shape == (c.hidden_size, c.num_heads * c.head_dim)   # 4 x 16 = 64 != hidden 32
    assert layer["attn"]["k_proj"].shape == (c.hidden_size, c.num_kv_heads * c.head_dim)
    assert set(layer["moe"]) == {"router", "experts", "shared_experts"}
    assert layer["moe"]["experts"]["gate"].shape == (c.num_experts, c.hidden_size, c.moe_ffn_hidden)
    assert layer["moe"]["experts"]["down"].shape == (c.num_experts, c.moe_ffn_hidden, c.hidden_size)
    dense = al.models.get("llama3-tiny").abstract_args[0]["layers"][0]
    assert set(dense["mlp"]) == {"gate", "up", "down"} and "moe" not in dense
    assert set(al.models.get("llama3-tiny").abstract_args[0]) == {"embed", "layers", "final_norm", "lm_head"}


# ------------------------------------------------------------------ forward matmul FLOPs

def attention_flops(c, B, S) -> float:
    """GQA: q and o over all heads, k and v over the KV heads only; QK^T and PV over the full S x S square."""
    N, H, nh, kv = B * S, c.hidden_size, c.num_heads, c.num_kv_heads
    hd = c.head_dim or H // nh
    return 2 * N * H * nh * hd + 2 * 2 * N * H * kv * hd + 2 * N * nh * hd * H + 2 * 2 * B * nh * S * S * hd


def test_gqa_and_swiglu_forward_flops_equal_the_hand_count():
    spec = al.models.get("llama3-tiny", num_heads=8, num_kv_heads=2, head_dim=6, hidden_size=40, ffn_hidden=56,
                         seq_len=24, batch_size=3, num_layers=3, vocab_size=72)
    c = spec.config
    B, S, N, H = c.batch_size, c.seq_len, c.batch_size * c.seq_len, c.hidden_size
    per_layer = attention_flops(c, B, S) + 3 * 2 * N * H * c.ffn_hidden          # SwiGLU: gate, up, down
    want = c.num_layers * per_layer + 2 * N * H * c.vocab_size                  # + lm_head
    g = spec.trace()
    assert forward_matmul_flops(g) == want
    # the K and V projections are kv / heads of Q's: 1/4 here
    kproj = [op for op in g if op.primitive == "dot_general" and op.role == FORWARD and "k_proj" in op.scope]
    qproj = [op for op in g if op.primitive == "dot_general" and op.role == FORWARD and "q_proj" in op.scope]
    assert len(kproj) == len(qproj) == c.num_layers
    assert kproj[0].flops * c.num_heads == qproj[0].flops * c.num_kv_heads


@pytest.mark.parametrize("capacity_factor, shared", [(1.0, 1), (1.25, 0)])
def test_routed_expert_forward_flops_equal_the_hand_count(capacity_factor, shared):
    spec = al.models.get("qwen3-moe-tiny", batch_size=2, seq_len=32, expert_group_size=16, num_layers=2,
                         capacity_factor=capacity_factor, num_shared_experts=shared)
    c = spec.config
    B, S, N, H, E, K, F = c.batch_size, c.seq_len, c.batch_size * c.seq_len, c.hidden_size, c.num_experts, c.top_k, \
        c.moe_ffn_hidden
    groups, cap = N // 16, math.ceil(capacity_factor * 16 * K / E)
    experts = 3 * 2 * E * groups * cap * H * F                                   # gate, up, down on E x C slots
    if capacity_factor == 1.0:
        assert experts == K * N * 6 * H * F       # exactly top_k x tokens x one expert's FLOPs: no one-hot einsum
    per_layer = attention_flops(c, B, S) + 2 * N * H * E + experts + shared * 6 * N * H * F
    g = spec.trace()
    assert forward_matmul_flops(g) == c.num_layers * per_layer + 2 * N * H * c.vocab_size
    # the expert matmuls are batched over the stacked weights' expert dimension: expert parallelism finds them
    mats = expert_matmuls(g)
    assert len(mats) == 3 * c.num_layers
    assert {g.tensor(g.op(p).outputs[0]).path.rsplit("[", 1)[1] for _j, _d, p in mats.values()} == \
        {"'gate']", "'up']", "'down']"}
    assert unsupported_ops(g) == []


# ------------------------------------------------------------------ routing

def brute_force_slots(experts, weights, E, cap):
    """Slot (e, c) of each group: the c-th choice of expert e in token order, if c < cap (a plain loop)."""
    G, T, K = experts.shape
    token = np.full((G, E, cap), -1)
    gate = np.zeros((G, E, cap))
    for g in range(G):
        fill = [0] * E
        for t in range(T):
            for k in range(K):
                e = experts[g, t, k]
                if fill[e] < cap:
                    token[g, e, fill[e]], gate[g, e, fill[e]] = t, weights[g, t, k]
                    fill[e] += 1
    return token, gate


def test_slots_are_assigned_first_come_within_capacity():
    G, T, K, E = 3, 24, 2, 4
    scores = jax.random.uniform(jax.random.PRNGKey(0), (G, T, E))
    weights, experts = jax.lax.top_k(scores, K)
    cap = capacity(T, E, K, 0.75)                                       # 9 slots for 12 choices a expert on average
    token, gate, counts = jax.jit(assign_slots, static_argnums=(2, 3))(experts, weights, E, cap)
    want_token, want_gate = brute_force_slots(np.asarray(experts), np.asarray(weights), E, cap)
    filled = want_token >= 0
    assert (~filled).any() and filled.any()
    np.testing.assert_array_equal(np.asarray(token).reshape(G, E, cap)[filled], want_token[filled])
    np.testing.assert_allclose(np.asarray(gate).reshape(G, E, cap), want_gate)   # 0 in the empty slots
    np.testing.assert_array_equal(np.asarray(counts), np.eye(E, dtype=int)[np.asarray(experts)].sum((1, 2)))
    assert sum(np.asarray(counts).clip(max=cap).ravel()) == filled.sum()           # dropped: over capacity only


# ------------------------------------------------------------------ names, layers, kernels

def test_layers_scopes_and_flash_attention_kernels():
    g = al.models.get("qwen3-moe-tiny", num_layers=3).trace()
    assert g.layer_rule == "indexed-scopes"
    assert g.layers == ["embed", "layer_0", "layer_1", "layer_2", "head"]
    scopes = {op.scope.split("/", 1)[1] for op in g if op.layer == "layer_1" and op.role == FORWARD and "/" in op.scope}
    for module in ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "attn/q_norm", "attn/rope",
                   "moe/router", "moe/dispatch", "moe/experts/gate", "moe/experts/up", "moe/experts/down",
                   "moe/combine", "attn_norm", "mlp_norm"):
        assert any(s == module or s.startswith(module + "/") for s in scopes), (module, sorted(scopes))
    # each layer's attention is one causal flash kernel forward and one backward (so long sequences price as such)
    v = kernel_view(g, True)
    att = [(g.op(k.root).layer, k.role) for k in v.kernels if k.kind == "attention"]
    assert sorted(att) == sorted((f"layer_{i}", r) for i in range(3) for r in ("forward", "backward"))


# ------------------------------------------------------------------ grouped-query attention's sharding

def _kv_reshapes(graph):
    """The forward reshapes of the K and V projections' outputs into [B, S, kv, hd]."""
    return [op for op in graph if op.primitive == "reshape" and op.role == FORWARD and len(op.out_shapes[0]) == 4
            and ("k_proj" in op.scope or "v_proj" in op.scope)]


@pytest.mark.parametrize("logical", [(1, 8), (2, 4)])
def test_tensor_parallelism_splits_whole_kv_heads_only(logical):
    """8 devices along a tensor axis, 4 KV heads: no strategy of the K/V reshape splits a head's dimensions, and the
    KV-head dimension is split only by a device count that divides 4 (whole heads per device)."""
    spec = al.models.get("llama3-tiny", hidden_size=64, num_heads=8, num_kv_heads=4, num_layers=1, batch_size=2)
    g = spec.trace()
    mesh = al.Cluster.preset("cpu", hosts=1).with_(devices_per_host=8).logical_mesh((1, 8), logical)
    ops = _kv_reshapes(g)
    assert len(ops) == 2 and all(op.out_shapes[0][2:] == (4, 8) for op in ops)
    split_heads = 0
    for op in ops:
        for s in strategies_for(op, mesh):
            out, inp = s.out_specs[0], s.in_specs[0]
            assert not out.dims[3], s.name                                            # head_dim never split
            n = math.prod(logical[a] for a in out.dims[2])
            assert 4 % n == 0, s.name                                                 # whole KV heads per device
            assert math.prod(logical[a] for a in inp.dims[2]) == n, s.name             # input split as the heads
            split_heads += n > 1
    assert (split_heads > 0) == (logical == (2, 4))    # over 2 or 4 devices: whole heads each; over 8: K/V unsplit


# ------------------------------------------------------------------ config overrides and errors

def test_every_field_is_configurable():
    spec = al.models.get("llama3-8b", num_kv_heads=4, ffn_hidden=1024, num_layers=2, seq_len=128, batch_size=2,
                         hidden_size=256, num_heads=8, vocab_size=1000, dtype="float32")
    p = spec.abstract_args[0]["layers"][0]
    assert p["attn"]["k_proj"].shape == (256, 4 * 32) and p["mlp"]["up"].shape == (256, 1024)
    assert spec.abstract_args[2]["tokens"].shape == (2, 128)
    moe = al.models.get("mixtral-8x7b", num_experts=4, top_k=1, num_layers=1, hidden_size=64, num_heads=4,
                        num_kv_heads=2, ffn_hidden=32, seq_len=16, batch_size=1, vocab_size=50)
    assert moe.abstract_args[0]["layers"][0]["moe"]["experts"]["up"].shape == (4, 64, 32)
    dense = al.models.get("mixtral-8x7b", num_experts=0, num_layers=1)
    assert "mlp" in dense.abstract_args[0]["layers"][0]
    assert set(al.models.names("llama")) >= {"llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b",
                                             "qwen3-30b-a3b", "llama3-tiny", "qwen3-moe-tiny"}
    assert "num_kv_heads" in al.models.fields("llama3-8b") and "moe_ffn_hidden" in al.models.fields("llama3-8b")


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=30), r"hidden_size \(30\) must be divisible by num_heads \(4\), or give head_dim\."),
    (dict(num_kv_heads=3), r"num_kv_heads \(3\) must divide num_heads \(4\)\."),
    (dict(head_dim=7), r"head_dim \(7\) must be even for RoPE\."),
    (dict(num_experts=4, top_k=5), r"top_k \(5\) cannot exceed num_experts \(4\)\."),
    (dict(num_shared_experts=1), r"num_shared_experts \(1\) needs routed experts: set num_experts > 0\."),
    (dict(num_experts=4, expert_group_size=6), r"seq_len \(16\) must be divisible by expert_group_size \(6\)\."),
    (dict(num_experts=4, router_score="relu"), r"router_score must be one of softmax, sigmoid"),
    (dict(num_experts=-1), r"num_experts must be between 0 and"),
    (dict(num_kv_heads=0), r"num_kv_heads must be between 1 and"),
    (dict(num_kv_head=2), r"unknown config field.*'num_kv_head'.*valid fields are: .*num_kv_heads"),
])
def test_bad_combinations_are_one_clear_sentence(overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        al.models.get("llama3-tiny", **overrides)
    assert str(e.value).count(". ") == 0 or "valid fields" in str(e.value)


# ------------------------------------------------------------------ training: pipelines and experts in parallel

def test_tiny_copies_learn_and_step_fast():
    for name in ("llama3-tiny", "qwen3-moe-tiny"):
        spec = al.models.get(name)
        step = jax.jit(spec.step_fn, compiler_options=FAST)
        params, opt, _ = spec.init(0)
        losses = []
        for i in range(8):
            params, opt, loss = step(params, opt, spec.init(i)[2])
            losses.append(float(loss))
        assert all(np.isfinite(losses)) and losses[-1] < 0.9 * losses[0], (name, losses)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
@pytest.mark.parametrize("name", ["llama3-tiny", "qwen3-moe-tiny"])
def test_two_stage_dp2_tp2_pipeline_trains_like_one_device(name):
    from reference import one_device_training

    model = al.models.get(name, batch_size=8)
    plan = al.megatron_plan(model, al.Cluster.preset("cpu", hosts=1), dp=2, tp=2, pp=2, microbatches=2)
    assert len(plan.stages) == 2 and all(st.logical_mesh == (2, 2) for st in plan.stages)
    losses = al.execute(plan, model, compiler_options=FAST).train(3)
    ref, _ = one_device_training(model, 3, compiler_options=FAST)
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
def test_experts_split_over_a_mesh_axis_train_like_one_device():
    from reference import one_device_training

    from autopar_lab.overrides import with_expert_parallel
    from autopar_lab.parallelism import expert_degree, expert_parallel

    model = al.models.get("qwen3-moe-tiny", batch_size=8, num_layers=1)
    cpu8 = al.Cluster.preset("cpu", hosts=1)
    plan = with_expert_parallel(al.data_parallel_plan(model, cpu8), (0,))
    assert expert_degree(plan) == 8
    (layer,) = expert_parallel(plan)[0]
    assert layer.axes == (0,) and layer.num_experts == 8
    runner = al.execute(plan, model, compiler_options=FAST)
    losses = runner.train(3)
    ref, _ = one_device_training(model, 3, compiler_options=FAST)
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)
    gate = runner.params["layers"][0]["moe"]["experts"]["gate"]
    assert gate.sharding.spec[0] == "x" and gate.addressable_shards[0].data.shape[0] == 1   # one expert a device


@pytest.mark.slow
def test_llama3_8b_plans_on_one_dgx_h100_and_fits():
    """As users plan it: Llama 3 8B (32 layers, planned on its 4-layer copy) on one 8-GPU DGX H100."""
    model = al.models.get("llama3-8b", batch_size=32, seq_len=4096)
    plan = al.auto_plan(model, al.Cluster.preset("dgx-h100", hosts=1))
    assert plan.cost.fits
    assert sum(st.layers[1] - st.layers[0] + 1 for st in plan.stages) == 34          # embed, 32 layers, head
    assert plan.table.solve_graph is not plan.table.graph and len(plan.table.solve_graph.layers) == 6
    assert llama.head_dim(model.config) == 128


def test_dispatch_and_combine_shard_like_the_batch_and_experts_take_all_to_alls():
    """The index-based dispatch (gather) and combine (scatter-add) have strategies that split the token groups with
    no communication, and the ILP splits the 8 experts over 8 devices with four all-to-alls of the dispatched
    tensor (dispatch and combine, forward and backward) of B = capacity_factor x top_k x tokens x hidden x bytes."""
    from autopar_lab.sharding.experts import expert_layers
    from autopar_lab.solve.intra import solve_intra

    # 8 groups of 64 tokens over 8 devices; the cpu link pinned as tests/test_moe.py pins it
    cpu8 = al.Cluster.preset("cpu", hosts=1).with_(devices_per_host=8, intra_host=al.Link(843551402.6727079, 6.972e-05),
                                                    inter_host=al.Link(843551402.6727079, 6.972e-05))
    spec = al.models.get("qwen3-moe-tiny", batch_size=8, seq_len=64, hidden_size=128, vocab_size=256, num_layers=1,
                         expert_group_size=64)
    c = spec.config
    g = spec.trace()
    mesh = cpu8.logical_mesh((1, 8), (8, 1))
    moved = [op for op in g if op.role == FORWARD and op.primitive in ("gather", "scatter-add")
             and ("/dispatch/" in op.scope or "/combine/" in op.scope) and len(op.out_shapes[0]) == 3]
    assert {op.primitive for op in moved} == {"gather", "scatter-add"}
    for op in moved:
        splits = [s for s in strategies_for(op, mesh) if s.out_specs[0].dims[0] == (0,)]
        assert any(not s.collectives and all(i.dims[0] == (0,) for i in s.in_specs[:2]) for s in splits), op.describe()
    intra = solve_intra(g, mesh)
    (layer,) = expert_layers(g, intra.strategies, mesh)
    assert layer.axes == (0,) and layer.degree == 8 and layer.num_experts == 8
    B = c.capacity_factor * c.top_k * c.batch_size * c.seq_len * c.hidden_size * 4
    assert layer.all_to_alls == (("all_to_all", 0, B),) * 4
    n = 8
    # NCCL-style all-to-all: one message per peer, n - 1 latencies inside the host
    one = (n - 1) * cpu8.intra_host.latency + (n - 1) / n**2 * B / mesh.axis_link(0).bandwidth
    assert layer.all_to_all_s == pytest.approx(4 * one, rel=1e-12)
