"""A stage that reads a parameter another stage holds (GPT's tied token embedding on the last stage) holds that
weight and its gradient while it runs (:func:`autopar_lab.pricing.layers.shared_weights`): priced by hand here.

The term is what a stage's static bytes gain over the same stage priced from layer costs without it (the
``shared`` entries stripped: what an untied head's stage would hold besides its own ``lm_head``): the embedding's
weight as the stage computes with it plus its gradient as stored, ``V x H`` elements each.
"""

from __future__ import annotations

import dataclasses

import pytest

import autopar_lab as al
from autopar_lab import planner
from autopar_lab.pricing.stage import prefix_sums

TWO = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=2)


def _gain(table, plan, k: int) -> float:
    """Static bytes stage ``k`` of ``plan`` gains from the shared-weight term, and a check that the plan's stage is
    the table's (so the gain is the plan's)."""
    st = plan.stages[k]
    costs, intra = table.mesh_costs(st.submesh, st.logical_mesh)
    a, b = st.layers

    def priced(cs):
        return table.stage_from_sums(prefix_sums(cs), a, b, st.submesh, st.logical_mesh, plan.microbatches,
                                     st.remat, intra)

    with_term = priced(costs)
    assert with_term.static_bytes == pytest.approx(st.static_bytes, rel=1e-12)
    return with_term.static_bytes - priced([dataclasses.replace(c, shared=()) for c in costs]).static_bytes


def test_tied_gpt_last_stage_holds_the_embedding_and_its_gradient():
    model = al.models.get("gpt-tiny", dtype="float32", batch_size=8, num_layers=2)
    V, H = model.config.vocab_size, model.config.hidden_size
    table = planner.CostTable.build(model, TWO)
    plan = al.megatron_plan(model, TWO, dp=1, tp=1, pp=2, microbatches=2, table=table)
    assert plan.stages[0].layers[0] == 0 and plan.stages[1].layers[1] == len(plan.layer_names) - 1
    # one device a stage, float32, no master weight: the weight (4 bytes) and its gradient (4 bytes) a parameter
    assert _gain(table, plan, 1) == V * H * (4 + 4)
    assert _gain(table, plan, 0) == 0.0  # the stage that holds it counts it once, as its own parameter
    one = al.megatron_plan(model, TWO, dp=2, tp=1, pp=1, microbatches=1, table=table)
    assert _gain(table, one, 0) == 0.0  # one stage holds every reader of the weight: nothing received


def test_deep_mixed_precision_gpt_planned_on_its_shallow_copy():
    """24 layers priced from a 4-layer trace: the head's stage receives the float16 compute copy of the float32
    master embedding (2 bytes an element) and returns its float32 gradient (4 bytes), as the runner measured on
    gpt-350m's last stage (25 + 50 MiB a device at tp4)."""
    model = al.models.get("gpt-tiny", dtype="float16", batch_size=8, num_layers=24)
    V, H = model.config.vocab_size, model.config.hidden_size
    table = planner.CostTable.build(model, TWO)
    assert table.solve_graph is not table.graph  # planned on the shallow copy
    plan = al.megatron_plan(model, TWO, dp=1, tp=1, pp=2, microbatches=2, table=table)
    assert len(plan.layer_names) == 26
    assert _gain(table, plan, 1) == V * H * (2 + 4)
    assert _gain(table, plan, 0) == 0.0
