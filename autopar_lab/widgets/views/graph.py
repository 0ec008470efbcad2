"""Operator graph view: one node per layer (a 30k-operator GPT-39B stays two plotly traces), one layer expanded.

Layers sit left to right in forward order; the expanded layer's operators are drawn below them, placed by their
depth inside the layer (longest path from the layer's entry, as networkx's topological generations would give). Nodes
are coloured by stage or by sharding (the operator's output spec; a layer takes its stage's logical mesh). Hover shows
shapes, FLOPs and bytes; a click selects (a layer also expands).

    >>> nodes, edges = graph_data(session, expanded="layer_0", mode="stage")     # doctest: +SKIP
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import ipywidgets as w

from . import figures
from ._base import View, fmt_bytes, fmt_flops

OTHER = "(no layer)"
_LAYER_CACHE: dict[int, tuple] = {}


def layer_summary(graph) -> tuple[list[str], dict, dict, set]:
    """Per layer of ``graph``: names (forward order, plus ``(no layer)`` when some operators have none),
    {layer: [ops]}, {layer: (flops, bytes)}, and the layer-to-layer edges. Cached per graph (graphs are immutable)."""
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
    out = (names, dict(ops), {k: tuple(v) for k, v in stats.items()}, edges)
    if len(_LAYER_CACHE) > 8:
        _LAYER_CACHE.clear()
    _LAYER_CACHE[id(graph)] = (graph, out)
    return out


def _depths(graph, ops: list[int]) -> dict[int, int]:
    """Longest-path depth of each operator inside the set ``ops`` (ids are topological, so one pass)."""
    inside = set(ops)
    depth: dict[int, int] = {}
    for o in ops:
        d = 0
        for t in graph.op(o).inputs:
            p = graph.tensor(t).producer
            if p in inside and p in depth:
                d = max(d, depth[p] + 1)
        depth[o] = d
    return depth


def _layer_stage(plan, names: list[str]) -> dict[str, int]:
    index = {n: k for k, n in enumerate(plan.layer_names)}
    out = {}
    for name in names:
        k = index.get(name, len(plan.layer_names) - 1)
        out[name] = next((s for s, st in enumerate(plan.stages) if st.layers[0] <= k <= st.layers[1]),
                         len(plan.stages) - 1)
    return out


def graph_data(session, expanded: str | None = None, mode: str = "stage", max_ops: int = 2000):
    """The nodes and edges :func:`figures.dag_figure` draws: every layer, plus the operators of ``expanded``
    (at most ``max_ops`` of them). Node keys: ``"L:<layer>"`` and ``"O:<op id in the full graph>"``."""
    if mode not in ("stage", "sharding"):
        raise ValueError(f"colour mode must be 'stage' or 'sharding', got {mode!r}")
    plan, graph = session.plan, session.graph
    names, ops, stats, ledges = layer_summary(graph)
    stage = _layer_stage(plan, names)
    x = {name: float(k) for k, name in enumerate(names)}
    meshes: dict[str, int] = {}
    nodes = []
    for name in names:
        st = plan.stages[stage[name]]
        mesh = f"{st.logical_mesh[0]}x{st.logical_mesh[1]}"
        c = figures.colour(stage[name]) if mode == "stage" else figures.colour(meshes.setdefault(mesh, len(meshes)))
        fl, by = stats[name]
        nodes.append({"key": f"L:{name}", "x": x[name], "y": 0.0, "label": name, "colour": c, "size": 18,
                      "hover": f"<b>{name}</b>: {len(ops[name])} operators, {fmt_flops(fl)}, {fmt_bytes(by)} accessed"
                               f"<br>stage {stage[name]} on {st.submesh[0]}x{st.submesh[1]} as {mesh}"})
    edges = [(x[a], 0.0, x[b], 0.0) for a, b in ledges]
    if expanded is not None and expanded in ops:
        members = ops[expanded][:max_ops]
        depth = _depths(graph, members)
        width = max(len(names) - 1, 1)
        dmax = max(depth.values(), default=0) or 1
        rows: dict[int, int] = defaultdict(int)
        pos = {}
        for o in members:
            d = depth[o]
            pos[o] = (width * d / dmax, -1.0 - 0.25 * rows[d])
            rows[d] += 1
        specs: dict[str, int] = {}
        for o in members:
            n = graph.op(o)
            sop = session.solve_op(o)
            strat = None
            if sop is not None:
                try:
                    strat = plan.choice(sop)
                except KeyError:
                    strat = None
            spec = str(strat.out_specs[0]) if strat is not None and strat.out_specs else "?"
            if mode == "stage":
                c = figures.colour(stage[expanded])
            else:
                c = figures.colour(specs.setdefault(spec, len(specs)))
            shapes = ", ".join(f"{d}{list(s)}" for s, d in zip(n.out_shapes, n.out_dtypes))
            hover = (f"<b>#{o} {n.primitive}</b> [{n.role}]<br>in: "
                     + ", ".join(f"{d}{list(s)}" for s, d in zip(n.in_shapes, n.in_dtypes))
                     + f"<br>out: {shapes}<br>{fmt_flops(n.flops)}, {fmt_bytes(n.bytes_accessed)} accessed"
                     + (f"<br>strategy {strat.name}" if strat is not None else ""))
            nodes.append({"key": f"O:{o}", "x": pos[o][0], "y": pos[o][1], "label": "", "colour": c, "size": 8,
                          "hover": hover})
        inside = set(members)
        for o in members:
            for t in graph.op(o).inputs:
                p = graph.tensor(t).producer
                if p in inside:
                    edges.append((pos[p][0], pos[p][1], pos[o][0], pos[o][1]))
        # A thin link from the layer node down to its operators, so the eye finds where they came from.
        edges.append((x[expanded], 0.0, x[expanded], -0.7))
    return nodes, edges


class GraphView(View):
    """The operator graph: layers, one expanded; colour by stage or sharding; click selects."""

    css = "autopar-graph"

    def __init__(self, session, mode: str = "stage"):
        super().__init__(session)
        self.mode = mode
        self.expanded: str | None = None
        self.selected_key: str | None = None
        nodes, edges = graph_data(session, None, mode)
        self._keys = [n["key"] for n in nodes]
        self._drawn = (nodes, edges, None)
        self.figure = self._make_figure(nodes, edges)
        self.mode_buttons = w.ToggleButtons(options=["stage", "sharding"], value=mode, description="colour by",
                                            style={"button_width": "80px"})
        self.mode_buttons.observe(lambda ch: self.set_mode(ch["new"]), names="value")
        self.info = w.HTML("")
        self._finish(w.VBox([w.HBox([self.mode_buttons, self.info]), self.figure, self.message]))

    def _make_figure(self, nodes, edges):
        import plotly.graph_objects as go

        fig = go.FigureWidget(figures.dag_figure(nodes, edges))
        fig.data[1].on_click(self._plotly_click)
        return fig

    def _plotly_click(self, trace, points, state) -> None:
        if points.point_inds:
            self.on_click(self._keys[points.point_inds[0]])

    # --- actions (plain methods: a click calls these) --------------------------------------------------------------
    def on_click(self, key: str) -> None:
        """A node was clicked: ``"L:<layer>"`` expands (or collapses) it and selects it; ``"O:<op>"`` selects the
        operator (by its counterpart in the plan's graph)."""
        kind, _, rest = key.partition(":")
        if kind == "L":
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
            else:
                self.run("select", lambda: self.session.select(op=sop))
        else:
            raise ValueError(f"unknown node key {key!r}")

    def set_mode(self, mode: str) -> None:
        self.mode = mode
        self.redraw()

    def expand(self, layer: str | None) -> None:
        self.expanded = layer
        self.redraw()

    # --- drawing -----------------------------------------------------------------------------------------------------
    def redraw(self) -> None:
        nodes, edges = graph_data(self.session, self.expanded, self.mode)
        self._keys = [n["key"] for n in nodes]
        sel = self.selected_key
        self.info.value = f"selected: {sel}" if sel else f"{len(self._keys)} nodes; click a layer to expand it"
        state = (nodes, edges, sel)
        if state == self._drawn:
            return  # nothing visible changed (most overrides): no figure update to send
        self._drawn = state
        fresh = figures.dag_figure(nodes, edges, selected=self.selected_key)
        with self.figure.batch_update():
            for i in (0, 1):
                tr = self.figure.data[i]
                src = fresh.data[i]
                tr.x, tr.y = src.x, src.y
                if i == 1:
                    tr.text, tr.hovertext, tr.customdata = src.text, src.hovertext, src.customdata
                    tr.marker = src.marker

    def on_plan(self, event) -> None:
        self.redraw()

    def on_selection(self, event) -> None:
        sel = event.detail["selection"]
        key = None
        if sel.op is not None:
            layer = self.session.op_graph.op(sel.op).layer
            if layer is not None and layer in self.session.plan.layer_names:
                self.expanded = layer
                full = _inverse(self.session, sel.op, layer)
                key = f"O:{full}" if full is not None else f"L:{layer}"
        elif sel.layer is not None:
            key = f"L:{sel.layer}"
        if key != self.selected_key or sel.op is not None:
            self.selected_key = key
            self.redraw()


def _inverse(session, sop: int, layer: str) -> Any:
    """The full-graph operator whose counterpart is ``sop``, looked for in ``layer``."""
    if session.op_graph is session.graph:
        return sop
    _, ops, _, _ = layer_summary(session.graph)
    for o in ops.get(layer, ()):
        if session.solve_op(o) == sop:
            return o
    return None
