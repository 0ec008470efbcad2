"""A stage's backward resharding buffers in its peak memory (issue 31, item 4).

Where an operator of the backward reads a tensor in another sharding than its producer wrote, the resharded copy
(the collective's, the all-to-all's or the gather's output) is live beside its source; XLA issues a layer's
collectives ahead of their readers, so a layer's copies are live together (measured: at the peak of gpt-tiny's
dp2 x tp2 x pp2 stage backward on 8 CPU devices, 152 KiB of collectives' outputs). A stage holds its largest layer's
copies of one microbatch (``LayerCost.reshard_dst_*_bytes``, ``pricing.stage.range_max``), beside everything else.
Priced where it was measured, on CPU devices (``backends.reshard_buffers_held``): MaxText's v5p-128 row, which ran
in 95 GiB, would read 96.7 GiB with it on the TPU.
"""

from __future__ import annotations

import dataclasses

import pytest

import autopar_lab as al
from autopar_lab.cluster import Cluster
from autopar_lab.graph.opgraph import FORWARD, UPDATE
from autopar_lab.memory import PARTS
from autopar_lab.pricing.stage import prefix_sums
from autopar_lab.solve.intra import StrategyCache, conversions

SMALL = Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=2)


@pytest.fixture
def held(monkeypatch):
    """The term's count on SMALL's V100 layouts, whose solutions the hand counts below follow: priced as the CPU
    prices it (``backends.reshard_buffers_held``)."""
    from autopar_lab.pricing import layers
    monkeypatch.setattr(layers, "reshard_buffers_held", lambda cluster: True)


def static_bytes(plan, k, costs):
    """Stage k's static bytes priced from ``costs`` (its layer costs, changed or not) by the table's own formula."""
    st = plan.stages[k]
    cand = plan.table.stage_from_sums(prefix_sums(costs), st.layers[0], st.layers[1], st.submesh, st.logical_mesh,
                                      plan.microbatches, st.remat)
    return cand.static_bytes


def without_reshard_buffers(costs):
    return [dataclasses.replace(c, reshard_dst_act_bytes=0.0, reshard_dst_weight_bytes=0.0) for c in costs]


def test_a_gpt_layers_backward_reshardings_counted_by_hand(held):
    """gpt-tiny (float32, batch 8, hidden 32, seq 16, MLP 128) in Megatron's dp2 x tp2 layout, 2 microbatches. Each
    layer's backward reads two forward tensors gathered over the data axis, still split over the tensor axis: fc1's
    output [8, 16, 128] (GELU's gradient) and the attention's output [8, 16, 32]: 8 x 16 x 128 x 4 / 2 + 8 x 16 x 32 x
    4 / 2 = 40,960 bytes a step, 20,480 of one microbatch. Its bias-gradient reductions read their inputs gathered too,
    but XLA reduces each shard and all-reduces the result instead (no copy): not counted; nor is a forward copy."""
    model = al.models.get("gpt-tiny", dtype="float32", batch_size=8)
    plan = al.megatron_plan(model, SMALL, dp=2, tp=2, pp=1, microbatches=2)
    st = plan.stages[0]
    by_hand = 8 * 16 * 128 * 4 / 2 + 8 * 16 * 32 * 4 / 2
    assert [c.reshard_dst_act_bytes for c in st.layer_costs] == [0.0, by_hand, by_hand, 0.0]
    assert all(c.reshard_dst_weight_bytes == 0.0 for c in st.layer_costs)
    # what is left out is there: the backward's reductions of gathered inputs, and the forward's reshardings
    g = plan.op_graph
    rows = list(conversions(g, st.intra.ops, st.intra.strategies, StrategyCache(st.intra.mesh)))
    assert any(g.op(v).primitive == "reduce_sum" and g.op(v).role not in (FORWARD, UPDATE) for _u, v, *_ in rows)
    # the stage holds one layer's copies of one microbatch on top of what it held before
    assert static_bytes(plan, 0, st.layer_costs) == st.static_bytes
    assert st.static_bytes - static_bytes(plan, 0, without_reshard_buffers(st.layer_costs)) == by_hand / 2
    row = al.memory_breakdown(plan)[0]
    assert sum(row[p] for p in PARTS) == pytest.approx(row["total_bytes"], abs=1.0)
    # Megatron's dp1 x tp2 x pp2 reads every tensor in its producer's sharding in the backward: nothing added
    pp = al.megatron_plan(model, SMALL, dp=1, tp=2, pp=2, microbatches=2)
    assert all(c.reshard_dst_act_bytes == c.reshard_dst_weight_bytes == 0.0 for s in pp.stages for c in s.layer_costs)


def test_a_deep_models_stage_holds_one_layers_resharding_buffers_not_every_layers(held):
    """gpt-1.3b (24 layers, planned on its 4-layer copy) in bf16 mixed precision, dp2 x tp2: each of the 24 blocks
    reshards activations and weights in its backward (the layer costs of the full model, mapped from the copy's
    middle layer, all alike), and so does its head; its one stage holds the largest layer's copies once (a
    microbatch's activations, the weights), not every layer's (they are freed layer by layer)."""
    model = al.models.get("gpt-1.3b", batch_size=4, seq_len=32)
    plan = al.megatron_plan(model, SMALL, dp=2, tp=2, pp=1, microbatches=2)
    costs = plan.stages[0].layer_costs
    assert len(costs) == 26
    blocks = costs[1:25]
    act, weight = blocks[0].reshard_dst_act_bytes, blocks[0].reshard_dst_weight_bytes
    assert act > 0 and weight > 0
    assert all((c.reshard_dst_act_bytes, c.reshard_dst_weight_bytes) == (act, weight) for c in blocks)
    most_act = max(c.reshard_dst_act_bytes for c in costs)
    most_weight = max(c.reshard_dst_weight_bytes for c in costs)
    added = plan.stages[0].static_bytes - static_bytes(plan, 0, without_reshard_buffers(costs))
    assert added == pytest.approx(most_act / 2 + most_weight, rel=1e-12)
    # the largest is the head's (the tied embedding read as the logits' weight), once; the 24 blocks' sum is far more
    assert (most_act, most_weight) == (costs[-1].reshard_dst_act_bytes, costs[-1].reshard_dst_weight_bytes)
    assert added < sum(c.reshard_dst_act_bytes / 2 + c.reshard_dst_weight_bytes for c in costs) / 4


def test_priced_on_cpu_devices_where_it_was_measured_not_on_gpus():
    """The same Megatron dp2 x tp2 layout of gpt-tiny: on CPU devices its layers' backward copies are priced, on
    V100s (unmeasured) they are not, and the stage's static bytes differ by exactly the term."""
    model = al.models.get("gpt-tiny", dtype="float32", batch_size=16)
    cpu = al.megatron_plan(model, Cluster.preset("cpu").with_(devices_per_host=4), dp=2, tp=2, pp=1, microbatches=2)
    costs = cpu.stages[0].layer_costs
    assert max(c.reshard_dst_act_bytes for c in costs) > 0
    assert cpu.stages[0].static_bytes > static_bytes(cpu, 0, without_reshard_buffers(costs))
    gpu = al.megatron_plan(model, SMALL, dp=2, tp=2, pp=1, microbatches=2)
    assert all(c.reshard_dst_act_bytes == c.reshard_dst_weight_bytes == 0.0 for c in gpu.stages[0].layer_costs)
