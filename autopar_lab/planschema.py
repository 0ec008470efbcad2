"""The plan file's schema: what :func:`autopar_lab.planfile.load_plan` checks before it believes a field.

A plan file is shared between colleagues, so it is untrusted input. :func:`read_plan_file` reads it as
:mod:`autopar_lab.safeio` does (a regular file, a size limit, finite numbers, bounded nesting). :func:`check_form`
checks every field's type, range and enum (strictly: ``"remat": "false"`` is a string, not a boolean; operator ids
are canonical decimal strings; names that end up in generated code are printable one-liners). Version 4 names every
pin by its operator in the model's own graph, with its scope: ``"pins": {"3521": {"strategy": "...", "scope":
"shared"}}`` (``"layer"``: that layer alone). Versions 1 to 3 named a pin by its operator in the graph the plan was
solved on (a deep model's shallower copy) and kept a split layer's pins apart in ``layer_pins`` (version 3, by the
model's own operators); they still load, their pins converted (:mod:`autopar_lab.planfile`). ``precision``
(optional: a file without it is in the model's own number format) names the plan's format or holds its fields.
:func:`check_fits` then checks the fields against the graph and cluster the plan is loaded for: pins name operators
of the graph, stage pins name layers and stages that exist, submeshes are shapes of the cluster and tile it, logical
meshes are views of their submesh, the microbatch count divides the batch. Every failure is one ValueError that names
the field.

The cluster inside a plan file is data (a JSON object), never a path or a spec string to resolve: a plan file
cannot make the loader read another file.

    >>> check_form({"version": 2, "method": "auto", "remat": 1}, "plan file 'p.json'")
    Traceback (most recent call last):
    ValueError: plan file 'p.json' is not a valid plan file: key 'graph_fingerprint' is missing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from .safeio import read_json_file
from .rematmode import REMAT_CHOICES, REMAT_STRINGS
from .schedules import MAX_VIRTUAL_STAGES, SCHEDULES

VERSION = 4  # the plan-file version save_plan writes: pins by operator of the model's own graph, with their scope
PINS_BY_OPERATOR = 4  # the first version whose pins name operators of the model's own graph (before: the solve graph)
READS = (1, 2, 3, 4)  # file versions load_plan accepts
SCOPES = ("shared", "layer")  # a pin's scope (autopar_lab.planvalues.SCOPES)

__all__ = ["REQUIRED", "read_plan_file", "check_form", "check_fits", "bad", "printable_name", "old_pins", "VERSION",
           "READS", "PINS_BY_OPERATOR", "SCOPES"]

REQUIRED = ("version", "graph_fingerprint", "cluster", "method", "microbatches", "schedule", "stage_comm",
            "layer_names", "stages", "choices", "pins")
_STAGE_KEYS = ("layers", "submesh", "logical_mesh", "remat", "devices")
_OP_ID = re.compile(r"^(0|[1-9][0-9]{0,8})$")  # canonical decimal: "7", never "07", " 7", "+7" or "0x7"
MAX_NAME = 256  # method, strategy, layer and note strings
MAX_STAGES = 4096
MAX_MICROBATCHES = 1 << 20
MIN_MEM_LIMIT = 1 << 20  # a per-device memory limit below 1 MiB is a typo, not a device


def bad(where: str, what: str) -> ValueError:
    return ValueError(f"{where} is not a valid plan file: {what}.")


def printable_name(value, what: str, where: str, limit: int = MAX_NAME) -> str:
    """``value`` if it is a one-line printable string of at most ``limit`` characters (what may reach generated code
    and terminals); ValueError otherwise."""
    if not isinstance(value, str):
        raise bad(where, f"{what} must be a string, got {type(value).__name__}")
    if len(value) > limit:
        raise bad(where, f"{what} is {len(value)} characters long, more than {limit}")
    if not value.isprintable():
        raise bad(where, f"{what} holds a control character or line break ({value[:40]!r})")
    return value


def read_plan_file(path) -> dict:
    """The JSON object of a plan file, read as untrusted input (:func:`autopar_lab.safeio.read_json_file`)."""
    data = read_json_file(path, "plan file")
    if not isinstance(data, dict):
        raise bad(_where(path), "it does not hold a JSON object")
    return data


def _where(path) -> str:
    import os

    return f"plan file {os.fspath(path)!r}"


def _int(value, what: str, where: str, lo: int = 0, hi: int = 1 << 40) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(where, f"{what} must be a whole number, got {value!r}"[:300])
    if not lo <= value <= hi:
        raise bad(where, f"{what} must be between {lo} and {hi}, got {value}")
    return value


def _pair(value, what: str, where: str) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2:
        raise bad(where, f"{what} must be a pair [n0, n1], got {value!r}"[:300])
    return _int(value[0], what, where, 1, 1 << 20), _int(value[1], what, where, 1, 1 << 20)


def _op_map(value, what: str, where: str) -> dict[int, str]:
    if not isinstance(value, dict):
        raise bad(where, f"{what} must be an object mapping operator ids to strategy names")
    out = {}
    for key, name in value.items():
        if not _OP_ID.match(key):
            raise bad(where, f"{what} has the key {key[:40]!r}, not an operator id (a whole number like \"12\")")
        out[int(key)] = printable_name(name, f"{what}[{key}]", where)
    return out


def _pins(value, where: str) -> dict[int, tuple[str, str]]:
    """A version-4 ``pins`` object: operator id -> {"strategy": name, "scope": "shared" or "layer"}."""
    if not isinstance(value, dict):
        raise bad(where, "pins must be an object mapping operator ids to {\"strategy\": ..., \"scope\": ...}")
    out = {}
    for key, entry in value.items():
        if not _OP_ID.match(key):
            raise bad(where, f"pins has the key {key[:40]!r}, not an operator id (a whole number like \"12\")")
        if not isinstance(entry, dict) or set(entry) != {"strategy", "scope"}:
            raise bad(where, f"pins[{key}] must be an object with a strategy and a scope, got {entry!r:.60}")
        if entry["scope"] not in SCOPES:
            raise bad(where, f"pins[{key}]'s scope must be 'shared' or 'layer', got {entry['scope']!r:.40}")
        out[int(key)] = (printable_name(entry["strategy"], f"pins[{key}]", where), entry["scope"])
    return out


def old_pins(data: Mapping) -> bool:
    """Whether a plan file names its pins by the graph the plan was solved on (versions 1 to 3)."""
    return data.get("version", 1) < PINS_BY_OPERATOR


def check_form(data: Mapping, where: str) -> None:
    """Every field of a plan file's object has the type, range and value set the format allows (see the module doc).

    Keys this version does not know are ignored (never used), so a newer writer's extra fields do not break it."""
    if "version" in data and (isinstance(data["version"], bool) or data["version"] not in READS):
        raise ValueError(f"{where} has version {data['version']!r:.40}, but this autopar-lab reads versions "
                         f"{', '.join(map(str, READS))}.")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise bad(where, f"key {missing[0]!r} is missing")
    for key in ("graph_fingerprint", "solve_graph_fingerprint"):
        if key in data:
            printable_name(data[key], key, where, 128)
    if not isinstance(data["cluster"], dict):
        raise bad(where, "its cluster must be a JSON object (the cluster's description, as Cluster.to_dict writes "
                         f"it), got {type(data['cluster']).__name__}; a plan file never names a cluster file or preset")
    printable_name(data["method"], "method", where)
    _int(data["microbatches"], "microbatches", where, 1, MAX_MICROBATCHES)
    if data["schedule"] not in SCHEDULES:
        raise bad(where, f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {data['schedule']!r:.40}")
    if data["schedule"] == "interleaved" or "virtual_stages" in data:
        # an interleaved plan's model chunks per stage (written since the schedule exists; 2 when absent)
        v = _int(data.get("virtual_stages", 2), "virtual_stages", where, 1, MAX_VIRTUAL_STAGES)
        if (v >= 2) != (data["schedule"] == "interleaved"):
            raise bad(where, f"virtual_stages {v} does not go with schedule {data['schedule']!r} (2 or more for "
                             "'interleaved' only)")
    if "precision" in data:  # the number format: a name, or an object of fields (planfile reads it, checked)
        fmt = data["precision"]
        if isinstance(fmt, str):
            printable_name(fmt, "precision", where, 64)
        elif not isinstance(fmt, dict):
            raise bad(where, f"precision must be a format's name or an object of its fields, got {fmt!r:.40}")
    if data["stage_comm"] not in ("model", "ignore"):
        raise bad(where, f"stage_comm must be 'model' or 'ignore', got {data['stage_comm']!r:.40}")
    if "mem_limit_bytes" in data:
        mem = data["mem_limit_bytes"]
        if isinstance(mem, bool) or not isinstance(mem, (int, float)) or not math.isfinite(mem) or \
                not MIN_MEM_LIMIT <= mem <= 2.0**60:
            raise bad(where, f"mem_limit_bytes must be a number of bytes between {MIN_MEM_LIMIT} and 2**60, got "
                             f"{mem!r:.40}")
    if "step_time_s" in data and (isinstance(data["step_time_s"], bool) or
                                  not isinstance(data["step_time_s"], (int, float))):
        raise bad(where, "step_time_s must be a number")
    names = data["layer_names"]
    if not isinstance(names, list) or not names:
        raise bad(where, "layer_names must be a non-empty list of names")
    for k, name in enumerate(names):
        printable_name(name, f"layer_names[{k}]", where)
    for key in ("notes",):
        if key in data:
            if not isinstance(data[key], list):
                raise bad(where, f"{key} must be a list of strings")
            for k, note in enumerate(data[key]):
                printable_name(note, f"{key}[{k}]", where, 4096)
    stages = data["stages"]
    if not isinstance(stages, list) or not stages:
        raise bad(where, "it has no stages")
    if len(stages) > MAX_STAGES:
        raise bad(where, f"it has {len(stages)} stages, more than {MAX_STAGES}")
    for k, st in enumerate(stages):
        if not isinstance(st, dict):
            raise bad(where, f"stage {k} must be an object")
        miss = [key for key in _STAGE_KEYS if key not in st]
        if miss:
            raise bad(where, f"stage {k} lacks key {miss[0]!r}")
        layers = st["layers"]
        if not isinstance(layers, list) or len(layers) != 2:
            raise bad(where, f"stage {k}'s layers must be a pair [first, last]")
        _int(layers[0], f"stage {k}'s first layer", where, 0, 1 << 20)
        _int(layers[1], f"stage {k}'s last layer", where, 0, 1 << 20)
        _pair(st["submesh"], f"stage {k}'s submesh", where)
        _pair(st["logical_mesh"], f"stage {k}'s logical_mesh", where)
        if not isinstance(st["remat"], bool) and st["remat"] not in REMAT_STRINGS:
            raise bad(where, f"stage {k}'s remat must be true or false (full or none) or one of "
                             f"{', '.join(map(repr, REMAT_STRINGS))}, got {st['remat']!r:.40}")
        if not isinstance(st["devices"], list):
            raise bad(where, f"stage {k}'s devices must be a list of device indices")
        for d in st["devices"]:
            _int(d, f"stage {k}'s device index", where, 0, 1 << 24)
        _op_map(st.get("choices_outside", {}), f"stage {k}'s choices_outside", where)
        if st.get("solution", "fast") not in ("fast", "lean"):
            raise bad(where, f"stage {k}'s solution must be 'fast' or 'lean', got {st['solution']!r:.40}")
    _op_map(data["choices"], "choices", where)
    if old_pins(data):
        _op_map(data["pins"], "pins", where)
        if "layer_pins" in data:
            _op_map(data["layer_pins"], "layer_pins", where)
    else:
        _pins(data["pins"], where)
    if "stage_pins" in data and not isinstance(data["stage_pins"], dict):
        raise bad(where, "stage_pins must be an object")
    sp = data.get("stage_pins", {})
    if "schedule" in sp and sp["schedule"] not in SCHEDULES:
        raise bad(where, f"stage_pins['schedule'] must be one of {', '.join(map(repr, SCHEDULES))}")
    if "virtual_stages" in sp:
        _int(sp["virtual_stages"], "stage_pins['virtual_stages']", where, 2, MAX_VIRTUAL_STAGES)
    if "zero" in sp:
        _int(sp["zero"], "stage_pins['zero']", where, 0, 3)


def check_fits(data: Mapping, where: str, *, ops, num_layers: int, cluster, batch_size: int,
               full_ops=None) -> None:
    """The plan file's fields against the graph (the operator ids ``ops`` its choices name, ``num_layers`` layers,
    ``batch_size``) and ``cluster`` it is loaded for; run after :func:`check_form`. ``full_ops``: the model's own
    graph's operator ids (those a version-4 file's pins and a version-3 file's ``layer_pins`` name; default
    ``ops``). That each shared pin names the strategy the plan runs is checked once the plan is built, where the
    pins' operators are mapped onto the choices' (a version 1-3 file's pins name the choices' operators: here)."""
    known = set(ops)
    full = set(ops if full_ops is None else full_ops)
    named = [("choices", known)] + ([("pins", known), ("layer_pins", full)] if old_pins(data) else [("pins", full)])
    for key, ids in named:
        stray = sorted(int(op) for op in data.get(key, {}) if int(op) not in ids)
        if stray:
            whose = "this model's graph" if ids is full and full is not known else "this graph"
            raise bad(where, f"{key} name operator {stray[0]}, which {whose} does not have (its operators are "
                             f"{min(ids)}..{max(ids)})")
    for op, name in data["pins"].items() if old_pins(data) else ():
        if data["choices"].get(op) != name:
            raise bad(where, f"pins[{op}] is {name[:60]!r} but the plan runs operator {op} as "
                             f"{str(data['choices'].get(op))[:60]!r}; a pin names the strategy the plan chose")
    for k, st in enumerate(data["stages"]):
        stray = sorted(int(op) for op in st.get("choices_outside", {}) if int(op) not in known)
        if stray:
            raise bad(where, f"stage {k}'s choices_outside names operator {stray[0]}, which this graph does not have")
    B = data["microbatches"]
    if batch_size % B:
        raise bad(where, f"microbatches {B} does not divide the batch size {batch_size}")
    S = len(data["stages"])
    shapes = [tuple(s) for s in cluster.submesh_shapes()]
    used = 0
    for k, st in enumerate(data["stages"]):
        sub = tuple(st["submesh"])
        if sub not in shapes:
            raise bad(where, f"stage {k}'s submesh {list(sub)} is not a submesh shape of this cluster (one of "
                             f"{[list(s) for s in shapes]})")
        if tuple(st["logical_mesh"]) not in cluster.logical_mesh_shapes(sub):
            raise bad(where, f"stage {k}'s logical mesh {list(st['logical_mesh'])} is not a view of its submesh "
                             f"{list(sub)} (one of {[list(s) for s in cluster.logical_mesh_shapes(sub)]})")
        if len(st["devices"]) != sub[0] * sub[1] or len(set(st["devices"])) != len(st["devices"]):
            raise bad(where, f"stage {k} lists {len(st['devices'])} devices for its {sub[0]}x{sub[1]} submesh")
        used += sub[0] * sub[1]
    if used > cluster.num_devices:
        raise bad(where, f"its submeshes need {used} devices but the cluster has {cluster.num_devices}; they do not "
                         "tile it")
    every = [d for st in data["stages"] for d in st["devices"]]
    if len(set(every)) != len(every) or any(d >= cluster.num_devices for d in every):
        raise bad(where, f"its stages' devices overlap or run past the cluster's {cluster.num_devices} devices")
    pins = data.get("stage_pins", {})
    for key in ("boundaries",):
        if key in pins and isinstance(pins[key], list):
            for b in pins[key]:
                if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b < num_layers:
                    raise bad(where, f"stage_pins['boundaries'] names layer {b!r:.20}, but a cut must be a layer "
                                     f"1..{num_layers - 1} of this graph")
            if pins[key] != sorted(set(pins[key])):
                raise bad(where, "stage_pins['boundaries'] must be increasing")
    for key in ("submeshes", "logical_meshes", "remat"):
        if key in pins and (not isinstance(pins[key], list) or len(pins[key]) != S):
            raise bad(where, f"stage_pins[{key!r}] must list one entry per stage ({S})")
    for k, sub in enumerate(pins.get("submeshes", ())):
        if sub is not None and (not isinstance(sub, list) or tuple(sub) not in shapes):
            raise bad(where, f"stage_pins['submeshes'][{k}] is not a submesh shape of this cluster")
    for k, mesh in enumerate(pins.get("logical_meshes", ())):
        sub = (pins.get("submeshes") or [None] * S)[k] or data["stages"][k]["submesh"]
        whole = isinstance(mesh, list) and len(mesh) == 2 and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in mesh)
        if mesh is not None and (not whole or mesh[0] * mesh[1] != sub[0] * sub[1]):
            raise bad(where, f"stage_pins['logical_meshes'][{k}] must be two whole numbers whose product is the "
                             f"stage's {sub[0] * sub[1]} devices")
    for k, remat in enumerate(pins.get("remat", ())):
        if remat is not None and not (isinstance(remat, bool) or remat in REMAT_CHOICES[2:]):  # 1 == True: no
            raise bad(where, f"stage_pins['remat'][{k}] must be one of {', '.join(map(repr, REMAT_CHOICES))}")
    if "virtual_stages" in pins and pins.get("schedule", data.get("schedule")) != "interleaved":
        raise bad(where, "stage_pins['virtual_stages'] goes with the interleaved schedule only; remove it or pin "
                         "stage_pins['schedule'] = 'interleaved'")
    if "microbatches" in pins:
        mb = pins["microbatches"]
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1 or batch_size % mb:
            raise bad(where, f"stage_pins['microbatches'] must be a whole number dividing the batch size {batch_size}")
