"""One run of a solver on ``model.prob`` as it stands (``_run``): status, objective and gap;
a HiGHS MIP big enough (``CHILD_MIN_BINARIES``) runs in a forked child with a hard deadline,
with the dive's rival beside it where the dive left one.
"""
from __future__ import annotations

import math
import time

import pulp

from planner.solve.milp import Model
from planner.solve.outcome import Infeasible, SolverFailed, rel_gap
from planner.solve.progress import _cbc_gap
from planner.solve.race import _fork_available, _in_child, _race, hard_deadline
from planner.solve.sandbox import _solver_run


def _highs_in_child(model: Model, s, time_limit: float | None):
    """Run HiGHS on the MIP in a forked child (``_in_child``) with a hard deadline
    (``hard_deadline``); its dual bound, or ``None`` with the status 'no solution' when the
    deadline killed it. With a ``model.rival`` (``_Rival``, left by the dive) the rival's
    search runs beside it (``_race``) and its plan is taken where it wins or is better."""
    def run():
        model.prob.solve(s)
        bound = float(model.prob.solverModel.getInfo().mip_dual_bound)
        return (model.prob.status, model.prob.sol_status,
                {v.name: v.varValue for v in model.prob.variables()}, bound)
    hard = None if time_limit is None else hard_deadline(time_limit, model.overrun_s)
    rival, model.rival = model.rival, None          # a rival runs beside one search only
    if rival is None:
        got = _in_child(run, hard)
    else:
        # HiGHS's own RINS and RENS off: they search what the rival searches, and their
        # sub-MIPs at the root hold back HiGHS's tree, the part of its search the rival
        # does not do
        s.neighbourhoods = False
        got, other = _race(run, lambda: rival.search(time_limit), hard, rival.wins,
                           meanwhile=lambda poll: rival.prove(time_limit, poll))
        got = rival.merge(model, got, other)
    if got is None:
        model.prob.status = pulp.LpStatusNotSolved
        model.prob.sol_status = pulp.LpSolutionNoSolutionFound
        return None
    model.prob.status, model.prob.sol_status, values, bound = got
    for v in model.prob.variables():
        v.varValue = values.get(v.name)
    return bound


# a MIP with at least this many binaries runs in a child (``_highs_in_child``): forking
# costs ~20 ms with torch loaded, nothing beside a search of that size, but 3x the whole
# solve of the few-binary MIPs that exhaustive checks and small models make by the hundred
CHILD_MIN_BINARIES = 64


def _big_mip(model: Model) -> bool:
    return sum(v.cat == pulp.LpInteger for v in model.prob.variables()) >= CHILD_MIN_BINARIES


def _run(model: Model, solver, time_limit, gap, warm=False, start=None, progress=False):
    """One solve of ``model.prob`` as it stands; (status, objective, gap or None). A HiGHS
    MIP of ``CHILD_MIN_BINARIES`` or more runs in a child process with a hard deadline
    (``_highs_in_child``); LPs, small MIPs and CBC (itself a child process) run as PuLP runs
    them."""
    with _solver_run(solver, time_limit, gap, warm, start, progress,
                     model.objective_value(1.0)) as (s, log_path, cb):
        t0 = time.perf_counter()
        bound = None
        try:
            if solver == "highs" and _fork_available() and _big_mip(model):
                bound = _highs_in_child(model, s, time_limit)
            else:
                model.prob.solve(s)
                if solver == "highs":
                    bound = float(model.prob.solverModel.getInfo().mip_dual_bound)
            if time_limit is not None:      # what passing the model cost beyond the limit
                past = time.perf_counter() - t0 - time_limit
                model.overrun_s = max(model.overrun_s, min(past, 60.0))
        except KeyboardInterrupt:
            if cb is not None:
                cb.stop = True
            raise
        except pulp.PulpSolverError as e:
            raise SolverFailed(f"the {solver} solver failed ({str(e).splitlines()[0][:120]}); "
                               "try --solver highs or a larger --time-limit") from None
        status = model.prob.sol_status
        if status == pulp.LpSolutionNoSolutionFound:
            return status, None, None
        if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            raise Infeasible(pulp.LpStatus[model.prob.status])
        raw = float(pulp.value(model.prob.objective))      # in the model's units, as the
        if solver == "cbc":                                  # solvers' bounds are
            g = _cbc_gap(log_path, raw, gap)
        else:
            g = rel_gap(raw, bound) if bound is not None and math.isfinite(bound) else None
        return status, model.objective_value(raw), g
