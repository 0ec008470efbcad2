"""Sharding choices: the operators (filtered by layer, stage, primitive and module) with the module they belong to
(:mod:`autopar_lab.graph.modules`: ``qkv``, ``attn/q_proj``, ``fc1 (weight grad)``), their shapes and their strategy in
Alpa's notation and as a ``PartitionSpec``; for the selected one a dropdown of alternatives with their step-time
deltas, and pin / unpin.

    >>> rows = op_rows(session, primitive="dot_general")          # doctest: +SKIP
    >>> rows[0]["label"], rows[0]["shapes"], rows[0]["alpa"]      # doctest: +SKIP
    ('qkv', '[8,1024,2048]x[2048,6144] -> [8,1024,6144]', 'S0RR')
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as w

from ...graph.modules import module_label, module_labels, modules_present, shapes_text, under
from ...layergroups import group_of_layer, layer_groups, span_text
from ...parallelism import op_notes
from ._base import View
from .fmt import fmt_s, strategy_text
from .notation import GROUP_TIP, STRATEGY_TIP, notation_html

ALL = "(all)"
OUTSIDE = "outside layers"  # the layer filter's choice for operators outside every layer
GROUP, LAYER = "group", "layer"  # what an override applies to: every layer sharing the solution, or one alone


def _spec_texts(strategy) -> tuple[str, str]:
    if strategy is None or not strategy.out_specs:
        return "", ""
    spec = strategy.out_specs[0]
    try:
        ps = str(spec.to_partition_spec())
    except Exception:  # a spec the JAX form cannot say (never for the two-axis meshes used here)
        ps = "?"
    return str(spec), ps


def _scope_rows(plan, group, full_layer: int | None):
    """(key, stand-in, full op or None, stages, shown) for each operator of ``group`` in graph order. A row of a
    whole group is keyed by the stand-in's id (every row of a model solved on its own graph); a row of one real layer
    whose solution other layers share (``full_layer``, one layer of the group shown alone, or a layer split from
    its group) by ``("layer", full_op)``. ``shown``: the model's operator whose module and shapes the row shows (a
    group's: its first layer's)."""
    m = plan.table.op_map if plan.table is not None else None
    if m is None or m.is_identity:
        names = list(plan.layer_names)
        return [(o, o, o, group.stages, o) for o in plan.graph.ops_in_layer(names[group.layers[0]])]
    k = full_layer if full_layer is not None else group.layers[0]
    alone = full_layer is not None or group.split
    out = []
    for full in plan.graph.ops_in_layer(plan.layer_names[k]):
        sop = m.solve_op(full)
        if sop is None:
            continue
        if alone:
            out.append((("layer", full), sop, full, (plan.full_stage_of(full),), full))
        else:
            out.append((sop, sop, full if len(group.layers) == 1 else None, group.stages, full))
    return out


def _outside_rows(plan):
    g = plan.op_graph
    last = len(plan.stages) - 1
    return [(node.id, node.id, None, (plan.stage_of(node.id) if plan.table is not None else last,), None)
            for node in g if node.layer is None]


def module_choices(session) -> list[str]:
    """The modules the filter by module offers: every module of the plan's operators and every module they sit
    under (``attn`` for ``attn/q_proj``)."""
    return modules_present(module_labels(session.op_graph))


def scopes(session) -> list[tuple[str, str]]:
    """The layer filter's choices as (label, value): every group of layers sharing one solution (its label says
    which real layers and stages), then each real layer of a group (to see or change it alone), then the operators
    outside every layer."""
    plan = session.plan
    groups = layer_groups(plan)
    out = [(grp.label, grp.key) for grp in groups]
    out += [(name, name) for grp in groups if len(grp.layers) > 1 for name in grp.names]
    if any(node.layer is None for node in plan.op_graph):
        out.append((OUTSIDE, OUTSIDE))
    return out


def op_rows(session, layer: str | None = None, stage: int | None = None, primitive: str | None = None,
            limit: int | None = None, module: str | None = None) -> list[dict]:
    """One dict per row of the table passing the filters. ``layer``: a group's key (``"layer_0.."``), a real layer's
    name, or :data:`OUTSIDE`; None: every group. ``module``: only the operators of that module or of modules under
    it (``"attn"`` keeps ``attn/q_proj`` and ``attn/scores``; the backward's and the optimizer's operators of a module
    are its too). A row of a group of layers sharing one solution stands for its operator in every one of them
    (``key``: the stand-in's id); a row of one real layer of a deep model for that layer's own operator (``key``:
    ``("layer", full_op)``).

    Each row: key, op (the stand-in in the graph the plan was solved on), full_op (the model's operator, None for a
    group's row), primitive, role, layer (the group's or layer's name), stages and stage (the first of them; a
    group spanning stages lists each), stage_text, strategy (its full Alpa name, on the first stage), alpa (output
    spec; per stage where they differ), partition_spec, pinned, group (the ILP group that solved its layer), note
    (ZeRO-3/FSDP, sequence or context parallelism it takes part in: :func:`autopar_lab.parallelism.op_notes`),
    module, label and module_path (:class:`autopar_lab.graph.modules.ModuleLabel`: ``"fc1"``, ``"fc1 (weight
    grad)"``, the parameter path or name scope it was read from; of the model's operator in the row's layer, a
    group's first layer), shapes (``"[8,1024,2048]x[2048,6144] -> [8,1024,6144]"``) and dtype (its result's)."""
    plan = session.plan
    groups = layer_groups(plan)
    pins = plan.pins
    m = session.op_map
    picked: list[tuple] = []
    if layer is None:
        for grp in groups:
            picked.append((grp, _scope_rows(plan, grp, None)))
        picked.append((None, _outside_rows(plan)))
    elif layer == OUTSIDE:
        picked.append((None, _outside_rows(plan)))
    else:
        grp = next((x for x in groups if x.key == layer), None)
        if grp is not None:
            picked.append((grp, _scope_rows(plan, grp, None)))
        else:
            grp = group_of_layer(plan, layer)
            k = list(plan.layer_names).index(layer)
            picked.append((grp, _scope_rows(plan, grp, k if len(grp.layers) > 1 else None)))
    ilp = _groups(plan)
    g = plan.op_graph
    notes = op_notes(plan)
    out = []
    for grp, items in picked:
        for key, sop, full, stages, shown in items:
            node = g.op(sop)
            if primitive is not None and node.primitive != primitive:
                continue
            if stage is not None and stage not in stages:
                continue
            where, at = (plan.graph, shown) if shown is not None else (g, sop)
            lab = module_label(where, at)
            if module is not None and not under(lab.module, module):
                continue
            if isinstance(key, tuple):
                strats = [plan.full_choice(full)]
                # Pinned in its layer, or (a layer still sharing its group's solution) by the group's pin.
                pinned = full in plan.layer_pins or (grp is not None and not grp.split and
                                                     any(o in pins for o in m.siblings(sop)))
            else:
                strats = [plan.stages[k].intra.strategies.get(sop) if plan.stages[k].intra is not None else None
                          for k in stages]
                pinned = any(o in pins for o in m.siblings(sop))
            texts = [_spec_texts(s) for s in strats]
            alpa = texts[0][0] if len({t[0] for t in texts}) == 1 else \
                " | ".join(f"S{k}: {t[0]}" for k, t in zip(stages, texts))
            name = (grp.names[0] if isinstance(key, tuple) or len(grp.layers) == 1 else
                    f"{span_text(grp.names)} ×{len(grp.layers)}") if grp is not None else None
            if isinstance(key, tuple):
                name = plan.graph.op(full).layer
            out.append({"key": key, "op": sop, "full_op": full, "primitive": node.primitive, "layer": name,
                        "role": node.role, "stage": stages[0], "stages": list(stages),
                        "stage_text": "+".join(f"S{k}" for k in stages),
                        "strategy": strats[0].name if strats[0] is not None else "", "alpa": alpa,
                        "partition_spec": texts[0][1], "pinned": pinned,
                        "group": ilp.get((stages[0], node.layer), ""), "note": notes.get(sop, ""),
                        "module": lab.module, "label": lab.label, "module_path": lab.path,
                        "shapes": shapes_text(where.op(at)), "dtype": ",".join(where.op(at).out_dtypes)})
            if limit is not None and len(out) >= limit:
                return out
    return out


def _groups(plan) -> dict:
    """(stage, layer) -> how the ILP solved that layer: "solved", "reused from layer_0", "+N merged"."""
    out = {}
    for k, st in enumerate(plan.stages):
        if st.intra is None:
            continue
        for gs in st.intra.groups:
            text = f"reused from {gs.reused_from}" if gs.reused_from else gs.status
            if gs.merges:
                text += f", {gs.merges} merged"
            for name in gs.name.split("+"):
                out[(k, None if name == "(no layer)" else name)] = f"{gs.name}: {text}"
    return out


#: The table's columns: (title, width); a width of 0 is the widest entry's (:func:`column_widths`). What tells the
#: rows apart (module, layer, stage, spec) comes first: the list scrolls sideways for the rest in a narrow column.
COLUMNS = (("pin #op", 7), ("module", 0), ("layer", 10), ("stage", 5), ("spec", 8), ("shapes", 0),
           ("PartitionSpec", 0), ("primitive", 0), ("module path", 0))


def _cells(r: dict) -> list[str]:
    pin = "*" if r["pinned"] else " "
    op = r.get("full_op") if isinstance(r.get("key"), tuple) else r["op"]
    note = f"  ({r['note']})" if r.get("note") else ""  # ZeRO-3/FSDP, sequence or context parallelism
    return [f"{pin}#{op}", r.get("label") or "—", r["layer"] if r["layer"] is not None else "—",
            r.get("stage_text", f"S{r['stage']}"), r["alpa"], r.get("shapes", ""), r["partition_spec"],
            r["primitive"], r.get("module_path", "") + note]


def column_widths(rows: list[dict]) -> list[int]:
    """Each column's width for ``rows``: its fixed width, or the widest entry's (and the title's)."""
    cells = [_cells(r) for r in rows]
    return [w or max([len(title)] + [len(c[k]) for c in cells]) for k, (title, w) in enumerate(COLUMNS)]


def row_label(r: dict, widths: list[int] | None = None) -> str:
    """One row of the table in fixed columns (``widths``: :func:`column_widths` of the rows shown together; by
    default each entry's own width); nothing is cut short (a long name widens its column)."""
    cells = _cells(r)
    widths = widths or [w or len(c) for (_, w), c in zip(COLUMNS, cells)]
    return " ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def header_label(widths: list[int]) -> str:
    """The column titles over rows laid out with ``widths``."""
    return " ".join(title.ljust(w) for (title, _), w in zip(COLUMNS, widths)).rstrip()


def delta_text(delta_s: float) -> str:
    """An alternative's step-time change: ``+1.2 ms``, ``-300 µs``, or ``no change``."""
    if delta_s == 0:
        return "no change"
    return f"{'+' if delta_s > 0 else '-'}{fmt_s(abs(delta_s))}"


class ShardingTable(View):
    """The operator table with filters, the selected row's alternatives, what an override applies to, and pin /
    unpin.

    On a deep model solved on a shallower copy the rows are the model's real layers: a group of layers that share one
    solution is one set of rows ("layer_0..23 ×24"), and the layer filter also offers each real layer alone.
    An override of a group's row applies to every layer of the group, on every stage that runs one; on a real
    layer's row, "apply to" chooses between the whole group (the default) and that layer alone (it is split from
    the group, :meth:`Session.set_layer_choice`). Rows are rebuilt after every plan change."""

    css = "autopar-sharding-table"

    def __init__(self, session, max_rows: int = 400):
        super().__init__(session)
        self.max_rows = max_rows
        plan, g = session.plan, session.op_graph
        prims = sorted({n.primitive for n in g})
        self._layer_options = [(ALL, ALL)] + scopes(session)
        self.layer_filter = w.Dropdown(options=self._layer_options, value=ALL, description="layer")
        self.stage_filter = w.Dropdown(options=[ALL] + [str(k) for k in range(len(plan.stages))], value=ALL,
                                       description="stage")
        self.primitive_filter = w.Dropdown(options=[ALL] + prims,
                                           value="dot_general" if "dot_general" in prims else ALL,
                                           description="primitive")
        # a text box offering the modules present: "attn" keeps every module under it, "fc1" fc1 and its gradients
        self.module_filter = w.Combobox(options=module_choices(session), value="", placeholder="all modules",
                                        description="module", ensure_option=False, continuous_update=False)
        self.module_filter.add_class("autopar-module-filter")
        for f in (self.layer_filter, self.stage_filter, self.primitive_filter, self.module_filter):
            f.layout.width = "220px"
            f.observe(lambda ch: self.refresh_rows(), names="value")
        self.layer_filter.layout.width = "340px"  # group labels name their layers and stages
        self.rows_select = w.Select(options=[], rows=12, layout=w.Layout(width="auto"))  # stretches, margins inside
        self.rows_select.add_class("autopar-op-rows")
        self.header = w.HTML("")
        self.header.add_class("autopar-op-header")
        # The column titles and the rows scroll sideways together, inside the view (a row is wider than a column).
        self.listing = w.VBox([self.header, self.rows_select], layout=w.Layout(overflow_x="auto", min_width="0"))
        self.listing.add_class("autopar-op-listing")
        self.rows_select.observe(self._select_changed, names="value")
        self.count = w.HTML("")
        self.detail = w.HTML("")
        self.detail.add_class("autopar-op-detail")
        self.scope = w.ToggleButtons(options=[("every layer sharing it", GROUP), ("this layer alone", LAYER)],
                                     value=GROUP, description="apply to", style={"button_width": "auto"})
        self.scope.add_class("autopar-override-scope")
        self.scope.layout.display = "none"
        self.scope.observe(self._scope_changed, names="value")
        self.alternatives = w.Dropdown(options=[], description="strategy", layout=w.Layout(width="auto"),
                                       tooltip=STRATEGY_TIP)
        self.alternatives.add_class("autopar-strategy-choice")
        self.alternatives.observe(self._alternative_changed, names="value")
        self.pin_button = w.Button(description="pin", tooltip="keep this operator's strategy through re-solves",
                                   layout=w.Layout(width="auto"))
        self.unpin_button = w.Button(description="unpin", tooltip="let re-solves change this operator again",
                                     layout=w.Layout(width="auto"))
        self.pin_button.on_click(lambda _: self.pin())
        self.unpin_button.on_click(lambda _: self.unpin())
        self._quiet = False
        self.rows: list[dict] = []
        self.op: int | None = None  # the selected row's operator in the graph the plan was solved on
        self.key: Any = None  # the selected row's key (see op_rows)
        self._alts: list = []
        self.notation = w.HTML(notation_html())  # how to read a strategy's name and an ILP group
        self.refresh_rows()
        self._finish(w.VBox([w.HBox([self.layer_filter, self.stage_filter, self.primitive_filter, self.module_filter],
                                    layout=w.Layout(flex_flow="row wrap")), self.count, self.listing, self.detail,
                             self.scope, self.alternatives, w.HBox([self.pin_button, self.unpin_button]),
                             self.notation, self.message]))

    # --- data --------------------------------------------------------------------------------------------------------
    def filters(self) -> dict:
        return {"layer": None if self.layer_filter.value == ALL else self.layer_filter.value,
                "stage": None if self.stage_filter.value == ALL else int(self.stage_filter.value),
                "primitive": None if self.primitive_filter.value == ALL else self.primitive_filter.value,
                "module": self.module_filter.value.strip() or None}

    def set_filters(self, layer: Any = ALL, stage: Any = ALL, primitive: Any = ALL, module: Any = ALL) -> None:
        """Set the four filters at once (``None`` or ``"(all)"``: no filter) and refresh the rows once. ``layer``:
        a group's key, a real layer's name, or :data:`OUTSIDE`; ``module``: a module (``"fc1"``) or one that others
        sit under (``"attn"``)."""
        self._quiet = True
        try:
            self.layer_filter.value = ALL if layer is None else layer
            self.stage_filter.value = ALL if stage is None else str(stage)
            self.primitive_filter.value = ALL if primitive is None else primitive
            self.module_filter.value = "" if module in (None, ALL) else str(module)
        finally:
            self._quiet = False
        self.refresh_rows()

    def _sync_options(self) -> None:
        """The stage, layer and module filters' choices for the current plan (stages and groups change with it; a
        what-if re-plan may bring another graph)."""
        n = len(self.session.plan.stages)
        self._quiet = True
        try:
            if len(self.stage_filter.options) != n + 1:
                self.stage_filter.options = [ALL] + [str(k) for k in range(n)]
                self.stage_filter.value = ALL
            layers = [(ALL, ALL)] + scopes(self.session)
            if layers != self._layer_options:
                value = self.layer_filter.value
                self._layer_options = layers
                self.layer_filter.options = layers
                self.layer_filter.value = value if value in [v for _, v in layers] else ALL
            modules = module_choices(self.session)
            if list(self.module_filter.options) != modules:
                self.module_filter.options = modules
        finally:
            self._quiet = False

    def refresh_rows(self) -> None:
        if self._quiet:
            return
        self._sync_options()
        self.rows = op_rows(self.session, limit=self.max_rows, **self.filters())
        widths = column_widths(self.rows)
        self.header.value = f"<pre>{html.escape(header_label(widths))}</pre>"  # styled as the rows (workbench CSS)
        self._quiet = True
        try:
            self.rows_select.options = [(row_label(r, widths), r["key"]) for r in self.rows]
            self.rows_select.value = self.key if any(r["key"] == self.key for r in self.rows) else None
        finally:
            self._quiet = False
        more = " (first rows only; narrow the filters)" if len(self.rows) >= self.max_rows else ""
        module = self.filters()["module"]
        none = (f"; no operator of module {module!r} here (the box lists the modules present)"
                if module and not self.rows else "")
        self.count.value = html.escape(f"{len(self.rows)} operator(s){more}; * = pinned{none}")

    def row(self, key) -> dict | None:
        """The table row of ``key`` (an operator id, or ``("layer", full_op)``; None when the filters hide it)."""
        return next((r for r in self.rows if r["key"] == key), None)

    # --- what the selected row is -------------------------------------------------------------------------------------
    def _target(self) -> tuple[str, int] | None:
        """("group", stand-in) or ("layer", full-graph operator): what an override of the selected row changes."""
        if self.key is None:
            return None
        if isinstance(self.key, tuple) and self.scope.value == LAYER:
            return LAYER, self.key[1]
        return GROUP, self.op

    def _current(self):
        target = self._target()
        plan = self.session.plan
        if target is None:
            return None
        return plan.full_choice(target[1]) if target[0] == LAYER else plan.choice(target[1])

    # --- actions (plain methods) --------------------------------------------------------------------------------------
    def select(self, key) -> None:
        """A row was clicked: select its operator (every view follows)."""
        if isinstance(key, tuple):
            self.run("select", lambda: self.session.select(full_op=key[1]))
        else:
            self.run("select", lambda: self.session.select(op=key))

    def choose(self, strategy: str) -> None:
        """An alternative was picked in the dropdown: override the selected row's operator (in every layer sharing
        its solution, or in its layer alone, as "apply to" says) and pin it."""
        target = self._target()
        if target is None:
            self.message.value = "select an operator first"
            return
        if strategy == self._current().name and (target[0] == GROUP or target[1] in self.session.plan.layer_pins):
            return
        kind, op = target
        if kind == LAYER:
            self.run("set_layer_choice", lambda: self.session.set_layer_choice(op, strategy))
        else:
            self.run("set_choice", lambda: self.session.set_choice(op, strategy))

    def pin(self) -> None:
        target = self._target()
        if target is None:
            return
        kind, op = target
        name = self._current().name
        if kind == LAYER:
            self.run("pin", lambda: self.session.set_layer_choice(op, name))
        else:
            self.run("pin", lambda: self.session.pin(op, name))

    def unpin(self) -> None:
        target = self._target()
        if target is None:
            return
        kind, op = target
        if kind == LAYER:
            self.run("unpin", lambda: self.session.unpin_layer(op))
        else:
            rep = self.session.op_map.representative(op)
            self.run("unpin", lambda: self.session.unpin(rep if rep in self.session.plan.pins else op))

    def _select_changed(self, change) -> None:
        if not self._quiet and change["new"] is not None:
            self.select(change["new"])

    def _alternative_changed(self, change) -> None:
        if not self._quiet and change["new"] is not None:
            self.choose(change["new"])

    def _scope_changed(self, change) -> None:
        if not self._quiet:
            self._show()

    # --- drawing -----------------------------------------------------------------------------------------------------
    def show_op(self, op: int | None, key: Any = None) -> None:
        """Fill the detail pane and the alternatives dropdown for the row ``key`` (default: ``op``'s group row;
        prices every alternative)."""
        self.op = op
        self.key = (key if key is not None else op) if op is not None else None
        self._quiet = True
        try:
            plan = self.session.plan
            if isinstance(self.key, tuple):
                layer = plan.graph.op(self.key[1]).layer
                grp = group_of_layer(plan, layer)
                self.scope.options = [("the other layers sharing its solution" if grp.split else
                                       f"all {grp.shared} layers sharing its solution", GROUP),
                                      (f"{layer} alone", LAYER)]
                self.scope.value = LAYER if grp.split else GROUP
                self.scope.layout.display = None
            else:
                self.scope.layout.display = "none"
                self.scope.value = GROUP
        finally:
            self._quiet = False
        self._show()

    def _show(self) -> None:
        self._quiet = True
        try:
            if self.key is None:
                self.detail.value = ""
                self.alternatives.options = []
                return
            self.detail.value = detail_html(self.session, self.key, self.scope.value)
            cur = self._current()
            kind, op = self._target()
            self._alts = (self.session.layer_alternatives(op) if kind == LAYER else self.session.alternatives(op))
            opts = [(f"{a.strategy}  ({delta_text(a.delta_s)})", a.strategy) for a in self._alts]
            if cur.name not in [a.strategy for a in self._alts]:
                opts.insert(0, (f"{cur.name} (current)", cur.name))
            self.alternatives.options = opts
            self.alternatives.value = cur.name
            if any(r["key"] == self.key for r in self.rows):
                self.rows_select.value = self.key
        finally:
            self._quiet = False

    def on_plan(self, event) -> None:
        self.refresh_rows()
        sel = self.session.selection
        key = self._key_of(sel)
        if key is not None and self.row(key) is None:
            self._reveal(sel, key)
        self.show_op(sel.op, key)

    def _key_of(self, sel):
        """The row key of a selection: one real layer's row when a real operator of a shared layer was picked."""
        if sel.op is None:
            return None
        plan = self.session.plan
        if sel.full_op is not None and plan.table is not None and not plan.table.op_map.is_identity:
            m = plan.table.op_map
            if len(m.sharing(m.full_layer_of(sel.full_op))) > 1 and plan.graph.op(sel.full_op).layer is not None:
                return ("layer", sel.full_op)
        return sel.op

    def _reveal(self, sel, key) -> None:
        """Set the filters so that the row of ``key`` is listed."""
        node = self.session.op_graph.op(sel.op)
        if isinstance(key, tuple):
            layer = self.session.graph.op(key[1]).layer
        elif node.layer is None:
            layer = OUTSIDE
        else:
            layer = group_of_layer(self.session.plan, sel.layer).key if sel.layer is not None else None
        self.set_filters(layer=layer, primitive=node.primitive)

    def on_selection(self, event) -> None:
        sel = event.detail["selection"]
        if sel.op is None and sel.layer is not None and self.layer_filter.value != sel.layer \
                and sel.layer in [v for _, v in self._layer_options]:
            self.layer_filter.value = sel.layer  # a real layer (a group's member is offered alone too)
        key = self._key_of(sel)
        if key is not None and self.row(key) is None:
            self._reveal(sel, key)
        self.show_op(sel.op, key)


def _shown(session, key) -> tuple:
    """(graph, operator) whose module and shapes row ``key`` shows: the model's operator (a group's, in its first
    layer), else the plan's own."""
    if isinstance(key, tuple):
        return session.plan.graph, key[1]
    full = session.op_map.full_ops(key)
    return (session.plan.graph, full[0]) if full else (session.op_graph, key)


def detail_html(session, key, scope: str = GROUP) -> str:
    """The detail pane of row ``key``: the operator, its strategy in words and its output spec on the mesh of the
    stage that runs it (each stage, for a group spanning stages), whether it is pinned, the module it belongs to and
    how that was found, its shapes, and which layers its solution stands for."""
    plan = session.plan
    if isinstance(key, tuple):
        full = key[1]
        node = plan.graph.op(full)
        k = plan.full_stage_of(full)
        cur = plan.full_choice(full)
        grp = group_of_layer(plan, node.layer)
        mine = full in plan.layer_pins
        stages = [(k, cur)]
        where = (f"in {html.escape(node.layer)}, split from the layers sharing its solution: its own strategies"
                 if grp.split else f"in {html.escape(node.layer)}, one of {grp.shared} layers sharing one solution "
                 f"({html.escape(span_text(grp.names))})")
        sop = session.solve_op(full)
        pinned = "pinned in its layer" if mine else (
            "pinned for its group" if any(o in plan.pins for o in session.op_map.siblings(sop)) else "not pinned")
        what = "#" + str(full) + " " + node.primitive
    else:
        op = key
        node = session.op_graph.op(op)
        layers = session.op_map.full_layers_of(op) if node.layer is not None else []
        grp = group_of_layer(plan, layers[0]) if layers else None
        stages = [(k, plan.stages[k].intra.strategies[op]) for k in plan.stages_of(op)]
        cur = stages[0][1]
        pinned = "pinned" if any(o in plan.pins for o in session.op_map.siblings(op)) else "not pinned"
        where = ""
        if grp is not None and len(grp.layers) > 1:
            where = f"in each of {html.escape(grp.label)}"
        elif grp is not None:
            where = f"in {html.escape(grp.names[0])}"
        what = node.describe()
    specs = "; ".join(f"output <code>{html.escape(_spec_texts(s)[1])}</code> on stage {k}'s "
                      f"{plan.stages[k].logical_mesh[0]}x{plan.stages[k].logical_mesh[1]} mesh" for k, s in stages)
    text = (f"<b>{html.escape(what)}</b> {where}<br>strategy <code>{html.escape(cur.name)}</code>: "
            f"{html.escape(strategy_text(cur.name))}; {specs}; {pinned}")
    seen_graph, seen = _shown(session, key)
    lab = module_label(seen_graph, seen)
    if lab.module:
        text += f"<br>module <b>{html.escape(lab.label)}</b>, from {html.escape(lab.explain())}"
    text += f"<br>shapes <code>{html.escape(shapes_text(seen_graph.op(seen)))}</code>"
    if isinstance(key, tuple):
        text += ("<br>an override applies to " + ("this layer alone" if scope == LAYER else
                                                  "every layer sharing its solution"))
    sop = session.solve_op(key[1]) if isinstance(key, tuple) else key
    group = _groups(plan).get((stages[0][0], session.op_graph.op(sop).layer), "")
    if group and session.op_graph is not plan.graph:  # its name is a layer of the copy, not of the model
        group = f"{group} (in the {len(session.op_graph.layers)}-layer copy the planner solved)"
    tip = html.escape(GROUP_TIP, quote=True)
    return text + (f"<br><span title=\"{tip}\">ILP group</span> {html.escape(group)}" if group else "")
