"""A plan's weights and optimizer state stored as a ZeRO stage says (:func:`with_zero`), and a plan's memory said in
words (:func:`explain_fit`): what the planner sharded to make it fit, or which part overflows by how much.

:func:`with_zero` serves the planners whose sharding is the ILP's (``auto_plan(zero=...)``,
``data_parallel_plan(zero=...)``): each stage keeps its layers, mesh and recomputation; its mesh's data-parallel
group is the axes its plan splits the batch over (:func:`~autopar_lab.parallelism.data_axes`); every parameter and
optimizer state keeps its split over the other axes and is stored, by the ZeRO stage, split over that group too
(:func:`~autopar_lab.sharding.fsdp.fsdp_spec`); the ILP re-solves the rest around that storage (both axes at once, so
the optimizer's update runs where the state lies) and the plan is priced with ZeRO's memory
(:mod:`autopar_lab.pricing.zero`). The stage DP chose the stages without ZeRO's savings: an approximation of
planning with ZeRO, said in the plan's notes.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

from ..parallelism import data_axes
from ..plan import price_plan
from ..pricing.zero import opt_states_of, planned_params
from ..sharding.fsdp import fsdp_spec
from ..solve.ilp import DEFAULT_SOLVER
from ..solve.intra import IntraOptions, solve_intra
from .fit import lean_note, overflow_note
from .shardpins import zero_spec_on_split_dim

if TYPE_CHECKING:
    from ..plan import Plan
    from ..solve.intra import IntraPlan

__all__ = ["explain_fit", "with_zero", "zero_storage"]

# table -> {(submesh, mesh shape, data axes, zero, the stage's specs' fingerprint): IntraPlan}
_SOLVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def zero_storage(graph, intra: IntraPlan, axes: tuple[int, ...], zero: int) -> dict[int, str]:
    """Parameter and optimizer-state input operator -> its stored spec (as a string) under ZeRO stage ``zero`` over
    mesh ``axes``, from ``intra``'s own storage with those axes removed (see the module docstring)."""
    mshape = tuple(intra.mesh.shape)
    states = opt_states_of(graph)
    out: dict[int, str] = {}
    for op, info, spec in planned_params(graph, intra):
        own = spec.without_axes(axes)
        sharded = fsdp_spec(own, tuple(info.shape), mshape, axes) or \
            zero_spec_on_split_dim(own, info.shape, mshape, axes)
        out[op] = str(sharded if zero == 3 else own)
        for st in states.get(op, ()):
            out[st] = str(sharded if zero >= 1 else own)
    return out


def with_zero(plan: Plan, zero: int, *, solver: str = DEFAULT_SOLVER) -> Plan:
    """``plan`` with its state stored as ZeRO stage ``zero`` says over each stage's data-parallel group (see the
    module docstring); stages whose batch is not split keep their storage."""
    table = plan.table
    if table is None:
        raise ValueError("this plan has no cost table to re-solve it with; plan it with the planner first")
    g = table.solve_graph
    memo = _SOLVED.setdefault(table, {})
    intras: list = []
    for st in plan.stages:
        intra = st.intra
        axes = tuple(a for a in data_axes(g, intra.strategies) if intra.mesh.shape[a] > 1) if intra else ()
        if intra is None or not axes:
            intras.append(intra)
            continue
        pins = zero_storage(g, intra, axes, zero)
        key = (tuple(st.submesh), tuple(st.logical_mesh), axes, zero, tuple(sorted(pins.items())))
        if key not in memo:
            memo[key] = solve_intra(g, intra.mesh, pins=pins, cache=table.strategy_cache(intra.mesh),
                                    options=IntraOptions(solver=solver, rounds=1, axes="joint"))
        intras.append(memo[key])
    note = (f"ZeRO-{zero}: the stages' optimizer state{', gradients' if zero >= 2 else ''}"
            f"{' and parameters' if zero >= 3 else ''} stored split over their data-parallel devices; the stage DP "
            "chose the stages without ZeRO's savings")
    return price_plan(table, plan.stages, microbatches=plan.microbatches, schedule=plan.schedule,
                      virtual_stages=plan.virtual_stages if plan.schedule == "interleaved" else None,
                      stage_comm=plan.stage_comm, mem_limit_bytes=plan.cost.mem_limit_bytes, method=plan.method,
                      intras=intras, solve_s=plan.solve_s, notes=(*plan.notes, note), pins=plan.pins,
                      stage_pins={**plan.stage_pins, "zero": zero},
                      solutions=[st.solution for st in plan.stages])


def explain_fit(plan: Plan) -> Plan:
    """``plan`` with its cost's ``fit_note`` (shown by explain()) saying which stages the stage DP stored at their
    least to fit (the memory-lean solution: the peak each would have with the fastest sharding, and with the lean
    one), or which part of which stage overflows by how much; ``plan`` itself when there is nothing to say."""
    notes = []
    lean = [k for k, st in enumerate(plan.stages) if st.solution == "lean"]
    table = plan.table
    if lean and table is not None:
        fast = price_plan(table, plan.stages, microbatches=plan.microbatches, schedule=plan.schedule,
                          virtual_stages=plan.virtual_stages if plan.schedule == "interleaved" else None,
                          stage_comm=plan.stage_comm, mem_limit_bytes=plan.cost.mem_limit_bytes,
                          stage_pins=plan.stage_pins, solutions=["fast"] * len(plan.stages))
        notes.append(lean_note(lean, [fast.cost.peak_mem_bytes[k] for k in lean],
                               [plan.cost.peak_mem_bytes[k] for k in lean],
                               f"the stage DP stored the parameters and optimizer state of {len(lean)} of "
                               f"{len(plan.stages)} stage(s) at their least (the memory-lean solution: split over "
                               "every mesh axis a dimension of theirs takes, ZeRO-3 / FSDP storage)"))
    if not plan.cost.fits:
        notes.append(overflow_note(plan))
    if not notes:
        return plan
    text = "; ".join(notes)
    return dataclasses.replace(plan, notes=(*plan.notes, text), cost=dataclasses.replace(plan.cost, fit_note=text))
