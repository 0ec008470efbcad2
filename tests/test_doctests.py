"""Every docstring example in the package runs and prints what it says (the examples are the API's first docs)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import autopar_lab

MODULES = sorted(m.name for m in pkgutil.walk_packages(autopar_lab.__path__, "autopar_lab.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, \
        f"{result.failed} of {result.attempted} examples in {name} failed (see them: python -m doctest -v FILE)"
