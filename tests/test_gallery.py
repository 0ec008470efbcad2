"""The gallery: small models written in five JAX libraries, each brought with one call and run end to end.

Each model is written the way its library's users write it, with no autopar-lab annotation, and brought with
``al.ModelSpec.from_step(step, init, batch_argnums=(2,))``. For every one: from abstract shapes, ``al.trace`` finds
its blocks as layers (and says by which rule); ``auto_plan`` plans it on a 2 x 2 cluster and ``to_jax_code``
exports the plan; a 2-stage pipeline on 8 CPU devices trains it with the losses of single-device training (1e-5).

Models: a GPT (Flax Linen, its blocks at ``backbone/transformer_layer_*`` and a tied embedding, the layout the
issue's Keras GPT-2 has), a CNN (Flax NNX, blocks in an ``nnx.List``), a GPT (Equinox, blocks in a list: no name
scopes at all, the parameters' paths say where the blocks are), a residual CNN (Haiku, auto-named modules
``res_block``, ``res_block_1``, ...), and a transformer classifier (Keras 3 on the JAX backend, ``stateless_call``).
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras 3 reads it once, at import

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import autopar_lab as al  # noqa: E402
from reference import one_device_training  # noqa: E402

FAST = {"xla_backend_optimization_level": 0}  # compiles several times faster on CPU; the same numbers in both runs
STEPS = 3
BATCH, SEQ, WIDTH, VOCAB, CLASSES, DEPTH = 8, 8, 32, 64, 10, 3


def _optax_step(apply_loss, opt):
    """step(params, opt_state, batch) -> (params, opt_state, loss), for a loss(params, batch)."""

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(apply_loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _tokens(seed):
    k1, k2 = jax.random.split(jax.random.key(1000 + seed))
    return (jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB), jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB))


def _images(seed):
    k1, k2 = jax.random.split(jax.random.key(2000 + seed))
    return (jax.random.normal(k1, (BATCH, 8, 8, 3)), jax.random.randint(k2, (BATCH,), 0, CLASSES))


def _lm_loss(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# ---------------------------------------------------------------------------------------------------- Flax Linen
def linen_gpt():
    nn = pytest.importorskip("flax.linen")

    class Attention(nn.Module):
        @nn.compact
        def __call__(self, x):
            q, k, v = jnp.split(nn.Dense(3 * WIDTH, name="qkv")(x), 3, axis=-1)
            mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
            w = jnp.where(mask, q @ k.transpose(0, 2, 1) / jnp.sqrt(WIDTH), -1e9)
            return nn.Dense(WIDTH, name="out")(jax.nn.softmax(w, axis=-1) @ v)

    class TransformerLayer(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + Attention(name="self_attention")(nn.LayerNorm(name="self_attention_layer_norm")(x))
            h = nn.Dense(4 * WIDTH, name="feedforward_intermediate_dense")(nn.LayerNorm(name="ff_norm")(x))
            return x + nn.Dense(WIDTH, name="feedforward_output_dense")(nn.gelu(h))

    class Backbone(nn.Module):
        @nn.compact
        def __call__(self, x):
            pos = self.param("position_embedding", nn.initializers.normal(0.02), (SEQ, WIDTH))
            x = x + pos[None]
            for i in range(DEPTH):
                x = TransformerLayer(name=f"transformer_layer_{i}")(x)
            return nn.LayerNorm(name="layer_norm")(x)

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            embed = nn.Embed(VOCAB, WIDTH, name="token_embedding")
            x = Backbone(name="backbone")(embed(tokens))
            return embed.attend(x)  # the output head reuses the token embedding (tied)

    model, opt = GPT(), optax.adam(1e-3)

    def loss(params, batch):
        return _lm_loss(model.apply(params, batch[0]), batch[1])

    def init(seed):
        params = model.init(jax.random.key(seed), jnp.zeros((BATCH, SEQ), jnp.int32))
        return params, opt.init(params), _tokens(seed)

    spec = al.ModelSpec.from_step(_optax_step(loss, opt), init, batch_argnums=(2,), name="linen-gpt")
    blocks = [f"backbone/transformer_layer_{i}" for i in range(DEPTH)]
    return spec, ["token_embedding", *blocks, "backbone/layer_norm", "token_embedding.attend"], "indexed-scopes"


# ------------------------------------------------------------------------------------------------------ Flax NNX
def nnx_cnn():
    nnx = pytest.importorskip("flax.nnx")

    class ConvBlock(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(16, 16, (3, 3), rngs=rngs)
            self.norm = nnx.LayerNorm(16, rngs=rngs)

        def __call__(self, x):
            return x + nnx.relu(self.norm(self.conv(x)))

    class CNN(nnx.Module):
        def __init__(self, rngs):
            self.stem = nnx.Conv(3, 16, (3, 3), rngs=rngs)
            self.blocks = nnx.List([ConvBlock(rngs) for _ in range(DEPTH)])
            self.head = nnx.Linear(16, CLASSES, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.stem(x))
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(axis=(1, 2)))

    graphdef, _ = nnx.split(CNN(nnx.Rngs(0)))
    opt = optax.adam(1e-3)

    def loss(params, batch):
        logits = nnx.merge(graphdef, params)(batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    def init(seed):
        _, params = nnx.split(CNN(nnx.Rngs(seed)))
        return params, opt.init(params), _images(seed)

    spec = al.ModelSpec.from_step(_optax_step(loss, opt), init, batch_argnums=(2,), name="nnx-cnn")
    return spec, ["stem", *[f"blocks[{i}]" for i in range(DEPTH)], "head"], "indexed-params"


# ------------------------------------------------------------------------------------------------------- Equinox
def equinox_gpt():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 4)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
            self.qkv = eqx.nn.Linear(WIDTH, 3 * WIDTH, key=k[0])
            self.out = eqx.nn.Linear(WIDTH, WIDTH, key=k[1])
            self.up = eqx.nn.Linear(WIDTH, 4 * WIDTH, key=k[2])
            self.down = eqx.nn.Linear(4 * WIDTH, WIDTH, key=k[3])

        def __call__(self, x):  # x: (SEQ, WIDTH), one sequence (Equinox layers act on one example)
            q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.ln1)(x)), 3, axis=-1)
            w = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), q @ k.T / jnp.sqrt(WIDTH), -1e9)
            x = x + jax.vmap(self.out)(jax.nn.softmax(w, axis=-1) @ v)
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(x))))

    class GPT(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        ln_f: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, DEPTH + 2)
            self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:-1]]
            self.ln_f = eqx.nn.LayerNorm(WIDTH)
            self.head = eqx.nn.Linear(WIDTH, VOCAB, key=keys[-1])

        def __call__(self, tokens):
            x = jax.vmap(self.embed)(tokens)
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))

    _, static = eqx.partition(GPT(jax.random.key(0)), eqx.is_array)
    opt = optax.adam(1e-3)

    def loss(params, batch):
        model = eqx.combine(params, static)
        return _lm_loss(jax.vmap(model)(batch[0]), batch[1])

    def init(seed):
        params, _ = eqx.partition(GPT(jax.random.key(seed)), eqx.is_array)
        return params, opt.init(params), _tokens(seed)

    spec = al.ModelSpec.from_step(_optax_step(loss, opt), init, batch_argnums=(2,), name="equinox-gpt")
    return spec, ["embed", *[f"blocks[{i}]" for i in range(DEPTH)], "ln_f", "head"], "indexed-params"


# --------------------------------------------------------------------------------------------------------- Haiku
def haiku_resnet():
    hk = pytest.importorskip("haiku")

    class ResBlock(hk.Module):
        def __call__(self, x):
            h = jax.nn.relu(hk.Conv2D(16, 3)(x))
            return x + hk.Conv2D(16, 3)(h)

    def forward(x):
        x = jax.nn.relu(hk.Conv2D(16, 3)(x))
        for _ in range(DEPTH):
            x = ResBlock()(x)
        return hk.Linear(CLASSES)(x.mean(axis=(1, 2)))

    net, opt = hk.without_apply_rng(hk.transform(forward)), optax.adam(1e-3)

    def loss(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(net.apply(params, batch[0]), batch[1]).mean()

    def init(seed):
        images = _images(seed)
        params = net.init(jax.random.key(seed), images[0])
        return params, opt.init(params), images

    spec = al.ModelSpec.from_step(_optax_step(loss, opt), init, batch_argnums=(2,), name="haiku-resnet")
    return spec, ["conv2_d", "res_block", *[f"res_block_{i}" for i in range(1, DEPTH)], "linear"], "indexed-scopes"


# ----------------------------------------------------------------------------------------------- Keras 3 (JAX)
def keras_transformer():
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip(f"Keras runs on its {keras.backend.backend()} backend here (KERAS_BACKEND was set before this "
                    "test file imported it); the gallery needs the JAX backend")

    class TransformerBlock(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.norm1, self.norm2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()
            self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=WIDTH // 2)
            self.up, self.down = keras.layers.Dense(4 * WIDTH, activation="gelu"), keras.layers.Dense(WIDTH)

        def call(self, x):
            h = self.norm1(x)
            x = x + self.attention(h, h, use_causal_mask=True)
            return x + self.down(self.up(self.norm2(x)))

    def build(seed):
        keras.utils.set_random_seed(seed)
        tokens = keras.Input((SEQ,), dtype="int32")
        x = keras.layers.Embedding(VOCAB, WIDTH)(tokens)
        for _ in range(DEPTH):
            x = TransformerBlock()(x)
        logits = keras.layers.Dense(CLASSES)(keras.layers.GlobalAveragePooling1D()(x))
        return keras.Model(tokens, logits)

    model, opt = build(0), optax.adam(1e-3)
    blocks = [layer.name for layer in model.layers if isinstance(layer, TransformerBlock)]

    def loss(trainable, batch):
        logits, _ = model.stateless_call(trainable, [v.value for v in model.non_trainable_variables], batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    def init(seed):
        params = [jnp.asarray(v.value) for v in build(seed).trainable_variables]
        tokens, labels = _tokens(seed)
        return params, opt.init(params), (tokens, labels[:, 0] % CLASSES)

    spec = al.ModelSpec.from_step(_optax_step(loss, opt), init, batch_argnums=(2,), name="keras-transformer")
    return spec, blocks, "indexed-scopes"


GALLERY = {"linen-gpt": linen_gpt, "nnx-cnn": nnx_cnn, "equinox-gpt": equinox_gpt, "haiku-resnet": haiku_resnet,
           "keras-transformer": keras_transformer}
_BUILT: dict = {}


def _get(name):
    if name not in _BUILT:
        _BUILT[name] = GALLERY[name]()
    return _BUILT[name]


@pytest.fixture(scope="module")
def graphs():
    return {}


def _graph(graphs, name):
    if name not in graphs:
        graphs[name] = _get(name)[0].trace()
    return graphs[name]


@pytest.mark.parametrize("name", list(GALLERY))
def test_layers_found_with_no_annotation(name, graphs):
    spec, layers, rule = _get(name)
    g = _graph(graphs, name)
    assert g.layer_rule == rule, g.layer_note
    if name == "keras-transformer":  # Keras numbers its auto-named layers per process: check the blocks, in order
        found = [x for x in g.layers if x in layers]
        assert found == layers and len(layers) == DEPTH and len(g.layers) >= DEPTH + 2
    else:
        assert g.layers == layers
    # every forward matmul or convolution sits in a layer; each block's have the same FLOPs
    heavy = [n for n in g if n.primitive in ("dot_general", "conv_general_dilated") and n.role == "forward"]
    assert heavy and all(n.layer is not None for n in heavy)
    blocks = layers if name == "keras-transformer" else layers[1:1 + DEPTH]
    flops = [sum(n.flops for n in heavy if n.layer == x) for x in blocks]
    assert len(flops) == DEPTH and max(flops) == min(flops) > 0
    assert g.param_count == spec.param_count


@pytest.mark.slow  # the intra-op ILP of every mesh of a 2 x 2 cluster, for five models
@pytest.mark.parametrize("name", list(GALLERY))
def test_auto_plan_on_a_2x2_cluster_and_its_jax_code(name, graphs):
    g = _graph(graphs, name)
    cluster = al.Cluster.preset("p3.16xlarge", hosts=2).with_(devices_per_host=2)
    plan = al.auto_plan(g, cluster)
    assert plan.cost.step_time_s > 0 and sum(st.submesh[0] * st.submesh[1] for st in plan.stages) <= 4
    assert [st.layers[0] for st in plan.stages][0] == 0 and plan.stages[-1].layers[1] == len(g.layers) - 1
    code = plan.to_jax_code()
    namespace: dict = {}
    exec(compile(code, f"<{name} plan>", "exec"), namespace)  # the exported code runs as it is
    assert "PartitionSpec" in code


@pytest.mark.slow  # compiles each stage's programs and the single-device step, for five models
@pytest.mark.skipif(jax.device_count() < 8, reason="needs JAX_NUM_CPU_DEVICES=8")
@pytest.mark.parametrize("name", list(GALLERY))
def test_two_stage_pipeline_trains_like_one_device(name, graphs):
    spec, _, _ = _get(name)
    g = _graph(graphs, name)
    plan = al.megatron_plan(g, al.Cluster.preset("cpu"), dp=2, tp=2, pp=2, microbatches=2)
    assert len(plan.stages) == 2
    runner = al.execute(plan, spec, compiler_options=FAST)
    assert runner.mode == "pipeline"
    losses = runner.train(STEPS)
    ref, _ = one_device_training(spec, STEPS, compiler_options=FAST, device=jax.devices()[0])
    # (steps 2 and 3 run on parameters the pipeline updated: a step that lost an update would differ here)
    np.testing.assert_allclose(losses, ref, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------- layers from clustering, on Ray
_ON_RAY = """
import json, sys
sys.path.insert(0, {tests!r})
import autopar_lab as al
import test_gallery as tg
from autopar_lab.runtime.launch import launch

spec = tg.linen_gpt()[0]
g = al.relayer(spec.trace(), boundaries="cluster", num_layers=4)
assert g.layers == [f"cluster_{{i}}" for i in range(4)] and g.layer_rule == "cluster"
plan = al.megatron_plan(g, al.Cluster.preset("cpu"), dp=2, tp=2, pp=2, microbatches=2)
local = al.execute(plan, spec, compiler_options=tg.FAST).train(tg.STEPS)
try:
    launch(plan, spec, tg.STEPS, ray_address="http://127.0.0.1:1")
    refused = ""
except ValueError as e:
    refused = str(e)
result = launch(plan, spec, tg.STEPS, options=al.RunOptions(compiler_options=tg.FAST), wait=True).result
print("RESULT " + json.dumps({{"local": local, "ray": result, "refused": refused}}))
"""


@pytest.mark.slow  # starts an embedded Ray and two stage actors (each traces, plans and compiles its stage)
def test_clustered_layers_of_an_own_model_train_on_local_ray_like_execute(tmp_path):
    """The issue's case: a GPT from another library, its layers made by Alpa's clustering (not by any scope), planned,
    run with al.execute, and launched on the embedded Ray (the ModelSpec travels by Ray's serialization): the same
    losses. In a fresh Python, as a user runs it (and so this file's other tests keep their own process Ray-free)."""
    import importlib.util
    import json
    import pathlib
    import subprocess
    import sys

    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed")
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(pathlib.Path(al.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    script = _ON_RAY.format(tests=str(pathlib.Path(__file__).parent))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert "your own" in out["refused"] and "embedded Ray" in out["refused"]
    assert out["ray"]["status"] == "done", out["ray"].get("message")
    np.testing.assert_allclose(out["ray"]["losses"], out["local"], rtol=1e-6, atol=0)
