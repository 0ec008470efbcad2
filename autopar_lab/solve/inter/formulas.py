"""The stage DP's formulas, shared by the DP and the brute force (so the brute force checks the search, not the
definitions): Alpa's submesh shapes, the in-order placement rule and the link a cut uses, the microbatches a stage
holds under each schedule, each schedule's step-time formula, and the one stage-transfer formula."""

from __future__ import annotations

from typing import Any, Sequence

from ...schedules import warmup_chunks

__all__ = ["SCHEDULES", "BY_STAGE_COUNT", "DEFAULT_WGRAD_SHARE", "STAGE_COMM", "submesh_shapes", "placement_fits",
           "cut_link", "held_microbatches", "coefficients", "schedule_latency", "serial_latency", "pipeline_latency",
           "transfer_s"]

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")
#: The schedules whose formula and memory depend on the total stage count (the DP solves each count on its own).
BY_STAGE_COUNT = ("interleaved", "zb-h1")
#: ZB-H1's weight-gradient part W as a share of a stage's fwd + bwd when none is given: a transformer layer's
#: backward is about twice its forward and W about half of it, so F = B = W.
DEFAULT_WGRAD_SHARE = 1.0 / 3.0
STAGE_COMM = ("model", "ignore")


def submesh_shapes(hosts: int, devices_per_host: int) -> list[tuple[int, int]]:
    """Alpa's submesh shapes: (1,1), (1,2), (1,4) ... (1,M), then (2,M) ... (N,M).

    >>> submesh_shapes(2, 4)
    [(1, 1), (1, 2), (1, 4), (2, 4)]
    """
    m = devices_per_host
    shapes = []
    w = 1
    while w < m:
        shapes.append((1, w))
        w *= 2
    shapes.append((1, m))
    shapes += [(n, m) for n in range(2, hosts + 1)]
    return shapes


def placement_fits(submesh: tuple[int, int], offset: int, hosts: int, devices_per_host: int) -> bool:
    """Whether a stage of shape ``submesh`` may start at host-major device ``offset``.

    >>> placement_fits((1, 2), 2, 2, 4), placement_fits((1, 4), 2, 2, 4), placement_fits((2, 4), 4, 3, 4)
    (True, False, True)
    """
    n, m = submesh
    size = n * m
    if offset < 0 or offset + size > hosts * devices_per_host:
        return False
    if n == 1:  # inside one host
        return offset // devices_per_host == (offset + m - 1) // devices_per_host
    return offset % devices_per_host == 0  # whole hosts, starting on a host boundary


def cut_link(offset: int, devices_per_host: int) -> str:
    """Link used by the cut in front of a stage starting at device ``offset`` (> 0).

    >>> cut_link(2, 4), cut_link(4, 4)
    ('intra', 'inter')
    """
    return "intra" if offset % devices_per_host else "inter"


def held_microbatches(stages_from_here: int, microbatches: int, schedule: str, num_stages: int | None = None,
                      virtual_stages: int = 1, group: int | None = None) -> float:
    """Microbatches a stage keeps alive at once, in units of a whole stage's activations per microbatch: 1F1B
    ``min(s, B)`` where ``s`` counts the stages from this one to the last (inclusive); GPipe ``B``. These two need
    only ``s``; the others need the total stage count ``num_stages = p`` too (as the simulator shows them):

    - ZB-H1: ``min(p, B)`` on every stage (a microbatch lives from its F to its W, which waits ``p - 1`` steps);
    - interleaved with ``v`` chunks: ``n / v`` where ``n`` counts chunk-microbatches (each holds a chunk's share,
      ``1 / v``, of the stage's activations): Megatron's warm-up ``2(s - 1) + (v - 1)N + 1`` of them, or all
      ``B v`` when ``B == p`` or fewer are left (``N = group``, the microbatches each chunk runs in a row, default
      ``p``: :func:`~autopar_lab.schedules.warmup_chunks`).

    >>> held_microbatches(3, 8, "1f1b"), held_microbatches(3, 8, "gpipe"), held_microbatches(1, 8, "zb-h1", 3)
    (3, 8, 3)
    >>> held_microbatches(2, 8, "interleaved", 4, 2)    # (2 + 4 + 1) chunk-microbatches of half a stage each
    3.5
    >>> held_microbatches(2, 8, "interleaved", 4, 2, group=8)    # (2 + 8 + 1) of them
    5.5
    """
    if schedule == "1f1b":
        return min(stages_from_here, microbatches)
    if schedule == "gpipe":
        return microbatches
    if num_stages is None:
        raise ValueError(f"the {schedule} schedule's memory depends on the total stage count; give num_stages.")
    if schedule == "zb-h1":
        return min(num_stages, microbatches)
    v = int(virtual_stages)
    return warmup_chunks(num_stages - stages_from_here, num_stages, microbatches, v, group) / v


def coefficients(schedule: str, microbatches: int, virtual_stages: int,
                 wgrad_share: float) -> tuple[float, float, float]:
    """``(a, kappa, K)``: the schedule's step time is ``a * (sum t + sum kappa c + K * max(t, kappa c))`` (see
    :func:`schedule_latency`), the form the DP minimises (``a`` scales every plan alike)."""
    B = microbatches
    if schedule == "interleaved":
        v = int(virtual_stages)
        return 1.0 / v, float(v), float(v * B - 1)
    if schedule == "zb-h1":
        a = 1.0 - wgrad_share
        return a, 1.0 / a, (B - 1 + wgrad_share) / a
    return 1.0, 1.0, float(B - 1)


def schedule_latency(stage_s: Sequence[float], cut_s: Sequence[float], microbatches: int, schedule: str = "1f1b",
                     virtual_stages: int = 1, wgrad_share: float = DEFAULT_WGRAD_SHARE,
                     cut_neck_s: Sequence[float] | None = None) -> float:
    """The step time the stage DP minimises for ``schedule``: :func:`pipeline_latency` for 1F1B and GPipe, and

    - interleaved (``v`` chunks): each stage runs ``vB`` chunk-microbatches of ``t / v`` and each cut carries ``v``
      transfers per microbatch (the wrap-around from the last stage to the first, ``v - 1`` more, is left out),
      so ``(sum t + v sum c + (vB - 1) max(t, v c)) / v`` -- with uniform stages and
      free transfers exactly the simulator's ``B t + (p - 1) t / v`` (Megatron's bubble), and above it for uneven
      stages (both checked in the tests);
    - ZB-H1 (``w = wgrad_share``: W's share of each stage's t): the simulator's makespan with uniform stages and
      F = B is ``B t + (p - 1)(t - w t) - min(B - 1, p - 1) w t``; for uneven stages it stays below
      ``sum (1 - w) t + (B - 1) max t + w max t - min(B - 1, p - 1) w min t`` (tests), whose last term needs the
      smallest stage and so does not split over stages. The DP drops it: ``(1 - w) sum t + sum c + (B - 1 + w)
      max(t, c / (1 - w))``, an upper bound the planner then re-ranks by simulation.

    >>> schedule_latency([3, 3], [], 4, "interleaved", 2)    # 4 * 3 + (2 - 1) * 3 / 2
    13.5
    >>> round(schedule_latency([3, 3], [], 4, "zb-h1", wgrad_share=1 / 3), 9)
    14.0
    """
    if schedule not in ("interleaved", "zb-h1"):
        return pipeline_latency(stage_s, cut_s, microbatches, cut_neck_s)
    a, kappa, K = coefficients(schedule, microbatches, virtual_stages, wgrad_share)
    necks = cut_s if cut_neck_s is None else cut_neck_s
    return a * (sum(stage_s) + kappa * sum(cut_s) + K * max(list(stage_s) + [kappa * c for c in necks]))


def serial_latency(stage_s: Sequence[float], cut_s: Sequence[float], microbatches: int) -> float:
    """The step time when every stage runs on one host's shared cores (the CPU's devices, one driver): each stage's
    forward and backward of every microbatch, and each transfer, one after another, ``B (sum t + sum c)``; the
    simulator's makespan on one host (checked in the tests), whatever the schedule.

    >>> serial_latency([3, 1], [0.5], 4)
    18.0
    """
    return microbatches * (sum(stage_s) + sum(cut_s))


def pipeline_latency(stage_s: Sequence[float], cut_s: Sequence[float], microbatches: int,
                     cut_neck_s: Sequence[float] | None = None) -> float:
    """``sum t + sum c + (B-1) * max(t, n)``: transfers act as extra pipeline stages. ``c`` is a cut's
    ``send_fwd + send_bwd`` (one microbatch's activation goes forward and its gradient back: both on its critical
    path); ``n`` (``cut_neck_s``, default ``c``) is what the cut takes per microbatch in the steady state: a link is
    full duplex (activations and gradients travel in opposite directions at once, one link each in the simulator),
    so the DP and its results pass ``max(send_fwd, send_bwd)``.

    How it compares with :func:`autopar_lab.simulate.simulate` (checked in the tests):
    GPipe equals it exactly when each stage's and each cut's backward time is the same
    multiple of its forward time (uniform stages and free transfers included); 1F1B equals
    it for uniform stages and free transfers, and is at most it when transfers are free and
    bwd is proportional to fwd (a fast stage's warm-up overlaps a slow one); with transfers,
    1F1B's fixed warm-up depth cannot always hide the gradient round trip, so it can exceed
    the formula. With arbitrary fwd/bwd splits either schedule can land on either side.

    >>> pipeline_latency([3, 3], [], 2)
    9
    >>> pipeline_latency([3, 3], [5], 2, cut_neck_s=[4])   # 3 + 3 + 5 + (2 - 1) * 4
    15
    """
    necks = cut_s if cut_neck_s is None else cut_neck_s
    return sum(stage_s) + sum(cut_s) + (microbatches - 1) * max(list(stage_s) + list(necks))


def transfer_s(nbytes: float, link: Any) -> float:
    """Seconds to send ``nbytes`` over ``link`` (one direction): its latency plus bytes over bandwidth. The one
    stage-transfer formula: the DP, the pricing of a plan and the global-optimum search all use it (the pricing and
    the search send a cut between stages that span several hosts over all their links,
    :func:`~autopar_lab.pricing.price.scale_out_hosts`; the DP's cut term, which does not know the stages' shapes,
    over one host's: an upper bound)."""
    return float(link.latency) + float(nbytes) / float(link.bandwidth)
