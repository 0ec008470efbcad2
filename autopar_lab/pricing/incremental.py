"""Re-pricing one strategy change without pricing the whole graph again.

An override that changes one operator's strategy (:meth:`~autopar_lab.plan.Plan.with_choice`, and every row of
:meth:`~autopar_lab.plan.Plan.alternatives`) gets a :class:`LazyIntraPlan` (the old choice with one strategy
replaced, its totals computed only when read) and its layer costs from :func:`changed_layer_costs`, which prices
again only the layers the change can reach, to the same bits as pricing every layer.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from ..graph.opgraph import INPUT_PRIMITIVE, OUTPUT_PRIMITIVE
from ..solve.intra import IntraPlan, StrategyCache, evaluate_intra
from .layers import LayerCost, layer_costs

if TYPE_CHECKING:
    from .table import CostTable

_TOTALS = ("compute_s", "comm_s", "reshard_s", "role_s", "sync_s", "static_bytes", "act_bytes", "collectives")


class LazyIntraPlan(IntraPlan):
    """An :class:`IntraPlan` whose totals (compute, collectives, resharding, memory) are computed by
    :func:`evaluate_intra` the first time one is read: an override needs only the strategies and its layers' costs
    to re-price a plan, and evaluating every operator and edge again is what would make it slow. Once computed the
    totals are exactly evaluate_intra's."""

    def __init__(self, graph=None, mesh=None, strategies=None, ops=(), cache=None, groups=(), solve_s=0.0,
                 **totals):  # noqa: D107
        for name, value in (("mesh", mesh), ("ops", tuple(ops)), ("strategies", dict(strategies or {})),
                            ("groups", groups), ("solve_s", solve_s)):
            object.__setattr__(self, name, value)
        if totals:  # dataclasses.replace passes every field: nothing left to compute
            for name, value in totals.items():
                object.__setattr__(self, name, value)
        else:
            object.__setattr__(self, "_lazy", (graph, cache))

    def __getattr__(self, name):
        lazy = self.__dict__.get("_lazy")
        if name not in _TOTALS or lazy is None:
            raise AttributeError(name)
        full = evaluate_intra(lazy[0], self.mesh, self.strategies, ops=self.ops, cache=lazy[1], groups=self.groups,
                              solve_s=self.solve_s)
        for f in _TOTALS:
            object.__setattr__(self, f, getattr(full, f))
        self.__dict__.pop("_lazy", None)
        return getattr(self, name)

    def __reduce__(self):
        # Pickled (and deep-copied) as the plain IntraPlan it stands for, totals computed.
        return IntraPlan, tuple(getattr(self, f.name) for f in dataclasses.fields(IntraPlan))

    def __eq__(self, other):
        if not isinstance(other, IntraPlan):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in dataclasses.fields(IntraPlan))

    __hash__ = None  # type: ignore[assignment]


def changed_layer_costs(table: CostTable, old: IntraPlan, new: IntraPlan, op: int, old_costs: Sequence[LayerCost],
                        cache: StrategyCache) -> list[LayerCost]:
    """The full-graph layer costs of ``new`` (``old`` with operator ``op``'s strategy changed), recomputing only
    the layers the change can reach, bit for bit as :func:`~autopar_lab.pricing.layers.layer_costs` on the whole
    graph.

    Why it is exact: layer_costs adds each operator's cost into its own layer and each resharding into its
    consumer's layer, in graph order, and counts a conversion of one tensor to one spec once (the first consumer
    reading it that way pays). Changing ``op`` changes its own cost and the conversions of its input and output
    tensors, so the layers touched are ``op``'s and those of every consumer of those tensors (and of the output it
    aliases). Those layers are recomputed by layer_costs itself on a sub-plan holding every operator of them, the
    producers they read, and every consumer of the tensors they read (so the "first consumer pays" rule sees the
    same readers in the same order); the other layers keep their costs.
    """
    g = table.solve_graph
    names = list(g.layers) or [""]
    layer_of = table.op_map.solve_layer_of
    node = g.op(op)
    touched = {op}
    for t in (*node.inputs, *node.outputs):
        touched.update(g.consumers.get(t, ()))
    for v in (g.ops if node.primitive == INPUT_PRIMITIVE else ()):
        # An output aliasing the parameter this op produces: the alias edge is priced in the output's layer.
        nv = g.op(v)
        if nv.primitive == OUTPUT_PRIMITIVE and nv.params.get("alias_of") is not None and \
                g.tensor(nv.params["alias_of"]).producer == op:
            touched.add(v)
    layers = {layer_of(v) for v in touched}
    inside = set(old.ops)
    sub = {v for v in old.ops if layer_of(v) in layers}
    extra: set[int] = set()
    for v in sub:
        nv = g.op(v)
        for t in nv.inputs:
            extra.update(g.consumers.get(t, ()))
            u = g.tensor(t).producer
            if u is not None:
                extra.add(u)
        if nv.primitive == OUTPUT_PRIMITIVE and nv.params.get("alias_of") is not None:
            u = g.tensor(nv.params["alias_of"]).producer
            if u is not None:
                extra.add(u)
    sub |= extra & inside
    ops = tuple(v for v in old.ops if v in sub)
    view = LazyIntraPlan(g, new.mesh, new.strategies, ops, cache)
    small = layer_costs(g, view, names, cache=cache)
    return [small[k] if k in layers else c for k, c in zip(table.layer_map, old_costs)]
