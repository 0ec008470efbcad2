"""simulated_best skips simulating a ranked plan whose step's lower bound is above the best plan that fits (issue 36):
the same pick as simulating every ranked plan, fewer simulations, and auto_plan's plan priced once."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from test_planner import SMALL, small_problem

import autopar_lab as al
from autopar_lab import planner

# Tight enough that a plan can fail to fit, loose enough that every count's DP finds one (two microbatches need about
# 1.01e8 bytes on the busiest device)
MEM = 1.2e8


@pytest.fixture(scope="module")
def tiny():
    model = al.models.get("gpt-tiny", num_layers=8, hidden_size=256, batch_size=64, seq_len=64, vocab_size=512)
    table = al.CostTable.build(model, SMALL)
    kw = dict(mem_limit_bytes=MEM, intra_link=SMALL.intra_host, inter_link=SMALL.inter_host, stage_comm="model",
              schedule="1f1b", max_stages=None)
    solved = {B: planner.search_microbatches(table, small_problem(table, kw), [B]) for B in (2, 4, 8, 16)}
    return table, solved


def reference_pick(table, ranked, result):
    """simulated_best as it was: every ranked plan simulated, the best score (fits first, then the step) picked,
    ties to the earlier; the DP's result kept unless strictly beaten."""
    scores = {}
    for r in ranked:
        cost = al.price_plan(table, r.stages, microbatches=r.microbatches, mem_limit_bytes=MEM, method="auto").cost
        scores[r.microbatches] = (not cost.fits, cost.step_time_s)
    pick = min(ranked, key=lambda r: scores[r.microbatches])
    return pick if scores[pick.microbatches] < scores[result.microbatches] else result


def test_the_pick_is_the_one_every_simulation_gives(tiny, monkeypatch):
    """Every order of the DP's ranking over three of the counts (latencies made up so that each order occurs):
    the same pick as the reference, and in at least one order a plan left unsimulated."""
    table, solved = tiny
    simulated = []
    price = planner.price_plan

    def counting(*args, **kw):
        plan = price(*args, **kw)
        simulated.append(kw["microbatches"])
        return plan

    monkeypatch.setattr(planner, "price_plan", counting)
    skipped = 0
    for counts in itertools.permutations((2, 8, 16)):
        lying = {B: dataclasses.replace(solved[B], latency_s=float(rank), diagnostics={})
                 for rank, B in enumerate(counts)}
        result = dataclasses.replace(lying[counts[0]], diagnostics={"solved": lying, "by_microbatches": {}})
        want = reference_pick(table, [lying[B] for B in counts], result)
        simulated.clear()
        got = planner.simulated_best(table, result, schedule="1f1b", stage_comm="model", mem_limit_bytes=MEM)
        assert (got.microbatches, got.stages) == (want.microbatches, want.stages)
        skipped += 3 - len(simulated)
        priced = got.diagnostics["priced"]
        assert priced.microbatches == got.microbatches and priced.cost == al.price_plan(
            table, got.stages, microbatches=got.microbatches, mem_limit_bytes=MEM, method="auto").cost
    assert skipped > 0


def test_auto_plan_prices_its_plan_once_and_to_the_same_bits(tiny, monkeypatch):
    table, _ = tiny
    plan = al.auto_plan(table=table, mem_limit_bytes=MEM)
    again = al.price_plan(table, [(s.layers, s.submesh, s.logical_mesh, s.remat) for s in plan.stages],
                          microbatches=plan.microbatches, mem_limit_bytes=MEM, method="auto",
                          intras=[s.intra for s in plan.stages], solutions=[s.solution for s in plan.stages])
    assert plan.cost == again.cost and plan.stages == again.stages
