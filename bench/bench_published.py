"""Benchmark (issue 17): the auto plan against the published Megatron-LM layouts, both priced by the same model.

Each row of the Megatron-LM weak-scaling table (``shared/reference/published-measurements.md``) that
``bench_fidelity.py`` prices is planned twice on one cost table (the zoo's GPT at the row's size on ``dgx-a100``
hosts, as there):

* **published**: the row's layout exactly as ``bench_fidelity.published_plan`` builds it (``p`` equal stages on
  ``d x t`` GPUs, Megatron-LM's tensor-parallel sharding pinned, full recomputation, ``B / d`` microbatches,
  interleaved for the pipelined rows);
* **auto**: ``auto_plan(schedule="auto")``: the stage DP over stages, submeshes, logical meshes, remat and the
  microbatch count, for 1F1B, interleaved (v = 2, 4) and ZB-H1 each, the fastest kept; the intra-op ILP of every
  mesh free to choose the operators' shardings (ZeRO-2/3 / FSDP, sequence parallelism and the rest of its space).

The table says the predicted step and TFLOP/s per GPU of both, auto's speedup, and what auto changed: stages and their
meshes (the published ``d, t`` is a ``(d, t)`` logical mesh), microbatches, schedule, remat, and the stages where the
ILP chose FSDP (parameters stored sharded and gathered) or sequence parallelism.

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_published.py [--rows 1.7B,7.5B] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_fidelity as fidelity  # noqa: E402  (the published layouts, one definition)

DEFAULT_ROWS = ("1.7B", "7.5B", "39B")  # 145B and 530B plan at 1,536 and 2,520 GPUs: pass --rows to include them


def describe(plan) -> dict:
    """What a plan decides, in the terms of the table: stages, meshes, microbatches, schedule, remat, FSDP, SP."""
    from autopar_lab.parallelism import fsdp_params, seqpar_regions

    meshes: dict[str, int] = {}
    for st in plan.stages:
        key = f"{st.submesh[0] * st.submesh[1]} GPUs as {tuple(st.logical_mesh)}"
        meshes[key] = meshes.get(key, 0) + 1
    fsdp = sorted(k for k, ps in fsdp_params(plan).items() if ps)
    sp = sorted(k for k, rs in seqpar_regions(plan).items() if rs)
    return {
        "stages": len(plan.stages),
        "meshes": ", ".join(f"{n} x {k}" for k, n in meshes.items()),
        "layers": [list(st.layers) for st in plan.stages],
        "microbatches": plan.microbatches,
        "schedule": plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""),
        "remat": sum(bool(st.remat) for st in plan.stages),
        "fsdp_stages": len(fsdp),
        "sp_stages": len(sp),
    }


def changes(pub: dict, auto: dict) -> str:
    """One line: what auto decided differently from the published layout."""
    out = []
    if (pub["stages"], pub["meshes"]) != (auto["stages"], auto["meshes"]):
        out.append(f"{pub['stages']} stage(s) of {pub['meshes'].split(' x ', 1)[1]} -> {auto['stages']} stage(s): "
                   f"{auto['meshes']}")
    if pub["microbatches"] != auto["microbatches"]:
        out.append(f"{pub['microbatches']} -> {auto['microbatches']} microbatches")
    if pub["schedule"] != auto["schedule"]:
        out.append(f"{pub['schedule']} -> {auto['schedule']}")
    if pub["remat"] != auto["remat"]:
        out.append(f"remat on {pub['remat']} -> {auto['remat']} of the stages")
    for key, what in (("fsdp_stages", "FSDP"), ("sp_stages", "sequence parallelism")):
        if pub[key] != auto[key]:
            out.append(f"{what} on {pub[key]} -> {auto[key]} stage(s)")
    return "; ".join(out) or "nothing"


def row(name: str) -> dict:
    import autopar_lab as al

    t0 = time.perf_counter()
    pub, model, gpus, published_tflops, F = fidelity.published_plan(name)
    t1 = time.perf_counter()
    auto = al.auto_plan(model, pub.table.cluster, schedule="auto", table=pub.table)
    t2 = time.perf_counter()
    p, a = describe(pub), describe(auto)
    step_p, step_a = pub.cost.step_time_s, auto.cost.step_time_s
    return {"row": name, "gpus": gpus, "published_tflops": published_tflops,
            "published_step_s": step_p, "published_pred_tflops": F / (step_p * gpus) / 1e12,
            "auto_step_s": step_a, "auto_pred_tflops": F / (step_a * gpus) / 1e12, "speedup": step_p / step_a,
            "auto_fits": auto.cost.fits, "published": p, "auto": a, "changed": changes(p, a),
            "schedules_tried": auto.notes[-1] if auto.notes else "", "price_s": t1 - t0, "plan_s": t2 - t1}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated row names")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in [r[0] for r in fidelity.ROWS]]
    if unknown:
        ap.error(f"unknown row {unknown[0]!r}; the rows are {', '.join(r[0] for r in fidelity.ROWS)}")
    rows = []
    for n in names:
        rows.append(row(n))
        if not args.json:
            print(f"# {n} done: {rows[-1]['plan_s']:.0f} s to plan", file=sys.stderr, flush=True)
    out = {"rows": rows, "auto_at_least_as_fast": all(r["speedup"] >= 1 - 1e-9 for r in rows)}
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    print("| row | GPUs | published layout (predicted step s, TFLOP/s) | auto (step s, TFLOP/s) | speedup | what auto "
          "changed | plan s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["published"]
        print(f"| {r['row']} | {r['gpus']} | {p['stages']} x {p['meshes'].split(' x ', 1)[1]}, {p['microbatches']} mb, "
              f"{p['schedule']} ({r['published_step_s']:.3f} s, {r['published_pred_tflops']:.0f}) | "
              f"{r['auto_step_s']:.3f} s, {r['auto_pred_tflops']:.0f}{'' if r['auto_fits'] else ' (DOES NOT FIT)'} | "
              f"{r['speedup']:.2f}x | {r['changed']} | {r['plan_s']:.0f} |")
    for r in rows:
        print(f"  {r['row']}: {r['schedules_tried']}")
    print(f"auto at least as fast as the published layout on every row: {out['auto_at_least_as_fast']}")
    return out


if __name__ == "__main__":
    main()
