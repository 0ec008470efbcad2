"""The values a cluster is made of: what a device achieves (:class:`Efficiency`), the device (:class:`Device`), a link
(:class:`Link`) and a point-to-point transfer (:func:`send_recv`), with the small checks every constructor shares.

Units: bandwidth in bytes/s, latency in s, memory in bytes, compute in FLOP/s (floats).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

__all__ = ["Efficiency", "Device", "Link", "NodeLimit", "shares_cores_of", "send_recv", "is_whole", "is_power_of_two",
           "check_positive", "check_link", "dtype_name"]

# ----------------------------------------------------------------------------------------------------------
# Small checks shared by the constructors and the JSON loader (one sentence, saying what to change).


def is_whole(x: Any) -> bool:
    """An integer, not a bool (``True`` is an int to Python, never a count here)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_power_of_two(x: int) -> bool:
    """1, 2, 4, 8, ..."""
    return x >= 1 and (x & (x - 1)) == 0


def check_positive(value: Any, what: str, unit: str) -> float:
    """Return ``value`` as a float, or raise if it is not a finite number above zero."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number in {unit}, got {value!r}; give it a positive number.") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{what} must be a positive finite number in {unit}, got {value!r}; set it above zero.")
    return v


def check_link(bandwidth: Any, latency: Any, what: str) -> tuple[float, float]:
    """(bandwidth, latency) as floats, or raise naming ``what`` if one is out of range."""
    bw = check_positive(bandwidth, f"{what} bandwidth", "bytes/s")
    try:
        lat = float(latency)
    except (TypeError, ValueError):
        raise ValueError(f"{what} latency must be a number in seconds, got {latency!r}; give it 0 or more.") from None
    if not math.isfinite(lat) or lat < 0:
        raise ValueError(f"{what} latency must be a finite number of seconds >= 0, got {latency!r}; set it to 0 or "
                         "more.")
    return bw, lat


def dtype_name(dtype: Any) -> str:
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
    - ``kernel_fusion``: whether a compiler fuses the step's elementwise work into kernels (XLA, ``torch.compile``:
      :mod:`autopar_lab.graph.fusion`); False prices eager execution (PyTorch without ``torch.compile``): every
      elementwise operator, reduction and cast a kernel of its own that reads its inputs from memory and writes its
      outputs back, every matmul without an epilogue (flash attention, a library kernel, stays one kernel);
    - ``library_kernels``: whether the step runs a fused-kernel library's kernels (Megatron-LM's Transformer Engine
      and fused bias-GeLU, SwiGLU and norm kernels), whose backward keeps each kernel's inputs and recomputes the
      elementwise values inside it, where JAX's autodiff keeps every value its backward reads
      (:func:`~autopar_lab.graph.fusion.kernel_saved`: a GPT layer's 44 bytes a token and hidden unit become 32, a
      Llama layer's 59 become 34); the recomputation's elementwise work is not priced (it runs inside the
      backward's kernels, on values they read anyway);
    - ``kernel_launch_s``: the gap one kernel launch leaves between kernels, per kernel per microbatch;
    - ``buffer_s``: the fixed cost per state array (a parameter or optimizer-state tensor, all its shards) that the
      step's update program takes and returns, once per step: the runtime's dispatch of its buffers (measured on the
      ``cpu`` preset, where it is tens of microseconds, with every array on all the host's devices: a mesh of fewer
      devices pays its share there; 0 on the GPU presets, whose executables keep their buffers);
    - ``driver_share`` and ``chain_reads``: empirical figures of the CPU (read only where the device shares a
      machine's cores, :attr:`Device.shares_cores`; fitted by :mod:`autopar_lab.calibrate`, priced by
      :mod:`autopar_lab.backends.cpu`, which says what each one is and the measurement behind it): the part of a
      kernel's cost, in devices, that does not shrink with the devices running it; the times each backward kernel of
      a layer reads one later layer's term of the gradient chain again. 0 on every other preset.

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
    kernel_fusion: bool = True
    library_kernels: bool = False
    kernel_launch_s: float = 5e-6
    buffer_s: float = 0.0
    driver_share: float = 0.0
    chain_reads: float = 0.0

    def __post_init__(self) -> None:
        for f in ("matmul", "memory", "attention"):
            v = check_positive(getattr(self, f), f"efficiency.{f}", "(a fraction of the datasheet figure)")
            if v > 1:
                raise ValueError(f"efficiency.{f} is {v}, above the datasheet figure; give a fraction in (0, 1].")
            object.__setattr__(self, f, v)
        for f in ("matmul_k", "cores", "tile", "k_overhead"):
            v = getattr(self, f)
            if not is_whole(v) or v < 0 or (f == "tile" and v < 1):
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
        object.__setattr__(self, "kernel_fusion", bool(self.kernel_fusion))
        object.__setattr__(self, "library_kernels", bool(self.library_kernels))

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

    ``shares_cores``: the host's devices are slices of one machine's cores, as JAX's CPU devices are
    (``JAX_NUM_CPU_DEVICES``): the device is the CPU, and the cost model adds what
    :mod:`autopar_lab.backends.cpu` measured of it (one driver thread and the same cores run every device's work:
    the tasks of different stages on a host run one after another, ``task_overhead_s`` is paid per device of the
    task). False for real accelerators. A saved profile's older key ``virtual`` is read as this
    (:func:`shares_cores_of`).

    >>> d = Device("toy", {"float32": 1e12, "bfloat16": 4e12}, memory_bytes=2**30, memory_bandwidth=1e11)
    >>> d.peak("bfloat16"), d.peak(np.float32), d.peak("int8"), d.task_overhead_s   # unknown dtype -> float32's
    (4000000000000.0, 1000000000000.0, 1000000000000.0, 0.0)
    """

    name: str
    peak_flops: Mapping[str, float]  # dtype name -> FLOP/s; must include "float32" (the fallback)
    memory_bytes: float
    memory_bandwidth: float  # bytes/s
    task_overhead_s: float = 0.0  # seconds per pipeline task (stage forward or backward of one microbatch)
    shares_cores: bool = False  # devices that share one machine's cores (JAX CPU devices): see the docstring
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
            dtype_name(k): check_positive(v, f"device {self.name!r} peak_flops[{dtype_name(k)!r}]", "FLOP/s")
            for k, v in self.peak_flops.items()
        }
        # A read-only view keeps the dataclass honestly immutable; __hash__ below makes it hashable.
        object.__setattr__(self, "peak_flops", MappingProxyType(flops))
        object.__setattr__(self, "memory_bytes",
                           check_positive(self.memory_bytes, f"device {self.name!r} memory_bytes", "bytes"))
        object.__setattr__(
            self, "memory_bandwidth",
            check_positive(self.memory_bandwidth, f"device {self.name!r} memory_bandwidth", "bytes/s")
        )
        try:
            overhead = float(self.task_overhead_s)
        except (TypeError, ValueError):
            overhead = math.nan
        if not math.isfinite(overhead) or overhead < 0:
            raise ValueError(f"device {self.name!r} task_overhead_s must be a finite number of seconds >= 0, got "
                             f"{self.task_overhead_s!r}; give 0 for no per-task overhead.")
        object.__setattr__(self, "task_overhead_s", overhead)
        if not isinstance(self.shares_cores, (bool, np.bool_)):
            raise ValueError(f"device {self.name!r} shares_cores must be true or false, got {self.shares_cores!r}.")
        object.__setattr__(self, "shares_cores", bool(self.shares_cores))
        if self.vector_flops is not None:
            if not isinstance(self.vector_flops, Mapping):
                raise ValueError(f"device {self.name!r} vector_flops must be a mapping of dtype name to FLOP/s or "
                                 f"None, got {self.vector_flops!r}.")
            vec = {dtype_name(k): check_positive(v, f"device {self.name!r} vector_flops[{dtype_name(k)!r}]",
                                                   "FLOP/s") for k, v in self.vector_flops.items()}
            object.__setattr__(self, "vector_flops", MappingProxyType(vec))
        if isinstance(self.efficiency, Mapping):
            object.__setattr__(self, "efficiency", Efficiency.from_dict(self.efficiency))
        if not isinstance(self.efficiency, Efficiency):
            raise ValueError(f"device {self.name!r} efficiency must be an Efficiency, got {self.efficiency!r}.")

    def __hash__(self) -> int:
        vec = tuple(sorted(self.vector_flops.items())) if self.vector_flops is not None else None
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory_bytes, self.memory_bandwidth,
                     self.task_overhead_s, vec, self.efficiency, self.shares_cores))

    def peak(self, dtype: Any = "float32") -> float:
        """Peak FLOP/s for ``dtype`` (a name, numpy/jax dtype or scalar type); float32's figure if unknown."""
        return self.peak_flops.get(dtype_name(dtype), self.peak_flops["float32"])

    # -- achievable rates: what a kernel's time is made of (figures in :class:`Efficiency`) --------------------

    def vector_rate(self, dtype: Any = "float32") -> float:
        """FLOP/s of elementwise and reduction work in ``dtype`` (outside the matrix units)."""
        table = self.vector_flops if self.vector_flops is not None else self.peak_flops
        return table.get(dtype_name(dtype), table.get("float32", self.peak_flops["float32"]))

    def matmul_rate(self, dtype: Any, m: int, n: int, k: float, batch: int = 1) -> float:
        """Achievable FLOP/s of a (batch x) m x k by k x n GEMM in ``dtype``: peak x ``efficiency.matmul`` x the
        wave fraction of its output tiles x the inner-dimension fraction (see :class:`Efficiency`).

        >>> a100 = Device("A100", {"float32": 19.5e12, "float16": 312e12}, 80 * 2**30, 2039e9,
        ...               efficiency=Efficiency(matmul=267.9 / 312, matmul_k=2048, cores=108, k_overhead=64))
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
            **({"shares_cores": True} if self.shares_cores else {}),
            **({"vector_flops": dict(self.vector_flops)} if self.vector_flops is not None else {}),
            **({"efficiency": self.efficiency.to_dict()} if self.efficiency != Efficiency() else {}),
        }


def shares_cores_of(dev: Mapping[str, Any]) -> bool:
    """A saved device's ``shares_cores`` (:class:`Device`), read from its JSON object: the one place that also
    reads the key profiles and plan files wrote before it was renamed, ``virtual``."""
    return dev.get("shares_cores", dev.get("virtual", False))


@dataclass(frozen=True)
class Link:
    """A communication link in the alpha-beta model: time(B bytes) = latency + B / bandwidth.

    >>> Link(bandwidth=1e9, latency=1e-5).transfer_time(1e9)
    1.00001
    """

    bandwidth: float  # bytes/s
    latency: float  # s

    def __post_init__(self) -> None:
        bw, lat = check_link(self.bandwidth, self.latency, "link")
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


@dataclass(frozen=True)
class NodeLimit:
    """Node-limited expert routing over a dispatcher that sends one copy of a token per node (DeepSeek-V3's routing
    with DeepEP): the ``num_experts`` routed experts are cut into ``n_group`` groups of consecutive experts, each
    token picks its ``top_k`` experts inside ``topk_group`` of the groups (config.json's ``n_group`` /
    ``topk_group``: 8 and 4 for DeepSeek-V3; its report, arXiv 2412.19437 section 2.1.2 and 3.2.2: "each token is
    sent to at most 4 nodes"), and the dispatcher sends each token once to every scale-up domain (node) holding one
    of its experts, then forwards it over NVLink to the experts there (DeepEP), and combines the same way back.

    Experts lie in order over the expert-parallel group, so each of its ``k`` domains holds ``num_experts / k``
    consecutive experts: a group fits in one domain when ``k <= n_group``, and spans ``k / n_group`` domains
    otherwise. A token's experts then sit in at most :meth:`reach` ``(k) = min(k, topk_group * ceil(k / n_group))``
    domains, so at most ``min(top_k, reach(k))`` copies of it cross domains instead of ``top_k``
    (:meth:`LogicalMesh.routed_all_to_all`).

    >>> NodeLimit(256, 8, 8, 4).reach(8), NodeLimit(256, 8, 8, 4).reach(4), NodeLimit(256, 8, 8, 4).reach(16)
    (4, 4, 8)
    >>> NodeLimit(256, 8, 8, 4).copies(8), NodeLimit(64, 8, 8, 8).copies(2)
    (4, 2)
    """

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "n_group", "topk_group"):
            v = getattr(self, name)
            if not is_whole(v) or v < 1:
                raise ValueError(f"NodeLimit's {name} must be a positive whole number, got {v!r}.")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) cannot exceed n_group ({self.n_group}); set it to at "
                             f"most n_group.")
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by n_group ({self.n_group}).")

    def reach(self, domains: int) -> int:
        """The most scale-up domains of an expert-parallel group over ``domains`` one token's experts sit in."""
        return min(domains, self.topk_group * -(-domains // self.n_group))

    def copies(self, domains: int) -> int:
        """The most copies of one token the dispatcher sends: one per domain it reaches, never more than ``top_k``."""
        return min(self.top_k, self.reach(domains))

    @classmethod
    def of(cls, config: Any) -> NodeLimit | None:
        """The limit a model config declares (``num_experts``, ``top_k``, ``n_group``, ``topk_group`` fields, as
        the zoo's DeepSeekConfig has), or None where it has none or does not limit (``topk_group == n_group``)."""
        try:
            e, k, n, m = (getattr(config, f) for f in ("num_experts", "top_k", "n_group", "topk_group"))
        except AttributeError:
            return None
        if not e or m >= n:
            return None
        return cls(int(e), int(k), int(n), int(m))
