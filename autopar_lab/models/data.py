"""Synthetic training data the zoo's models can learn, so a short run shows the loss fall.

Random tokens or random labels carry nothing to learn: a 20-step run of gpt-tiny on them stays at ln(vocab) and says
nothing about whether the plan trains. The tasks here are small, deterministic rules a model picks up in a few steps:

* tokens (GPT, MoE): every sequence counts up by one modulo :data:`COUNT_MODULO` from a random start, so the next
  token is a function of the current one (a bigram the embeddings learn; 20 steps of gpt-tiny take the loss from about
  4.2 to about 3.2);
* classes (MLP, Wide-ResNet): the label is the arg-max of a fixed random linear map of the input's features (a
  "teacher" the model's own head can represent).

Batches stay deterministic in their key, as :meth:`ModelSpec.init` promises.

    >>> import jax
    >>> b = counting_tokens(jax.random.PRNGKey(0), batch_size=2, seq_len=5, vocab_size=64)
    >>> bool(((b["tokens"] + 1) % COUNT_MODULO == b["targets"]).all())
    True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["COUNT_MODULO", "counting_tokens", "teacher_labels"]

#: Tokens count up modulo this many (or the vocabulary size, when smaller).
COUNT_MODULO = 16
# The teacher's weights come from one fixed key, so every batch of every seed follows the same rule.
_TEACHER_SEED = 1234


def counting_tokens(key, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    """``{"tokens", "targets"}`` ([batch, seq] int32 each): sequences counting up by one modulo
    ``min(COUNT_MODULO, vocab_size)`` from a random start; ``targets`` is ``tokens`` shifted by one."""
    k = min(COUNT_MODULO, int(vocab_size))
    start = jax.random.randint(key, (batch_size, 1), 0, k, jnp.int32)
    seq = (start + jnp.arange(seq_len + 1, dtype=jnp.int32)[None, :]) % k
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:]}


def teacher_labels(features, num_classes: int):
    """Integer labels [batch] for ``features`` [batch, d]: the arg-max of a fixed random linear map to
    ``num_classes`` scores (the same map for every batch)."""
    f = features.astype(jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(_TEACHER_SEED), (f.shape[-1], int(num_classes)), jnp.float32)
    return jnp.argmax(f @ w, axis=-1).astype(jnp.int32)
