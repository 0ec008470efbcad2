"""Whole plans: Alpa's two levels together (:func:`auto_plan`), and the hand-made baselines they are measured against.

How a plan is priced:

1. For every logical mesh of every submesh shape the cluster allows, the intra-operator pass
   (:func:`~autopar_lab.solve.intra.solve_intra`) picks each operator's strategy; each layer's cost is then the sum of
   its operators' costs and of the resharding on the edges into them, split into forward and backward (+ update).
   A zoo model is solved on a copy with fewer layers (its repeated layers are identical, so they get identical
   strategies and costs): planning GPT-39B needs a 4-layer trace per mesh, not a 48-layer one.
2. A stage running layers ``a..b`` on a microbatch of ``batch / B`` samples costs ``sum(layer costs) / B`` plus a
   fixed launch overhead per heavy operator (``LAUNCH_OVERHEAD_S``): the term that stops more microbatches from
   being free. With rematerialisation, it holds only its input activations and runs its forward pass twice.
3. The stage DP (:func:`~autopar_lab.solve.inter.stage_dp`) picks stages, submeshes and logical meshes; the plan's
   step time is the makespan of the event-level simulation of that pipeline (:mod:`autopar_lab.simulate`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .graph.opgraph import BACKWARD, BATCH, FORWARD, INPUT_PRIMITIVE, OpGraph
from .plan import CostReport, Plan, Stage
from .simulate import simulate
from .solve import inter
from .solve.intra import IntraPlan, _StrategyCache, conversions, layer_signature, solve_intra

LAUNCH_OVERHEAD_S = 5e-6  # per heavy operator (matmul, convolution, reduction, gather) per microbatch
_HEAVY = frozenset(["dot_general", "conv_general_dilated", "reduce_sum", "reduce_max", "gather", "scatter-add",
                    "scatter_add", "argmax", "cumsum"])


@dataclass(frozen=True)
class LayerCost:
    """One layer on one logical mesh, per training step at the graph's batch (bytes per device)."""

    fwd_s: float
    bwd_s: float  # backward + optimizer update
    compute_s: float
    comm_s: float
    reshard_s: float
    static_bytes: float
    act_bytes: float
    heavy_fwd: int
    heavy_bwd: int


def layer_costs(graph: OpGraph, plan: IntraPlan, layer_names: Sequence[str], cache=None) -> list[LayerCost]:
    """Split an intra plan's cost by layer: each operator counts in its layer (operators without one in the last
    layer), each resharding in its consumer's layer."""
    index = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    acc = [dict(fwd=0.0, bwd=0.0, compute=0.0, comm=0.0, reshard=0.0, static=0.0, act=0.0, hf=0, hb=0)
           for _ in layer_names]
    cache = cache or _StrategyCache(plan.mesh)
    mshape = tuple(plan.mesh.shape)

    def slot(op):
        return acc[index.get(graph.op(op).layer, last)]

    for op in plan.ops:
        node, s = graph.op(op), plan.strategies[op]
        a = slot(op)
        a["fwd" if node.role == FORWARD else "bwd"] += s.cost
        a["compute"] += s.compute_s
        a["comm"] += s.comm_s
        if node.primitive in _HEAVY:
            a["hf" if node.role == FORWARD else "hb"] += 1
        if node.primitive == INPUT_PRIMITIVE:
            kind = graph.tensor(node.outputs[0]).kind
            a["static"] += {"param": 2 * s.mem_bytes, "opt_state": s.mem_bytes}.get(kind, 0.0)
        elif node.role == FORWARD:
            for k, t in enumerate(node.outputs):
                if any(graph.op(c).role == BACKWARD for c in graph.consumers.get(t, ())):
                    info = graph.tensor(t)
                    a["act"] += s.out_specs[k].bytes_per_device(info.shape, info.dtype, mshape)
    for _u, v, is_alias, _t, _src, _dst, c in conversions(graph, plan.ops, plan.strategies, cache):
        a = slot(v)
        a["reshard"] += c
        a["fwd" if graph.op(v).role == FORWARD and not is_alias else "bwd"] += c
    return [LayerCost(a["fwd"], a["bwd"], a["compute"], a["comm"], a["reshard"], a["static"], a["act"], a["hf"],
                      a["hb"]) for a in acc]


def cut_bytes(graph: OpGraph, layer_names: Sequence[str]) -> list[float]:
    """Activation bytes (whole batch) crossing the cut in front of each layer 1..L-1 in the forward pass."""
    index = {name: k for k, name in enumerate(layer_names)}
    last = len(layer_names) - 1
    out = [0.0] * max(len(layer_names) - 1, 0)
    for node in graph:
        if node.role != FORWARD or node.primitive == INPUT_PRIMITIVE:
            continue
        src = index.get(node.layer, last)
        for t in node.outputs:
            far = max((index.get(graph.op(c).layer, last) for c in graph.consumers.get(t, ())
                       if graph.op(c).role == FORWARD), default=src)
            for k in range(src + 1, far + 1):
                out[k - 1] += graph.tensor(t).nbytes
    return out


def _batch_size(graph: OpGraph) -> int:
    sizes = [graph.tensor(t).shape[0] for t in graph.inputs if graph.tensor(t).kind == BATCH and graph.tensor(t).shape]
    return max(sizes) if sizes else 1


class CostTable:
    """Layer costs per logical mesh, computed on demand and cached (the stage DP asks for many)."""

    def __init__(self, graph: OpGraph, cluster, *, solve_graph: OpGraph | None = None, solver: str = "cbc",
                 progress: Callable[[str, int, int], None] | None = None):
        self.graph = graph
        self.cluster = cluster
        self.layer_names = list(graph.layers) or [""]
        self.solve_graph = solve_graph or graph
        self.solver = solver
        self.progress = progress
        self._mesh: dict[tuple, tuple[list[LayerCost], IntraPlan]] = {}
        self._sums: dict[tuple, dict[str, list[float]]] = {}
        self._shapes: dict[tuple, list] = {}
        self._map = self._layer_map()
        self.cut_bytes = cut_bytes(graph, self.layer_names)
        self.batch_size = _batch_size(graph)
        self.solve_s = 0.0

    def _layer_map(self) -> list[int]:
        """Full-graph layer -> the solve graph's layer with the same structure (a middle copy when there are several)."""
        if self.solve_graph is self.graph:
            return list(range(len(self.layer_names)))
        small_names = list(self.solve_graph.layers)
        by_sig: dict[tuple, list[int]] = {}
        for k, name in enumerate(small_names):
            by_sig.setdefault(_plain_sig(self.solve_graph, name), []).append(k)
        out = []
        for name in self.layer_names:
            ks = by_sig.get(_plain_sig(self.graph, name))
            if not ks:
                raise LookupError(name)
            out.append(ks[len(ks) // 2])
        return out

    def mesh_costs(self, submesh, shape) -> tuple[list[LayerCost], IntraPlan]:
        key = (tuple(submesh), tuple(shape))
        if key not in self._mesh:
            t0 = time.perf_counter()
            mesh = self.cluster.logical_mesh(submesh, shape)
            plan = solve_intra(self.solve_graph, mesh, solver=self.solver, rounds=1)
            small = layer_costs(self.solve_graph, plan, list(self.solve_graph.layers) or [""])
            self._mesh[key] = ([small[k] for k in self._map], plan)
            self.solve_s += time.perf_counter() - t0
            if self.progress:
                self.progress(f"intra-op {submesh[0]}x{submesh[1]} as {shape[0]}x{shape[1]}", len(self._mesh), 0)
        return self._mesh[key]

    def _prefix(self, submesh, shape):
        """Running sums of the layer costs on one mesh, so any layer range costs O(1) (the DP asks for many)."""
        key = (tuple(submesh), tuple(shape))
        if key not in self._sums:
            costs, _ = self.mesh_costs(submesh, shape)
            fields = ("fwd_s", "bwd_s", "static_bytes", "act_bytes", "heavy_fwd", "heavy_bwd")
            sums = {f: [0.0] for f in fields}
            for c in costs:
                for f in fields:
                    sums[f].append(sums[f][-1] + getattr(c, f))
            self._sums[key] = sums
        return self._sums[key]

    def stage(self, start: int, end: int, submesh, shape, microbatches: int, remat: bool) -> inter.StageCandidate:
        _, plan = self.mesh_costs(submesh, shape)
        sums = self._prefix(submesh, shape)

        def total(f):
            return sums[f][end + 1] - sums[f][start]

        B = microbatches
        fwd = total("fwd_s") / B + LAUNCH_OVERHEAD_S * total("heavy_fwd")
        bwd = total("bwd_s") / B + LAUNCH_OVERHEAD_S * total("heavy_bwd")
        static = total("static_bytes")
        act = total("act_bytes") / B
        if remat:
            n = shape[0] * shape[1]
            # Only the stage's input is kept (sharded over the mesh); the forward pass runs again in the backward.
            entry = self.cut_bytes[start - 1] if start > 0 else 0.0
            act = entry / B / n
            bwd += fwd
        return inter.StageCandidate((start, end), tuple(submesh), tuple(shape), remat, fwd, bwd, static, act,
                                    payload=plan)

    def candidates(self, start: int, end: int, submesh, microbatches: int, remat=(False, True)):
        sub = tuple(submesh)
        if sub not in self._shapes:
            self._shapes[sub] = self.cluster.logical_mesh_shapes(sub)
        cands = [self.stage(start, end, sub, shape, microbatches, r) for shape in self._shapes[sub] for r in remat]
        return pareto(cands)


def pareto(cands: Sequence[inter.StageCandidate]) -> list[inter.StageCandidate]:
    """The candidates no other candidate beats on every count (forward time, backward time, static and activation
    memory): the stage DP and the simulation can never prefer a dominated one, so dropping them changes no plan.

    >>> a = inter.StageCandidate((0, 0), (1, 2), (1, 2), False, 1.0, 2.0, 10.0, 5.0)
    >>> b = inter.StageCandidate((0, 0), (1, 2), (2, 1), False, 1.5, 2.0, 10.0, 5.0)
    >>> [c.logical_mesh for c in pareto([a, b])]
    [(1, 2)]
    """
    keys = [(c.fwd_s, c.bwd_s, c.static_bytes, c.act_bytes) for c in cands]
    out = []
    for i, ki in enumerate(keys):
        dominated = any(all(x <= y for x, y in zip(kj, ki)) and (kj != ki or j < i)
                        for j, kj in enumerate(keys) if j != i)
        if not dominated:
            out.append(cands[i])
    return out


def _plain_sig(graph: OpGraph, layer: str) -> tuple:
    """A layer's structure without its boundary: which operators, not which layer feeds them."""
    ops = graph.ops_in_layer(layer)
    return tuple((p[0], tuple(r for r in p[1] if r[0] == "in")) for p in layer_signature(graph, ops))


def _solve_graph_for(model) -> OpGraph | None:
    """A shallower copy of a zoo model whose layers cover every distinct layer of the full model."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "num_layers") or cfg.num_layers <= 4 or getattr(model, "family", "") == "wresnet":
        return None
    from . import models

    overrides = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "num_layers"}
    small = models.get(model.name, num_layers=4, **overrides)
    return small.trace()


def _as_graph(model_or_graph) -> tuple[OpGraph, Any, float]:
    if isinstance(model_or_graph, OpGraph):
        return model_or_graph, None, model_or_graph.trace_s
    graph = model_or_graph.trace()
    return graph, model_or_graph, graph.trace_s


def _table(model_or_graph, cluster, solver, progress) -> tuple[CostTable, dict]:
    graph, model, trace_s = _as_graph(model_or_graph)
    t0 = time.perf_counter()
    small = _solve_graph_for(model) if model is not None else None
    try:
        table = CostTable(graph, cluster, solve_graph=small, solver=solver, progress=progress)
    except LookupError:
        table = CostTable(graph, cluster, solver=solver, progress=progress)
    return table, {"trace": trace_s + (time.perf_counter() - t0)}


def _finish(table: CostTable, cluster, method: str, stages: Sequence[inter.StageCandidate], microbatches: int,
            schedule: str, stage_comm: str, mem_limit: float, solve_s: dict, notes=()) -> Plan:
    """Place the stages, simulate the pipeline, and assemble the Plan and its CostReport."""
    offsets, o = [], 0
    for st in stages:
        offsets.append(o)
        o += st.submesh[0] * st.submesh[1]
    send_f, send_b = [], []
    for k in range(1, len(stages)):
        nbytes = table.cut_bytes[stages[k].layers[0] - 1] / microbatches
        link = cluster.intra_host if offsets[k] % cluster.devices_per_host else cluster.inter_host
        t = link.latency + nbytes / link.bandwidth
        send_f.append(t)
        send_b.append(t)
    def run(warmup):
        return simulate([s.fwd_s for s in stages], [s.bwd_s for s in stages], microbatches, schedule,
                        send_fwd_s=send_f, send_bwd_s=send_b, act_bytes=[s.act_bytes for s in stages],
                        static_bytes=[s.static_bytes for s in stages], warmup=warmup)

    tl = run(None)
    if schedule == "1f1b" and any(send_f):
        # A deeper 1F1B warm-up, counting each cut as pipeline positions (as the DP's latency formula does: a
        # transfer is a stage of its own), hides a slow link's round trip with more microbatches in flight; it is
        # used when it is faster and still fits in memory.
        t_ref = max(s.fwd_s + s.bwd_s for s in stages) or 1.0
        extra = [math.ceil((f + b) / t_ref - 1e-9) if f + b > 0 else 0 for f, b in zip(send_f, send_b)]
        deep = run([len(stages) - i + sum(extra[i:]) for i in range(len(stages))])
        if deep.makespan < tl.makespan and all(m <= mem_limit for m in deep.peak_mem_bytes):
            tl = deep
    busiest = max(range(len(stages)), key=lambda i: tl.busy_s[i])
    plan_stages = []
    for st, off, peak in zip(stages, offsets, tl.peak_mem_bytes):
        costs, intra = table.mesh_costs(st.submesh, st.logical_mesh)
        part = costs[st.layers[0]:st.layers[1] + 1]
        plan_stages.append(Stage(st.layers, st.submesh, st.logical_mesh,
                                 tuple(range(off, off + st.submesh[0] * st.submesh[1])), st.remat, st.fwd_s, st.bwd_s,
                                 sum(c.compute_s for c in part), sum(c.comm_s for c in part),
                                 sum(c.reshard_s for c in part), st.static_bytes, st.act_bytes, peak, intra))
    b = plan_stages[busiest]
    busy = tl.busy_s[busiest]
    work = b.compute_s + b.comm_s + b.reshard_s
    # The busiest stage's busy time, split in proportion to its terms (launch overheads and recomputation included).
    scale = busy / work if work > 0 else 0.0
    cost = CostReport(
        step_time_s=tl.makespan,
        compute_s=b.compute_s * scale,
        comm_s=b.comm_s * scale,
        reshard_s=b.reshard_s * scale,
        stage_comm_s=sum(send_f) + sum(send_b),
        bubble_s=tl.makespan - busy,
        peak_mem_bytes=tuple(tl.peak_mem_bytes),
        mem_limit_bytes=mem_limit,
        samples_per_s=table.batch_size / tl.makespan if tl.makespan > 0 else math.inf,
        busiest_stage=busiest,
        timeline=tl,
    )
    solve_s = dict(solve_s)
    solve_s["intra"] = table.solve_s
    solve_s["total"] = sum(v for k, v in solve_s.items() if k != "total")
    return Plan(table.graph, cluster, method, tuple(table.layer_names), tuple(plan_stages), microbatches, schedule,
                stage_comm, cost, solve_s, tuple(notes), table=table)


def _microbatch_choices(batch: int, microbatches) -> list[int]:
    if microbatches == "auto":
        return [b for b in (1 << e for e in range(batch.bit_length())) if batch % b == 0]
    b = int(microbatches)
    if b < 1 or batch % b:
        raise ValueError(f"microbatches={microbatches} must be a positive divisor of the batch size {batch}")
    return [b]


def auto_plan(model_or_graph, cluster, *, microbatches="auto", stage_comm: str = "model", schedule: str = "1f1b",
              mem_limit: float | None = None, solver: str = "cbc", max_stages: int | None = None,
              progress: Callable[[str, int, int], None] | None = None, _table_cache: CostTable | None = None) -> Plan:
    """Alpa's plan: the stage DP over every layer range x submesh x logical mesh, each priced by the intra-op ILP.

    ``model_or_graph``: a zoo ``ModelSpec`` (planned on a shallower copy, see the module docstring) or an
    ``OpGraph``. ``microbatches``: a count or ``"auto"`` (every power of two dividing the batch). ``stage_comm``:
    ``"model"`` prices transfers between stages, ``"ignore"`` reproduces Alpa (the plan's reported step time still
    includes them). ``mem_limit``: bytes per device (default: the device's memory).
    """
    if _table_cache is not None:
        table, solve_s = _table_cache, {"trace": 0.0}
    else:
        table, solve_s = _table(model_or_graph, cluster, solver, progress)
    mem = float(cluster.device.memory_bytes if mem_limit is None else mem_limit)
    t0 = time.perf_counter()
    intra_before = table.solve_s
    kw = dict(mem_limit_bytes=mem, intra_link=cluster.intra_host, inter_link=cluster.inter_host,
              stage_comm=stage_comm, schedule=schedule, max_stages=max_stages)
    choices = _microbatch_choices(table.batch_size, microbatches)
    L = len(table.layer_names)
    result = inter.stage_dp_auto(
        L, cluster.hosts, cluster.devices_per_host,
        lambda a, b, sub, B: table.candidates(a, b, sub, B), table.batch_size, choices=choices,
        cut_bytes=lambda B: [c / B for c in table.cut_bytes], **kw)
    solve_s["inter"] = time.perf_counter() - t0 - (table.solve_s - intra_before)
    return _finish(table, cluster, "auto", result.stages, result.microbatches, schedule, stage_comm, mem, solve_s)


def megatron_plan(model_or_graph, cluster, *, dp: int, tp: int, pp: int, microbatches: int = 1,
                  schedule: str = "1f1b", mem_limit: float | None = None, solver: str = "cbc",
                  _table_cache: CostTable | None = None) -> Plan:
    """Megatron-LM's layout: ``pp`` stages of equal layer counts, each on ``dp x tp`` devices viewed as a (dp, tp)
    logical mesh with the tensor-parallel axis inside a host; the operators' shardings on that mesh come from the
    intra-op ILP (so this baseline is Megatron's layout with the best sharding our cost model finds for it)."""
    table = _table_cache
    solve_s = {}
    if table is None:
        table, solve_s = _table(model_or_graph, cluster, solver, None)
    n = cluster.num_devices
    if dp * tp * pp != n:
        raise ValueError(f"dp x tp x pp = {dp}x{tp}x{pp} = {dp * tp * pp}, but the cluster has {n} devices")
    if tp > cluster.devices_per_host:
        raise ValueError(f"tp={tp} exceeds the {cluster.devices_per_host} devices of a host (Megatron keeps tensor "
                         "parallelism inside a host)")
    L = len(table.layer_names)
    if pp > L:
        raise ValueError(f"pp={pp} stages but the model has only {L} layers")
    per = dp * tp
    M = cluster.devices_per_host
    submesh = (1, per) if per <= M else (per // M, M)
    if submesh not in [tuple(s) for s in cluster.submesh_shapes()]:
        raise ValueError(f"a stage of {per} devices is not a submesh shape of this cluster")
    bounds = [round(k * L / pp) for k in range(pp + 1)]
    mem = float(cluster.device.memory_bytes if mem_limit is None else mem_limit)
    _microbatch_choices(table.batch_size, microbatches)
    stages = [table.stage(bounds[k], bounds[k + 1] - 1, submesh, (dp, tp), microbatches, False) for k in range(pp)]
    return _finish(table, cluster, f"megatron(dp={dp},tp={tp},pp={pp})", stages, microbatches, schedule, "model",
                   mem, solve_s)


def data_parallel_plan(model_or_graph, cluster, *, microbatches: int = 1, mem_limit: float | None = None,
                       solver: str = "cbc", _table_cache: CostTable | None = None) -> Plan:
    """One stage on the whole cluster viewed as a (N*M, 1) mesh, microbatches as gradient accumulation.

    The operators' shardings on that 1D mesh come from the intra-op ILP: for dense models that is data parallelism
    (the batch split over every device); for MoE the ILP also splits the experts (data + expert parallelism)."""
    table = _table_cache
    solve_s = {}
    if table is None:
        table, solve_s = _table(model_or_graph, cluster, solver, None)
    n = cluster.num_devices
    submesh = (cluster.hosts, cluster.devices_per_host) if cluster.hosts > 1 else (1, cluster.devices_per_host)
    mem = float(cluster.device.memory_bytes if mem_limit is None else mem_limit)
    stage = table.stage(0, len(table.layer_names) - 1, submesh, (n, 1), microbatches, False)
    return _finish(table, cluster, "data_parallel", [stage], microbatches, "1f1b", "model", mem, solve_s)


def megatron_grid(cluster, num_layers: int) -> list[tuple[int, int, int]]:
    """Every valid (dp, tp, pp): tp a power of two inside a host, pp dividing into submesh-shaped stages."""
    n, M = cluster.num_devices, cluster.devices_per_host
    out = []
    tp = 1
    while tp <= M:
        pp = 1
        while pp <= min(n // tp, num_layers):
            if n % (tp * pp) == 0:
                dp = n // (tp * pp)
                per = dp * tp
                if per <= M or per % M == 0:
                    out.append((dp, tp, pp))
            pp *= 2
        tp *= 2
    return out


def compare(model_or_graph, cluster, *, microbatches="auto", solver: str = "cbc", stage_comm: str = "model") -> dict:
    """Auto vs the best Megatron-style configuration vs data parallelism, all priced by one cost table."""
    table, solve_s = _table(model_or_graph, cluster, solver, None)
    auto = auto_plan(table.graph, cluster, microbatches=microbatches, solver=solver, stage_comm=stage_comm,
                     _table_cache=table)
    best, tried = None, []
    mbs = _microbatch_choices(table.batch_size, microbatches)
    for dp, tp, pp in megatron_grid(cluster, len(table.layer_names)):
        for mb in mbs:
            if pp == 1 and mb > 1:
                continue  # without a pipeline, microbatches only add overhead
            try:
                p = megatron_plan(table.graph, cluster, dp=dp, tp=tp, pp=pp, microbatches=mb, _table_cache=table)
            except ValueError:
                continue
            fits = all(m <= p.cost.mem_limit_bytes for m in p.cost.peak_mem_bytes)
            tried.append({"dp": dp, "tp": tp, "pp": pp, "microbatches": mb, "step_time_s": p.cost.step_time_s,
                          "fits": fits})
            if fits and (best is None or p.cost.step_time_s < best.cost.step_time_s):
                best = p
    # Data parallelism with gradient accumulation: the fastest microbatch count that fits (else the smallest peak).
    datas = [data_parallel_plan(table.graph, cluster, microbatches=mb, _table_cache=table) for mb in mbs]
    fitting = [p for p in datas if all(m <= p.cost.mem_limit_bytes for m in p.cost.peak_mem_bytes)]
    data = (min(fitting, key=lambda p: p.cost.step_time_s) if fitting
            else min(datas, key=lambda p: max(p.cost.peak_mem_bytes)))
    return {"auto": auto, "megatron_best": best, "data_parallel": data, "megatron_tried": tried,
            "trace_s": solve_s.get("trace", 0.0)}
