"""What the cost table needs of a deep zoo model's full graph, derived from two shallow copies instead of traced.

The table reads three things of the full graph before any plan is priced: its layer names, which layer of the
solve graph (the 4-layer copy, :func:`~autopar_lab.pricing.table.solve_graph_for`) prices each of its layers
(:attr:`~autopar_lab.pricing.opmap.OpMap.layer_map`), and the activation bytes crossing each cut between layers
(:func:`~autopar_lab.pricing.layers.cut_bytes`). Tracing GPT-39B's 48 layers (1T: 128) only to read those is most
of the trace time, and all three follow a pattern along the repeated blocks: a prefix (the embedding), ``n`` blocks
and a suffix (the head). :func:`derive` traces the 6-layer copy as well as the 4-layer one, reads the pattern off
both and extrapolates it to the model's depth.

The pattern assumed: per-layer values (a layer's plain structure, the bytes entering it) depend on a block's
distance to the first and to the last block up to 2 (so blocks 2 .. n-3 are alike), and block names differ only
by the block's index. Both copies are checked against it exactly (the 4-layer copy must be what the pattern read off
the 6-layer one gives for 4 blocks, and the 6-layer copy's two middle blocks must agree); where they are not,
:func:`derive` returns None and the table traces the full model as before. The full graph is still traced when
something reads it (:func:`~autopar_lab.graph.capture.deferred_trace`); ``tests/test_deepmap.py`` compares the
derived values with the full trace's on zoo models up to 48 layers.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from ..graph.opgraph import OpGraph
from .layers import cut_bytes
from .opmap import layer_map_of, plain_signature

#: The two depths the pattern is read from (the smaller is the table's solve graph).
SHALLOW, DEEPER = 4, 6
#: How far from either end a block may differ from the middle ones.
EDGE = 2

T = TypeVar("T")


@dataclass(frozen=True)
class DeepMap:
    """The full graph's layer names, each one's solve-graph layer (``layer_map``) and the bytes crossing the cut in
    front of each layer 1..L-1 (``cut_bytes``), as :class:`~autopar_lab.pricing.table.CostTable` reads them."""

    layer_names: tuple[str, ...]
    layer_map: tuple[int, ...]
    cut_bytes: tuple[float, ...]


@dataclass(frozen=True)
class _Layout:
    """Where the blocks sit in a copy's layer list: ``prefix`` layers, then blocks of ``width`` layers each."""

    prefix: int
    width: int
    templates: tuple[str, ...]  # one per layer of a block, ``{}`` where the block index goes
    offset: int = 0  # the index in the name of the first block (the lead layers before it are in the prefix)

    def names(self, first: Sequence[str], blocks: int, suffix: Sequence[str]) -> list[str]:
        return list(first) + [t.replace("{}", str(i + self.offset)) for i in range(blocks) for t in self.templates] \
            + list(suffix)


def _layout(names4: Sequence[str], names6: Sequence[str], offset: int = 0) -> _Layout | None:
    """The block layout both copies' layer names share, or None. Block ``i``'s names are the block-0 names with the
    index ``offset`` written as ``offset + i``; everything before and after the blocks is the same in both copies."""
    extra = len(names6) - len(names4)
    if extra <= 0 or extra % (DEEPER - SHALLOW):
        return None
    width = extra // (DEEPER - SHALLOW)
    for prefix in range(len(names4) - SHALLOW * width + 1):
        block0 = names4[prefix:prefix + width]
        # Each way of marking one "0" of each block-0 name as the index.
        mark = rf"(?<!\d){offset}(?!\d)"
        options: list[list[str]] = [[n[:m.start()] + "{}" + n[m.end():] for m in re.finditer(mark, n)]
                                    for n in block0]
        for templates in itertools.product(*options):
            layout = _Layout(prefix, width, tuple(templates), offset)
            suffix = names4[prefix + SHALLOW * width:]
            if layout.names(names4[:prefix], SHALLOW, suffix) == list(names4) and \
                    layout.names(names4[:prefix], DEEPER, suffix) == list(names6):
                return layout
    return None


def _block_source(i: int, blocks: int) -> int:
    """The block of the 6-layer copy that stands for block ``i`` of ``blocks``: the one at the same distance from
    the nearer end (up to :data:`EDGE`), a middle one for the rest."""
    front, back = min(i, EDGE), min(blocks - 1 - i, EDGE)
    if front < EDGE:
        return front
    if back < EDGE:
        return DEEPER - 1 - back
    return EDGE


def _extend(values: Sequence[T], layout: _Layout, blocks: int) -> list[T]:
    """Per-layer ``values`` of the 6-layer copy extended to ``blocks`` blocks."""
    p, w = layout.prefix, layout.width
    out = list(values[:p])
    for i in range(blocks):
        b = _block_source(i, blocks)
        out += values[p + b * w:p + (b + 1) * w]
    return out + list(values[p + DEEPER * w:])


def _agrees(values4: Sequence[Any], values6: Sequence[Any], layout: _Layout) -> bool:
    """Whether the 4-layer copy's values are the pattern of the 6-layer copy's, and its middle blocks alike."""
    p, w = layout.prefix, layout.width
    middle = [values6[p + b * w:p + (b + 1) * w] for b in range(EDGE, DEEPER - EDGE)]
    return list(values4) == _extend(values6, layout, SHALLOW) and all(m == middle[0] for m in middle)


def derive(num_layers: int, shallow: OpGraph, trace_deeper: Callable[[], OpGraph], *, lead: int = 0,
           trace_base: Callable[[], OpGraph] | None = None) -> DeepMap | None:
    """The :class:`DeepMap` of a zoo model with ``num_layers`` blocks from its 4-layer copy ``shallow`` (the solve
    graph) and its 6-layer copy (``trace_deeper()``, traced here), or None where the copies do not follow the
    pattern (see the module docstring): the caller then traces the full model.

    ``lead``: how many first blocks differ from the rest while every copy keeps them (``ModelSpec.lead_layers``:
    DeepSeek-V3's 3 dense layers before its MoE layers). Above :data:`EDGE` they are more than the pattern's edge
    describes, so the pattern is read after the first ``lead - EDGE`` of them, off the copies of ``SHALLOW + lead -
    EDGE`` (``trace_base()``) and ``DEEPER + lead - EDGE`` blocks (``trace_deeper()``); each layer is still mapped
    onto ``shallow``'s layers by its structure."""
    offset = max(0, lead - EDGE) if trace_base is not None else 0
    if num_layers - offset <= SHALLOW:
        return None
    base = trace_base() if offset and trace_base is not None else shallow
    deeper = trace_deeper()
    names4, names6 = list(base.layers), list(deeper.layers)
    layout = _layout(names4, names6, offset)
    if layout is None:
        return None
    sig4 = [plain_signature(base, n) for n in names4]
    sig6 = [plain_signature(deeper, n) for n in names6]
    # The bytes entering each layer (0 for the first), so that cuts line up with layers.
    in4 = [0.0] + cut_bytes(base, names4)
    in6 = [0.0] + cut_bytes(deeper, names6)
    if not (_agrees(sig4, sig6, layout) and _agrees(in4, in6, layout)):
        return None
    suffix = names4[layout.prefix + SHALLOW * layout.width:]
    blocks = num_layers - offset
    names = layout.names(names4[:layout.prefix], blocks, suffix)
    try:
        layer_map = layer_map_of(_extend(sig6, layout, blocks), shallow)
    except LookupError:
        return None
    return DeepMap(tuple(names), tuple(layer_map), tuple(_extend(in6, layout, blocks)[1:]))


__all__ = ["DeepMap", "derive", "SHALLOW", "DEEPER", "EDGE"]
