"""How the calibration times a program: the median of repeated calls (what most calls pay on a shared machine), the
same for two programs taking turns (a change of load hits both), and the best of repeats for peak rates."""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np

__all__ = ["median_time", "median_time_pair", "ready", "best_time", "best_time_inplace"]


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median of ``repeats`` timed calls of ``fn`` (its result waited for), after two warm-up calls."""
    ready(fn())
    ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ready(fn())
        times.append(time.perf_counter() - t0)
    return max(float(np.median(times)), 1e-9)


def median_time_pair(fn_a: Callable[[], Any], fn_b: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """Medians of ``repeats`` timed calls each of ``fn_a`` and ``fn_b``, taking turns call by call (so a change of
    load on a shared machine hits both alike), after two warm-up calls of each."""
    for _ in range(2):
        ready(fn_a())
        ready(fn_b())
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, ts in ((fn_a, times[0]), (fn_b, times[1])):
            t0 = time.perf_counter()
            ready(fn())
            ts.append(time.perf_counter() - t0)
    return max(float(np.median(times[0])), 1e-9), max(float(np.median(times[1])), 1e-9)


def ready(x: Any) -> Any:
    """Wait for every array in ``x``."""
    import jax

    return jax.block_until_ready(x)


def best_time(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Fastest of ``repeats`` runs after one warm-up (which also compiles): least disturbed by other load."""
    fn(*args).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def best_time_inplace(fn: Callable[[Any], Any], x: Any, repeats: int) -> float:
    """Like :func:`best_time` for a jitted ``fn`` that donates its argument: x = fn(x) reuses one buffer.

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
