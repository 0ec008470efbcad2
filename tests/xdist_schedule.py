"""A ``--dist loadgroup`` scheduler that survives a crashed worker (tests/conftest.py installs it).

pytest-xdist 3.8.0's LoadGroupScheduling replaces a worker that dies ("node down: Not properly terminated") but can
then strand the run: it puts the dead worker's whole workload back on the queue, finished groups too (a later worker
is sent a group with nothing left to run, never reports, and is never given more: pytest-xdist issue 1378); it leaves
the test that killed the worker pending, so the replacement runs it again and may die the same way (pull request
1371); and the replacement gets one group only, so a worker whose group has a single test waits for a second one
that never comes (issue 1327). Here a dead worker's finished groups stay finished, the test it died in counts as
run (xdist has reported it failed), and a worker given work after the start is topped up to two tests or told to
stop, as at the start.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadGroupScheduling

# The group of a test's node id ("tests/test_x.py::test_y[param]"), set by tests/conftest.py in pytest_configure;
# without it each file is one group.
GROUP_OF_TEST = pytest.StashKey[object]()


class CrashSafeLoadGroupScheduling(LoadGroupScheduling):
    """LoadGroupScheduling whose run goes on to the end after a worker crashes (see the module docstring), and that
    groups the tests itself when xdist cannot (see _split_scope)."""

    def _split_scope(self, nodeid: str) -> str:
        """The group of the test ``nodeid``. pytest-xdist 3.8.0 marks a test's group by appending "@group" to its
        node id on the worker, which pytest 9 ignores (Node.nodeid is read from another attribute): under pytest 9
        the ids come without it and every test would be a group of its own, so that a file's module fixtures were
        built on each worker and the files meant to run one at a time ran side by side. Then the group is the one
        tests/conftest.py gives the test (GROUP_OF_TEST: its file's, or the test's own), or the test's file."""
        scope = super()._split_scope(nodeid)
        if scope != nodeid:  # xdist's own suffix (pytest before 9)
            return scope
        group_of = self.config.stash.get(GROUP_OF_TEST, None)
        return group_of(nodeid) if group_of else nodeid.split("::", 1)[0]

    def remove_node(self, node):
        workload = self.assigned_work.pop(node)
        unfinished = {scope: unit for scope, unit in workload.items() if not all(unit.values())}
        if not unfinished:
            return None
        # The first test not finished is the one the worker was running: xdist reports it failed, it is not rerun.
        scope, unit = next(iter(unfinished.items()))
        crashed = next(nodeid for nodeid, done in unit.items() if not done)
        unit[crashed] = True
        left = {scope: unit for scope, unit in unfinished.items() if not all(unit.values())}
        # The rest of the crashed worker's groups go first: they were due before what is still queued.
        queued = list(self.workqueue.items())
        self.workqueue.clear()
        self.workqueue.update(left)
        self.workqueue.update(queued)
        for other in list(self.assigned_work):
            self._top_up(other)
        return crashed

    def _assign_work_unit(self, node):
        # A group with nothing left to run would be sent as an empty request that never reports back.
        while self.workqueue and all(next(iter(self.workqueue.values())).values()):
            self.workqueue.popitem(last=False)
        if self.workqueue:
            super()._assign_work_unit(node)

    def _reschedule(self, node):
        if node in self.registered_collections:  # a replacement still collecting gets work when it has collected
            super()._reschedule(node)

    def _top_up(self, node):
        """Gives ``node`` work until it holds two pending tests (a worker runs a test once it knows the next one) or
        the queue is empty, when the node is told to stop after what it holds."""
        if node not in self.registered_collections or node.shutting_down:
            return
        while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()

    def schedule(self):
        if self.collection is None:
            super().schedule()
            return
        for node in self.nodes:  # a replacement worker after a crash
            self._top_up(node)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's hook: this scheduler for ``--dist loadgroup``, xdist's own for the other modes."""
    if config.getvalue("dist") == "loadgroup":
        return CrashSafeLoadGroupScheduling(config, log)
    return None
