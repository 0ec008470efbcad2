"""Operators named by the module users know: ``qkv``, ``attn/q_proj``, ``mlp/down (weight grad)``, not ``#3521``.

:func:`module_labels` gives every operator of a graph a :class:`ModuleLabel`: the *module* it belongs to, a short
*label* (the module and the operator's part in it) and the *path* the module was read from. The module is found,
in this order:

1. the operator's name scope inside its layer: ``transpose(jvp(layer_3))/attn/q_proj`` -> ``attn/q_proj`` (the
   transformations stripped as :mod:`autopar_lab.graph.scopes` does; an einsum's equation, which JAX puts in the name
   stack, is not a module);
2. the pytree path of a parameter the operator reads (through a mixed-precision cast):
   ``params['layers'][3]['qkv']['w']`` -> ``qkv``; the step's own parameters outside its layers get the names users
   know (a token embedding read by a gather is the ``embedding``; read by a matmul that keeps the vocabulary, it is the
   tied ``lm head``; ``wpe`` the ``position embedding``, ``ln_f`` the ``final norm``);
3. for a matmul of two activations, its structure: a batched matmul whose result reaches another one through a
   softmax is attention's scores (QK^T), that one its context (probs x V), ``attn/scores`` and ``attn/context``; a
   matmul whose result an expert matmul (batched over a parameter's expert axis) reads is a mixture of experts'
   token dispatch, one that reads an expert matmul's result its combine;
4. for the backward's matmuls, the forward matmul they differentiate: JAX transposes ``y = x @ w`` into two matmuls
   reading the same cotangent, ``dx = dy @ w^T`` (reads the parameter: the *data grad*) and ``dw = x^T @ dy`` (reads
   the forward's activation ``x``: the *weight grad*); a backward matmul that reads a forward matmul's operand
   computes the gradient of its other operand (a weight grad when that is a parameter, else a data grad);
5. else the module of the nearest operator upstream in the same layer that has one (matmuls only);

else it is empty. Backward operators say which forward module they belong to and ``grad`` (``fc1 (weight grad)``,
``attn/scores (data grad)``, ``ln1 (grad)``), optimizer operators ``(update)``; a forward matmul recomputed in the
backward (rematerialisation) ``(recomputed)``. Computed once per graph and kept with it (graphs are immutable), in
one pass over the operators with bounded walks: well under a second on a 48-layer GPT-39B step.

>>> import autopar_lab as al
>>> g = al.models.get("gpt-tiny").trace()
>>> labels = module_labels(g)
>>> [labels[n.id].label for n in g if n.primitive == "dot_general" and n.layer == "layer_0" and n.role == "forward"]
['qkv', 'attn/scores', 'attn/context', 'proj', 'fc1', 'fc2']
>>> labels[next(n.id for n in g if n.primitive == "dot_general" and n.role == "backward")].label
'lm head (weight grad)'
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from .opcost import CONTRACTIONS
from .opgraph import BACKWARD, FORWARD, INPUT_PRIMITIVE, OPT_STATE, OUTPUT_PRIMITIVE, PARAM, UPDATE, OpGraph, OpNode
from .scopes import scope_path_and_role

__all__ = ["ModuleLabel", "SOURCES", "layer_operators", "module_label", "module_labels", "modules_present",
           "shapes_text", "under"]

#: How a module was found (:attr:`ModuleLabel.source`), in the order the rules are tried.
SOURCES = ("scope", "param", "attention", "experts", "gradient", "upstream")

# Operators a value passes through unchanged but for its dtype or layout: a parameter cast to the compute dtype, a
# weight reshaped or transposed for an einsum.
_PASS = frozenset(["convert_element_type", "copy", "copy_p", "reshape", "transpose", "squeeze", "expand_dims",
                   "broadcast_in_dim", "dynamic_slice", "slice", "scan_slice"])
# The leaf names of a parameter inside its module (a module's weight, bias, scale): not part of the module's name.
_LEAVES = frozenset(["w", "b", "kernel", "bias", "scale", "weight", "gamma", "beta", "embedding"])
# The step's own parameters outside its layers, by the names models give them.
_TOKEN_EMBEDDING = frozenset(["wte", "embed_tokens", "tok_embeddings", "word_embeddings", "token_embedding",
                              "token_embeddings", "embed", "embedding", "embeddings"])
_ALIASES = {**{n: "position embedding" for n in ("wpe", "position_embeddings", "pos_embed", "pos_embedding",
                                                  "position_embedding")},
            **{n: "lm head" for n in ("lm_head", "head", "output_projection", "unembed")},
            **{n: "final norm" for n in ("ln_f", "norm_f", "final_norm", "final_layernorm", "norm")}}
_PATH_KEY = re.compile(r"\[\s*'([^']*)'\s*\]|\[\s*\"([^\"]*)\"\s*\]|\[\s*(-?\d+)\s*\]|\.([A-Za-z_]\w*)|^([A-Za-z_]\w*)")
_WALK = 64  # operators a structural walk visits at most (an attention's softmax is a dozen)


@dataclass(frozen=True)
class ModuleLabel:
    """What an operator is part of, in the words of the model's code.

    ``module``: the module (``"attn/q_proj"``, ``"qkv"``, ``"attn/scores"``, ``"lm head"``; ``""`` when none is
    known); ``label``: the module and the operator's part in it (``"fc1 (weight grad)"``); ``path``: where the module
    was read (the name scope ``"layer_3/attn/q_proj"``, or the parameter's pytree path); ``source``: which rule found
    it (one of :data:`SOURCES`, or ``""``)."""

    module: str = ""
    label: str = ""
    path: str = ""
    source: str = ""

    def explain(self) -> str:
        """How the module was found, for people: ``"its name scope layer_3/attn/q_proj"``, ``"the parameter it reads,
        args[0]['layers'][3]['qkv']['w']"``, ...; ``""`` when none was."""
        how = {"scope": "its name scope", "param": "the parameter it reads,",
               "attention": "attention's structure (a softmax between two batched matmuls):",
               "experts": "the experts' structure (a matmul beside the expert matmuls):",
               "gradient": "the forward matmul it differentiates:",
               "upstream": "the nearest operator upstream:"}.get(self.source)
        return f"{how} {self.path}" if how else ""


_NONE = ModuleLabel()


def shapes_text(node: OpNode) -> str:
    """An operator's operand shapes and result shape, compact: ``[8,1024,2048]x[2048,6144] -> [8,1024,6144]`` (a
    matmul's operands joined by ``x``, any other operator's by ``,``).

    >>> from autopar_lab.graph.opgraph import OpNode
    >>> shapes_text(OpNode(0, "dot_general", "d", (0, 1), (2,), ((8, 16), (16, 4)), ("f32", "f32"), ((8, 4),),
    ...                    ("f32",), ("activation", "param"), 0, 0, 0, "forward"))
    '[8,16]x[16,4] -> [8,4]'
    """
    def one(s) -> str:
        return "[" + ",".join(str(int(d)) for d in s) + "]"

    join = "x" if node.primitive in CONTRACTIONS else ","
    ins = join.join(one(s) for s in node.in_shapes)
    outs = ",".join(one(s) for s in node.out_shapes)
    return f"{ins} -> {outs}" if ins else outs


def module_label(graph: OpGraph, op: int) -> ModuleLabel:
    """The :class:`ModuleLabel` of operator ``op`` (see the module docstring)."""
    return module_labels(graph)[op]


def module_labels(graph: OpGraph) -> tuple[ModuleLabel, ...]:
    """Every operator's :class:`ModuleLabel`, indexed by operator id; computed once per graph."""
    hit = graph.__dict__.get("_module_labels")
    if hit is None:
        hit = _Finder(graph).run()  # reads the graph first: a deferred graph is traced before the memo is written
        graph.__dict__["_module_labels"] = hit
    return hit


def modules_present(labels: Sequence[ModuleLabel]) -> list[str]:
    """The distinct modules of ``labels`` and every module they sit under (``attn`` for ``attn/q_proj``), sorted:
    the choices of a filter by module."""
    out: set[str] = set()
    for lab in labels:
        parts = lab.module.split("/") if lab.module else []
        out.update("/".join(parts[:k]) for k in range(1, len(parts) + 1))
    return sorted(out)


def under(module: str, wanted: str) -> bool:
    """Whether ``module`` is ``wanted`` or sits under it (``attn/q_proj`` under ``attn``); case and spaces aside.

    >>> under("attn/q_proj", "attn"), under("attn/q_proj", "q_proj"), under("fc1", " FC1 ")
    (True, False, True)
    """
    m, w = module.lower(), wanted.strip().lower().strip("/")
    return bool(w) and (m == w or m.startswith(w + "/"))


# ----------------------------------------------------------------------------------------------------------------


def _path_keys(path: str) -> list[str | int]:
    """``"args[1][0].mu['layers'][3]['qkv']['w']"`` -> ``['args', 1, 0, 'mu', 'layers', 3, 'qkv', 'w']``."""
    out: list[str | int] = []
    for m in _PATH_KEY.finditer(path):
        a, b, idx, attr, head = m.groups()
        if idx is not None:
            out.append(int(idx))
        else:
            out.append(next(x for x in (a, b, attr, head) if x is not None))
    return out


def _param_module(path: str, layer: str | None) -> tuple[str, bool]:
    """The module a parameter path names, and whether the parameter sits outside the step's layers (no layer index
    or layer key in its path): ``"args[0]['layers'][3]['qkv']['w']"`` -> ``("qkv", False)``."""
    keys = _path_keys(path)
    while keys and (keys[0] in ("args", "params", "param") or isinstance(keys[0], int)):
        keys = keys[1:]  # the argument's place, an optimizer state's position in its tuple
    base = re.sub(r"\[\d+\]$", "", layer) if layer else None
    at = max((i for i, k in enumerate(keys) if isinstance(k, int) or k == layer), default=None)
    top = at is None
    if at is not None:
        # a layer that is itself the module (Flax's Dense named "head"): its name, not its leaf's
        rest = [k for k in keys[at + 1:] if not isinstance(k, int)]
        keys = keys[at:] if isinstance(keys[at], str) and all(k in _LEAVES for k in rest) else keys[at + 1:]
    else:
        # an optimizer state's own name (mu, nu) before the parameter's path; a scan's stacked layers' container
        while len(keys) > 1 and keys[0] in ("mu", "nu", "m", "v", "momentum", "trace", base, "params"):
            keys = keys[1:]
    names = [str(k) for k in keys if not isinstance(k, int)]
    if len(names) > 1 and names[-1] in _LEAVES:
        names = names[:-1]
    return "/".join(names), top


def _scope_module(node: OpNode) -> tuple[str, str]:
    """(module, path) from the operator's name scope: the user scopes below its layer's, an einsum's equation left
    out; ("", "") when there are none. A recomputed region's scope names the layer again
    (``transpose(jvp(layer_1))/jvp(layer_1)/rematted_computation/attn``): the module is what follows its last
    mention, the path names it once."""
    path, _ = scope_path_and_role(node.scope)
    path = tuple(p for p in path if "->" not in p)
    at: list[int] = []
    if node.layer is not None:
        base = re.sub(r"\[\d+\]$", "", node.layer)
        at = [i for i, p in enumerate(path) if p in (node.layer, base)]
    inner = path[at[-1] + 1:] if at else path
    full = path[:at[0] + 1] + inner if at else path
    return ("/".join(inner), "/".join(full)) if inner else ("", "")


def _recomputed_scope(scope: str) -> bool:
    """Whether a name stack is inside a rematerialised region (``jax.checkpoint``): the forward run again."""
    return any(w in scope for w in ("rematted_computation", "remat(", "checkpoint("))


class _Finder:
    """One pass of the rules of the module docstring over a graph."""

    def __init__(self, graph: OpGraph):
        self.g = graph
        self.nodes: list[OpNode] = list(graph)
        self.module = [""] * len(self.nodes)
        self.path = [""] * len(self.nodes)
        self.source = [""] * len(self.nodes)
        self.part = [""] * len(self.nodes)  # "data grad", "weight grad", "recomputed", "grad", "update" or ""
        self._param_memo: dict[int, int | None] = {}
        self._scopes: dict[tuple[str, str | None], tuple[str, str]] = {}  # a deep model repeats a few scopes
        self._labels: dict[tuple, ModuleLabel] = {}

    def scope_module(self, node: OpNode) -> tuple[str, str]:
        key = (node.scope, node.layer)
        hit = self._scopes.get(key)
        if hit is None:
            hit = self._scopes[key] = _scope_module(node)
        return hit

    # -- parameters -------------------------------------------------------------------------------------------
    def param_of(self, t: int) -> int | None:
        """The step input (a parameter or optimizer state, not a scalar) that tensor ``t`` is, through casts and
        layout changes; None if it is none."""
        if t in self._param_memo:
            return self._param_memo[t]
        g, x, out = self.g, t, None
        for _ in range(6):
            info = g.tensor(x)
            if info.producer is None:
                break
            node = self.nodes[info.producer]
            if node.primitive == INPUT_PRIMITIVE:
                if info.kind in (PARAM, OPT_STATE) and info.shape:
                    out = x
                break
            if node.primitive not in _PASS or not node.inputs:
                break
            x = node.inputs[0]
        self._param_memo[t] = out
        return out

    def param_operands(self, node: OpNode) -> list[int]:
        """The indices of ``node``'s operands that are parameters (or optimizer state)."""
        return [j for j, t in enumerate(node.inputs) if self.param_of(t) is not None]

    def from_param(self, node: OpNode, j: int | None) -> tuple[str, str]:
        """(module, path) of the parameter operand ``j`` of ``node`` (None: the step input ``node`` is), the names of
        the step's own parameters (outside its layers) made the ones users know."""
        t = node.outputs[0] if j is None else self.param_of(node.inputs[j])
        assert t is not None  # j is one of param_operands(node)
        info = self.g.tensor(t)
        module, top = _param_module(info.path, node.layer)
        if top and module:
            leaf = module.rsplit("/", 1)[-1]
            if leaf in _TOKEN_EMBEDDING:
                # a gather reads the embedding; a matmul the tied output projection (its backward's data grad too),
                # unless it is a forward one-hot lookup contracting the vocabulary
                lookup = j is None or (node.role == FORWARD and not self.keeps_dim0(node, j))
                module = "lm head" if node.primitive in CONTRACTIONS and not lookup else "embedding"
            else:
                module = _ALIASES.get(leaf, module)
        return module, info.path

    def keeps_dim0(self, node: OpNode, j: int) -> bool:
        """Whether a matmul keeps its operand ``j``'s first dimension (an embedding's vocabulary: the tied logits)
        rather than contracting it (a one-hot lookup)."""
        if node.primitive != "dot_general":
            return False
        (lc, rc), _ = node.params.get("dimension_numbers", (((), ()), ((), ())))
        return 0 not in (lc if j == 0 else rc)

    # -- structure ----------------------------------------------------------------------------------------------
    def is_matmul(self, node: OpNode) -> bool:
        return node.primitive in CONTRACTIONS

    def batched(self, node: OpNode) -> bool:
        if node.primitive != "dot_general":
            return False
        _, (lb, rb) = node.params.get("dimension_numbers", (((), ()), ((), ())))
        return bool(lb)

    def expert(self, node: OpNode) -> bool:
        """A forward matmul batched over a parameter's axis: the stacked weights of experts."""
        if node.primitive != "dot_general" or node.role != FORWARD:
            return False
        _, bdims = node.params.get("dimension_numbers", (((), ()), ((), ())))
        return any(bdims[j] and self.param_of(node.inputs[j]) is not None for j in (0, 1))

    def downstream(self, op: int) -> tuple[list[int], set[str]]:
        """The forward matmuls of ``op``'s layer its result reaches through other forward operators (at most
        :data:`_WALK` of them), and the primitives on the way."""
        node = self.nodes[op]
        found, prims, seen = [], set(), {op}
        todo = deque(node.outputs)
        while todo and len(seen) < _WALK:
            t = todo.popleft()
            for c in self.g.consumers.get(t, ()):
                cn = self.nodes[c]
                if c in seen or cn.role != FORWARD or cn.layer != node.layer:
                    continue
                seen.add(c)
                if self.is_matmul(cn):
                    found.append(c)
                else:
                    prims.add(cn.primitive)
                    todo.extend(cn.outputs)
        return found, prims

    def upstream_matmuls(self, op: int) -> list[int]:
        """The forward matmuls of ``op``'s layer whose results reach ``op`` through other operators (bounded)."""
        node = self.nodes[op]
        found, seen = [], {op}
        todo = deque(node.inputs)
        while todo and len(seen) < _WALK:
            p = self.g.tensor(todo.popleft()).producer
            if p is None or p in seen:
                continue
            seen.add(p)
            pn = self.nodes[p]
            if pn.layer != node.layer or pn.primitive == INPUT_PRIMITIVE:
                continue
            if self.is_matmul(pn):
                found.append(p)
            else:
                todo.extend(pn.inputs)
        return found

    def structure(self) -> None:
        """Attention's scores and context, and a mixture of experts' dispatch and combine, among the forward matmuls
        of two activations (a scope that names the attention, ``attn``, gets the part under it: ``attn/scores``)."""
        parts: dict[int, str] = {}
        for node in self.nodes:
            i = node.id
            if not self.is_matmul(node) or node.role != FORWARD or self.param_operands(node) or i in parts:
                continue
            after, prims = self.downstream(i)
            if self.batched(node) and prims & {"exp", "exp2"}:
                ctx = [c for c in after if self.batched(self.nodes[c]) and not self.param_operands(self.nodes[c])]
                if ctx:
                    parts[i], parts[ctx[0]] = "scores", "context"
                    continue
            if any(self.expert(self.nodes[c]) for c in after):
                parts[i] = "dispatch"
            elif any(self.expert(self.nodes[p]) for p in self.upstream_matmuls(i)):
                parts[i] = "combine"
        for i, part in parts.items():
            node = self.nodes[i]
            scope, _ = self.scope_module(node)
            if scope.rsplit("/", 1)[-1] == part:
                continue  # the scope says it already
            kind = "attention" if part in ("scores", "context") else "experts"
            module = f"{scope}/{part}" if scope else f"{'attn' if kind == 'attention' else 'moe'}/{part}"
            self.set(i, module, "/".join(x for x in (node.layer, module) if x), kind)

    # -- the backward's matmuls ---------------------------------------------------------------------------------
    def aliases(self, t: int) -> list[int]:
        """``t`` and the tensors it is a cast, reshape or transpose of (a few steps up)."""
        out = [t]
        for _ in range(3):
            p = self.g.tensor(out[-1]).producer
            if p is None or self.nodes[p].primitive not in _PASS or not self.nodes[p].inputs:
                break
            out.append(self.nodes[p].inputs[0])
        return out

    def forwardish(self, op: int) -> bool:
        """A forward operator, or one recomputed in the backward (its twin's stand-in there)."""
        return self.nodes[op].role == FORWARD or self.part[op] == "recomputed"

    def forward_readers(self, t: int) -> list[tuple[int, int]]:
        """(forward matmul, operand index) for each forward (or recomputed) matmul that reads ``t`` (directly or
        through a cast, reshape or transpose)."""
        out: list[tuple[int, int]] = []
        todo, seen = [(t, 0)], set()
        while todo:
            x, depth = todo.pop()
            for c in self.g.consumers.get(x, ()):
                if c in seen:
                    continue
                seen.add(c)
                cn = self.nodes[c]
                if self.is_matmul(cn) and self.forwardish(c):
                    out.extend((c, j) for j, y in enumerate(cn.inputs) if y == x)
                elif cn.primitive in _PASS and depth < 2:
                    todo.extend((y, depth + 1) for y in cn.outputs)
        return out

    def counterpart(self, node: OpNode) -> tuple[int, str] | None:
        """For a backward matmul that reads no parameter: (the operator whose module it takes, its gradient kind)."""
        g = self.g
        fwd_inputs: list[int] = []
        cotangents: list[int] = []
        for t in node.inputs:
            p = g.tensor(t).producer
            (fwd_inputs if p is not None and self.forwardish(p) else cotangents).append(t)
        # a sibling reading the same cotangent and a parameter is the data grad of this weight grad's matmul
        for t in cotangents:
            for x in self.aliases(t):
                for c in g.consumers.get(x, ()):
                    cn = self.nodes[c]
                    if c != node.id and self.is_matmul(cn) and cn.role == node.role and self.param_operands(cn) \
                            and self.part[c] != "recomputed":
                        return c, "weight grad"
        # a forward matmul's operand: this computes the gradient of its other operand
        for t in fwd_inputs:
            for x in self.aliases(t):
                for f, j in self.forward_readers(x):
                    if self.module[f]:
                        other = [k for k in self.param_operands(self.nodes[f]) if k != j]
                        return f, "weight grad" if other else "data grad"
        return None

    def recomputed(self, node: OpNode, j: int) -> bool:
        """Whether a backward matmul reading parameter operand ``j`` is a forward matmul run again (it contracts the
        parameter as the forward does), not a data grad (which contracts the parameter's other side)."""
        p = self.param_of(node.inputs[j])
        for c, k in self.forward_readers(p) if p is not None else ():
            f = self.nodes[c]
            if f.out_shapes == node.out_shapes and f.params.get("dimension_numbers") == \
                    node.params.get("dimension_numbers") and k == j:
                return True
        return False

    # -- the pass -------------------------------------------------------------------------------------------------
    def set(self, op: int, module: str, path: str, source: str) -> None:
        self.module[op], self.path[op], self.source[op] = module, path, source

    def nearest(self, op: int) -> int | None:
        """The nearest operator upstream in ``op``'s layer that has a module (breadth first, bounded)."""
        node = self.nodes[op]
        seen, todo = {op}, deque(node.inputs)
        while todo and len(seen) < _WALK:
            p = self.g.tensor(todo.popleft()).producer
            if p is None or p in seen:
                continue
            seen.add(p)
            pn = self.nodes[p]
            if pn.layer != node.layer:
                continue
            if self.module[p] and pn.primitive != INPUT_PRIMITIVE:
                return p
            todo.extend(pn.inputs)
        return None

    def twins(self) -> None:
        """A recomputed forward operator (in the backward, inside ``jax.checkpoint``) takes the module of the forward
        operator it repeats: the one at the same place among the forward operators of its layer with its scope,
        primitive and shapes."""
        forward: dict[tuple, list[int]] = {}
        seen: dict[tuple, int] = {}
        for node in self.nodes:
            if node.primitive in (INPUT_PRIMITIVE, OUTPUT_PRIMITIVE):
                continue
            key = (node.layer, self.scope_module(node)[0], node.primitive, node.in_shapes, node.out_shapes)
            if node.role == FORWARD:
                forward.setdefault(key, []).append(node.id)
            elif node.role == BACKWARD and _recomputed_scope(node.scope):
                k = seen.get(key, 0)
                seen[key] = k + 1
                twins = forward.get(key, ())
                if k < len(twins) and self.module[twins[k]]:
                    f = twins[k]
                    self.set(node.id, self.module[f], self.path[f], self.source[f])
                if self.module[node.id]:
                    self.part[node.id] = "recomputed"

    def updates(self) -> None:
        """An optimizer's chain of operators on one parameter shares its module: from the operators it reads (its
        state, the gradient's matmul), then from those that read it."""
        g, nodes = self.g, self.nodes
        for node in nodes:
            if not self.module[node.id] and node.role == UPDATE:
                p = next((q for q in (g.tensor(t).producer for t in node.inputs) if q is not None and
                          self.module[q] and nodes[q].primitive != INPUT_PRIMITIVE), None)
                if p is not None:
                    self.set(node.id, self.module[p], self.path[p], self.source[p])
        for node in reversed(nodes):
            if not self.module[node.id] and node.role == UPDATE and node.primitive != OUTPUT_PRIMITIVE:
                c = next((c for t in node.outputs for c in g.consumers.get(t, ()) if self.module[c] and
                          nodes[c].role == UPDATE), None)
                if c is not None:
                    self.set(node.id, self.module[c], self.path[c], self.source[c])

    def run(self) -> tuple[ModuleLabel, ...]:
        nodes = self.nodes
        for node in nodes:  # 1, 2: the scope, else a parameter read
            if node.primitive == OUTPUT_PRIMITIVE:
                continue
            if node.primitive == INPUT_PRIMITIVE:  # a parameter or its optimizer state: its own path
                if self.param_of(node.outputs[0]) is not None:
                    self.set(node.id, *self.from_param(node, None), "param")
                continue
            module, path = self.scope_module(node)
            if module:
                self.set(node.id, module, path, "scope")
                continue
            params = self.param_operands(node)
            if params:
                # the parameter, not the optimizer state, when an update reads both
                kinds = [self.g.tensor(t).kind for t in (self.param_of(node.inputs[j]) for j in params)
                         if t is not None]
                j = params[kinds.index(PARAM)] if PARAM in kinds else params[0]
                self.set(node.id, *self.from_param(node, j), "param")
        self.structure()  # 3
        self.twins()
        for node in nodes:  # 4, 5: the backward's matmuls, then the rest by their neighbours
            i = node.id
            if not self.is_matmul(node) or self.part[i]:
                continue
            if node.role != FORWARD and not self.param_operands(node):
                cp = self.counterpart(node)
                if cp is not None:
                    f, grad = cp
                    module = self.module[f]
                    # the scope names the module; the structure a part of it (attn -> attn/scores)
                    if not self.module[i] or module.startswith(self.module[i] + "/"):
                        self.set(i, module, self.path[f], "gradient")
                    self.part[i] = grad
                    continue
            if not self.module[i]:
                p = self.nearest(i)
                if p is not None:
                    self.set(i, self.module[p], self.path[p], "upstream")
        self.updates()
        return tuple(self.label(node) for node in nodes)

    def label(self, node: OpNode) -> ModuleLabel:
        i = node.id
        module = self.module[i]
        if not module:
            return _NONE
        part = self.part[i]
        if node.primitive == INPUT_PRIMITIVE:
            part = "optimizer state" if self.g.tensor(node.outputs[0]).kind == OPT_STATE else ""
        elif node.role == UPDATE:
            part = "update"
        elif node.role == BACKWARD and not part:
            if self.is_matmul(node):
                params = self.param_operands(node)
                if params:
                    part = "recomputed" if self.recomputed(node, params[0]) else "data grad"
                else:
                    part = "grad"
            else:
                part = "grad"
        key = (module, part, self.path[i], self.source[i])
        hit = self._labels.get(key)  # one value per parameter and part: a deep model's labels share them
        if hit is None:
            hit = self._labels[key] = ModuleLabel(module, f"{module} ({part})" if part else module, self.path[i],
                                                  self.source[i])
        return hit


def layer_operators(graph: OpGraph, layers: Sequence[str] | None = None) -> list[dict]:
    """The matmuls of some layers with their modules, as plain data (what ``autopar-lab graph --json`` prints under
    ``layer_modules``): per layer ``{"layer", "operators": [{"op", "role", "label", "module", "path", "shapes",
    "dtype", "flops"}]}``. ``layers``: by default the first layer of each kind among the blocks (layers with two or
    more forward matmuls; a kind is the modules of its forward matmuls): GPT's ``layer_0``; a mixture of experts'
    first dense and first expert layer.

    >>> import autopar_lab as al
    >>> [(b["layer"], [o["label"] for o in b["operators"] if o["role"] == "forward"][-3:])
    ...  for b in layer_operators(al.models.get("moe-tiny").trace())]
    [('layer_0', ['proj', 'fc1', 'fc2']), ('layer_1', ['experts/w1', 'experts/w2', 'moe/combine'])]
    """
    labels = module_labels(graph)
    matmuls: dict[str | None, list[OpNode]] = {}
    for n in graph:
        if n.primitive in CONTRACTIONS:
            matmuls.setdefault(n.layer, []).append(n)
    if layers is None:
        kinds: dict[tuple, str] = {}
        for name in graph.layers:
            forward = tuple(labels[n.id].module for n in matmuls.get(name, ()) if n.role == FORWARD)
            if len(forward) >= 2:
                kinds.setdefault(forward, name)
        layers = list(kinds.values())
    missing = [x for x in layers if x not in graph.layers]
    if missing:
        raise ValueError(f"no layer {missing[0]!r} in this graph; its layers are {', '.join(graph.layers[:6])}"
                         f"{', ...' if len(graph.layers) > 6 else ''}")
    return [{"layer": name, "operators": [
        {"op": n.id, "role": n.role, "label": labels[n.id].label, "module": labels[n.id].module,
         "path": labels[n.id].path, "shapes": shapes_text(n), "dtype": ",".join(n.out_dtypes), "flops": n.flops}
        for n in matmuls.get(name, ())]} for name in layers]
