"""Replaying the step function with a plan's shardings, walking its jaxpr as the capture does (see
:mod:`autopar_lab.validate`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ..graph.capture import _INLINE, _sub_jaxpr  # the SAME inlining decisions as the capture, by construction
from ..graph.opgraph import INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, OpGraph
from ..sharding.spec import DEFAULT_AXIS_NAMES, ShardingSpec


class ReplayError(RuntimeError):
    """The replayed jaxpr walk and the captured graph disagree (different op order, primitive or shape)."""


# ----------------------------------------------------------------------------------------------------------------
# Replaying the step with sharding constraints


def _as_spec(s: Any) -> ShardingSpec | None:
    if s is None or isinstance(s, ShardingSpec):
        return s
    if isinstance(s, PartitionSpec):
        return ShardingSpec.from_partition_spec(s)
    if isinstance(s, str):
        return ShardingSpec.parse(s)
    return ShardingSpec(tuple(s))


@dataclass(frozen=True, kw_only=True)
class ReplayOptions:
    """What a replay applies besides each operator's output specs (see :func:`replay_with_shardings`): the mesh's
    ``axis_names``, the specs of the values the step returns (``output_specs``), the specs a contraction's operands
    are constrained to (``operand_specs``), operators run another way (``binds``) and the graph's ``max_unroll``.
    Immutable: change one with :func:`dataclasses.replace`."""

    axis_names: Sequence[str] = DEFAULT_AXIS_NAMES
    output_specs: Mapping[int, Any] | None = None
    operand_specs: Mapping[int, Sequence[Any]] | None = None
    binds: Mapping[int, Callable] | None = None
    max_unroll: int | None = None


class Replay:
    """The step function re-executed equation by equation with the plan's sharding constraints.

    Call it like the step function (same pytrees in, same pytree out). Attributes:

    - ``in_shardings``: per argument, a pytree of ``NamedSharding`` (from the ``parameter`` operators' specs;
      an argument leaf without a spec is replicated);
    - ``out_shardings``: the output pytree of ``NamedSharding`` or ``None`` (let XLA choose) per leaf;
    - ``ops_walked``: how many operator ids the last trace counted (equals ``len(graph)`` on success);
    - ``constrained``: how many values the last trace pinned with ``with_sharding_constraint``.

    ``jit()`` gives ``jax.jit(self, in_shardings=..., out_shardings=...)``.
    """

    def __init__(self, graph: OpGraph, step_fn: Callable, abstract_args: Sequence[Any],
                 out_specs: Mapping[int, Sequence[Any]], mesh: jax.sharding.Mesh,
                 options: ReplayOptions = ReplayOptions()):
        axis_names, output_specs, max_unroll = options.axis_names, options.output_specs, options.max_unroll
        operand_specs, binds = options.operand_specs, options.binds
        self.graph = graph
        # Per operator (op id): a function run in place of its primitive (a ring-attention matmul's ring).
        self.binds = {int(k): v for k, v in (binds or {}).items()}
        # Per contraction (op id): the specs its operands are constrained to right before it.
        self.operand_specs = {int(k): tuple(None if x is None else _as_spec(x) for x in v)
                              for k, v in (operand_specs or {}).items()}
        self.step_fn = step_fn
        self.mesh = mesh
        self.axis_names = tuple(axis_names)
        missing = [a for a in self.axis_names if a not in mesh.axis_names]
        if missing:
            raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack {missing}: pass axis_names= matching the mesh")
        self.max_unroll = max_unroll
        self.out_specs = {int(k): tuple(_as_spec(s) for s in v) for k, v in (out_specs or {}).items()}
        n = len(graph)
        bad = [k for k in self.out_specs if not 0 <= k < n]
        if bad:
            raise ValueError(f"out_specs names operator {bad[0]}, but the graph has operators 0..{n - 1}")
        for k, specs in self.out_specs.items():
            node = graph.op(k)
            if node.primitive != OUTPUT_PRIMITIVE and len(specs) != len(node.out_shapes):
                raise ValueError(f"out_specs[{k}] has {len(specs)} specs, but {node.describe()} has "
                                 f"{len(node.out_shapes)} outputs")
        self.closed, out_shape = jax.make_jaxpr(step_fn, return_shape=True)(*abstract_args)
        self.in_tree = jax.tree_util.tree_structure(tuple(abstract_args))
        self.out_tree = jax.tree_util.tree_structure(out_shape)
        self.n_in = len(self.closed.jaxpr.invars)
        self.n_out = len(self.closed.jaxpr.outvars)
        for i in range(self.n_in):
            if i >= n or graph.op(i).primitive != INPUT_PRIMITIVE:
                raise ReplayError(f"the step has {self.n_in} input leaves but the graph's operator {i} is "
                                  f"{graph.op(i).describe() if i < n else 'missing'}: was the graph traced from "
                                  "these arguments?")
        first_out = n - self.n_out
        for k in range(self.n_out):
            if first_out + k < 0 or graph.op(first_out + k).primitive != OUTPUT_PRIMITIVE:
                raise ReplayError(f"the step has {self.n_out} outputs but the graph does not end with as many "
                                  "`output` operators: was the graph traced from this step function?")
        self.output_specs = {int(k): _as_spec(v) for k, v in (output_specs or {}).items()}
        self.in_shardings = self._in_shardings(abstract_args)
        self.out_shardings = self._out_shardings()
        self.ops_walked = 0
        self.constrained = 0
        self.__name__ = f"replay_{getattr(step_fn, '__name__', 'step')}"

    # --- shardings ------------------------------------------------------------------------------------------
    def named(self, spec: ShardingSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec.to_partition_spec(self.axis_names))

    def _in_shardings(self, abstract_args) -> tuple:
        leaves = []
        for i, var in enumerate(self.closed.jaxpr.invars):
            specs = self.out_specs.get(i)
            spec = specs[0] if specs else None
            rank = len(getattr(var.aval, "shape", ()))
            if spec is None:
                spec = ShardingSpec.replicated(rank)
            self._check_rank(spec, rank, i)
            leaves.append(self.named(spec))
        return tuple(jax.tree_util.tree_unflatten(self.in_tree, leaves))

    def output_spec(self, output_op: int) -> ShardingSpec | None:
        """The spec of an ``output`` operator's input: ``output_specs[op]``, else ``out_specs[op][0]`` when given,
        else the spec ``out_specs`` gives the producer of the value; None when nothing says (XLA chooses)."""
        if output_op in self.output_specs:
            return self.output_specs[output_op]
        if self.out_specs.get(output_op):
            return self.out_specs[output_op][0]
        node = self.graph.op(output_op)
        t = node.inputs[0]
        producer = self.graph.tensor(t).producer
        if producer is None or producer not in self.out_specs:
            return None
        specs = self.out_specs[producer]
        idx = self.graph.op(producer).outputs.index(t)
        return specs[idx] if idx < len(specs) else None

    def _out_shardings(self):
        first = len(self.graph) - self.n_out
        leaves = []
        for k, var in enumerate(self.closed.jaxpr.outvars):
            spec = self.output_spec(first + k)
            if spec is not None:
                self._check_rank(spec, len(getattr(var.aval, "shape", ())), first + k)
            leaves.append(None if spec is None else self.named(spec))
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)

    @staticmethod
    def _check_rank(spec: ShardingSpec, rank: int, op_id: int) -> None:
        if spec.rank != rank:
            raise ValueError(f"operator {op_id}: spec {str(spec)!r} has {spec.rank} dimensions, the value has {rank}")

    def jit(self, **kwargs):
        """``jax.jit`` of the replay with the plan's in/out shardings."""
        return jax.jit(self, in_shardings=self.in_shardings, out_shardings=self.out_shardings, **kwargs)

    # --- the walk -------------------------------------------------------------------------------------------
    def __call__(self, *args):
        leaves, tree = jax.tree_util.tree_flatten(tuple(args))
        if tree != self.in_tree:
            raise ValueError(f"the replay takes arguments shaped like the abstract args ({self.in_tree}), got {tree}")
        self._pos = 0
        self.constrained = 0
        env: dict = {}
        for i, (var, x) in enumerate(zip(self.closed.jaxpr.invars, leaves)):
            env[var] = self._emit(INPUT_PRIMITIVE, [x])[0]
        for cv, c in zip(self.closed.jaxpr.constvars, self.closed.consts):
            env[cv] = c
        self._walk(self.closed.jaxpr, env)
        outs = [self._read(env, v) for v in self.closed.jaxpr.outvars]
        for v in outs:  # output operators: the layout is fixed by out_shardings, nothing to run
            self._emit(OUTPUT_PRIMITIVE, [], check_shapes=False)
        if self._pos != len(self.graph):
            raise ReplayError(f"the replay counted {self._pos} operators, the graph has {len(self.graph)}")
        self.ops_walked = self._pos
        return jax.tree_util.tree_unflatten(self.out_tree, outs)

    @staticmethod
    def _read(env: dict, v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    def _emit(self, primitive: str, outs: list, check_shapes: bool = True) -> list:
        """Count one operator: check it against the graph, then apply its specs to ``outs``."""
        i = self._pos
        if i >= len(self.graph):
            raise ReplayError(f"the replay reached a '{primitive}' operator at id {i}, past the graph's end "
                              f"({len(self.graph)} operators): the walk diverged from the capture")
        node = self.graph.op(i)
        if node.primitive != primitive:
            raise ReplayError(f"operator {i}: the graph has {node.describe()} but the replay reached '{primitive}'"
                              f"; the walk diverged from the capture (was the graph traced from this step function, "
                              "with the same arguments and max_unroll?)")
        if check_shapes:
            if len(outs) != len(node.out_shapes) or any(
                    hasattr(o, "shape") and tuple(o.shape) != tuple(s) for o, s in zip(outs, node.out_shapes)):
                shapes = [tuple(getattr(o, "shape", ())) for o in outs]
                raise ReplayError(f"operator {i}: the graph has {node.describe()} but the replay's outputs have "
                                  f"shapes {shapes}; the walk diverged from the capture")
        self._pos = i + 1
        specs = self.out_specs.get(i)
        if not specs or node.primitive == OUTPUT_PRIMITIVE:
            return outs
        res = list(outs)
        for k, (o, spec) in enumerate(zip(outs, specs)):
            if spec is None or not hasattr(o, "shape"):
                continue
            self._check_rank(spec, len(o.shape), i)
            res[k] = jax.lax.with_sharding_constraint(o, self.named(spec))
            self.constrained += 1
        return res

    def _unrolled(self, eqn) -> bool:
        length = eqn.params["length"]
        if self.max_unroll is not None:
            return length <= self.max_unroll
        # Infer what the capture did: a scan kept whole is one `scan` operator right here with the scan's shapes.
        if self._pos < len(self.graph):
            node = self.graph.op(self._pos)
            shapes = tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
            if node.primitive == "scan" and tuple(map(tuple, node.out_shapes)) == shapes:
                return False
        return True

    def _walk(self, jaxpr, env: dict) -> None:
        from jax._src import source_info_util  # the same context eval_jaxpr binds under (names in HLO metadata)

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            invals = [self._read(env, v) for v in eqn.invars]
            body, consts = _sub_jaxpr(eqn.params)
            if name in _INLINE and body is not None:
                inner = dict(zip(body.constvars, consts))
                inner.update(zip(body.invars, invals))
                self._walk(body, inner)
                for ov, outer in zip(body.outvars, eqn.outvars):
                    env[outer] = self._read(inner, ov)
                continue
            if name == "scan" and self._unrolled(eqn):
                self._unroll_scan(eqn, invals, env)
                continue
            operands = self.operand_specs.get(self._pos) if name == self.graph.op(
                min(self._pos, len(self.graph) - 1)).primitive else None
            if operands:  # a contraction runs on the operand shards its strategy reads (its reshards, not XLA's)
                invals = [jax.lax.with_sharding_constraint(v, self.named(sp)) if sp is not None and
                          hasattr(v, "shape") else v for v, sp in zip(invals, operands)]
            params = eqn.primitive.get_bind_params(eqn.params)
            bound = self.binds.get(self._pos) if name == self.graph.op(
                min(self._pos, len(self.graph) - 1)).primitive else None
            with source_info_util.user_context(eqn.source_info.traceback,
                                               name_stack=source_info_util.current_name_stack()
                                               + eqn.source_info.name_stack), eqn.ctx.manager:
                ans = bound(*invals, **params) if bound is not None else eqn.primitive.bind(*invals, **params)
            outs = list(ans) if eqn.primitive.multiple_results else [ans]
            outs = self._emit(name, outs)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o

    def _unroll_scan(self, eqn, invals: list, env: dict) -> None:
        p = eqn.params
        body = p["jaxpr"]
        n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
        consts, carry = invals[:n_consts], invals[n_consts:n_consts + n_carry]
        xs = invals[n_consts + n_carry:]
        ys_per_iter: dict[int, list] = {}
        for step in range(length):
            idx = length - 1 - step if p["reverse"] else step
            x_slices = [self._emit("scan_slice", [jax.lax.index_in_dim(x, idx, axis=0, keepdims=False)])[0]
                        for x in xs]
            inner = dict(zip(body.jaxpr.constvars, body.consts))
            inner.update(zip(body.jaxpr.invars, list(consts) + list(carry) + x_slices))
            self._walk(body.jaxpr, inner)
            outs = [self._read(inner, v) for v in body.jaxpr.outvars]
            carry = outs[:n_carry]
            ys_per_iter[idx] = outs[n_carry:]
        results = list(carry)
        n_ys = len(body.jaxpr.outvars) - n_carry
        for k in range(n_ys):
            ys = [jnp.asarray(ys_per_iter[i][k]) for i in range(length)]
            aval = eqn.outvars[n_carry + k].aval
            stacked = jnp.stack(ys, axis=0).astype(aval.dtype) if ys else jnp.zeros(aval.shape, aval.dtype)
            results.append(self._emit("scan_stack", [stacked])[0])
        for v, r in zip(eqn.outvars, results):
            env[v] = r


def replay_with_shardings(graph: OpGraph, step_fn: Callable, abstract_args: Sequence[Any],
                          out_specs: Mapping[int, Sequence[ShardingSpec | None]], mesh: jax.sharding.Mesh,
                          axis_names: Sequence[str] = DEFAULT_AXIS_NAMES, *,
                          output_specs: Mapping[int, ShardingSpec] | None = None,
                          max_unroll: int | None = None,
                          operand_specs: Mapping[int, Sequence[ShardingSpec | None]] | None = None,
                          binds: Mapping[int, Callable] | None = None) -> Replay:
    """The step function, re-executed operator by operator with the plan's specs applied.

    ``out_specs[op_id]`` gives one spec (or None: leave it to XLA) per output of operator ``op_id``; an operator
    missing from the mapping is left alone. Specs may be ``ShardingSpec``, Alpa strings (``"S0R"``) or
    ``PartitionSpec``. The ``parameter`` operators' specs (ids ``0..n_inputs-1``) become the jitted function's
    ``in_shardings`` (replicated where missing). The ``out_shardings`` come from ``output_specs[output_op_id]``
    (the spec of the value an ``output`` operator reads) where given, else from ``out_specs[output_op_id][0]``,
    else from the spec ``out_specs`` gives the operator that produces that value, else None (XLA chooses).

    ``max_unroll`` must be what the graph was traced with when it holds scans kept whole; by default the replay
    infers it from the graph. ``operand_specs[op_id]``: the specs a contraction's operands are constrained to just
    before it (so XLA runs the matmul the way the plan's strategy does, not an algorithm of its own choosing). The
    returned :class:`Replay` is callable like ``step_fn``; ``.jit()`` jits it with the shardings. A walk that
    diverges from the graph raises :class:`ReplayError`. ``binds[op_id]``: a function called as
    ``fn(*operands, **bind params)`` in place of the operator's primitive (the ring of a ring-attention matmul,
    :func:`autopar_lab.runtime.ring.ring_binds`).
    """
    return Replay(graph, step_fn, abstract_args, out_specs, mesh,
                  ReplayOptions(axis_names=tuple(axis_names), output_specs=output_specs, max_unroll=max_unroll,
                                operand_specs=operand_specs, binds=binds))


def operand_specs_from_strategies(graph: OpGraph, strategies: Mapping[int, Any]) -> dict:
    """``operand_specs`` for :func:`replay_with_shardings`: each contraction's strategy's input specs."""
    return {int(op): tuple(s.in_specs) for op, s in strategies.items()
            if graph.op(int(op)).primitive in ("dot_general", "conv_general_dilated") and s.in_specs}


def specs_from_strategies(graph: OpGraph, strategies: Mapping[int, Any]) -> tuple[dict, dict]:
    """``(out_specs, output_specs)`` for :func:`replay_with_shardings` from chosen strategies (objects with
    ``out_specs`` and ``in_specs``, like :class:`autopar_lab.sharding.strategies.Strategy`), keyed by op id."""
    out_specs, output_specs = {}, {}
    for op_id, s in strategies.items():
        op_id = int(op_id)
        if graph.op(op_id).primitive == OUTPUT_PRIMITIVE:
            if s.in_specs:
                output_specs[op_id] = s.in_specs[0]
        else:
            out_specs[op_id] = tuple(s.out_specs)
    return out_specs, output_specs
