"""Selective recomputation (Korthikanti et al. 2022): priced from the graph against the paper's formula, searched by the
DP (brute force agrees), shown and overridden, executed (losses equal to one device) and exported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.graph.fusion import kernel_view
from autopar_lab.graph.attention import alternate_matmuls, attention_internals, dots_recomputed, output_matmuls
from autopar_lab.pricing.memory import memory_breakdown
from autopar_lab.pricing.stage import SUM_FIELDS, partial_keys, stage_cost
from autopar_lab.pricing.table import CostTable
from autopar_lab.rematmode import REMAT_CHOICES, remat_value
from autopar_lab.solve.exhaustive import OptimumSearch, global_optimum

ONE = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=1)
FAST = {"xla_backend_optimization_level": 0}


def _gpt(s, **kw):
    cfg = dict(seq_len=s, hidden_size=64, num_heads=4, num_layers=2, batch_size=2, dtype="float16", vocab_size=64)
    return al.models.get("gpt-tiny", **{**cfg, **kw})


@pytest.fixture(scope="module")
def block_costs():
    """A transformer block's LayerCost on one device at s = 64 and 128 (b = 2, h = 64, a = 4, fp16)."""
    return {s: CostTable.build(_gpt(s), ONE).mesh_costs((1, 1), (1, 1))[0][1] for s in (64, 128)}


def test_internals_grow_with_s_squared_per_head_as_the_paper_says(block_costs):
    """Per layer per microbatch the paper has s*b*h*(34 + 5*a*s/h) activation bytes, 34*s*b*h with selective: the rest
    is linear in s, the internals quadratic (5*a*s^2*b). Our bytes come from the graph: the zoo GPT has no dropout (the
    paper's mask and dropout output, 3 of its 5 bytes per score) but keeps the softmax in fp32 and its fp16 cast (6
    bytes per score), and keeps its layer norms' fp32 statistics (44 bytes of sbh, not 34)."""
    b, h, a = 2, 64, 4
    rest = {s: c.act_bytes - c.attn_act_bytes for s, c in block_costs.items()}
    attn = {s: c.attn_act_bytes for s, c in block_costs.items()}
    assert rest[128] == 2 * rest[64]  # linear in s
    assert 3.9 < attn[128] / attn[64] <= 4.0  # quadratic in s (a row statistic per head adds a linear term)
    per_score = attn[128] / (a * 128 ** 2 * b)
    per_sbh = rest[128] / (128 * b * h)
    assert 5 <= per_score <= 7 and 30 <= per_sbh <= 50
    # The share selective recomputation keeps, against the paper's 34 / (34 + 5 a s / h), at both lengths.
    for s, c in block_costs.items():
        paper = 34 / (34 + 5 * a * s / h)
        ours = rest[s] / c.act_bytes
        assert ours == pytest.approx(paper, rel=0.15)
    # The recomputed forward is the scores' matmul and the softmax: some, not all, of the layer's forward.
    for c in block_costs.values():
        assert 0 < c.attn_fwd_s < c.fwd_s


def test_stage_cost_prices_selective_between_none_and_full(block_costs):
    c = block_costs[128]
    totals = {f: 2 * getattr(c, f) for f in SUM_FIELDS}  # a two-block stage
    none, full, sel = (stage_cost(totals, 0.0, 2, 1, r, 0.0) for r in (False, True, "selective"))
    assert sel[3] == pytest.approx((totals["act_bytes"] - totals["attn_act_bytes"]) / 2)  # internals not held
    assert sel[1] == pytest.approx(none[1] + totals["attn_fwd_s"] / 2 + totals["attn_launch_s"])
    assert full[3] < sel[3] < none[3]  # memory: full holds least
    assert none[1] < sel[1] < full[1]  # time: full recomputes most
    assert sel[0] == none[0]


def test_internals_of_a_model_without_attention_are_empty():
    def step(w, x):
        return jax.grad(lambda w: jax.numpy.sum(jax.nn.softmax(x @ w) ** 2))(w)

    g = al.trace(step, np.ones((8, 8), np.float32), np.ones((4, 8), np.float32))
    assert attention_internals(g) == frozenset()  # a softmax, but no batched matmuls around it


def test_brute_force_agrees_with_the_dp_and_uses_selective():
    """On a small long-sequence instance under a memory limit, the exhaustive optimum (every remat choice per stage)
    is no better than the auto plan's pricing says it could be, and a plain enumeration with none/full only is
    beaten (or matched) once selective is in the space."""
    model = _gpt(128, num_heads=8, batch_size=4)
    cluster = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=2)
    table = CostTable.build(model, cluster)
    free = al.auto_plan(table.graph, cluster, table=table)
    mem = 0.7 * max(free.cost.peak_mem_bytes)
    three = global_optimum(model, cluster, mem_limit_bytes=mem, table=table)
    two = global_optimum(model, cluster, mem_limit_bytes=mem, table=table, remat=(False, True),
                         search=OptimumSearch(seed=False))
    assert three["gap"] >= 0 and three["optimum_step_s"] <= two["optimum_step_s"]
    assert three["plans_total"] > two["plans_total"]
    used = {remat_value(st.remat) for st in three["optimum"].stages} | {st.remat for st in three["auto"].stages}
    assert "selective" in used


def test_plan_shows_saves_and_loads_selective(tmp_path, plan):
    q = plan.with_remat(0, "selective")
    assert q.stages[0].remat == "selective" and q.stage_pins["remat"] == ("selective", None)
    assert q.stages[0].act_bytes < plan.stages[0].act_bytes  # the internals are no longer held
    assert q.stages[0].bwd_s > plan.stages[0].bwd_s  # and recomputed
    d = json.loads(json.dumps(q.report()))  # `autopar-lab plan --json`
    assert d["stages"][0]["remat"] == "selective" and d["stages"][1]["remat"] is False
    path = tmp_path / "p.json"
    al.save_plan(q, path)
    data = json.loads(path.read_text())
    assert data["stages"][0]["remat"] == "selective" and data["stage_pins"]["remat"] == ["selective", None]
    back = al.load_plan(path, plan.table.graph)
    assert back.stages[0].remat == "selective" and back.cost.step_time_s == pytest.approx(q.cost.step_time_s)
    # a plan file written before selective recomputation (booleans) still loads, as full/none
    old = plan.with_remat(1, True)
    al.save_plan(old, path)
    assert json.loads(path.read_text())["stages"][1]["remat"] is True
    assert al.load_plan(path, plan.table.graph).stages[1].remat is True
    # True/False keep meaning full/none; anything else is one clear error
    assert plan.with_remat(0, "full").stages[0].remat is True and plan.with_remat(0, "none").stages[0].remat is False
    with pytest.raises(ValueError, match="'selective'"):
        plan.with_remat(0, "partial")
    # the memory breakdown names it
    from autopar_lab.pricing.memory import memory_breakdown
    row = memory_breakdown(q)[0]
    assert row["remat"] and row["remat_mode"] == "selective" and row["remat_saved_bytes"] > 0


def test_megatron_selective_and_its_name(graph, cluster):
    p = al.megatron_plan(graph, cluster, dp=1, tp=2, pp=2, microbatches=2, remat="selective")
    assert [st.remat for st in p.stages] == ["selective", "selective"] and ",selective" in p.method
    plain = al.megatron_plan(graph, cluster, dp=1, tp=2, pp=2, microbatches=2, remat=False, table=p.table)
    full = al.megatron_plan(graph, cluster, dp=1, tp=2, pp=2, microbatches=2, remat=True, table=p.table)
    assert [st.remat for st in full.stages] == [True, True] and ",remat" in full.method
    assert full.stages[0].act_bytes < p.stages[0].act_bytes < plain.stages[0].act_bytes


def test_session_sets_selective_from_a_thread(graph, cluster):
    import threading

    from autopar_lab.widgets.session import Session

    session = Session(al.megatron_plan(graph, cluster, dp=1, tp=2, pp=2, microbatches=2))
    out = {}
    t = threading.Thread(target=lambda: out.update(p=session.set_remat(1, "selective")))
    t.start()
    t.join(120)
    assert out["p"].stages[1].remat == "selective" and session.plan.stages[1].remat == "selective"
    session.undo()
    assert session.plan.stages[1].remat is False


def test_export_checkpoints_with_the_selective_policy(plan):
    q = plan.with_remat(0, "selective")
    code = q.to_jax_code(0)
    assert "remat = 'selective'" in code and "jax.checkpoint(fn, policy=_selective_policy)" in code
    assert "remat = 'none'" in plan.to_jax_code(0) and "remat = 'full'" in plan.with_remat(0, True).to_jax_code(0)
    ns: dict = {}
    exec(compile(code, "<plan>", "exec"), ns)  # noqa: S102 - the code the user pastes
    model = al.models.get("gpt-tiny", batch_size=8, dtype="float32")
    params, _opt, batch = model.init(0)
    loss = model.loss_fn
    g0 = jax.grad(loss)(params, batch)
    g1 = jax.grad(ns["checkpointed"](loss))(params, batch)
    for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    # the policy recomputes the scores: the checkpointed jaxpr saves fewer residuals than the plain one
    jaxpr = str(jax.make_jaxpr(jax.grad(ns["checkpointed"](loss)))(params, batch))
    assert "checkpoint" in jaxpr or "remat" in jaxpr


@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
@pytest.mark.parametrize("mode", ["selective", "dots", "selective-op"])
def test_selective_stage_trains_like_one_device(model, reference, mode):
    """gpt-tiny as a 2-stage pipeline on 8 CPU devices, stage 0 selective (or "dots", "selective-op"): the same losses
    as one device, and the stage's backward recomputes only attention internals (the blocks' operators but their
    matmuls; and every other matmul of a block); its forward keeps the rest."""
    from autopar_lab.runtime.partition import split_stages

    cpu = al.Cluster.preset("cpu", hosts=1)
    base = al.megatron_plan(model, cpu, dp=2, tp=2, pp=2, microbatches=2)
    plan = base.with_remat(0, mode)
    sm = split_stages(model, plan, compiler_options=FAST)
    sm0 = split_stages(model, base, compiler_options=FAST)
    # Every backward also redoes the work a fused step recomputes inside its kernels (elementwise, broadcasts:
    # kernel_view's inline and free operators), as the runtime does for any stage since the stash holds only what a
    # kernel writes; beyond that, stage 0 recomputes its mode's operators and stage 1 nothing.
    roles = kernel_view(plan.graph).roles
    cheap = {i for i, r in roles.items() if r.kind in ("inline", "free")}
    again = set(sm.task_ops(0, "fwd")) & set(sm.task_ops(0, "bwd"))
    internals = attention_internals(plan.graph) if mode == "selective" else dots_recomputed(plan.graph)
    if mode == "selective-op":
        internals = internals | alternate_matmuls(plan.graph)
        assert again & alternate_matmuls(plan.graph)  # a matmul runs again (the attention projection, fc2)
    assert again - cheap and again <= internals | cheap
    assert set(sm.task_ops(1, "fwd")) & set(sm.task_ops(1, "bwd")) <= cheap  # stage 1 keeps what kernels write
    mb = sm.split_batch(model.init(0)[2])[0]
    kept = sm.run_task(0, "fwd", sm.init_state(0, 0), {}, mb).stash
    kept0 = sm0.run_task(0, "fwd", sm0.init_state(0, 0), {}, mb).stash
    size = lambda d: sum(np.asarray(v).nbytes for v in d.values())  # noqa: E731
    assert 0 < size(kept) < size(kept0)
    runner = al.execute(plan, model, compiler_options=FAST)
    np.testing.assert_allclose(runner.train(3), reference[0], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # a 24-layer trace and the stage DP over it: ~35 s
def test_deep_long_sequence_model_plans_selective_under_a_memory_limit():
    model = al.models.get("gpt-tiny", seq_len=256, hidden_size=64, num_heads=8, num_layers=24, batch_size=8,
                          dtype="float16", vocab_size=64)
    cluster = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=4)
    free = al.auto_plan(model, cluster)
    tight = al.auto_plan(model, cluster, mem_limit_bytes=0.5 * max(free.cost.peak_mem_bytes), table=free.table)
    assert "selective" in [st.remat for st in tight.stages]
    assert all(m <= 0.5 * max(free.cost.peak_mem_bytes) for m in tight.cost.peak_mem_bytes)
    # the same plan with every selective stage switched to full is slower (selective paid)
    k = [st.remat for st in tight.stages].index("selective")
    assert tight.with_remat(k, True).cost.step_time_s > tight.cost.step_time_s


@pytest.mark.slow  # a subprocess that traces and plans
def test_cli_shows_selective_remat(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
           "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "autopar_lab.cli", "plan", "gpt-tiny", "--cluster",
                        "p3.16xlarge:1", "--method", "megatron", "--dp", "2", "--tp", "2", "--pp", "2",
                        "--selective-remat", "--microbatches", "2"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("selective remat") == 2 and "megatron(dp=2,tp=2,pp=2,selective)" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "autopar_lab.cli", "plan", "gpt-tiny", "--cluster",
                          "p3.16xlarge:1", "--method", "megatron", "--dp", "2", "--tp", "2", "--pp", "2",
                          "--remat", "--selective-remat"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert bad.returncode == 2 and "exclude each other" in bad.stderr and "Traceback" not in bad.stderr


def test_remat_choices_are_the_three():
    assert REMAT_CHOICES == (False, True, "selective")


def test_resolve_keeps_a_selective_pin(plan):
    """A re-solve around the pins keeps a stage pinned to selective (the DP's candidates offer it) and may choose it
    freely elsewhere."""
    q = plan.with_remat(0, "selective")
    r = al.resolve(q)
    assert r.stages[0].remat == "selective" and r.stage_pins["remat"][0] == "selective"


# --- "dots": keep the matmuls' outputs, recompute the rest (MaxText's minimal, torchtitan's op-level SAC) ----------


def test_dots_keeps_every_matmul_output_of_a_block_and_nothing_else():
    """With flash attention a Llama block under "dots" keeps, a token: q (4 heads of 16), k and v (2 KV heads), the
    attention's output, the output projection, the gate and up projections (FFN 128) and the down projection, in
    bf16; it drops the rest (norms, SwiGLU's activation, rotary embeddings) and recomputes their forward."""
    h100 = al.Cluster.preset("dgx-h100").with_(devices_per_host=1)
    model = al.models.get("llama3-tiny", seq_len=64, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden=128,
                          num_layers=2, batch_size=2, vocab_size=64, dtype="bfloat16")
    costs, _ = CostTable.build(model, h100).mesh_costs((1, 1), (1, 1))
    block = costs[1]
    tokens, hd = 2 * 64, 16
    kept = tokens * 2 * (4 * hd + 2 * hd + 2 * hd + 4 * hd + 64 + 128 + 128 + 64)
    assert block.act_bytes - block.dots_act_bytes == kept
    assert block.attn_act_bytes == 0  # flash attention keeps no scores: Megatron's selective saves nothing here
    assert costs[0].dots_act_bytes == 0 and block.dots_fwd_s > 0  # the embedding is no block
    totals = {f: getattr(block, f) for f in SUM_FIELDS}
    none, dots = stage_cost(totals, 0.0, 1, 1, False, 0.0), stage_cost(totals, 0.0, 1, 1, "dots", 0.0)
    assert dots[3] == kept and dots[1] == pytest.approx(none[1] + block.dots_fwd_s + block.dots_launch_s, rel=1e-12)


def test_maxtexts_minimal_is_dots_and_torchtitans_selective_is_its_op_policy():
    model = al.models.get("llama3-tiny", num_layers=2, batch_size=8, dtype="bfloat16")
    h100 = al.Cluster.preset("dgx-h100")
    plan = al.fsdp_plan(model, h100, local_batch_size=1, remat="selective", precision="bf16")
    assert [st.remat for st in plan.stages] == ["selective-op"] and plan.method.endswith(",selective-op)")
    dots = al.fsdp_plan(table=plan.table, local_batch_size=1, remat="dots")  # still there by name
    assert [st.remat for st in dots.stages] == ["dots"] and dots.method.endswith(",dots)")
    assert remat_value("dots") == "dots" and dots.to_jax_code(0).count("dots_saveable") == 1
    assert remat_value("Selective-Op") == "selective-op"
    mt = al.maxtext_plan(table=plan.table, per_device_batch_size=1, remat="minimal")
    assert [st.remat for st in mt.stages] == ["dots"]


# --- "selective-op": torchtitan's op-level SAC as written: "dots" less every other matmul's output -----------------

_LLAMA = dict(seq_len=64, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden=128, batch_size=2, vocab_size=64,
              dtype="bfloat16")


def _recomputed_mm_flops(tokens: int, h: int, heads: int, kv: int, hd: int, ffn: int) -> int:
    """The formula: torchtitan's policy counts a Llama block's mms (wq, wk, wv, wo, w1, w3, w2) and recomputes the
    2nd, 4th and 6th: wk [h, kv hd], wo [heads hd, h], w3 [h, ffn], 2 FLOPs a multiply-add."""
    return 2 * tokens * (h * kv * hd + heads * hd * h + h * ffn)


def test_selective_op_recomputes_k_o_and_up_of_a_small_block_as_the_formula_says():
    """On a 2-block Llama: the recomputed matmuls are k, o and up in each block (not the embedding's or the head's);
    their FLOPs are the formula's; a block drops their outputs beyond what "dots" drops (2 hd + h + ffn values a token
    in bf16) and its backward runs their forward again (their priced forward time, and their kernels' launches)."""
    h100 = al.Cluster.preset("dgx-h100").with_(devices_per_host=1)
    model = al.models.get("llama3-tiny", num_layers=2, **_LLAMA)
    g = model.trace()
    again = alternate_matmuls(g)
    assert sorted((g.op(o).layer, g.op(o).scope.rsplit("/", 1)[-1]) for o in again) == \
        [(f"layer_{k}", s) for k in (0, 1) for s in ("k_proj", "o_proj", "up")]
    tokens, hd = 2 * 64, 16
    for k in (0, 1):
        flops = sum(g.op(o).flops for o in again if g.op(o).layer == f"layer_{k}")
        assert flops == _recomputed_mm_flops(tokens, 64, 4, 2, hd, 128)
    costs, _ = CostTable.build(model, h100).mesh_costs((1, 1), (1, 1))
    block = costs[1]
    assert block.op_act_bytes == tokens * 2 * (2 * hd + 64 + 128)
    assert costs[0].op_act_bytes == costs[0].op_fwd_s == 0  # the embedding is no block
    assert block.op_fwd_s > 0 and block.op_launch_s == 3 * h100.device.efficiency.kernel_launch_s
    totals = {f: getattr(block, f) for f in SUM_FIELDS}
    dots, op = stage_cost(totals, 0.0, 1, 1, "dots", 0.0), stage_cost(totals, 0.0, 1, 1, "selective-op", 0.0)
    assert op[3] == dots[3] - block.op_act_bytes  # kept: q, v, the attention's output, gate and down
    assert op[3] == tokens * 2 * (4 * hd + 2 * hd + 4 * hd + 128 + 64)
    assert op[1] == pytest.approx(dots[1] + block.op_fwd_s + block.op_launch_s, rel=1e-12)
    assert op[2] == pytest.approx(dots[2] + block.op_act_bytes, rel=1e-12)  # one layer's recomputed working set
    assert partial_keys("selective-op") == ("dots", "op") and partial_keys(False) == partial_keys(True) == ()


def test_selective_op_counts_matmuls_per_block_on_a_deep_model():
    """Llama 3 8B's shape (32 blocks): every block recomputes its own 2nd, 4th and 6th matmul (the policy's counter
    starts again in each checkpointed block; a counter over the whole step would, with 7 mms a block, flip the parity
    every other block), 36.5% of a block's matmul FLOPs, and drops wk's, wo's and w3's outputs."""
    h100 = al.Cluster.preset("dgx-h100").with_(devices_per_host=1)
    model = al.models.get("llama3-8b", seq_len=256, batch_size=1, vocab_size=1024)
    table = CostTable.build(model, h100, precision="bf16")
    costs, _ = table.mesh_costs((1, 1), (1, 1))
    blocks = costs[1:-1]
    assert len(blocks) == 32 and costs[0].op_act_bytes == costs[-1].op_act_bytes == 0
    h, ffn, kv_width = 4096, 14336, 8 * 128
    assert all(c.op_act_bytes == 256 * 2 * (kv_width + h + ffn) for c in blocks)
    g = table.graph
    again = alternate_matmuls(g)
    per_layer: dict = {}
    for o in again:
        per_layer.setdefault(g.op(o).layer, []).append(g.op(o))
    assert len(per_layer) == 32 and all(len(v) == 3 for v in per_layer.values())
    for ops in per_layer.values():
        assert sum(n.flops for n in ops) == _recomputed_mm_flops(256, h, 32, 8, 128, ffn)
    whole = 2 * 256 * (h * (h + 2 * kv_width + h) + 3 * h * ffn)
    assert _recomputed_mm_flops(256, h, 32, 8, 128, ffn) / whole == pytest.approx(0.3654, abs=1e-4)
    # priced: the stage's backward runs those matmuls again, in the recomputation's seconds
    none = al.fsdp_plan(table=table, local_batch_size=1)
    dots = al.fsdp_plan(table=table, local_batch_size=1, remat="dots")
    op = al.fsdp_plan(table=table, local_batch_size=1, remat="selective")
    extra = sum(c.op_fwd_s + c.op_launch_s for c in costs)
    assert op.stages[0].bwd_s == pytest.approx(dots.stages[0].bwd_s + extra, rel=1e-9)
    assert none.stages[0].act_bytes > dots.stages[0].act_bytes > op.stages[0].act_bytes
    assert dots.stages[0].act_bytes - op.stages[0].act_bytes == pytest.approx(32 * blocks[0].op_act_bytes, rel=1e-9)
    assert memory_breakdown(op)[0]["remat_mode"] == "selective-op"


def test_eager_sac_also_keeps_the_blocks_output_projection_a_compiled_block_does_not():
    """torchtitan's op-level SAC under eager PyTorch caches every saved mm's output, the down projection's (w2: the
    block's last mm, its output read by no backward operator, only by the residual add that writes the block's
    output) too; a compiled block keeps what its backward reads. On a small Llama the eager block drops h values a
    token less (bf16); "dots" and the compiled plan keep what they kept."""
    model = al.models.get("llama3-tiny", num_layers=2, **_LLAMA)
    g = model.trace()
    assert sorted((g.op(o).layer, g.op(o).scope.rsplit("/", 1)[-1]) for o in output_matmuls(g)) == \
        [("layer_0", "down"), ("layer_1", "down")]
    h100 = al.Cluster.preset("dgx-h100").with_(devices_per_host=1)
    eager = al.fsdp_plan(model, h100, remat="selective", compile=False)
    compiled = al.fsdp_plan(model, h100, remat="selective", compile=True)
    assert eager.stage_pins.get("host") == "eager" and "host" not in (compiled.stage_pins or {})
    tokens, hd = 2 * 64, 16
    e, c = eager.stages[0].layer_costs[1], compiled.stages[0].layer_costs[1]
    assert c.op_act_bytes == tokens * 2 * (2 * hd + 64 + 128)  # k, o and up: as before
    assert e.op_act_bytes == c.op_act_bytes - tokens * 2 * 64  # less the down projection's output, now kept
    assert e.dots_act_bytes == c.dots_act_bytes and e.act_bytes == c.act_bytes
    assert eager.stages[0].act_bytes - compiled.stages[0].act_bytes == 2 * tokens * 2 * 64  # two blocks


def test_torchtitan_8b_eager_keeps_4_gib_of_w2_outputs_more_than_compiled():
    """torchtitan-8b-8 (bench/bench_fidelity.py): Llama 3.1 8B, FSDP over 8 H100s, 2 x 8,192 tokens a device, op-level
    SAC. The eager plan keeps, beyond the compiled one, w2's output of each of the 32 blocks, 2 bytes x 16,384 tokens x
    4,096: 4.0 GiB, and its allocated peak (at the float32 loss's backward) is that much higher."""
    model = al.models.get("llama3-8b", seq_len=8192, batch_size=16)
    cluster = al.Cluster.preset("grand-teton-h100", 1)
    kw = dict(local_batch_size=2, remat="selective", precision="bf16", eager_loss="torchtitan")
    eager = al.fsdp_plan(model, cluster, compile=False, **kw)
    compiled = al.fsdp_plan(model, cluster, compile=True, **kw)
    w2 = 2 * 16_384 * 4_096 * 32
    assert w2 == 4 * 2**30
    assert eager.stages[0].act_bytes - compiled.stages[0].act_bytes == w2
    assert eager.stages[0].peak_mem_bytes - compiled.stages[0].peak_mem_bytes == pytest.approx(w2, rel=1e-9)
