"""The workbench's views: each one an ipywidgets box over a :class:`~autopar_lab.widgets.session.Session`.

Widget callbacks only delegate to plain methods (``on_click``, ``choose``, ...), so tests drive the views headless
by calling those methods. :mod:`.figures` builds the plotly figures from plain values and needs no widget.
:mod:`.training` runs the plan (locally or on Ray) and draws its progress from the session's ``training`` events.
"""
