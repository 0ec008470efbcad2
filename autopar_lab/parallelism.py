"""The newer parallelism dimensions of a plan, named and overridable: ZeRO-3 / FSDP, sequence and expert parallelism.

Both are choices of the intra-operator ILP (see :mod:`autopar_lab.sharding.fsdp` and
:mod:`autopar_lab.sharding.seqpar`); this module reads them off a :class:`~autopar_lab.plan.Plan` and sets them:

- :func:`fsdp_params`: per stage, the parameters stored sharded and gathered for their readers;
- :func:`with_fsdp`: the plan with every parameter stored sharded over its stage's data-parallel axes (each an
  ordinary ``with_choice`` override, so pinned, re-priced and kept by ``resolve``);
- :func:`seqpar_regions`: per stage, the operators that run split along the sequence between a reduce-scatter and
  an all-gather (Megatron-style sequence parallelism);
- :func:`expert_parallel`: per stage, its MoE layers with the mesh axes their experts are split over ("EP=4") and
  the all-to-alls that carry the tokens to the experts and back (see :mod:`autopar_lab.sharding.experts`);
- (:func:`autopar_lab.overrides.with_expert_parallel` sets the experts' split: it re-solves around pins, which
  builds on the planner, so it lives with the other overrides;)
- :func:`context_parallel`: per stage, its attention matmuls run as a ring over a mesh axis (ring attention, see
  :mod:`autopar_lab.sharding.ring`; executed by :mod:`autopar_lab.runtime.ring`);
- :func:`op_notes`: one line per operator that takes part in any of them (ring attention included), for the
  sharding table;
- :func:`summary`: one line per dimension a plan uses, for the CLI and reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import operators
from .graph.opgraph import BATCH, INPUT_PRIMITIVE
from .sharding.experts import ExpertLayer, expert_layers
from .sharding.fsdp import GatheredParam, fsdp_spec, gathered_params, is_param_input
from .sharding.ring import is_ring, ring_axes_used
from .sharding.seqpar import SeqRegion, sequence_regions

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["RingMatmul", "context_parallel", "data_axes", "expert_degree", "expert_parallel", "fsdp_params",
           "op_notes", "seqpar_regions", "summary", "with_fsdp"]


def data_axes(graph, strategies) -> tuple[int, ...]:
    """The mesh axes a plan's batch is split on (its first batch input's leading dimension), in ``strategies``."""
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive == INPUT_PRIMITIVE and graph.tensor(node.outputs[0]).kind == BATCH and op in strategies:
            spec = strategies[op].out_specs[0]
            return tuple(spec.dims[0]) if spec.rank else ()
    return ()


def fsdp_params(plan: Plan, stage: int | None = None) -> dict[int, list[GatheredParam]]:
    """Stage index -> the parameters (operators of ``plan.op_graph``) it stores sharded and all-gathers for their
    readers; every stage with a solved mesh, or only ``stage``."""
    return {k: gathered_params(plan.op_graph, intra.strategies, tuple(intra.mesh.shape), ops)
            for k, intra, ops in stage_intras(plan, stage)}


def stage_intras(plan: Plan, stage: int | None = None):
    """``(stage index, its IntraPlan, the operators it runs or None for all)`` of every stage with a solved mesh, or
    only ``stage`` (a pipeline's IntraPlans may hold operators of other stages' layers)."""
    for k, st in enumerate(plan.stages):
        if (stage is not None and k != stage) or st.intra is None:
            continue
        yield k, st.intra, ([op for op in st.intra.ops if operators.solve_stage_of(plan, op) == k]
                            if len(plan.stages) > 1 else None)


def with_fsdp(plan: Plan, axes: tuple[int, ...] | None = None) -> Plan:
    """``plan`` with every parameter stored sharded over mesh ``axes`` (default: the axes its stage splits the batch
    on, or every axis of more than one device when the batch is not split): ZeRO-3 / FSDP. Each parameter's spec
    gains those axes on its first dimension they divide (see :func:`~autopar_lab.sharding.fsdp.fsdp_spec`); its
    readers keep theirs, so they all-gather it, in forward and again in backward. Parameters that cannot take them
    (no dimension divides) stay as they are. Every change is a pin, as ``plan.with_choice``.

    >>> fsdp = with_fsdp(plan)                                              # doctest: +SKIP
    >>> [p.describe() for p in fsdp_params(fsdp)[0]][:1]                    # doctest: +SKIP
    ["ZeRO-3/FSDP: stored P('x', None), all-gathered over x to P(None, None) in forward and backward"]
    """
    if axes is not None and (not isinstance(axes, (tuple, list)) or not all(a in (0, 1) for a in axes)):
        raise ValueError(f"axes must be a tuple of mesh axes (0 and/or 1), got {axes!r}")
    g = plan.op_graph
    for op in g.ops:
        if not is_param_input(g, op):
            continue
        full = operators.user_op(plan, op)  # the operator of plan.graph a change of its solution is asked with
        if full is None:
            continue
        intra = plan.stages[operators.solve_stage_of(plan, op)].intra
        if intra is None or op not in intra.strategies:
            continue
        mshape = tuple(intra.mesh.shape)
        over = tuple(axes) if axes is not None else (data_axes(g, intra.strategies)
                                                    or tuple(a for a in (0, 1) if mshape[a] > 1))
        t = g.tensor(g.op(op).outputs[0])
        cur = intra.strategies[op].out_specs[0]
        new = fsdp_spec(cur, t.shape, mshape, over)
        if new is not None and new != cur:
            plan = plan.with_choice(full, str(new))
    return plan


def seqpar_regions(plan: Plan, stage: int | None = None) -> dict[int, list[SeqRegion]]:
    """Stage index -> its sequence-parallel regions (see :func:`~autopar_lab.sharding.seqpar.sequence_regions`)."""
    g = plan.op_graph
    out = {}
    for k, st in enumerate(plan.stages):
        if (stage is not None and k != stage) or st.intra is None:
            continue
        out[k] = sequence_regions(g, st.intra.strategies, tuple(st.intra.mesh.shape))
    return out


def expert_parallel(plan: Plan, stage: int | None = None) -> dict[int, list[ExpertLayer]]:
    """Stage index -> its MoE layers (see :func:`~autopar_lab.sharding.experts.expert_layers`): the expert matmuls,
    the mesh axes the experts are split over, the all-to-alls (bytes and seconds on the stage's mesh, forward and
    backward over the step's batch). Stages without MoE layers map to ``[]``."""
    return {k: expert_layers(plan.op_graph, intra.strategies, intra.mesh, ops)
            for k, intra, ops in stage_intras(plan, stage)}


def expert_degree(plan: Plan) -> int:
    """The largest number of devices any MoE layer of ``plan`` splits its experts over (1: replicated experts, or no
    MoE layer)."""
    return max((e.degree for layers in expert_parallel(plan).values() for e in layers), default=1)


@dataclass(frozen=True)
class RingMatmul:
    """An attention matmul a plan runs as a ring (context parallelism): operator ``op`` of ``plan.op_graph``, the
    mesh ``axes`` its ring runs over, its ``role`` ("forward" or "backward") and strategy ``name``."""

    op: int
    axes: tuple[int, ...]
    role: str
    name: str


def context_parallel(plan: Plan, stage: int | None = None) -> dict[int, list[RingMatmul]]:
    """Stage index -> its ring-marked attention matmuls (context parallelism by ring attention), in operator
    order; stages without any map to ``[]``."""
    g = plan.op_graph
    out: dict[int, list[RingMatmul]] = {}
    for k, intra, ops in stage_intras(plan, stage):
        mine = intra.strategies if ops is None else {op: intra.strategies[op] for op in ops if op in intra.strategies}
        out[k] = [RingMatmul(int(op), ring_axes_used(s), str(g.op(op).role), s.name)
                  for op, s in sorted(mine.items()) if is_ring(s)]
    return out


def summary(plan: Plan, axis_names=("x", "y")) -> list[str]:
    """One line per newer parallelism dimension ``plan`` uses (expert parallelism, ZeRO-3 / FSDP, sequence and
    context parallelism), per stage; ``[]`` when it uses none."""
    lines = []
    for k, layers in expert_parallel(plan).items():
        split = [e for e in layers if e.axes]
        if split:
            degrees = sorted({e.degree for e in split})
            over = sorted({"+".join(axis_names[a] for a in e.axes) for e in split})
            a2a = sum(e.all_to_all_bytes for e in split)
            secs = sum(e.all_to_all_s for e in split)
            lines.append(f"stage {k}: expert parallel EP={'/'.join(map(str, degrees))} over {', '.join(over)} in "
                         f"{len(split)} of {len(layers)} MoE layer(s); their all-to-alls move {a2a / 2**20:.4g} MiB "
                         f"({secs * 1e3:.4g} ms) a step")
        elif layers:
            lines.append(f"stage {k}: experts replicated (EP=1) in its {len(layers)} MoE layer(s)")
    for k, params in fsdp_params(plan).items():
        if params:
            lines.append(f"stage {k}: ZeRO-3/FSDP on {len(params)} parameter(s)")
    for k, regions in seqpar_regions(plan).items():
        if regions:
            lines.append(f"stage {k}: sequence parallel in {len(regions)} region(s)")
    for k, rings in context_parallel(plan).items():
        if rings:
            ring_over = ", ".join(sorted({"+".join(axis_names[a] for a in r.axes) for r in rings}))
            lines.append(f"stage {k}: context parallel (ring) over {ring_over} in {len(rings)} attention matmul(s)")
    return lines


def op_notes(plan: Plan, axis_names=("x", "y")) -> dict[int, str]:
    """Operator of ``plan.graph`` -> one line naming the newer parallelism it takes part in: a ZeRO-3 / FSDP
    parameter (stored and gathered specs), an operator of a sequence-parallel region, a ring-attention matmul
    (context parallelism), an expert matmul (expert parallelism). Operators in none of them are absent. The first
    stage that runs an operator's solution says."""
    out: dict[int, str] = {}
    for k, layers in expert_parallel(plan).items():
        for e in layers:
            for op in e.ops:
                out.setdefault(op, e.describe(axis_names))
    for k, params in fsdp_params(plan).items():
        for p in params:
            out.setdefault(p.op, p.describe(axis_names))
    for k, regions in seqpar_regions(plan).items():
        for r in regions:
            over = "+".join(axis_names[a] for a in r.axes)
            for op in r.ops:
                out.setdefault(op, f"sequence parallel: split along the sequence over {over}")
    for st in plan.stages:
        if st.intra is None:
            continue
        for op, s in st.intra.strategies.items():
            if is_ring(s):
                over = "+".join(axis_names[a] for a in ring_axes_used(s))
                out.setdefault(op, f"context parallel: ring attention over {over} (blocks passed around the ring, "
                                   "overlapping compute)")
    m = operators.op_map(plan)
    if m.is_identity:
        return out
    full: dict[int, str] = {}  # the notes above are of the graph the plan was solved on: each stands for its layers'
    for op, note in out.items():
        for real in m.full_ops(op):
            full.setdefault(real, note)
    return full
