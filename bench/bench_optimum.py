"""Benchmark 3: the gap between Alpa's two-level plan and the global optimum, over a set of small instances.

Each instance is a zoo model cut to a few layers, a small cluster (2-8 devices in 1-2 hosts; p3.16xlarge links, or
the same with a 10x slower inter-host network) and a per-device memory limit, given as a fraction of the peak memory
of the unconstrained auto plan (``mem 1`` = the device's own memory; smaller limits force pipelines and
rematerialisation, where the two levels have something to disagree about). For each, `global_optimum` enumerates
every plan (partition x submeshes x logical meshes x remat x microbatches), priced by the pipeline simulator, and the
auto plan is priced the same way from the same cost table. Prints one table and the median and worst gap.

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_optimum.py            # the default set
    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_optimum.py --quick    # two instances, to check it runs
"""

from __future__ import annotations

import statistics
import sys

import autopar_lab as al
from autopar_lab.solve.exhaustive import global_optimum
from autopar_lab.solve.inter import NoFeasiblePlanError

GPT_WIDE = {"hidden_size": 1024, "seq_len": 256, "vocab_size": 1024, "num_heads": 16}
MOE_WIDE = {"hidden_size": 512, "seq_len": 128, "vocab_size": 1024, "num_heads": 8}

# (model, num_layers, batch, overrides, hosts, devices_per_host, inter-host slowdown, memory fractions)
INSTANCES = [
    ("gpt-tiny", 2, 8, {}, 2, 2, 1, (1.0,)),
    ("gpt-tiny", 4, 64, GPT_WIDE, 2, 4, 10, (1.0, 0.12, 0.06)),
    ("gpt-tiny", 4, 64, GPT_WIDE, 2, 4, 1, (1.0, 0.5, 0.25)),
    ("moe-tiny", 2, 32, MOE_WIDE, 2, 2, 10, (1.0, 0.3)),
    ("mlp", 4, 32, {"hidden_size": 4096}, 1, 4, 1, (1.0, 0.6)),
    ("mlp", 3, 16, {"hidden_size": 2048}, 2, 1, 10, (1.0, 0.8)),
]
QUICK = [INSTANCES[0], ("mlp", 2, 8, {"hidden_size": 1024}, 1, 2, 1, (1.0, 0.5))]


def cluster_of(hosts: int, per_host: int, slow: float) -> al.Cluster:
    c = al.Cluster.preset("p3.16xlarge", hosts=hosts).with_(devices_per_host=per_host)
    return c.scaled_inter_host(slow) if slow != 1 else c


def main(argv: list[str]) -> None:
    instances = QUICK if "--quick" in argv else INSTANCES
    head = (f"{'instance':<44}{'auto s':>11}{'optimum s':>11}{'gap':>8}{'priced':>9}{'of':>9}{'search s':>10}"
            f"{'table s':>9}  auto | optimum")
    print(head)
    gaps = []
    for name, layers, batch, ov, hosts, per_host, slow, fractions in instances:
        model = al.models.get(name, batch_size=batch, num_layers=layers, **ov)
        cluster = cluster_of(hosts, per_host, slow)
        table, base_peak, table_s = None, None, 0.0
        for frac in fractions:
            label = (f"{name}{'+w' if ov else ''} L{layers} b{batch} {hosts}x{per_host}"
                     f"{' inter/10' if slow != 1 else ''} mem {frac:g}")
            mem = None if frac == 1.0 or base_peak is None else frac * base_peak
            try:
                r = global_optimum(model, cluster, mem_limit_bytes=mem, table=table)
            except NoFeasiblePlanError:
                print(f"{label:<44}  no plan fits", flush=True)
                continue
            if table is None:
                table_s = r["solve_s"]["table"]
            table = r["table"]
            if base_peak is None:
                base_peak = max(r["auto"].cost.peak_mem_bytes)
            gaps.append(r["gap"])
            shape = lambda p: " ".join(f"{s.layers[0]}-{s.layers[1]}@{s.submesh[0]}x{s.submesh[1]}"
                                       f"/{s.logical_mesh[0]}x{s.logical_mesh[1]}{'R' if s.remat else ''}"
                                       for s in p.stages) + f" B{p.microbatches}"
            print(f"{label:<44}{r['auto_step_s']:>11.4g}{r['optimum_step_s']:>11.4g}{r['gap']:>8.2%}"
                  f"{r['plans_priced']:>9}{r['plans_total']:>9}{r['solve_s']['search']:>10.1f}{table_s:>9.1f}"
                  f"  {shape(r['auto'])} | {shape(r['optimum'])}", flush=True)
    if gaps:
        print(f"\n{len(gaps)} instances: median gap {statistics.median(gaps):.2%}, worst gap {max(gaps):.2%}, "
              f"{sum(g > 1e-9 for g in gaps)} with a gap > 0")


if __name__ == "__main__":
    main(sys.argv[1:])
