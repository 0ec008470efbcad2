"""The zoo's registry: every family's presets by name, and the checked construction of a family's config."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import deepseek, gpt, llama, mlp, moe, wresnet
from .base import ModelSpec, replace_config

_FAMILIES = {"gpt": gpt, "moe": moe, "wresnet": wresnet, "mlp": mlp, "llama": llama, "deepseek": deepseek}
_REGISTRY = {name: (family, cfg) for family, mod in _FAMILIES.items() for name, cfg in mod.PRESETS.items()}

__all__ = ["get", "names", "config_of", "fields", "with_layers", "build_config", "MAX_LAYERS", "MAX_BATCH", "MAX_DIM"]


def names(family: str | None = None) -> list[str]:
    """Names in the zoo (optionally of one family: "gpt", "moe", "wresnet", "mlp", "llama", "deepseek")."""
    if family is not None and family not in _FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid families are: {', '.join(_FAMILIES)}.")
    return [n for n, (f, _) in _REGISTRY.items() if family is None or f == family]


def _lookup(name: str):
    key = str(name).strip().lower()
    if key not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid names are: {', '.join(_REGISTRY)}.")
    return key, *_REGISTRY[key]


def config_of(name: str, batch_size=None, num_layers=None, dtype=None, **overrides):
    """The (frozen dataclass) configuration get() would use, without building the model."""
    _, _, cfg = _lookup(name)
    return _configured(cfg, batch_size=batch_size, num_layers=num_layers, dtype=dtype, **overrides)


def _configured(cfg, batch_size=None, num_layers=None, dtype=None, **overrides):
    """``cfg`` with ``overrides`` (checked: bounds, a trainable dtype, known fields)."""
    if batch_size is not None:
        overrides["batch_size"] = batch_size
    if num_layers is not None:
        overrides["num_layers"] = num_layers
    if dtype is not None:
        try:
            kind = jnp.dtype(dtype)
        except TypeError:
            raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'float16' or 'bfloat16'.") from None
        if not jnp.issubdtype(kind, jnp.floating):  # gradients of integer parameters do not exist
            raise ValueError(f"dtype {kind.name!r} cannot be trained (gradients need floating point); use "
                             "'float32', 'float16' or 'bfloat16'.")
        if kind.itemsize > 4 and not jax.config.jax_enable_x64:  # JAX would quietly compute it in float32
            raise ValueError(f"dtype {kind.name!r} needs JAX's x64 mode (jax.config.update('jax_enable_x64', "
                             "True)); without it JAX computes in float32: use 'float32', 'float16' or 'bfloat16'.")
        overrides["dtype"] = kind.name
    _check_types(cfg, overrides)
    _check_bounds(overrides)
    return replace_config(cfg, **overrides)


def build_config(family, name: str, **fields) -> ModelSpec:
    """A model of zoo family ``family`` (its module, or its name: "llama", "deepseek", ...) named ``name``, its
    config the family's defaults with ``fields`` replaced (checked as :func:`get` checks them): a model that is not
    in the zoo by name, e.g. one read from a config.json (:func:`from_config`)."""
    module = _FAMILIES.get(family) if isinstance(family, str) else family
    if module is None or module not in _FAMILIES.values():
        raise ValueError(f"unknown model family {family!r}; valid families are: {', '.join(_FAMILIES)}.")
    base = type(next(iter(module.PRESETS.values())))()  # the family's config class at its defaults
    return _built(module, str(name), _configured(base, **fields))


def _built(family, name: str, cfg) -> ModelSpec:
    """``family.build(name, cfg)``, with its shallow copies (``ModelSpec.copy_fn``) unless the family has none
    (``HAS_COPIES = False``: Wide-ResNet)."""
    spec = family.build(name, cfg)
    if not getattr(family, "HAS_COPIES", True):
        return spec
    lead = getattr(family, "lead_layers", None)
    return dataclasses.replace(spec, copy_fn=functools.partial(with_layers, spec),
                               lead_layers=lead(cfg) if lead is not None else 0)


#: The largest size a config field may take. Tracing unrolls every layer and shapes are Python ints, so a typo such as
#: ``--layers 100000`` or ``--batch 99999999999999999999`` would trace for hours or overflow far from the input.
MAX_LAYERS = 1024
MAX_BATCH = 1 << 20
MAX_DIM = 1 << 24  # any other size (hidden, sequence, vocabulary, experts ...)
#: Sizes for which 0 means "none": no routed or shared experts, no dense first layers, no query compression.
MAY_BE_ZERO = frozenset(["num_experts", "num_shared_experts", "first_dense_layers", "q_lora_rank"])


def _check_types(cfg, overrides: dict) -> None:
    """A whole-number field given something else (``batch_size="8"``, ``num_layers=2.5``) is refused here, in one
    sentence, rather than deep in tracing."""
    for key, value in overrides.items():
        current = getattr(cfg, key, None)
        if isinstance(current, int) and not isinstance(current, bool) and (
                isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{key} must be a whole number, got {value!r:.40}; pass e.g. {key}={current}.")


def _check_bounds(overrides: dict) -> None:
    for key, value in overrides.items():
        if key == "dtype" or not isinstance(value, int) or isinstance(value, bool):
            continue  # flags, factors and names: the family's own config checks them
        most = MAX_LAYERS if key in ("num_layers", "first_dense_layers") else MAX_BATCH if key == "batch_size" \
            else MAX_DIM
        least = 0 if key in MAY_BE_ZERO else 1
        if not least <= value <= most:
            raise ValueError(f"{key} must be between {least} and {most:,}, got {value:,}; pick a size in that range.")


def get(name: str, batch_size: int | None = None, num_layers: int | None = None, dtype=None,
        **overrides) -> ModelSpec:
    """A ModelSpec by zoo name; keyword overrides replace config fields (e.g. hidden_size=64, seq_len=32).

    Unknown names or fields raise ValueError. Nothing is allocated: abstract args come from jax.eval_shape.
    """
    key, family, _ = _lookup(name)
    cfg = config_of(key, batch_size=batch_size, num_layers=num_layers, dtype=dtype, **overrides)
    return _built(_FAMILIES[family], key, cfg)


def fields(name: str) -> list[str]:
    """Config fields of a zoo model (what get() accepts as overrides)."""
    return [f.name for f in dataclasses.fields(_lookup(name)[2])]


def with_layers(model: ModelSpec, num_layers: int) -> ModelSpec:
    """The zoo-family model ``model`` (by name, or read from a config.json) with ``num_layers`` layers and every other
    setting kept: the shallow copies a deep model is planned on. A family may adjust a field so that the copy keeps
    every kind of layer the model has (a DeepSeek copy keeps at least one MoE layer after its dense ones:
    :func:`deepseek.copy_config`)."""
    family = _FAMILIES.get(model.family)
    if family is None or not dataclasses.is_dataclass(model.config) or not getattr(family, "HAS_COPIES", True):
        raise ValueError(f"{model.name!r} is not a zoo model with copies of another depth (Wide-ResNet has none).")
    copy = getattr(family, "copy_config", None)
    cfg = copy(model.config, num_layers) if copy else replace_config(model.config, num_layers=num_layers)
    _check_bounds({"num_layers": num_layers})
    return _built(family, model.name, cfg)

