"""auto_plan and global_optimum with the interleaved and zero-bubble schedules: the DP searches each with its own
formula, brute force agrees, and schedule="auto" keeps the fastest (Python and command line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import autopar_lab as al
from autopar_lab.cluster import Cluster
from autopar_lab.planner import AUTO_SCHEDULES, wgrad_share
from autopar_lab.solve.exhaustive import OptimumSearch, global_optimum
from test_exhaustive import naive

SMALL = Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=2)  # as test_exhaustive: 664 plans


@pytest.fixture(scope="module")
def table(model):
    return al.CostTable.build(model, SMALL)


@pytest.mark.slow  # prices every plan of the space twice per schedule: ~20 s
@pytest.mark.parametrize("schedule,v", [("zb-h1", None), ("interleaved", 2)])
def test_global_optimum_with_the_schedule_is_the_plain_enumeration(model, table, schedule, v):
    want, _ = naive(table, SMALL, [1, 2, 4, 8], SMALL.device.memory_bytes, schedule=schedule, virtual_stages=v)
    r = global_optimum(model, SMALL, schedule=schedule, virtual_stages=v, table=table)
    assert r["optimum_step_s"] == pytest.approx(want, rel=1e-12)
    assert r["optimum"].schedule == r["auto"].schedule == schedule
    assert r["gap"] >= -1e-12 and r["auto_fits"]
    # the auto plan is the DP's pick for this schedule, within a few percent of the optimum over the whole space
    assert r["gap"] < 0.25
    unseeded = global_optimum(model, SMALL, schedule=schedule, virtual_stages=v, table=table,
                              search=OptimumSearch(seed=False))
    assert unseeded["optimum_step_s"] == pytest.approx(want, rel=1e-12)
    assert unseeded["plans_priced"] < unseeded["plans_total"]  # the busiest-stage bound cuts the space


def test_auto_plan_runs_the_schedule_it_searched(model, table):
    share = wgrad_share(table)
    assert 0.0 <= share < 0.9
    one = al.auto_plan(model, SMALL, schedule="1f1b", table=table)
    zb = al.auto_plan(model, SMALL, schedule="zb-h1", table=table)
    inter = al.auto_plan(model, SMALL, schedule="interleaved", virtual_stages=2, table=table)
    assert zb.schedule == "zb-h1" and inter.schedule == "interleaved" and inter.virtual_stages == 2
    assert len(inter.stages) >= 2 and inter.microbatches % len(inter.stages) == 0
    assert all(len(st.chunks) == 2 for st in inter.stages)
    assert zb.cost.fits and inter.cost.fits
    # ZB-H1 runs any 1F1B layout no slower, and the DP searched for its own: it does at least as well
    assert zb.cost.step_time_s <= one.with_schedule("zb-h1").cost.step_time_s * (1 + 1e-9)
    best = al.auto_plan(model, SMALL, schedule="auto", table=table)
    steps = [p.cost.step_time_s for p in (one, zb, inter)]
    assert best.cost.step_time_s <= min(steps) * (1 + 1e-9)
    note = best.notes[-1]
    assert note.startswith("schedule auto:") and all(s in note for s, _ in AUTO_SCHEDULES)
    assert best.cost.explain().endswith(note)  # explain says which schedule and why
    with pytest.raises(ValueError, match="virtual_stages"):
        al.auto_plan(model, SMALL, schedule="auto", virtual_stages=2, table=table)


@pytest.mark.slow  # traces a 26-layer model and plans it five times: ~20 s
def test_deep_model_plans_each_schedule():
    # gpt-tiny with 24 layers (26 with the embedding and head) on 8 devices: the interleaved DP keeps v layers per
    # stage and a stage count dividing the microbatches; every plan fits and auto is the fastest of them.
    model = al.models.get("gpt-tiny", batch_size=16, num_layers=24)
    cluster = Cluster.preset("p3.16xlarge", hosts=1)
    table = al.CostTable.build(model, cluster)
    plans = {s: al.auto_plan(model, cluster, schedule=s, virtual_stages=v, table=table) for s, v in
             (("1f1b", None), ("interleaved", 4), ("zb-h1", None))}
    inter = plans["interleaved"]
    if len(inter.stages) > 1:
        assert all(st.layers[1] - st.layers[0] + 1 >= 4 for st in inter.stages)
        assert inter.microbatches % len(inter.stages) == 0
    auto = al.auto_plan(model, cluster, schedule="auto", table=table)
    assert auto.cost.step_time_s <= min(p.cost.step_time_s for p in plans.values()) * (1 + 1e-9)


@pytest.mark.slow  # two command-line runs, each starting JAX: ~15 s
def test_cli_schedule_auto_from_another_directory(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    args = [sys.executable, "-m", "autopar_lab", "plan", "gpt-tiny", "--layers", "4", "--batch", "8", "--cluster",
            "cpu", "--schedule", "auto", "--json"]
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["schedule"] in {s for s, _ in AUTO_SCHEDULES}
    assert any(n.startswith("schedule auto:") for n in out["notes"])
    bad = subprocess.run(args[:-1] + ["--method", "megatron", "--dp", "8", "--tp", "1", "--pp", "1"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--schedule auto" in bad.stderr


def test_megatron_grid_with_schedules_is_no_slower_and_says_which(table):
    from autopar_lab import planner

    plain = planner.baselines(table, SMALL, microbatches="auto")
    more = planner.baselines(table, SMALL, microbatches="auto", schedules=("1f1b", "interleaved", "zb-h1"))
    assert more["megatron_best"].cost.step_time_s <= plain["megatron_best"].cost.step_time_s
    assert plain["megatron_schedule"] == "1f1b"
    assert more["megatron_schedule"].split()[0] == more["megatron_best"].schedule
    kinds = {r["schedule"] for r in more["megatron_tried"]}
    assert kinds == {"1f1b", "interleaved", "zb-h1"}
    # only pipelines get the other schedules; every 1F1B row of the plain grid is still there
    assert all(r["pp"] > 1 for r in more["megatron_tried"] if r["schedule"] != "1f1b")
    assert sum(r["schedule"] == "1f1b" for r in more["megatron_tried"]) == len(plain["megatron_tried"])


@pytest.mark.parametrize("schedule", ["zb-h1", "interleaved"])
def test_nudged_cuts_only_move_cuts_and_only_when_the_simulation_is_faster(table, schedule):
    from autopar_lab.planner import nudged_cuts
    from autopar_lab.pricing import price_plan

    v = 2 if schedule == "interleaved" else 1
    kw = dict(microbatches=4, schedule=schedule, virtual_stages=v, stage_comm="model",
              mem_limit_bytes=SMALL.device.memory_bytes)
    start = [((0, 1), (1, 2), (1, 2), False), ((2, 3), (1, 2), (2, 1), True)]
    if schedule == "zb-h1":
        start = [((0, 0), (1, 2), (1, 2), False), ((1, 3), (1, 2), (2, 1), True)]
    out = nudged_cuts(table, start, **kw)
    assert [s[1:] for s in out] == [s[1:] for s in start]  # submeshes, meshes and remat kept
    assert out[0][0][0] == 0 and out[-1][0][1] == 3 and out[0][0][1] + 1 == out[1][0][0]

    def step(sts):
        return price_plan(table, sts, microbatches=4, schedule=schedule, virtual_stages=v).cost.step_time_s

    assert step(out) <= step(start)
    assert nudged_cuts(table, out, **kw) == out  # a fixpoint: no one-layer move is faster
