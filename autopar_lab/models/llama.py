"""The Llama 3 family (and the Mixtral / Qwen3-MoE shapes), in plain JAX, from abstract shapes.

Architecture (Llama 3 paper, Grattafiori et al. 2024, arXiv 2407.21783, section 3.2 and Table 3): a pre-norm decoder,
per layer ``x += Attn(RMSNorm(x)); x += FFN(RMSNorm(x))``, then a final RMSNorm and an untied ``lm_head``.

* attention: grouped-query attention (Ainslie et al. 2023) with ``num_heads`` query heads of ``head_dim`` (default
  ``hidden / heads``; Qwen3 sets it apart: 32 x 128 on hidden 2,048) and ``num_kv_heads`` key/value heads; each
  query head ``h`` reads KV head ``h // (heads / kv_heads)``. Q is laid out ``[B, S, kv, heads/kv, hd]`` and K, V
  ``[B, S, kv, hd]``: a reshape carries a split on its first dimension only (sharding/strategies.py), so tensor
  parallelism splits attention by whole KV heads, each device holding its KV heads and their query heads. A mesh
  axis with more devices than KV heads cannot split that dimension: the ILP splits another one over it (the batch,
  the sequence) or leaves K and V whole on it (Megatron-LM and torchtitan replicate KV heads there). RoPE
  (``rope_theta``, 500,000 for Llama 3; no Llama 3.1 frequency scaling) on Q and K; optional per-head RMSNorm on Q
  and K before RoPE (``qk_norm``: Qwen3).
* FFN: SwiGLU ``down(silu(gate(x)) * up(x))`` of width ``ffn_hidden``; or, with ``num_experts`` > 0, routed experts
  (:mod:`autopar_lab.models.routing`: ``top_k`` of ``num_experts`` SwiGLU experts of width ``moe_ffn_hidden``,
  capacity ``capacity_factor``, optional ``num_shared_experts``) in every layer: Mixtral 8x7B (Jiang et al. 2024,
  arXiv 2401.04088; HF config: 8 experts, top-2, softmax router renormalised over the chosen) and Qwen3-30B-A3B
  (Qwen3 technical report arXiv 2505.09388; HF config: 128 experts, top-8, expert FFN 768, ``norm_topk_prob``).
* training: next-token cross-entropy (+ ``aux_loss_weight`` x the routers' balance loss), Adam. ``dtype`` bfloat16
  with ``mixed_precision``: float32 master weights and Adam moments, each layer computing with a bfloat16 copy.

Parameters: ``2 V H`` (embedding, lm_head; ``V H`` tied) ``+ H`` (final norm) ``+ L [H (heads + 2 kv) hd + heads hd H
+ 2 H (+ 2 hd with qk_norm, + (heads + 2 kv) hd with Qwen2's qkv biases) + FFN]`` with FFN ``3 H F`` dense, or
``H E + 3 E H F_e + 3 H (shared F_e)`` routed. Llama 3 8B: 8,030,261,248.

Forward matmul FLOPs per step (``N = B S`` tokens; the scores' full square, which a causal flash kernel halves):
``2 N H (heads + 2 kv) hd + 2 N heads hd H`` (projections) ``+ 4 B heads S^2 hd`` (QK^T and PV) ``+ 6 N H F``
(SwiGLU) per layer, or ``2 N H E + top_k 6 N H F_e`` (router, experts at capacity factor 1) ``+ 6 N H F_shared``;
``+ 2 N H V`` (lm_head). The training step runs three times that (forward, and two matmuls of the backward).

Default shapes: the released configurations, sequence 8,192 and a global batch of 512 sequences (4M tokens, the
batch Llama 3 8B/70B trained at early on; the paper's 405B run reached 16M tokens = 2,048 sequences).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .base import check, make_spec, normal, param_dtype_of
from .blocks import causal_attention, decoder_loss, embed_and_head, rms_norm, rope, swiglu, swiglu_init
from .data import counting_tokens
from .routing import SCORES, Routing, init_moe, moe_ffn


@dataclass(frozen=True)
class LlamaConfig:
    seq_len: int = 8192
    hidden_size: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int | None = None          # None: hidden_size // num_heads
    ffn_hidden: int = 14336
    vocab_size: int = 128256
    batch_size: int = 512
    dtype: str = "bfloat16"
    mixed_precision: bool = True         # float32 master weights (and Adam moments) for a bfloat16/float16 model
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    qk_norm: bool = False                # per-head RMSNorm of Q and K before RoPE (Qwen3)
    qkv_bias: bool = False               # biases on the q, k and v projections (Qwen2)
    tie_embeddings: bool = False         # the lm_head reads the embedding (Llama 3.2 1B/3B, small Qwen models)
    num_experts: int = 0                 # > 0: every layer's FFN is routed experts
    top_k: int = 2
    moe_ffn_hidden: int | None = None    # None: ffn_hidden
    num_shared_experts: int = 0
    capacity_factor: float = 1.0
    expert_group_size: int = 4096        # tokens routed together (capped at seq_len; never across sequences)
    router_score: str = "softmax"
    norm_topk_prob: bool = True
    aux_loss_weight: float = 0.001


PRESETS = {
    "llama3-8b": LlamaConfig(),
    "llama3-70b": LlamaConfig(hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_hidden=28672),
    "llama3-405b": LlamaConfig(hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8, ffn_hidden=53248),
    "mixtral-8x7b": LlamaConfig(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden=14336,
                                vocab_size=32000, rope_theta=1e6, num_experts=8, top_k=2),
    "qwen3-30b-a3b": LlamaConfig(hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                                 ffn_hidden=6144, vocab_size=151936, rope_theta=1e6, norm_eps=1e-6, qk_norm=True,
                                 num_experts=128, top_k=8, moe_ffn_hidden=768),
    "llama3-tiny": LlamaConfig(seq_len=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=64,
                               vocab_size=64, batch_size=4, dtype="float32"),
    "qwen3-moe-tiny": LlamaConfig(seq_len=16, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                  ffn_hidden=64, vocab_size=64, batch_size=4, dtype="float32", rope_theta=1e6,
                                  qk_norm=True, num_experts=8, top_k=2, moe_ffn_hidden=16, expert_group_size=16),
}


def head_dim(c: LlamaConfig) -> int:
    return c.head_dim if c.head_dim is not None else c.hidden_size // c.num_heads


def moe_ffn_hidden(c: LlamaConfig) -> int:
    return c.moe_ffn_hidden if c.moe_ffn_hidden is not None else c.ffn_hidden


def routing(c: LlamaConfig) -> Routing:
    return Routing(c.num_experts, c.top_k, min(c.expert_group_size, c.seq_len), c.capacity_factor, c.router_score,
                   c.norm_topk_prob)


def init_layer(key, c: LlamaConfig, dtype) -> dict:
    H, nh, kv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, head_dim(c)
    k = jax.random.split(key, 5)
    attn = {"q_proj": normal(k[0], (H, nh * hd), dtype), "k_proj": normal(k[1], (H, kv * hd), dtype),
            "v_proj": normal(k[2], (H, kv * hd), dtype), "o_proj": normal(k[3], (nh * hd, H), dtype)}
    if c.qk_norm:
        attn["q_norm"], attn["k_norm"] = jnp.ones((hd,), dtype), jnp.ones((hd,), dtype)
    if c.qkv_bias:
        attn["q_bias"], attn["k_bias"] = jnp.zeros((nh * hd,), dtype), jnp.zeros((kv * hd,), dtype)
        attn["v_bias"] = jnp.zeros((kv * hd,), dtype)
    p = {"attn_norm": jnp.ones((H,), dtype), "attn": attn, "mlp_norm": jnp.ones((H,), dtype)}
    if c.num_experts:
        p["moe"] = init_moe(k[4], H, moe_ffn_hidden(c), c.num_experts, c.num_shared_experts, dtype)
    else:
        p["mlp"] = swiglu_init(k[4], H, c.ffn_hidden, dtype)
    return p


def init_params(key, c: LlamaConfig) -> dict:
    dtype = param_dtype_of(c)
    k_outer, k_layers = jax.random.split(key)
    p = embed_and_head(k_outer, c.vocab_size, c.hidden_size, dtype, tied=c.tie_embeddings)
    p["layers"] = [init_layer(k, c, dtype) for k in jax.random.split(k_layers, c.num_layers)]
    return p


def attention(p, x, c: LlamaConfig):
    """Grouped-query attention of ``x`` [B, S, H] (scopes ``q_proj``, ``k_proj``, ``v_proj``, ``q_norm``,
    ``k_norm``, ``rope``, ``o_proj``)."""
    B, S, _ = x.shape
    nh, kv, hd = c.num_heads, c.num_kv_heads, head_dim(c)
    def proj(name):
        y = x @ p[f"{name}_proj"]
        return y + p[f"{name}_bias"] if c.qkv_bias else y

    with jax.named_scope("q_proj"):
        q = proj("q").reshape(B, S, kv, nh // kv, hd)
    with jax.named_scope("k_proj"):
        k = proj("k").reshape(B, S, kv, hd)
    with jax.named_scope("v_proj"):
        v = proj("v").reshape(B, S, kv, hd)
    if c.qk_norm:
        with jax.named_scope("q_norm"):
            q = rms_norm(p["q_norm"], q, c.norm_eps)
        with jax.named_scope("k_norm"):
            k = rms_norm(p["k_norm"], k, c.norm_eps)
    with jax.named_scope("rope"):
        q, k = rope(q, c.rope_theta), rope(k, c.rope_theta)
    out = causal_attention(q, k, v).reshape(B, S, nh * hd)
    with jax.named_scope("o_proj"):
        return out @ p["o_proj"]


def layer(p, x, c: LlamaConfig):
    """One decoder layer -> (x, balance loss or None)."""
    with jax.named_scope("attn_norm"):
        h = rms_norm(p["attn_norm"], x, c.norm_eps)
    with jax.named_scope("attn"):
        x = x + attention(p["attn"], h, c)
    with jax.named_scope("mlp_norm"):
        h = rms_norm(p["mlp_norm"], x, c.norm_eps)
    if c.num_experts:
        with jax.named_scope("moe"):
            y, aux = moe_ffn(p["moe"], h, routing(c))
        return x + y, aux
    with jax.named_scope("mlp"):
        return x + swiglu(p["mlp"], h), None


def loss_fn(params, batch, c: LlamaConfig):
    return decoder_loss(params, batch, c, lambda i, p, x: layer(p, x, c), c.num_layers if c.num_experts else 0)


def make_batch(key, c: LlamaConfig):
    return counting_tokens(key, c.batch_size, c.seq_len, c.vocab_size)  # a learnable task (models/data.py)


def validate(c: LlamaConfig):
    for f in ("seq_len", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden", "vocab_size",
              "batch_size", "top_k", "expert_group_size"):
        check(isinstance(getattr(c, f), int) and getattr(c, f) >= 1,
              f"{f} must be a positive integer, got {getattr(c, f)!r}.")
    check(c.head_dim is not None or c.hidden_size % c.num_heads == 0,
          f"hidden_size ({c.hidden_size}) must be divisible by num_heads ({c.num_heads}), or give head_dim.")
    check(c.num_heads % c.num_kv_heads == 0,
          f"num_kv_heads ({c.num_kv_heads}) must divide num_heads ({c.num_heads}).")
    check(head_dim(c) >= 2 and head_dim(c) % 2 == 0, f"head_dim ({head_dim(c)}) must be even for RoPE.")
    check(c.rope_theta > 0, f"rope_theta must be positive, got {c.rope_theta!r}.")
    check(c.num_experts >= 0 and c.num_shared_experts >= 0,
          "num_experts and num_shared_experts must be 0 or more.")
    if not c.num_experts:
        check(c.num_shared_experts == 0,
              f"num_shared_experts ({c.num_shared_experts}) needs routed experts: set num_experts > 0.")
        return
    check(c.top_k <= c.num_experts, f"top_k ({c.top_k}) cannot exceed num_experts ({c.num_experts}).")
    check(moe_ffn_hidden(c) >= 1, f"moe_ffn_hidden must be a positive integer, got {c.moe_ffn_hidden!r}.")
    check(c.capacity_factor > 0, f"capacity_factor must be positive, got {c.capacity_factor!r}.")
    check(c.router_score in SCORES, f"router_score must be one of {', '.join(SCORES)}, got {c.router_score!r}.")
    group = min(c.expert_group_size, c.seq_len)
    check(c.seq_len % group == 0,
          f"seq_len ({c.seq_len}) must be divisible by expert_group_size ({c.expert_group_size}).")


def build(name: str, c: LlamaConfig):
    validate(c)
    return make_spec(name, "llama", c, lambda k: init_params(k, c), lambda k: make_batch(k, c),
                     lambda params, batch: loss_fn(params, batch, c))
