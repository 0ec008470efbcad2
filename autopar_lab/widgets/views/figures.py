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

# One colour per stage / category, cycling (plotly's qualitative "Plotly" palette plus "D3").
PALETTE = ("#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692", "#B6E880", "#FF97FF",
           "#FECB52", "#1F77B4", "#FF7F0E", "#2CA02C", "#D62728", "#9467BD", "#8C564B")
TERM_COLOURS = {"compute": "#636EFA", "collectives": "#EF553B", "resharding": "#AB63FA",
                "stage transfer": "#FFA15A", "bubble": "#BBBBBB"}
KIND_COLOURS = {"fwd": "#636EFA", "bwd": "#EF553B", "send_fwd": "#00CC96", "send_bwd": "#FFA15A", "idle": "#E5E5E5"}


_TEMPLATE = go.layout.Template()  # empty: no default template to merge


def _figure(*traces) -> go.Figure:
    return go.Figure(data=list(traces), layout={"template": _TEMPLATE})


def colour(k: int) -> str:
    """The palette colour of category ``k`` (cycling)."""
    return PALETTE[int(k) % len(PALETTE)]


def _layout(fig: go.Figure, title: str, height: int) -> go.Figure:
    # A plain white layout set by hand: a named template (e.g. "plotly_white") is deep-copied on every figure and
    # costs more than the figure itself.
    fig.update_layout(title=dict(text=title, x=0.01, font=dict(size=13)), height=height,
                      margin=dict(l=50, r=10, t=30, b=30), showlegend=True, template=_TEMPLATE,
                      plot_bgcolor="white", paper_bgcolor="white")
    fig.update_xaxes(gridcolor="#EEEEEE", zerolinecolor="#DDDDDD")
    fig.update_yaxes(gridcolor="#EEEEEE", zerolinecolor="#DDDDDD")
    return fig


def dag_figure(nodes: Sequence[Mapping], edges: Sequence[tuple[float, float, float, float]],
               selected: str | None = None, title: str = "operator graph", height: int = 380) -> go.Figure:
    """A layered DAG: ``nodes`` [{key, x, y, label, colour, hover, size}], ``edges`` [(x0, y0, x1, y1)].

    All edges are one line trace (None-separated segments) and all nodes one marker trace whose ``customdata`` is the
    node key, so a graph of any size is two traces. The node whose key is ``selected`` gets a thick outline.

    >>> f = dag_figure([{"key": "a", "x": 0, "y": 0}, {"key": "b", "x": 1, "y": 0}], [(0, 0, 1, 0)], selected="b")
    >>> list(f.data[1].customdata), list(f.data[1].marker.line.width)
    ([['a'], ['b']], [0.5, 3])
    """
    ex, ey = [], []
    for x0, y0, x1, y1 in edges:
        ex += [x0, x1, None]
        ey += [y0, y1, None]
    fig = _figure()
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#C8C8C8", width=1), hoverinfo="skip",
                             name="edges", showlegend=False))
    fig.add_trace(go.Scatter(
        x=[n["x"] for n in nodes], y=[n["y"] for n in nodes], mode="markers+text",
        text=[n.get("label", "") for n in nodes], textposition="top center", textfont=dict(size=9),
        hovertext=[n.get("hover", n["key"]) for n in nodes], hoverinfo="text",
        customdata=[[n["key"]] for n in nodes], name="nodes", showlegend=False,
        marker=dict(color=[n.get("colour", PALETTE[0]) for n in nodes], size=[n.get("size", 12) for n in nodes],
                    line=dict(color="#111111", width=[3 if n["key"] == selected else 0.5 for n in nodes]))))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig = _layout(fig, title, height)
    fig.update_layout(showlegend=False, clickmode="event", dragmode="pan")
    return fig


# The cost panel shares a row with the graph and table: a fixed width keeps its figures inside their column (a
# FigureWidget otherwise takes the width of the page it first renders in, and is cut off when the columns wrap).
SIDE_WIDTH = 460


def cost_figure(before: Mapping[str, float] | None, after: Mapping[str, float], title: str = "step time (s)",
                height: int = 220, width: int | None = SIDE_WIDTH) -> go.Figure:
    """Stacked horizontal bars of the step-time terms, "before" above "after" (``before`` None: one bar).

    >>> f = cost_figure(None, {"compute": 2.0, "bubble": 1.0})
    >>> [(t.name, t.x) for t in f.data]
    [('compute', (2.0,)), ('bubble', (1.0,))]
    """
    rows = (["before", "after"] if before is not None else ["now"])
    fig = _figure()
    for term, v in after.items():
        xs = ([before.get(term, 0.0)] if before is not None else []) + [v]
        fig.add_trace(go.Bar(y=rows, x=xs, name=term, orientation="h", marker_color=TERM_COLOURS.get(term),
                             hovertemplate=f"{term}: %{{x:.4g}} s<extra></extra>"))
    fig.update_layout(barmode="stack", legend=dict(orientation="h", y=-0.25), width=width)
    fig.update_yaxes(autorange="reversed")
    return _layout(fig, title, height)


def memory_figure(peak_bytes: Sequence[float], limit_bytes: float, title: str = "peak memory per device (GiB)",
                  height: int = 220, width: int | None = SIDE_WIDTH) -> go.Figure:
    """One bar per stage (red when over the limit) and the device limit as a dashed line.

    >>> f = memory_figure([1 * 2**30, 3 * 2**30], 2 * 2**30)
    >>> list(f.data[0].marker.color)
    ['#00CC96', '#D62728']
    """
    gib = [b / 2**30 for b in peak_bytes]
    lim = limit_bytes / 2**30
    fig = _figure(go.Bar(x=[f"stage {i}" for i in range(len(gib))], y=gib, name="peak",
                           marker_color=["#D62728" if g > lim else "#00CC96" for g in gib],
                           hovertemplate="%{x}: %{y:.3g} GiB<extra></extra>"))
    fig.add_hline(y=lim, line_dash="dash", line_color="#444", annotation_text=f"limit {lim:.3g} GiB")
    fig = _layout(fig, title, height)
    fig.update_layout(showlegend=False, width=width)
    return fig


def idle_intervals(rows: Sequence[Mapping], makespan: float) -> list[dict]:
    """The gaps on every compute row of a timeline (the bubbles): [{resource, stage, start, end}].

    >>> idle_intervals([{"resource": "stage 0", "stage": 0, "kind": "fwd", "start": 1.0, "end": 2.0}], 3.0)
    [{'resource': 'stage 0', 'stage': 0, 'start': 0.0, 'end': 1.0}, {'resource': 'stage 0', 'stage': 0, 'start': 2.0, 'end': 3.0}]
    """
    by: dict[str, list] = {}
    stage_of = {}
    for r in rows:
        if r["kind"] in ("fwd", "bwd"):
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
                    height: int = 260, max_labels: int = 64) -> go.Figure:
    """A Gantt chart of a pipeline simulation (rows as :meth:`simulate.Timeline.to_rows` gives them): one bar trace
    per task kind, plus the idle gaps of each stage in grey ("bubble"). Microbatch numbers are written on the bars
    when there are at most ``max_labels`` tasks.

    >>> rows = [{"resource": "stage 0", "stage": 0, "kind": "fwd", "microbatch": 0, "start": 0.0, "end": 1.0}]
    >>> [t.name for t in timeline_figure(rows, 2.0).data]
    ['fwd', 'bubble']
    """
    fig = _figure()
    label = len(rows) <= max_labels
    order = sorted({r["resource"] for r in rows}, key=lambda s: (s.startswith("link"), s))
    for kind in ("fwd", "bwd", "send_fwd", "send_bwd"):
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        fig.add_trace(go.Bar(
            y=[r["resource"] for r in rs], x=[r["end"] - r["start"] for r in rs], base=[r["start"] for r in rs],
            orientation="h", name=kind, marker_color=KIND_COLOURS[kind],
            text=[str(r["microbatch"]) for r in rs] if label else None, textposition="inside",
            customdata=[[r["microbatch"], r["start"], r["end"]] for r in rs],
            hovertemplate=f"{kind} mb %{{customdata[0]}}: %{{customdata[1]:.4g}}-%{{customdata[2]:.4g}} s<extra></extra>"))
    idle = idle_intervals(rows, makespan)
    if idle:
        fig.add_trace(go.Bar(
            y=[r["resource"] for r in idle], x=[r["end"] - r["start"] for r in idle], base=[r["start"] for r in idle],
            orientation="h", name="bubble", marker_color=KIND_COLOURS["idle"], opacity=0.8,
            hovertemplate="idle %{base:.4g} s + %{x:.4g} s<extra></extra>"))
    fig.update_layout(barmode="overlay", legend=dict(orientation="h", y=-0.3))
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(order)))
    fig.update_xaxes(title_text="seconds", range=[0, makespan * 1.01 if makespan > 0 else 1])
    return _layout(fig, title, height)


def mesh_grid_figure(hosts: int, devices_per_host: int, stages: Sequence[Mapping], selected: int | None = None,
                     title: str = "stages on the cluster (hosts x devices)", height: int | None = None) -> go.Figure:
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
    return _layout(fig, title, height or 120 + 50 * hosts)
