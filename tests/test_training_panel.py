"""The training panel and the session's training actions, headless.

A fake job (a real ProgressChannel behind the Job interface) is driven by publishing ProgressEvents from the test, as
the Ray driver thread would; ``autopar_lab.runtime.launch.launch`` is monkeypatched to return it, so no Ray starts
here (the Ray path is tested in test_launch.py). One real local run on 8 CPU devices checks the losses against
``al.execute(...).train(2)`` and that measured stage times reach the table.
"""

from __future__ import annotations

import threading

import jax
import pytest

import autopar_lab as al
from autopar_lab.runtime import launch as launch_mod
from autopar_lab.runtime.progress import ProgressChannel, ProgressEvent
from autopar_lab.widgets.session import Session
from autopar_lab.widgets.views.training import TrainingPanel, progress_text, stage_rows
from autopar_lab.widgets.workbench import Workbench

FAST = {"xla_backend_optimization_level": 0}  # compiles several times faster on CPU, same numbers up to rounding
needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")


@pytest.fixture(scope="module")
def model():
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2)


@pytest.fixture(scope="module")
def plan(model):
    return al.megatron_plan(model, al.Cluster.preset("cpu", hosts=1), dp=2, tp=2, pp=2, microbatches=2)


class FakeJob:
    """What Session.launch needs of a Job: subscribe / cancel / status / losses / stage_times / wait."""

    def __init__(self, plan, on_progress=None):
        self.channel = ProgressChannel()
        self.cancel_calls = 0
        self.result = None
        self.plan = plan
        if on_progress is not None:
            self.channel.subscribe(on_progress)

    def subscribe(self, cb, replay=True):
        return self.channel.subscribe(cb, replay=replay)

    def cancel(self):
        self.cancel_calls += 1
        self.channel.cancel()

    def status(self):
        return "running" if self.result is None else self.result["status"]

    @property
    def losses(self):
        return self.channel.losses

    def wait(self, timeout=None):
        return self.result

    def stage_times(self):
        rows = [{"stage": k, "predicted_fwd_s": st.fwd_s, "predicted_bwd_s": st.bwd_s, "measured_fwd_s": None,
                 "measured_bwd_s": None} for k, st in enumerate(self.plan.stages)]
        if self.result is not None:
            for r in rows:  # "measured": three and four times the prediction
                r["measured_fwd_s"], r["measured_bwd_s"] = 3 * r["predicted_fwd_s"], 4 * r["predicted_bwd_s"]
        return rows

    def finish(self, kind="done"):
        self.result = {"status": kind}
        self.channel.publish(ProgressEvent(kind=kind, step=len(self.losses), elapsed_s=1.0))


@pytest.fixture
def fake_launch(monkeypatch, plan):
    calls = []

    def launch(plan_, model_, steps, **kw):
        calls.append((plan_, model_, steps, kw))
        calls.job = FakeJob(plan_, kw.get("on_progress"))
        return calls.job

    calls = type("Calls", (list,), {})()
    monkeypatch.setattr(launch_mod, "launch", launch)
    return calls


def _step(job, k, loss):
    job.channel.publish(ProgressEvent(kind="step", step=k, loss=loss, samples_per_s=80.0 + k, step_time_s=0.1,
                                      stage_times=(0.02, 0.03), elapsed_s=0.1 * k))


def _wait_for(cond, timeout=5.0):
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return True
        done.wait(0.01)
    return cond()


def test_launch_streams_progress_restarts_and_cancel(model, plan, fake_launch):
    s = Session(plan, model=model)
    panel = TrainingPanel(s, num_cpus=2)
    panel.address.value = "  "  # blank: the embedded local Ray
    job = panel.launch(steps=5, background=False)
    (p_, m_, steps, kw), = fake_launch
    assert p_ is plan and m_ is model and steps == 5
    assert kw["ray_address"] is None and kw["num_cpus"] == 2 and callable(kw["on_progress"])
    assert panel.busy and not panel.cancel_button.disabled and panel.launch_button.disabled
    assert panel.progress.max == 5 and panel.progress.value == 0
    assert list(panel.loss_fig.data[0].y) == [None]  # a placeholder the browser draws as nothing

    for k, loss in enumerate([4.0, 3.5, 3.2], start=1):
        _step(job, k, loss)
    # Steps 2 and 3 came within DRAW_EVERY_S of step 1: they show together once that time is up.
    assert _wait_for(lambda: panel.progress.value == 3)
    assert list(panel.loss_fig.data[0].y) == [4.0, 3.5, 3.2] and list(panel.loss_fig.data[0].x) == [1, 2, 3]
    text = panel.throughput.value
    assert "step 3/5" in text and "loss 3.2000" in text and "83 samples/s" in text and "30 ms" in text

    # A stage actor died: the job went back to its checkpoint at step 1; steps 2 and 3 are redone.
    job.channel.publish(ProgressEvent(kind="restart", step=1, message="stage 1 died"))
    assert list(panel.loss_fig.data[0].y) == [4.0] and panel.progress.value == 1
    _step(job, 2, 3.6)
    assert _wait_for(lambda: list(panel.loss_fig.data[0].y) == [4.0, 3.6] == job.losses)

    panel.cancel_button.click()
    assert job.cancel_calls == 1 and job.channel.cancelled
    job.finish("cancelled")
    assert panel.progress.description == "cancelled" and not panel.busy and panel.cancel_button.disabled
    # The job's measured times arrive once its result is in (collected off the driver thread).
    assert _wait_for(lambda: s.measured is not None)
    rows = {r["stage"]: r for r in panel.rows}
    for k, st in enumerate(plan.stages):
        assert rows[k]["measured_fwd_s"] == pytest.approx(3 * st.fwd_s)
        assert rows[k]["fwd_ratio"] == pytest.approx(3.0) and rows[k]["bwd_ratio"] == pytest.approx(4.0)
    assert "3.00×" in panel.stage_table.value and "4.00×" in panel.stage_table.value


def test_session_launch_emits_training_events_and_chains_on_progress(model, plan, fake_launch):
    s = Session(plan, model=model)
    events, mine = [], []
    s.subscribe(events.append)
    job = s.launch(3, ray_address="http://head:8265", on_progress=mine.append)
    assert s.job is job and fake_launch[0][3]["ray_address"] == "http://head:8265"
    assert s.training.runs[-1].remote  # a cluster elsewhere: this machine's load says nothing of it
    _step(job, 1, 2.0)
    training = [e for e in events if e.name == "training"]
    assert len(training) == 1 and training[0].detail["event"].loss == 2.0 and training[0].action == "launch"
    assert [e.loss for e in mine] == [2.0]  # the caller's own callback still gets every event
    assert s.measured is None  # nothing measured before the job ends
    job.finish()
    assert _wait_for(lambda: s.measured is not None)
    assert any(e.name == "measured" for e in events)
    # A plan change makes the measured times stale; undo brings back the plan they were measured for.
    s.set_microbatches(4)
    assert s.measured is None
    s.undo()
    assert s.measured is not None


def test_training_needs_a_model(plan):
    s = Session(plan)
    with pytest.raises(ValueError, match="ModelSpec"):
        s.run_local(1)
    with pytest.raises(ValueError, match="ModelSpec"):
        s.launch(1)
    panel = TrainingPanel(s)
    assert panel.run_button.disabled and panel.launch_button.disabled and "ModelSpec" in panel.note.value
    with pytest.raises(ValueError, match="positive integer"):
        Session(plan, model=al.models.get("gpt-tiny", batch_size=8, num_layers=2)).run_local(0)


def test_a_launch_that_fails_to_start_says_why(model, plan, monkeypatch):
    def bad(*a, **kw):
        raise ValueError("cannot reach http://nowhere:8265")

    monkeypatch.setattr(launch_mod, "launch", bad)
    s = Session(plan, model=model)
    panel = TrainingPanel(s)
    errors = []
    s.subscribe(lambda e: errors.append(e) if e.name == "error" else None)
    assert panel.launch(3, address="http://nowhere:8265", background=False) is None
    assert "cannot reach" in panel.message.value and not panel.busy and errors[0].action == "launch on Ray"


def test_progress_text_and_stage_rows_by_hand(plan):
    ev = ProgressEvent(kind="step", step=2, loss=1.23456, samples_per_s=50.0, step_time_s=0.16,
                       stage_times=(0.05, 0.002), elapsed_s=3.0)
    assert progress_text(ev, 10) == ("step 2/10 · loss 1.2346 · 50 samples/s · 160 ms/step · "
                                     "stage busy 0: 50 ms, 1: 2 ms · elapsed 3 s")
    st0 = plan.stages[0]
    rows = stage_rows(plan, [{"stage": 0, "measured_fwd_s": 2 * st0.fwd_s, "measured_bwd_s": None}])
    assert rows[0]["fwd_ratio"] == pytest.approx(2.0) and rows[0]["bwd_ratio"] is None
    assert rows[1]["measured_fwd_s"] is None and rows[1]["predicted_bwd_s"] == plan.stages[1].bwd_s


@needs8
def test_run_local_matches_execute_and_fills_the_tables(model, plan):
    wb = Workbench(model, plan.cluster, plan=plan)
    assert "autopar-training" in wb.training.widget._dom_classes and wb.views["training"] is wb.training
    wb.training.compiler_options = FAST
    seen = []
    wb.session.subscribe(lambda e: seen.append(e.detail["event"]) if e.name == "training" else None)
    wb.training.run_local(2, background=False)
    expected = al.execute(plan, model, compiler_options=FAST).train(2)
    result = wb.training.last_result
    assert result["status"] == "done" and result["losses"] == pytest.approx(expected, rel=1e-6)
    assert [e.kind for e in seen] == ["step", "step", "done"] and [e.step for e in seen[:2]] == [1, 2]
    assert seen[1].samples_per_s == pytest.approx(8 / seen[1].step_time_s)
    assert list(wb.training.loss_fig.data[0].y) == pytest.approx(expected, rel=1e-6)
    assert wb.training.progress.value == 2 and wb.training.progress.description == "done"
    # Step 2 (after the compiling step 1) measured every stage's forward and backward.
    rows = wb.training.rows
    assert len(rows) == 2 and all(r["measured_fwd_s"] > 0 and r["measured_bwd_s"] > 0 for r in rows)
    assert all(r["fwd_ratio"] == pytest.approx(r["measured_fwd_s"] / r["predicted_fwd_s"]) for r in rows)
    assert "—" not in wb.training.stage_table.value
    # Each step event streams every stage's compute per step (from step 2: forward + backward x 2 microbatches).
    assert seen[0].stage_times == () and seen[1].stage_times == pytest.approx(
        [(r["measured_fwd_s"] + r["measured_bwd_s"]) * 2 for r in rows])
    assert "measured / predicted" in wb.cost.measured.value


class FakeRunner:
    """Stands in for al.execute's Runner: each step waits for the test's go-ahead, so a cancel lands mid-run."""

    def __init__(self, plan):
        self.plan, self.losses, self.gate = plan, [], threading.Semaphore(0)
        self.entered = 0  # steps begun (a step waits at the gate once begun)

    def step(self, batch):
        self.entered += 1
        assert self.gate.acquire(timeout=10)
        self.losses.append(5.0 - len(self.losses))
        return self.losses[-1]

    def stage_times(self):
        return [{"stage": k, "predicted_fwd_s": st.fwd_s, "predicted_bwd_s": st.bwd_s, "measured_fwd_s": 1e-3,
                 "measured_bwd_s": 2e-3} for k, st in enumerate(self.plan.stages)]

    def report(self):
        return {"losses": list(self.losses), "stage_times": self.stage_times()}


def test_fast_steps_are_drawn_together_and_the_last_one_always_shows(model, plan, fake_launch, monkeypatch):
    # 200 steps arriving at one instant (a fast run): the panel draws the first at once and the rest as one draw,
    # the latest step and every loss, instead of 200 redraws of the whole curve that left the page too busy to
    # take a click on cancel.
    from autopar_lab.widgets.views import training

    class Clock:  # the panel's clock stands still: every step arrives within DRAW_EVERY_S of the first
        now = 1000.0

        def monotonic(self):
            return self.now

    monkeypatch.setattr(training, "time", Clock())
    panel = TrainingPanel(Session(plan, model=model))
    job = panel.launch(steps=500, background=False)
    drawn = []
    panel.progress.observe(lambda change: drawn.append(change["new"]), "value")
    for k in range(1, 201):
        _step(job, k, 5.0 - k / 100)
    assert drawn == [1]  # the first step at once; 199 waiting
    assert _wait_for(lambda: panel.progress.value == 200)  # the trailing draw, on the timer
    assert drawn == [1, 200] and "step 200/500" in panel.throughput.value
    assert list(panel.loss_fig.data[0].x) == list(range(1, 201))
    assert panel.losses == pytest.approx([5.0 - k / 100 for k in range(1, 201)])
    # A run's end draws what is waiting at once, before saying how it ended.
    _step(job, 201, 2.9)
    job.finish("cancelled")
    assert drawn == [1, 200, 201] and panel.progress.description == "cancelled"
    assert list(panel.loss_fig.data[0].y)[-1] == 2.9


def test_local_run_in_the_background_cancels_between_steps(model, plan, monkeypatch):
    from autopar_lab.runtime import local

    runners = []
    monkeypatch.setattr(local, "execute", lambda plan_, model_, **kw: runners.append(FakeRunner(plan_)) or runners[-1])
    s = Session(plan, model=model)
    panel = TrainingPanel(s)
    assert panel.cancel_button.disabled and panel.cancel_button.button_style == ""  # idle: not coloured
    thread = panel.run_local(10)
    assert thread is not None and panel.busy and panel.run_button.disabled
    assert not panel.cancel_button.disabled and panel.cancel_button.button_style == "warning"
    assert _wait_for(lambda: bool(runners))
    runner = runners[0]
    runner.gate.release(2)
    # the third step under way (begun, waiting at the gate): under load the panel may show step 2 before then
    assert _wait_for(lambda: panel.progress.value == 2 and runner.entered == 3)
    panel.cancel()  # the third step is under way: it finishes, then the run stops
    runner.gate.release()
    panel.wait(10)
    assert not thread.is_alive() and not panel.busy and not panel.run_button.disabled
    assert panel.cancel_button.button_style == ""
    assert panel.last_result["status"] == "cancelled" and panel.last_result["losses"] == [5.0, 4.0, 3.0]
    assert list(panel.loss_fig.data[0].y) == [5.0, 4.0, 3.0] and panel.progress.max == 10
    assert panel.progress.description == "cancelled" and "cancelled after 3 of 10" in panel.throughput.value
    assert panel.rows[0]["measured_bwd_s"] == 2e-3 and panel.rows[0]["bwd_ratio"] == pytest.approx(
        2e-3 / plan.stages[0].bwd_s)


def test_runs_are_kept_overlaid_and_measured_against_predicted(model, plan, monkeypatch):
    from autopar_lab.runtime import local
    from autopar_lab.widgets.views.fmt import fmt_s

    def execute(plan_, model_, **kw):
        r = FakeRunner(plan_)
        r.gate.release(100)
        return r

    monkeypatch.setattr(local, "execute", execute)
    s = Session(plan, model=model)
    panel = TrainingPanel(s)
    panel.run_local(3, background=False)
    panel.run_local(4, background=False)
    runs = s.training.runs
    assert [(r.run, r.kind, r.status, len(r.losses)) for r in runs] == [(1, "local", "done", 3),
                                                                         (2, "local", "done", 4)]
    assert runs[0].plan is plan and runs[1].losses == [5.0, 4.0, 3.0, 2.0]
    assert len(runs[1].loads) == 4 and all(x >= 0 for x in runs[1].loads)  # the machine's load at each step
    # Measured: the median step after the first (which compiles), beside the plan's prediction.
    m = runs[1].measured_step_s
    assert m == sorted(runs[1].step_times[1:])[1] and runs[1].measured_samples_per_s == pytest.approx(8 / m)
    table = panel.runs_table.value
    assert table.index("<td>2</td>") < table.index("<td>1</td>")  # newest first
    assert fmt_s(m) in table and fmt_s(plan.cost.step_time_s) in table and "5 → 2" in table
    # The current run's curve first, the earlier run beside it.
    names = [t.name for t in panel.loss_fig.data]
    assert names == ["run 2", "run 1 (local, 3 steps)"]
    assert list(panel.loss_fig.data[0].y) == [5.0, 4.0, 3.0, 2.0] and list(panel.loss_fig.data[1].y) == [5.0, 4.0, 3.0]
    # A plan priced for this machine's devices measures like with like: no hardware note.
    assert "different hardware" not in table
    # A plan priced for V100s run here: the table says why measured ÷ predicted is far from 1.
    v100 = al.megatron_plan(model, al.Cluster.preset("p3.16xlarge", hosts=1), dp=2, tp=2, pp=2, microbatches=2)
    s.adopt(v100)
    panel.run_local(2, background=False)
    table = panel.runs_table.value
    assert "run 3: its plan is priced for V100-SXM2-16GB devices" in table and "cpu devices" in table
    hardware = next(part for part in table.split("<br>") if "its plan is priced for" in part)
    assert "run 1" not in hardware  # runs 1 and 2 were priced for the cpu preset


@pytest.mark.slow
@needs8
def test_twenty_local_steps_of_gpt_tiny_learn():
    # Issue 12, item 9: on random tokens the loss went 4.15 -> 4.18; the zoo's batches now carry a task.
    model = al.models.get("gpt-tiny")
    plan = al.megatron_plan(model, al.Cluster.preset("cpu", hosts=1), dp=2, tp=2, pp=2, microbatches=2)
    wb = Workbench(model, plan.cluster, plan=plan)
    wb.training.compiler_options = FAST
    wb.training.run_local(20, background=False)
    ys = list(wb.training.loss_fig.data[0].y)
    assert len(ys) == 20 and ys[0] > 4.0 and ys[-1] < ys[0] - 0.6, ys
    run = wb.session.training.runs[-1]
    assert run.measured_step_s > 0 and "measured ÷ predicted" in wb.training.runs_table.value
