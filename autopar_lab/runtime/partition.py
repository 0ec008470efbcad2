"""Split a model's forward loss into the pipeline stages of a plan: Alpa's MPMD partition, on the jaxpr.

:func:`split_stages` traces ``model.loss_fn`` on one microbatch's shapes (``jax.make_jaxpr``), inlines nested calls
(``pjit``, ``closed_call``, ``remat``; custom-derivative calls stay whole so their rules survive), unrolls a scan over
layers when the plan names its iterations as layers (as :mod:`autopar_lab.graph.capture` does), and gives every
equation a layer:

- from its name scope, at the depth where scopes first differ (the capture's rule, same helpers); or
- in a plan whose layers came from ``al.pipeline_boundary`` markers (``stage_0``, ``stage_1``, ...), from how many
  marker calls ran before it (a marker starts the layer its output flows into).

An equation runs on the stage that holds its layer; one without a layer joins the stage of its first consumer (else
of its producer). An equation never runs before the stages that produce its inputs (it moves later if it must), so
values only flow forward. Each stage is then a pure function ``(params_k, inputs, batch) -> outputs``.

Parameters: a leaf is *owned* by the first stage that reads it. A later stage that reads it too (GPT's tied token
embedding: ``embed`` and ``head``) receives its value as an input named ``"params['wte']"`` and sends its gradient
back, so the owner's gradient is the sum over every use. Parameters of stage ``k`` are a flat dict
``{"['wte']": array, ...}`` keyed by pytree path (``jax.tree_util.keystr``); ``merge_params`` rebuilds the tree.

Loss scaling: a step's loss is the mean of its microbatch losses, so the last stage's backward seeds the loss
cotangent with ``1 / microbatches``; the gradients summed over microbatches are then those of the mean loss (for a
loss that is a mean over equal-sized microbatches, the full batch's gradient).

Backward without recomputation: :meth:`StagedModel.forward_stash` runs the forward as ``jax.vjp`` in one jitted
program and returns the pullback with the outputs (the pullback is a pytree holding the residuals, so it can leave
one compiled program and enter another); :meth:`StagedModel.backward` given that stash applies it. That is what the
plan assumes of a stage with ``remat=False`` (it holds its activations until the backward). A rematerialised stage
(``remat=True``), or a caller without a stash, gets the backward that recomputes the forward (``jax.vjp`` inside
the jitted backward), which keeps only the stage's inputs between the tasks.

The optimizer is ``model.optimizer`` when the ModelSpec has one, else the zoo's ``optax.adam(LEARNING_RATE)`` (which
every zoo step uses), else whatever ``optimizer=`` says. It is applied per stage, which is exact for element-wise
optimizers (SGD, Adam) and not for ones that look at every gradient at once (global-norm clipping).

Example (2 stages of gpt-tiny on 8 CPU devices):
    >>> import autopar_lab as al                                                    # doctest: +SKIP
    >>> model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)               # doctest: +SKIP
    >>> plan = al.megatron_plan(model, al.Cluster.preset("cpu"), dp=4, tp=1, pp=2, microbatches=2)  # doctest: +SKIP
    >>> staged = split_stages(model, plan)                                          # doctest: +SKIP
    >>> params = [staged.init_stage(k, 0)[0] for k in range(staged.num_stages)]     # doctest: +SKIP
    >>> mb = staged.split_batch(model.init(0)[2], 2)[0]                             # doctest: +SKIP
    >>> acts = staged.forward(0, params[0], {}, mb)                                 # doctest: +SKIP
    >>> staged.forward(1, params[1], acts, mb)["loss"]                              # doctest: +SKIP
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..graph.capture import _sub_jaxpr, layer_depth, scope_path_and_role
from ..graph.markers import MARKER_PRIMITIVE
from ..graph.opgraph import BATCH, INPUT_PRIMITIVE, OPT_STATE, PARAM
from ..sharding.spec import DEFAULT_AXIS_NAMES, ShardingSpec

__all__ = ["StagedModel", "split_stages", "check_plan_matches", "stage_device_blocks", "move"]

# Calls inlined into the caller (their equations may belong to different layers). custom_jvp/custom_vjp calls are
# NOT inlined: re-binding them whole keeps their differentiation rules (softmax, gelu, user rules).
_SPLIT_INLINE = frozenset(["pjit", "jit", "closed_call", "core_call", "named_call", "xla_call", "checkpoint",
                           "remat", "remat2"])
_MARKER_LAYER = re.compile(r"^stage_\d+$")
LOSS = "loss"


# ----------------------------------------------------------------------------------------------------------------
# The flat program: equations over integer value ids


@dataclass(frozen=True)
class _Eqn:
    fn: Callable  # (*values) -> list of values
    ins: tuple  # value ids
    outs: tuple  # value ids
    layer: str | None
    label: str


def _bind(primitive, params, ctx, *args):
    with ctx.manager:  # the equation's context (e.g. its abstract mesh), as eval_jaxpr binds it
        ans = primitive.bind(*args, **params)
    return list(ans) if primitive.multiple_results else [ans]


class _Program:
    """The forward loss as a list of equations on value ids, with each equation's layer."""

    def __init__(self, closed, layer_names: Sequence[str]):
        self.layer_names = tuple(layer_names)
        self.eqns: list[_Eqn] = []
        self.consts: dict[int, Any] = {}
        self.avals: dict[int, Any] = {}
        self._next = 0
        self._scopes: list[str] = []  # per equation, the joined name stack (for the layer rule)
        self._scan_layers: list[str | None] = []
        self._marker = _MARKER_LAYER.match(self.layer_names[0] or "") is not None and all(
            _MARKER_LAYER.match(n) for n in self.layer_names)
        env: dict = {}
        self.invars = [self._new(v.aval) for v in closed.jaxpr.invars]
        env.update(zip(closed.jaxpr.invars, self.invars))
        for cv, c in zip(closed.jaxpr.constvars, closed.consts):
            env[cv] = self._const(c, cv.aval)
        self._walk(closed.jaxpr, env, "", None)
        self.outvars = [self._read(env, v) for v in closed.jaxpr.outvars]
        self._assign_layers()

    # --- building -------------------------------------------------------------------------------------------
    def _new(self, aval) -> int:
        i = self._next
        self._next += 1
        self.avals[i] = aval
        return i

    def _const(self, value, aval) -> int:
        i = self._new(aval)
        self.consts[i] = value
        return i

    def _read(self, env, v) -> int:
        if isinstance(v, jex_core.Literal):
            return self._const(v.val, v.aval)
        return env[v]

    def _add(self, fn, ins, out_avals, scope, scan_layer, label) -> list[int]:
        outs = [self._new(a) for a in out_avals]
        self.eqns.append(_Eqn(fn, tuple(ins), tuple(outs), None, label))
        self._scopes.append(scope)
        self._scan_layers.append(scan_layer)
        return outs

    def _walk(self, jaxpr, env, scope, scan_layer):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            stack = str(eqn.source_info.name_stack)
            eqn_scope = f"{scope}/{stack}" if scope and stack else (scope or stack)
            ins = [self._read(env, v) for v in eqn.invars]
            body, consts = _sub_jaxpr(eqn.params)
            if name in _SPLIT_INLINE and body is not None:
                inner = {cv: self._const(c, cv.aval) for cv, c in zip(body.constvars, consts)}
                inner.update(zip(body.invars, ins))
                self._walk(body, inner, eqn_scope, scan_layer)
                for ov, outer in zip(body.outvars, eqn.outvars):
                    env[outer] = self._read(inner, ov)
                continue
            if name == "scan" and scan_layer is None and self._unroll(eqn, eqn_scope):
                self._unroll_scan(eqn, ins, env, eqn_scope)
                continue
            params = eqn.primitive.get_bind_params(eqn.params)
            fn = functools.partial(_bind, eqn.primitive, params, eqn.ctx)
            outs = self._add(fn, ins, [v.aval for v in eqn.outvars], eqn_scope, scan_layer, name)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o

    def _scan_base(self, scope) -> str:
        path, _ = scope_path_and_role(scope)
        return path[-1] if path else "scan"  # the capture's rule: the innermost scope names the scanned block

    def _unroll(self, eqn, scope) -> bool:
        """Unroll a scan only when the plan names its iterations as layers (else it stays one equation)."""
        return f"{self._scan_base(scope)}[0]" in self.layer_names

    def _unroll_scan(self, eqn, ins, env, scope):
        p = eqn.params
        body = p["jaxpr"]
        n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
        consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        base = self._scan_base(scope)
        ys: dict[int, list[int]] = {}
        for step in range(length):
            idx = length - 1 - step if p["reverse"] else step
            layer = f"{base}[{idx}]"
            slices = []
            for k, x in enumerate(xs):
                aval = body.jaxpr.invars[n_consts + n_carry + k].aval
                fn = functools.partial(_index, idx)
                slices += self._add(fn, [x], [aval], scope, layer, "scan_slice")
            inner = {cv: self._const(c, cv.aval) for cv, c in zip(body.jaxpr.constvars, body.consts)}
            inner.update(zip(body.jaxpr.invars, list(consts) + list(carry) + slices))
            self._walk(body.jaxpr, inner, scope, layer)
            outs = [self._read(inner, v) for v in body.jaxpr.outvars]
            carry, ys[idx] = outs[:n_carry], outs[n_carry:]
        results = list(carry)
        for k in range(len(body.jaxpr.outvars) - n_carry):
            aval = eqn.outvars[n_carry + k].aval
            fn = functools.partial(_stack, aval.dtype)
            results += self._add(fn, [ys[i][k] for i in range(length)], [aval], scope, None, "scan_stack")
        for v, r in zip(eqn.outvars, results):
            env[v] = r

    # --- layers ---------------------------------------------------------------------------------------------
    def _assign_layers(self):
        names = set(self.layer_names)
        if self._marker and any(e.label == MARKER_PRIMITIVE for e in self.eqns):
            layers, count, prev_marker = [], 0, None
            for e in self.eqns:
                if e.label == MARKER_PRIMITIVE:
                    if prev_marker is None:  # leaves of one marker call are adjacent: one boundary
                        count += 1
                    prev_marker = e
                else:
                    prev_marker = None
                layers.append(f"stage_{count}")
        else:
            paths = [scope_path_and_role(s)[0] for s in self._scopes]
            depth = layer_depth([p for p in paths if p]) if any(paths) else 0
            # The step graph may see one more or one less wrapper scope; take the depth that names plan layers.
            depths = [depth] + [d for d in range(max((len(p) for p in paths), default=0)) if d != depth]
            best, best_hits = depth, -1
            for d in depths:
                hits = sum(1 for p in paths if len(p) > d and p[d] in names)
                if hits > best_hits:
                    best, best_hits = d, hits
            layers = [sl or (p[best] if len(p) > best else None) for sl, p in zip(self._scan_layers, paths)]
        self.eqns = [_Eqn(e.fn, e.ins, e.outs, lay if lay in names else None, e.label)
                     for e, lay in zip(self.eqns, layers)]
        if not any(e.layer for e in self.eqns) and len(self.layer_names) > 1:
            raise ValueError(
                f"no operator of the model's loss falls in any of the plan's layers {list(self.layer_names)[:4]}...: "
                "executing a pipeline needs layers from jax.named_scope or al.pipeline_boundary markers (a plan "
                "whose layers came from operator clustering cannot be mapped back onto the loss function)")


def _index(idx, x):
    return [jax.lax.index_in_dim(x, idx, axis=0, keepdims=False)]


def _stack(dtype, *ys):
    return [jnp.stack(ys, axis=0).astype(dtype)]


# ----------------------------------------------------------------------------------------------------------------
# Plan checks and devices


def _leaf_paths(tree, prefix: str) -> list[tuple[str, tuple, str]]:
    return [(prefix + jax.tree_util.keystr(p), tuple(x.shape), str(x.dtype))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_plan_matches(model, plan) -> None:
    """Raise ValueError unless ``plan`` was made for ``model``: same parameter and batch leaves (path, shape, dtype)
    as the plan's graph inputs."""
    graph = plan.graph
    want = {}
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive != INPUT_PRIMITIVE:
            continue
        t = graph.tensor(node.outputs[0])
        if t.kind in (PARAM, BATCH):
            want[t.path] = (tuple(t.shape), str(t.dtype))
    have = {}
    for i in (0, 2):
        for path, shape, dtype in _leaf_paths(model.abstract_args[i], f"args[{i}]"):
            have[path] = (shape, dtype)
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


def _mesh(block, shape) -> Mesh:
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
    """A plan solved on a shallower copy of the model: each input of a layer takes the spec of the same-position
    input (same shape) of the copy's layer that priced it (identical layers get identical strategies)."""
    table, intra = plan.table, plan.stages[k].intra
    small = getattr(table, "solve_graph", None)
    layer_map = getattr(table, "_map", None)
    if small is None or layer_map is None or intra is None:
        return {}

    def inputs_by_layer(g):
        by: dict[tuple, list] = {}
        for op in g.ops:
            node = g.op(op)
            if node.primitive != INPUT_PRIMITIVE:
                continue
            t = g.tensor(node.outputs[0])
            by.setdefault((node.layer, t.kind), []).append((op, t))
        return by

    big, little = inputs_by_layer(plan.graph), inputs_by_layer(small)
    small_names = list(small.layers)
    out = {}
    for (layer, kind), items in big.items():
        if layer not in plan.layer_names:
            continue
        twin = little.get((small_names[layer_map[plan.layer_names.index(layer)]], kind), [])
        for (op, t), (sop, st) in zip(items, twin):
            if tuple(t.shape) == tuple(st.shape) and sop in intra.strategies:
                out[t.path] = intra.strategies[sop].out_specs[0]
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
    return NamedSharding(mesh, spec.to_partition_spec(DEFAULT_AXIS_NAMES))


# ----------------------------------------------------------------------------------------------------------------
# The staged model


def _zoo_optimizer(model):
    opt = getattr(model, "optimizer", None)
    if opt is not None:
        return opt
    from ..models import _FAMILIES
    from ..models.base import LEARNING_RATE

    if getattr(model, "family", None) in _FAMILIES:
        import optax

        return optax.adam(LEARNING_RATE)
    raise ValueError(f"model {getattr(model, 'name', model)!r} does not say which optimizer its step uses; pass "
                     "split_stages(..., optimizer=<an optax GradientTransformation>).")


def _batch_axis_spec(spec: ShardingSpec | None, rank: int) -> ShardingSpec | None:
    """The batch dimension's split of a batch leaf's spec, for a value of ``rank`` dims (the rest replicated)."""
    if spec is None or spec.rank == 0 or rank == 0:
        return None
    return ShardingSpec((spec.dims[0],) + ((),) * (rank - 1))


class StagedModel:
    """A model's forward loss split into the stages of a plan (see the module docstring for the contract)."""

    def __init__(self, model, plan, *, devices=None, optimizer=None, compiler_options=None):
        check_plan_matches(model, plan)
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self.model = model
        self.plan = plan
        self.num_stages = len(plan.stages)
        self.microbatches = int(plan.microbatches)
        self.optimizer = optimizer if optimizer is not None else _zoo_optimizer(model)
        self._blocks = stage_device_blocks(plan, devices)
        params_abs, batch_abs = model.abstract_args[0], model.abstract_args[2]
        self._params_def = jax.tree_util.tree_structure(params_abs)
        self._param_keys = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params_abs)[0]]
        self._batch_def = jax.tree_util.tree_structure(batch_abs)
        b_leaves = jax.tree_util.tree_leaves(batch_abs)
        self._batch_paths = ["args[2]" + jax.tree_util.keystr(p)
                             for p, _ in jax.tree_util.tree_flatten_with_path(batch_abs)[0]]
        self.batch_size = int(b_leaves[0].shape[0]) if b_leaves and b_leaves[0].shape else 1
        for x in b_leaves:
            if not x.shape or int(x.shape[0]) != self.batch_size:
                raise ValueError("every batch leaf needs the batch on its leading axis (same size) to be split into "
                                 f"microbatches; got shapes {[tuple(y.shape) for y in b_leaves]}.")
        if self.batch_size % self.microbatches:
            raise ValueError(f"the plan's {self.microbatches} microbatches do not divide the batch of "
                             f"{self.batch_size}; choose a divisor.")
        mb = self.batch_size // self.microbatches
        mb_abs = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((mb,) + tuple(x.shape[1:]), x.dtype),
                                        batch_abs)
        self.microbatch_size = mb
        closed = jax.make_jaxpr(model.loss_fn)(params_abs, mb_abs)
        if len(closed.jaxpr.outvars) != 1 or getattr(closed.jaxpr.outvars[0].aval, "shape", None) != ():
            raise ValueError("model.loss_fn must return one scalar loss to be split into pipeline stages.")
        self._prog = _Program(closed, plan.layer_names)
        self._partition()
        self._init_cache: dict = {}
        self._compiled: dict = {}
        self._meshes: dict = {}

    # --- partition ------------------------------------------------------------------------------------------
    def _partition(self):
        prog, S = self._prog, self.num_stages
        layer_stage = {}
        for k, st in enumerate(self.plan.stages):
            for i in range(st.layers[0], st.layers[1] + 1):
                layer_stage[self.plan.layer_names[i]] = k
        n_params = len(self._param_keys)
        self._param_vars = prog.invars[:n_params]
        self._batch_vars = prog.invars[n_params:]
        consumers: dict[int, list[int]] = {}
        for i, e in enumerate(prog.eqns):
            for v in e.ins:
                consumers.setdefault(v, []).append(i)
        loss_var = prog.outvars[0]
        # Unlayered equations join their first consumer's stage (walk backwards so consumers are known first).
        tentative: list[int | None] = [layer_stage.get(e.layer) if e.layer else None for e in prog.eqns]
        for i in range(len(prog.eqns) - 1, -1, -1):
            if tentative[i] is None:
                cands = [tentative[c] for o in prog.eqns[i].outs for c in consumers.get(o, ()) if tentative[c] is not None]
                if any(o == loss_var for o in prog.eqns[i].outs):
                    cands.append(S - 1)
                tentative[i] = min(cands) if cands else None
        # ... and never before the stages that feed them (values only flow forward).
        stage_of_var: dict[int, int] = {}
        eqn_stage = []
        for i, e in enumerate(prog.eqns):
            feed = [stage_of_var[v] for v in e.ins if v in stage_of_var]
            s = max([tentative[i] if tentative[i] is not None else 0] + feed)
            eqn_stage.append(s)
            for o in e.outs:
                stage_of_var[o] = s
        # Parameters: owned by their first user.
        self._param_owner = []
        for key, v in zip(self._param_keys, self._param_vars):
            users = [eqn_stage[c] for c in consumers.get(v, ())]
            if v == loss_var:
                users.append(S - 1)
            owner = min(users) if users else S - 1
            self._param_owner.append(owner)
            stage_of_var[v] = owner
        self._names: dict[int, str] = {v: f"params{key}" for key, v in zip(self._param_keys, self._param_vars)}
        for i, e in enumerate(prog.eqns):
            for j, o in enumerate(e.outs):
                self._names.setdefault(o, f"{e.layer or e.label}:{o}")
        batch_set = set(self._batch_vars)
        ins = [set() for _ in range(S)]
        outs = [set() for _ in range(S)]
        uses = [(eqn_stage[i], v) for i, e in enumerate(prog.eqns) for v in e.ins]
        uses.append((S - 1, loss_var))
        for s, v in uses:
            if v in prog.consts or v in batch_set or v not in stage_of_var:
                continue
            p = stage_of_var[v]
            if p != s:
                ins[s].add(v)
                outs[p].add(v)
        self._eqn_stage = eqn_stage
        self._stage_of_var = stage_of_var
        self._in_vars = [sorted(x) for x in ins]
        self._out_vars = [sorted(x) for x in outs]
        self._var_of = {self._names[v]: v for v in stage_of_var}
        self._stage_eqns = [[e for e, s in zip(prog.eqns, eqn_stage) if s == k] for k in range(S)]
        self._stage_params = [[i for i, o in enumerate(self._param_owner) if o == k] for k in range(S)]
        used_batch = [set() for _ in range(S)]
        for s, v in uses:
            if v in batch_set:
                used_batch[s].add(v)
        self._stage_batch = [[j for j, v in enumerate(self._batch_vars) if v in used_batch[k]] for k in range(S)]
        if loss_var in batch_set or loss_var in prog.consts:
            raise ValueError("the loss does not depend on the parameters; nothing to train.")

    # --- the contract ---------------------------------------------------------------------------------------
    def stage_inputs(self, k: int) -> tuple[str, ...]:
        """Names of the values stage k consumes that another stage produces (tied parameters included)."""
        return tuple(self._names[v] for v in self._in_vars[self._check(k)])

    def stage_outputs(self, k: int) -> tuple[str, ...]:
        """Names of the values stage k produces for later stages; the last stage: ``("loss",)``."""
        if self._check(k) == self.num_stages - 1:
            return (LOSS,)
        return tuple(self._names[v] for v in self._out_vars[k])

    def producer(self, name: str) -> int:
        """The stage that produces value ``name`` (``"loss"``: the last stage)."""
        if name == LOSS:
            return self.num_stages - 1
        if name not in self._var_of:
            raise KeyError(f"no value named {name!r}; stage outputs are {[self.stage_outputs(k) for k in range(self.num_stages)]}")
        return self._stage_of_var[self._var_of[name]]

    def consumers(self, name: str) -> tuple[int, ...]:
        """The stages that read value ``name`` from its producer (whose gradients the producer sums)."""
        v = self._var_of[name]
        return tuple(k for k in range(self.num_stages) if v in self._in_vars[k])

    def is_differentiable(self, name: str) -> bool:
        """Whether a cross-stage value carries a gradient back (integer values do not)."""
        v = self._var_of[name] if name != LOSS else self._prog.outvars[0]
        return jnp.issubdtype(self._prog.avals[v].dtype, jnp.inexact)

    def stage_param_keys(self, k: int) -> tuple[str, ...]:
        """The pytree paths (``jax.tree_util.keystr``) of the parameter leaves stage k owns."""
        return tuple(self._param_keys[i] for i in self._stage_params[self._check(k)])

    def mesh(self, k: int) -> Mesh:
        """Stage k's ``jax.sharding.Mesh`` (axes ("x", "y") = the plan's logical mesh) over its device block."""
        self._check(k)
        if k not in self._meshes:
            block = self._blocks[k]
            if block is None:
                raise ValueError(f"this process was given no devices for stage {k}.")
            self._meshes[k] = _mesh(block, self.plan.stages[k].logical_mesh)
        return self._meshes[k]

    def _check(self, k: int) -> int:
        if not isinstance(k, (int, np.integer)) or not 0 <= k < self.num_stages:
            raise ValueError(f"stage index {k!r} is out of range; this plan has stages 0..{self.num_stages - 1}.")
        return int(k)

    # --- shardings ------------------------------------------------------------------------------------------
    def _specs(self, k):
        key = ("specs", k)
        if key not in self._compiled:
            self._compiled[key] = _plan_input_specs(self.plan, k)
        return self._compiled[key]

    def param_shardings(self, k: int) -> dict[str, NamedSharding]:
        """{key: NamedSharding} of stage k's parameters, from the plan's strategies of their ``parameter`` ops."""
        specs, mesh = self._specs(k), self.mesh(k)
        leaves = jax.tree_util.tree_leaves(self.model.abstract_args[0])
        return {self._param_keys[i]: _sharding(mesh, specs.get("args[0]" + self._param_keys[i]), leaves[i].shape)
                for i in self._stage_params[k]}

    def _batch_shardings(self, k):
        key = ("batch_sh", k)
        if key not in self._compiled:
            self._compiled[key] = self._make_batch_shardings(k)
        return self._compiled[key]

    def _make_batch_shardings(self, k):
        specs, mesh = self._specs(k), self.mesh(k)
        leaves = jax.tree_util.tree_leaves(self.model.abstract_args[2])
        return [_sharding(mesh, specs.get(self._batch_paths[j]),
                          (self.microbatch_size,) + tuple(leaves[j].shape[1:])) for j in self._stage_batch[k]]

    def value_sharding(self, k: int, name: str) -> NamedSharding:
        """Where cross-stage value ``name`` (or its gradient) lives on stage k's mesh."""
        return self._value_sharding(self._check(k), self._var_of[name])

    def _value_sharding(self, k, v):
        key = ("value_sh", k, v)
        if key not in self._compiled:
            self._compiled[key] = self._make_value_sharding(k, v)
        return self._compiled[key]

    def _make_value_sharding(self, k, v):
        """A cross-stage value on stage k: split along the batch like the batch is, when it has the batch axis."""
        aval = self._prog.avals[v]
        shape = tuple(getattr(aval, "shape", ()))
        if v in self._param_vars:
            i = self._param_vars.index(v)
            return _sharding(self.mesh(k), self._specs(k).get("args[0]" + self._param_keys[i]), shape)
        spec = None
        if shape and shape[0] == self.microbatch_size and self._batch_paths:
            spec = _batch_axis_spec(self._specs(k).get(self._batch_paths[0]), len(shape))
        return _sharding(self.mesh(k), spec, shape)

    # --- init, batches, merge -------------------------------------------------------------------------------
    def _full_init(self, seed):
        if seed not in self._init_cache:
            self._init_cache = {seed: self.model.init(seed)}
        return self._init_cache[seed]

    def _slice_params(self, params, k) -> dict:
        leaves = jax.tree_util.tree_leaves(params)
        return {self._param_keys[i]: leaves[i] for i in self._stage_params[k]}

    def _slice_opt_state(self, opt_state, k):
        keys = set(self.stage_param_keys(k))

        def is_params(x):
            try:
                return jax.tree_util.tree_structure(x) == self._params_def
            except Exception:  # noqa: BLE001 - odd leaves: not a params tree
                return False

        def cut(x):
            if is_params(x):
                flat = jax.tree_util.tree_leaves(x)
                return {self._param_keys[i]: flat[i] for i in range(len(flat)) if self._param_keys[i] in keys}
            return x

        return jax.tree_util.tree_map(cut, opt_state, is_leaf=is_params)

    def init_stage(self, k: int, seed: int = 0):
        """Stage k's parameters and optimizer state: its slice of ``model.init(seed)`` (same numbers), placed on its
        mesh by the plan's shardings."""
        self._check(k)
        params, opt_state, _ = self._full_init(seed)
        params_k = self._slice_params(params, k)
        opt_k = self._slice_opt_state(opt_state, k)
        want = jax.tree_util.tree_structure(jax.eval_shape(self.optimizer.init, params_k))
        if jax.tree_util.tree_structure(opt_k) != want:
            opt_k = self.optimizer.init(params_k)  # an optimizer state that does not mirror the params tree
        return self.place_params(k, params_k), self._place_opt(k, opt_k)

    def place_params(self, k: int, params_k: dict) -> dict:
        """``params_k`` put on stage k's mesh with the plan's shardings."""
        sh = self.param_shardings(k)
        return {key: move(x, sh[key]) for key, x in params_k.items()}

    def _place_opt(self, k, opt_k):
        sh = self.param_shardings(k)
        mesh = self.mesh(k)

        def place(x):
            if isinstance(x, dict) and set(x) <= set(sh) and x:
                return {key: move(v, sh[key]) for key, v in x.items()}
            return move(x, NamedSharding(mesh, PartitionSpec()))

        return jax.tree_util.tree_map(place, opt_k, is_leaf=lambda x: isinstance(x, dict) and x and set(x) <= set(sh))

    def split_batch(self, batch, microbatches: int | None = None) -> list:
        """``microbatches`` equal microbatches along the leading (batch) axis of every batch leaf (host arrays).

        The stages were traced for the plan's microbatch count, so ``microbatches`` must be that count."""
        m = self.microbatches if microbatches is None else int(microbatches)
        if m != self.microbatches:
            raise ValueError(f"this split was traced for the plan's {self.microbatches} microbatches, not {m}; make "
                             "a plan with the count you want (plan.with_stages(microbatches=...)).")
        leaves, tree = jax.tree_util.tree_flatten(batch)
        if tree != self._batch_def:
            raise ValueError(f"the batch has structure {tree}, the model expects {self._batch_def}.")
        n = int(leaves[0].shape[0])
        if n != self.batch_size:
            raise ValueError(f"the batch has {n} samples but the model (and its plan) take {self.batch_size}.")
        size = n // m
        # Sliced on the host: each stage then copies just its microbatch to its own devices.
        leaves = [np.asarray(x) for x in leaves]
        return [jax.tree_util.tree_unflatten(tree, [x[j * size:(j + 1) * size] for x in leaves]) for j in range(m)]

    def merge_params(self, parts: Sequence[dict]):
        """The full parameter pytree from every stage's ``params_k`` (for checks and checkpoints)."""
        if len(parts) != self.num_stages:
            raise ValueError(f"merge_params needs one params dict per stage ({self.num_stages}), got {len(parts)}.")
        flat = {}
        for part in parts:
            flat.update(part)
        missing = [key for key in self._param_keys if key not in flat]
        if missing:
            raise ValueError(f"parameter {missing[0]} is in no stage's params.")
        return jax.tree_util.tree_unflatten(self._params_def, [flat[key] for key in self._param_keys])

    # --- the stage functions --------------------------------------------------------------------------------
    def _run(self, k, params_k: dict, inputs: dict, batch_leaves: Sequence) -> dict:
        """Stage k's forward as plain JAX (traced inside the jitted functions)."""
        prog = self._prog
        env = {}
        for key, x in params_k.items():
            env[self._param_vars[self._param_keys.index(key)]] = x
        for name, x in inputs.items():
            env[self._var_of[name]] = x
        for j, x in zip(self._stage_batch[k], batch_leaves):
            env[self._batch_vars[j]] = x

        def read(v):
            return prog.consts[v] if v in prog.consts else env[v]

        for e in self._stage_eqns[k]:
            for o, val in zip(e.outs, e.fn(*[read(v) for v in e.ins])):
                env[o] = val
        if k == self.num_stages - 1:
            return {LOSS: read(prog.outvars[0])}
        return {self._names[v]: read(v) for v in self._out_vars[k]}

    def _fns(self, k):
        key = ("fns", k)
        if key in self._compiled:
            return self._compiled[key]
        run = functools.partial(self._run, k)
        diff_names = [n for n in self.stage_inputs(k) if self.is_differentiable(n)]
        opt = self.optimizer
        last = k == self.num_stages - 1
        out_avals = {n: self._prog.avals[self._var_of[n] if n != LOSS else self._prog.outvars[0]]
                     for n in self.stage_outputs(k)}

        def linearized(params_k, inputs, batch_leaves):
            diff = {n: inputs[n] for n in diff_names}
            rest = {n: x for n, x in inputs.items() if n not in diff}
            return jax.vjp(lambda p, d: run(p, {**d, **rest}, batch_leaves), params_k, diff)

        def cotangent(d_outputs):
            cot = {}
            for n, o in out_avals.items():
                if not jnp.issubdtype(o.dtype, jnp.inexact):
                    cot[n] = np.zeros(o.shape, jax.dtypes.float0)
                else:
                    cot[n] = d_outputs[n].astype(o.dtype) if n in d_outputs else jnp.zeros(o.shape, o.dtype)
            return cot

        def backward(params_k, inputs, batch_leaves, d_outputs):
            _, vjp = linearized(params_k, inputs, batch_leaves)  # the forward again (rematerialisation)
            return vjp(cotangent(d_outputs))

        def apply_pullback(pullback, d_outputs, acc):
            # jax.vjp's pullback is a pytree (a Partial holding the residuals), so the forward program can return
            # it and this program apply it: the backward without the forward. Accumulating here saves a program.
            grads, d_inputs = pullback(cotangent(d_outputs))
            if acc is not None:
                grads = jax.tree_util.tree_map(jnp.add, acc, grads)
            return grads, d_inputs

        def update(params_k, opt_state_k, grads_k):
            import optax

            updates, opt_state_k = opt.update(grads_k, opt_state_k, params_k)
            return optax.apply_updates(params_k, updates), opt_state_k

        jit = functools.partial(jax.jit, compiler_options=self.compiler_options)
        fns = dict(forward=jit(run), backward=jit(backward), update=jit(update),
                   forward_stash=jit(linearized), apply_pullback=jit(apply_pullback),
                   add=jit(lambda a, b: jax.tree_util.tree_map(jnp.add, a, b)),
                   diff=tuple(diff_names), last=last, out_avals=out_avals)
        self._compiled[key] = fns
        return fns

    def _place_inputs(self, k, inputs: dict) -> dict:
        want = self.stage_inputs(k)
        missing = [n for n in want if n not in inputs]
        if missing:
            raise ValueError(f"stage {k} needs input {missing[0]!r} (from stage {self.producer(missing[0])}); "
                             f"its inputs are {list(want)}.")
        return {n: move(inputs[n], self._value_sharding(k, self._var_of[n])) for n in want}

    def _place_batch(self, k, batch_mb) -> tuple:
        leaves, tree = jax.tree_util.tree_flatten(batch_mb)
        if tree != self._batch_def:
            raise ValueError(f"the microbatch has structure {tree}, the model expects {self._batch_def}.")
        return tuple(move(leaves[j], s) for j, s in zip(self._stage_batch[k], self._batch_shardings(k)))

    def forward(self, k: int, params_k: dict, inputs: dict, batch_mb) -> dict:
        """Stage k's forward on one microbatch: ``{name: value}`` for every name in ``stage_outputs(k)``
        (the last stage: ``{"loss": scalar}``). Inputs may live on any device; they are moved to stage k's mesh."""
        fns = self._fns(self._check(k))
        return fns["forward"](params_k, self._place_inputs(k, inputs), self._place_batch(k, batch_mb))

    def forward_stash(self, k: int, params_k: dict, inputs: dict, batch_mb):
        """Stage k's forward keeping what its backward needs: ``(outputs, stash)``, outputs as :meth:`forward`'s.

        ``stash`` holds the forward's residuals (the pullback of ``jax.vjp``, a pytree of arrays on stage k's mesh);
        :meth:`backward` given it applies it and does not run the forward again. A stage the plan rematerialises
        (``remat=True``: it keeps only its inputs) returns ``None`` and its backward recomputes the forward. The
        stash lives until the backward, as the plan's activation memory assumes.
        """
        fns = self._fns(self._check(k))
        args = (params_k, self._place_inputs(k, inputs), self._place_batch(k, batch_mb))
        if self.plan.stages[k].remat:
            return fns["forward"](*args), None
        return fns["forward_stash"](*args)

    def backward(self, k: int, params_k: dict, inputs: dict, batch_mb, d_outputs: dict | None = None, *,
                 stash=None, acc: dict | None = None):
        """``(grads_k, d_inputs)`` of stage k on one microbatch. ``d_outputs[name]``: the gradient of the step's loss
        w.r.t. output ``name`` (summed over every stage that reads it; a missing one counts as zero). The last stage
        seeds ``d loss = 1 / microbatches`` (a step's loss is the mean of its microbatch losses) unless
        ``d_outputs["loss"]`` says otherwise. ``d_inputs`` holds the differentiable inputs (integer values carry no
        gradient).

        With ``stash`` (from :meth:`forward_stash` of the same microbatch) the saved residuals are used and
        ``inputs`` / ``batch_mb`` are not read; without it the forward is recomputed (``jax.vjp`` in one jitted
        program) from ``inputs`` and ``batch_mb``. ``acc``: gradients to add ``grads_k`` to (returned summed, as
        :meth:`add_grads` would, in the same program when a stash is given)."""
        fns = self._fns(self._check(k))
        d_outputs = dict(d_outputs or {})
        if fns["last"] and LOSS not in d_outputs:
            d_outputs[LOSS] = np.float32(1.0 / self.microbatches)
        mesh = self.mesh(k)
        placed = {}
        for n in self.stage_outputs(k):
            if n in d_outputs and self.is_differentiable(n):
                v = self._var_of[n] if n != LOSS else self._prog.outvars[0]
                sh = self._value_sharding(k, v) if n != LOSS else NamedSharding(mesh, PartitionSpec())
                placed[n] = move(d_outputs[n], sh)
        if stash is not None:
            return fns["apply_pullback"](stash, placed, acc)
        grads, d_inputs = fns["backward"](params_k, self._place_inputs(k, inputs), self._place_batch(k, batch_mb),
                                          placed)
        if acc is not None:
            grads = fns["add"](acc, grads)
        return grads, d_inputs

    def update(self, k: int, params_k: dict, opt_state_k, grads_k: dict):
        """``(params_k, opt_state_k)`` after the model's optimizer step on stage k's parameters."""
        return self._fns(self._check(k))["update"](params_k, opt_state_k, grads_k)

    def add_grads(self, k: int, a: dict, b: dict) -> dict:
        """``a + b`` leaf by leaf, in one jitted program on stage k's mesh (gradient accumulation)."""
        return self._fns(self._check(k))["add"](a, b)

    def describe(self) -> list[dict]:
        """Per stage: layers, devices, equations, parameters owned, inputs and outputs (what crosses each cut)."""
        out = []
        for k, st in enumerate(self.plan.stages):
            out.append({"stage": k, "layers": [self.plan.layer_names[st.layers[0]], self.plan.layer_names[st.layers[1]]],
                        "num_eqns": len(self._stage_eqns[k]), "params": len(self._stage_params[k]),
                        "inputs": list(self.stage_inputs(k)), "outputs": list(self.stage_outputs(k)),
                        "devices": [str(d) for d in self._blocks[k]] if self._blocks[k] is not None else None})
        return out


def _cache_key(model, plan, devices, optimizer, compiler_options):
    stages = tuple((st.layers, st.submesh, st.logical_mesh, st.devices, st.remat, id(st.intra)) for st in plan.stages)
    dev = None if devices is None else tuple(str(d) for d in jax.tree_util.tree_leaves(
        [list(d) if isinstance(d, (list, tuple)) else d for d in devices], is_leaf=lambda x: x is None))
    opts = tuple(sorted((compiler_options or {}).items()))
    return (id(model), id(plan.graph), plan.layer_names, stages, int(plan.microbatches), dev, id(optimizer), opts)


_CACHE: dict = {}
_CACHE_SIZE = 8


def split_stages(model, plan, *, devices=None, optimizer=None, compiler_options=None,
                 cache: bool = True) -> StagedModel:
    """Split ``model``'s forward loss into ``plan``'s pipeline stages (see the module docstring).

    ``devices``: the local jax devices (stage k takes the k-th contiguous block), or one list per stage. A plan that
    needs more devices than that raises ValueError naming both numbers; a plan made for another model raises
    ValueError. ``compiler_options``: XLA options for every stage program (e.g. ``{"xla_backend_optimization_level":
    0}`` compiles several times faster on CPU, for tests). ``cache``: reuse the StagedModel (and so its compiled programs) of an earlier call with the same
    model, stage layout, shardings and devices (a GPipe and a 1F1B plan of one layout share one).
    """
    key = _cache_key(model, plan, devices, optimizer, compiler_options)
    if cache and key in _CACHE:
        staged, held = _CACHE[key]
        if held[0] is model and held[1] is plan.graph:
            return staged
    staged = StagedModel(model, plan, devices=devices, optimizer=optimizer, compiler_options=compiler_options)
    if cache:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (staged, (model, plan.graph))
    return staged
