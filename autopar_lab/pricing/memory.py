"""Each stage's peak memory per device, split into what holds it: the breakdown of the figure the plan reports.

A stage's peak is what the pipeline simulation charges it (:mod:`autopar_lab.simulate`): its static bytes plus the
activations of every microbatch it holds at once. The static bytes come from the stage-cost formula
(:func:`~autopar_lab.pricing.stage.stage_cost`) over the layer costs (:class:`~autopar_lab.pricing.layers.LayerCost`),
and :func:`memory_breakdown` splits the same sums:

* ``params_bytes``: the parameters as the step computes with them (for a mixed-precision step, their float16 or
  bfloat16 copy), as sharded on the stage's mesh;
* ``grads_bytes``: their gradients (at the compute precision as JAX traces them; float32 under the ``bf16`` and FP8
  formats, which accumulate and reduce gradients in float32: :mod:`autopar_lab.precision`); on the CPU, none for
  a whole step run as one program, which writes them over the activations its backward frees
  (:mod:`autopar_lab.backends`);
* ``master_bytes``: float32 master weights of a mixed-precision step (0 otherwise);
* ``optimizer_bytes``: the optimizer state (Adam's two moments, float32 for a mixed-precision step, and its count):
  with the three above, 16 bytes a parameter for Adam in mixed precision, as ZeRO counts (18 with fp32 gradients);
* ``copies_bytes``: copies of parameters kept through the step: gathered from their shards (weight-update sharding,
  ZeRO-2 style: the forward's gathered weight is what the backward reads), or cast, sliced or transposed in the
  forward and read by the backward;
* ``fp8_copies_bytes``: an FP8 format's FP8 copies of the weights its FP8 matmuls read (and their transposed copies
  and block scales; 0 otherwise);
* ``buffers_bytes``: the backward's transient buffers: the stage's (average) layer's largest tensor written and not
  kept, and the cotangents of one layer's activations (as large as its activations) while its backward runs; on the
  CPU also the backend's own (:mod:`autopar_lab.backends`): the float32 copies of the stage's largest half-precision
  matmul, and, where a pipeline stage's update program holds more than its backward (its state and the copies it
  makes of its optimizer state), what it holds beyond; on a stage after the first, the gradient of one microbatch's
  input received from the stage before (the input itself is in its activations, the output it sends in the next
  stage's: :func:`~autopar_lab.pricing.stage.stage_cost`); and the destination buffers of its largest layer's
  backward reshardings of one microbatch (live beside their sources; :class:`~autopar_lab.pricing.layers.LayerCost`'s
  ``reshard_dst_*_bytes``);
* ``recompute_bytes``: with rematerialisation, the working set of recomputing one layer's forward (its activations);
* ``activations_bytes``: ``act_per_microbatch_bytes`` x ``microbatches_in_flight`` (the most microbatches the
  schedule keeps alive on the stage at once: up to the number of stages under 1F1B, all of them under GPipe). An
  interleaved stage: its peak less its static bytes (its chunks hold different amounts).

A stage that computes an eager framework's loss (``stage_pins["eager_loss"]``, :mod:`autopar_lab.pricing.eagerloss`)
and peaks at that loss's backward is split as it stands then: without what an FSDP2 framework does not hold at that
moment (:func:`absent_at_loss`: its low-precision parameter shard, and with one microbatch its gradients), the loss's
tensors beyond the head's kept activations in ``buffers_bytes`` (no layer recomputes then: ``recompute_bytes`` 0).

``total_bytes`` is ``Stage.peak_mem_bytes`` itself, and the parts (:data:`PARTS`) add up to it: the bytes allocated.
``reserved_bytes``: what PyTorch's caching allocator reserves at that peak for a plan whose host is an eager PyTorch
one (``stage_pins["host"]``: ``total_bytes`` x the fitted :data:`~autopar_lab.backends.eager.ALLOCATOR_RESERVE`, the
figure ``torch.cuda.max_memory_reserved`` logs); ``total_bytes`` itself for every other plan (not modelled).

``remat_saved_bytes`` is what rematerialisation (full or selective; ``remat_mode`` says which) saves (the activations
the stage would hold without it, less what it holds), 0 for a stage without remat.

    >>> rows = memory_breakdown(plan)                                                    # doctest: +SKIP
    >>> sum(rows[0][p] for p in PARTS) == plan.stages[0].peak_mem_bytes                   # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..backends.eager import reserved_bytes
from ..rematmode import is_full, recomputes, remat_label
from .stage import partial_keys

if TYPE_CHECKING:
    from ..plan import Plan

__all__ = ["PARTS", "absent_at_loss", "memory_breakdown", "stage_memory"]

#: The parts of a stage's peak memory, in the order they stack.
PARTS = ("params_bytes", "grads_bytes", "master_bytes", "optimizer_bytes", "copies_bytes", "fp8_copies_bytes",
         "buffers_bytes", "recompute_bytes", "activations_bytes")

# LayerCost field -> part, for the parts held all step.
_STATIC = (("param_bytes", "params_bytes"), ("grad_bytes", "grads_bytes"), ("master_bytes", "master_bytes"),
           ("opt_bytes", "optimizer_bytes"), ("copies_bytes", "copies_bytes"), ("fp8_bytes", "fp8_copies_bytes"))


def stage_memory(costs, layers: tuple[int, int], microbatches: int, remat: bool | str) -> dict[str, float]:
    """The static parts of a stage of layers ``layers`` (first, last) from its mesh's layer costs (per device):
    what :func:`~autopar_lab.pricing.stage.stage_cost` adds up as static bytes, split; plus the activation bytes
    it keeps per microbatch without and with (full) remat. ``remat``: False, True (full), or a partial policy (its
    working set is one layer's dropped part: :func:`~autopar_lab.pricing.stage.partial_keys`)."""
    part = list(costs[layers[0]:layers[1] + 1])
    n = max(len(part), 1)
    out = {name: float(sum(getattr(c, field) for c in part)) for field, name in _STATIC}
    act = sum(c.act_bytes for c in part) / microbatches
    # the backward's transients: the average layer's largest temporary and one layer's activation cotangents
    # (the same float operations as stage_cost's, so the parts add up to its static bytes)
    out["buffers_bytes"] = sum(c.temp_bytes for c in part) / microbatches / n + act / n
    # a stage after the first writes its received input's gradient, one microbatch's (stage_cost's boundaries)
    recv = costs[layers[0]].recv_bytes / microbatches
    out["buffers_bytes"] = out["buffers_bytes"] + recv
    # the largest layer's backward resharding buffers (stage_cost's range_max of them)
    out["buffers_bytes"] = out["buffers_bytes"] + max(c.reshard_dst_act_bytes for c in part) / microbatches \
        + max(c.reshard_dst_weight_bytes for c in part)
    # the working set of recomputing one layer's dropped part (stage_cost's sum over the same keys)
    dropped = sum(getattr(c, f"{key}_act_bytes") for key in partial_keys(remat) for c in part) / microbatches
    out["recompute_bytes"] = act / n if is_full(remat) else dropped / n
    # without remat it keeps the input it received, not the output it sent
    out["plain_act_per_microbatch_bytes"] = act + recv - costs[layers[1]].sent_act_bytes / microbatches
    out["remat_act_per_microbatch_bytes"] = sum(c.ckpt_bytes for c in part) / microbatches
    return out


def absent_at_loss(costs, layers: tuple[int, int], microbatches: int) -> dict[str, float]:
    """The parts of :func:`stage_memory`'s state that an FSDP2 framework (torchtitan, KempnerForge: the frameworks of
    ``stage_pins["eager_loss"]``) does not hold at its loss's backward, for a stage of layers ``layers`` (first, last):

    * ``params_bytes``: the low-precision copy of every parameter with a float32 master. FSDP2's
      ``MixedPrecisionPolicy(param_dtype=bf16)`` keeps the sharded parameter in float32 only and casts it to bf16 into
      the all-gather's unsharded buffer (not a shard of its own), which the state counts as ``master_bytes``;
    * ``grads_bytes``: with one microbatch, every gradient. torchtitan's step starts with ``optimizers.zero_grad()``
      (``set_to_none``) and FSDP2 writes each layer's sharded gradient at its reduce-scatter, after the loss's backward;
      with several, the earlier microbatches' gradients are held by then (0).

    The same state is held in full later in the backward (its layers' working sets)."""
    part = costs[layers[0]:layers[1] + 1]
    return {"params_bytes": float(sum(c.param_bytes for c in part if c.master_bytes > 0)),
            "grads_bytes": float(sum(c.grad_bytes for c in part)) if microbatches == 1 else 0.0}


def transient_bytes(costs, layers: tuple[int, int], microbatches: int, remat: bool | str) -> float:
    """The part of :func:`stage_memory`'s static bytes a stage holds only while it runs a backward (its buffers and
    the recomputation's working set): an interleaved stage holds its largest chunk's, not the sum of its chunks'."""
    mem = stage_memory(costs, layers, microbatches, remat)
    return mem["buffers_bytes"] + mem["recompute_bytes"]


def memory_breakdown(plan: Plan) -> list[dict[str, Any]]:
    """Per stage of ``plan``: ``{stage, <each of PARTS>, act_per_microbatch_bytes, microbatches_in_flight, remat,
    remat_mode, remat_saved_bytes, total_bytes, reserved_bytes, limit_bytes}`` (bytes per device; see the module
    docstring). A stage priced without layer costs gets its static bytes as ``params_bytes``."""
    tl = plan.cost.timeline
    pins = plan.stage_pins or {}
    # the stage whose peak is an eager loss's backward (pricing.eagerloss adds what it holds beyond then)
    at_loss = plan.cost.loss_stage if plan.cost.eager_loss_bytes and plan.cost.loss_extra_bytes > 0 else None
    out = []
    for k, st in enumerate(plan.stages):
        if tl is not None:
            inflight = int(tl.peak_inflight[k])
        else:  # a timeline-less plan: the in-flight count its peak implies
            inflight = round((st.peak_mem_bytes - st.static_bytes) / st.act_bytes) if st.act_bytes else 0
        row: dict[str, Any] = {"stage": k, **{p: 0.0 for p in PARTS}}
        saved = 0.0
        if st.layer_costs is not None:
            # an interleaved stage runs its chunks, each priced as a stage of its own: their held parts add up, the
            # transients of one backward at a time are the largest chunk's (pricing.price)
            chunks = [stage_memory(st.layer_costs, rng, plan.microbatches, st.remat) for rng in st.layer_ranges]
            parts = {key: sum(c[key] for c in chunks) for key in chunks[0]}
            top = max(range(len(chunks)), key=lambda i: chunks[i]["buffers_bytes"] + chunks[i]["recompute_bytes"])
            parts["buffers_bytes"] = chunks[top]["buffers_bytes"]
            parts["recompute_bytes"] = chunks[top]["recompute_bytes"]
            for p in PARTS[:-1]:
                row[p] = parts[p]
            if recomputes(st.remat):
                saved = max(parts["plain_act_per_microbatch_bytes"] - st.act_bytes, 0.0) * inflight
            # what the formula's float sums leave over (a fraction of a byte) goes to the transient buffers, the
            # one part that is an average (one layer's of the stage's), so the stored state's parts stay exact
            left = st.static_bytes - sum(row[p] for p in PARTS[:-1])
            if left < -1.0:  # a whole step run as one program holds no gradients at its peak (on the CPU: backends)
                cut = min(-left, row["grads_bytes"])
                row["grads_bytes"] -= cut
                left += cut
            row["buffers_bytes"] += left
            if k == at_loss:  # split as the loss's backward holds it: no layer recomputes then (absent_at_loss)
                row["buffers_bytes"] += row["recompute_bytes"]
                row["recompute_bytes"] = 0.0
                for rng in st.layer_ranges:
                    for p, gone in absent_at_loss(st.layer_costs, rng, plan.microbatches).items():
                        row[p] -= gone
                        row["buffers_bytes"] += gone
        else:
            row["params_bytes"] = st.static_bytes
        # an interleaved stage's chunks hold different amounts each: its activations are its peak over its static
        row["activations_bytes"] = st.peak_mem_bytes - st.static_bytes if st.chunks else inflight * st.act_bytes
        row.update({"act_per_microbatch_bytes": st.act_bytes, "microbatches_in_flight": inflight,
                    "remat": recomputes(st.remat), "remat_mode": remat_label(st.remat), "remat_saved_bytes": saved,
                    "total_bytes": st.peak_mem_bytes,
                    "reserved_bytes": reserved_bytes(pins.get("host"), st.peak_mem_bytes),
                    "limit_bytes": plan.cost.mem_limit_bytes})
        out.append(row)
    return out
