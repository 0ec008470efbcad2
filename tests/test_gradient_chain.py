"""A backward program re-reads the gradient chain once per later layer (issue 14: the cost model at depth).

Measured on this machine (bench/RESULTS.md, 2026-12-04): gpt-tiny's step cost ~2x more per layer at 24 layers than at
4 with no communication, and only in the backward. XLA on CPU fuses the residual stream's gradient (a sum with one
term per later layer) into every kernel of each layer's backward that reads it instead of writing it once: at 24
layers 140 of the backward's fusions read 33 MB of operands (1.1 MB at 4 layers). The cost model charges it as
``Efficiency.chain_reads`` reads of each later layer's link per layer (:attr:`LayerCost.reread_s`), so a backward
program over layers a..b pays ``sum over k of (b - k) x reread_s[k]`` (:func:`autopar_lab.backends.cpu.chain_pairs`),
quadratic in the layers one program runs; the cpu profile measures ``chain_reads``
(:func:`autopar_lab.calibrate.measure_chain_reads`); the GPU presets charge none.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import autopar_lab as al
from autopar_lab import calibrate
from autopar_lab.cluster import CPU_PROFILE_PATH, Cluster, Efficiency
from autopar_lab.graph.fusion import is_chain_link
from autopar_lab.backends.cpu import chain_pair_bytes, chain_pairs, chain_read_s_per_byte, kernel_share
from autopar_lab.pricing.stage import prefix_sums, stage_cost


def _devices() -> int:
    import jax

    return len(jax.devices("cpu"))


def _with_reads(cluster: Cluster, reads: float) -> Cluster:
    dev = cluster.device
    return cluster.with_(device=dataclasses.replace(dev, efficiency=dataclasses.replace(dev.efficiency,
                                                                                          chain_reads=reads)))


def test_one_link_per_layer_and_the_pair_bytes_by_hand():
    """gpt-tiny's backward passes the residual stream's gradient from each block (and the head) to the layer before
    it through one add_any: one link per layer but the embedding, each a (batch, seq, hidden) float32 tensor; a
    program over all 6 layers re-reads (5 - k) links of layer k: 0 + 1 + 2 + 3 + 4 = 10 links."""
    model = al.models.get("gpt-tiny", batch_size=4, num_layers=4, hidden_size=32)
    g = model.trace()
    links = [n for n in g if is_chain_link(g, n)]
    assert sorted(n.layer for n in links) == sorted(["head", "layer_0", "layer_1", "layer_2", "layer_3"])
    cfg = model.config
    link = cfg.batch_size * cfg.seq_len * cfg.hidden_size * 4
    assert all(g.tensor(n.outputs[0]).nbytes == link for n in links)
    assert chain_pair_bytes(g, list(g.layers)) == 10 * link
    # no chain where nothing adds cotangents across layers: an MLP passes its gradient through matmuls
    mlp = al.models.get("mlp").trace()
    assert chain_pair_bytes(mlp, list(mlp.layers)) == 0.0


def test_layer_cost_and_stage_formula():
    """Each layer's reread_s is chain_reads x its link's bytes per device / achievable bandwidth; a stage's backward
    pays sum (b - k) reread_s[k] / B per microbatch more than without it, and splitting the layers in two stages
    pays less than one program over all (quadratic)."""
    model = al.models.get("gpt-tiny", batch_size=16, num_layers=4, hidden_size=32)
    cpu = Cluster.preset("cpu")
    assert cpu.device.efficiency.chain_reads > 0  # measured in the shipped profile
    plain = _with_reads(cpu, 0.0)
    reads = 40.0
    c = _with_reads(cpu, reads)
    dp = al.data_parallel_plan(model, c)
    costs = dp.stages[0].layer_costs
    names = list(dp.layer_names)
    cfg = model.config
    per_device = cfg.batch_size * cfg.seq_len * cfg.hidden_size * 4 / 8  # the batch split 8 ways
    unit = reads * per_device / c.device.achievable_bandwidth * kernel_share(c, 8)
    for name, lc in zip(names, costs):
        assert lc.reread_s == pytest.approx(0.0 if name == "embed" else unit, rel=1e-12)
    # the cost report's term is the formula over the stage's layers (one microbatch)
    L = len(names)
    assert dp.cost.cpu.chain_s == pytest.approx(sum((L - 1 - k) * lc.reread_s for k, lc in enumerate(costs)))
    assert dp.cost.cpu.chain_s == pytest.approx(10 * unit)
    base = al.data_parallel_plan(model, plain)
    assert base.cost.cpu.chain_s == 0.0
    assert dp.stages[0].bwd_s - base.stages[0].bwd_s == pytest.approx(10 * unit, rel=1e-9)
    assert "re-reading the gradient chain" in dp.cost.explain()
    assert "gradient chain" not in base.cost.explain()
    # stage_cost: the caller's rereads_s is paid by each microbatch's backward
    sums = prefix_sums(costs)
    for a, b, B in ((0, L - 1, 1), (1, 3, 2), (2, 2, 4), (0, 4, 2)):
        totals = {f: v[b + 1] - v[a] for f, v in sums.items()}
        want = sum((b - k) * costs[k].reread_s for k in range(a, b + 1))
        assert chain_pairs(sums, a, b) == pytest.approx(want, abs=1e-15)
        _, with_chain, _, _ = stage_cost({**totals, "rereads_s": want}, 0.0, B, 8, False, 0.0)
        _, without, _, _ = stage_cost(totals, 0.0, B, 8, False, 0.0)
        assert with_chain - without == pytest.approx(want / B)
    # vectorised (the stage DP's blocks) as scalar
    arr = {f: np.array(v, dtype=float) for f, v in sums.items()}
    rows, cols = np.arange(L), np.arange(L)
    many = chain_pairs(arr, rows[:, None], cols[None, :])
    for a in range(L):
        for b in range(a, L):
            assert many[a, b] == chain_pairs(sums, a, b)
    # two halves in two programs re-read less than one program over all
    assert chain_pairs(sums, 0, 2) + chain_pairs(sums, 3, L - 1) < chain_pairs(sums, 0, L - 1)


def test_gpu_presets_charge_no_chain():
    for preset in ("p3.16xlarge", "dgx-a100", "dgx-h100"):
        assert Cluster.preset(preset).device.efficiency.chain_reads == 0.0
    plan = al.data_parallel_plan(al.models.get("gpt-tiny"), Cluster.preset("dgx-a100"))
    assert plan.cost.cpu is None and all(lc.reread_s == 0.0 for lc in plan.stages[0].layer_costs)
    with pytest.raises(ValueError, match="chain_reads"):
        Efficiency(chain_reads=-1.0)
    with pytest.raises(ValueError, match="chain_reads"):
        Efficiency(chain_reads=float("nan"))


def test_deep_model_pays_the_chain_quadratically():
    """A 24-layer gpt-tiny planned on the cpu preset (on its 4-layer copy): the one-stage plan's backward re-reads
    sum over its 24 blocks of (24 - k) = 300 links, a 4-stage pipeline's busiest stage far fewer (it runs 6 blocks),
    and auto_plan beats the one program; the term is in explain() and to_dict()."""
    model = al.models.get("gpt-tiny", batch_size=16, num_layers=24, hidden_size=32)
    c = Cluster.preset("cpu")
    dp = al.data_parallel_plan(model, c)
    costs = dp.stages[0].layer_costs
    assert len(costs) == 26  # embed, 24 blocks, head
    link = costs[1].reread_s
    assert link > 0 and all(lc.reread_s == pytest.approx(link) for lc in costs[1:])
    assert dp.cost.cpu.chain_s == pytest.approx(300 * link)
    assert dp.cost.to_dict()["chain_s"] == dp.cost.cpu.chain_s
    pp = al.megatron_plan(model, c, dp=2, tp=1, pp=4, microbatches=4, table=dp.table)
    st = pp.stages[pp.cost.busiest_stage]
    a, b = st.layers
    own = st.layer_costs
    per_step = sum((b - k) * own[k].reread_s for k in range(a, b + 1))
    assert pp.cost.cpu.chain_s == pytest.approx(per_step)
    assert pp.cost.cpu.chain_s < dp.cost.cpu.chain_s / 4
    auto = al.auto_plan(model, c, table=dp.table)
    assert auto.cost.step_time_s <= dp.cost.step_time_s
    assert "gradient chain" in dp.cost.explain()


def test_cli_shows_the_chain_from_another_directory(tmp_path):
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8", "PATH": "/usr/bin:/bin"}
    args = [sys.executable, "-m", "autopar_lab", "plan", "gpt-tiny", "--layers", "24", "--batch", "16",
            "--cluster", "cpu", "--method", "data"]
    js = subprocess.run(args + ["--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert js.returncode == 0, js.stderr
    out = json.loads(js.stdout)
    assert out["chain_s"] > 0 and out["chain_s"] < out["compute_s"]
    text = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert text.returncode == 0 and "re-reading the gradient chain" in text.stdout


def test_measure_chain_reads_fits_its_own_points():
    """Small and fast (4 devices, 3 and 5 layers): each point's rest is what the kernel fit leaves, and chain_reads
    is the least-squares slope of the rests on the priced re-reads (0 when the rests are not positive)."""
    if _devices() < 4:
        pytest.skip("needs at least 4 JAX CPU devices (JAX_NUM_CPU_DEVICES=8)")
    fit = {"kernel_launch_s": 2e-6, "work_scale": 2.0, "model": "gpt-tiny",
           "rates": {"peak_flops": 1e10, "memory_bandwidth": 2e9}, "points": [{"devices": 4}]}
    out = calibrate.measure_chain_reads(fit, depths=(3, 5), repeats=3)
    rows = out["points"]
    assert [(r["layers"], r["devices"]) for r in rows] == [(3, 4), (5, 4)]
    assert rows[1]["chain_s"] > rows[0]["chain_s"] > 0
    for r in rows:
        assert r["rest_s"] == pytest.approx(r["seconds"] - r["call_s"] - 2e-6 * r["kernels"] - 2.0 * r["roofline_s"])
    u = np.array([r["chain_s"] * 2.0 for r in rows])
    rest = np.array([r["rest_s"] for r in rows])
    assert out["chain_reads"] == pytest.approx(max(float(u @ rest / (u @ u)), 0.0))
    with pytest.raises(ValueError, match="JAX_NUM_CPU_DEVICES"):
        calibrate.step_point("gpt-tiny", 1, 2, _devices() + 1, 1e10, 2e9, 1)


def test_update_chain_reads_keeps_the_rest_and_says_what_to_run(tmp_path):
    prof = json.loads(CPU_PROFILE_PATH.read_text())
    path = tmp_path / "cpu.json"
    bare = dict(prof, measurements={k: v for k, v in prof["measurements"].items() if k != "kernel_overhead"})
    path.write_text(json.dumps(bare))
    with pytest.raises(ValueError, match="--kernel-overhead-only"):
        calibrate.update_chain_reads(path)
    env = {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "autopar_lab.calibrate", "--chain-reads-only", "--out", str(path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--kernel-overhead-only" in r.stderr
    assert json.loads(path.read_text()) == bare  # nothing lost
    if _devices() < 8:
        return
    path.write_text(json.dumps(prof))
    out = calibrate.update_chain_reads(path, quick=True)
    assert [p["layers"] for p in out["measurements"]["chain_reads"]["points"]] == [6, 8]
    assert out["device"]["efficiency"]["chain_reads"] == out["measurements"]["chain_reads"]["chain_reads"]
    for key in ("kernel_launch_s", "buffer_s", "driver_share"):
        assert out["device"]["efficiency"][key] == prof["device"]["efficiency"][key]
    assert out["device"]["peak_flops"] == prof["device"]["peak_flops"]
    assert Cluster.from_profile(path).device.efficiency.chain_reads == out["device"]["efficiency"]["chain_reads"]


def test_the_ilp_prices_one_reread_of_each_link_at_its_sharding():
    """The intra-op ILP sees the chain (one later layer re-reads each link: backends.cpu.read_again_s): a link's
    strategy costs chain_read_s_per_byte x its bytes per device more than with chain_reads = 0, so a replicated link
    costs the mesh's size times a sharded one's; every other operator's costs are unchanged; a GPU preset adds none."""
    from autopar_lab.solve.intra import StrategyCache, build_problem

    g = al.models.get("gpt-tiny", batch_size=16, num_layers=4, hidden_size=32).trace()
    cpu = Cluster.preset("cpu")
    c, plain = _with_reads(cpu, 40.0), _with_reads(cpu, 0.0)
    mesh, mesh0 = c.logical_mesh((1, 4), (4, 1)), plain.logical_mesh((1, 4), (4, 1))
    assert chain_read_s_per_byte(mesh) == pytest.approx(40.0 / c.device.achievable_bandwidth * kernel_share(c, 4))
    with_chain = build_problem(g, mesh, cache=StrategyCache(mesh))
    without = build_problem(g, mesh0, cache=StrategyCache(mesh0))
    assert with_chain.nodes == without.nodes
    links = 0
    for k, op in enumerate(with_chain.nodes):
        node = g.op(op)
        added = with_chain.problem.node_costs[k] - without.problem.node_costs[k]
        if not is_chain_link(g, node):
            assert np.allclose(added, 0.0, atol=1e-15), node.primitive
            continue
        links += 1
        t = g.tensor(node.outputs[0])
        want = [chain_read_s_per_byte(mesh) * s.out_specs[0].bytes_per_device(
            t.shape, t.dtype, (4, 1)) for s in with_chain.strats[k]]
        assert np.allclose(added, want, rtol=1e-12)
        whole = [a for a, s in zip(added, with_chain.strats[k]) if not s.out_specs[0].axes]
        assert whole and max(whole) == pytest.approx(4 * min(added))
    assert links == 5
    gpu = Cluster.preset("dgx-a100").logical_mesh((1, 4), (4, 1))
    assert chain_read_s_per_byte(gpu) == 0.0


def test_deep_pipeline_keeps_the_chain_sharded():
    """gpt-tiny at 24 layers as the bench runs it: Megatron's pp=2 on 4x1 meshes used to replicate every link of the
    chain (the ILP did not see it: 53.6 ms of re-reads predicted, 12-layer stages each re-reading 66 links whole);
    with the chain in the ILP each link stays split over the batch, as the runtime's data parallelism keeps it, and
    the plan's predicted step drops with it."""
    model = al.models.get("gpt-tiny", batch_size=16, num_layers=24, hidden_size=32)
    cpu = Cluster.preset("cpu")
    pp2 = al.megatron_plan(model, cpu, dp=4, tp=1, pp=2, microbatches=2)
    g = pp2.op_graph
    for st in pp2.stages:
        links = [(g.tensor(g.op(op).outputs[0]), s.out_specs[0]) for op, s in st.intra.strategies.items()
                 if is_chain_link(g, g.op(op))]
        assert links and all(spec.bytes_per_device(t.shape, t.dtype, (4, 1)) * 4 == t.nbytes for t, spec in links)
    blind = al.megatron_plan(model, _with_reads(cpu, 0.0), dp=4, tp=1, pp=2, microbatches=2)
    assert pp2.cost.cpu.chain_s > 0 and blind.cost.cpu.chain_s == 0.0
    dp = al.data_parallel_plan(model, cpu, table=pp2.table)
    # per microbatch, a 12-layer stage on 4 devices re-reads 66 quarter-links: under dp's 276 eighth-links of one
    # program over all 26 layers
    assert pp2.cost.cpu.chain_s < dp.cost.cpu.chain_s
