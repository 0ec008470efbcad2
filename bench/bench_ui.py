"""Benchmark: UI latency of the workbench (issue: the workbench), headless.

1. First render: building every view of the GPT-1.3B workbench (header, graph, sharding table, stage layout, cost
   panel, timeline, controls, training) from a ready plan. Tracing and planning are EXCLUDED (timed and printed
   separately): the plan is Megatron-style, so one intra-op ILP prices it. "cold" is the first Workbench of the process (plotly's
   FigureWidget and ipywidgets load then); "warm" a second one.
2. A click on a layer of the operator graph: expand it (its operators, edges and their resharding priced and sent to
   the browser), then collapse it. The browser's layout of those operators (dagre) is timed by the browser test.
3. One override from the dropdown: the sharding table's alternatives dropdown set to another strategy, timed until
   the cost panel has redrawn (it observes first) and until every view has (the table re-prices the operator's
   alternatives last).
4. The stage editor: one stage's first layer moved in the draft, timed until its preview is priced; and the memory
   breakdown of the plan (autopar_lab.memory).

The what-if sliders' re-plans (GPT-39B on 512 GPUs, each beside a fresh plan of the same cluster) are timed by
``bench/bench_whatif.py``.

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_ui.py                     # gpt-1.3b on 4 V100s, dp=1 tp=2 pp=2
    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_ui.py gpt-tiny --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import math
import time

import autopar_lab as al


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="gpt-1.3b")
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8, help="capped at the model's batch size")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    cluster = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=args.gpus)
    model = al.models.get(args.model)
    mb = math.gcd(args.microbatches, model.config.batch_size) if hasattr(model, "config") else args.microbatches
    t0 = time.perf_counter()
    plan = al.megatron_plan(model, cluster, dp=args.dp, tp=args.tp, pp=args.pp, microbatches=mb)
    t_plan = time.perf_counter() - t0
    print(f"{args.model} on {cluster.num_devices} GPUs: {plan!r}")
    print(f"  graph {len(plan.graph.ops)} ops, {len(plan.layer_names)} layers; solve graph "
          f"{len(plan.table.solve_graph.ops)} ops; trace + plan {t_plan:.1f} s (excluded below)")

    t0 = time.perf_counter()
    import ipywidgets  # noqa: F401
    import plotly.graph_objects as go

    go.FigureWidget()
    t_import = time.perf_counter() - t0
    from autopar_lab.memory import memory_breakdown
    from autopar_lab.widgets.views.controls import Controls
    from autopar_lab.widgets.views.cost_panel import CostPanel
    from autopar_lab.widgets.views.graph import GraphView
    from autopar_lab.widgets.views.header import Header
    from autopar_lab.widgets.views.sharding_table import ShardingTable
    from autopar_lab.widgets.views.stage_layout import StageLayout
    from autopar_lab.widgets.views.timeline import TimelineView
    from autopar_lab.widgets.workbench import Workbench

    t0 = time.perf_counter()
    wb = Workbench(model, cluster, plan=plan)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    wb2 = Workbench(model, cluster, plan=plan)
    t_warm = time.perf_counter() - t0
    wb2.close()
    per_view = {}
    for name, cls in (("header", Header), ("graph", GraphView), ("sharding table", ShardingTable),
                      ("stage layout", StageLayout), ("cost panel", CostPanel), ("timeline", TimelineView),
                      ("controls", Controls)):
        t0 = time.perf_counter()
        v = cls(wb.session)
        per_view[name] = time.perf_counter() - t0
        v.close()
    print(f"first render (views only): cold {t_cold:.3f} s (plotly/ipywidgets import + first FigureWidget "
          f"{t_import:.3f} s before it), warm {t_warm:.3f} s")
    print("  per view (warm): " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in per_view.items()))

    layers = list(wb.plan.layer_names)
    mid = layers[len(layers) // 2]
    t0 = time.perf_counter()
    wb.graph.on_click(f"L:{mid}")  # a click on a layer node: expand it (and select it in every view)
    t_expand = time.perf_counter() - t0
    summary = dict(wb.graph.data["summary"])
    t0 = time.perf_counter()
    wb.graph.on_click(f"L:{mid}")  # collapse again
    t_collapse = time.perf_counter() - t0
    print(f"graph: {len(layers)} layers as {summary['overview_nodes']} overview node(s); expanding {mid} "
          f"({summary['operators']} operators, {summary['edges']} edges, {summary['resharded']} resharded) "
          f"{t_expand:.3f} s, collapsing {t_collapse:.3f} s")

    dots = [r["op"] for r in wb.table.rows if r["primitive"] == "dot_general" and r["role"] == "forward"]
    op = dots[len(dots) // 2]  # a row of the table (operators of the model's graph)
    t0 = time.perf_counter()
    wb.table.rows_select.value = op  # a row click: selection, then the table prices the alternatives
    t_select = time.perf_counter() - t0
    to_cost, total = [], []
    options = [v for _, v in wb.table.alternatives.options]
    for k in range(args.repeat):
        target = [s for s in options if s != wb.plan.choice(op).name][k % (len(options) - 1)]
        t0 = time.perf_counter()
        wb.table.alternatives.value = target  # the dropdown change
        t1 = time.perf_counter()
        assert wb.plan.choice(op).name == target
        to_cost.append(wb.cost.last_refresh - t0)
        total.append(t1 - t0)
    print(f"select op #{op} ({wb.session.graph.op(op).primitive}, {len(options)} strategies priced): {t_select:.3f} s")
    print(f"override from the dropdown (median of {args.repeat}): to the updated cost panel "
          f"{statistics.median(to_cost):.3f} s, to every view updated {statistics.median(total):.3f} s")
    print(f"  each: cost panel {', '.join(f'{x:.3f}' for x in to_cost)} s; all views "
          f"{', '.join(f'{x:.3f}' for x in total)} s")

    if len(wb.plan.stages) > 1:
        first = wb.layout.draft[1]["first"]
        t0 = time.perf_counter()
        wb.layout.edit_stage(1, first=first + 1)  # the draft only: priced for the preview
        t_preview = time.perf_counter() - t0
        print(f"stage editor: stage 1 starting one layer later, previewed in {t_preview:.3f} s "
              f"({'valid' if wb.layout.preview_plan is not None else wb.layout.preview_error})")
    t0 = time.perf_counter()
    memory_breakdown(wb.plan)
    print(f"memory breakdown of {len(wb.plan.stages)} stage(s): {time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
