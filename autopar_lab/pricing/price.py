"""A plan's price from its decisions: :func:`price_plan`, the one function every plan goes through.

The planner (auto, Megatron, data parallel), the global-optimum search, every override, :func:`resolve` and
:func:`~autopar_lab.planfile.load_plan` all hand their decisions here (each stage's layers, submesh, logical mesh,
remat and sharding; the microbatch count and schedule) and get the same numbers for the same decisions:

1. each stage's per-microbatch times and memory from its layer costs (:func:`~autopar_lab.pricing.stage.stage_cost`);
2. the transfers between stages over the link their placement implies (:func:`stage_transfers`);
3. the event-level simulation of the pipeline (:func:`simulate_pipeline`): its makespan is the step time;
4. the cost report, the busiest stage's busy time split in proportion to its terms, communication hidden behind its
   compute (gradient reduction behind the last backward, parameter gathers behind the forward) reported beside them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

from ..plan import CostReport, Plan, Stage
from ..simulate import Timeline, simulate
from ..solve.inter import transfer_s
from .stage import hidden_comm_s, prefix_sums

if TYPE_CHECKING:
    from ..solve.intra import IntraPlan
    from .layers import LayerCost
    from .table import CostTable


class StageSpec(NamedTuple):
    """The decisions of one stage: its layers (first, last), submesh, logical mesh and rematerialisation."""

    layers: tuple[int, ...]  # (first, last)
    submesh: tuple[int, ...]  # (hosts, devices per host)
    logical_mesh: tuple[int, ...]  # (n0, n1)
    remat: bool


def stage_spec(stage: Any) -> StageSpec:
    """A StageSpec from a 4-tuple or anything with the four attributes (a StageCandidate, a Stage)."""
    if isinstance(stage, tuple) and not hasattr(stage, "layers"):
        layers, submesh, shape, remat = stage
    else:
        layers, submesh, shape, remat = stage.layers, stage.submesh, stage.logical_mesh, stage.remat
    return StageSpec(tuple(layers), tuple(submesh), tuple(shape), bool(remat))


def stage_offsets(stages: Sequence[Any]) -> list[int]:
    """The first device of each stage: stages take consecutive devices in pipeline order."""
    offsets, o = [], 0
    for st in stages:
        offsets.append(o)
        o += st.submesh[0] * st.submesh[1]
    return offsets


def stage_transfers(table: CostTable, stages: Sequence[Any], microbatches: int) -> list[float]:
    """Seconds to send one microbatch's activations across each cut (gradients come back at the same size): over
    the intra-host link when the next stage starts inside a host, else the inter-host link."""
    cluster, offsets = table.cluster, stage_offsets(stages)
    out = []
    for k in range(1, len(stages)):
        nbytes = table.cut_bytes[stages[k].layers[0] - 1] / microbatches
        link = cluster.intra_host if offsets[k] % cluster.devices_per_host else cluster.inter_host
        out.append(transfer_s(nbytes, link))
    return out


def simulate_pipeline(fwd_s: Sequence[float], bwd_s: Sequence[float], microbatches: int, schedule: str,
                      sends: Sequence[float], act_bytes: Sequence[float], static_bytes: Sequence[float],
                      mem_limit_bytes: float) -> Timeline:
    """The pipeline's timeline: the schedule as is, or for 1F1B with transfers, a deeper warm-up when that is
    faster and still fits in ``mem_limit_bytes``.

    The deeper warm-up counts each cut as pipeline positions (as the DP's latency formula does: a transfer is a
    stage of its own), so a slow link's round trip is hidden by more microbatches in flight."""
    def run(warmup):
        return simulate(fwd_s, bwd_s, microbatches, schedule, send_fwd_s=sends, send_bwd_s=sends,
                        act_bytes=act_bytes, static_bytes=static_bytes, warmup=warmup)

    tl = run(None)
    if schedule == "1f1b" and any(sends):
        S = len(fwd_s)
        t_ref = max(f + b for f, b in zip(fwd_s, bwd_s)) or 1.0
        extra = [math.ceil((x + x) / t_ref - 1e-9) if x + x > 0 else 0 for x in sends]
        deep = run([S - i + sum(extra[i:]) for i in range(S)])
        if deep.makespan < tl.makespan and all(m <= mem_limit_bytes for m in deep.peak_mem_bytes):
            tl = deep
    return tl


def price_plan(table: CostTable, stages: Sequence[Any], *, microbatches: int, schedule: str = "1f1b",
               stage_comm: str = "model", mem_limit_bytes: float | None = None, method: str = "custom",
               intras: Sequence[IntraPlan | None] | None = None,
               layer_costs: Sequence[Sequence[LayerCost] | None] | None = None,
               solve_s: Mapping[str, float] | None = None, notes: Sequence[str] = (),
               pins: Mapping[int, str] | None = None, stage_pins: Mapping[str, Any] | None = None) -> Plan:
    """The :class:`~autopar_lab.plan.Plan` of these decisions, priced by ``table``.

    ``stages``: one entry per stage, (layers, submesh, logical_mesh, remat) or anything with those attributes
    (StageCandidates from the DP, a plan's Stages); their times are not read, they are priced here. ``intras``: each
    stage's IntraPlan (None or absent: the table's solution for its mesh); ``layer_costs``: each stage's full-graph
    layer costs of that IntraPlan when the caller already has them (absent: computed). ``mem_limit_bytes``: the
    memory per device the plan is checked against (default: the device's). ``solve_s``, ``notes``, ``pins`` and
    ``stage_pins`` are stored on the plan as given.

    >>> import autopar_lab as al                                                           # doctest: +SKIP
    >>> table = al.CostTable.build(al.models.get("gpt-tiny"), cluster)                     # doctest: +SKIP
    >>> price_plan(table, [((0, 3), (1, 8), (2, 4), False)], microbatches=2).cost.step_time_s  # doctest: +SKIP
    """
    specs = [stage_spec(st) for st in stages]
    cluster = table.cluster
    mem = float(cluster.device.memory_bytes if mem_limit_bytes is None else mem_limit_bytes)
    priced, per_stage, hidden = [], [], []
    for j, spec in enumerate(specs):
        intra = intras[j] if intras is not None else None
        costs = layer_costs[j] if layer_costs is not None else None
        own = table.solved_mesh(spec.submesh, spec.logical_mesh) if intra is not None else None
        if intra is None or (own is not None and own[1] is intra):
            costs, intra = table.mesh_costs(spec.submesh, spec.logical_mesh)
            sums = table.prefix_sums(spec.submesh, spec.logical_mesh)
        else:
            costs = costs if costs is not None else table.layer_costs_of(intra)
            sums = prefix_sums(costs)
        priced.append(table.stage_from_sums(sums, spec.layers[0], spec.layers[1], spec.submesh, spec.logical_mesh,
                                            microbatches, spec.remat, intra))
        first, last = spec.layers
        totals = {f: v[last + 1] - v[first] for f, v in sums.items()}
        launches = (totals["heavy_fwd"] * (2 if spec.remat else 1) + totals["heavy_bwd"]) * microbatches
        hidden.append((*hidden_comm_s(totals, microbatches), int(round(launches))))
        per_stage.append((tuple(costs), intra))

    sends = stage_transfers(table, priced, microbatches)
    tl = simulate_pipeline([s.fwd_s for s in priced], [s.bwd_s for s in priced], microbatches, schedule, sends,
                           [s.act_bytes for s in priced], [s.static_bytes for s in priced], mem)
    busiest = max(range(len(priced)), key=lambda i: tl.busy_s[i])
    plan_stages = []
    for st, off, peak, (costs, intra) in zip(priced, stage_offsets(priced), tl.peak_mem_bytes, per_stage):
        part = costs[st.layers[0]:st.layers[1] + 1]
        plan_stages.append(Stage(st.layers, st.submesh, st.logical_mesh,
                                 tuple(range(off, off + st.submesh[0] * st.submesh[1])), st.remat, st.fwd_s, st.bwd_s,
                                 sum(c.compute_s for c in part), sum(c.comm_s for c in part),
                                 sum(c.reshard_s for c in part), st.static_bytes, st.act_bytes, peak, intra, costs))
    b = plan_stages[busiest]
    busy = tl.busy_s[busiest]
    # Communication hidden behind compute is not in the busy time: only what shows is split.
    hid_sync, hid_gather, kernels = hidden[busiest]
    comm, reshard = max(b.comm_s - hid_sync, 0.0), max(b.reshard_s - hid_gather, 0.0)
    work = b.compute_s + comm + reshard
    # The busiest stage's busy time, split in proportion to its terms (launch overheads and recomputation included).
    scale = busy / work if work > 0 else 0.0
    cost = CostReport(
        step_time_s=tl.makespan,
        compute_s=b.compute_s * scale,
        comm_s=comm * scale,
        reshard_s=reshard * scale,
        stage_comm_s=sum(sends) + sum(sends),
        bubble_s=tl.makespan - busy,
        peak_mem_bytes=tuple(tl.peak_mem_bytes),
        mem_limit_bytes=mem,
        samples_per_s=table.batch_size / tl.makespan if tl.makespan > 0 else math.inf,
        busiest_stage=busiest,
        timeline=tl,
        hidden_comm_s=float(hid_sync + hid_gather),
        kernels=kernels,
        flash_attention=cluster.device.efficiency.flash_attention,
    )
    return Plan(table.graph, cluster, method, tuple(table.layer_names), tuple(plan_stages), microbatches, schedule,
                stage_comm, cost, dict(solve_s or {}), tuple(notes), pins=dict(pins or {}),
                stage_pins=dict(stage_pins or {}), table=table)


def table_of(plan: Plan) -> CostTable:
    """The cost table that priced ``plan`` (what re-pricing an override needs); a ValueError when it has none."""
    if plan.table is None:
        raise ValueError("this plan has no cost table to re-price it with; build it with autopar_lab.planner "
                         "(auto_plan, megatron_plan, data_parallel_plan) or load it with load_plan")
    return plan.table
