"""A deep model's layer names, layer map and cut bytes derived from its 4- and 6-layer copies
(:mod:`autopar_lab.pricing.deepmap`) equal the full trace's; where the copies do not follow the pattern the table
traces the full model; the full graph (a lazy value, graph.capture.deferred_trace) is traced only when read, and
plans are the same either way. Whether a model is planned on copies is the model's to say (ModelSpec.copy_fn)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

import autopar_lab as al
from autopar_lab.graph.capture import deferred_trace
from autopar_lab.graph.opgraph import OpGraph
from autopar_lab.lazy import Lazy
from autopar_lab.pricing import CostTable
from autopar_lab.pricing.deepmap import derive
from autopar_lab.pricing.layers import cut_bytes
from autopar_lab.pricing.opmap import OpMap, layer_map_of, plain_signature
from autopar_lab.pricing.table import deferred_graph, planned_on_copies, solve_graph_for

CLUSTER = al.Cluster.preset("p3.16xlarge", hosts=2)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _full_values(model, small):
    """(layer names, layer map onto the 4-layer copy ``small``, cut bytes) read off the model's full trace."""
    full = model.trace()
    names = list(full.layers)
    return names, OpMap(full, small).layer_map, cut_bytes(full, names)


@pytest.fixture(scope="module")
def traced_24():
    """(model, table, plan): a 24-layer gpt-tiny's table on CLUSTER traced in full (trace="full") and its auto plan,
    built once: the reference three tests compare the derived table, its plan and the CLI's plan with (they read it
    only; each traced and planned its own before)."""
    model = al.models.get("gpt-tiny", num_layers=24)
    traced = CostTable.build(model, CLUSTER, trace="full")
    return model, traced, al.auto_plan(traced.graph, CLUSTER, table=traced)


@pytest.mark.parametrize("name, layers, overrides", [
    ("gpt-tiny", 5, {}),
    ("gpt-tiny", 7, {}),
    ("gpt-tiny", 24, {}),  # a deep model, as users plan them
    ("gpt-tiny", 9, {"num_heads": 2, "seq_len": 24}),
    ("mlp", 9, {}),
    ("mlp", 13, {"hidden_size": 48}),
])
def test_derived_names_layer_map_and_cut_bytes_equal_the_full_trace(name, layers, overrides):
    model = al.models.get(name, num_layers=layers, **overrides)
    small = solve_graph_for(model)
    deep = derive(layers, small, lambda: model.with_layers(6).trace())
    assert deep is not None
    names, layer_map, cuts = _full_values(model, small)
    assert list(deep.layer_names) == names and len(names) > layers
    assert list(deep.layer_map) == layer_map
    assert list(deep.cut_bytes) == cuts and len(cuts) == len(names) - 1 and min(cuts) > 0


def test_copies_that_break_the_pattern_give_no_derived_values():
    """A 6-layer copy of another width than the 4-layer one: the middle blocks' structure disagrees, so derive
    refuses (the table then traces the full model)."""
    model = al.models.get("gpt-tiny", num_layers=12)
    small = solve_graph_for(model)
    other = al.models.get("gpt-tiny", num_layers=6, hidden_size=2 * model.config.hidden_size)
    assert derive(12, small, other.trace) is None
    assert derive(4, small, lambda: pytest.fail("no 6-layer copy is needed for 4 layers")) is None


def test_the_model_says_whether_it_is_planned_on_copies():
    """Pricing asks the model (ModelSpec.repeated_layers / with_layers), not its family's name: a zoo model deeper
    than a copy is planned on its 4-layer copy; the same model without copies (copy_fn None, as a step of your own
    or a Wide-ResNet has) on its own graph, with the same layer names; Wide-ResNet says it has none."""
    import dataclasses

    deep = al.models.get("gpt-tiny", num_layers=6, hidden_size=32, seq_len=16, vocab_size=64)
    assert deep.repeated_layers == 6 and planned_on_copies(deep) and deep.with_layers(4).repeated_layers == 4
    assert not planned_on_copies(deep.with_layers(4))  # no deeper than a copy: its own graph
    own = dataclasses.replace(deep, copy_fn=None)
    assert own.repeated_layers is None and not planned_on_copies(own)
    with pytest.raises(ValueError, match="no copies"):
        own.with_layers(4)
    copied, alone = CostTable.build(deep, CLUSTER), CostTable.build(own, CLUSTER)
    assert len(copied.solve_graph.layers) == 6 and copied.solve_graph is not copied.graph  # 4 blocks + embed, head
    assert alone.solve_graph is alone.graph and alone.layer_names == copied.layer_names
    wide = al.models.get("wresnet-tiny")
    assert wide.config.num_layers > 4 and wide.repeated_layers is None and not planned_on_copies(wide)
    with pytest.raises(ValueError, match="Wide-ResNet has none"):
        al.models.with_layers(wide, 4)


def test_a_model_whose_copies_break_the_pattern_is_traced_in_full_with_the_same_table():
    """MoE layers alternate with dense ones, which the two copies' pattern does not describe: the table's graph is
    the full trace, and its layer map and cut bytes equal trace="full"'s."""
    model = al.models.get("moe-tiny", num_layers=8)
    graph, deep = deferred_graph(model, solve_graph_for(model))
    assert deep is None and not isinstance(graph, Lazy)
    auto, full = CostTable.build(model, CLUSTER), CostTable.build(model, CLUSTER, trace="full")
    assert not isinstance(auto.graph, Lazy)
    assert (auto.layer_names, auto.layer_map, auto.cut_bytes) == (full.layer_names, full.layer_map, full.cut_bytes)


def test_a_deep_table_does_not_trace_the_full_graph_until_read(traced_24):
    model, full, _ = traced_24
    table = CostTable.build(model, CLUSTER)
    assert isinstance(table.graph, Lazy) and not table.graph.is_filled
    assert not isinstance(full.graph, Lazy)
    assert (table.layer_names, table.layer_map, table.cut_bytes, table.batch_size) == \
        (full.layer_names, full.layer_map, full.cut_bytes, full.batch_size)
    assert table.graph.name == model.name and table.graph.layers == full.graph.layers
    assert not table.graph.is_filled
    # The same layer costs on a mesh, still without the full graph.
    assert table.mesh_costs((1, 8), (2, 4))[0] == full.mesh_costs((1, 8), (2, 4))[0]
    assert not table.graph.is_filled
    # Read, it is the full graph: operator lookups equal the traced table's.
    assert len(table.graph) == len(full.graph) and table.graph.fingerprint == full.graph.fingerprint
    assert table.graph.is_filled
    op = full.graph.ops_in_layer("layer_11")[7]
    assert table.solve_op(op) == full.solve_op(op) is not None
    assert dict(table.op_map.items()) == dict(full.op_map.items())


def test_plans_are_the_same_with_and_without_derived_values(traced_24):
    model, _, b = traced_24
    derived = CostTable.build(model, CLUSTER)
    a = al.auto_plan(derived.graph, CLUSTER, table=derived)
    assert not derived.graph.is_filled  # planning reads no operator of the full graph
    assert [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in a.stages] == \
        [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in b.stages]
    assert (a.microbatches, a.cost.step_time_s) == (b.microbatches, b.cost.step_time_s)
    assert len(a.stages) > 1


def test_the_cli_plans_a_deep_model_and_writes_a_plan_file_that_loads(tmp_path, traced_24):
    """The way a user runs it: the CLI from another directory, the plan file written (which reads the full graph)
    and loaded back; the same plan as a table traced in full."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "autopar_lab", "plan", "gpt-tiny", "--layers", "24", "--cluster",
                          "p3.16xlarge:2", "--json", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    model, _, plan = traced_24
    assert (len(report["stages"]), report["microbatches"]) == (len(plan.stages), plan.microbatches)
    loaded = al.load_plan(out, model)
    assert [s.layers for s in loaded.stages] == [s.layers for s in plan.stages]


def test_an_unknown_trace_mode_is_one_clear_error():
    with pytest.raises(ValueError, match="trace must be one of"):
        CostTable.build(al.models.get("gpt-tiny", num_layers=6), CLUSTER, trace="shallow")


def test_layer_map_of_signatures_is_the_op_map_s_and_refuses_an_unknown_layer():
    deep = al.models.get("gpt-tiny", num_layers=6).trace()
    small = al.models.get("gpt-tiny", num_layers=4).trace()
    sigs = [plain_signature(deep, n) for n in deep.layers]
    assert layer_map_of(sigs, small) == OpMap(deep, small).layer_map == [0, 3, 3, 3, 3, 3, 3, 5]
    other = al.models.get("gpt-tiny", num_layers=6, hidden_size=64).trace()
    with pytest.raises(LookupError):
        layer_map_of([plain_signature(other, n) for n in other.layers], small)


def test_a_given_layer_map_maps_operators_as_the_computed_one():
    deep = al.models.get("gpt-tiny", num_layers=7).trace()
    small = al.models.get("gpt-tiny", num_layers=4).trace()
    computed = OpMap(deep, small)
    given = OpMap(deep, small, layer_map=computed.layer_map)
    assert given.layer_map == computed.layer_map
    assert dict(given.items()) == dict(computed.items())
    first = small.ops_in_layer("layer_0")[5]
    assert given.siblings(first) == computed.siblings(first) and len(given.siblings(first)) == 4


def _tiny_graph():
    return al.models.get("gpt-tiny", num_layers=4).trace()


def test_a_deferred_graph_traces_once_on_first_read_and_is_then_the_graph():
    calls = []

    def trace():
        calls.append(1)
        return _tiny_graph()

    g = deferred_trace(trace, name="gpt-tiny", layers=["embed", "layer_0", "layer_1", "layer_2", "layer_3", "head"])
    assert isinstance(g, OpGraph) and g.name == "gpt-tiny" and len(g.layers) == 6 and not calls
    real = _tiny_graph()
    assert len(g) == len(real) and g.ops == real.ops and g.is_filled
    assert g.fingerprint == real.fingerprint and g.total_flops == real.total_flops
    assert [n.primitive for n in g] == [n.primitive for n in real]
    assert len(calls) == 1
    with pytest.raises(AttributeError):
        g.no_such_attribute  # noqa: B018 - an attribute no OpGraph has is not traced for
    assert len(calls) == 1


def test_a_deferred_graph_pickles_as_a_plain_graph():
    g = deferred_trace(_tiny_graph, name="gpt-tiny")
    back = pickle.loads(pickle.dumps(g))
    assert type(back) is OpGraph and back.fingerprint == _tiny_graph().fingerprint and g.is_filled


def test_a_failed_trace_is_tried_again_and_other_layers_are_refused():
    tries = []

    def flaky():
        tries.append(1)
        if len(tries) == 1:
            raise KeyboardInterrupt("cancelled")
        return _tiny_graph()

    g = deferred_trace(flaky)
    with pytest.raises(KeyboardInterrupt):
        len(g)
    assert not g.is_filled and len(g) == len(_tiny_graph()) and len(tries) == 2
    wrong = deferred_trace(_tiny_graph, name="gpt-tiny", layers=["embed", "head"])
    with pytest.raises(RuntimeError, match="other layers"):
        wrong.fill_now()


@pytest.mark.parametrize("dense", [3, 5])
def test_dense_first_layers_beyond_the_edge_are_read_off_deeper_copies(dense):
    """DeepSeek-V3's 3 dense first layers are more than the pattern's edge (2): its 4- and 6-layer copies disagree,
    so the pattern is read off its 5- and 7-layer copies (the lead layers kept by every copy) instead of tracing the
    full model; the derived names, layer map and cut bytes equal the full trace's. With 5 dense layers the copies
    keep only 3 (deepseek.COPY_DENSE_MAX), so the model has no lead layers and is traced in full as before."""
    model = al.models.get("deepseek-tiny", num_layers=9, first_dense_layers=dense)
    small = solve_graph_for(model)
    assert model.lead_layers == (3 if dense == 3 else 0)
    graph, deep = deferred_graph(model, small)
    if dense == 5:
        assert deep is None and not isinstance(graph, Lazy)
        return
    assert derive(9, small, lambda: model.with_layers(6).trace()) is None  # the plain copies disagree
    assert deep is not None and isinstance(graph, Lazy) and not graph.is_filled
    names, layer_map, cuts = _full_values(model, small)
    assert list(deep.layer_names) == names and len(names) == 11  # embedding, 9 layers, head
    assert list(deep.layer_map) == layer_map and len(set(layer_map)) >= 4  # dense and MoE layers told apart
    assert list(deep.cut_bytes) == cuts
