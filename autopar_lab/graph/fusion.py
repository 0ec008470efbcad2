"""Kernels, not operators: the kernels a compiler runs for a training step, as a view on its operator graph.

XLA (like every ML compiler) does not launch one kernel per operator. :func:`kernel_view` groups a graph's operators
the way it does, and says for every operator how it runs inside its kernel:

- elementwise, convert and layout operators fuse into their consumer's kernel when all their consumers sit in one
  kernel (a *loop* fusion); reductions fuse the elementwise work that feeds them (a *reduce* fusion) and end their
  kernel; broadcasts, reshapes, iotas and scalars are recomputed inside every kernel that reads them (never
  written to memory);
- a matmul (or convolution) is a library call whose elementwise consumers (bias, activation, residual add) run as
  its epilogue (a *gemm* kernel);
- with ``fused_attention``, attention runs as one kernel forward and one backward (flash attention: scores, mask
  and softmax stay on chip, the backward recomputes them; an *attention* kernel);
- gathers, scatters, sorts and unknown operators are kernels of their own (*library*).

Each operator gets an :class:`OpKernel`: which of its inputs its kernel reads from memory and which outputs it
writes (tensors inside a kernel cost no traffic), whether it is the kernel's root (which pays the launch) and, for
gemm and attention kernels, whether it is *absorbed*: its FLOPs and memory traffic are priced once, with the
kernel's root, as multiples of the root's own (``extra_*``). So the sum of the operators' costs is the kernel's
cost, and the intra-operator ILP, which prices operators one by one, optimises what the plan reports.

The view also says which forward tensors the backward reads (:attr:`KernelView.saved`, as materialised: through
broadcasts and reshapes to what a kernel wrote), which tensors are computed from the parameters alone
(:attr:`KernelView.weight_derived`: they do not grow with the microbatch) and which parameters are fp32 master
weights of a lower-precision step (:attr:`KernelView.masters`).

>>> import jax, jax.numpy as jnp
>>> from autopar_lab.graph.capture import trace
>>> g = trace(lambda w, b, x: jnp.tanh(x @ w + b), jnp.zeros((8, 8)), jnp.zeros(8), jnp.zeros((4, 8)))
>>> v = kernel_view(g)
>>> [(k.kind, [g.op(o).primitive for o in k.ops]) for k in v.kernels]   # tanh: the matmul's epilogue
[('gemm', ['dot_general', 'tanh'])]
>>> g = trace(lambda w, b, x: jnp.sum(jnp.tanh(x @ w + b)), jnp.zeros((8, 8)), jnp.zeros(8), jnp.zeros((4, 8)))
>>> v = kernel_view(g)
>>> [(k.kind, [g.op(o).primitive for o in k.ops]) for k in v.kernels]   # a reduction reads it: XLA's input fusion
[('gemm', ['dot_general']), ('reduce', ['tanh', 'reduce_sum'])]
>>> v.roles[5].kind, v.roles[6].kind   # the bias add is recomputed where it is read; tanh runs before the sum
('inline', 'reduce')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import opcost
from .opgraph import (BACKWARD, BATCH, FORWARD, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, PARAM, RETYPED, UPDATE, OpGraph,
                      OpNode, dtype_size)

__all__ = ["CHAIN_PRIMITIVE", "Kernel", "KernelView", "OpKernel", "KINDS", "attach_kernel_roles", "is_chain_link",
           "kernel_role", "kernel_view"]

#: The kinds of kernel.
KINDS = ("gemm", "attention", "loop", "reduce", "library")

# Recomputed inside every kernel that reads them at no cost (XLA duplicates them into their consumers' fusions).
_CHEAP = frozenset(
    """broadcast_in_dim reshape squeeze expand_dims iota stop_gradient optimization_barrier sharding_constraint
    pjit_sharding mesh_cast pvary name pipeline_boundary bitcast_convert_type device_put""".split()
)
# Cheap elementwise work and slices: recomputed inside each consumer's kernel from their operands when that reads no
# more than writing and reading them back would (XLA's producer duplication), else a loop kernel's member.
_DUP = frozenset(
    """add sub mul neg abs sign max min select_n eq ne lt le gt ge and or not xor convert_element_type integer_pow
    square clamp add_any copy copy_p floor ceil round div slice dynamic_slice scan_slice""".split()
)
# Loop-fusible: the other elementwise arithmetic (transcendental: not duplicated), converts and layout changes.
_LOOP = (opcost.ELEMENTWISE | frozenset(
    """logistic erf_inv reduce_precision transpose pad concatenate rev dynamic_update_slice split scan_stack
    full_like""".split()
)) - _CHEAP - _DUP
_REDUCE = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin"
                    .split())
# Operators that read only the part of their first operand they return.
_SLICING = frozenset(["slice", "dynamic_slice", "scan_slice", "gather"])
_FREE, _CHEAP_CAT, _DUP_CAT, _LOOP_CAT, _REDUCE_CAT, _GEMM_CAT, _LIBRARY_CAT = range(7)
# A duplicated producer may read up to this multiple of what it writes (a bias vector or scalar besides its input).
_DUP_READ_RATIO = 1.25


@dataclass(frozen=True)
class OpKernel:
    """How one operator runs inside its kernel.

    ``reads[i]``: the fraction of input ``i``'s bytes its kernel reads from memory for this operator (0 inside the
    kernel, 1 read, less when it reads a broadcast's small operand); ``writes[j]``: 1 if output ``j`` is written to
    memory. ``absorbed``: its memory traffic is priced with the kernel's root (an epilogue, a flash-attention step);
    it prices only its own elementwise work (none in a flash kernel, whose efficiency covers it). A root of a gemm or
    attention kernel prices, beyond its own FLOPs and traffic, ``extra_mm`` times its FLOPs at the matmul (or
    attention) rate, ``extra_vec`` times its FLOPs at the elementwise rate (0 for the kernels built here), and
    ``extra_bytes`` times its output bytes of memory traffic; ``work`` scales its matmul FLOPs (0.5: a causal flash
    kernel skips the masked half).
    """

    kernel: int = field(compare=False)  # the kernel's index: equal roles of identical layers compare equal
    kind: str
    root: bool
    absorbed: bool
    reads: tuple[float, ...]
    writes: tuple[float, ...]
    extra_mm: float = 0.0
    extra_vec: float = 0.0
    extra_bytes: float = 0.0
    work: float = 1.0


@dataclass(frozen=True)
class Kernel:
    """One kernel: its operators (graph order), its kind, the operator that roots it, its layer and role."""

    id: int
    kind: str
    ops: tuple[int, ...]
    root: int
    layer: str | None
    role: str


@dataclass(frozen=True)
class KernelView:
    """The kernels of a graph and every operator's part in them (see the module docstring)."""

    fused_attention: bool
    kernels: tuple[Kernel, ...]
    # kernel -1: "inline" operators recomputed inside their consumers' kernels, "free" ones folded into them at no
    # cost (broadcasts, reshapes, arithmetic on scalars; step inputs and outputs), "dead" ones no output depends on
    roles: Mapping[int, OpKernel]
    saved: frozenset[int]
    weight_derived: frozenset[int]
    masters: Mapping[int, float]
    # what a framework whose fused kernels recompute their insides keeps (:func:`kernel_saved`); ``saved`` if None
    kernel_saved: frozenset[int] | None = None

    def kept(self, library_kernels: bool = False) -> frozenset[int]:
        """The forward tensors the backward keeps: JAX autodiff's (``saved``), or with ``library_kernels`` a
        fused-kernel library's (``kernel_saved``: :func:`kernel_saved`)."""
        return self.kernel_saved if library_kernels and self.kernel_saved is not None else self.saved

    def kernels_of(self, role: str) -> list[Kernel]:
        return [k for k in self.kernels if k.role == role]


# ----------------------------------------------------------------------------------------------------------------


def _category(node: OpNode) -> int:
    p = node.primitive
    if p in (INPUT_PRIMITIVE, OUTPUT_PRIMITIVE):
        return _FREE
    if p in opcost.CONTRACTIONS:
        return _GEMM_CAT
    if p == "convert_element_type" and RETYPED in node.params and node.in_dtypes[:1] == node.out_dtypes[:1]:
        return _CHEAP_CAT  # a cast a number format made a no-op (fp32 compute's copy of an fp32 weight): dropped
    if p in _CHEAP or (p in (_LOOP | _DUP) and all(math.prod(s) <= 1 for s in (*node.in_shapes, *node.out_shapes))):
        return _CHEAP_CAT  # layout changes, and arithmetic on scalars (folded into whatever kernel reads it)
    if p in _REDUCE:
        return _REDUCE_CAT
    if p in _DUP:
        return _DUP_CAT
    if p in _LOOP:
        return _LOOP_CAT
    return _LIBRARY_CAT


class _Builder:
    """Groups a graph's operators into kernels (see the module docstring); one use per view."""

    def __init__(self, graph: OpGraph, fused_attention: bool, eager: bool = False,
                 categories: list[int] | None = None):
        self.g = graph
        self.fused = fused_attention
        self.eager = eager
        self.cat = list(categories) if categories is not None else [_category(n) for n in graph]
        self.step_outputs = frozenset(graph.outputs)
        # tensor -> bytes, and dtype name -> bytes per element: read many times per tensor (sources, traffic), and
        # TensorInfo.nbytes costs a numpy reduction each time
        self._nbytes: dict[int, int] = {}
        self._itemsize: dict[str, int] = {}
        # Operators no output depends on (the jvp's leftovers): the compiler removes them; they cost nothing.
        self.live = _live_ops(graph)
        for op in graph.ops:
            if op not in self.live:
                self.cat[op] = _FREE
        # Operators recomputed inside their consumers' kernels (no kernel, no memory traffic of their own).
        self.inline: set[int] = {op for op in graph.ops if self.cat[op] == _CHEAP_CAT}
        self.group: dict[int, int] = {}  # op -> group index
        self.kinds: list[str] = []
        self.members: list[list[int]] = []
        self.roots: list[int] = []
        self.recomputed: set[int] = set()  # forward tensors a flash backward recomputes instead of reading
        self.work: dict[int, float] = {}  # attention group -> work scale
        self.recompute_flops: dict[int, float] = {}  # backward attention group -> forward matmul FLOPs it redoes
        self._sources: dict[int, dict[int, int]] = {}
        self._backward_by_layer: dict[str | None, list[OpNode]] | None = None

    # -- helpers ---------------------------------------------------------------------------------------------
    def nbytes(self, t: int) -> int:
        """Bytes of tensor ``t`` (its TensorInfo.nbytes)."""
        v = self._nbytes.get(t)
        if v is None:
            info = self.g.tensor(t)
            size = self._itemsize.get(info.dtype)
            if size is None:
                size = self._itemsize[info.dtype] = dtype_size(info.dtype)
            v = self._nbytes[t] = math.prod(info.shape) * size
        return v

    def consumers(self, t: int, through_inline: bool = True) -> list[int]:
        """The live operators that read ``t``, looking through operators recomputed in place (all of them, or with
        ``through_inline=False`` only the free ones: broadcasts, reshapes)."""
        out, todo, seen = [], [t], set()
        while todo:
            x = todo.pop()
            for c in self.g.consumers.get(x, ()):
                if c in seen or c not in self.live:
                    continue
                seen.add(c)
                if self.cat[c] == _CHEAP_CAT or (through_inline and c in self.inline):
                    todo.extend(self.g.op(c).outputs)
                else:
                    out.append(c)
        return out

    def sources(self, t: int) -> dict[int, int]:
        """What a kernel reads from memory for ``t``: {tensor: bytes}, through the producers it recomputes
        (a broadcast reads its operand; a duplicated add reads both of its operands; a slice only its part)."""
        hit = self._sources.get(t)
        if hit is not None:
            return hit
        self._sources[t] = {}  # guards a cycle (there is none in a graph) and marks the work in progress
        g = self.g
        p = g.tensor(t).producer
        out: dict[int, int] = {}
        if p is None:
            pass  # a literal: folded into the kernel
        elif p not in self.inline:
            out = {t: self.nbytes(t)}
        else:
            node = g.op(p)
            ins = [x for x in node.inputs if g.tensor(x).producer is not None]
            if node.primitive in _SLICING and ins:
                # reads only what it returns of its first operand (the rest of its operands are indices)
                first = self.sources(ins[0])
                total = sum(first.values()) or 1
                share = min(sum(self.nbytes(o) for o in node.outputs) / total, 1.0)
                out = {k: int(v * share) for k, v in first.items()}
                ins = ins[1:]
            elif self.cat[p] == _CHEAP_CAT:
                ins = ins[:1]  # a broadcast or reshape reads its one operand; a scalar's operands are scalars
            for x in ins:
                for k, v in self.sources(x).items():
                    out[k] = max(out.get(k, 0), v)
        self._sources[t] = out
        return out

    def new_group(self, kind: str, op: int) -> int:
        gid = len(self.kinds)
        self.kinds.append(kind)
        self.members.append([op])
        self.roots.append(op)
        self.group[op] = gid
        return gid

    def join(self, op: int, gid: int) -> None:
        self.group[op] = gid
        self.members[gid].append(op)

    def fusible_consumer(self, c: int, t: int) -> bool:
        """Whether consumer ``c`` (in a kernel already) can compute its operand ``t`` itself instead of reading it."""
        gid = self.group.get(c)
        if gid is None or self.cat[c] == _FREE:
            return False
        kind = self.kinds[gid]
        if kind in ("loop", "reduce"):
            return True
        # a matmul's epilogue can take elementwise work on its other operands; the matmul's own operands it reads
        return kind == "gemm" and c != self.roots[gid] and self.cat[c] not in (_GEMM_CAT, _LIBRARY_CAT)
    # -- flash attention ---------------------------------------------------------------------------------------
    def attention(self) -> None:
        g = self.g
        dots = [n for n in g if n.primitive == "dot_general" and n.role == FORWARD and _has_batch(n)]
        claimed: set[int] = set()
        for d2 in dots:
            for t in d2.inputs:
                d1, chain = self._score_chain(t, d2.layer)
                if d1 is None or d1.id in claimed or d2.id in claimed:
                    continue
                score = tuple(sorted(d1.out_shapes[0]))
                fwd = {d1.id, d2.id} | chain
                claimed |= fwd
                fg = len(self.kinds)
                self.kinds.append("attention")
                self.members.append(sorted(fwd))
                self.roots.append(d2.id)
                for op in fwd:
                    self.group[op] = fg
                    self.inline.discard(op)
                causal = any(_is_iota_mask(g, self.cat, c) for op in chain for c in g.op(op).inputs)
                self.work[fg] = 0.5 if causal else 1.0
                bwd = self._backward_region(d1, score)
                if bwd:
                    bg = len(self.kinds)
                    self.kinds.append("attention")
                    ordered = sorted(bwd)
                    self.members.append(ordered)
                    big = max((o for o in ordered if g.op(o).primitive == "dot_general"), key=lambda o: g.op(o).flops,
                              default=ordered[-1])
                    self.roots.append(big)
                    for op in ordered:
                        self.group[op] = bg
                        self.inline.discard(op)
                    self.work[bg] = self.work[fg]
                    self.recompute_flops[bg] = d1.flops
                    for op in fwd:
                        for t2 in g.op(op).outputs:
                            if any(c in bwd for c in g.consumers.get(t2, ())):
                                self.recomputed.add(t2)
                break

    def _score_chain(self, t: int, layer: str | None) -> tuple[OpNode | None, set[int]]:
        """Walk back from a matmul operand through elementwise, reduce and recomputed operators to the matmul that
        made the attention scores; (that matmul, the operators between) when the walk passes a softmax."""
        g = self.g
        chain: set[int] = set()
        todo, seen = [t], set()
        found: OpNode | None = None
        for _ in range(400):
            if not todo:
                break
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            p = g.tensor(x).producer
            if p is None:
                continue
            node = g.op(p)
            if node.primitive == "dot_general" and node.role == FORWARD:
                if _has_batch(node) and found is None:
                    found = node
                continue
            if self.cat[p] in (_LOOP_CAT, _DUP_CAT, _REDUCE_CAT, _CHEAP_CAT) and node.role == FORWARD and \
                    node.layer == layer:
                chain.add(p)
                todo.extend(node.inputs)
        if found is None:
            return None, set()
        prims = {g.op(o).primitive for o in chain}
        if not ({"exp", "exp2"} & prims and {"reduce_max", "reduce_sum"} & prims):
            return None, set()
        # only the operators on a path from the scores to the operand (the mask's construction stays outside)
        down = self._descendants(found.id, chain)
        return found, chain & down

    def _descendants(self, op: int, within: set[int]) -> set[int]:
        out, todo = set(), [op]
        while todo:
            x = todo.pop()
            for t in self.g.op(x).outputs:
                for c in self.g.consumers.get(t, ()):
                    if c in within and c not in out:
                        out.add(c)
                        todo.append(c)
        return out

    def _backward_region(self, d1: OpNode, score: tuple) -> set[int]:
        """The backward operators of ``d1``'s layer that produce or read a tensor of the scores' shape (and the row
        reductions between them): one flash backward kernel."""
        g = self.g
        layer = d1.layer

        def scoreish(shape) -> bool:
            return tuple(sorted(shape)) == score

        if self._backward_by_layer is None:  # once per view, not once per attention (a scan of the whole graph)
            self._backward_by_layer = {}
            for n in g:
                if n.role == BACKWARD:
                    self._backward_by_layer.setdefault(n.layer, []).append(n)
        mine = self._backward_by_layer.get(layer, [])  # graph order, as the scans below need
        region = {n.id for n in mine if n.role == BACKWARD and n.layer == layer and n.primitive != OUTPUT_PRIMITIVE and
                  self.cat[n.id] != _FREE and (any(scoreish(s) for s in n.out_shapes) or
                                               any(scoreish(s) for s in n.in_shapes))}
        if not region:
            return set()
        # row statistics of the softmax backward: read from the region and feeding back into it
        for _ in range(4):
            grown = False
            for n in mine:
                if n.id in region or n.role != BACKWARD or n.layer != layer or self.cat[n.id] in (_FREE, _GEMM_CAT,
                                                                                                   _LIBRARY_CAT):
                    continue
                ins = any(g.tensor(t).producer in region for t in n.inputs)
                outs = any(c in region for t in n.outputs for c in g.consumers.get(t, ()))
                if ins and outs:
                    region.add(n.id)
                    grown = True
            if not grown:
                break
        return {o for o in region if self.group.get(o) is None}

    # -- fusion ------------------------------------------------------------------------------------------------
    def fuse(self) -> None:
        g = self.g
        for op in reversed(g.ops):
            c = self.cat[op]
            if op in self.group or c in (_FREE, _CHEAP_CAT):
                continue
            node = g.op(op)
            if self.eager:  # no compiler: every operator its own kernel (an attention kernel stays whole)
                self.new_group({_REDUCE_CAT: "reduce", _LIBRARY_CAT: "library", _GEMM_CAT: "gemm"}.get(c, "loop"), op)
                continue
            if c == _REDUCE_CAT:
                self.new_group("reduce", op)
                continue
            if c == _LIBRARY_CAT:
                self.new_group("library", op)
                continue
            cons = [x for t in node.outputs for x in self.consumers(t)]
            groups = {self.group.get(x) for x in cons}
            external = not cons or None in groups or any(self.cat[x] == _FREE for x in cons) or \
                any(t in self.step_outputs for t in node.outputs)
            if c == _DUP_CAT and not external and \
                    all(self.fusible_consumer(x, t) for t in node.outputs for x in self.consumers(t)):
                read = sum(v for x in node.inputs for v in self.sources(x).values()) if node.primitive not in \
                    _SLICING else sum(self.nbytes(t) for t in node.outputs)
                if read <= _DUP_READ_RATIO * sum(self.nbytes(t) for t in node.outputs):
                    self.inline.add(op)
                    for t in node.outputs:
                        self._sources.pop(t, None)
                    continue
            if not external and len(groups) == 1:
                (gid,) = groups
                assert gid is not None  # a group of this kernel, not "no group"
                kind = self.kinds[gid]
                if c in (_LOOP_CAT, _DUP_CAT) and kind in ("loop", "reduce"):
                    self.join(op, gid)
                    continue
                if c == _GEMM_CAT and kind == "loop":
                    self.kinds[gid] = "gemm"
                    self.roots[gid] = op
                    self.join(op, gid)
                    continue
            self.new_group("gemm" if c == _GEMM_CAT else "loop", op)

    # -- roles -------------------------------------------------------------------------------------------------
    def _traffic(self, gid: int) -> dict[int, tuple[tuple[float, ...], tuple[float, ...]]]:
        """Per member: the bytes it reads per input (as a multiple of that input's bytes; each tensor read once
        per kernel) and whether it writes each output."""
        g = self.g
        seen: set[int] = set()
        out = {}
        for op in sorted(self.members[gid]):
            node = g.op(op)
            reads = []
            for k, t in enumerate(node.inputs):
                own = self.nbytes(t)
                if node.primitive in _SLICING and k == 0:
                    src = {x: min(v, sum(self.nbytes(o) for o in node.outputs)) for x, v in self.sources(t).items()}
                elif node.primitive in _SLICING:
                    src = {}  # indices
                else:
                    src = self.sources(t)
                new = {x: v for x, v in src.items() if x not in seen and x not in self.recomputed and
                       self.group.get(g.tensor(x).producer) != gid}  # type: ignore[arg-type]  # None: no group
                seen.update(new)
                reads.append(sum(new.values()) / own if own else 0.0)
            writes = []
            for t in node.outputs:
                cons = self.consumers(t)
                leaves = any(self.group.get(c) != gid or self.cat[c] == _FREE for c in cons) or t in self.step_outputs
                writes.append(1.0 if leaves and t not in self.recomputed else 0.0)
            out[op] = (tuple(reads), tuple(writes))
        return out

    def roles(self) -> tuple[tuple[Kernel, ...], dict[int, OpKernel]]:
        g = self.g
        kernels = []
        order = sorted(range(len(self.kinds)), key=lambda k: min(self.members[k]))
        roles: dict[int, OpKernel] = {}
        for new, gid in enumerate(order):
            ops = sorted(self.members[gid])
            kind, root = self.kinds[gid], self.roots[gid]
            rnode = g.op(root)
            kernels.append(Kernel(new, kind, tuple(ops), root, rnode.layer, rnode.role))
            raw = self._traffic(gid)
            if kind in ("gemm", "attention"):
                mm = vec = nbytes = 0.0
                for op in ops:
                    if op == root:
                        continue
                    node = g.op(op)
                    reads, writes = raw[op]
                    if node.primitive in opcost.CONTRACTIONS:
                        mm += node.flops
                    else:
                        vec += node.flops
                    nbytes += sum(f * self.nbytes(t) for f, t in zip(reads, node.inputs))
                    nbytes += sum(f * self.nbytes(t) for f, t in zip(writes, node.outputs))
                    roles[op] = OpKernel(new, kind, False, True, tuple(0.0 for _ in reads),
                                         tuple(0.0 for _ in writes))
                mm += self.recompute_flops.get(gid, 0.0)
                vec = 0.0  # absorbed operators price their own elementwise work (a flash kernel's is in its efficiency)
                own_flops = rnode.flops or 1.0
                own_out = sum(self.nbytes(t) for t in rnode.outputs) or 1
                reads, writes = raw[root]
                roles[root] = OpKernel(new, kind, True, False, reads, writes, extra_mm=mm / own_flops,
                                       extra_vec=vec / own_flops, extra_bytes=nbytes / own_out,
                                       work=self.work.get(gid, 1.0))
            else:
                for op in ops:
                    reads, writes = raw[op]
                    roles[op] = OpKernel(new, kind, op == root, False, reads, writes)
        for op in g.ops:
            if op in roles:
                continue
            node = g.op(op)
            kind = "dead" if op not in self.live else "free" if self.cat[op] in (_FREE, _CHEAP_CAT) else "inline"
            roles[op] = OpKernel(-1, kind, False, kind == "dead", tuple(0.0 for _ in node.inputs),
                                 tuple(0.0 for _ in node.outputs))
        return tuple(kernels), roles

    # -- memory ------------------------------------------------------------------------------------------------
    def memory(self) -> tuple[frozenset[int], frozenset[int], dict[int, float]]:
        g = self.g
        # computed from parameters (and constants) alone: does not grow with the batch
        batchy: set[int] = {t for t in g.inputs if g.tensor(t).kind == BATCH}
        for node in g:
            if any(t in batchy for t in node.inputs) or \
                    (node.primitive == INPUT_PRIMITIVE and any(g.tensor(t).kind == BATCH for t in node.outputs)):
                batchy.update(node.outputs)
        weight = frozenset(t for t in g.tensors if t not in batchy and (p := g.tensor(t).producer) is not None and
                           g.op(p).role == FORWARD and g.op(p).primitive != INPUT_PRIMITIVE)
        saved: set[int] = set()
        for node in g:
            if node.role != BACKWARD or node.id not in self.live:
                continue
            for t in node.inputs:
                p = g.tensor(t).producer
                if p is None or g.op(p).role != FORWARD:
                    continue
                for src in self.sources(t):
                    sp = g.tensor(src).producer
                    if src in self.recomputed or sp is None or g.op(sp).primitive == INPUT_PRIMITIVE or \
                            g.op(sp).role != FORWARD:
                        continue  # recomputed, or a step input (counted where the inputs are)
                    saved.add(src)
        masters: dict[int, float] = {}
        for t in g.inputs:
            info = g.tensor(t)
            if info.kind != PARAM or not info.dtype.startswith("float") or dtype_size(info.dtype) < 4:
                continue
            cons = [c for c in self.consumers(t, through_inline=False) if g.op(c).role == FORWARD]
            narrow = [dtype_size(g.op(c).out_dtypes[0]) for c in cons
                      if g.op(c).primitive == "convert_element_type" and g.op(c).out_dtypes]
            if cons and len(narrow) == len(cons) and max(narrow) < dtype_size(info.dtype):
                masters[t] = max(narrow) / dtype_size(info.dtype)
        return frozenset(saved), weight, masters


def _live_ops(graph: OpGraph) -> set[int]:
    """The operators some output of the step depends on."""
    live: set[int] = set()
    todo = [n.id for n in graph if n.primitive == OUTPUT_PRIMITIVE]
    outs = {graph.tensor(t).producer for t in graph.outputs}
    todo += [p for p in outs if p is not None]
    while todo:
        x = todo.pop()
        if x in live:
            continue
        live.add(x)
        for t in graph.op(x).inputs:
            p = graph.tensor(t).producer
            if p is not None and p not in live:
                todo.append(p)
    return live


def _has_batch(node: OpNode) -> bool:
    dn: Any = node.params.get("dimension_numbers")
    try:
        return bool(dn[1][0])
    except (TypeError, IndexError):
        return False


def _is_iota_mask(graph: OpGraph, cats: list[int], t: int, depth: int = 8) -> bool:
    """Whether ``t`` is a comparison of two iotas (a causal or banded mask), looking through cheap operators."""
    p = graph.tensor(t).producer
    if p is None or depth == 0:
        return False
    node = graph.op(p)
    if node.primitive in ("ge", "gt", "le", "lt"):
        return all(_from_iota(graph, x, 6) for x in node.inputs)
    if cats[p] in (_CHEAP_CAT, _LOOP_CAT, _DUP_CAT):
        return any(_is_iota_mask(graph, cats, x, depth - 1) for x in node.inputs)
    return False


def _from_iota(graph: OpGraph, t: int, depth: int) -> bool:
    p = graph.tensor(t).producer
    if p is None:
        return True  # a literal offset
    node = graph.op(p)
    if node.primitive == "iota":
        return True
    if depth == 0 or node.primitive not in ("add", "sub", "broadcast_in_dim", "reshape", "convert_element_type"):
        return False
    return all(_from_iota(graph, x, depth - 1) for x in node.inputs)


def kernel_view(graph: OpGraph, fused_attention: bool = False, eager: bool = False) -> KernelView:
    """The kernels of ``graph`` (see the module docstring); computed once per graph, attention choice and
    execution. ``eager``: no compiler fuses anything (PyTorch without ``torch.compile``): every operator but the
    free and cheap layout ones (views, broadcasts) is a kernel of its own, and a flash-attention kernel (a library
    call) stays whole. Which forward tensors the backward keeps (``saved``) is the compiled view's in both.

    >>> import jax.numpy as jnp
    >>> from autopar_lab.graph.capture import trace
    >>> g = trace(lambda w, b, x: jnp.tanh(x @ w + b), jnp.zeros((8, 8)), jnp.zeros(8), jnp.zeros((4, 8)))
    >>> [k.kind for k in kernel_view(g, eager=True).kernels]   # the bias add and tanh: kernels of their own
    ['gemm', 'loop', 'loop']
    """
    memo = graph.__dict__.setdefault("_kernel_views", {})
    key: bool | tuple[bool, str] = bool(fused_attention) if not eager else (bool(fused_attention), "eager")
    if key not in memo:
        # the operators' categories do not depend on the view: computed once for the (up to four) views of a graph
        categories = memo.get("categories")
        if categories is None:
            categories = memo["categories"] = [_category(n) for n in graph]
        b = _Builder(graph, bool(fused_attention), bool(eager), categories)
        if fused_attention:
            b.attention()
        b.fuse()
        kernels, roles = b.roles()
        if eager:  # what autodiff keeps does not depend on how the kernels run: the compiled view's
            compiled = kernel_view(graph, fused_attention)
            memo[key] = KernelView(bool(fused_attention), kernels, roles, compiled.saved, compiled.weight_derived,
                                   compiled.masters, compiled.kernel_saved)
        else:
            saved, weight, masters = b.memory()
            memo[key] = KernelView(bool(fused_attention), kernels, roles, saved, weight, masters,
                                   kernel_saved(graph, kernels, roles, saved, weight))
    return memo[key]


def kernel_saved(graph: OpGraph, kernels, roles: Mapping[int, OpKernel], saved: frozenset[int],
                 weight: frozenset[int]) -> frozenset[int]:
    """What the backward keeps when each fused kernel's backward recomputes the elementwise values inside it from
    the kernel's inputs, as a fused-kernel library does (Megatron-LM's Transformer Engine and fused bias-GeLU,
    SwiGLU and norm kernels save their inputs and a norm's statistics), where JAX's autodiff keeps every value its
    backward reads (a tanh-GeLU's tanh, a SiLU's sigmoid, a norm's normalised copy: 44 and 56 bytes a token and
    hidden unit for a GPT and a Llama layer against Korthikanti et al.'s 34 and Megatron's ~32).

    A library's kernel boundaries are not XLA's: each matmul, attention and norm is a kernel that keeps its own
    input, and the elementwise work between them one fused kernel that keeps its inputs. So a tensor of ``saved`` is
    dropped when elementwise work computes it and no forward matmul, attention, library call or reduction reads it,
    directly or through values its kernel recomputes inline (what those read, their kernels keep: a norm keeps its
    input, the residual sum, so a pipeline stage's last layer keeps nothing to recompute the output it sends),
    and it can be recomputed from values that stay kept: walking back
    through elementwise work and free layout changes to kept tensors, parameters, step inputs, values computed from
    parameters alone, or the output of a matmul, attention or reduction, which is kept instead (the fused kernel's
    input).

    >>> import jax, jax.numpy as jnp
    >>> from autopar_lab.graph.capture import trace
    >>> def loss(w, x):   # a tanh-GeLU's backward reads its tanh; a fused kernel recomputes it from x @ w
    ...     y = x @ w
    ...     return jnp.sum(0.5 * y * (1 + jnp.tanh(0.79788 * (y + 0.044715 * y ** 3))))
    >>> g = trace(lambda w, x: jax.value_and_grad(loss)(w, x), jnp.zeros((8, 8)), jnp.zeros((4, 8)))
    >>> v = kernel_view(g)
    >>> sorted(g.op(g.tensor(t).producer).primitive for t in v.saved - v.kernel_saved)
    ['tanh']
    """
    known = graph.__dict__.get("_kernel_views", {}).get("categories")  # kernel_view's, when it made them
    cat = {op: known[op] if known is not None else _category(graph.op(op)) for op in roles}
    elementwise = {op for op, c in cat.items() if c in (_DUP_CAT, _LOOP_CAT)}
    library = {op for op, c in cat.items() if c in (_GEMM_CAT, _LIBRARY_CAT, _REDUCE_CAT)} | {
        op for k in kernels if k.kind == "attention" for op in k.ops}

    def read_by_library(t: int, seen: set[int]) -> bool:
        # through the operators a kernel recomputes inline (a norm's fp32 convert and square before its reduction:
        # a norm kernel keeps its input, the residual sum, as Transformer Engine's norms do)
        for c in graph.consumers.get(t, ()):
            if graph.op(c).role != FORWARD or c in seen:
                continue
            seen.add(c)
            if c in library:
                return True
            r = roles.get(c)
            if r is not None and r.kind == "inline" and any(read_by_library(u, seen) for u in graph.op(c).outputs):
                return True
        return False

    def recomputed(t: int) -> bool:
        return not read_by_library(t, set())

    drop = {t for t in saved if (p := graph.tensor(t).producer) is not None and p in elementwise and
            p not in library and recomputed(t)}
    keep = set(saved - drop)

    def leaves(t: int, seen: set[int]) -> list[int]:
        """The tensors ``t`` is recomputed from: through elementwise work and free layout changes, down to kept
        values, parameters, step inputs and what a matmul, attention or reduction wrote."""
        out: list[int] = []
        p = graph.tensor(t).producer
        if p is None:  # a step input: kept with the inputs
            return out
        for u in graph.op(p).inputs:
            if u in seen:
                continue
            seen.add(u)
            q = graph.tensor(u).producer
            if q is None or u in keep or u in weight or graph.op(q).primitive == INPUT_PRIMITIVE:
                continue
            if (q in elementwise and q not in library) or cat.get(q) in (_FREE, _CHEAP_CAT):
                out += leaves(u, seen)
            else:
                out.append(u)
        return out

    for t in sorted(drop):
        keep.update(leaves(t, set()))
    return frozenset(keep)


def attach_kernel_roles(graph: OpGraph, eager: bool = False) -> None:
    """Give every operator of ``graph`` its :class:`OpKernel` (both attention choices; with ``eager`` the eager
    views' too), so that pricing an operator on its own (:func:`autopar_lab.sharding.strategies.strategies_for`)
    prices it as part of its kernel. Idempotent; the graph's operators keep them (graphs do not change once
    captured)."""
    if not graph.__dict__.get("_kernel_roles_attached"):
        plain, fused = kernel_view(graph, False), kernel_view(graph, True)
        for node in graph:
            object.__setattr__(node, "_kernel", (plain.roles.get(node.id), fused.roles.get(node.id)))
        graph.__dict__["_kernel_roles_attached"] = True
    if eager and not graph.__dict__.get("_eager_roles_attached"):
        plain, fused = kernel_view(graph, False, eager=True), kernel_view(graph, True, eager=True)
        for node in graph:
            object.__setattr__(node, "_kernel_eager", (plain.roles.get(node.id), fused.roles.get(node.id)))
        graph.__dict__["_eager_roles_attached"] = True


def kernel_role(node: OpNode, fused_attention: bool = False, eager: bool = False) -> OpKernel | None:
    """The operator's :class:`OpKernel` once its graph's roles are attached (:func:`attach_kernel_roles`, with
    ``eager`` for the eager views'), else None (priced as a kernel of its own)."""
    both = node.__dict__.get("_kernel_eager" if eager else "_kernel")
    return None if both is None else both[1 if fused_attention else 0]


#: The primitive JAX's autodiff sums cotangents with: a chain of them across layers is the gradient chain.
CHAIN_PRIMITIVE = "add_any"


def is_chain_link(graph: OpGraph, node: OpNode) -> bool:
    """Whether ``node`` is a link of a gradient chain: a backward cotangent sum (:data:`CHAIN_PRIMITIVE`) that an
    operator of another layer reads (a residual stream's gradient passing to the layer before). XLA on CPU fuses the
    chain into every kernel that reads it, so each later layer's backward reads it again
    (:mod:`autopar_lab.backends.cpu` prices that).

    >>> import jax, jax.numpy as jnp
    >>> from autopar_lab.graph.capture import trace
    >>> def loss(w, x):
    ...     with jax.named_scope("layer_0"):
    ...         x = x + jnp.tanh(x @ w[0])
    ...     with jax.named_scope("layer_1"):
    ...         x = x + jnp.tanh(x @ w[1])
    ...     return x.sum()
    >>> g = trace(jax.grad(loss), jnp.ones((2, 4, 4)), jnp.ones((8, 4)))
    >>> any(is_chain_link(g, n) for n in g)
    True
    """
    return (node.primitive == CHAIN_PRIMITIVE and node.role not in (FORWARD, UPDATE) and bool(node.outputs)
            and any(graph.op(c).layer != node.layer for c in graph.consumers.get(node.outputs[0], ())))
