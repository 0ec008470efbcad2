"""torchtitan's layout (Liang et al., "TorchTitan", ICLR 2025; pytorch/torchtitan's ``parallelize_llama``), priced.

FSDP2 over the data-parallel shard group x tensor parallelism x pipeline parallelism x context parallelism:

* FSDP (``fully_shard``): every parameter, its gradient and optimizer state split over the ``dp_shard`` devices
  (ZeRO-3), each parameter all-gathered for its layer's forward and freed after it, gathered again for the backward
  (``reshard_after_forward=True``); or, as Llama 3's pre-training ran it, kept gathered from the forward to the
  backward (``reshard_after_forward=False``, ZeRO-2-like: the gradients and optimizer state stay split, priced as
  ZeRO stage 2); HSDP's replicate groups (``dp_replicate``) keep whole copies of the shards;
* tensor parallelism as Megatron-LM's (``ColwiseParallel`` for Q, K, V, w1, w3 and the output head,
  ``RowwiseParallel`` for wo, w2 and the vocabulary-split embedding), with ``SequenceParallel`` norms between them
  (torchtitan's default with TP: ``sequence_parallel`` on);
* context parallelism (ring attention) and pipeline stages of equal transformer blocks as in
  :mod:`~autopar_lab.layouts.megatron` (the 2-D mesh mapping of :mod:`~autopar_lab.layouts.config`);
* expert parallelism ``ep`` (torchtitan's ``expert_parallel_degree``, which borrows its devices from the FSDP group):
  the routed experts split over the ``dp_shard`` axis (``ep == dp_shard``, or ``dp_shard x cp`` with tensor
  parallelism) or over the whole stage, the tokens exchanged by all-to-all;
* activation checkpointing ``remat``: torchtitan's ``none``, ``selective`` (its op-level SAC,
  ``selective_ac_option = "op"``: keeps SDPA's output and every matmul's but every second one of a block, and
  recomputes the rest: priced as ``"selective-op"``, :mod:`autopar_lab.rematmode`; ``"selective-op"`` may be passed
  by name, and ``"dots"``, every matmul's output kept, as the nearest policy JAX has; Megatron-LM's selective
  recomputation, which recomputes only the attention core, would save nothing with flash attention) or ``full``;
  eager (``compile=False``), the op-level SAC also keeps each block's output projection's output (w2's), which it
  caches though no backward operator reads it (:func:`~autopar_lab.graph.attention.output_matmuls`);
* ``compile``: torchtitan's ``compile`` switch (``[training] compile``, later ``[compile] enable``; off by default
  there): False prices eager PyTorch (the cluster's ``kernel_fusion`` off: every elementwise operator, norm and cast
  a kernel of its own through memory, attention SDPA's flash kernel), True ``torch.compile``'s fused kernels (as
  XLA's, :mod:`autopar_lab.graph.fusion`); None (the default) keeps the cluster's own, fused on every preset.
* gradient accumulation: torchtitan reduce-scatters the gradients after every microbatch (the default);
  ``accumulate_unsharded=True`` skips that sync but on the last microbatch (FSDP2's
  ``set_requires_gradient_sync(False)``, KempnerForge's ``maybe_no_sync``), each device then holding every
  gradient unsharded over the FSDP group in float32 through the step's last microbatch
  (:mod:`autopar_lab.pricing.accumulate`).
* the loss: computed op by op after the model (``eager_loss``, torchtitan's float32 cross-entropy or
  KempnerForge's bf16 one), its logits-sized tensors at its backward priced (:mod:`autopar_lab.pricing.eagerloss`),
  beside the state FSDP2 holds then: its parameters sharded in float32 only under mixed precision
  (``MixedPrecisionPolicy`` casts them to bf16 into the all-gather's buffer), and, a step of one microbatch, no
  gradient yet (:func:`~autopar_lab.pricing.memory.absent_at_loss`);
* memory as an eager framework logs it: with ``compile=False`` the breakdown's ``reserved_bytes`` is the caching
  allocator's reserve at the peak (what torchtitan logs, ``max_memory_reserved``), fitted
  (:data:`~autopar_lab.backends.eager.ALLOCATOR_RESERVE`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .. import checks
from ..plan import Plan
from ..planning import microbatch_choices, table_for
from ..precision import Precision
from ..pricing.eagerloss import LOSSES, eager_loss_bytes, logits_elements
from ..rematmode import SELECTIVE_OP, is_selective, remat_label, remat_value
from ..schedules import check_schedule
from ..solve.ilp import DEFAULT_SOLVER
from .config import MeshRoles, Parallelism, check_zero
from .engine import (Layout, check_experts, cluster_running, eager_host, microbatch_counts, price_fastest,
                     stage_submesh)
from .megatron import megatron_mesh

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..pricing import CostTable

__all__ = ["fsdp_plan"]


def fsdp_plan(model=None, cluster: Cluster | None = None, *, dp_shard: int = -1, dp_replicate: int = 1, tp: int = 1,
              pp: int = 1, cp: int = 1, ep: int = 1, reshard_after_forward: bool = True, zero: int | None = None,
              microbatches: int | str | None = None, local_batch_size: int | None = None, schedule: str = "1f1b",
              virtual_stages: int | None = None, remat: bool | str = False, sequence_parallel: bool | None = None,
              mem_limit_bytes: float | None = None, solver: str = DEFAULT_SOLVER, table: CostTable | None = None,
              precision: str | Precision | None = None, skip_above: float = math.inf,
              compile: bool | None = None, accumulate_unsharded: bool = False,
              eager_loss: str | None = None) -> Plan:
    """torchtitan's layout (see the module docstring). ``dp_shard``: the FSDP group (-1: every device the other
    degrees leave, torchtitan's default); ``zero``: the ZeRO stage to price instead of FSDP's (3, or 2 with
    ``reshard_after_forward=False``); ``microbatches`` (a count, or ``"auto"``: the fastest that fits
    of each micro-batch size of :data:`~autopar_lab.layouts.engine.MICRO_BATCH_SIZES`) or ``local_batch_size``
    (sequences per data-parallel rank per microbatch; the global batch is ``dp_replicate x dp_shard x
    local_batch_size x microbatches``); ``schedule``,
    ``virtual_stages``: the pipeline schedule (torchtitan's ``1F1B``, ``Interleaved1F1B``, ``ZBVZeroBubble`` as
    "1f1b", "interleaved", "zb-h1"); ``ep``: the expert-parallel degree (module docstring);
    ``sequence_parallel``: None for torchtitan's default (on with ``tp`` > 1). ``compile``: torchtitan's switch
    (module docstring; a ``table`` given was built with its cluster's kernels, which ``compile`` must match); eager
    (``compile=False``, or a cluster without ``kernel_fusion``) also prices the host that launches every kernel from
    Python (:mod:`autopar_lab.backends.eager`; explain()'s host term).
    ``accumulate_unsharded``: the gradients of every microbatch but the last kept unsharded, in float32, without a
    reduce-scatter between microbatches (FSDP2's ``set_requires_gradient_sync(False)``, as KempnerForge accumulates;
    torchtitan, the default False, reduce-scatters every microbatch): their memory priced by
    :mod:`autopar_lab.pricing.accumulate` where there are several microbatches.
    ``eager_loss``: the loss as a PyTorch framework computes it after the model, op by op ("torchtitan": float32
    cross-entropy, vocabulary-parallel under tensor parallelism; "kempnerforge": bf16 cross-entropy on logits
    gathered whole, held through the backward): its working set at the loss's backward priced
    (:mod:`autopar_lab.pricing.eagerloss`); None (the default): the traced step's own loss.
    ``table``, ``precision``, ``solver``: as for :func:`~autopar_lab.planner.auto_plan`.
    ``skip_above``: a step time to beat; a layout whose step provably cannot beat it (its lower bound
    is above) raises :class:`~autopar_lab.pricing.price.StepAbove` unsimulated (how the frameworks' grids search)."""
    remat = remat_value(remat)
    if is_selective(remat):
        remat = SELECTIVE_OP  # torchtitan's selective is its op-level SAC (module docstring)
    reshard_after_forward = checks.flag(reshard_after_forward, "reshard_after_forward")
    if eager_loss is not None and eager_loss not in LOSSES:
        raise ValueError(f"eager_loss must be None or one of {', '.join(map(repr, LOSSES))}, got {eager_loss!r:.60}")
    accumulate = "unsharded" if checks.flag(accumulate_unsharded, "accumulate_unsharded") else None
    zero = check_zero(zero)
    if zero is None:
        zero = 3 if reshard_after_forward else 2
    schedule, virtual_stages = check_schedule(schedule, virtual_stages)
    fused = None if compile is None else checks.flag(compile, "compile")
    cluster = cluster_running(cluster, table, "kernel_fusion", fused, f"compile={compile}")
    table, cluster, trace_s = table_for(model, cluster, table, solver, precision=precision)
    n = cluster.num_devices
    for k, v in (("dp_replicate", dp_replicate), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        checks.whole(v, k)
    rest = dp_replicate * tp * pp * cp
    if dp_shard == -1:
        if n % rest:
            raise ValueError(f"dp_replicate x tp x pp x cp = {rest} does not divide the cluster's {n} devices; "
                             "change the degrees")
        dp_shard = n // rest
    dp_shard = checks.whole(dp_shard, "dp_shard (or -1 for the devices the other degrees leave)")
    if dp_shard * rest != n:
        raise ValueError(f"dp_replicate x dp_shard x tp x pp x cp = {dp_shard * rest}, but the cluster has {n} "
                         "devices; pass dp_shard=-1 to take the rest")
    if tp > cluster.devices_per_domain:
        raise ValueError(f"tp={tp} exceeds the {cluster.devices_per_domain} devices of a scale-up domain; use a "
                         "smaller tp")
    if dp_replicate > 1 and (tp > 1 or cp > 1):
        raise ValueError("HSDP (dp_replicate > 1) with tensor or context parallelism needs a third mesh axis the "
                         "2-D logical mesh does not have; use dp_replicate=1, or tp=1 and cp=1")
    if pp > len(table.layer_names):
        raise ValueError(f"pp={pp} stages but the model has only {len(table.layer_names)} layers")
    sp = tp > 1 if sequence_parallel is None else checks.flag(sequence_parallel, "sequence_parallel")
    if sp and tp == 1:
        raise ValueError("sequence_parallel splits the norms between tensor-parallel matmuls; it needs tp > 1")
    dp = dp_replicate * dp_shard
    loss_bytes = None
    if eager_loss is not None:
        g = table.solve_graph
        loss_bytes = eager_loss_bytes(eager_loss, logits_elements(g, list(g.layers)[-1]), dp * cp, tp)
    counts = microbatch_counts(table.batch_size, dp, microbatches, local_batch_size)
    for mb in counts:
        microbatch_choices(table.batch_size, mb)
    check_experts(table, ep)
    if dp_replicate > 1:
        mesh = MeshRoles((dp_replicate, dp_shard), batch=(0, 1), zero=(1,), experts=_hsdp_experts(ep, dp_replicate,
                                                                                                   dp_shard))
    else:
        mesh = megatron_mesh(Parallelism(dp=dp_shard, tp=tp, pp=pp, cp=cp, ep=ep))
    degrees = [("dp_replicate", dp_replicate), ("dp_shard", dp_shard), ("tp", tp), ("pp", pp), ("cp", cp),
               ("ep", ep)]
    name = "fsdp(" + ",".join(f"{k}={v}" for k, v in degrees if v > 1 or k == "dp_shard")
    name += ("" if zero == 3 else ",no-reshard" if zero == 2 and not reshard_after_forward else f",zero={zero}")
    name += ("" if remat is False else f",{remat_label(remat)}") + (",sp" if sp else "")
    name += ",no-sync" if accumulate else ""
    name += f",{eager_loss}-loss" if eager_loss else ""
    name += f",v={virtual_stages})" if schedule == "interleaved" else ")"
    layout = Layout(name, pp, stage_submesh(cluster, dp * tp * cp), mesh, counts[0], remat, schedule,
                    virtual_stages, zero, sp, mesh.notes,
                    host=eager_host(cluster, "eager", not cluster.device.efficiency.kernel_fusion),
                    accumulate=accumulate, eager_loss=loss_bytes)
    return price_fastest(table, [layout.with_(microbatches=mb) for mb in counts], dp,
                         mem_limit_bytes=mem_limit_bytes, solver=solver,
                         solve_s={} if trace_s is None else {"trace": trace_s}, skip_above=skip_above)


def _hsdp_experts(ep: int, replicate: int, shard: int) -> tuple[int, ...]:
    """The axes of HSDP's (replicate, shard) mesh the experts split over: torchtitan takes the expert-parallel group
    from the shard group, or from both."""
    if ep == 1:
        return ()
    if ep == shard:
        return (1,)
    if ep == replicate * shard:
        return (0, 1)
    raise ValueError(f"ep={ep} does not fit HSDP's ({replicate}, {shard}) mesh: pass ep=1, ep={shard} (the shard "
                     f"group) or ep={replicate * shard} (the whole stage)")
