"""The attention internals of a graph: what selective recomputation (Korthikanti et al. 2022) recomputes.

An attention is found as :mod:`autopar_lab.graph.fusion` finds it for a flash-attention kernel, on any traced model:
a batched matmul (batch dimensions over heads) whose operand comes, through elementwise, reduce and layout operators
that include a softmax (an exp and a row max or sum), from another batched matmul of the same layer. The
*internals* are the first matmul (QK^T, the scores) and the operators between the two (scale, mask, softmax,
dropout, casts); the second matmul (scores x V) is not one of them: its output is the attention's result, which the
output projection keeps. Selective recomputation keeps everything else of the layer and, in the backward, recomputes
the internals from Q, K and the kept tensors -- activations that grow with s^2 per head, for the forward time of
one matmul and a softmax.

>>> import autopar_lab as al
>>> g = al.models.get("gpt-tiny").trace()
>>> ops = attention_internals(g)
>>> sorted({g.op(o).layer for o in ops}), sum(g.op(o).primitive == "dot_general" for o in ops)   # QK^T per layer
(['layer_0', 'layer_1'], 2)
"""

from __future__ import annotations

from .fusion import kernel_view
from .opgraph import FORWARD, OpGraph

__all__ = ["attention_internals", "dots_recomputed", "alternate_matmuls", "output_matmuls"]


def attention_internals(graph: OpGraph) -> frozenset[int]:
    """The forward operators selective recomputation recomputes (see the module docstring); empty when the graph
    has no attention. Computed once per graph."""
    memo = graph.__dict__
    if "_attention_internals" not in memo:
        view = kernel_view(graph, True)  # the flash-attention grouping finds each attention's forward operators
        ops: set[int] = set()
        for k in view.kernels:
            if k.kind == "attention" and k.role == FORWARD:
                ops.update(o for o in k.ops if o != k.root)  # the root is scores x V: its output is kept
        memo["_attention_internals"] = frozenset(ops)
    return memo["_attention_internals"]


def dots_recomputed(graph: OpGraph) -> frozenset[int]:
    """The forward operators a "keep the matmuls' outputs" policy recomputes: every forward operator of the layers
    that hold an attention (the transformer blocks) but their matmuls, whose outputs the backward keeps (and so
    flash attention's output, the scores x V matmul's). MaxText's ``remat_policy: minimal`` (JAX's
    ``checkpoint_dots``) and torchtitan's op-level selective checkpointing (which keeps every other matmul's output
    and SDPA's: priced as keeping all of them) recompute these: norms, activations, rotary embeddings, casts.

    >>> import autopar_lab as al
    >>> g = al.models.get("gpt-tiny").trace()
    >>> ops = dots_recomputed(g)
    >>> sorted({g.op(o).layer for o in ops}), any(g.op(o).primitive == "dot_general" for o in ops)
    (['layer_0', 'layer_1'], False)
    """
    memo = graph.__dict__
    if "_dots_recomputed" not in memo:
        blocks = {graph.op(o).layer for o in attention_internals(graph)}
        memo["_dots_recomputed"] = frozenset(
            o for o in graph.ops if graph.op(o).role == FORWARD and graph.op(o).layer in blocks
            and graph.op(o).primitive not in ("dot_general", "parameter"))
    return memo["_dots_recomputed"]


def alternate_matmuls(graph: OpGraph) -> frozenset[int]:
    """The matmuls torchtitan's op-level selective checkpointing recomputes (remat ``"selective-op"``,
    :mod:`autopar_lab.rematmode`): in each transformer block (a layer that holds an attention), the forward's
    unbatched matmuls (``aten.mm``: the linear layers; attention's batched matmuls are SDPA's, whose output the policy
    keeps) counted in the order the forward runs them, every second one. Its policy counts ``mm`` calls per block
    and saves the output of each but the even-numbered; on a Llama block (q, k, v, o, gate, up, down) that is k, o
    and up.

    >>> import autopar_lab as al
    >>> g = al.models.get("llama3-tiny").trace()
    >>> sorted({g.op(o).scope.rsplit("/", 1)[-1] for o in alternate_matmuls(g)})
    ['k_proj', 'o_proj', 'up']
    """
    memo = graph.__dict__
    if "_alternate_matmuls" not in memo:
        blocks = {graph.op(o).layer for o in attention_internals(graph)}
        seen: dict[str | None, int] = {}
        out = set()
        for o in sorted(graph.ops):
            node = graph.op(o)
            if node.role != FORWARD or node.layer not in blocks or node.primitive != "dot_general":
                continue
            (_contract, (lhs_batch, _rhs_batch)) = node.params.get("dimension_numbers", (((), ()), ((), ())))
            if lhs_batch:
                continue  # a batched matmul: attention's (SDPA's), not an mm
            seen[node.layer] = seen.get(node.layer, 0) + 1
            if seen[node.layer] % 2 == 0:
                out.add(o)
        memo["_alternate_matmuls"] = frozenset(out)
    return memo["_alternate_matmuls"]


def output_matmuls(graph: OpGraph) -> frozenset[int]:
    """The matmuls torchtitan's op-level policy saves (not :func:`alternate_matmuls`) whose output only makes the
    block's output: in each transformer block, a forward unbatched matmul every reader of whose output is a forward
    operator of the block (not a matmul) that no operator of the block reads (the residual add that writes the
    block's output, read by later layers only). On a Llama block that is the down projection (w2): no backward
    operator of the block reads its output, yet eager PyTorch's SAC caches it (:mod:`autopar_lab.pricing.layers`).

    >>> import autopar_lab as al
    >>> g = al.models.get("llama3-tiny").trace()
    >>> sorted({g.op(o).scope.rsplit("/", 1)[-1] for o in output_matmuls(g)})
    ['down']
    """
    memo = graph.__dict__
    if "_output_matmuls" not in memo:
        blocks = {graph.op(o).layer for o in attention_internals(graph)}
        alternate = alternate_matmuls(graph)
        out = set()
        for o in graph.ops:
            node = graph.op(o)
            if node.role != FORWARD or node.layer not in blocks or node.primitive != "dot_general" or o in alternate:
                continue
            (_contract, (lhs_batch, _rhs_batch)) = node.params.get("dimension_numbers", (((), ()), ((), ())))
            readers = [graph.op(c) for t in node.outputs for c in graph.consumers.get(t, ())]
            if lhs_batch or not readers:
                continue

            def block_output(r) -> bool:  # a block's operator whose outputs only other layers read
                return r.role == FORWARD and r.layer == node.layer and r.primitive != "dot_general" and all(
                    graph.op(c).layer != node.layer for u in r.outputs for c in graph.consumers.get(u, ()))
            if all(block_output(r) for r in readers):
                out.add(o)
        memo["_output_matmuls"] = frozenset(out)
    return memo["_output_matmuls"]
