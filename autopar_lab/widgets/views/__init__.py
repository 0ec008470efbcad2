"""The workbench's views: each one an ipywidgets box over a :class:`~autopar_lab.widgets.session.Session`.

Widget callbacks only delegate to plain methods (``on_click``, ``choose``, ``edit_stage``, ...), so tests drive the
views headless by calling those methods. :mod:`.figures` builds the plotly figures from plain values and needs no
widget; :mod:`.fmt` is the one number format every view writes with; :mod:`.graph_canvas` is the operator graph's
front end (an anywidget built from ``extensions/graph``); :mod:`.header` the dashboard's sticky header;
:mod:`.training` runs the plan (locally or on Ray, through ``session.training``) and draws its progress from the
session's ``training`` events.
"""
