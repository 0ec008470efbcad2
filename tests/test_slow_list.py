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


def test_every_file_the_group_order_names_exists():
    """GROUP_SECONDS orders the xdist groups longest first: a file renamed there would silently go to the end."""
    from conftest import GROUP_SECONDS

    gone = sorted(stem for stem in GROUP_SECONDS if not (HERE / f"{stem}.py").exists())
    assert not gone, f"GROUP_SECONDS names test files that are gone (renamed?): {', '.join(gone)}"



def test_the_collection_runs_the_longest_groups_first_and_keeps_each_file_together(request):
    """This session's tests, as the conftest ordered them: group seconds never rise, and no file is split (its
    module fixtures are built once). Run alone, this file is the whole collection; in `make test`, every file."""
    from conftest import group_of, group_seconds

    stems = [item.path.stem for item in request.session.items]
    seconds = [group_seconds(group_of(stem)) for stem in stems]
    assert seconds == sorted(seconds, reverse=True)
    runs = [stem for k, stem in enumerate(stems) if k == 0 or stems[k - 1] != stem]
    assert len(runs) == len(set(runs)), "a file's tests are split by the order"
