"""The part of ``model.init(seed)`` a process needs, computed alone: a stage's step inputs, a step's batch.

``model.init(seed)`` makes every argument of the step: all parameters, the optimizer state and the batch. A pipeline
stage needs only its own leaves, and a training step only the batch; making everything and keeping a slice held the
whole model in memory (on a Ray stage actor, every actor held it: 9.7 GB for gpt-350m's 4-layer copy, issue 35), and
making a step's batch ran the whole initialisation every step. :func:`init_leaves` runs, inside one jitted program,
only the part of ``model.init`` the leaves asked for depend on (its jaxpr, traced once per model and shared by every
such program, pruned to those leaves: the rest is neither traced again nor compiled; random initialisation draws
each leaf from its own split key: the leaves kept are computed as ``model.init`` computes them), and places them
straight on the devices and shardings asked for, never on one device whole.

A model whose ``init`` cannot be traced with a traced seed (a function of your own that uses the seed as a Python
int) falls back to calling ``model.init(seed)`` and picking the leaves, as before.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import jax
import jax.extend.core as jex_core

from ..models.base import FAST_CPU_COMPILE

__all__ = ["init_leaves", "init_batch"]

# model -> {(leaf indices, shardings): jitted program, (_JAXPR, seed type): its init's jaxpr, _EAGER: whether its
# init refuses a traced seed}; weak, so a spec that goes away takes its programs with it
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNTRACEABLE = (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                jax.errors.TracerArrayConversionError, jax.errors.TracerBoolConversionError, TypeError,
                ValueError)  # flax.nnx and keras refuse a traced seed with a ValueError: their init runs whole
_EAGER, _JAXPR = "eager", "jaxpr"


def _init_jaxpr(model, seed):
    """``model.init``'s leaves as one jaxpr, traced once per model and kind of seed: every program of the model
    (each stage's state, the batch) evaluates the part of it that it keeps, where each traced the whole init again
    (for gpt-tiny at 24 layers, ~3 CPU-s a trace)."""
    aval = jax.typeof(seed)
    key = (_JAXPR, tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)))
    programs = _PROGRAMS.setdefault(model, {})
    if key not in programs:
        programs[key] = jax.make_jaxpr(lambda s: jax.tree_util.tree_leaves(model.init(s)))(seed)
    return programs[key]


def _eval_leaves(closed, seed, index: tuple[int, ...]) -> tuple:
    """Outputs ``index`` of the closed jaxpr ``closed`` at ``seed``, binding only the equations they depend on (the
    rest of the init is not traced into the program at all)."""
    jaxpr = closed.jaxpr
    need = {v for i in index for v in [jaxpr.outvars[i]] if not isinstance(v, jex_core.Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in need for v in eqn.outvars):
            kept.append(eqn)
            need.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, [seed]))

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for eqn in reversed(kept):
        bound = eqn.primitive.get_bind_params(eqn.params)
        # jax before 0.10 returns (subfuns, params); 0.10 the params alone, subfuns inside them (pyproject: jax>=0.6)
        subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
        with eqn.ctx.manager:  # the equation's context, as eval_jaxpr binds it
            ans = eqn.primitive.bind(*subfuns, *map(read, eqn.invars), **params)
        env.update(zip(eqn.outvars, ans if eqn.primitive.multiple_results else [ans]))
    return tuple(read(jaxpr.outvars[i]) for i in index)


def _program(model, index: tuple[int, ...], shardings: tuple | None):
    programs = _PROGRAMS.setdefault(model, {})
    key = (index, shardings)
    if key not in programs:
        def pick(seed):
            return _eval_leaves(_init_jaxpr(model, seed), seed, index)

        # the zoo's init compiles with the same options (models.base): the same code, so the same numbers
        opts = FAST_CPU_COMPILE if jax.default_backend() == "cpu" else None
        programs[key] = jax.jit(pick, out_shardings=shardings, compiler_options=opts)
    return programs[key]


def _traces(model) -> bool:
    """Whether ``model.init`` runs with a traced seed (shapes only, nothing compiled)."""
    try:
        jax.eval_shape(model.init, jax.ShapeDtypeStruct((), "int32"))
    except _UNTRACEABLE:
        return False
    return True


def init_leaves(model, seed: int, index: Sequence[int], shardings: Sequence | None = None) -> list[Any]:
    """Leaves ``index`` (positions in ``jax.tree_util.tree_leaves(model.init(seed))``) of ``model.init(seed)``,
    each computed alone and placed with ``shardings`` (one per leaf; None: where the program leaves them)."""
    index = tuple(int(i) for i in index)
    if not index:
        return []
    sh = None if shardings is None else tuple(shardings)
    if not _PROGRAMS.get(model, {}).get(_EAGER):
        try:
            return list(_program(model, index, sh)(seed))  # traced as the zoo's jitted init traces it
        except _UNTRACEABLE:
            if _traces(model):
                # The init takes a traced seed, so the error is this program's own: falling back hid one (jax's
                # get_bind_params changed), and every stage then computed the whole model, on one device.
                raise
            # Remembered once the init itself is seen to refuse a traced seed: every later call (each stage's state,
            # each step's batch) traced it again up to the same error before running it eagerly.
            _PROGRAMS.setdefault(model, {})[_EAGER] = True
    leaves = jax.tree_util.tree_leaves(model.init(seed))
    picked = [leaves[i] for i in index]
    return picked if sh is None else [jax.device_put(x, s) for x, s in zip(picked, sh)]


def init_batch(model, seed: int):
    """The batch of ``model.init(seed)`` (the batch argument, or a tuple of them), made without the rest."""
    args = model.abstract_args
    first, spans = 0, []
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        spans.append((first, n))
        first += n
    index = [s + j for i in model.batch_argnums for s, n in [spans[i]] for j in range(n)]
    leaves = iter(init_leaves(model, seed, index))
    picked = tuple(jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args[i]),
                                                [next(leaves) for _ in range(spans[i][1])])
                   for i in model.batch_argnums)
    return picked[0] if len(picked) == 1 else picked
