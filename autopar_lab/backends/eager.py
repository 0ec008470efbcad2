"""The host of a framework that launches every kernel from Python, one by one (eager PyTorch: Megatron-LM and
Megatron-Core without CUDA graphs, torchtitan without ``torch.compile``): fitted.

Such a host runs ahead of the GPU while kernels are long, and the GPU waits on it where they are short. A plan says
its framework runs so with ``stage_pins["host"]`` (:data:`HOSTS`: ``megatron_plan(library_kernels=True)``, which
prices Megatron-LM's own stack, sets "eager-te" unless ``cuda_graphs=True``; ``fsdp_plan(compile=False)`` "eager";
a plan on the CPU's devices, which this library runs as XLA programs, never);
the stage-cost formula then prices each stage's microbatch as the longer of its GPU time and ``kernels x`` the host
time a kernel (:func:`host_launch_s`; :func:`~autopar_lab.pricing.stage.host_stretch`). XLA (JAX, MaxText)
and CUDA graphs launch from compiled executables and pay none of it; ``torch.compile``'s wrapper launches few,
fused kernels and is not priced.

The same host's memory: PyTorch's caching allocator reserves more than the tensors it holds allocated, and eager
frameworks log the reserved figure (torchtitan: ``torch.cuda`` max_memory_reserved): :func:`reserved_bytes`, the
allocated peak the cost model counts x :data:`ALLOCATOR_RESERVE`
(:func:`~autopar_lab.pricing.memory.memory_breakdown`'s ``reserved_bytes``).

Everything here is **fitted**: :data:`FITTED` names the measurement behind each figure.
"""

from __future__ import annotations

from typing import Mapping

__all__ = ["HOSTS", "TE_LAUNCH_S", "EAGER_LAUNCH_S", "ALLOCATOR_RESERVE", "FITTED", "host_launch_s", "reserved_bytes"]

#: The hosts a plan may name (``stage_pins["host"]``): "eager", each kernel launched from Python through PyTorch's
#: own modules (torchtitan without torch.compile); "eager-te", through Transformer Engine's modules (Megatron-LM's
#: stack, ``megatron_plan(library_kernels=True)``), whose Python costs more per kernel.
HOSTS = ("eager", "eager-te")

#: Seconds of host time per kernel the cost model prices (the framework's Python, PyTorch's dispatcher and the
#: launch) for an eager host through Transformer Engine's modules (fitted: :data:`FITTED`).
TE_LAUNCH_S = 64e-6

#: The same through PyTorch's own modules: :data:`TE_LAUNCH_S` over the ratio of a TE Linear's host time to a torch
#: Linear's on one machine (not fitted: :data:`FITTED`).
EAGER_LAUNCH_S = 24e-6

#: What PyTorch's caching allocator reserves at an eager host's peak, per byte allocated there (the peak the cost
#: model counts: ``torch.cuda.max_memory_reserved`` over ``max_memory_allocated``; fitted: :data:`FITTED`).
ALLOCATOR_RESERVE = 1.21

#: Each fitted or derived figure of this module -> the measurement behind it.
FITTED: Mapping[str, str] = {
    "TE_LAUNCH_S": "fitted on one row, Megatron-Core r0.8.0's GPT 1.7B on 48 H100 (hidden 2,048, micro-batch 1 x "
                   "4,096 tokens, dp=48, no CUDA graphs: the reference's 'Runs of 2022-2026', bench/"
                   "bench_fidelity.py mlm-h100-1.7B): its published 408.8 TFLOP/s is a 0.452 s step; the cost "
                   "model prices its GPU work at 0.346 s and launches 7,064 kernels a step (1,766 a microbatch): "
                   "0.452 s / 7,064 = 64 us a kernel (2026-12-07, bench/RESULTS.md fidelity-today; every other "
                   "row is out of sample, and none of them is host-bound at it). Order of magnitude: PyTorch's "
                   "eager path costs 5-25 us of host time per operator (Python, the dispatcher, autograd, "
                   "cudaLaunchKernel), and Transformer Engine's modules add their own Python: a TE Linear's forward "
                   "took 90.5 and 99.7 us of CPU time on GH200 and GB200 where torch's took 33.2 and 37.1 us "
                   "(NVIDIA/TransformerEngine issue 2053, 2025). The figure is per kernel the cost model counts "
                   "(its graph's kernels, about 74 a GPT layer's forward and backward), not per CUDA launch of the "
                   "real step",
    "EAGER_LAUNCH_S": "derived, not fitted: TE_LAUNCH_S / 2.7, the ratio of a TE Linear's host time to torch's on "
                      "the same host (90.5 / 33.2 on GH200, 99.7 / 37.1 on GB200: NVIDIA/TransformerEngine issue "
                      "2053), at the top of PyTorch's 5-25 us per eager operator. No row is host-bound at it: "
                      "torchtitan's 8B rows on their 500 W H100s launch 8,862 kernels a 2.6 s microbatch (0.21 s of "
                      "host; the published 2.84 s step would need 320 us a kernel). Megatron-LM's 2021 rows (plain "
                      "PyTorch modules, priced "
                      "without library_kernels and so without a host) launch at most 4,197 kernels a 0.24 s "
                      "microbatch (the 7.5B row, tp=4): 56 us would bind it; with TE_LAUNCH_S it read 0.860 of the "
                      "published throughput instead of 0.985, with EAGER_LAUNCH_S 0.985 (unchanged)",
    "ALLOCATOR_RESERVE": "fitted on one row, torchtitan's Llama 3.1 8B on 8 H100 (FSDP over 8, op-level selective "
                         "checkpointing, 2 x 8,192 tokens, bf16 with float32 reduction, eager: the reference's "
                         "torchtitan section, bench/bench_fidelity.py torchtitan-8b-8): its published 82.4 GiB is "
                         "torch.cuda's max_memory_reserved (torchtitan's train.py logs memory/max_reserved; the "
                         "max_active beside it is not published); the cost model counts 68.33 GiB allocated at its "
                         "peak, the float32 loss's backward, with the 4.0 GiB eager SAC caches of the blocks' output "
                         "projections (w2's output, 2 bytes x 16,384 tokens x 4,096 a layer x 32 layers, which no "
                         "backward operator reads: pricing.layers, graph.attention.output_matmuls; torch.compile's "
                         "run, which keeps only what its backward reads, logged 77.0 GiB against eager's 82.4): "
                         "82.4 / 68.33 = 1.206, taken as 1.21 (2026-12-07; 1.28 = 82.4 / 64.33 before that count). "
                         "Out of sample: the same table's 128-GPU row, 57.82 GiB allocated x 1.21 = 70.0 GiB against "
                         "67.0 published (1.04; 1.03 before, when the reserve absorbed the 8-GPU row's 4.0 GiB). What "
                         "it covers: the caching allocator's reserved blocks that the peak cannot reuse (7.8 GiB "
                         "float32 logits-sized tensors beside the blocks of many sizes that eager temporaries leave), "
                         "and what the count misses of this run: the final norm's saved tensors (0.5 GiB), less the "
                         "count's per-layer weight-derived copies (2.5 GiB) standing in for FSDP2's gathered root "
                         "group and last block (2.4 GiB). Applied only to a plan whose stage_pins['host'] is one of "
                         "HOSTS (fsdp_plan(compile=False); megatron_plan(library_kernels=True) without CUDA graphs, "
                         "whose rows publish no memory: unchecked there)",
}


def host_launch_s(host: str | None) -> float:
    """Seconds of host time per kernel for a plan whose ``stage_pins["host"]`` is ``host``: :data:`EAGER_LAUNCH_S`
    for "eager", :data:`TE_LAUNCH_S` for "eager-te", 0 for None (a compiled program: XLA, CUDA graphs).

    >>> host_launch_s("eager") < host_launch_s("eager-te"), host_launch_s(None)
    (True, 0.0)
    """
    if host is None:
        return 0.0
    if host not in HOSTS:
        raise ValueError(f"host must be one of {', '.join(map(repr, HOSTS))} or None, got {host!r:.40}; pass "
                         "\"eager\" for a framework that launches each kernel from Python")
    return TE_LAUNCH_S if host == "eager-te" else EAGER_LAUNCH_S


def reserved_bytes(host: str | None, allocated: float) -> float:
    """What PyTorch's caching allocator holds reserved at a peak of ``allocated`` bytes on a plan whose
    ``stage_pins["host"]`` is ``host``: ``allocated`` x :data:`ALLOCATOR_RESERVE` (fitted) for an eager PyTorch host
    (:data:`HOSTS`); ``allocated`` itself for None (not modelled: XLA's allocator, CUDA graphs' pools).

    >>> reserved_bytes(None, 2**30) == 2**30 < reserved_bytes("eager", 2**30)
    True
    """
    if host is None:
        return float(allocated)
    host_launch_s(host)  # the one check of a host's name
    return float(allocated) * ALLOCATOR_RESERVE
