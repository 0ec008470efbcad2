"""Each stage's peak memory split into what holds it (autopar_lab.memory, autopar_lab.pricing.memory), and the memory
model against the reference formulas: 16 bytes a parameter for mixed-precision Adam, Korthikanti's activations."""

import jax
import jax.numpy as jnp
import pytest

import autopar_lab as al
from autopar_lab.memory import PARTS, memory_breakdown


@pytest.fixture(scope="module")
def deep():
    # 24 layers planned on the zoo's shallow copy (the engine prices 4 blocks and maps the 24 onto them).
    return al.models.get("gpt-tiny", num_layers=24, batch_size=16, hidden_size=64, seq_len=32, vocab_size=128)


@pytest.fixture(scope="module")
def two():
    return al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=2)


@pytest.fixture(scope="module")
def pipeline(deep, two):
    return al.megatron_plan(deep, two, dp=1, tp=1, pp=2, microbatches=4)


def _check_sums(plan):
    rows = memory_breakdown(plan)
    assert len(rows) == len(plan.stages)
    for r, st in zip(rows, plan.stages):
        assert r["total_bytes"] == st.peak_mem_bytes  # the very figure the plan reports
        assert sum(r[p] for p in PARTS) == pytest.approx(st.peak_mem_bytes, rel=1e-12)
        assert r["activations_bytes"] == r["microbatches_in_flight"] * r["act_per_microbatch_bytes"]
        assert all(r[p] >= 0 for p in PARTS)
    return rows


def test_parts_add_up_and_parameters_are_the_models(deep, pipeline):
    rows = _check_sums(pipeline)
    # One device per stage: each stage holds its layers' parameters whole, so together they are the model's.
    assert sum(r["params_bytes"] for r in rows) == deep.param_bytes
    assert all(r["grads_bytes"] == r["params_bytes"] for r in rows)
    # Adam: two float32 moments per parameter, plus its step counter (an int32, outside every layer: the last stage).
    assert [r["optimizer_bytes"] - 2 * r["params_bytes"] for r in rows] == [0.0, 4.0]
    # 1F1B with 4 microbatches on 2 stages: stage 0 holds 2 microbatches at its peak, stage 1 one.
    assert [r["microbatches_in_flight"] for r in rows] == [2, 1]
    assert all(not r["remat"] and r["remat_saved_bytes"] == 0 for r in rows)


def test_gpipe_holds_every_microbatch(pipeline):
    rows = _check_sums(pipeline.with_schedule("gpipe"))
    assert [r["microbatches_in_flight"] for r in rows] == [4, 4]


def test_tensor_parallel_halves_the_parameters(two):
    # Wide enough that the ILP splits the matmuls over the tensor-parallel axis (a 64-wide layer is cheaper
    # replicated: a collective's latency costs more than its matmuls).
    wide = al.models.get("gpt-tiny", num_layers=4, batch_size=4, hidden_size=512, seq_len=64, vocab_size=128,
                         num_heads=8)
    whole = al.megatron_plan(wide, two.with_(devices_per_host=1), dp=1, tp=1, pp=1, microbatches=4)
    split = al.megatron_plan(wide, two, dp=1, tp=2, pp=1, microbatches=4)
    a, b = memory_breakdown(whole)[0], _check_sums(split)[0]
    assert a["params_bytes"] == wide.param_bytes
    # Megatron's tensor split shards the matmul weights over 2 devices (layer norms, biases stay whole): near half.
    assert 0.5 * a["params_bytes"] <= b["params_bytes"] < 0.7 * a["params_bytes"]


def test_remat_saves_what_the_stage_no_longer_keeps(pipeline):
    plain = memory_breakdown(pipeline)[1]
    re = pipeline.with_remat(1, True)
    r = _check_sums(re)[1]
    assert r["remat"] and r["act_per_microbatch_bytes"] < plain["act_per_microbatch_bytes"]
    # What it would keep without remat (the plain stage's activations per microbatch), less what it keeps.
    assert r["remat_saved_bytes"] == pytest.approx(
        (plain["act_per_microbatch_bytes"] - r["act_per_microbatch_bytes"]) * r["microbatches_in_flight"], rel=1e-12)
    assert r["params_bytes"] == plain["params_bytes"]  # remat changes activations only


# ---------------------------------------------------------------------------------------------------------------
# The memory model against the reference formulas (published-measurements.md, "Memory facts")

S, H, A, BATCH = 128, 256, 8, 2


def _one_device(flash=False):
    return al.Cluster.preset("dgx-a100").with_(devices_per_host=1, flash_attention=flash)


def _layer(plan, name):
    k = plan.layer_names.index(name)
    return plan.stages[0].layer_costs[k]


@pytest.fixture(scope="module")
def gpt16():
    return al.models.get("gpt-tiny", seq_len=S, hidden_size=H, num_heads=A, num_layers=4, batch_size=BATCH,
                         vocab_size=128, dtype="float16")


def test_mixed_precision_adam_keeps_16_bytes_per_parameter(gpt16):
    # fp16 parameters (2) and gradients (2), fp32 master weights (4) and two moments (8): ZeRO's count.
    plan = al.megatron_plan(gpt16, _one_device(), dp=1, tp=1, pp=1)
    (r,) = _check_sums(plan)
    psi = gpt16.param_count
    assert r["params_bytes"] == 2 * psi and r["grads_bytes"] == 2 * psi and r["master_bytes"] == 4 * psi
    assert r["optimizer_bytes"] == 8 * psi + 4  # and Adam's step count
    # All in float16 (the zoo before mixed precision): 8 bytes, no master weights.
    pure = al.models.get("gpt-tiny", seq_len=S, hidden_size=H, num_heads=A, num_layers=4, batch_size=BATCH,
                         vocab_size=128, dtype="float16", mixed_precision=False)
    (q,) = memory_breakdown(al.megatron_plan(pure, _one_device(), dp=1, tp=1, pp=1))
    assert q["params_bytes"] + q["grads_bytes"] + q["optimizer_bytes"] == 8 * psi + 4 and q["master_bytes"] == 0


def test_full_recomputation_keeps_each_layers_input(gpt16):
    # Korthikanti et al.: full recomputation keeps only the layer input, 2 s b h bytes (fp16) per layer.
    plan = al.megatron_plan(gpt16, _one_device(), dp=1, tp=1, pp=1, remat=True, microbatches=2)
    for name in ("layer_1", "layer_2"):
        assert _layer(plan, name).ckpt_bytes == 2 * S * BATCH * H
    # Per microbatch in flight: every layer's input (and the embedding's tokens, the head's), nothing else.
    st = plan.stages[0]
    assert st.act_bytes == sum(c.ckpt_bytes for c in st.layer_costs) / 2
    # The recomputation's working set: one (average) layer's activations of one microbatch.
    (r,) = _check_sums(plan)
    assert r["recompute_bytes"] == pytest.approx(sum(c.act_bytes for c in st.layer_costs) / 2 / len(st.layer_costs))


def test_attention_scores_are_kept_only_without_flash_attention(gpt16):
    """Korthikanti's 5 a s^2 b bytes of attention scores per layer: the fp16 softmax output (2), the dropout mask
    (1) and output (2). The zoo's GPT has no dropout and computes its softmax in fp32: it keeps the exponentials
    (4) and the fp16 probabilities (2), 6 a s^2 b. A flash-attention kernel keeps none (it recomputes them)."""
    plain = al.megatron_plan(gpt16, _one_device(False), dp=1, tp=1, pp=1)
    flash = al.megatron_plan(gpt16, _one_device(True), dp=1, tp=1, pp=1)
    for name in ("layer_1", "layer_2"):
        assert _layer(plain, name).act_bytes - _layer(flash, name).act_bytes == 6 * A * S * S * BATCH
    # The rest is per token: s b h times a constant (Korthikanti's 34 with dropout and Megatron's fused kernels;
    # the zoo's GPT keeps its tanh-GeLU's intermediate products too).
    # Beside it, per-row statistics in float32 that Korthikanti leaves out as small: each layer norm's mean, its
    # rsqrt and its normalisation factor (2 x 3 x 4 bytes a token), and the softmax's row statistic per head (4 a).
    small = (2 * 3 * 4 + 4 * A) * S * BATCH
    per_token = (_layer(flash, "layer_1").act_bytes - small) / (S * BATCH * H)
    assert per_token == int(per_token) and 30 <= per_token <= 50


def test_a_gathered_parameter_copy_is_held_as_memory():
    """ZeRO-3 style: a parameter stored split over the devices and gathered for its matmul, the copy kept for the
    backward. The gathered copy is held all step: 16 psi / n plus the full float32 weights."""
    from autopar_lab.solve.intra import solve_intra

    def step(w, x):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    g = al.trace(step, jax.ShapeDtypeStruct((512, 512), jnp.float32), jax.ShapeDtypeStruct((4096, 512), jnp.float32),
                 param_argnums=(0,), batch_argnums=(1,))
    mesh = al.Cluster.preset("dgx-a100").logical_mesh((1, 8), (8, 1))
    w = next(o for o in g.ops if g.op(o).primitive == "parameter" and g.tensor(g.op(o).outputs[0]).kind == "param")
    dot = next(o for o in g.ops if g.op(o).primitive == "dot_general")
    split = solve_intra(g, mesh, pins={w: "S0R", dot: "S0R = S0R x RR"})
    whole = solve_intra(g, mesh, pins={w: "RR", dot: "S0R = S0R x RR"})
    full = 512 * 512 * 4
    # split: its shard and its gradient's (2 x full / 8) plus the gathered full copy; whole: the weight and its
    # gradient, nothing gathered.
    assert split.static_bytes == pytest.approx(2 * full / 8 + full)
    assert whole.static_bytes == pytest.approx(2 * full)


def test_tensor_parallelism_splits_the_attention_scores_by_heads(gpt16):
    """Korthikanti's tensor-parallel attention term, 5 a s^2 b / t: each of t devices keeps the scores of its a / t
    heads. Megatron-LM's sharding pinned (``al.megatron_plan``, the state stored whole: ``zero=0``) on t = 2: the zoo's
    6 a s^2 b of kept scores (above) become 6 a s^2 b / 2 per device."""
    def layer_act(flash, t=2):
        cluster = al.Cluster.preset("dgx-a100").with_(devices_per_host=t, flash_attention=flash)
        plan = al.megatron_plan(gpt16, cluster, dp=1, tp=t, pp=1, microbatches=1, zero=0)
        return _layer(plan, "layer_1").act_bytes

    t = 2
    assert layer_act(False) - layer_act(True) == 6 * A * S * S * BATCH / t
    # The per-token part has Korthikanti's form s b h (R + X / t) (theirs: 10 + 24 / t with dropout): what the
    # sharded matmuls read and write splits, the layer norms' inputs and outputs and the residual stream do not.
    # Beside it the float32 row statistics: the layer norms' (24 bytes a token, replicated), the softmax's (4 a / t).
    per_token = {t: (layer_act(True, t) - (24 + 4 * A / t) * S * BATCH) / (S * BATCH * H) for t in (1, 2, 4)}
    X = 2 * (per_token[1] - per_token[2])
    R = per_token[1] - X
    assert per_token[4] == R + X / 4  # the three meshes lie on R + X / t
    assert R == int(R) and X == int(X) and 8 <= R <= 14 and 24 <= X <= 34
