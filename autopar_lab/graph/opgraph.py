"""The operator graph of a training step: operators, the tensors between them, and a networkx view.

An :class:`OpGraph` is what :func:`autopar_lab.trace` returns. It is immutable after capture: solvers and views
read it, plans refer to its operator ids.

Example:
    >>> import jax, jax.numpy as jnp
    >>> import autopar_lab as al
    >>> g = al.trace(lambda w, x: jnp.tanh(x @ w), jnp.zeros((4, 8)), jnp.zeros((2, 4)), batch_argnums=(1,))
    >>> [g.op(i).primitive for i in g.ops]
    ['parameter', 'parameter', 'dot_general', 'tanh', 'output']
    >>> g.op(2).flops
    128.0
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, Mapping

import networkx as nx
import numpy as np

from .opcost import CONTRACTIONS, DATA_MOVEMENT, ELEMENTWISE, REDUCTIONS

# What an operator's input (or a graph input) holds, from the step function's point of view.
PARAM, OPT_STATE, BATCH, ACTIVATION, CONST, STATE = "param", "opt_state", "batch", "activation", "const", "state"
TENSOR_KINDS = (PARAM, OPT_STATE, BATCH, ACTIVATION, CONST, STATE)
# The phase of the training step an operator belongs to.
FORWARD, BACKWARD, UPDATE = "forward", "backward", "update"
ROLES = (FORWARD, BACKWARD, UPDATE)
# Pseudo-primitives for the step function's inputs and outputs, as HLO has `parameter` and the root tuple.
INPUT_PRIMITIVE, OUTPUT_PRIMITIVE = "parameter", "output"
# Keys a number format (:func:`autopar_lab.precision.retype`) writes into an operator's ``params``, read by the
# formulas that price it (the graph layer knows the keys, not the formats):
#: an operator whose output dtypes the format changed: the dtypes it had as traced (a convert made a no-op by it
#: costs nothing: the compiler drops it);
RETYPED = "retyped_from"
#: per input, the bytes of the separate memory-bound kernels that cast that input to FP8 (and take its scale), as a
#: multiple of the input's bytes as the operator reads it (0: none); each nonzero entry is one kernel launch;
FP8_CASTS = "fp8_casts"
#: on a parameter's input operator: the bytes per element its gradient is kept in (the format's gradient dtype;
#: absent: the compute copy's width, as JAX traces it);
GRAD_BYTES = "grad_bytes"
#: on a parameter's input operator: the bytes per element of its FP8 copies (and their scales), held all step.
FP8_COPY_BYTES = "fp8_copy_bytes"


def cast_kernels(node: "OpNode") -> int:
    """The FP8 cast kernels an operator launches besides its own (one per nonzero entry of its ``FP8_CASTS``)."""
    return sum(1 for f in node.params.get(FP8_CASTS, ()) if f)


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype given by name (``"float32"`` -> 4); 1 for bool, 0 for opaque types."""
    try:  # asked per tensor and spec while pricing: np.dtype(name) costs a microsecond, a dict lookup far less
        return _DTYPE_SIZES[dtype]
    except (KeyError, TypeError):
        pass
    try:
        out = int(np.dtype(dtype).itemsize)
    except TypeError:
        # bfloat16, float8 and friends are not numpy dtypes unless ml_dtypes is imported; read the width from the name.
        digits = "".join(ch for ch in str(dtype) if ch.isdigit())
        out = max(int(digits[:2] or 0) // 8, 1) if digits else 0
    if type(dtype) is str and len(_DTYPE_SIZES) < 1 << 10:
        _DTYPE_SIZES[dtype] = out
    return out


_DTYPE_SIZES: dict[str, int] = {}


@dataclass(frozen=True)
class TensorInfo:
    """One value in the step: a graph input, an operator output, or a literal."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    kind: str  # one of TENSOR_KINDS
    producer: int | None  # op id that produces it (graph inputs are produced by their `parameter` op)
    path: str = ""  # for graph inputs: the pytree path, e.g. "params['layer_0']['wq']"

    @property
    def size(self) -> int:
        return int(math.prod(self.shape))  # exact where np.prod would wrap past 2**63; 1 for a scalar

    @property
    def nbytes(self) -> int:
        return self.size * dtype_size(self.dtype)


@dataclass(frozen=True)
class OpNode:
    """One operator of the captured step (a jaxpr equation after inlining), with its cost figures.

    ``params`` holds the primitive's parameters (dimension numbers, axes, ...), sub-jaxprs removed.
    ``input_kinds[i]`` says what input ``i`` holds: a parameter, optimizer state, batch data, an activation, ...
    """

    id: int
    primitive: str
    name: str
    inputs: tuple[int, ...]  # tensor ids
    outputs: tuple[int, ...]  # tensor ids
    in_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[str, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[str, ...]
    input_kinds: tuple[str, ...]
    flops: float
    bytes_read: float
    bytes_written: float
    role: str  # forward | backward | update
    scope: str = ""  # the full name scope, e.g. "transpose(jvp(layer_3))/attn"
    layer: str | None = None  # the outermost user name scope ("layer_3"), or "scan[2]" for scan iterations
    params: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    opaque: bool = False  # a primitive whose cost the project does not know: kept, priced at bytes only
    scan_layer: str | None = None  # "<scope>[i]" for an operator of iteration i of an unrolled scan

    @property
    def bytes_accessed(self) -> float:
        return self.bytes_read + self.bytes_written

    @property
    def category(self) -> str:
        """What kind of work the operator does, by the FLOP conventions of :mod:`autopar_lab.graph.opcost`:
        ``"matmul"`` (a contraction: dot_general, convolution), ``"elementwise"`` (one FLOP an output element),
        ``"reduction"`` (one FLOP an input element), ``"data movement"`` (no FLOPs, only bytes: layout changes,
        slices, converts, the step's inputs and outputs) or ``"other"`` (scatters, sorts, windowed reductions,
        unknown primitives).

        >>> OpNode(0, "tanh", "t", (0,), (1,), ((4,),), ("float32",), ((4,),), ("float32",), ("activation",), 4,
        ...        16, 16, "forward").category
        'elementwise'
        """
        for name, members in (("matmul", CONTRACTIONS), ("elementwise", ELEMENTWISE), ("reduction", REDUCTIONS),
                              ("data movement", DATA_MOVEMENT)):
            if self.primitive in members:
                return name
        return "other"

    @property
    def out_bytes(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) * dtype_size(d) for s, d in zip(self.out_shapes, self.out_dtypes))

    def describe(self) -> str:
        """A one-line, human-readable summary (used by hover text and error messages)."""
        ins = ", ".join(f"{d}{list(s)}" for s, d in zip(self.in_shapes, self.in_dtypes))
        outs = ", ".join(f"{d}{list(s)}" for s, d in zip(self.out_shapes, self.out_dtypes))
        where = f" in {self.layer}" if self.layer else ""
        return f"#{self.id} {self.primitive}({ins}) -> {outs}{where} [{self.role}]"


_SIGNATURE_IGNORES = ("path", "argnum", "index", "alias_of", RETYPED)  # where an operator sits, not what it computes


def op_signature(node: OpNode) -> tuple:
    """What makes two operators the same sharding problem: primitive, shapes, dtypes, parameters, input kinds and
    role (not their place in the graph). Computed once per node: the planner asks for it on every mesh.

    >>> a = OpNode(0, "exp", "e", (0,), (1,), ((4,),), ("float32",), ((4,),), ("float32",), ("activation",), 4, 16, 16,
    ...            "forward")
    >>> op_signature(a) == op_signature(OpNode(7, "exp", "f", (3,), (9,), ((4,),), ("float32",), ((4,),), ("float32",),
    ...                                        ("activation",), 4, 16, 16, "forward"))
    True
    """
    sig = node.__dict__.get("_signature")
    if sig is None:
        params = tuple(sorted((k, repr(v)) for k, v in node.params.items() if k not in _SIGNATURE_IGNORES))
        sig = (node.primitive, node.in_shapes, node.out_shapes, node.in_dtypes, node.out_dtypes, params,
               node.input_kinds, node.role)
        object.__setattr__(node, "_signature", sig)
    return sig


_KEEP: Any = object()  # with_nodes: "keep the graph's own"


class OpGraph:
    """The operators of a training step in topological order, and the tensors that flow between them.

    ``ops`` is the list of operator ids (topological order, ids are 0..n-1). ``nx`` is a networkx ``DiGraph`` with an
    edge u -> v for every tensor u produces that v reads (edge attribute ``tensors``: the tensor ids, ``bytes``).
    """

    def __init__(
        self,
        nodes: list[OpNode],
        tensors: Mapping[int, TensorInfo],
        inputs: tuple[int, ...],
        outputs: tuple[int, ...],
        warnings: tuple[str, ...] = (),
        name: str = "",
        trace_s: float = 0.0,
    ):
        self._nodes = tuple(nodes)
        # The number format the graph was retyped to (:func:`autopar_lab.precision.retype`); None: as traced.
        self.precision: Any = None
        # How the layers were found (see autopar_lab.graph.layerfind): a rule's key, and a sentence for people.
        self.layer_rule = ""
        self.layer_note = ""
        self._tensors = dict(tensors)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.warnings = tuple(warnings)
        self.name = name
        self.trace_s = trace_s
        for i, node in enumerate(self._nodes):
            if node.id != i:
                raise ValueError(f"operator ids must be 0..n-1 in order; found id {node.id} at position {i}")

    def with_nodes(self, nodes: list[OpNode], *, tensors: Mapping[int, TensorInfo] | None = None,
                   layers: tuple[str, str] | None = None, precision: Any = _KEEP) -> "OpGraph":
        """The same step with other operator records (the same ids, inputs and outputs): relayered (``layers``: the
        new rule's key and its sentence for people) or retyped (``tensors`` and ``precision``, the number format,
        None for the traced one); what is not given is kept."""
        out = OpGraph(nodes, self._tensors if tensors is None else tensors, self.inputs, self.outputs, self.warnings,
                      name=self.name, trace_s=self.trace_s)
        out.layer_rule, out.layer_note = (self.layer_rule, self.layer_note) if layers is None else layers
        out.precision = self.precision if precision is _KEEP else precision
        return out

    # --- access -------------------------------------------------------------------------------------------
    @property
    def ops(self) -> list[int]:
        return list(range(len(self._nodes)))

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self._nodes)

    def op(self, op_id: int) -> OpNode:
        try:
            return self._nodes[op_id]
        except (IndexError, TypeError):
            raise KeyError(f"no operator {op_id!r} in this graph (ids are 0..{len(self._nodes) - 1})") from None

    def tensor(self, tensor_id: int) -> TensorInfo:
        return self._tensors[tensor_id]

    @property
    def tensors(self) -> Mapping[int, TensorInfo]:
        return self._tensors

    @cached_property
    def consumers(self) -> Mapping[int, tuple[int, ...]]:
        """tensor id -> ids of the operators that read it (in order)."""
        users: dict[int, list[int]] = defaultdict(list)
        for node in self._nodes:
            for t in dict.fromkeys(node.inputs):
                users[t].append(node.id)
        return {t: tuple(v) for t, v in users.items()}

    @cached_property
    def nx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        for node in self._nodes:
            g.add_node(node.id, primitive=node.primitive, layer=node.layer, role=node.role, flops=node.flops)
        for node in self._nodes:
            for t in dict.fromkeys(node.inputs):
                src = self._tensors[t].producer
                if src is None:
                    continue
                if g.has_edge(src, node.id):
                    g[src][node.id]["tensors"].append(t)
                    g[src][node.id]["bytes"] += self._tensors[t].nbytes
                else:
                    g.add_edge(src, node.id, tensors=[t], bytes=self._tensors[t].nbytes)
        return g

    def predecessors(self, op_id: int) -> list[int]:
        return list(self.nx.predecessors(op_id))

    def successors(self, op_id: int) -> list[int]:
        return list(self.nx.successors(op_id))

    # --- summaries ----------------------------------------------------------------------------------------
    @cached_property
    def layers(self) -> list[str]:
        """The distinct layer names in forward order: by their first operator that is not a step input (inputs come
        in pytree order, not in the order the model uses them)."""
        order = [n.layer for n in self._nodes if n.layer is not None and n.primitive != INPUT_PRIMITIVE]
        order += [n.layer for n in self._nodes if n.layer is not None]
        return list(dict.fromkeys(order))

    def ops_in_layer(self, layer: str) -> list[int]:
        return [n.id for n in self._nodes if n.layer == layer]

    @property
    def total_flops(self) -> float:
        return float(sum(n.flops for n in self._nodes))

    def flops_by(self, attr: str) -> dict[str, float]:
        """Sum of FLOPs grouped by an operator attribute (``"primitive"``, ``"role"``, ``"layer"``)."""
        acc: dict[str, float] = defaultdict(float)
        for n in self._nodes:
            acc[str(getattr(n, attr))] += n.flops
        return {k: float(v) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}

    def input_bytes(self, kind: str) -> int:
        """Bytes of the step's inputs of one kind (``"param"``, ``"opt_state"``, ``"batch"``)."""
        return sum(self._tensors[t].nbytes for t in self.inputs if self._tensors[t].kind == kind)

    @property
    def param_bytes(self) -> int:
        return self.input_bytes(PARAM)

    @property
    def param_count(self) -> int:
        return sum(self._tensors[t].size for t in self.inputs if self._tensors[t].kind == PARAM)

    def summary(self) -> dict:
        """Plain-data summary: what `autopar-lab graph --json` prints."""
        return {
            "model": self.name,
            "num_ops": len(self._nodes),
            "num_tensors": len(self._tensors),
            "num_layers": len(self.layers),
            "layer_rule": self.layer_rule,
            "layer_note": self.layer_note,
            "total_flops": self.total_flops,
            "flops_by_primitive": self.flops_by("primitive"),
            "flops_by_role": self.flops_by("role"),
            "param_count": self.param_count,
            "param_bytes": self.param_bytes,
            "opt_state_bytes": self.input_bytes(OPT_STATE),
            "batch_bytes": self.input_bytes(BATCH),
            "opaque_ops": sorted({n.primitive for n in self._nodes if n.opaque}),
            "warnings": list(self.warnings),
            "trace_s": self.trace_s,
        }

    @cached_property
    def fingerprint(self) -> str:
        """A stable hash of the graph's structure and shapes (plans saved for one graph are refused by another)."""
        h = hashlib.sha256()
        for n in self._nodes:
            h.update(json.dumps([n.primitive, n.inputs, n.outputs, n.in_shapes, n.out_shapes, n.out_dtypes]).encode())
        # A retyped graph is another graph (an FP8 format changes operand dtypes only): plans and tables never mix.
        fmt = self.__dict__.get("precision")
        if fmt is not None:
            h.update(repr(fmt).encode())
        return h.hexdigest()[:16]

    def __repr__(self) -> str:
        return (
            f"OpGraph({self.name or 'step'}: {len(self._nodes)} ops, {len(self.layers)} layers, "
            f"{self.total_flops:.3g} FLOPs, {self.param_count:,} params)"
        )

    def _repr_html_(self) -> str:
        s = self.summary()
        rows = "".join(
            f"<tr><td>{k}</td><td style='text-align:right'>{v:.3g}</td></tr>" for k, v in s["flops_by_role"].items()
        )
        return (
            f"<b>OpGraph</b> {s['model'] or 'step'}: {s['num_ops']} operators, {s['num_layers']} layers, "
            f"{s['param_count']:,} parameters ({s['param_bytes'] / 2**20:.1f} MiB), traced in {s['trace_s']:.2f} s"
            f"<table><tr><th>role</th><th>FLOPs</th></tr>{rows}</table>"
        )
