"""One operator id for users: every operator a user passes or reads is one of the model's own graph, ``plan.graph``.

A deep model is solved on a shallower copy of itself (:func:`~autopar_lab.pricing.table.solve_graph_for`): its
strategies are kept per operator of the copy (``plan.op_graph``), every layer of the model is priced by one layer of
the copy with its structure, and the layers priced by one copy layer share one solution
(:class:`~autopar_lab.pricing.opmap.OpMap`). The copy is an internal detail; this module answers for an operator of
``plan.graph``: its strategy (:func:`choice`), its stage (:func:`stage_of`), the stages a change of its shared
solution reaches (:func:`stages_of`), its pin (:func:`pin_of`) and where a new pin is recorded (:func:`pins_with`).

An override's *scope* says what it changes: ``"shared"`` (the default) the operator in every layer that shares its
layer's solution, on every stage that runs one of them; ``"layer"`` the operator in its layer alone (the layer is
split from the others and priced on its own). For a model solved on its own graph every layer has a solution of its
own and the two are the same. The default is the shared one because the planner's decisions are per solution: the
blocks of a deep model run one solution, and a change to one block's operator is, unless asked otherwise, a change
to the solution (it keeps the blocks alike, as the planner made them and as :func:`~autopar_lab.pins.resolve`
re-solves them).

Pins (``plan.pins``: operator -> :class:`~autopar_lab.planvalues.Pin`) follow the same ids. A pin of a layer alone
is recorded under its operator; a pin of a shared solution under the operator at that place in the first layer
sharing the solution that has no pin of its own there (so one map holds both, and each place of a solution has at
most one shared pin).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from . import checks
from .layergroups import stage_of_layer
from .planvalues import LAYER, SCOPES, SHARED, Pin
from .pricing.opmap import OpMap

if TYPE_CHECKING:
    from .plan import Plan
    from .sharding.strategies import Strategy

__all__ = ["SCOPES", "op_map", "check_op", "check_scope", "layer_index", "stage_of", "stages_of", "stand_in",
           "shares_solution", "choice", "shared_choices", "places", "shared_pin_key", "pin_of", "pins_with",
           "normalised_pins", "split_layers", "layer_operators", "user_op", "solve_stage_of", "ilp_group"]


def op_map(plan: Plan) -> OpMap:
    """The plan's map between its graph and the graph it was solved on (the identity without a cost table)."""
    return plan.table.op_map if plan.table is not None else OpMap(plan.graph)


def check_op(plan: Plan, op) -> int:
    """``op`` as an operator id of ``plan.graph``; a ValueError naming the valid range otherwise."""
    op = checks.op_id(op)
    g = plan.graph
    try:
        if op < 0:  # a list would take -1 as the last operator
            raise KeyError(op)
        g.op(op)
    except (KeyError, IndexError):
        raise ValueError(f"operator {op} is not in this plan's graph (ids run 0..{len(g.ops) - 1}; they are "
                         "plan.graph's, the operators every view shows)") from None
    return op


def check_scope(scope) -> str:
    """``scope`` if it is one of :data:`SCOPES`; a ValueError saying what each means otherwise."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be {SHARED!r} (the operator in every layer that shares its layer's solution) "
                         f"or {LAYER!r} (in its layer alone), got {scope!r:.40}")
    return scope


def layer_index(plan: Plan, op: int) -> int:
    """The index in ``plan.layer_names`` of operator ``op``'s layer (an operator outside layers: the last)."""
    return op_map(plan).full_layer_of(op)


def stage_of(plan: Plan, op) -> int:
    """The stage that runs operator ``op``'s layer (an operator outside layers: the last layer's)."""
    return stage_of_layer(plan, layer_index(plan, check_op(plan, op)))


def stand_in(plan: Plan, op: int) -> int:
    """The operator of the graph the plan was solved on whose strategy ``op`` runs (itself, for a model solved on its
    own graph); a ValueError when that graph has none in its place."""
    sop = op_map(plan).solve_op(op)
    if sop is None:
        raise ValueError(f"operator {plan.graph.op(op).describe()} has no strategy in this plan: the graph it was "
                         "solved on has no operator in its place")
    return sop


def shares_solution(plan: Plan, op: int) -> bool:
    """Whether ``op``'s layer shares its solution with other layers (a block of a deep model)."""
    m = op_map(plan)
    if m.is_identity or plan.graph.op(op).layer is None:
        return False
    return len(m.sharing(m.full_layer_of(op))) > 1


def stages_of(plan: Plan, op) -> list[int]:
    """Every stage that runs a layer sharing operator ``op``'s solution, ascending (what a shared override of ``op``
    re-prices); ``[stage_of(op)]`` for an operator whose layer shares nothing."""
    op = check_op(plan, op)
    layers = op_map(plan).full_layers_of(stand_in(plan, op))
    out = [s for s, st in enumerate(plan.stages) if any(a <= i <= b for a, b in st.layer_ranges for i in layers)]
    return out or [stage_of(plan, op)]


def choice(plan: Plan, op) -> Strategy:
    """The strategy operator ``op`` runs with: its layer's own pin when it has one, else its solution's strategy in
    the stage that runs its layer. KeyError when no stage holds one."""
    op = check_op(plan, op)
    sop = stand_in(plan, op)
    intra = plan.stages[stage_of(plan, op)].intra
    if intra is None or sop not in intra.strategies:
        for st in plan.stages:
            if st.intra is not None and sop in st.intra.strategies:
                return st.intra.strategies[sop]
        raise KeyError(f"operator {op} has no strategy in this plan")
    own = plan.pins.get(op)
    if own is not None and own.scope == LAYER and plan.table is not None:
        hit = [s for s in plan.table.strategy_cache(intra.mesh).strategies(plan.op_graph.op(sop))
               if s.name == own.strategy]
        if hit:
            return hit[0]
    return intra.strategies[sop]


def shared_choices(plan: Plan, op) -> list[tuple[int, Strategy]]:
    """(stage, strategy) of operator ``op``'s shared solution on each stage that runs a layer sharing it (a layer's
    own pin aside): what a row of a group of layers shows."""
    op = check_op(plan, op)
    sop = stand_in(plan, op)
    out = []
    for k in stages_of(plan, op):
        intra = plan.stages[k].intra
        if intra is not None and sop in intra.strategies:
            out.append((k, intra.strategies[sop]))
    return out


def places(plan: Plan, op: int) -> list[int]:
    """The operators at ``op``'s place in every layer that shares its layer's solution, ascending (``[op]`` for an
    operator whose layer shares nothing)."""
    if not shares_solution(plan, op):
        return [op]
    m = op_map(plan)
    return m.full_ops(m.representative(stand_in(plan, op))) or [op]


def shared_pin_key(plan: Plan, op: int, pins: Mapping[int, Pin]) -> int | None:
    """The operator under which ``pins`` records the shared pin of ``op``'s place, or None."""
    return next((key for key in places(plan, op) if key in pins and pins[key].scope == SHARED), None)


def pin_of(plan: Plan, op) -> Pin | None:
    """The pin that holds operator ``op``: its layer's own, else its shared solution's; None when neither has one."""
    op = check_op(plan, op)
    own = plan.pins.get(op)
    if own is not None and own.scope == LAYER:
        return own
    key = shared_pin_key(plan, op, plan.pins)
    return None if key is None else plan.pins[key]


def _free(keys: list[int], pins: Mapping[int, Pin]) -> int | None:
    """The first of ``keys`` without a layer's own pin in ``pins``: where a shared pin of that place is recorded."""
    return next((k for k in keys if k not in pins or pins[k].scope == SHARED), None)


def normalised_pins(plan: Plan, pins: Mapping[int, Pin]) -> dict[int, Pin]:
    """``pins`` with every shared pin recorded where the rules say (see the module docstring): under its place in
    the first layer sharing the solution without a pin of its own there. A shared pin with no such layer left
    (every layer holds its own pin there) is dropped: it changes nothing."""
    out = {op: p for op, p in pins.items() if p.scope == LAYER}
    for op, p in pins.items():
        if p.scope == SHARED:
            key = _free(places(plan, op), out)
            if key is not None:
                out[key] = p
    return dict(sorted(out.items()))


def pins_with(plan: Plan, op: int, pin: Pin, pins: Mapping[int, Pin] | None = None) -> dict[int, Pin]:
    """``pins`` (default the plan's) with ``pin`` on operator ``op``: a shared pin replaces the shared pin of
    ``op``'s place (the layers' own pins there stay); a layer's pin replaces that layer's pin of ``op``. Recorded by
    :func:`normalised_pins`' rules."""
    out = dict(plan.pins if pins is None else pins)
    here = places(plan, op)
    if pin.scope == SHARED:
        out = {k: p for k, p in out.items() if not (k in here and p.scope == SHARED)}
        key = _free(here, out)
        if key is not None:
            out[key] = pin
        return normalised_pins(plan, out)
    shared = out.get(op)
    out[op] = pin
    if shared is not None and shared.scope == SHARED:
        key = _free(here, out)  # the shared pin moves on to the next layer without a pin of its own there
        if key is not None:
            out[key] = shared
    return normalised_pins(plan, out)


def split_layers(plan: Plan) -> set[int]:
    """The layers (indices in ``plan.layer_names``) split from the layers that share their solution: those with a
    pin of their own."""
    return {layer_index(plan, op) for op, p in plan.pins.items() if p.scope == LAYER}


def layer_operators(plan: Plan, layer: int | None) -> list[int]:
    """The operators of layer ``layer`` (an index in ``plan.layer_names``; None: those outside every layer) that
    have a strategy in this plan, in graph order."""
    g, m = plan.graph, op_map(plan)
    if layer is None:
        ops = [n.id for n in g if n.layer is None]
    else:
        ops = list(g.ops_in_layer(plan.layer_names[layer]))
    return [op for op in ops if m.solve_op(op) is not None]


# --- from the solve graph back to the user's ids (what the modules that read strategies per solve op need) ----------


def user_op(plan: Plan, sop: int) -> int | None:
    """The operator of ``plan.graph`` a change of solve-graph operator ``sop`` is asked with: the first operator its
    solution stands for (None when it stands for none)."""
    m = op_map(plan)
    full = m.full_ops(m.representative(sop))
    return full[0] if full else None


def solve_stage_of(plan: Plan, sop: int) -> int:
    """The first stage that runs a layer solve-graph operator ``sop`` stands for (an operator of a copy layer that
    prices none: its representative's layers)."""
    layers = op_map(plan).full_layers_of(sop)
    return next((s for s, st in enumerate(plan.stages) if any(a <= i <= b for i in layers for a, b in st.layer_ranges)),
                len(plan.stages) - 1)


def ilp_group(plan: Plan, op: int, stage: int) -> str:
    """How the intra-op ILP of ``stage``'s mesh solved operator ``op``'s layer (``"layer_2: solved"``, ``"...:
    reused from layer_1, 3 merged"``; ``""`` when it says nothing); for a plan solved on a shallower copy the layer
    named is the copy's."""
    intra = plan.stages[stage].intra
    if intra is None:
        return ""
    layer = plan.op_graph.op(stand_in(plan, op)).layer
    text = ""
    for gs in intra.groups:  # the last group naming the layer says (a layer may be named by several)
        if layer in [None if name == "(no layer)" else name for name in gs.name.split("+")]:
            text = f"{gs.name}: " + (f"reused from {gs.reused_from}" if gs.reused_from else gs.status) + \
                (f", {gs.merges} merged" if gs.merges else "")
    return text
