"""Pieces shared by today's decoder families (``llama``, ``deepseek``), in plain JAX.

* :func:`rms_norm`: RMSNorm (Zhang & Sennrich 2019), ``x / sqrt(mean(x^2) + eps) * scale``, statistics in float32;
* :func:`rope`: rotary position embeddings (Su et al. 2021, RoFormer) in the rotate-half layout of the released
  Llama/Qwen/DeepSeek checkpoints: the angle of pair ``i`` at position ``t`` is ``t * theta^(-2i/d)``;
* :func:`swiglu`: the gated FFN of Llama (Shazeer 2020), ``down(silu(gate(x)) * up(x))``: ``6 N H F`` forward
  FLOPs for ``N`` tokens, hidden ``H`` and FFN width ``F``;
* :func:`causal_attention`: softmax(Q K^T / sqrt(d)) V with a causal mask, Q laid out ``[B, S, kv, g, d]`` (``kv``
  key/value heads, ``g`` query heads per KV head) and K, V ``[B, S, kv, d]``: the KV-head axis is an array dimension
  of its own, so a sharding can split whole KV heads only (grouped-query attention, Ainslie et al. 2023). Forward
  FLOPs ``2 B (kv g) S^2 (d_qk + d_v)`` (the full square; a causal flash kernel runs half, which the pricing's
  kernel view accounts for);
* :func:`decoder_loss`: embedding lookup (a gather), the layers each in ``jax.named_scope("layer_i")``, final
  RMSNorm, the ``lm_head`` (or, tied, the embedding) and next-token cross-entropy plus the routed experts' balance
  loss.

Every weight is one array named by its module (``params['layers'][3]['attn']['q_proj']``), no biases, as the
released checkpoints.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from .base import compute_copy, cross_entropy, normal


def rms_norm(scale, x, eps: float):
    """RMSNorm over the last axis (statistics in float32, the result in ``x``'s dtype times ``scale``)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * scale


def rope(x, theta: float):
    """Rotary embedding of ``x`` ``[B, S, ..., d]`` (positions 0..S-1 along axis 1), rotate-half layout, angles in
    float32; the result in ``x``'s dtype."""
    S, d = x.shape[1], x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))           # [d/2]
    angles = jnp.arange(S, dtype=jnp.float32)[:, None] * inv_freq[None, :]             # [S, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1).reshape((1, S) + (1,) * (x.ndim - 3) + (d,))
    half = d // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def swiglu_init(key, hidden: int, ffn: int, dtype) -> dict:
    k = jax.random.split(key, 3)
    return {"gate": normal(k[0], (hidden, ffn), dtype), "up": normal(k[1], (hidden, ffn), dtype),
            "down": normal(k[2], (ffn, hidden), dtype)}


def swiglu(p, x):
    """``down(silu(gate(x)) * up(x))``, each projection in its own name scope."""
    with jax.named_scope("gate"):
        g = jax.nn.silu(x @ p["gate"])
    with jax.named_scope("up"):
        u = x @ p["up"]
    with jax.named_scope("down"):
        return (g * u) @ p["down"]


def causal_attention(q, k, v):
    """Causal softmax attention. ``q`` [B, S, kv, g, d], ``k`` [B, S, kv, d], ``v`` [B, S, kv, dv] ->
    [B, S, kv, g, dv]; scores and softmax in float32 (the layout of gpt.py's attention, so the kernel view finds a
    causal flash-attention kernel here too)."""
    S, d = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(d).astype(q.dtype)
    causal = jnp.tril(jnp.ones((S, S), bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v)


LayerFn = Callable[[int, dict, jax.Array], tuple]


def decoder_loss(params, batch, c, layer_fn: LayerFn, num_moe_layers: int):
    """Next-token loss of a pre-norm decoder: ``layer_fn(i, layer_params, x) -> (x, balance_loss)`` runs layer
    ``i`` (inside its ``layer_i`` scope, on its compute-dtype copy of the parameters); the balance losses of the
    ``num_moe_layers`` MoE layers are averaged and added with weight ``c.aux_loss_weight``."""
    tokens, targets = batch["tokens"], batch["targets"]                    # [B, S] int32 each
    with jax.named_scope("embed"):
        x = jnp.take(compute_copy(c, params["embed"]), tokens, axis=0)
        # The balance losses' sum starts here as a [1]-shaped zero made by an operator (a scalar zero would be a
        # literal): every MoE layer then adds to a computed value, the first as the others, and the sum crosses every
        # cut between layers alike, so layers of one structure read alike (pricing/opmap.py and deepmap.py match a
        # deep model's layers with its shallow copies' by structure and by the bytes entering them).
        aux_total = jnp.zeros((1,), jnp.float32) if num_moe_layers else None
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            x, aux = layer_fn(i, compute_copy(c, p), x)
            if aux is not None and aux_total is not None:
                aux_total = aux_total + aux
    with jax.named_scope("head"):
        tied = "lm_head" not in params  # a tied head reads the embedding (small Llama 3.2 and Qwen models)
        norm, head = compute_copy(c, (params["final_norm"], params["embed" if tied else "lm_head"]))
        with jax.named_scope("final_norm"):
            x = rms_norm(norm, x, c.norm_eps)
        with jax.named_scope("lm_head"):
            logits = jnp.einsum("bsh,vh->bsv", x, head) if tied else x @ head
        loss = cross_entropy(logits, targets)
        if aux_total is not None:
            loss = loss + c.aux_loss_weight * aux_total[0] / num_moe_layers
        return loss


def embed_and_head(key, vocab: int, hidden: int, dtype, tied: bool = False) -> dict:
    """The token embedding ``[V, H]``, the final norm's scale and, untied, the ``lm_head`` ``[H, V]`` (tied: the
    logits read the embedding, as :func:`decoder_loss` does when there is no ``lm_head``)."""
    k_embed, k_head = jax.random.split(key)
    out = {"embed": normal(k_embed, (vocab, hidden), dtype), "final_norm": jnp.ones((hidden,), dtype)}
    if not tied:
        out["lm_head"] = normal(k_head, (hidden, vocab), dtype)
    return out


__all__ = ["rms_norm", "rope", "swiglu", "swiglu_init", "causal_attention", "decoder_loss", "embed_and_head"]
