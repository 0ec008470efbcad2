"""Interleaved and ZB-H1 plans: priced chunk by chunk and task by task from the layer costs, pinned like the other
stage decisions, saved and loaded, on a deep model, and from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import autopar_lab as al
from autopar_lab.graph.opgraph import BACKWARD
from autopar_lab.pricing.memory import transient_bytes
from autopar_lab.pricing.price import stage_transfers
from autopar_lab.pricing.wgrad import input_grad_ops, weight_grad_fraction
from autopar_lab.schedules import interleave
from autopar_lab.simulate import SimOptions, simulate
from autopar_lab.solve.inter import transfer_s


@pytest.fixture(scope="module")
def model():
    return al.models.get("gpt-tiny", batch_size=8, num_layers=4)  # embed, layer_0..3, head


@pytest.fixture(scope="module")
def plan(model):
    cluster = al.Cluster.preset("cpu", hosts=1)
    # the table prices the gradient reduction hidden behind the backward, as Megatron-Core's --overlap-grad-reduce
    return al.megatron_plan(model, cluster, dp=2, tp=2, pp=2, microbatches=4, sharding="ilp",
                            overlap_grad_reduce=True)


def test_interleaved_plan_is_priced_chunk_by_chunk(plan):
    q = plan.with_schedule("interleaved", 2)
    table, B, p, v = plan.table, 4, 2, 2
    assert q.schedule == "interleaved" and q.virtual_stages == 2 and q.method == plan.method
    chunks = interleave([st.layers for st in plan.stages], v)
    assert [st.chunks for st in q.stages] == chunks == [((0, 1), (4, 4)), ((2, 3), (5, 5))]
    assert [st.layers for st in q.stages] == [st.layers for st in plan.stages]  # the layout (layer counts) kept
    # every chunk is a stage of its own on its stage's mesh, by the one stage-cost formula
    parts = [[table.stage(a, b, st.submesh, st.logical_mesh, B, st.remat) for a, b in chunks[k]]
             for k, st in enumerate(plan.stages)]
    order = [parts[c % p][c // p] for c in range(p * v)]
    for k, st in enumerate(q.stages):
        assert st.fwd_s == sum(c.fwd_s for c in parts[k]) and st.bwd_s == sum(c.bwd_s for c in parts[k])
    # the transfers: one per cut between chunks, each over the link into the chunk's stage (one host: NVLink-like)
    sends = [transfer_s(table.cut_bytes[order[c].layers[0] - 1] / B, plan.cluster.intra_host)
             for c in range(1, p * v)]
    # the cpu preset's devices share one machine's cores: both stages share one host
    # a stage runs one chunk's backward at a time: of its chunks' transients it holds the largest one's
    spare = [[transient_bytes(st.layer_costs, rng, B, st.remat) for rng in chunks[k]] for k, st in enumerate(q.stages)]
    top = [s.index(max(s)) for s in spare]
    static = [order[c].static_bytes - (0.0 if c // p == top[c % p] else spare[c % p][c // p]) for c in range(p * v)]
    assert all(x > 0 for s in spare for x in s)
    want = simulate([c.fwd_s for c in order], [c.bwd_s for c in order], B, "interleaved", send_fwd_s=sends,
                    send_bwd_s=sends, virtual_stages=v,
                    options=SimOptions(act_bytes=[c.act_bytes for c in order], static_bytes=static, hosts=[0] * p))
    assert q.cost.step_time_s == want.makespan
    assert q.cost.peak_mem_bytes == want.peak_mem_bytes
    assert q.cost.stage_comm_s == pytest.approx(2 * sum(sends))
    assert q.cost.timeline.virtual_stages == 2
    # the operators' stages follow the chunks: layer 4 (layer_3) runs on stage 0
    g = q.op_graph
    op = next(n.id for n in g if n.layer == q.layer_names[4])
    assert plan.stage_of(op) == 1 and q.stage_of(op) == 0
    # shown in the report and the explanation
    rep = q.report()
    assert rep["virtual_stages"] == 2 and rep["stages"][0]["chunk_layer_names"] == [["embed", "layer_0"],
                                                                                   ["layer_3", "layer_3"]]
    assert "interleaved schedule, 2 chunks per stage" in q.cost.explain()


def test_zb_h1_splits_each_backward_into_input_and_weight_gradients(plan, model):
    g = plan.op_graph
    b_ops = input_grad_ops(g)
    names = list(g.layers)
    index = {n: k for k, n in enumerate(names)}
    for node in g:  # B: what a backward operator of an earlier layer reads, and everything it needs
        if node.role != BACKWARD:
            continue
        reads_back = any(g.op(c).role == BACKWARD and index[g.op(c).layer] < index[node.layer]
                         for t in node.outputs for c in g.consumers.get(t, ()))
        if reads_back:
            assert node.id in b_ops
        if node.id in b_ops:
            assert all(g.tensor(t).producer is None or g.op(g.tensor(t).producer).role != BACKWARD
                       or g.tensor(t).producer in b_ops for t in node.inputs)
    for name in names[1:-1]:  # each transformer layer: its weight-gradient matmuls are W, its input-gradient ones B
        mats = [n for n in g if n.layer == name and n.role == BACKWARD and n.primitive == "dot_general"]
        assert any(n.id in b_ops for n in mats) and sum(n.id not in b_ops for n in mats) == 4  # qkv, proj, fc1, fc2
    q = plan.with_schedule("zb-h1")
    table = plan.table
    for k, (st, old) in enumerate(zip(q.stages, plan.stages)):
        task = table.task_overhead_s(old.submesh)
        frac = weight_grad_fraction(table, old.intra, old.layer_costs, *old.layers)
        assert 0.05 < frac < 0.95
        assert st.wgrad_s == pytest.approx((old.bwd_s - task) * frac + task, rel=1e-12)
        assert st.bwd_s == pytest.approx(old.bwd_s + task, rel=1e-12)  # W is one more task per microbatch
    sends = stage_transfers(table, plan.stages, 4)
    # CPU devices: one host's cores run every stage
    want = simulate([st.fwd_s for st in q.stages], [st.bwd_s - st.wgrad_s for st in q.stages], 4, "zb-h1",
                    send_fwd_s=sends, send_bwd_s=sends, wgrad_s=[st.wgrad_s for st in q.stages],
                    options=SimOptions(act_bytes=[st.act_bytes for st in q.stages],
                                       static_bytes=[st.static_bytes for st in q.stages], hosts=[0] * len(q.stages)))
    assert q.cost.step_time_s == pytest.approx(want.makespan, rel=1e-12)
    assert "zero-bubble" in q.cost.explain() and q.report()["stages"][0]["wgrad_s"] > 0


def test_schedule_is_pinned_and_kept_by_every_override(plan):
    q = plan.with_schedule("interleaved", 2)
    grad = {"overlap": ("grad_reduce",)}  # the fixture's --overlap-grad-reduce, kept by every override
    assert q.stage_pins == {"schedule": "interleaved", "virtual_stages": 2, **grad}
    assert q.with_schedule("1f1b").stage_pins == {"schedule": "1f1b", **grad}  # the chunk count goes with its schedule
    assert q.with_schedule("1f1b").cost.step_time_s == plan.cost.step_time_s
    op = next(iter(q.op_graph.ops))
    r = q.with_choice(op, q.choice(op).name)
    assert (r.schedule, r.virtual_stages) == ("interleaved", 2) and r.cost.step_time_s == q.cost.step_time_s
    assert q.with_microbatches(2).virtual_stages == 2
    assert q.with_remat(1).stages[1].chunks == q.stages[1].chunks
    z = plan.with_schedule("zb-h1")
    assert z.with_microbatches(8).schedule == "zb-h1" and z.with_remat(0).stages[0].wgrad_s > 0
    res = al.resolve(plan.with_schedule("interleaved", 2).with_stages(boundaries=[3], submeshes=[(1, 4), (1, 4)],
                                                                       microbatches=4))
    assert (res.schedule, res.virtual_stages) == ("interleaved", 2)
    with pytest.raises(ValueError, match="stage 0 holds 1 layer"):
        q.with_stages(boundaries=[1])
    with pytest.raises(ValueError, match="8 microbatch.es. is not a multiple of it: choose a multiple of 3"):
        plan.with_microbatches(8).with_stages(boundaries=[2, 4], submeshes=[(1, 2), (1, 4), (1, 2)]) \
            .with_schedule("interleaved", 2)
    with pytest.raises(ValueError, match="applies to the interleaved schedule only"):
        plan.with_schedule("zb-h1", 2)


def test_plan_files_save_and_load_the_schedules(plan, model, tmp_path):
    for q in (plan.with_schedule("interleaved", 2), plan.with_schedule("zb-h1"),
              al.megatron_plan(model, plan.cluster, dp=2, tp=2, pp=2, microbatches=4, schedule="interleaved",
                               virtual_stages=2, table=plan.table)):
        path = tmp_path / "p.json"
        al.save_plan(q, path)
        data = json.loads(path.read_text())
        assert data["schedule"] == q.schedule and data.get("virtual_stages", 1) == q.virtual_stages
        back = al.load_plan(path, q.graph)
        assert back.cost.step_time_s == q.cost.step_time_s
        assert (back.schedule, back.virtual_stages, back.stage_pins) == (q.schedule, q.virtual_stages, q.stage_pins)
        assert [st.chunks for st in back.stages] == [st.chunks for st in q.stages]
    # an old file (no virtual_stages, 1f1b) loads as before; a hand-broken one is refused with the field named
    al.save_plan(plan, path)
    data = json.loads(path.read_text())
    assert "virtual_stages" not in data and al.load_plan(path, plan.graph).cost.step_time_s == plan.cost.step_time_s
    for bad, needle in ((dict(schedule="interleaved", virtual_stages=1), "does not go with"),
                        (dict(virtual_stages=3), "does not go with"),
                        (dict(schedule="zigzag"), "schedule must be one of"),
                        (dict(schedule="interleaved", virtual_stages=True), "virtual_stages must be a whole number"),
                        (dict(stage_pins={"virtual_stages": 0}), r"stage_pins\['virtual_stages'\] must be between 2")):
        path.write_text(json.dumps({**data, **bad}))
        with pytest.raises(ValueError, match=needle):
            al.load_plan(path, plan.graph)


@pytest.mark.slow  # traces GPT-1.3B and solves its meshes: ~10 s
def test_deep_model_interleaved_shrinks_the_bubble_on_gpus():
    # GPT-1.3B (24 layers + embedding and head, planned on its shallow copy) on two DGX-A100 hosts, Megatron's
    # layout with 4 stages: interleaving cuts the bubble by about v, as the formula says, and ZB-H1 cuts it too.
    model = al.models.get("gpt-1.3b")
    cluster = al.Cluster.preset("dgx-a100", hosts=2)
    base = al.megatron_plan(model, cluster, dp=2, tp=2, pp=4, microbatches=16)
    assert len(base.layer_names) == 26
    inter = base.with_schedule("interleaved", 3)
    assert all(len(st.chunks) == 3 for st in inter.stages)
    covered = sorted(r for st in inter.stages for r in st.chunks)
    assert covered[0][0] == 0 and covered[-1][1] == 25 and all(a[1] + 1 == b[0] for a, b in zip(covered, covered[1:]))
    ideal = inter.cost.step_time_s - inter.cost.bubble_s
    # by less than v = 3: the chunk with the head (a 51,200-word matmul, a larger share of a stage now that fused
    # layers cost less) is heavier than the others, and the bubble follows the heaviest chunk
    assert inter.cost.bubble_s < base.cost.bubble_s / 1.5
    assert inter.cost.bubble_s / ideal < 2 * (4 - 1) / (3 * 16)  # (p-1)/(vm), plus the transfers' share
    assert inter.cost.step_time_s < base.cost.step_time_s
    assert inter.cost.stage_comm_s > 2 * base.cost.stage_comm_s  # the price: v times the transfers
    zb = base.with_schedule("zb-h1")
    assert zb.cost.bubble_s < base.cost.bubble_s and zb.cost.step_time_s < base.cost.step_time_s
    # the last stage held one microbatch under 1F1B; under ZB-H1 its W's wait, so it holds as many as the first
    assert zb.cost.timeline.peak_inflight == (4, 4, 4, 4) and base.cost.timeline.peak_inflight == (4, 3, 2, 1)


def run_cli(*args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "autopar_lab", *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=cwd)


@pytest.mark.slow  # four command-line runs, each starting JAX: ~25 s
def test_cli_plans_with_a_schedule_from_another_directory(tmp_path):
    args = ("plan", "gpt-tiny", "--layers", "4", "--batch", "8", "--cluster", "cpu", "--method", "megatron",
            "--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "4")
    proc = run_cli(*args, "--schedule", "interleaved", "--virtual-stages", "2", "--json", "--out", "p.json",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["schedule"] == "interleaved" and out["virtual_stages"] == 2
    assert [st["chunks"] for st in out["stages"]] == [[[0, 1], [4, 4]], [[2, 3], [5, 5]]]
    assert json.loads((tmp_path / "p.json").read_text())["virtual_stages"] == 2
    human = run_cli(*args, "--schedule", "zb-h1", cwd=tmp_path)
    assert human.returncode == 0 and "zb-h1" in human.stdout
    for extra, needle in ((("--schedule", "zb-h1", "--virtual-stages", "2"), "--virtual-stages applies to"),
                          (("--schedule", "interleaved", "--virtual-stages", "4"), "fewer than the 4 virtual stages"),
                          (("--schedule", "zigzag"), "invalid choice")):
        bad = run_cli(*args, *extra, cwd=tmp_path)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and needle in bad.stderr, bad.stderr
        if needle != "invalid choice":  # argparse prints its usage first; ours is one sentence
            assert len(bad.stderr.strip().splitlines()) == 1


def test_timeline_view_shows_chunks_and_weight_gradients(plan):
    pytest.importorskip("ipywidgets")
    from autopar_lab.widgets.views import figures
    from autopar_lab.widgets.views.stage_layout import StageLayout, stage_blocks
    from autopar_lab.widgets.views.timeline import TimelineView

    session = al.Session(plan)
    view = TimelineView(session)
    layout = StageLayout(session)
    layout.schedule.value = "interleaved"  # the stage layout's toggle: the default 2 chunks per stage, previewed
    layout.apply_run()
    assert session.plan.schedule == "interleaved" and session.plan.virtual_stages == 2
    assert "chunks 0-1, 4-4 (3 layers)" in stage_blocks(session.plan)[0]["label"]
    view.refresh()
    names = [t.name for t in view.figure.data]
    assert names[:4] == ["fwd chunk 1/2", "fwd chunk 2/2", "bwd chunk 1/2", "bwd chunk 2/2"] and "bubble" in names
    colours = {t.name: t.marker.color for t in view.figure.data}
    assert len({colours[n] for n in names[:4]}) == 4  # each chunk of each kind in its own shade
    bars = {t.name: len(t.x) for t in view.figure.data}
    assert bars["fwd chunk 1/2"] == bars["fwd chunk 2/2"] == 2 * 4  # two stages x four microbatches per chunk
    assert "interleaved (2 chunks per stage)" in view.figure.layout.title.text and "told apart" in view.caption.value
    layout.schedule.value = "zb-h1"
    layout.apply_run()
    tl = session.plan.cost.timeline
    view.refresh()
    bars = {t.name: len(t.x) for t in view.figure.data}
    assert bars["W (weight grad)"] == bars["B (input grad)"] == bars["fwd"] == 2 * 4
    assert "deferred" in view.caption.value
    # a W task is work, not bubble: each stage's gaps are the step minus its busy time
    rows = tl.to_rows()
    idle = figures.idle_intervals(rows, tl.makespan)
    for i in range(2):
        gaps = sum(r["end"] - r["start"] for r in idle if r["stage"] == i)
        assert gaps == pytest.approx(tl.makespan - tl.busy_s[i], rel=1e-9)


def test_memory_export_and_views_follow_an_interleaved_stage_chunks(plan):
    from autopar_lab.memory import memory_breakdown
    from autopar_lab.widgets.views.graph import _layer_stage

    q = plan.with_schedule("interleaved", 2)
    rows, before = memory_breakdown(q), memory_breakdown(plan)
    for r, st in zip(rows, q.stages):
        assert r["activations_bytes"] == st.peak_mem_bytes - st.static_bytes
        assert r["total_bytes"] == st.peak_mem_bytes
    # the same layers in all, on the same mesh: the parameters move between stages but add up the same
    assert sum(r["params_bytes"] for r in rows) == pytest.approx(sum(r["params_bytes"] for r in before))
    assert "(layers 0..1, 4..4)" in q.to_jax_code(0)
    assert _layer_stage(q, list(q.layer_names)) == {"embed": 0, "layer_0": 0, "layer_1": 1, "layer_2": 1,
                                                    "layer_3": 0, "head": 1}
