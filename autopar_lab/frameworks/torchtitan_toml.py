"""torchtitan's job configuration (TOML) in and out: read into a priced :func:`~autopar_lab.layouts.fsdp_plan`, and a
plan written back as one.

The sections and keys are torchtitan's ``torchtitan/config/job_config.py`` (``tests/data/framework_keys.json``
records the commit they were checked against). Modelled: ``[parallelism]`` ``data_parallel_replicate_degree``,
``data_parallel_shard_degree`` (-1: the devices the others leave), ``tensor_parallel_degree`` (with sequence
parallelism, which torchtitan always applies with TP), ``pipeline_parallel_degree``, ``pipeline_parallel_schedule``
(``1F1B``, ``Interleaved1F1B``, ``GPipe``, ``ZBVZeroBubble``), ``pipeline_parallel_layers_per_stage`` (the chunks of
an interleaved schedule; torchtitan's default is 2 a rank), ``pipeline_parallel_microbatch_size``,
``context_parallel_degree``, ``fsdp_reshard_after_forward`` (``never``: ZeRO-2, else ZeRO-3);
``[activation_checkpoint] mode`` (``none``, ``selective``, ``full``); ``[training]`` ``local_batch_size`` (per
data-parallel rank), ``global_batch_size`` (more than ``local x dp``: gradient accumulation), ``seq_len``,
``mixed_precision_param``, ``compile`` (false: eager PyTorch, :func:`~autopar_lab.layouts.fsdp_plan`'s
``compile=False``; left out, the cluster's own kernels, fused on every preset; written back as the plan was
priced: false for an eager plan, true for fused kernels); ``[model]`` ``name``, ``flavor``
(``llama3`` ``8B``/``70B``/``405B``: the zoo's Llama 3),
``converters`` (``float8``: FP8 matmuls); ``[liger_kernel] enable_fused_linear_cross_entropy``.

The loss (issue 31; ``tests/data/framework_keys.json``'s ``loss_note`` says where each was read): torchtitan calls
the model for its logits, then its cross-entropy on them cast to float32, op by op, ``torch.compile`` wrapping it only
with ``compile = true`` (``components/loss.py`` ``build_cross_entropy_loss``). A file that says ``compile = false``
is priced with that eager loss (:func:`~autopar_lab.layouts.fsdp_plan`'s ``eager_loss="torchtitan"``,
:mod:`autopar_lab.pricing.eagerloss`) unless Liger's fused linear cross-entropy replaces logits and loss; with
``compile = true`` the compiled loss is priced as the traced step's own (fused); left out, as the kernels are (the
cluster's own), and a note says so. Its gradient accumulation (``global_batch_size`` over ``local_batch_size`` x the
data-parallel degree, no key of its own) runs each microbatch's backward with FSDP2's gradient sync on: the gradients
are reduce-scattered every microbatch, never held unsharded (``accumulate_unsharded`` stays False). The export writes
``compile = false`` for a plan priced eager, which torchtitan runs with that loss; what the TOML cannot say (another
framework's loss, gradients held unsharded, CUDA graphs) is dropped with a note.
"""

from __future__ import annotations

import tomllib
from typing import Any

from .common import FRAMEWORK_NAMES, Imported, integer, model_for
from .planlayout import FrameworkLayout

__all__ = ["KEYS", "looks_like", "parse", "plan_from", "render"]

#: Every key of the sections read, as torchtitan's job config declares them (a key outside these is a ValueError).
KEYS = {
    "parallelism": ("data_parallel_replicate_degree", "enable_compiled_autograd", "data_parallel_shard_degree",
                    "fsdp_reshard_after_forward", "tensor_parallel_degree", "disable_loss_parallel",
                    "enable_async_tensor_parallel", "pipeline_parallel_degree", "pipeline_parallel_split_points",
                    "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers", "pipeline_parallel_layers_per_stage",
                    "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
                    "pipeline_parallel_microbatch_size", "context_parallel_degree", "context_parallel_rotate_method",
                    "expert_parallel_degree"),
    "training": ("dataset", "dataset_path", "local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps",
                 "enable_cpu_offload", "mixed_precision_param", "mixed_precision_reduce", "compile", "gc_freq",
                 "gc_debug", "seed", "deterministic"),
    "activation_checkpoint": ("mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns"),
    "model": ("name", "flavor", "tokenizer_path", "converters", "print_after_conversion"),
    "liger_kernel": ("enable_fused_linear_cross_entropy",),
}
#: The keys the planner models (the rest of :data:`KEYS` is listed as ignored).
MODELLED = {
    "parallelism": ("data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                    "tensor_parallel_degree", "pipeline_parallel_degree", "pipeline_parallel_split_points",
                    "module_fqns_per_model_part", "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule",
                    "pipeline_parallel_microbatch_size", "context_parallel_degree", "expert_parallel_degree",
                    "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers"),
    "training": ("local_batch_size", "global_batch_size", "seq_len", "mixed_precision_param", "compile"),
    "activation_checkpoint": ("mode", "selective_ac_option"),
    "model": ("name", "flavor", "converters"),
    "liger_kernel": ("enable_fused_linear_cross_entropy",),
}
#: torchtitan's schedule names -> the planner's (ZBVZeroBubble's V-shaped zero bubble priced as ZB-H1).
SCHEDULES = {"1F1B": "1f1b", "Interleaved1F1B": "interleaved", "GPipe": "gpipe", "ZBVZeroBubble": "zb-h1"}
#: torchtitan's Llama 3 flavors in the zoo.
FLAVORS = {"8B": "llama3-8b", "70B": "llama3-70b", "405B": "llama3-405b"}


def looks_like(text: str) -> bool:
    """Whether ``text`` reads as a torchtitan TOML (one of its sections)."""
    return any(f"[{s}]" in text for s in KEYS)


def parse(text: str) -> Imported:
    """The TOML ``text`` read (see the module docstring)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"the torchtitan configuration is not TOML ({e})") from None
    values: dict[str, Any] = {}
    ignored = []
    for section, body in doc.items():
        if not isinstance(body, dict):
            raise ValueError(f"torchtitan's configuration has sections ([parallelism], [training], ...), not a "
                             f"top-level key {section!r}")
        known = KEYS.get(section)
        for key, value in body.items():
            if known is not None and key not in known:
                raise ValueError(f"[{section}] {key} is not a torchtitan key (its keys: {', '.join(known)})")
            if known is not None and key in MODELLED[section]:
                values[f"{section}.{key}"] = value
            else:
                ignored.append(f"{section}.{key}")
    return Imported("torchtitan", values, tuple(ignored))


def _degree(imp: Imported, key: str, default: int = 1, allow_minus_one: bool = False) -> int:
    return integer(imp.get(f"parallelism.{key}", default), f"[parallelism] {key}", allow_minus_one=allow_minus_one)


def _compile(value: Any) -> bool | None:
    """``[training] compile`` as fsdp_plan's ``compile`` (None where the file leaves it out)."""
    if value is None or isinstance(value, bool):
        return value
    raise ValueError(f"[training] compile must be true or false, got {value!r:.20}")


def plan_from(imp: Imported, model, cluster, **planner):
    """The priced :func:`~autopar_lab.layouts.fsdp_plan` of ``imp`` on ``cluster``."""
    from ..layouts import fsdp_plan

    fw = "torchtitan"
    table = planner.get("table")
    cluster = cluster if cluster is not None else getattr(table, "cluster", None)
    if cluster is None:
        raise ValueError("a torchtitan configuration does not say how many GPUs run it; pass cluster= (e.g. "
                         "al.Cluster.parse('dgx-h100:8'))")
    rep, tp, pp, cp = (_degree(imp, k) for k in ("data_parallel_replicate_degree", "tensor_parallel_degree",
                                                 "pipeline_parallel_degree", "context_parallel_degree"))
    shard = _degree(imp, "data_parallel_shard_degree", -1, allow_minus_one=True)
    ep = _degree(imp, "expert_parallel_degree")
    for key in ("pipeline_parallel_split_points", "module_fqns_per_model_part"):
        if imp.get(f"parallelism.{key}"):
            raise ValueError(f"[parallelism] {key} places the stage cuts by hand; the planner splits the blocks "
                             "evenly: remove it (or give pipeline_parallel_layers_per_stage)")
    n = cluster.num_devices
    if shard == -1:
        if n % (rep * tp * pp * cp):
            raise ValueError(f"the degrees ({rep} x {tp} x {pp} x {cp}) do not divide the cluster's {n} GPUs")
        shard = n // (rep * tp * pp * cp)
    dp = rep * shard
    local = integer(imp.get("training.local_batch_size", 8), "[training] local_batch_size")
    batch = integer(imp.get("training.global_batch_size", -1), "[training] global_batch_size", allow_minus_one=True)
    batch = local * dp if batch == -1 else batch
    if batch % (local * dp):
        raise ValueError(f"[training] global_batch_size {batch} is not a multiple of local_batch_size x data "
                         f"parallel degree ({local} x {dp}); change one")
    accumulate = batch // (local * dp)
    per_mb = local
    if pp > 1:
        per_mb = integer(imp.get("parallelism.pipeline_parallel_microbatch_size", 1),
                         "[parallelism] pipeline_parallel_microbatch_size")
        if local % per_mb:
            raise ValueError(f"[parallelism] pipeline_parallel_microbatch_size {per_mb} does not divide "
                             f"local_batch_size {local}")
    microbatches = accumulate * (local // per_mb)
    kw: dict[str, Any] = {}
    sched = imp.get("parallelism.pipeline_parallel_schedule", "1F1B")
    if pp > 1:
        if sched not in SCHEDULES:
            raise ValueError(f"[parallelism] pipeline_parallel_schedule {sched!r:.30} is not modelled; use one of "
                             f"{', '.join(SCHEDULES)}")
        kw["schedule"] = SCHEDULES[sched]
        if sched == "ZBVZeroBubble":
            imp = imp.with_note("ZBVZeroBubble (two V-placed chunks a rank) priced as ZB-H1")
        imp = imp.with_note("torchtitan weighs the embedding and the head as a layer each when it cuts stages "
                            "(pipeline_parallel_first/last_stage_less_layers); priced with the blocks split evenly, "
                            "the embedding on the first stage and the head on the last")
    mode = imp.get("activation_checkpoint.mode", "selective")
    modes: dict[str, bool | str] = {"none": False, "selective": "selective", "full": True}
    remat = modes.get(mode)
    if remat is None:
        raise ValueError(f"[activation_checkpoint] mode must be none, selective or full, got {mode!r:.20}")
    option = str(imp.get("activation_checkpoint.selective_ac_option", "2"))
    if remat == "selective" and option != "op":
        imp = imp.with_note(f"selective_ac_option {option} (every {option}th layer recomputed in full) priced as "
                            "the op-level policy (selective-op) on every layer")
    prec = _precision(imp)
    name, flavor = imp.get("model.name", "llama3"), imp.get("model.flavor")
    zoo = FLAVORS.get(str(flavor)) if name == "llama3" else None
    seq = imp.get("training.seq_len")
    shape = {"batch_size": batch, "seq_len": None if seq is None else integer(seq, "[training] seq_len")}
    if model is None and table is not None:
        model = table.graph
    if model is None and zoo is None:
        raise ValueError(f"the torchtitan model {name!r} flavor {flavor!r} is not in the zoo (llama3 "
                         f"{', '.join(FLAVORS)} are); pass the model it trains (model=, or the command line's "
                         "model argument)")
    if zoo is not None and model is None and shape["seq_len"] is None:
        shape["seq_len"] = 2048  # torchtitan's default seq_len
    model = model_for(model, shape, zoo=zoo, family=None, name=fw, framework=fw)
    if table is not None and table.batch_size != batch:
        raise ValueError(f"the configuration's global batch of {batch} is not the cost table's {table.batch_size}")
    reshard = imp.get("parallelism.fsdp_reshard_after_forward", "default")
    if reshard not in ("default", "always", "never"):
        raise ValueError(f"[parallelism] fsdp_reshard_after_forward must be default, always or never, got "
                         f"{reshard!r:.20}")
    if pp > 1 and kw["schedule"] == "interleaved":
        lps = imp.get("parallelism.pipeline_parallel_layers_per_stage")
        layers = _layers(model, table)
        if lps is None:
            kw["virtual_stages"] = 2
        else:
            lps = integer(lps, "[parallelism] pipeline_parallel_layers_per_stage")
            if layers % (pp * lps):
                raise ValueError(f"pipeline_parallel_layers_per_stage {lps} does not split the {layers} layers over "
                                 f"{pp} ranks evenly")
            kw["virtual_stages"] = layers // (pp * lps)
    compiled = _compile(imp.get("training.compile"))
    loss, imp = _loss(imp, compiled, pp)
    plan = fsdp_plan(model if table is None else None, cluster, dp_shard=shard,
                     dp_replicate=rep, tp=tp, pp=pp, cp=cp, ep=ep, reshard_after_forward=reshard != "never",
                     microbatches=microbatches, remat=remat, precision=prec, compile=compiled, eager_loss=loss,
                     **kw, **planner)
    return plan, imp


def _loss(imp: Imported, compiled: bool | None, pp: int) -> tuple[str | None, Imported]:
    """fsdp_plan's ``eager_loss`` for the file (see the module docstring), and the import with a note saying how its
    loss was priced."""
    liger = imp.get("liger_kernel.enable_fused_linear_cross_entropy", False)
    if not isinstance(liger, bool):
        raise ValueError(f"[liger_kernel] enable_fused_linear_cross_entropy must be true or false, got {liger!r:.20}")
    if liger and pp > 1:
        raise ValueError("[liger_kernel] enable_fused_linear_cross_entropy is refused by torchtitan with pipeline "
                         "parallelism; set it false or pipeline_parallel_degree = 1")
    if liger:
        return None, imp.with_note("the loss is Liger's fused linear cross-entropy (no logits held): priced as the "
                                   "traced step's own fused loss")
    if compiled is False:
        return "torchtitan", imp.with_note("compile = false: torchtitan computes its float32 cross-entropy op by op "
                                           "after the model, priced at its backward (eager_loss='torchtitan')")
    if compiled is None:
        return None, imp.with_note("compile left out (torchtitan's default is false, its loss then computed op by "
                                   "op in float32): priced with the cluster's own kernels and the traced step's "
                                   "loss; write compile = false to price torchtitan's eager loss")
    return None, imp


def _layers(model, table) -> int:
    from .common import block_count, model_config_value

    layers = model_config_value(model, "num_layers")
    if layers is None and table is not None:
        layers = block_count(table)
    if layers is None:
        raise ValueError("the interleaved schedule needs the model's layer count: pass a zoo model")
    return layers


def _precision(imp: Imported) -> str:
    param = imp.get("training.mixed_precision_param", "bfloat16")
    if param not in ("bfloat16", "float32"):
        raise ValueError(f"[training] mixed_precision_param must be bfloat16 or float32, got {param!r:.20}")
    converters = imp.get("model.converters", [])
    converters = [converters] if isinstance(converters, str) else list(converters)
    if "float8" in converters:
        return "fp8"
    return "bf16" if param == "bfloat16" else "fp32"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def render(lay: FrameworkLayout, model=None) -> str:
    """``lay`` as a torchtitan TOML; a ValueError naming the decision torchtitan's job config does not express."""
    fw = FRAMEWORK_NAMES["torchtitan"]
    notes = list(lay.notes)
    zero = lay.zero
    if zero is None:
        zero = 3
        notes.append("the plan left the weights' storage to the planner; torchtitan's FSDP stores them as ZeRO-3")
    if zero == 1:
        raise ValueError(f"ZeRO-1 (the optimizer state alone split, Megatron-LM's distributed optimizer) has no {fw} "
                         "switch (FSDP splits gradients too: ZeRO-2 or 3; DDP splits nothing)")
    if lay.tp > 1 and not lay.sequence_parallel:
        raise ValueError(f"tensor parallelism without sequence parallelism has no {fw} switch ({fw} always splits "
                         "the norms over the tensor group)")
    rep, shard = (lay.dp_replicate, lay.dp // lay.dp_replicate) if zero else (lay.dp, 1)
    if rep > 1 and (lay.tp > 1 or lay.cp > 1):
        raise ValueError(f"{'DDP' if not zero else 'HSDP'} replicas ({rep}) beside tensor or context parallelism need "
                         "a third mesh axis the planner's 2-D mesh does not have")
    schedule = {v: k for k, v in SCHEDULES.items()}.get(lay.schedule)
    if lay.pp > 1 and schedule is None:
        raise ValueError(f"the {lay.schedule} schedule has no {fw} name")
    if lay.precision not in ("bf16", "fp32", "fp8"):
        raise ValueError(f"the {lay.precision} number format has no {fw} switch (mixed_precision_param is bfloat16 "
                         "or float32)")
    per_mb = lay.sample_per_microbatch
    par: dict[str, Any] = {"data_parallel_replicate_degree": rep, "data_parallel_shard_degree": shard,
                           "fsdp_reshard_after_forward": "never" if zero == 2 else "always",
                           "tensor_parallel_degree": lay.tp, "pipeline_parallel_degree": lay.pp,
                           "context_parallel_degree": lay.cp}
    if lay.ep > 1:
        par["expert_parallel_degree"] = lay.ep
    local = per_mb
    if lay.pp > 1:
        par["pipeline_parallel_schedule"] = schedule
        par["pipeline_parallel_microbatch_size"] = per_mb
        local = per_mb * lay.microbatches
        if lay.schedule == "interleaved":
            if lay.blocks % (lay.pp * lay.virtual_stages):
                raise ValueError(f"{lay.virtual_stages} chunks a rank do not split {lay.blocks} layers over {lay.pp} "
                                 "ranks evenly")
            par["pipeline_parallel_layers_per_stage"] = lay.blocks // (lay.pp * lay.virtual_stages)
    training: dict[str, Any] = {"local_batch_size": local, "global_batch_size": lay.batch,
                                "mixed_precision_param": "float32" if lay.precision == "fp32" else "bfloat16",
                                "compile": lay.kernel_fusion}  # priced eager (fsdp_plan(compile=False)): false
    seq = getattr(getattr(model, "config", None), "seq_len", None)
    if seq is not None:
        training["seq_len"] = seq
    mode = {True: "full", "selective": "selective", "dots": "selective", "selective-op": "selective"}.get(
        lay.remat, "none")  # op SAC: selective-op (or dots, its nearest)
    ac: dict[str, Any] = {"mode": mode}
    if mode == "selective":
        ac["selective_ac_option"] = "op"
    mdl: dict[str, Any] = {"name": "llama3"}
    flavor = {v: k for k, v in FLAVORS.items()}.get(str(getattr(model, "name", "")))
    if flavor:
        mdl["flavor"] = flavor
    else:
        notes.append(f"the model {getattr(model, 'name', '(not given)')} has no torchtitan flavor: set [model] "
                     "flavor to yours")
    if lay.precision == "fp8":
        mdl["converters"] = ["float8"]
    lines = [f"# {fw} job configuration written by autopar-lab"] + [f"# {n}" for n in notes]
    for section, body in (("model", mdl), ("training", training), ("parallelism", par), ("activation_checkpoint", ac)):
        lines += ["", f"[{section}]"] + [f"{k} = {_toml(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"
