"""tests/conftest.py's lists (issue 32 item 6). SLOW_TESTS names the tests `make test-fast` leaves out: a test renamed
or moved would silently fall back into test-fast; this checks every name on the list is still a test function of its
file (read with ast, no import). SERIAL_FILES and LONGEST_FIRST name files too: a renamed file would silently leave
the Ray group or the front of the run."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import LONGEST_FIRST, SERIAL_FILES, SERIAL_GROUP, SLOW_TESTS, longest_first

HERE = Path(__file__).parent


def test_every_test_the_slow_list_names_exists_in_its_file():
    missing = []
    for stem, names in SLOW_TESTS.items():
        path = HERE / f"{stem}.py"
        assert path.exists(), f"SLOW_TESTS names {stem}.py, which is not in tests/"
        defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        missing += [f"{stem}::{name}" for name in sorted(names - defined)]
    assert not missing, f"SLOW_TESTS names tests that are gone (renamed?): {', '.join(missing)}"


def test_the_serial_and_longest_first_lists_name_test_files():
    named = set(SERIAL_FILES) | set(LONGEST_FIRST) - {SERIAL_GROUP}
    assert not {stem for stem in named if not (HERE / f"{stem}.py").exists()}


def test_groups_run_longest_first_then_by_their_number_of_tests():
    # One entry per test: two Ray files (one group), two named longest-first groups, two files not named (two tests
    # of test_zz_b, one of test_zz_a, which comes first in collection).
    stems = ["test_zz_a", "test_golden", "test_launch", "test_zz_b", "test_zz_b", "test_browser", "test_ray_lifecycle"]
    rank = longest_first(stems)
    assert sorted(rank, key=rank.get) == [SERIAL_GROUP, "test_browser", "test_golden", "test_zz_b", "test_zz_a"]
