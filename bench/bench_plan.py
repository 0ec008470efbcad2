"""Benchmark: plan quality and planning time (issue: inter-operator pass).

For each model on its paper GPU count (p3.16xlarge hosts of 8 V100s), prices the auto plan, the best Megatron-style
configuration (every dp x tp x pp x microbatch count) and data parallelism with ONE cost model, and prints them side
by side with megatron_best / auto (>= 1 means auto is no worse), the expert parallelism of the auto and Megatron
plans ("EP a/m": devices each MoE layer's experts are split over, 1 = replicated) and the planning time. Both
baselines are tried with no, full and selective rematerialisation (",R" in a configuration: full activation
checkpointing; ",S": selective, the attention internals only).

    .venv/bin/python bench/bench_plan.py gpt-760m:2 gpt-1.3b:4 gpt-2.6b:8
    .venv/bin/python bench/bench_plan.py --quick     # one row per family where auto and Megatron differed, and more

``--quick`` runs :data:`QUICK`: the rows that take minutes, not hours, on a shared 2-core machine.
``--schedules`` (issue 17): auto chooses its schedule (``schedule="auto"``: 1F1B, interleaved v = 2, 4, ZB-H1) and
every Megatron configuration is tried with the interleaved (v = 2) and ZB-H1 schedules too (:data:`GRID_SCHEDULES`),
so that the comparison stays fair; the best Megatron configuration's schedule is printed after it.
"""

from __future__ import annotations

import sys
import time

import autopar_lab as al
from autopar_lab import planner
from autopar_lab.parallelism import expert_degree
from autopar_lab.rematmode import remat_label
from autopar_lab.solve.inter import NoFeasiblePlanError


#: The --quick subset of the 21 Alpa configurations: a small GPT where every layout ties, and the 16-GPU rows of each
#: family (auto against Megatron and data parallelism where they differ).
QUICK = ["gpt-1.3b:4", "gpt-6.7b:16", "moe-10b:16", "wresnet-4b:16"]


def cluster_for(gpus: int) -> al.Cluster:
    if gpus <= 8:
        return al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=gpus)
    return al.Cluster.preset("p3.16xlarge", hosts=gpus // 8)


#: The schedules the Megatron-style grid tries with --schedules (beside 1F1B).
GRID_SCHEDULES = ("1f1b", "interleaved", "zb-h1")


def main(items: list[str], schedules: bool = False) -> None:
    print(f"{'model':<12}{'GPUs':>5}{'auto s':>11}{'megatron s':>12}{'(dp,tp,pp,mb[,R])':>20}{'data s':>11}{'(mb[,R])':>10}"
          f"{'meg/auto':>10}{'data/auto':>10}{'stages':>8}{'EP a/m':>8}{'plan s':>8}")
    for item in items:
        name, gpus = item.split(":")
        gpus = int(gpus)
        t0 = time.perf_counter()
        try:
            res = planner.compare(al.models.get(name), cluster_for(gpus), **(
                dict(schedule="auto", grid_schedules=GRID_SCHEDULES) if schedules else {}))
        except NoFeasiblePlanError as e:  # nothing fits: a row that says so, and the next row
            print(f"{name:<12}{gpus:>5}  no plan fits: {str(e).split(': ', 1)[-1][:150]}", flush=True)
            continue
        took = time.perf_counter() - t0
        auto, meg, data = res["auto"], res["megatron_best"], res["data_parallel"]
        c = res["megatron_config"]
        cfg = f"({c[0]},{c[1]},{c[2]},{c[3]}{remat_tag(c[4])})" if c else "-"
        meg_s = meg.cost.step_time_s if meg else float("nan")
        data_fits = data.cost.fits  # the best fitting count, else the smallest peak
        data_s = data.cost.step_time_s if data_fits else float("nan")
        dcfg = f"({data.microbatches}{remat_tag(data.stages[0].remat)})" if data_fits else "-"
        print(f"{name:<12}{gpus:>5}{auto.cost.step_time_s:>11.4g}{meg_s:>12.4g}{cfg:>20}{data_s:>11.4g}{dcfg:>10}"
              f"{meg_s / auto.cost.step_time_s:>10.3f}{data_s / auto.cost.step_time_s:>10.3f}"
              f"{len(auto.stages):>8}{ep(auto) + '/' + (ep(meg) if meg else '-'):>8}{took:>8.0f}", flush=True)
        if schedules:
            print(f"{'':<12}auto: {auto.schedule}{f' v={auto.virtual_stages}' if auto.virtual_stages > 1 else ''}, "
                  f"{auto.microbatches} mb; megatron: {res['megatron_schedule']}", flush=True)


def remat_tag(remat) -> str:
    """",R" for full rematerialisation, ",S" for selective, "" for none."""
    return {"full": ",R", "selective": ",S"}.get(remat_label(remat), "")


def ep(plan) -> str:
    """The plan's expert parallelism (MoE): how many devices its experts are split over, 1 when replicated."""
    return str(expert_degree(plan))


if __name__ == "__main__":
    args = sys.argv[1:]
    with_schedules = "--schedules" in args
    args = [a for a in args if a != "--schedules"]
    main(QUICK if args == ["--quick"] else args or ["gpt-350m:1", "gpt-760m:2", "gpt-1.3b:4", "gpt-2.6b:8"],
         schedules=with_schedules)
