"""Cut a traced training step into the pipeline stages of a plan, and run the pieces: Alpa's MPMD partition, on the
step's own jaxpr.

:func:`split_stages` captures ``model.step_fn`` once more, on one microbatch's shapes, keeping what every operator
computes (:func:`autopar_lab.graph.capture.capture_program`: the same walk as :func:`autopar_lab.trace`, so operator
``i`` here is operator ``i`` of the plan's graph). Every operator then takes its stage from the layer the *plan's*
graph gives it, however those layers were made (name scopes, ``al.pipeline_boundary`` markers, clustering, a
``layers=`` pattern): nothing is re-derived from a loss function.

The step's operators fall in three parts, by their role in the graph:

- **forward** (per microbatch): an operator runs on its layer's stage, or later if an input comes from a later
  stage (values flow forward);
- **backward** (per microbatch): on its layer's stage, or earlier if an input gradient comes from an earlier stage
  (gradients flow backward). The backward is the step's own (``jax.grad``'s transposes, custom rules, ``remat``), not
  a re-derivation: a backward task reads the forward values it needs from its stage's forward (the *stash*, held
  until then, as the plan's activation memory assumes), or, for a stage the plan rematerialises (``remat=True``),
  recomputes them from the forward's inputs (``remat="selective"``: only the attention internals,
  :func:`~autopar_lab.graph.attention.attention_internals`, from the stashed Q and K);
- **update** (once per step): every value the update or the step's outputs read from the per-microbatch part (the
  gradients, the loss) is summed over the microbatches and divided by their number, then each stage runs the update
  operators that produce its own outputs (its parameters' and optimizer state's new values). For a loss that is a
  mean over the batch this is the full batch's step, exactly (up to rounding), whatever the optimizer: even one that
  looks at every gradient at once (global-norm clipping) sees the full batch's gradients.

Step inputs: a leaf (parameter, optimizer state, any non-batch argument) is *owned* by the earliest stage whose
forward or backward reads it; a later stage that reads it too (GPT's tied token embedding) receives it from the
owner's forward task, per microbatch, and the step's own backward sums the gradient of every use. A leaf that only
the update reads (Adam's step count) is held by every stage whose update reads it, each updating its copy the same
way. Batch leaves are split along their leading axis into the plan's microbatches.

Shardings: every operator a stage program runs (forward, backward, update) has its outputs, and a contraction its
operands, pinned to the plan's strategy for it on the stage's mesh (:meth:`StagedModel.op_shardings`), as the
one-stage replay pins them: the programs run the collectives the plan priced, not ones XLA propagates from the
stage's inputs.

Tasks: ``(stage, "fwd")`` and ``(stage, "bwd")`` per microbatch, then ``update`` per stage. :meth:`StagedModel.sources`
says which tasks of the same microbatch a task reads from; values that cross stages are *exports* (named
``"args[0]['wte']"`` for a step input, ``"%123"`` for the value of tensor 123); what a stage keeps for itself stays
in its stash (read by its later tasks of the same microbatch) and accumulators. The local runner (:mod:`.local`)
and the Ray driver (:mod:`.train_entry`) both walk these tasks in the plan's schedule order.

Ring attention: a matmul the plan marks ``[ring@a]`` (context parallelism) runs in its stage's program as a ring
of ``shard_map`` steps on the stage's mesh (:meth:`StagedModel.ring_ops`, :mod:`autopar_lab.runtime.ring`), with
the operator's own parameters; one whose layout a microbatch's shapes do not divide runs as the step does.

The module's parts: which tasks run what and what crosses between stages is a pure function of the plan and the
graph (:mod:`autopar_lab.runtime.taskgraph`, testable without devices); where each value lives on each stage's mesh
is :mod:`autopar_lab.runtime.layouts`; this module runs the tasks (the stage programs, the state, the batches).

The schedules (:mod:`autopar_lab.schedules`) change the tasks two ways:

- **interleaved**: the "stages" here are the plan's *virtual* stages, its model chunks in order (chunk ``c`` is
  the ``c // p``-th chunk of plan stage ``c % p`` and runs on that stage's devices and mesh):
  :attr:`StagedModel.num_stages` counts chunks and :attr:`StagedModel.device_stage` names each one's plan stage.
  Values between two chunks of one plan stage stay on its devices.
- **zb-h1**: each stage's backward is two tasks, ``"bwd"`` (the input gradients B: the operators of
  :func:`~autopar_lab.pricing.wgrad.input_grad_ops`, everything they need, and everything another stage reads) and
  ``"wgrad"`` (the rest: the weight gradients W), which reads the values it needs from the stashes of the stage's
  forward and B; :attr:`StagedModel.kinds` lists the task kinds.

Example (2 stages of gpt-tiny on 8 CPU devices):
    >>> import autopar_lab as al                                                    # doctest: +SKIP
    >>> model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)               # doctest: +SKIP
    >>> plan = al.megatron_plan(model, al.Cluster.preset("cpu"), dp=4, tp=1, pp=2, microbatches=2)  # doctest: +SKIP
    >>> staged = split_stages(model, plan)                                          # doctest: +SKIP
    >>> staged.sources(1, "fwd"), staged.sources(0, "bwd")                          # doctest: +SKIP
    ([(0, 'fwd')], [(1, 'bwd')])
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..graph.capture import capture_program
from .initpart import init_leaves
from .layouts import StageLayouts, check_plan_matches, move, stage_device_blocks
from .taskgraph import TaskGraph, is_inexact

__all__ = ["StagedModel", "TaskResult", "split_stages", "LOSS"]

LOSS = "loss"


@dataclass
class TaskResult:
    """What one forward or backward task returns: ``exports`` (values tasks of other stages read, by name),
    ``stash`` (values this stage's backward of the same microbatch reads) and ``acc`` (this microbatch's part of the
    values the update reads: gradients, the loss)."""

    exports: dict
    stash: dict
    acc: dict


class StagedModel:
    """A model's training step cut into the stages of a plan (see the module docstring for the contract)."""

    def __init__(self, model, plan, *, devices=None, optimizer=None, compiler_options=None):
        check_plan_matches(model, plan)
        del optimizer  # the optimizer is part of the step's own program: nothing to be told
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self.model = model
        self.schedule = plan.schedule
        self.microbatches = M = int(plan.microbatches)
        self._compiled: dict = {}
        #: called as ``probe(devices, program, args)`` before each stage program runs, when set (None: nothing);
        #: :class:`~autopar_lab.runtime.memprobe.DeviceMemoryProbe` measures each device's peak memory with it
        self.probe = None
        self._split_inputs(model, M)
        prog = _step_program(model, self._mb_args, self._opt_argnums, M)
        self._check_same_program(prog.graph, plan.graph)
        self._prog = prog
        self._g = prog.graph
        #: which tasks run what, and what crosses between stages (no devices: see runtime.taskgraph)
        self.tasks = TaskGraph(plan, self._g)
        self.plan = self.tasks.plan  # an interleaved plan's chunks are the stages here
        self.num_stages = self.tasks.num_stages
        #: the plan stage (devices) each stage here runs on: itself, or for a chunk its plan stage
        self.device_stage = self.tasks.device_stage
        #: the task kinds per stage and microbatch, in the order one microbatch runs them
        self.kinds = self.tasks.kinds
        self.owner = self.tasks.owner
        self.loss_output = self.tasks.loss_output
        self.update_crosses_stages = self.tasks.update_crosses_stages
        physical = stage_device_blocks(plan, devices)
        #: each stage's mesh and the layout of every value on it
        self.layouts = StageLayouts(self.tasks, [physical[d] for d in self.device_stage], self.microbatch_size)

    # --- inputs ---------------------------------------------------------------------------------------------------
    def _split_inputs(self, model, M):
        args = model.abstract_args
        self._opt_argnums = tuple(i for i in range(len(args)) if i not in model.batch_argnums
                                  and i not in model.param_argnums)
        self._args_def = [jax.tree_util.tree_structure(a) for a in args]
        b_leaves = [x for i in model.batch_argnums for x in jax.tree_util.tree_leaves(args[i])]
        if not b_leaves:
            raise ValueError(f"model {getattr(model, 'name', '')!r} names no batch argument (batch_argnums); a "
                             "pipeline splits the batch into microbatches, so say which argument holds it.")
        sizes = {int(x.shape[0]) if x.shape else None for x in b_leaves}
        if len(sizes) != 1 or None in sizes:
            raise ValueError("every batch leaf needs the batch on its leading axis (same size) to be split into "
                             f"microbatches; got shapes {[tuple(x.shape) for x in b_leaves]}.")
        self.batch_size = sizes.pop()
        if self.batch_size % M:
            raise ValueError(f"the plan's {M} microbatches do not divide the batch of {self.batch_size}; choose a "
                             "divisor.")
        self.microbatch_size = mb = self.batch_size // M

        def shrink(x):
            return jax.ShapeDtypeStruct((mb,) + tuple(x.shape[1:]), x.dtype)

        self._mb_args = tuple(jax.tree_util.tree_map(shrink, a) if i in model.batch_argnums else a
                              for i, a in enumerate(args))

    @staticmethod
    def _check_same_program(g, full):
        if len(g) == len(full) and all(a.primitive == b.primitive for a, b in zip(g, full)):
            return
        i = next((i for i, (a, b) in enumerate(zip(g, full)) if a.primitive != b.primitive), min(len(g), len(full)))
        here = g.op(i).describe() if i < len(g) else "nothing"
        there = full.op(i).describe() if i < len(full) else "nothing"
        raise ValueError(f"the step's program on one microbatch differs from the plan's graph at operator {i} "
                         f"({here} vs {there}): a pipeline needs a step whose operators do not depend on the batch "
                         "size; trace the plan's graph from this model's step (model.trace()).")

    # --- the task graph's answers (runtime.taskgraph) ------------------------------------------------------------
    def stash_readers(self, k: int, kind: str) -> tuple[str, ...]:
        return self.tasks.stash_readers(k, kind)

    def sources(self, k: int, kind: str) -> list[tuple[int, str]]:
        return self.tasks.sources(k, kind)

    def inputs(self, k: int, kind: str) -> tuple[str, ...]:
        return self.tasks.inputs(k, kind)

    def exports(self, k: int, kind: str) -> tuple[str, ...]:
        return self.tasks.exports(k, kind)

    def producer(self, name: str) -> tuple[int, str]:
        return self.tasks.producer(name)

    def task_ops(self, k: int, kind: str) -> tuple[int, ...]:
        return self.tasks.task_ops(k, kind)

    def update_ops(self, k: int) -> tuple[int, ...]:
        return self.tasks.update_ops(k)

    def stage_state_paths(self, k: int) -> tuple[str, ...]:
        return self.tasks.stage_state_paths(k)

    def update_sources(self, k: int) -> list[tuple[int, str]]:
        return self.tasks.update_sources(k)

    def is_accumulated(self, name: str) -> bool:
        return self.tasks.is_accumulated(name)

    def update_inputs(self, k: int) -> list[tuple[str, int]]:
        return self.tasks.update_inputs(k)

    def stage_param_keys(self, k: int) -> tuple[str, ...]:
        """The parameter leaves stage k owns, as paths inside the parameter argument (``"['wte']"``)."""
        pre = f"args[{self.model.param_argnums[0]}]"
        return tuple(p[len(pre):] for p in self.stage_state_paths(k) if p.startswith(pre)
                     and self.owner.get(self.tasks.var_of[p]) == k)

    def value_dtype(self, name: str):
        return self._g.tensor(self.tasks.var_of[name]).dtype

    # --- layouts (runtime.layouts) ------------------------------------------------------------------------------
    def mesh(self, k: int) -> Mesh:
        """Stage k's ``jax.sharding.Mesh`` (axes ("x", "y") = the plan's logical mesh) over its device block."""
        return self.layouts.mesh(k)

    def value_sharding(self, k: int, name: str) -> NamedSharding:
        """Where value ``name`` lives on stage k's mesh (see
        :meth:`autopar_lab.runtime.layouts.StageLayouts.value_sharding`)."""
        return self.layouts.value_sharding(k, name)

    def receive(self, k: int, name: str, x):
        """Value ``name``, made by another stage's task, placed on stage k's devices, keeping its layout where a mesh
        of stage k's shape holds it (:meth:`autopar_lab.runtime.layouts.StageLayouts.receive` says why)."""
        return self.layouts.receive(k, name, x)

    def ring_ops(self, k: int) -> dict[int, Any]:
        """Stage k's ring-attention matmuls, each with the function running it as a ring."""
        return self.layouts.ring_ops(k)

    def op_shardings(self, k: int) -> dict[int, tuple]:
        """Operator -> (output shardings, operand shardings or None) in stage k's programs: the plan's strategies."""
        return self.layouts.op_shardings(k)

    # --- init, batches, merge -----------------------------------------------------------------------------------
    def init_state(self, k: int, seed: int = 0) -> dict:
        """The step inputs stage k holds, ``{path: array}``: its slice of ``model.init(seed)`` (same numbers), made
        alone and placed on its mesh by the plan's shardings (:func:`~autopar_lab.runtime.initpart.init_leaves`: the
        stage never holds the rest of the model, not even while it starts)."""
        held = self.tasks.held[self.tasks.check_stage(k)]
        position = {t: i for i, t in enumerate(self._g.inputs)}
        values = init_leaves(self.model, seed, [position[t] for t in held],
                             [self.layouts.sharding_of(k, t) for t in held])
        return {self.tasks.names[t]: x for t, x in zip(held, values)}

    def place_state(self, k: int, state: dict) -> dict:
        """``state`` (``{path: array}``) put on stage k's mesh with the plan's shardings."""
        return {name: move(x, self.layouts.sharding_of(k, self.tasks.var_of[name])) for name, x in state.items()}

    def split_batch(self, batch, microbatches: int | None = None) -> list:
        """``microbatches`` equal microbatches along the leading (batch) axis of every batch leaf (host arrays).

        The stages were traced for the plan's microbatch count, so ``microbatches`` must be that count."""
        m = self.microbatches if microbatches is None else int(microbatches)
        if m != self.microbatches:
            raise ValueError(f"this split was traced for the plan's {self.microbatches} microbatches, not {m}; make "
                             "a plan with the count you want (plan.with_stages(microbatches=...)).")
        want = [self._args_def[i] for i in self.model.batch_argnums]
        tree = jax.tree_util.tree_structure(batch if len(want) > 1 else (batch,))
        if tree != jax.tree_util.tree_structure(tuple(jax.tree_util.tree_unflatten(d, [0] * d.num_leaves)
                                                      for d in want)):
            raise ValueError(f"the batch has structure {jax.tree_util.tree_structure(batch)}, the model expects "
                             f"{want[0] if len(want) == 1 else want}.")
        leaves = jax.tree_util.tree_leaves(batch)
        n = int(np.shape(leaves[0])[0])
        if n != self.batch_size:
            raise ValueError(f"the batch has {n} samples but the model (and its plan) take {self.batch_size}.")
        size = n // m
        leaves = [np.asarray(x) for x in leaves]  # sliced on the host: each stage copies just its microbatch
        return [[x[j * size:(j + 1) * size] for x in leaves] for j in range(m)]

    def merge_state(self, parts: Sequence[dict]) -> list:
        """The step's non-batch arguments (pytrees, ``None`` for batch arguments) from every stage's state."""
        if len(parts) != self.num_stages:
            raise ValueError(f"merge_state needs one state dict per stage ({self.num_stages}), got {len(parts)}.")
        flat = {}
        for part in reversed(parts):  # an input several stages hold: its owner's (earliest) copy wins
            flat.update(part)
        it = iter(self._g.inputs)
        out = []
        for i, d in enumerate(self._args_def):
            tids = [next(it) for _ in range(d.num_leaves)]
            if i in self.model.batch_argnums:
                out.append(None)
                continue
            missing = [self.tasks.names[t] for t in tids if self.tasks.names[t] not in flat]
            if missing:
                raise ValueError(f"step input {missing[0]} is in no stage's state.")
            out.append(jax.tree_util.tree_unflatten(d, [flat[self.tasks.names[t]] for t in tids]))
        return out

    def merge_params(self, parts: Sequence[dict]):
        """The parameter pytree (the first parameter argument) from every stage's state."""
        return self.merge_state(parts)[self.model.param_argnums[0]]

    # --- the stage programs -----------------------------------------------------------------------------------
    def _run_ops(self, ops, env: dict, binds: dict | None = None, shardings: dict | None = None) -> dict:
        g, fns, consts = self._g, self._prog.fns, self._prog.consts
        binds, shardings = binds or {}, shardings or {}
        pin = jax.lax.with_sharding_constraint
        for i in ops:
            node = g.op(i)
            vals = [env[t] if t in env else consts[t] for t in node.inputs]
            outs_sh, operands_sh = shardings.get(i, ((), None))
            if operands_sh:  # a contraction runs on the operand shards its strategy reads (its reshards, not XLA's)
                vals = [pin(v, sh) if sh is not None and hasattr(v, "shape") else v for v, sh in zip(vals, operands_sh)]
            if i in binds:  # a ring-attention matmul: its ring, with the operator's own parameters
                outs = [binds[i](*vals, **self._prog.bind_params(i))]
            else:
                outs = fns[i](*vals)
            if outs_sh:
                outs = [pin(o, sh) if sh is not None and hasattr(o, "shape") else o for o, sh in zip(outs, outs_sh)]
            env.update(zip(node.outputs, outs))
        return env

    def _task_fn(self, k, kind):
        key = ("task", k, kind)
        if key in self._compiled:
            return self._compiled[key]
        task = self.tasks.tasks[(k, kind)]
        ins = list(task.state_in) + list(task.recv) + list(task.stash_in) + list(task.batch_in)
        exports, stash, acc = sorted(task.exports), sorted(task.stash_out), sorted(task.acc_out)
        consts = self._prog.consts
        binds, shardings = self.ring_ops(k), self.op_shardings(k)
        acc_sh = [self.layouts.acc_sharding(k, t) for t in acc]

        def run(*vals):
            # the last len(acc) arguments: the running sums of the earlier microbatches (zeros for the first), added
            # to here, as a real runtime accumulates gradients inside the backward (not as a program of its own)
            vals, acc_in = vals[:len(ins)], vals[len(ins):]
            env = self._run_ops(task.ops, dict(zip(ins, vals)), binds, shardings)
            pick = lambda ts: tuple(env[t] if t in env else consts[t] for t in ts)  # noqa: E731
            summed = tuple(jax.lax.with_sharding_constraint(a + b, sh) if is_inexact(b.dtype) else b
                           for a, b, sh in zip(acc_in, pick(acc), acc_sh))
            return pick(exports), pick(stash), summed

        # the running sums are donated: XLA writes this microbatch's sums into their buffers, so a stage holds one
        # buffer per sum through the step, not the old and the new one side by side (a non-floating value is not a
        # sum: its output is this microbatch's value, no buffer could take it, and jax would warn of an unused one)
        donate = tuple(len(ins) + j for j, t in enumerate(acc) if is_inexact(jnp.dtype(self._g.tensor(t).dtype)))
        fn = jax.jit(run, compiler_options=self.compiler_options, donate_argnums=donate)
        self._compiled[key] = (fn, ins, exports, stash, acc)
        return self._compiled[key]

    def _acc_zeros(self, k: int, kind: str) -> tuple:
        """Fresh zeros to start task ``(k, kind)``'s sums from, made anew for each step's first microbatch: the task
        program takes them donated and writes its sums into them, so no zeros outlive the first task (cached, they
        were one more gradient-sized buffer per stage for the runner's lifetime)."""
        key = ("acc0", k, kind)
        if key not in self._compiled:
            acc = sorted(self.tasks.tasks[(k, kind)].acc_out)
            like = [(tuple(self._g.tensor(t).shape), jnp.dtype(self._g.tensor(t).dtype),
                     self.layouts.acc_sharding(k, t)) for t in acc]
            # made by a program pinning them as the task's program pins its sums, so both come back with the same
            # sharding object (a jit keys its compiled programs on it: P(None,) and P() would compile twice)
            self._compiled[key] = jax.jit(lambda: tuple(jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sh)
                                                        for shape, dtype, sh in like))
        return self._compiled[key]()

    def run_task(self, k: int, kind: str, state: dict, received: dict, batch_mb, stash: dict | None = None,
                 acc: dict | None = None) -> TaskResult:
        """Task ``(k, kind)`` on one microbatch (``batch_mb``: a list of batch leaves from :meth:`split_batch`).

        ``state``: stage k's step inputs (:meth:`init_state`); ``received``: the exports of the tasks in
        :meth:`sources` (a dict by name; extra names are ignored; values may live on any device, they are moved
        here); ``stash``: the stashes of stage k's earlier tasks of the same microbatch that this one reads (a backward
        task: its forward's; a "wgrad" task: its forward's and backward's, merged); ``acc``: this task's ``.acc`` of
        the earlier microbatches of the step (None for the first). The result's ``acc`` is then ``acc`` plus this
        microbatch's part, summed inside the task's program (floating values; any other value is this microbatch's),
        the same as :meth:`accumulate` (``acc``, the result's ``acc`` with ``acc=None``). ``acc``'s floating arrays are
        *donated*: the program writes the new sums into their buffers, and they are deleted (keep the result's
        ``acc``, or copy them first)."""
        task = self.tasks.task(k, kind)
        if not task.ops:  # nothing to run (a first stage's B under ZB-H1 may have no input gradient to make)
            return TaskResult({}, {}, dict(acc or {}))
        fn, ins, exports, stash_out, acc_out = self._task_fn(k, kind)
        vals = [state[self.tasks.names[t]] for t in task.state_in]
        for t in task.recv:
            name = self.tasks.names[t]
            if name not in received:
                raise ValueError(f"task ({k}, {kind!r}) needs {name!r} from task {self.producer(name)}; it received "
                                 f"{sorted(received)[:6]}.")
            vals.append(self.receive(k, name, received[name]))
        if task.stash_in:
            if stash is None:
                raise ValueError(f"task ({k}, {kind!r}) needs the stash of its stage's earlier tasks of the same "
                                 "microbatch.")
            vals += [stash[t] for t in task.stash_in]
        leaf_index = {t: j for j, t in enumerate(self.tasks.batch_tids)}
        vals += [move(batch_mb[leaf_index[t]], self.layouts.batch_sharding(k, t)) for t in task.batch_in]
        if acc:
            vals += [acc[self.tasks.names[t]] for t in acc_out]
        else:
            vals += list(self._acc_zeros(k, kind))
        if self.probe is not None:
            self.probe(self.mesh(k).devices.flat, fn, vals)
        e, s, a = fn(*vals)
        return TaskResult({self.tasks.names[t]: v for t, v in zip(exports, e)}, dict(zip(stash_out, s)),
                          {self.tasks.names[t]: v for t, v in zip(acc_out, a)})

    def accumulate(self, k: int, acc: dict | None, part: dict) -> dict:
        """``acc + part``, value by value, in one jitted program on stage k's mesh (floating values are summed over
        the microbatches, the update divides them by the count; any other value keeps the latest microbatch's).
        Keep one accumulator per task kind (the forward's and the backward's hold different values)."""
        if not acc or not part:
            return dict(part or acc or {})
        key = ("add", self.tasks.check_stage(k))
        if key not in self._compiled:
            def add(a, b):
                return {**a, **{n: (a[n] + b[n]) if n in a and is_inexact(b[n].dtype) else b[n] for n in b}}

            self._compiled[key] = jax.jit(add, compiler_options=self.compiler_options)
        return self._compiled[key](acc, part)

    def _update_fn(self, k, donate: bool = False):
        key = ("update", k, donate)
        if key in self._compiled:
            return self._compiled[key]
        info = self.tasks.updates[k]
        g, consts, M = self._g, self._prog.consts, self.microbatches
        acc_set = {t for task in self.tasks.tasks.values() for t in task.acc_out}
        ins = list(info.state) + list(info.acc) + list(info.recv)
        held = self.tasks.held[k]
        new_of = {}
        for o in info.targets:
            alias = g.op(o).params.get("alias_of")
            if alias is not None:
                new_of[alias] = g.op(o).inputs[0]
        results = [o for o in info.targets if g.op(o).params.get("alias_of") is None]
        shardings = self.op_shardings(k)
        state_sh = [self.layouts.sharding_of(k, t) for t in held]

        def run(*vals):
            env = {}
            for t, v in zip(ins, vals):
                # the update sees the mean over the microbatches of what the forward and backward made
                env[t] = v / M if t in acc_set and is_inexact(v.dtype) and M > 1 else v
            env = self._run_ops(info.ops, env, shardings=shardings)
            val = lambda t: env[t] if t in env else consts[t]  # noqa: E731
            # The new state goes back where the step found it (the plan's input sharding): left to XLA, a weight the
            # update made sharded came back sharded, and every later task program gathered it again per microbatch
            # (measured on dp2 tp2 pp2: 0-6 -> 7-15 all-gathers a task from the second step on, and a recompile).
            new_state = tuple(jax.lax.with_sharding_constraint(v, sh) if hasattr(v, "shape") else v
                              for v, sh in zip((val(new_of[t]) if t in new_of else val(t) for t in held), state_sh))
            return new_state, tuple(val(g.op(o).inputs[0]) for o in results)

        # The old state is donated where the runners ask: the new one is written over it, as an optimizer updates
        # in place (kept, a stage held its parameters and optimizer state twice while updating: its peak, 1.2x the
        # plan's, on gpt-350m's first stage). A value another stage's update reads is not (it reads the state as it
        # was before the step).
        shared = {self.tasks.var_of[name] for j in range(self.num_stages) for name, _ in self.update_inputs(j)}
        given = tuple(n for n, t in enumerate(ins) if t in info.state and t not in shared) if donate else ()
        fn = jax.jit(run, compiler_options=self.compiler_options, donate_argnums=given)
        self._compiled[key] = (fn, ins, results)
        return self._compiled[key]

    def update(self, k: int, state: dict, acc: dict, received: dict | None = None, *,
               donate: bool = False) -> tuple[dict, dict]:
        """Stage k's part of the update, once per step: ``(new_state, outputs)``. ``acc``: this stage's accumulated
        values (:meth:`accumulate` over the microbatches); ``received``: what :meth:`update_inputs` names, from the
        other stages. ``outputs``: the step's outputs this stage holds that are not new values of its inputs, by
        output index (the loss is output :attr:`loss_output`). ``donate=True`` (the runners'): ``state``'s arrays are
        donated (the new state is written into their buffers, and they are deleted), except those another stage's
        update reads."""
        info = self.tasks.updates[self.tasks.check_stage(k)]
        fn, ins, results = self._update_fn(k, bool(donate))
        received = received or {}
        vals = []
        for t in ins:
            name = self.tasks.names[t]
            if t in info.state:
                vals.append(state[name])
            elif t in info.acc:
                vals.append(acc[name])
            else:
                if name not in received:
                    raise ValueError(f"stage {k}'s update needs {name!r} from another stage.")
                vals.append(self.receive(k, name, received[name]))
        if self.probe is not None:
            self.probe(self.mesh(k).devices.flat, fn, vals)
        new_state, outs = fn(*vals)
        names = [self.tasks.names[t] for t in self.tasks.held[k]]
        index = {o: n for n, o in enumerate(self.tasks.outputs)}
        return dict(zip(names, new_state)), {index[o]: v for o, v in zip(results, outs)}

    def describe(self) -> list[dict]:
        """Per stage: layers, devices, operators per part, step inputs held, and what crosses each cut
        (:meth:`~autopar_lab.runtime.taskgraph.TaskGraph.describe` with each stage's devices)."""
        blocks = self.layouts.blocks
        return [row | {"devices": None if blocks[k] is None else [str(d) for d in blocks[k]]}
                for k, row in enumerate(self.tasks.describe())]


# model -> {microbatches: StepProgram}; weak, so a spec that goes away takes its programs with it
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step_program(model, mb_args, opt_argnums, microbatches: int):
    """``model``'s step captured on one microbatch's shapes, once per model and microbatch count: every plan of the
    model with that count cuts the same program (the capture reads no plan; its graph, functions and constants are
    only read), where each new stage layout traced the whole step again (a deep model's trace, seconds each)."""
    programs = _PROGRAMS.setdefault(model, {})
    if microbatches not in programs:
        programs[microbatches] = capture_program(model.step_fn, *mb_args, batch_argnums=model.batch_argnums,
                                                 param_argnums=model.param_argnums, opt_state_argnums=opt_argnums)
    return programs[microbatches]


def _cache_key(model, plan, devices, compiler_options):
    stages = tuple((st.layers, st.submesh, st.logical_mesh, st.devices, st.remat, id(st.intra)) for st in plan.stages)
    dev = None if devices is None else tuple(str(d) for d in jax.tree_util.tree_leaves(
        [list(d) if isinstance(d, (list, tuple)) else d for d in devices], is_leaf=lambda x: x is None))
    opts = tuple(sorted((compiler_options or {}).items()))
    # the schedule changes the tasks only through the W split and the chunks
    split = (plan.schedule == "zb-h1", int(getattr(plan, "virtual_stages", 1)))
    return (id(model), id(plan.graph), plan.layer_names, stages, int(plan.microbatches), dev, opts, split)


_CACHE: dict = {}
_CACHE_SIZE = 8


def split_stages(model, plan, *, devices=None, optimizer=None, compiler_options=None,
                 cache: bool = True) -> StagedModel:
    """Cut ``model``'s training step into ``plan``'s pipeline stages (see the module docstring).

    ``devices``: the local jax devices (stage k takes the k-th contiguous block), or one list per stage. A plan that
    needs more devices than that raises ValueError naming both numbers; a plan made for another model raises
    ValueError. ``compiler_options``: XLA options for every stage program (e.g. ``{"xla_backend_optimization_level":
    0}`` compiles several times faster on CPU, for tests). ``optimizer`` is accepted for compatibility and not needed:
    the step's own update runs. ``cache``: reuse the StagedModel (and so its compiled programs) of an earlier call with
    the same model, stage layout, shardings and devices (a GPipe and a 1F1B plan of one layout share one).
    """
    del optimizer
    key = _cache_key(model, plan, devices, compiler_options)
    if cache and key in _CACHE:
        staged, held = _CACHE[key]
        if held[0] is model and held[1] is plan.graph:
            return staged
    staged = StagedModel(model, plan, devices=devices, compiler_options=compiler_options)
    if cache:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (staged, (model, plan.graph))
    return staged
