"""GShard mixture-of-experts transformer, in plain JAX.

Pre-LN transformer (attention as in gpt.py); layer i's MLP is an MoE layer when i is odd (every other layer).
MLP width is ``mlp_factor * H`` with mlp_factor 8 (Alpa's MoE suite; the published sizes 380M ... 70B come out
with 8H experts and untied input/output embeddings). MoE layer (GShard, Lepikhin et al. 2020):
  * tokens are cut into groups of ``expert_group_size`` (2048 in Alpa) -> x[g, s, m];
  * top-2 gating over E experts, expert capacity C = capacity_factor * group_size / E (capacity_factor 2, i.e.
    GShard's 2N/E); tokens over capacity are dropped (their MoE output is zero; the residual carries them), and
    the gate weights of a token's kept choices are renormalised to sum to 1;
  * dispatch and combine are einsums with one-hot masks: "gsec,gsm->egcm" and "gsec,egcm->gsm" (the all-to-all
    pattern), the experts are batched einsums over the expert axis e;
  * load-balancing aux loss E * sum_e mean_s(gate_e) * mean_s(top1 == e), averaged over groups and MoE layers,
    added with weight aux_loss_weight. (GShard's random second-expert routing is left out: deterministic.)
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .base import (check, compute_copy, cross_entropy, dense_init, layer_norm, ln_init, make_spec, normal,
                   param_dtype_of)
from .data import counting_tokens
from .gpt import attention


@dataclass(frozen=True)
class MoEConfig:
    seq_len: int = 1024
    hidden_size: int = 768
    num_layers: int = 8
    num_heads: int = 16
    vocab_size: int = 32000
    num_experts: int = 8
    expert_group_size: int = 2048
    batch_size: int = 1024
    dtype: str = "float16"
    mixed_precision: bool = True  # a float16/bfloat16 model keeps float32 master weights (and Adam moments)
    mlp_factor: int = 8
    capacity_factor: float = 2.0
    aux_loss_weight: float = 0.01


# Alpa's MoE suite (batch 1024, S 1024, 16 heads, V 32000, group 2048): H, L, experts
PRESETS = {
    "moe-380m": MoEConfig(hidden_size=768, num_layers=8, num_experts=8),
    "moe-690m": MoEConfig(hidden_size=768, num_layers=8, num_experts=16),
    "moe-1.3b": MoEConfig(hidden_size=768, num_layers=16, num_experts=16),
    "moe-2.4b": MoEConfig(hidden_size=1024, num_layers=16, num_experts=16),
    "moe-10b": MoEConfig(hidden_size=1536, num_layers=16, num_experts=32),
    "moe-27b": MoEConfig(hidden_size=2048, num_layers=16, num_experts=48),
    "moe-70b": MoEConfig(hidden_size=2048, num_layers=32, num_experts=64),
    "moe-tiny": MoEConfig(seq_len=16, hidden_size=32, num_layers=2, num_heads=4, vocab_size=64, num_experts=4,
                          expert_group_size=32, batch_size=4, dtype="float32"),
}


def is_moe_layer(i: int) -> bool:
    return i % 2 == 1


def capacity(c: MoEConfig) -> int:
    return max(1, int(c.capacity_factor * group_size(c) / c.num_experts))


def group_size(c: MoEConfig) -> int:
    return min(c.expert_group_size, c.batch_size * c.seq_len)


def init_layer(key, i, c: MoEConfig, dtype):
    H, F, E = c.hidden_size, c.mlp_factor * c.hidden_size, c.num_experts
    k = jax.random.split(key, 5)
    p = {"ln1": ln_init(H, dtype), "qkv": dense_init(k[0], H, 3 * H, dtype), "proj": dense_init(k[1], H, H, dtype),
         "ln2": ln_init(H, dtype)}
    if is_moe_layer(i):
        p["gate"] = normal(k[2], (H, E), dtype)
        p["experts"] = {"w1": normal(k[3], (E, H, F), dtype), "b1": jnp.zeros((E, F), dtype),
                        "w2": normal(k[4], (E, F, H), dtype), "b2": jnp.zeros((E, H), dtype)}
    else:
        p["fc1"], p["fc2"] = dense_init(k[3], H, F, dtype), dense_init(k[4], F, H, dtype)
    return p


def init_params(key, c: MoEConfig):
    dtype = param_dtype_of(c)
    k_wte, k_wpe, k_head, k_layers = jax.random.split(key, 4)
    return {"wte": normal(k_wte, (c.vocab_size, c.hidden_size), dtype),
            "wpe": normal(k_wpe, (c.seq_len, c.hidden_size), dtype, std=0.01),
            "layers": [init_layer(k, i, c, dtype) for i, k in enumerate(jax.random.split(k_layers, c.num_layers))],
            "ln_f": ln_init(c.hidden_size, dtype),
            "lm_head": normal(k_head, (c.hidden_size, c.vocab_size), dtype)}


def top2_gating(logits, cap):
    """logits [g, s, e] -> combine weights [g, s, e, c] (float32), dispatch mask (same shape, 0/1), aux loss."""
    E = logits.shape[-1]
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    mask1 = jax.nn.one_hot(jnp.argmax(gates, -1), E)                              # [g, s, e]
    mask2 = jax.nn.one_hot(jnp.argmax(gates * (1 - mask1), -1), E)
    aux = E * jnp.mean(jnp.sum(gates.mean(1) * mask1.mean(1), -1))
    pos1 = jnp.cumsum(mask1, axis=1) - 1                                         # slot of each token in its expert
    pos2 = jnp.cumsum(mask2, axis=1) - 1 + mask1.sum(1, keepdims=True)           # after all first choices
    mask1, mask2 = mask1 * (pos1 < cap), mask2 * (pos2 < cap)                    # drop what overflows capacity
    g1, g2 = (gates * mask1).sum(-1), (gates * mask2).sum(-1)                    # [g, s]
    denom = jnp.maximum(g1 + g2, 1e-9)
    slot1 = jax.nn.one_hot((pos1 * mask1).sum(-1).astype(jnp.int32), cap)         # [g, s, c]
    slot2 = jax.nn.one_hot((pos2 * mask2).sum(-1).astype(jnp.int32), cap)
    combine = ((g1 / denom)[..., None, None] * mask1[..., None] * slot1[:, :, None, :]
               + (g2 / denom)[..., None, None] * mask2[..., None] * slot2[:, :, None, :])
    dispatch = jax.lax.stop_gradient((combine > 0).astype(jnp.float32))
    return combine, dispatch, aux


def moe_mlp(p, x, c: MoEConfig):
    B, S, H = x.shape
    gs = group_size(c)
    xg = x.reshape(B * S // gs, gs, H)                                            # [g, s, m]
    combine, dispatch, aux = top2_gating(jnp.einsum("gsm,me->gse", xg, p["gate"]), capacity(c))
    e = p["experts"]
    xe = jnp.einsum("gsec,gsm->egcm", dispatch.astype(x.dtype), xg)              # all-to-all: tokens -> experts
    h = jax.nn.gelu(jnp.einsum("egcm,emf->egcf", xe, e["w1"]) + e["b1"][:, None, None, :])
    ye = jnp.einsum("egcf,efm->egcm", h, e["w2"]) + e["b2"][:, None, None, :]
    y = jnp.einsum("gsec,egcm->gsm", combine.astype(x.dtype), ye)                # all-to-all: experts -> tokens
    return y.reshape(B, S, H), aux


def dense_mlp(p, x):
    return jax.nn.gelu(x @ p["fc1"]["w"] + p["fc1"]["b"]) @ p["fc2"]["w"] + p["fc2"]["b"]


def loss_fn(params, batch, c: MoEConfig):
    tokens, targets = batch["tokens"], batch["targets"]
    with jax.named_scope("embed"):
        wte, wpe = compute_copy(c, (params["wte"], params["wpe"]))
        x = jnp.take(wte, tokens, axis=0) + wpe[None, : tokens.shape[1]]
    aux_total = jnp.zeros((), jnp.float32)
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            p = compute_copy(c, p)
            x = x + attention(p, layer_norm(p["ln1"], x), c.num_heads)
            if is_moe_layer(i):
                y, aux = moe_mlp(p, layer_norm(p["ln2"], x), c)
                aux_total = aux_total + aux
            else:
                y = dense_mlp(p, layer_norm(p["ln2"], x))
            x = x + y
    with jax.named_scope("head"):
        ln_f, lm_head = compute_copy(c, (params["ln_f"], params["lm_head"]))
        logits = layer_norm(ln_f, x) @ lm_head
        n_moe = max(1, sum(is_moe_layer(i) for i in range(c.num_layers)))
        return cross_entropy(logits, targets) + c.aux_loss_weight * aux_total / n_moe


def make_batch(key, c: MoEConfig):
    return counting_tokens(key, c.batch_size, c.seq_len, c.vocab_size)  # a learnable task (models/data.py)


def validate(c: MoEConfig):
    for f in ("seq_len", "hidden_size", "num_layers", "num_heads", "vocab_size", "num_experts",
              "expert_group_size", "batch_size", "mlp_factor"):
        check(getattr(c, f) >= 1, f"{f} must be a positive integer, got {getattr(c, f)!r}.")
    check(c.hidden_size % c.num_heads == 0,
          f"hidden_size ({c.hidden_size}) must be divisible by num_heads ({c.num_heads}).")
    check((c.batch_size * c.seq_len) % group_size(c) == 0,
          f"batch_size * seq_len ({c.batch_size * c.seq_len} tokens) must be divisible by "
          f"expert_group_size ({c.expert_group_size}).")


def build(name: str, c: MoEConfig):
    validate(c)
    return make_spec(name, "moe", c, lambda k: init_params(k, c), lambda k: make_batch(k, c),
                     lambda params, batch: loss_fn(params, batch, c))
