"""Find a traced step's layers (the units a pipeline may cut between) wherever they sit, and say how.

:func:`autopar_lab.trace` calls :func:`find_layers` on every graph it captures. The first rule that applies wins, and
``graph.layer_rule`` (a key) and ``graph.layer_note`` (a sentence) say which one it was:

``"pattern"``
    The user named the level: ``layers="backbone/transformer_layer_*"`` (``fnmatch`` patterns, one per name-scope
    level, matched from the first scope or from the first scope that differs between operators; when no scope
    matches, the parameters' pytree paths are tried, e.g. ``layers="blocks/*"`` for ``params.blocks[3]``).
``"indexed-scopes"``
    A level of the name-scope tree whose sibling names differ only by an index: ``layer_3``, ``h_3``,
    ``transformer_layer_3``, ``block3``, or Keras' ``dense``, ``dense_1``, ``dense_2``. The groups with the most
    members win (two disjoint groups of similar size, an encoder's and a decoder's, both count); groups nested
    inside a winner (``Dense_0``, ``Dense_1`` inside every block) do not.
``"scan"``
    A ``lax.scan`` over layers: each iteration is a layer (``"<scope>[i]"``), see :mod:`.capture`.
``"indexed-params"``
    No scope says it, but the parameters' pytree paths do: ``.blocks[3].linear.weight`` (Equinox),
    ``['blocks'][3]['kernel'].value`` (Flax NNX), ``['transformer/~/layer_3/linear']['w']`` (Haiku). Each forward
    operator that reads a parameter is anchored to that parameter's block; between two blocks the cut falls where the
    fewest bytes cross (ties: the latest place, so a block keeps its activation and residual add).
``"top-scopes"``
    The children of the outermost scope all operators share (Flax puts the top module's name first), as before.
``"cluster"``
    Nothing above gives two layers: Alpa's operator clustering (:func:`autopar_lab.relayer` with
    ``boundaries="cluster"``).

Layer names are scope paths from the first level where operators' scopes differ: ``"block_3"`` for Flax's
``Net/block_3``, ``"backbone/transformer_layer_3"`` when other operators sit outside ``backbone``. An operator at a
group's parent level but in none of its members (glue such as the residual stream's add between blocks) takes a
neighbour's layer. A layer whose forward operators come back after another layer's (a tied embedding used again by
the output head) becomes two layers, ``"embed"`` and ``"embed#2"``: a pipeline's layers are contiguous.

When the layers named by scopes are contiguous, every operator keeps the layer its own scope names (backward and
update operators included; the zoo's graphs are exactly what they were). Otherwise (indexed parameters, split
layers) the forward operators are cut as said and the rest follows them by :func:`autopar_lab.graph.relayer`'s rules.

>>> split_key_path("args[0]['params']['block_0']['Dense_0']['kernel']")
('params', 'block_0', 'Dense_0', 'kernel')
>>> split_key_path("args[0].blocks[3].linear.weight")
('blocks', '3', 'linear', 'weight')
>>> split_key_path("args[0]['transformer/~/layer_3/linear']['w']")
('transformer', 'layer_3', 'linear', 'w')
>>> [(g.prefix, g.stem, len(g.members)) for g in indexed_groups([("backbone", "transformer_layer_0", "attn"),
...     ("backbone", "transformer_layer_1"), ("backbone", "layer_norm"), ("token_embedding",)])]
[(('backbone',), 'transformer_layer_', 2)]
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from .complete import layers_from_forward
from .scopes import layer_depth, propagate_layers, scope_path_and_role
from .opgraph import FORWARD, INPUT_PRIMITIVE, OUTPUT_PRIMITIVE, PARAM, OpGraph

__all__ = ["find_layers", "assign_layers", "indexed_groups", "split_key_path", "RULES", "Group"]

RULES = ("pattern", "indexed-scopes", "scan", "indexed-params", "top-scopes", "cluster")
_INDEXED = re.compile(r"^(.*?)(\d+)$")
_KEY = re.compile(r"\[(?:'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"|([^\]]*))\]|\.([A-Za-z_][\w]*)")
_PSEUDO = frozenset([INPUT_PRIMITIVE, OUTPUT_PRIMITIVE])


def split_key_path(path: str) -> tuple[str, ...]:
    """The components of a pytree key path (``jax.tree_util.keystr``), the leading ``args[i]`` dropped; a string key
    holding slashes (Haiku's module names) is split at them, Haiku's ``~`` separators dropped."""
    path = re.sub(r"^args\[\d+\]", "", path)
    out: list[str] = []
    for m in _KEY.finditer(path):
        key = next(g for g in m.groups() if g is not None)
        out.extend(part for part in key.split("/") if part and part != "~")
    return tuple(out)


@dataclass(frozen=True)
class Group:
    """Sibling names under ``prefix`` that differ only by an index: ``members`` maps each name to its index."""

    prefix: tuple
    stem: str
    members: dict

    def holds(self, path: Sequence[str]) -> bool:
        n = len(self.prefix)
        return len(path) > n and tuple(path[:n]) == self.prefix and path[n] in self.members

    def nested_in(self, other: "Group") -> bool:
        n = len(other.prefix)
        return len(self.prefix) > n and self.prefix[:n] == other.prefix and self.prefix[n] in other.members

    def describe(self) -> str:
        if not self.stem and all(str(m).isdigit() for m in self.members):
            return _join(self.prefix) + "[*]"
        return "/".join(self.prefix + (f"{self.stem}*",))


def indexed_groups(paths: Iterable[Sequence[str]]) -> list[Group]:
    """The winning groups of indexed siblings among ``paths`` (see the module docstring), most members first."""
    children: dict[tuple, set] = {}
    for p in paths:
        for d in range(len(p)):
            children.setdefault(tuple(p[:d]), set()).add(p[d])
    found = []
    for prefix, names in children.items():
        by_stem: dict[str, dict] = {}
        for name in names:
            m = _INDEXED.match(name)
            if m:
                by_stem.setdefault(m.group(1), {})[name] = int(m.group(2))
        for stem, members in by_stem.items():
            bare = stem[:-1] if stem.endswith(("_", "-")) else stem
            # Keras names the first of a kind "dense", the next "dense_1", "dense_2", ...
            if bare and bare in names and 0 not in members.values() and 1 in members.values():
                members = {bare: 0, **members}
            if len(set(members.values())) >= 2:
                found.append(Group(prefix, stem, members))
    found.sort(key=lambda g: (-len(g.members), len(g.prefix), g.prefix, g.stem))
    if not found:
        return []
    floor = max(2, len(found[0].members) // 2)
    keep: list[Group] = []
    for g in found:
        if len(g.members) >= floor and not any(g.nested_in(k) or k.nested_in(g) for k in keep):
            keep.append(g)
    return keep


# Repeated blocks hold most of a model's parameters; siblings that merely share a stem (``fc1``/``fc2``,
# ``ln1``/``ln2`` inside a one-block model) are not blocks. A group is taken for layers when its members hold at
# least this share of the parameter bytes and, with only two members, have parameters of the same shapes (fc1 and
# fc2 of an MLP are transposes of each other; two repeated blocks are alike).
MIN_PARAM_SHARE = 0.25


def _weighty(groups: list[Group], params: dict, graph: OpGraph) -> list[Group]:
    """The parameter-path groups that look like repeated blocks (see :data:`MIN_PARAM_SHARE`)."""
    size = {t: graph.tensor(t).nbytes for t in params}
    total = sum(size.values()) or 1
    out = []
    for g in groups:
        held = [(t, p) for t, p in params.items() if g.holds(p)]
        if sum(size[t] for t, _ in held) < MIN_PARAM_SHARE * total:
            continue
        if len(g.members) == 2:
            n = len(g.prefix)
            shapes: dict[str, list] = {}
            for t, p in held:
                shapes.setdefault(p[n], []).append((p[n + 1:], tuple(graph.tensor(t).shape)))
            if len({tuple(sorted(v)) for v in shapes.values()}) > 1:
                continue
        out.append(g)
    return out


def _join(parts: Sequence[str]) -> str:
    """Scope parts joined with "/"; a list index as ``[i]`` (``blocks[3]``, not ``blocks/3``)."""
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f"/{p}" if out else p)
    return out


def _name(path: Sequence[str], groups: Sequence[Group], d0: int) -> str | None:
    """The layer an operator (or parameter) at ``path`` belongs to, given the winning groups."""
    for g in groups:
        if g.holds(path):
            return _join(path[d0:len(g.prefix) + 1])
    best = 0
    for g in groups:
        lcp = 0
        while lcp < min(len(path), len(g.prefix)) and path[lcp] == g.prefix[lcp]:
            lcp += 1
        if lcp >= len(path):
            return None  # at a group's parent (or above): glue between members, it joins a neighbour
        best = max(best, lcp)
    return _join(path[d0:best + 1]) or None


def _pattern_groups(paths: Sequence[Sequence[str]], pattern: str, d0: int) -> tuple[list[Group], int] | None:
    pat = [p for p in pattern.strip("/").split("/") if p]
    if not pat:
        return None
    for offset in dict.fromkeys((0, d0)):
        members: dict[tuple, dict] = {}
        for p in paths:
            window = p[offset:offset + len(pat)]
            if len(window) == len(pat) and all(fnmatch.fnmatchcase(c, q) for c, q in zip(window, pat)):
                prefix = tuple(p[:offset + len(pat) - 1])
                members.setdefault(prefix, {}).setdefault(window[-1], len(members.get(prefix, {})))
        if members:
            return [Group(prefix, pat[-1], m) for prefix, m in members.items()], offset
    return None


def find_layers(graph: OpGraph, layers: str | None = None, *,
                cluster: Callable[[OpGraph], OpGraph] | None = None) -> OpGraph:
    """``graph`` with its operators' layers found by the first rule that applies (see the module docstring).

    ``layers``: a pattern naming the level (``"backbone/transformer_layer_*"``); ValueError when it matches no scope
    and no parameter path. ``cluster``: how to make layers when no rule names any (the last rule; the caller passes
    Alpa's clustering, :func:`autopar_lab.graph.relayer.relayer` with ``boundaries="cluster"``); None leaves the
    graph with the one layer the other rules found.
    """
    nodes = list(graph)
    fwd = [n.id for n in nodes if n.role == FORWARD and n.primitive not in _PSEUDO]
    paths = [scope_path_and_role(n.scope)[0] for n in nodes]
    scoped = [p for p, n in zip(paths, nodes) if p and not n.scan_layer]
    d0 = layer_depth(scoped) if scoped else 0
    d0 = min(d0, min((len(p) for p in scoped), default=0))
    params = {t: split_key_path(graph.tensor(t).path) for t in graph.inputs if graph.tensor(t).kind == PARAM}

    if layers is not None:
        if not isinstance(layers, str) or not layers.strip("/ "):
            raise ValueError(f"layers must be a pattern like 'backbone/transformer_layer_*', got {layers!r}")
        hit = _pattern_groups(scoped, layers, d0)
        if hit is not None:
            groups, offset = hit
            names = _scope_names(nodes, paths, groups, offset, keep_scans=True)
            return _finish(graph, names, "pattern", f"layers from the scopes matching {layers!r}")
        p_paths = list(params.values())
        p_d0 = layer_depth(p_paths) if p_paths else 0
        hit = _pattern_groups(p_paths, layers, p_d0)
        if hit is not None:
            groups, offset = hit
            return _from_params(graph, fwd, params, groups, offset, "pattern",
                                f"layers from the parameters matching {layers!r}")
        seen = sorted({"/".join(p[:3]) for p in scoped})[:5]
        raise ValueError(f"layers={layers!r} matches no name scope and no parameter path of this step; its scopes "
                         f"look like {seen or ['(none)']}: name one level of them, with * for the index.")

    groups = indexed_groups(scoped)
    if groups:
        names = _scope_names(nodes, paths, groups, d0, keep_scans=True)
        what = " and ".join(f"{g.describe()} ({len(g.members)})" for g in groups)
        out = _finish(graph, names, "indexed-scopes", f"layers from the name scopes that differ by an index: {what}")
        if len(out.layers) > 1:
            return out
    if any(n.scan_layer for n in nodes):
        top = [p[d0] if len(p) > d0 else None for p in paths]
        names = [n.scan_layer or (None if n.primitive == "scan_stack" else t) for n, t in zip(nodes, top)]
        n_iter = len({n.scan_layer for n in nodes if n.scan_layer})
        out = _finish(graph, names, "scan", f"layers from a scan over layers ({n_iter} iterations) and the top scopes")
        if len(out.layers) > 1:
            return out
    p_paths = list(params.values())
    p_groups = _weighty(indexed_groups(p_paths), params, graph)
    if p_groups:
        p_d0 = min(layer_depth(p_paths), min(len(p) for p in p_paths))
        what = " and ".join(f"{g.describe()} ({len(g.members)})" for g in p_groups)
        out = _from_params(graph, fwd, params, p_groups, p_d0, "indexed-params",
                           f"layers from the parameter paths that differ by an index: {what}")
        if len(out.layers) > 1:
            return out
    top = [p[d0] if len(p) > d0 else None for p in paths]
    out = _finish(graph, top, "top-scopes", "layers from the top module's children (the first scope level that "
                                            "differs between operators)")
    if len(out.layers) > 1 or not fwd or cluster is None:
        return out
    clustered = cluster(graph)
    return _with(clustered, [n.layer for n in clustered], "cluster",
                 f"no scope or parameter path names layers: Alpa's operator clustering made {len(clustered.layers)}")


def _scope_names(nodes, paths, groups, d0, keep_scans: bool) -> list[str | None]:
    names = []
    for n, p in zip(nodes, paths):
        name = _name(p, groups, d0) if p else None
        if keep_scans and n.scan_layer and not any(g.holds(p) for g in groups):
            name = n.scan_layer  # a scan over layers outside the groups keeps its iterations
        names.append(name)
    return names


def _finish(graph: OpGraph, names: list, rule: str, note: str) -> OpGraph:
    """Scope-derived names for every operator: kept as they are when the forward layers are contiguous (the gaps
    filled from neighbours), else the forward is cut into runs and everything else follows it."""
    nodes = list(graph)
    producer = {tid: t.producer for tid, t in graph.tensors.items()}
    alias_output = {n.params.get("alias_of"): n.id for n in nodes
                    if n.primitive == OUTPUT_PRIMITIVE and n.params.get("alias_of") is not None}
    fwd = [n.id for n in nodes if n.role == FORWARD and n.primitive not in _PSEUDO]
    runs = _runs([(i, names[i]) for i in fwd if names[i] is not None])
    if len({name for name, _ in runs}) == len(runs):
        filled = propagate_layers([n.primitive for n in nodes], [n.inputs for n in nodes], [n.outputs for n in nodes],
                                  producer, alias_output, names)
        return _with(graph, filled, rule, note)
    return _with(graph, _from_runs(graph, fwd, runs), rule,
                 note + "; a layer whose operators came back later was split in two")


def _runs(anchored: Sequence[tuple[int, str]]) -> list[tuple[str, list[int]]]:
    """Consecutive equal names in forward order: [(name, [op ids of its anchors])]."""
    runs: list[tuple[str, list[int]]] = []
    for i, name in anchored:
        if runs and runs[-1][0] == name:
            runs[-1][1].append(i)
        else:
            runs.append((name, [i]))
    return runs


def _from_params(graph: OpGraph, fwd: list[int], params: dict, groups, d0, rule: str, note: str) -> OpGraph:
    """Forward operators anchored by the parameters they read, cut into contiguous layers between the anchors."""
    owner = {t: _name(p, groups, d0) for t, p in params.items()}
    anchored: list[tuple[int, str]] = []
    for i in fwd:
        node = graph.op(i)
        reads = [(graph.tensor(t).nbytes, name) for t in node.inputs if (name := owner.get(t))]
        if reads:
            anchored.append((i, max(reads)[1]))
    runs = _runs(anchored)
    return _with(graph, _from_runs(graph, fwd, runs), rule, note)


def _from_runs(graph: OpGraph, fwd: list[int], runs) -> Sequence[str | None]:
    """Per operator, a layer: the forward cut into one layer per run of anchors (names repeated later get ``#2``,
    ``#3``, ...), each cut between two runs where the fewest bytes cross; everything else by relayer's rules."""
    if not runs:
        return [None] * len(graph)
    pos = {op: k for k, op in enumerate(fwd)}
    crossing = _crossing_bytes(graph, fwd, pos)
    seen: dict[str, int] = {}
    names = []
    for name, _ in runs:
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    starts = [0]
    for (_, a), (_, b) in zip(runs, runs[1:]):
        lo, hi = pos[a[-1]] + 1, pos[b[0]]  # the next layer starts somewhere in lo..hi
        gap = crossing[lo:hi + 1]
        c = lo + int(np.flatnonzero(gap == gap.min())[-1])  # ties: the latest place (a block keeps its tail)
        starts.append(c)
    layer_of = np.searchsorted(np.asarray(starts), np.arange(len(fwd)), side="right") - 1
    fwd_layer = {op: int(layer_of[k]) for k, op in enumerate(fwd)}
    return layers_from_forward(graph, fwd_layer, names)


def _crossing_bytes(graph: OpGraph, fwd: list[int], pos: dict) -> np.ndarray:
    """``out[c]``: bytes of forward values made before forward position ``c`` and read at ``c`` or later."""
    diff = np.zeros(len(fwd) + 2)
    for k, op in enumerate(fwd):
        for t in graph.op(op).outputs:
            last = max((pos[c] for c in graph.consumers.get(t, ()) if c in pos), default=k)
            if last > k:
                diff[k + 1] += graph.tensor(t).nbytes
                diff[last + 1] -= graph.tensor(t).nbytes
    return np.cumsum(diff)[:len(fwd) + 1]


def assign_layers(graph: OpGraph, layers: Sequence[str | None], rule: str = "given",
                  note: str = "layers given per operator") -> OpGraph:
    """``graph`` with operator ``i`` in layer ``layers[i]`` (how a stage actor rebuilds a plan's graph, whatever
    made its layers)."""
    if len(layers) != len(graph):
        raise ValueError(f"{len(layers)} layers given for a graph of {len(graph)} operators; give one per operator.")
    return _with(graph, list(layers), rule, note)


def _with(graph: OpGraph, layers: Sequence[str | None], rule: str, note: str) -> OpGraph:
    nodes = [n if n.layer == lay else dataclasses.replace(n, layer=lay) for n, lay in zip(graph, layers)]
    return graph.with_nodes(nodes, layers=(rule, note))
