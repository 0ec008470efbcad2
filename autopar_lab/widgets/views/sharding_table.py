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
from ...operators import ilp_group, layer_operators, shared_choices, shares_solution
from ...planvalues import LAYER, SHARED
from ...parallelism import op_notes
from ._base import View
from .fmt import fmt_s, strategy_text
from .notation import GROUP_TIP, STRATEGY_TIP, notation_html

ALL = "(all)"
OUTSIDE = "outside layers"  # the layer filter's choice for operators outside every layer


def _spec_texts(strategy) -> tuple[str, str]:
    if strategy is None or not strategy.out_specs:
        return "", ""
    spec = strategy.out_specs[0]
    try:
        ps = str(spec.to_partition_spec())
    except Exception:  # a spec the JAX form cannot say (never for the two-axis meshes used here)
        ps = "?"
    return str(spec), ps


def _scope_rows(plan, group, layer: int | None):
    """(operator, stages, alone) for each operator of ``group`` that has a strategy, in graph order: those of the
    group's first layer, or of real layer ``layer`` of it. ``alone``: the row is of one layer among several that share
    its solution (a layer of the group shown alone, or a layer split from it), so an override may apply to it alone."""
    k = group.layers[0] if layer is None else layer
    alone = layer is not None or group.split
    return [(op, (plan.stage_of(op),) if alone else group.stages, alone) for op in layer_operators(plan, k)]


def _outside_rows(plan):
    return [(op, (plan.stage_of(op),), False) for op in layer_operators(plan, None)]


def module_choices(session) -> list[str]:
    """The modules the filter by module offers: every module of the plan's operators and every module they sit
    under (``attn`` for ``attn/q_proj``)."""
    return modules_present(module_labels(session.plan.op_graph))  # the same modules as the model's, fewer operators


def scopes(session) -> list[tuple[str, str]]:
    """The layer filter's choices as (label, value): every group of layers sharing one solution (its label says
    which real layers and stages), then each real layer of a group (to see or change it alone), then the operators
    outside every layer."""
    plan = session.plan
    groups = layer_groups(plan)
    out = [(grp.label, grp.key) for grp in groups]
    out += [(name, name) for grp in groups if len(grp.layers) > 1 for name in grp.names]
    if layer_operators(plan, None):
        out.append((OUTSIDE, OUTSIDE))
    return out


def op_rows(session, layer: str | None = None, stage: int | None = None, primitive: str | None = None,
            limit: int | None = None, module: str | None = None) -> list[dict]:
    """One dict per row of the table passing the filters. ``layer``: a group's key (``"layer_0.."``), a real layer's
    name, or :data:`OUTSIDE`; None: every group. ``module``: only the operators of that module or of modules under
    it (``"attn"`` keeps ``attn/q_proj`` and ``attn/scores``; the backward's and the optimizer's operators of a module
    are its too). A row of a group of layers sharing one solution is its operator in the group's first layer and
    stands for it in every one of them; a row of one real layer among several sharing a solution (``alone``) is that
    layer's own operator. Every row is keyed by its operator of the plan's graph.

    Each row: key and op (the operator), alone, primitive, role, layer (the group's or layer's name), stages and stage
    (the first of them; a group spanning stages lists each), stage_text, strategy (its full Alpa name, on the first
    stage), alpa (output spec; per stage where they differ), partition_spec, pinned, group (the ILP group that solved
    its layer), note (ZeRO-3/FSDP, sequence or context parallelism it takes part in:
    :func:`autopar_lab.parallelism.op_notes`), module, label and module_path
    (:class:`autopar_lab.graph.modules.ModuleLabel`: ``"fc1"``, ``"fc1 (weight grad)"``, the parameter path or name
    scope it was read from), shapes (``"[8,1024,2048]x[2048,6144] -> [8,1024,6144]"``) and dtype (its result's)."""
    plan = session.plan
    groups = layer_groups(plan)
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
    g = plan.graph
    notes = op_notes(plan)
    out = []
    for grp, items in picked:
        for op, stages, alone in items:
            node = g.op(op)
            if primitive is not None and node.primitive != primitive:
                continue
            if stage is not None and stage not in stages:
                continue
            lab = module_label(g, op)
            if module is not None and not under(lab.module, module):
                continue
            if alone:
                strats = [plan.choice(op)]
            else:
                shared = dict(shared_choices(plan, op))
                strats = [shared.get(k) for k in stages]
            texts = [_spec_texts(s) for s in strats]
            alpa = texts[0][0] if len({t[0] for t in texts}) == 1 else \
                " | ".join(f"S{k}: {t[0]}" for k, t in zip(stages, texts))
            if alone:
                name = node.layer
            elif grp is not None:
                name = grp.names[0] if len(grp.layers) == 1 else f"{span_text(grp.names)} ×{len(grp.layers)}"
            else:
                name = None
            out.append({"key": op, "op": op, "alone": alone, "primitive": node.primitive, "layer": name,
                        "role": node.role, "stage": stages[0], "stages": list(stages),
                        "stage_text": "+".join(f"S{k}" for k in stages),
                        "strategy": strats[0].name if strats[0] is not None else "", "alpa": alpa,
                        "partition_spec": texts[0][1], "pinned": plan.pin_of(op) is not None,
                        "group": ilp_group(plan, op, stages[0]), "note": notes.get(op, ""),
                        "module": lab.module, "label": lab.label, "module_path": lab.path,
                        "shapes": shapes_text(node), "dtype": ",".join(node.out_dtypes)})
            if limit is not None and len(out) >= limit:
                return out
    return out


#: The table's columns: (title, width); a width of 0 is the widest entry's (:func:`column_widths`). What tells the
#: rows apart (module, layer, stage, spec) comes first: the list scrolls sideways for the rest in a narrow column.
COLUMNS = (("pin #op", 7), ("module", 0), ("layer", 10), ("stage", 5), ("spec", 8), ("shapes", 0),
           ("PartitionSpec", 0), ("primitive", 0), ("module path", 0))


def _cells(r: dict) -> list[str]:
    pin = "*" if r["pinned"] else " "
    op = r["op"]
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
    the group: :meth:`Session.set_choice` with ``scope="layer"``). Rows are rebuilt after every plan change."""

    css = "autopar-sharding-table"

    def __init__(self, session, max_rows: int = 400):
        super().__init__(session)
        self.max_rows = max_rows
        plan, g = session.plan, session.plan.op_graph
        prims = sorted({n.primitive for n in g})  # (of the graph solved on: the same primitives, fewer operators)
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
        # what an override applies to (its scope): every layer sharing the solution, or one alone
        self.scope = w.ToggleButtons(options=[("every layer sharing it", SHARED), ("this layer alone", LAYER)],
                                     value=SHARED, description="apply to", style={"button_width": "auto"})
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
        self.op: int | None = None  # the selected row's operator
        self.key: Any = None  # the selected row's key (see op_rows: its operator)
        self.alone = False  # the selected row is of one layer among several that share its solution
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
        """The table row of ``key`` (an operator id; None when the filters hide it)."""
        return next((r for r in self.rows if r["key"] == key), None)

    # --- what the selected row is -------------------------------------------------------------------------------------
    def _target(self) -> tuple[str, int] | None:
        """(scope, operator): what an override of the selected row changes (a row of one layer among several sharing
        its solution: as "apply to" says; any other row: its solution, "shared")."""
        if self.key is None:
            return None
        return (self.scope.value if self.alone else SHARED), self.key

    def _current(self):
        target = self._target()
        if target is None:
            return None
        scope, op = target
        plan = self.session.plan
        return plan.choice(op) if scope == LAYER else shared_choices(plan, op)[0][1]

    # --- actions (plain methods) --------------------------------------------------------------------------------------
    def select(self, key) -> None:
        """A row was clicked: select its operator (every view follows)."""
        self.run("select", lambda: self.session.select(op=key))

    def choose(self, strategy: str) -> None:
        """An alternative was picked in the dropdown: override the selected row's operator (in every layer sharing
        its solution, or in its layer alone, as "apply to" says) and pin it."""
        target = self._target()
        if target is None:
            self.message.value = "select an operator first"
            return
        scope, op = target
        own = self.session.plan.pins.get(op)
        if strategy == self._current().name and (scope == SHARED or (own is not None and own.scope == LAYER)):
            return
        self.run("set_choice", lambda: self.session.set_choice(op, strategy, scope))

    def pin(self) -> None:
        target = self._target()
        if target is None:
            return
        scope, op = target
        name = self._current().name
        self.run("pin", lambda: self.session.pin(op, name, scope))

    def unpin(self) -> None:
        target = self._target()
        if target is None:
            return
        scope, op = target
        self.run("unpin", lambda: self.session.unpin(op, scope))

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
    def show_op(self, op: int | None) -> None:
        """Fill the detail pane and the alternatives dropdown for operator ``op``'s row (prices every
        alternative)."""
        self.op = self.key = op
        self._quiet = True
        try:
            plan = self.session.plan
            row = self.row(op) if op is not None else None
            self.alone = op is not None and (row["alone"] if row is not None else shares_solution(plan, op))
            if self.alone:
                layer = plan.graph.op(op).layer
                grp = group_of_layer(plan, layer)
                self.scope.options = [("the other layers sharing its solution" if grp.split else
                                       f"all {grp.shared} layers sharing its solution", SHARED),
                                      (f"{layer} alone", LAYER)]
                self.scope.value = LAYER if grp.split else SHARED
                self.scope.layout.display = None
            else:
                self.scope.layout.display = "none"
                self.scope.value = SHARED
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
            scope, op = self._target()
            self.detail.value = detail_html(self.session, op, scope, self.alone)
            cur = self._current()
            self._alts = self.session.alternatives(op, scope)
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
        op = self.session.selection.op
        if op is not None and self.row(op) is None:
            self._reveal(op)
        self.show_op(op)

    def _reveal(self, op: int) -> None:
        """Set the filters so that operator ``op``'s row is listed: its layer alone when it shares its solution with
        other layers (a group's rows are its first layer's operators), else its group or the operators outside
        layers."""
        plan = self.session.plan
        node = plan.graph.op(op)
        if node.layer is None:
            layer = OUTSIDE
        elif shares_solution(plan, op):
            layer = node.layer
        else:
            layer = group_of_layer(plan, node.layer).key
        self.set_filters(layer=layer, primitive=node.primitive)

    def on_selection(self, event) -> None:
        sel = event.detail["selection"]
        if sel.op is None and sel.layer is not None and self.layer_filter.value != sel.layer \
                and sel.layer in [v for _, v in self._layer_options]:
            self.layer_filter.value = sel.layer  # a real layer (a group's member is offered alone too)
        if sel.op is not None and self.row(sel.op) is None:
            self._reveal(sel.op)
        self.show_op(sel.op)


def detail_html(session, op, scope: str = SHARED, alone: bool = False) -> str:
    """The detail pane of operator ``op``'s row (``alone``: the row of its layer alone, among layers sharing its
    solution): the operator, its strategy in words and its output spec on the mesh of the stage that runs it (each
    stage, for a group spanning stages), whether it is pinned, the module it belongs to and how that was found, its
    shapes, and which layers its solution stands for."""
    plan = session.plan
    node = plan.graph.op(op)
    grp = group_of_layer(plan, node.layer) if node.layer is not None else None
    pin = plan.pin_of(op)
    if alone and grp is not None:
        stages = [(plan.stage_of(op), plan.choice(op))]
        where = (f"in {html.escape(node.layer)}, split from the layers sharing its solution: its own strategies"
                 if grp.split else f"in {html.escape(node.layer)}, one of {grp.shared} layers sharing one solution "
                 f"({html.escape(span_text(grp.names))})")
        pinned = "not pinned" if pin is None else "pinned in its layer" if pin.scope == LAYER else \
            "pinned for its group"
        what = f"#{op} {node.primitive}"
    else:
        stages = shared_choices(plan, op)
        pinned = "pinned" if pin is not None else "not pinned"
        where = ""
        if grp is not None and len(grp.layers) > 1:
            where = f"in each of {html.escape(grp.label)}"
        elif grp is not None:
            where = f"in {html.escape(grp.names[0])}"
        what = node.describe()
    cur = stages[0][1]
    specs = "; ".join(f"output <code>{html.escape(_spec_texts(s)[1])}</code> on stage {k}'s "
                      f"{plan.stages[k].logical_mesh[0]}x{plan.stages[k].logical_mesh[1]} mesh" for k, s in stages)
    text = (f"<b>{html.escape(what)}</b> {where}<br>strategy <code>{html.escape(cur.name)}</code>: "
            f"{html.escape(strategy_text(cur.name))}; {specs}; {pinned}")
    lab = module_label(plan.graph, op)
    if lab.module:
        text += f"<br>module <b>{html.escape(lab.label)}</b>, from {html.escape(lab.explain())}"
    text += f"<br>shapes <code>{html.escape(shapes_text(node))}</code>"
    if alone:
        text += ("<br>an override applies to " + ("this layer alone" if scope == LAYER else
                                                  "every layer sharing its solution"))
    group = ilp_group(plan, op, stages[0][0])
    if group and plan.op_graph is not plan.graph:  # its name is a layer of the copy, not of the model
        group = f"{group} (in the {len(plan.op_graph.layers)}-layer copy the planner solved)"
    tip = html.escape(GROUP_TIP, quote=True)
    return text + (f"<br><span title=\"{tip}\">ILP group</span> {html.escape(group)}" if group else "")
