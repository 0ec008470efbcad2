"""Models from the files users have: a Hugging Face-style ``config.json`` read into a zoo family.

Only the architecture name and the shape fields are read (no weights, nothing downloaded). Each supported
architecture maps its keys onto a family's config (:mod:`~autopar_lab.models.llama`,
:mod:`~autopar_lab.models.deepseek`); the keys are those of the ``transformers`` configuration classes of the same
name (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config``, ``MixtralConfig``, ``Qwen3MoeConfig``, ``DeepseekV3Config``).

What a config.json says about storage or inference (``torch_dtype``, ``max_position_embeddings``, ``use_cache``,
rope scaling for long contexts ...) is not the training recipe: the model trains in its family's default format
(bfloat16 compute with float32 master weights) at its family's default sequence (capped at
``max_position_embeddings``), unless the caller overrides ``seq_len``, ``batch_size``, ``dtype`` ...; the keys that
shape the network but are not modelled are listed in :func:`ignored_keys`.

    >>> import json, tempfile, os
    >>> cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    ...        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    ...        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}
    >>> spec = from_config(cfg)
    >>> spec.family, spec.config == get("llama3-8b").config
    ('llama', True)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from . import deepseek, llama
from .base import ModelSpec
from .registry import build_config, get  # noqa: F401  (get: the doctest)

__all__ = ["ARCHITECTURES", "from_config", "read_config", "ignored_keys"]

#: Bound on a config.json's size: the real ones are a few kilobytes.
MAX_CONFIG_BYTES = 1 << 20


def _need(cfg: Mapping, key: str, arch: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"config.json field {key!r} is missing for {arch}; add it (the transformers {arch} "
                         "configuration names it so).")
    return cfg[key]


def _int(cfg: Mapping, key: str, arch: str) -> int:
    value = _need(cfg, key, arch)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"config.json field {key!r} must be a whole number, got {value!r}; fix it in the file.")
    return value


def _float(cfg: Mapping, key: str, arch: str, default: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"config.json field {key!r} must be a number, got {value!r}; fix it in the file.")
    return float(value)


def _attention(cfg: Mapping, arch: str) -> dict:
    """The fields every Llama-like architecture shares."""
    heads = _int(cfg, "num_attention_heads", arch)
    out = {"hidden_size": _int(cfg, "hidden_size", arch), "num_layers": _int(cfg, "num_hidden_layers", arch),
           "num_heads": heads, "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
           "vocab_size": _int(cfg, "vocab_size", arch),
           "rope_theta": _float(cfg, "rope_theta", arch, llama.LlamaConfig.rope_theta),
           "norm_eps": _float(cfg, "rms_norm_eps", arch, llama.LlamaConfig.norm_eps)}
    if cfg.get("head_dim") is not None and cfg["head_dim"] * heads != out["hidden_size"]:
        out["head_dim"] = _int(cfg, "head_dim", arch)
    if cfg.get("tie_word_embeddings"):
        out["tie_embeddings"] = True
    return out


def _llama(cfg: Mapping, arch: str) -> dict:
    return {**_attention(cfg, arch), "ffn_hidden": _int(cfg, "intermediate_size", arch)}


def _qwen2(cfg: Mapping, arch: str) -> dict:
    # Qwen2 adds biases to the q, k and v projections (the transformers Qwen2Attention); Qwen3 drops them and
    # normalises q and k per head instead.
    return {**_llama(cfg, arch), "qkv_bias": True}


def _qwen3(cfg: Mapping, arch: str) -> dict:
    return {**_llama(cfg, arch), "qk_norm": True}


def _mixtral(cfg: Mapping, arch: str) -> dict:
    # Mixtral's intermediate_size is each expert's width; every layer is sparse, softmax router renormalised.
    return {**_llama(cfg, arch), "num_experts": _int(cfg, "num_local_experts", arch),
            "top_k": _int(cfg, "num_experts_per_tok", arch)}


def _qwen3_moe(cfg: Mapping, arch: str) -> dict:
    sparse_step = cfg.get("decoder_sparse_step", 1)
    if cfg.get("mlp_only_layers") or sparse_step not in (None, 1):
        raise ValueError(f"this {arch} config makes only some layers sparse (decoder_sparse_step {sparse_step}, "
                         f"mlp_only_layers {cfg.get('mlp_only_layers')}); autopar-lab models every layer sparse: "
                         "set decoder_sparse_step to 1 and mlp_only_layers to [].")
    return {**_qwen3(cfg, arch), "num_experts": _int(cfg, "num_experts", arch),
            "top_k": _int(cfg, "num_experts_per_tok", arch),
            "moe_ffn_hidden": _int(cfg, "moe_intermediate_size", arch),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True))}


def _deepseek_v3(cfg: Mapping, arch: str) -> dict:
    freq = cfg.get("moe_layer_freq", 1)
    if freq not in (None, 1):
        raise ValueError(f"this {arch} config has an MoE layer every {freq} layers; autopar-lab models DeepSeek-V3's "
                         "layout (dense first layers, then every layer MoE): set moe_layer_freq to 1.")
    return {"hidden_size": _int(cfg, "hidden_size", arch), "num_layers": _int(cfg, "num_hidden_layers", arch),
            "num_heads": _int(cfg, "num_attention_heads", arch),
            "q_lora_rank": int(cfg.get("q_lora_rank") or 0), "kv_lora_rank": _int(cfg, "kv_lora_rank", arch),
            "qk_nope_head_dim": _int(cfg, "qk_nope_head_dim", arch),
            "qk_rope_head_dim": _int(cfg, "qk_rope_head_dim", arch), "v_head_dim": _int(cfg, "v_head_dim", arch),
            "ffn_hidden": _int(cfg, "intermediate_size", arch),
            "first_dense_layers": _int(cfg, "first_k_dense_replace", arch),
            "num_experts": _int(cfg, "n_routed_experts", arch),
            "num_shared_experts": int(cfg.get("n_shared_experts") or 0),
            "top_k": _int(cfg, "num_experts_per_tok", arch),
            # node-limited routing (absent: one group, no limit)
            "n_group": int(cfg.get("n_group") or 1), "topk_group": int(cfg.get("topk_group") or 1),
            "moe_ffn_hidden": _int(cfg, "moe_intermediate_size", arch),
            "vocab_size": _int(cfg, "vocab_size", arch),
            "rope_theta": _float(cfg, "rope_theta", arch, deepseek.DeepSeekConfig.rope_theta),
            "norm_eps": _float(cfg, "rms_norm_eps", arch, deepseek.DeepSeekConfig.norm_eps),
            "routed_scaling_factor": _float(cfg, "routed_scaling_factor", arch,
                                            deepseek.DeepSeekConfig.routed_scaling_factor)}


#: Architecture name (``config.json``'s ``architectures[0]``) -> (zoo family module, reader of its fields).
ARCHITECTURES: dict[str, tuple[Any, Callable[[Mapping, str], dict]]] = {
    "LlamaForCausalLM": (llama, _llama),
    "Qwen2ForCausalLM": (llama, _qwen2),
    "Qwen3ForCausalLM": (llama, _qwen3),
    "MixtralForCausalLM": (llama, _mixtral),
    "Qwen3MoeForCausalLM": (llama, _qwen3_moe),
    "DeepseekV3ForCausalLM": (deepseek, _deepseek_v3),
}

#: Keys that shape the network (or the routing) and that autopar-lab does not model: :func:`ignored_keys` names
#: those a config sets, so a plan says what it left out.
NOT_MODELLED = ("rope_scaling", "sliding_window", "use_sliding_window", "attention_bias", "mlp_bias",
                "topk_method", "num_nextn_predict_layers", "attention_dropout",
                "router_aux_loss_coef", "output_router_logits")


def read_config(source: str | os.PathLike | Mapping) -> tuple[dict, str]:
    """(the config as a dict, a name for the model) from a path to a config.json, JSON text or a dict."""
    if isinstance(source, Mapping):
        return dict(source), str(source.get("_name_or_path") or source.get("model_type") or "config")
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"from_config takes a path to a config.json, its text or a dict, got "
                         f"{type(source).__name__}.")
    text = os.fspath(source)
    name = "config"
    if not text.lstrip().startswith("{"):
        from ..safeio import read_text_file  # bounded, regular files only: a config file is user input

        path = Path(text)
        if path.is_dir():
            path = path / "config.json"
        text = read_text_file(str(path), "config.json", limit=MAX_CONFIG_BYTES)
        name = path.parent.name if path.stem == "config" and path.parent.name else path.stem
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the config.json is not valid JSON ({e}); fix the file.") from None
    if not isinstance(data, dict):
        raise ValueError(f"a config.json holds one JSON object, got {type(data).__name__}; fix the file.")
    return data, str(data.get("_name_or_path") or name)


def _architecture(cfg: Mapping) -> str:
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        arch = archs[0]
    else:
        raise ValueError("the config.json names no architecture ('architectures': [...]); add it, e.g. "
                         "[\"LlamaForCausalLM\"].")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r} in config.json; autopar-lab reads "
                         f"{', '.join(ARCHITECTURES)}.")
    return arch


def ignored_keys(source: str | os.PathLike | Mapping) -> list[str]:
    """The keys of a config.json that shape the network but are not modelled (set to something other than
    null/false/empty)."""
    cfg, _ = read_config(source)
    return [k for k in NOT_MODELLED if cfg.get(k) not in (None, False, [], {}, 0)]


def from_config(source: str | os.PathLike | Mapping, **overrides) -> ModelSpec:
    """The zoo family of a config.json's architecture, with that file's shapes (a path to the file or to the
    directory holding it, its JSON text, or a dict). ``overrides`` replace config fields as for
    :func:`autopar_lab.models.get` (``seq_len``, ``batch_size``, ``num_layers``, ``dtype`` ...).

    The name of the model is the file's ``_name_or_path`` or its directory's name. An unknown architecture or a
    missing field is one sentence naming it."""
    cfg, name = read_config(source)
    arch = _architecture(cfg)
    family, read = ARCHITECTURES[arch]
    fields = read(cfg, arch)
    limit = cfg.get("max_position_embeddings")
    default_seq = family.PRESETS[next(iter(family.PRESETS))].seq_len
    if "seq_len" not in overrides and isinstance(limit, int) and 0 < limit < default_seq:
        fields["seq_len"] = limit
    fields.update(overrides)
    return build_config(family, name.split("/")[-1].lower(), **fields)
