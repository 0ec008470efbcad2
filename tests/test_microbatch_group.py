"""The interleaved schedule's microbatch group (Megatron-LM's ``--microbatch-group-size-per-virtual-pipeline-stage``,
Llama 3's tunable N): the warm-up and order against Megatron-LM's formula and schedule table counted by hand, the
memory it moves, the default reproducing today's plans, Llama 3 405B's first row priced with every N Megatron-LM
accepts, the import and export of the flag, and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopar_lab as al
from autopar_lab.pricing import CostTable
from autopar_lab.pricing.memory import memory_breakdown
from autopar_lab.schedules import check_group, group_order, warmup_chunks
from autopar_lab.simulate import SimOptions, simulate, task_order
from autopar_lab.solve.inter import held_microbatches

GIB = 2 ** 30


def test_warmup_is_megatrons_count_by_hand():
    # p = 4 stages, v = 2 chunks, M = 8 microbatches. Megatron-LM's warm-up on rank r is 2(p - 1 - r) + (v - 1)N
    # chunk forwards, and the steady state's first forward comes before the first backward:
    # N = 4 (its default, p): 6 + 4, 4 + 4, 2 + 4, 0 + 4, plus one; N = 8 (M): 6 + 8, 4 + 8, 2 + 8, 0 + 8, plus one.
    assert [warmup_chunks(r, 4, 8, 2) for r in range(4)] == [11, 9, 7, 5]
    assert [warmup_chunks(r, 4, 8, 2, group=4) for r in range(4)] == [11, 9, 7, 5]
    assert [warmup_chunks(r, 4, 8, 2, group=8) for r in range(4)] == [15, 13, 11, 9]
    # at most the M v chunk forwards there are: v = 3, 6 + 16 + 1 = 23 of 24; M = N = 6: 6 + 6 + 1 = 13 > 12
    assert warmup_chunks(0, 4, 8, 3, group=8) == 23 and warmup_chunks(0, 4, 6, 2, group=6) == 12
    # the stage DP's memory holds the same count, in units of a whole stage's activations (v chunks)
    assert held_microbatches(3, 8, "interleaved", 4, 2, group=8) * 2 == warmup_chunks(1, 4, 8, 2, group=8) == 13


def test_group_order_is_megatrons_schedule_table():
    # Megatron-LM's own example in schedules.py (PP 2, N 3, M 5, VP 2):
    # microbatch_id 0 1 2 0 1 2 3 4 3 4, model_chunk_id 0 0 0 1 1 1 0 0 1 1
    table = group_order(5, 2, 3)
    assert [j for _, j in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [r for r, _ in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    # a stage's forwards follow it, and its backwards the same table with the chunks reversed
    order = task_order(0, 2, 5, "interleaved", virtual_stages=2, group=3)
    fwd = [(c // 2, j) for kind, c, j in order if kind == "fwd"]
    bwd = [(1 - c // 2, j) for kind, c, j in order if kind == "bwd"]
    assert fwd == table and bwd == table


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 12, 2), (3, 9, 3), (2, 5, 2)])
def test_every_accepted_group_runs_and_holds_its_warmup(p, m, v):
    groups = [n for n in range(1, m + 2) if p <= n <= m and not 0 < m % n < p]
    assert groups[-1] == m and (groups[0] == p) == (m % p == 0)
    fwd = [1.0 + 0.1 * (c % 3) for c in range(p * v)]
    for n in groups:
        tl = simulate(fwd, [2 * f for f in fwd], m, "interleaved", virtual_stages=v,
                      options=SimOptions(microbatch_group=n))
        assert list(tl.peak_inflight) == [warmup_chunks(r, p, m, v, n) for r in range(p)], n
        for r in range(p):
            kinds = [kind for kind, _, _ in task_order(r, p, m, "interleaved", virtual_stages=v, group=n)]
            assert kinds.index("bwd") == warmup_chunks(r, p, m, v, n)
            assert len(kinds) == 2 * m * v


def test_bad_groups_say_what_megatron_accepts():
    between = "between the stage count (4) and the microbatch count (8)"
    short = "leaves a last group of 3 of the 8 microbatches, fewer than the 4 stages"
    for n, needles in ((2, [between, "pass microbatch_group between 4 and 8"]), (9, [between]),
                       (5, [short, "pass one of 4, 8"]),
                       (True, ["whole number"]), (4.0, ["whole number"])):
        with pytest.raises(ValueError, match="microbatch_group") as e:
            check_group(n, 4, 8)
        assert all(needle in str(e.value) for needle in needles), str(e.value)
    with pytest.raises(ValueError, match="stage count"):
        simulate([1.0] * 8, [2.0] * 8, 8, "interleaved", virtual_stages=2, options=SimOptions(microbatch_group=2))


@pytest.fixture(scope="module")
def tiny():
    model = al.models.get("llama3-tiny", num_layers=8, batch_size=32, dtype="bfloat16")
    return model, CostTable.build(model, al.Cluster.parse("dgx-h100:1"), precision="bf16")


@pytest.fixture(scope="module")
def table(tiny):
    return tiny[1]


KW = dict(dp=2, tp=1, pp=4, micro_batch_size=2, schedule="interleaved", virtual_stages=2, precision="bf16")


def test_default_group_is_the_stage_count_and_changes_nothing(table):
    base = al.megatron_plan(table=table, **KW)
    same = al.megatron_plan(table=table, microbatch_group=4, **KW)
    assert base.microbatches == 8 and "microbatch_group" not in base.stage_pins
    assert same.stage_pins["microbatch_group"] == 4 and same.method.endswith(",v=2,group=4)")
    assert same.cost.step_time_s == base.cost.step_time_s
    assert same.cost.peak_mem_bytes == base.cost.peak_mem_bytes
    assert same.cost.timeline.peak_inflight == base.cost.timeline.peak_inflight


def test_a_larger_group_holds_exactly_the_added_chunk_microbatches(table):
    p4 = al.megatron_plan(table=table, **KW)
    p8 = al.megatron_plan(table=table, microbatch_group=8, **KW)
    m4, m8 = memory_breakdown(p4), memory_breakdown(p8)
    assert [m["microbatches_in_flight"] for m in m4] == [11, 9, 7, 5]  # the hand count above
    assert [m["microbatches_in_flight"] for m in m8] == [15, 13, 11, 9]
    for k, (a, b) in enumerate(zip(p4.stages, p8.stages)):
        assert a.static_bytes == b.static_bytes and a.act_bytes == b.act_bytes
    # stages 1 and 2 run one block in each chunk: (v - 1)(8 - 4) = 4 more chunk-microbatches, a chunk's each
    for k in (1, 2):
        st = p4.stages[k]
        assert [b - a for a, b in st.chunks] == [0, 0]
        chunk_act = st.act_bytes / 2
        assert p8.stages[k].peak_mem_bytes - st.peak_mem_bytes == pytest.approx(4 * chunk_act, rel=1e-9)
    # the priced timeline runs the grouped order: each stage's first backward after its warm-up
    for plan, n in ((p4, 4), (p8, 8)):
        for k in range(4):
            kinds = [t.kind for t in sorted((t for t in plan.cost.timeline.tasks if t.stage == k
                                             and t.kind in ("fwd", "bwd")), key=lambda t: t.start)]
            assert kinds.index("bwd") == warmup_chunks(k, 4, 8, 2, n)


def test_group_is_checked_where_the_plan_is_made(table):
    with pytest.raises(ValueError, match="between the stage count"):
        al.megatron_plan(table=table, microbatch_group=2, **KW)
    with pytest.raises(ValueError, match="interleaved schedule only"):
        al.megatron_plan(table=table, dp=2, tp=1, pp=4, micro_batch_size=2, precision="bf16", microbatch_group=4)
    # a microbatch count the group cannot run is refused on re-pricing too
    plan = al.megatron_plan(table=table, microbatch_group=8, **KW)
    with pytest.raises(ValueError, match="microbatch_group=8"):
        plan.with_microbatches(4)


def test_resolve_keeps_the_group_and_the_stage_dp_holds_its_warmup(table):
    plan = al.megatron_plan(table=table, microbatch_group=8, **KW)
    res = al.resolve(plan)
    S, M = len(res.stages), res.microbatches
    assert res.stage_pins["microbatch_group"] == 8 and S <= 8 <= M and not 0 < M % 8 < S  # a layout N = 8 runs
    assert list(res.cost.timeline.peak_inflight) == [warmup_chunks(k, S, M, 2, 8) for k in range(S)]


def test_a_saved_plan_keeps_its_group(tiny, tmp_path):
    model, table = tiny
    plan = al.megatron_plan(table=table, microbatch_group=8, **KW)
    al.save_plan(plan, tmp_path / "p.json")
    back = al.load_plan(tmp_path / "p.json", model)
    assert back.stage_pins["microbatch_group"] == 8 and back.cost.peak_mem_bytes == plan.cost.peak_mem_bytes


def test_megatron_flag_is_read_priced_and_written_back(tiny):
    model, table = tiny
    text = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 "
            "--num-layers-per-virtual-pipeline-stage 1 --micro-batch-size 2 --global-batch-size 32 --bf16 "
            "--microbatch-group-size-per-virtual-pipeline-stage 8")
    cluster = al.Cluster.parse("dgx-h100:1")
    plan = al.import_config(text, model, table=table, cluster=cluster)
    direct = al.megatron_plan(table=table, microbatch_group=8, **KW)
    assert plan.stage_pins["microbatch_group"] == 8
    assert plan.cost.step_time_s == direct.cost.step_time_s and plan.cost.peak_mem_bytes == direct.cost.peak_mem_bytes
    out = al.export_config(plan, "megatron", model=model)
    assert "--microbatch-group-size-per-virtual-pipeline-stage 8" in out
    # the default is not written (Megatron-LM's default is the pipeline size)
    assert "microbatch-group" not in al.export_config(al.megatron_plan(table=table, **KW), "megatron", model=model)
    with pytest.raises(ValueError, match="--microbatch-group-size-per-virtual-pipeline-stage 5 leaves a last group"):
        al.import_config(text.replace("stage 8", "stage 5"), model, table=table, cluster=cluster)
    flat = al.import_config(text.replace("--num-layers-per-virtual-pipeline-stage 1 ", ""), model, table=table,
                            cluster=cluster)
    assert "microbatch_group" not in flat.stage_pins and any("not read" in n for n in flat.notes)


def test_llama3_405b_first_row_priced_with_every_group_megatron_accepts():
    """Llama 3 405B's first row (bench_fidelity's): 32 microbatches over 16 stages, so Megatron-LM accepts N = 16
    (its default) and N = 32. The default is the least memory; N = 32 holds 16 more chunk-microbatches per rank."""
    model = al.models.get("llama3-405b", seq_len=8192, batch_size=2048)
    table = CostTable.build(model, al.Cluster.preset("dgx-h100", 1024), precision="bf16")
    kw = dict(dp=64, tp=8, pp=16, micro_batch_size=1, zero=2, sequence_parallel=True, precision="bf16",
              schedule="interleaved", virtual_stages=2)
    plans = {n: al.megatron_plan(table=table, microbatch_group=n, **kw) for n in (None, 16, 32)}
    assert [n for n in range(1, 40) if 16 <= n <= 32 and not 0 < 32 % n < 16] == [16, 32]
    rows = {n: memory_breakdown(p) for n, p in plans.items()}
    assert plans[16].cost.peak_mem_bytes == plans[None].cost.peak_mem_bytes
    assert plans[16].cost.step_time_s == plans[None].cost.step_time_s
    for n in (16, 32):
        assert [r["microbatches_in_flight"] for r in rows[n]] == [warmup_chunks(k, 16, 32, 2, n) for k in range(16)]
    assert rows[16][1]["microbatches_in_flight"] == 45 and rows[32][1]["microbatches_in_flight"] == 61
    # every rank holds 16 more chunk-microbatches with N = 32, and more memory: no N Megatron-LM runs fits less
    for a, b in zip(rows[16], rows[32]):
        assert b["microbatches_in_flight"] - a["microbatches_in_flight"] == 16
        assert b["total_bytes"] > a["total_bytes"] and b["activations_bytes"] > a["activations_bytes"]
    assert min(plans[16].cost.peak_mem_bytes) < min(plans[32].cost.peak_mem_bytes)


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "autopar_lab", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def test_cli_microbatch_group_from_another_directory(tmp_path):
    args = ("plan", "llama3-tiny", "--layers", "8", "--batch", "32", "--dtype", "bfloat16", "--cluster",
            "dgx-h100:1", "--method", "megatron", "--dp", "2", "--tp", "1", "--pp", "4", "--micro-batch-size", "2",
            "--precision", "bf16", "--schedule", "interleaved", "--virtual-stages", "2")
    proc = run_cli(*args, "--microbatch-group", "8", "--json", "--out", "p.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [m["microbatches_in_flight"] for m in out["memory"]] == [15, 13, 11, 9]
    assert json.loads((tmp_path / "p.json").read_text())["stage_pins"]["microbatch_group"] == 8
    for extra, needle in ((("--microbatch-group", "2"), "between the stage count (4)"),
                          (("--microbatch-group", "6"), "pass one of 4, 8")):
        bad = run_cli(*args, *extra, cwd=tmp_path)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and needle in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    bad = run_cli(*args[:-4], "--microbatch-group", "8", cwd=tmp_path)
    assert bad.returncode == 2 and "--microbatch-group orders the interleaved schedule" in bad.stderr
