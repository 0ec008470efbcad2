"""The CPU backend: what XLA on CPU and JAX's CPU devices do that the general cost model does not say.

Everything here is **empirical**: fitted to measurements of one machine (the ``cpu`` profile,
``autopar_lab/profiles/cpu.json``, written by ``python -m autopar_lab.calibrate``, and the predicted-against-measured
runs of ``bench/bench_execute.py``, bench/RESULTS.md's "Predicted against measured on 8 CPU devices" and the
bench_execute entries of bench/JOURNAL.md). :data:`EMPIRICAL` names the measurement behind each hook and figure.
None of it holds on a GPU or a TPU: the general cost model reaches this module only through the hooks of
:mod:`autopar_lab.backends`, which answer zero or identity (or None) without calling it unless the device is the CPU
(its devices share one machine's cores: ``Device.shares_cores``).

The quirks, each behind one function:

- driver costs (:func:`kernel_share`): the devices share the cores and one driver, so a program on fewer of a
  host's devices pays less of its kernels' cost calibrated with all of them busy (``Efficiency.driver_share``);
- state arrays (:func:`buffer_share`, :func:`task_array_s`): each device's buffer of a state array is made on the
  shared cores, and every forward and backward task takes its parameter arrays;
- task launches (:func:`task_devices`, :data:`ONE_PROGRAM_SHARE`): a task costs ``task_overhead_s`` per device it
  runs on; a whole step on every device with one microbatch runs as one program (the runtime's "spmd" mode);
- one host (:func:`runs_serially`, :func:`host_of_stages`): the stages on a host run one task at a time;
- the gradient chain (:func:`read_again_s`, :func:`chain_pairs`, :func:`chain_pair_bytes`): XLA on CPU fuses the
  residual stream's gradient, a sum with one term per later layer, into every kernel that reads it, so each layer's
  backward reads the link of every later layer of the same program again (``Efficiency.chain_reads`` reads each);
- memory (:func:`update_copies_bytes`, :func:`dot_f32_copies`): a pipeline stage's separate update program copies
  its optimizer state before writing it (:data:`UPDATE_COPIES_SHARE`), and XLA's CPU backend computes a
  half-precision matmul in float32, from float32 copies of its operands into a float32 result.
  A whole step run as one program holds no gradient buffers at its peak (:func:`one_program_grads_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..graph.fusion import is_chain_link
from ..graph.opgraph import PARAM

__all__ = ["EMPIRICAL", "ONE_PROGRAM_SHARE", "RESHARD_BUFFERS_HELD", "UPDATE_COPIES_SHARE", "CpuCost",
           "update_copies_bytes", "dot_f32_copies",
           "one_program_grads_bytes",
           "kernel_share", "buffer_share", "task_array_s",
           "task_devices", "runs_serially", "host_of_stages", "chain_read_s_per_byte", "read_again_s",
           "chain_pairs", "chain_pair_bytes", "plan_note"]

#: Each fitted hook and figure of this module -> the measurement that fitted it (all on this 2-core machine with 8
#: JAX CPU devices; the figures themselves are the ``cpu`` profile's, refitted by ``python -m autopar_lab.calibrate``).
EMPIRICAL: Mapping[str, str] = {
    "kernel_share": "Efficiency.driver_share (1.06 devices on the profile of 2026-12-04): the step of a small model "
                    "on 1, 2, 4 and 8 devices cost 1.17, 1.94, 3.04 and 5.30 ms "
                    "(calibrate.measure_kernel_overhead; bench/RESULTS.md, the cpu execute section)",
    "buffer_share": "an update program's state arrays cost 6.8, 10.6 and 18.2 us an array on 2, 4 and 8 devices "
                    "(calibrate.measure_buffer_overhead, every device holding each array): per device's shard",
    "task_array_s": "a pipeline's tasks ran 3-5 ms a step slower than priced until each forward and backward task "
                    "was charged its parameter arrays (bench/JOURNAL.md, the bench_execute entries, 2026-12-04)",
    "task_devices": "a pp4 task (2 devices) measured 0.8-1.2 ms, a pp2 task (4 devices) 2.5-3.0 ms: about 0.3 ms a "
                    "device; the calibrated 0.575 ms on a 2-device block is stored per device "
                    "(calibrate.measure_task_overhead; bench/JOURNAL.md 'Virtual devices')",
    "ONE_PROGRAM_SHARE": "a one-microbatch step on every device runs as one program, not three tasks (the runtime's "
                         "spmd mode; bench/RESULTS.md, the cpu execute section)",
    "runs_serially": "a pipeline's step on 8 CPU devices is the sum of its tasks, not their max: without it auto on "
                     "a 24-layer gpt-tiny chose 8 stages at 284.5 ms predicted against 92.2 ms for data parallelism "
                     "(bench/RESULTS.md, the cpu execute section; bench/JOURNAL.md 'Virtual devices')",
    "host_of_stages": "as runs_serially: one driver and the same cores run every stage of a host",
    "chain_read_s_per_byte": "Efficiency.chain_reads (59 reads per later layer on the profile of 2026-12-04): 12- "
                             "and 24-layer steps less the 2-4-layer kernel fit, over the chain's re-read bytes "
                             "(calibrate.measure_chain_reads; bench/JOURNAL.md 'Deeper models: the gradient chain')",
    "read_again_s": "as chain_read_s_per_byte; the ILP charges one reader (bench/JOURNAL.md 'The chain in the "
                    "intra-op ILP': Spearman 0.52 -> 0.99 over the 24-layer plans)",
    "chain_pairs": "as chain_read_s_per_byte: a backward program of n layers re-reads ~n^2/2 links",
    "UPDATE_COPIES_SHARE": "the update programs of tp4 x pp2 on gpt-350m's shape (4 layers, sequence 256, batch 2: "
                           "tests/test_memory_measured.py's plan) took 144.6 and 44.1 MiB of temporaries (XLA's "
                           "compiled memory analysis, per device) for 148.6 and 48.1 MiB of Adam state, 0.97 and "
                           "0.92 of it; gpt-tiny's dp4 x pp2 (float32, 4 layers) 0.94 and 0.92; the compiled "
                           "programs copy the donated state arrays they still read after writing the new ones "
                           "(2026-12-06, bench/JOURNAL.md 'CPU-only memory terms priced')",
    "update_copies_bytes": "as UPDATE_COPIES_SHARE: a pipeline stage's update program, not the one-program step "
                           "(whose update XLA fuses into the step: no copies)",
    "one_program_grads_bytes": "gpt-tiny (4 layers, hidden 32, batch 16, float32) on 8 CPU devices, each plan's "
                               "one program (the runtime's spmd mode): its temporaries (XLA's compiled memory "
                               "analysis, per device) were 454.1 KiB under data parallelism against 487.8 priced for "
                               "activations, buffers and copies without the gradients (0.93; 696.6 with its 208.8 "
                               "KiB of gradients: 0.65), 1196.4 KiB under dp1 x tp8 against 1113.0 (1.07; 1187.0 "
                               "with its 74.0: 1.01): the step's peak is where its backward starts, every activation "
                               "alive, and each gradient is written after its layer's backward frees activations and "
                               "read at once by the fused update (2026-12-07, bench/JOURNAL.md 'Memory measured: "
                               "the stage input recomputed, a one-program step's gradients')",
    "RESHARD_BUFFERS_HELD": "gpt-tiny's dp2 x tp2 x pp2 stages on 8 CPU devices (bench_execute's mixed plan): the "
                            "compiled backward programs' buffer assignment held 152 KiB of collective outputs live "
                            "at stage 1's peak, one layer's backward reshardings of a microbatch 132 KiB; measured / "
                            "predicted 1.17 / 1.19 without them, 1.06 / 1.04 with (2026-12-07, bench/RESULTS.md "
                            "execute-memory)",
    "dot_f32_copies": "XLA's CPU backend converts a float16 or bfloat16 matmul's operands to float32 and computes "
                      "a float32 result (the compiled HLO: convert, dot, convert); the backward of y = x @ W at "
                      "gpt-350m's tied vocabulary shape (x 512 x 1024, W 1024 x 12800, float16) took 75.0 MiB of "
                      "temporaries against 77.0 priced (x + W + y at 4 bytes), float32 none, bfloat16 operands into a "
                      "float32 result none (jax.jit(f).lower(...).compile().memory_analysis(); 2026-12-06, "
                      "bench/JOURNAL.md 'CPU-only memory terms priced')",
}

#: What the stage update program of a pipeline runner adds on the CPU as temporaries, per byte of the stage's
#: optimizer state (empirical: :data:`EMPIRICAL`; measured 0.92-0.97). Adam keeps two float32 arrays per
#: parameter, so this is about two float32 copies of the parameters: the program copies two of each parameter's
#: donated arrays that it still reads after writing their new values. The one-program step (the runtime's "spmd"
#: mode) fuses the update into the step and makes none.
UPDATE_COPIES_SHARE = 0.94

#: Element sizes of the dtypes whose matmuls XLA's CPU backend computes from float32 copies.
_HALF = {"float16": 2, "bfloat16": 2}

#: What each of a stage's three tasks a step (forward, backward, update, with one microbatch) is charged of the task
#: overhead when the stage is the whole step run as one program: one task in all (empirical: :data:`EMPIRICAL`).
ONE_PROGRAM_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class CpuCost:
    """The CPU's own terms of a plan's cost (``CostReport.cpu``; None on a GPU or a TPU).

    ``shared_host``: the stages on a host share its cores and run one task at a time, so the busiest stage also
    waits while the others run. ``task_s``: the fixed cost of the busiest stage's programs a step, part of its
    compute: each task's launch (``task_overhead_s``) and the state arrays each task takes. ``chain_s``: the busiest
    stage's re-reads of the gradient chain a step, part of its compute (a backward program of n layers reads ~n^2/2
    links: :func:`chain_pairs`).
    """

    shared_host: bool = False
    task_s: float = 0.0
    chain_s: float = 0.0

    def to_dict(self) -> dict:
        """The figures a plan's JSON carries beside the general terms (the keys they always had)."""
        return {"task_s": self.task_s, "chain_s": self.chain_s}

    @classmethod
    def from_dict(cls, figures: Mapping[str, Any]) -> "CpuCost":
        """The terms back from a plan's JSON (:meth:`to_dict`'s keys; absent ones 0)."""
        return cls(task_s=float(figures.get("task_s", 0.0)), chain_s=float(figures.get("chain_s", 0.0)))

    def terms(self) -> list[tuple[str, str, float]]:
        """(a table row's label, a sentence's clause, seconds) of each CPU part of the compute term, for the views."""
        return [("of which the programs' fixed cost (launches, arrays taken)", "the fixed cost of its programs",
                 self.task_s),
                ("of which re-reading the gradient chain", "re-reading the gradient chain (summed again in each "
                 "layer's backward kernels)", self.chain_s)]

    def cli_note(self) -> str:
        """The CLI's clause after the busiest stage's kernels ("" when nothing)."""
        return ((f", {self.task_s:.4g} s of it its programs' fixed cost" if self.task_s else "")
                + (f", {self.chain_s:.4g} s of it re-reading the gradient chain" if self.chain_s else ""))

    def compute_note(self) -> str:
        """What the compute term holds of these, for :meth:`CostReport.explain` ("" when nothing)."""
        out = (f"; of which {self.task_s:.4g} s the fixed cost of its programs: launches and the arrays they take"
               if self.task_s > 0 else "")
        return out + (f"; of which {self.chain_s:.4g} s re-reading the gradient chain (the compiler sums the "
                      "residual stream's gradient again in each layer's backward kernels: quadratic in a program's "
                      "layers)" if self.chain_s > 0 else "")

    def bubble_note(self) -> str:
        """What the bubble term holds of these ("" when nothing)."""
        return ", and the other stages running on its host (its devices share the cores)" if self.shared_host else ""


# --- driver costs and state arrays ------------------------------------------------------------------------------------


#: XLA:CPU issues a layer's backward collectives ahead of the operators that read them, so the layer's resharded
#: copies are live together at the backward's peak (empirical: :data:`EMPIRICAL`).
RESHARD_BUFFERS_HELD = True


def kernel_share(cluster: Any, devices: int) -> float:
    """What a program on ``devices`` of one host pays of its kernels' calibrated cost: the devices share the
    machine's cores and were calibrated with all of a host's D busy, so ``(d + driver_share) / (D + driver_share)``.

    >>> from types import SimpleNamespace as N
    >>> c = N(devices_per_host=8, device=N(efficiency=N(driver_share=2.0)))
    >>> kernel_share(c, 2), kernel_share(c, 8)
    (0.4, 1.0)
    """
    total = cluster.devices_per_host
    d = min(max(int(devices), 1), total)
    c = cluster.device.efficiency.driver_share
    return (d + c) / (total + c)


def buffer_share(mesh: Any) -> float:
    """What a mesh of d of a host's D devices pays of ``Efficiency.buffer_s`` (measured with each array on every
    device; each device's buffer is made on the shared cores): ``d / D``."""
    return min(mesh.num_devices / mesh.cluster.devices_per_host, 1.0)


def task_array_s(per_buffer: float, kind: str) -> float:
    """What each forward and backward task pays to take one state array of tensor ``kind`` (its ``per_buffer``):
    a parameter's whole figure, other state none."""
    return per_buffer if kind == PARAM else 0.0


# --- memory: the update's copies, matmuls in float32 ------------------------------------------------------------------


def update_copies_bytes(opt_bytes: Any) -> Any:
    """Bytes of temporaries a pipeline stage's update program takes per device on the CPU for ``opt_bytes`` of
    optimizer state: :data:`UPDATE_COPIES_SHARE` of it (floats or numpy arrays).

    >>> round(update_copies_bytes(100.0), 6)
    94.0
    """
    return UPDATE_COPIES_SHARE * opt_bytes


def dot_f32_copies(graph: Any, node: Any, strategy: Any, mshape: Sequence[int],
                   weights: Any) -> tuple[float, float] | None:
    """Bytes per device of the float32 copies XLA's CPU backend makes for the backward of forward matmul ``node``
    (run with ``strategy`` on a mesh of shape ``mshape``), as (the part that grows with the microbatch, the part of
    weights, ``weights``: the ids of weight-derived tensors); None for a matmul computed as it is traced (float32,
    or bfloat16 operands into a float32 result, which the backend computes without copies).

    XLA on CPU converts each half-precision operand to float32, multiplies, and converts the float32 result back.
    The backward of y = x @ W runs two such matmuls (dy x W into dx, x x dy into dW), whose operands and results
    are x-, W- and y-sized: ``4 x (x + W + y)`` elements' bytes at their sharding, each half-precision tensor's
    copy counted (empirical: :data:`EMPIRICAL`; XLA's temporaries were 0.86-1.47 of it over ten shapes, exactly it
    on four, 0.97 of it at a vocabulary matmul's, where W dominates: the heap reuses one copy's buffer for another's).
    """
    names = [str(graph.tensor(t).dtype) for t in (*node.inputs[:2], node.outputs[0])]
    if not any(n in _HALF for n in names) or (names[2] == "float32" and all(n == "bfloat16" for n in names[:2])):
        return None
    act = weight = 0.0
    specs = (*strategy.in_specs[:2], strategy.out_specs[0])
    for t, spec, name in zip((*node.inputs[:2], node.outputs[0]), specs, names):
        if name not in _HALF:
            continue
        info = graph.tensor(t)
        f32 = spec.bytes_per_device(info.shape, info.dtype, mshape) * 4 / _HALF[name]
        if t in weights or info.kind == PARAM:
            weight += f32
        else:
            act += f32
    return act, weight


def one_program_grads_bytes(grad_bytes: Any) -> Any:
    """Bytes per device of ``grad_bytes`` of gradients that a whole step run as one program does not hold at its
    peak: all of them. The peak is where the backward starts (every activation alive); XLA writes each gradient
    once its layer's backward has freed activations, and the update fused into the same program reads it at once
    (empirical: :data:`EMPIRICAL`). A pipeline stage's backward task returns its gradient sums, which it holds.

    >>> one_program_grads_bytes(100.0)
    100.0
    """
    return grad_bytes


# --- tasks and hosts --------------------------------------------------------------------------------------------------


def task_devices(cluster: Any, submesh: Sequence[int]) -> int:
    """How many times a task on ``submesh`` pays ``task_overhead_s``: once per device of the task on one host
    (each device's part of a program is launched and synchronised on the shared cores)."""
    return min(int(submesh[1]), cluster.devices_per_host)


def runs_serially(cluster: Any) -> bool:
    """Whether every stage of a plan shares one host's cores and driver (one host), so they run one task at a time
    and the stage DP prices a pipeline as the sum of its tasks."""
    return cluster.hosts == 1


def host_of_stages(cluster: Any, offsets: Sequence[int]) -> list[int]:
    """The host each stage (its first device's index in ``offsets``) runs on: the pipeline simulation's resource,
    one task at a time per host."""
    return [off // cluster.devices_per_host for off in offsets]


# --- the gradient chain -----------------------------------------------------------------------------------------------


def chain_read_s_per_byte(mesh: Any) -> float:
    """Seconds one device of ``mesh`` spends per byte of its shard of a gradient-chain link
    (:func:`~autopar_lab.graph.fusion.is_chain_link`) each time one later layer's backward reads it again: the
    device's ``Efficiency.chain_reads`` reads at its achievable bandwidth, at the mesh's :func:`kernel_share`."""
    device = mesh.cluster.device
    unit = device.efficiency.chain_reads / device.achievable_bandwidth
    if unit:
        unit *= kernel_share(mesh.cluster, mesh.num_devices)
    return unit


def read_again_s(mesh: Any, graph: Any, node: Any, strategies: Sequence[Any]) -> list[float] | None:
    """Seconds a step pays for each of ``strategies`` of ``node`` each time one later layer's backward reads its
    output again: the chain link's bytes per device x :func:`chain_read_s_per_byte`; None where ``node`` is no
    link or the device reads nothing again. The intra-op ILP charges this once (the least a link is re-read when it
    is read at all, by the next layer: enough that it does not replicate the chain to save a resharding elsewhere);
    the stage's real count is :func:`chain_pairs`'s."""
    unit = chain_read_s_per_byte(mesh)
    if not unit or not is_chain_link(graph, node):
        return None
    link = graph.tensor(node.outputs[0])
    mshape = tuple(mesh.shape)
    return [unit * s.out_specs[0].bytes_per_device(link.shape, link.dtype, mshape) for s in strategies]


def chain_pairs(sums: Mapping[str, Any], start: Any, end: Any) -> Any:
    """Seconds a step of a backward program over layers ``start..end`` spends re-reading the gradient chain:
    ``sum over k of (end - k) x reread_s[k]`` (each layer's backward kernels read the link of every later layer of
    the same program again), from the running sums of ``reread_s`` and ``reread_rank_s`` (``k x reread_s``;
    :func:`autopar_lab.pricing.stage.prefix_sums`, lists or numpy arrays). ``start``/``end``: ints, or broadcastable
    integer arrays (the stage DP's blocks).

    >>> s = {"reread_s": [0.0, 1.0, 2.0, 3.0], "reread_rank_s": [0.0, 0.0, 1.0, 3.0]}   # 1 s a layer, 3 layers
    >>> chain_pairs(s, 0, 2), chain_pairs(s, 1, 2), chain_pairs(s, 2, 2)   # 2+1+0, 1+0, 0
    (3.0, 1.0, 0.0)
    """
    c, r = sums["reread_s"], sums["reread_rank_s"]
    if isinstance(start, np.ndarray) or isinstance(end, np.ndarray):
        c, r = np.asarray(c, dtype=float), np.asarray(r, dtype=float)
    return end * (c[end + 1] - c[start]) - (r[end + 1] - r[start])


def chain_pair_bytes(graph: Any, layer_names: Sequence[str]) -> float:
    """Bytes (whole batch, unsharded) a one-program backward over all of ``layer_names`` re-reads of the gradient
    chain per read: ``sum over k of (L - 1 - k) x`` the links of layer k (what calibration fits the reads to)."""
    index: dict[str | None, int] = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    return float(sum((last - index.get(n.layer, last)) * graph.tensor(n.outputs[0]).nbytes
                     for n in graph if is_chain_link(graph, n)))


def plan_note(cluster: Any, stage_devices: Sequence[int], microbatches: int, pct: Callable[[float], str]) -> str:
    """How this module prices a plan whose stages run on ``stage_devices`` devices each with ``microbatches`` a
    step: the stages of one host run one task at a time, and a program pays its :func:`kernel_share` (``pct``
    formats a fraction). For the cost panel; it explains a plan of many stages and one microbatch."""
    S, B, D = len(stage_devices), microbatches, cluster.devices_per_host
    text = (f"CPU devices: this plan's {cluster.num_devices} devices are JAX CPU devices, slices of "
            f"{'one machine' if cluster.hosts == 1 else 'each host machine'}'s cores")
    if S > 1 and runs_serially(cluster):
        text += (f", so its {S} stages run one task at a time, one after another, not side by side: a pipeline "
                 "overlaps nothing here and the step is the sum of every stage's work")
        if B == 1:
            text += (", which is why it runs 1 microbatch: more would only add each task's fixed cost without "
                     "overlapping anything")
    c = cluster.device.efficiency.driver_share
    shares = ", ".join(f"S{k} on {d}: {pct(kernel_share(cluster, d))}" for k, d in enumerate(stage_devices))
    return text + (f". A program on d of a host's {D} devices is priced at (d + {c:.3g}) / ({D} + {c:.3g}) of its "
                   f"kernels' cost measured with all {D} busy (fewer devices, less contention for the cores): {shares}"
                   + ("; that is what splitting the layers into stages of few devices buys" if S > 1 else "")
                   + ". The training panel sets measured steps beside these predictions.")
