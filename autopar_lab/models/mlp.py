"""A plain MLP classifier, the smallest model of the zoo (good for solver walk-throughs).

Input features [B, input_dim] (Gaussian); ``num_layers`` dense layers of width ``hidden_size`` with gelu, each in
``layer_{i}``; head ("head"): dense to ``num_classes`` + softmax cross-entropy on random labels (so one fixed batch
can be memorised). Defaults: batch 1024, input 1024, 4 x 1024 hidden, 1000 classes, fp32 (~5.2M parameters).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .base import check, compute_copy, cross_entropy, dense_init, dtype_of, make_spec, param_dtype_of
from .data import teacher_labels


@dataclass(frozen=True)
class MLPConfig:
    input_dim: int = 1024
    hidden_size: int = 1024
    num_layers: int = 4
    num_classes: int = 1000
    batch_size: int = 1024
    dtype: str = "float32"
    mixed_precision: bool = True  # a float16/bfloat16 model keeps float32 master weights (and Adam moments)


PRESETS = {"mlp": MLPConfig()}


def init_params(key, c: MLPConfig):
    dtype = param_dtype_of(c)
    keys = jax.random.split(key, c.num_layers + 1)
    dims = [c.input_dim] + [c.hidden_size] * c.num_layers
    std = lambda n: (2.0 / n) ** 0.5                                              # He init for gelu layers
    return {"layers": [dense_init(keys[i], dims[i], dims[i + 1], dtype, std(dims[i])) for i in range(c.num_layers)],
            "head": dense_init(keys[-1], c.hidden_size, c.num_classes, dtype, c.hidden_size**-0.5)}


def loss_fn(params, batch, c: MLPConfig):
    x = batch["x"]
    for i, p in enumerate(params["layers"]):
        with jax.named_scope(f"layer_{i}"):
            p = compute_copy(c, p)
            x = jax.nn.gelu(x @ p["w"] + p["b"])
    with jax.named_scope("head"):
        head = compute_copy(c, params["head"])
        return cross_entropy(x @ head["w"] + head["b"], batch["labels"])


def make_batch(key, c: MLPConfig):
    x = jax.random.normal(key, (c.batch_size, c.input_dim), jnp.float32)
    return {"x": x.astype(dtype_of(c)), "labels": teacher_labels(x, c.num_classes)}  # learnable (models/data.py)


def validate(c: MLPConfig):
    for f in ("input_dim", "hidden_size", "num_layers", "num_classes", "batch_size"):
        check(getattr(c, f) >= 1, f"{f} must be a positive integer, got {getattr(c, f)!r}.")


def build(name: str, c: MLPConfig):
    validate(c)
    return make_spec(name, "mlp", c, lambda k: init_params(k, c), lambda k: make_batch(k, c),
                     lambda params, batch: loss_fn(params, batch, c))
