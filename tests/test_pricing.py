"""The pricing layer: a plan's price is a function of its decisions (price_plan), and the one operator map between a
deep model's full graph and the shallower copy it is solved on."""

import math

import pytest

import autopar_lab as al
from autopar_lab.plan import price_plan
from autopar_lab.pricing import CostTable, OpMap, stage_cost
from autopar_lab.pricing.opmap import plain_signature
from autopar_lab.pricing.price import table_of
from autopar_lab.pricing.stage import EDGE_FIELDS, SUM_FIELDS


@pytest.fixture(scope="module")
def auto(model, small_cluster):
    return al.auto_plan(model, small_cluster)


def _decisions(plan):
    return [(st.layers, st.submesh, st.logical_mesh, st.remat) for st in plan.stages]


def test_a_plan_priced_again_from_its_decisions_is_the_same_plan(auto):
    again = price_plan(auto.table, _decisions(auto), microbatches=auto.microbatches, schedule=auto.schedule,
                       stage_comm=auto.stage_comm, mem_limit_bytes=auto.cost.mem_limit_bytes, method=auto.method)
    assert again.cost == auto.cost and again.stages == auto.stages
    assert [st.intra for st in again.stages] == [st.intra for st in auto.stages]
    # Megatron's and remat's stages too, by hand against the stage-cost formula.
    m = al.megatron_plan(auto.graph, auto.cluster, dp=1, tp=2, pp=2, microbatches=2, remat=True, table=auto.table,
                         sharding="ilp")  # the sharding the table solved for those meshes
    t = auto.table
    for st in m.stages:
        costs, _ = t.mesh_costs(st.submesh, st.logical_mesh)
        part = costs[st.layers[0]:st.layers[1] + 1]
        totals = {f: math.fsum(getattr(c, f) for c in part) for f in SUM_FIELDS}
        # the boundaries: what the first layer receives, what the last sends
        totals.update({f: getattr(costs[st.layers[0] if f == "recv_bytes" else st.layers[1]], f) for f in EDGE_FIELDS})
        want = stage_cost(totals, t.entry_bytes(st.layers[0]), 2, 2, True, t.task_overhead_s(st.submesh))
        # a weight the stage reads but another stage holds (the tied embedding on the head's stage): held once
        entries: dict[int, list] = {}
        for c in part:
            for p, home, nbytes in c.shared:
                entries.setdefault(p, []).append((home, nbytes))
        held = sum(e[0][1] for e in entries.values() if not any(home for home, _ in e))
        assert (held > 0) == (st.layers[1] == len(m.layer_names) - 1)
        assert (st.fwd_s, st.bwd_s, st.static_bytes - held, st.act_bytes) == pytest.approx(want, rel=1e-12)
    # The step time is the simulated makespan, and the terms add up to it.
    c = m.cost
    assert c.step_time_s == c.timeline.makespan
    assert math.isclose(c.compute_s + c.comm_s + c.reshard_s + c.bubble_s, c.step_time_s, rel_tol=1e-9)


def test_price_plan_takes_other_shardings_and_keeps_what_it_is_given(auto):
    g = auto.op_graph
    dots = [o for o in g.ops if g.op(o).primitive == "dot_general"]
    op, other = next((o, a.strategy) for o in dots for a in auto.alternatives(o) if a.strategy != auto.choice(o).name)
    k = auto.stage_of(op)
    q = auto.with_choice(op, other)
    again = price_plan(q.table, _decisions(q), intras=[s.intra for s in q.stages], microbatches=q.microbatches,
                       mem_limit_bytes=q.cost.mem_limit_bytes, method=q.method, pins=q.pins, notes=("n",))
    assert again.cost == q.cost and again.pins == q.pins and again.notes == ("n",)
    # Layer costs computed from the IntraPlan equal the ones the override priced incrementally.
    assert list(again.stages[k].layer_costs) == list(q.stages[k].layer_costs)


def test_an_intraplan_priced_again_reuses_its_layer_costs(auto, monkeypatch):
    import autopar_lab.pricing.table as table_module

    g = auto.op_graph
    op = next(o for o in g.ops if g.op(o).primitive == "dot_general"
              and any(a.strategy != auto.choice(o).name for a in auto.alternatives(o)))
    other = next(a.strategy for a in auto.alternatives(op) if a.strategy != auto.choice(op).name)
    intra = auto.with_choice(op, other).stages[auto.stage_of(op)].intra   # not the table's own solution
    fresh = CostTable(auto.table.graph, auto.table.cluster).layer_costs_of(intra)
    table = CostTable(auto.table.graph, auto.table.cluster)
    calls = []
    real = table_module.layer_costs
    monkeypatch.setattr(table_module, "layer_costs", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = table.layer_costs_of(intra)
    first.append(None)                                  # the caller's list is its own
    again = table.layer_costs_of(intra)
    assert len(calls) == 1 and again == first[:-1] == fresh
    for _ in range(table_module.INTRA_COSTS_KEPT):      # only the most recent plans are kept
        table.layer_costs_of(auto.with_choice(op, other).stages[auto.stage_of(op)].intra)
    table.layer_costs_of(intra)
    assert len(calls) == table_module.INTRA_COSTS_KEPT + 2


def test_a_plan_without_a_table_says_so(auto):
    import dataclasses

    with pytest.raises(ValueError, match="no cost table"):
        table_of(dataclasses.replace(auto, table=None))


# ---------------------------------------------------------------------------------------------------------------
# The operator map, on a deep model (24 blocks) against its 4-block copy


@pytest.fixture(scope="module")
def deep_map():
    deep = al.models.get("gpt-tiny", batch_size=8, num_layers=24, dtype="float32").trace()
    small = al.models.get("gpt-tiny", batch_size=8, num_layers=4, dtype="float32").trace()
    return OpMap(deep, small)


def test_every_full_layer_is_priced_by_a_copy_layer_of_the_same_structure(deep_map):
    m = deep_map
    assert len(m.layer_map) == len(m.full_layer_names) == 26  # embedding, 24 blocks, head
    for k, j in enumerate(m.layer_map):
        assert plain_signature(m.graph, m.full_layer_names[k]) == \
            plain_signature(m.solve_graph, m.solve_layer_names[j])
    groups = m.layer_groups()
    assert [len(full) for _, full in groups] == [1, 24, 1]  # the 24 blocks share one solution
    block = groups[1][0]
    assert m.full_layers(block) == list(range(1, 25)) and m.sharing(7) == list(range(1, 25))
    assert m.solve_layer(0) != block and m.sharing(0) == [0]


def test_operators_map_both_ways(deep_map):
    m = deep_map
    full, small = m.graph, m.solve_graph
    assert len(m) == len(full.ops)  # every operator of the full graph has its stand-in
    for f, s in m.items():
        a, b = full.op(f), small.op(s)
        assert (a.primitive, a.out_shapes, a.role) == (b.primitive, b.out_shapes, b.role)
        assert f in m.full_ops(s)
    # A block operator of the copy stands for the operator at its place in each of the 24 blocks.
    op = full.ops_in_layer("layer_9")[3]
    s = m.solve_op(op)
    stands = m.full_ops(s)
    assert len(stands) == 24 and op in stands
    assert [full.op(o).layer for o in stands] == [f"layer_{i}" for i in range(24)]
    assert m.full_layers_of(s) == list(range(1, 25))
    # Inputs outside layers map by pytree path.
    for f, s in m.items():
        node = full.op(f)
        if node.layer is None and node.primitive == "parameter":
            assert full.tensor(node.outputs[0]).path == small.tensor(small.op(s).outputs[0]).path


def test_the_map_is_the_identity_without_a_copy(graph, cluster):
    m = CostTable(graph, cluster).op_map
    assert m.is_identity and m.solve_op(5) == 5 and m.full_ops(5) == [5]
    assert m.layer_groups() == [(k, [k]) for k in range(len(m.layer_map))]


def test_session_plan_and_export_share_the_table_s_map(small_cluster):
    from autopar_lab import operators
    from autopar_lab.export import strategy_lookup
    from autopar_lab.widgets.session import Session

    deep = al.models.get("gpt-tiny", batch_size=8, num_layers=6, dtype="float32")
    p = al.auto_plan(deep, small_cluster, microbatches=1)
    table = p.table
    assert table.solve_graph is not p.graph and operators.op_map(p) is table.op_map
    op = p.graph.ops_in_layer("layer_4")[2]  # an operator of the model's graph, as every one of them takes it
    s = table.solve_op(op)
    assert s == table.op_map.solve_op(op) and s < len(table.solve_graph.ops)
    # It runs in the stage of its own layer, by its stand-in's strategy there; the session and the export agree.
    k = next(j for j, st in enumerate(p.stages) if st.layers[0] <= 5 <= st.layers[1])  # layer_4 is layer 5
    assert p.stage_of(op) == k and p.choice(op) is p.stages[k].intra.strategies[s]
    assert Session(p).select(op=op).stage == k
    assert strategy_lookup(p, p.stages[k].intra)(op) is p.choice(op)
