"""Issue 31: ZeRO-1 (Megatron-LM's distributed optimizer) gathers the updated weights in the compute dtype.

Each data-parallel rank updates its 1/d shard of the float32 master weights; the updated weights are then
all-gathered as the bf16/fp16 parameters the step computes with (2 bytes a parameter, not the master's 4), and the
gradients are reduced in their own dtype (fp16 in the fp16 recipe, fp32 in bf16's). Each collective is a ring over
the d devices: (d - 1)/d x bytes / bandwidth + (d - 1) latencies (one host: every step over NVLink).
"""

from __future__ import annotations

import math

import pytest

import autopar_lab as al
from autopar_lab.graph.opgraph import INPUT_PRIMITIVE, PARAM
from autopar_lab.pricing.layers import weight_gradient_ops
from autopar_lab.pricing.zero import updated_param
from autopar_lab.solve.intra import StrategyCache, conversions

H100 = al.Cluster.preset("dgx-h100", hosts=1)
D = 8  # data-parallel devices: one DGX H100


def _ring_s(nbytes: float) -> float:
    """A ring all-gather (or reduce-scatter) of a ``nbytes`` buffer over the host's D GPUs, by hand."""
    link = H100.intra_host
    return (D - 1) / D * nbytes / link.bandwidth + (D - 1) * link.latency


@pytest.fixture(scope="module")
def mlp():
    # One simple layer stack (two 4096 x 4096 linears and a head), float32 masters cast to half precision.
    return al.models.get("mlp", dtype="float16", hidden_size=4096, input_dim=4096, batch_size=4096, num_layers=2)


def _params(graph):
    return [op for op in graph.ops if graph.op(op).primitive == INPUT_PRIMITIVE
            and graph.tensor(graph.op(op).outputs[0]).kind == PARAM]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_zero1_gathers_the_updated_weights_in_the_compute_dtype(mlp, precision):
    plan = al.megatron_plan(mlp, H100, dp=D, tp=1, pp=1, zero=1, precision=precision)
    g, intra = plan.graph, plan.stages[0].intra
    params = _params(g)
    assert len(params) == 6
    # By hand: every parameter's update runs on its 1/8 shard and comes back whole, 2 bytes an element.
    by_hand = sum(_ring_s(2 * math.prod(g.tensor(g.op(p).outputs[0]).shape)) for p in params)
    # What the plan charges for them: its resharding less every other conversion's (priced by the strategies).
    other = sum(c for _u, v, _a, _t, _s, _d, c in conversions(g, intra.ops, intra.strategies,
                                                              StrategyCache(intra.mesh))
                if updated_param(g, v) is None)
    charged = sum(c.reshard_s for c in plan.stages[0].layer_costs) - other
    assert charged == pytest.approx(by_hand, rel=1e-9)
    # The master weights' float32 gather would have cost (nearly) twice the bandwidth term.
    float32 = sum(_ring_s(4 * math.prod(g.tensor(g.op(p).outputs[0]).shape)) for p in params)
    assert charged < 0.6 * float32


@pytest.mark.parametrize("precision, grad_bytes", [("fp16", 2), ("bf16", 4)])
def test_zero1_reduces_the_gradients_in_the_gradient_dtype(mlp, precision, grad_bytes):
    """The weight gradients' collectives move the recipe's gradient dtype (bf16: fp32 reduction, precision.py);
    a reduce-scatter into the optimizer's shards costs a ring by hand."""
    plan = al.megatron_plan(mlp, H100, dp=D, tp=1, pp=1, zero=1, precision=precision)
    g, intra = plan.graph, plan.stages[0].intra
    seen = 0
    for op in weight_gradient_ops(g, intra.ops):
        s = intra.strategies[op]
        out = g.tensor(g.op(op).outputs[0])
        for kind, _axis, nbytes in s.collectives:
            assert nbytes == grad_bytes * math.prod(out.shape), (kind, out.shape)
            seen += 1
            if kind == "reduce_scatter" and len(s.collectives) == 1:
                assert s.comm_s == pytest.approx(_ring_s(nbytes), rel=1e-9)
    assert seen


def test_zero1_without_sharded_state_changes_nothing(mlp):
    """No ZeRO: the parameters' update runs where they lie, nothing is gathered back and nothing re-priced."""
    base = al.megatron_plan(mlp, H100, dp=D, tp=1, pp=1, precision="bf16")
    g, intra = base.graph, base.stages[0].intra
    assert not [v for _u, v, *_ in conversions(g, intra.ops, intra.strategies, StrategyCache(intra.mesh))
                if updated_param(g, v) is not None]


@pytest.mark.slow  # about 6 s: tracing Llama 3 8B's shallow copy
def test_a_deep_llama_gathers_every_layers_weights_once_in_bf16():
    """24 Llama blocks planned on the shallow copy, dp=16 over two DGX H100s (the ring crosses the hosts once: 14
    NVLink steps and one InfiniBand step): the full model's updated weights are charged one bf16 all-gather each,
    every layer's, not only those of the layers the table solved."""
    model = al.models.get("llama3-8b", num_layers=24, batch_size=16, seq_len=256)
    cluster = al.Cluster.preset("dgx-h100", hosts=2)
    plan = al.megatron_plan(model, cluster, dp=16, tp=1, pp=1, zero=1, micro_batch_size=1, precision="bf16")
    table, intra = plan.table, plan.stages[0].intra
    full, solved = plan.graph, table.solve_graph
    assert len(full.layers) > len(solved.layers) and plan.cost.fits
    bandwidth = intra.mesh.axis_link(0).bandwidth
    latency = 14 * cluster.intra_host.latency + cluster.inter_host.latency
    by_hand = sum(15 / 16 * 2 * math.prod(full.tensor(full.op(p).outputs[0]).shape) / bandwidth + latency
                  for p in _params(full))
    # The other conversions, per solved layer, counted for each full layer that layer stands for.
    names = list(solved.layers)
    other = [0.0] * len(names)
    for _u, v, _a, _t, _s, _d, c in conversions(solved, intra.ops, intra.strategies, StrategyCache(intra.mesh)):
        if updated_param(solved, v) is None:
            other[names.index(solved.op(v).layer) if solved.op(v).layer in names else -1] += c
    charged = sum(c.reshard_s for c in plan.stages[0].layer_costs) - sum(other[k] for k in table.layer_map)
    assert charged == pytest.approx(by_hand, rel=1e-9)
