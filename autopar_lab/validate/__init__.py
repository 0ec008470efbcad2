"""Apply a sharding plan to the real step function, and read back what XLA compiled.

Three pieces, one module each (:mod:`~autopar_lab.validate.replay`, :mod:`~autopar_lab.validate.hlo`,
:mod:`~autopar_lab.validate.report`), and a fourth that explains a gap between them
(:mod:`~autopar_lab.validate.xlamoves`):

- :func:`replay_with_shardings` re-executes the step function's jaxpr equation by equation, walking it in exactly the
  order :mod:`autopar_lab.graph.capture` does (nested calls inlined, short scans unrolled into ``scan_slice`` / body /
  ``scan_stack``), so that it counts operator ids like the :class:`~autopar_lab.graph.opgraph.OpGraph` does. After
  each operator that the plan gives specs for, it pins the outputs with ``jax.lax.with_sharding_constraint``. The
  walk checks, operator by operator, that it meets the graph's primitive and output shapes, and raises
  :class:`ReplayError` the moment the two disagree.
- :func:`collectives_in_hlo` counts the collectives in XLA's partitioned HLO text and the bytes each one moves
  (by the convention of :mod:`autopar_lab.sharding.strategies`: the full per-device buffer the collective works on).
- :func:`xla_moves` (:mod:`~autopar_lab.validate.xlamoves`): the conversions of a plan that XLA's partitioner moves
  across their reader (an elementwise operator computed before its inputs' shared conversion, a reduction before
  its input's), which explain a prediction above what XLA compiled.
- :func:`propagation_programs` (:mod:`~autopar_lab.validate.propagation`): one step compiled from a few input
  annotations (sharding propagation) and from the ILP's plan, side by side; :func:`time_programs` times compiled
  programs in interleaved rounds (notebook 06's question 3, ``bench/bench_propagation.py``).
- :func:`validate_model` puts the two together on a zoo model: compile the planned step on a mesh, count its
  collectives, run one step sharded and one on a single device, and report predicted against compiled.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh
    >>> from autopar_lab.graph.capture import trace
    >>> from autopar_lab.sharding.spec import ShardingSpec
    >>> fn = lambda x: jnp.sum(x, axis=0)
    >>> x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    >>> g = trace(fn, x, param_argnums=())
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("x", "y"))
    >>> f = replay_with_shardings(g, fn, (x,), {0: [ShardingSpec.parse("S0R")]}, mesh)
    >>> f.jit().lower(x).compile() is not None
    True
"""

from .hlo import COLLECTIVE_KINDS, collective_instructions, collectives_in_hlo, total_bytes
from .replay import (Replay, ReplayError, ReplayOptions, operand_specs_from_strategies, replay_with_shardings,
                     specs_from_strategies)
from .propagation import PROPAGATION_NAMES, PropagationPrograms, propagation_programs, time_programs
from .report import SMALL_OVERRIDES, predicted_collectives, summarize_collectives, validate_model, validate_plan
from .xlamoves import moves_seconds, without_moves, xla_moves

__all__ = [
    "COLLECTIVE_KINDS",
    "PROPAGATION_NAMES",
    "PropagationPrograms",
    "Replay",
    "ReplayError",
    "ReplayOptions",
    "collective_instructions",
    "collectives_in_hlo",
    "predicted_collectives",
    "propagation_programs",
    "replay_with_shardings",
    "specs_from_strategies",
    "operand_specs_from_strategies",
    "summarize_collectives",
    "time_programs",
    "total_bytes",
    "validate_model",
    "validate_plan",
    "SMALL_OVERRIDES",
    "moves_seconds",
    "without_moves",
    "xla_moves",
]
