"""The README's examples run as written: its Python blocks (the Ray launch too) and its command-line plan-then-train
example, from a working directory other than the repository's."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def bash_commands() -> list[list[str]]:
    """Each `.venv/bin/autopar-lab ...` command of the README's bash blocks, as argv (comments dropped)."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():  # a command continued with a backslash is one line
            if line.startswith(".venv/bin/autopar-lab "):
                out.append(shlex.split(line, comments=True)[1:])
    return out


@pytest.mark.slow
def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = python_blocks()
    runnable = [b for b in blocks if "al.launch(" not in b]
    assert len(blocks) >= 4 and len(runnable) == len(blocks) - 1, "README's example blocks changed: update this test"
    monkeypatch.chdir(tmp_path)  # the examples write plan.json
    scope: dict = {}
    for k, block in enumerate(runnable):
        exec(compile(block, f"README.md python block {k + 1}", "exec"), scope)
    assert (tmp_path / "plan.json").exists()
    assert len(scope["runner"].train(1)) == 1  # the pipeline the last block built keeps training


@pytest.mark.slow  # trains 20 steps on the shared embedded Ray (conftest's shared_ray), which the block's launch uses
def test_readme_ray_launch_block_runs(tmp_path, monkeypatch, shared_ray):
    from autopar_lab.runtime.checkpoint import steps_of

    blocks = python_blocks()
    launch = next(b for b in blocks if "al.launch(" in b)
    builds = next(b for b in blocks if "al.execute(" in b)  # the block that makes `plan` and `model`
    monkeypatch.chdir(tmp_path)  # the launch writes ckpt/
    scope: dict = {"al": __import__("autopar_lab")}
    exec(compile(builds.replace("runner.train(3)", "").replace("runner.stage_times()", ""), "README.md", "exec"),
         scope)
    exec(compile(launch, "README.md launch block", "exec"), scope)
    job = scope["job"]
    assert job.status() == "done" and len(job.losses) == 20
    assert [r["stage"] for r in job.stage_times()] == [0, 1]
    assert json.loads((tmp_path / "ckpt" / "job.json").read_text())["step"] == 20
    # the stage actors wrote here too, though the shared head was started from another directory
    assert steps_of(tmp_path / "ckpt", 0) == steps_of(tmp_path / "ckpt", 1) == [5, 10, 15, 20]


@pytest.mark.slow  # plans, then trains on the embedded Ray, as separate processes
def test_readme_command_line_plan_then_train_runs(tmp_path):
    commands = bash_commands()
    plan = next(c for c in commands if c[:2] == ["plan", "gpt-tiny"] and "cpu:1" in c and "--out" in c)
    train = next(c for c in commands if c[:2] == ["train", "gpt-tiny"])
    assert train[train.index("--plan") + 1] == plan[plan.index("--out") + 1], "README: train reads what plan wrote"
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu", RAY_AUTH_MODE="token")
    run = [sys.executable, "-m", "autopar_lab"]
    r = subprocess.run(run + plan, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(run + train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    steps = int(train[train.index("--steps") + 1])
    assert len(out["losses"]) == steps and out["step_time_s"] > 0 and out["stages"] == 2
