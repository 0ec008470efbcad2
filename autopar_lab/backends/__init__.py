"""The cost model's backend hooks: the few named places where one backend's compiler and runtime add to the general
formulas.

The general cost model (sharding, solve, pricing) prices every device by the same formulas; what a backend does on
top of them, fitted on one machine, answers here. Each hook returns zero, identity or None, without looking further,
unless the device is the CPU (its devices share one machine's cores: ``Device.shares_cores``, JAX's CPU devices);
then it asks :mod:`autopar_lab.backends.cpu`, where every such figure and formula lives, each marked empirical with
the measurement that fitted it. No GPU or TPU path reaches that module.

- :func:`on_cpu`: whether a cluster's device is the CPU (the views and the CLI show CPU lines only then).
- :func:`kernel_share`: the share of its kernels' calibrated cost a program on a mesh pays (driver costs).
- :func:`buffer_share`, :func:`task_array_s`: what a mesh pays of a state array's dispatch; what a task takes.
- :func:`task_devices`, :func:`one_program_share`: per-task overhead multiples.
- :func:`runs_serially`, :func:`host_of_stages`: stages that share one compute resource.
- :func:`read_again_s`, :func:`program_rereads_s`: an operator's output read again by later layers of its program.
- :func:`update_copies_bytes`, :func:`dot_f32_copies`: memory a program takes beyond the general formulas (a
  pipeline stage's update program; a half-precision matmul computed in float32); :func:`one_program_grads_bytes`,
  what it holds less (a whole step run as one program writes its gradients over freed activations).
- :func:`cpu_cost`, :func:`cost_note`: the CPU's own terms of a cost report; their clause in the CLI;
  :func:`plan_note`, how the CPU prices a plan's stages (the cost panel).

One hook answers for a framework's runtime, not the device: :func:`host_launch_s`, the host time per kernel of a
plan whose framework launches each kernel from Python (``stage_pins["host"] = "eager"``; fitted in
:mod:`autopar_lab.backends.eager`; 0 for every other plan).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from . import cpu, eager

__all__ = ["on_cpu", "kernel_share", "buffer_share", "task_array_s", "task_devices", "one_program_share",
           "runs_serially", "host_of_stages", "read_again_s", "program_rereads_s", "update_copies_bytes",
           "one_program_grads_bytes", "reshard_buffers_held", "dot_f32_copies", "cpu_cost", "cost_note", "plan_note",
           "host_launch_s"]


def on_cpu(cluster: Any) -> bool:
    """Whether ``cluster``'s devices are the CPU's: slices of one machine's cores (``Device.shares_cores``).

    >>> from autopar_lab.cluster import Cluster
    >>> on_cpu(Cluster.preset("dgx-h100")), on_cpu(Cluster.preset("tpu-v5p"))
    (False, False)
    """
    return bool(getattr(cluster.device, "shares_cores", False))


def kernel_share(mesh: Any) -> float:
    """What a program on ``mesh`` pays of its kernels' calibrated cost: 1 on a GPU or TPU (each device runs its own
    kernels); on the CPU :func:`autopar_lab.backends.cpu.kernel_share`."""
    return cpu.kernel_share(mesh.cluster, mesh.num_devices) if on_cpu(mesh.cluster) else 1.0


def buffer_share(mesh: Any) -> float:
    """What ``mesh`` pays of ``Efficiency.buffer_s`` per state array: 1, or on the CPU its share of the host."""
    return cpu.buffer_share(mesh) if on_cpu(mesh.cluster) else 1.0


def reshard_buffers_held(cluster: Any) -> bool:
    """Whether a layer's backward resharding copies are all live together beside their sources, to be priced in a
    stage's peak (``LayerCost.reshard_dst_*_bytes``): on the CPU, where XLA issues a layer's collectives ahead of
    their readers (:data:`autopar_lab.backends.cpu.RESHARD_BUFFERS_HELD`, measured). Not elsewhere: unmeasured there,
    and MaxText's v5p-128 row, which ran in 95 GiB, reads 96.7 GiB with them (a memory-aware scheduler, or
    Megatron's one global gather buffer, does not hold them together)."""
    return cpu.RESHARD_BUFFERS_HELD if on_cpu(cluster) else False


def task_array_s(cluster: Any, per_buffer: float, kind: str) -> float:
    """Seconds each forward and backward task pays to take one state array of tensor ``kind``: 0 but on the CPU."""
    return cpu.task_array_s(per_buffer, kind) if on_cpu(cluster) else 0.0


def task_devices(cluster: Any, submesh: Sequence[int]) -> int:
    """How many times a task on ``submesh`` pays the device's ``task_overhead_s``: once, or on the CPU once per
    device of the task."""
    return cpu.task_devices(cluster, submesh) if on_cpu(cluster) else 1


def one_program_share(cluster: Any) -> float | None:
    """What each of a stage's three tasks pays of the task overhead when the runtime runs a whole one-microbatch step
    on every device as one program: None where it never does (a GPU or TPU), else the CPU's share."""
    return cpu.ONE_PROGRAM_SHARE if on_cpu(cluster) else None


def runs_serially(cluster: Any) -> bool:
    """Whether all of a plan's stages share one compute resource and run one task at a time: False, or on the CPU
    where the cluster is one host."""
    return cpu.runs_serially(cluster) if on_cpu(cluster) else False


def host_of_stages(cluster: Any, offsets: Sequence[int]) -> list[int] | None:
    """Each stage's compute resource for the pipeline simulation (``SimOptions(hosts=)``), from its first device's
    index: None (every stage its own) but on the CPU, where a host's stages share it."""
    return cpu.host_of_stages(cluster, offsets) if on_cpu(cluster) else None


def read_again_s(mesh: Any, graph: Any, node: Any, strategies: Sequence[Any]) -> list[float] | None:
    """Seconds a step pays for each of ``strategies`` of ``node`` each time one later layer of its program reads
    its output again (the intra-op ILP charges it once); None where nothing is read again (every GPU and TPU)."""
    return cpu.read_again_s(mesh, graph, node, strategies) if on_cpu(mesh.cluster) else None


def program_rereads_s(cluster: Any, sums: Mapping[str, Any], start: Any, end: Any) -> Any:
    """Seconds a step of a backward program over layers ``start..end`` spends reading its layers' outputs again for
    the later layers of the same program, from the running sums of ``reread_s`` and ``reread_rank_s``
    (:func:`autopar_lab.pricing.stage.prefix_sums`); 0 but on the CPU."""
    return cpu.chain_pairs(sums, start, end) if on_cpu(cluster) else 0.0


def update_copies_bytes(cluster: Any, opt_bytes: Any) -> Any:
    """Bytes per device a pipeline stage's update program takes beyond the stage's state for ``opt_bytes`` of
    optimizer state (floats or numpy arrays): 0 but on the CPU
    (:func:`autopar_lab.backends.cpu.update_copies_bytes`)."""
    return cpu.update_copies_bytes(opt_bytes) if on_cpu(cluster) else 0.0


def one_program_grads_bytes(cluster: Any, grad_bytes: Any) -> Any:
    """Bytes per device of ``grad_bytes`` of gradients that a whole step run as one program (the CPU's "spmd" mode,
    :func:`one_program_share`) does not hold at its peak: 0 but on the CPU
    (:func:`autopar_lab.backends.cpu.one_program_grads_bytes`)."""
    return cpu.one_program_grads_bytes(grad_bytes) if on_cpu(cluster) else 0.0


def dot_f32_copies(mesh: Any, graph: Any, node: Any, strategy: Any, weights: Any) -> tuple[float, float] | None:
    """Bytes per device of the float32 copies the backward of forward matmul ``node`` makes with ``strategy``, as
    (what grows with the microbatch, what does not): None on a GPU or TPU, which multiply half precision as it is
    (:func:`autopar_lab.backends.cpu.dot_f32_copies`)."""
    if not on_cpu(mesh.cluster) or node.primitive != "dot_general":
        return None
    return cpu.dot_f32_copies(graph, node, strategy, tuple(mesh.shape), weights)


def cpu_cost(cluster: Any, *, shared_host: bool, task_s: float, rereads_s: float) -> cpu.CpuCost | None:
    """``CostReport.cpu``: the CPU's own terms (:class:`~autopar_lab.backends.cpu.CpuCost`), None on a GPU or TPU."""
    return cpu.CpuCost(shared_host, task_s, rereads_s) if on_cpu(cluster) else None


def cost_note(figures: Mapping[str, Any]) -> str:
    """The CPU's clause of the CLI's compute line from a plan's JSON (``CostReport.to_dict``), "" where the plan has
    no CPU terms (a GPU or TPU plan's JSON carries none)."""
    return cpu.CpuCost.from_dict(figures).cli_note() if "task_s" in figures else ""


def plan_note(cluster: Any, stage_devices: Sequence[int], microbatches: int, pct: Callable[[float], str]) -> str:
    """How the CPU prices a plan's stages (:func:`autopar_lab.backends.cpu.plan_note`), for the cost panel; "" on a
    GPU or TPU."""
    return cpu.plan_note(cluster, stage_devices, microbatches, pct) if on_cpu(cluster) else ""


def host_launch_s(host: str | None) -> float:
    """Seconds of host time per kernel a plan's framework pays to launch it (``stage_pins["host"]``: "eager",
    "eager-te" or None): :func:`autopar_lab.backends.eager.host_launch_s` (fitted), 0 for None."""
    return eager.host_launch_s(host)
