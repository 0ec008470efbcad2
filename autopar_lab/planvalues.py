"""A plan's value types: what pricing computes and a :class:`~autopar_lab.plan.Plan` holds.

:class:`Stage` (one pipeline stage: its layers, submesh, logical mesh, times and memory) and :class:`CostReport` (the
step time as a sum of named terms) are plain data: the pricing layer builds them (:mod:`autopar_lab.pricing.price`)
and the plans layer puts them into a ``Plan``, whose behaviour (overrides, alternatives, export) lives above
pricing (:mod:`autopar_lab.plan`). A cost report's step time splits as

    step_time_s = compute_s + comm_s + reshard_s + host_s + bubble_s

where the first three are the work of the pipeline's busiest stage over one step (its kernels' roofline time, the
collectives they run, the resharding between them, as far as they are not hidden behind compute: ``hidden_comm_s``
says how much is), ``host_s`` the time that stage's GPU waits on a host launching each kernel from Python (a plan
run by eager PyTorch, ``stage_pins["host"]``: a microbatch lasts at least its kernels x
``host_launch_s``; 0 for every other plan) and ``bubble_s`` is the time that stage waits (pipeline fill and drain,
and transfers between stages: ``stage_comm_s`` says how much those cost in all). The step time itself is the
makespan of the event-level pipeline simulation (:mod:`autopar_lab.simulate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

if TYPE_CHECKING:
    from .backends.cpu import CpuCost
    from .pricing.layers import LayerCost
    from .simulate import Timeline
    from .solve.intra import IntraPlan

#: An override's scope: the operator in every layer that shares its layer's solution, or in its layer alone.
SHARED, LAYER = "shared", "layer"
SCOPES = (SHARED, LAYER)


class Pin(NamedTuple):
    """A strategy the user fixed for an operator (``Plan.pins``: operator of ``plan.graph`` -> Pin): its name, and
    its scope: ``"shared"`` (every layer sharing the operator's solution runs it) or ``"layer"`` (the operator's layer
    alone, split from the others). A re-solve keeps it.

    >>> Pin("S0R = S0R x RR") == ("S0R = S0R x RR", "shared")
    True
    """

    strategy: str
    scope: str = SHARED


def as_pins(pins: Mapping[int, Any]) -> dict[int, Pin]:
    """``pins`` with every value a :class:`Pin` (a strategy name alone is a shared pin; a pair is (name, scope))."""
    return {int(op): p if isinstance(p, Pin) else Pin(*p) if isinstance(p, tuple) else Pin(str(p))
            for op, p in pins.items()}


def layer_scoped(pins: Mapping[int, Pin]) -> dict[int, str]:
    """The pins of single layers split from their solution's layers, as operator -> strategy name (what pricing
    prices on their own)."""
    return {op: p.strategy for op, p in pins.items() if p.scope == LAYER}


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
    # kept so that an override re-prices only what it changes. A layer split from its group (a "layer" Plan.pins) is
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


def _size(nbytes: float) -> str:
    """Bytes as explain() writes them: GiB from 1 GiB up, MiB below."""
    return f"{nbytes / 2**30:.4g} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.4g} MiB"


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
    # The CPU's own terms (backends.cpu.CpuCost: stages sharing a host, the programs' fixed cost, the gradient
    # chain's re-reads); None on a GPU or TPU, whose reports and explain() never show them.
    cpu: CpuCost | None = None
    # The number format the plan is priced in (autopar_lab.precision: "bf16 (bf16 compute, fp32 gradients, ...)"),
    # and whether it is priced only (a format the graph was retyped to: the runtime runs the model's own step).
    precision: str = field(default="", compare=False)
    # What was stored sharded to make the plan fit (the memory-lean solution of a stage), or which part of which stage
    # overflows by how much (autopar_lab.layouts.fit); "" when there is nothing to say.
    fit_note: str = field(default="", compare=False)
    # A plan whose framework launches each kernel from Python (stage_pins["host"] = "eager"): the fitted host seconds
    # per kernel (backends.eager.host_launch_s; 0: a compiled program) and what waiting on that host adds to the
    # busiest stage's busy time a step (0 where the GPU is the bound).
    host_launch_s: float = 0.0
    host_s: float = 0.0
    # A plan whose framework holds the gradients unsharded between microbatches (stage_pins["accumulate"],
    # pricing.accumulate): the stage where that adds most, its float32 gradients held whole over the FSDP group and
    # the shard they replace (bytes a device; 0: not held so).
    accumulate_stage: int = 0
    unsharded_grad_bytes: float = 0.0
    grad_shard_bytes: float = 0.0
    # A plan pricing an eager framework's loss (stage_pins["eager_loss"], pricing.eagerloss): its logits-sized bytes
    # a step, the stage computing it, that stage's microbatches and what the loss adds there at its backward.
    eager_loss_bytes: float = 0.0
    loss_stage: int = 0
    loss_microbatches: int = 1
    loss_extra_bytes: float = 0.0

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
            **({"host_s": self.host_s, "host_launch_s": self.host_launch_s} if self.host_launch_s else {}),
            **({"accumulate_stage": self.accumulate_stage, "unsharded_grad_bytes": self.unsharded_grad_bytes,
                "grad_shard_bytes": self.grad_shard_bytes} if self.unsharded_grad_bytes else {}),
            **({"eager_loss_bytes": self.eager_loss_bytes, "loss_stage": self.loss_stage,
                "loss_extra_bytes": self.loss_extra_bytes} if self.eager_loss_bytes else {}),
            **(self.cpu.to_dict() if self.cpu is not None else {}),
        }

    def host_note(self) -> str:
        """explain()'s host term: what waiting on an eager host adds (the formula with its figures), "" for a plan
        whose framework runs compiled programs."""
        if not self.host_launch_s:
            return ""
        launched = self.kernels * self.host_launch_s
        bound = ("the host is the bound: the GPU waits on it" if self.host_s > 0 else
                 "under the GPU's time: hidden")
        return (f"+ host {self.host_s:.4g} s (eager launches, each microbatch at least its kernels x "
                f"{self.host_launch_s * 1e6:.3g} us of host time: {self.kernels:,} kernels a step = "
                f"{launched:.4g} s, {bound}) ")

    def memory_note(self) -> str:
        """explain()'s memory terms a framework adds (each with its formula and figures): the gradients held unsharded
        between microbatches and an eager loss; "" for a plan with neither."""
        out = ""
        if self.unsharded_grad_bytes:
            out += (f"; memory: gradients held unsharded between microbatches on stage #{self.accumulate_stage}: "
                    f"{_size(self.unsharded_grad_bytes)} = its parameters' elements / tensor split x 4 B (float32, "
                    f"whole over the FSDP group) in place of its {_size(self.grad_shard_bytes)} gradient shard, "
                    f"+{_size(self.unsharded_grad_bytes - self.grad_shard_bytes)}")
        if self.eager_loss_bytes:
            out += (f"; memory: eager loss on stage #{self.loss_stage}: +{_size(self.loss_extra_bytes)} = max(0, "
                    f"({_size(self.eager_loss_bytes)} of logits-sized tensors a step - the head's kept activations) "
                    f"/ {self.loss_microbatches} microbatches - its average layer's working set - the state not yet "
                    "held then: FSDP2 keeps no bf16 parameter shard, nor a gradient on a step of one microbatch)")
        return out

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
        shared = self.cpu.bubble_note() if self.cpu is not None else ""
        tasks = self.cpu.compute_note() if self.cpu is not None else ""
        fmt = f"number format {self.precision}; " if self.precision else ""
        return fmt + (
            f"step time {self.step_time_s:.4g} s = compute {self.compute_s:.4g} s (the busiest stage, "
            f"#{self.busiest_stage}, runs {self.kernels:,} fused kernels a step, {attention}{tasks}) + collectives "
            f"{self.comm_s:.4g} s (of which latency {self.collective_latency_s:.4g} s: {self.collectives:,} "
            f"collectives a step, each microbatch pays its own) + resharding {self.reshard_s:.4g} s (over all "
            f"microbatches, what is not hidden) "
            + self.host_note()
            + f"+ bubble {self.bubble_s:.4g} s (that stage idle: pipeline fill/drain and waiting for transfers"
            f"{shared}"
            f"; stage transfers cost {self.stage_comm_s:.4g} s per microbatch round trip in all){how}; besides, "
            f"{self.hidden_comm_s:.4g} s of communication runs hidden behind that stage's compute (gradient "
            f"reduction behind the last backward, parameter gathers behind the forward)"
            + (f"; {self.schedule_choice}" if self.schedule_choice else "")
            + self.memory_note()
            + (f"; {self.fit_note}" if self.fit_note else "")
        )
