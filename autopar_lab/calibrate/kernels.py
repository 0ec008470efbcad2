"""What a small model's kernels cost (fitted on its whole step at a few depths and batches, on every device and on a
quarter of them), the gradient chain's re-reads of a deep step, and the fixed cost of one state array a program
takes and returns."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .fits import fit_alpha_beta
from .timing import median_time

__all__ = ["step_point", "measure_kernel_overhead", "measure_chain_reads", "measure_buffer_overhead"]


def step_point(model: str, layers: int, batch: int, devices: int, peak_flops: float, memory_bandwidth: float,
               repeats: int) -> dict:
    """One point of the kernel fits: the zoo ``model`` at ``layers`` and ``batch`` runs its whole step on ``devices``
    CPU devices at once, each its own copy (``shard_map`` over replicated inputs: no communication). Returns
    {"layers", "batch", "devices", "kernels" (:func:`autopar_lab.graph.fusion.kernel_view`'s), "roofline_s" (every
    operator priced on one device at the rates given), "chain_s" (the gradient chain's re-read bytes per read,
    :func:`autopar_lab.backends.cpu.chain_pair_bytes`, at ``memory_bandwidth``), "call_s" (an empty program's
    call on the same devices), "seconds" (median of ``repeats``)}."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from autopar_lab import models
    from autopar_lab.cluster import Cluster, Device, Link
    from autopar_lab.graph.fusion import attach_kernel_roles, kernel_view
    from autopar_lab.backends.cpu import chain_pair_bytes
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
    call = median_time(lambda: nothing(x), repeats=repeats)  # a program's call alone, on these devices
    return {"layers": int(layers), "batch": int(batch), "devices": d, "kernels": kernels, "roofline_s": roof,
            "chain_s": chain, "call_s": call, "seconds": median_time(lambda: fn(*args), repeats=repeats)}


# The (layers, batch) points of the kernel fit and the depths of the chain-read fit; ``--quick``'s (profile.measure_cpu
# and modes.update_kernel_overhead alike) are 1-2-layer points and 6-8-layer steps, so a quick run compiles no 12- or
# 24-layer step.
KERNEL_POINTS = ((2, 2), (4, 2), (4, 16))
CHAIN_DEPTHS = (12, 24)
QUICK_KERNEL_POINTS = ((1, 2), (2, 2), (2, 8))
QUICK_CHAIN_DEPTHS = (6, 8)


def measure_kernel_overhead(num_devices: int | None = None, points=KERNEL_POINTS, repeats: int = 21,
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
    what it pays of the fit gives ``driver_share`` (:func:`autopar_lab.backends.cpu.kernel_share`). The batch-2
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


def measure_chain_reads(kernel_fit: Mapping[str, Any], depths=CHAIN_DEPTHS, batch: int = 2, repeats: int = 11) -> dict:
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
        rows.append({"arrays": k, "seconds": median_time(lambda: fn(*xs), repeats=repeats)})
    alpha, beta = fit_alpha_beta([r["arrays"] for r in rows], [r["seconds"] for r in rows])
    return {"buffer_s": beta, "call_s": alpha, "points": rows,
            "fit": "t = call_s + buffer_s * arrays, median of repeats per count, every device holding each array"}
