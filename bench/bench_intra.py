"""Benchmark: intra-op ILP size and solve time against layers, with and without layer reuse and follower merging.

GPT with the gpt-1.3b shape (H=2048, 32 heads, S=1024, V=51200; batch 16) traced from abstract shapes for each
number of layers, solved by :func:`autopar_lab.solve.intra.solve_intra` on one p3.16xlarge (logical mesh (1, 8) by
default; ``--mesh 2x4`` solves axes="auto", i.e. sequentially) in four variants:

    reuse        reuse_layers=True (the default: each distinct layer solved once, copies reuse it)
    reuse+merge  reuse_layers=True, merge=True (Alpa's follower merging inside each layer's ILP)
    whole        reuse_layers=False (the whole graph as one ILP: the reference)
    whole+merge  reuse_layers=False, merge=True

The whole-graph variants run under a CBC time limit (``--time-limit``, default 120 s; a row that hit it says
``time_limit`` and its gap) and stop growing L once one solve takes longer than ``--grow-limit`` seconds (later
rows print ``skipped``). Columns: L, operators, variant, ILP variables and constraints (summed over the groups that
were solved, reused layers add none), solver time (sum of the groups' solve_ilp calls, model build included), wall
time of solve_intra (strategies, resharding matrices, ILPs, evaluation), plan step time (``plan.total_s``), and
the plan time over the best plan time at that L (1.000 = best; the quality lost to merging or to reuse). Trace time
per L is printed as its own table. A variant that raises prints the error in place of its numbers.

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_intra.py [--layers 2 4 8 16 24 48] [--mesh 1x8] [--budget 840]
"""

from __future__ import annotations

import argparse
import math
import sys
import time


import autopar_lab as al
from autopar_lab.cluster import Cluster
from autopar_lab.solve.intra import IntraOptions, solve_intra

VARIANTS = {
    "reuse": dict(reuse_layers=True, merge=False),
    "reuse+merge": dict(reuse_layers=True, merge=True),
    "whole": dict(reuse_layers=False, merge=False),
    "whole+merge": dict(reuse_layers=False, merge=True),
}


def run_variant(graph, mesh, variant: str, time_limit):
    t0 = time.perf_counter()
    try:
        plan = solve_intra(graph, mesh, options=IntraOptions(time_limit=time_limit, **VARIANTS[variant]))
    except Exception as e:  # report, keep benchmarking the rest
        return {"variant": variant, "error": f"{type(e).__name__}: {e}", "wall_s": time.perf_counter() - t0}
    solved = [g for g in plan.groups if g.reused_from is None]
    worst = [g for g in solved if g.status != "optimal"]
    return {
        "variant": variant,
        "vars": sum(g.num_vars for g in solved),
        "cons": sum(g.num_constraints for g in solved),
        "ilps": len(solved),
        "merges": sum(g.merges for g in solved),
        "ilp_s": sum(g.solve_s for g in solved),
        "wall_s": plan.solve_s,
        "plan_s": plan.total_s,
        "status": "optimal" if not worst else f"{worst[0].status} gap={worst[0].gap if worst[0].gap is None else round(worst[0].gap, 4)}",
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 24, 48])
    ap.add_argument("--mesh", default="1x8", help="logical mesh of one p3.16xlarge, e.g. 1x8 or 2x4")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--time-limit", type=float, default=120.0, help="CBC limit (s) for the whole-graph ILPs")
    ap.add_argument("--grow-limit", type=float, default=120.0,
                    help="stop growing L for a whole-graph variant once one of its solves takes longer (s)")
    ap.add_argument("--budget", type=float, default=None, help="skip further whole-graph solves past this (s)")
    args = ap.parse_args(argv)

    shape = tuple(int(x) for x in args.mesh.lower().split("x"))
    mesh = Cluster.preset("p3.16xlarge", hosts=1).logical_mesh((1, shape[0] * shape[1]), shape)
    print(f"{args.model} batch {args.batch}, p3.16xlarge x1, logical mesh {shape}, solver cbc, "
          f"whole-graph time limit {args.time_limit:g} s, grow limit {args.grow_limit:g} s")
    start = time.perf_counter()
    traces, rows = [], []
    stopped: dict[str, str] = {}
    hdr = (f"{'L':>3}{'ops':>7}  {'variant':<12}{'ILPs':>5}{'vars':>9}{'cons':>9}{'merged':>8}{'ILP s':>9}"
           f"{'wall s':>9}{'plan ms':>10}{'/best':>8}  status")
    print(hdr, flush=True)
    for L in args.layers:
        t0 = time.perf_counter()
        graph = al.models.get(args.model, num_layers=L, batch_size=args.batch).trace()
        traces.append((L, len(graph), time.perf_counter() - t0))
        results = []
        for v in args.variants:
            whole = v.startswith("whole")
            if whole and v in stopped:
                results.append({"variant": v, "skipped": stopped[v]})
                continue
            if whole and args.budget is not None and time.perf_counter() - start > args.budget:
                stopped[v] = f"budget {args.budget:g} s spent"
                results.append({"variant": v, "skipped": stopped[v]})
                continue
            r = run_variant(graph, mesh, v, args.time_limit if whole else None)
            if whole and r["wall_s"] > args.grow_limit:
                stopped[v] = f"L={L} took {r['wall_s']:.0f} s"
            results.append(r)
        best = min((r["plan_s"] for r in results if "plan_s" in r), default=math.nan)
        for r in results:
            head = f"{L:>3}{len(graph):>7}  {r['variant']:<12}"
            if "skipped" in r:
                line = head + f"{'skipped':>5}  ({r['skipped']})"
            elif "error" in r:
                line = head + f"{'error':>5}  {r['error'][:100]}"
            else:
                line = (head + f"{r['ilps']:>5}{r['vars']:>9}{r['cons']:>9}{r['merges']:>8}{r['ilp_s']:>9.1f}"
                        f"{r['wall_s']:>9.1f}{r['plan_s'] * 1e3:>10.2f}{r['plan_s'] / best:>8.3f}  {r['status']}")
            print(line, flush=True)
            rows.append(line)
    print(f"\n{'L':>3}{'ops':>7}{'trace s':>9}")
    for L, n, s in traces:
        print(f"{L:>3}{n:>7}{s:>9.2f}")
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
