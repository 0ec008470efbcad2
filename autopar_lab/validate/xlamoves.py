"""The conversions of a plan that XLA's SPMD partitioner moves across an operator, and what that saves.

A plan says where each operator's inputs and outputs lie; :func:`~autopar_lab.validate.report.predicted_collectives`
prices each conversion between them where the plan puts it. XLA's sharding propagation is free to place an operator
that the replay does not pin itself (the replay pins outputs, after the operator) in another layout, and two such
placements move a conversion, measured on ``autopar-lab validate mlp --devices 8 --mesh 2x4`` (the compiled HLO of
that plan, 2026-12-06):

- **commuted**: an elementwise operator whose inputs all arrive through the same conversion (one source layout, one
  target layout, one shape) is computed in the source layout and its result converted once: ``gather(a) +
  gather(b)`` becomes ``gather(a + b)``. All but one of the inputs' conversions go.
- **reduced first**: a reduction whose input is converted, where the reduced dimensions are whole in both layouts,
  is computed in the source layout and its (smaller) result converted: the same collectives on a buffer
  ``out_elements / in_elements`` as large.

Either applies only where no other reader of the converted value reads the converted copy (it is then made anyway).
These are properties of XLA's compilation of a plan, not of the plan: the cost model and the ILP price the plan as
written (an operator computed in the layout its strategy names), so this module is used only to explain the gap
between predicted and compiled bytes (``validate_plan``'s ``xla_moves`` and ``bytes_ratio_xla``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Mapping, Sequence

from ..graph.opcost import ELEMENTWISE, REDUCTIONS
from ..graph.opgraph import OpGraph
from ..sharding.reshard import collective_time
from ..sharding.spec import ShardingSpec


def _whole_in(spec: ShardingSpec, dims: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """No mesh axis of more than one device splits any of ``dims`` in ``spec``."""
    return all(mesh_shape[a] == 1 for d in dims for a in spec.dims[d])


def _copy_read_elsewhere(graph: OpGraph, strategies: Mapping[int, Any], tensor: int, reader: int,
                         dst: ShardingSpec) -> bool:
    """Another reader of ``tensor`` than ``reader`` reads it in ``dst``: the converted copy is made for it anyway."""
    for c in graph.consumers.get(tensor, ()):
        if c == reader:
            continue
        for j, t in enumerate(graph.op(c).inputs):
            if t == tensor and strategies[c].in_specs[j] == dst:
                return True
    return False


def xla_moves(graph: OpGraph, strategies: Mapping[int, Any], records: Sequence[Mapping[str, Any]],
              mesh_shape: Sequence[int]) -> list[dict]:
    """The records of ``records`` (:func:`~autopar_lab.validate.report.predicted_collectives` of ``strategies`` on a
    mesh of ``mesh_shape``) whose conversion XLA moves across its reader (see the module docstring), one dict each:
    the record's ``index`` in ``records``, its ``rule`` ("commuted" or "reduced first"), ``op`` (the reader),
    ``tensor``, ``kind``, ``axis``, ``bytes`` and ``hlo_bytes`` (as predicted) and ``kept`` (the fraction of it XLA
    still moves: 0 for a commuted conversion)."""
    by_edge: dict[tuple[int, int], list[int]] = defaultdict(list)  # (tensor, reader) -> its conversion's records
    for k, r in enumerate(records):
        if r["source"] == "reshard":
            by_edge[(r["tensor"], r["consumer"])].append(k)
    readers: dict[int, list[int]] = defaultdict(list)
    for tensor, reader in by_edge:
        readers[reader].append(tensor)
    out: list[dict] = []

    def move(k: int, rule: str, kept: float) -> None:
        r = records[k]
        out.append({"index": k, "rule": rule, "op": r["consumer"], "tensor": r["tensor"], "kind": r["kind"],
                    "axis": r["axis"], "bytes": r["bytes"], "hlo_bytes": r["hlo_bytes"], "kept": kept})

    for v, tensors in readers.items():
        node = graph.op(v)
        conv = {t: (records[by_edge[(t, v)][0]]["src"], records[by_edge[(t, v)][0]]["dst"]) for t in tensors}
        if any(_copy_read_elsewhere(graph, strategies, t, v, ShardingSpec.parse(conv[t][1])) for t in tensors):
            continue
        if node.primitive in ELEMENTWISE and len(node.inputs) > 1:
            shape = graph.tensor(node.outputs[0]).shape
            alike = (set(node.inputs) == set(tensors) and len(set(conv.values())) == 1
                     and all(graph.tensor(t).shape == shape for t in node.inputs))
            if alike:
                for t in list(dict.fromkeys(node.inputs))[1:]:
                    for k in by_edge[(t, v)]:
                        move(k, "commuted", 0.0)
        elif node.primitive in REDUCTIONS and "axes" in node.params and len(node.inputs) == 1:
            (t,) = tensors
            src, dst = (ShardingSpec.parse(s) for s in conv[t])
            axes = tuple(node.params["axes"])
            ratio = math.prod(graph.tensor(node.outputs[0]).shape) / math.prod(graph.tensor(t).shape)
            if ratio < 1 and _whole_in(src, axes, mesh_shape) and _whole_in(dst, axes, mesh_shape):
                for k in by_edge[(t, v)]:
                    move(k, "reduced first", ratio)
    return sorted(out, key=lambda m: m["index"])


def without_moves(records: Sequence[Mapping[str, Any]], moves: Sequence[Mapping[str, Any]]) -> list[dict]:
    """``records`` as XLA compiles them: each moved record's bytes scaled by what XLA still moves of it, a commuted
    one left out."""
    kept = {m["index"]: m["kept"] for m in moves}
    out = []
    for k, r in enumerate(records):
        f = kept.get(k, 1.0)
        if f > 0:
            out.append(dict(r, bytes=r["bytes"] * f, hlo_bytes=r["hlo_bytes"] * f))
    return out


def moves_seconds(moves: Sequence[Mapping[str, Any]], mesh) -> float:
    """What the cost model charges for the moved collectives beyond what XLA moves (alpha-beta on ``mesh``, the
    plan's logical mesh: a commuted collective's whole time, a reduced-first one's time on the full buffer less its
    time on the reduced one)."""
    def seconds(m: Mapping[str, Any], nbytes: float) -> float:
        axis = tuple(m["axis"]) if isinstance(m["axis"], list) else m["axis"]  # JSON-ready records hold lists
        return collective_time(mesh, m["kind"], nbytes, axis) if nbytes else 0.0

    return sum(seconds(m, m["bytes"]) - seconds(m, m["bytes"] * m["kept"]) for m in moves)
