"""Megatron-LM's command line in and out: a training script's arguments (``pretrain_gpt.py --tensor-model-parallel-size
8 ...``, a shell line or a file, backslash continuations and ``#`` comments allowed) read into a priced
:func:`~autopar_lab.layouts.megatron_plan`, and a plan written back as those arguments.

The flags and their meaning are Megatron-LM's ``megatron/training/arguments.py`` (``tests/data/framework_keys.json``
records the commit they were checked against):

* parallelism: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--context-parallel-size``,
  ``--expert-model-parallel-size`` (the data-parallel size is what the cluster's devices leave, as Megatron-LM
  computes it), ``--num-layers-per-virtual-pipeline-stage`` (the interleaved schedule) with
  ``--microbatch-group-size-per-virtual-pipeline-stage`` (its microbatches per chunk in a row, default the pipeline
  size: :func:`~autopar_lab.layouts.megatron_plan`'s ``microbatch_group``; read only with interleaving, which alone
  uses it), ``--sequence-parallel``,
  ``--use-distributed-optimizer`` (ZeRO-1; without it the optimizer state is whole on every rank: ZeRO-0);
* communication overlapped with compute: ``--overlap-grad-reduce``, ``--overlap-param-gather``, ``--tp-comm-overlap``,
  ``--overlap-moe-expert-parallel-comm`` (:func:`~autopar_lab.layouts.megatron_plan`'s ``overlap_grad_reduce``,
  ``overlap_param_gather``, ``tp_comm_overlap``, ``overlap_moe_comm``; each off without its switch, as in
  Megatron-LM);
* recomputation: ``--recompute-granularity full|selective``, ``--recompute-activations`` (selective),
  ``--checkpoint-activations`` (full, the older name: the checked arguments.py still declares it but exits on it,
  asking for ``--recompute-activations`` or ``--recompute-granularity``);
* CUDA graphs: ``--cuda-graph-impl local|transformer_engine`` (the step's kernels replayed from graphs:
  :func:`~autopar_lab.layouts.megatron_plan`'s ``cuda_graphs=True``, so the eager host's time per kernel,
  :mod:`autopar_lab.backends.eager`, is not paid), ``--cuda-graph-impl none`` (Megatron-LM's default: eager), and
  the deprecated switches ``--enable-cuda-graph`` (read as ``local``) and ``--external-cuda-graph``
  (``transformer_engine``), which Megatron-LM refuses beside a ``--cuda-graph-impl`` other than ``none``, or
  together. Megatron-LM also refuses CUDA graphs with full recomputation. ``--cuda-graph-scope`` (one or more of
  :data:`CUDA_GRAPH_SCOPES`; none: each whole transformer layer captured, Megatron-LM's default) is read where the
  plan expresses it: no scope, ``full_iteration`` (the whole forward and backward as one graph; ``local`` only, as
  Megatron-LM asserts), or scopes that cover each whole layer (``attn`` with ``mlp``, with ``moe`` for a model with
  experts) are the plan with CUDA graphs, priced with no host time per kernel; a scope that leaves part of each layer
  to the eager host (``attn`` alone, ``mlp``, ``moe_router``, ``moe_preprocess``, ``mamba``) is not expressible (the
  host's time is priced per stage's kernels, not per part of a layer) and is dropped with a note, priced as every
  kernel replayed; without CUDA graphs a scope has no effect (as Megatron-LM warns) and is dropped with a note. The
  host's time is priced only with Megatron-LM's kernels (below), so a cost table built without them prices both
  alike. The export writes ``--cuda-graph-impl local`` for a plan with CUDA graphs and no scope (each layer
  captured: what the plan prices; the pricing does not tell the implementations apart);
* batch: ``--micro-batch-size``, ``--global-batch-size`` (default ``micro-batch-size x data-parallel size``);
* number format: ``--bf16``, ``--fp16``, ``--fp8-format e4m3|hybrid`` (fp32 without any);
* the model's shape: ``--num-layers``, ``--hidden-size``, ``--ffn-hidden-size``, ``--num-attention-heads``,
  ``--group-query-attention`` with ``--num-query-groups``, ``--kv-channels``, ``--seq-length``,
  ``--max-position-embeddings``, ``--vocab-size``, ``--swiglu``, ``--normalization``, ``--position-embedding-type``,
  ``--untie-embeddings-and-output-weights``, ``--num-experts``, ``--moe-router-topk``: a Llama-style model (zoo
  family ``llama``) when any of SwiGLU, RMSNorm, RoPE, grouped-query attention or untied embeddings is set, else GPT
  (zoo family ``gpt``: LayerNorm, GELU, learned positions, tied embeddings).

The activations are priced as Megatron-LM's kernels keep them (``megatron_plan(library_kernels=True)``: each fused
kernel keeps its inputs), as ``bench/bench_fidelity.py`` prices its Megatron-LM rows; a cost table passed in keeps its
own setting, and a note says when that is JAX's autodiff's.
"""

from __future__ import annotations

import shlex
from typing import Any

from ..schedules import FlexibleGroup, check_group
from .common import FRAMEWORK_NAMES, Imported, close_to, integer, model_config_value, model_for
from .planlayout import FrameworkLayout

__all__ = ["CUDA_GRAPH_IMPLS", "CUDA_GRAPH_SCOPES", "FLAGS", "OLD_CUDA_GRAPH_SWITCHES", "OVERLAP_SWITCHES",
           "looks_like", "parse", "plan_from", "render", "scope_note"]

#: Flags taking a value: flag -> what it is (int or str).
VALUED = {
    "--tensor-model-parallel-size": int, "--pipeline-model-parallel-size": int, "--context-parallel-size": int,
    "--expert-model-parallel-size": int, "--num-layers-per-virtual-pipeline-stage": int,
    "--recompute-granularity": str, "--micro-batch-size": int, "--global-batch-size": int, "--fp8-format": str,
    "--num-layers": int, "--hidden-size": int, "--ffn-hidden-size": int, "--num-attention-heads": int,
    "--num-query-groups": int, "--kv-channels": int, "--seq-length": int, "--max-position-embeddings": int,
    "--vocab-size": int, "--normalization": str, "--position-embedding-type": str, "--num-experts": int,
    "--moe-router-topk": int, "--recompute-method": str, "--recompute-num-layers": int, "--cuda-graph-impl": str,
    "--microbatch-group-size-per-virtual-pipeline-stage": int,
}
#: Flags taking one or more values (argparse's nargs='+'): flag -> what each value is.
LISTED = {"--cuda-graph-scope": str}
#: Switches (no value).
SWITCHES = ("--sequence-parallel", "--use-distributed-optimizer", "--recompute-activations", "--checkpoint-activations",
            "--bf16", "--fp16", "--group-query-attention", "--swiglu", "--untie-embeddings-and-output-weights",
            "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
            "--overlap-moe-expert-parallel-comm", "--enable-cuda-graph", "--external-cuda-graph")

#: ``--cuda-graph-impl``'s choices ("none": eager, Megatron-LM's default).
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
#: ``--cuda-graph-scope``'s values (its help text; none given: each whole transformer layer is captured).
CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration")
#: Megatron-LM's deprecated CUDA-graph switches -> the ``--cuda-graph-impl`` each stands for (its validate_args).
OLD_CUDA_GRAPH_SWITCHES = {"--enable-cuda-graph": "local", "--external-cuda-graph": "transformer_engine"}

#: Megatron-LM's overlap switches -> (megatron_plan's keyword, the overlap's name in pricing.overlap).
OVERLAP_SWITCHES = {"--overlap-grad-reduce": ("overlap_grad_reduce", "grad_reduce"),
                    "--overlap-param-gather": ("overlap_param_gather", "param_gather"),
                    "--tp-comm-overlap": ("tp_comm_overlap", "tp_comm"),
                    "--overlap-moe-expert-parallel-comm": ("overlap_moe_comm", "moe_comm")}
#: Every flag read.
FLAGS = (*VALUED, *LISTED, *SWITCHES)
#: Flags that mark a Llama-style model.
LLAMA_MARKS = ("--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights")


def looks_like(text: str) -> bool:
    """Whether ``text`` reads as Megatron-LM arguments (one of its parallelism or model flags)."""
    return any(f in text for f in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                   "--micro-batch-size", "--global-batch-size", "--num-layers", "--hidden-size"))


def _tokens(text: str) -> list[str]:
    lines = [ln.split("#", 1)[0] if ln.lstrip().startswith("#") or " #" in ln else ln for ln in text.splitlines()]
    try:
        tokens = shlex.split(" ".join(ln.rstrip().rstrip("\\") for ln in lines))
    except ValueError as e:
        raise ValueError(f"the Megatron-LM arguments do not split as a shell line ({e}); check the quotes") from None
    scripts = [k for k, t in enumerate(tokens) if t.endswith(".py")]
    start = scripts[-1] + 1 if scripts else next((k for k, t in enumerate(tokens) if t.startswith("--")), len(tokens))
    return tokens[start:]


def parse(text: str) -> Imported:
    """The arguments of ``text`` (see the module docstring); a flag this reader does not model is listed as ignored,
    one that reads like a modelled flag misspelt is a ValueError."""
    tokens = _tokens(text)
    values: dict[str, Any] = {}
    ignored: list[str] = []
    k = 0
    while k < len(tokens):
        tok = tokens[k]
        k += 1
        if not tok.startswith("--"):
            raise ValueError(f"Megatron-LM argument {tok!r} is not a flag (flags start with --); quote a value that "
                             "has spaces")
        flag, eq, given = tok.partition("=")
        if flag in SWITCHES:
            if eq:
                raise ValueError(f"{flag} is a switch and takes no value (got {given!r:.20})")
            values[flag] = True
        elif flag in VALUED:
            if not eq:
                if k >= len(tokens) or tokens[k].startswith("--"):
                    raise ValueError(f"{flag} needs a value")
                given, k = tokens[k], k + 1
            if flag in values:
                raise ValueError(f"{flag} is given twice ({values[flag]} and {given}); keep one")
            values[flag] = integer(given, flag) if VALUED[flag] is int else given
        elif flag in LISTED:
            given_all = [given] if eq else []  # --flag=a takes that one value, as argparse does
            while not eq and k < len(tokens) and not tokens[k].startswith("--"):
                given_all.append(tokens[k])
                k += 1
            if not given_all:
                raise ValueError(f"{flag} needs one or more values")
            if flag in values:
                raise ValueError(f"{flag} is given twice; give its values once")
            values[flag] = tuple(given_all)
        else:
            close_to(flag, FLAGS, "Megatron-LM flag")
            ignored.append(flag)
            if not eq and k < len(tokens) and not tokens[k].startswith("--"):
                k += 1  # its value
                while k < len(tokens) and not tokens[k].startswith("--"):
                    k += 1  # a list (--data-path 0.5 a 0.5 b)
    imported = Imported("megatron", values, tuple(dict.fromkeys(ignored)))
    _check(imported)
    return imported


def _check(imp: Imported) -> None:
    gran = imp.get("--recompute-granularity")
    if gran is not None and gran not in ("full", "selective"):
        raise ValueError(f"--recompute-granularity must be full or selective, got {gran!r:.20}")
    if imp.get("--recompute-activations") and gran == "full":
        raise ValueError("--recompute-activations (selective recomputation) contradicts --recompute-granularity full; "
                         "keep one")
    if imp.get("--bf16") and imp.get("--fp16"):
        raise ValueError("--bf16 and --fp16 exclude each other; keep one")
    fp8 = imp.get("--fp8-format")
    if fp8 is not None and fp8 not in ("e4m3", "hybrid"):
        raise ValueError(f"--fp8-format must be e4m3 or hybrid, got {fp8!r:.20}")
    norm = imp.get("--normalization")
    if norm is not None and norm not in ("LayerNorm", "RMSNorm"):
        raise ValueError(f"--normalization must be LayerNorm or RMSNorm, got {norm!r:.20}")
    pos = imp.get("--position-embedding-type")
    if pos is not None and pos not in ("learned_absolute", "rope"):
        raise ValueError(f"--position-embedding-type must be learned_absolute or rope, got {pos!r:.20}")
    seq, most = imp.get("--seq-length"), imp.get("--max-position-embeddings")
    if seq is not None and most is not None and most < seq:
        raise ValueError(f"--max-position-embeddings {most} is shorter than --seq-length {seq}; raise it")
    if imp.get("--num-query-groups") is not None and not imp.get("--group-query-attention"):
        raise ValueError("--num-query-groups takes effect only with --group-query-attention; add it")
    _check_cuda_graphs(imp)


def _check_cuda_graphs(imp: Imported) -> None:
    """Megatron-LM's own checks of its CUDA-graph flags (arguments.py's validate_args)."""
    impl = imp.get("--cuda-graph-impl")
    if impl is not None and impl not in CUDA_GRAPH_IMPLS:
        raise ValueError(f"--cuda-graph-impl must be none, local or transformer_engine, got {impl!r:.30}")
    old = [f for f in OLD_CUDA_GRAPH_SWITCHES if imp.get(f)]
    if len(old) > 1:
        raise ValueError("--enable-cuda-graph and --external-cuda-graph exclude each other; keep one (or write "
                         "--cuda-graph-impl local or transformer_engine instead)")
    if old and impl not in (None, "none"):
        raise ValueError(f"{old[0]} is the deprecated spelling of --cuda-graph-impl {OLD_CUDA_GRAPH_SWITCHES[old[0]]}"
                         f" and Megatron-LM refuses it beside --cuda-graph-impl {impl}; keep one")
    scope = imp.get("--cuda-graph-scope") or ()
    unknown = [v for v in scope if v not in CUDA_GRAPH_SCOPES]
    if unknown:
        raise ValueError(f"--cuda-graph-scope takes {', '.join(CUDA_GRAPH_SCOPES)}; got {unknown[0]!r:.30}")
    if "full_iteration" in scope and (impl == "transformer_engine" or imp.get("--external-cuda-graph")):
        raise ValueError("--cuda-graph-scope full_iteration needs --cuda-graph-impl local (Megatron-LM asserts "
                         "transformer_engine does not capture a whole iteration); change one")
    if _cuda_graphs(imp) and _remat(imp) is True:
        raise ValueError("CUDA graphs exclude full recomputation (--recompute-granularity full or "
                         "--checkpoint-activations), as Megatron-LM asserts; use --recompute-granularity selective "
                         "or drop the CUDA graphs")


def _cuda_graphs(imp: Imported) -> bool:
    """Whether the flags replay the step's kernels from CUDA graphs (any implementation)."""
    impl = imp.get("--cuda-graph-impl")
    return impl not in (None, "none") or any(imp.get(f) for f in OLD_CUDA_GRAPH_SWITCHES)


def _remat(imp: Imported):
    """The recomputation the flags ask for: True (full), "selective" or False."""
    gran = imp.get("--recompute-granularity")
    if gran == "full" or (imp.get("--checkpoint-activations") and gran is None):
        return True
    return "selective" if gran == "selective" or imp.get("--recompute-activations") else False


def _precision(imp: Imported) -> str:
    if imp.get("--fp8-format"):
        return "fp8"
    return "bf16" if imp.get("--bf16") else "fp16" if imp.get("--fp16") else "fp32"


def _shape(imp: Imported, batch: int | None) -> tuple[str | None, dict]:
    """(the zoo family the shape flags describe or None without them, the model's config fields)."""
    if imp.get("--num-layers") is None:
        return None, {"batch_size": batch, "seq_len": imp.get("--seq-length")}
    llama = any(imp.get(f) for f in LLAMA_MARKS) or imp.get("--normalization") == "RMSNorm" \
        or imp.get("--position-embedding-type") == "rope"
    for need in ("--hidden-size", "--num-attention-heads", "--seq-length"):
        if imp.get(need) is None:
            raise ValueError(f"the Megatron-LM arguments give --num-layers but not {need}; give the model's whole "
                             "shape (or leave the shape flags out and pass model=)")
    hidden, heads = imp.get("--hidden-size"), imp.get("--num-attention-heads")
    fields = {"num_layers": imp.get("--num-layers"), "hidden_size": hidden, "num_heads": heads,
              "seq_len": imp.get("--seq-length"), "vocab_size": imp.get("--vocab-size"), "batch_size": batch,
              "dtype": {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}.get(_precision(imp), "float32")}
    ffn = imp.get("--ffn-hidden-size")
    if not llama:
        if ffn is not None and ffn % hidden:
            raise ValueError(f"--ffn-hidden-size {ffn} is not a multiple of --hidden-size {hidden}, which the GPT "
                             "family needs; add --swiglu for a Llama-style model")
        if imp.get("--num-experts"):
            raise ValueError("--num-experts needs a Llama-style model here (add --swiglu); the GPT family has no "
                             "experts")
        fields["mlp_factor"] = 4 if ffn is None else ffn // hidden
        return "gpt", fields
    kv = imp.get("--num-query-groups", 1) if imp.get("--group-query-attention") else heads
    channels = imp.get("--kv-channels")
    if ffn is None:
        # Megatron-LM's default without --ffn-hidden-size: 4h, or with --swiglu two thirds of it rounded down to a
        # multiple of 64 (the gated MLP's three matrices then hold about the parameters of the plain MLP's two).
        ffn = int(4 * hidden * 2 / 3 / 64) * 64 if imp.get("--swiglu") else 4 * hidden
    fields.update(num_kv_heads=kv, ffn_hidden=ffn,
                  head_dim=None if channels is None or channels * heads == hidden else channels,
                  tie_embeddings=not imp.get("--untie-embeddings-and-output-weights"))
    if imp.get("--num-experts"):
        fields.update(num_experts=imp.get("--num-experts"), top_k=imp.get("--moe-router-topk", 2))
    return "llama", fields


def plan_from(imp: Imported, model, cluster, **planner):
    """The priced :func:`~autopar_lab.layouts.megatron_plan` of ``imp`` on ``cluster`` (``planner``: ``table``,
    ``solver``, ``mem_limit_bytes``)."""
    from ..layouts import megatron_plan

    table = planner.get("table")
    cluster = cluster if cluster is not None else getattr(table, "cluster", None)
    if cluster is None:
        raise ValueError("Megatron-LM's arguments do not say how many GPUs run them; pass cluster= (e.g. "
                         "al.Cluster.parse('dgx-h100:8'))")
    tp, pp = imp.get("--tensor-model-parallel-size", 1), imp.get("--pipeline-model-parallel-size", 1)
    cp, ep = imp.get("--context-parallel-size", 1), imp.get("--expert-model-parallel-size", 1)
    n = cluster.num_devices
    if n % (tp * pp * cp):
        raise ValueError(f"tensor x pipeline x context parallel sizes ({tp} x {pp} x {cp}) do not divide the "
                         f"cluster's {n} GPUs; change them or the cluster")
    dp = n // (tp * pp * cp)
    mbs = imp.get("--micro-batch-size", 1)
    batch = imp.get("--global-batch-size", mbs * dp)
    family, fields = _shape(imp, batch)
    if model is None and table is not None:
        model = table.graph
    model = model_for(model, fields if family else {"batch_size": batch, "seq_len": fields["seq_len"]},
                      zoo=None, family=family, name=f"megatron-{family}", framework="megatron")
    have = table.batch_size if table is not None else None
    if have is not None and have != batch:
        raise ValueError(f"--global-batch-size {batch} is not the cost table's batch of {have}; build the table for "
                         "the configuration's batch")
    kw: dict[str, Any] = {}
    per_stage = imp.get("--num-layers-per-virtual-pipeline-stage")
    if per_stage is not None:
        layers = imp.get("--num-layers") or _model_layers(model, table)
        if layers % (pp * per_stage):
            raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_stage} does not divide the {layers} layers "
                             f"of {pp} pipeline stages evenly; pick a divisor of {layers // pp}")
        v = layers // (pp * per_stage)
        if v > 1:
            kw.update(schedule="interleaved", virtual_stages=v)
    group = imp.get("--microbatch-group-size-per-virtual-pipeline-stage")
    if group is not None and "virtual_stages" in kw:
        if batch % (dp * mbs) == 0:  # else megatron_plan says the batch does not split
            check_group(group, pp, batch // (dp * mbs), "--microbatch-group-size-per-virtual-pipeline-stage ")
        kw["microbatch_group"] = group
    elif group is not None:
        imp = imp.with_note(f"--microbatch-group-size-per-virtual-pipeline-stage {group} not read: it orders the "
                            "interleaved schedule's microbatches only, and these arguments do not interleave")
    prec = _precision(imp)
    method, count = imp.get("--recompute-method"), imp.get("--recompute-num-layers")
    if _remat(imp) is True and (method, count) not in ((None, None), ("uniform", 1)):
        imp = imp.with_note(f"--recompute-method {method} --recompute-num-layers {count} priced as every layer "
                            "recomputed in full (the planner recomputes whole stages)")
    if family is not None and imp.get("--vocab-size") is None:
        imp = imp.with_note(f"no --vocab-size (Megatron-LM reads it from the tokenizer): the {family} family's "
                            f"{getattr(model.config, 'vocab_size', '?')} tokens")
    if prec == "fp32":
        imp = imp.with_note("no --bf16, --fp16 or --fp8-format: priced in fp32, as Megatron-LM trains without them")
    old = next((f for f in OLD_CUDA_GRAPH_SWITCHES if imp.get(f)), None)
    if old is not None:
        imp = imp.with_note(f"{old} (deprecated) read as --cuda-graph-impl {OLD_CUDA_GRAPH_SWITCHES[old]}, as "
                            "Megatron-LM does")
    imp = scope_note(imp, model)
    if imp.get("--fp8-format") == "hybrid":
        imp = imp.with_note("--fp8-format hybrid (E4M3 forward, E5M2 gradients) priced as FP8 E4M3 matmuls")
    # Megatron-LM's layers run its own kernels (Transformer Engine's, or its fused bias-GeLU/SwiGLU and norms), each
    # keeping its inputs: priced so unless a cost table was built otherwise (then the table's, said in a note).
    kernels = True if table is None else None
    if table is not None and not table.cluster.device.efficiency.library_kernels:
        imp = imp.with_note("the cost table prices the activations JAX's autodiff keeps, not those Megatron-LM's "
                            "kernels keep; build it on cluster.with_(library_kernels=True) to price those")
    plan = megatron_plan(model if table is None else None, cluster, dp=dp, tp=tp, pp=pp,
                         cp=cp, ep=ep, micro_batch_size=mbs, remat=_remat(imp),
                         zero=1 if imp.get("--use-distributed-optimizer") else 0,
                         sequence_parallel=bool(imp.get("--sequence-parallel")), precision=prec,
                         overlap_grad_reduce=bool(imp.get("--overlap-grad-reduce")),
                         overlap_param_gather=bool(imp.get("--overlap-param-gather")),
                         tp_comm_overlap=bool(imp.get("--tp-comm-overlap")),
                         overlap_moe_comm=bool(imp.get("--overlap-moe-expert-parallel-comm")),
                         cuda_graphs=_cuda_graphs(imp), library_kernels=kernels, **kw,
                         **planner)
    return plan, imp


def scope_note(imp: Imported, model) -> Imported:
    """``imp`` with a note where its ``--cuda-graph-scope`` is not what the plan prices (see the module docstring):
    a scope without CUDA graphs, or one that leaves part of each layer to the eager host."""
    scope = imp.get("--cuda-graph-scope")
    if not scope:
        return imp
    given = " ".join(scope)
    if not _cuda_graphs(imp):
        return imp.with_note(f"--cuda-graph-scope {given} dropped: it has no effect without --cuda-graph-impl local "
                             "or transformer_engine, as Megatron-LM warns")
    experts = bool(imp.get("--num-experts") or model_config_value(model, "num_experts"))
    whole_layer = {"attn", "moe"} if experts else {"attn", "mlp"}
    if "full_iteration" in scope or whole_layer <= set(scope):
        return imp
    return imp.with_note(f"not expressible, dropped: --cuda-graph-scope {given} (the rest of each layer launched by "
                         "the eager host); the host's time is priced per stage's kernels, not per part of a layer, so "
                         "it is priced as every kernel replayed from a graph")


def _model_layers(model, table) -> int:
    from .common import block_count

    layers = model_config_value(model, "num_layers")
    if layers is not None:
        return layers
    if table is not None:
        return block_count(table)
    raise ValueError("--num-layers-per-virtual-pipeline-stage needs the layer count: add --num-layers")


def render(lay: FrameworkLayout, model=None) -> str:
    """``lay`` as Megatron-LM arguments (the model's shape flags too when ``model`` is a zoo GPT or Llama model); a
    ValueError naming the decision Megatron-LM's arguments do not express."""
    fw = FRAMEWORK_NAMES["megatron"]
    if lay.dp_replicate > 1:
        raise ValueError(f"HSDP's replicate groups (dp_replicate={lay.dp_replicate}) have no {fw} switch")
    if lay.zero not in (None, 0, 1):
        raise ValueError(f"ZeRO-{lay.zero} storage ({'parameters, ' if lay.zero == 3 else ''}gradients and optimizer "
                         f"state split over the data-parallel group) has no switch in {fw}'s arguments (its "
                         "distributed optimizer is ZeRO-1): export a plan with zero=0 or 1")
    if lay.schedule not in ("1f1b", "interleaved"):
        raise ValueError(f"the {lay.schedule} schedule is not one {fw} runs (1F1B, or interleaved 1F1B with "
                         "--num-layers-per-virtual-pipeline-stage)")
    if lay.precision not in ("fp32", "fp16", "bf16", "fp8"):
        raise ValueError(f"the {lay.precision} number format has no {fw} switch here (--bf16, --fp16, --fp8-format)")
    args: list[tuple[str, int | str]] = [("--tensor-model-parallel-size", lay.tp),
                                         ("--pipeline-model-parallel-size", lay.pp)]
    if lay.schedule == "interleaved":
        if lay.blocks % (lay.pp * lay.virtual_stages):
            raise ValueError(f"{lay.virtual_stages} model chunks per stage do not split {lay.blocks} layers over "
                             f"{lay.pp} stages evenly, which {fw}'s --num-layers-per-virtual-pipeline-stage needs")
        args.append(("--num-layers-per-virtual-pipeline-stage", lay.blocks // (lay.pp * lay.virtual_stages)))
        if lay.microbatch_group is not None:
            if isinstance(lay.microbatch_group, FlexibleGroup) and lay.microbatch_group < lay.pp:
                raise ValueError(f"microbatch group {int(lay.microbatch_group)} is below the {lay.pp} pipeline stages: "
                                 f"Llama 3's flexible schedule, which {fw} cannot run (it asks "
                                 "--microbatch-group-size-per-virtual-pipeline-stage of at least the pipeline size); "
                                 "export a plan with as many microbatches as stages or more")
            args.append(("--microbatch-group-size-per-virtual-pipeline-stage", int(lay.microbatch_group)))
    args += [(k, v) for k, v in (("--context-parallel-size", lay.cp), ("--expert-model-parallel-size", lay.ep))
             if v > 1]
    switches = []
    if lay.sequence_parallel:
        switches.append("--sequence-parallel")
    if lay.zero == 1:
        switches.append("--use-distributed-optimizer")
    switches += [f for f, (_, name) in OVERLAP_SWITCHES.items() if name in lay.overlap]
    if lay.remat is True:
        args.append(("--recompute-granularity", "full"))
        args.append(("--recompute-method", "uniform"))  # full recomputation needs a method; every layer: uniform 1
        args.append(("--recompute-num-layers", 1))
    elif lay.remat == "selective":
        args.append(("--recompute-granularity", "selective"))
    args += [("--micro-batch-size", lay.sample_per_microbatch), ("--global-batch-size", lay.batch)]
    switches += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp8": ["--bf16"]}.get(lay.precision, [])
    if lay.precision == "fp8":
        args.append(("--fp8-format", "e4m3"))
    if lay.cuda_graphs:
        # Megatron-Core's own capture (the pricing does not tell the implementations apart), with Megatron-LM's
        # default scope, each whole layer: what the plan prices (a whole iteration, full_iteration, prices the same)
        args.append(("--cuda-graph-impl", "local"))
    lines = [f"# {fw} arguments written by autopar-lab (the data-parallel size is what the GPUs leave: {lay.dp})"]
    lines += [f"# {n}" for n in lay.notes]
    lines += [f"{k} {v} \\" for k, v in args] + [f"{s} \\" for s in switches]
    lines += [f"{line} \\" for line in _shape_lines(model)]
    lines[-1] = lines[-1].rstrip(" \\")
    return "\n".join(lines) + "\n"


def _shape_lines(model) -> list[str]:
    """The model's shape flags, for a zoo GPT or Llama model (none for another model)."""
    family, c = getattr(model, "family", None), getattr(model, "config", None)
    if family not in ("gpt", "llama") or c is None:
        return []
    out = [f"--num-layers {c.num_layers}", f"--hidden-size {c.hidden_size}", f"--num-attention-heads {c.num_heads}",
           f"--seq-length {c.seq_len}", f"--max-position-embeddings {c.seq_len}", f"--vocab-size {c.vocab_size}"]
    if family == "gpt":
        return out + [f"--ffn-hidden-size {c.mlp_factor * c.hidden_size}"]
    out += [f"--ffn-hidden-size {c.ffn_hidden}", "--swiglu", "--normalization RMSNorm",
            "--position-embedding-type rope", "--group-query-attention", f"--num-query-groups {c.num_kv_heads}"]
    if c.head_dim is not None and c.head_dim * c.num_heads != c.hidden_size:
        out.append(f"--kv-channels {c.head_dim}")
    if not c.tie_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    if c.num_experts:
        out += [f"--num-experts {c.num_experts}", f"--moe-router-topk {c.top_k}"]
    return out
