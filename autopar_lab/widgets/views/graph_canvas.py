"""The operator graph's front end: an anywidget whose ES module and CSS are built from ``extensions/graph/``.

Python sends the whole picture as one ``data`` dict (see :func:`autopar_lab.widgets.views.graph.graph_data`); the
browser lays the expanded layer out (dagre), draws it, and handles zoom, pan and hover. A click comes back as a
``{"type": "click", "key": ...}`` message and is handed to ``on_click``; the drawing's width in pixels comes back as
``{"type": "width", "px": ...}`` when it settles or changes, and is handed to ``on_width``. The bundle
``extensions/graph/static/graph.js`` is committed (``make -C extensions`` or ``npm run build`` there rebuilds it).
"""

from __future__ import annotations

import pathlib
from typing import Callable

import anywidget
import traitlets

STATIC = pathlib.Path(__file__).resolve().parents[3] / "extensions" / "graph" / "static"


def _bundle(name: str) -> pathlib.Path:
    path = STATIC / name
    if not path.exists():
        raise FileNotFoundError(f"the operator graph's front end {path} is missing: run `npm install && npm run build` "
                                "in extensions/graph (or `make test`, which builds it)")
    return path


class GraphCanvas(anywidget.AnyWidget):
    """The drawing of the operator graph (``data``: what to draw; ``height``: the DAG pane's height in pixels)."""

    _esm = _bundle("graph.js")
    _css = _bundle("graph.css")
    data = traitlets.Dict().tag(sync=True)
    height = traitlets.Int(440).tag(sync=True)

    def __init__(self, on_click: Callable[[str], None] | None = None,
                 on_width: Callable[[int], None] | None = None, **kwargs):
        super().__init__(**kwargs)
        self._click = on_click
        self._width = on_width
        self.width_px: int | None = None  # the drawing's width in the browser, once it said
        self.on_msg(self.handle_message)

    def handle_message(self, _widget, content, _buffers=None) -> None:
        """A message from the browser: a click on a node calls ``on_click(key)``, a width ``on_width(px)``."""
        if not isinstance(content, dict):
            return
        if content.get("type") == "click" and self._click is not None:
            self._click(str(content.get("key", "")))
        elif content.get("type") == "width" and isinstance(content.get("px"), (int, float)) and content["px"] > 0:
            self.width_px = int(content["px"])
            if self._width is not None:
                self._width(self.width_px)
