"""Checkpoints never lose a run (issue 19): a directory belongs to one run, a damaged index is refused with its path,
a damaged step falls back to the last good one, and a writer killed in the middle of a save leaves a directory that
resumes from the last complete step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from autopar_lab.runtime.checkpoint import (CheckpointError, claim, load_job, load_stage, resume_point, save_job,
                                            save_stage, verify_step)


def _tree(value: float, n: int = 1000):
    return {"w": np.full((n,), value, np.float32), "b": np.arange(3, dtype=np.int32)}


def _run(directory, steps, stages=2, run_id="run-a"):
    losses = []
    for step in range(1, steps + 1):
        losses.append(10.0 - step)
        for k in range(stages):
            save_stage(directory, step, k, _tree(step))
        save_job(directory, step, losses, run_id)


def test_a_new_run_into_a_used_directory_is_refused_unless_told_to_overwrite(tmp_path):
    assert claim(tmp_path, "run-a") == ("run-a", None)
    _run(tmp_path, 3)
    with pytest.raises(CheckpointError, match=r"holds the checkpoints of run run-a \(step 3\); resume it"):
        claim(tmp_path, "run-b")
    assert load_job(tmp_path)["step"] == 3 and verify_step(tmp_path, 3, 1) is None  # nothing was touched
    (tmp_path / "notes.txt").write_text("mine")
    assert claim(tmp_path, "run-b", overwrite=True) == ("run-b", None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.json", "notes.txt"]  # only the run's own files went
    assert load_job(tmp_path)["run_id"] == "run-b" and load_job(tmp_path)["step"] == 0
    assert claim(tmp_path, "run-b") == ("run-b", None)  # the same run claiming again (launch, then its driver)


def test_stage_files_without_an_index_are_never_silently_replaced(tmp_path):
    _run(tmp_path, 2)
    (tmp_path / "job.json").unlink()
    with pytest.raises(CheckpointError, match="holds the checkpoints of another run"):
        claim(tmp_path, "run-b")
    with pytest.raises(CheckpointError, match="no job.json"):
        claim(tmp_path, "run-b", resume=True)


def test_resume_with_a_damaged_index_is_refused_naming_it(tmp_path):
    _run(tmp_path, 2)
    (tmp_path / "job.json").write_text('{"step": "two"')
    with pytest.raises(CheckpointError, match=f"the run index {tmp_path / 'job.json'} is damaged"):
        claim(tmp_path, "run-b", resume=True)
    with pytest.raises(CheckpointError, match="holds the checkpoints"):  # and a new run still may not overwrite it
        claim(tmp_path, "run-b")


def test_resume_keeps_the_run_id_and_refuses_a_directory_without_a_run(tmp_path):
    _run(tmp_path / "used", 2)
    run_id, rec = claim(tmp_path / "used", "run-b", resume=True)
    assert run_id == "run-a" and rec["step"] == 2
    with pytest.raises(CheckpointError, match="does not exist"):  # issue 35: a typo must not start training over
        claim(tmp_path / "new", "run-c", resume=True)


def test_a_read_only_place_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot write checkpoints to"):
        claim(tmp_path / "file" / "ck", "run-a")


def test_a_truncated_step_falls_back_to_the_last_good_one_and_says_so(tmp_path):
    _run(tmp_path, 4)
    npz = tmp_path / "stage_1" / "step_00000004.npz"
    npz.write_bytes(npz.read_bytes()[: npz.stat().st_size // 2])
    step, losses, note = resume_point(tmp_path, 2)
    assert step == 3 and losses == [9.0, 8.0, 7.0]
    assert "checkpoint step 4 is damaged" in note and "step_00000004.npz" in note and "resuming from step 3" in note
    assert load_stage(tmp_path, 3, 1, template=_tree(0))["w"][0] == 3
    (tmp_path / "stage_0" / "step_00000003.json").write_text("{")
    step, _, note = resume_point(tmp_path, 2)
    assert step == 2 and "steps 4, 3 are damaged" in note


def test_nothing_readable_means_step_zero_with_a_note(tmp_path):
    _run(tmp_path, 1)
    (tmp_path / "stage_0" / "step_00000001.npz").write_bytes(b"PK\x03\x04 torn")
    assert resume_point(tmp_path, 2)[0] == 0 and "starting from step 0" in resume_point(tmp_path, 2)[2]


WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from autopar_lab.runtime.checkpoint import save_job, save_stage

    directory = sys.argv[1]
    losses = []
    for step in range(1, 10_000):
        losses.append(float(step))
        for k in range(2):
            save_stage(directory, step, k, {"w": np.full((2_000_000,), step, np.float32)})
        save_job(directory, step, losses)
        print(step, flush=True)
""")


@pytest.mark.parametrize("delay_s", [0.7, 1.9, 3.1])
def test_a_writer_killed_while_saving_resumes_from_the_last_complete_step(tmp_path, delay_s):
    """SIGKILL lands at an arbitrary moment of a stream of 8 MB saves (often mid-file); whatever it cut, the
    directory resumes from a step every stage can read back, no older than the last one the writer reported."""
    claim(tmp_path, "run-a")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    reported = []
    deadline = time.monotonic() + 120
    while not reported and time.monotonic() < deadline:  # let it get going (imports) before the clock starts
        reported.append(int(proc.stdout.readline()))
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    reported += [int(line) for line in proc.stdout.read().split()]
    proc.wait()
    step, losses, _note = resume_point(tmp_path, 2)
    assert step >= reported[-1] >= 1
    assert losses == [float(s) for s in range(1, step + 1)]
    for k in range(2):
        assert verify_step(tmp_path, step, k) is None
        assert load_stage(tmp_path, step, k, template={"w": np.zeros((2_000_000,), np.float32)})["w"][7] == step
