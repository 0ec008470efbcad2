"""Stage candidates as arrays: :class:`StageBlock` (every layer range of one submesh at one microbatch count, priced
by :func:`~autopar_lab.pricing.stage.stage_cost` on numpy arrays) and :class:`StageCandidates` (a table's blocks at one
microbatch count, as the stage DP reads them).

A table keeps the blocks it builds (:func:`cached_block`, up to :data:`BLOCK_CACHE_BYTES` a table), so a later search
over it at the same count and memory limit reads them again; a what-if's table (:meth:`CostTable.for_cluster`)
takes over the blocks whose every mesh carried over (:func:`carried_blocks`): at 16,384 GPUs building them was a
fifth of the stage search of a re-plan with the host count doubled.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..backends import on_cpu, one_program_share
from ..rematmode import REMAT_CHOICES
from ..solve.inter import StageCandidate
from .stage import pareto_mask, stage_cost

if TYPE_CHECKING:
    from .table import CostTable

__all__ = ["BLOCK_CACHE_BYTES", "StageBlock", "StageCandidates", "block_options", "cached_block", "carried_blocks"]

#: The most bytes of stage blocks one table keeps (Llama 3 405B's search on 2,048 hosts builds about 0.7 GB of them:
#: 13 submeshes x 12 microbatch counts); past it, blocks are built for each search and not kept.
BLOCK_CACHE_BYTES = 1 << 30

Grid = tuple[Sequence[int], Sequence[int]]


def block_options(table: CostTable, submesh, remat=REMAT_CHOICES) -> list[tuple]:
    """A submesh's options as its block lists them: (logical mesh shape, solution, remat) for every distinct shape
    (:meth:`CostTable.mesh_shapes`), every solution the table has of it (:meth:`CostTable.solutions`), every remat."""
    return [(shape, sol, r) for shape in table.mesh_shapes(submesh) for sol in table.solutions(submesh, shape)
            for r in remat]


def _key(submesh, microbatches: int, mem_limit_bytes: float | None, grid: Grid | None) -> tuple:
    g = None if grid is None else (tuple(int(a) for a in grid[0]), tuple(int(b) for b in grid[1]))
    return (int(submesh[0]), int(submesh[1])), int(microbatches), mem_limit_bytes, g


def cached_block(table: CostTable, submesh, microbatches: int, mem_limit_bytes: float | None,
                 grid: Grid | None = None) -> StageBlock:
    """The submesh's :class:`StageBlock` at this count and limit: the one the table keeps when its options are still
    the table's (a lean solution solved since adds options) and it was priced on the table's cluster, else built (and
    kept while the table's blocks stay under :data:`BLOCK_CACHE_BYTES`). A kept block holds the numbers a new one
    would: the same layer costs and formulas."""
    key = _key(submesh, microbatches, mem_limit_bytes, grid)
    kept = table.stage_blocks.get(key)
    if kept is not None and kept.cluster is table.cluster and kept.options == block_options(table, key[0]):
        return kept
    block = StageBlock(table, key[0], microbatches, mem_limit_bytes, grid=grid)
    if kept is not None:
        del table.stage_blocks[key]
    if sum(b.nbytes for b in table.stage_blocks.values()) + block.nbytes <= BLOCK_CACHE_BYTES:
        table.stage_blocks[key] = block
    return block


def carried_blocks(old: CostTable, new: CostTable) -> dict[tuple, StageBlock]:
    """The blocks of ``old`` that ``new`` (``old.for_cluster(...)``) would build the same: those of a submesh the new
    cluster plans whose every (mesh, solution) carried over (:attr:`CostTable.kept_meshes`: the same layer costs),
    each bound to ``new`` (its candidates' IntraPlans are the new table's). Only off the CPU and on the same device:
    there a block reads nothing else of the cluster (a task's overhead is the device's, once a task; no step is one
    program; no backend term). Their options are checked again when used (:func:`cached_block`)."""
    if on_cpu(old.cluster) or on_cpu(new.cluster) or old.cluster.device != new.cluster.device:
        return {}
    if one_program_share(old.cluster) is not None or one_program_share(new.cluster) is not None:
        return {}
    subs = set(new.submeshes())
    out = {}
    for key, block in old.stage_blocks.items():
        if key[0] in subs and all(old.key(block.submesh, shape, sol) in new.kept_meshes
                                  for shape, sol, _ in block.options):
            out[key] = block.bound_to(new)
    return out


class StageCandidates:
    """The stage candidates of a table at one microbatch count: callable as ``(start, end, submesh)`` (a list), and
    ``block(submesh)`` (a :class:`StageBlock`, every range at once); blocks are built on first use and kept (here, and
    by the table: :func:`cached_block`)."""

    def __init__(self, table: CostTable, microbatches: int, mem_limit_bytes: float | None,
                 grid: Grid | None = None):
        self.table, self.microbatches, self.mem_limit_bytes = table, microbatches, mem_limit_bytes
        self.grid = grid
        self._blocks: dict[tuple, StageBlock] = {}

    def block(self, submesh) -> StageBlock | None:
        """The submesh's candidates as arrays; None for a submesh outside the table's planning space."""
        sub = (int(submesh[0]), int(submesh[1]))
        if sub not in self.table.submeshes():
            return None
        if sub not in self._blocks:
            self._blocks[sub] = cached_block(self.table, sub, self.microbatches, self.mem_limit_bytes, self.grid)
        return self._blocks[sub]

    def __call__(self, start: int, end: int, submesh) -> list[StageCandidate]:
        block = self.block(submesh)
        return [] if block is None else block.candidates(start, end)


class StageBlock:
    """Every stage candidate of one submesh at one microbatch count, as arrays over (start, end) layers.

    ``keys[f][k, a, b]``: field f (forward s, backward s, static bytes, activation bytes) of the k-th (logical
    mesh, solution (:meth:`CostTable.solutions`), remat) option for layers a..b, from
    :func:`~autopar_lab.pricing.stage.stage_cost` on arrays (the same float operations as :meth:`CostTable.stage`);
    ``keep[k, a, b]``: the option is Pareto-optimal there (as :func:`pareto` decides, ties to the first) and, when
    a memory limit is given, fits in it while holding one microbatch (a candidate that cannot is never usable: a
    stage holds at least one microbatch and its memory only grows with more).

    ``grid``: (first layers, last layers) of the ranges priced, ``a`` and ``b`` then index them (``starts``,
    ``ends``; default every layer): a deep model's layer grid prices only its blocks' ranges, with the same numbers.
    """

    def __init__(self, table: CostTable, submesh, microbatches: int, mem_limit_bytes: float | None,
                 remat=REMAT_CHOICES, grid: Grid | None = None):
        L, B = len(table.layer_names), microbatches
        self.table = table
        # the cluster its numbers were priced on: a table whose cluster is swapped (a what-if, a test) builds anew
        self.cluster = table.cluster
        self.submesh: tuple[int, int] = (int(submesh[0]), int(submesh[1]))
        self.starts = np.arange(L) if grid is None else np.asarray(grid[0], dtype=np.int64)
        self.ends = np.arange(L) if grid is None else np.asarray(grid[1], dtype=np.int64)
        self.options = block_options(table, submesh, remat)
        rows, cols = self.starts, self.ends
        upper = rows[:, None] <= cols[None, :]  # start <= end
        entry = np.array([0.0] + list(table.cut_bytes), dtype=float)[:L][rows]  # bytes entering layer a
        task: Any = table.task_overhead_s(submesh)
        arrays: Any = 1.0
        if table.one_program(0, L - 1, submesh, B) and rows[0] == 0 and cols[-1] == L - 1:
            task = np.full((len(rows), len(cols)), task)
            task[0, -1] *= one_program_share(table.cluster)  # the whole step on the whole cluster: one program
            arrays = np.ones((len(rows), len(cols)))
            arrays[0, -1] = 0.0  # ... which takes its arrays once, in the update (layer costs' buffer_s)
        dims = (len(self.options), len(rows), len(cols))
        keys = [np.full(dims, np.inf) for _ in range(4)]  # (K, rows, cols) each
        totals: dict[str, np.ndarray] = {}
        for k, (shape, sol, r) in enumerate(self.options):
            if k == 0 or self.options[k - 1][:2] != (shape, sol):  # the remat options of a mesh share the sums
                totals = table.range_totals(submesh, shape, sol, rows, cols)
            costs = stage_cost(totals, entry[:, None], B, shape[0] * shape[1], r, task, arrays)
            for out, v in zip(keys, costs):
                np.copyto(out[k], np.broadcast_to(v, dims[1:]), where=upper)
        keep = np.zeros(keys[0].shape, dtype=bool)
        starts, ends = np.nonzero(upper)
        # Fitting is closed upwards under dominance (less static and activation memory sums to less, rounding
        # included), so the Pareto filter need compare only the options that fit (see pareto_mask's ``alive``).
        alive = None if mem_limit_bytes is None else \
            keys[2][:, starts, ends] + keys[3][:, starts, ends] <= mem_limit_bytes
        keep[:, starts, ends] = pareto_mask([v[:, starts, ends] for v in keys], alive)
        self.keys, self.keep = keys, keep
        # The arrays as the stage DP reads them (see solve.inter.CandidateBlock).
        self.fwd_s, self.bwd_s, self.static_bytes, self.act_bytes = keys
        self.usable = keep

    @property
    def nbytes(self) -> int:
        """The bytes of the block's arrays."""
        return sum(v.nbytes for v in self.keys) + self.keep.nbytes

    def bound_to(self, table: CostTable) -> StageBlock:
        """The same block (its arrays shared, never written) making its candidates from ``table``'s meshes."""
        out = copy.copy(self)
        out.table, out.cluster = table, table.cluster
        return out

    def make(self, k: int, row: int, col: int) -> StageCandidate:
        """Option k for layers ``starts[row]..ends[col]`` (without a grid: row..col) as a StageCandidate (its
        IntraPlan as the payload)."""
        shape, sol, r = self.options[k]
        _, plan = self.table.mesh_costs(self.submesh, shape, sol)
        f, b, st, a = (float(v[k, row, col]) for v in self.keys)
        return StageCandidate((int(self.starts[row]), int(self.ends[col])), self.submesh, shape, r, f, b, st, a,
                              payload=plan, solution=sol)

    def candidates(self, start: int, end: int) -> list[StageCandidate]:
        """The candidates for layers start..end (none for a range off the grid)."""
        row, col = np.flatnonzero(self.starts == start), np.flatnonzero(self.ends == end)
        if not row.size or not col.size:
            return []
        return [self.make(int(k), int(row[0]), int(col[0])) for k in np.flatnonzero(self.keep[:, row[0], col[0]])]
