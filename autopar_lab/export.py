"""A plan as JAX code a user can paste: the first stage's mesh and the shardings of the step's inputs.

:func:`to_jax_code` emits Python source that defines

- ``mesh``: the stage's logical mesh ``(n0, n1)`` with axes ``("x", "y")`` (mesh axis 0 and 1 of the plan's specs)
  over the first ``n0 * n1`` devices;
- ``param_specs``, ``opt_state_specs``, ``batch_specs``: ``PartitionSpec`` per input leaf, keyed by its pytree path
  as the trace names it (``"args[0]['layers'][0]['qkv']['w']"``), from the strategy of its ``parameter`` operator;
- ``in_shardings_for(*args)``: ``NamedSharding``\\ s with the structure of the step's arguments (concrete arrays or
  ``ShapeDtypeStruct``\\ s), for ``jax.jit(step_fn, in_shardings=in_shardings_for(*args))``.

For a pipelined plan only the first stage is covered (each stage has its own mesh); the code says so.
"""

from __future__ import annotations

from .graph.opgraph import BATCH, INPUT_PRIMITIVE, OPT_STATE, PARAM

AXIS_NAMES = ("x", "y")


def _spec_text(spec) -> str:
    entries = []
    for d in spec.dims:
        names = [AXIS_NAMES[a] for a in d]
        entries.append("None" if not names else repr(names[0]) if len(names) == 1 else repr(tuple(names)))
    return f"P({', '.join(entries)})"


def input_specs(plan, stage: int = 0) -> dict[str, dict[str, object]]:
    """{"param": {path: ShardingSpec}, "opt_state": {...}, "batch": {...}} from one stage's strategies."""
    graph = plan.graph
    intra = plan.stages[stage].intra
    if intra is None:
        raise ValueError("this plan has no per-operator strategies to export")
    if plan.table is not None and plan.table.solve_graph is not graph:
        raise ValueError("this plan was solved on a shallower copy of the model; its input shardings are per layer "
                         "of that copy, not per input of this graph, so they cannot be exported as they are")
    out: dict[str, dict[str, object]] = {PARAM: {}, OPT_STATE: {}, BATCH: {}}
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive != INPUT_PRIMITIVE:
            continue
        t = graph.tensor(node.outputs[0])
        out.setdefault(t.kind, {})[t.path] = intra.strategies[op].out_specs[0]
    return out


def to_jax_code(plan) -> str:
    """Python source building the first stage's mesh, PartitionSpecs and NamedShardings (see the module doc)."""
    st = plan.stages[0]
    n0, n1 = (int(x) for x in st.logical_mesh)
    specs = input_specs(plan, 0)
    lines = [
        f"# autopar-lab plan: {plan.method}, {len(plan.stages)} stage(s), {plan.microbatches} microbatch(es), "
        f"predicted step {plan.cost.step_time_s:.4g} s",
    ]
    if len(plan.stages) > 1:
        lines.append(f"# Only stage 0 (layers {st.layers[0]}..{st.layers[1]}) is shown: each pipeline stage has a "
                     "mesh of its own.")
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
    ]
    return "\n".join(lines)
