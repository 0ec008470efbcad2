"""Re-pricing one strategy change without pricing the whole graph again.

An override that changes one operator's strategy (:meth:`~autopar_lab.plan.Plan.with_choice`, and every row of
:meth:`~autopar_lab.plan.Plan.alternatives`) gets a :class:`LazyIntraPlan` (the old choice with one strategy
replaced, its totals computed only when read: :meth:`LazyIntraPlan.with_strategies`) and its layer costs from
:func:`changed_layer_costs`, which prices again only the layers the change can reach, to the same bits as pricing
every layer. A full-graph layer split from
the layers that share its solution (its own operator pins, a "layer" scope in ``Plan.pins``) is priced on its own by
:func:`split_layer_costs`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np

from ..graph.opgraph import INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, OpGraph
from ..lazy import Lazy
from ..solve.intra import IntraPlan, StrategyCache, evaluate_intra
from .layers import LayerCost, layer_costs
from .table_pool import mesh_key, plan_from_choice

if TYPE_CHECKING:
    from ..cluster import Cluster
    from .table import CostTable

_TOTALS = ("compute_s", "comm_s", "reshard_s", "role_s", "sync_s", "static_bytes", "act_bytes", "collectives")
_FIELDS = tuple(f.name for f in dataclasses.fields(IntraPlan))


class LazyIntraPlan(Lazy, IntraPlan):
    """An :class:`IntraPlan` whose fields are computed the first time one is read (a :class:`~autopar_lab.lazy.Lazy`
    value); once read they are exactly what computing them at once gives. Two kinds:

    - :meth:`with_strategies`: an override's plan, the strategies given and the totals (compute, collectives,
      resharding, memory) :func:`evaluate_intra`'s: an override needs only the strategies and its layers' costs to
      re-price a plan, and evaluating every operator and edge again is what would make it slow.
    - :meth:`from_choice`: a mesh solved in a worker process (or for another cluster), rebuilt from its strategy
      indices (:func:`~autopar_lab.pricing.table_pool.plan_from_choice`). The stage DP hands each stage candidate its
      mesh's plan and most are never read (a second or so each for GPT-39B's 4-layer copy). Unlike a plain IntraPlan
      it pickles as what rebuilds it: the graph, the cluster (as its JSON form), the mesh key and the indices.
    """

    @classmethod
    def with_strategies(cls, graph, mesh, strategies, ops=(), cache=None, groups=(), solve_s=0.0) -> LazyIntraPlan:
        """The plan running ``strategies`` on ``mesh``, its totals :func:`evaluate_intra`'s when first read."""
        strategies, ops = dict(strategies), tuple(ops)

        def fill():
            full = evaluate_intra(graph, mesh, strategies, ops=ops, cache=cache, groups=groups, solve_s=solve_s)
            return {f: getattr(full, f) for f in _TOTALS}

        return cls.defer(fill, names=_TOTALS, mesh=mesh, ops=ops, strategies=strategies, groups=groups,
                         solve_s=solve_s)

    @classmethod
    def from_choice(cls, graph: OpGraph, cluster: Cluster, key, choice: np.ndarray) -> LazyIntraPlan:
        """The plan of mesh ``key`` solved elsewhere, rebuilt from its strategy indices when first read."""
        recipe = (graph, cluster, mesh_key(key), np.asarray(choice))

        def fill():
            plan = plan_from_choice(*recipe)
            return {f: getattr(plan, f) for f in _FIELDS}

        obj = cls.defer(fill, names=_FIELDS)
        obj.__dict__["_recipe"] = recipe
        return obj

    def __reduce__(self):
        recipe = self.__dict__.get("_recipe")
        if recipe is None:
            return super().__reduce__()  # the plain IntraPlan it stands for, totals computed
        graph, cluster, key, choice = recipe
        return rebuilt_plan, (graph, cluster.to_dict(), key, choice)  # a Cluster pickles as its JSON form

    def __eq__(self, other):
        if not isinstance(other, IntraPlan):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in _FIELDS)

    __hash__ = None  # type: ignore[assignment]


def rebuilt_plan(graph: OpGraph, cluster_dict: dict, key, choice: np.ndarray) -> LazyIntraPlan:
    """A :meth:`LazyIntraPlan.from_choice` unpickled."""
    from ..cluster import Cluster

    return LazyIntraPlan.from_choice(graph, Cluster.from_json(cluster_dict), key, choice)


def changed_layer_costs(table: CostTable, old: IntraPlan, new: IntraPlan, op: int | Iterable[int],
                        old_costs: Sequence[LayerCost], cache: StrategyCache) -> list[LayerCost]:
    """The full-graph layer costs of ``new`` (``old`` with the strategy of operator ``op``, or of each operator of
    an iterable ``op``, changed), recomputing only the layers the change can reach, bit for bit as
    :func:`~autopar_lab.pricing.layers.layer_costs` on the whole graph.

    Why it is exact: layer_costs adds each operator's cost into its own layer and each resharding into its
    consumer's layer, in graph order, and counts a conversion of one tensor to one spec once (the first consumer
    reading it that way pays). Changing ``op`` changes its own cost and the conversions of its input and output
    tensors, so the layers touched are ``op``'s and those of every consumer of those tensors (and of the output it
    aliases). Those layers are recomputed by layer_costs itself on a sub-plan holding every operator of them, the
    producers they read, and every consumer of the tensors they read (so the "first consumer pays" rule sees the
    same readers in the same order); the other layers keep their costs. Only layers that price some full-graph
    layer (:attr:`~autopar_lab.pricing.table.CostTable.layer_map`) are recomputed: the others' costs are never read.
    """
    g = table.solve_graph
    layer_of = table.op_map.solve_layer_of
    touched: set[int] = set()
    for one in ([op] if isinstance(op, int) else op):
        touched |= _reached(g, int(one))
    layers = {layer_of(v) for v in touched} & set(table.layer_map)
    small = _costs_of_layers(table, old, new, layers, cache)
    return [small[k] if k in layers else c for k, c in zip(table.layer_map, old_costs)]


def _reached(g, op: int) -> set[int]:
    """``op`` and the operators whose layer's cost a change of ``op``'s strategy can change (see above)."""
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
    return touched


def _costs_of_layers(table: CostTable, old: IntraPlan, new: IntraPlan, layers: set[int],
                     cache: StrategyCache) -> list[LayerCost]:
    """layer_costs of ``new`` on the solve graph, right (to the bit) for the solve layers in ``layers`` only: priced
    on a sub-plan of ``old.ops`` that holds every operator those layers' costs read (see changed_layer_costs)."""
    g = table.solve_graph
    names = list(g.layers) or [""]
    layer_of = table.op_map.solve_layer_of
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
    view = LazyIntraPlan.with_strategies(g, new.mesh, new.strategies, ops, cache)
    return layer_costs(g, view, names, cache=cache)


def split_layer_costs(table: CostTable, intra: IntraPlan, costs: Sequence[LayerCost], layers: tuple[int, int],
                      layer_pins: Mapping[int, str], cache: StrategyCache, stage: int = 0) -> list[LayerCost] | None:
    """The full-graph layer costs ``costs`` of ``intra`` with every *split* layer in ``layers`` (first, last)
    priced on its own: a full-graph layer with operators in ``layer_pins`` (full-graph op -> strategy name) no
    longer shares the solution of the layers its copy layer prices. Its cost is its copy layer's cost under
    ``intra`` with those operators' stand-ins (:meth:`OpMap.solve_op`) run by the pinned strategies; every other
    layer keeps its cost (the edges out of a split layer into the next one keep the group's price: the next layer's
    cost is its copy layer's, which reads an unsplit layer). None when no split layer falls in ``layers``.

    Raises ValueError naming the operator when a pinned strategy is not one of its strategies on ``intra``'s mesh.
    """
    m = table.op_map
    g = table.solve_graph
    by_layer: dict[int, dict[int, str]] = {}
    for full_op, name in layer_pins.items():
        k = m.full_layer_of(full_op)
        if layers[0] <= k <= layers[1]:
            sop = m.solve_op(full_op)
            if sop is None:
                raise ValueError(f"operator {full_op} of the model has no counterpart in the graph the plan was "
                                 "solved on, so it cannot be pinned on its own")
            by_layer.setdefault(k, {})[sop] = name
    if not by_layer:
        return None
    out = list(costs)
    mesh = intra.mesh
    for k, pins in sorted(by_layer.items()):
        chosen = dict(intra.strategies)
        for sop, name in pins.items():
            hit = [s for s in cache.strategies(g.op(sop)) if s.name == name]
            if not hit:
                raise ValueError(f"operator {g.op(sop).describe()} of {m.full_layer_names[k]} is pinned to {name!r}, "
                                 f"which is not one of its strategies on stage {stage}'s {mesh.shape[0]}x"
                                 f"{mesh.shape[1]} logical mesh; pin it to a strategy of that mesh or unpin it.")
            chosen[sop] = hit[0]
        j = m.layer_map[k]
        view = LazyIntraPlan.with_strategies(g, mesh, chosen, intra.ops, cache)
        out[k] = _costs_of_layers(table, intra, view, {j}, cache)[j]
    return out
