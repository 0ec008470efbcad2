"""What the cost report says beyond the step time: communication hidden behind compute (the overlap model), kernel
counts, and the memory breakdown, in explain(), the CLI's plan --json and the cost panel."""

import json
import math
import subprocess
import sys

import pytest

import autopar_lab as al
from autopar_lab.pricing.memory import PARTS
from autopar_lab.pricing.stage import SUM_FIELDS, hidden_comm_s


@pytest.fixture(scope="module")
def dp_plan():
    # Data parallelism over 2 hosts x 8 A100s: the gradient all-reduce crosses InfiniBand, 4 microbatches.
    model = al.models.get("gpt-tiny", num_layers=4, seq_len=128, hidden_size=512, num_heads=8, batch_size=64,
                          vocab_size=1024, dtype="float16")
    return al.data_parallel_plan(model, al.Cluster.preset("dgx-a100", hosts=2), microbatches=4)


def test_the_gradient_reduction_hides_behind_the_last_backward(dp_plan):
    (st,) = dp_plan.stages
    costs = st.layer_costs
    t = {f: math.fsum(getattr(c, f) for c in costs) for f in SUM_FIELDS}
    assert t["sync_s"] > 0
    hidden_sync, hidden_gather = hidden_comm_s(t, 4)
    # by hand: up to the last microbatch's backward compute, less its last bucket (one layer of n)
    assert hidden_sync == min(t["sync_s"], t["bwd_compute_s"] / 4 * (1 - 1 / t["layers"]))
    assert dp_plan.cost.hidden_comm_s == pytest.approx(hidden_sync + hidden_gather, rel=1e-12)
    # the backward per microbatch carries only the part that shows
    assert st.bwd_s == pytest.approx((t["bwd_s"] - hidden_sync) / 4 + t["launch_bwd_s"], rel=1e-12)
    # the report's terms still add up to the step time; the hidden part is beside them
    c = dp_plan.cost
    assert math.isclose(c.compute_s + c.comm_s + c.reshard_s + c.bubble_s, c.step_time_s, rel_tol=1e-9)
    assert "hidden behind" in c.explain() and f"{c.kernels:,} fused kernels" in c.explain()


def test_plan_json_from_another_directory_has_the_new_terms(tmp_path):
    out = subprocess.run([sys.executable, "-m", "autopar_lab.cli", "plan", "gpt-tiny", "--cluster", "dgx-a100:1",
                          "--method", "megatron", "--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2",
                          "--remat", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert {"hidden_comm_s", "kernels", "flash_attention"} <= set(rep) and rep["flash_attention"] is True
    assert len(rep["memory"]) == len(rep["stages"]) == 2
    for mem, st in zip(rep["memory"], rep["stages"]):
        assert sum(mem[p] for p in PARTS) == pytest.approx(st["peak_mem_bytes"], rel=1e-9)
        assert mem["recompute_bytes"] > 0  # remat: one layer's activations recomputed at a time


def test_the_cost_panel_shows_hidden_communication_and_kernels(dp_plan):
    from autopar_lab.widgets.views.cost_panel import breakdown_html, explain_text, memory_text
    from autopar_lab.pricing.memory import memory_breakdown

    html = breakdown_html(None, dp_plan.cost)
    assert "hidden behind compute" in html
    assert "fused kernels" in explain_text(dp_plan.cost) and "hidden behind compute" in explain_text(dp_plan.cost)
    text = memory_text(memory_breakdown(dp_plan), dp_plan.cost.mem_limit_bytes)
    assert "fp32 master weights" in text  # the zoo's float16 GPT trains in mixed precision


def test_the_update_pays_once_per_step_for_each_state_array():
    """Efficiency.buffer_s: the step's update program takes and returns every parameter and optimizer-state array
    once per step (measured on the cpu preset, where dispatching buffers costs tens of microseconds each)."""
    from autopar_lab.graph.opgraph import INPUT_PRIMITIVE, OPT_STATE, PARAM

    model = al.models.get("gpt-tiny", num_layers=2, hidden_size=32, seq_len=16, batch_size=8, vocab_size=64)
    base = al.Cluster.preset("cpu").with_(devices_per_host=2, buffer_s=0.0)
    slow = base.with_(buffer_s=1e-3)
    a = al.data_parallel_plan(model, base, microbatches=2)
    b = al.data_parallel_plan(model, slow, microbatches=2)
    g = a.table.solve_graph
    arrays = sum(1 for o in g.ops if g.op(o).primitive == INPUT_PRIMITIVE
                 and g.tensor(g.op(o).outputs[0]).kind in (PARAM, OPT_STATE))
    assert arrays > 20  # every weight, bias and norm, two Adam moments each, and Adam's count
    extra = sum(c.bwd_s for c in b.stages[0].layer_costs) - sum(c.bwd_s for c in a.stages[0].layer_costs)
    assert extra == pytest.approx(arrays * 1e-3, rel=1e-9)
    # once per step: spread over the microbatches' backward tasks, the step grows by as much; and on these virtual
    # devices each of the 2 microbatches' forward and backward tasks takes the parameter arrays (1 + 3 passes)
    params = sum(1 for o in g.ops if g.op(o).primitive == INPUT_PRIMITIVE
                 and g.tensor(g.op(o).outputs[0]).kind == PARAM)
    assert sum(c.task_arrays_s for c in b.stages[0].layer_costs) == pytest.approx(params * 1e-3, rel=1e-9)
    assert b.cost.step_time_s - a.cost.step_time_s == pytest.approx((arrays + 2 * 4 * params) * 1e-3, rel=1e-6)
    with pytest.raises(ValueError, match="buffer_s"):
        base.with_(buffer_s=-1.0)
