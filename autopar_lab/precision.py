"""Number formats as a plan decision: fp32, fp16, bf16 and FP8 matmuls, applied to a traced operator graph.

A model is traced in one format: the zoo's is float16 compute with float32 master weights and Adam state (Megatron-LM's
and Alpa's mixed precision). Today's runs are planned in others. A :class:`Precision` names one, and :func:`retype`
returns the graph as it would run in it: the same operators (the same ids, so pins, plans and the runtime's mapping
hold), with their dtypes changed and a few keys in their ``params`` (:data:`~autopar_lab.graph.opgraph.RETYPED`,
``FP8_CASTS``, ``GRAD_BYTES``, ``FP8_COPY_BYTES``). Every formula downstream reads the format from the graph and from
nothing else: strategy pricing (a matmul's dtype picks the device rate, :meth:`~autopar_lab.cluster.Device.peak`), the
intra-op ILP's collectives (a gradient's all-reduce moves its dtype's bytes), the memory terms
(:func:`~autopar_lab.solve.memterms.memory_terms`) and kernel fusion. A retyped graph has its own fingerprint, so cost
tables, plan files and memo caches never mix formats. :func:`precision_of` says a graph's format.

The formats (:data:`NAMES`), with Adam's memory per parameter as ZeRO counts it (Rajbhandari et al., SC20):

- ``"fp32"``: float32 everywhere, no master weights: 4 (weights) + 4 (gradients) + 8 (two moments) = 16 bytes.
- ``"fp16"``: float16 compute copies of float32 master weights, float32 optimizer state, gradients accumulated and
  reduced in float16 (as JAX traces a float16 step: the weight-gradient matmuls write float16, cast to float32 for
  the update): 2 + 2 + 4 + 8 = 16 bytes.
- ``"bf16"``: Megatron-LM's and Llama 3's recipe (Megatron-LM's ``--bf16`` turns on
  ``accumulate_allreduce_grads_in_fp32``: "bfloat16 requires gradient accumulation and all-reduce to be done in fp32",
  megatron/training/arguments.py, unless ``--grad-reduce-in-bf16``; Llama 3 405B was trained in bf16 with fp32
  gradient accumulation and reduce-scatter, Llama 3 paper, as ``published-measurements.md`` summarises it):
  bfloat16 compute copies, float32 master weights and optimizer state, gradients accumulated and reduced in float32.
  In the graph the weight-gradient operators (the matmuls that contract the batch, the bias and norm reductions, an
  embedding's scatter) write float32, and so do the layout and elementwise operators between them and the optimizer
  (:func:`~autopar_lab.solve.intra.weight_gradient_ops`): a data-parallel gradient all-reduce or reduce-scatter moves
  twice fp16's bytes; memory 2 + 4 + 4 + 8 = 18 bytes a parameter.
- ``"fp8"``: bf16's recipe with the linear layers' GEMMs in FP8 (Micikevicius et al., "FP8 Formats for Deep
  Learning", 2022), per-tensor scaling as Transformer Engine's delayed scaling does it (the scale comes from the
  amax history of earlier steps; the amax of this cast is taken in the cast kernel itself).
- ``"fp8-block"``: the same GEMMs with DeepSeek-V3's fine-grained scaling (technical report, arXiv 2412.19437, sec.
  3.3): one float32 scale per 1x128 tile of an activation or gradient and per 128x128 block of a weight, each
  computed from that tile's amax inside the quantising kernel.

What the FP8 formats price, and what they assume:

- Which GEMMs: those of the linear layers, found in the graph: a forward matmul of one weight (a parameter's compute
  copy, through layout operators) by one activation (forward propagation), the backward matmuls that read the same
  weight (data gradient) or the same activation (weight gradient). Attention's score and value matmuls (two
  activations) stay in bf16, as Transformer Engine keeps them; so do the GEMMs of the graph's first and last layer
  (the embedding and the output head, which Megatron-LM with Transformer Engine and DeepSeek-V3 keep in higher
  precision) and GEMMs with a dimension that is not a multiple of 16 (Transformer Engine asks FP8 GEMM operands
  for dimensions divisible by 8 or 16; 16 is required of all three here, an assumption on the safe side), and a
  mixture of experts' router (:func:`router_gemms`: its scores pick the experts; DeepSeek-V3 keeps gating in BF16).
- Their rate: both operands are ``float8_e4m3fn`` (:data:`FP8_DTYPE`), priced at the device's FP8 rate
  (``Device.peak("float8_e4m3fn")``) with the device's matmul efficiency. Transformer Engine's HYBRID format keeps
  gradients in E5M2; both formats run at one rate on Hopper and Blackwell. Outputs stay bf16 (fp32 for the weight
  gradients, bf16's recipe). A device without an FP8 rate refuses the format (:func:`check_device`).
- The casts: every tensor an FP8 GEMM reads is cast once, however many FP8 GEMMs read it, by a memory-bound kernel
  of its own that reads it at its width (2 bytes) and writes an FP8 copy and, because Hopper's FP8 tensor-core
  GEMMs read both operands K-major, a transposed FP8 copy for the backward's GEMMs (Transformer Engine's
  cast-transpose; :attr:`Precision.transposed`, on by default), with the block scales where there are (4 bytes per
  128 elements of an activation, per 128 x 128 of a weight). The scale (amax) computation is part of that kernel
  (delayed scaling, per-tile scaling); the per-step scale update of delayed scaling (a few bytes a tensor) is not
  priced. An activation's or gradient's cast runs per microbatch, with the first FP8 GEMM that reads it
  (:data:`~autopar_lab.graph.opgraph.FP8_CASTS` on that operator); a weight's once per step, after the optimizer's
  update (on the update operator that writes the new weight), as Transformer Engine caches the FP8 weights across a
  step's microbatches. Each cast is priced as its own kernel: where Transformer Engine fuses it into the layer norm or
  activation before it, this is an upper bound.
- Memory: each FP8 weight's copies (1 + 1 bytes a parameter, and their block scales) are held all step, a part of
  their own (``FP8_COPY_BYTES``: the breakdown's ``fp8_copies_bytes``), besides bf16's 18 bytes. Activations are kept
  as the graph saves them (bf16): Transformer Engine saves a linear layer's input as its transposed FP8 copy (1 byte
  an element) instead, so this overstates activation memory by up to a byte an element of those inputs. The
  weight's bf16 copy is still made per microbatch, as the bf16 format makes it.

Not executed: the runtime (``al.execute``, ``al.launch``) runs the model's own step in its traced dtypes. A retyped
plan is priced in its format, not run in it (on JAX's CPU devices FP8 matmuls could not run at all).

    >>> import autopar_lab as al
    >>> spec = al.models.get("gpt-1.3b", num_layers=2, hidden_size=64, num_heads=4, seq_len=16, batch_size=8,
    ...                      vocab_size=128)
    >>> g = spec.trace()
    >>> precision_of(g).name, precision_of(retype(g, "bf16")).name
    ('fp16', 'bf16')
    >>> retype(g, "bf16").fingerprint != g.fingerprint, retype(retype(g, "bf16"), "fp16").fingerprint == g.fingerprint
    (True, True)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .graph import opcost
from .graph.fusion import kernel_view
from .graph.opgraph import (FORWARD, FP8_CASTS, FP8_COPY_BYTES, GRAD_BYTES, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, PARAM,
                            RETYPED, UPDATE, OpGraph, OpNode, dtype_size)
from .solve.intra import weight_gradient_ops

__all__ = ["FP8_DTYPE", "NAMES", "TRACED", "Precision", "as_precision", "check_device", "precision_from_json",
           "precision_note", "precision_of", "precision_to_json", "retype", "traced_graph"]

#: The dtype an FP8 GEMM's operands are priced in (E4M3; E5M2 runs at the same rate).
FP8_DTYPE = "float8_e4m3fn"
#: How FP8 scales are taken: "tensor" (one scale per tensor, Transformer Engine's delayed scaling), "block"
#: (DeepSeek-V3: 1 x 128 tiles of activations and gradients, 128 x 128 blocks of weights).
SCALINGS = ("tensor", "block")
#: DeepSeek-V3's tile edge: an activation's scale covers 1 x BLOCK elements, a weight's BLOCK x BLOCK.
BLOCK = 128
SCALE_BYTES = 4  # one float32 scale
#: The FP8 GEMMs' dimensions must be multiples of this.
FP8_ALIGN = 16
_FLOATS = ("float32", "float16", "bfloat16")
_OUR_KEYS = (RETYPED, FP8_CASTS, GRAD_BYTES, FP8_COPY_BYTES)


@dataclass(frozen=True)
class Precision:
    """A number format: ``compute`` (the dtype of activations and of the weights' compute copies), ``grad`` (the
    dtype weight gradients are accumulated and reduced in), ``master`` (float32 master weights and optimizer state
    beside half-precision compute copies), ``matmul`` (the FP8 dtype of the linear layers' GEMMs, or None),
    ``scaling`` (FP8 scales: :data:`SCALINGS`), ``transposed`` (FP8 casts also write the transposed copy a Hopper
    FP8 GEMM of the backward reads). Get one by name with :func:`as_precision` (``"bf16"``); see the module
    docstring for what each prices.

    >>> as_precision("bf16").bytes_per_param()
    {'params': 2, 'grads': 4, 'master': 4, 'optimizer': 8, 'fp8_copies': 0}
    >>> as_precision("fp8-block").with_(transposed=False).cast_bytes(2)   # bf16 in, one FP8 copy + 4 B per 128 out
    3.03125
    """

    name: str
    compute: str
    grad: str
    master: bool
    matmul: str | None = None
    scaling: str | None = None
    transposed: bool = True

    def __post_init__(self) -> None:
        for field in ("compute", "grad"):
            if getattr(self, field) not in _FLOATS:
                raise ValueError(f"Precision.{field} must be one of {', '.join(_FLOATS)}, got "
                                 f"{getattr(self, field)!r}.")
        if self.matmul is not None and (self.matmul != FP8_DTYPE or self.scaling not in SCALINGS):
            raise ValueError(f"an FP8 Precision has matmul={FP8_DTYPE!r} and scaling one of {SCALINGS}, got "
                             f"matmul={self.matmul!r}, scaling={self.scaling!r}.")
        if self.matmul is not None and (self.compute == "float32" or not self.master):
            raise ValueError("FP8 matmuls go with half-precision compute and float32 master weights (the bf16 "
                             "recipe); give compute='bfloat16' and master=True.")
        if self.master and self.compute == "float32":
            raise ValueError("float32 compute has no master weights (they would be the weights themselves); give "
                             "master=False.")

    def with_(self, **changes: Any) -> "Precision":
        """This format with some fields changed (checked), e.g. ``with_(transposed=False)`` for FP8 GEMMs that read
        either layout (Blackwell's)."""
        return dataclasses.replace(self, **changes)

    @property
    def fp8(self) -> bool:
        """Whether the linear layers' GEMMs run in FP8."""
        return self.matmul is not None

    @property
    def copies(self) -> int:
        """FP8 copies a cast writes of a tensor: the copy, and its transpose when :attr:`transposed`."""
        return 2 if self.transposed else 1

    def scale_bytes(self, weight: bool = False) -> float:
        """Bytes of FP8 scale per element of one FP8 copy: one float32 per 1 x 128 tile of an activation or
        gradient, per 128 x 128 block of a weight (``"block"``); a per-tensor scale is a few bytes a tensor (0)."""
        if self.scaling != "block":
            return 0.0
        return SCALE_BYTES / (BLOCK * BLOCK if weight else BLOCK)

    def cast_bytes(self, src_bytes: float, weight: bool = False) -> float:
        """Bytes one cast kernel moves per element of the tensor it casts: it reads the element (``src_bytes``
        wide) and writes :attr:`copies` FP8 bytes with their scales (the amax is taken as it reads)."""
        return src_bytes + self.copies * (dtype_size(FP8_DTYPE) + self.scale_bytes(weight))

    def bytes_per_param(self) -> dict[str, float]:
        """The bytes Adam keeps per parameter of a linear layer's weight in this format, by part (as the memory
        breakdown names them): ``params`` (the compute copy), ``grads``, ``master``, ``optimizer`` (two moments),
        ``fp8_copies``."""
        master = 4 if self.master else 0
        fp8 = self.copies * (dtype_size(FP8_DTYPE) + self.scale_bytes(True)) if self.fp8 else 0
        return {"params": dtype_size(self.compute), "grads": dtype_size(self.grad), "master": master,
                "optimizer": 8, "fp8_copies": fp8}

    def describe(self) -> str:
        """One line: the format's name and what it keeps in which dtype."""
        short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
        parts = [f"{short[self.compute]} compute"]
        if self.fp8:
            scales = "per-tensor scaling" if self.scaling == "tensor" else "1x128 / 128x128 block scaling"
            parts.append(f"FP8 linear-layer matmuls ({scales})")
        parts.append(f"{short[self.grad]} gradients")
        if self.master:
            parts.append("fp32 master weights and optimizer state")
        label = "as traced" if self.name == TRACED else self.name
        return f"{label} ({', '.join(parts)})"

    def same_format(self, other: "Precision") -> bool:
        """Whether ``other`` prices the same (every field but the name)."""
        return dataclasses.replace(other, name=self.name) == self


#: The name of a format inferred from a graph that matches none of :data:`NAMES` (a bfloat16 step as JAX traces it:
#: bfloat16 gradients).
TRACED = "traced"

_NAMED = {
    "fp32": Precision("fp32", "float32", "float32", False),
    "fp16": Precision("fp16", "float16", "float16", True),
    "bf16": Precision("bf16", "bfloat16", "float32", True),
    "fp8": Precision("fp8", "bfloat16", "float32", True, FP8_DTYPE, "tensor"),
    "fp8-block": Precision("fp8-block", "bfloat16", "float32", True, FP8_DTYPE, "block"),
}
#: The formats by name, as ``precision=`` and ``--precision`` take them.
NAMES = tuple(_NAMED)


def as_precision(value) -> Precision:
    """The :class:`Precision` ``value`` names (one of :data:`NAMES`, any case), or ``value`` itself."""
    if isinstance(value, Precision):
        return value
    if isinstance(value, str):
        hit = _NAMED.get(value.strip().lower())
        if hit is not None:
            return hit
        raise ValueError(f"unknown precision {value!r}; use one of {', '.join(NAMES)}.")
    raise ValueError(f"precision must be one of {', '.join(NAMES)} (or a Precision), got a {type(value).__name__}.")


def precision_to_json(fmt: Precision) -> str | dict:
    """How a plan file holds a format: its name when it is the named format (or :data:`TRACED`), else its fields."""
    if fmt.name == TRACED or _NAMED.get(fmt.name) == fmt:
        return fmt.name
    return dataclasses.asdict(fmt)


def precision_from_json(value) -> Precision | None:
    """The format a plan file names (None: as traced, and for a file written before formats existed); a
    ValueError, one sentence, for anything else."""
    if value is None or value == TRACED:
        return None
    if isinstance(value, str):
        return as_precision(value)
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(Precision)}
        if set(value) != fields:
            raise ValueError(f"precision must have the fields {', '.join(sorted(fields))}")
        if not isinstance(value["name"], str) or not value["name"].isprintable() or len(value["name"]) > 64:
            raise ValueError("precision's name must be a short printable string")
        for key in ("master", "transposed"):
            if not isinstance(value[key], bool):
                raise ValueError(f"precision's {key} must be true or false")
        return Precision(**value)
    raise ValueError(f"precision must be one of {', '.join(NAMES)} or an object of Precision fields")


def check_device(precision: Precision, device) -> None:
    """Refuse (ValueError, one sentence) an FP8 format on a device without an FP8 rate."""
    if precision.fp8 and precision.matmul not in device.peak_flops:
        raise ValueError(f"the {device.name} has no FP8 matmul rate ({precision.matmul} is not in its peak_flops), "
                         f"so precision {precision.name!r} cannot be priced on it; plan in 'bf16' or on a device "
                         "with FP8 (e.g. dgx-h100).")


def precision_of(graph: OpGraph) -> Precision:
    """The format ``graph`` runs in: the one it was retyped to, else the one it was traced in (its largest matmul's
    dtype, whether its parameters are float32 master weights, gradients in the compute dtype as JAX traces them),
    named when it is one of :data:`NAMES` (a float16 zoo model: ``"fp16"``), else :data:`TRACED`."""
    fmt = graph.__dict__.get("precision")
    if fmt is not None:
        return fmt
    hit = graph.__dict__.get("_traced_precision")
    if hit is None:
        hit = graph.__dict__["_traced_precision"] = _traced_format(graph)
    return hit


def _traced_format(graph: OpGraph) -> Precision:
    best, compute = -1.0, "float32"
    for n in graph:
        if n.primitive in opcost.CONTRACTIONS and n.role == FORWARD and n.flops > best and n.in_dtypes:
            best, compute = n.flops, n.in_dtypes[0]
    if compute not in _FLOATS:
        compute = "float32"
    master = compute != "float32" and bool(kernel_view(graph).masters)
    for fmt in _NAMED.values():
        if not fmt.fp8 and (fmt.compute, fmt.grad, fmt.master) == (compute, compute, master):
            return fmt
    return Precision(TRACED, compute, compute, master)


def precision_note(graph: OpGraph) -> str:
    """What a plan of ``graph`` says of its number format (``CostReport.precision``, shown by ``explain()``): the
    format, and for a retyped graph that it is priced, not executed (the runtime runs the model's own step)."""
    fmt = precision_of(graph)
    if graph.__dict__.get("precision") is None:
        return fmt.describe()
    src = graph.__dict__.get("source_precision")
    traced = "" if src is None else f" ({src.describe()})" if src.name == TRACED else f" (as traced: {src.name})"
    return (f"{fmt.describe()}; priced, not executed: al.execute and al.launch run the model's own step{traced}"
            + ("; FP8 matmuls could not run on CPU devices at all" if fmt.fp8 else ""))


def traced_graph(graph: OpGraph) -> OpGraph:
    """``graph`` as it was traced: a retyped graph's operators with their traced dtypes and parameters back (the
    same fingerprint as the trace); any other graph itself."""
    if graph.__dict__.get("precision") is None:
        return graph
    tensors = dict(graph.tensors)
    for node in graph:
        before = node.params.get(RETYPED)
        if before is not None:
            for t, dt in zip(node.outputs, before):
                tensors[t] = dataclasses.replace(tensors[t], dtype=dt)
    nodes = [_renode(node, tuple(tensors[t].dtype for t in node.inputs),
                     tuple(tensors[t].dtype for t in node.outputs),
                     {k: v for k, v in node.params.items() if k not in _OUR_KEYS}, tensors) for node in graph]
    return _graph_like(graph, nodes, tensors, None)


def retype(graph: OpGraph, precision) -> OpGraph:
    """``graph`` in number format ``precision`` (a name of :data:`NAMES` or a :class:`Precision`): a new graph with
    the same operators and ids (see the module docstring for what changes); the graph itself when it already is in
    that format. A graph retyped before is retyped from its traced dtypes. A step traced without float32 master
    weights takes only float32 or its own format (its parameters are the weights it computes with), and a step traced
    in half precision without them only its own: refused in one sentence."""
    fmt = as_precision(precision)
    if graph.__dict__.get("precision") is not None and graph.__dict__["precision"] == fmt:
        return graph
    base = traced_graph(graph)
    src = precision_of(base)
    if fmt.same_format(src):
        return base
    if fmt.master and not src.master or (not src.master and src.compute != "float32"):
        what = f"{src.compute} without float32 master weights" if src.compute != "float32" else "float32"
        raise ValueError(f"precision {fmt.name!r} needs a model traced in half precision with float32 master weights, "
                         f"and this one computes in {what}; trace it in half precision (e.g. "
                         "al.models.get(name, dtype='bfloat16')) or plan it in its own format.")
    dtypes: dict[int, str] = {}
    if fmt.compute != src.compute:
        for t, info in base.tensors.items():
            p = info.producer
            if info.dtype == src.compute and p is not None and base.op(p).primitive != INPUT_PRIMITIVE:
                dtypes[t] = fmt.compute
    if fmt.grad != fmt.compute:
        for op in weight_gradient_ops(base, base.ops):
            for t in base.op(op).outputs:
                if dtypes.get(t, base.tensor(t).dtype) == fmt.compute:
                    dtypes[t] = fmt.grad
    masters = kernel_view(base).masters if fmt.master else {}
    fp8_ins, casts, fp8_copies = _fp8_plan(base, fmt, dtypes, masters) if fmt.fp8 else ({}, {}, {})
    tensors = {t: dataclasses.replace(info, dtype=dtypes[t]) if t in dtypes else info
               for t, info in base.tensors.items()}
    nodes = []
    for node in base:
        ins = tuple(fp8_ins.get((node.id, i), tensors[t].dtype) for i, t in enumerate(node.inputs))
        outs = tuple(tensors[t].dtype for t in node.outputs)
        params = dict(node.params)
        if outs != node.out_dtypes:
            params[RETYPED] = node.out_dtypes
        if node.id in casts:
            params[FP8_CASTS] = tuple(casts[node.id])
        if node.primitive == INPUT_PRIMITIVE and node.outputs and node.outputs[0] in masters:
            t = node.outputs[0]
            if fmt.grad != fmt.compute:
                params[GRAD_BYTES] = dtype_size(fmt.grad)
            if t in fp8_copies:
                params[FP8_COPY_BYTES] = fp8_copies[t]
        nodes.append(_renode(node, ins, outs, params, tensors))
    out = _graph_like(base, nodes, tensors, fmt)
    out.__dict__["source_fingerprint"] = base.fingerprint  # the trace it came from (planner.table_for accepts it)
    out.__dict__["source_precision"] = src
    return out


def _renode(node: OpNode, ins: tuple, outs: tuple, params: dict, tensors) -> OpNode:
    """A fresh copy of ``node`` (never the object itself: an operator carries its graph's kernel role) with these
    dtypes and params, its bytes read and written recomputed as the trace computes them."""
    if ins == node.in_dtypes and outs == node.out_dtypes:
        read, written = node.bytes_read, node.bytes_written
    else:
        read, written = opcost.op_bytes(
            node.primitive, [tensors[t].size * dtype_size(d) for t, d in zip(node.inputs, ins)],
            [tensors[t].size * dtype_size(d) for t, d in zip(node.outputs, outs)])
    return dataclasses.replace(node, in_dtypes=ins, out_dtypes=outs, bytes_read=read, bytes_written=written,
                               params=params)


def _graph_like(graph: OpGraph, nodes, tensors, fmt: Precision | None) -> OpGraph:
    return graph.with_nodes(nodes, tensors=tensors, precision=fmt)


#: Primitives that pick experts from a router's scores.
ROUTING_PICKS = frozenset(["top_k", "argmax", "sort"])
#: How far (forward operators, no matmul between) a router's scores travel to the pick: a softmax is five.
ROUTER_HOPS = 8


def router_gemms(g: OpGraph) -> frozenset[int]:
    """The forward GEMMs whose result picks experts (reaches a top-k, argmax or sort through forward operators other
    than matmuls): a mixture of experts' router, which stays in the compute format under FP8, as DeepSeek-V3 keeps
    its gating (technical report, section 3.3.1: the gating module in BF16/FP32)."""
    out = set()
    for node in g:
        if node.role != FORWARD or node.primitive != "dot_general":
            continue
        frontier, seen = list(node.outputs), set(node.outputs)
        for _ in range(ROUTER_HOPS):
            nxt: list = []
            for t in frontier:
                for c in g.consumers.get(t, ()):
                    reader = g.op(c)
                    if reader.role != FORWARD or reader.primitive == "dot_general":
                        continue
                    if reader.primitive in ROUTING_PICKS:
                        out.add(node.id)
                    nxt.extend(o for o in reader.outputs if o not in seen)
                    seen.update(reader.outputs)
            frontier = nxt
    return frozenset(out)


def _fp8_plan(g: OpGraph, fmt: Precision, dtypes: dict[int, str], masters) -> tuple[dict, dict, dict]:
    """The FP8 GEMMs of ``g`` (see the module docstring): ``({(op, input): FP8 dtype}, {op: cast multiples per
    input}, {master parameter tensor: FP8 copy bytes per element})``."""
    def dtype(t: int) -> str:
        return dtypes.get(t, g.tensor(t).dtype)

    layers = list(g.layers)
    inner = set(layers[1:-1])  # the embedding and the output head stay in bf16
    origin: dict[int, int | None] = {t: t for t in g.inputs if g.tensor(t).kind == PARAM}  # weight -> its parameter
    for node in g:
        if node.role != FORWARD or node.primitive in (INPUT_PRIMITIVE, OUTPUT_PRIMITIVE):
            continue
        srcs = {origin[t] for t in node.inputs if t in origin}
        if srcs and all(t in origin or g.tensor(t).producer is None for t in node.inputs):
            one = srcs.pop() if len(srcs) == 1 else None
            for t in node.outputs:
                origin[t] = one

    def aligned(node: OpNode) -> bool:
        _b, m, n, k = opcost.gemm_dims(node.primitive, node.in_shapes, node.out_shapes, node.params)
        return all(int(d) % FP8_ALIGN == 0 for d in (m, n, k))

    routers = router_gemms(g)

    def matmul(node: OpNode) -> bool:
        return node.primitive == "dot_general" and len(node.inputs) == 2 and node.layer in inner and \
            node.id not in routers and all(dtype(t) == fmt.compute for t in node.inputs) and aligned(node)

    weights: dict[int, int] = {}  # weight tensor -> its master parameter
    acts: set[int] = set()
    gemms: list[int] = []
    for node in g:
        if node.role != FORWARD or not matmul(node):
            continue
        held = [t for t in node.inputs if t in origin]
        if len(held) != 1 or origin[held[0]] not in masters:
            continue
        w = held[0]
        x = node.inputs[1 - node.inputs.index(w)]
        if g.tensor(x).producer is None:
            continue
        weights[w] = origin[w]  # type: ignore[assignment]  # checked: a master parameter
        acts.add(x)
        gemms.append(node.id)
    for node in g:
        if node.role == FORWARD or not matmul(node):
            continue
        held = [t for t in node.inputs if t in origin]
        if (len(held) == 1 and held[0] in weights) or (not held and any(t in acts for t in node.inputs)):
            gemms.append(node.id)  # a data gradient (reads the weight) or a weight gradient (reads the activation)
    gemms.sort()
    fp8_ins = {(op, i): FP8_DTYPE for op in gemms for i in range(2)}
    casts: dict[int, list[float]] = {}
    cast_done: set[int] = set()
    first_reader: dict[int, tuple[int, int]] = {}  # parameter -> (the first FP8 GEMM reading its weight, input)
    for op in gemms:
        node = g.op(op)
        for i, t in enumerate(node.inputs):
            if t in weights:
                first_reader.setdefault(weights[t], (op, i))
            elif t not in cast_done:  # an activation or a gradient: cast per microbatch, by its first FP8 reader
                cast_done.add(t)
                casts.setdefault(op, [0.0, 0.0])[i] = fmt.cast_bytes(dtype_size(dtype(t))) / dtype_size(FP8_DTYPE)
    fp8_copies: dict[int, float] = {}
    for p, (op, i) in first_reader.items():
        fp8_copies[p] = fmt.copies * (dtype_size(FP8_DTYPE) + fmt.scale_bytes(True))
        moved = fmt.cast_bytes(dtype_size(fmt.compute), weight=True)  # per element of the weight
        update = next((c for c in g.consumers.get(p, ()) if g.op(c).role == UPDATE), None)
        if update is None:  # no optimizer update writes it (a frozen weight): cast with its first FP8 GEMM
            casts.setdefault(op, [0.0, 0.0])[i] += moved / dtype_size(FP8_DTYPE)
            continue
        unode = g.op(update)
        row = casts.setdefault(update, [0.0] * len(unode.inputs))
        row[unode.inputs.index(p)] += moved / dtype_size(dtype(p))  # once a step, on the weight the update holds
    return fp8_ins, casts, fp8_copies
