"""Plans as values with behaviour: :class:`Plan`, and :func:`price_plan`, which makes one from decisions.

The data a plan holds (:class:`~autopar_lab.planvalues.Stage`, :class:`~autopar_lab.planvalues.CostReport`) sits
below the pricing layer, which computes it (:func:`~autopar_lab.pricing.price.price_stages`); this module sits above
pricing and the modules that edit plans (:mod:`autopar_lab.overrides`, :mod:`autopar_lab.pins`,
:mod:`autopar_lab.parallelism`, :mod:`autopar_lab.export`), so a plan's methods call them with plain imports. Those
modules never make a Plan from nothing: they re-price the plan they were given and return it with its new fields
(:meth:`~autopar_lab.pricing.price.Priced.onto`, ``dataclasses.replace``), so it keeps its class. What makes a plan
from nothing (the planner, plan files, the global optimum) sits above this module and calls :func:`price_plan`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from . import export, operators, overrides, parallelism
from .planvalues import SHARED, CostReport, Pin, Stage, as_pins, layer_scoped
from .precision import precision_of
from .pricing.price import price_stages
from .schedules import schedule_of

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.opgraph import OpGraph
    from .overrides import Alternative
    from .precision import Precision
    from .pricing.layers import LayerCost
    from .pricing.table import CostTable
    from .solve.intra import IntraPlan

__all__ = ["Plan", "Stage", "CostReport", "Pin", "price_plan", "plan_object"]


@dataclass(frozen=True)
class Plan:
    """A complete parallelization plan of a training step on a cluster.

    Every operator a plan's methods take or give is one of :attr:`graph`, the model's own graph (the ids every view
    shows), also for a deep model solved on a shallower copy of itself; ``scope`` says whether a change applies to
    the operator in every layer sharing its layer's solution (``"shared"``, the default) or in its layer alone
    (``"layer"``): see :mod:`autopar_lab.operators`."""

    graph: OpGraph = field(repr=False)
    cluster: Cluster = field(repr=False)
    method: str
    layer_names: tuple[str, ...]
    stages: tuple[Stage, ...]
    microbatches: int
    schedule: str
    stage_comm: str
    cost: CostReport
    solve_s: Mapping[str, float] = field(default_factory=dict, compare=False)
    notes: tuple[str, ...] = ()
    # Operators the user fixed (operator of ``graph`` -> Pin(strategy name, scope)): overrides record them so a later
    # re-solve keeps them. A shared pin is recorded under its place in the first layer sharing the solution that has
    # no pin of its own there (autopar_lab.operators); a bare strategy name given here is a shared pin.
    pins: Mapping[int, Pin] = field(default_factory=dict, hash=False)
    # Stage decisions the user fixed, which a re-solve keeps (see autopar_lab.overrides): any of "boundaries" (first
    # layer of each stage after the first), "submeshes", "logical_meshes", "remat" (one entry per stage, None where
    # free), "microbatches", "schedule".
    stage_pins: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # The CostTable that priced this plan (layer costs per mesh, cut bytes, batch size): what re-pricing an override
    # needs. Not part of the plan's value.
    table: CostTable | None = field(default=None, compare=False, repr=False)
    # Model chunks per stage: > 1 only for the interleaved schedule (each stage's chunks in Stage.chunks).
    virtual_stages: int = 1

    def __post_init__(self):
        if any(not isinstance(p, Pin) for p in self.pins.values()):
            object.__setattr__(self, "pins", as_pins(self.pins))

    @property
    def precision(self) -> Precision:
        """The number format the plan is priced in (``precision=`` of the planners; by default the model's own, as
        traced): its graph's, :func:`~autopar_lab.precision.precision_of`."""
        return precision_of(self.op_graph)

    @property
    def op_graph(self) -> OpGraph:
        """The graph the stages' intra-op plans are keyed by: :attr:`graph`, or for a deep model planned on a
        shallower copy, that copy (an internal detail: the methods here take operators of :attr:`graph`)."""
        return self.table.solve_graph if self.table is not None else self.graph

    def stage_of(self, op: int) -> int:
        """The index of the stage that runs operator ``op``'s layer (an operator outside layers: the last layer's)."""
        return operators.stage_of(self, op)

    def stages_of(self, op: int) -> list[int]:
        """Every stage that runs a layer sharing operator ``op``'s solution: what a shared override of ``op``
        re-prices (a deep model's blocks share one solution and may span stages)."""
        return operators.stages_of(self, op)

    def choice(self, op: int) -> Any:
        """The sharding strategy operator ``op`` runs with: its layer's own pin when its layer is split from the
        layers sharing its solution, else its solution's strategy in the stage that runs its layer."""
        return operators.choice(self, op)

    def pin_of(self, op: int) -> Pin | None:
        """The pin that holds operator ``op`` (its layer's own, else its shared solution's), or None."""
        return operators.pin_of(self, op)

    # --- overrides: each returns a new Plan, re-estimated (see autopar_lab.overrides) -----------------------------
    def with_choice(self, op: int, strategy, scope: str = SHARED) -> "Plan":
        """This plan with operator ``op`` run by ``strategy`` (a Strategy, its name, or an output spec like "S0R"),
        pinned, re-priced and re-simulated. ``scope="shared"`` (the default): in every layer that shares ``op``'s
        solution, on every stage that runs one of them (a layer split from them keeps its own); ``"layer"``: in
        ``op``'s layer alone, which is split from the others and priced on its own (the same as shared for a layer
        that shares its solution with no other)."""
        return overrides.with_choice(self, op, strategy, scope)

    def without_pin(self, op: int, scope: str | None = None) -> "Plan":
        """This plan without the pin that holds operator ``op`` (``scope``: only that kind; None: its layer's own,
        else its shared solution's). A layer's own pin removed, the layer runs its solution's strategy again
        (re-priced; a layer left with no pin of its own shares the solution again); a shared pin removed, the
        strategies stay until the next re-solve."""
        return overrides.without_pin(self, op, scope)

    def with_microbatches(self, n: int) -> "Plan":
        """This plan with ``n`` microbatches (stages and strategies kept), re-simulated; ``n`` is pinned."""
        return overrides.with_microbatches(self, n)

    def with_stages(self, boundaries=None, submeshes=None, logical_meshes=None, microbatches=None) -> "Plan":
        """This plan with its stages changed: ``boundaries`` the first layer of each stage after the first (or a
        list of (first, last) ranges), ``submeshes`` one (hosts, devices) shape per stage, ``logical_meshes`` one
        (n0, n1) per stage (None entries of either: free, the stage DP picks them around the others). What is not
        given is kept where still valid, else the best from the plan's cost table; stages that do not change keep
        their strategies. What is given is pinned.

        >>> plan.with_stages(boundaries=[6], submeshes=[(1, 4), (1, 4)])   # doctest: +SKIP
        """
        return overrides.with_stages(self, boundaries, submeshes, logical_meshes, microbatches)

    def with_schedule(self, schedule: str, virtual_stages: int | None = None) -> "Plan":
        """This plan run with pipeline schedule ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (``virtual_stages``
        model chunks per stage, default 2) or ``"zb-h1"`` (pinned), re-priced and re-simulated."""
        return overrides.with_schedule(self, schedule, virtual_stages)

    def with_remat(self, stage: int, on: bool | str = True) -> "Plan":
        """This plan with rematerialisation of stage ``stage`` switched ``on`` (True: full), off (False) or to
        ``"selective"`` (the attention internals only), pinned: its activation memory and backward time re-priced,
        the pipeline re-simulated."""
        return overrides.with_remat(self, stage, on)

    def with_fsdp(self, axes: tuple[int, ...] | None = None) -> "Plan":
        """This plan with every parameter stored sharded over its stage's data-parallel axes (or ``axes``) and
        all-gathered where read, in forward and again in backward: ZeRO-3 / FSDP (each a pin, re-priced); see
        :func:`autopar_lab.parallelism.with_fsdp`."""
        return parallelism.with_fsdp(self, axes)

    def with_expert_parallel(self, axes: tuple[int, ...] = (), resolve: bool = True) -> "Plan":
        """This plan with the experts of every MoE layer split over mesh ``axes`` (``()``: replicated, EP=1), the
        rest re-solved around them; see :func:`autopar_lab.overrides.with_expert_parallel`."""
        return overrides.with_expert_parallel(self, axes, resolve)

    def alternatives(self, op: int, scope: str = SHARED) -> list[Alternative]:
        """Every strategy of operator ``op`` on its stage's mesh as ``Alternative(strategy, spec, delta_s)``, where
        ``delta_s`` is the step-time change of :meth:`with_choice` with that strategy and ``scope`` (exactly), sorted
        by ``delta_s``: "why this choice"."""
        return overrides.alternatives(self, op, scope)

    def diff(self, other: "Plan") -> dict:
        """What changed from this plan to ``other``: operators' strategies, stages, microbatches, and step time."""
        return overrides.diff(self, plan_object(other, "Plan.diff"))

    def to_jax_code(self, stage: int = 0) -> str:
        """Python source that builds one stage's mesh (default the first), the PartitionSpecs / NamedShardings of
        the step's inputs and the sharding constraints of its forward matmuls (see :mod:`autopar_lab.export`)."""
        return export.to_jax_code(self, stage)

    def report(self, model_name: str | None = None) -> dict:
        """The JSON report of `autopar-lab plan --json`."""
        out = {
            "model": model_name or getattr(self.graph, "name", ""),
            "cluster": self.cluster.name if hasattr(self.cluster, "name") else str(self.cluster),
            "hosts": self.cluster.hosts,
            "devices_per_host": self.cluster.devices_per_host,
            "method": self.method,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            **({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {}),
            "stage_comm": self.stage_comm,
            "precision": self.precision.name,
            "precision_text": self.cost.precision,
            **self.cost.to_dict(),
            "fits": self.cost.fits,
            "stages": [s.to_dict(self.layer_names) for s in self.stages],
            "solve_s": dict(self.solve_s),
            "notes": list(self.notes),
        }
        return out

    def __repr__(self) -> str:
        shapes = ", ".join(f"{s.layers[0]}-{s.layers[1]}@{s.submesh[0]}x{s.submesh[1]}" for s in self.stages)
        return (f"Plan({self.method}: {len(self.stages)} stage(s) [{shapes}], {self.microbatches} microbatches, "
                f"step {self.cost.step_time_s:.4g} s)")


def price_plan(table: CostTable, stages: Sequence[Any], *, microbatches: int, schedule: str = "1f1b",
               stage_comm: str = "model", mem_limit_bytes: float | None = None, method: str = "custom",
               intras: Sequence[IntraPlan | None] | None = None,
               layer_costs: Sequence[Sequence[LayerCost] | None] | None = None,
               solve_s: Mapping[str, float] | None = None, notes: Sequence[str] = (),
               pins: Mapping[int, Pin | str] | None = None, stage_pins: Mapping[str, Any] | None = None,
               virtual_stages: int | None = None, solutions: Sequence[str] | None = None,
               skip_above: float = math.inf) -> Plan:
    """The :class:`Plan` of these decisions, priced by ``table``
    (:func:`~autopar_lab.pricing.price.price_stages`, whose keywords these are, says how), with ``method``,
    ``stage_comm`` (what the stage DP was told about stage transfers), ``solve_s``, ``notes``, ``pins`` (operator
    of the table's graph -> :class:`Pin`, or a strategy name for a shared pin; a layer's own pins are priced on
    their own) and ``stage_pins`` stored on it as given.

    >>> import autopar_lab as al                                                           # doctest: +SKIP
    >>> table = al.CostTable.build(al.models.get("gpt-tiny"), cluster)                     # doctest: +SKIP
    >>> al.price_plan(table, [((0, 3), (1, 8), (2, 4), False)], microbatches=2).cost.step_time_s  # doctest: +SKIP
    """
    given = as_pins(pins or {})
    schedule, v = schedule_of(schedule, virtual_stages, stage_pins)  # a pinned chunk count, when none is given
    priced = price_stages(table, stages, microbatches=microbatches, schedule=schedule, virtual_stages=v,
                          mem_limit_bytes=mem_limit_bytes, intras=intras, layer_costs=layer_costs,
                          layer_pins=layer_scoped(given), solutions=solutions,
                          zero=(stage_pins or {}).get("zero"), skip_above=skip_above,
                          overlap=(stage_pins or {}).get("overlap"), host=(stage_pins or {}).get("host"),
                          accumulate=(stage_pins or {}).get("accumulate"),
                          eager_loss=(stage_pins or {}).get("eager_loss"),
                          microbatch_group=(stage_pins or {}).get("microbatch_group"))
    return Plan(table.graph, table.cluster, method, tuple(table.layer_names), priced.stages, microbatches,
                priced.schedule, stage_comm, priced.cost, dict(solve_s or {}), tuple(notes), pins=given,
                stage_pins=dict(stage_pins or {}), table=table, virtual_stages=priced.virtual_stages)


def plan_object(plan, where: str) -> Plan:
    """``plan`` if it is a :class:`Plan`; a path gets told how to load it."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, os.PathLike)):
        raise ValueError(f"{where} takes a Plan, got the path {os.fspath(plan)!r:.200}; load it first with "
                         "al.load_plan(path, model.trace()).")
    raise ValueError(f"{where} takes a Plan (from al.auto_plan, al.megatron_plan, al.load_plan ...), got "
                     f"{type(plan).__name__}.")
