"""Benchmark (issue 14): the cost model against published training runs.

Every row of the Megatron-LM weak-scaling table (Narayanan et al., SC21; ``shared/reference/published-measurements.md``)
planned in its published layout and priced by the library: predicted TFLOP/s per GPU and peak memory per device
beside the published figure, the ratio per row, the median and the worst.

The published layout, as the paper ran it:

* the zoo's GPT (``gpt-tiny`` reshaped: the row's hidden size, layers and heads, sequence 2048, vocabulary 51,200),
  float16 in mixed precision (fp32 master weights and Adam moments), the published global batch;
* the ``dgx-a100`` cluster of the row's GPU count (8 per host);
* ``p`` pipeline stages of ``l / p`` transformer layers each, the embedding with the first and the head with the
  last; each stage on ``d x t`` GPUs viewed as a (d, t) logical mesh (tensor parallelism inside a host);
* Megatron-LM's tensor-parallel sharding, pinned by the library (``al.megatron_plan``, issue 31:
  :mod:`autopar_lab.layouts`): qkv and the first MLP matmul split by columns, the attention projection and the
  second MLP matmul by rows (one all-reduce each, forward and backward), attention split by heads, the embedding and
  the head split by vocabulary; parameters and Adam state sharded only by ``t`` (``zero=0``: no distributed
  optimizer in 2021); the intra-op ILP decides everything else around the pins;
* full activation recomputation (``remat``); one stage: 1F1B; the pipelined rows (39B, 145B, 530B): the interleaved
  1F1B schedule they ran, with ``v`` model chunks per stage (:func:`virtual_stages`: the paper does not give ``v``;
  the smallest divisor above 1 of the layers per stage is assumed: 2, 2 and 3); ``--no-interleave`` prices plain
  1F1B instead (the nearest plan before the planner had the interleaved schedule);
* attention as matmuls and a fused softmax through memory (Megatron-LM of 2021 had no flash attention; the
  ``dgx-a100`` preset's default would price flash attention: ``--flash`` shows those figures too).

Assumed where the paper leaves it out: microbatch size 1 (``B / d`` microbatches per step); no dropout (the zoo's GPT
has none; Megatron-LM trained with attention and hidden dropout 0.1); the interleaving factor (above). Not priced:
data loading, logging.

TFLOP/s per GPU counts the published formula's FLOPs, recomputation included: F = 96 B s l h^2 (1 + s / (6 h)
+ V / (16 l h)); predicted TFLOP/s = F / (predicted step time x GPUs).

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_fidelity.py [--rows 1.7B,7.5B] [--flash] [--no-interleave] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# name, heads, hidden, layers, tensor t, pipeline p, GPUs, global batch, published TFLOP/s per GPU
ROWS = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
]
SEQ, VOCAB = 2048, 51200
GIB = 2**30


def published_flops(B: int, s: int, l: int, h: int, V: int) -> float:  # noqa: E741  (the paper's symbols)
    """F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)): the published count per step, recomputation included.

    >>> round(published_flops(512, 2048, 24, 2304, 51200) / 1e15, 2)
    15.47
    """
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def virtual_stages(layers_per_stage: int) -> int:
    """The interleaving factor assumed for a pipelined row: the smallest divisor above 1 of its transformer layers per
    stage (Megatron-LM needs equal chunks; the paper does not say which ``v`` each row ran).

    >>> [virtual_stages(n) for n in (24, 10, 3)]
    [2, 2, 3]
    """
    return next(v for v in range(2, layers_per_stage + 1) if layers_per_stage % v == 0)


def published_plan(name: str, *, flash: bool = False, micro: int = 1, table=None, interleave: bool = True):
    """(plan, model, GPUs, published TFLOP/s, FLOPs per step) of one row in its published layout (pipelined rows
    interleaved unless ``interleave`` is False), priced through the public API: ``al.megatron_plan`` with the row's
    degrees, Megatron-LM's sharding pinned by the library, the state stored whole over the data-parallel group
    (``zero=0``: SC21 ran without the distributed optimizer), full recomputation, ``micro`` sequences a microbatch."""
    import autopar_lab as al
    from autopar_lab.pricing import CostTable

    _, a, h, l, t, p, gpus, B, pub = next(r for r in ROWS if r[0] == name)  # noqa: E741
    d = gpus // (t * p)
    model = al.models.get("gpt-tiny", seq_len=SEQ, hidden_size=h, num_layers=l, num_heads=a, vocab_size=VOCAB,
                          batch_size=B, dtype="float16")
    cluster = al.Cluster.preset("dgx-a100", hosts=gpus // 8).with_(flash_attention=flash)
    table = table or CostTable.build(model, cluster)
    sched = dict(schedule="interleaved", virtual_stages=virtual_stages(l // p)) if p > 1 and interleave else {}
    plan = al.megatron_plan(table=table, dp=d, tp=t, pp=p, micro_batch_size=micro, remat=True, zero=0, **sched)
    return plan, model, gpus, pub, published_flops(B, SEQ, l, h, VOCAB)


def row(name: str, flash: bool = False, micro: int = 1, interleave: bool = True) -> dict:
    from autopar_lab.pricing.memory import PARTS, memory_breakdown

    t0 = time.perf_counter()
    plan, model, gpus, pub, F = published_plan(name, flash=flash, micro=micro, interleave=interleave)
    step = plan.cost.step_time_s
    tflops = F / (step * gpus) / 1e12
    mem = memory_breakdown(plan)
    peak = max(mem, key=lambda r: r["total_bytes"])
    c = plan.cost
    return {"row": name, "gpus": gpus, "published_tflops": pub, "predicted_tflops": tflops, "ratio": tflops / pub,
            "schedule": plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""),
            "step_s": step, "published_step_s": F / (pub * 1e12 * gpus), "microbatches": plan.microbatches,
            "compute_s": c.compute_s, "comm_s": c.comm_s, "reshard_s": c.reshard_s, "bubble_s": c.bubble_s,
            "hidden_comm_s": c.hidden_comm_s, "kernels": c.kernels, "flash_attention": flash,
            "peak_mem_gib": peak["total_bytes"] / GIB, "fits": c.fits, "limit_gib": c.mem_limit_bytes / GIB,
            "peak_stage": peak["stage"], "peak_parts_gib": {p: peak[p] / GIB for p in PARTS},
            "microbatches_in_flight": peak["microbatches_in_flight"], "seconds": time.perf_counter() - t0}


def summary(rows: list[dict]) -> dict:
    err = [abs(r["ratio"] - 1) for r in rows]
    return {"median_abs_err": statistics.median(err), "worst_abs_err": max(err),
            "worst_row": rows[err.index(max(err))]["row"], "all_fit": all(r["fits"] for r in rows)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(r[0] for r in ROWS), help="comma-separated row names")
    ap.add_argument("--flash", action="store_true", help="also price each row with flash attention (informative)")
    ap.add_argument("--micro", type=int, default=1, help="microbatch size (samples per microbatch per replica)")
    ap.add_argument("--no-interleave", action="store_true",
                    help="price the pipelined rows with plain 1F1B (the nearest plan without interleaving)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    inter = not args.no_interleave
    rows = [row(n, micro=args.micro, interleave=inter) for n in names]
    out = {"rows": rows, **summary(rows), "micro": args.micro}
    if args.flash:
        out["flash"] = [row(n, flash=True, micro=args.micro, interleave=inter) for n in names]
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    print("| row | GPUs | schedule | published TFLOP/s | predicted | pred / pub | step s (pub) | peak GiB (stage) | fits in 80 GiB |"
          " peak stage: params + grads + master + optimizer + copies + buffers + recompute + activations GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        parts = " + ".join(f"{v:.1f}" for v in r["peak_parts_gib"].values())
        print(f"| {r['row']} | {r['gpus']} | {r['schedule']} | {r['published_tflops']} | {r['predicted_tflops']:.1f} | {r['ratio']:.3f} "
              f"| {r['step_s']:.2f} ({r['published_step_s']:.2f}) | {r['peak_mem_gib']:.1f} (S{r['peak_stage']}, "
              f"{r['microbatches_in_flight']} in flight) | {'yes' if r['fits'] else 'NO'} | {parts} |")
    print(f"median |pred/pub - 1| = {out['median_abs_err']:.1%}, worst {out['worst_abs_err']:.1%} "
          f"({out['worst_row']}); every layout fits: {out['all_fit']}")
    for r in rows:
        print(f"  {r['row']}: compute {r['compute_s']:.2f} s + collectives {r['comm_s']:.2f} s + resharding "
              f"{r['reshard_s']:.2f} s + bubble {r['bubble_s']:.2f} s; {r['hidden_comm_s']:.3f} s hidden; "
              f"{r['kernels']:,} kernels; {r['seconds']:.0f} s to price")
    if args.flash:
        for r in out["flash"]:
            print(f"  with flash attention: {r['row']} {r['predicted_tflops']:.1f} TFLOP/s ({r['ratio']:.3f} of the "
                  f"published run, which had none), peak {r['peak_mem_gib']:.1f} GiB")
    return out


if __name__ == "__main__":
    main()
