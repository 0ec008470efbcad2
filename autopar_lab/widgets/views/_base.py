"""What every view shares: the session, the top widget with its stable CSS class, and error reporting."""

from __future__ import annotations

from typing import Any, Callable

import ipywidgets as w
import plotly.graph_objects as go

from .fmt import fmt_bytes, fmt_flops, fmt_s  # noqa: F401 - the views' number format, re-exported

#: Errors an action may raise on bad input; the view reports them (the session keeps its plan) instead of raising.
USER_ERRORS = (ValueError, NotImplementedError, TypeError, KeyError)


class View:
    """A view: ``widget`` (an ipywidgets box with CSS class ``autopar-<name>``), refreshed on session events."""

    css: str = "autopar-view"

    def __init__(self, session):
        self.session = session
        self.message = w.HTML("", layout=w.Layout(min_height="0px"))
        self.message.add_class("autopar-message")
        self._unsubscribe = session.subscribe(self._on_event)

    def _on_event(self, event) -> None:
        if event.name == "plan":
            self.message.value = ""  # an error about the plan before no longer applies to this one
            self.on_plan(event)
        elif event.name == "selection":
            self.on_selection(event)

    def on_plan(self, event) -> None:  # override
        pass

    def on_selection(self, event) -> None:  # override
        pass

    def run(self, action: str, fn: Callable[[], Any]) -> Any:
        """Run one user action; a bad-input error becomes a message here and an ``error`` event (nothing changes)."""
        try:
            out = fn()
        except USER_ERRORS as e:
            self.message.value = f"<span style='color:#B00020'>{action}: {_escape(str(e))}</span>"
            self.session.error(action, e, source=self.css)
            return None
        self.message.value = ""
        return out

    def _finish(self, box: w.Widget) -> w.Widget:
        box.add_class(self.css)
        self.widget = box
        return box

    def close(self) -> None:
        self._unsubscribe()


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class LiveFigure(go.FigureWidget):
    """A plotly ``FigureWidget`` whose comm opens with its traces and layout in it: for a figure built whole.

    Measured in Chromium (JupyterLab 4, plotly 7's anywidget front end): a figure's browser view draws the state
    its comm opened with, then applies the edits (restyle, add traces, ...) that arrive after it drew; state sent
    later, and edits sent before the view drew, are not drawn. plotly's ``FigureWidget`` opens its comm empty and
    sends its traces and layout after, so a view could stay an empty plot at plotly's default 700 px until the next
    edit (the cost panel in CI of 2026-12-06, and the stage layout here, each 700 px in a 603-px column). Holding the
    comm until the figure is complete draws it whole; the side column's figures, built whole, use it."""

    def __init__(self, *args, **kwargs):
        self._complete = False  # before the base class opens the comm
        super().__init__(*args, **kwargs)
        self._complete = True
        self.open()

    def open(self) -> None:
        if self._complete:
            super().open()


def sync_figure(widget, fresh, layout: dict | None = None) -> None:
    """Make FigureWidget ``widget`` show the traces of figure ``fresh``: in place when the traces are the same kind
    and name (one message to the browser, no trace re-creation), else by replacing them. ``layout``: layout
    properties to set too (e.g. ``{"title.text": ...}``); the rest of the layout is left as it is."""
    same = len(widget.data) == len(fresh.data) and all(
        a.type == b.type and a.name == b.name for a, b in zip(widget.data, fresh.data))
    if same:
        with widget.batch_update():
            for a, b in zip(widget.data, fresh.data):
                a.update(b.to_plotly_json(), overwrite=True)
            for k, v in (layout or {}).items():
                widget.layout[k] = v
        return
    widget.data = ()
    widget.add_traces(list(fresh.data))
    with widget.batch_update():
        for k, v in (layout or {}).items():
            widget.layout[k] = v
