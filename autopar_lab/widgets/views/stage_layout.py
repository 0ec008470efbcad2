"""Stage-to-submesh layout: the cluster as a hosts x devices grid with the stages as coloured blocks, and a stage
editor: every stage's first layer (chosen by name), submesh, logical mesh and remat edited together, with a preview
of the plan they make (step time, memory, or why it is not valid) before it is applied; plus the run settings
(microbatch count, schedule, chunks per stage), previewed the same way (:mod:`.run_settings`) and applied on confirm.

Editing one stage at a time cannot work when stages must tile the cluster in order: a stage that grows pushes the
next one across a host boundary. So edits go to a draft of all stages; each edit re-prices the draft
(:meth:`Plan.with_stages`, then remat per stage) and "apply" makes the previewed plan current in one undoable step.
Adding or removing a stage lets the stage DP choose every submesh for the new cuts ("auto"); the draft then shows
its choice, which the user can change.

    >>> stage_blocks(session.plan)[0]["label"]          # doctest: +SKIP
    'S0: layers 0-3 (embed..layer_2) on 1x4 as 2x2'
"""

from __future__ import annotations

import html

import ipywidgets as w

from ...graph.modules import module_label
from ...pins import PinIndex, stage_runs
from ...rematmode import REMAT_CHOICES, is_full, is_selective, remat_label, remat_value
from ...schedules import SCHEDULES
from . import figures
from ._base import USER_ERRORS, LiveFigure, View, sync_figure
from .run_settings import microbatch_choices, pending_plan, run_preview_html
from .fmt import fmt_bytes, fmt_delta_s, fmt_pct, fmt_s

AUTO = "auto"


def stage_blocks(plan) -> list[dict]:
    """One dict per stage for :func:`figures.mesh_grid_figure`: devices and a label (layers, submesh, logical mesh)."""
    names = plan.layer_names
    out = []
    for k, st in enumerate(plan.stages):
        a, b = st.layers
        remat = ", remat" if is_full(st.remat) else ", selective remat" if is_selective(st.remat) else ""
        lean = ", lean" if getattr(st, "solution", "fast") == "lean" else ""  # the mesh's memory-lean sharding
        where = f"layers {a}-{b} ({names[a]}..{names[b]})"
        if getattr(st, "chunks", ()):  # interleaved: the chunks the stage runs
            where = "chunks " + ", ".join(f"{x}-{y}" for x, y in st.chunks) + f" ({b - a + 1} layers)"
        out.append({"devices": list(st.devices),
                    "label": f"S{k}: {where} on {st.submesh[0]}x{st.submesh[1]} "
                             f"as {st.logical_mesh[0]}x{st.logical_mesh[1]}{remat}{lean}"})
    return out


def draft_of(plan) -> list[dict]:
    """The editable form of a plan's stages: [{first, submesh, logical_mesh, remat, edited}] (``first``: layer
    index; ``edited``: the user set this stage's submesh or logical mesh, so adding or removing a stage keeps it)."""
    return [{"first": st.layers[0], "submesh": tuple(st.submesh), "logical_mesh": tuple(st.logical_mesh),
             "remat": remat_value(st.remat), "edited": False} for st in plan.stages]


def _spec(draft: list[dict]) -> list[tuple]:
    """What a draft asks of the plan (not which of it the user typed)."""
    return [(d["first"], d["submesh"], d["logical_mesh"], d["remat"]) for d in draft]


def _ranges(plan, draft: list[dict]) -> list[tuple[int, int]]:
    ends = [d["first"] - 1 for d in draft[1:]] + [len(plan.layer_names) - 1]
    return [(d["first"], e) for d, e in zip(draft, ends)]


def _runs(plan, draft: list[dict]) -> list:
    """The layer ranges each stage of ``draft`` runs (its chunks on an interleaved plan)."""
    return stage_runs(_ranges(plan, draft), plan.virtual_stages if plan.schedule == "interleaved" else 1)


def _mesh(shape) -> str:
    return f"{shape[0]}x{shape[1]}"


def _pins_missing(pins: PinIndex, runs, submesh, shape) -> list[tuple[int, str]]:
    """The pins (operator of the plan's graph, strategy) a stage running ``runs`` cannot hold on that mesh."""
    out = [(pins.user[op], name) for op, name in pins.in_ranges(runs).items()
           if pins.strategy(op, submesh, shape) is None]
    for full, (k, sop) in pins.split.items():  # layers split from their group: their own pins
        if any(a <= k <= b for a, b in runs) and (
                sop is None or pins.strategy(sop, submesh, shape, pins.layer_pins[full]) is None):
            out.append((full, pins.layer_pins[full]))
    return out


def best_view(plan, draft: list[dict], k: int, submesh) -> tuple[int, int]:
    """The logical mesh to fill in when stage ``k`` of ``draft`` gets ``submesh``: among the submesh's views that
    hold every operator pin of the layers the stage runs, the one the cost table prices fastest for those layers
    (among the meshes it has solved already: choosing one must not start an ILP), else the first such view, else
    (none holds them: the preview says why) the submesh's own shape."""
    sub = tuple(submesh)
    views = [tuple(v) for v in plan.cluster.logical_mesh_shapes(sub)]
    pins = PinIndex(plan)
    runs = _runs(plan, draft)[k]
    holding = [v for v in views if not _pins_missing(pins, runs, sub, v)]
    if not holding:
        return sub
    table = plan.table
    if table is None:
        return holding[0]
    first, last = _ranges(plan, draft)[k]
    remat = remat_value(draft[k]["remat"]) if draft[k]["remat"] is not None else False
    priced = [(table.stage(first, last, sub, v, plan.microbatches, remat).time_s, i, v)
              for i, v in enumerate(holding) if table.solved_mesh(sub, v) is not None]
    return min(priced)[2] if priced else holding[0]


def draft_problem(plan, draft: list[dict]) -> str | None:
    """The first thing wrong with a stage of ``draft`` that no layout can get round, said with the stage and the
    reason (a pinned operator its mesh cannot run, a logical mesh that is no view of its submesh), or None."""
    names = plan.layer_names
    pins = PinIndex(plan)
    copy = plan.op_graph is not plan.graph  # planned on a shallower copy: its blocks share solutions
    for k, (d, runs, (a, b)) in enumerate(zip(draft, _runs(plan, draft), _ranges(plan, draft))):
        sub, shape = d["submesh"], d["logical_mesh"]
        if sub is None:
            continue
        views = [tuple(v) for v in plan.cluster.logical_mesh_shapes(sub)]
        where = f"S{k} (layers {a}-{b}, {names[a]}..{names[b]})"
        if shape is not None and tuple(shape) not in views:
            return (f"{where}: as mesh {_mesh(shape)} is not a view of its {_mesh(sub)} submesh; choose one of "
                    f"{', '.join(map(_mesh, views))}.")
        tried = [tuple(shape)] if shape is not None else views
        missing = [_pins_missing(pins, runs, sub, v) for v in tried]
        if all(missing):
            op, name = missing[0][0]
            g = plan.graph
            node = g.op(op)
            label = module_label(g, op).label or node.primitive
            shared = plan.pins[op].scope == "shared"
            whose = f"{node.layer}" + (" and every layer sharing its solution" if copy and shared else "")
            mesh = f"a {_mesh(tried[0])} mesh" if shape is not None else f"no view of its {_mesh(sub)} submesh"
            holding = [v for v in views if not _pins_missing(pins, runs, sub, v)]
            fix = (f"choose as mesh {' or '.join(map(_mesh, holding))}" if holding else
                   f"give S{k} a submesh one of whose views has that strategy")
            has = "has no strategy" if shape is not None else "has a strategy"
            return (f"{where} runs operator #{op} ({label}, {node.primitive} of {whose}) pinned to {name!r}, and "
                    f"{mesh} {has} of that name; {fix}, or unpin the operator in the sharding table.")
    return None


def _no_layout(plan, draft: list[dict], kept: list) -> str:
    """Why the stage DP found no layout for ``draft`` (its cuts fixed, ``kept``: the stages given a submesh)."""
    S, n = len(draft), plan.cluster.num_devices
    pins = PinIndex(plan)
    cluster = plan.cluster
    meshes = [(tuple(sub), tuple(v)) for sub in cluster.submesh_shapes() for v in cluster.logical_mesh_shapes(sub)]
    narrow = []
    for op, name in pins.in_ranges(_ranges(plan, draft)).items():
        runs_on = sorted({v for sub, v in meshes if pins.strategy(op, sub, v) is not None})
        if len(runs_on) < len({v for _, v in meshes}):
            narrow.append(f"operator #{pins.user[op]} pinned to {name!r} runs only on {', '.join(map(_mesh, runs_on))} "
                          "meshes")
    why = ("; ".join(narrow[:2]) + (f" (and {len(narrow) - 2} more pins)" if len(narrow) > 2 else "")
           + ", and every stage running it must be on one") if narrow else ""
    given = ", ".join(f"S{k} on {_mesh(d['submesh'])}" for k, d in kept)
    auto = [f"S{k}" for k, d in enumerate(draft) if d["submesh"] is None]
    head = (f"no layout of these {S} stages tiles the cluster's {n} devices in order"
            + (f" with {given} as you set {'it' if len(kept) == 1 else 'them'}" if kept else "")
            + (f" and {', '.join(auto)} placed by the planner" if auto and kept else ""))
    fix = ("remove a stage, unpin the operator in the sharding table" if narrow else "remove a stage")
    if kept:
        fix += ", or set a stage you set back to auto"
    return f"{head}{': ' + why if why else ''}; {fix}."


def plan_from_draft(plan, draft: list[dict]):
    """The plan ``draft`` describes, priced from ``plan``'s cost table (a ValueError says what is wrong, naming the
    stage). A submesh of ``None`` (auto) lets the stage DP choose that stage's submesh and logical mesh around the
    stages given (all of them when none is given)."""
    if not draft or draft[0]["first"] != 0:
        raise ValueError("the first stage must start at the first layer")
    problem = draft_problem(plan, draft)
    if problem is not None:
        raise ValueError(problem)
    boundaries = [d["first"] for d in draft[1:]]
    kw: dict = {"boundaries": boundaries}
    kept = [(k, d) for k, d in enumerate(draft) if d["submesh"] is not None]
    if kept:
        kw["submeshes"] = [d["submesh"] for d in draft]
        kw["logical_meshes"] = [d["logical_mesh"] if d["submesh"] is not None else None for d in draft]
    try:
        new = plan.with_stages(**kw)
    except ValueError as e:
        if "no stage layout keeps" not in str(e):
            raise
        raise ValueError(_no_layout(plan, draft, kept)) from None
    for k, d in enumerate(draft):
        if d["remat"] is not None and remat_value(d["remat"]) != new.stages[k].remat:
            new = new.with_remat(k, remat_value(d["remat"]))
    return new


class StageLayout(View):
    """The hosts x devices grid, the stage editor with its preview, microbatches and schedule."""

    css = "autopar-stage-layout"

    def __init__(self, session):
        super().__init__(session)

        plan = session.plan
        c = plan.cluster
        self.stage = 0
        self.figure = LiveFigure(figures.mesh_grid_figure(c.hosts, c.devices_per_host, stage_blocks(plan), 0,
                                                               width=figures.SIDE_WIDTH, legend=False))
        self.figure.data[0].on_click(self._plotly_click)
        self.summary = w.HTML("")
        self.rows_box = w.GridBox([], layout=w.Layout(grid_template_columns="34px minmax(0,1.6fr) minmax(0,1fr) "
                                                                            "minmax(0,1fr) 64px",
                                                      grid_gap="2px 4px", width="100%"))
        self.rows_box.add_class("autopar-stage-editor")
        self.preview = w.HTML("")
        self.preview.add_class("autopar-stage-preview")
        B = lambda d, t="": w.Button(description=d, tooltip=t, layout=w.Layout(width="auto"))  # noqa: E731
        self.add_button = B("+ stage", "split the stage with the most layers in two (the DP picks the submeshes)")
        self.remove_button = B("− stage", "merge the last stage into the one before it")
        self.reset_button = B("reset", "the draft back to the current plan's stages")
        self.apply_button = B("apply stages", "make the previewed plan current (undoable)")
        self.apply_button.add_class("autopar-apply-stages")
        self.add_button.on_click(lambda _: self.add_stage())
        self.remove_button.on_click(lambda _: self.remove_stage())
        self.reset_button.on_click(lambda _: self.reset())
        self.apply_button.on_click(lambda _: self.apply())
        self.microbatches = w.Dropdown(description="microbatches", layout=w.Layout(width="190px"),
                                       style={"description_width": "initial"})
        self.schedule = w.ToggleButtons(options=list(SCHEDULES), description="schedule",
                                        style={"button_width": "auto", "description_width": "initial"})
        # Model chunks per stage of the interleaved schedule (enabled only for it).
        self.virtual_stages = w.BoundedIntText(value=2, min=2, max=64, description="chunks per stage",
                                               layout=w.Layout(width="170px"), style={"description_width": "initial"})
        self.unpin_button = B("unpin stage decisions",
                              "let the next resolve change cuts, submeshes, microbatches, schedule, remat")
        self.unpin_button.on_click(lambda _: self.unpin_stages())
        self._quiet = False
        # The run settings: each change prices the plan it makes (a preview); "apply" makes it current.
        self.microbatches.observe(lambda ch: None if self._quiet else self.edit_run(microbatches=ch["new"]),
                                  names="value")
        self.schedule.observe(lambda ch: None if self._quiet else self.edit_run(schedule=ch["new"]), names="value")
        self.virtual_stages.observe(
            lambda ch: None if self._quiet else self.edit_run(virtual_stages=ch["new"]), names="value")
        self.run_preview = w.HTML("")
        self.run_preview.add_class("autopar-run-preview")
        self.apply_run_button = B("apply run settings", "make the previewed microbatches and schedule current "
                                                        "(undoable)")
        self.apply_run_button.add_class("autopar-apply-run")
        self.cancel_run_button = B("cancel", "the run settings back to the current plan's")
        self.apply_run_button.on_click(lambda _: self.apply_run())
        self.cancel_run_button.on_click(lambda _: self._sync_controls())
        self.run_plan = None  # the plan the run settings make (None: not valid, see run_error)
        self.run_error: str | None = None
        self.draft: list[dict] = []
        self.preview_plan = None
        self.preview_error: str | None = None
        self._previewed: tuple = ([], None)  # (draft, plan) the preview was priced for
        self._row_widgets: list[dict] = []
        self.refresh()
        self._finish(w.VBox([
            self.figure, self.summary, w.HTML("<b>stages</b> (edit any, then apply):"), self.rows_box,
            w.HBox([self.add_button, self.remove_button, self.reset_button, self.apply_button],
                   layout=w.Layout(flex_flow="row wrap")),
            self.preview,
            w.HTML("<b>run</b> (choose, then apply):"),
            w.HBox([self.microbatches, self.schedule, self.virtual_stages], layout=w.Layout(flex_flow="row wrap")),
            self.run_preview, w.HBox([self.apply_run_button, self.cancel_run_button]),
            w.HBox([self.unpin_button]),
            self.message], layout=w.Layout(min_width="0")))

    def _plotly_click(self, trace, points, state) -> None:
        if points.point_inds:
            k = trace.customdata[points.point_inds[0]][0]
            if k >= 0:
                self.on_click_stage(int(k))

    # --- actions ------------------------------------------------------------------------------------------------------
    def on_click_stage(self, k: int) -> None:
        """A device square was clicked: select its stage."""
        self.run("select", lambda: self.session.select(stage=k))

    def edit_stage(self, k: int, first=None, submesh=None, logical_mesh=None, remat=None) -> None:
        """Change stage ``k`` in the draft (``first``: a layer index or name; ``submesh`` / ``logical_mesh``: a
        pair, or ``"auto"`` to let the DP choose) and preview the result."""
        if not 0 <= k < len(self.draft):
            raise ValueError(f"stage {k} is not in the draft (stages 0..{len(self.draft) - 1})")
        d = self.draft[k]
        if first is not None:
            if k == 0:
                raise ValueError("the first stage always starts at the first layer")
            d["first"] = self._layer_index(first)
        if submesh is not None:
            d["submesh"] = None if submesh == AUTO else tuple(submesh)
            d["edited"] = d["submesh"] is not None
            if d["submesh"] is None:
                d["logical_mesh"] = None
            elif d["logical_mesh"] not in self._views(d["submesh"]) or _pins_missing(
                    PinIndex(self.session.plan), _runs(self.session.plan, self.draft)[k], d["submesh"],
                    d["logical_mesh"]):
                d["logical_mesh"] = best_view(self.session.plan, self.draft, k, d["submesh"])
        if logical_mesh is not None:
            d["logical_mesh"] = None if logical_mesh == AUTO else tuple(logical_mesh)
            d["edited"] = d["edited"] or d["logical_mesh"] is not None
        if remat is not None:
            d["remat"] = remat_value(remat)
        self._draw_rows()
        self.update_preview()

    def add_stage(self) -> None:
        """Split the draft's stage with the most layers at its middle; every submesh the user has not set in the
        draft becomes "auto" (the DP places the new stage around those the user set)."""
        L = len(self.session.plan.layer_names)
        ends = [d["first"] for d in self.draft[1:]] + [L]
        sizes = [e - d["first"] for d, e in zip(self.draft, ends)]
        k = max(range(len(sizes)), key=lambda i: sizes[i])
        if sizes[k] < 2:
            self.message.value = "every stage has one layer: no stage can be split"
            return
        mid = self.draft[k]["first"] + sizes[k] // 2
        self.draft.insert(k + 1, {"first": mid, "submesh": None, "logical_mesh": None, "remat": False,
                                  "edited": False})
        self._free_unedited()

    def remove_stage(self) -> None:
        """Merge the draft's last stage into the one before it; every submesh the user has not set becomes
        "auto"."""
        if len(self.draft) < 2:
            self.message.value = "the plan has one stage: there is none to merge"
            return
        self.draft.pop()
        self._free_unedited()

    def _free_unedited(self) -> None:
        for d in self.draft:
            if not d.get("edited"):
                d["submesh"] = d["logical_mesh"] = None
        self._draw_rows()
        self.update_preview()

    def reset(self) -> None:
        """The draft back to the current plan's stages."""
        self.draft = draft_of(self.session.plan)
        self._draw_rows()
        self.update_preview()

    def update_preview(self):
        """Price the draft (no plan change): the preview shows its step time and memory, or what is wrong."""
        plan = self.session.plan
        self._previewed = ([dict(d) for d in self.draft], plan)
        if _spec(self.draft) == _spec(draft_of(plan)):
            self.preview_plan, self.preview_error = plan, None
            self.preview.value = "<small>the draft is the current plan's stages</small>"
            self.apply_button.disabled = True
            return plan
        try:
            new = plan_from_draft(plan, self.draft)
        except USER_ERRORS as e:
            self.preview_plan, self.preview_error = None, str(e)
            self.preview.value = f"<span style='color:#B00020'>not valid: {html.escape(str(e))}</span>"
            self.apply_button.disabled = True
            return None
        self.preview_plan, self.preview_error = new, None
        if any(d["submesh"] is None for d in self.draft):
            # The DP chose the submeshes: the draft shows its choice, so the next edit starts from it.
            for d, st in zip(self.draft, new.stages):
                d["submesh"], d["logical_mesh"] = tuple(st.submesh), tuple(st.logical_mesh)
            self._previewed = ([dict(d) for d in self.draft], plan)
            self._draw_rows()
        peak, limit = max(new.cost.peak_mem_bytes), new.cost.mem_limit_bytes
        fits = "fits" if peak <= limit else "<span style='color:#B00020'>does not fit in memory</span>"
        self.preview.value = (
            f"preview: step time <b>{fmt_s(new.cost.step_time_s)}</b> "
            f"({fmt_delta_s(plan.cost.step_time_s, new.cost.step_time_s)} against now) · peak memory "
            f"{fmt_bytes(peak)} of "
            f"{fmt_bytes(limit)} ({fmt_pct(peak / limit)}), {fits}<br><small>"
            + "<br>".join(html.escape(b["label"]) for b in stage_blocks(new)) + "</small>")
        self.apply_button.disabled = False
        return new

    def apply(self) -> None:
        """Make the previewed draft the current plan (one undoable step)."""
        fresh = self._previewed == (self.draft, self.session.plan) and self.preview_plan is not None
        new = self.preview_plan if fresh else self.update_preview()
        if new is None or new is self.session.plan:
            return
        self.run("set_stages", lambda: self.session.adopt(new, action="set_stages"))

    def move_cut(self, cut: int, first_layer) -> None:
        """Move cut ``cut`` so that stage ``cut + 1`` starts at ``first_layer`` (an index or a layer name), now."""
        def go():
            return self.session.move_cut(int(cut), self._layer_index(first_layer))
        self.run("move_cut", go)

    def edit_run(self, microbatches=None, schedule=None, virtual_stages=None):
        """Change the run settings shown (the microbatch count, the schedule, its chunks per stage) and preview the
        plan they make; nothing applies until :meth:`apply_run`. Returns that plan (None when not valid)."""
        plan = self.session.plan
        mb = int(microbatches if microbatches is not None else self.microbatches.value or plan.microbatches)
        name = schedule if schedule is not None else self.schedule.value
        v = int(virtual_stages if virtual_stages is not None else self.virtual_stages.value)
        try:
            new, note = pending_plan(plan, mb, name, v if name == "interleaved" else None)
        except USER_ERRORS as e:
            self.run_plan, self.run_error = None, str(e)
            self.run_preview.value = f"<span style='color:#B00020'>not valid: {html.escape(str(e))}</span>"
        else:
            self.run_plan, self.run_error = new, None
            self.run_preview.value = run_preview_html(plan, new, note)
            mb = new.microbatches
        self._quiet = True
        try:  # the controls show what the preview priced: counts the schedule can run, the count it runs
            self.microbatches.options = microbatch_choices(plan, name) or [plan.microbatches]
            if mb in self.microbatches.options:
                self.microbatches.value = mb
            self.schedule.value = name
            self.virtual_stages.disabled = name != "interleaved"
        finally:
            self._quiet = False
        self.apply_run_button.disabled = self.run_plan is None or self.run_plan is plan
        self.cancel_run_button.disabled = self.run_plan is plan
        return self.run_plan

    def apply_run(self) -> None:
        """Make the previewed run settings' plan current (one undoable step)."""
        plan, new = self.session.plan, self.run_plan
        if new is None or new is plan:
            return
        action = "set_schedule" if (new.schedule, new.virtual_stages) != (plan.schedule, plan.virtual_stages) \
            else "set_microbatches"
        self.run(action, lambda: self.session.adopt(new, action=action))

    def set_microbatches(self, n: int) -> None:
        """Run ``n`` microbatches now (the dropdown previews first: :meth:`edit_run`)."""
        if n is not None and n != self.session.plan.microbatches:
            self.run("set_microbatches", lambda: self.session.set_microbatches(int(n)))

    def set_schedule(self, name: str, virtual_stages: int | None = None) -> None:
        """Run the plan with schedule ``name`` now; ``"interleaved"`` with ``virtual_stages`` chunks per stage (default:
        the box's value). The schedule buttons preview first (:meth:`edit_run`)."""
        plan = self.session.plan
        if name == "interleaved" and virtual_stages is None:
            virtual_stages = int(self.virtual_stages.value)
        if name != plan.schedule or (name == "interleaved" and virtual_stages != plan.virtual_stages):
            self.run("set_schedule", lambda: self.session.set_schedule(
                name, virtual_stages if name == "interleaved" else None))
        self._sync_controls()

    def set_remat(self, stage: int, on: bool | str) -> None:
        """Set remat of ``stage`` now: True (full), False (none) or "selective" (the editor's remat menus edit the
        draft instead)."""
        on = remat_value(on)
        if on != self.session.plan.stages[stage].remat:
            self.run("set_remat", lambda: self.session.set_remat(stage, on))

    def unpin_stages(self) -> None:
        if self.session.plan.stage_pins:
            self.run("unpin_stages", self.session.unpin_stages)

    # --- drawing ------------------------------------------------------------------------------------------------------
    def _layer_index(self, layer) -> int:
        names = list(self.session.plan.layer_names)
        if isinstance(layer, str):
            if layer not in names:
                raise ValueError(f"layer {layer!r} is not in this plan; layers are {names[0]}..{names[-1]}")
            return names.index(layer)
        return int(layer)

    def _views(self, submesh) -> list:
        return [] if submesh is None else [tuple(v) for v in self.session.cluster.logical_mesh_shapes(submesh)]

    def _draw_rows(self) -> None:
        """The editor's rows for the draft (widgets rebuilt only when the stage count changes)."""
        plan = self.session.plan
        names = list(plan.layer_names)
        subs = [tuple(s) for s in plan.cluster.submesh_shapes()]
        if len(self._row_widgets) != len(self.draft):
            self._row_widgets = [self._make_row(k) for k in range(len(self.draft))]
            head = [w.HTML(f"<b>{t}</b>") for t in ("", "first layer", "submesh", "as mesh", "remat")]
            self.rows_box.children = head + [x for r in self._row_widgets for x in
                                             (r["label"], r["first"], r["submesh"], r["logical"], r["remat"])]
        self._quiet = True
        try:
            for k, (d, r) in enumerate(zip(self.draft, self._row_widgets)):
                sel = k == self.stage
                r["label"].value = f"<b>S{k}</b>" if sel else f"S{k}"
                r["first"].options = [(names[0], 0)] if k == 0 else [(n, i) for i, n in enumerate(names) if i > 0]
                r["first"].value = d["first"]
                r["first"].disabled = k == 0
                r["submesh"].options = [(AUTO, AUTO)] + [(f"{a}x{b}", (a, b)) for a, b in subs]
                r["submesh"].value = AUTO if d["submesh"] is None else d["submesh"]
                views = self._views(d["submesh"])
                r["logical"].options = [(AUTO, AUTO)] + [(f"{a}x{b}", (a, b)) for a, b in views]
                r["logical"].value = AUTO if d["logical_mesh"] is None or d["logical_mesh"] not in views \
                    else d["logical_mesh"]
                r["remat"].value = remat_value(d["remat"])
        finally:
            self._quiet = False

    def _make_row(self, k: int) -> dict:
        lay = w.Layout(width="auto", min_width="0")
        r = {"label": w.HTML(f"S{k}"), "first": w.Dropdown(layout=lay), "submesh": w.Dropdown(layout=lay),
             "logical": w.Dropdown(layout=lay),
             "remat": w.Dropdown(options=[(remat_label(v), v) for v in REMAT_CHOICES], layout=lay)}

        def on(field):
            def cb(ch):
                if not self._quiet:
                    self.run("edit stages", lambda: self.edit_stage(k, **{field: ch["new"]}))
            return cb

        r["first"].observe(on("first"), names="value")
        r["submesh"].observe(on("submesh"), names="value")
        r["logical"].observe(on("logical_mesh"), names="value")
        r["remat"].observe(on("remat"), names="value")
        return r

    def _sync_controls(self) -> None:
        plan = self.session.plan
        self._quiet = True
        try:
            self.stage = min(self.stage, len(plan.stages) - 1)
            self.microbatches.options = microbatch_choices(plan) or [plan.microbatches]
            self.microbatches.value = plan.microbatches
            self.schedule.value = plan.schedule
            self.virtual_stages.disabled = plan.schedule != "interleaved"
            if plan.schedule == "interleaved":
                self.virtual_stages.value = plan.virtual_stages
        finally:
            self._quiet = False
        self.run_plan, self.run_error = plan, None
        self.run_preview.value = ""
        self.apply_run_button.disabled = self.cancel_run_button.disabled = True

    def refresh(self) -> None:
        """Redraw for the current plan; the draft starts again from its stages."""
        plan = self.session.plan
        self._sync_controls()
        self._draw_grid()
        pinned = ", ".join(sorted(plan.stage_pins)) or "none"
        self.summary.value = ("<small>" + "<br>".join(html.escape(b["label"]) for b in stage_blocks(plan))
                              + f"<br>{plan.microbatches} microbatch(es), {plan.schedule}; pinned: {pinned}</small>")
        self.unpin_button.disabled = not plan.stage_pins
        self.draft = draft_of(plan)
        self._draw_rows()
        self.update_preview()

    def _draw_grid(self) -> None:
        plan = self.session.plan
        c = plan.cluster
        fresh = figures.mesh_grid_figure(c.hosts, c.devices_per_host, stage_blocks(plan), self.stage,
                                         width=figures.SIDE_WIDTH, legend=False)  # the labels are listed below
        first = self.figure.data[0]
        sync_figure(self.figure, fresh, {"height": fresh.layout.height, "xaxis.range": fresh.layout.xaxis.range,
                                         "yaxis.range": fresh.layout.yaxis.range})
        if self.figure.data[0] is not first:  # traces were replaced (stages came or went): click handler again
            self.figure.data[0].on_click(self._plotly_click)

    def on_plan(self, event) -> None:
        self.refresh()

    def on_selection(self, event) -> None:
        sel = event.detail["selection"]
        if sel.stage is not None and sel.stage != self.stage:
            self.stage = sel.stage
            self._draw_grid()  # the outline moves; the draft being edited stays
            self._draw_rows()
