"""FSDP2's gradients accumulated unsharded between microbatches (``fsdp_plan(accumulate_unsharded=True)``,
:mod:`autopar_lab.pricing.accumulate`): each layer holds its parameters' float32 gradients gathered over the FSDP
group, still split by tensor parallelism, in place of its gradient shard; nothing else changes."""

from __future__ import annotations

import math

import jax
import pytest

import autopar_lab as al
from autopar_lab.memory import memory_breakdown
from autopar_lab.planfile import load_plan, save_plan
from autopar_lab.pricing.accumulate import accumulated_layer_costs, check_accumulate

GIB = 2**30


@pytest.fixture(scope="module")
def tiny():
    return al.models.get("llama3-tiny", batch_size=8)


@pytest.fixture(scope="module")
def four():
    return al.Cluster.preset("dgx-h200", 1).with_(devices_per_host=4, mesh_peers=3)


def _leaves(model):
    """(path, element count) of every parameter of the model, counted from its initial values."""
    params = model.init(0)[0]
    return [(jax.tree_util.keystr(p), math.prod(x.shape)) for p, x in jax.tree_util.tree_leaves_with_path(params)]


def test_every_gradient_is_held_whole_in_float32_over_the_fsdp_group(tiny, four):
    plan = al.fsdp_plan(tiny, four, dp_shard=4, microbatches=2, accumulate_unsharded=True)
    base = al.fsdp_plan(tiny, four, dp_shard=4, microbatches=2)
    elements = sum(n for _p, n in _leaves(tiny))
    st, st0 = plan.stages[0], base.stages[0]
    assert sum(c.grad_bytes for c in st.layer_costs) == pytest.approx(4 * elements, rel=1e-12)
    assert memory_breakdown(plan)[0]["grads_bytes"] == pytest.approx(4 * elements, rel=1e-12)
    # everything else is the plan without the option: the gradient shard is replaced, nothing added beside it
    shard = sum(c.grad_bytes for c in st0.layer_costs)
    assert st.static_bytes == pytest.approx(st0.static_bytes - shard + 4 * elements, rel=1e-12)
    assert st.act_bytes == st0.act_bytes and plan.cost.step_time_s == base.cost.step_time_s
    assert plan.stage_pins["accumulate"] == "unsharded" and "no-sync" in plan.method


def test_tensor_parallelism_still_splits_the_unsharded_gradients(tiny, four):
    plan = al.fsdp_plan(tiny, four, dp_shard=2, tp=2, microbatches=2, accumulate_unsharded=True)
    # Megatron's split: every matmul weight, the embedding and the head over tp=2 (the tiny model's 2 KV heads
    # divide), the RMSNorm scales whole
    whole = sum(n for p, n in _leaves(tiny) if "norm" in p)
    split = sum(n for p, n in _leaves(tiny) if "norm" not in p)
    assert sum(c.grad_bytes for c in plan.stages[0].layer_costs) == pytest.approx(4 * (whole + split / 2), rel=1e-12)


def test_one_microbatch_has_nothing_to_accumulate(tiny, four):
    plan = al.fsdp_plan(tiny, four, dp_shard=4, microbatches=1, accumulate_unsharded=True)
    base = al.fsdp_plan(tiny, four, dp_shard=4, microbatches=1)
    assert plan.cost.peak_mem_bytes == base.cost.peak_mem_bytes
    st = plan.stages[0]
    assert accumulated_layer_costs(plan.table, st.intra, st.layer_costs, "unsharded", 1) == list(st.layer_costs)


def test_bad_values_are_refused(tiny, four, tmp_path):
    with pytest.raises(ValueError, match="accumulate must be None or one of 'unsharded'"):
        check_accumulate("sharded")
    with pytest.raises(ValueError, match="accumulate_unsharded must be True or False"):
        al.fsdp_plan(tiny, four, dp_shard=4, microbatches=2, accumulate_unsharded="yes")
    plan = al.fsdp_plan(tiny, four, dp_shard=4, microbatches=2, accumulate_unsharded=True)
    save_plan(plan, tmp_path / "p.json")
    back = load_plan(tmp_path / "p.json", tiny)
    assert back.stage_pins["accumulate"] == "unsharded"
    assert back.cost.peak_mem_bytes == pytest.approx(plan.cost.peak_mem_bytes, rel=1e-12)
    text = (tmp_path / "p.json").read_text().replace('"accumulate": "unsharded"', '"accumulate": "sharded"')
    (tmp_path / "q.json").write_text(text)
    with pytest.raises(ValueError, match=r"stage_pins\['accumulate'\] must be one of 'unsharded'"):
        load_plan(tmp_path / "q.json", tiny)


def test_kempnerforge_fsdp4_holds_llama3_8b_float32_gradients_whole():
    """The bench's kf-fsdp-4 row (bench_fidelity.TODAY) through the public API: Llama 3 8B in pure bf16 over FSDP 4,
    two microbatches, FSDP2 without a sync on the first: 8,030,261,248 parameters' float32 gradients on each GPU."""
    model = al.models.get("llama3-8b", seq_len=4096, batch_size=32, mixed_precision=False)
    cluster = al.Cluster.preset("dgx-h200", 1).with_(devices_per_host=4, mesh_peers=3)
    kw = dict(dp_shard=4, tp=1, local_batch_size=4, remat=True, compile=True)
    plan = al.fsdp_plan(model, cluster, accumulate_unsharded=True, **kw)
    base = al.fsdp_plan(model, cluster, table=plan.table, **kw)
    h, f, kv, layers, vocab = 4096, 14336, 1024, 32, 128256
    params = layers * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + 2 * vocab * h + h
    assert params == 8_030_261_248
    row, row0 = memory_breakdown(plan)[0], memory_breakdown(base)[0]
    assert plan.microbatches == 2
    assert row["grads_bytes"] == pytest.approx(4 * params, rel=1e-12)
    assert row0["grads_bytes"] == pytest.approx(2 * params / 4, rel=1e-12)  # the bf16 shard it replaces
    assert row["total_bytes"] - row0["total_bytes"] == pytest.approx(4 * params - 2 * params / 4, rel=1e-9)
