"""Benchmark (issue 14): the cost model against published training runs.

Every row of the Megatron-LM weak-scaling table (Narayanan et al., SC21; ``shared/reference/published-measurements.md``)
planned in its published layout and priced by the library: predicted TFLOP/s per GPU and peak memory per device
beside the published figure, the ratio per row, the median and the worst.

The published layout, as the paper ran it:

* the zoo's GPT (``gpt-tiny`` reshaped: the row's hidden size, layers and heads, sequence 2048, vocabulary 51,200),
  float16 in mixed precision (fp32 master weights and Adam moments), the published global batch;
* the ``dgx-a100`` cluster of the row's GPU count (8 per host);
* ``p`` pipeline stages of ``l / p`` transformer layers each, the embedding with the first and the head with the
  last; each stage on ``d x t`` GPUs viewed as a (d, t) logical mesh (tensor parallelism inside a host);
* Megatron-LM's tensor-parallel sharding, pinned by the library (``al.megatron_plan``, issue 31:
  :mod:`autopar_lab.layouts`): qkv and the first MLP matmul split by columns, the attention projection and the
  second MLP matmul by rows (one all-reduce each, forward and backward), attention split by heads, the embedding and
  the head split by vocabulary; parameters and Adam state sharded only by ``t`` (``zero=0``: no distributed
  optimizer in 2021); the intra-op ILP decides everything else around the pins;
* full activation recomputation (``remat``); one stage: 1F1B; the pipelined rows (39B, 145B, 530B): the interleaved
  1F1B schedule they ran, with ``v`` model chunks per stage (:func:`virtual_stages`: the paper does not give ``v``;
  the smallest divisor above 1 of the layers per stage is assumed: 2, 2 and 3); ``--no-interleave`` prices plain
  1F1B instead (the nearest plan before the planner had the interleaved schedule);
* attention as matmuls and a fused softmax through memory (Megatron-LM of 2021 had no flash attention; the
  ``dgx-a100`` preset's default would price flash attention: ``--flash`` shows those figures too).

Assumed where the paper leaves it out: microbatch size 1 (``B / d`` microbatches per step); no dropout (the zoo's GPT
has none; Megatron-LM trained with attention and hidden dropout 0.1); the interleaving factor (above). Not priced:
data loading, logging.

TFLOP/s per GPU counts the published formula's FLOPs, recomputation included: F = 96 B s l h^2 (1 + s / (6 h)
+ V / (16 l h)); predicted TFLOP/s = F / (predicted step time x GPUs).

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_fidelity.py [--rows 1.7B,7.5B] [--flash] [--no-interleave] [--json]

**Runs of 2022-2026** (issue 31 item 3, ``--today``): every row of the reference's section of that name, priced through
the public API in its published layout, format and recomputation (:data:`TODAY`; what each row assumes where its
source is silent is in its ``assumed`` field and in bench/RESULTS.md):

* Megatron-LM on H100 (Megatron-Core r0.8.0's weak-scaling table): the zoo's GPT at the row's shape, sequence 4,096,
  vocabulary 131,072, ``al.megatron_plan(dp=48, tp, pp, micro_batch_size=1, zero=1, sequence_parallel=tp > 1,
  precision="bf16", library_kernels=True)`` on ``dgx-h100`` (Transformer Engine's kernels: the activations
  Korthikanti et al. count), the pipelined rows interleaved;
* Llama 3 405B's first row: ``llama3-405b`` at sequence 8,192, ``megatron_plan(dp=64, tp=8, pp=16, zero=2,
  sequence_parallel=True, schedule="interleaved", virtual_stages=8)`` on 1,024 ``dgx-h100`` hosts, no
  recomputation (one layer a chunk, as the paper's first chunk holding only the embedding implies);
* torchtitan's Llama 3.1 8B rows: ``al.fsdp_plan(local_batch_size=2, remat="selective", compile=False,
  eager_loss="torchtitan")`` (eager: no torch.compile; torchtitan's selective is its op-level policy,
  ``"selective-op"``; its float32 cross-entropy after the model) on ``grand-teton-h100``, the run's H100 (96 GB
  HBM2e at 2.4 TB/s, 500 W power limit: 886.8 BF16 TFLOP/s, the preset's sources say why); their published memory
  is what torchtitan logs, the caching allocator's max_memory_reserved, compared with the plan's ``reserved_bytes``
  (the eager host's fitted reserve, ``autopar_lab.backends.eager.ALLOCATOR_RESERVE``: fitted on the 8-GPU row, the
  128-GPU row out of sample; the eager SAC's cached w2 outputs counted in the allocated peak, not in the reserve); every other row's with the bytes allocated (KempnerForge logs max_memory_allocated);
* KempnerForge's H200 layouts: a pure-bf16 Llama 3 8B (80.7 GB on one GPU leaves no room for fp32 state),
  ``fsdp_plan`` with FSDP or TP over 1, 2 or 4 of a node's 4 H200s (``dgx-h200`` with 4 devices a host), full
  recomputation, two microbatches of 4 sequences; a 4-GPU node is an HGX board whose GPUs are joined pairwise
  (``mesh_peers=3``: 2 of its GPUs talk over a third of a GPU's NVLink); FSDP2's gradients held unsharded in float32
  between microbatches where it wraps the model (``accumulate_unsharded``), its bf16 cross-entropy on gathered
  logits (``eager_loss="kempnerforge"``);
* DeepSeek-V3 on 256 H100 (``--deepseek``: the slowest row to price): ``deepseek-v3``, ``megatron_plan(dp=64, pp=4,
  ep=64, zero=3, remat=True, overlap_moe_comm=True)`` (NeMo Automodel's config checkpoints every block; the
  expert all-to-alls behind the other microbatch's compute, as DualPipe and Megatron-Core's combined 1F1B run them);
* MaxText on TPU v5p: MaxText's ``global_parameter_scale`` 32 and 128 models (``configs/base.yml`` scaled as its
  ``pyconfig.get_individual_scales`` does) as Llama-shaped models, ``al.maxtext_plan(ici_fsdp=-1, ici_tensor,
  per_device_batch_size, remat="minimal", attention="flash")`` on one slice.

The eager host (``autopar_lab.backends.eager``): Megatron-LM's rows priced with its own stack (``library_kernels``,
Transformer Engine's modules, no CUDA graphs) and torchtitan's eager rows have each stage's microbatch last at least
its kernels times the host's time a kernel (fitted on mlm-h100-1.7B alone: 64 us through TE; 24 us through PyTorch's
modules, not fitted); ``host_s`` in a row is what it adds to the step.

Throughput is compared as step times: a row published as tokens/s gives its step as tokens / rate; one published as
TFLOP/s per device as F / (rate x devices) with F the publishers' count (:func:`model_flops`: 6 x tokens x the
matmul weights, plus 12 x tokens x layers x sequence x attention width; no recomputation, attention counted whole as
Megatron-LM's and MaxText's counters do), so predicted / published = published step / predicted step.

    JAX_PLATFORMS=cpu .venv/bin/python bench/bench_fidelity.py --today [--rows kf-none-1,kf-fsdp-2] [--deepseek] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# name, heads, hidden, layers, tensor t, pipeline p, GPUs, global batch, published TFLOP/s per GPU
ROWS = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("39B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
]
SEQ, VOCAB = 2048, 51200
GIB = 2**30


def published_flops(B: int, s: int, l: int, h: int, V: int) -> float:  # noqa: E741  (the paper's symbols)
    """F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)): the published count per step, recomputation included.

    >>> round(published_flops(512, 2048, 24, 2304, 51200) / 1e15, 2)
    15.47
    """
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def virtual_stages(layers_per_stage: int) -> int:
    """The interleaving factor assumed for a pipelined row: the smallest divisor above 1 of its transformer layers per
    stage (Megatron-LM needs equal chunks; the paper does not say which ``v`` each row ran).

    >>> [virtual_stages(n) for n in (24, 10, 3)]
    [2, 2, 3]
    """
    return next(v for v in range(2, layers_per_stage + 1) if layers_per_stage % v == 0)


def published_plan(name: str, *, flash: bool = False, micro: int = 1, table=None, interleave: bool = True):
    """(plan, model, GPUs, published TFLOP/s, FLOPs per step) of one row in its published layout (pipelined rows
    interleaved unless ``interleave`` is False), priced through the public API: ``al.megatron_plan`` with the row's
    degrees, Megatron-LM's sharding pinned by the library, the state stored whole over the data-parallel group
    (``zero=0``: SC21 ran without the distributed optimizer), full recomputation, ``micro`` sequences a microbatch,
    no communication overlapped (megatron_plan's defaults, Megatron-Core's: assumed, SC21's Megatron-LM reduced the
    gradients after the backward; ``--overlap-grad-reduce`` came with Megatron-Core)."""
    import autopar_lab as al
    from autopar_lab.pricing import CostTable

    _, a, h, l, t, p, gpus, B, pub = next(r for r in ROWS if r[0] == name)  # noqa: E741
    d = gpus // (t * p)
    model = al.models.get("gpt-tiny", seq_len=SEQ, hidden_size=h, num_layers=l, num_heads=a, vocab_size=VOCAB,
                          batch_size=B, dtype="float16")
    cluster = al.Cluster.preset("dgx-a100", hosts=gpus // 8).with_(flash_attention=flash)
    if table is None:
        table = CostTable.build(model, cluster)
    elif (table.cluster, table.batch_size, len(table.layer_names)) != (cluster, B, l + 2):
        raise ValueError(f"the cost table given for row {name} was built for another cluster, batch or depth; build "
                         "it with CostTable.build on the row's model and cluster, or leave table out")
    sched = dict(schedule="interleaved", virtual_stages=virtual_stages(l // p)) if p > 1 and interleave else {}
    plan = al.megatron_plan(table=table, dp=d, tp=t, pp=p, micro_batch_size=micro, remat=True, zero=0, **sched)
    return plan, model, gpus, pub, published_flops(B, SEQ, l, h, VOCAB)


def row(name: str, flash: bool = False, micro: int = 1, interleave: bool = True, table=None) -> dict:
    """One row's prediction beside its published figures; ``table``: a cost table already built for the row's model
    and cluster (as :func:`published_plan` builds it), to price on instead of building one."""
    from autopar_lab.pricing.memory import PARTS, memory_breakdown

    t0 = time.perf_counter()
    plan, model, gpus, pub, F = published_plan(name, flash=flash, micro=micro, interleave=interleave, table=table)
    step = plan.cost.step_time_s
    tflops = F / (step * gpus) / 1e12
    mem = memory_breakdown(plan)
    peak = max(mem, key=lambda r: r["total_bytes"])
    c = plan.cost
    return {"row": name, "gpus": gpus, "published_tflops": pub, "predicted_tflops": tflops, "ratio": tflops / pub,
            "schedule": plan.schedule + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""),
            "step_s": step, "published_step_s": F / (pub * 1e12 * gpus), "microbatches": plan.microbatches,
            "compute_s": c.compute_s, "comm_s": c.comm_s, "reshard_s": c.reshard_s, "bubble_s": c.bubble_s,
            "hidden_comm_s": c.hidden_comm_s, "kernels": c.kernels, "flash_attention": flash,
            "peak_mem_gib": peak["total_bytes"] / GIB, "fits": c.fits, "limit_gib": c.mem_limit_bytes / GIB,
            "peak_stage": peak["stage"], "peak_parts_gib": {p: peak[p] / GIB for p in PARTS},
            "microbatches_in_flight": peak["microbatches_in_flight"], "seconds": time.perf_counter() - t0}


def summary(rows: list[dict]) -> dict:
    err = [abs(r["ratio"] - 1) for r in rows]
    return {"median_abs_err": statistics.median(err), "worst_abs_err": max(err),
            "worst_row": rows[err.index(max(err))]["row"], "all_fit": all(r["fits"] for r in rows)}


# ---------------------------------------------------------------------------------------------------------------
# Runs of 2022-2026


def model_flops(tokens: float, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
                vocab: int, seq: int, gated: bool = True) -> float:
    """FLOPs of one step as the publishers count them: 6 x tokens x (every layer's matmul weights + the head) +
    12 x tokens x layers x seq x heads x head_dim (attention's two matmuls, forward and backward, the whole square);
    no recomputation, the embedding lookup free. For GPT (ungated MLP of 4h) it is Megatron-LM's
    72 B s l h^2 (1 + s / (6 h) + V / (12 l h)).

    >>> B, s, l, h, V = 192, 4096, 24, 2048, 131072
    >>> f = model_flops(B * s, l, h, 4 * h, 16, 16, 128, V, s, gated=False)
    >>> abs(f / (72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))) - 1) < 1e-12
    True
    """
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = (3 if gated else 2) * hidden * ffn
    return 6.0 * tokens * (layers * (attn + mlp) + hidden * vocab) + 12.0 * tokens * layers * seq * heads * head_dim


@dataclass(frozen=True)
class Today:
    """One published run of 2022-2026: how to build its model, cluster and plan, and what was published.

    ``unit``: "tflops" (per device, the publishers' count :func:`model_flops`), "tokens_per_device" or "step_s";
    ``mem_gib``: the published peak memory per device (GiB) where there is one; ``mem_logged``: what that figure is,
    "allocated" (``torch.cuda.max_memory_allocated``: KempnerForge's) or "reserved" (``max_memory_reserved``, the
    caching allocator's: torchtitan's), compared with the plan's ``total_bytes`` or ``reserved_bytes``
    (:func:`~autopar_lab.pricing.memory.memory_breakdown`); ``group``: rows measured side by side
    (their order is checked, Spearman); ``assumed``: what the source leaves out and the row assumes."""

    name: str
    source: str
    planner: str  # "megatron", "fsdp" or "maxtext"
    model: str
    model_kw: dict
    preset: str
    count: int
    plan_kw: dict
    devices: int
    published: float
    unit: str
    cluster_kw: dict = field(default_factory=dict)
    mem_gib: float | None = None
    mem_logged: str = "allocated"
    group: str | None = None
    assumed: str = ""

    @property
    def tokens(self) -> int:
        kw = self.model_kw
        return kw["batch_size"] * kw["seq_len"]

    def flops(self) -> float:
        """The publishers' FLOPs of one step (:func:`model_flops`) from the row's model configuration."""
        import autopar_lab as al

        c = al.models.get(self.model, **self.model_kw).config
        gpt = self.model.startswith("gpt")
        hd = (getattr(c, "head_dim", None) or c.hidden_size // c.num_heads)
        return model_flops(self.tokens, c.num_layers, c.hidden_size, 4 * c.hidden_size if gpt else c.ffn_hidden,
                           c.num_heads, c.num_heads if gpt else c.num_kv_heads, hd, c.vocab_size, c.seq_len,
                           gated=not gpt)

    def published_step_s(self) -> float:
        if self.unit == "step_s":
            return self.published
        if self.unit == "tokens_per_device":
            return self.tokens / (self.published * self.devices)
        return self.flops() / (self.published * 1e12 * self.devices)


def _mlm(name, heads, hidden, layers, tp, pp, gpus, batch, tflops) -> Today:
    sched = dict(schedule="interleaved", virtual_stages=2) if pp > 1 else {}
    return Today(f"mlm-h100-{name}", "Megatron-LM README weak scaling (Megatron-Core r0.8.0)", "megatron", "gpt-tiny",
                 dict(seq_len=4096, hidden_size=hidden, num_layers=layers, num_heads=heads, vocab_size=131072,
                      batch_size=batch, dtype="bfloat16"), "dgx-h100", gpus // 8,
                 dict(dp=48, tp=tp, pp=pp, micro_batch_size=1, zero=1, sequence_parallel=tp > 1, precision="bf16",
                      overlap_grad_reduce=True, overlap_param_gather=True, tp_comm_overlap=tp > 1,
                      library_kernels=True, **sched), gpus,
                 tflops, "tflops",
                 assumed="micro-batch 1, no recomputation, flash attention, Transformer Engine's fused kernels "
                         "(library_kernels: the activations Korthikanti et al. count), the distributed optimizer "
                         "(zero=1); "
                         "the gradient reduce-scatter, parameter all-gather and TP communication overlapped (the "
                         "README's words; TP overlap where TP > 1, as Megatron-LM allows it only with sequence "
                         "parallelism)"
                         + (", interleaved with 2 virtual stages" if pp > 1 else ""))


def _kf(layout: str, n: int, tokens_all: float, mem_gb: float) -> Today:
    dp, tp = (n, 1) if layout in ("none", "fsdp") else (1, n)
    return Today(f"kf-{layout}-{n}", "KempnerForge benchmarks/mfu_scaling (H200)", "fsdp", "llama3-8b",
                 dict(seq_len=4096, batch_size=8 * dp, mixed_precision=False), "dgx-h200", 1,
                 dict(dp_shard=dp, tp=tp, local_batch_size=4, remat=True, compile=True, accumulate_unsharded=n > 1,
                      eager_loss="kempnerforge"),
                 n, tokens_all / n,
                 "tokens_per_device",
                 cluster_kw=dict(devices_per_host=n, mesh_peers=3), mem_gib=mem_gb,
                 group="kempnerforge",
                 assumed="pure bf16 state (8 bytes a parameter with Adam), 4 x 4,096 "
                         "tokens a microbatch, 2 microbatches; the memory its \"GB\" are GiB of "
                         "torch.cuda.max_memory_allocated (kempnerforge/metrics/memory.py divides by 1024**3); with "
                         "more than one GPU FSDP2 wraps the model (a group of one under TP: "
                         "kempnerforge/distributed/setup.py) and skips the gradient sync but on the last microbatch "
                         "(training/grad.py maybe_no_sync): float32 gradients held unsharded (accumulate_unsharded); "
                         "the node's 4 H200s an HGX 4-GPU board, NVLink as a "
                         "full mesh without NVSwitch (mesh_peers=3: a pair of GPUs talks over a third of a GPU's "
                         "links)")


def _tt(gpus: int, tokens: float, mem_gib: float) -> Today:
    return Today(f"torchtitan-8b-{gpus}", "torchtitan llama3_h100_202412", "fsdp", "llama3-8b",
                 dict(seq_len=8192, batch_size=2 * gpus), "grand-teton-h100", gpus // 8,
                 dict(dp_shard=-1, local_batch_size=2, remat="selective", precision="bf16", compile=False,
                      eager_loss="torchtitan"), gpus, tokens,
                 "tokens_per_device", mem_gib=mem_gib, mem_logged="reserved",
                 assumed="the memory torchtitan logs is torch.cuda's max_memory_reserved (train.py's "
                         "memory/max_reserved), compared with the plan's reserved figure (the eager host's fitted "
                         "allocator reserve: autopar_lab.backends.eager.ALLOCATOR_RESERVE, fitted on the 8-GPU row, "
                         "the 128-GPU row out of sample); torchtitan's op-level selective checkpointing (its policy saves SDPA's "
                         "output and every other mm's, recomputing the rest) priced as such "
                         "(remat 'selective-op': wk, wo and w3 run again in the backward; eager, it also caches "
                         "each block's w2 output, which no backward operator reads: 4.0 GiB over 32 layers, "
                         "counted); no "
                         "torch.compile: eager (compile=False, every "
                         "elementwise op a kernel through HBM); the run's H100s as the grand-teton-h100 preset "
                         "(96 GB HBM2e at 2.4 TB/s; the 500 W cap's peak, 886.8 BF16 TFLOP/s, between the SXM's "
                         "and the NVL's as torchtitan's note puts it: linear in power between their datasheets)")


_MAXTEXT_ASSUMED = ("attention='flash' as the run's script passes it (configs/v5p/32b.sh, 128b.sh); remat 'minimal' "
                    "priced as 'dots' (every matmul's output kept: attention's output too, which MaxText's minimal "
                    "recomputes); the activations between blocks split over tensor (base.yml's activation_embed "
                    "rule), priced as sequence parallelism")

#: name -> row: the reference's "Runs of 2022-2026", in its order.
TODAY = {r.name: r for r in [
    _mlm("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _mlm("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _mlm("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _mlm("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    Today("llama3-405b", "Llama 3 paper, Table 4, first row", "megatron", "llama3-405b",
          dict(seq_len=8192, batch_size=2048), "dgx-h100", 1024,
          dict(dp=64, tp=8, pp=16, micro_batch_size=1, zero=2, sequence_parallel=True, precision="bf16",
               schedule="interleaved", virtual_stages=8, overlap_grad_reduce=True, overlap_param_gather=True,
               library_kernels=True),
          8192, 430.0, "tflops",
          assumed="micro-batch 1; 8 virtual stages, one layer a chunk (the paper's 3.3.2: with one layer fewer on "
                  "the first and last stages, 'the first model chunk on the first stage has only the embedding': "
                  "126 layers, the embedding and the head in 128 one-layer chunks over 16 stages); fused kernels "
                  "keeping what Megatron-LM's do (library_kernels), "
                  "sequence parallelism with TP, ZeRO-2 for FSDP without "
                  "resharding, FSDP's reduce-scatter and all-gather overlapped with compute (as FSDP does; the "
                  "paper does not say), TP communication not overlapped (not stated), the interleaved schedule's "
                  "microbatch groups at N = pp = 16, Megatron-LM's default (the paper's tunable N is not given for "
                  "this run; of its 32 microbatches N = 16 or 32 run, 32 holds more in flight, and Llama 3's "
                  "flexible N below the stage count runs only fewer microbatches than stages: schedules."
                  "FlexibleGroup)"),
    _tt(8, 5762, 82.4),
    _tt(128, 5605, 67.0),
    _kf("none", 1, 10471, 80.7),
    _kf("fsdp", 2, 18728, 62.4),
    _kf("tp", 2, 13163, 57.8),
    _kf("fsdp", 4, 38983, 61.1),
    _kf("tp", 4, 25135, 39.4),
    Today("deepseek-v3", "NeMo Automodel performance summary", "megatron", "deepseek-v3",
          dict(seq_len=4096, batch_size=512), "dgx-h100", 32,
          dict(dp=64, tp=1, pp=4, ep=64, zero=3, micro_batch_size=1, precision="bf16", overlap_grad_reduce=True,
               overlap_param_gather=True, overlap_moe_comm=True, remat=True, schedule="interleaved",
               virtual_stages=2), 256, 8.18, "step_s",
          assumed="full recomputation of every block (the run's config, examples/benchmark/configs/"
                  "deepseek_v3_te_deepep.yaml: activation_checkpointing true, a checkpoint wrapper per block); "
                  "the interleaved schedule with the run's 8 virtual stages, 2 chunks on each of the 4 pipeline "
                  "ranks (61 layers: chunks of 7 and 8, split as evenly as they go), FSDP as ZeRO-3 "
                  "(the config keeps parameters gathered after the forward, reshard_after_forward false: ZeRO-2 "
                  "prices 12.93 s and 62.9 GiB), its reduce-scatter and all-gather overlapped with compute (FSDP2's "
                  "default prefetching); node-limited routing (4 of 8 groups) with DeepEP's one copy a node; "
                  "the expert-parallel all-to-alls overlapped with the other microbatch's compute "
                  "(overlap_moe_comm: DualPipe's defining feature, Megatron-Core's "
                  "--overlap-moe-expert-parallel-comm; the Automodel summary does not say how its run overlaps)"),
    Today("maxtext-32b", "MaxText configs/tpu/v5p README", "maxtext", "llama3-8b",
          dict(seq_len=2048, hidden_size=8192, num_layers=32, num_heads=64, num_kv_heads=64, head_dim=128,
               ffn_hidden=28672, vocab_size=32000, batch_size=6 * 128), "tpu-v5p", 128,
          dict(ici_fsdp=-1, ici_tensor=4, per_device_batch_size=6, remat="minimal", attention="flash",
               precision="bf16"), 128, 328.0,
          "tflops", assumed="global_parameter_scale 32: emb 8,192, 64 heads of 128, MLP 28,672, 32 layers, vocabulary "
                            "32,000; " + _MAXTEXT_ASSUMED),
    Today("maxtext-128b", "MaxText configs/tpu/v5p README", "maxtext", "llama3-8b",
          dict(seq_len=2048, hidden_size=8192, num_layers=64, num_heads=128, num_kv_heads=128, head_dim=128,
               ffn_hidden=57344, vocab_size=32000, batch_size=256), "tpu-v5p", 256,
          dict(ici_fsdp=-1, ici_tensor=8, per_device_batch_size=1, remat="minimal", attention="flash",
               precision="bf16"), 256, 315.0,
          "tflops", assumed="global_parameter_scale 128: emb 8,192, 128 heads of 128, MLP 57,344, 64 layers, "
                            "vocabulary 32,000; " + _MAXTEXT_ASSUMED),
]}


def today_plan(r: Today):
    """The row's plan, through the public API (``al.megatron_plan`` / ``al.fsdp_plan`` / ``al.maxtext_plan``)."""
    import autopar_lab as al

    model = al.models.get(r.model, **r.model_kw)
    cluster = al.Cluster.preset(r.preset, r.count)
    if r.cluster_kw:
        cluster = cluster.with_(**r.cluster_kw)
    planner = {"megatron": al.megatron_plan, "fsdp": al.fsdp_plan, "maxtext": al.maxtext_plan}[r.planner]
    return planner(model, cluster, **r.plan_kw)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two lists without ties.

    >>> spearman([1, 2, 3, 4], [10, 20, 40, 30])
    0.8
    """
    def ranks(x):
        order = sorted(range(len(x)), key=lambda k: x[k])
        out = [0] * len(x)
        for rank, k in enumerate(order):
            out[k] = rank
        return out

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def today_row(r: Today) -> dict:
    from autopar_lab.pricing.memory import PARTS, memory_breakdown

    t0 = time.perf_counter()
    plan = today_plan(r)
    step, pub = plan.cost.step_time_s, r.published_step_s()
    mem = memory_breakdown(plan)
    peak = max(mem, key=lambda m: m["total_bytes"])
    # the figure the source logs: allocated, or the caching allocator's reserved (Today.mem_logged)
    logged = peak["reserved_bytes" if r.mem_logged == "reserved" else "total_bytes"] / GIB
    return {"row": r.name, "devices": r.devices, "plan": plan.method, "published": r.published, "unit": r.unit,
            "published_step_s": pub, "step_s": step, "ratio": pub / step,
            "tokens_per_device_s": r.tokens / step / r.devices,
            "published_tokens_per_device_s": r.tokens / pub / r.devices,
            "peak_mem_gib": peak["total_bytes"] / GIB, "peak_reserved_gib": peak["reserved_bytes"] / GIB,
            "mem_logged": r.mem_logged, "compared_mem_gib": logged, "published_mem_gib": r.mem_gib,
            "mem_ratio": logged / r.mem_gib if r.mem_gib else None, "fits": plan.cost.fits,
            "limit_gib": plan.cost.mem_limit_bytes / GIB, "peak_parts_gib": {p: peak[p] / GIB for p in PARTS},
            "group": r.group, "compute_s": plan.cost.compute_s, "comm_s": plan.cost.comm_s,
            "reshard_s": plan.cost.reshard_s, "bubble_s": plan.cost.bubble_s, "host_s": plan.cost.host_s,
            "assumed": r.assumed,
            "seconds": time.perf_counter() - t0}


def today_summary(rows: list[dict]) -> dict:
    err = [abs(r["ratio"] - 1) for r in rows]
    mem = [abs(r["mem_ratio"] - 1) for r in rows if r["mem_ratio"] is not None]
    out = {"median_abs_err": statistics.median(err), "worst_abs_err": max(err),
           "worst_row": rows[err.index(max(err))]["row"], "all_fit": all(r["fits"] for r in rows),
           "worst_mem_err": max(mem) if mem else None}
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["group"]:
            groups.setdefault(r["group"], []).append(r)
    out["spearman"] = {g: spearman([x["tokens_per_device_s"] for x in rs],
                                   [x["published_tokens_per_device_s"] for x in rs])
                       for g, rs in groups.items() if len(rs) > 2}
    return out


def print_today(rows: list[dict], summ: dict) -> None:
    print("| row | devices | plan | published | pred / pub (throughput) | step s (published) | peak GiB "
          "allocated | compared GiB (published) | pred / pub (memory) | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        unit = {"tflops": "TFLOP/s a device", "tokens_per_device": "tokens/s a device", "step_s": "s a step"}[r["unit"]]
        pm = "-" if r["published_mem_gib"] is None else f"{r['published_mem_gib']:.1f}"
        mr = "-" if r["mem_ratio"] is None else f"{r['mem_ratio']:.2f}"
        cmp = "-" if r["published_mem_gib"] is None else f"{r['compared_mem_gib']:.1f} {r['mem_logged']} ({pm})"
        print(f"| {r['row']} | {r['devices']} | {r['plan']} | {r['published']:g} {unit} | {r['ratio']:.3f} | "
              f"{r['step_s']:.2f} ({r['published_step_s']:.2f}) | {r['peak_mem_gib']:.1f} | {cmp} | {mr} | "
              f"{'yes' if r['fits'] else 'NO'} |")
    wm = summ["worst_mem_err"]
    print(f"median |pred/pub - 1| = {summ['median_abs_err']:.1%}, worst {summ['worst_abs_err']:.1%} "
          f"({summ['worst_row']}); every layout fits: {summ['all_fit']}; worst memory error "
          f"{'-' if wm is None else f'{wm:.1%}'}; Spearman "
          + ", ".join(f"{g} {v:.2f}" for g, v in summ["spearman"].items()))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(r[0] for r in ROWS), help="comma-separated row names")
    ap.add_argument("--flash", action="store_true", help="also price each row with flash attention (informative)")
    ap.add_argument("--micro", type=int, default=1, help="microbatch size (samples per microbatch per replica)")
    ap.add_argument("--no-interleave", action="store_true",
                    help="price the pipelined rows with plain 1F1B (the nearest plan without interleaving)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--today", action="store_true", help="the reference's runs of 2022-2026 instead (--rows picks "
                    "among them)")
    ap.add_argument("--deepseek", action="store_true", help="with --today: DeepSeek-V3 on 256 H100 too (slow)")
    args = ap.parse_args(argv)
    if args.today:
        given = args.rows != ap.get_default("rows")
        names = [n.strip() for n in args.rows.split(",") if n.strip()] if given else \
            [n for n in TODAY if n != "deepseek-v3" or args.deepseek]
        rows = []
        for n in names:
            rows.append(today_row(TODAY[n]))
            if not args.json:
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "peak_parts_gib"}), flush=True)
        out = {"rows": rows, **today_summary(rows)}
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            print_today(rows, out)
        return out
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    inter = not args.no_interleave
    rows = [row(n, micro=args.micro, interleave=inter) for n in names]
    out = {"rows": rows, **summary(rows), "micro": args.micro}
    if args.flash:
        out["flash"] = [row(n, flash=True, micro=args.micro, interleave=inter) for n in names]
    if args.json:
        print(json.dumps(out, indent=1))
        return out
    print("| row | GPUs | schedule | published TFLOP/s | predicted | pred / pub | step s (pub) | peak GiB (stage) | fits in 80 GiB |"
          " peak stage: params + grads + master + optimizer + copies + buffers + recompute + activations GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        parts = " + ".join(f"{v:.1f}" for v in r["peak_parts_gib"].values())
        print(f"| {r['row']} | {r['gpus']} | {r['schedule']} | {r['published_tflops']} | {r['predicted_tflops']:.1f} | {r['ratio']:.3f} "
              f"| {r['step_s']:.2f} ({r['published_step_s']:.2f}) | {r['peak_mem_gib']:.1f} (S{r['peak_stage']}, "
              f"{r['microbatches_in_flight']} in flight) | {'yes' if r['fits'] else 'NO'} | {parts} |")
    print(f"median |pred/pub - 1| = {out['median_abs_err']:.1%}, worst {out['worst_abs_err']:.1%} "
          f"({out['worst_row']}); every layout fits: {out['all_fit']}")
    for r in rows:
        print(f"  {r['row']}: compute {r['compute_s']:.2f} s + collectives {r['comm_s']:.2f} s + resharding "
              f"{r['reshard_s']:.2f} s + bubble {r['bubble_s']:.2f} s; {r['hidden_comm_s']:.3f} s hidden; "
              f"{r['kernels']:,} kernels; {r['seconds']:.0f} s to price")
    if args.flash:
        for r in out["flash"]:
            print(f"  with flash attention: {r['row']} {r['predicted_tflops']:.1f} TFLOP/s ({r['ratio']:.3f} of the "
                  f"published run, which had none), peak {r['peak_mem_gib']:.1f} GiB")
    return out


if __name__ == "__main__":
    main()
