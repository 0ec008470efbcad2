"""Benchmark: what ignoring inter-stage communication costs (the seed's open question 2).

For each model and cluster, plans twice from ONE cost table: with stage transfers ignored in the DP (Alpa) and with
them priced (autopar-lab's default). Both plans' step times come from the pipeline simulation, which always includes
the transfers. Clusters: p3.16xlarge as published, and the same with inter-host links 10x slower.

    .venv/bin/python bench/bench_slow_network.py gpt-1.3b:2 [--batch 256]
"""

from __future__ import annotations

import argparse
import time

import autopar_lab as al
from autopar_lab import planner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("items", nargs="*", default=["gpt-1.3b:2"])
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    print(f"{'model':<12}{'cluster':<22}{'ignore s':>11}{'model s':>11}{'ignore/model':>14}"
          f"{'stages i/m':>12}{'xfer s (i)':>12}{'plan s':>8}")
    for item in args.items:
        name, hosts = item.split(":")
        model = al.models.get(name, batch_size=args.batch, num_layers=args.layers)
        base = al.Cluster.preset("p3.16xlarge", hosts=int(hosts))
        for label, cluster in (("p3.16xlarge", base), ("p3.16xlarge 10x slower", base.scaled_inter_host(10))):
            t0 = time.perf_counter()
            table = al.CostTable.build(model, cluster, solver="cbc")
            ign = planner.auto_plan(model, cluster, stage_comm="ignore", table=table)
            mod = planner.auto_plan(model, cluster, stage_comm="model", table=table)
            took = time.perf_counter() - t0
            print(f"{name:<12}{label + ':' + hosts:<22}{ign.cost.step_time_s:>11.4g}{mod.cost.step_time_s:>11.4g}"
                  f"{ign.cost.step_time_s / mod.cost.step_time_s:>14.3f}"
                  f"{str(len(ign.stages)) + '/' + str(len(mod.stages)):>12}{ign.cost.stage_comm_s:>12.4g}"
                  f"{took:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
