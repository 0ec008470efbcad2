"""The loss an eager PyTorch framework computes after its model (``fsdp_plan(eager_loss=...)``,
:mod:`autopar_lab.pricing.eagerloss`): its logits-sized tensors at the loss's backward, on the stage computing it."""

from __future__ import annotations

import pytest

import autopar_lab as al
from autopar_lab.memory import memory_breakdown
from autopar_lab.planfile import load_plan, save_plan
from autopar_lab.pricing.eagerloss import LOSSES, eager_loss_bytes, logits_elements, loss_extra_bytes
from autopar_lab.pricing.memory import PARTS, absent_at_loss


@pytest.fixture(scope="module")
def tiny():
    return al.models.get("llama3-tiny", batch_size=8)


def test_the_head_writes_batch_x_sequence_x_vocabulary_logits(tiny):
    g = tiny.trace()
    assert logits_elements(g, list(g.layers)[-1]) == 8 * 16 * 64


def test_each_framework_counts_its_tensors_and_bytes():
    # KempnerForge: logits, log-probabilities and both gradients in bf16, whole on every tensor-parallel rank
    assert eager_loss_bytes("kempnerforge", 1000, 2, 4) == 4 * 2 * 1000 / 2
    # torchtitan: float32 log-probabilities and both float32 gradients, vocabulary-parallel
    assert eager_loss_bytes("torchtitan", 1000, 2, 4) == 3 * 4 * 1000 / 2 / 4
    assert set(LOSSES) == {"kempnerforge", "torchtitan"}
    with pytest.raises(ValueError, match="eager_loss must be None or one of 'kempnerforge', 'torchtitan'"):
        eager_loss_bytes("megatron", 1000, 1, 1)


def test_a_stage_without_the_loss_holds_nothing_more(tiny):
    cluster = al.Cluster.preset("dgx-h100", 1).with_(devices_per_host=4)
    plan = al.fsdp_plan(tiny, cluster, dp_shard=2, pp=2, microbatches=2, eager_loss="kempnerforge")
    base = al.fsdp_plan(tiny, cluster, dp_shard=2, pp=2, microbatches=2)
    st = plan.stages[0]
    assert st.static_bytes == base.stages[0].static_bytes  # the first stage computes no loss
    last = len(plan.table.layer_names) - 1
    assert loss_extra_bytes(st.layer_costs, st.layers, 2, st.remat, 1e12, last) == 0.0
    assert loss_extra_bytes(st.layer_costs, st.layers, 2, st.remat, 0.0, st.layers[1]) == 0.0
    # the last stage's: a loss this small is within its average layer's working set, then one larger is not
    end = plan.stages[1]
    assert loss_extra_bytes(end.layer_costs, end.layers, 2, end.remat, 1.0, last) == 0.0
    assert loss_extra_bytes(end.layer_costs, end.layers, 2, end.remat, 1e12, last) > 0.0


def test_kempnerforge_tp4_holds_four_bf16_logits_of_16k_tokens_at_the_loss():
    """The bench's kf-tp-4 row (bench_fidelity.TODAY) through the public API: Llama 3 8B, TP 4 with the logits
    gathered whole, 4 x 4,096 tokens a microbatch: 4 tensors of 16,384 x 128,256 bf16 (15.66 GiB) at the loss's
    backward, beyond the stage's checkpoints and state, in place of its average layer's working set."""
    model = al.models.get("llama3-8b", seq_len=4096, batch_size=8, mixed_precision=False)
    cluster = al.Cluster.preset("dgx-h200", 1).with_(devices_per_host=4, mesh_peers=3)
    kw = dict(dp_shard=1, tp=4, local_batch_size=4, remat=True, compile=True, accumulate_unsharded=True)
    plan = al.fsdp_plan(model, cluster, eager_loss="kempnerforge", **kw)
    base = al.fsdp_plan(model, cluster, table=plan.table, **kw)
    assert plan.microbatches == 2
    loss = 4 * 2 * 16384 * 128256
    assert loss == 16_810_770_432  # 15.66 GiB
    assert plan.stage_pins["eager_loss"] == 2 * loss  # a step: two microbatches
    row = memory_breakdown(base)[0]
    head = base.stages[0].layer_costs[-1]
    working = row["buffers_bytes"] + row["recompute_bytes"]  # the average layer's, which the loss's replaces
    expect = loss - head.ckpt_bytes / 2 - working  # the head's input a microbatch is a checkpoint already
    assert plan.stages[0].peak_mem_bytes - base.stages[0].peak_mem_bytes == pytest.approx(expect, rel=1e-9)
    assert plan.cost.step_time_s == base.cost.step_time_s


def test_plan_files_carry_the_loss_and_refuse_a_bad_one(tiny, tmp_path):
    cluster = al.Cluster.preset("dgx-h100", 1).with_(devices_per_host=4)
    with pytest.raises(ValueError, match="eager_loss must be None or one of"):
        al.fsdp_plan(tiny, cluster, dp_shard=4, eager_loss="jax")
    plan = al.fsdp_plan(tiny, cluster, dp_shard=4, microbatches=2, eager_loss="torchtitan")
    assert plan.stage_pins["eager_loss"] == 3 * 4 * (8 * 16 * 64) / 4
    save_plan(plan, tmp_path / "p.json")
    back = load_plan(tmp_path / "p.json", tiny)
    assert back.cost.peak_mem_bytes == pytest.approx(plan.cost.peak_mem_bytes, rel=1e-12)
    text = (tmp_path / "p.json").read_text()
    assert '"eager_loss": 24576.0' in text
    (tmp_path / "q.json").write_text(text.replace('"eager_loss": 24576.0', '"eager_loss": -1'))
    with pytest.raises(ValueError, match=r"stage_pins\['eager_loss'\] must be a number of bytes"):
        load_plan(tmp_path / "q.json", tiny)


def test_a_plan_file_carries_both_pins_and_explain_says_each_term(tmp_path):
    """A plan with KempnerForge's loss and its gradients held unsharded saves and loads with both pins; explain()
    and the JSON report give each term with its figures, which are the stage's own: the held gradients are its
    layers' float32 gradients in place of the shard, the loss adds what its static bytes grew by."""
    model = al.models.get("llama3-tiny", batch_size=8, vocab_size=65536)  # logits large beside the layers
    cluster = al.Cluster.preset("dgx-h100", 1).with_(devices_per_host=4)
    plan = al.fsdp_plan(model, cluster, dp_shard=4, microbatches=2, accumulate_unsharded=True,
                        eager_loss="kempnerforge")
    table = plan.table
    base = al.fsdp_plan(table=table, dp_shard=4, microbatches=2)
    loss = al.fsdp_plan(table=table, dp_shard=4, microbatches=2, eager_loss="kempnerforge")
    held = al.fsdp_plan(table=table, dp_shard=4, microbatches=2, accumulate_unsharded=True)
    cost = plan.cost
    assert cost.unsharded_grad_bytes == sum(c.grad_bytes for c in held.stages[0].layer_costs)
    assert cost.grad_shard_bytes == sum(c.grad_bytes for c in base.stages[0].layer_costs)
    assert cost.unsharded_grad_bytes == pytest.approx(4 * cost.grad_shard_bytes)  # a float32 model: whole over 4
    assert loss.cost.loss_extra_bytes > 0
    assert loss.cost.loss_extra_bytes == loss.stages[0].static_bytes - base.stages[0].static_bytes
    assert cost.eager_loss_bytes == plan.stage_pins["eager_loss"] == 4 * 2 * 8 * 16 * 65536 / 4
    text = cost.explain()
    assert "; memory: gradients held unsharded between microbatches on stage #0: " in text
    assert f"; memory: eager loss on stage #0: +{cost.loss_extra_bytes / 2**20:.4g} MiB = max(0, (16 MiB of " \
           "logits-sized tensors a step - the head's kept activations) / 2 microbatches" in text
    assert "memory:" not in base.cost.explain()
    report = plan.report()
    assert report["unsharded_grad_bytes"] == cost.unsharded_grad_bytes and report["loss_stage"] == 0
    assert not {"unsharded_grad_bytes", "eager_loss_bytes"} & set(base.report())
    save_plan(plan, tmp_path / "both.json")
    back = load_plan(tmp_path / "both.json", model)
    assert back.method == plan.method == "fsdp(dp_shard=4,no-sync,kempnerforge-loss)"
    assert back.stage_pins == plan.stage_pins and back.cost.explain() == text
    assert back.cost.peak_mem_bytes == pytest.approx(plan.cost.peak_mem_bytes, rel=1e-12)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_fsdp2_holds_no_bf16_shard_and_no_gradient_yet_at_the_loss(microbatches):
    """At the loss's backward an FSDP2 framework holds its parameters sharded in float32 only (MixedPrecisionPolicy
    casts them to bf16 into the all-gather's buffer, no bf16 shard of their own), and on a step of one microbatch no
    gradient yet (zero_grad sets them to None; each layer's is written at its reduce-scatter, after the loss): the
    loss adds max(0, (loss - head kept) / microbatches - working set - bf16 shard - gradients) by hand, and the
    breakdown of that stage shows neither."""
    model = al.models.get("llama3-tiny", batch_size=8, vocab_size=65536, dtype="bfloat16")
    cluster = al.Cluster.preset("dgx-h100", 1).with_(devices_per_host=4)
    plan = al.fsdp_plan(model, cluster, dp_shard=4, microbatches=microbatches, eager_loss="torchtitan",
                        precision="bf16")
    base = al.fsdp_plan(table=plan.table, dp_shard=4, microbatches=microbatches)
    costs = base.stages[0].layer_costs
    row = memory_breakdown(base)[0]
    working = row["buffers_bytes"] + row["recompute_bytes"]
    bf16_shard = sum(c.param_bytes for c in costs)
    grads = sum(c.grad_bytes for c in costs)
    assert bf16_shard * 2 == pytest.approx(sum(c.master_bytes for c in costs))  # bf16 beside a float32 master
    loss = 3 * 4 * 8 * 16 * 65536 / 4
    assert plan.stage_pins["eager_loss"] == loss
    not_held = bf16_shard + (grads if microbatches == 1 else 0.0)
    expect = (loss - costs[-1].act_bytes) / microbatches - working - not_held
    assert expect > 0
    assert plan.stages[0].peak_mem_bytes - base.stages[0].peak_mem_bytes == pytest.approx(expect, rel=1e-9)
    at_loss = memory_breakdown(plan)[0]
    assert at_loss["params_bytes"] == 0.0 and at_loss["recompute_bytes"] == 0.0
    assert at_loss["grads_bytes"] == (0.0 if microbatches == 1 else pytest.approx(grads))
    assert at_loss["master_bytes"] == row["master_bytes"] and at_loss["optimizer_bytes"] == row["optimizer_bytes"]
    assert sum(at_loss[p] for p in PARTS) == pytest.approx(plan.stages[0].peak_mem_bytes, rel=1e-12)


def test_a_float32_model_keeps_its_parameters_at_the_loss():
    """Without master weights the parameters are the shard itself: only the gradients are absent at the loss."""
    model = al.models.get("llama3-tiny", batch_size=8, vocab_size=65536)
    cluster = al.Cluster.preset("dgx-h100", 1).with_(devices_per_host=4)
    plan = al.fsdp_plan(model, cluster, dp_shard=4, microbatches=1, eager_loss="torchtitan")
    costs = plan.stages[0].layer_costs
    gone = absent_at_loss(costs, plan.stages[0].layers, 1)
    assert gone == {"params_bytes": 0.0, "grads_bytes": pytest.approx(sum(c.grad_bytes for c in costs))}
    assert absent_at_loss(costs, plan.stages[0].layers, 2) == {"params_bytes": 0.0, "grads_bytes": 0.0}
    row = memory_breakdown(plan)[0]
    assert row["params_bytes"] > 0
    assert row["params_bytes"] == pytest.approx(sum(c.param_bytes for c in costs))
