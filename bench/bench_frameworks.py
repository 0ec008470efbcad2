"""Benchmark: the best plan each framework can run, beside the unconstrained auto plan (issue 33's must-show).

Llama 3 70B (80 layers, sequence 8,192, global batch 512) in bf16 on 8 DGX H100 hosts (64 GPUs), planned on its
copy as ``auto_plan`` plans it. For each framework, ``al.auto_plan(..., expressible_in=framework)``: the fastest layout
of that framework's grid that fits (``autopar_lab.frameworks.grid``), its step and peak memory, how many layouts the
grid priced and how many of those the bound stopped unsimulated, the wall time of the grid's search, and the gap to
the unconstrained plan: what the framework's limits cost. Each chosen plan is written as the framework's
configuration and read back (``export_config`` / ``import_config``): "round trip" says whether that gives the same
step to the bit.

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_frameworks.py [--model llama3-70b] [--cluster dgx-h100:8]
        [--frameworks megatron,torchtitan,maxtext]
"""

from __future__ import annotations

import sys
import time

import autopar_lab as al
from autopar_lab.pricing import CostTable

FRAMEWORKS = ("megatron", "torchtitan", "maxtext")


def arg(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def main(argv: list[str]) -> None:
    name, spec = arg(argv, "--model", "llama3-70b"), arg(argv, "--cluster", "dgx-h100:8")
    frameworks = arg(argv, "--frameworks", ",".join(FRAMEWORKS)).split(",")
    model, cluster = al.models.get(name), al.Cluster.parse(spec)
    t0 = time.perf_counter()
    table = CostTable.build(model, cluster, precision="bf16")
    t1 = time.perf_counter()
    free = al.auto_plan(table=table)
    t2 = time.perf_counter()
    gib = 2 ** 30
    print(f"{name} on {spec} ({cluster.num_devices} GPUs), bf16: table {t1 - t0:.1f} s; unconstrained auto plan "
          f"{t2 - t1:.1f} s: {free.method}, {len(free.stages)} stage(s), {free.microbatches} microbatches, step "
          f"{free.cost.step_time_s:.3f} s, peak {max(free.cost.peak_mem_bytes) / gib:.1f} GiB"
          f"{'' if free.cost.fits else ' (does not fit)'}\n")
    print("| framework | best layout it can run | step s | peak GiB | vs auto | priced | stopped by bound | "
          "search s | round trip |")
    print("|---|---|---|---|---|---|---|---|---|")
    for fw in frameworks:
        t = time.perf_counter()
        plan = al.auto_plan(table=table, expressible_in=fw)
        spent = time.perf_counter() - t
        note = plan.notes[-1]
        priced = note.split(" priced")[0].rsplit("(", 1)[-1]
        stopped = note.split(" stopped by a lower bound")[0].rsplit(", ", 1)[-1]
        again = al.import_config(al.export_config(plan, fw, model=model), model, framework=fw, table=table)
        same = again.cost.step_time_s == plan.cost.step_time_s
        print(f"| {fw} | `{plan.method}` x {plan.microbatches} mb | {plan.cost.step_time_s:.3f} | "
              f"{max(plan.cost.peak_mem_bytes) / gib:.1f} | {plan.cost.step_time_s / free.cost.step_time_s - 1:+.1%} | "
              f"{priced} | {stopped} | {spent:.0f} | {'same' if same else 'DIFFERS'} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
