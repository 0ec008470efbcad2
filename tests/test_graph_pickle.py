"""A captured graph pickles: the mesh pool's worker processes get it pickled (auto_plan of Wide-ResNet-6.8B on 32
GPUs failed there: max pooling's backward, select_and_scatter_add, carried a jax primitive as a parameter)."""

from __future__ import annotations

import pickle

import autopar_lab as al


def test_a_wide_resnet_graph_pickles_with_its_pooling_primitive_named():
    model = al.models.get("wresnet-tiny")
    graph = model.trace()
    pools = [op for op in graph if op.primitive == "select_and_scatter_add"]
    assert pools, "wresnet-tiny's step has a max-pool backward"
    assert all(op.params["select_prim"] == "ge" for op in pools)
    back = pickle.loads(pickle.dumps(graph))
    assert [op.primitive for op in back] == [op.primitive for op in graph]

