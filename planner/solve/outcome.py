"""What one solve of a ``Model`` answers (``Outcome``), the ways it can end without one
(``Infeasible``, ``SolverFailed``, ``NoIncumbent``, ``NothingBetter``), and the relative gap
every part of the solve reports (``rel_gap``).

The reported gap is relative to the step time: the model's objective has no constant term
(every stage's duration is a variable), so the solver's own relative gap already is that.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.errors import UserError
from planner.solve.milp import Solution


class Infeasible(Exception):
    """The model has no solution under its budgets (``plan solve`` turns it into exit 3)."""


class SolverFailed(UserError):
    """The solver program itself failed (crashed, or wrote no readable solution): one strategy
    of ``plan solve`` is lost, not the solve; alone it is exit 2."""


class NoIncumbent(Exception):
    """The solver stopped (time limit) before it found any solution."""


class NothingBetter(Exception):
    """The model's LP relaxation proves that no plan of it beats the given incumbent (a plan
    from another strategy) by more than the gap: searching it would not change the answer."""


@dataclass(frozen=True)
class Outcome:
    """One solve: the solution read back and the solver's account of it."""

    solution: Solution
    solver: str
    status: str          # optimal | feasible (stopped at the time limit with a solution)
    gap: float | None    # (incumbent - bound) / incumbent
    solve_s: float
    variables: int
    constraints: int


def rel_gap(incumbent: float, bound: float) -> float:
    return max(0.0, incumbent - bound) / max(abs(incumbent), 1e-12)
