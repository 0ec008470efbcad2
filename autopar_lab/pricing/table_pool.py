"""Solving a cost table's logical meshes in worker processes (:meth:`CostTable.solve_meshes`).

Each mesh's intra-op ILP is independent of the others, so on a machine with spare cores they run side by side. A
worker is a fresh Python (``python -m autopar_lab.pricing.table_worker``) fed over a pipe: not a
fork of the parent (which has JAX's threads) and not ``multiprocessing``'s spawn (which runs the user's script again
in every worker unless it guards itself with ``if __name__ == "__main__"``). Each worker receives the solve graph and
the cluster once, keeps its own first-pass memo and sends back per mesh only what the table keeps: the solve graph's
layer costs and, per operator, the index of the strategy chosen among its strategies on that mesh. The parent
rebuilds an IntraPlan from those indices when one is asked for (:func:`plan_from_choice`): the same strategies,
priced by the same code, so the same numbers to the bit as solving in the parent.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, BinaryIO, Generator, Iterator, Sequence

import numpy as np

from ..graph.opgraph import INPUT_PRIMITIVE, OPT_STATE, PARAM, OpGraph
from ..solve.intra import IntraOptions, IntraPlan, StrategyCache, evaluate_intra, solve_intra
from .layers import LayerCost, layer_costs

if TYPE_CHECKING:
    from ..cluster import Cluster

#: One solved mesh: (its key, the solve graph's layer costs, strategy indices in op order, seconds).
MeshResult = tuple[tuple, list[LayerCost], np.ndarray, float]

#: The third element of a mesh key asking for the mesh's memory-lean solution (:func:`lean_pins`) instead of the
#: fastest one: ``(submesh, shape)`` is the fast solution, ``(submesh, shape, LEAN)`` the lean one.
LEAN = "lean"


def mesh_key(key) -> tuple:
    """A mesh key in its canonical form: ``((n, m), (a, b))``, or with :data:`LEAN` as a third element."""
    sub, shape = (int(key[0][0]), int(key[0][1])), (int(key[1][0]), int(key[1][1]))
    return (sub, shape, LEAN) if len(key) > 2 and key[2] == LEAN else (sub, shape)


def lean_pins(graph: OpGraph, cache: StrategyCache) -> dict[int, int]:
    """The pins of a mesh's memory-lean solution: every parameter and optimizer-state input stored with its
    strategy of least bytes per device (ties: the cheaper, then the first), i.e. split over every mesh axis that a
    dimension of it can take (ZeRO-3 / FSDP storage over the data-parallel axis, on top of any tensor split).

    Why this objective: the time-only ILP keeps a layer's parameters, gradients and optimizer state (16 bytes a
    parameter in mixed precision) replicated over the data-parallel axis, and that state is what stops a large
    layer from fitting (a 1T layer is 125 GB). Storing it at its least, the ILP then picks the fastest way to compute
    around it (all-gathering a weight for its readers, FSDP, or reading it where it lies, a tensor split). A memory
    limit instead would need a budget the table cannot know (it depends on how many layers and microbatches the DP
    gives the stage) and makes the ILP one whole-graph problem; the pins keep it the per-layer problem of the fast
    solution. The stage DP then chooses per stage between the two solutions."""
    pins = {}
    for op in graph.ops:
        node = graph.op(op)
        if node.primitive != INPUT_PRIMITIVE or graph.tensor(node.outputs[0]).kind not in (PARAM, OPT_STATE):
            continue
        strats = cache.strategies(node)
        pins[op] = min(range(len(strats)), key=lambda k: (strats[k].mem_bytes, strats[k].cost, k))
    return pins


def default_workers() -> int:
    """Worker processes worth starting: the cores this process may use, at most 4 (the ILPs are small; more
    processes mostly add memory)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def solve_one(graph: OpGraph, cluster: Cluster, key, solver: str, memo: dict, cache: StrategyCache | None = None
              ) -> tuple[list[LayerCost], IntraPlan, np.ndarray]:
    """One mesh's ILP as the table solves it: (the solve graph's layer costs, the IntraPlan, strategy indices).
    A key with :data:`LEAN` gets the memory-lean solution (:func:`lean_pins`). ``cache``: a StrategyCache of this
    very mesh to share (a mesh's fast and lean solves price the same strategies and edges: a third of the lean
    solve's time); a fresh one by default. Either way the same numbers: the cache only remembers."""
    submesh, shape = key[0], key[1]
    if cache is None:
        cache = StrategyCache(cluster.logical_mesh(submesh, shape))
    mesh = cache.mesh
    pins = lean_pins(graph, cache) if len(key) > 2 and key[2] == LEAN else {}
    plan = solve_intra(graph, mesh, pins=pins, options=IntraOptions(solver=solver, rounds=1), cache=cache, memo=memo)
    costs = layer_costs(graph, plan, list(graph.layers) or [""], cache=cache)
    choice = np.empty(len(graph.ops), dtype=np.int32)  # in graph.ops order: a few KB per mesh, kept for every mesh
    for n, op in enumerate(graph.ops):
        s = plan.strategies[op]
        choice[n] = next(k for k, x in enumerate(cache.strategies(graph.op(op))) if x is s)
    return costs, plan, choice


def plan_from_choice(graph: OpGraph, cluster: Cluster, key, choice: np.ndarray) -> IntraPlan:
    """The IntraPlan of a mesh solved elsewhere (another process, another cluster with the same device and links),
    from its strategy indices (see :func:`solve_one`)."""
    submesh, shape = key[0], key[1]
    mesh = cluster.logical_mesh(submesh, shape)
    cache = StrategyCache(mesh)
    chosen = {op: cache.strategies(graph.op(op))[int(k)] for op, k in zip(graph.ops, choice)}
    return evaluate_intra(graph, mesh, chosen, ops=list(graph.ops), cache=cache)


class _Worker:
    """One worker process and the parent's thread that feeds it meshes from a shared queue."""

    def __init__(self, setup: bytes, tasks: queue.Queue, results: queue.Queue):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the parent's imports
        self.proc = subprocess.Popen([sys.executable, "-m", "autopar_lab.pricing.table_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.tasks, self.results = tasks, results
        self.thread = threading.Thread(target=self._feed, args=(setup,), daemon=True)
        self.thread.start()

    def _feed(self, setup: bytes) -> None:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(setup)
            stdin.flush()
            while True:
                batch = self.tasks.get()  # waits: the pool may be handed more meshes (MeshPool.add)
                if batch is None:  # the pool is closing
                    break
                for task in batch:  # the solutions of one mesh (see MeshPool.add): a result for each
                    pickle.dump(task, stdin)
                    stdin.flush()
                    for _ in task:
                        self.results.put(pickle.load(stdout))
        except (EOFError, OSError, pickle.UnpicklingError) as e:  # the worker died (or was stopped)
            self.results.put(RuntimeError(f"an ILP worker process stopped: {type(e).__name__}: {e}"))
            return
        finally:
            try:
                stdin.close()
            except OSError:
                pass

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def mesh_tasks(keys: Sequence) -> list[tuple]:
    """``keys`` as a worker's tasks: the solutions of one mesh asked together (its fast and lean ones) are one task,
    solved one after the other on one StrategyCache (see :func:`solve_one`), in the order first asked.

    >>> mesh_tasks([((1, 8), (1, 8)), ((1, 8), (2, 4)), ((1, 8), (1, 8), "lean")])
    [(((1, 8), (1, 8)), ((1, 8), (1, 8), 'lean')), (((1, 8), (2, 4)),)]
    """
    tasks: dict = {}
    for key in keys:
        key = mesh_key(key)
        tasks.setdefault(key[:2], []).append(key)
    return [tuple(t) for t in tasks.values()]


def longest_first(keys: Sequence) -> list[tuple]:
    """``keys`` in the order the workers should take them, longest ILP first, so that they finish together: every
    mesh with both axes split before the others (its sequential solve runs two ILP passes, the first on axis 0
    alone: DeepSeek-V3 on 256 H800 hosts, 2.2 CPU-s a two-axis mesh's fast and lean solves against 1.3 a one-axis
    one's, whatever the device count), then more devices first; the sort is stable. Which worker solves a mesh
    changes no number (each task starts a fresh StrategyCache; the memos only remember), only when it arrives.

    >>> longest_first([((1, 8), (1, 8)), ((4, 8), (1, 32)), ((1, 8), (2, 4)), ((4, 8), (4, 8))])
    [((4, 8), (4, 8)), ((1, 8), (2, 4)), ((4, 8), (1, 32)), ((1, 8), (1, 8))]
    """
    def weight(key) -> tuple[int, int]:
        shape = key[1]
        return (-(shape[0] > 1 and shape[1] > 1), -key[0][0] * key[0][1])

    return sorted(keys, key=weight)


def first_pass_batches(cluster: Cluster, keys: Sequence) -> list[list]:
    """``keys`` in batches of tasks (:func:`mesh_tasks`) that one worker solves in turn: meshes with both axes split
    whose axis 0 has the same size and link share the sequential solve's first pass (see ``memo`` in
    :func:`~autopar_lab.solve.intra.solve_intra`), which a worker remembers, so they go to the same worker and that
    pass runs once in all; every other mesh is a batch of its own. Batches keep the order of their first mesh.

    >>> from autopar_lab.cluster import Cluster
    >>> c = Cluster.preset("dgx-a100", hosts=4)   # (2, 16) on 4 hosts and (2, 8) on 2: pairs 16 and 8 devices apart
    >>> first_pass_batches(c, [((4, 8), (2, 16)), ((4, 8), (1, 32)), ((2, 8), (2, 8)), ((4, 8), (4, 8))])
    [[(((4, 8), (2, 16)),), (((2, 8), (2, 8)),)], [(((4, 8), (1, 32)),)], [(((4, 8), (4, 8)),)]]
    """
    batches: dict = {}
    for n, task in enumerate(mesh_tasks(keys)):
        sub, shape = task[0][0], task[0][1]
        group: tuple = ("alone", n)
        if shape[0] > 1 and shape[1] > 1:
            link = cluster.logical_mesh(sub, shape).axis_link(0)
            group = (shape[0], float(link.bandwidth), float(link.latency))
        batches.setdefault(group, []).append(task)
    return list(batches.values())


class MeshPool:
    """Worker processes solving a list of meshes, started at once (:meth:`CostTable.build` starts one with
    ``workers=`` so that the ILPs run while the full model is still being traced). Iterate :meth:`results` for each
    mesh's :data:`MeshResult` as a worker finishes it (in no particular order); :meth:`close` stops every worker."""

    def __init__(self, graph: OpGraph, cluster: Cluster, solver: str, keys: Sequence, workers: int):
        self.keys: list[tuple] = []
        self._cluster = cluster
        self._tasks: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._left = 0
        self.add(keys)
        setup = pickle.dumps((graph, cluster.to_dict(), solver))
        meshes = len({k[:2] for k in self.keys})
        self._pool = [_Worker(setup, self._tasks, self._results) for _ in range(max(1, min(workers, meshes)))]

    def add(self, keys: Sequence) -> None:
        """Hand the workers more meshes, after those already queued (a table queues a mesh's lean ILP as its fast
        one arrives, so the same workers go on to it: no second pool to start). :meth:`results` yields them too.
        A mesh's fast and lean keys handed over in one call are solved together (:func:`mesh_tasks`)."""
        keys = [mesh_key(k) for k in keys]
        self.keys.extend(keys)
        self._left += len(keys)
        for batch in first_pass_batches(self._cluster, keys):
            self._tasks.put(batch)

    def results(self) -> Iterator[MeshResult]:
        """Each mesh not handed out yet, as it arrives; a worker's failure is raised here."""
        while self._left:
            got = self._results.get()
            if isinstance(got, BaseException):
                self.close()
                raise got
            self._left -= 1
            yield got

    def close(self) -> None:
        self._left = 0
        for _ in self._pool:
            self._tasks.put(None)  # each feeding thread ends at its next wait for a batch
        for w in self._pool:
            w.stop()


def solve_in_workers(graph: OpGraph, cluster: Cluster, solver: str, keys: Sequence, workers: int) -> Generator[
        MeshResult, None, None]:
    """Yield each mesh's result as a worker finishes it (in no particular order). Closing the generator early (the
    caller's progress hook raised, a cancel) stops every worker at once."""
    pool = MeshPool(graph, cluster, solver, keys, workers)
    try:
        yield from pool.results()
    finally:
        pool.close()


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """A worker's loop (``python -m autopar_lab.pricing.table_worker``): the setup, then one mesh after another."""
    from ..cluster import Cluster

    graph, cluster_dict, solver = pickle.load(stdin)
    cluster = Cluster.from_json(cluster_dict)
    memo: dict[Any, Any] = {}
    while True:
        try:
            task = pickle.load(stdin)
        except EOFError:
            return
        cache = None  # one mesh's solutions share its strategies and edge matrices
        for key in task:
            t0 = time.perf_counter()
            if cache is None:
                cache = StrategyCache(cluster.logical_mesh(key[0], key[1]))
            costs, _plan, choice = solve_one(graph, cluster, key, solver, memo, cache)
            pickle.dump((key, costs, choice, time.perf_counter() - t0), stdout)
            stdout.flush()

