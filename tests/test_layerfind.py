"""Layers found wherever they sit in the scope tree (or the parameters' paths), and the rule that found them."""

import jax
import jax.numpy as jnp
import pytest

import autopar_lab as al
from autopar_lab.graph.layerfind import indexed_groups, split_key_path
from autopar_lab.graph.opgraph import BACKWARD, FORWARD

D, B, T, V, DEPTH = 16, 4, 8, 32, 3


def test_indexed_groups_rules():
    # Keras names the first of a kind without an index; a group nested in a winner does not count
    paths = [("dense",), ("dense_1",), ("dense_2",), ("dense", "kernel_0"), ("dense", "kernel_1")]
    assert [(g.prefix, g.stem, sorted(g.members.values())) for g in indexed_groups(paths)] == [((), "dense_",
                                                                                                 [0, 1, 2])]
    # two disjoint groups of similar size both count (an encoder's and a decoder's layers)
    paths = [("enc", f"layer_{i}") for i in range(6)] + [("dec", f"layer_{i}") for i in range(4)]
    assert sorted(g.prefix for g in indexed_groups(paths)) == [("dec",), ("enc",)]
    # ... a much smaller one does not
    paths = [("enc", f"layer_{i}") for i in range(12)] + [("head", "linear_0"), ("head", "linear_1")]
    assert [g.prefix for g in indexed_groups(paths)] == [("enc",)]
    assert indexed_groups([("embed",), ("block",), ("head",)]) == []
    assert split_key_path("args[0]['blocks'][2]['kernel'].value") == ("blocks", "2", "kernel", "value")


def _gpt2_like_step():
    """Plain JAX with the scope layout of a Keras GPT-2: token_embedding at the top (used by the input and, tied, by
    the output head), the blocks at backbone/transformer_layer_*, a final norm, glue at backbone's own level."""

    def loss(p, tokens):
        with jax.named_scope("token_embedding"):
            x = p["wte"][tokens]
        with jax.named_scope("backbone"):
            x = x + p["wpe"][None]  # glue at backbone's own level
            for i in range(DEPTH):
                with jax.named_scope(f"transformer_layer_{i}"):
                    x = x + jnp.tanh(x @ p["w"][i]) @ p["v"][i]
            with jax.named_scope("layer_norm"):
                x = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
        with jax.named_scope("token_embedding"):  # the tied output head: the same scope again, later
            logits = x @ p["wte"].T
        return jax.nn.logsumexp(logits, -1).mean() - logits[..., 0].mean()

    def step(p, tokens):
        g = jax.grad(loss)(p, tokens)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)

    f32 = jnp.float32
    p = {"wte": jax.ShapeDtypeStruct((V, D), f32), "wpe": jax.ShapeDtypeStruct((T, D), f32),
         "w": [jax.ShapeDtypeStruct((D, D), f32)] * DEPTH, "v": [jax.ShapeDtypeStruct((D, D), f32)] * DEPTH}
    return step, p, jax.ShapeDtypeStruct((B, T), jnp.int32)


def test_blocks_one_level_down_are_found_and_a_tied_embedding_becomes_two_layers():
    step, p, tokens = _gpt2_like_step()
    g = al.trace(step, p, tokens, batch_argnums=(1,))
    blocks = [f"backbone/transformer_layer_{i}" for i in range(DEPTH)]
    assert g.layer_rule == "indexed-scopes" and "backbone/transformer_layer_*" in g.layer_note
    assert g.layers == ["token_embedding", *blocks, "backbone/layer_norm", "token_embedding#2"]
    # the tied head's matmuls, forward and backward, sit in the last layer, not with the embedding lookup
    head = [n for n in g if n.primitive == "dot_general" and V in n.out_shapes[0]]
    assert head and all(n.layer == "token_embedding#2" for n in head if n.role == FORWARD)
    wte_grad = [n for n in g if n.primitive == "dot_general" and n.role == BACKWARD and n.out_shapes[0] == (V, D)]
    assert wte_grad and all(n.layer == "token_embedding#2" for n in wte_grad)
    # each block's two forward matmuls and four backward ones are in it; the glue joined a neighbour
    for name in blocks:
        roles = sorted(n.role for n in g if n.layer == name and n.primitive == "dot_general")
        assert roles == [BACKWARD] * 4 + [FORWARD] * 2
    assert all(n.layer is not None for n in g if n.role == FORWARD and n.primitive != "output")
    # the user names the level: the same blocks, by the pattern rule
    named = al.trace(step, p, tokens, batch_argnums=(1,), layers="backbone/transformer_layer_*")
    assert named.layer_rule == "pattern" and [x for x in named.layers if x in blocks] == blocks
    assert al.relayer(g, layers="backbone/transformer_layer_*").layers == named.layers
    with pytest.raises(ValueError, match="matches no name scope.*backbone"):
        al.trace(step, p, tokens, batch_argnums=(1,), layers="decoder/block_*")


def test_a_plan_over_found_layers_cuts_between_blocks():
    step, p, tokens = _gpt2_like_step()
    g = al.trace(step, p, tokens, batch_argnums=(1,))
    cluster = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=2)
    plan = al.megatron_plan(g, cluster, dp=1, tp=1, pp=2, microbatches=1)
    assert len(plan.stages) == 2 and plan.layer_names == tuple(g.layers) or list(plan.layer_names) == g.layers


def _residual_step(names):
    """h <- h + tanh(h @ w_i), parameters in a list (indexed paths) or a dict of plain names; no scopes."""

    def loss(ws, x):
        h = x
        for w in (ws if isinstance(ws, list) else ws.values()):
            h = h + jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    def step(ws, x):
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, ws, jax.grad(loss)(ws, x))

    w = jax.ShapeDtypeStruct((D, D), jnp.float32)
    ws = [w] * 4 if names is None else {n: w for n in names}
    return step, ws, jax.ShapeDtypeStruct((B, D), jnp.float32)


def test_indexed_parameters_anchor_the_layers_and_the_cut_falls_where_fewest_bytes_cross():
    step, ws, x = _residual_step(None)
    g = al.trace(step, ws, x, batch_argnums=(1,))
    assert g.layer_rule == "indexed-params" and g.layers == ["[0]", "[1]", "[2]", "[3]"]
    fwd = [n for n in g if n.role == FORWARD and n.primitive not in ("parameter", "output")]
    # block i: its matmul, its tanh and its residual add (cutting after the add sends one array, before it two)
    for name in g.layers:
        prims = [n.primitive for n in fwd if n.layer == name]
        assert prims.count("dot_general") == 1 and prims.count("tanh") == 1 and prims.count("add") == 1
    adds = [n for n in fwd if n.primitive == "add"]
    assert [n.layer for n in adds[:4]] == g.layers
    # and the pattern rule reads parameter paths when no scope matches
    assert al.trace(step, ws, x, batch_argnums=(1,), layers="*").layer_rule == "pattern"


def test_no_names_at_all_falls_back_to_clustering():
    step, ws, x = _residual_step(["alpha", "beta", "gamma", "delta"])
    g = al.trace(step, ws, x, batch_argnums=(1,))
    assert g.layer_rule == "cluster" and g.layers == [f"cluster_{i}" for i in range(4)]
    assert "clustering" in g.layer_note and g.summary()["layer_rule"] == "cluster"


def test_zoo_models_keep_their_layers_and_a_deep_one_is_found_in_full():
    g = al.models.get("gpt-tiny", num_layers=24).trace()
    assert g.layer_rule == "indexed-scopes"
    assert g.layers == ["embed", *[f"layer_{i}" for i in range(24)], "head"]
    scanned = al.models.get("gpt-tiny", num_layers=4, scan_layers=True).trace()
    assert scanned.layer_rule == "scan" and len(scanned.layers) == 6


def test_siblings_sharing_a_stem_are_not_blocks_in_a_one_block_model():
    """A one-layer zoo GPT: fc1/fc2 and ln1/ln2 are not repeated blocks (fc1 and fc2 differ in shape, the layer
    norms hold a sliver of the parameters), so the top scopes name the layers, as they did before the finder."""
    for name in ("gpt-tiny", "gpt-1.3b"):
        g = al.models.get(name, num_layers=1, batch_size=1).trace()
        assert g.layers == ["embed", "layer_0", "head"] and g.layer_rule == "top-scopes"
