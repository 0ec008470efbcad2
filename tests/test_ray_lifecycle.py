"""The embedded Ray's life (issues 12 and 19): started from a thread that ends, it lives until the job ends and is
stopped after; Ctrl-C and SIGTERM during `train` stop the job cleanly, keep a final checkpoint, stop the Ray the
command started and nothing else, exit 130 / 143 with one sentence, and never start a second Ray head.

Each test starts its own Ray (a minute on two busy cores), so all are marked slow. RAY_AUTH_MODE is set explicitly
(token, with a throwaway token) and everything a test creates is removed.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import autopar_lab as al

OPTS = {"xla_backend_optimization_level": 0}
pytestmark = pytest.mark.slow


@pytest.fixture()
def token_auth(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(16))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _ray_default_sessions() -> set[str]:
    """Session folders in Ray's default temporary directory: a second, unhardened head would leave one there."""
    base = Path(tempfile.gettempdir()) / "ray"
    return {p.name for p in base.glob("session_2*")} if base.is_dir() else set()


def _listening_ports(pgid: int) -> set[int]:
    """TCP ports the processes of process group ``pgid`` listen on."""
    import psutil

    ports = set()
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                ports |= {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        except (psutil.Error, ProcessLookupError):
            continue
    return ports


# Ray's fixed defaults: the node agent's HTTP port (the Jobs API submits through it) and Ray Client's server.
RAY_DEFAULT_PORTS = {52365, 10001}


@pytest.fixture(scope="module")
def thread_launched():
    """A 3-step job launched from a worker thread that then ends, as the workbench's "launch on Ray" button does; its
    embedded head is kept up (for the tests that read it) until test_the_thread_launched_head_stops_and_leaves_nothing
    stops it. One head for the three tests: each head start and stop is ~7 CPU-s on two busy cores. RAY_AUTH_MODE is
    token with a throwaway token, put back after."""
    from autopar_lab.runtime import launch as L

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "token")
        mp.setenv("RAY_AUTH_TOKEN", secrets.token_hex(16))
        model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)
        plan = al.megatron_plan(model, al.Cluster.preset("cpu"), dp=2, tp=2, pp=2, microbatches=2)
        before = _ray_default_sessions()
        holder, seen = {}, []

        def on_step(ev):  # runs in the job's thread, long after the launching thread ended
            if ev.kind == "step":
                head = L.local_ray_head()
                seen.append((ev.step, head is not None and head.alive() and _group_alive(head.ray_group)))

        def work():  # launch from a worker thread that then ends
            holder["job"] = al.launch(plan, model, 3, on_progress=on_step,
                                      options=al.RunOptions(compiler_options=OPTS))

        t = threading.Thread(target=work)
        t.start()
        t.join()
        try:
            yield {"thread": t, "holder": holder, "seen": seen, "before": before, "head": L.local_ray_head(),
                   "temp_dir": L._LOCAL["temp_dir"]}
        finally:
            L.shutdown_local_ray()


def test_launch_from_a_short_lived_thread_trains_and_ray_outlives_the_thread(thread_launched):
    from autopar_lab.runtime import launch as L

    t, holder, seen, head = (thread_launched[k] for k in ("thread", "holder", "seen", "head"))
    assert not t.is_alive() and "job" in holder
    result = holder["job"].wait(timeout=900)
    assert result["status"] == "done" and len(result["losses"]) == 3
    assert seen == [(1, True), (2, True), (3, True)]  # the head was up for every step
    assert L.local_ray_head() is head
    assert head.alive() and _group_alive(head.ray_group)  # and still is, until it is stopped
    # It leaves Ray's default ports free: a head the user starts on this machine (`ray start --head`) keeps its
    # job agent (CI saw "No available agent to submit job" while an embedded head held 52365).
    ports = _listening_ports(head.ray_group)
    assert ports and not ports & RAY_DEFAULT_PORTS, sorted(ports)


def _group_processes(pgid: int) -> dict[int, list[str]]:
    """The command lines of the processes of process group ``pgid``."""
    import psutil

    out = {}
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                out[proc.pid] = proc.cmdline()
        except (psutil.Error, ProcessLookupError):
            continue
    return out


def test_the_embedded_head_gives_its_agents_their_ports_and_starts_no_ui_monitors_or_client_server(thread_launched):
    """What keeps the start robust on a busy machine (issue 32): the raylet takes the agents' ports from the library
    (so it does not wait on their port files), and Ray starts no dashboard UI, autoscaler monitor, log monitor or
    client server. (On the thread-launched job's head: an embedded head like any other, see start_local_ray.)"""
    import ray

    from autopar_lab.runtime import launch as L
    from autopar_lab.runtime import rayhead
    from autopar_lab.runtime.rayhead import HEAD_ENV_DEFAULTS

    head = thread_launched["head"]
    assert L.local_ray_head() is head and ray.is_initialized()
    flags = dict(a[2:].split("=", 1) for a in head.args if a.startswith("--") and "=" in a)
    node = ray._private.worker._global_node  # the node as the GCS registered it
    assert node.dashboard_agent_listen_port == int(flags["dashboard-agent-listen-port"])
    assert node.metrics_agent_port == int(flags["dashboard-agent-grpc-port"])
    assert node.metrics_export_port == int(flags["metrics-export-port"])
    assert node.runtime_env_agent_port == int(flags["runtime-env-agent-port"])
    procs = _group_processes(head.ray_group)
    lines = [" ".join(c) for c in procs.values()]
    assert not [c for c in lines if "autoscaler/_private/monitor.py" in c or "log_monitor.py" in c], lines
    # nor a Ray Client server (drivers connect to the GCS), and the watcher runs without importing the package
    assert not [c for c in lines if "ray.util.client.server" in c], lines
    watcher = _group_processes(head.pid)[head.pid]
    assert watcher[1:3] == ["-I", str(Path(rayhead.__file__).resolve())], watcher
    # Ray always runs its API server (dashboard.py); without the dashboard it serves no page, one module
    api = [c for c in lines if "dashboard/dashboard.py" in c]
    assert len(api) == 1 and "--disable-frontend" in api[0] and "--modules-to-load=UsageStatsHead" in api[0]
    raylet = next(pid for pid, c in procs.items() if c and c[0].endswith("/raylet"))
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{raylet}/environ").read_text().split("\0") if "=" in kv)
    assert {k: env.get(k) for k in HEAD_ENV_DEFAULTS} == HEAD_ENV_DEFAULTS
    assert env["RAY_AUTH_MODE"] == "token"  # as the caller set it
    assert ray.get(ray.remote(lambda: 6 * 7).remote()) == 42  # and it runs tasks


def test_the_thread_launched_head_stops_and_leaves_nothing(thread_launched):
    from autopar_lab.runtime import launch as L

    head, temp_dir = thread_launched["head"], thread_launched["temp_dir"]
    assert head is not None and temp_dir is not None
    L.shutdown_local_ray()
    assert not head.alive() and not _group_alive(head.pid) and not _group_alive(head.ray_group)  # all gone
    assert not os.path.exists(temp_dir)  # token and Ray's session files with it
    assert _ray_default_sessions() == thread_launched["before"]


def test_a_head_whose_owner_dies_is_stopped_and_its_token_removed(token_auth, tmp_path):
    """A SIGKILLed notebook kernel cannot clean up: the head notices its owner is gone and removes itself."""
    code = ("import os, sys, time\n"
            "from autopar_lab.runtime.launch import start_local_ray, local_ray_head, _LOCAL\n"
            "start_local_ray(num_cpus=1)\n"
            "print(local_ray_head().ray_group, _LOCAL['temp_dir'], flush=True)\n"
            "time.sleep(600)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("RAY_AUTH_TOKEN")  # the throwaway token is written into the session's private folder
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pgid, temp_dir = owner.stdout.readline().split()
        assert (Path(temp_dir) / "auth_token").exists() and _group_alive(int(pgid))
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 120
    while (_group_alive(int(pgid)) or os.path.exists(temp_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_alive(int(pgid)) and not os.path.exists(temp_dir)


def ray_folders_of(pid: int) -> set[Path]:
    """The embedded-Ray folders process ``pid`` made (their "pid" file): tests on other xdist workers start Rays of
    their own meanwhile, whose folders come and go."""
    out = set()
    for folder in Path(tempfile.gettempdir()).glob("autopar-ray-*"):
        try:
            if (folder / "pid").read_text() == str(pid):
                out.add(folder)
        except OSError:  # not ours, or being removed
            pass
    return out


def _train(args, cwd, env):
    return subprocess.Popen([sys.executable, "-m", "autopar_lab", "train", "gpt-tiny", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture()
def plan_file(tmp_path):
    model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)
    plan = al.megatron_plan(model, al.Cluster.preset("cpu"), dp=2, tp=2, pp=2, microbatches=2)
    path = tmp_path / "plan.json"
    al.save_plan(plan, path)
    return path


def test_ctrl_c_during_train_stops_cleanly_keeps_a_checkpoint_and_resumes(token_auth, plan_file, tmp_path, capsys,
                                                                         monkeypatch):
    """Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group, Ray's processes included."""
    from autopar_lab.cli import main

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    before = _ray_default_sessions()
    common = ["--batch", "8", "--layers", "2", "--plan", str(plan_file), "--fast-compile", "--checkpoint-dir", "ck"]
    proc = _train([*common, "--steps", "40", "--checkpoint-every", "100"], tmp_path, env)
    for line in proc.stdout:
        if line.startswith("step 2/"):
            os.killpg(proc.pid, signal.SIGINT)
            break
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("autopar-lab: interrupted (SIGINT): stopped after step ")
    stopped = int(lines[0].split("stopped after step ")[1].split()[0])
    assert stopped >= 2 and f"checkpoint at step {stopped} in ck" in lines[0]
    record = json.loads((tmp_path / "ck" / "job.json").read_text())
    assert record["step"] == stopped and len(record["losses"]) == stopped  # the final checkpoint, never configured
    assert _ray_default_sessions() == before  # no second head behind the user's back
    # a new run may not overwrite it (refused before Ray starts: the CLI in this process, not a third interpreter
    # start); --resume goes on from where Ctrl-C stopped it
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["train", "gpt-tiny", *common, "--steps", "4"]) == 2
    refused = capsys.readouterr().err
    assert "holds the checkpoints of run" in refused and "--resume" in refused
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    r = subprocess.run([sys.executable, "-m", "autopar_lab", "train", "gpt-tiny", *common, "--steps",
                        str(stopped + 1), "--resume", "--json"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["steps_run"] == stopped + 1 and result["losses"][:stopped] == record["losses"]


def test_sigterm_while_ray_starts_exits_143_and_leaves_nothing(token_auth, plan_file, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    proc = _train(["--batch", "8", "--layers", "2", "--plan", str(plan_file), "--steps", "5"], tmp_path, env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait for its Ray folder to appear: the head is starting
        new = ray_folders_of(proc.pid)
        if any((p / "auth_token").exists() or any(p.glob("head-*")) for p in new if p.is_dir()):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    assert err.strip() == "autopar-lab: interrupted (SIGTERM): before training started."
    time.sleep(1)
    assert ray_folders_of(proc.pid) == set()


def test_a_head_that_does_not_start_in_time_is_a_clear_error_and_leaves_nothing(token_auth):
    from autopar_lab.runtime import launch as L

    before = ray_folders_of(os.getpid())
    with pytest.raises(RuntimeError, match=r"the embedded Ray did not start \(the Ray head did not start within 1 s"):
        L.start_local_ray(num_cpus=1, attempts=1, timeout_s=1)
    assert L.local_ray_head() is None and not L._LOCAL["owned"]
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    time.sleep(1)
    assert ray_folders_of(os.getpid()) - before == set()
