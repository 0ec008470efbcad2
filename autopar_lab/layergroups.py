"""Which real layers of a plan share one solution: what the sharding table and the operator graph show of a deep model.

A deep zoo model is solved on a shallower copy, and every block of the model is priced by one layer of the copy
(:class:`~autopar_lab.pricing.OpMap`): the 24 blocks of GPT-1.3B run one solution. :func:`layer_groups` lists a
plan's layers as the user should see them: each group of real layers that shares a solution (with the stages that
run it), each layer split from its group (a pin of its own: ``plan.with_choice(op, s, scope="layer")``) on its own,
and every other layer alone. For a model solved on its own graph every layer is a group of one.

    >>> [g.label for g in layer_groups(plan)]                   # doctest: +SKIP
    ['embed', 'layer_0..23 (×24, one solution; S0: layer_0..11, S1: layer_12..23)', 'head']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .planvalues import LAYER

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["LayerGroup", "layer_groups", "group_of_layer", "stage_of_layer", "span_text"]


@dataclass(frozen=True)
class LayerGroup:
    """Real layers (indices into ``plan.layer_names``) that run one solution.

    ``solve_layer``: the layer of the graph the plan was solved on that prices them; ``stages``: the stages that run
    them, ascending; ``split``: a single layer split from the layers that share its solution (it has pins of its
    own); ``shared``: how many real layers that solve layer prices in all (1 for a layer that shares nothing)."""

    layers: tuple[int, ...]
    names: tuple[str, ...]
    stages: tuple[int, ...]
    stage_layers: tuple[tuple[int, tuple[str, ...]], ...]  # (stage, the names of its layers in this group)
    solve_layer: int
    split: bool
    shared: int
    split_off: tuple[str, ...] = ()  # layers of this solution split from the group (their own pins)

    @property
    def key(self) -> str:
        """A stable name for the group: its first layer's name (``"layer_0.."`` for a group of several)."""
        return self.names[0] + (".." if len(self.names) > 1 else "")

    @property
    def label(self) -> str:
        """``"layer_0..layer_23 (×24, one solution)"``, with the layers of each stage when it spans several;
        ``"layer_13 (split from its group)"``; a lone layer's name."""
        if len(self.names) == 1:
            return self.names[0] + (" (split from its group)" if self.split else "")
        text = span_text(self.names)
        if self.split_off:
            text += f" but {', '.join(self.split_off)}"
        text += f" (×{len(self.names)}, one solution"
        if len(self.stages) > 1:
            text += "; " + ", ".join(f"S{k}: {span_text(names)}" for k, names in self.stage_layers)
        return text + ")"


def span_text(names) -> str:
    """``"layer_0..11"`` for a run of names from ``layer_0`` to ``layer_11`` (the last one's common prefix left
    out; one name: itself).

    >>> span_text(["layer_0", "layer_1", "layer_11"]), span_text(["embed", "head"]), span_text(["head"])
    ('layer_0..11', 'embed..head', 'head')
    """
    names = list(names)
    if len(names) == 1:
        return names[0]
    first, last = names[0], names[-1]
    stem = first.rstrip("0123456789")
    if stem and stem == last.rstrip("0123456789") and first != stem and last != stem:
        return f"{first}..{last[len(stem):]}"
    return f"{first}..{last}"


def stage_of_layer(plan: Plan, k: int) -> int:
    """The index of the stage that runs real layer ``k``."""
    return next((s for s, st in enumerate(plan.stages) if any(a <= k <= b for a, b in st.layer_ranges)),
                len(plan.stages) - 1)


def _split_layers(plan: Plan) -> set[int]:
    """The layers with pins of their own (a "layer" scope in ``plan.pins``)."""
    own = [op for op, p in plan.pins.items() if p.scope == LAYER]
    if not own or plan.table is None:
        return set()
    return {plan.table.op_map.full_layer_of(op) for op in own}


def layer_groups(plan: Plan) -> list[LayerGroup]:
    """The plan's real layers as groups sharing one solution, in the order of their first layer (see the module
    docstring)."""
    names = list(plan.layer_names)
    if plan.table is None:
        pairs = [(k, [k]) for k in range(len(names))]
    else:
        pairs = plan.table.op_map.layer_groups()
    split = _split_layers(plan)
    out = []

    def make(j: int, members: list[int], is_split: bool, shared: int, off=()) -> LayerGroup:
        per: dict[int, list[str]] = {}
        for k in members:
            per.setdefault(stage_of_layer(plan, k), []).append(names[k])
        return LayerGroup(tuple(members), tuple(names[k] for k in members), tuple(sorted(per)),
                          tuple((s, tuple(v)) for s, v in sorted(per.items())), j, is_split, shared,
                          tuple(names[k] for k in off))

    for j, members in pairs:
        rest = [k for k in members if k not in split]
        if rest:
            off = [k for k in members if k in split and rest[0] < k < rest[-1]]
            out.append(make(j, rest, False, len(members), off))
        out += [make(j, [k], True, len(members)) for k in members if k in split]
    out.sort(key=lambda grp: grp.layers[0])
    return out


def group_of_layer(plan: Plan, layer) -> LayerGroup:
    """The group real layer ``layer`` (its index or name) belongs to; ValueError naming the layers otherwise."""
    names = list(plan.layer_names)
    if isinstance(layer, str):
        if layer not in names:
            raise ValueError(f"layer {layer!r} is not in this plan; layers are {names[:6]}"
                             f"{'...' if len(names) > 6 else ''}")
        layer = names.index(layer)
    for grp in layer_groups(plan):
        if layer in grp.layers:
            return grp
    raise ValueError(f"layer {layer!r} is not in this plan (layers 0..{len(names) - 1})")
