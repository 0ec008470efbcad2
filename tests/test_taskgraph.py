"""The pipeline's task graph as a pure function of the plan and its graph (runtime.taskgraph): built with no device
and no compilation, every value a task receives is exported by a task it lists as a source, the operators of each
role are split over the tasks, layers stay on their stages, and the runtime runs exactly this graph."""

from __future__ import annotations

import jax
import pytest

import autopar_lab as al
from autopar_lab.graph.opgraph import BACKWARD, BATCH, FORWARD, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, UPDATE
from autopar_lab.runtime.taskgraph import task_graph


@pytest.fixture(scope="module")
def model():
    return al.models.get("gpt-tiny", batch_size=8, num_layers=2)


@pytest.fixture(scope="module")
def cluster():
    return al.Cluster.preset("cpu", hosts=1)


@pytest.fixture(scope="module")
def plan2(model, cluster):
    return al.megatron_plan(model, cluster, dp=2, tp=2, pp=2, microbatches=2)


@pytest.fixture()
def no_devices(monkeypatch):
    """Any use of devices or compilation fails the test."""
    def refuse(*_a, **_k):
        raise AssertionError("the task graph touched the devices or compiled a program")

    for name in ("devices", "local_devices", "device_put", "jit"):
        monkeypatch.setattr(jax, name, refuse)


def _roles(graph):
    return {role: {n.id for n in graph if n.role == role and n.primitive not in (INPUT_PRIMITIVE, OUTPUT_PRIMITIVE)}
            for role in (FORWARD, BACKWARD, UPDATE)}


def check_consistent(tg, graph):
    """What every pipeline's task graph must satisfy, whatever the plan."""
    for k in range(tg.num_stages):
        for kind in tg.kinds:
            srcs = tg.sources(k, kind)
            assert all(s != k for s, _ in srcs)  # sources are other stages' tasks
            for name in tg.inputs(k, kind):  # everything received is exported by a listed source
                src = tg.producer(name)
                assert src in srcs and name in tg.exports(*src)
    roles = _roles(graph)
    ran = {kind: set().union(*(tg.task_ops(k, kind) for k in range(tg.num_stages))) for kind in tg.kinds}
    # each forward operator runs in exactly one forward task; the backward's operators are split over the backward
    # tasks (and W tasks), with no operator in two stages' backward
    fwd_counts = [sum(op in tg.task_ops(k, "fwd") for k in range(tg.num_stages)) for op in roles[FORWARD]]
    assert set(fwd_counts) == {1}
    back = [op for k in range(tg.num_stages) for kind in tg.kinds[1:] for op in tg.task_ops(k, kind)
            if op in roles[BACKWARD]]
    assert sorted(back) == sorted(roles[BACKWARD])
    assert ran["fwd"] >= roles[FORWARD]
    # the updates run exactly the update operators some step output needs (an operator several stages' outputs
    # need runs on each of them)
    needed, todo = set(), [graph.op(o).inputs[0] for o in graph.ops if graph.op(o).primitive == OUTPUT_PRIMITIVE]
    while todo:
        p = graph.tensor(todo.pop()).producer
        if p in roles[UPDATE] and p not in needed:
            needed.add(p)
            todo.extend(graph.op(p).inputs)
    assert set(op for k in range(tg.num_stages) for op in tg.update_ops(k)) == needed
    # every non-batch step input is held by some stage
    held = {p for k in range(tg.num_stages) for p in tg.stage_state_paths(k)}
    inputs = {graph.tensor(t).path for t in graph.inputs if graph.tensor(t).kind != BATCH}
    assert held == inputs


def test_two_stages_without_devices(plan2, no_devices):
    tg = task_graph(plan2)
    assert tg.num_stages == 2 and tg.kinds == ("fwd", "bwd") and tg.device_stage == (0, 1)
    # activations go forward, their gradients back
    assert tg.sources(1, "fwd") == [(0, "fwd")] and tg.sources(0, "bwd") == [(1, "bwd")]
    # the first stage's forward needs no other task; the last stage's backward starts the gradients' way back (it
    # reads only what the first stage's forward passes on: the tied embedding)
    assert tg.sources(0, "fwd") == [] and all(kind == "fwd" for _, kind in tg.sources(1, "bwd"))
    check_consistent(tg, plan2.graph)
    # GPT's tied token embedding: owned by stage 0 (its first reader) and sent to stage 1's forward
    assert "args[0]['wte']" in tg.exports(0, "fwd") and "args[0]['wte']" in tg.inputs(1, "fwd")
    assert "args[0]['wte']" in tg.stage_state_paths(0)
    rows = tg.describe()
    assert [r["layers"] for r in rows] == [[plan2.layer_names[s.layers[0]], plan2.layer_names[s.layers[1]]]
                                           for s in plan2.stages]


def test_the_runtime_runs_this_graph(model, plan2):
    from autopar_lab.runtime.partition import split_stages

    if jax.device_count() < 8:
        pytest.skip("needs JAX_NUM_CPU_DEVICES=8")
    staged = split_stages(model, plan2, cache=False)
    tg = task_graph(plan2)
    for k in range(tg.num_stages):
        assert staged.update_ops(k) == tg.update_ops(k)
        assert staged.stage_state_paths(k) == tg.stage_state_paths(k)
        for kind in tg.kinds:
            assert staged.task_ops(k, kind) == tg.task_ops(k, kind)
            assert staged.sources(k, kind) == tg.sources(k, kind)
            assert staged.inputs(k, kind) == tg.inputs(k, kind)
            assert staged.exports(k, kind) == tg.exports(k, kind)


def test_zero_bubble_splits_each_backward_in_two(model, cluster, plan2, no_devices):
    zb = al.megatron_plan(model, cluster, dp=2, tp=2, pp=2, microbatches=2, schedule="zb-h1", table=plan2.table)
    tg, plain = task_graph(zb), task_graph(plan2)
    assert tg.kinds == ("fwd", "bwd", "wgrad")
    check_consistent(tg, zb.graph)
    for k in range(2):
        # B and W together are the 1F1B backward, and neither waits for a task the whole backward did not
        assert sorted(tg.task_ops(k, "bwd") + tg.task_ops(k, "wgrad")) == sorted(plain.task_ops(k, "bwd"))
        assert tg.task_ops(k, "wgrad")
        assert set(tg.sources(k, "bwd")) | set(tg.sources(k, "wgrad")) <= set(plain.sources(k, "bwd"))
        assert "wgrad" in tg.stash_readers(k, "fwd")  # W reads what the forward kept


def test_interleaved_chunks_are_stages_on_their_plan_stage_devices(model, cluster, plan2, no_devices):
    inter = al.megatron_plan(al.models.get("gpt-tiny", batch_size=8, num_layers=4), cluster, dp=2, tp=2, pp=2,
                             microbatches=2, schedule="interleaved", virtual_stages=2)
    tg = task_graph(inter)
    assert tg.num_stages == 4 and tg.device_stage == (0, 1, 0, 1)
    check_consistent(tg, inter.graph)
    # chunk c reads chunk c - 1's activations, whichever device runs it (chunk 2 wraps to stage 0's devices), and
    # only earlier chunks' forwards (the head also reads the tied embedding from chunk 0)
    for c in range(1, 4):
        assert (c - 1, "fwd") in tg.sources(c, "fwd")
        assert all(kind == "fwd" and s < c for s, kind in tg.sources(c, "fwd"))


def test_a_deep_model_keeps_every_layer_on_its_stage(cluster, no_devices):
    """24 layers planned on the model's shallow copy; the task graph is of the full graph the runtime captures."""
    deep = al.models.get("gpt-tiny", batch_size=8, num_layers=24)
    plan = al.megatron_plan(deep, cluster, dp=2, tp=1, pp=4, microbatches=4)
    assert len(plan.table.solve_graph.layers) < len(plan.graph.layers)  # solved on the copy
    tg = task_graph(plan)
    check_consistent(tg, plan.graph)
    stage_of = {plan.layer_names[i]: k for k, st in enumerate(plan.stages)
                for i in range(st.layers[0], st.layers[1] + 1)}
    for k in range(tg.num_stages):
        for kind in tg.kinds:
            for op in tg.task_ops(k, kind):
                layer = plan.graph.op(op).layer
                if layer in stage_of and plan.graph.op(op).role == FORWARD:
                    assert stage_of[layer] <= k  # a forward operator runs on its layer's stage or later
                elif layer in stage_of and kind == "bwd":
                    assert stage_of[layer] >= k  # a backward one on its layer's stage or earlier
    # a 24-layer pipeline of 4 stages: each stage's forward reads its neighbour's (and the head the tied embedding)
    for k in range(1, 4):
        assert (k - 1, "fwd") in tg.sources(k, "fwd") and set(tg.sources(k, "fwd")) <= {(k - 1, "fwd"), (0, "fwd")}
