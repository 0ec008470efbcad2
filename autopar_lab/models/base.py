"""ModelSpec: what the rest of autopar-lab needs to know about a model, and shared helpers of the zoo.

A model in the zoo is plain JAX: parameters are nested dicts of arrays, the forward pass is a function, and the
training step is ``loss -> jax.grad -> optax update``. ``ModelSpec`` bundles that step with abstract arguments
(``jax.ShapeDtypeStruct`` pytrees built by ``jax.eval_shape``), so a 39B model can be traced and planned without
allocating a byte of it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

LEARNING_RATE = 1e-3  # one fixed Adam learning rate for the whole zoo
FAST_CPU_COMPILE = {"xla_backend_optimization_level": 0}  # for one-off CPU programs (init)


@dataclass(frozen=True, eq=False)  # identity hash: specs can be dict keys / static args
class ModelSpec:
    """A training step and its (abstract) arguments.

    step_fn(params, opt_state, batch) -> (new_params, new_opt_state, loss); loss_fn(params, batch) -> scalar.
    abstract_args = (params, opt_state, batch) as pytrees of jax.ShapeDtypeStruct (never allocated).
    init_fn(seed) -> concrete (params, opt_state, batch); only sensible at small sizes.
    A step of your own: :meth:`from_step` (any arguments, any library; ``loss_fn`` is then None).
    """

    name: str
    family: str
    config: Any
    step_fn: Callable
    loss_fn: Callable
    abstract_args: tuple
    init_fn: Callable
    batch_argnums: tuple = (2,)
    param_argnums: tuple = (0,)
    # The optax optimizer inside step_fn: a pipeline runtime applies it per stage (exact for element-wise ones).
    optimizer: Any = field(default=None, compare=False, repr=False)
    # How to make this model with another number of its repeated layers, every other setting kept: ``copy_fn(n)``.
    # A deep model is planned on such shallow copies (its repeated layers are identical, so a 4-layer trace prices
    # all of them: autopar_lab.pricing.table.solve_graph_for). None for a model without them: a step of your own,
    # a Wide-ResNet (its blocks are not all alike: the widths change from stage to stage). The zoo's families set it.
    copy_fn: Callable[[int], ModelSpec] | None = field(default=None, compare=False, repr=False)
    # How many first layers differ from the repeated ones that follow while every copy of more layers than that keeps
    # them as they are (DeepSeek's dense first layers); 0 when all are alike or a copy may not keep them. The pricing
    # reads a deep model's layer pattern off copies that keep them (autopar_lab.pricing.deepmap).
    lead_layers: int = field(default=0, compare=False, repr=False)

    @classmethod
    def from_step(cls, step_fn: Callable, init_fn: Callable, *, batch_argnums, param_argnums=(0,),
                  name: str = "my-model") -> "ModelSpec":
        """A ModelSpec for a training step of your own, written with any JAX library.

        ``step_fn(*args)`` is one training step: it returns the new value of each argument it updates *in that
        argument's place* (same pytree structure) and a scalar loss, e.g. ``(params, opt_state, batch) -> (params,
        opt_state, loss)``. ``init_fn(seed)`` returns the step's arguments (concrete, deterministic in ``seed``; the
        batch of seed ``i`` is what step ``i`` trains on); tracing and planning use only its shapes
        (``jax.eval_shape``), so nothing is allocated until you run the plan. ``batch_argnums``: which arguments hold
        the batch (split into microbatches along their leading axis); ``param_argnums``: which hold the parameters
        (the other arguments are optimizer or other state). The optimizer needs no naming: a pipeline runs the
        step's own update.

        >>> import jax, jax.numpy as jnp, optax
        >>> opt = optax.sgd(0.1)
        >>> def step(w, s, x):
        ...     loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        ...     u, s = opt.update(g, s, w)
        ...     return optax.apply_updates(w, u), s, loss
        >>> def init(seed):
        ...     w = jax.random.normal(jax.random.key(seed), (4, 2))
        ...     return w, opt.init(w), jnp.ones((8, 4))
        >>> spec = ModelSpec.from_step(step, init, batch_argnums=(2,), name="linear")
        >>> spec.param_count, len(spec.trace().layers)
        (8, 1)
        """
        if not callable(step_fn) or not callable(init_fn):
            raise ValueError("from_step needs the training step and an init function: from_step(step_fn, init_fn, "
                             "batch_argnums=...), with init_fn(seed) returning the step's arguments.")
        try:
            args = jax.eval_shape(lambda: init_fn(0))  # shapes only; the seed stays a Python int
        except Exception as e:  # noqa: BLE001 - the user's function: say what failed, in one sentence
            raise ValueError(f"init_fn(0) failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}); "
                             "init_fn(seed) must return the step's arguments.") from None
        if not isinstance(args, (tuple, list)):
            raise ValueError(f"init_fn(seed) must return the step's arguments as a tuple, got a {type(args).__name__}.")
        args = tuple(args)
        n = len(args)

        def argnums(label, nums):
            nums = (nums,) if isinstance(nums, int) else tuple(nums)
            if not nums or any(not isinstance(i, int) or not 0 <= i < n for i in nums):
                raise ValueError(f"{label}={nums} must name arguments among the {n} that init_fn returns "
                                 f"(0..{n - 1}).")
            return nums

        batch_argnums = argnums("batch_argnums", batch_argnums)
        param_argnums = argnums("param_argnums", param_argnums)
        if set(batch_argnums) & set(param_argnums):
            raise ValueError(f"argument {sorted(set(batch_argnums) & set(param_argnums))[0]} cannot be both batch and "
                             "parameters.")
        try:
            out = jax.eval_shape(step_fn, *args)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"step_fn does not run on init_fn's arguments ({type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0][:200]}).") from None
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        for i in param_argnums:
            if i >= len(outs) or not _same_structure(outs[i], args[i]):
                raise ValueError(f"step_fn must return the new parameters in the place of argument {i} (same pytree "
                                 "structure), e.g. (params, opt_state, batch) -> (params, opt_state, loss).")
        if not any(x.shape == () and jnp.issubdtype(x.dtype, jnp.inexact)
                   for j, o in enumerate(outs) if j >= n or j in batch_argnums
                   or not _same_structure(o, args[j])
                   for x in jax.tree_util.tree_leaves(o)):
            raise ValueError("step_fn must also return the scalar loss (a float scalar, e.g. the last of (params, "
                             "opt_state, loss)).")
        return cls(name=name, family="custom", config=None, step_fn=step_fn, loss_fn=None,  # type: ignore[arg-type]
                   abstract_args=args,
                   init_fn=lambda seed=0: tuple(init_fn(seed)), batch_argnums=batch_argnums,
                   param_argnums=param_argnums)

    @property
    def repeated_layers(self) -> int | None:
        """How many repeated layers the model has when it can be made with another number of them
        (:meth:`with_layers`), else None."""
        if self.copy_fn is None:
            return None
        return getattr(self.config, "num_layers", None)

    def with_layers(self, num_layers: int) -> ModelSpec:
        """This model with ``num_layers`` repeated layers, every other setting kept (its shallow copies); a
        ValueError for a model that has no such copies.

        >>> import autopar_lab as al
        >>> al.models.get("gpt-1.3b").with_layers(4).repeated_layers, al.models.get("wresnet-tiny").repeated_layers
        (4, None)
        """
        if self.copy_fn is None:
            raise ValueError(f"model {self.name!r} has no copies with another number of layers (its layers are not "
                             "all alike, or it is a step of your own); plan it on its own graph.")
        return self.copy_fn(num_layers)

    def init(self, seed: int = 0):
        """Concrete arguments of the step (zoo: (params, opt_state, batch)), deterministic in ``seed``."""
        return self.init_fn(seed)

    @property
    def param_count(self) -> int:
        """Number of trainable parameters, from the abstract shapes."""
        return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(self.abstract_args[0]))

    @property
    def param_bytes(self) -> int:
        return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(self.abstract_args[0]))

    def trace(self, **kwargs):
        """Capture the operator graph of the training step (see autopar_lab.graph.capture.trace)."""
        from autopar_lab.graph.capture import trace
        kwargs.setdefault("name", self.name)
        opt_state_argnums = tuple(i for i in range(len(self.abstract_args))
                                  if i not in self.batch_argnums and i not in self.param_argnums)
        return trace(self.step_fn, *self.abstract_args, batch_argnums=self.batch_argnums,
                     param_argnums=self.param_argnums, opt_state_argnums=opt_state_argnums, **kwargs)

    def __repr__(self):
        n = self.param_count
        size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"
        return f"ModelSpec({self.name!r}, family={self.family!r}, params={size}, config={self.config})"


def make_spec(name: str, family: str, config: Any, init_params: Callable, make_batch: Callable,
              loss_fn: Callable, learning_rate: float = LEARNING_RATE) -> ModelSpec:
    """Build a ModelSpec from init_params(key) -> params, make_batch(key) -> batch and loss_fn(params, batch).

    A half-precision config with ``mixed_precision`` (the zoo's default) trains as Megatron-LM and Alpa did: the
    parameters (and so Adam's moments) are float32 master weights (``init_params`` makes them in
    :func:`param_dtype_of`), and the loss computes with float16/bfloat16 copies made inside each layer's scope
    (:func:`compute_copy`), so the copy belongs to the layer that uses it."""
    opt = optax.adam(learning_rate)

    def step_fn(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def init_all(seed):
        k_params, k_batch = jax.random.split(jax.random.PRNGKey(seed))
        params = init_params(k_params)
        return params, opt.init(params), make_batch(k_batch)

    compiled = {}

    def init_fn(seed: int = 0):
        if isinstance(seed, jax.core.Tracer):  # traced inside another program (runtime.initpart): no jit of its own
            return init_all(seed)
        # One jitted program (eager init would compile a kernel per parameter shape). On CPU, XLA's backend
        # optimisation is switched off for it: random init then compiles ~4x faster and still runs in milliseconds.
        if "init" not in compiled:
            opts = FAST_CPU_COMPILE if jax.default_backend() == "cpu" else None
            compiled["init"] = jax.jit(init_all, compiler_options=opts)
        return compiled["init"](seed)

    abstract_args = tuple(jax.eval_shape(init_all, 0))
    return ModelSpec(name=name, family=family, config=config, step_fn=step_fn, loss_fn=loss_fn,
                     abstract_args=abstract_args, init_fn=init_fn, optimizer=opt)


def _same_structure(a, b) -> bool:
    return bool(jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b))  # type: ignore[operator]


# ---------------------------------------------------------------- small shared pieces (plain JAX)

def dtype_of(config) -> jnp.dtype:
    """The dtype the model computes in."""
    return jnp.dtype(config.dtype)


def param_dtype_of(config) -> jnp.dtype:
    """The dtype its parameters are kept in: float32 master weights for a half-precision model trained in mixed
    precision (``config.mixed_precision``), else the compute dtype."""
    compute = dtype_of(config)
    if getattr(config, "mixed_precision", False) and compute.name in ("float16", "bfloat16"):
        return jnp.dtype("float32")
    return compute


def compute_copy(config, tree):
    """``tree`` (a layer's parameters) in the model's compute dtype: the float16/bfloat16 copy a mixed-precision step
    computes with (unchanged when the parameters already are in it)."""
    compute = dtype_of(config)
    return jax.tree_util.tree_map(lambda p: p.astype(compute) if p.dtype != compute else p, tree)


def normal(key, shape, dtype, std=0.02):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def dense_init(key, n_in, n_out, dtype, std=0.02):
    return {"w": normal(key, (n_in, n_out), dtype, std), "b": jnp.zeros((n_out,), dtype)}


def ln_init(h, dtype):
    return {"scale": jnp.ones((h,), dtype), "bias": jnp.zeros((h,), dtype)}


def layer_norm(p, x, eps=1e-5):
    """LayerNorm over the last axis, statistics in float32."""
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = jnp.square(xf - mean).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return y.astype(x.dtype) * p["scale"] + p["bias"]


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy with integer labels (log-softmax in float32; no one-hot matmul)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def check(cond: bool, msg: str):
    if not cond:
        raise ValueError(msg)


def replace_config(config, **overrides):
    """dataclasses.replace with a clear ValueError for unknown fields."""
    valid = [f.name for f in dataclasses.fields(config)]
    bad = [k for k in overrides if k not in valid]
    if bad:
        raise ValueError(f"unknown config field(s) {', '.join(map(repr, bad))} for {type(config).__name__}; "
                         f"valid fields are: {', '.join(valid)}.")
    return dataclasses.replace(config, **overrides)
