"""Predicted against compiled: a zoo model's plan compiled by XLA and run, and the reports comparing the two."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import jax
import numpy as np

from ..graph.opgraph import OUTPUT_PRIMITIVE, OpGraph
from .hlo import COLLECTIVE_KINDS, collectives_in_hlo, total_bytes
from .replay import Replay, ReplayOptions, operand_specs_from_strategies, specs_from_strategies
from .xlamoves import moves_seconds, without_moves, xla_moves

if TYPE_CHECKING:
    from ..cluster import LogicalMesh


def _max_abs_err(a, b) -> float:
    worst = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape:
            raise ValueError(f"sharded and single-device outputs differ in shape: {x.shape} vs {y.shape}")
        if x.size:
            worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))))
    return worst


def validate_model(model_spec, out_specs: Mapping[int, Sequence[Any]], mesh: jax.sharding.Mesh,
                   predicted: Mapping[str, Mapping[str, float]] | None = None, *, graph: OpGraph | None = None,
                   seed: int = 0, run: bool = True, donate_argnums: Sequence[int] = (),
                   replay: ReplayOptions = ReplayOptions()) -> dict:
    """Compile the planned step of ``model_spec`` on ``mesh``, count its collectives, run one step sharded and one
    on a single device, and compare.

    Returns ``{"predicted", "compiled", "bytes_ratio", "numerics_max_abs_err", "num_devices", "compile_s",
    "num_ops"}``: ``compiled`` is :func:`collectives_in_hlo` of the partitioned HLO; ``bytes_ratio`` is predicted
    total bytes / compiled total bytes (None when XLA compiled no collective bytes); ``numerics_max_abs_err`` is
    the largest |sharded - single device| over the outputs' leaves (None with ``run=False``). ``graph`` defaults to
    ``model_spec.trace()``; the concrete arguments are ``model_spec.init(seed)``. ``donate_argnums`` are donated to
    the sharded step (the updated parameters and optimizer state then reuse their inputs' buffers, as in training).
    ``replay`` (:class:`~autopar_lab.validate.replay.ReplayOptions`): what the replay applies besides ``out_specs``
    (the step outputs' specs, contractions' operand specs, operators run another way such as a ring-attention
    matmul's ring, the mesh's axis names).
    """
    graph = model_spec.trace() if graph is None else graph
    replayed = Replay(graph, model_spec.step_fn, model_spec.abstract_args, out_specs, mesh, replay)
    jitted = replayed.jit(donate_argnums=tuple(donate_argnums)) if donate_argnums else replayed.jit()
    t0 = time.perf_counter()
    compiled_exe = jitted.lower(*model_spec.abstract_args).compile()
    compile_s = time.perf_counter() - t0
    compiled = collectives_in_hlo(compiled_exe.as_text())
    predicted = {k: dict(v) for k, v in (predicted or {}).items()}
    comp_total = total_bytes(compiled)
    err = None
    if run:
        args = model_spec.init(seed)
        single = jax.jit(model_spec.step_fn)(*args)
        sharded_args = jax.device_put(tuple(args), replayed.in_shardings)
        sharded = compiled_exe(*sharded_args)
        err = _max_abs_err(sharded, single)
    return {
        "predicted": predicted,
        "compiled": compiled,
        "bytes_ratio": (total_bytes(predicted) / comp_total) if comp_total > 0 else None,
        "numerics_max_abs_err": err,
        "num_devices": int(mesh.devices.size),
        "compile_s": compile_s,
        "num_ops": replayed.ops_walked,
    }


# ----------------------------------------------------------------------------------------------------------------
# An intra-op plan of the solver against what XLA compiles


def predicted_collectives(graph: OpGraph, strategies: Mapping[int, Any], mesh: LogicalMesh) -> list[dict]:
    """Every collective the cost model charges for ``strategies`` on the logical ``mesh``, one record each.

    The same collectives :func:`autopar_lab.solve.intra.evaluate_intra` sums into ``IntraPlan.collectives``: those
    the operators run themselves (on mesh axes of more than one device), and those of every resharding edge
    (producer -> consumer, and updated parameter -> parameter for an output that aliases an input). A record is
    ``{"kind", "axis", "axis_size", "bytes", "hlo_bytes", "source", "op", "consumer", "tensor", "src", "dst"}``:

    - ``bytes`` is the cost model's B (the full buffer along the axis, see :class:`~autopar_lab.cluster.LogicalMesh`);
    - ``hlo_bytes`` is the same collective in the convention of :func:`collectives_in_hlo` (the per-device buffer
      the HLO instruction names): equal to ``bytes`` for all-reduce, all-gather and reduce-scatter, ``bytes / n``
      for an all-to-all over n devices (each device holds one n-th of B before and after);
    - ``source`` is ``"op"`` (the operator ``op`` runs it), ``"reshard"`` (edge ``op`` -> ``consumer`` on
      ``tensor``, from spec ``src`` to ``dst``) or ``"alias"`` (the update read by output ``consumer`` converted
      back to the spec of parameter ``op``).
    """
    from ..sharding.reshard import plan_reshard
    from ..solve.intra import conversion_key

    mshape = tuple(int(n) for n in mesh.shape)
    out: list[dict] = []

    def rec(kind, axis, nbytes, source, op, consumer=None, tensor=None, src=None, dst=None):
        n = int(mesh.axis_size(axis))
        if n <= 1:
            return
        hlo = float(nbytes) / n if kind == "all_to_all" else float(nbytes)
        out.append({"kind": kind, "axis": list(axis) if isinstance(axis, tuple) else axis, "axis_size": n,
                    "bytes": float(nbytes), "hlo_bytes": hlo, "source": source, "op": op, "consumer": consumer,
                    "tensor": tensor, "src": None if src is None else str(src),
                    "dst": None if dst is None else str(dst)})

    ops = list(graph.ops)
    missing = [op for op in ops if op not in strategies]
    if missing:
        raise ValueError(f"the plan has no strategy for operator {graph.op(missing[0]).describe()}; "
                         "pass the strategies of every operator (IntraPlan.strategies of a whole-graph solve).")
    for op in ops:
        for kind, axis, nbytes in strategies[op].collectives:
            rec(kind, axis, nbytes, "op", op)
    converted: set[tuple] = set()
    for v in ops:
        node = graph.op(v)
        for j, t in enumerate(node.inputs):
            u = graph.tensor(t).producer
            if u is None:
                continue
            i = graph.op(u).outputs.index(t)
            src, dst = strategies[u].out_specs[i], strategies[v].in_specs[j]
            info = graph.tensor(t)
            key = conversion_key(graph, u, v, t, src, dst)
            if src != dst and info.shape and key not in converted:
                converted.add(key)  # one conversion serves the consumers conversion_key says (as evaluate_intra)
                for kind, axis, nbytes in plan_reshard(src, dst, info.shape, info.dtype, mshape):
                    rec(kind, axis, nbytes, "reshard", u, v, t, src, dst)
        if node.primitive == OUTPUT_PRIMITIVE and node.params.get("alias_of") is not None:
            p = graph.tensor(node.params["alias_of"]).producer
            assert p is not None  # an alias names a produced tensor
            info = graph.tensor(node.inputs[0])
            src, dst = strategies[v].in_specs[0], strategies[p].out_specs[0]
            if src != dst and info.shape:
                for kind, axis, nbytes in plan_reshard(src, dst, info.shape, info.dtype, mshape):
                    rec(kind, axis, nbytes, "alias", p, v, node.inputs[0], src, dst)
    return out


def summarize_collectives(records: Sequence[Mapping[str, Any]], field: str = "hlo_bytes", *,
                          dedupe: bool = False) -> dict[str, dict[str, float]]:
    """``{kind: {"count", "bytes"}}`` (every kind of :data:`COLLECTIVE_KINDS`) of :func:`predicted_collectives`
    records, bytes taken from ``field``. ``dedupe`` counts once the resharding of one tensor from one spec to the
    same spec for several consumers (XLA computes that value once and every consumer reads it)."""
    acc = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVE_KINDS}
    seen = set()
    for r in records:
        if dedupe and r["source"] == "reshard":
            key = (r["tensor"], r["src"], r["dst"], r["kind"], str(r["axis"]))
            if key in seen:
                continue
            seen.add(key)
        acc[r["kind"]]["count"] += 1
        acc[r["kind"]]["bytes"] += float(r[field])
    return acc


_OVERRIDE_ALIASES = {"layers": "num_layers", "batch": "batch_size"}

#: What ``validate_plan(name, small=True)`` sets (for fields ``overrides`` leaves unset): float32, and sizes that
#: compile and run a step on 8 CPU devices in seconds while the matmuls are still large enough for the solver to
#: split them (on the ``cpu`` preset a collective costs ~0.5 ms of latency, so tiny layers stay replicated).
SMALL_OVERRIDES = {
    "mlp": dict(batch_size=256, input_dim=256, hidden_size=512, num_layers=2, num_classes=64),
    "gpt": dict(batch_size=8, seq_len=64, hidden_size=256, num_layers=2, num_heads=4, vocab_size=512),
    "moe": dict(batch_size=8, seq_len=64, hidden_size=256, num_layers=2, num_heads=4, vocab_size=512,
                num_experts=8, expert_group_size=64),
    "wresnet": dict(batch_size=16, num_layers=14, num_channels=16, width_factor=2, image_size=32, num_classes=16),
}


def _build_model(model, overrides, small: bool):
    from .. import models as zoo
    from ..models.base import ModelSpec

    if isinstance(model, ModelSpec):
        if overrides:
            raise ValueError("overrides apply to a zoo model name; pass the name (e.g. 'gpt-1.3b') or build the "
                             "ModelSpec with the sizes you want.")
        return model
    over: dict[str, Any] = {}
    for k, v in dict(overrides or {}).items():
        if v is not None:
            over[_OVERRIDE_ALIASES.get(str(k), str(k))] = v
    key = str(model).strip().lower()
    if key not in zoo.names():
        raise ValueError(f"unknown model {model!r}; valid names are: {', '.join(zoo.names())}.")
    family = next(f for f in ("gpt", "moe", "wresnet", "mlp") if key in zoo.names(f))
    fields = set(zoo.fields(key))
    unknown = sorted(set(over) - fields)
    if unknown:
        raise ValueError(f"model {key!r} has no field {unknown[0]!r}; its fields are: {', '.join(sorted(fields))}.")
    if small:
        for k, v in SMALL_OVERRIDES[family].items():
            if k in fields:
                over.setdefault(k, v)
    over.setdefault("dtype", "float32")
    return zoo.get(key, **over)


def _parse_mesh_shape(mesh_shape, devices: int) -> tuple[int, int] | None:
    if mesh_shape is None:
        return None
    if isinstance(mesh_shape, str):
        parts = mesh_shape.lower().replace(",", "x").split("x")
        try:
            shape = tuple(int(p) for p in parts)
        except ValueError:
            raise ValueError(f"mesh {mesh_shape!r} is not two numbers like '2x4'; write it as ROWSxCOLS.") from None
    else:
        try:
            shape = tuple(int(p) for p in mesh_shape)
        except (TypeError, ValueError):
            raise ValueError(f"mesh {mesh_shape!r} is not two whole numbers; pass e.g. (2, 4) or '2x4'.") from None
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"mesh {mesh_shape!r} must be two positive numbers like '2x4'.")
    if shape[0] * shape[1] != devices:
        raise ValueError(f"mesh {shape[0]}x{shape[1]} has {shape[0] * shape[1]} devices but --devices is {devices}; "
                         "use a mesh whose two sizes multiply to the device count.")
    return shape


def _check_devices(devices) -> int:
    try:
        n = int(devices)
        ok = n == devices
    except (TypeError, ValueError):
        ok = False
    if not ok or n < 1:
        raise ValueError(f"devices must be a positive whole number, got {devices!r}.")
    if n & (n - 1):
        raise ValueError(f"devices must be a power of two (1, 2, 4, 8, ...), got {n}.")
    have = jax.local_device_count()
    if n > have:
        raise ValueError(f"asked for {n} devices but JAX sees {have}; set JAX_NUM_CPU_DEVICES={n} (before jax is "
                         "imported) or ask for fewer devices.")
    return n


def _plan_report(spec, graph, cluster, shape, devices, solver, run, trace_s) -> dict:
    from ..solve.intra import IntraOptions, solve_intra

    lm = cluster.logical_mesh((1, devices), shape)
    t0 = time.perf_counter()
    plan = solve_intra(graph, lm, options=IntraOptions(solver=solver))
    solve_s = time.perf_counter() - t0
    records = predicted_collectives(graph, plan.strategies, lm)
    out_specs, output_specs = specs_from_strategies(graph, plan.strategies)
    # Faithful to the cost model's aliasing: an updated parameter (or optimizer state) leaves the step in the spec
    # its input came in, so the next step can take it as is (the model charges that conversion to this step).
    for node in graph:
        if node.primitive == OUTPUT_PRIMITIVE and node.params.get("alias_of") is not None:
            p = graph.tensor(node.params["alias_of"]).producer
            output_specs[node.id] = plan.strategies[p].out_specs[0]
    donate = tuple(i for i in range(len(spec.abstract_args)) if i not in spec.batch_argnums)
    from ..runtime.ring import ring_binds

    mesh = lm.to_jax_mesh(jax.devices()[:devices])
    replay = ReplayOptions(output_specs=output_specs, operand_specs=operand_specs_from_strategies(graph,
                                                                                                 plan.strategies),
                           binds=ring_binds(graph, plan.strategies, mesh))  # ring attention runs as the plan's ring
    rep = validate_model(spec, out_specs, mesh, None, graph=graph, run=run, donate_argnums=donate, replay=replay)
    predicted = summarize_collectives(records)
    dedup = summarize_collectives(records, dedupe=True)
    moves = xla_moves(graph, plan.strategies, records, shape)
    compiled = rep["compiled"]
    comp_total = total_bytes(compiled)
    ratio = (lambda pred: total_bytes(pred) / comp_total if comp_total > 0 else
             (1.0 if total_bytes(pred) == 0 else None))
    return {
        "model": spec.name,
        "devices": devices,
        "logical_mesh": list(shape),
        "predicted": predicted,
        "compiled": compiled,
        "bytes_ratio": ratio(predicted),
        "predicted_dedup": dedup,
        "bytes_ratio_dedup": ratio(dedup),
        "predicted_model": {k: dict(v) for k, v in plan.collectives.items()},
        "xla_moves": [dict(m, op_name=graph.op(m["op"]).describe()) for m in moves],
        "predicted_xla": summarize_collectives(without_moves(records, moves)),
        "bytes_ratio_xla": ratio(summarize_collectives(without_moves(records, moves))),
        "xla_moves_s": moves_seconds(moves, lm),
        "numerics_max_abs_err": rep["numerics_max_abs_err"],
        "predicted_step_s": plan.total_s,
        "predicted_comm_s": plan.comm_s + plan.reshard_s,
        "solve_s": solve_s,
        "compile_s": rep["compile_s"],
        "trace_s": trace_s,
        "num_ops": len(graph),
    }


def validate_plan(model, devices: int = 8, mesh_shape=None, overrides: Mapping[str, Any] | None = None,
                  solver: str = "cbc", *, small: bool = True, run: bool = True) -> dict:
    """Solve the intra-op plan of a model on ``devices`` local devices, compile it with XLA, run one step, compare.

    ``model`` is a zoo name (built float32; with ``small=True`` the fields ``overrides`` leaves unset
    take :data:`SMALL_OVERRIDES`, sizes that compile in seconds on CPU; ``overrides`` may say ``layers`` / ``batch``
    for ``num_layers`` / ``batch_size``) or a :class:`~autopar_lab.models.ModelSpec`. The cluster is the ``cpu``
    preset as one host of ``devices`` devices; the logical mesh views that (1, devices) submesh as ``mesh_shape``
    ((2, 4) or "2x4"). Without ``mesh_shape`` both (devices, 1) and (2, devices / 2) are solved and validated; the
    report is that of the mesh with the lower predicted step time, and ``meshes`` holds every mesh's report.

    The strategies of :func:`autopar_lab.solve.intra.solve_intra` are applied with :func:`specs_from_strategies`
    (every operator's outputs pinned, each matmul's operands constrained to its strategy's input specs, parameters'
    ``in_shardings`` from their specs, updated parameters and optimizer state leaving in their inputs' specs,
    donated), and :func:`validate_model` compiles and runs the step.

    Returns a JSON-ready dict: model, devices, logical_mesh, predicted and compiled ``{kind: {count, bytes}}`` (bytes
    per device buffer, see :func:`predicted_collectives`), bytes_ratio (predicted / compiled total; 1.0 when both
    are zero), predicted_dedup / bytes_ratio_dedup (a value resharded alike for several consumers counted once, as
    XLA does), predicted_model (``IntraPlan.collectives`` as the cost model states it), xla_moves / predicted_xla /
    bytes_ratio_xla / xla_moves_s (the conversions XLA's partitioner moves across their reader, the prediction
    with them moved, and the seconds the plan's price charges for what XLA does not move:
    :mod:`~autopar_lab.validate.xlamoves`), numerics_max_abs_err,
    predicted_step_s, predicted_comm_s, solve_s, compile_s, trace_s, num_ops. Bad input raises ValueError.
    """
    from ..cluster import Cluster

    devices = _check_devices(devices)
    shape = _parse_mesh_shape(mesh_shape, devices)
    if solver not in ("cbc", "highs"):
        raise ValueError(f"solver must be 'cbc' or 'highs', got {solver!r}.")
    spec = _build_model(model, overrides, small)
    cluster = Cluster.preset("cpu").with_(devices_per_host=devices)
    allowed = cluster.logical_mesh_shapes((1, devices))
    if shape is not None and shape not in allowed:
        raise ValueError(f"mesh {shape[0]}x{shape[1]} is not a logical view of 1 host x {devices} devices; "
                         f"use one of {', '.join(f'{a}x{b}' for a, b in allowed)}.")
    t0 = time.perf_counter()
    graph = spec.trace()
    trace_s = time.perf_counter() - t0
    shapes = [shape] if shape is not None else list(dict.fromkeys(
        s for s in ((devices, 1), (min(2, devices), devices // min(2, devices))) if s in allowed))
    reports = [_plan_report(spec, graph, cluster, s, devices, solver, run, trace_s) for s in shapes]
    best = min(reports, key=lambda r: r["predicted_step_s"])
    if len(reports) > 1:
        best = dict(best, meshes=reports)
    return best
