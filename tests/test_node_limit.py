"""Node-limited expert routing (DeepSeek-V3's ``n_group`` / ``topk_group``) and what it does to the price of the token
exchange (one copy a node, DeepEP), against hand formulas on a small mesh; and what an MoE layer of the zoo keeps for
the backward (the tokens dispatched by index, no one-hot tensor), against a hand count."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import autopar_lab as al
from autopar_lab.cluster import Cluster, Device, Link, NodeLimit
from autopar_lab.graph.fusion import kernel_view
from autopar_lab.graph.opgraph import dtype_size
from autopar_lab.models.routing import Routing, top_k_gates
from autopar_lab.parallelism import stage_intras
from autopar_lab.pricing.table import with_routing
from autopar_lab.sharding.experts import expert_layers
from autopar_lab.sharding.reshard import reshard_cost
from autopar_lab.sharding.spec import ShardingSpec as S

W_IN, W_OUT, A_IN, A_OUT = 4e11, 1e10, 1e-6, 1e-5
LIMIT = NodeLimit(num_experts=16, top_k=4, n_group=4, topk_group=2)


def small(limit: NodeLimit | None = None) -> Cluster:
    """4 hosts of 2 devices (each host its own domain): one axis of 8 devices spans all 4."""
    return Cluster(hosts=4, devices_per_host=2, device=Device("toy", {"float32": 1e12}, 2**30, 1e11),
                   intra_host=Link(W_IN, A_IN), inter_host=Link(W_OUT, A_OUT), moe_routing=limit)


def test_the_routed_all_to_all_sends_one_copy_per_node_reached():
    B = 2**30
    n, g, k, h = 8, 2, 4, 2  # devices, per domain, domains, group devices per host
    m = small(LIMIT).logical_mesh((4, 2), (1, 8))
    assert (m.axis_size(1), m.axis_domains(1), m.axis_link(1).bandwidth) == (n, k, W_OUT)
    latency = (g - 1) * A_IN + (n - g) * A_OUT
    inside = (g - 1) * B / n**2 / W_IN
    # every token's 4 copies go to their experts: 4 x 6/8 of them leave the host
    plain = latency + max(inside, h * (n - g) * B / n**2 / W_OUT)
    # 16 experts in 4 groups of 4, one group a host; top-4 inside 2 groups: at most 2 hosts, one copy each
    assert LIMIT.reach(k) == 2 and LIMIT.copies(k) == 2
    routed = latency + max(inside, h * (n - g) * B / n**2 * (2 / 4) / W_OUT)
    assert m.all_to_all(B, 1) == pytest.approx(plain, rel=1e-12)
    assert m.routed_all_to_all(B, 1) == pytest.approx(routed, rel=1e-12)
    # without a limit the routed exchange is the plain one; inside one host it is too (nothing crosses)
    assert small().logical_mesh((4, 2), (1, 8)).routed_all_to_all(B, 1) == pytest.approx(plain, rel=1e-12)
    one_host = small(LIMIT).logical_mesh((1, 2), (1, 2))
    assert one_host.routed_all_to_all(B, 1) == one_host.all_to_all(B, 1)


def test_reach_with_more_and_fewer_nodes_than_groups():
    # DeepSeek-V3: 256 experts, 8 groups, 4 of them a token
    ds = NodeLimit(256, 8, 8, 4)
    assert [ds.reach(k) for k in (1, 2, 4, 8, 16, 32)] == [1, 2, 4, 4, 8, 16]  # 16 nodes: a group spans two
    assert [ds.copies(k) for k in (2, 8, 16, 32)] == [2, 4, 8, 8]              # never more than top_k
    with pytest.raises(ValueError, match="topk_group"):
        NodeLimit(16, 4, 4, 5)
    with pytest.raises(ValueError, match="divisible"):
        NodeLimit(10, 2, 4, 2)


def test_only_the_expert_exchange_is_routed():
    B_shape = (8, 16, 4, 64)  # [groups, experts, capacity, hidden]: the dispatched tokens
    m, plain = small(LIMIT).logical_mesh((4, 2), (1, 8)), small().logical_mesh((4, 2), (1, 8))
    src, dst = S.parse("S1RRR"), S.parse("RS1RR")  # the axis moves from the groups onto the experts
    t_routed, cols = reshard_cost(src, dst, B_shape, "float32", m)
    t_plain, cols_plain = reshard_cost(src, dst, B_shape, "float32", plain)
    assert [c[0] for c in cols] == ["all_to_all"] and cols == cols_plain
    nbytes = cols[0][2]
    assert t_routed == pytest.approx(m.routed_all_to_all(nbytes, 1)) and t_routed < t_plain
    assert t_plain == pytest.approx(plain.all_to_all(nbytes, 1))
    # a dimension of another size (not the experts'): the plain price
    other = (8, 32, 4, 64)
    assert reshard_cost(src, dst, other, "float32", m)[0] == pytest.approx(reshard_cost(src, dst, other, "float32",
                                                                                        plain)[0])


def test_group_limited_gates_choose_inside_the_best_groups():
    r = Routing(16, 4, 32, score="sigmoid", n_group=4, topk_group=2)
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 32, 16))
    _w, experts, _p = top_k_gates(logits, r)
    groups = np.asarray(experts) // 4
    assert max(len(set(row)) for row in groups.reshape(-1, 4)) <= 2
    # the groups kept are those with the largest sum of their two best scores (DeepSeek-V3's ranking)
    scores = np.asarray(jax.nn.sigmoid(logits)).reshape(3, 32, 4, 4)
    rank = np.sort(scores, -1)[..., -2:].sum(-1)
    best = np.argsort(-rank, -1)[..., :2]
    assert all(set(groups[i, t]) <= set(best[i, t]) for i in range(3) for t in range(32))
    # one group (no limit): the plain top-k
    free = Routing(16, 4, 32, score="sigmoid")
    assert np.array_equal(np.asarray(top_k_gates(logits, free)[1]),
                          np.asarray(jax.lax.top_k(jax.nn.sigmoid(logits), 4)[1]))


def test_the_config_fields_reach_the_cluster_of_the_table():
    ds = al.models.get("deepseek-v3")
    assert (ds.config.n_group, ds.config.topk_group) == (8, 4)
    assert with_routing(small(), ds).moe_routing == NodeLimit(256, 8, 8, 4)
    assert with_routing(small(), al.models.get("deepseek-tiny")).moe_routing is None  # one group: no limit
    assert with_routing(small(), al.models.get("llama3-8b")).moe_routing is None
    with pytest.raises(ValueError, match="topk_group"):
        al.models.get("deepseek-tiny", n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="n_group"):
        al.models.get("deepseek-tiny", n_group=3, topk_group=1)


def test_a_plan_prices_the_deepseek_exchange_with_the_limit(tmp_path):
    """End to end through the public API: DeepSeek-V3's layers (two of them, sequence 1,024) with 256 experts split
    over 32 GPUs on 4 hosts: a token's top-8 experts sit in 4 of 8 groups, two groups a host, so it reaches at most
    4 hosts (all of them here) and the limit saves nothing beyond top_k = 8 -> 4 copies: half the bytes that leave a
    host. The plan's cluster carries the limit; its exchanges cost what the routed formula says, less than the same
    layout's with every group open (topk_group = n_group), and so is the step."""
    kw = dict(num_layers=2, first_dense_layers=1, batch_size=32, seq_len=1024, expert_group_size=1024)
    cluster = Cluster.preset("dgx-h100", 4)
    layout = dict(dp=32, tp=1, pp=1, ep=32, micro_batch_size=1)
    model = al.models.get("deepseek-v3", **kw)
    plan = al.megatron_plan(model, cluster, **layout)
    free = al.megatron_plan(al.models.get("deepseek-v3", topk_group=8, **kw), cluster, **layout)
    assert plan.cluster.moe_routing == NodeLimit(256, 8, 8, 4) and free.cluster.moe_routing is None
    [(_k, intra, ops)] = stage_intras(plan)
    mesh = intra.mesh
    [layer] = expert_layers(plan.op_graph, intra.strategies, mesh, ops)
    assert layer.degree == 32 and mesh.axis_domains(layer.axes[0]) == 4 and layer.all_to_alls
    assert plan.cluster.moe_routing.copies(4) == 4
    routed = sum(mesh.routed_all_to_all(b, a) for _kind, a, b in layer.all_to_alls)
    plain = sum(mesh.all_to_all(b, a) for _kind, a, b in layer.all_to_alls)
    assert layer.all_to_all_s == pytest.approx(routed) and routed < 0.6 * plain
    assert plan.cost.step_time_s < free.cost.step_time_s  # (the ILP may move other exchanges onto the cheaper one)
    # a saved plan loads with the same limit (the cluster's file form does not hold it: the model gives it again)
    al.save_plan(plan, tmp_path / "ds.json")
    back = al.load_plan(tmp_path / "ds.json", model)
    assert back.cluster.moe_routing == plan.cluster.moe_routing
    assert back.cost.step_time_s == pytest.approx(plan.cost.step_time_s, rel=1e-9)


def one_hot_kept(kept, tokens: int, experts: int, slots: int) -> list:
    """The kept tensors (scope, shape, ...) with a tokens x experts x capacity block: a one-hot dispatch or combine."""
    return [x for x in kept if {tokens, experts, slots} <= set(x[1])]


def test_an_moe_layer_keeps_the_tokens_it_dispatched_by_index():
    """What the zoo's MoE layer keeps for the backward, per microbatch of N tokens (capacity factor 1: E C = N K slots):
    the dispatched tokens (N K H, the gather Megatron-LM's and DeepEP's token permutation keeps too), the experts'
    output in the slots (N K H: the combine's gate gradient reads it), the SwiGLU's intermediates (N K F each) and
    int32 slot indices: no [tokens, experts, capacity] one-hot dispatch or combine tensor (GShard's), which at
    DeepSeek-V3's size would be 4,096 x 256 x 128 elements a sequence."""
    spec = al.models.get("deepseek-tiny", num_layers=2, first_dense_layers=1, batch_size=2, seq_len=32,
                         expert_group_size=32, hidden_size=64, moe_ffn_hidden=24, top_k=3)  # sizes all distinct
    c = spec.config
    g = spec.trace()
    v = kernel_view(g, True)
    N, K, H, F, E = c.batch_size * c.seq_len, c.top_k, c.hidden_size, c.moe_ffn_hidden, c.num_experts
    cap = math.ceil(c.seq_len * K / E)
    kept = {}
    for t in v.saved - v.weight_derived:
        info = g.tensor(t)
        node = g.op(info.producer)
        if node.layer == "layer_1" and "/moe/" in node.scope and "shared_experts" not in node.scope:
            kept[t] = (node.scope, tuple(info.shape), math.prod(info.shape) * dtype_size(info.dtype))
    assert len({c.seq_len, E, cap, H, F}) == 5
    # the check finds GShard's one-hot where a model keeps one (the zoo's GShard MoE, models/moe.py)
    gs = al.models.get("moe-tiny", num_experts=8, batch_size=2, seq_len=16, expert_group_size=32, hidden_size=64,
                       capacity_factor=3.0)
    gg = gs.trace()
    gv = kernel_view(gg, True)
    gkept = [(gg.op(gg.tensor(t).producer).scope, tuple(gg.tensor(t).shape)) for t in gv.saved - gv.weight_derived
             if gg.op(gg.tensor(t).producer).layer == "layer_1"]
    assert one_hot_kept(gkept, 32, 8, 12)
    assert not one_hot_kept(kept.values(), c.seq_len, E, cap)
    dispatched = [b for s, shape, b in kept.values() if "/dispatch" in s and math.prod(shape) == N * K * H]
    assert dispatched == [N * K * H * 4]  # float32 tiny model
    wide = sum(b for _s, shape, b in kept.values() if math.prod(shape) >= N * K * min(H, F))
    assert wide <= N * K * (2 * H + 6 * F) * 4
    assert sum(b for *_x, b in kept.values()) - wide <= N * K * 4 * 8 + N * E * 4 * 4  # indices, gates, scores
