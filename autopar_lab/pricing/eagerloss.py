"""The loss an eager PyTorch framework computes outside its compiled model: its working set at the loss's backward.

The stage-cost formula charges a stage's backward the working set of an *average* layer of the stage (its transient
buffers and recomputed activations, :func:`~autopar_lab.pricing.memory.stage_memory`). The loss is no average layer:
a PyTorch framework computes it op by op after the model, each op's output materialised, on logits of tokens x
vocabulary (Llama 3's 128,256 entries: 3.9 GiB of bf16 for 16,384 tokens). When its backward runs, the stage holds
its state and every in-flight activation, and these logits-sized tensors:

* KempnerForge (``training/loss.py`` ``cross_entropy_loss``: ``F.cross_entropy`` on the bf16 logits, which the
  training loop keeps referenced through ``backward()``; with tensor parallelism the output head gathers the
  logits whole on every rank, ``ColwiseParallel(output_layouts=Replicate())``): the logits, the log-probabilities
  ``log_softmax`` saves, and at the backward their gradient and the logits' gradient: 4 tensors of 2 bytes;
* torchtitan (``F.cross_entropy(pred.flatten(0, 1).float(), ...)``, ``del pred`` before ``loss.backward()``; with
  tensor parallelism the loss is vocabulary-parallel): the float32 log-probabilities, their gradient and the float32
  logits' gradient: 3 tensors of 4 bytes, over the tensor split.

:data:`LOSSES` holds those counts, :func:`eager_loss_bytes` the bytes a device holds a step. The stage that computes
the loss (the graph's last layer) then peaks at ``static + in-flight activations + max(its average layer's working
set, the loss's)``, the loss's less what its activations already keep of the head a microbatch
(:func:`loss_extra_bytes`: what a plan whose ``stage_pins["eager_loss"]`` names those bytes adds to the stage's
static bytes; ``fsdp_plan(eager_loss=...)``). At that moment an FSDP2 framework holds less state than its static
bytes count (:func:`~autopar_lab.pricing.memory.absent_at_loss`): under ``MixedPrecisionPolicy`` no bf16 shard of the
parameters (they are sharded in float32 only), and on a step of one microbatch no gradient yet (zero_grad sets them
to None before the forward; FSDP2 writes each layer's at its reduce-scatter, later in the backward): the loss's
extra is what it holds beyond the layer moment's peak net of that state. The traced JAX step's own loss is fused by
XLA and is what the formula prices without the pin.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

from ..rematmode import is_full
from .memory import absent_at_loss, stage_memory
from .stage import partial_keys

if TYPE_CHECKING:
    from ..graph.opgraph import OpGraph
    from .layers import LayerCost

__all__ = ["LOSSES", "eager_loss_bytes", "logits_elements", "loss_extra_bytes"]

#: framework -> (logits-sized tensors alive at the loss's backward, bytes an element, split over tensor parallelism)
LOSSES: dict[str, tuple[int, int, bool]] = {"kempnerforge": (4, 2, False), "torchtitan": (3, 4, True)}


def logits_elements(graph: OpGraph, layer: str) -> int:
    """The elements of the largest tensor the graph's ``layer`` writes (the head's: its logits, batch x sequence x
    vocabulary at the graph's batch)."""
    best = 0
    for op in graph.ops:
        node = graph.op(op)
        if node.layer != layer:
            continue
        for t in node.outputs:
            shape = graph.tensor(t).shape
            best = max(best, math.prod(shape) if shape else 1)
    return best


def eager_loss_bytes(framework: str, elements: int, data_parallel: int, tensor_parallel: int) -> float:
    """Bytes a device holds of ``framework``'s loss at its backward, a step (a microbatch holds its share): the logits
    of ``elements`` split over the ``data_parallel`` replicas (and context-parallel ranks), and over
    ``tensor_parallel`` where the framework's loss is vocabulary-parallel (:data:`LOSSES`)."""
    if framework not in LOSSES:
        raise ValueError(f"eager_loss must be None or one of {', '.join(map(repr, LOSSES))}, got {framework!r}")
    tensors, nbytes, split = LOSSES[framework]
    return tensors * nbytes * elements / data_parallel / (tensor_parallel if split else 1)


def loss_extra_bytes(costs: Sequence[LayerCost], layers: tuple[int, int], microbatches: int, remat: bool | str,
                     loss_bytes: float, loss_layer: int) -> float:
    """What a stage of layers ``layers`` (first, last) holds beyond its static bytes and in-flight activations at the
    loss's backward, above its average layer's working set: ``max(0, loss - head kept - working set - state not yet
    held)`` a microbatch, with ``loss_bytes`` a step (:func:`eager_loss_bytes`) and the loss in layer ``loss_layer``;
    0 for a stage without it. The state not held then is FSDP2's (both frameworks' wrapper):
    :func:`~autopar_lab.pricing.memory.absent_at_loss` (no low-precision parameter shard under mixed precision; with
    one microbatch, no gradient written yet)."""
    if loss_bytes <= 0 or not layers[0] <= loss_layer <= layers[1]:
        return 0.0
    mem = stage_memory(costs, layers, microbatches, remat)
    held = mem["buffers_bytes"] + mem["recompute_bytes"] + sum(absent_at_loss(costs, layers, microbatches).values())
    head = costs[loss_layer]
    if is_full(remat):
        kept = head.ckpt_bytes
    else:
        kept = head.act_bytes - sum(getattr(head, f"{key}_act_bytes") for key in partial_keys(remat))
    return max(0.0, (loss_bytes - kept) / microbatches - held)
