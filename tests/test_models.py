"""Model zoo: names, abstract shapes, published sizes, Megatron FLOPs, training on tiny instances, overrides."""
import math
import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autopar_lab import models
from autopar_lab.models import gpt, moe

# ------------------------------------------------------------------ a small jaxpr walker of our own

def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(item, "eqns"):                 # Jaxpr
                yield item
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):  # ClosedJaxpr
                yield item.jaxpr


def dot_flops(jaxpr) -> float:
    """2 * prod(batch) * prod(lhs free) * prod(rhs free) * prod(contracting), summed, scans times their length."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            ls, rs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            batch = math.prod(ls[d] for d in lb)
            contract = math.prod(ls[d] for d in lc)
            lfree = math.prod(s for d, s in enumerate(ls) if d not in lc and d not in lb)
            rfree = math.prod(s for d, s in enumerate(rs) if d not in rc and d not in rb)
            total += 2.0 * batch * lfree * rfree * contract
        mult = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for sub in _sub_jaxprs(eqn):
            total += mult * dot_flops(sub)
    return total


def step_flops(spec) -> float:
    return dot_flops(jax.make_jaxpr(spec.step_fn)(*spec.abstract_args).jaxpr)


def published_size(name: str) -> float:
    num, unit = re.fullmatch(r"[a-z]+-([\d.]+)([mb])", name).groups()
    return float(num) * (1e6 if unit == "m" else 1e9)


# Alpa's suites, named by published size (today's families check their released sizes in test_models_llama.py and
# test_models_deepseek.py).
SIZED = [n for n in models.names() if re.fullmatch(r"[a-z]+-[\d.]+[mb]", n)]
# The family of each name's prefix where they differ.
FAMILY = {"llama3": "llama", "mixtral": "llama", "qwen3": "llama"}

# ------------------------------------------------------------------ names, abstract shapes, sizes

def test_names_cover_the_zoo():
    expected = {f"gpt-{s}" for s in ["350m", "760m", "1.3b", "2.6b", "6.7b", "15b", "39b", "tiny"]}
    expected |= {f"moe-{s}" for s in ["380m", "690m", "1.3b", "2.4b", "10b", "27b", "70b", "tiny"]}
    expected |= {f"wresnet-{s}" for s in ["250m", "500m", "1b", "2b", "4b", "6.8b", "13b", "tiny"]}
    expected |= {"mlp"}
    expected |= {"llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b", "qwen3-30b-a3b", "llama3-tiny",
                 "qwen3-moe-tiny", "deepseek-v3", "deepseek-tiny"}
    assert set(models.names()) == expected
    assert set(models.names("moe")) == {n for n in expected if n.startswith("moe-")}
    assert set(models.names("deepseek")) == {"deepseek-v3", "deepseek-tiny"}


@pytest.mark.parametrize("name", models.names())
def test_abstract_args_and_published_sizes(name):
    before = {id(a) for a in jax.live_arrays()}
    spec = models.get(name)
    new = [a for a in jax.live_arrays() if id(a) not in before]
    assert all(a.size < 1_000_000 for a in new), "building a spec must not allocate model-sized arrays"
    params, opt_state, batch = spec.abstract_args
    for leaf in jax.tree_util.tree_leaves((params, opt_state, batch)):
        assert isinstance(leaf, jax.ShapeDtypeStruct)
    assert spec.batch_argnums == (2,) and spec.param_argnums == (0,)
    prefix = name.split("-")[0]
    assert spec.family == FAMILY.get(prefix, prefix)
    # Adam holds two moments of every parameter
    n_opt = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(opt_state))
    assert n_opt >= 2 * spec.param_count
    if name in SIZED:
        rel = spec.param_count / published_size(name) - 1
        assert abs(rel) < 0.10, f"{name}: {spec.param_count / 1e9:.3f}B params vs published"
    # Mixed precision (the zoo's default for its float16 GPT and MoE, as Megatron-LM and Alpa trained them, and for
    # today's bfloat16 families): float32 master weights and Adam moments; the step computes in the config's dtype.
    compute = {"gpt": jnp.float16, "moe": jnp.float16, "llama": jnp.bfloat16,
               "deepseek": jnp.bfloat16}.get(spec.family, jnp.float32)
    if not name.endswith("-tiny"):
        assert jnp.dtype(spec.config.dtype) == compute
        assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))
        assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(opt_state) if x.ndim)


def test_exact_counts_of_the_biggest():
    assert abs(models.get("gpt-39b").param_count / 39e9 - 1) < 0.03
    # GPT: 12 L H^2 + 13 L H + V H + S H + 2 H (tied embedding)
    c = gpt.PRESETS["gpt-1.3b"]
    L, H, V, S = c.num_layers, c.hidden_size, c.vocab_size, c.seq_len
    assert models.get("gpt-1.3b").param_count == 12 * L * H * H + 13 * L * H + V * H + S * H + 2 * H
    assert abs(models.get("moe-70b").param_count / 70e9 - 1) < 0.03
    assert abs(models.get("wresnet-13b").param_count / 13e9 - 1) < 0.05


def test_batch_sizes_and_shapes_follow_alpa():
    g = models.get("gpt-1.3b")
    assert g.abstract_args[2]["tokens"].shape == (1024, 1024)
    assert g.abstract_args[2]["tokens"].dtype == jnp.int32
    m = models.get("moe-380m")
    assert m.abstract_args[2]["tokens"].shape == (1024, 1024)
    assert m.config.expert_group_size == 2048 and m.config.vocab_size == 32000 and m.config.num_heads == 16
    w = models.get("wresnet-250m")
    assert w.abstract_args[2]["images"].shape == (1536, 224, 224, 3)
    assert w.abstract_args[2]["labels"].shape == (1536,)


# ------------------------------------------------------------------ Megatron FLOPs (GPT)

@pytest.mark.parametrize("name", models.names("gpt"))
def test_gpt_step_flops_match_megatron_formula(name):
    spec = models.get(name, num_layers=2)
    got, want = step_flops(spec), gpt.megatron_flops(spec.config)
    assert abs(got / want - 1) < 0.02, f"{name}: {got:.4e} vs Megatron {want:.4e}"


def test_gpt_1_3b_full_size_flops():
    spec = models.get("gpt-1.3b")
    got, want = step_flops(spec), gpt.megatron_flops(spec.config)
    assert abs(got / want - 1) < 0.02
    assert want == pytest.approx(72 * 1024 * 1024 * 24 * 2048**2 * (1 + 1024 / (6 * 2048) + 51200 / (12 * 24 * 2048)))


def test_moe_graph_has_dispatch_and_expert_einsums():
    spec = models.get("moe-380m", num_layers=2)
    jaxpr = jax.make_jaxpr(spec.loss_fn)(*spec.abstract_args[::2]).jaxpr
    c = spec.config
    g, e, cap = 1024 * 1024 // 2048, 8, moe.capacity(c)
    assert cap == 2 * 2048 // 8
    shapes = [tuple(eqn.outvars[0].aval.shape) for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"]
    # dispatched tokens live on the expert axis: [e, g, c, m] (possibly transposed by einsum)
    assert any(sorted(sh) == sorted((e, g, cap, c.hidden_size)) for sh in shapes)
    # experts are batched over e: [e, g, c, 8H]
    assert any(sorted(sh) == sorted((e, g, cap, 8 * c.hidden_size)) for sh in shapes)


# ------------------------------------------------------------------ real steps on tiny instances

FAST_COMPILE = {"xla_backend_optimization_level": 0}   # halves XLA:CPU compile time; these runs are tiny


def _compiled(fn, *args, static_argnums=()):
    return jax.jit(fn, static_argnums=static_argnums).lower(*args).compile(compiler_options=FAST_COMPILE)


def _train(spec, steps):
    params, opt_state, batch = spec.init(seed=0)
    step = _compiled(spec.step_fn, params, opt_state, batch)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("name,kw", [
    ("gpt-tiny", {}),
    ("moe-tiny", {}),
    ("wresnet-tiny", {}),
    ("mlp", dict(batch_size=32, input_dim=32, hidden_size=64, num_layers=2, num_classes=10)),
])
def test_tiny_models_learn(name, kw):
    spec = models.get(name, dtype="float32", **kw)
    assert spec.param_count < 300_000
    losses = _train(spec, 8)
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.9 * losses[0], losses


def test_init_is_deterministic_in_seed():
    spec = models.get("gpt-tiny")
    a, b, c = spec.init(0), spec.init(0), spec.init(1)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    assert not np.array_equal(a[2]["tokens"], c[2]["tokens"])
    # concrete init agrees with the abstract args
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), a)
    assert shapes == jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), spec.abstract_args)


def test_name_scopes_mark_embed_layers_head():
    spec = models.get("gpt-tiny", num_layers=3)
    jaxpr = jax.make_jaxpr(spec.loss_fn)(*spec.abstract_args[::2]).jaxpr
    scopes = {str(e.source_info.name_stack).split("/")[0] for e in jaxpr.eqns}
    assert {"embed", "layer_0", "layer_1", "layer_2", "head"} <= scopes
    w = models.get("wresnet-tiny")
    jaxpr = jax.make_jaxpr(w.loss_fn)(*w.abstract_args[::2]).jaxpr
    scopes = {str(e.source_info.name_stack).split("/")[0] for e in jaxpr.eqns}
    assert {"embed", "layer_0", "layer_3", "head"} <= scopes and "layer_4" not in scopes


# ------------------------------------------------------------------ scan_layers

def test_scan_layers_matches_unrolled():
    unrolled = models.get("gpt-tiny", num_layers=3)
    scanned = models.get("gpt-tiny", num_layers=3, scan_layers=True)
    p_u, _, batch = unrolled.init(seed=3)
    p_s, _, batch_s = scanned.init(seed=3)
    assert p_s["layers"]["qkv"]["w"].shape == (3,) + p_u["layers"][0]["qkv"]["w"].shape
    restacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *p_u["layers"])
    assert all(np.array_equal(x, y) for x, y in
               zip(jax.tree_util.tree_leaves(restacked), jax.tree_util.tree_leaves(p_s["layers"])))
    l_u = float(_compiled(unrolled.loss_fn, p_u, batch)(p_u, batch))
    l_s = float(_compiled(scanned.loss_fn, p_s, batch_s)(p_s, batch_s))
    assert l_s == pytest.approx(l_u, rel=1e-5)
    jaxpr = jax.make_jaxpr(scanned.step_fn)(*scanned.abstract_args).jaxpr
    assert any(e.primitive.name == "scan" for e in jaxpr.eqns)
    assert step_flops(scanned) == pytest.approx(step_flops(unrolled), rel=1e-9)


# ------------------------------------------------------------------ overrides and errors

def test_overrides_apply():
    spec = models.get("gpt-350m", batch_size=8, num_layers=2, dtype="float32", hidden_size=64, seq_len=32,
                      vocab_size=100, num_heads=4)
    c = spec.config
    assert (c.batch_size, c.num_layers, c.dtype, c.hidden_size, c.seq_len, c.vocab_size) == \
        (8, 2, "float32", 64, 32, 100, )
    assert spec.abstract_args[0]["wte"].shape == (100, 64)
    assert spec.abstract_args[0]["wte"].dtype == jnp.float32
    assert spec.abstract_args[2]["tokens"].shape == (8, 32)
    assert models.get("gpt-tiny", dtype=jnp.bfloat16).config.dtype == "bfloat16"
    m = models.get("moe-380m", num_experts=4, hidden_size=32, num_layers=2, batch_size=2, seq_len=16,
                   expert_group_size=8)
    assert m.abstract_args[0]["layers"][1]["experts"]["w1"].shape == (4, 32, 256)
    w = models.get("wresnet-250m", num_channels=8, image_size=32, num_layers=101, batch_size=2)
    assert len(w.abstract_args[0]["blocks"]) == 33
    assert models.get("GPT-1.3B").name == "gpt-1.3b"


def test_bad_name_and_bad_overrides_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown model 'gpt-2'.*valid names are: .*gpt-1.3b"):
        models.get("gpt-2")
    with pytest.raises(ValueError, match="unknown config field.*'num_expert'.*valid fields are: .*num_experts"):
        models.get("moe-tiny", num_expert=4)
    with pytest.raises(ValueError, match="unknown config field.*'num_experts'"):
        models.get("gpt-tiny", num_experts=4)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        models.get("gpt-tiny", hidden_size=30)
    with pytest.raises(ValueError, match="num_layers must be one of"):
        models.get("wresnet-tiny", num_layers=20)
    with pytest.raises(ValueError, match="expert_group_size"):
        models.get("moe-tiny", expert_group_size=48)
    with pytest.raises(ValueError, match="unknown dtype"):
        models.get("mlp", dtype="float42")


# ------------------------------------------------------------------ GShard gating

def test_top2_gating_respects_capacity_and_normalises():
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 64, 4))
    cap = 8                                   # 64 tokens * 2 choices > 4 experts * 8 slots: some must drop
    gating = jax.jit(moe.top2_gating, static_argnums=1, compiler_options=FAST_COMPILE)
    combine, dispatch, aux = gating(logits, cap)
    assert combine.shape == dispatch.shape == (3, 64, 4, cap)
    # each (expert, slot) holds at most one token
    assert float(dispatch.sum(1).max()) <= 1.0
    # every token goes to at most 2 experts; its kept weights are renormalised to sum to 1 (0 if both dropped)
    per_token = np.asarray(combine.sum((2, 3)))
    assert np.all((np.abs(per_token - 1) < 1e-5) | (per_token == 0))
    assert (per_token == 0).any() and float(dispatch.sum()) == 3 * 4 * cap   # overflow happened; slots all full
    assert float(dispatch.sum((2, 3)).max()) <= 2.0
    # with ample capacity nothing is dropped and weights sum to exactly 1
    combine, dispatch, aux = gating(logits, 128)
    np.testing.assert_allclose(np.asarray(combine.sum((2, 3))), 1.0, rtol=1e-5)
    assert np.all(np.asarray(dispatch.sum((2, 3))) == 2)
    # uniform gates give the balanced aux loss value 1
    _, _, aux = gating(jnp.zeros((1, 8, 4)).at[0, jnp.arange(8), jnp.arange(8) % 4].set(1e-3), 8)
    assert float(aux) == pytest.approx(1.0, rel=1e-2)
