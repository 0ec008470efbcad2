"""tests/conftest.py's lists (issue 32 item 6). SLOW_TESTS names the tests `make test-fast` leaves out: a test renamed
or moved would silently fall back into test-fast; this checks every name on the list is still a test function of its
file (read with ast, no import). SERIAL_FILES, OWN_GROUP_TESTS and LONGEST_FIRST name files and tests too: a renamed
one would silently leave the Ray group, its own group or the front of the run."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import LONGEST_FIRST, OWN_GROUP_TESTS, SERIAL_FILES, SERIAL_GROUP, SLOW_TESTS, group_of, longest_first

HERE = Path(__file__).parent


def _functions(stem: str) -> set[str]:
    path = HERE / f"{stem}.py"
    assert path.exists(), f"{stem}.py is not in tests/"
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_every_test_the_slow_list_names_exists_in_its_file():
    missing = []
    for stem, names in SLOW_TESTS.items():
        missing += [f"{stem}::{name}" for name in sorted(names - _functions(stem))]
    assert not missing, f"SLOW_TESTS names tests that are gone (renamed?): {', '.join(missing)}"


def test_the_serial_own_group_and_longest_first_lists_name_test_files_and_tests():
    named = set(SERIAL_FILES) | {g.split("::")[0] for g in LONGEST_FIRST} - {SERIAL_GROUP}
    assert not {stem for stem in named if not (HERE / f"{stem}.py").exists()}
    missing = [f"{stem}::{name}" for stem, names in OWN_GROUP_TESTS.items()
               for name in sorted(names - _functions(stem))]
    assert not missing, f"OWN_GROUP_TESTS names tests that are gone (renamed?): {', '.join(missing)}"
    # A test named in LONGEST_FIRST is one of OWN_GROUP_TESTS (else it is never a group and has no place to take).
    tests = [g.split("::") for g in LONGEST_FIRST if "::" in g]
    assert all(test.split("[")[0] in OWN_GROUP_TESTS.get(stem, ()) for stem, test in tests), tests
    notebooks = {p.stem for p in (HERE.parent / "notebooks").glob("*.ipynb")}
    assert {test.split("[")[1].rstrip("]") for stem, test in tests if stem == "test_notebooks"} <= notebooks


def test_a_test_is_in_the_ray_group_its_own_or_its_files():
    assert group_of("tests/test_launch.py::test_cancel_stops_the_job_cleanly") == SERIAL_GROUP
    assert group_of("tests/test_readme.py::test_readme_examples_run") == SERIAL_GROUP
    assert group_of("tests/test_notebooks.py::test_notebook_runs[05_bring_your_own_model]") == (
        "test_notebooks::test_notebook_runs[05_bring_your_own_model]")
    assert group_of("tests/test_notebooks.py::test_there_is_a_tour") == "test_notebooks"
    assert group_of("tests/test_browser.py::test_deep_workbench_in_chromium") == (
        "test_browser::test_deep_workbench_in_chromium")
    assert group_of("tests/test_golden.py::test_x[a::b]") == "test_golden"


def test_groups_run_longest_first_then_by_their_number_of_tests():
    # One entry per test: two Ray files (one group), a named longest-first file and a named test of its own group, two
    # files not named (two tests of test_zz_b, one of test_zz_a, which comes first in collection), and a test of its
    # own group not named (one test, collected after test_zz_a: last).
    ids = ["tests/test_zz_a.py::t", "tests/test_golden.py::t", "tests/test_launch.py::t", "tests/test_zz_b.py::t1",
           "tests/test_zz_b.py::t2", "tests/test_browser.py::test_deep_workbench_in_chromium",
           "tests/test_ray_lifecycle.py::t", "tests/test_notebooks.py::test_notebook_runs[02_concepts]"]
    rank = longest_first(ids)
    assert sorted(rank, key=rank.get) == [SERIAL_GROUP, "test_browser::test_deep_workbench_in_chromium", "test_golden",
                                          "test_zz_b", "test_zz_a", "test_notebooks::test_notebook_runs[02_concepts]"]
