"""The collectives measured: an all-reduce and an all-gather over the local CPU devices, timed in chains (the program
call cancels), back to back or each after a layer-like compute as a step meets it."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .timing import median_time, median_time_pair

__all__ = ["BETWEEN_COMPUTE_NOTE", "collective_mesh", "measure_collectives", "measure_collectives_between_compute"]


BETWEEN_COMPUTE_NOTE = ("each collective timed after a layer-like compute on every device, in a chain of such links "
                         "against the same chain without the collectives (the difference over the links: latency, "
                         "barrier wait included, plus bytes over bandwidth; the program call cancels)")


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
        t_short = median_time(lambda: short_fn(buf), repeats=repeats)
        t_long = median_time(lambda: long_fn(buf), repeats=repeats)
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
    step each collective follows a layer's compute, and with N CPU devices sharing C < N cores a collective is
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
        t_with, t_without = median_time_pair(lambda: with_fn(act, buf, w1, w2),
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
