"""Memory-lean solutions in the cost table (issues 16 and 17): beside each mesh's fastest intra-op solution, one with
every parameter and optimizer state stored at its least (ZeRO-3 / FSDP storage), for the stage DP to choose per
stage. The DP with both solutions against brute force over (stage split, submesh, logical mesh, solution, remat);
a deep model whose layers do not fit replicated planned with them; plan files; the CLI as the user runs it."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest

import autopar_lab as al
from autopar_lab import cli
from autopar_lab.cluster import Cluster
from autopar_lab.graph.opgraph import INPUT_PRIMITIVE, OPT_STATE, PARAM
from autopar_lab.parallelism import op_notes
from autopar_lab.planfile import load_plan, save_plan
from autopar_lab.pricing.table import CostTable
from autopar_lab.rematmode import REMAT_CHOICES
from autopar_lab.sharding.fsdp import gathered_params
from autopar_lab.solve import inter

SMALL = Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=2)


@pytest.fixture(scope="module")
def table():
    t = CostTable.build(al.models.get("gpt-tiny"), SMALL, lean="all")
    t.solve_meshes(workers=1)
    t.solve_lean(workers=1)
    return t


def state_inputs(graph):
    return [op for op in graph.ops if graph.op(op).primitive == INPUT_PRIMITIVE
            and graph.tensor(graph.op(op).outputs[0]).kind in (PARAM, OPT_STATE)]


def test_the_lean_solution_stores_every_weight_and_optimizer_state_at_its_least(table):
    g = table.solve_graph
    leaner = 0
    for sub, shape in table.planned_meshes():
        fast_costs, fast = table.mesh_costs(sub, shape)
        if "lean" not in table.solutions(sub, shape):
            assert sub == (1, 1)  # one device: nothing to shard, the two solutions are one
            continue
        lean_costs, lean = table.mesh_costs(sub, shape, "lean")
        cache = table.strategy_cache(lean.mesh)
        for op in state_inputs(g):
            least = min(s.mem_bytes for s in cache.strategies(g.op(op)))
            assert lean.strategies[op].mem_bytes == least
        # Less held all step, more time (or the ILP would have chosen it for time alone).
        assert sum(c.static_bytes for c in lean_costs) < sum(c.static_bytes for c in fast_costs)
        assert sum(c.fwd_s + c.bwd_s for c in lean_costs) >= sum(c.fwd_s + c.bwd_s for c in fast_costs)
        # A candidate records the solution it was priced with (and carries that solution's sharding).
        for sol, intra in (("lean", lean), ("fast", fast)):
            cand = table.stage(0, 0, sub, shape, 1, False, sol)
            assert cand.solution == sol and cand.payload is intra
        leaner += 1
    assert leaner >= 2


def every_candidate(table, B):
    """Every (logical mesh, solution, remat) of every range, nothing dropped: what brute force searches (every remat
    mode the stage DP tries, selective included)."""
    def fn(a, b, sub):
        sub = tuple(sub)
        if sub not in table.submeshes():
            return []
        return [table.stage(a, b, sub, shape, B, r, sol) for shape in table.mesh_shapes(sub)
                for sol in table.solutions(sub, shape) for r in REMAT_CHOICES]
    return fn


def outcome(run):
    try:
        r = run()
    except inter.NoFeasiblePlanError:
        return None
    return r.latency_s


def dp_problem(table, B, mem):
    c = table.cluster
    return inter.StageProblem(len(table.layer_names), c.hosts, c.devices_per_host, microbatches=B, mem_limit_bytes=mem,
                              cut_bytes=[x / B for x in table.cut_bytes], intra_link=c.intra_host,
                              inter_link=c.inter_host, stage_comm="model")


@pytest.mark.parametrize("seed", range(24))
def test_the_dp_with_both_solutions_finds_brute_force_s_best_plan(table, seed):
    rng = random.Random(seed)
    L = len(table.layer_names)
    B = rng.choice([1, 2, 4])
    fn = every_candidate(table, B)
    # Limits from below the leanest single stage to above the fattest: infeasible, lean-only and easy instances.
    mems = [cand.mem_bytes(1) for sub in table.submeshes() for cand in fn(0, L - 1, sub)]
    per_layer = [cand.mem_bytes(1) for sub in table.submeshes() for a in range(L) for cand in fn(a, a, sub)]
    mem = rng.uniform(min(per_layer), max(mems) * 1.2)
    prob = dp_problem(table, B, mem)
    want = outcome(lambda: inter.brute_force_stages(prob, fn))
    got = outcome(lambda: inter.stage_dp(prob, table.candidate_fn(B, mem)))
    assert (got is None) == (want is None)
    if want is not None:
        assert got == pytest.approx(want, rel=1e-9)


def test_some_limit_is_met_only_with_the_lean_solutions(table):
    """Where the fast solutions cannot fit a limit the lean ones can, the DP finds the lean plan (and brute force
    over the fast solutions alone finds none)."""
    B = 4
    fn, fast_fn = every_candidate(table, B), every_fast_candidate(table, B)

    def least(f):
        return inter.brute_force_stages(dp_problem(table, B, 1.0), f).latency_s

    with pytest.raises(inter.NoFeasiblePlanError) as fast_err:
        least(fast_fn)
    with pytest.raises(inter.NoFeasiblePlanError) as both_err:
        least(fn)
    lo, hi = both_err.value.min_mem_bytes, fast_err.value.min_mem_bytes
    assert lo < hi
    mem = (lo + hi) / 2
    prob = dp_problem(table, B, mem)
    with pytest.raises(inter.NoFeasiblePlanError):
        inter.brute_force_stages(prob, fast_fn)
    r = inter.stage_dp(prob, table.candidate_fn(B, mem))
    assert any(s.solution == "lean" for s in r.stages)
    assert all(s.payload is table.mesh_costs(s.submesh, s.logical_mesh, s.solution)[1] for s in r.stages)
    assert r.latency_s == pytest.approx(
        inter.brute_force_stages(prob, fn).latency_s, rel=1e-9)


def lean_only_limit(table, B):
    """A memory limit per device halfway between the least any plan needs and the least a plan of fast solutions
    alone needs (the stage DP's own answers): only a plan with a lean stage meets it."""
    least = {}
    for name, fn in (("both", table.candidate_fn(B, None)), ("fast", every_fast_candidate(table, B))):
        with pytest.raises(inter.NoFeasiblePlanError) as err:
            inter.stage_dp(dp_problem(table, B, 1.0), fn)
        least[name] = err.value.min_mem_bytes
    assert least["both"] < least["fast"]
    return (least["both"] + least["fast"]) / 2


def test_each_stage_records_its_solution_through_overrides_the_plan_file_and_the_views(table, tmp_path, capsys):
    """Stage.solution is what the DP chose (the stage runs that solution's sharding), and it stays through a
    re-solve, an override, a plan file (an old file without the key loads as "fast") and shows in the views."""
    from autopar_lab.widgets.views.stage_layout import stage_blocks

    mem = lean_only_limit(table, 4)
    plan = al.auto_plan(table.graph, SMALL, table=table, microbatches=4, mem_limit_bytes=mem)
    assert plan.cost.fits
    lean = [k for k, st in enumerate(plan.stages) if st.solution == "lean"]
    assert lean
    for st in plan.stages:
        assert st.intra is table.mesh_costs(st.submesh, st.logical_mesh, st.solution)[1]
    assert [d["solution"] for d in plan.report()["stages"]] == [st.solution for st in plan.stages]  # plan --json
    assert all(", lean" in stage_blocks(plan)[k]["label"] for k in lean)
    cli._print_plan(plan.report("gpt-tiny"))  # the CLI's plan output, a line per stage
    lines = [x for x in capsys.readouterr().out.splitlines() if x.lstrip().startswith("stage ")]
    assert [k for k, x in enumerate(lines) if "lean sharding" in x] == lean
    for q in (al.resolve(plan), plan.with_stages(microbatches=4), plan.with_remat(lean[0], True)):
        assert [st.solution for st in q.stages] == [st.solution for st in plan.stages] and q.cost.fits
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    assert [k for k, st in enumerate(data["stages"]) if st.get("solution") == "lean"] == lean
    data["mem_limit_bytes"] = 2**20  # the least a plan file may say: this toy limit is below it
    path.write_text(json.dumps(data))
    back = load_plan(path, plan.graph, plan.cluster)
    assert [st.solution for st in back.stages] == [st.solution for st in plan.stages]
    for st in data["stages"]:
        st.pop("solution", None)
    path.write_text(json.dumps(data))
    old = load_plan(path, plan.graph, plan.cluster)
    assert [st.solution for st in old.stages] == ["fast"] * len(plan.stages)
    assert old.cost.step_time_s == back.cost.step_time_s  # the strategies are in the file either way


def test_lean_off_adds_nothing_and_auto_only_where_a_layer_does_not_fit():
    t = CostTable.build(al.models.get("gpt-tiny"), SMALL, lean="off")
    assert t.lean_meshes(1.0, 1) == []
    t.lean = "auto"
    assert t.lean_meshes(math.inf, 1) == []
    assert t.lean_meshes(1.0, 1) == t.planned_meshes()
    with pytest.raises(ValueError, match="lean must be one of"):
        CostTable.build(al.models.get("gpt-tiny"), SMALL, lean="yes")


DEEP = Cluster.preset("p3.16xlarge", hosts=2)  # 16 devices
DEEP_MODEL = dict(num_layers=24, hidden_size=64)  # 26 layers with the embedding and the head; 0.8 MB a layer


def every_fast_candidate(table, B):
    every = every_candidate(table, B)
    return lambda a, b, sub: [x for x in every(a, b, sub) if x.solution == "fast"]


def limit_between(model):
    """A memory limit per device that no plan of ``model`` on DEEP meets with the fast (replicated) solutions and
    some plan meets with the lean ones: halfway between the least memory each needs (the DP's infeasibility
    figure, exact), at 4 microbatches."""
    t = CostTable.build(model, DEEP, lean="all")
    t.solve_meshes(workers=1)
    t.solve_lean(workers=1)
    B = 4
    least = []
    for fn in (every_fast_candidate(t, B), t.candidate_fn(B, None)):
        with pytest.raises(inter.NoFeasiblePlanError) as e:
            inter.stage_dp(dp_problem(t, B, 1.0), fn)
        least.append(e.value.min_mem_bytes)
    fast, both = least
    assert both < fast
    return (both + fast) / 2


@pytest.fixture(scope="module")
def deep_limit():
    mem = limit_between(al.models.get("gpt-tiny", **DEEP_MODEL))
    assert mem > 2 ** 20  # a plan file holds limits from 1 MiB
    return mem


@pytest.fixture(scope="module")
def deep_plan(deep_limit):
    return al.auto_plan(al.models.get("gpt-tiny", **DEEP_MODEL), DEEP, mem_limit_bytes=deep_limit)


def check_lean_plan(plan, mem):
    """The plan fits ``mem`` and its lean stages store their weights split, some gathered for their readers."""
    g = plan.op_graph
    assert plan.cost.fits and max(plan.cost.peak_mem_bytes) <= mem
    lean = [k for k, st in enumerate(plan.stages) if st.solution == "lean"]
    assert lean
    params = [op for op in state_inputs(g) if g.tensor(g.op(op).outputs[0]).kind == PARAM]
    for k in lean:
        st = plan.stages[k]
        assert st.submesh[0] * st.submesh[1] > 1
        assert all(st.intra.strategies[op].out_specs[0].axes for op in params)
    assert any(gathered_params(g, plan.stages[k].intra.strategies, plan.stages[k].intra.mesh.shape) for k in lean)
    return lean


@pytest.mark.slow
def test_a_deep_model_that_does_not_fit_replicated_plans_with_fsdp_under_the_limit(deep_plan, deep_limit, tmp_path):
    plan = deep_plan
    assert len(plan.graph.layers) >= 24
    lean = check_lean_plan(plan, deep_limit)
    assert "ZeRO-3" in " ".join(op_notes(plan).values())
    # The plan file says which stages run the lean solution and loads back to the same numbers.
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    data = json.loads(path.read_text())
    assert [k for k, st in enumerate(data["stages"]) if st.get("solution") == "lean"] == lean
    back = load_plan(path, plan.graph, plan.cluster, model=al.models.get("gpt-tiny", **DEEP_MODEL))
    assert back.cost.step_time_s == plan.cost.step_time_s
    assert back.cost.peak_mem_bytes == plan.cost.peak_mem_bytes


@pytest.mark.slow
def test_the_cli_plans_a_model_too_big_to_replicate(tmp_path):
    """As the user runs it: `autopar-lab plan gpt-tiny --layers 24` from another directory, on a cluster file whose
    devices hold less than any replicated plan needs; the plan it prints fits, and the plan file it writes has
    lean stages. (That limit is under the 1 MiB a plan file may hold, so the file is read as JSON, not loaded.)"""
    mem = limit_between(al.models.get("gpt-tiny", num_layers=24))
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps(DEEP.with_(memory_bytes=mem).to_dict()))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), JAX_PLATFORMS="cpu")
    out = tmp_path / "plan.json"
    run = subprocess.run([sys.executable, "-m", "autopar_lab.cli", "plan", "gpt-tiny", "--layers", "24",
                          "--cluster", str(spec), "--json", "--out", str(out)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stderr[-2000:]
    printed = json.loads(run.stdout)
    assert max(printed["peak_mem_bytes"]) <= printed["mem_limit_bytes"] == mem
    data = json.loads(out.read_text())
    assert any(st.get("solution") == "lean" for st in data["stages"])


def test_lean_keys_travel_to_worker_processes_and_back_equal(table):
    """The worker pool solves lean keys as the parent does (same strategies, same layer costs to the bit)."""
    from autopar_lab.pricing.table_pool import LEAN, plan_from_choice, solve_in_workers

    keys = [(sub, shape, LEAN) for sub, shape in table.planned_meshes() if sub != (1, 1)]
    got = {k: (costs, choice) for k, costs, choice, _s in
           solve_in_workers(table.solve_graph, table.cluster, table.solver, keys, 2)}
    for sub, shape, _ in keys:
        costs, choice = got[(sub, shape, LEAN)]
        full, here = table.mesh_costs(sub, shape, "lean")
        assert [costs[k] for k in table.layer_map] == full
        there = plan_from_choice(table.solve_graph, table.cluster, (sub, shape, LEAN), choice)
        assert {op: s.name for op, s in there.strategies.items()} == {op: s.name for op, s in here.strategies.items()}


@pytest.mark.slow
def test_a_pin_on_a_lean_plan_is_re_solved_around_with_the_weights_still_lean(deep_plan, deep_limit):
    """Re-solving around a user's pin keeps the lean stages lean (their weights stored at their least around the
    pin), so a plan that fits only with lean solutions still fits after an override."""
    plan, g = deep_plan, deep_plan.op_graph
    lean = check_lean_plan(plan, deep_limit)
    st = plan.stages[lean[0]]
    # A matmul of that stage, pinned to another of its strategies on the stage's mesh.
    op = next(op for op in sorted(st.intra.strategies) if g.op(op).primitive == "dot_general"
              and plan.stage_of(op) == lean[0])
    other = next(a.strategy for a in plan.alternatives(op) if a.strategy != st.intra.strategies[op].name)
    pinned = plan.with_choice(op, other)
    out = al.resolve(pinned)
    assert out.pins == pinned.pins and other in {pin.strategy for pin in out.pins.values()}
    for p_op, pin in out.pins.items():
        assert out.choice(p_op).name == pin.strategy
    # Only lean storage meets this limit (limit_between); the pinned stage stores every weight split.
    assert out.cost.fits and max(out.cost.peak_mem_bytes) <= deep_limit
    params = [p for p in state_inputs(g) if g.tensor(g.op(p).outputs[0]).kind == PARAM]
    held = out.stages[out.stage_of(op)].intra.strategies
    assert all(held[p].out_specs[0].axes for p in params)
