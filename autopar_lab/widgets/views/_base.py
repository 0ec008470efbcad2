"""What every view shares: the session, the top widget with its stable CSS class, and error reporting."""

from __future__ import annotations

from typing import Any, Callable

import anywidget
import ipywidgets as w
import plotly.graph_objects as go
import traitlets

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


# plotly's figure front end (plotly 6 and later: an anywidget ES module of 5 MB) is sent to the browser once per kernel,
# not once per figure. A FigureWidget carries the whole module in its state and the browser evaluates it again for
# every figure: a workbench's five figures sent 25 MB through the kernel, the server and the page, and took the page
# 15 s of its main thread to evaluate (a Chromium trace of tests/test_browser.py's deep test, 2026-12-07, beside other
# work on 2 cores). A SharedFigure sends a small module instead that imports plotly's, held once by a plain widget
# model (its ``source``), and evaluates it once per page and kernel.
_SHARED_ESM = """
const loaded = (globalThis.__autoparPlotly ??= new Map());
async function libraryModel(model, id) {
  for (let i = 0; ; i++) {  // restored from the kernel, the library's model may register after this one's
    try { return await model.widget_manager.get_model(id); }
    catch (e) { if (i >= 200) throw e; await new Promise(r => setTimeout(r, 50)); }
  }
}
function plotly(model) {
  const id = model.get("_plotly_library");
  let mod = loaded.get(id);
  if (!mod) {
    mod = libraryModel(model, id).then(async lib => {
      const url = URL.createObjectURL(new Blob([lib.get("source")], { type: "text/javascript" }));
      try { return await import(/* webpackIgnore: true */ url); } finally { URL.revokeObjectURL(url); }
    });
    loaded.set(id, mod);
    mod.catch(() => loaded.delete(id));
  }
  return mod;
}
export default () => {
  let inner, ready;
  return {
    initialize(ctx) {
      ready = plotly(ctx.model).then(async mod => {
        inner = typeof mod.default === "function" ? await mod.default() : mod.default;
        return inner.initialize?.(ctx);
      });
      return ready;
    },
    async render(ctx) { await ready; return inner.render(ctx); },
  };
};
"""

#: Whether plotly's FigureWidget is an anywidget (plotly 6 and later): only then can its front end be shared.
_SHARES_FRONT_END = issubclass(go.FigureWidget, anywidget.AnyWidget) and hasattr(go.FigureWidget, "_esm")


class _PlotlyLibrary(w.Widget):
    """plotly's figure front end, as a widget model the browser fetches once per kernel (no view)."""

    source = traitlets.Unicode("").tag(sync=True)


_LIBRARY: list[_PlotlyLibrary] = []


def plotly_library() -> _PlotlyLibrary:
    """The kernel's one widget holding plotly's figure front end (made again if it was closed)."""
    if not _LIBRARY or _LIBRARY[0].comm is None:
        _LIBRARY[:] = [_PlotlyLibrary(source=str(go.FigureWidget._esm))]
    return _LIBRARY[0]


class SharedFigure(go.FigureWidget):
    """A plotly ``FigureWidget`` whose front end is sent to the browser once per kernel (see ``_SHARED_ESM``): what
    it draws and how it updates are plotly's. A plotly before 6 (no anywidget) draws it as a plain FigureWidget."""

    if _SHARES_FRONT_END:
        _esm = _SHARED_ESM
    _plotly_library = traitlets.Unicode("").tag(sync=True)

    @traitlets.default("_plotly_library")
    def _library_id(self) -> str:
        return plotly_library().model_id if _SHARES_FRONT_END else ""


class LiveFigure(SharedFigure):
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
