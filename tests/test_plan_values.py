"""Plans as values: overrides re-estimated, save/load round trip with validation, export to JAX code."""

import json

import numpy as np
import pytest

import autopar_lab as al
from autopar_lab import planfile
from autopar_lab.cluster import Cluster
from autopar_lab.planner import megatron_plan


@pytest.fixture(scope="module")
def plan(model, cluster):
    return megatron_plan(model, cluster, dp=2, tp=2, pp=1)


@pytest.fixture(scope="module")
def plan2(plan, cluster):
    # Two stages, priced from the same graph (its own cost table: another mesh shape).
    return megatron_plan(plan.graph, cluster, dp=1, tp=2, pp=2, microbatches=2)


def _dot(g, layer="layer_0", k=0):
    return [o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).layer == layer][k]


def test_with_choice_is_pure_and_reestimated(plan):
    op = _dot(plan.graph)
    before = plan.cost.step_time_s
    alts = plan.alternatives(op)
    assert alts == sorted(alts, key=lambda a: a.delta_s)
    assert alts[0].delta_s <= 0.0 <= alts[-1].delta_s
    worst = alts[-1]
    assert worst.delta_s > 0
    q = plan.with_choice(op, worst.strategy)
    assert plan.cost.step_time_s == before and plan.pins == {}  # the original is untouched
    assert q.choice(op).name == worst.strategy and plan.choice(op).name != worst.strategy
    assert q.pins == {op: (worst.strategy, "shared")}
    assert q.cost.step_time_s == pytest.approx(before + worst.delta_s, rel=0, abs=1e-15)
    # Overriding back to the original strategy gives the original cost exactly.
    back = q.with_choice(op, plan.choice(op))
    assert back.cost.step_time_s == before
    # By output spec string.
    r = plan.with_choice(op, worst.spec)
    assert str(r.choice(op).out_specs[0]) == worst.spec


def test_invalid_choice_names_operator_and_choices(plan):
    op = _dot(plan.graph)
    with pytest.raises(ValueError, match=rf"#{op} dot_general.*choose one of: .*RRR"):
        plan.with_choice(op, "S7R")
    assert plan.pins == {}


def test_override_reprices_only_its_stage(plan2):
    op = _dot(plan2.graph, "layer_1")
    assert plan2.stage_of(op) == 1 and plan2.stage_of(_dot(plan2.graph, "layer_0")) == 0
    alt = plan2.alternatives(op)[-1]
    q = plan2.with_choice(op, alt.strategy)
    assert q.stages[0].intra is plan2.stages[0].intra and q.stages[0].fwd_s == plan2.stages[0].fwd_s
    assert q.stages[1].fwd_s + q.stages[1].bwd_s > plan2.stages[1].fwd_s + plan2.stages[1].bwd_s
    assert q.cost.step_time_s > plan2.cost.step_time_s


def test_with_microbatches(plan2):
    q = plan2.with_microbatches(4)
    assert q.microbatches == 4 and plan2.microbatches == 2
    assert [s.intra for s in q.stages] == [s.intra for s in plan2.stages]
    assert q.with_microbatches(2).cost.step_time_s == plan2.cost.step_time_s
    with pytest.raises(ValueError, match="divisor"):
        plan2.with_microbatches(3)


def test_diff(plan):
    op = _dot(plan.graph)
    alt = plan.alternatives(op)[-1]
    q = plan.with_choice(op, alt.strategy).with_microbatches(2)
    d = plan.diff(q)
    assert d["ops"] == [{"op": op, "before": plan.choice(op).name, "after": alt.strategy}]
    assert d["microbatches"] == (1, 2)
    assert d["step_time_delta_s"] == q.cost.step_time_s - plan.cost.step_time_s
    assert any(s["stage"] == 0 and s["field"] == "fwd_s" for s in d["stages"])
    assert plan.diff(plan)["ops"] == [] and plan.diff(plan)["step_time_delta_s"] == 0


def test_save_load_round_trip(plan, plan2, cluster, tmp_path):
    op = _dot(plan2.graph, "layer_1")
    edited = plan2.with_choice(op, plan2.alternatives(op)[-1].strategy)
    for p in (plan, plan2, edited):
        path = tmp_path / "plan.json"
        al.save_plan(p, path)
        data = json.loads(path.read_text())
        assert data["version"] == planfile.VERSION and data["graph_fingerprint"] == p.graph.fingerprint
        back = al.load_plan(path, p.graph, cluster)
        assert back.cost.step_time_s == p.cost.step_time_s  # to the last bit
        assert back.cost.peak_mem_bytes == p.cost.peak_mem_bytes
        assert back.stages == p.stages and back.pins == p.pins
        assert all(back.choice(o) == p.choice(o) for o in p.graph.ops)
    assert back.pins == {op: (edited.choice(op).name, "shared")}


def test_load_refuses_other_graph_cluster_and_broken_files(plan, cluster, tmp_path):
    path = tmp_path / "plan.json"
    al.save_plan(plan, path)
    other_graph = al.models.get("gpt-tiny", batch_size=4, dtype="float32").trace()
    with pytest.raises(ValueError, match="another graph"):
        al.load_plan(path, other_graph, cluster)
    with pytest.raises(ValueError, match="another cluster"):
        al.load_plan(path, plan.graph, cluster.with_(inter_host_bandwidth=1e9))
    good = json.loads(path.read_text())

    def broken(edit):
        data = json.loads(json.dumps(good))
        edit(data)
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match="plan file") as e:
            al.load_plan(path, plan.graph, cluster)
        return str(e.value)

    assert "'stages' is missing" in broken(lambda d: d.pop("stages"))
    assert "version" in broken(lambda d: d.update(version=99))
    msg = broken(lambda d: d["choices"].update({"0": "no such strategy"}))
    assert "'no such strategy'" in msg and "#0 parameter" in msg
    assert "layers" in broken(lambda d: d["stages"][0].update(layers=[1, 3]))
    broken(lambda d: d["stages"][0].update(logical_mesh="2x2"))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        al.load_plan(path, plan.graph, cluster)


@pytest.mark.slow  # XLA compiles the sharded and the unsharded step: most of a minute on two shared cores
def test_to_jax_code_runs_and_matches_unsharded_loss(model, plan):
    import jax

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (JAX_NUM_CPU_DEVICES=8)")
    g = plan.graph
    inputs = {g.tensor(g.op(o).outputs[0]).path: o for o in g.ops if g.op(o).primitive == "parameter"}
    # The ILP leaves inputs replicated here (slicing a replicated input is free); shard some by overrides so the
    # export has something to show: the batch over x, a weight's columns over y.
    edited = plan.with_choice(inputs["args[2]['tokens']"], "S0R").with_choice(inputs["args[2]['targets']"], "S0R")
    edited = edited.with_choice(inputs["args[0]['layers'][0]['fc1']['w']"], "RS1")
    plan = edited
    code = plan.to_jax_code()
    assert "jax.make_mesh((2, 2)" in code and "param_specs" in code and "batch_specs" in code
    ns: dict = {}
    exec(compile(code, "<plan>", "exec"), ns)
    mesh = ns["mesh"]
    assert dict(mesh.shape) == {"x": 2, "y": 2}
    params = {g.tensor(g.op(o).outputs[0]).path for o in g.ops if g.op(o).primitive == "parameter"
              and g.tensor(g.op(o).outputs[0]).kind == "param"}
    assert set(ns["param_specs"]) == params
    P = jax.sharding.PartitionSpec
    assert ns["batch_specs"] == {"args[2]['targets']": P("x", None), "args[2]['tokens']": P("x", None)}
    assert ns["param_specs"]["args[0]['layers'][0]['fc1']['w']"] == P(None, "y")
    args = model.init(0)
    shardings = ns["in_shardings_for"](*args)
    assert shardings[2]["tokens"].spec == P("x", None)
    _, _, loss = jax.jit(model.step_fn, in_shardings=shardings)(*args)
    _, _, ref = jax.jit(model.step_fn)(*args)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # The forward matmuls' constraints: one per forward dot_general of the graph, each applicable as written.
    acts = ns["activation_specs"]
    fwd_dots = [o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).role == "forward"]
    assert len(acts) == len(fwd_dots)
    key, spec = next(iter(acts.items()))
    shape = eval(key.rsplit("-> ", 1)[1])
    assert spec == plan.choice(fwd_dots[0]).out_specs[0].to_partition_spec(("x", "y"))
    y = jax.jit(lambda x: ns["constrain"](x * 2, key))(np.ones(shape, np.float32))
    assert y.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), len(shape))


def test_export_of_a_deep_model_planned_on_its_shallow_copy():
    # A zoo model deeper than 4 layers is planned on a 4-layer copy; its export still covers every input and forward
    # matmul of the full model, each with the strategy of the copy's operator at the same place in the layer that
    # priced it.
    from autopar_lab.export import activation_specs, input_specs

    deep = al.models.get("gpt-tiny", num_layers=7, batch_size=16, hidden_size=64, seq_len=32, vocab_size=128)
    p = al.auto_plan(deep, Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=4))
    table, g = p.table, p.graph
    assert table.solve_graph is not g and len(table.solve_graph.layers) < len(g.layers)
    specs = input_specs(p)
    inputs = [o for o in g.ops if g.op(o).primitive == "parameter"]
    assert sum(len(v) for v in specs.values()) == len(inputs)
    strategies = p.stages[0].intra.strategies
    sg = table.solve_graph
    for o in inputs:
        t = g.tensor(g.op(o).outputs[0])
        s = table.solve_op(o)
        assert sg.op(s).primitive == "parameter" and sg.op(s).out_shapes == g.op(o).out_shapes
        assert specs[t.kind][t.path] == strategies[s].out_specs[0]
    # Layers priced by the same layer of the copy get the same shardings (layers 2..5 all stand for one).
    same = [k for k, m in enumerate(table.layer_map) if m == table.layer_map[3]]
    assert len(same) >= 3
    per_layer = [[str(specs["param"][g.tensor(g.op(o).outputs[0]).path]) for o in g.ops_in_layer(g.layers[k])
                  if g.op(o).primitive == "parameter" and g.tensor(g.op(o).outputs[0]).kind == "param"] for k in same]
    assert all(x == per_layer[0] for x in per_layer)
    fwd_dots = [o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).role == "forward"]
    # every forward matmul is exported by the stage that runs it (the auto plan may be a pipeline)
    assert sum(len(activation_specs(p, k)) for k in range(len(p.stages))) == len(fwd_dots)
    ns: dict = {}
    exec(compile(p.to_jax_code(), "<plan>", "exec"), ns)
    assert set(ns["param_specs"]) == set(specs["param"])
