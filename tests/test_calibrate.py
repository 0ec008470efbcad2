"""Calibration: the alpha-beta fit (exact on synthetic data), a quick real measurement whose fit reproduces what it
measured, the profile file it writes, and the cpu preset reading that file."""

import json
import math

import numpy as np
import pytest

from autopar_lab import calibrate
from autopar_lab.calibrate import (
    fit_alpha_beta,
    fit_collectives,
    latency_steps,
    measure_collectives,
    measure_collectives_between_compute,
)
from autopar_lab.cluster import Cluster, Device, Link


def test_fit_recovers_alpha_beta_from_synthetic_timings():
    alpha, bw, n = 3e-5, 2e9, 8  # alpha: latency per algorithm step
    rng = np.random.default_rng(0)
    rows = []
    for kind, factor in (("all_reduce", 2 * 7 / 8), ("all_gather", 7 / 8)):
        for b in (1 << 12, 1 << 16, 1 << 20, 1 << 23):
            x = factor * b
            t = (alpha * latency_steps(kind, n) + x / bw) * (1 + rng.uniform(-0.03, 0.03))  # 3% noise
            rows.append({"kind": kind, "x_bytes": x, "seconds": t})
    fits = fit_collectives(rows, n)
    assert set(fits) == {"all_reduce", "all_gather", "joint"}
    for f in fits.values():
        assert f["latency"] == pytest.approx(alpha, rel=0.1) and f["bandwidth"] == pytest.approx(bw, rel=0.1)
        assert f["max_abs_rel_residual"] < 0.06
        # The stored residuals are the fit's: (alpha steps + beta x - t) / t.
        for p in f["points"]:
            want = f["alpha_s"] * latency_steps(p["kind"], n) + f["beta_s_per_byte"] * p["x_bytes"]
            assert p["fit_seconds"] == pytest.approx(want, rel=1e-12)
            assert p["rel_residual"] == pytest.approx((p["fit_seconds"] - p["seconds"]) / p["seconds"], rel=1e-12)
    # Noise that would tip the fit negative still gives a usable link.
    a, b = fit_alpha_beta([1e3, 1e6, 2e6], [5e-3, 4e-3, 3e-3])
    assert a >= 0 and b > 0


def test_the_fit_is_the_cost_models_formula():
    """A link with the fitted figures prices each measured collective as the fit does: the latency steps the fit
    assumes are the ones the cost model charges."""
    alpha, bw, n = 2e-5, 1e9, 8
    rows = [{"kind": k, "x_bytes": f * b, "seconds": alpha * latency_steps(k, n) + f * b / bw}
            for k, f in (("all_reduce", 2 * 7 / 8), ("all_gather", 7 / 8)) for b in (1 << 12, 1 << 20)]
    joint = fit_collectives(rows, n)["joint"]
    link = Link(joint["bandwidth"], joint["latency"])
    c = Cluster(hosts=1, devices_per_host=n, device=Device("cpu", {"float32": 1e10}, 2**30, 1e10), intra_host=link,
                inter_host=link)
    mesh = c.logical_mesh((1, n), (1, n))
    for r in rows:
        b = r["x_bytes"] / (2 * 7 / 8 if r["kind"] == "all_reduce" else 7 / 8)
        assert getattr(mesh, r["kind"])(b, 1) == pytest.approx(r["seconds"], rel=1e-9)


def _devices():
    import jax

    return len(jax.devices("cpu"))


def test_quick_collective_fit_reports_its_true_residuals():
    """A real quick measurement on the local devices: the rows describe what was measured (sizes, bytes each device
    moves by the ring formulas), and the fit's reported residuals are its true residuals against those rows (fitted
    = alpha + beta * x_bytes). How well the line fits depends on what else shares the cores, so that is recorded, not
    asserted here; recovery of known alpha/beta is checked on synthetic timings above."""
    n = min(_devices(), 8)
    if n < 2:
        pytest.skip("needs at least 2 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    sizes = (1 << 12, 1 << 16, 1 << 18, 1 << 20)
    rows = measure_collectives(n, sizes, repeats=5)
    best = fit_collectives(rows, n)["joint"]
    assert {r["kind"] for r in rows} == {"all_reduce", "all_gather"} and len(rows) == 2 * len(sizes)
    assert [r["bytes"] for r in rows if r["kind"] == "all_reduce"] == list(sizes)
    assert all(r["x_bytes"] == pytest.approx(2 * (n - 1) / n * r["bytes"]) for r in rows if r["kind"] == "all_reduce")
    assert all(r["x_bytes"] == pytest.approx((n - 1) / n * r["bytes"]) for r in rows if r["kind"] == "all_gather")
    assert all(r["seconds"] > 0 and math.isfinite(r["seconds"]) for r in rows)
    assert best["latency"] >= 0 and math.isfinite(best["bandwidth"]) and best["bandwidth"] > 0
    rel = []
    for p in best["points"]:
        want = best["alpha_s"] * latency_steps(p["kind"], n) + best["beta_s_per_byte"] * p["x_bytes"]
        assert p["fit_seconds"] == pytest.approx(want, rel=1e-9)
        rel.append((p["fit_seconds"] - p["seconds"]) / p["seconds"])
    assert best["max_abs_rel_residual"] == pytest.approx(max(abs(r) for r in rel), rel=1e-9)
    assert best["rms_rel_residual"] == pytest.approx(math.sqrt(sum(r * r for r in rel) / len(rel)), rel=1e-9)


def test_quick_profile_file_and_cpu_preset(tmp_path, monkeypatch):
    if _devices() < 2:
        pytest.skip("needs at least 2 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    out = tmp_path / "cpu.json"
    assert calibrate.main(["--quick", "--devices", "2", "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["quick"] and prof["num_devices"] == 2
    assert prof["device"]["peak_flops"]["float32"] > 0 and prof["device"]["memory_bandwidth"] > 0
    joint = prof["measurements"]["collective_fits"]["joint"]
    assert prof["intra_host"] == {"bandwidth": joint["bandwidth"], "latency": joint["latency"]}
    assert {"all_reduce", "all_gather"} <= set(prof["measurements"]["collective_fits"])
    assert all("rel_residual" in p for p in joint["points"])
    # The cpu preset reads the profile file: pointed at this one, it has these figures.
    from autopar_lab import cluster as cl

    monkeypatch.setattr(cl.cpuprofile, "CPU_PROFILE_PATH", out)  # where the cpu preset reads it
    c = cl.Cluster.preset("cpu")
    assert c.intra_host.bandwidth == joint["bandwidth"] and c.intra_host.latency == joint["latency"]
    assert c.device.peak_flops["float32"] == prof["device"]["peak_flops"]["float32"]
    assert c.device.memory_bandwidth == prof["device"]["memory_bandwidth"]


def test_shipped_profile_has_the_fits():
    from autopar_lab.cluster import CPU_PROFILE_PATH

    prof = json.loads(CPU_PROFILE_PATH.read_text())
    fits = prof["measurements"]["collective_fits"]
    assert {"all_reduce", "all_gather", "joint"} <= set(fits)
    assert prof["intra_host"]["bandwidth"] == fits["joint"]["bandwidth"]
    assert prof["intra_host"]["latency"] == fits["joint"]["latency"]  # per algorithm step
    n = prof["num_devices"]
    for f in fits.values():
        for p in f["points"]:
            want = f["alpha_s"] * latency_steps(p["kind"], n) + f["beta_s_per_byte"] * p["x_bytes"]
            assert p["fit_seconds"] == pytest.approx(want, rel=1e-9)


def test_task_overhead_fit_reproduces_its_measured_task_times():
    """The fitted per-task overhead (t = overhead + beta * bytes over activation sizes) reproduces the median task
    time at every size within 50% (the better of two runs on this shared machine). A task includes its call, so it
    takes longer than the call alone. No assertion on absolute speed."""
    if _devices() < 4:
        pytest.skip("needs at least 4 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    best = None
    for _ in range(2):
        res = calibrate.measure_task_overhead(4, repeats=21)
        if best is None or res["max_abs_rel_residual"] < best["max_abs_rel_residual"]:
            best = res
        if best["max_abs_rel_residual"] < 0.5:
            break
    assert [p["bytes"] for p in best["points"]] == sorted(p["bytes"] for p in best["points"])
    assert best["task_overhead_s"] >= 0 and best["beta_s_per_byte"] > 0
    for p in best["points"]:
        assert p["fit_seconds"] == pytest.approx(best["fit_alpha_s"] + best["beta_s_per_byte"] * p["bytes"])
        assert abs(p["fit_seconds"] - p["seconds"]) <= 0.5 * p["seconds"], p
    # the fixed cost is the smallest task's time, not the fit's intercept (which noise can drive to 0)
    assert best["task_overhead_s"] == min(best["points"], key=lambda p: p["bytes"])["seconds"]
    assert best["points"][0]["seconds"] > best["call_s"]
    with pytest.raises(ValueError, match="two blocks of 2 devices"):
        calibrate.measure_task_overhead(3)


def test_task_overhead_only_keeps_the_profile_and_the_preset_reads_it(tmp_path, monkeypatch):
    if _devices() < 4:
        pytest.skip("needs at least 4 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    from autopar_lab import cluster as cl

    out = tmp_path / "cpu.json"
    before = json.loads(cl.CPU_PROFILE_PATH.read_text())
    before["num_devices"] = 4
    out.write_text(json.dumps(before))
    assert calibrate.main(["--task-overhead-only", "--quick", "--out", str(out)]) == 0
    after = json.loads(out.read_text())
    task = after["measurements"]["task_overhead"]
    # stored per device of the task: the measured task ran on a block of task["block"] devices
    assert after["device"]["task_overhead_s"] == pytest.approx(task["task_overhead_s"] / task["block"])
    assert after["device"]["task_overhead_s"] >= 0 and after["device"]["shares_cores"] is True
    for key in ("intra_host", "inter_host", "total_memory_bytes"):
        assert after[key] == before[key]
    assert {k: v for k, v in after["device"].items() if k != "task_overhead_s"} == \
        {k: v for k, v in before["device"].items() if k != "task_overhead_s"}
    monkeypatch.setattr(cl.cpuprofile, "CPU_PROFILE_PATH", out)  # where the cpu preset reads it
    c = cl.Cluster.preset("cpu")
    assert c.device.task_overhead_s == after["device"]["task_overhead_s"] and c.device.shares_cores
    # it survives the cluster's JSON form (plan files compare it)
    assert cl.Cluster.from_json(c.to_dict()) == c
    # a profile written before the figure existed means no per-task overhead
    del before["device"]["task_overhead_s"]
    out.write_text(json.dumps(before))
    assert cl.Cluster.preset("cpu").device.task_overhead_s == 0.0
    assert calibrate.main(["--task-overhead-only", "--out", str(tmp_path / "missing.json")]) == 2


def test_device_task_overhead_is_checked_and_optional():
    from autopar_lab.cluster import Cluster, Device

    d = Device("toy", {"float32": 1e12}, memory_bytes=1e9, memory_bandwidth=1e11)
    assert d.task_overhead_s == 0.0 and "task_overhead_s" not in d.to_dict()
    assert "task_overhead_s" not in Cluster.preset("p3.16xlarge").to_dict()["device"]
    with_it = Device("toy", {"float32": 1e12}, memory_bytes=1e9, memory_bandwidth=1e11, task_overhead_s=2e-3)
    assert with_it.to_dict()["task_overhead_s"] == 2e-3 and hash(with_it) != hash(d)
    for bad in (-1e-3, float("nan"), "fast"):
        with pytest.raises(ValueError, match="task_overhead_s must be a finite number of seconds >= 0"):
            Device("toy", {"float32": 1e12}, memory_bytes=1e9, memory_bandwidth=1e11, task_overhead_s=bad)


def test_shipped_profile_has_the_task_overhead_fit():
    from autopar_lab.cluster import CPU_PROFILE_PATH

    prof = json.loads(CPU_PROFILE_PATH.read_text())
    task = prof["measurements"]["task_overhead"]
    # per device of a task: the fitted task ran on a block of devices
    assert prof["device"]["task_overhead_s"] == pytest.approx(task["task_overhead_s"] / task["block"])
    assert task["task_overhead_s"] > 0 and prof["device"]["shares_cores"] is True
    for p in task["points"]:
        assert p["fit_seconds"] == pytest.approx(task["fit_alpha_s"] + task["beta_s_per_byte"] * p["bytes"])
    # the fixed cost is the smallest task's time (the fit's intercept swings with noise; measure_task_overhead)
    assert task["task_overhead_s"] == min(task["points"], key=lambda p: p["bytes"])["seconds"]


def test_planner_charges_the_task_overhead_once_per_task():
    """Each stage forward and each backward of a microbatch costs the device's task_overhead_s once, and the
    stage's update once a step (1/B of a task per backward); on virtual devices (JAX's CPU devices) times the
    stage's devices (each device's part of a program is launched on the shared cores; measured, bench/RESULTS.md).
    A rematerialised stage's backward (forward rerun inside it) is still one task. The vectorised candidates the
    stage DP uses carry the same numbers."""
    import dataclasses

    import autopar_lab as al
    from autopar_lab.cluster import Cluster
    from autopar_lab.planner import CostTable

    base = Cluster.preset("p3.16xlarge")  # 8 devices per host, no jax devices needed
    graph = al.models.get("gpt-tiny", batch_size=8, num_layers=2).trace()
    t = 1e-3
    table = CostTable(graph, base)
    B = 4
    for virtual in (False, True):
        # the same device with and without the overhead: a device sharing cores also holds the CPU backend's memory
        # terms (backends.cpu), which the overhead must not move
        without = base.with_(device=dataclasses.replace(base.device, shares_cores=virtual))
        with_overhead = base.with_(device=dataclasses.replace(base.device, task_overhead_s=t, shares_cores=virtual))
        for submesh, shape, devices in (((1, 2), (1, 2), 2), ((1, 8), (1, 8), 8)):
            factor = devices if virtual else 1
            table.cluster = without
            plain = [table.stage(0, 2, submesh, shape, B, r) for r in (False, True)]
            table.cluster = with_overhead
            charged = [table.stage(0, 2, submesh, shape, B, r) for r in (False, True)]
            for p, c in zip(plain, charged):
                assert c.fwd_s - p.fwd_s == pytest.approx(t * factor, rel=1e-9)
                assert c.bwd_s - p.bwd_s == pytest.approx(t * factor * (1 + 1 / B), rel=1e-9)
                assert (c.static_bytes, c.act_bytes) == (p.static_bytes, p.act_bytes)
            fast = table.candidate_fn(B)(0, 2, submesh)
            for c in fast:
                ref = table.stage(0, 2, submesh, c.logical_mesh, B, c.remat)
                assert (c.fwd_s, c.bwd_s) == (ref.fwd_s, ref.bwd_s)


def test_buffer_overhead_is_measured_per_state_array():
    if _devices() < 2:
        pytest.skip("needs at least 2 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    m = calibrate.measure_buffer_overhead(2, counts=(4, 64), repeats=5)
    assert m["buffer_s"] > 0 and [p["arrays"] for p in m["points"]] == [4, 64]
    # the fit goes through the two points (two unknowns, two measurements) unless noise tipped the intercept
    # below 0 (then it is 0 and the slope refitted)
    assert m["call_s"] >= 0
    if m["call_s"] > 0:
        for p in m["points"]:
            assert m["call_s"] + m["buffer_s"] * p["arrays"] == pytest.approx(p["seconds"], rel=1e-6)


def test_shipped_profile_has_the_buffer_overhead():
    from autopar_lab.cluster import CPU_PROFILE_PATH, Cluster

    prof = json.loads(CPU_PROFILE_PATH.read_text())
    buf = prof["measurements"]["buffer_overhead"]["buffer_s"]
    assert prof["device"]["efficiency"]["buffer_s"] == buf > 0
    assert Cluster.preset("cpu").device.efficiency.buffer_s == buf


def test_collectives_only_times_chains_and_refits_the_links(tmp_path, monkeypatch):
    """``--collectives-only``: the collectives are timed in chains (so the program call is not charged to the latency)
    and the links refitted from them; every other figure of the profile is kept, and the cpu preset reads the new
    links. Each row is one collective (the chains' difference), with the call left over beside it."""
    if _devices() < 2:
        pytest.skip("needs at least 2 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    from autopar_lab import cluster as cl

    out = tmp_path / "cpu.json"
    before = json.loads(cl.CPU_PROFILE_PATH.read_text())
    before["num_devices"] = 2
    out.write_text(json.dumps(before))
    assert calibrate.main(["--collectives-only", "--back-to-back", "--quick", "--out", str(out)]) == 0
    after = json.loads(out.read_text())
    rows = after["measurements"]["collectives"]
    assert {r["kind"] for r in rows} == {"all_reduce", "all_gather"} and all(r["chain"] == [1, 9] for r in rows)
    assert "back-to-back" in after["collectives_note"]
    assert all(r["seconds"] > 0 and r["call_s"] >= 0 for r in rows)
    fits = calibrate.fit_collectives(rows, 2)
    assert after["measurements"]["collective_fits"] == fits
    assert after["intra_host"] == {"bandwidth": fits["joint"]["bandwidth"], "latency": fits["joint"]["latency"]}
    assert after["device"] == before["device"] and after["total_memory_bytes"] == before["total_memory_bytes"]
    for key in ("task_overhead", "kernel_overhead", "buffer_overhead", "matmul_float32"):
        assert after["measurements"][key] == before["measurements"][key]
    monkeypatch.setattr(cl.cpuprofile, "CPU_PROFILE_PATH", out)  # where the cpu preset reads it
    assert cl.Cluster.preset("cpu").intra_host.latency == fits["joint"]["latency"]
    with pytest.raises(ValueError, match="chain must be two lengths"):
        measure_collectives(2, (1 << 12,), chain=(4, 4))
    assert calibrate.main(["--collectives-only", "--out", str(tmp_path / "missing.json")]) == 2


def test_collectives_between_compute_measure_each_collective_as_a_step_meets_it(tmp_path, monkeypatch):
    """The default ``--collectives-only``: each collective follows a layer-like compute on every device, timed against
    the same chain without collectives. A small chain on 8 devices (the barrier this measures needs more device
    threads than cores; on 2 devices the difference is within the noise): every row is one collective, a positive
    difference (not the floor the clamp gives a chain with collectives no slower than the one without), beside the
    compute a link costs alone; the links fitted from them round-trip through the profile file into the cpu
    preset, and every other figure is kept."""
    if _devices() < 8:
        pytest.skip("needs 8 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    from autopar_lab import cluster as cl

    n = 8
    rows = measure_collectives_between_compute(n, (1 << 12,), repeats=9, links=4, compute=(32, 32))
    assert [(r["kind"], r["bytes"]) for r in rows] == [("all_reduce", 1 << 12), ("all_gather", 1 << 12)]
    for r in rows:
        assert r["seconds"] > 1e-9 and r["compute_s"] > 0 and r["links"] == 4 and r["compute"] == [32, 32]
        assert r["x_bytes"] == pytest.approx((2 if r["kind"] == "all_reduce" else 1) * (n - 1) / n * r["bytes"])

    out = tmp_path / "cpu.json"
    before = json.loads(cl.CPU_PROFILE_PATH.read_text())
    before["num_devices"] = n
    out.write_text(json.dumps(before))
    assert calibrate.main(["--collectives-only", "--quick", "--out", str(out)]) == 0
    after = json.loads(out.read_text())
    measured = after["measurements"]["collectives"]
    assert {r["kind"] for r in measured} == {"all_reduce", "all_gather"}
    assert all(r["seconds"] > 0 and r["links"] >= 1 for r in measured)
    assert "after a layer-like compute" in after["collectives_note"]
    fits = calibrate.fit_collectives(measured, n)
    assert after["measurements"]["collective_fits"] == fits
    assert after["intra_host"] == {"bandwidth": fits["joint"]["bandwidth"], "latency": fits["joint"]["latency"]}
    assert after["device"] == before["device"]
    monkeypatch.setattr(cl.cpuprofile, "CPU_PROFILE_PATH", out)  # where the cpu preset reads it
    link = cl.Cluster.preset("cpu").intra_host
    assert (link.bandwidth, link.latency) == (fits["joint"]["bandwidth"], fits["joint"]["latency"])

    with pytest.raises(ValueError, match="links must be at least 1"):
        measure_collectives_between_compute(2, (1 << 12,), links=0)
    with pytest.raises(ValueError, match="compute must be"):
        measure_collectives_between_compute(2, (1 << 12,), compute=(0, 16))
    with pytest.raises(ValueError, match="collectives need"):
        measure_collectives_between_compute(1, (1 << 12,))
