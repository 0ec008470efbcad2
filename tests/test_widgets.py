"""The workbench's views, headless: simulated clicks and dropdown changes update the plan and every linked view."""

import pytest

import autopar_lab as al
from autopar_lab.widgets.views import figures
from autopar_lab.widgets.views.cost_panel import cost_terms, roofline
from autopar_lab.widgets.views.graph import graph_data, layer_summary
from autopar_lab.widgets.views.sharding_table import op_rows
from autopar_lab.widgets.views.timeline import timeline_data
from autopar_lab.widgets.workbench import Workbench

CSS = ("autopar-graph", "autopar-sharding-table", "autopar-stage-layout", "autopar-cost-panel", "autopar-timeline",
       "autopar-controls")


@pytest.fixture(scope="module")
def graph():
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2, dtype="float32").trace()


@pytest.fixture(scope="module")
def plan(graph):
    cluster = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=4)
    return al.megatron_plan(graph, cluster, dp=1, tp=2, pp=2, microbatches=2)


@pytest.fixture(scope="module")
def small_plan(graph):
    c2 = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=2)
    return al.megatron_plan(graph, c2, dp=1, tp=2, pp=1)


@pytest.fixture
def wb(graph, plan):
    return Workbench(graph, plan.cluster, plan=plan)


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


def _dot(wb, layer="layer_0"):
    g = wb.session.op_graph
    return [o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).layer == layer][0]


def test_every_view_is_findable_by_its_css_class(wb):
    found = {c for w in _walk(wb.widget) for c in getattr(w, "_dom_classes", ())}
    assert set(CSS) <= found and "autopar-step-time" in found
    steps = [w for w in _walk(wb.widget) if "autopar-step-time" in getattr(w, "_dom_classes", ())]
    assert len(steps) == 1 and "step time" in steps[0].value
    assert f"{wb.plan.cost.step_time_s * 1e3:.4g} ms" in steps[0].value


def test_dropdown_change_overrides_and_updates_table_and_cost_panel(wb, plan):
    op = _dot(wb)
    wb.table.rows_select.value = op  # a click on the row
    assert wb.session.selection.op == op and wb.table.op == op
    opts = wb.table.alternatives.options
    assert wb.table.alternatives.value == plan.choice(op).name and len(opts) >= 2
    worst = opts[-1][1]
    before_text = wb.cost.step_time.value
    wb.table.alternatives.value = worst  # the dropdown change
    new = wb.plan
    assert new is not plan and new.choice(op).name == worst and new.pins == {op: worst}
    row = wb.table.row(op)
    assert row["strategy"] == worst and row["pinned"]
    assert row["alpa"] == str(new.choice(op).out_specs[0])
    text = wb.cost.step_time.value
    assert text != before_text and "was" in text and f"{new.cost.step_time_s * 1e3:.4g} ms" in text
    assert "before" in wb.cost.breakdown.value
    # The cost figure shows before and after; each bar's terms add up to that plan's step time.
    for k, p in enumerate((plan, new)):
        total = sum(tr.x[k] for tr in wb.cost.cost_fig.data)
        assert total == pytest.approx(p.cost.step_time_s, rel=1e-12)
    # Undo by its button restores the plan and the cost text.
    wb.controls.undo_button.click()
    assert wb.plan is plan and wb.table.row(op)["strategy"] == plan.choice(op).name
    assert f"{plan.cost.step_time_s * 1e3:.4g} ms" in wb.cost.step_time.value
    wb.controls.redo_button.click()
    assert wb.plan is new


def test_pin_unpin_buttons(wb, plan):
    op = _dot(wb)
    wb.table.select(op)
    wb.table.pin_button.click()
    assert wb.plan.pins == {op: plan.choice(op).name} and wb.table.row(op)["pinned"]
    assert not wb.controls.resolve_button.disabled
    wb.table.unpin_button.click()
    assert wb.plan.pins == {} and not wb.table.row(op)["pinned"]


def test_graph_clicks_expand_and_select(wb):
    g = wb.graph
    n_layers = len(layer_summary(wb.session.graph)[0])
    assert len(g._keys) == n_layers
    g.on_click("L:layer_1")
    assert g.expanded == "layer_1" and wb.session.selection.layer == "layer_1"
    assert len(g._keys) == n_layers + len(wb.session.graph.ops_in_layer("layer_1"))
    op = _dot(wb, "layer_1")
    g.on_click(f"O:{op}")
    assert wb.session.selection.op == op and wb.session.selection.stage == 1
    assert wb.table.op == op and f"#{op}" in wb.table.detail.value  # the table follows the graph
    assert wb.layout.stage == 1  # and so does the stage layout
    marker = g.figure.data[1].marker
    assert marker.line.width[g._keys.index(f"O:{op}")] == 3  # the selected node is outlined
    g.on_click("L:layer_1")
    assert g.expanded is None and len(g._keys) == n_layers


def test_graph_colours_by_stage_or_sharding(wb):
    layers, ops, stats, _ = layer_summary(wb.session.graph)
    assert sum(len(v) for v in ops.values()) == len(wb.session.graph.ops)
    assert sum(s[0] for s in stats.values()) == pytest.approx(wb.session.graph.total_flops)
    by_stage, _ = graph_data(wb.session, "layer_0", "stage")
    by_spec, _ = graph_data(wb.session, "layer_0", "sharding")
    op_cols = lambda nodes: {n["colour"] for n in nodes if n["key"].startswith("O:")}
    assert len(op_cols(by_stage)) == 1 and len(op_cols(by_spec)) > 1
    layer_cols = {n["key"]: n["colour"] for n in by_stage if n["key"].startswith("L:")}
    assert layer_cols["L:embed"] != layer_cols["L:head"]  # two stages, two colours
    wb.graph.mode_buttons.value = "sharding"
    assert wb.graph.mode == "sharding"
    with pytest.raises(ValueError, match="colour mode"):
        graph_data(wb.session, None, "rainbow")


def test_stage_layout_controls(wb, plan):
    lay = wb.layout
    lay.microbatches.value = 4  # dropdown
    assert wb.plan.microbatches == 4
    rows, makespan, cut = timeline_data(wb.plan)
    sends = 2 * 4 if wb.plan.cost.stage_comm_s > 0 else 0  # one cut: an activation and a gradient per microbatch
    assert len(rows) == 2 * 2 * 4 + sends and cut == 0
    n_bars = sum(len(tr.x) for tr in wb.timeline.figure.data if tr.name in ("fwd", "bwd"))
    assert n_bars == 2 * 2 * 4  # fwd and bwd of every microbatch on both stages
    assert "4 microbatch" in wb.timeline.figure.layout.title.text
    lay.on_click_stage(1)
    assert wb.session.selection.stage == 1 and lay.stage_pick.value == 1
    lay.submesh.value = (1, 2)
    lay.logical.value = (2, 1)
    lay.apply_mesh.click()
    assert wb.plan.stages[1].logical_mesh == (2, 1)
    lay.schedule.value = "gpipe"
    assert wb.plan.schedule == "gpipe" and wb.timeline.figure.layout.title.text.startswith("gpipe")
    lay.remat.value = True
    assert wb.plan.stages[1].remat
    lay.cut_layer.value = 3
    lay.apply_cut.click()
    assert [st.layers for st in wb.plan.stages] == [(0, 2), (3, 3)]
    # A bad move is reported, and nothing changes.
    current = wb.plan
    lay.move_cut(0, 0)
    assert wb.plan is current and "cut 0 can move" in lay.message.value and "move_cut" in wb.status.value
    lay.unpin_button.click()
    assert wb.plan.stage_pins == {}


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
    t = c.start_solve("intra")
    assert t is not None
    c.wait(120)
    assert not c.busy and c.progress.description == "done" and c.progress.value == 1.0
    assert wb.session.last_action == "solve_intra" and wb.plan.pins == {}
    assert wb.plan.choice(op).name == plan.choice(op).name and wb.table.row(op)["strategy"] == plan.choice(op).name
    assert f"{plan.cost.step_time_s * 1e3:.4g} ms" in wb.cost.step_time.value
    assert not c.undo_button.disabled and c.cancel_button.disabled


def test_cancel_a_full_solve(wb, plan):
    c = wb.controls
    c.start_solve("full")
    c.cancel()
    c.wait(120)
    assert c.progress.description == "cancelled" and wb.plan is plan and not wb.session.can_undo
    assert "cancelled" in c.status.value


def test_compare_and_adopt(small_plan, graph):
    wb = Workbench(graph, small_plan.cluster, plan=small_plan)
    c = wb.controls
    c.compare_button.click()  # on a worker thread
    c.wait(120)
    html = c.comparison.value
    assert "megatron" in html and "data_parallel" in html and "optimum" in html
    assert set(c.adopt_pick.options) == {"megatron", "data_parallel", "optimum"}
    c.adopt_pick.value = "optimum"
    c.adopt_button.click()
    assert wb.plan is wb.session.comparison["optimum"] and wb.session.last_action == "adopt_optimum"
    assert "before" in wb.cost.breakdown.value and "optimum" in wb.status.value


def test_what_if_sliders_replan(small_plan, graph):
    wb = Workbench(graph, small_plan.cluster, plan=small_plan)
    c = wb.controls
    c.devices.value = 1
    assert wb.plan is small_plan  # a slider alone does not re-plan unless asked to
    c.what_if(background=False)
    assert wb.plan.cluster.num_devices == 1 and wb.layout.figure.data[0].x == (0,)
    assert c.devices.value == 1 and c.progress.description == "done"


# --- figures from plain values (no widget) --------------------------------------------------------------------------

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
