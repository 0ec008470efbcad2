"""Running plans: on local JAX devices (:mod:`.local`, stages split by :mod:`.partition`) and on Ray (:mod:`.launch`).

Names load on first use, so importing this package pulls in neither the stage split nor Ray.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "execute": ("autopar_lab.runtime.local", "execute"),
    "Runner": ("autopar_lab.runtime.local", "Runner"),
    "split_stages": ("autopar_lab.runtime.partition", "split_stages"),
    "StagedModel": ("autopar_lab.runtime.partition", "StagedModel"),
}


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar_lab.runtime' has no attribute {name!r}")


__all__ = list(_LAZY)
