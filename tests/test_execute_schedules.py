"""Interleaved and ZB-H1 plans executed on the 8 local CPU devices: the same losses as single-device training.

The pipeline runs the step's own jaxpr: an interleaved plan runs each model chunk as a stage of its own on its plan
stage's devices, a ZB-H1 plan runs each backward as its input-gradient task B and, later, its weight-gradient task
W, in the orders of :func:`autopar_lab.simulate.task_order`. Compiled with XLA's CPU optimisation off, as
test_execute.py does.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.runtime.partition import split_stages
from autopar_lab.simulate import task_order

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")

FAST = {"xla_backend_optimization_level": 0}
STEPS = 3


@pytest.fixture(scope="module")
def model():
    return al.models.get("gpt-tiny", batch_size=8, num_layers=4)  # embed, layer_0..3, head


@pytest.fixture(scope="module")
def plan(model):
    p = al.megatron_plan(model, al.Cluster.preset("cpu", hosts=1), dp=2, tp=2, pp=2, microbatches=4)
    assert [st.devices for st in p.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    return p


def _close(a, b, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=1e-7)


def _same_params(runner, reference):
    for a, b in zip(jax.tree_util.tree_leaves(runner.params), jax.tree_util.tree_leaves(reference[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=STEPS * 2e-3)


@pytest.mark.slow  # two plan stages' programs to compile, three steps: ~20 s of CPU
def test_interleaved_two_stages_two_chunks_trains_like_one_device(model, plan, reference):
    q = plan.with_schedule("interleaved", 2)
    runner = al.execute(q, model, compiler_options=FAST)
    sm = runner.staged
    # four chunks, two per plan stage, each on its stage's devices: embed+layer_0 | layer_1+layer_2 | layer_3 | head
    assert sm.num_stages == 4 and sm.device_stage == (0, 1, 0, 1)
    assert [d["layers"] for d in sm.describe()] == [["embed", "layer_0"], ["layer_1", "layer_2"],
                                                     ["layer_3", "layer_3"], ["head", "head"]]
    assert sm.mesh(2) is sm.mesh(0) and sm.mesh(3) is sm.mesh(1)
    assert sm.sources(2, "fwd") == [(1, "fwd")]  # layer_3 reads layer_2's output, from the other plan stage
    assert (0, "fwd") in sm.sources(3, "fwd")  # the head reads the tied embedding from the chunk that owns it
    losses = runner.train(STEPS)
    _close(losses, reference[0])
    _same_params(runner, reference)
    # the step ran every chunk's tasks in the interleaved order of each plan stage
    for d in range(2):
        ran = [(kind, c, j) for c, kind, j in runner.last_tasks if c % 2 == d]
        assert ran == task_order(d, 2, 4, "interleaved", virtual_stages=2)
    rows = runner.stage_times()
    assert [r["stage"] for r in rows] == [0, 1] and all(r["measured_fwd_s"] > 0 for r in rows)
    assert runner.report()["virtual_stages"] == 2


@pytest.mark.slow  # two plan stages' programs to compile, three steps: ~20 s of CPU
def test_zero_bubble_runs_weight_gradients_as_their_own_tasks(model, plan, reference):
    q = plan.with_schedule("zb-h1")
    runner = al.execute(q, model, compiler_options=FAST)
    sm = runner.staged
    assert sm.kinds == ("fwd", "bwd", "wgrad") and sm.num_stages == 2
    for k in range(2):
        b, w = set(sm.task_ops(k, "bwd")), set(sm.task_ops(k, "wgrad"))
        assert b and w and not b & w
        names = {q.graph.op(i).primitive for i in w}
        assert "dot_general" in names  # the weight-gradient matmuls
        assert not sm.exports(k, "wgrad") or all(  # W sends nothing another stage's forward or backward waits for
            (k, "wgrad") not in sm.sources(s, kd) for s in range(2) for kd in sm.kinds)
        # W reads what it needs from the stashes of its forward and its B
        assert set(sm.stash_readers(k, "fwd")) <= {"bwd", "wgrad"} and sm.stash_readers(k, "bwd") == ("wgrad",)
    assert sm.sources(0, "bwd") == [(1, "bwd")]
    losses = runner.train(STEPS)
    _close(losses, reference[0])
    _same_params(runner, reference)
    for d in range(2):
        assert [(kind, c, j) for c, kind, j in runner.last_tasks if c == d] == task_order(d, 2, 4, "zb-h1")
    row = runner.stage_times()[1]
    assert row["predicted_wgrad_s"] == q.stages[1].wgrad_s and row["measured_wgrad_s"] > 0
    # the same layout as the 1F1B plan, a different split: its own StagedModel
    assert split_stages(model, plan, compiler_options=FAST) is not sm


@pytest.mark.slow  # a rematerialised stage under ZB-H1: B recomputes the forward, W reads what B recomputed
def test_zero_bubble_with_a_rematerialised_stage(model, plan, reference):
    q = plan.with_remat(1).with_schedule("zb-h1")
    runner = al.execute(q, model, compiler_options=FAST)
    assert runner.staged.stash_readers(1, "bwd") == ("wgrad",)
    _close(runner.train(STEPS), reference[0])


@pytest.mark.slow  # builds two stage workers (trace, plan, compile) in this process
def test_stage_workers_run_zero_bubble_and_checkpoint(model, plan, reference, tmp_path, run_at_once):
    """The Ray driver's walk and the stage actors' contract, in one process, for a ZB-H1 plan: W tasks submitted
    as tasks of their own, the same losses as single-device training, and a restored worker goes on exactly."""
    from autopar_lab.runtime.actors import StageWorker
    from autopar_lab.runtime.train_entry import _Routes, _submit_step, job_spec, step_loss

    q = plan.with_schedule("zb-h1")
    spec = job_spec(q, model, STEPS, options=al.RunOptions(compiler_options=FAST))
    assert spec["plan"]["schedule"] == "zb-h1"
    workers = [StageWorker(spec, k) for k in range(2)]
    routes = _Routes([w.info() for w in workers])
    assert set(routes.sources) == {(k, kind) for k in range(2) for kind in ("fwd", "bwd", "wgrad")}
    losses = []
    for step in range(STEPS):
        if step == 2:
            for w in workers:
                w.save(str(tmp_path), 2)
            workers = [StageWorker(spec, k) for k in range(2)]
            for w in workers:
                w.restore(str(tmp_path), 2)
        rows = _submit_step([run_at_once(w) for w in workers], routes, step, 2, 4, "zb-h1")
        losses.append(step_loss(rows))
        assert all(r["wgrad_s"] > 0 and r["bwd_s"] > r["wgrad_s"] for r in rows)
    _close(losses, reference[0])


@pytest.mark.slow  # two stage actors on the shared embedded Ray (conftest's shared_ray)
def test_interleaved_plan_on_ray_trains_like_one_device(model, plan, reference, shared_ray, tmp_path):
    """Two actors, each running its plan stage's two chunks in the interleaved order the driver submits; a
    checkpoint holds each actor's chunks."""
    from autopar_lab.runtime.checkpoint import steps_of
    from autopar_lab.runtime.launch import launch

    q = plan.with_schedule("interleaved", 2)
    job = launch(q, model, STEPS, options=al.RunOptions(compiler_options=FAST, checkpoint_dir=tmp_path,
                                                        checkpoint_every=STEPS))
    result = job.wait(timeout=900)
    assert result["status"] == "done", result["message"]
    _close(result["losses"], reference[0])
    rows = job.stage_times()
    assert [r["stage"] for r in rows] == [0, 1] and all(r["measured_fwd_s"] > 0 for r in rows)
    assert steps_of(tmp_path, 0) == steps_of(tmp_path, 1) == [STEPS]
