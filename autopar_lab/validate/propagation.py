"""Sharding propagation from a few annotations against the ILP's plan, compiled and run (notebook 06's question 3,
``bench/bench_propagation.py``).

:func:`propagation_programs` compiles one training step four ways on a 2-D mesh of local devices: three from
annotations on the step's inputs alone, which XLA's partitioner (Shardy or GSPMD) propagates through the graph, and
the intra-op ILP's plan applied operator by operator as :func:`~autopar_lab.validate.validate_plan` applies it.
:func:`time_programs` runs compiled programs in interleaved rounds and gives each one's median step.

Usage (on 8 devices: ``JAX_NUM_CPU_DEVICES=8`` before jax is imported)::

    spec = al.models.get("mlp", dtype="float32", **al.validate.SMALL_OVERRIDES["mlp"])
    built = al.validate.propagation_programs(spec, (2, 4))
    medians = al.validate.time_programs(built.programs, spec.init(0), rounds=15)   # name -> seconds

    >>> PROPAGATION_NAMES[-1]
    'ILP plan (compiled)'
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..graph.opgraph import OUTPUT_PRIMITIVE
from .replay import Replay, ReplayOptions, operand_specs_from_strategies, specs_from_strategies

if TYPE_CHECKING:
    from ..cluster import Cluster, LogicalMesh
    from ..graph.opgraph import OpGraph
    from ..models import ModelSpec
    from ..solve.intra import IntraPlan

#: The four programs, in the order :func:`propagation_programs` builds them (and the notebook and benchmark print).
PROPAGATION_NAMES = ("propagated: batch on x*y", "propagated: batch on x, weights on y",
                     "propagated: FSDP annotations", "ILP plan (compiled)")


@dataclass(frozen=True)
class PropagationPrograms:
    """What :func:`propagation_programs` built: ``programs`` (name -> compiled executable, in
    :data:`PROPAGATION_NAMES`' order) and what the ILP's program came from: the model ``spec``, its traced ``graph``,
    the ``cpu`` preset as one host (``cluster``), the logical mesh the ILP solved on (``logical_mesh``), its plan
    (``plan``, an :class:`~autopar_lab.solve.intra.IntraPlan`) and the JAX mesh every program runs on (``mesh``)."""

    programs: dict[str, Any]
    spec: ModelSpec
    graph: OpGraph
    cluster: Cluster
    logical_mesh: LogicalMesh
    plan: IntraPlan
    mesh: jax.sharding.Mesh


def _annotations(spec: ModelSpec, mesh: jax.sharding.Mesh) -> dict[str, tuple]:
    """The three annotated programs' in_shardings: (params, optimizer state, batch) each a pytree of shardings."""
    params, opt_state, batch = spec.abstract_args
    n = mesh.devices.size

    def shardings(tree, rule: Callable[[Any], PartitionSpec]):
        return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, rule(x)), tree)

    def replicated(x):
        return PartitionSpec()

    def columns(x):      # every weight matrix split by columns over y (its Adam moments alike)
        return PartitionSpec(None, "y") if x.ndim == 2 and x.shape[1] % mesh.shape["y"] == 0 else PartitionSpec()

    def fsdp(x):         # every parameter and Adam moment split along its first dimension over all devices
        return PartitionSpec(("x", "y")) if x.ndim and x.shape[0] % n == 0 else PartitionSpec()

    def batch_over(axes):
        return lambda x: PartitionSpec(axes) if x.ndim and x.shape[0] % math.prod(
            mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))) == 0 else PartitionSpec()

    return {
        PROPAGATION_NAMES[0]: (shardings(params, replicated), shardings(opt_state, replicated),
                               shardings(batch, batch_over(("x", "y")))),
        PROPAGATION_NAMES[1]: (shardings(params, columns), shardings(opt_state, columns),
                               shardings(batch, batch_over("x"))),
        PROPAGATION_NAMES[2]: (shardings(params, fsdp), shardings(opt_state, fsdp),
                               shardings(batch, batch_over(("x", "y")))),
    }


def propagation_programs(spec: ModelSpec, mesh_shape: Sequence[int] = (2, 4), *,
                         solver: str = "cbc") -> PropagationPrograms:
    """One training step of ``spec`` (a zoo :class:`~autopar_lab.models.ModelSpec` whose step takes (params,
    optimizer state, batch)) compiled four ways on a ``mesh_shape`` mesh (axes "x", "y") of the first local devices:

    - ``"propagated: batch on x*y"``: the batch split over all devices (``in_shardings``), the rest propagated;
    - ``"propagated: batch on x, weights on y"``: the batch over ``x``, every weight matrix (and its optimizer state)
      split by columns over ``y``;
    - ``"propagated: FSDP annotations"``: the batch over all devices, every parameter and optimizer state split over
      all devices along its first dimension;
    - ``"ILP plan (compiled)"``: :func:`~autopar_lab.solve.intra.solve_intra`'s plan on the ``cpu`` preset as one
      host of that many devices, applied operator by operator as :func:`~autopar_lab.validate.validate_plan` does
      (every operator's outputs pinned, each matmul's operands constrained, updated parameters leaving in their
      inputs' specs). Nothing is donated, so :func:`time_programs` can call each program again on the same inputs.

    A leaf whose dimension the mesh does not divide is replicated. Raises ValueError for a mesh that is not two
    positive sizes or needs more devices than JAX sees."""
    from ..cluster import Cluster
    from ..solve.intra import IntraOptions, solve_intra

    shape = tuple(int(s) for s in mesh_shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"mesh_shape must be two positive sizes such as (2, 4), got {tuple(mesh_shape)!r}.")
    n = shape[0] * shape[1]
    if n > len(jax.devices()):
        raise ValueError(f"a {shape[0]}x{shape[1]} mesh needs {n} devices but JAX sees {len(jax.devices())}; set "
                         f"JAX_NUM_CPU_DEVICES={n} before jax is imported, or ask for a smaller mesh.")
    cluster = Cluster.preset("cpu").with_(devices_per_host=n)
    logical = cluster.logical_mesh((1, n), shape)
    mesh = logical.to_jax_mesh(jax.devices()[:n])
    programs = {name: jax.jit(spec.step_fn, in_shardings=ins).lower(*spec.abstract_args).compile()
                for name, ins in _annotations(spec, mesh).items()}
    graph = spec.trace()
    plan = solve_intra(graph, logical, options=IntraOptions(solver=solver))
    out_specs, output_specs = specs_from_strategies(graph, plan.strategies)
    for node in graph:      # updated parameters leave the step in their inputs' specs, as the cost model assumes
        if node.primitive == OUTPUT_PRIMITIVE and node.params.get("alias_of") is not None:
            output_specs[node.id] = plan.strategies[graph.tensor(node.params["alias_of"]).producer].out_specs[0]
    replay = Replay(graph, spec.step_fn, spec.abstract_args, out_specs, mesh,
                    ReplayOptions(output_specs=output_specs,
                                  operand_specs=operand_specs_from_strategies(graph, plan.strategies)))
    programs[PROPAGATION_NAMES[3]] = replay.jit().lower(*spec.abstract_args).compile()
    return PropagationPrograms(programs=programs, spec=spec, graph=graph, cluster=cluster, logical_mesh=logical,
                               plan=plan, mesh=mesh)


def time_programs(programs: Mapping[str, Any], args: Sequence[Any], rounds: int = 15) -> dict[str, float]:
    """The median seconds of one call of each compiled program in ``programs`` (name -> ``jax.stages.Compiled``)
    on ``args`` (the step's concrete arguments, placed on each program's input shardings here).

    Each program is called once to warm up, then the programs run in turn, round after round, ``rounds`` times: other
    work on a shared machine weighs on all of them alike, and the median keeps a round it disturbed out. Wall times:
    they move with the machine's load, so compare them within one call, as ratios. Raises ValueError for
    ``rounds`` < 1 or no program."""
    if rounds < 1 or not programs:
        raise ValueError(f"time_programs needs at least one program and rounds >= 1 (got {len(programs)} programs, "
                         f"rounds={rounds}).")
    placed = {name: jax.device_put(tuple(args), tuple(exe.input_shardings[0])) for name, exe in programs.items()}
    for name, exe in programs.items():
        jax.block_until_ready(exe(*placed[name]))
    runs: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(rounds):
        for name, exe in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(exe(*placed[name]))
            runs[name].append(time.perf_counter() - t0)
    return {name: statistics.median(r) for name, r in runs.items()}
