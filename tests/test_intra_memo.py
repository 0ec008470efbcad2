"""The intra-op pass's memos (issue 16, third round) change no number: strategies, edge matrices, collective times
and whole solves are the same whether computed cold or after other meshes warmed the caches."""

from __future__ import annotations

import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.sharding import reshard, spec, strategies
from autopar_lab.sharding.strategies import strategies_for
from autopar_lab.solve.intra import IntraOptions, StrategyCache, build_problem, solve_intra


def _clear_module_memos():
    strategies._TEMPLATES.clear()
    strategies._VALID.clear()
    spec._BYTES.clear()


def _priced(strats):
    return [(s.name, s.out_specs, s.in_specs, s.collectives, s.compute_s, s.comm_s, s.mem_bytes) for s in strats]


@pytest.fixture(scope="module")
def graph():
    return al.models.get("gpt-tiny", dtype="float32", num_layers=2).trace()


def _meshes():
    cluster = al.Cluster.preset("p3.16xlarge", hosts=2)
    return [cluster.logical_mesh(sub, shape) for sub, shape in
            [((1, 8), (1, 8)), ((1, 8), (8, 1)), ((1, 8), (2, 4)), ((2, 8), (2, 8)), ((2, 8), (4, 4)),
             ((1, 4), (1, 4)), ((1, 2), (2, 1))]]


def test_strategies_are_the_same_cold_and_after_other_meshes_warmed_the_memos(graph):
    meshes = _meshes()
    ops = [graph.op(op) for op in graph.ops]
    cold = []
    for mesh in meshes:
        _clear_module_memos()
        cold.append([_priced(strategies_for(node, mesh)) for node in ops])
    for k in (3, 0, 6, 2, 5, 1, 4):  # another order, every memo warm
        assert [_priced(strategies_for(node, meshes[k])) for node in ops] == cold[k]
    # The meshes really differ: a memo keyed too coarsely would have made them equal.
    assert len({repr(c) for c in cold}) == len(meshes)


def test_operators_of_one_shape_in_other_roles_share_the_enumeration_and_keep_their_own_price(graph):
    mesh = _meshes()[2]
    by_shape = {}
    for op in graph.ops:
        node = graph.op(op)
        by_shape.setdefault((node.primitive, node.in_shapes, node.out_shapes, node.params.get("axes")), {}) \
            .setdefault(node.role, node)
    pairs = [tuple(nodes.values())[:2] for nodes in by_shape.values() if len(nodes) > 1]
    assert len(pairs) > 5  # the sharing is exercised
    for first, second in pairs:
        _clear_module_memos()
        cold = _priced(strategies_for(second, mesh))
        _clear_module_memos()
        strategies_for(first, mesh)  # warms the enumeration memo for `second`'s shape
        assert _priced(strategies_for(second, mesh)) == cold


def test_shared_edge_matrices_equal_per_call_ones(graph):
    mesh = _meshes()[4]
    shared = StrategyCache(mesh)
    a = build_problem(graph, mesh, cache=shared).problem
    b = build_problem(graph, mesh, cache=shared).problem  # every matrix from the memo
    c = build_problem(graph, mesh, cache=StrategyCache(mesh)).problem
    assert len(a.edge_costs) == len(c.edge_costs) > 100
    for x, y, z in zip(a.edge_costs, b.edge_costs, c.edge_costs):
        assert np.array_equal(x, z) and np.array_equal(y, z)
    for x, z in zip(a.node_costs, c.node_costs):
        assert np.array_equal(x, z)
    # A shared matrix cannot be changed by whoever holds it.
    mats = [m for _k, (_su, _sv, m) in shared.edge_mats.items()]
    assert mats and not any(m.flags.writeable for m in mats)


def test_collective_time_memo_equals_the_mesh_formula():
    mesh = _meshes()[3]
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for axis in (0, 1, (0, 1)):
            for nbytes in (0, 1, 4096, 3.5e8):
                want = float(getattr(mesh, kind)(nbytes, axis))
                assert reshard.collective_time(mesh, kind, nbytes, axis) == want
                assert reshard.collective_time(mesh, kind, nbytes, axis) == want  # from the memo
    with pytest.raises(ValueError, match="unknown collective"):
        reshard.collective_time(mesh, "broadcast", 8, 0)


def test_a_solve_is_the_same_with_warm_and_cold_caches(graph):
    meshes = _meshes()
    _clear_module_memos()
    cold = solve_intra(graph, meshes[4], options=IntraOptions(rounds=1, solver="highs"))
    for mesh in meshes:
        solve_intra(graph, mesh, options=IntraOptions(rounds=1, solver="highs"))
    warm = solve_intra(graph, meshes[4], options=IntraOptions(rounds=1, solver="highs"))
    assert {op: s.key for op, s in warm.strategies.items()} == {op: s.key for op, s in cold.strategies.items()}
    assert (warm.compute_s, warm.comm_s, warm.reshard_s, warm.static_bytes, warm.act_bytes) == \
        (cold.compute_s, cold.comm_s, cold.reshard_s, cold.static_bytes, cold.act_bytes)


def test_a_reused_layer_takes_what_same_strategy_gives(graph):
    """Where :func:`shared_lists` says two operators share their strategy list, the reused layer takes the
    reference's strategy object itself; that is what ``same_strategy`` returns for every strategy of the list."""
    from autopar_lab.solve.intra import layer_groups, layer_signature, shared_lists

    groups = [g for name, g in layer_groups(graph) if name]
    pairs = [(a, b) for i, a in enumerate(groups) for b in groups[i + 1:]
             if layer_signature(graph, a) == layer_signature(graph, b)]
    assert pairs  # gpt-tiny's two layers are identical
    for mesh in _meshes()[:3]:
        cache = StrategyCache(mesh)
        for ref, ops in pairs:
            flags = shared_lists(graph, ref, ops, cache)
            assert len(flags) == len(ops)
            for a, b, same in zip(ref, ops, flags):
                sa, sb = cache.strategies(graph.op(a)), cache.strategies(graph.op(b))
                assert (sa is sb) == same
                if same:
                    assert all(cache.same_strategy(s, graph.op(b)) is s for s in sa)
