"""The backward's two parts, for the zero-bubble schedule (ZB-H1): the input gradients ``B`` and the weight
gradients ``W``.

``B`` is what an earlier stage waits for: every backward operator whose output a backward operator of an *earlier*
layer reads (the gradient leaving its layer), with every backward operator it depends on. ``W`` is the rest of the
backward (the parameter gradients, and sums of them) and the update: nothing another layer's backward waits for.
The runtime splits a stage's backward task with the same :func:`input_grad_ops`, so the plan prices what runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from ..graph.opgraph import BACKWARD, FORWARD
from ..solve.intra import conversions

if TYPE_CHECKING:
    from ..graph.opgraph import OpGraph
    from ..solve.intra import IntraPlan
    from .table import CostTable

__all__ = ["input_grad_ops", "upstream", "weight_grad_fraction"]

_KEEP = 16  # graphs and IntraPlans whose split is remembered (a plan's stages, a session's few plans)
_ops_memo: dict[int, tuple[object, frozenset[int]]] = {}
_w_memo: dict[int, tuple[object, list[float]]] = {}


def _remember(memo: dict, obj, value):
    if len(memo) >= _KEEP:
        memo.pop(next(iter(memo)))
    memo[id(obj)] = (obj, value)  # the object is kept, so its id is not reused while the entry lives
    return value


def upstream(graph: OpGraph, seeds: Iterable[int], within: Callable[[int], bool]) -> set[int]:
    """``seeds`` and every operator they read from, transitively, through the operators ``within`` accepts."""
    found: set[int] = set()
    todo = list(seeds)
    while todo:
        op = todo.pop()
        if op in found:
            continue
        found.add(op)
        todo.extend(p for t in graph.op(op).inputs if (p := graph.tensor(t).producer) is not None and within(p))
    return found


def input_grad_ops(graph: OpGraph) -> frozenset[int]:
    """The backward operators of ``graph`` on the input-gradient path (``B``, see the module docstring); an
    operator outside every layer counts in the last layer, as in the layer costs."""
    hit = _ops_memo.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    names = list(graph.layers) or [""]
    index: dict[str | None, int] = {name: k for k, name in enumerate(names)}
    last = len(names) - 1
    todo = []
    for node in graph:
        if node.role != BACKWARD:
            continue
        here = index.get(node.layer, last)
        for t in node.outputs:
            if any(graph.op(c).role == BACKWARD and index.get(graph.op(c).layer, last) < here
                   for c in graph.consumers.get(t, ())):
                todo.append(node.id)
                break
    found = upstream(graph, todo, lambda p: graph.op(p).role == BACKWARD)
    return _remember(_ops_memo, graph, frozenset(found))


def _weight_grad_by_layer(table: CostTable, intra: IntraPlan) -> list[float]:
    hit = _w_memo.get(id(intra))
    if hit is not None and hit[0] is intra:
        return hit[1]
    g = table.solve_graph
    names = list(g.layers) or [""]
    index: dict[str | None, int] = {name: k for k, name in enumerate(names)}
    last = len(names) - 1
    b_ops = input_grad_ops(g)
    small = [0.0] * len(names)

    def is_w(op):
        return g.op(op).role != FORWARD and op not in b_ops

    for op in intra.ops:  # the terms layer_costs adds to a layer's bwd_s, those of W
        if is_w(op):
            small[index.get(g.op(op).layer, last)] += intra.strategies[op].cost
    for _u, v, is_alias, _t, _src, _dst, c in conversions(g, intra.ops, intra.strategies,
                                                          table.strategy_cache(intra.mesh)):
        if is_w(v) or (is_alias and g.op(v).role == FORWARD):
            small[index.get(g.op(v).layer, last)] += c
    return _remember(_w_memo, intra, [small[k] for k in table.layer_map])


def weight_grad_fraction(table: CostTable, intra: IntraPlan, costs: Sequence, first: int, last: int) -> float:
    """The share of layers ``first..last``'s backward seconds (``LayerCost.bwd_s`` of ``costs``, the full-graph
    layer costs of ``intra``) that is ``W``: what the ZB-H1 pricing moves from a stage's backward task to its
    weight-gradient task."""
    w = sum(_weight_grad_by_layer(table, intra)[first:last + 1])
    total = sum(c.bwd_s for c in costs[first:last + 1])
    return min(max(w / total, 0.0), 1.0) if total > 0 else 0.0
