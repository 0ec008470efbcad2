"""The cluster model: devices, links, clusters, Alpa's submeshes, logical meshes and collective costs.

Units everywhere: bandwidth in bytes/s, latency in s, memory in bytes, compute in FLOP/s (floats).

>>> c = Cluster.preset("p3.16xlarge", hosts=2)
>>> c.num_devices, c.submesh_shapes()[:3]
(16, [(1, 1), (1, 2), (1, 4)])
>>> mesh = c.logical_mesh((2, 8), (2, 8))
>>> mesh.axis_link(1) == c.intra_host, mesh.axis_link(0).bandwidth == c.inter_host.bandwidth / 8
(True, True)

Nothing here imports jax at module import time: presets, costs and JSON work on any machine, and the
``cpu`` preset and :meth:`LogicalMesh.to_jax_mesh` import jax only when called.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence, Union

import numpy as np

__all__ = [
    "Device",
    "Efficiency",
    "Link",
    "Cluster",
    "LogicalMesh",
    "send_recv",
    "PRESETS",
    "CPU_PROFILE_PATH",
    "CPU_PROFILE_KIND",
]

Axis = Union[int, tuple]

#: Where the ``cpu`` preset reads its measured figures (regenerate with ``python -m autopar_lab.calibrate``).
CPU_PROFILE_PATH = Path(__file__).resolve().parent / "profiles" / "cpu.json"
#: The ``kind`` a profile written by :mod:`autopar_lab.calibrate` carries (``Cluster.from_json`` reads one as the
#: ``cpu`` preset with its figures).
CPU_PROFILE_KIND = "autopar-lab cpu profile"

#: Bounds on a cluster's size, checked where a Cluster is made: past them the planner's tables (a submesh shape per
#: host count, a mesh view per divisor) would take longer than anyone waits. Alpa's largest runs used 8 hosts x 8.
MAX_HOSTS = 1024
MAX_DEVICES_PER_HOST = 1024

#: The names :meth:`Cluster.preset` and :meth:`Cluster.parse` accept.
PRESETS = ("p3.16xlarge", "dgx-a100", "dgx-h100", "cpu")

_GB = 1e9  # decimal gigabyte: vendors quote bandwidth in GB/s = 1e9 bytes/s
_GIB = 2**30  # binary gibibyte: HBM capacities are powers of two (a "16 GB" V100 holds 16 GiB)
_GBIT = 1e9 / 8  # one Gb/s in bytes/s


# ----------------------------------------------------------------------------------------------------------
# Small checks shared by the constructors and the JSON loader (one sentence, saying what to change).


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_power_of_two(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def _check_positive(value: Any, what: str, unit: str) -> float:
    """Return ``value`` as a float, or raise if it is not a finite number above zero."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number in {unit}, got {value!r}; give it a positive number.") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what} must be a positive finite number in {unit}, got {value!r}; set it above zero.")
    return v


def _check_link(bandwidth: Any, latency: Any, what: str) -> tuple[float, float]:
    bw = _check_positive(bandwidth, f"{what} bandwidth", "bytes/s")
    try:
        lat = float(latency)
    except (TypeError, ValueError):
        raise ValueError(f"{what} latency must be a number in seconds, got {latency!r}; give it 0 or more.") from None
    if not math.isfinite(lat) or lat < 0:
        raise ValueError(f"{what} latency must be a finite number of seconds >= 0, got {latency!r}; set it to 0 or more.")
    return bw, lat


def _dtype_name(dtype: Any) -> str:
    """'float32' for np.float32, jnp.bfloat16, np.dtype('float32'), a ShapeDtypeStruct's dtype or 'float32'."""
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name  # numpy dtypes, scalar types, and ml_dtypes (bfloat16) once registered
    except TypeError:
        pass
    for attr in ("name", "__name__"):
        name = getattr(dtype, attr, None)
        if isinstance(name, str):
            return name
    return str(dtype)


# ----------------------------------------------------------------------------------------------------------
# Device and Link


@dataclass(frozen=True)
class Efficiency:
    """What a device achieves of its datasheet figures: the one place the cost model's achievable rates live.

    Every kernel is priced as ``max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth) + kernel_launch_s``
    (:meth:`Device.kernel_s`), with:

    - ``matmul``: the fraction of ``peak_flops`` a large, well-shaped GEMM reaches (the maximum achievable matmul
      FLOP/s over peak), measured at a GEMM whose inner dimension is ``matmul_k``;
    - ``cores``, ``tile``: streaming multiprocessors and the GEMM output tile edge: a GEMM of ``t`` output tiles runs
      in ``ceil(t / cores)`` waves, only part of the last one busy, and pads its edges to whole tiles (wave and tile
      quantisation, :meth:`wave_fraction`; 0 cores: none);
    - ``k_overhead``: the inner-dimension length a GEMM tile's software pipeline spends filling and draining, so a
      GEMM of inner dimension k reaches ``k / (k + k_overhead)`` of what a long one does (relative to ``matmul_k``,
      the shape ``matmul`` was measured at; never above 1);
    - ``memory``: the fraction of ``memory_bandwidth`` a streaming kernel reaches;
    - ``attention``: the fraction of ``peak_flops`` a fused (flash) attention kernel reaches on the FLOPs it runs;
    - ``flash_attention``: whether attention runs as one fused kernel on this device by default (the s x s scores
      never reach memory); a plan may choose otherwise (``cluster.with_(flash_attention=False)``);
    - ``kernel_launch_s``: the gap one kernel launch leaves between kernels, per kernel per microbatch;
    - ``buffer_s``: the fixed cost per state array (a parameter or optimizer-state tensor, all its shards) that the
      step's update program takes and returns, once per step: the runtime's dispatch of its buffers (measured on the
      ``cpu`` preset, where it is tens of microseconds, with every array on all the host's devices: a mesh of fewer
      virtual devices pays its share; 0 on the GPU presets, whose executables keep their buffers);
    - ``driver_share``: on virtual devices (:attr:`Device.virtual`), the part of a kernel's cost that does not
      shrink with the devices running it, in devices: a program on ``d`` of a host's ``D`` devices pays
      ``(d + driver_share) / (D + driver_share)`` of its kernels' calibrated cost (measured with all ``D`` busy), as
      the devices share the machine's cores and one driver dispatches them all (:meth:`Cluster.virtual_share`).
    - ``chain_reads``: where the compiler fuses a gradient-accumulation chain into every kernel that reads it (XLA
      on CPU: the residual stream's gradient, a sum with one term per later layer, is not written once but summed
      again inside each consumer kernel of each layer's backward), the times each backward kernel of a layer reads
      one later layer's term, in units of the chain's link tensor (:attr:`LayerCost.chain_s
      <autopar_lab.pricing.layers.LayerCost>`): a backward program of n layers reads ~n^2/2 link tensors x
      ``chain_reads``. Measured on the ``cpu`` preset (:func:`autopar_lab.calibrate.measure_chain_reads`), where a
      24-layer backward ran 2x its kernels' time; 0 elsewhere (XLA on GPU caps a fusion's operands, and the
      presets' figures are fitted without it).

    The defaults are the datasheet itself (every rate at 100%) with the launch figure the planner always used, so a
    device described only by its datasheet (a JSON cluster file) prices as before. The presets say what they assume
    and where each figure comes from.

    >>> e = Efficiency(matmul=0.86, cores=108, tile=128)
    >>> e.wave_fraction(6912, 16384)       # 54 x 128 tiles of 128 x 128: 64 full waves of 108
    1.0
    >>> round(e.wave_fraction(2048, 2304), 3)   # 288 tiles in 3 waves of 108 (0.889); 1152 of 64 x 64 in 11 (0.970)
    0.97
    """

    matmul: float = 1.0
    matmul_k: int = 0
    cores: int = 0
    tile: int = 128
    k_overhead: int = 0
    memory: float = 1.0
    attention: float = 1.0
    flash_attention: bool = False
    kernel_launch_s: float = 5e-6
    buffer_s: float = 0.0
    driver_share: float = 0.0
    chain_reads: float = 0.0

    def __post_init__(self) -> None:
        for f in ("matmul", "memory", "attention"):
            v = _check_positive(getattr(self, f), f"efficiency.{f}", "(a fraction of the datasheet figure)")
            if v > 1:
                raise ValueError(f"efficiency.{f} is {v}, above the datasheet figure; give a fraction in (0, 1].")
            object.__setattr__(self, f, v)
        for f in ("matmul_k", "cores", "tile", "k_overhead"):
            v = getattr(self, f)
            if not _is_int(v) or v < 0 or (f == "tile" and v < 1):
                raise ValueError(f"efficiency.{f} must be a whole number >= {1 if f == 'tile' else 0}, got {v!r}.")
        launch = self.kernel_launch_s
        if not isinstance(launch, numbers.Real) or not math.isfinite(launch) or launch < 0:
            raise ValueError(f"efficiency.kernel_launch_s must be a finite number of seconds >= 0, got {launch!r}.")
        object.__setattr__(self, "kernel_launch_s", float(launch))
        buf = self.buffer_s
        if not isinstance(buf, numbers.Real) or not math.isfinite(buf) or buf < 0:
            raise ValueError(f"efficiency.buffer_s must be a finite number of seconds >= 0, got {buf!r}.")
        object.__setattr__(self, "buffer_s", float(buf))
        share = self.driver_share
        if not isinstance(share, numbers.Real) or not math.isfinite(share) or share < 0:
            raise ValueError(f"efficiency.driver_share must be a finite number of devices >= 0, got {share!r}.")
        object.__setattr__(self, "driver_share", float(share))
        reads = self.chain_reads
        if not isinstance(reads, numbers.Real) or not math.isfinite(reads) or reads < 0:
            raise ValueError(f"efficiency.chain_reads must be a finite number >= 0 (reads per later layer), got "
                             f"{reads!r}.")
        object.__setattr__(self, "chain_reads", float(reads))
        object.__setattr__(self, "flash_attention", bool(self.flash_attention))

    def wave_fraction(self, m: int, n: int, batch: int = 1) -> float:
        """The fraction of the cores' time a GEMM of ``batch`` x (m x n) outputs spends on useful work: its output
        tiles (a dimension smaller than the tile gets a tile its size, rounded up to a power of two) are padded to
        whole tiles and run in ``ceil(tiles / cores)`` waves, the last one partly idle. A problem of less than one
        wave is split along its inner dimension to fill the cores (split-K) and loses nothing to waves. A library
        picks among tile sizes: the better of ``tile`` and ``tile / 2`` is taken."""
        if not self.cores:
            return 1.0
        m, n, batch = max(int(m), 1), max(int(n), 1), max(int(batch), 1)
        best = 0.0
        for t in (self.tile, max(self.tile // 2, 1)):
            tm, tn = min(t, 1 << (m - 1).bit_length()), min(t, 1 << (n - 1).bit_length())
            tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
            pad = m * n * batch / (tiles * tm * tn)
            wave = tiles / (math.ceil(tiles / self.cores) * self.cores) if tiles >= self.cores else 1.0
            best = max(best, pad * wave)
        return best

    def k_fraction(self, k: float) -> float:
        """What a GEMM of inner dimension ``k`` reaches of one of inner dimension ``matmul_k`` (at most 1)."""
        if not self.k_overhead or k <= 0:
            return 1.0
        ref = self.matmul_k or k
        return min((k / (k + self.k_overhead)) / (ref / (ref + self.k_overhead)), 1.0)

    def to_dict(self) -> dict:
        """Only the fields that differ from the defaults (a plain datasheet device has none)."""
        base = Efficiency()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(base, f.name)}

    @classmethod
    def from_dict(cls, data: Any) -> "Efficiency":
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise ValueError(f"device.efficiency must be an object of achievable fractions, got {data!r}; see "
                             "autopar_lab.cluster.Efficiency for its fields.")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(data) - known)
        if bad:
            raise ValueError(f"device.efficiency has unknown field(s) {bad}; use some of {sorted(known)}.")
        return cls(**dict(data))


@dataclass(frozen=True)
class Device:
    """One accelerator: peak compute per dtype, memory size, memory bandwidth and the fixed cost of one task.

    ``task_overhead_s``: host time one pipeline task costs beyond its operators (launching a stage's compiled
    forward or backward program for one microbatch and moving its inputs onto the stage's devices). The GPU presets
    leave it 0 (a few microseconds of launch, below the per-operator launch overhead the planner already charges);
    the ``cpu`` preset reads the figure :mod:`autopar_lab.calibrate` measured for the local runtime.

    ``virtual``: the host's devices are slices of one machine's cores, as JAX's CPU devices are
    (``JAX_NUM_CPU_DEVICES``): one driver thread and the same cores run every device's work, so the tasks of
    different stages on a host run one after another, not at once, and ``task_overhead_s`` is paid per device of
    the task (each device's part of a program is launched and synchronised on the shared cores). False for real
    accelerators (see :func:`autopar_lab.pricing.stage.task_overhead_s` and :func:`autopar_lab.simulate.simulate`).

    >>> d = Device("toy", {"float32": 1e12, "bfloat16": 4e12}, memory_bytes=2**30, memory_bandwidth=1e11)
    >>> d.peak("bfloat16"), d.peak(np.float32), d.peak("int8"), d.task_overhead_s   # unknown dtype -> float32's
    (4000000000000.0, 1000000000000.0, 1000000000000.0, 0.0)
    """

    name: str
    peak_flops: Mapping[str, float]  # dtype name -> FLOP/s; must include "float32" (the fallback)
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    task_overhead_s: float = 0.0  # seconds per pipeline task (stage forward or backward of one microbatch)
    virtual: bool = False  # devices that share one machine's cores (JAX CPU devices): see the docstring
    # FLOP/s of elementwise work outside the matrix units (CUDA cores), per dtype; None: ``peak_flops``.
    vector_flops: Mapping[str, float] | None = None
    efficiency: Efficiency = Efficiency()

    def __post_init__(self) -> None:
        if not isinstance(self.peak_flops, Mapping) or "float32" not in self.peak_flops:
            raise ValueError(
                f"device {self.name!r} peak_flops must be a mapping of dtype name to FLOP/s that includes 'float32' "
                f"(the fallback for other dtypes), got {self.peak_flops!r}; add a 'float32' entry."
            )
        flops = {
            _dtype_name(k): _check_positive(v, f"device {self.name!r} peak_flops[{_dtype_name(k)!r}]", "FLOP/s")
            for k, v in self.peak_flops.items()
        }
        # A read-only view keeps the dataclass honestly immutable; __hash__ below makes it hashable.
        object.__setattr__(self, "peak_flops", MappingProxyType(flops))
        object.__setattr__(self, "memory_bytes", _check_positive(self.memory_bytes, f"device {self.name!r} memory_bytes", "bytes"))
        object.__setattr__(
            self, "memory_bandwidth", _check_positive(self.memory_bandwidth, f"device {self.name!r} memory_bandwidth", "bytes/s")
        )
        try:
            overhead = float(self.task_overhead_s)
        except (TypeError, ValueError):
            overhead = math.nan
        if not math.isfinite(overhead) or overhead < 0:
            raise ValueError(f"device {self.name!r} task_overhead_s must be a finite number of seconds >= 0, got "
                             f"{self.task_overhead_s!r}; give 0 for no per-task overhead.")
        object.__setattr__(self, "task_overhead_s", overhead)
        if not isinstance(self.virtual, (bool, np.bool_)):
            raise ValueError(f"device {self.name!r} virtual must be true or false, got {self.virtual!r}.")
        object.__setattr__(self, "virtual", bool(self.virtual))
        if self.vector_flops is not None:
            if not isinstance(self.vector_flops, Mapping):
                raise ValueError(f"device {self.name!r} vector_flops must be a mapping of dtype name to FLOP/s or None, "
                                 f"got {self.vector_flops!r}.")
            vec = {_dtype_name(k): _check_positive(v, f"device {self.name!r} vector_flops[{_dtype_name(k)!r}]",
                                                   "FLOP/s") for k, v in self.vector_flops.items()}
            object.__setattr__(self, "vector_flops", MappingProxyType(vec))
        if isinstance(self.efficiency, Mapping):
            object.__setattr__(self, "efficiency", Efficiency.from_dict(self.efficiency))
        if not isinstance(self.efficiency, Efficiency):
            raise ValueError(f"device {self.name!r} efficiency must be an Efficiency, got {self.efficiency!r}.")

    def __hash__(self) -> int:
        vec = tuple(sorted(self.vector_flops.items())) if self.vector_flops is not None else None
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory_bytes, self.memory_bandwidth,
                     self.task_overhead_s, vec, self.efficiency, self.virtual))

    def peak(self, dtype: Any = "float32") -> float:
        """Peak FLOP/s for ``dtype`` (a name, numpy/jax dtype or scalar type); float32's figure if unknown."""
        return self.peak_flops.get(_dtype_name(dtype), self.peak_flops["float32"])

    # -- achievable rates: what a kernel's time is made of (figures in :class:`Efficiency`) --------------------

    def vector_rate(self, dtype: Any = "float32") -> float:
        """FLOP/s of elementwise and reduction work in ``dtype`` (outside the matrix units)."""
        table = self.vector_flops if self.vector_flops is not None else self.peak_flops
        return table.get(_dtype_name(dtype), table.get("float32", self.peak_flops["float32"]))

    def matmul_rate(self, dtype: Any, m: int, n: int, k: float, batch: int = 1) -> float:
        """Achievable FLOP/s of a (batch x) m x k by k x n GEMM in ``dtype``: peak x ``efficiency.matmul`` x the
        wave fraction of its output tiles x the inner-dimension fraction (see :class:`Efficiency`).

        >>> a100 = Cluster.preset("dgx-a100").device
        >>> round(a100.matmul_rate("float16", 6912, 16384, 2048) / 1e12, 1)   # the shape its efficiency was measured at
        267.9
        """
        e = self.efficiency
        return self.peak(dtype) * e.matmul * e.wave_fraction(m, n, batch) * e.k_fraction(k)

    def attention_rate(self, dtype: Any) -> float:
        """Achievable FLOP/s of a fused attention kernel on the FLOPs it runs."""
        return self.peak(dtype) * self.efficiency.attention

    @property
    def achievable_bandwidth(self) -> float:
        """Bytes/s a streaming kernel reaches: ``memory_bandwidth`` x ``efficiency.memory``."""
        return self.memory_bandwidth * self.efficiency.memory

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            # Only when set: the GPU presets' dicts (and plan files saved before the field existed) stay as they were.
            **({"task_overhead_s": self.task_overhead_s} if self.task_overhead_s else {}),
            **({"virtual": True} if self.virtual else {}),
            **({"vector_flops": dict(self.vector_flops)} if self.vector_flops is not None else {}),
            **({"efficiency": self.efficiency.to_dict()} if self.efficiency != Efficiency() else {}),
        }


@dataclass(frozen=True)
class Link:
    """A communication link in the alpha-beta model: time(B bytes) = latency + B / bandwidth.

    >>> Link(bandwidth=1e9, latency=1e-5).transfer_time(1e9)
    1.00001
    """

    bandwidth: float  # bytes/s
    latency: float  # s

    def __post_init__(self) -> None:
        bw, lat = _check_link(self.bandwidth, self.latency, "link")
        object.__setattr__(self, "bandwidth", bw)
        object.__setattr__(self, "latency", lat)

    @property
    def beta(self) -> float:
        """Inverse bandwidth, seconds per byte (the b of the alpha-beta formulas)."""
        return 1.0 / self.bandwidth

    def transfer_time(self, nbytes: float) -> float:
        """Point-to-point time for ``nbytes``: latency + nbytes / bandwidth (0 for an empty message)."""
        return 0.0 if nbytes <= 0 else self.latency + nbytes / self.bandwidth

    def to_dict(self) -> dict:
        return {"bandwidth": self.bandwidth, "latency": self.latency}


def send_recv(nbytes: float, link: Link) -> float:
    """Time to send ``nbytes`` from one stage's submesh to the next over ``link`` (see Cluster.p2p_link).

    >>> send_recv(25e9 / 8, Link(25e9 / 8, 50e-6))   # 25 Gb/s moves 3.125 GB in one second
    1.00005
    """
    return link.transfer_time(nbytes)


# ----------------------------------------------------------------------------------------------------------
# Presets. Peak figures are vendor datasheet numbers; achievable fractions (Efficiency) and link figures are what
# measurements report, each with its source or, where none was found, what is assumed and why. bench/RESULTS.md
# ("The cost model against published runs") lists them again beside the runs they were checked against.

# Maximum achievable matmul FLOP/s (MAMF: the best of a brute-force search over large BF16 GEMM shapes, Bekman,
# "Machine Learning Engineering", compute/accelerator): A100 SXM 267.9 of 312 TFLOP/s (85.9%) at 6912x16384x2048,
# H100 SXM 792.1 of 989 (80.1%) at 6144x17920x2816. No MAMF is published for the V100: 0.80 is assumed (the
# A100/H100 figures bracket it). Streaming kernels: copy kernels reach about 90% of HBM bandwidth (a measured
# 4 GiB copy: 3.57 of 3.94 TB/s on an H100 NVL); 0.9 for every GPU. Wave quantisation: 80 / 108 / 132 SMs, 128 x 128
# output tiles. k_overhead 64 (assumed): a GEMM tile's multistage pipeline (4 stages of 32-deep K slices in
# CUTLASS/cuBLAS's Ampere kernels) is filled and drained once per tile, about half of it hidden by the other tile
# an SM runs at once; the published rows move by under 0.5% between 0 and 128 (bench/RESULTS.md). Fused attention: FlashAttention-2 reaches 50-73% of peak on
# an A100 (Dao 2023; forward up to 73%, backward lower): 0.6; on an H100 FlashAttention-2/cuDNN reach about 50%;
# the V100 has no flash-attention kernel (FlashAttention needs sm80+), so attention there runs as matmuls and a
# softmax through memory. Kernel launch: consecutive kernels of one XLA executable leave about 3 us between them
# (1.3 us replayed from a CUDA graph, 4.2 us issued one by one from Python, measured on an H100).
_V100_EFF = Efficiency(matmul=0.80, matmul_k=2048, cores=80, tile=128, k_overhead=64, memory=0.9, attention=0.5,
                       flash_attention=False, kernel_launch_s=3e-6)
_A100_EFF = Efficiency(matmul=267.9 / 312, matmul_k=2048, cores=108, tile=128, k_overhead=64, memory=0.9,
                       attention=0.6, flash_attention=True, kernel_launch_s=3e-6)
_H100_EFF = Efficiency(matmul=792.1 / 989, matmul_k=2816, cores=132, tile=128, k_overhead=64, memory=0.9,
                       attention=0.5, flash_attention=True, kernel_launch_s=3e-6)

# NVIDIA Tesla V100 datasheet (SXM2 16 GB): FP64 7.8 TFLOPS, FP32 15.7 TFLOPS, tensor (FP16) 125 TFLOPS,
# HBM2 16 GB at 900 GB/s, NVLink 300 GB/s (aggregate both directions, 6 links x 25 GB/s x 2). Outside the tensor
# cores, FP16 runs at twice FP32 (packed half2): 31.4 TFLOPS.
_V100 = Device(
    name="V100-SXM2-16GB",
    peak_flops={
        "float64": 7.8e12,
        "float32": 15.7e12,
        "float16": 125e12,
        # V100 has no bfloat16 units; XLA computes bf16 at (at best) the fp32 rate.
        "bfloat16": 15.7e12,
    },
    memory_bytes=16 * _GIB,
    memory_bandwidth=900 * _GB,
    vector_flops={"float64": 7.8e12, "float32": 15.7e12, "float16": 31.4e12, "bfloat16": 15.7e12},
    efficiency=_V100_EFF,
)

# NVIDIA A100 datasheet (SXM 80 GB), dense figures: FP64 9.7, FP64 tensor 19.5, FP32 19.5, TF32 156,
# BF16/FP16 tensor 312 TFLOPS; HBM2e 80 GB at 2,039 GB/s; NVLink3 600 GB/s aggregate (300 GB/s each way).
# Outside the tensor cores (A100 whitepaper, table 1): FP16 78, BF16 39, FP32 19.5 TFLOPS.
_A100 = Device(
    name="A100-SXM-80GB",
    peak_flops={
        "float64": 19.5e12,  # FP64 tensor cores
        "float32": 19.5e12,  # CUDA cores; XLA uses TF32 for f32 dots only at reduced precision settings
        "tfloat32": 156e12,
        "float16": 312e12,
        "bfloat16": 312e12,
    },
    memory_bytes=80 * _GIB,
    memory_bandwidth=2039 * _GB,
    vector_flops={"float64": 9.7e12, "float32": 19.5e12, "float16": 78e12, "bfloat16": 39e12},
    efficiency=_A100_EFF,
)

# NVIDIA H100 datasheet (SXM5 80 GB), dense figures (the sheet's headline numbers are 2:4-sparse, i.e. 2x):
# FP64 34, FP64 tensor 67, FP32 67, TF32 494.7, BF16/FP16 989.4, FP8 1,978.9 TFLOPS;
# HBM3 80 GB at 3.35 TB/s; NVLink4 900 GB/s aggregate (450 GB/s each way). Outside the tensor cores (the Hopper
# architecture blog's table 3, H100 SXM5): FP16/BF16 120, FP32 60 TFLOPS.
_H100 = Device(
    name="H100-SXM5-80GB",
    peak_flops={
        "float64": 67e12,
        "float32": 67e12,
        "tfloat32": 494.7e12,
        "float16": 989.4e12,
        "bfloat16": 989.4e12,
        "float8_e4m3fn": 1978.9e12,
        "float8_e5m2": 1978.9e12,
    },
    memory_bytes=80 * _GIB,
    memory_bandwidth=3350 * _GB,
    vector_flops={"float64": 34e12, "float32": 60e12, "float16": 120e12, "bfloat16": 120e12},
    efficiency=_H100_EFF,
)

# Links carry achievable bus bandwidth (what NCCL's busbw reports for large all-reduces: the per-device rate of the
# ring's bottleneck link) and a per-step latency (one hop of a ring, one level of a tree): see LogicalMesh.
# InfiniBand: 4 DGX-class nodes with 8 x 400 Gb/s NICs reach 376.7 GB/s of all-reduce busbw of their 400 GB/s
# (94%, all_reduce_bench at 16 GiB, Bekman, network/benchmarks); 0.94 of the NIC aggregate for every IB preset.
# NVSwitch: without SHARP/NVLS, NCCL all-reduce on 8 A100s reaches about 230-240 GB/s of the 300 GB/s each way
# (nccl-tests sweeps as NVIDIA and cloud vendors publish them; no single source was at hand): 0.78 assumed for
# NVSwitch nodes, and for the V100's hybrid cube mesh NCCL's rings reach about 130 of 150 GB/s. Latencies per step:
# ~2 us over NVLink, ~7 us over InfiniBand (NCCL's small-message all-reduce takes ~10-15 us on 8 GPUs and ~25 us
# across 2 nodes: a tree of log2(8) = 3 levels each way in a node, one more across), 50 us over TCP.
_GPU_PRESETS: dict[str, dict] = {
    # AWS p3.16xlarge (Alpa's testbed): 8 x V100 in a hybrid cube-mesh; AWS lists "up to 25 Gbps" networking.
    "p3.16xlarge": dict(
        devices_per_host=8,
        device=_V100,
        # NCCL rings over NVLink2's hybrid cube mesh: ~130 GB/s bus bandwidth; ~3 us per step.
        intra_host=Link(bandwidth=130 * _GB, latency=3e-6),
        # 25 Gb/s ENA Ethernet (TCP, no EFA on p3.16xlarge): 3.125 GB/s per host, ~90% of it achieved; ~50 us per
        # message over TCP.
        inter_host=Link(bandwidth=0.9 * 25 * _GBIT, latency=50e-6),
    ),
    # NVIDIA DGX A100: 8 x A100 80 GB on NVSwitch; 8 x ConnectX-6 200 Gb/s HDR InfiniBand for compute traffic.
    "dgx-a100": dict(
        devices_per_host=8,
        device=_A100,
        # 0.78 x 300 GB/s per GPU each way through NVSwitch; ~2 us per step in a node.
        intra_host=Link(bandwidth=0.78 * 300 * _GB, latency=2e-6),
        # 0.94 x 8 x 200 Gb/s (200 GB/s per host); ~7 us per step across IB.
        inter_host=Link(bandwidth=0.94 * 8 * 200 * _GBIT, latency=7e-6),
    ),
    # NVIDIA DGX H100: 8 x H100 80 GB on NVLink4 / NVSwitch; 8 x ConnectX-7 400 Gb/s NDR InfiniBand.
    "dgx-h100": dict(
        devices_per_host=8,
        device=_H100,
        # 0.78 x 450 GB/s per GPU each way (NVLink4 900 GB/s aggregate); NVLS (SHARP in the switch) would give
        # more for all-reduce (482 GB/s measured on 8 x H200), not modelled; ~2 us per step in a node.
        intra_host=Link(bandwidth=0.78 * 450 * _GB, latency=2e-6),
        # 0.94 x 8 x 400 Gb/s (400 GB/s per host); ~7 us per step across NDR IB.
        inter_host=Link(bandwidth=0.94 * 8 * 400 * _GBIT, latency=7e-6),
    ),
}


def _local_cpu_device_count() -> int:
    import jax  # lazy: planning for GPU presets must not need jax initialised

    return len(jax.devices("cpu"))


def _cpu_preset(hosts: int, path: str | os.PathLike | None = None) -> "Cluster":
    """The ``cpu`` preset: this machine's JAX CPU devices with figures measured by autopar_lab.calibrate (the
    shipped profile, or the one at ``path``)."""
    where = Path(path) if path is not None else CPU_PROFILE_PATH
    try:
        profile = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"the cpu preset needs the profile {where} ({e}); regenerate it with `python -m autopar_lab.calibrate"
            f" --out {where}`."
        ) from None
    return _cpu_cluster(profile, hosts, str(where))


def _cpu_cluster(profile: Any, hosts: int, where: str) -> "Cluster":
    """The cpu preset's cluster from a profile's contents (``where``: its file, for messages)."""
    if not isinstance(profile, Mapping) or not all(isinstance(profile.get(k), Mapping)
                                                   for k in ("device", "intra_host", "inter_host")):
        raise ValueError(f"{where} is not a cpu profile (it needs 'device', 'intra_host' and 'inter_host' objects); "
                         f"write one with `python -m autopar_lab.calibrate --out {where}`.")
    n = _local_cpu_device_count()
    if not _is_power_of_two(n):
        raise ValueError(
            f"the cpu preset found {n} JAX CPU devices but needs a power of two; "
            "set JAX_NUM_CPU_DEVICES=8 (or 1, 2, 4, ...) before jax is imported."
        )
    dev = profile["device"]
    # Memory is the machine's RAM split across however many devices JAX exposes now, not at measurement time.
    total = float(profile.get("total_memory_bytes", dev["memory_bytes"] * profile.get("num_devices", 1)))
    device = Device(
        name=dev.get("name", "cpu"),
        peak_flops=dev["peak_flops"],
        memory_bytes=total / n,
        memory_bandwidth=dev["memory_bandwidth"],
        task_overhead_s=dev.get("task_overhead_s", 0.0),  # profiles written before it was measured: none
        virtual=bool(dev.get("virtual", False)),  # JAX's CPU devices share the machine's cores
        # Measured per-kernel overhead and the like (profiles written before they were measured: the defaults).
        efficiency=Efficiency.from_dict(dev.get("efficiency")),
    )
    return Cluster(
        hosts=hosts,
        devices_per_host=n,
        device=device,
        intra_host=Link(**profile["intra_host"]),
        inter_host=Link(**profile["inter_host"]),
        name="cpu",
    )


# ----------------------------------------------------------------------------------------------------------
# Cluster


_SPEC_HELP = (
    "use PRESET:HOSTS with PRESET one of " + ", ".join(PRESETS) + " and HOSTS a positive integer "
    "(e.g. 'p3.16xlarge:2'), or a path to a JSON cluster file"
)


@dataclass(frozen=True)
class Cluster:
    """N hosts x M devices, one device type, one link inside a host and one between hosts.

    ``inter_host`` is the whole host's network bandwidth (all its NICs), shared by its devices; see
    :meth:`LogicalMesh.axis_link`. Devices are numbered host-major: device d sits in host ``d // M``.

    >>> c = Cluster(hosts=2, devices_per_host=4, device=Device("toy", {"float32": 1e12}, 2**30, 1e11),
    ...             intra_host=Link(1e11, 1e-6), inter_host=Link(1e10, 1e-5))
    >>> c.num_devices, c.host_of(5)
    (8, 1)
    """

    hosts: int
    devices_per_host: int
    device: Device
    intra_host: Link
    inter_host: Link
    name: str = "custom"

    def __post_init__(self) -> None:
        for field, value, most in (("hosts", self.hosts, MAX_HOSTS),
                                   ("devices_per_host", self.devices_per_host, MAX_DEVICES_PER_HOST)):
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{field} must be a positive whole number, got {value!r}; set it to 1 or more.")
            if value > most:  # the planner's tables grow with both: a typo must not eat the machine's memory
                raise ValueError(f"{field} is {value}, more than the {most} autopar-lab plans for; set it to at "
                                 f"most {most}.")
        if not _is_power_of_two(self.devices_per_host):
            lower = 1 << (self.devices_per_host.bit_length() - 1)
            raise ValueError(
                f"devices_per_host must be a power of two (1, 2, 4, 8, ...), got {self.devices_per_host}, because "
                f"Alpa's submesh shapes (1,1), (1,2), (1,4) ... (1,M) can only tile a host of M devices when M is a "
                f"power of two; use {lower} (or {lower * 2}) devices per host."
            )
        if not isinstance(self.device, Device):
            raise ValueError(f"device must be a Device, got {type(self.device).__name__}; build one with Device(...).")
        for field in ("intra_host", "inter_host"):
            if not isinstance(getattr(self, field), Link):
                raise ValueError(f"{field} must be a Link, got {type(getattr(self, field)).__name__}; use Link(bandwidth, latency).")

    # -- basic facts ------------------------------------------------------------------------------------

    @property
    def serial_host(self) -> bool:
        """Whether a plan's stages all share one host's cores and driver (virtual devices, one host: the local
        ``cpu`` preset), so they run one task at a time: the stage DP prices a pipeline as the sum of its tasks."""
        return self.device.virtual and self.hosts == 1

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    def virtual_share(self, devices: int) -> float:
        """What a program on ``devices`` of one host pays of its kernels' calibrated cost: 1 on real accelerators
        (each runs its own kernels); on virtual devices, which share the machine's cores and were calibrated with
        all of a host's D devices busy, ``(d + driver_share) / (D + driver_share)`` (see :class:`Efficiency`).

        >>> c = Cluster.preset("dgx-a100")
        >>> c.virtual_share(2)
        1.0
        >>> v = c.with_(device=dataclasses.replace(c.device, virtual=True,
        ...             efficiency=Efficiency(driver_share=2.0)))
        >>> v.virtual_share(2), v.virtual_share(8)
        (0.4, 1.0)
        """
        if not self.device.virtual:
            return 1.0
        total = self.devices_per_host
        d = min(max(int(devices), 1), total)
        c = self.device.efficiency.driver_share
        return (d + c) / (total + c)

    def host_of(self, device: int) -> int:
        """The host index of a (host-major) device index."""
        return int(device) // self.devices_per_host

    # -- construction ---------------------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str, hosts: int = 1) -> "Cluster":
        """A named cluster: ``p3.16xlarge``, ``dgx-a100``, ``dgx-h100`` (8 GPUs per host) or ``cpu``.

        >>> Cluster.preset("dgx-a100", hosts=4).num_devices
        32
        """
        key = str(name).strip().lower()
        if not _is_int(hosts) or hosts <= 0:
            raise ValueError(f"hosts must be a positive whole number, got {hosts!r}; set it to 1 or more.")
        if hosts > MAX_HOSTS:
            raise ValueError(f"hosts is {hosts}, more than the {MAX_HOSTS} autopar-lab plans for; set it to at most "
                             f"{MAX_HOSTS}.")
        if key == "cpu":
            return _cpu_preset(hosts)
        if key not in _GPU_PRESETS:
            raise ValueError(f"unknown cluster preset {name!r}; {_SPEC_HELP}.")
        return cls(hosts=hosts, name=key, **_GPU_PRESETS[key])

    @classmethod
    def from_profile(cls, path: str | os.PathLike, hosts: int = 1) -> "Cluster":
        """The ``cpu`` preset with the figures of the profile at ``path`` (one ``python -m autopar_lab.calibrate
        --out PATH`` wrote) in place of the shipped one: this machine as it measures now (its speed moves with its
        load), for a prediction to set beside a run made at the same time.

        >>> from autopar_lab.cluster import CPU_PROFILE_PATH
        >>> Cluster.from_profile(CPU_PROFILE_PATH).name
        'cpu'
        """
        if not _is_int(hosts) or hosts <= 0 or hosts > MAX_HOSTS:
            raise ValueError(f"hosts must be a whole number from 1 to {MAX_HOSTS}, got {hosts!r}.")
        return _cpu_preset(hosts, path)

    @classmethod
    def parse(cls, spec: str) -> "Cluster":
        """``'PRESET:HOSTS'``, ``'PRESET'`` (one host) or a path to a JSON cluster file.

        >>> Cluster.parse("p3.16xlarge:2").hosts
        2
        """
        if isinstance(spec, Cluster):
            return spec
        if not isinstance(spec, (str, os.PathLike)):
            raise ValueError(f"bad cluster spec {spec!r}; {_SPEC_HELP}.")
        text = os.fspath(spec).strip()
        if text.lower().endswith(".json") or os.path.exists(text):
            return cls.from_json(text)
        name, sep, hosts_text = text.partition(":")
        if not sep:
            return cls.preset(name, 1)
        try:
            hosts = int(hosts_text)
        except ValueError:
            hosts = 0
        if hosts <= 0 or name.strip().lower() not in PRESETS:
            raise ValueError(f"bad cluster spec {text!r}; {_SPEC_HELP}.")
        return cls.preset(name, hosts)

    def to_dict(self) -> dict:
        """The JSON form (see :meth:`from_json`)."""
        return {
            "version": 1,
            "name": self.name,
            "hosts": self.hosts,
            "devices_per_host": self.devices_per_host,
            "device": self.device.to_dict(),
            "intra_host": self.intra_host.to_dict(),
            "inter_host": self.inter_host.to_dict(),
        }

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The cluster as JSON text; also written to ``path`` when given.

        >>> Cluster.from_json(Cluster.preset("dgx-h100").to_json()) == Cluster.preset("dgx-h100")
        True
        """
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike | Mapping) -> "Cluster":
        """A cluster from a dict, JSON text or a JSON file path. The form (units: bytes, bytes/s, s, FLOP/s)::

            {"version": 1, "name": "my-cluster", "hosts": 2, "devices_per_host": 8,
             "device": {"name": "V100", "peak_flops": {"float32": 15.7e12, "float16": 125e12},
                        "memory_bytes": 17179869184, "memory_bandwidth": 9e11},
             "intra_host": {"bandwidth": 1.5e11, "latency": 5e-6},
             "inter_host": {"bandwidth": 3.125e9, "latency": 5e-5}}

        ``inter_host.bandwidth`` is the whole host's network bandwidth. ``name`` and ``version`` are optional.
        """
        from .safeio import loads_json, read_text_file

        where = "cluster dict"
        if isinstance(source, Mapping):
            data = source
        elif not isinstance(source, (str, os.PathLike)):
            raise ValueError(f"a cluster must be a dict, JSON text or a JSON file path, got {type(source).__name__}; "
                             "use the form shown in Cluster.from_json.")
        else:
            text = os.fspath(source)
            if text.lstrip().startswith("{"):
                where = "cluster JSON text"
            else:
                where = f"cluster file {text!r}"
                # Untrusted like a plan file: a regular file, bounded in size (safeio says why).
                text = read_text_file(text, "cluster file", limit=1 << 20)
            try:
                data = loads_json(text, where)
            except ValueError as e:
                hint = "" if ";" in str(e) else "; fix it to the form shown in Cluster.from_json"
                raise ValueError(f"{str(e).rstrip('.')}{hint}.") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must hold a JSON object, got {type(data).__name__}; use the form shown in Cluster.from_json.")
        if data.get("kind") == CPU_PROFILE_KIND:  # a calibration of this machine: the cpu preset with its figures
            return _cpu_cluster(data, 1, where)

        def get(obj: Any, key: str, label: str) -> Any:
            if not isinstance(obj, Mapping) or key not in obj:
                raise ValueError(f"{where} is missing {label!r}; add it (see Cluster.from_json for the form).")
            return obj[key]

        dev = get(data, "device", "device")
        device = Device(
            name=str(dev.get("name", "device")) if isinstance(dev, Mapping) else "device",
            peak_flops=get(dev, "peak_flops", "device.peak_flops"),
            memory_bytes=get(dev, "memory_bytes", "device.memory_bytes"),
            memory_bandwidth=get(dev, "memory_bandwidth", "device.memory_bandwidth"),
            task_overhead_s=dev.get("task_overhead_s", 0.0) if isinstance(dev, Mapping) else 0.0,
            virtual=dev.get("virtual", False) if isinstance(dev, Mapping) else False,
            vector_flops=dev.get("vector_flops") if isinstance(dev, Mapping) else None,
            efficiency=Efficiency.from_dict(dev.get("efficiency") if isinstance(dev, Mapping) else None),
        )
        links = {}
        for field in ("intra_host", "inter_host"):
            raw = get(data, field, field)
            # Checked here with the field's name, so the message says which link is wrong.
            bw, lat = _check_link(get(raw, "bandwidth", f"{field}.bandwidth"), get(raw, "latency", f"{field}.latency"), field)
            links[field] = Link(bw, lat)
        return cls(
            hosts=get(data, "hosts", "hosts"),
            devices_per_host=get(data, "devices_per_host", "devices_per_host"),
            device=device,
            name=str(data.get("name", "custom")),
            **links,
        )

    # Shortcuts accepted by with_() besides the dataclass fields, so a what-if slider can move one number.
    _SHORTCUTS = {
        "intra_host_bandwidth": ("intra_host", "bandwidth"),
        "intra_host_latency": ("intra_host", "latency"),
        "inter_host_bandwidth": ("inter_host", "bandwidth"),
        "inter_host_latency": ("inter_host", "latency"),
        "memory_bytes": ("device", "memory_bytes"),
        "memory_bandwidth": ("device", "memory_bandwidth"),
        "peak_flops": ("device", "peak_flops"),
        "efficiency": ("device", "efficiency"),
    }
    # Fields of the device's Efficiency a what-if may set directly (``cluster.with_(flash_attention=False)``).
    _EFFICIENCY_SHORTCUTS = frozenset(f.name for f in dataclasses.fields(Efficiency))

    def with_(self, **changes: Any) -> "Cluster":
        """A modified copy: any field (``hosts=4``) or shortcut (``inter_host_bandwidth=1e9``, ``memory_bytes=...``),
        or a field of the device's :class:`Efficiency` (``flash_attention=False``: attention priced as matmuls and a
        softmax through memory, a per-plan choice).

        >>> Cluster.preset("p3.16xlarge").with_(hosts=4, memory_bytes=32 * 2**30).device.memory_bytes == 32 * 2**30
        True
        >>> Cluster.preset("dgx-a100").with_(flash_attention=False).device.efficiency.flash_attention
        False
        """
        fields = {f.name for f in dataclasses.fields(self)}
        eff = {k: changes.pop(k) for k in list(changes) if k in self._EFFICIENCY_SHORTCUTS and k not in fields}
        if eff:
            base_dev = changes.get("device", self.device)
            changes["device"] = dataclasses.replace(base_dev, efficiency=dataclasses.replace(base_dev.efficiency, **eff))
        direct = {k: v for k, v in changes.items() if k in fields}
        nested: dict[str, dict] = {}
        for key, value in changes.items():
            if key in fields:
                continue
            if key not in self._SHORTCUTS:
                valid = ", ".join(sorted(fields | set(self._SHORTCUTS) | self._EFFICIENCY_SHORTCUTS))
                raise ValueError(f"Cluster.with_ got an unknown change {key!r}; use one of: {valid}.")
            part, attr = self._SHORTCUTS[key]
            nested.setdefault(part, {})[attr] = value
        for part, attrs in nested.items():
            base = direct.get(part, getattr(self, part))
            direct[part] = dataclasses.replace(base, **attrs)
        return dataclasses.replace(self, **direct)

    def scaled_inter_host(self, factor: float) -> "Cluster":
        """The same cluster with inter-host bandwidth ``factor`` times lower (latency unchanged).

        >>> c = Cluster.preset("p3.16xlarge")
        >>> c.scaled_inter_host(4).inter_host.bandwidth == c.inter_host.bandwidth / 4
        True
        """
        f = _check_positive(factor, "scaled_inter_host factor", "times")
        return self.with_(inter_host_bandwidth=self.inter_host.bandwidth / f)

    # -- submeshes ------------------------------------------------------------------------------------

    def submesh_shapes(self) -> list[tuple[int, int]]:
        """Alpa's submesh shapes: (1,1), (1,2), (1,4) ... (1,M), then (2,M), (3,M) ... (N,M).

        >>> Cluster.preset("p3.16xlarge", hosts=2).submesh_shapes()
        [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]
        """
        m = self.devices_per_host
        shapes = [(1, 1 << i) for i in range(m.bit_length())]  # powers of two up to M (M is one)
        shapes += [(n, m) for n in range(2, self.hosts + 1)]
        return shapes

    def _check_submesh(self, submesh: Sequence[int]) -> tuple[int, int]:
        try:
            shape = (int(submesh[0]), int(submesh[1]))
            ok = len(submesh) == 2
        except (TypeError, ValueError, IndexError):
            ok = False
        if not ok or shape not in self.submesh_shapes():
            raise ValueError(
                f"submesh {tuple(submesh) if isinstance(submesh, (list, tuple)) else submesh!r} is not one of this "
                f"cluster's submesh shapes; use one of {self.submesh_shapes()}."
            )
        return shape

    def logical_mesh_shapes(self, submesh: Sequence[int]) -> list[tuple[int, int]]:
        """The 2D logical views (n0, n1) of an (n, m) submesh, n0 ascending.

        Returned: every (n0, n1) with n0 * n1 = n * m where n1 divides M or is a whole number of hosts (k * M,
        k dividing n). Devices fill the logical mesh row-major in host-major order, so axis 1 is the fast axis:
        this rule guarantees every axis-1 group lies inside one host or is made of whole hosts, so each axis
        runs over one kind of link. For n == 1 this is (1, m), (2, m/2) ... (m, 1); for n > 1 it includes the
        physical (n, M), (n*M, 1) and (1, n*M). Alpa's "all" space also tries n1 values that split a host
        unevenly (e.g. (8, 3) on a (3, 8) submesh); those are left out because their groups straddle hosts.

        >>> Cluster.preset("p3.16xlarge", hosts=2).logical_mesh_shapes((2, 8))
        [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1)]
        """
        n, m = self._check_submesh(submesh)
        size, host = n * m, self.devices_per_host
        out = []
        for n0 in range(1, size + 1):
            if size % n0:
                continue
            n1 = size // n0
            if host % n1 == 0 or (n1 % host == 0 and n % (n1 // host) == 0):
                out.append((n0, n1))
        return out

    def logical_mesh(self, submesh: Sequence[int], shape: Sequence[int] | None = None, first_device: int = 0) -> "LogicalMesh":
        """A validated :class:`LogicalMesh` (``shape`` defaults to the submesh's physical shape).

        >>> Cluster.preset("dgx-a100", hosts=2).logical_mesh((1, 8), (2, 4)).axis_size((0, 1))
        8
        """
        sub = self._check_submesh(submesh)
        return LogicalMesh(self, sub, tuple(shape) if shape is not None else sub, first_device)

    def place(self, submeshes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Device indices for each submesh (in the given order), tiling the cluster as Alpa does.

        Whole-host shapes (n, M) take whole hosts first; the (1, 2^k) shapes then go in decreasing size,
        each right after the previous one. Why this always fits: while placing size s, every earlier piece
        in that host was a multiple of s, so the offset is a multiple of s, and M is too, so no piece
        straddles a host; with sizes summing to at most N*M, nothing runs past the last device.

        >>> Cluster.preset("p3.16xlarge").place([(1, 2), (1, 4), (1, 1)])
        [(4, 5), (0, 1, 2, 3), (6,)]
        """
        shapes = [self._check_submesh(s) for s in submeshes]
        total = sum(n * m for n, m in shapes)
        if total > self.num_devices:
            raise ValueError(
                f"submeshes {shapes} need {total} devices but the cluster has {self.num_devices}; "
                "drop or shrink some submeshes."
            )
        # Stable sort: whole-host shapes (larger first) then sub-host shapes by decreasing size.
        order = sorted(range(len(shapes)), key=lambda i: -(shapes[i][0] * shapes[i][1]))
        out: list[tuple[int, ...]] = [()] * len(shapes)
        nxt = 0
        for i in order:
            size = shapes[i][0] * shapes[i][1]
            out[i] = tuple(range(nxt, nxt + size))
            nxt += size
        return out

    # -- links ------------------------------------------------------------------------------------------

    def p2p_link(self, src_devices: Sequence[int], dst_devices: Sequence[int]) -> Link:
        """The link a stage-to-stage transfer uses: intra_host if both device sets lie in one host, else inter_host.

        >>> c = Cluster.preset("p3.16xlarge", hosts=2)
        >>> c.p2p_link([0, 1], [2, 3]) == c.intra_host, c.p2p_link([0], [8]) == c.inter_host
        (True, True)
        """
        devs = [int(d) for d in list(src_devices) + list(dst_devices)]
        bad = [d for d in devs if not 0 <= d < self.num_devices]
        if bad:
            raise ValueError(f"device indices {bad} are outside this cluster's 0..{self.num_devices - 1}; use indices in that range.")
        return self.intra_host if len({self.host_of(d) for d in devs}) <= 1 else self.inter_host

    def send_recv(self, nbytes: float, src_devices: Sequence[int], dst_devices: Sequence[int]) -> float:
        """Time to move ``nbytes`` between two device sets over :meth:`p2p_link`."""
        return send_recv(nbytes, self.p2p_link(src_devices, dst_devices))


# ----------------------------------------------------------------------------------------------------------
# Logical meshes and collective costs


@dataclass(frozen=True)
class LogicalMesh:
    """A 2D view (n0, n1) of a submesh; axis 1 is the fast axis (consecutive devices).

    ``first_device`` is where the submesh starts in the cluster's host-major numbering (see Cluster.place).
    Collective costs use Alpa's alpha-beta formulas with B = bytes of the FULL buffer along the axis.

    >>> c = Cluster.preset("p3.16xlarge")
    >>> m = c.logical_mesh((1, 8), (1, 8))
    >>> m.all_reduce(1e9, 1) == 2 * 3 * c.intra_host.latency + 2 * (7 / 8) * 1e9 / c.intra_host.bandwidth  # a tree
    True
    >>> m.all_gather(1e9, 1) == 7 * c.intra_host.latency + (7 / 8) * 1e9 / c.intra_host.bandwidth  # a ring
    True
    """

    cluster: Cluster
    submesh: tuple
    shape: tuple
    first_device: int = 0

    def __post_init__(self) -> None:
        sub = self.cluster._check_submesh(self.submesh)
        object.__setattr__(self, "submesh", sub)
        try:
            shape = tuple(int(s) for s in self.shape)
        except (TypeError, ValueError):
            shape = ()
        size = sub[0] * sub[1]
        if len(shape) != 2 or shape[0] * shape[1] != size or min(shape) < 1:
            raise ValueError(
                f"logical mesh shape {self.shape!r} must be two positive numbers multiplying to the submesh's "
                f"{size} devices; use one of {self.cluster.logical_mesh_shapes(sub)}."
            )
        if shape not in self.cluster.logical_mesh_shapes(sub):
            raise ValueError(
                f"logical mesh shape {shape} would split hosts unevenly along axis 1; "
                f"use one of {self.cluster.logical_mesh_shapes(sub)}."
            )
        object.__setattr__(self, "shape", shape)
        M = self.cluster.devices_per_host
        align = sub[1] if sub[0] == 1 else M  # a (1, m) piece sits at a multiple of m; bigger ones on host starts
        f = self.first_device
        if not _is_int(f) or f < 0 or f % align or f + size > self.cluster.num_devices:
            raise ValueError(
                f"first_device {f!r} cannot start a {sub} submesh; use a multiple of {align} no larger than "
                f"{self.cluster.num_devices - size} (Cluster.place computes valid starts)."
            )

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def devices(self) -> np.ndarray:
        """Cluster device indices, shape (n0, n1), host-major and row-major (axis 1 = consecutive devices)."""
        return np.arange(self.first_device, self.first_device + self.num_devices).reshape(self.shape)

    def _groups(self, axis: Axis) -> np.ndarray:
        """Rows = the device groups a collective along ``axis`` runs in."""
        d = self.devices
        if axis in (0, 1):
            return d.T if axis == 0 else d  # axis 0 varies the row index: its groups are the columns
        if isinstance(axis, (tuple, list)) and tuple(axis) in ((0, 1), (1, 0)):
            return d.reshape(1, -1)
        raise ValueError(f"mesh axis must be 0, 1 or (0, 1), got {axis!r}; pick one of those.")

    def axis_size(self, axis: Axis) -> int:
        """Devices along ``axis`` (0, 1, or (0, 1) for both flattened)."""
        return int(self._groups(axis).shape[1])

    def axis_link(self, axis: Axis) -> Link:
        """The link a collective along ``axis`` uses.

        intra_host if every group along the axis sits inside one host. Otherwise inter_host, with its
        bandwidth divided by the number of groups that cross the network from one host at the same time
        (they share that host's NICs): logical (2, 8) on 2 p3 hosts has 8 axis-0 pairs per host, so each
        gets 25/8 Gb/s.
        """
        # Memoised per mesh and axis: every collective a strategy prices asks, and the answer is a function of the
        # mesh alone (at 3,072 devices working it out walks every group and host: tens of ms a call).
        key = tuple(axis) if isinstance(axis, (tuple, list)) else axis
        memo = self.__dict__.setdefault("_axis_links", {})
        if key not in memo:
            memo[key] = self._axis_link(axis)
        return memo[key]

    def _axis_link(self, axis: Axis) -> Link:
        hosts = self._groups(axis) // self.cluster.devices_per_host
        if (hosts == hosts[:, :1]).all():
            return self.cluster.intra_host
        # How many crossing groups each host is in, the most of them: each row's distinct hosts (sorted, the
        # first of each run), counted over the rows that span more than one host.
        ordered = np.sort(hosts, axis=1)
        first = np.ones(ordered.shape, dtype=bool)
        first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        crossing = first.sum(axis=1) > 1
        sharing = int(np.bincount(ordered[crossing][first[crossing]]).max())
        link = self.cluster.inter_host
        return link if sharing == 1 else Link(link.bandwidth / sharing, link.latency)

    def axis_hosts(self, axis: Axis) -> int:
        """How many hosts each group along ``axis`` spans (1: the group sits inside one host)."""
        groups = self._groups(axis) // self.cluster.devices_per_host
        return max(len(set(row.tolist())) for row in groups)

    def axis_profile(self, axis: Axis) -> tuple:
        """What a collective along ``axis`` costs depends on, and nothing else: its size, the hosts each group
        spans, the bottleneck link's bandwidth and the per-step latencies inside and between hosts (hashable: the
        planner shares work between axes with the same profile)."""
        n = self.axis_size(axis)
        if n == 1:
            return (1,)
        link = self.axis_link(axis)
        return (n, self.axis_hosts(axis), float(link.bandwidth), float(self.cluster.intra_host.latency),
                float(self.cluster.inter_host.latency))

    def _steps(self, axis: Axis) -> tuple[int, int, float, float]:
        """(devices per host in a group g, hosts k, intra-host latency, inter-host latency) along ``axis``."""
        n, k = self.axis_size(axis), self.axis_hosts(axis)
        return n // k, k, self.cluster.intra_host.latency, self.cluster.inter_host.latency

    def _tree_latency(self, axis: Axis) -> float:
        """One pass of a hierarchical tree: log2 levels inside a host over NVLink-class links, then log2 levels
        between hosts (NCCL's all-reduce trees)."""
        g, k, a_in, a_out = self._steps(axis)
        return math.ceil(math.log2(g)) * a_in + math.ceil(math.log2(k)) * a_out

    def _ring_step_latency(self, axis: Axis) -> float:
        """A ring step waits for its slowest hop: the inter-host one when the ring leaves a host."""
        g, k, a_in, a_out = self._steps(axis)
        return a_out if k > 1 else a_in

    def _bandwidth_s(self, nbytes: float, axis: Axis, factor: float) -> float:
        return factor * nbytes / self.axis_link(axis).bandwidth

    def ring_step(self, nbytes: float, axis: Axis) -> float:
        """One step of a ring along ``axis``: every device sends ``nbytes`` to its neighbour at once, waiting for the
        slowest hop's latency (:meth:`all_gather` of B is n-1 such steps of B / n). 0 on an axis of one device."""
        if self.axis_size(axis) == 1 or nbytes <= 0:
            return 0.0
        return self._ring_step_latency(axis) + self._bandwidth_s(nbytes, axis, 1.0)

    def all_gather(self, nbytes: float, axis: Axis) -> float:
        """B = bytes of the gathered (full) buffer: a ring (NCCL's algorithm for it), n-1 steps moving (n-1)/n B at
        the axis' bus bandwidth."""
        n = self.axis_size(axis)
        if n == 1:
            return 0.0  # nothing to communicate: exactly zero, not the latency
        return (n - 1) * self._ring_step_latency(axis) + self._bandwidth_s(nbytes, axis, (n - 1) / n)

    def reduce_scatter(self, nbytes: float, axis: Axis) -> float:
        """B = bytes of the full (unscattered) buffer: as :meth:`all_gather` (a ring)."""
        return self.all_gather(nbytes, axis)

    def all_reduce(self, nbytes: float, axis: Axis) -> float:
        """2 (n-1)/n B at the bus bandwidth, with the latency of NCCL's faster algorithm: a ring's 2 (n-1) steps or a
        (hierarchical, double binary) tree's log2 levels up and down. Small buffers take the tree, so one all-reduce
        beats a reduce-scatter and an all-gather."""
        n = self.axis_size(axis)
        if n == 1:
            return 0.0
        latency = 2 * min((n - 1) * self._ring_step_latency(axis), self._tree_latency(axis))
        return latency + self._bandwidth_s(nbytes, axis, 2 * (n - 1) / n)

    def all_to_all(self, nbytes: float, axis: Axis) -> float:
        """(n-1)/n^2 B at the bus bandwidth (each device keeps 1/n and sends n-1 pieces of B/n^2), in n-1
        pairwise exchanges that run at once: a tree's latency."""
        n = self.axis_size(axis)
        if n == 1:
            return 0.0
        return self._tree_latency(axis) + self._bandwidth_s(nbytes, axis, (n - 1) / (n * n))

    def to_jax_mesh(self, devices: Sequence[Any] | None = None):
        """A ``jax.sharding.Mesh`` with axes ("x", "y") over real jax devices.

        ``devices`` is either exactly this mesh's devices (taken in order) or the whole cluster's device list
        (indexed by :attr:`devices`); by default ``jax.devices()``.
        """
        import jax  # lazy: the cost model must not need jax

        devs = list(jax.devices() if devices is None else devices)
        if len(devs) == self.num_devices:
            arr = np.empty(self.num_devices, dtype=object)
            arr[:] = devs
            arr = arr.reshape(self.shape)
        elif len(devs) > int(self.devices.max()):
            arr = np.empty(self.shape, dtype=object)
            for idx, d in np.ndenumerate(self.devices):
                arr[idx] = devs[int(d)]
        else:
            raise ValueError(
                f"got {len(devs)} jax devices for a {self.shape} mesh of devices {self.devices.min()}..{self.devices.max()}; "
                f"pass exactly {self.num_devices} devices or the cluster's full list (set JAX_NUM_CPU_DEVICES to get more)."
            )
        axis_type = getattr(jax.sharding, "AxisType", None)
        if axis_type is not None:
            return jax.sharding.Mesh(arr, ("x", "y"), axis_types=(axis_type.Auto, axis_type.Auto))
        return jax.sharding.Mesh(arr, ("x", "y"))
