"""The model's LP relaxation and its LPs with binaries fixed: through PuLP
(``_relaxation``, ``_fixed_lp``), or held in one HiGHS instance and re-solved warm
(``_HeldLP``), with rows added for a while (the count bound's regions).
"""
from __future__ import annotations

import pulp

from planner.solve.highs import quiet as _quiet_highs
from planner.solve.milp import Model
from planner.solve.outcome import Infeasible
from planner.solve.runner import _run


def _binaries(model: Model):
    """The model's binaries (PuLP stores a binary as an integer in [0, 1])."""
    return [v for v in model.prob.variables() if v.cat == pulp.LpInteger]


def _fixed_lp(model: Model, solver: str, time_limit, fixed: dict):
    """Objective and all values of ``model`` with the binaries in ``fixed`` pinned: an LP.
    ``model.lp_optimal`` says whether it was solved to optimality: an LP the time limit
    stopped has a feasible point, not a bound."""
    saved = []
    by_name = {v.name: v for v in model.prob.variables()}
    for name, val in fixed.items():
        v = by_name[name]
        saved.append((v, v.lowBound, v.upBound, v.cat))
        v.lowBound = v.upBound = val
        v.cat = pulp.LpContinuous
    try:
        model.lp_optimal = False
        try:
            status, obj, _ = _run(model, solver, time_limit, 0.0)
        except Infeasible:
            return None, None
        model.lp_optimal = status == pulp.LpSolutionOptimal
        return obj, {v.name: v.value() for v in model.prob.variables()}
    finally:
        for v, lo, up, cat in saved:
            v.lowBound, v.upBound, v.cat = lo, up, cat


def _relaxation(model: Model, solver: str, time_limit, fixed: dict):
    """The LP relaxation with the binaries in ``fixed`` pinned: (objective, values) or
    (None, None) when infeasible."""
    bins = _binaries(model)
    for v in bins:
        v.cat = pulp.LpContinuous
    try:
        obj, values = _fixed_lp(model, solver, time_limit, fixed)
    finally:
        for v in bins:
            v.cat = pulp.LpInteger
    return obj, values


# a relaxation with at least this many columns is solved first by HiGHS's interior point
# method (then crossover to a vertex), and re-solved by dual simplex from that basis: on
# models that large the first LP by simplex alone takes several times longer
IPM_MIN_COLUMNS = 8000


class _HeldLP:
    """The model's LP relaxation held in one HiGHS instance for a whole dive: binaries
    relaxed, fixings applied as bound changes, each re-solve warm-started from the last basis
    (through PuLP every LP is built and solved from scratch; a warm re-solve takes a fraction
    of that). HiGHS only; answers what ``_relaxation`` answers."""

    def __init__(self, model: Model):
        import highspy
        import numpy as np
        self.np, self.hs = np, highspy
        self.model = model
        prob = model.prob
        self.vars = prob.variables()
        self.names = [v.name for v in self.vars]
        self.col = {n: j for j, n in enumerate(self.names)}
        inf = highspy.kHighsInf
        self.lo = np.array([-inf if v.lowBound is None else v.lowBound for v in self.vars], float)
        self.up = np.array([inf if v.upBound is None else v.upBound for v in self.vars], float)
        cost = np.zeros(len(self.vars))
        for v, c in prob.objective.items():
            cost[self.col[v.name]] += c
        self.constant = float(prob.objective.constant or 0.0)
        self.cost = cost
        h = _quiet_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        n = len(self.vars)
        h.addVars(n, self.lo, self.up)
        h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
        senses = {pulp.LpConstraintLE: (-inf, 0), pulp.LpConstraintGE: (0, inf),
                  pulp.LpConstraintEQ: (0, 0)}
        cons = prob.constraints            # a list from a call in later PuLP 3.x, a dict before
        for con in (cons() if callable(cons) else cons.values()):
            idx = np.fromiter((self.col[v.name] for v in con.keys()), np.int32)
            val = np.fromiter(con.values(), float)
            rhs = -float(con.constant or 0.0)
            lo, up = senses[con.sense]
            h.addRow(rhs if lo == 0 else lo, rhs if up == 0 else up, len(idx), idx, val)
        self.rows = h.getNumRow()
        self.h = h
        self.fixed: dict = {}
        self.first = True
        self.root_basis = None      # the basis of the relaxation with nothing fixed

    def solve(self, time_limit, fixed: dict):
        """(objective, {variable name: value}) with the binaries in ``fixed`` pinned, or
        (None, None) when that is infeasible or the time limit left no point; sets
        ``model.lp_optimal``."""
        np, h = self.np, self.h
        self._release([k for k in self.fixed if k not in fixed])
        new = {k: v for k, v in fixed.items() if self.fixed.get(k) != v}
        if new:
            ids = np.fromiter((self.col[k] for k in new), np.int32)
            vals = np.fromiter((float(v) for v in new.values()), float)
            h.changeColsBounds(len(ids), ids, vals, vals)
        self.fixed = dict(fixed)
        # HiGHS's time limit counts the instance's whole run time, every earlier solve's too
        h.setOptionValue("time_limit", float("inf") if time_limit is None
                         else h.getRunTime() + max(0.05, float(time_limit)))
        big = self.first and len(self.vars) >= IPM_MIN_COLUMNS
        h.setOptionValue("solver", "ipm" if big else "simplex")
        self.first = False
        h.run()
        status = h.getModelStatus()
        ok = status == self.hs.HighsModelStatus.kOptimal
        self.model.lp_optimal = ok
        info = h.getInfo()
        if not ok and info.primal_solution_status != 2:       # 2: a feasible point
            return None, None
        values = dict(zip(self.names, h.getSolution().col_value))
        obj = float(info.objective_function_value) + self.constant
        if ok and not fixed and self.root_basis is None and h.getNumRow() == self.rows:
            self.root_basis = h.getBasis()
        return self.model.objective_value(obj), values

    def value_of(self, col_value) -> float:
        """The objective, in its own unit, of the point ``col_value`` (one value per column)."""
        return self.model.objective_value(float(self.np.dot(self.cost, col_value))
                                          + self.constant)

    def _release(self, names) -> None:
        """Give the binaries ``names`` their own bounds again (no longer fixed)."""
        if names:
            ids = self.np.fromiter((self.col[k] for k in names), self.np.int32)
            self.h.changeColsBounds(len(ids), ids, self.lo[ids], self.up[ids])

    def infeasible(self) -> bool:
        """Whether the last ``solve`` proved its LP infeasible (not merely stopped)."""
        return self.h.getModelStatus() == self.hs.HighsModelStatus.kInfeasible

    def solve_with_rows(self, rows, time_limit, basis=None):
        """``solve`` with nothing fixed and more rows, each (names, lo, up): lo <= Σ names <=
        up, taken out again afterwards; started from ``basis`` (one this returned for the
        rows but the last, the last row then basic), else from the relaxation's. Returns
        (objective, values, basis)."""
        np, h = self.np, self.h
        if self.fixed:
            self._release(list(self.fixed))
            self.fixed = {}
        start = basis if basis is not None else self.root_basis
        try:
            for names, lo, up in rows:
                ids = np.fromiter((self.col[n] for n in names), np.int32)
                h.addRow(lo, up, len(ids), ids, np.ones(len(ids)))
            if start is not None:
                # from the parent region's basis, not from whichever region was solved last
                # (the rows it was solved with taken out again, its basis is no longer one)
                b = self.hs.HighsBasis()
                b.col_status = list(start.col_status)
                b.row_status = list(start.row_status) + [self.hs.HighsBasisStatus.kBasic] * (
                    h.getNumRow() - len(start.row_status))
                b.valid = True
                h.setBasis(b)
            obj, values = self.solve(time_limit, {})
            return obj, values, (h.getBasis() if obj is not None else None)
        finally:
            n = h.getNumRow()            # every row past the model's, however this ended
            if n > self.rows:
                h.deleteRows(n - self.rows, np.arange(self.rows, n, dtype=np.int32))
