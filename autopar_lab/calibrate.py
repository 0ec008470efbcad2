"""Measure this machine's JAX CPU devices and write the profile the ``cpu`` cluster preset reads.

Regenerate the shipped profile (about a minute)::

    JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu python -m autopar_lab.calibrate --out autopar_lab/profiles/cpu.json

What is measured, and why each figure is the one the cost model wants:

* matmul FLOP/s (float32, a few sizes, best of several runs), once on one device alone and once with every
  device multiplying at the same time (one batched matmul sharded over the N devices, a k x k product each). The
  preset's ``peak_flops`` starts from the concurrent figure: the machine's aggregate throughput with all N devices
  busy, divided by N (best size), and is then brought to a small model's kernel sizes (the step fit below). N virtual CPU devices share the machine's C cores, so this is the honest model of
  "N devices on C cores": every device runs concurrently at 1/N of the machine, and a stage on d devices gets d/N
  of it (one device alone runs much faster: ``matmul_flops_single_device``, kept for comparison).
* memory bandwidth from a large elementwise add (bytes read + written), alone and concurrent (same reason).
* collective latency and bandwidth between the local devices: a jitted all-reduce (``psum``) and all-gather
  (``all_gather``), shard_map over a 1D mesh of the devices, at several buffer sizes, each timed as a step meets it:
  after a layer-like compute on every device, in a chain of such links against the same chain without the
  collectives (:func:`measure_collectives_between_compute`: the program call cancels, and the barrier wait for the
  slowest of the N device threads on C cores is counted; bare back-to-back collectives, :func:`measure_collectives`,
  see a quarter of it here). Each measurement is put in
  the cost model's form t = alpha + beta * x, with x the bytes the formula charges (all-reduce 2 (n-1)/n B, B the
  buffer; all-gather (n-1)/n B, B the gathered buffer: the formulas of :class:`~autopar_lab.cluster.LogicalMesh`),
  and alpha (latency) and beta (1 / bandwidth) fitted by least squares, per collective and jointly. The joint fit
  is the intra-host link; every fit is stored with its residuals (measured vs fitted time per size).
* what a small model's kernels cost (:func:`measure_kernel_overhead`): gpt-tiny's whole training step at a few
  depths and batches on every device at once (each its own copy, no communication), fitted as a fixed cost per
  kernel plus the cost model's roofline at the rates above times a work scale, then on a quarter of the devices
  (their share). Stored as ``device.efficiency.kernel_launch_s`` and ``driver_share``; ``peak_flops`` and
  ``memory_bandwidth`` are the measured rates over the work scale (about 4x on this machine: 32-256-row kernels
  reach a quarter of what 1024-wide matmuls and 32 MB streams do). Measured one at a time, the figures did not add
  up to a step: a chain of scalar kernels (the measurement until 2026-12-04) gave a tenth of a step's per-kernel
  cost.
* the fixed cost of one state array a program takes and returns (:func:`measure_buffer_overhead`): a jitted update
  of many small arrays replicated on every device, fitted per array; stored as ``device.efficiency.buffer_s`` (a
  step's update program takes and returns every parameter and optimizer-state array once).
* the fixed cost of one pipeline task (:func:`measure_task_overhead`): a trivial jitted call on a block of devices
  with a small activation moved in from another block and a host microbatch put there, as the local runtime runs
  a stage's forward or backward; the median time at a few activation sizes, fitted to t = overhead + beta * bytes.
  Stored as ``device.task_overhead_s``: the planner charges it once per stage forward and once per backward per
  microbatch.

``--quick`` uses small sizes and few repeats (seconds; noisier figures, for tests and a first look).
Each profile records the load average at its start and end (``load_average``): this machine is shared, and its
speed moves with what else runs (``bench/bench_execute.py --calibrate`` measures a profile just before it runs).

``--task-overhead-only`` (``--kernel-overhead-only``) measures just the per-task (per-kernel and per-state-array)
overhead and adds it to an existing profile; ``--chain-reads-only`` just the gradient chain's re-reads
(:func:`measure_chain_reads`); ``--collectives-only`` measures just the collectives and refits the
links.

>>> p = measure_cpu(quick=True)            # doctest: +SKIP
>>> p["device"]["peak_flops"]["float32"] > 0  # doctest: +SKIP
True
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from autopar_lab.cluster import CPU_PROFILE_KIND, CPU_PROFILE_PATH

__all__ = ["measure_cpu", "measure_collectives", "measure_collectives_between_compute", "fit_collectives", "measure_task_overhead", "write_profile",
           "update_task_overhead", "update_collectives", "fit_alpha_beta", "latency_steps", "refit_collectives", "total_memory_bytes",
           "measure_kernel_overhead", "update_kernel_overhead", "measure_buffer_overhead", "main"]

REGENERATE = "JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu python -m autopar_lab.calibrate --out autopar_lab/profiles/cpu.json"

_COLLECTIVE_FIT = ("t = latency x steps + x / bandwidth with x = 2 (n-1)/n B (all-reduce), (n-1)/n B (all-gather) and "
                   "steps = 2 log2(n) (all-reduce: a tree), n-1 (all-gather: a ring); least squares in relative "
                   "error; intra_host = the joint fit")
_BETWEEN_COMPUTE_NOTE = ("each collective timed after a layer-like compute on every device, in a chain of such links "
                         "against the same chain without the collectives (the difference over the links: latency, "
                         "barrier wait included, plus bytes over bandwidth; the program call cancels)")
# A single machine has no inter-host network to measure; a multi-host "cpu:N" what-if assumes 10 GbE.
_ASSUMED_INTER_HOST = {"bandwidth": 10e9 / 8, "latency": 50e-6}


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


def fit_alpha_beta(x_bytes: Any, seconds: Any, steps: Any = None) -> tuple[float, float]:
    """Least-squares fit of t = alpha * steps + beta * x in relative error; returns (alpha >= 0, beta > 0).

    ``steps``: the latency steps of each point (the algorithm's ring steps or tree levels, as
    :class:`~autopar_lab.cluster.LogicalMesh` counts them; default 1: alpha is the whole latency). Relative
    (1/t-weighted) residuals keep the small sizes, which carry the latency, from being swamped by the large ones,
    which carry the bandwidth. Noise on a shared machine can tip the unconstrained fit negative; then the bound is
    applied and the other parameter refitted, so the result is always a usable Link.

    >>> a, b = fit_alpha_beta([0, 1e6, 2e6], [1e-5, 1e-5 + 1e-3, 1e-5 + 2e-3])
    >>> round(a, 9), round(1 / b)
    (1e-05, 1000000000)
    >>> a, b = fit_alpha_beta([0, 1e6], [6e-5, 6e-5 + 1e-3], steps=[6, 6])   # 6 steps of 10 us
    >>> round(a, 9), round(1 / b)
    (1e-05, 1000000000)
    """
    x = np.asarray(x_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    k = np.ones_like(x) if steps is None else np.asarray(steps, dtype=float)
    w = 1.0 / t
    A = np.stack([k, x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(A * w[:, None], t * w, rcond=None)
    if beta <= 0:  # no visible size dependence: charge everything to bandwidth at the largest size
        i = int(np.argmax(x))
        alpha, beta = 0.0, t[i] / x[i]
    elif alpha < 0:  # latency below the noise: fit a line through the origin
        alpha, beta = 0.0, float((w * x) @ (w * t) / ((w * x) @ (w * x)))
    return float(alpha), float(beta)


def latency_steps(kind: str, n: int) -> int:
    """The latency steps the cost model charges a collective of ``kind`` over ``n`` devices of one host: a tree's
    log2 levels up and down for an all-reduce, a ring's n-1 steps for an all-gather or reduce-scatter (see
    :class:`~autopar_lab.cluster.LogicalMesh`).

    >>> latency_steps("all_reduce", 8), latency_steps("all_gather", 8)
    (6, 7)
    """
    if n <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * min(n - 1, math.ceil(math.log2(n)))
    return n - 1


def fit_collectives(rows: list[dict], num_devices: int = 2) -> dict:
    """Fit alpha (latency per step) and beta to collective timings, per kind and jointly, with residuals.

    ``rows``: [{"kind": "all_reduce" | "all_gather", "x_bytes": bytes the formula charges, "seconds": measured}],
    measured over ``num_devices`` devices. Returns {kind: fit, ..., "joint": fit}, each fit {"alpha_s",
    "beta_s_per_byte", "bandwidth", "latency", "points": [{"x_bytes", "seconds", "fit_seconds", "rel_residual"}],
    "max_abs_rel_residual", "rms_rel_residual"}; ``latency`` is per step (:func:`latency_steps`),
    ``rel_residual`` is (fitted - measured) / measured.

    >>> rows = [{"kind": "all_reduce", "x_bytes": x, "seconds": 2e-5 + x / 1e9} for x in (0, 1e6, 4e6)]
    >>> f = fit_collectives(rows, num_devices=2)["joint"]   # 2 devices: one step up and one down
    >>> round(f["latency"], 9), round(f["bandwidth"]), f["max_abs_rel_residual"] < 1e-9
    (1e-05, 1000000000, True)
    """
    out = {}
    kinds = sorted({r["kind"] for r in rows})
    for name, part in [(k, [r for r in rows if r["kind"] == k]) for k in kinds] + [("joint", list(rows))]:
        if len(part) < 2:
            continue
        x = [r["x_bytes"] for r in part]
        t = [r["seconds"] for r in part]
        steps = [latency_steps(r["kind"], num_devices) for r in part]
        alpha, beta = fit_alpha_beta(x, t, steps)
        points = []
        for r, k in zip(part, steps):
            fit = alpha * k + beta * r["x_bytes"]
            points.append({"kind": r["kind"], "x_bytes": r["x_bytes"], "seconds": r["seconds"], "fit_seconds": fit,
                           "rel_residual": (fit - r["seconds"]) / r["seconds"]})
        rel = np.array([p["rel_residual"] for p in points])
        out[name] = {"alpha_s": alpha, "beta_s_per_byte": beta, "latency": alpha, "bandwidth": 1.0 / beta,
                     "points": points, "max_abs_rel_residual": float(np.max(np.abs(rel))),
                     "rms_rel_residual": float(np.sqrt(np.mean(rel ** 2)))}
    return out


def refit_collectives(profile: dict) -> dict:
    """The profile with its links refitted from its stored collective measurements (:func:`fit_collectives`, latency
    per step), as :func:`measure_cpu` would fit them: for a profile measured before latency was counted per step."""
    rows = profile.get("measurements", {}).get("collectives") or []
    n = int(profile.get("num_devices", 1))
    if len(rows) < 2 or n < 2:
        return profile
    fits = fit_collectives(rows, n)
    profile["intra_host"] = {"bandwidth": fits["joint"]["bandwidth"], "latency": fits["joint"]["latency"]}
    profile["inter_host"] = {"bandwidth": min(_ASSUMED_INTER_HOST["bandwidth"], fits["joint"]["bandwidth"]),
                             "latency": max(_ASSUMED_INTER_HOST["latency"], fits["joint"]["latency"])}
    profile["measurements"]["collective_fits"] = fits
    profile["measurements"]["collective_fit"] = _COLLECTIVE_FIT
    return profile



def collective_mesh(num_devices: int | None = None):
    """A 1-D mesh ("d") of the first ``num_devices`` CPU devices (default all) for timing collectives; fewer
    than 2, or more than JAX has, is refused with what to set."""
    import jax
    from jax.sharding import Mesh

    devs = jax.devices("cpu")
    n = len(devs) if num_devices is None else int(num_devices)
    if not 2 <= n <= len(devs):
        raise ValueError(f"collectives need 2..{len(devs)} devices, got num_devices={num_devices}; "
                         "set JAX_NUM_CPU_DEVICES before jax is imported.")
    return Mesh(np.array(devs[:n]), ("d",))

def measure_collectives(num_devices: int | None = None, byte_sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 23),
                        repeats: int = 15, chain: tuple[int, int] = (1, 9)) -> list[dict]:
    """Time an all-reduce and an all-gather over the first ``num_devices`` local devices at each buffer size.

    For each size B (bytes per device): the all-reduce sums a B-byte buffer per device (x = 2 (n-1)/n B); the
    all-gather assembles n buffers of B/n bytes into B bytes on every device (x = (n-1)/n B). One program call costs
    far more than a small collective on this machine (hundreds of microseconds), and a fit of single collectives
    charges that call to the latency: so each program runs a chain of collectives back to back (each reads the
    last one's result), ``chain`` = (short, long) of them, and a collective's time is the difference of the two
    chains' times over the difference of their lengths (the call cancels). Each chain's time is the median of
    ``repeats`` runs after a warm-up, as for kernels and tasks: what a step meets on a shared machine (the best run
    can be a quarter of the median here, and plans executed meet the median). Returns rows for
    :func:`fit_collectives` (``seconds``: one collective; ``call_s``: the rest of the short chain's time).
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    short, long = (int(k) for k in chain)
    if not 1 <= short < long:
        raise ValueError(f"chain must be two lengths 1 <= short < long, got {chain!r}")
    mesh = collective_mesh(num_devices)
    n = mesh.size
    split = NamedSharding(mesh, P("d"))

    def sums(k: int) -> Callable[..., Any]:
        def body(b):
            for _ in range(k):  # each all-reduce reads the last one's sum: they run one after another
                b = jax.lax.psum(b, "d")
            return b
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def gathers(k: int) -> Callable[..., Any]:
        def body(b):
            per = b.shape[0]
            for _ in range(k):  # gather, then keep the next device's piece: the next gather needs this one
                full = jax.lax.all_gather(b, "d", tiled=True)
                start = ((jax.lax.axis_index("d") + 1) % n) * per
                b = jax.lax.dynamic_slice_in_dim(full, start, per)
            return b
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))

    def per_collective(make: Callable[[int], Callable[..., Any]], buf: Any) -> tuple[float, float]:
        short_fn, long_fn = make(short), make(long)
        t_short = _median_time(lambda: short_fn(buf), repeats=repeats)
        t_long = _median_time(lambda: long_fn(buf), repeats=repeats)
        each = max((t_long - t_short) / (long - short), 1e-9)
        return each, max(t_short - short * each, 0.0)

    rows = []
    for nbytes in byte_sizes:
        elems = max(nbytes // 4, n)
        buf = jax.device_put(np.ones((n, elems), np.float32), split)  # each device holds B bytes
        each, call = per_collective(sums, buf)
        rows.append({"kind": "all_reduce", "bytes": elems * 4, "x_bytes": 2 * (n - 1) / n * elems * 4,
                     "seconds": each, "call_s": call, "chain": [short, long]})
        per = max(elems // n, 1)
        part = jax.device_put(np.ones((n * per,), np.float32), split)  # B/n bytes per device, B gathered
        each, call = per_collective(gathers, part)
        rows.append({"kind": "all_gather", "bytes": n * per * 4, "x_bytes": (n - 1) / n * n * per * 4,
                     "seconds": each, "call_s": call, "chain": [short, long]})
    return rows


def measure_collectives_between_compute(num_devices: int | None = None,
                                        byte_sizes=(1 << 12, 1 << 16, 1 << 20, 1 << 23), repeats: int = 15,
                                        links: int = 8, compute: tuple[int, int] = (32, 32)) -> list[dict]:
    """Time an all-reduce and an all-gather as a step meets them: each after a small compute on every device.

    Back-to-back collectives (:func:`measure_collectives`) run on devices that have nothing else to do. In a plan's
    step each collective follows a layer's compute, and with N virtual devices sharing C < N cores a collective is
    also a barrier: it waits for the last device thread to finish its share, which back-to-back collectives never
    see. So each program here is a chain of ``links`` links; a link is a layer-like compute on every device (an MLP
    of ``compute`` = (rows, hidden): ``tanh(a @ w1) @ w2`` with w1 hidden x 4 hidden, the shape of a gpt-tiny layer's
    per-device share under data parallelism), then the collective on a B-byte buffer that has read the compute's
    result, and the next link's compute reads the collective's. The same chain without the collectives (the buffer
    still updated from the compute, so the same work is left) is timed alongside, the two programs taking turns call
    by call (a change in this shared machine's load hits both); the median difference over ``links`` is one
    collective as a step pays it: latency (barrier included) plus its bytes over the bandwidth, the program call
    cancelling. Returns rows for :func:`fit_collectives` (``seconds``: one collective; ``compute_s``: one link's
    compute alone).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    if int(links) < 1:
        raise ValueError(f"links must be at least 1, got {links!r}")
    rows_per_device, hidden = (int(v) for v in compute)
    if rows_per_device < 1 or hidden < 1:
        raise ValueError(f"compute must be (rows, hidden), both at least 1, got {compute!r}")
    mesh = collective_mesh(num_devices)
    n = mesh.size
    split, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    act = jax.device_put(rng.standard_normal((n * rows_per_device, hidden), dtype=np.float32) * 0.1, split)
    w1 = jax.device_put(rng.standard_normal((hidden, 4 * hidden), dtype=np.float32) * hidden ** -0.5, replicated)
    w2 = jax.device_put(rng.standard_normal((4 * hidden, hidden), dtype=np.float32) * (4 * hidden) ** -0.5,
                        replicated)

    def chain(collective: Callable[[Any], Any] | None) -> Callable[..., Any]:
        def body(a, b, w1, w2):
            for _ in range(int(links)):
                a = jnp.tanh(a @ w1) @ w2
                b = b * 0.5 + a[0, 0]  # the collective's input waits for this device's compute
                if collective is not None:
                    b = collective(b)
                a = a + 1e-3 * b[0]  # the next compute waits for the collective
            return a, b
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d"), P(), P()),
                                     out_specs=(P("d"), P("d")), check_vma=False))

    def gather(per: int) -> Callable[[Any], Any]:
        def fn(b):  # gather, then keep the next device's piece (as in measure_collectives)
            full = jax.lax.all_gather(b, "d", tiled=True)
            return jax.lax.dynamic_slice_in_dim(full, ((jax.lax.axis_index("d") + 1) % n) * per, per)
        return fn

    def per_collective(collective: Callable[[Any], Any], buf: Any) -> tuple[float, float]:
        with_fn, without_fn = chain(collective), chain(None)
        t_with, t_without = _median_time_pair(lambda: with_fn(act, buf, w1, w2),
                                              lambda: without_fn(act, buf, w1, w2), repeats=repeats)
        return max((t_with - t_without) / links, 1e-9), t_without / links

    out = []
    for nbytes in byte_sizes:
        elems = max(nbytes // 4, n)
        buf = jax.device_put(np.ones((n * elems,), np.float32), split)  # each device holds B bytes
        each, comp = per_collective(lambda b: jax.lax.psum(b, "d"), buf)
        out.append({"kind": "all_reduce", "bytes": elems * 4, "x_bytes": 2 * (n - 1) / n * elems * 4,
                    "seconds": each, "compute_s": comp, "links": int(links), "compute": [rows_per_device, hidden]})
        per = max(elems // n, 1)
        part = jax.device_put(np.ones((n * per,), np.float32), split)  # B/n bytes per device, B gathered
        each, comp = per_collective(gather(per), part)
        out.append({"kind": "all_gather", "bytes": n * per * 4, "x_bytes": (n - 1) / n * n * per * 4,
                    "seconds": each, "compute_s": comp, "links": int(links), "compute": [rows_per_device, hidden]})
    return out


def update_collectives(path: str | os.PathLike | None = None, quick: bool = False, back_to_back: bool = False) -> dict:
    """Measure only the collectives and refit the links of the profile at ``path`` (default: the shipped one) from
    them (:func:`refit_collectives`), keeping every other figure; returns the profile.

    By default each collective is timed after a layer-like compute on every device, as a plan's step meets it
    (:func:`measure_collectives_between_compute`); ``back_to_back`` times chains of bare collectives instead
    (:func:`measure_collectives`: no barrier wait, a lower latency that the plans executed here do not see)."""
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    profile = json.loads(out.read_text())
    n = int(profile.get("num_devices", 1))
    sizes = (1 << 12, 1 << 16, 1 << 20) if quick else (1 << 12, 1 << 16, 1 << 20, 1 << 23)
    repeats = 5 if quick else 41
    if back_to_back:
        rows = measure_collectives(n, sizes, repeats=repeats)
        note = ("each collective timed in chains of back-to-back collectives, the chains' difference over their "
                "lengths (the program call cancels)")
    else:
        rows = measure_collectives_between_compute(n, sizes, repeats=repeats)
        note = _BETWEEN_COMPUTE_NOTE
    profile.setdefault("measurements", {})["collectives"] = rows
    profile = refit_collectives(profile)
    profile["collectives_measured_on"] = _dt.date.today().isoformat()
    profile["collectives_note"] = note
    profile.pop("collectives_refit_note", None)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def measure_task_overhead(num_devices: int | None = None, byte_sizes=(1 << 10, 1 << 14, 1 << 18),
                          repeats: int = 101, block: int = 2) -> dict:
    """Time one pipeline task as the local runtime runs it, with (almost) no work in it, and fit its fixed cost.

    A task here is what :class:`autopar_lab.runtime.local.Runner` does per stage and microbatch: move an activation
    from the previous stage's device block (``block`` devices) onto this stage's block (split along the batch, with
    the runtime's own :func:`~autopar_lab.runtime.layouts.move`), put a host microbatch there, and call a jitted
    program (one add) on both, waiting for the result. Each activation size B is timed ``repeats`` times (median: a
    fixed cost is what most calls pay; the best would hide the scheduling every call meets on a shared machine) and
    t = alpha + beta * B is fitted (:func:`fit_alpha_beta`). ``alpha`` is the per-task overhead (the bytes are
    charged separately, as the stage-to-stage transfer). Returns {"task_overhead_s", "block", "points": [{"bytes",
    "seconds", "fit_seconds", "rel_residual"}], "max_abs_rel_residual", "call_s" (the call alone, inputs in
    place), "fit"}.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from autopar_lab.runtime.layouts import device_mesh, move  # the runtime's own placement, so its cost is measured

    devs = jax.devices("cpu")
    n = len(devs) if num_devices is None else int(num_devices)
    if not 2 * block <= n <= len(devs):
        raise ValueError(f"a task overhead needs two blocks of {block} devices ({2 * block}..{len(devs)} devices), "
                         f"got num_devices={num_devices}; set JAX_NUM_CPU_DEVICES before jax is imported.")
    src, dst = device_mesh(devs[:block], (1, block)), device_mesh(devs[block:2 * block], (1, block))
    split = P(None, "y")  # the microbatch axis over the block, as a data-parallel stage holds it
    src_sh, dst_sh = NamedSharding(src, split), NamedSharding(dst, split)
    task_fn = jax.jit(lambda act, tokens: act + tokens[..., None].astype(act.dtype))
    rows, call_s = [], None
    for nbytes in byte_sizes:
        width = max(nbytes // (4 * 8 * block), 1)
        act = jax.device_put(np.ones((1, 8 * block, width), np.float32), src_sh)
        tokens = np.ones((1, 8 * block), np.int32)

        def task():
            return task_fn(move(act, dst_sh), move(tokens, dst_sh))

        rows.append({"bytes": int(act.size * 4), "seconds": _median_time(task, repeats=repeats)})
        if call_s is None:
            a, t = move(act, dst_sh), move(tokens, dst_sh)
            call_s = _median_time(lambda: task_fn(a, t), repeats=repeats)
    alpha, beta = fit_alpha_beta([r["bytes"] for r in rows], [r["seconds"] for r in rows])
    for r in rows:
        r["fit_seconds"] = alpha + beta * r["bytes"]
        r["rel_residual"] = (r["fit_seconds"] - r["seconds"]) / r["seconds"]
    # The fixed cost is the smallest task's time (its bytes move in about a microsecond): the fit's intercept swings
    # with the noise of the larger sizes on this shared machine (0 on 2026-12-04, the 16 KB task slower than the
    # 256 KB one), and the bytes are charged separately anyway.
    smallest = min(rows, key=lambda r: r["bytes"])["seconds"]
    return {"task_overhead_s": smallest, "fit_alpha_s": alpha, "block": block, "points": rows, "call_s": call_s,
            "max_abs_rel_residual": max(abs(r["rel_residual"]) for r in rows),
            "fit": "task_overhead_s = the smallest activation's task time (median of repeats); beta from t = alpha + bytes * beta over the sizes",
            "beta_s_per_byte": beta}


def per_device_task_overhead(task: Mapping[str, Any]) -> float:
    """The profile's ``task_overhead_s`` from a :func:`measure_task_overhead` result: its fitted task on a block
    of devices, per device (virtual devices: :func:`autopar_lab.pricing.stage.task_overhead_s` charges a task
    this times its stage's devices).

    >>> per_device_task_overhead({"task_overhead_s": 6e-4, "block": 2})
    0.0003
    """
    return float(task["task_overhead_s"]) / max(int(task.get("block", 1)), 1)


def measure_kernel_overhead(num_devices: int | None = None, points=((2, 2), (4, 2), (4, 16)), repeats: int = 21,
                            peak_flops: float = 1e10, memory_bandwidth: float = 1e9,
                            model: str = "gpt-tiny") -> dict:
    """Fit what a small model's kernels cost on every device at once: a fixed cost per kernel and how far the
    measured rates (``peak_flops``, ``memory_bandwidth``: large matmuls, long streams) are from what kernels of a
    small model's sizes reach.

    For each (layers, batch) of ``points``, the zoo ``model`` of that depth and batch runs its whole training step on
    every device at once, each device its own copy (``shard_map`` over replicated inputs: no communication), as the
    plans run their kernels on the machine's shared cores. The cost model prices the same step on one device at the
    given rates (:func:`autopar_lab.sharding.strategies.price` of every operator, kernels by
    :func:`autopar_lab.graph.fusion.kernel_view`) and the times, less the call of an empty program on the same
    devices, are fitted, least squares on all points, as ``kernel_launch_s * kernels + work_scale * roofline_s``.
    The first point runs again on a quarter of the devices (the rest idle, as a pipeline stage's task finds them):
    what it pays of the fit gives ``driver_share`` (:meth:`autopar_lab.cluster.Cluster.virtual_share`). The batch-2
    points (a data-parallel shard of
    gpt-tiny: launch-bound kernels of a few KB) and the batch-16 one (the whole batch: a replicated plan's kernels)
    pin the two terms. ``work_scale`` divides the profile's rates (see :func:`measure_cpu`).

    Why: measured one at a time, the figures did not add up to a step. A chain of 16-float kernels gave 1.1 us a
    kernel where a step's kernels cost 10-12 us each on 8 devices over 2 cores; 256-row kernels took 2-3x their
    roofline at the 32 MB stream bandwidth. Returns {"kernel_launch_s", "work_scale", "driver_share", "points":
    [{"layers", "batch", "devices", "kernels", "roofline_s", "call_s", "seconds", "fit_seconds"}], "fewer" (the
    point on fewer devices, with its "share"; None below 4 devices), "fit"}.
    """
    import jax

    devs = jax.devices("cpu")
    n = len(devs) if num_devices is None else int(num_devices)
    if len(points) < 2:
        raise ValueError(f"points needs two (layers, batch) pairs or more to fit two terms, got {points!r}")

    def run(layers: int, batch: int, d: int) -> dict:
        return step_point(model, layers, batch, d, peak_flops, memory_bandwidth, repeats)

    rows = [run(layers, batch, n) for layers, batch in points]
    a = np.array([[r["kernels"], r["roofline_s"]] for r in rows])
    t = np.array([r["seconds"] - r["call_s"] for r in rows])
    launch, scale = (float(v) for v in np.linalg.lstsq(a, t, rcond=None)[0])
    launch, scale = max(launch, 0.0), max(scale, 1e-3)
    for r in rows:
        r["fit_seconds"] = r["call_s"] + launch * r["kernels"] + scale * r["roofline_s"]
    # The same step on fewer devices (the rest idle, as a pipeline stage's task finds them): its share of the cost.
    share, few = 0.0, None
    if n >= 4:
        few = run(points[0][0], points[0][1], max(n // 4, 2))
        phi = (few["seconds"] - few["call_s"]) / (launch * few["kernels"] + scale * few["roofline_s"])
        d = few["devices"]
        few["share"] = phi
        share = max((d - phi * n) / (phi - 1.0), 0.0) if phi < 1.0 else 0.0
    return {"kernel_launch_s": launch, "work_scale": scale, "driver_share": share, "points": rows, "fewer": few,
            "model": model, "rates": {"peak_flops": float(peak_flops), "memory_bandwidth": float(memory_bandwidth)},
            "fit": "t - call_s = kernel_launch_s * kernels + work_scale * roofline_s (the cost model's kernels and "
                   "roofline at the rates given), least squares over the points, all devices busy; on d of the n "
                   "devices the step pays (d + driver_share) / (n + driver_share) of that; medians of repeats"}


def step_point(model: str, layers: int, batch: int, devices: int, peak_flops: float, memory_bandwidth: float,
               repeats: int) -> dict:
    """One point of the kernel fits: the zoo ``model`` at ``layers`` and ``batch`` runs its whole step on ``devices``
    CPU devices at once, each its own copy (``shard_map`` over replicated inputs: no communication). Returns
    {"layers", "batch", "devices", "kernels" (:func:`autopar_lab.graph.fusion.kernel_view`'s), "roofline_s" (every
    operator priced on one device at the rates given), "chain_s" (the gradient chain's re-read bytes per read,
    :func:`autopar_lab.pricing.layers.chain_pair_bytes`, at ``memory_bandwidth``), "call_s" (an empty program's
    call on the same devices), "seconds" (median of ``repeats``)}."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from autopar_lab import models
    from autopar_lab.cluster import Cluster, Device, Link
    from autopar_lab.graph.fusion import attach_kernel_roles, kernel_view
    from autopar_lab.pricing.layers import chain_pair_bytes
    from autopar_lab.sharding.strategies import price, replicated_strategy

    devs = jax.devices("cpu")
    d = int(devices)
    if d > len(devs):
        raise ValueError(f"this point runs on {d} CPU devices and JAX has {len(devs)}: set JAX_NUM_CPU_DEVICES={d} "
                         f"before Python starts (or pass fewer devices)")
    one = Cluster(hosts=1, devices_per_host=1, name="one",
                  device=Device("cpu", {"float32": float(peak_flops)}, memory_bytes=2.0 ** 30,
                                memory_bandwidth=float(memory_bandwidth)),
                  intra_host=Link(1e9, 0.0), inter_host=Link(1e9, 0.0)).logical_mesh((1, 1), (1, 1))
    mesh = Mesh(np.array(devs[:d]), ("d",))
    replicated = NamedSharding(mesh, P())
    spec = models.get(model, num_layers=int(layers), batch_size=int(batch))
    graph = spec.trace()
    attach_kernel_roles(graph)
    kernels = len(kernel_view(graph).kernels)
    roof = float(sum(price(op, replicated_strategy(op), one).compute_s for op in graph))
    chain = chain_pair_bytes(graph, list(graph.layers) or [""]) / float(memory_bandwidth)
    args = jax.device_put(jax.tree.map(np.asarray, spec.init(seed=0)), replicated)
    fn = jax.jit(jax.shard_map(spec.step_fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(),
                               check_vma=False))
    nothing = jax.jit(jax.shard_map(lambda x: x + 1, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jax.device_put(np.zeros(d, np.float32), NamedSharding(mesh, P("d")))
    call = _median_time(lambda: nothing(x), repeats=repeats)  # a program's call alone, on these devices
    return {"layers": int(layers), "batch": int(batch), "devices": d, "kernels": kernels, "roofline_s": roof,
            "chain_s": chain, "call_s": call, "seconds": _median_time(lambda: fn(*args), repeats=repeats)}


def measure_chain_reads(kernel_fit: Mapping[str, Any], depths=(12, 24), batch: int = 2, repeats: int = 11) -> dict:
    """Fit ``Efficiency.chain_reads`` from deep steps: what a ``kernel_fit``'s formula (of
    :func:`measure_kernel_overhead`, fitted at 2-4 layers) leaves unexplained of the step at each of ``depths``
    layers, on the same devices, over the gradient chain's re-read bytes at the profile's bandwidth (least squares
    through the origin; none below 0).

    Why: on this machine a layer of gpt-tiny's step cost ~2x more at 24 layers than at 4 with no communication. XLA
    on CPU fuses the residual stream's gradient (the sum of every later layer's term) into each reader kernel of
    each layer's backward instead of writing it once: at 24 layers 140 of the backward's fusions read 33 MB of
    operands (1.1 MB at 4 layers), ~29 reads of a link per pair of layers; the forward's per-kernel time does not
    grow. What the fit leaves per re-read link grows with depth on all 8 devices (22, 51, 65, 70 reads at 6, 12, 18,
    24 layers; the 2-4-layer kernel fit holds part of a short program's) and less so on 2 (53 at 6 layers): the
    default depths are those of the programs that pay it most. Returns {"chain_reads", "points": [... as
    :func:`step_point`, with "rest_s" (seconds the fit leaves)], "fit"}."""
    rates = kernel_fit["rates"]
    n = int(kernel_fit["points"][0]["devices"])
    launch, scale = float(kernel_fit["kernel_launch_s"]), float(kernel_fit["work_scale"])
    rows = [step_point(kernel_fit.get("model", "gpt-tiny"), L, batch, n, rates["peak_flops"],
                       rates["memory_bandwidth"], repeats) for L in depths]
    for r in rows:
        r["rest_s"] = r["seconds"] - r["call_s"] - launch * r["kernels"] - scale * r["roofline_s"]
    u = np.array([r["chain_s"] * scale for r in rows])  # priced at the profile's bandwidth (measured / work_scale)
    rest = np.array([r["rest_s"] for r in rows])
    reads = max(float(u @ rest / (u @ u)), 0.0) if float(u @ u) > 0 else 0.0
    return {"chain_reads": reads, "points": rows,
            "fit": "t - call_s - (kernel_launch_s * kernels + work_scale * roofline_s) = chain_reads * work_scale * "
                   "chain_s (the chain's re-read bytes at the measured bandwidth), least squares through 0"}


def measure_buffer_overhead(num_devices: int | None = None, counts=(8, 128), repeats: int = 21) -> dict:
    """Time a jitted update of ``k`` small arrays, each replicated on every device (``x * a + b`` per array, taken
    and returned, as a step's update program takes and returns each parameter and optimizer-state array), and fit
    the fixed cost per array. Returns {"buffer_s", "call_s" (the intercept), "points": [{"arrays", "seconds"}],
    "fit"}."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devs = jax.devices("cpu")
    n = len(devs) if num_devices is None else int(num_devices)
    replicated = NamedSharding(Mesh(np.array(devs[:n]), ("d",)), P())
    rows = []
    for k in counts:
        xs = [jax.device_put(np.full((16, 16), i, np.float32), replicated) for i in range(k)]
        fn = jax.jit(lambda *a: [x * 0.5 + 1.0 for x in a])
        rows.append({"arrays": k, "seconds": _median_time(lambda: fn(*xs), repeats=repeats)})
    alpha, beta = fit_alpha_beta([r["arrays"] for r in rows], [r["seconds"] for r in rows])
    return {"buffer_s": beta, "call_s": alpha, "points": rows,
            "fit": "t = call_s + buffer_s * arrays, median of repeats per count, every device holding each array"}


def update_kernel_overhead(path: str | os.PathLike | None = None, quick: bool = False) -> dict:
    """Measure only the per-kernel and per-state-array overheads (:func:`measure_kernel_overhead`,
    :func:`measure_buffer_overhead`) and store them in the profile at ``path`` (default: the shipped one), with the
    device's rates refitted from the profile's measured large-kernel rates (kept under "measurements"), keeping
    every other figure; returns the profile."""
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    profile = json.loads(out.read_text())
    raw = profile.get("measurements", {})
    kern = measure_kernel_overhead(profile.get("num_devices"), repeats=7 if quick else 21,
                                   peak_flops=raw.get("matmul_flops_concurrent_per_device",
                                                      profile["device"]["peak_flops"]["float32"]),
                                   memory_bandwidth=raw.get("memory_bandwidth_concurrent_per_device",
                                                            profile["device"]["memory_bandwidth"]))
    profile["device"]["peak_flops"] = {"float32": kern["rates"]["peak_flops"] / kern["work_scale"]}
    profile["device"]["memory_bandwidth"] = kern["rates"]["memory_bandwidth"] / kern["work_scale"]
    chain = measure_chain_reads(kern, repeats=5 if quick else 11)
    buf = measure_buffer_overhead(profile.get("num_devices"), repeats=7 if quick else 21)
    profile["device"].setdefault("efficiency", {}).update(kernel_launch_s=kern["kernel_launch_s"],
                                                          buffer_s=buf["buffer_s"], driver_share=kern["driver_share"],
                                                          chain_reads=chain["chain_reads"])
    profile.setdefault("measurements", {})["kernel_overhead"] = kern
    profile["measurements"]["chain_reads"] = chain
    profile["measurements"]["buffer_overhead"] = buf
    profile["kernel_overhead_measured_on"] = _dt.date.today().isoformat()
    profile["kernel_overhead_load_average"] = list(os.getloadavg()[:1])
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median of ``repeats`` timed calls of ``fn`` (its result waited for), after two warm-up calls."""
    _ready(fn())
    _ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _ready(fn())
        times.append(time.perf_counter() - t0)
    return max(float(np.median(times)), 1e-9)


def _median_time_pair(fn_a: Callable[[], Any], fn_b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Medians of ``repeats`` timed calls each of ``fn_a`` and ``fn_b``, taking turns call by call (so a change of
    load on a shared machine hits both alike), after two warm-up calls of each."""
    for _ in range(2):
        _ready(fn_a())
        _ready(fn_b())
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, ts in ((fn_a, times[0]), (fn_b, times[1])):
            t0 = time.perf_counter()
            _ready(fn())
            ts.append(time.perf_counter() - t0)
    return max(float(np.median(times[0])), 1e-9), max(float(np.median(times[1])), 1e-9)


def _ready(x: Any) -> Any:
    """Wait for every array in ``x``."""
    import jax

    return jax.block_until_ready(x)


def _best_time(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Fastest of ``repeats`` runs after one warm-up (which also compiles): least disturbed by other load."""
    fn(*args).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _best_time_inplace(fn: Callable[[Any], Any], x: Any, repeats: int) -> float:
    """Like :func:`_best_time` for a jitted ``fn`` that donates its argument: x = fn(x) reuses one buffer.

    Without donation every call writes a freshly allocated buffer, and the page faults of touching new memory
    (not the memory bus) dominate the time of a large elementwise op.
    """
    x = fn(x)
    x.block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = fn(x)
        x.block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def measure_cpu(num_devices: int | None = None, quick: bool = False) -> dict:
    """Measure the local JAX CPU devices; returns the profile dict (the form :func:`write_profile` stores).

    ``num_devices`` uses the first N CPU devices (default: all). ``quick`` uses smaller sizes and fewer
    repeats (a few seconds; for tests), the full run takes about a minute on a busy two-core machine.
    """
    import jax
    import jax.numpy as jnp
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
        single = 2 * k**3 / _best_time(matmul, a, a, repeats=repeats)
        # One k x k product per device, all at once (batched matmul sharded on the batch axis).
        ab = jax.device_put(rng.standard_normal((n, k, k), dtype=np.float32), split)
        concurrent = 2 * k**3 / _best_time(matmul, ab, ab, repeats=repeats)
        mm_rows.append({"size": k, "flops_single": single, "flops_concurrent_per_device": concurrent})
    peak_single = max(r["flops_single"] for r in mm_rows)
    peak_concurrent = max(r["flops_concurrent_per_device"] for r in mm_rows)

    # -- memory bandwidth ---------------------------------------------------------------------------
    add = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    elems = (1 << 20) if quick else (1 << 23)  # 4 MiB or 32 MiB of float32 per device: beyond the caches
    moved = 2 * 4 * elems  # read once, write once
    x1 = jax.device_put(np.ones(elems, np.float32), devs[0])
    bw_single = moved / _best_time_inplace(add, x1, repeats=repeats)
    xn = jax.device_put(np.ones((n, elems), np.float32), split)
    bw_concurrent = moved / _best_time_inplace(add, xn, repeats=repeats)

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
                                   points=((1, 2), (2, 2), (2, 8)) if quick else ((2, 2), (4, 2), (4, 16)))
    chain = measure_chain_reads(kern, depths=(6, 8) if quick else (12, 24), repeats=5 if quick else 11)
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
            "virtual": True,
            # Measured, so the datasheet fractions stay 1; one kernel's fixed cost, every device busy.
            "efficiency": {"kernel_launch_s": kern["kernel_launch_s"], "buffer_s": buf["buffer_s"],
                           "driver_share": kern["driver_share"], "chain_reads": chain["chain_reads"]},
        },
        "intra_host": intra,
        # Never faster than the measured in-machine link, so a "cpu:2" what-if keeps the usual ordering.
        "inter_host": {
            "bandwidth": min(_ASSUMED_INTER_HOST["bandwidth"], intra["bandwidth"]),
            "latency": max(_ASSUMED_INTER_HOST["latency"], intra["latency"]),
        },
        "inter_host_note": "assumed 10 GbE, capped at the measured intra-host link (one machine has no network to measure)",
        "collectives_note": _BETWEEN_COMPUTE_NOTE,
        "measurements": {
            "matmul_float32": mm_rows,
            "matmul_flops_single_device": peak_single,
            "matmul_flops_concurrent_per_device": peak_concurrent,
            "memory_bandwidth_single_device": bw_single,
            "memory_bandwidth_concurrent_per_device": bw_concurrent,
            "elementwise_bytes_per_device": moved,
            "collectives": coll_rows,
            "collective_fits": fits,
            "collective_fit": _COLLECTIVE_FIT,
            "task_overhead": task,
            "kernel_overhead": kern,
            "chain_reads": chain,
            "buffer_overhead": buf,
        },
    }


def write_profile(path: str | os.PathLike | None = None, num_devices: int | None = None, quick: bool = False) -> dict:
    """Measure (see :func:`measure_cpu`) and write the JSON profile to ``path`` (default: the shipped one)."""
    profile = measure_cpu(num_devices=num_devices, quick=quick)
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def update_task_overhead(path: str | os.PathLike | None = None, quick: bool = False) -> dict:
    """Measure only the per-task overhead (:func:`measure_task_overhead`, as :func:`measure_cpu` does) and store it
    in the profile at ``path`` (default: the shipped one), keeping every other figure; returns the profile."""
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    profile = json.loads(out.read_text())
    task = measure_task_overhead(profile.get("num_devices"), repeats=21 if quick else 101)
    profile["device"]["task_overhead_s"] = per_device_task_overhead(task)
    profile["device"]["virtual"] = True
    profile.setdefault("measurements", {})["task_overhead"] = task
    profile["task_overhead_measured_on"] = _dt.date.today().isoformat()
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def update_chain_reads(path: str | os.PathLike | None = None, quick: bool = False) -> dict:
    """Measure only ``chain_reads`` (:func:`measure_chain_reads`, against the profile's own kernel fit) and store it
    in the profile at ``path`` (default: the shipped one), keeping every other figure; returns the profile. A
    profile without a kernel fit is a ValueError that says what to run first."""
    out = Path(path) if path is not None else CPU_PROFILE_PATH
    profile = json.loads(out.read_text())
    kern = profile.get("measurements", {}).get("kernel_overhead")
    if not kern or "rates" not in kern:
        raise ValueError(f"{out} has no kernel fit to measure the gradient chain against; run "
                         f"`python -m autopar_lab.calibrate --kernel-overhead-only --out {out}` first")
    chain = measure_chain_reads(kern, depths=(6, 8) if quick else (12, 24), repeats=5 if quick else 11)
    profile["device"].setdefault("efficiency", {})["chain_reads"] = chain["chain_reads"]
    profile.setdefault("measurements", {})["chain_reads"] = chain
    profile["chain_reads_measured_on"] = _dt.date.today().isoformat()
    profile["chain_reads_load_average"] = list(os.getloadavg()[:1])
    out.write_text(json.dumps(profile, indent=2) + "\n")
    return profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar_lab.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(CPU_PROFILE_PATH), help="where to write the JSON profile")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (seconds, noisier)")
    parser.add_argument("--devices", type=int, default=None, help="use the first N CPU devices (default: all)")
    parser.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    parser.add_argument("--task-overhead-only", action="store_true",
                        help="measure only the per-task overhead and add it to the existing profile at --out")
    parser.add_argument("--collectives-only", action="store_true",
                        help="measure only the collectives (each after a layer-like compute, as a step meets them) "
                             "and refit the links of the existing profile at --out")
    parser.add_argument("--back-to-back", action="store_true",
                        help="with --collectives-only: time chains of bare back-to-back collectives instead")
    parser.add_argument("--kernel-overhead-only", action="store_true",
                        help="measure only the per-kernel and per-state-array overheads and add them to the existing "
                             "profile at --out")
    parser.add_argument("--chain-reads-only", action="store_true",
                        help="measure only the gradient chain's re-reads (deep steps against the profile's kernel "
                             "fit) and add them to the existing profile at --out")
    args = parser.parse_args(argv)
    # Calibrate CPU devices; give the usual 8 unless the caller chose (only works before jax is imported).
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    if "jax" in sys.modules:  # imported with the package: its config read the environment already
        import jax

        try:
            jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))
        except (RuntimeError, ValueError):
            pass  # the backend is up already: the devices are what they are (step_point says if too few)
    try:
        if args.task_overhead_only:
            profile = update_task_overhead(args.out, quick=args.quick)
        elif args.collectives_only:
            profile = update_collectives(args.out, quick=args.quick, back_to_back=args.back_to_back)
        elif args.kernel_overhead_only:
            profile = update_kernel_overhead(args.out, quick=args.quick)
        elif args.chain_reads_only:
            profile = update_chain_reads(args.out, quick=args.quick)
        else:
            profile = write_profile(args.out, num_devices=args.devices, quick=args.quick)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(profile))
    else:
        d, link = profile["device"], profile["intra_host"]
        print(
            f"wrote {args.out}: {profile['num_devices']} devices, "
            f"{d['peak_flops']['float32'] / 1e9:.1f} GFLOP/s and {d['memory_bandwidth'] / 1e9:.1f} GB/s per device "
            f"(concurrent), collective link (all-reduce + all-gather fit) {link['bandwidth'] / 1e9:.2f} GB/s + {link['latency'] * 1e6:.1f} us, "
            f"{d['task_overhead_s'] * 1e3:.2f} ms per pipeline task, "
            f"{d.get('efficiency', {}).get('kernel_launch_s', 0.0) * 1e6:.1f} us per kernel, "
            f"{d.get('efficiency', {}).get('buffer_s', 0.0) * 1e6:.1f} us per state array, "
            f"{d.get('efficiency', {}).get('chain_reads', 0.0):.3g} gradient-chain reads per later layer"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
