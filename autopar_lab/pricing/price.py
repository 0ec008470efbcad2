"""A plan's price from its decisions: :func:`price_stages`, the one function every plan goes through.

The planner (auto, Megatron, data parallel), the global-optimum search, every override, :func:`resolve` and
:func:`~autopar_lab.planfile.load_plan` all hand their decisions here (each stage's layers, submesh, logical mesh,
remat and sharding; the microbatch count and schedule) and get the same numbers for the same decisions, as a
:class:`Priced` value (the stages and the cost report) that the plans layer puts into a Plan
(:func:`autopar_lab.plan.price_plan` for a new one, :meth:`Priced.onto` for a plan re-priced):

1. each stage's per-microbatch times and memory from its layer costs (:func:`~autopar_lab.pricing.stage.stage_cost`);
2. the transfers between stages over the link their placement implies (:func:`stage_transfers`);
3. the event-level simulation of the pipeline (:func:`simulate_pipeline`): its makespan is the step time;
4. the cost report, the busiest stage's busy time split in proportion to its terms, communication hidden behind its
   compute (gradient reduction behind the last backward, parameter gathers behind the forward) reported beside them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

from ..backends import cpu_cost, host_launch_s, host_of_stages, program_rereads_s
from ..planvalues import CostReport, Stage
from ..precision import precision_note
from ..rematmode import is_full, recomputes, remat_value
from ..schedules import check_layout, interleave, schedule_of
from ..simulate import SimOptions, Timeline, makespan_floor, simulate
from ..solve.inter import transfer_s
from .accumulate import accumulated_layer_costs
from .eagerloss import loss_extra_bytes
from .incremental import split_layer_costs
from .memory import transient_bytes
from .stage import hidden_comm_s, host_stretch, is_running_sum, prefix_sums, recompute_s, recomputed_kernels
from .wgrad import weight_grad_fraction
from .overlap import overlap_layer_costs, paired_share
from .zero import zero_layer_costs

if TYPE_CHECKING:
    from ..solve.inter import StageCandidate
    from ..solve.intra import IntraPlan
    from .layers import LayerCost
    from .table import CostTable


class StageSpec(NamedTuple):
    """The decisions of one stage: its layers (first, last), submesh, logical mesh and rematerialisation."""

    layers: tuple[int, ...]  # (first, last)
    submesh: tuple[int, ...]  # (hosts, devices per host)
    logical_mesh: tuple[int, ...]  # (n0, n1)
    remat: bool | str  # False (none), True (full) or "selective"


def stage_spec(stage: Any) -> StageSpec:
    """A StageSpec from a 4-tuple or anything with the four attributes (a StageCandidate, a Stage)."""
    if isinstance(stage, tuple) and not hasattr(stage, "layers"):
        layers, submesh, shape, remat = stage
    else:
        layers, submesh, shape, remat = stage.layers, stage.submesh, stage.logical_mesh, stage.remat
    return StageSpec(tuple(layers), tuple(submesh), tuple(shape), remat_value(remat))


def stage_offsets(stages: Sequence[Any]) -> list[int]:
    """The first device of each stage: stages take consecutive devices in pipeline order."""
    offsets, o = [], 0
    for st in stages:
        offsets.append(o)
        o += st.submesh[0] * st.submesh[1]
    return offsets


def scale_out_hosts(cluster, sender: Any, receiver: Any) -> int:
    """How many hosts' scale-out links carry a cut between two stages: each device sends its own part of the
    microbatch's activations to its counterpart in the next stage (each data-parallel replica its own samples, each
    tensor-parallel rank its shard), so a stage spread over ``h`` hosts sends over ``h`` hosts' network links at
    once (``inter_host.bandwidth`` is one host's); the smaller of the two stages' host counts, at least 1.

    >>> from types import SimpleNamespace as S
    >>> dgx = S(devices_per_host=8)
    >>> scale_out_hosts(dgx, S(submesh=(64, 8)), S(submesh=(64, 8))), scale_out_hosts(dgx, S(submesh=(1, 4)),
    ...                                                                                S(submesh=(2, 8)))
    (64, 1)
    """
    def hosts(st: Any) -> int:
        return max(1, (st.submesh[0] * st.submesh[1]) // cluster.devices_per_host)

    return min(hosts(sender), hosts(receiver))


def stage_transfers(table: CostTable, stages: Sequence[Any], microbatches: int) -> list[float]:
    """Seconds to send one microbatch's activations across each cut (gradients come back at the same size): over
    the scale-up link when the next stage starts inside a scale-up domain (a host, or the hosts sharing an NVLink
    fabric), else the scale-out links of the hosts the stages span (:func:`scale_out_hosts`)."""
    cluster, offsets = table.cluster, stage_offsets(stages)
    out = []
    for k in range(1, len(stages)):
        nbytes = table.cut_bytes[stages[k].layers[0] - 1] / microbatches
        if offsets[k] % cluster.devices_per_domain:
            out.append(transfer_s(nbytes, cluster.scale_up_link(2)))
        else:
            out.append(transfer_s(nbytes / scale_out_hosts(cluster, stages[k - 1], stages[k]), cluster.inter_host))
    return out


def chunk_transfers(table: CostTable, stages: Sequence[Any], chunks: Sequence[Sequence[Sequence[int]]],
                    microbatches: int) -> list[float]:
    """:func:`stage_transfers` of an interleaved plan: one per cut between consecutive chunks (virtual stage ``c``
    on stage ``c % p``), the link chosen as for the stage the chunk after the cut runs on; the cut from the last
    stage back to stage 0 crosses domains unless the whole pipeline sits in one scale-up domain."""
    cluster, offsets, p = table.cluster, stage_offsets(stages), len(stages)
    order = [chunks[c % p][c // p] for c in range(p * len(chunks[0]))]
    last_device = offsets[-1] + stages[-1].submesh[0] * stages[-1].submesh[1] - 1
    out = []
    for c in range(1, len(order)):
        k = c % p
        nbytes = table.cut_bytes[order[c][0] - 1] / microbatches
        inside = offsets[k] % cluster.devices_per_domain if k else last_device < cluster.devices_per_domain
        if inside:
            out.append(transfer_s(nbytes, cluster.scale_up_link(2)))
        else:
            out.append(transfer_s(nbytes / scale_out_hosts(cluster, stages[k - 1], stages[k]), cluster.inter_host))
    return out


def simulate_pipeline(fwd_s: Sequence[float], bwd_s: Sequence[float], microbatches: int, schedule: str,
                      sends: Sequence[float], mem_limit_bytes: float, *, wgrad_s: Sequence[float] | None = None,
                      virtual_stages: int = 1, options: SimOptions = SimOptions()) -> Timeline:
    """The pipeline's timeline: the schedule as is, or for 1F1B with transfers, a deeper warm-up when that is
    faster and still fits in ``mem_limit_bytes``. ``wgrad_s``, ``virtual_stages`` and ``options`` (each stage's
    memory and host; its warm-up is chosen here): as for :func:`~autopar_lab.simulate.simulate` (ZB-H1,
    interleaved, stages sharing a CPU host's cores).

    The deeper warm-up counts each cut as pipeline positions (as the DP's latency formula does: a transfer is a
    stage of its own), so a slow link's round trip is hidden by more microbatches in flight."""
    def run(warmup):
        return simulate(fwd_s, bwd_s, microbatches, schedule, send_fwd_s=sends, send_bwd_s=sends, wgrad_s=wgrad_s,
                        virtual_stages=virtual_stages, options=options.with_warmup(warmup))

    tl = run(None)
    if schedule == "1f1b" and any(sends):
        S = len(fwd_s)
        t_ref = max(f + b for f, b in zip(fwd_s, bwd_s)) or 1.0
        extra = [math.ceil((x + x) / t_ref - 1e-9) if x + x > 0 else 0 for x in sends]
        deep = run([S - i + sum(extra[i:]) for i in range(S)])
        if deep.makespan < tl.makespan and all(m <= mem_limit_bytes for m in deep.peak_mem_bytes):
            tl = deep
    return tl


class StepAbove(Exception):
    """:func:`price_stages` with ``skip_above``: the step's lower bound (``floor``, seconds) is above the step to beat,
    so the plan was not simulated."""

    def __init__(self, floor: float):
        super().__init__(f"the step is at least {floor:.6g} s")
        self.floor = floor


class Priced(NamedTuple):
    """What pricing a plan's decisions gives: its stages (times, memory, each one's IntraPlan and layer costs), the
    cost report, and the schedule and model chunks per stage it was priced with."""

    stages: tuple[Stage, ...]
    cost: CostReport
    schedule: str
    virtual_stages: int

    def onto(self, plan: Any, **fields: Any) -> Any:
        """``plan`` (re-priced from its own table) with these stages, cost, schedule and chunk count, and ``fields``
        (the microbatch count, pins ... that changed) replaced: a new value of the plan's own class."""
        return dataclasses.replace(plan, stages=self.stages, cost=self.cost, schedule=self.schedule,
                                   virtual_stages=self.virtual_stages, **fields)


def price_stages(table: CostTable, stages: Sequence[Any], *, microbatches: int, schedule: str = "1f1b",
                 virtual_stages: int | None = None, mem_limit_bytes: float | None = None,
                 intras: Sequence[IntraPlan | None] | None = None,
                 layer_costs: Sequence[Sequence[LayerCost] | None] | None = None,
                 layer_pins: Mapping[int, str] | None = None, solutions: Sequence[str] | None = None,
                 zero: int | None = None, skip_above: float = math.inf,
                 overlap: Sequence[str] | None = None, host: str | None = None,
                 accumulate: str | None = None, eager_loss: float | None = None,
                 microbatch_group: int | None = None) -> Priced:
    """The price of these decisions by ``table``: each stage's times and memory and the cost report (:class:`Priced`).

    ``stages``: one entry per stage, (layers, submesh, logical_mesh, remat) or anything with those attributes
    (StageCandidates from the DP, a plan's Stages); their times are not read, they are priced here. ``intras``: each
    stage's IntraPlan (None or absent: a stage candidate's payload, else the table's solution for its mesh);
    ``solutions``: which of its mesh's solutions each stage's sharding is ("fast" or "lean", see
    :meth:`~autopar_lab.pricing.table.CostTable.solutions`; absent: a stage candidate's or stage's own ``solution``,
    else "fast"), recorded on the stages and used where a stage has no IntraPlan given; ``layer_costs``: each
    stage's full-graph layer costs of that IntraPlan when the caller already has them (absent: computed).
    ``mem_limit_bytes``: the memory per device the plan is checked against (default: the device's).
    ``layer_pins`` (full-graph op -> strategy name): layers split from the layers that share their solution, each
    priced on its own (:func:`~autopar_lab.pricing.incremental.split_layer_costs`); without any, nothing changes.
    ``zero``: a ZeRO stage (0-3; a plan's ``stage_pins["zero"]``): every stage's memory priced as ZeRO splits it
    (:mod:`~autopar_lab.pricing.zero`), the updated weights gathered in the compute dtype; None: the storage each
    IntraPlan chose.
    ``overlap``: the communication hidden behind compute (a plan's ``stage_pins["overlap"]``, names of
    :data:`~autopar_lab.pricing.overlap.OVERLAPS`: Megatron-Core's ``--overlap-grad-reduce``,
    ``--overlap-param-gather``, ``--tp-comm-overlap`` and ``--overlap-moe-expert-parallel-comm``;
    :mod:`~autopar_lab.pricing.overlap` says how each is
    priced); None: the layer costs as they are (the weight-gradient collectives hidden, nothing else).
    ``host``: how the plan's framework launches its kernels (a plan's ``stage_pins["host"]``): "eager", each from
    Python (:mod:`autopar_lab.backends.eager`: a stage's microbatch lasts at least its kernels times the fitted host
    time per kernel, :func:`~autopar_lab.pricing.stage.host_stretch`; the cost report's ``host_s`` is what that
    adds to the busiest stage); None: a compiled program, the GPU's time alone.
    ``accumulate``: how the plan's framework holds the gradients between microbatches (a plan's
    ``stage_pins["accumulate"]``): "unsharded", FSDP2 without a gradient sync until the last microbatch, each
    parameter's float32 gradient gathered over the FSDP group (:mod:`~autopar_lab.pricing.accumulate`); None: as the
    strategies store them.
    ``eager_loss``: bytes a device holds a step of the loss an eager PyTorch framework computes after its model (a
    plan's ``stage_pins["eager_loss"]``, :func:`~autopar_lab.pricing.eagerloss.eager_loss_bytes`): the stage
    computing the loss holds what it needs beyond its average layer's working set at the loss's backward
    (:mod:`~autopar_lab.pricing.eagerloss`); None: the loss as the traced step computes it.
    ``skip_above``: a step time to beat; when the simulated step cannot (its lower bound,
    :func:`~autopar_lab.simulate.makespan_floor`, is above it), the simulation is skipped and :class:`StepAbove`
    raised (the planner's ranking of several plans by simulation).

    ``schedule``: "1f1b", "gpipe", "interleaved" or "zb-h1" (see :mod:`autopar_lab.schedules`). Interleaved: each
    stage runs ``virtual_stages`` chunks (default 2; :func:`~autopar_lab.schedules.schedule_of` reads a plan's pinned
    count), each chunk priced by
    the stage-cost formula as a stage of its own on the stage's mesh, with a transfer at every cut between chunks;
    ``microbatch_group``: the microbatches each chunk runs in a row (a plan's ``stage_pins["microbatch_group"]``,
    Megatron-LM's ``--microbatch-group-size-per-virtual-pipeline-stage``; None: the stage count, Megatron-LM's
    default), which sets each stage's warm-up and so the chunk-microbatches it holds
    (:func:`~autopar_lab.schedules.warmup_chunks`); ignored by the other schedules.
    ZB-H1: each stage's backward is priced as two tasks, B and W, split by
    :func:`~autopar_lab.pricing.wgrad.weight_grad_fraction` (W pays its own per-task overhead).
    """
    specs = [stage_spec(st) for st in stages]
    schedule, v = schedule_of(schedule, virtual_stages, None)
    group = microbatch_group if schedule == "interleaved" else None
    check_layout(schedule, v, [s.layers[1] - s.layers[0] + 1 for s in specs], microbatches, group)
    cluster = table.cluster
    mem = float(cluster.device.memory_bytes if mem_limit_bytes is None else mem_limit_bytes)
    per_kernel = host_launch_s(host)
    loss_layer = len(table.layer_names) - 1  # the head's: where the loss is computed
    priced, per_stage, stage_sums, hidden = [], [], [], []
    # per stage: (unsharded gradient bytes, the shard they replace) where held unsharded; what the eager loss adds
    held: dict[int, tuple[float, float]] = {}
    loss_extra = [0.0] * len(specs)
    chosen: list[str] = []  # each stage's solution
    # The layer ranges each stage runs: its chunks when interleaved (a stage's layers are then its range in the
    # 1F1B layout), else its layers.
    ranges: list[tuple[tuple[int, int], ...]] = (interleave([s.layers for s in specs], v) if v > 1
                                                  else [((s.layers[0], s.layers[1]),) for s in specs])
    for j, spec in enumerate(specs):
        # A stage candidate of the DP carries the IntraPlan it was priced with (a mesh's fast or lean solution).
        intra = intras[j] if intras is not None else getattr(stages[j], "payload", None)
        solution = solutions[j] if solutions is not None else getattr(stages[j], "solution", "fast")
        chosen.append(solution)
        costs = layer_costs[j] if layer_costs is not None else None
        own = table.solved_mesh(spec.submesh, spec.logical_mesh, solution) if intra is not None else None
        if intra is None or (own is not None and own[1] is intra):
            costs, intra = table.mesh_costs(spec.submesh, spec.logical_mesh, solution)
            sums = table.prefix_sums(spec.submesh, spec.logical_mesh, solution)
        else:
            costs = costs if costs is not None else table.layer_costs_of(intra)
            sums = prefix_sums(costs)
        if zero is not None:  # ZeRO's memory and its gathers of the updated weights (pricing.zero)
            costs = zero_layer_costs(table, intra, costs, zero)
            sums = prefix_sums(costs)
        if overlap is not None:  # what the plan's framework overlaps (pricing.overlap)
            costs = overlap_layer_costs(table, intra, costs, overlap, zero,
                                        paired_share(schedule, len(specs), j, microbatches, v, group))
            sums = prefix_sums(costs)
        if accumulate is not None and microbatches > 1:  # gradients held unsharded (pricing.accumulate)
            shard = sum(c.grad_bytes for a, z in ranges[j] for c in costs[a:z + 1])
            costs = accumulated_layer_costs(table, intra, costs, accumulate, microbatches)
            sums = prefix_sums(costs)
            held[j] = (sum(c.grad_bytes for a, z in ranges[j] for c in costs[a:z + 1]), shard)
        kept = costs  # what the stage keeps: the costs of its IntraPlan, every layer sharing its solution
        if layer_pins:
            for first, last in ranges[j]:
                split = split_layer_costs(table, intra, costs, (first, last), layer_pins,
                                          table.strategy_cache(intra.mesh), j)
                if split is not None:
                    costs = split
                    sums = prefix_sums(costs)
        bare = table.stage_from_sums(sums, spec.layers[0], spec.layers[1], spec.submesh, spec.logical_mesh,
                                     microbatches, spec.remat, intra)
        priced.append(with_loss(bare, costs, microbatches, eager_loss, loss_layer))
        loss_extra[j] = priced[-1].static_bytes - bare.static_bytes
        if per_kernel:
            priced[-1] = hosted(priced[-1], sums, (spec.layers[0], spec.layers[1]), per_kernel)
        # What the stage hides behind its compute and the kernels it launches a step (over its chunks when
        # interleaved: each chunk is priced as a stage of its own).
        hid_sync = hid_gather = launches = colls = latency = 0.0
        for first, last in ranges[j]:
            span = {f: run[last + 1] - run[first] for f, run in sums.items() if is_running_sum(f)}
            sync, gather = hidden_comm_s(span, microbatches)
            hid_sync, hid_gather = hid_sync + sync, hid_gather + gather
            again = span["heavy_fwd"] if is_full(spec.remat) else recomputed_kernels(span, cluster, spec.remat) \
                if recomputes(spec.remat) else 0.0
            launches += (span["heavy_fwd"] + again + span["heavy_bwd"]) * microbatches
            # Collectives issued every microbatch (a full recomputation issues the forward's again).
            twice = 2 if is_full(spec.remat) else 1
            colls += (span["collectives_fwd"] * twice + span["collectives_bwd"]) * microbatches
            latency += (span["latency_fwd_s"] * twice + span["latency_bwd_s"]) * microbatches
        # The fixed cost of the stage's programs a step (its chunks' when interleaved), by stage_cost's formula: a
        # forward and a backward task per microbatch and the update once, each taking its arrays (the CPU).
        tasks_s = rereads_s = 0.0
        for first, last in ranges[j]:
            # Every microbatch's backward reads its layers' outputs again (stage_cost's rereads_s, per step).
            rereads_s += program_rereads_s(cluster, sums, first, last)
            task, arrays = table.task_charge(first, last, spec.submesh, microbatches)
            args = sums["task_arrays_s"][last + 1] - sums["task_arrays_s"][first]
            per_mb = 3 if schedule == "zb-h1" else 2  # ZB-H1's weight gradient is a task of its own
            tasks_s += (per_mb * microbatches + 1) * task + 4 * microbatches * args * arrays
        hidden.append((hid_sync, hid_gather, int(round(launches)), int(round(colls)), latency, tasks_s, rereads_s))
        per_stage.append((tuple(costs), intra, kept))
        stage_sums.append(sums)

    p = len(priced)
    chunks = ranges
    wgrad = [0.0] * p
    if v > 1:
        # Every chunk is priced as a stage of its own on its stage's mesh (its own tasks, overheads and entry).
        parts = [[hosted(with_loss(table.stage_from_sums(stage_sums[k], a, b, st.submesh, st.logical_mesh,
                                                         microbatches, st.remat, st.payload),
                                   per_stage[k][0], microbatches, eager_loss, loss_layer),
                         stage_sums[k], (a, b), per_kernel)
                  for a, b in chunks[k]] for k, st in enumerate(priced)]
        # A stage runs one chunk's task at a time: the backward's transients (its buffers, a recomputed layer's
        # activations: pricing.memory.stage_memory), in each chunk's static bytes, are held for one chunk, not all v.
        for k, st in enumerate(priced):
            spare = [transient_bytes(per_stage[k][0], rng, microbatches, st.remat) for rng in chunks[k]]
            top = spare.index(max(spare))
            parts[k] = [dataclasses.replace(c, static_bytes=c.static_bytes - (0.0 if i == top else w))
                        for i, (c, w) in enumerate(zip(parts[k], spare))]
        order = [parts[c % p][c // p] for c in range(p * v)]
        sim = dict(fwd=[c.fwd_s for c in order], bwd=[c.bwd_s for c in order], act=[c.act_bytes for c in order],
                   static=[c.static_bytes for c in order])
        sends = chunk_transfers(table, priced, chunks, microbatches)
        totals = [tuple(sum(getattr(c, f) for c in parts[k]) for f in ("fwd_s", "bwd_s", "static_bytes", "act_bytes"))
                  for k in range(p)]
    else:
        totals = [(s.fwd_s, s.bwd_s, s.static_bytes, s.act_bytes) for s in priced]
        if schedule == "zb-h1":
            for k, (st, (costs, intra, _kept)) in enumerate(zip(priced, per_stage)):
                task = table.task_overhead_s(st.submesh)
                # The recomputed forward of a remat stage and the task overhead stay with B; W is a task of its own.
                core = st.bwd_s - task - recompute_s(st, stage_sums[k], microbatches, task)
                w = core * weight_grad_fraction(table, intra, costs, st.layers[0], st.layers[1])
                wgrad[k] = w + task
                totals[k] = (st.fwd_s, st.bwd_s + task, st.static_bytes, st.act_bytes)
        sim = dict(fwd=[t[0] for t in totals], bwd=[t[1] - w for t, w in zip(totals, wgrad)],
                   act=[t[3] for t in totals], static=[t[2] for t in totals])
        sends = stage_transfers(table, priced, microbatches)
    if skip_above < math.inf:
        floor = makespan_floor(sim["fwd"], sim["bwd"], microbatches, schedule, send_fwd_s=sends, send_bwd_s=sends,
                               wgrad_s=wgrad if schedule == "zb-h1" else None, virtual_stages=v if v > 1 else None)
        if floor > skip_above:
            raise StepAbove(floor)
    # Stages that share a compute resource run one task at a time (backends: a CPU host's stages; None elsewhere).
    hosts = host_of_stages(cluster, stage_offsets(priced))
    tl = simulate_pipeline(sim["fwd"], sim["bwd"], microbatches, schedule, sends, mem,
                           wgrad_s=wgrad if schedule == "zb-h1" else None, virtual_stages=v,
                           options=SimOptions(hosts=hosts, microbatch_group=group).with_memory(sim["act"],
                                                                                                sim["static"]))
    busiest = max(range(len(priced)), key=lambda i: tl.busy_s[i])
    plan_stages = []
    for k, (st, off, peak, (costs, intra, kept)) in enumerate(zip(priced, stage_offsets(priced), tl.peak_mem_bytes,
                                                            per_stage)):
        part = [c for a, b in chunks[k] for c in costs[a:b + 1]]
        fwd, bwd, static, act = totals[k]
        plan_stages.append(Stage(st.layers, st.submesh, st.logical_mesh,
                                 tuple(range(off, off + st.submesh[0] * st.submesh[1])), st.remat, fwd, bwd,
                                 sum(c.compute_s for c in part), sum(c.comm_s for c in part),
                                 sum(c.reshard_s for c in part), static, act, peak, intra, tuple(kept),
                                 chunks=tuple(chunks[k]) if v > 1 else (), wgrad_s=wgrad[k], solution=chosen[k]))
    b = plan_stages[busiest]
    busy = tl.busy_s[busiest]
    host_s = 0.0
    if per_kernel:
        # What the host adds to the busiest stage's busy time: each of its chunks' microbatch stretched to its
        # kernels' host time, less the same chunk priced on the GPU's time alone.
        st = priced[busiest]
        for first, last in chunks[busiest]:
            gpu = table.stage_from_sums(stage_sums[busiest], first, last, st.submesh, st.logical_mesh, microbatches,
                                        st.remat, st.payload)
            both = hosted(gpu, stage_sums[busiest], (first, last), per_kernel)
            host_s += microbatches * (both.fwd_s + both.bwd_s - gpu.fwd_s - gpu.bwd_s)
    # Communication hidden behind compute is not in the busy time: only what shows is split.
    hid_sync, hid_gather, kernels, colls, latency, tasks_s, rereads_s = hidden[busiest]
    # The stage's comm_s counts each per-microbatch collective's latency once a step; its busy time pays it every
    # microbatch (and once more per recomputed forward): what is left of the step's latency shows as collectives.
    once = sum(c.latency_fwd_s + c.latency_bwd_s for c in (c for a, z in chunks[busiest]
                                                           for c in per_stage[busiest][0][a:z + 1]))
    comm = max(b.comm_s - hid_sync, 0.0) + max(latency - once, 0.0)
    reshard = max(b.reshard_s - hid_gather, 0.0)
    work = b.compute_s + comm + reshard
    # The busiest stage's busy time less its host wait, split in proportion to its terms (launch overheads and
    # recomputation included).
    scale = (busy - host_s) / work if work > 0 else 0.0
    acc = max(held, key=lambda k: held[k][0] - held[k][1], default=0)  # where holding them adds most
    lost = max(range(len(loss_extra)), key=lambda k: loss_extra[k])
    cost = CostReport(
        step_time_s=tl.makespan,
        compute_s=b.compute_s * scale,
        comm_s=comm * scale,
        reshard_s=reshard * scale,
        stage_comm_s=sum(sends) + sum(sends),
        bubble_s=tl.makespan - busy,
        host_s=host_s,
        host_launch_s=per_kernel,
        peak_mem_bytes=tuple(tl.peak_mem_bytes),
        mem_limit_bytes=mem,
        samples_per_s=table.batch_size / tl.makespan if tl.makespan > 0 else math.inf,
        busiest_stage=busiest,
        timeline=tl,
        hidden_comm_s=float(hid_sync + hid_gather),
        kernels=kernels,
        collectives=colls,
        collective_latency_s=float(latency),
        flash_attention=cluster.device.efficiency.flash_attention,
        cpu=cpu_cost(cluster, shared_host=hosts is not None and len(priced) > 1, task_s=float(tasks_s),
                     rereads_s=float(rereads_s)),
        precision=precision_note(table.solve_graph),
        accumulate_stage=acc,
        unsharded_grad_bytes=held.get(acc, (0.0, 0.0))[0],
        grad_shard_bytes=held.get(acc, (0.0, 0.0))[1],
        eager_loss_bytes=float(eager_loss or 0.0),
        loss_stage=lost if loss_extra[lost] else len(specs) - 1,
        loss_microbatches=microbatches,
        loss_extra_bytes=loss_extra[lost],
    )
    return Priced(tuple(plan_stages), cost, schedule, v)


def with_loss(cand: StageCandidate, costs: Sequence[Any], microbatches: int, loss_bytes: float | None,
              loss_layer: int) -> StageCandidate:
    """``cand`` (a stage or a chunk, priced from ``costs``) holding what an eager framework's loss adds at its
    backward where it computes the loss (:func:`~autopar_lab.pricing.eagerloss.loss_extra_bytes`), else itself."""
    if not loss_bytes:
        return cand
    extra = loss_extra_bytes(costs, cand.layers, microbatches, cand.remat, loss_bytes, loss_layer)
    return dataclasses.replace(cand, static_bytes=cand.static_bytes + extra) if extra else cand


def hosted(cand: StageCandidate, sums: Mapping[str, Sequence[float]], layers: tuple[int, int],
           per_kernel: float) -> StageCandidate:
    """``cand`` (layers ``layers`` priced from running sums ``sums``) as an eager host runs it: its forward and
    backward stretched until they last as long as the host takes to launch their kernels, ``per_kernel`` seconds
    each (:func:`~autopar_lab.pricing.stage.host_stretch`); ``cand`` itself where ``per_kernel`` is 0."""
    if not per_kernel:
        return cand
    first, last = layers
    span: dict[str, Any] = {f: run[last + 1] - run[first] for f, run in sums.items() if is_running_sum(f)}
    span["host_launch_s"] = per_kernel
    stretch = host_stretch(span, cand.fwd_s, cand.bwd_s, cand.remat)
    return dataclasses.replace(cand, fwd_s=cand.fwd_s * stretch, bwd_s=cand.bwd_s * stretch)


def table_of(plan: Any) -> CostTable:
    """The cost table that priced ``plan`` (what re-pricing an override needs); a ValueError when it has none."""
    if plan.table is None:
        raise ValueError("this plan has no cost table to re-price it with; build it with autopar_lab.planner "
                         "(auto_plan, megatron_plan, data_parallel_plan) or load it with load_plan")
    return plan.table
