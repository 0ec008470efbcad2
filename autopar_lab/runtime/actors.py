"""The stage actor: one pipeline stage of a plan, on its own devices, in its own process.

A :class:`StageWorker` rebuilds everything from the job spec (the model by zoo name and config, or, for a model
of your own on the embedded Ray, the ModelSpec object itself, which Ray's serialization carries to the actor; the
graph by ``model.trace()`` with the plan's layers per operator; the plan by :func:`autopar_lab.planfile.load_plan`),
cuts the step with :func:`autopar_lab.runtime.partition.split_stages`, keeps only the step inputs its stage holds,
and runs that stage's SPMD programs on the devices of its process: ``forward`` and ``backward`` per microbatch (in
the order the driver submits them, which is the plan's schedule) and ``finish_step`` (its part of the step's
update). Values crossing stages travel as numpy arrays inside Ray object refs.

Ray is not imported here: :func:`remote_class` wraps the class with ``ray.remote`` when the runtime needs it, and
:func:`actor_options` says what each actor asks of Ray. JAX starts inside the actor only after the runtime_env has
set ``JAX_PLATFORMS`` and ``JAX_NUM_CPU_DEVICES`` (CPU devices) or Ray has set ``CUDA_VISIBLE_DEVICES`` (GPUs), so
the stage sees exactly its own devices.

The worker also runs without Ray (``StageWorker(job, k)`` in one process), which is how its contract is tested:

    >>> w = StageWorker(job, 0)                  # doctest: +SKIP
    >>> out = w.forward(0, 0)   # step 0, microbatch 0 -> {name: numpy array}  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import tempfile
import time

__all__ = ["StageWorker", "remote_class", "actor_options", "build_model", "build_plan", "is_gpu_plan"]


def build_model(job: dict):
    """The model of a job spec: ``job["model_spec"]`` when the job carries the ModelSpec itself (a model of your own,
    embedded Ray), else the zoo model ``job["model"]`` with ``job["config"]`` fields."""
    if job.get("model_spec") is not None:
        return job["model_spec"]
    from .. import models

    return models.get(job["model"], **dict(job.get("config") or {}))


def build_plan(job: dict, model):
    """The plan of a job spec (``job["plan"]``, the planfile JSON object), loaded for ``model``'s graph with the
    plan's layers (``job["op_layers"]``, one per operator, when the spec has them: layers from markers, clustering
    or a ``layers=`` pattern are not what ``model.trace()`` finds by itself)."""
    from ..cluster import Cluster
    from ..graph.layerfind import assign_layers
    from ..planfile import load_plan

    data = job["plan"]
    cluster = Cluster.from_json(data["cluster"])
    graph = model.trace()
    if job.get("op_layers") is not None:
        graph = assign_layers(graph, job["op_layers"])
    fd, path = tempfile.mkstemp(prefix="autopar-plan-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        return load_plan(path, graph, cluster, model=model)
    finally:
        os.unlink(path)


def is_gpu_plan(plan_dict: dict) -> bool:
    """Whether a plan (planfile JSON) was made for GPUs (any device other than the ``cpu`` preset's)."""
    name = str(plan_dict["cluster"].get("device", {}).get("name", "cpu")).lower()
    return not name.startswith("cpu")


def actor_options(job: dict, stage: int) -> dict:
    """What stage ``stage``'s actor asks of Ray: GPUs through ``num_gpus``; CPU devices through the runtime_env
    (``JAX_NUM_CPU_DEVICES`` = the stage's device count, set before JAX is imported in the actor)."""
    st = job["plan"]["stages"][stage]
    n = int(st["submesh"][0]) * int(st["submesh"][1])
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if job.get("device_kind", "cpu") == "gpu":
        opts = {"num_gpus": n, "num_cpus": 1}
    else:
        env.update({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(n)})
        opts = {"num_cpus": float(job.get("cpus_per_actor", 1))}
    env.update({str(k): str(v) for k, v in dict(job.get("env_vars") or {}).items()})
    opts["runtime_env"] = {"env_vars": env}
    opts["max_restarts"] = 0  # a dead stage is restarted by the driver, from the last checkpoint
    return opts


class StageWorker:
    """One stage of a pipeline plan (see the module docstring). All arrays in and out are numpy."""

    def __init__(self, job: dict, stage: int):
        import jax

        from .partition import split_stages

        t0 = time.perf_counter()
        self.stage = int(stage)
        self.job = job
        self.model = build_model(job)
        self.plan = build_plan(job, self.model)
        S = len(self.plan.stages)
        st = self.plan.stages[self.stage]
        n = st.submesh[0] * st.submesh[1]
        local = jax.local_devices()
        if len(local) < n:
            raise ValueError(f"stage {stage} needs {n} devices but its actor sees {len(local)} "
                             f"({local[0].platform if local else 'none'}).")
        devices = [None] * S
        devices[self.stage] = list(local[:n])
        self.staged = split_stages(self.model, self.plan, devices=devices,
                                   compiler_options=job.get("compiler_options") or None)
        self.seed = int(job.get("seed", 0))
        self.state = self.staged.init_state(self.stage, self.seed)
        self._batch_step = None
        self._mbs = None
        self._stash: dict = {}  # microbatch -> what its forward keeps for its backward
        self._acc: dict = {}  # "fwd"/"bwd" -> values the update reads, summed over the step's microbatches
        self._times = {"fwd": [], "bwd": [], "update": []}
        self.setup_s = time.perf_counter() - t0
        self.device_names = [str(d) for d in local[:n]]

    # --- info ---------------------------------------------------------------------------------------------------
    def info(self) -> dict:
        import jax

        k, sm = self.stage, self.staged
        return {"stage": k, "pid": os.getpid(), "devices": self.device_names,
                "platform": jax.default_backend(), "setup_s": self.setup_s,
                "inputs": list(sm.inputs(k, "fwd")), "outputs": list(sm.exports(k, "fwd")),
                "fwd_from": [list(x) for x in sm.sources(k, "fwd")],
                "bwd_from": [list(x) for x in sm.sources(k, "bwd")],
                "update_from": [list(x) for x in sm.update_sources(k)]}

    # --- state ----------------------------------------------------------------------------------------------------
    def _tree(self):
        return {"state": self.state}

    def save(self, directory: str, step: int) -> str:
        """Write this stage's step inputs (parameters, optimizer state) as checkpoint ``step`` (see
        runtime.checkpoint)."""
        from .checkpoint import save_stage

        return str(save_stage(directory, step, self.stage, self._tree()))

    def restore(self, directory: str, step: int) -> int:
        """Load checkpoint ``step`` of this stage (checked against the stage's own state) and place it on its mesh."""
        from .checkpoint import load_stage

        tree = load_stage(directory, step, self.stage, template=self._tree())
        # each leaf goes back where the freshly initialised one lives (the plan's sharding on this stage's mesh)
        self.state = self.staged.place_state(self.stage, tree["state"])
        return int(step)

    def params_numpy(self) -> dict:
        import numpy as np

        return {k: np.asarray(v) for k, v in self.state.items()}

    # --- one step -------------------------------------------------------------------------------------------------
    def _microbatch(self, step: int, mb: int):
        if self._batch_step != step:
            from .local import synthetic_batch

            # every actor makes the step's batch itself (same seed, same numbers): no batch crosses the network
            self._mbs = self.staged.split_batch(synthetic_batch(self.model, self.seed + int(step)))
            self._batch_step = step
        return self._mbs[mb]

    def _task(self, kind: str, step: int, mb: int, received: tuple) -> dict:
        import jax
        import numpy as np

        t0 = time.perf_counter()
        pool = {}
        for d in received:
            pool.update(d)
        res = self.staged.run_task(self.stage, kind, self.state, pool, self._microbatch(step, mb),
                                   self._stash.pop(mb) if kind == "bwd" else None)
        if kind == "fwd":
            self._stash[mb] = res.stash
        self._acc[kind] = self.staged.accumulate(self.stage, self._acc.get(kind), res.acc)
        jax.block_until_ready(self._acc[kind])
        out = {n: np.asarray(v) for n, v in res.exports.items()}  # np.asarray waits for the result
        self._times[kind].append(time.perf_counter() - t0)
        return out

    def forward(self, step: int, mb: int, *produced: dict) -> dict:
        """Stage forward on microbatch ``mb`` of step ``step``; ``produced``: the exports of the tasks it reads from
        (``info()["fwd_from"]``, their refs resolved by Ray). Returns ``{name: numpy}`` of what it sends."""
        return self._task("fwd", step, mb, produced)

    def backward(self, step: int, mb: int, *produced: dict) -> dict:
        """Stage backward on microbatch ``mb``; ``produced``: the exports of the tasks it reads from
        (``info()["bwd_from"]``: later stages' backwards, other stages' forwards). Returns what it sends."""
        return self._task("bwd", step, mb, produced)

    def finish_step(self, step: int, *produced: dict) -> dict:
        """This stage's part of the step's update, on the gradients summed over the microbatches; ``produced``: the
        exports of every microbatch of the tasks in ``info()["update_from"]`` (what this update reads from other
        stages, such as a gradient another stage finished, or all of them for clipping by global norm). Returns its
        measured times for the step: ``fwd_s``/``bwd_s`` (mean per microbatch), ``update_s`` and ``busy_s``
        (everything this stage computed), and ``loss`` when this stage holds the step's loss."""
        import jax
        import numpy as np

        t0 = time.perf_counter()
        if not self._acc:
            raise RuntimeError(f"stage {self.stage} finished step {step} without a forward or backward pass.")
        acc = {**self._acc.get("fwd", {}), **self._acc.get("bwd", {})}
        need = dict(self.staged.update_inputs(self.stage))
        received: dict = {}
        for d in produced:  # in microbatch order: summed as the local runner sums them
            for n, v in d.items():
                if n not in need:
                    continue
                summed = self.staged.is_accumulated(n) and np.issubdtype(np.asarray(v).dtype, np.inexact)
                received[n] = received[n] + v if summed and n in received else v
        self.state, outputs = self.staged.update(self.stage, self.state, acc, received)
        jax.block_until_ready(self.state)
        self._acc = {}
        self._stash.clear()
        upd = time.perf_counter() - t0
        fwd, bwd = self._times["fwd"], self._times["bwd"]
        out = {"stage": self.stage, "step": int(step), "fwd_s": sum(fwd) / max(len(fwd), 1),
               "bwd_s": sum(bwd) / max(len(bwd), 1), "update_s": upd, "busy_s": sum(fwd) + sum(bwd) + upd}
        if self.staged.loss_output in outputs:
            out["loss"] = float(outputs[self.staged.loss_output])
        self._times = {"fwd": [], "bwd": [], "update": []}
        return out


def remote_class(ray):
    """``StageWorker`` as a Ray actor class (Ray is passed in, so importing this module never imports Ray)."""
    return ray.remote(StageWorker)
