"""Overrides on a deep model tell the truth (issue 12, item 2).

A 24-layer GPT is planned on its 4-layer copy: every block is priced by one layer of the copy. An override of a
block operator applies to every block that shares the solution (on every stage that runs one), or, split off, to
one layer alone; either way the step time moves by exactly the delta the alternatives predicted, the pins survive
save/load and resolve, and the views say the real layer, stage and spec.
"""

import dataclasses
import json

import pytest

import autopar_lab as al
from autopar_lab import planschema
from autopar_lab.layergroups import group_of_layer, layer_groups
from autopar_lab.overrides import without_layer_pin
from autopar_lab.pricing.incremental import split_layer_costs
from autopar_lab.pricing.layers import layer_costs


@pytest.fixture(scope="module")
def deep():
    """24 blocks (GPT-1.3B's depth) on 2 hosts x 4 devices: layers 0..12 on stage 0, 13..25 on stage 1."""
    model = al.models.get("gpt-tiny", num_layers=24, batch_size=16, hidden_size=64, seq_len=32, vocab_size=128)
    cluster = al.Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=4)
    plan = al.megatron_plan(model, cluster, dp=1, tp=4, pp=2, microbatches=4)
    assert plan.table.solve_graph is not plan.graph and len(plan.layer_names) == 26
    return model, plan


def _first_dot(plan, layer):
    g = plan.op_graph
    return next(o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).layer == layer)


def _real_dot(plan, layer):
    g = plan.graph
    return next(o for o in g.ops_in_layer(layer) if g.op(o).primitive == "dot_general")


def test_a_group_override_moves_the_step_time_by_its_predicted_delta(deep):
    _, plan = deep
    m = plan.table.op_map
    # The first matmul of the copy's first block: that copy layer prices no real layer, but the operator stands for
    # the first matmul of every block (before the fix every alternative read "+0 s" and changed nothing).
    op = _first_dot(plan, "layer_0")
    rep = m.representative(op)
    assert rep != op and m.full_layers_of(op) == list(range(1, 25)) and plan.stages_of(op) == [0, 1]
    alts = plan.alternatives(op)
    assert len(alts) >= 3 and sum(a.delta_s != 0 for a in alts) >= 2
    for a in alts:
        new = plan.with_choice(op, a.strategy)
        assert new.cost.step_time_s - plan.cost.step_time_s == a.delta_s  # to the bit: one pricing path
        assert plan.diff(new)["step_time_delta_s"] == a.delta_s
        assert new.pins == {rep: a.strategy}
        for k in (0, 1):  # both stages run blocks: each runs every sibling by the new strategy
            assert {new.stages[k].intra.strategies[s].name for s in m.siblings(op)} == {a.strategy}
    worst = alts[-1]
    new = plan.with_choice(op, worst.strategy)
    assert worst.delta_s > 0 and new.cost.step_time_s > plan.cost.step_time_s
    # Every real block reads the new strategy, on the stage that runs it.
    for name in ("layer_0", "layer_13", "layer_23"):
        full = m.full_op_in(op, plan.layer_names.index(name))
        assert new.full_choice(full).name == worst.strategy


def test_a_split_layer_is_priced_alone_by_its_own_strategy(deep):
    _, plan = deep
    m = plan.table.op_map
    k13 = plan.layer_names.index("layer_13")
    full = _real_dot(plan, "layer_13")
    assert plan.full_stage_of(full) == 1 and plan.stage_of(m.solve_op(full)) == 0  # the stand-in's first block: S0
    alts = plan.layer_alternatives(full)
    assert sum(a.delta_s != 0 for a in alts) >= 2
    for a in alts:
        new = plan.with_layer_choice(full, a.strategy)
        assert new.cost.step_time_s - plan.cost.step_time_s == a.delta_s
    worst = alts[-1]
    new = plan.with_layer_choice(full, worst.strategy)
    assert new.layer_pins == {full: worst.strategy} and new.pins == {}
    assert new.full_choice(full).name == worst.strategy
    other = m.full_op_in(m.solve_op(full), plan.layer_names.index("layer_12"))
    assert new.full_choice(other).name == plan.full_choice(other).name  # the rest of the group is unchanged
    # Only layer_13's cost moved, and it is its copy layer's cost (layer_costs over the whole copy, not the
    # incremental path) with its stand-in run by the pinned strategy on stage 1's mesh.
    intra = plan.stages[1].intra
    cache = plan.table.strategy_cache(intra.mesh)
    before = plan.stages[1].layer_costs
    after = split_layer_costs(plan.table, intra, before, (13, 25), new.layer_pins, cache)
    assert [k for k in range(26) if before[k] != after[k]] == [k13]
    sop = m.solve_op(full)
    pinned = next(s for s in cache.strategies(plan.op_graph.op(sop)) if s.name == worst.strategy)
    view = dataclasses.replace(intra, strategies={**intra.strategies, sop: pinned})
    truth = layer_costs(plan.op_graph, view, list(plan.op_graph.layers), cache=cache)[m.layer_map[k13]]
    assert after[k13] == truth
    # ... and the stage was priced from it (stage 0 untouched).
    assert new.stages[1].compute_s == sum(c.compute_s for c in after[13:26])
    assert new.stages[0] == plan.stages[0] and new.stages[1].fwd_s > plan.stages[1].fwd_s
    # The split layer is a group of its own; the others still share one solution.
    labels = [grp.label for grp in layer_groups(new)]
    assert "layer_13 (split from its group)" in labels
    assert "layer_0..23 but layer_13 (×23, one solution; S0: layer_0..11, S1: layer_12..23)" in labels


def test_a_group_override_after_a_split_leaves_the_split_layer_alone(deep):
    _, plan = deep
    m = plan.table.op_map
    a = _real_dot(plan, "layer_13")
    split = plan.with_layer_choice(a, plan.layer_alternatives(a)[-1].strategy)
    # Another operator of the same layer, changed for the group: layer_13 keeps its strategy (its own from its
    # split on), every other block takes the new one.
    g = plan.graph
    b = [o for o in g.ops_in_layer("layer_13") if g.op(o).primitive == "dot_general"][1]
    sop = m.solve_op(b)
    old = split.full_choice(b).name
    alts = split.alternatives(sop)
    new_name = next(x.strategy for x in alts if x.strategy != old)
    new = split.with_choice(sop, new_name)
    assert split.alternatives(sop) == alts
    assert new.full_choice(b).name == old and new.layer_pins[b] == old
    assert new.full_choice(m.full_op_in(sop, plan.layer_names.index("layer_12"))).name == new_name
    delta = next(x.delta_s for x in alts if x.strategy == new_name)
    assert new.cost.step_time_s - split.cost.step_time_s == delta


def test_an_override_of_a_group_spanning_two_meshes(deep):
    _, plan = deep
    two = plan.with_stages(logical_meshes=[(2, 2), (1, 4)])  # stage 0 sees its 4 devices as 2x2
    op = _first_dot(two, "layer_1")
    alts = two.alternatives(op)
    names0 = {s.name for s in two.table.strategy_cache(two.stages[0].intra.mesh).strategies(two.op_graph.op(op))}
    names1 = {s.name for s in two.table.strategy_cache(two.stages[1].intra.mesh).strategies(two.op_graph.op(op))}
    assert {a.strategy for a in alts} == names0 & names1  # only what every stage running a block can do
    a = alts[-1]
    new = two.with_choice(op, a.strategy)
    assert new.cost.step_time_s - two.cost.step_time_s == a.delta_s
    assert new.stages[0].intra.strategies[op].name == new.stages[1].intra.strategies[op].name == a.strategy
    assert names0 - names1  # a 2x2 mesh has strategies (over mesh axis 0) that a 1x4 one has not
    with pytest.raises(ValueError, match="stage 1's 1x4 logical mesh"):
        two.with_choice(op, next(iter(names0 - names1)))


def test_a_layer_that_shares_nothing_is_overridden_as_itself(deep):
    _, plan = deep
    full = _real_dot(plan, "head")
    sop = plan.table.op_map.solve_op(full)
    alts = plan.layer_alternatives(full)
    assert alts == plan.alternatives(sop)
    new = plan.with_layer_choice(full, alts[-1].strategy)
    assert new.layer_pins == {} and new.pins == {sop: alts[-1].strategy}


@pytest.mark.slow
def test_resolve_honours_a_pin_on_any_copy_layer_and_files_keep_it(deep, tmp_path):
    # The lead's bug on main: a pin on the copy's first block came back from resolve run by another strategy, and
    # the plan file then refused to load ("a pin names the strategy the plan chose").
    model, plan = deep
    m = plan.table.op_map
    op = _first_dot(plan, "layer_0")
    name = plan.alternatives(op)[-1].strategy
    pinned = dataclasses.replace(plan, pins={op: name})  # as an old plan file holds it: not the representative
    out = al.resolve(pinned)
    assert out.pins == {op: name}
    for k, st in enumerate(out.stages):
        assert {st.intra.strategies[s].name for s in m.siblings(op)} == {name}, k
    al.save_plan(out, tmp_path / "p.json")
    back = al.load_plan(tmp_path / "p.json", plan.graph, plan.cluster, model=model)
    assert back.cost.step_time_s == out.cost.step_time_s and back.pins == out.pins
    assert json.loads((tmp_path / "p.json").read_text())["version"] == 2  # no split layer: still a version-2 file
    # The model itself, as auto_plan takes it, is enough (it is traced and is the model).
    again = al.load_plan(tmp_path / "p.json", model)
    assert again.cost.step_time_s == out.cost.step_time_s and again.pins == out.pins


def test_split_layer_pins_survive_save_load_and_resolve(deep, tmp_path):
    model, plan = deep
    full = _real_dot(plan, "layer_13")
    name = plan.layer_alternatives(full)[-1].strategy
    split = plan.with_layer_choice(full, name)
    path = tmp_path / "split.json"
    al.save_plan(split, path)
    data = json.loads(path.read_text())
    assert data["version"] == planschema.SPLIT_VERSION and data["layer_pins"] == {str(full): name}
    back = al.load_plan(path, plan.graph, plan.cluster, model=model)
    assert back.layer_pins == {full: name} and back.cost.step_time_s == split.cost.step_time_s
    assert back.full_choice(full).name == name
    # A re-solve keeps the split layer's pin and prices it (resolving the unsplit plan would not).
    out = al.resolve(split)
    assert out.layer_pins == {full: name} and out.full_choice(full).name == name
    assert without_layer_pin(out, full).cost.step_time_s < out.cost.step_time_s  # the split layer is priced
    # A file naming an operator the model does not have is refused, in one sentence naming the field.
    data["layer_pins"] = {str(10**7): name}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="layer_pins name operator 10000000"):
        al.load_plan(path, plan.graph, plan.cluster, model=model)
    data["layer_pins"] = {str(full): "S9 nonsense"}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not one of its strategies"):
        al.load_plan(path, plan.graph, plan.cluster, model=model)


def test_unpinning_a_split_layer_rejoins_its_group(deep):
    _, plan = deep
    full = _real_dot(plan, "layer_13")
    split = plan.with_layer_choice(full, plan.layer_alternatives(full)[-1].strategy)
    back = without_layer_pin(split, full)
    assert back.layer_pins == {} and back.cost.step_time_s == plan.cost.step_time_s
    assert [g.label for g in layer_groups(back)] == [g.label for g in layer_groups(plan)]
    with pytest.raises(ValueError, match="no strategy of its own"):
        without_layer_pin(back, full)
    assert group_of_layer(plan, "layer_13").names[0] == "layer_0"


@pytest.mark.slow
def test_a_what_if_replan_keeps_split_layer_pins_or_says_why_not(deep):
    from autopar_lab.pins import keep_pins

    model, plan = deep
    full = _real_dot(plan, "layer_13")
    name = next(a.strategy for a in plan.layer_alternatives(full) if "S1" in a.strategy.split(" = ")[0])
    split = plan.with_layer_choice(full, name)
    kept, messages = keep_pins(plan, split)  # the same cluster: the pin holds
    assert messages == [] and kept.layer_pins == {full: name} and kept.full_choice(full).name == name
    # One device: no mesh axis to shard over, so no strategy splits a tensor; the pin is dropped, saying so.
    one = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=1)
    fresh = al.megatron_plan(model, one, dp=1, tp=1, pp=1, microbatches=4)
    out, messages = keep_pins(fresh, split)
    assert out.layer_pins == {} and len(messages) == 1
    assert f"#{full} dot_general" in messages[0] and "in layer_13" in messages[0]
    assert "in its layer" in messages[0] and "no logical mesh of the new cluster" in messages[0]


def test_exported_code_shards_a_split_layer_by_its_own_strategy(deep):
    from autopar_lab.export import activation_specs

    _, plan = deep
    full = _real_dot(plan, "layer_13")
    assert plan.graph.op(full).role == "forward"
    now = str(plan.full_choice(full).out_specs[0])
    name = next(a.strategy for a in plan.layer_alternatives(full) if a.spec != now)
    split = plan.with_layer_choice(full, name)
    node = plan.graph.op(full)
    key = f"{node.scope or node.layer} dot_general#0 -> {tuple(node.out_shapes[0])}"
    before, after = activation_specs(plan, 1), activation_specs(split, 1)
    assert str(before[key]) == now and str(after[key]) == str(split.full_choice(full).out_specs[0]) != now
    assert {k: str(v) for k, v in before.items() if k != key} == {k: str(v) for k, v in after.items() if k != key}


def test_a_split_layer_in_a_later_chunk_of_an_interleaved_stage_is_priced_there():
    """Interleaved: stage 0 runs layers 0-2 and 6-7; layer_5 (index 6) split off and given a dearer strategy makes
    stage 0's forward dearer by its layer's change (its 1F1B range, 0-4, does not hold it)."""
    m = al.models.get("gpt-tiny", num_layers=8, batch_size=8, hidden_size=256, seq_len=64, vocab_size=128)
    c = al.Cluster.preset("p3.16xlarge", hosts=1)
    q = al.megatron_plan(m, c, dp=2, tp=2, pp=2, microbatches=4, sharding="ilp").with_schedule(
        "interleaved", virtual_stages=2)  # the ILP's sharding: stage 0 is the busier one
    g = q.graph
    full = next(o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).layer == "layer_5")
    k = list(q.layer_names).index("layer_5")
    assert q.full_stage_of(full) == 0 and any(a <= k <= b for a, b in q.stages[0].chunks)
    assert not q.stages[0].layers[0] <= k <= q.stages[0].layers[1]
    dear = max(q.layer_alternatives(full), key=lambda a: a.delta_s).strategy
    r = q.with_layer_choice(full, dear)
    assert r.stages[0].fwd_s > q.stages[0].fwd_s
    assert (r.stages[1].fwd_s, r.stages[1].bwd_s) == (q.stages[1].fwd_s, q.stages[1].bwd_s)
