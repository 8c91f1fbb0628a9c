"""What runs beside another search: ``_Rival`` (the neighbourhood search and the count bound
beside HiGHS's search, and the plan that wins) and ``_guarded`` (a search in a child with a
hard deadline, a proof beside it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pulp

from planner.solve.milp import Model
from planner.solve.outcome import rel_gap
from planner.solve.race import _fork_available, _race
from planner.solve.relaxation import _HeldLP
from planner.solve.runner import _big_mip


@dataclass
class _Rival:
    """What runs beside HiGHS's search (``_race``): ``_rins`` from the dive's plan in a child,
    and ``_count_bound`` in this process meanwhile. Why beside and not before: where the
    dive's plan is off the best by more than the gap, the neighbourhood search finds a plan
    within it in seconds, and no bound can prove the dive's; where the plan is already within
    a hair of the best, the neighbourhood search spends its time finding nothing, and the
    count bound proves the plan in a fraction of a second. Which case holds is not known
    beforehand; either one deciding ends HiGHS's search. The dive uses one without a ``search`` beside its polish:
    ``prove`` only."""

    search: object                  # time_limit -> (values, objective in seconds)
    bound: float                    # seconds: the best bound known
    gap: float
    ts: float                       # the model's time unit
    raise_bound: object = None      # time_limit -> a bound (seconds) at least ``bound``
    plan: tuple = None              # (values, objective in seconds): the dive's plan

    def wins(self, got) -> bool:
        return rel_gap(got[1], self.bound) <= self.gap

    def prove(self, time_limit, stop=None):
        """Raise the bound (``raise_bound``, until ``stop()``); the dive's plan when that
        proves it within the gap, else None."""
        if self.raise_bound is None or self.plan is None:
            return None
        self.bound = max(self.bound, self.raise_bound(time_limit, stop))
        return self.plan if self.wins(self.plan) else None

    def merge(self, model: Model, got, other):
        """HiGHS's answer (status, solution status, values, dual bound), with the rival's
        plan in it where that is better (or HiGHS has none); None when neither has a plan."""
        if other is None:
            return got
        values, obj = other
        if got is not None and got[1] in (pulp.LpSolutionOptimal,
                                          pulp.LpSolutionIntegerFeasible):
            mine = _objective_of(model, got[2])
            if mine is not None and mine * self.ts <= obj:
                return got
            status, _, _, bound = got
        else:
            status, bound = pulp.LpStatusOptimal, -math.inf
        bound = max(bound, self.bound / self.ts)        # both bound every plan
        sol = pulp.LpSolutionOptimal if rel_gap(obj, bound * self.ts) <= self.gap \
            else pulp.LpSolutionIntegerFeasible
        return status, sol, values, bound


def _objective_of(model: Model, values: dict) -> float | None:
    """The objective, in the model's units, of the plan ``values`` holds."""
    if any(values.get(v.name) is None for v in model.prob.objective):
        return None
    return float(sum(c * values[v.name] for v, c in model.prob.objective.items())
                 + (model.prob.objective.constant or 0.0))


def _guarded(search, model: Model, held: _HeldLP, lp: dict, values: dict, obj: float,
             bound, gap: float, time_limit, prove=None):
    """``search`` (``_polish``) in a forked child with a hard deadline
    (``_in_child``) where the model is big enough to run HiGHS MIPs there
    (``CHILD_MIN_BINARIES``): a search that runs on past its limit is killed, and the plan it
    started from stands. ``prove(time_limit, poll)`` (``_Rival.prove``: the count bound), if
    given, runs in this process meanwhile (``_race``); when it proves the plan within the gap
    first, the search is killed. Returns (values, objective)."""
    def run():
        return search(model, held, lp, values, obj, bound, gap, time_limit)
    if not (_fork_available() and _big_mip(model)):
        return run()
    hard = None if time_limit is None else time_limit + max(2.0, 0.1 * time_limit)
    meanwhile = None if prove is None else (lambda poll: prove(time_limit, poll))
    try:
        got, proven = _race(run, None, hard, lambda plan: plan is not None, meanwhile, nice=0)
        got = proven if got is None else got
    except pulp.PulpSolverError:
        got = None
    return (values, obj) if got is None else got
