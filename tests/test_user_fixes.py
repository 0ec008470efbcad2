"""Issue 35's data-loss bugs and poor answers (items 9, 10, 11 and part of 12), each as a user met it.

- 9: writing a plan (or a checkpoint) never replaces a FIFO, a device, a symlink or a directory at the path;
- 10: ``checkpoint_dir`` without ``checkpoint_every`` still checkpoints at the end, and ``resume`` of a directory that
  does not exist or holds no run is refused (a typo must not restart training);
- 11: resume reads a step's files as the plan reader reads plan files (regular files only, bounded), and a complete
  but wrong step (stage files swapped, an array of another shape) falls back to the last intact step;
- 12: a method name cannot put a PEP 263 coding cookie into the export; ``--seed`` out of JAX's range, a 5000-digit
  number, ``save_plan`` to a directory, a config field of the wrong type, float64 without x64, ``load_plan`` without
  a model, operator -1, ``diff(None)``, stage pins that do not fit their plan and a cluster file of another version
  each get one sentence; a cluster may be given as the CLI spells it ("cpu:2").

The driver's tests run :func:`autopar_lab.runtime.train_entry.run_job` itself on an in-process stand-in for Ray with
light stage workers (the stage actors' contract, kept by :class:`_Worker`): the checkpoint cadence, resume and its
fallback are the driver's, and need no Ray cluster.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys

import numpy as np
import pytest
from test_hostile import one_sentence, within

import autopar_lab as al
from autopar_lab.runtime.checkpoint import (CheckpointError, claim, load_job, load_stage, resume_point, save_job,
                                            save_stage, steps_of, verify_step)
from autopar_lab.safeio import write_atomic

HUGE = "9" * 5000


@pytest.fixture(scope="module")
def model():
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2)


@pytest.fixture(scope="module")
def plan(model):
    return al.megatron_plan(model, al.Cluster.preset("cpu"), dp=2, tp=2, pp=2, microbatches=2)


@pytest.fixture()
def plan_file(plan, tmp_path):
    path = tmp_path / "plan.json"
    al.save_plan(plan, path)
    return path


# ---------------------------------------------------------------------------------- 9: the writer's target

def test_writing_refuses_a_fifo_a_symlink_and_a_directory_and_leaves_them_as_they_were(plan, tmp_path):
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    mine = tmp_path / "mine.json"
    mine.write_text("my notes")
    link = tmp_path / "link.json"
    link.symlink_to(mine)
    folder = tmp_path / "folder"
    folder.mkdir()
    for target in (fifo, link, folder):
        with pytest.raises(ValueError) as e:
            within(20, lambda: write_atomic(target, b"{}"))
        msg = str(e.value)
        assert repr(str(target)) in msg and "pick a regular file path" in msg and "\n" not in msg, msg
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.islink(link) and os.path.isdir(folder)
    assert mine.read_text() == "my notes" and os.readlink(link) == str(mine)
    with pytest.raises(ValueError, match="is a directory, not a regular file; pick a regular file path"):
        al.save_plan(plan, folder)  # was a raw IsADirectoryError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "link.json", "mine.json", "plan.fifo"]  # no temp
    # a regular file is still replaced, keeping its mode
    mine.chmod(0o600)
    write_atomic(mine, b"new")
    assert mine.read_bytes() == b"new" and stat.S_IMODE(mine.stat().st_mode) == 0o600


def test_cli_plan_out_refuses_a_fifo_before_planning(capsys, tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    one_sentence(capsys, ["plan", "gpt-tiny", "--cluster", "cpu:1", "--out", str(fifo)], "--out", "out.fifo",
                 "regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# ------------------------------------------------------------------- a stand-in for Ray, for the driver's tests

class _RayError(Exception):
    pass


class _RayActorError(_RayError):
    pass


class _GetTimeoutError(_RayError):
    pass


class _Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        # as Ray does: refs passed as arguments arrive as their values; an error in the task surfaces at get()
        if any(isinstance(a, _Ref) and a.error for a in args):
            return next(a for a in args if isinstance(a, _Ref) and a.error)
        try:
            return _Ref(self.fn(*[a.value if isinstance(a, _Ref) else a for a in args]))
        except Exception as e:  # noqa: BLE001 - Ray's task error: its text ends with the remote exception's line
            return _Ref(error=f"ray::StageWorker() (pid=1)\n  File \"actors.py\"\n{type(e).__module__}."
                              f"{type(e).__name__}: {e}")


class _Handle:
    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return _Method(getattr(self.worker, name))


class _ActorClass:
    def __init__(self, cls):
        self.cls = cls

    def options(self, **_):
        return self

    def remote(self, job, stage):
        return _Handle(self.cls(job, stage))


class InProcessRay:
    """The part of Ray's API the driver uses, run at once in this process."""

    class exceptions:
        RayError, RayActorError, GetTimeoutError = _RayError, _RayActorError, _GetTimeoutError

    @staticmethod
    def remote(cls):
        return _ActorClass(cls)

    @staticmethod
    def cluster_resources():
        return {"CPU": 8.0}

    @staticmethod
    def nodes():
        return []

    def get(self, refs, timeout=None):
        for r in refs if isinstance(refs, list) else [refs]:
            if r.error is not None:
                raise _RayError(r.error)
        return [r.value for r in refs] if isinstance(refs, list) else refs.value

    @staticmethod
    def kill(_handle, no_restart=True):
        pass


class _Worker:
    """A stage worker with the actors' contract and a tiny state: ``w`` counts the steps it has taken (its length
    differs per stage), and the last stage's loss is ``100 - steps taken``, so the losses tell which state a resumed
    run started from."""

    def __init__(self, job, stage):
        self.k, self.S = int(stage), len(job["plan"]["stages"])
        self.w = np.zeros(3 + self.k, np.float32)

    def info(self):
        k = self.k
        return {"chunks": [k], "updates": [[k, []]],
                "tasks": [[k, "fwd", [[k - 1, "fwd"]] if k else []],
                          [k, "bwd", [[k + 1, "bwd"]] if k < self.S - 1 else []]]}

    def run(self, kind, chunk, step, mb, *produced):
        return {}

    def finish_step(self, step, *produced):
        out = {"stage": self.k, "fwd_s": 1e-3, "bwd_s": 1e-3, "update_s": 1e-3, "busy_s": 3e-3}
        if self.k == self.S - 1:
            out["loss"] = 100.0 - float(self.w[0])
        self.w = self.w + 1
        return out

    def save(self, directory, step):
        return str(save_stage(directory, step, self.k, {"w": self.w}))

    def restore(self, directory, step):
        self.w = load_stage(directory, step, self.k, template={"w": self.w})["w"]
        return step


def _job(directory, steps, *, every=0, resume=False, stages=2):
    return {"plan": {"stages": [{"submesh": [1, 1]}] * stages, "microbatches": 2, "schedule": "1f1b"},
            "model": "stand-in", "steps": steps, "checkpoint_dir": str(directory), "checkpoint_every": every,
            "resume": resume, "overwrite": False, "run_id": "run-a", "device_kind": "cpu", "max_restarts": 1,
            "predicted": [{"fwd_s": 1e-3, "bwd_s": 1e-3}] * stages, "batch_size": 8}


@pytest.fixture()
def drive(monkeypatch):
    """``drive(job)``: (result, events) of the real driver on the in-process stand-in."""
    from autopar_lab.runtime import actors
    from autopar_lab.runtime.progress import ProgressChannel
    from autopar_lab.runtime.train_entry import run_job

    monkeypatch.setattr(actors, "remote_class", lambda ray: ray.remote(_Worker))

    def run(job):
        events = []
        channel = ProgressChannel()
        channel.subscribe(events.append)
        return run_job(job, channel, InProcessRay()), events

    return run


# -------------------------------------------------------------------- 10: checkpoint at the end; resume of nothing

def test_a_checkpoint_dir_without_every_still_checkpoints_at_the_end(drive, tmp_path):
    result, _ = drive(_job(tmp_path, 3))
    assert result["status"] == "done", result["message"]
    assert result["losses"] == [100.0, 99.0, 98.0]
    assert [steps_of(tmp_path, k) for k in range(2)] == [[3], [3]]  # nothing in between, the end saved
    assert load_job(tmp_path)["step"] == 3 and result["checkpoint_step"] == 3
    # and a later resume goes on from it, not from step 1
    result, _ = drive(_job(tmp_path, 5, resume=True))
    assert result["status"] == "done", result["message"]
    assert result["losses"] == [100.0, 99.0, 98.0, 97.0, 96.0]


def test_resume_of_a_directory_that_does_not_exist_or_holds_no_run_is_refused(tmp_path):
    typo = tmp_path / "ckpt-typo"
    with pytest.raises(CheckpointError, match="does not exist") as e:
        claim(typo, "run-a", resume=True)
    assert str(typo) in str(e.value) and "leave out resume" in str(e.value)
    assert not typo.exists()  # not created either
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint to resume"):
        claim(tmp_path / "empty", "run-a", resume=True)
    assert list((tmp_path / "empty").iterdir()) == []


def test_resume_of_a_run_stopped_before_its_first_checkpoint_says_so(drive, tmp_path):
    claim(tmp_path, "run-a")  # the run claimed the directory, then was killed before finishing a step
    result, events = drive(_job(tmp_path, 2, resume=True))
    assert result["status"] == "done" and result["losses"] == [100.0, 99.0]
    notes = [ev.message for ev in events if ev.kind == "note"]
    assert len(notes) == 1 and "no checkpoint" in notes[0] and "step 1" in notes[0], notes


def test_cli_train_resume_of_a_typo_is_one_sentence_before_ray_starts(capsys, plan_file, tmp_path):
    argv = ["train", "gpt-tiny", "--batch", "8", "--layers", "2", "--plan", str(plan_file), "--steps", "2"]
    one_sentence(capsys, [*argv, "--checkpoint-dir", str(tmp_path / "nope"), "--resume"], "nope", "does not exist")
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


# --------------------------------------------------------------------- 11: resume reads only what it should

def _steps(directory, steps, stages=2):
    """What a run with a checkpoint every step leaves: stage k's ``w`` holds ``step`` in ``3 + k`` entries."""
    claim(directory, "run-a")
    losses = []
    for step in range(1, steps + 1):
        losses.append(100.0 - step + 1)
        for k in range(stages):
            save_stage(directory, step, k, {"w": np.full(3 + k, step, np.float32)})
        save_job(directory, step, losses, "run-a")


def test_step_files_that_are_not_regular_files_are_refused_at_once(tmp_path):
    _steps(tmp_path, 3)
    index = tmp_path / "stage_1" / "step_00000003.json"
    index.unlink()
    index.symlink_to("/dev/zero")  # read_text() would fill memory
    assert "not a regular file" in within(20, lambda: verify_step(tmp_path, 3, 1))
    with pytest.raises(CheckpointError, match="not a regular file"):
        within(20, lambda: load_stage(tmp_path, 3, 1, template={"w": np.zeros(4, np.float32)}))
    step, _, note = within(20, lambda: resume_point(tmp_path, 2))
    assert step == 2 and "step 3 is damaged" in note
    index.unlink()
    os.mkfifo(index)  # no writer: a plain open blocks for ever
    assert "not a regular file" in within(20, lambda: verify_step(tmp_path, 3, 1))
    npz = tmp_path / "stage_0" / "step_00000002.npz"
    npz.unlink()
    os.mkfifo(npz)
    assert "not a regular file" in within(20, lambda: verify_step(tmp_path, 2, 0))
    with pytest.raises(CheckpointError, match="not a regular file"):
        within(20, lambda: load_stage(tmp_path, 2, 0, template={"w": np.zeros(3, np.float32)}))
    assert within(20, lambda: resume_point(tmp_path, 2))[0] == 1
    job = tmp_path / "job.json"
    job.unlink()
    job.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="not a regular file"):
        within(20, lambda: claim(tmp_path, "run-a", resume=True))


def test_a_complete_but_wrong_step_falls_back_to_the_last_intact_one(tmp_path):
    _steps(tmp_path, 3)
    s0, s1 = tmp_path / "stage_0", tmp_path / "stage_1"
    for ext in ("json", "npz"):  # stage files swapped: each a whole, valid checkpoint of the other stage
        a, b = s0 / f"step_00000003.{ext}", s1 / f"step_00000003.{ext}"
        tmp = tmp_path / "swap"
        a.rename(tmp)
        b.rename(a)
        tmp.rename(b)
    assert "stage 1" in verify_step(tmp_path, 3, 0)
    step, losses, note = resume_point(tmp_path, 2)
    assert step == 2 and losses == [100.0, 99.0] and "step 3 is damaged" in note and "resuming from step 2" in note
    # an array of another shape than its index says (a whole zip: every CRC fine)
    npz = s1 / "step_00000002.npz"
    with open(npz, "wb") as f:
        np.savez(f, leaf_00000=np.full((2, 2), 2, np.float32))
    reason = verify_step(tmp_path, 2, 1)
    assert reason is not None and "shape" in reason and "[2, 2]" in reason and "[4]" in reason, reason
    step, _, note = resume_point(tmp_path, 2)
    assert step == 1 and "steps 3, 2 are damaged" in note


def test_the_driver_falls_back_past_a_step_that_does_not_fit_its_stage(drive, tmp_path):
    """A step whose index and arrays agree but do not fit the stage (written by hand, or by a changed program) is
    refused by the stage's restore; the driver goes back to the step before instead of failing the run."""
    result, _ = drive(_job(tmp_path, 4, every=2))
    assert result["status"] == "done" and [steps_of(tmp_path, k) for k in range(2)] == [[2, 4], [2, 4]]
    save_stage(tmp_path, 4, 1, {"w": np.full(7, 4.0, np.float32)})  # consistent in itself, 7 entries for 4
    assert verify_step(tmp_path, 4, 1) is None
    result, events = drive(_job(tmp_path, 5, resume=True))
    assert result["status"] == "done", result["message"]
    assert result["losses"] == [100.0, 99.0, 98.0, 97.0, 96.0]  # steps 3-5 trained again from step 2's state
    notes = " ".join(ev.message for ev in events if ev.kind == "note")
    assert "step 4 cannot be restored" in notes and "resuming from step 2" in notes and "[7]" in notes, notes


# ---------------------------------------------------------------------------------------------- 12: poor answers

COOKIES = ["coding: utf-16", "x -*- coding: latin-1 -*-", "coding=bogus-codec", "vim: set fileencoding=utf-16 :",
           "auto\x0ccoding: utf-16"]


def test_a_method_cannot_set_the_exports_source_encoding(plan, tmp_path):
    for method in COOKIES:
        code = dataclasses.replace(plan, method=method).to_jax_code()
        path = tmp_path / "export.py"
        path.write_text(code, encoding="utf-8")
        compile(path.read_bytes(), str(path), "exec")  # as python reads a saved file: the cookie applies to bytes
        header = code.splitlines()[0]
        assert header.startswith("# autopar-lab plan: "), header
        assert any(w in header for w in ("utf-16", "latin-1", "bogus-codec")), header  # the name is still shown


def test_a_seed_jax_cannot_hold_is_refused_before_anything_starts(capsys, plan, model, plan_file):
    import jax

    from autopar_lab.runtime.train_entry import job_spec

    top = 2**63 - 3  # 3 steps: the batches use keys seed .. seed + 2, the last of them JAX's largest
    job_spec(plan, model, 3, options=al.RunOptions(seed=top))
    jax.random.PRNGKey(top + 2)
    jax.random.PRNGKey(-(2**63))
    job_spec(plan, model, 3, options=al.RunOptions(seed=-(2**63)))
    for seed in (top + 1, 2**64 + 1, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed must be a whole number between"):
            job_spec(plan, model, 3, options=al.RunOptions(seed=seed))
    argv = ["train", "gpt-tiny", "--batch", "8", "--layers", "2", "--plan", str(plan_file), "--steps", "2"]
    one_sentence(capsys, [*argv, "--seed", str(2**64 + 1)], "--seed", "between")
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_a_5000_digit_number_is_too_large_in_one_short_sentence(capsys, tmp_path):
    cases = [["graph", "mlp", "--layers", HUGE], ["graph", "mlp", "--batch", "-" + HUGE],
             ["plan", "mlp", "--cluster", "cpu:1", "--microbatches", HUGE],
             ["validate", "mlp", "--mesh", f"{HUGE}x1"],
             ["train", "mlp", "--plan", "p.json", "--steps", HUGE]]
    cfile = tmp_path / "c.json"
    cfile.write_text('{"hosts": ' + HUGE + "}")
    cases.append(["plan", "mlp", "--cluster", str(cfile)])
    for argv in cases:
        line = one_sentence(capsys, argv, "too large")
        assert "set_int_max_str_digits" not in line and len(line) < 300, line


# ---------------------------------------------------------------------------------- 12: the rest of the poor answers

def test_a_field_of_the_wrong_type_or_float64_is_one_sentence():
    with pytest.raises(ValueError, match="batch_size must be a whole number") as e:
        al.models.get("gpt-tiny", batch_size="8")
    assert "'8'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="num_layers must be a whole number"):
        al.models.get("llama3-tiny", num_layers=2.5)
    with pytest.raises(ValueError, match="x64"):  # JAX would train it in float32 without a word
        al.models.get("gpt-tiny", dtype="float64")


def test_a_cluster_may_be_given_as_the_cli_spells_it(model, plan, plan_file):
    by_name = al.megatron_plan(model, "cpu", dp=2, tp=2, pp=2, microbatches=2)
    assert by_name.cost.step_time_s == plan.cost.step_time_s and by_name.cluster == plan.cluster
    loaded = al.load_plan(plan_file, model, "cpu")
    assert loaded.cost.step_time_s == plan.cost.step_time_s
    with pytest.raises(ValueError, match="another cluster"):
        al.load_plan(plan_file, model, "cpu:2")


def test_load_plan_without_a_model_operator_minus_one_and_diff_of_nothing_are_one_sentence(plan, plan_file):
    with pytest.raises(ValueError, match=r"load_plan\(path, model\)"):
        al.load_plan(plan_file, None)
    with pytest.raises(ValueError, match="operator -1 is not in this plan's graph"):
        plan.with_choice(-1, "R")
    with pytest.raises(ValueError, match="Plan.diff takes a Plan"):
        plan.diff(None)


@pytest.mark.parametrize("pins, says", [
    ({"logical_meshes": [[7, 7], None]}, "logical_meshes'][0] must be two whole numbers"),
    ({"remat": [1, False]}, "stage_pins['remat'][0] must be one of"),
    ({"virtual_stages": 1024}, "goes with the interleaved schedule only"),
])
def test_stage_pins_that_do_not_fit_the_plan_they_sit_in_are_refused(model, plan, plan_file, pins, says):
    import json

    data = json.loads(plan_file.read_text())
    data["stage_pins"] = {**data.get("stage_pins", {}), **pins}
    plan_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
        al.load_plan(plan_file, model)


def test_a_cluster_file_of_another_version_is_refused(tmp_path):
    data = al.Cluster.preset("dgx-h100", hosts=2).to_dict()
    assert al.Cluster.from_json(data) == al.Cluster.preset("dgx-h100", hosts=2)
    with pytest.raises(ValueError, match="has version 2, but this autopar-lab reads version 1"):
        al.Cluster.from_json({**data, "version": 2})
