"""What each matmul of a transformer does, found in the traced graph: the part a framework's layout gives it.

A framework's tensor parallelism is a rule per module: Megatron-LM splits the first matmul of a pair by its output
columns and the second by its input rows (one all-reduce per pair), attention by heads, the embedding and the output
head by vocabulary, experts over the expert-parallel group (Shoeybi et al. 2019, section 3; Narayanan et al. 2021).
torchtitan's ``ColwiseParallel`` / ``RowwiseParallel`` plan and MaxText's ``mlp`` / ``heads`` / ``vocab`` axes are
the same rule. This module finds those modules in any traced step, from :func:`~autopar_lab.graph.modules.module_labels`
(attention's scores and context, the embedding and the head) and the dataflow between a layer's matmuls, not from
parameter names: the zoo's ``qkv`` / ``fc1``, a Llama's ``attn/q_proj`` / ``mlp/gate``, DeepSeek's MLA projections,
a user's own step all get the same roles.

Roles (:data:`KINDS`), for each forward matmul that reads one parameter (a *weight matmul*) within a layer:

* ``column``: its output reaches attention (a Q, K or V projection, MLA's up-projections), or feeds a ``row``
  matmul (an MLP's first matmuls: ``fc1``, SwiGLU's gate and up);
* ``row``: its input comes from attention's context or from a ``column`` matmul (``proj``, ``o_proj``, ``fc2``,
  ``down``);
* ``duplicated``: a weight matmul that pairs with neither: a low-rank down-projection feeding a column matmul
  (MLA's ``q_down``, ``kv_down``), a router; Megatron-LM keeps these whole on every tensor-parallel rank;
* ``head``: the output projection over the vocabulary (``lm head``), split by vocabulary;
* ``expert``: a matmul batched over a parameter's expert axis (:func:`~autopar_lab.sharding.experts.expert_matmuls`);
* ``dispatch``: a mixture of experts' token dispatch or combine written as a matmul (GShard's einsums, labelled
  ``moe/dispatch`` and ``moe/combine``), which expert parallelism keeps on the tokens' split: the exchange with the
  experts is then the all-to-all before and after them;
* ``attention``: attention's scores (QK^T) and context (probs x V), split by heads (their second batch dimension);
* ``embedding``: the gather reading the token embedding, split by vocabulary.

The walks between matmuls stay inside one layer and stop at the next matmul, so a residual stream (which connects
every matmul of a layer to every later one) does not pair them: the ``row`` test looks upstream, where only the
matmuls of the same block lie. The result is memoised on the graph (graphs are immutable).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Mapping

from ..graph.modules import module_labels
from ..graph.opcost import CONTRACTIONS
from ..graph.opgraph import BATCH, FORWARD, INPUT_PRIMITIVE, PARAM, OpGraph, OpNode
from ..pricing.zero import opt_states_of  # noqa: F401 - the layouts' name for it
from ..sharding.experts import expert_matmuls

__all__ = ["KINDS", "MatmulRole", "ParamRole", "Roles", "find_roles", "opt_states_of", "weight_source"]

#: The roles, see the module docstring.
KINDS = ("column", "row", "duplicated", "head", "expert", "dispatch", "attention", "embedding")

# Operators a weight passes through on its way to its matmul, with how each maps dimensions (see _param_dims).
_PASS = frozenset(["convert_element_type", "copy", "copy_p", "transpose", "reshape"])
_WALK = 256  # operators a walk between matmuls visits at most (a block's norms, activations and reshapes)


@dataclass(frozen=True)
class MatmulRole:
    """The role of one forward operator of the graph (a matmul, or the embedding's gather).

    ``kind``: one of :data:`KINDS`; ``weight``: the operand index of the parameter it reads (None for attention);
    ``param``: that parameter's input operator; ``dims``: for each dimension of the weight *operand*, the
    parameter's dimension it is (None where a reshape mixes them); ``split``: the operand dimension the layout
    splits (column and head: the output features; row: the contracted one; embedding: the vocabulary; expert: the
    experts; attention: the heads, its second batch dimension); ``label``: the operator's module label; ``feeds``:
    for a projection into attention, the attention matmuls and operands its output reaches (Q, K or V)."""

    op: int
    kind: str
    weight: int | None
    param: int | None
    dims: tuple[int | None, ...]
    split: int | None
    label: str
    feeds: tuple[tuple[int, int], ...] = ()  # (attention matmul, its operand index) a projection's output reaches

    @property
    def param_dim(self) -> int | None:
        """The parameter's dimension the layout splits (None when a reshape hides it)."""
        if self.split is None or self.param is None or self.split >= len(self.dims):
            return None
        return self.dims[self.split]


@dataclass(frozen=True)
class ParamRole:
    """How a parameter is split by the layout's tensor parallelism: ``dim`` (None: whole on every rank) and the
    role that decided it (``kind``, ``label``). A bias added to a column matmul's output takes its split."""

    op: int
    dim: int | None
    kind: str
    label: str


@dataclass(frozen=True)
class Roles:
    """Every role found in a graph: ``matmuls`` (forward operator -> :class:`MatmulRole`), ``params`` (parameter
    input operator -> :class:`ParamRole`, only the parameters a role splits or keeps whole on purpose) and
    ``blocks``: the layers holding attention or a column/row pair (the transformer blocks)."""

    matmuls: Mapping[int, MatmulRole]
    params: Mapping[int, ParamRole]
    blocks: tuple[str, ...]

    def of_kind(self, kind: str) -> list[MatmulRole]:
        return [r for r in self.matmuls.values() if r.kind == kind]

    def describe(self) -> list[str]:
        """One line per role, its modules: ``column: attn/q_proj, attn/k_proj, ...``."""
        out = []
        for kind in KINDS:
            names = list(dict.fromkeys(r.label for r in self.matmuls.values() if r.kind == kind))
            if names:
                out.append(f"{kind}: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}")
        return out


def weight_source(graph: OpGraph, t: int) -> tuple[int | None, tuple[int | None, ...]]:
    """(the parameter input operator tensor ``t`` is a cast / transposed / reshaped view of, for each dimension of
    ``t`` the parameter's dimension), or (None, ()) when ``t`` is not a parameter's view."""
    chain: list[OpNode] = []
    x = t
    for _ in range(6):
        info = graph.tensor(x)
        p = info.producer
        if p is None:
            return None, ()
        node = graph.op(p)
        if node.primitive == INPUT_PRIMITIVE:
            if info.kind != PARAM or not info.shape:
                return None, ()
            dims: list[int | None] = list(range(len(info.shape)))
            for n in reversed(chain):  # from the parameter down to t
                dims = _through(n, dims)
            return p, tuple(dims)
        if node.primitive not in _PASS or not node.inputs:
            return None, ()
        chain.append(node)
        x = node.inputs[0]
    return None, ()


def _through(node: OpNode, dims: list[int | None]) -> list[int | None]:
    """The parameter dimension of each output dimension of a pass-through ``node`` given its input's."""
    if node.primitive == "transpose":
        perm = node.params.get("permutation", tuple(range(len(dims))))
        return [dims[p] for p in perm]
    if node.primitive == "reshape":
        src, dst = tuple(node.in_shapes[0]), tuple(node.out_shapes[0])
        if src == dst:
            return dims
        # a dimension survives a reshape when the sizes before it and its own size are the same on both sides
        out: list[int | None] = []
        for k, size in enumerate(dst):
            before = _prod(dst[:k])
            hit = next((j for j in range(len(src)) if src[j] == size and _prod(src[:j]) == before), None)
            out.append(dims[hit] if hit is not None else None)
        return out
    return dims


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


class _Finder:
    def __init__(self, graph: OpGraph):
        self.g = graph
        self.labels = module_labels(graph)
        self.experts = expert_matmuls(graph)
        self.weight: dict[int, tuple[int, int, tuple]] = {}  # weight matmul -> (operand, param op, dims)
        self.attention: set[int] = set()
        self.context: set[int] = set()
        self.dispatch: set[int] = set()
        self.key: set[int] = set()  # every forward matmul (the walks stop at them)
        for node in graph:
            if node.role != FORWARD or node.primitive not in CONTRACTIONS:
                continue
            self.key.add(node.id)
            if node.id in self.experts or node.primitive != "dot_general":
                continue  # (a convolution is no transformer's; it stays the ILP's)
            found = [(j, p, dims) for j, t in enumerate(node.inputs) for p, dims in (weight_source(graph, t),)
                     if p is not None]
            module = self.labels[node.id].module
            if len(found) == 1:
                self.weight[node.id] = found[0]
            elif not found and node.primitive == "dot_general" and module.rsplit("/", 1)[-1] in ("scores",
                                                                                               "context"):
                self.attention.add(node.id)
                if module.endswith("context"):
                    self.context.add(node.id)
            elif not found and node.primitive == "dot_general" and module.rsplit("/", 1)[-1] in ("dispatch",
                                                                                                 "combine"):
                self.dispatch.add(node.id)

    def feeds(self, op: int) -> tuple[tuple[int, int], ...]:
        """(attention matmul, operand index) of each attention operand ``op``'s output reaches within its layer
        without passing another matmul."""
        g, node = self.g, self.g.op(op)
        out: set[tuple[int, int]] = set()
        seen, todo = {op}, deque(node.outputs)
        while todo and len(seen) < _WALK:
            t = todo.popleft()
            for c in g.consumers.get(t, ()):
                cn = g.op(c)
                if cn.role != FORWARD or cn.layer != node.layer:
                    continue
                if c in self.attention:
                    out.update((c, j) for j, x in enumerate(cn.inputs) if x == t)
                if c in seen or c in self.key:
                    continue
                seen.add(c)
                todo.extend(cn.outputs)
        return tuple(sorted(out))

    def walk(self, op: int, down: bool) -> set[int]:
        """The forward matmuls of ``op``'s layer reached from its output (``down``) or its activation input,
        stopping at each."""
        g, node = self.g, self.g.op(op)
        found: set[int] = set()
        seen = {op}
        if down:
            todo: deque[int | None] = deque(c for t in node.outputs for c in g.consumers.get(t, ()))
        else:
            w = self.weight[op][0] if op in self.weight else None
            todo = deque(g.tensor(t).producer for j, t in enumerate(node.inputs) if j != w)
        while todo and len(seen) < _WALK:
            v = todo.popleft()
            if v is None or v in seen:
                continue
            seen.add(v)
            vn = g.op(v)
            if vn.role != FORWARD or vn.layer != node.layer or vn.primitive == INPUT_PRIMITIVE:
                continue
            if v in self.key:
                found.add(v)
                continue
            if down:
                todo.extend(c for t in vn.outputs for c in g.consumers.get(t, ()))
            else:
                todo.extend(g.tensor(t).producer for t in vn.inputs)
        return found

    def run(self) -> Roles:
        g, labels = self.g, self.labels
        kinds: dict[int, str] = {}
        down = {m: self.walk(m, True) for m in self.weight}
        embeddings = self.embeddings()
        vocab = {int(g.tensor(g.op(p).outputs[0]).shape[0]) for p, _d in embeddings.values()}
        attn_layers = {g.op(m).layer for m in self.attention}
        for m in self.weight:  # the head, and the projections into attention
            if self.is_head(m, vocab, attn_layers):
                kinds[m] = "head"
            elif down[m] & self.attention:
                kinds[m] = "duplicated" if any(x in self.weight for x in down[m]) else "column"
        for m in self.weight:  # a projection feeding another one into attention (MLA's down-projections)
            if m not in kinds and any(kinds.get(x) == "column" for x in down[m]):
                kinds[m] = "duplicated"
        tentative: set[int] = set()
        for m in sorted(self.weight):  # in graph order: a pair's first matmul before its second
            if m in kinds:
                continue
            up = self.walk(m, False)
            if up & (self.context | tentative):
                kinds[m] = "row"
            else:
                tentative.add(m)
        for m in tentative:  # a first matmul without its second is kept whole (a router, a lone projection)
            kinds[m] = "column" if any(kinds.get(x) == "row" for x in down[m]) else "duplicated"
        roles: dict[int, MatmulRole] = {}
        for m, (j, p, dims) in self.weight.items():
            node = g.op(m)
            (lc, rc), (lb, rb) = node.params["dimension_numbers"]
            cont, batch = (lc, rc)[j], (lb, rb)[j]
            free = [d for d in range(len(node.in_shapes[j])) if d not in cont and d not in batch]
            kind = kinds[m]
            split = (cont[0] if cont else None) if kind == "row" else (free[-1] if free else None)
            roles[m] = MatmulRole(m, kind, j, p, dims, split if kind != "duplicated" else None, labels[m].label,
                                  self.feeds(m) if kind == "column" else ())
        for m, (j, d, p) in self.experts.items():
            _, dims = weight_source(g, g.op(m).inputs[j])
            roles[m] = MatmulRole(m, "expert", j, p, dims, d, labels[m].label)
        for m in self.attention:
            _, (lb, _rb) = g.op(m).params["dimension_numbers"]
            roles[m] = MatmulRole(m, "attention", None, None, (), lb[1] if len(lb) > 1 else None, labels[m].label)
        for m in self.dispatch:
            _, (lb, _rb) = g.op(m).params["dimension_numbers"]
            roles[m] = MatmulRole(m, "dispatch", None, None, (), lb[0] if lb else None, labels[m].label)
        for op, (p, dims) in embeddings.items():
            roles[op] = MatmulRole(op, "embedding", 0, p, dims, 0, labels[op].label)
        params = self.param_roles(roles)
        blocks = tuple(dict.fromkeys(str(g.op(r.op).layer) for r in roles.values()
                                     if r.kind in ("attention", "row") and g.op(r.op).layer is not None))
        return Roles(dict(sorted(roles.items())), params, blocks)

    def embeddings(self) -> dict[int, tuple[int, tuple]]:
        """The token embedding's lookups: forward gathers of a rank-2 parameter by indices that come from the step's
        batch (the tokens; a position embedding is read by positions the step makes itself) -> (parameter, dims)."""
        g = self.g
        out = {}
        for node in g:
            if node.role != FORWARD or node.primitive != "gather" or len(node.inputs) < 2:
                continue
            p, dims = weight_source(g, node.inputs[0])
            if p is None or len(g.tensor(g.op(p).outputs[0]).shape) != 2:
                continue
            if self.labels[node.id].module == "embedding" or self.from_batch(node.inputs[1]):
                out[node.id] = (p, dims)
        return out

    def from_batch(self, t: int) -> bool:
        """Whether tensor ``t`` is computed from a batch input alone (a few reshapes, casts, clamps away)."""
        g = self.g
        todo, seen = [t], set[int]()
        while todo and len(seen) < 16:
            x = todo.pop()
            if x in seen:
                continue
            seen.add(x)
            info = g.tensor(x)
            if info.producer is None:
                continue
            node = g.op(info.producer)
            if node.primitive == INPUT_PRIMITIVE:
                if info.kind == BATCH:
                    return True
                continue
            todo.extend(node.inputs)
        return False

    def is_head(self, m: int, vocab: set[int], blocks: set) -> bool:
        """The output projection: a weight matmul outside the transformer blocks whose output features are the
        vocabulary (the token embedding's rows), or that its module label calls the head."""
        node = self.g.op(m)
        if self.labels[m].module in ("lm head", "lm_head"):
            return True
        if node.layer in blocks or not vocab:
            return False
        j = self.weight[m][0]
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        free = [d for d in range(len(node.in_shapes[j])) if d not in (lc, rc)[j] and d not in (lb, rb)[j]]
        return any(int(node.in_shapes[j][d]) in vocab for d in free)

    def param_roles(self, roles: dict[int, MatmulRole]) -> dict[int, ParamRole]:
        """Each parameter read by a role, split as its readers want (the first reader decides; a tied embedding's
        lookup and head both split the vocabulary); a column matmul's bias as its output."""
        g = self.g
        out: dict[int, ParamRole] = {}
        for r in roles.values():
            if r.param is None or r.param in out:
                continue
            out[r.param] = ParamRole(r.param, r.param_dim, r.kind, r.label)
        for r in roles.values():
            if r.kind != "column":
                continue
            for t in g.op(r.op).outputs:
                for c in g.consumers.get(t, ()):
                    bias = self.bias_of(c, t)
                    if bias is not None and bias not in out:
                        out[bias] = ParamRole(bias, 0, "column", f"{r.label} (bias)")
        return out

    def bias_of(self, op: int, t: int) -> int | None:
        """The rank-1 parameter ``op`` adds to tensor ``t`` (through a cast and a broadcast), or None."""
        g = self.g
        node = g.op(op)
        if node.primitive != "add":
            return None
        for u in node.inputs:
            if u == t:
                continue
            x = u
            for _ in range(3):
                p = g.tensor(x).producer
                if p is None:
                    break
                pn = g.op(p)
                if pn.primitive == INPUT_PRIMITIVE:
                    info = g.tensor(x)
                    return p if info.kind == PARAM and len(info.shape) == 1 else None
                if pn.primitive not in ("broadcast_in_dim", "convert_element_type", "reshape") or not pn.inputs:
                    break
                x = pn.inputs[0]
        return None


def find_roles(graph: OpGraph) -> Roles:
    """The :class:`Roles` of ``graph`` (memoised on it)."""
    hit = graph.__dict__.get("_layout_roles")
    if hit is None:
        hit = _Finder(graph).run()
        graph.__dict__["_layout_roles"] = hit
    return hit
