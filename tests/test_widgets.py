"""The workbench's views, headless: simulated clicks and dropdown changes update the plan and every linked view."""

import dataclasses
import re

import pytest

import autopar_lab as al
from autopar_lab.memory import PARTS, memory_breakdown
from autopar_lab.sharding.reshard import reshard_cost
from autopar_lab.widgets.views import figures
from autopar_lab.widgets.views.cost_panel import breakdown_html, cost_terms, roofline
from autopar_lab.widgets.views.graph import graph_data, layer_groups, layer_summary
from autopar_lab.widgets.views.graph_canvas import STATIC, GraphCanvas
from autopar_lab.widgets.views.sharding_table import op_rows, row_label
from autopar_lab.widgets.views.timeline import timeline_data, window_end
from autopar_lab.widgets.views.fmt import fmt_s
from autopar_lab.widgets.workbench import COLUMN_PX, STYLE, Workbench

CSS = ("autopar-header", "autopar-graph", "autopar-sharding-table", "autopar-stage-layout", "autopar-cost-panel",
       "autopar-timeline", "autopar-controls", "autopar-training")


@pytest.fixture(scope="module")
def graph():
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2, dtype="float32").trace()


@pytest.fixture(scope="module")
def plan(graph):
    cluster = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=4)
    return al.megatron_plan(graph, cluster, dp=1, tp=2, pp=2, microbatches=2, sharding="ilp")  # the ILP's choices


@pytest.fixture(scope="module")
def small_plan(graph):
    c2 = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=2)
    return al.megatron_plan(graph, c2, dp=1, tp=2, pp=1, sharding="ilp")  # the ILP's own choices


@pytest.fixture(scope="module")
def deep(deep_gpt24_megatron):
    """24 layers (the depth of GPT-1.3B) on 2 hosts of 4 devices, two stages of one host each (conftest's, shared
    with tests/test_workbench_fixes.py)."""
    return deep_gpt24_megatron


@pytest.fixture
def wb(graph, plan):
    return Workbench(graph, plan.cluster, plan=plan)


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


def _dot(wb, layer="layer_0"):
    g = wb.session.graph
    return [o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).layer == layer][0]


def _ms(seconds):
    return fmt_s(seconds)  # the views' one number format (a step of the tiny test model is about 1 ms)


def test_every_view_is_findable_by_its_css_class(wb):
    found = {c for w in _walk(wb.widget) for c in getattr(w, "_dom_classes", ())}
    assert set(CSS) <= found and {"autopar-step-time", "autopar-toolbar", "autopar-grid"} <= found
    steps = [w for w in _walk(wb.widget) if "autopar-step-time" in getattr(w, "_dom_classes", ())]
    assert len(steps) == 1 and steps[0] is wb.header.step_time and "step time" in steps[0].value
    assert _ms(wb.plan.cost.step_time_s) in steps[0].value
    # The header is the dashboard's top: the plan, its memory and pins, and the undo / redo buttons.
    assert wb.widget.children[1] is wb.header.widget
    assert wb.controls.undo_button in list(_walk(wb.header.widget))
    assert "2 stages on 4 devices" in wb.header.plan_line.value and "0 operator pins" in wb.header.pins.value
    assert "of 16 GiB" in wb.header.memory.value


def test_views_sit_in_a_grid_that_fits_the_width(wb):
    grid = wb.grid
    assert "minmax(min(100%" in grid.layout.grid_template_columns and grid.layout.width == "100%"
    assert [c for c in grid.children] == [wb.graph.widget, wb.column, wb.cost.widget, wb.timeline.widget,
                                          wb.training.widget]
    assert list(wb.column.children) == [wb.table.widget, wb.layout.widget]  # one column: no gap under the table
    for wide in (wb.graph, wb.timeline, wb.training):
        assert "autopar-wide" in wide.widget._dom_classes  # across every column
    assert ".autopar-grid > .autopar-wide { grid-column: 1 / -1; }" in STYLE
    # Side figures are narrower than a grid column, so nothing in a column scrolls sideways.
    for fig in (wb.cost.cost_fig, wb.cost.mem_fig, wb.layout.figure):
        assert fig.layout.width is not None and fig.layout.width <= COLUMN_PX - 10
    # Full-width figures take the width the graph reports from the browser.
    wb.graph.canvas.handle_message(None, {"type": "width", "px": 1234})
    assert wb.timeline.figure.layout.width == 1226 and wb.training.loss_fig.layout.width == 1226


def test_every_figure_reaches_the_browser_whole_in_its_first_message(graph, plan, monkeypatch):
    """A figure's browser view draws what its comm opened with: plotly's FigureWidget opens empty and sends its
    traces and layout after, and a view drawn in between stays an empty 700-px plot (a CI failure). The side
    column's figures, built whole, must open with their width and their traces."""
    import comm

    opened = []
    real = comm.create_comm

    def record(**kw):
        opened.append(kw["data"]["state"])
        return real(**kw)

    monkeypatch.setattr(comm, "create_comm", record)
    wb = Workbench(graph, plan.cluster, plan=plan)
    figures_opened = [s for s in opened if "_widget_layout" in s]
    side = (wb.cost.cost_fig, wb.cost.mem_fig, wb.layout.figure)
    assert len(figures_opened) >= len(side)
    for fig in side:
        state = next(s for s in figures_opened if s["_widget_layout"].get("width") == fig.layout.width
                     and len(s["_widget_data"]) == len(fig.data))
        assert state["_widget_data"] and state["_widget_layout"]["width"] <= COLUMN_PX - 10
    # The timeline (full width) opens with its bars and its title, not empty.
    title = wb.timeline.figure.layout.title.text
    assert any(s["_widget_layout"].get("title", {}).get("text") == title
               and len(s["_widget_data"]) == len(wb.timeline.figure.data) > 0 for s in figures_opened)


def test_dropdown_change_overrides_and_updates_table_and_cost_panel(wb, plan):
    op = _dot(wb)
    wb.table.rows_select.value = op  # a click on the row
    assert wb.session.selection.op == op and wb.table.op == op
    opts = wb.table.alternatives.options
    assert wb.table.alternatives.value == plan.choice(op).name and len(opts) >= 2
    worst = opts[-1][1]
    before_text = wb.header.step_time.value
    wb.table.alternatives.value = worst  # the dropdown change
    new = wb.plan
    assert new is not plan and new.choice(op).name == worst and new.pins == {op: (worst, "shared")}
    row = wb.table.row(op)
    assert row["strategy"] == worst and row["pinned"]
    assert row["alpa"] == str(new.choice(op).out_specs[0])
    text = wb.header.step_time.value
    assert text != before_text and f"was {_ms(plan.cost.step_time_s)}" in text and _ms(new.cost.step_time_s) in text
    assert "before" in wb.cost.breakdown.value and "1 operator pin" in wb.header.pins.value
    # The cost figure shows before and now; each bar's terms add up to that plan's step time.
    for k, p in enumerate((plan, new)):
        total = sum(tr.x[k] for tr in wb.cost.cost_fig.data)
        assert total == pytest.approx(p.cost.step_time_s, rel=1e-12)
    # Undo by its button restores the plan and the step time.
    wb.controls.undo_button.click()
    assert wb.plan is plan and wb.table.row(op)["strategy"] == plan.choice(op).name
    assert _ms(plan.cost.step_time_s) in wb.header.step_time.value
    wb.controls.redo_button.click()
    assert wb.plan is new


def test_after_undo_was_is_the_plan_just_left(wb, plan):
    # Issue 12, item 5: after undo, "was" showed the plan two steps back (the history's previous entry).
    s = wb.session
    op = _dot(wb)
    by_delta = {}
    for a in reversed(s.alternatives(op)):  # the worst first; alternatives that tie price the same plan
        by_delta.setdefault(a.delta_s, a)
    worst, other = [a for d, a in by_delta.items() if d != 0][:2]
    b = s.set_choice(op, worst.strategy)
    c = s.set_choice(op, other.strategy)
    assert len({plan.cost.step_time_s, b.cost.step_time_s, c.cost.step_time_s}) == 3
    wb.controls.undo()
    assert wb.plan is b
    for text in (wb.header.step_time.value, wb.cost.breakdown.value):
        assert f"was {_ms(c.cost.step_time_s)}" in text or _ms(c.cost.step_time_s) in text
    assert f"was {_ms(c.cost.step_time_s)}" in wb.header.step_time.value
    assert f"was {_ms(plan.cost.step_time_s)}" not in wb.header.step_time.value
    total = sum(tr.x[0] for tr in wb.cost.cost_fig.data)  # the "before" bar is the undone plan
    assert total == pytest.approx(c.cost.step_time_s, rel=1e-12)


def test_pin_unpin_buttons(wb, plan):
    op = _dot(wb)
    wb.table.select(op)
    wb.table.pin_button.click()
    assert wb.plan.pins == {op: (plan.choice(op).name, "shared")} and wb.table.row(op)["pinned"]
    assert not wb.controls.resolve_button.disabled
    wb.table.unpin_button.click()
    assert wb.plan.pins == {} and not wb.table.row(op)["pinned"]


# --- the operator graph -------------------------------------------------------------------------------------------

def test_graph_clicks_expand_and_select(wb):
    g = wb.graph
    n_overview = len(g.data["overview"])
    assert len(layer_summary(wb.session.graph)[0]) == n_overview  # 2 layers on 2 stages: nothing to group
    g.on_click("L:layer_1")
    assert g.expanded == "layer_1" and wb.session.selection.layer == "layer_1"
    graph = wb.session.graph
    ops = [o for o in graph.ops_in_layer("layer_1") if graph.op(o).primitive not in ("parameter", "output")]
    assert len(g.keys) == n_overview + len(ops)  # the step's inputs and outputs are folded into their neighbours
    folded = [n["hover"] for n in g.data["detail"]["nodes"] if "reads param" in n["hover"]]
    assert folded and "folded into their readers" in g.data["detail"]["title"]
    # Every operator is named in its box: a matmul by its module (the layer's landmarks), the others by primitive.
    labels = {n["key"]: n["label"] for n in g.data["detail"]["nodes"]}
    matmuls = [o for o in ops if graph.op(o).primitive == "dot_general"]
    assert all(labels[f"O:{o}"] == graph.op(o).primitive for o in ops if o not in matmuls)
    assert sorted(labels[f"O:{o}"] for o in matmuls if graph.op(o).role == "forward") == sorted(
        ["qkv", "attn/scores", "attn/context", "proj", "fc1", "fc2"])
    assert {"fc1 (weight grad)", "fc1 (data grad)", "qkv (weight grad)"} <= set(labels.values())
    hover = next(n["hover"] for n in g.data["detail"]["nodes"] if n["label"] == "fc1")
    assert "module: fc1" in hover and "['layers'][1]['fc1']['w']" in hover and "FLOP" in hover
    op = _dot(wb, "layer_1")
    g.canvas.handle_message(None, {"type": "click", "key": f"O:{op}"})  # what the browser sends on a click
    assert wb.session.selection.op == op and wb.session.selection.stage == 1
    assert wb.table.op == op and f"#{op}" in wb.table.detail.value  # the table follows the graph
    assert wb.layout.stage == 1  # and so does the stage layout
    selected = [n for n in g.data["detail"]["nodes"] if n["selected"]]
    assert [n["key"] for n in selected] == [f"O:{op}"]
    g.on_click("L:layer_1")
    assert g.expanded is None and len(g.keys) == n_overview and g.data["detail"] is None


def test_graph_colours_have_legends(wb):
    layers, ops, stats, _ = layer_summary(wb.session.graph)
    assert sum(len(v) for v in ops.values()) == len(wb.session.graph.ops)
    assert sum(s[0] for s in stats.values()) == pytest.approx(wb.session.graph.total_flops)
    by_stage = graph_data(wb.session, "layer_0", "stage")
    by_spec = graph_data(wb.session, "layer_0", "sharding")
    op_cols = lambda d: {n["colour"] for n in d["detail"]["nodes"]}  # noqa: E731
    assert len(op_cols(by_stage)) == 1 and len(op_cols(by_spec)) > 1
    layer_cols = {n["key"]: n["colour"] for n in by_stage["overview"]}
    assert layer_cols["L:embed"] != layer_cols["L:head"]  # two stages, two colours
    # Every colouring has a legend that names every colour drawn.
    stage_legend = {i["colour"] for i in by_stage["legends"][0]["items"]}
    assert set(layer_cols.values()) <= stage_legend and by_stage["legends"][0]["title"] == "colour: stage"
    spec_legend = next(lg for lg in by_spec["legends"] if lg["title"] == "operators: output sharding")
    assert op_cols(by_spec) <= {i["colour"] for i in spec_legend["items"]} | {"#9e9e9e"}
    assert any(lg["title"] == "edges" for lg in by_stage["legends"])
    wb.graph.mode_buttons.value = "sharding"
    assert wb.graph.mode == "sharding" and wb.graph.canvas.data["legends"][0]["title"].startswith("layers")
    with pytest.raises(ValueError, match="colour mode"):
        graph_data(wb.session, None, "rainbow")


def test_resharded_edges_carry_their_collective_and_bytes(small_plan, graph):
    s = al.Session(small_plan)
    g = s.graph
    # Override the first forward matmul of layer_0 to its dearest strategy: its neighbours must be resharded.
    op = [o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).layer == "layer_0"][0]
    s.set_choice(op, s.alternatives(op)[-1].strategy)
    data = graph_data(s, "layer_0", "sharding")
    hot = [e for e in data["detail"]["edges"] if e["resharded"]]
    assert hot and data["summary"]["resharded"] == len(hot)
    mesh = s.cluster.logical_mesh(s.plan.stages[0].submesh, s.plan.stages[0].logical_mesh)
    for e in hot:
        p, o = int(e["source"][2:]), int(e["target"][2:])
        t = next(t for t in g.op(o).inputs if g.tensor(t).producer == p)
        j = g.op(o).inputs.index(t)
        src = s.plan.choice(p).out_specs[g.op(p).outputs.index(t)]
        dst = s.plan.choice(o).in_specs[j]
        cost, cols = reshard_cost(src, dst, g.tensor(t).shape, g.tensor(t).dtype, mesh)
        assert src != dst and e["cost_s"] == cost
        assert f"{src} → {dst}" in e["hover"]
        for kind, _axis, _nbytes in cols:
            assert kind.replace("_", "-") in e["hover"]
        assert re.search(r"\d (B|KiB|MiB|GiB)", e["hover"])


def test_deep_model_groups_repeated_layers(deep):
    model, plan = deep
    wb = Workbench(model, plan.cluster, plan=plan)
    groups = layer_groups(wb.session)
    sizes = [(len(g["layers"]), g["stage"]) for g in groups]
    assert (12, 0) in sizes and (12, 1) in sizes  # layer_0..11 on stage 0, layer_12..23 on stage 1
    over = wb.graph.data["overview"]
    labels = [n["label"] for n in over]
    assert "layer_0..layer_11" in labels and "layer_12..layer_23" in labels and "outside layers" in labels
    assert len(over) < 8 and all(n["count"] == 12 for n in over if ".." in n["label"])
    wb.graph.on_click("G:layer_0")  # open the group: its 12 layers one by one
    assert [n["label"] for n in wb.graph.data["overview"]].count("layer_5") == 1
    wb.graph.on_click("L:layer_5")
    detail = wb.graph.data["detail"]
    graph = wb.session.graph
    n = len([o for o in graph.ops_in_layer("layer_5") if graph.op(o).primitive not in ("parameter", "output")])
    assert n > 400 and len(detail["nodes"]) == n and "layer_5" in detail["title"]
    # Forward-to-backward edges do not shape the layout; every edge drawn is laid out or resharded.
    assert all(e.get("layout", True) or e["resharded"] for e in detail["edges"])
    assert wb.graph.data["summary"]["hidden_edges"] > 0
    wb.graph.on_click("G:layer_0")
    assert "layer_0..layer_11" in [n["label"] for n in wb.graph.data["overview"]]


# --- a deep model: real layers, the groups that share a solution, overrides that act ----------------------------

def _real_dot(plan, layer, n=0):
    g = plan.graph
    return [o for o in g.ops_in_layer(layer) if g.op(o).primitive == "dot_general"][n]


def test_deep_table_shows_real_layers_and_the_groups_that_share_a_solution(deep):
    model, plan = deep
    wb = Workbench(model, plan.cluster, plan=plan)
    t = wb.table
    labels = [label for label, _ in t._layer_options]
    group = "layer_0..23 (×24, one solution; S0: layer_0..11, S1: layer_12..23)"
    assert labels[:4] == ["(all)", "embed", group, "head"]
    assert [f"layer_{i}" for i in range(24)] == labels[4:28]  # each real layer, to see or change it alone
    copy_only = {"layer_1", "layer_2", "layer_3"}  # names of the copy's blocks: never a row's layer on their own
    assert not any(r["layer"] in copy_only for r in t.rows)
    blocks = [r for r in t.rows if r["layer"] == "layer_0..23 ×24"]
    assert blocks and all(r["stage_text"] == "S0+S1" and r["stages"] == [0, 1] for r in blocks)
    assert "S0+S1" in row_label(blocks[0]) and "×24" in row_label(blocks[0])
    # A real layer of stage 1 lists its own operators, on stage 1.
    t.set_filters(layer="layer_13", primitive="dot_general")
    full = _real_dot(plan, "layer_13")
    assert t.rows[0]["key"] == t.rows[0]["op"] == full and t.rows[0]["alone"]
    assert all(r["stage"] == 1 and r["stage_text"] == "S1" and r["layer"] == "layer_13" for r in t.rows)
    assert f"#{full}" in row_label(t.rows[0])


def test_a_click_on_a_deep_layer_lands_on_that_layer_on_its_stage(deep):
    # Issue 12, item 2: clicking the real layer_3 landed on the copy's stand-in, whose alternatives all read "+0 s",
    # and the row said stage S0 while the detail said stage 1.
    model, plan = deep
    wb = Workbench(model, plan.cluster, plan=plan)
    full = _real_dot(plan, "layer_13")
    wb.graph.on_click("L:layer_13")
    wb.graph.canvas.handle_message(None, {"type": "click", "key": f"O:{full}"})
    sel = wb.session.selection
    assert (sel.op, sel.layer, sel.stage) == (full, "layer_13", 1)  # the operator clicked, no stand-in
    t = wb.table
    assert t.key == full and t.alone and t.layer_filter.value == "layer_13"
    assert t.row(t.key)["stage_text"] == "S1" and "stage 1's 1x4 mesh" in t.detail.value
    assert "layer_13" in t.detail.value and "one of 24 layers sharing one solution" in t.detail.value
    assert t.scope.layout.display is None and t.scope.value == "shared"
    deltas = [label for label, _ in t.alternatives.options if "no change" not in label]
    assert len(deltas) >= 2 and all("µs" in d or "ms" in d for d in deltas)
    assert wb.graph.expanded == "layer_13" and wb.graph.selected_key == f"O:{full}"
    assert wb.layout.stage == 1


def test_a_deep_override_moves_the_header_by_the_predicted_delta_and_refreshes_the_rows(deep):
    model, plan = deep
    wb = Workbench(model, plan.cluster, plan=plan)
    t, s = wb.table, wb.session
    full = _real_dot(plan, "layer_13")
    s.select(op=full)
    # Every layer sharing the solution (the default): both stages re-priced.
    alts = t._alts
    worst = alts[-1]
    t.alternatives.value = worst.strategy
    group = wb.plan
    assert group.cost.step_time_s - plan.cost.step_time_s == worst.delta_s > 0
    assert _ms(group.cost.step_time_s) in wb.header.step_time.value and "1 operator pin" in wb.header.pins.value
    row = t.row(full)
    assert row["strategy"] == worst.strategy and row["pinned"] and row["alpa"] == str(group.choice(full).out_specs[0])
    other = _real_dot(plan, "layer_2")
    assert group.choice(other).name == worst.strategy  # a block on stage 0 too
    # This layer alone: split from the group, re-priced, the others unchanged.
    t.scope.value = "layer"
    layer_alts = t._alts
    pick = next(a for a in layer_alts if a.strategy != worst.strategy and a.delta_s != 0)
    t.alternatives.value = pick.strategy
    split = wb.plan
    assert split.pins[full] == (pick.strategy, "layer") and s.last_action == "set_choice"
    assert split.cost.step_time_s - group.cost.step_time_s == pick.delta_s
    assert _ms(split.cost.step_time_s) in wb.header.step_time.value
    assert split.choice(other).name == worst.strategy
    assert t.row(full)["strategy"] == pick.strategy  # the row shows the new spec at once
    assert "layer_13 (split from its group)" in [label for label, _ in t._layer_options]
    assert t.scope.value == "layer" and "pinned in its layer" in t.detail.value
    # The graph draws the split layer on its own, its operator pinned with the new strategy.
    labels = [n["label"] for n in wb.graph.data["overview"]]
    assert "layer_13" in labels and "layer_14..layer_23" in labels
    node = next(n for n in wb.graph.data["detail"]["nodes"] if n["key"] == f"O:{full}")
    assert node["pinned"] and "stage 1's 1x4 mesh" in node["hover"]
    t.unpin_button.click()
    assert wb.plan.pins == group.pins and wb.plan.cost.step_time_s == group.cost.step_time_s
    wb.controls.undo()
    wb.controls.undo()
    wb.controls.undo()
    assert wb.plan is plan and t.row(full)["strategy"] == plan.choice(full).name


def test_graph_front_end_is_built():
    # The committed bundle is what the widget loads (a fresh clone works without npm).
    js = (STATIC / "graph.js").read_text()
    assert len(js) > 10_000 and "render" in js and (STATIC / "graph.css").exists()
    assert GraphCanvas(height=300).height == 300


# --- stages --------------------------------------------------------------------------------------------------------

def test_stage_layout_controls(wb, plan):
    lay = wb.layout
    lay.microbatches.value = 4  # dropdown: a preview, applied on confirm
    assert wb.plan.microbatches == 2 and "→ <b>1f1b, 4 microbatches</b>" in lay.run_preview.value
    lay.apply_run_button.click()
    assert wb.plan.microbatches == 4
    rows, makespan, cut = timeline_data(wb.plan)
    sends = 2 * 4 if wb.plan.cost.stage_comm_s > 0 else 0  # one cut: an activation and a gradient per microbatch
    assert len(rows) == 2 * 2 * 4 + sends and cut == 0
    n_bars = sum(len(tr.x) for tr in wb.timeline.figure.data if tr.name in ("fwd", "bwd"))
    assert n_bars == 2 * 2 * 4  # fwd and bwd of every microbatch on both stages
    assert "4 microbatch" in wb.timeline.figure.layout.title.text
    lay.on_click_stage(1)
    assert wb.session.selection.stage == 1 and lay.stage == 1 and "<b>S1</b>" in lay._row_widgets[1]["label"].value
    lay.schedule.value = "gpipe"
    lay.apply_run()
    assert wb.plan.schedule == "gpipe" and wb.timeline.figure.layout.title.text.startswith("gpipe")
    # The editor: stage 1's logical mesh and remat in the draft, previewed, applied in one step.
    row = lay._row_widgets[1]
    row["logical"].value = (2, 1)
    row["remat"].value = True
    assert wb.plan.stages[1].logical_mesh == (1, 2)  # nothing applied yet
    assert "preview: step time" in lay.preview.value and not lay.apply_button.disabled
    before = wb.plan
    lay.apply_button.click()
    assert wb.plan.stages[1].logical_mesh == (2, 1) and wb.plan.stages[1].remat
    assert wb.plan is lay.preview_plan and wb.session.last_action == "set_stages"
    wb.controls.undo()
    assert wb.plan is before
    # Cuts by layer name: stage 1 starts at layer_1 (index 2); "layer_1" means layer_1, not the 2nd layer.
    lay.move_cut(0, "head")
    assert [st.layers for st in wb.plan.stages] == [(0, 2), (3, 3)]
    # A bad move is reported, and nothing changes.
    current = wb.plan
    lay.move_cut(0, 0)
    assert wb.plan is current and "cut 0 can move" in lay.message.value and "move_cut" in wb.status.value
    lay.unpin_button.click()
    assert wb.plan.stage_pins == {}
    # The error is gone once the plan changed (issue 12, item 4: it stayed after undo, re-plan and adopt).
    assert lay.message.value == "" and "move_cut" not in wb.status.value


def test_interleaved_schedule_with_its_chunks_from_the_stage_layout(wb):
    lay, plan = wb.layout, wb.plan
    assert lay.virtual_stages.disabled  # only the interleaved schedule has chunks
    lay.schedule.value = "interleaved"
    assert not lay.virtual_stages.disabled and wb.plan is plan  # previewed, not applied
    lay.apply_run()
    assert wb.plan.schedule == "interleaved" and wb.plan.virtual_stages == 2
    assert wb.plan.cost.step_time_s == plan.with_schedule("interleaved", 2).cost.step_time_s
    # more chunks than a stage has layers: one clear reason in the preview, nothing to apply, the plan kept
    current = wb.plan
    lay.virtual_stages.value = 5
    assert wb.plan is current and "not valid" in lay.run_preview.value and lay.apply_run_button.disabled
    lay.apply_run()
    assert wb.plan is current
    wb.controls.undo()
    assert wb.plan is plan and lay.virtual_stages.disabled


def test_editing_every_stage_together_crosses_what_one_at_a_time_cannot(deep):
    model, plan = deep  # S0 on host 0 (1x4), S1 on host 1 (1x4)
    wb = Workbench(model, plan.cluster, plan=plan)
    s, lay = wb.session, wb.layout
    assert [st.submesh for st in plan.stages] == [(1, 4), (1, 4)]
    with pytest.raises(ValueError, match="does not fit at device 2|use 6 devices"):
        s.set_submesh(0, (1, 2))  # alone, the other stage no longer tiles the cluster
    lay.add_stage()  # three stages; the DP picks every submesh for the new cuts
    assert len(lay.draft) == 3 and lay.preview_plan is not None, lay.preview.value
    subs = [st.submesh for st in lay.preview_plan.stages]
    assert sum(a * b for a, b in subs) == 8
    # Now any tiling can be typed in, stage by stage, each edit previewed; cuts by layer name.
    lay.edit_stage(0, submesh=(1, 2))
    lay.edit_stage(1, submesh=(1, 2), first="layer_8")
    lay.edit_stage(2, submesh=(1, 4), logical_mesh=(2, 2), first="layer_16")
    assert "not valid" not in lay.preview.value, lay.preview.value
    p = lay.preview_plan
    assert [st.submesh for st in p.stages] == [(1, 2), (1, 2), (1, 4)] and p.stages[2].logical_mesh == (2, 2)
    names = p.layer_names
    assert [names[st.layers[0]] for st in p.stages] == ["embed", "layer_8", "layer_16"]
    lay.apply()
    assert wb.plan is p and wb.session.last_action == "set_stages"
    # A draft that cannot tile says why in the preview, and apply does nothing.
    lay.edit_stage(0, submesh=(1, 4))
    assert "not valid" in lay.preview.value and lay.apply_button.disabled
    wb.controls.undo()  # the plan changes: the draft starts again from it, the error is gone
    assert wb.plan is plan and "not valid" not in lay.preview.value and len(lay.draft) == 2


# --- controls ------------------------------------------------------------------------------------------------------

def test_controls_save_load_export_and_background_solve(wb, plan, tmp_path):
    c = wb.controls
    path = str(tmp_path / "wb.json")
    op = _dot(wb)
    wb.table.select(op)
    wb.table.choose(wb.table.alternatives.options[-1][1])
    changed = wb.plan
    c.path.value = path
    c.save_button.click()
    c.undo_button.click()
    c.load_button.click()
    assert wb.plan.cost.step_time_s == changed.cost.step_time_s and wb.session.last_action == "load"
    c.load(str(tmp_path / "missing.json"))
    assert "cannot read" in c.message.value and wb.session.last_action == "load"
    code = c.export()
    assert "PartitionSpec" in code and c.code.value == code
    # Unpinned, the overridden operator goes back to the ILP's choice in an intra solve on a worker thread.
    wb.table.unpin_button.click()
    assert c.message.value == ""  # the plan changed: the load error went
    t = c.start_solve("intra")
    assert t is not None
    c.wait(120)
    assert not c.busy and c.progress.description == "done" and c.progress.value == 1.0
    assert c.status.value.startswith("intra solve done in")  # not the last progress report
    assert wb.session.last_action == "solve_intra" and wb.plan.pins == {}
    assert wb.plan.choice(op).name == plan.choice(op).name and wb.table.row(op)["strategy"] == plan.choice(op).name
    assert _ms(plan.cost.step_time_s) in wb.header.step_time.value
    assert not c.undo_button.disabled and c.cancel_button.disabled
    assert c.code.value == wb.plan.to_jax_code()  # the code box follows the plan


def test_cancel_a_full_solve(wb, plan):
    c = wb.controls
    assert c.cancel_button.disabled and c.cancel_button.button_style == ""  # idle: not coloured as if it could act
    c.start_solve("full")
    assert c.cancel_button.button_style == "warning" or not c.busy
    c.cancel()
    c.wait(120)
    assert c.progress.description == "cancelled" and wb.plan is plan and not wb.session.can_undo
    assert "cancelled" in c.status.value and c.cancel_button.button_style == ""


def test_compare_and_adopt(small_plan, graph):
    wb = Workbench(graph, small_plan.cluster, plan=small_plan)
    c = wb.controls
    assert c.compare_panel.layout.display == "none"
    c.adopt(None)
    assert "compare baselines first" in c.message.value
    c.compare_button.click()  # on a worker thread
    c.wait(120)
    html = c.comparison.value
    assert "megatron" in html and "data_parallel" in html and "optimum" in html
    assert set(c.adopt_pick.options) == {"megatron", "data_parallel", "optimum"}
    # Issue 12, item 5: the dropdown was blank and "make current" said "run compare first".
    assert c.adopt_pick.value == "megatron" and c.compare_panel.layout.display is None
    c.export()
    old_code = c.code.value
    c.adopt_pick.value = "optimum"
    c.adopt_button.click()
    optimum = wb.session.comparison["optimum"]
    assert wb.plan is optimum and wb.session.last_action == "adopt_optimum"
    assert "before" in wb.cost.breakdown.value and "optimum" in wb.header.history.value
    # The table and the code describe the adopted plan, not the one before it.
    assert "optimum (current)" in c.comparison.value
    assert f"<td>current</td><td>{fmt_s(optimum.cost.step_time_s)}</td><td>1.00×</td>" in c.comparison.value
    assert c.code.value == optimum.to_jax_code() and (c.code.value != old_code or small_plan.to_jax_code() == old_code)


def test_what_if_sliders_replan(small_plan, graph):
    wb = Workbench(graph, small_plan.cluster, plan=small_plan)
    c = wb.controls
    assert c.whatif_panel.layout.display == "none"
    c.whatif_toggle.value = True
    assert c.whatif_panel.layout.display is None
    c.devices.value = 1
    assert wb.plan is small_plan  # a slider alone does not re-plan unless asked to
    c.what_if(background=False)
    assert wb.plan.cluster.num_devices == 1 and wb.layout.figure.data[0].x == (0,)
    assert c.devices.value == 1 and c.progress.description == "done"


def test_what_if_on_a_deep_model_reuses_the_table_shows_progress_and_plans_as_a_fresh_one(deep):
    """24 layers on 2 hosts of 4: the sliders moved to a 10x slower link between hosts and the re-plan run from the
    workbench. The one-host meshes' ILPs are not run again (the progress says how many were kept), the bar only
    moves forward and ends full, and the plan is the one a fresh auto_plan makes of that cluster, to the bit."""
    from autopar_lab.widgets.views.controls import hosts_max

    model, megatron = deep
    plan = al.auto_plan(model, megatron.cluster)  # every mesh priced, as after a full solve
    wb = Workbench(model, plan.cluster, plan=plan)
    c = wb.controls
    assert c.hosts.max == hosts_max(2) == 8 and hosts_max(64) == 128  # 512 GPUs: the slider reaches 1,024
    c.inter_bw.value = c.inter_bw.value / 10
    seen = []
    values = []
    wb.session.subscribe(lambda e: seen.append(e.detail.get("message")) if e.name == "progress" else None)
    c.progress.observe(lambda ch: values.append(ch["new"]), names="value")
    c.what_if(background=False)
    new = plan.cluster.with_(inter_host_bandwidth=plan.cluster.inter_host.bandwidth / 10)
    assert wb.plan.cluster == new and c.progress.description == "done" and c.progress.value == 1.0
    kept = next(m for m in seen if m and m.startswith("re-plan on 2x4"))
    one_host = [k for k in wb.plan.table.planned_meshes() if k[0][0] == 1]
    assert f"{len(one_host)} of {len(wb.plan.table.planned_meshes())} meshes kept" in kept
    solved = [m for m in seen if m and m.startswith("intra-op")]
    assert solved and not any(m.startswith("intra-op 1x") for m in solved)  # only meshes that cross hosts
    assert any(m.startswith("stage DP") for m in seen)
    assert values == sorted(values) and "what-if re-plan done" in c.status.value
    fresh = al.auto_plan(model, new)
    assert wb.plan.cost.to_dict() == fresh.cost.to_dict()
    assert [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in wb.plan.stages] == \
        [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in fresh.stages]
    # The hosts slider grows with the cluster: at 5 hosts it reaches 10.
    wb.session.set_cluster(hosts=5)
    assert c.hosts.value == 5 and c.hosts.max == 10


def test_labels_are_whole(wb):
    # Issue 12, item 5: "re-plan on this cl...", "unpin stage decis..." were cut off by fixed-width buttons.
    for view in wb.views.values():
        for x in _walk(view.widget):
            if type(x).__name__ in ("Button", "ToggleButton"):
                assert x.layout.width == "auto", f"button {x.description!r} has a fixed width"
    assert "(no layer)" not in str([n["label"] for n in wb.graph.data["overview"]])
    row = {"op": 7, "primitive": "dynamic_update_slice", "layer": "layer_10", "stage": 0, "alpa": "S0R",
           "partition_spec": "P('x', None)", "pinned": False}
    assert "dynamic_update_slice" in row_label(row) and "layer_10" in row_label(row)


def test_no_number_is_written_in_exponent_form(deep):
    # Issue 12, items 5 and 8: "8.38e+03 GiB accessed"; one number format everywhere.
    model, plan = deep
    wb = Workbench(model, plan.cluster, plan=plan)
    wb.graph.on_click("L:head")
    texts = [x.value for v in wb.views.values() for x in _walk(v.widget) if isinstance(getattr(x, "value", None), str)]
    texts += [n["hover"] for n in wb.graph.data["overview"]] + [n["hover"] for n in wb.graph.data["detail"]["nodes"]]
    texts += [wb.graph.data["detail"]["title"]]
    bad = [t for t in texts if re.search(r"\d[eE][+-]\d", t) and "PartitionSpec" not in t]
    assert not bad, bad[:3]
    assert not any("x ''" in t for t in texts)  # strategies are said in words ("from RS1 × scalar")


# --- figures and texts from plain values -------------------------------------------------------------------------

def test_tiny_terms_get_no_percentage(plan):
    # Issue 12, item 5: a term that grows from 2 µs to 83 µs showed "+4063.1%".
    before = dataclasses.replace(plan.cost, reshard_s=2e-6)
    after = dataclasses.replace(plan.cost, reshard_s=8.3e-5)
    html = breakdown_html(before, after)
    row = next(r for r in html.split("<tr") if "resharding" in r)
    assert "+81 µs" in row and "%" not in row
    slower = dataclasses.replace(plan.cost, step_time_s=plan.cost.step_time_s * 1.1)
    row = next(r for r in breakdown_html(plan.cost, slower).split("<tr") if "step time" in r)
    assert "+10.0%" in row
    assert "white-space: nowrap" in STYLE  # cost cells never wrap ("9.208 / ms")


def test_memory_view_splits_each_stage_before_and_after(wb, plan):
    cost = wb.cost
    names = [t.name for t in cost.mem_fig.data]
    assert names[:len(PARTS)] == [figures.PART_LABELS[p] for p in PARTS]
    unit, scale = figures.byte_unit(max(plan.cost.peak_mem_bytes))
    assert cost.mem_fig.layout.yaxis.title.text == unit and unit in ("KiB", "MiB")  # not flattened to 0.001 GiB
    rows = memory_breakdown(plan)
    for k, r in enumerate(rows):
        assert sum(cost.mem_fig.data[i].y[k] for i in range(len(PARTS))) == pytest.approx(r["total_bytes"] / scale)
    assert "off the scale" in cost.mem_fig.layout.title.text  # 16 GiB is far above: named, not drawn
    # Only the parts some stage holds are in the legend, and the figure grows by a line for each of them (a legend
    # squeezed into the default height became a scroll box over the stage labels in Chromium).
    held = [figures.PART_LABELS[p] for p in PARTS if any(r[p] for r in rows)]
    assert [t.name for t in cost.mem_fig.data if t.showlegend is not False] == held and len(held) < len(PARTS)
    grown = cost.mem_fig.layout.height
    wb.layout.set_remat(1, True)
    assert cost.mem_fig.layout.height > grown  # the recompute working set and "saved by remat" joined the legend
    after = memory_breakdown(wb.plan)
    # Before and now side by side: x is (stage, before/now).
    assert list(cost.mem_fig.data[0].x[1]) == ["before", "now", "before", "now"]
    acts = cost.mem_fig.data[PARTS.index("activations_bytes")].y
    assert acts[3] * scale == pytest.approx(after[1]["activations_bytes"]) and acts[2] * scale == pytest.approx(
        rows[1]["activations_bytes"])
    assert "remat saves" in cost.memory.value and any(t.name.startswith("saved by remat") for t in cost.mem_fig.data)


def test_timeline_opens_on_the_first_microbatches(graph, monkeypatch):
    from autopar_lab.widgets.views import timeline as tv

    cluster = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=4)
    p = al.megatron_plan(graph, cluster, dp=1, tp=2, pp=2, microbatches=8)
    monkeypatch.setattr(tv, "ZOOM_ABOVE", 4)  # the batch of 8 allows 8 microbatches: zoom from 5 on
    view = tv.TimelineView(al.Session(p))
    rows, makespan, _ = timeline_data(p)
    end = window_end(rows, tv.ZOOM_TO)
    assert view.first == tv.ZOOM_TO and 0 < end < makespan
    assert view.figure.layout.xaxis.range[1] == pytest.approx(end * 1.04)
    labelled = [t for tr in view.figure.data if tr.name in ("fwd", "bwd") for t in tr.text if t]
    assert labelled and max(int(t) for t in labelled) < 2 * tv.ZOOM_TO
    assert "first 4 microbatches" in view.caption.value
    view.window.value = 0  # "whole step"
    assert view.first is None and view.figure.layout.xaxis.range[1] == pytest.approx(makespan * 1.01)


def test_timeline_bubbles_are_the_idle_time_of_each_stage(plan):
    tl = plan.cost.timeline
    rows = tl.to_rows()
    idle = figures.idle_intervals(rows, tl.makespan)
    for i in range(tl.num_stages):
        gaps = sum(r["end"] - r["start"] for r in idle if r["stage"] == i)
        assert gaps == pytest.approx(tl.makespan - tl.busy_s[i], rel=1e-9)
    fig = figures.timeline_figure(rows, tl.makespan)
    assert {t.name for t in fig.data} >= {"fwd", "bwd", "bubble"}


def test_cost_terms_add_up_and_roofline(plan):
    terms = cost_terms(plan.cost)
    assert sum(terms.values()) == pytest.approx(plan.cost.step_time_s, rel=1e-12)
    r = roofline(plan)
    c = plan.cluster
    peak = c.device.peak("float32")
    assert r["utilisation"] == pytest.approx(plan.graph.total_flops / (plan.cost.step_time_s * c.num_devices * peak))
    assert 0 < r["utilisation"] <= r["bound"] <= 1


def test_mesh_grid_and_rows(plan, wb):
    blocks = [{"devices": list(st.devices), "label": f"S{k}"} for k, st in enumerate(plan.stages)]
    fig = figures.mesh_grid_figure(1, 4, blocks, selected=1)
    assert [c[0] for c in fig.data[0].customdata] == [0, 0, 1, 1]
    assert list(fig.data[0].marker.line.width) == [0.5, 0.5, 3, 3]
    rows = op_rows(wb.session, primitive="dot_general", stage=1)
    assert rows and all(r["stage"] == 1 and r["primitive"] == "dot_general" for r in rows)
    assert all(r["partition_spec"].startswith("P(") for r in rows)


def test_the_workbench_opens_on_a_tpu_slice_of_64_chips():
    """A TPU slice is one host of many chips (tpu-v5p:64): the what-if slider offers that count (it offered 1..16
    and the workbench failed to open with 'Invalid selection')."""
    from autopar_lab.widgets.views.controls import device_counts

    assert device_counts(8) == [1, 2, 4, 8, 16] and device_counts(64)[-1] == 64
    spec = al.models.get("llama3-tiny", dtype="bfloat16", batch_size=64, seq_len=32, hidden_size=64, num_heads=4,
                         num_kv_heads=2, ffn_hidden=128)
    # The plan auto_plan picks there (one stage on the 64 chips, data parallel: the same step), given rather than
    # searched: the failure was the controls', whatever the plan, and the search took 15 CPU-s of ILP workers.
    cluster = al.Cluster.parse("tpu-v5p:64")
    wb = Workbench(spec, plan=al.megatron_plan(spec, cluster, dp=64, tp=1, pp=1))
    assert wb.controls.devices.value == 64 and sum(
        st.submesh[0] * st.submesh[1] for st in wb.session.plan.stages) <= 64
