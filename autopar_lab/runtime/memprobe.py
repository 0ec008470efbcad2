"""Memory measured while a plan runs on local devices: each device's peak, and the process's peak resident memory.

On CPU, XLA keeps no per-device memory statistics (``device.memory_stats()`` is None), and the 8 virtual CPU devices
share one process. So a device's peak is measured as XLA itself accounts for it: before each program the runtime
launches on the device (a stage task, a stage update, the one-stage step), the bytes of every live array's shard on
the device (``jax.live_arrays()``: parameters, optimizer state, gradient sums, stashed activations, values received
from other stages), plus what the program adds while it runs, from its compiled memory analysis (its outputs less
the donated inputs they reuse, and its temporary buffers, per device: the figures XLA allocates from). The peak over a
step is the device's measured peak (:class:`DeviceMemoryProbe`). Beside it, :class:`PeakRSS` samples the process's
resident memory, the figure the kernel holds the machine to: all devices together, plus the Python process, JAX and
the compiled code.

Used by :meth:`autopar_lab.runtime.local.Runner.measure_memory`; on GPUs the same figures are XLA's allocations.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Any, Iterable

import jax

__all__ = ["DeviceMemoryProbe", "PeakRSS", "live_bytes", "process_rss", "program_extra_bytes"]


def live_bytes() -> dict[Any, int]:
    """Device -> bytes of every live (not deleted) array's shards on it, each buffer counted once (a shard read as
    an array of its own, ``shard.data``, is one more live array over the same buffer)."""
    out: dict[Any, int] = {}
    seen: set[tuple[Any, int]] = set()
    for a in jax.live_arrays():
        if a.is_deleted():
            continue
        for s in a.addressable_shards:
            x = s.data
            key = (s.device, x.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                out[s.device] = out.get(s.device, 0) + int(x.nbytes)
    return out


def program_extra_bytes(fn, args) -> int | None:
    """What jitted ``fn`` adds on each of its devices while it runs on ``args``: output bytes less the donated input
    bytes they reuse, plus temporaries (XLA's compiled memory analysis, per device); None where XLA gives none. The
    program is compiled already when it has run before (jax caches it), so this costs a trace."""
    stats = fn.lower(*args).compile().memory_analysis()
    if stats is None:
        return None
    return int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes) + int(stats.temp_size_in_bytes)


def process_rss() -> int:
    """The process's resident memory now, in bytes (Linux's /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class DeviceMemoryProbe:
    """Called before each program with ``(devices, fn, args)``: keeps each device's peak (see the module docstring).

    ``peak``: device -> bytes; ``programs``: how many programs it saw."""

    def __init__(self):
        self.peak: dict[Any, int] = {}
        self.programs = 0
        # (program, argument shapes and layouts) -> what it adds: lowering traces the program again (seconds for a
        # large stage), and a pipeline runs each task program once per microbatch on the same shapes
        self._extra: dict[tuple, int] = {}

    def __call__(self, devices: Iterable, fn, args) -> None:
        key = (id(fn), tuple((getattr(a, "shape", None), str(getattr(a, "dtype", "")), getattr(a, "sharding", None))
                             for a in args))
        if key not in self._extra:
            self._extra[key] = program_extra_bytes(fn, args) or 0
        extra = self._extra[key]
        live = live_bytes()
        self.programs += 1
        for d in devices:
            self.peak[d] = max(self.peak.get(d, 0), live.get(d, 0) + extra)


class PeakRSS:
    """A context that samples the process's resident memory every ``interval_s``: ``start``, ``peak`` (bytes) and
    ``growth`` (peak less start)."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = float(interval_s)
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _watch(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, process_rss())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = process_rss()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, process_rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start
