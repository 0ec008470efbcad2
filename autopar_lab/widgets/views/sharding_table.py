"""Sharding choices: the operators (filtered by layer, stage, primitive) with their strategy in Alpa's notation and as
a ``PartitionSpec``; for the selected one a dropdown of alternatives with their step-time deltas, and pin / unpin.

    >>> rows = op_rows(session, primitive="dot_general")          # doctest: +SKIP
    >>> rows[0]["alpa"], rows[0]["partition_spec"]                # doctest: +SKIP
    ('S0RR', "P('x', None, None)")
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as w

from ._base import View
from .fmt import fmt_s, strategy_text

ALL = "(all)"


def _spec_texts(strategy) -> tuple[str, str]:
    if strategy is None or not strategy.out_specs:
        return "", ""
    spec = strategy.out_specs[0]
    try:
        ps = str(spec.to_partition_spec())
    except Exception:  # a spec the JAX form cannot say (never for the two-axis meshes used here)
        ps = "?"
    return str(spec), ps


def op_rows(session, layer: str | None = None, stage: int | None = None, primitive: str | None = None,
            limit: int | None = None) -> list[dict]:
    """One dict per operator of the plan's graph passing the filters: op, primitive, layer, role, stage, strategy
    (its full Alpa name), alpa (output spec), partition_spec, pinned, group (the ILP group that solved its layer)."""
    plan, g = session.plan, session.op_graph
    pins = plan.pins
    names = list(plan.layer_names)
    stage_of_layer = {}
    for k, st in enumerate(plan.stages):
        for a, b in st.layer_ranges:  # an interleaved stage runs several chunks
            for i in range(a, b + 1):
                stage_of_layer[names[i]] = k
    groups = _groups(plan)
    out = []
    for node in g:
        if layer is not None and node.layer != layer:
            continue
        if primitive is not None and node.primitive != primitive:
            continue
        k = plan.stage_of(node.id) if node.layer not in stage_of_layer else stage_of_layer[node.layer]
        if stage is not None and k != stage:
            continue
        st = plan.stages[k].intra
        strat = st.strategies.get(node.id) if st is not None else None
        alpa, ps = _spec_texts(strat)
        out.append({"op": node.id, "primitive": node.primitive, "layer": node.layer, "role": node.role, "stage": k,
                    "strategy": strat.name if strat is not None else "", "alpa": alpa, "partition_spec": ps,
                    "pinned": node.id in pins, "group": groups.get((k, node.layer), "")})
        if limit is not None and len(out) >= limit:
            break
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


def row_label(r: dict) -> str:
    """One row of the table in fixed columns; nothing is cut short (a long name widens its column)."""
    pin = "*" if r["pinned"] else " "
    layer = r["layer"] if r["layer"] is not None else "—"
    return (f"{pin}#{r['op']:<5} {r['primitive']:<14} {layer:<10} S{r['stage']} "
            f"{r['alpa']:<8} {r['partition_spec']}")


def delta_text(delta_s: float) -> str:
    """An alternative's step-time change: ``+1.2 ms``, ``-300 µs``, or ``no change``."""
    if delta_s == 0:
        return "no change"
    return f"{'+' if delta_s > 0 else '-'}{fmt_s(abs(delta_s))}"


class ShardingTable(View):
    """The operator table with filters, the selected operator's alternatives, and pin / unpin."""

    css = "autopar-sharding-table"

    def __init__(self, session, max_rows: int = 400):
        super().__init__(session)
        self.max_rows = max_rows
        plan, g = session.plan, session.op_graph
        prims = sorted({n.primitive for n in g})
        self.layer_filter = w.Dropdown(options=[ALL] + [n for n in g.layers], value=ALL, description="layer")
        self.stage_filter = w.Dropdown(options=[ALL] + [str(k) for k in range(len(plan.stages))], value=ALL,
                                       description="stage")
        self.primitive_filter = w.Dropdown(options=[ALL] + prims,
                                           value="dot_general" if "dot_general" in prims else ALL,
                                           description="primitive")
        for f in (self.layer_filter, self.stage_filter, self.primitive_filter):
            f.layout.width = "220px"
            f.observe(lambda ch: self.refresh_rows(), names="value")
        self.rows_select = w.Select(options=[], rows=12, layout=w.Layout(width="auto"))  # stretches, margins inside
        self.rows_select.add_class("autopar-op-rows")
        self.rows_select.observe(self._select_changed, names="value")
        self.count = w.HTML("")
        self.detail = w.HTML("")
        self.alternatives = w.Dropdown(options=[], description="strategy", layout=w.Layout(width="auto"))
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
        self.op: int | None = None
        self._alts: list = []
        self.refresh_rows()
        header = w.HTML("<code>pin #op primitive layer stage spec PartitionSpec</code>")
        self._finish(w.VBox([w.HBox([self.layer_filter, self.stage_filter, self.primitive_filter]), self.count, header,
                             self.rows_select, self.detail, self.alternatives,
                             w.HBox([self.pin_button, self.unpin_button]), self.message]))

    # --- data --------------------------------------------------------------------------------------------------------
    def filters(self) -> dict:
        return {"layer": None if self.layer_filter.value == ALL else self.layer_filter.value,
                "stage": None if self.stage_filter.value == ALL else int(self.stage_filter.value),
                "primitive": None if self.primitive_filter.value == ALL else self.primitive_filter.value}

    def set_filters(self, layer: Any = ALL, stage: Any = ALL, primitive: Any = ALL) -> None:
        """Set the three filters at once (``None`` or ``"(all)"``: no filter) and refresh the rows once."""
        self._quiet = True
        try:
            self.layer_filter.value = ALL if layer is None else layer
            self.stage_filter.value = ALL if stage is None else str(stage)
            self.primitive_filter.value = ALL if primitive is None else primitive
        finally:
            self._quiet = False
        self.refresh_rows()

    def refresh_rows(self) -> None:
        if self._quiet:
            return
        n = len(self.session.plan.stages)
        if len(self.stage_filter.options) != n + 1:
            self._quiet = True
            self.stage_filter.options = [ALL] + [str(k) for k in range(n)]
            self.stage_filter.value = ALL
            self._quiet = False
        self.rows = op_rows(self.session, limit=self.max_rows, **self.filters())
        self._quiet = True
        try:
            self.rows_select.options = [(row_label(r), r["op"]) for r in self.rows]
            self.rows_select.value = self.op if any(r["op"] == self.op for r in self.rows) else None
        finally:
            self._quiet = False
        more = " (first rows only; narrow the filters)" if len(self.rows) >= self.max_rows else ""
        self.count.value = f"{len(self.rows)} operator(s){more}; * = pinned"

    def row(self, op: int) -> dict | None:
        """The table row of ``op`` (None when the filters hide it)."""
        return next((r for r in self.rows if r["op"] == op), None)

    # --- actions (plain methods) --------------------------------------------------------------------------------------
    def select(self, op: int) -> None:
        """A row was clicked: select the operator (every view follows)."""
        self.run("select", lambda: self.session.select(op=op))

    def choose(self, strategy: str) -> None:
        """An alternative was picked in the dropdown: override the selected operator's strategy (and pin it)."""
        if self.op is None:
            self.message.value = "select an operator first"
            return
        if strategy == self.session.plan.choice(self.op).name:
            return
        op = self.op
        self.run("set_choice", lambda: self.session.set_choice(op, strategy))

    def pin(self) -> None:
        if self.op is not None:
            op = self.op
            self.run("pin", lambda: self.session.pin(op, self.session.plan.choice(op).name))

    def unpin(self) -> None:
        if self.op is not None:
            op = self.op
            self.run("unpin", lambda: self.session.unpin(op))

    def _select_changed(self, change) -> None:
        if not self._quiet and change["new"] is not None:
            self.select(change["new"])

    def _alternative_changed(self, change) -> None:
        if not self._quiet and change["new"] is not None:
            self.choose(change["new"])

    # --- drawing -----------------------------------------------------------------------------------------------------
    def show_op(self, op: int | None) -> None:
        """Fill the detail pane and the alternatives dropdown for ``op`` (prices every alternative)."""
        self.op = op
        self._quiet = True
        try:
            if op is None:
                self.detail.value = ""
                self.alternatives.options = []
                return
            plan, node = self.session.plan, self.session.op_graph.op(op)
            cur = plan.choice(op)
            _, ps = _spec_texts(cur)
            k = plan.stage_of(op)
            group = _groups(plan).get((k, node.layer), "")
            pinned = "pinned" if op in plan.pins else "not pinned"
            self.detail.value = (
                f"<b>{html.escape(node.describe())}</b><br>strategy <code>{html.escape(cur.name)}</code>: "
                f"{html.escape(strategy_text(cur.name))}; output <code>{html.escape(ps)}</code> on stage {k}'s "
                f"{plan.stages[k].logical_mesh[0]}x{plan.stages[k].logical_mesh[1]} mesh; {pinned}"
                + (f"<br>ILP group {html.escape(group)}" if group else ""))
            self._alts = self.session.alternatives(op)
            opts = [(f"{a.strategy}  ({delta_text(a.delta_s)})", a.strategy) for a in self._alts]
            if cur.name not in [a.strategy for a in self._alts]:
                opts.insert(0, (f"{cur.name} (current)", cur.name))
            self.alternatives.options = opts
            self.alternatives.value = cur.name
            if any(r["op"] == op for r in self.rows):
                self.rows_select.value = op
        finally:
            self._quiet = False

    def on_plan(self, event) -> None:
        self.refresh_rows()
        op = self.session.selection.op
        self.show_op(op)

    def on_selection(self, event) -> None:
        sel = event.detail["selection"]
        if sel.op is None and sel.layer is not None and self.layer_filter.value != sel.layer \
                and sel.layer in self.layer_filter.options:
            self.layer_filter.value = sel.layer
        if sel.op is not None and self.row(sel.op) is None:
            node = self.session.op_graph.op(sel.op)
            self.set_filters(layer=node.layer if node.layer in self.layer_filter.options else None,
                             primitive=node.primitive)
        self.show_op(sel.op)
