"""The whole profile of this machine's CPU devices (:func:`measure_cpu`): matmul and memory rates alone and with
every device busy, the collectives, the task, kernel and state-array overheads, the gradient chain's re-reads."""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path

import numpy as np

from ..cluster import CPU_PROFILE_KIND
from .collectives import BETWEEN_COMPUTE_NOTE, measure_collectives_between_compute
from .fits import ASSUMED_INTER_HOST, COLLECTIVE_FIT, fit_collectives
from .kernels import (CHAIN_DEPTHS, KERNEL_POINTS, QUICK_CHAIN_DEPTHS, QUICK_KERNEL_POINTS, measure_buffer_overhead,
                      measure_chain_reads, measure_kernel_overhead)
from .tasks import measure_task_overhead, per_device_task_overhead
from .timing import best_time, best_time_inplace

__all__ = ["REGENERATE", "total_memory_bytes", "measure_cpu"]


REGENERATE = ("JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu python -m autopar_lab.calibrate "
              "--out autopar_lab/profiles/cpu.json")


def total_memory_bytes() -> int:
    """Physical RAM, or the cgroup memory limit when a container sets a lower one."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return int(total)


def measure_cpu(num_devices: int | None = None, quick: bool = False) -> dict:
    """Measure the local JAX CPU devices; returns the profile dict (the form :func:`write_profile` stores).

    ``num_devices`` uses the first N CPU devices (default: all). ``quick`` uses smaller sizes and fewer
    repeats (a few seconds; for tests), the full run takes about a minute on a busy two-core machine.
    """
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    load0 = os.getloadavg()[0]
    all_cpu = jax.devices("cpu")
    n = len(all_cpu) if num_devices is None else int(num_devices)
    if not 1 <= n <= len(all_cpu):
        raise ValueError(
            f"num_devices={num_devices} but JAX exposes {len(all_cpu)} CPU devices; "
            "pass at most that many or set JAX_NUM_CPU_DEVICES before jax is imported."
        )
    devs = all_cpu[:n]
    mesh = Mesh(np.array(devs), ("d",))
    split = NamedSharding(mesh, P("d"))
    repeats = 3 if quick else 15
    rng = np.random.default_rng(0)

    # -- matmul FLOP/s ------------------------------------------------------------------------------
    matmul = jax.jit(lambda a, b: a @ b)
    sizes = (128, 256) if quick else (256, 512, 1024)
    mm_rows = []
    for k in sizes:
        a = jax.device_put(rng.standard_normal((k, k), dtype=np.float32), devs[0])
        single = 2 * k**3 / best_time(matmul, a, a, repeats=repeats)
        # One k x k product per device, all at once (batched matmul sharded on the batch axis).
        ab = jax.device_put(rng.standard_normal((n, k, k), dtype=np.float32), split)
        concurrent = 2 * k**3 / best_time(matmul, ab, ab, repeats=repeats)
        mm_rows.append({"size": k, "flops_single": single, "flops_concurrent_per_device": concurrent})
    peak_single = max(r["flops_single"] for r in mm_rows)
    peak_concurrent = max(r["flops_concurrent_per_device"] for r in mm_rows)

    # -- memory bandwidth ---------------------------------------------------------------------------
    add = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    elems = (1 << 20) if quick else (1 << 23)  # 4 MiB or 32 MiB of float32 per device: beyond the caches
    moved = 2 * 4 * elems  # read once, write once
    x1 = jax.device_put(np.ones(elems, np.float32), devs[0])
    bw_single = moved / best_time_inplace(add, x1, repeats=repeats)
    xn = jax.device_put(np.ones((n, elems), np.float32), split)
    bw_concurrent = moved / best_time_inplace(add, xn, repeats=repeats)

    # -- collective (all-reduce, all-gather) latency and bandwidth ------------------------------------
    coll_rows, fits = [], {}
    if n > 1:
        byte_sizes = (1 << 12, 1 << 16, 1 << 20) if quick else (1 << 12, 1 << 16, 1 << 20, 1 << 23)
        coll_rows = measure_collectives_between_compute(n, byte_sizes, repeats=5 if quick else 41)
        fits = fit_collectives(coll_rows, n)
        intra = {"bandwidth": fits["joint"]["bandwidth"], "latency": fits["joint"]["latency"]}
    else:
        # One device has nobody to talk to; model an in-memory copy.
        intra = {"bandwidth": bw_single / 2, "latency": 0.0}

    # -- fixed cost of one pipeline task (needs two device blocks) -------------------------------------------
    task = None
    if n >= 4:
        task = measure_task_overhead(n, byte_sizes=(1 << 10, 1 << 14, 1 << 18), repeats=21 if quick else 101)
    kern = measure_kernel_overhead(n, repeats=7 if quick else 21, peak_flops=peak_concurrent,
                                   memory_bandwidth=bw_concurrent,
                                   points=QUICK_KERNEL_POINTS if quick else KERNEL_POINTS)
    chain = measure_chain_reads(kern, depths=QUICK_CHAIN_DEPTHS if quick else CHAIN_DEPTHS, repeats=5 if quick else 11)
    buf = measure_buffer_overhead(n, repeats=7 if quick else 21)

    total = total_memory_bytes()
    return {
        "version": 1,
        "kind": CPU_PROFILE_KIND,
        "measured_on": _dt.date.today().isoformat(),
        "command": REGENERATE,
        "quick": bool(quick),
        # This machine's speed moves with what else runs on it: the 1-minute load average when the measurement
        # started and ended says which machine the figures describe.
        "load_average": [load0, os.getloadavg()[0]],
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "jax_version": jax.__version__,
        },
        "num_devices": n,
        "total_memory_bytes": total,
        "device": {
            "name": "cpu",
            # Concurrent per-device figures: every device of a plan computes at once on shared cores.
            # ... at a small model's kernel sizes: the large-kernel rates over the fitted work scale (see
            # measure_kernel_overhead; the rates as measured are kept under "measurements").
            "peak_flops": {"float32": peak_concurrent / kern["work_scale"]},
            "memory_bytes": total / n,
            "memory_bandwidth": bw_concurrent / kern["work_scale"],
            # One stage task's launch and input moves, per device of the task (0 when there are too few devices
            # to measure it): JAX's CPU devices share the machine's cores, so a task's fixed cost grows with them.
            "task_overhead_s": per_device_task_overhead(task) if task else 0.0,
            "shares_cores": True,
            # Measured, so the datasheet fractions stay 1; one kernel's fixed cost, every device busy.
            "efficiency": {"kernel_launch_s": kern["kernel_launch_s"], "buffer_s": buf["buffer_s"],
                           "driver_share": kern["driver_share"], "chain_reads": chain["chain_reads"]},
        },
        "intra_host": intra,
        # Never faster than the measured in-machine link, so a "cpu:2" what-if keeps the usual ordering.
        "inter_host": {
            "bandwidth": min(ASSUMED_INTER_HOST["bandwidth"], intra["bandwidth"]),
            "latency": max(ASSUMED_INTER_HOST["latency"], intra["latency"]),
        },
        "inter_host_note": ("assumed 10 GbE, capped at the measured intra-host link (one machine has no network to "
                            "measure)"),
        "collectives_note": BETWEEN_COMPUTE_NOTE,
        "measurements": {
            "matmul_float32": mm_rows,
            "matmul_flops_single_device": peak_single,
            "matmul_flops_concurrent_per_device": peak_concurrent,
            "memory_bandwidth_single_device": bw_single,
            "memory_bandwidth_concurrent_per_device": bw_concurrent,
            "elementwise_bytes_per_device": moved,
            "collectives": coll_rows,
            "collective_fits": fits,
            "collective_fit": COLLECTIVE_FIT,
            "task_overhead": task,
            "kernel_overhead": kern,
            "chain_reads": chain,
            "buffer_overhead": buf,
        },
    }
