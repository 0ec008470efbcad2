"""Collective latency is paid every microbatch (issue 14, item 3: latency terms).

A layer's collectives are priced by the alpha-beta formula once a step at the full batch; a pipeline runs B
microbatches and each issues its tensor-parallel all-reduces again, so each pays the latency (alpha) again while the
bytes (beta) are split. The layer costs count the collectives a microbatch issues and their latency; the stage cost
pays that latency B times a step; the cost report, ``explain()`` and ``plan --json`` show it.

The expected figures come from NCCL's algorithms written out here (not read from the cluster's methods), with the
ring latencies NCCL's tuning model counts (``src/graph/tuning.cc``): an all-reduce takes the faster of a ring's 2 (n-1)
steps, 2 (hosts - 1) of them between hosts, and a hierarchical tree's log2 levels in a host and between hosts, up and
down; an all-gather a ring's n-1 steps, hosts - 1 of them between hosts.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar_lab as al
from autopar_lab.cluster import Link
from autopar_lab.plan import price_plan
from autopar_lab.pricing.stage import stage_cost

ROOT = Path(__file__).resolve().parents[1]


def all_reduce_alpha(n: int, hosts: int, a_in: float, a_out: float) -> float:
    """Latency of one all-reduce over n devices in ``hosts`` hosts."""
    per_host = n // hosts
    ring = (n - hosts) * a_in + (hosts - 1) * a_out
    tree = math.ceil(math.log2(per_host)) * a_in + math.ceil(math.log2(hosts)) * a_out
    return 2 * min(ring, tree)


def model(layers: int):
    return al.models.get("gpt-tiny", num_layers=layers, batch_size=16, hidden_size=256, seq_len=64, vocab_size=512)


def blocks(plan):
    return [k for k, name in enumerate(plan.layer_names) if name.startswith("layer_")]


def check_blocks(plan, alpha: float, stage: int = 0, counts: tuple[int, int] = (2, 2)) -> None:
    """Every transformer block of ``stage``: ``counts`` all-reduces a pass (Megatron's two by default), each paying
    one ``alpha``."""
    st = plan.stages[stage]
    a, b = st.layers
    for k in blocks(plan):
        if not a <= k <= b:
            continue
        c = st.layer_costs[k]
        assert (c.collectives_fwd, c.collectives_bwd) == counts, plan.layer_names[k]
        assert c.latency_fwd_s == pytest.approx(counts[0] * alpha, rel=1e-12)
        assert c.latency_bwd_s == pytest.approx(counts[1] * alpha, rel=1e-12)


def check_report(plan) -> None:
    """The report's totals: the busiest stage's per-microbatch collectives and latency times the microbatches."""
    B = plan.microbatches
    st = plan.stages[plan.cost.busiest_stage]
    a, b = st.layers
    part = st.layer_costs[a:b + 1]
    assert plan.cost.collectives == B * sum(c.collectives_fwd + c.collectives_bwd for c in part) > 0
    assert plan.cost.collective_latency_s == pytest.approx(
        B * sum(c.latency_fwd_s + c.latency_bwd_s for c in part), rel=1e-12)
    # The stage's per-microbatch times pay the latency in full: the stage cost with the latency fields zeroed, plus
    # the latency's other B - 1 shares (the layer costs count it once a step, 1/B of it a microbatch).
    sums = {f: sum(getattr(c, f) for c in part) for f in part[0].__dataclass_fields__
            if f != "shared"}  # the shared weights' entries are not a number (no latency of their own)
    task = plan.table.task_overhead_s(st.submesh)
    fwd, bwd, _, _ = stage_cost(sums, 0.0, B, 1, st.remat, task)
    quiet = dict(sums, latency_fwd_s=0.0, latency_bwd_s=0.0)
    fwd0, bwd0, _, _ = stage_cost(quiet, 0.0, B, 1, st.remat, task)
    assert fwd - fwd0 == pytest.approx(sums["latency_fwd_s"] * (B - 1) / B, rel=1e-9)
    assert bwd - bwd0 == pytest.approx(sums["latency_bwd_s"] * (B - 1) / B, rel=1e-9)
    assert st.fwd_s == pytest.approx(fwd, rel=1e-12) and st.bwd_s == pytest.approx(bwd, rel=1e-12)
    assert "collectives a step" in plan.cost.explain()
    assert plan.cost.to_dict()["collective_latency_s"] == plan.cost.collective_latency_s


def test_tensor_parallel_latency_is_count_times_alpha_per_microbatch():
    cluster = al.Cluster.preset("p3.16xlarge").with_(devices_per_host=4)
    a_in = cluster.intra_host.latency
    one = al.megatron_plan(model(2), cluster, dp=1, tp=4, pp=1, microbatches=1)
    four = al.megatron_plan(model(2), cluster, dp=1, tp=4, pp=1, microbatches=4, table=one.table)
    for plan in (one, four):
        check_blocks(plan, all_reduce_alpha(4, 1, a_in, cluster.inter_host.latency))
        check_report(plan)
    # Same strategies, four microbatches: four times the collectives and their latency.
    assert four.cost.collectives == 4 * one.cost.collectives
    assert four.cost.collective_latency_s == pytest.approx(4 * one.cost.collective_latency_s, rel=1e-12)


def test_latency_of_the_inter_host_link_class():
    # Tensor parallelism across two hosts of two devices (a layout Megatron avoids, priced here on purpose): the ring
    # crosses hosts once a pass and the tree climbs one level in a host and one between hosts. A fast but
    # high-latency inter-host link keeps the tensor-parallel sharding the cheaper choice.
    cluster = al.Cluster.preset("p3.16xlarge", hosts=2).with_(
        devices_per_host=2, inter_host=Link(bandwidth=100e9, latency=40e-6))
    a_in, a_out = cluster.intra_host.latency, cluster.inter_host.latency
    base = al.megatron_plan(model(2), cluster, dp=1, tp=2, pp=2, microbatches=4)
    plan = price_plan(base.table, [((0, len(base.layer_names) - 1), (2, 2), (1, 4), False)], microbatches=4)
    alpha = all_reduce_alpha(4, 2, a_in, a_out)
    assert alpha == 2 * (a_in + a_out)  # the tree beats the ring's 2 steps in a host and 1 between, each way
    # What the ILP chose on that mesh, counted from its strategies: the collectives of each block's forward operators
    # and of its backward operators but the weight gradients' (none here: nothing is data parallel); all all-reduces.
    st = plan.stages[0]
    g, intra = plan.op_graph, st.intra
    assert g is plan.graph and st.reshard_s == 0.0
    counts = []
    for role in ("forward", "backward"):
        kinds = [[kind for o in intra.ops if g.op(o).layer == plan.layer_names[k] and g.op(o).role == role
                  for kind, _axis, _n in intra.strategies[o].collectives] for k in blocks(plan)]
        assert all(set(ks) == {"all_reduce"} for ks in kinds) and len({len(ks) for ks in kinds}) == 1
        counts.append(len(kinds[0]))
    check_blocks(plan, alpha, counts=(counts[0], counts[1]))
    check_report(plan)


def test_deep_model_planned_on_a_shallower_copy():
    # 24 blocks on 2 hosts x 4 devices, two pipeline stages of tensor parallelism inside a host, and remat: every
    # block of both stages pays its all-reduces' latency, and the recomputed forward issues its all-reduces again.
    cluster = al.Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=4)
    plan = al.megatron_plan(model(24), cluster, dp=1, tp=4, pp=2, microbatches=8)
    assert plan.table.solve_graph is not plan.graph and len(blocks(plan)) == 24
    alpha = all_reduce_alpha(4, 1, cluster.intra_host.latency, cluster.inter_host.latency)
    for k in (0, 1):
        check_blocks(plan, alpha, stage=k)
    check_report(plan)
    remat = al.megatron_plan(model(24), cluster, dp=1, tp=4, pp=2, microbatches=8, remat=True, table=plan.table)
    st = remat.stages[remat.cost.busiest_stage]
    part = st.layer_costs[st.layers[0]:st.layers[1] + 1]
    assert remat.cost.collectives == 8 * sum(2 * c.collectives_fwd + c.collectives_bwd for c in part)
    assert remat.cost.collective_latency_s == pytest.approx(
        8 * sum(2 * c.latency_fwd_s + c.latency_bwd_s for c in part), rel=1e-12)


def test_cli_json_shows_the_collectives_and_their_latency(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    args = ["plan", "gpt-350m", "--layers", "2", "--batch", "8", "--cluster", "p3.16xlarge:1", "--method",
            "megatron", "--dp", "1", "--tp", "8", "--pp", "1", "--microbatches", "4"]
    run = subprocess.run([sys.executable, "-m", "autopar_lab", *args, "--json"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    plan = al.megatron_plan(al.models.get("gpt-350m", num_layers=2, batch_size=8),
                            al.Cluster.preset("p3.16xlarge"), dp=1, tp=8, pp=1, microbatches=4)
    assert out["collectives"] == plan.cost.collectives > 0 and out["collectives"] % 4 == 0
    assert out["collective_latency_s"] == pytest.approx(plan.cost.collective_latency_s, rel=1e-12)
    text = subprocess.run([sys.executable, "-m", "autopar_lab", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    assert text.returncode == 0 and f"of {plan.cost.collectives:,} a step" in text.stdout
