"""The best plan a framework can run: each layout of the framework's grid (below) priced through its layout
function, the fastest that fits kept (``al.auto_plan(..., expressible_in=...)`` puts it beside the unconstrained
auto plan).

The grids (``n`` devices, ``M`` a host, ``D`` a scale-up domain, ``L`` transformer blocks, ``B`` the global batch;
"powers" are powers of two):

* Megatron-LM: tensor ``tp`` (powers up to ``D``) x pipeline ``pp`` (powers dividing ``L``; stages of whole hosts
  or part of one) x data ``dp`` (the rest) x ZeRO 0 or 1 (the distributed optimizer) x recomputation (none,
  selective, full) x ``--micro-batch-size`` (powers up to 8 dividing ``B / dp``) x schedule (1F1B; interleaved with
  2 chunks a stage where ``2 pp`` divides ``L``); sequence parallelism on with ``tp`` > 1 (it only saves memory).
  Recomputation is tried in the order none, selective, full, and a layout stops at the first that fits: recomputing
  adds compute to the backward and changes nothing else the layout prices, so a layout that fits without it is not
  faster with it.
* torchtitan: the same ``tp`` x ``pp`` x FSDP over the rest (ZeRO-3, or ZeRO-2 kept gathered after the forward;
  HSDP with one replica a host when ``tp`` is 1) x recomputation x microbatch size x schedule.
* MaxText: ``ici_tensor`` (powers up to ``M``) with FSDP over the rest of the slice, across slices data or FSDP x
  ``remat_policy`` (full, minimal, none) x gradient accumulation (powers up to 8); ``per_device_batch_size`` is
  ``B / n`` (a MaxText run has whole sequences per chip). No pipeline axis.

For a model with MoE layers, Megatron-LM's and torchtitan's grids also try each layout with its experts split over
the data-parallel group (``ep = dp``, Megatron-LM's ``--expert-model-parallel-size`` and torchtitan's
``expert_parallel_degree`` borrowing the FSDP ranks) where that divides the expert count. Context parallelism is not
searched (import a configuration with it to price it).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from .common import FRAMEWORK_NAMES, block_count

__all__ = ["best_in_grid", "grid"]

#: The largest per-rank microbatch (sequences) the grids try.
MAX_MICRO = 8


def _powers(most: int) -> list[int]:
    out, k = [], 1
    while k <= most:
        out.append(k)
        k *= 2
    return out


def _stage_ok(cluster, devices: int) -> bool:
    M = cluster.devices_per_host
    return devices <= M and M % devices == 0 or devices % M == 0


def _pipelines(table) -> Iterator[tuple[int, int, list[tuple[str, int | None]]]]:
    """(tp, pp, schedules) of Megatron-LM's and torchtitan's grids."""
    cluster = table.cluster
    n, blocks = cluster.num_devices, block_count(table)
    for tp in _powers(min(cluster.devices_per_domain, n)):
        for pp in _powers(min(n // tp, blocks)):
            if n % (tp * pp) or blocks % pp or not _stage_ok(cluster, n // pp):
                continue
            scheds: list[tuple[str, int | None]] = [("1f1b", None)]
            if pp > 1 and blocks % (2 * pp) == 0:
                scheds.append(("interleaved", 2))
            yield tp, pp, scheds


def _expert_degrees(table, dp: int) -> list[int]:
    """1, and ``dp`` where the model has MoE layers whose expert count ``dp`` divides (module docstring)."""
    from ..layouts.engine import check_experts

    if dp == 1:
        return [1]
    try:
        check_experts(table, dp)
    except ValueError:  # no MoE layer, or dp does not divide the experts
        return [1]
    return [1, dp]


def _micro(batch: int, dp: int) -> list[int]:
    return [m for m in _powers(MAX_MICRO) if batch % dp == 0 and (batch // dp) % m == 0]


def grid(framework: str, table) -> Iterator[tuple[Callable, dict[str, Any]]]:
    """(layout function, its keywords) for every layout of ``framework``'s grid on ``table`` (module docstring)."""
    from ..layouts import fsdp_plan, maxtext_plan, megatron_plan

    cluster, batch = table.cluster, table.batch_size
    n = cluster.num_devices
    if framework == "maxtext":
        if batch % n:
            return
        across = [{}] if cluster.hosts == 1 else [{"dcn_data": -1}, {"dcn_data": 1, "dcn_fsdp": cluster.hosts}]
        for tensor in _powers(cluster.devices_per_host):
            for dcn in across:
                for acc in _powers(MAX_MICRO):
                    if batch % acc == 0:
                        yield maxtext_plan, dict(ici_tensor=tensor, per_device_batch_size=batch // n,
                                                 microbatches=acc, **dcn)
        return
    for tp, pp, scheds in _pipelines(table):
        dp = n // (tp * pp)
        for mbs in _micro(batch, dp):
            for schedule, v in scheds:
                for ep in _expert_degrees(table, dp):
                    sched = dict(schedule=schedule, virtual_stages=v, ep=ep)
                    if framework == "megatron":
                        for zero in (0, 1):
                            yield megatron_plan, dict(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=tp > 1,
                                                      micro_batch_size=mbs, **sched)
                    else:
                        reps = [1] + ([cluster.hosts] if tp == 1 and pp == 1 and cluster.hosts > 1 else [])
                        for rep in reps:
                            for reshard in (True, False):
                                yield fsdp_plan, dict(dp_replicate=rep, dp_shard=dp // rep, tp=tp, pp=pp,
                                                      reshard_after_forward=reshard, local_batch_size=mbs, **sched)


def best_in_grid(framework: str, table, *, mem_limit_bytes: float | None = None, solver: str | None = None):
    """(the fastest plan of ``framework``'s grid that fits, or None; how many plans were priced; how many of them
    fit)."""
    best, priced, fitting = None, 0, 0
    extra = {} if solver is None else {"solver": solver}
    ladder = ("none", "minimal", "full") if framework == "maxtext" else (False, "selective", True)
    for fn, kw in grid(framework, table):
        for remat in ladder:  # recomputation adds compute and nothing else: only where less of it does not fit
            try:
                plan = fn(table=table, mem_limit_bytes=mem_limit_bytes, remat=remat, **extra, **kw)
            except ValueError:
                break  # a layout this model cannot take (heads or experts that do not split, a batch that does not)
            priced += 1
            if plan.cost.fits:
                fitting += 1
                if best is None or plan.cost.step_time_s < best.cost.step_time_s:
                    best = plan
                break
    if priced == 0:
        raise ValueError(f"no layout of {FRAMEWORK_NAMES[framework]}'s grid applies to this model and cluster")
    return best, priced, fitting
