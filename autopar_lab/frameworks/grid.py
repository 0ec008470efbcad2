"""The best plan a framework can run: each layout of the framework's grid (below) priced through its layout
function, the fastest that fits kept (``al.auto_plan(..., expressible_in=...)`` puts it beside the unconstrained
auto plan).

The grids (``n`` devices, ``M`` a host, ``D`` a scale-up domain, ``L`` transformer blocks, ``B`` the global batch;
"powers" are powers of two):

* Megatron-LM: tensor ``tp`` (powers up to ``D``) x context ``cp`` (below) x pipeline ``pp`` (powers dividing
  ``L``; stages of whole hosts or part of one) x data ``dp`` (the rest) x ZeRO 0 or 1 (the distributed optimizer) x
  recomputation (none, selective, full) x ``--micro-batch-size`` (powers up to 8 dividing ``B / dp``) x schedule
  (1F1B; interleaved with 2 chunks a stage where ``2 pp`` divides ``L``); sequence parallelism on with ``tp`` > 1
  (it only saves memory), and Megatron-Core's overlap switches on where they apply (``--overlap-grad-reduce``;
  ``--overlap-param-gather`` with the distributed optimizer; ``--tp-comm-overlap`` with ``tp`` > 1;
  ``--overlap-moe-expert-parallel-comm`` with ``ep`` > 1, the expert all-to-alls behind the other microbatch's
  compute as Megatron-Core's combined 1F1B runs them for DeepSeek-V3: they only hide communication, as the H100 runs
  used them). Recomputation is tried in the order none, selective, full, and a
  layout stops at the first that fits: recomputing adds compute to the backward and changes nothing else the layout
  prices, so a layout that fits without it is not faster with it.
* torchtitan: the same ``tp`` x ``cp`` x ``pp`` x FSDP over the rest (ZeRO-3, or ZeRO-2 kept gathered after the
  forward; HSDP with one replica a host when ``tp`` and ``cp`` are 1) x recomputation x microbatch size x schedule.
* MaxText: ``ici_tensor`` (powers up to ``M``) x ``ici_sequence`` (``cp`` below) with FSDP over the rest of the
  slice; across slices data, FSDP, or a pipeline (``dcn_pipeline``: powers dividing the slices and ``L``, with 1, 2
  or 4 microbatches a stage) with data over the rest; ``remat_policy`` (full, minimal, none) x gradient
  accumulation (powers up to 8) where there is no pipeline; ``per_device_batch_size`` is ``B / n`` (a MaxText run
  has whole sequences per chip).

Context parallelism (``cp``, MaxText's sequence axis) is tried in powers of two that leave each rank at least
:data:`CP_MIN_TOKENS` tokens of a sequence (and divide it in ``2 cp`` chunks, Megatron-LM's load-balanced split):
none at Llama 3's 8,192 pre-training sequence, up to 16 at its 131,072-token long-context stage, as it ran
(Dubey et al. 2024: CP 1 at 8K, CP 16 at 128K). For a model with MoE layers, each layout is also tried with its
experts split over the data-parallel group (``ep = dp x cp``, Megatron-LM's ``--expert-model-parallel-size`` and
torchtitan's ``expert_parallel_degree`` borrowing the FSDP ranks; MaxText's ``ici_expert`` over the slice's FSDP
chips) where that divides the expert count.

The search prices each layout against the best so far (``skip_above``): a layout whose step provably cannot beat it
is not simulated, and one whose floor before any ILP (the least compute any sharding of its meshes gives, its
launches and task overheads, through the pipeline's floor: :func:`~autopar_lab.layouts.engine.compute_floor`) cannot
beat it has no ILP solved (the result is the exhaustive grid's best; tests/test_frameworks.py checks it, and that
the floor is below every layout's priced step).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, NamedTuple

from ..layouts.engine import MICRO_BATCH_SIZES, micro_batch_sizes
from .common import FRAMEWORK_NAMES, block_count, sequence_length

__all__ = ["CP_MIN_TOKENS", "GridBest", "best_in_grid", "context_degrees", "grid"]

#: The fewest tokens of a sequence a context-parallel rank keeps in the grids (module docstring: Llama 3's 131,072
#: tokens over CP 16).
CP_MIN_TOKENS = 8192


def _powers(most: int) -> list[int]:
    out, k = [], 1
    while k <= most:
        out.append(k)
        k *= 2
    return out


def _stage_ok(cluster, devices: int) -> bool:
    M = cluster.devices_per_host
    return devices <= M and M % devices == 0 or devices % M == 0


def context_degrees(seq_len: int) -> list[int]:
    """The context-parallel degrees the grids try for sequences of ``seq_len`` tokens (module docstring): 1, and
    powers of two that leave each rank at least :data:`CP_MIN_TOKENS` tokens and split the sequence in ``2 cp``
    equal chunks.

    >>> context_degrees(8192), context_degrees(131072)
    ([1], [1, 2, 4, 8, 16])
    """
    return [cp for cp in _powers(seq_len // CP_MIN_TOKENS or 1) if cp == 1 or seq_len % (2 * cp) == 0]


def _pipelines(table) -> Iterator[tuple[int, int, int, list[tuple[str, int | None]]]]:
    """(tp, cp, pp, schedules) of Megatron-LM's and torchtitan's grids."""
    cluster = table.cluster
    n, blocks = cluster.num_devices, block_count(table)
    for tp in _powers(min(cluster.devices_per_domain, n)):
        for cp in context_degrees(sequence_length(table)):
            for pp in _powers(min(n // (tp * cp), blocks)):
                if n % (tp * cp * pp) or blocks % pp or not _stage_ok(cluster, n // pp):
                    continue
                scheds: list[tuple[str, int | None]] = [("1f1b", None)]
                if pp > 1 and blocks % (2 * pp) == 0:
                    scheds.append(("interleaved", 2))
                yield tp, cp, pp, scheds


def _expert_degrees(table, group: int) -> list[int]:
    """1, and ``group`` (the data-parallel ranks) where the model has MoE layers whose expert count it divides."""
    from ..layouts.engine import check_experts

    if group == 1:
        return [1]
    try:
        check_experts(table, group)
    except ValueError:  # no MoE layer, or the group does not divide the experts
        return [1]
    return [1, group]


def grid(framework: str, table) -> Iterator[tuple[Callable, dict[str, Any]]]:
    """(layout function, its keywords) for every layout of ``framework``'s grid on ``table`` (module docstring)."""
    from ..layouts import fsdp_plan, megatron_plan

    cluster, batch = table.cluster, table.batch_size
    n = cluster.num_devices
    if framework == "maxtext":
        yield from _maxtext(table)
        return
    for tp, cp, pp, scheds in _pipelines(table):
        dp = n // (tp * cp * pp)
        for mbs in micro_batch_sizes(batch, dp):
            for schedule, v in scheds:
                for ep in _expert_degrees(table, dp * cp):
                    sched = dict(schedule=schedule, virtual_stages=v, ep=ep, cp=cp)
                    if framework == "megatron":
                        for zero in (0, 1):
                            yield megatron_plan, dict(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=tp > 1,
                                                      micro_batch_size=mbs, overlap_grad_reduce=True,
                                                      overlap_param_gather=zero == 1, tp_comm_overlap=tp > 1,
                                                      overlap_moe_comm=ep > 1, **sched)
                    else:
                        hsdp = tp == 1 and cp == 1 and pp == 1 and cluster.hosts > 1
                        for rep in [1] + ([cluster.hosts] if hsdp else []):
                            for reshard in (True, False):
                                yield fsdp_plan, dict(dp_replicate=rep, dp_shard=dp // rep, tp=tp, pp=pp,
                                                      reshard_after_forward=reshard, local_batch_size=mbs, **sched)


def _maxtext(table) -> Iterator[tuple[Callable, dict[str, Any]]]:
    """MaxText's grid (module docstring)."""
    from ..layouts import maxtext_plan

    cluster, batch, blocks = table.cluster, table.batch_size, block_count(table)
    n, M, hosts = cluster.num_devices, cluster.devices_per_host, cluster.hosts
    if batch % n:
        return
    across: list[dict[str, int]] = [{}] if hosts == 1 else [{"dcn_data": -1}, {"dcn_data": 1, "dcn_fsdp": hosts}]
    across += [{"dcn_pipeline": pp, "dcn_data": -1} for pp in _powers(min(hosts, blocks))[1:]
               if hosts % pp == 0 and blocks % pp == 0]
    for tensor in _powers(M):
        for seq in context_degrees(sequence_length(table)):
            if M % (tensor * seq):
                continue
            for ep in _expert_degrees(table, M // (tensor * seq)):
                ici = dict(ici_tensor=tensor, ici_sequence=seq, ici_expert=ep)
                for dcn in across:
                    pp = dcn.get("dcn_pipeline", 1)
                    counts = [pp * k for k in (1, 2, 4)] if pp > 1 else list(MICRO_BATCH_SIZES)
                    for mb in counts:
                        if batch % mb == 0:
                            yield maxtext_plan, dict(per_device_batch_size=batch // n, microbatches=mb, **ici,
                                                     **dcn)


class GridBest(NamedTuple):
    """What searching a framework's grid found: the fastest plan that fits (None when none does), how many plans
    were priced, how many of them fit, and how many were stopped by a lower bound above the best so far."""

    best: Any
    priced: int
    fitting: int
    skipped: int


def best_in_grid(framework: str, table, *, mem_limit_bytes: float | None = None,
                 solver: str | None = None) -> GridBest:
    """The fastest plan of ``framework``'s grid that fits (:class:`GridBest`). Each layout is priced against the
    best so far (``skip_above``): one whose step provably cannot beat it is not simulated (nor its ILP solved where
    its compute floor already cannot, :func:`~autopar_lab.layouts.engine.compute_floor`), nor are its
    more-recomputing variants (recomputation only lengthens the backward); nor are they where the layout's stored
    state alone overflows a device (recomputation only saves activations)."""
    from ..pricing.price import StepAbove

    best, priced, fitting, skipped = None, 0, 0, 0
    extra = {} if solver is None else {"solver": solver}
    ladder = ("none", "minimal", "full") if framework == "maxtext" else (False, "selective", True)
    for fn, kw in grid(framework, table):
        for remat in ladder:  # recomputation adds compute and nothing else: only where less of it does not fit
            bar = math.inf if best is None else best.cost.step_time_s * (1 + 1e-9)
            try:
                plan = fn(table=table, mem_limit_bytes=mem_limit_bytes, remat=remat, skip_above=bar, **extra, **kw)
            except StepAbove:
                priced, skipped = priced + 1, skipped + 1
                break
            except ValueError:
                break  # a layout this model cannot take (heads or experts that do not split, a batch that does not)
            priced += 1
            if plan.cost.fits:
                fitting += 1
                if best is None or plan.cost.step_time_s < best.cost.step_time_s:
                    best = plan
                break
            if any(st.static_bytes > plan.cost.mem_limit_bytes for st in plan.stages):
                break  # weights and optimizer state alone overflow: no recomputation makes it fit
    if priced == 0:
        raise ValueError(f"no layout of {FRAMEWORK_NAMES[framework]}'s grid applies to this model and cluster")
    return GridBest(best, priced, fitting, skipped)
