"""The reduced ILP as a PuLP model, and running it with CBC (as Alpa) or HiGHS through PuLP (the reference for
the direct HiGHS build of :mod:`autopar_lab.solve.ilp.highs_direct`).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from .problem import SOLVER_NAMES, IntraProblem
from .reduce import pair_edges, reductions

def new_var(prob: pulp.LpProblem, name: str, lb, ub, cat) -> pulp.LpVariable:
    # PuLP >= 3.3 wants variables made through the problem (LpVariable() warns there).
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lb, ub, cat=cat)
    return pulp.LpVariable(name, lb, ub, cat)  # pragma: no cover - PuLP < 3.3


@dataclass
class PulpModel:
    prob: pulp.LpProblem
    dom: list[np.ndarray]
    x: dict[int, list]                  # node -> binary vars aligned with dom[node]
    e: list[tuple[int, int, list]]      # (u, v, [(p_idx, q_idx, var)]) in domain indices
    scale: float                        # objective divided by this before solving
    build_s: float


def build(problem: IntraProblem, *, min_memory: bool) -> PulpModel | None:
    """Build the reduced PuLP model; None when the reductions already prove infeasibility."""
    t0 = time.perf_counter()
    reduced = reductions(problem, min_memory=min_memory)
    if reduced is None:
        return None
    edges, rows, dom, scale = reduced
    limit = math.inf if min_memory else problem.mem_limit

    prob = pulp.LpProblem("intra_min_memory" if min_memory else "intra", pulp.LpMinimize)
    x: dict[int, list] = {}
    lin: dict[int, np.ndarray] = {}
    for v, d in enumerate(dom):
        if d.size > 1:
            x[v] = [new_var(prob, f"s{v}_{q}", 0, 1, pulp.LpBinary) for q in d]
            lin[v] = np.zeros(d.size) if min_memory else problem.node_costs[v][d].astype(float)
            prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression((xv, 1.0) for xv in x[v]),
                                                 pulp.LpConstraintEQ, rhs=1.0))

    obj_terms: list[tuple] = []
    e_list = []
    for u, v, r in pair_edges(edges, dom, lin, min_memory=min_memory):
        du, dv = dom[u], dom[v]
        # Alpa's e_uv, continuous (see module docstring), only on allowed pairs.
        cells = []
        rowsum: list[list] = [[] for _ in range(du.size)]
        colsum: list[list] = [[] for _ in range(dv.size)]
        for p, q in zip(*np.nonzero(np.isfinite(r))):
            var = new_var(prob, f"e{u}_{v}_{du[p]}_{dv[q]}", 0.0, 1.0, pulp.LpContinuous)
            cells.append((int(p), int(q), var))
            rowsum[p].append((var, 1.0))
            colsum[q].append((var, 1.0))
            if r[p, q] != 0.0:
                obj_terms.append((var, float(r[p, q]) / scale))
        for p in range(du.size):
            prob.addConstraint(pulp.LpConstraint(
                pulp.LpAffineExpression(rowsum[p] + [(x[u][p], -1.0)]), pulp.LpConstraintEQ, rhs=0.0))
        for q in range(dv.size - 1):  # the last column is implied by the rows and the others
            prob.addConstraint(pulp.LpConstraint(
                pulp.LpAffineExpression(colsum[q] + [(x[v][q], -1.0)]), pulp.LpConstraintEQ, rhs=0.0))
        e_list.append((u, v, cells))

    for v, c in lin.items():
        for xv, coef in zip(x[v], c):
            if coef != 0.0:
                obj_terms.append((xv, float(coef) / scale))

    if min_memory:
        mscale = max((float(vec.max()) for row in rows for vec in row.values()), default=1.0) or 1.0
        peak = new_var(prob, "peak", 0.0, None, pulp.LpContinuous)
        for row in rows:
            const = sum(float(vec[dom[v][0]]) for v, vec in row.items() if dom[v].size == 1)
            terms = [(xv, float(b) / mscale) for v, vec in row.items() if v in x
                     for xv, b in zip(x[v], vec[dom[v]]) if b != 0.0]
            if terms:
                prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms + [(peak, -1.0)]),
                                                     pulp.LpConstraintLE, rhs=-const / mscale))
        prob.setObjective(pulp.LpAffineExpression([(peak, 1.0)]))
    else:
        if math.isfinite(limit):
            for row in rows:
                const = sum(float(vec[dom[v][0]]) for v, vec in row.items() if dom[v].size == 1)
                worst = const + sum(float(vec[dom[v]].max()) for v, vec in row.items() if v in x)
                if worst <= limit:
                    continue  # can never bind
                mscale = max(limit, 1.0)
                terms = [(xv, float(b) / mscale) for v, vec in row.items() if v in x
                         for xv, b in zip(x[v], vec[dom[v]]) if b != 0.0]
                prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE,
                                                     rhs=(limit - const) / mscale))
        prob.setObjective(pulp.LpAffineExpression(obj_terms))
    return PulpModel(prob, dom, x, e_list, scale, time.perf_counter() - t0)


class _HiGHSWarm(pulp.HiGHS):
    """PuLP's highspy-API HiGHS with a MIP start.

    PuLP (3.3) offers ``warmStart`` only for its command-line solvers; the API solver
    ignores initial values. This hands the variables' initial values to
    ``Highs.setSolution`` just before the run, which HiGHS uses as its first incumbent.
    HiGHS 1.16 sometimes returns the start's columns although it found (and reports) a
    better plan; ``run`` checks for that and re-solves without the start.
    """

    def __init__(self, *args, start: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._start = start

    def callSolver(self, lp):
        if self._start:
            vs = lp.variables()
            idx = np.array([v.index for v in vs], dtype=np.int32)
            val = np.array([0.0 if v.varValue is None else float(v.varValue) for v in vs])
            lp.solverModel.setSolution(len(idx), idx, val)
        super().callSolver(lp)


def _highs_consistent(prob: pulp.LpProblem) -> bool:
    """Does the objective of the returned columns match what HiGHS says it found?"""
    try:
        reported = float(prob.solverModel.getInfo().objective_function_value)
    except Exception:  # pragma: no cover
        return True
    got = sum(c * (v.varValue or 0.0) for v, c in prob.objective.items())
    return not math.isfinite(reported) or abs(got - reported) <= 1e-7 * max(1.0, abs(reported))


_CBC_OBJ = re.compile(r"^Objective value:\s*(\S+)", re.M)
_CBC_BOUND = re.compile(r"^Lower bound:\s*(\S+)", re.M)


def run(model: PulpModel, solver: str, time_limit, warm: bool, msg: bool, rel_gap: float):
    """Solve; return (status, absolute gap in model units or None)."""
    prob = model.prob
    if solver == "cbc":
        with tempfile.TemporaryDirectory(prefix="autopar_ilp_") as d:
            log = os.path.join(d, "cbc.log")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # PULP_CBC_CMD's deprecation notice
                cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, warmStart=warm, gapRel=rel_gap,
                                        logPath=log)
            prob.solve(cmd)
            text = open(log).read() if os.path.exists(log) else ""
        if msg:
            print(text)
        # PuLP reads CBC's solution file but not its bound; the log has both figures.
        mo, mb = _CBC_OBJ.search(text), _CBC_BOUND.search(text)
        absgap = float(mo.group(1)) - float(mb.group(1)) if mo and mb else None
    elif solver == "highs-pulp":
        cmd = _HiGHSWarm(msg=msg, timeLimit=time_limit, gapRel=rel_gap, gapAbs=0.0, start=warm)
        prob.solve(cmd)
        if warm and not _highs_consistent(prob):
            # HiGHS 1.16 can hand back the MIP start's columns while reporting a better
            # incumbent (seen when presolve fixes columns of the start). Solve again, cold.
            cmd = _HiGHSWarm(msg=msg, timeLimit=time_limit, gapRel=rel_gap, gapAbs=0.0, start=False)
            prob.solve(cmd)
        try:
            info = prob.solverModel.getInfo()
            absgap = float(info.objective_function_value) - float(info.mip_dual_bound)
            if not math.isfinite(absgap):
                absgap = None
        except Exception:  # pragma: no cover - older highspy
            absgap = None
    else:
        raise ValueError(f"solver must be one of {SOLVER_NAMES}, got {solver!r}")
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal", 0.0
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "time_limit", absgap
    if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible", None
    return "no_solution", None


def read_choice(model: PulpModel) -> tuple[int, ...]:
    choice = []
    for v, d in enumerate(model.dom):
        if v in model.x:
            vals = [xv.varValue or 0.0 for xv in model.x[v]]
            choice.append(int(d[int(np.argmax(vals))]))  # argmax: lowest index on ties
        else:
            choice.append(int(d[0]))
    return tuple(choice)


def set_start(model: PulpModel, start: tuple[int, ...]) -> bool:
    """Give every variable its value under ``start``; False if start is outside the model."""
    pos = {}
    for v, d in enumerate(model.dom):
        hit = np.flatnonzero(d == start[v])
        if hit.size == 0:
            return False
        pos[v] = int(hit[0])
    for v, xs in model.x.items():
        for i, xv in enumerate(xs):
            xv.setInitialValue(1.0 if i == pos[v] else 0.0)
    for u, v, cells in model.e:
        for p, q, var in cells:
            var.setInitialValue(1.0 if (p, q) == (pos[u], pos[v]) else 0.0)
    return True
