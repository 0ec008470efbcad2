"""What a plan's memory says in words: which part of a stage overflows by how much, and what was sharded to fit.

A stage's peak (:func:`~autopar_lab.pricing.memory.memory_breakdown`) is grouped into the three parts a user can act
on (:data:`GROUPS`): the *parameters* (weights, their gradients, fp32 master weights and kept copies: more tensor
or pipeline parallelism, or ZeRO-3, shrink them), the *optimizer state* (ZeRO-1) and the *activations* (microbatches in
flight, recomputation's working set and buffers: smaller microbatches, recomputation, sequence parallelism).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..pricing.memory import memory_breakdown

if TYPE_CHECKING:
    from ..plan import Plan

__all__ = ["GROUPS", "lean_note", "overflow_note", "part_bytes"]

GIB = 2**30

#: Each group of a stage's memory and the parts of :data:`~autopar_lab.pricing.memory.PARTS` it adds up.
GROUPS = {
    "parameters (with their gradients, master weights and copies)": (
        "params_bytes", "grads_bytes", "master_bytes", "copies_bytes", "fp8_copies_bytes"),
    "optimizer state": ("optimizer_bytes",),
    "activations (microbatches in flight, recomputation, buffers)": (
        "activations_bytes", "recompute_bytes", "buffers_bytes"),
}


def part_bytes(row: dict) -> dict[str, float]:
    """A stage's row of :func:`memory_breakdown` in :data:`GROUPS` (bytes per device)."""
    return {name: float(sum(row[p] for p in parts)) for name, parts in GROUPS.items()}


def overflow_note(plan: Plan) -> str:
    """"" when every stage of ``plan`` fits; else one sentence for the stage furthest over its limit: what it needs,
    by how much that exceeds the limit, each part's bytes and the part that overflows (a part that exceeds the limit
    by itself; else the largest, with what it would have to lose)."""
    rows = memory_breakdown(plan)
    over = [r for r in rows if r["total_bytes"] > r["limit_bytes"]]
    if not over:
        return ""
    r = max(over, key=lambda r: r["total_bytes"] - r["limit_bytes"])
    limit, total = r["limit_bytes"], r["total_bytes"]
    parts = part_bytes(r)
    listed = ", ".join(f"{name} {b / GIB:.3g} GiB" for name, b in parts.items())
    name, big = max(parts.items(), key=lambda x: x[1])
    short = name.split(" (")[0]
    if big > limit:
        which = f"the {short} alone overflow it by {(big - limit) / GIB:.3g} GiB"
    else:
        which = (f"the largest part, the {short}, would have to shrink by {(total - limit) / GIB:.3g} GiB "
                 f"(to {(big - total + limit) / GIB:.3g} GiB)")
    return (f"does not fit: stage {r['stage']} needs {total / GIB:.3g} GiB per device, {(total - limit) / GIB:.3g} "
            f"GiB over the {limit / GIB:.3g} GiB limit ({listed}); {which}")


def lean_note(stages: Sequence[int], before: Sequence[float], after: Sequence[float], what: str) -> str:
    """The note of stages stored at their least to fit: ``stages`` (indices), each one's peak bytes per device
    ``before`` (the state as the fastest sharding keeps it) and ``after``; ``what``: what was sharded over what."""
    each = "; ".join(f"stage {k}: {b / GIB:.3g} -> {a / GIB:.3g} GiB" for k, b, a in zip(stages, before, after))
    return f"to fit in memory, {what} ({each})"
