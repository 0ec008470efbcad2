"""``al.launch``: train a plan on Ray, from a notebook or the command line.

With no address, an embedded Ray starts in this process (nothing to set up) and the job's driver runs in a
background thread; with ``ray_address="http://HEAD:8265"`` the job is submitted to an existing cluster through the
Ray Jobs API, with a runtime_env carrying the job spec (model by zoo name and config, the plan as JSON) and the
``autopar_lab`` package. Either way the same driver runs (:mod:`autopar_lab.runtime.train_entry`), and the returned
:class:`Job` streams progress (step, loss, samples/s, per-stage time), can be cancelled, and reports the measured
per-stage times beside the plan's predictions.

    >>> job = launch(plan, model, steps=20, checkpoint_dir="ck", checkpoint_every=5)   # doctest: +SKIP
    >>> job.subscribe(lambda ev: print(ev.step, ev.loss))                               # doctest: +SKIP
    >>> job.wait()["losses"]                                                            # doctest: +SKIP

Security. The embedded cluster listens on the loopback interface only (Ray's single-machine mode:
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` while it starts, node address 127.0.0.1, no dashboard), and it uses Ray's
token authentication: ``RAY_AUTH_MODE=token`` unless you set ``RAY_AUTH_MODE`` yourself (then that is respected). The
token is yours if you have one (``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else
``~/.ray/auth_token``); otherwise a throwaway random token is written into the cluster's private temporary directory
and removed with it (nothing is written to your home directory). For a token-protected remote cluster, set
``RAY_AUTH_MODE=token`` and the cluster's token (``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``, or
``~/.ray/auth_token``) before launching: the Jobs API client sends it as a bearer token.

Ray is imported only on these launch paths, never by ``import autopar_lab``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from urllib.parse import urlparse

from ..plan import plan_object
from .progress import ProgressChannel, ProgressEvent, parse_event
from .train_entry import (RESULT_PREFIX, JobFailed, RunOptions, check_local_gpus, check_resources, job_spec,
                          local_gpu_count, run_job)

__all__ = ["launch", "Job", "RemoteJob", "start_local_ray", "shutdown_local_ray", "local_ray_head", "remote_submission",
           "JobFailed"]

_LOCAL: dict = {"owned": False, "temp_dir": None, "env_set": (), "head": None}
_LOCK = threading.RLock()
_RUNNING: "weakref.WeakSet[Job]" = weakref.WeakSet()  # local jobs whose driver thread may still call Ray


# ------------------------------------------------------------------------------------------------ embedded Ray

def _has_token() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    try:
        return bool(Path(path).read_text().strip())
    except OSError:
        return False


def start_local_ray(num_cpus: int | None = None, object_store_memory: int | None = None, attempts: int = 3,
                    timeout_s: float | None = None):
    """The embedded Ray (started once per process), or the Ray this process is already connected to; the ``ray``
    module, connected.

    The head runs in a process group this library owns (:mod:`autopar_lab.runtime.rayhead`): it outlives the thread
    that started it, a Ctrl-C in the terminal does not reach it, and it is stopped (with its temporary directory) by
    :func:`shutdown_local_ray`, at exit, or when this process dies. Every service listens on 127.0.0.1 (Ray's
    single-machine mode, node address 127.0.0.1, no dashboard). Authentication: ``RAY_AUTH_MODE=token`` unless the
    environment sets ``RAY_AUTH_MODE`` (then that is respected); the token is Ray's (``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) or, when none exists, a fresh random one in the cluster's
    private temporary directory (mode 0700), for its lifetime only; nothing is written to the home directory.
    A head that does not start within ``timeout_s`` (default ``AUTOPAR_RAY_START_TIMEOUT`` or 300 s) raises
    RuntimeError, and nothing of it is left behind.
    """
    from .rayhead import HeadFailed, RayHead

    with _LOCK:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            return sys.modules["ray"]
        if timeout_s is None:
            timeout_s = float(os.environ.get("AUTOPAR_RAY_START_TIMEOUT", 300))
        set_here = []
        if "RAY_AUTH_MODE" not in os.environ:
            os.environ["RAY_AUTH_MODE"] = "token"
            set_here.append("RAY_AUTH_MODE")
        # 0700: only this user can read what is inside. Its name stays short (Ray's socket paths under it must fit
        # in 107 bytes); the file "pid" says which process's Ray it is, for whoever cleans up beside other Rays.
        temp_dir = tempfile.mkdtemp(prefix="autopar-ray-")
        (Path(temp_dir) / "pid").write_text(str(os.getpid()))
        if os.environ["RAY_AUTH_MODE"].lower() == "token" and not _has_token():
            token_file = Path(temp_dir) / "auth_token"
            token_file.write_text(secrets.token_hex(32))
            token_file.chmod(0o600)
            os.environ["RAY_AUTH_TOKEN_PATH"] = str(token_file)
            set_here.append("RAY_AUTH_TOKEN_PATH")
        _LOCAL.update(temp_dir=temp_dir, env_set=tuple(set_here))
        try:
            last = None
            for _ in range(max(int(attempts), 1)):
                try:
                    head = RayHead.start(temp_dir, num_cpus=num_cpus, object_store_memory=object_store_memory,
                                         timeout_s=timeout_s)
                except HeadFailed as e:
                    # The raylet's fixed wait for its agents (ray-project/ray#65983) is taken out of the start
                    # (rayhead.head_args); other start failures on a loaded machine often pass on a fresh attempt.
                    last = e
                    continue
                _LOCAL["head"] = head
                ray = _connect(head.address)
                _LOCAL["owned"] = True
                return ray
            raise RuntimeError(f"the embedded Ray did not start ({str(last)[:300]}); on a busy machine try again "
                               "(AUTOPAR_RAY_START_TIMEOUT sets how long to wait), or start Ray yourself and pass "
                               "its address.")
        except BaseException:
            _stop_head()
            _cleanup_local()
            raise


class _QuietThreadWarning(logging.Filter):
    """Drops Ray's "SIGTERM handler is not set" warning: connecting from a worker thread is how this module works."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def _connect(address: str):
    """``ray.init`` as a driver of the head at ``address``, from any thread. Ray's own SIGTERM handler (installed when
    connecting from the main thread) is put back to what it was: this process's signals are its owner's."""
    import ray
    from ray._private import auto_init_hook, ray_constants
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # Ray 2.60+, no stub

    # Ray loads the auth token once per process and caches it: a second embedded Ray in this process (a new throwaway
    # token in a new folder) would be refused with the first one's ("InvalidAuthToken"). Read it afresh.
    AuthenticationTokenLoader.instance().reset_cache()
    quiet = _QuietThreadWarning()
    logging.getLogger("ray._private.worker").addFilter(quiet)
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    # Single-machine mode while connecting, or Ray rewrites 127.0.0.1 to this host's network address, where the
    # loopback-only head does not listen (ray_constants read the variable at import: set both).
    saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"), ray_constants.ENABLE_RAY_CLUSTER
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address=address, _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False,
                 namespace="autopar-lab")
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]
        if saved[0] is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved[0]
        logging.getLogger("ray._private.worker").removeFilter(quiet)
        if main and before is not None:
            signal.signal(signal.SIGTERM, before)
    # A Ray call after shutdown_local_ray must fail, never quietly start a second head with Ray's defaults.
    _LOCAL["auto_connect"] = auto_init_hook.enable_auto_connect
    auto_init_hook.enable_auto_connect = False
    return ray


def _stop_head() -> None:
    head = _LOCAL.get("head")
    if head is not None:
        head.stop()
        _LOCAL["head"] = None


def _cleanup_local() -> None:
    for name in _LOCAL["env_set"]:
        os.environ.pop(name, None)
    if _LOCAL["temp_dir"]:
        shutil.rmtree(_LOCAL["temp_dir"], ignore_errors=True)
    _LOCAL.update(owned=False, temp_dir=None, env_set=())


def local_ray_head():
    """The :class:`~autopar_lab.runtime.rayhead.RayHead` of the embedded Ray, or None (for inspection and tests)."""
    return _LOCAL.get("head")


def shutdown_local_ray(timeout_s: float = 120.0) -> None:
    """Stop the embedded Ray (if this module started it), remove its temporary directory and token.

    Jobs still running on it are cancelled and waited for first (up to ``timeout_s``), so no job thread makes a Ray
    call after Ray is gone."""
    with _LOCK:
        if not _LOCAL["owned"]:
            return
        for job in list(_RUNNING):
            job.cancel()
        deadline = time.monotonic() + timeout_s
        for job in list(_RUNNING):
            if job._thread is not None:
                job._thread.join(max(deadline - time.monotonic(), 0.1))
        import ray

        try:
            ray.shutdown()
        finally:
            _stop_head()
            _cleanup_local()
            if not any(job._thread is not None and job._thread.is_alive() for job in _RUNNING):
                from ray._private import auto_init_hook

                auto_init_hook.enable_auto_connect = _LOCAL.pop("auto_connect", auto_init_hook.enable_auto_connect)


atexit.register(shutdown_local_ray)


# ---------------------------------------------------------------------------------------------------- handles

class Job:
    """A training job on the embedded Ray: progress, cancel, result.

    ``status()``: "running", "done", "cancelled" or "error". ``wait()`` returns the result dict (losses,
    step_time_s, stage_times, restarts, ...) and raises JobFailed if the job failed. ``losses`` and ``progress``
    grow while it runs; ``subscribe(cb)`` calls ``cb(event)`` for every :class:`ProgressEvent` (past ones first).
    """

    def __init__(self, spec: dict, channel: ProgressChannel):
        self.spec = spec
        self.channel = channel
        self.result: dict | None = None
        self._actors: list = []
        self._thread: threading.Thread | None = None

    # started by launch()
    def _start(self, ray):
        def body():
            try:
                self.result = run_job(self.spec, self.channel, ray, on_actors=self._set_actors)
            except BaseException as e:  # noqa: BLE001 - the thread must always leave a result behind
                self.result = {"status": "error", "message": f"{type(e).__name__}: {e}", "losses": []}
                if not self.channel.finished:
                    self.channel.publish(ProgressEvent(kind="error", message=self.result["message"]))
            finally:
                _RUNNING.discard(self)

        self._thread = threading.Thread(target=body, name="autopar-lab-job", daemon=True)
        _RUNNING.add(self)
        self._thread.start()

    def _set_actors(self, handles):
        self._actors = list(handles)

    def stage_actors(self) -> list:
        """The current stage actors (Ray handles), one per stage: for inspection or fault-injection tests."""
        return list(self._actors)

    def status(self) -> str:
        if self.result is not None:
            return self.result["status"]
        return "running"

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the job ends (or ``timeout`` seconds: TimeoutError); the result dict."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the job is still running after {timeout} s.")
        if self.result is None:
            raise JobFailed("the job ended without a result.")
        if self.result["status"] == "error":
            raise JobFailed(self.result["message"])
        return self.result

    def cancel(self) -> None:
        """Stop the job cleanly at the end of the current step."""
        self.channel.cancel()

    def subscribe(self, callback, replay: bool = True):
        return self.channel.subscribe(callback, replay=replay)

    @property
    def losses(self) -> list[float]:
        return self.channel.losses

    @property
    def progress(self) -> list[ProgressEvent]:
        return list(self.channel.events)

    @property
    def checkpoint_dir(self):
        return self.spec.get("checkpoint_dir")

    def stage_times(self) -> list[dict]:
        """Per stage: measured forward / backward seconds per microbatch (medians over steps after the first) beside
        the plan's predicted Stage.fwd_s / bwd_s, and their ratios; from the finished job's result."""
        if self.result is None or "stage_times" not in self.result:
            return [{"stage": k, "predicted_fwd_s": p["fwd_s"], "predicted_bwd_s": p["bwd_s"],
                     "measured_fwd_s": None, "measured_bwd_s": None} for k, p in enumerate(self.spec["predicted"])]
        return self.result["stage_times"]

    def __repr__(self):
        return f"Job({self.spec['model']}, {self.status()}, {len(self.losses)}/{self.spec['steps']} steps)"


class RemoteJob(Job):
    """A job submitted to a cluster through the Ray Jobs API; progress comes from the job's log lines."""

    def __init__(self, spec: dict, channel: ProgressChannel, client, job_id: str, workdir: str):
        super().__init__(spec, channel)
        self.client = client
        self.job_id = job_id
        self._workdir = workdir

    def _start(self, ray=None, poll_s: float = 1.0):
        def body():
            seen = 0
            try:
                while True:
                    status = str(self.client.get_job_status(self.job_id)).split(".")[-1]
                    logs = self.client.get_job_logs(self.job_id)
                    lines = logs.splitlines()
                    for line in lines[seen:]:
                        ev = parse_event(line)
                        if ev is not None:
                            self.channel.publish(ev)
                        elif line.startswith(RESULT_PREFIX):
                            self.result = json.loads(line[len(RESULT_PREFIX):])
                    seen = len(lines)
                    if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                        break
                    time.sleep(poll_s)
                if self.result is None:
                    msg = {"STOPPED": "the job was stopped"}.get(status, f"the job ended {status} without a result; "
                                                                         "see its logs on the cluster")
                    self.result = {"status": "cancelled" if status == "STOPPED" else "error", "message": msg,
                                   "losses": self.channel.losses}
                    if not self.channel.finished:
                        kind = "cancelled" if status == "STOPPED" else "error"
                        self.channel.publish(ProgressEvent(kind=kind, message=msg))
            except Exception as e:  # noqa: BLE001
                self.result = {"status": "error", "message": f"lost the job's progress: {e}", "losses": []}
            finally:
                shutil.rmtree(self._workdir, ignore_errors=True)

        self._thread = threading.Thread(target=body, name="autopar-lab-remote-job", daemon=True)
        self._thread.start()

    def status(self) -> str:
        if self.result is not None:
            return self.result["status"]
        return "running"

    def cancel(self) -> None:
        """Stop the job on the cluster (the Jobs API stops its driver and with it the stage actors)."""
        self.channel.cancel()
        self.client.stop_job(self.job_id)


# ----------------------------------------------------------------------------------------------- remote clusters

def _check_address(address: str) -> tuple[str, int]:
    url = urlparse(address)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"ray_address must be the Ray dashboard's HTTP address, like http://HEAD:8265, got "
                         f"{address!r}; leave it out to train on an embedded local Ray.")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=5):
            pass
    except OSError as e:
        raise ValueError(f"cannot reach a Ray cluster at {address} ({e.strerror or e}); check the address (the "
                         "dashboard's, usually port 8265) and that the cluster is up.") from None
    return url.hostname, port


def remote_submission(spec: dict, workdir: str | os.PathLike) -> tuple[str, dict]:
    """The Jobs API entrypoint and runtime_env of a job spec: the spec (plan included) written to ``workdir`` (the
    job's working_dir) and the ``autopar_lab`` package shipped as a py_module."""
    workdir = Path(workdir)
    (workdir / "job.json").write_text(json.dumps(spec))
    package = Path(__file__).resolve().parents[1]
    runtime_env = {
        "working_dir": str(workdir),
        "py_modules": [str(package)],
        "excludes": ["__pycache__", "*.pyc"],
        "env_vars": {"PYTHONUNBUFFERED": "1"},
    }
    return "python -m autopar_lab.runtime.train_entry job.json", runtime_env


AGENT_WAIT_S = 120.0  # how long a submission waits for a new head's job agent before giving up


def submit_when_ready(client, entrypoint: str, runtime_env: dict, *, wait_s: float = AGENT_WAIT_S,
                      poll_s: float = 1.0) -> str:
    """``client.submit_job(...)``, retried while the head answers that its job agent is not up yet.

    A head started moments ago refuses jobs with "No available agent to submit job, please try again later" for a
    few seconds (longer on a loaded machine); users of ``ray job submit`` retry by hand. Any other refusal, or the
    same one after ``wait_s`` seconds, is raised as it came.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        except Exception as e:  # noqa: BLE001 - the Jobs SDK raises RuntimeError for HTTP errors
            m = str(e).lower()
            if ("no available agent" not in m and "try again later" not in m) or time.monotonic() >= deadline:
                raise
            time.sleep(poll_s)


def _submit(spec: dict, address: str, channel: ProgressChannel) -> RemoteJob:
    _check_address(address)
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
    except Exception as e:  # noqa: BLE001 - connection and auth failures: one clear sentence
        text = " ".join(str(e).split())
        hint = ("; the cluster uses token authentication: set RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN or "
                "RAY_AUTH_TOKEN_PATH)" if any(w in text.lower() for w in ("401", "403", "auth", "token")) else "")
        raise ValueError(f"cannot connect to the Ray Jobs API at {address} ({text[:200]}){hint}.") from None
    workdir = tempfile.mkdtemp(prefix="autopar-job-")
    entrypoint, runtime_env = remote_submission(spec, workdir)
    try:
        job_id = submit_when_ready(client, entrypoint, runtime_env)
    except Exception as e:  # noqa: BLE001
        shutil.rmtree(workdir, ignore_errors=True)
        raise ValueError(f"the cluster at {address} refused the job ({' '.join(str(e).split())[:300]}).") from None
    job = RemoteJob(spec, channel, client, job_id, workdir)
    job._start()
    return job


# -------------------------------------------------------------------------------------------------------- launch

def launch(plan, model, steps: int, *, ray_address: str | None = None, options: RunOptions = RunOptions(),
           num_cpus: int | None = None, on_progress=None, wait: bool = False) -> Job:
    """Train ``model`` with ``plan`` for ``steps`` steps on Ray; returns a :class:`Job` (or waits for it).

    ``ray_address``: None for an embedded local Ray (loopback only), or a cluster's dashboard address
    (``http://HEAD:8265``) to submit through the Jobs API. ``options`` (:class:`RunOptions`): the seed, per-stage
    checkpoints every N steps (and at the end; a dead stage actor restarts from the last one; ``resume`` continues a
    run from its directory; a directory holding another run's checkpoints is refused unless ``overwrite``), the
    device kind ("cpu": stages on CPU devices, JAX_NUM_CPU_DEVICES per actor; "gpu": num_gpus per actor; default:
    what the plan's cluster has), XLA options, restarts. ``num_cpus``: CPUs of the embedded Ray (default: one per
    stage). ``on_progress(event)``: subscribed before the job starts.

    Bad input raises ValueError before anything starts: a plan made for another model, an unreachable address, a
    cluster without enough devices for the plan (for the embedded Ray, a plan on GPUs is checked against this
    machine's GPUs before Ray starts), a checkpoint directory that is not writable, belongs to another
    run, or cannot be resumed. The embedded Ray failing to start raises RuntimeError.
    """
    plan_object(plan, "al.launch")
    spec = job_spec(plan, model, steps, options=options)
    if ray_address and spec.get("model_spec") is not None:
        raise ValueError(f"model {model.name!r} is your own (its step function lives in this Python process), and a "
                         "job on a remote cluster rebuilds its model by zoo name; train it on the embedded Ray (leave "
                         "ray_address out) or with al.execute.")
    channel = ProgressChannel()
    if on_progress is not None:
        channel.subscribe(on_progress)
    job: Job
    if ray_address:
        job = _submit(spec, str(ray_address), channel)
    else:
        if spec["checkpoint_dir"]:  # refuse a directory that is not ours to write before Ray starts
            from .checkpoint import claim

            # The stage actors work in the directory the head was started from, which need not be this one (a
            # notebook that changed directory since, a head another launch started): a relative path means here.
            spec["checkpoint_dir"] = os.path.abspath(spec["checkpoint_dir"])

            spec["run_id"], _ = claim(spec["checkpoint_dir"], spec["run_id"], resume=spec["resume"],
                                      overwrite=spec["overwrite"])
        # The stage actors take the plan object itself (through Ray's object store), not the JSON they would load,
        # trace and price again; the spec stays JSON for a cluster (this key is never sent there).
        spec["plan_instance"] = plan
        S = len(spec["plan"]["stages"])
        if not ("ray" in sys.modules and sys.modules["ray"].is_initialized()):
            check_local_gpus(spec, local_gpu_count())  # seconds, not the minute a Ray start takes, to refuse
        ray = start_local_ray(num_cpus=num_cpus if num_cpus is not None else max(S, 1))
        check_resources(ray, spec)
        job = Job(spec, channel)
        job._start(ray)
    if wait:
        job.wait()
    return job
