"""A plan as JAX code a user can paste: the first stage's mesh and the shardings of the step's inputs.

:func:`to_jax_code` emits Python source that defines

- ``mesh``: the stage's logical mesh ``(n0, n1)`` with axes ``("x", "y")`` (mesh axis 0 and 1 of the plan's specs)
  over the first ``n0 * n1`` devices;
- ``param_specs``, ``opt_state_specs``, ``batch_specs``: ``PartitionSpec`` per input leaf, keyed by its pytree path
  as the trace names it (``"args[0]['layers'][0]['qkv']['w']"``), from the strategy of its ``parameter`` operator;
- ``in_shardings_for(*args)``: ``NamedSharding``\\ s with the structure of the step's arguments (concrete arrays or
  ``ShapeDtypeStruct``\\ s), for ``jax.jit(step_fn, in_shardings=in_shardings_for(*args))``;
- ``activation_specs`` and ``constrain(x, key)``: the sharding constraints of the stage's forward matmuls (the
  activations users put ``jax.lax.with_sharding_constraint`` on), keyed by layer, scope and shape, e.g.
  ``"layer_0/attn dot_general#2 -> (8, 16, 96)"``; ``constrain(x, key)`` applies one inside the user's step;
- ``remat`` (the stage's recomputation: ``"none"``, ``"selective"``, ``"dots"``, ``"selective-op"`` or ``"full"``) and
  ``checkpointed(fn)``: ``fn`` under ``jax.checkpoint`` as the plan recomputes it (full: everything; selective: a
  policy that saves every value the backward reads but the attention internals, the batched matmuls and what reads
  the scores; dots: JAX's ``dots_saveable`` policy; selective-op: the same, which keeps the outputs of the matmuls
  torchtitan's policy recomputes too).

Its header comment names the plan's number format (:mod:`autopar_lab.precision`); the code sets shardings only.

A pipelined plan has a mesh per stage: ``to_jax_code(plan, stage=k)`` writes stage ``k``'s (default 0).
"""

from __future__ import annotations

import re
from typing import Any

from .graph.attention import attention_internals
from .graph.opgraph import BATCH, INPUT_PRIMITIVE, OPT_STATE, PARAM
from .planvalues import layer_scoped
from .precision import TRACED
from .rematmode import remat_label

AXIS_NAMES = ("x", "y")


#: What makes a comment on a file's first two lines a PEP 263 encoding declaration (``# coding: utf-16``): Python
#: would then decode the whole saved file with it (https://peps.python.org/pep-0263/).
_CODING_COOKIE = re.compile(r"coding([:=])")


def _comment_text(text) -> str:
    """``text`` for the inside of a ``#`` comment: as it is when it is one printable line, else its repr (which
    escapes line breaks and every other control character), so it cannot end the comment and start code; and with a
    space before the ``:`` or ``=`` of any ``coding:``, so it cannot declare the file's encoding either."""
    text = str(text)
    return _CODING_COOKIE.sub(r"coding \1", text if text.isprintable() else repr(text))


def _spec_text(spec) -> str:
    entries = []
    for d in spec.dims:
        names = [AXIS_NAMES[a] for a in d]
        entries.append("None" if not names else repr(names[0]) if len(names) == 1 else repr(tuple(names)))
    return f"P({', '.join(entries)})"


def strategy_lookup(plan, intra):
    """op of the plan's graph -> its strategy in ``intra``, or None. A plan solved on a shallower copy of a deep model
    keys its strategies by the copy's operators: each of the model's operators takes the one at its place in the
    layer that priced it (:meth:`autopar_lab.pricing.OpMap.solve_op`), or its own pin when its layer is split from
    the others (a "layer" scope in ``plan.pins``)."""
    table = plan.table
    if table is None or table.solve_graph is plan.graph:
        return intra.strategies.get
    cache = table.strategy_cache(intra.mesh)
    own = layer_scoped(plan.pins)  # an operator of a layer split from its group runs its own strategy

    def strategy(op):
        stand_in = table.op_map.solve_op(op)
        if stand_in is None:
            return None
        if op in own:
            hit = [s for s in cache.strategies(table.solve_graph.op(stand_in)) if s.name == own[op]]
            if hit:
                return hit[0]
        return intra.strategies.get(stand_in)

    return strategy


def input_specs(plan, stage: int = 0) -> dict[str, dict[str, object]]:
    """{"param": {path: ShardingSpec}, "opt_state": {...}, "batch": {...}} from one stage's strategies."""
    graph = plan.graph
    intra = plan.stages[stage].intra
    if intra is None:
        raise ValueError("this plan has no per-operator strategies to export")
    strategy = strategy_lookup(plan, intra)
    out: dict[str, dict[str, object]] = {PARAM: {}, OPT_STATE: {}, BATCH: {}}
    missing = []
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive != INPUT_PRIMITIVE:
            continue
        t = graph.tensor(node.outputs[0])
        s = strategy(op)
        if s is None:
            missing.append(t.path)
            continue
        out.setdefault(t.kind, {})[t.path] = s.out_specs[0]
    if missing:
        raise ValueError(f"{len(missing)} input(s) of this graph have no strategy in the plan (first: {missing[0]}); "
                         "was the plan made for another model?")
    return out


def _forward_matmuls(plan, stage: int):
    """``(key, op, strategy)`` of the forward matmuls one stage runs, in graph order (keys as
    :func:`activation_specs` writes them)."""
    graph = plan.graph
    intra = plan.stages[stage].intra
    if intra is None:
        raise ValueError("this plan has no per-operator strategies to export")
    strategy = strategy_lookup(plan, intra)
    names = {plan.layer_names[i] for a, b in plan.stages[stage].layer_ranges for i in range(a, b + 1)}
    seen: dict[str, int] = {}
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive != "dot_general" or node.role != "forward":
            continue
        if node.layer is not None and node.layer not in names:
            continue
        s = strategy(op)
        if s is None:
            continue
        where = node.scope or node.layer or "(no scope)"
        i = seen[where] = seen.get(where, -1) + 1
        yield f"{where} dot_general#{i} -> {tuple(node.out_shapes[0])}", op, s


def activation_specs(plan, stage: int = 0) -> dict[str, object]:
    """{key: ShardingSpec} of the forward matmuls' outputs that one stage runs, in graph order.

    Keys name where the value is (its layer and scope, the primitive with its index in that scope, the output shape),
    so a user can find the line of their model it belongs to.
    """
    return {key: s.out_specs[0] for key, _op, s in _forward_matmuls(plan, stage)}


def ring_matmuls(plan, stage: int = 0) -> dict[str, tuple[Any, int, tuple]]:
    """{key: (strategy, rotated operand, dimension numbers)} of the forward matmuls one stage runs as rings (context
    parallelism; keys as :func:`activation_specs`). Their backward needs no entry: ``jax.grad`` of a ring is a
    ring."""
    from .runtime.ring import rotated_operand
    from .sharding.ring import is_ring

    g = plan.graph
    out = {}
    for key, op, s in _forward_matmuls(plan, stage):
        if is_ring(s):
            (lc, rc), (lb, rb) = g.op(op).params["dimension_numbers"]
            dn = ((tuple(map(int, lc)), tuple(map(int, rc))), (tuple(map(int, lb)), tuple(map(int, rb))))
            out[key] = (s, rotated_operand(s, dn, g.op(op).in_shapes), dn)
    return out


def _ring_lines(plan, stage: int) -> list[str]:
    """``ring_matmuls``, :func:`~autopar_lab.runtime.ring.ring_dot_general` (its source, as the library runs it)
    and ``ring_dot(key, lhs, rhs)``; nothing for a stage without ring matmuls."""
    import inspect

    from .runtime.ring import ring_dot_general
    from .sharding.ring import ring_axes_used

    rings = ring_matmuls(plan, stage)
    if not rings:
        return []
    axes = sorted({AXIS_NAMES[a] for s, _r, _dn in rings.values() for a in ring_axes_used(s)})
    lines = [
        "",
        "",
        f"# Context parallel (ring attention) over {'+'.join(axes)}: {len(rings)} forward attention matmul(s) run as "
        "rings. Inside",
        "# your step write y = ring_dot(KEY, lhs, rhs) where that dot_general was (its operands in the traced "
        "order, see",
        "# dimension_numbers; jax.grad's backward of a ring is a ring).",
        "ring_matmuls = {",
    ]
    for key, (s, rotate, dn) in rings.items():
        ins = ", ".join(_spec_text(x) for x in s.in_specs)
        lines.append(f"    {key!r}: dict(dimension_numbers={dn!r}, in_specs=({ins}), "
                     f"out_spec={_spec_text(s.out_specs[0])}, axis={AXIS_NAMES[ring_axes_used(s)[0]]!r}, "
                     f"rotate={int(rotate)}),")
    lines += ["}", "", ""]
    lines += inspect.getsource(ring_dot_general).rstrip("\n").split("\n")
    lines += [
        "",
        "",
        "def ring_dot(key, lhs, rhs, preferred_element_type=None):",
        "    return ring_dot_general(lhs, rhs, mesh=mesh, preferred_element_type=preferred_element_type,",
        "                            **ring_matmuls[key])",
    ]
    return lines


def _parallelism_notes(plan, stage: int) -> list[str]:
    """Comment lines naming the stage's ZeRO-3 / FSDP parameters, sequence-parallel regions and expert-parallel MoE
    layers (the specs below and the activation constraints say them; jit inserts the gathers, reduce-scatters and
    all-to-alls they imply)."""
    from .parallelism import expert_parallel, fsdp_params, seqpar_regions

    out = []
    experts = [e for e in expert_parallel(plan, stage).get(stage, []) if e.axes]
    if experts:
        axes = sorted({"+".join(AXIS_NAMES[a] for a in e.axes) for e in experts})
        degrees = "/".join(str(d) for d in sorted({e.degree for e in experts}))
        out.append(f"# Expert parallel EP={degrees} over {', '.join(axes)}: the experts of {len(experts)} MoE layer(s) "
                   "stored split along the expert dimension (param_specs); jit inserts the token all-to-alls.")
    gathered = fsdp_params(plan, stage).get(stage, [])
    if gathered:
        axes = sorted({AXIS_NAMES[a] for p in gathered for a in p.axes})
        out.append(f"# ZeRO-3/FSDP: {len(gathered)} parameter(s) stored sharded over {'+'.join(axes)} (param_specs), "
                   "all-gathered where read, in forward and again in backward.")
    regions = seqpar_regions(plan, stage).get(stage, [])
    if regions:
        axes = sorted({AXIS_NAMES[a] for r in regions for a in r.axes})
        out.append(f"# Sequence parallel over {'+'.join(axes)}: {len(regions)} region(s) split along the sequence "
                   "between a reduce-scatter and an all-gather (activation_specs).")
    return out + ([""] if out else [])


def score_shapes(plan) -> list[tuple[int, ...]]:
    """The attention scores' shapes less their leading (batch) dimension, e.g. ``[(heads, s, s)]``: what the
    selective policy of :func:`to_jax_code` recognises (a microbatch changes only the leading dimension)."""
    g = plan.graph
    out = {tuple(int(d) for d in g.op(op).out_shapes[0][1:]) for op in attention_internals(g)
           if g.op(op).primitive == "dot_general"}
    return sorted(out)


def _remat_lines(plan, stage: int) -> list[str]:
    mode = remat_label(plan.stages[stage].remat)
    shapes = score_shapes(plan)
    return [
        "",
        "",
        f"# Recomputation on this stage: {mode!r}. Wrap each layer's function: layer = checkpointed(layer).",
        f"remat = {mode!r}",
        f"_score_shapes = {repr(set(shapes)) if shapes else 'set()'}  # attention scores, less the batch dimension",
        "",
        "",
        "def _selective_policy(prim, *args, **params):",
        '    """Save what the backward reads but the attention internals: batched matmuls, what reads the scores."""',
        "    if prim.name == 'dot_general' and params['dimension_numbers'][1][0]:",
        "        return False",
        "    return not any(tuple(getattr(a, 'shape', ()))[1:] in _score_shapes for a in args)",
        "",
        "",
        "def checkpointed(fn):",
        "    if remat == 'full':",
        "        return jax.checkpoint(fn)",
        "    if remat == 'selective':",
        "        return jax.checkpoint(fn, policy=_selective_policy)",
        "    # selective-op (torchtitan's op SAC) keeps every other matmul's output; JAX's stateless policies cannot",
        "    # count matmuls: it is written as the dots policy (every matmul's output kept)",
        "    if remat in ('dots', 'selective-op'):  # keep the matmuls' outputs, recompute the rest",
        "        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_saveable)",
        "    return fn",
        "",
    ]


def to_jax_code(plan, stage: int = 0) -> str:
    """Python source building one stage's mesh, PartitionSpecs, NamedShardings and the sharding constraints of its
    forward matmuls (see the module doc)."""
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < len(plan.stages):
        raise ValueError(f"stage must be a stage index 0..{len(plan.stages) - 1} of this plan, got {stage!r:.40}")
    st = plan.stages[stage]
    n0, n1 = (int(x) for x in st.logical_mesh)
    specs = input_specs(plan, stage)
    acts = activation_specs(plan, stage)
    # Every value below is an int, a float formatted as a number, a repr() (a closed string literal) or
    # _comment_text (one printable line): no string of a plan, however hostile, can leave its comment or literal.
    lines = [
        f"# autopar-lab plan: {_comment_text(plan.method)}, {len(plan.stages)} stage(s), {int(plan.microbatches)} "
        f"microbatch(es), predicted step {float(plan.cost.step_time_s):.4g} s",
    ]
    fmt = plan.precision
    lines.append(f"# Number format: {_comment_text(fmt.describe())}"
                 + ("" if fmt.name == TRACED or plan.op_graph.__dict__.get("precision") is None else
                    ": the plan is priced in it; these shardings do not set it (compute in it in your step)."))
    if len(plan.stages) > 1:
        where = ", ".join(f"{int(x)}..{int(y)}" for x, y in st.layer_ranges)  # an interleaved stage: its chunks
        lines.append(f"# Stage {stage} (layers {where}) of {len(plan.stages)}: each "
                     "pipeline stage has a mesh of its own (to_jax_code(plan, stage=k) writes stage k).")
    lines += [
        "import jax",
        "import numpy as np",
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P",
        "",
        f"_devices = jax.devices()[:{n0 * n1}]",
        "try:",
        "    from jax.sharding import AxisType",
        f"    mesh = jax.make_mesh(({n0}, {n1}), {AXIS_NAMES!r}, axis_types=(AxisType.Auto,) * 2, devices=_devices)",
        "except (ImportError, TypeError):  # an older JAX: no axis types",
        f"    mesh = Mesh(np.array(_devices).reshape(({n0}, {n1})), {AXIS_NAMES!r})",
        "",
    ]
    lines += _parallelism_notes(plan, stage)
    for var, kind in (("param_specs", PARAM), ("opt_state_specs", OPT_STATE), ("batch_specs", BATCH)):
        lines.append(f"{var} = {{")
        for path, spec in specs.get(kind, {}).items():
            lines.append(f"    {path!r}: {_spec_text(spec)},")
        lines.append("}")
    lines += [
        "_specs = {**param_specs, **opt_state_specs, **batch_specs}",
        "param_shardings = {k: NamedSharding(mesh, v) for k, v in param_specs.items()}",
        "batch_shardings = {k: NamedSharding(mesh, v) for k, v in batch_specs.items()}",
        "",
        "",
        "def in_shardings_for(*args):",
        '    """NamedShardings shaped like the step\'s arguments, for jax.jit(step_fn, in_shardings=...)."""',
        "    def one(i, arg):",
        "        return jax.tree_util.tree_map_with_path(",
        "            lambda path, _: NamedSharding(mesh, _specs.get(f'args[{i}]' + jax.tree_util.keystr(path), P())),",
        "            arg)",
        "    return tuple(one(i, a) for i, a in enumerate(args))",
        "",
        "",
        "# The plan's sharding of each forward matmul's output: inside your step, write",
        "# x = constrain(x, KEY) where that value is computed (XLA propagates the rest).",
        "activation_specs = {",
    ]
    lines += [f"    {key!r}: {_spec_text(spec)}," for key, spec in acts.items()]
    lines += [
        "}",
        "",
        "",
        "def constrain(x, key):",
        "    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, activation_specs[key]))",
    ]
    lines += _ring_lines(plan, stage)
    lines += _remat_lines(plan, stage)
    return "\n".join(lines)
