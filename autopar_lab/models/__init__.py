"""The model zoo: Alpa's benchmark models by name, as ModelSpecs built from abstract shapes.

    >>> import jax
    >>> spec = get("gpt-1.3b")                       # nothing allocated: spec.abstract_args are ShapeDtypeStructs
    >>> tiny = get("gpt-tiny", dtype="float32")
    >>> params, opt_state, batch = tiny.init(seed=0)
    >>> params, opt_state, loss = jax.jit(tiny.step_fn)(params, opt_state, batch)

Families: gpt (GPT-3 / Megatron), moe (GShard MoE), wresnet (Wide-ResNet), mlp: the configurations of Alpa's
benchmark suites (see docs/reference alpa-facts.md); llama (Llama 3 8B/70B/405B, and the Mixtral 8x7B and Qwen3-30B-A3B
shapes: grouped-query attention, SwiGLU, RMSNorm, RoPE, optional routed experts) and deepseek (DeepSeek-V3:
multi-head latent attention, dense first layers, shared + fine-grained routed experts), bfloat16 with float32 master
weights. ``-tiny`` variants run a step on a CPU in well under a second.
"""
from __future__ import annotations

from .base import ModelSpec
from .hfconfig import from_config
from .registry import MAX_BATCH, MAX_DIM, MAX_LAYERS, build_config, config_of, fields, get, names, with_layers

__all__ = ["ModelSpec", "get", "names", "config_of", "fields", "with_layers", "build_config", "from_config",
           "MAX_LAYERS", "MAX_BATCH", "MAX_DIM"]
