"""The job's driver: start one actor per stage, walk the plan's schedule step by step, checkpoint, restart, report.

One driver for both ways a job runs:

- embedded local Ray (``al.launch(plan, model, steps)`` with no address): :func:`run_job` runs in a thread of the
  notebook's process and publishes to a :class:`~autopar_lab.runtime.progress.ProgressChannel` directly;
- a cluster through the Ray Jobs API: the job's entrypoint is ``python -m autopar_lab.runtime.train_entry job.json``
  (this module's :func:`main`), which connects to the cluster it runs in and prints every progress event, and the
  final result, as one tagged JSON line on stdout for the submitting side to read back from the job's logs.

A *job spec* is JSON (:func:`job_spec`): the model by zoo name and config, the plan as its planfile object, steps,
seed, checkpointing, and the plan's predicted per-stage times. Each step the driver submits every stage's tasks in
that stage's order (:func:`autopar_lab.simulate.task_order`: GPipe, 1F1B, interleaved over the stage's chunks, or
ZB-H1 with its weight-gradient tasks): a forward takes the refs of the forward outputs it reads, a backward the refs
of its consumers' input gradients, so Ray moves the values from actor to actor and each actor runs its tasks in the
order they were submitted. When a stage actor dies, the driver kills
the others, starts new ones from the last complete checkpoint and runs again from there.

    >>> spec = job_spec(plan, model, steps=4, checkpoint_dir="/tmp/ck", checkpoint_every=2)   # doctest: +SKIP
    >>> result = run_job(spec, ProgressChannel())                                              # doctest: +SKIP
    >>> result["losses"]                                                                       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .progress import EVENT_PREFIX, ProgressChannel, ProgressEvent, format_event

__all__ = ["RunOptions", "job_spec", "check_seed", "run_job", "check_resources", "main", "step_loss", "RESULT_PREFIX",
           "JobFailed"]

RESULT_PREFIX = "AUTOPAR_RESULT "


class JobFailed(RuntimeError):
    """The job could not go on (a stage failed to start, an error in a stage function, too many restarts)."""


def _config_dict(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def check_seed(seed, steps: int, name: str = "seed") -> None:
    """Raise ValueError (one sentence naming ``name``) unless every random key a run of ``steps`` steps makes from
    ``seed`` fits JAX's: the model's initial state takes ``seed``, step ``i``'s batch ``seed + i``, and
    ``jax.random.PRNGKey`` holds a 64-bit signed integer (a larger one fails inside JAX, after Ray started)."""
    low, high = -(2**63), 2**63 - max(int(steps), 1)
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise ValueError(f"{name} must be a whole number between {low} and {high} (JAX's random keys hold 64 bits and "
                         f"step i uses {name} + i), got {seed!r:.40}.")


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a training run on Ray goes, besides the plan, the model and the step count (:func:`job_spec`,
    :func:`autopar_lab.launch`).

    ``seed``: the model's initial state takes it and step ``i``'s batch ``seed + i`` (:func:`check_seed`).
    ``checkpoint_dir``: every stage's state is saved there at the end of the run (and when it is cancelled), and
    every ``checkpoint_every`` steps when that is positive; ``resume=True`` continues the run in it, ``overwrite=True``
    replaces another run's checkpoints there. ``device_kind``: "cpu" (the stages run on CPU devices) or "gpu";
    default: what the plan's cluster has. ``compiler_options``: XLA options for every stage program.
    ``max_restarts``: how many times a dead stage actor is restarted from the last checkpoint. Immutable: change one
    with a ``with_*`` method or :func:`dataclasses.replace`.

    >>> RunOptions().with_checkpoints("/tmp/ck", every=2).checkpoint_every
    2
    """

    seed: int = 0
    checkpoint_dir: str | os.PathLike | None = None
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False
    device_kind: str | None = None
    compiler_options: dict | None = None
    max_restarts: int = 3

    def with_checkpoints(self, directory: str | os.PathLike | None, *, every: int = 0, resume: bool = False,
                         overwrite: bool = False) -> RunOptions:
        """These options checkpointing into ``directory`` (every ``every`` steps when positive, and at the end)."""
        return dataclasses.replace(self, checkpoint_dir=directory, checkpoint_every=every, resume=resume,
                                   overwrite=overwrite)

    def with_seed(self, seed: int) -> RunOptions:
        return dataclasses.replace(self, seed=seed)


def job_spec(plan, model, steps: int, *, options: RunOptions = RunOptions(), env_vars: dict | None = None) -> dict:
    """The JSON job spec of training ``model`` with ``plan`` for ``steps`` steps (see the module docstring), run as
    ``options`` (:class:`RunOptions`) says.

    Checks, before anything starts: ``steps``, the seed (:func:`check_seed`) and checkpoint settings; that ``plan``
    was made for ``model``; that a zoo model can be rebuilt from its name and config (the actors rebuild it so); the
    device kind. A model of your own (``ModelSpec.from_step``) is carried as the object under ``"model_spec"``: the
    spec is then not JSON, and trains on an embedded Ray only.
    """
    seed, checkpoint_every = options.seed, options.checkpoint_every
    resume, overwrite = options.resume, options.overwrite
    device_kind, compiler_options, max_restarts = options.device_kind, options.compiler_options, options.max_restarts
    checkpoint_dir = os.fspath(options.checkpoint_dir) if options.checkpoint_dir else None
    from ..planfile import plan_to_dict
    from .actors import is_gpu_plan
    from .layouts import check_plan_matches

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive whole number, got {steps!r}.")
    check_seed(seed, steps)
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be 0 (only at the end) or a positive number of steps, got "
                         f"{checkpoint_every!r:.40}.")
    if checkpoint_every and not checkpoint_dir:
        raise ValueError("checkpoint_every needs a checkpoint_dir to write into; pass checkpoint_dir=... .")
    if resume and not checkpoint_dir:
        raise ValueError("resume=True needs the checkpoint_dir of the run to resume.")
    if resume and overwrite:
        raise ValueError("resume=True continues the run in checkpoint_dir and overwrite=True replaces it; pass one.")
    check_plan_matches(model, plan)
    from .. import models

    own = model.name not in models.names() or getattr(model, "family", None) == "custom"
    config = {} if own else _config_dict(model.config)
    if not own:
        try:
            rebuilt = models.get(model.name, **config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"model {model.name!r} cannot be rebuilt from its config ({e}).") from None
        check_plan_matches(rebuilt, plan)
        json.dumps(config)  # the spec must be JSON: fail here, not on the cluster
    env_vars = dict(env_vars or {})
    if own:  # the actors (local processes of the embedded Ray) import what the model's functions import, from here
        env_vars.setdefault("PYTHONPATH", os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
    data = plan_to_dict(plan)
    kind = device_kind or ("gpu" if is_gpu_plan(data) else "cpu")
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"device_kind must be 'cpu' or 'gpu', got {device_kind!r}.")
    return {
        "version": 1, "model": model.name, "config": config, "plan": data, "steps": int(steps), "seed": int(seed),
        # A model of your own travels as the object (Ray's serialization carries its functions to the actors of an
        # embedded Ray); the plan's layers travel per operator, whatever made them (scopes, markers, clustering).
        "model_spec": model if own else None, "op_layers": [n.layer for n in plan.graph],
        "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir else None, "checkpoint_every": int(checkpoint_every),
        "resume": bool(resume), "overwrite": bool(overwrite), "run_id": uuid.uuid4().hex[:12], "device_kind": kind,
        "compiler_options": dict(compiler_options or {}), "max_restarts": int(max_restarts), "env_vars": env_vars,
        "batch_size": int(_batch_size(model)),
        "predicted": [{"fwd_s": st.fwd_s, "bwd_s": st.bwd_s, "peak_mem_bytes": st.peak_mem_bytes}
                      for st in plan.stages],
        "predicted_step_s": plan.cost.step_time_s,
    }


def _batch_size(model) -> int:
    import jax

    leaves = jax.tree_util.tree_leaves([model.abstract_args[i] for i in model.batch_argnums])
    return int(leaves[0].shape[0]) if leaves and leaves[0].shape else 1


def _stage_devices(job: dict) -> list[int]:
    return [int(st["submesh"][0]) * int(st["submesh"][1]) for st in job["plan"]["stages"]]


def local_gpu_count() -> int | None:
    """The GPUs an embedded Ray on this machine would find: as many as ``CUDA_VISIBLE_DEVICES`` lists when it is
    set, else the ``GPU n:`` lines of ``nvidia-smi -L``, 0 without an ``nvidia-smi``; None when it fails or another
    vendor's tools are there (unknown: Ray finds those GPUs its own way)."""
    import shutil
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None if shutil.which("rocm-smi") or shutil.which("amd-smi") else 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def check_local_gpus(job: dict, have: int | None) -> None:
    """Raise ValueError, before an embedded Ray starts (it runs on this machine), when ``job`` runs its stages on
    GPUs and needs more than the ``have`` this machine has (None: unknown, not refused here)."""
    if job["device_kind"] != "gpu" or have is None:
        return
    sizes = _stage_devices(job)
    if have < sum(sizes):
        raise ValueError(f"the plan needs {sum(sizes)} GPUs ({' + '.join(map(str, sizes))} over {len(sizes)} "
                         f"stage(s)) but this machine, where the embedded Ray runs, has {have}; connect to a cluster "
                         "with enough GPUs (ray_address), plan for a smaller cluster, or run the stages on CPU "
                         "devices (device_kind='cpu').")


def check_resources(ray, job: dict) -> None:
    """Raise ValueError unless the connected Ray cluster can hold one actor per stage of ``job``."""
    have = ray.cluster_resources()
    sizes = _stage_devices(job)
    S = len(sizes)
    if job["device_kind"] == "gpu":
        gpus = have.get("GPU", 0)
        if gpus < sum(sizes):
            raise ValueError(f"the plan needs {sum(sizes)} GPUs ({' + '.join(map(str, sizes))} over {S} stage(s)) but "
                             f"the Ray cluster has {gpus:g}; connect to a cluster with enough GPUs, plan for a "
                             "smaller cluster, or run the stages on CPU devices (device_kind='cpu').")
        big = max(sizes)
        node_gpus = [n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("Alive")]
        if node_gpus and max(node_gpus) < big:
            raise ValueError(f"a stage needs {big} GPUs on one node but the largest node has {max(node_gpus):g}; "
                             "this runtime runs one actor per stage, so plan stages that fit a node.")
    cpus = have.get("CPU", 0)
    need = S * float(job.get("cpus_per_actor", 1))
    if cpus < need:
        raise ValueError(f"the plan has {S} stages, one actor each needing {job.get('cpus_per_actor', 1)} CPU, but the "
                         f"Ray cluster has {cpus:g} CPUs; give it at least {need:g} CPUs (num_cpus=...).")


# ---------------------------------------------------------------------------------------------------------- driver

class _Routes:
    """Which tasks of the same microbatch each task of the split reads from (``info()["tasks"]`` of the stage
    actors; a task is ``(chunk, kind)``, the chunk being the stage itself unless the plan is interleaved), which
    tasks' every microbatch each chunk's update reads (``["updates"]``), which chunks each actor runs
    (``chunks``), and, per chunk, the chunks its forward reads from (``producers``) and those whose backward its
    backward waits for (``consumers``)."""

    def __init__(self, infos: list[dict]):
        self.sources: dict = {}
        self.chunks = [[int(c) for c in info.get("chunks", [k])] for k, info in enumerate(infos)]
        C = sum(len(ch) for ch in self.chunks)
        self.update_from: list[list] = [[] for _ in range(C)]
        for info in infos:
            for c, kind, srcs in info["tasks"]:
                self.sources[(int(c), str(kind))] = [(int(s), str(kd)) for s, kd in srcs]
            for c, srcs in info["updates"]:
                self.update_from[int(c)] = [(int(s), str(kd)) for s, kd in srcs]
        self.producers = [sorted({s for s, _ in self.sources[(k, "fwd")]}) for k in range(C)]
        self.consumers = [sorted({s for s, kd in self.sources[(k, "bwd")] if kd == "bwd"}) for k in range(C)]
        for k in range(C):
            if any(s >= k for s in self.producers[k]) or any(kd != "fwd" for _, kd in self.sources[(k, "fwd")]):
                raise JobFailed(f"stage {k}'s forward reads {self.sources[(k, 'fwd')]}; values must flow forward.")


def _submit_step(actors, routes: _Routes, step: int, S: int, B: int, schedule: str, virtual_stages: int = 1,
                 group: int | None = None):
    """Submit one step's tasks in the schedule's order; the refs of every stage's ``finish_step`` (its measured
    times, and the step's loss from the stage that holds it)."""
    from ..simulate import ScheduleStuck, issue_order, task_order

    orders = [task_order(d, S, B, schedule, virtual_stages=virtual_stages, group=group) for d in range(S)]
    refs: dict[Any, Any] = {}

    def ready(_d, kind, c, j):  # a task is submitted once the refs it takes exist (Ray waits for their values)
        return all((s, kd, j) in refs for s, kd in routes.sources[(c, kind)])

    try:
        for d, kind, c, j in issue_order(orders, ready):
            refs[(c, kind, j)] = actors[d].run.remote(kind, c, step, j,
                                                      *[refs[(s, kd, j)] for s, kd in routes.sources[(c, kind)]])
    except ScheduleStuck:
        raise JobFailed("the schedule is stuck (a stage waits for a value no stage produces).") from None
    return [a.finish_step.remote(step, *[refs[(s, kd, j)] for c in routes.chunks[d] for s, kd in routes.update_from[c]
                                         for j in range(B)])
            for d, a in enumerate(actors)]


def step_loss(rows: list[dict]) -> float:
    """The step's loss from the stages' ``finish_step`` rows (the stage holding the loss reports it)."""
    for r in rows:
        if r.get("loss") is not None:
            return float(r["loss"])
    raise JobFailed("no stage reported the step's loss; does the step return a scalar loss?")


def _is_actor_death(ray, err) -> bool:
    seen = 0
    while err is not None and seen < 5:
        if isinstance(err, ray.exceptions.RayActorError):
            return True
        err = getattr(err, "cause", None) or err.__cause__
        seen += 1
    return False


def _dead(ray, actors) -> list[int]:
    out = []
    for k, a in enumerate(actors):
        try:
            ray.get(a.info.remote(), timeout=120)
        except ray.exceptions.RayActorError:
            out.append(k)
        except ray.exceptions.GetTimeoutError:
            out.append(k)
    return out


def _summary_rows(job: dict, per_step: list[list[dict]]) -> list[dict]:
    """Measured per-stage times beside the plan's predictions (medians over the steps after the first)."""
    later = per_step[1:] or per_step
    rows = []
    for k, pred in enumerate(job["predicted"]):
        vals = {key: [s[k][key] for s in later if len(s) > k] for key in ("fwd_s", "bwd_s", "update_s", "busy_s")}
        med = {key: (statistics.median(v) if v else None) for key, v in vals.items()}
        rows.append({"stage": k, "predicted_fwd_s": pred["fwd_s"], "predicted_bwd_s": pred["bwd_s"],
                     "measured_fwd_s": med["fwd_s"], "measured_bwd_s": med["bwd_s"],
                     "measured_update_s": med["update_s"], "measured_busy_s": med["busy_s"],
                     "fwd_ratio": (med["fwd_s"] / pred["fwd_s"]) if med["fwd_s"] and pred["fwd_s"] else None,
                     "bwd_ratio": (med["bwd_s"] / pred["bwd_s"]) if med["bwd_s"] and pred["bwd_s"] else None,
                     # the stage actor's peak resident memory (its whole process: JAX, compiled programs, buffers),
                     # beside the plan's peak per device (the actor runs the stage's devices)
                     "predicted_peak_mem_bytes": pred.get("peak_mem_bytes"),
                     "peak_rss_bytes": max((s[k].get("peak_rss_bytes", 0) for s in per_step if len(s) > k),
                                           default=None)})
    return rows


def _plan_ref(ray, job: dict):
    """The job's plan object (``job["plan_instance"]``, what :func:`autopar_lab.launch` puts there for the embedded
    Ray) in Ray's object store, for every stage actor of every attempt to read; None without one or when it does not
    pickle (the actors then load the plan from its JSON)."""
    plan = job.get("plan_instance")
    if plan is None:
        return None
    try:
        return ray.put(plan)
    except Exception:  # noqa: BLE001 - a plan holding something that does not pickle: the JSON path works for all
        return None


class _Actors:
    """The stage actors of one attempt: start (and restore) them, or kill them all. ``plan_ref``: the job's plan in
    the object store (:func:`_plan_ref`), or None."""

    def __init__(self, ray, job: dict, plan_ref=None):
        from .actors import actor_options, remote_class

        self.ray = ray
        cls = remote_class(ray)
        S = len(job["plan"]["stages"])
        sent = {k: v for k, v in job.items() if k != "plan_instance"}  # the plan goes once, by reference
        extra = () if plan_ref is None else (plan_ref,)
        self.handles = [cls.options(**actor_options(job, k)).remote(sent, k, *extra) for k in range(S)]
        try:
            self.infos = ray.get([a.info.remote() for a in self.handles])
        except ray.exceptions.RayError as e:
            self.kill()
            raise JobFailed(f"a stage actor failed to start: {_short(e)}") from None

    def restore(self, directory, step):
        self.ray.get([a.restore.remote(str(directory), step) for a in self.handles])

    def kill(self):
        for a in self.handles:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass


def _short(e: BaseException) -> str:
    text = str(e)
    # a Ray error carries the remote traceback; its last line says what went wrong
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def run_job(job: dict, channel: ProgressChannel | None = None, ray=None, on_actors=None) -> dict:
    """Run a job spec on the connected Ray cluster; returns the result (losses, times, restarts, status).

    ``on_actors(handles)`` is called with the stage actors each time they (re)start (what the Job handle exposes).
    """
    if ray is None:
        # the runtime's launch path is the only place Ray is imported (an optional dependency)
        import ray as ray_module

        ray = ray_module
    from .checkpoint import CheckpointError, claim, resume_point, save_job

    channel = channel or ProgressChannel()
    stages = job["plan"]["stages"]
    S, B, schedule = len(stages), int(job["plan"]["microbatches"]), job["plan"]["schedule"]
    virtual = int(job["plan"].get("virtual_stages", 1))
    # the interleaved schedule's microbatches per chunk in a row (a plan file's stage pin; None: the stage count)
    pins = job["plan"].get("stage_pins", {})
    group = pins.get("microbatch_group") if schedule == "interleaved" else None
    if group is not None and pins.get("flexible_group") is True:  # the plan file's mark (planfile)
        from ..schedules import FlexibleGroup
        group = FlexibleGroup(group)
    steps, ck_dir, ck_every = int(job["steps"]), job.get("checkpoint_dir"), int(job.get("checkpoint_every", 0))
    check_resources(ray, job)
    t_start = time.perf_counter()
    losses: list[float] = []
    step, run_id = 0, job.get("run_id")
    if ck_dir:
        try:  # launch() claimed a local directory already (claiming again is a no-op); a remote one is claimed here
            run_id, _ = claim(ck_dir, run_id or uuid.uuid4().hex[:12], resume=bool(job.get("resume")),
                              overwrite=bool(job.get("overwrite")))
        except CheckpointError as e:
            channel.publish(ProgressEvent(kind="error", message=str(e)))
            return {"status": "error", "message": str(e), "model": job["model"], "steps": steps, "steps_run": 0,
                    "losses": [], "step_times_s": [], "step_time_s": None, "samples_per_s": None,
                    "predicted_step_s": job.get("predicted_step_s"), "stage_times": _summary_rows(job, []),
                    "restarts": 0, "checkpoint_dir": ck_dir, "elapsed_s": time.perf_counter() - t_start}
        if job.get("resume"):
            step, losses, note = resume_point(ck_dir, S)
            if not note and step == 0:  # the run was stopped before it wrote one: say so, never start over quietly
                note = f"the run in {ck_dir} has no checkpoint yet (it stopped before its first); starting from step 1"
            if note:
                channel.publish(ProgressEvent(kind="note", step=step, message=note))
    saved = step  # the newest step on disk: a cancelled run writes one more checkpoint if it got past it
    first = step
    per_step: list[list[dict]] = []
    step_times: list[float] = []
    restarts, status, message = 0, "done", ""
    actors = None

    def rewind(to: int) -> None:  # forget the measurements of the steps after ``to`` (they run again)
        nonlocal first
        del step_times[max(to - first, 0):], per_step[max(to - first, 0):]
        first = min(first, to)

    plan_ref = None
    try:
        while step < steps:
            if channel.cancelled:
                status = "cancelled"
                break
            try:
                if actors is None:
                    if plan_ref is None:
                        plan_ref = _plan_ref(ray, job)
                    actors = _Actors(ray, job, plan_ref)
                    if step > 0:
                        try:
                            actors.restore(ck_dir, step)
                        except ray.exceptions.RayError as e:
                            if _is_actor_death(ray, e) or _dead(ray, actors.handles):
                                raise  # a restart, below
                            # a whole step the stages refuse (arrays that do not fit them): the one before, as a
                            # damaged step is skipped; each time an older step, so this ends (at step 0 at worst)
                            bad = step
                            actors.kill()
                            actors = None
                            step, losses, note = resume_point(ck_dir, S, upto=bad - 1)
                            saved = step
                            rewind(step)
                            why = _short(e).rstrip(".")
                            channel.publish(ProgressEvent(
                                kind="note", step=step, message=f"checkpoint step {bad} cannot be restored ({why}); "
                                f"resuming from step {step}" + (f" ({note})" if note else "")))
                            continue
                    if on_actors is not None:
                        on_actors(list(actors.handles))
                    routes = _Routes(actors.infos)
                t0 = time.perf_counter()
                rows = ray.get(_submit_step(actors.handles, routes, step, S, B, schedule, virtual, group))
            except ray.exceptions.RayError as e:
                if actors is None or not (_is_actor_death(ray, e) or _dead(ray, actors.handles)):
                    raise JobFailed(f"step {step + 1} failed: {_short(e)}") from None
                restarts += 1
                actors.kill()
                actors = None
                if restarts > int(job.get("max_restarts", 3)):
                    raise JobFailed(f"a stage actor died {restarts} times; giving up (max_restarts="
                                    f"{job.get('max_restarts', 3)}).") from None
                step, kept, note = resume_point(ck_dir, S) if ck_dir else (0, [], "")
                losses = losses[:step] if len(losses) >= step else kept
                saved = step
                rewind(step)
                channel.publish(ProgressEvent(kind="restart", step=step, elapsed_s=time.perf_counter() - t_start,
                                              message=f"a stage actor died ({_short(e)}); restarting from step {step}"
                                                      + (f" ({note})" if note else "")))
                continue
            dt = time.perf_counter() - t0
            loss = step_loss(rows)
            losses.append(loss)
            step_times.append(dt)
            per_step.append(rows)
            step += 1
            if ck_dir and ((ck_every and step % ck_every == 0) or step == steps):  # and always at the end
                ray.get([a.save.remote(ck_dir, step) for a in actors.handles])
                save_job(ck_dir, step, losses, run_id)
                saved = step
            channel.publish(ProgressEvent(kind="step", step=step, loss=loss, step_time_s=dt,
                                          samples_per_s=job["batch_size"] / dt if dt > 0 else None,
                                          stage_times=tuple(r["busy_s"] for r in rows),
                                          elapsed_s=time.perf_counter() - t_start))
        if status == "cancelled" and ck_dir and actors is not None and step > saved:
            # a clean stop keeps the work done: the state after the last finished step becomes a checkpoint
            ray.get([a.save.remote(ck_dir, step) for a in actors.handles])
            save_job(ck_dir, step, losses, run_id)
            saved = step
            message = f"cancelled after step {step}; checkpoint at step {step} in {ck_dir}"
    except JobFailed as e:
        status, message = "error", str(e)
    except Exception as e:  # noqa: BLE001 - reported to the user as the job's error, not a dead thread
        status, message = "error", f"{type(e).__name__}: {_short(e)}"
    finally:
        if actors is not None:
            actors.kill()
    later = step_times[1:] or step_times
    step_s = statistics.median(later) if later else None
    result = {
        "status": status, "message": message, "model": job["model"], "steps": steps, "steps_run": len(losses),
        "losses": losses, "step_times_s": step_times, "step_time_s": step_s,
        "samples_per_s": (job["batch_size"] / step_s) if step_s else None,
        "predicted_step_s": job.get("predicted_step_s"), "stage_times": _summary_rows(job, per_step),
        "restarts": restarts, "checkpoint_dir": ck_dir, "elapsed_s": time.perf_counter() - t_start,
        "checkpoint_step": saved if ck_dir else None, "run_id": run_id,
    }
    kind = {"done": "done", "cancelled": "cancelled", "error": "error"}[status]
    channel.publish(ProgressEvent(kind=kind, step=len(losses), elapsed_s=result["elapsed_s"], message=message))
    return result


# ------------------------------------------------------------------------------------------------ Jobs API entry

def main(argv=None) -> int:
    """``python -m autopar_lab.runtime.train_entry JOB.json``: run a job spec on the Ray cluster this process is
    part of (the Jobs API starts it there), printing events and the result as tagged JSON lines."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1:
        print("usage: python -m autopar_lab.runtime.train_entry JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False, configure_logging=False)
    channel = ProgressChannel()
    channel.subscribe(lambda ev: print(format_event(ev), flush=True))
    try:
        result = run_job(job, channel, ray)
    except ValueError as e:  # not enough resources: said before anything started
        result = {"status": "error", "message": str(e), "losses": []}
        channel.publish(ProgressEvent(kind="error", message=str(e)))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0 if result["status"] in ("done", "cancelled") else 1


assert EVENT_PREFIX != RESULT_PREFIX

if __name__ == "__main__":
    sys.exit(main())
