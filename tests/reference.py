"""What a plan's training is checked against: the same step jitted on one device, batch i at step i."""

from __future__ import annotations

import dataclasses

import jax

import autopar_lab as al


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


def scanned(spec):
    """The zoo GPT ``spec`` with its blocks run by ``lax.scan`` (``scan_layers=True``), every other setting kept: the
    same model, parameters and batches (tests/test_models.py::test_scan_layers_matches_unrolled), whose one-device
    step compiles one block instead of every one. A 24-layer reference compiles in a quarter of the CPU time (51 -> 14
    CPU-s for gpt-tiny at 24 layers); the losses are the same. Its parameters come back stacked by layer."""
    cfg = spec.config
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "scan_layers"}
    return al.models.get(spec.name, **fields, scan_layers=True)

