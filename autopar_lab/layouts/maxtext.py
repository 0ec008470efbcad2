"""MaxText's layout (AI-Hypercomputer/maxtext, ``configs/base.yml``'s ``ici_*`` / ``dcn_*`` parallelism), priced on
TPU slices.

MaxText names a device mesh by its axes inside a slice (``ici_*_parallelism``, over the chips' ICI torus) and across
slices (``dcn_*_parallelism``, over the data-center network): data, FSDP, sequence, tensor, expert and pipeline. One
axis of each set may be -1 (the chips or slices the others leave; ``ici_fsdp`` and ``dcn_data`` are, by default). Its
sharding rules split the weights' ``embed`` dimension over FSDP (every weight, gradient and optimizer state stored
split: ZeRO-3) and the ``mlp``, ``heads`` and ``vocab`` dimensions over tensor (Megatron-LM's column and row
matmuls), the batch over data and FSDP, activations' length over sequence, experts over expert.

On a slice (a host of the TPU presets, :mod:`autopar_lab.cluster.torus`), each pipeline stage's chips are viewed as
the 2-D logical mesh of :mod:`~autopar_lab.layouts.config`: with tensor parallelism, ``(data x fsdp x sequence x
expert, tensor)`` (sequence folded into the data-parallel axis as Megatron-LM's ``cp`` is; data and FSDP sharing an
axis, the state is split over data too: said in the plan's notes); without, ``(data, fsdp)`` (the state split over
FSDP only) or ``(data x fsdp, sequence)`` (ring attention over sequence). With tensor parallelism the activations
between the blocks stay split over the tensor axis (base.yml's logical axis rule ``['activation_embed', 'tensor']``):
each block's output is reduce-scattered, its input all-gathered, as Megatron-LM's sequence parallelism does (split
on the embedding rather than the sequence dimension: the same bytes held and moved), and priced as that.

``remat``: MaxText's ``remat_policy`` ``"full"``, ``"minimal"`` or ``"none"``, or any ``remat=`` value of the other
planners. ``"minimal"`` is priced as ``"dots"`` (:mod:`autopar_lab.rematmode`: every matmul's output kept, the rest
recomputed). MaxText's ``minimal`` saves the outputs of the matmuls against weights (``layers/decoders.py``:
``jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims``; later ``save_only_these_names`` of the q, k, v,
out and MLP projections) and not attention's batched matmuls; with its flash kernel (below) the scores are never
written, so the one difference left is attention's output (``context``), which ``minimal`` recomputes and
``"dots"`` keeps (MaxText's ``minimal_with_context``): one activation of the embedding's size per layer held, one
flash forward per layer saved.

``attention``: MaxText's ``attention`` key. ``"autoselected"`` (base.yml's default) and ``"flash"`` run its fused
kernel (Pallas splash attention on TPU; ``"autoselected"`` picks it for training at 128 tokens and more, and is
priced as it at every length), as does ``"cudnn_flash_te"`` (a GPU's), priced with the cluster's ``flash_attention``
on; ``"dot_product"`` runs attention as matmuls and a softmax through memory. The v5p configurations of the
reference's rows (``configs/v5p/32b.sh``, ``128b.sh``) pass ``attention='flash'``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .. import checks
from ..plan import Plan
from ..planning import microbatch_choices, table_for
from ..precision import Precision
from ..rematmode import DOTS, remat_label, remat_value
from ..schedules import check_schedule
from ..solve.ilp import DEFAULT_SOLVER
from .config import MeshRoles, check_zero
from .engine import Layout, check_experts, cluster_running, price_layout, stage_submesh

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..pricing import CostTable

__all__ = ["ATTENTION_KERNELS", "AXES", "attention_cluster", "maxtext_mesh", "maxtext_plan", "resolve_axes"]

#: MaxText's parallelism axes, in the order its mesh lists them (pipeline first: each stage is a sub-mesh).
AXES = ("pipeline", "data", "fsdp", "sequence", "expert", "tensor")
#: MaxText's ``remat_policy`` names and the recomputation they are priced as.
REMAT_POLICIES = {"full": True, "minimal": DOTS, "none": False}
#: MaxText's ``attention`` kernels and whether each runs fused (flash attention).
ATTENTION_KERNELS = {"autoselected": True, "flash": True, "cudnn_flash_te": True, "dot_product": False}


def resolve_axes(given: dict[str, int], total: int, where: str) -> dict[str, int]:
    """``given`` (axis -> degree, at most one -1) with the -1 filled so that the degrees multiply to ``total``.

    >>> resolve_axes({"fsdp": -1, "tensor": 4, "data": 1}, 128, "ici")["fsdp"]
    32
    """
    free = [k for k, v in given.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"at most one {where}_* axis may be -1, got {', '.join(f'{where}_{k}' for k in free)}")
    for k, v in given.items():
        if v != -1:
            checks.whole(v, f"{where}_{k}")
    known = math.prod(v for v in given.values() if v != -1)
    out = dict(given)
    if free:
        if total % known:
            raise ValueError(f"the {where}_* degrees ({known}) do not divide the {total} "
                             f"{'chips of a slice' if where == 'ici' else 'slices'}; change them")
        out[free[0]] = total // known
    elif known != total:
        raise ValueError(f"the {where}_* degrees multiply to {known}, but there are {total} "
                         f"{'chips in a slice' if where == 'ici' else 'slices'}; make one of them -1")
    return out


def attention_cluster(attention: str, cluster, table):
    """The cluster to build the cost table on for MaxText's ``attention`` kernel: ``cluster`` (a Cluster or its
    name, ``"tpu-v5p:128"``) with ``flash_attention`` set as the kernel runs; with a ``table`` instead, ``cluster``
    as given once the table's attention agrees (``"autoselected"`` takes the table's own).

    >>> attention_cluster("flash", "tpu-v5p:8", None).device.efficiency.flash_attention
    True
    """
    if not isinstance(attention, str) or attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of MaxText's kernels {', '.join(map(repr, ATTENTION_KERNELS))}, "
                         f"got {attention!r:.40}")
    fused = ATTENTION_KERNELS[attention]
    keep = attention == "autoselected" and table is not None  # a table given: its own attention
    return cluster_running(cluster, table, "flash_attention", None if keep else fused, f"attention={attention!r}")


def maxtext_mesh(data: int, fsdp: int, sequence: int, expert: int, tensor: int) -> MeshRoles:
    """A stage's logical mesh and its axes' roles for MaxText's degrees (see the module docstring).

    >>> maxtext_mesh(1, 32, 1, 1, 4).shape, maxtext_mesh(2, 16, 1, 1, 1).zero
    ((32, 4), (1,))

    (``zero``: the data-parallel group the layout's ZeRO stage splits the state over: FSDP's, 3 by default with
    FSDP, 0 without.)
    """
    notes: list[str] = []
    if tensor > 1:
        n0 = data * fsdp * sequence * expert
        if sequence > 1:
            notes.append(f"sequence parallelism {sequence} folded into the data-parallel axis beside tensor "
                         f"parallelism (2-D mesh): attention priced without the key/value exchange")
        if data > 1 and fsdp > 1:
            notes.append(f"data {data} and FSDP {fsdp} share one mesh axis: the state is split over both")
        experts: tuple[int, ...] = () if expert == 1 else (0,) if expert == n0 else ()
        if expert > 1 and expert != n0:
            notes.append(f"expert parallelism {expert} is not a whole mesh axis here: the experts' split is the ILP's")
            experts = None  # type: ignore[assignment]
        return MeshRoles((n0, tensor), batch=(0,), tensor=1, zero=(0,), experts=experts, notes=tuple(notes))
    if sequence > 1:
        n0 = data * fsdp * expert
        return MeshRoles((n0, sequence), batch=(0,), context=1, zero=(0, 1),
                         experts=() if expert == 1 else None)
    if data > 1 and fsdp > 1:
        return MeshRoles((data, fsdp), batch=(0, 1), zero=(1,), experts=() if expert == 1 else None)
    n0 = data * fsdp * expert
    return MeshRoles((n0, 1), batch=(0,), zero=(0,),
                     experts=() if expert == 1 else (0,) if expert == n0 else None)


def maxtext_plan(model=None, cluster: Cluster | None = None, *, ici_data: int = 1, ici_fsdp: int = -1,
                 ici_sequence: int = 1, ici_expert: int = 1, ici_tensor: int = 1, ici_pipeline: int = 1,
                 dcn_data: int = -1, dcn_fsdp: int = 1, dcn_pipeline: int = 1, microbatches: int | None = None,
                 per_device_batch_size: int | None = None, remat: bool | str = "full", zero: int | None = None,
                 schedule: str = "1f1b", virtual_stages: int | None = None, attention: str = "autoselected",
                 mem_limit_bytes: float | None = None, solver: str = DEFAULT_SOLVER, table: CostTable | None = None,
                 precision: str | Precision | None = None, skip_above: float = math.inf) -> Plan:
    """MaxText's layout (see the module docstring) on a cluster of TPU slices (``tpu-v5p:N``; a GPU cluster's hosts
    are taken as slices). ``per_device_batch_size``: MaxText's, checked against the model's batch (which must be
    it times the chips); ``microbatches``: gradient accumulation steps, or a pipeline's microbatches (default: 1,
    or the stage count when pipelined, MaxText's ``num_pipeline_microbatches``); ``zero``: the ZeRO stage to price
    instead of the layout's own (3 with FSDP, 0 without). ``attention``: MaxText's kernel (module docstring); a
    ``table`` given was built with its cluster's attention, which ``"autoselected"`` keeps and ``"flash"`` or
    ``"dot_product"`` must match. ``table``, ``precision``, ``solver``: as for
    :func:`~autopar_lab.planner.auto_plan`.
    ``skip_above``: a step time to beat; a layout whose step provably cannot beat it (its lower bound
    is above) raises :class:`~autopar_lab.pricing.price.StepAbove` unsimulated (how the frameworks' grids search)."""
    policy = REMAT_POLICIES.get(remat, remat) if isinstance(remat, str) else remat
    remat = remat_value(policy, "remat (MaxText's remat_policy: 'full', 'minimal' or 'none')")
    zero = check_zero(zero)
    schedule, virtual_stages = check_schedule(schedule, virtual_stages)
    cluster = attention_cluster(attention, cluster, table)
    table, cluster, trace_s = table_for(model, cluster, table, solver, precision=precision)
    ici = resolve_axes({"data": ici_data, "fsdp": ici_fsdp, "sequence": ici_sequence, "expert": ici_expert,
                        "tensor": ici_tensor, "pipeline": ici_pipeline}, cluster.devices_per_host, "ici")
    dcn = resolve_axes({"data": dcn_data, "fsdp": dcn_fsdp, "pipeline": dcn_pipeline}, cluster.hosts, "dcn")
    pp = ici["pipeline"] * dcn["pipeline"]
    if pp > len(table.layer_names):
        raise ValueError(f"{pp} pipeline stages but the model has only {len(table.layer_names)} layers")
    data, fsdp = ici["data"] * dcn["data"], ici["fsdp"] * dcn["fsdp"]
    check_experts(table, ici["expert"])
    chips = cluster.num_devices
    if per_device_batch_size is not None:
        pdbs = checks.whole(per_device_batch_size, "per_device_batch_size")
        if pdbs * chips != table.batch_size:
            raise ValueError(f"per_device_batch_size={pdbs} on {chips} chips is a global batch of {pdbs * chips}, but "
                             f"the model's batch is {table.batch_size}; build the model with batch_size="
                             f"{pdbs * chips}")
    mb = (1 if pp == 1 else pp) if microbatches is None else checks.whole(microbatches, "microbatches")
    microbatch_choices(table.batch_size, mb)
    mesh = maxtext_mesh(data, fsdp, ici["sequence"], ici["expert"], ici["tensor"])
    if zero is None:
        zero = 3 if fsdp > 1 else 0
    degrees = [(f"{where}_{k}", v) for where, axes in (("ici", ici), ("dcn", dcn)) for k, v in axes.items() if v > 1]
    name = "maxtext(" + ",".join(f"{k}={v}" for k, v in degrees) + f",remat={remat_label(remat)}"
    name += f",zero={zero})" if zero != (3 if fsdp > 1 else 0) else ")"
    layout = Layout(name, pp, stage_submesh(cluster, chips // pp), mesh, mb, remat, schedule, virtual_stages,
                    zero, ici["tensor"] > 1, mesh.notes)  # activation_embed split over tensor: module docstring
    return price_layout(table, layout, mem_limit_bytes=mem_limit_bytes, solver=solver,
                        solve_s={} if trace_s is None else {"trace": trace_s}, skip_above=skip_above)
