"""The stage actor: one pipeline stage of a plan, on its own devices, in its own process.

A :class:`StageWorker` rebuilds everything from JSON (the model by zoo name and config, the graph by
``model.trace()``, the plan by :func:`autopar_lab.planfile.load_plan`), splits the model with
:func:`autopar_lab.runtime.partition.split_stages`, keeps only its stage's parameters and optimizer state, and runs
that stage's SPMD functions on the devices of its process: ``forward`` and ``backward`` per microbatch (in the order
the driver submits them, which is the plan's schedule) and ``finish_step`` (the optimizer update). Values crossing
stages travel as numpy arrays inside Ray object refs.

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
    """The zoo model of a job spec (``job["model"]`` name, ``job["config"]`` fields)."""
    from .. import models

    return models.get(job["model"], **dict(job.get("config") or {}))


def build_plan(job: dict, model):
    """The plan of a job spec (``job["plan"]``, the planfile JSON object), loaded for ``model``."""
    from ..cluster import Cluster
    from ..planfile import load_plan

    data = job["plan"]
    cluster = Cluster.from_json(data["cluster"])
    fd, path = tempfile.mkstemp(prefix="autopar-plan-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        return load_plan(path, model.trace(), cluster, model=model)
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
        self.params, self.opt_state = self.staged.init_stage(self.stage, self.seed)
        self._batch_step = None
        self._mbs = None
        self._inputs: dict = {}  # microbatch -> the inputs its forward read (backward recomputes from them)
        self._grads = None
        self._times = {"fwd": [], "bwd": [], "update": []}
        self.setup_s = time.perf_counter() - t0
        self.device_names = [str(d) for d in local[:n]]

    # --- info ---------------------------------------------------------------------------------------------------
    def info(self) -> dict:
        import jax

        return {"stage": self.stage, "pid": os.getpid(), "devices": self.device_names,
                "platform": jax.default_backend(), "setup_s": self.setup_s,
                "inputs": list(self.staged.stage_inputs(self.stage)),
                "outputs": list(self.staged.stage_outputs(self.stage))}

    # --- state ----------------------------------------------------------------------------------------------------
    def _tree(self):
        return {"params": self.params, "opt_state": self.opt_state}

    def save(self, directory: str, step: int) -> str:
        """Write this stage's parameters and optimizer state as checkpoint ``step`` (see runtime.checkpoint)."""
        from .checkpoint import save_stage

        return str(save_stage(directory, step, self.stage, self._tree()))

    def restore(self, directory: str, step: int) -> int:
        """Load checkpoint ``step`` of this stage (checked against the stage's own state) and place it on its mesh."""
        import jax

        from .checkpoint import load_stage

        tree = load_stage(directory, step, self.stage, template=self._tree())
        placed_now = self._tree()
        # each leaf goes back where the freshly initialised one lives (the plan's sharding on this stage's mesh)
        self.params = jax.tree_util.tree_map(lambda new, old: jax.device_put(new, old.sharding),
                                             tree["params"], placed_now["params"])
        self.opt_state = jax.tree_util.tree_map(lambda new, old: jax.device_put(new, old.sharding),
                                                tree["opt_state"], placed_now["opt_state"])
        return int(step)

    def params_numpy(self) -> dict:
        import numpy as np

        return {k: np.asarray(v) for k, v in self.params.items()}

    # --- one step -------------------------------------------------------------------------------------------------
    def _microbatch(self, step: int, mb: int):
        if self._batch_step != step:
            from .local import synthetic_batch

            # every actor makes the step's batch itself (same seed, same numbers): no batch crosses the network
            self._mbs = self.staged.split_batch(synthetic_batch(self.model, self.seed + int(step)))
            self._batch_step = step
        return self._mbs[mb]

    def forward(self, step: int, mb: int, *produced: dict) -> dict:
        """Stage forward on microbatch ``mb`` of step ``step``; ``produced``: output dicts of the stages it reads
        from (their refs are resolved by Ray). Returns ``{name: numpy}`` of this stage's outputs."""
        import numpy as np

        t0 = time.perf_counter()
        need = self.staged.stage_inputs(self.stage)
        pool = {}
        for d in produced:
            pool.update(d)
        inputs = {n: pool[n] for n in need}
        out = self.staged.forward(self.stage, self.params, inputs, self._microbatch(step, mb))
        out = {n: np.asarray(v) for n, v in out.items()}  # np.asarray waits for the result
        self._inputs[mb] = inputs
        self._times["fwd"].append(time.perf_counter() - t0)
        return out

    def backward(self, step: int, mb: int, *d_from_consumers: dict) -> dict:
        """Stage backward on microbatch ``mb``; ``d_from_consumers``: the ``d_inputs`` dicts of the stages that read
        this stage's outputs (summed per name, in stage order). Returns this stage's ``d_inputs`` as numpy."""
        import jax
        import numpy as np

        t0 = time.perf_counter()
        outs = set(self.staged.stage_outputs(self.stage))
        d_out: dict = {}
        for d in d_from_consumers:
            for n, v in d.items():
                if n in outs:
                    d_out[n] = v if n not in d_out else d_out[n] + v
        g, d_inputs = self.staged.backward(self.stage, self.params, self._inputs.pop(mb), self._microbatch(step, mb),
                                           d_out)
        self._grads = g if self._grads is None else self.staged.add_grads(self.stage, self._grads, g)
        jax.block_until_ready(self._grads)
        res = {n: np.asarray(v) for n, v in d_inputs.items()}
        self._times["bwd"].append(time.perf_counter() - t0)
        return res

    def finish_step(self, step: int) -> dict:
        """Apply the optimizer to the summed gradients; returns this stage's measured times for the step:
        ``fwd_s``/``bwd_s`` (mean per microbatch), ``update_s`` and ``busy_s`` (everything this stage computed)."""
        import jax

        t0 = time.perf_counter()
        if self._grads is None:
            raise RuntimeError(f"stage {self.stage} finished step {step} without a backward pass.")
        self.params, self.opt_state = self.staged.update(self.stage, self.params, self.opt_state, self._grads)
        jax.block_until_ready(self.params)
        self._grads = None
        self._inputs.clear()
        upd = time.perf_counter() - t0
        fwd, bwd = self._times["fwd"], self._times["bwd"]
        out = {"stage": self.stage, "step": int(step), "fwd_s": sum(fwd) / max(len(fwd), 1),
               "bwd_s": sum(bwd) / max(len(bwd), 1), "update_s": upd, "busy_s": sum(fwd) + sum(bwd) + upd}
        self._times = {"fwd": [], "bwd": [], "update": []}
        return out


def remote_class(ray):
    """``StageWorker`` as a Ray actor class (Ray is passed in, so importing this module never imports Ray)."""
    return ray.remote(StageWorker)
