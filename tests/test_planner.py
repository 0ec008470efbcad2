"""Whole plans: the auto plan against the baselines under one cost model, the report, the CLI."""

import dataclasses
import json
import math

import pytest

import autopar_lab as al
from autopar_lab import planner
from autopar_lab.cluster import Cluster
from autopar_lab.solve.inter import StageProblem

# Two hosts of two devices: every submesh shape (1x1, 1x2, 2x2) and both links appear, and the ILPs stay small.
SMALL = Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=2)


def small_problem(table, kw):
    """The stage problem of ``table``'s layers on SMALL, with the stage DP's settings ``kw``."""
    return StageProblem(len(table.layer_names), SMALL.hosts, SMALL.devices_per_host, **kw)


@pytest.fixture(scope="module")
def result(model):
    return planner.compare(model, SMALL, microbatches="auto")


def test_auto_is_no_worse_than_megatron_and_data_parallel(result):
    auto, best, data = result["auto"], result["megatron_best"], result["data_parallel"]
    assert best is not None and result["megatron_tried"]
    assert auto.cost.step_time_s <= best.cost.step_time_s * (1 + 1e-9)
    assert auto.cost.step_time_s <= data.cost.step_time_s * (1 + 1e-9)


def test_plan_covers_every_layer_and_device_once(result, model):
    plan = result["auto"]
    layers = [k for st in plan.stages for k in range(st.layers[0], st.layers[1] + 1)]
    assert layers == list(range(len(plan.layer_names)))
    devices = [d for st in plan.stages for d in st.devices]
    assert devices == list(range(SMALL.num_devices))
    # Every operator of the step has a strategy in the stage that runs it.
    g = plan.graph
    assert plan.choice(next(o for o in g.ops if g.op(o).primitive == "dot_general")) is not None


def test_cost_terms_add_up_to_the_step_time(result):
    for plan in (result["auto"], result["data_parallel"], result["megatron_best"]):
        c = plan.cost
        assert math.isclose(c.compute_s + c.comm_s + c.reshard_s + c.bubble_s, c.step_time_s, rel_tol=1e-9)
        assert c.step_time_s == pytest.approx(c.timeline.makespan)
        assert "step time" in c.explain()


def test_report_has_the_promised_keys(result):
    rep = result["auto"].report("gpt-tiny")
    for key in ("model", "cluster", "method", "step_time_s", "samples_per_s", "compute_s", "comm_s", "reshard_s",
                "stage_comm_s", "bubble_s", "peak_mem_bytes", "mem_limit_bytes", "microbatches", "stages", "solve_s"):
        assert key in rep
    for key in ("layers", "submesh", "logical_mesh", "remat"):
        assert key in rep["stages"][0]
    for key in ("trace", "intra", "inter", "total"):
        assert key in rep["solve_s"]
    json.dumps(rep)


def test_megatron_layout_is_what_was_asked(model):
    p = planner.megatron_plan(model, SMALL, dp=1, tp=2, pp=2, microbatches=2)
    assert [s.submesh for s in p.stages] == [(1, 2), (1, 2)]
    assert [s.logical_mesh for s in p.stages] == [(1, 2), (1, 2)]
    assert p.stages[0].layers == (0, 1) and p.stages[1].layers == (2, 3)
    with pytest.raises(ValueError, match="devices"):
        planner.megatron_plan(model, SMALL, dp=2, tp=2, pp=2)
    with pytest.raises(ValueError, match="inside a host"):
        planner.megatron_plan(model, SMALL, dp=1, tp=4, pp=1)


def test_megatron_grid_is_valid():
    grid = planner.megatron_grid(Cluster.preset("p3.16xlarge", hosts=2), num_layers=24)
    assert (2, 8, 1) in grid and (16, 1, 1) in grid and (1, 8, 2) in grid
    assert all(dp * tp * pp == 16 for dp, tp, pp in grid)


# ---------------------------------------------------------------- planning speed-ups keep the answer


def _subs(table):
    return [tuple(s) for s in table.cluster.submesh_shapes()]


def test_vectorised_candidates_equal_the_scalar_ones(result):
    table = result["auto"].table
    L = len(table.layer_names)
    for B in (1, 4):
        fn = table.candidate_fn(B)
        for sub in _subs(table):
            for a in range(L):
                for b in range(a, L):
                    want = table.candidates(a, b, sub, B)
                    got = fn(a, b, sub)
                    assert [(c.logical_mesh, c.remat, c.fwd_s, c.bwd_s, c.static_bytes, c.act_bytes) for c in got] \
                        == [(c.logical_mesh, c.remat, c.fwd_s, c.bwd_s, c.static_bytes, c.act_bytes) for c in want]
    # With a memory limit, exactly the candidates that cannot fit holding one microbatch are gone.
    limit = sorted(c.static_bytes + c.act_bytes for c in table.candidates(0, L - 1, (1, 1), 2))[0] * 0.9
    fn = table.candidate_fn(2, limit)
    for sub in _subs(table):
        for a in range(L):
            for b in range(a, L):
                want = [c for c in table.candidates(a, b, sub, 2) if c.static_bytes + c.act_bytes <= limit]
                assert [(c.logical_mesh, c.remat) for c in fn(a, b, sub)] == [(c.logical_mesh, c.remat) for c in want]


def _reference(table, cluster, choices, **kw):
    from autopar_lab.solve import inter
    problem = inter.StageProblem(len(table.layer_names), cluster.hosts, cluster.devices_per_host, **kw)
    return inter.stage_dp_auto(problem,
                               lambda a, b, sub, B: table.candidates(a, b, sub, B), table.batch_size,
                               choices=choices, cut_bytes=lambda B: [c / B for c in table.cut_bytes])


def test_microbatch_search_matches_stage_dp_auto(result):
    """Largest count first, stopping where nothing fits, gives stage_dp_auto's plan, latency and table; memory
    limits from roomy to impossible, so that small counts (or all) fail."""
    from autopar_lab.solve import inter
    table = result["auto"].table
    choices = planner.microbatch_choices(table.batch_size, "auto")
    base = dict(intra_link=SMALL.intra_host, inter_link=SMALL.inter_host, stage_comm="model", schedule="1f1b",
                max_stages=None)

    def need(B):  # the smallest memory limit under which B microbatches fit
        with pytest.raises(inter.NoFeasiblePlanError) as e:
            _reference(table, SMALL, [B], mem_limit_bytes=1.0, **base)
        return e.value.min_mem_bytes

    lo, hi = need(max(choices)), need(min(choices))
    assert lo < hi  # fewer microbatches hold more activations
    seen_partial = False
    for mem in (math.inf, hi * 1.5, hi, (lo + hi) / 2, lo, lo * 0.99, 1.0):
        kw = dict(mem_limit_bytes=mem, intra_link=SMALL.intra_host, inter_link=SMALL.inter_host,
                  stage_comm="model", schedule="1f1b", max_stages=None)
        try:
            want = _reference(table, SMALL, choices, **kw)
        except inter.NoFeasiblePlanError as e:
            with pytest.raises(inter.NoFeasiblePlanError) as got:
                planner.search_microbatches(table, small_problem(table, kw), choices)
            assert str(got.value) == str(e) and got.value.min_mem_bytes == e.min_mem_bytes
            continue
        got = planner.search_microbatches(table, small_problem(table, kw), choices)
        assert got.latency_s == want.latency_s and got.microbatches == want.microbatches
        assert [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in got.stages] == \
            [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in want.stages]
        table_b = want.diagnostics["by_microbatches"]
        mine = got.diagnostics["by_microbatches"]
        assert mine.keys() == table_b.keys()
        for B, t in table_b.items():  # a count that cannot beat the best is cut short: inf
            assert mine[B] == t or (mine[B] == math.inf and t is not None and t >= got.latency_s)
        seen_partial |= None in table_b.values()
    assert seen_partial  # some limit made the small counts fail while larger ones fitted


def test_mesh_twins_cost_the_same(model):
    """A logical mesh with one split axis is solved once: its twin with the axis swapped costs the same."""
    table = planner.CostTable.build(model, SMALL)
    for sub in [(1, 2), (2, 2)]:
        shapes = SMALL.logical_mesh_shapes(sub)
        kept = planner.distinct_mesh_shapes(SMALL, sub)
        assert kept[0] == (1, sub[0] * sub[1]) and (sub[0] * sub[1], 1) not in kept and set(kept) <= set(shapes)
        a, _ = table.mesh_costs(sub, (1, sub[0] * sub[1]))
        b, _ = table.mesh_costs(sub, (sub[0] * sub[1], 1))
        for x, y in zip(a, b):
            assert x.fwd_s + x.bwd_s == pytest.approx(y.fwd_s + y.bwd_s, rel=1e-9)
            assert x.static_bytes == pytest.approx(y.static_bytes) and x.act_bytes == pytest.approx(y.act_bytes)


def test_stage_dp_upper_bound():
    """The bound the microbatch search hands to the DP: above the optimum the same plan, below it None, and
    infeasibility is still an error."""
    from autopar_lab.solve import inter

    def cands(a, b, sub):
        n, size = b - a + 1, sub[0] * sub[1]
        f = n * (1.5 if size > 1 else 1.0) / size
        return [inter.StageCandidate((a, b), sub, sub, False, f, 2 * f, 4.0 * n / size, 1.0)]

    free = inter.stage_dp(inter.StageProblem(4, 1, 2, microbatches=4), cands)
    same = inter.stage_dp(inter.StageProblem(4, 1, 2, microbatches=4), cands,
                          inter.DPOptions(upper_bound=free.latency_s * 1.01))
    assert same.latency_s == free.latency_s and same.stages == free.stages
    assert inter.stage_dp(inter.StageProblem(4, 1, 2, microbatches=4), cands,
                          inter.DPOptions(upper_bound=free.latency_s)) is None  # must beat it strictly
    with pytest.raises(inter.NoFeasiblePlanError):
        inter.stage_dp(inter.StageProblem(4, 1, 2, microbatches=4, mem_limit_bytes=1.0), cands,
                       inter.DPOptions(upper_bound=free.latency_s * 2))
    with pytest.raises(ValueError, match="upper_bound"):
        inter.stage_dp(inter.StageProblem(4, 1, 2, microbatches=4), cands,
                       inter.DPOptions(upper_bound=1.0, t_max_search="alpa"))


def test_megatron_with_remat_recomputes_forward_and_holds_less(model):
    table = planner.CostTable.build(model, SMALL)
    kw = dict(dp=1, tp=2, pp=2, microbatches=2, table=table)
    plain, remat = planner.megatron_plan(model, SMALL, **kw), planner.megatron_plan(model, SMALL, remat=True, **kw)
    assert "remat" in remat.method and "remat" not in plain.method
    for a, b in zip(plain.stages, remat.stages):
        assert b.remat and not a.remat
        assert b.bwd_s == pytest.approx(a.bwd_s + a.fwd_s - table.task_overhead_s(a.submesh))  # one task, not two
        assert b.act_bytes < a.act_bytes
    assert max(remat.cost.peak_mem_bytes) < max(plain.cost.peak_mem_bytes)


def test_compare_tries_megatron_with_every_remat_choice_and_keeps_the_fastest_fitting(result):
    """None, full and selective recomputation, as the auto plan chooses per stage: every configuration with each."""
    from collections import Counter

    from autopar_lab.rematmode import REMAT_CHOICES

    tried = result["megatron_tried"]
    assert {t["remat"] for t in tried} == set(REMAT_CHOICES)
    per_layout = Counter((t["dp"], t["tp"], t["pp"], t["microbatches"]) for t in tried)
    assert set(per_layout.values()) == {len(REMAT_CHOICES)}
    fitting = [t for t in tried if t["fits"]]
    best = min(fitting, key=lambda t: t["step_time_s"])
    assert result["megatron_best"].cost.step_time_s == best["step_time_s"]
    assert all((t["peak_mem_bytes"] <= result["megatron_best"].cost.mem_limit_bytes) == t["fits"] for t in tried)
    # Data parallelism too: the fastest fitting of every gradient-accumulation count x remat choice.
    table = result["auto"].table
    datas = [planner.data_parallel_plan(table=table, microbatches=mb, remat=r)
             for mb in planner.microbatch_choices(table.batch_size, "auto") for r in REMAT_CHOICES]
    assert result["data_parallel"].cost.step_time_s == min(p.cost.step_time_s for p in datas if p.cost.fits)


# ---------------------------------------------------------------- the vocabulary: table=, renamed keywords


def test_a_cost_table_is_a_value_the_user_builds_once(model, result):
    table = planner.CostTable.build(model, SMALL)
    assert table.trace_s > 0 and table.solver == "highs"
    auto = planner.auto_plan(model, SMALL, table=table)
    assert auto.table is table and auto.solve_s["trace"] == 0.0  # nothing traced again
    assert auto.cost == result["auto"].cost and auto.stages == result["auto"].stages
    same = planner.auto_plan(table=table)  # model and cluster default to the table's
    assert same.cost == auto.cost
    with pytest.raises(ValueError, match="another cluster"):
        planner.auto_plan(model, SMALL.with_(devices_per_host=1), table=table)
    with pytest.raises(ValueError, match="another graph"):
        planner.auto_plan(al.models.get("mlp").trace(), SMALL, table=table)
    with pytest.raises(TypeError, match="CostTable"):
        planner.auto_plan(model, SMALL, table={})


def test_the_old_keyword_names_are_gone(model, result):
    # 0.1.0 is unreleased: the names renamed before it (mem_limit, progress, model_or_graph, _table_cache) are refused
    # as any unknown keyword is, not kept with a warning.
    table = result["auto"].table
    with pytest.raises(TypeError, match="mem_limit"):
        planner.megatron_plan(model, SMALL, dp=1, tp=2, pp=2, microbatches=2, mem_limit=1e9, table=table)
    with pytest.raises(TypeError, match="progress"):
        planner.auto_plan(model, SMALL, progress=print, table=table)
    with pytest.raises(TypeError, match="_table_cache"):
        planner.data_parallel_plan(model, SMALL, _table_cache=table)
    assert not hasattr(planner, "_table")


def test_one_default_solver():
    import inspect

    from autopar_lab.solve import exhaustive
    from autopar_lab.solve.ilp import DEFAULT_SOLVER
    from autopar_lab.widgets.session import Session

    for fn in (planner.auto_plan, planner.megatron_plan, planner.data_parallel_plan, planner.compare,
               Session.__init__, planner.CostTable.__init__):
        assert inspect.signature(fn).parameters["solver"].default == DEFAULT_SOLVER == "highs", fn
    assert exhaustive.OptimumSearch().solver == DEFAULT_SOLVER  # the global optimum's search options


def test_the_microbatch_count_is_decided_by_the_simulated_step_among_the_dps_best():
    # The stage DP ranks counts by Alpa's latency formula; the plan is priced by simulating the schedule. Make the
    # formula prefer the count that simulates slower: simulated_best must hand back the other one.
    model = al.models.get("gpt-tiny", num_layers=8, hidden_size=256, batch_size=64, seq_len=64, vocab_size=512)
    table = al.CostTable.build(model, SMALL)
    mem = 1.2e8  # every count's DP finds a plan (two microbatches need about 1.01e8 bytes on the busiest device)
    kw = dict(mem_limit_bytes=mem, intra_link=SMALL.intra_host, inter_link=SMALL.inter_host, stage_comm="model",
              schedule="1f1b", max_stages=None)
    solved = {B: planner.search_microbatches(table, small_problem(table, kw), [B]) for B in (2, 4, 8)}

    def step(r):
        return al.price_plan(table, r.stages, microbatches=r.microbatches, mem_limit_bytes=mem).cost.step_time_s

    steps = {B: step(r) for B, r in solved.items()}
    fast, slow = min(steps, key=steps.get), max(steps, key=steps.get)
    assert steps[fast] < steps[slow]
    lying = {B: dataclasses.replace(r, latency_s=(0.0 if B == slow else 1.0 + B)) for B, r in solved.items()}
    result = dataclasses.replace(lying[slow], diagnostics={"solved": lying, "by_microbatches": {}})
    pick = planner.simulated_best(table, result, schedule="1f1b", stage_comm="model", mem_limit_bytes=mem)
    assert pick.microbatches == fast and pick.stages == solved[fast].stages
    # With the formula and the simulation agreeing, the DP's pick stands (the same object).
    honest = {B: dataclasses.replace(r, latency_s=steps[B]) for B, r in solved.items()}
    result = dataclasses.replace(honest[fast], diagnostics={"solved": honest, "by_microbatches": {}})
    assert planner.simulated_best(table, result, schedule="1f1b", stage_comm="model", mem_limit_bytes=mem) is result


def test_auto_microbatch_counts_span_a_batch_with_a_large_odd_factor():
    """Megatron-LM's 530B run used a batch of 2,520 (8 x 315): its powers of two stop at 8 microbatches, so the
    search fills in the batch's divisors nearest the larger powers of two; batches the powers of two span keep
    exactly Alpa's choices."""
    assert planner.microbatch_choices(1024, "auto") == [1 << e for e in range(11)]
    assert planner.microbatch_choices(1536, "auto") == [1 << e for e in range(10)]  # 512^2 >= 1536
    c = planner.microbatch_choices(2520, "auto")
    assert all(2520 % b == 0 for b in c) and c == sorted(set(c)) and c[0] == 1 and c[-1] == 2520
    assert {1, 2, 4, 8} <= set(c) and len(c) <= (2520).bit_length() + 1
    assert max(b / a for a, b in zip(c, c[1:])) <= 3  # no stretch of the range left unsearched
    with pytest.raises(ValueError, match="divisor"):
        planner.microbatch_choices(2520, 16)
