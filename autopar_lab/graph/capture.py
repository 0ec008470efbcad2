"""Capture the operator graph of a JAX training step: jaxpr in, :class:`OpGraph` out.

What happens to each kind of equation:

- Nested calls (``jit``/``pjit``, ``closed_call``, ``core_call``, ``custom_jvp_call``, ``custom_vjp_call``,
  ``checkpoint``/``remat``) are inlined: their operators join the graph with the caller's name scope in front.
- ``scan`` is unrolled, one copy of its body per iteration, so a scan over layers yields one layer per iteration
  (named ``"<scope>[i]"``, where ``i`` is the index into the scanned-over arrays, so a reverse scan's iteration ``i``
  is the same layer as the forward scan's). Each iteration reads its slice of a scanned-over array through a
  ``scan_slice`` operator, and stacked outputs are assembled by one ``scan_stack`` operator. Scans longer than
  ``max_unroll`` iterations stay one operator whose FLOPs are ``length`` x the body's.
- ``cond`` stays one operator; it is priced as its most expensive branch (the plan must fit whichever runs).
- ``while`` stays one operator; its trip count is unknown when tracing, so it is priced as one iteration of its body
  and a warning says so.
- An unknown primitive stays one operator marked ``opaque``: it costs its bytes and no FLOPs, and a warning names it.

Example:
    >>> import jax.numpy as jnp
    >>> g = trace(lambda w, x: (x @ w).sum(), jnp.zeros((4, 8)), jnp.zeros((2, 4)), batch_argnums=(1,))
    >>> g.op(2).primitive, g.op(2).in_shapes, g.op(2).flops
    ('dot_general', ((2, 4), (4, 8)), 128.0)
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp

from ..lazy import Lazy
from . import opcost
from .scopes import layer_depth, propagate_layers, scope_layer_and_role, scope_path_and_role  # noqa: F401
from .opgraph import (
    ACTIVATION,
    BACKWARD,
    BATCH,
    CONST,
    FORWARD,
    INPUT_PRIMITIVE,
    OPT_STATE,
    OUTPUT_PRIMITIVE,
    PARAM,
    STATE,
    UPDATE,
    OpGraph,
    OpNode,
    TensorInfo,
    dtype_size,
)

# Call-like primitives whose body is inlined (the capture and the replay inline the same), and the parameter that
# holds the body.
_INLINE_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
INLINED = frozenset(
    [
        "pjit",
        "jit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "checkpoint",
        "remat",
        "remat2",
        "custom_lin",
        "xla_call",
        "named_call",
    ]
)


class TraceError(ValueError):
    """The step function could not be turned into a graph; the message says what to change."""


class UnknownPrimitiveWarning(UserWarning):
    """A primitive the cost model does not know: kept as an opaque operator."""


class OpPlace(NamedTuple):
    """Where an operator sits in the model: its name scope and, inside an unrolled scan, the iteration's layer."""

    scope: str
    scan_layer: str | None


@dataclass
class _Builder:
    """Mutable state while walking the jaxpr; frozen into an OpGraph at the end."""

    max_unroll: int
    nodes: list = field(default_factory=list)
    tensors: dict = field(default_factory=dict)
    unknown: Counter = field(default_factory=Counter)
    notes: list = field(default_factory=list)
    # With keep_program: per operator the function that computes it, and the values of constant tensors.
    keep_program: bool = False
    fns: list = field(default_factory=list)
    const_values: dict = field(default_factory=dict)

    # Per tensor id (ids are dense, 0..n-1): its shape, dtype and bytes, read by every operator that touches it
    # (TensorInfo.nbytes costs a numpy reduction; an operator reads each of its tensors' sizes once).
    shapes: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)
    nbytes: list = field(default_factory=list)
    kinds: list = field(default_factory=list)
    # aval dtype object -> (its name, bytes per element): str() of a numpy dtype is slow and every tensor needs it.
    dtype_names: dict = field(default_factory=dict)

    def new_tensor(self, aval, kind: str, producer: int | None, path: str = "", value: Any = None) -> int:
        tid = len(self.shapes)
        shape = tuple(map(int, getattr(aval, "shape", ())))
        dt = getattr(aval, "dtype", "opaque")
        known = self.dtype_names.get(dt)
        if known is None:
            name = str(dt)
            known = self.dtype_names[dt] = (name, dtype_size(name))
        dtype, itemsize = known
        self.tensors[tid] = TensorInfo(tid, shape, dtype, kind, producer, path)
        self.shapes.append(shape)
        self.dtypes.append(dtype)
        self.nbytes.append(math.prod(shape) * itemsize)  # == TensorInfo.nbytes
        self.kinds.append(kind)
        if self.keep_program and kind == CONST:
            self.const_values[tid] = value
        return tid

    def set_input(self, tid: int, kind: str, producer: int, path: str) -> None:
        """Re-mark tensor ``tid`` as a step input of ``kind`` (the pytree ``path`` says which leaf)."""
        self.tensors[tid] = TensorInfo(tid, self.shapes[tid], self.dtypes[tid], kind, producer, path)
        self.kinds[tid] = kind

    def add_op(self, primitive: str, inputs: Sequence[int], out_avals: Sequence[Any], params: dict, where: OpPlace,
               flops: float | None = None, opaque: bool = False, out_kind: str = ACTIVATION,
               fn: Callable | None = None) -> list[int]:
        scope, scan_layer = where
        op_id = len(self.nodes)
        if self.keep_program:
            self.fns.append(fn)
        outs = [self.new_tensor(a, out_kind, op_id) for a in out_avals]
        shapes, dtypes, nbytes = self.shapes, self.dtypes, self.nbytes
        in_shapes = tuple([shapes[t] for t in inputs])
        out_shapes = tuple([shapes[t] for t in outs])
        if flops is None:
            flops = opcost.op_flops(primitive, in_shapes, out_shapes, params)
        read, written = opcost.op_bytes(primitive, [nbytes[t] for t in inputs], [nbytes[t] for t in outs])
        self.nodes.append(
            dict(
                id=op_id,
                primitive=primitive,
                name=f"{primitive}_{op_id}",
                inputs=tuple(inputs),
                outputs=tuple(outs),
                in_shapes=in_shapes,
                in_dtypes=tuple([dtypes[t] for t in inputs]),
                out_shapes=out_shapes,
                out_dtypes=tuple([dtypes[t] for t in outs]),
                flops=float(flops),
                bytes_read=read,
                bytes_written=written,
                scope=scope,
                scan_layer=scan_layer,
                params=params,
                opaque=opaque,
            )
        )
        return outs


def _join(outer: str, inner: str) -> str:
    return f"{outer}/{inner}" if outer and inner else (outer or inner)


def sub_jaxpr(params: dict):
    """(the body jaxpr, its constants) of a call-like equation's ``params`` (those of :data:`INLINED`), or (None,
    None) when it holds none."""
    for key in _INLINE_BODY_PARAMS:
        if key in params and params[key] is not None:
            body = params[key]
            if hasattr(body, "jaxpr") and hasattr(body, "consts"):
                return body.jaxpr, list(body.consts)
            if hasattr(body, "eqns"):
                return body, []
    return None, None


_PLAIN_TYPES = frozenset([int, float, bool, str, type(None)])


def _plain_params(params: dict) -> dict:
    """The primitive's parameters without sub-jaxprs (which the graph has inlined or summarised)."""
    out = {}
    for k, v in params.items():
        if type(v) in _PLAIN_TYPES or (type(v) is tuple and all(type(x) in _PLAIN_TYPES for x in v)):
            out[k] = v  # most parameters (axes, sizes, flags): no sub-jaxpr, no primitive; skip the probing below
            continue
        if hasattr(v, "eqns") or hasattr(v, "jaxpr") or callable(v):
            continue
        if isinstance(v, (tuple, list)) and any(hasattr(x, "eqns") or hasattr(x, "jaxpr") for x in v):
            continue
        if hasattr(v, "bind") and hasattr(v, "abstract_eval") and isinstance(getattr(v, "name", None), str):
            # A primitive as a parameter (select_and_scatter_add's select_prim, max pooling's backward): its name.
            # The object holds local closures that do not pickle, and the mesh pool's worker processes get the
            # graph pickled (auto_plan of Wide-ResNet-6.8B on 32 GPUs failed there).
            v = v.name
        out[k] = v
    return out


def _jaxpr_flops(jaxpr) -> float:
    """FLOPs of a sub-jaxpr, recursing through calls and scans (used to price cond/while/long scans)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        body, _ = sub_jaxpr(eqn.params)
        if name == "scan":
            total += eqn.params["length"] * _jaxpr_flops(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(_jaxpr_flops(b.jaxpr) for b in eqn.params["branches"])
        elif name == "while":
            total += _jaxpr_flops(eqn.params["body_jaxpr"].jaxpr) + _jaxpr_flops(eqn.params["cond_jaxpr"].jaxpr)
        elif body is not None:
            total += _jaxpr_flops(body)
        else:
            total += opcost.op_flops(
                name,
                [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars],
                [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars],
                eqn.params,
            )
    return total


def _walk(b: _Builder, jaxpr, env: dict, scope: str, scan_layer: str | None) -> None:
    """Add jaxpr's equations to the builder; env maps jaxpr Vars to tensor ids."""

    def read(v) -> int:
        return _read(b, env, v)

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        eqn_scope = _join(scope, str(eqn.source_info.name_stack))
        inputs = [read(v) for v in eqn.invars]
        body, consts = sub_jaxpr(eqn.params)
        if name in INLINED and body is not None:
            inner_env = {}
            for cv, c in zip(body.constvars, consts):
                inner_env[cv] = b.new_tensor(c, CONST, None, value=c)
            for iv, t in zip(body.invars, inputs):
                inner_env[iv] = t
            _walk(b, body, inner_env, eqn_scope, scan_layer)
            for ov, outer in zip(body.outvars, eqn.outvars):
                env[outer] = _read(b, inner_env, ov)
            continue
        if name == "scan" and eqn.params["length"] <= b.max_unroll:
            _unroll_scan(b, eqn, inputs, env, eqn_scope, scan_layer)
            continue
        out_avals = [v.aval for v in eqn.outvars]
        flops = None
        opaque = False
        if name == "scan":
            flops = eqn.params["length"] * _jaxpr_flops(eqn.params["jaxpr"].jaxpr)
            b.notes.append(f"scan of {eqn.params['length']} iterations kept as one operator "
                           f"(max_unroll={b.max_unroll})")
        elif name == "cond":
            flops = max(_jaxpr_flops(br.jaxpr) for br in eqn.params["branches"])
        elif name == "while":
            flops = _jaxpr_flops(eqn.params["body_jaxpr"].jaxpr) + _jaxpr_flops(eqn.params["cond_jaxpr"].jaxpr)
            b.notes.append("while loop kept as one operator and priced as ONE iteration (its trip count is unknown)")
        elif name not in opcost.KNOWN_PRIMITIVES:
            opaque = True
            b.unknown[name] += 1
        fn = None
        if b.keep_program:
            fn = functools.partial(_bind_eqn, eqn.primitive, eqn.primitive.get_bind_params(eqn.params), eqn.ctx)
        outs = b.add_op(name, inputs, out_avals, _plain_params(eqn.params), OpPlace(eqn_scope, scan_layer), flops,
                        opaque,
                        fn=fn)
        for v, t in zip(eqn.outvars, outs):
            env[v] = t


def _unroll_scan(b: _Builder, eqn, inputs: list[int], env: dict, scope: str, outer_layer: str | None) -> None:
    p = eqn.params
    body = p["jaxpr"]
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry, xs = inputs[:n_consts], inputs[n_consts : n_consts + n_carry], inputs[n_consts + n_carry :]
    path, _ = scope_path_and_role(scope)
    base = outer_layer or (path[-1] if path else "scan")  # the innermost scope names the scanned block
    ys_per_iter: dict[int, list[int]] = {}
    for step in range(length):
        idx = length - 1 - step if p["reverse"] else step
        layer = f"{base}[{idx}]"
        x_slices = []
        for k, x in enumerate(xs):
            # A slice of a stacked parameter is still a parameter (of this iteration's layer).
            aval = body.jaxpr.invars[n_consts + n_carry + k].aval
            (s,) = b.add_op("scan_slice", [x], [aval], {"axis": 0, "index": idx}, OpPlace(scope, layer),
                            out_kind=b.tensors[x].kind, fn=functools.partial(_scan_slice, idx))
            x_slices.append(s)
        inner_env = {cv: b.new_tensor(c, CONST, None, value=c) for cv, c in zip(body.jaxpr.constvars, body.consts)}
        for iv, t in zip(body.jaxpr.invars, consts + carry + x_slices):
            inner_env[iv] = t
        _walk(b, body.jaxpr, inner_env, scope, layer)
        outs = [_read(b, inner_env, v) for v in body.jaxpr.outvars]
        carry = outs[:n_carry]
        ys_per_iter[idx] = outs[n_carry:]
    results = list(carry)
    n_ys = len(body.jaxpr.outvars) - n_carry
    for k in range(n_ys):
        ys = [ys_per_iter[i][k] for i in range(length)]
        out_aval = eqn.outvars[n_carry + k].aval
        (stacked,) = b.add_op("scan_stack", ys, [out_aval], {"axis": 0}, OpPlace(scope, outer_layer),
                              fn=functools.partial(_scan_stack, out_aval))
        results.append(stacked)
    for v, t in zip(eqn.outvars, results):
        env[v] = t


def _read(b: _Builder, env: dict, v) -> int:
    """The tensor id of a jaxpr atom: a Var bound in env, or a literal (a fresh constant tensor)."""
    if isinstance(v, jex_core.Literal):
        return b.new_tensor(v.aval, CONST, None, value=v.val)
    return env[v]


# --- what each operator computes (kept with keep_program, for running the step cut into pieces) ---------------------
def _bind_eqn(primitive, params, ctx, *args) -> list:
    with ctx.manager:  # the equation's context (e.g. its abstract mesh), as eval_jaxpr binds it
        ans = primitive.bind(*args, **params)
    return list(ans) if primitive.multiple_results else [ans]


def _scan_slice(idx: int, x) -> list:
    return [jax.lax.index_in_dim(x, idx, axis=0, keepdims=False)]


def _scan_stack(aval, *ys) -> list:
    if not ys:
        return [jnp.zeros(aval.shape, aval.dtype)]
    return [jnp.stack(ys, axis=0).astype(aval.dtype)]


def _abstractify(args: tuple) -> tuple:
    """Replace arrays by ShapeDtypeStructs (nothing is allocated or copied), and check every leaf is array-like."""

    def one(path, x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
        if isinstance(x, (bool, int, float, complex)):
            return x
        raise TraceError(
            f"argument leaf {jax.tree_util.keystr(path) or '(top)'} is a {type(x).__name__}, not an array: pass "
            "arrays or jax.ShapeDtypeStruct leaves (close over static values instead)"
        )

    return tuple(jax.tree_util.tree_map_with_path(one, a) for a in args)


def _kind_of_arg(i: int, batch_argnums, param_argnums, opt_state_argnums) -> str:
    if i in batch_argnums:
        return BATCH
    if i in param_argnums:
        return PARAM
    if opt_state_argnums is not None and i in opt_state_argnums:
        return OPT_STATE
    return STATE


def _check_argnums(label: str, argnums: Sequence[int], n: int) -> tuple[int, ...]:
    out = tuple(a + n if a < 0 else a for a in argnums)
    bad = [a for a, o in zip(argnums, out) if not 0 <= o < n]
    if bad:
        raise TraceError(f"{label}={tuple(argnums)} names argument {bad[0]}, but the step function gets {n} arguments")
    return out


def trace(
    step_fn: Callable,
    *args,
    batch_argnums: Sequence[int] = (),
    param_argnums: Sequence[int] = (0,),
    opt_state_argnums: Sequence[int] | None = None,
    name: str = "",
    max_unroll: int = 4096,
    layers: str | None = None,
) -> OpGraph:
    """Capture the operator graph of ``step_fn(*args)``.

    ``args`` may be arrays or pytrees of ``jax.ShapeDtypeStruct`` (nothing is allocated). ``param_argnums`` and
    ``batch_argnums`` say which arguments hold parameters and batch data; ``opt_state_argnums`` which hold optimizer
    state (operators that read it are the update). Any other argument is plain state.

    The graph's layers (the units a pipeline may cut between) are found by the first rule that applies (see
    :mod:`autopar_lab.graph.layerfind`; ``graph.layer_rule`` says which): ``layers="backbone/block_*"`` names the
    level; else name scopes that differ only by an index (``layer_3``, ``h_3``, ``transformer_layer_3``); else a scan
    over layers; else parameter paths that differ only by an index (``blocks[3]``); else the top module's children;
    else Alpa's operator clustering.

    >>> import jax, jax.numpy as jnp
    >>> w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    >>> x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    >>> g = trace(lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w), w, x, batch_argnums=(1,))
    >>> g.flops_by("role")["backward"] == 2 * 64 * 1024 * 1024 + 64 * 1024 * 3
    True
    """
    graph, _b = _capture(step_fn, args, batch_argnums, param_argnums, opt_state_argnums, name, max_unroll, False)
    from .layerfind import find_layers
    from .relayer import relayer

    return find_layers(graph, layers=layers, cluster=lambda g: relayer(g, boundaries="cluster"))


@dataclass(frozen=True)
class StepProgram:
    """A step captured to be run in pieces: its graph (layers as capture found them) and, per operator, the function
    that computes it (``fns[op](*input values) -> [output values]``; None for ``parameter`` and ``output``
    operators), and the values of the constant tensors (``consts[tensor id]``)."""

    graph: OpGraph
    fns: tuple
    consts: dict

    def bind_params(self, op: int) -> dict:
        """The parameters operator ``op``'s primitive is bound with (a ``dot_general``'s dimension numbers,
        precision, preferred type), for running it another way (a ring-attention matmul); {} for a pseudo-op."""
        fn = self.fns[op]
        if isinstance(fn, functools.partial) and fn.func is _bind_eqn:
            return dict(fn.args[1])
        return {}


def capture_program(step_fn: Callable, *args, batch_argnums: Sequence[int] = (), param_argnums: Sequence[int] = (0,),
                    opt_state_argnums: Sequence[int] | None = None, max_unroll: int = 4096) -> StepProgram:
    """Capture ``step_fn(*args)`` like :func:`trace` (the same operators, in the same order, with the same ids), and
    keep what each operator computes, so that any subset of the operators can be run (see
    :mod:`autopar_lab.runtime.partition`). Layers are not searched for (the caller brings its own)."""
    graph, b = _capture(step_fn, args, batch_argnums, param_argnums, opt_state_argnums, "", max_unroll, True)
    return StepProgram(graph, tuple(b.fns), dict(b.const_values))


def _capture(step_fn, args, batch_argnums, param_argnums, opt_state_argnums, name, max_unroll,
             keep_program) -> tuple[OpGraph, _Builder]:
    t0 = time.perf_counter()
    if not callable(step_fn):
        raise TraceError(f"step_fn must be a function, got a {type(step_fn).__name__}")
    n = len(args)
    batch_argnums = _check_argnums("batch_argnums", batch_argnums, n)
    param_argnums = _check_argnums("param_argnums", param_argnums, n)
    if opt_state_argnums is not None:
        opt_state_argnums = _check_argnums("opt_state_argnums", opt_state_argnums, n)
    abstract = _abstractify(args)
    try:
        closed, out_shape = jax.make_jaxpr(step_fn, return_shape=True)(*abstract)
    except TraceError:
        raise
    except Exception as e:  # JAX raises many types here; the user needs one readable sentence, not the stack
        shapes = ", ".join(_describe_arg(a) for a in abstract)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TraceError(
            f"JAX could not trace {getattr(step_fn, '__name__', 'the step function')} with arguments ({shapes}): "
            f"{type(e).__name__}: {first}"
        ) from e

    b = _Builder(max_unroll=max_unroll, keep_program=keep_program)
    env: dict = {}
    # One `parameter` operator per input leaf, as HLO has, so every input gets a sharding decision of its own.
    leaves_with_paths = [jax.tree_util.tree_flatten_with_path(a)[0] for a in abstract]
    flat_invars = iter(closed.jaxpr.invars)
    input_tensors = []
    for i, leaves in enumerate(leaves_with_paths):
        kind = _kind_of_arg(i, batch_argnums, param_argnums, opt_state_argnums)
        for path, _leaf in leaves:
            var = next(flat_invars)
            op_id = len(b.nodes)
            (t,) = b.add_op(INPUT_PRIMITIVE, [], [var.aval], {"argnum": i, "path": jax.tree_util.keystr(path)},
                            OpPlace("", None), out_kind=kind)
            b.set_input(t, kind, op_id, f"args[{i}]{jax.tree_util.keystr(path)}")
            env[var] = t
            input_tensors.append(t)
    for cv, c in zip(closed.jaxpr.constvars, closed.consts):
        env[cv] = b.new_tensor(c, CONST, None, value=c)

    _walk(b, closed.jaxpr, env, "", None)

    # One `output` operator per output leaf; an updated parameter or optimizer state aliases its input (donation),
    # so a plan must give both the same sharding.
    out_leaves = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    aliases = _output_aliases(abstract, out_shape, input_tensors)
    output_tensors = []
    for k, ((path, _), var) in enumerate(zip(out_leaves, closed.jaxpr.outvars)):
        t = env[var] if var in env else b.new_tensor(var.aval, CONST, None, value=getattr(var, "val", None))
        b.add_op(OUTPUT_PRIMITIVE, [t], [],
                 {"index": k, "path": jax.tree_util.keystr(path), "alias_of": aliases.get(k)},
                 OpPlace("", None))
        output_tensors.append(t)

    warn = []
    for prim, count in b.unknown.items():
        msg = (f"primitive '{prim}' ({count} operator{'s' if count > 1 else ''}) is unknown to autopar-lab's cost "
               "model: kept as an opaque operator (bytes only, no FLOPs, replicated); register a rule for it to plan "
               "it")
        warn.append(msg)
        if not keep_program:
            warnings.warn(msg, UnknownPrimitiveWarning, stacklevel=3)
    warn.extend(dict.fromkeys(b.notes))

    nodes = _finish_nodes(b)
    graph = OpGraph(nodes, b.tensors, tuple(input_tensors), tuple(output_tensors), tuple(warn), name=name,
                    trace_s=time.perf_counter() - t0)
    return graph, b


def _describe_arg(a) -> str:
    leaves = jax.tree_util.tree_leaves(a)
    if len(leaves) == 1 and hasattr(leaves[0], "shape"):
        return f"{leaves[0].dtype}{list(leaves[0].shape)}"
    return f"pytree of {len(leaves)} arrays"


def _output_aliases(args, out_shape, input_tensors) -> dict[int, int]:
    """Output leaf index -> input tensor id, where a top-level output has the same structure as an argument."""
    aliases: dict[int, int] = {}
    if not isinstance(out_shape, (tuple, list)):
        return aliases
    in_offsets, off = [], 0
    for a in args:
        in_offsets.append(off)
        off += len(jax.tree_util.tree_leaves(a))
    out_off = 0
    for j, o in enumerate(out_shape):
        o_leaves, o_def = jax.tree_util.tree_flatten(o)
        if j < len(args):
            a_leaves, a_def = jax.tree_util.tree_flatten(args[j])
            same_tree = a_def == o_def  # type: ignore[operator]  # PyTreeDef compares by structure; its stub says not
            if same_tree and all(getattr(x, "shape", None) == getattr(y, "shape", None)
                                 for x, y in zip(a_leaves, o_leaves)):
                for k in range(len(o_leaves)):
                    aliases[out_off + k] = input_tensors[in_offsets[j] + k]
        out_off += len(o_leaves)
    return aliases


def _finish_nodes(b: _Builder) -> list[OpNode]:
    """Assign each operator its layer and role, then freeze.

    Role: the name scope says forward (``jvp``) or backward (``transpose``); an operator without either is an update
    if it depends on a backward operator (the optimizer), else forward (loss code outside ``grad``, integer masks).
    Layer: the user name scope at the depth where scopes first differ (see ``layer_depth``), or the scan
    iteration; operators without one take the layer of the
    operator they read from (an optimizer update joins its gradient's layer), and parameters the layer of their
    first reader.
    """
    raw = b.nodes
    n = len(raw)
    producer = {tid: t.producer for tid, t in b.tensors.items()}
    kinds = b.kinds
    roles: list[str] = [FORWARD] * n
    layers: list[str | None] = [None] * n
    after_backward = [False] * n
    by_scope: dict[str, tuple] = {}  # operators share scopes (a layer's hundreds): parse each once
    paths = []
    for node in raw:
        scope = node["scope"]
        hit = by_scope.get(scope)
        if hit is None:
            hit = by_scope[scope] = scope_path_and_role(scope)
        paths.append(hit)
    depth = layer_depth([p for p, _ in paths if p])
    for node in raw:
        i = node["id"]
        path, role = paths[i]
        layer = path[depth] if len(path) > depth else None
        # Optimizer arithmetic reads gradients (after backward) or optimizer state (its step count, moments).
        dep_back = False
        for t in node["inputs"]:
            p = producer[t]
            if (p is not None and (after_backward[p] or roles[p] == BACKWARD)) or kinds[t] == OPT_STATE:
                dep_back = True
                break
        after_backward[i] = dep_back
        if role is None:
            role = UPDATE if dep_back and node["primitive"] != INPUT_PRIMITIVE else FORWARD
        if node["primitive"] == OUTPUT_PRIMITIVE:
            role = UPDATE if dep_back else FORWARD
        roles[i] = role
        layers[i] = node["scan_layer"] or layer
        if node["primitive"] == "scan_stack" and not node["scan_layer"]:
            layers[i] = None  # joins the layer of what it stacks (below), not a pseudo-layer named after the scan
    alias_output = {node["params"]["alias_of"]: node["id"] for node in raw
                    if node["primitive"] == OUTPUT_PRIMITIVE and node["params"].get("alias_of") is not None}
    layers = propagate_layers([node["primitive"] for node in raw], [node["inputs"] for node in raw],
                              [node["outputs"] for node in raw], producer, alias_output, layers)
    out = []
    for node in raw:
        i = node["id"]
        input_kinds = tuple([kinds[t] for t in node["inputs"]])
        out.append(
            OpNode(
                id=i,
                primitive=node["primitive"],
                name=node["name"],
                inputs=node["inputs"],
                outputs=node["outputs"],
                in_shapes=node["in_shapes"],
                in_dtypes=node["in_dtypes"],
                out_shapes=node["out_shapes"],
                out_dtypes=node["out_dtypes"],
                input_kinds=input_kinds,
                flops=node["flops"],
                bytes_read=node["bytes_read"],
                bytes_written=node["bytes_written"],
                role=roles[i],
                scope=node["scope"],
                layer=layers[i],
                params=node["params"],
                opaque=node["opaque"],
                scan_layer=node["scan_layer"],
            )
        )
    return out




def deferred_trace(trace_fn: Callable[[], OpGraph], *, name: str = "", layers: Sequence[str] | None = None,
                   **known: Any) -> OpGraph:
    """An :class:`OpGraph` whose trace runs the first time something reads it (a :class:`~autopar_lab.lazy.Lazy`
    value).

    A deep zoo model's cost table needs only its layer names, layer map and cut bytes up front, which
    :mod:`autopar_lab.pricing.deepmap` derives from two shallow copies; the full graph (48 layers of GPT-39B, 128 of
    a 1T model: most of the tracing time) is wanted only by what reads operators (a plan's sharding table, export,
    overrides). ``trace_fn()`` returns the graph; ``name``, ``layers`` and the ``known`` attributes, when given, are
    answered without it. Once traced the object is that graph in every respect; it pickles and copies as a plain
    OpGraph. A trace that finds other layers than ``layers`` raises RuntimeError (the values derived from them
    would be wrong)."""
    def fill() -> dict[str, Any]:
        real = trace_fn()
        state = dict(real.__dict__)
        state["layers"] = list(real.layers)
        if layers is not None and list(layers) != state["layers"]:
            raise RuntimeError(f"the traced graph of {name or 'the model'} has other layers than the ones its cost "
                               "table was derived with")
        return state

    given: dict[str, Any] = {"name": name, **known}
    if layers is not None:
        given["layers"] = list(layers)  # the cached_property's slot: read without tracing
    return Lazy.of(OpGraph, fill, **given)
