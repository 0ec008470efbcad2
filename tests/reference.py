"""What a plan's training is checked against: the same step jitted on one device, batch i at step i."""

from __future__ import annotations

import jax


def one_device_training(spec, steps: int, *, compiler_options: dict | None = None, device=None):
    """``(losses, params)`` of ``steps`` steps of ``spec.step_fn`` on one device (``device``, default JAX's
    choice), starting from ``spec.init(0)`` and fed ``spec.init(i)``'s batch at step ``i``, as every runner is."""
    step = jax.jit(spec.step_fn, compiler_options=compiler_options)
    put = (lambda x: jax.device_put(x, device)) if device is not None else (lambda x: x)
    params, opt_state, _ = put(spec.init(0))
    losses = []
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, put(spec.init(i)[2]))
        losses.append(float(loss))
    return losses, params
