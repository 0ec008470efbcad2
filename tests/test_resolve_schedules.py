"""Re-solves around pins keep the plan's schedule: for 1F1B, GPipe, interleaved and ZB-H1 the stage DP of
:func:`autopar_lab.resolve` is the brute-force best among the layouts that respect the pins (priced with that
schedule's own formula), every stage holds the pins of the layers it really runs (an interleaved stage's chunks),
and an interleaved plan keeps its chunk count."""

from __future__ import annotations

import math

import pytest

import autopar_lab as al
from autopar_lab import pins, planner
from autopar_lab.rematmode import REMAT_CHOICES
from autopar_lab.solve.inter import NoFeasiblePlanError, StageConstraints, StageProblem, brute_force_stages

SCHEDULES = [("1f1b", None), ("gpipe", None), ("zb-h1", None), ("interleaved", 2), ("interleaved", 3)]


@pytest.fixture(scope="module")
def six():
    """gpt-tiny with four blocks (six layers with embedding and head): room for three chunks on each of two stages."""
    return al.models.get("gpt-tiny", batch_size=12, num_layers=4, dtype="float32").trace()


@pytest.fixture(scope="module")
def one_host(cluster):
    """One host of four devices (conftest's ``cluster``)."""
    return cluster


@pytest.fixture(scope="module")
def table(six, one_host):
    return al.CostTable.build(six, one_host)


def names_on(table, op, submesh, shape) -> set[str]:
    cache = table.strategy_cache(table.cluster.logical_mesh(submesh, shape))
    return {s.name for s in cache.strategies(table.graph.op(op))}


def restrictive_pin(plan, table):
    """An operator of a middle block and a strategy that some logical mesh of the cluster lacks and the plan does
    not use for it now (so the pin moves something, and limits where the stage that runs it may go)."""
    g, cluster = plan.op_graph, plan.cluster
    meshes = [(sub, shape) for sub in cluster.submesh_shapes() for shape in cluster.logical_mesh_shapes(sub)]
    block = plan.layer_names[2]
    for op in g.ops:
        node = g.op(op)
        if node.layer != block or node.primitive != "dot_general":
            continue
        have = [names_on(table, op, *m) for m in meshes]
        now = plan.choice(op).name
        for name in [a.strategy for a in plan.alternatives(op)]:  # those of the mesh that runs it now
            if name != now and not all(name in h for h in have) and sum(name in h for h in have) >= 3:
                return op, name
    raise AssertionError("no operator of the block has a strategy only some meshes offer")


def brute_best(plan, table, schedule, v, pinned: dict[int, str]):
    """The best layout by brute force over every microbatch count: every partition, submesh placement, logical
    mesh, solution and remat, a stage allowed a mesh only when that mesh has every pinned strategy of the layers it
    runs (for the interleaved schedule, whose chunks the DP cannot see, of every layer)."""
    cluster = plan.cluster
    L = len(table.layer_names)
    layer_of = {op: plan.layer_names.index(plan.op_graph.op(op).layer) for op in pinned}

    def cands(B):
        def candidates(a, b, sub):
            lo, hi = (a, b) if v == 1 else (0, L - 1)
            mine = {op: n for op, n in pinned.items() if lo <= layer_of[op] <= hi}
            return [table.stage(a, b, sub, shape, B, r, sol) for shape in cluster.logical_mesh_shapes(sub)
                    if all(n in names_on(table, op, sub, shape) for op, n in mine.items())
                    for sol in table.solutions(sub, shape) for r in REMAT_CHOICES]
        return candidates

    kw = {"schedule": schedule}
    if schedule == "interleaved":
        kw["virtual_stages"] = v
    if schedule == "zb-h1":
        kw["wgrad_share"] = planner.wgrad_share(table)
    best = None
    for B in planner.microbatch_choices(table.batch_size, "auto"):
        try:
            problem = StageProblem(L, cluster.hosts, cluster.devices_per_host, microbatches=B,
                                   mem_limit_bytes=plan.cost.mem_limit_bytes,
                                   cut_bytes=[c / B for c in table.cut_bytes], intra_link=cluster.intra_host,
                                   inter_link=cluster.inter_host, stage_comm=plan.stage_comm, **kw)
            r = brute_force_stages(problem, cands(B))
        except NoFeasiblePlanError:
            continue
        if best is None or r.latency_s < best.latency_s * (1 - 1e-12):
            best = r
    assert best is not None
    return best


def layout(stages):
    return [(tuple(s.layers), tuple(s.submesh), tuple(s.logical_mesh), s.remat) for s in stages]


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_resolve_is_the_brute_force_best_for_the_plans_schedule(six, one_host, table, schedule, v):
    plan = al.auto_plan(six, one_host, table=table, schedule=schedule, virtual_stages=v)
    op, name = restrictive_pin(plan, table)
    pinned = plan.with_choice(op, name)
    sched = pins.schedule_keywords(pinned)
    assert sched["schedule"] == schedule and sched.get("virtual_stages", 1) == (v or 1)
    dp = pins.solve_stages(pinned, None, planner.microbatch_choices(table.batch_size, "auto"), sched,
                           pinned.cost.mem_limit_bytes, pins.PinIndex(pinned))
    bf = brute_best(pinned, table, schedule, v or 1, {op: name})
    assert math.isclose(dp.latency_s, bf.latency_s, rel_tol=1e-9)
    assert dp.microbatches == bf.microbatches

    out = al.resolve(pinned)
    assert layout(out.stages) == layout(dp.stages) and out.microbatches == dp.microbatches
    assert out.schedule == schedule and out.virtual_stages == (v or 1)
    # Every stage holds the pin wherever it runs the pinned operator's layer: its chunks when interleaved.
    k = out.layer_names.index(out.op_graph.op(op).layer)
    runners = [j for j, st in enumerate(out.stages) if any(a <= k <= b for a, b in st.layer_ranges)]
    assert len(runners) == 1
    assert out.stages[runners[0]].intra.strategies[op].name == name
    assert out.choice(op).name == name


def test_interleaved_pins_are_held_on_the_stage_that_runs_their_chunk(six, one_host, table):
    """Layer 2 is in stage 0's range of the 1F1B layout, but with three chunks a stage of layers 0..2 and 3..5 runs
    layers 0, 2, 4 and 1, 3, 5: the re-solve holds a pin of layer 1 on stage 1, where that layer runs."""
    plan = al.auto_plan(six, one_host, table=table, schedule="interleaved", virtual_stages=3)
    assert [st.layer_ranges for st in plan.stages] == [((0, 0), (2, 2), (4, 4)), ((1, 1), (3, 3), (5, 5))]
    g = plan.op_graph
    block = plan.layer_names[1]
    op = next(i for i in g.ops if g.op(i).layer == block and g.op(i).primitive == "dot_general")
    mesh1 = (plan.stages[1].submesh, plan.stages[1].logical_mesh)
    name = next(a.strategy for a in plan.alternatives(op)[1:] if a.strategy in names_on(table, op, *mesh1))
    out = al.resolve(plan.with_choice(op, name))
    assert out.virtual_stages == 3
    assert out.stages[out.stage_of(op)].intra.strategies[op].name == name
    again = pins.solve_intra_around_pins(out)
    assert again.virtual_stages == 3 and again.stages[again.stage_of(op)].intra.strategies[op].name == name


def test_overrides_keep_an_unpinned_chunk_count(six, one_host, table):
    """A chunk count chosen at planning (not pinned by with_schedule) survives every override that re-prices or
    re-solves the stages."""
    plan = al.auto_plan(six, one_host, table=table, schedule="interleaved", virtual_stages=3)
    assert "virtual_stages" not in plan.stage_pins and plan.virtual_stages == 3
    for q in (plan.with_remat(0, True), plan.with_stages(submeshes=[(1, 2), (1, 2)]),
              plan.with_stages(microbatches=4), al.resolve(plan)):
        assert q.schedule == "interleaved" and q.virtual_stages == 3
        assert [len(st.layer_ranges) for st in q.stages] == [3, 3]
    # A schedule given anew takes its own chunk count.
    assert plan.with_schedule("interleaved", 2).virtual_stages == 2


@pytest.mark.parametrize("schedule,v", SCHEDULES[:4])
def test_fixed_cuts_follow_the_plans_schedule(six, one_host, table, schedule, v):
    """with_stages' DP with the cuts fixed (a new stage count: every submesh, mesh and remat free) prices the
    plan's schedule: it equals the full stage DP with those cuts pinned, priced with that schedule."""
    plan = al.auto_plan(six, one_host, table=table, schedule=schedule, virtual_stages=v)
    cuts = (2, 4) if len(plan.stages) != 3 else (3,)
    q = plan.with_stages(boundaries=list(cuts), microbatches=6)
    assert q.schedule == schedule and q.virtual_stages == (v or 1)
    con = StageConstraints(cuts=cuts)
    full = pins.solve_stages(plan, con, [6], pins.schedule_keywords(plan), plan.cost.mem_limit_bytes, None,
                             prune=False)
    assert layout(full.stages) == layout(q.stages)


def test_deep_interleaved_model_resolves_around_a_pin_on_its_chunks():
    """GPT with 24 blocks planned on its shallower copy, interleaved with 3 chunks on 4 stages: a pin on a block
    holds on every stage that runs a block sharing its solution, and the re-solve keeps the schedule."""
    model = al.models.get("gpt-tiny", batch_size=16, num_layers=24, dtype="float32")
    cluster = al.Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=4)
    plan = al.auto_plan(model, cluster, schedule="interleaved", virtual_stages=3, microbatches=8)
    assert len(plan.layer_names) >= 24 and plan.virtual_stages == 3
    g = plan.op_graph
    op = next(i for i in g.ops if g.op(i).primitive == "dot_general" and
              len(plan.table.op_map.full_layers_of(i)) > 1)
    alts = [a.strategy for a in plan.alternatives(op)]
    name = alts[len(alts) // 2]
    out = al.resolve(plan.with_choice(op, name))
    assert out.schedule == "interleaved" and out.virtual_stages == 3
    runs = set(plan.table.op_map.full_layers_of(op))
    stages = {j for j, st in enumerate(out.stages) for a, b in st.layer_ranges if any(a <= k <= b for k in runs)}
    assert len(stages) >= 2  # the blocks sharing the solution run on several stages
    for j in stages:
        assert out.stages[j].intra.strategies[op].name == name, j
