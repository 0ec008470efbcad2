"""The pricing layer: every cost formula that turns decisions into seconds and bytes, in one place.

- :mod:`~autopar_lab.pricing.layers`: an intra-operator plan's cost split by layer; bytes crossing each cut.
- :mod:`~autopar_lab.pricing.stage`: the stage-cost formula (per-microbatch times and memory of a layer range).
- :mod:`~autopar_lab.pricing.table`: :class:`CostTable`, layer costs per logical mesh and stage candidates.
- :mod:`~autopar_lab.pricing.opmap`: :class:`OpMap`, the full graph vs the (shallower) graph a plan was solved on.
- :mod:`~autopar_lab.pricing.price`: :func:`price_stages`, a plan's step time and memory from its decisions.
- :mod:`~autopar_lab.pricing.incremental`: re-pricing one strategy change without pricing every layer again.
- :mod:`~autopar_lab.pricing.kernels`: one device's view of a step (each operator's seconds, alone or fused; the
  kernels with their FLOPs and bytes; a plan's cost by layer), what the roofline notebook reads.
- :mod:`~autopar_lab.pricing.memory`: each stage's peak memory split into parameters, gradients, master weights,
  optimizer state, parameter copies, buffers, the recomputation working set and activations.

Below it: the sharding strategies' own costs (:mod:`autopar_lab.sharding`), the collective formulas
(:mod:`autopar_lab.cluster`), the solvers (:mod:`autopar_lab.solve`), the values it builds
(:mod:`autopar_lab.planvalues`). Above it: the plans (:mod:`autopar_lab.plan`), the planner, overrides, plan files and
the session, which only make decisions and hand them here.
"""

from .incremental import LazyIntraPlan, changed_layer_costs
from .layers import HEAVY_PRIMITIVES, LayerCost, batch_size, cut_bytes, layer_costs
from .memory import PARTS, memory_breakdown
from .opmap import OpMap
from .price import Priced, StageSpec, price_stages, simulate_pipeline, stage_transfers, table_of
from .stage import LAUNCH_OVERHEAD_S, hidden_comm_s, pareto, prefix_sums, stage_cost, task_overhead_s
from .table import (
    CostTable,
    StageBlock,
    as_graph,
    solve_graph_for,
)
from .space import distinct_mesh_shapes, mesh_signature, planning_submeshes, scale_space

__all__ = [
    "CostTable", "HEAVY_PRIMITIVES", "LAUNCH_OVERHEAD_S", "LayerCost", "LazyIntraPlan", "OpMap", "PARTS",
    "StageBlock", "StageSpec", "as_graph", "batch_size", "changed_layer_costs", "cut_bytes", "distinct_mesh_shapes",
    "hidden_comm_s", "layer_costs", "memory_breakdown", "mesh_signature", "pareto", "planning_submeshes", "scale_space",
    "prefix_sums", "price_stages", "Priced",
    "simulate_pipeline", "solve_graph_for", "stage_cost", "stage_transfers", "table_of", "task_overhead_s",
]
