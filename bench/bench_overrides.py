"""Benchmark: re-estimating an override, and a resolve around a pin, on the GPT-1.3B plan (issue 5, target < 50 ms).

Builds the auto plan of GPT-1.3B (24 layers, batch 1024, microbatches searched) on one p3.16xlarge (8 V100s) once,
then times each override kind as the median of repeats (each a fresh override of the same plan, so nothing is
cached between repeats beyond the CostTable the plan carries), and one resolve around an operator pin plus a stage
pin. Prints one table; planning itself takes a few minutes on a busy two-core machine.

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_overrides.py [--model gpt-1.3b] [--cluster p3.16xlarge:1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import autopar_lab as al

TARGET_S = 0.050


def _median_s(fn, repeats: int) -> tuple[float, float, object]:
    """(median, first, result): the first call may price a mesh the planner never asked for (its ILP)."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times[0], out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--cluster", default="p3.16xlarge:1")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    model = al.models.get(args.model)
    cluster = al.Cluster.parse(args.cluster)
    t0 = time.perf_counter()
    plan = al.auto_plan(model, cluster)
    plan_s = time.perf_counter() - t0
    g = plan.table.solve_graph
    print(f"{args.model} on {args.cluster}: {plan} in {plan_s:.1f} s; {len(plan.layer_names)} layers, "
          f"{len(plan.graph.ops)} operators ({len(g.ops)} in the solve graph)", flush=True)

    # One operator of a middle layer, overridden to its worst alternative (the stage really changes).
    layer = plan.table.solve_graph.layers[len(plan.table.solve_graph.layers) // 2]
    op = [o for o in g.ops if g.op(o).primitive == "dot_general" and g.op(o).layer == layer][0]
    worst = plan.alternatives(op)[-1].strategy
    L = len(plan.layer_names)
    B = plan.microbatches
    other_B = B * 2 if plan.table.batch_size % (B * 2) == 0 else max(B // 2, 1)
    k = plan.stage_of(op)
    S = len(plan.stages)
    if S > 1:
        # Move the first cut by one layer; submeshes and logical meshes kept (same stage count).
        cut = plan.stages[1].layers[0]
        new_cut = cut + 1 if cut + 1 < plan.stages[1].layers[1] + 1 and cut + 1 < L else cut - 1
        bounds = [new_cut] + [st.layers[0] for st in plan.stages[2:]]
        stage_kw = dict(boundaries=bounds)
        stage_what = f"first cut {cut} -> {new_cut}"
    else:
        # One stage: split it in two at the middle layer, submeshes chosen by the table's DP.
        stage_kw = dict(boundaries=[L // 2])
        stage_what = f"split at layer {L // 2}, submeshes chosen"

    cases = [
        (f"with_choice(#{op}, worst)", lambda: plan.with_choice(op, worst)),
        (f"with_microbatches({other_B})", lambda: plan.with_microbatches(other_B)),
        (f"with_stages({stage_what})", lambda: plan.with_stages(**stage_kw)),
        (f"with_remat({k}, {not plan.stages[k].remat})", lambda: plan.with_remat(k, not plan.stages[k].remat)),
        ("with_schedule(gpipe)", lambda: plan.with_schedule("gpipe")),
    ]
    print(f"{'override':<48}{'median ms':>11}{'first ms':>10}{'step s before':>15}{'step s after':>14}{'target':>8}")
    for name, fn in cases:
        med, first, out = _median_s(fn, args.repeats)
        ok = "met" if med < TARGET_S else "MISSED"
        print(f"{name:<48}{med * 1e3:>11.1f}{first * 1e3:>10.1f}{plan.cost.step_time_s:>15.5g}"
              f"{out.cost.step_time_s:>14.5g}{ok:>8}", flush=True)

    pinned = plan.with_choice(op, worst).with_microbatches(B)
    t0 = time.perf_counter()
    r = al.resolve(pinned)
    t_resolve = time.perf_counter() - t0
    print(f"resolve around the operator pin and the microbatch pin: {t_resolve:.2f} s, step "
          f"{pinned.cost.step_time_s:.5g} -> {r.cost.step_time_s:.5g} s (unpinned plan {plan.cost.step_time_s:.5g} s); "
          f"pin kept: {r.choice(op).name == worst}; {r}")
    free = plan.with_choice(op, worst)
    t0 = time.perf_counter()
    r2 = al.resolve(free)
    t_resolve2 = time.perf_counter() - t0
    print(f"resolve around the operator pin alone (microbatches searched again): {t_resolve2:.2f} s, step "
          f"{r2.cost.step_time_s:.5g} s; {r2}")
    cut = plan.with_stages(boundaries=[L // 2])
    t0 = time.perf_counter()
    r3 = al.resolve(cut)
    t_resolve3 = time.perf_counter() - t0
    print(f"resolve around a pinned cut at layer {L // 2} (submeshes, logical meshes, remat, microbatches free): "
          f"{t_resolve3:.2f} s, step {cut.cost.step_time_s:.5g} -> {r3.cost.step_time_s:.5g} s; {r3}")


if __name__ == "__main__":
    main()
