"""Operators named by module (autopar_lab.graph.modules) and the views that show them: the sharding table's rows
carry each operator's module label, shapes and module path, and filter by module.

Expected shapes are computed here from the model's configuration (B, S, H, heads, 4H), not read from the code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp
import pytest

import autopar_lab as al
from autopar_lab.graph.modules import layer_operators, module_labels, modules_present, shapes_text, under
from autopar_lab.widgets.session import Session
from autopar_lab.widgets.views.sharding_table import ShardingTable, column_widths, op_rows, row_label

FORWARD_GPT = ["qkv", "attn/scores", "attn/context", "proj", "fc1", "fc2"]


def _shape(s) -> str:
    return "[" + ",".join(str(d) for d in s) + "]"


def gpt_forward_shapes(c) -> dict[str, str]:
    """Each forward matmul of a GPT layer: operands and result, from the configuration (gpt.py's layout: q, k, v
    [B, S, heads, head_dim]; scores [B, heads, S, S]; the context einsum "bhqk,bkhd->bqhd" as XLA's dot_general puts
    it, batch dims first: [B, heads, head_dim, S])."""
    B, S, H, nh = c.batch_size, c.seq_len, c.hidden_size, c.num_heads
    hd, F = H // nh, c.mlp_factor * H
    return {"qkv": f"{_shape((B, S, H))}x{_shape((H, 3 * H))} -> {_shape((B, S, 3 * H))}",
            "attn/scores": f"{_shape((B, S, nh, hd))}x{_shape((B, S, nh, hd))} -> {_shape((B, nh, S, S))}",
            "attn/context": f"{_shape((B, S, nh, hd))}x{_shape((B, nh, S, S))} -> {_shape((B, nh, hd, S))}",
            "proj": f"{_shape((B, S, H))}x{_shape((H, H))} -> {_shape((B, S, H))}",
            "fc1": f"{_shape((B, S, H))}x{_shape((H, F))} -> {_shape((B, S, F))}",
            "fc2": f"{_shape((B, S, F))}x{_shape((F, H))} -> {_shape((B, S, H))}"}


def _param_tensor(graph, t):
    """The step input tensor ``t`` is, through casts (what a mixed-precision matmul reads), else None."""
    for _ in range(3):
        info = graph.tensor(t)
        if info.producer is None:
            return None
        node = graph.op(info.producer)
        if node.primitive == "parameter":
            return info
        if node.primitive != "convert_element_type":
            return None
        t = node.inputs[0]
    return None


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # float16: the weights are cast copies of fp32 masters
def test_gpt_layer_matmuls_are_named(dtype):
    model = al.models.get("gpt-tiny", dtype=dtype)
    g = model.trace()
    labels = module_labels(g)
    want = gpt_forward_shapes(model.config)
    for k in range(model.config.num_layers):
        dots = [n for n in g if n.primitive == "dot_general" and n.layer == f"layer_{k}"]
        fwd = [n for n in dots if n.role == "forward"]
        assert [labels[n.id].label for n in fwd] == FORWARD_GPT
        for n in fwd:
            assert shapes_text(n) == want[labels[n.id].label]
            params = [p for p in (_param_tensor(g, t) for t in n.inputs) if p is not None]
            if labels[n.id].module.startswith("attn/"):
                assert not params and labels[n.id].source == "attention"  # two activations: found by structure
            else:  # the weight it reads is layer k's parameter of that name, and the path says so
                assert [p.path for p in params] == [f"args[0]['layers'][{k}]['{labels[n.id].module}']['w']"]
                assert labels[n.id].path == params[0].path and labels[n.id].source == "param"
        # The backward: per weight one weight grad (a result of the weight's size, reading no parameter) and one
        # data grad (reading that weight); attention's two matmuls two data grads each.
        bwd = [n for n in dots if n.role == "backward"]
        assert Counter(labels[n.id].label for n in bwd) == Counter(
            [f"{m} (weight grad)" for m in ("qkv", "proj", "fc1", "fc2")]
            + [f"{m} (data grad)" for m in ("qkv", "proj", "fc1", "fc2")]
            + ["attn/scores (data grad)"] * 2 + ["attn/context (data grad)"] * 2)
        for n in bwd:
            lab = labels[n.id]
            params = [p for p in (_param_tensor(g, t) for t in n.inputs) if p is not None]
            if lab.label.endswith("(weight grad)"):
                w = next(g.tensor(t) for t in g.inputs if g.tensor(t).path ==
                         f"args[0]['layers'][{k}]['{lab.module}']['w']")
                assert not params and sorted(n.out_shapes[0]) == sorted(w.shape)
            elif not lab.module.startswith("attn/"):
                assert [p.path for p in params] == [f"args[0]['layers'][{k}]['{lab.module}']['w']"]


def test_gpt_outside_layers_and_optimizer():
    g = al.models.get("gpt-tiny").trace()
    labels = module_labels(g)
    head = [labels[n.id].label for n in g if n.primitive == "dot_general" and n.layer == "head"]
    assert sorted(head) == ["lm head", "lm head (data grad)", "lm head (weight grad)"]  # tied to wte: still the head
    gather = next(n for n in g if n.primitive == "gather")
    assert labels[gather.id].label == "embedding" and labels[gather.id].path == "args[0]['wte']"
    # Adam's operators on a weight: its update; its moments: optimizer state.
    mu = next(n for n in g if n.primitive == "parameter" and
              g.tensor(n.outputs[0]).path == "args[1][0].mu['layers'][1]['fc1']['w']")
    assert labels[mu.id].label == "fc1 (optimizer state)"
    reads_mu = [c for c in g.consumers[mu.outputs[0]] if g.op(c).role == "update"]
    assert reads_mu and all(labels[c].label == "fc1 (update)" for c in reads_mu)
    assert {"embedding", "position embedding", "final norm", "lm head", "ln1", "ln2"} <= set(modules_present(labels))


def test_moe_router_experts_dispatch_and_combine():
    model = al.models.get("moe-tiny")
    g = model.trace()
    labels = module_labels(g)
    fwd = [labels[n.id].label for n in g if n.primitive == "dot_general" and n.layer == "layer_1" and
           n.role == "forward"]
    assert fwd == ["qkv", "attn/scores", "attn/context", "proj", "gate", "moe/dispatch", "experts/w1", "experts/w2",
                   "moe/combine"]
    bwd = Counter(labels[n.id].label for n in g if n.primitive == "dot_general" and n.layer == "layer_1" and
                  n.role == "backward")
    for m in ("gate", "experts/w1", "experts/w2"):
        assert bwd[f"{m} (weight grad)"] == 1 and bwd[f"{m} (data grad)"] == 1
    # Every matmul of the step has a module.
    assert all(labels[n.id].module for n in g if n.primitive == "dot_general")


# --- a step of one's own, with the name scopes the Llama / DeepSeek families use --------------------------------------

B, S, H, F = 2, 8, 16, 32
SCOPED = {"wa": (H, H), "wb": (H, H), "wc": (H, H), "wd": (H, H), "we": (H, F), "wf": (H, F), "wg": (F, H)}


def _scoped_layer(p, x):
    # The parameters' names say nothing (wa..wg): the scopes name the modules.
    with jax.named_scope("attn"):
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)
        with jax.named_scope("q_proj"):
            q = h @ p["wa"]
        with jax.named_scope("k_proj"):
            k = h @ p["wb"]
        with jax.named_scope("v_proj"):
            v = h @ p["wc"]
        probs = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 4.0, axis=-1)
        ctx = jnp.einsum("bqk,bkd->bqd", probs, v)
        with jax.named_scope("o_proj"):
            x = x + ctx @ p["wd"]
    with jax.named_scope("mlp"):
        with jax.named_scope("gate"):
            gate = x @ p["we"]
        with jax.named_scope("up"):
            up = x @ p["wf"]
        with jax.named_scope("down"):
            x = x + (jax.nn.silu(gate) * up) @ p["wg"]
    return x


def _scoped_graph(remat: bool):
    block = jax.checkpoint(_scoped_layer) if remat else _scoped_layer

    def loss(params, x):
        for i, p in enumerate(params["layers"]):
            with jax.named_scope(f"layer_{i}"):
                x = block(p, x)
        return (x ** 2).mean()

    def step(params, x):
        grads = jax.grad(loss)(params, x)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, grads)

    params = {"layers": [{k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SCOPED.items()} for _ in range(2)]}
    return al.trace(step, params, jax.ShapeDtypeStruct((B, S, H), jnp.float32), batch_argnums=(1,))


SCOPED_FORWARD = ["attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/scores", "attn/context", "attn/o_proj",
                  "mlp/gate", "mlp/up", "mlp/down"]
SCOPED_WEIGHTS = ["attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj", "mlp/gate", "mlp/up", "mlp/down"]


@pytest.mark.parametrize("remat", [False, True])
def test_scope_path_wins(remat):
    g = _scoped_graph(remat)
    labels = module_labels(g)
    dots = [n for n in g if n.primitive == "dot_general" and n.layer == "layer_1"]
    fwd = [n for n in dots if n.role == "forward"]
    assert [labels[n.id].label for n in fwd] == SCOPED_FORWARD
    q = fwd[0]
    assert labels[q.id].source == "scope" and labels[q.id].path == "layer_1/attn/q_proj"
    # the parameter it reads is wa: the scope, not the parameter's name, names it
    assert g.tensor(q.inputs[1]).path == "args[0]['layers'][1]['wa']"
    bwd = Counter(labels[n.id].label for n in dots if n.role == "backward")
    want = Counter([f"{m} (weight grad)" for m in SCOPED_WEIGHTS] + [f"{m} (data grad)" for m in SCOPED_WEIGHTS]
                   + ["attn/scores (data grad)"] * 2 + ["attn/context (data grad)"] * 2)
    if remat:  # jax.checkpoint runs the layer's forward matmuls again in the backward (all but the last: no
        # gradient reads mlp/down's result)
        want += Counter(f"{m} (recomputed)" for m in SCOPED_FORWARD[:-1])
    assert bwd == want


# --- the sharding table -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def session():
    model = al.models.get("gpt-tiny", batch_size=8, dtype="float32")
    cluster = al.Cluster.preset("p3.16xlarge", hosts=1).with_(devices_per_host=4)
    return model, Session(al.megatron_plan(model, cluster, dp=1, tp=2, pp=2, microbatches=2))


def test_table_rows_carry_label_shapes_and_path(session):
    model, s = session
    rows = op_rows(s, layer="layer_1", primitive="dot_general")
    want = gpt_forward_shapes(model.config)
    fwd = [r for r in rows if r["role"] == "forward"]
    assert [r["label"] for r in fwd] == FORWARD_GPT
    for r in fwd:
        assert r["shapes"] == want[r["label"]] and r["dtype"] == "float32"
        if r["module"] in ("qkv", "proj", "fc1", "fc2"):
            assert r["module_path"] == f"args[0]['layers'][1]['{r['module']}']['w']"
        text = row_label(r, column_widths(rows))
        assert r["label"] in text and r["shapes"] in text and r["module_path"] in text and "layer_1" in text
    assert {r["label"] for r in rows if r["role"] == "backward"} >= {"fc1 (weight grad)", "qkv (data grad)"}


def test_filter_by_module_keeps_only_its_rows(session):
    _, s = session
    every = op_rows(s)
    for module in ("fc1", "attn", "lm head"):
        kept = op_rows(s, module=module)
        want = [r["key"] for r in every if r["module"] == module or r["module"].startswith(module + "/")]
        assert kept and [r["key"] for r in kept] == want
    assert {r["label"] for r in op_rows(s, module="attn", primitive="dot_general")} == {
        "attn/scores", "attn/context", "attn/scores (data grad)", "attn/context (data grad)"}
    assert under("attn/q_proj", "attn") and not under("attn/q_proj", "q_proj")
    # The widget: its module box offers the modules present and filters the rows it lists.
    t = ShardingTable(s)
    assert {"qkv", "fc1", "attn", "attn/scores", "lm head"} <= set(t.module_filter.options)
    t.set_filters(layer="layer_0", primitive="dot_general", module="fc1")
    assert sorted(r["label"] for r in t.rows) == ["fc1", "fc1 (data grad)", "fc1 (weight grad)"]
    assert all("fc1" in text for text, _ in t.rows_select.options)
    assert "module" in t.header.value and "shapes" in t.header.value
    t.module_filter.value = "no_such_module"
    assert t.rows == [] and "no operator of module" in t.count.value
    t.select(op_rows(s, layer="layer_0", primitive="dot_general")[0]["key"])  # a click on the qkv row
    assert "module <b>qkv</b>" in t.detail.value and "shapes <code>" in t.detail.value


@pytest.mark.slow
def test_deep_table_layer_20_names_its_modules():
    """GPT-1.3B (24 layers) planned on its 4-layer copy: layer 20's own rows name qkv, fc1, ... with its shapes and
    its own parameters' paths."""
    model = al.models.get("gpt-1.3b")
    plan = al.auto_plan(model, al.Cluster.preset("p3.16xlarge", hosts=2))
    assert plan.op_graph is not plan.graph  # solved on the copy
    s = Session(plan)
    rows = op_rows(s, layer="layer_20", primitive="dot_general")
    assert all(r["layer"] == "layer_20" for r in rows)
    want = gpt_forward_shapes(model.config)
    fwd = [r for r in rows if r["role"] == "forward"]
    assert [r["label"] for r in fwd] == FORWARD_GPT
    assert all(r["shapes"] == want[r["label"]] for r in fwd)
    assert want["qkv"] == "[1024,1024,2048]x[2048,6144] -> [1024,1024,6144]"  # batch 1024, seq 1024, H 2048
    for r in fwd:
        if r["module"] in ("qkv", "proj", "fc1", "fc2"):
            assert r["module_path"] == f"args[0]['layers'][20]['{r['module']}']['w']"
    assert Counter(r["label"].split(" (")[0] for r in rows) == Counter(
        {"qkv": 3, "proj": 3, "fc1": 3, "fc2": 3, "attn/scores": 3, "attn/context": 3})
    fc1 = op_rows(s, layer="layer_20", primitive="dot_general", module="fc1")
    assert sorted(r["label"] for r in fc1) == ["fc1", "fc1 (data grad)", "fc1 (weight grad)"]


@pytest.mark.slow
def test_labels_are_fast_on_a_deep_full_trace():
    g = al.models.get("gpt-39b").trace()  # 48 layers, 26,000 operators
    t0 = time.perf_counter()
    labels = module_labels(g)
    took = time.perf_counter() - t0
    assert took < 2.0, f"labelling {len(g)} operators took {took:.2f} s"  # ~0.3 s alone; a shared CI runner
    assert module_labels(g) is labels  # computed once per graph
    assert Counter(labels[n.id].label for n in g if n.primitive == "dot_general")["fc1 (weight grad)"] == 48


def test_cli_graph_lists_the_modules_of_each_layer_kind(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "autopar_lab", "graph", "moe-tiny", "--json"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "num_ops" in out and "flops_by_role" in out  # the keys it had
    blocks = {b["layer"]: b["operators"] for b in out["layer_modules"]}
    assert list(blocks) == ["layer_0", "layer_1"]  # the dense layer and the first expert layer
    assert [o["label"] for o in blocks["layer_0"] if o["role"] == "forward"] == FORWARD_GPT
    experts = next(o for o in blocks["layer_1"] if o["label"] == "experts/w1")
    assert experts["path"] == "args[0]['layers'][1]['experts']['w1']" and experts["shapes"].endswith("]")
    text = subprocess.run([sys.executable, "-m", "autopar_lab", "graph", "gpt-tiny"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=300).stdout
    assert "layer_0's matmuls" in text and "fc1" in text and "[4,16,32]x[32,128] -> [4,16,128]" in text


def test_layer_operators_refuses_an_unknown_layer():
    g = al.models.get("gpt-tiny").trace()
    with pytest.raises(ValueError, match="no layer 'layer_9'"):
        layer_operators(g, ["layer_9"])


def test_a_flax_model_is_named_by_its_modules():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(64)(nn.LayerNorm()(x))  # Dense_0: Flax numbers modules as they are built
            return x + nn.Dense(16)(nn.gelu(h))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(2):
                x = Block(name=f"block_{i}")(x)
            return nn.Dense(4, name="head")(x)

    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    params = jax.eval_shape(Net().init, jax.random.key(0), x)

    def step(p, x):
        grads = jax.grad(lambda q: (Net().apply(q, x) ** 2).mean())(p)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, grads)

    g = al.trace(step, params, x, batch_argnums=(1,))
    labels = module_labels(g)
    dots = [(n.layer, n.role, labels[n.id].label) for n in g if n.primitive == "dot_general"]
    assert [d[2] for d in dots if d[1] == "forward"] == ["Dense_0", "Dense_1"] * 2 + ["head"]
    assert ("block_1", "backward", "Dense_0 (weight grad)") in dots and ("head", "backward", "head (data grad)") in dots
    norm = [labels[n.id] for n in g if n.layer == "block_0" and n.role == "forward" and
            labels[n.id].module == "LayerNorm_0"]
    # its statistics by its scope, the operators on its scale and bias (some outside the scope) by those parameters
    assert {(x.source, x.path) for x in norm} >= {("scope", "Net/block_0/LayerNorm_0"),
                                                   ("param", "args[0]['params']['block_0']['LayerNorm_0']['scale']")}
