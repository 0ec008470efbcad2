"""Measure this machine's JAX CPU devices and write the profile the ``cpu`` cluster preset reads.

Regenerate the shipped profile (about a minute)::

    JAX_NUM_CPU_DEVICES=8 JAX_PLATFORMS=cpu python -m autopar_lab.calibrate --out autopar_lab/profiles/cpu.json

What is measured, and why each figure is the one the cost model wants:

* matmul FLOP/s (float32, a few sizes, best of several runs), once on one device alone and once with every
  device multiplying at the same time (one batched matmul sharded over the N devices, a k x k product each). The
  preset's ``peak_flops`` starts from the concurrent figure: the machine's aggregate throughput with all N devices
  busy, divided by N (best size), and is then brought to a small model's kernel sizes (the step fit below). N
  JAX CPU devices share the machine's C cores, so this is the honest model of "N devices on C cores": every
  device runs concurrently at 1/N of the machine, and a stage on d devices gets d/N of it (one device alone runs
  much faster: ``matmul_flops_single_device``, kept for comparison).
* memory bandwidth from a large elementwise add (bytes read + written), alone and concurrent (same reason).
* collective latency and bandwidth between the local devices: a jitted all-reduce (``psum``) and all-gather
  (``all_gather``), shard_map over a 1D mesh of the devices, at several buffer sizes, each timed as a step meets it:
  after a layer-like compute on every device, in a chain of such links against the same chain without the
  collectives (:func:`measure_collectives_between_compute`: the program call cancels, and the barrier wait for the
  slowest of the N device threads on C cores is counted; bare back-to-back collectives, :func:`measure_collectives`,
  see a quarter of it here). Each measurement is put in
  the cost model's form t = alpha + beta * x, with x the bytes the formula charges (all-reduce 2 (n-1)/n B, B the
  buffer; all-gather (n-1)/n B, B the gathered buffer: the formulas of :class:`~autopar_lab.cluster.LogicalMesh`),
  and alpha (latency) and beta (1 / bandwidth) fitted by least squares, per collective and jointly. The joint fit
  is the intra-host link; every fit is stored with its residuals (measured vs fitted time per size).
* what a small model's kernels cost (:func:`measure_kernel_overhead`): gpt-tiny's whole training step at a few
  depths and batches on every device at once (each its own copy, no communication), fitted as a fixed cost per
  kernel plus the cost model's roofline at the rates above times a work scale, then on a quarter of the devices
  (their share). Stored as ``device.efficiency.kernel_launch_s`` and ``driver_share``; ``peak_flops`` and
  ``memory_bandwidth`` are the measured rates over the work scale (about 4x on this machine: 32-256-row kernels
  reach a quarter of what 1024-wide matmuls and 32 MB streams do). Measured one at a time, the figures did not add
  up to a step: a chain of scalar kernels (the measurement until 2026-12-04) gave a tenth of a step's per-kernel
  cost.
* the fixed cost of one state array a program takes and returns (:func:`measure_buffer_overhead`): a jitted update
  of many small arrays replicated on every device, fitted per array; stored as ``device.efficiency.buffer_s`` (a
  step's update program takes and returns every parameter and optimizer-state array once).
* the fixed cost of one pipeline task (:func:`measure_task_overhead`): a trivial jitted call on a block of devices
  with a small activation moved in from another block and a host microbatch put there, as the local runtime runs
  a stage's forward or backward; the median time at a few activation sizes, fitted to t = overhead + beta * bytes.
  Stored as ``device.task_overhead_s``: the planner charges it once per stage forward and once per backward per
  microbatch.

The package's modules, one job each: :mod:`.timing` (how a program is timed), :mod:`.fits` (alpha-beta fits),
:mod:`.collectives`, :mod:`.tasks`, :mod:`.kernels` (kernels, the gradient chain, state arrays): the measurements;
:mod:`.profile` (the whole profile), :mod:`.modes` (what each command-line mode writes), :mod:`.cli`.

``--quick`` uses small sizes and few repeats (seconds; noisier figures, for tests and a first look).
Each profile records the load average at its start and end (``load_average``): this machine is shared, and its
speed moves with what else runs (``bench/bench_execute.py --calibrate`` measures a profile just before it runs).

``--task-overhead-only`` (``--kernel-overhead-only``) measures just the per-task (per-kernel and per-state-array)
overhead and adds it to an existing profile; ``--chain-reads-only`` just the gradient chain's re-reads
(:func:`measure_chain_reads`); ``--collectives-only`` measures just the collectives and refits the
links.

>>> p = measure_cpu(quick=True)            # doctest: +SKIP
>>> p["device"]["peak_flops"]["float32"] > 0  # doctest: +SKIP
True
"""

from .cli import main
from .collectives import collective_mesh, measure_collectives, measure_collectives_between_compute
from .fits import fit_alpha_beta, fit_collectives, latency_steps, refit_collectives
from .kernels import measure_buffer_overhead, measure_chain_reads, measure_kernel_overhead, step_point
from .modes import update_chain_reads, update_collectives, update_kernel_overhead, update_task_overhead, write_profile
from .profile import REGENERATE, measure_cpu, total_memory_bytes
from .tasks import measure_task_overhead, per_device_task_overhead

__all__ = ["measure_cpu", "measure_collectives", "measure_collectives_between_compute", "fit_collectives",
           "measure_task_overhead", "per_device_task_overhead", "write_profile", "update_task_overhead",
           "update_collectives", "fit_alpha_beta", "latency_steps", "refit_collectives", "total_memory_bytes",
           "measure_kernel_overhead", "update_kernel_overhead", "measure_buffer_overhead", "measure_chain_reads",
           "update_chain_reads", "step_point", "collective_mesh", "REGENERATE", "main"]
