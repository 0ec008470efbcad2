"""Event-level pipeline simulator: GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1) schedules as timelines.

The model is deliberately small so every number can be checked by hand:

* each stage is one compute resource that runs its task list strictly in order (:func:`task_order`);
* each cut between stage ``i`` and ``i + 1`` is two link resources, one per direction
  (activations forward, gradients backward); transfers on one link are serialised,
  but a transfer overlaps compute on both stages;
* ``fwd`` of microbatch ``j`` on stage ``i`` may start once ``fwd j`` on stage ``i - 1``
  has finished and its activation has crossed the cut; ``bwd j`` on stage ``i`` may start
  once ``bwd j`` on stage ``i + 1`` has finished and its gradient has crossed back
  (the last stage starts ``bwd j`` after its own ``fwd j``).

Interleaved (``virtual_stages = v > 1``): the per-stage figures are given per *virtual stage* (chunk) ``c = 0 ..
p*v - 1``, chunk ``c`` runs on stage ``c % p``, and the rules above hold between consecutive chunks (so a value goes
from the last stage back to the first one over a link of its own, ``p-1 -> 0``, once per chunk round). ZB-H1: the
``bwd`` task is the backward's input-gradient part ``B`` (what the earlier stage waits for) and a ``wgrad`` task,
the weight-gradient part ``W``, follows it on the same stage whenever the schedule puts it; a microbatch's
activations are held from its forward until its ``W`` (or its ``bwd``, without one) ends.

Example (2 stages, 2 microbatches, fwd 1 s, bwd 2 s):

>>> tl = simulate([1, 1], [2, 2], 2, schedule="gpipe")
>>> tl.makespan
9.0
>>> [(t.kind, t.microbatch, t.start, t.end) for t in tl.tasks if t.stage == 1]
[('fwd', 0, 1.0, 2.0), ('fwd', 1, 2.0, 3.0), ('bwd', 0, 3.0, 5.0), ('bwd', 1, 5.0, 7.0)]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .schedules import SCHEDULES, check_group, check_layout, check_schedule, group_order, warmup_chunks

__all__ = ["SCHEDULES", "COMPUTE_KINDS", "ScheduleStuck", "SimOptions", "Task", "Timeline", "issue_order",
           "simulate", "makespan_floor", "stage_order", "task_order"]

#: The kinds of compute task: forward, backward (for ZB-H1 its input-gradient part B), weight gradient (ZB-H1's W).
COMPUTE_KINDS = ("fwd", "bwd", "wgrad")


@dataclass(frozen=True)
class Task:
    """One interval on a resource. ``stage`` is the compute stage for ``fwd``/``bwd``/``wgrad``;
    for ``send_fwd``/``send_bwd`` it is the link (the one between stage ``stage`` and ``stage + 1``, or
    between the last stage and stage 0 for an interleaved plan's wrap-around). ``chunk``: the virtual stage the
    task belongs to (for a transfer: the one sending the activation, or receiving the gradient); it equals
    ``stage`` unless the plan is interleaved."""

    stage: int
    kind: str  # "fwd" | "bwd" | "wgrad" | "send_fwd" | "send_bwd"
    microbatch: int
    start: float
    end: float
    chunk: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """The result of :func:`simulate`. Per-stage figures are tuples indexed by (physical) stage.

    ``tasks`` (every interval, sorted by start) is built from ``records`` on first read: a planner ranking plans by
    their makespan and memory never reads it, and at 65 stages and 2,048 microbatches building it is most of a
    simulation's time."""

    records: tuple[tuple, ...] = field(repr=False)  # Task fields (stage, kind, microbatch, start, end, chunk) per task
    num_stages: int
    microbatches: int
    schedule: str
    makespan: float
    busy_s: tuple[float, ...]
    peak_inflight: tuple[int, ...]  # most microbatches (chunk-microbatches when interleaved) alive at once
    peak_mem_bytes: tuple[float, ...]  # static + the activations of those in flight at the worst instant
    virtual_stages: int = 1

    @functools.cached_property
    def tasks(self) -> tuple[Task, ...]:
        """Every task, by start time (compute before transfers, then by stage and end; ties in placement order)."""
        out = [Task(*r) for r in self.records]
        out.sort(key=lambda t: (t.start, t.kind not in COMPUTE_KINDS, t.stage, t.end))
        return tuple(out)

    @property
    def bubble_fraction(self) -> float:
        """Idle compute time over total stage time: ``1 - sum(busy) / (S * makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (self.num_stages * self.makespan)

    def to_rows(self) -> list[dict]:
        """One dict per task, ready for a Gantt chart (e.g. ``plotly.express.timeline``
        after mapping seconds to a time axis). ``resource`` names the row; ``chunk`` is the virtual stage (the
        stage itself unless interleaved) and ``round`` which of its stage's chunks that is (0 unless interleaved)."""
        rows = []
        p = self.num_stages
        for t in self.tasks:
            if t.kind in COMPUTE_KINDS:
                resource = f"stage {t.stage}"
            else:
                arrow = "->" if t.kind == "send_fwd" else "<-"
                resource = f"link {t.stage}{arrow}{(t.stage + 1) % p if p > 1 else t.stage + 1}"
            chunk = t.stage if t.chunk is None else t.chunk
            rows.append(
                {
                    "resource": resource,
                    "stage": t.stage,
                    "kind": t.kind,
                    "microbatch": t.microbatch,
                    "chunk": chunk,
                    "round": chunk // p if p else 0,
                    "start": t.start,
                    "end": t.end,
                    "duration": t.end - t.start,
                }
            )
        return rows


def _one_f_one_b(warm: int, b: int) -> list[tuple[str, int]]:
    order = [("fwd", j) for j in range(warm)]
    for j in range(b - warm):  # steady state: one bwd frees a slot for one more fwd
        order += [("bwd", j), ("fwd", warm + j)]
    return order + [("bwd", j) for j in range(b - warm, b)]


def _zb_h1(stage: int, s: int, b: int) -> list[tuple[str, int]]:
    # Qi et al.'s ZB-H1: at step x stage i runs F_x, B_{x-(s-1-i)} and W_{x-(s-1)} (each when it exists), so the
    # forwards and B's follow 1F1B exactly and each W waits until s - 1 more microbatches have started: the later
    # the stage, the more of its W's are left for the drain, where 1F1B idles. A microbatch lives from its F to its
    # W: at most s at once on every stage, 1F1B's peak.
    order = []
    for x in range(b + s - 1):
        for kind, j in (("fwd", x), ("bwd", x - (s - 1 - stage)), ("wgrad", x - (s - 1))):
            if 0 <= j < b:
                order.append((kind, j))
    return order


def _interleaved(stage: int, p: int, b: int, v: int, group: int | None = None) -> list[tuple[str, int, int]]:
    # Narayanan et al.'s schedule (Megatron-LM's): the stage's m*v chunk-microbatches in groups of N microbatches
    # (default p; schedules.group_order), the forwards through chunks 0..v-1 and the backwards through v-1..0; a
    # warm-up of 2(p-1-i) + (v-1)N + 1 forwards (schedules.warmup_chunks), then one backward and one forward in turn.
    total = b * v
    table = group_order(b, v, check_group(group, p, b))

    def item(k: int, kind: str) -> tuple[str, int, int]:
        r, j = table[k]
        r = r if kind == "fwd" else v - 1 - r
        return kind, r * p + stage, j

    warm = warmup_chunks(stage, p, b, v, group)
    order = [item(k, "fwd") for k in range(warm)]
    for k in range(total - warm):
        order += [item(k, "bwd"), item(warm + k, "fwd")]
    return order + [item(k, "bwd") for k in range(total - warm, total)]


def task_order(stage: int, num_stages: int, microbatches: int, schedule: str = "1f1b", warmup: int | None = None,
               virtual_stages: int | None = None, group: int | None = None) -> list[tuple[str, int, int]]:
    """The order in which one stage runs its compute tasks, as ``(kind, chunk, microbatch)``.

    ``chunk`` is the virtual stage (``r * num_stages + stage`` for the stage's ``r``-th chunk; the stage itself
    unless interleaved). GPipe: every fwd, then every bwd. 1F1B: ``min(S - i, B)`` warm-up fwds (``min(warmup, B)``
    when given: a deeper warm-up hides slow transfers at the price of more microbatches in flight), then one bwd
    and one fwd in turn, then the remaining bwds. ZB-H1 and interleaved: see :func:`_zb_h1` and
    :func:`_interleaved` (the papers' schedules; interleaved needs ``B`` a multiple of ``S``, or with ``group``,
    its microbatches in groups of that many, a count :func:`~autopar_lab.schedules.check_group` accepts).

    >>> task_order(0, 2, 2, "interleaved", virtual_stages=2)
    [('fwd', 0, 0), ('fwd', 0, 1), ('fwd', 2, 0), ('fwd', 2, 1), ('bwd', 2, 0), ('bwd', 2, 1), ('bwd', 0, 0), \
('bwd', 0, 1)]
    >>> task_order(1, 2, 2, "zb-h1")
    [('fwd', 1, 0), ('bwd', 1, 0), ('fwd', 1, 1), ('bwd', 1, 1), ('wgrad', 1, 0), ('wgrad', 1, 1)]
    """
    schedule, v = check_schedule(schedule, virtual_stages)
    s, b = num_stages, microbatches
    if schedule == "interleaved":
        check_layout(schedule, v, [v] * s, b, group)
        return _interleaved(stage, s, b, v, group)
    if schedule == "gpipe":
        pairs = [("fwd", j) for j in range(b)] + [("bwd", j) for j in range(b)]
    elif schedule == "zb-h1":
        pairs = _zb_h1(stage, s, b)
    else:
        pairs = _one_f_one_b(min(s - stage if warmup is None else max(int(warmup), 1), b), b)
    return [(kind, stage, j) for kind, j in pairs]


def stage_order(stage: int, num_stages: int, microbatches: int, schedule: str = "1f1b",
                warmup: int | None = None) -> list[tuple[str, int]]:
    """:func:`task_order` as ``(kind, microbatch)`` pairs, for the schedules whose stages run one chunk each (all
    but interleaved).

    >>> stage_order(0, 2, 3)
    [('fwd', 0), ('fwd', 1), ('bwd', 0), ('fwd', 2), ('bwd', 1), ('bwd', 2)]
    """
    if schedule == "interleaved":
        raise ValueError("an interleaved stage runs several chunks; use task_order, whose tasks name their chunk.")
    return [(kind, j) for kind, _, j in task_order(stage, num_stages, microbatches, schedule, warmup)]


class ScheduleStuck(RuntimeError):
    """No stage's next task can run: each waits for a value no task left to run will produce."""


def issue_order(orders: Sequence[Sequence[tuple]], ready: Callable[..., bool]):
    """Walk every stage's order (from :func:`task_order` or :func:`stage_order`) and yield ``(stage, *task)``
    whenever that stage's next task is ``ready(stage, *task)``; the caller runs (or submits) the task before asking
    for the next one, so ``ready`` sees its effects. Each stage keeps its own order; stages interleave. This is how
    a runtime drives a pipeline: the local runner and the Ray driver both issue their tasks with it.
    Raises :class:`ScheduleStuck` when tasks remain but none is ready.

    >>> done = set()
    >>> orders = [stage_order(k, 2, 2) for k in range(2)]
    >>> def ready(k, kind, j):  # stage 1's fwd needs stage 0's; stage 0's bwd needs stage 1's
    ...     if kind == "fwd":
    ...         return k == 0 or (0, "fwd", j) in done
    ...     return k == 1 or (1, "bwd", j) in done
    >>> for task in issue_order(orders, ready):
    ...     done.add(task)
    ...     print(task, end=" ")
    (0, 'fwd', 0) (0, 'fwd', 1) (1, 'fwd', 0) (1, 'bwd', 0) (1, 'fwd', 1) (1, 'bwd', 1) (0, 'bwd', 0) (0, 'bwd', 1)
    """
    pos = [0] * len(orders)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for k, order in enumerate(orders):
            while pos[k] < len(order):
                item = tuple(order[pos[k]])
                if not ready(k, *item):
                    break
                yield (k, *item)
                pos[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleStuck("the schedule is stuck: every stage waits for a value that no remaining task produces")


def _check_vector(name: str, values, length: int) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if len(out) != length:
        raise ValueError(f"{name} has {len(out)} entries but {length} are needed.")
    for v in out:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must hold finite non-negative numbers, got {v}.")
    return out


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """What a simulated pipeline holds and shares besides its task times (:func:`simulate`).

    ``act_bytes[i]``: bytes stage ``i`` keeps per in-flight microbatch; ``static_bytes[i]``: bytes it always holds
    (zeros by default: the timeline's memory is then 0). ``warmup[i]``: forwards stage ``i`` runs before its first
    backward under 1F1B (default: the schedule's own). ``hosts[i]``: the compute resource stage ``i`` shares with
    the stages of the same value (the CPU's devices: one machine's cores and driver run every stage on it, one task
    at a time; default: each stage its own). Interleaved: ``act_bytes`` and ``static_bytes`` per virtual stage, like
    the times; ``microbatch_group``: the microbatches each chunk runs in a row (None: the stage count;
    :func:`~autopar_lab.schedules.check_group`). Immutable: change one with a ``with_*`` method or
    :func:`dataclasses.replace`.

    >>> SimOptions().with_memory([1.0, 2.0], [0.0, 0.0]).act_bytes
    (1.0, 2.0)
    """

    act_bytes: Sequence[float] | None = None
    static_bytes: Sequence[float] | None = None
    warmup: Sequence[int] | None = None
    hosts: Sequence[int] | None = None
    microbatch_group: int | None = None

    def with_memory(self, act_bytes: Sequence[float], static_bytes: Sequence[float]) -> SimOptions:
        return dataclasses.replace(self, act_bytes=tuple(act_bytes), static_bytes=tuple(static_bytes))

    def with_warmup(self, warmup: Sequence[int] | None) -> SimOptions:
        return dataclasses.replace(self, warmup=None if warmup is None else tuple(warmup))

    def with_hosts(self, hosts: Sequence[int] | None) -> SimOptions:
        return dataclasses.replace(self, hosts=None if hosts is None else tuple(hosts))


def simulate(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    microbatches: int,
    schedule: str = "1f1b",
    *,
    send_fwd_s: Sequence[float] | None = None,
    send_bwd_s: Sequence[float] | None = None,
    wgrad_s: Sequence[float] | None = None,
    virtual_stages: int | None = None,
    options: SimOptions = SimOptions(),
) -> Timeline:
    """Simulate one training step of a pipeline and return its :class:`Timeline`.

    ``fwd_s[i]``/``bwd_s[i]``: seconds per microbatch on stage ``i``. ``send_fwd_s[c]``/
    ``send_bwd_s[c]``: seconds to move one microbatch's activation / gradient over cut ``c``
    (between stage ``c`` and ``c + 1``); zeros by default. ``options`` (:class:`SimOptions`): the memory each
    stage holds, 1F1B's warm-up depth, the stages sharing one host.
    ``wgrad_s[i]`` (ZB-H1 only, required there): seconds of the weight-gradient task W, ``bwd_s[i]`` then being the
    input-gradient part B alone. ``virtual_stages = v`` (interleaved only, default 2): every per-stage list is per
    virtual stage (``p * v`` entries, chunk ``c`` on stage ``c % p``) and every cut list per cut between
    consecutive chunks (``p * v - 1``); the timeline's figures are per stage. Stages sharing a host
    (``options.hosts``) still run their own tasks in order; among them the task that can start first runs next.

    Transfer tasks are recorded only on cuts whose transfer time is positive.

    >>> tl = simulate([1, 1], [2, 2], 2, "1f1b")
    >>> tl.makespan, tl.peak_inflight
    (9.0, (2, 1))
    >>> simulate([1, 1], [1, 1], 4, "zb-h1", wgrad_s=[1, 1]).makespan   # 1F1B with bwd 2 s: 15 s
    13.0
    """
    act_bytes, static_bytes, warmup, hosts = options.act_bytes, options.static_bytes, options.warmup, options.hosts
    schedule, v = check_schedule(schedule, virtual_stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}.")
    C = len(fwd_s)  # chunks (virtual stages); the stages themselves unless interleaved
    if C < 1:
        raise ValueError("fwd_s must name at least one stage.")
    if C % v:
        raise ValueError(f"fwd_s has {C} entries, not a multiple of the {v} virtual stages per stage.")
    S, B = C // v, microbatches
    group = options.microbatch_group if schedule == "interleaved" else None
    check_layout(schedule, v, [v] * S, B, group)
    fwd = _check_vector("fwd_s", fwd_s, C)
    bwd = _check_vector("bwd_s", bwd_s, C)
    zeros_cut = [0.0] * (C - 1)
    zeros_chunk = [0.0] * C
    if (wgrad_s is None) == (schedule == "zb-h1"):
        raise ValueError("wgrad_s (the weight-gradient task's seconds per stage) is needed by the zb-h1 schedule and "
                         f"by no other; {'give it' if wgrad_s is None else 'leave it out'} for {schedule!r}.")
    wgt = _check_vector("wgrad_s", zeros_chunk if wgrad_s is None else wgrad_s, C)
    sf = _check_vector("send_fwd_s", zeros_cut if send_fwd_s is None else send_fwd_s, C - 1)
    sb = _check_vector("send_bwd_s", zeros_cut if send_bwd_s is None else send_bwd_s, C - 1)
    act = _check_vector("act_bytes", zeros_chunk if act_bytes is None else act_bytes, C)
    static = _check_vector("static_bytes", zeros_chunk if static_bytes is None else static_bytes, C)

    if warmup is not None and len(warmup) != S:
        raise ValueError(f"warmup has {len(warmup)} entries but {S} are needed.")
    orders = [task_order(i, S, B, schedule, None if warmup is None else warmup[i], v, group) for i in range(S)]
    if hosts is not None and len(hosts) != S:
        raise ValueError(f"hosts has {len(hosts)} entries but {S} are needed (one per stage).")
    resource = list(range(S)) if hosts is None else [int(h) for h in hosts]
    durations = {"fwd": fwd, "bwd": bwd, "wgrad": wgt}
    if len(set(resource)) < S:
        records, fwd_start, held_end = _place_shared(orders, resource, B, durations, sf, sb)
        makespan = max(r[4] for r in records)
    else:
        records, fwd_start, held_end, makespan = _place_own(orders, B, durations, sf, sb)

    chunks = [range(i, C, S) for i in range(S)]
    split = schedule == "zb-h1"
    if v == 1:
        busy = tuple(B * (fwd[i] + bwd[i] + wgt[i]) if split else B * (fwd[i] + bwd[i]) for i in range(S))
        peak = tuple(_max_alive(fwd_start[i], held_end[i]) for i in range(S))
        mem = tuple(static[i] + peak[i] * act[i] for i in range(S))
    else:
        busy = tuple(sum(B * (fwd[c] + bwd[c] + wgt[c]) for c in chunks[i]) for i in range(S))
        peak = tuple(_max_overlap([(fwd_start[c][j], held_end[c][j]) for c in chunks[i] for j in range(B)])
                     for i in range(S))
        mem = tuple(sum(static[c] for c in chunks[i]) + _max_overlap(
            [(fwd_start[c][j], held_end[c][j]) for c in chunks[i] for j in range(B)],
            [act[c] for c in chunks[i] for _ in range(B)]) for i in range(S))
    return Timeline(tuple(records), S, B, schedule, makespan, busy, peak, mem, v)


# A placed task as the fields of its Task: (stage, kind, microbatch, start, end, chunk).
_Records = list[tuple[int, str, int, float, float, int]]
_Times = list[list[float]]


def _place_own(orders: Sequence[Sequence[tuple[str, int, int]]], B: int, durations: dict[str, tuple[float, ...]],
               sf: Sequence[float], sb: Sequence[float]) -> tuple[_Records, _Times, _Times, float]:
    """Place every task when each stage is a compute resource of its own (:func:`simulate`'s rules): each stage in
    turn runs as many of its next tasks as have their input, until none is left. Every start, end and transfer is
    the one :func:`_place_shared` computes with a host per stage, by the same operations in the same order (a stage's
    next task starts at the later of its stage's end and its input's arrival; each link carries one sender's values
    in that sender's order), and the tasks are recorded in the same order; the work per task is a few list reads.
    Returns the records, each chunk's forward starts and activation release times per microbatch, and the makespan."""
    S, C = len(orders), len(durations["fwd"])
    fw, bw, wg = durations["fwd"], durations["bwd"], durations["wgrad"]
    # ready_*[c][j]: when chunk c's task of microbatch j has its input (None: not yet).
    ready_f: list[list[float | None]] = [[None] * B for _ in range(C)]
    ready_f[0] = [0.0] * B
    ready_b: list[list[float | None]] = [[None] * B for _ in range(C)]
    ready_w: list[list[float | None]] = [[None] * B for _ in range(C)]
    fwd_start = [[0.0] * B for _ in range(C)]
    held_end = [[0.0] * B for _ in range(C)]
    link_f, link_b = [0.0] * S, [0.0] * S
    free, pos = [0.0] * S, [0] * S
    records: _Records = []
    add = records.append
    last = C - 1
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for i in range(S):
            order, k, t = orders[i], pos[i], free[i]
            n = len(order)
            while k < n:
                kind, c, j = order[k]
                if kind == "fwd":
                    at = ready_f[c][j]
                    if at is None:
                        break
                    start = t if t > at else at
                    end = start + fw[c]
                    add((i, kind, j, start, end, c))
                    fwd_start[c][j] = start
                    if c == last:
                        ready_b[c][j] = end
                    else:
                        t0 = link_f[i]
                        t0 = end if end > t0 else t0
                        x = sf[c]
                        t1 = link_f[i] = t0 + x
                        if x > 0:
                            add((i, "send_fwd", j, t0, t1, c))
                        ready_f[c + 1][j] = t1
                elif kind == "bwd":
                    at = ready_b[c][j]
                    if at is None:
                        break
                    start = t if t > at else at
                    end = start + bw[c]
                    add((i, kind, j, start, end, c))
                    held_end[c][j] = end
                    ready_w[c][j] = end
                    if c > 0:
                        link = (c - 1) % S  # the link between stage c-1's and this one, named by the receiver
                        t0 = link_b[link]
                        t0 = end if end > t0 else t0
                        x = sb[c - 1]
                        t1 = link_b[link] = t0 + x
                        if x > 0:
                            add((link, "send_bwd", j, t0, t1, c - 1))
                        ready_b[c - 1][j] = t1
                else:
                    at = ready_w[c][j]
                    if at is None:
                        break
                    start = t if t > at else at
                    end = start + wg[c]
                    add((i, kind, j, start, end, c))
                    held_end[c][j] = end
                t = end
                k += 1
            if k > pos[i]:
                remaining -= k - pos[i]
                progressed = True
                pos[i], free[i] = k, t
        if not progressed:  # cannot happen for the schedules above; guard anyway
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in task_order.")
    # Every value a stage or link ends on is a recorded task's end, or (a transfer of 0 s, not recorded) no later than
    # one: the latest of them is the latest task's end.
    return records, fwd_start, held_end, max(max(free), max(link_f), max(link_b))


def _place_shared(orders: Sequence[Sequence[tuple[str, int, int]]], resource: Sequence[int], B: int,
                  durations: dict[str, tuple[float, ...]], sf: Sequence[float],
                  sb: Sequence[float]) -> tuple[_Records, _Times, _Times]:
    """Place every task when stages share compute resources (``resource[i]``: stage i's): among the stages whose
    next task has its input, the task that can start first runs next. Returns the records (in placement order) and
    each chunk's forward starts and activation release times per microbatch."""
    S, C = len(orders), len(durations["fwd"])
    pos = [0] * S  # next task index per stage
    stage_free = [0.0] * S
    # Arrival times of inputs: ready[kind][c][j] is when chunk c may start that task of microbatch j (its
    # activation, gradient or own B has arrived).
    ready: dict[str, list[list[float | None]]] = {k: [[None] * B for _ in range(C)] for k in COMPUTE_KINDS}
    ready["fwd"][0] = [0.0] * B
    # One link per direction from each stage to the next (for interleaving, the last stage's to stage 0 too); each
    # link has one sender, which emits in its own task order, so a transfer can be placed as soon as it is made.
    link_fwd_free = [0.0] * S
    link_bwd_free = [0.0] * S
    records: _Records = []
    fwd_start = [[0.0] * B for _ in range(C)]
    held_end = [[0.0] * B for _ in range(C)]  # when the microbatch's activations are freed (last bwd or wgrad end)
    resource_free = dict.fromkeys(resource, 0.0)

    def next_start(i: int) -> float | None:
        """When stage i's next task could start (None: none left, or its input has not arrived)."""
        if pos[i] >= len(orders[i]):
            return None
        kind, c, j = orders[i][pos[i]]
        at = ready[kind][c][j]
        return None if at is None else max(stage_free[i], resource_free[resource[i]], at)

    remaining = sum(len(o) for o in orders)
    while remaining:
        # The one task (of all stages) that can start first runs next.
        starts = [(t, i) for i in range(S) for t in (next_start(i),) if t is not None]
        if not starts:  # cannot happen for the schedules above; guard anyway
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in task_order.")
        start, i = min(starts)
        kind, c, j = orders[i][pos[i]]
        end = start + durations[kind][c]
        resource_free[resource[i]] = end
        records.append((i, kind, j, start, end, c))
        stage_free[i] = end
        pos[i] += 1
        remaining -= 1
        if kind == "fwd":
            fwd_start[c][j] = start
            if c == C - 1:
                ready["bwd"][c][j] = end
            else:
                t0 = max(end, link_fwd_free[i])
                t1 = t0 + sf[c]
                link_fwd_free[i] = t1
                if sf[c] > 0:
                    records.append((i, "send_fwd", j, t0, t1, c))
                ready["fwd"][c + 1][j] = t1
        elif kind == "bwd":
            held_end[c][j] = end
            ready["wgrad"][c][j] = end
            if c > 0:
                link = (c - 1) % S  # the link between stage c-1's and this one, named by the receiver
                t0 = max(end, link_bwd_free[link])
                t1 = t0 + sb[c - 1]
                link_bwd_free[link] = t1
                if sb[c - 1] > 0:
                    records.append((link, "send_bwd", j, t0, t1, c - 1))
                ready["bwd"][c - 1][j] = t1
        else:
            held_end[c][j] = end
    return records, fwd_start, held_end


def makespan_floor(fwd_s: Sequence[float], bwd_s: Sequence[float], microbatches: int, schedule: str = "1f1b", *,
                   send_fwd_s: Sequence[float] | None = None, send_bwd_s: Sequence[float] | None = None,
                   wgrad_s: Sequence[float] | None = None, virtual_stages: int | None = None) -> float:
    """A lower bound on :func:`simulate`'s makespan with these arguments (any warm-up, memory or shared hosts), in
    O(stages) instead of a simulation: a stage runs its tasks one at a time, so it is busy ``B (f + b + w)`` in all.
    For 1F1B and GPipe (one chunk per stage) stage i also starts no earlier than microbatch 0's forward reaches it,
    ``sum_{k<i} (f_k + send_fwd_k)``, and its last task, the backward of the last microbatch, still has to travel
    back through the stages before it, ``sum_{k<i} (send_bwd_k + b_k)``: the floor is the largest of those sums.

    >>> makespan_floor([1, 1], [2, 2], 2)    # stage 1: 1 + 2 (1 + 2) + 2; simulate([1, 1], [2, 2], 2) is 9
    9.0
    """
    C = len(fwd_s)
    v = 1 if virtual_stages is None else int(virtual_stages)
    S, B = C // v, microbatches
    sf = [0.0] * (C - 1) if send_fwd_s is None else [float(x) for x in send_fwd_s]
    sb = [0.0] * (C - 1) if send_bwd_s is None else [float(x) for x in send_bwd_s]
    w = [0.0] * C if wgrad_s is None else [float(x) for x in wgrad_s]
    busy = [B * sum(float(fwd_s[c]) + float(bwd_s[c]) + w[c] for c in range(i, C, S)) for i in range(S)]
    if v > 1 or schedule not in ("1f1b", "gpipe"):
        return max(busy)
    best = into = back = 0.0  # into / back: the forward path to stage i, the backward path from it
    for i in range(S):
        best = max(best, into + busy[i] + back)
        if i < S - 1:
            into += float(fwd_s[i]) + sf[i]
            back += sb[i] + float(bwd_s[i])
    return best


def _max_alive(starts: Sequence[float], ends: Sequence[float]) -> int:
    """:func:`_max_overlap` of the intervals ``[starts[j], ends[j])``, by sorting the starts and the ends apart.

    With ends before starts at equal times, the count of those alive rises only at starts, so its highest values come
    right after all the starts at one time ``t``: ``#(starts <= t) - #(ends <= t)``, the largest over the starts (or
    0, as the event sweep starts from 0). Counts of the same floats: exact.
    """
    s = np.sort(np.asarray(starts, dtype=float))
    e = np.sort(np.asarray(ends, dtype=float))
    alive = np.searchsorted(s, s, side="right") - np.searchsorted(e, s, side="right")
    return max(int(alive.max()), 0)


def _max_overlap(intervals: list[tuple[float, float]], weights: Sequence[float] | None = None):
    """Most half-open intervals [start, end) alive at one instant (with ``weights``: the largest sum of the
    weights of those alive at one instant).

    A microbatch whose bwd ends exactly when another's fwd starts frees its memory first,
    so ends sort before starts at equal times.
    """
    w = [1.0] * len(intervals) if weights is None else [float(x) for x in weights]
    events = [(s, 1, x) for (s, _), x in zip(intervals, w)] + [(e, -1, x) for (_, e), x in zip(intervals, w)]
    events.sort(key=lambda x: (x[0], x[1]))
    alive = best = 0.0
    for _, sign, x in events:
        alive += sign * x
        best = max(best, alive)
    return int(best) if weights is None else best
