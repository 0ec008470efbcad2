"""Benchmark: planning time as models and clusters grow (the seed's open question 5; issue 16: thousands of GPUs).

Two kinds of rows, each `auto_plan` with the microbatch count searched, split into trace, intra-op (the ILPs of every
planned logical mesh) and inter-op (the stage DP):

- ``L:D[:solver]``: GPT-39B's layer shape (H 8192, 64 heads, S 1024, V 51200, batch 1024) with L layers on
  p3.16xlarge hosts (D devices), the growth table of earlier rounds; ``48:64`` is Alpa's GPT-39B case.
- Megatron-LM's published sizes on DGX A100 hosts (``../shared/reference/published-measurements.md``, s 2048,
  V 51200): ``39b@512`` (48 layers, H 8192, 64 heads, batch 1536), ``145b@1536`` (80, 12288, 96, 2304),
  ``530b@2520`` (105, 20480, 128, 2520), ``1t@3072`` (128, 25600, 160, 3072).

"trace s" is what `CostTable.build` spent tracing (a deep zoo model's 4- and 6-layer copies, its full graph traced
only when read: `--trace full` traces it up front as before, `pricing/deepmap.py`); "table s" the part of "inter s"
spent building the stage candidates' arrays (`StageBlock`), "dp s" the rest (the stage DP, the simulation).
"meshes" counts the logical meshes the table solves (the planning space, `CostTable.planned_meshes`), "lean" those
whose memory-lean solution was solved too (`CostTable.lean_solved`: where the fast one cannot hold a layer, or all
when nothing fits without them); "cpu s" is
this process's CPU time and "workers cpu s" the ILP worker processes'; "peak GiB" the largest resident set of this
process and of any worker (getrusage); "load" the machine's 1-minute load average before and after the row.

- Today's largest runs (issue 36), each followed by a line with the plan found and one with the published layout
  priced on the same table (``al.megatron_plan``): ``llama3-405b@2048`` (sequence 8,192, batch 2,048 sequences,
  bf16, on 2,048 DGX H100 hosts; published TP 8 (sequence-parallel) x PP 16 x DP 128, 16 microbatches,
  interleaved, ZeRO-2-like:
  the Llama 3 paper's Table 4 at 16,384 GPUs) and ``deepseek-v3@256`` (sequence 4,096, batch 15,360, on 256 H800
  hosts; published PP 16 x EP 64 x DP 128, microbatch 1, its DualPipe priced as ZB-H1; EP priced as 128, over the
  stage's whole data-parallel group: a Megatron layout's (128, 1) mesh has no axis of 64). Both plan in the "scale"
  space by default (``pricing.table.scale_space``); ``llama3-405b@64`` and the like plan the same models on
  fewer hosts (the published layout then left out).

    .venv/bin/python bench/bench_plan_time.py 48:64 39b@512 1t@3072 llama3-405b@2048 [--workers N]
        [--space full|divisors|scale|auto] [--trace auto|full]
"""

from __future__ import annotations

import os
import resource
import sys
import time

import autopar_lab as al
from autopar_lab.pricing import table as table_module
from autopar_lab.pricing.table_pool import default_workers

#: Seconds spent building StageBlocks (the stage candidates' arrays) in this process, summed.
BLOCK_S = [0.0]


def timed_blocks() -> None:
    """Count the time spent building each StageBlock into BLOCK_S."""
    init = table_module.StageBlock.__init__

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            init(self, *args, **kwargs)
        finally:
            BLOCK_S[0] += time.perf_counter() - t0

    table_module.StageBlock.__init__ = timed  # type: ignore[method-assign]

MEGATRON = {  # name: (devices, layers, hidden, heads, batch)
    "39b": (512, 48, 8192, 64, 1536),
    "145b": (1536, 80, 12288, 96, 2304),
    "530b": (2520, 105, 20480, 128, 2520),
    "1t": (3072, 128, 25600, 160, 3072),
}


TODAY = {  # name: (preset, model keywords, published megatron_plan keywords at its published host count)
    "llama3-405b": ("dgx-h100", dict(seq_len=8192, batch_size=2048),
                    (2048, dict(dp=128, tp=8, pp=16, microbatches=16, schedule="interleaved", zero=2,
                                sequence_parallel=True))),
    "deepseek-v3": ("h800", dict(seq_len=4096, batch_size=15360),
                    (256, dict(dp=128, tp=1, pp=16, ep=128, microbatches=120, schedule="zb-h1"))),
}


def config(item: str):
    """(label, model, cluster, solver) of one row."""
    name = item.split("@")[0]
    if name in TODAY:
        preset, kw, _ = TODAY[name]
        return name, al.models.get(name, **kw), al.Cluster.parse(f"{preset}:{item.split('@')[1]}"), "highs"
    if "@" in item:
        name, devices = item.split("@")
        _, layers, hidden, heads, batch = MEGATRON[name]
        model = al.models.get("gpt-39b", num_layers=layers, hidden_size=hidden, num_heads=heads, seq_len=2048,
                              batch_size=batch)
        return f"{name} ({layers})", model, al.Cluster.preset("dgx-a100", hosts=int(devices) // 8), "highs"
    parts = item.split(":")
    layers, devices = int(parts[0]), int(parts[1])
    cluster = (al.Cluster.preset("p3.16xlarge", hosts=devices // 8) if devices >= 8
               else al.Cluster.preset("p3.16xlarge").with_(devices_per_host=devices))
    return f"{layers}", al.models.get("gpt-39b", num_layers=layers), cluster, parts[2] if len(parts) > 2 else "highs"


def main(argv: list[str]) -> None:
    workers = space = None
    trace = "auto"
    items = []
    args = iter(argv)
    for a in args:
        if a == "--workers":
            workers = int(next(args))
        elif a == "--space":
            space = next(args)
        elif a == "--trace":
            trace = next(args)
        else:
            items.append(a)
    print(f"{'model':>10}{'devices':>8}{'meshes':>8}{'lean':>6}{'trace s':>9}{'intra s':>9}{'table s':>9}{'dp s':>7}{'total s':>9}"
          f"{'stages':>8}{'mb':>6}{'step s':>10}{'cpu s':>8}{'wk cpu s':>9}{'peak GiB':>9}{'load':>12}", flush=True)
    timed_blocks()
    for item in items or ["48:64", "39b@512"]:
        BLOCK_S[0] = 0.0
        label, model, cluster, solver = config(item)
        load0 = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        k0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        table = al.CostTable.build(model, cluster, solver=solver, space=space or "auto",
                                   workers=default_workers() if workers is None else workers, trace=trace)
        try:
            plan = al.auto_plan(table.graph, cluster, solver=solver, table=table, workers=workers)
        except ValueError as e:  # the model does not fit: the search still ran to the end
            print(f"{label:>10}{cluster.num_devices:>8}   no plan ({time.perf_counter() - t0:.1f} s): {str(e)[:70]}",
                  flush=True)
            continue
        total = time.perf_counter() - t0
        k1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        s = plan.solve_s
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, k1.ru_maxrss) / 2 ** 20
        print(f"{label:>10}{cluster.num_devices:>8}{len(table.planned_meshes()):>8}{len(table.lean_solved()):>6}"
              f"{table.trace_s:>9.1f}"
              f"{s['intra']:>9.1f}{BLOCK_S[0]:>9.1f}{s['inter'] - BLOCK_S[0]:>7.1f}{total:>9.1f}{len(plan.stages):>8}{plan.microbatches:>6}"
              f"{plan.cost.step_time_s:>10.4g}{time.process_time() - c0:>8.1f}"
              f"{(k1.ru_utime + k1.ru_stime) - (k0.ru_utime + k0.ru_stime):>9.1f}{peak:>9.2f}"
              f"{f'{load0:.1f}->{os.getloadavg()[0]:.1f}':>12}", flush=True)
        name = item.split("@")[0]
        if name in TODAY:
            print(f"    auto: {describe(plan)}", flush=True)
            hosts, kw = TODAY[name][2]
            if cluster.hosts == hosts:
                t1 = time.perf_counter()
                try:
                    pub = al.megatron_plan(table=table, **kw)
                    print(f"    published {kw}: {describe(pub)} ({time.perf_counter() - t1:.1f} s)", flush=True)
                except ValueError as e:
                    print(f"    published {kw}: not priced: {e}", flush=True)


def describe(plan) -> str:
    """The plan's stages (meshes and how many), microbatches, schedule, predicted step and largest stage memory."""
    meshes: dict[str, int] = {}
    for st in plan.stages:
        key = f"{st.submesh[0] * st.submesh[1]} GPUs as {tuple(st.logical_mesh)}{', remat' if st.remat else ''}"
        meshes[key] = meshes.get(key, 0) + 1
    sched = plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    mem = max(plan.cost.peak_mem_bytes) / 2 ** 30
    return (f"{len(plan.stages)} stages ({'; '.join(f'{n} x {k}' for k, n in meshes.items())}), "
            f"{plan.microbatches} mb, {sched}, step {plan.cost.step_time_s:.4g} s, peak {mem:.1f} GiB of "
            f"{plan.cost.mem_limit_bytes / 2 ** 30:.0f}{'' if plan.cost.fits else ' (does not fit)'}")


if __name__ == "__main__":
    main(sys.argv[1:])
