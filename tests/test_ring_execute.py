"""Ring attention executed: the matmuls a plan marks ``[ring@a]`` run as rings of shard_map + ppermute steps (in the
one-stage replay, in pipeline stages, in the stage workers Ray runs, in the exported script), and training equals
single-device training."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar_lab as al
import autopar_lab.sharding.ring as sharding_ring
from autopar_lab.export import ring_matmuls, to_jax_code
from autopar_lab.parallelism import context_parallel, summary
from autopar_lab.runtime.ring import ring_binds, ring_dot_general, usable_layout
from autopar_lab.sharding.ring import RING_MIN_SEQ, is_ring
from autopar_lab.sharding.strategies import _VALID
from reference import one_device_training, scanned

FAST = {"xla_backend_optimization_level": 0}
STEPS = 3
# The sequence of the model the in-process tests plan and train, with ring strategies offered from it on (the
# short_rings fixture): the rings' numerics do not depend on the length, and at RING_MIN_SEQ (4096) attention's
# scores made each step ~25 times dearer (3 one-device steps 12.9 CPU-s against 0.46 at 512, compiles alike). The
# planner still chooses the rings at 512 (the tests below check it). The CLI and Ray tests, in processes of their own
# that keep the library's threshold, plan at RING_MIN_SEQ.
SEQ = 512


def _auto_mesh(shape):
    return jax.make_mesh(shape, ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:shape[0] * shape[1]])


# Attention's matmuls as gpt's einsums trace them: (lhs, rhs shapes, dimension numbers, lhs spec, rhs spec, out spec,
# rotated operand); "E" marks the dimension the other mesh axis splits (the batch), where the case uses it.
QK = (((3,), (3,)), ((0, 2), (0, 2)))  # bqhd,bkhd->bhqk: the rotated K's sequence is free (fills columns)
PV = (((1,), (3,)), ((0, 2), (0, 1)))  # V bkhd, P bhqk -> bhdq: the rotated V's sequence is contracted (sums)
CASES = [
    ((4, 16, 2, 8), (4, 16, 2, 8), QK, P(None, "y"), P(None, "y"), P(None, None, "y", None), 1),
    ((4, 16, 2, 8), (4, 16, 2, 8), QK, P("x", "y"), P("x", "y"), P("x", None, "y", None), 1),
    ((4, 16, 2, 8), (4, 16, 2, 8), QK, P(None, "y"), P(None, "y"), P(None, None, None, "y"), 0),
    ((4, 16, 2, 8), (4, 2, 16, 16), PV, P(None, "y"), P(None, None, "y"), P(None, None, None, "y"), 0),
    ((4, 16, 2, 8), (4, 2, 16, 16), PV, P("x", "y"), P("x", None, "y"), P("x", None, None, "y"), 0),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_ring_dot_general_equals_dot_general_and_its_gradient(case):
    ls, rs, dn, lsp, rsp, osp, rotate = CASES[case]
    mesh = _auto_mesh((2, 4))
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(case), 3)
    lhs, rhs = jax.random.normal(k1, ls), jax.random.normal(k2, rs)
    ref = jax.lax.dot_general(lhs, rhs, dn)
    ring = jax.jit(lambda a, b: ring_dot_general(a, b, dimension_numbers=dn, mesh=mesh, in_specs=(lsp, rsp),
                                                  out_spec=osp, axis="y", rotate=rotate))
    out = ring(lhs, rhs)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # each device ends with its block of the result
    assert out.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, osp), out.ndim)
    assert "collective-permute" in ring.lower(lhs, rhs).compile().as_text()  # a ring, not a gather
    w = jax.random.normal(k3, ref.shape)
    # Each gradient one jitted program: taken eagerly, every primitive of the backward compiled on its own.
    got = jax.jit(jax.grad(lambda a, b: jnp.sum(ring(a, b) * w), (0, 1)))(lhs, rhs)
    want = jax.jit(jax.grad(lambda a, b: jnp.sum(jax.lax.dot_general(a, b, dn) * w), (0, 1)))(lhs, rhs)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def short_rings():
    """Ring strategies from SEQ tokens on, for this module's tests. The memo of each rule's valid strategies (per
    operator signature, process-wide) is emptied before and after: it would otherwise keep what was enumerated under
    the other threshold, here or in a later test of this process."""
    patch = pytest.MonkeyPatch()
    patch.setattr(sharding_ring, "RING_MIN_SEQ", SEQ)
    _VALID.clear()
    yield
    patch.undo()
    _VALID.clear()


def _long_gpt(seq: int):
    """gpt-tiny with a sequence of ``seq`` tokens, small everywhere else."""
    return al.models.get("gpt-tiny", num_layers=2, seq_len=seq, batch_size=2, num_heads=2, hidden_size=32,
                         vocab_size=64, dtype="float32")


@pytest.fixture(scope="module")
def model(short_rings):
    """gpt-tiny with a sequence long enough for ring strategies (SEQ, see short_rings), small everywhere else."""
    return _long_gpt(SEQ)


@pytest.fixture(scope="module")
def cpu():
    return al.Cluster.preset("cpu")


@pytest.fixture(scope="module")
def ring_plan(model, cpu):
    plan = al.auto_plan(model, cpu, microbatches=1)
    assert len(plan.stages) == 1 and plan.stages[0].submesh == (1, 8)
    return plan


def _ring_ops(plan) -> set[int]:
    return {r.op for rings in context_parallel(plan).values() for r in rings}


def test_the_plan_marks_attention_matmuls_ring_and_says_so(ring_plan):
    g = ring_plan.graph
    rings = context_parallel(ring_plan)[0]
    # QK^T and PV of each of the two layers, forward, and their four gradients' ring forms
    assert {r.role for r in rings} == {"forward", "backward"} and len(rings) == 8
    # One mesh axis carries every ring (which one the ILP picks follows the calibrated link), with devices along it.
    axes = {r.axes for r in rings}
    assert len(axes) == 1 and len(next(iter(axes))) == 1
    axis = next(iter(axes))[0]
    assert ring_plan.stages[0].logical_mesh[axis] > 1
    assert all(g.op(r.op).primitive == "dot_general" for r in rings)
    assert f"stage 0: context parallel (ring) over {'xy'[axis]} in 8 attention matmul(s)" in summary(ring_plan)


def test_a_ring_plan_trains_like_one_device(model, ring_plan, reference):
    runner = al.execute(ring_plan, model, compiler_options=FAST)
    assert runner.mode == "spmd" and set(runner.ring_ops) == _ring_ops(ring_plan)
    np.testing.assert_allclose(runner.train(STEPS), reference[0], rtol=1e-5, atol=1e-7)


def test_the_replay_runs_rings_only_where_marked(model, ring_plan):
    """The replay with the ring binds compiles collective-permutes (the ring's steps) and computes the single
    device's step; without them it has none (XLA's own algorithm for the same layouts gathers instead)."""
    from autopar_lab.validate import ReplayOptions, specs_from_strategies, validate_model

    st = ring_plan.stages[0]
    mesh = _auto_mesh(st.logical_mesh)
    out_specs, output_specs = specs_from_strategies(ring_plan.graph, st.intra.strategies)
    binds = ring_binds(ring_plan.graph, st.intra.strategies, mesh)
    assert set(binds) == _ring_ops(ring_plan)

    def validate(binds, run):
        return validate_model(model, out_specs, mesh, None, graph=ring_plan.graph, run=run,
                              replay=ReplayOptions(output_specs=output_specs, binds=binds))

    ring = validate(binds, True)
    assert ring["compiled"]["collective_permute"]["count"] >= len(binds)
    assert ring["numerics_max_abs_err"] < 1e-4
    assert validate({}, False)["compiled"]["collective_permute"]["count"] == 0


def test_a_ring_layout_that_does_not_divide_falls_back(ring_plan):
    g = ring_plan.graph
    op = min(_ring_ops(ring_plan))
    s = ring_plan.stages[0].intra.strategies[op]
    node = g.op(op)
    mesh = ring_plan.stages[0].logical_mesh
    axis = next(r.axes[0] for rings in context_parallel(ring_plan).values() for r in rings if r.op == op)
    assert usable_layout(s, node.in_shapes, node.out_shapes[0], mesh)
    odd = [tuple(d if i != 1 else 4097 for i, d in enumerate(sh)) for sh in node.in_shapes]  # odd: no ring divides it
    assert not usable_layout(s, odd, node.out_shapes[0], mesh)
    flat = (1, 8) if axis == 0 else (8, 1)
    assert not usable_layout(s, node.in_shapes, node.out_shapes[0], flat)  # one device along the ring axis


def test_a_two_stage_pipeline_with_rings_trains_like_one_device(model, ring_plan, reference, run_at_once):
    from autopar_lab.runtime.actors import StageWorker
    from autopar_lab.runtime.train_entry import _Routes, _submit_step, job_spec, step_loss

    plan = ring_plan.with_stages(boundaries=[2], submeshes=[(1, 4), (1, 4)])
    assert len(plan.stages) == 2 and all(context_parallel(plan)[k] for k in (0, 1))
    runner = al.execute(plan, model, compiler_options=FAST)
    assert runner.mode == "pipeline"
    ran = {k: set(runner.staged.ring_ops(k)) for k in (0, 1)}
    assert all(ran.values()) and ran[0] | ran[1] == _ring_ops(plan)
    losses = runner.train(STEPS)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5, atol=1e-7)
    # the stage workers Ray runs cut the step the same way (here behind Ray's call syntax, without Ray)
    job = job_spec(plan, model, STEPS, options=al.RunOptions(compiler_options=FAST))
    workers = [StageWorker(job, k) for k in range(2)]
    assert all(w.staged.ring_ops(k) for k, w in enumerate(workers))
    routes = _Routes([w.info() for w in workers])
    got = [step_loss(_submit_step([run_at_once(w) for w in workers], routes, i, 2, 1, plan.schedule))
           for i in range(STEPS)]
    np.testing.assert_allclose(got, losses, rtol=1e-6)


def test_the_exported_script_runs_the_ring(ring_plan):
    code = to_jax_code(ring_plan)
    rings = ring_matmuls(ring_plan)
    assert len(rings) == 4 and "def ring_dot_general(" in code and "def ring_dot(" in code
    ns: dict = {}
    exec(compile(code, "<exported plan>", "exec"), ns)  # noqa: S102 - the code under test
    assert set(ns["ring_matmuls"]) == set(rings)
    for key, (_s, rotate, dn) in rings.items():
        entry = ns["ring_matmuls"][key]
        assert entry["rotate"] == rotate and entry["dimension_numbers"] == dn
        g = ring_plan.graph
        op = next(o for o in g.ops if g.op(o).role == "forward" and is_ring(ring_plan.stages[0].intra.strategies.get(o))
                  and tuple(g.op(o).out_shapes[0]) == tuple(int(x) for x in key.rsplit("(", 1)[1][:-1].split(",")))
        # the same matmul at a shorter sequence (the layout needs only divisibility): the script's ring equals it
        shapes = [tuple(64 if d == SEQ else d for d in sh) for sh in g.op(op).in_shapes]
        a, b = (jax.random.normal(jax.random.PRNGKey(i), sh) for i, sh in enumerate(shapes))
        np.testing.assert_allclose(jax.jit(lambda x, y, k=key: ns["ring_dot"](k, x, y))(a, b),
                                   jax.lax.dot_general(a, b, dn), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_24_layer_model_two_stages_with_rings_trains_like_one_device(cpu, monkeypatch):
    """A deep model planned on a shallower copy: every layer's ring-marked matmuls run as rings on their stage. The
    ring threshold is lowered so that a short sequence (a CPU-sized test) has ring strategies to pin; the rings'
    numerics do not depend on it."""
    import autopar_lab.sharding.ring as sharding_ring
    from autopar_lab.operators import user_op

    monkeypatch.setattr(sharding_ring, "RING_MIN_SEQ", 64)
    deep = al.models.get("gpt-tiny", num_layers=24, seq_len=64, batch_size=4, num_heads=2, hidden_size=32,
                         vocab_size=64, dtype="float32")
    # Both stages on the same (1, 4) view, so a ring strategy chosen for a layer exists on either stage: the ILP's own
    # choices on that one mesh (a stage of embed + 12 layers, then 12 layers + head), where auto_plan solved every
    # mesh of the cluster (~19 s of the test) for a plan whose stages were then replaced by these.
    plan = al.megatron_plan(deep, cpu, dp=1, tp=4, pp=2, microbatches=2, sharding="ilp")
    assert [st.layers for st in plan.stages] == [(0, 12), (13, 25)]
    assert all(st.submesh == st.logical_mesh == (1, 4) for st in plan.stages)
    assert plan.table.solve_graph is not plan.graph  # planned on a shallower copy
    g, table = plan.op_graph, plan.table
    cache = table.strategy_cache(plan.stages[0].intra.mesh)
    for op in g.ops:
        node = g.op(op)
        if node.primitive != "dot_general" or node.layer is None or not node.layer.startswith("layer_"):
            continue
        rings = [s for s in cache.strategies(node) if is_ring(s)]
        if rings:  # pinned by plan.graph's id of the operator (the shallow copy's op stands in for its layers)
            plan = plan.with_choice(user_op(plan, op), min(rings, key=lambda s: s.cost).name)
    runner = al.execute(plan, deep, compiler_options=FAST)
    ran = {k: set(runner.staged.ring_ops(k)) for k in (0, 1)}
    full = plan.graph
    per_layer = {full.op(op).layer for ops in ran.values() for op in ops}
    assert per_layer == {f"layer_{i}" for i in range(24)}  # every layer's attention, on both stages
    losses = runner.train(2)
    ref, _ = one_device_training(scanned(deep), 2, compiler_options=FAST)  # the same model, compiled once a layer
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=1e-7)


def test_the_cli_plans_a_long_sequence_gpt_with_rings(tmp_path):
    """`autopar-lab plan` from another directory: --seq-len / --heads make the long-sequence model, the summary names
    the ring, and --seq-len on a model without attention is one sentence, exit 2."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8",
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(al.__file__)))}
    base = [sys.executable, "-m", "autopar_lab", "plan"]
    out = subprocess.run(base + ["gpt-tiny", "--seq-len", str(RING_MIN_SEQ), "--heads", "2", "--layers", "2",
                                 "--batch", "2", "--cluster", "cpu", "--microbatches", "1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"context parallel \(ring\) over [xy] in 8 attention matmul\(s\)", out.stdout), out.stdout
    bad = subprocess.run(base + ["mlp", "--seq-len", "4096", "--cluster", "cpu"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--seq-len" in bad.stderr


@pytest.mark.slow
def test_the_two_stage_ring_pipeline_trains_on_ray(cpu, shared_ray_head):
    """A 2-stage ring plan on the embedded Ray (each stage an actor process running its rings): the head conftest's
    shared_ray starts for the Ray group's tests, in whose xdist group this test runs. The actors find the plan's
    strategies by name under the library's threshold, so this model's sequence is RING_MIN_SEQ."""
    model = _long_gpt(RING_MIN_SEQ)
    plan = al.auto_plan(model, cpu, microbatches=1).with_stages(boundaries=[2], submeshes=[(1, 4), (1, 4)])
    assert all(context_parallel(plan)[k] for k in (0, 1))
    try:
        shared_ray_head.start()
    except RuntimeError as e:  # an embedded head that cannot start (a loaded machine) says so; not a ring question
        pytest.skip(f"Ray could not start here: {e}")
    job = al.launch(plan, model, 2, options=al.RunOptions(compiler_options=FAST))
    result = job.wait(timeout=1200)
    assert result["status"] == "done"
    ref, _ = one_device_training(model, 2, compiler_options=FAST, device=jax.devices()[0])
    np.testing.assert_allclose(result["losses"], ref, rtol=1e-5, atol=1e-7)
