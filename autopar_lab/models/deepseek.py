"""The DeepSeek-V3 shape: multi-head latent attention and fine-grained routed experts, in plain JAX.

Architecture (DeepSeek-V3 technical report, arXiv 2412.19437, section 2.1, and the released config.json): a
pre-norm decoder (RMSNorm), untied embeddings, ``num_layers`` layers of ``x += MLA(RMSNorm(x)); x += FFN(RMSNorm(x))``.

* Multi-head latent attention (MLA, section 2.1.1; scopes inside ``attn``): queries compressed,
  ``c_q = RMSNorm(x W_dq)`` (``q_down`` [H, q_lora_rank], ``q_norm``) and ``q = c_q W_uq`` (``q_up``
  [q_lora_rank, heads (nope + rope)]; with ``q_lora_rank`` 0 one ``q_proj`` [H, heads (nope + rope)] instead, as
  DeepSeek-V2-Lite); keys and values compressed jointly, ``[c_kv, k_rope] = x W_dkv`` (``kv_down`` [H, kv_lora_rank
  + rope]), ``c_kv`` normalised (``kv_norm``) and expanded to per-head ``[k_nope, v] = c_kv W_ukv`` (``kv_up``
  [kv_lora_rank, heads (nope + v)]); the decoupled RoPE key ``k_rope`` (``qk_rope_head_dim``) is shared by all
  heads and RoPE rotates only the ``rope`` part of each query. Scores over ``nope + rope`` dims, scaled by
  ``1/sqrt(nope + rope)`` (YaRN's long-context scale factor is left out), ``o_proj`` [heads v, H].
* FFN: the first ``first_dense_layers`` layers a dense SwiGLU of ``ffn_hidden`` (18,432); the others routed experts
  (:mod:`autopar_lab.models.routing`): ``num_shared_experts`` shared + ``num_experts`` routed experts of width
  ``moe_ffn_hidden`` (2,048), ``top_k`` (8) chosen per token by **sigmoid** scores renormalised over the chosen and
  scaled by ``routed_scaling_factor`` (2.5), as section 2.1.2, among the experts of the token's best ``topk_group``
  (4) of ``n_group`` (8) expert groups (node-limited routing, config.json's ``n_group`` / ``topk_group``,
  :func:`~autopar_lab.models.routing.group_limited`; ``topk_group == n_group``: no limit): a token's experts sit on
  at most 4 nodes, and a plan prices the token exchange with that bound (:class:`~autopar_lab.cluster.NodeLimit`,
  set on the cluster by ``CostTable.build``). The auxiliary-loss-free balancing bias and multi-token prediction
  (MTP, section 2.2) are left out: they do not change the main model's shapes or FLOPs (MTP would add one more layer
  and head pass per step); a small balance loss (``aux_loss_weight``, the report's sequence-wise alpha 0.0001)
  stands in for the bias.
* training: next-token cross-entropy, Adam, bfloat16 with float32 master weights (``mixed_precision``).

Parameters (no biases): ``2 V H + H + L_attn + 3 H F first_dense + (L - first_dense) (H E + 3 (E + shared) H F_e)``
with ``L_attn = L [H q_lora + q_lora + q_lora heads (nope + rope) + H (kv_lora + rope) + kv_lora + kv_lora heads
(nope + v) + heads v H + 2 H]``: 671B for DeepSeek-V3 (its 37B activated per token); the MTP module's 14B are
not included.

Forward matmul FLOPs per layer (``N = B S`` tokens): ``2 N (H q_lora + q_lora heads (nope + rope) + H (kv_lora +
rope) + kv_lora heads (nope + v) + heads v H)`` (the projections) ``+ 2 B heads S^2 (nope + rope + v)`` (QK^T and
PV, the full square) ``+ 6 N H F`` (dense layers) or ``2 N H E + top_k 6 N H F_e + shared 6 N H F_e`` (MoE layers,
capacity factor 1); ``+ 2 N H V`` for the lm_head.

Default shapes: DeepSeek-V3, sequence 4,096, global batch 512 sequences (the NeMo Automodel benchmark row in the
reference; the report's pre-training batch ramps to 15,360 sequences).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .base import check, make_spec, normal, param_dtype_of, replace_config
from .blocks import causal_attention, decoder_loss, embed_and_head, rms_norm, rope, swiglu, swiglu_init
from .data import counting_tokens
from .routing import Routing, init_moe, moe_ffn


@dataclass(frozen=True)
class DeepSeekConfig:
    seq_len: int = 4096
    hidden_size: int = 7168
    num_layers: int = 61
    num_heads: int = 128
    q_lora_rank: int = 1536              # 0: no query compression (one q_proj)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    ffn_hidden: int = 18432              # the dense layers' FFN
    first_dense_layers: int = 3
    num_experts: int = 256               # routed experts (0: every layer dense)
    num_shared_experts: int = 1
    top_k: int = 8
    moe_ffn_hidden: int = 2048
    n_group: int = 8                     # expert groups (node-limited routing) ...
    topk_group: int = 4                  # ... of which a token's experts come from at most this many
    vocab_size: int = 129280
    batch_size: int = 512
    dtype: str = "bfloat16"
    mixed_precision: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    capacity_factor: float = 1.0
    expert_group_size: int = 4096        # tokens routed together (capped at seq_len; never across sequences)
    routed_scaling_factor: float = 2.5
    aux_loss_weight: float = 0.0001


PRESETS = {
    "deepseek-v3": DeepSeekConfig(),
    "deepseek-tiny": DeepSeekConfig(seq_len=16, hidden_size=32, num_layers=2, num_heads=4, q_lora_rank=16,
                                    kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                    ffn_hidden=64, first_dense_layers=1, num_experts=8, num_shared_experts=1, top_k=2,
                                    moe_ffn_hidden=16, vocab_size=64, batch_size=4, dtype="float32",
                                    expert_group_size=16, n_group=1, topk_group=1),
}


def is_moe_layer(c: DeepSeekConfig, i: int) -> bool:
    return c.num_experts > 0 and i >= c.first_dense_layers


def num_moe_layers(c: DeepSeekConfig) -> int:
    return sum(is_moe_layer(c, i) for i in range(c.num_layers))


def routing(c: DeepSeekConfig) -> Routing:
    return Routing(c.num_experts, c.top_k, min(c.expert_group_size, c.seq_len), c.capacity_factor, "sigmoid", True,
                   c.routed_scaling_factor, c.n_group, c.topk_group)


#: The most dense first layers a shallow copy keeps (DeepSeek-V3 has 3). The planner solves a deep model on its 4-layer
#: copy and reads its layer pattern off the 4- and 6-layer copies (pricing/deepmap.py): with at most 3 dense layers
#: in every copy, the 4-layer one has an MoE layer for the full model's MoE layers, and a model of 3 or more dense
#: layers gives copies whose blocks disagree, so the pattern is refused and each full layer is matched by its own
#: structure; capping only where a copy would run out of MoE layers (at num_layers - 1) gives copies of 4 and 6
#: layers that agree on a pattern the full model does not follow (5 dense: [d d d m] and [d d d d d m]).
COPY_DENSE_MAX = 3


def copy_config(c: DeepSeekConfig, num_layers: int) -> DeepSeekConfig:
    """``c`` with ``num_layers`` layers (a shallow copy the planner solves on): when ``c`` has MoE layers the copy
    keeps ``min(first_dense_layers, COPY_DENSE_MAX, num_layers - 1)`` dense layers, so that it has both kinds and
    each layer of the full model has a copy layer of its structure."""
    first = c.first_dense_layers
    if num_moe_layers(c):
        first = max(0, min(first, COPY_DENSE_MAX, num_layers - 1))
    return replace_config(c, num_layers=num_layers, first_dense_layers=first)


def lead_layers(c: DeepSeekConfig) -> int:
    """The dense first layers every copy keeps as they are (``ModelSpec.lead_layers``): all of them where the model
    has MoE layers and at most :data:`COPY_DENSE_MAX` dense ones, else 0 (every layer alike, or copies that cap the
    dense layers and so do not keep them)."""
    first = c.first_dense_layers
    return first if num_moe_layers(c) and first <= COPY_DENSE_MAX else 0


def init_attention(key, c: DeepSeekConfig, dtype) -> dict:
    H, nh = c.hidden_size, c.num_heads
    dn, dr, dv, ql, kl = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.q_lora_rank, c.kv_lora_rank
    k = jax.random.split(key, 5)
    p = {"kv_down": normal(k[0], (H, kl + dr), dtype), "kv_norm": jnp.ones((kl,), dtype),
         "kv_up": normal(k[1], (kl, nh * (dn + dv)), dtype), "o_proj": normal(k[2], (nh * dv, H), dtype)}
    if ql:
        p |= {"q_down": normal(k[3], (H, ql), dtype), "q_norm": jnp.ones((ql,), dtype),
              "q_up": normal(k[4], (ql, nh * (dn + dr)), dtype)}
    else:
        p["q_proj"] = normal(k[3], (H, nh * (dn + dr)), dtype)
    return p


def init_layer(key, i: int, c: DeepSeekConfig, dtype) -> dict:
    H = c.hidden_size
    k_attn, k_ffn = jax.random.split(key)
    p = {"attn_norm": jnp.ones((H,), dtype), "attn": init_attention(k_attn, c, dtype),
         "mlp_norm": jnp.ones((H,), dtype)}
    if is_moe_layer(c, i):
        p["moe"] = init_moe(k_ffn, H, c.moe_ffn_hidden, c.num_experts, c.num_shared_experts, dtype)
    else:
        p["mlp"] = swiglu_init(k_ffn, H, c.ffn_hidden, dtype)
    return p


def init_params(key, c: DeepSeekConfig) -> dict:
    dtype = param_dtype_of(c)
    k_outer, k_layers = jax.random.split(key)
    p = embed_and_head(k_outer, c.vocab_size, c.hidden_size, dtype)
    p["layers"] = [init_layer(k, i, c, dtype) for i, k in enumerate(jax.random.split(k_layers, c.num_layers))]
    return p


def mla(p, x, c: DeepSeekConfig):
    """Multi-head latent attention of ``x`` [B, S, H] (see the module docstring for the scopes)."""
    B, S, _ = x.shape
    nh, dn, dr, dv, kl = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    if c.q_lora_rank:
        with jax.named_scope("q_down"):
            cq = x @ p["q_down"]
        with jax.named_scope("q_norm"):
            cq = rms_norm(p["q_norm"], cq, c.norm_eps)
        with jax.named_scope("q_up"):
            q = cq @ p["q_up"]
    else:
        with jax.named_scope("q_proj"):
            q = x @ p["q_proj"]
    q = q.reshape(B, S, nh, 1, dn + dr)                  # every head its own KV head: a group of one query head
    with jax.named_scope("kv_down"):
        ckv = x @ p["kv_down"]
    with jax.named_scope("kv_norm"):
        latent = rms_norm(p["kv_norm"], ckv[..., :kl], c.norm_eps)
    with jax.named_scope("kv_up"):
        kv = (latent @ p["kv_up"]).reshape(B, S, nh, dn + dv)
    with jax.named_scope("rope"):
        q = jnp.concatenate([q[..., :dn], rope(q[..., dn:], c.rope_theta)], axis=-1)
        k_rope = rope(ckv[..., kl:].reshape(B, S, 1, dr), c.rope_theta)          # one RoPE key for all heads
    k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_rope, (B, S, nh, dr))], axis=-1)
    out = causal_attention(q, k, kv[..., dn:]).reshape(B, S, nh * dv)
    with jax.named_scope("o_proj"):
        return out @ p["o_proj"]


def layer(i: int, p, x, c: DeepSeekConfig):
    """Decoder layer ``i`` -> (x, balance loss or None)."""
    with jax.named_scope("attn_norm"):
        h = rms_norm(p["attn_norm"], x, c.norm_eps)
    with jax.named_scope("attn"):
        x = x + mla(p["attn"], h, c)
    with jax.named_scope("mlp_norm"):
        h = rms_norm(p["mlp_norm"], x, c.norm_eps)
    if is_moe_layer(c, i):
        with jax.named_scope("moe"):
            y, aux = moe_ffn(p["moe"], h, routing(c))
        return x + y, aux
    with jax.named_scope("mlp"):
        return x + swiglu(p["mlp"], h), None


def loss_fn(params, batch, c: DeepSeekConfig):
    return decoder_loss(params, batch, c, lambda i, p, x: layer(i, p, x, c), num_moe_layers(c))


def make_batch(key, c: DeepSeekConfig):
    return counting_tokens(key, c.batch_size, c.seq_len, c.vocab_size)  # a learnable task (models/data.py)


def validate(c: DeepSeekConfig):
    positive = ("seq_len", "hidden_size", "num_layers", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "ffn_hidden", "top_k", "moe_ffn_hidden", "vocab_size", "batch_size",
                "expert_group_size")
    for f in positive:
        check(isinstance(getattr(c, f), int) and getattr(c, f) >= 1,
              f"{f} must be a positive integer, got {getattr(c, f)!r}.")
    for f in ("q_lora_rank", "first_dense_layers", "num_experts", "num_shared_experts"):
        check(isinstance(getattr(c, f), int) and getattr(c, f) >= 0,
              f"{f} must be 0 or a positive integer, got {getattr(c, f)!r}.")
    check(c.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim ({c.qk_rope_head_dim}) must be even for RoPE.")
    check(c.rope_theta > 0, f"rope_theta must be positive, got {c.rope_theta!r}.")
    if not c.num_experts:
        return
    check(c.top_k <= c.num_experts, f"top_k ({c.top_k}) cannot exceed num_experts ({c.num_experts}).")
    check(c.capacity_factor > 0, f"capacity_factor must be positive, got {c.capacity_factor!r}.")
    for f in ("n_group", "topk_group"):
        check(isinstance(getattr(c, f), int) and getattr(c, f) >= 1,
              f"{f} must be a positive integer, got {getattr(c, f)!r}.")
    check(c.topk_group <= c.n_group, f"topk_group ({c.topk_group}) cannot exceed n_group ({c.n_group}).")
    check(c.num_experts % c.n_group == 0,
          f"num_experts ({c.num_experts}) must be divisible by n_group ({c.n_group}); set n_group to a divisor.")
    check(c.top_k <= c.topk_group * (c.num_experts // c.n_group),
          f"top_k ({c.top_k}) exceeds the {c.topk_group * (c.num_experts // c.n_group)} experts of topk_group "
          f"({c.topk_group}) groups; raise topk_group.")
    group = min(c.expert_group_size, c.seq_len)
    check(c.seq_len % group == 0,
          f"seq_len ({c.seq_len}) must be divisible by expert_group_size ({c.expert_group_size}).")


def build(name: str, c: DeepSeekConfig):
    validate(c)
    return make_spec(name, "deepseek", c, lambda k: init_params(k, c), lambda k: make_batch(k, c),
                     lambda params, batch: loss_fn(params, batch, c))

