"""Number formats as a plan decision (autopar_lab.precision): memory per parameter against ZeRO's count, the
gradient reduction's bytes, FP8 matmuls and their casts against hand formulas, and the format kept by every planner,
override, re-solve, what-if, plan file, view, export and the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar_lab as al
from autopar_lab.cluster import Cluster
from autopar_lab.graph.fusion import attach_kernel_roles, kernel_role
from autopar_lab.graph.opgraph import FORWARD, FP8_CASTS, UPDATE
from autopar_lab.memory import PARTS, memory_breakdown
from autopar_lab.precision import NAMES, as_precision, precision_of, retype
from autopar_lab.pricing import CostTable
from autopar_lab.sharding.strategies import cast_time, kernel_time, strategies_for
from autopar_lab.solve.intra import weight_gradient_ops

ROOT = Path(__file__).resolve().parents[1]
ONE_H100 = Cluster.preset("dgx-h100").with_(devices_per_host=1)
TWO_H100 = Cluster.preset("dgx-h100").with_(devices_per_host=2)
ADAM_COUNT = 4  # optax's Adam keeps its step count as one int32 beside the two moments
SMALL = dict(num_layers=2, hidden_size=64, num_heads=4, seq_len=16, batch_size=8, vocab_size=128)


def small_gpt(**kw):
    return al.models.get("gpt-1.3b", **{"dtype": "bfloat16", **SMALL, **kw})


@pytest.fixture(scope="module")
def deep():
    """GPT-1.3B's 24 layers at a small width: planned on its shallow copy, as users' deep models are."""
    return al.models.get("gpt-1.3b", dtype="bfloat16", hidden_size=256, num_heads=4, seq_len=128, batch_size=8,
                         vocab_size=1024)


@pytest.fixture(scope="module")
def deep_plans(deep):  # 5 cost tables of a 24-layer model (a 4- and a 6-layer trace each): ~25 s
    return {name: al.data_parallel_plan(deep, ONE_H100, precision=name) for name in NAMES}


@pytest.mark.slow
def test_memory_per_parameter_is_zeros_count_to_the_byte(deep, deep_plans):
    """One H100, one stage, data parallel 1: bf16 keeps 2 + 4 + 4 + 4 + 4 bytes a parameter (bf16 weights, fp32
    gradients, fp32 master, two fp32 moments), fp16 2 + 2 + 4 + 8, fp32 4 + 4 + 8 with no master."""
    P = deep.param_count
    assert deep.config.num_layers == 24 and deep_plans["bf16"].table.solve_graph is not deep_plans["bf16"].graph
    want = {"bf16": (2, 4, 4), "fp16": (2, 2, 4), "fp32": (4, 4, 0)}
    for name, (param, grad, master) in want.items():
        plan = deep_plans[name]
        assert len(plan.stages) == 1 and plan.stages[0].logical_mesh == (1, 1)
        row = memory_breakdown(plan)[0]
        assert row["params_bytes"] == param * P, name
        assert row["grads_bytes"] == grad * P, name
        assert row["master_bytes"] == master * P, name
        assert row["optimizer_bytes"] == 8 * P + ADAM_COUNT, name
        assert row["fp8_copies_bytes"] == 0
        assert sum(row[p] for p in PARTS) == pytest.approx(plan.stages[0].peak_mem_bytes, rel=1e-12)
        assert plan.precision.name == name


@pytest.mark.slow
def test_fp8_weight_copies_are_a_part_of_their_own(deep, deep_plans):
    """FP8 keeps bf16's 18 bytes and, for every linear layer's weight (12 H^2 per transformer block: qkv, proj, fc1,
    fc2; the head's tied embedding stays bf16), an FP8 copy and its transpose: 2 bytes, plus DeepSeek-V3's one fp32
    scale per 128 x 128 block and copy with blockwise scaling."""
    P, H, L = deep.param_count, deep.config.hidden_size, deep.config.num_layers
    linear = 12 * H * H * L
    bf16 = memory_breakdown(deep_plans["bf16"])[0]
    for name, per in (("fp8", 2.0), ("fp8-block", 2 * (1 + 4 / (128 * 128)))):
        row = memory_breakdown(deep_plans[name])[0]
        assert row["fp8_copies_bytes"] == per * linear, name
        for part in ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes"):
            assert row[part] == bf16[part], (name, part)
        assert row["grads_bytes"] == 4 * P


def test_fp8_is_faster_than_bf16_by_at_most_the_rate_ratio():
    """On an H100 the FP8 plan computes faster than bf16, by less than the FP8/BF16 rate ratio (casts, bf16
    attention and everything not a linear layer's GEMM stay as they were)."""
    spec = small_gpt(hidden_size=2048, num_heads=16, seq_len=512, batch_size=4, vocab_size=1024)
    dev = ONE_H100.device
    ratio = dev.peak("float8_e4m3fn") / dev.peak("bfloat16")
    bf16 = al.data_parallel_plan(spec, ONE_H100, precision="bf16").cost.compute_s
    for name in ("fp8", "fp8-block"):
        fp8 = al.data_parallel_plan(spec, ONE_H100, precision=name).cost.compute_s
        assert 1.0 < bf16 / fp8 <= ratio, name


def _fp8_ops(graph):
    return [n for n in graph if n.primitive == "dot_general" and n.in_dtypes[0] == "float8_e4m3fn"]


def test_one_gemms_cast_cost_is_the_hand_formula():
    """The activation a forward FP8 GEMM reads is cast by a kernel of its own: it reads the bf16 tensor (2 bytes an
    element) and writes an FP8 copy and a transposed one (1 + 1), plus with blockwise scaling one fp32 scale per
    128 elements of each copy; a weight is cast once a step, on the optimizer's update of its fp32 master."""
    spec = small_gpt(hidden_size=256, num_heads=4, seq_len=64, batch_size=4)
    mesh = ONE_H100.logical_mesh((1, 1), (1, 1))
    bw = ONE_H100.device.memory_bandwidth * ONE_H100.device.efficiency.memory
    for name, act_bytes in (("fp8", 2 + 2 * 1), ("fp8-block", 2 + 2 * (1 + 4 / 128))):
        g = retype(spec.trace(), name)
        attach_kernel_roles(g)
        fwd = next(n for n in _fp8_ops(g) if n.role == FORWARD)
        x = g.tensor(fwd.inputs[0])  # x @ w: the activation comes first
        assert fwd.params[FP8_CASTS] == (act_bytes, 0.0)
        s = strategies_for(fwd, mesh)[0]
        hand = x.size * act_bytes / bw
        ins = [float(g.tensor(t).size) for t in fwd.inputs]  # one device: every element, at 1 byte (FP8)
        assert cast_time(fwd, mesh, ins) == pytest.approx(hand, rel=1e-12)
        plain = kernel_time(fwd, s, mesh, ins, [g.tensor(fwd.outputs[0]).nbytes], 1)
        assert s.compute_s == pytest.approx(plain + hand, rel=1e-12)
        # the weight's cast: on the update op that writes its master, once a step
        updates = [n for n in g if n.role == UPDATE and FP8_CASTS in n.params]
        assert len(updates) == 4 * spec.config.num_layers  # qkv, proj, fc1, fc2 of each block
        u = updates[0]
        k = next(i for i, f in enumerate(u.params[FP8_CASTS]) if f)
        w = g.tensor(u.inputs[k])
        w_bytes = 2 + 2 * (1 + (4 / 128**2 if name == "fp8-block" else 0))
        u_ins = [float(g.tensor(t).nbytes) for t in u.inputs]
        assert cast_time(u, mesh, u_ins) == pytest.approx(w.size * w_bytes / bw, rel=1e-12)


def test_a_compute_bound_gemm_runs_at_the_fp8_rate():
    """A linear layer's GEMM large enough to be compute-bound is faster than in bf16 by exactly the H100's rate ratio
    (1978.9 vs 989.4 TFLOP/s) before its casts, and attention's score matmuls stay in bf16."""
    spec = small_gpt(hidden_size=2048, num_heads=16, seq_len=512, batch_size=4)
    mesh = ONE_H100.logical_mesh((1, 1), (1, 1))
    g16, g8 = retype(spec.trace(), "bf16"), retype(spec.trace(), "fp8")
    for g in (g16, g8):
        attach_kernel_roles(g)
    fc1 = next(n for n in _fp8_ops(g8) if n.role == FORWARD and n.out_shapes[0][-1] == 4 * 2048)
    same = g16.op(fc1.id)
    assert same.in_dtypes == ("bfloat16", "bfloat16") and kernel_role(same) == kernel_role(fc1)

    def gemm_s(node, g):
        s = strategies_for(node, mesh)[0]
        ins = [float(g.tensor(t).size * (1 if d.startswith("float8") else 2)) for t, d in zip(node.inputs,
                                                                                           node.in_dtypes)]
        return kernel_time(node, s, mesh, ins, [float(g.tensor(node.outputs[0]).nbytes)], 1)

    dev = ONE_H100.device
    ratio = dev.peak("float8_e4m3fn") / dev.peak("bfloat16")
    assert gemm_s(same, g16) == pytest.approx(ratio * gemm_s(fc1, g8), rel=1e-12)
    scores = [n for n in g8 if n.primitive == "dot_general" and n.role == FORWARD
              and n.params["dimension_numbers"][1][0]]  # batched: attention's scores and values
    assert scores and all(n.in_dtypes[0] == "bfloat16" for n in scores)


def test_bf16_reduces_gradients_in_fp32_twice_fp16s_bytes():
    """Data parallel on 2 H100s: every weight gradient is reduced once (the tied embedding twice, once from the
    embedding's scatter and once from the head's matmul), 2 bytes an element in fp16, 4 in bf16 (fp32)."""
    spec = small_gpt(hidden_size=256, num_heads=4, seq_len=128, batch_size=64, vocab_size=512)
    P, VH = spec.param_count, 512 * 256
    moved = {}
    for name in ("fp16", "bf16"):
        plan = al.data_parallel_plan(spec, TWO_H100, precision=name)
        g, intra = plan.op_graph, plan.stages[0].intra
        cols = [(kind, n) for op in weight_gradient_ops(g, g.ops)
                for kind, _axis, n in intra.strategies[op].collectives]
        assert cols and {k for k, _ in cols} <= {"all_reduce", "reduce_scatter"}
        moved[name] = sum(n for _k, n in cols)
    assert moved["fp16"] == 2 * (P + VH)
    assert moved["bf16"] == 4 * (P + VH) == 2 * moved["fp16"]


@pytest.fixture(scope="module")
def bf16():
    """(model, its bf16 cost table on 2 H100s, the auto plan priced by it)."""
    spec = small_gpt()
    table = CostTable.build(spec, TWO_H100, precision="bf16")
    return spec, table, al.auto_plan(table=table)


def test_every_planner_records_the_format(bf16):
    spec, table, auto = bf16
    plans = {"auto": al.auto_plan(spec, TWO_H100, precision="bf16"), "auto(table)": auto,
             "megatron": al.megatron_plan(spec, TWO_H100, dp=1, tp=2, pp=1, precision="bf16"),
             "data": al.data_parallel_plan(table=table, precision="bf16"),
             **{k: v for k, v in al.compare(table=table, precision="bf16").items() if k in ("auto", "data_parallel")}}
    for what, plan in plans.items():
        assert plan.precision.name == "bf16", what
        assert "number format bf16" in plan.cost.explain() and "priced, not executed" in plan.cost.explain(), what
        assert plan.report()["precision"] == "bf16"
    assert plans["auto"].cost == auto.cost  # the same format, traced and retyped again: the same plan


def test_overrides_resolve_and_what_ifs_keep_the_format(bf16):
    spec, table, plan = bf16
    dot = next(o for o in plan.op_graph.ops if plan.op_graph.op(o).primitive == "dot_general"
               and len(plan.alternatives(o)) > 1)
    other = next(a.strategy for a in plan.alternatives(dot) if a.strategy != plan.choice(dot).name)
    changed = plan.with_choice(dot, other)
    for what, p in (("with_choice", changed), ("resolve", al.resolve(changed)),
                    ("with_remat", plan.with_remat(0, True)), ("with_microbatches", plan.with_microbatches(2))):
        assert p.precision.name == "bf16", what
    # a what-if on the cluster keeps the table's format (CostTable.for_cluster, as Session.set_cluster does)
    wider = Cluster.preset("dgx-h100").with_(devices_per_host=4)
    assert al.auto_plan(table=table.for_cluster(wider)).precision.name == "bf16"
    assert al.Session(changed, model=spec).set_cluster(wider).precision.name == "bf16"
    with pytest.raises(ValueError, match="no FP8 matmul rate"):  # an FP8 table moved to a device without FP8
        CostTable.build(spec, TWO_H100, precision="fp8").for_cluster(Cluster.preset("dgx-a100"))


def test_plan_files_views_and_export_say_the_format(bf16, tmp_path):
    spec, _table, plan = bf16
    path = tmp_path / "plan.json"
    al.save_plan(plan, path)
    assert json.loads(path.read_text())["precision"] == "bf16"
    back = al.load_plan(path, spec)  # the graph is retyped before its fingerprint is checked
    assert back.precision.name == "bf16" and back.cost.step_time_s == plan.cost.step_time_s
    # a format with a field changed (FP8 GEMMs that read either layout: no transposed copies) is saved by its fields
    fp8 = as_precision("fp8").with_(transposed=False)
    one = al.data_parallel_plan(spec, TWO_H100, precision=fp8)
    al.save_plan(one, path)
    assert json.loads(path.read_text())["precision"]["transposed"] is False
    again = al.load_plan(path, spec)
    assert again.precision == fp8 and again.cost.step_time_s == one.cost.step_time_s
    assert memory_breakdown(again)[0]["fp8_copies_bytes"] * 2 == memory_breakdown(
        al.data_parallel_plan(spec, TWO_H100, precision="fp8"))[0]["fp8_copies_bytes"]
    from autopar_lab.widgets.views.header import plan_text

    assert plan_text(plan).endswith(", bf16")
    assert "# Number format: bf16 (bf16 compute, fp32 gradients" in plan.to_jax_code()


def test_default_is_the_models_own_format_and_old_files_load(tmp_path):
    spec = small_gpt(dtype="float16")
    plan = al.data_parallel_plan(spec, TWO_H100)
    assert plan.precision.name == "fp16" and plan.graph.precision is None  # as traced, nothing retyped
    assert al.data_parallel_plan(spec, TWO_H100, precision="fp16").cost == plan.cost
    path = tmp_path / "old.json"
    al.save_plan(plan, path)
    data = json.loads(path.read_text())
    del data["precision"]  # a file written before number formats
    path.write_text(json.dumps(data))
    assert al.load_plan(path, spec).cost.step_time_s == plan.cost.step_time_s


def test_formats_retype_the_graph_and_back():
    g = small_gpt(dtype="float16").trace()
    retyped = {name: retype(g, name) for name in NAMES}
    assert retyped["fp16"] is g and precision_of(g).name == "fp16"
    assert len({h.fingerprint for h in retyped.values()}) == len(NAMES)  # tables and caches never mix formats
    for name, h in retyped.items():
        assert precision_of(h).name == name and [n.primitive for n in h] == [n.primitive for n in g]
        assert retype(h, "fp16").fingerprint == g.fingerprint
    bf16 = retyped["bf16"]
    wgrads = [n for n in bf16 if n.primitive == "dot_general" and n.role != FORWARD and n.out_dtypes[0] == "float32"]
    assert wgrads and all(n.in_dtypes == ("bfloat16", "bfloat16") for n in wgrads)  # bf16 in, fp32 accumulated out
    assert all(d != "float16" for n in bf16 if n.primitive != "parameter" for d in n.out_dtypes)


def test_bad_formats_are_one_sentence():
    spec = small_gpt()
    with pytest.raises(ValueError, match=r"unknown precision 'fp9'; use one of fp32, fp16, bf16, fp8, fp8-block\.$"):
        al.auto_plan(spec, TWO_H100, precision="fp9")
    with pytest.raises(ValueError, match="no FP8 matmul rate"):
        al.data_parallel_plan(spec, Cluster.preset("p3.16xlarge").with_(devices_per_host=2), precision="fp8")
    table = CostTable.build(spec, TWO_H100, precision="bf16")
    with pytest.raises(ValueError, match="prices precision 'bf16', not 'fp8'"):
        al.auto_plan(table=table, precision="fp8")
    with pytest.raises(ValueError, match="master weights"):  # gpt-tiny computes in float32, without them
        al.data_parallel_plan(al.models.get("gpt-tiny"), TWO_H100, precision="bf16")
    assert as_precision(" BF16 ") is as_precision("bf16")


@pytest.mark.slow
def test_the_runtime_runs_the_models_own_step():
    """A format is priced, not executed: al.execute runs the model's own step (bf16 with bf16 gradients, as traced)
    for a bf16 or an FP8 plan, with the losses of the plan in the model's own format."""
    spec = al.models.get("gpt-tiny", dtype="bfloat16", batch_size=8)
    own = al.data_parallel_plan(spec, TWO_H100)
    assert own.precision.name == "traced" and "priced, not executed" not in own.cost.explain()
    losses = al.execute(own, spec).train(2)
    for name in ("bf16", "fp8"):
        plan = al.data_parallel_plan(spec, TWO_H100, precision=name)
        assert "priced, not executed" in plan.cost.explain()
        assert al.execute(plan, spec).train(2) == losses, name


def _cli(*args, cwd="/tmp"):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "autopar_lab", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def _one_sentence(proc, *needles):
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(n in lines[0] for n in needles), lines[0]


def test_cli_rejects_an_unknown_format_in_one_sentence():
    _one_sentence(_cli("plan", "gpt-1.3b", "--cluster", "dgx-h100:2", "--precision", "fp9"), "fp9", "fp8-block")


@pytest.mark.slow
def test_cli_plans_gpt_1_3b_in_bf16_from_another_directory():
    _one_sentence(_cli("compare", "gpt-1.3b", "--cluster", "dgx-h100:2", "--precision", "fp9"), "fp9", "fp8-block")
    _one_sentence(_cli("plan", "gpt-1.3b", "--cluster", "p3.16xlarge:1", "--precision", "fp8"), "no FP8")
    proc = _cli("plan", "gpt-1.3b", "--cluster", "dgx-h100:2", "--precision", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert "number format: bf16 (bf16 compute, fp32 gradients" in proc.stdout
    assert "params " in proc.stdout and "grads " in proc.stdout and "master " in proc.stdout
    proc = _cli("plan", "gpt-1.3b", "--cluster", "dgx-h100:1", "--layers", "2", "--batch", "8", "--precision", "fp8",
                "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["precision"] == "fp8" and out["memory"][0]["fp8_copies_bytes"] > 0


def test_a_router_stays_in_the_compute_format_under_fp8():
    """DeepSeek-V3 (technical report 3.3.1) keeps its gating in BF16: the router's GEMM, whose scores pick the
    experts, is not an FP8 GEMM; the experts' and the attention projections' are."""
    from autopar_lab.graph.modules import module_labels
    from autopar_lab.precision import FP8_DTYPE, retype, router_gemms

    g = al.models.get("deepseek-tiny", dtype="bfloat16", num_layers=4, hidden_size=64, moe_ffn_hidden=32,
                      ffn_hidden=64, seq_len=32, expert_group_size=32).trace()
    labels = module_labels(g)
    routers = router_gemms(g)
    assert routers and {labels[op].label for op in routers} == {"moe/router"}
    fp8 = retype(g, "fp8")
    forward = [n for n in fp8 if n.role == "forward" and n.primitive == "dot_general"]
    by_label = {labels[n.id].label: n.in_dtypes for n in forward if n.layer == "layer_2"}
    assert FP8_DTYPE not in by_label["moe/router"]
    assert set(by_label["moe/experts/up"]) == {FP8_DTYPE} and set(by_label["attn/q_up"]) == {FP8_DTYPE}


@pytest.mark.slow
def test_llama3_8b_on_one_h100_in_bf16_is_18_bytes_a_parameter():
    """Issue 30's check at the size users plan: Llama 3 8B (32 layers, planned on its 4-layer copy) on one H100 in
    bf16 holds 2 + 4 + 4 + 4 + 4 bytes a parameter (bf16 weights, fp32 gradients, fp32 master, two fp32 moments), to
    the byte: 144.5 GB, which does not fit 80 GB, and the plan says so; FP8 adds its weight copies (the 32 layers'
    linear weights, the embedding and head staying bf16) as a part of their own."""
    llama = al.models.get("llama3-8b", batch_size=1, seq_len=1024)
    P, c = llama.param_count, llama.config
    assert P == 8_030_261_248
    plans = {name: al.data_parallel_plan(llama, ONE_H100, precision=name) for name in ("bf16", "fp8")}
    row = memory_breakdown(plans["bf16"])[0]
    assert (row["params_bytes"], row["grads_bytes"], row["master_bytes"]) == (2 * P, 4 * P, 4 * P)
    assert row["optimizer_bytes"] == 8 * P + ADAM_COUNT
    assert not plans["bf16"].cost.fits
    kv = c.num_kv_heads * c.hidden_size // c.num_heads
    linear = c.num_layers * (c.hidden_size * (2 * c.hidden_size + 2 * kv) + 3 * c.hidden_size * c.ffn_hidden)
    fp8 = memory_breakdown(plans["fp8"])[0]
    assert fp8["fp8_copies_bytes"] == 2 * linear                  # an FP8 copy and its transpose of each
    assert {k: fp8[k] for k in ("params_bytes", "grads_bytes", "master_bytes")} == \
        {k: row[k] for k in ("params_bytes", "grads_bytes", "master_bytes")}
