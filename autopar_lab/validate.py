"""Apply a sharding plan to the real step function, and read back what XLA compiled.

Three pieces:

- :func:`replay_with_shardings` re-executes the step function's jaxpr equation by equation, walking it in exactly the
  order :mod:`autopar_lab.graph.capture` does (nested calls inlined, short scans unrolled into ``scan_slice`` / body /
  ``scan_stack``), so that it counts operator ids like the :class:`~autopar_lab.graph.opgraph.OpGraph` does. After
  each operator that the plan gives specs for, it pins the outputs with ``jax.lax.with_sharding_constraint``. The
  walk checks, operator by operator, that it meets the graph's primitive and output shapes, and raises
  :class:`ReplayError` the moment the two disagree.
- :func:`collectives_in_hlo` counts the collectives in XLA's partitioned HLO text and the bytes each one moves
  (by the convention of :mod:`autopar_lab.sharding.strategies`: the full per-device buffer the collective works on).
- :func:`validate_model` puts the two together on a zoo model: compile the planned step on a mesh, count its
  collectives, run one step sharded and one on a single device, and report predicted against compiled.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh
    >>> from autopar_lab.graph.capture import trace
    >>> from autopar_lab.sharding.spec import ShardingSpec
    >>> fn = lambda x: jnp.sum(x, axis=0)
    >>> x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    >>> g = trace(fn, x, param_argnums=())
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    >>> f = replay_with_shardings(g, fn, (x,), {0: [ShardingSpec.parse("S0R")]}, mesh)
    >>> f.jit().lower(x).compile() is not None
    True
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .graph.capture import _INLINE, _sub_jaxpr  # the SAME inlining decisions as the capture, by construction
from .graph.opgraph import INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, OpGraph
from .sharding.spec import DEFAULT_AXIS_NAMES, ShardingSpec

__all__ = [
    "COLLECTIVE_KINDS",
    "Replay",
    "ReplayError",
    "collective_instructions",
    "collectives_in_hlo",
    "predicted_collectives",
    "replay_with_shardings",
    "specs_from_strategies",
    "summarize_collectives",
    "total_bytes",
    "validate_model",
    "validate_plan",
]

#: The collective kinds :func:`collectives_in_hlo` reports (always all five keys).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")


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
                 axis_names: Sequence[str] = DEFAULT_AXIS_NAMES,
                 output_specs: Mapping[int, Any] | None = None, max_unroll: int | None = None):
        self.graph = graph
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
            params = eqn.primitive.get_bind_params(eqn.params)
            with source_info_util.user_context(eqn.source_info.traceback,
                                               name_stack=source_info_util.current_name_stack()
                                               + eqn.source_info.name_stack), eqn.ctx.manager:
                ans = eqn.primitive.bind(*invals, **params)
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
                          max_unroll: int | None = None) -> Replay:
    """The step function, re-executed operator by operator with the plan's specs applied.

    ``out_specs[op_id]`` gives one spec (or None: leave it to XLA) per output of operator ``op_id``; an operator
    missing from the mapping is left alone. Specs may be ``ShardingSpec``, Alpa strings (``"S0R"``) or
    ``PartitionSpec``. The ``parameter`` operators' specs (ids ``0..n_inputs-1``) become the jitted function's
    ``in_shardings`` (replicated where missing). The ``out_shardings`` come from ``output_specs[output_op_id]``
    (the spec of the value an ``output`` operator reads) where given, else from ``out_specs[output_op_id][0]``,
    else from the spec ``out_specs`` gives the operator that produces that value, else None (XLA chooses).

    ``max_unroll`` must be what the graph was traced with when it holds scans kept whole; by default the replay
    infers it from the graph. The returned :class:`Replay` is callable like ``step_fn``; ``.jit()`` jits it with
    the shardings. A walk that diverges from the graph raises :class:`ReplayError`.
    """
    return Replay(graph, step_fn, abstract_args, out_specs, mesh, axis_names, output_specs, max_unroll)


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


# ----------------------------------------------------------------------------------------------------------------
# Reading collectives out of partitioned HLO

_OPCODES = {
    "all-reduce": ("all_reduce", "shape"),
    "all-reduce-start": ("all_reduce", "shape"),
    "all-gather": ("all_gather", "shape"),
    "all-gather-start": ("all_gather", "result"),  # shape (operand(s), result(s))
    "reduce-scatter": ("reduce_scatter", "operand"),
    "reduce-scatter-start": ("reduce_scatter", "start_operand"),  # async sugar: ((operands), results, ...)
    "all-to-all": ("all_to_all", "shape"),
    "all-to-all-start": ("all_to_all", "result"),
    "ragged-all-to-all": ("all_to_all", "shape"),
    "collective-permute": ("collective_permute", "shape"),
    "collective-permute-start": ("collective_permute", "result"),  # (operand, result, u32[], u32[])
}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=(){}]+)\s*=\s*")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_OPERAND_NAME = re.compile(r"%?([A-Za-z_][\w.\-]*)\s*$")


def _dtype_bytes(name: str) -> float:
    if name in ("pred",):
        return 1.0
    if name in ("token", "tuple", "opaque"):
        return 0.0
    if name.startswith("c"):  # c64, c128: complex widths count both halves
        digits = "".join(ch for ch in name if ch.isdigit())
        return int(digits) / 8 if digits else 0.0
    digits = re.match(r"[a-z]+(\d+)", name)
    return int(digits.group(1)) / 8 if digits else 0.0


def _shape_bytes(text: str) -> float:
    """Bytes of every array in an HLO shape string (tuples summed): ``(f32[8,32]{1,0}, s32[])`` -> 1028."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(_COMMENT.sub("", text)):
        n = 1
        for d in dims.split(","):
            d = re.sub(r"[^0-9]", "", d)
            if d:
                n *= int(d)
        total += n * _dtype_bytes(dtype)
    return total


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at ``text[start] == '('``."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    """Elements of a tuple shape ``(a, (b, c), d)`` at the top level; a non-tuple is its own single element."""
    text = _COMMENT.sub("", text).strip()
    if not text.startswith("("):
        return [text]
    inner = text[1:_balanced(text, 0) - 1]
    parts, depth, cur = [], 0, []
    for ch in inner:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _group_size(attrs: str) -> int | None:
    """Devices per replica group from ``replica_groups=`` in its three spellings."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'?([\w.]+)'?\s*=\s*(\d+)", m.group(1)))
        names = re.findall(r"'?([\w.]+)'?", m.group(2))
        return math.prod(int(sizes[n]) for n in names if n in sizes) if names else None
    m = re.search(r"replica_groups=\[([\d,\s]+)\]<=", attrs)
    if m:
        dims = [int(d) for d in m.group(1).split(",") if d.strip()]
        return dims[-1] if dims else None
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
    if m:
        return len([d for d in m.group(1).split(",") if d.strip()])
    return None


def _parse_instruction(line: str):
    """``(name, shape_text, opcode, operands_text, attrs_text)`` of one HLO instruction line, or None."""
    m = _INSTR.match(line)
    if not m:
        return None
    pos = m.end()
    if pos < len(line) and line[pos] == "(":
        end = _balanced(line, pos)
    else:
        end = pos
        while end < len(line) and not line[end].isspace():
            end += 1
    shape = line[pos:end]
    m2 = re.compile(r"\s+([\w\-]+)\(").match(line, end)
    if not m2:
        return None
    op_start = m2.end() - 1
    op_end = _balanced(line, op_start)
    return m.group("name"), shape, m2.group(1), line[op_start + 1:op_end - 1], line[op_end:]


def collective_instructions(hlo_text: str) -> list[dict]:
    """Every collective instruction in an HLO module's text, in order, as
    ``{"kind", "opcode", "name", "computation", "shape", "bytes", "group_size"}``.

    Each instruction is counted once: ``-start`` forms count, ``-done`` forms do not; instructions inside fusion,
    async-wrapped and other called computations count. ``bytes`` is the full buffer the collective works on, per
    device: all-gather its result, reduce-scatter its operand(s), all-reduce / all-to-all / collective-permute
    their result; tuple-shaped (variadic) collectives sum their parts.

    >>> hlo = '''
    ... ENTRY %main (p: f32[8,256]) -> f32[256] {
    ...   %p = f32[8,256]{1,0} parameter(0)
    ...   %r = f32[256]{0} reduce(%p, %c), dimensions={0}, to_apply=%add
    ...   ROOT %all-reduce = f32[256]{0} all-reduce(%r), replica_groups={{0,1,2,3}}, to_apply=%add
    ... }'''
    >>> [(c["kind"], c["bytes"]) for c in collective_instructions(hlo)]
    [('all_reduce', 1024.0)]
    """
    shapes: dict[str, str] = {}
    parsed = []
    computation = ""
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and "=" not in stripped.split("(")[0]:
            computation = stripped.split("(")[0].replace("ENTRY", "").strip().lstrip("%")
            # computation parameters: "(param_0: f32[8,256], p1: s32[])"
            for pname, pshape in re.findall(r"([\w.\-]+):\s*([a-z][a-z0-9]*\[[^\]]*\])", stripped):
                shapes.setdefault(pname, pshape)
            continue
        ins = _parse_instruction(line)
        if ins is None:
            continue
        name, shape, opcode, operands, attrs = ins
        shapes[name] = shape
        if opcode in _OPCODES:
            parsed.append((computation, name, shape, opcode, operands, attrs))
    out = []
    for computation, name, shape, opcode, operands, attrs in parsed:
        kind, rule = _OPCODES[opcode]
        group = _group_size(attrs)
        elements = _split_top(shape)
        if rule == "shape":
            nbytes = _shape_bytes(shape)
        elif rule == "result":
            nbytes = _shape_bytes(elements[1]) if len(elements) >= 2 else _shape_bytes(shape)
        elif rule == "start_operand":
            nbytes = _shape_bytes(elements[0])
        else:  # reduce-scatter: its operands' shapes (printed inline, or looked up by name)
            nbytes = 0.0
            found = True
            for operand in _split_top("(" + operands + ")"):
                if _ARRAY.search(operand):
                    nbytes += _shape_bytes(operand)
                    continue
                m = _OPERAND_NAME.search(operand)
                if m and m.group(1) in shapes:
                    nbytes += _shape_bytes(shapes[m.group(1)])
                else:
                    found = False
            if not found or nbytes == 0.0:  # fall back on result x group size
                nbytes = _shape_bytes(shape) * (group or 1)
        out.append({"kind": kind, "opcode": opcode, "name": name, "computation": computation,
                    "shape": _COMMENT.sub("", shape), "bytes": float(nbytes), "group_size": group})
    return out


def collectives_in_hlo(hlo_text: str) -> dict[str, dict[str, float]]:
    """``{kind: {"count": int, "bytes": float}}`` for every kind in :data:`COLLECTIVE_KINDS` (zeros included),
    from partitioned HLO text (``jax.jit(...).lower(...).compile().as_text()``); see :func:`collective_instructions`
    for what counts and how bytes are measured."""
    acc = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVE_KINDS}
    for c in collective_instructions(hlo_text):
        acc[c["kind"]]["count"] += 1
        acc[c["kind"]]["bytes"] += c["bytes"]
    return acc


def total_bytes(collectives: Mapping[str, Mapping[str, float]] | None) -> float:
    """Sum of ``bytes`` over the kinds of a collectives summary."""
    return float(sum(float(v.get("bytes", 0.0)) for v in (collectives or {}).values()))


# ----------------------------------------------------------------------------------------------------------------
# Predicted against compiled, on a zoo model


def _max_abs_err(a, b) -> float:
    worst = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            raise ValueError(f"sharded and single-device outputs differ in shape: {x.shape} vs {y.shape}")
        if x.size:
            worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))))
    return worst


def validate_model(model_spec, out_specs: Mapping[int, Sequence[Any]], mesh: jax.sharding.Mesh,
                   predicted: Mapping[str, Mapping[str, float]] | None = None, *,
                   output_specs: Mapping[int, Any] | None = None, graph: OpGraph | None = None,
                   axis_names: Sequence[str] = DEFAULT_AXIS_NAMES, seed: int = 0, run: bool = True,
                   donate_argnums: Sequence[int] = ()) -> dict:
    """Compile the planned step of ``model_spec`` on ``mesh``, count its collectives, run one step sharded and one
    on a single device, and compare.

    Returns ``{"predicted", "compiled", "bytes_ratio", "numerics_max_abs_err", "num_devices", "compile_s",
    "num_ops"}``: ``compiled`` is :func:`collectives_in_hlo` of the partitioned HLO; ``bytes_ratio`` is predicted
    total bytes / compiled total bytes (None when XLA compiled no collective bytes); ``numerics_max_abs_err`` is
    the largest |sharded - single device| over the outputs' leaves (None with ``run=False``). ``graph`` defaults to
    ``model_spec.trace()``; the concrete arguments are ``model_spec.init(seed)``. ``donate_argnums`` are donated to
    the sharded step (the updated parameters and optimizer state then reuse their inputs' buffers, as in training).
    """
    graph = model_spec.trace() if graph is None else graph
    replay = replay_with_shardings(graph, model_spec.step_fn, model_spec.abstract_args, out_specs, mesh,
                                   axis_names, output_specs=output_specs)
    jitted = replay.jit(donate_argnums=tuple(donate_argnums)) if donate_argnums else replay.jit()
    t0 = time.perf_counter()
    compiled_exe = jitted.lower(*model_spec.abstract_args).compile()
    compile_s = time.perf_counter() - t0
    compiled = collectives_in_hlo(compiled_exe.as_text())
    predicted = {k: dict(v) for k, v in (predicted or {}).items()}
    comp_total = total_bytes(compiled)
    err = None
    if run:
        args = model_spec.init(seed)
        single = jax.jit(model_spec.step_fn)(*args)
        sharded_args = jax.device_put(tuple(args), replay.in_shardings)
        sharded = compiled_exe(*sharded_args)
        err = _max_abs_err(sharded, single)
    return {
        "predicted": predicted,
        "compiled": compiled,
        "bytes_ratio": (total_bytes(predicted) / comp_total) if comp_total > 0 else None,
        "numerics_max_abs_err": err,
        "num_devices": int(mesh.devices.size),
        "compile_s": compile_s,
        "num_ops": replay.ops_walked,
    }


# ----------------------------------------------------------------------------------------------------------------
# An intra-op plan of the solver against what XLA compiles


def predicted_collectives(graph: OpGraph, strategies: Mapping[int, Any], mesh) -> list[dict]:
    """Every collective the cost model charges for ``strategies`` on the logical ``mesh``, one record each.

    The same collectives :func:`autopar_lab.solve.intra.evaluate_intra` sums into ``IntraPlan.collectives``: those
    the operators run themselves (on mesh axes of more than one device), and those of every resharding edge
    (producer -> consumer, and updated parameter -> parameter for an output that aliases an input). A record is
    ``{"kind", "axis", "axis_size", "bytes", "hlo_bytes", "source", "op", "consumer", "tensor", "src", "dst"}``:

    - ``bytes`` is the cost model's B (the full buffer along the axis, see :class:`~autopar_lab.cluster.LogicalMesh`);
    - ``hlo_bytes`` is the same collective in the convention of :func:`collectives_in_hlo` (the per-device buffer
      the HLO instruction names): equal to ``bytes`` for all-reduce, all-gather and reduce-scatter, ``bytes / n``
      for an all-to-all over n devices (each device holds one n-th of B before and after);
    - ``source`` is ``"op"`` (the operator ``op`` runs it), ``"reshard"`` (edge ``op`` -> ``consumer`` on
      ``tensor``, from spec ``src`` to ``dst``) or ``"alias"`` (the update read by output ``consumer`` converted
      back to the spec of parameter ``op``).
    """
    from .sharding.reshard import plan_reshard

    mshape = tuple(int(n) for n in mesh.shape)
    out: list[dict] = []

    def rec(kind, axis, nbytes, source, op, consumer=None, tensor=None, src=None, dst=None):
        n = int(mesh.axis_size(axis))
        if n <= 1:
            return
        hlo = float(nbytes) / n if kind == "all_to_all" else float(nbytes)
        out.append({"kind": kind, "axis": list(axis) if isinstance(axis, tuple) else axis, "axis_size": n,
                    "bytes": float(nbytes), "hlo_bytes": hlo, "source": source, "op": op, "consumer": consumer,
                    "tensor": tensor, "src": None if src is None else str(src),
                    "dst": None if dst is None else str(dst)})

    ops = list(graph.ops)
    missing = [op for op in ops if op not in strategies]
    if missing:
        raise ValueError(f"the plan has no strategy for operator {graph.op(missing[0]).describe()}; "
                         "pass the strategies of every operator (IntraPlan.strategies of a whole-graph solve).")
    for op in ops:
        for kind, axis, nbytes in strategies[op].collectives:
            rec(kind, axis, nbytes, "op", op)
    converted: set[tuple] = set()
    for v in ops:
        node = graph.op(v)
        for j, t in enumerate(node.inputs):
            u = graph.tensor(t).producer
            if u is None:
                continue
            i = graph.op(u).outputs.index(t)
            src, dst = strategies[u].out_specs[i], strategies[v].in_specs[j]
            info = graph.tensor(t)
            if src != dst and info.shape and (t, src, dst) not in converted:
                converted.add((t, src, dst))  # one conversion serves every consumer (as in evaluate_intra)
                for kind, axis, nbytes in plan_reshard(src, dst, info.shape, info.dtype, mshape):
                    rec(kind, axis, nbytes, "reshard", u, v, t, src, dst)
        if node.primitive == OUTPUT_PRIMITIVE and node.params.get("alias_of") is not None:
            p = graph.tensor(node.params["alias_of"]).producer
            info = graph.tensor(node.inputs[0])
            src, dst = strategies[v].in_specs[0], strategies[p].out_specs[0]
            if src != dst and info.shape:
                for kind, axis, nbytes in plan_reshard(src, dst, info.shape, info.dtype, mshape):
                    rec(kind, axis, nbytes, "alias", p, v, node.inputs[0], src, dst)
    return out


def summarize_collectives(records: Sequence[Mapping[str, Any]], field: str = "hlo_bytes", *,
                          dedupe: bool = False) -> dict[str, dict[str, float]]:
    """``{kind: {"count", "bytes"}}`` (every kind of :data:`COLLECTIVE_KINDS`) of :func:`predicted_collectives`
    records, bytes taken from ``field``. ``dedupe`` counts once the resharding of one tensor from one spec to the
    same spec for several consumers (XLA computes that value once and every consumer reads it)."""
    acc = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVE_KINDS}
    seen = set()
    for r in records:
        if dedupe and r["source"] == "reshard":
            key = (r["tensor"], r["src"], r["dst"], r["kind"], str(r["axis"]))
            if key in seen:
                continue
            seen.add(key)
        acc[r["kind"]]["count"] += 1
        acc[r["kind"]]["bytes"] += float(r[field])
    return acc


_OVERRIDE_ALIASES = {"layers": "num_layers", "batch": "batch_size"}

#: What ``validate_plan(name, small=True)`` sets (for fields ``overrides`` leaves unset): float32, and sizes that
#: compile and run a step on 8 CPU devices in seconds while the matmuls are still large enough for the solver to
#: split them (on the ``cpu`` preset a collective costs ~0.5 ms of latency, so tiny layers stay replicated).
SMALL_OVERRIDES = {
    "mlp": dict(batch_size=256, input_dim=256, hidden_size=512, num_layers=2, num_classes=64),
    "gpt": dict(batch_size=8, seq_len=64, hidden_size=256, num_layers=2, num_heads=4, vocab_size=512),
    "moe": dict(batch_size=8, seq_len=64, hidden_size=256, num_layers=2, num_heads=4, vocab_size=512,
                num_experts=8, expert_group_size=64),
    "wresnet": dict(batch_size=16, num_layers=14, num_channels=16, width_factor=2, image_size=32, num_classes=16),
}


def _build_model(model, overrides, small: bool):
    from . import models as zoo
    from .models.base import ModelSpec

    if isinstance(model, ModelSpec):
        if overrides:
            raise ValueError("overrides apply to a zoo model name; pass the name (e.g. 'gpt-1.3b') or build the "
                             "ModelSpec with the sizes you want.")
        return model
    over = {}
    for k, v in dict(overrides or {}).items():
        if v is not None:
            over[_OVERRIDE_ALIASES.get(k, k)] = v
    key = str(model).strip().lower()
    if key not in zoo.names():
        raise ValueError(f"unknown model {model!r}; valid names are: {', '.join(zoo.names())}.")
    family = next(f for f in ("gpt", "moe", "wresnet", "mlp") if key in zoo.names(f))
    fields = set(zoo.fields(key))
    unknown = sorted(set(over) - fields)
    if unknown:
        raise ValueError(f"model {key!r} has no field {unknown[0]!r}; its fields are: {', '.join(sorted(fields))}.")
    if small:
        for k, v in SMALL_OVERRIDES[family].items():
            if k in fields:
                over.setdefault(k, v)
    over.setdefault("dtype", "float32")
    return zoo.get(key, **over)


def _parse_mesh_shape(mesh_shape, devices: int) -> tuple[int, int] | None:
    if mesh_shape is None:
        return None
    if isinstance(mesh_shape, str):
        parts = mesh_shape.lower().replace(",", "x").split("x")
        try:
            shape = tuple(int(p) for p in parts)
        except ValueError:
            raise ValueError(f"mesh {mesh_shape!r} is not two numbers like '2x4'; write it as ROWSxCOLS.") from None
    else:
        try:
            shape = tuple(int(p) for p in mesh_shape)
        except (TypeError, ValueError):
            raise ValueError(f"mesh {mesh_shape!r} is not two whole numbers; pass e.g. (2, 4) or '2x4'.") from None
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"mesh {mesh_shape!r} must be two positive numbers like '2x4'.")
    if shape[0] * shape[1] != devices:
        raise ValueError(f"mesh {shape[0]}x{shape[1]} has {shape[0] * shape[1]} devices but --devices is {devices}; "
                         "use a mesh whose two sizes multiply to the device count.")
    return shape


def _check_devices(devices) -> int:
    try:
        n = int(devices)
        ok = n == devices
    except (TypeError, ValueError):
        ok = False
    if not ok or n < 1:
        raise ValueError(f"devices must be a positive whole number, got {devices!r}.")
    if n & (n - 1):
        raise ValueError(f"devices must be a power of two (1, 2, 4, 8, ...), got {n}.")
    have = jax.local_device_count()
    if n > have:
        raise ValueError(f"asked for {n} devices but JAX sees {have}; set JAX_NUM_CPU_DEVICES={n} (before jax is "
                         "imported) or ask for fewer devices.")
    return n


def _plan_report(spec, graph, cluster, shape, devices, solver, run, trace_s) -> dict:
    from .solve.intra import solve_intra

    lm = cluster.logical_mesh((1, devices), shape)
    t0 = time.perf_counter()
    plan = solve_intra(graph, lm, solver=solver)
    solve_s = time.perf_counter() - t0
    records = predicted_collectives(graph, plan.strategies, lm)
    out_specs, output_specs = specs_from_strategies(graph, plan.strategies)
    # Faithful to the cost model's aliasing: an updated parameter (or optimizer state) leaves the step in the spec
    # its input came in, so the next step can take it as is (the model charges that conversion to this step).
    for node in graph:
        if node.primitive == OUTPUT_PRIMITIVE and node.params.get("alias_of") is not None:
            p = graph.tensor(node.params["alias_of"]).producer
            output_specs[node.id] = plan.strategies[p].out_specs[0]
    donate = tuple(i for i in range(len(spec.abstract_args)) if i not in spec.batch_argnums)
    rep = validate_model(spec, out_specs, lm.to_jax_mesh(jax.devices()[:devices]), None,
                         output_specs=output_specs, graph=graph, run=run, donate_argnums=donate)
    predicted = summarize_collectives(records)
    dedup = summarize_collectives(records, dedupe=True)
    compiled = rep["compiled"]
    comp_total = total_bytes(compiled)
    ratio = (lambda pred: total_bytes(pred) / comp_total if comp_total > 0 else
             (1.0 if total_bytes(pred) == 0 else None))
    return {
        "model": spec.name,
        "devices": devices,
        "logical_mesh": list(shape),
        "predicted": predicted,
        "compiled": compiled,
        "bytes_ratio": ratio(predicted),
        "predicted_dedup": dedup,
        "bytes_ratio_dedup": ratio(dedup),
        "predicted_model": {k: dict(v) for k, v in plan.collectives.items()},
        "numerics_max_abs_err": rep["numerics_max_abs_err"],
        "predicted_step_s": plan.total_s,
        "predicted_comm_s": plan.comm_s + plan.reshard_s,
        "solve_s": solve_s,
        "compile_s": rep["compile_s"],
        "trace_s": trace_s,
        "num_ops": len(graph),
    }


def validate_plan(model_name_or_spec, devices: int = 8, mesh_shape=None, overrides: Mapping[str, Any] | None = None,
                  solver: str = "cbc", *, small: bool = True, run: bool = True) -> dict:
    """Solve the intra-op plan of a model on ``devices`` local devices, compile it with XLA, run one step, compare.

    ``model_name_or_spec`` is a zoo name (built float32; with ``small=True`` the fields ``overrides`` leaves unset
    take :data:`SMALL_OVERRIDES`, sizes that compile in seconds on CPU; ``overrides`` may say ``layers`` / ``batch``
    for ``num_layers`` / ``batch_size``) or a :class:`~autopar_lab.models.ModelSpec`. The cluster is the ``cpu``
    preset as one host of ``devices`` devices; the logical mesh views that (1, devices) submesh as ``mesh_shape``
    ((2, 4) or "2x4"). Without ``mesh_shape`` both (devices, 1) and (2, devices / 2) are solved and validated; the
    report is that of the mesh with the lower predicted step time, and ``meshes`` holds every mesh's report.

    The strategies of :func:`autopar_lab.solve.intra.solve_intra` are applied with :func:`specs_from_strategies`
    (every operator's outputs pinned, parameters' ``in_shardings`` from their specs, updated parameters and optimizer
    state leaving in their inputs' specs, donated), and :func:`validate_model` compiles and runs the step.

    Returns a JSON-ready dict: model, devices, logical_mesh, predicted and compiled ``{kind: {count, bytes}}`` (bytes
    per device buffer, see :func:`predicted_collectives`), bytes_ratio (predicted / compiled total; 1.0 when both
    are zero), predicted_dedup / bytes_ratio_dedup (a value resharded alike for several consumers counted once, as
    XLA does), predicted_model (``IntraPlan.collectives`` as the cost model states it), numerics_max_abs_err,
    predicted_step_s, predicted_comm_s, solve_s, compile_s, trace_s, num_ops. Bad input raises ValueError.
    """
    from .cluster import Cluster

    devices = _check_devices(devices)
    shape = _parse_mesh_shape(mesh_shape, devices)
    if solver not in ("cbc", "highs"):
        raise ValueError(f"solver must be 'cbc' or 'highs', got {solver!r}.")
    spec = _build_model(model_name_or_spec, overrides, small)
    cluster = Cluster.preset("cpu").with_(devices_per_host=devices)
    allowed = cluster.logical_mesh_shapes((1, devices))
    if shape is not None and shape not in allowed:
        raise ValueError(f"mesh {shape[0]}x{shape[1]} is not a logical view of 1 host x {devices} devices; "
                         f"use one of {', '.join(f'{a}x{b}' for a, b in allowed)}.")
    t0 = time.perf_counter()
    graph = spec.trace()
    trace_s = time.perf_counter() - t0
    shapes = [shape] if shape is not None else list(dict.fromkeys(
        s for s in ((devices, 1), (min(2, devices), devices // min(2, devices))) if s in allowed))
    reports = [_plan_report(spec, graph, cluster, s, devices, solver, run, trace_s) for s in shapes]
    best = min(reports, key=lambda r: r["predicted_step_s"])
    if len(reports) > 1:
        best = dict(best, meshes=reports)
    return best
