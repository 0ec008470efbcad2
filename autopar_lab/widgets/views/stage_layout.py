"""Stage-to-submesh layout: the cluster as a hosts x devices grid with the stages as coloured blocks; controls to give a
stage another submesh or logical mesh, move a stage cut, set the microbatch count, the schedule and remat.

    >>> stage_blocks(session.plan)[0]["label"]          # doctest: +SKIP
    'S0: layers 0-3 (embed..head) on 1x4 as 2x2'
"""

from __future__ import annotations

import ipywidgets as w

from . import figures
from ._base import View, sync_figure


def stage_blocks(plan) -> list[dict]:
    """One dict per stage for :func:`figures.mesh_grid_figure`: devices and a label (layers, submesh, logical mesh)."""
    names = plan.layer_names
    out = []
    for k, st in enumerate(plan.stages):
        a, b = st.layers
        remat = ", remat" if st.remat else ""
        out.append({"devices": list(st.devices),
                    "label": f"S{k}: layers {a}-{b} ({names[a]}..{names[b]}) on {st.submesh[0]}x{st.submesh[1]} "
                             f"as {st.logical_mesh[0]}x{st.logical_mesh[1]}{remat}"})
    return out


def microbatch_choices(plan) -> list[int]:
    """Every microbatch count the plan's batch allows (divisors of the batch size)."""
    batch = plan.table.batch_size if plan.table is not None else plan.microbatches
    return [d for d in range(1, batch + 1) if batch % d == 0]


class StageLayout(View):
    """The hosts x devices grid and the stage controls."""

    css = "autopar-stage-layout"

    def __init__(self, session):
        super().__init__(session)
        import plotly.graph_objects as go

        plan = session.plan
        c = plan.cluster
        self.stage = 0
        self.figure = go.FigureWidget(figures.mesh_grid_figure(c.hosts, c.devices_per_host, stage_blocks(plan), 0))
        self.figure.data[0].on_click(self._plotly_click)
        self.stage_pick = w.Dropdown(description="stage", layout=w.Layout(width="160px"))
        self.submesh = w.Dropdown(description="submesh", layout=w.Layout(width="180px"))
        self.logical = w.Dropdown(description="as mesh", layout=w.Layout(width="180px"))
        self.apply_mesh = w.Button(description="apply submesh")
        self.cut = w.Dropdown(description="cut", layout=w.Layout(width="160px"))
        self.cut_layer = w.BoundedIntText(description="starts at", min=1, max=max(len(plan.layer_names) - 1, 1),
                                          layout=w.Layout(width="160px"))
        self.apply_cut = w.Button(description="move cut")
        self.microbatches = w.Dropdown(description="microbatches", layout=w.Layout(width="220px"),
                                       style={"description_width": "initial"})
        self.schedule = w.ToggleButtons(options=["1f1b", "gpipe"], description="schedule",
                                        style={"button_width": "60px"})
        self.remat = w.Checkbox(description="rematerialise this stage")
        self.unpin_button = w.Button(description="unpin stage decisions",
                                     tooltip="let the next resolve change cuts, submeshes, microbatches, schedule")
        self.unpin_button.on_click(lambda _: self.unpin_stages())
        self._quiet = False
        self.stage_pick.observe(lambda ch: None if self._quiet else self.pick_stage(int(ch["new"])), names="value")
        self.submesh.observe(lambda ch: None if self._quiet else self._fill_logical(), names="value")
        self.apply_mesh.on_click(lambda _: self.apply_submesh())
        self.apply_cut.on_click(lambda _: self.move_cut())
        self.microbatches.observe(lambda ch: None if self._quiet else self.set_microbatches(ch["new"]), names="value")
        self.schedule.observe(lambda ch: None if self._quiet else self.set_schedule(ch["new"]), names="value")
        self.remat.observe(lambda ch: None if self._quiet else self.set_remat(ch["new"]), names="value")
        self.summary = w.HTML("")
        self.refresh()
        self._finish(w.VBox([self.figure, self.summary,
                             w.HBox([self.stage_pick, self.submesh, self.logical, self.apply_mesh]),
                             w.HBox([self.cut, self.cut_layer, self.apply_cut]),
                             w.HBox([self.microbatches, self.schedule, self.remat]), self.unpin_button,
                             self.message]))

    def _plotly_click(self, trace, points, state) -> None:
        if points.point_inds:
            k = trace.customdata[points.point_inds[0]][0]
            if k >= 0:
                self.on_click_stage(int(k))

    # --- actions -------------------------------------------------------------------------------------------------------
    def on_click_stage(self, k: int) -> None:
        """A device square was clicked: select its stage."""
        self.run("select", lambda: self.session.select(stage=k))

    def pick_stage(self, k: int) -> None:
        self.stage = k
        self.refresh()

    def apply_submesh(self, submesh=None, logical_mesh=None) -> None:
        """Give the picked stage the submesh and logical mesh in the dropdowns (or the arguments)."""
        sub = tuple(submesh) if submesh is not None else self.submesh.value
        lm = tuple(logical_mesh) if logical_mesh is not None else self.logical.value
        self.run("set_submesh", lambda: self.session.set_submesh(self.stage, sub, lm))

    def move_cut(self, cut: int | None = None, first_layer: int | None = None) -> None:
        c = self.cut.value if cut is None else cut
        f = self.cut_layer.value if first_layer is None else first_layer
        if c is None:
            self.message.value = "this plan has one stage: there is no cut to move"
            return
        self.run("move_cut", lambda: self.session.move_cut(int(c), int(f)))

    def set_microbatches(self, n: int) -> None:
        if n is not None and n != self.session.plan.microbatches:
            self.run("set_microbatches", lambda: self.session.set_microbatches(int(n)))

    def set_schedule(self, name: str) -> None:
        if name != self.session.plan.schedule:
            self.run("set_schedule", lambda: self.session.set_schedule(name))
            self._sync_controls()

    def set_remat(self, on: bool) -> None:
        if bool(on) != self.session.plan.stages[self.stage].remat:
            self.run("set_remat", lambda: self.session.set_remat(self.stage, bool(on)))
            self._sync_controls()

    def unpin_stages(self) -> None:
        if self.session.plan.stage_pins:
            self.run("unpin_stages", self.session.unpin_stages)

    # --- drawing -------------------------------------------------------------------------------------------------------
    def _fill_logical(self) -> None:
        sub = self.submesh.value
        if sub is None:
            return
        shapes = self.session.cluster.logical_mesh_shapes(sub)
        cur = tuple(self.session.plan.stages[self.stage].logical_mesh)
        self.logical.options = [(f"{a}x{b}", (a, b)) for a, b in shapes]
        self.logical.value = cur if cur in shapes else shapes[0]

    def _sync_controls(self) -> None:
        plan = self.session.plan
        self._quiet = True
        try:
            n = len(plan.stages)
            self.stage = min(self.stage, n - 1)
            self.stage_pick.options = [(f"S{k}", k) for k in range(n)]
            self.stage_pick.value = self.stage
            st = plan.stages[self.stage]
            subs = [tuple(s) for s in plan.cluster.submesh_shapes()]
            self.submesh.options = [(f"{a}x{b}", (a, b)) for a, b in subs]
            self.submesh.value = tuple(st.submesh)
            self._fill_logical()
            cuts = [s.layers[0] for s in plan.stages[1:]]
            self.cut.options = [(f"S{k}|S{k + 1}", k) for k in range(len(cuts))]
            self.cut.value = 0 if cuts else None
            if cuts:
                self.cut_layer.value = cuts[0]
            mbs = microbatch_choices(plan)
            self.microbatches.options = mbs
            self.microbatches.value = plan.microbatches
            self.schedule.value = plan.schedule
            self.remat.value = bool(st.remat)
        finally:
            self._quiet = False

    def refresh(self) -> None:
        plan = self.session.plan
        self._sync_controls()
        c = plan.cluster
        fresh = figures.mesh_grid_figure(c.hosts, c.devices_per_host, stage_blocks(plan), self.stage)
        first = self.figure.data[0]
        sync_figure(self.figure, fresh, {"height": fresh.layout.height, "xaxis.range": fresh.layout.xaxis.range,
                                         "yaxis.range": fresh.layout.yaxis.range})
        if self.figure.data[0] is not first:  # traces were replaced (stages came or went): click handler again
            self.figure.data[0].on_click(self._plotly_click)
        pinned = ", ".join(sorted(plan.stage_pins)) or "none"
        self.summary.value = "<br>".join(b["label"] for b in stage_blocks(plan)) + \
            f"<br>{plan.microbatches} microbatch(es), {plan.schedule}; pinned: {pinned}"
        self.unpin_button.disabled = not plan.stage_pins

    def on_plan(self, event) -> None:
        self.refresh()

    def on_selection(self, event) -> None:
        sel = event.detail["selection"]
        if sel.stage is not None and sel.stage != self.stage:
            self.stage = sel.stage
            self.refresh()
