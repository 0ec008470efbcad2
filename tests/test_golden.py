"""Plans priced to the bit: the auto, Megatron and data-parallel plans (and a few overrides of them) of a fixed set
of zoo configurations, against numbers recorded in tests/golden/plans.json before the pricing code was refactored.

Every float is compared with ``==`` (JSON keeps a float's repr, so the round trip is exact): a refactor of the
pricing layer must not move a single bit. A change that is meant to change the numbers (a new cost formula)
regenerates the file on purpose, with ``AUTOPAR_REGEN_GOLDEN=1 pytest tests/test_golden.py``, and says why in its
commit.

Regenerated 2026-12-06 for NCCL's collective latencies (``cluster/mesh.py``: a ring of n devices over k hosts pays
the inter-host latency on k-1 of its n-1 steps, not on every step; an all-to-all is one message per peer). Only the
``overrides`` of gpt-tiny, moe-tiny and wresnet-tiny moved: their auto
plans run one stage on SMALL's (1, 4) mesh over 2 hosts x 2 devices, where an all-gather or reduce-scatter's
latency fell from 3 x 50 us (every step charged the network's) to 2 x 3 + 50 = 56 us, so each alternative with one
such collective is 94 us cheaper (188 us with two) while the all-reduce alternative keeps its tree's 2 x (3 + 50) us;
the cheapest alternative is now ``RRS1 = RRR x RS1`` (``S1R = S1R x RR`` for wresnet-tiny), which ``with_choice`` and
``resolve`` then record. No auto, Megatron or data-parallel plan moved: their collectives run on axes of 2 devices
(one step either way), but gpt-tiny-cpu's first data-parallel plan: a resharding all-to-all on the ``cpu`` preset's
4-device host pays 3 latency steps (one message per peer) where a tree's log2 4 = 2 did, so its ILP reshards
otherwise (26 collectives a step for 22; the step 16.036 -> 16.072 ms).

Regenerated 2026-12-06 for the all-to-all across hosts (``LogicalMesh.all_to_all``: the bytes beyond a host go
through its NICs shared by the group's devices on it, g (n-g) / n^2 B, beside (g-1) / n^2 B on NVLink). No number
moved: only ``choices_sha1`` of gpt-1.3b's two data-parallel plans, whose (4, 1) mesh spans both hosts. Their ILP
now breaks a tie otherwise: each traced layer's causal-mask broadcast ([2, 32, 32, 32], free either way, recomputed
rather than kept) is made whole (``RRRR``) and sliced by its readers instead of made split by heads (``RS0RR``);
the dearer all-to-all moved the solver's optimal vertex, not the optimum.

Regenerated 2026-12-06 for the backward's working set (``pricing.stage.stage_cost``: a stage's static bytes now add
the cotangents of one (average) layer's activations of one microbatch, which live while that layer's backward runs;
measured on 8 CPU devices, bench/RESULTS.md execute-memory). Only ``static_bytes`` and ``peak_mem_bytes`` moved, each
by exactly its stage's ``act_bytes`` (one microbatch) over its layer count: gpt-tiny-cpu's one-layer auto stages by a
whole layer's activations (651,008 -> 1,049,344 B), the deep gpt-1.3b plans by under 0.2%. No plan, time or choice
moved: no memory limit here binds within that margin.

Regenerated 2026-12-07 for a pipeline's boundary (``pricing.stage.stage_cost``'s ``recv_bytes``/``sent_act_bytes``:
the stage receiving a microbatch's input keeps it and writes its gradient, the stage that sent it keeps it no longer;
measured on 8 CPU devices, bench/JOURNAL.md "the head stage's input"). Only ``act_bytes``, ``static_bytes`` and
``peak_mem_bytes`` of pipelined plans moved, each by exactly the residual stream's bytes per device of one
microbatch: a receiving stage's act and static by +b (its peak by b x (in flight + 1)), a sending stage's act by -b
(its peak by -b x in flight); under full recomputation only the receiver's static (+b: it kept its first layer's
input already). E.g. gpt-tiny's Megatron dp1 tp2 pp2 (8 x 16 x 32 float32 replicated, 2 microbatches: b = 8,192 B):
stage 0 peak -16,384, stage 1 +16,384. ``megatron_tried`` peaks are the largest stage's, so some moved by a
difference of two stages' moves. One-stage plans, every time, choice and stage cut: unchanged.

Regenerated 2026-12-07 for the backward's resharding buffers (``pricing.stage.stage_cost``: a stage's static bytes add
the destination buffers of its largest layer's backward reshardings of one microbatch, activations over the count,
weights once; ``LayerCost.reshard_dst_*_bytes``, ``solve.memterms.reshard_buffer_bytes``; priced on CPU devices,
where it was measured, only: ``backends.reshard_buffers_held``; measured on 8 CPU devices,
mixed dp2 x tp2 x pp2 1.17 / 1.19 -> 1.06 / 1.04 of its prediction). Only ``peak_mem_bytes`` (and ``static_bytes``
where a stage is recorded) moved, each by exactly those bytes: gpt-tiny's ``megatron_tried`` dp2 x tp2 x pp1 layouts
(entries 36-47), whose layers' backward reads fc1's output [8, 16, 128] and the attention's output [8, 16, 32] float32
gathered over the data axis (40,960 B a step), by 40,960 / microbatches (1, 2, 4, 8: +40,960 ... +5,120); moe-tiny's
Megatron dp1 tp2 pp2 stage 1, whose last block reshards its residual gradient [2, 32, 32] float32 whole (8,192 B a
step), by 4,096 (2 microbatches). Reductions of a gathered input (XLA reduces each shard and all-reduces) and gathered
weights held all step (already ``copies_bytes``) add nothing, so no other plan moved; no time, choice or cut moved.
"""

import hashlib
import json
import os
from pathlib import Path

import pytest

import autopar_lab as al
from autopar_lab import planner
from autopar_lab.cluster import Cluster

GOLDEN = Path(__file__).parent / "golden" / "plans.json"

SMALL = Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=2)

# name -> (zoo model, get() keywords, cluster, auto_plan keywords, megatron_plan keywords (list), data-parallel kw)
CONFIGS = {
    # Two layers, 2 hosts x 2 devices: both links, every submesh shape.
    "gpt-tiny": ("gpt-tiny", dict(dtype="float32", batch_size=8), SMALL, {}, [
        dict(dp=1, tp=2, pp=2, microbatches=2),
        dict(dp=1, tp=2, pp=2, microbatches=4, remat=True, schedule="gpipe"),
        dict(dp=2, tp=1, pp=2, microbatches=8, remat=True),
    ], [dict(microbatches=2), dict(microbatches=2, remat=True)]),
    # A deep zoo model planned on its shallow copy (24 layers priced by a 4-layer trace).
    "gpt-1.3b": ("gpt-1.3b", dict(batch_size=2, seq_len=32), SMALL, {}, [
        dict(dp=1, tp=2, pp=2, microbatches=2),
        dict(dp=2, tp=1, pp=2, microbatches=2, remat=True, schedule="gpipe"),
    ], [dict(), dict(remat=True)]),
    # The same deep model where memory forces a pipeline (the auto plan then has several stages and microbatches) and
    # moves its cut (mixed precision: 16 bytes a parameter, 21 GB for 1.3B parameters on four 16 GB V100s).
    "gpt-1.3b-tight": ("gpt-1.3b", dict(batch_size=8, seq_len=32), SMALL, dict(mem_limit_bytes=5.6e9), [
        dict(dp=1, tp=2, pp=2, microbatches=8, remat=True),
    ], [dict(microbatches=8, remat=True)]),
    "moe-tiny": ("moe-tiny", {}, SMALL, {}, [dict(dp=1, tp=2, pp=2, microbatches=2)], [dict()]),
    "wresnet-tiny": ("wresnet-tiny", {}, SMALL, {}, [dict(dp=2, tp=1, pp=2, microbatches=2)], [dict()]),
    # The cpu preset charges a per-task overhead (CostTable.task_overhead_s).
    "gpt-tiny-cpu": ("gpt-tiny", dict(dtype="float32", batch_size=8), Cluster.preset("cpu").with_(devices_per_host=4),
                     dict(microbatches="auto"), [dict(dp=1, tp=2, pp=2, microbatches=4)], [dict(microbatches=2)]),
}


def _stage(st) -> dict:
    choices = sorted((op, s.name) for op, s in st.intra.strategies.items())
    return {
        "layers": list(st.layers), "submesh": list(st.submesh), "logical_mesh": list(st.logical_mesh),
        "devices": list(st.devices), "remat": st.remat, "fwd_s": st.fwd_s, "bwd_s": st.bwd_s,
        "compute_s": st.compute_s, "comm_s": st.comm_s, "reshard_s": st.reshard_s,
        "static_bytes": st.static_bytes, "act_bytes": st.act_bytes, "peak_mem_bytes": st.peak_mem_bytes,
        "choices_sha1": hashlib.sha1(repr(choices).encode()).hexdigest(),
    }


def record(plan) -> dict:
    """Everything a plan's pricing decides: the cost report's terms, the stages' layout, times and memory."""
    return {
        "method": plan.method, "microbatches": plan.microbatches, "schedule": plan.schedule,
        "stage_comm": plan.stage_comm, "layer_names": len(plan.layer_names), "cost": plan.cost.to_dict(),
        "stages": [_stage(st) for st in plan.stages],
        # operator of the model's graph -> [strategy, scope] (before issue 32 the solve graph's operator -> strategy:
        # only these entries changed then, every number was kept to the bit)
        "pins": {str(k): [p.strategy, p.scope] for k, p in sorted(plan.pins.items())},
        "stage_pins": {k: repr(v) for k, v in sorted(plan.stage_pins.items())},
    }


def _table(model, cluster):
    """One cost table per configuration, shared by its plans (what a user does with ``table=``)."""
    return planner.CostTable.build(model, cluster)


def _with_table(fn, model, cluster, table, **kw):
    return fn(model, cluster, table=table, **kw)


def _priced_dot(plan) -> int:
    """The model's first matmul with another strategy to choose (a stage on one device has none: the cpu preset's
    auto plan has such stages)."""
    g = plan.graph
    return next((o for o in g.ops if g.op(o).primitive == "dot_general" and len(plan.alternatives(o)) > 1), None)


def _overrides(plan) -> dict:
    """A few overrides of one plan: a strategy change, remat, schedule, new stages, resolve around a pin."""
    dot = _priced_dot(plan)
    alts = plan.alternatives(dot)
    other = next(a.strategy for a in alts if a.strategy != plan.choice(dot).name)
    chosen = plan.with_choice(dot, other)
    out = {
        "alternatives": [[a.strategy, a.delta_s] for a in alts],
        "with_choice": record(chosen),
        "with_remat": record(plan.with_remat(0, not plan.stages[0].remat)),
        "with_schedule": record(plan.with_schedule("gpipe" if plan.schedule == "1f1b" else "1f1b")),
        "resolve": record(al.resolve(chosen)),
    }
    L = len(plan.layer_names)
    if L > 1:
        out["with_stages"] = record(plan.with_stages(boundaries=[L // 2]))
    return out


def compute(name: str) -> dict:
    zoo, get_kw, cluster, auto_kw, megatron_kws, dp_kws = CONFIGS[name]
    model = al.models.get(zoo, **get_kw)
    table = _table(model, cluster)
    auto = _with_table(planner.auto_plan, model, cluster, table, **auto_kw)
    megatron = [_with_table(planner.megatron_plan, model, cluster, table, **kw) for kw in megatron_kws]
    out = {
        "auto": record(auto),
        "megatron": [record(p) for p in megatron],
        "data_parallel": [record(_with_table(planner.data_parallel_plan, model, cluster, table, **kw))
                          for kw in dp_kws],
        # the overrides of the auto plan, or of the first plan with a matmul to re-choose (the cpu preset's auto plan
        # puts every stage on one device)
        "overrides": _overrides(next(p for p in [auto, *megatron] if _priced_dot(p) is not None)),
    }
    if name == "gpt-tiny":
        base = planner.baselines(table, cluster)
        out["baselines"] = {"megatron_best": record(base["megatron_best"]), "megatron_config": base["megatron_config"],
                            "megatron_tried": base["megatron_tried"], "data_parallel": record(base["data_parallel"])}
    return out


def _load() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_plans_price_to_the_recorded_bits(name):
    got = json.loads(json.dumps(compute(name)))  # through JSON, as stored (tuples become lists)
    if os.environ.get("AUTOPAR_REGEN_GOLDEN"):
        data = _load()
        data[name] = got
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        pytest.skip("golden file regenerated")
    want = _load().get(name)
    assert want is not None, f"no golden numbers for {name!r}; regenerate with AUTOPAR_REGEN_GOLDEN=1"
    assert got == want


@pytest.mark.slow
def test_a_plan_file_reloads_to_the_recorded_bits(tmp_path):
    """load_plan re-prices a saved plan: the same numbers as the plan that was saved, for a deep model too."""
    want = _load()["gpt-1.3b"]["overrides"]["resolve"]
    zoo, get_kw, cluster, *_ = CONFIGS["gpt-1.3b"]
    model = al.models.get(zoo, **get_kw)
    table = _table(model, cluster)
    plan = _with_table(planner.auto_plan, model, cluster, table)
    dot = _priced_dot(plan)
    other = next(a.strategy for a in plan.alternatives(dot) if a.strategy != plan.choice(dot).name)
    resolved = al.resolve(plan.with_choice(dot, other))
    al.save_plan(resolved, tmp_path / "p.json")
    loaded = al.load_plan(tmp_path / "p.json", table.graph, cluster, model=model)
    assert json.loads(json.dumps(record(loaded))) == want
