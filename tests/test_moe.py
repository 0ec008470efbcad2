"""Expert parallelism (MoE): the experts split over a mesh axis, the token all-to-alls priced by the formula and
found in XLA's partitioned HLO, named in plans (EP=n), chosen where it pays, overridable, executed and exported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.models import moe
from autopar_lab.overrides import with_expert_parallel
from autopar_lab.parallelism import expert_degree, expert_parallel, op_notes, summary
from autopar_lab.sharding.experts import expert_layers, expert_matmuls
from autopar_lab.solve.intra import solve_intra
from autopar_lab.validate import (collective_instructions, operand_specs_from_strategies, replay_with_shardings,
                                  specs_from_strategies)

# The cpu preset's link is re-measured on each machine (autopar_lab/profiles/cpu.json), and how many all-to-alls
# the ILP's best solution holds depends on it (at 7 us a step it also reshards one more activation by all-to-all):
# these tests pin the link the expectations below were worked out for (0.84 GB/s, 70 us a step).
CPU8 = al.Cluster.preset("cpu", hosts=1).with_(devices_per_host=8, intra_host=al.Link(843551402.6727079, 6.972e-05),
                                                inter_host=al.Link(843551402.6727079, 6.972e-05))
P3 = al.Cluster.preset("p3.16xlarge", hosts=1)
FAST = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="module")
def small():
    """8 experts, 8 groups of 64 tokens: the token groups split over 8 devices as evenly as the experts."""
    return al.models.get("moe-tiny", batch_size=8, seq_len=64, hidden_size=256, num_layers=2, num_heads=4,
                         vocab_size=512, num_experts=8, expert_group_size=64)


@pytest.fixture(scope="module")
def small_intra(small):
    g = small.trace()
    mesh = CPU8.logical_mesh((1, 8), (8, 1))
    return g, mesh, solve_intra(g, mesh)


def test_the_expert_matmuls_are_found_and_only_they():
    spec = al.models.get("moe-tiny", num_layers=4)
    g = spec.trace()
    mm = expert_matmuls(g)
    # two MoE layers (1 and 3), each with two expert matmuls (w1 and w2), batched over the expert dimension 0
    assert sorted({g.op(op).layer for op in mm}) == ["layer_1", "layer_3"]
    assert len(mm) == 4
    for op, (j, d, p) in mm.items():
        assert g.tensor(g.op(p).outputs[0]).path.endswith(("['experts']['w1']", "['experts']['w2']"))
        assert g.op(op).in_shapes[j][d] == spec.config.num_experts
    dense = al.models.get("gpt-tiny", num_layers=2).trace()
    assert expert_matmuls(dense) == {}  # attention's batched matmuls are over activations, not weights


def test_the_token_all_to_alls_are_priced_by_the_formula(small, small_intra):
    g, mesh, intra = small_intra
    c = small.config
    (layer,) = expert_layers(g, intra.strategies, mesh)
    # the ILP splits the 8 experts over the 8 devices (the experts' weights, their gradients and Adam state 1/8 each)
    assert layer.layer == "layer_1" and layer.axes == (0,) and layer.degree == 8 and layer.num_experts == 8
    # dispatch and combine, in forward and backward: four all-to-alls of B = capacity_factor x tokens x hidden x bytes
    B = c.capacity_factor * c.batch_size * c.seq_len * c.hidden_size * 4
    assert B == moe.capacity(c) * c.num_experts * (c.batch_size * c.seq_len // moe.group_size(c)) * c.hidden_size * 4
    assert layer.all_to_alls == (("all_to_all", 0, B),) * 4
    # each device keeps 1/n of its 1/n and sends the rest: (n - 1) / n^2 B over the axis' link, one message per peer
    n, link = 8, mesh.axis_link(0)
    one = (n - 1) * CPU8.intra_host.latency + (n - 1) / n**2 * B / link.bandwidth
    assert layer.all_to_all_s == pytest.approx(4 * one, rel=1e-12)
    # ... and the same seconds are in the plan's resharding total (every all-to-all of the ILP's solution)
    assert intra.collectives["all_to_all"]["bytes"] >= 4 * B


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
def test_xla_compiles_the_predicted_expert_all_to_alls(small, small_intra):
    g, mesh, intra = small_intra
    (layer,) = expert_layers(g, intra.strategies, mesh)
    out_specs, output_specs = specs_from_strategies(g, intra.strategies)
    replay = replay_with_shardings(g, small.step_fn, small.abstract_args, out_specs,
                                   mesh.to_jax_mesh(jax.devices()[:8]), output_specs=output_specs,
                                   operand_specs=operand_specs_from_strategies(g, intra.strategies))
    hlo = replay.jit().lower(*small.abstract_args).compile().as_text()
    a2a = [c for c in collective_instructions(hlo) if c["kind"] == "all_to_all"]
    # XLA's all-to-all names the per-device buffer, B / n: the four token exchanges are there, over all 8 devices
    per_device = layer.all_to_alls[0][2] / 8
    moved = [c for c in a2a if c["bytes"] == per_device]
    assert len(moved) == 4, [(c["shape"], c["bytes"]) for c in a2a]
    assert all(c["group_size"] == 8 for c in moved)


@pytest.fixture(scope="module")
def ep_plan():
    """moe-10b's layers (32 experts, hidden 1536) on one 8-GPU host: two layers, one MoE; 128 microbatches (fits)."""
    model = al.models.get("moe-10b", num_layers=2)
    plan = al.data_parallel_plan(model, P3, microbatches=128)
    assert plan.cost.fits
    return model, plan


def test_a_plan_names_expert_parallelism_and_its_all_to_alls(ep_plan):
    model, plan = ep_plan
    c = model.config
    assert expert_degree(plan) == 8
    (layer,) = expert_parallel(plan)[0]
    assert layer.axes == (0,) and layer.num_experts == 32
    B = c.capacity_factor * c.batch_size * c.seq_len * c.hidden_size * 2  # float16 tokens
    assert [b for _k, _a, b in layer.all_to_alls] == [B] * 4
    (line,) = [s for s in summary(plan) if "expert" in s]
    assert "EP=8 over x" in line and f"{4 * B / 2**20:.4g} MiB" in line
    notes = op_notes(plan)
    assert all(notes[op].startswith("expert parallel EP=8: 32 experts split over x (4 per device); 4 all-to-alls")
               for op in layer.ops)
    code = plan.to_jax_code()
    assert "# Expert parallel EP=8 over x: the experts of 1 MoE layer(s)" in code
    assert "\"args[0]['layers'][1]['experts']['w1']\": P('x', None, None)," in code


def _replicated_experts(plan, op):
    """The cheapest alternative of expert matmul ``op`` that keeps every expert on every device."""
    g = plan.op_graph
    j, d, _p = expert_matmuls(g)[op]
    table = plan.stages[0].intra
    for alt in plan.alternatives(op):
        s = next(s for s in _strategies(plan, op) if s.name == alt.strategy)
        if not s.in_specs[j].dims[d]:
            return alt
    raise AssertionError(f"no replicated-experts strategy for {g.op(op).describe()} on {table.mesh.shape}")


def _strategies(plan, op):
    from autopar_lab.overrides import table_of

    return table_of(plan).strategy_cache(plan.stages[0].intra.mesh).strategies(plan.op_graph.op(op))


@pytest.mark.slow
def test_pinning_replicated_experts_costs_what_the_alternatives_predict(ep_plan):
    model, plan = ep_plan
    (layer,) = expert_parallel(plan)[0]
    op = layer.ops[0]
    alt = _replicated_experts(plan, op)
    assert alt.delta_s > 0  # expert parallelism pays here: the ILP's choice is the cheaper one
    pinned = plan.with_choice(op, alt.strategy)
    assert pinned.cost.step_time_s - plan.cost.step_time_s == pytest.approx(alt.delta_s, rel=1e-9)
    assert op in pinned.pins
    # re-solving around the pin keeps the experts replicated where pinned, and cannot beat the free plan
    resolved = al.resolve(pinned)
    assert resolved.cost.step_time_s >= plan.cost.step_time_s * (1 - 1e-9)


@pytest.mark.slow
def test_replicated_experts_override_costs_more_and_ep_comes_back(ep_plan):
    model, plan = ep_plan
    (layer,) = expert_parallel(plan)[0]
    rep = with_expert_parallel(plan, ())  # pinned, the rest of the stage re-solved around the pins
    assert expert_degree(rep) == 1 and set(rep.pins) == set(layer.ops)
    assert [(s.layers, s.logical_mesh) for s in rep.stages] == [(s.layers, s.logical_mesh) for s in plan.stages]
    assert any("experts replicated (EP=1)" in s for s in summary(rep))
    # The ILP's EP=8 was the cheaper by its own objective (a step's compute, collectives and resharding) ...
    assert rep.stages[0].intra.total_s > plan.stages[0].intra.total_s
    # ... which sees neither overlap nor the microbatch count: the step model hides the replicated experts' gradient
    # all-reduce behind the backward and charges EP's all-to-alls their latency in each of the 128 microbatches.
    assert rep.cost.hidden_comm_s > plan.cost.hidden_comm_s
    assert rep.cost.collective_latency_s < plan.cost.collective_latency_s
    assert rep.cost.step_time_s != pytest.approx(plan.cost.step_time_s, rel=1e-6)  # re-estimated, not copied
    (r,) = expert_parallel(rep)[0]
    assert r.all_to_alls == ()  # no tokens move to experts: every device runs all 32 on its own tokens
    back = with_expert_parallel(rep, (0,))
    assert expert_degree(back) == 8 and back.cost.step_time_s == pytest.approx(plan.cost.step_time_s, rel=1e-6)
    half = with_expert_parallel(plan, (), resolve=False)  # only the expert matmuls changed: tokens go back and forth
    assert expert_degree(half) == 1 and half.cost.step_time_s > rep.cost.step_time_s
    with pytest.raises(ValueError, match="axes must be"):
        with_expert_parallel(plan, (2,))
    with pytest.raises(ValueError, match="no MoE layer"):
        with_expert_parallel(al.data_parallel_plan(al.models.get("gpt-tiny", num_layers=1), CPU8), ())


@pytest.mark.slow
def test_the_deep_moe_auto_plan_uses_expert_parallelism():
    """moe-10b (16 layers, 32 experts) on two 8-GPU hosts, planned on its shallow copy: Alpa's MoE row."""
    model = al.models.get("moe-10b")
    assert model.config.num_layers >= 16
    plan = al.auto_plan(model, al.Cluster.preset("p3.16xlarge", hosts=2))
    assert expert_degree(plan) == 8
    layers = [e for ls in expert_parallel(plan).values() for e in ls]
    assert layers and all(e.degree == 8 for e in layers)
    assert any("EP=8" in s for s in summary(plan))


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
def test_an_expert_parallel_plan_trains_like_one_device(small):
    plan = al.data_parallel_plan(small, CPU8)
    g = plan.op_graph
    for op in g.ops:  # the CPU preset's latencies alone keep so small a step replicated: split the batch
        if g.op(op).primitive == "parameter" and g.tensor(g.op(op).outputs[0]).kind == "batch":
            plan = plan.with_choice(op, "S0R")
    assert expert_degree(plan) == 8
    single = al.execute(al.data_parallel_plan(small, al.Cluster.preset("cpu", hosts=1).with_(devices_per_host=1)),
                        small, compiler_options=FAST).train(3)
    runner = al.execute(plan, small, compiler_options=FAST)
    np.testing.assert_allclose(runner.train(3), single, rtol=1e-5, atol=1e-6)
    w1 = runner.params["layers"][1]["experts"]["w1"]
    assert w1.sharding.spec[0] == "x" and w1.addressable_shards[0].data.shape[0] == 1  # one expert per device
    # the exported code builds the same mesh and stores the experts split; run it
    code = plan.to_jax_code()
    assert "Expert parallel EP=8 over x" in code
    env: dict = {}
    exec(compile(code, "exported.py", "exec"), env)
    assert env["param_specs"]["args[0]['layers'][1]['experts']['w1']"] == jax.sharding.PartitionSpec("x", None, None)
    shardings = env["in_shardings_for"](*small.abstract_args)
    step = jax.jit(small.step_fn, in_shardings=shardings)
    args = jax.device_put(small.init(0), shardings)
    out = step(*args)
    assert out[0]["layers"][1]["experts"]["w1"].sharding.spec[0] == "x"


@pytest.mark.slow
def test_the_cli_shows_expert_parallelism(tmp_path):
    """As a user runs it: `autopar-lab plan` from another directory says EP=8 and the all-to-alls' bytes."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    cmd = [sys.executable, "-m", "autopar_lab.cli", "plan", "moe-10b", "--layers", "2", "--cluster",
           "p3.16xlarge:1", "--method", "data"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "stage 0: expert parallel EP=8 over x in 1 of 1 MoE layer(s)" in out.stdout
    js = subprocess.run(cmd + ["--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    rep = json.loads(js.stdout)
    assert rep["expert_parallel"] == 8 and any("EP=8" in s for s in rep["parallelism"])


def test_the_sharding_table_labels_the_expert_matmuls(ep_plan):
    from autopar_lab.widgets.session import Session
    from autopar_lab.widgets.views.sharding_table import op_rows, row_label

    model, plan = ep_plan
    (layer,) = expert_parallel(plan)[0]
    rows = {r["op"]: r for r in op_rows(Session(plan, model=model), primitive="dot_general")}
    for op in layer.ops:
        assert rows[op]["note"].startswith("expert parallel EP=8")
        assert "EP=8" in row_label(rows[op])
    assert not any("expert" in (r["note"] or "") for op, r in rows.items() if op not in layer.ops)
