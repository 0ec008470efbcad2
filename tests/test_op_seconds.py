"""One device's view of a step through the public API (autopar_lab.pricing.kernels): each operator's seconds, alone
or as its share of a fused kernel; the kernels with their FLOPs and bytes; an intra plan's cost by layer; and
OpNode.category. Checked against roofline formulas worked out here from the device's figures."""

import math

import jax
import jax.numpy as jnp
import pytest

import autopar_lab as al

N = 1 << 20                                   # a vector big enough that every kernel is memory-bound


@pytest.fixture(scope="module")
def h100():
    return al.Cluster.preset("dgx-h100")


def _chain():
    # exp(tanh(x)) summed: two elementwise operators and a reduction, which XLA runs as one reduce kernel.
    return al.trace(lambda x: jnp.sum(jnp.exp(jnp.tanh(x))), jax.ShapeDtypeStruct((N,), jnp.float32))


def _op(graph, primitive):
    return next(op for op in graph.ops if graph.op(op).primitive == primitive)


def test_an_operator_alone_reads_its_input_and_writes_its_output(h100):
    g = _chain()
    d = h100.device
    alone = al.op_seconds(g, h100, fused=False)
    # tanh alone: N FLOPs at the vector rate, or N float32 values read and N written at the achievable bandwidth.
    expected = max(N / d.vector_rate("float32"), 2 * 4 * N / d.achievable_bandwidth)
    assert math.isclose(alone[_op(g, "tanh")], expected, rel_tol=1e-9)
    assert math.isclose(alone[_op(g, "exp")], expected, rel_tol=1e-9)


def test_fused_the_chain_is_one_kernel_that_reads_the_vector_once(h100):
    g = _chain()
    d = h100.device
    (k,) = [k for k in al.kernel_costs(g, h100) if k.flops > 0]
    assert k.kind == "reduce" and {g.op(op).primitive for op in k.ops} == {"tanh", "exp", "reduce_sum"}
    assert k.bytes == 4 * N + 4                # x read once, the scalar written: tanh's and exp's outputs stay on chip
    assert k.flops == 3 * N and math.isclose(k.intensity, 3 * N / (4 * N + 4))
    # Each operator prices its share at its own roofline: tanh reads x; exp works on chip; the sum writes 4 bytes.
    vec, bw = d.vector_rate("float32"), d.achievable_bandwidth
    assert math.isclose(k.seconds, max(N / vec, 4 * N / bw) + N / vec + max(N / vec, 4 / bw), rel_tol=1e-9)
    fused = al.op_seconds(g, h100)
    assert math.isclose(sum(fused[op] for op in k.ops), k.seconds, rel_tol=1e-12)
    # Alone, tanh and exp each read and write N values and the sum reads N: 20 N bytes against the kernel's 4 N.
    alone = al.op_seconds(g, h100, fused=False)
    assert math.isclose(sum(alone.values()), 2 * max(N / vec, 8 * N / bw) + max(N / vec, (4 * N + 4) / bw),
                        rel_tol=1e-9)


def test_alone_stays_alone_after_the_graph_was_priced_fused(h100):
    g = _chain()
    first = al.op_seconds(g, h100, fused=False)
    al.op_seconds(g, h100)                     # attaches the kernel roles to the graph's operators
    assert al.op_seconds(g, h100, fused=False) == first


def test_operator_categories():
    g = al.trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)).reshape(1), jnp.zeros((4, 8)), jnp.zeros((2, 4)))
    kinds = {g.op(op).primitive: g.op(op).category for op in g.ops}
    assert kinds["dot_general"] == "matmul" and kinds["tanh"] == "elementwise"
    assert kinds["reduce_sum"] == "reduction" and kinds["reshape"] == kinds["parameter"] == "data movement"


def test_a_llama_layer_kernel_by_kernel_on_an_h100(h100):
    """The size the lesson runs at: one Llama 3 8B layer with its embedding and head, a 4,096-token sequence, bf16."""
    g = al.models.get("llama3-8b", num_layers=1, batch_size=1, seq_len=4096, dtype="bfloat16").trace()
    d = h100.device
    kernels = al.kernel_costs(g, h100)
    assert "attention" in {k.kind for k in kernels}          # flash attention: the H100 preset runs it
    for k in kernels:                                        # every kernel at or under the roofline
        if k.flops > 0 and k.bytes > 0:
            assert k.flops / k.seconds <= min(d.peak("bfloat16"), k.intensity * d.memory_bandwidth) * (1 + 1e-9)
    in_kernels = {op for k in kernels for op in k.ops}
    assert len(in_kernels) == sum(len(k.ops) for k in kernels)   # no operator in two kernels
    fused, alone = al.op_seconds(g, h100), al.op_seconds(g, h100, fused=False)
    assert sum(k.seconds for k in kernels) <= sum(fused.values()) * (1 + 1e-12)
    assert sum(alone.values()) > 1.5 * sum(fused.values())


def test_costs_by_layer_split_the_plan():
    cluster = al.Cluster.preset("dgx-h100")
    g = al.models.get("gpt-tiny", num_layers=2, batch_size=8, dtype="bfloat16").trace()
    # Data parallel: each token batch split over the two GPUs, so the weight gradients are all-reduced.
    batch = {op: "S1" + "R" * (len(g.op(op).out_shapes[0]) - 1) for op in g.ops
             if g.op(op).primitive == "parameter" and g.tensor(g.op(op).outputs[0]).kind == "batch"}
    plan = al.solve_intra(g, cluster.logical_mesh((1, 2), (1, 2)), pins=batch,
                          options=al.IntraOptions(solver="highs", rounds=1))
    assert plan.comm_s + plan.reshard_s > 0                  # a plan with collectives to split
    by_layer = al.costs_by_layer(g, plan)
    assert list(by_layer) == list(g.layers)
    assert math.isclose(sum(c.compute_s for c in by_layer.values()), plan.compute_s, rel_tol=1e-9)
    assert math.isclose(sum(c.comm_s for c in by_layer.values()), plan.comm_s, rel_tol=1e-9)
    assert math.isclose(sum(c.reshard_s for c in by_layer.values()), plan.reshard_s, rel_tol=1e-9)
