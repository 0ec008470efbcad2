"""What the three frameworks' readers share: a configuration read into :class:`Imported` (the values the planner
models, the fields it leaves out), the model a configuration names or shapes, and the checks of its numbers.

A field is *ignored* when the framework has it and the planner does not model it (a learning rate, a data path, a
kernel switch): the plan's notes list each in one line. A field is *unknown* when it is none of the framework's own
and reads like a modelled one (a typo: ``--tensor-model-paralel-size``): that is a ValueError, since pricing the
configuration without it would answer another question than the user asked.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .. import checks
from ..safeio import read_text_file

__all__ = ["FRAMEWORK_NAMES", "Imported", "block_count", "close_to", "integer", "model_for", "read_source",
           "with_import_notes"]

#: The frameworks' names as the API takes them, and how a sentence names them.
FRAMEWORK_NAMES = {"megatron": "Megatron-LM", "torchtitan": "torchtitan", "maxtext": "MaxText"}
#: The largest configuration read (a training script's arguments or a config file are a few kB).
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class Imported:
    """A configuration as read: ``values`` (the modelled fields, by the framework's own names, as given),
    ``ignored`` (the fields the planner does not model, in the order given) and ``notes`` (how a modelled field was
    approximated)."""

    framework: str
    values: Mapping[str, Any] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def get(self, key: str, default=None):
        return self.values.get(key, default)

    def with_note(self, note: str) -> Imported:
        return dataclasses.replace(self, notes=(*self.notes, note))


def read_source(source) -> str:
    """The text of ``source``: a path (str or os.PathLike) to a file that exists, else the configuration's text."""
    if isinstance(source, os.PathLike):
        return read_text_file(source, "configuration file", MAX_CONFIG_BYTES, "give the path of a configuration file")
    if not isinstance(source, str):
        raise ValueError(f"give a configuration's text or the path of its file, got a {type(source).__name__}")
    one_line = "\n" not in source and len(source) < 4096
    if one_line and source.strip() and os.path.exists(source.strip()):
        return read_text_file(source.strip(), "configuration file", MAX_CONFIG_BYTES,
                              "give the path of a configuration file")
    name = source.strip()
    if one_line and " " not in name and name.lower().endswith((".toml", ".yaml", ".yml", ".sh", ".txt", ".args")):
        raise ValueError(f"no configuration file {name!r}; give the path of an existing file, or the text itself")
    if not source.strip():
        raise ValueError("the configuration is empty; give a Megatron-LM argument list, a torchtitan TOML or a "
                         "MaxText YAML (its text or its path)")
    return source


def close_to(key: str, known, what: str) -> None:
    """A ValueError when ``key`` (not one of the framework's fields) reads like one of ``known``: a typo the user
    meant as a modelled field."""
    near = difflib.get_close_matches(key, list(known), n=1, cutoff=0.85)
    if near:
        raise ValueError(f"{what} {key!r} is not one; did you mean {near[0]!r}?")


def integer(value, what: str, lo: int = 1, allow_minus_one: bool = False) -> int:
    """``value`` (an int, a whole float such as MaxText's ``12.0``, or a numeral) as an int of at least ``lo``."""
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{what} must be a whole number, got {value!r:.40}") from None
    if isinstance(value, float) and not isinstance(value, bool) and math.isfinite(value) and value == int(value):
        value = int(value)
    if allow_minus_one and value == -1 and not isinstance(value, bool):
        return -1
    return checks.whole(value, what, lo)


def block_count(table) -> int:
    """The transformer blocks of ``table``'s model (the layers between the embedding and the head, as
    :func:`~autopar_lab.layouts.engine.stage_bounds` counts them); every layer when none is found."""
    from ..layouts import find_roles

    names = list(table.solve_graph.layers)
    blocks = set(find_roles(table.solve_graph).blocks)
    inside = [k for k in range(len(table.layer_names)) if names and names[table.layer_map[k]] in blocks]
    return len(inside) or len(table.layer_names)


def sequence_length(table) -> int:
    """The sequence length of ``table``'s model: the second dimension of its rank-2 integer batch input (the
    tokens; 1 for a model without one)."""
    from ..graph.opgraph import BATCH

    graph = table.solve_graph
    for t in graph.inputs:
        spec = graph.tensor(t)
        if spec.kind == BATCH and len(spec.shape) == 2 and "int" in str(spec.dtype):
            return int(spec.shape[1])
    return 1


def model_config_value(model, key: str):
    """A field of a zoo model's configuration (None for a model without it, or an OpGraph)."""
    config = getattr(model, "config", None)
    return getattr(config, key, None) if dataclasses.is_dataclass(config) else None


def model_for(model, shape: Mapping[str, Any], *, zoo: str | None, family: str | None, name: str,
              framework: str):
    """The model to plan: ``model`` when given (checked against the ``shape`` fields the configuration states:
    a contradiction is a ValueError), else the zoo model ``zoo`` with ``shape`` replaced, else a model of zoo
    ``family`` built from ``shape`` (:func:`~autopar_lab.models.registry.build_config`)."""
    from .. import models

    fw = FRAMEWORK_NAMES[framework]
    if model is not None:
        for key, want in shape.items():
            if key == "dtype":
                continue  # the number format is the planner's precision=, not the model's
            have = model_config_value(model, key)
            if have is not None and want is not None and have != want:
                raise ValueError(f"the {fw} configuration says {key.replace('_', ' ')} {want}, but the model "
                                 f"{getattr(model, 'name', '')!r} has {have}; pass the model the configuration "
                                 "trains, or leave model out to build it from the configuration")
        return model
    if zoo is not None:
        return models.get(zoo, **{k: v for k, v in shape.items() if v is not None})
    if family is not None:
        return models.build_config(family, name, **{k: v for k, v in shape.items() if v is not None})
    raise ValueError(f"this {fw} configuration does not say which model it trains; pass it (model=, or the command "
                     "line's model argument: a zoo model, "
                     "e.g. al.models.get('llama3-8b'), or al.models.from_config('config.json'))")


def with_import_notes(plan, imported: Imported):
    """``plan`` with what the import did said in its notes: where it came from, each approximation, and the one line
    of fields not modelled."""
    lines = [f"imported from a {FRAMEWORK_NAMES[imported.framework]} configuration", *imported.notes]
    if imported.ignored:
        lines.append("ignored (not modelled by the planner): " + ", ".join(imported.ignored))
    return dataclasses.replace(plan, notes=(*plan.notes, *lines))
