"""autopar-lab: Alpa's automatic parallelization (intra-operator ILP, inter-operator DP), in the open, on JAX.

>>> import autopar_lab as al
>>> model = al.models.get("gpt-tiny")          # doctest: +SKIP
>>> graph = model.trace()                      # doctest: +SKIP
>>> cluster = al.Cluster.preset("p3.16xlarge", hosts=2)   # doctest: +SKIP
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Heavier parts load on first use, so `import autopar_lab` stays quick and a missing optional piece
# (plotting, Ray) never breaks the engine.
_LAZY = {
    # The graph loads JAX (a second of CPU): the command line's usage errors answer before it (python -m autopar_lab
    # imports this package first).
    "OpGraph": ("autopar_lab.graph", "OpGraph"),
    "OpNode": ("autopar_lab.graph", "OpNode"),
    "TraceError": ("autopar_lab.graph", "TraceError"),
    "trace": ("autopar_lab.graph", "trace"),
    "models": ("autopar_lab.models", None),
    "ModelSpec": ("autopar_lab.models.base", "ModelSpec"),
    "Cluster": ("autopar_lab.cluster", "Cluster"),
    "Device": ("autopar_lab.cluster", "Device"),
    "Link": ("autopar_lab.cluster", "Link"),
    "LogicalMesh": ("autopar_lab.cluster", "LogicalMesh"),
    "auto_plan": ("autopar_lab.planner", "auto_plan"),
    "megatron_plan": ("autopar_lab.planner", "megatron_plan"),
    "data_parallel_plan": ("autopar_lab.planner", "data_parallel_plan"),
    "fsdp_plan": ("autopar_lab.layouts", "fsdp_plan"),
    "maxtext_plan": ("autopar_lab.layouts", "maxtext_plan"),
    "compare": ("autopar_lab.planner", "compare"),
    "import_config": ("autopar_lab.frameworks", "import_config"),
    "export_config": ("autopar_lab.frameworks", "export_config"),
    "Plan": ("autopar_lab.plan", "Plan"),
    "Pin": ("autopar_lab.planvalues", "Pin"),
    "save_plan": ("autopar_lab.planfile", "save_plan"),
    "load_plan": ("autopar_lab.planfile", "load_plan"),
    "resolve": ("autopar_lab.pins", "resolve"),
    "CostTable": ("autopar_lab.pricing", "CostTable"),
    "Precision": ("autopar_lab.precision", "Precision"),
    "price_plan": ("autopar_lab.plan", "price_plan"),
    "op_seconds": ("autopar_lab.pricing.kernels", "op_seconds"),
    "kernel_costs": ("autopar_lab.pricing.kernels", "kernel_costs"),
    "KernelCost": ("autopar_lab.pricing.kernels", "KernelCost"),
    "costs_by_layer": ("autopar_lab.pricing.kernels", "costs_by_layer"),
    "solve_intra": ("autopar_lab.solve.intra", "solve_intra"),
    "IntraOptions": ("autopar_lab.solve.intra", "IntraOptions"),
    "pipeline_boundary": ("autopar_lab.graph.markers", "pipeline_boundary"),
    "relayer": ("autopar_lab.graph.relayer", "relayer"),
    "execute": ("autopar_lab.runtime.local", "execute"),
    "launch": ("autopar_lab.runtime.launch", "launch"),
    "RunOptions": ("autopar_lab.runtime.train_entry", "RunOptions"),
    "Session": ("autopar_lab.widgets.session", "Session"),
    "Workbench": ("autopar_lab.widgets.workbench", "Workbench"),
    "Exercise": ("autopar_lab.widgets.exercise", "Exercise"),
    # The pieces the course's notebooks open up (issue 34: the notebooks import nothing but this package). Each is
    # the library's own function or class, under the name below; its docstring says what it does.
    # Pipeline schedules as timelines (GPipe, 1F1B, interleaved, zero-bubble) and their figure. Not `simulate`: the
    # module of that name would shadow the function once imported.
    "simulate_pipeline": ("autopar_lab.simulate", "simulate"),
    "SimOptions": ("autopar_lab.simulate", "SimOptions"),
    "FlexibleGroup": ("autopar_lab.schedules", "FlexibleGroup"),
    "timeline_figure": ("autopar_lab.widgets.views.figures", "timeline_figure"),
    "timeline_series": ("autopar_lab.widgets.views.timeline", "timeline_series"),
    # The sharding strategies of one operator on a logical mesh, the ILP's problem and its solvers.
    "strategies_for": ("autopar_lab.sharding.strategies", "strategies_for"),
    "intra_problem": ("autopar_lab.solve.intra", "build_problem"),
    "solve_ilp": ("autopar_lab.solve.ilp", "solve_ilp"),
    "brute_force_ilp": ("autopar_lab.solve.ilp", "brute_force"),
    # Alpa's stage DP on plain data, its brute-force check, its latency formula; the exhaustive optimum.
    "StageProblem": ("autopar_lab.solve.inter", "StageProblem"),
    "StageCandidate": ("autopar_lab.solve.inter", "StageCandidate"),
    "stage_dp": ("autopar_lab.solve.inter", "stage_dp"),
    "stage_dp_auto": ("autopar_lab.solve.inter", "stage_dp_auto"),
    "brute_force_stages": ("autopar_lab.solve.inter", "brute_force_stages"),
    "pipeline_latency": ("autopar_lab.solve.inter", "pipeline_latency"),
    "NoFeasiblePlanError": ("autopar_lab.solve.inter", "NoFeasiblePlanError"),
    "global_optimum": ("autopar_lab.solve.exhaustive", "global_optimum"),
    # Memory: a plan's peak per stage split into parts (MEMORY_PARTS: the keys that add up to it), one operator's
    # terms as the ILP counts them; a number format by name ("bf16").
    "memory_breakdown": ("autopar_lab.pricing.memory", "memory_breakdown"),
    "MEMORY_PARTS": ("autopar_lab.pricing.memory", "PARTS"),
    "memory_terms": ("autopar_lab.solve.memterms", "memory_terms"),
    "as_precision": ("autopar_lab.precision", "as_precision"),
    # A plan against what XLA compiles (validate_plan, replay_with_shardings, collectives_in_hlo, ...): a namespace,
    # as `models` is, since its pieces are used together.
    "validate": ("autopar_lab.validate", None),
    "shutdown_local_ray": ("autopar_lab.runtime.launch", "shutdown_local_ray"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar_lab' has no attribute {name!r}")


__all__ = [*_LAZY]
