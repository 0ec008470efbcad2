"""Megatron-LM's layout (Shoeybi et al. 2019; Narayanan et al., SC21; Korthikanti et al., MLSys 2023), priced.

``pp`` stages of equal runs of transformer blocks (the embedding with the first, the head with the last), each on
``dp x tp x cp`` devices with the tensor-parallel group inside a scale-up domain, and Megatron-LM's sharding pinned on
every transformer the graph holds (:mod:`~autopar_lab.layouts.roles`, :mod:`~autopar_lab.layouts.shardpins`):
column- then row-parallel matmuls (one all-reduce per pair, forward and backward), attention by heads (GQA's KV heads
no finer than their count: with more tensor-parallel ranks than KV heads, K and V stay whole, as Megatron-LM
replicates them), the embedding and the head split by vocabulary; sequence parallelism (``sequence_parallel``),
context parallelism (``cp``) and expert parallelism (``ep``) as :mod:`~autopar_lab.layouts.config` maps them onto the
2-D mesh; the distributed optimizer (``zero=1``, or any ZeRO stage); the interleaved schedule with virtual stages;
recomputation (``remat``: ``True`` Megatron-LM's full ``--recompute-granularity full``, ``"selective"`` its
``selective``); the microbatch size (``micro_batch_size``, Megatron-LM's ``--micro-batch-size``: the global batch is
``dp x micro_batch_size x microbatches``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .. import checks
from ..plan import Plan
from ..planning import microbatch_choices, table_for
from ..precision import Precision
from ..rematmode import is_full, is_selective, remat_value
from ..schedules import FlexibleGroup, check_group, check_schedule
from ..solve.ilp import DEFAULT_SOLVER
from .config import MeshRoles, Parallelism, check_zero
from .engine import (Layout, check_experts, cluster_running, eager_host, microbatch_counts, price_fastest,
                     stage_submesh)

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..pricing import CostTable

__all__ = ["SHARDINGS", "megatron_mesh", "megatron_plan"]

#: ``sharding=``: Megatron-LM's pinned, or the ILP's on Megatron-LM's layout.
SHARDINGS = ("megatron", "ilp")

# overlap name (pricing.overlap) -> megatron_plan's keyword, and the plan name's tag when it is on
_FLAGS = {"grad_reduce": "overlap_grad_reduce", "param_gather": "overlap_param_gather", "tp_comm": "tp_comm_overlap",
          "moe_comm": "overlap_moe_comm"}
_TAGS = {"grad_reduce": "ogr", "param_gather": "opg", "tp_comm": "tpo", "moe_comm": "omc"}


def megatron_mesh(par: Parallelism) -> MeshRoles:
    """The logical mesh of a Megatron-LM stage and its axes' roles (see :mod:`~autopar_lab.layouts.config`).

    >>> megatron_mesh(Parallelism(dp=32, tp=4)).shape, megatron_mesh(Parallelism(dp=4, cp=2)).context
    ((32, 4), 1)
    """
    notes: tuple[str, ...] = ()
    if par.cp == 1:
        roles = MeshRoles((par.dp, par.tp), batch=(0,), tensor=1, zero=(0,))
    elif par.tp == 1:
        roles = MeshRoles((par.dp, par.cp), batch=(0,), context=1, zero=(0, 1))
    else:
        notes = (f"context parallelism cp={par.cp} folded into the data-parallel axis ({par.dp} x {par.cp} = "
                 f"{par.dp * par.cp}, beside tp={par.tp} on the 2-D mesh): the same tokens per device and the same "
                 "gradient and ZeRO group as Megatron-LM's, attention priced without the ring's key/value exchange",)
        roles = MeshRoles((par.dp * par.cp, par.tp), batch=(0,), tensor=1, zero=(0,), notes=notes)
    n0, n1 = roles.shape
    if par.ep == 1:
        experts: tuple[int, ...] = ()
    elif par.ep == n0:
        experts = (0,)
    elif par.ep == n1 and roles.tensor != 1:
        experts = (1,)
    elif par.ep == n0 * n1:
        experts = (0, 1)
    else:
        raise ValueError(f"ep={par.ep} does not fit the 2-D mesh ({n0}, {n1}) of this layout: pass ep=1, "
                         f"ep={n0} (the data-parallel group{' x cp' if par.cp > 1 and par.tp > 1 else ''}) or "
                         f"ep={n0 * n1} (the whole stage)")
    return roles.with_(experts=experts)


def group_counts(group: int, stages: int, counts: list[int]) -> list[int]:
    """The microbatch counts of ``counts`` that the interleaved schedule can run in groups of ``group`` over
    ``stages`` stages (:func:`~autopar_lab.schedules.check_group`); the first count's ValueError when none can.

    >>> group_counts(8, 4, [4, 8, 16])
    [8, 16]
    """
    ok = []
    for mb in counts:
        try:
            check_group(group, stages, mb)
        except ValueError:
            continue
        ok.append(mb)
    if not ok:
        check_group(group, stages, counts[0])
    return ok


def megatron_plan(model=None, cluster: Cluster | None = None, *, dp: int, tp: int, pp: int,
                  microbatches: int | str | None = None, schedule: str = "1f1b", remat: bool | str = False,
                  mem_limit_bytes: float | None = None, solver: str = DEFAULT_SOLVER, table: CostTable | None = None,
                  virtual_stages: int | None = None, precision: str | Precision | None = None,
                  zero: int | None = None, sequence_parallel: bool = False, cp: int = 1, ep: int = 1,
                  micro_batch_size: int | None = None, sharding: str = "megatron", lean: bool = True,
                  overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                  tp_comm_overlap: bool = False, overlap_moe_comm: bool = False,
                  library_kernels: bool | None = None, cuda_graphs: bool = False,
                  microbatch_group: int | None = None, skip_above: float = math.inf) -> Plan:
    """Megatron-LM's layout: ``pp`` stages of equal runs of transformer blocks, each on ``dp x tp x cp`` devices
    viewed as a (dp, tp) logical mesh with the tensor-parallel axis inside a scale-up domain (a host, or the hosts
    of one NVLink fabric); Megatron-LM's sharding pinned on the operators the graph's transformer blocks hold and
    the intra-op ILP choosing the rest (``sharding="megatron"``, see the module docstring), or each operator's
    sharding on that layout left to the ILP (``sharding="ilp"``: the best the cost model finds on Megatron-LM's
    stages and meshes, what this planner priced before issue 31).

    ``remat``: every stage recomputes its forward in the backward (True: Megatron-LM's ``--checkpoint-activations``)
    or only its attention internals (``"selective"``: ``--recompute-activations``).

    ``schedule``: "1f1b", "gpipe", "interleaved" (``virtual_stages`` model chunks per stage, default 2: Megatron-LM's
    ``--num-layers-per-virtual-pipeline-stage``) or "zb-h1". ``microbatch_group`` (interleaved only): the
    microbatches each model chunk runs in a row, Megatron-LM's ``--microbatch-group-size-per-virtual-pipeline-stage``
    and Llama 3's tunable ``N``; None is Megatron-LM's default, ``pp``, the fewest microbatches in flight (each
    stage's warm-up is ``2(pp - 1 - rank) + (v - 1)N`` chunk forwards, :func:`~autopar_lab.schedules.warmup_chunks`);
    Megatron-LM asks ``pp <= N <= microbatches`` with a last group of 0 or at least ``pp`` microbatches; Llama 3's
    schedule (``microbatch_group=FlexibleGroup(N)``, :class:`~autopar_lab.schedules.FlexibleGroup`) also runs one
    group of fewer microbatches than stages, which Megatron-LM cannot (its export refuses it).
    ``zero``: the ZeRO stage (1: the distributed optimizer; None: the storage of weights and optimizer state left to
    the planner, stored at its least in any stage that overflows, which explain() then says; ``lean=False`` keeps the
    ILP's storage there, to see what the layout would need). ``table``, ``precision``, ``solver``: as for
    :func:`~autopar_lab.planner.auto_plan`. ``microbatches``: the count (default 1), or ``"auto"``: the layout
    priced at each micro-batch size of :data:`~autopar_lab.layouts.engine.MICRO_BATCH_SIZES` that splits the batch,
    the fastest that fits kept (its notes say which; with ``microbatch_group``, the counts that group can run);
    ``micro_batch_size``: Megatron-LM's ``--micro-batch-size`` instead (the count is the batch over dp x it).
    ``skip_above``: a step time to beat; a layout whose step provably cannot beat it (its lower bound
    is above) raises :class:`~autopar_lab.pricing.price.StepAbove` unsimulated (how the frameworks' grids search).

    Communication overlapped with compute, Megatron-Core's switches and defaults (all off;
    :mod:`~autopar_lab.pricing.overlap` prices each): ``overlap_grad_reduce`` (``--overlap-grad-reduce``: the
    gradient reduction in per-layer buckets behind the last microbatch's backward, hidden up to that backward's
    compute less one layer's; off, it follows the backward in full), ``overlap_param_gather``
    (``--overlap-param-gather``, with the distributed optimizer and ``overlap_grad_reduce``: the updated weights'
    all-gather behind the next step's first forward, up to its compute less one layer's; off, it follows the update),
    ``tp_comm_overlap`` (``--tp-comm-overlap``, with ``sequence_parallel``: each layer's tensor-parallel all-gathers
    and reduce-scatters, the backward's re-gather of the stored sequence shard included, hidden behind that layer's
    matmuls of the same pass, ``min(collectives, matmuls)``; off, on the critical path), ``overlap_moe_comm``
    (``--overlap-moe-expert-parallel-comm``, with ``ep`` > 1; DeepSeek-V3's DualPipe: each MoE layer's
    expert-parallel all-to-alls behind the other microbatch's compute of the other pass, ``min(all-to-alls,
    compute)`` per pass; off, on the critical path).

    ``library_kernels``: True prices the activations Megatron-LM's fused kernels keep (Transformer Engine, fused
    bias-GeLU / SwiGLU and norms: each kernel keeps its inputs and recomputes what it computes inside; a GPT layer
    keeps Korthikanti et al.'s 34 bytes a token and hidden unit less the dropout masks), False what JAX's autodiff
    keeps, None the cluster's (``table``'s) own :class:`~autopar_lab.cluster.Efficiency` setting (False on every
    preset: a plan the library runs keeps what autodiff keeps).

    With ``library_kernels`` (Megatron-LM's own stack priced, not the library's XLA programs) on a GPU, Megatron's
    eager host is priced too: it launches every kernel from Python through Transformer Engine's modules, so a
    stage's microbatch lasts at least its kernels times the fitted host time per kernel
    (:mod:`autopar_lab.backends.eager`; explain()'s host term). ``cuda_graphs``: True (``--cuda-graph-impl local``
    or ``transformer_engine``; the deprecated ``--enable-cuda-graph`` / ``--external-cuda-graph``: the step's kernels
    replayed from graphs) prices the GPU's time alone and is named in the plan's name (``graphs``, which the export
    writes back); without ``library_kernels`` the plan is the layout as this library runs it (XLA executables: no
    host term either way). Megatron-LM refuses CUDA graphs with full recomputation, and so does this."""
    par = Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    remat = remat_value(remat)
    zero = check_zero(zero)
    sequence_parallel = checks.flag(sequence_parallel, "sequence_parallel")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(map(repr, SHARDINGS))}, got {sharding!r:.40}")
    schedule, virtual_stages = check_schedule(schedule, virtual_stages)
    if microbatch_group is not None and schedule != "interleaved":
        raise ValueError(f"microbatch_group applies to the interleaved schedule only (Megatron-LM's "
                         f"--microbatch-group-size-per-virtual-pipeline-stage); pass schedule='interleaved' or leave "
                         f"microbatch_group out for {schedule!r}")
    overlap = tuple(name for name, on in (("grad_reduce", overlap_grad_reduce), ("param_gather", overlap_param_gather),
                                          ("tp_comm", tp_comm_overlap), ("moe_comm", overlap_moe_comm))
                    if checks.flag(on, f"{_FLAGS[name]}"))
    if overlap_param_gather and not (zero is not None and zero >= 1 and overlap_grad_reduce):
        raise ValueError("overlap_param_gather overlaps the distributed optimizer's gather of the updated weights: "
                         "pass zero=1 (or 2, 3) and overlap_grad_reduce=True with it, as Megatron-LM requires")
    if tp_comm_overlap and not sequence_parallel:
        raise ValueError("tp_comm_overlap overlaps the sequence-parallel all-gathers and reduce-scatters with the "
                         "matmuls; pass sequence_parallel=True with it, as Megatron-LM requires")
    if overlap_moe_comm and ep == 1:
        raise ValueError("overlap_moe_comm overlaps the expert-parallel all-to-alls with the other microbatch's "
                         "compute; pass ep of 2 or more with it, as Megatron-LM requires")
    cuda_graphs = checks.flag(cuda_graphs, "cuda_graphs")
    if cuda_graphs and is_full(remat):
        raise ValueError("cuda_graphs with full recomputation (remat=True): Megatron-LM refuses CUDA graphs with "
                         "--recompute-granularity full; pass remat='selective' or False, or cuda_graphs=False")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel splits the regions between tensor-parallel matmuls over the tensor "
                         "group; it needs tp of 2 or more")
    library_kernels = None if library_kernels is None else checks.flag(library_kernels, "library_kernels")
    cluster = cluster_running(cluster, table, "library_kernels", library_kernels,
                              f"library_kernels={library_kernels}")
    table, cluster, trace_s = table_for(model, cluster, table, solver, precision=precision)
    n = cluster.num_devices
    if par.devices != n:
        raise ValueError(f"dp x tp x pp{' x cp' if cp > 1 else ''} = {par.devices}, but the cluster has {n} devices")
    if tp > cluster.devices_per_domain:
        raise ValueError(f"tp={tp} exceeds the {cluster.devices_per_domain} devices of a scale-up domain (Megatron "
                         "keeps tensor parallelism inside a host, or inside the hosts sharing one NVLink fabric); use "
                         "a smaller tp")
    L = len(table.layer_names)
    if pp > L:
        raise ValueError(f"pp={pp} stages but the model has only {L} layers")
    check_experts(table, ep)
    counts = microbatch_counts(table.batch_size, dp, microbatches, micro_batch_size)
    for mb in counts:
        microbatch_choices(table.batch_size, mb)
    if microbatch_group is not None:
        counts = group_counts(microbatch_group, pp, counts)
    tag = ",remat" if is_full(remat) else ",selective" if is_selective(remat) else ""
    extra = "".join(f",{k}={v}" for k, v in (("cp", cp), ("ep", ep)) if v > 1)
    extra += (",sp" if sequence_parallel else "") + (f",zero={zero}" if zero is not None else "")
    extra += ",ilp" if sharding == "ilp" else ""
    extra += "".join(f",{_TAGS[o]}" for o in overlap) + (",graphs" if cuda_graphs else "")
    name = f"megatron(dp={dp},tp={tp},pp={pp}{tag}{extra})"
    if schedule == "interleaved":
        flex = ",flexible" if isinstance(microbatch_group, FlexibleGroup) else ""
        group = "" if microbatch_group is None else f",group={microbatch_group}{flex}"
        name = f"{name[:-1]},v={virtual_stages}{group})"
    mesh = megatron_mesh(par)
    layout = Layout(name, pp, stage_submesh(cluster, par.stage_devices), mesh, counts[0], remat, schedule,
                    virtual_stages, zero, sequence_parallel, mesh.notes, pin_roles=sharding == "megatron",
                    lean=checks.flag(lean, "lean"), overlap=overlap,
                    host=eager_host(cluster, "eager-te", cluster.device.efficiency.library_kernels
                                    and not cuda_graphs), microbatch_group=microbatch_group)
    return price_fastest(table, [layout.with_(microbatches=mb) for mb in counts], dp,
                         mem_limit_bytes=mem_limit_bytes, solver=solver,
                         solve_s={} if trace_s is None else {"trace": trace_s}, skip_above=skip_above)
