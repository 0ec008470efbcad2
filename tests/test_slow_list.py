"""tests/conftest.py's SLOW_TESTS names the tests `make test-fast` leaves out (issue 32 item 6). A test renamed or
moved would silently fall back into test-fast; this checks every name on the list is still a test function of its
file (read with ast, no import)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import SLOW_TESTS

HERE = Path(__file__).parent


def test_every_test_the_slow_list_names_exists_in_its_file():
    missing = []
    for stem, names in SLOW_TESTS.items():
        path = HERE / f"{stem}.py"
        assert path.exists(), f"SLOW_TESTS names {stem}.py, which is not in tests/"
        defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        missing += [f"{stem}::{name}" for name in sorted(names - defined)]
    assert not missing, f"SLOW_TESTS names tests that are gone (renamed?): {', '.join(missing)}"
