"""User-marked pipeline boundaries: ``al.pipeline_boundary(x)`` inside a step function.

A marker is the identity on a pytree of arrays. It binds one ``pipeline_boundary`` primitive per array leaf, with the
parameter ``index`` = k (0, 1, ... in call order within one trace, shared by every leaf of one call), so the captured
graph (:func:`autopar_lab.trace`) holds one operator per marked array and :func:`autopar_lab.relayer` can cut the
step into layers there: layer ``stage_k`` is what runs between marker ``k-1`` and marker ``k``.

The primitive has every rule JAX needs, so a marked step runs unchanged under ``jit``, ``grad`` and ``vmap``:

- impl / MLIR lowering: the identity (XLA removes it);
- JVP: the identity on primals *and* tangents, the tangent marked too (same ``index``), so that
- transpose: the cotangent is marked with the same ``index``: the backward pass carries a boundary at the same place;
- batching: the identity on the batched value.

Numbering: within one trace (``al.trace``, ``jax.jit``, ``jax.make_jaxpr``), markers are numbered from 0 in the order
they are called. The counter is tied to the outermost JAX trace of the call, so tracing a step twice numbers its
markers the same way both times. A function under an inner ``jax.jit`` that JAX has already traced (and cached) keeps
the indices of that first trace; :func:`autopar_lab.relayer` cuts at the markers' positions, so it does not depend
on the indices being distinct.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def f(x):
    ...     h = jnp.tanh(x)
    ...     h = pipeline_boundary(h)
    ...     return (h * 2).sum()
    >>> float(jax.jit(jax.grad(f))(jnp.zeros(3))[0])
    2.0
    >>> [e.params for e in jax.make_jaxpr(f)(jnp.zeros(3)).jaxpr.eqns if e.primitive.name == "pipeline_boundary"]
    [{'index': 0}]
"""

from __future__ import annotations

import itertools
import weakref

import jax
import jax.extend.core as jex_core
from jax.interpreters import ad, batching, mlir

__all__ = ["pipeline_boundary", "pipeline_boundary_p", "MARKER_PRIMITIVE"]

MARKER_PRIMITIVE = "pipeline_boundary"

pipeline_boundary_p = jex_core.Primitive(MARKER_PRIMITIVE)


def _impl(x, *, index):
    return x


def _abstract_eval(x, *, index):
    return x


def _jvp(primals, tangents, *, index):
    (x,), (t,) = primals, tangents
    y = pipeline_boundary_p.bind(x, index=index)
    if type(t) is ad.Zero:
        return y, t
    return y, pipeline_boundary_p.bind(t, index=index)


def _transpose(ct, x, *, index):
    if type(ct) is ad.Zero:
        return [ct]
    return [pipeline_boundary_p.bind(ct, index=index)]


def _batch(args, dims, *, index):
    (x,), (d,) = args, dims
    return pipeline_boundary_p.bind(x, index=index), d


pipeline_boundary_p.def_impl(_impl)
pipeline_boundary_p.def_abstract_eval(_abstract_eval)
ad.primitive_jvps[pipeline_boundary_p] = _jvp
ad.primitive_transposes[pipeline_boundary_p] = _transpose
batching.primitive_batchers[pipeline_boundary_p] = _batch
mlir.register_lowering(pipeline_boundary_p, mlir.lower_fun(lambda x, **_: x, multiple_results=False))


# --- numbering: one counter per outermost trace ---------------------------------------------------------------------
_counters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_eager = itertools.count()


def _root_trace():
    """The outermost trace the current call runs under (None when running eagerly or when JAX's internals differ)."""
    try:
        from jax._src import core as _core

        t = _core.trace_ctx.trace
    except Exception:  # pragma: no cover - a JAX without trace_ctx: fall back to one process-wide counter
        return None
    root = None
    for _ in range(1000):  # walk out through the transformations (grad, vmap, inner jit) to the outermost trace
        if t is None or type(t).__name__ == "EvalTrace":
            break
        root = t
        t = getattr(t, "parent_trace", None)
    return root


def _next_index() -> int:
    root = _root_trace()
    if root is None:
        return next(_eager)
    try:
        counter = _counters.get(root)
        if counter is None:
            counter = _counters[root] = itertools.count()
    except TypeError:  # not weak-referenceable: one counter per process
        return next(_eager)
    return next(counter)


def pipeline_boundary(tree):
    """Mark a pipeline boundary: return ``tree`` (a pytree of arrays) unchanged, each leaf passed through one
    ``pipeline_boundary`` operator. Call it inside the step function between the parts that should become separate
    pipeline layers (``stage_0`` before the first marker, ``stage_1`` after it, ...); see :func:`autopar_lab.relayer`.

    >>> import jax.numpy as jnp
    >>> pipeline_boundary({"h": jnp.ones(2)})["h"].tolist()
    [1.0, 1.0]
    """
    index = _next_index()
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for leaf in leaves:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            leaf = jax.numpy.asarray(leaf)
        out.append(pipeline_boundary_p.bind(leaf, index=index))
    return jax.tree_util.tree_unflatten(treedef, out)
