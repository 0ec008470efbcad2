"""The fixed cost of one pipeline task, measured as the local runtime runs one (an activation moved between device
blocks, a host microbatch put there, a jitted call)."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .fits import fit_alpha_beta
from .timing import median_time

__all__ = ["measure_task_overhead", "per_device_task_overhead"]


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

        rows.append({"bytes": int(act.size * 4), "seconds": median_time(task, repeats=repeats)})
        if call_s is None:
            a, t = move(act, dst_sh), move(tokens, dst_sh)
            call_s = median_time(lambda: task_fn(a, t), repeats=repeats)
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
            "fit": ("task_overhead_s = the smallest activation's task time (median of repeats); beta from t = alpha + "
                    "bytes * beta over the sizes"),
            "beta_s_per_byte": beta}


def per_device_task_overhead(task: Mapping[str, Any]) -> float:
    """The profile's ``task_overhead_s`` from a :func:`measure_task_overhead` result: its fitted task on a block
    of devices, per device (CPU devices: :func:`autopar_lab.backends.cpu.task_devices` charges a task
    this times its stage's devices).

    >>> per_device_task_overhead({"task_overhead_s": 6e-4, "block": 2})
    0.0003
    """
    return float(task["task_overhead_s"]) / max(int(task.get("block", 1)), 1)
