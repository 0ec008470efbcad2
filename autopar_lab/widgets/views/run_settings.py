"""The stage layout's run settings, previewed before they apply: microbatch count, pipeline schedule and chunks per
stage. Choosing one prices the plan it would make (:func:`pending_plan`) and :func:`run_preview_html` says its step
time and memory against the current plan's, "does not fit" in words; the stage layout applies it on confirm.

The microbatch counts offered are those the plan's batch and the chosen schedule accept (:func:`microbatch_choices`):
divisors of the batch, and for the interleaved schedule multiples of the stage count (it runs the microbatches in
groups of that many, Narayanan et al. SC21). Choosing interleaved with a count it cannot run moves the count to the
nearest one it can, and says so; when the batch has none, the preview says which stage counts could interleave.

    >>> microbatch_choices(plan, "interleaved")              # doctest: +SKIP
    [3, 6, 12, 24]
"""

from __future__ import annotations

import html

from .fmt import fmt_bytes, fmt_delta_bytes, fmt_delta_s, fmt_pct, fmt_s

__all__ = ["batch_size", "microbatch_choices", "pending_plan", "run_preview_html"]


def batch_size(plan) -> int:
    """The plan's global batch (its cost table's), or its microbatch count when it has no table."""
    return plan.table.batch_size if plan.table is not None else plan.microbatches


def microbatch_choices(plan, schedule: str | None = None) -> list[int]:
    """Every microbatch count ``plan`` can run with ``schedule`` (default: its own): the divisors of its batch, for
    the interleaved schedule only the multiples of its stage count."""
    batch = batch_size(plan)
    step = len(plan.stages) if (schedule or plan.schedule) == "interleaved" else 1
    return [d for d in range(1, batch + 1) if batch % d == 0 and d % step == 0]


def _interleavable_stage_counts(batch: int, most: int) -> list[int]:
    """The stage counts from 2 to ``most`` that some divisor of ``batch`` is a multiple of."""
    return [p for p in range(2, most + 1) if batch % p == 0]


def pending_plan(plan, microbatches: int, schedule: str, virtual_stages: int | None) -> tuple:
    """``(new plan, note)``: ``plan`` with these run settings, priced (``plan`` itself when nothing changes);
    ``note`` says what was adjusted (a microbatch count the schedule cannot run moved to the nearest one it can),
    or "". A ValueError says, in the workbench's words, why no such plan exists."""
    note = ""
    if schedule == "interleaved":
        choices = microbatch_choices(plan, "interleaved")
        p = len(plan.stages)
        if p < 2:
            raise ValueError("the interleaved schedule needs 2 or more pipeline stages and this plan has 1: add a "
                             "stage in the stage editor first.")
        if not choices:
            batch = batch_size(plan)
            counts = _interleavable_stage_counts(batch, max(8, p + 1))
            raise ValueError(f"the interleaved schedule runs the microbatches in groups of the stage count ({p}), so "
                             f"it needs a microbatch count that is a multiple of {p} and divides the batch of {batch}: "
                             f"none does. Make it {' or '.join(map(str, counts[:4]))} stages in the stage editor to "
                             "interleave.")
        if microbatches not in choices:
            near = min(choices, key=lambda d: (max(d / microbatches, microbatches / d), d))
            note = (f"interleaving runs the microbatches in groups of {p}: {near} microbatches, the nearest count "
                    f"to {microbatches} that is a multiple of {p}")
            microbatches = near
    v = virtual_stages if schedule == "interleaved" else None
    same_schedule = schedule == plan.schedule and (schedule != "interleaved" or v == plan.virtual_stages)
    new = plan
    if schedule == "interleaved":  # counts first: the interleaved plan must be able to run them
        if microbatches != new.microbatches:
            new = new.with_microbatches(int(microbatches))
        if not same_schedule:
            new = new.with_schedule(schedule, v)
    else:
        if not same_schedule:
            new = new.with_schedule(schedule)
        if microbatches != new.microbatches:
            new = new.with_microbatches(int(microbatches))
    return new, note


def _what(plan) -> str:
    chunks = f" ({plan.virtual_stages} chunks per stage)" if plan.schedule == "interleaved" else ""
    return f"{plan.schedule}{chunks}, {plan.microbatches} microbatch{'es' if plan.microbatches != 1 else ''}"


def run_preview_html(plan, new, note: str = "") -> str:
    """The preview of run settings: what changes, the step time and the largest stage's memory before -> after,
    and whether it fits (said plainly when it does not)."""
    if new is plan:
        return "<small>the run settings are the current plan's</small>"
    a, b = plan.cost, new.cost
    peak_a, peak_b, limit = max(a.peak_mem_bytes), max(b.peak_mem_bytes), b.mem_limit_bytes
    fits = ("fits" if peak_b <= limit else
            f"<b style='color:#B00020'>does not fit</b>: its largest stage needs {fmt_bytes(peak_b)} per device "
            f"and a device has {fmt_bytes(limit)}")
    return (f"preview: {html.escape(_what(plan))} → <b>{html.escape(_what(new))}</b><br>"
            f"step time {fmt_s(a.step_time_s)} → <b>{fmt_s(b.step_time_s)}</b> "
            f"({fmt_delta_s(a.step_time_s, b.step_time_s)}) · peak memory {fmt_bytes(peak_a)} → "
            f"<b>{fmt_bytes(peak_b)}</b> of {fmt_bytes(limit)} ({fmt_pct(peak_b / limit)}; "
            f"{fmt_delta_bytes(peak_a, peak_b)}), {fits}"
            + (f"<br><small>{html.escape(note)}</small>" if note else ""))
