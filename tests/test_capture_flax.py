"""A model the zoo did not write: Flax modules go through al.trace with no special case."""

import jax
import jax.numpy as jnp
import optax
import pytest

import autopar_lab as al

nn = pytest.importorskip("flax.linen")


class Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
        return x + nn.Dense(self.width)(nn.gelu(h))


class Net(nn.Module):
    depth: int = 3
    width: int = 32

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = Block(self.width, name=f"block_{i}")(x)
        return nn.Dense(10, name="head")(x)


class ScanBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, carry, _):
        return Block(self.width)(carry), None


class ScanNet(nn.Module):
    depth: int = 4
    width: int = 32

    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.depth)
        x, _ = blocks(self.width, name="blocks")(x, None)
        return nn.Dense(10, name="head")(x)


def _train_step(model, width=32, batch=8):
    x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)
    opt = optax.adamw(1e-3)
    opt_state = jax.eval_shape(opt.init, params)

    def step(params, opt_state, batch):
        xs, ys = batch

        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, xs), ys).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, (x, jax.ShapeDtypeStruct((batch,), jnp.int32)))


def test_flax_model_traces_with_layers_roles_and_exact_matmul_flops():
    step, args = _train_step(Net())
    g = al.trace(step, *args, batch_argnums=(2,))
    # Flax names every module; the layers are the top module's children.
    assert {"block_0", "block_1", "block_2", "head"} <= set(g.layers)
    dots = [g.op(i) for i in g.ops if g.op(i).primitive == "dot_general"]
    fwd = [d for d in dots if d.role == "forward"]
    B, W = 8, 32
    # forward: 3 blocks x (W->4W, 4W->W) + head W->10; backward: twice that, less the first input gradient.
    assert sum(d.flops for d in fwd) == 3 * 2 * (2 * B * W * 4 * W) + 2 * B * W * 10
    assert {d.layer for d in fwd} == {"block_0", "block_1", "block_2", "head"}
    assert set(g.flops_by("role")) == {"forward", "backward", "update"}
    assert g.param_count == 3 * (2 * W + W * 4 * W + 4 * W + 4 * W * W + W) + W * 10 + 10
    assert not g.summary()["opaque_ops"]


def test_flax_scan_over_layers_yields_one_layer_per_iteration():
    step, args = _train_step(ScanNet(depth=4))
    g = al.trace(step, *args, batch_argnums=(2,))
    scanned = [x for x in g.layers if "[" in x]
    base = scanned[0].split("[")[0]  # the scope Flax gives the scan
    assert scanned == [f"{base}[{i}]" for i in range(4)]
    for name in scanned:
        roles = sorted(g.op(i).role for i in g.ops_in_layer(name) if g.op(i).primitive == "dot_general")
        assert roles.count("forward") == 2 and roles.count("backward") == 4
