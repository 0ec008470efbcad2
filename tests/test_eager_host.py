"""An eager host (issue 31): a framework that launches every kernel from Python (Megatron-LM's stack without CUDA
graphs, torchtitan without torch.compile) makes each stage's microbatch last at least its kernels times the fitted
host time per kernel (autopar_lab.backends.eager); auto_plan and maxtext_plan, compiled programs, never pay it, nor a
Megatron layout as this library runs it (no library_kernels)."""

import math

import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.backends import eager, host_launch_s
from autopar_lab.pricing.stage import host_kernels, host_stretch

H = eager.TE_LAUNCH_S  # megatron_plan(library_kernels=True): Megatron-LM's stack, Transformer Engine's modules


def _tiny(batch=8, layers=2):
    # small kernels on an H100 (microseconds each): the host, at tens of microseconds a kernel, is the bound
    return al.models.get("gpt-tiny", seq_len=64, hidden_size=128, num_heads=4, num_layers=layers, batch_size=batch,
                         vocab_size=512)


@pytest.fixture(scope="module")
def table():
    return al.CostTable.build(_tiny(), al.Cluster.preset("dgx-h100", 1).with_(library_kernels=True))


def test_the_host_time_a_kernel_is_the_fitted_constant_and_names_its_measurement():
    assert host_launch_s("eager-te") == H and host_launch_s("eager") == eager.EAGER_LAUNCH_S
    assert host_launch_s(None) == 0.0
    assert "mlm-h100-1.7B" in eager.FITTED["TE_LAUNCH_S"] and 10e-6 < eager.EAGER_LAUNCH_S < H < 100e-6
    with pytest.raises(ValueError, match="eager"):
        host_launch_s("lazy")


def test_a_host_bound_stage_lasts_its_kernels_times_the_host_time():
    """The formula by hand: 100 + 200 kernels (and, recomputing its attention internals, 30 more) at 100 us are 30
    (33) ms of host time; a microbatch of 3 ms on the GPU stretches tenfold (11-fold), one of 45 ms not at all."""
    t = dict(heavy_fwd=100, heavy_bwd=200, attn_kernels=30, host_launch_s=1e-4)
    assert host_kernels(t, False) == 300 and host_kernels(t, "selective") == 330 and host_kernels(t, True) == 400
    assert host_stretch(t, 0.001, 0.002, False) == pytest.approx(10.0)
    assert host_stretch(t, 0.001, 0.002, "selective") == pytest.approx(11.0)
    assert host_stretch(t, 0.015, 0.030, False) == 1.0
    # the stage DP's arrays give the same numbers as one stage's floats
    arr = host_stretch({**t, "heavy_fwd": np.array([100, 100])}, np.array([0.001, 0.015]), np.array([0.002, 0.03]),
                       False)
    assert list(arr) == [host_stretch(t, 0.001, 0.002, False), 1.0]


def test_megatron_plan_on_small_kernels_is_host_bound_by_the_formula(table):
    """One stage, two microbatches: the step is B x max(GPU time of a microbatch, its kernels x the host time), the
    GPU time the same layout's with CUDA graphs (no host), and the breakdown names the wait as its own term."""
    eager_plan = al.megatron_plan(table=table, dp=8, tp=1, pp=1, microbatches=2)
    graphs = al.megatron_plan(table=table, dp=8, tp=1, pp=1, microbatches=2, cuda_graphs=True)
    B = 2
    (st,), (g,) = eager_plan.stages, graphs.stages
    kernels = eager_plan.cost.kernels / B  # a microbatch's, forward and backward
    assert kernels == graphs.cost.kernels / B and kernels > 100
    gpu, host = g.fwd_s + g.bwd_s, kernels * H
    assert host > gpu  # small kernels: the host is the bound
    assert st.fwd_s + st.bwd_s == pytest.approx(max(gpu, host), rel=1e-12)
    assert st.fwd_s / st.bwd_s == pytest.approx(g.fwd_s / g.bwd_s, rel=1e-12)  # both tasks stretch alike
    c = eager_plan.cost
    assert c.step_time_s == pytest.approx(B * host, rel=1e-9)
    assert c.host_s == pytest.approx(c.step_time_s - graphs.cost.step_time_s, rel=1e-9)
    assert c.compute_s == pytest.approx(graphs.cost.compute_s, rel=1e-9)
    assert math.isclose(c.compute_s + c.comm_s + c.reshard_s + c.host_s + c.bubble_s, c.step_time_s, rel_tol=1e-9)
    text = c.explain()
    assert f"+ host {c.host_s:.4g} s" in text and f"{c.kernels:,} kernels a step" in text
    assert f"{H * 1e6:.3g} us" in text
    assert graphs.cost.host_s == 0 and "+ host" not in graphs.cost.explain()
    assert eager_plan.stage_pins["host"] == "eager-te" and "host" not in graphs.stage_pins
    assert c.to_dict()["host_s"] == c.host_s


def test_a_pipelined_eager_plan_stretches_each_stage_by_its_own_kernels(table):
    eager_plan = al.megatron_plan(table=table, dp=4, tp=1, pp=2, microbatches=4)
    graphs = al.megatron_plan(table=table, dp=4, tp=1, pp=2, microbatches=4, cuda_graphs=True)
    for st, g in zip(eager_plan.stages, graphs.stages):
        span = st.layer_costs[st.layers[0]:st.layers[1] + 1]
        kernels = sum(c.heavy_fwd + c.heavy_bwd for c in span)
        assert st.fwd_s + st.bwd_s == pytest.approx(max(g.fwd_s + g.bwd_s, kernels * H), rel=1e-9)
    assert eager_plan.cost.step_time_s > graphs.cost.step_time_s and eager_plan.cost.host_s > 0


def test_auto_and_maxtext_plans_pay_no_host(table):
    """Compiled programs (XLA): auto_plan and maxtext_plan price the GPU's time alone, as before the eager host."""
    auto = al.auto_plan(table=table)
    assert auto.cost.host_launch_s == 0 and auto.cost.host_s == 0 and "host" not in auto.stage_pins
    assert "+ host" not in auto.cost.explain() and "host_s" not in auto.cost.to_dict()
    same = al.price_plan(table, auto.stages, microbatches=auto.microbatches, schedule=auto.schedule)
    assert same.cost.step_time_s == auto.cost.step_time_s
    mt = al.maxtext_plan(_tiny(), al.Cluster.preset("tpu-v5p", 8), ici_fsdp=-1, remat=False)
    assert mt.cost.host_launch_s == 0 and "host" not in mt.stage_pins


def test_fsdp_plan_is_eager_without_torch_compile():
    model = _tiny()
    eager_plan = al.fsdp_plan(model, al.Cluster.preset("dgx-h100", 1), compile=False)
    compiled = al.fsdp_plan(model, al.Cluster.preset("dgx-h100", 1), compile=True)
    assert eager_plan.stage_pins.get("host") == "eager" and eager_plan.cost.host_launch_s == eager.EAGER_LAUNCH_S
    assert "host" not in compiled.stage_pins and compiled.cost.host_s == 0


def test_the_host_survives_an_override_and_a_plan_file(table, tmp_path):
    plan = al.megatron_plan(table=table, dp=8, tp=1, pp=1, microbatches=2)
    op = next(o for o in plan.graph.ops if plan.graph.op(o).primitive == "dot_general")
    other = next(a.strategy for a in plan.alternatives(op) if a.strategy != plan.choice(op).name)
    changed = plan.with_choice(op, other)
    assert changed.stage_pins["host"] == "eager-te" and changed.cost.host_launch_s == H
    back = changed.without_pin(op)
    assert back.cost.step_time_s == pytest.approx(plan.cost.step_time_s, rel=1e-12)
    path = tmp_path / "p.json"
    al.save_plan(plan, path)
    loaded = al.load_plan(path, plan.graph, plan.cluster)
    assert loaded.stage_pins["host"] == "eager-te" and loaded.cost.step_time_s == pytest.approx(plan.cost.step_time_s)


def test_a_megatron_layout_as_this_library_runs_it_pays_no_host():
    """Without library_kernels a Megatron plan is the layout as the library's XLA programs run it (the SC21 rows are
    priced so); on the CPU's devices the library's runtime runs every plan, library_kernels or not."""
    model = _tiny()
    xla = al.megatron_plan(model, al.Cluster.preset("dgx-h100", 1), dp=8, tp=1, pp=1, microbatches=2)
    assert "host" not in xla.stage_pins and xla.cost.host_launch_s == 0 and xla.cost.host_s == 0
    cpu = al.megatron_plan(model, al.Cluster.preset("cpu").with_(devices_per_host=4), dp=4, tp=1, pp=1,
                           microbatches=2, library_kernels=True)
    assert "host" not in cpu.stage_pins and cpu.cost.host_launch_s == 0


def test_the_cost_panel_and_the_cli_show_the_host_term(table, capsys):
    from autopar_lab.cli import _print_plan
    from autopar_lab.widgets.views.cost_panel import breakdown_html, cost_terms, explain_text

    plan = al.megatron_plan(table=table, dp=8, tp=1, pp=1, microbatches=2)
    terms = cost_terms(plan.cost)
    assert terms["host"] == plan.cost.host_s > 0
    assert sum(terms.values()) == pytest.approx(plan.cost.step_time_s, rel=1e-9)
    assert "+ host" in explain_text(plan.cost) and "eager host" in breakdown_html(None, plan.cost)
    graphs = al.megatron_plan(table=table, dp=8, tp=1, pp=1, microbatches=2, cuda_graphs=True)
    assert "host" not in cost_terms(graphs.cost) and "+ host" not in explain_text(graphs.cost)
    out = {"model": "m", "cluster": "c", "method": plan.method, "microbatches": 2, "schedule": "1f1b", "stages": [],
           "solve_s": {},
           **plan.cost.to_dict()}
    _print_plan(out)
    assert f"+ host {plan.cost.host_s:.4g} s" in capsys.readouterr().out


def test_an_eager_host_reserves_the_fitted_share_of_its_peak_beyond_what_it_allocates():
    """PyTorch's caching allocator reserves more than it allocates: an eager plan's breakdown gives the reserved
    figure (what torchtitan logs) as its allocated peak x the fitted ALLOCATOR_RESERVE; a compiled plan's is its
    allocated peak (not modelled). The figure names the row it was fitted on and the one it was checked on."""
    model = _tiny()
    eager_plan = al.fsdp_plan(model, al.Cluster.preset("dgx-h100", 1), compile=False)
    compiled = al.fsdp_plan(model, al.Cluster.preset("dgx-h100", 1), compile=True)
    for row in al.memory_breakdown(eager_plan):
        assert row["reserved_bytes"] == pytest.approx(row["total_bytes"] * eager.ALLOCATOR_RESERVE, rel=1e-12)
        assert row["reserved_bytes"] > row["total_bytes"]
    for row in al.memory_breakdown(compiled):
        assert row["reserved_bytes"] == row["total_bytes"]
    text = eager.FITTED["ALLOCATOR_RESERVE"]
    assert "torchtitan-8b-8" in text and "Out of sample" in text and "128-GPU row" in text
    assert 1.0 < eager.ALLOCATOR_RESERVE < 1.5
    assert eager.reserved_bytes("eager-te", 100.0) == eager.reserved_bytes("eager", 100.0)
    with pytest.raises(ValueError, match="eager"):
        eager.reserved_bytes("lazy", 100.0)
