"""`make test`'s scheduler (tests/xdist_schedule.py) finishes a run in which a worker dies, running every other test
once, and runs each group of tests whole on one worker, a group being what the conftest maps a test's node id to:
small suites run with two xdist workers."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent

# Each file is one group, as tests/conftest.py makes them; b's first test kills its worker. c and d hold one test
# each: a replacement worker given a one-test group must still be able to run it.
FILES = {
    "test_a.py": "def test_a1(): pass\ndef test_a2(): pass\ndef test_a3(): pass\n",
    "test_b.py": "import os\ndef test_b_crash(): os._exit(3)\ndef test_b_after(): pass\ndef test_b_last(): pass\n",
    "test_c.py": "def test_c1(): pass\n",
    "test_d.py": "def test_d1(): pass\n",
}
CONFTEST = """import pytest

def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.path.stem))
"""


def test_a_crashed_worker_fails_its_test_and_the_rest_run_once(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    # Only xdist and the scheduler as plugins: the run starts in a second, not the seconds the venv's plugins take.
    cmd = [sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-p", "xdist_schedule", "-p", "no:cacheprovider",
           "-n", "2", "--dist", "loadgroup", "-rA", "-q"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(HERE), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    try:
        out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                             env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the run was stranded after the crash:\n{e.stdout}")
    text = out.stdout
    assert out.returncode == 1, text
    assert "crashed while running 'test_b.py::test_b_crash'" in text, text
    passed = [line.split()[1] for line in text.splitlines() if line.startswith("PASSED ")]
    failed = [line.split()[1] for line in text.splitlines() if line.startswith("FAILED ")]
    assert failed == ["test_b.py::test_b_crash"], text
    assert sorted(passed) == ["test_a.py::test_a1", "test_a.py::test_a2", "test_a.py::test_a3",
                              "test_b.py::test_b_after", "test_b.py::test_b_last", "test_c.py::test_c1",
                              "test_d.py::test_d1"], text


# Files e and f are one group (as tests/conftest.py puts the Ray files in one), g and h a group each, and each test
# of file d a group of its own (as conftest's OWN_GROUP_TESTS): the scheduler gets the test's node id.
GROUPING_CONFTEST = """import pathlib

import xdist_schedule


def group_of(nodeid):
    path, _, test = nodeid.partition("::")
    stem = pathlib.PurePath(path).stem
    return "ef" if stem in ("test_e", "test_f") else nodeid if stem == "test_d" else path


def pytest_configure(config):
    config.stash[xdist_schedule.GROUP_OF_TEST] = group_of
    config.option.loadscopereorder = False  # collection order, as tests/conftest.py sets it: d's tests first
"""


def test_each_group_runs_whole_on_one_worker(tmp_path):
    """pytest-xdist's own group marks do not reach its scheduler under pytest 9 (each test was its own group, spread
    over the workers); the scheduler groups the tests by file, as the conftest maps the files, or test by test where
    the conftest makes a test a group of its own."""
    for x in "defgh":
        (tmp_path / f"test_{x}.py").write_text("".join(f"def test_{x}{i}(): pass\n" for i in range(4)))
    (tmp_path / "conftest.py").write_text(GROUPING_CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-p", "xdist_schedule", "-p", "no:cacheprovider",
           "-n", "2", "--dist", "loadgroup", "-v"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(HERE), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout
    workers: dict[str, set[str]] = {}
    for worker, stem in re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] PASSED (test_\w)\.py::", out.stdout, re.M):
        workers.setdefault(stem, set()).add(worker)
    assert sorted(workers) == ["test_d", "test_e", "test_f", "test_g", "test_h"], out.stdout
    assert all(len(workers[s]) == 1 for s in ("test_e", "test_f", "test_g", "test_h")), workers  # a file: one worker
    assert workers["test_e"] == workers["test_f"], workers  # one group: one worker
    # d's four one-test groups come first and are dealt out before any test runs (two to each worker at the start).
    assert workers["test_d"] == {"gw0", "gw1"}, workers


def _item(stem: str, name: str, on_ray: bool):
    """A collected test as conftest's ordering and teardown hooks read it."""
    from types import SimpleNamespace

    return SimpleNamespace(path=pathlib.Path(f"tests/{stem}.py"), nodeid=f"tests/{stem}.py::{name}",
                           fixturenames=["shared_ray_head"] if on_ray else ["tmp_path"])


def test_the_tests_on_the_shared_ray_run_one_after_another():
    """conftest puts the tests that train on the shared embedded Ray (shared_ray_head) one after another in the Ray
    group, so the head starts once for them all, and keeps the first and last file's other tests beside their own."""
    import conftest

    ring = "test_the_two_stage_ring_pipeline_trains_on_ray"
    assert conftest.group_of(f"tests/test_ring_execute.py::{ring}") == conftest.SERIAL_GROUP
    assert conftest.group_of("tests/test_ring_execute.py::test_a_ring_plan_trains_like_one_device") != "ray"
    items = []
    for stem in sorted(conftest.SHARED_RAY_CHAIN):  # in file order, as collected
        if stem == "test_ring_execute":
            items.append(_item(stem, ring, True))
        else:
            items += [_item(stem, "test_before", False), _item(stem, "test_on_ray", True),
                      _item(stem, "test_after", False)]
    items.sort(key=conftest.shared_ray_place)
    on_ray = [k for k, it in enumerate(items) if "shared_ray_head" in it.fixturenames]
    assert on_ray == list(range(on_ray[0], on_ray[0] + len(on_ray)))  # one run of tests on the head
    stems = [it.path.stem for it in items]
    first, last = conftest.SHARED_RAY_CHAIN[0], conftest.SHARED_RAY_CHAIN[-1]
    assert stems[:on_ray[0] + 1] == [first] * (on_ray[0] + 1)  # the first file's others lead into its test on Ray
    assert stems[on_ray[-1]:on_ray[-1] + 3] == [last] * 3  # the last file's others follow its test on Ray


def test_the_shared_ray_stops_before_a_test_that_does_not_ask_for_it(monkeypatch):
    import conftest

    class Head:
        stops = 0

        def stop(self):
            self.stops += 1

    head = Head()
    monkeypatch.setattr(conftest, "SHARED_RAY", head)
    this = _item("test_launch", "test_on_ray", True)
    for nextitem, stops in [(_item("test_launch", "test_on_ray_too", True), 0),
                            (_item("test_launch", "test_without_ray", False), 1), (None, 2)]:
        hook = conftest.pytest_runtest_teardown(this, nextitem)
        next(hook)  # the test's own teardown runs here
        with pytest.raises(StopIteration):
            hook.send(None)
        assert head.stops == stops
