"""The exhaustive global optimum: never worse than the auto plan, equal to a plain enumeration, refuses big spaces."""

import itertools
import json
import math

import pytest

import autopar_lab as al
from autopar_lab import cli
from autopar_lab.pricing import price_plan
from autopar_lab.cluster import Cluster
from autopar_lab.solve.exhaustive import DEFAULT_LIMIT, OptimumSearch, count_plans, global_optimum
from autopar_lab.solve.inter import placement_fits

# Two hosts of two devices: every submesh shape (1x1, 1x2, 2x2) and both links appear, and the ILPs stay small.
SMALL = Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=2)


@pytest.fixture(scope="module")
def base(model):
    return global_optimum(model, SMALL)


def naive(table, cluster, choices, mem, remat=(False, True, "selective"), schedule="1f1b", virtual_stages=None):
    """Every partition x in-order tiling x logical mesh x remat x B, each priced by price_plan (layouts the
    schedule cannot run left out)."""
    L, NM, M = len(table.layer_names), cluster.num_devices, cluster.devices_per_host
    shapes = cluster.submesh_shapes()

    def tilings(offset, count):
        if count == 0:
            if offset == NM:
                yield ()
            return
        for sh in shapes:
            if placement_fits(sh, offset, cluster.hosts, M):
                for rest in tilings(offset + sh[0] * sh[1], count - 1):
                    yield (sh, *rest)

    best, n = math.inf, 0
    for B in choices:
        for S in range(1, min(L, NM) + 1):
            for cuts in itertools.combinations(range(1, L), S - 1):
                bounds = (0, *cuts, L)
                for subs in tilings(0, S):
                    options = [[table.stage(bounds[j], bounds[j + 1] - 1, subs[j], lm, B, r)
                                for lm in cluster.logical_mesh_shapes(subs[j]) for r in remat] for j in range(S)]
                    for stages in itertools.product(*options):
                        n += 1  # priced by price_plan, as every plan is: the ground truth
                        try:
                            plan = price_plan(table, stages, microbatches=B, schedule=schedule, stage_comm="model",
                                              mem_limit_bytes=mem, method="naive", virtual_stages=virtual_stages)
                        except ValueError:
                            continue
                        if all(m <= mem for m in plan.cost.peak_mem_bytes):
                            best = min(best, plan.cost.step_time_s)
    return best, n


def test_optimum_is_no_worse_than_auto(base):
    assert base["gap"] >= 0
    assert base["optimum_step_s"] <= base["auto_step_s"] * (1 + 1e-12)
    assert base["auto_fits"]
    assert base["plans_total"] == count_plans(4, SMALL, 4)  # embed, 2 blocks, head; B in 1, 2, 4, 8
    # Both are real plans priced by price_plan: every layer and every device exactly once.
    for plan in (base["optimum"], base["auto"]):
        layers = [k for st in plan.stages for k in range(st.layers[0], st.layers[1] + 1)]
        assert layers == list(range(len(plan.layer_names)))
        assert [d for st in plan.stages for d in st.devices] == list(range(SMALL.num_devices))
        assert plan.cost.step_time_s == pytest.approx(plan.cost.timeline.makespan)


@pytest.mark.parametrize("fraction", [None, 0.6, 0.2])
def test_pruned_search_equals_plain_enumeration(model, base, fraction):
    """Memory limits (fractions of the unconstrained plan's peak) force pipelines and remat into the optimum."""
    table = base["table"]
    mem = None if fraction is None else fraction * max(base["auto"].cost.peak_mem_bytes)
    limit = SMALL.device.memory_bytes if mem is None else mem
    want, n = naive(table, SMALL, [1, 2, 4, 8], limit)
    plain = global_optimum(model, SMALL, mem_limit_bytes=mem, table=table, search=OptimumSearch(prune=False))
    unseeded = global_optimum(model, SMALL, mem_limit_bytes=mem, table=table, search=OptimumSearch(seed=False))
    seeded = global_optimum(model, SMALL, mem_limit_bytes=mem, table=table)
    assert n == plain["plans_total"] == plain["plans_priced"]
    for r in (plain, unseeded, seeded):
        assert r["optimum_step_s"] == pytest.approx(want, rel=1e-12)
        assert r["gap"] >= -1e-12
        assert all(m <= limit for m in r["optimum"].cost.peak_mem_bytes)
    assert unseeded["plans_priced"] < n  # the bound and the dominance rule cut the space


def test_size_guard_refuses_big_instances(model, base):
    with pytest.raises(ValueError, match="too many plans to enumerate: 2,088"):
        global_optimum(model, SMALL, table=base["table"], search=OptimumSearch(limit=100))
    big = al.models.get("gpt-tiny", batch_size=8, num_layers=6)  # 8 layers on 16 devices
    cluster = Cluster.preset("p3.16xlarge", hosts=2)
    assert count_plans(8, cluster, 4) > DEFAULT_LIMIT
    with pytest.raises(ValueError, match="use fewer layers or devices"):
        global_optimum(big, cluster)


def test_cli_optimum(tmp_path, capsys):
    path = tmp_path / "two.json"
    Cluster.preset("p3.16xlarge").with_(devices_per_host=2).to_json(path)
    assert cli.main(["optimum", "gpt-tiny", "--cluster", str(path), "--batch", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("model", "cluster", "auto_step_s", "optimum_step_s", "gap", "plans_priced", "solve_s"):
        assert key in out
    assert out["gap"] >= 0 and out["optimum_step_s"] <= out["auto_step_s"]
    assert out["auto"]["stages"] and out["optimum"]["stages"]
    assert cli.main(["optimum", "gpt-tiny", "--cluster", "p3.16xlarge:2", "--layers", "6", "--json"]) == 2
    assert "too many plans to enumerate" in capsys.readouterr().err
