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

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..graph.attention import attention_internals
from ..graph.capture import capture_program
from ..graph.opgraph import BACKWARD, BATCH, FORWARD, INPUT_PRIMITIVE, OPT_STATE, OUTPUT_PRIMITIVE, PARAM, UPDATE
from ..pricing.wgrad import input_grad_ops, upstream
from ..rematmode import is_selective, recomputes, remat_value
from ..sharding.spec import DEFAULT_AXIS_NAMES, ShardingSpec

__all__ = ["StagedModel", "TaskResult", "split_stages", "check_plan_matches", "stage_device_blocks", "move",
           "batch_of", "virtual_plan", "LOSS"]

LOSS = "loss"
_PSEUDO = frozenset([INPUT_PRIMITIVE, OUTPUT_PRIMITIVE])


# ----------------------------------------------------------------------------------------------------------------
# Plan checks and devices


def _arg_leaves(model) -> dict[str, tuple]:
    out = {}
    for i, arg in enumerate(model.abstract_args):
        for p, x in jax.tree_util.tree_flatten_with_path(arg)[0]:
            out[f"args[{i}]{jax.tree_util.keystr(p)}"] = (tuple(x.shape), str(x.dtype))
    return out


def check_plan_matches(model, plan) -> None:
    """Raise ValueError unless ``plan`` was made for ``model``: the same step inputs (path, shape, dtype) as the plan's
    graph."""
    graph = plan.graph
    want = {}
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive == INPUT_PRIMITIVE:
            t = graph.tensor(node.outputs[0])
            want[t.path] = (tuple(t.shape), str(t.dtype))
    have = _arg_leaves(model)
    if want == have:
        return
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    differ = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    what = (f"input {differ[0]} is {have[differ[0]][1]}{list(have[differ[0]][0])} in the model but "
            f"{want[differ[0]][1]}{list(want[differ[0]][0])} in the plan" if differ else
            f"the plan has input {missing[0]} that the model lacks" if missing else
            f"the model has input {extra[0]} that the plan lacks")
    raise ValueError(f"this plan was made for another model ({graph.name or 'unnamed graph'}, fingerprint "
                     f"{graph.fingerprint}) than {getattr(model, 'name', 'this model')}: {what}; plan this model "
                     "(al.auto_plan(model, cluster)) before executing it.")


def batch_of(model, args: Sequence) -> Any:
    """The batch among a step's arguments: the batch argument itself when there is one, else a tuple of them."""
    picked = tuple(args[i] for i in model.batch_argnums)
    return picked[0] if len(picked) == 1 else picked


def stage_device_blocks(plan, devices=None) -> list[list]:
    """The local jax devices of each stage: stage k gets the k-th contiguous block of ``devices`` (default
    ``jax.local_devices()``), as big as its submesh. ``devices`` may also be one list per stage (``None`` for a stage
    this process does not run), as a Ray actor that runs one stage passes it."""
    sizes = [st.submesh[0] * st.submesh[1] for st in plan.stages]
    if devices is not None and len(devices) == len(sizes) and all(d is None or isinstance(d, (list, tuple))
                                                                   for d in devices):
        blocks = []
        for k, (d, n) in enumerate(zip(devices, sizes)):
            if d is not None and len(d) != n:
                raise ValueError(f"stage {k} runs on a {plan.stages[k].submesh} submesh of {n} devices, but {len(d)} "
                                 "devices were given for it; give exactly that many.")
            blocks.append(None if d is None else list(d))
        return blocks
    devs = list(jax.local_devices() if devices is None else devices)
    need = sum(sizes)
    if need > len(devs):
        raise ValueError(f"the plan needs {need} devices ({' + '.join(map(str, sizes))} over {len(sizes)} stage(s)) "
                         f"but only {len(devs)} are available; plan for a smaller cluster, or get more devices (on "
                         f"CPU: JAX_NUM_CPU_DEVICES={need} before JAX starts).")
    out, o = [], 0
    for n in sizes:
        out.append(devs[o:o + n])
        o += n
    return out


def virtual_plan(plan):
    """``plan`` with one stage per virtual stage: an interleaved plan's chunks in order, chunk ``c`` on the submesh,
    logical mesh, remat and strategies of plan stage ``c % p``; any other plan as it is."""
    v, p = int(getattr(plan, "virtual_stages", 1)), len(plan.stages)
    if v <= 1:
        return plan
    stages = tuple(dataclasses.replace(plan.stages[c % p], layers=tuple(plan.stages[c % p].chunks[c // p]), chunks=())
                   for c in range(p * v))
    return dataclasses.replace(plan, stages=stages, virtual_stages=1)


def stage_mesh(block, shape) -> Mesh:
    """A JAX mesh of the devices ``block`` in the logical ``shape`` (axes named as the plan's specs name them)."""
    arr = np.empty(len(block), dtype=object)
    arr[:] = block
    arr = arr.reshape(tuple(int(s) for s in shape))
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is not None:
        return Mesh(arr, DEFAULT_AXIS_NAMES, axis_types=(axis_type.Auto,) * 2)
    return Mesh(arr, DEFAULT_AXIS_NAMES)


def _plan_input_specs(plan, k: int) -> dict[str, ShardingSpec]:
    """{graph input path: spec} of stage k's strategies; {} when the plan holds none for this graph's inputs."""
    from ..export import input_specs

    try:
        specs = input_specs(plan, k)
    except ValueError:
        return _specs_via_solve_graph(plan, k)
    out = {}
    for kind in (PARAM, OPT_STATE, BATCH):
        out.update(specs.get(kind, {}))
    return out


def _specs_via_solve_graph(plan, k: int) -> dict[str, ShardingSpec]:
    """A plan solved on a shallower copy of the model: each input takes the spec of the copy's operator that stands
    for it (:class:`~autopar_lab.pricing.OpMap`: identical layers get identical strategies)."""
    table, intra = plan.table, plan.stages[k].intra
    if table is None or intra is None:
        return {}
    out = {}
    for op in plan.graph.ops:
        node = plan.graph.op(op)
        if node.primitive != INPUT_PRIMITIVE:
            continue
        sop = table.op_map.solve_op(op)
        if sop is not None and sop in intra.strategies:
            out[plan.graph.tensor(node.outputs[0]).path] = intra.strategies[sop].out_specs[0]
    return out


# Measured on the 8-device CPU preset (gpt-tiny, 4 stages x 4 microbatches, steps interleaved): jax.device_put
# between stage meshes is 10-15% faster per step than a copy through numpy, which waits for each value and so
# stops stages from overlapping. AUTOPAR_VIA_HOST=1 restores the copy through host memory.
VIA_HOST = os.environ.get("AUTOPAR_VIA_HOST", "0") == "1"


def move(x, sharding: NamedSharding):
    """``x`` placed with ``sharding`` (``jax.device_put``; with ``AUTOPAR_VIA_HOST=1`` a copy between different
    CPU devices goes through host memory instead, which waits for the value but compiles nothing per shape)."""
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        if VIA_HOST and x.sharding.device_set != sharding.device_set and all(
                d.platform == "cpu" for d in sharding.device_set):
            return jax.device_put(np.asarray(x), sharding)
        return jax.device_put(x, sharding)
    return jax.device_put(np.asarray(x), sharding)


def _sharding(mesh: Mesh, spec: ShardingSpec | None, shape) -> NamedSharding:
    """The spec on the mesh, or replicated when it does not divide the shape (a microbatch is smaller than the
    batch the plan was priced on)."""
    mshape = tuple(mesh.devices.shape)
    if spec is None or not spec.is_valid(tuple(shape), mshape):
        return NamedSharding(mesh, PartitionSpec())
    return _named(mesh, spec.to_partition_spec(DEFAULT_AXIS_NAMES))


def _named(mesh: Mesh, pspec: PartitionSpec) -> NamedSharding:
    """``NamedSharding(mesh, pspec)`` spelled as a jitted program spells its outputs' shardings: without trailing
    unsplit dimensions (``P(None,)`` is ``P()``, ``P('x', None)`` is ``P('x')``). A jit keys its dispatch cache on the
    sharding object, and the two spellings are unequal: a state placed as ``P(None,)`` and updated to ``P()`` gave
    every task and update program a second cache entry in the second step (and a backward one in the first: its
    received gradients), each a miss looked up again through jax's slow path."""
    parts = list(pspec)
    while parts and parts[-1] is None:
        parts.pop()
    return NamedSharding(mesh, PartitionSpec(*parts))


def _batch_axis_spec(spec: ShardingSpec | None, rank: int) -> ShardingSpec | None:
    """The batch dimension's split of a batch leaf's spec, for a value of ``rank`` dims (the rest replicated)."""
    if spec is None or spec.rank == 0 or rank == 0:
        return None
    return ShardingSpec((spec.dims[0],) + ((),) * (rank - 1))


# ----------------------------------------------------------------------------------------------------------------
# The staged model


@dataclass
class TaskResult:
    """What one forward or backward task returns: ``exports`` (values tasks of other stages read, by name),
    ``stash`` (values this stage's backward of the same microbatch reads) and ``acc`` (this microbatch's part of the
    values the update reads: gradients, the loss)."""

    exports: dict
    stash: dict
    acc: dict


@dataclass
class _Task:
    ops: list
    state_in: list = None  # step inputs this stage holds
    recv: list = None  # values from other stages' tasks
    stash_in: list = None  # values from this stage's forward (a backward task only)
    batch_in: list = None  # batch leaves
    exports: set = None
    stash_out: set = None
    acc_out: set = None
    sources: set = None  # (stage, kind) of the tasks it receives from

    def __post_init__(self):
        for name in ("exports", "stash_out", "acc_out", "sources"):
            setattr(self, name, set())


def _inexact(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


class StagedModel:
    """A model's training step cut into the stages of a plan (see the module docstring for the contract)."""

    def __init__(self, model, plan, *, devices=None, optimizer=None, compiler_options=None):
        check_plan_matches(model, plan)
        del optimizer  # the optimizer is part of the step's own program: nothing to be told
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self.model = model
        self.schedule = plan.schedule
        P = len(plan.stages)
        self.plan = plan = virtual_plan(plan)  # an interleaved plan's chunks are the stages here
        self.num_stages = S = len(plan.stages)
        #: the plan stage (devices) each stage here runs on: itself, or for a chunk its plan stage
        self.device_stage = tuple(c % P for c in range(S))
        #: the task kinds per stage and microbatch, in the order one microbatch runs them
        self.kinds = ("fwd", "bwd", "wgrad") if self.schedule == "zb-h1" else ("fwd", "bwd")
        self.microbatches = M = int(plan.microbatches)
        physical = stage_device_blocks(dataclasses.replace(plan, stages=plan.stages[:P]), devices)
        self._blocks = [physical[d] for d in self.device_stage]
        self._meshes: dict = {}
        self._compiled: dict = {}
        self._init_cache: dict = {}
        self._split_inputs(model, M)
        prog = capture_program(model.step_fn, *self._mb_args, batch_argnums=model.batch_argnums,
                               param_argnums=model.param_argnums, opt_state_argnums=self._opt_argnums)
        self._check_same_program(prog.graph, plan.graph)
        self._prog = prog
        self._g = g = prog.graph
        self._n_inputs = len(g.inputs)
        self._kind = self._op_kinds(plan.graph)
        self._stage = self._op_stages(plan, S)
        self._place_inputs_and_tasks(S)
        self._plan_update(S)

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

    def _op_kinds(self, full) -> list[str]:
        kinds = []
        for node in full:
            if node.primitive == INPUT_PRIMITIVE:
                kinds.append("in")
            elif node.primitive == OUTPUT_PRIMITIVE:
                kinds.append("out")
            else:
                kinds.append({FORWARD: "fwd", BACKWARD: "bwd", UPDATE: "upd"}[node.role])
        return kinds

    def _op_stages(self, plan, S) -> list:
        """Each forward/backward operator's stage (None for the rest): its layer's, moved so values flow forward in
        the forward and backward in the backward."""
        g, kind = self._g, self._kind
        layer_stage = {}
        for k, st in enumerate(plan.stages):
            for i in range(st.layers[0], st.layers[1] + 1):
                layer_stage[plan.layer_names[i]] = k
        n = len(g)
        producer = {tid: t.producer for tid, t in g.tensors.items()}
        ts = [layer_stage.get(node.layer) if kind[node.id] not in ("in", "out") else None for node in plan.graph]
        consumers = g.consumers
        for i in range(n - 1, -1, -1):  # an operator without a layer joins its first consumer's stage...
            if ts[i] is None and kind[i] not in ("in", "out"):
                cs = [ts[c] for t in g.op(i).outputs for c in consumers.get(t, ()) if ts[c] is not None]
                ts[i] = min(cs) if cs else None
        for i in range(n):  # ... else its producers'
            if ts[i] is None and kind[i] not in ("in", "out"):
                ps = [ts[producer[t]] for t in g.op(i).inputs if producer.get(t) is not None
                      and ts[producer[t]] is not None]
                ts[i] = max(ps) if ps else 0
        stage: list = [None] * n
        for i in range(n):
            if kind[i] not in ("fwd", "bwd"):
                continue
            preds = [producer[t] for t in g.op(i).inputs if producer.get(t) is not None]
            if kind[i] == "fwd":
                bad = [p for p in preds if kind[p] in ("bwd", "upd")]
                stage[i] = max([ts[i]] + [stage[p] for p in preds if kind[p] == "fwd"])
            else:
                bad = [p for p in preds if kind[p] == "upd"]
                stage[i] = min([ts[i]] + [stage[p] for p in preds if kind[p] == "bwd"])
            if bad:
                raise ValueError(f"operator {g.op(i).describe()} ({kind[i]}ward) reads {g.op(bad[0]).describe()}; a "
                                 "pipeline runs the forward, then the backward, then the update, so this step cannot "
                                 "be cut into stages.")
        return stage

    def _place_inputs_and_tasks(self, S):
        g, kind, stage = self._g, self._kind, self._stage
        producer = {tid: t.producer for tid, t in g.tensors.items()}
        consumers = g.consumers
        self._batch_tids = [t for t in g.inputs if g.tensor(t).kind == BATCH]
        self._state_tids = [t for t in g.inputs if g.tensor(t).kind != BATCH]
        batch_set, state_set = set(self._batch_tids), set(self._state_tids)
        self._names = {t: g.tensor(t).path for t in g.inputs}
        self.owner: dict[int, int] = {}
        for t in self._state_tids:
            users = [stage[c] for c in consumers.get(t, ()) if kind[c] in ("fwd", "bwd")]
            if users:
                self.owner[t] = min(users)
        tasks = {(k, kd): _Task([i for i in range(len(g)) if kind[i] == kd and stage[i] == k])
                 for k in range(S) for kd in self.kinds}
        self._remat = [remat_value(st.remat) for st in self.plan.stages]
        # selective: only the attention internals are recomputed (the plan's graph numbers operators as this one)
        internals = attention_internals(self.plan.graph) if any(map(is_selective, self._remat)) else frozenset()
        for k in range(S):
            if recomputes(self._remat[k]):  # the backward recomputes what it reads of its stage's forward
                fwd_ops = set(tasks[(k, "fwd")].ops)
                if is_selective(self._remat[k]):
                    fwd_ops &= internals  # the rest it reads from the forward's stash, as without remat
                need, todo = set(), [t for i in tasks[(k, "bwd")].ops for t in g.op(i).inputs]
                while todo:
                    p = producer.get(todo.pop())
                    if p is not None and p in fwd_ops and p not in need:
                        need.add(p)
                        todo.extend(g.op(p).inputs)
                tasks[(k, "bwd")].ops = sorted(need | set(tasks[(k, "bwd")].ops))
        if "wgrad" in self.kinds:
            self._split_backward(tasks, S)
        home = {i: key for key, task in tasks.items() for i in task.ops if kind[i] == key[1]}
        for key, task in tasks.items():  # a recomputed forward operator also lives in its stage's backward
            for i in task.ops:
                home.setdefault(i, key)
        order = {kd: n for n, kd in enumerate(self.kinds)}
        consts = self._prog.consts
        for (k, kd), task in tasks.items():
            inside = {t for i in task.ops for t in g.op(i).outputs}
            reads = list(dict.fromkeys(t for i in task.ops for t in g.op(i).inputs))
            task.state_in, task.recv, task.stash_in, task.batch_in = [], [], [], []
            for t in reads:
                if t in inside or (t in consts and producer.get(t) is None):
                    continue
                if t in batch_set:
                    task.batch_in.append(t)
                elif t in state_set:
                    o = self.owner[t]
                    if o == k:
                        task.state_in.append(t)
                    else:  # a step input another stage owns: its forward passes it on
                        task.recv.append(t)
                        task.sources.add((o, "fwd"))
                        tasks[(o, "fwd")].exports.add(t)
                else:
                    p = producer[t]
                    # the latest earlier task of this stage that made it (a W task reads what its B recomputed)
                    mine = [e for e in self.kinds[:order[kd]] if p in tasks[(k, e)].ops]
                    src = (k, mine[-1]) if mine else home[p]
                    if src[0] == k and order[src[1]] < order[kd]:
                        task.stash_in.append(t)
                        tasks[src].stash_out.add(t)
                    else:
                        task.recv.append(t)
                        task.sources.add(src)
                        tasks[src].exports.add(t)
        for t in self._state_tids:  # an owner's forward that passes a step input on reads it from its state
            o = self.owner.get(t)
            if o is not None and t in tasks[(o, "fwd")].exports and t not in tasks[(o, "fwd")].state_in:
                tasks[(o, "fwd")].state_in.append(t)
        # What the update or the step's outputs read from the per-microbatch part is accumulated where it is made.
        for i in range(len(g)):
            if kind[i] not in ("upd", "out"):
                continue
            for t in g.op(i).inputs:
                p = producer.get(t)
                if t in batch_set:
                    raise ValueError(f"the step's update ({g.op(i).describe()}) reads the batch directly; a pipeline "
                                     "splits the batch into microbatches, so only the forward and backward may read "
                                     "it.")
                if p is not None and kind[p] in ("fwd", "bwd"):
                    tasks[home[p]].acc_out.add(t)
        for task in tasks.values():
            for t in task.exports | task.acc_out | task.stash_out:
                self._names.setdefault(t, f"%{t}")
            for t in task.recv:
                self._names.setdefault(t, f"%{t}")
        self._tasks = tasks
        self._var_of = {name: t for t, name in self._names.items()}

    def _split_backward(self, tasks, S):
        """ZB-H1: each stage's backward task keeps B (the input-gradient operators, what they need, what another
        stage's task reads, and a rematerialised forward) and gives the rest, W, to its "wgrad" task."""
        g, kind, stage = self._g, self._kind, self._stage
        consumers = g.consumers
        b_ops = input_grad_ops(self.plan.graph)  # the plan's graph: the same operators, with the plan's layers
        for k in range(S):
            ops = tasks[(k, "bwd")].ops
            inside = set(ops)
            seeds = [i for i in ops if i in b_ops or kind[i] != "bwd" or any(
                c not in inside and kind[c] in ("fwd", "bwd") and stage[c] != k
                for t in g.op(i).outputs for c in consumers.get(t, ()))]
            keep = upstream(g, seeds, inside.__contains__)
            tasks[(k, "bwd")].ops = [i for i in ops if i in keep]
            tasks[(k, "wgrad")].ops = [i for i in ops if i not in keep]

    def _plan_update(self, S):
        """Which update operators each stage runs (those its own outputs need), which step inputs it holds."""
        g, kind, stage = self._g, self._kind, self._stage
        producer = {tid: t.producer for tid, t in g.tensors.items()}
        outs = [i for i in range(len(g)) if kind[i] == "out"]
        self._outputs = outs
        u_only = [t for t in self._state_tids if t not in self.owner]
        holders: dict[int, set] = {t: {self.owner[t]} for t in self.owner}
        for t in u_only:
            holders[t] = set()
        alias_out = {g.op(o).params.get("alias_of"): o for o in outs if g.op(o).params.get("alias_of") is not None}
        targets: list[set] = [set() for _ in range(S)]
        for o in outs:
            x, alias = g.op(o).inputs[0], g.op(o).params.get("alias_of")
            if alias is not None and alias in self.owner:
                targets[self.owner[alias]].add(o)
            elif alias is not None:
                continue  # an update-only input: updated by every stage that holds it (below)
            else:
                p = producer.get(x)
                if p is not None and kind[p] in ("fwd", "bwd"):
                    targets[stage[p]].add(o)
                elif x in self.owner:
                    targets[self.owner[x]].add(o)
                else:
                    targets[S - 1].add(o)
        while True:  # update-only inputs are held by every stage whose update reads them, and updated there
            slices = [self._update_slice(targets[k], producer) for k in range(S)]
            changed = False
            for k in range(S):
                for i in slices[k]:
                    for t in g.op(i).inputs:
                        if t in holders and t not in self.owner and k not in holders[t]:
                            holders[t].add(k)
                            changed = True
                for o in targets[k]:
                    t = g.op(o).inputs[0]
                    if t in holders and t not in self.owner and k not in holders[t]:
                        holders[t].add(k)
                        changed = True
            for t in u_only:
                if not holders[t]:
                    holders[t].add(0)
                    changed = True
                o = alias_out.get(t)
                if o is not None:
                    for k in holders[t]:
                        if o not in targets[k]:
                            targets[k].add(o)
                            changed = True
            if not changed:
                break
        self._holders = holders
        self._held = [[t for t in self._state_tids if k in holders[t]] for k in range(S)]
        acc_stage = {t: k for (k, _), task in self._tasks.items() for t in task.acc_out}
        self._update: list[dict] = []
        self.update_crosses_stages: list[str] = []
        for k in range(S):
            ops = slices[k]
            inside = {t for i in ops for t in g.op(i).outputs}
            reads = list(dict.fromkeys([t for i in ops for t in g.op(i).inputs]
                                       + [g.op(o).inputs[0] for o in sorted(targets[k])]))
            own_state, own_acc, recv = [], [], []
            for t in reads:
                if t in inside or (t in self._prog.consts and producer.get(t) is None):
                    continue
                if t in holders:
                    (own_state if k in holders[t] else recv).append(t)
                elif t in acc_stage:
                    (own_acc if acc_stage[t] == k else recv).append(t)
                else:
                    raise ValueError(f"the update of stage {k} reads {self._names.get(t, t)}, which no stage makes.")
            sources = set()
            for t in recv:  # what another stage has: its task exports it (every microbatch) for this update
                self._names.setdefault(t, f"%{t}")
                if t in holders:
                    src = (min(holders[t]), "fwd")
                    if t not in self._tasks[src].state_in:
                        self._tasks[src].state_in.append(t)
                else:
                    src = next(key for key, task in self._tasks.items() if t in task.acc_out)
                self._tasks[src].exports.add(t)
                sources.add(src)
                self.update_crosses_stages.append(f"stage {k}'s update reads {self._names[t]} from stage {src[0]}")
            self._update.append({"ops": ops, "state": own_state, "acc": own_acc, "recv": recv,
                                 "targets": sorted(targets[k]), "sources": sorted(sources)})
        self._var_of = {name: t for t, name in self._names.items()}
        # The loss: the step's first scalar floating output that is not a new value of an input.
        self.loss_output = next((k for k, o in enumerate(outs) if g.op(o).params.get("alias_of") is None
                                 and g.tensor(g.op(o).inputs[0]).shape == ()
                                 and _inexact(g.tensor(g.op(o).inputs[0]).dtype)), None)

    def _update_slice(self, targets, producer) -> list[int]:
        g, kind = self._g, self._kind
        need, todo = set(), [g.op(o).inputs[0] for o in targets]
        while todo:
            p = producer.get(todo.pop())
            if p is not None and kind[p] == "upd" and p not in need:
                need.add(p)
                todo.extend(g.op(p).inputs)
        return sorted(need)

    # --- the contract -----------------------------------------------------------------------------------------
    def _check(self, k: int) -> int:
        if not isinstance(k, (int, np.integer)) or not 0 <= k < self.num_stages:
            raise ValueError(f"stage index {k!r} is out of range; this plan has stages 0..{self.num_stages - 1}.")
        return int(k)

    def _task(self, k, kind) -> _Task:
        if kind not in self.kinds:
            raise ValueError(f"a task is one of {', '.join(map(repr, self.kinds))} for this plan, got {kind!r}.")
        return self._tasks[(self._check(k), kind)]

    def stash_readers(self, k: int, kind: str) -> tuple[str, ...]:
        """The kinds of stage k's later tasks (same microbatch) that read the stash task ``(k, kind)`` keeps: it is
        held until the last of them has run."""
        mine = self._task(k, kind).stash_out
        return tuple(kd for kd in self.kinds if set(self._tasks[(k, kd)].stash_in) & mine)

    def sources(self, k: int, kind: str) -> list[tuple[int, str]]:
        """The tasks of the same microbatch that task ``(k, kind)`` receives values from (other stages only)."""
        return sorted(self._task(k, kind).sources)

    def inputs(self, k: int, kind: str) -> tuple[str, ...]:
        """Names of the values task ``(k, kind)`` receives from other stages' tasks."""
        return tuple(self._names[t] for t in self._task(k, kind).recv)

    def exports(self, k: int, kind: str) -> tuple[str, ...]:
        """Names of the values task ``(k, kind)`` produces for other stages' tasks."""
        return tuple(self._names[t] for t in sorted(self._task(k, kind).exports))

    def producer(self, name: str) -> tuple[int, str]:
        """The task ``(stage, kind)`` whose exports hold value ``name``."""
        t = self._var_of.get(name)
        for key, task in self._tasks.items():
            if t in task.exports:
                return key
        raise KeyError(f"no task exports a value named {name!r}.")

    def task_ops(self, k: int, kind: str) -> tuple[int, ...]:
        """The operator ids (of the plan's graph) task ``(k, kind)`` runs, in program order."""
        return tuple(self._task(k, kind).ops)

    def update_ops(self, k: int) -> tuple[int, ...]:
        return tuple(self._update[self._check(k)]["ops"])

    def stage_state_paths(self, k: int) -> tuple[str, ...]:
        """The step inputs (pytree paths, ``"args[0]['wte']"``) stage k holds."""
        return tuple(self._names[t] for t in self._held[self._check(k)])

    def stage_param_keys(self, k: int) -> tuple[str, ...]:
        """The parameter leaves stage k owns, as paths inside the parameter argument (``"['wte']"``)."""
        pre = f"args[{self.model.param_argnums[0]}]"
        return tuple(p[len(pre):] for p in self.stage_state_paths(k) if p.startswith(pre)
                     and self.owner.get(self._var_of[p]) == k)

    def value_dtype(self, name: str):
        return self._g.tensor(self._var_of[name]).dtype

    def mesh(self, k: int) -> Mesh:
        """Stage k's ``jax.sharding.Mesh`` (axes ("x", "y") = the plan's logical mesh) over its device block."""
        d = self.device_stage[self._check(k)]  # the chunks of one plan stage share its mesh (values stay put)
        if d not in self._meshes:
            block = self._blocks[k]
            if block is None:
                raise ValueError(f"this process was given no devices for stage {k}.")
            self._meshes[d] = stage_mesh(block, self.plan.stages[k].logical_mesh)
        return self._meshes[d]

    # --- shardings --------------------------------------------------------------------------------------------
    def _specs(self, k):
        key = ("specs", k)
        if key not in self._compiled:
            self._compiled[key] = _plan_input_specs(self.plan, k)
        return self._compiled[key]

    def value_sharding(self, k: int, name: str) -> NamedSharding:
        """Where value ``name`` lives on stage k's mesh: a step input as the plan shards it; another value split
        along the batch like the batch is, when it has the batch axis; else replicated."""
        return self._sharding_of(self._check(k), self._var_of[name])

    def _sharding_of(self, k, t):
        key = ("sh", k, t)
        if key not in self._compiled:
            info = self._g.tensor(t)
            shape = tuple(info.shape)
            specs = self._specs(k)
            if (t in self._names and info.producer is not None
                    and self._g.op(info.producer).primitive == INPUT_PRIMITIVE):
                spec = specs.get(info.path)
            else:
                spec = None
                batch_spec = specs.get(self._g.tensor(self._batch_tids[0]).path) if self._batch_tids else None
                if shape and shape[0] == self.microbatch_size:
                    spec = _batch_axis_spec(batch_spec, len(shape))
            self._compiled[key] = _sharding(self.mesh(k), spec, shape)
        return self._compiled[key]

    def receive(self, k: int, name: str, x):
        """Value ``name``, made by another stage's task (or a step input another stage holds), placed on stage k's
        devices: sharded on a mesh of stage k's shape, it keeps its layout (the program, pinned to the plan,
        reshards it inside, as the plan prices); else (a host array, another mesh shape) it takes
        :meth:`value_sharding`'s.

        Why: ``jax.device_put`` to other devices *and* another layout waits for the value to be computed (measured:
        a 35 ms producer, the call returned after 36.6 ms; the same layout returned after 0.6 ms), so the driver
        stalled on every such activation and gradient, and the stages could not overlap."""
        k = self._check(k)
        t = self._var_of[name]
        mesh = self.mesh(k)
        sh = getattr(x, "sharding", None)
        if (isinstance(x, jax.Array) and isinstance(sh, NamedSharding)
                and tuple(sh.mesh.devices.shape) == tuple(mesh.devices.shape)):
            return move(x, _named(mesh, sh.spec))
        return move(x, self._sharding_of(k, t))

    # --- init, batches, merge -----------------------------------------------------------------------------------
    def _full_init(self, seed):
        if seed not in self._init_cache:
            self._init_cache = {seed: self.model.init(seed)}
        return self._init_cache[seed]

    def _leaf_values(self, args) -> dict[int, Any]:
        """Tensor id -> value of every non-batch leaf of a step's arguments."""
        out, it = {}, iter(self._g.inputs)
        for i, a in enumerate(args):
            for x in jax.tree_util.tree_leaves(a):
                out[next(it)] = x
        return {t: v for t, v in out.items() if t not in set(self._batch_tids)}

    def init_state(self, k: int, seed: int = 0) -> dict:
        """The step inputs stage k holds, ``{path: array}``: its slice of ``model.init(seed)`` (same numbers), placed
        on its mesh by the plan's shardings."""
        values = self._leaf_values(self._full_init(seed))
        return self.place_state(k, {self._names[t]: values[t] for t in self._held[self._check(k)]})

    def place_state(self, k: int, state: dict) -> dict:
        """``state`` (``{path: array}``) put on stage k's mesh with the plan's shardings."""
        return {name: move(x, self._sharding_of(k, self._var_of[name])) for name, x in state.items()}

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
            missing = [self._names[t] for t in tids if self._names[t] not in flat]
            if missing:
                raise ValueError(f"step input {missing[0]} is in no stage's state.")
            out.append(jax.tree_util.tree_unflatten(d, [flat[self._names[t]] for t in tids]))
        return out

    def merge_params(self, parts: Sequence[dict]):
        """The parameter pytree (the first parameter argument) from every stage's state."""
        return self.merge_state(parts)[self.model.param_argnums[0]]

    # --- the stage programs -----------------------------------------------------------------------------------
    def ring_ops(self, k: int) -> dict[int, Any]:
        """Operator -> the function running it as ring attention, for stage k's ring-marked matmuls (context
        parallelism) usable on its mesh at the microbatch's shapes (:func:`~autopar_lab.runtime.ring.ring_binds`);
        the other operators run as the step does."""
        key = ("ring", self._check(k))
        if key not in self._compiled:
            from ..export import strategy_lookup
            from .ring import ring_binds

            intra = self.plan.stages[k].intra
            ops = [i for i, s in enumerate(self._stage) if s == k]
            self._compiled[key] = {} if intra is None else ring_binds(self._g, strategy_lookup(self.plan, intra),
                                                                      self.mesh(k), ops=ops)
        return self._compiled[key]

    def op_shardings(self, k: int) -> dict[int, tuple]:
        """Operator -> ``(output shardings, operand shardings or None)`` in stage k's programs: the plan's strategy
        of each operator stage k runs, on its mesh (operands: a contraction's, as the strategy reads them). A spec
        that does not divide this microbatch's shapes is None there (XLA chooses), like an operator without one.

        The programs pin every value to these, as the one-stage replay does: the plan priced these shardings, and
        XLA left to propagate from the inputs alone can pick others (a plan that stores a weight replicated and
        slices it at its matmul, free in the plan, left XLA replicating the batch and splitting the hidden axis:
        2.4-4.2x the priced collectives, and the compute repeated over the data-parallel axis)."""
        key = ("opsh", self._check(k))
        if key in self._compiled:
            return self._compiled[key]
        from ..export import strategy_lookup

        out: dict[int, tuple] = {}
        intra = self.plan.stages[k].intra
        if intra is not None:
            g, mesh = self._g, self.mesh(k)
            mshape = tuple(mesh.devices.shape)
            lookup = strategy_lookup(self.plan, intra)

            def named(spec, shape):
                shape = tuple(shape)
                if spec is None or spec.rank != len(shape) or not spec.is_valid(shape, mshape):
                    return None
                return _named(mesh, spec.to_partition_spec(DEFAULT_AXIS_NAMES))

            ops = {i for kd in self.kinds for i in self._tasks[(k, kd)].ops} | set(self._update[k]["ops"])
            for i in sorted(ops):
                s = lookup(i)
                if s is None:
                    continue
                node = g.op(i)
                outs = tuple(named(sp, shape) for sp, shape in zip(s.out_specs, node.out_shapes))
                operands = None
                if node.primitive in ("dot_general", "conv_general_dilated") and s.in_specs:
                    operands = tuple(named(sp, g.tensor(t).shape) for sp, t in zip(s.in_specs, node.inputs))
                if any(outs) or (operands and any(operands)):
                    out[i] = (outs, operands)
        self._compiled[key] = out
        return out

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
        task = self._tasks[(k, kind)]
        ins = list(task.state_in) + list(task.recv) + list(task.stash_in) + list(task.batch_in)
        exports, stash, acc = sorted(task.exports), sorted(task.stash_out), sorted(task.acc_out)
        consts = self._prog.consts
        binds, shardings = self.ring_ops(k), self.op_shardings(k)
        acc_sh = [self._acc_sharding(k, t) for t in acc]

        def run(*vals):
            # the last len(acc) arguments: the running sums of the earlier microbatches (zeros for the first), added
            # to here, as a real runtime accumulates gradients inside the backward (not as a program of its own)
            vals, acc_in = vals[:len(ins)], vals[len(ins):]
            env = self._run_ops(task.ops, dict(zip(ins, vals)), binds, shardings)
            pick = lambda ts: tuple(env[t] if t in env else consts[t] for t in ts)  # noqa: E731
            summed = tuple(jax.lax.with_sharding_constraint(a + b, sh) if _inexact(b.dtype) else b
                           for a, b, sh in zip(acc_in, pick(acc), acc_sh))
            return pick(exports), pick(stash), summed

        # the running sums are donated: XLA writes this microbatch's sums into their buffers, so a stage holds one
        # buffer per sum through the step, not the old and the new one side by side (a non-floating value is not a
        # sum: its output is this microbatch's value, no buffer could take it, and jax would warn of an unused one)
        donate = tuple(len(ins) + j for j, t in enumerate(acc) if _inexact(jnp.dtype(self._g.tensor(t).dtype)))
        fn = jax.jit(run, compiler_options=self.compiler_options, donate_argnums=donate)
        self._compiled[key] = (fn, ins, exports, stash, acc)
        return self._compiled[key]

    def _acc_sharding(self, k: int, t: int) -> NamedSharding:
        """Where stage k keeps the running sum of value t: the plan's sharding of it (its producer's strategy), else
        where :meth:`value_sharding` puts it. The task program pins its sum there and the zeros it starts from live
        there, so every microbatch calls one compiled program."""
        info = self._g.tensor(t)
        outs = self.op_shardings(k).get(info.producer, ((), None))[0] if info.producer is not None else ()
        node = self._g.op(info.producer) if outs else None
        sh = outs[list(node.outputs).index(t)] if node is not None and t in node.outputs else None
        return sh if sh is not None else self._sharding_of(k, t)

    def _acc_zeros(self, k: int, kind: str) -> tuple:
        """Fresh zeros to start task ``(k, kind)``'s sums from, made anew for each step's first microbatch: the task
        program takes them donated and writes its sums into them, so no zeros outlive the first task (cached, they
        were one more gradient-sized buffer per stage for the runner's lifetime)."""
        key = ("acc0", k, kind)
        if key not in self._compiled:
            acc = sorted(self._tasks[(k, kind)].acc_out)
            like = [(tuple(self._g.tensor(t).shape), jnp.dtype(self._g.tensor(t).dtype), self._acc_sharding(k, t))
                    for t in acc]
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
        task = self._task(k, kind)
        if not task.ops:  # nothing to run (a first stage's B under ZB-H1 may have no input gradient to make)
            return TaskResult({}, {}, dict(acc or {}))
        fn, ins, exports, stash_out, acc_out = self._task_fn(k, kind)
        vals = [state[self._names[t]] for t in task.state_in]
        for t in task.recv:
            name = self._names[t]
            if name not in received:
                raise ValueError(f"task ({k}, {kind!r}) needs {name!r} from task {self.producer(name)}; it received "
                                 f"{sorted(received)[:6]}.")
            vals.append(self.receive(k, name, received[name]))
        if task.stash_in:
            if stash is None:
                raise ValueError(f"task ({k}, {kind!r}) needs the stash of its stage's earlier tasks of the same "
                                 "microbatch.")
            vals += [stash[t] for t in task.stash_in]
        leaf_index = {t: j for j, t in enumerate(self._batch_tids)}
        vals += [move(batch_mb[leaf_index[t]], self._batch_sharding(k, t)) for t in task.batch_in]
        if acc:
            vals += [acc[self._names[t]] for t in acc_out]
        else:
            vals += list(self._acc_zeros(k, kind))
        e, s, a = fn(*vals)
        return TaskResult({self._names[t]: v for t, v in zip(exports, e)}, dict(zip(stash_out, s)),
                          {self._names[t]: v for t, v in zip(acc_out, a)})

    def _batch_sharding(self, k, t):
        key = ("batch_sh", k, t)
        if key not in self._compiled:
            info = self._g.tensor(t)
            self._compiled[key] = _sharding(self.mesh(k), self._specs(k).get(info.path), tuple(info.shape))
        return self._compiled[key]

    def accumulate(self, k: int, acc: dict | None, part: dict) -> dict:
        """``acc + part``, value by value, in one jitted program on stage k's mesh (floating values are summed over
        the microbatches, the update divides them by the count; any other value keeps the latest microbatch's).
        Keep one accumulator per task kind (the forward's and the backward's hold different values)."""
        if not acc or not part:
            return dict(part or acc or {})
        key = ("add", self._check(k))
        if key not in self._compiled:
            def add(a, b):
                return {**a, **{n: (a[n] + b[n]) if n in a and _inexact(b[n].dtype) else b[n] for n in b}}

            self._compiled[key] = jax.jit(add, compiler_options=self.compiler_options)
        return self._compiled[key](acc, part)

    def update_sources(self, k: int) -> list[tuple[int, str]]:
        """The tasks ``(stage, kind)`` whose exports of *every* microbatch stage k's update reads (what
        :meth:`update_inputs` names); a Ray stage actor receives them in ``finish_step``."""
        return list(self._update[self._check(k)]["sources"])

    def is_accumulated(self, name: str) -> bool:
        """Whether value ``name`` is summed over the microbatches before the update reads it (else: a step input,
        the same in every microbatch)."""
        t = self._var_of[name]
        return any(t in task.acc_out for task in self._tasks.values())

    def update_inputs(self, k: int) -> list[tuple[str, int]]:
        """``(name, stage)`` of what stage k's update reads from another stage (an accumulated value or a step
        input it does not hold; a step clipping by global norm reads every stage's gradients)."""
        info = self._update[self._check(k)]
        acc_stage = {t: s for (s, _), task in self._tasks.items() for t in task.acc_out}
        return [(self._names[t], min(self._holders[t]) if t in self._holders else acc_stage[t]) for t in info["recv"]]

    def _update_fn(self, k):
        key = ("update", k)
        if key in self._compiled:
            return self._compiled[key]
        info = self._update[k]
        g, consts, M = self._g, self._prog.consts, self.microbatches
        acc_set = {t for task in self._tasks.values() for t in task.acc_out}
        ins = list(info["state"]) + list(info["acc"]) + list(info["recv"])
        held = self._held[k]
        new_of = {}
        for o in info["targets"]:
            alias = g.op(o).params.get("alias_of")
            if alias is not None:
                new_of[alias] = g.op(o).inputs[0]
        results = [o for o in info["targets"] if g.op(o).params.get("alias_of") is None]
        shardings = self.op_shardings(k)
        state_sh = [self._sharding_of(k, t) for t in held]

        def run(*vals):
            env = {}
            for t, v in zip(ins, vals):
                # the update sees the mean over the microbatches of what the forward and backward made
                env[t] = v / M if t in acc_set and _inexact(v.dtype) and M > 1 else v
            env = self._run_ops(info["ops"], env, shardings=shardings)
            val = lambda t: env[t] if t in env else consts[t]  # noqa: E731
            # The new state goes back where the step found it (the plan's input sharding): left to XLA, a weight the
            # update made sharded came back sharded, and every later task program gathered it again per microbatch
            # (measured on dp2 tp2 pp2: 0-6 -> 7-15 all-gathers a task from the second step on, and a recompile).
            new_state = tuple(jax.lax.with_sharding_constraint(v, sh) if hasattr(v, "shape") else v
                              for v, sh in zip((val(new_of[t]) if t in new_of else val(t) for t in held), state_sh))
            return new_state, tuple(val(g.op(o).inputs[0]) for o in results)

        fn = jax.jit(run, compiler_options=self.compiler_options)
        self._compiled[key] = (fn, ins, results)
        return self._compiled[key]

    def update(self, k: int, state: dict, acc: dict, received: dict | None = None) -> tuple[dict, dict]:
        """Stage k's part of the update, once per step: ``(new_state, outputs)``. ``acc``: this stage's accumulated
        values (:meth:`accumulate` over the microbatches); ``received``: what :meth:`update_inputs` names, from the
        other stages. ``outputs``: the step's outputs this stage holds that are not new values of its inputs, by
        output index (the loss is output :attr:`loss_output`)."""
        info = self._update[self._check(k)]
        fn, ins, results = self._update_fn(k)
        received = received or {}
        vals = []
        for t in ins:
            name = self._names[t]
            if t in info["state"]:
                vals.append(state[name])
            elif t in info["acc"]:
                vals.append(acc[name])
            else:
                if name not in received:
                    raise ValueError(f"stage {k}'s update needs {name!r} from another stage.")
                vals.append(self.receive(k, name, received[name]))
        new_state, outs = fn(*vals)
        names = [self._names[t] for t in self._held[k]]
        index = {o: n for n, o in enumerate(self._outputs)}
        return dict(zip(names, new_state)), {index[o]: v for o, v in zip(results, outs)}

    def describe(self) -> list[dict]:
        """Per stage: layers, devices, operators per part, step inputs held, and what crosses each cut."""
        out = []
        for k, st in enumerate(self.plan.stages):
            out.append({"stage": k, "layers": [self.plan.layer_names[st.layers[0]],
                                               self.plan.layer_names[st.layers[1]]],
                        "num_ops": {kd: len(self._tasks[(k, kd)].ops) for kd in self.kinds}
                        | {"update": len(self._update[k]["ops"])},
                        "holds": len(self._held[k]), "remat": self._remat[k], "device_stage": self.device_stage[k],
                        "receives": {kd: list(self.inputs(k, kd)) for kd in self.kinds},
                        "sends": {kd: list(self.exports(k, kd)) for kd in self.kinds},
                        "devices": [str(d) for d in self._blocks[k]] if self._blocks[k] is not None else None})
        return out


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
