"""Frameworks in and out (issue 33): a Megatron-LM, torchtitan or MaxText configuration read and priced
(:func:`import_config`), and a plan written back as one (:func:`export_config`).

- :mod:`~autopar_lab.frameworks.megatron_args`: Megatron-LM's command-line arguments;
- :mod:`~autopar_lab.frameworks.torchtitan_toml`: torchtitan's TOML job configuration;
- :mod:`~autopar_lab.frameworks.maxtext_yaml`: MaxText's YAML (``configs/base.yml``'s keys);
- :mod:`~autopar_lab.frameworks.planlayout`: a plan's decisions in the terms every framework shares, or the one no
  framework switch expresses;
- :mod:`~autopar_lab.frameworks.common`: reading, the model a configuration names, the fields not modelled;
- :mod:`~autopar_lab.frameworks.grid`: each framework's grid of layouts and its best plan
  (``al.auto_plan(..., expressible_in=...)``).

Each reader prices the configuration through the library's layout of that framework (``al.megatron_plan``,
``al.fsdp_plan``, ``al.maxtext_plan``), so an imported plan is the plan those functions give for the same settings.
"""

from __future__ import annotations

from types import ModuleType

from . import maxtext_yaml, megatron_args, torchtitan_toml
from .common import FRAMEWORK_NAMES, read_source, with_import_notes
from .grid import best_in_grid
from .planlayout import FrameworkLayout, dropped, layout_of

__all__ = ["FRAMEWORKS", "FRAMEWORK_NAMES", "FrameworkLayout", "best_in_grid", "detect_framework", "export_config",
           "import_config", "layout_of"]

#: The frameworks by the name the API takes.
FRAMEWORKS: dict[str, ModuleType] = {"megatron": megatron_args, "torchtitan": torchtitan_toml,
                                     "maxtext": maxtext_yaml}


def _framework(name) -> str:
    key = str(name).strip().lower().replace("-lm", "")
    if key not in FRAMEWORKS:
        raise ValueError(f"unknown framework {name!r:.40}; use one of {', '.join(FRAMEWORKS)}")
    return key


def detect_framework(text: str) -> str:
    """Which framework's configuration ``text`` is: a TOML section of torchtitan's, Megatron-LM's flags, or MaxText's
    keys (a ValueError when none fits)."""
    if torchtitan_toml.looks_like(text):
        return "torchtitan"
    if megatron_args.looks_like(text):
        return "megatron"
    if maxtext_yaml.looks_like(text):
        return "maxtext"
    raise ValueError("cannot tell which framework this configuration is for (no torchtitan [parallelism] or "
                     "[training] section, no Megatron-LM --tensor-model-parallel-size / --micro-batch-size flag, no "
                     "MaxText *_parallelism or per_device_batch_size key); pass framework=")


def import_config(source, model=None, cluster=None, framework: str | None = None, **planner):
    """The priced :class:`~autopar_lab.plan.Plan` of a framework configuration.

    ``source``: the configuration's text, or the path of its file: Megatron-LM's arguments (a shell line or a
    script's argument list), a torchtitan TOML or a MaxText YAML; ``framework`` ("megatron", "torchtitan",
    "maxtext"): guessed from the content when None. ``model``: the model it trains (a zoo ModelSpec or an OpGraph);
    None builds it from the configuration when it carries the model (Megatron-LM's shape flags, torchtitan's
    ``llama3`` flavor, MaxText's ``model_name``). ``cluster``: the devices it runs on (the configurations leave the
    device count to the launcher). ``planner``: ``table``, ``solver``, ``mem_limit_bytes``, as for
    :func:`~autopar_lab.layouts.megatron_plan`.

    The plan's notes say what the import approximated and list, in one line, every field the planner does not model
    ("ignored (not modelled by the planner): --use-flash-attn, ..."); a field that is misspelt or contradicts another
    (or the model, or the cluster) is a ValueError.
    """
    text = read_source(source)
    fw = detect_framework(text) if framework is None else _framework(framework)
    module = FRAMEWORKS[fw]
    imported = module.parse(text)
    unknown = set(planner) - {"table", "solver", "mem_limit_bytes"}
    if unknown:
        raise ValueError(f"import_config takes table=, solver= and mem_limit_bytes=, not {sorted(unknown)[0]}=")
    plan, imported = module.plan_from(imported, model, cluster, **planner)
    return with_import_notes(plan, imported)


def export_config(plan, framework: str, model=None) -> str:
    """``plan`` as ``framework``'s configuration text ("megatron": the arguments, "torchtitan": a TOML, "maxtext": a
    YAML), the model's shape or name written too when ``model`` (the zoo model planned) is given; a ValueError naming
    the decision that framework cannot express (uneven stages, different meshes per stage, a per-operator pin, a ZeRO
    stage or schedule it has no switch for). What the plan prices that the framework has no switch for but can run
    without (CUDA graphs outside Megatron-LM, another framework's eager loss, gradients held unsharded between
    microbatches) is dropped, and the text's comments say so (:func:`~autopar_lab.frameworks.planlayout.dropped`)."""
    from ..plan import plan_object

    plan = plan_object(plan, "plan")
    fw = _framework(framework)
    layout = layout_of(plan, FRAMEWORK_NAMES[fw])
    layout = layout.with_(notes=(*layout.notes, *dropped(layout, fw)))  # what the configuration cannot say
    if fw == "maxtext":
        return maxtext_yaml.render(layout, model, plan.cluster)
    return FRAMEWORKS[fw].render(layout, model)
