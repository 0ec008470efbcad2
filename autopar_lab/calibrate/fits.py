"""The calibration's fits: alpha-beta lines through timed collectives, per collective and jointly, in the cost
model's form (latency per step, bytes over bandwidth; :class:`~autopar_lab.cluster.LogicalMesh`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["COLLECTIVE_FIT", "ASSUMED_INTER_HOST", "fit_alpha_beta", "latency_steps", "fit_collectives",
           "refit_collectives"]


COLLECTIVE_FIT = ("t = latency x steps + x / bandwidth with x = 2 (n-1)/n B (all-reduce), (n-1)/n B (all-gather) and "
                   "steps = 2 log2(n) (all-reduce: a tree), n-1 (all-gather: a ring); least squares in relative "
                   "error; intra_host = the joint fit")


# A single machine has no inter-host network to measure; a multi-host "cpu:N" what-if assumes 10 GbE.
ASSUMED_INTER_HOST = {"bandwidth": 10e9 / 8, "latency": 50e-6}


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
    profile["inter_host"] = {"bandwidth": min(ASSUMED_INTER_HOST["bandwidth"], fits["joint"]["bandwidth"]),
                             "latency": max(ASSUMED_INTER_HOST["latency"], fits["joint"]["latency"])}
    profile["measurements"]["collective_fits"] = fits
    profile["measurements"]["collective_fit"] = COLLECTIVE_FIT
    return profile
