"""Operator graph view: the model's layers in an overview strip, repeated layers collapsed, one layer expanded as a
layered DAG of its operators.

Consecutive layers with the same operators (the same primitives in the same order) on the same stage are one group
node, "layer_0..layer_11 ×12"; a click opens the group into its layers, a click on a layer expands it below as a DAG
with every operator named (a matmul by its module, :mod:`autopar_lab.graph.modules`: ``qkv``, ``fc1 (weight grad)``;
the others by primitive; the hover gives the module and where it was read), laid out in the browser by dagre
(``extensions/graph``). The overview always names the selected (or expanded) layer. Nodes are coloured by stage or by
sharding (an operator's output spec; a layer takes its stage's logical mesh), with a legend for each colouring. An
edge whose two ends use different shardings is resharded: drawn thick and red, its hover says which collectives
convert it, over which mesh axis, how many bytes and how long. Edges from the forward pass into the backward pass
(activations kept for the backward) are left out of the layout: they would tie every forward operator to its
backward twin across the whole drawing; those that are resharded are still drawn. The step's inputs and outputs in
a layer (its parameters and optimizer state, a third of its operators, each a lone source or sink) are folded into
the hover of the operators that read or write them.

    >>> data = graph_data(session, expanded="layer_0", mode="sharding")     # doctest: +SKIP
    >>> [n["label"] for n in data["overview"]]                                 # doctest: +SKIP
    ['embed', 'layer_0..layer_23', 'head', 'outside layers']
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import ipywidgets as w

from ...graph.modules import module_labels
from ...graph.opcost import CONTRACTIONS
from ...layergroups import group_of_layer, span_text
from . import figures
from ._base import View
from .notation import STRATEGY_TIP
from ...graph.opgraph import INPUT_PRIMITIVE, OUTPUT_PRIMITIVE
from .fmt import fmt_bytes, fmt_flops, fmt_s, strategy_text

OTHER = "(no layer)"  # the pseudo-layer of operators outside every layer
OTHER_LABEL = "outside layers"
RESHARD_COLOUR = "#d62728"
EDGE_COLOUR = "#bdbdbd"
UNKNOWN_COLOUR = "#9e9e9e"
_LAYER_CACHE: dict[int, tuple] = {}


def layer_summary(graph) -> tuple[list[str], dict, dict, set]:
    """Per layer of ``graph``: names (forward order, plus ``(no layer)`` when some operators have none),
    {layer: [ops]}, {layer: (flops, bytes)}, and the layer-to-layer edges. Cached per graph (graphs are immutable)."""
    return _summary(graph)[:4]


def layer_shapes(graph) -> dict[str, tuple]:
    """{layer: its operators' primitives in order}: layers with equal values have the same structure."""
    return _summary(graph)[4]


def _summary(graph):
    hit = _LAYER_CACHE.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    ops: dict[str, list[int]] = defaultdict(list)
    stats: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    layer_of = {}
    for n in graph:
        name = n.layer if n.layer is not None else OTHER
        layer_of[n.id] = name
        ops[name].append(n.id)
        s = stats[name]
        s[0] += n.flops
        s[1] += n.bytes_accessed
    edges = set()
    for n in graph:
        for t in n.inputs:
            src = graph.tensor(t).producer
            if src is not None and layer_of[src] != layer_of[n.id]:
                edges.add((layer_of[src], layer_of[n.id]))
    names = list(graph.layers) + ([OTHER] if OTHER in ops else [])
    shapes = {name: tuple(graph.op(o).primitive for o in ops[name]) for name in names}
    out = (names, dict(ops), {k: tuple(v) for k, v in stats.items()}, edges, shapes)
    if len(_LAYER_CACHE) > 8:
        _LAYER_CACHE.clear()
    _LAYER_CACHE[id(graph)] = (graph, out)
    return out


def _layer_stage(plan, names: list[str]) -> dict[str, int]:
    index = {n: k for k, n in enumerate(plan.layer_names)}
    out = {}
    for name in names:
        k = index.get(name, len(plan.layer_names) - 1)
        out[name] = next((s for s, st in enumerate(plan.stages) if any(a <= k <= b for a, b in st.layer_ranges)),
                         len(plan.stages) - 1)
    return out


def _split_names(plan) -> set[str]:
    """The real layers split from the layers that share their solution (they have operator pins of their own)."""
    return {plan.graph.op(o).layer for o in plan.layer_pins}


def layer_groups(session) -> list[dict]:
    """Runs of consecutive layers with the same structure on the same stage: [{key, layers, stage}] in forward
    order (a layer that repeats nothing, or was split from the layers sharing its solution, is a group of one).
    ``key`` is ``"G:<first layer>"``."""
    names, _, _, _, shapes = _summary(session.graph)
    stage = _layer_stage(session.plan, names)
    split = _split_names(session.plan)
    groups: list[dict] = []
    for name in names:
        g = groups[-1] if groups else None
        if (g is not None and name != OTHER and g["layers"][0] != OTHER and stage[name] == g["stage"]
                and name not in split and g["layers"][0] not in split
                and shapes[name] == shapes[g["layers"][0]]):
            g["layers"].append(name)
        else:
            groups.append({"key": f"G:{name}", "layers": [name], "stage": stage[name]})
    return groups


def _sharing_text(session, name: str) -> str:
    """"; one solution shared by 24 layers (layer_0..23)" for a layer whose solution others share, "; split
    from ..." for one split from them; "" otherwise."""
    plan = session.plan
    if name == OTHER or name not in plan.layer_names:
        return ""
    grp = group_of_layer(plan, name)
    if grp.split:
        return f"; split from the {grp.shared - 1} other layers sharing its solution (its own strategies)"
    if len(grp.layers) > 1:
        return f"; one solution shared by {len(grp.layers)} layers ({span_text(grp.names)})"
    return ""


def _mesh_text(st) -> str:
    return f"{st.logical_mesh[0]}x{st.logical_mesh[1]}"


def _label(name: str) -> str:
    return OTHER_LABEL if name == OTHER else name


def _strategy(session, full_op: int):
    """The strategy the real operator ``full_op`` runs with, on the stage that runs its layer (None: none)."""
    try:
        return session.plan.full_choice(full_op)
    except (KeyError, ValueError):
        return None


def _pinned(session, full_op: int) -> bool:
    """Whether ``full_op`` is pinned: in its layer alone, or for every layer sharing its solution."""
    plan = session.plan
    if full_op in plan.layer_pins:
        return True
    sop = session.solve_op(full_op)
    return sop is not None and any(o in plan.pins for o in session.op_map.siblings(sop))


def _shapes_text(shapes, dtypes) -> str:
    return ", ".join(f"{d}{list(s)}" for s, d in zip(shapes, dtypes)) or "none"


def op_label(node, lab) -> str:
    """An operator node's name in the drawing: a matmul's module (``qkv``, ``fc1 (weight grad)``: the landmarks of a
    layer), else its primitive."""
    return lab.label if lab.label and node.primitive in CONTRACTIONS else node.primitive


def _op_hover(session, node, strat, stage: int, pinned: bool, lab=None) -> str:
    plan = session.plan
    st = plan.stages[stage]
    lines = [f"#{node.id} {node.primitive} ({node.role})"]
    if lab is not None and lab.module:
        lines += [f"module: {lab.label}", f"  from {lab.explain()}"]
    lines += [f"in: {_shapes_text(node.in_shapes, node.in_dtypes)}",
              f"out: {_shapes_text(node.out_shapes, node.out_dtypes)}",
              f"{fmt_flops(node.flops)}, {fmt_bytes(node.bytes_accessed)} read and written"]
    if strat is not None:
        lines.append(f"sharding: {strategy_text(strat.name)} on stage {stage}'s {_mesh_text(st)} mesh"
                     + (" (pinned)" if pinned else ""))
        lines.append(f"time: compute {fmt_s(strat.compute_s)}, collectives {fmt_s(strat.comm_s)}")
        for kind, axis, nbytes in strat.collectives:
            lines.append(f"  {kind.replace('_', '-')} over mesh axis {axis}: {fmt_bytes(nbytes)}")
    else:
        lines.append("sharding: none recorded for this operator")
    return "\n".join(lines)


def _reshard(mesh_cache: dict, plan, stage: int, tensor, src, dst) -> tuple[float, tuple] | None:
    from ...sharding.reshard import reshard_cost

    mesh = mesh_cache.get(stage)
    if mesh is None:
        st = plan.stages[stage]
        mesh = mesh_cache[stage] = plan.cluster.logical_mesh(st.submesh, st.logical_mesh)
    try:
        return reshard_cost(src, dst, tensor.shape, tensor.dtype, mesh)
    except ValueError:  # a spec the tensor's shape cannot take on this mesh: nothing to say
        return None


def _edge_hover(tensor, src, dst, cost: float, cols, mesh: str) -> str:
    lines = [f"{tensor.dtype}{list(tensor.shape)} ({fmt_bytes(tensor.nbytes)}): {src} → {dst} on the {mesh} mesh"]
    if cols:
        for kind, axis, nbytes in cols:
            lines.append(f"{kind.replace('_', '-')} over mesh axis {axis}: {fmt_bytes(nbytes)}")
    else:
        lines.append("local slicing only (no communication)")
    lines.append(f"costs {fmt_s(cost)} per microbatch")
    return "\n".join(lines)


def graph_data(session, expanded: str | None = None, mode: str = "stage", open_groups=(), selected: str | None = None,
               max_ops: int = 4000) -> dict:
    """What the graph canvas draws: ``{"title", "overview": [node], "detail": {"title", "nodes", "edges"} or None,
    "legends": [...], "summary": {...}}``. Node keys: ``"G:<first layer>"`` (a collapsed group), ``"L:<layer>"``,
    ``"O:<operator id in the full graph>"``. ``open_groups``: group keys shown as their layers; ``selected``: the key
    outlined. ``summary`` holds counts the tests and captions use (operators drawn, resharded edges, ...)."""
    if mode not in ("stage", "sharding"):
        raise ValueError(f"colour mode must be 'stage' or 'sharding', got {mode!r}")
    plan, graph = session.plan, session.graph
    names, ops, stats, _ = layer_summary(graph)
    stage = _layer_stage(plan, names)
    meshes: dict[str, str] = {}  # mesh text -> colour (sharding mode)

    def layer_colour(name: str) -> str:
        st = plan.stages[stage[name]]
        if mode == "stage":
            return figures.colour(stage[name])
        m = _mesh_text(st)
        return meshes.setdefault(m, figures.colour(len(meshes)))

    def layer_hover(name: str) -> str:
        st = plan.stages[stage[name]]
        fl, by = stats[name]
        return (f"{_label(name)}: {operator_count_text(graph, ops[name])}, {fmt_flops(fl)}, {fmt_bytes(by)} read and "
                "written"
                f"{_sharing_text(session, name)}\n"
                f"stage {stage[name]} on a {st.submesh[0]}x{st.submesh[1]} submesh as {_mesh_text(st)}\n"
                "click: show its operators")

    open_groups = set(open_groups)
    overview = []
    groups = layer_groups(session)
    for g in groups:
        members = g["layers"]
        if len(members) > 1 and g["key"] not in open_groups:
            first, last = members[0], members[-1]
            st = plan.stages[g["stage"]]
            fl = sum(stats[n][0] for n in members)
            overview.append({
                "key": g["key"], "label": f"{first}..{last}", "count": len(members), "colour": layer_colour(first),
                "selected": selected == g["key"] or selected in {f"L:{n}" for n in members},
                "expanded": expanded in members,
                "hover": (f"{first} .. {last}: {len(members)} layers with the same operators, each "
                          f"{operator_count_text(graph, ops[first])}"
                          f"{_sharing_text(session, first)}\n"
                          f"stage {g['stage']} on a {st.submesh[0]}x{st.submesh[1]} submesh as {_mesh_text(st)}; "
                          f"{fmt_flops(fl)} in all\nclick: show them one by one")})
        else:
            for n in members:
                overview.append({"key": f"L:{n}", "label": _label(n), "count": 1, "colour": layer_colour(n),
                                 "selected": selected == f"L:{n}", "expanded": expanded == n,
                                 "hover": layer_hover(n)})
    legends = []
    if mode == "stage":
        legends.append({"title": "colour: stage", "items": [
            {"colour": figures.colour(k), "label": f"S{k}: {_label(plan.layer_names[st.layers[0]])}.."
                                                     f"{_label(plan.layer_names[st.layers[1]])} on "
                                                     f"{st.submesh[0]}x{st.submesh[1]} as {_mesh_text(st)}"}
            for k, st in enumerate(plan.stages)]})
    summary = {"layers": len(names), "overview_nodes": len(overview), "operators": 0, "edges": 0, "resharded": 0,
               "hidden_edges": 0}
    detail = None
    if expanded is not None and expanded in ops:
        detail, spec_colours, counts = _detail(session, expanded, stage[expanded], mode, selected, max_ops,
                                               layer_colour(expanded))
        summary.update(counts)
        if mode == "sharding":
            legends.append({"title": "operators: output sharding", "items": [
                {"colour": c, "label": s} for s, c in spec_colours.items()]})
    if mode == "sharding":
        legends.insert(0, {"title": "layers: their stage's logical mesh", "items": [
            {"colour": c, "label": m} for m, c in meshes.items()]})
    if detail is not None:  # its hovers name each operator's strategy
        legends.append({"title": "strategy (hover)", "items": [{"kind": "text", "label": STRATEGY_TIP}]})
    legends.append({"title": "edges", "items": [
        {"kind": "line", "colour": EDGE_COLOUR, "label": "same sharding at both ends"},
        {"kind": "line", "colour": RESHARD_COLOUR, "width": 3,
         "label": "resharded (hover: collective, bytes, time)"}]})
    title = (f"{len(names)} layers in {len(overview)} node(s): repeated layers are grouped (×n); click a group to "
             "open it, a layer to see its operators")
    return {"title": title, "overview": overview, "detail": detail, "legends": legends, "summary": summary}


def operator_count_text(graph, members) -> str:
    """``"466 operators (and 72 inputs and outputs of the step)"``: the operators a layer's detail view draws, and
    apart from them the step's inputs and outputs it folds into their readers and writers (its parameters and
    optimizer state), so the overview's hover and the detail's title count the same thing."""
    io = sum(1 for o in members if graph.op(o).primitive in (INPUT_PRIMITIVE, OUTPUT_PRIMITIVE))
    text = f"{len(members) - io} operators"
    return text + (f" (and {io} inputs and outputs of the step: parameters, optimizer state)" if io else "")


def _folded(graph, members: list[int]) -> dict[int, list[str]]:
    """The step's inputs and outputs among ``members`` (parameters, optimizer state: a third of a layer's operators,
    each a source or a sink), folded into the operators that read or write them: {reader or writer: [lines]}."""
    inside = set(members)
    notes: dict[int, list[str]] = defaultdict(list)
    for o in members:
        node = graph.op(o)
        if node.primitive == INPUT_PRIMITIVE:
            t = graph.tensor(node.outputs[0])
            for c in graph.consumers.get(t.id, ()):
                if c in inside:
                    notes[c].append(f"reads {t.kind.replace('_', ' ')} {t.dtype}{list(t.shape)}")
        elif node.primitive == OUTPUT_PRIMITIVE:
            for t in node.inputs:
                p = graph.tensor(t).producer
                if p in inside:
                    notes[p].append("its result leaves the step (an updated parameter or optimizer state)")
    return notes


def _detail(session, layer: str, stage: int, mode: str, selected, max_ops: int, layer_colour: str):
    plan, graph = session.plan, session.graph
    _, ops, _, _ = layer_summary(graph)
    members = ops[layer][:max_ops]
    notes = _folded(graph, members)
    io = {o for o in members if graph.op(o).primitive in (INPUT_PRIMITIVE, OUTPUT_PRIMITIVE)}
    members = [o for o in members if o not in io]
    inside = set(members)
    strategies = {o: _strategy(session, o) for o in members}
    labels = module_labels(graph)
    spec_colours: dict[str, str] = {}
    roles: dict[str, int] = defaultdict(int)
    nodes = []
    for o in members:
        node = graph.op(o)
        roles[node.role] += 1
        strat = strategies[o]
        spec = str(strat.out_specs[0]) if strat is not None and strat.out_specs else None
        if mode == "stage":
            colour = layer_colour
        elif spec is None:
            colour = UNKNOWN_COLOUR
        else:
            colour = spec_colours.setdefault(spec, figures.colour(len(spec_colours)))
        pinned = _pinned(session, o)
        hover = _op_hover(session, node, strat, stage, pinned, labels[o])
        if notes.get(o):
            hover += "\n" + "\n".join(notes[o])
        nodes.append({"key": f"O:{o}", "label": op_label(node, labels[o]), "colour": colour,
                      "selected": selected == f"O:{o}", "pinned": pinned, "hover": hover, "module": labels[o].module})
    edges, hidden, resharded = [], 0, 0
    mesh_cache: dict = {}
    mesh = _mesh_text(plan.stages[stage])
    for o in members:
        node = graph.op(o)
        for j, t in enumerate(node.inputs):
            tensor = graph.tensor(t)
            p = tensor.producer
            if p not in inside:
                continue
            pnode = graph.op(p)
            layout = not (pnode.role == "forward" and node.role != "forward")
            sp, so = strategies[p], strategies[o]
            edge = {"source": f"O:{p}", "target": f"O:{o}", "resharded": False}
            if sp is not None and so is not None and j < len(so.in_specs):
                i = pnode.outputs.index(t)
                src, dst = sp.out_specs[i], so.in_specs[j]
                if src != dst:
                    priced = _reshard(mesh_cache, plan, stage, tensor, src, dst)
                    if priced is not None and (priced[0] > 0 or priced[1]):
                        edge.update(resharded=True, cost_s=priced[0],
                                    collectives=[[k, str(a), b] for k, a, b in priced[1]],
                                    hover=_edge_hover(tensor, src, dst, priced[0], priced[1], mesh))
                        resharded += 1
            if layout or edge["resharded"]:
                edge["layout"] = layout
                edges.append(edge)
            else:
                hidden += 1
    role_text = ", ".join(f"{r} {n}" for r, n in roles.items())
    more = f" of the first {max_ops}" if len(ops[layer]) > max_ops else ""
    title = (f"{_label(layer)}: {len(members)} operators{more} ({role_text}) on stage {stage}'s {mesh} mesh; "
             f"{len(io)} inputs and outputs of the step folded into their readers and writers; "
             f"{resharded} resharded edge(s); {hidden} forward→backward edges (activations kept) not drawn")
    detail = {"title": title, "nodes": nodes, "edges": edges}
    return detail, spec_colours, {"operators": len(members), "edges": len(edges), "resharded": resharded,
                                  "hidden_edges": hidden}


class GraphView(View):
    """The operator graph: layers (repeats grouped), one layer's operators; colour by stage or sharding; clicks
    select (see the module docstring)."""

    css = "autopar-graph"

    def __init__(self, session, mode: str = "stage", height: int = 440):
        super().__init__(session)
        from .graph_canvas import GraphCanvas

        if mode not in ("stage", "sharding"):
            raise ValueError(f"colour mode must be 'stage' or 'sharding', got {mode!r}")
        self.mode = mode
        self.expanded: str | None = None
        self.open_groups: set[str] = set()
        self.selected_key: str | None = None
        self.width_listeners: list = []  # called with the graph's width in pixels (it spans the notebook)
        self.canvas = GraphCanvas(on_click=self.on_click, on_width=self._on_width, height=height)
        self.canvas.layout = w.Layout(width="100%")
        self.data: dict = {}
        self.mode_buttons = w.ToggleButtons(options=["stage", "sharding"], value=mode, description="colour by",
                                            style={"button_width": "80px"})
        self.mode_buttons.observe(lambda ch: self.set_mode(ch["new"]), names="value")
        self.info = w.HTML("")
        self.redraw()
        self._finish(w.VBox([w.HBox([self.mode_buttons, self.info], layout=w.Layout(flex_flow="row wrap")),
                             self.canvas, self.message], layout=w.Layout(width="100%", min_width="0")))

    @property
    def keys(self) -> list[str]:
        """Every node key drawn: the overview's, then the expanded layer's operators."""
        d = self.data
        return [n["key"] for n in d.get("overview", ())] + [n["key"] for n in (d.get("detail") or {}).get("nodes", ())]

    # --- actions (plain methods: a click calls these) --------------------------------------------------------------
    def on_click(self, key: str) -> None:
        """A node was clicked: ``"G:<layer>"`` opens (or closes) a group of repeated layers; ``"L:<layer>"`` shows
        (or hides) that layer's operators and selects it; ``"O:<op>"`` selects the operator (by its counterpart in
        the plan's graph)."""
        kind, _, rest = key.partition(":")
        if kind == "G":
            self.open_groups ^= {key}
            self.redraw()
        elif kind == "L":
            self.expanded = None if self.expanded == rest else rest
            self.selected_key = key
            if rest in self.session.plan.layer_names:
                self.run("select", lambda: self.session.select(layer=rest))
            self.redraw()
        elif kind == "O":
            full = int(rest)
            sop = self.session.solve_op(full)
            self.selected_key = key
            if sop is None:
                self.info.value = f"operator #{full} has no counterpart in the plan's solve graph"
                self.redraw()
            else:  # the real operator: its own layer and stage, not the stand-in's
                self.run("select", lambda: self.session.select(full_op=full))
        else:
            raise ValueError(f"unknown node key {key!r}")

    def _on_width(self, px: int) -> None:
        for cb in list(self.width_listeners):
            cb(px)

    def set_mode(self, mode: str) -> None:
        if mode not in ("stage", "sharding"):
            raise ValueError(f"colour mode must be 'stage' or 'sharding', got {mode!r}")
        self.mode = mode
        self.redraw()

    def expand(self, layer: str | None) -> None:
        self.expanded = layer
        self.redraw()

    # --- drawing -----------------------------------------------------------------------------------------------------
    def redraw(self) -> None:
        data = graph_data(self.session, self.expanded, self.mode, self.open_groups, self.selected_key)
        s = data["summary"]
        sel = f"selected {self.selected_key}; " if self.selected_key else ""
        self.info.value = (f"<small>{sel}{s['layers']} layers as {s['overview_nodes']} node(s)"
                           + (f"; {s['operators']} operators, {s['resharded']} resharded edge(s)"
                              if s["operators"] else "") + "</small>")
        if data == self.data:
            return  # nothing visible changed (most overrides): no message to the browser
        self.data = data
        self.canvas.data = data

    def on_plan(self, event) -> None:
        self.redraw()

    def on_selection(self, event) -> None:
        sel = event.detail["selection"]
        key = None
        if sel.op is not None:
            layer = sel.layer  # a real layer's name (the session names the real layer, not the copy's)
            if layer is not None and layer in self.session.plan.layer_names:
                self.expanded = layer
                full = sel.full_op if sel.full_op is not None else _inverse(self.session, sel.op, layer)
                key = f"O:{full}" if full is not None else f"L:{layer}"
        elif sel.layer is not None:
            key = f"L:{sel.layer}"
        if key != self.selected_key or sel.op is not None:
            self.selected_key = key
            self.redraw()


def _inverse(session, sop: int, layer: str) -> Any:
    """The full-graph operator of ``layer`` that ``sop`` (or the sibling that stands for it) stands for."""
    if session.op_graph is session.graph:
        return sop
    return session.op_map.full_op_in(sop, list(session.plan.layer_names).index(layer))
