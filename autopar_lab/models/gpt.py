"""GPT-3 / Megatron-LM style decoder (pre-LN), in plain JAX.

Per layer: x += Attn(LN(x)); x += MLP(LN(x)), MLP = H -> 4H (gelu) -> H. Token + learned position embeddings
(a gather, not a one-hot matmul), final LN, logits tied to the token embedding (logits = x @ wte.T), next-token
softmax cross-entropy. No rematerialisation. Parameter count ~ 12 L H^2 + V H + S H. The training step's matmul
FLOPs equal Megatron-LM's 72 B S L H^2 (1 + S/(6H) + V/(12 L H)).

``scan_layers=True`` stacks the per-layer parameters on a leading axis and runs the blocks with ``lax.scan``
inside ``jax.named_scope("layers")`` (the body then carries no per-layer scope).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .base import (check, compute_copy, cross_entropy, dense_init, layer_norm, ln_init, make_spec, normal,
                   param_dtype_of)
from .data import counting_tokens


@dataclass(frozen=True)
class GPTConfig:
    seq_len: int = 1024
    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    vocab_size: int = 51200
    batch_size: int = 1024
    dtype: str = "float16"
    mixed_precision: bool = True  # a float16/bfloat16 model keeps float32 master weights (and Adam moments)
    mlp_factor: int = 4
    scan_layers: bool = False


# Alpa's GPT suite (global batch 1024): S, H, L, heads, V
PRESETS = {
    "gpt-350m": GPTConfig(1024, 1024, 24, 16, 51200),
    "gpt-760m": GPTConfig(1024, 1536, 24, 16, 51200),
    "gpt-1.3b": GPTConfig(1024, 2048, 24, 32, 51200),
    "gpt-2.6b": GPTConfig(1024, 2560, 32, 32, 51200),
    "gpt-6.7b": GPTConfig(1024, 4096, 32, 32, 51200),
    "gpt-15b": GPTConfig(1024, 5120, 48, 40, 51200),
    "gpt-39b": GPTConfig(1024, 8192, 48, 64, 51200),
    "gpt-tiny": GPTConfig(seq_len=16, hidden_size=32, num_layers=2, num_heads=4, vocab_size=64, batch_size=4,
                          dtype="float32"),
}


def init_block(key, c: GPTConfig, dtype):
    H, F = c.hidden_size, c.mlp_factor * c.hidden_size
    k = jax.random.split(key, 4)
    return {"ln1": ln_init(H, dtype), "qkv": dense_init(k[0], H, 3 * H, dtype), "proj": dense_init(k[1], H, H, dtype),
            "ln2": ln_init(H, dtype), "fc1": dense_init(k[2], H, F, dtype), "fc2": dense_init(k[3], F, H, dtype)}


def init_params(key, c: GPTConfig):
    dtype = param_dtype_of(c)
    k_wte, k_wpe, k_layers = jax.random.split(key, 3)
    keys = jax.random.split(k_layers, c.num_layers)
    if c.scan_layers:
        # One block's initialisation mapped over the layers' keys: the same numbers as the unrolled list stacked (a
        # random draw under vmap is the draw of each key alone; tests/test_models.py checks it bit for bit), and XLA
        # compiles one block's random draws instead of every layer's: gpt-tiny at 24 layers, 8.8 -> 0.9 CPU-s at
        # backend optimisation level 0 (journal 2026-12-07 "deep tests' reference init").
        layers = jax.vmap(lambda k: init_block(k, c, dtype))(keys)
    else:
        # a list, each layer drawn alone: a pipeline stage's init program (runtime.initpart) keeps only its layers'
        # draws and XLA prunes the rest, where a mapped draw would compute every layer's to slice its own
        layers = [init_block(k, c, dtype) for k in keys]
    return {"wte": normal(k_wte, (c.vocab_size, c.hidden_size), dtype),
            "wpe": normal(k_wpe, (c.seq_len, c.hidden_size), dtype, std=0.01),
            "layers": layers, "ln_f": ln_init(c.hidden_size, dtype)}


def attention(p, x, num_heads):
    B, S, H = x.shape
    # Megatron-LM's layout: each head's q, k, v side by side, so a column split of the qkv weight over tensor-parallel
    # devices gives each device whole heads.
    qkv = (x @ p["qkv"]["w"] + p["qkv"]["b"]).reshape(B, S, num_heads, 3, H // num_heads)
    q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]              # [B, S, nh, hd]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(H // num_heads).astype(x.dtype)
    causal = jnp.tril(jnp.ones((S, S), bool))
    scores = jnp.where(causal, scores.astype(jnp.float32), -1e9)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, S, H)
    return out @ p["proj"]["w"] + p["proj"]["b"]


def mlp(p, x):
    return jax.nn.gelu(x @ p["fc1"]["w"] + p["fc1"]["b"]) @ p["fc2"]["w"] + p["fc2"]["b"]


def block(p, x, num_heads):
    x = x + attention(p, layer_norm(p["ln1"], x), num_heads)
    return x + mlp(p, layer_norm(p["ln2"], x))


def loss_fn(params, batch, c: GPTConfig):
    tokens, targets = batch["tokens"], batch["targets"]                     # [B, S] int32 each
    with jax.named_scope("embed"):
        wte, wpe = compute_copy(c, (params["wte"], params["wpe"]))
        x = jnp.take(wte, tokens, axis=0) + wpe[None, : tokens.shape[1]]
    if c.scan_layers:
        with jax.named_scope("layers"):
            x, _ = jax.lax.scan(lambda h, p: (block(compute_copy(c, p), h, c.num_heads), None), x, params["layers"])
    else:
        for i, p in enumerate(params["layers"]):
            with jax.named_scope(f"layer_{i}"):
                x = block(compute_copy(c, p), x, c.num_heads)
    with jax.named_scope("head"):
        ln_f, wte = compute_copy(c, (params["ln_f"], params["wte"]))
        logits = jnp.einsum("bsh,vh->bsv", layer_norm(ln_f, x), wte)
        return cross_entropy(logits, targets)


def make_batch(key, c: GPTConfig):
    return counting_tokens(key, c.batch_size, c.seq_len, c.vocab_size)  # a learnable task (models/data.py)


def validate(c: GPTConfig):
    for f in ("seq_len", "hidden_size", "num_layers", "num_heads", "vocab_size", "batch_size", "mlp_factor"):
        check(getattr(c, f) >= 1, f"{f} must be a positive integer, got {getattr(c, f)!r}.")
    check(c.hidden_size % c.num_heads == 0,
          f"hidden_size ({c.hidden_size}) must be divisible by num_heads ({c.num_heads}).")


def build(name: str, c: GPTConfig):
    validate(c)
    return make_spec(name, "gpt", c, lambda k: init_params(k, c), lambda k: make_batch(k, c),
                     lambda params, batch: loss_fn(params, batch, c))


def megatron_flops(c: GPTConfig) -> float:
    """Megatron-LM's FLOPs per training step (no recomputation): 72 B S L H^2 (1 + S/(6H) + V/(12 L H))."""
    B, S, L, H, V = c.batch_size, c.seq_len, c.num_layers, c.hidden_size, c.vocab_size
    return 72 * B * S * L * H**2 * (1 + S / (6 * H) + V / (12 * L * H))
