"""The layouts frameworks run, through the public API (issue 31): Megatron-LM's (``al.megatron_plan``), torchtitan's
(``al.fsdp_plan``) and MaxText's (``al.maxtext_plan``) on transformers the graph finds; ZeRO's memory against its
formula; no silent "does not fit" (the memory-lean stage, and the part that overflows, said in explain())."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

import autopar_lab as al
from autopar_lab import parallelism
from autopar_lab.graph.modules import module_labels
from autopar_lab.layouts import find_roles
from autopar_lab.layouts.fit import GROUPS
from autopar_lab.planfile import load_plan, save_plan
from autopar_lab.pricing.memory import memory_breakdown

A100 = al.Cluster.preset("dgx-a100")  # 8 devices on one host
GIB = 2**30
STATE = ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes")


def forward_matmuls(plan, layer="layer_0"):
    """module label -> the strategy of that layer's forward matmul (or gather) of ``plan``'s first stage."""
    g, st = plan.op_graph, plan.stages[0].intra.strategies
    labels = module_labels(g)
    return {labels[o].label: st[o] for o in g.ops if g.op(o).layer == layer and g.op(o).role == "forward"
            and g.op(o).primitive in ("dot_general", "gather") and labels[o].label}


def stored(plan, suffix):
    """The stored spec of the parameter whose path ends with ``suffix``."""
    g, st = plan.op_graph, plan.stages[0].intra.strategies
    (op,) = [o for o in g.ops if g.op(o).primitive == "parameter" and g.tensor(g.op(o).outputs[0]).kind == "param"
             and g.tensor(g.op(o).outputs[0]).path.endswith(suffix)]
    return str(st[op].out_specs[0])


def weight_spec(strategy):
    return str(strategy.in_specs[1])


# --- Megatron-LM's tensor parallelism, found by module labels and structure -----------------------------------------

@pytest.fixture(scope="module")
def llama_tp():
    """A small Llama (8 heads, 4 KV heads) on 2 x 4 A100s in Megatron-LM's layout, the state stored whole."""
    model = al.models.get("llama3-tiny", num_heads=8, num_kv_heads=4, batch_size=16, dtype="bfloat16")
    return al.megatron_plan(model, A100, dp=2, tp=4, pp=1, zero=0, precision="bf16")


def test_roles_are_found_by_module_labels_and_dataflow_not_names():
    for name, column, row in (("llama3-tiny", ["attn/q_proj", "attn/k_proj", "attn/v_proj", "mlp/gate", "mlp/up"],
                               ["attn/o_proj", "mlp/down"]),
                              ("gpt-tiny", ["qkv", "fc1"], ["proj", "fc2"]),
                              ("deepseek-tiny", ["attn/q_up", "attn/kv_up", "mlp/gate", "mlp/up",
                                                 "moe/shared_experts/gate", "moe/shared_experts/up"],
                               ["attn/o_proj", "mlp/down", "moe/shared_experts/down"])):
        roles = find_roles(al.models.get(name).trace())
        kinds = {r.label: r.kind for r in roles.matmuls.values()}
        assert [k for k, v in kinds.items() if v == "column"] == column, name
        assert [k for k, v in kinds.items() if v == "row"] == row, name
        assert [r.kind for r in roles.matmuls.values()].count("attention") == 2 * 2  # two layers' scores, context
        assert "embedding" in kinds.values()
        assert "head" in kinds.values()
    # MLA's low-rank down-projections feed a column matmul: kept whole, as Megatron-LM keeps them (and the router)
    kinds = {r.label: r.kind for r in find_roles(al.models.get("deepseek-tiny").trace()).matmuls.values()}
    assert kinds["attn/q_down"] == kinds["attn/kv_down"] == kinds["moe/router"] == "duplicated"
    assert kinds["moe/experts/up"] == "expert"


def test_megatron_pins_a_llama_column_then_row_with_vocabulary_parallel_ends(llama_tp):
    m = forward_matmuls(llama_tp)
    # weights [in, out]: column-parallel splits the output features over the tensor axis (1), row-parallel the input
    for col in ("attn/q_proj", "attn/k_proj", "attn/v_proj", "mlp/gate", "mlp/up"):
        assert weight_spec(m[col]) == "RS1" and not m[col].collectives, col
        assert str(m[col].in_specs[0]) == "S0RR"  # the batch over the data-parallel axis, whole over tp
    for row in ("attn/o_proj", "mlp/down"):
        assert weight_spec(m[row]) == "S1R"
        assert [(k, a) for k, a, _ in m[row].collectives] == [("all_reduce", 1)], row
    # attention by heads: the KV-head dimension (the second batch dimension) over the tensor axis, nothing exchanged
    g = llama_tp.op_graph
    for att in ("attn/scores", "attn/context"):
        op = next(o for o in g.ops_in_layer("layer_0") if module_labels(g)[o].label == att)
        _, bdims = g.op(op).params["dimension_numbers"]  # (batch, KV heads) of each operand
        assert [m[att].in_specs[j].dims[bdims[j][1]] for j in (0, 1)] == [(1,), (1,)] and not m[att].collectives
    assert [stored(llama_tp, f"['layers'][1]['attn']['{w}']") for w in ("q_proj", "k_proj", "o_proj")] == \
        ["RS1", "RS1", "S1R"]
    assert stored(llama_tp, "['layers'][1]['attn_norm']") == "R"
    # vocabulary-parallel embedding (a lookup of each rank's rows, all-reduced) and head (the logits split)
    emb = forward_matmuls(llama_tp, "embed")["embed"]
    assert str(emb.in_specs[0]) == "S1R" and [(k, a) for k, a, _ in emb.collectives] == [("all_reduce", 1)]
    head = next(s for k, s in forward_matmuls(llama_tp, "head").items() if k.startswith("lm"))
    assert weight_spec(head) == "RS1"  # lm_head [hidden, vocab]: the vocabulary over tp
    assert stored(llama_tp, "['embed']") == "S1R" and stored(llama_tp, "['lm_head']") == "RS1"


@pytest.fixture(scope="module")
def gpt16():
    """gpt-tiny (batch 16, fp16) and its cost table on the 8 A100s, what ``al.megatron_plan(model, A100, ...)`` builds:
    one table for this file's layouts of it, so each layout's pinned ILP is solved once (the tests only price)."""
    model = al.models.get("gpt-tiny", batch_size=16, dtype="float16")
    return model, al.CostTable.build(model, A100)


def test_with_more_tensor_ranks_than_kv_heads_k_and_v_stay_whole():
    model = al.models.get("llama3-tiny", num_heads=8, num_kv_heads=2, batch_size=16, dtype="bfloat16")
    plan = al.megatron_plan(model, A100, dp=2, tp=4, pp=1, zero=0, precision="bf16")
    m = forward_matmuls(plan)
    for kv in ("attn/k_proj", "attn/v_proj"):
        assert 1 not in m[kv].in_specs[1].axes, kv  # K and V computed whole on every tensor-parallel rank
        assert stored(plan, f"['layers'][0]['attn']['{kv[5:]}']") == "RR"
    assert weight_spec(m["mlp/gate"]) == "RS1"  # the rest of the layer keeps Megatron-LM's split
    assert any("attn/q_proj" in n for n in plan.notes)  # Q's heads sit under the 2 KV heads: left to the ILP


def test_sequence_parallel_reduce_scatters_what_tensor_parallel_all_reduces(gpt16):
    _, table = gpt16
    plain, sp = (al.megatron_plan(table=table, dp=2, tp=4, pp=1, zero=0, sequence_parallel=s) for s in (False, True))
    b, s, h = 16, 16, 32
    nbytes = b // 2 * s * h * 2  # the projection's output on one data-parallel replica, fp16
    ((k0, a0, n0),) = forward_matmuls(plain)["proj"].collectives
    ((k1, a1, n1),) = forward_matmuls(sp)["proj"].collectives
    assert (k0, a0, n0) == ("all_reduce", 1, nbytes) and (k1, a1, n1) == ("reduce_scatter", 1, nbytes)
    assert str(forward_matmuls(sp)["proj"].out_specs[0]) == "S0S1R"  # onto the sequence
    mesh = A100.logical_mesh((1, 8), (2, 4))
    assert mesh.reduce_scatter(nbytes, 1) < mesh.all_reduce(nbytes, 1)
    assert parallelism.seqpar_regions(sp)[0] and not parallelism.seqpar_regions(plain)[0]
    assert "sp" in sp.method


def test_context_parallel_runs_attention_as_a_ring_passing_key_blocks():
    model = al.models.get("gpt-tiny", batch_size=4, seq_len=4096, dtype="float16")
    plan = al.megatron_plan(model, A100, dp=2, tp=1, pp=1, cp=4, zero=0)
    assert plan.stages[0].logical_mesh == (2, 4)
    rings = parallelism.context_parallel(plan)[0]
    assert rings and all(r.axes == (1,) for r in rings)
    scores = forward_matmuls(plan)["attn/scores"]
    # one ring step sends K's block: a replica's K (batch 4 / dp 2, 4096 tokens, 4 heads x 8) in fp16, over cp
    assert scores.collectives == (("collective_permute", 1, 4 // 2 * 4096 * 32 * 2),)


def test_expert_parallel_splits_the_experts_and_the_tokens_reach_them_by_an_all_to_all():
    cluster = A100.with_(devices_per_host=4)
    model = al.models.get("moe-tiny", batch_size=16, dtype="bfloat16")
    one = al.megatron_plan(model, cluster, dp=4, tp=1, pp=1, ep=1, zero=0)
    four = al.megatron_plan(model, cluster, dp=4, tp=1, pp=1, ep=4, zero=0, table=one.table)  # one table for both
    assert parallelism.expert_degree(one) == 1 and parallelism.expert_degree(four) == 4
    (layer,) = [e for e in parallelism.expert_parallel(four)[0] if e.axes]
    cf, tokens, hidden = 2.0, 16 * 16, 32  # GShard's buffer: capacity x tokens x hidden, bf16
    assert layer.all_to_alls[0] == ("all_to_all", 0, int(cf * tokens * hidden * 2))
    # each device stores 1 of the 4 experts: the experts' weights a quarter of the replicated ones'
    assert stored(four, "['experts']['w1']") == "S0RR" and stored(one, "['experts']['w1']") == "RRR"
    with pytest.raises(ValueError, match="ep=3 does not divide the model's 4 experts"):
        al.megatron_plan(model, cluster, dp=4, tp=1, pp=1, ep=3, table=one.table)
    with pytest.raises(ValueError, match="ep=2 does not fit the 2-D mesh"):
        al.megatron_plan(model, cluster, dp=4, tp=1, pp=1, ep=2, table=one.table)


# --- ZeRO's memory: the formula to the byte ---------------------------------------------------------------------

def gpt_tiny_elements(t):
    """Parameters per device of the zoo's gpt-tiny (H 32, 2 layers, V 64, S 16) under Megatron-LM's tensor split
    over ``t``: qkv, fc1 (and their biases), proj, fc2 and the embedding split; norms, the other biases and the
    position embedding whole."""
    H, V, S = 32, 64, 16
    layer = (H * 3 * H + 3 * H + H * H + H * 4 * H + 4 * H + 4 * H * H) / t + H + H + 4 * H
    return 2 * layer + V * H / t + S * H + 2 * H


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_memory_per_device_is_the_zero_formula_to_the_byte(zero, gpt16):
    d, t = 4, 2
    model, table = gpt16  # fp16 with fp32 master weights: 16 bytes a parameter
    plan = al.megatron_plan(model, A100, dp=d, tp=t, pp=1, zero=zero, table=table)
    row = memory_breakdown(plan)[0]
    psi = gpt_tiny_elements(t)
    # (fp16 params, fp16 grads, fp32 master, Adam's two fp32 moments) per parameter, as ZeRO divides them over d
    want = {0: (2, 2, 4, 8), 1: (2, 2, 4 / d, 8 / d), 2: (2, 2 / d, 4 / d, 8 / d), 3: (2 / d, 2 / d, 4 / d, 8 / d)}
    for part, per in zip(STATE, want[zero]):
        extra = 4 if part == "optimizer_bytes" else 0  # Adam's step count, an int32 on every device
        assert row[part] == pytest.approx(per * psi + extra, abs=1), part
    assert plan.stage_pins["zero"] == zero and f"zero={zero}" in plan.method


def test_zero_in_bf16_counts_fp32_gradients_18_bytes_a_parameter():
    d, t = 4, 2
    model = al.models.get("llama3-tiny", batch_size=16, dtype="bfloat16")
    H, F, V, kv = 32, 64, 64, 16
    layer = (2 * H * H + 2 * H * kv + 3 * H * F) / t + 2 * H  # q, o; k, v; gate, up, down; two norms
    psi = 2 * layer + 2 * V * H / t + H
    table = None  # the first plan's, for the others (one table, each stage's ILP on it)
    for zero, per in ((1, 2 + 4 + 12 / d), (2, 2 + 16 / d), (3, 18 / d)):
        plan = al.megatron_plan(model, A100, dp=d, tp=t, pp=1, zero=zero, precision="bf16", table=table)
        table = plan.table
        row = memory_breakdown(plan)[0]
        assert sum(row[p] for p in STATE) == pytest.approx(per * psi + 4, abs=2), zero


def test_a_zero_plan_keeps_its_zero_through_the_plan_file(tmp_path, gpt16):
    model, table = gpt16
    plan = al.megatron_plan(model, A100, dp=4, tp=2, pp=1, zero=1, table=table)
    save_plan(plan, tmp_path / "p.json")
    back = load_plan(tmp_path / "p.json", plan.graph, A100, model=model)
    assert back.stage_pins["zero"] == 1
    assert back.cost.peak_mem_bytes == plan.cost.peak_mem_bytes and back.cost.step_time_s == plan.cost.step_time_s


def test_zero_on_every_planner():
    model = al.models.get("gpt-tiny", batch_size=16, dtype="float16")
    cluster = A100.with_(devices_per_host=4)
    base = al.data_parallel_plan(model, cluster)
    z1 = al.data_parallel_plan(model, cluster, zero=1, table=base.table)
    rows = [memory_breakdown(p)[0] for p in (base, z1)]
    assert rows[1]["optimizer_bytes"] < rows[0]["optimizer_bytes"] and z1.stage_pins["zero"] == 1
    auto = al.auto_plan(model, cluster, zero=3, table=base.table)
    assert auto.stage_pins["zero"] == 3 and any("ZeRO-3" in n for n in auto.notes)
    for bad in (4, -1, True, "1"):
        with pytest.raises(ValueError, match="zero"):
            al.megatron_plan(model, A100, dp=4, tp=2, pp=1, zero=bad)


# --- the layouts of the published runs ---------------------------------------------------------------------------

def test_microbatch_size_is_megatrons():
    model = al.models.get("gpt-tiny", batch_size=32, dtype="float16")
    plan = al.megatron_plan(model, A100, dp=4, tp=2, pp=1, micro_batch_size=2)
    assert plan.microbatches == 32 // (4 * 2)
    with pytest.raises(ValueError, match="disagrees"):
        al.megatron_plan(model, A100, dp=4, tp=2, pp=1, micro_batch_size=2, microbatches=2)
    with pytest.raises(ValueError, match="needs tp"):
        al.megatron_plan(model, A100, dp=8, tp=1, pp=1, sequence_parallel=True)


@pytest.fixture(scope="module")
def deep_llama():
    """Llama 3 8B at 24 blocks (batch 32, 512 tokens) on 2 DGX H100s, and its bf16 cost table (planned on the 4-layer
    copy): the table ``al.megatron_plan(model, cluster, precision="bf16")`` builds, built once for the two tests."""
    model = al.models.get("llama3-8b", num_layers=24, batch_size=32, seq_len=512)
    cluster = al.Cluster.preset("dgx-h100", hosts=2)
    return model, cluster, al.CostTable.build(model, cluster, precision="bf16")


def test_a_deep_llama_in_megatrons_pipeline_splits_the_blocks_evenly(deep_llama):
    """24 blocks planned on the 4-layer copy: 12 a stage, the embedding with the first and the head with the last;
    interleaved with 2 chunks a stage; the distributed optimizer."""
    model, cluster, table = deep_llama
    plan = al.megatron_plan(model, cluster, dp=2, tp=4, pp=2, zero=1, micro_batch_size=1, remat="selective",
                            schedule="interleaved", virtual_stages=2, precision="bf16", table=table)
    assert [st.layers for st in plan.stages] == [(0, 12), (13, 25)]
    assert plan.microbatches == 16 and plan.virtual_stages == 2 and plan.cost.fits
    assert weight_spec(forward_matmuls(plan, "layer_1")["attn/q_proj"]) == "RS1"


def test_microbatches_auto_keeps_the_fastest_micro_batch_size_that_fits(deep_llama):
    """``microbatches="auto"`` on a deep model (24 blocks, planned on a copy): each micro-batch size of 1, 2, 4, 8
    priced on the same table, the fastest that fits kept, equal to that size asked for; under a tighter memory limit
    a smaller size; on both planners that take a micro-batch size."""
    model, cluster, table = deep_llama
    kw = dict(dp=2, tp=4, pp=2, zero=1, precision="bf16")
    auto = al.megatron_plan(model, cluster, microbatches="auto", table=table, **kw)
    each = {m: al.megatron_plan(table=auto.table, micro_batch_size=m, **kw) for m in (1, 2, 4, 8)}
    fits = {m: p for m, p in each.items() if p.cost.fits}
    best = min(fits, key=lambda m: fits[m].cost.step_time_s)
    assert auto.microbatches == 32 // (2 * best) and auto.cost == each[best].cost
    assert any(n.startswith(f"microbatches auto: {auto.microbatches} microbatches (micro-batch size {best})")
               for n in auto.notes)
    # a limit the kept size's activations overflow: auto moves to a smaller size, never to one that overflows
    peaks = {m: max(p.cost.peak_mem_bytes) for m, p in each.items()}
    assert best > 1 and peaks[1] < peaks[best]
    limit = (peaks[1] + peaks[best]) / 2
    tight = al.megatron_plan(table=auto.table, microbatches="auto", mem_limit_bytes=limit, **kw)
    assert tight.cost.fits and max(tight.cost.peak_mem_bytes) <= limit and tight.microbatches > auto.microbatches
    fsdp = al.fsdp_plan(table=auto.table, tp=4, pp=2, microbatches="auto")
    assert fsdp.cost == min((al.fsdp_plan(table=auto.table, tp=4, pp=2, local_batch_size=m) for m in (1, 2, 4, 8)),
                            key=lambda p: (not p.cost.fits, p.cost.step_time_s)).cost
    with pytest.raises(ValueError, match="not both"):
        al.megatron_plan(table=auto.table, microbatches="auto", micro_batch_size=2, **kw)


def test_fsdp_plan_prices_torchtitans_llama3_8b_on_8_h100s():
    """torchtitan's Llama 3.1 8B row: FSDP over 8 H100s, local batch 2 of 8,192 tokens, bf16, with full
    recomputation and with the row's selective (op-level) checkpointing, priced as "selective-op" (its policy as
    written): it fits (with Megatron-LM's selective recomputation, which saves nothing with flash attention, it read
    147 GiB). On the
    run's parts: H100s of 96 GB HBM2e at 2.4 TB/s (it peaked at 82.4 GiB, more than an 80 GB H100 holds)."""
    model = al.models.get("llama3-8b", batch_size=16, seq_len=8192)
    cluster = al.Cluster.preset("dgx-h100").with_(memory_bytes=96 * 2**30, memory_bandwidth=2.4e12)
    plan = al.fsdp_plan(model, cluster, local_batch_size=2, remat="full", precision="bf16")
    assert plan.cost.fits and plan.microbatches == 1 and plan.stages[0].logical_mesh == (8, 1)
    tokens_per_gpu_s = 16 * 8192 / plan.cost.step_time_s / 8
    assert 1000 < tokens_per_gpu_s < 30000  # published 5,762
    row = memory_breakdown(plan)[0]
    psi = model.param_count
    assert sum(row[p] for p in STATE) == pytest.approx(18 * psi / 8, rel=1e-3)  # ZeRO-3: 18 bytes / 8
    nrf = al.fsdp_plan(model, cluster, local_batch_size=2, remat="full", precision="bf16",
                       reshard_after_forward=False)
    assert nrf.stage_pins["zero"] == 2 and "no-reshard" in nrf.method
    assert memory_breakdown(nrf)[0]["params_bytes"] == pytest.approx(2 * psi, rel=1e-3)
    sac = al.fsdp_plan(table=plan.table, local_batch_size=2, remat="selective")
    assert sac.cost.fits and sac.stages[0].remat == "selective-op"
    plain = al.fsdp_plan(table=plan.table, local_batch_size=2)
    # a block keeps SDPA's output and every other matmul's, of the 29.5 h values a token JAX's residuals hold
    assert memory_breakdown(sac)[0]["activations_bytes"] < 0.5 * memory_breakdown(plain)[0]["activations_bytes"]


def test_fsdp_plan_with_tensor_and_pipeline_parallelism_is_torchtitans_4d_less_the_replicas():
    model = al.models.get("llama3-tiny", num_heads=8, num_kv_heads=4, num_layers=4, batch_size=16, dtype="bfloat16")
    plan = al.fsdp_plan(model, A100, tp=2, pp=2, local_batch_size=2, precision="bf16")
    assert plan.method == "fsdp(dp_shard=2,tp=2,pp=2,sp)" and plan.stage_pins["zero"] == 3
    assert [st.logical_mesh for st in plan.stages] == [(2, 2), (2, 2)] and plan.microbatches == 16 // (2 * 2)
    assert [st.layers for st in plan.stages] == [(0, 2), (3, 5)]  # 2 blocks a stage, embedding and head at the ends
    assert stored(plan, "['layers'][0]['mlp']['gate']") == "S0S1"  # FSDP over the shard group, TP's column split
    assert parallelism.seqpar_regions(plan)[0]  # torchtitan's TP runs the norms sequence-parallel
    with pytest.raises(ValueError, match="HSDP"):
        al.fsdp_plan(model, A100, dp_replicate=2, tp=2)


def test_maxtext_plan_prices_fsdp_with_tensor_parallelism_on_a_v5p_slice():
    model = al.models.get("gpt-tiny", batch_size=256, seq_len=512, hidden_size=256, num_heads=8, num_layers=2,
                          dtype="bfloat16")
    cluster = al.Cluster.parse("tpu-v5p:128")
    plan = al.maxtext_plan(model, cluster, ici_fsdp=-1, ici_tensor=4, per_device_batch_size=2, remat="minimal",
                           precision="bf16")
    assert plan.stages[0].logical_mesh == (32, 4) and plan.stages[0].remat == "dots"  # checkpoint_dots
    assert plan.stage_pins["zero"] == 3 and plan.cost.fits and math.isfinite(plan.cost.step_time_s)
    assert stored(plan, "['layers'][0]['fc1']['w']") == "S0S1"  # FSDP over 32, tensor over 4
    with pytest.raises(ValueError, match="per_device_batch_size"):
        al.maxtext_plan(model, cluster, ici_fsdp=-1, ici_tensor=4, per_device_batch_size=1)
    with pytest.raises(ValueError, match="at most one ici"):
        al.maxtext_plan(model, cluster, ici_fsdp=-1, ici_tensor=-1)


@pytest.mark.slow
def test_maxtext_plan_keeps_the_activations_split_over_tensor_and_runs_its_flash_kernel():
    """MaxText's sharding rules split activations' embedding over tensor (base.yml: ['activation_embed', 'tensor']),
    and its attention is the flash kernel unless the configuration says dot_product (base.yml: attention
    'autoselected'; the v5p rows' scripts pass attention='flash')."""
    B, s, h, heads = 32, 512, 256, 8
    model = al.models.get("gpt-tiny", batch_size=B, seq_len=s, hidden_size=h, num_heads=heads, num_layers=2,
                          dtype="bfloat16")
    cluster = al.Cluster.parse("tpu-v5p:16")
    assert not cluster.device.efficiency.flash_attention  # the preset's default: XLA does not fuse attention itself
    kw = dict(ici_fsdp=-1, ici_tensor=4, per_device_batch_size=2, remat="minimal", precision="bf16")
    plan = al.maxtext_plan(model, cluster, **kw)
    assert plan.cluster.device.efficiency.flash_attention  # "autoselected": the flash kernel
    assert parallelism.seqpar_regions(plan)[0]
    # Each block's output (the residual stream, B x s x h in bf16) is held split over FSDP (4) and tensor (4).
    g, st, mesh = plan.op_graph, plan.stages[0].intra.strategies, plan.stages[0].logical_mesh
    adds = [o for o in g.ops if g.op(o).layer == "layer_0" and g.op(o).role == "forward"
            and g.op(o).primitive == "add" and g.tensor(g.op(o).outputs[0]).shape == (B, s, h)]
    assert adds
    for o in adds:
        t = g.tensor(g.op(o).outputs[0])
        assert st[o].out_specs[0].bytes_per_device(t.shape, t.dtype, mesh) == B // 4 * s * h * 2 / 4
    dot = al.maxtext_plan(model, cluster, attention="dot_product", **kw)
    assert not dot.cluster.device.efficiency.flash_attention
    # Without the kernel a recomputed layer writes its scores (B/4 sequences x heads/4 x s x s in bf16) at least.
    held = [memory_breakdown(p)[0]["recompute_bytes"] for p in (plan, dot)]
    assert held[1] - held[0] >= B // 4 * heads // 4 * s * s * 2
    with pytest.raises(ValueError, match="attention must be one of MaxText's kernels"):
        al.maxtext_plan(model, cluster, attention="splash", **kw)
    with pytest.raises(ValueError, match="built with flash_attention=True"):
        al.maxtext_plan(table=plan.table, attention="dot_product", **kw)


# --- no silent "does not fit" --------------------------------------------------------------------------------------

def test_a_stage_that_overflows_with_open_storage_is_stored_at_its_least_and_says_so(gpt16):
    model, table = gpt16
    fast = al.megatron_plan(model, A100, dp=4, tp=2, pp=1, table=table)
    limit = fast.cost.peak_mem_bytes[0] * 0.75
    lean = al.megatron_plan(model, A100, dp=4, tp=2, pp=1, mem_limit_bytes=limit, table=table)
    assert lean.cost.fits and lean.stages[0].solution == "lean"
    assert stored(lean, "['layers'][0]['fc1']['w']") == "S0S1"  # split over the data-parallel axis too
    text = lean.cost.explain()
    assert "to fit in memory" in text and "ZeRO-3 storage" in text
    assert f"stage 0: {fast.cost.peak_mem_bytes[0] / GIB:.3g} -> {lean.cost.peak_mem_bytes[0] / GIB:.3g} GiB" in text
    # a stated ZeRO stage is the layout's, and lean=False asks for the ILP's storage: nothing else is tried
    assert not al.megatron_plan(model, A100, dp=4, tp=2, pp=1, zero=0, mem_limit_bytes=limit, table=table).cost.fits
    kept = al.megatron_plan(model, A100, dp=4, tp=2, pp=1, mem_limit_bytes=limit, lean=False, table=table)
    assert kept.cost.peak_mem_bytes == fast.cost.peak_mem_bytes and kept.cost.fit_note.startswith("does not fit")


def test_a_layout_nothing_fits_says_which_part_overflows_by_how_much(gpt16):
    model, table = gpt16
    limit = 2**17
    plan = al.megatron_plan(model, A100, dp=4, tp=2, pp=1, zero=0, mem_limit_bytes=limit, table=table)
    assert not plan.cost.fits
    row = memory_breakdown(plan)[0]
    parts = {name: sum(row[p] for p in ps) for name, ps in GROUPS.items()}
    total = row["total_bytes"]
    big = max(parts, key=parts.get)
    note = plan.cost.fit_note
    assert note.startswith(f"does not fit: stage 0 needs {total / GIB:.3g} GiB per device, "
                           f"{(total - limit) / GIB:.3g} GiB over the {limit / GIB:.3g} GiB limit")
    assert f"optimizer state {parts['optimizer state'] / GIB:.3g} GiB" in note
    short = big.split(" (")[0]
    assert (f"the {short} alone overflow it by {(parts[big] - limit) / GIB:.3g} GiB" in note) == (parts[big] > limit)
    assert note in plan.cost.explain()


def test_auto_plan_on_a_model_whose_replicated_state_overflows_takes_the_lean_stage_and_says_so():
    sys.path.insert(0, str(Path(__file__).parent))
    from test_lean import SMALL, lean_only_limit  # the limit only a plan with a lean stage meets (exact)

    table = al.CostTable.build(al.models.get("gpt-tiny"), SMALL, lean="all")
    table.solve_meshes(workers=1)
    table.solve_lean(workers=1)
    mem = lean_only_limit(table, 4)
    plan = al.auto_plan(table=table, microbatches=4, mem_limit_bytes=mem)
    lean = [k for k, st in enumerate(plan.stages) if st.solution == "lean"]
    assert plan.cost.fits and lean
    assert "the stage DP stored the parameters and optimizer state" in plan.cost.explain()
    assert all(f"stage {k}: " in plan.cost.fit_note for k in lean)


# --- the SC21 rows through the public API (slow: a 24-48-layer GPT on up to 512 GPUs each) ----------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_fidelity as fidelity  # noqa: E402 - the benchmark is a script beside the package


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1.7B", "7.5B", "39B"])
def test_the_sc21_rows_priced_through_the_public_api_equal_the_bench_and_fit(name):
    _, a, h, l, t, p, gpus, B, pub = next(r for r in fidelity.ROWS if r[0] == name)  # noqa: E741
    d = gpus // (t * p)
    model = al.models.get("gpt-tiny", seq_len=2048, hidden_size=h, num_layers=l, num_heads=a, vocab_size=51200,
                          batch_size=B, dtype="float16")
    cluster = al.Cluster.preset("dgx-a100", hosts=gpus // 8).with_(flash_attention=False)
    table = al.CostTable.build(model, cluster)
    sched = dict(schedule="interleaved", virtual_stages=fidelity.virtual_stages(l // p)) if p > 1 else {}
    plan = al.megatron_plan(table=table, dp=d, tp=t, pp=p, microbatches=B // d, remat=True, zero=0, **sched)
    # the bench's own layout and pricing, on this table (it refuses a table of another cluster, batch or depth; its
    # model's sequence and vocabulary are these)
    assert (fidelity.SEQ, fidelity.VOCAB) == (2048, 51200)
    r = fidelity.row(name, table=table)
    F = fidelity.published_flops(B, 2048, l, h, 51200)
    assert F / (plan.cost.step_time_s * gpus) / 1e12 == r["predicted_tflops"]
    assert max(plan.cost.peak_mem_bytes) / GIB == r["peak_mem_gib"]
    assert abs(r["ratio"] - 1) <= 0.2 and plan.cost.fits and not plan.cost.fit_note
    # with the storage left open, and with the distributed optimizer: every layout fits, nothing says otherwise
    for zero in (None, 1):
        other = al.megatron_plan(table=table, dp=d, tp=t, pp=p, microbatches=B // d, remat=True, zero=zero,
                                 **sched)
        assert other.cost.fits and "does not fit" not in other.cost.explain()
    z1 = memory_breakdown(other)[0]
    z0 = memory_breakdown(plan)[0]
    assert z1["optimizer_bytes"] == pytest.approx(z0["optimizer_bytes"] / d, rel=1e-3)
