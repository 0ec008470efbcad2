"""Run a plan on local JAX devices: SPMD inside each stage, a pipeline across stages.

:func:`execute` returns a :class:`Runner`. Two ways to run a step:

- **pipeline** (any plan with several stages, or one stage with several microbatches): the model's own training step
  is cut into the plan's stages (:func:`autopar_lab.runtime.partition.split_stages`), whatever made the plan's layers,
  each stage's pieces jitted on a mesh of its own devices with every operator pinned to the plan's sharding. One step
  splits the batch into microbatches and drives every stage's task list in the plan's schedule order
  (:func:`autopar_lab.simulate.task_order`: GPipe, 1F1B, interleaved or ZB-H1) from one thread: a task runs as soon as
  what it needs is there (activations of earlier stages for a forward, gradients of later stages for a backward),
  values move between stage meshes with ``jax.device_put``, a forward keeps what its backward reads (no recomputation,
  unless the plan rematerialises the stage), gradients are summed over microbatches inside each task's program, and
  then each stage runs the step's own update for its parameters. An interleaved plan runs each of its chunks as a
  stage of its own on its plan stage's devices; a ZB-H1 plan runs each backward as two tasks, B and then, where the
  schedule puts it, the weight gradients W.
- **spmd** (one stage, one microbatch): the model's own ``step_fn`` replayed with the plan's sharding of every
  operator (:func:`autopar_lab.validate.replay_with_shardings`) and jitted once on the stage's mesh.

In both, the matmuls the plan runs as ring attention (context parallelism) run as rings of ``shard_map`` +
``ppermute`` steps (:mod:`autopar_lab.runtime.ring`); ``Runner.ring_ops`` lists them.

Timing: with ``timing=True`` (the default) each pipeline task waits for its result (``block_until_ready``) so its
duration can be measured; that also serialises the stages. ``stage_times()`` reports the median per microbatch over
every step after the first (which compiles), next to the plan's predictions.

Example:
    >>> import autopar_lab as al                                                     # doctest: +SKIP
    >>> model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)                # doctest: +SKIP
    >>> plan = al.megatron_plan(model, al.Cluster.preset("cpu"), dp=4, tp=1, pp=2, microbatches=2)  # doctest: +SKIP
    >>> runner = al.execute(plan, model)                                             # doctest: +SKIP
    >>> runner.train(3)                                                              # doctest: +SKIP
    [4.16..., 4.15..., 4.13...]
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Sequence

import jax

from ..plan import plan_object
from ..simulate import ScheduleStuck, issue_order, task_order
from .initpart import init_batch
from .layouts import check_plan_matches, device_mesh, move, stage_device_blocks
from .memprobe import DeviceMemoryProbe, PeakRSS, live_bytes
from .partition import StagedModel, split_stages
from .ring import ring_binds

__all__ = ["Runner", "execute", "synthetic_batch"]


def synthetic_batch(model, seed: int):
    """The model's own synthetic batch for ``seed`` (the batch of ``model.init(seed)``, made without the parameters
    and optimizer state: :func:`~autopar_lab.runtime.initpart.init_batch`)."""
    return init_batch(model, seed)


def _block(tree):
    return jax.tree_util.tree_map(lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x, tree)


class Runner:
    """A plan, running on local devices (see the module docstring). Build it with :func:`execute`."""

    def __init__(self, plan, model, *, seed: int = 0, devices=None, timing: bool = True, mode: str = "auto",
                 compiler_options=None, optimizer=None):
        check_plan_matches(model, plan)
        self.plan = plan
        self.model = model
        self.timing = bool(timing)
        self.losses: list[float] = []
        self.step_times: list[float] = []
        # (stage, kind, microbatch) in the order the last step ran them; for an interleaved plan the stage is the
        # chunk (virtual stage), for ZB-H1 a kind may be "wgrad"
        self.last_tasks: tuple = ()
        self._task_times: list[dict] = []  # per step: {(stage or chunk, kind): [seconds per task]}
        single = len(plan.stages) == 1 and int(plan.microbatches) == 1
        if mode not in ("auto", "pipeline", "spmd"):
            raise ValueError(f"mode must be 'auto', 'pipeline' or 'spmd', got {mode!r}.")
        self.notes: list[str] = []
        #: the operators run as ring attention (the plan's ring-marked matmuls usable on their mesh)
        self.ring_ops: tuple[int, ...] = ()
        self._compiler_options = dict(compiler_options) if compiler_options else None
        self._probe: DeviceMemoryProbe | None = None  # set while measure_memory runs its step
        self.mode = "pipeline"
        if mode == "spmd" or (mode == "auto" and single):
            if not single:
                raise ValueError("mode='spmd' runs one stage with one microbatch; this plan has "
                                 f"{len(plan.stages)} stage(s) and {plan.microbatches} microbatch(es).")
            try:
                self._init_spmd(seed, devices)
                self.mode = "spmd"
            except Exception as e:  # noqa: BLE001 - a replay that cannot follow this graph: run it as a 1-stage pipeline
                if mode == "spmd" or isinstance(e, ValueError) and "devices" in str(e):
                    raise
                self.notes.append(f"per-operator replay unavailable ({type(e).__name__}: {str(e)[:160]}); "
                                  "ran as a one-stage pipeline with the plan's input shardings")
        if self.mode == "pipeline":
            self.staged: StagedModel = split_stages(model, plan, devices=devices, compiler_options=compiler_options)
            if self.staged.loss_output is None:
                raise ValueError("the step returns no scalar loss (a floating scalar output that is not a new value of "
                                 "one of its inputs); return the loss from the step to train it.")
            self._state = [self.staged.init_state(k, seed) for k in range(self.staged.num_stages)]
            self.ring_ops = tuple(sorted({op for k in range(self.staged.num_stages) for op in self.staged.ring_ops(k)}))

    # --- one-stage SPMD ---------------------------------------------------------------------------------------
    def _init_spmd(self, seed, devices):
        from ..validate import replay_with_shardings, specs_from_strategies

        plan = self.plan
        st = plan.stages[0]
        if st.intra is None or (plan.table is not None and plan.table.solve_graph is not plan.graph):
            raise LookupError("the plan's strategies are not per operator of this graph")
        block = stage_device_blocks(plan, devices)[0]
        mesh = device_mesh(block, st.logical_mesh)
        out_specs, output_specs = specs_from_strategies(plan.graph, st.intra.strategies)
        output_specs = _stored_like_inputs(plan.graph, out_specs, output_specs)
        # ring-marked matmuls (context parallelism) run as rings of shard_map steps, not XLA's algorithm
        binds = ring_binds(plan.graph, st.intra.strategies, mesh)
        replay = replay_with_shardings(plan.graph, self.model.step_fn, self.model.abstract_args, out_specs, mesh,
                                       output_specs=output_specs, binds=binds)
        self.ring_ops = tuple(sorted(binds))
        self._replay = replay
        args = self.model.init(seed)
        batch_argnums = set(self.model.batch_argnums)
        self._spmd_io = _output_roles(plan.graph, args)
        # The state is donated, as a training loop's step donates it: XLA writes the new parameters and optimizer
        # state into the old ones' buffers, so a device holds one copy of its state, not two, while the step runs
        # (what the plan's memory prices). Only an argument whose every leaf the step returns anew is donated (a
        # leaf the step leaves as it is must outlive the step).
        donate = tuple(i for i, a in enumerate(args) if i not in batch_argnums
                       and all((i, j) in self._spmd_io[0] for j in range(len(jax.tree_util.tree_leaves(a)))))
        self._spmd_step = replay.jit(compiler_options=self._compiler_options, donate_argnums=donate)
        self._spmd_state = [None if i in batch_argnums else jax.tree_util.tree_map(move, a, replay.in_shardings[i])
                            for i, a in enumerate(args)]
        self.mesh = mesh

    def _step_spmd(self, batch) -> float:
        args = list(self._spmd_state)
        batch_argnums = self.model.batch_argnums
        parts = (batch,) if len(batch_argnums) == 1 else tuple(batch)
        for i, b in zip(batch_argnums, parts):
            args[i] = jax.tree_util.tree_map(move, b, self._replay.in_shardings[i])
        if self._probe is not None:
            self._probe(self.mesh.devices.flat, self._spmd_step, args)
        t0 = time.perf_counter()
        outs = jax.tree_util.tree_leaves(self._spmd_step(*args))
        new_leaf, loss_index = self._spmd_io
        if loss_index is None:
            raise ValueError("the step returns no scalar loss (a floating scalar output that is not a new value of "
                             "one of its inputs); return the loss from the step to train it.")
        loss = float(outs[loss_index])
        self.step_times.append(time.perf_counter() - t0)
        for i, a in enumerate(self._spmd_state):
            if a is not None:
                leaves, tree = jax.tree_util.tree_flatten(a)
                for j in range(len(leaves)):
                    k = new_leaf.get((i, j))
                    if k is not None:
                        leaves[j] = outs[k]
                # a plan may leave an updated value in another layout than its input's: lay it out for the next
                # step (outside the timed call, as a runtime keeping its own layout would)
                self._spmd_state[i] = jax.tree_util.tree_map(move, jax.tree_util.tree_unflatten(tree, leaves),
                                                             self._replay.in_shardings[i])
        return loss

    # --- pipeline ----------------------------------------------------------------------------------------------
    def _step_pipeline(self, batch) -> float:
        sm, plan = self.staged, self.plan
        S, B = sm.num_stages, sm.microbatches
        mbs = sm.split_batch(batch, B)
        P, v = len(plan.stages), plan.virtual_stages
        group = plan.stage_pins.get("microbatch_group") if plan.schedule == "interleaved" else None
        orders = [task_order(d, P, B, plan.schedule, virtual_stages=v, group=group)  # chunks c of stage c % P
                  for d in range(P)]
        tasks = [(k, kind) for k in range(S) for kind in sm.kinds]
        readers = {t: sum(t in sm.sources(*r) for r in tasks) for t in tasks}
        stash_from = {(k, kind): [e for e in sm.kinds if kind in sm.stash_readers(k, e)] for k, kind in tasks}
        exports: dict[tuple, dict] = {}  # (stage, kind, mb) -> what the task sent to other stages
        left: dict[tuple, int] = {}  # how many readers of those exports (or that stash) have not run yet
        stash: dict[tuple, dict] = {}  # (stage, kind, mb) -> what the task keeps for its stage's later tasks
        acc: dict[tuple[int, str], Any] = {}  # (stage, kind) -> values the update reads, summed over microbatches
        times: dict = {}
        done: list[tuple[int, str, int]] = []

        def ready(_d, kind, k, j):
            if any((k, e, j) not in stash for e in stash_from[(k, kind)]):
                return False
            return all((s, kd, j) in exports for s, kd in sm.sources(k, kind))

        t_step = time.perf_counter()
        try:
            for _d, kind, k, j in issue_order(orders, ready):
                received = {}
                for s, kd in sm.sources(k, kind):
                    received.update(exports[(s, kd, j)])
                kept = {}
                for e in stash_from[(k, kind)]:  # the stashes this task reads; each freed after its last reader
                    kept.update(stash[(k, e, j)])
                    left[("stash", k, e, j)] -= 1
                    if not left[("stash", k, e, j)]:
                        del stash[(k, e, j)]
                t0 = time.perf_counter()
                res = sm.run_task(k, kind, self._state[k], received, mbs[j], kept if stash_from[(k, kind)] else None,
                                  acc=acc.get((k, kind)))
                acc[(k, kind)] = res.acc  # summed over the microbatches inside the task's program
                if self.timing:
                    _block((res.exports, res.stash, acc[(k, kind)]))
                times.setdefault((k, kind), []).append(time.perf_counter() - t0)
                if sm.stash_readers(k, kind):
                    stash[(k, kind, j)] = res.stash
                    left[("stash", k, kind, j)] = len(sm.stash_readers(k, kind))
                if readers[(k, kind)]:
                    exports[(k, kind, j)] = res.exports
                    left[(k, kind, j)] = readers[(k, kind)]
                for s, kd in sm.sources(k, kind):  # every reader has run: free the values
                    left[(s, kd, j)] -= 1
                    if not left[(s, kd, j)]:
                        del exports[(s, kd, j)]
                done.append((k, kind, j))
        except ScheduleStuck:
            raise RuntimeError("the pipeline driver is stuck (a stage waits for a value nobody produces); this "
                               "is a bug in the stage split.") from None
        new_state, outputs = [], {}
        acc = [{key: val for kind in sm.kinds for key, val in acc.get((k, kind), {}).items()} for k in range(S)]
        for k in range(S):  # every stage's update reads the state as it was before any update
            received = {name: acc[src].get(name, self._state[src].get(name)) for name, src in sm.update_inputs(k)}
            st, outs = sm.update(k, self._state[k], acc[k], received, donate=True)
            new_state.append(st)
            outputs.update(outs)
        self._state = new_state
        loss = float(outputs[sm.loss_output])
        _block(self._state)
        self.step_times.append(time.perf_counter() - t_step)
        self._task_times.append(times)
        self.last_tasks = tuple(done)
        return loss

    # --- public -------------------------------------------------------------------------------------------------
    def step(self, batch) -> float:
        """One training step on ``batch`` (the full batch; it is split into the plan's microbatches): the loss
        (mean of the microbatch losses, which for a mean loss equals the full batch's loss)."""
        loss = self._step_spmd(batch) if self.mode == "spmd" else self._step_pipeline(batch)
        self.losses.append(loss)
        return loss

    def train(self, steps: int, batches: Sequence | None = None, seed: int = 0) -> list[float]:
        """``steps`` training steps; ``batches`` defaults to the model's synthetic batches, the batch of step ``i``
        being ``model.init(seed + i)``'s (a fixed key per step, so runs are repeatable). Returns the losses."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be a non-negative integer, got {steps!r}.")
        if batches is not None and len(batches) < steps:
            raise ValueError(f"{steps} steps need {steps} batches, got {len(batches)}.")
        out = []
        for i in range(steps):
            batch = batches[i] if batches is not None else synthetic_batch(self.model, seed + i)
            out.append(self.step(batch))
        return out

    @property
    def params(self):
        """The full parameter pytree (stages merged)."""
        if self.mode == "spmd":
            return self._spmd_state[self.model.param_argnums[0]]
        return self.staged.merge_params(self._state)

    @property
    def state(self) -> list:
        """The step's non-batch arguments as they are now (``None`` for batch arguments), stages merged."""
        if self.mode == "spmd":
            return list(self._spmd_state)
        return self.staged.merge_state(self._state)

    @property
    def stage_params(self) -> list:
        """Each stage's step inputs (flat dicts keyed by path, ``"args[0]['wte']"``; per chunk for an interleaved plan,
        chunk ``c`` on plan stage ``c % p``); one full pytree in spmd mode."""
        return [self.params] if self.mode == "spmd" else list(self._state)

    def measure_memory(self, batch=None) -> dict:
        """One step (on ``batch``; default the next synthetic batch) with each device's memory measured
        (:mod:`autopar_lab.runtime.memprobe`: live buffers on the device before each program plus what the program
        adds, from XLA's compiled memory analysis), beside the plan's prediction. Arrays on the devices that are not
        this runner's (another runner's, the caller's) are left out: what a device holds before the step beyond this
        runner's state is subtracted. A runner that has not stepped yet
        runs one step first (it compiles; its programs would otherwise be compiled twice).

        Returns ``{"stages": [{stage, devices, predicted_bytes, measured_bytes (the most of its devices),
        per_device_bytes}], "process_rss_start_bytes", "process_rss_peak_bytes", "loss"}``: the process's resident
        memory before and at its peak during the step (all devices of this process together)."""
        if batch is None:
            batch = synthetic_batch(self.model, len(self.losses))
        if not self.losses:
            self.step(batch)
        # Arrays that are not this runner's (another runner's state, the caller's batches) sit on the same devices:
        # what a device holds between steps beyond this runner's state is subtracted from its peak.
        gc.collect()
        own: dict = {}
        for x in jax.tree_util.tree_leaves(self._spmd_state if self.mode == "spmd" else self._state):
            for sh in x.addressable_shards:
                own[sh.device] = own.get(sh.device, 0) + int(sh.data.nbytes)
        others = {d: n - own.get(d, 0) for d, n in live_bytes().items()}
        probe = DeviceMemoryProbe()
        self._probe = probe
        if self.mode == "pipeline":
            self.staged.probe = probe
        try:
            with PeakRSS() as rss:
                loss = self.step(batch)
        finally:
            self._probe = None
            if self.mode == "pipeline":
                self.staged.probe = None
        if self.mode == "pipeline":
            blocks = [list(self.staged.mesh(c).devices.flat) for c in range(self.staged.num_stages)]
            devices = [[d for c, b in enumerate(blocks) if self.staged.device_stage[c] == k for d in b]
                       for k in range(len(self.plan.stages))]
        else:
            devices = [list(self.mesh.devices.flat)]
        stages = []
        for k, st in enumerate(self.plan.stages):
            mine = list(dict.fromkeys(devices[k]))  # an interleaved stage's chunks share its devices
            per = {str(d): probe.peak.get(d, 0) - others.get(d, 0) for d in mine}
            stages.append({"stage": k, "devices": list(per), "predicted_bytes": float(st.peak_mem_bytes),
                           "measured_bytes": max(per.values()), "per_device_bytes": per})
        return {"stages": stages, "process_rss_start_bytes": rss.start, "process_rss_peak_bytes": rss.peak,
                "loss": loss}

    def measured_step_s(self) -> float | None:
        """Median wall time of the steps after the first (which compiles); None before two steps."""
        later = self.step_times[1:]
        return statistics.median(later) if later else None

    def stage_times(self) -> list[dict]:
        """Per stage: the plan's predicted forward / backward seconds per microbatch, and the measured ones (median
        over steps after the first of each step's time per microbatch; None in spmd mode, with ``timing=False``, or
        before two steps). An interleaved stage's figures add up its chunks; a ZB-H1 backward is B and W together
        (``*_wgrad_s``: the W part)."""
        rows = []
        later = self._task_times[1:]
        B = int(self.plan.microbatches)
        for k, st in enumerate(self.plan.stages):
            row = {"stage": k, "predicted_fwd_s": st.fwd_s, "predicted_bwd_s": st.bwd_s,
                   "measured_fwd_s": None, "measured_bwd_s": None}
            if st.wgrad_s:
                row.update(predicted_wgrad_s=st.wgrad_s, measured_wgrad_s=None)
            if self.mode == "pipeline" and later and self.timing:
                mine = [c for c, d in enumerate(self.staged.device_stage) if d == k]
                groups = {"fwd": ("fwd",), "bwd": ("bwd", "wgrad"), "wgrad": ("wgrad",)}
                for name, kinds in groups.items():
                    if name == "wgrad" and not st.wgrad_s:
                        continue
                    per_step = [sum(sum(t.get((c, kd), ())) for c in mine for kd in kinds) / B for t in later
                                if any(t.get((c, kd)) for c in mine for kd in kinds)]
                    row[f"measured_{name}_s"] = statistics.median(per_step) if per_step else None
            rows.append(row)
        return rows

    def report(self) -> dict:
        """A JSON-ready summary: plan, mode, devices, losses, predicted and measured step and stage times."""
        measured = self.measured_step_s()
        predicted = self.plan.cost.step_time_s
        if self.mode == "pipeline":
            devices = [[str(d) for d in self.staged.mesh(k).devices.flat] for k in range(len(self.plan.stages))]
        else:
            devices = [[str(d) for d in self.mesh.devices.flat]]
        return {
            "model": getattr(self.model, "name", ""),
            "method": self.plan.method,
            "mode": self.mode,
            "num_stages": len(self.plan.stages),
            "microbatches": int(self.plan.microbatches),
            "schedule": self.plan.schedule,
            "virtual_stages": self.plan.virtual_stages,
            "logical_meshes": [list(st.logical_mesh) for st in self.plan.stages],
            "devices": devices,
            "steps": len(self.losses),
            "losses": list(self.losses),
            "predicted_step_s": predicted,
            "measured_step_s": measured,
            "measured_over_predicted": (measured / predicted) if measured and predicted else None,
            "timing": self.timing,
            "stage_times": self.stage_times(),
            "notes": list(self.notes),
        }

    def __repr__(self):
        return (f"Runner({self.plan.method}, {self.mode}, {len(self.plan.stages)} stage(s), "
                f"{self.plan.microbatches} microbatch(es), {len(self.losses)} step(s) run)")


def _stored_like_inputs(graph, out_specs: dict, output_specs: dict) -> dict:
    """``output_specs`` with each new value of a step input (an output aliasing it) in that input's spec: the plan
    prices converting the update back to how the input is stored (the alias edge; e.g. a ZeRO-3 / FSDP weight
    updated on other shards), and the next step's jit takes the input in exactly that sharding."""
    out = dict(output_specs)
    for node in graph:
        alias = node.params.get("alias_of") if node.primitive == "output" else None
        if alias is None:
            continue
        src = graph.tensor(alias).producer
        if src in out_specs and out_specs[src]:
            out[node.id] = out_specs[src][0]
    return out


def _output_roles(graph, args) -> tuple[dict, int | None]:
    """``({(argnum, leaf): output leaf}, loss output leaf)``: which output leaf is the new value of which argument
    leaf (from the graph's aliases), and the first scalar floating output that is none."""
    where, it = {}, iter(graph.inputs)
    for i, a in enumerate(args):
        for j in range(len(jax.tree_util.tree_leaves(a))):
            where[next(it)] = (i, j)
    new_leaf, loss = {}, None
    outs = [n for n in graph if n.primitive == "output"]
    for k, node in enumerate(outs):
        alias = node.params.get("alias_of")
        if alias is not None:
            new_leaf[where[alias]] = k
        elif loss is None:
            t = graph.tensor(node.inputs[0])
            if t.shape == () and "float" in t.dtype:
                loss = k
    return new_leaf, loss


def execute(plan, model, *, seed: int = 0, devices=None, timing: bool = True, mode: str = "auto",
            compiler_options=None, optimizer=None) -> Runner:
    """Run ``plan`` for ``model`` on local JAX devices; returns a :class:`Runner` (``.step(batch)``, ``.train(n)``).

    ``devices``: the jax devices to use (default ``jax.local_devices()``; stage k takes the k-th contiguous block).
    A plan that needs more devices than there are, or that was made for another model, raises ValueError.
    ``mode``: ``"auto"`` (spmd for one stage and one microbatch, else pipeline), ``"pipeline"`` or ``"spmd"``.
    ``compiler_options``: XLA options for the compiled programs (``{"xla_backend_optimization_level": 0}`` compiles
    several times faster on CPU). ``timing``: wait for each pipeline task so ``stage_times()`` can measure it.
    ``optimizer`` is accepted for compatibility and not needed: a pipeline runs the step's own update.

    ``model``: a :class:`~autopar_lab.models.base.ModelSpec` (the zoo's, or yours from
    ``ModelSpec.from_step(step_fn, init_fn, batch_argnums=...)``).
    """
    plan_object(plan, "al.execute")
    return Runner(plan, model, seed=seed, devices=devices, timing=timing, mode=mode,
                  compiler_options=compiler_options, optimizer=optimizer)
