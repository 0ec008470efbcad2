"""Megatron-Core's communication overlap switches on ``al.megatron_plan`` (issue 31; pricing/overlap.py): each one
hides what its docstring says, up to the compute it overlaps, checked against the formulas by hand on a one-stage
plan (step = B x (forward + backward) a microbatch, so a switch moves the step by exactly what it hides)."""

import json

import pytest

import autopar_lab as al
from autopar_lab import Cluster
from autopar_lab.pricing.overlap import check_overlap, overlap_terms
from autopar_lab.sharding.reshard import collective_time

S, H, A, B = 512, 512, 8, 16
MB = 2  # microbatches


@pytest.fixture(scope="module")
def table():
    m = al.models.get("gpt-tiny", seq_len=S, hidden_size=H, num_heads=A, num_layers=2, batch_size=B, vocab_size=128,
                      dtype="float16")
    return al.CostTable.build(m, Cluster.preset("dgx-a100").with_(devices_per_host=4))


def plan(table, **kw):
    return al.megatron_plan(table=table, pp=1, microbatches=MB, **kw)


def test_the_defaults_are_megatron_cores_and_the_gradient_reduction_shows(table):
    """Off by default (Megatron-Core's defaults): the reduce-scatter of ZeRO-1 runs after the backward, in full.
    On: it hides behind the last microbatch's backward, up to that backward's compute less one layer's bucket:
    min(sync, bwd_compute / B x (1 - 1/layers))."""
    off = plan(table, dp=4, tp=1, zero=1)
    on = plan(table, dp=4, tp=1, zero=1, overlap_grad_reduce=True)
    assert off.stage_pins["overlap"] == () and on.stage_pins["overlap"] == ("grad_reduce",)
    assert on.method == "megatron(dp=4,tp=1,pp=1,zero=1,ogr)"
    lc = on.stages[0].layer_costs
    sync = sum(c.sync_s for c in lc)
    assert sync > 0 and sum(c.sync_s for c in off.stages[0].layer_costs) == 0
    hidden = min(sync, sum(c.bwd_compute_s for c in lc) / MB * (1 - 1 / len(lc)))
    assert off.cost.step_time_s - on.cost.step_time_s == pytest.approx(hidden, rel=1e-9)


def test_the_updated_weights_gather_hides_behind_the_next_forward(table):
    """``overlap_param_gather``: the all-gather of the updated weights in bf16/fp16 (each parameter 2 bytes an
    element, gathered over the 4 data-parallel devices) moves from after the update to the next step's forward,
    hidden up to its first microbatch's compute less one layer's: min(G, fwd_compute / B x (1 - 1/layers))."""
    base = plan(table, dp=4, tp=1, zero=1, overlap_grad_reduce=True)
    on = plan(table, dp=4, tp=1, zero=1, overlap_grad_reduce=True, overlap_param_gather=True)
    mesh = base.stages[0].intra.mesh
    g = table.graph
    params = [op for op in g.ops if g.op(op).primitive == "parameter" and g.tensor(g.op(op).outputs[0]).kind == "param"]
    # by hand: one all-gather per parameter, over axis 0, of its 16-bit copy
    G = sum(collective_time(mesh, "all_gather", 2 * g.tensor(g.op(p).outputs[0]).size, 0) for p in params)
    lc = on.stages[0].layer_costs
    assert sum(c.gather_s for c in lc) == pytest.approx(G, rel=1e-9)
    hidden = min(G, sum(c.fwd_compute_s for c in lc) / MB * (1 - 1 / len(lc)))
    assert base.cost.step_time_s - on.cost.step_time_s == pytest.approx(hidden, rel=1e-9)


def test_tensor_parallel_communication_hides_behind_each_layers_matmuls(table):
    """``tp_comm_overlap``: per layer and pass, min(T, G) of T seconds of tensor-axis collectives behind G seconds of
    matmuls. T by hand for a transformer block on t = 4 with sequence parallelism: the forward gathers the (b, s, h)
    fp16 activations before each of the 2 column matmuls and reduces the 2 row matmuls' outputs (priced as
    all-reduces at this size); the backward reduce-scatters the 2 column matmuls' input gradients, gathers the 2 row
    matmuls' output gradients, and gathers the 2 column matmuls' inputs again for their weight gradients (Megatron-LM
    keeps only the sequence shard: Korthikanti et al. 2023, 4.2.2)."""
    off = plan(table, dp=1, tp=4, zero=0, sequence_parallel=True)
    on = plan(table, dp=1, tp=4, zero=0, sequence_parallel=True, tp_comm_overlap=True)
    st = off.stages[0]
    mesh = st.intra.mesh
    g = table.solve_graph
    terms = overlap_terms(g, st.intra, list(g.layers), 0)
    nb = B * S * H * 2
    ag, rs, ar = (collective_time(mesh, k, nb, 1) for k in ("all_gather", "reduce_scatter", "all_reduce"))
    block = terms[list(g.layers).index("layer_0")]
    assert block["tp_fwd"] == pytest.approx(2 * ag + 2 * ar, rel=1e-9)
    assert block["tp_bwd"] == pytest.approx(2 * rs + 4 * ag, rel=1e-9)
    assert block["regather"] == pytest.approx(2 * ag, rel=1e-9)
    hidden = sum(min(t["tp_fwd"], t["mm_fwd"]) + min(t["tp_bwd"], t["mm_bwd"]) for t in terms)
    assert hidden > 0
    assert off.cost.step_time_s - on.cost.step_time_s == pytest.approx(hidden, rel=1e-9)


def test_megatron_lms_requirements_are_one_sentence_each(table):
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        plan(table, dp=1, tp=4, zero=0, tp_comm_overlap=True)
    with pytest.raises(ValueError, match="zero=1"):
        plan(table, dp=4, tp=1, zero=0, overlap_grad_reduce=True, overlap_param_gather=True)
    with pytest.raises(ValueError, match="overlap_grad_reduce=True"):
        plan(table, dp=4, tp=1, zero=1, overlap_param_gather=True)
    with pytest.raises(ValueError, match="True or False"):
        plan(table, dp=4, tp=1, zero=1, overlap_grad_reduce="yes")
    with pytest.raises(ValueError, match="'grad_reduce'"):
        check_overlap(["grad"])


def test_a_saved_plan_keeps_its_overlap_and_prices_the_same(table, tmp_path):
    p = plan(table, dp=4, tp=1, zero=1, overlap_grad_reduce=True, overlap_param_gather=True)
    path = tmp_path / "p.json"
    al.save_plan(p, path)
    assert json.loads(path.read_text())["stage_pins"]["overlap"] == ["grad_reduce", "param_gather"]
    back = al.load_plan(path, table.graph, table.cluster)
    assert back.stage_pins["overlap"] == ("grad_reduce", "param_gather")
    assert back.cost.step_time_s == pytest.approx(p.cost.step_time_s, rel=1e-12)


def test_the_backward_gathers_the_sequence_shard_again(table):
    """Without the overlap switches a Megatron plan still pays what Megatron-LM runs: the cost model alone converts
    the gathered copy once for the forward and the weight gradient; Megatron-LM's backward gathers the kept shard
    again. The plan priced without the key (the cost model's own) is faster by exactly those re-gathers, 2 all-gathers
    of the (b, s, h) fp16 activations per block over the tensor axis, and by the weight-gradient reduction it hides
    (the layer norms' gradients summed over the sequence shards; Megatron-LM reduces them after the backward):
    min(sync, bwd_compute / B x (1 - 1/layers))."""
    from autopar_lab.plan import price_plan

    off = plan(table, dp=1, tp=4, zero=0, sequence_parallel=True)
    st = off.stages[0]
    own = price_plan(table, [(st.layers, st.submesh, st.logical_mesh, st.remat)], microbatches=MB,
                     intras=[st.intra], stage_pins={"zero": 0})
    ag = collective_time(st.intra.mesh, "all_gather", B * S * H * 2, 1)
    blocks = sum(1 for name in table.layer_names if name.startswith("layer_"))
    lc = own.stages[0].layer_costs
    hidden = min(sum(c.sync_s for c in lc), sum(c.bwd_compute_s for c in lc) / MB * (1 - 1 / len(lc)))
    assert hidden > 0
    assert off.cost.step_time_s - own.cost.step_time_s == pytest.approx(blocks * 2 * ag + hidden, rel=1e-9)


# --- the expert-parallel all-to-alls behind the other microbatch's compute (overlap_moe_comm) -------------------

@pytest.fixture(scope="module")
def moe_table():
    """A deep DeepSeek-style MoE (6 blocks, the first dense; planned on its shallow copy) on 4 A100s, wide enough
    that the ILP exchanges the tokens by all-to-alls with the experts split over the 4 devices."""
    m = al.models.get("deepseek-tiny", num_layers=6, first_dense_layers=1, batch_size=32, seq_len=512,
                      hidden_size=256, ffn_hidden=512, moe_ffn_hidden=128, dtype="bfloat16")
    return al.CostTable.build(m, Cluster.preset("dgx-a100").with_(devices_per_host=4), precision="bf16")


def moe_plan(table, **kw):
    return al.megatron_plan(table=table, dp=4, tp=1, pp=1, ep=4, zero=0, microbatches=4, **kw)


def test_the_moe_all_to_alls_hide_behind_the_other_microbatchs_compute(moe_table):
    """``overlap_moe_comm`` (``--overlap-moe-expert-parallel-comm``): off by default; on, each MoE layer's forward
    all-to-alls hide behind its backward compute and its backward all-to-alls behind its forward compute, each up to
    that compute, on the share of forwards the combined 1F1B pairs with another microbatch's backward (without
    pipelining, all but the first of 4: 3/4). The dense block has no all-to-all and hides nothing."""
    from autopar_lab.pricing.overlap import paired_share

    table = moe_table
    off, on = moe_plan(table), moe_plan(table, overlap_moe_comm=True)
    assert off.stage_pins["overlap"] == () and on.stage_pins["overlap"] == ("moe_comm",)
    assert on.method == "megatron(dp=4,tp=1,pp=1,ep=4,zero=0,omc)"
    st = off.stages[0]
    g = table.solve_graph
    names = list(g.layers)
    terms = overlap_terms(g, st.intra, names, 0)
    moe_blocks = [terms[names.index(f"layer_{k}")] for k in range(1, 4)]
    assert terms[names.index("layer_0")]["a2a_fwd"] == terms[names.index("layer_0")]["a2a_bwd"] == 0
    assert all(t["a2a_fwd"] > 0 for t in moe_blocks)
    paired = paired_share("1f1b", 1, 0, 4)
    assert paired == 0.75
    hidden = paired * sum(min(terms[table.layer_map[k]]["a2a_fwd"], c.bwd_compute_s)
                          + min(terms[table.layer_map[k]]["a2a_bwd"], c.fwd_compute_s)
                          for k, c in enumerate(st.layer_costs))
    a2a = sum(terms[table.layer_map[k]]["a2a_fwd"] + terms[table.layer_map[k]]["a2a_bwd"]
              for k in range(len(st.layer_costs)))
    assert 0 < hidden <= paired * a2a
    assert off.cost.step_time_s - on.cost.step_time_s == pytest.approx(hidden, rel=1e-9)
    # the hidden seconds leave the resharding they were charged as
    assert sum(c.reshard_s for c in off.stages[0].layer_costs) - sum(c.reshard_s for c in on.stages[0].layer_costs) \
        == pytest.approx(hidden, rel=1e-9)


def test_the_moe_overlap_hides_no_more_than_the_compute_it_runs_behind(moe_table):
    """Where the other pass's compute is shorter than the all-to-alls, only that compute's worth hides."""
    import dataclasses

    from autopar_lab.pricing.overlap import overlap_layer_costs

    table = moe_table
    st = moe_plan(table).stages[0]
    names = list(table.solve_graph.layers)
    terms = overlap_terms(table.solve_graph, st.intra, names, 0)
    k = next(k for k in range(len(st.layer_costs)) if terms[table.layer_map[k]]["a2a_fwd"] > 0)
    a2a_f = terms[table.layer_map[k]]["a2a_fwd"]
    short = [dataclasses.replace(c, bwd_compute_s=a2a_f / 4) if j == k else c for j, c in enumerate(st.layer_costs)]
    out = overlap_layer_costs(table, st.intra, short, ["moe_comm"], 0)
    assert short[k].fwd_s - out[k].fwd_s == pytest.approx(a2a_f / 4, rel=1e-12)
    half = overlap_layer_costs(table, st.intra, st.layer_costs, ["moe_comm"], 0, paired=0.5)
    assert st.layer_costs[k].fwd_s - half[k].fwd_s == pytest.approx(0.5 * min(a2a_f, st.layer_costs[k].bwd_compute_s),
                                                                    rel=1e-12)


def test_the_moe_overlap_needs_expert_parallelism_and_round_trips_megatrons_flag(moe_table):
    with pytest.raises(ValueError, match="pass ep of 2 or more"):
        al.megatron_plan(table=moe_table, dp=4, tp=1, pp=1, zero=0, microbatches=4, overlap_moe_comm=True)
    on = moe_plan(moe_table, overlap_moe_comm=True)
    text = al.export_config(on, "megatron")
    assert "--overlap-moe-expert-parallel-comm" in text
    back = al.import_config(text, framework="megatron", table=moe_table)
    assert back.stage_pins["overlap"] == ("moe_comm",)
    assert "--overlap-moe-expert-parallel-comm" not in al.export_config(moe_plan(moe_table), "megatron")


def test_megatrons_grid_overlaps_the_expert_all_to_alls_where_it_splits_the_experts(moe_table):
    """The frameworks' grid turns ``--overlap-moe-expert-parallel-comm`` on with ``ep`` > 1 (Megatron-Core's combined
    1F1B, as its DeepSeek-V3 runs use it) and off without: its EP layout is the one priced above with the switch,
    faster than the same layout without it, and the layout without experts split has nothing to overlap."""
    from autopar_lab.frameworks.grid import grid

    layouts = [kw for fn, kw in grid("megatron", moe_table)]
    assert all(kw["overlap_moe_comm"] == (kw["ep"] > 1) for kw in layouts)
    kw = next(kw for kw in layouts if kw["ep"] == 4 and kw["pp"] == 1 and kw["tp"] == 1 and kw["zero"] == 0
              and kw["micro_batch_size"] == 2)
    on = al.megatron_plan(table=moe_table, **kw)
    off = al.megatron_plan(table=moe_table, **dict(kw, overlap_moe_comm=False))
    assert on.microbatches == 4 and on.stage_pins["overlap"][-1] == "moe_comm"
    assert on.cost.step_time_s < off.cost.step_time_s
    assert on.cost.step_time_s == moe_plan(moe_table, overlap_moe_comm=True, overlap_grad_reduce=True).cost.step_time_s
