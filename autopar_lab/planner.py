"""Whole plans: Alpa's two levels together (:func:`auto_plan`), and the hand-made baselines they are measured against.

How a plan is priced:

1. For every logical mesh of every submesh shape the cluster allows, the intra-operator pass
   (:func:`~autopar_lab.solve.intra.solve_intra`) picks each operator's strategy; each layer's cost is then the sum of
   its operators' costs and of the resharding on the edges into them, split into forward and backward (+ update).
   A zoo model is solved on a copy with fewer layers (its repeated layers are identical, so they get identical
   strategies and costs): planning GPT-39B needs a 4-layer trace per mesh, not a 48-layer one.
2. A stage running layers ``a..b`` on a microbatch of ``batch / B`` samples costs ``sum(layer costs) / B`` plus a
   fixed launch overhead per heavy operator (``LAUNCH_OVERHEAD_S``): the term that stops more microbatches from
   being free; each forward and each backward task also costs the device's ``task_overhead_s`` (measured for the
   cpu preset; shared by a host's devices, :meth:`CostTable.task_overhead_s`). With rematerialisation, it holds
   only its input activations and runs its forward pass twice.
3. The stage DP (:func:`~autopar_lab.solve.inter.stage_dp`) picks stages, submeshes and logical meshes; the plan's
   step time is the makespan of the event-level simulation of that pipeline (:mod:`autopar_lab.simulate`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from . import checks
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

    def __init__(self, graph: OpGraph, cluster, *, solve_graph: OpGraph | None = None, solver: str = "highs",
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
        self._memo: dict = {}  # solve_intra's first passes, shared by meshes with the same axis 0
        self._op_map: dict[int, int] | None = None
        self.layer_map = self._layer_map()  # full-graph layer k is priced as the solve graph's layer layer_map[k]
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

    def solve_op(self, op: int) -> int | None:
        """The operator of the solve graph that stands for operator ``op`` of the full graph (the same position in
        the layer :attr:`layer_map` prices it with; operators outside layers: the input with the same pytree path);
        None when there is none (an operator outside layers that only the full graph has).

        Strategies of a plan solved on a shallower copy are keyed by these ids: this is how they reach the full
        graph's operators (export, for one)."""
        if self.solve_graph is self.graph:
            return op
        if self._op_map is None:
            self._op_map = self._build_op_map()
        return self._op_map.get(op)

    def _build_op_map(self) -> dict[int, int]:
        small_names = list(self.solve_graph.layers) or [""]
        out = {}
        for k, name in enumerate(self.layer_names):
            full, small = self.graph.ops_in_layer(name), self.solve_graph.ops_in_layer(small_names[self.layer_map[k]])
            if len(full) == len(small):  # equal plain signatures: the same operators in the same order
                out.update(zip(full, small))
        by_path = {}
        for op in self.solve_graph.ops:
            node = self.solve_graph.op(op)
            if node.layer is None and node.primitive == INPUT_PRIMITIVE:
                by_path[self.solve_graph.tensor(node.outputs[0]).path] = op
        for op in self.graph.ops:
            node = self.graph.op(op)
            if node.layer is None and node.primitive == INPUT_PRIMITIVE:
                hit = by_path.get(self.graph.tensor(node.outputs[0]).path)
                if hit is not None:
                    out[op] = hit
        return out

    def mesh_costs(self, submesh, shape) -> tuple[list[LayerCost], IntraPlan]:
        key = (tuple(submesh), tuple(shape))
        if key not in self._mesh:
            t0 = time.perf_counter()
            mesh = self.cluster.logical_mesh(submesh, shape)
            plan = solve_intra(self.solve_graph, mesh, solver=self.solver, rounds=1, memo=self._memo)
            small = layer_costs(self.solve_graph, plan, list(self.solve_graph.layers) or [""])
            self._mesh[key] = ([small[k] for k in self.layer_map], plan)
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
        task = self.task_overhead_s(submesh)  # once per task: a rematerialised backward is still one task
        fwd, bwd = fwd + task, bwd + task
        return inter.StageCandidate((start, end), tuple(submesh), tuple(shape), remat, fwd, bwd, static, act,
                                    payload=plan)

    def task_overhead_s(self, submesh) -> float:
        """Seconds charged per stage task (the forward, or the backward, of one microbatch): the device's
        ``task_overhead_s`` times the host's devices over the stage's devices on that host. A host runs every
        stage's tasks from one driver, so a stage on d of its D devices gets d/D of it, as it gets d/D of the
        host's cores (measured on the cpu preset: tasks of different stages do not overlap). 0 on the GPU presets."""
        per_host = self.cluster.devices_per_host
        return self.cluster.device.task_overhead_s * per_host / min(int(submesh[1]), per_host)

    def _distinct(self, submesh) -> list:
        sub = tuple(submesh)
        if sub not in self._shapes:
            self._shapes[sub] = distinct_mesh_shapes(self.cluster, sub)
        return self._shapes[sub]

    def candidates(self, start: int, end: int, submesh, microbatches: int, remat=(False, True)):
        """The Pareto-optimal stage candidates for layers start..end on a submesh (one per distinct logical mesh
        and remat choice, dominated ones dropped)."""
        sub = tuple(submesh)
        cands = [self.stage(start, end, sub, shape, microbatches, r) for shape in self._distinct(sub) for r in remat]
        return pareto(cands)

    def candidate_fn(self, microbatches: int, mem_limit: float | None = None):
        """``candidates`` for one microbatch count as the stage DP calls it, ``(start, end, submesh)``, computed
        for all layer ranges of a submesh at once with numpy; with ``mem_limit``, candidates that cannot fit even
        holding one microbatch are left out (the DP could never use them). Same candidates, same order, same
        numbers as :meth:`candidates` otherwise.
        """
        blocks: dict[tuple, _Block] = {}

        def fn(start, end, submesh):
            sub = tuple(submesh)
            if sub not in blocks:
                blocks[sub] = _Block(self, sub, microbatches, mem_limit)
            return blocks[sub].candidates(self, start, end, sub)

        return fn


def mesh_signature(mesh) -> tuple:
    """What the intra-op pass sees of a logical mesh: each axis' size and link, the cluster's device.

    A mesh with one split axis is the same problem whichever axis it is: (1, 8) and (8, 1) on one host run the same
    collectives over the same devices, and the ILP finds the same plan with the axis renamed. With both axes split
    the order matters (the sequential solve decides axis 0 first), so it is kept.

    >>> from autopar_lab.cluster import Cluster
    >>> c = Cluster.preset("p3.16xlarge")
    >>> mesh_signature(c.logical_mesh((1, 8), (1, 8))) == mesh_signature(c.logical_mesh((1, 8), (8, 1)))
    True
    >>> mesh_signature(c.logical_mesh((1, 8), (2, 4))) == mesh_signature(c.logical_mesh((1, 8), (4, 2)))
    False
    """
    axes = []
    for a in (0, 1):
        n = mesh.axis_size(a)
        if n > 1:
            link = mesh.axis_link(a)
            axes.append((n, float(link.bandwidth), float(link.latency)))
    return (mesh.cluster.device, tuple(axes))


def distinct_mesh_shapes(cluster, submesh) -> list[tuple[int, int]]:
    """The submesh's logical mesh shapes, keeping the first of each group with the same :func:`mesh_signature`
    (their layer costs are the same, so the stage DP needs only one and the intra-op pass solves only one).

    >>> from autopar_lab.cluster import Cluster
    >>> distinct_mesh_shapes(Cluster.preset("p3.16xlarge"), (1, 8))
    [(1, 8), (2, 4), (4, 2)]
    """
    out, seen = [], set()
    for shape in cluster.logical_mesh_shapes(submesh):
        sig = mesh_signature(cluster.logical_mesh(submesh, shape))
        if sig not in seen:
            seen.add(sig)
            out.append(tuple(shape))
    return out


class _Block:
    """Every stage candidate of one submesh at one microbatch count, as arrays over (start, end) layers.

    ``keys[f][k, a, b]``: field f (forward s, backward s, static bytes, activation bytes) of the k-th (logical
    mesh, remat) option for layers a..b, computed with the same float operations as :meth:`CostTable.stage`;
    ``keep[k, a, b]``: the option is Pareto-optimal there (as :func:`pareto` decides, ties to the first) and, when
    a memory limit is given, fits in it while holding one microbatch (a candidate that cannot is never usable:
    a stage holds at least one microbatch and its memory only grows with more).
    """

    def __init__(self, table: "CostTable", submesh, microbatches: int, mem_limit: float | None,
                 remat=(False, True)):
        L, B = len(table.layer_names), microbatches
        self.options = [(shape, r) for shape in table._distinct(submesh) for r in remat]
        upper = np.triu(np.ones((L, L), dtype=bool))  # start <= end
        entry = np.array([0.0] + list(table.cut_bytes), dtype=float)[:L]  # bytes entering layer a
        fields = [[], [], [], []]
        for shape, r in self.options:
            sums = {f: np.array(v, dtype=float) for f, v in table._prefix(submesh, shape).items()}

            def total(f):
                return sums[f][None, 1:] - sums[f][:-1, None]  # [a, b] = sums[b + 1] - sums[a]

            fwd = total("fwd_s") / B + LAUNCH_OVERHEAD_S * total("heavy_fwd")
            bwd = total("bwd_s") / B + LAUNCH_OVERHEAD_S * total("heavy_bwd")
            static = total("static_bytes")
            act = total("act_bytes") / B
            if r:
                n = shape[0] * shape[1]
                act = np.broadcast_to((entry / B / n)[:, None], (L, L))
                bwd = bwd + fwd
            task = table.task_overhead_s(submesh)
            fwd, bwd = fwd + task, bwd + task
            for out, v in zip(fields, (fwd, bwd, static, act)):
                out.append(np.where(upper, v, np.inf))
        keys = [np.stack(f) for f in fields]  # (K, L, L) each
        K = len(self.options)
        le = np.ones((K, K, L, L), dtype=bool)  # [j, i]: option j is <= option i on every count
        eq = np.ones((K, K, L, L), dtype=bool)
        for v in keys:
            le &= v[:, None] <= v[None, :]
            eq &= v[:, None] == v[None, :]
        j_before_i = np.tril(np.ones((K, K), dtype=bool), -1).T[:, :, None, None]  # j < i
        not_self = ~np.eye(K, dtype=bool)[:, :, None, None]
        dominated = (le & (~eq | j_before_i) & not_self).any(axis=0)
        keep = ~dominated & upper[None]
        if mem_limit is not None:
            keep &= keys[2] + keys[3] <= mem_limit
        self.keys, self.keep = keys, keep

    def candidates(self, table: "CostTable", start: int, end: int, submesh) -> list[inter.StageCandidate]:
        out = []
        for k in np.flatnonzero(self.keep[:, start, end]):
            shape, r = self.options[k]
            _, plan = table.mesh_costs(submesh, shape)
            f, b, st, a = (float(v[k, start, end]) for v in self.keys)
            out.append(inter.StageCandidate((start, end), tuple(submesh), tuple(shape), r, f, b, st, a, payload=plan))
        return out


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


def microbatch_choices(batch: int, microbatches) -> list[int]:
    """The microbatch counts to try: every power of two dividing ``batch`` for ``"auto"``, else ``[microbatches]``
    (which must divide the batch).

    >>> microbatch_choices(24, "auto"), microbatch_choices(24, 3)
    ([1, 2, 4, 8], [3])
    """
    if microbatches == "auto":
        return [b for b in (1 << e for e in range(batch.bit_length())) if batch % b == 0]
    b = int(microbatches)
    if b < 1 or batch % b:
        raise ValueError(f"microbatches={microbatches} must be a positive divisor of the batch size {batch}")
    return [b]


def search_microbatches(table: CostTable, cluster, choices: Sequence[int], **kw) -> inter.InterResult:
    """The stage DP for each microbatch count, the fastest plan kept: what ``inter.stage_dp_auto`` does, with the
    same answer (ties to the smaller count) and the same ``diagnostics["by_microbatches"]``, in less time.

    Counts are tried from the largest down, and the search stops at the first count where nothing fits: a
    candidate's memory, ``static + min(s, B) * act / B``, never grows with ``B``, so a plan that fits with ``B``
    microbatches fits with any larger count, and a count where nothing fits rules out every smaller one. The
    candidates come from :meth:`CostTable.candidate_fn` (vectorised, unusable ones dropped). The best latency
    found so far is handed to each DP as an upper bound, so its t_max search skips what cannot beat it; a count
    that cannot is recorded as ``inf`` in ``by_microbatches`` (stage_dp_auto records its exact latency). When
    nothing fits at all, the largest count is run again with every candidate, for the error's smallest memory
    requirement.
    ``kw``: :func:`~autopar_lab.solve.inter.stage_dp`'s keywords (``mem_limit_bytes`` among them).
    """
    L = len(table.layer_names)
    mem = kw.get("mem_limit_bytes")
    by: dict[int, float | None] = {B: None for B in choices}
    best = None
    for B in sorted(set(choices), reverse=True):
        # The best latency so far bounds the DP's t_max search (nextafter: an equal latency with fewer
        # microbatches still wins, as in stage_dp_auto).
        bound = math.nextafter(best.latency_s, math.inf) if best is not None else math.inf
        try:
            r = inter.stage_dp(L, cluster.hosts, cluster.devices_per_host, table.candidate_fn(B, mem), B,
                               cut_bytes=[c / B for c in table.cut_bytes], upper_bound=bound, **kw)
        except inter.NoFeasiblePlanError:
            break
        if r is None:
            by[B] = math.inf  # plans fit, but none beats the best: not solved to the end
            continue
        by[B] = r.latency_s
        if best is None or r.latency_s < best.latency_s or (r.latency_s == best.latency_s and B < best.microbatches):
            best = r
    if best is None:
        B = max(choices)
        try:
            best = inter.stage_dp(L, cluster.hosts, cluster.devices_per_host,
                                  lambda a, b, sub: table.candidates(a, b, sub, B), B,
                                  cut_bytes=[c / B for c in table.cut_bytes], **kw)
        except inter.NoFeasiblePlanError as e:
            raise inter.NoFeasiblePlanError(f"for every microbatch count in {list(choices)}: {e}",
                                            e.min_mem_bytes) from e
        by[B] = best.latency_s  # pragma: no cover - the filtered candidates lose no usable one
    best.diagnostics["by_microbatches"] = by
    return best


def auto_plan(model_or_graph, cluster, *, microbatches="auto", stage_comm: str = "model", schedule: str = "1f1b",
              mem_limit: float | None = None, solver: str = "highs", max_stages: int | None = None,
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
    choices = microbatch_choices(table.batch_size, microbatches)
    result = search_microbatches(table, cluster, choices, **kw)
    solve_s["inter"] = time.perf_counter() - t0 - (table.solve_s - intra_before)
    return _finish(table, cluster, "auto", result.stages, result.microbatches, schedule, stage_comm, mem, solve_s)


def megatron_plan(model_or_graph, cluster, *, dp: int, tp: int, pp: int, microbatches: int = 1,
                  schedule: str = "1f1b", remat: bool = False, mem_limit: float | None = None, solver: str = "highs",
                  _table_cache: CostTable | None = None) -> Plan:
    """Megatron-LM's layout: ``pp`` stages of equal layer counts, each on ``dp x tp`` devices viewed as a (dp, tp)
    logical mesh with the tensor-parallel axis inside a host; the operators' shardings on that mesh come from the
    intra-op ILP (so this baseline is Megatron's layout with the best sharding our cost model finds for it).
    ``remat``: every stage recomputes its forward in the backward (Megatron-LM's ``--checkpoint-activations``)."""
    dp, tp, pp = (checks.whole(v, k) for k, v in (("dp", dp), ("tp", tp), ("pp", pp)))
    remat = checks.flag(remat, "remat")
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
    microbatch_choices(table.batch_size, microbatches)
    stages = [table.stage(bounds[k], bounds[k + 1] - 1, submesh, (dp, tp), microbatches, bool(remat))
              for k in range(pp)]
    name = f"megatron(dp={dp},tp={tp},pp={pp}{',remat' if remat else ''})"
    return _finish(table, cluster, name, stages, microbatches, schedule, "model", mem, solve_s)


def data_parallel_plan(model_or_graph, cluster, *, microbatches: int = 1, remat: bool = False,
                       mem_limit: float | None = None, solver: str = "highs",
                       _table_cache: CostTable | None = None) -> Plan:
    """One stage on the whole cluster viewed as a (N*M, 1) mesh, microbatches as gradient accumulation.

    The operators' shardings on that 1D mesh come from the intra-op ILP: for dense models that is data parallelism
    (the batch split over every device); for MoE the ILP also splits the experts (data + expert parallelism).
    ``remat``: the forward is recomputed in the backward (gradient checkpointing)."""
    microbatches, remat = checks.whole(microbatches, "microbatches"), checks.flag(remat, "remat")
    table = _table_cache
    solve_s = {}
    if table is None:
        table, solve_s = _table(model_or_graph, cluster, solver, None)
    n = cluster.num_devices
    submesh = (cluster.hosts, cluster.devices_per_host) if cluster.hosts > 1 else (1, cluster.devices_per_host)
    mem = float(cluster.device.memory_bytes if mem_limit is None else mem_limit)
    stage = table.stage(0, len(table.layer_names) - 1, submesh, (n, 1), microbatches, bool(remat))
    name = "data_parallel(remat)" if remat else "data_parallel"
    return _finish(table, cluster, name, [stage], microbatches, "1f1b", "model", mem, solve_s)


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


def compare(model_or_graph, cluster, *, microbatches="auto", solver: str = "highs", stage_comm: str = "model") -> dict:
    """Auto vs the best Megatron-style configuration vs data parallelism, all priced by one cost table.

    Both baselines are tried with and without rematerialisation (Megatron-LM's activation checkpointing) at every
    microbatch count; ``megatron_tried`` lists every Megatron configuration with its step time and peak memory."""
    table, solve_s = _table(model_or_graph, cluster, solver, None)
    auto = auto_plan(table.graph, cluster, microbatches=microbatches, solver=solver, stage_comm=stage_comm,
                     _table_cache=table)
    return {"auto": auto, **baselines(table, cluster, microbatches), "trace_s": solve_s.get("trace", 0.0)}


def baselines(table: CostTable, cluster, microbatches="auto") -> dict:
    """The best Megatron-style plan and the best data-parallel plan, priced by ``table``.

    Every (dp, tp, pp) of :func:`megatron_grid` x microbatch count x rematerialisation (Megatron-LM's activation
    checkpointing) is tried; data parallelism gets the same microbatch counts (gradient accumulation) and remat.
    Returns ``megatron_best`` (None when no configuration fits memory), ``megatron_config`` ((dp, tp, pp,
    microbatches, remat) or None), ``megatron_tried`` (one row per configuration: step time, peak memory, fits) and
    ``data_parallel`` (the fastest that fits, else the one with the smallest peak memory).
    """
    best, config, tried = None, None, []
    mbs = microbatch_choices(table.batch_size, microbatches)
    for dp, tp, pp in megatron_grid(cluster, len(table.layer_names)):
        for mb in mbs:
            for remat in (False, True):
                try:
                    p = megatron_plan(table.graph, cluster, dp=dp, tp=tp, pp=pp, microbatches=mb, remat=remat,
                                      _table_cache=table)
                except ValueError:
                    continue
                fits = p.cost.fits
                tried.append({"dp": dp, "tp": tp, "pp": pp, "microbatches": mb, "remat": remat,
                              "step_time_s": p.cost.step_time_s, "peak_mem_bytes": max(p.cost.peak_mem_bytes),
                              "fits": fits})
                if fits and (best is None or p.cost.step_time_s < best.cost.step_time_s):
                    best, config = p, (dp, tp, pp, mb, remat)
    datas = [data_parallel_plan(table.graph, cluster, microbatches=mb, remat=remat, _table_cache=table)
             for mb in mbs for remat in (False, True)]
    fitting = [p for p in datas if p.cost.fits]
    data = (min(fitting, key=lambda p: p.cost.step_time_s) if fitting
            else min(datas, key=lambda p: max(p.cost.peak_mem_bytes)))
    return {"megatron_best": best, "megatron_config": config, "megatron_tried": tried, "data_parallel": data}

