"""Plans as values: stages on submeshes, a sharding strategy per operator, and the cost report.

A :class:`Plan` is immutable. Its cost is a :class:`CostReport` whose step time splits into named terms:

    step_time_s = compute_s + comm_s + reshard_s + bubble_s

where the first three are the work of the pipeline's busiest stage over one step (its kernels' roofline time, the
collectives they run, the resharding between them, as far as they are not hidden behind compute: ``hidden_comm_s``
says how much is) and ``bubble_s`` is the time that stage waits (pipeline fill and
drain, and transfers between stages: ``stage_comm_s`` says how much those cost in all). The step time itself is the
makespan of the event-level pipeline simulation (:mod:`autopar_lab.simulate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.opgraph import OpGraph
    from .overrides import Alternative
    from .precision import Precision
    from .pricing.layers import LayerCost
    from .pricing.table import CostTable
    from .simulate import Timeline
    from .solve.intra import IntraPlan


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous range of layers on a submesh, viewed as a 2D logical mesh."""

    layers: tuple[int, int]  # first and last layer index (inclusive), into Plan.layer_names
    submesh: tuple[int, int]
    logical_mesh: tuple[int, int]
    devices: tuple[int, ...]
    remat: bool | str  # False (none), True (full) or "selective" (autopar_lab.rematmode)
    fwd_s: float  # per microbatch
    bwd_s: float  # per microbatch (optimizer update and gradient synchronisation spread over the microbatches)
    compute_s: float  # per step
    comm_s: float
    reshard_s: float
    static_bytes: float
    act_bytes: float  # per microbatch in flight
    peak_mem_bytes: float
    intra: IntraPlan | None = field(default=None, compare=False, repr=False)  # the IntraPlan of the stage's mesh
    # The full-graph layer costs of ``intra`` (every layer, not only this stage's): what the stage was priced from,
    # kept so that an override re-prices only what it changes. A layer split from its group (Plan.layer_pins) is
    # priced on top of these (pricing.incremental.split_layer_costs), so removing its pins restores its cost.
    layer_costs: tuple[LayerCost, ...] | None = field(default=None, compare=False, repr=False)
    # Interleaved schedule: the layer ranges the stage runs, one per virtual stage (its model chunks; ``layers`` is
    # then the stage's range in the plan's 1F1B layout, which gives its layer count). Empty otherwise.
    chunks: tuple[tuple[int, int], ...] = ()
    # Zero-bubble schedule: the part of ``bwd_s`` that is the weight-gradient task W (0 for the other schedules).
    wgrad_s: float = 0.0
    # Which of its mesh's intra-op solutions the stage's sharding starts from: "fast" (the time-only ILP) or "lean"
    # (weights stored at their least, ZeRO-3 / FSDP style; :meth:`~autopar_lab.pricing.table.CostTable.solutions`),
    # as the stage DP chose it (pins, if any, applied on top).
    solution: str = "fast"

    @property
    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """The (first, last) layer ranges the stage runs: its chunks when interleaved, else ``(layers,)``."""
        return self.chunks or (self.layers,)

    def to_dict(self, layer_names=None) -> dict:
        out: dict[str, Any] = {
            "layers": list(self.layers),
            "submesh": list(self.submesh),
            "logical_mesh": list(self.logical_mesh),
            "devices": [self.devices[0], self.devices[-1] + 1],
            "remat": self.remat,
            "fwd_s": self.fwd_s,
            "bwd_s": self.bwd_s,
            "peak_mem_bytes": self.peak_mem_bytes,
        }
        if layer_names is not None:
            out["layer_names"] = [layer_names[self.layers[0]], layer_names[self.layers[1]]]
        if self.chunks:
            out["chunks"] = [list(c) for c in self.chunks]
            if layer_names is not None:
                out["chunk_layer_names"] = [[layer_names[a], layer_names[b]] for a, b in self.chunks]
        if self.wgrad_s:
            out["wgrad_s"] = self.wgrad_s
        out["solution"] = self.solution
        return out


@dataclass(frozen=True)
class CostReport:
    """Every figure of a plan's cost, in seconds per training step and bytes per device."""

    step_time_s: float
    compute_s: float
    comm_s: float
    reshard_s: float
    stage_comm_s: float
    bubble_s: float
    peak_mem_bytes: tuple[float, ...]
    mem_limit_bytes: float
    samples_per_s: float
    busiest_stage: int
    timeline: Timeline | None = field(default=None, compare=False, repr=False)
    # Communication the busiest stage runs hidden behind its compute (not part of the step time): the data-parallel
    # gradient reduction bucketed behind the last microbatch's backward, parameter gathers prefetched behind the
    # forward.
    hidden_comm_s: float = 0.0
    # Kernels the busiest stage launches per step (forward, recomputation and backward, every microbatch); whether
    # attention ran as one fused (flash) kernel.
    kernels: int = 0
    flash_attention: bool = False
    # Collectives the busiest stage issues per step that every microbatch issues again (tensor-parallel all-reduces,
    # activation resharding; not the once-a-step gradient reduction or parameter gathers) and their latency (the
    # alpha term of each, count x latency of its link class, over all microbatches): part of the collectives term.
    collectives: int = 0
    collective_latency_s: float = 0.0
    # Why this schedule (auto_plan(schedule="auto"): the schedules tried and their steps), or "".
    schedule_choice: str = field(default="", compare=False)
    # Virtual devices (JAX's CPU devices): the stages on a host share its cores and run one task at a time, so the
    # busiest stage also waits while the others run (Device.virtual).
    shared_host: bool = False
    # The fixed cost of the busiest stage's programs a step, part of its compute: each task's launch (the device's
    # task_overhead_s) and, on virtual devices, the state arrays each task takes (pricing.stage.stage_cost). 0 where
    # none is charged (the GPU presets).
    task_s: float = 0.0
    # The busiest stage's re-reads of the gradient chain a step, part of its compute: where the compiler sums the
    # chain again inside each layer's backward kernels (Efficiency.chain_reads; XLA on CPU), a backward program of n
    # layers reads ~n^2/2 links (pricing.stage.chain_pairs). 0 where none is charged (the GPU presets).
    chain_s: float = 0.0
    # The number format the plan is priced in (autopar_lab.precision: "bf16 (bf16 compute, fp32 gradients, ...)"),
    # and whether it is priced only (a format the graph was retyped to: the runtime runs the model's own step).
    precision: str = field(default="", compare=False)
    # What was stored sharded to make the plan fit (the memory-lean solution of a stage), or which part of which stage
    # overflows by how much (autopar_lab.layouts.fit); "" when there is nothing to say.
    fit_note: str = field(default="", compare=False)

    @property
    def fits(self) -> bool:
        """Whether every stage's peak memory is within the device's limit."""
        return all(m <= self.mem_limit_bytes for m in self.peak_mem_bytes)

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
            "compute_s": self.compute_s,
            "comm_s": self.comm_s,
            "reshard_s": self.reshard_s,
            "stage_comm_s": self.stage_comm_s,
            "bubble_s": self.bubble_s,
            "peak_mem_bytes": list(self.peak_mem_bytes),
            "mem_limit_bytes": self.mem_limit_bytes,
            "busiest_stage": self.busiest_stage,
            "hidden_comm_s": self.hidden_comm_s,
            "kernels": self.kernels,
            "flash_attention": self.flash_attention,
            "collectives": self.collectives,
            "collective_latency_s": self.collective_latency_s,
            "task_s": self.task_s,
            "chain_s": self.chain_s,
        }

    def explain(self) -> str:
        """The step time as the sum of its terms, with what each one is."""
        attention = "attention as one fused (flash) kernel" if self.flash_attention else \
            "attention as matmuls and a softmax through memory"
        tl = self.timeline
        how = ""
        if tl is not None and tl.schedule == "interleaved":
            how = (f"; interleaved schedule, {tl.virtual_stages} chunks per stage: fill and drain shrink by "
                   f"{tl.virtual_stages}, transfers grow by as much")
        elif tl is not None and tl.schedule == "zb-h1":
            how = "; zero-bubble schedule (ZB-H1): weight gradients deferred into the drain"
        shared = ", and the other stages running on its host (virtual devices share its cores)" if self.shared_host \
            else ""
        tasks = (f"; of which {self.task_s:.4g} s the fixed cost of its programs: launches and the arrays they take"
                 if self.task_s > 0 else "")
        tasks += (f"; of which {self.chain_s:.4g} s re-reading the gradient chain (the compiler sums the residual "
                  f"stream's gradient again in each layer's backward kernels: quadratic in a program's layers)"
                  if self.chain_s > 0 else "")
        fmt = f"number format {self.precision}; " if self.precision else ""
        return fmt + (
            f"step time {self.step_time_s:.4g} s = compute {self.compute_s:.4g} s (the busiest stage, "
            f"#{self.busiest_stage}, runs {self.kernels:,} fused kernels a step, {attention}{tasks}) + collectives "
            f"{self.comm_s:.4g} s (of which latency {self.collective_latency_s:.4g} s: {self.collectives:,} "
            f"collectives a step, each microbatch pays its own) + resharding {self.reshard_s:.4g} s (over all "
            f"microbatches, what is not hidden) "
            f"+ bubble {self.bubble_s:.4g} s (that stage idle: pipeline fill/drain and waiting for transfers"
            f"{shared}"
            f"; stage transfers cost {self.stage_comm_s:.4g} s per microbatch round trip in all){how}; besides, "
            f"{self.hidden_comm_s:.4g} s of communication runs hidden behind that stage's compute (gradient "
            f"reduction behind the last backward, parameter gathers behind the forward)"
            + (f"; {self.schedule_choice}" if self.schedule_choice else "")
            + (f"; {self.fit_note}" if self.fit_note else "")
        )


@dataclass(frozen=True)
class Plan:
    """A complete parallelization plan of a training step on a cluster."""

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
    # Operators the user fixed (op id -> strategy name): overrides record them so a later re-solve keeps them.
    pins: Mapping[int, str] = field(default_factory=dict, hash=False)
    # Stage decisions the user fixed, which a re-solve keeps (see autopar_lab.overrides): any of "boundaries" (first
    # layer of each stage after the first), "submeshes", "logical_meshes", "remat" (one entry per stage, None where
    # free), "microbatches", "schedule".
    stage_pins: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # The CostTable that priced this plan (layer costs per mesh, cut bytes, batch size): what re-pricing an override
    # needs. Not part of the plan's value.
    table: CostTable | None = field(default=None, compare=False, repr=False)
    # Model chunks per stage: > 1 only for the interleaved schedule (each stage's chunks in Stage.chunks).
    virtual_stages: int = 1
    # Operators of single layers split from the layers that share their solution (full-graph op id -> strategy
    # name; see with_layer_choice): a deep model solved on a shallower copy prices every block by one copy layer,
    # and a layer with pins here is priced on its own instead.
    layer_pins: Mapping[int, str] = field(default_factory=dict, hash=False)

    @property
    def precision(self) -> Precision:
        """The number format the plan is priced in (``precision=`` of the planners; by default the model's own, as
        traced): its graph's, :func:`~autopar_lab.precision.precision_of`."""
        from .precision import precision_of

        return precision_of(self.op_graph)

    @property
    def op_graph(self) -> OpGraph:
        """The graph whose operator ids the stages' strategies use: the plan's own graph, or for a deep zoo model
        planned on a shallower copy, that copy (see :class:`~autopar_lab.pricing.opmap.OpMap`)."""
        return self.table.solve_graph if self.table is not None else self.graph

    def stage_of(self, op: int) -> int:
        """The index of the stage that runs operator ``op`` of :attr:`op_graph`: its layer's stage (no layer: the
        last layer's; an operator of a shallower copy: the stage of the first full-graph layer it stands for)."""
        g = self.op_graph
        try:
            node = g.op(op)
        except (KeyError, IndexError):
            raise ValueError(f"operator {op} is not in this plan's graph (ids run 0..{len(g.ops) - 1})") from None
        if self.table is None:
            names = list(self.layer_names)
            layers = [names.index(node.layer) if node.layer in names else len(names) - 1]
        else:
            layers = self.table.op_map.full_layers_of(op)
        for s, st in enumerate(self.stages):
            if any(a <= i <= b for i in layers for a, b in st.layer_ranges):
                return s
        return len(self.stages) - 1

    def stages_of(self, op: int) -> list[int]:
        """Every stage that runs a full-graph layer operator ``op`` of :attr:`op_graph` stands for (a block of a deep
        model's copy stands for blocks that may span stages; an override of it re-prices each of them)."""
        first = self.stage_of(op)
        if self.table is None:
            return [first]
        layers = self.table.op_map.full_layers_of(op)
        out = [s for s, st in enumerate(self.stages) if any(a <= i <= b for a, b in st.layer_ranges for i in layers)]
        return out or [first]

    def full_stage_of(self, full_op: int) -> int:
        """The stage that runs operator ``full_op`` of the model's full graph (:attr:`graph`): its layer's stage."""
        from .overrides import full_stage_of

        return full_stage_of(self, full_op)

    def full_choice(self, full_op: int) -> Any:
        """The sharding strategy operator ``full_op`` of the full graph (:attr:`graph`) runs with: its own pin if its
        layer is split (:attr:`layer_pins`), else its stand-in's strategy in the stage that runs its layer."""
        from .overrides import full_choice

        return full_choice(self, full_op)

    def choice(self, op: int) -> Any:
        """The sharding strategy of one operator (from the stage that runs its layer)."""
        try:
            k = self.stage_of(op)
        except (KeyError, ValueError, IndexError):
            k = None
        own = self.stages[k].intra if k is not None else None
        if own is not None and op in own.strategies:
            return own.strategies[op]
        for st in self.stages:
            if st.intra is not None and op in st.intra.strategies:
                return st.intra.strategies[op]
        raise KeyError(f"operator {op} is not in this plan")

    # --- overrides: each returns a new Plan, re-estimated (see autopar_lab.overrides) -----------------------------
    # These convenience methods delegate to autopar_lab.overrides (and export), which build on this module: the
    # imports are inside the methods, the one deliberate upward edge of the engine (tests/test_structure.py).
    def with_choice(self, op: int, strategy) -> "Plan":
        """This plan with operator ``op`` run by ``strategy`` (a Strategy, its name, or an output spec like "S0R");
        for a deep model's copy, in every layer that shares ``op``'s solution and on every stage that runs one of
        them (each re-priced), then the pipeline is simulated again."""
        from .overrides import with_choice

        return with_choice(self, op, strategy)

    def with_layer_choice(self, full_op: int, strategy) -> "Plan":
        """This plan with operator ``full_op`` of the full graph (:attr:`graph`) run by ``strategy`` in its layer
        alone: the layer is split from the layers that share its solution (its own pins from then on, in
        :attr:`layer_pins`) and re-priced on its stage's mesh; the other layers keep theirs. For a layer that shares
        its solution with no other (every layer of a model solved on its own graph), the same as
        :meth:`with_choice` on its operator."""
        from .overrides import with_layer_choice

        return with_layer_choice(self, full_op, strategy)

    def with_microbatches(self, n: int) -> "Plan":
        """This plan with ``n`` microbatches (stages and strategies kept), re-simulated; ``n`` is pinned."""
        from .overrides import with_microbatches

        return with_microbatches(self, n)

    def with_stages(self, boundaries=None, submeshes=None, logical_meshes=None, microbatches=None) -> "Plan":
        """This plan with its stages changed: ``boundaries`` the first layer of each stage after the first (or a
        list of (first, last) ranges), ``submeshes`` one (hosts, devices) shape per stage, ``logical_meshes`` one
        (n0, n1) per stage (None entries of either: free, the stage DP picks them around the others). What is not
        given is kept where still valid, else the best from the plan's cost table; stages that do not change keep
        their strategies. What is given is pinned.

        >>> plan.with_stages(boundaries=[6], submeshes=[(1, 4), (1, 4)])   # doctest: +SKIP
        """
        from .overrides import with_stages

        return with_stages(self, boundaries, submeshes, logical_meshes, microbatches)

    def with_schedule(self, schedule: str, virtual_stages: int | None = None) -> "Plan":
        """This plan run with pipeline schedule ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (``virtual_stages``
        model chunks per stage, default 2) or ``"zb-h1"`` (pinned), re-priced and re-simulated."""
        from .overrides import with_schedule

        return with_schedule(self, schedule, virtual_stages)

    def with_remat(self, stage: int, on: bool | str = True) -> "Plan":
        """This plan with rematerialisation of stage ``stage`` switched ``on`` (True: full), off (False) or to
        ``"selective"`` (the attention internals only), pinned: its activation memory and backward time re-priced,
        the pipeline re-simulated."""
        from .overrides import with_remat

        return with_remat(self, stage, on)

    def with_fsdp(self, axes: tuple[int, ...] | None = None) -> "Plan":
        """This plan with every parameter stored sharded over its stage's data-parallel axes (or ``axes``) and
        all-gathered where read, in forward and again in backward: ZeRO-3 / FSDP (each a pin, re-priced); see
        :func:`autopar_lab.parallelism.with_fsdp`."""
        from .parallelism import with_fsdp

        return with_fsdp(self, axes)

    def with_expert_parallel(self, axes: tuple[int, ...] = (), resolve: bool = True) -> "Plan":
        """This plan with the experts of every MoE layer split over mesh ``axes`` (``()``: replicated, EP=1), the
        rest re-solved around them; see :func:`autopar_lab.overrides.with_expert_parallel`."""
        from .overrides import with_expert_parallel

        return with_expert_parallel(self, axes, resolve)

    def alternatives(self, op: int) -> list[Alternative]:
        """Every strategy of ``op`` on its stage's mesh as ``Alternative(strategy, spec, delta_s)`` (the step-time
        change if chosen instead), sorted by ``delta_s``: "why this choice"."""
        from .overrides import alternatives

        return alternatives(self, op)

    def layer_alternatives(self, full_op: int) -> list[Alternative]:
        """Every strategy of operator ``full_op`` of the full graph on its layer's stage mesh, with the step-time
        change of choosing it for that layer alone (:meth:`with_layer_choice`), sorted by ``delta_s``."""
        from .overrides import layer_alternatives

        return layer_alternatives(self, full_op)

    def diff(self, other: "Plan") -> dict:
        """What changed from this plan to ``other``: operators' strategies, stages, microbatches, and step time."""
        from .overrides import diff

        return diff(self, other)

    def to_jax_code(self, stage: int = 0) -> str:
        """Python source that builds one stage's mesh (default the first), the PartitionSpecs / NamedShardings of
        the step's inputs and the sharding constraints of its forward matmuls (see :mod:`autopar_lab.export`)."""
        from .export import to_jax_code

        return to_jax_code(self, stage)

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
            "stages": [s.to_dict(self.layer_names) for s in self.stages],
            "solve_s": dict(self.solve_s),
            "notes": list(self.notes),
        }
        return out

    def __repr__(self) -> str:
        shapes = ", ".join(f"{s.layers[0]}-{s.layers[1]}@{s.submesh[0]}x{s.submesh[1]}" for s in self.stages)
        return (f"Plan({self.method}: {len(self.stages)} stage(s) [{shapes}], {self.microbatches} microbatches, "
                f"step {self.cost.step_time_s:.4g} s)")
