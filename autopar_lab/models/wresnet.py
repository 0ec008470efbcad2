"""Wide-ResNet (bottleneck ResNet-50/101 with a width factor), in plain JAX, NHWC.

Stem ("embed"): 7x7/2 conv to ``num_channels``, norm, relu, 3x3/2 max pool. Stages of bottleneck blocks
([3,4,6,3] for 50 layers, [3,4,23,3] for 101; generally depth = 3 * sum(stages) + 2), stage i with base
f = num_channels * 2^i; each block (one ``layer_{i}`` scope, numbered across stages):
    1x1 conv -> f, norm, relu;  3x3 conv (stride 2 on a stage's first block, from stage 2 on) -> f * width_factor,
    norm, relu;  1x1 conv -> 4f, norm;  + shortcut (1x1 conv + norm when the shape changes);  relu.
The width factor widens the 3x3 conv's output only (as in Alpa's benchmark model): it is the choice that gives the
published sizes (250M ... 13B). Counts: 254M, 495M, 1.005B, 1.965B, 4.00B, 6.73B, 12.63B.
Head: global average pool, dense to ``num_classes``, softmax cross-entropy.
Normalisation: batch norm in training mode (batch statistics, learned scale and bias, no running averages).
Batch size 1536 (Alpa's Wide-ResNet suite); fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .base import check, compute_copy, cross_entropy, dtype_of, make_spec, param_dtype_of
from .data import teacher_labels

#: A Wide-ResNet has no shallow copies to plan it on (ModelSpec.copy_fn): its blocks are not all alike (each
#: stage doubles the width and its first block strides and changes the shortcut), so a few blocks cannot price all.
HAS_COPIES = False

STAGES = {14: (1, 1, 1, 1), 26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


@dataclass(frozen=True)
class WResNetConfig:
    num_layers: int = 50
    num_channels: int = 160
    width_factor: int = 2
    image_size: int = 224
    num_classes: int = 1000
    batch_size: int = 1536
    dtype: str = "float32"
    mixed_precision: bool = True  # a float16/bfloat16 model keeps float32 master weights (and Adam moments)


# Alpa's Wide-ResNet suite (image 224, fp32): layers, base channels, width factor
PRESETS = {
    "wresnet-250m": WResNetConfig(50, 160, 2),
    "wresnet-500m": WResNetConfig(50, 224, 2),
    "wresnet-1b": WResNetConfig(50, 320, 2),
    "wresnet-2b": WResNetConfig(50, 448, 2),
    "wresnet-4b": WResNetConfig(50, 640, 2),
    "wresnet-6.8b": WResNetConfig(50, 320, 16),
    "wresnet-13b": WResNetConfig(101, 320, 16),
    "wresnet-tiny": WResNetConfig(num_layers=14, num_channels=8, width_factor=2, image_size=32, num_classes=10,
                                  batch_size=8),
}


def conv_init(key, kh, kw, cin, cout, dtype):
    std = (2.0 / (kh * kw * cin)) ** 0.5                                          # He init
    return (std * jax.random.normal(key, (kh, kw, cin, cout), jnp.float32)).astype(dtype)


def bn_init(c, dtype, zero=False):
    return {"scale": (jnp.zeros if zero else jnp.ones)((c,), dtype), "bias": jnp.zeros((c,), dtype)}


def conv(x, w, stride=1):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def batch_norm(p, x, eps=1e-5):
    xf = x.astype(jnp.float32)
    mean = xf.mean((0, 1, 2))
    var = jnp.square(xf - mean).mean((0, 1, 2))
    return ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype) * p["scale"] + p["bias"]


def block_plan(c: WResNetConfig):
    """[(cin, f, stride)] for every bottleneck block, in order."""
    plan, cin = [], c.num_channels
    for i, n in enumerate(STAGES[c.num_layers]):
        f = c.num_channels * 2**i
        for j in range(n):
            plan.append((cin, f, 2 if (i > 0 and j == 0) else 1))
            cin = 4 * f
    return plan


def init_params(key, c: WResNetConfig):
    dtype = param_dtype_of(c)
    plan = block_plan(c)
    k_stem, k_head, k_blocks = jax.random.split(key, 3)
    blocks = []
    for (cin, f, stride), k in zip(plan, jax.random.split(k_blocks, len(plan))):
        k = jax.random.split(k, 4)
        mid = f * c.width_factor
        b = {"conv1": conv_init(k[0], 1, 1, cin, f, dtype), "bn1": bn_init(f, dtype),
             "conv2": conv_init(k[1], 3, 3, f, mid, dtype), "bn2": bn_init(mid, dtype),
             "conv3": conv_init(k[2], 1, 1, mid, 4 * f, dtype), "bn3": bn_init(4 * f, dtype, zero=True)}
        if cin != 4 * f or stride != 1:
            b["proj"], b["bn_proj"] = conv_init(k[3], 1, 1, cin, 4 * f, dtype), bn_init(4 * f, dtype)
        blocks.append(b)
    cout = 4 * c.num_channels * 2 ** (len(STAGES[c.num_layers]) - 1)
    return {"stem": {"conv": conv_init(k_stem, 7, 7, 3, c.num_channels, dtype), "bn": bn_init(c.num_channels, dtype)},
            "blocks": blocks,
            "head": {"w": (jax.random.normal(k_head, (cout, c.num_classes), jnp.float32) * cout**-0.5).astype(dtype),
                     "b": jnp.zeros((c.num_classes,), dtype)}}


def bottleneck(p, x, stride):
    y = jax.nn.relu(batch_norm(p["bn1"], conv(x, p["conv1"])))
    y = jax.nn.relu(batch_norm(p["bn2"], conv(y, p["conv2"], stride)))
    y = batch_norm(p["bn3"], conv(y, p["conv3"]))
    if "proj" in p:
        x = batch_norm(p["bn_proj"], conv(x, p["proj"], stride))
    return jax.nn.relu(x + y)


def loss_fn(params, batch, c: WResNetConfig):
    with jax.named_scope("embed"):
        stem = compute_copy(c, params["stem"])
        x = jax.nn.relu(batch_norm(stem["bn"], conv(batch["images"], stem["conv"], 2)))
        x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    for i, (p, (_, _, stride)) in enumerate(zip(params["blocks"], block_plan(c))):
        with jax.named_scope(f"layer_{i}"):
            x = bottleneck(compute_copy(c, p), x, stride)
    with jax.named_scope("head"):
        head = compute_copy(c, params["head"])
        logits = x.mean((1, 2)) @ head["w"] + head["b"]
        return cross_entropy(logits, batch["labels"])


def make_batch(key, c: WResNetConfig):
    s = c.image_size
    images = jax.random.normal(key, (c.batch_size, s, s, 3), jnp.float32)
    # The label follows the image's mean colour (a learnable rule, models/data.py).
    return {"images": images.astype(dtype_of(c)), "labels": teacher_labels(images.mean((1, 2)), c.num_classes)}


def validate(c: WResNetConfig):
    check(c.num_layers in STAGES, f"num_layers must be one of {sorted(STAGES)} for a bottleneck Wide-ResNet, "
                                  f"got {c.num_layers!r}.")
    for f in ("num_channels", "width_factor", "image_size", "num_classes", "batch_size"):
        check(getattr(c, f) >= 1, f"{f} must be a positive integer, got {getattr(c, f)!r}.")


def build(name: str, c: WResNetConfig):
    validate(c)
    return make_spec(name, "wresnet", c, lambda k: init_params(k, c), lambda k: make_batch(k, c),
                     lambda params, batch: loss_fn(params, batch, c))
