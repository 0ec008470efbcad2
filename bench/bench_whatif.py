"""Benchmark: the workbench's what-if re-plans at 512 GPUs (issue 16, item 4), beside a fresh plan of each cluster.

A session on GPT-39B (Megatron's 48 layers, H 8192, 64 heads, s 2048, batch 1536) planned on 64 DGX A100 hosts
(512 GPUs), then each what-if a user tries from the sliders, undone after each: hosts 64 -> 32, 128, 63, 65;
inter-host bandwidth x0.1 and x10; intra-host bandwidth x0.5. Each re-plan (``Session.set_cluster``, what the
"re-plan on this cluster" button runs) is timed and split into "ilp s" (the ILPs of meshes the moved table could not
keep), "table s" (the stage candidates' arrays, ``StageBlock``) and "dp s" (the rest: the stage DP, the simulation,
pricing); "cpu s" is the re-plan's CPU time in this process (ILP worker processes apart: the figure a shared
machine's load does not inflate); "new/kept" counts the meshes solved against those carried over. "fresh s" is a
fresh ``auto_plan`` of the same cluster (trace and every ILP, as a new workbench would plan it), and "same" says whether both plans agree to the
bit (stages, microbatches, step time).

With ``--model llama3-405b@2048`` (or another row of ``bench_plan_time.TODAY``, issue 36 item 3) the session is
that model on that many hosts of its preset, planned as bench_plan_time plans it, and the what-ifs are the hosts
halved and doubled and the inter-host bandwidth x0.1 and x10. Arguments such as ``hosts=1024`` run only those
what-ifs (their names as printed).

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_whatif.py [--no-fresh] [--model llama3-405b@2048] [hosts=32 ...]
"""

from __future__ import annotations

import os
import sys
import time

import autopar_lab as al
from autopar_lab.pricing.table_pool import default_workers
from autopar_lab.widgets.session import Session

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_plan_time import BLOCK_S, config, timed_blocks  # noqa: E402  (one StageBlock timer for both benchmarks)


def model():
    return al.models.get("gpt-39b", num_layers=48, hidden_size=8192, num_heads=64, seq_len=2048, batch_size=1536)


def what_ifs(c: al.Cluster) -> dict[str, dict]:
    """The slider moves a user tries, as changes for ``Cluster.with_``."""
    return {"hosts=32": dict(hosts=32), "hosts=128": dict(hosts=128), "hosts=63": dict(hosts=63),
            "hosts=65": dict(hosts=65),
            "inter x0.1": dict(inter_host_bandwidth=c.inter_host.bandwidth * 0.1),
            "inter x10": dict(inter_host_bandwidth=c.inter_host.bandwidth * 10),
            "intra x0.5": dict(intra_host_bandwidth=c.intra_host.bandwidth * 0.5)}


def scaled_what_ifs(c: al.Cluster) -> dict[str, dict]:
    """The what-ifs of today's largest runs: hosts halved and doubled, the inter-host network 10x slower or faster."""
    return {f"hosts={c.hosts // 2}": dict(hosts=c.hosts // 2), f"hosts={c.hosts * 2}": dict(hosts=c.hosts * 2),
            "inter x0.1": dict(inter_host_bandwidth=c.inter_host.bandwidth * 0.1),
            "inter x10": dict(inter_host_bandwidth=c.inter_host.bandwidth * 10)}


def signature(plan) -> tuple:
    return (tuple((st.layers, tuple(st.submesh), tuple(st.logical_mesh), st.remat) for st in plan.stages),
            plan.microbatches, plan.cost.step_time_s)


def main(argv: list[str]) -> None:
    fresh = "--no-fresh" not in argv
    row = argv[argv.index("--model") + 1] if "--model" in argv else None
    only = [a for a in argv if not a.startswith("--") and a != row]
    timed_blocks()
    if row is None:
        label, build, cluster, solver, moves = "GPT-39B", model, al.Cluster.preset("dgx-a100", hosts=64), "highs", \
            what_ifs
    else:
        label, _, cluster, solver = config(row)
        build, moves = (lambda: config(row)[1]), scaled_what_ifs
    t0 = time.perf_counter()
    spec = build()
    table = al.CostTable.build(spec, cluster, workers=default_workers(), solver=solver)
    plan = al.auto_plan(table.graph, cluster, table=table, solver=solver)
    t_start = time.perf_counter() - t0
    session = Session(plan, model=spec)
    print(f"{label} on {cluster.num_devices} GPUs: planned in {t_start:.1f} s ({len(table.planned_meshes())} meshes):"
          f" {len(plan.stages)} stages, {plan.microbatches} microbatches, step {plan.cost.step_time_s:.4f} s; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'what-if':>12}{'re-plan s':>11}{'cpu s':>7}{'ilp s':>8}{'table s':>9}{'dp s':>7}{'new/kept':>10}"
          f"{'fresh s':>9}{'speedup':>9}{'same':>6}{'stages':>8}{'mb':>6}{'step s':>9}{'load':>6}", flush=True)
    for name, changes in moves(cluster).items():
        if only and name not in only:
            continue
        new_cluster = cluster.with_(**changes)
        BLOCK_S[0] = 0.0
        t0, c0 = time.perf_counter(), time.process_time()
        after = session.set_cluster(new_cluster)
        t_re, c_re = time.perf_counter() - t0, time.process_time() - c0
        t_block = BLOCK_S[0]
        moved = after.table
        ilp = moved.solve_s
        kept = sum(1 for k in moved.planned_meshes() if k in moved.kept_meshes) if hasattr(moved, "kept_meshes") \
            else -1
        solved = len(moved.planned_meshes()) + len(moved.lean_solved()) - max(kept, 0)
        session.undo()
        t_fresh, same = float("nan"), "-"
        if fresh:
            t0 = time.perf_counter()
            ref = al.auto_plan(build(), new_cluster, solver=solver)
            t_fresh = time.perf_counter() - t0
            same = "yes" if signature(ref) == signature(after) else "NO"
        print(f"{name:>12}{t_re:>11.1f}{c_re:>7.1f}{ilp:>8.1f}{t_block:>9.1f}{t_re - ilp - t_block:>7.1f}"
              f"{f'{solved}/{kept}':>10}{t_fresh:>9.1f}{t_fresh / t_re:>8.1f}x{same:>6}{len(after.stages):>8}"
              f"{after.microbatches:>6}{after.cost.step_time_s:>9.4f}{os.getloadavg()[0]:>6.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
