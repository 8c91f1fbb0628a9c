"""Phase two of a time-minimising solve (``_settle``): the decisions and the stages'
durations held, the transfer shares placed so that the least device memory is held longest.
"""
from __future__ import annotations

from planner.solve.milp import GB, Model, lin
from planner.solve.outcome import SolverFailed
from planner.solve.relaxation import _binaries, _fixed_lp


def _settle(model: Model, solver: str, time_limit) -> None:
    """Phase two of a time-minimising solve: with the chosen decisions and every stage's
    duration held, the LP that places the transfer shares so that the least device memory is
    held longest (``CostModel.held_longer``: sends as early, fetches as late as the stages'
    durations allow). The objective's own tie-break on it is too small to survive the
    solvers' tolerances and gaps (1e-8 s against a 0.5% gap), so it is settled here on its
    own scale. The step cannot rise (each stage keeps its duration); if the LP fails, the
    solution stands as it was."""
    if model.opt.minimise != "time":
        return
    held = model.cm.held_longer(model.v)
    if not held or (time_limit is not None and time_limit < 1.0):
        return
    values = {v.name: v.varValue for v in model.prob.variables()}
    fixed = {v.name: round(v.varValue or 0.0) for v in _binaries(model)}
    durations = [*model.T.values(), *model.T2.values(), model.To]
    bounds = [(v, v.upBound) for v in durations]
    objective = model.prob.objective
    try:
        for v in durations:
            v.upBound = (v.varValue or 0.0) * (1 + 1e-9) + 1e-12
        model.prob.setObjective(lin(held, 1 / GB))
        try:
            obj, got = _fixed_lp(model, solver, time_limit, fixed)
        except SolverFailed:
            obj = got = None
        if obj is None:             # infeasible, or stopped with no point: values unusable
            got = None
    finally:
        for v, up in bounds:
            v.upBound = up
        model.prob.setObjective(objective)
    for v in model.prob.variables():
        v.varValue = (got or values).get(v.name, values.get(v.name))
