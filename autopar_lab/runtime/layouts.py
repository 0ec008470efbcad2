"""Where a staged plan's values live: each stage's device block and mesh, the layout of every value on it, the
shardings its programs pin each operator to, and the moves between stages (:class:`StageLayouts`); the checks that
a plan fits the model and the devices given.

Why values keep their layout when they cross to a mesh of the same shape (:meth:`StageLayouts.receive`): a
``jax.device_put`` to other devices *and* another layout waits for the value to be computed, so the driver would
stall on every activation and gradient and the stages could not overlap.
"""

from __future__ import annotations

import os
from typing import Any, Sequence, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..graph.opgraph import BATCH, INPUT_PRIMITIVE, OPT_STATE, PARAM
from ..sharding.spec import DEFAULT_AXIS_NAMES, ShardingSpec

__all__ = ["check_plan_matches", "batch_of", "stage_device_blocks", "device_mesh", "plan_input_specs", "move",
           "sharding_on", "named_sharding", "batch_axis_spec", "VIA_HOST", "StageLayouts"]


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


def stage_device_blocks(plan, devices=None) -> list[list | None]:
    """The local jax devices of each stage: stage k gets the k-th contiguous block of ``devices`` (default
    ``jax.local_devices()``), as big as its submesh. ``devices`` may also be one list per stage (``None`` for a stage
    this process does not run), as a Ray actor that runs one stage passes it."""
    sizes = [st.submesh[0] * st.submesh[1] for st in plan.stages]
    if devices is not None and len(devices) == len(sizes) and all(d is None or isinstance(d, (list, tuple))
                                                                   for d in devices):
        blocks: list[list | None] = []
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
    out: list[list | None] = []
    o = 0
    for n in sizes:
        out.append(devs[o:o + n])
        o += n
    return out



def device_mesh(block, shape) -> Mesh:
    arr = np.empty(len(block), dtype=object)
    arr[:] = block
    arr = arr.reshape(tuple(int(s) for s in shape))
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is not None:
        return Mesh(arr, DEFAULT_AXIS_NAMES, axis_types=(axis_type.Auto,) * 2)
    return Mesh(arr, DEFAULT_AXIS_NAMES)


def plan_input_specs(plan, k: int) -> dict[str, ShardingSpec]:
    """{graph input path: spec} of stage k's strategies; {} when the plan holds none for this graph's inputs."""
    from ..export import input_specs

    try:
        specs = input_specs(plan, k)
    except ValueError:
        return _specs_via_solve_graph(plan, k)
    out: dict[str, ShardingSpec] = {}
    for kind in (PARAM, OPT_STATE, BATCH):
        out.update(cast(dict[str, ShardingSpec], specs.get(kind, {})))
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
                getattr(d, "platform", None) == "cpu" for d in sharding.device_set):
            return jax.device_put(np.asarray(x), sharding)
        return jax.device_put(x, sharding)
    return jax.device_put(np.asarray(x), sharding)


def sharding_on(mesh: Mesh, spec: ShardingSpec | None, shape) -> NamedSharding:
    """The spec on the mesh, or replicated when it does not divide the shape (a microbatch is smaller than the
    batch the plan was priced on)."""
    mshape = tuple(mesh.devices.shape)
    if spec is None or not spec.is_valid(tuple(shape), mshape):
        return NamedSharding(mesh, PartitionSpec())
    return named_sharding(mesh, spec.to_partition_spec(DEFAULT_AXIS_NAMES))


def named_sharding(mesh: Mesh, pspec: PartitionSpec) -> NamedSharding:
    """``NamedSharding(mesh, pspec)`` spelled as a jitted program spells its outputs' shardings: without trailing
    unsplit dimensions (``P(None,)`` is ``P()``, ``P('x', None)`` is ``P('x')``). A jit keys its dispatch cache on the
    sharding object, and the two spellings are unequal: a state placed as ``P(None,)`` and updated to ``P()`` gave
    every task and update program a second cache entry in the second step (and a backward one in the first: its
    received gradients), each a miss looked up again through jax's slow path."""
    parts = list(pspec)
    while parts and parts[-1] is None:
        parts.pop()
    return NamedSharding(mesh, PartitionSpec(*parts))


def batch_axis_spec(spec: ShardingSpec | None, rank: int) -> ShardingSpec | None:
    """The batch dimension's split of a batch leaf's spec, for a value of ``rank`` dims (the rest replicated)."""
    if spec is None or spec.rank == 0 or rank == 0:
        return None
    return ShardingSpec((spec.dims[0],) + ((),) * (rank - 1))


# operators whose operands are pinned as their strategy reads them (each runs on the shards it was priced on: a
# contraction's reshards are the plan's, not XLA's; a scatter updates its operand's shard, not a whole copy)
_OPERANDS_PINNED = ("dot_general", "conv_general_dilated", "scatter-add", "scatter")


class StageLayouts:
    """Each stage's mesh and the layout of every value on it, for the tasks ``tasks``
    (:class:`~autopar_lab.runtime.taskgraph.TaskGraph`) on the device blocks ``blocks`` (one per stage; None for a
    stage this process does not run), with microbatches of ``microbatch_size`` samples. Meshes and shardings are
    made on first use and kept."""

    def __init__(self, tasks, blocks: Sequence, microbatch_size: int):
        self.tasks = tasks
        self.plan = tasks.plan  # an interleaved plan's chunks as its stages
        self.graph = tasks.graph
        self.blocks = list(blocks)
        self.microbatch_size = microbatch_size
        self._meshes: dict = {}
        self._compiled: dict = {}

    def mesh(self, k: int) -> Mesh:
        """Stage k's ``jax.sharding.Mesh`` (axes ("x", "y") = the plan's logical mesh) over its device block."""
        # the chunks of one plan stage share its mesh (values stay put)
        d = self.tasks.device_stage[self.tasks.check_stage(k)]
        if d not in self._meshes:
            block = self.blocks[k]
            if block is None:
                raise ValueError(f"this process was given no devices for stage {k}.")
            self._meshes[d] = device_mesh(block, self.plan.stages[k].logical_mesh)
        return self._meshes[d]

    # --- shardings --------------------------------------------------------------------------------------------
    def _specs(self, k):
        key = ("specs", k)
        if key not in self._compiled:
            self._compiled[key] = plan_input_specs(self.plan, k)
        return self._compiled[key]

    def value_sharding(self, k: int, name: str) -> NamedSharding:
        """Where value ``name`` lives on stage k's mesh: a step input as the plan shards it; another value split
        along the batch like the batch is, when it has the batch axis; else replicated."""
        return self.sharding_of(self.tasks.check_stage(k), self.tasks.var_of[name])

    def sharding_of(self, k, t):
        key = ("sh", k, t)
        if key not in self._compiled:
            info = self.graph.tensor(t)
            shape = tuple(info.shape)
            specs = self._specs(k)
            if (t in self.tasks.names and info.producer is not None
                    and self.graph.op(info.producer).primitive == INPUT_PRIMITIVE):
                spec = specs.get(info.path)
            else:
                spec = None
                batch = self.tasks.batch_tids
                batch_spec = specs.get(self.graph.tensor(batch[0]).path) if batch else None
                if shape and shape[0] == self.microbatch_size:
                    spec = batch_axis_spec(batch_spec, len(shape))
            self._compiled[key] = sharding_on(self.mesh(k), spec, shape)
        return self._compiled[key]

    def receive(self, k: int, name: str, x):
        """Value ``name``, made by another stage's task (or a step input another stage holds), placed on stage k's
        devices: sharded on a mesh of stage k's shape, it keeps its layout (the program, pinned to the plan,
        reshards it inside, as the plan prices); else (a host array, another mesh shape) it takes
        :meth:`value_sharding`'s.

        Why: ``jax.device_put`` to other devices *and* another layout waits for the value to be computed (measured:
        a 35 ms producer, the call returned after 36.6 ms; the same layout returned after 0.6 ms), so the driver
        stalled on every such activation and gradient, and the stages could not overlap."""
        k = self.tasks.check_stage(k)
        t = self.tasks.var_of[name]
        mesh = self.mesh(k)
        sh = getattr(x, "sharding", None)
        if (isinstance(x, jax.Array) and isinstance(sh, NamedSharding)
                and tuple(sh.mesh.devices.shape) == tuple(mesh.devices.shape)):
            return move(x, named_sharding(mesh, sh.spec))
        return move(x, self.sharding_of(k, t))

    def ring_ops(self, k: int) -> dict[int, Any]:
        """Operator -> the function running it as ring attention, for stage k's ring-marked matmuls (context
        parallelism) usable on its mesh at the microbatch's shapes (:func:`~autopar_lab.runtime.ring.ring_binds`);
        the other operators run as the step does."""
        key = ("ring", self.tasks.check_stage(k))
        if key not in self._compiled:
            from ..export import strategy_lookup
            from .ring import ring_binds

            intra = self.plan.stages[k].intra
            ops = [i for i, s in enumerate(self.tasks.op_stage) if s == k]
            self._compiled[key] = {} if intra is None else ring_binds(self.graph, strategy_lookup(self.plan, intra),
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
        key = ("opsh", self.tasks.check_stage(k))
        if key in self._compiled:
            return self._compiled[key]
        from ..export import strategy_lookup

        out: dict[int, tuple] = {}
        intra = self.plan.stages[k].intra
        if intra is not None:
            g, mesh = self.graph, self.mesh(k)
            mshape = tuple(mesh.devices.shape)
            lookup = strategy_lookup(self.plan, intra)

            def named(spec, shape):
                shape = tuple(shape)
                if spec is None or spec.rank != len(shape) or not spec.is_valid(shape, mshape):
                    return None
                return named_sharding(mesh, spec.to_partition_spec(DEFAULT_AXIS_NAMES))

            ops = {i for kd in self.tasks.kinds for i in self.tasks.tasks[(k, kd)].ops} | set(self.tasks.updates[k].ops)
            for i in sorted(ops):
                s = lookup(i)
                if s is None:
                    continue
                node = g.op(i)
                if node.primitive == "broadcast_in_dim":
                    # a broadcast is never written on its own (graph.fusion: recomputed inside every kernel that
                    # reads it, as XLA does), so it takes its readers' layout: pinned to its own (often replicated)
                    # strategy, the zeros a gather's backward scatters into were made whole on every device, the
                    # full [batch, seq, vocab] logits in float32 where the plan priced a vocabulary shard
                    continue
                outs = tuple(named(sp, shape) for sp, shape in zip(s.out_specs, node.out_shapes))
                operands = None
                if node.primitive in _OPERANDS_PINNED and s.in_specs:
                    operands = tuple(named(sp, g.tensor(t).shape) for sp, t in zip(s.in_specs, node.inputs))
                if any(outs) or (operands and any(operands)):
                    out[i] = (outs, operands)
        self._compiled[key] = out
        return out

    def acc_sharding(self, k: int, t: int) -> NamedSharding:
        """Where stage k keeps the running sum of value t: the plan's sharding of it (its producer's strategy), else
        where :meth:`value_sharding` puts it. The task program pins its sum there and the zeros it starts from live
        there, so every microbatch calls one compiled program."""
        info = self.graph.tensor(t)
        outs = self.op_shardings(k).get(info.producer, ((), None))[0] if info.producer is not None else ()
        node = self.graph.op(info.producer) if outs else None
        sh = outs[list(node.outputs).index(t)] if node is not None and t in node.outputs else None
        return sh if sh is not None else self.sharding_of(k, t)

    def batch_sharding(self, k, t):
        key = ("batch_sh", k, t)
        if key not in self._compiled:
            info = self.graph.tensor(t)
            self._compiled[key] = sharding_on(self.mesh(k), self._specs(k).get(info.path), tuple(info.shape))
        return self._compiled[key]
