"""The cost table: layer costs per logical mesh (one intra-operator ILP each), and stage candidates priced from them.

1. For every logical mesh the stage DP asks about, the intra-operator pass
   (:func:`~autopar_lab.solve.intra.solve_intra`) picks each operator's strategy; each layer's cost is then the sum of
   its operators' costs and of the resharding on the edges into them, split into forward and backward (+ update)
   (:func:`~autopar_lab.pricing.layers.layer_costs`). A zoo model is solved on a copy with fewer layers
   (:func:`solve_graph_for`: its repeated layers are identical, so they get identical strategies and costs):
   planning GPT-39B needs a 4-layer trace per mesh, not a 48-layer one. :class:`~autopar_lab.pricing.opmap.OpMap`
   maps one graph onto the other.
2. A stage's candidates come from :func:`~autopar_lab.pricing.stage.stage_cost` over running sums of those layer
   costs, one layer range at a time (:meth:`CostTable.stage`) or every range of a submesh at once with numpy
   (:class:`StageBlock`), with the same numbers.

A table is a value the user may build once and pass to every planning function (``table=``)::

    >>> table = CostTable.build(al.models.get("gpt-tiny"), cluster)        # doctest: +SKIP
    >>> al.auto_plan(table.graph, cluster, table=table)                     # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..deprecation import renamed_keywords
from ..graph.fusion import attach_kernel_roles
from ..graph.opgraph import OpGraph
from ..solve.ilp import DEFAULT_SOLVER
from ..solve.inter import StageCandidate
from ..solve.intra import IntraPlan, StrategyCache, solve_intra
from .layers import LayerCost, batch_size, cut_bytes, layer_costs
from .opmap import OpMap
from .stage import pareto, prefix_sums, stage_cost, task_overhead_s

if TYPE_CHECKING:
    from ..cluster import Cluster, LogicalMesh

ProgressFn = Callable[[str, int, int], None]


def mesh_signature(mesh: LogicalMesh) -> tuple:
    """What the intra-op pass sees of a logical mesh: each axis' collective profile (size, hosts spanned, link;
    :meth:`~autopar_lab.cluster.LogicalMesh.axis_profile`), the cluster's device.

    A mesh with one split axis is the same problem whichever axis it is: (1, 8) and (8, 1) on one host run the same
    collectives over the same devices, and the ILP finds the same plan with the axis renamed. With both axes split
    the order matters (the sequential solve decides axis 0 first), so it is kept.

    >>> from autopar_lab.cluster import Cluster
    >>> c = Cluster.preset("p3.16xlarge")
    >>> mesh_signature(c.logical_mesh((1, 8), (1, 8))) == mesh_signature(c.logical_mesh((1, 8), (8, 1)))
    True
    >>> mesh_signature(c.logical_mesh((1, 8), (2, 4))) == mesh_signature(c.logical_mesh((1, 8), (4, 2)))
    False
    """
    axes = [mesh.axis_profile(a) for a in (0, 1) if mesh.axis_size(a) > 1]
    return (mesh.cluster.device, tuple(axes))


def distinct_mesh_shapes(cluster: Cluster, submesh: Sequence[int]) -> list[tuple[int, int]]:
    """The submesh's logical mesh shapes, keeping the first of each group with the same :func:`mesh_signature`
    (their layer costs are the same, so the stage DP needs only one and the intra-op pass solves only one).

    >>> from autopar_lab.cluster import Cluster
    >>> distinct_mesh_shapes(Cluster.preset("p3.16xlarge"), (1, 8))
    [(1, 8), (2, 4), (4, 2)]
    """
    out, seen = [], set()
    for shape in cluster.logical_mesh_shapes(submesh):
        sig = mesh_signature(cluster.logical_mesh(submesh, shape))
        if sig not in seen:
            seen.add(sig)
            out.append((int(shape[0]), int(shape[1])))
    return out


def solve_graph_for(model) -> OpGraph | None:
    """A shallower copy of a zoo model whose layers cover every distinct layer of the full model (None when the
    model is not a deep zoo model: it is then solved on its own graph)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "num_layers") or cfg.num_layers <= 4 or \
            getattr(model, "family", "") == "wresnet":
        return None
    from .. import models  # the zoo (and JAX models) load only when a zoo model is planned

    overrides = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "num_layers"}
    small = models.get(model.name, num_layers=4, **overrides)
    return small.trace()


def as_graph(model) -> tuple[OpGraph, Any, float]:
    """(graph, the zoo model or None, seconds spent tracing) for a ModelSpec or an OpGraph."""
    if isinstance(model, OpGraph):
        return model, None, model.trace_s
    graph = model.trace()
    return graph, model, graph.trace_s


class CostTable:
    """Layer costs per logical mesh, computed on demand and cached (the stage DP asks for many).

    ``graph``: the model's graph; ``solve_graph``: the graph the intra-op ILPs run on (a deep zoo model's shallower
    copy; default the graph itself); ``solver``: the ILP solver; ``on_progress(message, done, total)``: called as
    each mesh's ILP finishes. Build one from a model with :meth:`build`.
    """

    @renamed_keywords(progress="on_progress")
    def __init__(self, graph: OpGraph, cluster: Cluster, *, solve_graph: OpGraph | None = None,
                 solver: str = DEFAULT_SOLVER, on_progress: ProgressFn | None = None):
        self.graph = graph
        self.cluster = cluster
        self.layer_names = list(graph.layers) or [""]
        self.solve_graph = solve_graph or graph
        # Every operator's part in its kernel, before any strategy is priced (a plan file re-priced from this
        # table's graph prices its operators in their kernels too).
        attach_kernel_roles(self.solve_graph)
        self.solver = solver
        self.on_progress = on_progress
        self.op_map = OpMap(graph, self.solve_graph)  # raises LookupError when a layer has no counterpart
        self.cut_bytes = cut_bytes(graph, self.layer_names)
        self.batch_size = batch_size(graph)
        self.solve_s = 0.0  # seconds spent in intra-op ILPs so far
        self.trace_s = 0.0  # seconds :meth:`build` spent tracing (0 for a table made from graphs)
        self._mesh: dict[tuple, tuple[list[LayerCost], IntraPlan]] = {}
        self._sums: dict[tuple, dict[str, list[float]]] = {}
        self._shapes: dict[tuple, list] = {}
        self._memo: dict = {}  # solve_intra's first passes, shared by meshes with the same axis 0
        self._caches: dict[tuple, StrategyCache] = {}

    @classmethod
    def build(cls, model, cluster: Cluster, *, solver: str = DEFAULT_SOLVER,
              on_progress: ProgressFn | None = None) -> CostTable:
        """The table of a zoo ModelSpec (traced; a deep one solved on its shallower copy) or of an OpGraph.
        ``trace_s`` holds the seconds spent tracing and choosing the copy. No ILP runs until a mesh is priced."""
        graph, spec, trace_s = as_graph(model)
        t0 = time.perf_counter()
        small = solve_graph_for(spec) if spec is not None else None
        try:
            table = cls(graph, cluster, solve_graph=small, solver=solver, on_progress=on_progress)
        except LookupError:  # the copy lacks some layer's structure: solve the full graph
            table = cls(graph, cluster, solver=solver, on_progress=on_progress)
        table.trace_s = trace_s + (time.perf_counter() - t0)
        return table

    # The session hands a solve's progress hook to the table for the time of that solve.
    @property
    def progress(self) -> ProgressFn | None:
        return self.on_progress

    @progress.setter
    def progress(self, fn: ProgressFn | None) -> None:
        self.on_progress = fn

    # --- the full graph vs the solve graph ----------------------------------------------------------------------------
    @property
    def layer_map(self) -> list[int]:
        """Full-graph layer k is priced as the solve graph's layer ``layer_map[k]`` (see :class:`OpMap`)."""
        return self.op_map.layer_map

    def solve_op(self, op: int) -> int | None:
        """The operator of the solve graph that stands for operator ``op`` of the full graph (see
        :meth:`OpMap.solve_op`). Strategies of a plan solved on a shallower copy are keyed by these ids."""
        return self.op_map.solve_op(op)

    # --- layer costs --------------------------------------------------------------------------------------------------
    def mesh_costs(self, submesh, shape) -> tuple[list[LayerCost], IntraPlan]:
        """(full-graph layer costs, the IntraPlan) of one logical mesh: its ILP solved on first use."""
        key = (tuple(submesh), tuple(shape))
        if key not in self._mesh:
            t0 = time.perf_counter()
            mesh = self.cluster.logical_mesh(submesh, shape)
            plan = solve_intra(self.solve_graph, mesh, solver=self.solver, rounds=1, memo=self._memo)
            small = layer_costs(self.solve_graph, plan, list(self.solve_graph.layers) or [""])
            self._mesh[key] = ([small[k] for k in self.layer_map], plan)
            self.solve_s += time.perf_counter() - t0
            if self.on_progress:
                self.on_progress(f"intra-op {submesh[0]}x{submesh[1]} as {shape[0]}x{shape[1]}", len(self._mesh), 0)
        return self._mesh[key]

    def solved_mesh(self, submesh, shape) -> tuple[list[LayerCost], IntraPlan] | None:
        """:meth:`mesh_costs` if that mesh's ILP has run already, else None (nothing is solved)."""
        return self._mesh.get((tuple(submesh), tuple(shape)))

    def strategy_cache(self, mesh: LogicalMesh) -> StrategyCache:
        """The shared StrategyCache of ``mesh``: strategies and resharding costs are looked up, not recomputed, by
        every override of plans priced by this table."""
        key = (tuple(mesh.submesh), tuple(mesh.shape), getattr(mesh, "first_device", 0))
        if key not in self._caches:
            self._caches[key] = StrategyCache(mesh)
        return self._caches[key]

    def layer_costs_of(self, intra: IntraPlan) -> list[LayerCost]:
        """Full-graph layer costs of any IntraPlan on the solve graph (the table's own entry when it is the
        table's solution of its mesh)."""
        hit = self.solved_mesh(intra.mesh.submesh, intra.mesh.shape)
        if hit is not None and hit[1] is intra:
            return hit[0]
        g = self.solve_graph
        small = layer_costs(g, intra, list(g.layers) or [""], cache=self.strategy_cache(intra.mesh))
        return [small[k] for k in self.layer_map]

    def prefix_sums(self, submesh, shape) -> dict[str, list[float]]:
        """Running sums of the layer costs on one mesh, so any layer range costs O(1) (the DP asks for many)."""
        key = (tuple(submesh), tuple(shape))
        if key not in self._sums:
            costs, _ = self.mesh_costs(submesh, shape)
            self._sums[key] = prefix_sums(costs)
        return self._sums[key]

    # --- stages -------------------------------------------------------------------------------------------------------
    def entry_bytes(self, start: int) -> float:
        """Activation bytes (full batch) entering layer ``start`` (0 for the first layer)."""
        return self.cut_bytes[start - 1] if start > 0 else 0.0

    def task_overhead_s(self, submesh) -> float:
        """Seconds charged per stage task on ``submesh`` (see :func:`~autopar_lab.pricing.stage.task_overhead_s`)."""
        return task_overhead_s(self.cluster, submesh)

    def stage_from_sums(self, sums, start: int, end: int, submesh, shape, microbatches: int, remat: bool,
                        intra: IntraPlan | None = None) -> StageCandidate:
        """The candidate for layers start..end priced from running sums ``sums`` (:func:`prefix_sums`) of some
        layer costs on the ``shape`` view of ``submesh``; ``intra`` rides along as its payload."""
        totals = {f: v[end + 1] - v[start] for f, v in sums.items()}
        fwd, bwd, static, act = stage_cost(totals, self.entry_bytes(start), microbatches, shape[0] * shape[1], remat,
                                           self.task_overhead_s(submesh))
        return StageCandidate((start, end), tuple(submesh), tuple(shape), remat, fwd, bwd, static, act,
                              payload=intra)

    def stage(self, start: int, end: int, submesh, shape, microbatches: int, remat: bool) -> StageCandidate:
        """Layers start..end on the ``shape`` view of ``submesh`` with the table's sharding of that mesh."""
        _, plan = self.mesh_costs(submesh, shape)
        return self.stage_from_sums(self.prefix_sums(submesh, shape), start, end, submesh, shape, microbatches,
                                    remat, plan)

    def mesh_shapes(self, submesh) -> list[tuple[int, int]]:
        """The submesh's distinct logical mesh shapes (:func:`distinct_mesh_shapes`), cached."""
        sub = tuple(submesh)
        if sub not in self._shapes:
            self._shapes[sub] = distinct_mesh_shapes(self.cluster, sub)
        return self._shapes[sub]

    def candidates(self, start: int, end: int, submesh, microbatches: int, remat=(False, True)):
        """The Pareto-optimal stage candidates for layers start..end on a submesh (one per distinct logical mesh
        and remat choice, dominated ones dropped)."""
        sub = tuple(submesh)
        cands = [self.stage(start, end, sub, shape, microbatches, r) for shape in self.mesh_shapes(sub) for r in remat]
        return pareto(cands)

    @renamed_keywords(mem_limit="mem_limit_bytes")
    def candidate_fn(self, microbatches: int, mem_limit_bytes: float | None = None):
        """``candidates`` for one microbatch count as the stage DP calls it, ``(start, end, submesh)``, computed
        for all layer ranges of a submesh at once with numpy; with ``mem_limit_bytes``, candidates that cannot fit
        even holding one microbatch are left out (the DP could never use them). Same candidates, same order, same
        numbers as :meth:`candidates` otherwise.
        """
        blocks: dict[tuple, StageBlock] = {}

        def fn(start, end, submesh):
            sub = tuple(submesh)
            if sub not in blocks:
                blocks[sub] = StageBlock(self, sub, microbatches, mem_limit_bytes)
            return blocks[sub].candidates(start, end)

        return fn


class StageBlock:
    """Every stage candidate of one submesh at one microbatch count, as arrays over (start, end) layers.

    ``keys[f][k, a, b]``: field f (forward s, backward s, static bytes, activation bytes) of the k-th (logical
    mesh, remat) option for layers a..b, from :func:`~autopar_lab.pricing.stage.stage_cost` on arrays (the same
    float operations as :meth:`CostTable.stage`); ``keep[k, a, b]``: the option is Pareto-optimal there (as
    :func:`pareto` decides, ties to the first) and, when a memory limit is given, fits in it while holding one
    microbatch (a candidate that cannot is never usable: a stage holds at least one microbatch and its memory only
    grows with more).
    """

    def __init__(self, table: CostTable, submesh, microbatches: int, mem_limit_bytes: float | None,
                 remat=(False, True)):
        L, B = len(table.layer_names), microbatches
        self.table = table
        self.submesh: tuple[int, int] = (int(submesh[0]), int(submesh[1]))
        self.options = [(shape, r) for shape in table.mesh_shapes(submesh) for r in remat]
        upper = np.triu(np.ones((L, L), dtype=bool))  # start <= end
        entry = np.array([0.0] + list(table.cut_bytes), dtype=float)[:L]  # bytes entering layer a
        task = table.task_overhead_s(submesh)
        fields: list[list[np.ndarray]] = [[], [], [], []]
        for shape, r in self.options:
            sums = {f: np.array(v, dtype=float) for f, v in table.prefix_sums(submesh, shape).items()}
            totals = {f: v[None, 1:] - v[:-1, None] for f, v in sums.items()}  # [a, b] = sums[b + 1] - sums[a]
            costs = stage_cost(totals, entry[:, None], B, shape[0] * shape[1], r, task)
            for out, v in zip(fields, costs):
                out.append(np.where(upper, np.broadcast_to(v, (L, L)), np.inf))
        keys = [np.stack(f) for f in fields]  # (K, L, L) each
        K = len(self.options)
        le = np.ones((K, K, L, L), dtype=bool)  # [j, i]: option j is <= option i on every count
        eq = np.ones((K, K, L, L), dtype=bool)
        for v in keys:
            le &= v[:, None] <= v[None, :]
            eq &= v[:, None] == v[None, :]
        j_before_i = np.tril(np.ones((K, K), dtype=bool), -1).T[:, :, None, None]  # j < i
        not_self = ~np.eye(K, dtype=bool)[:, :, None, None]
        dominated = (le & (~eq | j_before_i) & not_self).any(axis=0)
        keep = ~dominated & upper[None]
        if mem_limit_bytes is not None:
            keep &= keys[2] + keys[3] <= mem_limit_bytes
        self.keys, self.keep = keys, keep

    def candidates(self, start: int, end: int) -> list[StageCandidate]:
        out = []
        for k in np.flatnonzero(self.keep[:, start, end]):
            shape, r = self.options[k]
            _, plan = self.table.mesh_costs(self.submesh, shape)
            f, b, st, a = (float(v[k, start, end]) for v in self.keys)
            out.append(StageCandidate((start, end), self.submesh, shape, r, f, b, st, a, payload=plan))
        return out
