"""Each stage's peak memory split into parameters, gradients, optimizer state and activations (autopar_lab.memory)."""

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


def test_tensor_parallel_halves_the_parameters(deep, two, pipeline):
    whole = al.megatron_plan(deep, two.with_(devices_per_host=1), dp=1, tp=1, pp=1, microbatches=4)
    split = al.megatron_plan(deep, two, dp=1, tp=2, pp=1, microbatches=4)
    a, b = memory_breakdown(whole)[0], _check_sums(split)[0]
    assert a["params_bytes"] == deep.param_bytes
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
