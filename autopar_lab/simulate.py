"""Event-level pipeline simulator: GPipe and 1F1B schedules as timelines.

The model is deliberately small so every number can be checked by hand:

* each stage is one compute resource that runs its task list strictly in order;
* each cut between stage ``i`` and ``i + 1`` is two link resources, one per direction
  (activations forward, gradients backward); transfers on one link are serialised,
  but a transfer overlaps compute on both stages;
* ``fwd`` of microbatch ``j`` on stage ``i`` may start once ``fwd j`` on stage ``i - 1``
  has finished and its activation has crossed the cut; ``bwd j`` on stage ``i`` may start
  once ``bwd j`` on stage ``i + 1`` has finished and its gradient has crossed back
  (the last stage starts ``bwd j`` after its own ``fwd j``).

Example (2 stages, 2 microbatches, fwd 1 s, bwd 2 s):

>>> tl = simulate([1, 1], [2, 2], 2, schedule="gpipe")
>>> tl.makespan
9.0
>>> [(t.kind, t.microbatch, t.start, t.end) for t in tl.tasks if t.stage == 1]
[('fwd', 0, 1.0, 2.0), ('fwd', 1, 2.0, 3.0), ('bwd', 0, 3.0, 5.0), ('bwd', 1, 5.0, 7.0)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["ScheduleStuck", "Task", "Timeline", "issue_order", "simulate", "stage_order"]

SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Task:
    """One interval on a resource. ``stage`` is the compute stage for ``fwd``/``bwd``;
    for ``send_fwd``/``send_bwd`` it is the cut index (the cut between stage ``stage``
    and ``stage + 1``)."""

    stage: int
    kind: str  # "fwd" | "bwd" | "send_fwd" | "send_bwd"
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """The result of :func:`simulate`. Per-stage figures are tuples indexed by stage."""

    tasks: tuple[Task, ...]
    num_stages: int
    microbatches: int
    schedule: str
    makespan: float
    busy_s: tuple[float, ...]
    peak_inflight: tuple[int, ...]  # most microbatches alive at once (fwd start .. bwd end)
    peak_mem_bytes: tuple[float, ...]  # static + peak_inflight * act_bytes

    @property
    def bubble_fraction(self) -> float:
        """Idle compute time over total stage time: ``1 - sum(busy) / (S * makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (self.num_stages * self.makespan)

    def to_rows(self) -> list[dict]:
        """One dict per task, ready for a Gantt chart (e.g. ``plotly.express.timeline``
        after mapping seconds to a time axis). ``resource`` names the row."""
        rows = []
        for t in self.tasks:
            if t.kind in ("fwd", "bwd"):
                resource = f"stage {t.stage}"
            else:
                arrow = "->" if t.kind == "send_fwd" else "<-"
                resource = f"link {t.stage}{arrow}{t.stage + 1}"
            rows.append(
                {
                    "resource": resource,
                    "stage": t.stage,
                    "kind": t.kind,
                    "microbatch": t.microbatch,
                    "start": t.start,
                    "end": t.end,
                    "duration": t.end - t.start,
                }
            )
        return rows


def stage_order(stage: int, num_stages: int, microbatches: int, schedule: str = "1f1b",
                warmup: int | None = None) -> list[tuple[str, int]]:
    """The order in which one stage runs its compute tasks.

    GPipe: every fwd, then every bwd, in microbatch order. 1F1B (PipeDream-flush):
    ``min(S - i, B)`` warm-up fwds (or ``min(warmup, B)`` when given: deeper warm-up hides slow transfers between
    stages, at the price of more microbatches in flight), then alternate one bwd and one fwd, then drain bwds.

    >>> stage_order(0, 2, 3)
    [('fwd', 0), ('fwd', 1), ('bwd', 0), ('fwd', 2), ('bwd', 1), ('bwd', 2)]
    """
    s, b = num_stages, microbatches
    if schedule == "gpipe":
        return [("fwd", j) for j in range(b)] + [("bwd", j) for j in range(b)]
    if schedule != "1f1b":
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
    warm = min(s - stage if warmup is None else max(int(warmup), 1), b)
    order = [("fwd", j) for j in range(warm)]
    for j in range(b - warm):  # steady state: one bwd frees a slot for one more fwd
        order += [("bwd", j), ("fwd", warm + j)]
    order += [("bwd", j) for j in range(b - warm, b)]
    return order


class ScheduleStuck(RuntimeError):
    """No stage's next task can run: each waits for a value no task left to run will produce."""


def issue_order(orders: Sequence[Sequence[tuple[str, int]]], ready: Callable[[int, str, int], bool]):
    """Walk every stage's order (from :func:`stage_order`) and yield ``(stage, kind, microbatch)`` whenever that
    stage's next task is ``ready``; the caller runs (or submits) the task before asking for the next one, so
    ``ready`` sees its effects. Each stage keeps its own order; stages interleave. This is how a runtime drives a
    pipeline: the local runner and the Ray driver both issue their tasks with it.
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
                kind, j = order[pos[k]]
                if not ready(k, kind, j):
                    break
                yield k, kind, j
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


def simulate(
    fwd_s: Sequence[float],
    bwd_s: Sequence[float],
    microbatches: int,
    schedule: str = "1f1b",
    send_fwd_s: Sequence[float] | None = None,
    send_bwd_s: Sequence[float] | None = None,
    act_bytes: Sequence[float] | None = None,
    static_bytes: Sequence[float] | None = None,
    warmup: Sequence[int] | None = None,
) -> Timeline:
    """Simulate one training step of a pipeline and return its :class:`Timeline`.

    ``fwd_s[i]``/``bwd_s[i]``: seconds per microbatch on stage ``i``. ``send_fwd_s[c]``/
    ``send_bwd_s[c]``: seconds to move one microbatch's activation / gradient over cut ``c``
    (between stage ``c`` and ``c + 1``); zeros by default. ``act_bytes[i]``: bytes stage
    ``i`` keeps per in-flight microbatch; ``static_bytes[i]``: bytes it always holds.

    Transfer tasks are recorded only on cuts whose transfer time is positive.

    >>> tl = simulate([1, 1], [2, 2], 2, "1f1b")
    >>> tl.makespan, tl.peak_inflight
    (9.0, (2, 1))
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}.")
    num_stages = len(fwd_s)
    if num_stages < 1:
        raise ValueError("fwd_s must name at least one stage.")
    fwd = _check_vector("fwd_s", fwd_s, num_stages)
    bwd = _check_vector("bwd_s", bwd_s, num_stages)
    zeros_cut = [0.0] * (num_stages - 1)
    zeros_stage = [0.0] * num_stages
    sf = _check_vector("send_fwd_s", zeros_cut if send_fwd_s is None else send_fwd_s, num_stages - 1)
    sb = _check_vector("send_bwd_s", zeros_cut if send_bwd_s is None else send_bwd_s, num_stages - 1)
    act = _check_vector("act_bytes", zeros_stage if act_bytes is None else act_bytes, num_stages)
    static = _check_vector("static_bytes", zeros_stage if static_bytes is None else static_bytes, num_stages)

    S, B = num_stages, microbatches
    if warmup is not None and len(warmup) != S:
        raise ValueError(f"warmup has {len(warmup)} entries but {S} are needed.")
    orders = [stage_order(i, S, B, schedule, None if warmup is None else warmup[i]) for i in range(S)]
    pos = [0] * S  # next task index per stage
    stage_free = [0.0] * S
    # Arrival times of inputs: fwd_ready[i][j] is when stage i may start fwd j
    # (its activation has arrived); bwd_ready[i][j] likewise for the gradient.
    fwd_ready: list[list[float | None]] = [[None] * B for _ in range(S)]
    bwd_ready: list[list[float | None]] = [[None] * B for _ in range(S)]
    fwd_ready[0] = [0.0] * B
    link_fwd_free = [0.0] * (S - 1)
    link_bwd_free = [0.0] * (S - 1)
    tasks: list[Task] = []
    fwd_start = [[0.0] * B for _ in range(S)]
    bwd_end = [[0.0] * B for _ in range(S)]

    remaining = S * 2 * B
    while remaining:
        progressed = False
        for i in range(S):
            # Run as many tasks of stage i as are ready; the list is strictly in order.
            while pos[i] < len(orders[i]):
                kind, j = orders[i][pos[i]]
                ready = fwd_ready[i][j] if kind == "fwd" else bwd_ready[i][j]
                if ready is None:
                    break
                start = max(stage_free[i], ready)
                end = start + (fwd[i] if kind == "fwd" else bwd[i])
                tasks.append(Task(i, kind, j, start, end))
                stage_free[i] = end
                pos[i] += 1
                remaining -= 1
                progressed = True
                if kind == "fwd":
                    fwd_start[i][j] = start
                    if i == S - 1:
                        bwd_ready[i][j] = end
                    else:
                        # Each stage emits fwds in microbatch order, so FIFO on the link
                        # is microbatch order and we can place the transfer right away.
                        t0 = max(end, link_fwd_free[i])
                        t1 = t0 + sf[i]
                        link_fwd_free[i] = t1
                        if sf[i] > 0:
                            tasks.append(Task(i, "send_fwd", j, t0, t1))
                        fwd_ready[i + 1][j] = t1
                else:
                    bwd_end[i][j] = end
                    if i > 0:
                        t0 = max(end, link_bwd_free[i - 1])
                        t1 = t0 + sb[i - 1]
                        link_bwd_free[i - 1] = t1
                        if sb[i - 1] > 0:
                            tasks.append(Task(i - 1, "send_bwd", j, t0, t1))
                        bwd_ready[i - 1][j] = t1
        if not progressed:  # cannot happen for the two schedules above; guard anyway
            raise RuntimeError("pipeline schedule deadlocked; this is a bug in stage_order.")

    makespan = max(t.end for t in tasks)
    busy = tuple(B * (fwd[i] + bwd[i]) for i in range(S))
    peak = tuple(_max_overlap([(fwd_start[i][j], bwd_end[i][j]) for j in range(B)]) for i in range(S))
    mem = tuple(static[i] + peak[i] * act[i] for i in range(S))
    tasks.sort(key=lambda t: (t.start, t.kind not in ("fwd", "bwd"), t.stage, t.end))
    return Timeline(tuple(tasks), S, B, schedule, makespan, busy, peak, mem)


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Most half-open intervals [start, end) alive at one instant.

    A microbatch whose bwd ends exactly when another's fwd starts frees its memory first,
    so ends sort before starts at equal times.
    """
    events = [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals]
    events.sort(key=lambda x: (x[0], x[1]))
    alive = best = 0
    for _, delta in events:
        alive += delta
        best = max(best, alive)
    return best
