"""The one map between a model's full graph and the graph its plan was solved on.

A deep zoo model is solved on a shallower copy (:func:`autopar_lab.pricing.table.solve_graph_for`): its repeated
layers are identical, so each layer of the full graph is priced by a layer of the copy with the same structure, and
each operator of the full graph stands for the copy's operator at the same place in that layer. Strategies of such
a plan are keyed by the copy's operator ids; this map is how the session, the sharding table, export and overrides
get from one graph to the other. For a model solved on its own graph the map is the identity.

Layer indices are positions in ``graph.layers`` (a graph without layers has one, ``""``); an operator without a
layer belongs to the last layer, as the layer costs count it.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..graph.opgraph import INPUT_PRIMITIVE, OpGraph
from ..solve.intra import layer_signature


def plain_signature(graph: OpGraph, layer: str) -> tuple:
    """A layer's structure without its boundary: which operators, not which layer feeds them."""
    ops = graph.ops_in_layer(layer)
    return tuple((p[0], tuple(r for r in p[1] if r[0] == "in")) for p in layer_signature(graph, ops))


def _names(graph: OpGraph) -> list[str]:
    return list(graph.layers) or [""]


def _ops_by_layer(graph: OpGraph, names: list[str]) -> list[list[int]]:
    """Each named layer's operators in graph order (operators without a layer are in none of them)."""
    index = {name: k for k, name in enumerate(names)}
    out: list[list[int]] = [[] for _ in names]
    for node in graph:
        if node.layer is not None and node.layer in index:
            out[index[node.layer]].append(node.id)
    return out


def signature_groups(solve_graph: OpGraph) -> dict[tuple, list[int]]:
    """The solve graph's layer indices grouped by :func:`plain_signature` (ascending in each group)."""
    out: dict[tuple, list[int]] = {}
    for k, name in enumerate(list(solve_graph.layers)):
        out.setdefault(plain_signature(solve_graph, name), []).append(k)
    return out


def layer_map_of(signatures: Sequence[tuple], solve_graph: OpGraph,
                 groups: dict[tuple, list[int]] | None = None) -> list[int]:
    """The solve graph's layer that prices each layer of a graph whose layers have these plain ``signatures``: the
    middle one of the solve graph's layers with that structure (:attr:`OpMap.layer_map`). Raises LookupError for a
    signature the solve graph has no layer of. A graph's signatures may come from its trace or, for a deep zoo
    model, from the pattern of two shallow copies (:mod:`autopar_lab.pricing.deepmap`)."""
    by_sig = signature_groups(solve_graph) if groups is None else groups
    out = []
    for k, sig in enumerate(signatures):
        ks = by_sig.get(sig)
        if not ks:
            raise LookupError(f"layer {k} has no counterpart in the solve graph")
        out.append(ks[len(ks) // 2])
    return out


class OpMap:
    """Full graph <-> solve graph, for operators and for layers.

    ``layer_map[k]``: the solve graph's layer that prices full-graph layer ``k`` (the middle one of the copy's
    layers with its structure). Raises LookupError when some layer of the full graph has no counterpart. A
    ``layer_map`` given is taken as is (a deep zoo model's, derived from two shallow copies without reading the full
    graph, :mod:`autopar_lab.pricing.deepmap`): the full graph is then read only for operator lookups.

    >>> import autopar_lab as al
    >>> deep = al.models.get("gpt-tiny", num_layers=6).trace()
    >>> m = OpMap(deep, al.models.get("gpt-tiny", num_layers=4).trace())
    >>> m.layer_map
    [0, 3, 3, 3, 3, 3, 3, 5]
    >>> m.layer_groups()[1]
    (3, [1, 2, 3, 4, 5, 6])
    >>> op = deep.ops_in_layer("layer_3")[5]
    >>> m.full_ops(m.solve_op(op))[2] == op and m.is_identity
    False

    Every layer of the copy with that structure holds a *sibling* of each operator: a strategy given to one block
    operator of the copy is given to its siblings too (so the layer that prices the blocks reads its input from a
    layer sharded the same way), and the sibling in the pricing layer (:meth:`representative`) names them all:

    >>> first = al.models.get("gpt-tiny", num_layers=4).trace().ops_in_layer("layer_0")[5]
    >>> len(m.siblings(first)), m.representative(first) == m.solve_op(op), m.full_layers_of(first)
    (4, True, [1, 2, 3, 4, 5, 6])
    >>> m.full_op_in(first, 4) == op   # full layer 4 is layer_3 (layer 0 is the embedding)
    True
    """

    def __init__(self, graph: OpGraph, solve_graph: OpGraph | None = None, layer_map: Sequence[int] | None = None):
        self.graph = graph
        self.solve_graph = solve_graph if solve_graph is not None else graph
        self.full_layer_names = _names(graph)
        self.solve_layer_names = _names(self.solve_graph)
        self._by_sig: dict[tuple, list[int]] = {}
        self.layer_map = self._layer_map(layer_map)
        self._to_solve: dict[int, int] | None = None
        self._place: dict[int, tuple[int, int]] | None = None  # solve op -> (its layer, its place in the layer)
        self._solve_ops: list[list[int]] = []  # per solve layer, its operators (layered ones only)
        self._full_ops: list[list[int]] | None = None
        self._to_full: dict[int, list[int]] | None = None
        self._solve_layer_index: dict[int, int] | None = None

    @property
    def is_identity(self) -> bool:
        """True when the plan was solved on the full graph itself."""
        return self.solve_graph is self.graph

    def _layer_map(self, given: Sequence[int] | None) -> list[int]:
        if self.is_identity:
            return list(range(len(self.full_layer_names)))
        self._by_sig = signature_groups(self.solve_graph)
        if given is not None:
            return [int(k) for k in given]
        return layer_map_of([plain_signature(self.graph, name) for name in self.full_layer_names], self.solve_graph,
                            self._by_sig)

    # --- layers ---------------------------------------------------------------------------------------------------
    def solve_layer(self, full_layer: int) -> int:
        """The solve graph's layer index that prices full-graph layer ``full_layer``."""
        return self.layer_map[full_layer]

    def full_layers(self, solve_layer: int) -> list[int]:
        """Every full-graph layer the solve graph's layer ``solve_layer`` stands for (ascending)."""
        return [k for k, m in enumerate(self.layer_map) if m == solve_layer]

    def layer_groups(self) -> list[tuple[int, list[int]]]:
        """(solve layer, [full layers it prices]) in full-graph order of first appearance: the layers that share one
        solution (for a deep model, e.g. layers 1..24 all priced by one middle layer of the copy)."""
        out: dict[int, list[int]] = {}
        for k, m in enumerate(self.layer_map):
            out.setdefault(m, []).append(k)
        return list(out.items())

    def sharing(self, full_layer: int) -> list[int]:
        """The full-graph layers that share ``full_layer``'s solution (itself included)."""
        return self.full_layers(self.layer_map[full_layer])

    # --- operators ------------------------------------------------------------------------------------------------
    def solve_layer_of(self, solve_op: int) -> int:
        """The index of the solve graph's layer that operator ``solve_op`` counts in (no layer: the last)."""
        if self._solve_layer_index is None:
            index: dict[str | None, int] = {name: k for k, name in enumerate(self.solve_layer_names)}
            last = len(index) - 1
            self._solve_layer_index = {op: index.get(self.solve_graph.op(op).layer, last)
                                       for op in self.solve_graph.ops}
        return self._solve_layer_index[solve_op]

    def full_layers_of(self, solve_op: int) -> list[int]:
        """The full-graph layers operator ``solve_op`` of the solve graph stands for (for an operator of a copy
        layer that prices none, those of its :meth:`representative`)."""
        return self.full_layers(self.solve_layer_of(self.representative(solve_op)))

    # --- siblings: the same place in every copy layer with the same structure -------------------------------------
    def _places(self) -> dict[int, tuple[int, int]]:
        if self._place is None:
            place: dict[int, tuple[int, int]] = {}
            self._solve_ops = _ops_by_layer(self.solve_graph, self.solve_layer_names)
            for j, ops in enumerate(self._solve_ops):
                for i, op in enumerate(ops):
                    place[op] = (j, i)
            self._place = place
        return self._place

    def _same_structure(self, solve_layer: int) -> list[int]:
        for ks in self._by_sig.values():
            if solve_layer in ks:
                return ks
        return [solve_layer]

    def siblings(self, solve_op: int) -> list[int]:
        """The solve graph's operators at ``solve_op``'s place in every one of its layers with the structure of
        ``solve_op``'s layer, itself included (ascending). They stand for the same full-graph operators and take
        one strategy together (:func:`~autopar_lab.overrides.with_choice`). Just ``[solve_op]`` for a model
        solved on its own graph and for operators outside layers."""
        solve_op = int(solve_op)
        hit = None if self.is_identity else self._places().get(solve_op)
        if hit is None:
            return [solve_op]
        j, i = hit
        return sorted(self._solve_ops[k][i] for k in self._same_structure(j))

    def representative(self, solve_op: int) -> int:
        """The sibling of ``solve_op`` in the copy layer that prices full layers (:attr:`layer_map`): the one id a
        pin on any of the siblings is recorded under. ``solve_op`` itself when it is that one (always, for a model
        solved on its own graph)."""
        solve_op = int(solve_op)
        hit = None if self.is_identity else self._places().get(solve_op)
        if hit is None:
            return solve_op
        priced = set(self.layer_map)
        for sib in self.siblings(solve_op):
            if self._places()[sib][0] in priced:
                return sib
        return solve_op

    def full_op_in(self, solve_op: int, full_layer: int) -> int | None:
        """The operator of full-graph layer ``full_layer`` that ``solve_op`` (or its representative) stands for; None
        when that layer is not one of :meth:`full_layers_of`."""
        rep = self.representative(solve_op)
        if self.is_identity:
            return rep if full_layer in self.full_layers_of(rep) else None
        hit = self._places().get(rep)
        if hit is None or self.layer_map[full_layer] != hit[0]:
            return None
        if self._full_ops is None:
            self._full_ops = _ops_by_layer(self.graph, self.full_layer_names)
        ops = self._full_ops[full_layer]
        return ops[hit[1]] if hit[1] < len(ops) else None

    def full_layer_of(self, full_op: int) -> int:
        """The index of the full-graph layer operator ``full_op`` counts in (no layer: the last)."""
        layer = self.graph.op(int(full_op)).layer
        names = self.full_layer_names
        return names.index(layer) if layer in names else len(names) - 1

    def solve_op(self, full_op: int) -> int | None:
        """The solve graph's operator that stands for operator ``full_op`` of the full graph (the same position in
        the layer :attr:`layer_map` prices it with; operators outside layers: the input with the same pytree path,
        else the one at the same position when both graphs have as many); None when there is none."""
        if self.is_identity:
            return int(full_op)
        return self._forward().get(int(full_op))

    def full_ops(self, solve_op: int) -> list[int]:
        """Every operator of the full graph that operator ``solve_op`` of the solve graph stands for (ascending)."""
        if self.is_identity:
            return [int(solve_op)]
        if self._to_full is None:
            back: dict[int, list[int]] = {}
            for full, small in sorted(self._forward().items()):
                back.setdefault(small, []).append(full)
            self._to_full = back
        return list(self._to_full.get(int(solve_op), []))

    def items(self) -> Iterable[tuple[int, int]]:
        """(full op, solve op) for every full-graph operator that has a counterpart."""
        return self._forward().items() if not self.is_identity else ((op, op) for op in self.graph.ops)

    def __len__(self) -> int:
        return len(self.graph.ops) if self.is_identity else len(self._forward())

    def _forward(self) -> dict[int, int]:
        if self._to_solve is None:
            self._to_solve = self._build()
        return self._to_solve

    def _build(self) -> dict[int, int]:
        full, small = self.graph, self.solve_graph
        out: dict[int, int] = {}
        for k, name in enumerate(self.full_layer_names):
            src = full.ops_in_layer(name)
            dst = small.ops_in_layer(self.solve_layer_names[self.layer_map[k]])
            if len(src) == len(dst):  # equal plain signatures: the same operators in the same order
                out.update(zip(src, dst))
        # Operators outside layers: by position when both graphs have as many, and inputs by pytree path (which
        # holds even when they do not).
        src = [n.id for n in full if n.layer is None]
        dst = [n.id for n in small if n.layer is None]
        if len(src) == len(dst):
            out.update(zip(src, dst))
        by_path = {}
        for node in small:
            if node.layer is None and node.primitive == INPUT_PRIMITIVE:
                by_path[small.tensor(node.outputs[0]).path] = node.id
        for node in full:
            if node.layer is None and node.primitive == INPUT_PRIMITIVE:
                hit = by_path.get(full.tensor(node.outputs[0]).path)
                if hit is not None:
                    out[node.id] = hit
        return out
