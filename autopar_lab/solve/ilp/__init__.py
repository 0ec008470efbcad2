"""Alpa's intra-operator pass as a generic ILP over "nodes with strategies" (OSDI'22 §4).

The problem is graph-agnostic: a node is anything with a finite list of strategies, each
with a cost (compute plus the collectives the node runs itself) and, optionally, the bytes
per device its output takes. An edge ``(u, v)`` says that ``v`` reads ``u``'s output and
carries a ``|S_u| x |S_v|`` matrix of resharding costs; ``np.inf`` marks a pair that is not
allowed (likewise an ``inf`` node cost forbids that strategy). The ILP picks one strategy per
node (one-hot ``s_v``) and one pair per edge (one-hot ``e_uv``, linked to ``s_u`` and
``s_v`` by Alpa's row/column constraints) to minimise

    sum_v s_v . c_v  +  sum_(u,v) e_uv . R_uv

subject to, for every program point ``t``, ``sum_(v live at t) s_v . mem_v <= mem_limit``.

Nothing here knows about operators, meshes or JAX; the sharding code turns an operator
graph into an :class:`IntraProblem` and reads :attr:`IntraSolution.choice` back.

Reductions done before the solver sees the model (each keeps the optimum exact):

* pinned nodes, nodes with a single strategy, and strategies that cannot be part of any
  plan (``inf`` costs, ``inf`` edge pairs with no partner left, memory rows that cannot be
  met) are removed, repeatedly, until nothing changes (arc consistency);
* an edge whose one side has a single strategy left becomes a linear term on the other
  side's ``s``; an edge whose finite matrix is additive (``R[p,q] = a[p] + b[q]``; all-zero
  matrices included) becomes two linear terms; only the remaining edges get ``e``
  variables;
* ``e`` variables are continuous in ``[0, 1]``: with ``s_u`` and ``s_v`` binary the linking
  constraints leave exactly one ``e`` at 1, so the branch-and-bound only branches on
  ``s``; one column constraint per edge is implied by the others and dropped;
* memory rows that can never bind, repeat, or are dominated by another row are dropped.

Alpa's follower merging (:func:`merge_followers`) is exposed separately, because it is a
heuristic: a merged follower takes, for each strategy of the node it follows, its locally
best strategy, which ignores what the follower's own consumers want. Measured with this
module on 400 random problems (3-7 nodes, 1-4 strategies, random DAGs with 1-2 inputs
per node, half of the nodes marked mergeable, integer costs 0-19; resharding matrices
either unstructured or "zero when the specs match, positive otherwise"; optimum by brute
force on both sides): of the 295 instances where something merged, merging lost
optimality on 61 (21%), by 10% of the optimum on average when it lost (median 7%, worst
62%); unstructured 21% / mean 8%, spec-like 21% / mean 12%. This is the "merging over-constrains the ILP" issue
Alpa's users reported, hence merges are recorded (:class:`MergeRecord`) and can be undone
by marking a node not mergeable.

The package, one job per module: :mod:`~autopar_lab.solve.ilp.problem` (the problem and solution values, their
evaluation, the errors), :mod:`~autopar_lab.solve.ilp.reference` (brute force, the reference the solvers are tested
against), :mod:`~autopar_lab.solve.ilp.reduce` (the reductions below, shared by both model builders),
:mod:`~autopar_lab.solve.ilp.pulp_model` and :mod:`~autopar_lab.solve.ilp.highs_direct` (the model built for PuLP /
CBC, and as arrays for HiGHS), :mod:`~autopar_lab.solve.ilp.backends` (:func:`solve_ilp`, :func:`solve_min_memory`),
:mod:`~autopar_lab.solve.ilp.merge` (follower merging).

Example: two nodes, each either replicated (strategy 0, costly) or split (strategy 1, cheap
but it must be resharded when the consumer is replicated):

>>> import numpy as np
>>> p = IntraProblem(node_costs=(np.array([4.0, 1.0]), np.array([4.0, 1.0])),
...                  edges=((0, 1),), edge_costs=(np.array([[0.0, 0.0], [5.0, 0.0]]),))
>>> s = solve_ilp(p)
>>> s.choice, s.objective, s.status
((1, 1), 2.0, 'optimal')
>>> brute_force(p).objective
2.0
"""

from .backends import solve_ilp, solve_min_memory
from .merge import MergeRecord, expand, merge_followers
from .problem import (
    DEFAULT_SOLVER,
    SOLVER_NAMES,
    Evaluation,
    InfeasibleError,
    IntraProblem,
    IntraSolution,
    evaluate,
    relative_gap,
)
from .reference import BRUTE_FORCE_LIMIT, brute_force

__all__ = [
    "IntraProblem",
    "IntraSolution",
    "Evaluation",
    "InfeasibleError",
    "MergeRecord",
    "solve_ilp",
    "solve_min_memory",
    "evaluate",
    "brute_force",
    "merge_followers",
    "expand",
    "relative_gap",
    "BRUTE_FORCE_LIMIT",
    "DEFAULT_SOLVER",
    "SOLVER_NAMES",
]
