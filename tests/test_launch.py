"""Training on Ray: embedded local cluster, stage actors, progress, cancel, kill-and-resume, errors, CLI.

The Ray tests (marked slow: Ray's start and each job's actor start dominate) share one embedded Ray, conftest's
shared_ray (token auth with a throwaway token, loopback only), with the Ray tests of test_execute_schedules,
test_ring_execute and test_readme, and one 2-stage plan of a small GPT on 8 CPU devices (2 actors x 4 devices); their
losses are checked against the single-process execution of the same plan (:func:`autopar_lab.runtime.local.execute`).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.runtime.progress import ProgressChannel, ProgressEvent, format_event, parse_event

OPTS = {"xla_backend_optimization_level": 0}  # compiles several times faster on CPU; same numbers in both runs
STEPS = 4


@pytest.fixture(scope="module")
def setup():
    model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)
    plan = al.megatron_plan(model, al.Cluster.preset("cpu"), dp=2, tp=2, pp=2, microbatches=2)
    return model, plan


# ------------------------------------------------------------------------------------------- no Ray needed

def test_progress_channel_replays_truncates_on_restart_and_cancels():
    ch = ProgressChannel()
    ch.publish(ProgressEvent(kind="step", step=1, loss=3.0))
    seen = []
    unsub = ch.subscribe(seen.append)  # replays the past event
    for i, loss in [(2, 2.0), (3, 1.0)]:
        ch.publish(ProgressEvent(kind="step", step=i, loss=loss))
    ch.publish(ProgressEvent(kind="restart", step=2))  # back to the checkpoint after step 2
    ch.publish(ProgressEvent(kind="step", step=3, loss=1.5))
    assert [e.step for e in seen] == [1, 2, 3, 2, 3]
    assert ch.losses == [3.0, 2.0, 1.5]
    unsub()
    ch.publish(ProgressEvent(kind="step", step=4, loss=1.0))
    assert len(seen) == 5

    def broken(_):
        raise RuntimeError("widget bug")
    ch.subscribe(broken, replay=False)
    ch.publish(ProgressEvent(kind="step", step=5, loss=0.5))  # does not raise into the driver
    assert len(ch.subscriber_errors) == 1
    assert not ch.cancelled
    ch.cancel()
    assert ch.cancelled and not ch.finished
    ch.publish(ProgressEvent(kind="cancelled", step=5))
    assert ch.finished
    with pytest.raises(ValueError, match="kind"):
        ProgressEvent(kind="bogus")


def test_events_travel_as_tagged_json_lines():
    ev = ProgressEvent(kind="step", step=3, loss=2.5, samples_per_s=10.0, stage_times=(0.1, 0.2))
    line = format_event(ev)
    assert parse_event(line) == ev
    assert parse_event("some other log line") is None


def test_bad_input_is_refused_before_anything_starts(setup, tmp_path):
    from autopar_lab.runtime.launch import launch

    model, plan = setup
    with pytest.raises(ValueError, match="steps must be a positive"):
        launch(plan, model, 0)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        launch(plan, model, 2, options=al.RunOptions(checkpoint_every=1))
    other = al.models.get("gpt-tiny", batch_size=8, num_layers=2, hidden_size=64)
    with pytest.raises(ValueError, match="made for another model"):
        launch(plan, other, 2)
    with pytest.raises(ValueError, match="dashboard's HTTP address"):
        launch(plan, model, 2, ray_address="ray://127.0.0.1:10001")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=f"cannot reach a Ray cluster at http://127.0.0.1:{port}"):
        launch(plan, model, 2, ray_address=f"http://127.0.0.1:{port}")
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()  # nothing started


def test_remote_submission_carries_the_plan_and_the_code(setup, tmp_path):
    from autopar_lab.runtime.launch import remote_submission
    from autopar_lab.runtime.train_entry import job_spec

    model, plan = setup
    spec = job_spec(plan, model, 3, options=al.RunOptions(seed=1))
    entry, env = remote_submission(spec, tmp_path)
    assert entry == "python -m autopar_lab.runtime.train_entry job.json"
    assert env["working_dir"] == str(tmp_path)
    carried = json.loads((tmp_path / "job.json").read_text())
    assert carried["plan"]["graph_fingerprint"] == plan.graph.fingerprint
    assert carried["model"] == "gpt-tiny" and carried["config"]["hidden_size"] == model.config.hidden_size
    assert carried["steps"] == 3 and carried["seed"] == 1 and carried["device_kind"] == "cpu"
    assert [Path(p).name for p in env["py_modules"]] == ["autopar_lab"]
    assert (Path(env["py_modules"][0]) / "runtime" / "train_entry.py").exists()


def test_importing_autopar_lab_never_imports_ray():
    code = ("import sys, autopar_lab as al; al.launch; import autopar_lab.runtime.actors, "
            "autopar_lab.runtime.train_entry; assert 'ray' not in sys.modules, 'ray imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-500:]


def test_cli_train_errors_are_one_sentence(setup, tmp_path):
    model, plan = setup
    path = tmp_path / "plan.json"
    al.save_plan(plan, path)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "autopar_lab.cli", "train", "gpt-tiny", "--batch", "8", "--layers", "2",
                        "--plan", str(tmp_path / "missing.json"), "--steps", "2", "--json"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 2 and r.stdout == "" and "missing.json" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "autopar_lab.cli", "train", "gpt-tiny", "--batch", "8", "--layers", "4",
                        "--plan", str(path), "--steps", "2", "--json"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "another graph" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # builds four stage workers (trace, plan, compile) in this process
def test_stage_workers_follow_the_schedule_and_checkpoint_without_ray(setup, reference, tmp_path, run_at_once):
    """The actors' contract and the driver's routing, in one process: same losses as the single-process run, and a
    worker restored from a checkpoint goes on exactly where the saved one was."""
    from autopar_lab.runtime.actors import StageWorker
    from autopar_lab.runtime.train_entry import _Routes, _submit_step, job_spec, step_loss

    model, plan = setup
    spec = job_spec(plan, model, 3, options=al.RunOptions(compiler_options=OPTS))
    workers = [StageWorker(spec, k) for k in range(2)]
    assert workers[1].info()["inputs"] and workers[0].info()["outputs"]
    routes = _Routes([w.info() for w in workers])
    assert routes.producers == [[], [0]] and routes.consumers == [[1], []]
    handles = [run_at_once(w) for w in workers]
    losses = []
    for step in range(3):
        if step == 2:  # checkpoint after step 2, then carry on with fresh workers restored from it
            for w in workers:
                w.save(str(tmp_path), 2)
            # given the plan object, as the embedded Ray's actors are (the first ones loaded it from the spec's JSON)
            workers = [StageWorker(spec, k, plan) for k in range(2)]
            assert all(w.plan is plan for w in workers)
            for w in workers:
                w.restore(str(tmp_path), 2)
            handles = [run_at_once(w) for w in workers]
        finish = _submit_step(handles, routes, step, 2, 2, plan.schedule)
        losses.append(step_loss(finish))
        assert [f["stage"] for f in finish] == [0, 1] and all(f["busy_s"] > 0 for f in finish)
    np.testing.assert_allclose(losses, reference[:3], rtol=1e-6)


# ---------------------------------------------------------------------------------------------- on Ray

@pytest.fixture(scope="module")
def reference(setup):
    model, plan = setup
    return al.execute(plan, model, compiler_options=OPTS).train(STEPS)


@pytest.fixture(scope="module")
def uninterrupted(setup, shared_ray_head, tmp_path_factory):
    from autopar_lab.runtime.launch import launch

    model, plan = setup
    ray = shared_ray_head.start()
    events, memory = [], []
    holder: dict = {}

    def measure_after_step_1(ev):
        # In the driver's thread, between steps 1 and 2 (the next step's tasks are not submitted yet): what each
        # stage actor holds (test_ray_stage_actor_holds_only_its_stage), on this job's actors rather than two more
        # started for it alone (a pair of actor starts, ~10 CPU-s).
        if ev.kind == "step" and ev.step == 1 and not memory:
            memory.extend(ray.get([a.memory.remote() for a in holder["job"].stage_actors()], timeout=600))

    ck = tmp_path_factory.mktemp("ck_a")
    options = al.RunOptions(compiler_options=OPTS).with_checkpoints(ck, every=2)
    job = launch(plan, model, STEPS, options=options, on_progress=events.append)
    holder["job"] = job
    job.subscribe(measure_after_step_1)  # replays step 1 here if it came first: the actors are still up
    result = job.wait(timeout=900)
    return job, result, events, memory


@pytest.mark.slow  # stage actors on the shared embedded Ray (started once for the Ray group's files)
def test_embedded_cluster_is_loopback_only(shared_ray):
    nodes = [n for n in shared_ray.nodes() if n["Alive"]]
    assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]
    assert shared_ray.cluster_resources()["CPU"] == 2


@pytest.mark.slow  # stage actors on the shared embedded Ray (started once for the Ray group's files)
def test_two_stage_plan_on_ray_equals_single_process(setup, uninterrupted, reference):
    model, plan = setup
    job, result, events, _ = uninterrupted
    assert result["status"] == "done" and result["restarts"] == 0
    assert len(result["losses"]) == STEPS == len(reference)
    np.testing.assert_allclose(result["losses"], reference, rtol=1e-6, atol=0)
    assert job.losses == result["losses"]
    steps = [e for e in events if e.kind == "step"]
    assert [e.step for e in steps] == list(range(1, STEPS + 1))
    assert all(e.samples_per_s > 0 and len(e.stage_times) == 2 and min(e.stage_times) > 0 for e in steps)
    assert events[-1].kind == "done"
    # measured per-stage times beside the plan's predictions
    rows = job.stage_times()
    assert [r["stage"] for r in rows] == [0, 1]
    for r, st in zip(rows, plan.stages):
        assert r["predicted_fwd_s"] == st.fwd_s and r["predicted_bwd_s"] == st.bwd_s
        assert r["measured_fwd_s"] > 0 and r["measured_bwd_s"] > 0
        assert r["fwd_ratio"] == pytest.approx(r["measured_fwd_s"] / st.fwd_s)
        # each stage actor's peak resident memory, beside the plan's peak per device
        assert r["peak_rss_bytes"] > 0 and r["predicted_peak_mem_bytes"] == st.peak_mem_bytes
    assert result["step_time_s"] > 0


@pytest.mark.slow  # stage actors on the shared embedded Ray (started once for the Ray group's files)
def test_ray_stage_actor_holds_only_its_stage(setup, uninterrupted, shared_ray):
    """Each actor's live arrays are its stage's parameters and optimizer state and nothing else: it made only its
    own part of the model (issue 35: one actor held the whole of gpt-350m's 4-layer copy, 9.7 GB), and keeps
    nothing of a step after it (measured between the uninterrupted job's steps 1 and 2)."""
    model, plan = setup
    job, mem = uninterrupted[0], uninterrupted[3]
    assert not job.channel.subscriber_errors, job.channel.subscriber_errors  # the measurement's own failure
    assert [m["stage"] for m in mem] == [0, 1]
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model.abstract_args[:2]))
    for m in mem:
        assert m["live_bytes"] == m["state_bytes"] > 0
        assert m["state_bytes"] < whole * 4  # its share over its 4 devices, not the model on each of them


@pytest.mark.slow  # stage actors on the shared embedded Ray (started once for the Ray group's files)
def test_killed_stage_actor_resumes_from_checkpoint_with_the_same_losses(setup, uninterrupted, shared_ray, tmp_path):
    from autopar_lab.runtime.checkpoint import steps_of
    from autopar_lab.runtime.launch import launch

    model, plan = setup
    ray = shared_ray
    killed = []
    holder = {}

    def kill_after_step_3(ev):
        if ev.kind == "step" and ev.step == 3 and not killed:
            victim = holder["job"].stage_actors()[1]
            ray.kill(victim, no_restart=True)  # stage 1 dies between steps 3 and 4: its state after step 3 is lost
            killed.append(victim)

    job = launch(plan, model, STEPS, options=al.RunOptions(compiler_options=OPTS, checkpoint_dir=tmp_path,
                                                           checkpoint_every=2))
    holder["job"] = job
    job.subscribe(kill_after_step_3)
    result = job.wait(timeout=900)
    assert killed and result["restarts"] == 1
    restarts = [e for e in job.progress if e.kind == "restart"]
    assert [e.step for e in restarts] == [2]  # went back to the checkpoint after step 2, lost only step 3
    assert result["losses"] == uninterrupted[1]["losses"]  # the same trajectory, to the bit
    assert steps_of(tmp_path, 0) == steps_of(tmp_path, 1) == [2, 4]


@pytest.mark.slow  # stage actors on the shared embedded Ray (started once for the Ray group's files)
def test_cancel_stops_the_job_cleanly(setup, shared_ray):
    from autopar_lab.runtime.launch import launch

    model, plan = setup
    holder = {}

    def cancel_after_first(ev):
        if ev.kind == "step" and ev.step == 1:
            holder["job"].cancel()

    job = launch(plan, model, 50, options=al.RunOptions(compiler_options=OPTS))
    holder["job"] = job
    job.subscribe(cancel_after_first)
    result = job.wait(timeout=900)
    assert result["status"] == "cancelled" and job.status() == "cancelled"
    assert 1 <= len(result["losses"]) < 50
    assert job.progress[-1].kind == "cancelled"


@pytest.mark.slow  # stage actors on the shared embedded Ray (started once for the Ray group's files)
def test_cluster_without_enough_devices_is_refused(setup, shared_ray):
    from autopar_lab.runtime.launch import launch

    model, plan = setup
    with pytest.raises(ValueError, match="needs 8 GPUs .* has 0"):
        launch(plan, model, 2, options=al.RunOptions(device_kind="gpu"))


@pytest.mark.slow  # stage actors on the shared embedded Ray (started once for the Ray group's files)
def test_cli_train_json_prints_losses_and_step_time(setup, shared_ray, tmp_path, capsys, reference):
    from autopar_lab.cli import main

    model, plan = setup
    path = tmp_path / "plan.json"
    al.save_plan(plan, path)
    code = main(["train", "gpt-tiny", "--batch", "8", "--layers", "2", "--plan", str(path), "--steps", "2",
                 "--fast-compile", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert len(data["losses"]) == 2 and data["step_time_s"] > 0
    np.testing.assert_allclose(data["losses"], reference[:2], rtol=1e-6)
    assert [r["stage"] for r in data["stage_times"]] == [0, 1]
