"""The DeepSeek-V3 shape: multi-head latent attention and shared + routed experts against hand counts, the layer map
of a deep copy (dense layers to a dense copy layer, MoE layers to an MoE one), and the tiny copy training as a
pipeline and with its experts split over a mesh axis exactly like one device."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.graph.opgraph import FORWARD
from autopar_lab.models import deepseek
from autopar_lab.pricing import CostTable
from autopar_lab.pricing.deepmap import derive
from autopar_lab.pricing.table import solve_graph_for
from autopar_lab.sharding.experts import expert_matmuls

FAST = {"xla_backend_optimization_level": 0}


def forward_matmul_flops(graph) -> float:
    return sum(op.flops for op in graph if op.primitive == "dot_general" and op.role == FORWARD)


def mla_params(c) -> int:
    H, nh, dn, dr, dv, ql, kl = (c.hidden_size, c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                                 c.q_lora_rank, c.kv_lora_rank)
    q = H * ql + ql + ql * nh * (dn + dr) if ql else H * nh * (dn + dr)
    return q + H * (kl + dr) + kl + kl * nh * (dn + dv) + nh * dv * H


def deepseek_params(c) -> int:
    """Hand count: embedding + lm_head + final norm; per layer MLA, two norms, and a dense SwiGLU (first layers) or
    the router, the routed experts and the shared experts."""
    H, F, Fe, E = c.hidden_size, c.ffn_hidden, c.moe_ffn_hidden, c.num_experts
    dense = c.first_dense_layers
    moe = c.num_layers - dense
    per_layer = mla_params(c) + 2 * H
    return (2 * c.vocab_size * H + H + c.num_layers * per_layer + dense * 3 * H * F
            + moe * (H * E + 3 * (E + c.num_shared_experts) * H * Fe))


def test_published_parameter_count_and_activated_parameters():
    spec = al.models.get("deepseek-v3")
    c = spec.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
            c.qk_rope_head_dim, c.v_head_dim, c.first_dense_layers, c.ffn_hidden, c.num_experts, c.num_shared_experts,
            c.top_k, c.moe_ffn_hidden, c.vocab_size, c.seq_len) == \
        (61, 7168, 128, 1536, 512, 128, 64, 128, 3, 18432, 256, 1, 8, 2048, 129280, 4096)
    assert spec.param_count == deepseek_params(c) == 671_026_404_352            # 671B (the report, without MTP)
    # activated per token: every routed expert but the top 8 of each MoE layer idle -> the report's 37B
    idle = (c.num_layers - c.first_dense_layers) * (c.num_experts - c.top_k) * 3 * c.hidden_size * c.moe_ffn_hidden
    assert abs((spec.param_count - idle) / 37e9 - 1) < 0.02
    assert spec.family == "deepseek" and c.dtype == "bfloat16" and c.mixed_precision


@pytest.mark.parametrize("q_lora_rank", [16, 0])
def test_mla_dense_and_routed_forward_flops_equal_the_hand_count(q_lora_rank):
    spec = al.models.get("deepseek-tiny", num_layers=3, first_dense_layers=1, batch_size=2, seq_len=32,
                         expert_group_size=16, q_lora_rank=q_lora_rank)
    c = spec.config
    B, S, N, H, nh = c.batch_size, c.seq_len, c.batch_size * c.seq_len, c.hidden_size, c.num_heads
    dn, dr, dv, ql, kl = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank, c.kv_lora_rank
    q = 2 * N * (H * ql + ql * nh * (dn + dr)) if ql else 2 * N * H * nh * (dn + dr)
    kv = 2 * N * (H * (kl + dr) + kl * nh * (dn + dv))                  # down to the latent + RoPE key, up per head
    core = 2 * B * nh * S * S * (dn + dr) + 2 * B * nh * S * S * dv      # QK^T over nope + rope dims, then PV
    attn = q + kv + core + 2 * N * nh * dv * H
    dense = 6 * N * H * c.ffn_hidden
    moe = 2 * N * H * c.num_experts + c.top_k * 6 * N * H * c.moe_ffn_hidden \
        + c.num_shared_experts * 6 * N * H * c.moe_ffn_hidden
    want = 3 * attn + 1 * dense + 2 * moe + 2 * N * H * c.vocab_size
    g = spec.trace()
    assert forward_matmul_flops(g) == want
    assert len(expert_matmuls(g)) == 3 * 2                                # gate, up, down of the two MoE layers
    assert spec.param_count == deepseek_params(c)


def test_scopes_name_the_latent_projections_and_experts():
    g = al.models.get("deepseek-tiny").trace()
    assert g.layers == ["embed", "layer_0", "layer_1", "head"]

    def modules(layer):
        return {op.scope.split("/", 1)[1] for op in g if op.layer == layer and op.role == FORWARD and "/" in op.scope}

    for m in ("attn/q_down", "attn/q_norm", "attn/q_up", "attn/kv_down", "attn/kv_norm", "attn/kv_up", "attn/rope",
              "attn/o_proj", "mlp/gate", "mlp/up", "mlp/down"):
        assert any(s == m or s.startswith(m + "/") for s in modules("layer_0")), m
    for m in ("moe/router", "moe/dispatch", "moe/experts/gate", "moe/experts/down", "moe/combine",
              "moe/shared_experts/gate", "moe/shared_experts/down"):
        assert any(s == m or s.startswith(m + "/") for s in modules("layer_1")), m
    assert not any(s.startswith("moe") for s in modules("layer_0"))
    p = al.models.get("deepseek-tiny").abstract_args[0]["layers"]
    assert p[0]["attn"]["kv_down"].shape == (32, 8 + 4) and p[0]["attn"]["kv_up"].shape == (8, 4 * (8 + 8))
    assert set(p[1]["moe"]) == {"router", "experts", "shared_experts"} and "mlp" in p[0]


@pytest.mark.parametrize("overrides, message", [
    (dict(num_experts=4, top_k=5), r"top_k \(5\) cannot exceed num_experts \(4\)\."),
    (dict(qk_rope_head_dim=3), r"qk_rope_head_dim \(3\) must be even for RoPE\."),
    (dict(expert_group_size=5), r"seq_len \(16\) must be divisible by expert_group_size \(5\)\."),
    (dict(kv_lora_rank=0), r"kv_lora_rank must be between 1 and"),
    (dict(num_kv_heads=4), r"unknown config field.*'num_kv_heads'"),
])
def test_bad_combinations_are_one_clear_sentence(overrides, message):
    with pytest.raises(ValueError, match=message):
        al.models.get("deepseek-tiny", **overrides)


# ------------------------------------------------------------------ the shallow copies and the layer map

def test_a_shallow_copy_keeps_an_moe_layer_after_the_dense_ones():
    v3 = al.models.get("deepseek-v3")
    assert v3.with_layers(4).config.first_dense_layers == 3                 # 3 dense + 1 MoE: both kinds as is
    deep = al.models.get("deepseek-tiny", num_layers=24, first_dense_layers=5)
    four, six = deep.with_layers(4), deep.with_layers(6)
    assert (four.config.first_dense_layers, six.config.first_dense_layers) == (3, 3)   # capped alike: MoE kept
    assert deepseek.num_moe_layers(four.config) == 1
    assert {f: getattr(four.config, f) for f in ("hidden_size", "num_experts", "top_k", "batch_size")} == \
        {f: getattr(deep.config, f) for f in ("hidden_size", "num_experts", "top_k", "batch_size")}
    dense = al.models.get("deepseek-tiny", num_layers=8, first_dense_layers=8)   # no MoE layer: nothing to keep
    assert dense.with_layers(4).config.first_dense_layers == 8


def _kinds(graph) -> list[str]:
    """Per layer of ``graph``: "moe", "dense" or "" (embed, head), read from the operators' scopes."""
    out = []
    for name in graph.layers:
        scopes = {graph.op(o).scope for o in graph.ops_in_layer(name)}
        out.append("moe" if any("/moe/" in s for s in scopes) else "dense" if any("/mlp/" in s for s in scopes)
                   else "")
    return out


def _check_layer_map(model):
    table = CostTable.build(model, al.Cluster.preset("dgx-h100", hosts=1))
    assert table.solve_graph is not table.graph                               # planned on the 4-layer copy
    full, small = _kinds(table.graph), _kinds(table.solve_graph)
    c = model.config
    want = [""] + ["moe" if deepseek.is_moe_layer(c, i) else "dense" for i in range(c.num_layers)] + [""]
    assert full == want
    assert [small[k] for k in table.layer_map] == full                        # each layer priced by its own kind
    return table


@pytest.mark.parametrize("first_dense", [2, 3, 5])
def test_layer_map_sends_dense_layers_to_a_dense_copy_layer_and_moe_to_moe(first_dense):
    """2 dense layers: the 4- and 6-layer copies' pattern extends to the full model (derived without the full trace);
    3 (DeepSeek-V3's) or 5 (more than a copy keeps): the copies' blocks disagree, so the pattern is refused and the
    full model's layers are matched by structure."""
    model = al.models.get("deepseek-tiny", num_layers=8, first_dense_layers=first_dense)
    derived = derive(8, solve_graph_for(model), lambda: model.with_layers(6).trace())
    assert (derived is None) == (first_dense >= 3)
    _check_layer_map(model)


@pytest.mark.slow
def test_deepseek_v3_at_full_size_layer_map_and_flops():
    """The 61-layer DeepSeek-V3 as users plan it: traced in full from abstract shapes, its 3 dense and 58 MoE layers
    mapped to their kind in the 4-layer copy, and its forward matmul FLOPs the hand count at full size."""
    model = al.models.get("deepseek-v3")
    table = _check_layer_map(model)
    c = model.config
    N, H, nh, S = c.batch_size * c.seq_len, c.hidden_size, c.num_heads, c.seq_len
    attn = 2 * N * (H * c.q_lora_rank + c.q_lora_rank * nh * 192 + H * 576 + 512 * nh * 256 + nh * 128 * H) \
        + 2 * c.batch_size * nh * S * S * (192 + 128)
    moe = 2 * N * H * 256 + (8 + 1) * 6 * N * H * 2048
    want = 61 * attn + 3 * 6 * N * H * 18432 + 58 * moe + 2 * N * H * 129280
    assert forward_matmul_flops(table.graph) == want


# ------------------------------------------------------------------ training

@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
def test_two_stage_dp2_tp2_pipeline_trains_like_one_device():
    from reference import one_device_training

    model = al.models.get("deepseek-tiny", batch_size=8)
    plan = al.megatron_plan(model, al.Cluster.preset("cpu", hosts=1), dp=2, tp=2, pp=2, microbatches=2)
    assert len(plan.stages) == 2
    losses = al.execute(plan, model, compiler_options=FAST).train(3)
    ref, _ = one_device_training(model, 3, compiler_options=FAST)
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
def test_experts_split_over_a_mesh_axis_train_like_one_device():
    from reference import one_device_training

    from autopar_lab.overrides import with_expert_parallel
    from autopar_lab.parallelism import expert_degree

    model = al.models.get("deepseek-tiny", batch_size=8)
    plan = with_expert_parallel(al.data_parallel_plan(model, al.Cluster.preset("cpu", hosts=1)), (0,))
    assert expert_degree(plan) == 8
    runner = al.execute(plan, model, compiler_options=FAST)
    losses = runner.train(3)
    ref, _ = one_device_training(model, 3, compiler_options=FAST)
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-6)
    assert runner.params["layers"][1]["moe"]["experts"]["up"].sharding.spec[0] == "x"
