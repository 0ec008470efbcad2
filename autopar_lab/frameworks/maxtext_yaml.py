"""MaxText's configuration (YAML, ``configs/base.yml``'s keys) in and out: read into a priced
:func:`~autopar_lab.layouts.maxtext_plan`, and a plan written back as one.

The keys are MaxText's ``configs/base.yml`` (``tests/data/framework_keys.json`` records the commit they were checked
against). Modelled: ``ici_{data,fsdp,sequence,expert,tensor,pipeline}_parallelism`` and
``dcn_{data,fsdp,pipeline}_parallelism`` (the other ``*_parallelism`` axes must be 1), ``per_device_batch_size``,
``gradient_accumulation_steps``, ``num_pipeline_microbatches``, ``num_layers_per_pipeline_stage`` and
``num_pipeline_repeats`` (repeats > 1: a circular schedule, priced as interleaved), ``remat_policy`` (``full``,
``minimal`` and the policies that save some matmul outputs as "dots" (every matmul output kept), ``none``),
``attention`` (``autoselected``, ``flash``, ``dot_product``: :func:`~autopar_lab.layouts.maxtext_plan`'s),
``max_target_length``, ``model_name`` (``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``llama3.1-*``: the zoo's
Llama 3), ``dtype`` and ``quantization`` (``fp8``). Every other key is listed as ignored.
"""

from __future__ import annotations

from typing import Any

from .common import FRAMEWORK_NAMES, Imported, close_to, integer, model_for
from .planlayout import FrameworkLayout

__all__ = ["AXES_ICI", "AXES_DCN", "looks_like", "parse", "plan_from", "render"]

#: Every ``ici_*`` / ``dcn_*`` axis of base.yml, and those the planner models (the others must be 1).
AXES_ICI = ("data", "fsdp", "fsdp_transpose", "sequence", "context", "context_autoregressive", "tensor",
            "tensor_transpose", "tensor_sequence", "autoregressive", "pipeline", "expert")
AXES_DCN = ("data", "fsdp", "fsdp_transpose", "sequence", "context", "context_autoregressive", "tensor",
            "tensor_transpose", "tensor_sequence", "pipeline", "expert", "autoregressive")
MODELLED_ICI = ("data", "fsdp", "sequence", "expert", "tensor", "pipeline")
MODELLED_DCN = ("data", "fsdp", "pipeline")
#: The other keys the planner models.
MODELLED = ("per_device_batch_size", "gradient_accumulation_steps", "num_pipeline_microbatches",
            "num_layers_per_pipeline_stage", "num_pipeline_repeats", "remat_policy", "max_target_length",
            "model_name", "dtype", "quantization", "attention")
#: base.yml's remat policies: the planner's recomputation for each (None: not modelled).
REMAT: dict[str, bool | str | None] = {
    "full": True, "minimal": "dots", "none": False, "save_dot_with_context_except_mlp": "dots",
    "save_dot_except_mlpwi": "dots", "save_dot_except_mlp": "dots", "save_qkv_proj": "dots",
    "save_out_proj": "dots", "qkv_proj_offloaded": None, "custom": None, "minimal_offloaded": None}
#: MaxText model names in the zoo.
MODELS = {"llama3-8b": "llama3-8b", "llama3-70b": "llama3-70b", "llama3-405b": "llama3-405b",
          "llama3.1-8b": "llama3-8b", "llama3.1-70b": "llama3-70b", "llama3.1-405b": "llama3-405b"}


def _axis_keys() -> list[str]:
    return [f"ici_{a}_parallelism" for a in AXES_ICI] + [f"dcn_{a}_parallelism" for a in AXES_DCN]


def looks_like(text: str) -> bool:
    """Whether ``text`` reads as a MaxText YAML (a parallelism axis or its batch key)."""
    return any(k in text for k in ("_parallelism:", "per_device_batch_size:", "remat_policy:"))


def parse(text: str) -> Imported:
    """The YAML ``text`` read (see the module docstring)."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"the MaxText configuration is not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise ValueError("a MaxText configuration is a YAML mapping of keys (ici_fsdp_parallelism: -1, ...)")
    axes = _axis_keys()
    values: dict[str, Any] = {}
    ignored = []
    for key, value in doc.items():
        key = str(key)
        if key in axes or key in MODELLED:
            values[key] = value
        elif key.endswith("_parallelism"):
            raise ValueError(f"{key} is not a MaxText parallelism axis (base.yml's: {', '.join(axes)})")
        else:
            close_to(key, [*axes, *MODELLED], "MaxText key")
            ignored.append(key)
    for key in axes:
        axis = key[4:-len("_parallelism")]
        modelled = MODELLED_ICI if key.startswith("ici_") else MODELLED_DCN
        if axis not in modelled and integer(values.get(key, 1), key, allow_minus_one=True) != 1:
            raise ValueError(f"{key} is not modelled by the MaxText layout the planner prices (its axes: "
                             f"{', '.join(f'ici_{a}' for a in MODELLED_ICI)}, "
                             f"{', '.join(f'dcn_{a}' for a in MODELLED_DCN)}); set it to 1")
    return Imported("maxtext", values, tuple(ignored))


def plan_from(imp: Imported, model, cluster, **planner):
    """The priced :func:`~autopar_lab.layouts.maxtext_plan` of ``imp`` on ``cluster``."""
    from ..layouts import maxtext_plan

    table = planner.get("table")
    cluster = cluster if cluster is not None else getattr(table, "cluster", None)
    if cluster is None:
        raise ValueError("a MaxText configuration does not say which slices run it; pass cluster= (e.g. "
                         "al.Cluster.parse('tpu-v5p:128'))")
    degrees: dict[str, Any] = {}
    for where, axes in (("ici", MODELLED_ICI), ("dcn", MODELLED_DCN)):
        for a in axes:
            default = -1 if (where, a) in (("ici", "fsdp"), ("dcn", "data")) else 1
            key = f"{where}_{a}_parallelism"
            degrees[f"{where}_{a}"] = integer(imp.get(key, default), key, allow_minus_one=True)
    pdbs = integer(imp.get("per_device_batch_size", 12), "per_device_batch_size")
    batch = pdbs * cluster.num_devices
    policy = str(imp.get("remat_policy", "full"))
    remat = REMAT.get(policy)
    if remat is None:
        raise ValueError(f"remat_policy {policy!r:.40} is not modelled (offloading is not priced); use one of "
                         f"{', '.join(k for k, v in REMAT.items() if v is not None)}")
    if policy not in ("full", "minimal", "none"):
        imp = imp.with_note(f"remat_policy {policy} (some matmul outputs saved) priced as 'dots' (every matmul output "
                            "saved, the rest recomputed)")
    seq = imp.get("max_target_length")
    name = imp.get("model_name", "default")
    zoo = MODELS.get(str(name))
    if model is None and table is not None:
        model = table.graph
    if model is None and zoo is None:
        raise ValueError(f"the MaxText model_name {name!r:.40} is not in the zoo ({', '.join(MODELS)} are); pass the "
                         "model it trains (model=, or the command line's model argument)")
    shape = {"batch_size": batch, "seq_len": None if seq is None else integer(seq, "max_target_length")}
    if zoo is not None and model is None and shape["seq_len"] is None:
        shape["seq_len"] = 2048  # base.yml's max_target_length
    model = model_for(model, shape, zoo=zoo, family=None, name="maxtext", framework="maxtext")
    if table is not None and table.batch_size != batch:
        raise ValueError(f"per_device_batch_size {pdbs} on {cluster.num_devices} chips is a batch of {batch}, not the "
                         f"cost table's {table.batch_size}")
    pp = _pipeline(degrees, cluster)
    kw: dict[str, Any] = {}
    if pp > 1:
        micro = integer(imp.get("num_pipeline_microbatches", -1), "num_pipeline_microbatches", allow_minus_one=True)
        kw["microbatches"] = pp if micro == -1 else micro
        layers = _layers(model, table)
        repeats = integer(imp.get("num_pipeline_repeats", -1), "num_pipeline_repeats", allow_minus_one=True)
        if repeats == -1:
            per = integer(imp.get("num_layers_per_pipeline_stage", 1), "num_layers_per_pipeline_stage")
            if layers % (pp * per):
                raise ValueError(f"num_layers_per_pipeline_stage {per} does not split the {layers} layers over {pp} "
                                 "stages evenly")
            repeats = layers // (pp * per)
        if repeats > 1:
            kw.update(schedule="interleaved", virtual_stages=repeats)
            imp = imp.with_note(f"MaxText's circular pipeline ({repeats} repeats) priced as interleaved 1F1B with "
                                f"{repeats} chunks a stage")
    else:
        kw["microbatches"] = integer(imp.get("gradient_accumulation_steps", 1), "gradient_accumulation_steps")
    prec = _precision(imp)
    attention = str(imp.get("attention", "autoselected"))  # base.yml's default
    plan = maxtext_plan(model if table is None else None, cluster, per_device_batch_size=pdbs, remat=remat,
                        precision=prec, attention=attention, **degrees, **kw, **planner)
    return plan, imp


def _pipeline(degrees: dict, cluster) -> int:
    ici, dcn = degrees["ici_pipeline"], degrees["dcn_pipeline"]
    return (cluster.devices_per_host if ici == -1 else ici) * (cluster.hosts if dcn == -1 else dcn)


def _layers(model, table) -> int:
    from .common import block_count, model_config_value

    layers = model_config_value(model, "num_layers")
    return layers if layers is not None else block_count(table)


def _precision(imp: Imported) -> str:
    if str(imp.get("quantization", "")) in ("fp8", "fp8_full"):
        return "fp8"
    dtype = str(imp.get("dtype", "bfloat16"))
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r:.20}")
    return "bf16" if dtype == "bfloat16" else "fp32"


def _axes_from(lay: FrameworkLayout, cluster) -> dict[str, int]:
    """MaxText's axes for a plan of another framework's layout (one stage: data or FSDP over the data-parallel group,
    tensor and sequence inside a slice)."""
    fw = FRAMEWORK_NAMES["maxtext"]
    if lay.pp > 1:
        raise ValueError(f"this exporter writes {fw}'s pipeline axes only for a plan made with MaxText's layout "
                         "(al.maxtext_plan); export a one-stage plan")
    if lay.ep > 1:
        raise ValueError(f"expert parallelism ep={lay.ep} of another layout is not written as {fw} axes")
    zero = 3 if lay.zero is None else lay.zero
    if zero in (1, 2):
        raise ValueError(f"ZeRO-{zero} (the optimizer state{' and gradients' if zero == 2 else ''} split, the "
                         f"parameters whole) has no {fw} switch: its FSDP axis stores ZeRO-3, its data axis nothing")
    M, H = cluster.devices_per_host, cluster.hosts
    inside = lay.tp * lay.cp
    if M % inside:
        raise ValueError(f"tensor x sequence parallelism ({inside}) does not divide a slice's {M} chips")
    split = "fsdp" if zero == 3 else "data"
    return {f"ici_{split}": M // inside, f"dcn_{split}": H, "ici_tensor": lay.tp, "ici_sequence": lay.cp}


def render(lay: FrameworkLayout, model=None, cluster=None) -> str:
    """``lay`` as a MaxText YAML (``cluster``: the plan's, whose slices the ``ici`` / ``dcn`` axes count); a
    ValueError naming the decision MaxText does not express."""
    fw = FRAMEWORK_NAMES["maxtext"]
    notes = list(lay.notes)
    if lay.origin == "maxtext":
        axes = dict(lay.maxtext_axes)
    else:
        axes = _axes_from(lay, cluster)
        if lay.tp > 1 and not lay.sequence_parallel:
            notes.append("not expressible, written as MaxText's nearest: MaxText keeps the activations between the "
                         "blocks split over its tensor axis (activation_embed), which this plan keeps whole; import "
                         "this file to price that")
        if lay.zero is None:
            notes.append("the plan left the weights' storage to the planner; written as FSDP (ZeRO-3)")
    if lay.precision not in ("bf16", "fp32", "fp8"):
        raise ValueError(f"the {lay.precision} number format has no {fw} switch (dtype bfloat16 or float32)")
    chips = cluster.num_devices
    if lay.batch % chips:
        raise ValueError(f"the batch of {lay.batch} is not a whole number of sequences per chip ({chips} chips)")
    out: dict[str, Any] = {}
    name = {v: k for k, v in MODELS.items() if k.startswith("llama3-")}.get(str(getattr(model, "name", "")))
    if name:
        out["model_name"] = name
    else:
        notes.append(f"the model {getattr(model, 'name', '(not given)')} has no MaxText model_name: set yours")
    seq = getattr(getattr(model, "config", None), "seq_len", None)
    if seq is not None:
        out["max_target_length"] = seq
    out["per_device_batch_size"] = lay.batch // chips
    for where, modelled in (("ici", MODELLED_ICI), ("dcn", MODELLED_DCN)):
        for a in modelled:
            out[f"{where}_{a}_parallelism"] = axes.get(f"{where}_{a}", 1)
    if lay.pp > 1:
        out["num_pipeline_microbatches"] = lay.microbatches
        if lay.blocks % (lay.pp * lay.virtual_stages):
            raise ValueError(f"{lay.virtual_stages} repeats do not split {lay.blocks} layers over {lay.pp} stages")
        out["num_layers_per_pipeline_stage"] = lay.blocks // (lay.pp * lay.virtual_stages)
        if lay.schedule not in ("1f1b", "interleaved"):
            raise ValueError(f"the {lay.schedule} schedule has no {fw} switch")
    else:
        out["gradient_accumulation_steps"] = lay.microbatches
    out["remat_policy"] = {True: "full", "selective": "minimal", "dots": "minimal"}.get(lay.remat, "none")
    out["dtype"] = "float32" if lay.precision == "fp32" else "bfloat16"
    if lay.precision == "fp8":
        out["quantization"] = "fp8"
    lines = [f"# {fw} configuration written by autopar-lab"] + [f"# {n}" for n in notes]
    lines += [f"{k}: {v if not isinstance(v, str) else repr(v)}" for k, v in out.items()]
    return "\n".join(lines) + "\n"
