"""PuLP expressions from the cost model's terms (``lin``), the MILP's memory unit (``GB``) and
its time unit (``time_unit``), shared by the MILP's row builders."""
from __future__ import annotations

import math

import pulp

GB = 1e9   # the MILP counts memory in GB (its rows' coefficients stay near 1)


def lin(terms, scale: float = 1.0, constant: float = 0.0) -> pulp.LpAffineExpression:
    """A PuLP expression from cost-model terms ``(value, coef)`` where value is a variable or a
    number; repeated variables are summed (pulp's own constructor keeps the last)."""
    e = pulp.LpAffineExpression(constant=constant)
    for v, c in terms:
        if isinstance(v, (int, float)):
            e.constant += v * c * scale
        else:
            e.addterm(v, c * scale)
    return e


# below this compute floor (seconds) the model counts time in a smaller unit
SECONDS_FROM_S = 0.1


def time_unit(cm) -> float:
    """Seconds per unit of the model's time variables. The solvers' tolerances are absolute
    (1e-7 on a row): with times in seconds, a step of a few hundred microseconds lets each
    stage's row slip by a fraction of a percent of its length, and the objective comes out
    below the simulated step by as much. So a model whose compute floor is under
    ``SECONDS_FROM_S`` counts time in that floor rounded to a power of two (an exact scaling;
    a step is then 0.7-1.4 units). From 0.1 s up a row's slip is at most 1e-6 of the step and
    seconds are kept: the searches are sensitive to the scale (a step of 0.64 s counted in
    units of 0.5 s took three times as long to reach the same plan)."""
    c = cm.compute_only()
    if not (0 < c < SECONDS_FROM_S):
        return 1.0
    return 2.0 ** round(math.log2(c))
