"""GPU check (issue 31 item 5): what one H100 or H200 machine measures, beside what its preset predicts.

One prepared script, one short call (well under 5 minutes on a GPU), for whenever an H100 or H200 is at hand:

* **GEMM sweep**: bf16 matmuls of a few shapes (a square one, Llama 3 8B's MLP and attention projections at 8,192
  tokens, the MAMF shape the presets' matmul efficiency was measured at), each timed as the median of several runs,
  beside :meth:`Device.matmul_rate <autopar_lab.cluster.Device.matmul_rate>` (peak x efficiency x wave and
  inner-dimension fractions) plus one kernel launch;
* **flash attention**: ``jax.nn.dot_product_attention`` (cuDNN's fused kernel where JAX has it, ``implementation=
  "cudnn"``; XLA's otherwise), causal, forward and forward + backward, beside the FLOPs it runs (half the square,
  causal) over :meth:`Device.attention_rate` (the backward runs 2.5x the forward's FLOPs: its five matmuls against
  two, the scores recomputed);
* **collectives** across the machine's devices (all-reduce, all-gather, reduce-scatter, all-to-all of one buffer,
  through ``jax.shard_map`` and ``jax.lax``), beside :class:`LogicalMesh <autopar_lab.cluster.LogicalMesh>`'s
  formula on one host of the preset; on a machine with one device there is nothing to exchange: the rows say so;
* **a small Llama step**: a few-layer Llama 3 8B (``llama3-8b`` with 2 layers, sequence 2,048, batch 2) trained one
  step on one device, beside ``al.data_parallel_plan`` of the same model on one device of the preset.

The preset follows the device's name (``dgx-h200`` for an H200, else ``dgx-h100``; ``--preset`` overrides it). On a
machine without a GPU (or with ``--dry-run``) the same code runs on the CPU devices at tiny sizes and prints what it
would compare: the measured column is then the CPU's, and only the table's rows and the predictions mean anything.

    python bench/gpu_check.py                 # on a GPU machine: the real sizes
    JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=8 python bench/gpu_check.py --dry-run [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

#: The collectives timed, by the cost model's names.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Sizes:
    """What each check runs: the real sizes on a GPU, tiny ones for the CPU dry run (the same code path)."""

    gemms: tuple[tuple[int, int, int], ...]  # (m, n, k)
    attention: tuple[int, int, int, int]  # (batch, sequence, heads, head dim)
    collective_bytes: int  # the full buffer, bytes
    llama: dict  # al.models.get("llama3-8b", **llama)
    repeats: int


GPU_SIZES = Sizes(
    gemms=((8192, 8192, 8192), (8192, 14336, 4096), (8192, 4096, 14336), (8192, 6144, 4096), (2048, 2048, 13312)),
    attention=(4, 4096, 32, 128), collective_bytes=256 * 2**20,
    llama=dict(num_layers=2, seq_len=2048, batch_size=2), repeats=10)
DRY_SIZES = Sizes(
    gemms=((256, 256, 256), (128, 448, 128), (128, 128, 448)), attention=(1, 128, 2, 32), collective_bytes=2**16,
    llama=dict(num_layers=1, seq_len=32, batch_size=2, hidden_size=64, ffn_hidden=128, num_heads=4, num_kv_heads=2,
               vocab_size=256),
    repeats=2)


def preset_for(device_kind: str) -> str:
    """The preset a device's name calls for: ``dgx-h200`` for an H200, else ``dgx-h100``.

    >>> preset_for("NVIDIA H200"), preset_for("NVIDIA H100 80GB HBM3"), preset_for("cpu")
    ('dgx-h200', 'dgx-h100', 'dgx-h100')
    """
    return "dgx-h200" if "h200" in device_kind.lower() else "dgx-h100"


def timed(fn, *args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` over ``repeats`` runs after one warm-up (compilation) run."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_rows(sizes: Sizes, device) -> list[dict]:
    import jax
    import jax.numpy as jnp

    mm = jax.jit(lambda a, b: a @ b)
    rows = []
    for m, n, k in sizes.gemms:
        a = jnp.ones((m, k), jnp.bfloat16)
        b = jnp.ones((k, n), jnp.bfloat16)
        s = timed(mm, a, b, repeats=sizes.repeats)
        flops = 2.0 * m * n * k
        pred = flops / device.matmul_rate("bfloat16", m, n, k) + device.efficiency.kernel_launch_s
        rows.append({"check": "gemm", "shape": f"{m}x{n}x{k} bf16", "measured_s": s, "predicted_s": pred,
                     "measured_tflops": flops / s / 1e12, "predicted_tflops": flops / pred / 1e12})
    return rows


def attention_rows(sizes: Sizes, device, on_gpu: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    B, S, H, D = sizes.attention
    impl = "cudnn" if on_gpu else None
    q = jnp.ones((B, S, H, D), jnp.bfloat16) * 0.01

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    try:
        fwd = jax.jit(attend)
        fwd(q, q, q)
    except Exception:  # noqa: BLE001 - no cuDNN kernel for this shape or build: XLA's
        impl = "xla"
        fwd = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    grad = jax.jit(jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    flops = 4.0 * B * S * S * H * D / 2  # QK^T and PV, causal: half the square
    rate = device.attention_rate("bfloat16")
    rows = []
    for label, fn, mult in (("forward", fwd, 1.0), ("forward + backward", grad, 3.5)):
        s = timed(fn, q, q, q, repeats=sizes.repeats)
        pred = mult * flops / rate
        rows.append({"check": "attention", "shape": f"{label}, b{B} s{S} h{H} d{D} causal ({impl or 'xla'})",
                     "measured_s": s, "predicted_s": pred, "measured_tflops": mult * flops / s / 1e12,
                     "predicted_tflops": mult * flops / pred / 1e12})
    return rows


def collective_rows(sizes: Sizes, cluster) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devs = jax.devices()
    n = len(devs)
    B = sizes.collective_bytes
    if n == 1:
        return [{"check": "collective", "shape": f"{kind}, 1 device", "measured_s": None, "predicted_s": 0.0,
                 "note": "one device: nothing to exchange"} for kind in COLLECTIVES]
    mesh = Mesh(np.array(devs), ("d",))
    elems = B // 4 // (n * n) * (n * n)  # float32, divisible by n^2 for the all-to-all's pieces
    full = jax.device_put(jnp.ones((elems,), jnp.float32), NamedSharding(mesh, P("d")))

    def shard(body, out):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=out))

    # Each program's input is its device's 1/n of the buffer; B = bytes of the full buffer along the axis, as the
    # cost model counts: the all-reduce and the reduce-scatter reduce B bytes per device, the all-gather assembles B.
    progs = {
        "all_reduce": (shard(lambda x: jax.lax.psum(jnp.tile(x, n), "d"), P("d")), elems * 4),
        "all_gather": (shard(lambda x: jax.lax.all_gather(x, "d", tiled=True), P("d")), elems * 4),
        "reduce_scatter": (shard(lambda x: jax.lax.psum_scatter(jnp.tile(x, n), "d", tiled=True), P("d")),
                           elems * 4),
        "all_to_all": (shard(lambda x: jax.lax.all_to_all(x, "d", 0, 0, tiled=True), P("d")), elems * 4 // n),
    }
    mesh_model = cluster.with_(devices_per_host=n).logical_mesh((1, n), (1, n))
    rows = []
    for kind in COLLECTIVES:
        fn, nbytes = progs[kind]
        s = timed(fn, full, repeats=sizes.repeats)
        pred = getattr(mesh_model, kind)(float(nbytes), 1)
        rows.append({"check": "collective", "shape": f"{kind}, {nbytes / 2**20:.3g} MiB over {n} devices",
                     "measured_s": s, "predicted_s": pred})
    return rows


def llama_rows(sizes: Sizes, cluster) -> list[dict]:
    import jax

    import autopar_lab as al

    model = al.models.get("llama3-8b", **sizes.llama)
    args = model.init_fn(0)
    step = jax.jit(model.step_fn)

    def run(*a):
        return step(*a)

    s = timed(run, *args, repeats=max(sizes.repeats // 2, 1))
    plan = al.data_parallel_plan(model, cluster.with_(devices_per_host=1))
    cfg = model.config
    return [{"check": "llama step", "shape": f"llama3-8b x{cfg.num_layers} layers, s{cfg.seq_len} b{cfg.batch_size}, "
                                             "1 device", "measured_s": s, "predicted_s": plan.cost.step_time_s}]


def check(dry_run: bool | None = None, preset: str | None = None) -> dict:
    """Every row: ``{check, shape, measured_s, predicted_s, ...}``; ``dry_run`` None: on CPU devices only."""
    import jax

    import autopar_lab as al

    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    dry = (not on_gpu) if dry_run is None else bool(dry_run)
    sizes = DRY_SIZES if dry else GPU_SIZES
    name = preset or preset_for(getattr(dev, "device_kind", ""))
    cluster = al.Cluster.preset(name)
    device = cluster.device
    t0 = time.perf_counter()
    rows = [*gemm_rows(sizes, device), *attention_rows(sizes, device, on_gpu), *collective_rows(sizes, cluster),
            *llama_rows(sizes, cluster)]
    for r in rows:
        m, p = r.get("measured_s"), r.get("predicted_s")
        r["measured_over_predicted"] = m / p if m is not None and p else None
    return {"device": getattr(dev, "device_kind", dev.platform), "devices": jax.device_count(), "preset": name,
            "dry_run": dry, "rows": rows, "seconds": time.perf_counter() - t0}


def fmt_s(x) -> str:
    return "-" if x is None else f"{x * 1e3:.3f} ms"


def table(out: dict) -> str:
    lines = [f"device: {out['device']} x {out['devices']}; preset: {out['preset']}"
             + (" (dry run: CPU timings, tiny sizes; the predictions are the preset's)" if out["dry_run"] else ""),
             "| check | shape | measured | predicted | measured / predicted |", "|---|---|---|---|---|"]
    for r in out["rows"]:
        ratio = r["measured_over_predicted"]
        lines.append(f"| {r['check']} | {r['shape']} | {fmt_s(r['measured_s'])} | {fmt_s(r['predicted_s'])} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    lines.append(f"{len(out['rows'])} rows in {out['seconds']:.1f} s")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on whatever devices JAX has (CPU: automatic)")
    ap.add_argument("--preset", choices=("dgx-h100", "dgx-h200"), help="the preset to compare with (default: by "
                    "the device's name)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = check(True if args.dry_run else None, args.preset)
    print(json.dumps(out, indent=1) if args.json else table(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
