"""Plans as files: versioned JSON (never pickle), loaded back with validation and re-priced.

The file holds the plan's decisions, not its numbers: stages (layers, submesh, logical mesh, remat, devices), the
strategy name of every operator (``choices``, from the stage that runs it), pins, microbatches, schedule. Loading
checks the version, that the graph and the cluster are the ones the plan was made for, looks every strategy up by
name among :func:`~autopar_lab.sharding.strategies.strategies_for` on its stage's mesh, and re-prices the plan the
way the planner does (:func:`autopar_lab.plan.price_plan`), so the step time comes back to the last bit::

    {"version": 4, "graph_fingerprint": "...", "cluster": {...}, "method": "auto", "microbatches": 4,
     "schedule": "1f1b", "stage_comm": "model", "mem_limit_bytes": 1.7e10, "layer_names": [...],
     "stages": [{"layers": [0, 1], "submesh": [1, 4], "logical_mesh": [2, 2], "remat": false,
                 "devices": [0, 1, 2, 3], "choices_outside": {}}],
     "choices": {"0": "RR = ()", ...}, "pins": {"165": {"strategy": "S0RR = S0RR x RR", "scope": "shared"}},
     "stage_pins": {"boundaries": [2], "submeshes": [[1, 4], [1, 4]], "remat": [null, true], "microbatches": 4}}

``choices`` holds the strategy of every operator of the graph the plan was solved on (a deep model's shallower copy,
then named by ``solve_graph_fingerprint``): each stage's intra-op plan. ``choices_outside`` keeps, per stage, the
strategies of operators other stages run where this stage's IntraPlan differs (they price the edges at the stage's
borders). ``pins`` names operators of the model's own graph, as every view and method does, each with its scope
(:mod:`autopar_lab.operators`). An interleaved plan (``"schedule": "interleaved"``) also has
``"virtual_stages"`` (model chunks per stage, 2 or more; each stage's chunks follow from its layers, see
:func:`~autopar_lab.schedules.interleave`). ``stage_pins`` (version 2) holds the stage decisions the user
fixed (see :class:`~autopar_lab.plan.Plan`); a version 1 file (which has none) still loads, with no stage pins.
``precision`` (written since number formats exist; a file without it loads in the model's own format): the plan's
number format, its name (``"bf16"``, ``"traced"`` for the model's own when it has no name) or, for a format with
fields changed, an object of its fields (:mod:`autopar_lab.precision`); the graph is retyped to it before its
fingerprint is checked. Versions 1 to 3 named pins by the operators of the graph the plan was solved on and kept
the pins of split layers apart (``layer_pins``, version 3): they load with their pins converted to the model's own
operators (a pin of a copy's operator becomes a shared pin of the operator it stands for).

A stage that runs its mesh's memory-lean solution (:meth:`~autopar_lab.pricing.table.CostTable.solutions`) says so
in ``"solution": "lean"`` (its strategies are in ``choices`` like any stage's; the plan loads with
``Stage.solution`` as written). A stage without the key (every file written before it, and every fast stage)
loads as ``"fast"``; readers that do not know the key ignore it, so the file version stays.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from . import operators, planschema
from .planschema import READS, VERSION  # noqa: F401 - READS is offered here as before
from .planvalues import LAYER, Pin
from .backends.eager import HOSTS
from .pricing.accumulate import ACCUMULATIONS
from .pricing.overlap import OVERLAPS, check_overlap
from .precision import precision_from_json, precision_to_json, retype
from .rematmode import REMAT_STRINGS, is_full, remat_label, remat_value
from .safeio import write_atomic
from .schedules import SCHEDULES, FlexibleGroup

_STAGE_KEYS = ("layers", "submesh", "logical_mesh", "remat", "devices")


def remat_json(value) -> bool | str:
    """A remat value as a plan file holds it: true/false as always (full/none), its name for the others
    ("selective", "dots", "selective-op")."""
    label = remat_label(value)
    return is_full(value) if label in ("none", "full") else label


def plan_to_dict(plan) -> dict:
    g = plan.op_graph
    owner = {op: operators.solve_stage_of(plan, op) for op in g.ops}
    choices = {op: plan.stages[owner[op]].intra.strategies[op].name for op in g.ops}
    stages = []
    for k, st in enumerate(plan.stages):
        outside = {str(op): s.name for op, s in st.intra.strategies.items() if owner[op] != k and s.name != choices[op]}
        stages.append({"layers": list(st.layers), "submesh": list(st.submesh), "logical_mesh": list(st.logical_mesh),
                       "remat": remat_json(st.remat), "devices": list(st.devices), "choices_outside": outside})
        if st.solution != "fast":  # old files have none: they load as "fast"
            stages[-1]["solution"] = st.solution
    out = {
        "version": VERSION,
        "graph_fingerprint": plan.graph.fingerprint,
        "cluster": plan.cluster.to_dict(),
        "method": plan.method,
        "microbatches": plan.microbatches,
        "schedule": plan.schedule,
        **({"virtual_stages": plan.virtual_stages} if plan.virtual_stages > 1 else {}),
        "stage_comm": plan.stage_comm,
        "precision": precision_to_json(plan.precision),
        "mem_limit_bytes": plan.cost.mem_limit_bytes,
        "layer_names": list(plan.layer_names),
        "stages": stages,
        "choices": {str(op): name for op, name in choices.items()},
        "pins": {str(op): {"strategy": p.strategy, "scope": p.scope} for op, p in plan.pins.items()},
        "stage_pins": _stage_pins_to_json(plan.stage_pins),
        "notes": list(plan.notes),
        "step_time_s": plan.cost.step_time_s,  # for reading only: load_plan prices the plan again
    }
    if g is not plan.graph:
        out["solve_graph_fingerprint"] = g.fingerprint
    return out


_PER_STAGE_PAIRS = ("submeshes", "logical_meshes")


def _stage_pins_to_json(stage_pins) -> dict:
    out: dict = {}
    for key, value in stage_pins.items():
        if key in _PER_STAGE_PAIRS:
            out[key] = [None if v is None else list(v) for v in value]
        elif key == "boundaries":
            out[key] = list(value)
        elif key == "remat":
            out[key] = [None if v is None else remat_json(v) for v in value]
        elif key == "overlap":
            out[key] = list(value)
        elif key == "microbatch_group" and isinstance(value, FlexibleGroup):
            out[key], out["flexible_group"] = int(value), True  # Llama 3's schedule, not Megatron-LM's
        else:
            out[key] = value
    return out


def _stage_pins_from_json(data, num_stages: int) -> dict:
    """Stage pins as the Plan holds them (tuples), checked for form; a ValueError naming the bad entry."""
    if not isinstance(data, dict):
        raise ValueError("stage_pins must be an object")
    out: dict = {}
    for key, value in data.items():
        if key in _PER_STAGE_PAIRS or key == "remat":
            if not isinstance(value, list) or len(value) != num_stages:
                raise ValueError(f"stage_pins[{key!r}] must list one entry per stage ({num_stages})")
            if key == "remat":
                if any(v is not None and not isinstance(v, bool) and v not in REMAT_STRINGS for v in value):
                    raise ValueError("stage_pins['remat'] entries must be true, false, \"selective\" or null")
                out[key] = tuple(None if v is None else remat_value(v) for v in value)
            else:
                out[key] = tuple(None if v is None else (int(v[0]), int(v[1])) for v in value)
                if any(v is not None and len(data[key][j]) != 2 for j, v in enumerate(out[key])):
                    raise ValueError(f"stage_pins[{key!r}] entries must be [n0, n1] pairs or null")
        elif key == "boundaries":
            if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
                raise ValueError("stage_pins['boundaries'] must be a list of layer indices")
            out[key] = tuple(value)
        elif key == "microbatches":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError("stage_pins['microbatches'] must be an integer")
            out[key] = value
        elif key == "schedule":
            if value not in SCHEDULES:
                raise ValueError(f"stage_pins['schedule'] must be one of {', '.join(map(repr, SCHEDULES))}")
            out[key] = value
        elif key == "virtual_stages":
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError("stage_pins['virtual_stages'] must be a whole number of 2 or more")
            out[key] = value
        elif key == "zero":  # the ZeRO stage the memory is priced with (pricing.zero)
            if isinstance(value, bool) or value not in (0, 1, 2, 3):
                raise ValueError("stage_pins['zero'] must be a ZeRO stage 0, 1, 2 or 3")
            out[key] = value
        elif key == "overlap":  # the communication hidden behind compute (pricing.overlap)
            if not isinstance(value, list) or any(v not in OVERLAPS for v in value):
                raise ValueError(f"stage_pins['overlap'] must list names among {', '.join(map(repr, OVERLAPS))}")
            out[key] = check_overlap(value)
        elif key == "host":  # how the framework launches its kernels (backends.eager)
            if value not in HOSTS:
                raise ValueError(f"stage_pins['host'] must be one of {', '.join(map(repr, HOSTS))}")
            out[key] = value
        elif key == "accumulate":  # how the framework holds the gradients between microbatches (pricing.accumulate)
            if value not in ACCUMULATIONS:
                raise ValueError(f"stage_pins['accumulate'] must be one of {', '.join(map(repr, ACCUMULATIONS))}")
            out[key] = value
        elif key == "eager_loss":  # bytes of an eager framework's loss a device holds a step (pricing.eagerloss)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError("stage_pins['eager_loss'] must be a number of bytes, 0 or more")
            out[key] = float(value)
        elif key == "microbatch_group":  # the interleaved schedule's microbatches per chunk in a row (schedules)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError("stage_pins['microbatch_group'] must be a whole number of microbatches, 1 or more")
            out[key] = FlexibleGroup(value) if data.get("flexible_group") is True else value
        elif key == "flexible_group":  # the group is Llama 3's flexible schedule's (schedules.FlexibleGroup)
            if value is not True or "microbatch_group" not in data:
                raise ValueError("stage_pins['flexible_group'] must be true, beside a microbatch_group")
        else:
            raise ValueError(f"stage_pins has an unknown key {key!r}")
    return out


def save_plan(plan, path: str | os.PathLike) -> None:
    """Write ``plan`` to ``path`` as versioned JSON."""
    if plan.table is None or any(st.intra is None for st in plan.stages):
        raise ValueError("this plan has no per-stage strategies to save; build it with autopar_lab.planner")
    text = json.dumps(plan_to_dict(plan), indent=1)
    write_atomic(path, (text + "\n").encode())  # a reader never sees half a plan, an old plan survives a failed write


def _bad(where: str, what: str) -> ValueError:
    return ValueError(f"{where} is not a valid plan file: {what}.")


def load_plan(path: str | os.PathLike, graph, cluster=None, *, model=None):
    """The plan saved in ``path``, for ``graph`` on ``cluster`` (default: the cluster the file describes), re-priced.

    Refuses (ValueError, one sentence) a file of another version, a plan made for another graph or cluster, and a
    corrupt, hand-broken or hostile file (see :mod:`autopar_lab.planschema`: every field is checked before use).
    ``model``: the zoo model, needed only for a deep model planned on a shallower copy. ``graph`` may be the model
    itself (a ``ModelSpec``, as :func:`~autopar_lab.auto_plan` takes it): it is traced, and is the ``model``.
    """
    from .cluster import Cluster
    from .planner import microbatch_choices
    from .plan import price_plan
    from .pricing import CostTable, solve_graph_for
    from .pricing.table import with_routing
    from .solve.intra import StrategyCache, evaluate_intra

    where = f"plan file {os.fspath(path)!r}"
    if isinstance(path, (bytes, int)) or not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"load_plan takes the path of a plan file, got {type(path).__name__}.")
    if not hasattr(graph, "fingerprint") and callable(getattr(graph, "trace", None)):  # a ModelSpec
        model = graph if model is None else model
        graph = graph.trace()
    if not hasattr(graph, "fingerprint"):
        raise ValueError(f"load_plan needs the model the plan was made for (a ModelSpec or its traced graph), got "
                         f"{type(graph).__name__}: load_plan(path, model).")
    if cluster is not None and not isinstance(cluster, Cluster):
        cluster = Cluster.parse(cluster)  # 'cpu:2', a preset's name or a cluster file
    data = planschema.read_plan_file(path)
    planschema.check_form(data, where)
    try:
        fmt = precision_from_json(data.get("precision"))
    except ValueError as e:
        raise _bad(where, str(e).rstrip(".")) from None
    if fmt is not None:
        graph = retype(graph, fmt)  # the plan's number format: its graph is the retyped one
    if cluster is None:
        try:
            cluster = Cluster.from_json(data["cluster"])
        except (ValueError, TypeError) as e:
            raise _bad(where, f"its cluster is broken ({str(e).rstrip('.')})") from None
    if data["graph_fingerprint"] != graph.fingerprint:
        raise ValueError(f"{where} was made for another graph (fingerprint {data['graph_fingerprint']!r}, this graph "
                         f"has {graph.fingerprint!r}); plan this model again or load the plan with the graph it was "
                         "made for.")
    try:
        saved_cluster = Cluster.from_json(data["cluster"])
    except (ValueError, TypeError) as e:
        raise _bad(where, f"its cluster is broken ({e})") from None
    if saved_cluster.to_dict() != cluster.to_dict():
        raise ValueError(f"{where} was made for another cluster ({saved_cluster.name}: {saved_cluster.hosts} x "
                         f"{saved_cluster.devices_per_host} devices), not {cluster.name}: {cluster.hosts} x "
                         f"{cluster.devices_per_host}; load it with the cluster it was made for.")
    try:
        solve_graph = graph
        if "solve_graph_fingerprint" in data and data["solve_graph_fingerprint"] != graph.fingerprint:
            solve_graph = solve_graph_for(model) if model is not None else None
            if solve_graph is not None and fmt is not None:
                solve_graph = retype(solve_graph, fmt)
            if solve_graph is None or solve_graph.fingerprint != data["solve_graph_fingerprint"]:
                raise ValueError(f"{where} was planned on a shallower copy of the model; pass model= (the zoo model "
                                 "it was made for) to load it.")
        cluster = with_routing(cluster, model)  # a zoo model's routing limit, as CostTable.build priced it
        table = CostTable(graph, cluster, solve_graph=solve_graph)
        planschema.check_fits(data, where, ops=solve_graph.ops, num_layers=len(table.layer_names), cluster=cluster,
                              batch_size=table.batch_size, full_ops=graph.ops)
        if list(data["layer_names"]) != list(table.layer_names):
            raise _bad(where, "its layer names are not this graph's")
        B = data["microbatches"]
        if isinstance(B, bool) or not isinstance(B, int):
            raise _bad(where, f"microbatches must be an integer, got {B!r}")
        microbatch_choices(table.batch_size, B)
        if data["schedule"] not in SCHEDULES or data["stage_comm"] not in ("model", "ignore"):
            raise _bad(where, f"schedule must be one of {', '.join(map(repr, SCHEDULES))} and stage_comm 'model' or "
                              "'ignore'")
        choices = {int(op): str(name) for op, name in dict(data["choices"]).items()}
        g = solve_graph
        if set(choices) != set(g.ops):
            raise _bad(where, f"choices cover {len(choices)} operators, the graph has {len(g.ops)}")
        stages = data["stages"]
        if not isinstance(stages, list) or not stages:
            raise _bad(where, "it has no stages")
        specs: list[tuple] = []
        intras, offset = [], 0
        solutions: list[str] = []
        L = len(table.layer_names)
        for k, st in enumerate(stages):
            miss = [key for key in _STAGE_KEYS if key not in st]
            if miss:
                raise _bad(where, f"stage {k} lacks key {miss[0]!r}")
            layers = tuple(int(x) for x in st["layers"])
            submesh = tuple(int(x) for x in st["submesh"])
            shape = tuple(int(x) for x in st["logical_mesh"])
            if len(layers) != 2 or not 0 <= layers[0] <= layers[1] < L or (k == 0 and layers[0] != 0) or \
                    (k > 0 and layers[0] != specs[-1][0][1] + 1) or (k == len(stages) - 1 and layers[1] != L - 1):
                raise _bad(where, f"stage {k}'s layers {list(layers)} do not continue the stages before it over "
                                  f"layers 0..{L - 1}")
            if len(submesh) != 2 or len(shape) != 2 or math.prod(shape) != math.prod(submesh):
                raise _bad(where, f"stage {k}'s logical mesh {list(shape)} does not match its submesh {list(submesh)}")
            n = math.prod(submesh)
            if list(st["devices"]) != list(range(offset, offset + n)):
                raise _bad(where, f"stage {k}'s devices are not {offset}..{offset + n - 1}")
            offset += n
            if offset > cluster.num_devices:
                raise _bad(where, f"its stages use more than the cluster's {cluster.num_devices} devices")
            mesh = cluster.logical_mesh(submesh, shape)
            cache = StrategyCache(mesh)
            names = dict(choices)
            names.update({int(op): str(s) for op, s in dict(st.get("choices_outside", {})).items()})
            chosen = {}
            for op in g.ops:
                node = g.op(op)
                hit = [s for s in cache.strategies(node) if s.name == names[op]]
                if not hit:
                    raise _bad(where, f"strategy {names[op]!r} of operator {node.describe()} is not one of its "
                                      f"strategies on stage {k}'s {shape[0]}x{shape[1]} mesh")
                chosen[op] = hit[0]
            intras.append(evaluate_intra(g, mesh, chosen, ops=g.ops, cache=cache))
            specs.append((layers, submesh, shape, remat_value(st["remat"])))
            solutions.append(str(st.get("solution", "fast")))
        mem = float(data.get("mem_limit_bytes", cluster.device.memory_bytes))
        stage_pins = _stage_pins_from_json(data.get("stage_pins", {}), len(specs))
        shared, own = _pins_of(data, table)
        plan = price_plan(table, specs, intras=intras, microbatches=B, schedule=data["schedule"],
                          stage_comm=data["stage_comm"], mem_limit_bytes=mem, method=str(data["method"]), solve_s={},
                          notes=tuple(data.get("notes", ())), pins=own, stage_pins=stage_pins,
                          virtual_stages=data.get("virtual_stages"), solutions=solutions)
        return _with_shared_pins(plan, shared, where)
    except ValueError as e:
        if where in str(e):
            raise
        raise _bad(where, str(e).rstrip(".")) from None
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise _bad(where, f"a field has the wrong form ({type(e).__name__}: {e})") from None


def _pins_of(data, table) -> tuple[dict[int, Pin], dict[int, Pin]]:
    """(shared pins, pins of single layers) of a checked plan file, by operator of the model's own graph; a version
    1-3 file's pins (by the solve graph's operators) are converted: each becomes a shared pin of the first operator
    its solution stands for."""
    if not planschema.old_pins(data):
        given = {int(op): Pin(str(e["strategy"]), str(e["scope"])) for op, e in dict(data["pins"]).items()}
        return ({op: p for op, p in given.items() if p.scope != LAYER},
                {op: p for op, p in given.items() if p.scope == LAYER})
    m = table.op_map
    shared = {}
    for op, name in dict(data["pins"]).items():
        full = m.full_ops(m.representative(int(op)))
        if full:  # an operator of a copy layer that prices none and stands for nothing: a pin of nothing
            shared[full[0]] = Pin(str(name))
    own = {int(op): Pin(str(name), LAYER) for op, name in dict(data.get("layer_pins", {})).items()}
    return shared, own


def _with_shared_pins(plan, shared: dict[int, Pin], where: str):
    """``plan`` (priced with its layers' own pins) with the shared pins recorded by the rules
    (:func:`~autopar_lab.operators.pins_with`), each checked to name the strategy the plan runs."""
    pins = dict(plan.pins)
    for op, pin in shared.items():
        pins = operators.pins_with(plan, op, pin, pins)
    out = dataclasses.replace(plan, pins=pins)
    for op, pin in pins.items():
        runs = operators.choice(out, op).name
        if runs != pin.strategy:
            raise _bad(where, f"pins[{op}] is {pin.strategy[:60]!r} but the plan runs operator {op} as "
                              f"{runs[:60]!r}; a pin names the strategy the plan chose")
    return out
