"""The workbench session, headless: every action, undo/redo, observers, solves with progress and cancel."""

import threading

import pytest

import autopar_lab as al
from autopar_lab.plan import Plan
from autopar_lab.pricing import CostTable
from autopar_lab.widgets.session import Event, Selection, Session, SolveCancelled


@pytest.fixture
def session(plan):
    return Session(plan)


def _dot(s: Session, layer="layer_0", k=0) -> int:
    g = s.graph
    return [o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).layer == layer][k]


def _record(s: Session) -> list[Event]:
    events: list[Event] = []
    s.subscribe(events.append)
    return events


def test_set_choice_pushes_a_new_plan_and_tells_observers(session, plan):
    events = _record(session)
    op = _dot(session)
    worst = session.alternatives(op)[-1]
    assert worst.delta_s > 0
    after = session.set_choice(op, worst.strategy)
    assert session.plan is after and session.previous is plan
    assert after.choice(op).name == worst.strategy and plan.choice(op).name != worst.strategy
    assert after.cost.step_time_s == pytest.approx(plan.cost.step_time_s + worst.delta_s, rel=0, abs=1e-15)
    assert session.pins == {op: (worst.strategy, "shared")}
    d = session.diff()
    assert d["ops"] == [{"op": op, "before": plan.choice(op).name, "after": worst.strategy}]
    assert d["step_time_delta_s"] == after.cost.step_time_s - plan.cost.step_time_s
    assert [(e.name, e.action) for e in events] == [("plan", "set_choice")]
    assert events[0].before is plan and events[0].after is after


def test_undo_redo_restore_the_same_plans_and_a_new_action_clears_redo(session, plan):
    op = _dot(session)
    alts = session.alternatives(op)
    p1 = session.set_choice(op, alts[-1].strategy)
    p2 = session.set_microbatches(4)
    events = _record(session)
    assert session.undo() is p1 and session.undo() is plan
    assert not session.can_undo and session.can_redo
    with pytest.raises(ValueError, match="nothing to undo"):
        session.undo()
    assert session.redo() is p1
    assert [(e.action, e.before, e.after) for e in events] == [("undo", p2, p1), ("undo", p1, plan), ("redo", plan, p1)]
    p3 = session.set_microbatches(8)
    assert not session.can_redo and session.plan is p3 and session.previous is p1
    assert [a for a, _ in session.history] == ["start", "set_choice", "set_microbatches"]
    with pytest.raises(ValueError, match="nothing to redo"):
        session.redo()


def test_bad_override_changes_nothing(session, plan):
    events = _record(session)
    op = _dot(session)
    with pytest.raises(ValueError, match=str(op)):
        session.set_choice(op, "S9 nonsense")
    with pytest.raises(ValueError, match="divisor|dividing"):
        session.set_microbatches(3)
    assert session.plan is plan and not session.can_undo and events == [] and session.diff() is None


def test_selection_follows_op_layer_and_stage(session, plan):
    events = _record(session)
    op = _dot(session, "layer_1")
    sel = session.select(op=op)
    assert sel == Selection(op, "layer_1", plan.stage_of(op)) and sel.stage == 1  # layers 2-3 are stage 1
    assert session.select(layer="embed") == Selection(None, "embed", 0)
    assert session.select(stage=1) == Selection(None, None, 1)
    assert session.select() == Selection()
    assert [e.name for e in events] == ["selection"] * 4
    assert events[0].detail["selection"].op == op
    for bad in (dict(op=10**6), dict(layer="nope"), dict(stage=5)):
        with pytest.raises(ValueError):
            session.select(**bad)


def test_pin_and_unpin(session, plan):
    op = _dot(session)
    current = plan.choice(op).name
    session.pin(op, current)
    assert session.pins == {op: (current, "shared")}
    assert session.plan.cost.step_time_s == plan.cost.step_time_s  # pinning the current choice costs nothing
    session.unpin(op)
    assert session.pins == {} and session.plan.choice(op).name == current
    with pytest.raises(ValueError, match="not pinned"):
        session.unpin(op)


def test_microbatches_match_the_engine(session, plan):
    p = session.set_microbatches(4)
    assert p.microbatches == 4
    assert p.cost.step_time_s == plan.with_microbatches(4).cost.step_time_s
    assert p.cost.timeline.microbatches == 4


def test_stage_actions(session, plan):
    assert session.boundaries() == [2]
    with pytest.raises(ValueError, match="layers 1..3"):
        session.move_cut(0, 0)
    with pytest.raises(ValueError, match="cut 1 does not exist"):
        session.move_cut(1, 2)
    p = session.move_cut(0, 3)
    assert [st.layers for st in p.stages] == [(0, 2), (3, 3)]
    assert p.stage_pins["boundaries"] == (3,)
    p = session.set_submesh(0, (1, 2), (2, 1))
    assert p.stages[0].logical_mesh == (2, 1) and p.stages[0].submesh == (1, 2)
    with pytest.raises(ValueError):
        session.set_submesh(0, (1, 4))  # the two stages would need 6 devices
    with pytest.raises(ValueError, match="stage must be"):
        session.set_remat(7, True)
    p = session.set_remat(1, True)
    assert p.stages[1].remat and not p.stages[0].remat
    p = session.set_schedule("gpipe")
    assert p.schedule == "gpipe" and p.cost.timeline.schedule == "gpipe"
    assert session.stage_pins.keys() >= {"boundaries", "schedule", "remat"}
    p = session.unpin_stages("schedule")
    assert "schedule" not in p.stage_pins and p.schedule == "gpipe"
    assert session.unpin_stages().stage_pins == {}
    for _ in range(6):
        session.undo()
    assert session.plan is plan


def test_stage_actions_say_what_is_missing_without_the_engine_methods(session, monkeypatch):
    for name, call in (("with_schedule", lambda: session.set_schedule("gpipe")),
                       ("with_remat", lambda: session.set_remat(0, True)),
                       ("with_stages", lambda: session.move_cut(0, 3))):
        monkeypatch.delattr(Plan, name)
        with pytest.raises(NotImplementedError, match=f"Plan.{name}"):
            call()
    assert not session.can_undo


def test_resolve_keeps_stage_pins(small_plan):
    session = Session(small_plan)
    session.set_microbatches(2)
    p = session.resolve()  # the stage DP over the cached table, the microbatch count held
    # a Megatron-LM plan also keeps what it overlaps (none of Megatron-Core's switches on: its default)
    assert p.microbatches == 2 and p.stage_pins == {"microbatches": 2, "overlap": ()}
    assert session.last_action == "resolve" and session.previous.microbatches == 2


def test_save_load_and_export(session, plan, tmp_path):
    op = _dot(session)
    session.set_choice(op, session.alternatives(op)[-1].strategy)
    path = session.save(tmp_path / "p.json")
    saved = session.plan
    session.undo()
    loaded = session.load(path)
    assert loaded.cost.step_time_s == saved.cost.step_time_s and loaded.pins == saved.pins
    assert session.last_action == "load"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        session.load(tmp_path / "bad.json")
    assert session.plan is loaded
    code = session.export_code()
    assert "PartitionSpec" in code and "Mesh" in code


def test_unsubscribe(session):
    events = []
    off = session.subscribe(events.append)
    session.select(stage=0)
    off()
    session.select(stage=1)
    assert len(events) == 1
    with pytest.raises(TypeError):
        session.subscribe("not callable")


def test_intra_solve_returns_unpinned_operators_to_the_ilp_choice(small_plan):
    session, plan = Session(small_plan), small_plan
    op = _dot(session)
    session.set_choice(op, session.alternatives(op)[-1].strategy)
    session.unpin(op)  # the worse strategy stays, no longer pinned
    p = session.solve("intra")
    assert p.choice(op).name == plan.choice(op).name
    assert p.cost.step_time_s == plan.cost.step_time_s
    assert session.last_action == "solve_intra"
    # With the pin the ILP keeps it.
    worst = session.alternatives(op)[-1].strategy
    session.set_choice(op, worst)
    assert session.solve("intra").choice(op).name == worst


def test_inter_solve_reports_progress_keeps_pins_and_is_no_worse(small_plan):
    s = Session(small_plan)
    op = _dot(s)
    name = s.plan.choice(op).name
    s.pin(op, name)
    seen = []
    # The meshes the stage DP prices (each distinct view of a submesh once: (1, 2) seen as (2, 1) is the same
    # devices in the same order, not another ILP) that no earlier solve has priced.
    missing = {key for key in small_plan.table.planned_meshes() if small_plan.table.solved_mesh(*key) is None}
    p = s.solve("inter", on_progress=lambda msg, frac: seen.append((msg, frac)))
    assert seen[0][0] == "inter solve started" and seen[-1] == ("inter solve done", 1.0)
    # Each ILP the cost table had not run yet reports as it finishes; then the pins are re-solved around.
    assert sum(m.startswith("intra-op") for m, _ in seen) == len(missing)
    assert ("re-solving around the pins", None) in seen
    assert p.pins == {op: (name, "shared")} and p.choice(op).name == name
    assert p.cost.step_time_s <= small_plan.cost.step_time_s * (1 + 1e-9)


def test_cancel_leaves_the_session_unchanged(small_plan):
    s = Session(small_plan)
    events = _record(s)
    stop = threading.Event()
    stop.set()
    with pytest.raises(SolveCancelled):
        s.solve("full", cancel=stop)
    # Cancelled from inside: the first report of an ILP sets the event, the next report raises.
    stop2 = threading.Event()
    with pytest.raises(SolveCancelled):
        s.solve("full", cancel=stop2, on_progress=lambda msg, frac: stop2.set())
    assert s.plan is small_plan and not s.can_undo
    assert all(e.name == "progress" for e in events)
    with pytest.raises(ValueError, match="solve kind"):
        s.solve("quick")


def test_compare_prices_baselines_and_the_optimum(small_plan):
    s = Session(small_plan)
    events = _record(s)
    out = s.compare()
    assert out["current"] is small_plan
    assert out["megatron"] is not None and out["data_parallel"].method == "data_parallel"
    opt = out["optimum"].cost.step_time_s
    # The exhaustive optimum is no slower than any plan of its space (these baselines are in it).
    for name in ("megatron", "data_parallel"):
        assert opt <= out[name].cost.step_time_s * (1 + 1e-9)
    assert events[-1].name == "compare" and s.comparison is out
    s.adopt(out["optimum"])
    assert s.plan is out["optimum"] and s.last_action == "adopt"


def test_what_if_cluster_replans(small_plan, graph):
    s = Session(small_plan, model=graph)
    p = s.set_cluster(devices_per_host=1)
    assert p.cluster.num_devices == 1 and s.cluster.devices_per_host == 1
    assert p.method == "auto" and len(p.stages) == 1
    with pytest.raises(ValueError, match="unknown change"):
        s.set_cluster(gpus=3)
    s.undo()
    assert s.cluster.num_devices == 2


def test_solve_op_maps_a_deep_graph_onto_its_shallow_copy(cluster):
    deep = al.models.get("gpt-tiny", batch_size=8, num_layers=5, dtype="float32").trace()
    shallow = al.models.get("gpt-tiny", batch_size=8, num_layers=4, dtype="float32").trace()
    table = CostTable(deep, cluster, solve_graph=shallow)  # no ILP runs until a mesh is priced
    m = dict(table.op_map.items())
    assert len(m) == len(deep.ops)
    for full, small in m.items():
        a, b = deep.op(full), shallow.op(small)
        assert (a.primitive, a.out_shapes, a.role) == (b.primitive, b.out_shapes, b.role)
    # layer_4 (the last block) maps onto a layer of the copy, operator by operator in order.
    k = table.layer_names.index("layer_4")
    target = list(shallow.layers)[table.layer_map[k]]
    assert [m[o] for o in deep.ops_in_layer("layer_4")] == shallow.ops_in_layer(target)


def test_session_needs_a_plan():
    with pytest.raises(TypeError, match="needs a Plan"):
        Session("plan.json")


def test_session_imports_no_widget_library():
    import subprocess
    import sys

    code = ("import sys, autopar_lab as al; s = al.Session; "
            "print(sorted(m for m in ('ipywidgets', 'plotly', 'IPython') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_what_if_replan_keeps_operator_pins(small_plan, graph):
    """Issue 12 item 3: an operator pinned to a strategy came back with the fresh plan's own strategy after a
    what-if re-plan while still counted as pinned. Every pin that still holds is kept, and honoured."""
    s = Session(small_plan, model=graph)
    op = _dot(s, "layer_1")
    other = next(a.strategy for a in s.alternatives(op) if a.strategy != small_plan.choice(op).name)
    s.set_choice(op, other)
    for change in (dict(devices_per_host=4), dict(hosts=2)):
        events = _record(s)
        p = s.set_cluster(**change)
        assert p.pins == {op: (other, "shared")} and p.choice(op).name == other
        assert s.dropped_pins == [] and events[-1].detail["dropped_pins"] == []
        s.undo()
    # The inter solve keeps it too.
    assert s.solve("inter").choice(op).name == other


def test_what_if_replan_drops_what_cannot_hold_and_says_why(small_plan, graph):
    s = Session(small_plan, model=graph)
    op = _dot(s, "layer_1")
    split = next(a.strategy for a in s.alternatives(op) if "S" in a.strategy.split("=")[0])
    s.set_choice(op, split)
    s.set_stages(submeshes=[(1, 2)])  # a stage pin that a one-device cluster cannot keep
    assert "submeshes" in s.stage_pins
    events = _record(s)
    p = s.set_cluster(devices_per_host=1)  # one device: no strategy splits anything
    assert p.pins == {} and p.stage_pins == {"overlap": ()}  # the Megatron-LM plan's overlap (none) holds anywhere
    assert len(s.dropped_pins) == 2 and events[-1].detail["dropped_pins"] == s.dropped_pins
    assert any(f"#{op}" in m and split in m and "no logical mesh of the new cluster" in m for m in s.dropped_pins)
    assert any("submeshes" in m and "dropped" in m for m in s.dropped_pins)
    assert any(e.name == "progress" and e.detail["message"] in s.dropped_pins for e in events)
