"""Frameworks in and out (issue 33): ``al.import_config`` reads a Megatron-LM argument list, a torchtitan TOML or a
MaxText YAML and prices it through the library's layouts; ``al.export_config`` writes a plan back as one.

What must hold: export then import gives the same layout and the same predicted step (property-based over random
layouts each framework expresses); importing a published reference configuration, written as the framework's own
file, gives the prediction of pricing that row through ``megatron_plan`` / ``fsdp_plan`` / ``maxtext_plan``; the
fields not modelled are listed, a misspelt or contradictory one is one sentence; a decision no framework switch
expresses is named; the keys are the frameworks' own (``tests/data/framework_keys.json``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar_lab as al
from autopar_lab.frameworks import maxtext_yaml, megatron_args, torchtitan_toml
from autopar_lab.pricing import CostTable
from autopar_lab.rematmode import remat_label

KEYS = json.loads((Path(__file__).parent / "data" / "framework_keys.json").read_text())
TWO_H100 = al.Cluster.parse("dgx-h100:2")  # 16 GPUs: 2 hosts of 8
BATCH = 64


@pytest.fixture(scope="module")
def tiny():
    """(model, table): a 4-layer Llama (the tiny shape) in bf16 on 2 x 8 H100s, global batch 64."""
    model = al.models.get("llama3-tiny", num_layers=4, batch_size=BATCH, dtype="bfloat16")
    return model, CostTable.build(model, TWO_H100, precision="bf16")


def layout(plan) -> tuple:
    """Everything a plan decides that a framework writes: its layout's name, each stage's layers, submesh, mesh and
    recomputation, the microbatches, schedule, chunks and stage pins (its ZeRO stage)."""
    return (plan.method, [(tuple(s.layers), tuple(s.submesh), tuple(s.logical_mesh), remat_label(s.remat))
                          for s in plan.stages],
            plan.microbatches, plan.schedule, plan.virtual_stages, dict(plan.stage_pins))


def round_trip(plan, framework, model, table):
    text = al.export_config(plan, framework, model=model)
    again = al.import_config(text, model, framework=framework, table=table)
    assert layout(again) == layout(plan), text
    assert again.cost.step_time_s == plan.cost.step_time_s
    assert again.cost.peak_mem_bytes == plan.cost.peak_mem_bytes
    return text, again


# --- Megatron-LM ----------------------------------------------------------------------------------------------------

def megatron_text(tp, pp, cp, sp, dist_opt, remat, mbs, per_chunk, extra=()):
    args = ["pretrain_gpt.py", f"--tensor-model-parallel-size {tp}", f"--pipeline-model-parallel-size {pp}",
            f"--micro-batch-size {mbs}", f"--global-batch-size {BATCH}", "--bf16", *extra]
    args += [f"--context-parallel-size {cp}"] if cp > 1 else []
    args += ["--sequence-parallel"] if sp else []
    args += ["--use-distributed-optimizer"] if dist_opt else []
    args += [remat] if remat else []
    args += [f"--num-layers-per-virtual-pipeline-stage {per_chunk}"] if per_chunk else []
    return " \\\n  ".join(args) + "\n"


MEGATRON = st.builds(
    lambda tp, pp, cp, sp, dist_opt, remat, mbs, per_chunk: (tp, pp, cp, sp and tp > 1, dist_opt, remat, mbs,
                                                             per_chunk if pp > 1 else None),
    st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.booleans(), st.booleans(),
    st.sampled_from([None, "--recompute-activations", "--recompute-granularity full",
                     "--recompute-granularity selective"]),
    st.sampled_from([1, 2, 4]), st.sampled_from([None, 1, 2]))


def test_megatron_arguments_round_trip_interleaved_selective_sequence_parallel_zero1(tiny):
    model, table = tiny
    text = megatron_text(2, 2, 1, True, True, "--recompute-activations", 1, 1,
                         extra=["--use-flash-attn", "--lr 3e-4", "--data-path 0.5 /data/a 0.5 /data/b"])
    plan = al.import_config(text, model, table=table)
    # the arguments are Megatron-LM's layout, as al.megatron_plan prices it: dp is what the 16 GPUs leave
    direct = al.megatron_plan(table=table, dp=4, tp=2, pp=2, micro_batch_size=1, remat="selective", zero=1,
                              sequence_parallel=True, schedule="interleaved", virtual_stages=2, precision="bf16")
    assert layout(plan) == layout(direct) and plan.cost.step_time_s == direct.cost.step_time_s
    assert plan.microbatches == BATCH // (4 * 1) and plan.virtual_stages == 4 // (2 * 1)
    assert plan.notes[-1] == "ignored (not modelled by the planner): --use-flash-attn, --lr, --data-path"
    out, _ = round_trip(plan, "megatron", model, table)
    assert "--num-layers-per-virtual-pipeline-stage 1" in out and "--use-distributed-optimizer" in out


def test_megatron_overlap_switches_are_read_priced_and_written_back(tiny):
    """--overlap-grad-reduce, --overlap-param-gather and --tp-comm-overlap (Megatron-LM's arguments.py) become
    megatron_plan's keywords of the same names (priced by pricing.overlap, tests/test_overlap.py), and the export
    writes them again."""
    model, table = tiny
    text = megatron_text(2, 2, 1, True, True, None, 1, None,
                         extra=["--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap"])
    plan = al.import_config(text, model, table=table)
    direct = al.megatron_plan(table=table, dp=4, tp=2, pp=2, micro_batch_size=1, zero=1, sequence_parallel=True,
                              precision="bf16", overlap_grad_reduce=True, overlap_param_gather=True,
                              tp_comm_overlap=True)
    assert plan.stage_pins["overlap"] == ("grad_reduce", "param_gather", "tp_comm")
    assert layout(plan) == layout(direct) and plan.cost.step_time_s == direct.cost.step_time_s
    assert "ignored" not in plan.notes[-1]
    plain = al.import_config(megatron_text(2, 2, 1, True, True, None, 1, None), model, table=table)
    assert plain.stage_pins["overlap"] == () and plain.cost.step_time_s != plan.cost.step_time_s
    out, _ = round_trip(plan, "megatron", model, table)
    assert all(f in out for f in ("--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap"))


@pytest.fixture(scope="module")
def small_kernels():
    """(model, table): a 2-layer GPT of small kernels on one DGX H100, priced with Megatron-LM's kernels (so its
    eager host is priced too, backends.eager: these kernels are host-bound)."""
    model = al.models.get("gpt-tiny", seq_len=64, hidden_size=128, num_heads=4, num_layers=2, batch_size=8,
                          vocab_size=512, dtype="bfloat16")
    cluster = al.Cluster.preset("dgx-h100", 1).with_(library_kernels=True)
    return model, CostTable.build(model, cluster, precision="bf16")


SMALL_ARGS = ("pretrain_gpt.py --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --micro-batch-size 1 "
              "--global-batch-size 8 --bf16 ")


@pytest.mark.parametrize("flags, note", [
    ("--cuda-graph-impl local", None),
    ("--cuda-graph-impl transformer_engine", None),
    ("--enable-cuda-graph", "--enable-cuda-graph (deprecated) read as --cuda-graph-impl local"),
    ("--external-cuda-graph", "--external-cuda-graph (deprecated) read as --cuda-graph-impl transformer_engine"),
    ("--cuda-graph-impl none --enable-cuda-graph", "--enable-cuda-graph (deprecated) read as"),
])
def test_megatron_cuda_graph_flags_price_no_host_and_round_trip(small_kernels, flags, note):
    """Each of Megatron-LM's CUDA-graph flags (arguments.py: --cuda-graph-impl, and the deprecated switches it
    replaces) is megatron_plan(cuda_graphs=True): the kernels replayed from graphs, so the eager host's time per
    kernel is not paid where, without the flag, it is the step's bound; the export writes --cuda-graph-impl local and
    reads back as the same plan."""
    model, table = small_kernels
    eager = al.import_config(SMALL_ARGS, model, table=table)
    none = al.import_config(SMALL_ARGS + "--cuda-graph-impl none", model, table=table)
    assert eager.cost.host_s > 0 and none.cost.host_s == eager.cost.host_s and layout(none) == layout(eager)
    plan = al.import_config(SMALL_ARGS + flags, model, table=table)
    direct = al.megatron_plan(table=table, dp=8, tp=1, pp=1, micro_batch_size=1, zero=0, precision="bf16",
                              cuda_graphs=True)
    assert layout(plan) == layout(direct) and plan.cost.step_time_s == direct.cost.step_time_s
    assert plan.cost.host_s == 0 and "host" not in plan.stage_pins and plan.method.endswith(",graphs)")
    assert plan.cost.step_time_s < eager.cost.step_time_s
    assert (note is None) == all("deprecated" not in n for n in plan.notes)
    assert note is None or any(n.startswith(note) for n in plan.notes)
    out, again = round_trip(plan, "megatron", model, table)
    assert "--cuda-graph-impl local" in out and again.cost.host_s == 0
    assert "--cuda-graph-impl" not in al.export_config(eager, "megatron", model=model)


@pytest.mark.parametrize("flags, graphs, note", [
    ("--cuda-graph-impl local --cuda-graph-scope full_iteration", True, None),
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope attn mlp", True, None),
    ("--cuda-graph-impl=local --cuda-graph-scope=full_iteration", True, None),
    ("--cuda-graph-impl transformer_engine --cuda-graph-scope attn", True,
     "not expressible, dropped: --cuda-graph-scope attn (the rest of each layer launched by the eager host)"),
    ("--external-cuda-graph --cuda-graph-scope mlp moe_router", True,
     "not expressible, dropped: --cuda-graph-scope mlp moe_router"),
    ("--cuda-graph-scope attn mlp", False, "--cuda-graph-scope attn mlp dropped: it has no effect without"),
    ("--cuda-graph-impl none --cuda-graph-scope full_iteration", False, "--cuda-graph-scope full_iteration dropped"),
])
def test_megatron_cuda_graph_scope_is_read_where_the_plan_expresses_it(small_kernels, flags, graphs, note):
    """--cuda-graph-scope (Megatron-LM's arguments.py: one or more of attn, mlp, moe, moe_router, moe_preprocess,
    mamba, full_iteration; none: each whole layer captured): a whole iteration, or scopes covering each whole layer,
    are the plan with CUDA graphs (no host time per kernel) and export back as it; a scope leaving part of each layer
    to the eager host is not expressible, dropped with a note (priced as the graphs plan); without CUDA graphs it has
    no effect and is dropped with a note (priced eager). The flag is read, never listed as ignored."""
    model, table = small_kernels
    plan = al.import_config(SMALL_ARGS + flags + " --bf16", model, table=table)
    direct = al.megatron_plan(table=table, dp=8, tp=1, pp=1, micro_batch_size=1, zero=0, precision="bf16",
                              cuda_graphs=graphs)
    assert layout(plan) == layout(direct) and plan.cost.step_time_s == direct.cost.step_time_s
    assert (plan.cost.host_s == 0) == graphs
    assert all("--cuda-graph-scope" not in n or n.startswith(("not expressible", "--cuda-graph-scope"))
               for n in plan.notes)
    assert not any("ignored" in n and "--cuda-graph-scope" in n for n in plan.notes)
    scoped = [n for n in plan.notes if "--cuda-graph-scope" in n]
    assert (scoped == []) == (note is None) and (note is None or scoped[0].startswith(note))
    out, again = round_trip(plan, "megatron", model, table)
    assert ("--cuda-graph-impl local" in out) == graphs and "--cuda-graph-scope" not in out


def test_megatron_cuda_graph_scope_of_a_model_with_experts_covers_its_layers_with_moe():
    """On a model with experts a layer is its attention and its MoE block: attn with moe is the whole layer (read as
    the plan with CUDA graphs, no note), attn with mlp is not (mlp captures a dense layer's MLP only)."""
    imp = megatron_args.parse(SMALL_ARGS + "--cuda-graph-impl transformer_engine --cuda-graph-scope attn moe "
                              "--num-experts 4")
    assert imp.get("--cuda-graph-scope") == ("attn", "moe")
    assert megatron_args.scope_note(imp, None).notes == ()
    dense = megatron_args.parse(SMALL_ARGS + "--cuda-graph-impl transformer_engine --cuda-graph-scope attn mlp "
                                "--num-experts 4")
    assert megatron_args.scope_note(dense, None).notes[-1].startswith("not expressible, dropped")


def test_megatron_cuda_graphs_refuse_full_recomputation(small_kernels):
    """Megatron-LM asserts CUDA graphs run without full recomputation; megatron_plan and the import refuse it too."""
    model, table = small_kernels
    with pytest.raises(ValueError, match="Megatron-LM refuses CUDA graphs with --recompute-granularity full"):
        al.megatron_plan(table=table, dp=8, tp=1, pp=1, precision="bf16", remat=True, cuda_graphs=True)
    selective = al.megatron_plan(table=table, dp=8, tp=1, pp=1, precision="bf16", remat="selective",
                                 cuda_graphs=True)
    assert selective.cost.host_s == 0 and selective.method == "megatron(dp=8,tp=1,pp=1,selective,graphs)"


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(MEGATRON)
def test_megatron_round_trip_over_random_layouts(tiny, case):
    model, table = tiny
    plan = al.import_config(megatron_text(*case), model, table=table)
    round_trip(plan, "megatron", model, table)


@pytest.mark.slow
def test_megatron_shape_flags_build_the_model_a_deep_gpt_planned_on_its_copy():
    """24 layers from the shape flags: the zoo's GPT at that shape (planned on its 4-layer copy), priced as
    al.megatron_plan prices it; the flags written back are the same shape."""
    args = ("--num-layers 24 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
            "--vocab-size 128 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2 "
            "--global-batch-size 16 --recompute-granularity full --fp16")
    model = al.models.get("gpt-tiny", num_layers=24, hidden_size=64, num_heads=4, seq_len=32, vocab_size=128,
                          batch_size=16, dtype="float16")
    family, fields = megatron_args._shape(megatron_args.parse(args), 16)  # noqa: SLF001 - the model the flags build
    assert family == "gpt" and {k: getattr(model.config, k) for k in fields} == fields
    table = CostTable.build(model, al.Cluster.parse("dgx-a100:1"), precision="fp16")
    plan = al.import_config(args, table=table)
    direct = al.megatron_plan(table=table, dp=2, tp=2, pp=2, micro_batch_size=2, remat=True, zero=0,
                              precision="fp16")
    assert len(plan.graph.layers) == 24 + 2 and plan.op_graph is not plan.graph   # solved on a shallow copy
    assert [tuple(s.layers) for s in plan.stages] == [(0, 12), (13, 25)]          # 12 blocks a stage, ends attached
    assert plan.cost.step_time_s == direct.cost.step_time_s
    text = al.export_config(plan, "megatron", model=model)
    for flag in ("--num-layers 24", "--hidden-size 64", "--num-attention-heads 4", "--ffn-hidden-size 256",
                 "--recompute-granularity full", "--fp16", "--micro-batch-size 2", "--global-batch-size 16"):
        assert flag in text, flag


def test_megatron_llama_shape_flags_build_a_llama():
    args = megatron_text(1, 1, 1, False, False, None, 4, None) + (
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--ffn-hidden-size 64 --seq-length 16 --max-position-embeddings 16 --vocab-size 64 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights")
    imported = megatron_args.parse(args)
    family, fields = megatron_args._shape(imported, BATCH)  # noqa: SLF001 - the shape read, without pricing
    want = al.models.config_of("llama3-tiny", batch_size=BATCH, dtype="bfloat16")
    assert family == "llama"
    for key, value in fields.items():
        if value is not None:
            assert getattr(want, key) == value, key



@pytest.mark.parametrize("hidden, swiglu, ffn", [(4096, True, 10880), (32, True, 64), (4096, False, 16384)])
def test_megatron_llama_without_ffn_size_takes_megatron_s_default(hidden, swiglu, ffn):
    # Megatron-LM's validate_args: --swiglu without --ffn-hidden-size is int(4h * 2/3 / 64) * 64 (4,096 -> 10,880:
    # 10,922.7 rounded down to 64s), otherwise 4h.
    args = megatron_text(1, 1, 1, False, False, None, 4, None) + (
        f"--num-layers 2 --hidden-size {hidden} --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
        f"--vocab-size 64 --normalization RMSNorm" + (" --swiglu" if swiglu else ""))
    family, fields = megatron_args._shape(megatron_args.parse(args), BATCH)  # noqa: SLF001 - the shape read alone
    assert family == "llama" and fields["ffn_hidden"] == ffn

# --- torchtitan -----------------------------------------------------------------------------------------------------

def torchtitan_text(rep, tp, pp, cp, reshard, mode, local, schedule, pp_mbs, flavor=None, seq=None):
    lines = ["[model]", 'name = "llama3"'] + ([f'flavor = "{flavor}"'] if flavor else [])
    lines += ["", "[training]", f"local_batch_size = {local}", f"global_batch_size = {BATCH}",
              'mixed_precision_param = "bfloat16"'] + ([f"seq_len = {seq}"] if seq else [])
    lines += ["", "[parallelism]", f"data_parallel_replicate_degree = {rep}", "data_parallel_shard_degree = -1",
              f"tensor_parallel_degree = {tp}", f"pipeline_parallel_degree = {pp}",
              f"context_parallel_degree = {cp}", f'fsdp_reshard_after_forward = "{reshard}"']
    if pp > 1:
        lines += [f'pipeline_parallel_schedule = "{schedule}"', f"pipeline_parallel_microbatch_size = {pp_mbs}"]
    lines += ["", "[activation_checkpoint]", f'mode = "{mode}"', 'selective_ac_option = "op"',
              "", "[metrics]", "log_freq = 1"]
    return "\n".join(lines) + "\n"


@st.composite
def torchtitan_case(draw):
    tp, pp, cp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    rep = draw(st.sampled_from([1, 2])) if tp == cp == 1 else 1
    dp = 16 // (tp * pp * cp)
    pp_mbs = draw(st.sampled_from([1, 2]))
    local = draw(st.sampled_from([k for k in (1, 2, 4) if BATCH % (k * dp) == 0 and k % pp_mbs == 0] or [pp_mbs]))
    return (rep, tp, pp, cp, draw(st.sampled_from(["default", "always", "never"])),
            draw(st.sampled_from(["none", "selective", "full"])), local,
            draw(st.sampled_from(list(torchtitan_toml.SCHEDULES))), pp_mbs)


def test_torchtitan_round_trip_pipelined_fsdp_with_tensor_parallelism(tiny):
    model, table = tiny
    plan = al.import_config(torchtitan_text(1, 2, 2, 1, "never", "selective", 4, "Interleaved1F1B", 2), model,
                            table=table)
    # FSDP over the 4 ranks the other degrees leave, kept gathered after the forward (ZeRO-2), 2 chunks a rank by
    # default; local batch 4 in pipeline microbatches of 2, accumulated 64 / (4 x 4) = 4 times: 8 microbatches
    direct = al.fsdp_plan(table=table, dp_shard=4, tp=2, pp=2, reshard_after_forward=False, microbatches=8,
                          remat="selective", schedule="interleaved", virtual_stages=2, precision="bf16")
    assert layout(plan) == layout(direct) and plan.cost.step_time_s == direct.cost.step_time_s
    assert "ignored (not modelled by the planner): metrics.log_freq" in plan.notes
    text, _ = round_trip(plan, "torchtitan", model, table)
    assert 'fsdp_reshard_after_forward = "never"' in text and "pipeline_parallel_layers_per_stage = 1" in text


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(torchtitan_case())
def test_torchtitan_round_trip_over_random_layouts(tiny, case):
    model, table = tiny
    plan = al.import_config(torchtitan_text(*case), model, table=table)
    round_trip(plan, "torchtitan", model, table)


# --- MaxText --------------------------------------------------------------------------------------------------------

def maxtext_text(tensor, sequence, ici_data, across, remat, accumulate, pipe_micro, per_stage, model_name=None):
    lines = [f"model_name: {model_name}"] if model_name else []
    lines += ["per_device_batch_size: 4.0", f"ici_tensor_parallelism: {tensor}",
              f"ici_sequence_parallelism: {sequence}", f"ici_data_parallelism: {ici_data}",
              "ici_fsdp_parallelism: -1", f"dcn_{across}_parallelism: 2", f"remat_policy: '{remat}'",
              "enable_checkpointing: false", "learning_rate: 3.e-5"]
    if across != "data":
        lines.append("dcn_data_parallelism: 1")
    if across == "pipeline":
        lines += [f"num_pipeline_microbatches: {pipe_micro}", f"num_layers_per_pipeline_stage: {per_stage}"]
    else:
        lines.append(f"gradient_accumulation_steps: {accumulate}")
    return "\n".join(lines) + "\n"


MAXTEXT = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
                    st.sampled_from(["data", "fsdp", "pipeline"]),
                    st.sampled_from(["full", "minimal", "none", "save_qkv_proj"]), st.sampled_from([1, 2, 4]),
                    st.sampled_from([2, 4]), st.sampled_from([1, 2])).filter(lambda c: c[0] * c[1] * c[2] <= 8)


def test_maxtext_round_trip_circular_pipeline_with_tensor_axis(tiny):
    model, table = tiny
    plan = al.import_config(maxtext_text(2, 1, 1, "pipeline", "minimal", 1, 4, 1), model, table=table)
    # 2 slices as 2 stages; 4 layers, 1 a stage per repeat -> 2 repeats (circular: priced as interleaved)
    direct = al.maxtext_plan(table=table, ici_tensor=2, dcn_data=1, dcn_pipeline=2, per_device_batch_size=4,
                             microbatches=4, remat="minimal", schedule="interleaved", virtual_stages=2,
                             precision="bf16")
    assert layout(plan) == layout(direct) and plan.cost.step_time_s == direct.cost.step_time_s
    assert "ignored (not modelled by the planner): enable_checkpointing, learning_rate" in plan.notes
    text, _ = round_trip(plan, "maxtext", model, table)
    assert "num_layers_per_pipeline_stage: 1" in text and "dcn_pipeline_parallelism: 2" in text


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(MAXTEXT)
def test_maxtext_round_trip_over_random_layouts(tiny, case):
    model, table = tiny
    plan = al.import_config(maxtext_text(*case), model, table=table)
    round_trip(plan, "maxtext", model, table)


# --- expert parallelism, through all three ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe():
    """(model, table): a 2-layer Qwen3-MoE (the tiny shape, its experts over 8) in bf16 on 2 x 8 H100s, batch 64."""
    model = al.models.get("qwen3-moe-tiny", num_layers=2, batch_size=BATCH, dtype="bfloat16")
    return model, CostTable.build(model, TWO_H100, precision="bf16")


def test_expert_parallelism_round_trips_through_megatron_torchtitan_and_maxtext(moe):
    model, table = moe
    experts = model.config.num_experts
    # Megatron-LM: tp 2 x dp 8, the experts over the data-parallel group (--expert-model-parallel-size 8)
    text = megatron_text(2, 1, 1, True, True, None, 1, None, extra=[f"--expert-model-parallel-size {experts}"])
    plan = al.import_config(text, model, framework="megatron", table=table)
    direct = al.megatron_plan(table=table, dp=8, tp=2, pp=1, ep=experts, micro_batch_size=1, zero=1,
                              sequence_parallel=True, precision="bf16")
    assert layout(plan) == layout(direct) and plan.cost.step_time_s == direct.cost.step_time_s
    out, _ = round_trip(plan, "megatron", model, table)
    assert f"--expert-model-parallel-size {experts}" in out
    # torchtitan: FSDP over 8 with tp 2, expert_parallel_degree borrowing the 8 FSDP ranks
    text = torchtitan_text(1, 2, 1, 1, "default", "none", 4, "1F1B", 1).replace(
        "context_parallel_degree = 1", f"context_parallel_degree = 1\nexpert_parallel_degree = {experts}")
    plan = al.import_config(text, model, framework="torchtitan", table=table)
    direct = al.fsdp_plan(table=table, dp_shard=8, tp=2, ep=experts, microbatches=2, precision="bf16")
    assert layout(plan) == layout(direct) and plan.cost.step_time_s == direct.cost.step_time_s
    assert plan.method.endswith(f",ep={experts},sp)")
    out, _ = round_trip(plan, "torchtitan", model, table)
    assert f"expert_parallel_degree = {experts}" in out
    # experts split or not change the price: expert parallelism is priced, not dropped on the way
    assert al.fsdp_plan(table=table, dp_shard=8, tp=2, microbatches=2, precision="bf16").cost.step_time_s \
        != plan.cost.step_time_s
    # MaxText: the experts over an ici expert axis beside FSDP, exported and read back
    yaml = maxtext_text(2, 1, 1, "data", "full", 1, 2, 1).replace("ici_data_parallelism: 1",
                                                                   "ici_data_parallelism: 1\nici_expert_parallelism: 2")
    plan = al.import_config(yaml, model, framework="maxtext", table=table)
    out, _ = round_trip(plan, "maxtext", model, table)
    assert "ici_expert_parallelism: 2" in out


def test_the_grids_try_experts_over_the_data_parallel_group_for_an_moe_model(moe, tiny):
    from autopar_lab.frameworks.grid import grid

    _, table = moe
    for fw in ("megatron", "torchtitan"):
        layouts = [kw for _, kw in grid(fw, table)]
        with_ep = [kw for kw in layouts if kw["ep"] > 1]
        dp_of = (lambda kw: kw["dp"]) if fw == "megatron" else (lambda kw: kw["dp_replicate"] * kw["dp_shard"])
        # every EP layout splits the 8 experts over its whole data-parallel group, and has a twin without EP
        assert with_ep and all(kw["ep"] == dp_of(kw) and 8 % kw["ep"] == 0 for kw in with_ep)
        # Megatron-LM's layouts with experts split overlap their all-to-alls (--overlap-moe-expert-parallel-comm),
        # the twin without has none to overlap
        twin = (lambda kw: dict(kw, ep=1, overlap_moe_comm=False)) if fw == "megatron" else \
            (lambda kw: dict(kw, ep=1))
        assert all(twin(kw) in layouts for kw in with_ep)
        if fw == "megatron":  # (priced: tests/test_overlap.py)
            assert all(kw["overlap_moe_comm"] == (kw["ep"] > 1) for kw in layouts)
        assert {dp_of(kw) for kw in layouts if kw["ep"] == 1 and dp_of(kw) > 1 and 8 % dp_of(kw) == 0} <= \
            {dp_of(kw) for kw in with_ep}
    # a dense model gets no expert degree
    assert all(kw["ep"] == 1 for _, kw in grid("torchtitan", tiny[1]))


@pytest.mark.parametrize("bad, words", [(3, "does not divide the model's"), (4, "ep=4 does not fit")])
def test_fsdp_plan_expert_degree_that_does_not_fit_is_one_sentence(moe, bad, words):
    _, table = moe
    with pytest.raises(ValueError, match=words):
        al.fsdp_plan(table=table, dp_shard=8, tp=2, ep=bad, microbatches=2, precision="bf16")


# --- the published reference configurations (shared/reference/published-measurements.md) --------------------------

@pytest.mark.slow
def test_megatron_h100_row_imports_as_megatron_plan_prices_it():
    """Megatron-LM README, H100 weak scaling, the 1.7B row: GPT, 16 heads, hidden 2,048, 24 layers, TP 1, PP 1, 48
    GPUs, global batch 192 of 4,096 tokens, vocabulary 131,072, bf16, the gradient reduce-scatter and parameter
    all-gather overlapped (the distributed optimizer). The microbatch size is not published: 1 assumed."""
    args = """torchrun --nproc_per_node 8 pretrain_gpt.py \\
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 \\
        --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \\
        --seq-length 4096 --max-position-embeddings 4096 --vocab-size 131072 \\
        --micro-batch-size 1 --global-batch-size 192 --bf16 \\
        --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --use-flash-attn
    """
    cluster = al.Cluster.parse("dgx-h100:6")
    plan = al.import_config(args, cluster=cluster)
    model = al.models.get("gpt-tiny", seq_len=4096, hidden_size=2048, num_layers=24, num_heads=16,
                          vocab_size=131072, batch_size=192, dtype="bfloat16")
    row = al.megatron_plan(model, cluster, dp=48, tp=1, pp=1, micro_batch_size=1, zero=1, precision="bf16",
                           overlap_grad_reduce=True, overlap_param_gather=True, library_kernels=True)
    assert layout(plan) == layout(row)
    assert plan.cost.step_time_s == row.cost.step_time_s
    # priced with the activations Megatron-LM's kernels keep, as bench_fidelity's rows are: fewer than autodiff's
    assert plan.cost.peak_mem_bytes == row.cost.peak_mem_bytes
    autodiff = al.megatron_plan(model, cluster, dp=48, tp=1, pp=1, micro_batch_size=1, zero=1, precision="bf16",
                                overlap_grad_reduce=True, overlap_param_gather=True)
    assert max(plan.cost.peak_mem_bytes) < max(autodiff.cost.peak_mem_bytes)
    assert plan.notes[-1] == "ignored (not modelled by the planner): --use-flash-attn"


@pytest.mark.slow
def test_torchtitan_llama3_8b_row_imports_as_fsdp_plan_prices_it():
    """torchtitan's Llama 3.1 8B benchmark on 8 H100s: FSDP over all GPUs, selective (op) activation checkpointing,
    local batch 2, sequence 8,192, bf16 (priced on dgx-h100's 80 GB parts; the row's are 96 GB)."""
    toml = """[model]
name = "llama3"
flavor = "8B"

[training]
local_batch_size = 2
seq_len = 8192
mixed_precision_param = "bfloat16"
compile = false

[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 1

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""
    cluster = al.Cluster.parse("dgx-h100:1")
    plan = al.import_config(toml, cluster=cluster)
    row = al.fsdp_plan(al.models.get("llama3-8b", seq_len=8192, batch_size=16), cluster, local_batch_size=2,
                       remat="selective", precision="bf16", compile=False,  # the file's compile = false: eager
                       eager_loss="torchtitan")  # and its float32 loss computed op by op (components/loss.py)
    assert layout(plan) == layout(row)
    assert plan.cost.step_time_s == row.cost.step_time_s and plan.cost.peak_mem_bytes == row.cost.peak_mem_bytes
    assert not plan.cluster.device.efficiency.kernel_fusion


def test_an_eager_fsdp_plan_exports_compile_false_and_imports_back_eager(tiny):
    """A plan priced without torch.compile (fsdp_plan(compile=False): every elementwise op its own kernel) writes
    torchtitan's ``compile = false``; the file read back prices the same eager plan, with torchtitan's eager float32
    loss, which compile = false brings and the export says this plan did not price. A fused plan writes ``true``."""
    model, table = tiny
    eager = al.fsdp_plan(model, TWO_H100, local_batch_size=4, precision="bf16", compile=False)
    text = al.export_config(eager, "torchtitan", model=model)
    assert "\ncompile = false\n" in text
    assert "# compile = false also computes torchtitan's float32 loss op by op, which importing this file prices" \
        in text
    again = al.import_config(text, model, cluster=TWO_H100)
    assert not again.cluster.device.efficiency.kernel_fusion
    with_loss = al.fsdp_plan(table=eager.table, local_batch_size=4, precision="bf16", compile=False,
                             eager_loss="torchtitan")
    assert layout(again) == layout(with_loss) and again.cost.peak_mem_bytes == with_loss.cost.peak_mem_bytes
    assert again.cost.step_time_s == eager.cost.step_time_s  # the loss's memory, not its time
    fused = al.fsdp_plan(model, TWO_H100, local_batch_size=4, precision="bf16", table=table)
    assert "\ncompile = true\n" in al.export_config(fused, "torchtitan", model=model)
    assert fused.cost.step_time_s < eager.cost.step_time_s  # the eager kernels read and write more


# --- the loss and the gradients between microbatches (issue 31) ------------------------------------------------------

EAGER_TOML = """[training]
local_batch_size = 2
global_batch_size = 64
mixed_precision_param = "bfloat16"
compile = false

[parallelism]
data_parallel_shard_degree = 8
tensor_parallel_degree = 2
"""


@pytest.fixture(scope="module")
def eager_table(tiny):
    """The tiny model's cost table with eager PyTorch's kernels (torchtitan's compile = false)."""
    model, _ = tiny
    return al.fsdp_plan(model, TWO_H100, dp_shard=8, tp=2, local_batch_size=4, precision="bf16",
                        compile=False).table


def test_torchtitan_compile_false_prices_its_eager_float32_loss_and_round_trips(tiny, eager_table):
    """torchtitan computes its loss after the model, F.cross_entropy on the logits cast to float32, compiled only
    with compile = true (components/loss.py, tests/data/framework_keys.json's loss_note): a file that says
    compile = false is fsdp_plan(eager_loss="torchtitan"), and import -> export -> import prices the same."""
    from autopar_lab.pricing.eagerloss import eager_loss_bytes

    model, _ = tiny
    plan = al.import_config(EAGER_TOML, model, table=eager_table)
    direct = al.fsdp_plan(table=eager_table, dp_shard=8, tp=2, microbatches=4, remat="selective", precision="bf16",
                          compile=False, eager_loss="torchtitan")
    assert layout(plan) == layout(direct) and plan.cost.peak_mem_bytes == direct.cost.peak_mem_bytes
    assert plan.method.endswith(",torchtitan-loss)") and "accumulate" not in plan.stage_pins
    # float32 log-probabilities and two float32 gradients of the batch's logits, over 8 replicas and 2 vocab shards
    assert plan.stage_pins["eager_loss"] == eager_loss_bytes("torchtitan", BATCH * 16 * 64, 8, 2)
    assert any(n.startswith("compile = false: torchtitan computes its float32 cross-entropy") for n in plan.notes)
    text, again = round_trip(plan, "torchtitan", model, eager_table)
    assert "\ncompile = false\n" in text and "dropped" not in text
    assert again.cost.explain() == plan.cost.explain()


@pytest.mark.parametrize("extra, loss, note", [
    ("", None, "compile left out (torchtitan's default is false"),
    ("[liger_kernel]\nenable_fused_linear_cross_entropy = true\n", None, "the loss is Liger's fused linear"),
    ("[liger_kernel]\nenable_fused_linear_cross_entropy = false\n", "torchtitan", "compile = false: torchtitan"),
])
def test_torchtitan_prices_the_eager_loss_only_where_it_runs(tiny, eager_table, extra, loss, note):
    """Compile left out keeps the cluster's own kernels and the traced loss (a note says torchtitan's default);
    Liger's fused linear cross-entropy holds no logits; compile = true compiles the loss: none of these price it."""
    model, table = tiny
    toml = (EAGER_TOML if loss or "liger" in extra else EAGER_TOML.replace("compile = false\n", "")) + extra
    plan = al.import_config(toml, model, table=eager_table if "compile = false" in toml else table)
    assert plan.stage_pins.get("eager_loss") is not None if loss else "eager_loss" not in plan.stage_pins
    assert any(n.startswith(note) for n in plan.notes)
    compiled = al.import_config(EAGER_TOML.replace("compile = false", "compile = true"), model, table=table)
    assert "eager_loss" not in compiled.stage_pins and not any("loss" in n for n in compiled.notes)


def test_liger_with_pipeline_parallelism_is_refused_as_torchtitan_does(tiny):
    model, table = tiny
    toml = EAGER_TOML + "pipeline_parallel_degree = 2\n[liger_kernel]\nenable_fused_linear_cross_entropy = true\n"
    with pytest.raises(ValueError, match="refused by torchtitan with pipeline parallelism"):
        al.import_config(toml, model, table=table)


def test_export_drops_what_a_framework_cannot_express_and_says_so(tiny):
    """KempnerForge's bf16 loss and gradients held unsharded between microbatches have no torchtitan or MaxText
    switch: the export writes the rest, says what it dropped, and the file prices the plan without them."""
    model, table = tiny
    kf = al.fsdp_plan(table=table, dp_shard=16, microbatches=2, precision="bf16", accumulate_unsharded=True,
                      eager_loss="kempnerforge")
    plain = al.fsdp_plan(table=table, dp_shard=16, microbatches=2, precision="bf16")
    assert kf.method == "fsdp(dp_shard=16,no-sync,kempnerforge-loss)"
    for fw, own in (("torchtitan", "torchtitan runs its float32 loss"), ("maxtext", "MaxText runs its loss inside")):
        text = al.export_config(kf, fw, model=model)
        assert "# not expressible, dropped: KempnerForge's bf16 loss on logits gathered whole" in text
        assert own in text and "# not expressible, dropped: the gradients held unsharded in float32" in text
        back = al.import_config(text, model, framework=fw, table=table)
        assert "eager_loss" not in back.stage_pins and "accumulate" not in back.stage_pins
    back = al.import_config(al.export_config(kf, "torchtitan", model=model), model, table=table)
    assert layout(back) == layout(plain) and back.cost.peak_mem_bytes == plain.cost.peak_mem_bytes
    assert "reduce-scatters the gradients every microbatch" in al.export_config(kf, "torchtitan", model=model)
    # torchtitan's own loss on fused kernels: its compile = true compiles the loss too
    fused = al.fsdp_plan(table=table, dp_shard=16, microbatches=2, precision="bf16", eager_loss="torchtitan")
    assert "with compile = true (the plan's fused kernels) torchtitan compiles its loss too" in \
        al.export_config(fused, "torchtitan", model=model)
    assert "dropped" not in al.export_config(plain, "torchtitan", model=model)
    # Megatron-LM has no switch for either: a Megatron plan carrying the pins says so too
    meg = al.megatron_plan(table=table, dp=16, tp=1, pp=1, zero=1, microbatches=2, precision="bf16")
    pinned = dataclasses.replace(meg, stage_pins={**meg.stage_pins, "accumulate": "unsharded", "eager_loss": 1e6})
    text = al.export_config(pinned, "megatron", model=model)
    assert "# not expressible, dropped: an eager framework's loss (eager_loss); Megatron-LM runs its own fused" in text
    assert "Megatron-LM has no switch to hold them so" in text
    assert "dropped" not in al.export_config(meg, "megatron", model=model)


def test_exporting_a_cuda_graph_megatron_plan_elsewhere_says_the_graphs_are_dropped(small_kernels):
    model, table = small_kernels
    graphs = al.megatron_plan(table=table, dp=8, tp=1, pp=1, zero=0, precision="bf16", cuda_graphs=True)
    assert graphs.method.endswith(",graphs)")
    for fw, name in (("torchtitan", "torchtitan"), ("maxtext", "MaxText")):
        text = al.export_config(graphs, fw, model=model)
        assert f"# not expressible, dropped: the plan's CUDA graphs (Megatron-LM's --cuda-graph-impl, every kernel " \
               f"launched from a graph); {name} has no switch for them" in text
    assert "dropped" not in al.export_config(graphs, "megatron", model=model)
    plain = al.megatron_plan(table=table, dp=8, tp=1, pp=1, zero=0, precision="bf16")
    assert "CUDA graphs" not in al.export_config(plain, "torchtitan", model=model)


@pytest.mark.slow
def test_maxtext_v5p_row_imports_as_maxtext_plan_prices_it():
    """MaxText's v5p table, the 32B row's layout (FSDP over the slice, tensor 4, per-device batch 6, remat minimal,
    sequence 2,048) on one v5p-128 slice (64 chips), on the zoo's Llama 3 8B (the row's 32B shape is not in the
    zoo)."""
    yml = """model_name: llama3-8b
max_target_length: 2048
per_device_batch_size: 6
ici_fsdp_parallelism: -1
ici_tensor_parallelism: 4
remat_policy: minimal
steps: 20
"""
    cluster = al.Cluster.parse("tpu-v5p:64")
    plan = al.import_config(yml, cluster=cluster)
    row = al.maxtext_plan(al.models.get("llama3-8b", seq_len=2048, batch_size=384), cluster, ici_tensor=4,
                          per_device_batch_size=6, remat="minimal", precision="bf16")
    assert layout(plan) == layout(row)
    assert plan.cost.step_time_s == row.cost.step_time_s


# --- bad input: one sentence ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, framework, words", [
    ("--tensor-model-paralel-size 2 --micro-batch-size 1", None, "did you mean '--tensor-model-parallel-size'"),
    ("--recompute-activations --recompute-granularity full --micro-batch-size 1", None, "contradicts"),
    ("--bf16 --fp16 --micro-batch-size 1", "megatron", "exclude each other"),
    ("--micro-batch-size 1 --micro-batch-size 2", "megatron", "given twice"),
    ("--micro-batch-size 1 --cuda-graph-impl full_iteration", None, "must be none, local or transformer_engine"),
    ("--micro-batch-size 1 --enable-cuda-graph --external-cuda-graph", None, "exclude each other"),
    ("--micro-batch-size 1 --external-cuda-graph --cuda-graph-impl local", None,
     "deprecated spelling of --cuda-graph-impl transformer_engine"),
    ("--micro-batch-size 1 --cuda-graph-impl local --recompute-granularity full", None,
     "exclude full recomputation"),
    ("--micro-batch-size 1 --enable-cuda-graph --checkpoint-activations", None, "exclude full recomputation"),
    ("--micro-batch-size 1 --cuda-graph-impl local --cuda-graph-scope layer", None,
     "--cuda-graph-scope takes attn, mlp, moe"),
    ("--micro-batch-size 1 --cuda-graph-impl transformer_engine --cuda-graph-scope full_iteration", None,
     "full_iteration needs --cuda-graph-impl local"),
    ("--micro-batch-size 1 --cuda-graph-impl local --cuda-graph-scope", None, "needs one or more values"),
    ("--micro-batch-size 1 --cuda-graph-scope attn --cuda-graph-scope mlp", None, "given twice"),
    ("--micro-batch-size 1 --cuda-graph-scope=attn mlp", None, "'mlp' is not a flag"),
    ("[parallelism]\ntensor_paralel_degree = 2\n", None, "is not a torchtitan key"),
    ("[training]\nlocal_batch_size = 1\n[activation_checkpoint]\nmode = \"some\"\n", None, "mode must be"),
    ("ici_tensor_transpose_parallelism: 2\nper_device_batch_size: 4\n", None, "not modelled"),
    ("ici_tensr_parallelism: 2\n", "maxtext", "not a MaxText parallelism axis"),
    ("per_device_batch_sise: 4\nici_tensor_parallelism: 2\n", None, "did you mean 'per_device_batch_size'"),
    ("remat_policy: custom\nper_device_batch_size: 4\n", None, "not modelled"),
    ("hello: world\n", None, "cannot tell which framework"),
    ("run.toml", None, "no configuration file 'run.toml'"),
])
def test_bad_configurations_are_one_sentence(tiny, text, framework, words):
    model, table = tiny
    with pytest.raises(ValueError) as e:
        al.import_config(text, model, framework=framework, table=table)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_configuration_file_is_read_by_its_path(tiny, tmp_path):
    model, table = tiny
    path = tmp_path / "run.yaml"
    path.write_text(maxtext_text(2, 1, 1, "data", "full", 2, 2, 1))
    for source in (path, str(path)):
        plan = al.import_config(source, model, table=table)
        assert plan.method == "maxtext(ici_fsdp=4,ici_tensor=2,dcn_data=2,remat=full)" and plan.microbatches == 2


def test_a_configuration_contradicting_the_model_is_refused(tiny):
    model, table = tiny
    with pytest.raises(ValueError, match="batch size 32, but the model"):
        al.import_config(megatron_text(1, 1, 1, False, False, None, 1, None).replace("--global-batch-size 64",
                                                                                    "--global-batch-size 32"), model,
                         cluster=TWO_H100)
    with pytest.raises(ValueError, match="does not say which model"):
        al.import_config("--micro-batch-size 1 --tensor-model-parallel-size 2", cluster=TWO_H100)
    with pytest.raises(ValueError, match="pass cluster="):
        al.import_config("--micro-batch-size 1 --tensor-model-parallel-size 2", model)


# --- what no framework switch expresses -----------------------------------------------------------------------------

@pytest.mark.slow
def test_export_names_the_decision_a_framework_cannot_express(tiny):
    model, table = tiny
    uneven = al.price_plan(table, [((0, 1), (1, 8), (8, 1), False), ((2, 5), (1, 8), (8, 1), False)], microbatches=4)
    with pytest.raises(ValueError, match="uneven stages are not expressible"):
        al.export_config(uneven, "megatron")
    meshes = al.price_plan(table, [((0, 2), (1, 8), (8, 1), False), ((3, 5), (1, 8), (4, 2), False)], microbatches=4)
    with pytest.raises(ValueError, match="runs every stage on the same mesh"):
        al.export_config(meshes, "torchtitan")
    zero1 = al.megatron_plan(table=table, dp=8, tp=2, pp=1, zero=1, sequence_parallel=True, precision="bf16")
    with pytest.raises(ValueError, match="ZeRO-1 .* has no torchtitan switch"):
        al.export_config(zero1, "torchtitan")
    with pytest.raises(ValueError, match="ZeRO-1 .* has no MaxText switch"):
        al.export_config(zero1, "maxtext")
    gpipe = al.megatron_plan(table=table, dp=4, tp=2, pp=2, microbatches=4, schedule="gpipe", precision="bf16")
    with pytest.raises(ValueError, match="gpipe schedule is not one Megatron-LM runs"):
        al.export_config(gpipe, "megatron")
    op = next(o for o in zero1.graph.ops if zero1.graph.op(o).primitive == "dot_general")
    other = next(a.strategy for a in zero1.alternatives(op) if a.strategy != zero1.choice(op).name)
    with pytest.raises(ValueError, match="pins operator .* has no switch for one operator's sharding"):
        al.export_config(zero1.with_choice(op, other), "megatron")


def test_an_auto_plan_of_equal_stages_exports_its_mesh_as_the_layout(tiny):
    model, table = tiny
    plan = al.price_plan(table, [((0, 5), (2, 8), (8, 2), "selective")], microbatches=4)
    text = al.export_config(plan, "megatron", model=model)
    assert "--tensor-model-parallel-size 2" in text and "--micro-batch-size 2" in text
    assert "not the planner's choice" in text        # the ILP's per-operator sharding is not carried
    again = al.import_config(text, model, table=table)
    assert [tuple(s.logical_mesh) for s in again.stages] == [(8, 2)] and again.microbatches == 4


# --- the best plan a framework can run -------------------------------------------------------------------------------

@pytest.mark.slow
def test_auto_plan_expressible_in_megatron_is_the_grid_best_and_states_the_gap():
    model = al.models.get("llama3-tiny", num_layers=4, batch_size=32, dtype="bfloat16")
    table = CostTable.build(model, al.Cluster.parse("dgx-h100:1"), precision="bf16")
    plan = al.auto_plan(table=table, expressible_in="megatron")
    assert plan.method.startswith("megatron(") and plan.cost.fits
    al.export_config(plan, "megatron", model=model)  # a plan Megatron-LM runs
    for kw in (dict(dp=8, tp=1, pp=1, micro_batch_size=4, zero=1), dict(dp=4, tp=2, pp=1, sequence_parallel=True),
               dict(dp=2, tp=2, pp=2, schedule="interleaved", virtual_stages=2, micro_batch_size=2),
               dict(dp=1, tp=8, pp=1, remat="selective", zero=0)):
        other = al.megatron_plan(table=table, precision="bf16", **kw)
        assert not other.cost.fits or plan.cost.step_time_s <= other.cost.step_time_s, kw
    free = al.auto_plan(table=table)
    gap = plan.cost.step_time_s / free.cost.step_time_s - 1
    assert f"what Megatron-LM's limits cost: {gap:+.1%}" in plan.notes[-1]
    # the grid's search prices layouts against the best so far: it finds what pricing all of them in full finds
    best, priced = exhaustive_best("megatron", table)
    assert layout(plan) == layout(best) and plan.cost.step_time_s == best.cost.step_time_s
    skipped = int(re.search(r"(\d+) stopped by a lower bound", plan.notes[-1]).group(1))
    assert 0 < skipped < priced
    with pytest.raises(ValueError, match="expressible_in must be one of megatron, torchtitan, maxtext"):
        al.auto_plan(table=table, expressible_in="deepspeed")


# --- the keys are the frameworks' own --------------------------------------------------------------------------------

def test_the_keys_read_are_recorded_with_the_source_they_were_checked_against():
    for fw in ("megatron", "torchtitan", "maxtext"):
        assert len(KEYS[fw]["commit"]) == 40 and KEYS[fw]["path"] and "/" in KEYS[fw]["repository"]
    assert sorted(megatron_args.FLAGS) == KEYS["megatron"]["keys"]
    assert {s: list(v) for s, v in torchtitan_toml.KEYS.items()} == KEYS["torchtitan"]["keys"]
    for section, keys in torchtitan_toml.MODELLED.items():
        assert set(keys) <= set(KEYS["torchtitan"]["keys"][section])
    modelled = [f"ici_{a}_parallelism" for a in maxtext_yaml.MODELLED_ICI] + \
               [f"dcn_{a}_parallelism" for a in maxtext_yaml.MODELLED_DCN]
    assert set(modelled) | set(maxtext_yaml.MODELLED) <= set(KEYS["maxtext"]["keys"])


# --- as the user runs it ---------------------------------------------------------------------------------------------

def _cli(*args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "autopar_lab", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=900)


def _cli_here(capsys, monkeypatch, *args, cwd):
    """The same command through ``cli.main`` in this process, run in ``cwd``: a round trip's second run, whose first
    ran as the user runs it (``_cli``: a process of its own, from another directory). It spares the interpreter's
    start and the imports (2-3 CPU-s a run); what is printed and the exit status are main's, as in a process."""
    from autopar_lab.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code = main(list(args))
    printed = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, printed.out, printed.err)


@pytest.mark.slow
def test_cli_imports_a_torchtitan_toml_and_exports_maxtext_yaml_from_another_directory(tmp_path, capsys,
                                                                                       monkeypatch):
    (tmp_path / "run.toml").write_text(torchtitan_text(1, 2, 1, 1, "default", "full", 2, "1F1B", 1, seq=16))
    model = ["llama3-tiny", "--layers", "4", "--batch", str(BATCH), "--dtype", "bfloat16"]
    out = _cli("plan", *model, "--cluster", "dgx-h100:2", "--from-config", "run.toml", "--export", "maxtext",
               "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["method"] == "fsdp(dp_shard=8,tp=2,full,sp)" and got["microbatches"] == BATCH // (8 * 2)
    assert "ici_tensor_parallelism: 2" in got["config_text"] and "remat_policy: 'full'" in got["config_text"]
    (tmp_path / "run.yaml").write_text(got["config_text"])
    back = _cli_here(capsys, monkeypatch, "plan", *model, "--cluster", "dgx-h100:2", "--from-config", "run.yaml",
                     "--json", cwd=tmp_path)
    assert back.returncode == 0, back.stderr[-2000:]
    assert json.loads(back.stdout)["method"].startswith("maxtext(ici_fsdp=4,ici_tensor=2,dcn_fsdp=2")


@pytest.mark.slow
def test_cli_plans_the_best_layout_torchtitan_can_run_and_exports_it_from_another_directory(tmp_path, capsys,
                                                                                            monkeypatch):
    """The CLI's wiring of --expressible-in and --export, on the smallest model whose grid still pipelines (2 layers,
    batch 16: 48 layouts, 21 CPU-s; the 4-layer batch-32 grid took 39 CPU-s, 325 s wall under load). The search itself
    is checked on the 4-layer model in process (test_auto_plan_expressible_in_megatron_is_the_grid_best_...)."""
    model = ["llama3-tiny", "--layers", "2", "--batch", "16", "--dtype", "bfloat16"]
    out = _cli("plan", *model, "--cluster", "dgx-h100:1", "--expressible-in", "torchtitan", "--export",
               "torchtitan", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["method"].startswith("fsdp(") and got["fits"]
    assert any("what torchtitan's limits cost: " in n for n in got["notes"])
    text = got["config_text"]
    assert "[parallelism]" in text and "data_parallel_shard_degree" in text
    # the model's own bfloat16 step (no --precision) is written as torchtitan's bf16 mixed precision, and says so
    assert 'mixed_precision_param = "bfloat16"' in text and "bfloat16 step written as the framework's bf16" in text
    (tmp_path / "best.toml").write_text(text)
    back = _cli_here(capsys, monkeypatch, "plan", *model, "--cluster", "dgx-h100:1", "--from-config", "best.toml",
                     "--json", cwd=tmp_path)
    assert back.returncode == 0, back.stderr[-2000:]
    assert json.loads(back.stdout)["method"] == got["method"]


@pytest.mark.slow
def test_cli_imports_megatron_cuda_graphs_and_exports_them_from_another_directory(tmp_path, capsys, monkeypatch):
    """A Megatron-LM script with --cuda-graph-impl transformer_engine priced from another directory: no host term
    (the kernels replayed from graphs), and its export reads back as the same plan."""
    model = ["gpt-tiny", "--layers", "2", "--batch", "8", "--seq-len", "64", "--hidden", "128", "--heads", "4",
             "--vocab", "512", "--dtype", "bfloat16"]
    (tmp_path / "run.sh").write_text(SMALL_ARGS + "--cuda-graph-impl transformer_engine\n")
    out = _cli("plan", *model, "--cluster", "dgx-h100:1", "--from-config", "run.sh", "--export", "megatron", "--json",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["method"] == "megatron(dp=8,tp=1,pp=1,zero=0,graphs)" and "host_s" not in got
    assert "--cuda-graph-impl local" in got["config_text"]
    (tmp_path / "back.sh").write_text(got["config_text"])
    back = _cli_here(capsys, monkeypatch, "plan", *model, "--cluster", "dgx-h100:1", "--from-config", "back.sh",
                     "--json", cwd=tmp_path)
    assert back.returncode == 0, back.stderr[-2000:]
    again = json.loads(back.stdout)
    assert again["method"] == got["method"] and again["step_time_s"] == got["step_time_s"]


def test_cli_prices_torchtitan_s_eager_loss_and_shows_its_term_from_another_directory(tmp_path, capsys, monkeypatch):
    """A torchtitan TOML with compile = false priced by the CLI: its JSON carries the eager loss's term (the pin's
    bytes, the stage computing it, what it adds there) and the printed plan says it."""
    (tmp_path / "run.toml").write_text(EAGER_TOML)
    model = ["llama3-tiny", "--layers", "4", "--batch", str(BATCH), "--dtype", "bfloat16"]
    out = _cli("plan", *model, "--cluster", "dgx-h100:2", "--from-config", "run.toml", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["method"].endswith(",torchtitan-loss)") and got["eager_loss_bytes"] > 0
    assert got["loss_stage"] == 0 and got["loss_extra_bytes"] >= 0 and "unsharded_grad_bytes" not in got
    assert any(n.startswith("compile = false: torchtitan computes its float32 cross-entropy") for n in got["notes"])
    shown = _cli_here(capsys, monkeypatch, "plan", *model, "--cluster", "dgx-h100:2", "--from-config", "run.toml",
                      cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"eager loss: {got['eager_loss_bytes'] / 2**30:.2f} GiB of logits-sized tensors a step; stage 0" in \
        shown.stdout


def test_cli_bad_configuration_exits_2_with_one_sentence(tmp_path, capsys, monkeypatch):
    from autopar_lab.cli import main

    (tmp_path / "run.sh").write_text("pretrain_gpt.py --tensor-model-paralel-size 2 --micro-batch-size 1\n")
    out = _cli("plan", "llama3-tiny", "--cluster", "dgx-h100:2", "--from-config", "run.sh", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "did you mean '--tensor-model-parallel-size'" in out.stderr
    monkeypatch.chdir(tmp_path)
    for extra, words in ((["--tp", "2"], "--tp conflicts with --from-config"),
                         (["--export", "megatron", "--precision", "bf16"], "--precision conflicts with --from-config"),
                         (["--expressible-in", "maxtext"], "--expressible-in conflicts with --from-config")):
        assert main(["plan", "llama3-tiny", "--cluster", "dgx-h100:2", "--from-config", "run.sh", *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1
    assert main(["plan", "llama3-tiny", "--cluster", "dgx-h100:1", "--method", "data", "--expressible-in",
                 "megatron"]) == 2
    err = capsys.readouterr().err
    assert "--expressible-in applies to --method auto" in err and err.count("\n") == 1


# --- the workbench's controls ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_workbench_imports_a_torchtitan_toml_and_exports_maxtext_yaml(tiny):
    from autopar_lab.widgets.session import Session
    from autopar_lab.widgets.views.controls import Controls

    model, table = tiny
    start = al.megatron_plan(table=table, dp=16, tp=1, pp=1, micro_batch_size=1, precision="bf16")
    session = Session(start, model=model)
    controls = Controls(session)
    controls.config_box.value = torchtitan_text(1, 2, 1, 1, "default", "full", 2, "1F1B", 1, seq=16)
    controls.import_config()
    assert session.plan.method == "fsdp(dp_shard=8,tp=2,full,sp)" and session.can_undo
    controls.framework.value = "maxtext"
    text = controls.export_config()
    assert controls.config_box.value == text and "ici_tensor_parallelism: 2" in text
    assert controls.config_panel.layout.display is None  # the box is shown with the text in it
    controls.config_box.value = "--tensor-model-paralel-size 2 --micro-batch-size 1"
    controls.import_config()
    assert "did you mean" in controls.message.value and session.plan.method.startswith("fsdp(")  # nothing changed
    session.undo()
    assert session.plan is start


# --- the grids' search -----------------------------------------------------------------------------------------------

def priced_grid(framework, table):
    """Each layout of ``framework``'s grid: (planner, keywords, its plans up the framework's recomputation ladder as
    (remat, plan), priced lazily and stopping where the planner refuses the layout)."""
    from autopar_lab.frameworks.grid import grid

    ladder = ("none", "minimal", "full") if framework == "maxtext" else (False, "selective", True)

    def climb(fn, kw):
        for remat in ladder:
            try:
                plan = fn(table=table, remat=remat, **kw)
            except ValueError:
                return
            yield remat, plan

    for fn, kw in grid(framework, table):
        yield fn, kw, climb(fn, kw)


def exhaustive_best(framework, table):
    """The fastest plan of ``framework``'s grid that fits, each layout priced in full (no bound) and recomputing
    no more than it must to fit, and how many plans that priced."""
    best, priced = None, 0
    for _fn, _kw, ladder in priced_grid(framework, table):
        for _remat, plan in ladder:
            priced += 1
            if plan.cost.fits:
                if best is None or plan.cost.step_time_s < best.cost.step_time_s:
                    best = plan
                break
    return best, priced


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["maxtext"])
def test_the_bounded_grid_search_finds_the_exhaustive_grids_best(framework):
    """Pricing each layout against the best so far skips most of the grid, and finds what pricing every layout in
    full finds (the same plan, to the bit). Megatron-LM's grid: in the expressible_in test above (torchtitan's
    search is the same code with Megatron-LM's recomputation ladder; its grid's ILPs take a minute here)."""
    from autopar_lab.frameworks.grid import best_in_grid

    model = al.models.get("llama3-tiny", num_layers=2, batch_size=16, dtype="bfloat16")
    table = CostTable.build(model, al.Cluster.parse("dgx-h100:1"), precision="bf16")
    found = best_in_grid(framework, table)
    best, priced = exhaustive_best(framework, table)
    assert found.best is not None and layout(found.best) == layout(best)
    assert found.best.cost.step_time_s == best.cost.step_time_s
    assert found.skipped > 0 and found.priced - found.skipped < priced


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["megatron", "torchtitan", "maxtext"])
def test_the_floor_checked_before_a_layouts_ilp_is_below_its_priced_step_on_every_layout(framework):
    """The grids skip a layout before solving its ILP where its floor (the least compute any sharding gives, its
    launches and task overheads: layouts.engine.compute_floor) is above the best so far: that floor is never above
    the step the layout is priced at, for every layout of the grid and every recomputation, brute force."""
    from autopar_lab.pricing.price import StepAbove

    model = al.models.get("llama3-tiny", num_layers=2, batch_size=8, dtype="bfloat16")
    table = CostTable.build(model, al.Cluster.parse("dgx-h100:1"), precision="bf16")
    ratios = []
    for fn, kw, ladder in priced_grid(framework, table):
        for remat, plan in ladder:
            with pytest.raises(StepAbove) as above:  # any step to beat below the floor: raised before the ILP
                fn(table=table, remat=remat, skip_above=0.0, **kw)
            assert 0 < above.value.floor <= plan.cost.step_time_s, (kw, remat)
            ratios.append(above.value.floor / plan.cost.step_time_s)
    assert len(ratios) > 20 and max(ratios) > 0.5  # every layout checked, and the floor is not a vacuous one


@pytest.mark.slow
def test_the_bounded_grid_search_finds_the_exhaustive_best_on_a_deep_model():
    """On 24 layers (planned on the shallow copy, pipelines of up to 8 stages and their bubbles) the search that
    skips layouts before their ILPs still finds what pricing every layout in full finds, to the bit (torchtitan's
    grid: Megatron-LM's runs the same search, checked on 4 layers above)."""
    from autopar_lab.frameworks.grid import best_in_grid

    framework = "torchtitan"
    model = al.models.get("llama3-tiny", num_layers=24, batch_size=16, dtype="bfloat16")
    table = CostTable.build(model, al.Cluster.parse("dgx-h100:1"), precision="bf16")
    found = best_in_grid(framework, table)
    best, priced = exhaustive_best(framework, table)
    assert found.best is not None and layout(found.best) == layout(best)
    assert found.best.cost.step_time_s == best.cost.step_time_s
    assert found.skipped > 0


def test_the_grids_try_context_parallelism_at_long_sequences_and_maxtext_pipelines_across_slices():
    from autopar_lab.frameworks.grid import CP_MIN_TOKENS, context_degrees, grid

    # Llama 3 ran CP 1 at its 8,192-token pre-training sequence and CP 16 at 131,072 tokens: both are in the grid
    assert context_degrees(8192) == [1] and context_degrees(131072)[-1] == 16 and context_degrees(100) == [1]
    assert context_degrees(3 * CP_MIN_TOKENS) == [1, 2]  # 3 x 8,192 tokens: 2 ranks of 12,288 (4 would keep 6,144)

    long = al.models.get("llama3-tiny", num_layers=4, batch_size=BATCH, seq_len=4 * CP_MIN_TOKENS, dtype="bfloat16")
    table = CostTable.build(long, TWO_H100, precision="bf16")
    for fw in ("megatron", "torchtitan"):
        layouts = [kw for _, kw in grid(fw, table)]
        assert {kw["cp"] for kw in layouts} == {1, 2, 4}  # each rank keeps >= CP_MIN_TOKENS tokens
        for kw in layouts:
            dp = kw["dp"] if fw == "megatron" else kw["dp_replicate"] * kw["dp_shard"]
            assert dp * kw["tp"] * kw["pp"] * kw["cp"] == 16
    maxtext = [kw for _, kw in grid("maxtext", table)]
    assert {kw["ici_sequence"] for kw in maxtext} == {1, 2, 4}
    piped = [kw for kw in maxtext if kw.get("dcn_pipeline", 1) > 1]
    assert piped and all(kw["dcn_pipeline"] == 2 and kw["microbatches"] in (2, 4, 8) for kw in piped)
