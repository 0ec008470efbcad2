"""Whole plans: the auto plan against the baselines under one cost model, the report, the CLI."""

import json
import math

import pytest

import autopar_lab as al
from autopar_lab import planner
from autopar_lab.cluster import Cluster

# Two hosts of two devices: every submesh shape (1x1, 1x2, 2x2) and both links appear, and the ILPs stay small.
SMALL = Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=2)


@pytest.fixture(scope="module")
def model():
    return al.models.get("gpt-tiny", dtype="float32", batch_size=8)


@pytest.fixture(scope="module")
def result(model):
    return planner.compare(model, SMALL, microbatches="auto")


def test_auto_is_no_worse_than_megatron_and_data_parallel(result):
    auto, best, data = result["auto"], result["megatron_best"], result["data_parallel"]
    assert best is not None and result["megatron_tried"]
    assert auto.cost.step_time_s <= best.cost.step_time_s * (1 + 1e-9)
    assert auto.cost.step_time_s <= data.cost.step_time_s * (1 + 1e-9)


def test_plan_covers_every_layer_and_device_once(result, model):
    plan = result["auto"]
    layers = [l for st in plan.stages for l in range(st.layers[0], st.layers[1] + 1)]
    assert layers == list(range(len(plan.layer_names)))
    devices = [d for st in plan.stages for d in st.devices]
    assert devices == list(range(SMALL.num_devices))
    # Every operator of the step has a strategy in the stage that runs it.
    g = plan.graph
    assert plan.choice(next(o for o in g.ops if g.op(o).primitive == "dot_general")) is not None


def test_cost_terms_add_up_to_the_step_time(result):
    for plan in (result["auto"], result["data_parallel"], result["megatron_best"]):
        c = plan.cost
        assert math.isclose(c.compute_s + c.comm_s + c.reshard_s + c.bubble_s, c.step_time_s, rel_tol=1e-9)
        assert c.step_time_s == pytest.approx(c.timeline.makespan)
        assert "step time" in c.explain()


def test_report_has_the_promised_keys(result):
    rep = result["auto"].report("gpt-tiny")
    for key in ("model", "cluster", "method", "step_time_s", "samples_per_s", "compute_s", "comm_s", "reshard_s",
                "stage_comm_s", "bubble_s", "peak_mem_bytes", "mem_limit_bytes", "microbatches", "stages", "solve_s"):
        assert key in rep
    for key in ("layers", "submesh", "logical_mesh", "remat"):
        assert key in rep["stages"][0]
    for key in ("trace", "intra", "inter", "total"):
        assert key in rep["solve_s"]
    json.dumps(rep)


def test_megatron_layout_is_what_was_asked(model):
    p = planner.megatron_plan(model, SMALL, dp=1, tp=2, pp=2, microbatches=2)
    assert [s.submesh for s in p.stages] == [(1, 2), (1, 2)]
    assert [s.logical_mesh for s in p.stages] == [(1, 2), (1, 2)]
    assert p.stages[0].layers == (0, 1) and p.stages[1].layers == (2, 3)
    with pytest.raises(ValueError, match="devices"):
        planner.megatron_plan(model, SMALL, dp=2, tp=2, pp=2)
    with pytest.raises(ValueError, match="inside a host"):
        planner.megatron_plan(model, SMALL, dp=1, tp=4, pp=1)


def test_megatron_grid_is_valid():
    grid = planner.megatron_grid(Cluster.preset("p3.16xlarge", hosts=2), num_layers=24)
    assert (2, 8, 1) in grid and (16, 1, 1) in grid and (1, 8, 2) in grid
    assert all(dp * tp * pp == 16 for dp, tp, pp in grid)
