"""A plan's decisions in the terms every framework shares (:class:`FrameworkLayout`), read back from the plan: what
:func:`~autopar_lab.frameworks.export_config` writes, or the decision no framework switch expresses.

A plan a framework can run has equal stages (Megatron-LM's split of the transformer blocks, the embedding with the
first and the head with the last: :func:`~autopar_lab.layouts.engine.stage_bounds`), one submesh, logical mesh and
recomputation on every stage, and no per-operator pin. A plan made by a framework layout (``al.megatron_plan``,
``al.fsdp_plan``, ``al.maxtext_plan``, or imported) carries its degrees in its name; any other plan (the auto plan)
is read from its mesh: axis 0 the data-parallel group, axis 1 the tensor-parallel group, its ZeRO stage from
``stage_pins``. Its per-operator sharding is then the framework's own, not the ILP's: the export says so.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from ..rematmode import remat_label, remat_value

__all__ = ["FrameworkLayout", "dropped", "layout_of"]

_NAME = re.compile(r"^(megatron|fsdp|maxtext)\((.*)\)$")


@dataclass(frozen=True)
class FrameworkLayout:
    """The layout a framework runs: ``origin`` (the layout the plan was made with: "megatron", "fsdp", "maxtext", or
    "mesh" for a plan read from its mesh), data-parallel replicas ``dp`` (HSDP's ``dp_replicate`` of them keep whole
    copies of the shards), tensor ``tp``, pipeline ``pp``, context ``cp``, expert ``ep``; ``zero`` (the ZeRO stage,
    None: the planner's storage); ``sequence_parallel``; ``remat``; ``schedule`` and ``virtual_stages``;
    ``microbatches``; ``batch`` (the global batch, sequences); ``blocks`` (the transformer blocks);
    ``maxtext_axes`` (``ici_*`` / ``dcn_*`` degrees, for a MaxText plan), ``notes`` (what the export should say) and
    ``overlap`` (the communication overlapped with compute, :data:`~autopar_lab.pricing.overlap.OVERLAPS` names);
    ``kernel_fusion`` (whether the plan was priced with a compiler's fused kernels, its cluster's
    :class:`~autopar_lab.cluster.Efficiency` field: torchtitan's ``compile``); ``cuda_graphs`` (a Megatron plan's
    kernels replayed from CUDA graphs, ``megatron_plan(cuda_graphs=True)``: Megatron-LM's ``--cuda-graph-impl``);
    ``eager_loss`` (the framework whose eager loss the plan prices, ``fsdp_plan(eager_loss=...)``: "torchtitan",
    "kempnerforge", or "eager" for a plan file's bytes of another; None: the traced step's own) and ``accumulate``
    (the plan's ``stage_pins["accumulate"]``: "unsharded" for gradients held unsharded between microbatches);
    ``microbatch_group`` (the interleaved schedule's microbatches per chunk in a row, ``stage_pins
    ["microbatch_group"]``: Megatron-LM's ``--microbatch-group-size-per-virtual-pipeline-stage``; None: its default).
    """

    origin: str
    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    zero: int | None = None
    sequence_parallel: bool = False
    remat: bool | str = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    microbatches: int = 1
    batch: int = 1
    blocks: int = 1
    precision: str = "fp32"
    maxtext_axes: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    overlap: tuple[str, ...] = ()
    kernel_fusion: bool = True
    cuda_graphs: bool = False
    eager_loss: str | None = None
    accumulate: str | None = None
    microbatch_group: int | None = None

    @property
    def sample_per_microbatch(self) -> int:
        """Sequences one data-parallel rank runs per microbatch (Megatron-LM's ``--micro-batch-size``)."""
        return self.batch // (self.dp * self.microbatches)

    def with_(self, **changes) -> FrameworkLayout:
        return dataclasses.replace(self, **changes)


def _items(inside: str) -> tuple[dict[str, str], set[str]]:
    pairs, flags = {}, set()
    for part in filter(None, inside.split(",")):
        if "=" in part:
            k, v = part.split("=", 1)
            pairs[k] = v
        else:
            flags.add(part)
    return pairs, flags


def _check_expressible(plan, fw: str) -> None:
    """A ValueError naming the first decision of ``plan`` no switch of framework ``fw`` expresses."""
    from ..layouts.engine import stage_bounds

    if plan.pins:
        op, pin = next(iter(plan.pins.items()))
        raise ValueError(f"the plan pins operator {op}'s sharding to {pin.strategy} ({len(plan.pins)} pin(s) in "
                         f"all); {fw} has no switch for one operator's sharding: drop the pins "
                         "(plan.without_pin) to export it")
    stages = plan.stages
    first = stages[0]
    for k, st in enumerate(stages[1:], 1):
        if tuple(st.submesh) != tuple(first.submesh) or tuple(st.logical_mesh) != tuple(first.logical_mesh):
            raise ValueError(f"stage {k} runs on a {st.submesh[0]}x{st.submesh[1]} submesh as a "
                             f"{tuple(st.logical_mesh)} mesh and stage 0 on {first.submesh[0]}x{first.submesh[1]} as "
                             f"{tuple(first.logical_mesh)}; {fw} runs every stage on the same mesh")
        if remat_label(st.remat) != remat_label(first.remat):
            raise ValueError(f"stage {k} recomputes {remat_label(st.remat)} and stage 0 {remat_label(first.remat)}; "
                             f"{fw} recomputes the same way on every stage")
    if plan.table is None:
        raise ValueError("the plan has no cost table (it was loaded without one); plan it again to export it")
    bounds = stage_bounds(plan.table, len(stages))
    for k, st in enumerate(stages):
        if tuple(st.layers) != (bounds[k], bounds[k + 1] - 1):
            raise ValueError(f"stage {k} runs layers {st.layers[0]}-{st.layers[1]}, but {fw} splits the transformer "
                             f"blocks evenly (layers {bounds[k]}-{bounds[k + 1] - 1} there): uneven stages are not "
                             "expressible")


def layout_of(plan, fw: str) -> FrameworkLayout:
    """``plan``'s layout (see the module docstring); a ValueError naming the decision framework ``fw`` (its name, for
    messages) cannot express."""
    from .common import block_count

    _check_expressible(plan, fw)
    first = plan.stages[0]
    n0, n1 = first.logical_mesh
    precision, written = _format_name(plan.precision)
    base = dict(pp=len(plan.stages), remat=remat_value(first.remat), schedule=plan.schedule,
                virtual_stages=plan.virtual_stages, microbatches=plan.microbatches, batch=plan.table.batch_size,
                blocks=block_count(plan.table), precision=precision,
                kernel_fusion=plan.cluster.device.efficiency.kernel_fusion,
                eager_loss=_eager_loss(plan), accumulate=plan.stage_pins.get("accumulate"),
                microbatch_group=plan.stage_pins.get("microbatch_group") if plan.schedule == "interleaved" else None)
    layout = _layout(plan, fw, base, n0, n1)
    return layout if written is None else layout.with_(notes=(*layout.notes, written))


def _eager_loss(plan) -> str | None:
    """Whose eager loss ``plan`` prices: the framework its layout's name says (``fsdp_plan``'s ",torchtitan-loss"),
    "eager" for bytes a plan file pins without one, None for none."""
    if not plan.stage_pins.get("eager_loss"):
        return None
    m = _NAME.match(plan.method)
    flags = _items(m.group(2))[1] if m else set()
    return next((f[:-len("-loss")] for f in sorted(flags) if f.endswith("-loss")), "eager")


#: What each framework runs in place of a plan's eager loss (an export note's words).
_OWN_LOSS = {"megatron": "its own fused, vocabulary-parallel cross-entropy",
             "torchtitan": "its float32 loss, eager with compile = false and compiled with compile = true",
             "maxtext": "its loss inside the traced, fused step"}


def dropped(lay: FrameworkLayout, fw: str) -> tuple[str, ...]:
    """The export notes for what ``lay`` prices that framework ``fw`` ("megatron", "torchtitan", "maxtext") has no
    switch for, each dropped from the configuration written (importing it prices the plan without it); for
    torchtitan, also the eager loss its ``compile = false`` brings that the plan did not price."""
    name = {"megatron": "Megatron-LM", "torchtitan": "torchtitan", "maxtext": "MaxText"}[fw]
    notes = []
    if lay.cuda_graphs and fw != "megatron":
        notes.append(f"not expressible, dropped: the plan's CUDA graphs (Megatron-LM's --cuda-graph-impl, every "
                     f"kernel launched from a graph); {name} has no switch for them: import this file to price it "
                     "without them")
    expressed = fw == "torchtitan" and lay.eager_loss == "torchtitan" and not lay.kernel_fusion
    if lay.eager_loss is not None and not expressed:
        whose = {"torchtitan": "torchtitan's float32 loss computed eagerly",
                 "kempnerforge": "KempnerForge's bf16 loss on logits gathered whole, held through the backward"}.get(
            lay.eager_loss, "an eager framework's loss")
        why = ("with compile = true (the plan's fused kernels) torchtitan compiles its loss too"
               if lay.eager_loss == "torchtitan" else f"{name} runs {_OWN_LOSS[fw]}")
        notes.append(f"not expressible, dropped: {whose} (eager_loss); {why}: import this file to price that")
    if fw == "torchtitan" and lay.eager_loss is None and not lay.kernel_fusion:
        notes.append("compile = false also computes torchtitan's float32 loss op by op, which importing this file "
                     "prices (eager_loss='torchtitan') and this plan does not")
    if lay.microbatch_group is not None and fw != "megatron":
        notes.append(f"not expressible, dropped: the interleaved schedule's microbatch groups of "
                     f"{lay.microbatch_group} (Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage); "
                     f"{name} has no switch for them: import this file to price the default order")
    if lay.accumulate is not None:
        how = {"torchtitan": "torchtitan reduce-scatters the gradients every microbatch"}.get(
            fw, f"{name} has no switch to hold them so")
        notes.append("not expressible, dropped: the gradients held unsharded in float32 between "
                     f"microbatches (accumulate, FSDP2 without a gradient sync); {how}: import this file to price "
                     "that")
    return tuple(notes)


def _format_name(fmt) -> tuple[str, str | None]:
    """The format a framework's switch names for ``fmt``, and a note when the plan's is a model's own traced one (a
    bfloat16 step whose gradients JAX keeps in bfloat16: the frameworks' bf16 mixed precision, fp32 gradients)."""
    from ..precision import TRACED

    if fmt.name != TRACED:
        return fmt.name, None
    name = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(fmt.compute, fmt.name)
    return name, f"the model's own {fmt.compute} step written as the framework's {name} mixed precision"


def _layout(plan, fw: str, base: dict, n0: int, n1: int) -> FrameworkLayout:
    """The plan's degrees: from its layout function's name, else from its mesh (module docstring)."""
    m = _NAME.match(plan.method)
    if m is None:
        zero = plan.stage_pins.get("zero")
        notes = (f"the layout of the {plan.method} plan: each operator's sharding is {fw}'s own, not the planner's "
                 "choice (import this configuration to price it)",)
        lean = [k for k, st in enumerate(plan.stages) if getattr(st, "solution", "fast") == "lean"]
        if zero is None and lean:
            zero = 3  # the memory-lean solution stores the state as ZeRO-3 does
        return FrameworkLayout("mesh", dp=n0, tp=n1, zero=zero, notes=notes, **base)
    kind, (pairs, flags) = m.group(1), _items(m.group(2))
    if "ilp" in flags:
        raise ValueError(f"the plan's sharding is the ILP's on {kind}'s layout (sharding='ilp'), not the framework's "
                         f"own; {fw} has no switch for it: plan it with sharding='megatron' to export it")
    num = {k: int(v) for k, v in pairs.items() if v.lstrip("-").isdigit()}
    if kind == "megatron":
        remat = True if "remat" in flags else "selective" if "selective" in flags else False
        return FrameworkLayout("megatron", dp=num["dp"], tp=num["tp"], cp=num.get("cp", 1), ep=num.get("ep", 1),
                               zero=num.get("zero"), sequence_parallel="sp" in flags,
                               overlap=tuple(plan.stage_pins.get("overlap", ())), cuda_graphs="graphs" in flags,
                               **{**base, "pp": num["pp"], "remat": remat})
    if kind == "fsdp":
        zero = num.get("zero", 2 if "no-reshard" in flags else 3)
        remat = True if "full" in flags else "selective" if "selective" in flags else "dots" if "dots" in flags \
            else "selective-op" if "selective-op" in flags else False  # fsdp_plan names torchtitan's op SAC so
        rep = num.get("dp_replicate", 1)
        return FrameworkLayout("fsdp", dp=rep * num["dp_shard"], dp_replicate=rep, tp=num.get("tp", 1),
                               cp=num.get("cp", 1), ep=num.get("ep", 1), zero=zero, sequence_parallel="sp" in flags,
                               **{**base, "remat": remat})
    axes = {k: v for k, v in num.items() if k.startswith(("ici_", "dcn_"))}

    def deg(name: str) -> int:
        return axes.get(f"ici_{name}", 1) * axes.get(f"dcn_{name}", 1)

    fsdp = deg("fsdp")
    zero = num.get("zero", 3 if fsdp > 1 else 0)
    # maxtext_plan keeps the activations split over the tensor axis (activation_embed): sequence parallelism
    return FrameworkLayout("maxtext", dp=deg("data") * fsdp * deg("expert"), tp=deg("tensor"), cp=deg("sequence"),
                           ep=deg("expert"), zero=zero, sequence_parallel=deg("tensor") > 1, maxtext_axes=axes,
                           **base)
