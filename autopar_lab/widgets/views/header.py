"""The workbench's header: what the plan is, its step time (and what it was before the last change), its peak memory
against the device limit, the pins, the history, and the undo / redo buttons. It stays at the top of the notebook's
view while the workbench scrolls under it (CSS ``position: sticky``, see :mod:`autopar_lab.widgets.workbench`).

    >>> plan_text(session.plan)                          # doctest: +SKIP
    'auto plan: 2 stages on 8 devices, 8 microbatches, 1f1b, fp16'

The number format (:mod:`autopar_lab.precision`) is the plan's; its tooltip says what it keeps in which dtype.
"""

from __future__ import annotations

import html

import ipywidgets as w

from ...precision import TRACED
from ...rematmode import is_full, is_selective
from ._base import View
from .cost_panel import step_time_text
from .fmt import fmt_bytes, fmt_pct


def plan_text(plan) -> str:
    """One line saying what the plan is."""
    n = len(plan.stages)
    remat = sum(is_full(st.remat) for st in plan.stages)
    selective = sum(is_selective(st.remat) for st in plan.stages)
    fmt = plan.precision
    return (f"{plan.method} plan: {n} stage{'s' if n != 1 else ''} on {plan.cluster.num_devices} devices, "
            f"{plan.microbatches} microbatch{'es' if plan.microbatches != 1 else ''}, {plan.schedule}, "
            f"{'as traced' if fmt.name == TRACED else fmt.name}"
            + (f", remat on {remat} stage{'s' if remat != 1 else ''}" if remat else "")
            + (f", selective remat on {selective} stage{'s' if selective != 1 else ''}" if selective else ""))


def memory_summary(plan) -> str:
    """``"peak memory 1.2 GiB of 16 GiB (7.5%)"``, with a warning when a stage is over the limit."""
    peak, limit = max(plan.cost.peak_mem_bytes), plan.cost.mem_limit_bytes
    text = f"peak memory {fmt_bytes(peak)} of {fmt_bytes(limit)} ({fmt_pct(peak / limit)})"
    return text + (" — over the limit" if peak > limit else "")


def pins_text(plan) -> str:
    ops, stages = len(plan.pins), sorted(plan.stage_pins)
    text = f"{ops} operator pin{'s' if ops != 1 else ''}"
    own = len(getattr(plan, "layer_pins", {}))  # operators of layers split from their group
    text += f" + {own} in split layer{'s' if own != 1 else ''}" if own else ""
    return text + (f"; pinned: {', '.join(stages)}" if stages else "")


class Header(View):
    """The sticky header (CSS class ``autopar-header``); the step time carries ``autopar-step-time``. ``buttons``:
    widgets shown at its right end (the workbench passes the controls' undo and redo)."""

    css = "autopar-header"

    def __init__(self, session, buttons=()):
        super().__init__(session)
        self.before = session.previous
        self.plan_line = w.HTML("")
        self.step_time = w.HTML("")
        self.step_time.add_class("autopar-step-time")
        self.memory = w.HTML("")
        self.pins = w.HTML("")
        self.history = w.HTML("")
        self.refresh()
        info = w.VBox([w.HBox([self.plan_line, self.history], layout=w.Layout(flex_flow="row wrap")),
                       self.step_time,
                       w.HBox([self.memory, self.pins], layout=w.Layout(flex_flow="row wrap"))],
                      layout=w.Layout(flex="1 1 auto", min_width="0"))
        self.buttons = w.HBox(list(buttons), layout=w.Layout(flex="0 0 auto", align_items="center"))
        box = w.HBox([info, self.buttons], layout=w.Layout(width="100%", align_items="center"))
        self._finish(box)

    def set_buttons(self, buttons) -> None:
        """The widgets at the header's right end (the workbench's undo and redo, made after the header)."""
        self.buttons.children = tuple(buttons)

    def refresh(self) -> None:
        s = self.session
        plan = s.plan
        before = self.before.cost if self.before is not None else None
        self.plan_line.value = (f"<b title='{html.escape(plan.cost.precision or plan.precision.describe())}'>"
                                f"{html.escape(plan_text(plan))}</b>&nbsp;&nbsp;")
        self.step_time.value = f"<b>{html.escape(step_time_text(before, plan.cost))}</b>"
        over = max(plan.cost.peak_mem_bytes) > plan.cost.mem_limit_bytes
        style = " style='color:#B00020'" if over else ""
        self.memory.value = f"<span{style}>{html.escape(memory_summary(plan))}</span>&nbsp;·&nbsp;"
        self.pins.value = html.escape(pins_text(plan))
        last = s.last_action
        self.history.value = (f"<span style='color:#666'>history {len(s.history)} step(s)"
                              + (f", last: {html.escape(last)}" if last != "start" else "") + "</span>")

    def on_plan(self, event) -> None:
        self.before = event.before if event.before is not event.after else self.before
        self.refresh()
