"""autopar-lab: Alpa's automatic parallelization (intra-operator ILP, inter-operator DP), in the open, on JAX.

>>> import autopar_lab as al
>>> model = al.models.get("gpt-tiny")          # doctest: +SKIP
>>> graph = model.trace()                      # doctest: +SKIP
>>> cluster = al.Cluster.preset("p3.16xlarge", hosts=2)   # doctest: +SKIP
"""

from __future__ import annotations

import importlib

from .graph import OpGraph, OpNode, TraceError, trace

__version__ = "0.1.0"

# Heavier parts load on first use, so `import autopar_lab` stays quick and a missing optional piece
# (plotting, Ray) never breaks the engine.
_LAZY = {
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
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        mod = importlib.import_module(module)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar_lab' has no attribute {name!r}")


__all__ = ["OpGraph", "OpNode", "TraceError", "trace", *_LAZY]
