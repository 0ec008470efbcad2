"""Which tasks a plan's pipeline runs, in what order, and what crosses between stages: a pure function of the
plan and the step's graph (:func:`task_graph`), no devices and no compilation.

Every operator takes its stage from the layer the plan's graph gives it; an operator without a layer joins its first
consumer's stage, else its producers'. The forward runs an operator on its layer's stage, or later if an input comes
from a later stage (values flow forward); the backward on its layer's stage, or earlier if an input gradient comes
from an earlier stage. A stage the plan rematerialises recomputes in its backward the forward operators it reads
(selective: only the attention internals). ZB-H1 splits each backward into B (the input gradients, what they need,
what another stage reads) and W (``"wgrad"``: the rest). A step input (parameter, optimizer state) is owned by the
earliest stage whose forward or backward reads it; a later reader receives it from the owner's forward; one only
the update reads is held by every stage whose update reads it. What the update or the step's outputs read from the
per-microbatch part is accumulated where it is made; each stage's update runs the operators its own outputs need.

:class:`TaskGraph` answers the questions the runners ask (:meth:`~TaskGraph.sources`, :meth:`~TaskGraph.inputs`,
:meth:`~TaskGraph.exports`, :meth:`~TaskGraph.stash_readers`, :meth:`~TaskGraph.update_inputs` ...);
:class:`~autopar_lab.runtime.partition.StagedModel` runs it on devices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from ..graph.attention import alternate_matmuls, attention_internals, dots_recomputed
from ..graph.fusion import kernel_view
from ..graph.opgraph import BACKWARD, BATCH, CONST, FORWARD, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, UPDATE
from ..pricing.wgrad import input_grad_ops, upstream
from ..rematmode import is_dots, is_selective, is_selective_op, recomputes, remat_value

__all__ = ["Task", "StageUpdate", "TaskGraph", "task_graph", "virtual_plan", "is_inexact"]


def virtual_plan(plan):
    """``plan`` with one stage per virtual stage: an interleaved plan's chunks in order, chunk ``c`` on the submesh,
    logical mesh, remat and strategies of plan stage ``c % p``; any other plan as it is."""
    v, p = int(getattr(plan, "virtual_stages", 1)), len(plan.stages)
    if v <= 1:
        return plan
    stages = tuple(dataclasses.replace(plan.stages[c % p], layers=tuple(plan.stages[c % p].chunks[c // p]), chunks=())
                   for c in range(p * v))
    return dataclasses.replace(plan, stages=stages, virtual_stages=1)


def is_inexact(dtype) -> bool:
    """Whether values of ``dtype`` are floating (summed over microbatches) rather than integers or booleans."""
    return jnp.issubdtype(dtype, jnp.inexact)


@dataclass
class Task:
    """One forward, backward or weight-gradient task of a stage (per microbatch): the operators it runs (program
    order) and, by tensor id, what it reads (``state_in``: step inputs its stage holds; ``recv``: values from other
    stages' tasks; ``stash_in``: values its stage's earlier tasks of the same microbatch kept; ``batch_in``: batch
    leaves) and makes for others (``exports``: other stages' tasks; ``stash_out``: its stage's later tasks;
    ``acc_out``: summed over the microbatches for the update). ``sources``: the ``(stage, kind)`` it receives
    from."""

    ops: list
    state_in: list = field(default_factory=list)
    recv: list = field(default_factory=list)
    stash_in: list = field(default_factory=list)
    batch_in: list = field(default_factory=list)
    exports: set = field(default_factory=set)
    stash_out: set = field(default_factory=set)
    acc_out: set = field(default_factory=set)
    sources: set = field(default_factory=set)


@dataclass(frozen=True)
class StageUpdate:
    """One stage's part of the update (once per step): its operators, the step inputs it holds (``state``), the
    accumulated values it made itself (``acc``), what it receives from other stages (``recv``), the step outputs it
    makes (``targets``) and the tasks it receives from (``sources``)."""

    ops: list
    state: list
    acc: list
    recv: list
    targets: list
    sources: list


class TaskGraph:
    """The tasks of ``plan`` on the step graph ``graph`` (see the module docstring); build it with
    :func:`task_graph`.

    ``num_stages`` counts the stages here (an interleaved plan's chunks), ``device_stage[k]`` the plan stage (devices)
    stage ``k`` runs on, ``kinds`` the task kinds per stage and microbatch in the order one microbatch runs them.
    ``tasks[(k, kind)]``: each :class:`Task`; ``updates[k]``: each stage's :class:`StageUpdate`; ``names``: tensor id ->
    the name a value crossing stages goes by (``"args[0]['wte']"`` for a step input, ``"%123"`` otherwise).
    """

    def __init__(self, plan, graph):
        P = len(plan.stages)
        self.schedule = plan.schedule
        self.plan = plan = virtual_plan(plan)  # an interleaved plan's chunks are the stages here
        self.num_stages = S = len(plan.stages)
        #: the plan stage (devices) each stage here runs on: itself, or for a chunk its plan stage
        self.device_stage = tuple(c % P for c in range(S))
        #: the task kinds per stage and microbatch, in the order one microbatch runs them
        self.kinds = ("fwd", "bwd", "wgrad") if self.schedule == "zb-h1" else ("fwd", "bwd")
        self.graph = graph
        self._consts = frozenset(t for t, info in graph.tensors.items() if info.kind == CONST)
        self.op_kind = self._op_kinds(plan.graph)
        self.op_stage = self._op_stages(plan, S)
        self._place_inputs_and_tasks(S)
        self._plan_update(S)

    def _op_kinds(self, full) -> list[str]:
        kinds = []
        for node in full:
            if node.primitive == INPUT_PRIMITIVE:
                kinds.append("in")
            elif node.primitive == OUTPUT_PRIMITIVE:
                kinds.append("out")
            else:
                kinds.append({FORWARD: "fwd", BACKWARD: "bwd", UPDATE: "upd"}[node.role])
        return kinds

    def _op_stages(self, plan, S) -> list:
        """Each forward/backward operator's stage (None for the rest): its layer's, moved so values flow forward in
        the forward and backward in the backward."""
        g, kind = self.graph, self.op_kind
        layer_stage = {}
        for k, st in enumerate(plan.stages):
            for i in range(st.layers[0], st.layers[1] + 1):
                layer_stage[plan.layer_names[i]] = k
        n = len(g)
        producer = {tid: t.producer for tid, t in g.tensors.items()}
        ts = [layer_stage.get(node.layer) if kind[node.id] not in ("in", "out") else None for node in plan.graph]
        consumers = g.consumers
        for i in range(n - 1, -1, -1):  # an operator without a layer joins its first consumer's stage...
            if ts[i] is None and kind[i] not in ("in", "out"):
                cs = [ts[c] for t in g.op(i).outputs for c in consumers.get(t, ()) if ts[c] is not None]
                ts[i] = min(cs) if cs else None
        for i in range(n):  # ... else its producers'
            if ts[i] is None and kind[i] not in ("in", "out"):
                ps = [ts[producer[t]] for t in g.op(i).inputs if producer.get(t) is not None
                      and ts[producer[t]] is not None]
                ts[i] = max(ps) if ps else 0
        stage: list = [None] * n
        for i in range(n):
            if kind[i] not in ("fwd", "bwd"):
                continue
            preds = [producer[t] for t in g.op(i).inputs if producer.get(t) is not None]
            if kind[i] == "fwd":
                bad = [p for p in preds if kind[p] in ("bwd", "upd")]
                stage[i] = max([ts[i]] + [stage[p] for p in preds if kind[p] == "fwd"])
            else:
                bad = [p for p in preds if kind[p] == "upd"]
                stage[i] = min([ts[i]] + [stage[p] for p in preds if kind[p] == "bwd"])
            if bad:
                raise ValueError(f"operator {g.op(i).describe()} ({kind[i]}ward) reads {g.op(bad[0]).describe()}; a "
                                 "pipeline runs the forward, then the backward, then the update, so this step cannot "
                                 "be cut into stages.")
        return stage

    def _place_inputs_and_tasks(self, S):
        g, kind, stage = self.graph, self.op_kind, self.op_stage
        producer = {tid: t.producer for tid, t in g.tensors.items()}
        consumers = g.consumers
        self.batch_tids = [t for t in g.inputs if g.tensor(t).kind == BATCH]
        self.state_tids = [t for t in g.inputs if g.tensor(t).kind != BATCH]
        batch_set, state_set = set(self.batch_tids), set(self.state_tids)
        self.names = {t: g.tensor(t).path for t in g.inputs}
        self.owner: dict[int, int] = {}
        for t in self.state_tids:
            users = [stage[c] for c in consumers.get(t, ()) if kind[c] in ("fwd", "bwd")]
            if users:
                self.owner[t] = min(users)
        tasks = {(k, kd): Task([i for i in range(len(g)) if kind[i] == kd and stage[i] == k])
                 for k in range(S) for kd in self.kinds}
        self.remat = [remat_value(st.remat) for st in self.plan.stages]
        # selective: only the attention internals are recomputed (the plan's graph numbers operators as this one);
        # dots: every forward operator of the blocks but the matmuls; selective-op: those and every other matmul
        internals = attention_internals(self.plan.graph) if any(map(is_selective, self.remat)) else frozenset()
        partial = [is_dots(r) or is_selective_op(r) for r in self.remat]
        elementwise = dots_recomputed(self.plan.graph) if any(partial) else frozenset()
        alternate = alternate_matmuls(self.plan.graph) if any(map(is_selective_op, self.remat)) else frozenset()
        for k in range(S):
            if recomputes(self.remat[k]):  # the backward recomputes what it reads of its stage's forward
                fwd_ops = set(tasks[(k, "fwd")].ops)
                if is_selective(self.remat[k]):
                    fwd_ops &= internals  # the rest it reads from the forward's stash, as without remat
                elif is_dots(self.remat[k]):
                    fwd_ops &= elementwise
                elif is_selective_op(self.remat[k]):
                    fwd_ops &= elementwise | alternate
                need, todo = set(), [t for i in tasks[(k, "bwd")].ops for t in g.op(i).inputs]
                while todo:
                    p = producer.get(todo.pop())
                    if p is not None and p in fwd_ops and p not in need:
                        need.add(p)
                        todo.extend(g.op(p).inputs)
                tasks[(k, "bwd")].ops = sorted(need | set(tasks[(k, "bwd")].ops))
        self._recompute_inline(tasks, S, producer, state_set | batch_set)
        if "wgrad" in self.kinds:
            self._split_backward(tasks, S)
        home = {i: key for key, task in tasks.items() for i in task.ops if kind[i] == key[1]}
        for key, task in tasks.items():  # a recomputed forward operator also lives in its stage's backward
            for i in task.ops:
                home.setdefault(i, key)
        order = {kd: n for n, kd in enumerate(self.kinds)}
        consts = self._consts
        for (k, kd), task in tasks.items():
            inside = {t for i in task.ops for t in g.op(i).outputs}
            reads = list(dict.fromkeys(t for i in task.ops for t in g.op(i).inputs))
            task.state_in, task.recv, task.stash_in, task.batch_in = [], [], [], []
            for t in reads:
                if t in inside or (t in consts and producer.get(t) is None):
                    continue
                if t in batch_set:
                    task.batch_in.append(t)
                elif t in state_set:
                    o = self.owner[t]
                    if o == k:
                        task.state_in.append(t)
                    else:  # a step input another stage owns: its forward passes it on
                        task.recv.append(t)
                        task.sources.add((o, "fwd"))
                        tasks[(o, "fwd")].exports.add(t)
                else:
                    p = producer[t]
                    # the latest earlier task of this stage that made it (a W task reads what its B recomputed)
                    mine = [e for e in self.kinds[:order[kd]] if p in tasks[(k, e)].ops]
                    src = (k, mine[-1]) if mine else home[p]
                    if src[0] == k and order[src[1]] < order[kd]:
                        task.stash_in.append(t)
                        tasks[src].stash_out.add(t)
                    else:
                        task.recv.append(t)
                        task.sources.add(src)
                        tasks[src].exports.add(t)
        for t in self.state_tids:  # an owner's forward that passes a step input on reads it from its state
            o = self.owner.get(t)
            if o is not None and t in tasks[(o, "fwd")].exports and t not in tasks[(o, "fwd")].state_in:
                tasks[(o, "fwd")].state_in.append(t)
        # What the update or the step's outputs read from the per-microbatch part is accumulated where it is made.
        for i in range(len(g)):
            if kind[i] not in ("upd", "out"):
                continue
            for t in g.op(i).inputs:
                p = producer.get(t)
                if t in batch_set:
                    raise ValueError(f"the step's update ({g.op(i).describe()}) reads the batch directly; a pipeline "
                                     "splits the batch into microbatches, so only the forward and backward may read "
                                     "it.")
                if p is not None and kind[p] in ("fwd", "bwd"):
                    tasks[home[p]].acc_out.add(t)
        for task in tasks.values():
            for t in task.exports | task.acc_out | task.stash_out:
                self.names.setdefault(t, f"%{t}")
            for t in task.recv:
                self.names.setdefault(t, f"%{t}")
        self.tasks = tasks
        self.var_of = {name: t for t, name in self.names.items()}

    def _recompute_inline(self, tasks, S, producer, step_inputs):
        """Each stage's backward recomputes the cheap forward operators whose values it reads (elementwise, layout
        and broadcast work, the operators :func:`~autopar_lab.graph.fusion.kernel_view` runs inline in their
        consumers' kernels or folds in for free) from what their kernels read, instead of reading them from the
        forward's stash: a compiled step keeps only what a kernel writes (:attr:`KernelView.saved`), and so does the
        plan's memory. Stashing every value ``jax.grad``'s backward reads kept, for one GELU, six [batch, seq, 4H]
        tensors where the fused step keeps one; a stage held 1.6-1.9x its predicted peak (bench_execute, 2026-12-06).
        Only operators whose inputs the stage has without another stage's help are recomputed (a value received
        from an earlier stage would otherwise stay alive on the sender until the backward)."""
        g = self.graph
        view = kernel_view(self.plan.graph)  # no flash kernel: the runtime runs attention as the step writes it
        cheap = {i for i, r in view.roles.items() if r.kind in ("inline", "free")}
        for k in range(S):
            if recomputes(self.remat[k]) and not is_selective(self.remat[k]):
                continue  # full recomputation: the backward recomputes its whole forward already
            fwd_ops = set(tasks[(k, "fwd")].ops)

            def own(t, fwd_ops=fwd_ops, k=k):
                p = producer.get(t)
                if p is None or t in self._consts or p in fwd_ops:
                    return True
                return t in step_inputs and (g.tensor(t).kind == BATCH or self.owner.get(t) == k)

            bwd = tasks[(k, "bwd")]
            need, todo = set(), [t for i in bwd.ops for t in g.op(i).inputs]
            while todo:
                p = producer.get(todo.pop())
                if p is None or p in need or p not in fwd_ops or p not in cheap or \
                        not all(own(t) for t in g.op(p).inputs):
                    continue
                need.add(p)
                todo.extend(g.op(p).inputs)
            bwd.ops = sorted(need | set(bwd.ops))

    def _split_backward(self, tasks, S):
        """ZB-H1: each stage's backward task keeps B (the input-gradient operators, what they need, what another
        stage's task reads, and a rematerialised forward) and gives the rest, W, to its "wgrad" task."""
        g, kind, stage = self.graph, self.op_kind, self.op_stage
        consumers = g.consumers
        b_ops = input_grad_ops(self.plan.graph)  # the plan's graph: the same operators, with the plan's layers
        for k in range(S):
            ops = tasks[(k, "bwd")].ops
            inside = set(ops)
            seeds = [i for i in ops if i in b_ops or kind[i] != "bwd" or any(
                c not in inside and kind[c] in ("fwd", "bwd") and stage[c] != k
                for t in g.op(i).outputs for c in consumers.get(t, ()))]
            keep = upstream(g, seeds, inside.__contains__)
            tasks[(k, "bwd")].ops = [i for i in ops if i in keep]
            tasks[(k, "wgrad")].ops = [i for i in ops if i not in keep]

    def _plan_update(self, S):
        """Which update operators each stage runs (those its own outputs need), which step inputs it holds."""
        g, kind, stage = self.graph, self.op_kind, self.op_stage
        producer = {tid: t.producer for tid, t in g.tensors.items()}
        outs = [i for i in range(len(g)) if kind[i] == "out"]
        self.outputs = outs
        u_only = [t for t in self.state_tids if t not in self.owner]
        holders: dict[int, set] = {t: {self.owner[t]} for t in self.owner}
        for t in u_only:
            holders[t] = set()
        alias_out = {g.op(o).params.get("alias_of"): o for o in outs if g.op(o).params.get("alias_of") is not None}
        targets: list[set] = [set() for _ in range(S)]
        for o in outs:
            x, alias = g.op(o).inputs[0], g.op(o).params.get("alias_of")
            if alias is not None and alias in self.owner:
                targets[self.owner[alias]].add(o)
            elif alias is not None:
                continue  # an update-only input: updated by every stage that holds it (below)
            else:
                p = producer.get(x)
                if p is not None and kind[p] in ("fwd", "bwd"):
                    targets[stage[p]].add(o)
                elif x in self.owner:
                    targets[self.owner[x]].add(o)
                else:
                    targets[S - 1].add(o)
        while True:  # update-only inputs are held by every stage whose update reads them, and updated there
            slices = [self._update_slice(targets[k], producer) for k in range(S)]
            changed = False
            for k in range(S):
                for i in slices[k]:
                    for t in g.op(i).inputs:
                        if t in holders and t not in self.owner and k not in holders[t]:
                            holders[t].add(k)
                            changed = True
                for o in targets[k]:
                    t = g.op(o).inputs[0]
                    if t in holders and t not in self.owner and k not in holders[t]:
                        holders[t].add(k)
                        changed = True
            for t in u_only:
                if not holders[t]:
                    holders[t].add(0)
                    changed = True
                o = alias_out.get(t)
                if o is not None:
                    for k in holders[t]:
                        if o not in targets[k]:
                            targets[k].add(o)
                            changed = True
            if not changed:
                break
        self.holders = holders
        self.held = [[t for t in self.state_tids if k in holders[t]] for k in range(S)]
        acc_stage = {t: k for (k, _), task in self.tasks.items() for t in task.acc_out}
        self.updates: list[StageUpdate] = []
        self.update_crosses_stages: list[str] = []
        for k in range(S):
            ops = slices[k]
            inside = {t for i in ops for t in g.op(i).outputs}
            reads = list(dict.fromkeys([t for i in ops for t in g.op(i).inputs]
                                       + [g.op(o).inputs[0] for o in sorted(targets[k])]))
            own_state, own_acc, recv = [], [], []
            for t in reads:
                if t in inside or (t in self._consts and producer.get(t) is None):
                    continue
                if t in holders:
                    (own_state if k in holders[t] else recv).append(t)
                elif t in acc_stage:
                    (own_acc if acc_stage[t] == k else recv).append(t)
                else:
                    raise ValueError(f"the update of stage {k} reads {self.names.get(t, t)}, which no stage makes.")
            sources = set()
            for t in recv:  # what another stage has: its task exports it (every microbatch) for this update
                self.names.setdefault(t, f"%{t}")
                if t in holders:
                    src = (min(holders[t]), "fwd")
                    if t not in self.tasks[src].state_in:
                        self.tasks[src].state_in.append(t)
                else:
                    src = next(key for key, task in self.tasks.items() if t in task.acc_out)
                self.tasks[src].exports.add(t)
                sources.add(src)
                self.update_crosses_stages.append(f"stage {k}'s update reads {self.names[t]} from stage {src[0]}")
            self.updates.append(StageUpdate(ops, own_state, own_acc, recv, sorted(targets[k]), sorted(sources)))
        self.var_of = {name: t for t, name in self.names.items()}
        # The loss: the step's first scalar floating output that is not a new value of an input.
        self.loss_output = next((k for k, o in enumerate(outs) if g.op(o).params.get("alias_of") is None
                                 and g.tensor(g.op(o).inputs[0]).shape == ()
                                 and is_inexact(g.tensor(g.op(o).inputs[0]).dtype)), None)

    def _update_slice(self, targets, producer) -> list[int]:
        g, kind = self.graph, self.op_kind
        need, todo = set(), [g.op(o).inputs[0] for o in targets]
        while todo:
            p = producer.get(todo.pop())
            if p is not None and kind[p] == "upd" and p not in need:
                need.add(p)
                todo.extend(g.op(p).inputs)
        return sorted(need)

    # --- the contract -----------------------------------------------------------------------------------------
    def check_stage(self, k: int) -> int:
        if not isinstance(k, (int, np.integer)) or not 0 <= k < self.num_stages:
            raise ValueError(f"stage index {k!r} is out of range; this plan has stages 0..{self.num_stages - 1}.")
        return int(k)

    def task(self, k, kind) -> Task:
        if kind not in self.kinds:
            raise ValueError(f"a task is one of {', '.join(map(repr, self.kinds))} for this plan, got {kind!r}.")
        return self.tasks[(self.check_stage(k), kind)]

    def stash_readers(self, k: int, kind: str) -> tuple[str, ...]:
        """The kinds of stage k's later tasks (same microbatch) that read the stash task ``(k, kind)`` keeps: it is
        held until the last of them has run."""
        mine = self.task(k, kind).stash_out
        return tuple(kd for kd in self.kinds if set(self.tasks[(k, kd)].stash_in) & mine)

    def sources(self, k: int, kind: str) -> list[tuple[int, str]]:
        """The tasks of the same microbatch that task ``(k, kind)`` receives values from (other stages only)."""
        return sorted(self.task(k, kind).sources)

    def inputs(self, k: int, kind: str) -> tuple[str, ...]:
        """Names of the values task ``(k, kind)`` receives from other stages' tasks."""
        return tuple(self.names[t] for t in self.task(k, kind).recv)

    def exports(self, k: int, kind: str) -> tuple[str, ...]:
        """Names of the values task ``(k, kind)`` produces for other stages' tasks."""
        return tuple(self.names[t] for t in sorted(self.task(k, kind).exports))

    def producer(self, name: str) -> tuple[int, str]:
        """The task ``(stage, kind)`` whose exports hold value ``name``."""
        t = self.var_of.get(name)
        for key, task in self.tasks.items():
            if t in task.exports:
                return key
        raise KeyError(f"no task exports a value named {name!r}.")

    def task_ops(self, k: int, kind: str) -> tuple[int, ...]:
        """The operator ids (of the plan's graph) task ``(k, kind)`` runs, in program order."""
        return tuple(self.task(k, kind).ops)

    def update_ops(self, k: int) -> tuple[int, ...]:
        return tuple(self.updates[self.check_stage(k)].ops)

    def stage_state_paths(self, k: int) -> tuple[str, ...]:
        """The step inputs (pytree paths, ``"args[0]['wte']"``) stage k holds."""
        return tuple(self.names[t] for t in self.held[self.check_stage(k)])

    def update_sources(self, k: int) -> list[tuple[int, str]]:
        """The tasks ``(stage, kind)`` whose exports of *every* microbatch stage k's update reads (what
        :meth:`update_inputs` names); a Ray stage actor receives them in ``finish_step``."""
        return list(self.updates[self.check_stage(k)].sources)

    def is_accumulated(self, name: str) -> bool:
        """Whether value ``name`` is summed over the microbatches before the update reads it (else: a step input,
        the same in every microbatch)."""
        t = self.var_of[name]
        return any(t in task.acc_out for task in self.tasks.values())

    def update_inputs(self, k: int) -> list[tuple[str, int]]:
        """``(name, stage)`` of what stage k's update reads from another stage (an accumulated value or a step
        input it does not hold; a step clipping by global norm reads every stage's gradients)."""
        info = self.updates[self.check_stage(k)]
        acc_stage = {t: s for (s, _), task in self.tasks.items() for t in task.acc_out}
        return [(self.names[t], min(self.holders[t]) if t in self.holders else acc_stage[t]) for t in info.recv]

    def describe(self) -> list[dict]:
        """Per stage: layers, operators per part, step inputs held, remat, its plan stage, and what crosses each cut
        (the values each task receives and sends, by name)."""
        out = []
        for k, st in enumerate(self.plan.stages):
            out.append({"stage": k, "layers": [self.plan.layer_names[st.layers[0]],
                                               self.plan.layer_names[st.layers[1]]],
                        "num_ops": {kd: len(self.tasks[(k, kd)].ops) for kd in self.kinds}
                        | {"update": len(self.updates[k].ops)},
                        "holds": len(self.held[k]), "remat": self.remat[k], "device_stage": self.device_stage[k],
                        "receives": {kd: list(self.inputs(k, kd)) for kd in self.kinds},
                        "sends": {kd: list(self.exports(k, kd)) for kd in self.kinds}})
        return out


def task_graph(plan, graph=None) -> TaskGraph:
    """The tasks of ``plan``'s pipeline (see the module docstring): on ``graph`` (default: the plan's own; the
    runtime passes the step captured on one microbatch, whose operators and tensors are the same), without devices.

    >>> import autopar_lab as al                                                    # doctest: +SKIP
    >>> model = al.models.get("gpt-tiny", batch_size=8, num_layers=2)               # doctest: +SKIP
    >>> plan = al.megatron_plan(model, al.Cluster.preset("cpu"), dp=4, tp=1, pp=2, microbatches=2)  # doctest: +SKIP
    >>> tg = task_graph(plan)                                                       # doctest: +SKIP
    >>> tg.sources(1, "fwd"), tg.sources(0, "bwd")                                  # doctest: +SKIP
    ([(0, 'fwd')], [(1, 'bwd')])
    """
    return TaskGraph(plan, plan.graph if graph is None else graph)
