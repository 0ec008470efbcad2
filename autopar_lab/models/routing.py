"""Routed experts: the top-k mixture-of-experts FFN of Mixtral, Qwen3-MoE and DeepSeek-V3, in plain JAX.

Tokens are cut into groups of ``group_size`` (never across sequences), ``x[g, t, h]``. In each group:

1. **router** (``router`` scope): ``logits = x @ W_router`` ``[H, E]`` (``2 N H E`` FLOPs for ``N`` tokens), then
   per token the ``top_k`` experts by score: softmax scores (Mixtral, Qwen3-MoE; Shazeer et al. 2017) or sigmoid
   scores (DeepSeek-V3, arXiv 2412.19437 section 2.1.2); the chosen experts' scores renormalised to sum to one
   (``normalize``) and multiplied by ``scale`` (DeepSeek-V3's routed scaling factor 2.5).
2. **capacity**: expert ``e`` takes at most ``C = ceil(capacity_factor * group_size * top_k / E)`` tokens of a
   group; the assignments beyond it are dropped (their expert output is zero; the residual carries the token).
   Assignments are served in token order (a stable sort of the ``T * top_k`` choices by expert), so the first
   tokens of a group win. With ``capacity_factor`` 1.0 and ``E`` dividing ``T * top_k``, ``E * C = T * top_k``:
   the expert matmuls run ``top_k x tokens x`` one expert's FLOPs exactly (``6 H F`` per token and choice).
3. **dispatch** (``dispatch`` scope), **by index, not by one-hot einsum**: slot ``(e, c)`` holds the ``c``-th
   assignment to expert ``e`` in the sorted order, found with a sort, a scatter-add (the per-expert counts), a
   cumulative sum and two gathers; the tokens move with one gather ``x[g, token[g, e, c]] -> xe[g, e, c, h]``. A
   GShard-style one-hot dispatch einsum ``"gsec,gsm->egcm"`` costs ``2 T E C H`` FLOPs per group, which with 256
   experts is more than the experts themselves and would misprice every plan.
4. **experts** (``experts`` scope): SwiGLU with stacked weights ``gate``, ``up`` ``[E, H, F]`` and ``down``
   ``[E, F, H]``, each a ``dot_general`` batched over the expert dimension of the parameter
   (``"gech,ehf->egcf"``), which :func:`autopar_lab.sharding.experts.expert_matmuls` finds: a plan may split ``e``
   over a mesh axis (expert parallelism) while the dispatched tensor keeps the group dimension ``g`` that the
   batch is split along; the edge between is then an all-to-all.
5. **combine** (``combine`` scope): each slot's output times its gate weight is added back to its token's row with a
   scatter-add (zero for empty slots).
6. **shared experts** (``shared_experts`` scope; DeepSeek's always-active experts): one SwiGLU of width
   ``num_shared * F`` on every token.

What the layer keeps for the backward (the memory model reads it off the traced program,
:mod:`~autopar_lab.graph.fusion`; ``N`` tokens, ``K`` choices, capacity factor 1 so ``E C = N K`` slots): the
dispatched tokens (``N K H``, the gather), the experts' output in their slots (``N K H``: the combine's gate
gradient reads it), the SwiGLU's intermediates (``N K F`` each) and ``N K`` int32 slot indices; no ``[tokens,
experts, capacity]`` one-hot tensor. That is what Megatron-LM's token permutation and DeepEP keep too (the permuted
tokens, the expert outputs before the weighted un-permutation, the grouped MLP's intermediates), so the layout
functions (``megatron_plan`` and the others) price the zoo's program as it is, with nothing pinned for the dispatch
(tests/test_node_limit.py); only the number of the SwiGLU's intermediates is the kernel model's (what XLA's fusions
write: 6 of ``N K F``), where Megatron-LM's fused kernels keep 3 (the first matmul's two halves and its activation).

The balance loss returned is the Switch Transformer's (Fedus et al. 2021) for top-k: ``E * sum_e f_e P_e`` with
``f_e`` the share of the group's ``T * top_k`` choices made for ``e`` (before capacity) and ``P_e`` the mean
normalised score of ``e``; it is 1 for perfectly balanced routing. (DeepSeek-V3's auxiliary-loss-free bias is not
modelled: it changes which experts are chosen, not the shapes or FLOPs. Its node-limited routing is,
:func:`group_limited`: it bounds the copies of a token that cross nodes, which the pricing of the token exchange
honours, :meth:`~autopar_lab.cluster.LogicalMesh.routed_all_to_all`.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .base import normal
from .blocks import swiglu, swiglu_init

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    """How tokens are routed: ``num_experts`` experts, ``top_k`` of them per token, groups of ``group_size`` tokens,
    capacity ``ceil(capacity_factor * group_size * top_k / num_experts)`` per expert and group, ``score`` "softmax"
    or "sigmoid", the chosen weights renormalised (``normalize``) and scaled by ``scale``; with ``topk_group <
    n_group``, node-limited routing (:func:`group_limited`): the experts are cut into ``n_group`` groups and a token
    chooses among those of its best ``topk_group`` groups only."""

    num_experts: int
    top_k: int
    group_size: int
    capacity_factor: float = 1.0
    score: str = "softmax"
    normalize: bool = True
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    @property
    def capacity(self) -> int:
        return capacity(self.group_size, self.num_experts, self.top_k, self.capacity_factor)


def capacity(group_size: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert and group: ``ceil(capacity_factor * group_size * top_k / num_experts)``, at least 1.

    >>> capacity(4096, 256, 8, 1.0), capacity(16, 8, 2, 1.25)
    (128, 5)
    """
    return max(1, math.ceil(capacity_factor * group_size * top_k / num_experts))


def init_moe(key, hidden: int, moe_ffn: int, num_experts: int, num_shared: int, dtype) -> dict:
    """``router`` [H, E], stacked ``experts`` (``gate``/``up`` [E, H, F], ``down`` [E, F, H]) and, with
    ``num_shared`` > 0, ``shared_experts`` (one SwiGLU of width ``num_shared * F``)."""
    k = jax.random.split(key, 5)
    E = num_experts
    p = {"router": normal(k[0], (hidden, E), dtype),
         "experts": {"gate": normal(k[1], (E, hidden, moe_ffn), dtype), "up": normal(k[2], (E, hidden, moe_ffn), dtype),
                     "down": normal(k[3], (E, moe_ffn, hidden), dtype)}}
    if num_shared:
        p["shared_experts"] = swiglu_init(k[4], hidden, num_shared * moe_ffn, dtype)
    return p


def group_limited(scores, r: Routing):
    """``scores`` [G, T, E] with every expert outside a token's best ``topk_group`` of ``n_group`` expert groups set to
    0 (DeepSeek-V3's node-limited routing, arXiv 2412.19437 section 2.1.2, as its released code ranks groups: by the
    sum of each group's two highest scores); ``scores`` itself without a limit. The groups are runs of ``E /
    n_group`` consecutive experts: laid out in order over the expert-parallel devices, a group sits on one node, so
    a token's experts lie on at most ``topk_group`` nodes (what :class:`~autopar_lab.cluster.values.NodeLimit`
    prices)."""
    if r.topk_group >= r.n_group:
        return scores
    G, T, E = scores.shape
    grouped = scores.reshape(G, T, r.n_group, E // r.n_group)
    rank = jax.lax.top_k(grouped, min(2, E // r.n_group))[0].sum(-1)                 # [G, T, n_group]
    keep = jax.nn.one_hot(jax.lax.top_k(rank, r.topk_group)[1], r.n_group, dtype=scores.dtype).sum(-2)
    return (grouped * keep[..., None]).reshape(G, T, E)


def top_k_gates(logits, r: Routing):
    """``logits`` [G, T, E] -> (weights [G, T, K] float32, experts [G, T, K] int32, normalised scores [G, T, E])."""
    lf = logits.astype(jnp.float32)
    if r.score == "softmax":
        probs = scores = jax.nn.softmax(lf, axis=-1)
    else:
        scores = jax.nn.sigmoid(lf)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    weights, experts = jax.lax.top_k(group_limited(scores, r), r.top_k)
    if r.normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * r.scale, experts.astype(jnp.int32), probs


def _take(rows, index):
    """``rows[g, index[g, m]]`` for every group ``g`` (one gather batched over groups)."""
    return jax.vmap(lambda r, i: r.at[i].get(mode="promise_in_bounds"))(rows, index)


def _add_rows(rows, index, n: int):
    """``out[g, index[g, m]] += rows[g, m]`` into zeros ``[G, n, ...]`` (one scatter-add batched over groups)."""
    return jax.vmap(lambda r, i: jnp.zeros((n,) + r.shape[1:], r.dtype).at[i].add(r, mode="promise_in_bounds"))(
        rows, index)


def assign_slots(experts, weights, num_experts: int, cap: int):
    """Which token fills each expert slot, and with what gate weight.

    ``experts``, ``weights`` [G, T, K] -> (``token`` [G, E*C] int32: the token of slot ``(e, c)`` at ``e*C + c``,
    ``gate`` [G, E*C] float32: its weight, 0 for an empty slot, ``counts`` [G, E] int32: choices made per expert
    before capacity). No one-hot tensor: a stable sort of the ``T*K`` choices by expert, their per-expert counts (a
    scatter-add), where each expert's run starts (a cumulative sum) and gathers."""
    G, T, K = experts.shape
    E, n = num_experts, T * K
    flat = experts.reshape(G, n)
    order = jnp.argsort(flat, axis=-1, stable=True)                                    # choices sorted by expert
    counts = _add_rows(jnp.ones_like(flat), flat, E)                                   # [G, E]
    starts = jnp.cumsum(counts, axis=-1) - counts
    slot = jnp.arange(cap, dtype=jnp.int32)
    sorted_at = jnp.minimum(starts[:, :, None] + slot, n - 1).reshape(G, E * cap)      # slot (e, c) in `order`
    filled = (slot < counts[:, :, None]).reshape(G, E * cap)
    choice = _take(order, sorted_at)                                                   # t * K + k
    token = jax.lax.div(choice, jnp.int32(K))
    gate = _take(weights.reshape(G, n), choice) * filled
    return token, gate, counts


def expert_swiglu(e, xe):
    """The experts' SwiGLU on dispatched tokens ``xe`` [G, E, C, H]: three matmuls batched over the expert dimension
    of the stacked weights; the result [G, E, C, H]."""
    with jax.named_scope("gate"):
        g = jax.nn.silu(jnp.einsum("gech,ehf->egcf", xe, e["gate"]))
    with jax.named_scope("up"):
        u = jnp.einsum("gech,ehf->egcf", xe, e["up"])
    with jax.named_scope("down"):
        return jnp.einsum("egcf,efh->gech", g * u, e["down"])


def balance_loss(counts, probs, top_k: int):
    """``E * sum_e f_e P_e``, averaged over groups: ``f_e`` the share of choices for ``e``, ``P_e`` its mean score."""
    G, T, E = probs.shape
    share = counts.astype(jnp.float32) / (T * top_k)
    return E * jnp.mean(jnp.sum(share * jnp.mean(probs, axis=1), axis=-1))


def moe_ffn(p, x, r: Routing):
    """The routed-experts FFN of ``x`` [B, S, H] (see the module docstring) -> (output [B, S, H], balance loss)."""
    B, S, H = x.shape
    T, E, cap = r.group_size, r.num_experts, r.capacity
    G = B * S // T
    xg = x.reshape(G, T, H)
    with jax.named_scope("router"):
        weights, experts, probs = top_k_gates(xg @ p["router"], r)
    with jax.named_scope("dispatch"):
        token, gate, counts = assign_slots(experts, weights, E, cap)
        xe = _take(xg, token).reshape(G, E, cap, H)                                    # tokens -> expert slots
    with jax.named_scope("experts"):
        ye = expert_swiglu(p["experts"], xe)
    with jax.named_scope("combine"):
        y = _add_rows(ye.reshape(G, E * cap, H) * gate[..., None].astype(x.dtype), token, T)  # slots -> tokens
    y = y.reshape(B, S, H)
    if "shared_experts" in p:
        with jax.named_scope("shared_experts"):
            y = y + swiglu(p["shared_experts"], x)
    return y, balance_loss(counts, probs, r.top_k)


__all__ = ["Routing", "SCORES", "capacity", "init_moe", "group_limited", "top_k_gates", "assign_slots", "expert_swiglu",
           "balance_loss", "moe_ffn"]
