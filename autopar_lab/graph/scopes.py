"""Name scopes as layers: a name stack read as the user's scopes and the role its transformations imply, the scope
depth that names layers, and how operators without a layer take a neighbour's.

Shared by the capture (:mod:`autopar_lab.graph.capture`) and the layer finder (:mod:`autopar_lab.graph.layerfind`),
so neither imports the other.
"""

from __future__ import annotations

import re
from typing import Sequence

from .opgraph import BACKWARD, FORWARD, INPUT_PRIMITIVE

_WRAPPER = re.compile(r"^([A-Za-z_][\w.]*)\((.*)\)$")
# Transformation names that JAX puts around a scope; they are not user scopes.
_TRANSFORMS = frozenset(["jvp", "transpose", "vmap", "remat", "checkpoint", "rematted_computation", "pjit", "jit"])


def _strip(component: str) -> tuple[str, list[str]]:
    """'transpose(jvp(layer_3))' -> ('layer_3', ['transpose', 'jvp'])."""
    wrappers = []
    m = _WRAPPER.match(component)
    while m:
        wrappers.append(m.group(1))
        component = m.group(2)
        m = _WRAPPER.match(component)
    return component, wrappers


def scope_path_and_role(scope: str) -> tuple[tuple[str, ...], str | None]:
    """The user name scopes of a name stack (transformations stripped), and the role those transformations imply.

    >>> scope_path_and_role("transpose(jvp(Net))/block_0/Dense_1")
    (('Net', 'block_0', 'Dense_1'), 'backward')
    """
    path, role = [], None
    for comp in scope.split("/") if scope else ():
        name, wrappers = _strip(comp)
        if "transpose" in wrappers:
            role = BACKWARD
        elif "jvp" in wrappers and role is None:
            role = FORWARD
        if name and name not in _TRANSFORMS:
            path.append(name)
    return tuple(path), role


def scope_layer_and_role(scope: str) -> tuple[str | None, str | None]:
    """The outermost user scope of a name stack, and the role its transformations imply.

    >>> scope_layer_and_role("transpose(jvp(layer_3))/attn")
    ('layer_3', 'backward')
    >>> scope_layer_and_role("jvp(embed)")
    ('embed', 'forward')
    >>> scope_layer_and_role("")
    (None, None)
    """
    path, role = scope_path_and_role(scope)
    return (path[0] if path else None), role


def layer_depth(paths) -> int:
    """The scope depth that names layers: the first depth at which the operators' scopes differ.

    A model whose every operator sits under one wrapper scope (Flax puts the top module's name first: ``Net/block_0``)
    has its layers one level down.

    >>> layer_depth([("Net", "block_0", "Dense_0"), ("Net", "block_1"), ("Net",)])
    1
    >>> layer_depth([("layer_0", "attn"), ("layer_1",)])
    0
    """
    depth = 0
    while True:
        names = {p[depth] for p in paths if len(p) > depth}
        if len(names) != 1:
            return depth
        depth += 1


def propagate_layers(primitives: Sequence[str], inputs: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                     producer: dict, alias_output: dict, layers: Sequence[str | None]) -> list[str | None]:
    """Operators without a layer take a neighbour's: a step input the layer of its first reader that has one (else of
    the output that updates it), any other operator the layer of the first input whose producer has one (an optimizer
    update joins its gradient's layer); repeated, since each rule can unlock the others."""
    layers = list(layers)
    consumers: dict[int, list[int]] = {}
    for i, ins in enumerate(inputs):
        for t in ins:
            consumers.setdefault(t, []).append(i)
    for _ in range(3):
        changed = False
        for i, prim in enumerate(primitives):  # parameters: their first reader that has a layer, else their update
            if prim == INPUT_PRIMITIVE and layers[i] is None:
                readers = [c for c in consumers.get(outputs[i][0], []) if layers[c] is not None]
                out = alias_output.get(outputs[i][0])
                layers[i] = layers[readers[0]] if readers else (layers[out] if out is not None else None)
                changed |= layers[i] is not None
        for i, prim in enumerate(primitives):  # everything else: the layer of the first input whose producer has one
            if layers[i] is None and prim != INPUT_PRIMITIVE:
                for t in inputs[i]:
                    p = producer.get(t)
                    if p is not None and layers[p] is not None:
                        layers[i] = layers[p]
                        changed = True
                        break
        if not changed:
            break
    return layers
