"""The interleaved schedule's microbatch group (Megatron-LM's ``--microbatch-group-size-per-virtual-pipeline-stage``,
Llama 3's tunable N): the warm-up and order against Megatron-LM's formula and schedule table counted by hand, the
memory it moves, the default reproducing today's plans, Llama 3 405B's first row priced with every N Megatron-LM
accepts, the import and export of the flag, and the command line; Llama 3's flexible schedule (FlexibleGroup): one
group of fewer microbatches than stages against a hand simulation, and why a group below the stages beside others is
refused."""

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
from autopar_lab.schedules import FlexibleGroup, check_group, group_order, warmup_chunks
from autopar_lab.simulate import ScheduleStuck, SimOptions, issue_order, simulate, task_order
from autopar_lab.solve.inter import held_microbatches

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_fidelity as fidelity  # noqa: E402 - the benchmark is a script beside the package

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


def hand_orders(p: int, v: int, m: int, n: int, warm: list[int]) -> list[list[tuple[str, int, int]]]:
    """Each stage's tasks written out from the schedule's rule, not the library's: groups of n microbatches through
    rounds 0..v-1 (forwards) and v-1..0 (backwards), warm[i] forwards first, then a backward and a forward in turn."""
    table = [(r, j) for g in range(0, m, n) for r in range(v) for j in range(g, min(g + n, m))]
    out = []
    for i in range(p):
        fwd = [("fwd", r * p + i, j) for r, j in table]
        bwd = [("bwd", (v - 1 - r) * p + i, j) for r, j in table]
        w = min(warm[i], m * v)
        order = fwd[:w]
        for k in range(m * v - w):
            order += [bwd[k], fwd[w + k]]
        out.append(order + bwd[m * v - w:])
    return out


def hand_simulation(p: int, v: int, m: int, orders, fwd_s: float, bwd_s: float) -> tuple[float, list[int]]:
    """(makespan, most chunk-microbatches each stage holds) of ``orders`` run task by task: a stage's next task starts
    when the stage is free and its input is there (a chunk's forward after the chunk before's, a backward after its
    own forward and the next chunk's backward), no transfer time; a chunk-microbatch is held from its forward's
    start to its backward's end."""
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    spans: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    start_f: dict[tuple[int, int], float] = {}

    def ready(i, kind, c, j):
        need = [("fwd", c - 1, j)] if kind == "fwd" and c else []
        if kind == "bwd":
            need = [("fwd", c, j)] + ([("bwd", c + 1, j)] if c < p * v - 1 else [])
        return all(x in done for x in need)

    for i, kind, c, j in issue_order(orders, ready):
        deps = [done[("fwd", c - 1, j)]] if kind == "fwd" and c else []
        if kind == "bwd":
            deps = [done[("fwd", c, j)]] + ([done[("bwd", c + 1, j)]] if c < p * v - 1 else [])
        t0 = max([free[i], *deps])
        free[i] = done[(kind, c, j)] = t0 + (fwd_s if kind == "fwd" else bwd_s)
        if kind == "fwd":
            start_f[(c, j)] = t0
        else:
            spans[i].append((start_f[(c, j)], free[i]))
    peak = [max(sum(1 for a, b in sp if a <= t < b) for t, _ in sp) for sp in spans]
    return max(free), peak


def test_flexible_group_of_fewer_microbatches_than_stages_matches_a_hand_simulation():
    """p = 4 stages, v = 2 chunks: Llama 3's schedule runs M < p microbatches as one group N = M (Megatron-LM asks
    M >= p), with the warm-up 2(p - 1 - i) + (v - 1)N + 1 (PyTorch's ScheduleInterleaved1F1B's); its timing and
    memory are those of the same order run task by task, for N = 1..4."""
    p, v = 4, 2
    for n in range(1, 5):
        group = FlexibleGroup(n)
        warm = [m_v if n == p else min(2 * (p - 1 - i) + (v - 1) * n + 1, m_v) for i in range(p) for m_v in [n * v]]
        assert [warmup_chunks(i, p, n, v, group) for i in range(p)] == warm
        orders = hand_orders(p, v, n, n, warm)
        assert [task_order(i, p, n, "interleaved", virtual_stages=v, group=group) for i in range(p)] == orders
        tl = simulate([1.0] * (p * v), [2.0] * (p * v), n, "interleaved", virtual_stages=v,
                      options=SimOptions(microbatch_group=group))
        makespan, peak = hand_simulation(p, v, n, orders, 1.0, 2.0)
        assert tl.makespan == makespan and list(tl.peak_inflight) == peak, n
        assert peak == [min(w, n * v) for w in warm]
    # by hand: one microbatch goes through the 8 chunks and back, nothing overlaps: 8 x 1 + 8 x 2 seconds, and
    # each stage holds its 2 chunks of it
    tl = simulate([1.0] * 8, [2.0] * 8, 1, "interleaved", virtual_stages=2,
                  options=SimOptions(microbatch_group=FlexibleGroup(1)))
    assert tl.makespan == 24.0 and tl.peak_inflight == (2, 2, 2, 2)
    # Megatron-LM's rule refuses the same group, and says how to ask for Llama 3's
    with pytest.raises(ValueError, match=r"FlexibleGroup\(2\) or --flexible-group"):
        check_group(2, 4, 2)


def test_a_flexible_group_below_the_stages_beside_others_is_refused_for_holding_more():
    """N < p <= M: with the warm-up formula the order stalls for good (a stage's backward waits on a forward queued
    behind it on another stage), and the least uniform addition to every stage's warm-up that runs holds no fewer
    chunk-microbatches than N = p does (more for N = 1, 2); so the flexible group below p is only the one-group
    case."""
    p, v, m = 4, 2, 8

    def runs(n: int, extra: int) -> bool:
        done: set = set()
        warm = [2 * (p - 1 - i) + (v - 1) * n + 1 + extra for i in range(p)]

        def ready(i, kind, c, j):
            if kind == "fwd":
                return c == 0 or ("fwd", c - 1, j) in done
            return ("fwd", c, j) in done and (c == p * v - 1 or ("bwd", c + 1, j) in done)
        try:
            for _i, *task in issue_order(hand_orders(p, v, m, n, warm), ready):
                done.add(tuple(task))
        except ScheduleStuck:
            return False
        return True

    least = warmup_chunks(0, p, m, v)  # N = p: 11 on stage 0
    for n in (1, 2, 3):
        assert not runs(n, 0)
        extra = next(x for x in range(m * v) if runs(n, x))
        held = min(2 * (p - 1) + (v - 1) * n + 1 + extra, m * v)
        assert held > least if n < 3 else held == least, n  # N = 1, 2: 16 of 16; N = 3: 11, no fewer
        with pytest.raises(ValueError, match="only as one group of all the microbatches"):
            check_group(FlexibleGroup(n), p, m)
    assert runs(p, 0)


def test_a_flexible_plan_saves_loads_and_megatron_export_refuses_it(tiny, tmp_path):
    model, table = tiny
    kw = {**KW, "micro_batch_size": 8}  # 32 sequences over dp 2: 2 microbatches, fewer than the 4 stages
    with pytest.raises(ValueError, match="multiple of it"):
        al.megatron_plan(table=table, **kw)
    plan = al.megatron_plan(table=table, microbatch_group=FlexibleGroup(2), **kw)
    assert plan.microbatches == 2 and plan.method.endswith(",v=2,group=2,flexible)")
    assert [m["microbatches_in_flight"] for m in memory_breakdown(plan)] == [4, 4, 4, 3]
    al.save_plan(plan, tmp_path / "p.json")
    pins = json.loads((tmp_path / "p.json").read_text())["stage_pins"]
    assert pins["microbatch_group"] == 2 and pins["flexible_group"] is True
    back = al.load_plan(tmp_path / "p.json", model)
    assert isinstance(back.stage_pins["microbatch_group"], FlexibleGroup)
    assert back.cost.peak_mem_bytes == plan.cost.peak_mem_bytes and back.cost.step_time_s == plan.cost.step_time_s
    with pytest.raises(ValueError, match="cannot run") as e:
        al.export_config(plan, "megatron", model=model)
    assert "\n" not in str(e.value)
    # a flexible group Megatron-LM also accepts exports as Megatron-LM's flag
    same = al.megatron_plan(table=table, microbatch_group=FlexibleGroup(8), **KW)
    assert "--microbatch-group-size-per-virtual-pipeline-stage 8" in al.export_config(same, "megatron", model=model)


def test_cli_flexible_group_from_another_directory(tmp_path):
    args = ("plan", "llama3-tiny", "--layers", "8", "--batch", "32", "--dtype", "bfloat16", "--cluster",
            "dgx-h100:1", "--method", "megatron", "--dp", "2", "--tp", "1", "--pp", "4", "--micro-batch-size", "8",
            "--precision", "bf16", "--schedule", "interleaved", "--virtual-stages", "2", "--microbatch-group", "2")
    proc = run_cli(*args, "--flexible-group", "--json", "--out", "p.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [m["microbatches_in_flight"] for m in json.loads(proc.stdout)["memory"]] == [4, 4, 4, 3]
    assert json.loads((tmp_path / "p.json").read_text())["stage_pins"]["flexible_group"] is True
    for extra, needle in (((), "--flexible-group runs them as one group"),
                          (("--flexible-group", "--microbatch-group", "1"), "only as one group")):
        bad = run_cli(*args, *extra, cwd=tmp_path)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and needle in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    bad = run_cli(*args[:-2], "--flexible-group", cwd=tmp_path)
    assert bad.returncode == 2 and "add --microbatch-group N" in bad.stderr


def test_llama3_405b_row_fits_with_one_layer_chunks_and_refuses_a_flexible_group_below_its_stages():
    """bench_fidelity's Llama 3 405B row as priced: 8 one-layer chunks a stage (the paper's first chunk holding only
    the embedding), N = 16, Transformer Engine's kernels. It fits 80 GB: each stage holds 2(15 - rank) + 7 x 16 + 1
    one-layer chunk-microbatches and one chunk's backward transients (a stage runs one chunk's backward at a time:
    as many as with 4-layer chunks, not 8 chunks' worth). Llama 3's flexible N runs 16 as Megatron-LM does, and
    refuses N = 8 beside other groups (32 microbatches over 16 stages)."""
    r = fidelity.TODAY["llama3-405b"]
    assert r.plan_kw["virtual_stages"] == 8 and "microbatch_group" not in r.plan_kw
    plan = fidelity.today_plan(r)
    rows = memory_breakdown(plan)
    assert plan.cost.fits and max(m["total_bytes"] for m in rows) < 80 * GIB
    assert [m["microbatches_in_flight"] for m in rows] == [warmup_chunks(k, 16, 32, 8) for k in range(16)]
    assert rows[1]["microbatches_in_flight"] == 2 * 14 + 7 * 16 + 1 == 141
    assert plan.stages[0].chunks[0] == (0, 0) and plan.table.layer_names[0] == "embed"
    kw = {**r.plan_kw}
    flex = al.megatron_plan(table=plan.table, **{**kw, "microbatch_group": FlexibleGroup(16)})
    assert flex.cost.step_time_s == plan.cost.step_time_s and flex.cost.peak_mem_bytes == plan.cost.peak_mem_bytes
    with pytest.raises(ValueError, match="only as one group of all the microbatches"):
        al.megatron_plan(table=plan.table, **{**kw, "microbatch_group": FlexibleGroup(8)})
    four = memory_breakdown(al.megatron_plan(table=plan.table, **{**kw, "virtual_stages": 2}))
    assert rows[1]["buffers_bytes"] == pytest.approx(four[1]["buffers_bytes"], rel=0.05)
