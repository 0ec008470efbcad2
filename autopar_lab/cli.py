"""The `autopar-lab` command line. Every command takes `--json` and then prints one JSON object on stdout.

Bad input exits with status 2 and one sentence on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import Callable, Sequence

from .rematmode import remat_label, remat_value
from .schedules import SCHEDULES, FlexibleGroup


#: What ``plan --export`` writes.
FRAMEWORK_CHOICES = ("megatron", "torchtitan", "maxtext")


class UsageError(Exception):
    """Bad input from the command line: printed as one sentence, exit status 2."""


def _whole_number(text: str, what: str) -> int:
    """``int(text)``; a number too large for Python to read (past its 4300-digit limit, whose own message tells the
    user to raise it) is a UsageError saying it is too large; other bad text raises int's ValueError."""
    try:
        return int(text)
    except ValueError:
        digits = text.strip().lstrip("+-").replace("_", "")
        if digits.isdigit():
            raise UsageError(f"{what} is a {len(digits):,}-digit number, far too large") from None
        raise


def _int_arg(text: str) -> int:
    """argparse's type for every ``type=int`` flag: one short sentence for a bad or huge number."""
    try:
        return _whole_number(text, "the value")
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r:.40}") from None


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", int, _int_arg)  # argparse looks type=int up here: every int flag parses with it

    def error(self, message: str):  # argparse's default prints the whole usage block; one sentence is the contract
        raise UsageError(f"{message} (see `{self.prog} --help`)")


#: Model fields the CLI takes as flags: (flag, config field, help).
MODEL_FLAGS = (
    ("--layers", "num_layers", "the number of layers"),
    ("--batch", "batch_size", "the global batch size (sequences)"),
    ("--seq-len", "seq_len", "the sequence length (models with attention; 4096 and up offers ring attention)"),
    ("--hidden", "hidden_size", "the hidden size"),
    ("--ffn", "ffn_hidden", "the FFN width (llama-*, deepseek-*: the dense layers')"),
    ("--heads", "num_heads", "the number of attention (query) heads"),
    ("--kv-heads", "num_kv_heads", "the number of key/value heads (grouped-query attention: llama-*, mixtral, qwen3)"),
    ("--vocab", "vocab_size", "the vocabulary size"),
    ("--experts", "num_experts", "the number of routed experts (MoE models)"),
    ("--top-k", "top_k", "experts per token (MoE models)"),
)


def _model(args):
    """The model the command names: a zoo name or a config.json (a path to it or its folder), with the flags'
    fields replaced."""
    from . import models

    overrides = {}
    if getattr(args, "dtype", None) is not None:
        overrides["dtype"] = args.dtype
    is_file = os.path.exists(args.model) or args.model.lower().endswith(".json")
    fields = None if is_file else models.fields(args.model)
    for flag, field, _ in MODEL_FLAGS:
        value = getattr(args, field, None)
        if value is None:
            continue
        if fields is not None and field not in fields:  # one sentence naming the flag, not the config's field list
            raise UsageError(f"{flag} does not apply to {args.model!r} (it has no {field.replace('_', ' ')}); "
                             f"its fields are {', '.join(fields)}")
        overrides[field] = value
    if is_file:
        return models.from_config(args.model, **overrides)
    return models.get(args.model, **overrides)


def cmd_graph(args) -> dict:
    """The captured graph: operators, FLOPs by primitive and role, bytes; the matmuls of the first layer of each
    kind by module."""
    from .graph.modules import layer_operators

    model = _model(args)
    graph = model.trace()
    out = graph.summary()
    out["model"] = model.name
    out["flops_by_layer"] = graph.flops_by("layer")
    out["layer_modules"] = layer_operators(graph)
    return out


def _print_graph(out: dict) -> None:
    print(f"{out['model']}: {out['num_ops']} operators, {out['num_layers']} layers, traced in {out['trace_s']:.2f} s")
    print(f"  parameters {out['param_count']:,} ({out['param_bytes'] / 2**30:.2f} GiB)")
    print(f"  FLOPs per step {out['total_flops']:.4g}")
    for role, flops in out["flops_by_role"].items():
        print(f"    {role:<10} {flops:.4g}")
    print("  top primitives by FLOPs:")
    for prim, flops in list(out["flops_by_primitive"].items())[:6]:
        print(f"    {prim:<22} {flops:.4g}")
    for block in out.get("layer_modules", ()):  # the first layer of each kind (dense, experts)
        print(f"  {block['layer']}'s matmuls (forward; the backward's too with --json):")
        for o in block["operators"]:
            if o["role"] == "forward":
                print(f"    {o['label'] or '?':<22} {o['shapes']}")
    for w in out["warnings"]:
        print(f"  warning: {w}")


def _cluster(args):
    from .cluster import Cluster

    return Cluster.parse(args.cluster)


def _progress(args):
    if args.json:
        return None

    def show(what, done, total):
        # A bar when the total is known (the planned meshes, the microbatch counts of the stage DP), else a count.
        if total:
            filled = int(20 * min(done, total) / total)
            bar = f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total}"
        else:
            bar = f"({done} meshes)"
        print(f"\r  solving: {bar} {what}        ", end="", file=sys.stderr, flush=True)

    return show


def _precision(args):
    """``--precision``, checked before anything is traced (None: the model's own format)."""
    text = getattr(args, "precision", None)
    if text is None:
        return None
    from .precision import as_precision

    try:
        return as_precision(text)
    except ValueError as e:
        raise UsageError(f"--precision: {str(e).rstrip('.')}") from None


def _microbatches(text):
    if text is None or text == "auto":
        return "auto"
    try:
        return _whole_number(text, "--microbatches")
    except ValueError:
        raise UsageError(f"--microbatches must be a number or 'auto', got {text!r:.40}") from None


def _solution_text(stage: dict) -> str:
    """A stage's mesh solution as its line shows it: ", lean sharding" for the memory-lean one, else nothing."""
    return ", lean sharding (weights stored at their least)" if stage.get("solution") == "lean" else ""


def _remat_text(value) -> str:
    """A stage's remat as its line shows it: " remat" (full), " selective remat", or nothing."""
    return {"full": " remat", "selective": " selective remat"}.get(remat_label(value), "")


def cmd_plan(args) -> dict:
    """Plan a model on a cluster: Alpa's auto plan, a Megatron-style or data-parallel baseline, or a framework's
    configuration (``--from-config``); ``--export`` adds the plan as a framework's configuration."""
    if args.from_config:
        return _plan_from_config(args)
    if args.model is None:
        raise UsageError("give the model to plan (a zoo name or a config.json), or --from-config FILE")
    if args.remat and args.selective_remat:
        raise UsageError("--remat (full recomputation) and --selective-remat exclude each other; give one")
    remat = remat_value("selective" if args.selective_remat else args.remat)
    if (args.remat or args.selective_remat) and args.method == "auto":
        raise UsageError("--remat applies to --method megatron or data; the auto plan chooses rematerialisation per "
                         "stage itself")
    given = [f"--{k}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(args, k) is not None]
    given += [flag for flag, on in (("--sequence-parallel", args.sequence_parallel),
                                    ("--micro-batch-size", args.micro_batch_size is not None),
                                    ("--microbatch-group", args.microbatch_group is not None)) if on]
    if given and args.method != "megatron":
        raise UsageError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --method megatron only; the "
                         f"{args.method} method chooses its own layout (drop {given[0]} or add --method megatron)")
    if args.expressible_in and args.method != "auto":
        raise UsageError(f"--expressible-in applies to --method auto (the best plan {args.expressible_in} can run); "
                         f"the {args.method} method's layout is fixed: drop one")
    schedule, virtual = _schedule(args)
    if args.microbatch_group is not None and schedule != "interleaved":
        raise UsageError("--microbatch-group orders the interleaved schedule's microbatches; add --schedule "
                         "interleaved or drop --microbatch-group")
    if args.flexible_group and args.microbatch_group is None:
        raise UsageError("--flexible-group marks the --microbatch-group N as Llama 3's flexible schedule's; add "
                         "--microbatch-group N or drop --flexible-group")
    group = FlexibleGroup(args.microbatch_group) if args.flexible_group else args.microbatch_group
    if args.out:
        check_writable_file(args.out, "--out")  # before planning: a bad path must not cost the user the plan
    # Checks that need no model first: a usage error should not pay for loading JAX (~2 CPU-s).
    mb = _microbatches(args.microbatches)
    if args.method == "megatron":
        if None in (args.dp, args.tp, args.pp):
            raise UsageError("--method megatron needs --dp, --tp and --pp")
        if args.micro_batch_size is not None and args.microbatches is not None:
            raise UsageError("--micro-batch-size and --microbatches both set the microbatch count (the batch over "
                             "dp x micro-batch size); give one")
    cluster = _cluster(args)
    fmt, model = _precision(args), _model(args)
    from . import planner

    notes: list[str] = []
    if args.method == "auto":
        # The stage DP prices each schedule with its own formula; "auto" plans each and keeps the fastest.
        plan = planner.auto_plan(model, cluster, microbatches=mb, stage_comm=args.stage_comm,
                                 schedule=schedule, virtual_stages=virtual if schedule == "interleaved" else None,
                                 on_progress=_progress(args), precision=fmt, expressible_in=args.expressible_in)
    elif args.method == "megatron":
        plan = planner.megatron_plan(model, cluster, dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp or 1,
                                     ep=args.ep or 1,
                                     microbatches=None if args.micro_batch_size is not None else mb,
                                     micro_batch_size=args.micro_batch_size, remat=remat, schedule=schedule,
                                     virtual_stages=virtual, precision=fmt, zero=args.zero,
                                     sequence_parallel=args.sequence_parallel,
                                     microbatch_group=group)
    else:
        plan = planner.data_parallel_plan(model, cluster, microbatches=1 if mb == "auto" else mb, remat=remat,
                                          precision=fmt, zero=args.zero)
    if schedule not in (plan.schedule, "auto"):
        try:
            plan = plan.with_schedule(schedule, virtual)
        except ValueError as e:
            raise UsageError(f"the {args.method} plan ({len(plan.stages)} stage(s), {plan.microbatches} "
                             f"microbatch(es)) cannot run the {schedule} schedule: {str(e).rstrip('.')}") from None
    out = plan.report(model.name)
    out["cluster"] = args.cluster
    out["notes"] = list(out.get("notes", [])) + notes
    from .pricing.memory import memory_breakdown

    out["memory"] = memory_breakdown(plan)  # each stage's peak split into parameters, gradients, ... activations
    from .parallelism import expert_degree, summary

    out["expert_parallel"] = expert_degree(plan)  # 1: replicated experts (or no MoE layer)
    out["parallelism"] = summary(plan)  # one line per newer dimension the plan uses (EP, FSDP, sequence parallel)
    _export(args, plan, model, out)
    if args.out:
        from .planfile import save_plan

        try:
            save_plan(plan, args.out)  # the plan file `train --plan` and al.load_plan read (its cluster included)
        except OSError as e:
            raise UsageError(f"cannot write --out {args.out!r} ({e.strerror or e})") from None
        out["plan_file"] = os.path.abspath(args.out)
    return out


def _plan_from_config(args) -> dict:
    """``plan --from-config FILE``: the framework configuration priced (the model from the positional argument, or
    from the configuration when it names one)."""
    from .frameworks import import_config

    clash = [flag for flag, given in (("--method", args.method != "auto"), ("--dp", args.dp is not None),
                                      ("--tp", args.tp is not None), ("--pp", args.pp is not None),
                                      ("--cp", args.cp is not None), ("--ep", args.ep is not None),
                                      ("--zero", args.zero is not None),
                                      ("--sequence-parallel", args.sequence_parallel),
                                      ("--micro-batch-size", args.micro_batch_size is not None),
                                      ("--remat", args.remat), ("--selective-remat", args.selective_remat),
                                      ("--microbatches", args.microbatches is not None),
                                      ("--schedule", args.schedule is not None),
                                      ("--virtual-stages", args.virtual_stages is not None),
                                      ("--precision", args.precision is not None),
                                      ("--expressible-in", args.expressible_in is not None)) if given]
    if clash:
        raise UsageError(f"{clash[0]} conflicts with --from-config (the configuration sets the layout, batch and "
                         "number format); drop it")
    if not os.path.exists(args.from_config):
        raise UsageError(f"--from-config {args.from_config!r}: no such file")
    if args.out:
        check_writable_file(args.out, "--out")
    model = _model(args) if args.model is not None else None
    plan = import_config(args.from_config, model, _cluster(args))
    out = plan.report(getattr(model, "name", None))
    out["cluster"] = args.cluster
    from .pricing.memory import memory_breakdown

    out["memory"] = memory_breakdown(plan)
    _export(args, plan, model, out)
    if args.out:
        from .planfile import save_plan

        save_plan(plan, args.out)
        out["plan_file"] = os.path.abspath(args.out)
    return out


def _export(args, plan, model, out: dict) -> None:
    """``--export FRAMEWORK``: the plan as that framework's configuration, in ``out["config_text"]``."""
    if not getattr(args, "export", None):
        return
    from .frameworks import export_config

    try:
        out["config_text"] = export_config(plan, args.export, model=model)
    except ValueError as e:
        raise UsageError(f"--export {args.export}: {str(e).rstrip('.')}") from None
    out["config_framework"] = args.export


def _schedule(args) -> tuple[str, int | None]:
    """``--schedule`` and ``--virtual-stages``, checked together."""
    from .schedules import check_schedule

    schedule = args.schedule or "1f1b"
    if schedule == "auto":
        if getattr(args, "method", "auto") != "auto":
            raise UsageError(f"--schedule auto applies to --method auto only; give the {args.method} plan a "
                             f"schedule ({', '.join(SCHEDULES)})")
        if args.virtual_stages is not None:
            raise UsageError("--virtual-stages goes with --schedule interleaved; --schedule auto tries 2 and 4")
        return "auto", None
    if args.virtual_stages is not None and schedule != "interleaved":
        raise UsageError("--virtual-stages applies to --schedule interleaved only (add it, or drop --virtual-stages)")
    try:
        return check_schedule(schedule, args.virtual_stages)
    except ValueError as e:
        raise UsageError(f"--virtual-stages: {str(e).rstrip('.')}") from None


def _print_plan(out: dict) -> None:
    from .backends import cost_note

    sched = out["schedule"] + (f" with {out['virtual_stages']} chunks per stage" if "virtual_stages" in out else "")
    print(f"\n{out['model']} on {out['cluster']} ({out['method']}): step {out['step_time_s']:.4g} s, "
          f"{out['samples_per_s']:.4g} samples/s, {out['microbatches']} microbatches, {sched}")
    if out.get("precision_text"):
        print(f"  number format: {out['precision_text']}")
    print(f"  compute {out['compute_s']:.4g} s + collectives {out['comm_s']:.4g} s (latency "
          f"{out.get('collective_latency_s', 0.0):.4g} s of {out.get('collectives', 0):,} a step) + resharding "
          f"{out['reshard_s']:.4g} s"
          + (f" + host {out['host_s']:.4g} s (eager launches, {out['host_launch_s'] * 1e6:.3g} us a kernel)"
             if "host_s" in out else "")
          + f" + bubble {out['bubble_s']:.4g} s (stage transfers {out['stage_comm_s']:.4g} s; "
          f"{out.get('hidden_comm_s', 0.0):.4g} s of communication hidden behind compute; "
          f"{out.get('kernels', 0):,} kernels a step on the busiest stage"
          + cost_note(out) + ")")
    memory = out.get("memory") or [None] * len(out["stages"])
    for k, (st, mem) in enumerate(zip(out["stages"], memory)):
        names = st.get("layer_names", ["", ""])
        unit, scale = ("GiB", 2**30) if st["peak_mem_bytes"] >= 2**30 else ("MiB", 2**20)
        parts = "" if mem is None else " = " + " + ".join(
            f"{label} {mem[key] / scale:.2f}" for key, label in (
                ("params_bytes", "params"), ("grads_bytes", "grads"), ("master_bytes", "master"),
                ("optimizer_bytes", "optimizer"), ("copies_bytes", "copies"), ("fp8_copies_bytes", "fp8 copies"),
                ("buffers_bytes", "buffers"),
                ("recompute_bytes", "recompute"), ("activations_bytes", "activations")) if mem[key])
        if st.get("chunks"):  # interleaved: the stage runs its chunks, not one range
            where = "chunks " + ", ".join(
                f"{a}-{b} ({x} .. {y})" if a != b else f"{a} ({x})"
                for (a, b), (x, y) in zip(st["chunks"], st.get("chunk_layer_names", st["chunks"])))
        else:
            where = f"layers {st['layers'][0]}-{st['layers'][1]} ({names[0]} .. {names[1]})"
        print(f"  stage {k}: {where} on submesh "
              f"{st['submesh'][0]}x{st['submesh'][1]} as {st['logical_mesh'][0]}x{st['logical_mesh'][1]}"
              f"{_remat_text(st['remat'])}{_solution_text(st)}, peak {st['peak_mem_bytes'] / scale:.2f} {unit}"
              f"{parts}")
    gib = 2**30
    if out.get("unsharded_grad_bytes"):  # the terms explain() gives (CostReport.memory_note)
        print(f"  gradients held unsharded between microbatches (float32, whole over the FSDP group): stage "
              f"{out['accumulate_stage']} holds {out['unsharded_grad_bytes'] / gib:.2f} GiB in place of its "
              f"{out['grad_shard_bytes'] / gib:.2f} GiB shard")
    if out.get("eager_loss_bytes"):
        print(f"  eager loss: {out['eager_loss_bytes'] / gib:.2f} GiB of logits-sized tensors a step; stage "
              f"{out['loss_stage']} holds {out['loss_extra_bytes'] / gib:.2f} GiB more at its backward than its "
              "average layer's working set")
    for line in out.get("parallelism", []):
        print(f"  {line}")
    for note in out.get("notes", []):
        print(f"  note: {note}")
    print(f"  planning took {out['solve_s'].get('total', 0):.1f} s")
    if out.get("config_text"):
        print(f"\n# the plan as a {out['config_framework']} configuration:\n{out['config_text']}", end="")


def cmd_compare(args) -> dict:
    """Auto vs the best Megatron-style configuration vs data parallelism."""
    from . import planner

    fmt = _precision(args)
    model, cluster = _model(args), _cluster(args)
    res = planner.compare(model, cluster, microbatches=_microbatches(args.microbatches), precision=fmt)
    out = {"model": model.name, "cluster": args.cluster, "precision": res["auto"].precision.name,
           "precision_text": res["auto"].cost.precision}
    for key in ("auto", "megatron_best", "data_parallel"):
        plan = res[key]
        out[key] = None if plan is None else plan.report(model.name)
    best = res["megatron_best"]
    out["megatron_best_over_auto"] = (best.cost.step_time_s / res["auto"].cost.step_time_s) if best else None
    out["megatron_tried"] = res["megatron_tried"]
    return out


def _print_compare(out: dict) -> None:
    if out.get("precision_text"):
        print(f"number format: {out['precision_text']}")
    for key in ("auto", "megatron_best", "data_parallel"):
        r = out[key]
        if r is None:
            print(f"{key:<15} no configuration fits")
        else:
            peak = max(r["peak_mem_bytes"])
            fits = "" if peak <= r["mem_limit_bytes"] else (
                f"; does not fit: {peak / 2**30:.3g} GiB per device > {r['mem_limit_bytes'] / 2**30:.3g} GiB")
            print(f"{key:<15} {r['method']:<28} step {r['step_time_s']:.4g} s  ({len(r['stages'])} stages, "
                  f"{r['microbatches']} microbatches{fits})")
    if out["megatron_best_over_auto"]:
        print(f"megatron_best / auto = {out['megatron_best_over_auto']:.3f}")


MAX_VALIDATE_DEVICES = 64


def cmd_validate(args) -> dict:
    """The intra-op plan against what XLA compiles and runs on N local devices."""
    import jax

    from .validate import validate_plan

    if not 1 <= args.devices <= MAX_VALIDATE_DEVICES:  # XLA's CPU client aborts (no Python error) far past this
        raise UsageError(f"--devices must be between 1 and {MAX_VALIDATE_DEVICES}, got {args.devices}")
    if "JAX_NUM_CPU_DEVICES" not in os.environ and args.devices > 1:
        try:  # give the CPU backend the devices asked for, if it has not started yet
            jax.config.update("jax_num_cpu_devices", args.devices)
        except RuntimeError:
            pass

    overrides = {f: getattr(args, f) for f in ("num_layers", "batch_size") if getattr(args, f) is not None}
    mesh = None
    if args.mesh:
        try:
            mesh = tuple(_whole_number(x, "a --mesh side") for x in args.mesh.lower().split("x"))
        except ValueError:
            raise UsageError(f"--mesh must look like 2x4, got {args.mesh!r:.40}") from None
    return validate_plan(args.model, devices=args.devices, mesh_shape=mesh, overrides=overrides or None)


# --- optimum (hierarchical plan vs the exhaustive global optimum) ---------------------------------------------------
def cmd_optimum(args) -> dict:
    """Alpa's two-level plan against the global optimum found by exhaustive enumeration (small instances only)."""
    from .solve.exhaustive import global_optimum

    model, cluster = _model(args), _cluster(args)
    res = global_optimum(model, cluster, microbatches=_microbatches(args.microbatches))
    return {"model": model.name, "cluster": args.cluster, "auto_step_s": res["auto_step_s"],
            "optimum_step_s": res["optimum_step_s"], "gap": res["gap"], "auto_fits": res["auto_fits"],
            "plans_total": res["plans_total"], "plans_priced": res["plans_priced"],
            "plans_feasible": res["plans_feasible"], "solve_s": res["solve_s"]["total"],
            "solve_s_parts": res["solve_s"], "auto": res["auto"].report(model.name),
            "optimum": res["optimum"].report(model.name)}


def _print_optimum(out: dict) -> None:
    print(f"{out['model']} on {out['cluster']}: auto {out['auto_step_s']:.4g} s, "
          f"optimum {out['optimum_step_s']:.4g} s, "
          f"gap {out['gap']:.2%}")
    for key in ("auto", "optimum"):
        r = out[key]
        print(f"  {key}: {r['microbatches']} microbatches")
        for k, st in enumerate(r["stages"]):
            print(f"    stage {k}: layers {st['layers'][0]}-{st['layers'][1]} on submesh "
                  f"{st['submesh'][0]}x{st['submesh'][1]} as {st['logical_mesh'][0]}x{st['logical_mesh'][1]}"
                  f"{_remat_text(st['remat'])}")
    print(f"  {out['plans_priced']:,} of {out['plans_total']:,} plans simulated in {out['solve_s']:.1f} s")
# --- end optimum ------------------------------------------------------------------------------------------------------


# --- train (Ray: embedded local cluster, or a cluster's Jobs API) -------------------------------------------------
def cmd_train(args) -> dict:
    """Train a zoo model with a saved plan on Ray; per-step progress on stdout unless --json.

    SIGINT (Ctrl-C) or SIGTERM stops the job at the end of its current step, writes a final checkpoint when
    --checkpoint-dir is set, stops the embedded Ray this command started (nothing else) and exits 130 or 143 with one
    sentence; a second signal stops at once."""
    from .runtime.launch import launch, shutdown_local_ray
    from .runtime.train_entry import RunOptions
    from .runtime.train_entry import check_seed
    from .planfile import load_plan

    if args.steps < 1:
        raise UsageError(f"--steps must be a positive whole number, got {args.steps}")
    try:  # here, not after Ray started and JAX choked on the key
        check_seed(args.seed, args.steps, "--seed")
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --checkpoint-dir and --overwrite replaces it; pass one")
    model = _model(args)
    # The cluster is the one the plan file describes (data, never a path or preset to resolve).
    plan = load_plan(args.plan, model.trace(), model=model)

    def show(ev):
        if ev.kind == "step":
            times = " ".join(f"{t * 1e3:.1f}" for t in ev.stage_times)
            print(f"step {ev.step}/{args.steps}  loss {ev.loss:.5f}  {ev.samples_per_s:.1f} samples/s  "
                  f"stage ms [{times}]", flush=True)
        elif ev.kind in ("restart", "note"):
            print(f"{ev.kind}: {ev.message}", flush=True)

    state: dict = {"signum": None, "job": None}

    def on_signal(signum, _frame):
        if state["signum"] is not None or state["job"] is None:
            state["signum"] = state["signum"] or signum
            raise Interrupted(signum, "before training started" if state["job"] is None else "at once")
        state["signum"] = signum
        state["job"].cancel()  # the driver stops after this step and writes the final checkpoint

    ours = not args.ray_address and not ("ray" in sys.modules and sys.modules["ray"].is_initialized())
    handlers = _install(on_signal)
    forced = False
    try:
        options = RunOptions(seed=args.seed, device_kind=args.device_kind,
                             compiler_options={"xla_backend_optimization_level": 0} if args.fast_compile else None)
        options = options.with_checkpoints(args.checkpoint_dir, every=args.checkpoint_every, resume=args.resume,
                                           overwrite=args.overwrite)
        job = launch(plan, model, args.steps, ray_address=args.ray_address, options=options,
                     on_progress=None if args.json else show)
        state["job"] = job
        result = job.wait()
    except Interrupted:
        forced = True
        raise
    except RuntimeError as e:  # the job failed (JobFailed) or the embedded Ray did not start
        if state["signum"] is not None:  # a job cut short by the signal: the signal is the news
            raise Interrupted(state["signum"], "while stopping") from None
        raise UsageError(f"training failed: {e}") from None
    finally:
        _install(handlers)
        if ours:
            shutdown_local_ray(timeout_s=10 if forced else 120)
    if state["signum"] is not None:
        ck = result.get("checkpoint_step")
        where = f"; checkpoint at step {ck} in {args.checkpoint_dir}" if args.checkpoint_dir and ck else ""
        raise Interrupted(state["signum"], f"stopped after step {result.get('steps_run', 0)} of {args.steps}{where}")
    result = dict(result)
    result["stages"] = len(plan.stages)
    return result


class Interrupted(Exception):
    """SIGINT or SIGTERM: the command stopped; exit status 128 + the signal's number, one sentence."""

    def __init__(self, signum: int, what: str = ""):
        super().__init__(what)
        self.signum = int(signum)
        self.what = what


def _install(handler):
    """Set ``handler`` for SIGINT and SIGTERM (or a {signal: handler} dict as returned); the previous ones. Only the
    main thread may set handlers: elsewhere (main() called from a thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    wanted = handler if isinstance(handler, dict) else {signal.SIGINT: handler, signal.SIGTERM: handler}
    return {sig: signal.signal(sig, h) for sig, h in wanted.items()}


def _print_train(out: dict) -> None:
    print(f"{out['model']}: {out['steps_run']} steps ({out['status']}), step {out['step_time_s'] or 0:.4g} s "
          f"(predicted {out['predicted_step_s']:.4g} s), {out['restarts']} restart(s)")
    for r in out["stage_times"]:
        if r["measured_fwd_s"] is not None:
            print(f"  stage {r['stage']}: fwd {r['measured_fwd_s'] * 1e3:.2f} ms (predicted "
                  f"{r['predicted_fwd_s'] * 1e3:.3g}), bwd {r['measured_bwd_s'] * 1e3:.2f} ms (predicted "
                  f"{r['predicted_bwd_s'] * 1e3:.3g})")
# --- end train --------------------------------------------------------------------------------------------------------


COMMANDS: dict[str, tuple[Callable, Callable | None]] = {
    "graph": (cmd_graph, _print_graph),
    "plan": (cmd_plan, _print_plan),
    "compare": (cmd_compare, _print_compare),
    "validate": (cmd_validate, None),
    "optimum": (cmd_optimum, _print_optimum),
    "train": (cmd_train, _print_train),
}


CLUSTER_HELP = ("PRESET:HOSTS (p3.16xlarge, dgx-a100, dgx-h100, dgx-h200, dgx-b200, h800, "
                "grand-teton-h100: hosts of 8 GPUs; "
                "gb200-nvl72: trays of 4 GPUs, 18 a rack; cpu: this machine's JAX devices), "
                "PRESET:CHIPS (tpu-v5e, tpu-v5p, tpu-v6e) or a JSON cluster file")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="autopar-lab", description="Alpa-style automatic parallelization planning on JAX.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def model_args(sp, optional: bool = False):
        sp.add_argument("model", nargs="?" if optional else None,
                        help="a zoo model name (e.g. llama3-70b, deepseek-v3, gpt-1.3b, mlp) or a Hugging Face "
                             "config.json (its path, or its folder's)"
                             + ("; with --from-config, optional when the configuration names the model" if optional
                                else ""))
        for flag, field, what in MODEL_FLAGS:
            sp.add_argument(flag, dest=field, type=int, help=f"override {what}")
        sp.add_argument("--dtype", help="override the dtype (float32, float16, bfloat16)")
        sp.add_argument("--json", action="store_true", help="print one JSON object")

    def precision_arg(sp):
        sp.add_argument("--precision", metavar="FORMAT",
                        help="the number format to plan in: fp32, fp16, bf16 (fp32 master weights, gradients and "
                             "their reduction), fp8 or fp8-block (FP8 linear-layer matmuls, per-tensor or blockwise "
                             "scaling); default: the model's own")

    model_args(sub.add_parser("graph", help="capture a model's training step as an operator graph"))

    sp = sub.add_parser("plan", help="plan a model on a cluster")
    model_args(sp, optional=True)
    sp.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    sp.add_argument("--method", choices=["auto", "megatron", "data"], default="auto")
    sp.add_argument("--dp", type=int)
    sp.add_argument("--tp", type=int)
    sp.add_argument("--pp", type=int)
    sp.add_argument("--cp", type=int, help="with --method megatron: context parallelism (sequence split over N)")
    sp.add_argument("--ep", type=int, help="with --method megatron: expert parallelism (MoE models)")
    sp.add_argument("--zero", type=int, choices=range(4), metavar="{0,1,2,3}",
                    help="the ZeRO stage: optimizer state (1), gradients (2) and weights (3) split over the "
                         "data-parallel group (default: left to the planner, stored at its least where a stage would "
                         "not fit)")
    sp.add_argument("--sequence-parallel", action="store_true", dest="sequence_parallel",
                    help="with --method megatron: Megatron-LM's sequence parallelism (needs --tp 2 or more)")
    sp.add_argument("--micro-batch-size", type=int, dest="micro_batch_size",
                    help="with --method megatron: sequences a microbatch (the microbatch count is the batch over "
                         "dp x this), instead of --microbatches")
    sp.add_argument("--remat", action="store_true",
                    help="with --method megatron or data: recompute activations in the backward")
    sp.add_argument("--selective-remat", action="store_true", dest="selective_remat",
                    help="with --method megatron or data: recompute only the attention internals in the backward "
                         "(Korthikanti et al.'s selective recomputation)")
    sp.add_argument("--microbatches", help="a number, or 'auto' (the default) to search them (--method megatron: "
                    "the micro-batch sizes 1, 2, 4 and 8, the fastest that fits; --method data: 1)")
    sp.add_argument("--stage-comm", choices=["model", "ignore"], default="model", dest="stage_comm")
    sp.add_argument("--schedule", choices=[*SCHEDULES, "auto"],
                    help="the pipeline schedule (default 1f1b); interleaved runs --virtual-stages model chunks per "
                         "stage, zb-h1 splits each backward into its input- and weight-gradient parts; auto (with "
                         "--method auto) plans 1f1b, interleaved (2 and 4 chunks) and zb-h1 and keeps the fastest")
    sp.add_argument("--virtual-stages", dest="virtual_stages", type=int,
                    help="with --schedule interleaved: model chunks per stage (default 2)")
    sp.add_argument("--microbatch-group", dest="microbatch_group", type=int, metavar="N",
                    help="with --method megatron --schedule interleaved: microbatches each chunk runs in a row "
                         "(Megatron-LM's --microbatch-group-size-per-virtual-pipeline-stage; default --pp)")
    sp.add_argument("--flexible-group", dest="flexible_group", action="store_true",
                    help="with --microbatch-group N: Llama 3's flexible schedule, which also runs one group of fewer "
                         "microbatches than stages (N = the microbatches < --pp); Megatron-LM cannot run that")
    sp.add_argument("--out", help="also write the plan file (for `train --plan` and al.load_plan) to this path")
    sp.add_argument("--from-config", dest="from_config", metavar="FILE",
                    help="price a framework's configuration: Megatron-LM arguments, a torchtitan TOML or a MaxText "
                         "YAML (the framework read from its content)")
    sp.add_argument("--export", choices=list(FRAMEWORK_CHOICES), metavar="FRAMEWORK",
                    help="also write the plan as a framework's configuration: megatron, torchtitan or maxtext")
    sp.add_argument("--expressible-in", dest="expressible_in", choices=list(FRAMEWORK_CHOICES), metavar="FRAMEWORK",
                    help="with --method auto: the best plan that framework (megatron, torchtitan or maxtext) can "
                         "run, the gap to the unconstrained plan in its notes")
    precision_arg(sp)

    sp = sub.add_parser("compare", help="auto vs the best Megatron-style plan vs data parallelism")
    model_args(sp)
    sp.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    sp.add_argument("--microbatches", help="a number, or 'auto' (the default)")
    precision_arg(sp)

    sp = sub.add_parser("validate", help="the intra-op plan against what XLA compiles on N local devices")
    model_args(sp)
    sp.add_argument("--devices", type=int, default=8)
    sp.add_argument("--mesh", help="the logical mesh, e.g. 2x4 (default: tried for you)")

    sp = sub.add_parser("optimum", help="the hierarchical plan vs the exhaustive global optimum (small instances)")
    model_args(sp)
    sp.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    sp.add_argument("--microbatches", help="a number, or 'auto' (the default)")

    sp = sub.add_parser("train", help="train a model with a saved plan on Ray (embedded local cluster by default)")
    model_args(sp)
    sp.add_argument("--plan", required=True, help="a plan file written by al.save_plan")
    sp.add_argument("--steps", type=int, required=True)
    sp.add_argument("--ray-address", dest="ray_address", help="a cluster's dashboard address, http://HEAD:8265")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--checkpoint-dir", dest="checkpoint_dir")
    sp.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=0,
                    help="also checkpoint every N steps (with --checkpoint-dir; the end of the run always is)")
    sp.add_argument("--resume", action="store_true", help="go on from the last checkpoint in --checkpoint-dir")
    sp.add_argument("--overwrite", action="store_true",
                    help="replace the checkpoints of another run in --checkpoint-dir (refused otherwise)")
    sp.add_argument("--device-kind", dest="device_kind", choices=["cpu", "gpu"])
    sp.add_argument("--fast-compile", dest="fast_compile", action="store_true",
                    help="compile the stage programs without XLA's backend optimisations (quicker on CPU)")
    return p


def check_writable_file(path: str, what: str) -> None:
    """Refuse (UsageError) a path a file cannot be written to: a directory, something else than a regular file (a
    FIFO, a device, a symlink: writing would replace it), a missing or read-only folder. The folder is checked by
    creating and removing a file in it, which works for root and read-only file systems alike."""
    from .safeio import check_write_target, probe_writable

    if path.endswith(os.sep) or os.path.isdir(path):
        raise UsageError(f"{what} {path!r} is a directory; give a file name, e.g. {os.path.join(path, 'plan.json')!r}")
    try:
        check_write_target(path, what)
    except ValueError as e:
        raise UsageError(str(e)) from None
    folder = os.path.dirname(os.path.abspath(path))
    try:
        probe_writable(folder)
    except OSError as e:
        raise UsageError(f"cannot write {what} {path!r} ({e.strerror or e} in {folder!r}); pick a folder you can "
                         "write to") from None


def _one_sentence(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if text.endswith((".", "?", "!", ")")) else text + "."


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    parser = build_parser()

    def on_sigterm(signum, _frame):  # like Ctrl-C: unwind (finally blocks run), then exit 143
        raise Interrupted(signum)

    handlers = _install({signal.SIGTERM: on_sigterm})
    try:
        args = parser.parse_args(argv)
        run, pretty = COMMANDS[args.command]
        out = run(args)
    except Interrupted as e:
        name = {2: "SIGINT", 15: "SIGTERM"}.get(e.signum, f"signal {e.signum}")
        print(f"autopar-lab: interrupted ({name}){': ' + e.what if e.what else ''}.", file=sys.stderr)
        return 128 + e.signum
    except UsageError as e:
        print(f"autopar-lab: {_one_sentence(e)}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, FileNotFoundError, TypeError) as e:
        # Every engine error about the user's input is a ValueError (or KeyError/FileNotFoundError) with a message
        # that says what to change.
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"autopar-lab: {_one_sentence(msg if isinstance(msg, BaseException) else Exception(msg))}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar-lab: interrupted (SIGINT).", file=sys.stderr)
        return 130
    finally:
        _install(handlers)
    if args.json:
        json.dump(out, sys.stdout, default=_json_default)
        sys.stdout.write("\n")
    elif pretty is not None:
        pretty(out)
    else:
        json.dump(out, sys.stdout, indent=2, default=_json_default)
        sys.stdout.write("\n")
    return 0


def _json_default(x):
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, tuple):
        return list(x)
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
