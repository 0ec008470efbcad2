"""The workbench's state as a plain object: the plan, its history, the selection, and who to tell when they change.

Every action a view offers is a method here, so all of it runs (and is tested) without a browser or ipywidgets. The
plans are values (:class:`~autopar_lab.plan.Plan`); the session holds a history of them for undo/redo, and each action
pushes the new plan and tells the observers with an :class:`Event` carrying the plan before and after.

    >>> import autopar_lab as al                                                    # doctest: +SKIP
    >>> s = al.Session(al.megatron_plan(graph, cluster, dp=2, tp=2, pp=1))         # doctest: +SKIP
    >>> s.subscribe(lambda e: print(e.name, e.action))                             # doctest: +SKIP
    >>> s.set_choice(42, "S0R = S0R x RR")                                          # doctest: +SKIP
    plan set_choice
    >>> s.undo()                                                                    # doctest: +SKIP
    plan undo

Operator ids are those of the model's own graph (``session.graph``, ``plan.graph``), as every view shows them, also for
a deep model solved on a shallower copy of itself; an override's ``scope`` says whether it applies to the operator in
every layer sharing its layer's solution (``"shared"``, the default) or in its layer alone (``"layer"``): see
:mod:`autopar_lab.operators`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..operators import check_op
from ..rematmode import remat_value
from ..solve.ilp import DEFAULT_SOLVER
from .training import TrainingController

if TYPE_CHECKING:
    from ..plan import Plan
    from ..pricing.table import CostTable


__all__ = ["Session", "Event", "SolveCancelled", "Selection"]

EVENTS = ("plan", "selection", "progress", "compare", "error", "training", "measured")


class SolveCancelled(Exception):
    """Raised inside a solve when its cancel event is set; the session keeps the plan it had."""


@dataclass(frozen=True)
class Selection:
    """What the views highlight: an operator (of the plan's graph), a layer name, a stage index; any may be None."""

    op: int | None = None
    layer: str | None = None
    stage: int | None = None


@dataclass(frozen=True)
class Event:
    """What an observer receives. ``name`` is one of ``plan``, ``selection``, ``progress``, ``compare``, ``error``;
    ``action`` the method that caused it; ``before``/``after`` the plans around a ``plan`` event (else the current
    plan twice); ``detail`` anything else (progress message and fraction, the selection, the comparison).
    Training adds ``training`` (detail ``event``: a ProgressEvent, ``run``: the run's number; before/after: the plan
    being trained, called from the job's thread) and ``measured`` (detail ``stage_times``: the measured rows)."""

    name: str
    action: str
    before: Any
    after: Any
    detail: Mapping[str, Any] = field(default_factory=dict)


def _missing(method: str) -> NotImplementedError:
    return NotImplementedError(
        f"Plan.{method} is not available in this version of autopar_lab.plan; this action needs it (stage, "
        "submesh, schedule and remat overrides). Use set_choice / set_microbatches, or update autopar_lab.")


class Session:
    """Observable state of one workbench: graph, cluster, current plan, pins, undo/redo, selection, observers.

    ``plan``: the starting plan (from :func:`~autopar_lab.auto_plan`, :func:`~autopar_lab.megatron_plan`, ...).
    ``model``: the zoo ModelSpec or OpGraph it was made from (a full re-solve traces it again only if it is a model;
    by default the plan's graph is used). ``solver``: the ILP solver of every solve (the planner's default).
    """

    def __init__(self, plan: Plan, *, model=None, solver: str = DEFAULT_SOLVER):
        from ..plan import Plan

        if not isinstance(plan, Plan):
            raise TypeError(f"Session needs a Plan (from al.auto_plan, al.megatron_plan, ...), got "
                            f"{type(plan).__name__}")
        self._history: list = [plan]
        self._actions: list[str] = ["start"]
        self._index = 0
        self.model = model
        self.solver = solver
        self.selection = Selection()
        self.comparison: dict | None = None
        self._observers: list[Callable[[Event], None]] = []
        self._lock = threading.RLock()
        # Messages about pins a solve had to drop (a what-if re-plan on a cluster that cannot keep them).
        self.dropped_pins: list[str] = []
        #: Local runs and Ray launches of the current plan (widgets/training.py); the methods below delegate to it.
        self.training = TrainingController(self)

    # --- state ----------------------------------------------------------------------------------------------------
    @property
    def plan(self):
        """The current plan."""
        return self._history[self._index]

    @property
    def previous(self):
        """The plan before the last action (None at the start of the history): the "before" of the cost panel."""
        return self._history[self._index - 1] if self._index > 0 else None

    @property
    def last_action(self) -> str:
        return self._actions[self._index]

    @property
    def graph(self):
        """The plan's operator graph: the model's own, whose ids every operator here is."""
        return self.plan.graph

    @property
    def cluster(self):
        return self.plan.cluster

    @property
    def pins(self) -> Mapping[int, Any]:
        """The plan's operator pins: operator -> Pin(strategy name, scope)."""
        return dict(self.plan.pins)

    @property
    def stage_pins(self) -> Mapping[str, Any]:
        return dict(self.plan.stage_pins)

    @property
    def can_undo(self) -> bool:
        return self._index > 0

    @property
    def can_redo(self) -> bool:
        return self._index < len(self._history) - 1

    @property
    def history(self) -> list[tuple[str, Any]]:
        """(action, plan) for every step of the history, oldest first."""
        return list(zip(self._actions, self._history))

    # --- observers -------------------------------------------------------------------------------------------------
    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``callback(event)`` on every change; returns a function that unsubscribes it."""
        if not callable(callback):
            raise TypeError("subscribe needs a callable taking one Event")
        self._observers.append(callback)
        return lambda: self._observers.remove(callback) if callback in self._observers else None

    def _emit(self, name: str, action: str, before=None, after=None, **detail) -> None:
        ev = Event(name, action, self.plan if before is None else before, self.plan if after is None else after,
                   detail)
        for cb in list(self._observers):
            cb(ev)

    def _push(self, plan, action: str, **detail) -> Any:
        with self._lock:
            before = self.plan
            del self._history[self._index + 1:]
            del self._actions[self._index + 1:]
            self._history.append(plan)
            self._actions.append(action)
            self._index += 1
        self._fix_selection()
        self._emit("plan", action, before, plan, **detail)
        return plan

    def _fix_selection(self) -> None:
        # The stage of the selected operator may move when stages change.
        sel = self.selection
        if sel.op is not None:
            try:
                stage = self.plan.stage_of(sel.op)
            except (ValueError, KeyError):
                stage = None
            self.selection = dataclasses.replace(sel, stage=stage)
        elif sel.stage is not None and sel.stage >= len(self.plan.stages):
            self.selection = dataclasses.replace(sel, stage=None)

    # --- selection -------------------------------------------------------------------------------------------------
    def select(self, op: int | None = None, layer: str | None = None, stage: int | None = None) -> Selection:
        """Select an operator of the plan's graph (which also selects its layer and the stage that runs it), a layer,
        or a stage; no argument clears."""
        plan = self.plan
        if op is not None:
            op = check_op(plan, op)
            layer = self.graph.op(op).layer
            stage = plan.stage_of(op)
        elif layer is not None:
            names = list(plan.layer_names)
            if layer not in names:
                more = "..." if len(names) > 6 else ""
                raise ValueError(f"layer {layer!r} is not in this plan; layers are {names[:6]}{more}")
            k = names.index(layer)
            stage = next(s for s, st in enumerate(plan.stages) if any(a <= k <= b for a, b in st.layer_ranges))
        elif stage is not None:
            if not 0 <= int(stage) < len(plan.stages):
                raise ValueError(f"stage {stage} does not exist; this plan has {len(plan.stages)} stage(s)")
            stage = int(stage)
        self.selection = Selection(op, layer, stage)
        self._emit("selection", "select", selection=self.selection)
        return self.selection

    # --- overrides -------------------------------------------------------------------------------------------------
    def set_choice(self, op: int, strategy, scope: str = "shared") -> Any:
        """Run operator ``op`` by ``strategy`` (name, output spec or Strategy) and pin it there: in every layer that
        shares its layer's solution (``scope="shared"``) or in its layer alone (``"layer"``; see
        :meth:`Plan.with_choice`)."""
        return self._push(self.plan.with_choice(int(op), strategy, scope), "set_choice")

    pin = set_choice

    def unpin(self, op: int, scope: str | None = None) -> Any:
        """Forget the pin that holds ``op`` (``scope``: only that kind; see :meth:`Plan.without_pin`): a shared pin's
        strategy stays until the next :meth:`resolve` or solve; a layer's own pin gives the layer its solution's
        strategy again."""
        return self._push(self.plan.without_pin(int(op), scope), "unpin")

    def unpin_stages(self, key: str | None = None) -> Any:
        """Forget the stage pins (``key``: one of "boundaries", "submeshes", "logical_meshes", "remat",
        "microbatches", "schedule"; None: all), so the next :meth:`resolve` may change those decisions."""
        sp = dict(self.plan.stage_pins)
        if key is None:
            sp = {}
        elif key not in sp:
            raise ValueError(f"{key!r} is not pinned; stage pins: {sorted(sp)}")
        else:
            del sp[key]
        return self._push(dataclasses.replace(self.plan, stage_pins=sp), "unpin_stages")

    def alternatives(self, op: int, scope: str = "shared") -> list:
        """Every strategy of ``op`` with its step-time change (see :meth:`Plan.alternatives`)."""
        return self.plan.alternatives(int(op), scope)

    def layer_groups(self) -> list:
        """The plan's real layers grouped by the solution they share (:func:`autopar_lab.layergroups.layer_groups`)."""
        from ..layergroups import layer_groups

        return layer_groups(self.plan)

    def set_microbatches(self, n: int) -> Any:
        return self._push(self.plan.with_microbatches(n), "set_microbatches")

    def set_stages(self, boundaries: Sequence[int] | None = None, submeshes: Sequence | None = None,
                   logical_meshes: Sequence | None = None, microbatches: int | None = None) -> Any:
        """New stage cuts (first layer of each stage after the first), submeshes and logical meshes per stage."""
        if not hasattr(self.plan, "with_stages"):
            raise _missing("with_stages")
        p = self.plan.with_stages(boundaries=boundaries, submeshes=submeshes, logical_meshes=logical_meshes,
                                  microbatches=microbatches)
        return self._push(p, "set_stages")

    def boundaries(self) -> list[int]:
        """The first layer of every stage but the first (the form :meth:`set_stages` takes)."""
        return [st.layers[0] for st in self.plan.stages[1:]]

    def move_cut(self, cut: int, first_layer: int) -> Any:
        """Move cut ``cut`` (between stage ``cut`` and ``cut + 1``) so that stage ``cut + 1`` starts at
        ``first_layer``."""
        b = self.boundaries()
        if not 0 <= cut < len(b):
            raise ValueError(f"cut {cut} does not exist; this plan has {len(b)} cut(s) between {len(b) + 1} stage(s)")
        lo = b[cut - 1] + 1 if cut > 0 else 1
        hi = b[cut + 1] - 1 if cut + 1 < len(b) else len(self.plan.layer_names) - 1
        if not lo <= first_layer <= hi:
            raise ValueError(f"cut {cut} can move to layers {lo}..{hi} (each stage keeps at least one layer), "
                             f"got {first_layer}")
        b[cut] = int(first_layer)
        return self.set_stages(boundaries=b)

    def set_submesh(self, stage: int, submesh, logical_mesh=None) -> Any:
        """Give stage ``stage`` another submesh (and logical mesh; default: the submesh's own shape)."""
        stage = self._check_stage(stage)
        subs = [tuple(st.submesh) for st in self.plan.stages]
        lms = [tuple(st.logical_mesh) for st in self.plan.stages]
        subs[stage] = tuple(submesh)
        lms[stage] = tuple(logical_mesh) if logical_mesh is not None else tuple(submesh)
        return self.set_stages(submeshes=subs, logical_meshes=lms)

    def set_schedule(self, schedule: str, virtual_stages: int | None = None) -> Any:
        """Run the plan with ``schedule`` (``"interleaved"`` with ``virtual_stages`` model chunks per stage),
        pinned and re-priced, undoably (:meth:`Plan.with_schedule`)."""
        if not hasattr(self.plan, "with_schedule"):
            raise _missing("with_schedule")
        return self._push(self.plan.with_schedule(schedule, virtual_stages), "set_schedule")

    def set_remat(self, stage: int, remat: bool | str) -> Any:
        """Stage ``stage``'s rematerialisation: True (full), False (none) or "selective", pinned, undoably."""
        if not hasattr(self.plan, "with_remat"):
            raise _missing("with_remat")
        return self._push(self.plan.with_remat(self._check_stage(stage), remat_value(remat)), "set_remat")

    def _check_stage(self, stage) -> int:
        n = len(self.plan.stages)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n:
            raise ValueError(f"stage must be 0..{n - 1} (this plan has {n} stage(s)), got {stage!r}")
        return stage

    def resolve(self, *, on_progress: Callable[[str, float | None], None] | None = None,
                cancel: threading.Event | None = None) -> Any:
        """Re-solve every decision that is not pinned, around the operator and stage pins
        (:func:`autopar_lab.resolve`: the stage DP over the plan's cost table, then the ILP of each stage with pins).
        ``on_progress`` / ``cancel``: as for :meth:`solve` (the stage DP reports once per microbatch count, then
        each stage's ILP)."""
        from ..pins import resolve

        hook = self._hooks(on_progress, cancel, "resolve")
        hook("resolve around pins started")
        table = self.plan.table
        old = table.on_progress if table is not None else None
        if table is not None:
            table.on_progress = hook
        try:
            new = resolve(self.plan, solver=self.solver, on_progress=hook)
        finally:
            if table is not None:
                table.on_progress = old
        hook("resolve around pins done", 1, 1)
        return self._push(new, "resolve")

    def adopt(self, plan: Plan, action: str = "adopt") -> Any:
        """Make ``plan`` (a baseline from :meth:`compare`, a loaded file) the current plan, undoably."""
        from ..plan import Plan

        if not isinstance(plan, Plan):
            raise TypeError(f"adopt needs a Plan, got {type(plan).__name__}")
        return self._push(plan, action)

    def diff(self) -> dict | None:
        """What the last action changed (:meth:`Plan.diff` of the previous plan to the current one), or None."""
        prev = self.previous
        return None if prev is None else prev.diff(self.plan)

    # --- history ---------------------------------------------------------------------------------------------------
    def undo(self) -> Any:
        if not self.can_undo:
            raise ValueError("nothing to undo")
        before = self.plan
        self._index -= 1
        self._fix_selection()
        self._emit("plan", "undo", before, self.plan)
        return self.plan

    def redo(self) -> Any:
        if not self.can_redo:
            raise ValueError("nothing to redo")
        before = self.plan
        self._index += 1
        self._fix_selection()
        self._emit("plan", "redo", before, self.plan)
        return self.plan

    # --- solves ----------------------------------------------------------------------------------------------------
    def _hooks(self, progress, cancel, action: str = "solve"):
        t0 = time.perf_counter()

        def hook(message: str, done: int = 0, total: int = 0):
            if cancel is not None and cancel.is_set():
                raise SolveCancelled("solve cancelled")
            frac = done / total if total else None
            if progress is not None:
                progress(message, frac)
            self._emit("progress", action, message=message, done=done, total=total, fraction=frac,
                       elapsed_s=time.perf_counter() - t0)

        return hook

    def solve(self, kind: str = "full", *, on_progress: Callable[[str, float | None], None] | None = None,
              cancel: threading.Event | None = None, microbatches="auto", cluster=None) -> Any:
        """Run a solver and make its plan current; pins are kept (re-solved around) wherever they still hold.

        ``kind``: ``"intra"`` (the current stages kept, each stage's operator shardings re-solved by the intra-op
        ILP around the pins), ``"inter"`` (the stage DP again over the plan's cost table: stages, submeshes, logical
        meshes, microbatches, around the pins), or ``"full"`` (both, with a fresh cost table; ``cluster`` replaces
        the cluster, for what-if questions). Every pin the new plan cannot keep (a strategy no mesh of the new
        cluster has, submeshes that do not tile it, pins that together do not fit) is dropped with a message saying
        which and why: in :attr:`dropped_pins` and in the ``plan`` event's ``detail["dropped_pins"]``.
        ``on_progress(message, fraction or None)`` is called as the intra-op ILPs finish; when ``cancel`` (a
        threading.Event) is set the solve stops at the next report with :class:`SolveCancelled` and the session is
        unchanged.
        """
        from .. import planner
        from ..pins import keep_pins, solve_intra_around_pins

        if kind not in ("intra", "inter", "full"):
            raise ValueError(f"solve kind must be 'intra', 'inter' or 'full', got {kind!r}")
        hook = self._hooks(on_progress, cancel)
        hook(f"{kind} solve started")
        plan = self.plan
        dropped: list[str] = []
        if kind == "intra":
            if plan.table is None:
                raise ValueError("this plan has no cost table; run a full solve")
            new = solve_intra_around_pins(plan, solver=self.solver, on_progress=hook)
        else:
            new_cluster = cluster if cluster is not None else plan.cluster
            mem = plan.cost.mem_limit_bytes if new_cluster == plan.cluster else None
            kw = dict(microbatches=microbatches, stage_comm=plan.stage_comm, schedule=plan.schedule,
                      mem_limit_bytes=mem, solver=self.solver,
                      virtual_stages=plan.virtual_stages if plan.schedule == "interleaved" else None)
            if kind == "inter" and cluster is None and plan.table is not None:
                old = plan.table.on_progress
                plan.table.on_progress = hook
                try:
                    new = planner.auto_plan(plan.graph, new_cluster, table=plan.table, **kw)
                finally:
                    plan.table.on_progress = old
            elif cluster is not None and plan.table is not None and plan.table.graph is plan.graph:
                # A what-if on the cluster: the table moves to the new cluster (no trace; every mesh it priced
                # whose ILP the change cannot alter carries over: CostTable.for_cluster), the stage DP runs again.
                table = plan.table.for_cluster(new_cluster)
                planned = table.planned_meshes()
                todo = sum(1 for k in planned if k not in table.kept_meshes)
                hook(f"re-plan on {new_cluster.hosts}x{new_cluster.devices_per_host}: {len(planned) - todo} of "
                     f"{len(planned)} meshes kept from the cost table, {todo} ILP(s) to solve")
                table.on_progress = hook
                try:
                    new = planner.auto_plan(plan.graph, new_cluster, table=table, **kw)
                finally:
                    table.on_progress = None  # the hook belongs to this solve only
            else:
                source = self.model if self.model is not None else plan.graph
                # the plan's number format, when it was chosen (None: the model's own, as traced, again)
                fmt = plan.op_graph.__dict__.get("precision")
                new = planner.auto_plan(source, new_cluster, on_progress=hook, precision=fmt, **kw)
                if new.table is not None:
                    new.table.on_progress = None  # the hook belongs to this solve only
            new, dropped = keep_pins(new, plan, solver=self.solver, on_progress=hook)
        if cancel is not None and cancel.is_set():
            raise SolveCancelled("solve cancelled")
        for message in dropped:
            hook(message)
        hook(f"{kind} solve done", 1, 1)
        self.dropped_pins = list(dropped)
        return self._push(new, f"solve_{kind}", dropped_pins=list(dropped))

    def set_cluster(self, cluster=None, *, on_progress=None, cancel=None, **changes) -> Any:
        """What if the cluster were different: ``cluster`` or changes for :meth:`Cluster.with_` (``hosts=4``,
        ``inter_host_bandwidth=1e9``, ...); re-plans with a full solve, keeping every pin that still holds (see
        :meth:`solve`). The plan's cost table moves to the new cluster (:meth:`CostTable.for_cluster`): nothing is
        traced again, and every mesh already priced whose ILP the change cannot alter is reused (all of a submesh
        both clusters have when the host count moves; the one-host meshes when the inter-host link changes; those
        whose split axes all cross hosts when the intra-host link does), so only the other ILPs and the stage DP
        run, to the same plan as a fresh :func:`~autopar_lab.auto_plan` of the new cluster."""
        if cluster is None:
            if not changes:
                raise ValueError("set_cluster needs a Cluster or changes such as hosts=2, inter_host_bandwidth=1e9")
            cluster = self.cluster.with_(**changes)
        elif changes:
            raise ValueError("pass either a Cluster or changes, not both")
        return self.solve("full", on_progress=on_progress, cancel=cancel, cluster=cluster)

    # --- comparisons -----------------------------------------------------------------------------------------------
    def compare(self, *, optimum: bool | None = None, optimum_limit: int = 20_000, on_progress=None,
                cancel: threading.Event | None = None) -> dict:
        """The current plan against the best Megatron-style layout and data parallelism, priced by the plan's own cost
        table; with ``optimum`` (default: when the plan space has at most ``optimum_limit`` plans) also the
        exhaustive global optimum. Returns {name: Plan} plus ``"megatron_config"``; also kept in ``comparison``.
        ``on_progress``/``cancel``: as for :meth:`solve` (the ILPs of meshes the table has not priced yet report)."""
        plan = self.plan
        table = plan.table
        if table is None:
            raise ValueError("this plan has no cost table to price the baselines with; run a full solve")
        hook = self._hooks(on_progress, cancel, "compare")
        old = table.on_progress
        table.on_progress = hook
        try:
            return self._compare(plan, table, optimum, optimum_limit, hook)
        finally:
            table.on_progress = old

    def _compare(self, plan: Plan, table: CostTable, optimum, optimum_limit, hook) -> dict:
        from .. import planner
        from ..solve import exhaustive

        hook("pricing the baselines")
        cluster = plan.cluster
        mbs = planner.microbatch_choices(table.batch_size, "auto")
        base = planner.baselines(table, cluster)
        out: dict[str, Any] = {"current": plan, "megatron": base["megatron_best"],
                               "megatron_config": base["megatron_config"], "data_parallel": base["data_parallel"]}
        n = exhaustive.count_plans(len(table.layer_names), cluster, len(mbs))
        if optimum or (optimum is None and n <= optimum_limit):
            hook(f"searching all {n} plans for the global optimum")
            search = exhaustive.OptimumSearch(solver=self.solver,
                                              limit=max(optimum_limit, n) if optimum else optimum_limit)
            res = exhaustive.global_optimum(plan.graph, cluster, table=table, search=search)
            out["optimum"] = res["optimum"]
        self.comparison = out
        self._emit("compare", "compare", comparison=out)
        return out

    # --- files and code --------------------------------------------------------------------------------------------
    def save(self, path) -> str:
        from ..planfile import save_plan

        save_plan(self.plan, path)
        return str(path)

    def load(self, path) -> Any:
        """Load a plan file made for this graph and cluster (validated) and make it current, undoably."""
        from ..planfile import load_plan

        from ..graph.opgraph import OpGraph

        model = None if self.model is None or isinstance(self.model, OpGraph) else self.model
        return self._push(load_plan(path, self.graph, self.cluster, model=model), "load")

    def export_code(self) -> str:
        return self.plan.to_jax_code()

    def import_config(self, source, framework: str | None = None) -> Any:
        """Price a Megatron-LM, torchtitan or MaxText configuration (its text or its path) on this model and cluster
        (:func:`~autopar_lab.frameworks.import_config`) and make it the current plan, undoably."""
        from ..frameworks import import_config
        from ..graph.opgraph import OpGraph

        model = None if isinstance(self.model, OpGraph) else self.model
        table = self.plan.table
        try:
            plan = import_config(source, model, self.cluster, framework=framework, table=table)
        except ValueError as e:
            # a configuration in another number format than the current plan's: priced on a table of its own
            if table is None or model is None or not str(e).startswith("the cost table prices precision"):
                raise
            plan = import_config(source, model, self.cluster, framework=framework)
        return self._push(plan, "import_config")

    def export_config(self, framework: str) -> str:
        """The current plan as ``framework``'s configuration (:func:`~autopar_lab.frameworks.export_config`)."""
        from ..frameworks import export_config
        from ..graph.opgraph import OpGraph

        return export_config(self.plan, framework, model=None if isinstance(self.model, OpGraph) else self.model)

    # --- training (delegates to self.training, a TrainingController) -------------------------------------------------
    @property
    def measured(self) -> list[dict] | None:
        """The latest measured per-stage times of the current plan (see :attr:`TrainingController.measured`)."""
        return self.training.measured

    def record_measured(self, plan, rows, action: str = "record_measured") -> None:
        self.training.record_measured(plan, rows, action)

    def run_local(self, steps: int, **kw) -> dict:
        """Train the current plan on the local devices (:meth:`TrainingController.run_local`).

            >>> s = al.Session(plan, model=model)       # doctest: +SKIP
            >>> s.run_local(3)["losses"]                # doctest: +SKIP
            [4.2..., 3.9..., 3.7...]
        """
        return self.training.run_local(steps, **kw)

    def launch(self, steps: int, **launch_kw):
        """Train the current plan on Ray (:meth:`TrainingController.launch`); returns the Job.

            >>> job = s.launch(100, ray_address="http://head:8265")   # doctest: +SKIP
            >>> job.cancel()                                            # doctest: +SKIP
        """
        return self.training.launch(steps, **launch_kw)

    @property
    def job(self):
        """The latest Ray job from :meth:`launch`."""
        return self.training.job

    @property
    def runner(self):
        """The latest local Runner from :meth:`run_local`."""
        return self.training.runner

    def notify(self, name: str, action: str, before=None, after=None, **detail) -> None:
        """Tell every observer an :class:`Event` ``name`` happened (how the training controller reports)."""
        self._emit(name, action, before, after, **detail)

    def error(self, action: str, exc: BaseException, source: str | None = None) -> None:
        """Tell observers an action failed (views show the message; the plan is unchanged). ``source``: the view
        that already shows it (its CSS class), so that another place need not say it again."""
        self._emit("error", action, message=str(exc), kind=type(exc).__name__, source=source)

    def __repr__(self) -> str:
        return f"Session({self.plan!r}, history {self._index + 1}/{len(self._history)}, {len(self.plan.pins)} pin(s))"
