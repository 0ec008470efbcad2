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

import copy
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from ..backends import one_program_grads_bytes, one_program_share, program_rereads_s, update_copies_bytes
from ..cluster.values import NodeLimit
from ..graph.capture import deferred_trace
from ..graph.fusion import attach_kernel_roles
from ..graph.opgraph import OpGraph
from ..lazy import Lazy
from ..precision import Precision, as_precision, check_device, precision_of, retype
from ..rematmode import REMAT_CHOICES
from ..solve.ilp import DEFAULT_SOLVER
from ..solve.inter import StageCandidate
from ..solve.intra import IntraPlan, StrategyCache
from .blocks import StageBlock, StageCandidates, carried_blocks
from .deepmap import DEEPER, EDGE, SHALLOW, DeepMap, derive
from .layers import LayerCost, batch_size, cut_bytes, layer_costs
from .opmap import OpMap
from .stage import (is_running_sum, pareto, prefix_sums, range_edges, range_max, running_keys, stage_cost,
                    task_overhead_s)
from .incremental import LazyIntraPlan
from .space import SPACES, distinct_mesh_shapes, lean_everywhere, mesh_signature, planning_submeshes, scale_space
from .table_pool import LEAN, MeshPool, default_workers, longest_first, mesh_key, mesh_tasks, solve_one

if TYPE_CHECKING:
    from ..cluster import Cluster, LogicalMesh

ProgressFn = Callable[[str, int, int], None]
#: Keys to solve next once a mesh's ILP has arrived (see :meth:`CostTable.collect`).
FollowFn = Callable[[tuple], list]


#: How :meth:`CostTable.build` gets a deep zoo model's graph: "auto" (derived from shallow copies where they
#: follow the pattern, :mod:`~autopar_lab.pricing.deepmap`, the full graph traced when first read), "full" (traced).
TRACE_MODES = ("auto", "full")
#: :meth:`CostTable.layer_costs_of` keeps the layer costs of this many recent IntraPlans (not the table's own).
INTRA_COSTS_KEPT = 32
#: :meth:`CostTable.solve_meshes` starts worker processes only for at least this many meshes.
POOL_MIN_MESHES = 16
#: A mesh's solutions the stage DP may choose from: the fastest (the time-only ILP) and the memory-lean one
#: (:func:`~autopar_lab.pricing.table_pool.lean_pins`), priced where the table has solved it.
SOLUTIONS = ("fast", LEAN)
#: When a table solves lean solutions (:attr:`CostTable.lean`): "auto" (where the fast solution cannot hold one of
#: the model's layers, and everywhere when the DP finds no plan without them), "all" (every planned mesh), "off".
LEAN_MODES = ("auto", "all", "off")


def planned_on_copies(model) -> bool:
    """Whether ``model`` is planned on shallower copies of itself: it can be made with another number of its
    repeated layers (``ModelSpec.with_layers``; the zoo's families say so) and has more than a copy's 4."""
    depth = getattr(model, "repeated_layers", None)
    return depth is not None and depth > SHALLOW


def solve_graph_for(model) -> OpGraph | None:
    """A shallower copy of a model whose layers cover every distinct layer of the full model (None when the model is
    not planned on copies, :func:`planned_on_copies`: it is then solved on its own graph)."""
    if not planned_on_copies(model):
        return None
    return model.with_layers(SHALLOW).trace()


def deferred_graph(model, small: OpGraph, fit: Callable[[OpGraph], OpGraph] | None = None
                   ) -> tuple[OpGraph, DeepMap | None]:
    """(the full graph of the deep zoo model ``model``, traced when first read
    (:func:`~autopar_lab.graph.capture.deferred_trace`), its :class:`DeepMap`) when its
    layer names, layer map and cut bytes can be derived from ``small`` (its 4-layer copy) and its 6-layer copy
    (:func:`~autopar_lab.pricing.deepmap.derive`); else (its full trace, None). ``fit``: what every traced graph
    goes through (a number format, :func:`~autopar_lab.precision.retype`), as ``small`` did."""
    def traced(spec) -> OpGraph:
        graph = spec.trace()
        return graph if fit is None else fit(graph)

    # Lead layers beyond the pattern's edge (DeepSeek-V3's 3 dense ones): the pattern is read off copies that
    # are deeper by the excess, still far shallower than the model (7 and 9 layers against 61).
    extra = max(0, getattr(model, "lead_layers", 0) - EDGE)
    base = (lambda: traced(model.with_layers(SHALLOW + extra))) if extra else None
    deep = derive(model.repeated_layers, small, lambda: traced(model.with_layers(DEEPER + extra)),
                  lead=getattr(model, "lead_layers", 0), trace_base=base)
    if deep is None:
        return traced(model), None
    # the number format is answered without the trace, as the name and layers are
    known = {"precision": small.precision} if small.__dict__.get("precision") is not None else {}
    return deferred_trace(lambda: traced(model), name=model.name, layers=deep.layer_names, **known), deep


def as_graph(model) -> tuple[OpGraph, Any, float]:
    """(graph, the zoo model or None, seconds spent tracing) for a ModelSpec or an OpGraph."""
    if isinstance(model, OpGraph):
        return model, None, model.trace_s
    graph = model.trace()
    return graph, model, graph.trace_s


def with_routing(cluster: Cluster, model) -> Cluster:
    """``cluster`` with the node limit of ``model``'s expert routing (:attr:`Cluster.moe_routing`, from a zoo
    model's config: :meth:`NodeLimit.of <autopar_lab.cluster.values.NodeLimit.of>`), so that every mesh of its
    table prices the token exchange with it; ``cluster`` itself for a model without one, or an OpGraph (a graph does
    not say how it routes)."""
    limit = NodeLimit.of(getattr(model, "config", None))
    return cluster if limit is None or cluster.moe_routing is not None else cluster.with_(moe_routing=limit)


def _fitter(fmt: Precision) -> Callable[[OpGraph], OpGraph]:
    return lambda graph: retype(graph, fmt)


class CostTable:
    """Layer costs per logical mesh, computed on demand and cached (the stage DP asks for many).

    ``graph``: the model's graph; ``solve_graph``: the graph the intra-op ILPs run on (a deep zoo model's shallower
    copy; default the graph itself); ``solver``: the ILP solver; ``on_progress(message, done, total)``: called as
    each mesh's ILP finishes; ``space``: the submeshes the stage DP searches (:func:`planning_submeshes`);
    ``lean``: where the planner adds each mesh's memory-lean solution beside its fastest (:data:`LEAN_MODES`, see
    :meth:`lean_meshes`). Build one from a model with :meth:`build`.
    """

    def __init__(self, graph: OpGraph, cluster: Cluster, *, solve_graph: OpGraph | None = None,
                 solver: str = DEFAULT_SOLVER, on_progress: ProgressFn | None = None, space: str = "auto",
                 lean: str = "auto", deep: DeepMap | None = None):
        if space not in SPACES:
            raise ValueError(f"space must be one of {SPACES}, got {space!r}")
        if lean not in LEAN_MODES:
            raise ValueError(f"lean must be one of {LEAN_MODES}, got {lean!r}")
        self.lean = lean
        self.graph = graph
        self.cluster = cluster
        self.space = space
        self.solve_graph = solve_graph or graph
        if deep is not None and solve_graph is None:
            raise ValueError("deep= goes with the solve graph it was derived from (solve_graph=)")
        # A deep zoo model's names, layer map and cut bytes derived from its shallow copies (``deep``): its full
        # graph is not read here, and may not be traced yet (graph.capture.deferred_trace).
        self.layer_names = list(deep.layer_names) if deep is not None else list(graph.layers) or [""]
        # The number format is the graph's (CostTable.build retypes it); a device without its matmul rate refuses.
        check_device(self.precision, cluster.device)
        # Every operator's part in its kernel, before any strategy is priced (a plan file re-priced from this
        # table's graph prices its operators in their kernels too).
        attach_kernel_roles(self.solve_graph, eager=not cluster.device.efficiency.kernel_fusion)
        self.solver = solver
        self.on_progress = on_progress
        # raises LookupError when a layer has no counterpart
        self.op_map = OpMap(graph, self.solve_graph, layer_map=None if deep is None else deep.layer_map)
        self.cut_bytes = cut_bytes(graph, self.layer_names) if deep is None else list(deep.cut_bytes)
        self.batch_size = batch_size(graph if deep is None else self.solve_graph)  # a copy keeps the batch
        self.solve_s = 0.0  # seconds spent in intra-op ILPs so far
        self.trace_s = 0.0  # seconds :meth:`build` spent tracing (0 for a table made from graphs)
        self._mesh: dict[tuple, tuple[list[LayerCost], IntraPlan | None]] = {}
        self._sums: dict[tuple, dict[str, list[float]]] = {}
        self._arrays: dict[tuple, dict[str, np.ndarray]] = {}  # the same sums as arrays
        self._totals: dict[tuple, dict[str, np.ndarray]] = {}  # range_totals, per mesh, solution and ranges
        self._shapes: dict[tuple, list] = {}
        self._memo: dict = {}  # solve_intra's first passes, shared by meshes with the same axis 0
        self._caches: dict[tuple, StrategyCache] = {}
        self._intra_costs: dict[int, tuple[IntraPlan, list[LayerCost]]] = {}  # layer_costs_of's recent answers
        self._memo_space: dict[str, list] = {}
        self._choices: dict[tuple, np.ndarray] = {}  # every solved mesh's strategy index per operator
        self._ahead: MeshPool | None = None  # meshes being solved since build (workers=), not collected yet
        self._spare: dict[tuple, tuple] = {}  # lean solutions solved ahead, not asked for yet (see _drain)
        #: Stage blocks kept for later searches, by (submesh, microbatches, memory limit, grid) (blocks.cached_block).
        self.stage_blocks: dict[tuple, StageBlock] = {}
        #: The mesh keys :meth:`for_cluster` carried over from the table it was made from (empty otherwise).
        self.kept_meshes: frozenset[tuple] = frozenset()

    @property
    def precision(self) -> Precision:
        """The number format the table prices: its solve graph's (:func:`~autopar_lab.precision.precision_of`)."""
        return precision_of(self.solve_graph)

    @classmethod
    def build(cls, model, cluster: Cluster, *, solver: str = DEFAULT_SOLVER,
              on_progress: ProgressFn | None = None, space: str = "auto", workers: int = 0,
              lean: str = "auto", trace: str = "auto", precision: str | Precision | None = None) -> CostTable:
        """The table of a zoo ModelSpec (traced; a deep one solved on its shallower copy) or of an OpGraph.
        ``trace_s`` holds the seconds spent tracing and choosing the copy. A deep zoo model's full graph is not
        traced here with ``trace="auto"``: its layer names, layer map and cut bytes come from its 4- and 6-layer
        copies (:mod:`~autopar_lab.pricing.deepmap`, checked, else the full trace) and ``graph`` is a
        :func:`~autopar_lab.graph.capture.deferred_trace`: traced when first read; ``trace="full"`` traces it here.
        No ILP runs until a mesh is priced, unless ``workers`` (> 1) is given: a deep zoo model's shallow copy is
        then traced first and that many worker processes start solving every planned mesh
        (:meth:`planned_meshes`, from ``POOL_MIN_MESHES`` meshes on) while the rest is traced; :meth:`solve_meshes`
        (or the first mesh priced) collects them, with the same numbers as solving them then. ``lean``: see the
        class. ``precision``: the number format to price (a name of :data:`~autopar_lab.precision.NAMES` or a
        :class:`~autopar_lab.precision.Precision`): every graph traced here is retyped to it
        (:func:`~autopar_lab.precision.retype`); None: the model's own (as traced, or as ``model``, a graph, was
        retyped)."""
        fit = None if precision is None else _fitter(as_precision(precision))
        cluster = with_routing(cluster, model)
        if lean not in LEAN_MODES:
            raise ValueError(f"lean must be one of {LEAN_MODES}, got {lean!r}")
        if trace not in TRACE_MODES:
            raise ValueError(f"trace must be one of {TRACE_MODES}, got {trace!r}")
        kw: dict[str, Any] = dict(solver=solver, on_progress=on_progress, space=space)
        t0 = time.perf_counter()
        if isinstance(model, OpGraph) or not planned_on_copies(model):
            graph, _, trace_s = as_graph(model)
            t0 = time.perf_counter() - trace_s
            table = cls(graph if fit is None else fit(graph), cluster, **kw)
        else:
            small = solve_graph_for(model)
            assert small is not None
            if fit is not None:
                small = fit(small)
                check_device(precision_of(small), cluster.device)  # before any worker starts
            pool = cls._start_pool(small, cluster, solver, space, workers, lean) if workers > 1 else None
            try:
                graph, deep = deferred_graph(model, small, fit) if trace == "auto" else \
                    (model.trace() if fit is None else fit(model.trace()), None)
                table, fell_back = cls._with_copy(graph, small, deep, cluster, kw)
            except BaseException:
                if pool is not None:
                    pool.close()
                raise
            if fell_back and pool is not None:  # the pool solves the copy's meshes, which the table does not use
                pool.close()
                pool = None
            table._ahead = pool
            if pool is not None:  # its workers wait for more meshes until closed: closed with the table at the latest
                weakref.finalize(table, pool.close)
        table.trace_s = time.perf_counter() - t0
        table.lean = lean
        return table

    @classmethod
    def _with_copy(cls, graph: OpGraph, small: OpGraph, deep: DeepMap | None, cluster: Cluster,
                   kw: dict) -> tuple[CostTable, bool]:
        """(the table of ``graph`` solved on its copy ``small``, False), or (solved on ``graph`` itself, True) when
        the copy lacks some layer's structure."""
        try:
            return cls(graph, cluster, solve_graph=small, deep=deep, **kw), False
        except LookupError:
            if isinstance(graph, Lazy):
                graph.fill_now()
            return cls(graph, cluster, **kw), True

    @staticmethod
    def _start_pool(small: OpGraph, cluster: Cluster, solver: str, space: str, workers: int,
                    lean: str) -> MeshPool | None:
        """Worker processes solving every planned mesh of the copy ``small`` (None below ``POOL_MIN_MESHES``), and
        each one's lean solution with it where the table will want them all (:func:`lean_everywhere`; kept aside
        until asked for, :meth:`_drain`)."""
        keys = [(sub, shape) for sub in planning_submeshes(cluster, batch_size(small), space)
                for shape in distinct_mesh_shapes(cluster, sub, space)]
        if len(keys) < POOL_MIN_MESHES:
            return None
        keys = longest_first(keys)  # as solve_meshes does
        if lean_everywhere(cluster, space, lean):
            keys = [k for key in keys for k in (mesh_key(key), mesh_key((*key, LEAN)))]
        return MeshPool(small, cluster, solver, keys, workers)

    def collect(self, follow: FollowFn | None = None) -> int:
        """Collect the meshes that :meth:`build`'s workers solve (waiting for them; ``on_progress`` sees each with
        their total); a no-op without them. ``follow(key)``: more keys to hand the same workers once ``key``
        arrives (:meth:`solve_planned`: its lean solution). A progress hook that raises stops the workers (the
        meshes not collected are solved when next needed). Returns how many were collected."""
        pool, self._ahead = self._ahead, None
        if pool is None:
            return 0
        return self._drain(pool, follow)

    def _drain(self, pool: MeshPool, follow: FollowFn | None, asked: Iterable[tuple] = ()) -> int:
        """Store every mesh ``pool`` solves as it arrives, handing it the keys ``follow`` asks for; close it. A lean
        solution neither in ``asked`` nor asked by ``follow`` (solved ahead beside its fast one) is kept aside
        until it is (:meth:`_take_spare`): the table holds the solutions it was asked for, as without workers."""
        t0, n = time.perf_counter(), 0
        asked = set(asked)
        try:
            for n, (key, small, choice, _s) in enumerate(pool.results(), 1):
                if key in self._mesh:
                    pass
                elif len(key) > 2 and key not in asked:
                    self._spare[key] = (small, choice)
                else:
                    self._store(key, small, None)
                    self._choices[key] = choice
                    more = [k for k in follow(key) if k not in self._mesh] if follow else []
                    asked.update(more)
                    more = [k for k in more if not self._take_spare(k) and k not in pool.keys]
                    if more:
                        pool.add(more)
                self._report(key, n, len(pool.keys))
        finally:
            pool.close()
            self.solve_s += time.perf_counter() - t0
        return n

    def _take_spare(self, key) -> bool:
        """Store the solution ``key`` if a worker solved it ahead (:meth:`_drain`); whether it did."""
        got = self._spare.pop(key, None)
        if got is None:
            return False
        self._store(key, got[0], None)
        self._choices[key] = got[1]
        return True

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
    def mesh_costs(self, submesh, shape, solution: str = "fast") -> tuple[list[LayerCost], IntraPlan]:
        """(full-graph layer costs, the IntraPlan) of one logical mesh: its ILP solved on first use. ``solution``:
        "fast" (the time-only ILP) or "lean" (:func:`~autopar_lab.pricing.table_pool.lean_pins`)."""
        key = self.key(submesh, shape, solution)
        if key not in self._mesh and self._ahead is not None and key in self._ahead.keys:
            self.collect()
        if key not in self._mesh and not self._take_spare(key):
            t0 = time.perf_counter()
            small, plan, self._choices[key] = solve_one(self.solve_graph, self.cluster, key, self.solver, self._memo)
            self._store(key, small, plan)
            self.solve_s += time.perf_counter() - t0
            self._report(key, len(self._mesh), 0)
        costs, stored = self._mesh[key]
        if stored is None:  # solved in a worker process (or for another cluster): the plan from its strategy indices,
            # rebuilt when first read (most payloads are not)
            stored = LazyIntraPlan.from_choice(self.solve_graph, self.cluster, key, self._choices[key])
            self._mesh[key] = (costs, stored)
        return costs, stored

    def solved_mesh(self, submesh, shape, solution: str = "fast") -> tuple[list[LayerCost], IntraPlan] | None:
        """:meth:`mesh_costs` if that mesh's ILP has run already, else None (nothing is solved)."""
        key = self.key(submesh, shape, solution)
        return self.mesh_costs(submesh, shape, solution) if key in self._mesh else None

    @staticmethod
    def key(submesh, shape, solution: str = "fast") -> tuple:
        """The table's key of one solution of a mesh (see :func:`~autopar_lab.pricing.table_pool.mesh_key`)."""
        if solution not in SOLUTIONS:
            raise ValueError(f"solution must be one of {SOLUTIONS}, got {solution!r}")
        return mesh_key((submesh, shape, solution))

    def solutions(self, submesh, shape) -> tuple[str, ...]:
        """The solutions of a mesh the stage DP chooses from: "fast", and "lean" once solved (:meth:`solve_lean`)
        when it differs from the fast one (on one device, or where the fast one is already lean, it does not)."""
        lean = self.key(submesh, shape, LEAN)
        if lean not in self._choices:
            return ("fast",)
        fast = self._choices.get(self.key(submesh, shape))
        return ("fast",) if fast is not None and np.array_equal(fast, self._choices[lean]) else ("fast", LEAN)

    def lean_meshes(self, mem_limit_bytes: float, microbatches: int) -> list[tuple]:
        """The planned meshes whose lean solution can matter to the stage DP under ``mem_limit_bytes`` (per
        device), by :attr:`lean`: "all": every one; "off": none; "auto": those on which the fast solution cannot
        hold some single layer as a stage (with ``microbatches``, the most the DP tries, and rematerialised: its
        least memory), so that every layer range including it is out of reach there; in the "scale" space
        (:func:`scale_space`) every one. A stage always holds a layer,
        and planning a model that fits replicated (GPT-39B on A100s) solves no lean ILP at all; where the fast
        solution holds every layer but not the ranges a pipeline needs, the planner asks again for every mesh when
        the DP finds no plan (:meth:`solve_lean`)."""
        return [k for k in self.planned_meshes() if self.lean_wanted(k, mem_limit_bytes, microbatches)]

    def lean_wanted(self, key, mem_limit_bytes: float, microbatches: int) -> bool:
        """Whether :meth:`lean_meshes` picks the mesh ``key`` ((submesh, shape)): by this mesh's fast layer costs
        alone (solved on first use), so a table can decide as each mesh's fast ILP arrives."""
        if self.lean != "auto":
            return self.lean == "all"
        if lean_everywhere(self.cluster, self.space, self.lean):
            # At this size every layer alone fits somewhere fast, but the ranges a pipeline needs do not: Llama 3
            # 405B on 2,048 DGX H100 hosts solved no lean ILP by the rule below, and the one plan that fitted was a
            # single stage on 16,384 devices, 1,000 times slower than a pipeline (issue 36). Every mesh, then.
            return True
        sub, shape = key[0], key[1]
        L = len(self.layer_names)
        entry = np.array([0.0] + list(self.cut_bytes), dtype=float)[:L]
        sums = self.prefix_arrays(sub, shape)
        single = {f: v[1:] - v[:-1] for f, v in sums.items() if is_running_sum(f)}  # layer k alone
        single.update(range_edges(sums, np.arange(L), np.arange(L)))
        task = self.task_overhead_s(sub)
        least = np.full(L, np.inf)
        for remat in (False, True):
            _, _, static, act = stage_cost(single, entry, microbatches, shape[0] * shape[1], remat, task)
            least = np.minimum(least, static + act)
        return bool((least > mem_limit_bytes).any())

    def lean_solved(self) -> list[tuple]:
        """The (submesh, shape) of every mesh whose lean solution has been solved (or collected)."""
        return [k[:2] for k in self._mesh if len(k) > 2]

    def solve_lean(self, keys=None, *, workers: int | None = None) -> int:
        """Solve the lean solutions of ``keys`` ((submesh, shape) pairs; default every planned mesh) not solved yet,
        as :meth:`solve_meshes` does (in worker processes from ``POOL_MIN_MESHES`` meshes on). The stage
        candidates built afterwards include them (:meth:`solutions`). Returns how many were solved."""
        keys = self.planned_meshes() if keys is None else keys
        return self.solve_meshes([self.key(a, b, LEAN) for a, b in keys], workers=workers)

    def planned_meshes(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Every (submesh, logical mesh) the stage DP prices: the distinct views of each planning submesh."""
        return [(sub, shape) for sub in self.submeshes() for shape in self.mesh_shapes(sub)]

    def solve_planned(self, mem_limit_bytes: float, microbatches: int, *, workers: int | None = None) -> int:
        """Every planned mesh's ILP (:meth:`solve_meshes`) and the lean ones :meth:`lean_meshes` picks for
        ``mem_limit_bytes`` and ``microbatches``, the same meshes as the two calls one after the other; but with
        worker processes a mesh's lean ILP is handed to the same workers as soon as its fast one arrives (it needs
        only that mesh's layer costs), so they go on from the fast ILPs to the lean ones without a second pool to
        start or a wait for the slowest fast ILP (1T on 3,072 GPUs: 144 fast, then 122 lean). Returns how many
        were solved or collected."""
        def follow(key) -> list[tuple]:
            return [self.key(key[0], key[1], LEAN)] if len(key) == 2 and \
                self.lean_wanted(key, mem_limit_bytes, microbatches) else []

        n = self.collect(follow) + self.solve_meshes(workers=workers, follow=follow)
        return n + self.solve_lean(self.lean_meshes(mem_limit_bytes, microbatches), workers=workers)

    def solve_meshes(self, keys=None, *, workers: int | None = None, follow: FollowFn | None = None) -> int:
        """Solve now the ILPs of ``keys`` ((submesh, shape) pairs; default :meth:`planned_meshes`) not solved yet,
        in ``workers`` processes (default :func:`~autopar_lab.pricing.table_pool.default_workers`; 1: here, one after
        the other). Worker processes start only for at least ``POOL_MIN_MESHES`` meshes (starting one costs an
        import of the library, a few seconds). ``on_progress`` sees each mesh as it finishes, with the count done and
        the total; the same numbers as solving each on first use. ``follow``: as in :meth:`collect`, with worker
        processes only; but where it asks for every lean solution (:func:`lean_everywhere`) each mesh's lean ILP is
        solved right after its fast one, on the same StrategyCache, here or in a worker. Returns how many were
        solved (or collected from :meth:`build`'s workers)."""
        collected = self.collect(follow)
        todo = [k for k in (self.planned_meshes() if keys is None else [mesh_key(k) for k in keys])
                if k not in self._mesh]
        ahead = len(todo)
        todo = [k for k in todo if not self._take_spare(k)]
        collected += ahead - len(todo)
        workers = default_workers() if workers is None else max(1, int(workers))
        if workers == 1 or len(todo) < POOL_MIN_MESHES:
            keys = self._with_lean(todo, follow)
            n = 0
            for task in mesh_tasks(keys):  # a mesh's fast and lean solutions share its StrategyCache
                cache = StrategyCache(self.cluster.logical_mesh(task[0][0], task[0][1]))
                for key in task:
                    n += 1
                    t0 = time.perf_counter()
                    small, plan, choice = solve_one(self.solve_graph, self.cluster, key, self.solver, self._memo, cache)
                    self._store(key, small, plan)
                    self._choices[key] = choice
                    self.solve_s += time.perf_counter() - t0
                    self._report(key, n, len(keys))
            return collected + len(keys)
        todo = longest_first(todo)  # so that the workers finish together
        pool = MeshPool(self.solve_graph, self.cluster, self.solver, self._with_lean(todo, follow),
                        min(workers, len(todo)))
        return collected + self._drain(pool, follow, asked=todo)

    def _with_lean(self, todo: list[tuple], follow: FollowFn | None) -> list[tuple]:
        """``todo`` and, where ``follow`` will ask for every fast mesh's lean solution (:func:`lean_everywhere`),
        each one's lean key right after it (not solved yet), to solve on the fast one's StrategyCache."""
        if follow is None or not lean_everywhere(self.cluster, self.space, self.lean):
            return todo
        return [k for key in todo for k in ((key, mesh_key((*key, LEAN))) if len(key) == 2 else (key,))
                if k == key or (k not in self._mesh and not self._take_spare(k))]

    def for_cluster(self, cluster: Cluster) -> CostTable:
        """The same model's table on another cluster (a what-if): the traces, the operator map and the cut bytes are
        shared, nothing is traced again, and every mesh already solved whose ILP the change cannot alter carries
        over: a mesh the new cluster has with the same :func:`mesh_signature` (the device and each axis' collective
        profile: size, hosts spanned, bottleneck link, latencies), since that is all a mesh's ILP and layer costs
        read of the cluster (its plan is rebuilt for the new cluster from the strategy indices when asked). So a
        host count keeps every mesh of a submesh both clusters have; an inter-host bandwidth keeps the meshes inside
        one host; an intra-host bandwidth keeps the meshes whose split axes all cross hosts. :attr:`kept_meshes`
        lists the keys carried over. The number format is the table's (an FP8 one refused on a device without an FP8
        rate)."""
        check_device(self.precision, cluster.device)
        self.collect()  # the workers' meshes belong to this table's cluster
        new = copy.copy(self)
        new.cluster = cluster
        new.solve_s, new.trace_s = 0.0, 0.0
        new._caches, new._memo_space, new._totals, new._intra_costs = {}, {}, {}, {}
        same = (cluster.device == self.cluster.device and cluster.intra_host == self.cluster.intra_host
                and cluster.inter_host == self.cluster.inter_host
                and cluster.devices_per_host == self.cluster.devices_per_host
                and (cluster.domain_hosts, cluster.torus, cluster.mesh_peers)
                == (self.cluster.domain_hosts, self.cluster.torus, self.cluster.mesh_peers))
        subs = {tuple(s) for s in cluster.submesh_shapes()}
        sigs: dict[tuple, bool] = {}  # (submesh, shape) -> the mesh's ILP is the same problem on both clusters

        def unchanged(key) -> bool:
            mesh = key[:2]
            if mesh not in sigs:
                sigs[mesh] = same or mesh_signature(self.cluster.logical_mesh(*mesh)) == \
                    mesh_signature(cluster.logical_mesh(*mesh))
            return sigs[mesh]

        keep = [k for k in self._mesh if k[0] in subs and k in self._choices and unchanged(k)]
        new.kept_meshes = frozenset(keep)
        new._mesh = {k: (self._mesh[k][0], None) for k in keep}
        new._choices = {k: self._choices[k] for k in keep}
        new._spare = {k: v for k, v in self._spare.items() if k[0] in subs and unchanged(k)}
        new._sums = {k: v for k, v in self._sums.items() if k in new._mesh}
        new._arrays = {k: v for k, v in self._arrays.items() if k in new._mesh}
        # Which views of a submesh are distinct depends on the links, and which are searched on the host count
        # (scale_space): kept only when both are the same.
        same_views = same and scale_space(cluster, self.space) == scale_space(self.cluster, self.space)
        new._shapes = {k: v for k, v in self._shapes.items() if k in subs} if same_views else {}
        # First passes are keyed by axis 0's collective profile, not by the device: kept with the same device.
        new._memo = dict(self._memo) if cluster.device == self.cluster.device else {}
        # The stage blocks of submeshes whose meshes all carried over (the same numbers, blocks.carried_blocks).
        new.stage_blocks = carried_blocks(self, new)
        return new

    def _store(self, key, small: list[LayerCost], plan: IntraPlan | None) -> None:
        self._mesh[key] = ([small[k] for k in self.layer_map], plan)

    def _report(self, key, done: int, total: int) -> None:
        if self.on_progress:
            sub, shape = key[0], key[1]
            lean = " (lean)" if len(key) > 2 else ""
            self.on_progress(f"intra-op {sub[0]}x{sub[1]} as {shape[0]}x{shape[1]}{lean}", done, total)

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
        for solution in SOLUTIONS:
            hit = self.solved_mesh(intra.mesh.submesh, intra.mesh.shape, solution)
            if hit is not None and hit[1] is intra:
                return hit[0]
        # A caller pricing one IntraPlan several times (each stage of a pipeline sharing it, each microbatch count
        # tried) gets its costs once: kept by identity (the entry holds the plan, so its id stays its own), the
        # last INTRA_COSTS_KEPT plans only.
        kept = self._intra_costs.get(id(intra))
        if kept is not None and kept[0] is intra:
            small = kept[1]
        else:
            g = self.solve_graph
            small = layer_costs(g, intra, list(g.layers) or [""], cache=self.strategy_cache(intra.mesh))
            if len(self._intra_costs) >= INTRA_COSTS_KEPT:
                del self._intra_costs[next(iter(self._intra_costs))]
            self._intra_costs[id(intra)] = (intra, small)
        return [small[k] for k in self.layer_map]

    def prefix_sums(self, submesh, shape, solution: str = "fast") -> dict[str, list[float]]:
        """Running sums of the layer costs on one mesh, so any layer range costs O(1) (the DP asks for many)."""
        key = self.key(submesh, shape, solution)
        if key not in self._sums:
            costs = self._mesh[key][0] if key in self._mesh else self.mesh_costs(submesh, shape, solution)[0]
            self._sums[key] = prefix_sums(costs)
        return self._sums[key]

    def range_totals(self, submesh, shape, solution: str, rows: np.ndarray, cols: np.ndarray) -> dict[str, np.ndarray]:
        """Each running sum's total over layers ``rows[a]..cols[b]`` on one mesh (``(len(rows), len(cols))`` arrays,
        ``sums[b + 1] - sums[a]``), with the backward programs' re-reads (``rereads_s``): what :class:`StageBlock`
        prices its candidates from. They do not depend on the microbatch count, so every count's blocks share them
        (kept until the table moves to another cluster, whose links the re-reads read)."""
        key = (self.key(submesh, shape, solution), rows.tobytes(), cols.tobytes())
        if key not in self._totals:
            sums = self.prefix_arrays(submesh, shape, solution)
            totals = {f: v[None, cols + 1] - v[rows, None] for f, v in sums.items()  # sums[b+1] - sums[a]
                      if is_running_sum(f)}
            self.backend_totals(totals, sums, rows[:, None], cols[None, :])
            self._totals[key] = totals
        return self._totals[key]

    def prefix_arrays(self, submesh, shape, solution: str = "fast") -> dict[str, np.ndarray]:
        """:meth:`prefix_sums` as float arrays, kept (every microbatch count's :class:`StageBlock` reads them)."""
        key = self.key(submesh, shape, solution)
        if key not in self._arrays:
            self._arrays[key] = {f: np.array(v, dtype=float)
                                 for f, v in self.prefix_sums(submesh, shape, solution).items()}
        return self._arrays[key]

    # --- stages -------------------------------------------------------------------------------------------------------
    def entry_bytes(self, start: int) -> float:
        """Activation bytes (full batch) entering layer ``start`` (0 for the first layer)."""
        return self.cut_bytes[start - 1] if start > 0 else 0.0

    def task_overhead_s(self, submesh) -> float:
        """Seconds charged per stage task on ``submesh`` (see :func:`~autopar_lab.pricing.stage.task_overhead_s`)."""
        return task_overhead_s(self.cluster, submesh)

    def one_program(self, start: int, end: int, submesh, microbatches: int) -> bool:
        """Whether a stage of layers start..end on ``submesh`` is a whole step run as one program: every layer on
        every device with one microbatch, where the backend's runtime replays such a step as one program
        (:func:`~autopar_lab.backends.one_program_share`: the CPU's "spmd" mode). Its forward, backward and update,
        three tasks in the stage formula, are then one task (that share of the per-task charge each). Not for a model
        planned on a shallower copy: its strategies are not per operator of the model's own graph, so the runtime
        runs the step as a one-stage pipeline (a forward, a backward and an update program; measured at 24
        layers)."""
        return (one_program_share(self.cluster) is not None and int(microbatches) == 1 and start == 0
                and self.solve_graph is self.graph
                and end == len(self.layer_names) - 1 and int(submesh[0]) * int(submesh[1]) == self.cluster.num_devices)

    def task_charge(self, start: int, end: int, submesh, microbatches: int) -> tuple[float, float]:
        """``(task_s, arrays)`` for :func:`~autopar_lab.pricing.stage.stage_cost` of layers start..end on
        ``submesh``: the per-task overhead, and 1 where its tasks take their arrays; a one-program stage
        (:meth:`one_program`) pays the backend's share of the overhead per task and no task arrays."""
        task = self.task_overhead_s(submesh)
        share = one_program_share(self.cluster)
        if share is not None and self.one_program(start, end, submesh, microbatches):
            return task * share, 0.0
        return task, 1.0

    def backend_totals(self, totals: dict, sums, start, end) -> None:
        """Add to ``totals`` (a range's sums, layers ``start..end``: ints or broadcastable arrays) the backend's terms
        (:mod:`autopar_lab.backends`; 0 but on the CPU): the backward programs' re-reads (``rereads_s``), the update
        program's copies of the optimizer state (``update_copies_bytes``), the gradients a one-program step does not
        hold at its peak (``one_program_grads_bytes``) and the largest of the layers' float32 matmul copies
        (:func:`~autopar_lab.pricing.stage.range_max`); and, on every device, the pipeline's boundaries (what the
        first layer receives, what the last sends: :func:`~autopar_lab.pricing.stage.range_edges`)."""
        totals["rereads_s"] = program_rereads_s(self.cluster, sums, start, end)
        totals["update_copies_bytes"] = update_copies_bytes(self.cluster, totals["opt_bytes"])
        totals["one_program_grads_bytes"] = one_program_grads_bytes(self.cluster, totals["grad_bytes"])
        totals.update(range_max(sums, start, end))
        totals.update(range_edges(sums, start, end))  # not the backend's: the pipeline's boundaries, on every device

    def stage_from_sums(self, sums, start: int, end: int, submesh, shape, microbatches: int, remat: bool | str,
                        intra: IntraPlan | None = None, solution: str = "fast") -> StageCandidate:
        """The candidate for layers start..end priced from running sums ``sums`` (:func:`prefix_sums`) of some
        layer costs on the ``shape`` view of ``submesh``; ``intra`` rides along as its payload, ``solution`` (which
        of the mesh's solutions it is, :meth:`solutions`) is recorded with it."""
        totals = {f: sums[f][end + 1] - sums[f][start] for f in running_keys(tuple(sums))}
        self.backend_totals(totals, sums, start, end)
        task, arrays = self.task_charge(start, end, submesh, microbatches)
        fwd, bwd, static, act = stage_cost(totals, self.entry_bytes(start), microbatches, shape[0] * shape[1], remat,
                                           task, arrays)
        return StageCandidate((start, end), tuple(submesh), tuple(shape), remat, fwd, bwd, static, act,
                              payload=intra, solution=solution)

    def stage(self, start: int, end: int, submesh, shape, microbatches: int, remat: bool | str,
              solution: str = "fast") -> StageCandidate:
        """Layers start..end on the ``shape`` view of ``submesh`` with the table's sharding of that mesh (its
        ``solution``, see :meth:`solutions`)."""
        _, plan = self.mesh_costs(submesh, shape, solution)
        return self.stage_from_sums(self.prefix_sums(submesh, shape, solution), start, end, submesh, shape,
                                    microbatches, remat, plan, solution)

    def submeshes(self) -> list[tuple[int, int]]:
        """The submesh shapes the stage DP searches (:func:`planning_submeshes` of the table's ``space``)."""
        if "submeshes" not in self._memo_space:
            self._memo_space["submeshes"] = planning_submeshes(self.cluster, self.batch_size, self.space)
        return self._memo_space["submeshes"]

    def mesh_shapes(self, submesh) -> list[tuple[int, int]]:
        """The submesh's distinct logical mesh shapes (:func:`distinct_mesh_shapes`), cached."""
        sub = tuple(submesh)
        if sub not in self._shapes:
            self._shapes[sub] = distinct_mesh_shapes(self.cluster, sub, self.space)
        return self._shapes[sub]

    def candidates(self, start: int, end: int, submesh, microbatches: int, remat=REMAT_CHOICES):
        """The Pareto-optimal stage candidates for layers start..end on a submesh (one per distinct logical mesh,
        solution (:meth:`solutions`) and remat choice, dominated ones dropped)."""
        sub = tuple(submesh)
        cands = [self.stage(start, end, sub, shape, microbatches, r, sol) for shape in self.mesh_shapes(sub)
                 for sol in self.solutions(sub, shape) for r in remat]
        return pareto(cands)

    def candidate_fn(self, microbatches: int, mem_limit_bytes: float | None = None, *,
                     grid: tuple[Sequence[int], Sequence[int]] | None = None) -> StageCandidates:
        """``candidates`` for one microbatch count as the stage DP calls it, ``(start, end, submesh)``, computed
        for all layer ranges of a submesh at once with numpy; with ``mem_limit_bytes``, candidates that cannot fit
        even holding one microbatch are left out (the DP could never use them). Same candidates, same order, same
        numbers as :meth:`candidates` otherwise. The object returned also hands the DP each submesh's arrays
        (``block(submesh)``, a :class:`StageBlock`), so the DP reads them without building a candidate per range.
        ``grid``: (first layers, last layers): only the ranges from one of the first to one of the last layers
        (a layer grid's blocks, see ``planner.layer_grid``), the blocks' arrays indexed by their positions there.
        """
        return StageCandidates(self, microbatches, mem_limit_bytes, grid)
