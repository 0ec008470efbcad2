"""al.launch(ray_address=...) through the Ray Jobs API, against a token-protected Ray head started on loopback here
(the way a user would run a cluster: `ray start --head`), with the plan and the package shipped in the runtime_env."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import autopar_lab as al
from autopar_lab.runtime.rayhead import announce_agent_listen_port


def _stop_head(temp: Path) -> None:
    """Stop the Ray head started with ``--temp-dir=temp`` and nothing else: its processes name that directory (their
    session directory is inside it). Not `ray stop --force`, which stops every Ray of the user: the Ray runs of other
    test files running beside this one on the other xdist worker, and anything else the user runs."""
    import psutil  # Ray's own dependency

    def ours(p) -> bool:
        try:
            return any(str(temp) in arg for arg in (p.cmdline() or ()))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    procs = [p for p in psutil.process_iter() if ours(p)]
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=30)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_remote_job_on_a_token_protected_head_matches_local_execution(tmp_path):
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        pytest.skip("the ray command is not installed beside this Python")
    token = secrets.token_hex(16)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "JAX_PLATFORMS": "cpu",
           # the job's entrypoint runs `python` from PATH on the head: this venv's, as on a cluster set up for it
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    gcs, dash, listen = _free_port(), _free_port(), _free_port()
    temp = Path("/tmp") / f"autopar-ray-{secrets.token_hex(4)}"  # Ray's socket paths must stay short
    start = [str(ray_bin), "start", "--head", f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
             "--include-dashboard=true", "--num-cpus=4", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
             f"--temp-dir={temp}", f"--dashboard-agent-listen-port={listen}",
             f"--ray-client-server-port={_free_port()}",  # free of any other Ray here (Ray's defaults are fixed)
             # given, so that the raylet does not wait on the agents' port files (a fixed 15 s, ray-project/ray#65983)
             f"--dashboard-agent-grpc-port={_free_port()}", f"--metrics-export-port={_free_port()}",
             f"--runtime-env-agent-port={_free_port()}"]
    proc = subprocess.Popen(start, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The HTTP port the raylet still reads from the agent's file: written as the library does for its own head,
        # or a loaded machine (the agent loads every dashboard module first) fails the start.
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            announce_agent_listen_port(str(temp), listen)
            time.sleep(0.2)
        try:
            _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"ray start did not finish in 240 s: {err[-2000:]}")
        if proc.returncode != 0:
            pytest.fail(f"ray start failed: {err[-2000:]}")
        model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)
        plan = al.megatron_plan(model, al.Cluster.preset("cpu", hosts=1), dp=2, tp=2, pp=2, microbatches=2)
        al.save_plan(plan, tmp_path / "plan.json")
        # The client runs in its own process, as a user's would: Ray keeps the first auth token a process loads.
        # The two clients (with and without the token) and the local reference run side by side: each mostly
        # waits (on its interpreter's start, the job's polling, the head), one after another they took ~130 s.
        train = subprocess.Popen([sys.executable, "-m", "autopar_lab", "train", "gpt-tiny", "--layers", "2", "--batch",
                                  "8", "--plan", str(tmp_path / "plan.json"), "--steps", "2",
                                  "--ray-address", f"http://127.0.0.1:{dash}", "--json"],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Without the token the cluster refuses the client, and the CLI says so in one sentence.
        no_token = {k: v for k, v in env.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
        no_token["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
        refused = subprocess.Popen([sys.executable, "-m", "autopar_lab", "train", "gpt-tiny", "--layers", "2",
                                    "--batch", "8", "--plan", str(tmp_path / "plan.json"), "--steps", "1",
                                    "--ray-address", f"http://127.0.0.1:{dash}", "--json"],
                                   env=no_token, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ref = al.execute(plan, model).train(2)
            train_out, train_err = train.communicate(timeout=600)
            _, refused_err = refused.communicate(timeout=300)
        finally:
            for p in (train, refused):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert train.returncode == 0, train_err[-2000:]
        losses = json.loads(train_out)["losses"]
        assert losses == pytest.approx(ref, rel=1e-6)
        assert refused.returncode == 2 and "token" in refused_err and "Traceback" not in refused_err
    finally:
        _stop_head(temp)
        shutil.rmtree(temp, ignore_errors=True)


class _StartingHead:
    """A Jobs client whose head refuses the first ``busy`` submissions as a just-started Ray head does."""

    def __init__(self, busy: int, message: str = "Request failed with status code 500: No available agent to "
                                                   "submit job, please try again later.."):
        self.busy, self.message, self.calls = busy, message, 0

    def submit_job(self, *, entrypoint, runtime_env):
        self.calls += 1
        if self.calls <= self.busy:
            raise RuntimeError(self.message)
        return f"raysubmit_{self.calls}"


def test_a_submission_waits_for_a_starting_heads_job_agent():
    from autopar_lab.runtime.launch import submit_when_ready

    head = _StartingHead(busy=3)
    assert submit_when_ready(head, "python x.py", {}, wait_s=30, poll_s=0.01) == "raysubmit_4"
    assert head.calls == 4


def test_a_submission_gives_up_on_other_refusals_at_once_and_on_a_missing_agent_after_the_wait():
    from autopar_lab.runtime.launch import submit_when_ready

    denied = _StartingHead(busy=5, message="Request failed with status code 401: Unauthorized")
    with pytest.raises(RuntimeError, match="401"):
        submit_when_ready(denied, "python x.py", {}, wait_s=30, poll_s=0.01)
    assert denied.calls == 1
    never = _StartingHead(busy=10**6)
    with pytest.raises(RuntimeError, match="No available agent"):
        submit_when_ready(never, "python x.py", {}, wait_s=0.05, poll_s=0.01)
    assert 1 < never.calls < 10**6
