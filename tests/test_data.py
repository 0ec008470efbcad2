"""The zoo's synthetic batches carry a task a model can learn, so a short training run shows the loss fall."""

import jax
import jax.numpy as jnp
import numpy as np
import autopar_lab as al
from autopar_lab.models.data import COUNT_MODULO, counting_tokens, teacher_labels


def _losses(spec, steps):
    """Train on a fresh batch per step (step i on ``init(i)``'s batch, as Runner.train and run_local do)."""
    params, opt_state, _ = spec.init(0)
    step = jax.jit(spec.step_fn)
    out = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, spec.init(i)[2])
        out.append(float(loss))
    return out


def test_gpt_tiny_loss_falls_visibly_in_20_steps():
    spec = al.models.get("gpt-tiny")
    losses = _losses(spec, 20)
    # Random tokens stay at ln(vocab) = 4.16 (4.15 -> 4.18 in the issue); the counting task is learnt.
    assert losses[0] > 4.0 and losses[-1] < 3.5 and losses[-1] < losses[0] - 0.7, losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5


def test_batches_follow_the_rule_and_depend_on_the_seed():
    spec = al.models.get("gpt-tiny", batch_size=16)
    a, b = spec.init(0)[2], spec.init(3)[2]
    for batch in (a, b):
        t, y = np.asarray(batch["tokens"]), np.asarray(batch["targets"])
        assert t.shape == y.shape == (16, spec.config.seq_len) and t.dtype == np.int32
        assert ((t + 1) % COUNT_MODULO == y).all() and t.max() < COUNT_MODULO
    assert not np.array_equal(a["tokens"], b["tokens"])
    small = counting_tokens(jax.random.PRNGKey(0), 3, 10, vocab_size=5)  # a vocabulary under the modulus
    assert int(small["tokens"].max()) < 5 and ((small["tokens"] + 1) % 5 == small["targets"]).all()


def test_teacher_labels_are_one_fixed_rule():
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 12))
    y = teacher_labels(x, 5)
    assert y.shape == (64,) and y.dtype == jnp.int32 and 0 <= int(y.min()) and int(y.max()) < 5
    assert len(set(np.asarray(y).tolist())) > 2  # not one class for everything
    assert np.array_equal(teacher_labels(x[:10], 5), y[:10])  # per example, the same map every call


def test_classifier_learns_the_teacher():
    # Fresh examples every step: only a rule (not memorised labels) can bring the loss down.
    spec = al.models.get("mlp", batch_size=128, input_dim=8, hidden_size=64, num_layers=1, num_classes=2)
    losses = _losses(spec, 40)
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
