"""Solving one ``Model`` (``solve``): the dive, then the solver's search where the dive's plan
is not proven within the gap, then phase two; the time limit shared out between them.

The parts, one module each (all under ``planner.solve``):

- ``outcome``: ``Outcome``, the exceptions a solve ends with, ``rel_gap``;
- ``backends``: ``make_solver``, the one place a solver (CBC or HiGHS) is made;
- ``sandbox``: the run around a solver: its temporary files and child processes, cleaned up
  on every path;
- ``progress``: progress lines and gaps from CBC's log and HiGHS's callback;
- ``race``: functions in forked children with hard deadlines, and races between them;
- ``runner``: one solver run on the model as it stands (``_run``);
- ``relaxation``: the LP relaxation, through PuLP or held in one HiGHS instance;
- ``rounding``: whole choices from the relaxation's fractional ones;
- ``bound``: the count bound, above the relaxation's;
- ``neighbourhood``: the polish and the relaxation-induced neighbourhood search;
- ``rival``: searches run beside others;
- ``dive``: the LP dive, a bound and a first plan;
- ``settle``: phase two, the shares placed to hold the least memory.

The rest of the planner imports from here: ``solve``, the exceptions and ``highs_available``.
"""
from __future__ import annotations

import math
import time

import pulp

from planner.solve.backends import SOLVERS, make_solver
from planner.solve.dive import _dive
from planner.solve.highs import available as highs_available
from planner.solve.milp import Model
from planner.solve.outcome import (Infeasible, NoIncumbent, NothingBetter, Outcome,
                                   SolverFailed, rel_gap)
from planner.solve.race import hard_deadline
from planner.solve.relaxation import IPM_MIN_COLUMNS
from planner.solve.runner import _run
from planner.solve.settle import _settle

__all__ = ["SOLVERS", "Infeasible", "NoIncumbent", "NothingBetter", "Outcome", "SolverFailed",
           "hard_deadline", "highs_available", "make_solver", "rel_gap", "solve"]


# rows handed to a solver per second, beyond its own time limit: the first guess of a run's
# overrun before one has been measured (a joint MILP of ~8,600 rows takes ~2 s to hand over)
PASS_ROWS_PER_S = 4000


def _proven(obj: float, bound: float | None, gap: float) -> bool:
    """Whether a plan of objective ``obj`` is proven within ``gap`` of the relaxation's
    ``bound``. One below the bound proves nothing: its objective was misread (a solver's
    report of a point, not the point's own value), and the search goes on."""
    return bound is not None and obj >= bound - 1e-4 * max(abs(bound), 1e-9) and \
        rel_gap(obj, bound) <= gap


def solve(model: Model, solver: str = "highs", time_limit: float | None = 60.0,
          gap: float = 0.005, warm=None, progress: bool = False,
          incumbent: float | None = None) -> Outcome:
    """Solve ``model``; raise ``Infeasible`` when nothing fits, ``NoIncumbent`` when the time
    limit ends the search before a solution.

    First ``_dive`` (a few LPs): when its plan is within ``gap`` of the LP's bound
    it is the answer, proven; otherwise it starts the full search (with ``warm``,
    a list of decisions such as the best baseline's, as the start where it has none).
    With ``incumbent`` (the step of the best plan another strategy has), raise
    ``NothingBetter`` as soon as the LP relaxation's bound shows that no plan of this model
    beats it by more than ``gap``."""
    if model.violated:
        raise Infeasible(f"constant rows violated: {', '.join(model.violated[:3])}")
    t0 = time.perf_counter()
    # A solver's own time limit does not count handing it the model (PuLP passes or writes
    # every row first), which on a large model takes seconds per run: that much is kept back
    # from each run's limit, so that the runs together end within --time-limit. The first
    # guess is by size, later ones what the runs took beyond their limits.
    model.overrun_s = max(model.overrun_s, model.prob.numConstraints() / PASS_ROWS_PER_S)

    def left(share=1.0):
        if time_limit is None:
            return None
        # 1.5x: a run with a start to pass overruns by more than one without
        return max(0.5, (time_limit - (time.perf_counter() - t0) - 1.5 * model.overrun_s) * share)

    # the dive's share of the time: at IPM_MIN_COLUMNS and more, HiGHS's own search finds
    # nothing in the time plan solve has (its root LP by simplex alone takes minutes), so the
    # dive, which gives the plan there, gets most of it
    big = len(model.prob.variables()) >= IPM_MIN_COLUMNS
    bound, start, obj = _dive(model, solver, left(0.8 if big else 0.3), gap, incumbent,
                              polish_limit=left(0.5))
    if start is not None and _proven(obj, bound, gap):
        for v in model.prob.variables():
            v.varValue = start.get(v.name, v.varValue)
        status, g = "optimal", rel_gap(obj, bound)
    else:
        dived = start is not None           # the dive's rounded plan: complete, shares and all
        if start is None and warm:
            use = model.warm_start(warm)
            start = {v.name: v.varValue for v in model.prob.variables()} if use else None
        elif start is not None:
            for v in model.prob.variables():
                x = start.get(v.name, 0.0) or 0.0
                lo = -math.inf if v.lowBound is None else v.lowBound
                up = math.inf if v.upBound is None else v.upBound
                v.setInitialValue(min(max(x, lo), up))
        # HiGHS gets only a complete start (the dive's): a partial one (a baseline's choices
        # without its shares) it completes in a sub-search that can run far past its limit
        st, obj2, g = _run(model, solver, left(), gap, warm=start is not None,
                           start=start if (solver == "highs" and dived) else None,
                           progress=progress)
        if (st == pulp.LpSolutionOptimal and start is not None and g is not None and g > gap
                and bound is not None and obj2 is not None and rel_gap(obj2, bound) > gap):
            # HiGHS can return the start as "optimal" though the relaxation bounds the
            # objective more than the gap below it: search again without the start
            st, obj2, g = _run(model, solver, left(), gap, progress=progress)
        if obj2 is None:
            if not dived:
                # nothing but the warm start (a baseline's decisions, whose transfer shares the
                # model does not set): that baseline is already a candidate of plan solve
                raise NoIncumbent(f"{solver} found no solution within {time_limit} s")
            for v in model.prob.variables():
                v.varValue = start.get(v.name, v.varValue)
            status = "feasible"
            g = rel_gap(obj, bound) if bound is not None else None
        else:
            status = "optimal" if st == pulp.LpSolutionOptimal else "feasible"
            if bound is not None and g is not None:
                g = min(g, rel_gap(obj2, bound))
    model.rival = None              # not run (no search followed the dive): let it go
    _settle(model, solver, left())
    sol = model.solution()
    return Outcome(solution=sol, solver=solver, status=status, gap=g,
                   solve_s=time.perf_counter() - t0, variables=len(model.prob.variables()),
                   constraints=model.prob.numConstraints())
