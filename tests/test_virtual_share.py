"""CPU devices pay for the devices that run at once (issue 14, the cpu preset's kernels).

Measured on this machine (bench/RESULTS.md, 2026-12-04): gpt-tiny's step on each of 2 of the 8 JAX CPU devices costs
about a third of the same step on all 8 (the devices share two cores and one driver), and a step's kernels cost
10-12 us each with all 8 busy, where a chain of scalar kernels had measured 1.1 us. So the calibration fits the
kernel cost on a small model's own step, the rates at its sizes and the share of fewer devices
(:func:`autopar_lab.calibrate.measure_kernel_overhead`), and the cost model charges a program on d of a host's D
CPU devices ``(d + driver_share) / (D + driver_share)`` of its kernels' calibrated cost
(:func:`autopar_lab.backends.cpu.kernel_share`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

import autopar_lab as al
from autopar_lab import backends, calibrate
from autopar_lab.backends.cpu import kernel_share
from autopar_lab.cluster import CPU_PROFILE_PATH, Cluster, Efficiency
from autopar_lab.graph.fusion import attach_kernel_roles
from autopar_lab.sharding.strategies import price, replicated_strategy


def _devices() -> int:
    import jax

    return len(jax.devices("cpu"))


def virtual_cluster(share: float, devices: int = 8, launch: float = 1e-5) -> Cluster:
    c = Cluster.preset("p3.16xlarge")
    dev = dataclasses.replace(c.device, shares_cores=True,
                              efficiency=Efficiency(driver_share=share, kernel_launch_s=launch))
    return c.with_(device=dev)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.06, 3.0])
def test_virtual_share_is_the_formula(share):
    c = virtual_cluster(share)
    D = c.devices_per_host
    for d in range(1, D + 1):
        assert kernel_share(c, d) == pytest.approx((d + share) / (D + share))
        if d in (1, 2, 4, 8):  # the hook, on a mesh of d devices
            assert backends.kernel_share(c.logical_mesh((1, d), (1, d))) == kernel_share(c, d)
    assert kernel_share(c, D) == 1.0 and kernel_share(c, 4 * D) == 1.0  # never above all of them busy
    assert kernel_share(c, 0) == kernel_share(c, 1)
    # real accelerators run their own kernels: no share
    real = Cluster.preset("p3.16xlarge")
    assert [backends.kernel_share(real.logical_mesh((1, d), (1, d))) for d in (1, 2, 8)] == [1.0, 1.0, 1.0]


def test_driver_share_must_be_a_number_of_devices():
    with pytest.raises(ValueError, match="driver_share"):
        Efficiency(driver_share=-1.0)
    with pytest.raises(ValueError, match="driver_share"):
        Efficiency(driver_share=float("nan"))
    assert Efficiency(driver_share=2).to_dict() == {"driver_share": 2.0}
    assert Efficiency.from_dict({"driver_share": 1.5}).driver_share == 1.5


def test_an_operator_on_fewer_virtual_devices_costs_its_share():
    """The same replicated operator priced on a 2-device and an 8-device mesh of a virtual host: the ratio of the
    shares, for every operator of gpt-tiny's step; a real accelerator prices both alike."""
    graph = al.models.get("gpt-tiny").trace()
    attach_kernel_roles(graph)
    for share in (0.0, 1.0):
        c = virtual_cluster(share)
        two, eight = c.logical_mesh((1, 2), (1, 2)), c.logical_mesh((1, 8), (1, 8))
        seen = 0
        for op in graph:
            a = price(op, replicated_strategy(op), two).compute_s
            b = price(op, replicated_strategy(op), eight).compute_s
            if b > 0:
                seen += 1
                assert a == pytest.approx(b * kernel_share(c, 2) / kernel_share(c, 8), rel=1e-9)
        assert seen > 50
    real = Cluster.preset("p3.16xlarge")
    op = next(o for o in graph if o.primitive == "dot_general")
    assert price(op, replicated_strategy(op), real.logical_mesh((1, 2), (1, 2))).compute_s == pytest.approx(
        price(op, replicated_strategy(op), real.logical_mesh((1, 8), (1, 8))).compute_s)


def test_a_stage_on_fewer_virtual_devices_pays_fewer_launches():
    """Layer costs: a data-parallel stage's kernel launches on 2 devices are share(2) of those on 8."""
    model = al.models.get("gpt-tiny", batch_size=16)
    c = virtual_cluster(1.0)
    sub = c.with_(devices_per_host=8)
    p2 = al.megatron_plan(model, sub, dp=2, tp=1, pp=4, microbatches=1)
    p8 = al.data_parallel_plan(model, sub)
    lf2 = sum(lc.launch_fwd_s for lc in p2.stages[0].layer_costs)
    hf2 = sum(lc.heavy_fwd for lc in p2.stages[0].layer_costs)
    # per forward kernel of the stage: the calibrated launch times its share
    assert lf2 / hf2 == pytest.approx(1e-5 * kernel_share(sub, 2))
    lf8 = sum(lc.launch_fwd_s for lc in p8.stages[0].layer_costs)
    hf8 = sum(lc.heavy_fwd for lc in p8.stages[0].layer_costs)
    assert lf8 / hf8 == pytest.approx(1e-5)


def test_the_shipped_profile_has_the_step_fit():
    prof = json.loads(CPU_PROFILE_PATH.read_text())
    k = prof["measurements"]["kernel_overhead"]
    eff = prof["device"]["efficiency"]
    assert eff["kernel_launch_s"] == k["kernel_launch_s"] > 0 and eff["driver_share"] == k["driver_share"] >= 0
    # the device's rates are the measured large-kernel rates over the work scale the step fit found
    raw = prof["measurements"]
    assert prof["device"]["peak_flops"]["float32"] == pytest.approx(
        raw["matmul_flops_concurrent_per_device"] / k["work_scale"])
    assert prof["device"]["memory_bandwidth"] == pytest.approx(
        raw["memory_bandwidth_concurrent_per_device"] / k["work_scale"])
    for p in k["points"]:  # the fit, term by term
        assert p["fit_seconds"] == pytest.approx(p["call_s"] + k["kernel_launch_s"] * p["kernels"]
                                                 + k["work_scale"] * p["roofline_s"])
    assert len(prof["load_average"]) == 2
    assert Cluster.preset("cpu").device.efficiency.driver_share == eff["driver_share"]


def test_kernel_fit_on_four_devices():
    """The step fit run small (4 devices, 1-2 layers): its figures reproduce its own points by the formula, the
    fewer-devices point ran on 2 devices, and its share inverts the formula."""
    if _devices() < 4:
        pytest.skip("needs at least 4 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    k = calibrate.measure_kernel_overhead(4, points=((1, 2), (2, 2), (2, 8)), repeats=5, peak_flops=1e10,
                                          memory_bandwidth=2e9)
    assert k["kernel_launch_s"] >= 0 and k["work_scale"] > 0 and k["driver_share"] >= 0
    assert [(p["layers"], p["batch"], p["devices"]) for p in k["points"]] == [(1, 2, 4), (2, 2, 4), (2, 8, 4)]
    deeper, wider = k["points"][1], k["points"][2]
    assert deeper["kernels"] > k["points"][0]["kernels"]
    assert wider["roofline_s"] > deeper["roofline_s"]  # more rows: more work at the same kernels
    for p in k["points"]:
        assert p["fit_seconds"] == pytest.approx(p["call_s"] + k["kernel_launch_s"] * p["kernels"]
                                                 + k["work_scale"] * p["roofline_s"])
    few = k["fewer"]
    assert few["devices"] == 2 and (few["layers"], few["batch"]) == (1, 2)
    c = k["driver_share"]
    if 0.5 < few["share"] < 1:  # above d / n: a part that does not shrink with the devices
        assert (2 + c) / (4 + c) == pytest.approx(few["share"], rel=1e-6)
    else:  # at most d / n (or a slower run on fewer devices, noise): none
        assert c == 0.0
    with pytest.raises(ValueError, match="two"):
        calibrate.measure_kernel_overhead(4, points=((1, 2),))


def test_from_profile_reads_another_profile(tmp_path):
    prof = json.loads(CPU_PROFILE_PATH.read_text())
    prof["device"]["memory_bandwidth"] = 1.25e9
    prof["device"]["efficiency"]["driver_share"] = 2.5
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(prof))
    c = Cluster.from_profile(path, hosts=2)
    assert c.name == "cpu" and c.hosts == 2 and c.device.shares_cores
    assert c.device.memory_bandwidth == 1.25e9 and c.device.efficiency.driver_share == 2.5
    # a profile is also a cluster file (one host): --cluster PATH
    assert Cluster.from_json(path).device.efficiency.driver_share == 2.5
    assert Cluster.parse(str(path)).device.memory_bandwidth == 1.25e9
    with pytest.raises(ValueError, match="calibrate --out"):
        Cluster.from_profile(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"kind": "autopar-lab cpu profile", "device": 3}))
    with pytest.raises(ValueError, match="not a cpu profile"):
        Cluster.from_json(broken)
    with pytest.raises(ValueError, match="hosts"):
        Cluster.from_profile(path, hosts=0)


def test_cli_plans_with_a_profile_file_from_another_directory(tmp_path):
    """As a user runs it: calibrate writes a profile (here: the shipped one, copied), `plan --cluster FILE` plans on
    it from another directory, and a file that is not a profile exits 2 with one sentence."""
    prof = json.loads(CPU_PROFILE_PATH.read_text())
    prof["device"]["efficiency"]["kernel_launch_s"] *= 10  # a slower machine: the same plan costs more
    mine = tmp_path / "slow.json"
    mine.write_text(json.dumps(prof))
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8", "PATH": "/usr/bin:/bin"}

    def plan(cluster):
        return subprocess.run([sys.executable, "-m", "autopar_lab", "plan", "gpt-tiny", "--cluster", cluster,
                               "--method", "megatron", "--dp", "8", "--tp", "1", "--pp", "1", "--json"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    slow, shipped = plan(str(mine)), plan("cpu")
    assert slow.returncode == 0 and shipped.returncode == 0, slow.stderr + shipped.stderr
    assert json.loads(slow.stdout)["step_time_s"] > json.loads(shipped.stdout)["step_time_s"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "autopar-lab cpu profile", "device": {}}))
    out = plan(str(bad))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "cpu profile" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def deep_dp():
    """A 24-layer gpt-tiny (batch 16) and its data-parallel plan on the cpu preset, for the two tests that plan it."""
    model = al.models.get("gpt-tiny", num_layers=24, batch_size=16)
    return model, al.data_parallel_plan(model, Cluster.preset("cpu"))


def test_deep_model_auto_on_the_fresh_share_is_never_worse_than_data_parallel(deep_dp):
    """A 24-layer gpt-tiny planned on the cpu preset: the auto plan the share lets the stage DP find (stages on few
    devices) is predicted no slower than data parallelism, and its stages use every device once."""
    model, dp = deep_dp
    c = Cluster.preset("cpu")
    auto = al.auto_plan(model, c, table=dp.table)
    assert auto.cost.step_time_s <= dp.cost.step_time_s * (1 + 1e-9)
    assert sum(s.submesh[0] * s.submesh[1] for s in auto.stages) <= c.num_devices


def test_each_task_takes_its_parameter_arrays():
    """stage_cost: the forward task pays task_arrays_s once, the backward three times (parameters, gradient sums in
    and out); a stage run as one program (arrays=0) pays none; arrays of stages at once give the same numbers."""
    import numpy as np

    from autopar_lab.pricing.stage import stage_cost

    t = dict(fwd_s=4.0, bwd_s=8.0, static_bytes=10.0, act_bytes=6.0, heavy_fwd=2, heavy_bwd=4, fwd_compute_s=4.0,
             bwd_compute_s=6.0, sync_s=0.0, gather_s=0.0, launch_fwd_s=0.0, launch_bwd_s=0.0, ckpt_bytes=2.0,
             temp_bytes=0.0, layers=2)
    base = stage_cost(t, 0.0, 2, 1, False, 0.5)
    withs = stage_cost({**t, "task_arrays_s": 0.25}, 0.0, 2, 1, False, 0.5)
    assert withs[0] == pytest.approx(base[0] + 0.25) and withs[1] == pytest.approx(base[1] + 0.75)
    assert withs[2:] == base[2:]
    assert stage_cost({**t, "task_arrays_s": 0.25}, 0.0, 2, 1, False, 0.5, 0.0) == base
    many = stage_cost({k: np.full(3, v, dtype=float) for k, v in {**t, "task_arrays_s": 0.25}.items()}, 0.0, 2, 1,
                      False, 0.5, np.array([1.0, 0.0, 1.0]))
    assert list(many[0]) == pytest.approx([withs[0], base[0], withs[0]])
    assert list(many[1]) == pytest.approx([withs[1], base[1], withs[1]])


def test_the_programs_fixed_cost_is_reported_everywhere(tmp_path):
    """CostReport.cpu.task_s: the busiest stage's task overheads and the arrays its tasks take, by the stage formula;
    shown by explain(), plan --json and the text CLI, and the cost panel; 0 on a GPU preset."""
    from autopar_lab.pricing import task_overhead_s
    from autopar_lab.backends.cpu import ONE_PROGRAM_SHARE
    from autopar_lab.widgets.views.cost_panel import breakdown_html, explain_text

    model = al.models.get("gpt-tiny", batch_size=16, num_layers=4, hidden_size=32)
    c = Cluster.preset("cpu")
    dp = al.data_parallel_plan(model, c)
    pp = al.megatron_plan(model, c, dp=4, tp=1, pp=2, microbatches=2, table=dp.table)
    # one program: its three tasks are one; it takes its arrays once, in the update (no task arrays)
    assert dp.cost.cpu.task_s == pytest.approx(3 * task_overhead_s(c, (1, 8)) * ONE_PROGRAM_SHARE)
    st = pp.stages[pp.cost.busiest_stage]
    args = sum(lc.task_arrays_s for lc in st.layer_costs[st.layers[0]:st.layers[1] + 1])
    assert args > 0
    B = pp.microbatches
    assert pp.cost.cpu.task_s == pytest.approx((2 * B + 1) * task_overhead_s(c, st.submesh) + 4 * B * args)
    assert pp.cost.cpu.task_s < pp.cost.compute_s + pp.cost.bubble_s + 1e-12
    assert "fixed cost of its programs" in pp.cost.explain()
    assert "fixed cost of its programs" in explain_text(pp.cost)
    assert "programs' fixed cost" in breakdown_html(dp.cost, pp.cost)
    gpu = al.data_parallel_plan(al.models.get("gpt-tiny"), Cluster.preset("p3.16xlarge"))
    assert gpu.cost.cpu is None and "fixed cost of its programs" not in gpu.cost.explain()
    assert "fixed cost" not in breakdown_html(None, gpu.cost) and "task_s" not in gpu.cost.to_dict()
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8", "PATH": "/usr/bin:/bin"}
    args_cli = [sys.executable, "-m", "autopar_lab", "plan", "gpt-tiny", "--cluster", "cpu", "--method", "megatron",
                "--dp", "4", "--tp", "1", "--pp", "2", "--microbatches", "2"]
    js = subprocess.run(args_cli + ["--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert js.returncode == 0, js.stderr
    assert json.loads(js.stdout)["task_s"] > 0
    text = subprocess.run(args_cli, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert text.returncode == 0 and "its programs' fixed cost" in text.stdout


def test_a_deep_model_planned_on_a_copy_is_not_one_program(deep_dp):
    """The runtime replays a one-stage, one-microbatch plan as one program only when its strategies are per operator
    of the model's own graph; a 24-layer model planned on a shallower copy runs as a one-stage pipeline (measured),
    so its plan pays three tasks and their arrays, and the executed runner says so."""
    from autopar_lab.pricing import task_overhead_s

    c = Cluster.preset("cpu")
    model, deep = deep_dp
    assert deep.table.solve_graph is not deep.graph  # planned on a copy
    assert not deep.table.one_program(0, len(deep.layer_names) - 1, (1, 8), 1)
    args = sum(lc.task_arrays_s for lc in deep.stages[0].layer_costs)
    assert args > 0
    assert deep.cost.cpu.task_s == pytest.approx(3 * task_overhead_s(c, (1, 8)) + 4 * args)
    shallow = al.data_parallel_plan(al.models.get("gpt-tiny", batch_size=16, num_layers=4), c)
    assert shallow.table.one_program(0, len(shallow.layer_names) - 1, (1, 8), 1)
    if _devices() >= 8:
        runner = al.execute(deep, model, timing=False)
        assert runner.mode == "pipeline"


def test_kernel_overhead_only_refits_a_profile_in_place(tmp_path):
    """`--kernel-overhead-only` on a copy of the shipped profile: the kernel figures and the rates change together
    (rates = the profile's measured large-kernel rates over the new work scale, so a second run does not compound
    the scale), everything else is kept."""
    if _devices() < 8:
        pytest.skip("needs 8 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    path = tmp_path / "cpu.json"
    path.write_text(CPU_PROFILE_PATH.read_text())
    before = json.loads(path.read_text())
    assert calibrate.main(["--kernel-overhead-only", "--quick", "--out", str(path)]) == 0
    after = json.loads(path.read_text())
    k, raw = after["measurements"]["kernel_overhead"], after["measurements"]
    assert after["device"]["peak_flops"]["float32"] == pytest.approx(
        raw["matmul_flops_concurrent_per_device"] / k["work_scale"])
    assert after["device"]["memory_bandwidth"] == pytest.approx(
        raw["memory_bandwidth_concurrent_per_device"] / k["work_scale"])
    assert after["device"]["efficiency"]["driver_share"] == k["driver_share"]
    assert raw["matmul_flops_concurrent_per_device"] == before["measurements"]["matmul_flops_concurrent_per_device"]
    for key in ("intra_host", "inter_host", "num_devices", "total_memory_bytes"):
        assert after[key] == before[key]
    assert after["device"]["task_overhead_s"] == before["device"]["task_overhead_s"]
