"""Benchmark: planning time as models and clusters grow (the seed's open question 5).

GPT-39B's layer shape (H 8192, 64 heads, S 1024, V 51200, batch 1024) with L layers on p3.16xlarge hosts; times
`auto_plan` with microbatches searched, split into trace, intra-op (ILP per logical mesh) and inter-op (stage DP).
"meshes" counts the logical meshes the intra-op pass solves (one per group of equivalent ones, see
`planner.distinct_mesh_shapes`); "cpu s" is this process' CPU time, steadier than the wall times on a shared machine.
An optional third field picks the ILP solver: `48:64:cbc` (default: highs).

    .venv/bin/python bench/bench_plan_time.py 48:8 96:8 48:16 48:64
"""

from __future__ import annotations

import sys
import time

import autopar_lab as al
from autopar_lab import planner


def main(items: list[str]) -> None:
    print(f"{'layers':>7}{'devices':>8}{'meshes':>8}{'trace s':>9}{'intra s':>9}{'inter s':>9}{'total s':>9}"
          f"{'stages':>8}{'step s':>10}{'cpu s':>9}{'mb':>6}")
    for item in items:
        parts = item.split(":")
        layers, devices = int(parts[0]), int(parts[1])
        solver = parts[2] if len(parts) > 2 else "highs"
        cluster = (al.Cluster.preset("p3.16xlarge", hosts=devices // 8) if devices >= 8
                   else al.Cluster.preset("p3.16xlarge").with_(devices_per_host=devices))
        model = al.models.get("gpt-39b", num_layers=layers)
        meshes = sum(len(planner.distinct_mesh_shapes(cluster, s)) for s in cluster.submesh_shapes())
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            plan = al.auto_plan(model, cluster, solver=solver)
        except ValueError as e:  # the model does not fit: the search still ran to the end
            print(f"{layers:>7}{devices:>8}{meshes:>8}   no plan fits in 16 GB ({time.perf_counter() - t0:.1f} s): "
                  f"{str(e)[:60]}", flush=True)
            continue
        total = time.perf_counter() - t0
        s = plan.solve_s
        print(f"{layers:>7}{devices:>8}{meshes:>8}{s['trace']:>9.1f}{s['intra']:>9.1f}{s['inter']:>9.1f}"
              f"{total:>9.1f}{len(plan.stages):>8}{plan.cost.step_time_s:>10.4g}{time.process_time() - c0:>9.1f}"
              f"{plan.microbatches:>6}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["48:16", "48:32", "48:64", "96:64", "128:64"])
