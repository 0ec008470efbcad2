"""Overrides on a deep model tell the truth, with one operator id (issue 12, item 2; issue 32, item 1).

A 24-layer GPT is planned on its 4-layer copy: every block is priced by one layer of the copy. Every operator a user
passes is one of ``plan.graph`` (the model's own, as every view shows it), whatever its layer; an override applies to
every block that shares its solution (``scope="shared"``, on every stage that runs one) or to its layer alone
(``scope="layer"``); either way the step time moves by exactly the delta the alternatives predicted, the pins
survive save/load and resolve, and the views say the real layer, stage and spec.
"""

import dataclasses
import json

import pytest

import autopar_lab as al
from autopar_lab import operators, planschema
from autopar_lab.layergroups import group_of_layer, layer_groups
from autopar_lab.planvalues import Pin, layer_scoped
from autopar_lab.pricing.incremental import split_layer_costs
from autopar_lab.pricing.layers import layer_costs


@pytest.fixture(scope="module")
def deep(deep_gpt24_megatron):
    """24 blocks (GPT-1.3B's depth) on 2 hosts x 4 devices: layers 0..12 on stage 0, 13..25 on stage 1 (conftest's
    plan, shared with the widget tests a worker runs)."""
    model, plan = deep_gpt24_megatron
    assert plan.table.solve_graph is not plan.graph and len(plan.layer_names) == 26
    return model, plan


def _real_dot(plan, layer, k=0):
    g = plan.graph
    return [o for o in g.ops_in_layer(layer) if g.op(o).primitive == "dot_general"][k]


def _siblings(plan, op):
    """The stand-in of ``op`` and its siblings in the graph the plan was solved on (internals, to check them)."""
    m = operators.op_map(plan)
    return m.siblings(m.representative(operators.stand_in(plan, op)))


def _moves_by_its_delta(plan, op, scope):
    """Every alternative of ``op`` applied: the step time moves by exactly its predicted delta; the dearest plan."""
    alts = plan.alternatives(op, scope=scope)
    assert len(alts) >= 3 and sum(a.delta_s != 0 for a in alts) >= 2
    for a in alts:
        new = plan.with_choice(op, a.strategy, scope=scope)
        assert new.cost.step_time_s - plan.cost.step_time_s == a.delta_s  # to the bit: one pricing path
        assert new.choice(op).name == a.strategy and plan.diff(new)["step_time_delta_s"] == a.delta_s
    worst = alts[-1]
    assert worst.delta_s > 0
    return plan.with_choice(op, worst.strategy, scope=scope), worst


def test_an_operator_of_a_deep_layer_is_accepted_everywhere(deep):
    """The issue's case: ``op`` from ``plan.graph.ops_in_layer("layer_20")`` was refused ("operator ... is not in
    this plan's graph (ids run 0..N)", N the copy's); now every method takes it, and the shared override is the
    default scope."""
    _, plan = deep
    op = _real_dot(plan, "layer_20")
    assert op >= len(plan.op_graph.ops)  # beyond the copy's ids: the case that was refused
    assert plan.stage_of(op) == 1 and plan.stages_of(op) == [0, 1]  # its layer on S1, its solution on both
    assert plan.choice(op).name == plan.choice(_real_dot(plan, "layer_0")).name  # one solution for the blocks
    new, worst = _moves_by_its_delta(plan, op, "shared")
    first = _real_dot(plan, "layer_0")
    # One pin, of the shared solution, recorded under its place in the first block; it holds op's layer too.
    assert new.pins == {first: Pin(worst.strategy, "shared")} and new.pin_of(op) == new.pins[first]
    for name in ("layer_0", "layer_12", "layer_13", "layer_23"):  # every block on both stages runs it
        assert new.choice(_real_dot(plan, name)).name == worst.strategy
    for k in (0, 1):  # ... because every sibling in the copy runs it on each stage
        assert {new.stages[k].intra.strategies[s].name for s in _siblings(plan, op)} == {worst.strategy}
    assert {d["op"] for d in plan.diff(new)["ops"]} >= {first, op}
    back = new.without_pin(op)  # the shared pin, found from any block's operator
    assert back.pins == {} and back.choice(op).name == worst.strategy  # the strategy stays until a re-solve
    # The session and its selection take it as well.
    s = al.Session(plan)
    assert s.select(op=op).layer == "layer_20" and s.selection.stage == 1
    assert s.set_choice(op, worst.strategy).cost.step_time_s == new.cost.step_time_s


def test_bad_operators_and_scopes_get_one_sentence(deep):
    _, plan = deep
    n = len(plan.graph.ops)
    with pytest.raises(ValueError, match=rf"operator {n} is not in this plan's graph \(ids run 0..{n - 1}"):
        plan.alternatives(n)
    with pytest.raises(ValueError, match="scope must be 'shared' .* or 'layer'"):
        plan.with_choice(_real_dot(plan, "layer_3"), "RRR", scope="all")
    with pytest.raises(ValueError, match="is not pinned"):
        plan.without_pin(_real_dot(plan, "layer_3"))


def test_a_split_layer_is_priced_alone_by_its_own_strategy(deep):
    _, plan = deep
    k13 = plan.layer_names.index("layer_13")
    full = _real_dot(plan, "layer_13")
    new, worst = _moves_by_its_delta(plan, full, "layer")
    assert new.pins == {full: Pin(worst.strategy, "layer")} and new.pin_of(full) == new.pins[full]
    other = _real_dot(plan, "layer_12")
    assert new.choice(other).name == plan.choice(other).name  # the rest of the group is unchanged
    # Only layer_13's cost moved, and it is its copy layer's cost (layer_costs over the whole copy, not the
    # incremental path) with its stand-in run by the pinned strategy on stage 1's mesh.
    intra = plan.stages[1].intra
    cache = plan.table.strategy_cache(intra.mesh)
    before = plan.stages[1].layer_costs
    after = split_layer_costs(plan.table, intra, before, (13, 25), layer_scoped(new.pins), cache)
    assert [k for k in range(26) if before[k] != after[k]] == [k13]
    sop = operators.stand_in(plan, full)
    pinned = next(s for s in cache.strategies(plan.op_graph.op(sop)) if s.name == worst.strategy)
    view = dataclasses.replace(intra, strategies={**intra.strategies, sop: pinned})
    truth = layer_costs(plan.op_graph, view, list(plan.op_graph.layers), cache=cache)[plan.table.layer_map[k13]]
    assert after[k13] == truth
    # ... and the stage was priced from it (stage 0 untouched).
    assert new.stages[1].compute_s == sum(c.compute_s for c in after[13:26])
    assert new.stages[0] == plan.stages[0] and new.stages[1].fwd_s > plan.stages[1].fwd_s
    # The split layer is a group of its own; the others still share one solution.
    labels = [grp.label for grp in layer_groups(new)]
    assert "layer_13 (split from its group)" in labels
    assert "layer_0..23 but layer_13 (×23, one solution; S0: layer_0..11, S1: layer_12..23)" in labels


def test_a_shared_override_after_a_split_leaves_the_split_layer_alone(deep):
    _, plan = deep
    a = _real_dot(plan, "layer_13")
    split = plan.with_choice(a, plan.alternatives(a, scope="layer")[-1].strategy, scope="layer")
    # Another operator of the same layer, changed for the shared solution (asked from the split layer itself):
    # layer_13 keeps its strategy (its own from its split on), every other block takes the new one.
    b = _real_dot(plan, "layer_13", 1)
    old = split.choice(b).name
    alts = split.alternatives(b)
    new_name = next(x.strategy for x in alts if x.strategy != old)
    new = split.with_choice(b, new_name)
    assert split.alternatives(b) == alts
    assert new.choice(b).name == old and new.pins[b] == Pin(old, "layer")
    assert new.choice(_real_dot(plan, "layer_12", 1)).name == new_name
    assert new.pins[_real_dot(plan, "layer_0", 1)] == Pin(new_name, "shared")
    delta = next(x.delta_s for x in alts if x.strategy == new_name)
    assert new.cost.step_time_s - split.cost.step_time_s == delta


def test_one_map_holds_a_layers_pin_and_its_solutions_pin_of_one_place(deep):
    """Pinning the first block's operator alone while the solution is pinned there moves the shared pin on to the
    next block without a pin of its own there: both pins hold, one map."""
    _, plan = deep
    first, second = _real_dot(plan, "layer_0"), _real_dot(plan, "layer_1")
    shared = plan.with_choice(first, plan.alternatives(first)[-1].strategy)
    assert set(shared.pins) == {first}
    own = plan.alternatives(first, scope="layer")[1].strategy
    both = shared.with_choice(first, own, scope="layer")
    assert both.pins == {first: Pin(own, "layer"), second: shared.pins[first]}
    assert both.choice(first).name == own and both.choice(second).name == shared.pins[first].strategy
    # Removing the layer's pin puts the shared pin back under the first block, as a fresh plan records it.
    back = both.without_pin(first, scope="layer")
    assert back.pins == shared.pins and back.cost.step_time_s == shared.cost.step_time_s


def test_an_override_of_a_group_spanning_two_meshes(deep):
    _, plan = deep
    two = plan.with_stages(logical_meshes=[(2, 2), (1, 4)])  # stage 0 sees its 4 devices as 2x2
    op = _real_dot(two, "layer_1")
    sop = operators.stand_in(two, op)
    alts = two.alternatives(op)
    names0 = {s.name for s in two.table.strategy_cache(two.stages[0].intra.mesh).strategies(two.op_graph.op(sop))}
    names1 = {s.name for s in two.table.strategy_cache(two.stages[1].intra.mesh).strategies(two.op_graph.op(sop))}
    assert {a.strategy for a in alts} == names0 & names1  # only what every stage running a block can do
    a = alts[-1]
    new = two.with_choice(op, a.strategy)
    assert new.cost.step_time_s - two.cost.step_time_s == a.delta_s
    assert new.stages[0].intra.strategies[sop].name == new.stages[1].intra.strategies[sop].name == a.strategy
    assert names0 - names1  # a 2x2 mesh has strategies (over mesh axis 0) that a 1x4 one has not
    with pytest.raises(ValueError, match="stage 1's 1x4 logical mesh"):
        two.with_choice(op, next(iter(names0 - names1)))


def test_a_layer_that_shares_nothing_is_overridden_as_itself(deep):
    _, plan = deep
    full = _real_dot(plan, "head")
    alts = plan.alternatives(full, scope="layer")
    assert alts == plan.alternatives(full)
    new = plan.with_choice(full, alts[-1].strategy, scope="layer")
    assert new.pins == {full: Pin(alts[-1].strategy, "shared")}


@pytest.mark.slow
def test_resolve_honours_a_pin_on_any_block_and_files_keep_it(deep, tmp_path):
    # The lead's bug on main: a pin on the copy's first block came back from resolve run by another strategy, and
    # the plan file then refused to load ("a pin names the strategy the plan chose").
    model, plan = deep
    op = _real_dot(plan, "layer_5")
    name = plan.alternatives(op)[-1].strategy
    pinned = dataclasses.replace(plan, pins={op: name})  # a name alone is a shared pin, on any block's operator
    assert pinned.pins == {op: Pin(name, "shared")}
    out = al.resolve(pinned)
    assert out.pins == {_real_dot(plan, "layer_0"): Pin(name, "shared")}  # recorded where the rules say
    for k, st in enumerate(out.stages):
        assert {st.intra.strategies[s].name for s in _siblings(plan, op)} == {name}, k
    al.save_plan(out, tmp_path / "p.json")
    back = al.load_plan(tmp_path / "p.json", plan.graph, plan.cluster, model=model)
    assert back.cost.step_time_s == out.cost.step_time_s and back.pins == out.pins
    assert json.loads((tmp_path / "p.json").read_text())["version"] == planschema.VERSION == 4
    # The model itself, as auto_plan takes it, is enough (it is traced and is the model).
    again = al.load_plan(tmp_path / "p.json", model)
    assert again.cost.step_time_s == out.cost.step_time_s and again.pins == out.pins


def test_split_layer_pins_survive_save_load_and_resolve(deep, tmp_path):
    model, plan = deep
    full = _real_dot(plan, "layer_13")
    name = plan.alternatives(full, scope="layer")[-1].strategy
    split = plan.with_choice(full, name, scope="layer")
    path = tmp_path / "split.json"
    al.save_plan(split, path)
    data = json.loads(path.read_text())
    assert data["version"] == 4 and data["pins"] == {str(full): {"strategy": name, "scope": "layer"}}
    back = al.load_plan(path, plan.graph, plan.cluster, model=model)
    assert back.pins == split.pins and back.cost.step_time_s == split.cost.step_time_s
    assert back.choice(full).name == name
    # A re-solve keeps the split layer's pin and prices it (resolving the unsplit plan would not).
    out = al.resolve(split)
    assert out.pins == split.pins and out.choice(full).name == name
    assert out.without_pin(full).cost.step_time_s < out.cost.step_time_s  # the split layer is priced
    # A file naming an operator the model does not have is refused, in one sentence naming the field.
    data["pins"] = {str(10**7): {"strategy": name, "scope": "layer"}}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="pins name operator 10000000, which this model's graph does not have"):
        al.load_plan(path, plan.graph, plan.cluster, model=model)
    data["pins"] = {str(full): {"strategy": "S9 nonsense", "scope": "layer"}}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not one of its strategies"):
        al.load_plan(path, plan.graph, plan.cluster, model=model)
    data["pins"] = {str(full): {"strategy": name, "scope": "everywhere"}}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"pins\[\d+\]'s scope must be 'shared' or 'layer'"):
        al.load_plan(path, plan.graph, plan.cluster, model=model)


def test_a_version_3_file_with_pins_by_the_copys_operators_loads_converted(deep, tmp_path):
    """Before version 4 a file named a shared pin by the copy's operator (any sibling) and kept a split layer's pins
    apart (``layer_pins``, by the model's operators): it loads, its pins converted to the model's operators."""
    model, plan = deep
    a, b = _real_dot(plan, "layer_7"), _real_dot(plan, "layer_13", 1)
    edited = plan.with_choice(a, plan.alternatives(a)[-1].strategy)
    edited = edited.with_choice(b, edited.alternatives(b, scope="layer")[-1].strategy, scope="layer")
    path = tmp_path / "v3.json"
    al.save_plan(edited, path)
    data = json.loads(path.read_text())
    copy_op = _siblings(plan, a)[0]  # the copy's first block: an old file could name any sibling
    assert copy_op != operators.stand_in(plan, a)
    shared_key = _real_dot(plan, "layer_0")
    data.update(version=3, pins={str(copy_op): edited.pins[shared_key].strategy},
                layer_pins={str(b): edited.pins[b].strategy})
    path.write_text(json.dumps(data))
    back = al.load_plan(path, plan.graph, plan.cluster, model=model)
    assert back.pins == edited.pins and back.cost.step_time_s == edited.cost.step_time_s
    # The old form's own checks still hold: a pin must name the strategy the plan chose.
    data["pins"] = {str(copy_op): "S9 nonsense"}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"pins\[{copy_op}\] is 'S9 nonsense' but the plan runs"):
        al.load_plan(path, plan.graph, plan.cluster, model=model)


def test_unpinning_a_split_layer_rejoins_its_group(deep):
    _, plan = deep
    full = _real_dot(plan, "layer_13")
    split = plan.with_choice(full, plan.alternatives(full, scope="layer")[-1].strategy, scope="layer")
    back = split.without_pin(full)
    assert back.pins == {} and back.cost.step_time_s == plan.cost.step_time_s
    assert [g.label for g in layer_groups(back)] == [g.label for g in layer_groups(plan)]
    with pytest.raises(ValueError, match="is not pinned"):
        back.without_pin(full)
    assert group_of_layer(plan, "layer_13").names[0] == "layer_0"


@pytest.mark.slow
def test_a_what_if_replan_keeps_split_layer_pins_or_says_why_not(deep):
    from autopar_lab.pins import keep_pins

    model, plan = deep
    full = _real_dot(plan, "layer_13")
    name = next(a.strategy for a in plan.alternatives(full, scope="layer") if "S1" in a.strategy.split(" = ")[0])
    split = plan.with_choice(full, name, scope="layer")
    kept, messages = keep_pins(plan, split)  # the same cluster: the pin holds
    assert messages == [] and kept.pins == split.pins and kept.choice(full).name == name
    # One device: no mesh axis to shard over, so no strategy splits a tensor; the pin is dropped, saying so.
    one = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=1)
    fresh = al.megatron_plan(model, one, dp=1, tp=1, pp=1, microbatches=4)
    out, messages = keep_pins(fresh, split)
    assert out.pins == {} and len(messages) == 1
    assert f"#{full} dot_general" in messages[0] and "in layer_13" in messages[0]
    assert "in its layer" in messages[0] and "no logical mesh of the new cluster" in messages[0]


def test_exported_code_shards_a_split_layer_by_its_own_strategy(deep):
    from autopar_lab.export import activation_specs

    _, plan = deep
    full = _real_dot(plan, "layer_13")
    assert plan.graph.op(full).role == "forward"
    now = str(plan.choice(full).out_specs[0])
    name = next(a.strategy for a in plan.alternatives(full, scope="layer") if a.spec != now)
    split = plan.with_choice(full, name, scope="layer")
    node = plan.graph.op(full)
    key = f"{node.scope or node.layer} dot_general#0 -> {tuple(node.out_shapes[0])}"
    before, after = activation_specs(plan, 1), activation_specs(split, 1)
    assert str(before[key]) == now and str(after[key]) == str(split.choice(full).out_specs[0]) != now
    assert {k: str(v) for k, v in before.items() if k != key} == {k: str(v) for k, v in after.items() if k != key}


def test_a_split_layer_in_a_later_chunk_of_an_interleaved_stage_is_priced_there():
    """Interleaved: stage 0 runs layers 0-2 and 6-7; layer_5 (index 6) split off and given a dearer strategy makes
    stage 0's forward dearer by its layer's change (its 1F1B range, 0-4, does not hold it)."""
    m = al.models.get("gpt-tiny", num_layers=8, batch_size=8, hidden_size=256, seq_len=64, vocab_size=128)
    c = al.Cluster.preset("p3.16xlarge", hosts=1)
    q = al.megatron_plan(m, c, dp=2, tp=2, pp=2, microbatches=4, sharding="ilp").with_schedule(
        "interleaved", virtual_stages=2)  # the ILP's sharding: stage 0 is the busier one
    full = _real_dot(q, "layer_5")
    k = list(q.layer_names).index("layer_5")
    assert q.stage_of(full) == 0 and any(a <= k <= b for a, b in q.stages[0].chunks)
    assert not q.stages[0].layers[0] <= k <= q.stages[0].layers[1]
    dear = max(q.alternatives(full, scope="layer"), key=lambda a: a.delta_s).strategy
    r = q.with_choice(full, dear, scope="layer")
    assert r.stages[0].fwd_s > q.stages[0].fwd_s
    assert (r.stages[1].fwd_s, r.stages[1].bwd_s) == (q.stages[1].fwd_s, q.stages[1].bwd_s)


# --- the issue's cases, at the size users plan them ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name, get_kw, cluster, layout", [
    # GPT-1.3B (24 blocks) on two p3.16xlarge hosts, a block of stage 1 asked by the full graph's id
    ("gpt-1.3b", dict(batch_size=16, seq_len=128), ("p3.16xlarge", 2), dict(dp=1, tp=8, pp=2, microbatches=4)),
    # Llama 3 8B (32 blocks) with a small batch on one DGX H100
    ("llama3-8b", dict(batch_size=8, seq_len=128), ("dgx-h100", 1), dict(dp=1, tp=8, pp=1, microbatches=1)),
])
def test_the_issues_models_take_an_operator_of_layer_20(name, get_kw, cluster, layout):
    model = al.models.get(name, **get_kw)
    plan = al.megatron_plan(model, al.Cluster.preset(cluster[0], hosts=cluster[1]), **layout)
    assert plan.op_graph is not plan.graph and len(plan.op_graph.layers) == 6  # planned on its 4-block copy
    g = plan.graph
    op = next(o for o in g.ops_in_layer("layer_20") if g.op(o).primitive == "dot_general")
    assert op >= len(plan.op_graph.ops)  # an id the copy does not have: refused before
    for scope in ("shared", "layer"):
        alts = plan.alternatives(op, scope=scope)
        assert len(alts) >= 2 and any(a.delta_s != 0 for a in alts)
        for a in (alts[0], alts[-1]):
            new = plan.with_choice(op, a.strategy, scope=scope)
            assert new.cost.step_time_s - plan.cost.step_time_s == a.delta_s
            assert new.choice(op).name == a.strategy
