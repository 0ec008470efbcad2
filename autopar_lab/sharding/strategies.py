"""Per-operator sharding strategies: Alpa's intra-operator search space.

A :class:`Strategy` of an operator fixes the spec of each output, the spec it needs each input in, and the
collectives it runs itself (a contraction over a split dimension leaves partial sums: an all-reduce, or a
reduce-scatter). :func:`strategies_for` lists the strategies of one :class:`~autopar_lab.graph.opgraph.OpNode` on a
logical mesh, priced:

- ``compute_s``: one device's share of the kernel the operator runs in (:func:`kernel_time`): the roofline
  ``max(flops / n_work / achievable FLOP/s, bytes / achievable bandwidth)``, where ``n_work`` is the number of devices
  the work is divided over (the product of the sizes of every mesh axis any of its specs splits) and ``bytes`` the
  bytes its kernel moves for it (:mod:`autopar_lab.graph.fusion`: fused neighbours' tensors move none), plus the
  FP8 cast kernels a number format gives it (:func:`cast_time`);
- ``comm_s``: the sum of its collectives on the mesh (alpha-beta, see :mod:`autopar_lab.cluster`);
- ``mem_bytes``: bytes of its output shards on one device.

The built-in rules, one per primitive family, are :mod:`autopar_lab.sharding.rules` (registered when the package is
imported). Most rules are one of two shapes, both public so a custom rule can use them:

- :func:`contraction_strategies`: an "iteration space" of named dimensions (for a matmul: batch, i, j, k), each
  tensor maps its dimensions onto it, splitting a reduced dimension leaves partial outputs;
- :func:`follow_strategies`: outputs and inputs share a spec on the dimensions they have in common (elementwise,
  slicing, sorting ...), the other dimensions stay replicated.

Both enumerate splits of at most two dimensions, each useful mesh axis (size > 1) used at most once:
``1 + 3r + r(r-1)`` candidates for ``r`` splittable dimensions on a 2D mesh, ``r + 1`` on a mesh with one useful
axis. Counts therefore stay small on 1D meshes (a matmul has 5: RR, i, j, k with all-reduce, k with reduce-scatter)
and grow on 2D ones (on 2 x 4: a plain matmul 23, a batched attention matmul up to 45, an elementwise op on a
rank-2 tensor 9, rank 3: 16, rank 4: 25). Contractions split only one representative of each kind of dimension
(the first lhs-free, rhs-free and contracting dimension that divides the mesh; at most two batch dimensions).
Strategies that would need padding are dropped; duplicates (same specs) keep the cheapest.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from autopar_lab.graph.capture import trace
    >>> from autopar_lab.cluster import Cluster
    >>> mesh = Cluster.preset("p3.16xlarge").logical_mesh((1, 8), (1, 8))
    >>> g = trace(lambda x, w: x @ w, jax.ShapeDtypeStruct((64, 256), jnp.float32),
    ...           jax.ShapeDtypeStruct((256, 1024), jnp.float32))
    >>> sorted(s.name for s in strategies_for(g.op(2), mesh))  # doctest: +NORMALIZE_WHITESPACE
    ['RR = RR x RR', 'RR = RS1 x S1R [all_reduce@1]', 'RS1 = RR x RS1', 'S1R = RS1 x S1R [reduce_scatter@1]',
     'S1R = S1R x RR']
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..backends import kernel_share
from ..graph import opcost
from ..graph.fusion import kernel_role
from ..graph.opgraph import FP8_CASTS, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, OpGraph, OpNode, op_signature
from .reshard import Collective, collective_time
from .ring import RING_KIND, ring_exposed_s
from .spec import ShardingSpec, assignments, useful_axes

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Strategy:
    """One way to run an operator on a logical mesh.

    ``collectives`` are ``(kind, mesh axis, bytes of the full buffer)`` with kind one of ``COLLECTIVE_KINDS`` and
    axis 0, 1 or (0, 1). Rules may leave ``compute_s``, ``comm_s`` and ``mem_bytes`` at 0: :func:`strategies_for`
    prices every strategy.

    >>> s = Strategy("S0R = S0R x RR", (ShardingSpec.parse("S0R"),), (ShardingSpec.parse("S0R"), ShardingSpec.parse("RR")),
    ...              compute_s=2.0, comm_s=0.5)
    >>> s.cost
    2.5
    """

    name: str
    out_specs: tuple[ShardingSpec, ...]
    in_specs: tuple[ShardingSpec, ...]
    collectives: tuple[Collective, ...] = ()
    compute_s: float = 0.0
    comm_s: float = 0.0
    mem_bytes: float = 0.0

    @property
    def cost(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def key(self) -> tuple:
        """What makes two strategies the same choice for the ILP: their specs."""
        return (self.out_specs, self.in_specs)

    def __str__(self) -> str:
        return self.name


Rule = Callable[[OpNode, Any], Iterable[Strategy]]
_RULES: dict[str, Rule] = {}
#: Rules that read only an operator's primitive, shapes, dtypes and parameters (see :func:`register_rule`).
_SHAPE_ONLY: set[Rule] = set()


def register_rule(primitive: str, fn: Rule | None = None, *, shape_only: bool = False):
    """Register ``fn(op, mesh) -> iterable of Strategy`` as the rule of ``primitive`` (replacing any earlier one).

    Works as a decorator too. The rule returns unpriced strategies; invalid ones (a spec that does not divide its
    tensor, the wrong number of specs) are dropped and the rest priced by :func:`strategies_for`. A rule should read
    only the mesh's shape (links are the pricing's business): its strategies are remembered per operator signature
    and mesh shape. ``shape_only``: the rule reads only the operator's primitive, shapes, dtypes and parameters (not
    its role or its inputs' kinds), so a forward and a backward operator of one shape share its enumeration (the
    built-in rules of :mod:`autopar_lab.sharding.rules` are).

    >>> @register_rule("my_identity")
    ... def _identity(op, mesh):
    ...     return follow_strategies(op, mesh)
    >>> "my_identity" in registered_primitives()
    True
    """
    if fn is None:
        return lambda f: register_rule(primitive, f)
    if not callable(fn):
        raise TypeError(f"the rule for {primitive!r} must be a function (op, mesh) -> strategies, got {type(fn).__name__}")
    _RULES[str(primitive)] = fn
    if shape_only:
        _SHAPE_ONLY.add(fn)
    return fn


def unregister_rule(primitive: str) -> None:
    """Remove the rule of ``primitive`` (its operators become replicated-only)."""
    _RULES.pop(str(primitive), None)


def registered_primitives() -> frozenset[str]:
    return frozenset(_RULES)


def has_rule(primitive: str) -> bool:
    return primitive in _RULES


# --------------------------------------------------------------------------------------------------------------
# Building blocks


def mesh_shape(mesh) -> tuple[int, int]:
    shape = mesh.shape
    try:  # asked for every strategy priced: the few shapes of a run remembered
        return _MESH_SHAPES[shape]
    except (KeyError, TypeError):  # new, or not hashable (a list)
        out = tuple(int(s) for s in shape)
        if type(shape) is tuple and len(_MESH_SHAPES) < 1 << 12:
            _MESH_SHAPES[shape] = out
        return out  # type: ignore[return-value]


_MESH_SHAPES: dict[tuple, tuple[int, ...]] = {}


def _axis_key(axes: Sequence[int]):
    """A collective's axis argument: 0, 1 or (0, 1)."""
    axes = tuple(sorted(axes))
    return axes[0] if len(axes) == 1 else axes


def _spec(rank_map: Sequence[int | None], assign: Mapping[int, tuple[int, ...]]) -> ShardingSpec:
    return ShardingSpec(tuple(assign.get(r, ()) if r is not None else () for r in rank_map))


def strategy_name(out_specs: Sequence[ShardingSpec], in_specs: Sequence[ShardingSpec], suffix: str = "") -> str:
    outs = ", ".join(map(str, out_specs)) or "()"
    ins = " x ".join(str(s) or "''" for s in in_specs) or "()"
    return f"{outs} = {ins}{suffix}"


def contraction_strategies(
    op: OpNode,
    mesh,
    space: Sequence[int],
    in_maps: Sequence[Sequence[int | None]],
    out_maps: Sequence[Sequence[int | None]],
    reduce: Iterable[int] = (),
    splittable: Iterable[int] | None = None,
    reduce_scatter: bool = True,
) -> list[Strategy]:
    """Strategies of an einsum-like operator.

    ``space`` are the sizes of the iteration dimensions; ``in_maps[i][d]`` (``out_maps``) is the iteration dimension
    that dimension ``d`` of input ``i`` (output) runs along, or None if that dimension stays replicated. Splitting a
    dimension in ``reduce`` (contracted away) leaves each output partial over those axes: an ``all_reduce`` of it,
    or, when ``reduce_scatter`` and there is one output, a variant that ``reduce_scatter``s it onto its first free
    dimension that divides (how gradients get sharded for a sharded optimizer update). ``splittable`` limits which
    iteration dimensions may be split (all by default).

    >>> # C[i,j] = sum_k A[i,k] B[k,j]: space (i, j, k)
    >>> # contraction_strategies(op, mesh, (M, N, K), [(0, 2), (2, 1)], [(0, 1)], reduce=[2])
    """
    mshape = mesh_shape(mesh)
    out: list[Strategy] = []
    for checks, ins, outs, red_axes, axis, name, scatters in _contraction_template(
            len(space), in_maps, out_maps, reduce, splittable, reduce_scatter, useful_axes(mshape)):
        if any(int(space[r]) % math.prod(mshape[a] for a in ax) for r, ax in checks):
            continue
        if not red_axes:
            out.append(Strategy(name, outs, ins))
            continue
        cols = tuple(
            ("all_reduce", axis, s.bytes_per_device(shape, dtype, mshape))
            for s, shape, dtype in zip(outs, op.out_shapes, op.out_dtypes)
            if s.is_valid(shape, mshape)
        )
        out.append(Strategy(name, outs, ins, cols))
        if scatters:
            o, shape, dtype = outs[0], op.out_shapes[0], op.out_dtypes[0]
            n = math.prod(mshape[a] for a in red_axes)
            for d, scattered, rs_name in scatters:
                if shape[d] % n == 0 and shape[d] >= n:
                    if not o.is_valid(shape, mshape):
                        break
                    col = ("reduce_scatter", axis, o.bytes_per_device(shape, dtype, mshape))
                    out.append(Strategy(rs_name, (scattered,), ins, (col,)))
                    break
    return out


#: :func:`contraction_strategies`' candidates per (iteration rank, maps, reduce, splittable, reduce_scatter, useful
#: mesh axes): their specs and names do not depend on the sizes, only which of them divide does. The planner asks
#: again on every logical mesh shape, so the specs are built once per pattern of useful axes.
_TEMPLATES: dict[tuple, tuple] = {}


def _contraction_template(rank, in_maps, out_maps, reduce, splittable, reduce_scatter, useful) -> tuple:
    in_maps = tuple(tuple(m) for m in in_maps)
    out_maps = tuple(tuple(m) for m in out_maps)
    reduce = frozenset(reduce)
    splittable = None if splittable is None else tuple(sorted(set(splittable)))
    key = (rank, in_maps, out_maps, reduce, splittable, reduce_scatter, useful)
    hit = _TEMPLATES.get(key)
    if hit is not None:
        return hit
    pattern = tuple(2 if a in useful else 1 for a in (0, 1))  # a mesh shape with the same useful axes
    rows = []
    for assign in assignments(rank, pattern, splittable):
        checks = tuple(assign.items())
        ins = tuple(_spec(m, assign) for m in in_maps)
        outs = tuple(_spec(m, assign) for m in out_maps)
        red_axes = tuple(sorted(a for r, ax in assign.items() if r in reduce for a in ax))
        if not red_axes:
            rows.append((checks, ins, outs, red_axes, None, strategy_name(outs, ins), ()))
            continue
        axis = _axis_key(red_axes)
        scatters: tuple = ()
        if reduce_scatter and len(outs) == 1:
            o = outs[0]
            scatters = tuple(
                (d, sc, strategy_name((sc,), ins, f" [reduce_scatter@{_fmt_axis(axis)}]"))
                for d in range(o.rank) if not o.dims[d]
                for sc in (ShardingSpec(tuple(red_axes if i == d else ax for i, ax in enumerate(o.dims))),)
            )
        rows.append((checks, ins, outs, red_axes, axis, strategy_name(outs, ins, f" [all_reduce@{_fmt_axis(axis)}]"),
                     scatters))
    if len(_TEMPLATES) > 1 << 14:
        _TEMPLATES.clear()
    hit = _TEMPLATES[key] = tuple(rows)
    return hit


def _fmt_axis(axis) -> str:
    return str(axis) if isinstance(axis, int) else "".join(map(str, axis))


def same_dims_map(shape: Sequence[int], ref: Sequence[int]) -> tuple[int | None, ...]:
    """Map a tensor's dims onto ``ref``'s: identity where the ranks match and the sizes agree, else replicated."""
    if len(shape) != len(ref):
        return (None,) * len(shape)
    return tuple(d if int(shape[d]) == int(ref[d]) else None for d in range(len(shape)))


def follow_strategies(
    op: OpNode,
    mesh,
    allowed: Iterable[int] | None = None,
    space: Sequence[int] | None = None,
    in_maps: Sequence[Sequence[int | None]] | None = None,
    out_maps: Sequence[Sequence[int | None]] | None = None,
) -> list[Strategy]:
    """Strategies where inputs and outputs share one spec over ``space`` (the first output's shape by default).

    By default a tensor of the same rank follows ``space`` on the dimensions whose size agrees and is replicated on
    the others; scalars and other ranks are replicated. ``allowed`` limits the dimensions of ``space`` that may be
    split (e.g. not the sorted or the concatenated one). No collectives.
    """
    if space is None:
        space = op.out_shapes[0] if op.out_shapes else op.in_shapes[0]
    if in_maps is None:
        in_maps = [same_dims_map(s, space) for s in op.in_shapes]
    if out_maps is None:
        out_maps = [same_dims_map(s, space) for s in op.out_shapes]
    return contraction_strategies(op, mesh, space, in_maps, out_maps, splittable=allowed)


def replicated_strategy(op: OpNode, why: str = "") -> Strategy:
    """Everything replicated (the fallback for operators without a rule)."""
    outs = tuple(ShardingSpec.replicated(len(s)) for s in op.out_shapes)
    ins = tuple(ShardingSpec.replicated(len(s)) for s in op.in_shapes)
    return Strategy(strategy_name(outs, ins, f" [{why}]" if why else ""), outs, ins)


# Operators that cost nothing whatever their spec: inputs and outputs of the step, and constants made on the spot.
ZERO_COST = frozenset([INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, "iota"])


# --------------------------------------------------------------------------------------------------------------
# Pricing and the entry points


def _fits(s: Strategy, op: OpNode, mshape: Sequence[int]) -> bool:
    if len(s.out_specs) != len(op.out_shapes) or len(s.in_specs) != len(op.in_shapes):
        return False
    return all(spec.is_valid(shape, mshape) for spec, shape in zip(s.out_specs, op.out_shapes)) and all(
        spec.is_valid(shape, mshape) for spec, shape in zip(s.in_specs, op.in_shapes)
    )


def price(op: OpNode, s: Strategy, mesh, *, alone: bool = False) -> Strategy:
    """``s`` with compute_s, comm_s and mem_bytes filled in (see the module docstring for the formulas); ``alone``:
    the operator priced as a kernel of its own even where its graph has kernel roles (:func:`kernel_time`)."""
    return _OpPricer(op, mesh, alone).price(s, _geometry(op, s, mesh_shape(mesh)))


def kernel_time(op: OpNode, s: Strategy, mesh, ins: Sequence[float], outs: Sequence[float], n_work: int, *,
                alone: bool = False) -> float:
    """Seconds one device spends on ``op``'s shard under strategy ``s``, as part of the kernel it runs in.

    The roofline of the kernel, ``max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth)``, split over its
    operators (:mod:`autopar_lab.graph.fusion`): an operator charges the bytes its kernel reads and writes for it
    (a tensor inside the kernel costs none); a matmul (or flash-attention kernel) charges its absorbed operators'
    FLOPs and traffic with its own, at the GEMM's achievable rate for the shard's shape (wave quantisation, inner
    dimension: :meth:`~autopar_lab.cluster.Device.matmul_rate`); the rest run at the elementwise rate. An operator
    whose graph has no kernel roles attached, or priced ``alone``, is priced as a kernel of its own (reading its
    inputs from memory and writing its outputs back). Launch overheads are counted per kernel elsewhere
    (:mod:`autopar_lab.pricing.layers`).
    """
    return _OpPricer(op, mesh, alone).kernel_time(s, ins, outs, n_work, None)


def _geometry(op: OpNode, s: Strategy, mshape: tuple[int, ...]) -> list:
    """What pricing ``s`` reads of the operator's shapes only: [bytes per device of each output, of each input, the
    devices doing distinct work, the GEMM's (batch, m, n, k) or None until first asked]. The same for every operator
    of one shape on one mesh shape, so :func:`strategies_for` keeps it beside the rule's strategies."""
    outs = tuple(spec.bytes_per_device(sh, dt, mshape) for spec, sh, dt in zip(s.out_specs, op.out_shapes,
                                                                                 op.out_dtypes))
    ins = tuple(spec.bytes_per_device(sh, dt, mshape) for spec, sh, dt in zip(s.in_specs, op.in_shapes, op.in_dtypes))
    used = set().union(*(spec.axes for spec in s.out_specs + s.in_specs)) if (s.out_specs or s.in_specs) else set()
    return [outs, ins, math.prod(mshape[a] for a in used), None]


class _OpPricer:
    """:func:`price` and :func:`kernel_time` for one operator on one mesh: what does not depend on the strategy (its
    kernel role, the device's rates, the CPU share) looked up once for all of the operator's strategies."""

    def __init__(self, op: OpNode, mesh, alone: bool):
        device = mesh.cluster.device
        self.op, self.mesh, self.device = op, mesh, device
        self.role = None if alone else kernel_role(op, device.efficiency.flash_attention,
                                                   not device.efficiency.kernel_fusion)
        self.dtype = op.in_dtypes[0] if op.in_dtypes else (op.out_dtypes[0] if op.out_dtypes else "float32")
        self.share = kernel_share(mesh)  # 1 but on the CPU, calibrated with all of a host's devices busy (backends)
        self.slice_read = op.primitive in ("gather", "dynamic_slice", "scan_slice")
        self.zero = op.primitive in ZERO_COST
        self._vector_rate = None

    def vector_rate(self) -> float:
        if self._vector_rate is None:
            self._vector_rate = self.device.vector_rate(self.dtype)
        return self._vector_rate

    def price(self, s: Strategy, geom: list) -> Strategy:
        op, mesh = self.op, self.mesh
        outs, ins = geom[0], geom[1]
        if self.slice_read and ins:
            ins = (sum(outs),) + ins[1:]  # they read only the slice they return, not the whole operand
        compute = 0.0
        if not self.zero:
            compute = self.kernel_time(s, ins, outs, geom[2], geom)
            if FP8_CASTS in op.params:
                compute += cast_time(op, mesh, ins)
        comm = sum(collective_time(mesh, kind, nbytes, axis) if kind != RING_KIND else
                   ring_exposed_s(mesh, nbytes, axis, compute) for kind, axis, nbytes in s.collectives)
        return Strategy(s.name, s.out_specs, s.in_specs, s.collectives, compute, comm, float(sum(outs)))

    def kernel_time(self, s: Strategy, ins: Sequence[float], outs: Sequence[float], n_work: int,
                    geom: list | None) -> float:
        op, device, role, share = self.op, self.device, self.role, self.share
        flops = op.flops / n_work
        if role is not None and role.kind in ("free", "dead"):
            return 0.0  # folded into the kernels that read it (a layout change, a scalar), or removed
        if role is None:
            traffic = float(sum(ins) + sum(outs))
            extra_mm = extra_vec = 0.0
            work = 1.0
        elif role.absorbed:
            # Its traffic is its kernel root's; its own elementwise work it does where its spec puts it (so an
            # epilogue computed on a shard costs less than one replicated). A flash-attention step's work is the
            # root's.
            return 0.0 if role.kind in ("attention", "dead") else flops / self.vector_rate() * share
        else:
            traffic = float(sum(f * b for f, b in zip(role.reads, ins)) + sum(f * b for f, b in zip(role.writes, outs)))
            traffic += role.extra_bytes * float(sum(outs))
            extra_mm, extra_vec, work = role.extra_mm, role.extra_vec, role.work
        if op.primitive in opcost.CONTRACTIONS:
            if role is not None and role.kind == "attention":
                rate = device.attention_rate(self.dtype)
            else:
                dims = geom[3] if geom is not None else None
                if dims is None:
                    mshape = mesh_shape(self.mesh)
                    local_in = [spec.shard_shape(sh, mshape) for spec, sh in zip(s.in_specs, op.in_shapes)]
                    local_out = [spec.shard_shape(sh, mshape) for spec, sh in zip(s.out_specs, op.out_shapes)]
                    dims = opcost.gemm_dims(op.primitive, local_in, local_out, op.params)
                    if geom is not None:
                        geom[3] = dims
                batch, m, n, k = dims
                rate = device.matmul_rate(self.dtype, m, n, k, batch)
            t = flops * (1.0 + extra_mm) * work / rate + flops * extra_vec / self.vector_rate()
        else:
            t = flops * (1.0 + extra_vec) / self.vector_rate()
        return max(t, traffic / device.achievable_bandwidth) * share


def cast_time(op: OpNode, mesh, ins: Sequence[float]) -> float:
    """Seconds one device spends on the FP8 cast kernels ``op`` pays for (``op.params[FP8_CASTS]``, written by
    :func:`autopar_lab.precision.retype`): each a memory-bound kernel of its own, moving ``FP8_CASTS[i]`` times the
    bytes ``ins[i]`` the operator reads of input ``i`` (as its strategy shards it) at the achievable bandwidth. Their
    launches are counted with the other kernels' (:mod:`autopar_lab.pricing.layers`)."""
    device = mesh.cluster.device
    share = kernel_share(mesh)
    moved = sum(f * b for f, b in zip(op.params[FP8_CASTS], ins))
    return moved / device.achievable_bandwidth * share


def strategies_for(op: OpNode, mesh) -> list[Strategy]:
    """The priced, valid, deduplicated strategies of ``op`` on ``mesh`` (never empty).

    An operator without a rule (see :func:`register_rule`) gets the all-replicated strategy only; its graph's
    :func:`unsupported_ops` says so.
    """
    mshape = mesh_shape(mesh)
    rule = _RULES.get(op.primitive)
    best: dict[tuple, Strategy] = {}
    valid, geoms = _valid_strategies(op, rule, mesh, mshape)
    if valid:
        pricer = _OpPricer(op, mesh, False)
        for k, s in enumerate(valid):
            geom = geoms[k]
            if geom is None:
                geom = geoms[k] = _geometry(op, s, mshape)
            p = pricer.price(s, geom)
            key = p.key
            if key not in best or p.cost < best[key].cost:
                best[key] = p
    if not best:
        why = f"no rule for '{op.primitive}'" if rule is None else "no valid split"
        p = price(op, replicated_strategy(op, why), mesh)
        best[p.key] = p
    return list(best.values())


#: Per (rule, operator signature, mesh shape): the rule's valid strategies, unpriced, and each one's _geometry
#: (filled as first priced).
_VALID: dict[tuple, tuple[tuple[Strategy, ...], list]] = {}


def _valid_strategies(op: OpNode, rule, mesh, mshape) -> tuple[tuple[Strategy, ...], list]:
    """The rule's strategies that fit ``op`` on a mesh of shape ``mshape``, unpriced, and a list of their geometries
    (None until computed). Remembered per (rule, operator signature, mesh shape): a rule sees the mesh only through
    its shape (pricing, which reads links, comes after), and the planner asks again on every logical mesh of every
    submesh."""
    if rule is None:
        return (), []
    sig = op_signature(op)
    # A shape-only rule (the built-in ones) reads an operator's primitive, shapes, dtypes and parameters only, not
    # its role or its inputs' kinds: a forward and a backward operator of one shape share the enumeration. Any other
    # rule may read anything: it keeps the whole signature. Either key holds all the geometry reads (sig[:6]).
    key = (rule, sig[:6] if rule in _SHAPE_ONLY else sig, mshape)
    hit = _VALID.get(key)
    if hit is None:
        valid = tuple(s for s in rule(op, mesh) if _fits(s, op, mshape))
        if len(_VALID) > 1 << 16:
            _VALID.clear()
        hit = _VALID[key] = (valid, [None] * len(valid))
    return hit


def unsupported_ops(graph: OpGraph) -> list[str]:
    """One warning per primitive of ``graph`` that has no sharding rule (its operators are planned replicated)."""
    missing: dict[str, list[int]] = defaultdict(list)
    for node in graph:
        if node.primitive not in _RULES:
            missing[node.primitive].append(node.id)
    out = []
    for prim, ids in sorted(missing.items()):
        shown = ", ".join(f"#{i}" for i in ids[:5]) + (", ..." if len(ids) > 5 else "")
        out.append(
            f"no sharding rule for '{prim}' ({len(ids)} operator{'s' if len(ids) > 1 else ''}: {shown}): planned "
            f"replicated; register one with autopar_lab.sharding.register_rule('{prim}', fn) to shard it"
        )
    return out


__all__ = [
    "COLLECTIVE_KINDS",
    "Rule",
    "Strategy",
    "ZERO_COST",
    "contraction_strategies",
    "follow_strategies",
    "has_rule",
    "kernel_time",
    "price",
    "register_rule",
    "registered_primitives",
    "replicated_strategy",
    "strategies_for",
    "unregister_rule",
    "unsupported_ops",
    "mesh_shape",
    "same_dims_map",
    "strategy_name",
]
