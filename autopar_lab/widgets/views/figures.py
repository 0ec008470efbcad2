"""Plotly figures of the workbench from plain values (lists, dicts, numbers): no widget, no kernel, no Plan needed.

The views turn a plan into these values (see each view module's ``*_data`` functions) and draw them here; notebooks
and tests can call the same builders directly.

    >>> fig = cost_figure({"compute": 1.0, "collectives": 0.2}, {"compute": 0.8, "collectives": 0.3})
    >>> [t.name for t in fig.data]
    ['compute', 'collectives']
"""

from __future__ import annotations

from typing import Mapping, Sequence

import plotly.graph_objects as go

from .fmt import fmt_bytes, fmt_s

# One colour per stage / category, cycling (plotly's qualitative "Plotly" palette plus "D3").
PALETTE = ("#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692", "#B6E880", "#FF97FF",
           "#FECB52", "#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B")
TERM_COLOURS = {"compute": "#636EFA", "collectives": "#EF553B", "resharding": "#AB63FA",
                "stage transfer": "#FFA15A", "bubble": "#BBBBBB"}
KIND_COLOURS = {"fwd": "#636EFA", "bwd": "#EF553B", "send_fwd": "#00CC96", "send_bwd": "#FFA15A", "idle": "#E5E5E5",
                "wgrad": "#AB63FA"}
COMPUTE_KINDS = ("fwd", "bwd", "wgrad")  # a zero-bubble schedule's weight-gradient tasks ("wgrad") are work too


_TEMPLATE = go.layout.Template()  # empty: no default template to merge


def _figure(*traces) -> go.Figure:
    return go.Figure(data=list(traces), layout={"template": _TEMPLATE})


def colour(k: int) -> str:
    """The palette colour of category ``k`` (cycling)."""
    return PALETTE[int(k) % len(PALETTE)]


#: Right margin: room for plotly's toolbar, stood upright at the figure's right edge (``modebar.orientation="v"``).
#: Lying across the top (its default) it covered the titles of the narrow side figures whenever the mouse was over them.
MODEBAR_PX = 34


def _layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    # A plain white layout set by hand: a named template (e.g. "plotly_white") is deep-copied on every figure and
    # costs more than the figure itself.
    lines = title.count("<br>") + 1
    fig.update_layout(title=dict(text=title, x=0.01, font=dict(size=13)), height=height + 16 * (lines - 1),
                      margin=dict(l=50, r=MODEBAR_PX, t=30 + 16 * (lines - 1), b=30), showlegend=True,
                      template=_TEMPLATE, plot_bgcolor="white", paper_bgcolor="white", modebar=dict(orientation="v"))
    fig.update_xaxes(gridcolor="#EEEEEE", zerolinecolor="#DDDDDD")
    fig.update_yaxes(gridcolor="#EEEEEE", zerolinecolor="#DDDDDD")
    return fig


# The cost panel shares a row with the graph and table: a fixed width keeps its figures inside their column (a
# FigureWidget otherwise takes the width of the page it first renders in, and is cut off when the columns wrap).
SIDE_WIDTH = 460


def cost_figure(before: Mapping[str, float] | None, after: Mapping[str, float], title: str = "step time by term",
                height: int = 220, width: int | None = SIDE_WIDTH) -> go.Figure:
    """Stacked horizontal bars of the step-time terms, "before" above "after" (``before`` None: one bar).

    >>> f = cost_figure(None, {"compute": 2.0, "bubble": 1.0})
    >>> [(t.name, t.x) for t in f.data]
    [('compute', (2.0,)), ('bubble', (1.0,))]
    """
    rows = ["before", "now"] if before is not None else ["now"]
    fig = _figure()
    for term, v in after.items():
        xs = ([before.get(term, 0.0)] if before is not None else []) + [v]
        fig.add_trace(go.Bar(y=rows, x=xs, name=term, orientation="h", marker_color=TERM_COLOURS.get(term),
                             customdata=[fmt_s(x) for x in xs],
                             hovertemplate=f"{term}: %{{customdata}}<extra></extra>"))
    fig.update_layout(barmode="stack", legend=dict(orientation="h", y=-0.25, traceorder="normal"), width=width)
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(exponentformat="SI", minexponent=0, ticksuffix="s")  # 0.005 reads "5ms"
    return _layout(fig, title, height)


PART_LABELS = {"params_bytes": "parameters", "grads_bytes": "gradients", "master_bytes": "fp32 master weights",
               "optimizer_bytes": "optimizer state", "copies_bytes": "parameter copies",
               "fp8_copies_bytes": "FP8 weight copies", "buffers_bytes": "buffers",
               "recompute_bytes": "recompute working set",
               "activations_bytes": "activations (x microbatches in flight)"}
PART_COLOURS = {"params_bytes": "#636EFA", "grads_bytes": "#19D3F3", "master_bytes": "#00CC96",
                "optimizer_bytes": "#AB63FA", "copies_bytes": "#B6E880", "fp8_copies_bytes": "#FECB52",
                "buffers_bytes": "#BAB0AC",
                "recompute_bytes": "#FF97FF", "activations_bytes": "#FFA15A", "remat_saved_bytes": "#FFFFFF"}
_UNITS = (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def byte_unit(largest: float) -> tuple[str, float]:
    """The binary unit a chart of values up to ``largest`` bytes reads best in: ``byte_unit(3e6) == ('MiB', 2**20)``."""
    return next(((u, s) for u, s in _UNITS if largest >= s), ("B", 1))


def memory_figure(after: Sequence[Mapping], before: Sequence[Mapping] | None = None, limit_bytes: float | None = None,
                  title: str = "peak memory per device, by stage", height: int = 260,
                  width: int | None = SIDE_WIDTH) -> go.Figure:
    """Each stage's peak memory stacked by part (parameters, gradients, optimizer state, activations), ``before``
    beside "now" when given; rows as :func:`autopar_lab.memory.memory_breakdown` gives them. The axis takes the unit
    of the largest bar (so small usage is not flattened by a far device limit); the limit is a dashed line when it is
    within reach of the bars, else named in the title. Activations that remat saves are an outlined, unfilled
    segment on top ("saved by remat", not held).

    >>> rows = [{"params_bytes": 2**20, "grads_bytes": 2**20, "optimizer_bytes": 2**21, "activations_bytes": 0,
    ...          "remat_saved_bytes": 0}]
    >>> f = memory_figure(rows, limit_bytes=16 * 2**30)
    >>> [t.name for t in f.data][:2], f.data[0].y, f.layout.yaxis.title.text
    (['parameters', 'gradients'], (1.0,), 'MiB')
    """
    sets = ([("before", before)] if before is not None else []) + [("now", after)]
    largest = max((sum(r.get(p, 0.0) for p in PART_LABELS) for _, rows in sets for r in rows), default=0.0)
    unit, scale = byte_unit(largest)
    x0, x1 = [], []
    for label, rows in sets:
        for k in range(len(rows)):
            x0.append(f"S{k}")
            x1.append(label)
    # Stages across, before / now within each stage.
    order = sorted(range(len(x0)), key=lambda i: (int(x0[i][1:]), x1[i] != "before"))
    xs = [[x0[i] for i in order], [x1[i] for i in order]]
    flat = [r for _, rows in sets for r in rows]
    fig = _figure()
    for part, name in PART_LABELS.items():
        ys = [flat[i].get(part, 0.0) / scale for i in order]
        # A part no stage holds (no remat: no recompute working set) stays out of the legend, which is long enough.
        fig.add_trace(go.Bar(x=xs, y=ys, name=name, marker_color=PART_COLOURS[part], showlegend=any(ys),
                             customdata=[fmt_bytes(flat[i].get(part, 0.0)) for i in order],
                             hovertemplate=f"{name}: %{{customdata}}<extra>%{{x}}</extra>"))
    saved = [flat[i].get("remat_saved_bytes", 0.0) / scale for i in order]
    if any(saved):
        fig.add_trace(go.Bar(x=xs, y=saved, name="saved by remat (not held)",
                             marker=dict(color="rgba(0,0,0,0)", line=dict(color="#FFA15A", width=1.5)),
                             customdata=[fmt_bytes(flat[i].get("remat_saved_bytes", 0.0)) for i in order],
                             hovertemplate="remat saves %{customdata}<extra>%{x}</extra>"))
    note = ""
    if limit_bytes is not None:
        lim = limit_bytes / scale
        if limit_bytes <= 1.5 * largest:
            fig.add_hline(y=lim, line_dash="dash", line_color="#D62728",
                          annotation_text=f"device limit {fmt_bytes(limit_bytes)}", annotation_position="top left")
        else:
            note = f"<br>(device limit {fmt_bytes(limit_bytes)}, off the scale)"  # a line of its own: it is long
    fig.update_yaxes(title_text=unit, rangemode="tozero")
    _layout(fig, title + note, height)
    # The legend goes below the two rows of axis labels (stage, before / now) and wraps into as many lines as it
    # needs (one per part at this width); the figure grows by the room they take instead of the legend turning into
    # a scroll box over the axis labels.
    lines = sum(1 for t in fig.data if t.showlegend is not False)
    top = fig.layout.margin.t
    fig.update_layout(barmode="stack", width=width, height=fig.layout.height + 19 * lines,
                      margin=dict(l=50, r=MODEBAR_PX, t=top, b=60 + 19 * lines),
                      legend=dict(orientation="h", yanchor="top", y=-0.3, x=0, font=dict(size=10)))
    return fig


def idle_intervals(rows: Sequence[Mapping], makespan: float) -> list[dict]:
    """The gaps on every compute row of a timeline (the bubbles): [{resource, stage, start, end}].

    >>> idle_intervals([{"resource": "stage 0", "stage": 0, "kind": "fwd", "start": 1.0, "end": 2.0}], 3.0)
    ... # doctest: +NORMALIZE_WHITESPACE
    [{'resource': 'stage 0', 'stage': 0, 'start': 0.0, 'end': 1.0},
     {'resource': 'stage 0', 'stage': 0, 'start': 2.0, 'end': 3.0}]
    """
    by: dict[str, list] = {}
    stage_of = {}
    for r in rows:
        if r["kind"] in COMPUTE_KINDS:
            by.setdefault(r["resource"], []).append((r["start"], r["end"]))
            stage_of[r["resource"]] = r["stage"]
    out = []
    for res, spans in by.items():
        t = 0.0
        for s, e in sorted(spans):
            if s > t + 1e-15:
                out.append({"resource": res, "stage": stage_of[res], "start": t, "end": s})
            t = max(t, e)
        if makespan > t + 1e-15:
            out.append({"resource": res, "stage": stage_of[res], "start": t, "end": makespan})
    return out


def timeline_figure(rows: Sequence[Mapping], makespan: float, title: str = "pipeline timeline",
                    height: int = 290, max_labels: int = 64, label_upto: int | None = None,
                    series: Sequence[tuple[str, str]] | None = None) -> go.Figure:
    """A Gantt chart of a pipeline simulation (rows as :meth:`simulate.Timeline.to_rows` gives them): one bar trace
    per task kind, plus the idle gaps of each stage in grey ("bubble"). Microbatch numbers are written on the bars
    when there are at most ``max_labels`` tasks, or (``label_upto``) on the bars of microbatches below that number
    (the ones a window on the first microbatches shows). ``series``: the traces as (name, colour), each drawing the
    rows whose ``"series"`` is that name (default: one trace per kind, named by it).

    >>> rows = [{"resource": "stage 0", "stage": 0, "kind": "fwd", "microbatch": 0, "start": 0.0, "end": 1.0}]
    >>> [t.name for t in timeline_figure(rows, 2.0).data]
    ['fwd', 'bubble']
    """
    fig = _figure()
    def label(r) -> str:
        if label_upto is not None:
            return str(r["microbatch"]) if r["microbatch"] < label_upto else ""
        return str(r["microbatch"]) if len(rows) <= max_labels else ""

    order = sorted({r["resource"] for r in rows}, key=lambda s: (s.startswith("link"), s))
    for kind, col in series or [(k, KIND_COLOURS[k]) for k in ("fwd", "bwd", "wgrad", "send_fwd", "send_bwd")]:
        rs = [r for r in rows if r.get("series", r["kind"]) == kind]
        if not rs:
            continue
        fig.add_trace(go.Bar(
            y=[r["resource"] for r in rs], x=[r["end"] - r["start"] for r in rs], base=[r["start"] for r in rs],
            orientation="h", name=kind, marker_color=col,
            text=[label(r) if r["kind"] in COMPUTE_KINDS else "" for r in rs], textposition="inside",
            customdata=[[r["microbatch"], fmt_s(r["start"]), fmt_s(r["end"] - r["start"])] for r in rs],
            hovertemplate=(f"{kind} of microbatch %{{customdata[0]}}: starts at %{{customdata[1]}}, "
                           "takes %{customdata[2]}<extra>%{y}</extra>")))
    idle = idle_intervals(rows, makespan)
    if idle:
        fig.add_trace(go.Bar(
            y=[r["resource"] for r in idle], x=[r["end"] - r["start"] for r in idle], base=[r["start"] for r in idle],
            orientation="h", name="bubble", marker_color=KIND_COLOURS["idle"], opacity=0.8,
            customdata=[[fmt_s(r["start"]), fmt_s(r["end"] - r["start"])] for r in idle],
            hovertemplate="idle from %{customdata[0]} for %{customdata[1]}<extra>%{y}</extra>"))
    fig.update_layout(barmode="overlay", legend=dict(orientation="h", y=-0.42))
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(order)))
    fig.update_xaxes(title_text="time into the step", range=[0, makespan * 1.01 if makespan > 0 else 1],
                     exponentformat="SI", minexponent=0, ticksuffix="s")
    return _layout(fig, title, height)


def mesh_grid_figure(hosts: int, devices_per_host: int, stages: Sequence[Mapping], selected: int | None = None,
                     title: str = "stages on the cluster (hosts x devices)", height: int | None = None,
                     width: int | None = None, legend: bool = True) -> go.Figure:
    """The cluster as a hosts x devices grid, each device a square coloured by the stage that runs on it.

    ``stages``: [{devices: [global device ids], label: "S0 1x4 as 2x2 L0-3"}]. Clicking a square reports the stage
    index in ``customdata``; free devices are grey with stage -1.

    >>> f = mesh_grid_figure(1, 4, [{"devices": [0, 1], "label": "S0"}, {"devices": [2, 3], "label": "S1"}])
    >>> [c[0] for c in f.data[0].customdata]
    [0, 0, 1, 1]
    """
    owner = {}
    for k, st in enumerate(stages):
        for d in st["devices"]:
            owner[int(d)] = k
    xs, ys, cols, cd, hover, text = [], [], [], [], [], []
    for d in range(hosts * devices_per_host):
        h, m = divmod(d, devices_per_host)
        k = owner.get(d, -1)
        xs.append(m)
        ys.append(h)
        cols.append(colour(k) if k >= 0 else "#DDDDDD")
        cd.append([k, d])
        lab = stages[k]["label"] if k >= 0 else "free"
        hover.append(f"host {h}, device {m} (#{d}): {lab}")
        text.append(f"S{k}" if k >= 0 else "")
    size = max(14, min(48, 480 // max(devices_per_host, 1)))
    fig = _figure(go.Scatter(
        x=xs, y=ys, mode="markers+text", text=text, textfont=dict(color="white", size=10), customdata=cd,
        hovertext=hover, hoverinfo="text", showlegend=False,
        marker=dict(symbol="square", size=size, color=cols,
                    line=dict(color="#111", width=[3 if c[0] == selected and selected is not None else 0.5
                                                   for c in cd]))))
    for k, st in enumerate(stages):  # legend entries: one per stage, with its logical mesh
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker=dict(symbol="square", color=colour(k)),
                                 name=st["label"]))
    fig.update_xaxes(title_text="device in host", dtick=1, range=[-0.7, devices_per_host - 0.3])
    fig.update_yaxes(title_text="host", dtick=1, range=[hosts - 0.3, -0.7])  # host 0 on top
    fig = _layout(fig, title, height or 120 + 50 * hosts)
    fig.update_layout(width=width, showlegend=legend, legend=dict(orientation="h", y=-0.6, font=dict(size=10)))
    return fig
