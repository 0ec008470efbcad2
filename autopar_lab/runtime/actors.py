"""The stage actor: one pipeline stage of a plan, on its own devices, in its own process.

A :class:`StageWorker` rebuilds everything from the job spec (the model by zoo name and config, or, for a model
of your own on the embedded Ray, the ModelSpec object itself, which Ray's serialization carries to the actor; the
graph by ``model.trace()`` with the plan's layers per operator; the plan by :func:`autopar_lab.planfile.load_plan`;
on the embedded Ray the driver's plan object instead, from Ray's object store, which spares the trace and re-pricing),
cuts the step with :func:`autopar_lab.runtime.partition.split_stages`, keeps only the step inputs its stage holds,
and runs that stage's SPMD programs on the devices of its process: its tasks per microbatch (``run(kind, chunk,
...)``: the forward, the backward and, for a ZB-H1 plan, the weight gradients; for an interleaved plan, of each of
the stage's chunks) in the order the driver submits them, which is the plan's schedule, and ``finish_step`` (its
part of the step's update). Values crossing stages travel as numpy arrays inside Ray object refs.

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
import resource
import tempfile
import time
from typing import Any

__all__ = ["StageWorker", "remote_class", "actor_options", "build_model", "build_plan", "is_gpu_plan"]


def build_model(job: dict):
    """The model of a job spec: ``job["model_spec"]`` when the job carries the ModelSpec itself (a model of your own,
    embedded Ray), else the zoo model ``job["model"]`` with ``job["config"]`` fields."""
    if job.get("model_spec") is not None:
        return job["model_spec"]
    from .. import models

    config = dict(job.get("config") or {})
    try:
        key = (job["model"], tuple(sorted(config.items())))
        hash(key)
    except TypeError:  # a config value that is not hashable (a list): built anew
        return models.get(job["model"], **config)
    # One object per zoo model and config in a process: the stage workers of one job built here (the in-process
    # workers the tests and run-at-once drivers make) share it, and with it the step captured for the split and the
    # init programs (both kept per model object), where each worker traced and lowered them again.
    if key not in _MODELS:
        if len(_MODELS) >= 4:
            _MODELS.pop(next(iter(_MODELS)))
        _MODELS[key] = models.get(job["model"], **config)
    return _MODELS[key]


_MODELS: dict = {}


def build_plan(job: dict, model):
    """The plan of a job spec (``job["plan"]``, the planfile JSON object), loaded for ``model``'s graph with the
    plan's layers (``job["op_layers"]``, one per operator, when the spec has them: layers from markers, clustering
    or a ``layers=`` pattern are not what ``model.trace()`` finds by itself)."""
    from ..cluster import Cluster
    from ..graph.layerfind import assign_layers
    from ..planfile import load_plan

    data = job["plan"]
    text = json.dumps(data)
    layers = job.get("op_layers")
    # One load per plan, model and layers in a process: the stage workers of one job built here (in-process
    # workers: tests, run-at-once drivers) each traced the model and re-priced the plan (1.5-2.5 CPU-s each on
    # gpt-tiny's 2-stage plan). A plan is never changed in place, so the workers may share it.
    key = (text, None if layers is None else tuple(layers))
    held = _PLANS.get(key)
    if held is not None and held[0] is model:
        return held[1]
    cluster = Cluster.from_json(data["cluster"])
    graph = model.trace()
    if layers is not None:
        graph = assign_layers(graph, layers)
    fd, path = tempfile.mkstemp(prefix="autopar-plan-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        plan = load_plan(path, graph, cluster, model=model)
    finally:
        os.unlink(path)
    if len(_PLANS) >= 4:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = (model, plan)
    return plan


_PLANS: dict = {}


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
    opts: dict[str, Any]
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
    """One stage of a pipeline plan (see the module docstring). All arrays in and out are numpy.

    ``plan``: the job's plan as the driver holds it (the embedded Ray carries it to the actor through its object
    store), used when it is the plan of ``job``; without it the plan is loaded from the job's JSON (re-traced and
    re-priced)."""

    def __init__(self, job: dict, stage: int, plan=None):
        import jax

        from .partition import split_stages

        t0 = time.perf_counter()
        self.stage = int(stage)
        self.job = job
        self.model = build_model(job)
        # The driver's plan object, when it came: loading the plan from JSON traces the model and prices every
        # operator's strategies again (2.7 of an actor's ~6 CPU-s to start on gpt-tiny's 2-stage plan, measured
        # 2026-12-07 with py-spy and cProfile), all to rebuild what the driver already has.
        same = plan is not None and getattr(getattr(plan, "graph", None), "fingerprint", None) == \
            job["plan"]["graph_fingerprint"] and len(plan.stages) == len(job["plan"]["stages"])
        self.plan = plan if same else build_plan(job, self.model)
        S = len(self.plan.stages)
        st = self.plan.stages[self.stage]
        n = st.submesh[0] * st.submesh[1]
        local = jax.local_devices()
        if len(local) < n:
            raise ValueError(f"stage {stage} needs {n} devices but its actor sees {len(local)} "
                             f"({local[0].platform if local else 'none'}).")
        devices: list[list | None] = [None] * S
        devices[self.stage] = list(local[:n])
        self.staged = split_stages(self.model, self.plan, devices=devices,
                                   compiler_options=job.get("compiler_options") or None)
        self.seed = int(job.get("seed", 0))
        #: the stages of the split this actor runs: its own, or for an interleaved plan each of its chunks
        self.chunks = [c for c, d in enumerate(self.staged.device_stage) if d == self.stage]
        self.states = {c: self.staged.init_state(c, self.seed) for c in self.chunks}
        self._batch_step: int | None = None
        self._mbs: list | None = None
        self._stash: dict = {}  # (chunk, kind, microbatch) -> what the task keeps for the chunk's later tasks
        self._left: dict = {}  # how many of those later tasks have not read it yet
        self._acc: dict = {}  # (chunk, kind) -> values the update reads, summed over the step's microbatches
        self._times: dict = {}  # kind -> seconds of each task this step
        self.setup_s = time.perf_counter() - t0
        self.device_names = [str(d) for d in local[:n]]

    @property
    def state(self) -> dict:
        """The step inputs this stage holds (``{path: array}``; one plan stage's chunks together)."""
        return {name: x for c in self.chunks for name, x in self.states[c].items()}

    # --- info ---------------------------------------------------------------------------------------------------
    def info(self) -> dict:
        """Who this actor is and how its tasks connect: ``tasks`` holds ``[chunk, kind, [[chunk, kind], ...]]`` (the
        tasks of the same microbatch each of its tasks reads from), ``updates`` ``[chunk, [[chunk, kind], ...]]``
        (the tasks whose every microbatch each chunk's update reads); chunks are the stages of the split."""
        import jax

        k, sm = self.stage, self.staged
        first = self.chunks[0]
        return {"stage": k, "pid": os.getpid(), "devices": self.device_names,
                "platform": jax.default_backend(), "setup_s": self.setup_s, "chunks": list(self.chunks),
                "inputs": list(sm.inputs(first, "fwd")), "outputs": list(sm.exports(first, "fwd")),
                "fwd_from": [list(x) for x in sm.sources(first, "fwd")],
                "bwd_from": [list(x) for x in sm.sources(first, "bwd")],
                "update_from": [list(x) for x in sm.update_sources(first)],
                "tasks": [[c, kind, [list(x) for x in sm.sources(c, kind)]] for c in self.chunks for kind in sm.kinds],
                "updates": [[c, [list(x) for x in sm.update_sources(c)]] for c in self.chunks]}

    def memory(self) -> dict:
        """What this actor holds: ``state_bytes`` (its stage's step inputs, as sharded, summed over its devices),
        ``live_bytes`` (every live array of the process, each buffer once: between steps, its state and nothing of
        the rest of the model), ``peak_rss_bytes`` (the process's peak resident memory so far)."""
        from .memprobe import live_bytes

        state = sum(int(s.data.nbytes) for x in self.state.values() for s in x.addressable_shards)
        return {"stage": self.stage, "state_bytes": state, "live_bytes": sum(live_bytes().values()),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    # --- state ----------------------------------------------------------------------------------------------------
    def _tree(self):
        if self.chunks == [self.stage]:
            return {"state": self.states[self.stage]}
        return {"state": {f"chunk{c}": self.states[c] for c in self.chunks}}

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
        if self.chunks == [self.stage]:
            self.states = {self.stage: self.staged.place_state(self.stage, tree["state"])}
        else:
            self.states = {c: self.staged.place_state(c, tree["state"][f"chunk{c}"]) for c in self.chunks}
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
        assert self._mbs is not None
        return self._mbs[mb]

    def run(self, kind: str, chunk: int, step: int, mb: int, *produced: dict) -> dict:
        """Task ``kind`` ("fwd", "bwd" or "wgrad") of ``chunk`` (this stage, or one of its chunks: ``info()
        ["chunks"]``) on microbatch ``mb`` of step ``step``; ``produced``: the exports of the tasks it reads from
        (``info()["tasks"]``, their refs resolved by Ray). Returns ``{name: numpy}`` of what it sends."""
        import jax
        import numpy as np

        sm, c = self.staged, int(chunk)
        if c not in self.states:
            raise ValueError(f"stage {self.stage}'s actor runs chunks {self.chunks}, not {c}.")
        t0 = time.perf_counter()
        pool = {}
        for d in produced:
            pool.update(d)
        sources = [e for e in sm.kinds if kind in sm.stash_readers(c, e)]
        kept = {}
        for e in sources:  # the stashes of this chunk's earlier tasks it reads, each dropped after its last reader
            kept.update(self._stash[(c, e, mb)])
            self._left[(c, e, mb)] -= 1
            if not self._left[(c, e, mb)]:
                del self._stash[(c, e, mb)], self._left[(c, e, mb)]
        res = sm.run_task(c, kind, self.states[c], pool, self._microbatch(step, mb), kept if sources else None,
                          acc=self._acc.get((c, kind)))
        if sm.stash_readers(c, kind):
            self._stash[(c, kind, mb)] = res.stash
            self._left[(c, kind, mb)] = len(sm.stash_readers(c, kind))
        self._acc[(c, kind)] = res.acc  # summed over the microbatches inside the task's program
        jax.block_until_ready(self._acc[(c, kind)])
        out = {n: np.asarray(v) for n, v in res.exports.items()}  # np.asarray waits for the result
        self._times.setdefault(kind, []).append(time.perf_counter() - t0)
        return out

    def forward(self, step: int, mb: int, *produced: dict) -> dict:
        """Stage forward on microbatch ``mb`` of step ``step``; ``produced``: the exports of the tasks it reads from
        (``info()["fwd_from"]``, their refs resolved by Ray). Returns ``{name: numpy}`` of what it sends."""
        return self.run("fwd", self.chunks[0], step, mb, *produced)

    def backward(self, step: int, mb: int, *produced: dict) -> dict:
        """Stage backward on microbatch ``mb``; ``produced``: the exports of the tasks it reads from
        (``info()["bwd_from"]``: later stages' backwards, other stages' forwards). Returns what it sends."""
        return self.run("bwd", self.chunks[0], step, mb, *produced)

    def finish_step(self, step: int, *produced: dict) -> dict:
        """This stage's part of the step's update, on the gradients summed over the microbatches; ``produced``: the
        exports of every microbatch of the tasks in ``info()["updates"]``, chunk by chunk in order (what each
        chunk's update reads from other stages, such as a gradient another stage finished, or all of them for
        clipping by global norm). Returns its measured times for the step: ``fwd_s``/``bwd_s`` (per microbatch;
        a ZB-H1 backward is B and W, ``wgrad_s`` the W part), ``update_s`` and ``busy_s`` (everything this stage
        computed), ``peak_rss_bytes`` (this actor process's peak resident memory so far), and ``loss`` when this
        stage holds the step's loss."""
        import jax
        import numpy as np

        t0 = time.perf_counter()
        if not self._acc:
            raise RuntimeError(f"stage {self.stage} finished step {step} without a forward or backward pass.")
        sm, B = self.staged, self.staged.microbatches
        rest = list(produced)
        outputs: dict = {}
        for c in self.chunks:
            acc = {key: val for kind in sm.kinds for key, val in self._acc.get((c, kind), {}).items()}
            need = dict(sm.update_inputs(c))
            mine, rest = rest[:len(sm.update_sources(c)) * B], rest[len(sm.update_sources(c)) * B:]
            received: dict = {}
            for d in mine:  # in microbatch order: summed as the local runner sums them
                for n, v in d.items():
                    if n not in need:
                        continue
                    summed = sm.is_accumulated(n) and np.issubdtype(np.asarray(v).dtype, np.inexact)
                    received[n] = received[n] + v if summed and n in received else v
            self.states[c], outs = sm.update(c, self.states[c], acc, received, donate=True)
            outputs.update(outs)
        jax.block_until_ready(self.states)
        self._acc = {}
        self._stash.clear()
        self._left.clear()
        # the step's microbatches too: between steps the actor holds its state and nothing else (memory())
        self._mbs, self._batch_step = None, None
        upd = time.perf_counter() - t0
        fwd, bwd, wgt = (self._times.get(kind, []) for kind in ("fwd", "bwd", "wgrad"))
        out = {"stage": self.stage, "step": int(step), "fwd_s": sum(fwd) / B, "bwd_s": (sum(bwd) + sum(wgt)) / B,
               "update_s": upd, "busy_s": sum(fwd) + sum(bwd) + sum(wgt) + upd}
        # the actor process's peak resident memory so far (Linux reports KiB): the job reports it per stage
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if wgt:
            out["wgrad_s"] = sum(wgt) / B
        if sm.loss_output in outputs:
            out["loss"] = float(outputs[sm.loss_output])
        self._times = {}
        return out


def remote_class(ray):
    """``StageWorker`` as a Ray actor class (Ray is passed in, so importing this module never imports Ray)."""
    return ray.remote(StageWorker)
